"""The built-in `latency-aware` strategy: windowed-fifo with a wider collection window, a quiet tail in each step and a depth fitted to what the trainer takes and the engines run."""
from __future__ import annotations

from typing import Any, Mapping, Sequence

from .builtin_strategies import WindowedFifoStrategy
from .settings import Key, lookup, read_options, setting
from .strategy import SlidingWindowStrategy, register_sliding_window_strategy
from .types import TrajectoryStatus


def _group_size(config: Any) -> int:
    """N of the first data source; a bare config without it (built outside a pacer) gets the default, 8."""
    value = lookup(config.data_sources[0], "num_trajectories_per_prompt")
    return int(value) if value is not None else setting({}, "data_source.num_trajectories_per_prompt")


@register_sliding_window_strategy("latency-aware")
class LatencyAwareStrategy(WindowedFifoStrategy):
    """Windowed-fifo with three changes that use the step's progress and the buffer.

    Quiet tail: once `quiet_after x B` groups have been consumed in the step, admit nothing new until the
    next Resume, except what the rest of the step still needs (B - consumed - R - Q, so a quiet tail can
    never starve the trainer). A group started in that tail runs on weights about to be replaced: with
    partial rollout (ABORT) it is aborted moments later and continued on the next weights, one version
    staler and with its first tokens masked; in WAIT mode the step boundary waits for it.

    Collection window: collect a complete group only within `collect_window x B` seqs of the oldest
    in-flight one (windowed-fifo: exactly B; no-window: unbounded). Wider than B, the trainer is not held
    up behind one slow group at the head; bounded, the old long groups are still consumed before the new
    short ones, instead of running on across boundaries (aborted, re-prefilled, masked) as they do with
    no-window.

    Depth (the `R + Q` the strategy admits up to, at most C), adjusted at each Resume:
    - groups the buffer holds beyond the next step's B were not needed in the step that made them (in
      WAIT mode every group still running then held the boundary; in either mode a buffered group is one
      version staler after it): the depth shrinks by half that surplus;
    - with partial rollout (ABORT) the boundary shows which dispatched trajectories never generated a
      token in the step (aborted with no more tokens than at the boundary before): they waited behind
      the engines' own concurrency limit, and only split their groups across versions. At such a
      boundary the trajectories that did generate are what the engines run at once, and a trajectory
      dispatched beyond that many plus one step's B x N cannot start before the engines have done a
      step's work: the depth never again exceeds that many groups plus B (the most seen, if several);
    - with neither surplus and fewer groups buffered than one trainer fetch, the next step would start
      waiting: the depth grows by one fetch. Never below B.
    Options (`fully_async.latency_aware`): `quiet_after` in (0, 1], default 0.75; `collect_window` >= 1,
    default 1.5; `adaptive_depth`, default true (false: the depth stays C).
    """

    ordered_gate = True  # refuses aborted groups; otherwise a window from the oldest in-flight seq
    # Under fully_async.latency_aware; validated at start-up with the service's own keys (settings.py).
    options = (
        Key("quiet_after", "number", 0.75, "Go quiet once this share of B has been consumed in the step",
            above=0, high=1, allowed="must be a number in (0, 1]"),
        Key("collect_window", "number", 1.5, "Collect only within this many B of seqs from the oldest in flight",
            low=1, allowed="must be a number >= 1 (in units of B)"),
        Key("adaptive_depth", "bool", True, "Resize the depth at each Resume (false: it stays C)"),
    )

    def __init__(self, config: Any):
        super().__init__(config)
        options = read_options(config, "fully_async.latency_aware", self.options)
        self._quiet_at = max(1, int(round(options["quiet_after"] * self._batch_size)))
        self._collect_window = max(1, int(round(options["collect_window"] * self._batch_size)))
        self._adaptive_depth = options["adaptive_depth"]
        self._consumed_in_step = 0
        self.quiet_since: float | None = None  # pacer-clock time the current quiet tail began (for metrics)
        self.depth = self._capacity  # R + Q admitted up to (<= C)
        self._fetch_groups = 1  # groups per trainer fetch, as seen in on_consumed
        self._group_size = _group_size(config)
        self._tokens_at_boundary: dict[str, int] = {}  # trajectory id -> tokens when last aborted
        self._aborted_now: dict[str, int] = {}  # the same, for the boundary in progress
        self._idle_at_boundary = 0  # aborted in this boundary without a token since the last one
        self._generating_at_boundary = 0  # aborted in this boundary with new tokens
        self.engine_concurrency = 0  # most trajectories seen generating at one boundary

    def compute_dispatch_count(self, buf_qsize: int) -> int:
        if self._consumed_in_step >= self._quiet_at:
            still_needed = self._batch_size - self._consumed_in_step - self._running_count - buf_qsize
            return max(0, min(still_needed, self._free_slots(buf_qsize)))
        return max(0, self.depth - self._running_count - buf_qsize)  # depth <= C (on_resume keeps it there)

    def will_collect(self, group: Mapping[str, Any]) -> bool:
        if not SlidingWindowStrategy.will_collect(self, group):  # no aborted trajectory in it
            return False
        prompt_id = next(iter(group.values())).prompt_id
        return self._seqs.seq_of(prompt_id) - self._seqs.min_seq() < self._collect_window

    def on_consumed(self, groups: Sequence[Any]) -> None:
        self._fetch_groups = max(self._fetch_groups, len(groups))
        self._consumed_in_step += len(groups)
        if self._consumed_in_step >= self._quiet_at and self.quiet_since is None:
            self.quiet_since = self.now()

    def on_submitted(self, trajectory: Any) -> None:
        # `num_tokens` is the whole response so far, so an aborted one that did not grow never ran.
        if trajectory.status is not TrajectoryStatus.ABORTED:
            return
        tokens = int(trajectory.num_tokens)
        if tokens > self._tokens_at_boundary.get(trajectory.trajectory_id, 0):
            self._generating_at_boundary += 1
        else:
            self._idle_at_boundary += 1
        self._aborted_now[trajectory.trajectory_id] = tokens

    # What the strategy learned over past steps, kept across a restart (the snapshot is taken at a step
    # boundary; the calls after it are replayed through the hooks).
    _LEARNED = ("depth", "engine_concurrency", "_fetch_groups", "_consumed_in_step", "_tokens_at_boundary",
                "_aborted_now", "_idle_at_boundary", "_generating_at_boundary")

    def state(self) -> dict:
        learned = {name.lstrip("_"): getattr(self, name) for name in self._LEARNED}
        for name in ("tokens_at_boundary", "aborted_now"):
            learned[name] = dict(learned[name])
        learned["quiet"] = self.quiet_since is not None
        return learned

    def restore(self, state: dict) -> None:
        for name in self._LEARNED:
            key = name.lstrip("_")
            if key in state:
                value = state[key]
                setattr(self, name, dict(value) if isinstance(value, dict) else int(value))
        self.depth = min(self.depth, self._capacity)
        # The quiet tail's start is a time on the last process's clock: restart it on this one.
        self.quiet_since = self.now() if state.get("quiet") else None

    def on_resume(self, weight_version: int) -> None:
        if self._adaptive_depth:
            surplus = (len(self.buffer) - self._batch_size) // 2
            if surplus > 0:
                change = -surplus
            elif len(self.buffer) < self._fetch_groups:  # the next step's first fetch will wait
                change = self._fetch_groups
            else:
                change = 0
            if self._idle_at_boundary:  # some waited, so the engines ran all they could
                self.engine_concurrency = max(self.engine_concurrency, self._generating_at_boundary)
            ceiling = self._capacity
            if self.engine_concurrency:
                ceiling = min(ceiling, -(-self.engine_concurrency // self._group_size) + self._batch_size)
            self.depth = max(self._batch_size, min(ceiling, self.depth + change))
        # Only this boundary's aborted trajectories can come back aborted at the next one.
        self._tokens_at_boundary, self._aborted_now = self._aborted_now, {}
        self._idle_at_boundary = self._generating_at_boundary = 0
        self._consumed_in_step = 0
        self.quiet_since = None
