"""The end of a job (EndJob): close dispatch for good, tell watchers JOB_ENDED, and report what was left.

Written as functions over one Pacer's state, as reset_steps.py is. After the end, Submit, Collect and Ack
still work (workers hand in what they hold, the trainer may take what is buffered); Dispatch admits nothing
and says so (`job_ended`); Reset and Resume are refused. The end is journaled, so a restarted server stays
ended.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from .errors import JobEndedError, ResetInProgressError
from .journal import JobEnded
from .types import ControlEventType, JobEndReport, ResetMode

if TYPE_CHECKING:
    from .pacer import Pacer


def begin(pacer: "Pacer", mode: ResetMode) -> ResetMode:
    """Close dispatch for good and tell watchers (once; a second call changes nothing). Returns the mode."""
    mode = pacer.checks.reset_mode(mode)
    with pacer.lock:
        pacer.check_open()
        if pacer.job_ended:
            return pacer.job_end_mode
        if pacer.resetting:
            raise ResetInProgressError("a Reset is running; end the job once it has finished")
        mode = pacer.default_mode if mode == ResetMode.UNSPECIFIED else mode
        now = pacer.clock()
        pacer.job_ended, pacer.job_end_mode = True, mode
        pacer.steps.pause(now)
        pacer.emit(ControlEventType.JOB_ENDED, mode)
        pacer.notify()
        pacer.record(JobEnded(now, mode))
        return mode


def refuse_if_ended(pacer: "Pacer", call: str) -> None:
    """Reset and Resume after the end: there is no next step."""
    if pacer.job_ended:
        raise JobEndedError(f"{call} refused: EndJob ended this job; there is no next step. Submit, Collect, Ack and "
                            f"GetState still work")


def report(pacer: "Pacer", waited_seconds: float) -> JobEndReport:
    """Where every group not yet accounted for by the totals is now."""
    with pacer.lock:
        running = pacer.inflight.in_dispatch_order()
        return JobEndReport(
            mode=pacer.job_end_mode, waited_seconds=waited_seconds,
            buffered_prompt_ids=[group.prompt_id for _, group in sorted(pacer.buffer.export())],
            leased=pacer.leases.leased_groups,
            held_prompt_ids=[g.prompt_id for g in running if g.complete],
            in_flight_prompt_ids=[g.prompt_id for g in running if not g.complete],
            kept_prompt_ids=[g.prompt_id for g in pacer.restored.export()],
            expired_prompt_ids=[g.prompt_id for g in pacer.collector.expired],
            quarantined_prompt_ids=[g.prompt_id for g in pacer.collector.quarantined],
            state=pacer.state(),
        )
