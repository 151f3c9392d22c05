"""Where complete groups go when they leave the trajectory queue: the gate (will_collect), the filters, the buffer,
quarantine after a raising hook or a FAILED trajectory, re-checks of held groups, and reclaiming expired leases.

Written as functions over one Pacer's state, as its own methods would be (like reset_steps.py), so that pacer.py
reads as the dispatch-submit-collect cycle and this module as the collector behind it.
"""
from __future__ import annotations

import heapq
from types import MappingProxyType
from typing import TYPE_CHECKING, Iterable, Optional

from .incidents import DIRTY_GROUP, HOOK_FAILED, QUARANTINED, describe_exception, failed_trajectory, hook_error
from .inflight import InflightGroup, bytes_of
from .types import Incident, TrajectoryStatus

if TYPE_CHECKING:
    from .pacer import Pacer


def collect_ready(pacer: "Pacer", completed: Iterable[InflightGroup]) -> None:
    """Groups that just became complete: out through the gate now, or held until it opens."""
    for group in completed:
        if release(pacer, group) is False:
            group.held = True
            # An ordered gate never takes an aborted group: it waits for the Reset outside the heap.
            if not (pacer._ordered_gate and any(t.status == TrajectoryStatus.ABORTED
                                                for t in group.trajectories.values())):
                heapq.heappush(pacer._held, (group.seq, group.prompt_id))
    release_held(pacer)


def release_held(pacer: "Pacer") -> None:
    """Re-examine gate-refused groups, oldest first, for as long as the strategy state keeps changing.

    With an ordered gate a pass ends at the first refusal (later groups would be refused too),
    so its cost follows the groups released, not the groups held.
    """
    if pacer._strategy_touched and pacer._held:
        pacer._last_gate_pass = pacer._clock()
    while pacer._strategy_touched and pacer._held:
        pacer._strategy_touched = False
        still_held = []
        while pacer._held:
            seq, prompt_id = heapq.heappop(pacer._held)
            group = pacer._inflight.get(prompt_id)
            if group is None or group.seq != seq or not group.held:
                continue
            if release(pacer, group) is False:
                still_held.append((seq, prompt_id))
                if pacer._ordered_gate:
                    break
        for entry in still_held:
            heapq.heappush(pacer._held, entry)
    pacer._strategy_touched = False


def release(pacer: "Pacer", group: InflightGroup) -> Optional[bool]:
    """Ask the gate about a complete group and move it out if it may go: True if it went, False if the gate
    refused (the caller holds it), None if the gate raised (the group is quarantined)."""
    collectable = ask_gate(pacer, group)
    if collectable:
        move_out(pacer, group)
    return collectable


def ask_gate(pacer: "Pacer", group: InflightGroup) -> Optional[bool]:
    """The strategy's will_collect for a complete group; None when it raised (the group is quarantined)."""
    try:
        return bool(pacer._hooks.will_collect(MappingProxyType(group.trajectories)))
    except Exception as exc:
        quarantine_after_hook(pacer, group, "will_collect", exc)
        return None


def move_out(pacer: "Pacer", group: InflightGroup) -> None:
    """The group leaves the trajectory queue: into the buffer, dropped by a filter, or quarantined."""
    try:
        pacer._hooks.on_collected(group.prompt_id)
    except Exception as exc:
        quarantine_after_hook(pacer, group, "on_collected", exc, tell_strategy=False)
        return
    pacer._strategy_touched = True
    del pacer._inflight[group.prompt_id]
    pacer._complete_inflight -= 1
    pacer._queued_trajectories -= len(group.trajectories)
    view = MappingProxyType(group.trajectories)
    for group_filter in pacer._filters:
        try:
            kept = group_filter.keep(view)
        except Exception as exc:
            quarantine(pacer, group, hook_incident(pacer, f"filter {type(group_filter).__name__}.keep", exc,
                                                   group.prompt_id))
            return
        if not kept:
            pacer.totals["filtered"] += 1
            pacer._tally.filtered += 1
            pacer._held_bytes -= bytes_of(group.trajectories.values())
            return
    failed = None if pacer._train_on_failed else failed_trajectory(group.trajectories.values())
    if failed is not None:  # dirty data is never trained on silently (LoongSage stops on it)
        quarantine(pacer, group, pacer._incident(
            DIRTY_GROUP, group.prompt_id, "", f"trajectory {failed.trajectory_id!r} is FAILED and no filter "
            f"dropped the group (rollout.filter has no `status`; rollout.train_on_failed is false)"))
        return
    heapq.heappush(pacer._buffer, (group.priority(), group.to_group()))
    pacer.totals["collected"] += 1


def hook_incident(pacer: "Pacer", hook: str, exc: BaseException, prompt_id: str = "",
                  action: str = QUARANTINED) -> Incident:
    """Record a hook that raised on a group, and the error its caller gets (INTERNAL) once the call ends."""
    incident = pacer._incident(HOOK_FAILED, prompt_id, hook, describe_exception(exc), action)
    pacer._call_failures.append(hook_error(pacer._strategy.name, hook, exc, prompt_id=prompt_id, consequence=(
        "the group was quarantined (returned by the next Reset)" if action == QUARANTINED
        else "the call changed nothing")))
    return incident


def quarantine_after_hook(pacer: "Pacer", group: InflightGroup, hook: str, exc: BaseException,
                          tell_strategy: bool = True) -> None:
    """A hook raised on a complete group: take it out of the queue, free its slot if the strategy lets us."""
    incident = hook_incident(pacer, hook, exc, group.prompt_id)
    if group.prompt_id not in pacer._inflight:
        return
    if tell_strategy:
        try:
            pacer._hooks.on_collected(group.prompt_id)
            pacer._strategy_touched = True
        except Exception:  # the strategy is already reported broken for this group; its slot stays taken
            pass
    del pacer._inflight[group.prompt_id]
    pacer._complete_inflight -= 1
    pacer._queued_trajectories -= len(group.trajectories)
    quarantine(pacer, group, incident)


def quarantine(pacer: "Pacer", group: InflightGroup, incident: Incident) -> None:
    """Keep a complete group (already out of the trajectory queue) out of the buffer until the next Reset."""
    pacer._quarantined.append(group.to_group())
    pacer.totals["quarantined"] += 1
    pacer._notify()  # a waiting Collect reports the incident now


def expire(pacer: "Pacer", prompt_ids: list[str], lease_ids: list[str]) -> None:
    """Reclaim in-flight groups whose lease ran out (their slots) and lapsed Collect leases (back to the buffer)."""
    for prompt_id in prompt_ids:
        group = pacer._inflight.pop(prompt_id)
        try:
            pacer._hooks.on_collected(prompt_id)  # the slot is reclaimed as if the group had been collected
        except Exception as exc:  # reported; the group is reclaimed all the same
            pacer._incident(HOOK_FAILED, prompt_id, "on_collected", describe_exception(exc), "expired")
        pacer._queued_trajectories -= len(group.trajectories)
        if pacer.continue_restored:
            # Kept for continuation like a restored group (its bytes stay held) and re-offered first on
            # Dispatch; whoever continues it submits every trajectory anew, so none counts as accepted.
            pacer._restored.keep([group.to_group()])
            for trajectory_id in group.trajectories:
                pacer._accepted.pop(trajectory_id, None)
        else:
            pacer._expired_groups.append(group.to_group())
        pacer._expired_prompts.add(prompt_id)  # late Submits: LEASE_EXPIRED until it is dispatched again
        pacer.totals["expired"] += 1
    for lease_id in lease_ids:
        lease = pacer._leases.lapse(lease_id)
        for entry in lease.entries:
            heapq.heappush(pacer._buffer, entry)
        pacer.totals["redelivered"] += len(lease.entries)
    pacer._strategy_touched = True
    release_held(pacer)
    pacer._call_failures.clear()  # reported as incidents; the expiry stands
    pacer._notify()


def recheck(pacer: "Pacer") -> int:
    """Re-examine the held groups although nothing changed; returns how many left the trajectory queue."""
    before = len(pacer._inflight)
    pacer._strategy_touched = True
    release_held(pacer)
    pacer._call_failures.clear()  # reported as incidents
    released = before - len(pacer._inflight)
    if released:
        pacer._notify()
    return released
