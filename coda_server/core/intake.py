"""Submit's intake: trajectories sorted all-or-nothing, accepted into their groups, complete ones to the collector."""
from __future__ import annotations

import logging
from typing import Any, Callable, Mapping, Optional, Sequence

from .buffer import PipelineBuffer
from .checks import RequestChecks
from .clock import PacerClock
from .collector import Collector
from .errors import StaleGenerationError
from .incidents import HookFailures
from .inflight import HeldBytes, InflightTable, bytes_of
from .journal import Recorder, StaleRejected, Submitted
from .leases import Leases
from .limits import Limits
from .signals import Signals
from .steps import StepBoundary
from .types import SubmitResult, Trajectory

log = logging.getLogger("coda_server.intake")


class Intake:
    """Accepts a Submit's trajectories all-or-nothing: refused whole (malformed, unknown, stale, expired, no
    room, a fence crossed, the strategy's on_submitted raising) with nothing changed but the stale count;
    else into their groups, each complete group to the collector, the waiters woken, the change recorded.
    Its callers hold the pacer's lock."""

    def __init__(self, checks: RequestChecks, limits: Limits, inflight: InflightTable, held_bytes: HeldBytes,
                 leases: Leases, buffer: PipelineBuffer, collector: Collector, steps: StepBoundary, totals: dict,
                 signals: Signals, failures: HookFailures, recorder: Recorder, clock: PacerClock,
                 on_submitted: Optional[Callable[[Trajectory], Any]]):
        self._checks, self._limits, self._inflight, self._held_bytes = checks, limits, inflight, held_bytes
        self._leases, self._buffer, self._collector, self._steps = leases, buffer, collector, steps
        self._totals, self._notify, self._failures = totals, signals.notify, failures
        self._recorder, self._record, self._clock = recorder, recorder.record, clock
        self._on_submitted = on_submitted  # the strategy's optional hook, None when it does not define one

    def accept(self, trajectories: Sequence[Trajectory], request_id: str,
               dispatch_seqs: Optional[Mapping[str, int]]) -> SubmitResult:
        """See `Pacer.apply_submit`."""
        if dispatch_seqs:
            self._checks.check_fence_targets(dispatch_seqs, trajectories)
            self._inflight.check_fences(dispatch_seqs)
        collector, totals = self._collector, self._totals
        collector.clear_failures()
        stale_before = totals["stale_rejected"]
        try:
            fresh, duplicates, earlier_dispatch = self._sort(trajectories, dispatch_seqs)
        except StaleGenerationError:
            self._record(StaleRejected(self._clock.now(), totals["stale_rejected"] - stale_before))
            raise
        on_submitted = self._on_submitted
        if on_submitted is not None:  # the strategy hears first: if it raises, nothing changed
            try:
                for trajectory in fresh:
                    on_submitted(trajectory)
            except Exception as exc:
                raise self._failures.refused("on_submitted", exc, "nothing was accepted") from exc
        completed, assembling, added_bytes = self._inflight.accept(fresh)
        self._held_bytes.add(added_bytes)
        self._leases.extend(assembling, self._clock.now())
        totals["submitted"] += len(fresh)
        totals["duplicates"] += duplicates
        collector.collect_ready(completed)
        if fresh or duplicates:
            self._notify()
        result = SubmitResult(len(fresh), duplicates, len(completed))  # accepted, duplicates, groups completed
        if self._recorder.recording:  # a server without a journal builds no record (a copy of the batch)
            self._record(Submitted(self._clock.now(), list(trajectories), request_id))
        if earlier_dispatch and not self._recorder.replaying:  # said when it happened, not again at a restart
            self._warn_earlier_dispatch(earlier_dispatch)
        collector.raise_failures()  # accepted, but a hook raised on a group: the caller hears it (INTERNAL)
        return result

    def _sort(self, trajectories: Sequence[Trajectory], dispatch_seqs: Optional[Mapping[str, int]]
              ) -> tuple[list[Trajectory], int, list[tuple[str, str, int]]]:
        """Return (new trajectories, duplicate count, duplicates of an earlier dispatch of a running prompt) or
        raise with every problem found; changes nothing but the stale count."""
        inflight = self._inflight
        sorted_ = inflight.sort_submit(self._checks, trajectories, dispatch_seqs)
        if sorted_.refused_as_stale:
            self._totals["stale_rejected"] += len(sorted_.stale)
        sorted_.refuse(self._steps.generation, inflight.remembered_generations, self._leases.inflight_seconds,
                       self._checks.continue_restored)
        limits = self._limits
        if limits.max_held_bytes or limits.max_buffered_groups:
            get = inflight.get
            self._checks.check_room(
                self._held_bytes.total, bytes_of(sorted_.fresh) if limits.max_held_bytes else 0,
                len(self._buffer.entries),
                sum(1 for prompt_id, added in sorted_.added_per_group.items()
                    if len(get(prompt_id).trajectories) + added == get(prompt_id).group_size))
        return sorted_.fresh, sorted_.duplicates, sorted_.earlier_dispatch

    def _warn_earlier_dispatch(self, earlier_dispatch: list[tuple[str, str, int]]) -> None:
        """Said where the operator sees it: an unfenced Submit cannot be told from a late retry of the earlier
        dispatch's, so it is answered as duplicates; if it was new work under reused ids, the running group waits
        for trajectories that will not come until its in-flight lease runs out."""
        prompts = len({pid for _, pid, _ in earlier_dispatch})
        tid, pid, seq = earlier_dispatch[0]
        lease = self._leases.inflight_seconds
        waits = (f"until its in-flight lease runs out (server.inflight_lease_seconds = {lease:g})" if lease
                 else "indefinitely (server.inflight_lease_seconds is 0)")
        what = ("1 trajectory was counted as a duplicate" if len(earlier_dispatch) == 1
                else f"{len(earlier_dispatch)} trajectories were counted as duplicates")
        log.warning("Submit: %s (the first %r): an earlier dispatch of prompt %r brought them in this generation, and "
                    "its later dispatch (seq %d%s) runs without them. If they are that dispatch's work, their ids were "
                    "reused (trajectory ids must be unique within a generation) and its group waits %s", what, tid,
                    pid, seq, f"; {prompts} prompts in all" if prompts > 1 else "", waits)
