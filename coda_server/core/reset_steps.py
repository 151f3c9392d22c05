"""The Reset and Resume steps of the Pacer: pause, restore complete groups, drop incomplete ones, close the step, resume.

Written as functions over one Pacer's state, as its own methods would be (the Pacer's `begin_reset`,
`reset_ready`, `finish_reset`, `abandon_reset` and `apply_resume` call them), so that pacer.py reads as
the dispatch-submit-collect cycle and this module as the step boundary.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Optional

from .errors import ResetInProgressError
from .job_end import refuse_if_ended
from .journal import ResetAbandoned, ResetBegun, ResetFinished, Resumed
from .types import ControlEventType, ResetMode, ResetResult, ResumeResult, TrajectoryGroup

if TYPE_CHECKING:
    from .pacer import Pacer


def begin(pacer: "Pacer", mode: ResetMode, resume: bool, weight_version: Optional[int]) -> ResetMode:
    """Step 1: pause dispatch and tell watchers. Returns the effective mode."""
    mode = pacer.checks.reset_mode(mode)
    with pacer.lock:
        pacer.check_open()
        refuse_if_ended(pacer, "Reset")
        if pacer.resetting:
            raise ResetInProgressError("a Reset is already running; wait for it to finish")
        if resume:
            pacer.checks.check_weight_version(weight_version, pacer.weight_version)
        mode = pacer.default_mode if mode == ResetMode.UNSPECIFIED else mode
        now = pacer.clock()
        pacer.steps.begin_reset(now)
        pacer.emit(ControlEventType.PAUSE, mode)
        pacer.notify()
        pacer.record(ResetBegun(now, mode, resume, weight_version))
        return mode


def ready(pacer: "Pacer") -> bool:
    """Step 2's condition: every running group holds all its trajectories (any status)."""
    with pacer.lock:
        is_ready = pacer.inflight.all_assembled
        if is_ready:
            pacer.steps.note_ready(pacer.clock())
        return is_ready


def finish(pacer: "Pacer", resume: bool, weight_version: Optional[int], request_id: str) -> ResetResult:
    """Steps 3-6: restore complete groups, drop incomplete ones, clear, close the step, optionally resume."""
    with pacer.lock:
        if not pacer.resetting:
            raise ResetInProgressError("finish_reset without begin_reset")
        now = pacer.clock()
        # The strategy hears first: if its on_reset raises, nothing is restored or cleared, the Reset ends
        # (dispatch stays paused) and a later Reset may try again.
        try:
            pacer.hooks.on_reset()
        except Exception as exc:
            pacer.steps.abandon_reset()
            pacer.record(ResetAbandoned(now))
            raise pacer.hook_refused("on_reset", exc, "the Reset changed nothing; dispatch stays paused") from exc
        ready(pacer)
        ready_at_recorded = pacer.steps.ready_at
        restored: list[TrajectoryGroup] = []
        dropped: list[str] = []
        # Restored in the order their first trajectory arrived, as LoongSage's clean-up drains its trajectory
        # queue (and so re-offers them); dropped ones in dispatch order.
        running = pacer.inflight.in_dispatch_order()
        for group in sorted(running, key=lambda g: g.arrival):
            if group.complete:
                restored.append(group.to_group())
        dropped_groups = [group for group in running if not group.complete]
        dropped = [group.prompt_id for group in dropped_groups]
        pacer.totals["restored"] += len(restored)
        pacer.totals["dropped"] += len(dropped)
        expired, quarantined = pacer.collector.set_aside()
        kept: list[str] = []
        restored_here = restored  # the step report counts every group this Reset restored
        if pacer.continue_restored:  # the server keeps them (their bytes stay held) and re-offers them on Dispatch
            kept, restored = pacer.restored.keep(restored), []
        for group in (*restored, *expired, *quarantined):
            pacer.held_bytes.release(group.trajectories)
        for group in dropped_groups:
            pacer.held_bytes.release(group.trajectories.values())
        pacer.inflight.new_generation()
        pacer.collector.clear_held()
        pacer.leases.forget_running()
        report, pause_delay = pacer.steps.close_step(now, len(pacer.buffer), restored_here, dropped_groups)
        if resume:
            _resume_locked(pacer, weight_version)
        pacer.notify()
        result = ResetResult(restored, dropped, pause_delay, pacer.generation, pacer.step, pacer.weight_version,
                             pacer.paused, report, expired, quarantined, kept)
        pacer.record(ResetFinished(now, ready_at_recorded, resume, weight_version, request_id))
        if pacer.recorder.recording:
            # The step boundary is the natural checkpoint: nothing is in flight, so the snapshot is small. It
            # replaces this Reset's event, so it must hold the answer a retry of this Reset gets (remembered
            # again by the caller's wrapper, which keeps the first).
            pacer.answers.remember("Reset", request_id, result)
            pacer.recorder.snapshot(pacer.export_state())
        return result


def abandon(pacer: "Pacer") -> None:
    """A Reset that cannot finish (shutdown): leave the pause on, allow a later Reset."""
    with pacer.lock:
        pacer.steps.abandon_reset()
        pacer.notify()
        pacer.record(ResetAbandoned(pacer.clock()))


def resume(pacer: "Pacer", weight_version: int, request_id: str) -> ResumeResult:
    """step += 1, record the weight version, reopen dispatch, tell watchers."""
    with pacer.lock:
        pacer.check_open()
        refuse_if_ended(pacer, "Resume")
        if pacer.resetting:
            raise ResetInProgressError("a Reset is running; it resumes when it finishes (Reset with resume=true)")
        pacer.checks.check_weight_version(weight_version, pacer.weight_version)
        _resume_locked(pacer, weight_version)
        pacer.notify()
        pacer.record(Resumed(pacer.clock(), weight_version, request_id))
        return ResumeResult(pacer.step, pacer.weight_version)


def _resume_locked(pacer: "Pacer", weight_version: Optional[int]) -> None:
    pacer.steps.resume(weight_version)
    pacer.tell_resumed()
