"""The step boundary's calls: a Reset's steps (pause, restore, drop, close the step), Resume and EndJob.

`BoundaryCalls` is built by the Pacer over the owners these calls cross, passed explicitly; the Pacer's
`begin_reset`, `reset_ready`, `finish_reset`, `abandon_reset`, `apply_resume` and `begin_end_job` call it.
"""
from __future__ import annotations

import logging
import threading
from typing import Any, Callable, Mapping, Optional

from .answers import AnswerBook
from .buffer import PipelineBuffer
from .checks import RequestChecks
from .clock import PacerClock
from .collector import Collector
from .errors import ResetInProgressError
from .incidents import HOOK_FAILED, HookFailures, describe_exception
from .inflight import HeldBytes, InflightTable, fitting_answer
from .job_end import Lifecycle
from .journal import JobEnded, Recorder, ResetAbandoned, ResetBegun, ResetFinished, Resumed
from .leases import Leases
from .limits import Limits
from .replay import RestoredGroups
from .signals import Signals
from .steps import StepBoundary
from .types import ControlEventType, ResetMode, ResetResult, ResumeResult, TrajectoryGroup


log = logging.getLogger("coda_server")  # the lifecycle lines (docs/operations.md, "Logs")

# A Reset answer's fields besides its groups and the ids it names: the numbers, the step report.
RESET_ANSWER_FIELDS_BYTES = 1024


def reset_wait(mode: ResetMode, wait: Optional[float], until_assembled: float, abort_wait: float = 0.0) -> float:
    """The seconds a Reset waits: `wait` when given; absent, until every running group is assembled, for at most
    `until_assembled` (the bound on any such wait: server.max_wait_seconds and the call's deadline): in WAIT mode
    as a waiting pause does in LoongSage; in ABORT mode within `abort_wait` too (server.abort_wait_seconds, the
    time engines need to abort), as LoongSage's abort gathers the aborted partial trajectories before its
    boundary clean-up, so every running group is restored."""
    if wait is not None:
        return wait
    return until_assembled if mode == ResetMode.WAIT else min(until_assembled, abort_wait)


class BoundaryCalls:
    """Reset (begin, ready, finish, abandon), Resume and the end of the job, over the owners they change. Each
    method takes the pacer's lock itself (re-entrantly)."""

    def __init__(self, lock: threading.RLock, lifecycle: Lifecycle, checks: RequestChecks, steps: StepBoundary,
                 inflight: InflightTable, collector: Collector, restored: RestoredGroups, held_bytes: HeldBytes,
                 leases: Leases, buffer: PipelineBuffer, totals: dict, hooks: Any, signals: Signals,
                 failures: HookFailures, recorder: Recorder, answers: AnswerBook, clock: PacerClock, limits: Limits, *,
                 default_mode: ResetMode, continue_restored: bool, on_resume: Optional[Callable[[int], None]],
                 snapshot: Callable[[], dict], streams: Callable[[str], int] = lambda client_id: 0):
        self._lock, self._lifecycle, self._checks, self._steps = lock, lifecycle, checks, steps
        self._inflight, self._collector, self._restored, self._held_bytes = inflight, collector, restored, held_bytes
        self._leases, self._buffer, self._totals, self._hooks = leases, buffer, totals, hooks
        self._signals, self._failures, self._recorder, self._answers = signals, failures, recorder, answers
        self._clock, self._limits = clock, limits
        self.default_mode = default_mode  # rollout.partial: ABORT, else WAIT
        self.continue_restored = continue_restored  # the server keeps restored groups and re-offers them
        self._on_resume = on_resume  # the strategy's optional hook, None when it does not define one
        self._snapshot = snapshot  # the pacer's export_state
        self._streams = streams  # client id -> its open WatchControl streams (Liveness.streams)
        # Who held the groups the last finished Reset dropped: (its result, {holder: (groups, open watch streams)}),
        # for its warning (the answer does not carry it; one Reset runs at a time).
        self._dropped_holders: tuple[Optional[ResetResult], dict[str, tuple[int, int]]] = (None, {})

    def dropped_holders(self, result: ResetResult) -> dict[str, tuple[int, int]]:
        """Who held the groups the Reset answered `result` dropped: {client id: (groups, open watch streams)}."""
        said_for, holders = self._dropped_holders
        return holders if said_for is result else {}

    def begin(self, mode: ResetMode = ResetMode.UNSPECIFIED, *, resume: bool = False,
              weight_version: Optional[int] = None) -> ResetMode:
        """Step 1: pause dispatch and tell watchers. Returns the effective mode."""
        mode = self._checks.reset_mode(mode)
        with self._lock:
            self._lifecycle.check_open()
            self._lifecycle.refuse_if_ended("Reset")
            steps = self._steps
            if steps.resetting:
                raise ResetInProgressError("a Reset is already running; wait for it to finish")
            if resume:
                self._checks.check_weight_version(weight_version, steps.weight_version)
            mode = self.default_mode if mode == ResetMode.UNSPECIFIED else mode
            now = self._clock()
            steps.begin_reset(now)
            self._signals.emit(ControlEventType.PAUSE, mode)
            self._signals.notify()
            self._recorder.record(ResetBegun(now, mode, resume, weight_version))
            return mode

    def ready(self) -> bool:
        """Step 2's condition: every running group holds all its trajectories (any status)."""
        with self._lock:
            is_ready = self._inflight.all_assembled
            if is_ready:
                self._steps.note_ready(self._clock())
            return is_ready

    def finish(self, *, resume: bool = False, weight_version: Optional[int] = None,
               request_id: str = "", max_response_bytes: int = 0) -> ResetResult:
        """Steps 3-6: restore complete groups, drop incomplete ones, clear, close the step, optionally resume.
        `max_response_bytes`: the largest answer the caller receives (0: the server's limit); the groups the answer
        cannot carry stay on the server (`_cut_to_fit`)."""
        with self._lock:
            steps, inflight, totals, held_bytes = self._steps, self._inflight, self._totals, self._held_bytes
            if not steps.resetting:
                raise ResetInProgressError("finish_reset without begin_reset")
            now = self._clock()
            # The strategy hears first: if its on_reset raises, nothing is restored or cleared, the Reset ends
            # (dispatch stays paused) and a later Reset may try again.
            try:
                self._hooks.on_reset()
            except Exception as exc:
                steps.abandon_reset()
                self._recorder.record(ResetAbandoned(now))
                raise self._failures.refused("on_reset", exc, "the Reset changed nothing; dispatch stays paused") from exc
            self.ready()
            ready_at_recorded = steps.ready_at
            # Restored in the order their first trajectory arrived, as LoongSage's clean-up drains its trajectory
            # queue (and so re-offers them); dropped ones in dispatch order.
            running = inflight.in_dispatch_order()
            restored = [group.to_group() for group in sorted(running, key=lambda g: g.arrival) if group.complete]
            dropped_groups = [group for group in running if not group.complete]
            dropped = [group.prompt_id for group in dropped_groups]
            totals["restored"] += len(restored)
            totals["dropped"] += len(dropped)
            expired, quarantined = self._collector.set_aside()
            released = self._collector.take_released_kept()
            kept: list[str] = []
            restored_here: list[TrajectoryGroup] = restored  # the step report counts every group this Reset restored
            if self.continue_restored:  # the server keeps them (their bytes stay held) and re-offers them on Dispatch
                # First the groups released this step (a silent worker's, during this Reset's wait too) that still
                # wait: they were kept at their release, as `expired` holds them without continuation; a group
                # continued since is running again and this Reset restores or drops it like any other.
                kept_before = [prompt_id for prompt_id in released if prompt_id in self._restored]
                kept, restored = kept_before + self._restored.keep(restored), []
            restored, expired, quarantined, cut_to_fit = self._cut_to_fit(
                restored, expired, quarantined, dropped, kept, max_response_bytes)
            for group in (*restored, *expired, *quarantined):
                held_bytes.release(group.trajectories)
            for running_group in dropped_groups:
                held_bytes.release(running_group.trajectories.values())
            inflight.new_generation()
            self._collector.clear_held()
            self._leases.forget_running()
            report, pause_delay = steps.close_step(now, len(self._buffer), restored_here, dropped_groups)
            if resume:
                self._resume_locked(weight_version)
            self._signals.notify()
            result = ResetResult(restored, dropped, pause_delay, steps.generation, steps.step, steps.weight_version,
                                 steps.paused, report, expired, quarantined, kept, cut_to_fit)
            holders: dict[str, tuple[int, int]] = {}
            for running_group in dropped_groups:
                count, _ = holders.get(running_group.client_id, (0, 0))
                holders[running_group.client_id] = (count + 1, self._streams(running_group.client_id))
            self._dropped_holders = (result, holders)
            self._recorder.record(ResetFinished(now, ready_at_recorded, resume, weight_version, request_id,
                                                max_response_bytes))
            if self._recorder.recording:
                # The step boundary is the natural checkpoint: nothing is in flight, so the snapshot is small. It
                # replaces this Reset's event, so it must hold the answer a retry of this Reset gets (remembered
                # again by the caller's wrapper, which keeps the first).
                self._answers.remember("Reset", request_id, result)
                self._recorder.snapshot(self._snapshot())
            return result

    def _cut_to_fit(self, restored: list[TrajectoryGroup], expired: list[TrajectoryGroup],
                    quarantined: list[TrajectoryGroup], dropped: list[str], kept: list[str],
                    max_response_bytes: int) -> tuple[list[TrajectoryGroup], list[TrajectoryGroup],
                                                      list[TrajectoryGroup], bool]:
        """The restored, expired and quarantined groups one answer can carry to its caller, oldest first, and whether
        some could not go. Those left out are not lost with an answer the caller could not receive: restored and
        expired ones are kept for continuation (added to `kept`, re-offered on Dispatch, as
        rollout.continue_restored keeps them), quarantined ones stay quarantined for the next Reset."""
        groups = [*restored, *expired, *quarantined]
        limit = self._limits.answer_bytes(max_response_bytes)
        if not limit or not groups:
            return restored, expired, quarantined, False
        named = [*dropped, *kept, *(group.prompt_id for group in groups)]  # each may end up in a list of ids
        room = limit - RESET_ANSWER_FIELDS_BYTES - sum(len(prompt_id.encode()) + 6 for prompt_id in named)
        carried = len(fitting_answer(groups, room))
        if carried == len(groups):
            return restored, expired, quarantined, False
        restored_carried = min(carried, len(restored))
        expired_carried = min(carried - restored_carried, len(expired))
        quarantined_carried = carried - restored_carried - expired_carried
        continued = [*restored[restored_carried:], *expired[expired_carried:]]
        kept.extend(self._restored.keep(continued))
        self._collector.restore_quarantined(quarantined[quarantined_carried:])
        if not self._recorder.replaying:  # said when it happens, not again when a restart replays it
            log.warning("the Reset's answer carries %d of %d restored, expired and quarantined groups within the "
                        "caller's limit of %d bytes: %d kept for continuation (re-offered on Dispatch), %d stay "
                        "quarantined for the next Reset", carried, len(groups), limit, len(continued),
                        len(quarantined) - quarantined_carried)
        return restored[:restored_carried], expired[:expired_carried], quarantined[:quarantined_carried], True

    def abandon(self) -> None:
        """A Reset that cannot finish (shutdown): leave the pause on, allow a later Reset."""
        with self._lock:
            self._steps.abandon_reset()
            self._signals.notify()
            self._recorder.record(ResetAbandoned(self._clock()))

    def resume(self, weight_version: int, request_id: str = "") -> ResumeResult:
        """step += 1, record the weight version, reopen dispatch, tell watchers."""
        with self._lock:
            self._lifecycle.check_open()
            self._lifecycle.refuse_if_ended("Resume")
            steps = self._steps
            if steps.resetting:
                raise ResetInProgressError("a Reset is running; it resumes when it finishes (Reset with resume=true)")
            self._checks.check_weight_version(weight_version, steps.weight_version)
            self._resume_locked(weight_version)
            self._signals.notify()
            self._recorder.record(Resumed(self._clock(), weight_version, request_id))
            return ResumeResult(steps.step, steps.weight_version)

    def _resume_locked(self, weight_version: Optional[int]) -> None:
        self._steps.resume(weight_version)
        self.tell_resumed()

    def tell_resumed(self) -> None:
        """Dispatch reopened: the strategy's on_resume hook, then watchers hear RESUME."""
        if self._on_resume is not None:
            try:
                self._on_resume(self._steps.weight_version)
            except Exception as exc:  # reported; the Resume stands (dispatch must reopen)
                self._failures.incident(HOOK_FAILED, "", "on_resume", describe_exception(exc), "resumed")
        self._signals.emit(ControlEventType.RESUME)

    def end_job(self, mode: ResetMode = ResetMode.UNSPECIFIED) -> ResetMode:
        """Close dispatch for good and tell watchers JOB_ENDED (once; a second call changes nothing)."""
        mode = self._checks.reset_mode(mode)
        with self._lock:
            lifecycle = self._lifecycle
            lifecycle.check_open()
            if lifecycle.job_ended:
                return lifecycle.job_end_mode
            if self._steps.resetting:
                raise ResetInProgressError("a Reset is running; end the job once it has finished")
            mode = self.default_mode if mode == ResetMode.UNSPECIFIED else mode
            now = self._clock()
            lifecycle.end_job(mode)
            self._steps.pause(now)
            self._signals.emit(ControlEventType.JOB_ENDED, mode)
            self._signals.notify()
            self._recorder.record(JobEnded(now, mode))
            return mode


def log_reset_finished(result: ResetResult, mode: ResetMode) -> None:
    """One line saying what a Reset did with the groups it found, in figures (never a line per group). The groups
    kept for continuation include those released this step (their worker went silent, or their in-flight lease ran
    out), which the expired total counts when released: said apart, so that the line agrees with it."""
    paused = ("dispatch stays paused until a Resume" if result.paused
              else f"dispatch resumed at weight version {result.weight_version}")
    kept = len(result.kept_prompt_ids)
    # kept_prompt_ids: those released this step that still wait, then those this Reset restored (counted by the
    # step report).
    released_kept = max(0, kept - result.report.partial_restored_group_count) if kept else 0
    released = (f" ({released_kept} of them expired this step: worker silent or in-flight lease run out)"
                if released_kept else "")
    log.info("Reset finished (mode %s) at step %d, generation %d: %d complete group(s) restored, %d kept for "
             "continuation%s, %d incomplete dropped, %d expired and handed back, %d quarantined; pause delay %.3fs; %s",
             mode.name.lower(), result.step, result.generation, len(result.restored), kept, released,
             len(result.dropped_prompt_ids), len(result.expired), len(result.quarantined), result.pause_delay_seconds,
             paused,
             extra={"fields": {"event": "reset_finished", "mode": mode.name.lower(), "step": result.step,
                               "weight_version": result.weight_version, "generation": result.generation,
                               "restored": len(result.restored), "kept": kept, "kept_expired": released_kept,
                               "dropped": len(result.dropped_prompt_ids), "expired": len(result.expired),
                               "quarantined": len(result.quarantined),
                               "pause_delay_seconds": round(result.pause_delay_seconds, 6), "paused": result.paused}})


def warn_dropped(result: ResetResult, mode: ResetMode, wait: Optional[float], bound: float, abort_wait: float,
                 holders: Mapping[str, tuple[int, int]]) -> None:
    """A Reset that waited for running groups and dropped some when its wait ended: said where the operator sees it
    (LoongSage's waiting pause never drops), with the setting that bounds the wait (`reset_wait`'s)."""
    ids = result.dropped_prompt_ids
    why = (f"its wait_seconds ({wait:g} s)" if wait is not None else
           f"server.abort_wait_seconds ({abort_wait:g} s)" if mode == ResetMode.ABORT and abort_wait <= bound
           else f"server.max_wait_seconds or the call's deadline ({bound:g} s)")
    # A caller without a client id cannot be matched to a stream: whether it watches is not known.
    deaf = sorted(client for client, (_, streams) in holders.items() if client and not streams)
    held = ", ".join(f"{client or '(no client id)'} ({count}, "
                     + ("watch stream unknown" if not client else "watch stream open" if streams
                        else "no WatchControl stream open") + ")"
                     for client, (count, streams) in sorted(holders.items()))
    if deaf:
        advice = (f"{', '.join(deaf)} never heard the PAUSE (no control stream), so "
                  "waiting longer would not help: such a client must submit or stop on its own (a worker should "
                  "watch WatchControl, as RolloutWorker does; `coda-client workers` shows what each holds)")
    else:
        advice = "raise it to wait longer"
    log.warning("Reset (mode %s) waited %.1f s for running groups and dropped %d incomplete group(s) (%s%s), "
                "%d trajectories of them submitted: the wait ended at %s; %s%s",
                mode.name.lower(), result.pause_delay_seconds, len(ids), ", ".join(ids[:5]),
                ", ..." if len(ids) > 5 else "", result.report.partial_dropped_incomplete_count, why,
                f"held by {held}; " if held else "", advice)
