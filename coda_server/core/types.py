"""Value types the pacing core passes around: trajectory status, trajectories, groups and results."""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, ClassVar, Mapping, Optional


class TrajectoryStatus(enum.IntEnum):
    """How a trajectory ended; values equal the wire enum's numbers (0 is refused)."""

    UNSPECIFIED = 0
    COMPLETED = 1
    FAILED = 2
    ABORTED = 3

    @classmethod
    def _missing_(cls, value: object) -> "TrajectoryStatus":
        """LoongSage's values ("completed", "failed", "aborted") and member names, any case, name a status too."""
        if isinstance(value, str):
            member = cls.__members__.get(value.strip().upper())
            if member is not None and member is not cls.UNSPECIFIED:
                return member
            if value.strip().lower() in ("pending", "generating"):
                raise ValueError(f"trajectory status {value!r} is not a final status: the pacer takes "
                                 f"completed, failed or aborted trajectories")
        return None  # type: ignore[return-value]  # Enum then raises its usual ValueError

    # LoongSage's TrajectoryStatus is a str enum, so a strategy or filter written for it may test
    # `t.status == "aborted"`: that holds here too (the lower-case name, as LoongSage's value), and `!=` agrees.
    # Hashing stays the integer's, so a set or dict of strings does not find a status; compare with == or `in` a
    # tuple or list.
    def __eq__(self, other: object) -> bool:
        if other.__class__ is str:
            return other == self._name_.lower()
        return int.__eq__(self, other)

    def __ne__(self, other: object) -> bool:
        equal = self.__eq__(other)
        return equal if equal is NotImplemented else not equal

    __hash__ = int.__hash__


class ResetMode(enum.IntEnum):
    """What workers are asked to do with running requests when a Reset pauses dispatch."""

    UNSPECIFIED = 0  # the server's default, from rollout.partial
    ABORT = 1  # abort requests and submit what they have as ABORTED (partial rollout)
    WAIT = 2  # let running requests finish


@dataclass
class PromptRef:
    """A prompt group a generation worker proposes to start.

    A plain record, not frozen: one is built per Dispatch candidate, and a frozen dataclass takes three
    times as long to build. Treat it as a value all the same: once handed to the pacer, do not change it.
    """

    prompt_id: str
    ds_index: int = 0
    epoch: Optional[int] = None
    index: Optional[int] = None


@dataclass
class Trajectory:
    """One generated trajectory as the pacer sees it.

    The routing fields are what pacing needs; `body` is everything else (token ids, logprobs,
    payload ...), opaque to the core and handed back to the trainer as it came. `size_bytes` feeds
    the byte cap. Duplicate detection compares `content_key()`s: a body that offers `fingerprint()`
    (a hashable digest of its content, e.g. coda_server.wire.EncodedTrajectory) is represented by it, so
    the pacer can forget the body once the trajectory has left (and `fingerprinted()`, if it offers it, says
    whether that digest is computed yet); any other body is compared with ==.
    `metadata` (the worker's string map) and `num_tokens` (length of its token ids) are there for
    strategies and filters to read; so are LoongSage's names `start_rollout_weight_version` /
    `end_rollout_weight_version`.
    """

    trajectory_id: str
    prompt_id: str
    ds_index: int = 0
    status: TrajectoryStatus = TrajectoryStatus.COMPLETED
    reward: float = 0.0
    start_weight_version: int = 0
    end_weight_version: int = 0
    num_turns: int = 0
    body: Any = None
    size_bytes: int = 0
    metadata: Mapping[str, str] = field(default_factory=dict)
    num_tokens: int = 0

    @property
    def start_rollout_weight_version(self) -> int:
        """LoongSage's name for `start_weight_version`."""
        return self.start_weight_version

    @property
    def end_rollout_weight_version(self) -> int:
        """LoongSage's name for `end_weight_version`."""
        return self.end_weight_version

    def same_content(self, other: "Trajectory | tuple") -> bool:
        """True when `other` (a trajectory, or the content_key() kept of one) is a harmless re-send of this one."""
        return self.content_key() == (other if isinstance(other, tuple) else other.content_key())

    # The content key once built (prepare_content_key): a class default, so it is no field of the dataclass.
    _content_key: ClassVar[Optional[tuple]] = None

    def content_key_ready(self) -> bool:
        """Whether `content_key()` costs nothing now: False for a body whose `fingerprinted()` says its digest is
        not computed yet (AsyncPacer computes them as a Submit arrives, or in a thread of its own)."""
        if self._content_key is not None:
            return True
        fingerprinted = getattr(self.body, "fingerprinted", None)
        return not callable(fingerprinted) or fingerprinted()

    def content_key_if_ready(self) -> Optional[tuple]:
        """`content_key()` when it costs nothing now (`content_key_ready`), else None."""
        key = self._content_key
        if key is None and self.content_key_ready():
            key = self._build_content_key()
        return key

    def prepare_content_key(self) -> None:
        """Build the content key now, digest included, and keep it: AsyncPacer makes them as a Submit arrives (or in
        its keys thread), so the trajectory's leaving, on the event loop, only reads it. A trajectory is a value once
        handed to the pacer, so the key stays true."""
        self._content_key = self._build_content_key()

    def content_key(self) -> tuple:
        """Everything a re-send must repeat to be a duplicate, without the body where it has a fingerprint:
        what the pacer keeps of an accepted trajectory once the trainer has it. A fingerprint covers the
        metadata and the arrays; without one they are compared as they are."""
        key = self._content_key
        return key if key is not None else self._build_content_key()

    def _build_content_key(self) -> tuple:
        fingerprint = getattr(self.body, "fingerprint", None)
        content = (fingerprint() if callable(fingerprint)
                   else (self.body, self.num_tokens, tuple(sorted(self.metadata.items())) if self.metadata else ()))
        return (self.trajectory_id, self.prompt_id, self.ds_index, int(self.status),
                "nan" if self.reward != self.reward else self.reward, self.start_weight_version,
                self.end_weight_version, self.num_turns, content)


@dataclass
class TrajectoryGroup:
    """A prompt's complete set of trajectories, as the trainer (or a restoring Reset) receives it.

    Built as LoongSage builds one too: `TrajectoryGroup(prompt_id="p0", trajectories=[...])`.
    """

    prompt_id: str
    seq: int = 0
    ds_index: int = 0
    trajectories: list[Trajectory] = field(default_factory=list)
    epoch: Optional[int] = None
    index: Optional[int] = None
    dispatched_at: float = 0.0


@dataclass
class Admitted:
    """A candidate the pacer admitted, with the dispatch sequence number it was given."""

    prompt_id: str
    seq: int


@dataclass
class DispatchResult:
    """What a Dispatch did and the window after it.

    Admitted groups get consecutive seqs, so they are kept as their prompt ids in admission order plus the
    first one's seq, with no object per group; `admitted` lists them as `Admitted` records.
    """

    admitted_ids: list[str]
    first_seq: int  # the seq of admitted_ids[0]; when nothing was admitted, the seq the next group will get
    paused: bool
    step: int
    weight_version: int
    generation: int
    running: int
    buffered: int
    capacity: int  # C = int(B * (1 + stale_steps))
    remaining: int  # what a Dispatch would admit now, after this one
    # Restored groups re-offered for continuation, admitted before the candidates (seqs from the call's first).
    continued: list[TrajectoryGroup] = field(default_factory=list)
    job_ended: bool = False  # EndJob closed dispatch for good

    @property
    def admitted(self) -> list[Admitted]:
        """The admitted groups with their seqs (a new list on every access)."""
        return [Admitted(prompt_id, seq) for seq, prompt_id in enumerate(self.admitted_ids, self.first_seq)]

    @property
    def seqs(self) -> list[int]:
        """The seq of each admitted id, in order (the client's DispatchResult.seqs)."""
        return list(range(self.first_seq, self.first_seq + len(self.admitted_ids)))

    @property
    def continuations(self) -> list[TrajectoryGroup]:
        """The client's name for `continued` (DispatchResponse.continuations)."""
        return self.continued


@dataclass
class SubmitResult:
    accepted: int
    duplicates: int
    groups_completed: int


def groups_bytes(groups: list[TrajectoryGroup]) -> int:
    """The trajectories' sizes (`size_bytes`) summed over these groups."""
    return sum([t.size_bytes for group in groups for t in group.trajectories])


@dataclass
class CollectResult:
    groups: list[TrajectoryGroup]
    timed_out: bool
    lease_id: str = ""  # set when the groups are leased: Ack it, or they are delivered again
    cut_to_fit: bool = False  # fewer than asked: more would not fit the caller's message limit (still buffered)
    # A rank's Collect that took a new global mini-batch while shares of mini-batches of another shape waited for
    # their ranks: those shapes' keys (world_size, num_groups, token_budget). Ranks that disagree, or a trainer
    # restarted with another shape; AsyncPacer logs it.
    other_shapes_waiting: tuple = ()

    def trajectory_bytes(self) -> int:
        """Bytes of the trajectories this answer carries (what remembering it keeps in memory)."""
        return groups_bytes(self.groups)


@dataclass
class StepReport:
    """The seed framework's step-boundary metrics, over the groups the trainer took this step."""

    step: int = 0
    pipeline_buf_size: int = 0
    filter_drop: int = 0
    partial_ratio: float = 0.0
    partial_span_max: int = 0
    partial_restored_count: int = 0  # trajectories, as LoongSage counts them (divide by N for groups)
    partial_dropped_incomplete_count: int = 0  # trajectories
    pause_delay: float = 0.0
    partial_restored_group_count: int = 0
    partial_dropped_incomplete_group_count: int = 0


@dataclass
class ResetResult:
    restored: list[TrajectoryGroup]
    dropped_prompt_ids: list[str]
    pause_delay_seconds: float
    generation: int
    step: int
    weight_version: int
    paused: bool
    report: StepReport = field(default_factory=StepReport)
    # Partial groups whose in-flight lease ran out this generation, set aside for their data source.
    expired: list[TrajectoryGroup] = field(default_factory=list)
    # Complete groups quarantined this generation (a hook raised on them, or dirty data), never buffered.
    quarantined: list[TrajectoryGroup] = field(default_factory=list)
    # Groups kept for continuation (rollout.continue_restored): those released this step (a silent worker's) that
    # still wait, then those this Reset restored; `restored` is empty then.
    kept_prompt_ids: list[str] = field(default_factory=list)
    # True: the groups to return did not all fit the caller's message limit; the rest stayed on the server (kept
    # for continuation, or quarantined until the next Reset).
    cut_to_fit: bool = False

    def trajectory_bytes(self) -> int:
        """Bytes of the trajectories this answer carries (what remembering it keeps in memory)."""
        return groups_bytes(self.restored) + groups_bytes(self.expired) + groups_bytes(self.quarantined)


@dataclass
class RestoreResult:
    """What a Restore did: the checkpoint's step and weight version, and what it discarded and put back."""

    step: int
    weight_version: int
    generation: int  # the new generation: anything dispatched before the Restore is refused as stale
    discarded_groups: int  # groups the server held (buffered, leased, kept, set aside, running), now gone
    discarded_trajectories: int  # their trajectories
    discarded_newer_trajectories: int  # of those, generated (in part) under a weight version newer than step's
    dropped_running: int  # of the discarded groups, those still running
    reinstated_groups: int  # the checkpoint's buffered (and leased) groups, back in the buffer
    kept_groups: int  # the checkpoint's groups kept for continuation, kept again
    reoffered_prompts: int  # prompts in flight at the checkpoint or admitted since: offered again
    checkpoint_taken_at: float = 0.0  # when the checkpoint was taken (seconds since the epoch)
    discarded_prompt_ids: list[str] = field(default_factory=list)  # of the discarded groups, running ones included


@dataclass
class KeepAliveResult:
    renewed: int
    unknown_prompt_ids: list[str]
    lease_seconds: float
    liveness_seconds: float = 0.0
    ended_lease_ids: list[str] = field(default_factory=list)  # of the Collect leases named, those not live any more


@dataclass
class ResumeResult:
    step: int
    weight_version: int


class ControlEventType(enum.IntEnum):
    """Kinds of control events pushed to subscribed workers; values equal the wire enum's."""

    UNSPECIFIED = 0
    STATE = 1
    PAUSE = 2
    RESUME = 3
    SHUTDOWN = 4
    JOB_ENDED = 5


@dataclass(frozen=True)
class ControlEvent:
    type: ControlEventType
    mode: ResetMode = ResetMode.UNSPECIFIED
    weight_version: int = 0
    step: int = 0
    generation: int = 0
    paused: bool = False
    restores: int = 0  # Restores made so far: a worker seeing it grow drops what it holds, re-reads the cursor
    job_ended: bool = False


@dataclass
class JobEndReport:
    """What EndJob left (see EndJobResponse): every group not accounted for by the totals, by where it is."""

    mode: ResetMode
    waited_seconds: float
    buffered_prompt_ids: list[str]
    leased: int
    held_prompt_ids: list[str]
    in_flight_prompt_ids: list[str]
    kept_prompt_ids: list[str]
    expired_prompt_ids: list[str]
    quarantined_prompt_ids: list[str]
    state: Any = None  # the PacerState at the end


@dataclass(frozen=True)
class HeldGroup:
    """A running group as the in-flight records hold it: who dispatched it, since when, how far it got."""

    prompt_id: str
    seq: int
    ds_index: int
    client_id: str  # "" when the Dispatch carried no client id
    held_seconds: float  # since Dispatch admitted it
    trajectories: int  # received so far
    group_size: int
    lease_remaining_seconds: float  # until its in-flight lease runs out; inf with leases off


@dataclass(frozen=True)
class Incident:
    """Something that went wrong with a group outside a caller's request (GetState, the next Collect)."""

    kind: str  # "hook_failed" or "dirty_group"
    prompt_id: str
    strategy: str  # the strategy or filter name
    hook: str  # the hook that raised; "" for a dirty group
    message: str
    step: int = 0
    generation: int = 0
    action: str = "quarantined"  # or "refused": the call failed and changed nothing
