"""The Pacer: dispatch, submit, collect, reset and resume over one strategy, trajectory queue and buffer."""
from __future__ import annotations

import heapq
import math
import threading
import time
from collections import OrderedDict, deque
from operator import attrgetter
from types import MappingProxyType
from typing import Any, Callable, Iterable, Mapping, Optional, Sequence

from .config import config_summary
from .errors import (
    InvalidArgumentError,
    LeaseExpiredError,
    RecoveryError,
    ResetInProgressError,
    ResourceExhaustedError,
    ShuttingDownError,
    StaleGenerationError,
    UnknownLeaseError,
    UnknownPromptError,
)
from .filters import GroupFilter, create_filters
from .strategy import ThreadSafeStrategy, create_strategy, gate_is_ordered, window_size
from .types import (
    CollectResult,
    ControlEvent,
    ControlEventType,
    DispatchResult,
    PacerState,
    PromptRef,
    ResetMode,
    ResetResult,
    ResumeResult,
    StepReport,
    SubmitResult,
    Trajectory,
    TrajectoryGroup,
    TrajectoryStatus,
)

VALID_STATUSES = (TrajectoryStatus.COMPLETED, TrajectoryStatus.FAILED, TrajectoryStatus.ABORTED)
ANSWERED_METHODS = ("Dispatch", "Submit", "Collect", "Reset", "Resume", "Ack")
RESOURCE_RETRY_SECONDS = 1.0
DATA_ANSWERS_KEPT = 16  # each is in every snapshot: enough for retries, small enough to write
# Request ids (client-made, e.g. UUIDs) and lease ids (server-made) may always be this long, whatever max_id_length.
OPAQUE_ID_MIN_LIMIT = 128
SNAPSHOT_FORMAT = 2  # 2: DispatchResult keeps admitted prompt ids and the first seq
_NO_PRIORITY = float("inf")


class InflightGroup:
    """A dispatched group that has not left the trajectory queue; handed to strategy hooks."""

    __slots__ = ("prompt_id", "ds_index", "epoch", "index", "seq", "group_size", "trajectories", "deadline",
                 "dispatched_at", "held")

    def __init__(self, ref: PromptRef, seq: int, group_size: int, now: float):
        self.prompt_id = ref.prompt_id
        self.ds_index = ref.ds_index
        self.epoch = ref.epoch
        self.index = ref.index
        self.seq = seq
        self.group_size = group_size
        self.trajectories: dict[str, Trajectory] = {}
        self.dispatched_at = now
        self.held = False  # complete, but the strategy's will_collect refused it so far
        self.deadline = math.inf  # when its in-flight lease runs out (extended by every Submit for it)

    @property
    def complete(self) -> bool:
        return len(self.trajectories) >= self.group_size

    def priority(self) -> tuple:
        """Buffer order: the prompt's (epoch, index) when the dispatcher gave both, else dispatch seq."""
        if self.epoch is not None and self.index is not None:
            return (self.epoch, self.index, self.seq)
        return (_NO_PRIORITY, _NO_PRIORITY, self.seq)

    def to_group(self) -> TrajectoryGroup:
        return TrajectoryGroup(self.prompt_id, self.seq, self.ds_index, list(self.trajectories.values()),
                               self.epoch, self.index, self.dispatched_at)


class _StepTally:
    """What the trainer took since the last Reset, for the step report."""

    def __init__(self) -> None:
        self.trajectories = 0
        self.partial = 0
        self.span_max = 0
        self.filtered = 0

    def count_consumed(self, group: TrajectoryGroup) -> None:
        for t in group.trajectories:
            span = t.end_weight_version - t.start_weight_version
            self.trajectories += 1
            if span != 0:
                self.partial += 1
            self.span_max = max(self.span_max, span)


class CollectLease:
    """Groups handed to the trainer that go back to the buffer unless acknowledged before `deadline`."""

    __slots__ = ("lease_id", "entries", "seconds", "deadline")

    def __init__(self, lease_id: str, entries: list, seconds: float, deadline: float):
        self.lease_id = lease_id
        self.entries = entries  # (priority, group) as they were in the buffer, so redelivery keeps the order
        self.seconds = seconds
        self.deadline = deadline


class Pacer:
    """Thread-safe pacing state machine; every operation is atomic under one lock.

    Waiting operations take a bound (`wait` seconds). Asyncio servers call them with wait=0 and do
    their waiting in `AsyncPacer`, woken by `add_change_listener` callbacks.
    """

    def __init__(
        self,
        config: Any,
        *,
        strategy: Optional[ThreadSafeStrategy] = None,
        filters: Optional[list[GroupFilter]] = None,
        clock: Callable[[], float] = time.monotonic,
        journal: Optional[Any] = None,
    ):
        self.config = config
        self._clock = clock
        # Where acknowledged changes are recorded (see journal.py); None keeps state in memory only.
        self._journal = journal
        self.last_ticket = 0  # journal ticket of the latest recorded change
        self._strategy = strategy if strategy is not None else create_strategy(config)
        # The pacer's lock is the strategy proxy's lock, so holding it is holding both, as every hook requires;
        # the pacer then calls the strategy itself, without the proxy taking the same lock again on every call.
        proxied = isinstance(self._strategy, ThreadSafeStrategy)
        self._hooks = self._strategy.wrapped if proxied else self._strategy
        # With an ordered gate, a re-examination pass stops at the first refusal (see SlidingWindowStrategy).
        self._ordered_gate = gate_is_ordered(self._hooks)
        self._filters = filters if filters is not None else create_filters(list(config.rollout.filter), config)
        self._group_sizes = [int(s.num_trajectories_per_prompt) for s in config.data_sources]
        self._window_size = window_size(config)
        server = config.get("server") or {}
        self._max_id_length = int(server.get("max_id_length", 512))
        # Request and lease ids: like prompt ids, but never refused below 128 characters (a UUID must fit).
        self._max_opaque_id_length = max(self._max_id_length, OPAQUE_ID_MIN_LIMIT)
        self._max_candidates = int(server.get("max_dispatch_candidates", 65536))
        self._max_trajectories = int(server.get("max_submit_trajectories", 65536))
        self._max_collect = int(server.get("max_collect_groups", 65536))
        self._default_mode = ResetMode.ABORT if bool(config.rollout.get("partial", True)) else ResetMode.WAIT
        self._summary = config_summary(config)

        self._lock = self._strategy.lock if proxied else threading.RLock()
        self._changed = threading.Condition(self._lock)
        self._blocked_threads = 0  # threads in a blocking call's wait on _changed (embedding without asyncio)
        self._change_listeners: list[Callable[[], None]] = []
        self._control_listeners: list[Callable[[ControlEvent], None]] = []
        self._consume_listeners: list[Callable[[list[TrajectoryGroup], int, float], None]] = []

        self._inflight: dict[str, InflightGroup] = {}
        self._held: list[tuple[int, str]] = []  # heap of (seq, prompt_id); stale entries skipped lazily
        self._complete_inflight = 0
        self._queued_trajectories = 0
        self._buffer: list[tuple[tuple, TrajectoryGroup]] = []  # heap by priority
        self._accepted: dict[str, Trajectory] = {}  # this generation's accepted trajectories, by id
        self._generation_prompts: set[str] = set()
        self._past_generation_prompts: deque[set[str]] = deque(maxlen=int(server.get("remembered_generations", 16)))
        self._next_seq = 0
        self._strategy_touched = False

        self.step = 0
        self.weight_version = 0
        self.generation = 0
        self.paused = False
        self.resetting = False
        self.closed = False
        self._pause_started: Optional[float] = None
        self._reset_ready_at: Optional[float] = None
        self._tally = _StepTally()
        self._reports: deque[StepReport] = deque(maxlen=int(server.get("step_reports_kept", 32)))
        self.totals = dict.fromkeys(
            ("dispatched", "submitted", "collected", "consumed", "filtered", "restored", "dropped",
             "stale_rejected", "duplicates", "expired", "redelivered"), 0)
        # Answers of recent mutating calls by request_id, so a retry gets the first answer (and,
        # being part of the state, this survives a restart). Answers carrying trajectories are big:
        # fewer of them are kept.
        answers_kept = int(server.get("request_id_cache_size", 65536))
        self._inflight_lease = float(server.get("inflight_lease_seconds", 0) or 0)
        # (deadline, seq of the first, prompt ids): one entry per call that started or extended leases; an id whose
        # group has another deadline by now is skipped lazily.
        self._lease_heap: list[tuple[float, int, list[str]]] = []
        self._expired_groups: list[TrajectoryGroup] = []  # reclaimed this generation; the next Reset returns them
        self._expired_prompts: set[str] = set()
        self._leases: dict[str, CollectLease] = {}  # Collect leases awaiting Ack, by lease id
        self._lease_serial = 0
        self._lapsed_leases: deque[str] = deque(maxlen=4096)  # recently expired lease ids, for a clear Ack error
        self._max_buffered = int(server.get("max_buffered_groups", 0) or 0)
        self._max_bytes = int(server.get("max_held_bytes", 0) or 0)
        self._held_bytes = 0  # bytes of trajectories queued, buffered or leased
        self._answers: dict[str, OrderedDict] = {method: OrderedDict() for method in ANSWERED_METHODS}
        self._answer_limits = {method: answers_kept for method in ANSWERED_METHODS}
        self._answer_limits.update({method: min(answers_kept, DATA_ANSWERS_KEPT) for method in ("Collect", "Reset")})

    # ----------------------------------------------------------------- listeners

    def add_change_listener(self, callback: Callable[[], None]) -> None:
        """`callback()` runs (under the lock, so it must be quick) after every state change."""
        with self._lock:
            self._change_listeners.append(callback)

    def add_control_listener(self, callback: Callable[[ControlEvent], None]) -> None:
        """`callback(event)` runs for every PAUSE / RESUME / SHUTDOWN, in order, under the lock."""
        with self._lock:
            self._control_listeners.append(callback)

    def add_consume_listener(self, callback: Callable[[list[TrajectoryGroup], int, float], None]) -> None:
        """`callback(groups, weight_version, now)` runs (under the lock, so it must be quick) when the trainer
        takes groups; `now` is the pacer clock, the clock of `TrajectoryGroup.dispatched_at` (for metrics)."""
        with self._lock:
            self._consume_listeners.append(callback)

    def _wait_for_change(self, timeout: float) -> None:
        """Block this thread (holding the lock) until the next change or `timeout` seconds."""
        self._blocked_threads += 1
        try:
            self._changed.wait(timeout)
        finally:
            self._blocked_threads -= 1

    def _notify(self) -> None:
        if self._blocked_threads:  # notify_all is Python code under the hood: skip it when nobody waits
            self._changed.notify_all()
        for callback in self._change_listeners:
            callback()

    def _emit(self, kind: ControlEventType, mode: ResetMode = ResetMode.UNSPECIFIED) -> None:
        event = self._control_event(kind, mode)
        for callback in self._control_listeners:
            callback(event)

    def _control_event(self, kind: ControlEventType, mode: ResetMode = ResetMode.UNSPECIFIED) -> ControlEvent:
        return ControlEvent(kind, mode, self.weight_version, self.step, self.generation, self.paused)

    def current_state_event(self) -> ControlEvent:
        """The STATE event a new watcher receives first."""
        with self._lock:
            return self._control_event(ControlEventType.STATE)

    # ----------------------------------------------------------------- dispatch

    def dispatch(self, candidates: Sequence[PromptRef], wait: float = 0.0, request_id: str = "") -> DispatchResult:
        """Admit the first k candidates the strategy allows now; with `wait`, wait up to that long for one slot."""
        deadline = self._clock() + max(0.0, wait)
        with self._lock:
            answered = self._answers["Dispatch"].get(request_id)
            if answered is not None:
                return answered
            self._check_open()
            while True:
                # A waiter woken by close() answers at once, admitting nothing.
                result = self._dispatch_locked([] if self.closed else candidates, request_id)
                if result.admitted_ids or not candidates or self.closed:
                    return result
                remaining = deadline - self._clock()
                if remaining <= 0:
                    return result
                self._wait_for_change(remaining)

    def _dispatch_locked(self, candidates: Sequence[PromptRef], request_id: str = "") -> DispatchResult:
        if candidates:  # none is a peek at the window
            self._validate_candidates(candidates)
        allowed = self._admissible_now()
        count = min(allowed, len(candidates))
        first_seq = self._next_seq
        admitted_ids: list[str] = []
        if count:
            now = self._clock()
            admitted_refs = list(candidates[:count])  # also the journal's record of this Dispatch
            group_sizes = self._group_sizes
            groups = [InflightGroup(ref, seq, group_sizes[ref.ds_index], now)
                      for seq, ref in enumerate(admitted_refs, first_seq)]
            # The strategy hears first: if a custom strategy raises, the pacer is unchanged.
            self._hooks.on_dispatched(groups)
            self._next_seq += count
            inflight, generation_prompts = self._inflight, self._generation_prompts
            for group in groups:
                inflight[group.prompt_id] = group
                generation_prompts.add(group.prompt_id)
                admitted_ids.append(group.prompt_id)
            self._extend_leases(groups, now)
            self.totals["dispatched"] += count
            self._strategy_touched = True
            self._release_held()
            self._notify()
        # Positional: a keyword call to a dataclass builds a kwargs dict and costs about twice as much.
        result = DispatchResult(admitted_ids, first_seq, self.paused, self.step, self.weight_version, self.generation,
                                len(self._inflight), len(self._buffer), self._window_size,
                                self._admissible_now() if count else allowed)  # unchanged if nothing was admitted
        if count:
            self._record(("dispatch", now, admitted_refs, request_id))
            self._remember("Dispatch", request_id, result)
        return result

    def admissible_now(self) -> int:
        """What a Dispatch would admit now (0 while paused or closed); cheap, unlike re-validating candidates."""
        with self._lock:
            return self._admissible_now()

    def _admissible_now(self) -> int:
        if self.paused or self.closed:
            return 0
        return max(0, int(self._hooks.compute_dispatch_count(len(self._buffer))))

    def _validate_candidates(self, candidates: Sequence[PromptRef]) -> None:
        violations: list[tuple[str, str]] = []
        if len(candidates) > self._max_candidates:
            raise InvalidArgumentError(
                f"{len(candidates)} candidates in one Dispatch; at most {self._max_candidates} are allowed",
                violations=[("candidates", f"at most {self._max_candidates} candidates per call")])
        seen: set[str] = set()
        inflight, datasets = self._inflight, len(self._group_sizes)
        for i, ref in enumerate(candidates):
            prompt_id, ds_index = ref.prompt_id, ref.ds_index
            problem = self._id_problem(prompt_id)
            if problem is None:
                if prompt_id in seen:
                    problem = f"prompt {prompt_id!r} is named twice in this request"
                elif prompt_id in inflight:
                    problem = f"prompt {prompt_id!r} is already in flight"
                seen.add(prompt_id)
            if problem is not None:
                violations.append((f"candidates[{i}].prompt_id", problem))
            if not (isinstance(ds_index, int) and 0 <= ds_index < datasets):
                violations.append((f"candidates[{i}].ds_index", self._ds_index_problem(ds_index)))
        if violations:
            raise InvalidArgumentError(f"Dispatch refused, nothing admitted: {violations[0][1]}", violations=violations)

    def _ds_index_problem(self, ds_index: Any) -> str:
        return f"ds_index {ds_index!r} is not configured; allowed: 0..{len(self._group_sizes) - 1}"

    def check_request_id(self, request_id: Any) -> None:
        """A non-empty request_id is kept in the replay cache: bound its length and refuse control characters."""
        problem = self._id_problem(request_id, self._max_opaque_id_length)
        if problem:
            raise InvalidArgumentError(f"request_id {problem}", violations=[("request_id", problem)])

    def _id_problem(self, value: Any, limit: Optional[int] = None) -> Optional[str]:
        limit = self._max_id_length if limit is None else limit
        if not isinstance(value, str) or not value:
            return "must be a non-empty string"
        if len(value) > limit:
            return f"is {len(value)} characters long; at most {limit} are allowed"
        if not value.isprintable():
            return "must not contain control or non-printable characters"
        return None

    # ----------------------------------------------------------------- submit

    def submit(self, trajectories: Sequence[Trajectory], request_id: str = "") -> SubmitResult:
        """Accept finished trajectories all-or-nothing, then collect every group that became ready."""
        with self._lock:
            answered = self._answers["Submit"].get(request_id)
            if answered is not None:
                return answered
            self._check_open()
            stale_before = self.totals["stale_rejected"]
            try:
                fresh, duplicates = self._validate_submit(trajectories)
            except StaleGenerationError:
                self._record(("stale", self._clock(), self.totals["stale_rejected"] - stale_before))
                raise
            completed: list[InflightGroup] = []
            touched: dict[str, InflightGroup] = {}
            for trajectory in fresh:
                group = touched[trajectory.prompt_id] = self._inflight[trajectory.prompt_id]
                group.trajectories[trajectory.trajectory_id] = trajectory
                self._accepted[trajectory.trajectory_id] = trajectory
                self._held_bytes += trajectory.size_bytes
                if group.complete:
                    completed.append(group)
            self._extend_leases([group for group in touched.values() if not group.complete], self._clock())
            self._queued_trajectories += len(fresh)
            self._complete_inflight += len(completed)
            self.totals["submitted"] += len(fresh)
            self.totals["duplicates"] += duplicates
            self._collect_ready(completed)
            if fresh or duplicates:
                self._notify()
            result = SubmitResult(len(fresh), duplicates, len(completed))  # accepted, duplicates, groups completed
            self._record(("submit", self._clock(), list(trajectories), request_id))
            self._remember("Submit", request_id, result)
            return result

    def _validate_submit(self, trajectories: Sequence[Trajectory]) -> tuple[list[Trajectory], int]:
        """Return (new trajectories, duplicate count) or raise with every problem found; changes nothing."""
        if len(trajectories) > self._max_trajectories:
            raise InvalidArgumentError(
                f"{len(trajectories)} trajectories in one Submit; at most {self._max_trajectories} are allowed",
                violations=[("trajectories", f"at most {self._max_trajectories} per call")])
        violations: list[tuple[str, str]] = []
        unknown: list[str] = []
        stale: list[str] = []
        expired: list[str] = []
        fresh: list[Trajectory] = []
        in_batch: dict[str, Trajectory] = {}
        added_per_group: dict[str, int] = {}
        duplicates = 0
        for i, t in enumerate(trajectories):
            field = f"trajectories[{i}]"
            before = len(violations)
            for name in ("trajectory_id", "prompt_id"):
                problem = self._id_problem(getattr(t, name))
                if problem:
                    violations.append((f"{field}.{name}", problem))
            if t.status not in VALID_STATUSES:
                violations.append((f"{field}.status", f"status {t.status!r} is not allowed; use COMPLETED, FAILED or ABORTED"))
            if not isinstance(t.reward, (int, float)) or not math.isfinite(t.reward):
                violations.append((f"{field}.reward", f"reward {t.reward!r} must be a finite number"))
            if len(violations) > before:
                continue
            earlier = self._accepted.get(t.trajectory_id) or in_batch.get(t.trajectory_id)
            if earlier is not None:
                if earlier.same_content(t):
                    duplicates += 1
                else:
                    violations.append((f"{field}.trajectory_id",
                                       f"trajectory {t.trajectory_id!r} was already accepted with different content"))
                continue
            group = self._inflight.get(t.prompt_id)
            if group is None:
                if t.prompt_id in self._expired_prompts:
                    expired.append(t.prompt_id)
                elif t.prompt_id in self._generation_prompts:
                    violations.append((f"{field}.prompt_id", f"the group of prompt {t.prompt_id!r} is already "
                                       f"complete and collected; it takes no more trajectories"))
                elif any(t.prompt_id in past for past in self._past_generation_prompts):
                    stale.append(t.prompt_id)
                else:
                    unknown.append(t.prompt_id)
                continue
            if t.ds_index != group.ds_index:
                violations.append((f"{field}.ds_index", f"ds_index {t.ds_index!r} differs from the prompt's "
                                   f"ds_index {group.ds_index}"))
                continue
            added = added_per_group.get(t.prompt_id, 0) + 1
            if len(group.trajectories) + added > group.group_size:
                violations.append((f"{field}.prompt_id", f"group {t.prompt_id!r} would hold more than its "
                                   f"{group.group_size} trajectories"))
                continue
            added_per_group[t.prompt_id] = added
            in_batch[t.trajectory_id] = t
            fresh.append(t)
        if violations:
            raise InvalidArgumentError(f"Submit refused, nothing accepted: {violations[0][0]} {violations[0][1]}",
                                       violations=violations)
        if unknown:
            raise UnknownPromptError(f"Submit refused, nothing accepted: prompt {unknown[0]!r} was never dispatched "
                                     f"(or was dispatched more than {self._past_generation_prompts.maxlen} resets ago)")
        if stale:
            self.totals["stale_rejected"] += len(stale)
            raise StaleGenerationError(f"Submit refused, nothing accepted: prompt {stale[0]!r} was dispatched before "
                                       f"the last Reset (current generation {self.generation})")
        if expired:
            raise LeaseExpiredError(f"Submit refused, nothing accepted: the in-flight lease of prompt {expired[0]!r} "
                                    f"ran out (server.inflight_lease_seconds = {self._inflight_lease:g}); its slot was "
                                    f"reclaimed and its partial trajectories are returned by the next Reset")
        self._check_limits(fresh, added_per_group)
        return fresh, duplicates

    def _check_limits(self, fresh: list[Trajectory], added_per_group: dict[str, int]) -> None:
        """Refuse (changing nothing) a Submit that would overfill the buffer or the byte budget."""
        if self._max_bytes:
            incoming = sum(t.size_bytes for t in fresh)
            if self._held_bytes + incoming > self._max_bytes:
                raise ResourceExhaustedError(
                    f"Submit refused, nothing accepted: {self._held_bytes} bytes are held and this Submit brings "
                    f"{incoming} more, over server.max_held_bytes = {self._max_bytes}; retry after the trainer "
                    f"collects", retry_after=RESOURCE_RETRY_SECONDS, reason="BYTES_FULL")
        if self._max_buffered:
            completing = sum(1 for prompt_id, added in added_per_group.items()
                             if len(self._inflight[prompt_id].trajectories) + added == self._inflight[prompt_id].group_size)
            if completing and len(self._buffer) + completing > self._max_buffered:
                raise ResourceExhaustedError(
                    f"Submit refused, nothing accepted: the pipeline buffer holds {len(self._buffer)} groups and this "
                    f"Submit completes {completing} more, over server.max_buffered_groups = {self._max_buffered}; "
                    f"retry after the trainer collects", retry_after=RESOURCE_RETRY_SECONDS, reason="BUFFER_FULL")

    # ----------------------------------------------------------------- collector

    def _collect_ready(self, completed: Iterable[InflightGroup]) -> None:
        for group in completed:
            if self._hooks.will_collect(MappingProxyType(group.trajectories)):
                self._move_out(group)
            else:
                group.held = True
                # An ordered gate never takes an aborted group: it waits for the Reset outside the heap.
                if not (self._ordered_gate and any(t.status == TrajectoryStatus.ABORTED
                                                   for t in group.trajectories.values())):
                    heapq.heappush(self._held, (group.seq, group.prompt_id))
        self._release_held()

    def _release_held(self) -> None:
        """Re-examine gate-refused groups, oldest first, for as long as the strategy state keeps changing.

        With an ordered gate a pass ends at the first refusal (later groups would be refused too),
        so its cost follows the groups released, not the groups held.
        """
        while self._strategy_touched and self._held:
            self._strategy_touched = False
            still_held = []
            while self._held:
                seq, prompt_id = heapq.heappop(self._held)
                group = self._inflight.get(prompt_id)
                if group is None or group.seq != seq or not group.held:
                    continue
                if self._hooks.will_collect(MappingProxyType(group.trajectories)):
                    self._move_out(group)
                else:
                    still_held.append((seq, prompt_id))
                    if self._ordered_gate:
                        break
            for entry in still_held:
                heapq.heappush(self._held, entry)
        self._strategy_touched = False

    def _move_out(self, group: InflightGroup) -> None:
        """The group leaves the trajectory queue: into the buffer, or dropped by a filter."""
        self._hooks.on_collected(group.prompt_id)
        self._strategy_touched = True
        del self._inflight[group.prompt_id]
        self._complete_inflight -= 1
        self._queued_trajectories -= len(group.trajectories)
        view = MappingProxyType(group.trajectories)
        if all(f.keep(view) for f in self._filters):
            heapq.heappush(self._buffer, (group.priority(), group.to_group()))
            self.totals["collected"] += 1
        else:
            self.totals["filtered"] += 1
            self._tally.filtered += 1
            self._held_bytes -= _bytes_of(group.trajectories.values())

    # ----------------------------------------------------------------- collect

    def collect(self, num_groups: int, wait: float = 0.0, allow_partial: bool = False) -> CollectResult:
        """Take `num_groups` groups, oldest priority first, waiting up to `wait` seconds for them.

        Without `allow_partial`, fewer than `num_groups` at the deadline gives nothing and `timed_out`.
        """
        self._validate_collect(num_groups)
        deadline = self._clock() + max(0.0, wait)
        with self._lock:
            self._check_open()  # once: a waiter woken by close() answers with what is there
            while True:
                if len(self._buffer) >= num_groups:
                    return self._taken(num_groups, timed_out=False)
                remaining = deadline - self._clock()
                if remaining <= 0 or self.closed:
                    return self.collect_now(num_groups, allow_partial)
                self._wait_for_change(remaining)

    def collect_now(self, num_groups: int, allow_partial: bool = False, request_id: str = "",
                    lease_seconds: float = 0.0) -> CollectResult:
        """Non-waiting collect: all `num_groups`, or with `allow_partial` whatever is there.

        With `lease_seconds` > 0 the groups are leased: they return to the buffer, in their original
        order, unless `ack(lease_id)` comes within that time (at-least-once delivery).
        """
        self._validate_collect(num_groups)
        if not (isinstance(lease_seconds, (int, float)) and math.isfinite(lease_seconds) and lease_seconds >= 0):
            raise InvalidArgumentError(f"lease_seconds {lease_seconds!r} must be a finite number >= 0 (0: no lease)",
                                       violations=[("lease_seconds", "must be a finite number >= 0")])
        with self._lock:
            answered = self._answers["Collect"].get(request_id)
            if answered is not None:
                return answered
            available = len(self._buffer)
            if available >= num_groups:
                return self._taken(num_groups, timed_out=False, request_id=request_id, lease_seconds=lease_seconds)
            if allow_partial and available:
                return self._taken(available, timed_out=True, request_id=request_id, lease_seconds=lease_seconds)
            return CollectResult([], timed_out=True)

    def _taken(self, count: int, timed_out: bool, request_id: str = "", lease_seconds: float = 0.0) -> CollectResult:
        now = self._clock()
        if lease_seconds > 0:
            entries = [heapq.heappop(self._buffer) for _ in range(count)]
            self._lease_serial += 1
            lease = CollectLease(f"lease-{self._lease_serial}", entries, lease_seconds, now + lease_seconds)
            self._leases[lease.lease_id] = lease
            self._notify()
            result = CollectResult([group for _, group in entries], timed_out=timed_out, lease_id=lease.lease_id)
        else:
            result = CollectResult(self._take(count), timed_out=timed_out)
        self._record(("collect", now, count, timed_out, request_id, lease_seconds))
        self._remember("Collect", request_id, result)
        return result

    def ack(self, lease_id: str, request_id: str = "") -> int:
        """The trainer has the leased groups: they are consumed for good. Returns how many."""
        problem = self._id_problem(lease_id, self._max_opaque_id_length)
        if problem:  # before the id is echoed in any message
            raise InvalidArgumentError(f"lease_id {problem}", violations=[("lease_id", problem)])
        with self._lock:
            answered = self._answers["Ack"].get(request_id)
            if answered is not None:
                return answered
            self._check_open()
            lease = self._leases.pop(lease_id, None)
            if lease is None:
                if lease_id in self._lapsed_leases:
                    raise LeaseExpiredError(f"lease {lease_id!r} ran out before this Ack; its groups went back to "
                                            f"the buffer and will be delivered again")
                raise UnknownLeaseError(f"lease {lease_id!r} is not known (never granted, or already acknowledged)")
            self._consume([group for _, group in lease.entries])
            count = len(lease.entries)
            self._record(("ack", self._clock(), lease_id, request_id))
            self._remember("Ack", request_id, count)
            return count

    def expire_leases(self) -> tuple[list[str], list[str]]:
        """Reclaim what ran out: in-flight groups (their slots) and Collect leases (back to the buffer).

        Returns (expired prompt ids, expired lease ids). Called periodically by the server.
        """
        with self._lock:
            now = self._clock()
            groups = []
            while self._lease_heap and self._lease_heap[0][0] <= now:
                deadline, _seq, prompt_ids = heapq.heappop(self._lease_heap)
                for prompt_id in prompt_ids:
                    group = self._inflight.get(prompt_id)
                    if group is not None and group.deadline == deadline and not group.complete:
                        group.deadline = math.inf  # taken: a duplicate heap entry must not take it twice
                        groups.append(group)
            groups.sort(key=attrgetter("seq"))  # dispatch order
            lapsed = [lease_id for lease_id, lease in self._leases.items() if lease.deadline <= now]
            if groups or lapsed:
                self._expire([g.prompt_id for g in groups], lapsed)
                self._record(("expire", now, [g.prompt_id for g in groups], lapsed))
            return [g.prompt_id for g in groups], lapsed

    def _expire(self, prompt_ids: list[str], lease_ids: list[str]) -> None:
        for prompt_id in prompt_ids:
            group = self._inflight.pop(prompt_id)
            self._hooks.on_collected(prompt_id)  # the slot is reclaimed as if the group had been collected
            self._queued_trajectories -= len(group.trajectories)
            self._expired_groups.append(group.to_group())
            self._expired_prompts.add(prompt_id)
            self.totals["expired"] += 1
        for lease_id in lease_ids:
            lease = self._leases.pop(lease_id)
            for entry in lease.entries:
                heapq.heappush(self._buffer, entry)
            self.totals["redelivered"] += len(lease.entries)
            self._lapsed_leases.append(lease_id)
        self._strategy_touched = True
        self._release_held()
        self._notify()

    def _extend_leases(self, groups: Sequence[InflightGroup], now: float) -> None:
        """Give these groups their full in-flight lease from `now`, with one heap entry for all of them."""
        if not self._inflight_lease or not groups:
            return
        deadline = now + self._inflight_lease
        extended = []
        for group in groups:
            if group.deadline != deadline:
                group.deadline = deadline
                extended.append(group.prompt_id)
        if extended:
            heapq.heappush(self._lease_heap, (deadline, groups[0].seq, extended))

    def _validate_collect(self, num_groups: int) -> None:
        if not isinstance(num_groups, int) or isinstance(num_groups, bool) or not 1 <= num_groups <= self._max_collect:
            raise InvalidArgumentError(
                f"num_groups {num_groups!r} is out of range; allowed: 1..{self._max_collect}",
                violations=[("num_groups", f"must be an integer in 1..{self._max_collect}")])

    def _take(self, count: int) -> list[TrajectoryGroup]:
        groups = [heapq.heappop(self._buffer)[1] for _ in range(count)]
        self._consume(groups)
        return groups

    def _consume(self, groups: list[TrajectoryGroup]) -> None:
        """The trainer has these groups for good: count them, free their bytes, tell listeners."""
        self.totals["consumed"] += len(groups)
        for group in groups:
            self._tally.count_consumed(group)
            self._held_bytes -= _bytes_of(group.trajectories)
        if self._consume_listeners:
            now = self._clock()
            for callback in self._consume_listeners:
                callback(groups, self.weight_version, now)
        self._notify()

    # ----------------------------------------------------------------- reset / resume

    def reset(self, mode: ResetMode = ResetMode.UNSPECIFIED, wait: float = 0.0, resume: bool = False,
              weight_version: Optional[int] = None) -> ResetResult:
        """Pause, wait up to `wait` for running groups to assemble, restore/drop them, optionally resume."""
        self.begin_reset(mode, resume=resume, weight_version=weight_version)
        deadline = self._clock() + max(0.0, wait)
        with self._lock:
            while not self.reset_ready() and not self.closed:
                remaining = deadline - self._clock()
                if remaining <= 0:
                    break
                self._wait_for_change(remaining)
            return self.finish_reset(resume=resume, weight_version=weight_version)

    def begin_reset(self, mode: ResetMode = ResetMode.UNSPECIFIED, *, resume: bool = False,
                    weight_version: Optional[int] = None) -> ResetMode:
        """Step 1 of a Reset: pause dispatch and tell watchers. Returns the effective mode."""
        mode = ResetMode(mode) if mode in ResetMode._value2member_map_ else mode
        if mode not in (ResetMode.UNSPECIFIED, ResetMode.ABORT, ResetMode.WAIT):
            raise InvalidArgumentError(f"reset mode {mode!r} is not allowed; use ABORT or WAIT",
                                       violations=[("mode", "must be ABORT, WAIT or unspecified (server default)")])
        with self._lock:
            self._check_open()
            if self.resetting:
                raise ResetInProgressError("a Reset is already running; wait for it to finish")
            if resume:
                self._validate_weight_version(weight_version)
            mode = self._default_mode if mode == ResetMode.UNSPECIFIED else mode
            now = self._clock()
            self.resetting = True
            if not self.paused:
                self.paused = True
                self._pause_started = now
            elif self._pause_started is None:
                self._pause_started = now
            self._reset_ready_at = None
            self._emit(ControlEventType.PAUSE, mode)
            self._notify()
            self._record(("begin_reset", now, mode, resume, weight_version))
            return mode

    def reset_ready(self) -> bool:
        """True when every running group holds all its trajectories (any status)."""
        with self._lock:
            ready = self._complete_inflight == len(self._inflight)
            if ready and self._reset_ready_at is None and self.resetting:
                self._reset_ready_at = self._clock()
            return ready

    def finish_reset(self, *, resume: bool = False, weight_version: Optional[int] = None,
                     request_id: str = "") -> ResetResult:
        """Steps 3-6 of a Reset: restore complete groups, drop incomplete ones, clear, optionally resume."""
        with self._lock:
            if not self.resetting:
                raise ResetInProgressError("finish_reset without begin_reset")
            now = self._clock()
            self.reset_ready()
            ready_at_recorded = self._reset_ready_at
            restored: list[TrajectoryGroup] = []
            dropped: list[str] = []
            for group in sorted(self._inflight.values(), key=lambda g: g.seq):
                if group.complete:
                    restored.append(group.to_group())
                else:
                    dropped.append(group.prompt_id)
            self.totals["restored"] += len(restored)
            self.totals["dropped"] += len(dropped)
            expired, self._expired_groups = self._expired_groups, []
            self._expired_prompts = set()
            for group in (*restored, *expired):
                self._held_bytes -= _bytes_of(group.trajectories)
            for prompt_id in dropped:
                self._held_bytes -= _bytes_of(self._inflight[prompt_id].trajectories.values())
            self._hooks.on_reset()
            self._inflight.clear()
            self._held.clear()
            self._lease_heap.clear()
            self._complete_inflight = 0
            self._queued_trajectories = 0
            self._accepted.clear()
            self._past_generation_prompts.append(self._generation_prompts)
            self._generation_prompts = set()
            self.generation += 1
            ready_at = self._reset_ready_at if self._reset_ready_at is not None else now
            pause_delay = max(0.0, ready_at - (self._pause_started or ready_at))
            report = self._close_step(len(restored), len(dropped), pause_delay)
            self.resetting = False
            if resume:
                self._resume_locked(weight_version)
            self._notify()
            result = ResetResult(restored, dropped, pause_delay, self.generation, self.step, self.weight_version,
                                 self.paused, report, expired)
            self._record(("finish_reset", now, ready_at_recorded, resume, weight_version, request_id))
            self._remember("Reset", request_id, result)
            if self._journal is not None:
                # The step boundary is the natural checkpoint: nothing is in flight, so the snapshot is small.
                self.last_ticket = self._journal.snapshot(self.export_state())
            return result

    def abandon_reset(self) -> None:
        """Used when a Reset cannot finish (shutdown): leave the pause on, allow a later Reset."""
        with self._lock:
            self.resetting = False
            self._notify()
            self._record(("abandon_reset", self._clock()))

    def _close_step(self, restored: int, dropped: int, pause_delay: float) -> StepReport:
        tally = self._tally
        report = StepReport(
            step=self.step,
            pipeline_buf_size=len(self._buffer),
            filter_drop=tally.filtered,
            partial_ratio=(tally.partial / tally.trajectories) if tally.trajectories else 0.0,
            partial_span_max=tally.span_max,
            partial_restored_count=restored,
            partial_dropped_incomplete_count=dropped,
            pause_delay=pause_delay,
        )
        self._reports.append(report)
        self._tally = _StepTally()
        return report

    def resume(self, weight_version: int, request_id: str = "") -> ResumeResult:
        """step += 1, record the weight version, reopen dispatch, tell watchers."""
        with self._lock:
            answered = self._answers["Resume"].get(request_id)
            if answered is not None:
                return answered
            self._check_open()
            if self.resetting:
                raise ResetInProgressError("a Reset is running; it resumes when it finishes (Reset with resume=true)")
            self._validate_weight_version(weight_version)
            self._resume_locked(weight_version)
            self._notify()
            result = ResumeResult(self.step, self.weight_version)
            self._record(("resume", self._clock(), weight_version, request_id))
            self._remember("Resume", request_id, result)
            return result

    def _validate_weight_version(self, weight_version: Optional[int]) -> None:
        if weight_version is None:
            weight_version = self.weight_version
        if not isinstance(weight_version, int) or isinstance(weight_version, bool) or weight_version < self.weight_version:
            raise InvalidArgumentError(
                f"weight_version {weight_version!r} must be an integer >= the current {self.weight_version}",
                violations=[("weight_version", f"must be >= {self.weight_version}")])

    def _resume_locked(self, weight_version: Optional[int]) -> None:
        self.step += 1
        if weight_version is not None:
            self.weight_version = weight_version
        self.paused = False
        self._pause_started = None
        self._emit(ControlEventType.RESUME)

    # ----------------------------------------------------------------- answers, journal, recovery

    def answers_of(self, method: str) -> Mapping[str, Any]:
        """The remembered first answers of earlier `method` calls, by request_id: read-only and live. A lookup
        takes no lock (a single dict read is atomic), so a retry is recognised without a method call."""
        return MappingProxyType(self._answers[method])

    def remember_answer(self, method: str, request_id: str, result: Any) -> None:
        """Keep the final answer of a call that changed nothing (a retry gets it too); changes are kept as made."""
        if not request_id or request_id in self._answers[method]:  # the usual case: no lock needed to see it
            return
        with self._lock:
            if request_id not in self._answers[method]:
                self._remember(method, request_id, result)

    def _remember(self, method: str, request_id: str, result: Any) -> None:
        # An empty request_id is never stored, so the operations look answers up with a plain .get() under their lock.
        if request_id:
            answers = self._answers[method]
            answers[request_id] = result
            if len(answers) > self._answer_limits[method]:
                answers.popitem(last=False)

    @property
    def journal(self) -> Optional[Any]:
        return self._journal

    def _record(self, event: tuple) -> None:
        if self._journal is not None:
            self.last_ticket = self._journal.append(event)

    def export_state(self) -> dict:
        """A consistent copy of everything a Reset leaves behind (nothing is in flight then), for a snapshot."""
        with self._lock:
            return {
                "format": SNAPSHOT_FORMAT,
                "step": self.step, "weight_version": self.weight_version, "generation": self.generation,
                "paused": self.paused, "next_seq": self._next_seq, "totals": dict(self.totals),
                "buffer": list(self._buffer), "past_generation_prompts": list(self._past_generation_prompts),
                "reports": list(self._reports),
                "answers": {method: list(answers.items()) for method, answers in self._answers.items()},
                "leases": [(lease.lease_id, lease.entries, lease.seconds) for lease in self._leases.values()],
                "lease_serial": self._lease_serial, "lapsed_leases": list(self._lapsed_leases),
                "held_bytes": self._held_bytes,
                "config": dict(self._summary),  # the pacing settings the state was made under
            }

    def recover(self) -> int:
        """Rebuild the state from the journal: its snapshot, then its events replayed in order.

        The strategy is a fresh instance that hears every dispatch and collection since the last
        Reset again, custom strategies included. Returns the number of events replayed.
        """
        if self._journal is None:
            return 0
        snapshot, events = self._journal.load()
        recorded = (snapshot or {}).get("config")  # None: a new directory, or a snapshot older than the record
        if events:
            self._check_recorded_config(recorded, len(events))
        journal, clock = self._journal, self._clock
        self._journal = None  # replaying must not record the events again
        try:
            with self._lock:
                if snapshot is not None:
                    try:
                        self._import_state(snapshot)
                    except (KeyError, ValueError) as exc:
                        raise RecoveryError(f"cannot read the state snapshot in {journal.directory}: {exc}") from None
                for number, event in enumerate(events, 1):
                    self._clock = lambda at=event[1]: at  # the replayed call sees the time it first ran at
                    try:
                        self._replay(event)
                    except Exception as exc:
                        raise RecoveryError(
                            f"cannot rebuild the state in {journal.directory}: replaying event {number} of "
                            f"{len(events)} ({event[0]}) failed: {exc}. Was the pacing configuration changed since "
                            f"the state was written? Start with the configuration it was written with, or move "
                            f"server.state_dir aside to start afresh") from None
        finally:
            self._journal, self._clock = journal, clock
        if not events and recorded != self._summary:
            # Nothing in flight (a new directory, or just after a Reset): put these settings on record now, so a
            # restart before the next Reset replays its events under the settings they were recorded with.
            self.last_ticket = self._journal.snapshot(self.export_state())
        if self.resetting:  # the last process died during a Reset's wait: end it (recorded); a retried Reset starts afresh
            self.abandon_reset()
        if self.paused and not self.resetting:
            self._pause_started = self._clock()
        with self._lock:  # deadlines were on the old process's clock: every lease gets its full time again
            now = self._clock()
            self._extend_leases(list(self._inflight.values()), now)
            for lease in self._leases.values():
                lease.deadline = now + lease.seconds
        return len(events)

    def _check_recorded_config(self, recorded: Optional[dict], events: int) -> None:
        """Refuse to replay events recorded under other pacing settings: that would rebuild a different state."""
        if recorded is None:  # a snapshot older than the record: nothing to compare (replay still checks itself)
            return
        changed = [f"{key} {recorded.get(key)!r} -> {self._summary.get(key)!r}"
                   for key in sorted(set(recorded) | set(self._summary)) if recorded.get(key) != self._summary.get(key)]
        if changed:
            raise RecoveryError(
                f"the state in {self._journal.directory} has {events} events since its last snapshot, recorded under "
                f"other pacing settings ({', '.join(changed)}); start with the settings they were recorded with "
                f"(to change settings, restart after a Reset, when nothing is replayed), or move server.state_dir "
                f"aside to start afresh")

    def _import_state(self, snapshot: dict) -> None:
        if snapshot.get("format") != SNAPSHOT_FORMAT:
            raise ValueError(f"it is in format {snapshot.get('format')!r}, written by another version of coda-server; "
                             f"this version reads format {SNAPSHOT_FORMAT} (move server.state_dir aside to start afresh)")
        self.step, self.weight_version = snapshot["step"], snapshot["weight_version"]
        self.generation, self.paused, self._next_seq = snapshot["generation"], snapshot["paused"], snapshot["next_seq"]
        self.totals.update(snapshot["totals"])
        self._buffer = list(snapshot["buffer"])
        heapq.heapify(self._buffer)
        self._past_generation_prompts.extend(snapshot["past_generation_prompts"])
        self._reports.extend(snapshot["reports"])
        for method, items in snapshot["answers"].items():
            self._answers[method].update(items)
        now = self._clock()
        for lease_id, entries, seconds in snapshot["leases"]:
            # The old deadline was on the old process's clock: a recovered lease gets its full time again.
            self._leases[lease_id] = CollectLease(lease_id, entries, seconds, now + seconds)
        self._lease_serial = snapshot["lease_serial"]
        self._lapsed_leases.extend(snapshot["lapsed_leases"])
        self._held_bytes = snapshot["held_bytes"]

    def _replay(self, event: tuple) -> None:
        kind = event[0]
        if kind == "dispatch":
            _, _, refs, request_id = event
            result = self.dispatch(refs, request_id=request_id)
            if result.admitted_ids != [r.prompt_id for r in refs]:
                raise RuntimeError(f"recovery diverged: the strategy admitted {len(result.admitted_ids)} of the "
                                   f"{len(refs)} groups it admitted before the restart")
        elif kind == "submit":
            _, _, trajectories, request_id = event
            self.submit(trajectories, request_id=request_id)
        elif kind == "stale":
            self.totals["stale_rejected"] += event[2]
        elif kind == "collect":
            _, _, count, timed_out, request_id, lease_seconds = event
            self._taken(count, timed_out, request_id, lease_seconds)
        elif kind == "ack":
            _, _, lease_id, request_id = event
            self.ack(lease_id, request_id)
        elif kind == "expire":
            _, _, prompt_ids, lease_ids = event
            self._expire(prompt_ids, lease_ids)
        elif kind == "begin_reset":
            _, _, mode, resume, weight_version = event
            self.begin_reset(mode, resume=resume, weight_version=weight_version)
        elif kind == "finish_reset":
            _, _, ready_at, resume, weight_version, request_id = event
            self._reset_ready_at = ready_at
            self.finish_reset(resume=resume, weight_version=weight_version, request_id=request_id)
        elif kind == "abandon_reset":
            self.abandon_reset()
        elif kind == "resume":
            _, _, weight_version, request_id = event
            self.resume(weight_version, request_id=request_id)
        else:
            raise ValueError(f"unknown journal event {kind!r}")

    # ----------------------------------------------------------------- state / shutdown

    def state(self) -> PacerState:
        with self._lock:
            return PacerState(
                running=len(self._inflight), buffered=len(self._buffer),
                queued_trajectories=self._queued_trajectories, capacity=self._admissible_now(),
                window_size=self._window_size, step=self.step, weight_version=self.weight_version,
                generation=self.generation, paused=self.paused, resetting=self.resetting,
                strategy=self._strategy.name, config_summary=dict(self._summary),
                leased=sum(len(lease.entries) for lease in self._leases.values()), held_bytes=self._held_bytes,
                recent_reports=list(self._reports), **self.totals,
            )

    def close(self) -> None:
        """Shut down: waiters return at once with their flags, watchers get SHUTDOWN, new calls fail."""
        with self._lock:
            if self.closed:
                return
            self.closed = True
            self._emit(ControlEventType.SHUTDOWN)
            self._notify()

    def _check_open(self) -> None:
        if self.closed:
            raise ShuttingDownError("the pacer is shutting down and takes no new calls")


def _bytes_of(trajectories: Iterable[Trajectory]) -> int:
    return sum(t.size_bytes for t in trajectories)
