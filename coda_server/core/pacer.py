"""The Pacer: the pacing rule (dispatch, submit, collect) over one strategy and its state's owners; the one lock.

Each piece of state belongs to an owner that changes it only through its methods: the in-flight table and the
held bytes (inflight.py), the pipeline buffer (buffer.py), the collector (collector.py: gate, filters, quarantine,
expiry), delivery to the trainer (delivery.py), the step boundary (steps.py), leases, liveness, kept groups, the
prompt cursor, answers, incidents, the listeners (signals.py), the lifecycle (job_end.py), the recorder
(journal.py) and the clock (clock.py). The Pacer builds them, holds a reference to each, is where a Dispatch,
Submit or Collect crosses them, and owns the one lock (docs/architecture.md). The step boundary's calls (Reset,
Resume, EndJob), trainer checkpoints, the snapshot and recovery are objects built here over the owners they
cross (reset_steps.py, checkpoints.py, recovery.py); the waiting calls' polls are in polls.py.
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable, Mapping, Optional, Sequence

from .answers import AnswerBook
from .buffer import PipelineBuffer
from .checkpoints import Checkpoints
from .checks import CollectLimit, RequestChecks
from .clock import PacerClock
from .collector import Collector
from .config import config_summary
from .cursor import PromptCursor
from .delivery import Delivery
from .dispatching import Admission
from .filters import GroupFilter, create_filters
from .incidents import HookFailures, IncidentLog, collect_error
from .inflight import HeldBytes, InflightTable
from .intake import Intake
from .job_end import Lifecycle, report
from .journal import Acked, Collected, Expired, GatesRechecked, Journal, JournalEvent, Recorder
from .leases import LAPSED_UNKNOWN, RAN_OUT, RELEASED, Leases, started_again
from .limits import Limits
from .liveness import Liveness
from .polls import CollectPoll, DispatchPoll, ResetPoll
from .recovery import Recovery, Snapshot
from .replay import BufferReplayStrategy, RestoredGroups, create_replay_strategies
from .reset_steps import BoundaryCalls, reset_wait
from .settings import setting
from .shares import PLAIN, BatchShape
from .signals import Signals
from .state import COUNTER_NAMES, PacerState, StateReader
from .steps import StepBoundary
from .strategy import BufferView, ThreadSafeStrategy, create_strategy, gate_is_ordered, overridden_hook, window_size
from .types import (CollectResult, ControlEvent, ControlEventType, DispatchResult, JobEndReport, PromptRef, ResetMode,
                    RestoreResult, SubmitResult, Trajectory, TrajectoryGroup)
from .waiting import ThreadWaits
from .in_process import InProcessCalls
from .views import PacerViews
from .workers import Workers

log = logging.getLogger("coda_server.leases")


class Pacer(InProcessCalls, PacerViews):
    """Thread-safe pacing state machine; every operation is atomic under one lock.

    In-process callers use `dispatch`, `submit`, `collect`, `ack`, `release`, `reset`, `resume`: each runs through
    the request-id answers (`AnswerBook.once`) and, when it waits, blocks its thread (`ThreadWaits`).
    The asyncio face (`AsyncPacer`) builds the same calls from the same parts: the `apply_*` changes and
    the `*_poll` waits, awaited instead of blocked on.

    The lock: `lock` is the Pacer's own re-entrant lock. Every public method that reads or changes state takes
    it itself, so no caller has to; a caller holds it only to make several calls one atomic step (a Poll's
    attempt, a Reset's wait and finish). The owners take no lock of their own: they are reached only under it.
    The strategy proxy runs under it too (given it, or adopting it with `run_under`): holding it is holding
    both, as every hook requires, and the pacer calls the strategy itself without the proxy taking it again.
    """

    def __init__(self, config: Any, *, strategy: Optional[ThreadSafeStrategy] = None,
                 filters: Optional[list[GroupFilter]] = None, clock: Callable[[], float] = time.monotonic,
                 journal: Optional[Journal] = None, replay_strategies: Optional[list[BufferReplayStrategy]] = None):
        self.config = config
        # GetState reports these on every call: read once (an OmegaConf lookup costs more than the rest of it).
        self._prompts_per_step = int(config.data_sources[0].num_prompts_per_step)
        self._mini_batch_size = int(config.trainer.mini_batch_size)
        self._clock = PacerClock(clock)  # pinned to each event's time while the journal is replayed
        self.recorder = Recorder(journal)  # where acknowledged changes are recorded; None keeps state in memory only
        self.record: Callable[[JournalEvent], None] = self.recorder.record  # record(event): one acknowledged change
        self.lock = threading.RLock()  # the one lock (see the class docstring)
        self._strategy = strategy if strategy is not None else create_strategy(config, lock=self.lock)
        proxied = isinstance(self._strategy, ThreadSafeStrategy)
        if proxied:
            self._strategy.run_under(self.lock)
        self.hooks = hooks = self._strategy.wrapped if proxied else self._strategy
        # The optional hooks: called only when the strategy defines them (on_submitted runs per trajectory).
        self._on_submitted = overridden_hook(hooks, "on_submitted")
        self._on_consumed = overridden_hook(hooks, "on_consumed")
        self._on_resume = overridden_hook(hooks, "on_resume")
        filters = filters if filters is not None else create_filters(list(config.rollout.filter), config)
        self._group_sizes = [int(s.num_trajectories_per_prompt) for s in config.data_sources]
        self._window_size = window_size(config)
        self._stale_steps = float(setting(config, "fully_async.stale_steps"))
        self.limits = limits = Limits.from_config(config)
        # The most groups a Collect may wait for: more can never be buffered at once (0: no bound known).
        self.collect_bound = CollectLimit(config, hooks, limits)
        self.collect_limit = self.collect_bound.limit
        # Restored groups: kept and re-offered for continuation, or handed to the Reset's caller (the old way).
        continue_restored = bool(setting(config, "rollout.continue_restored"))
        self.checks = RequestChecks(limits, self._group_sizes, continue_restored)
        default_mode = ResetMode.ABORT if bool(setting(config, "rollout.partial")) else ResetMode.WAIT
        self.restored = RestoredGroups(self._clock, create_replay_strategies(config) if replay_strategies is None
                                       else replay_strategies)
        self.summary = config_summary(config)
        self.max_wait_seconds = float(setting(config, "server.max_wait_seconds"))
        # How often held groups are re-examined with nothing changed (the server's timer; 0: never).
        self.gate_recheck_seconds = float(setting(config, "fully_async.gate_recheck_seconds"))

        # The owners of the state.
        self.lifecycle = Lifecycle()  # shut down? the job ended?
        self.check_open = self.lifecycle.check_open
        self.waits = ThreadWaits(self.lock, self._clock, lambda: self.lifecycle.closed)
        self.inflight = InflightTable(limits.remembered_generations)
        self.answers = AnswerBook(limits, self.lock, self.checks.check_request_id,
                                  retry_checks={"Submit": self.inflight.check_retried_submit})
        self.leases = Leases(limits.inflight_lease_seconds)
        self.liveness = Liveness(limits.worker_liveness_seconds, limits.trainer_liveness_seconds)
        self.buffer = buffer = PipelineBuffer()
        attach = getattr(hooks, "attach", None)  # a strategy not derived from SlidingWindowStrategy may lack it
        if attach is not None:  # the strategy's clock and buffer view are this pacer's (the clock pinned in replay)
            attach(self._clock, BufferView(lambda: buffer.entries))
        self.incidents = IncidentLog(limits.incidents_kept)
        self.cursor = PromptCursor()  # the prompts admitted so far (offered again after a Restore)
        self.held_bytes = HeldBytes()  # bytes of trajectories queued, buffered, leased or set aside
        self.steps = steps = StepBoundary(limits.step_reports_kept)
        self.totals = dict.fromkeys(COUNTER_NAMES, 0)  # one per counter of PacerState
        self.signals = signals = Signals(self.waits, steps, self.totals, self.lifecycle)
        self.notify, self.emit = signals.notify, signals.emit
        self.failures = HookFailures(self.incidents, self._strategy.name, steps, signals.notify)
        self.incident, self.hook_refused = self.failures.incident, self.failures.refused
        # A group still holding a FAILED trajectory after the filters is quarantined, not trained on, unless asked.
        self.collector = Collector(
            hooks, filters, self.inflight, buffer, self.held_bytes, steps.tally, self.totals, self.restored,
            self.leases, ordered_gate=gate_is_ordered(hooks),
            train_on_failed=bool(setting(config, "rollout.train_on_failed")), continue_restored=continue_restored,
            strategy_name=self._strategy.name, incident=self.incident, notify=signals.notify, clock=self._clock)
        self.admission = Admission(
            hooks, self.checks, limits, self.inflight, self.restored, self.cursor, self.held_bytes, self.leases,
            self.collector, steps, buffer, self.lifecycle, self.liveness, self.totals, signals, self.failures,
            self.recorder, self._clock, self._group_sizes, self._window_size)
        self.intake = Intake(self.checks, limits, self.inflight, self.held_bytes, self.leases, buffer, self.collector,
                             steps, self.totals, signals, self.failures, self.recorder, self._clock, self._on_submitted)
        self.delivery = Delivery(buffer, self.leases, self.inflight, steps, self.held_bytes, self.totals,
                                 self.answers, signals, self.failures, limits, self._on_consumed, self.collect_limit)

        # The calls that cross many owners at once, each an object given the owners it crosses.
        self.checkpoints = Checkpoints(
            self.lock, self.lifecycle, steps, self.inflight, self.collector, buffer, self.leases, self.restored,
            self.cursor, self.held_bytes, self.totals, self.answers, hooks, signals, self.failures, self._clock,
            self.summary)
        self.snapshots = Snapshot(
            self.lock, steps, self.inflight, self.totals, buffer, self.answers, self.leases, self.held_bytes,
            self.restored, self.incidents, self.collector, self.cursor, self.checkpoints, self.lifecycle, hooks,
            self.failures, self._clock, self.summary, self._strategy.name)
        self.boundary = BoundaryCalls(
            self.lock, self.lifecycle, self.checks, steps, self.inflight, self.collector, self.restored,
            self.held_bytes, self.leases, buffer, self.totals, hooks, signals, self.failures, self.recorder,
            self.answers, self._clock, self.limits, default_mode=default_mode, continue_restored=continue_restored,
            on_resume=self._on_resume, snapshot=self.snapshots.export, streams=self.liveness.streams)
        self.workers = workers = Workers(self.lock, self.lifecycle, self.checks, self.inflight, self.leases,
                                         self.liveness, self.collector, self.delivery, self.recorder, self._clock)
        # The calls about workers are Workers' (workers.py); Reset's steps, Resume and EndJob are BoundaryCalls'
        # (reset_steps.py): here under the names the servers call.
        self.heard_from, self.watch_opened = workers.heard_from, workers.watch_opened
        self.watch_closed, self.release_silent_workers = workers.watch_closed, workers.release_silent_workers
        self.note_loaded_version, self.loaded_versions = workers.note_loaded_version, workers.loaded_versions
        self.held_groups, self.keep_alive, self.held_leases = workers.held_groups, workers.keep_alive, workers.held_leases
        boundary = self.boundary
        self.begin_reset, self.reset_ready, self.finish_reset = boundary.begin, boundary.ready, boundary.finish
        self.abandon_reset, self.apply_resume = boundary.abandon, boundary.resume
        self.tell_resumed, self.begin_end_job = boundary.tell_resumed, boundary.end_job
        self.recovery = Recovery(
            self.lock, self.recorder, self.snapshots, self.boundary, steps, self.inflight, self.leases,
            self.liveness, self.collector, self.answers, self.totals, self._clock, dispatch=self.apply_dispatch,
            submit=self.apply_submit, take=self.apply_take, ack=self.apply_ack, workers=workers)
        # read_state(waiting_calls, ages): a reading of the state (StateReader), as a PacerState by `state_of`.
        self.state_reader = StateReader(
            self.lock, steps, self.checkpoints, self.inflight, buffer, self.admission, self.leases, self.held_bytes,
            self.restored, self.incidents, self.totals, self.lifecycle, self.recorder, dict(
            window_size=self._window_size, strategy=self._strategy.name, config_summary=self.summary,
            stale_steps=self._stale_steps, collect_limit=self.collect_limit, prompts_per_step=self._prompts_per_step,
            group_sizes=self._group_sizes, mini_batch_size=self._mini_batch_size))
        self.read_state, self.state_of = self.state_reader.read, self.state_reader.state

    # ----------------------------------------------------------------- listeners and read-only views

    def add_change_listener(self, callback: Callable[[], None]) -> None:
        """`callback()` runs (under the lock, so it must be quick) after every state change."""
        with self.lock:
            self.signals.add_change_listener(callback)

    def add_control_listener(self, callback: Callable[[ControlEvent], None]) -> None:
        """`callback(event)` runs for every PAUSE / RESUME / SHUTDOWN, in order, under the lock."""
        with self.lock:
            self.signals.add_control_listener(callback)

    def add_consume_listener(self, callback: Callable[[list[TrajectoryGroup], int, float], None]) -> None:
        """`callback(groups, weight_version, now)` runs (under the lock, so it must be quick) when the trainer
        takes groups; `now` is the pacer clock, the clock of `TrajectoryGroup.dispatched_at` (for metrics)."""
        with self.lock:
            self.signals.add_consume_listener(callback)

    def current_state_event(self) -> ControlEvent:
        """The STATE event a new watcher receives first."""
        with self.lock:
            return self.signals.control_event(ControlEventType.STATE)

    # ----------------------------------------------------------------- dispatch

    def dispatch_poll(self, candidates: Sequence[PromptRef], request_id: str = "", client_id: str = "",
                      max_continuations: Optional[int] = None, max_response_bytes: int = 0) -> DispatchPoll:
        self.checks.check_max_continuations(max_continuations)
        return DispatchPoll(self, candidates, request_id, client_id, max_continuations, max_response_bytes)

    def peek(self, request_id: str = "") -> DispatchResult:
        """`dispatch` without candidates or `max_continuations`: the window as it is (Admission.peek), at once (a
        poll's first attempt answers it), under the lock taken once, remembered under `request_id` alike."""
        with self.lock:
            return self.answers.once("Dispatch", request_id, self.admission.peek, ())

    def apply_dispatch(self, candidates: Sequence[PromptRef], request_id: str = "", client_id: str = "",
                       max_continuations: Optional[int] = None,
                       continued_ids: Optional[Sequence[str]] = None, *, max_response_bytes: int = 0) -> DispatchResult:
        """Validate the candidates and admit what the strategy allows now (dispatching.py): first kept
        restored groups (replay names them: `continued_ids`), then candidates. `max_continuations` None (the
        default) re-offers kept groups first in place of candidates, as many as the caller proposes (LoongSage's
        data source hands out its restored groups before new prompts); a number takes up to that many on top
        (0: none, for a caller that cannot continue a partial group). The kept groups handed out are those whose
        trajectories fit one answer of `max_response_bytes` (the caller's limit; 0: the server's)."""
        with self.lock:
            return self.admission.admit(candidates, request_id, client_id, max_continuations, continued_ids,
                                        max_response_bytes)

    def admissible_now(self) -> int:
        """What a Dispatch would admit now (0 while paused or closed); cheap, unlike re-validating candidates."""
        with self.lock:
            return self.admission.admissible_now()

    # ----------------------------------------------------------------- submit

    def apply_submit(self, trajectories: Sequence[Trajectory], request_id: str = "",
                     dispatch_seqs: Optional[Mapping[str, int]] = None) -> SubmitResult:
        """Accept finished trajectories all-or-nothing, then collect every group that became ready (intake.py)."""
        with self.lock:
            self.check_open()
            return self.intake.accept(trajectories, request_id, dispatch_seqs)

    # ----------------------------------------------------------------- collect

    def report_incidents(self) -> None:
        """Raise, once, for the incidents the trainer has not been told about : a Collect
        answers with it before taking anything, so dirty data or a broken strategy never goes unnoticed."""
        with self.lock:
            if self.incidents.has_unreported():
                raise collect_error(*self.incidents.take_unreported())

    def collect_must_attempt(self, trainer_step: Optional[int]) -> bool:
        """A waiting Collect answers now, whatever is buffered: what report_incidents, check_trainer_step raise for."""
        with self.lock:
            return self.incidents.has_unreported() or self.steps.differs(trainer_step)

    def check_collect_reachable(self, num_groups: int, allow_partial: bool, shape: BatchShape = PLAIN) -> None:
        """Refuse a Collect that could never be answered (see `CollectLimit.check`)."""
        self.collect_bound.check(num_groups, allow_partial, shape, len(self.buffer))

    def collect_poll(self, num_groups: int, allow_partial: bool = False, request_id: str = "",
                     lease_seconds: float = 0.0, shape: BatchShape = PLAIN, trainer_step: Optional[int] = None,
                     max_bytes: int = 0, holder: str = "", named_at_grant: bool = False) -> CollectPoll:
        return CollectPoll(self, num_groups, allow_partial, request_id, lease_seconds, shape, trainer_step, max_bytes,
                           holder, named_at_grant)

    def check_trainer_step(self, trainer_step: Optional[int]) -> None:
        """Refuse a Collect from a trainer at another step than the server's (see `StepBoundary.check_trainer_step`)."""
        with self.lock:
            self.steps.check_trainer_step(trainer_step)

    def ready_count(self, num_groups: int, shape: BatchShape, partial: bool = False) -> Optional[int]:
        """Groups the next Collect of this shape takes from the buffer now, or None (see `Delivery.ready_count`)."""
        with self.lock:
            return self.delivery.ready_count(num_groups, shape, partial)

    def end_earlier_run(self, num_groups: int, shape: BatchShape) -> None:
        """A rank Collect naming another run than the one its shape's last mini-batch was cut under: the shares cut
        under that earlier run end now, claimed or not, recorded as the expiry it is, before the Collect takes
        (Leases.run_change). Its take then makes the run its shape's."""
        if not shape.run:  # the usual Collect: no lookup
            return
        with self.lock:
            ended = self.leases.run_change(shape.key(num_groups), shape.run)
            if ended:
                log.info("the ranks started again as run %r: %d share(s) of their earlier run (%s) went back to the "
                         "buffer, so that every rank starts from one new global mini-batch", shape.run, len(ended),
                         ", ".join(ended))
                self.expire([], ended, started_again(shape.run))

    def apply_take(self, count: int, timed_out: bool, request_id: str = "", lease_seconds: float = 0.0,
                   shape: BatchShape = PLAIN, num_groups: int = 0, max_bytes: int = 0, split: Sequence[int] = (),
                   holder: str = "", named_at_grant: bool = False) -> CollectResult:
        """Hand `count` groups from the buffer to the trainer, leased when `lease_seconds` > 0. A rank's share
        (`shape.world_size` > 1) is the oldest one waiting for it, or with `count` > 0 its share of a new mini-batch
        of `count` groups, split as `split` says when a replay gives one (`Collected.split`); `num_groups` (what the
        Collect asked for) tells the ranks of one trainer apart from another's. `holder`: a heartbeating trainer's
        client id, watched from now on: its silence ends the lease too (liveness.py); `named_at_grant`: the lease
        counts as named by it now (`Leases.named_at_grant`). Fewer (`cut_to_fit`) when the answer would be larger
        than the caller can receive (`max_bytes`, within server.max_message_bytes): whole groups, oldest first, the
        rest stay buffered. A first group (or a rank's share) larger than that alone is refused
        (MessageTooLargeError) before anything is taken."""
        with self.lock:
            now = self._clock.now()
            result, count, split = self.delivery.take(count, timed_out, lease_seconds, shape, num_groups, max_bytes,
                                                      now, split, holder)
            if holder and result.lease_id:
                self.liveness.watch([holder], now)
                if named_at_grant:
                    self.leases.named_at_grant(result.lease_id, now)
            self.record(Collected(now, count, timed_out, request_id, lease_seconds, shape.token_budget, shape.rank,
                                   shape.world_size, num_groups, split, holder, shape.run))
            return result

    def apply_ack(self, lease_id: str, request_id: str = "") -> int:
        with self.lock:
            self.check_open()
            now = self._clock.now()
            count = self.delivery.ack(lease_id, now)
            self.record(Acked(now, lease_id, request_id))
            return count

    def apply_release(self, lease_id: str) -> int:
        # No request id: a Release is journaled as the expiry it is, which carries none.
        with self.lock:
            self.check_open()
            groups = self.leases.releasable(lease_id)
            if groups:
                self.expire([], [lease_id], RELEASED)
            return groups

    def expire_leases(self) -> tuple[list[str], list[str]]:
        """Reclaim what ran out: in-flight groups (their slots) and Collect leases (back to the buffer). Returns
        (expired prompt ids, expired lease ids). Called periodically by the server."""
        with self.lock:
            now = self._clock.now()
            prompt_ids = [group.prompt_id for group in self.leases.running_out(now, self.inflight)]
            lapsed = self.leases.lapsing(now)
            if prompt_ids or lapsed:
                self.expire(prompt_ids, lapsed, RAN_OUT)
            return prompt_ids, lapsed

    def restart_clocks(self) -> None:
        """Every lease gets its full time again from now, and every watched client counts as heard now: the time
        the server refused their calls (its state directory could not be written) does not count against them."""
        with self.lock:
            now = self._clock.now()
            self.leases.restart_clocks(now, self.inflight.values())
            self.liveness.restart_clocks(now)

    def expire(self, prompt_ids: list[str], lease_ids: list[str], why: str = LAPSED_UNKNOWN) -> None:
        """These in-flight groups and Collect leases end now, recorded (`why`: what an Ack of such a lease is told)."""
        with self.lock:
            self.collector.expire(prompt_ids, lease_ids, why)
            self.record(Expired(self._clock.now(), prompt_ids, lease_ids, why))

    def recheck_gates(self, min_age: float = 0.0) -> int:
        """Re-examine the held groups (the strategy refused them) although nothing changed: a gate that opens
        with time or on an outside flag releases its groups. Skipped when a re-examination ran less than
        `min_age` seconds ago. Returns how many groups left the trajectory queue. Called periodically by the
        server (fully_async.gate_recheck_seconds)."""
        with self.lock:
            now = self._clock.now()
            collector = self.collector
            if not collector.holds_groups or self.lifecycle.closed or now - collector.last_gate_pass < min_age:
                return 0
            released = self.apply_gate_recheck()
            if released:
                self.record(GatesRechecked(now))
            return released

    def apply_gate_recheck(self) -> int:
        with self.lock:
            return self.collector.recheck()

    # ----------------------------------------------------------------- the step boundary (reset_steps.py)

    def reset_poll(self) -> ResetPoll:
        return ResetPoll(self)

    reset_wait = staticmethod(reset_wait)

    def job_end_report(self, waited_seconds: float = 0.0) -> JobEndReport:
        """What the job left: buffered, leased, held, in-flight, kept, expired and quarantined groups."""
        with self.lock:
            return report(self.lifecycle.job_end_mode, waited_seconds, self.inflight, self.buffer, self.leases,
                          self.restored, self.collector, self.state())

    # ----------------------------------------------------------------- journal, checkpoints, state, shutdown

    def export_state(self) -> dict:
        """A consistent copy of everything a Reset leaves behind (nothing is in flight then), for a snapshot."""
        return self.snapshots.export()

    def checkpoint(self) -> dict:
        """What the pacer needs to continue from the current step (checkpoints.py), taken without pausing."""
        checkpoint = self.checkpoints.take()
        self.checkpoints.taken(checkpoint)
        return checkpoint

    def apply_restore(self, checkpoint: dict, request_id: str = "") -> RestoreResult:
        """Restore a validated checkpoint (checkpoints.decode or checkpoints.validate checked it whole)."""
        with self.lock:
            result = self.checkpoints.restore(checkpoint)
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
        return self.recovery.recover()

    def running_groups(self) -> list[TrajectoryGroup]:
        """Copies of the groups in flight (dispatched, not yet out of the trajectory queue), in dispatch order."""
        with self.lock:
            return [group.to_group() for group in self.inflight.in_dispatch_order()]

    def state(self, waiting_calls: int = 0, ages: bool = False) -> PacerState:
        """Every counter, read under the lock; `waiting_calls` is the caller's count of waiting long-polls. With
        `ages`, the clock-dependent gauges too (GetState and the metrics ask for them), else 0 (StateReader.read)."""
        return self.state_of(self.read_state(waiting_calls, ages))

    def close(self) -> None:
        """Shut down: waiters return at once with their flags, watchers get SHUTDOWN, new calls fail."""
        with self.lock:
            if self.lifecycle.close():
                self.emit(ControlEventType.SHUTDOWN)
                self.notify()
