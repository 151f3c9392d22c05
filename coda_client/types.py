"""Typed values of the pacer API and their conversion to and from the protobuf messages."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field, fields
from typing import Any, TypeVar

from ._proto import pacer_pb2

__all__ = [
    "TrajectoryStatus",
    "ResetMode",
    "ControlEventType",
    "PromptRef",
    "Trajectory",
    "TrajectoryGroup",
    "DispatchResult",
    "SubmitResult",
    "CollectResult",
    "ResetResult",
    "ResumeResult",
    "PacerState",
    "ControlEvent",
]

_E = TypeVar("_E", bound=enum.IntEnum)
_R = TypeVar("_R")


class TrajectoryStatus(enum.IntEnum):
    """How a trajectory ended; values equal the proto's TRAJECTORY_STATUS_* numbers (0 is refused)."""

    UNSPECIFIED = 0
    COMPLETED = 1
    FAILED = 2
    ABORTED = 3


class ResetMode(enum.IntEnum):
    """How Reset treats running generation; values equal the proto's RESET_MODE_* numbers."""

    UNSPECIFIED = 0  # the server's default, from its rollout.partial setting
    ABORT = 1
    WAIT = 2

    @classmethod
    def parse(cls, mode: ResetMode | str | int | None) -> ResetMode:
        """Accepts a ResetMode, its number, "abort"/"wait" (any case) or None (the server default)."""
        if mode is None:
            return cls.UNSPECIFIED
        if isinstance(mode, str):
            try:
                return cls[mode.strip().upper()]
            except KeyError:
                raise ValueError(f"unknown reset mode {mode!r}; expected 'abort', 'wait' or None") from None
        return cls(mode)


class ControlEventType(enum.IntEnum):
    """Kind of control event; values equal the proto's CONTROL_EVENT_TYPE_* numbers."""

    UNSPECIFIED = 0
    STATE = 1  # first event of every watch stream: the current state
    PAUSE = 2
    RESUME = 3
    SHUTDOWN = 4


def _enum(cls: type[_E], value: int) -> _E | int:
    """Proto3 enums are open: a number this client does not know yet is kept as a plain int."""
    try:
        return cls(value)
    except ValueError:
        return value


def _optional(msg: Any, name: str) -> int | None:
    """Reads a proto3 `optional` scalar: None when unset, so 0 stays distinct from absent."""
    return getattr(msg, name) if msg.HasField(name) else None


def _from_fields(cls: type[_R], msg: Any, **converted: Any) -> _R:
    """Builds a result dataclass from same-named message fields; `converted` supplies the non-scalar ones."""
    return cls(**{f.name: converted[f.name] if f.name in converted else getattr(msg, f.name) for f in fields(cls)})


@dataclass(frozen=True)
class PromptRef:
    """A prompt group proposed to Dispatch; epoch/index (when given) set its buffer priority."""

    prompt_id: str
    ds_index: int = 0
    epoch: int | None = None
    index: int | None = None

    @classmethod
    def of(cls, candidate: PromptRef | str) -> PromptRef:
        """A bare prompt id means data source 0 and no epoch/index."""
        if isinstance(candidate, PromptRef):
            return candidate
        if isinstance(candidate, str):
            return cls(candidate)
        raise TypeError(f"a Dispatch candidate is a prompt id (str) or a PromptRef, not {type(candidate).__name__}")

    def to_pb(self) -> pacer_pb2.PromptRef:
        """The wire message; unset epoch/index stay unset."""
        return pacer_pb2.PromptRef(prompt_id=self.prompt_id, ds_index=self.ds_index, epoch=self.epoch, index=self.index)

    @classmethod
    def from_pb(cls, msg: pacer_pb2.PromptRef) -> PromptRef:
        """From the wire message."""
        return cls(msg.prompt_id, msg.ds_index, _optional(msg, "epoch"), _optional(msg, "index"))


@dataclass(frozen=True, kw_only=True)
class Trajectory:
    """One generated response. Empty lists mean absent; logprobs travel as float32.

    `status` is required: the server refuses UNSPECIFIED, so a forgotten status fails loudly.
    Non-empty token_ids, logprobs and loss_mask must have equal lengths (the server checks).
    """

    trajectory_id: str
    prompt_id: str
    status: TrajectoryStatus | int
    ds_index: int = 0
    reward: float = 0.0
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    start_weight_version: int = 0
    end_weight_version: int = 0
    num_turns: int = 0
    metadata: dict[str, str] = field(default_factory=dict)
    payload: bytes = b""

    def to_pb(self) -> pacer_pb2.Trajectory:
        """The wire message."""
        return pacer_pb2.Trajectory(**{f.name: getattr(self, f.name) for f in fields(self)})

    @classmethod
    def from_pb(cls, msg: pacer_pb2.Trajectory) -> Trajectory:
        """From the wire message (repeated fields copied into plain lists, the map into a dict)."""
        return _from_fields(
            cls,
            msg,
            status=_enum(TrajectoryStatus, msg.status),
            token_ids=list(msg.token_ids),
            logprobs=list(msg.logprobs),
            loss_mask=list(msg.loss_mask),
            metadata=dict(msg.metadata),
        )


@dataclass(frozen=True)
class TrajectoryGroup:
    """A complete prompt group: what Collect serves and Reset restores."""

    prompt_id: str
    seq: int = 0
    ds_index: int = 0
    epoch: int | None = None
    index: int | None = None
    trajectories: list[Trajectory] = field(default_factory=list)

    def to_pb(self) -> pacer_pb2.TrajectoryGroup:
        """The wire message."""
        return pacer_pb2.TrajectoryGroup(
            prompt_id=self.prompt_id,
            seq=self.seq,
            ds_index=self.ds_index,
            epoch=self.epoch,
            index=self.index,
            trajectories=[t.to_pb() for t in self.trajectories],
        )

    @classmethod
    def from_pb(cls, msg: pacer_pb2.TrajectoryGroup) -> TrajectoryGroup:
        """From the wire message."""
        return _from_fields(
            cls,
            msg,
            epoch=_optional(msg, "epoch"),
            index=_optional(msg, "index"),
            trajectories=[Trajectory.from_pb(t) for t in msg.trajectories],
        )


def _groups(messages: Any) -> list[TrajectoryGroup]:
    """Converts a repeated TrajectoryGroup field."""
    return [TrajectoryGroup.from_pb(g) for g in messages]


@dataclass(frozen=True)
class DispatchResult:
    """Dispatch answer: admitted ids with their seqs (same order) and the window terms after admission."""

    admitted: list[str]
    seqs: list[int]
    paused: bool
    step: int
    weight_version: int
    generation: int
    running: int
    buffered: int
    capacity: int  # C = int(B * (1 + stale_steps))
    remaining: int  # what a Dispatch would admit now, after this one

    @classmethod
    def from_pb(cls, msg: pacer_pb2.DispatchResponse) -> DispatchResult:
        """From the wire message."""
        return _from_fields(
            cls, msg, admitted=[a.prompt_id for a in msg.admitted], seqs=[a.seq for a in msg.admitted]
        )


@dataclass(frozen=True)
class SubmitResult:
    """Submit answer: newly accepted trajectories, acknowledged duplicates, groups completed."""

    accepted: int
    duplicates: int
    groups_completed: int

    @classmethod
    def from_pb(cls, msg: pacer_pb2.SubmitResponse) -> SubmitResult:
        """From the wire message."""
        return _from_fields(cls, msg)


@dataclass(frozen=True)
class CollectResult:
    """Collect answer: the groups taken, and whether the wait ended before enough were ready."""

    groups: list[TrajectoryGroup]
    timed_out: bool
    lease_id: str = ""  # set for a leased Collect: Ack it, or the groups are delivered again

    @classmethod
    def from_pb(cls, msg: pacer_pb2.CollectResponse) -> CollectResult:
        """From the wire message."""
        return _from_fields(cls, msg, groups=_groups(msg.groups))


@dataclass(frozen=True)
class StepReport:
    """The seed framework's step-boundary metrics over the groups the trainer took in one step."""

    step: int
    pipeline_buf_size: int
    filter_drop: int
    partial_ratio: float
    partial_span_max: int
    partial_restored_count: int  # trajectories of the restored groups (LoongSage's unit)
    partial_dropped_incomplete_count: int  # trajectories of the dropped incomplete groups
    pause_delay: float
    partial_restored_group_count: int
    partial_dropped_incomplete_group_count: int

    @classmethod
    def from_pb(cls, msg: pacer_pb2.StepReport) -> StepReport:
        """From the wire message."""
        return _from_fields(cls, msg)


@dataclass(frozen=True)
class ResetResult:
    """Reset answer: restored groups, dropped incomplete prompt ids, and the state after the call."""

    restored: list[TrajectoryGroup]
    dropped_prompt_ids: list[str]
    pause_delay_seconds: float
    generation: int
    step: int
    weight_version: int
    paused: bool
    report: StepReport
    expired: list[TrajectoryGroup]  # partial groups whose in-flight lease ran out, for their data source
    quarantined: list[TrajectoryGroup]  # complete groups never buffered (a raising hook, dirty data)

    @classmethod
    def from_pb(cls, msg: pacer_pb2.ResetResponse) -> ResetResult:
        """From the wire message."""
        return _from_fields(cls, msg, restored=_groups(msg.restored), dropped_prompt_ids=list(msg.dropped_prompt_ids),
                            report=StepReport.from_pb(msg.report), expired=_groups(msg.expired),
                            quarantined=_groups(msg.quarantined))


@dataclass(frozen=True)
class ResumeResult:
    """Resume answer: the new step and the recorded weight version."""

    step: int
    weight_version: int

    @classmethod
    def from_pb(cls, msg: pacer_pb2.ResumeResponse) -> ResumeResult:
        """From the wire message."""
        return _from_fields(cls, msg)


@dataclass(frozen=True)
class PacerState:
    """GetState answer: every counter of the pacer, flat, as on the wire."""

    running: int
    buffered: int
    queued_trajectories: int
    capacity: int  # what a Dispatch would admit now; 0 while paused
    window_size: int  # C
    step: int
    weight_version: int
    generation: int
    paused: bool
    resetting: bool
    strategy: str
    dispatched: int
    submitted: int
    collected: int  # into the pipeline buffer
    consumed: int  # taken by the trainer
    filtered: int
    restored: int
    dropped: int
    stale_rejected: int
    duplicates: int
    config_summary: dict[str, str]
    waiting_calls: int  # long-polls waiting in the server now
    recent_reports: list[StepReport]  # oldest first
    expired: int  # running groups reclaimed because their in-flight lease ran out
    redelivered: int  # leased groups returned to the buffer because no Ack came in time
    leased: int  # groups under a Collect lease, not yet acknowledged
    held_bytes: int  # bytes of trajectories queued, buffered or leased
    quarantined: int  # complete groups never buffered (a raising hook, dirty data); see recent_incidents
    recent_incidents: list[Incident]  # oldest first

    @classmethod
    def from_pb(cls, msg: pacer_pb2.GetStateResponse) -> PacerState:
        """From the wire message."""
        return _from_fields(cls, msg, config_summary=dict(msg.config_summary),
                            recent_reports=[StepReport.from_pb(r) for r in msg.recent_reports],
                            recent_incidents=[Incident.from_pb(i) for i in msg.recent_incidents])


@dataclass(frozen=True)
class Incident:
    """A raising strategy hook or a refused dirty group, as GetState reports it."""

    kind: str  # "hook_failed" or "dirty_group"
    prompt_id: str
    strategy: str
    hook: str
    message: str
    step: int
    generation: int
    action: str  # "quarantined" or "refused"

    @classmethod
    def from_pb(cls, msg: pacer_pb2.Incident) -> Incident:
        """From the wire message."""
        return _from_fields(cls, msg)


@dataclass(frozen=True)
class ControlEvent:
    """One WatchControl event with the pacer state when it was sent; `mode` is set for PAUSE."""

    type: ControlEventType | int
    mode: ResetMode | int
    weight_version: int
    step: int
    generation: int
    paused: bool

    @classmethod
    def from_pb(cls, msg: pacer_pb2.ControlEvent) -> ControlEvent:
        """From the wire message."""
        return _from_fields(cls, msg, type=_enum(ControlEventType, msg.type), mode=_enum(ResetMode, msg.mode))
