"""Recovery: the pacer's snapshot (export and import), the recorded-config check, the replay of journal events.

`Snapshot` reads and writes the owners a snapshot holds; `Recovery` rebuilds the state from the journal,
replaying each recorded change through the same steps the live call ran (given to it as the calls it
replays), at the time it first ran, and remembering its answer as the live call did. The Pacer builds both
over its owners, passed explicitly.
"""
from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING, Any, Callable, Optional

from .answers import AnswerBook
from .buffer import PipelineBuffer
from .checkpoints import Checkpoints, strategy_state
from .clock import PacerClock
from .collector import Collector
from .cursor import PromptCursor
from .errors import RecoveryError, StrategyHookError
from .incidents import HookFailures, IncidentLog, hook_error
from .inflight import HeldBytes, InflightTable
from .job_end import Lifecycle
from .journal import (
    Acked,
    Collected,
    Dispatched,
    Expired,
    GatesRechecked,
    JobEnded,
    JournalEvent,
    Reclaimed,
    Recorder,
    ResetAbandoned,
    ResetBegun,
    ResetFinished,
    Resumed,
    StaleRejected,
    Submitted,
    as_event,
)
from .leases import LAPSED_UNKNOWN, Leases
from .liveness import Liveness
from .plugins import raised_at, source_directory
from .replay import RestoredGroups
from .reset_steps import BoundaryCalls
from .shares import BatchShape
from .steps import StepBoundary

if TYPE_CHECKING:
    from .workers import Workers

log = logging.getLogger("coda_server.recovery")

# A recovery that takes longer logs how far it got this often: a big journal takes seconds to read and replay, and
# an operator watching the log would otherwise see nothing between start-up's first line and its last.
PROGRESS_SECONDS = 5.0
# A journal this long or longer gets a first line as its recovery begins; a shorter one is rebuilt in well under a
# second, its "recovered" line follows at once, and a start refused for it stays one line (the error).
FIRST_LINE_EVENTS = 1000
SNAPSHOT_FORMAT = 2  # 2: DispatchResult keeps admitted prompt ids and the first seq
# What to do about a journal that cannot be read back; recovery only reads, so the directory is as it was.
UNREADABLE_ADVICE = ("the state directory was not modified: start the coda-server version that wrote it, or, if the "
                     "file is damaged, move server.state_dir aside to start afresh (that loses its running and "
                     "buffered groups)")


class RecoveryInterrupted(Exception):
    """A stop was asked for (`Recovery.interrupt`) before the state was rebuilt; nothing was written."""


class RecoveryProgress:
    """Recovery's log lines while it runs: one when it begins (a long journal), then one every `every` seconds of
    `clock` (a monotonic clock; the pacer's own is pinned to each event's time during replay) saying how many events
    were read, then replayed, and how fast."""

    def __init__(self, directory: Any, clock: Callable[[], float], every: float):
        self._directory, self._clock, self._every = directory, clock, every
        self._phase, self._total, self._began, self._next = "", None, 0.0, 0.0

    def begin(self, total: Optional[int]) -> None:
        """The first line, for a long journal (or one that cannot count its events): what is read (the snapshot, and
        the events since it)."""
        self.phase("read", total)
        self._next = self._began + self._every
        if total is not None and total < FIRST_LINE_EVENTS:
            return
        events = "the events recorded after it" if total is None else f"the {total} events recorded after it"
        log.info("recovering the state in %s: reading its snapshot and %s, then replaying them (a progress line "
                 "every %gs)", self._directory, events, self._every,
                 extra={"fields": {"event": "recovering", "state_dir": str(self._directory), "events": total}})

    def phase(self, verb: str, total: Optional[int]) -> None:
        """Events are now `verb` ("read", then "replayed"), `total` of them (None: not known); the lines keep their
        pace across phases, the rate starts again."""
        self._phase, self._total = verb, total
        self._began = self._clock()

    def tick(self, done: int) -> None:
        """`done` events of the phase are through: a line if the last one is `every` seconds old."""
        now = self._clock()
        if now < self._next:
            return
        self._next = now + self._every
        rate = done / (now - self._began) if now > self._began else 0.0
        of = f" of {self._total}" if self._total is not None else ""
        log.info("recovering the state in %s: %d%s events %s (%.0f events/s)", self._directory, done, of,
                 self._phase, rate, extra={"fields": {"event": "recovery_progress", "state_dir": str(self._directory),
                                                      "phase": self._phase, "done": done, "events": self._total,
                                                      "events_per_second": round(rate, 1)}})


class StrategyRestoreError(Exception):
    """The strategy's restore() raised on the state its state() saved in the snapshot, which was read fine."""

    def __init__(self, strategy: str, exc: BaseException, at: str):
        place = f" (at {at})" if at else ""
        super().__init__(
            f"{hook_error(strategy, 'restore', exc)}{place}; the snapshot itself was read, and the state directory is "
            f"intact (do not move it aside: that loses the running and buffered groups): make restore() take back "
            f"what state() saves (e.g. a key renamed since the snapshot was written), or start the strategy version "
            f"that wrote it")


class Snapshot:
    """Everything a Reset leaves behind (nothing is in flight then), exported from the owners and imported back."""

    def __init__(self, lock: threading.RLock, steps: StepBoundary, inflight: InflightTable, totals: dict,
                 buffer: PipelineBuffer, answers: AnswerBook, leases: Leases, held_bytes: HeldBytes,
                 restored: RestoredGroups, incidents: IncidentLog, collector: Collector, cursor: PromptCursor,
                 checkpoints: Checkpoints, lifecycle: Lifecycle, hooks: Any, failures: HookFailures,
                 clock: PacerClock, summary: dict, strategy_name: str):
        self._lock, self._steps, self._inflight, self._totals = lock, steps, inflight, totals
        self._buffer, self._answers, self._leases, self._held_bytes = buffer, answers, leases, held_bytes
        self._restored, self._incidents, self._collector, self._cursor = restored, incidents, collector, cursor
        self._checkpoints, self._lifecycle, self._hooks, self._failures = checkpoints, lifecycle, hooks, failures
        self._clock, self.summary, self._strategy_name = clock, summary, strategy_name

    def export(self) -> dict:
        """A consistent copy, taken under the lock."""
        with self._lock:
            return {
                "format": SNAPSHOT_FORMAT,
                **self._steps.export(), **self._inflight.export(), "totals": dict(self._totals),
                "buffer": self._buffer.export(),
                "answers": self._answers.export(),
                **self._leases.export(),
                "held_bytes": self._held_bytes.total,
                "restored_kept": self._restored.export(),  # restored groups waiting to be continued
                "incidents": self._incidents.export(),
                "config": dict(self.summary),  # the pacing settings the state was made under
                "quarantined": self._collector.quarantined,  # empty after a Reset; a Restore may put some back
                "cursor": self._cursor.export(),  # the prompts admitted so far
                **self._checkpoints.export(),
                # What the strategy learned (its state() hook), under its name: restored only into the same strategy.
                "strategy": {"name": self._strategy_name, "state": strategy_state(self._hooks, self._failures)},
                **self._lifecycle.export(),
            }

    def load(self, snapshot: dict) -> None:
        """Put every owner back as the snapshot has it (caller holds the lock)."""
        if snapshot.get("format") != SNAPSHOT_FORMAT:
            raise ValueError(f"it is in format {snapshot.get('format')!r}, written by another version of coda-server; "
                             f"this version reads format {SNAPSHOT_FORMAT} (start the version that wrote it, or move "
                             f"server.state_dir aside to start afresh and Restore the trainer's checkpoint)")
        self._steps.restore(snapshot)
        self._inflight.restore(snapshot)
        self._totals.update(snapshot["totals"])
        self._buffer.replace(snapshot["buffer"])
        self._answers.restore(snapshot["answers"])
        self._leases.restore(snapshot, self._clock())
        self._held_bytes.total = snapshot["held_bytes"]
        self._restored.restore(snapshot.get("restored_kept"))  # absent in snapshots written before continuation
        self._incidents.restore(snapshot.get("incidents"))  # absent from snapshots written before incidents existed
        # Absent from snapshots written before checkpoints existed:
        self._collector.restore_quarantined(snapshot.get("quarantined") or ())
        self._cursor.restore(snapshot.get("cursor"))
        self._checkpoints.restore_marks(snapshot)
        saved = snapshot.get("strategy")  # absent from snapshots written before strategies kept state
        if saved and saved.get("state") is not None and saved.get("name") == self._strategy_name:
            try:
                self._hooks.restore(saved["state"])
            except Exception as exc:  # the strategy's bug, not the snapshot's: said so, or the state dir gets deleted
                at = raised_at(exc, source_directory(type(self._hooks)))
                raise StrategyRestoreError(self._strategy_name, exc, at) from exc
        self._lifecycle.restore(snapshot)


class Recovery:
    """Rebuilds the state from the journal: the snapshot, then every event since, replayed through the calls
    that made it (`dispatch`, `submit`, `take`, `ack`: the Pacer's apply steps; the step boundary's calls)."""

    def __init__(self, lock: threading.RLock, recorder: Recorder, snapshot: Snapshot, boundary: BoundaryCalls,
                 steps: StepBoundary, inflight: InflightTable, leases: Leases, liveness: Liveness,
                 collector: Collector, answers: AnswerBook, totals: dict, clock: PacerClock, *,
                 dispatch: Callable[..., Any], submit: Callable[..., Any], take: Callable[..., Any],
                 ack: Callable[..., Any], workers: Workers):
        self._lock, self._recorder, self._snapshot, self._boundary = lock, recorder, snapshot, boundary
        self._steps, self._inflight, self._leases, self._liveness = steps, inflight, leases, liveness
        self._collector, self._answers, self._totals, self._clock = collector, answers, totals, clock
        self._dispatch, self._submit, self._take, self._ack, self._workers = dispatch, submit, take, ack, workers
        self._interrupted = threading.Event()
        # (events replayed, events to replay) once the journal is read; None before. Read by another thread.
        self.progress: Optional[tuple[int, int]] = None
        # The clock and interval of the progress lines (a test sets a fake clock).
        self.progress_clock: Callable[[], float] = time.monotonic
        self.progress_seconds = PROGRESS_SECONDS

    def interrupt(self) -> None:
        """From any thread: a recovery in progress (or still to begin) stops before its next event, raising
        RecoveryInterrupted, with nothing written; a journal that can stop reading early is told to."""
        self._interrupted.set()
        stop_reading = getattr(self._recorder.journal, "interrupt", None)
        if stop_reading is not None:
            stop_reading()

    def _check_interrupted(self) -> None:
        if self._interrupted.is_set():
            raise RecoveryInterrupted(f"stopped after replaying {self.progress[0]} of {self.progress[1]} events"
                                      if self.progress is not None else "stopped while reading the journal")

    def recover(self) -> int:
        """Rebuild the state: the snapshot, then the events replayed in order. The strategy is a fresh instance
        that hears every dispatch and collection since the last Reset again, custom strategies included.
        Returns the number of events replayed."""
        journal = self._recorder.journal
        if journal is None:
            return 0
        self._check_interrupted()
        lines = RecoveryProgress(journal.directory, self.progress_clock, self.progress_seconds)
        count = getattr(journal, "event_count", None)
        lines.begin(count() if count is not None else None)
        try:
            snapshot, recorded_events = journal.load(on_read=lines.tick)
        except Exception as exc:
            self._check_interrupted()  # the journal stopped reading because it was told to
            # A record the restricted unpickler refuses, a truncated one, a damaged file: one line, not a traceback.
            what = (f": {exc}" if isinstance(exc, RecoveryError) else  # the backend's own words name its file
                    f" in {journal.directory}: {type(exc).__name__}: {exc}")
            raise RecoveryError(f"cannot read the state{what}; {UNREADABLE_ADVICE}") from None
        self.progress = (0, len(recorded_events))
        self._check_interrupted()
        recorded = (snapshot or {}).get("config")  # None: a new directory, or a snapshot older than the record
        if recorded_events:
            self.check_recorded_config(recorded, len(recorded_events))
        with self._recorder.suspended(), self._lock:  # replaying must not record the events again
            if snapshot is not None:
                try:
                    self._snapshot.load(snapshot)
                except StrategyRestoreError as exc:
                    raise RecoveryError(f"cannot recover the state in {journal.directory}: {exc}") from None
                except (KeyError, ValueError) as exc:
                    raise RecoveryError(f"cannot read the state snapshot in {journal.directory}: {exc}") from None
            lines.phase("replayed", len(recorded_events))
            for number, recorded_event in enumerate(recorded_events, 1):
                self._check_interrupted()  # before the event: a stop leaves nothing half-replayed to write
                self.progress = (number - 1, len(recorded_events))
                lines.tick(number - 1)
                try:
                    event = as_event(recorded_event)
                    with self._clock.pinned(event.at):  # the replayed call sees the time it first ran at
                        self.replay(event)
                except Exception as exc:
                    kind = type(recorded_event).__name__ if not isinstance(recorded_event, tuple) else recorded_event[0]
                    raise RecoveryError(
                        f"cannot rebuild the state in {journal.directory}: replaying event {number} of "
                        f"{len(recorded_events)} ({kind}) failed: {exc}. Was the pacing configuration changed "
                        f"since the state was written? Start with the configuration it was written with, or move "
                        f"server.state_dir aside to start afresh") from None
            self.progress = (len(recorded_events), len(recorded_events))
        self._check_interrupted()  # the last point at which nothing has been written
        if not recorded_events and recorded != self._snapshot.summary:
            # Nothing in flight (a new directory, or just after a Reset): put these settings on record now, so a
            # restart before the next Reset replays its events under the settings they were recorded with.
            self._recorder.snapshot(self._snapshot.export())
        if self._steps.resetting:  # the last process died during a Reset's wait: end it (recorded); a retry starts afresh
            self._boundary.abandon()
        with self._lock:
            now = self._clock()
            self._steps.restart_pause_clock(now)
            self._leases.restart_clocks(now, self._inflight.values())
            self._liveness.watch(self._leases.held().keys(), now)  # a trainer that does not come back loses its leases
            self._liveness.restart_clocks(now)
        return len(recorded_events)

    def check_recorded_config(self, recorded: Optional[dict], events: int) -> None:
        """Refuse to replay events recorded under other pacing settings: that would rebuild a different state."""
        if recorded is None:  # a snapshot older than the record: nothing to compare (replay still checks itself)
            return
        summary = self._snapshot.summary
        # Keys on one side only were added to (or removed from) the summary by another version; they restate the
        # others (e.g. window_size), so only the keys both record are compared.
        changed = [f"{key} {recorded.get(key)!r} -> {summary.get(key)!r}"
                   for key in sorted(set(recorded) & set(summary)) if recorded.get(key) != summary.get(key)]
        if changed:
            raise RecoveryError(
                f"the state in {self._recorder.journal.directory} has {events} events since its last snapshot, "
                f"recorded under other pacing settings ({', '.join(changed)}); start with the settings they were "
                f"recorded with (to change settings, restart after a Reset, when nothing is replayed), or move "
                f"server.state_dir aside to start afresh")

    def replay(self, event: JournalEvent) -> None:
        """Apply one recorded change again, through the step the live call ran, and remember its answer."""
        remember, boundary = self._answers.remember, self._boundary
        if isinstance(event, Dispatched):
            if event.watched:
                self._liveness.watch([event.client_id], event.at)
            result = self._dispatch(event.refs, event.request_id, event.client_id, continued_ids=event.continued)
            if result.admitted_ids != [r.prompt_id for r in event.refs]:
                raise RuntimeError(f"recovery diverged: the strategy admitted {len(result.admitted_ids)} of the "
                                   f"{len(event.refs)} groups it admitted before the restart")
            remember("Dispatch", event.request_id, result)
        elif isinstance(event, Submitted):
            try:
                remember("Submit", event.request_id, self._submit(event.trajectories, event.request_id))
            except StrategyHookError:  # the live call raised it too, after its change: the change is replayed
                pass
        elif isinstance(event, StaleRejected):
            self._totals["stale_rejected"] += event.count
        elif isinstance(event, Collected):
            remember("Collect", event.request_id,
                     self._take(event.count, event.timed_out, event.request_id, event.lease_seconds,
                                BatchShape(event.token_budget, event.rank, event.world_size, event.run),
                                event.num_groups, split=event.split, holder=event.holder))
        elif isinstance(event, Acked):
            remember("Ack", event.request_id, self._ack(event.lease_id, event.request_id))
        elif isinstance(event, Expired):
            if event.holder:  # its silence ended them: kept for it to claim back, as live
                self._workers.lapse_silent(event.at, event.holder, event.lease_ids, event.why)
            else:
                self._collector.expire(event.prompt_ids, event.lease_ids, event.why or LAPSED_UNKNOWN)
        elif isinstance(event, Reclaimed):
            reclaimed, _ = self._workers.apply_reclaim(event.holder, event.leases)
            if len(reclaimed) != len(event.leases):
                raise RuntimeError(f"recovery diverged: the leases {event.holder} reclaimed are not in the buffer")
        elif isinstance(event, ResetBegun):
            boundary.begin(event.mode, resume=event.resume, weight_version=event.weight_version)
        elif isinstance(event, ResetFinished):
            self._steps.ready_at = event.ready_at
            remember("Reset", event.request_id, boundary.finish(resume=event.resume, weight_version=event.weight_version,
                                                                 request_id=event.request_id,
                                                                 max_response_bytes=event.max_response_bytes))
        elif isinstance(event, ResetAbandoned):
            boundary.abandon()
        elif isinstance(event, GatesRechecked):
            self._collector.recheck()
        elif isinstance(event, JobEnded):
            boundary.end_job(event.mode)
        elif isinstance(event, Resumed):
            remember("Resume", event.request_id, boundary.resume(event.weight_version, event.request_id))
        else:
            raise ValueError(f"unknown journal event {event!r:.80}")
