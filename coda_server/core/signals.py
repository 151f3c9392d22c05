"""Who hears of the pacer's changes: the waiting calls woken, and the change, control-event and consume listeners."""
from __future__ import annotations

from typing import Any, Callable

from .types import ControlEvent, ControlEventType, ResetMode, TrajectoryGroup


class Signals:
    """The listeners the server registers (long-polls, watch streams, metrics) and the waits to wake. Every
    callback runs under the pacer's lock, in order, so it must be quick."""

    __slots__ = ("_waits", "_steps", "_totals", "_lifecycle", "_change", "_control", "_consume")

    def __init__(self, waits: Any, steps: Any, totals: dict, lifecycle: Any):
        self._waits = waits  # ThreadWaits: in-process callers blocked on a Poll
        self._steps = steps  # the StepBoundary, read for each control event
        self._totals = totals
        self._lifecycle = lifecycle
        self._change: list[Callable[[], None]] = []
        self._control: list[Callable[[ControlEvent], None]] = []
        self._consume: list[Callable[[list[TrajectoryGroup], int, float], None]] = []

    def add_change_listener(self, callback: Callable[[], None]) -> None:
        self._change.append(callback)

    def add_control_listener(self, callback: Callable[[ControlEvent], None]) -> None:
        self._control.append(callback)

    def add_consume_listener(self, callback: Callable[[list[TrajectoryGroup], int, float], None]) -> None:
        self._consume.append(callback)

    def notify(self) -> None:
        """Something changed: wake the waiting calls (each re-attempts its Poll) and tell the change listeners."""
        waits = self._waits
        if waits.blocked:  # notify_all is Python code under the hood: skip it when nobody waits
            waits.wake_all()
        for callback in self._change:
            callback()

    def control_event(self, kind: ControlEventType, mode: ResetMode = ResetMode.UNSPECIFIED) -> ControlEvent:
        steps, lifecycle = self._steps, self._lifecycle
        if kind == ControlEventType.STATE and lifecycle.job_ended:
            # A stream opened after EndJob (a worker reconnecting) hears how the job ended, not only that it did:
            # in ABORT mode it aborts what it holds rather than finishing it.
            mode = lifecycle.job_end_mode
        return ControlEvent(kind, mode, steps.weight_version, steps.step, steps.generation, steps.paused,
                            self._totals["restores"], lifecycle.job_ended)

    def emit(self, kind: ControlEventType, mode: ResetMode = ResetMode.UNSPECIFIED) -> None:
        """A PAUSE, RESUME, JOB_ENDED or SHUTDOWN for the control listeners (the watch streams)."""
        event = self.control_event(kind, mode)
        for callback in self._control:
            callback(event)

    def consumed(self, groups: list[TrajectoryGroup], weight_version: int, now: float) -> None:
        """The trainer took these groups for good (for the staleness metrics)."""
        for callback in self._consume:
            callback(groups, weight_version, now)

    @property
    def hears_consumed(self) -> bool:
        return bool(self._consume)
