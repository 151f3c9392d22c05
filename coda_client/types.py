"""Typed values of the pacer API and their conversion to and from the protobuf messages."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field, fields
from collections.abc import Sequence
from typing import Any, TypeVar

from . import arrays, wire_forms as _wire
from ._proto import pacer_pb2
from .protocol import LOONGSAGE_PROMPT_ID, describe_collect_shape

__all__ = [
    "TrajectoryStatus",
    "ResetMode",
    "ControlEventType",
    "PromptRef",
    "Trajectory",
    "TrajectoryGroup",
    "DispatchResult",
    "KeepAliveResult",
    "SubmitResult",
    "CollectResult",
    "ResetResult",
    "ResumeResult",
    "PacerState",
    "ControlEvent",
    "HeldGroup",
    "WorkerHoldings",
]

_E = TypeVar("_E", bound=enum.IntEnum)
_R = TypeVar("_R")


class TrajectoryStatus(enum.IntEnum):
    """How a trajectory ended; values equal the proto's TRAJECTORY_STATUS_* numbers (0 is refused)."""

    UNSPECIFIED = 0
    COMPLETED = 1
    FAILED = 2
    ABORTED = 3

    @classmethod
    def _missing_(cls, value: object) -> TrajectoryStatus:
        """LoongSage's values ("completed", "failed", "aborted", or its str enum) and member names, any case."""
        if isinstance(value, str):
            member = cls.__members__.get(value.strip().upper())
            if member is not None and member is not cls.UNSPECIFIED:
                return member
            if value.strip().lower() in ("pending", "generating"):
                raise ValueError(f"trajectory status {value!r} is not a final status: submit completed, failed or "
                                 f"aborted trajectories")
        return None  # type: ignore[return-value]  # Enum then raises its usual ValueError


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
    JOB_ENDED = 5  # EndJob: dispatch closed for good; `mode` says abort or finish what you hold, then stop


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


# Fields of Trajectory that are numeric arrays on the wire, in proto order.
ARRAY_FIELD_NAMES = tuple(_wire.ARRAY_FIELDS)


@dataclass(frozen=True, kw_only=True, eq=False)
class Trajectory:
    """One generated response. Empty arrays mean absent; logprobs travel as float32.

    `status` is required: the server refuses UNSPECIFIED, so a forgotten status fails loudly.
    Non-empty token_ids, logprobs and loss_mask must have equal lengths (the server checks).
    The arrays may be lists, tuples, array.array or NumPy arrays (token ids and mask as integers that fit
    int32, logprobs as numbers stored as float32); what a client returns is lists, or read-only NumPy
    arrays over the received bytes with `arrays="numpy"`. Two trajectories are equal when every field
    is, the arrays compared as their encoded bits (NaN equals the same NaN; a list equals an array).

    Written as LoongSage writes its trajectories too: `status` may be LoongSage's string ("completed",
    "failed", "aborted", or its str enum), normalised to TrajectoryStatus; and its keyword names are taken
    as aliases (see LOONGSAGE_NAMES): `start_rollout_weight_version`, `end_rollout_weight_version`,
    `rollout_log_probs`, `loss_masks`, `tokens` (prompt + response: the response's part, as long as
    loss_masks or rollout_log_probs, becomes token_ids) and `rollout_weight_versions` (per token: runs
    of one version become the segments). The same names read the fields back.
    """

    trajectory_id: str
    prompt_id: str
    status: TrajectoryStatus | int
    ds_index: int = 0
    reward: float = 0.0
    token_ids: Sequence[int] | Any = field(default_factory=list)
    logprobs: Sequence[float] | Any = field(default_factory=list)
    loss_mask: Sequence[int] | Any = field(default_factory=list)
    start_weight_version: int = 0
    end_weight_version: int = 0
    num_turns: int = 0
    metadata: dict[str, str] = field(default_factory=dict)
    payload: bytes = b""
    # Partial rollouts: response tokens per segment and the weight version each segment was generated with.
    segment_lengths: list[int] = field(default_factory=list)
    segment_weight_versions: list[int] = field(default_factory=list)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Trajectory):
            return NotImplemented
        for f in fields(self):
            mine, theirs = getattr(self, f.name), getattr(other, f.name)
            if f.name in _wire.ARRAY_FIELDS:
                if arrays.comparable(f.name, mine) != arrays.comparable(f.name, theirs):
                    return False
            elif mine != theirs:
                return False
        return True

    __hash__ = None  # type: ignore[assignment]  # mutable arrays inside

    def __post_init__(self) -> None:
        if isinstance(self.status, str):  # LoongSage's status strings (its enum is a str enum)
            object.__setattr__(self, "status", TrajectoryStatus(self.status))

    # LoongSage's names for the same fields, to read them as LoongSage code does.
    @property
    def start_rollout_weight_version(self) -> int:
        return self.start_weight_version

    @property
    def end_rollout_weight_version(self) -> int:
        return self.end_weight_version

    @property
    def rollout_log_probs(self) -> Sequence[float] | Any:
        return self.logprobs

    @property
    def loss_masks(self) -> Sequence[int] | Any:
        return self.loss_mask

    def _scalars(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name not in _wire.ARRAY_FIELDS}

    def encoded_parts(self) -> list[Any]:
        """The wire encoding as buffers to join: scalar fields, then each array's own buffer."""
        return _wire.encode_trajectory(self._scalars(), {name: arrays.encode(name, getattr(self, name))
                                                         for name in ARRAY_FIELD_NAMES})

    def to_pb(self) -> pacer_pb2.Trajectory:
        """The wire message (built from the encoding, so arrays are not copied number by number)."""
        return pacer_pb2.Trajectory.FromString(b"".join(self.encoded_parts()))

    @classmethod
    def from_pb(cls, msg: pacer_pb2.Trajectory, arrays_as: arrays.ArrayMode = "list") -> Trajectory:
        """From the wire message: arrays as lists, or as read-only NumPy arrays (`arrays_as="numpy"`)."""
        values = {name: arrays.from_values(name, getattr(msg, name), arrays_as) for name in ARRAY_FIELD_NAMES}
        return _from_fields(cls, msg, status=_enum(TrajectoryStatus, msg.status), metadata=dict(msg.metadata),
                            **values)

    @classmethod
    def from_encoded(cls, encoded: memoryview, arrays_as: arrays.ArrayMode = "list") -> Trajectory:
        """From an encoded Trajectory: with `arrays_as="numpy"` each array is a read-only NumPy array over
        `encoded` itself (no copy); only the other fields are decoded."""
        msg, runs = _wire.split_message(encoded, pacer_pb2.Trajectory, _ARRAY_NUMBERS)
        if any(len(r) > 1 for r in runs.values()) or any(len(getattr(msg, name)) for name in runs):
            # An array in several packed runs, or sent unpacked (legal, unusual): decoded the ordinary way.
            return cls.from_pb(pacer_pb2.Trajectory.FromString(bytes(encoded)), arrays_as)
        values = {name: arrays.decode(name, run[0] if run else b"", arrays_as) for name, run in runs.items()}
        return _from_fields(cls, msg, status=_enum(TrajectoryStatus, msg.status), metadata=dict(msg.metadata),
                            **values)


_ARRAY_NUMBERS = {field.number: name for name, field in _wire.ARRAY_FIELDS.items()}

# LoongSage's Trajectory keyword names (coda.agentflow.trajectory_store) -> this Trajectory's.
LOONGSAGE_NAMES = {
    "start_rollout_weight_version": "start_weight_version",
    "end_rollout_weight_version": "end_weight_version",
    "rollout_log_probs": "logprobs",
    "loss_masks": "loss_mask",
}
_dataclass_init = Trajectory.__init__


def _init_with_loongsage_names(self: Trajectory, **values: Any) -> None:
    for theirs, ours in LOONGSAGE_NAMES.items():
        if theirs in values:
            if ours in values:
                raise TypeError(f"Trajectory got both {ours!r} and LoongSage's name for it, {theirs!r}")
            values[ours] = values.pop(theirs)
    if "tokens" in values:  # LoongSage's prompt + response: the response is the last len(loss_masks) tokens
        tokens = values.pop("tokens")
        if "token_ids" in values:
            raise TypeError("Trajectory got both 'token_ids' (the response) and LoongSage's 'tokens' (prompt + "
                            "response)")
        response = max(len(values.get("loss_mask", ())), len(values.get("logprobs", ())))
        if not response and len(tokens):
            raise TypeError("LoongSage's 'tokens' is prompt + response: pass 'loss_masks' or 'rollout_log_probs' "
                            "too (as long as the response), or the response alone as 'token_ids'")
        values["token_ids"] = list(tokens)[len(tokens) - response:] if response else []
    if "rollout_weight_versions" in values:  # one version per response token: runs of one version are segments
        versions = list(values.pop("rollout_weight_versions"))
        if "segment_lengths" in values or "segment_weight_versions" in values:
            raise TypeError("Trajectory got both segments and LoongSage's per-token 'rollout_weight_versions'")
        lengths: list[int] = []
        segment_versions: list[int] = []
        for version in versions:
            if segment_versions and segment_versions[-1] == version:
                lengths[-1] += 1
            else:
                lengths.append(1)
                segment_versions.append(int(version))
        values["segment_lengths"], values["segment_weight_versions"] = lengths, segment_versions
    _dataclass_init(self, **values)


_init_with_loongsage_names.__doc__ = _dataclass_init.__doc__
Trajectory.__init__ = _init_with_loongsage_names  # type: ignore[method-assign]


def _number(message_class: Any, name: str) -> int:
    return message_class.DESCRIPTOR.fields_by_name[name].number


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
    def from_pb(cls, msg: pacer_pb2.TrajectoryGroup, arrays_as: arrays.ArrayMode = "list") -> TrajectoryGroup:
        """From the wire message; arrays as in Trajectory.from_pb."""
        return cls._of(msg, [Trajectory.from_pb(t, arrays_as) for t in msg.trajectories])

    @classmethod
    def from_encoded(cls, encoded: memoryview, arrays_as: arrays.ArrayMode = "list") -> TrajectoryGroup:
        """From an encoded TrajectoryGroup; arrays as in Trajectory.from_encoded."""
        msg, parts = _wire.split_message(encoded, pacer_pb2.TrajectoryGroup, _GROUP_TRAJECTORIES)
        return cls._of(msg, [Trajectory.from_encoded(t, arrays_as) for t in parts["trajectories"]])

    @classmethod
    def _of(cls, msg: Any, trajectories: list[Trajectory]) -> TrajectoryGroup:
        return _from_fields(cls, msg, epoch=_optional(msg, "epoch"), index=_optional(msg, "index"),
                            trajectories=trajectories)


_GROUP_TRAJECTORIES = {_number(pacer_pb2.TrajectoryGroup, "trajectories"): "trajectories"}


def _groups(messages: Any, arrays_as: arrays.ArrayMode = "list") -> list[TrajectoryGroup]:
    """Converts a repeated TrajectoryGroup field."""
    return [TrajectoryGroup.from_pb(g, arrays_as) for g in messages]


def _split_answer(response: Any, message_class: Any, group_fields: tuple[str, ...],
                  arrays_as: arrays.ArrayMode) -> tuple[Any, dict[str, list[TrajectoryGroup]]]:
    """An answer carrying groups, as its message (groups left out when it came as bytes) and its groups."""
    if not isinstance(response, (bytes, bytearray, memoryview)):  # a decoded message
        return response, {name: _groups(getattr(response, name), arrays_as) for name in group_fields}
    msg, parts = _wire.split_message(memoryview(response), message_class,
                                     {_number(message_class, name): name for name in group_fields})
    return msg, {name: [TrajectoryGroup.from_encoded(g, arrays_as) for g in encoded] for name, encoded in parts.items()}


@dataclass(frozen=True)
class DispatchResult:
    """Dispatch answer: admitted ids with their seqs (same order) and the window terms after admission.
    `admitted_ids`, `first_seq` and `continued` read them under the core's names."""

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
    # Restored groups re-offered for continuation (asked for with max_continuations), admitted before the
    # candidates: each with its new seq and the trajectories it had when it was restored.
    continuations: list[TrajectoryGroup] = field(default_factory=list)
    job_ended: bool = False  # EndJob ended the job: nothing will be admitted again; stop dispatching

    # The core's names for the same things (coda_server.core.types.DispatchResult), so code reading either
    # record reads the same: the fields above keep the wire's names (DispatchResponse).
    @property
    def admitted_ids(self) -> list[str]:
        """The admitted prompt ids, in admission order (`admitted`)."""
        return self.admitted

    @property
    def first_seq(self) -> int:
        """The seq of admitted_ids[0] (the others follow it); -1 when nothing was admitted."""
        return self.seqs[0] if self.seqs else -1

    @property
    def continued(self) -> list[TrajectoryGroup]:
        """The restored groups re-offered for continuation (`continuations`)."""
        return self.continuations

    @classmethod
    def from_pb(cls, msg: pacer_pb2.DispatchResponse) -> DispatchResult:
        """From the wire message."""
        return _from_fields(
            cls, msg, admitted=[a.prompt_id for a in msg.admitted], seqs=[a.seq for a in msg.admitted],
            continuations=_groups(msg.continuations),
        )


@dataclass(frozen=True)
class KeepAliveResult:
    """KeepAlive answer: leases renewed, named groups no longer in flight, and the server's lease length."""

    renewed: int
    unknown_prompt_ids: list[str]
    lease_seconds: float  # 0: in-flight leases never run out
    # A worker holding a control stream that makes no call for this long loses its running groups (0: off).
    liveness_seconds: float = 0.0
    # Of the Collect leases named (lease_ids), those not live any more: a batch of one, not trained yet, went (or
    # goes) to another trainer, and is not to be trained.
    ended_lease_ids: list[str] = field(default_factory=list)

    @classmethod
    def from_pb(cls, msg: pacer_pb2.KeepAliveResponse) -> KeepAliveResult:
        """From the wire message."""
        return _from_fields(cls, msg, unknown_prompt_ids=list(msg.unknown_prompt_ids),
                            ended_lease_ids=list(msg.ended_lease_ids))


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
class CollectShape:
    """What keeps a data-parallel trainer's global mini-batches apart: the ranks' world_size, num_groups and
    token_budget (docs/protocol.md, "Data-parallel ranks")."""

    world_size: int
    num_groups: int
    token_budget: int = 0

    def __str__(self) -> str:
        return describe_collect_shape(self.world_size, self.num_groups, self.token_budget)


@dataclass(frozen=True)
class CollectResult:
    """Collect answer: the groups taken, and whether the wait ended before enough were ready."""

    groups: list[TrajectoryGroup]
    timed_out: bool
    lease_id: str = ""  # set for a leased Collect: Ack it, or the groups are delivered again
    # Fewer groups than asked although they were there: more would not have fit the client's message limit.
    # They stay buffered, first in line: collect again for the rest.
    cut_to_fit: bool = False
    # A rank's Collect that took a new global mini-batch while shares of another shape waited for their ranks:
    # those shapes (ranks that disagree on the shape, or a trainer restarted with another world size).
    other_shapes_waiting: tuple[CollectShape, ...] = ()

    @classmethod
    def from_pb(cls, msg: Any, arrays_as: arrays.ArrayMode = "list") -> CollectResult:
        """From the wire message or its encoded bytes (arrays then viewed in place, see Trajectory.from_encoded)."""
        msg, groups = _split_answer(msg, pacer_pb2.CollectResponse, ("groups",), arrays_as)
        shapes = tuple(CollectShape(s.world_size, s.num_groups, s.token_budget) for s in msg.other_shapes_waiting)
        return _from_fields(cls, msg, other_shapes_waiting=shapes, **groups)

    @classmethod
    def from_stream(cls, messages: Sequence[Any], arrays_as: arrays.ArrayMode = "list") -> CollectResult:
        """From CollectStream's messages (as from_pb takes them): one answer, their groups joined in order."""
        if not messages:
            raise ValueError("CollectStream ended without an answer message")
        results = [cls.from_pb(message, arrays_as) for message in messages]
        first = results[0]
        return cls([g for r in results for g in r.groups], first.timed_out, first.lease_id, first.cut_to_fit,
                   first.other_shapes_waiting)


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
    # Groups the server keeps and re-offers on Dispatch (rollout.continue_restored): those released from silent
    # workers this step that still wait, then those this Reset restored; `restored` is empty then. With
    # cut_to_fit, also the restored and expired groups this answer could not carry.
    kept_prompt_ids: list[str] = field(default_factory=list)
    # True: the groups to return would not all fit this client's max_message_bytes; the rest stayed on the server
    # (restored and expired ones kept for continuation, quarantined ones until the next Reset).
    cut_to_fit: bool = False

    @classmethod
    def from_pb(cls, msg: Any, arrays_as: arrays.ArrayMode = "list") -> ResetResult:
        """From the wire message or its encoded bytes; arrays as in CollectResult.from_pb."""
        msg, groups = _split_answer(msg, pacer_pb2.ResetResponse, ("restored", "expired", "quarantined"), arrays_as)
        return _from_fields(cls, msg, dropped_prompt_ids=list(msg.dropped_prompt_ids),
                            report=StepReport.from_pb(msg.report), kept_prompt_ids=list(msg.kept_prompt_ids),
                            **groups)


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
class Checkpoint:
    """Checkpoint answer: the opaque blob to store beside the model checkpoint, and what it holds."""

    blob: bytes
    step: int
    weight_version: int
    buffered_groups: int
    kept_groups: int
    in_flight_prompts: int
    trajectory_bytes: int

    @classmethod
    def from_pb(cls, msg: pacer_pb2.CheckpointResponse) -> Checkpoint:
        """From the wire message."""
        return _from_fields(cls, msg, blob=msg.checkpoint)


@dataclass(frozen=True)
class RestoreResult:
    """Restore answer: the checkpoint's step and weight version, what was discarded and what put back."""

    step: int
    weight_version: int
    generation: int
    discarded_groups: int
    discarded_trajectories: int
    discarded_newer_trajectories: int  # generated (in part) under a weight version newer than the checkpoint's
    dropped_running: int
    reinstated_groups: int
    kept_groups: int
    reoffered_prompts: int
    checkpoint_taken_at: float
    discarded_prompt_ids: list[str]  # of the discarded groups

    @classmethod
    def from_pb(cls, msg: pacer_pb2.RestoreResponse) -> RestoreResult:
        """From the wire message."""
        return _from_fields(cls, msg, discarded_prompt_ids=list(msg.discarded_prompt_ids))


@dataclass(frozen=True)
class PromptCursor:
    """The prompts a Dispatch admitted (GetPromptCursor): per (ds_index, epoch) every index below a mark and
    those above it. `admitted(...)` says whether a prompt was; a prompt without an index (nor a LoongSage-form
    id) is not tracked, and reads as not admitted."""

    marks: dict[tuple[int, int], tuple[int, frozenset[int]]]
    restores: int

    @classmethod
    def from_pb(cls, msg: pacer_pb2.PromptCursor) -> PromptCursor:
        """From the wire message."""
        return cls({(m.ds_index, m.epoch): (m.below, frozenset(m.above)) for m in msg.marks}, msg.restores)

    def admitted(self, prompt_id: str, ds_index: int = 0, epoch: int | None = None, index: int | None = None) -> bool:
        """Whether a Dispatch admitted this prompt (a ref without an epoch counts as epoch 0; without an
        index, its LoongSage-form id `epoch{E}_..._prompt{N}` gives both)."""
        if index is None:
            match = LOONGSAGE_PROMPT_ID.fullmatch(prompt_id)
            if match is None:
                return False
            epoch, index = int(match.group(1)), int(match.group(2))
        mark = self.marks.get((ds_index, 0 if epoch is None else epoch))
        return mark is not None and (index < mark[0] or index in mark[1])


@dataclass(frozen=True)
class PacerState:
    """GetState answer: every counter of the pacer, flat, as on the wire."""

    # BEGIN PacerState fields: generated by scripts/gen_proto.py from coda_server/core/state.py; do not edit
    #: R: groups dispatched and not yet collected out of the trajectory queue (GetState running). Metric:
    #: coda_pacer_running_groups.
    running: int
    #: Q: complete groups in the pipeline buffer, not yet taken by the trainer (GetState buffered). Metric:
    #: coda_pacer_buffered_groups.
    buffered: int
    #: Trajectories waiting in the trajectory queue. Metric: coda_pacer_queued_trajectories.
    queued_trajectories: int
    #: Groups a Dispatch would admit now (0 while paused). Metric: coda_pacer_capacity_groups.
    capacity: int
    #: C = int(B * (1 + stale_steps)), the window size in groups. Metric: coda_pacer_window_size_groups.
    window_size: int
    #: Trainer step (Resume increments it). Metric: coda_pacer_step.
    step: int
    #: Weight version generation runs with (set at Resume). Metric: coda_pacer_weight_version.
    weight_version: int
    #: Reset generation (increments at every Reset). Metric: coda_pacer_generation.
    generation: int
    #: 1 while dispatch is paused by a Reset, else 0. Metric: coda_pacer_paused.
    paused: bool
    #: 1 while a Reset is running, else 0. Metric: coda_pacer_resetting.
    resetting: bool
    #: The pacing strategy (fully_async.sliding_window).
    strategy: str
    #: Groups admitted by Dispatch. Metric: coda_pacer_dispatched_groups_total.
    dispatched: int
    #: Trajectories accepted by Submit (duplicates excluded). Metric: coda_pacer_submitted_trajectories_total.
    submitted: int
    #: Groups collected into the pipeline buffer. Metric: coda_pacer_collected_groups_total.
    collected: int
    #: Groups taken by the trainer through Collect. Metric: coda_pacer_consumed_groups_total.
    consumed: int
    #: Groups dropped by a filter (rollout.filter). Metric: coda_pacer_filtered_groups_total.
    filtered: int
    #: Assembled groups returned by a Reset for continuation. Metric: coda_pacer_restored_groups_total.
    restored: int
    #: Incomplete groups dropped by a Reset. Metric: coda_pacer_dropped_groups_total.
    dropped: int
    #: Trajectories refused by Submit with reason STALE_GENERATION (prompt dispatched before the last Reset or
    #: Restore). Metric: coda_pacer_stale_rejected_trajectories_total.
    stale_rejected: int
    #: Re-submitted identical trajectories acknowledged as duplicates. Metric:
    #: coda_pacer_duplicate_trajectories_total.
    duplicates: int
    #: The pacing settings the state is made under.
    config_summary: dict[str, str]
    #: Long-polls (Dispatch, Collect, Reset) waiting in the server now. Metric: coda_pacer_waiting_calls.
    waiting_calls: int
    #: The last server.step_reports_kept step reports, oldest first.
    recent_reports: list[StepReport]
    #: Running groups reclaimed before they were assembled: their in-flight lease ran out
    #: (server.inflight_lease_seconds), or their worker went silent for server.worker_liveness_seconds (killed, hung,
    #: cut off). Metric: coda_pacer_expired_groups_total.
    expired: int
    #: Leased groups returned to the buffer unacknowledged (the lease ran out or was given back, or its trainer went
    #: silent or stopped naming it). Metric: coda_pacer_redelivered_groups_total.
    redelivered: int
    #: Of the redelivered groups, those given back under their lease to a trainer heard again after its silence,
    #: before anyone else took them. Metric: coda_pacer_reclaimed_groups_total.
    reclaimed: int
    #: Groups handed out under a Collect lease, not yet acknowledged. Metric: coda_pacer_leased_groups.
    leased: int
    #: Bytes of trajectories queued, buffered or leased. Metric: coda_pacer_held_bytes.
    held_bytes: int
    #: Complete groups quarantined instead of buffered: a strategy hook raised on them, or they held a FAILED
    #: trajectory no filter dropped (recent_incidents says which; the next Reset returns them). Metric:
    #: coda_pacer_quarantined_groups_total.
    quarantined: int
    #: The last server.incidents_kept incidents (a raising strategy hook, a refused dirty group), oldest first.
    recent_incidents: list[Incident]
    #: Groups the server keeps for continuation (rollout.continue_restored: restored by a Reset, or released from a
    #: silent worker), waiting to be re-offered by a Dispatch. Metric: coda_pacer_restored_kept_groups.
    restored_kept: int
    #: Buffered or leased groups a Restore discarded (the server had them after the restored checkpoint was taken).
    #: Metric: coda_pacer_rolled_back_groups_total.
    rolled_back: int
    #: Groups a Restore put back into the buffer from its checkpoint. Metric: coda_pacer_reinstated_groups_total.
    reinstated: int
    #: Checkpoints taken (Checkpoint). Metric: coda_pacer_checkpoints_total.
    checkpoints: int
    #: Checkpoints restored (Restore). Metric: coda_pacer_restores_total.
    restores: int
    #: Step of the last checkpoint taken (-1: none since the state began). Metric: coda_pacer_last_checkpoint_step.
    last_checkpoint_step: int
    #: Weight version of the last checkpoint taken (-1: none). Metric: coda_pacer_last_checkpoint_weight_version.
    last_checkpoint_weight_version: int
    #: Step of the last checkpoint restored (-1: none since the state began). Metric: coda_pacer_last_restore_step.
    last_restore_step: int
    #: Weight version of the last checkpoint restored (-1: none). Metric: coda_pacer_last_restore_weight_version.
    last_restore_weight_version: int
    #: 1 once EndJob ended the job (dispatch closed for good), else 0. Metric: coda_pacer_job_ended.
    job_ended: bool
    #: B: prompt groups per training step (data_source.num_prompts_per_step).
    prompts_per_step: int
    #: N of each data source, by ds_index.
    group_sizes: list[int]
    #: M: trajectories per mini-batch (trainer.mini_batch_size); a step is B * N / M mini-batches.
    mini_batch_size: int
    #: fully_async.stale_steps: C = int(B * (1 + stale_steps)).
    stale_steps: float
    #: The most groups a Collect (without allow_partial) may wait for: more can never be buffered at once (the window
    #: C for the built-in strategies, or server.max_buffered_groups); 0: no bound known. Metric:
    #: coda_pacer_collect_limit_groups.
    collect_limit: int
    #: Seconds the longest-kept restored group has waited to be re-offered (0 when none is kept): a kept group nobody
    #: continues shows here. Metric: coda_pacer_restored_kept_oldest_seconds.
    restored_kept_oldest_seconds: float
    #: Why the state directory cannot be written now (a full disk, a read-only or failing volume): until it can,
    #: changes are refused UNAVAILABLE (reason STATE_DIR_UNWRITABLE) and readiness is NOT_SERVING. Empty when it can
    #: be written, or state is in memory.
    state_dir_problem: str
    # END PacerState fields

    @classmethod
    def from_pb(cls, msg: pacer_pb2.GetStateResponse) -> PacerState:
        """From the wire message."""
        return _from_fields(cls, msg, config_summary=dict(msg.config_summary),
                            recent_reports=[StepReport.from_pb(r) for r in msg.recent_reports],
                            recent_incidents=[Incident.from_pb(i) for i in msg.recent_incidents],
                            group_sizes=list(msg.group_sizes) or _summary_group_sizes(msg.config_summary))


@dataclass(frozen=True)
class JobEndReport:
    """EndJob answer: where every group the totals (`state`) do not account for is at the end of the job."""

    mode: ResetMode | int  # what the workers were told: ABORT or WAIT what they held
    waited_seconds: float
    buffered_prompt_ids: list[str]  # complete, never taken by the trainer (a Collect can still take them)
    leased: int  # handed out under a Collect lease, not acknowledged
    held_prompt_ids: list[str]  # complete but held by the collection gate (e.g. holding ABORTED trajectories)
    in_flight_prompt_ids: list[str]  # still missing trajectories when the wait ended
    kept_prompt_ids: list[str]  # restored groups kept for continuation, never re-offered now
    expired_prompt_ids: list[str]  # their in-flight lease ran out this step
    quarantined_prompt_ids: list[str]  # quarantined this step (state.recent_incidents says why)
    state: PacerState  # the counters at the end

    @property
    def left_over(self) -> int:
        """Groups generated or started and never trained on, by this report."""
        return (len(self.buffered_prompt_ids) + self.leased + len(self.held_prompt_ids)
                + len(self.in_flight_prompt_ids) + len(self.kept_prompt_ids) + len(self.expired_prompt_ids)
                + len(self.quarantined_prompt_ids))

    @classmethod
    def from_pb(cls, msg: pacer_pb2.EndJobResponse) -> JobEndReport:
        """From the wire message."""
        return _from_fields(cls, msg, mode=_enum(ResetMode, msg.mode), state=PacerState.from_pb(msg.state),
                            **{name: list(getattr(msg, name)) for name in (
                                "buffered_prompt_ids", "held_prompt_ids", "in_flight_prompt_ids", "kept_prompt_ids",
                                "expired_prompt_ids", "quarantined_prompt_ids")})


def _summary_group_sizes(summary: Any) -> list[int]:
    """N per data source from a server that sends no typed group_sizes (older than that field)."""
    return [int(n) for n in summary.get("num_trajectories_per_prompt", "").split(",") if n]


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
    restores: int = 0  # Restores the server has made (a worker seeing it grow re-reads the prompt cursor)
    job_ended: bool = False  # EndJob ended the job (JOB_ENDED, and every event after it)

    @classmethod
    def from_pb(cls, msg: pacer_pb2.ControlEvent) -> ControlEvent:
        """From the wire message."""
        return _from_fields(cls, msg, type=_enum(ControlEventType, msg.type), mode=_enum(ResetMode, msg.mode))


@dataclass(frozen=True)
class HeldGroup:
    """One running group a worker holds (ListWorkers)."""

    prompt_id: str
    seq: int
    ds_index: int
    held_seconds: float  # since Dispatch admitted it
    trajectories: int  # received so far
    group_size: int
    lease_remaining_seconds: float | None  # until its in-flight lease runs out; None with leases off

    @classmethod
    def from_pb(cls, msg: pacer_pb2.HeldGroup) -> HeldGroup:
        """From the wire message."""
        return _from_fields(cls, msg, lease_remaining_seconds=_optional(msg, "lease_remaining_seconds"))


@dataclass(frozen=True)
class WorkerHoldings:
    """The running groups of one client id ("" for groups dispatched without one), oldest first."""

    client_id: str
    running: int
    oldest_held_seconds: float
    groups: list[HeldGroup]
    # The weight version its engine reported loaded on its last Dispatch or KeepAlive; None: never said.
    loaded_weight_version: int | None = None
    # Groups leased to it as a trainer (leases its silence ends: batches()'), and those leases, oldest first.
    leased: int = 0
    lease_ids: list[str] = field(default_factory=list)
    # Seconds since the server last heard a call or stream under this client id; None: it heard none.
    last_heard_seconds: float | None = None
    # WatchControl streams open under it now; 0: it hears no PAUSE or RESUME. None: the server does not report
    # contact (an older release), and then last_heard_seconds None says nothing either.
    watch_streams: int | None = None

    @classmethod
    def from_pb(cls, msg: pacer_pb2.WorkerHoldings) -> WorkerHoldings:
        """From the wire message."""
        return _from_fields(cls, msg, groups=[HeldGroup.from_pb(g) for g in msg.groups],
                            loaded_weight_version=_optional(msg, "loaded_weight_version"),
                            lease_ids=list(msg.lease_ids),
                            last_heard_seconds=_optional(msg, "last_heard_seconds"),
                            watch_streams=_optional(msg, "watch_streams"))
