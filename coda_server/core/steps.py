"""The step boundary: step, weight version, generation, the pause around a Reset, the step's tally, past step reports."""
from __future__ import annotations

from collections import deque
from typing import Optional, Sequence

from .errors import FailedPreconditionError
from .inflight import InflightGroup, StepTally
from .types import StepReport, TrajectoryGroup


class StepBoundary:
    """Where the pacer is between steps. `step`, `weight_version`, `generation`, `paused` and `resetting` are read
    freely; they change only through the methods, which keep the pause's timing (for the step report's
    pause_delay) consistent with them."""

    __slots__ = ("step", "weight_version", "generation", "paused", "resetting", "_pause_started", "ready_at",
                 "tally", "_reports")

    def __init__(self, reports_kept: int):
        self.step = 0
        self.weight_version = 0
        self.generation = 0
        self.paused = False
        self.resetting = False
        self._pause_started: Optional[float] = None
        self.ready_at: Optional[float] = None  # when a running Reset found every running group assembled
        self.tally = StepTally()  # what the trainer took this step
        self._reports: deque[StepReport] = deque(maxlen=reports_kept)

    @property
    def reports(self) -> list[StepReport]:
        return list(self._reports)

    def pause(self, now: float) -> None:
        """Dispatch stops (a Reset, the end of the job); the pause is timed from its first start."""
        if not self.paused:
            self.paused = True
            self._pause_started = now
        elif self._pause_started is None:
            self._pause_started = now

    def begin_reset(self, now: float) -> None:
        self.resetting = True
        self.pause(now)
        self.ready_at = None

    def note_ready(self, now: float) -> None:
        """Every running group is assembled: the first time in a Reset, that is when its pause delay ends."""
        if self.ready_at is None and self.resetting:
            self.ready_at = now

    def abandon_reset(self) -> None:
        """The Reset ends without closing the step (dispatch stays paused)."""
        self.resetting = False

    def close_step(self, now: float, buffered: int, restored: Sequence[TrajectoryGroup],
                   dropped: Sequence[InflightGroup]) -> tuple[StepReport, float]:
        """A Reset's end: the step's report (kept), its pause delay; a new generation begins."""
        ready_at = self.ready_at if self.ready_at is not None else now
        pause_delay = max(0.0, ready_at - (self._pause_started or ready_at))
        report = self.tally.report(self.step, buffered, list(restored), list(dropped), pause_delay)
        self._reports.append(report)
        self.tally.clear()
        self.generation += 1
        self.resetting = False
        # The pause this Reset timed is spent: a next Reset before the Resume times its own, from its begin.
        self._pause_started = None
        return report, pause_delay

    def resume(self, weight_version: Optional[int]) -> None:
        """step += 1 at the weight version (unchanged when None); dispatch reopens."""
        self.step += 1
        if weight_version is not None:
            self.weight_version = weight_version
        self.paused = False
        self._pause_started = None

    def rolled_back(self, step: int, weight_version: int, paused: bool, now: float) -> None:
        """A Restore: back at `step`; a new generation; the restored step's tally starts empty."""
        self.step, self.weight_version = step, weight_version
        self.generation += 1
        self.resetting = False
        self.paused = paused
        self._pause_started, self.ready_at = (now if paused else None), None
        self.tally.clear()

    def restart_pause_clock(self, now: float) -> None:
        """After a restart the old process's clock is gone: a pause (outside a Reset) is timed from `now`."""
        if self.paused and not self.resetting:
            self._pause_started = now

    def differs(self, trainer_step: Optional[int]) -> bool:
        """The trainer states a step, and not the server's (`check_trainer_step` refuses it)."""
        return trainer_step is not None and trainer_step != self.step

    def check_trainer_step(self, trainer_step: Optional[int]) -> None:
        """A Collect from a trainer at another step than the server's is refused: after a trainer restarts
        from a checkpoint, the pacer must be restored to it first."""
        if not self.differs(trainer_step):
            return
        if trainer_step < self.step:
            hint = (f"the trainer is behind the server (restarted from a checkpoint?): restore first, "
                    f"PacerClient.restore() with the pacer checkpoint taken with the trainer's step-{trainer_step} "
                    f"model")
        else:
            hint = ("the trainer is ahead of the server (a step boundary without Reset/Resume, or a server that "
                    "lost its state): restore first, from the pacer checkpoint of the trainer's last model checkpoint")
        raise FailedPreconditionError(f"the trainer states step {trainer_step}, the server is at step {self.step}; "
                                      f"{hint}", reason="STEP_MISMATCH",
                                      violations=[("trainer_step", f"must be the server's step {self.step}")])

    def export(self) -> dict:
        return {"step": self.step, "weight_version": self.weight_version, "generation": self.generation,
                "paused": self.paused, "reports": list(self._reports)}

    def restore(self, snapshot: dict) -> None:
        self.step, self.weight_version = snapshot["step"], snapshot["weight_version"]
        self.generation, self.paused = snapshot["generation"], snapshot["paused"]
        self._reports.extend(snapshot["reports"])
