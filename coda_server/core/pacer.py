"""The Pacer: the pacing rule (dispatch, submit, collect, reset, resume) over one strategy and the owners of its state.

Each piece of state belongs to an owner that changes it only through its methods: the in-flight table and the
held bytes (inflight.py), the pipeline buffer (buffer.py), the collector (collector.py: gate, filters, quarantine,
expiry), the step boundary (steps.py), leases, liveness, kept groups, the prompt cursor, answers, incidents, the
recorder (journal.py) and the clock (clock.py). The Pacer holds a reference to each, is where a call crosses
them, and owns the one lock (docs/architecture.md). The Reset steps, trainer checkpoints, recovery, the end of a
job and the waiting calls' polls are in reset_steps.py, checkpoints.py, recovery.py, job_end.py and polls.py.
"""
from __future__ import annotations

import threading
import time
from typing import Any, Callable, Mapping, Optional, Sequence

from . import checkpoints, job_end, recovery, reset_steps
from .collector import Collector
from .answers import ANSWERED_METHODS, AnswerBook  # noqa: F401  (ANSWERED_METHODS was defined here)
from .checks import RequestChecks
from .clock import PacerClock
from .config import config_summary
from .cursor import PromptCursor
from .errors import (FailedPreconditionError, InvalidArgumentError, MessageTooLargeError, ShuttingDownError,
                     StaleDispatchError, StaleGenerationError, StrategyHookError)
from .filters import GroupFilter, create_filters
from .incidents import HOOK_FAILED, QUARANTINED, REFUSED, IncidentLog, describe_exception
from .incidents import collect_error, hook_error
from .buffer import PipelineBuffer
from .inflight import (ANSWER_OVERHEAD_BYTES, DispatchedGroup, HeldBytes, InflightGroup, InflightTable,
                       bytes_of, encoded_group_bound)
from .journal import (Acked, Collected, Dispatched, Expired, GatesRechecked, Journal, JournalEvent, Recorder,
                      StaleRejected, Submitted)
from .leases import CollectLease, Leases  # noqa: F401  (CollectLease was defined here)
from .liveness import Liveness
from .limits import Limits
from .polls import CollectPoll, DispatchPoll, ResetPoll
from .replay import RestoredGroups, create_replay_strategy
from .settings import setting
from .shares import PLAIN, BatchShape, balanced_shares, budget_count, group_tokens
from .state import COUNTER_NAMES, PacerState
from .steps import StepBoundary
from .strategy import BufferView, ThreadSafeStrategy, create_strategy, gate_is_ordered, overridden_hook, window_size
from .types import (
    CollectResult,
    ControlEvent,
    ControlEventType,
    DispatchResult,
    HeldGroup,
    Incident,
    JobEndReport,
    KeepAliveResult,
    PromptRef,
    ResetMode,
    ResetResult,
    RestoreResult,
    ResumeResult,
    SubmitResult,
    Trajectory,
    TrajectoryGroup,
)
from .waiting import ThreadWaits

SNAPSHOT_FORMAT = recovery.SNAPSHOT_FORMAT


def collect_limit(config: Any, hooks: Any, limits: Limits) -> tuple[int, str]:
    """The most groups that can ever be buffered at once, and the terms that say why (0, "": no bound known):
    the window C for a strategy that promises to stay within it, server.max_buffered_groups when set."""
    bounds: list[tuple[int, str]] = []
    if getattr(hooks, "bounded_by_window", False):
        source = config.data_sources[0]
        B, stale = int(source.num_prompts_per_step), float(config.fully_async.stale_steps)
        sizes = ",".join(str(int(s.num_trajectories_per_prompt)) for s in config.data_sources)
        C = window_size(config)
        bounds.append((C, f"the window holds at most C = int(B * (1 + stale_steps)) = int({B} * (1 + {stale:g})) = "
                          f"{C} groups running or buffered (B = num_prompts_per_step {B}, N = "
                          f"num_trajectories_per_prompt {sizes}, stale_steps {stale:g}, strategy "
                          f"{config.fully_async.sliding_window})"))
    if limits.max_buffered_groups:
        bounds.append((limits.max_buffered_groups,
                       f"server.max_buffered_groups caps the buffer at {limits.max_buffered_groups} groups"))
    return min(bounds) if bounds else (0, "")


class Pacer:
    """Thread-safe pacing state machine; every operation is atomic under one lock.

    In-process callers use `dispatch`, `submit`, `collect`, `ack`, `reset`, `resume`: each runs through
    the request-id answers (`AnswerBook.once`) and, when it waits, blocks its thread (`ThreadWaits`).
    The asyncio face (`AsyncPacer`) builds the same calls from the same parts: the `apply_*` changes and
    the `*_poll` waits, awaited instead of blocked on.
    """

    def __init__(
        self,
        config: Any,
        *,
        strategy: Optional[ThreadSafeStrategy] = None,
        filters: Optional[list[GroupFilter]] = None,
        clock: Callable[[], float] = time.monotonic,
        journal: Optional[Journal] = None,
    ):
        self.config = config
        # GetState reports these on every call: read once (an OmegaConf lookup costs more than the rest of it).
        self._prompts_per_step = int(config.data_sources[0].num_prompts_per_step)
        self._mini_batch_size = int(config.trainer.mini_batch_size)
        self._clock = PacerClock(clock)  # pinned to each event's time while the journal is replayed
        self.recorder = Recorder(journal)  # where acknowledged changes are recorded; None keeps state in memory only
        self.record: Callable[[JournalEvent], None] = self.recorder.record  # record(event): one acknowledged change
        # The one lock (see docs/architecture.md), the Pacer's own: every public method takes it itself,
        # re-entrantly, so no caller has to; a caller holds it across several calls to make them one atomic step
        # (a Poll's attempt, a Reset's wait and finish). The strategy proxy runs under it too (given it, or
        # adopting it with `run_under`): holding it is holding both, as every hook requires, and the pacer calls
        # the strategy itself without the proxy taking the lock again.
        self.lock = threading.RLock()
        self._strategy = strategy if strategy is not None else create_strategy(config, lock=self.lock)
        proxied = isinstance(self._strategy, ThreadSafeStrategy)
        if proxied:
            self._strategy.run_under(self.lock)
        self.hooks = self._strategy.wrapped if proxied else self._strategy
        # With an ordered gate, a re-examination pass stops at the first refusal (see SlidingWindowStrategy).
        self._ordered_gate = gate_is_ordered(self.hooks)
        # The optional hooks: called only when the strategy defines them (on_submitted runs per trajectory).
        self._on_submitted = overridden_hook(self.hooks, "on_submitted")
        self._on_consumed = overridden_hook(self.hooks, "on_consumed")
        self._on_resume = overridden_hook(self.hooks, "on_resume")
        self._filters = filters if filters is not None else create_filters(list(config.rollout.filter), config)
        self._group_sizes = [int(s.num_trajectories_per_prompt) for s in config.data_sources]
        self._window_size = window_size(config)
        self._stale_steps = float(setting(config, "fully_async.stale_steps"))
        self.limits = limits = Limits.from_config(config)
        # The most groups a Collect may wait for: more can never be buffered at once (0: no bound known).
        self.collect_limit, self._collect_limit_terms = collect_limit(config, self.hooks, limits)
        self.checks = RequestChecks(limits, self._group_sizes)
        self.default_mode = ResetMode.ABORT if bool(setting(config, "rollout.partial")) else ResetMode.WAIT
        # Restored groups: kept and re-offered for continuation, or handed to the Reset's caller (the old way).
        self.continue_restored = bool(setting(config, "rollout.continue_restored"))
        self.restored = RestoredGroups(self._clock, [create_replay_strategy((s.get("dataset") or {}).get("buffer_replay_strategy"),
                                                                config) for s in config.data_sources])
        # A group still holding a FAILED trajectory after the filters is quarantined, not trained on, unless asked.
        self._train_on_failed = bool(setting(config, "rollout.train_on_failed"))
        self.summary = config_summary(config)
        self.max_wait_seconds = float(setting(config, "server.max_wait_seconds"))
        # How often held groups are re-examined with nothing changed (the server's timer; 0: never).
        self.gate_recheck_seconds = float(setting(config, "fully_async.gate_recheck_seconds"))

        self.waits = ThreadWaits(self.lock, self._clock, lambda: self.closed)
        self.answers = AnswerBook(limits, self.lock, self.checks.check_request_id)
        self.leases = Leases(limits.inflight_lease_seconds)
        self.liveness = Liveness(limits.worker_liveness_seconds)
        self._loaded_versions: dict[str, int] = {}  # client id -> the weight version its engine reports loaded
        self._change_listeners: list[Callable[[], None]] = []
        self._control_listeners: list[Callable[[ControlEvent], None]] = []
        self._consume_listeners: list[Callable[[list[TrajectoryGroup], int, float], None]] = []

        self.inflight = InflightTable(limits.remembered_generations)
        self.buffer = PipelineBuffer()
        attach = getattr(self.hooks, "attach", None)  # a strategy not derived from SlidingWindowStrategy may lack it
        if attach is not None:  # the strategy's clock and buffer view are this pacer's (the clock pinned in replay)
            attach(self._clock, BufferView(lambda: self.buffer.entries))
        self.incidents = IncidentLog(limits.incidents_kept)
        self.cursor = PromptCursor()  # the prompts admitted so far (offered again after a Restore)
        # (step, weight version, wall time) of the last checkpoint taken and restored; None: none yet.
        self.last_checkpoint: Optional[tuple[int, int, float]] = None
        self.last_restore: Optional[tuple[int, int, float]] = None
        self.held_bytes = HeldBytes()  # bytes of trajectories queued, buffered, leased or set aside

        self.steps = StepBoundary(limits.step_reports_kept)
        self.closed = False
        self.job_ended = False  # EndJob closed dispatch for good (journaled)
        self.job_end_mode = ResetMode.UNSPECIFIED
        self.totals = dict.fromkeys(COUNTER_NAMES, 0)  # one per counter of PacerState
        self.collector = Collector(
            self.hooks, self._filters, self.inflight, self.buffer, self.held_bytes, self.steps.tally, self.totals,
            self.restored, self.leases, ordered_gate=self._ordered_gate, train_on_failed=self._train_on_failed,
            continue_restored=self.continue_restored, strategy_name=self._strategy.name, incident=self.incident,
            notify=self.notify, clock=self._clock)

    # ----------------------------------------------------------------- listeners

    def add_change_listener(self, callback: Callable[[], None]) -> None:
        """`callback()` runs (under the lock, so it must be quick) after every state change."""
        with self.lock:
            self._change_listeners.append(callback)

    def add_control_listener(self, callback: Callable[[ControlEvent], None]) -> None:
        """`callback(event)` runs for every PAUSE / RESUME / SHUTDOWN, in order, under the lock."""
        with self.lock:
            self._control_listeners.append(callback)

    def add_consume_listener(self, callback: Callable[[list[TrajectoryGroup], int, float], None]) -> None:
        """`callback(groups, weight_version, now)` runs (under the lock, so it must be quick) when the trainer
        takes groups; `now` is the pacer clock, the clock of `TrajectoryGroup.dispatched_at` (for metrics)."""
        with self.lock:
            self._consume_listeners.append(callback)

    def notify(self) -> None:
        waits = self.waits
        if waits.blocked:  # notify_all is Python code under the hood: skip it when nobody waits
            waits.wake_all()
        for callback in self._change_listeners:
            callback()

    def emit(self, kind: ControlEventType, mode: ResetMode = ResetMode.UNSPECIFIED) -> None:
        event = self._control_event(kind, mode)
        for callback in self._control_listeners:
            callback(event)

    def _control_event(self, kind: ControlEventType, mode: ResetMode = ResetMode.UNSPECIFIED) -> ControlEvent:
        steps = self.steps
        return ControlEvent(kind, mode, steps.weight_version, steps.step, steps.generation, steps.paused,
                            self.totals["restores"], self.job_ended)

    def tell_resumed(self) -> None:
        """Dispatch reopened: the strategy's on_resume hook, then watchers hear RESUME."""
        if self._on_resume is not None:
            try:
                self._on_resume(self.steps.weight_version)
            except Exception as exc:  # reported; the Resume stands (dispatch must reopen)
                self.incident(HOOK_FAILED, "", "on_resume", describe_exception(exc), "resumed")
        self.emit(ControlEventType.RESUME)

    # The step boundary's state, read here; it changes only through the StepBoundary's methods.
    step = property(lambda self: self.steps.step, doc="The trainer's step (Resume adds one).")
    weight_version = property(lambda self: self.steps.weight_version, doc="The weight version of the last Resume.")
    generation = property(lambda self: self.steps.generation, doc="Reset and Restore count generations.")
    paused = property(lambda self: self.steps.paused, doc="Dispatch is paused (Reset, EndJob).")
    resetting = property(lambda self: self.steps.resetting, doc="A Reset is between its begin and finish.")

    def current_state_event(self) -> ControlEvent:
        """The STATE event a new watcher receives first."""
        with self.lock:
            return self._control_event(ControlEventType.STATE)


    def check_open(self) -> None:
        if self.closed:
            raise ShuttingDownError("the pacer is shutting down and takes no new calls")

    # ----------------------------------------------------------------- in-process calls

    def dispatch(self, candidates: Sequence[PromptRef], wait: float = 0.0, request_id: str = "",
                 client_id: str = "", max_continuations: Optional[int] = None) -> DispatchResult:
        """Admit the first k candidates the strategy allows now, after up to `max_continuations` kept restored
        groups; with `wait`, wait up to that long for one slot. `client_id` names who holds the admitted
        groups (`held_groups`)."""
        poll = self.dispatch_poll(candidates, request_id, client_id, max_continuations)
        return self.answers.once("Dispatch", request_id, lambda: self.waits.until(poll, wait))

    def submit(self, trajectories: Sequence[Trajectory], request_id: str = "",
               dispatch_seqs: Optional[Mapping[str, int]] = None) -> SubmitResult:
        """Accept finished trajectories all-or-nothing, then collect every group that became ready.
        `dispatch_seqs` (prompt id -> the seq its dispatch answered): the fence, see `check_fences`."""
        return self.answers.once("Submit", request_id,
                                 lambda: self.apply_submit(trajectories, request_id, dispatch_seqs))

    def collect(self, num_groups: int, wait: float = 0.0, allow_partial: bool = False, request_id: str = "",
                lease_seconds: float = 0.0, shape: BatchShape = PLAIN,
                trainer_step: Optional[int] = None, max_bytes: int = 0) -> CollectResult:
        """Take `num_groups` groups, oldest priority first, waiting up to `wait` seconds for them.

        Without `allow_partial`, fewer than `num_groups` at the deadline gives nothing and `timed_out`.
        With `lease_seconds` > 0 the groups are leased: they return to the buffer, in their original
        order, unless `ack(lease_id)` comes within that time (at-least-once delivery). `shape` cuts the
        mini-batch by a token budget and/or hands the caller one rank's share of it (shares.py). `max_bytes`:
        the largest answer the caller takes (0: server.max_message_bytes); see `apply_take`.
        """
        num_groups = self.checks.check_collect(num_groups, lease_seconds, shape)
        self.check_collect_reachable(num_groups, allow_partial, shape)
        self.check_open()  # once: a waiter woken by close() answers with what is there
        poll = CollectPoll(self, num_groups, allow_partial, request_id, lease_seconds, shape, trainer_step, max_bytes)
        return self.answers.once("Collect", request_id, lambda: self.waits.until(poll, wait))

    def collect_now(self, num_groups: int, allow_partial: bool = False, request_id: str = "",
                    lease_seconds: float = 0.0, shape: BatchShape = PLAIN, max_bytes: int = 0) -> CollectResult:
        """Non-waiting collect: all `num_groups`, or with `allow_partial` whatever is there."""
        num_groups = self.checks.check_collect(num_groups, lease_seconds, shape)
        self.check_collect_reachable(num_groups, allow_partial, shape)
        return self.answers.once("Collect", request_id, self.collect_poll(
            num_groups, allow_partial, request_id, lease_seconds, shape, max_bytes=max_bytes).give_up)

    def ack(self, lease_id: str, request_id: str = "") -> int:
        """The trainer has the leased groups: they are consumed for good. Returns how many."""
        self.checks.check_lease_id(lease_id)
        return self.answers.once("Ack", request_id, lambda: self.apply_ack(lease_id, request_id))

    def reset(self, mode: ResetMode = ResetMode.UNSPECIFIED, wait: Optional[float] = 0.0, resume: bool = False,
              weight_version: Optional[int] = None, request_id: str = "") -> ResetResult:
        """Pause, wait up to `wait` for running groups to assemble, restore/drop them, optionally resume.

        `wait=None`: wait until every running group is assembled: in WAIT mode for at most
        server.max_wait_seconds, in ABORT mode (the workers submit what they have as ABORTED) for at most
        server.abort_wait_seconds. `wait=0`: drop the incomplete groups now.
        """
        def call() -> ResetResult:
            effective = self.begin_reset(mode, resume=resume, weight_version=weight_version)
            with self.lock:  # ready, then finished, with no change in between
                self.waits.until(ResetPoll(self), self.reset_wait(effective, wait, self.max_wait_seconds,
                                                                  self.limits.abort_wait_seconds))
                return self.finish_reset(resume=resume, weight_version=weight_version, request_id=request_id)

        return self.answers.once("Reset", request_id, call)

    def resume(self, weight_version: int, request_id: str = "") -> ResumeResult:
        """step += 1, record the weight version, reopen dispatch, tell watchers."""
        return self.answers.once("Resume", request_id, lambda: self.apply_resume(weight_version, request_id))

    # ----------------------------------------------------------------- dispatch

    def dispatch_poll(self, candidates: Sequence[PromptRef], request_id: str = "", client_id: str = "",
                      max_continuations: Optional[int] = None) -> DispatchPoll:
        self.checks.check_max_continuations(max_continuations)
        return DispatchPoll(self, candidates, request_id, client_id, max_continuations)

    def apply_dispatch(self, candidates: Sequence[PromptRef], request_id: str = "", client_id: str = "",
                       max_continuations: Optional[int] = None,
                       continued_ids: Optional[Sequence[str]] = None) -> DispatchResult:
        """Validate the candidates and admit what the strategy allows now: first kept
        restored groups (replay names them: `continued_ids`), then candidates. `max_continuations` None (the
        default) re-offers kept groups first in place of candidates, as many as the caller proposes (LoongSage's
        data source hands out its restored groups before new prompts); a number takes up to that many on top
        (0: none, for a caller that cannot continue a partial group)."""
        with self.lock:
            if candidates:  # none is a peek at the window
                self.inflight.check_candidates(self.checks, candidates, self.restored)
            allowed = self._admissible_now()
            wanted = len(candidates) if max_continuations is None else max_continuations
            if continued_ids is not None:
                continued = self.restored.by_ids(continued_ids)
            elif wanted and allowed and self.restored:
                continued = self._fitting_continuations(self.restored.choose(min(allowed, wanted), self.steps.step))
            else:
                continued = []
            # By default the kept groups take the place of as many candidates (the caller proposed that much room).
            proposed = len(candidates) - len(continued) if max_continuations is None and continued_ids is None \
                else len(candidates)
            count = min(allowed - len(continued), proposed)
            first_seq = self.inflight.next_seq + len(continued)
            admitted_ids: list[str] = []
            if count or continued:
                now = self._clock.now()
                admitted_refs = list(candidates[:count])  # also the journal's record of this Dispatch
                group_sizes = self._group_sizes
                refs = [*(PromptRef(g.prompt_id, g.ds_index, g.epoch, g.index) for g in continued), *admitted_refs]
                groups = [InflightGroup(ref, seq, group_sizes[ref.ds_index], now, client_id)
                          for seq, ref in enumerate(refs, self.inflight.next_seq)]
                # The strategy hears first: if a custom strategy raises, the pacer is unchanged. It sees each group
                # with its trajectories as LoongSage hands them to on_dispatched: the N pending ones of a new group,
                # those a continued group brings back.
                brought = {g.prompt_id: g.trajectories for g in continued}
                try:
                    self.hooks.on_dispatched([DispatchedGroup(group, brought.get(group.prompt_id)) for group in groups])
                except Exception as exc:
                    raise self.hook_refused("on_dispatched", exc, "nothing was admitted") from exc
                self.inflight.admit(groups)
                mark = self.cursor.mark
                for ref in admitted_refs:
                    mark(ref.ds_index, ref.epoch, ref.index, ref.prompt_id)
                admitted_ids = [ref.prompt_id for ref in admitted_refs]
                if continued:
                    # Handed out again with the trajectories they had; the worker submits all N anew.
                    self.restored.take(continued)
                    self.inflight.continued(g.prompt_id for g in continued)
                    for group in continued:
                        self.held_bytes.release(group.trajectories)
                    continued = [TrajectoryGroup(g.prompt_id, seq, g.ds_index, g.trajectories, g.epoch, g.index, now)
                                 for seq, g in enumerate(continued, self.inflight.next_seq - len(groups))]
                self.leases.extend(groups, now)
                self.totals["dispatched"] += len(groups)
                self.collector.release_held(strategy_changed=True)
                self.notify()
            # Positional: a keyword call to a dataclass builds a kwargs dict and costs about twice as much.
            steps = self.steps
            result = DispatchResult(admitted_ids, first_seq, steps.paused, steps.step, steps.weight_version, steps.generation,
                                    len(self.inflight.groups), len(self.buffer.entries), self._window_size,
                                    # unchanged if nothing was admitted
                                    self._admissible_after_change() if count or continued else allowed, continued,
                                    self.job_ended)
            self.collector.clear_failures()  # a group quarantined on the way is reported; the admission stands
            if count or continued:
                self.record(Dispatched(now, admitted_refs, request_id, client_id, [g.prompt_id for g in continued],
                                        self.liveness.watched(client_id)))
            return result

    def _fitting_continuations(self, chosen: list[TrajectoryGroup]) -> list[TrajectoryGroup]:
        """The first of the chosen kept groups whose trajectories fit one Dispatch answer (server.max_message_bytes):
        the rest wait for the next Dispatch. A group too large alone is not handed out; GetState's
        restored_kept_oldest_seconds shows it waiting."""
        limit = self.limits.answer_bytes(0)
        size = ANSWER_OVERHEAD_BYTES
        for count, group in enumerate(chosen):
            size += encoded_group_bound(group)
            if limit and size > limit:
                return chosen[:count]
        return chosen

    def admissible_now(self) -> int:
        """What a Dispatch would admit now (0 while paused or closed); cheap, unlike re-validating candidates."""
        with self.lock:
            return self._admissible_now()

    def _dispatch_count(self) -> int:
        if self.steps.paused or self.closed:
            return 0
        return max(0, int(self.hooks.compute_dispatch_count(len(self.buffer.entries))))

    def _admissible_now(self) -> int:
        try:
            return self._dispatch_count()
        except Exception as exc:
            raise self.hook_refused("compute_dispatch_count", exc, "nothing was admitted") from exc

    def _admissible_after_change(self) -> int:
        """What a Dispatch would admit now, for an answer (or GetState) that must not fail: a raising
        compute_dispatch_count reads as 0 here; the next Dispatch fails with it and records it."""
        try:
            return self._dispatch_count()
        except Exception:
            return 0

    # ----------------------------------------------------------------- worker liveness

    def heard_from(self, client_id: str) -> None:
        """A call from `client_id` (a worker's heartbeat, Dispatch or Submit): it is alive."""
        self.liveness.heard(client_id, self._clock.now())

    def note_loaded_version(self, client_id: str, weight_version: int) -> None:
        """`client_id`'s engine reports `weight_version` loaded (on its Dispatch or KeepAlive), the version its
        segments are tagged with. Shown by ListWorkers; not journaled (every worker says it again)."""
        if client_id:
            with self.lock:
                self._loaded_versions[client_id] = weight_version

    def loaded_versions(self) -> dict[str, int]:
        """The weight version each worker's engine last reported loaded, by client id."""
        with self.lock:
            return dict(self._loaded_versions)

    def watch_opened(self, client_id: str) -> None:
        """`client_id` opened a control stream: it is a watched worker from now on (see liveness.py)."""
        self.liveness.stream_opened(client_id, self._clock.now())

    def watch_closed(self, client_id: str) -> None:
        self.liveness.stream_closed(client_id)

    @property
    def liveness_seconds(self) -> float:
        return self.liveness.grace

    def release_silent_workers(self) -> dict[str, list[str]]:
        """Release the incomplete running groups of watched workers silent for the liveness grace, as an
        expired lease releases them. Returns {client id: released prompt ids}. Called periodically by the server."""
        with self.lock:
            now = self._clock.now()
            gone = self.liveness.silent(now)
            if not gone or self.closed:
                return {}
            gone_set = set(gone)
            groups = [g for g in self.inflight.in_dispatch_order() if g.client_id in gone_set and not g.complete]
            if not groups:
                return {}
            released: dict[str, list[str]] = {}
            for group in groups:
                released.setdefault(group.client_id, []).append(group.prompt_id)
            prompt_ids = [group.prompt_id for group in groups]
            self.apply_expiry(prompt_ids, [])
            self.record(Expired(now, prompt_ids, []))
            return released

    # ----------------------------------------------------------------- keep-alive

    def keep_alive(self, prompt_ids: Sequence[str],
                   dispatch_seqs: Optional[Mapping[str, int]] = None) -> KeepAliveResult:
        """Renew the in-flight lease of these running groups (their worker is alive and generating).

        Not journaled: a restarted server gives every running group its full lease again anyway.
        """
        self.checks.check_keep_alive(prompt_ids)
        with self.lock:
            self.check_open()
            get = self.inflight.get
            seqs = dispatch_seqs or {}
            # A group handed out again under another dispatch is not the caller's any more: named unknown.
            running = [g for g in map(get, prompt_ids) if g is not None and seqs.get(g.prompt_id, g.seq) == g.seq]
            self.leases.extend([g for g in running if not g.complete], self._clock.now())
            known = {g.prompt_id for g in running}
            return KeepAliveResult(len(running), [p for p in prompt_ids if p not in known],
                                   self.leases.inflight_seconds, self.liveness.grace)

    # ----------------------------------------------------------------- submit

    def apply_submit(self, trajectories: Sequence[Trajectory], request_id: str = "",
                     dispatch_seqs: Optional[Mapping[str, int]] = None) -> SubmitResult:
        """Accept finished trajectories all-or-nothing, then collect every group that became ready."""
        with self.lock:
            self.check_open()
            if dispatch_seqs:
                self.check_fences(dispatch_seqs)
            self.collector.clear_failures()
            stale_before = self.totals["stale_rejected"]
            try:
                fresh, duplicates = self._sort_submit(trajectories)
            except StaleGenerationError:
                self.record(StaleRejected(self._clock.now(), self.totals["stale_rejected"] - stale_before))
                raise
            if self._on_submitted is not None:  # the strategy hears first: if it raises, nothing changed
                try:
                    for trajectory in fresh:
                        self._on_submitted(trajectory)
                except Exception as exc:
                    raise self.hook_refused("on_submitted", exc, "nothing was accepted") from exc
            completed, assembling, added_bytes = self.inflight.accept(fresh)
            self.held_bytes.add(added_bytes)
            self.leases.extend(assembling, self._clock.now())
            self.totals["submitted"] += len(fresh)
            self.totals["duplicates"] += duplicates
            self.collector.collect_ready(completed)
            if fresh or duplicates:
                self.notify()
            result = SubmitResult(len(fresh), duplicates, len(completed))  # accepted, duplicates, groups completed
            self.record(Submitted(self._clock.now(), list(trajectories), request_id))
            self.collector.raise_failures()  # accepted, but a hook raised on a group: the caller hears it (INTERNAL)
            return result

    def check_fences(self, dispatch_seqs: Mapping[str, int]) -> None:
        """Refuse a Submit from a worker that lost a group: the group was released from it (lease or liveness)
        and handed out again, so its running dispatch has another seq than the one the Submit names."""
        stale = self.inflight.stale_fences(dispatch_seqs)
        if stale:
            prompt_id, yours, now = stale[0]
            raise StaleDispatchError(
                f"group {prompt_id!r} was released from its dispatch seq {yours} (its worker went silent or its "
                f"lease ran out) and was dispatched again as seq {now}, to another worker; drop this worker's "
                f"work on it"
                + (f" ({len(stale)} groups in all)" if len(stale) > 1 else ""))

    def _sort_submit(self, trajectories: Sequence[Trajectory]) -> tuple[list[Trajectory], int]:
        """Return (new trajectories, duplicate count) or raise with every problem found; changes nothing
        but the stale count."""
        sorted_ = self.inflight.sort_submit(self.checks, trajectories)
        if sorted_.refused_as_stale:
            self.totals["stale_rejected"] += len(sorted_.stale)
        sorted_.refuse(self.steps.generation, self.inflight.remembered_generations, self.leases.inflight_seconds)
        limits = self.limits
        if limits.max_held_bytes or limits.max_buffered_groups:
            get = self.inflight.get
            self.checks.check_room(
                self.held_bytes.total, bytes_of(sorted_.fresh) if limits.max_held_bytes else 0, len(self.buffer.entries),
                sum(1 for prompt_id, added in sorted_.added_per_group.items()
                    if len(get(prompt_id).trajectories) + added == get(prompt_id).group_size))
        return sorted_.fresh, sorted_.duplicates

    # ----------------------------------------------------------------- hook failures

    def incident(self, kind: str, prompt_id: str, hook: str, message: str, action: str = QUARANTINED) -> Incident:
        incident = Incident(kind, prompt_id, self._strategy.name, hook, message, self.steps.step,
                            self.steps.generation, action)
        self.incidents.record(incident)
        return incident

    def hook_refused(self, hook: str, exc: BaseException, consequence: str) -> StrategyHookError:
        """The error of a call a raising hook stopped before it changed anything (recorded as an incident)."""
        self.incident(HOOK_FAILED, "", hook, describe_exception(exc), REFUSED)
        self.notify()
        return hook_error(self._strategy.name, hook, exc, consequence=consequence)

    def report_incidents(self) -> None:
        """Raise, once, for the incidents the trainer has not been told about : a Collect
        answers with it before taking anything, so dirty data or a broken strategy never goes unnoticed."""
        with self.lock:
            if self.incidents.has_unreported():
                raise collect_error(*self.incidents.take_unreported())

    # ----------------------------------------------------------------- collect

    def check_collect_reachable(self, num_groups: int, allow_partial: bool, shape: BatchShape = PLAIN) -> None:
        """A Collect that must have `num_groups` buffered at once (no allow_partial, no token budget) is refused
        when the window can never hold that many: it would wait forever, silently."""
        if (not allow_partial and not shape.token_budget and self.collect_limit
                and num_groups > self.collect_limit):
            raise InvalidArgumentError(
                f"num_groups {num_groups} can never be buffered at once, so this Collect could never be answered: "
                f"{self._collect_limit_terms}; ask for at most {self.collect_limit} groups a Collect "
                f"(a mini-batch of at most {self.collect_limit} x N trajectories), raise the window, or pass "
                f"allow_partial", violations=[("num_groups", f"must be at most {self.collect_limit} "
                                                             f"({self._collect_limit_terms})")])

    def collect_poll(self, num_groups: int, allow_partial: bool = False, request_id: str = "",
                     lease_seconds: float = 0.0, shape: BatchShape = PLAIN,
                     trainer_step: Optional[int] = None, max_bytes: int = 0) -> CollectPoll:
        return CollectPoll(self, num_groups, allow_partial, request_id, lease_seconds, shape, trainer_step, max_bytes)

    def check_trainer_step(self, trainer_step: Optional[int]) -> None:
        """A Collect from a trainer at another step than the server's is refused: after
        a trainer restarts from a checkpoint, the pacer must be restored to it first."""
        with self.lock:
            if trainer_step is None or trainer_step == self.steps.step:
                return
            if trainer_step < self.steps.step:
                hint = (f"the trainer is behind the server (restarted from a checkpoint?): restore first, "
                        f"PacerClient.restore() with the pacer checkpoint taken with the trainer's step-{trainer_step} "
                        f"model")
            else:
                hint = ("the trainer is ahead of the server (a step boundary without Reset/Resume, or a server that "
                        "lost its state): restore first, from the pacer checkpoint of the trainer's last model checkpoint")
            raise FailedPreconditionError(f"the trainer states step {trainer_step}, the server is at step "
                                          f"{self.steps.step}; "
                                          f"{hint}", reason="STEP_MISMATCH",
                                          violations=[("trainer_step", f"must be the server's step {self.steps.step}")])

    def ready_count(self, num_groups: int, shape: BatchShape, partial: bool = False) -> Optional[int]:
        """Groups the next Collect of this shape takes from the buffer now (0: a rank's share of a mini-batch
        already taken is waiting), or None when it is not ready; with `partial`, what is there at a deadline."""
        with self.lock:
            if shape.world_size > 1 and self.leases.claimable(shape.key(num_groups), shape.rank):
                return 0
            available = len(self.buffer.entries)
            if shape.token_budget:
                count = budget_count(self.buffer.entries, shape.token_budget, num_groups, shape.world_size)
                return count if count is not None or not partial or available < shape.world_size else available
            if available >= num_groups:
                return num_groups
            return available if partial and available >= shape.world_size else None

    def apply_take(self, count: int, timed_out: bool, request_id: str = "", lease_seconds: float = 0.0,
                   shape: BatchShape = PLAIN, num_groups: int = 0, max_bytes: int = 0) -> CollectResult:
        """Hand `count` groups from the buffer to the trainer, leased when `lease_seconds` > 0.
        A rank's share (`shape.world_size` > 1) is the oldest one waiting for it, or with `count` > 0 its share of
        a new mini-batch of `count` groups; `num_groups` (what the Collect asked for) tells the ranks of one
        trainer apart from another's.

        Fewer (`cut_to_fit`) when the answer would be larger than the caller can receive (`max_bytes`, within
        server.max_message_bytes): whole groups, oldest first, the rest stay buffered. A first group (or a rank's
        share) larger than that alone is refused (MessageTooLargeError) before anything is taken."""
        with self.lock:
            now = self._clock.now()
            limit = self.limits.answer_bytes(max_bytes)
            cut_to_fit = False
            if shape.world_size > 1:
                lease = self._take_share(count, lease_seconds, shape.key(num_groups), shape, now, limit)
                result = CollectResult([group for _, group in lease.entries], timed_out=timed_out, lease_id=lease.lease_id)
            else:
                entries = self.buffer.pop_fitting(count, limit)
                cut_to_fit, count = len(entries) < count, len(entries)
                if lease_seconds > 0:
                    lease = self.leases.grant(entries, lease_seconds, now)
                    self.notify()
                    result = CollectResult([group for _, group in lease.entries], timed_out=timed_out,
                                           lease_id=lease.lease_id, cut_to_fit=cut_to_fit)
                else:
                    groups = [group for _, group in entries]
                    self._consume(groups)
                    result = CollectResult(groups, timed_out=timed_out, cut_to_fit=cut_to_fit)
            self.record(Collected(now, count, timed_out, request_id, lease_seconds, shape.token_budget, shape.rank,
                                   shape.world_size, num_groups))
            return result

    def _take_share(self, count: int, lease_seconds: float, key: tuple, shape: BatchShape, now: float,
                    limit: int = 0) -> CollectLease:
        if not count:
            lease = self.leases.claim(key, shape.rank, now)
            if lease is None:
                raise RuntimeError("recovery diverged: no share of a data-parallel mini-batch waits for this rank")
            return lease
        entries = self.buffer.pop(count)
        shares = balanced_shares([group_tokens(group) for _, group in entries], shape.world_size,
                                 equal_counts=not shape.token_budget)
        if limit:  # every rank's share must reach it: refused, nothing taken, when one would not fit
            sizes = [ANSWER_OVERHEAD_BYTES + sum(encoded_group_bound(entries[i][1]) for i in share) for share in shares]
            if max(sizes) > limit:
                self.buffer.push_all(entries)
                largest = shares[sizes.index(max(sizes))]
                raise MessageTooLargeError(f"a rank's share ({len(largest)} groups, from "
                                           f"{entries[largest[0]][1].prompt_id})", max(sizes), limit)
        lease = self.leases.grant_shares(key, [[entries[i] for i in share] for share in shares], shape.rank,
                                          lease_seconds, now)
        self.notify()
        return lease

    def apply_ack(self, lease_id: str, request_id: str = "") -> int:
        with self.lock:
            self.check_open()
            lease = self.leases.acknowledge(lease_id)
            self._consume([group for _, group in lease.entries])
            # The caller has the answer it acknowledges: a retry of that Collect cannot come any more, and a
            # remembered answer would keep the consumed trajectories alive.
            self.answers.forget("Collect", lambda answer: answer.lease_id == lease_id)
            self.record(Acked(self._clock.now(), lease_id, request_id))
            return len(lease.entries)

    def _consume(self, groups: list[TrajectoryGroup]) -> None:
        """The trainer has these groups for good: count them, free their bytes (the pacer keeps only each
        trajectory's content key, for duplicate detection), tell listeners."""
        if self._on_consumed is not None:
            try:
                self._on_consumed(groups)
            except Exception as exc:  # reported; the trainer has the groups all the same
                self.incident(HOOK_FAILED, "", "on_consumed", describe_exception(exc), "consumed")
        self.totals["consumed"] += len(groups)
        for group in groups:
            self.steps.tally.count_consumed(group)
            self.held_bytes.release(group.trajectories)
        self.inflight.consumed(groups)
        if self._consume_listeners:
            now = self._clock.now()
            for callback in self._consume_listeners:
                callback(groups, self.steps.weight_version, now)
        self.notify()

    def expire_leases(self) -> tuple[list[str], list[str]]:
        """Reclaim what ran out: in-flight groups (their slots) and Collect leases (back to the buffer).

        Returns (expired prompt ids, expired lease ids). Called periodically by the server.
        """
        with self.lock:
            now = self._clock.now()
            prompt_ids = [group.prompt_id for group in self.leases.running_out(now, self.inflight)]
            lapsed = self.leases.lapsing(now)
            if prompt_ids or lapsed:
                self.apply_expiry(prompt_ids, lapsed)
                self.record(Expired(now, prompt_ids, lapsed))
            return prompt_ids, lapsed

    def apply_expiry(self, prompt_ids: list[str], lease_ids: list[str]) -> None:
        with self.lock:
            self.collector.expire(prompt_ids, lease_ids)

    def recheck_gates(self, min_age: float = 0.0) -> int:
        """Re-examine the held groups (the strategy refused them) although nothing changed: a gate that opens
        with time or on an outside flag releases its groups. Skipped when a re-examination ran less than
        `min_age` seconds ago. Returns how many groups left the trajectory queue. Called periodically by the
        server (fully_async.gate_recheck_seconds)."""
        with self.lock:
            now = self._clock.now()
            if not self.collector.holds_groups or self.closed or now - self.collector.last_gate_pass < min_age:
                return 0
            released = self.apply_gate_recheck()
            if released:
                self.record(GatesRechecked(now))
            return released

    def apply_gate_recheck(self) -> int:
        with self.lock:
            return self.collector.recheck()

    # ----------------------------------------------------------------- reset / resume

    def begin_reset(self, mode: ResetMode = ResetMode.UNSPECIFIED, *, resume: bool = False,
                    weight_version: Optional[int] = None) -> ResetMode:
        """Step 1 of a Reset: pause dispatch and tell watchers. Returns the effective mode."""
        return reset_steps.begin(self, mode, resume, weight_version)

    def reset_ready(self) -> bool:
        """True when every running group holds all its trajectories (any status)."""
        return reset_steps.ready(self)

    def reset_poll(self) -> ResetPoll:
        return ResetPoll(self)

    @staticmethod
    def reset_wait(mode: ResetMode, wait: Optional[float], until_assembled: float,
                   abort_wait: float = 0.0) -> float:
        """The seconds a Reset waits: `wait` when given; absent, until every running group is assembled, for
        at most `until_assembled` (the bound on any such wait: server.max_wait_seconds and the call's
        deadline): in WAIT mode as a waiting pause does in LoongSage; in ABORT mode within `abort_wait` too
        (server.abort_wait_seconds, the time engines need to abort), as LoongSage's abort gathers the aborted
        partial trajectories before its boundary clean-up, so every running group is restored."""
        if wait is not None:
            return wait
        return until_assembled if mode == ResetMode.WAIT else min(until_assembled, abort_wait)

    def finish_reset(self, *, resume: bool = False, weight_version: Optional[int] = None,
                     request_id: str = "") -> ResetResult:
        """Steps 3-6 of a Reset: restore complete groups, drop incomplete ones, clear, optionally resume."""
        return reset_steps.finish(self, resume, weight_version, request_id)

    def abandon_reset(self) -> None:
        """Used when a Reset cannot finish (shutdown): leave the pause on, allow a later Reset."""
        reset_steps.abandon(self)

    def apply_resume(self, weight_version: int, request_id: str = "") -> ResumeResult:
        """step += 1, record the weight version, reopen dispatch, tell watchers."""
        return reset_steps.resume(self, weight_version, request_id)

    # ----------------------------------------------------------------- the end of the job

    def begin_end_job(self, mode: ResetMode = ResetMode.UNSPECIFIED) -> ResetMode:
        """Close dispatch for good and tell watchers JOB_ENDED (once). Returns the effective mode."""
        return job_end.begin(self, mode)

    def job_end_report(self, waited_seconds: float = 0.0) -> "JobEndReport":
        """What the job left: buffered, leased, held, in-flight, kept, expired and quarantined groups."""
        return job_end.report(self, waited_seconds)

    def end_job(self, mode: ResetMode = ResetMode.UNSPECIFIED, wait: float = 0.0, request_id: str = "") -> JobEndReport:
        """End the job: close dispatch, wait up to `wait` for the running groups to be assembled, report."""
        def call() -> JobEndReport:
            self.begin_end_job(mode)
            started = self._clock.now()
            with self.lock:
                self.waits.until(ResetPoll(self), wait)
                return self.job_end_report(self._clock.now() - started)

        return self.answers.once("EndJob", request_id, call)

    # ----------------------------------------------------------------- journal, state, shutdown

    @property
    def journal(self) -> Optional[Journal]:
        return self.recorder.journal

    @property
    def clock(self) -> PacerClock:
        """The pacer's clock (pinned to each event's time while the journal is replayed)."""
        return self._clock

    @property
    def last_ticket(self) -> int:
        """The journal ticket of the latest recorded change (what a caller waits on to be durable)."""
        return self.recorder.last_ticket

    def export_state(self) -> dict:
        """A consistent copy of everything a Reset leaves behind (nothing is in flight then), for a snapshot."""
        return recovery.export_state(self)

    def checkpoint(self) -> dict:
        """What the pacer needs to continue from the current step (checkpoints.py), taken without pausing."""
        return checkpoints.take(self)

    def restore(self, checkpoint: dict, request_id: str = "") -> RestoreResult:
        """Bring the pacer back to `checkpoint` (a dict from `checkpoint()`), see checkpoints.restore."""
        return self.answers.once("Restore", request_id, lambda: self.apply_restore(checkpoint, request_id))

    def apply_restore(self, checkpoint: dict, request_id: str = "") -> RestoreResult:
        with self.lock:
            result = checkpoints.restore(self, checkpoint)
            if self.recorder.recording:
                # Journalled as a snapshot (nothing is in flight now) holding this answer, as a Reset's end is.
                self.answers.remember("Restore", request_id, result)
                self.recorder.snapshot(self.export_state())
            return result

    def prompt_cursor(self) -> dict:
        """The prompts admitted so far (cursor.py), as plain data, with the number of Restores."""
        with self.lock:
            return {**self.cursor.export(), "restores": self.totals["restores"]}

    def recover(self) -> int:
        """Rebuild the state from the journal (see recovery.py); returns the number of events replayed."""
        return recovery.recover(self)

    @property
    def strategy(self) -> Any:
        """The pacing strategy as configured (a `ThreadSafeStrategy` proxy unless one was passed in)."""
        return self._strategy

    def running_groups(self) -> list[TrajectoryGroup]:
        """Copies of the groups in flight (dispatched, not yet out of the trajectory queue), in dispatch order."""
        with self.lock:
            return [group.to_group() for group in self.inflight.in_dispatch_order()]

    def held_groups(self, client_id: Optional[str] = None) -> list[HeldGroup]:
        """The running groups (all, or those `client_id` dispatched), oldest first: which worker holds what."""
        with self.lock:
            now = self._clock.now()
            return [HeldGroup(g.prompt_id, g.seq, g.ds_index, g.client_id, max(0.0, now - g.dispatched_at),
                              len(g.trajectories), g.group_size, max(0.0, g.deadline - now))
                    for g in self.inflight.in_dispatch_order()
                    if client_id is None or g.client_id == client_id]

    def state(self, waiting_calls: int = 0, ages: bool = False) -> PacerState:
        """Every counter, read under the lock; `waiting_calls` is the caller's count of waiting long-polls. With
        `ages`, the clock-dependent gauges too (restored_kept_oldest_seconds; GetState and the metrics ask for
        them), else 0, so two states taken with nothing changed in between compare equal."""
        with self.lock:
            return PacerState(waiting_calls=waiting_calls,
                running=len(self.inflight.groups), buffered=len(self.buffer.entries),
                queued_trajectories=self.inflight.queued_trajectories, capacity=self._admissible_after_change(),
                window_size=self._window_size, step=self.steps.step, weight_version=self.steps.weight_version,
                generation=self.steps.generation, paused=self.steps.paused, resetting=self.steps.resetting,
                strategy=self._strategy.name, config_summary=dict(self.summary),
                leased=self.leases.leased_groups, held_bytes=self.held_bytes.total, restored_kept=len(self.restored),
                restored_kept_oldest_seconds=self.restored.oldest_age() if ages else 0.0,
                last_checkpoint_step=self.last_checkpoint[0] if self.last_checkpoint else -1,
                last_checkpoint_weight_version=self.last_checkpoint[1] if self.last_checkpoint else -1,
                last_restore_step=self.last_restore[0] if self.last_restore else -1,
                last_restore_weight_version=self.last_restore[1] if self.last_restore else -1,
                stale_steps=self._stale_steps,
                collect_limit=self.collect_limit,
                recent_reports=self.steps.reports, recent_incidents=self.incidents.recent(), **self.totals,
                job_ended=self.job_ended, prompts_per_step=self._prompts_per_step,
                group_sizes=list(self._group_sizes), mini_batch_size=self._mini_batch_size,
            )

    def close(self) -> None:
        """Shut down: waiters return at once with their flags, watchers get SHUTDOWN, new calls fail."""
        with self.lock:
            if self.closed:
                return
            self.closed = True
            self.emit(ControlEventType.SHUTDOWN)
            self.notify()
