"""The durability contract: the `Journal` protocol, the journal's event records, and the trajectory codec.

A journal keeps what the Pacer needs to rebuild its state after a restart: a snapshot (the dict of
`Pacer.export_state()`, taken at each Reset, when nothing is in flight) and the events recorded since it,
each one change the Pacer acknowledged. Recovery imports the snapshot and replays the events in order
(`recovery.py`). A backend implements `Journal`; `sqlite_journal.SqliteJournal` is the one shipped.
"""
from __future__ import annotations

import copyreg
import enum
import io
import pickle
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, Callable, Iterator, Optional, Protocol

from .types import PromptRef, ResetMode, Trajectory, TrajectoryStatus

# synchronous= levels. WAL mode writes every commit to the OS before returning, so each of these
# survives kill -9 of the server; they differ in what survives a machine crash or power loss.
FSYNC_POLICIES = {
    "off": "OFF",  # no fsync: a machine crash may lose recent commits or corrupt the database
    "normal": "NORMAL",  # fsync at WAL checkpoints: a machine crash may lose the last commits, never corrupts
    "full": "FULL",  # fsync every commit: nothing acknowledged is lost even on power loss
}


class StateDirError(RuntimeError):
    """The state directory cannot be used (not creatable, not writable, not a directory, or held)."""


class StateDirLockedError(StateDirError):
    """Another server holds the state directory."""


# ------------------------------------------------------------------ events


@dataclass(slots=True)
class JournalEvent:
    """One change the Pacer acknowledged; `at` is the pacer clock when it was made (replay runs at that time)."""

    at: float

    def __reduce__(self) -> tuple:  # pickled as (class, field values): compact, and read back without a dict
        return type(self), tuple(getattr(self, name) for name in self.__match_args__)


@dataclass(slots=True)
class Dispatched(JournalEvent):
    refs: list[PromptRef]  # the candidates admitted, in order (replay admits exactly these)
    request_id: str
    client_id: str = ""  # who dispatched them (records written before client ids have none)
    continued: list[str] = ()  # prompt ids of kept restored groups re-offered first (journals before: none)
    watched: bool = False  # the client was a watched worker (liveness): after a restart its grace restarts


@dataclass(slots=True)
class Submitted(JournalEvent):
    trajectories: list[Trajectory]  # the whole batch as sent, duplicates included
    request_id: str


@dataclass(slots=True)
class StaleRejected(JournalEvent):
    count: int  # a refused Submit still counts its stale trajectories


@dataclass(slots=True)
class Collected(JournalEvent):
    count: int
    timed_out: bool
    request_id: str
    lease_seconds: float  # > 0: the groups went out under a Collect lease
    # The Collect's shape (shares.py); the defaults are a plain Collect (and events recorded before shapes).
    token_budget: int = 0
    rank: int = 0
    world_size: int = 1
    num_groups: int = 0
    # A new data-parallel mini-batch: each taken group's rank, in the order taken. Replay hands the shares out as
    # they were, whatever rule splits them now (events recorded before splits were: split again, by today's rule).
    split: tuple[int, ...] = ()
    # The client whose silence also ends the lease (a trainer that heartbeats); "" for none (and events before).
    holder: str = ""
    # The ranks' run (BatchShape.run): a new mini-batch's cut makes it its shape's; "" for none (and events before).
    run: str = ""


@dataclass(slots=True)
class Acked(JournalEvent):
    lease_id: str
    request_id: str


@dataclass(slots=True)
class Expired(JournalEvent):
    prompt_ids: list[str]  # running groups whose in-flight lease ran out
    lease_ids: list[str]  # Collect leases that ran out without Ack
    # Why the leases ended, as an Ack of one is told ("": not said, in records written before it was journaled).
    why: str = ""
    # The trainer whose silence ended them ("": another cause): replay keeps them for it to claim back.
    holder: str = ""


@dataclass(slots=True)
class Reclaimed(JournalEvent):
    holder: str  # a trainer heard again after its silence lapsed these leases of its
    leases: list[tuple[str, float, tuple]]  # (lease id, seconds, its groups' buffer priorities), given back to it


@dataclass(slots=True)
class ResetBegun(JournalEvent):
    mode: ResetMode
    resume: bool
    weight_version: Optional[int]


@dataclass(slots=True)
class ResetFinished(JournalEvent):
    ready_at: Optional[float]  # when every running group was assembled (for the step report's pause delay)
    resume: bool
    weight_version: Optional[int]
    request_id: str
    # The caller's answer limit, which decides what its answer carries (0: the server's; records before it: 0).
    max_response_bytes: int = 0


@dataclass(slots=True)
class ResetAbandoned(JournalEvent):
    pass


@dataclass(slots=True)
class Resumed(JournalEvent):
    weight_version: int
    request_id: str


@dataclass(slots=True)
class GatesRechecked(JournalEvent):
    pass  # the periodic re-examination of held groups released some (replay re-examines at the same time)


@dataclass(slots=True)
class JobEnded(JournalEvent):
    mode: ResetMode  # what the workers were told to do with the groups they held


EVENT_TYPES: tuple[type[JournalEvent], ...] = (
    Dispatched, Submitted, StaleRejected, Collected, Acked, Expired, ResetBegun, ResetFinished, ResetAbandoned,
    Resumed, GatesRechecked, JobEnded, Reclaimed)
# Journals written before the records were named held positional tuples, first the kind: read them still.
_LEGACY_KINDS = {"dispatch": Dispatched, "submit": Submitted, "stale": StaleRejected, "collect": Collected,
                 "ack": Acked, "expire": Expired, "begin_reset": ResetBegun, "finish_reset": ResetFinished,
                 "abandon_reset": ResetAbandoned, "resume": Resumed}


def as_event(recorded: Any) -> JournalEvent:
    """The event record of what a journal holds: a record as it is, or an older journal's positional tuple."""
    if isinstance(recorded, JournalEvent):
        return recorded
    if isinstance(recorded, tuple) and recorded and recorded[0] in _LEGACY_KINDS:
        return _LEGACY_KINDS[recorded[0]](*recorded[1:])
    raise ValueError(f"unknown journal event {recorded!r:.80}")


# ------------------------------------------------------------------ the contract


class Journal(Protocol):
    """What the Pacer needs from a durability backend. Tickets are increasing integers, one per write."""

    directory: Path  # where the state lives, for messages

    def load(self, on_read: Optional[Callable[[int], None]] = None) -> tuple[Optional[dict], list[JournalEvent]]:
        """The latest snapshot (None if there is none) and the events appended after it, in order; `on_read(n)` once
        n events are read. A backend may also offer `event_count()` (how many events follow the snapshot, or None)
        and `interrupt()`: recovery's first line and its stop use them when there."""

    def append(self, event: JournalEvent) -> int:
        """Queue `event` for writing after everything queued before it; returns its ticket. Must not block on I/O."""

    def snapshot(self, state: dict) -> int:
        """Queue a snapshot that replaces every event queued before it; returns its ticket."""

    def on_durable(self, ticket: int, callback: Callable[[], None]) -> None:
        """Call `callback()` (from any thread, or now) once `ticket` and all before it are durable, or on failure."""

    def wait(self, ticket: int, timeout: Optional[float] = None) -> None:
        """Block until `ticket` is durable; raises on failure or timeout."""

    def committed(self, ticket: int) -> bool:
        """Whether `ticket` and all before it are durable."""

    @property
    def error(self) -> Optional[BaseException]:
        """Why writing fails now (the write is retried until it works; then None again), or None."""

    def close(self) -> None:
        """Write what is queued, then release the storage."""


class TrajectoryCodec(Protocol):
    """Writes whole trajectories in the transport's own encoding (the server: the protobuf message,
    which carries every routing field too), far cheaper than pickling them field by field."""

    def encode(self, trajectory: Trajectory) -> Optional[bytes]:
        """The trajectory's bytes, or None to pickle it as it is."""

    def decode(self, data: bytes) -> Trajectory: ...


class PickledTrajectories:
    """In-process embedding: trajectories (and bodies: None, bytes, plain containers) are pickled as they are."""

    def encode(self, trajectory: Trajectory) -> Optional[bytes]:
        return None

    def decode(self, data: bytes) -> Trajectory:
        raise TypeError("pickled trajectories carry no encoded form")


# ------------------------------------------------------------------ encoding (for backends that store bytes)

# Classes a journal may contain; anything else is refused on load (the file is data, not code).
ALLOWED_CLASSES = {
    ("coda_server.core.types", name)
    for name in ("Trajectory", "TrajectoryGroup", "TrajectoryStatus", "ResetMode", "PromptRef", "Admitted",
                 "DispatchResult", "SubmitResult", "CollectResult", "ResetResult", "ResumeResult", "StepReport",
                 "Incident", "RestoreResult", "JobEndReport")
} | {("coda_server.core.state", "PacerState")} | {(__name__, event_type.__name__) for event_type in EVENT_TYPES} | {
    ("builtins", name) for name in ("set", "frozenset", "tuple", "list", "dict")} | {
    ("collections", "OrderedDict"), ("collections", "deque")}


# The enums a journal holds, pickled by value on every Python: 3.11.0-3.11.3 pickle an enum member as
# getattr(class, name), which a restricted unpickler cannot allow, so such a journal could not be read back.
JOURNAL_ENUMS = (TrajectoryStatus, ResetMode)


def _enum_by_value(member: enum.Enum) -> tuple:
    return type(member), (member.value,)


def _enum_member_by_name(enum_class: Any, name: Any) -> enum.Enum:
    """Reads an enum member pickled by name (journals written by Python 3.11.0-3.11.3): only a journal enum's."""
    if enum_class not in JOURNAL_ENUMS or not isinstance(name, str) or name not in enum_class.__members__:
        raise pickle.UnpicklingError(f"the journal names {name!r} of {enum_class!r}, which it may not contain")
    return enum_class[name]


def dumps(value: Any, codec: TrajectoryCodec, prefix: bytes = b"") -> bytes:
    """`value` pickled, trajectories as the codec's bytes, written after `prefix` (no second copy to prepend it)."""
    buffer = io.BytesIO()
    buffer.write(prefix)
    _TrajectoryPickler(buffer, codec).dump(value)
    return buffer.getvalue()


def loads(data: bytes, codec: TrajectoryCodec) -> Any:
    return _RestrictedUnpickler(io.BytesIO(data), codec).load()


# persistent_id and persistent_load are methods of these subclasses, not attributes set on a pickler: from Python
# 3.13 on, the C pickler's are read-only on an instance.
class _TrajectoryPickler(pickle.Pickler):
    """Pickles each trajectory as its codec's bytes (a persistent id), enums by value, the rest as pickle does."""

    dispatch_table = {**copyreg.dispatch_table, **{enum_class: _enum_by_value for enum_class in JOURNAL_ENUMS}}

    def __init__(self, file: IO[bytes], codec: TrajectoryCodec):
        super().__init__(file, protocol=5)
        self._encode = codec.encode

    def persistent_id(self, obj: Any) -> Optional[bytes]:
        return self._encode(obj) if type(obj) is Trajectory else None


class _RestrictedUnpickler(pickle.Unpickler):
    """Loads only ALLOWED_CLASSES (the file is data, not code); trajectories come back through the codec."""

    def __init__(self, file: IO[bytes], codec: TrajectoryCodec):
        super().__init__(file)
        self._decode = codec.decode

    def persistent_load(self, pid: Any) -> Trajectory:
        return self._decode(pid)

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == ("builtins", "getattr"):  # an enum member by name (Python 3.11.0-3.11.3)
            return _enum_member_by_name
        if (module, name) not in ALLOWED_CLASSES:
            raise pickle.UnpicklingError(f"the journal refers to {module}.{name}, which it may not contain")
        return super().find_class(module, name)


class Recorder:
    """Records each acknowledged change in the journal (None: state in memory only) and keeps the ticket of the
    latest one, which a caller waits on to be durable. `suspended()` stops recording while a journal is replayed."""

    __slots__ = ("journal", "last_ticket", "_active")

    def __init__(self, journal: Optional[Journal]):
        self.journal = journal
        self.last_ticket = 0
        self._active = journal  # None while suspended or without a journal

    @property
    def recording(self) -> bool:
        """True when changes are written now (a journal, not replaying it)."""
        return self._active is not None

    @property
    def replaying(self) -> bool:
        """True while a journal is replayed (`suspended()`): what the live call said once, it does not say again."""
        return self.journal is not None and self._active is None

    def record(self, event: JournalEvent) -> None:
        if self._active is not None:
            self.last_ticket = self._active.append(event)

    def snapshot(self, state: dict) -> None:
        """Replace everything recorded so far with `state` (when recording)."""
        if self._active is not None:
            self.last_ticket = self._active.snapshot(state)

    @contextmanager
    def suspended(self) -> Iterator[None]:
        """Within the block nothing is recorded (replay re-runs changes the journal already holds)."""
        active, self._active = self._active, None
        try:
            yield
        finally:
            self._active = active
