"""Incidents (a raising strategy hook, a refused dirty group): their log, and the errors that report them."""
from __future__ import annotations

import logging
import sys
from collections import deque
from typing import Any, Callable, Iterable, Optional

from .errors import DirtyGroupError, PacerError, StrategyHookError
from .types import Incident, Trajectory, TrajectoryStatus

log = logging.getLogger("coda_server.strategy")

HOOK_FAILED = "hook_failed"
DIRTY_GROUP = "dirty_group"
QUARANTINED = "quarantined"
REFUSED = "refused"


class WrongAnswer(TypeError):
    """A hook returned what the pacer cannot use (its message says what, beginning "returned"): reported as the
    hook's incident, as if it had raised."""


class IncidentLog:
    """The recent incidents, for GetState, and those the trainer's Collect has not been told about yet.

    Both are bounded by `kept`; `unreported_dropped` counts what fell out of the unreported list, so a
    Collect still says how many there were.
    """

    def __init__(self, kept: int = 32):
        self._recent: deque[Incident] = deque(maxlen=max(1, kept))
        self._unreported: deque[Incident] = deque(maxlen=max(1, kept))
        self.unreported_dropped = 0

    def record(self, incident: Incident) -> None:
        self._recent.append(incident)
        if len(self._unreported) == self._unreported.maxlen:
            self.unreported_dropped += 1
        self._unreported.append(incident)

    def recent(self) -> list[Incident]:
        return list(self._recent)

    def has_unreported(self) -> bool:
        return bool(self._unreported)

    def take_unreported(self) -> tuple[list[Incident], int]:
        """The incidents not reported yet (and how many more fell out of the list); they count as reported now."""
        taken, dropped = list(self._unreported), self.unreported_dropped
        self._unreported.clear()
        self.unreported_dropped = 0
        return taken, dropped

    def export(self) -> dict:
        return {"recent": list(self._recent), "unreported": list(self._unreported),
                "unreported_dropped": self.unreported_dropped}

    def restore(self, exported: Optional[dict]) -> None:
        if not exported:
            return
        self._recent.extend(exported.get("recent", ()))
        self._unreported.extend(exported.get("unreported", ()))
        self.unreported_dropped = int(exported.get("unreported_dropped", 0))


class HookFailures:
    """Reports what went wrong in the strategy or the data: each incident stamped with the strategy's name and
    the step it came in, into the log; for a call a raising hook stopped, also that call's error."""

    __slots__ = ("_log", "_strategy", "_steps", "_notify")

    def __init__(self, log: IncidentLog, strategy: str, steps: Any, notify: Callable[[], None]):
        self._log = log
        self._strategy = strategy
        self._steps = steps  # the StepBoundary: the step and generation an incident is stamped with
        self._notify = notify

    @property
    def strategy(self) -> str:
        """The strategy's registered name, which every incident is stamped with."""
        return self._strategy

    def incident(self, kind: str, prompt_id: str, hook: str, message: str, action: str = QUARANTINED,
                 exc: Optional[BaseException] = None) -> Incident:
        """Record an incident; a hook's is logged once too, with the traceback of `exc` (by default the exception
        being handled: every hook's incident is recorded where its exception is caught)."""
        steps = self._steps
        incident = Incident(kind, prompt_id, self._strategy, hook, message, steps.step, steps.generation, action)
        self._log.record(incident)
        if kind == HOOK_FAILED:
            _log_hook_failure(incident, exc if exc is not None else sys.exc_info()[1])
        return incident

    def refused(self, hook: str, exc: BaseException, consequence: str) -> StrategyHookError:
        """The error of a call a raising hook stopped before it changed anything (recorded as an incident; a
        waiting Collect is woken to report it)."""
        self.incident(HOOK_FAILED, "", hook, describe_exception(exc), REFUSED, exc)
        self._notify()
        return hook_error(self._strategy, hook, exc, consequence=consequence)


def _log_hook_failure(incident: Incident, exc: Optional[BaseException]) -> None:
    """One WARNING per hook incident, with the traceback (the strategy's file and line) when the hook raised."""
    group = f" for group {incident.prompt_id!r}" if incident.prompt_id else ""
    # A wrong answer's traceback is the pacer's own: the message says all there is.
    trace = exc if exc is not None and not isinstance(exc, WrongAnswer) else None
    log.warning("strategy %r hook %s %s (incident at step %d: %s)", incident.strategy, incident.hook,
                _outcome(incident.message, group), incident.step, incident.action, exc_info=trace)


def _outcome(message: str, group: str = "") -> str:
    """"raised for group 'p': KeyError: ..." or, for a wrong answer, "for group 'p' returned None (...)"."""
    return f"{group.lstrip()} {message}".lstrip() if message.startswith("returned ") else f"raised{group}: {message}"


def describe_exception(exc: BaseException) -> str:
    text = str(exc)
    if isinstance(exc, WrongAnswer):  # "returned None (NoneType), not an int: ..."
        return text
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def hook_error(strategy: str, hook: str, exc: BaseException, *, prompt_id: str = "", consequence: str = "") -> StrategyHookError:
    """The INTERNAL error a call gets when a strategy hook raised under it (or returned what the pacer cannot use),
    naming strategy and hook."""
    where = f" for group {prompt_id!r}" if prompt_id else ""
    tail = f"; {consequence}" if consequence else ""
    return StrategyHookError(f"strategy {strategy!r} hook {hook} {_outcome(describe_exception(exc), where)}{tail}",
                             strategy=strategy, hook=hook)


def failed_trajectory(trajectories: Iterable[Trajectory]) -> Optional[Trajectory]:
    """The first FAILED trajectory of a group, or None."""
    for t in trajectories:
        if t.status is TrajectoryStatus.FAILED:
            return t
    return None


def collect_error(incidents: list[Incident], dropped: int = 0) -> PacerError:
    """What the trainer's Collect answers after incidents it has not been told about: a raising hook is
    INTERNAL (STRATEGY_HOOK_FAILED), dirty data alone FAILED_PRECONDITION (DIRTY_GROUP)."""
    total = len(incidents) + dropped
    hooks = [i for i in incidents if i.kind == HOOK_FAILED]
    first = hooks[0] if hooks else incidents[0]
    more = f" ({total - 1} more incident(s): GetState recent_incidents)" if total > 1 else ""
    groups = "quarantined groups come back in the next Reset's `quarantined`"
    if hooks:
        return StrategyHookError(
            f"since the last Collect, strategy {first.strategy!r} hook {first.hook} "
            f"{_outcome(first.message, ' for group ' + repr(first.prompt_id) if first.prompt_id else '')} "
            f"(group {first.action}){more}; the buffered groups stay for the next Collect; {groups}",
            strategy=first.strategy, hook=first.hook)
    return DirtyGroupError(
        f"since the last Collect, group {first.prompt_id!r} was refused: {first.message}{more}. It was not trained "
        f"on: add `status` to rollout.filter to drop such groups, or set rollout.train_on_failed: true to train "
        f"on them; the buffered groups stay for the next Collect; {groups}")
