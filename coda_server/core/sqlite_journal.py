"""The SQLite journal: an append-only WAL log of the Pacer's events with a snapshot at each Reset, and the state-dir lock."""
from __future__ import annotations

import fcntl
import logging
import os
import sqlite3
import threading
from collections import deque
from pathlib import Path
from typing import Any, Callable, Optional

from .journal import (
    FSYNC_POLICIES,
    JournalEvent,
    PickledTrajectories,
    StateDirError,
    StateDirLockedError,
    TrajectoryCodec,
    dumps,
    loads,
)

log = logging.getLogger("coda_server.journal")

# WAL size (in 64 KiB pages, so 256 MiB) at which SQLite folds it into the database by itself.
WAL_PAGES_LIMIT = 4096


class SqliteJournal:
    """The `Journal` of one state directory: SQLite in WAL mode, written in order by one background thread
    with group commit.

    `append(event)` queues an event and returns its ticket; `snapshot(state)` queues a snapshot that
    replaces every event queued before it. `wait(ticket)` / `on_durable(ticket, callback)` tell when
    the write has been committed.
    """

    def __init__(self, state_dir: str | Path, *, fsync: str = "normal", codec: Optional[TrajectoryCodec] = None):
        if fsync not in FSYNC_POLICIES:
            raise ValueError(f"fsync policy {fsync!r} is not known; allowed: {', '.join(FSYNC_POLICIES)}")
        self.directory = Path(state_dir).absolute()  # a relative default (./coda-state) is named in full in logs
        self.codec = codec or PickledTrajectories()
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            self._lock_file = self._take_lock()
            self._db = self._open_database(fsync)
        except (OSError, sqlite3.Error) as exc:
            raise StateDirError(f"server.state_dir {str(self.directory)!r} cannot be used: {exc}; it must be a "
                                f"directory (or a path where one can be made) that this user can write") from None
        self._queue: deque[tuple[int, str, Any]] = deque()
        self._cond = threading.Condition()
        self._queued = 0  # tickets handed out
        self._durable = 0  # tickets committed
        self._error: Optional[BaseException] = None
        self._callbacks: list[tuple[int, Callable[[], None]]] = []
        self._closing = False
        self._writer = threading.Thread(target=self._write_loop, name="coda-journal", daemon=True)
        self._writer.start()

    def _open_database(self, fsync: str) -> sqlite3.Connection:
        db = sqlite3.connect(self.directory / "pacer.sqlite3", isolation_level=None, check_same_thread=False)
        # Events are large blobs (a Submit carries its trajectories): 64 KiB pages store them in few
        # pages. The WAL is folded into the database after each snapshot rather than every 1000 pages,
        # which would copy every event a second time; WAL_PAGES_LIMIT bounds it if Resets are rare.
        db.execute("PRAGMA page_size=65536")  # takes effect when the file is created
        db.execute("PRAGMA journal_mode=WAL")
        db.execute(f"PRAGMA wal_autocheckpoint={WAL_PAGES_LIMIT}")
        db.execute(f"PRAGMA synchronous={FSYNC_POLICIES[fsync]}")
        db.execute("CREATE TABLE IF NOT EXISTS events (id INTEGER PRIMARY KEY, body BLOB NOT NULL)")
        db.execute("CREATE TABLE IF NOT EXISTS snapshot (id INTEGER PRIMARY KEY CHECK (id = 1), body BLOB NOT NULL)")
        return db

    def _take_lock(self):
        path = self.directory / "LOCK"
        handle = open(path, "a+")
        try:
            fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.seek(0)
            holder = handle.read().strip() or "unknown"
            handle.close()
            raise StateDirLockedError(
                f"state directory {self.directory} is in use by another coda-server (pid {holder}); "
                f"each server needs its own server.state_dir") from None
        handle.seek(0)
        handle.truncate()
        handle.write(str(os.getpid()))
        handle.flush()
        return handle

    # ------------------------------------------------------------------ reading

    def load(self) -> tuple[Optional[dict], list[JournalEvent]]:
        """(snapshot or None, events after it, in order)."""
        row = self._db.execute("SELECT body FROM snapshot WHERE id = 1").fetchone()
        snapshot = loads(row[0], self.codec) if row else None
        events = [loads(body, self.codec) for (body,) in self._db.execute("SELECT body FROM events ORDER BY id")]
        return snapshot, events

    # ------------------------------------------------------------------ writing

    def append(self, event: JournalEvent) -> int:
        return self._enqueue("event", event)

    def snapshot(self, state: dict) -> int:
        return self._enqueue("snapshot", state)

    def _enqueue(self, kind: str, value: Any) -> int:
        with self._cond:
            # After a failure nothing more is written: the ticket is never committed, and whoever waits
            # for it learns of the failure (the change is not acknowledged, as if the server had crashed).
            self._queued += 1
            self._queue.append((self._queued, kind, value))
            self._cond.notify_all()
            return self._queued

    @property
    def last_ticket(self) -> int:
        return self._queued

    def wait(self, ticket: int, timeout: Optional[float] = None) -> None:
        """Block until `ticket` (and everything before it) is committed."""
        with self._cond:
            if not self._cond.wait_for(lambda: self._durable >= ticket or self._error is not None, timeout):
                raise TimeoutError(f"journal write {ticket} not committed within {timeout}s")
            if self._error is not None:
                raise RuntimeError(f"the journal failed: {self._error}") from self._error

    def on_durable(self, ticket: int, callback: Callable[[], None]) -> None:
        """Run `callback()` (on the writer thread, or now) once `ticket` is committed or the journal failed."""
        with self._cond:
            if self._durable >= ticket or self._error is not None:
                ready = True
            else:
                self._callbacks.append((ticket, callback))
                ready = False
        if ready:
            callback()

    @property
    def error(self) -> Optional[BaseException]:
        return self._error

    def _write_loop(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._queue or self._closing)
                if not self._queue and self._closing:
                    return
                batch = list(self._queue)
                self._queue.clear()
            try:
                self._commit(batch)
            except BaseException as exc:  # the disk failed: every waiter learns it, nothing more is written
                log.error("journal write failed; the server can no longer acknowledge changes: %s", exc)
                with self._cond:
                    self._error = exc
                    callbacks, self._callbacks = self._callbacks, []
                    self._cond.notify_all()
                for _, callback in callbacks:
                    callback()
                return
            with self._cond:
                self._durable = batch[-1][0]
                ready = [cb for ticket, cb in self._callbacks if ticket <= self._durable]
                self._callbacks = [(t, cb) for t, cb in self._callbacks if t > self._durable]
                self._cond.notify_all()
            for callback in ready:
                callback()

    def _commit(self, batch: list[tuple[int, str, Any]]) -> None:
        # Encode outside the transaction; one transaction for the whole batch (group commit).
        encoded = [(kind, dumps(value, self.codec)) for _, kind, value in batch]
        db = self._db
        db.execute("BEGIN")
        try:
            for kind, body in encoded:
                if kind == "snapshot":
                    db.execute("DELETE FROM events")
                    db.execute("INSERT OR REPLACE INTO snapshot (id, body) VALUES (1, ?)", (body,))
                else:
                    db.execute("INSERT INTO events (body) VALUES (?)", (body,))
            db.execute("COMMIT")
        except BaseException:
            db.execute("ROLLBACK")
            raise
        if any(kind == "snapshot" for kind, _ in encoded):
            db.execute("PRAGMA wal_checkpoint(TRUNCATE)")

    def close(self) -> None:
        """Write what is queued, then release the database and the directory lock."""
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        self._writer.join()
        self._db.close()
        self._lock_file.close()
