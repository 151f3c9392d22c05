"""The SQLite journal: an append-only WAL log of the Pacer's events with a snapshot at each Reset, and the state-dir lock."""
from __future__ import annotations

import fcntl
import logging
import os
import shutil
import sqlite3
import threading
import time
from collections import deque
from pathlib import Path
from typing import Any, Callable, Optional

from .errors import RecoveryError
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
# After a failed write (a full disk, ...) the same batch is written again this often, until it succeeds.
WRITE_RETRY_SECONDS = 1.0
# What every failed write's message says happens meanwhile, whatever the cause.
_REFUSED_MEANWHILE = (f"changes are refused with UNAVAILABLE (reason STATE_DIR_UNWRITABLE) and the write is retried "
                      f"every {WRITE_RETRY_SECONDS:g} s")
# Free space below which a failed write is put down to a full disk.
LOW_SPACE_BYTES = 64 << 20
# SQLite's words for a file that is no database, or a damaged one: no permission or free space would help.
_DAMAGED_SIGNS = ("file is not a database", "malformed", "file is encrypted")


class JournalReadError(RecoveryError):
    """A record of the journal (or the file itself) cannot be read back; the message says which."""


class LoadInterrupted(Exception):
    """`SqliteJournal.interrupt()` stopped `load()` before it read every record."""


def _open_advice(directory: Path, exc: BaseException) -> str:
    """What to do about a state directory that could not be opened: make room when its file system is full (the
    cause, or too little free space and no sign of another), else give a directory this user can write."""
    text = str(exc).lower()
    if any(sign in text for sign in _DAMAGED_SIGNS):
        return (f"{directory / 'pacer.sqlite3'} is not a readable coda-server journal (damaged, or another file); the "
                f"state directory was not modified: move server.state_dir aside to start afresh (that loses its "
                f"running and buffered groups)")
    free = _free_bytes(directory)
    full = (any(sign in text for sign in ("disk is full", "no space left", "disk quota exceeded"))
            or (free is not None and free < LOW_SPACE_BYTES
                and not any(sign in text for sign in ("permission denied", "read-only", "not a directory"))))
    if not full:
        return "it must be a directory (or a path where one can be made) that this user can write"
    left = f"{free / 2**20:.1f} MiB free" if free is not None else "no space left"
    return (f"its file system is full ({left}): free space on it, or set server.state_dir to a directory on a file "
            f"system with room")


def _free_bytes(path: Path) -> Optional[int]:
    """Free bytes of the file system `path` is (or would be created) on; None when that cannot be told."""
    for candidate in (path, *path.parents):
        if candidate.exists():
            try:
                return shutil.disk_usage(candidate).free
            except OSError:
                return None
    return None


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
            raise StateDirError(f"server.state_dir {str(self.directory)!r} cannot be used: {exc}; "
                                f"{_open_advice(self.directory, exc)}") from None
        self._queue: deque[tuple[int, str, Any]] = deque()
        self._cond = threading.Condition()
        self._queued = 0  # tickets handed out
        self._durable = 0  # tickets committed
        self._error: Optional[BaseException] = None
        self._callbacks: list[tuple[int, Callable[[], None]]] = []
        self._closing = False
        self._interrupted = threading.Event()  # set by interrupt(): load() stops at its next record
        self.failing_since: Optional[float] = None  # monotonic time of the first failed write of this spell
        # Called on the writer thread with the error when writes start failing, and with None when they work again.
        self.on_health: Optional[Callable[[Optional[BaseException]], None]] = None
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

    def load(self, on_read: Optional[Callable[[int], None]] = None) -> tuple[Optional[dict], list[JournalEvent]]:
        """(snapshot or None, events after it, in order); `on_read(n)` after each event read (recovery's progress
        lines). JournalReadError names a record that cannot be read back; LoadInterrupted after `interrupt()`.
        Reading changes nothing in the directory."""
        try:
            row = self._db.execute("SELECT body FROM snapshot WHERE id = 1").fetchone()
            snapshot = self._decode(row[0], 0) if row else None
            events = []
            for number, (body,) in enumerate(self._db.execute("SELECT body FROM events ORDER BY id"), 1):
                if self._interrupted.is_set():
                    raise LoadInterrupted(f"stopped after reading {number - 1} events")
                events.append(self._decode(body, number))
                if on_read is not None:
                    on_read(number)
        except sqlite3.Error as exc:  # a damaged file: SQLite says so only when it reads the damaged page
            raise JournalReadError(f"the journal {self.directory / 'pacer.sqlite3'} could not be read "
                                   f"({getattr(exc, 'sqlite_errorname', type(exc).__name__)}: {exc})") from None
        return snapshot, events

    def _decode(self, body: bytes, number: int) -> Any:
        """Record `number` since the snapshot (0: the snapshot itself) read back."""
        try:
            return loads(body, self.codec)
        except Exception as exc:  # refused by the restricted unpickler, truncated, or a trajectory that does not decode
            problem = " ".join(str(exc).split()) or "(no message)"
            what = f"event {number} of {self._event_count()} since the last snapshot" if number else "the snapshot"
            raise JournalReadError(f"{what} in {self.directory / 'pacer.sqlite3'} could not be read back "
                                   f"({type(exc).__name__}: {problem})") from None

    def _event_count(self) -> str:
        """How many events follow the snapshot, for a message ("?" if unknown)."""
        count = self.event_count()
        return "?" if count is None else str(count)

    def event_count(self) -> Optional[int]:
        """How many events follow the snapshot, None if the table cannot be read (counted for messages and recovery's
        first line only: it reads the whole table, though not the records' bodies)."""
        try:
            return int(self._db.execute("SELECT count(*) FROM events").fetchone()[0])
        except sqlite3.Error:
            return None

    def interrupt(self) -> None:
        """From any thread: a `load()` in progress (or to come) stops at its next record with LoadInterrupted."""
        self._interrupted.set()

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

    def committed(self, ticket: int) -> bool:
        return self._durable >= ticket

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
            while True:
                try:
                    self._commit(batch)
                    break
                except BaseException as exc:  # noqa: BLE001 - the disk failed: said plainly, retried until it works
                    if not self._failed(exc):
                        return
            if self._error is not None:
                with self._cond:
                    self._error, self.failing_since = None, None
                log.warning("journal writes work again in %s: the server acknowledges changes again", self.directory)
                if self.on_health is not None:
                    self.on_health(None)
            with self._cond:
                self._durable = batch[-1][0]
                ready = [cb for ticket, cb in self._callbacks if ticket <= self._durable]
                self._callbacks = [(t, cb) for t, cb in self._callbacks if t > self._durable]
                self._cond.notify_all()
            for callback in ready:
                callback()

    def _failed(self, exc: BaseException) -> bool:
        """A write failed: every waiter learns it (the changes are not acknowledged), the cause is said once per
        spell; returns False when the journal is closing (the batch is given up), else after a pause."""
        error = JournalWriteError(describe_write_failure(self.directory, exc))
        first = self._error is None
        with self._cond:
            self._error = error
            if first:
                self.failing_since = time.monotonic()
            callbacks, self._callbacks = self._callbacks, []
            self._cond.notify_all()
        if first:
            log.error("%s", error)
            if self.on_health is not None:
                self.on_health(error)
        for _, callback in callbacks:
            callback()
        with self._cond:
            if self._closing:
                return False
            self._cond.wait(WRITE_RETRY_SECONDS)
            return not self._closing

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
            if db.in_transaction:  # a failed COMMIT already rolled back: a ROLLBACK would hide the cause
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


class JournalWriteError(OSError):
    """The journal could not write; its message says why, where, and what helps."""


def describe_write_failure(directory: Path, exc: BaseException) -> str:
    """A failed journal write in plain words: the file, the cause as far as it can be told (full disk, read-only
    or unwritable directory, I/O error, or a change that could not be encoded), the error's own words, and what
    helps."""
    name = getattr(exc, "sqlite_errorname", type(exc).__name__)
    if not isinstance(exc, (OSError, sqlite3.Error)):
        # Raised while the change was encoded, before anything reached the disk: freeing space would not help.
        return (f"writing the journal {directory / 'pacer.sqlite3'} failed before reaching the disk: encoding the "
                f"change raised {name}: {exc}. This is a fault in the server, not in the state directory (report it "
                f"with this message); {_REFUSED_MEANWHILE}")
    cause = "an I/O error"
    try:
        usage = shutil.disk_usage(directory)
        readonly = bool(os.statvfs(directory).f_flag & os.ST_RDONLY)
    except OSError as stat_error:
        cause = f"the directory cannot be read ({stat_error.strerror or stat_error})"
    else:
        if readonly:
            cause = "the file system is read-only"
        elif name == "SQLITE_FULL" or usage.free < LOW_SPACE_BYTES:
            cause = f"no space left on the device ({usage.free / 1e6:.0f} MB free of {usage.total / 1e6:.0f} MB)"
        elif not os.access(directory, os.W_OK):
            cause = "permission denied"
    return (f"writing the journal {directory / 'pacer.sqlite3'} failed: {cause} ({name}: {exc}); {_REFUSED_MEANWHILE}: "
            f"free space on that volume or make it writable (server.state_dir), and the server becomes ready again by "
            f"itself")
