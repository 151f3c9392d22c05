"""Dispatch's admission: the window the strategy opens, kept groups re-offered first, candidates admitted."""
from __future__ import annotations

import logging
from typing import Any, Optional, Sequence

from .buffer import PipelineBuffer
from .checks import RequestChecks
from .clock import PacerClock
from .collector import Collector
from .cursor import PromptCursor
from .incidents import HookFailures
from .inflight import DispatchedGroup, HeldBytes, InflightGroup, InflightTable, fitting_answer
from .job_end import Lifecycle
from .journal import Dispatched, Recorder
from .leases import Leases
from .limits import Limits
from .liveness import Liveness
from .plugins import where
from .replay import RestoredGroups
from .signals import Signals
from .steps import StepBoundary
from .strategy import MAX_DISPATCH_COUNT, checked_count, dispatched_ids_only, overridden_hook
from .types import DispatchResult, PromptRef, TrajectoryGroup

log = logging.getLogger("coda_server.strategy")


class Admission:
    """Admits prompt groups into the in-flight table as far as the strategy's window allows: the strategy hears
    first (if it raises, nothing changed), then the table, the cursor, the kept groups, the leases, the
    collector's held groups and the waiters; the change is recorded. Its callers hold the pacer's lock."""

    def __init__(self, hooks: Any, checks: RequestChecks, limits: Limits, inflight: InflightTable,
                 restored: RestoredGroups, cursor: PromptCursor, held_bytes: HeldBytes, leases: Leases,
                 collector: Collector, steps: StepBoundary, buffer: PipelineBuffer, lifecycle: Lifecycle,
                 liveness: Liveness, totals: dict, signals: Signals, failures: HookFailures, recorder: Recorder,
                 clock: PacerClock, group_sizes: list[int], window_size: int):
        self._hooks, self._checks, self._limits, self._inflight = hooks, checks, limits, inflight
        self._restored, self._cursor, self._held_bytes, self._leases = restored, cursor, held_bytes, leases
        self._collector, self._steps, self._buffer, self._lifecycle = collector, steps, buffer, lifecycle
        self._liveness, self._totals, self._notify, self._failures = liveness, totals, signals.notify, failures
        self._recorder, self._record, self._clock = recorder, recorder.record, clock
        self._group_sizes, self._window_size = group_sizes, window_size
        # The built-in strategies read only the ids in on_dispatched: they get the in-flight groups themselves,
        # without a LoongSage-form copy of each (a Python object per admitted group).
        self._ids_only = dispatched_ids_only(hooks)
        # An on_dispatched of the strategy's own must count the groups in (super()): checked on each admission, two
        # reads, until a mismatch is warned about once.
        self._watch_running = overridden_hook(hooks, "on_dispatched") is not None

    def admit(self, candidates: Sequence[PromptRef], request_id: str, client_id: str,
              max_continuations: Optional[int], continued_ids: Optional[Sequence[str]],
              max_response_bytes: int = 0) -> DispatchResult:
        """See `Pacer.apply_dispatch`."""
        inflight, restored, steps = self._inflight, self._restored, self._steps
        if candidates:  # none is a peek at the window
            inflight.check_candidates(self._checks, candidates, restored)
        allowed = self.admissible_now()
        wanted = len(candidates) if max_continuations is None else max_continuations
        if continued_ids is not None:
            continued = restored.by_ids(continued_ids)
        elif wanted and allowed and restored:
            # Those whose trajectories fit one answer the caller receives; the rest wait for the next Dispatch (a
            # group too large alone is not handed out: GetState's restored_kept_oldest_seconds shows it waiting).
            continued = fitting_answer(restored.choose(min(allowed, wanted), steps.step),
                                       self._limits.answer_bytes(max_response_bytes))
        else:
            continued = []
        # By default the kept groups take the place of as many candidates (the caller proposed that much room).
        proposed = len(candidates) - len(continued) if max_continuations is None and continued_ids is None \
            else len(candidates)
        count = allowed - len(continued)
        if proposed < count:  # min(), without the builtin's keyword parsing
            count = proposed
        first_seq = inflight.next_seq + len(continued)
        admitted_ids: list[str] = []
        if count or continued:
            now = self._clock.now()
            admitted_refs = list(candidates[:count])  # also the journal's record of this Dispatch
            group_sizes = self._group_sizes
            refs = [*(PromptRef(g.prompt_id, g.ds_index, g.epoch, g.index) for g in continued), *admitted_refs]
            groups = [InflightGroup(ref, seq, group_sizes[ref.ds_index], now, client_id)
                      for seq, ref in enumerate(refs, inflight.next_seq)]
            # The strategy hears first: if a custom strategy raises, the pacer is unchanged. It sees each group
            # with its trajectories as LoongSage hands them to on_dispatched: the N pending ones of a new group,
            # those a continued group brings back.
            running_before = getattr(self._hooks, "_running_count", None) if self._watch_running else None
            try:
                if self._ids_only:
                    self._hooks.on_dispatched(groups)
                else:
                    brought = {g.prompt_id: g.trajectories for g in continued}
                    self._hooks.on_dispatched([DispatchedGroup(group, brought.get(group.prompt_id)) for group in groups])
            except Exception as exc:
                raise self._failures.refused("on_dispatched", exc, "nothing was admitted") from exc
            if running_before is not None and \
                    getattr(self._hooks, "_running_count", None) != running_before + len(groups):
                self._warn_running_count(running_before, len(groups))
            inflight.admit(groups)
            self._cursor.mark_all(admitted_refs)
            admitted_ids = [ref.prompt_id for ref in admitted_refs]
            if continued:
                # Handed out again with the trajectories they had; the worker submits all N anew.
                restored.take(continued)
                inflight.continued(g.prompt_id for g in continued)
                for group in continued:
                    self._held_bytes.release(group.trajectories)
                continued = [TrajectoryGroup(g.prompt_id, seq, g.ds_index, g.trajectories, g.epoch, g.index, now)
                             for seq, g in enumerate(continued, inflight.next_seq - len(groups))]
            self._leases.extend(groups, now)
            self._totals["dispatched"] += len(groups)
            self._collector.release_held(strategy_changed=True)
            self._notify()
        # Positional: a keyword call to a dataclass builds a kwargs dict and costs about twice as much.
        result = DispatchResult(admitted_ids, first_seq, steps.paused, steps.step, steps.weight_version, steps.generation,
                                len(inflight.groups), len(self._buffer.entries), self._window_size,
                                # unchanged if nothing was admitted
                                self.admissible_after_change() if count or continued else allowed, continued,
                                self._lifecycle.job_ended)
        self._collector.clear_failures()  # a group quarantined on the way is reported; the admission stands
        if (count or continued) and self._recorder.recording:  # a server without a journal builds no record
            self._record(Dispatched(now, admitted_refs, request_id, client_id, [g.prompt_id for g in continued],
                                    self._liveness.watched(client_id)))
        return result

    def _warn_running_count(self, before: int, admitted: int) -> None:
        """Warn, once, that the strategy's _running_count did not grow by the groups its on_dispatched was told of:
        an override that forgot super().on_dispatched(groups) leaves R at 0, and the window admits past C."""
        self._watch_running = False
        after = getattr(self._hooks, "_running_count", None)
        hook = type(self._hooks).on_dispatched
        log.warning("strategy %r: its _running_count went from %s to %s while on_dispatched was told of %d admitted "
                    "group(s); does %s call super().on_dispatched(groups)? Without it the strategy counts fewer "
                    "running groups than there are (GetState running) and its window admits too many (warned once)",
                    self._failures.strategy, before, after, admitted, where(hook))

    def peek(self) -> DispatchResult:
        """`admit` without candidates, kept groups or their count (a peek at the window): nothing is admitted,
        so the answer is the window as it is, without admission's bookkeeping. A closed pacer refuses it."""
        self._lifecycle.check_open()
        allowed = self.admissible_now()
        steps = self._steps
        result = DispatchResult([], self._inflight.next_seq, steps.paused, steps.step, steps.weight_version,
                                steps.generation, len(self._inflight.groups), len(self._buffer.entries),
                                self._window_size, allowed, [], self._lifecycle.job_ended)
        self._collector.clear_failures()
        return result

    def admissible_now(self, refusing: bool = True) -> int:
        """What a Dispatch would admit now (0 while paused or closed); a raising compute_dispatch_count refuses
        (or, not `refusing`, reads as 0)."""
        if self._steps.paused or self._lifecycle.closed:
            return 0
        try:
            count = self._hooks.compute_dispatch_count(len(self._buffer.entries))
            if count.__class__ is not int:  # a NumPy integer is taken; a float, bool, str or None refused
                count = checked_count(count)
        except Exception as exc:
            if not refusing:
                return 0
            raise self._failures.refused("compute_dispatch_count", exc, "nothing was admitted") from exc
        # Clamped to 0 .. MAX_DISPATCH_COUNT (not max()/min(): a builtin parsing keywords costs several times more).
        if count > 0:
            return count if count < MAX_DISPATCH_COUNT else MAX_DISPATCH_COUNT
        return 0

    def admissible_after_change(self) -> int:
        """What a Dispatch would admit now, for an answer (or GetState) that must not fail: a raising
        compute_dispatch_count reads as 0 here; the next Dispatch fails with it and records it."""
        return self.admissible_now(refusing=False)
