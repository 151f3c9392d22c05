"""Whether the pacer takes calls (`Lifecycle`: shut down, the job ended by EndJob) and EndJob's report of what was left.

After the end, Submit, Collect and Ack still work (workers hand in what they hold, the trainer may take what
is buffered); Dispatch admits nothing and says so (`job_ended`); Reset and Resume are refused. The end is
journaled (and in every snapshot), so a restarted server stays ended.
"""
from __future__ import annotations

from .buffer import PipelineBuffer
from .collector import Collector
from .errors import JobEndedError, ShuttingDownError
from .inflight import InflightTable
from .leases import Leases
from .replay import RestoredGroups
from .state import PacerState
from .types import JobEndReport, ResetMode


class Lifecycle:
    """`closed`: the pacer is shutting down and takes no new calls; `job_ended` (with `job_end_mode`): EndJob
    closed dispatch for good. Changed only by `close` and `end_job`."""

    __slots__ = ("closed", "job_ended", "job_end_mode")

    def __init__(self) -> None:
        self.closed = False
        self.job_ended = False
        self.job_end_mode = ResetMode.UNSPECIFIED

    def check_open(self) -> None:
        if self.closed:
            raise ShuttingDownError("the pacer is shutting down and takes no new calls")

    def refuse_if_ended(self, call: str) -> None:
        """Reset and Resume after the end: there is no next step."""
        if self.job_ended:
            raise JobEndedError(f"{call} refused: EndJob ended this job; there is no next step. Submit, Collect, "
                                f"Ack and GetState still work")

    def close(self) -> bool:
        """Shut down; False when already closed."""
        if self.closed:
            return False
        self.closed = True
        return True

    def end_job(self, mode: ResetMode) -> None:
        self.job_ended, self.job_end_mode = True, mode

    def export(self) -> dict:
        return {"job_ended": self.job_ended, "job_end_mode": self.job_end_mode}

    def restore(self, snapshot: dict) -> None:
        self.job_ended = bool(snapshot.get("job_ended", False))  # absent from snapshots written before EndJob
        self.job_end_mode = snapshot.get("job_end_mode", self.job_end_mode)


def report(mode: ResetMode, waited_seconds: float, inflight: InflightTable, buffer: PipelineBuffer, leases: Leases,
           restored: RestoredGroups, collector: Collector, state: PacerState) -> JobEndReport:
    """Where every group not yet accounted for by the totals is now."""
    running = inflight.in_dispatch_order()
    return JobEndReport(
        mode=mode, waited_seconds=waited_seconds,
        buffered_prompt_ids=[group.prompt_id for _, group in sorted(buffer.export())],
        leased=leases.leased_groups,
        held_prompt_ids=[g.prompt_id for g in running if g.complete],
        in_flight_prompt_ids=[g.prompt_id for g in running if not g.complete],
        kept_prompt_ids=[g.prompt_id for g in restored.export()],
        expired_prompt_ids=[g.prompt_id for g in collector.expired],
        quarantined_prompt_ids=[g.prompt_id for g in collector.quarantined],
        state=state,
    )
