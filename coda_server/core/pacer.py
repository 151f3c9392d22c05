"""The Pacer: dispatch, submit, collect, reset and resume over one strategy, trajectory queue and buffer."""
from __future__ import annotations

import heapq
import math
import threading
import time
from collections import deque
from types import MappingProxyType
from typing import Any, Callable, Iterable, Optional, Sequence

from .config import config_summary
from .errors import (
    InvalidArgumentError,
    ResetInProgressError,
    ShuttingDownError,
    StaleGenerationError,
    UnknownPromptError,
)
from .filters import GroupFilter, create_filters
from .strategy import ThreadSafeStrategy, create_strategy, window_size
from .types import (
    Admitted,
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
_NO_PRIORITY = float("inf")


class InflightGroup:
    """A dispatched group that has not left the trajectory queue; handed to strategy hooks."""

    __slots__ = ("prompt_id", "ds_index", "epoch", "index", "seq", "group_size", "trajectories",
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
    ):
        self.config = config
        self._clock = clock
        self._strategy = strategy if strategy is not None else create_strategy(config)
        self._filters = filters if filters is not None else create_filters(list(config.rollout.filter), config)
        self._group_sizes = [int(s.num_trajectories_per_prompt) for s in config.data_sources]
        self._window_size = window_size(config)
        server = config.get("server") or {}
        self._max_id_length = int(server.get("max_id_length", 512))
        self._max_candidates = int(server.get("max_dispatch_candidates", 65536))
        self._max_trajectories = int(server.get("max_submit_trajectories", 65536))
        self._max_collect = int(server.get("max_collect_groups", 65536))
        self._default_mode = ResetMode.ABORT if bool(config.rollout.get("partial", True)) else ResetMode.WAIT
        self._summary = config_summary(config)

        self._lock = threading.RLock()
        self._changed = threading.Condition(self._lock)
        self._change_listeners: list[Callable[[], None]] = []
        self._control_listeners: list[Callable[[ControlEvent], None]] = []

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
             "stale_rejected", "duplicates"), 0)

    # ----------------------------------------------------------------- listeners

    def add_change_listener(self, callback: Callable[[], None]) -> None:
        """`callback()` runs (under the lock, so it must be quick) after every state change."""
        with self._lock:
            self._change_listeners.append(callback)

    def add_control_listener(self, callback: Callable[[ControlEvent], None]) -> None:
        """`callback(event)` runs for every PAUSE / RESUME / SHUTDOWN, in order, under the lock."""
        with self._lock:
            self._control_listeners.append(callback)

    def _notify(self) -> None:
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

    def dispatch(self, candidates: Sequence[PromptRef], wait: float = 0.0) -> DispatchResult:
        """Admit the first k candidates the strategy allows now; with `wait`, wait up to that long for one slot."""
        deadline = self._clock() + max(0.0, wait)
        with self._lock:
            while True:
                self._check_open()
                result = self._dispatch_locked(candidates)
                if result.admitted or not candidates or self.closed:
                    return result
                remaining = deadline - self._clock()
                if remaining <= 0:
                    return result
                self._changed.wait(remaining)

    def _dispatch_locked(self, candidates: Sequence[PromptRef]) -> DispatchResult:
        self._validate_candidates(candidates)
        buffered = len(self._buffer)
        count = 0 if self.paused else self._strategy.compute_dispatch_count(buffered)
        count = max(0, min(count, len(candidates)))
        admitted: list[Admitted] = []
        if count:
            now = self._clock()
            groups = [InflightGroup(ref, self._next_seq + i, self._group_sizes[ref.ds_index], now)
                      for i, ref in enumerate(candidates[:count])]
            # The strategy hears first: if a custom strategy raises, the pacer is unchanged.
            self._strategy.on_dispatched(groups)
            self._next_seq += count
            for group in groups:
                self._inflight[group.prompt_id] = group
                self._generation_prompts.add(group.prompt_id)
                admitted.append(Admitted(group.prompt_id, group.seq))
            self.totals["dispatched"] += count
            self._strategy_touched = True
            self._release_held()
            self._notify()
        return DispatchResult(
            admitted=admitted, paused=self.paused, step=self.step, weight_version=self.weight_version,
            generation=self.generation, running=len(self._inflight), buffered=len(self._buffer),
            capacity=self._window_size, remaining=self._admissible_now(),
        )

    def _admissible_now(self) -> int:
        if self.paused or self.closed:
            return 0
        return max(0, self._strategy.compute_dispatch_count(len(self._buffer)))

    def _validate_candidates(self, candidates: Sequence[PromptRef]) -> None:
        violations: list[tuple[str, str]] = []
        if len(candidates) > self._max_candidates:
            raise InvalidArgumentError(
                f"{len(candidates)} candidates in one Dispatch; at most {self._max_candidates} are allowed",
                violations=[("candidates", f"at most {self._max_candidates} candidates per call")])
        seen: set[str] = set()
        for i, ref in enumerate(candidates):
            field = f"candidates[{i}]"
            problem = self._id_problem(ref.prompt_id)
            if problem:
                violations.append((f"{field}.prompt_id", problem))
            elif ref.prompt_id in seen:
                violations.append((f"{field}.prompt_id", f"prompt {ref.prompt_id!r} is named twice in this request"))
            elif ref.prompt_id in self._inflight:
                violations.append((f"{field}.prompt_id", f"prompt {ref.prompt_id!r} is already in flight"))
            seen.add(ref.prompt_id)
            if not (isinstance(ref.ds_index, int) and 0 <= ref.ds_index < len(self._group_sizes)):
                violations.append((f"{field}.ds_index", self._ds_index_problem(ref.ds_index)))
        if violations:
            raise InvalidArgumentError(f"Dispatch refused, nothing admitted: {violations[0][1]}", violations=violations)

    def _ds_index_problem(self, ds_index: Any) -> str:
        return f"ds_index {ds_index!r} is not configured; allowed: 0..{len(self._group_sizes) - 1}"

    def _id_problem(self, value: Any) -> Optional[str]:
        if not isinstance(value, str) or not value:
            return "must be a non-empty string"
        if len(value) > self._max_id_length:
            return f"is {len(value)} characters long; at most {self._max_id_length} are allowed"
        if not value.isprintable():
            return "must not contain control or non-printable characters"
        return None

    # ----------------------------------------------------------------- submit

    def submit(self, trajectories: Sequence[Trajectory]) -> SubmitResult:
        """Accept finished trajectories all-or-nothing, then collect every group that became ready."""
        with self._lock:
            self._check_open()
            fresh, duplicates = self._validate_submit(trajectories)
            completed: list[InflightGroup] = []
            for trajectory in fresh:
                group = self._inflight[trajectory.prompt_id]
                group.trajectories[trajectory.trajectory_id] = trajectory
                self._accepted[trajectory.trajectory_id] = trajectory
                if group.complete:
                    completed.append(group)
            self._queued_trajectories += len(fresh)
            self._complete_inflight += len(completed)
            self.totals["submitted"] += len(fresh)
            self.totals["duplicates"] += duplicates
            self._collect_ready(completed)
            if fresh or duplicates:
                self._notify()
            return SubmitResult(accepted=len(fresh), duplicates=duplicates, groups_completed=len(completed))

    def _validate_submit(self, trajectories: Sequence[Trajectory]) -> tuple[list[Trajectory], int]:
        """Return (new trajectories, duplicate count) or raise with every problem found; changes nothing."""
        if len(trajectories) > self._max_trajectories:
            raise InvalidArgumentError(
                f"{len(trajectories)} trajectories in one Submit; at most {self._max_trajectories} are allowed",
                violations=[("trajectories", f"at most {self._max_trajectories} per call")])
        violations: list[tuple[str, str]] = []
        unknown: list[str] = []
        stale: list[str] = []
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
                if t.prompt_id in self._generation_prompts:
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
        return fresh, duplicates

    # ----------------------------------------------------------------- collector

    def _collect_ready(self, completed: Iterable[InflightGroup]) -> None:
        with self._strategy.lock:  # will_collect runs under the queue (pacer) lock and the strategy lock
            for group in completed:
                if self._strategy.will_collect(MappingProxyType(group.trajectories)):
                    self._move_out(group)
                else:
                    group.held = True
                    heapq.heappush(self._held, (group.seq, group.prompt_id))
            self._release_held()

    def _release_held(self) -> None:
        """Re-examine gate-refused groups, oldest first, for as long as the strategy state keeps changing."""
        while self._strategy_touched and self._held:
            self._strategy_touched = False
            still_held = []
            while self._held:
                seq, prompt_id = heapq.heappop(self._held)
                group = self._inflight.get(prompt_id)
                if group is None or group.seq != seq or not group.held:
                    continue
                if self._strategy.will_collect(MappingProxyType(group.trajectories)):
                    self._move_out(group)
                else:
                    still_held.append((seq, prompt_id))
            for entry in still_held:
                heapq.heappush(self._held, entry)
        self._strategy_touched = False

    def _move_out(self, group: InflightGroup) -> None:
        """The group leaves the trajectory queue: into the buffer, or dropped by a filter."""
        self._strategy.on_collected(group.prompt_id)
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

    # ----------------------------------------------------------------- collect

    def collect(self, num_groups: int, wait: float = 0.0, allow_partial: bool = False) -> CollectResult:
        """Take `num_groups` groups, oldest priority first, waiting up to `wait` seconds for them.

        Without `allow_partial`, fewer than `num_groups` at the deadline gives nothing and `timed_out`.
        """
        self._validate_collect(num_groups)
        deadline = self._clock() + max(0.0, wait)
        with self._lock:
            while True:
                self._check_open()
                if len(self._buffer) >= num_groups:
                    return CollectResult(self._take(num_groups), timed_out=False)
                remaining = deadline - self._clock()
                if remaining <= 0 or self.closed:
                    return self.collect_now(num_groups, allow_partial)
                self._changed.wait(remaining)

    def collect_now(self, num_groups: int, allow_partial: bool = False) -> CollectResult:
        """Non-waiting collect: all `num_groups`, or with `allow_partial` whatever is there."""
        self._validate_collect(num_groups)
        with self._lock:
            available = len(self._buffer)
            if available >= num_groups:
                return CollectResult(self._take(num_groups), timed_out=False)
            if allow_partial and available:
                return CollectResult(self._take(available), timed_out=True)
            return CollectResult([], timed_out=True)

    def _validate_collect(self, num_groups: int) -> None:
        if not isinstance(num_groups, int) or isinstance(num_groups, bool) or not 1 <= num_groups <= self._max_collect:
            raise InvalidArgumentError(
                f"num_groups {num_groups!r} is out of range; allowed: 1..{self._max_collect}",
                violations=[("num_groups", f"must be an integer in 1..{self._max_collect}")])

    def _take(self, count: int) -> list[TrajectoryGroup]:
        groups = [heapq.heappop(self._buffer)[1] for _ in range(count)]
        self.totals["consumed"] += count
        for group in groups:
            self._tally.count_consumed(group)
        self._strategy_touched = True  # Q shrank: dispatch may open
        self._notify()
        return groups

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
                self._changed.wait(remaining)
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
            self.resetting = True
            if not self.paused:
                self.paused = True
                self._pause_started = self._clock()
            elif self._pause_started is None:
                self._pause_started = self._clock()
            self._reset_ready_at = None
            self._emit(ControlEventType.PAUSE, mode)
            self._notify()
            return mode

    def reset_ready(self) -> bool:
        """True when every running group holds all its trajectories (any status)."""
        with self._lock:
            ready = self._complete_inflight == len(self._inflight)
            if ready and self._reset_ready_at is None and self.resetting:
                self._reset_ready_at = self._clock()
            return ready

    def finish_reset(self, *, resume: bool = False, weight_version: Optional[int] = None) -> ResetResult:
        """Steps 3-6 of a Reset: restore complete groups, drop incomplete ones, clear, optionally resume."""
        with self._lock:
            if not self.resetting:
                raise ResetInProgressError("finish_reset without begin_reset")
            self.reset_ready()
            restored: list[TrajectoryGroup] = []
            dropped: list[str] = []
            for group in sorted(self._inflight.values(), key=lambda g: g.seq):
                if group.complete:
                    restored.append(group.to_group())
                else:
                    dropped.append(group.prompt_id)
            self.totals["restored"] += len(restored)
            self.totals["dropped"] += len(dropped)
            self._strategy.on_reset()
            self._inflight.clear()
            self._held.clear()
            self._complete_inflight = 0
            self._queued_trajectories = 0
            self._accepted.clear()
            self._past_generation_prompts.append(self._generation_prompts)
            self._generation_prompts = set()
            self.generation += 1
            ready_at = self._reset_ready_at if self._reset_ready_at is not None else self._clock()
            pause_delay = max(0.0, ready_at - (self._pause_started or ready_at))
            report = self._close_step(len(restored), len(dropped), pause_delay)
            self.resetting = False
            if resume:
                self._resume_locked(weight_version)
            self._notify()
            return ResetResult(restored, dropped, pause_delay, self.generation, self.step, self.weight_version,
                               self.paused, report)

    def abandon_reset(self) -> None:
        """Used when a Reset cannot finish (shutdown): leave the pause on, allow a later Reset."""
        with self._lock:
            self.resetting = False
            self._notify()

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

    def resume(self, weight_version: int) -> ResumeResult:
        """step += 1, record the weight version, reopen dispatch, tell watchers."""
        with self._lock:
            self._check_open()
            if self.resetting:
                raise ResetInProgressError("a Reset is running; it resumes when it finishes (Reset with resume=true)")
            self._validate_weight_version(weight_version)
            self._resume_locked(weight_version)
            self._notify()
            return ResumeResult(self.step, self.weight_version)

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
        self._strategy_touched = True
        self._emit(ControlEventType.RESUME)

    # ----------------------------------------------------------------- state / shutdown

    def state(self) -> PacerState:
        with self._lock:
            return PacerState(
                running=len(self._inflight), buffered=len(self._buffer),
                queued_trajectories=self._queued_trajectories, capacity=self._admissible_now(),
                window_size=self._window_size, step=self.step, weight_version=self.weight_version,
                generation=self.generation, paused=self.paused, resetting=self.resetting,
                strategy=self._strategy.name, config_summary=dict(self._summary),
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
