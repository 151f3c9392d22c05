"""Recovery: the snapshot a Pacer exports and imports, the recorded-config check, and the replay of journal events.

These functions work on one Pacer's state, as its own methods would; they live here so that the
pacing rule (pacer.py) reads without them. Replay re-runs each recorded change through the same
steps the live call ran, at the time it first ran, and remembers its answer as the live call did.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional

from .cursor import PromptCursor
from .errors import RecoveryError, StrategyHookError
from .incidents import HOOK_FAILED, describe_exception
from .shares import BatchShape
from .journal import (
    Acked,
    Collected,
    Dispatched,
    Expired,
    GatesRechecked,
    JobEnded,
    JournalEvent,
    ResetAbandoned,
    ResetBegun,
    ResetFinished,
    Resumed,
    StaleRejected,
    Submitted,
    as_event,
)

if TYPE_CHECKING:
    from .pacer import Pacer

SNAPSHOT_FORMAT = 2  # 2: DispatchResult keeps admitted prompt ids and the first seq


def export_state(pacer: "Pacer") -> dict:
    """A consistent copy of everything a Reset leaves behind (nothing is in flight then), for a snapshot."""
    with pacer.lock:
        return {
            "format": SNAPSHOT_FORMAT,
            **pacer.steps.export(), **pacer.inflight.export(), "totals": dict(pacer.totals),
            "buffer": pacer.buffer.export(),
            "answers": pacer.answers.export(),
            **pacer.leases.export(),
            "held_bytes": pacer.held_bytes.total,
            "restored_kept": pacer.restored.export(),  # restored groups waiting to be continued
            "incidents": pacer.incidents.export(),
            "config": dict(pacer.summary),  # the pacing settings the state was made under
            "quarantined": pacer.collector.quarantined,  # empty after a Reset; a Restore may put some back
            "cursor": pacer.cursor.export(),  # the prompts admitted so far
            "last_checkpoint": pacer.last_checkpoint, "last_restore": pacer.last_restore,
            # What the strategy learned (its state() hook), under its name: restored only into the same strategy.
            "strategy": {"name": pacer.strategy.name, "state": strategy_state(pacer)},
            "job_ended": pacer.job_ended, "job_end_mode": pacer.job_end_mode,
        }


def strategy_state(pacer: "Pacer") -> Any:
    """What the strategy's state() hook returns; None (an incident recorded) when it raises."""
    hook = getattr(pacer.hooks, "state", None)
    if not callable(hook):  # a strategy of its own making, with an attribute of that name: nothing to save
        return None
    try:
        return hook()
    except Exception as exc:  # a broken hook must not cost the snapshot: reported, and the restart relearns
        pacer.incident(HOOK_FAILED, "", "state", describe_exception(exc), "not saved")
        return None


def import_state(pacer: "Pacer", snapshot: dict) -> None:
    if snapshot.get("format") != SNAPSHOT_FORMAT:
        raise ValueError(f"it is in format {snapshot.get('format')!r}, written by another version of coda-server; "
                         f"this version reads format {SNAPSHOT_FORMAT} (move server.state_dir aside to start afresh)")
    pacer.steps.restore(snapshot)
    pacer.inflight.restore(snapshot)
    pacer.totals.update(snapshot["totals"])
    pacer.buffer.replace(snapshot["buffer"])
    pacer.answers.restore(snapshot["answers"])
    pacer.leases.restore(snapshot, pacer.clock())
    pacer.held_bytes.total = snapshot["held_bytes"]
    pacer.restored.restore(snapshot.get("restored_kept"))  # absent in snapshots written before continuation
    pacer.incidents.restore(snapshot.get("incidents"))  # absent from snapshots written before incidents existed
    # Absent from snapshots written before checkpoints existed:
    pacer.collector.restore_quarantined(snapshot.get("quarantined") or ())
    pacer.cursor = PromptCursor.restored(snapshot.get("cursor"))
    pacer.last_checkpoint, pacer.last_restore = snapshot.get("last_checkpoint"), snapshot.get("last_restore")
    saved = snapshot.get("strategy")  # absent from snapshots written before strategies kept state
    if saved and saved.get("state") is not None and saved.get("name") == pacer.strategy.name:
        pacer.hooks.restore(saved["state"])
    pacer.job_ended = bool(snapshot.get("job_ended", False))  # absent from snapshots written before EndJob
    pacer.job_end_mode = snapshot.get("job_end_mode", pacer.job_end_mode)


def recover(pacer: "Pacer") -> int:
    """Rebuild the pacer's state from its journal: the snapshot, then the events replayed in order.

    The strategy is a fresh instance that hears every dispatch and collection since the last Reset
    again, custom strategies included. Returns the number of events replayed.
    """
    journal = pacer.journal
    if journal is None:
        return 0
    snapshot, recorded_events = journal.load()
    recorded = (snapshot or {}).get("config")  # None: a new directory, or a snapshot older than the record
    if recorded_events:
        check_recorded_config(pacer, recorded, len(recorded_events))
    with pacer.recorder.suspended(), pacer.lock:  # replaying must not record the events again
        if snapshot is not None:
            try:
                import_state(pacer, snapshot)
            except (KeyError, ValueError) as exc:
                raise RecoveryError(f"cannot read the state snapshot in {journal.directory}: {exc}") from None
        for number, recorded_event in enumerate(recorded_events, 1):
            try:
                event = as_event(recorded_event)
                with pacer.clock.pinned(event.at):  # the replayed call sees the time it first ran at
                    replay(pacer, event)
            except Exception as exc:
                kind = type(recorded_event).__name__ if not isinstance(recorded_event, tuple) else recorded_event[0]
                raise RecoveryError(
                    f"cannot rebuild the state in {journal.directory}: replaying event {number} of "
                    f"{len(recorded_events)} ({kind}) failed: {exc}. Was the pacing configuration changed since "
                    f"the state was written? Start with the configuration it was written with, or move "
                    f"server.state_dir aside to start afresh") from None
    if not recorded_events and recorded != pacer.summary:
        # Nothing in flight (a new directory, or just after a Reset): put these settings on record now, so a
        # restart before the next Reset replays its events under the settings they were recorded with.
        pacer.recorder.snapshot(export_state(pacer))
    if pacer.resetting:  # the last process died during a Reset's wait: end it (recorded); a retried Reset starts afresh
        pacer.abandon_reset()
    with pacer.lock:
        pacer.steps.restart_pause_clock(pacer.clock())
        pacer.leases.restart_clocks(pacer.clock(), pacer.inflight.values())
        pacer.liveness.restart_clocks(pacer.clock())
    return len(recorded_events)


def check_recorded_config(pacer: "Pacer", recorded: Optional[dict], events: int) -> None:
    """Refuse to replay events recorded under other pacing settings: that would rebuild a different state."""
    if recorded is None:  # a snapshot older than the record: nothing to compare (replay still checks itself)
        return
    summary = pacer.summary
    # Keys on one side only were added to (or removed from) the summary by another version; they restate the
    # others (e.g. window_size), so only the keys both record are compared.
    changed = [f"{key} {recorded.get(key)!r} -> {summary.get(key)!r}"
               for key in sorted(set(recorded) & set(summary)) if recorded.get(key) != summary.get(key)]
    if changed:
        raise RecoveryError(
            f"the state in {pacer.journal.directory} has {events} events since its last snapshot, recorded under "
            f"other pacing settings ({', '.join(changed)}); start with the settings they were recorded with "
            f"(to change settings, restart after a Reset, when nothing is replayed), or move server.state_dir "
            f"aside to start afresh")


def replay(pacer: "Pacer", event: JournalEvent) -> None:
    """Apply one recorded change again, through the step the live call ran, and remember its answer."""
    remember = pacer.answers.remember
    if isinstance(event, Dispatched):
        if event.watched:
            pacer.liveness.restore([event.client_id], event.at)
        result = pacer.apply_dispatch(event.refs, event.request_id, event.client_id, continued_ids=event.continued)
        if result.admitted_ids != [r.prompt_id for r in event.refs]:
            raise RuntimeError(f"recovery diverged: the strategy admitted {len(result.admitted_ids)} of the "
                               f"{len(event.refs)} groups it admitted before the restart")
        remember("Dispatch", event.request_id, result)
    elif isinstance(event, Submitted):
        try:
            remember("Submit", event.request_id, pacer.apply_submit(event.trajectories, event.request_id))
        except StrategyHookError:  # the live call raised it too, after its change: the change is replayed
            pass
    elif isinstance(event, StaleRejected):
        pacer.totals["stale_rejected"] += event.count
    elif isinstance(event, Collected):
        remember("Collect", event.request_id,
                 pacer.apply_take(event.count, event.timed_out, event.request_id, event.lease_seconds,
                                  BatchShape(event.token_budget, event.rank, event.world_size), event.num_groups))
    elif isinstance(event, Acked):
        remember("Ack", event.request_id, pacer.apply_ack(event.lease_id, event.request_id))
    elif isinstance(event, Expired):
        pacer.apply_expiry(event.prompt_ids, event.lease_ids)
    elif isinstance(event, ResetBegun):
        pacer.begin_reset(event.mode, resume=event.resume, weight_version=event.weight_version)
    elif isinstance(event, ResetFinished):
        pacer.steps.ready_at = event.ready_at
        remember("Reset", event.request_id,
                 pacer.finish_reset(resume=event.resume, weight_version=event.weight_version,
                                    request_id=event.request_id))
    elif isinstance(event, ResetAbandoned):
        pacer.abandon_reset()
    elif isinstance(event, GatesRechecked):
        pacer.apply_gate_recheck()
    elif isinstance(event, JobEnded):
        pacer.begin_end_job(event.mode)
    elif isinstance(event, Resumed):
        remember("Resume", event.request_id, pacer.apply_resume(event.weight_version, event.request_id))
    else:
        raise ValueError(f"unknown journal event {event!r:.80}")
