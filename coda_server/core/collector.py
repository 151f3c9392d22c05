"""The collector: where complete groups go when they leave the trajectory queue (the gate, the filters, the buffer,
quarantine), the groups the gate holds, the groups set aside until the next Reset, and the hook failures of a call."""
from __future__ import annotations

import heapq
import logging
from types import MappingProxyType
from typing import Any, Callable, Iterable, Optional

from .buffer import PipelineBuffer
from .errors import StrategyHookError
from .incidents import DIRTY_GROUP, HOOK_FAILED, QUARANTINED, describe_exception, failed_trajectory, hook_error
from .inflight import HeldBytes, InflightGroup, InflightTable, StepTally
from .leases import LAPSED_UNKNOWN, Leases
from .replay import RestoredGroups
from .strategy import checked_gate
from .types import Incident, TrajectoryGroup, TrajectoryStatus

log = logging.getLogger("coda_server.leases")
IncidentSink = Callable[..., Incident]  # (kind, prompt_id, hook, message, action) -> the recorded incident


class Collector:
    """Moves complete groups out of the in-flight table: to the buffer when the strategy's gate (will_collect)
    lets them go and no filter drops them, else held (gate refused, re-examined when the strategy's state
    changes), or quarantined (a hook raised, or dirty data). Owns the held heap, the quarantined and expired
    groups (returned by the next Reset), the ids of the released groups kept for continuation (named by the next
    Reset) and the hook failures of the call running now (raised to its caller)."""

    def __init__(self, hooks: Any, filters: list, inflight: InflightTable, buffer: PipelineBuffer,
                 held_bytes: HeldBytes, tally: StepTally, totals: dict, restored: RestoredGroups, leases: Leases,
                 *, ordered_gate: bool, train_on_failed: bool, continue_restored: bool, strategy_name: str,
                 incident: IncidentSink, notify: Callable[[], None], clock: Callable[[], float]):
        self._hooks = hooks
        self._filters = filters
        self._inflight = inflight
        self._buffer = buffer
        self._held_bytes = held_bytes
        self._tally = tally
        self._totals = totals
        self._restored = restored
        self._leases = leases
        self._ordered_gate = ordered_gate  # a re-examination pass stops at the first refusal
        self._train_on_failed = train_on_failed
        self._continue_restored = continue_restored
        self._strategy_name = strategy_name
        self._incident = incident
        self._notify = notify
        self._clock = clock
        self._held: list[tuple[int, str]] = []  # heap of (seq, prompt_id); stale entries skipped lazily
        self._strategy_touched = False  # the strategy's state changed since held groups were last examined
        self.last_gate_pass = clock()  # when held groups were last re-examined (for the periodic re-check)
        self._expired: list[TrajectoryGroup] = []  # reclaimed this generation; the next Reset returns them
        # Prompt ids released this generation and kept for continuation (rollout.continue_restored), in the order of
        # their latest release: the next Reset names those still kept, as it names `_expired` without continuation.
        self._released_kept: dict[str, None] = {}
        # Complete groups a raising hook or dirty data kept out of the buffer; the next Reset returns them.
        self._quarantined: list[TrajectoryGroup] = []
        self._call_failures: list[StrategyHookError] = []  # hook failures of the call running now

    # ------------------------------------------------------------- reading

    @property
    def holds_groups(self) -> bool:
        return bool(self._held)

    @property
    def quarantined(self) -> list[TrajectoryGroup]:
        return list(self._quarantined)

    @property
    def expired(self) -> list[TrajectoryGroup]:
        return list(self._expired)

    # ------------------------------------------------------------- the calls' failures

    def clear_failures(self) -> None:
        """The failures so far were reported as incidents; the change that met them stands."""
        if self._call_failures:
            self._call_failures.clear()

    def raise_failures(self) -> None:
        """Raise the first hook failure of this call, if any (its change stands: the caller hears INTERNAL)."""
        if self._call_failures:
            failures, self._call_failures = self._call_failures, []
            raise failures[0]

    # ------------------------------------------------------------- complete groups

    def strategy_changed(self) -> None:
        """The strategy's state changed (a dispatch, a restore): held groups may be released by the next pass."""
        self._strategy_touched = True

    def collect_ready(self, completed: Iterable[InflightGroup]) -> None:
        """Groups that just became complete: out through the gate now, or held until it opens."""
        for group in completed:
            if self._release(group) is False:
                group.held = True
                # An ordered gate never takes an aborted group: it waits for the Reset outside the heap.
                if not (self._ordered_gate and any(t.status is TrajectoryStatus.ABORTED
                                                   for t in group.trajectories.values())):
                    heapq.heappush(self._held, (group.seq, group.prompt_id))
        self.release_held()

    def release_held(self, strategy_changed: bool = False) -> None:
        """Re-examine gate-refused groups, oldest first, for as long as the strategy state keeps changing
        (`strategy_changed`: it just did).

        With an ordered gate a pass ends at the first refusal (later groups would be refused too),
        so its cost follows the groups released, not the groups held.
        """
        held = self._held
        if strategy_changed:
            self._strategy_touched = True
        if self._strategy_touched and held:
            self.last_gate_pass = self._clock()
        while self._strategy_touched and held:
            self._strategy_touched = False
            still_held = []
            while held:
                seq, prompt_id = heapq.heappop(held)
                group = self._inflight.get(prompt_id)
                if group is None or group.seq != seq or not group.held:
                    continue
                if self._release(group) is False:
                    still_held.append((seq, prompt_id))
                    if self._ordered_gate:
                        break
            for entry in still_held:
                heapq.heappush(held, entry)
        self._strategy_touched = False

    def recheck(self) -> int:
        """Re-examine the held groups although nothing changed; returns how many left the trajectory queue."""
        before = len(self._inflight)
        self._strategy_touched = True
        self.release_held()
        self._call_failures.clear()  # reported as incidents
        released = before - len(self._inflight)
        if released:
            self._notify()
        return released

    def _release(self, group: InflightGroup) -> Optional[bool]:
        """Ask the gate about a complete group and move it out if it may go: True if it went, False if the gate
        refused (the caller holds it), None if the gate raised (the group is quarantined)."""
        collectable = self._ask_gate(group)
        if collectable:
            self._move_out(group)
        return collectable

    def _ask_gate(self, group: InflightGroup) -> Optional[bool]:
        try:
            return checked_gate(self._hooks.will_collect(MappingProxyType(group.trajectories)))
        except Exception as exc:
            self._quarantine_after_hook(group, "will_collect", exc)
            return None

    def _move_out(self, group: InflightGroup) -> None:
        """The group leaves the trajectory queue: into the buffer, dropped by a filter, or quarantined."""
        try:
            self._hooks.on_collected(group.prompt_id)
        except Exception as exc:
            self._quarantine_after_hook(group, "on_collected", exc, tell_strategy=False)
            return
        self._strategy_touched = True
        self._inflight.remove_complete(group)
        view = MappingProxyType(group.trajectories)
        for group_filter in self._filters:
            try:
                kept = group_filter.keep(view)
            except Exception as exc:
                self._quarantine(group, self._hook_incident(f"filter {type(group_filter).__name__}.keep", exc,
                                                            group.prompt_id))
                return
            if not kept:
                self._totals["filtered"] += 1
                self._tally.filtered += 1
                self._held_bytes.release(group.trajectories.values())
                self._inflight.left(group.trajectories.values())
                return
        failed = None if self._train_on_failed else failed_trajectory(group.trajectories.values())
        if failed is not None:  # dirty data is never trained on silently (LoongSage stops on it)
            self._quarantine(group, self._incident(
                DIRTY_GROUP, group.prompt_id, "", f"trajectory {failed.trajectory_id!r} is FAILED and no filter "
                f"dropped the group (rollout.filter has no `status`; rollout.train_on_failed is false)"))
            return
        self._buffer.push((group.priority(), group.to_group()))
        self._totals["collected"] += 1

    def _hook_incident(self, hook: str, exc: BaseException, prompt_id: str = "",
                       action: str = QUARANTINED) -> Incident:
        """Record a hook that raised on a group, and the error its caller gets (INTERNAL) once the call ends."""
        incident = self._incident(HOOK_FAILED, prompt_id, hook, describe_exception(exc), action)
        self._call_failures.append(hook_error(self._strategy_name, hook, exc, prompt_id=prompt_id, consequence=(
            "the group was quarantined (returned by the next Reset)" if action == QUARANTINED
            else "the call changed nothing")))
        return incident

    def _quarantine_after_hook(self, group: InflightGroup, hook: str, exc: BaseException,
                               tell_strategy: bool = True) -> None:
        """A hook raised on a complete group: take it out of the queue, free its slot if the strategy lets us."""
        incident = self._hook_incident(hook, exc, group.prompt_id)
        if group.prompt_id not in self._inflight:
            return
        if tell_strategy:
            try:
                self._hooks.on_collected(group.prompt_id)
                self._strategy_touched = True
            except Exception:  # the strategy is already reported broken for this group; its slot stays taken
                pass
        self._inflight.remove_complete(group)
        self._quarantine(group, incident)

    def _quarantine(self, group: InflightGroup, incident: Incident) -> None:
        """Keep a complete group (already out of the trajectory queue) out of the buffer until the next Reset."""
        self._quarantined.append(group.to_group())
        self._totals["quarantined"] += 1
        self._notify()  # a waiting Collect reports the incident now

    # ------------------------------------------------------------- expiry

    def expire(self, prompt_ids: list[str], lease_ids: list[str], why: str = LAPSED_UNKNOWN) -> None:
        """Reclaim in-flight groups whose lease ran out (their slots) and lapsed Collect leases (back to the buffer;
        `why` is what an Ack of one is told), with the ranks' shares that end with them (`Leases.end`)."""
        for prompt_id in prompt_ids:
            # Kept for continuation, whoever continues it submits every trajectory anew: none counts as accepted.
            group = self._inflight.expire(prompt_id, resubmitted=self._continue_restored)
            try:
                self._hooks.on_collected(prompt_id)  # the slot is reclaimed as if the group had been collected
            except Exception as exc:  # reported; the group is reclaimed all the same
                self._incident(HOOK_FAILED, prompt_id, "on_collected", describe_exception(exc), "expired")
            if self._continue_restored:
                # Kept for continuation like a restored group (its bytes stay held) and re-offered first on Dispatch.
                self._restored.keep([group.to_group()])
                self._released_kept.pop(prompt_id, None)  # released again after a continuation: its latest place
                self._released_kept[prompt_id] = None
            else:
                self._expired.append(group.to_group())
            self._totals["expired"] += 1
        ended = self._leases.end(lease_ids, why) if lease_ids else ()
        for lease in ended:
            self._buffer.push_all(lease.entries)
            self._totals["redelivered"] += len(lease.entries)
        if len(ended) > len(lease_ids):
            log.info("%d rank share(s) not handed out yet (%s) went back to the buffer with their data-parallel "
                     "mini-batch, as another rank's share of it ended unacknowledged (%s): every rank takes a new one",
                     len(ended) - len(lease_ids), ", ".join(lease.lease_id for lease in ended[len(lease_ids):]),
                     ", ".join(lease_ids))
        self._strategy_touched = True
        self.release_held()
        self._call_failures.clear()  # reported as incidents; the expiry stands
        self._notify()

    # ------------------------------------------------------------- the step boundary

    def set_aside(self) -> tuple[list[TrajectoryGroup], list[TrajectoryGroup]]:
        """(expired, quarantined) groups of this generation, handed over (a Reset returns them): none is kept."""
        expired, quarantined = self._expired, self._quarantined
        self._expired, self._quarantined = [], []
        return expired, quarantined

    def take_released_kept(self) -> list[str]:
        """The prompt ids released this generation and kept for continuation, in the order of their latest release,
        handed over (a Reset names those still kept): none is named again."""
        released, self._released_kept = list(self._released_kept), {}
        return released

    def new_generation(self, quarantined: Iterable[TrajectoryGroup] = ()) -> None:
        """Nothing is in flight any more (a Restore): nothing held or set aside but `quarantined`."""
        self._held.clear()
        self._expired, self._quarantined = [], list(quarantined)
        self._released_kept = {}
        self._strategy_touched = True

    def clear_held(self) -> None:
        self._held.clear()

    def restore_quarantined(self, groups: Iterable[TrajectoryGroup]) -> None:
        self._quarantined = list(groups)
