"""Conversion between protobuf messages and the pacing core's types; nothing else."""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from types import MappingProxyType
from typing import Callable, Iterable, Optional, Sequence, Union

from google.protobuf.message import DecodeError

from coda_client import wire_forms as _wire
from coda_client._proto import pacer_pb2 as pb

from . import wire
from .core import checkpoints
from .core.errors import InvalidArgumentError, ResourceExhaustedError, refused
from .core.shares import PLAIN, BatchShape
from .core.state import STATE_FIELD_NAMES, PacerState
from .core.types import (
    CollectResult,
    ControlEvent,
    DispatchResult,
    HeldGroup,
    JobEndReport,
    KeepAliveResult,
    PromptRef,
    ResetMode,
    ResetResult,
    ResumeResult,
    StepReport,
    SubmitResult,
    Trajectory,
    TrajectoryGroup,
    TrajectoryStatus,
    groups_bytes,
)


class ProtoTrajectories:
    """Journal codec: a trajectory is written as its wire message, which carries every field the core reads."""

    def encode(self, trajectory: Trajectory) -> Optional[bytes]:
        body = trajectory.body
        return body.SerializeToString() if isinstance(body, wire.EncodedTrajectory) else None

    def decode(self, data: bytes) -> Trajectory:
        return trajectories([wire.read_trajectory(data)])[0]


_STATUSES = {int(status): status for status in TrajectoryStatus}
_TOKEN_ID_WIDTH = wire.TOKEN_ID_WIDTH
_NO_METADATA: Mapping[str, str] = MappingProxyType({})


# Called through the class: upb looks an attribute up among the message's fields before its methods, so
# `c.HasField` costs more than the call itself.
_has_field = pb.PromptRef.HasField


def prompt_refs(candidates: Iterable[pb.PromptRef]) -> list[PromptRef]:
    return [
        PromptRef(
            c.prompt_id,
            c.ds_index,
            c.epoch if _has_field(c, "epoch") else None,
            c.index if _has_field(c, "index") else None,
        )
        for c in candidates
    ]


def trajectories(submitted: Sequence[wire.SubmittedTrajectory]) -> list[Trajectory]:
    """Core trajectories read from a Submit's trajectories, whose body is their encoded bytes
    (wire.EncodedTrajectory), so the trainer gets them back byte for byte; `size_bytes`, which the
    server.max_held_bytes cap counts, is the encoded size."""
    converted: list[Trajectory] = []
    append, body_of, statuses, usual_token_count = (converted.append, wire.EncodedTrajectory, _STATUSES,
                                                    wire.usual_token_count)
    for i, submitted_trajectory in enumerate(submitted):
        m, data = submitted_trajectory.fields, submitted_trajectory.encoded
        # The usual trajectory (the three per-token arrays of one length, nothing else to check) in one test, as
        # wire.usual_token_count tells it; anything else through the checks that name what is wrong.
        num_tokens = usual_token_count(submitted_trajectory)
        if num_tokens is None:
            if wire.array_problem(submitted_trajectory):
                raise _refused(submitted, i)
            token_ids = submitted_trajectory.runs.get("token_ids")
            num_tokens = len(token_ids) // _TOKEN_ID_WIDTH if token_ids else 0
        metadata = _NO_METADATA
        if submitted_trajectory.has_metadata:
            # Decoded now: an entry the trainer's parser refuses must not get in.
            try:
                metadata = submitted_trajectory.metadata_map()
            except DecodeError:
                raise _refused(submitted, i) from None
        status = m.status
        # Positional, in Trajectory's field order: a keyword call to a dataclass builds a kwargs dict and costs
        # about twice as much, once per submitted trajectory.
        append(Trajectory(
            m.trajectory_id, m.prompt_id, m.ds_index,
            statuses.get(status, status),  # kept as a plain int when unknown, so the core refuses it by value
            m.reward, m.start_weight_version, m.end_weight_version, m.num_turns,
            body_of(data, submitted_trajectory),  # body
            len(data),  # size_bytes
            metadata,
            num_tokens,
        ))
    return converted


def _refused(submitted: Sequence[wire.SubmittedTrajectory], first: int) -> InvalidArgumentError:
    """The error refusing a Submit whose trajectory `first` is the first with a problem: every violation named."""
    violations = [(f"trajectories[{j}]", problem) for j in range(first, len(submitted))
                  if (problem := _problem(submitted[j]))]
    return refused("Submit", "accepted", violations)


def _problem(submitted_trajectory: wire.SubmittedTrajectory) -> Optional[str]:
    """What is wrong with a submitted trajectory's arrays or metadata, or None."""
    problem = wire.array_problem(submitted_trajectory)
    if problem is None and submitted_trajectory.has_metadata:
        try:
            submitted_trajectory.metadata_map()
        except DecodeError:
            problem = "metadata must map UTF-8 strings to UTF-8 strings; an entry does not decode as one"
    return problem


def reset_mode(value: int, method: str = "Reset") -> ResetMode:
    """A Reset's or an EndJob's (`method`) mode, refused when it is no ResetMode."""
    if value not in ResetMode._value2member_map_:
        raise InvalidArgumentError(f"{method} mode {value} is not allowed; use RESET_MODE_ABORT, RESET_MODE_WAIT "
                                   f"or RESET_MODE_UNSPECIFIED (server default)",
                                   violations=[("mode", "must be RESET_MODE_ABORT, RESET_MODE_WAIT or unspecified")])
    return ResetMode(value)


def group_parts(group: TrajectoryGroup) -> list:
    return wire.group_parts(group.prompt_id, group.seq, group.ds_index, group.epoch, group.index,
                            [t.body for t in group.trajectories])


# Responses are filled field by field: upb sets an attribute several times faster than it takes a keyword
# argument, and adding a repeated element in place spares building and copying a separate message.

def dispatch_response(result: DispatchResult) -> Union[pb.DispatchResponse, wire.EncodedAnswer]:
    message = pb.DispatchResponse()
    if result.admitted_ids:  # a peek admits nothing: no repeated-field lookup (about a fifth of a microsecond)
        add = message.admitted.add
        for seq, prompt_id in enumerate(result.admitted_ids, result.first_seq):
            entry = add()
            entry.prompt_id = prompt_id
            entry.seq = seq
    # Only the fields that differ from their default are set: a field set costs a call into the message, and
    # most answers are not paused nor ended, many at step 0 or with nothing buffered.
    if result.paused:
        message.paused = True
    if result.step:
        message.step = result.step
    if result.weight_version:
        message.weight_version = result.weight_version
    if result.generation:
        message.generation = result.generation
    if result.running:
        message.running = result.running
    if result.buffered:
        message.buffered = result.buffered
    if result.capacity:
        message.capacity = result.capacity
    if result.remaining:
        message.remaining = result.remaining
    if result.job_ended:
        message.job_ended = True
    if result.continued:  # restored groups re-offered: their trajectories go out as the bytes held
        return wire.EncodedAnswer(message, {"continuations": [group_parts(g) for g in result.continued]})
    return message


def keep_alive_response(result: KeepAliveResult) -> pb.KeepAliveResponse:
    return pb.KeepAliveResponse(renewed=result.renewed, unknown_prompt_ids=result.unknown_prompt_ids,
                                lease_seconds=result.lease_seconds, liveness_seconds=result.liveness_seconds,
                                ended_lease_ids=result.ended_lease_ids)


def submit_response(result: SubmitResult) -> pb.SubmitResponse:
    message = pb.SubmitResponse()
    message.accepted = result.accepted
    message.duplicates = result.duplicates
    message.groups_completed = result.groups_completed
    return message


def lease_holder(request: pb.CollectRequest, caller: str) -> str:
    """Whose silence also ends a Collect's lease: the caller's client id when it asks so (release_when_silent)."""
    if not request.release_when_silent:
        return ""
    if not caller:
        raise InvalidArgumentError(
            "release_when_silent needs the caller's client id (x-coda-client-id metadata; PacerClient(client_id=...)): "
            "the server watches that id for heartbeats", violations=[("release_when_silent", "needs a client id")])
    return caller


def batch_shape(request: pb.CollectRequest) -> BatchShape:
    """A Collect's shape (world_size 0, the proto default, is a single consumer: RequestChecks.check_collect refuses
    any rank but 0 with it, and a run)."""
    if not (request.token_budget or request.world_size > 1 or request.rank or request.run):
        return PLAIN
    return BatchShape(request.token_budget, request.rank, request.world_size or 1, request.run)


def collect_response(result: CollectResult) -> wire.EncodedAnswer:
    return wire.EncodedAnswer(_collect_message(result), {"groups": [group_parts(g) for g in result.groups]})


def collect_stream(result: CollectResult, message_bytes: int = wire.STREAM_MESSAGE_BYTES) -> list[wire.EncodedAnswer]:
    """Collect's answer as CollectStream's messages (wire.split_answer)."""
    return wire.split_answer(_collect_message(result), [group_parts(g) for g in result.groups], message_bytes)


def _collect_message(result: CollectResult) -> pb.CollectResponse:
    """A Collect answer's fields other than its groups."""
    message = pb.CollectResponse(timed_out=result.timed_out, lease_id=result.lease_id, cut_to_fit=result.cut_to_fit)
    for world_size, num_groups, token_budget in result.other_shapes_waiting:  # BatchShape.key()s
        message.other_shapes_waiting.add(world_size=world_size, num_groups=num_groups, token_budget=token_budget)
    return message


def step_report(report: StepReport, message_class: type = pb.StepReport) -> pb.StepReport:
    return message_class(**dataclasses.asdict(report))


def reset_response(result: ResetResult) -> wire.EncodedAnswer:
    message = pb.ResetResponse(
        dropped_prompt_ids=result.dropped_prompt_ids, pause_delay_seconds=result.pause_delay_seconds,
        generation=result.generation, step=result.step, weight_version=result.weight_version, paused=result.paused,
        report=step_report(result.report), kept_prompt_ids=result.kept_prompt_ids, cut_to_fit=result.cut_to_fit,
    )
    return wire.EncodedAnswer(message, {"restored": [group_parts(g) for g in result.restored],
                                        "expired": [group_parts(g) for g in result.expired],
                                        "quarantined": [group_parts(g) for g in result.quarantined]})


def resume_response(result: ResumeResult) -> pb.ResumeResponse:
    return pb.ResumeResponse(step=result.step, weight_version=result.weight_version)


# Every PacerState field but those that are not plain values: the declaration (core/state.py) is the list.
STATE_FIELDS = tuple(name for name in STATE_FIELD_NAMES
                     if name not in ("config_summary", "recent_reports", "recent_incidents"))


def state_message(state: PacerState) -> pb.GetStateResponse:
    """The whole GetStateResponse message (EndJob's report carries one)."""
    message = _state_without_summary(state)
    message.config_summary.update(state.config_summary)
    return message


def state_response(state: PacerState) -> wire.EncodedAnswer:
    """GetState's answer; the configuration summary, the same in every answer of a server, is encoded once."""
    return wire.EncodedAnswer(_state_without_summary(state), {}, _encoded_summary(state.config_summary))


class Serialized:
    """An answer already serialized: gRPC's serializer (its SerializeToString) sends these bytes as they are."""

    __slots__ = ("data",)

    def __init__(self, data: bytes):
        self.data = data

    def SerializeToString(self) -> bytes:  # noqa: N802
        return self.data


class StateAnswers:
    """GetState's answers of one server: while a reading of the state (core/state.py's StateReader) compares equal
    to the one last answered (nothing changed in between, the usual case for a trainer or a monitor polling it),
    the last answer's bytes are sent again, without building the PacerState. Comparing two readings (tuples,
    compared in C) costs a small fraction of building the state and encoding its answer."""

    __slots__ = ("_reading", "_answer")

    def __init__(self) -> None:
        self._reading: Optional[tuple] = None
        self._answer = Serialized(b"")

    def answer(self, reading: tuple, state_of: Callable[[tuple], PacerState]) -> Serialized:
        """The answer of the state read as `reading`, which `state_of` turns into the PacerState."""
        if reading != self._reading:
            self._answer = Serialized(state_response(state_of(reading)).SerializeToString())
            self._reading = reading
        return self._answer


def _state_without_summary(state: PacerState) -> pb.GetStateResponse:
    values = {}
    for name in STATE_FIELDS:  # zeros left out: proto3 does not send them, and upb takes each keyword at a cost
        value = getattr(state, name)
        if value:
            values[name] = value
    return pb.GetStateResponse(recent_reports=[step_report(r) for r in state.recent_reports],
                               recent_incidents=[pb.Incident(**dataclasses.asdict(i)) for i in state.recent_incidents],
                               **values)


_ENCODED_SUMMARIES: dict[tuple, bytes] = {}  # a server has one summary (a test process a few)


def _encoded_summary(summary: Mapping[str, str]) -> bytes:
    key = tuple(summary.items())
    encoded = _ENCODED_SUMMARIES.get(key)
    if encoded is None:
        if len(_ENCODED_SUMMARIES) >= 16:
            _ENCODED_SUMMARIES.clear()
        encoded = _ENCODED_SUMMARIES[key] = pb.GetStateResponse(config_summary=summary).SerializeToString()
    return encoded


def end_job_response(report: JobEndReport) -> pb.EndJobResponse:
    return pb.EndJobResponse(
        mode=int(report.mode), waited_seconds=report.waited_seconds, buffered_prompt_ids=report.buffered_prompt_ids,
        leased=report.leased, held_prompt_ids=report.held_prompt_ids,
        in_flight_prompt_ids=report.in_flight_prompt_ids, kept_prompt_ids=report.kept_prompt_ids,
        expired_prompt_ids=report.expired_prompt_ids, quarantined_prompt_ids=report.quarantined_prompt_ids,
        state=state_message(report.state))


def control_event(event: ControlEvent) -> pb.ControlEvent:
    return pb.ControlEvent(type=int(event.type), mode=int(event.mode), weight_version=event.weight_version,
                           step=event.step, generation=event.generation, paused=event.paused,
                           restores=event.restores, job_ended=event.job_ended)


def checkpoint_response(checkpoint: dict, codec: ProtoTrajectories, max_message_bytes: int,
                        max_response_bytes: int = 0) -> bytes:
    """The encoded CheckpointResponse: its summary fields, then the blob as field 1 (fields may come in any
    order), so the blob is copied once into the answer; RESOURCE_EXHAUSTED when it cannot be sent, or when the
    caller could not receive it (`max_response_bytes`, 0: unsaid): refused here, it is not counted as taken."""
    head, body = checkpoints.encode_parts(checkpoint, codec)
    size = len(head) + len(body)
    # The smaller limit refuses it, named with what to raise.
    if max_response_bytes and max_response_bytes < max_message_bytes:
        limit, what = max_response_bytes, "this client's max_message_bytes"
        advice = f"raise the client's max_message_bytes (the server takes up to {max_message_bytes})"
    else:
        limit, what = max_message_bytes, "server.max_message_bytes"
        advice = "raise it (and the client's max_message_bytes)"
    if size > limit:
        raise ResourceExhaustedError(
            f"the checkpoint is {size} bytes, more than {what} ({limit}) lets one answer carry; {advice} above the "
            f"buffer's size", retry_after=60.0, reason="CHECKPOINT_TOO_LARGE", metadata={"checkpoint_bytes": str(size)})
    buffered = [group for _, group in checkpoint["buffer"]]
    summary = pb.CheckpointResponse(
        step=checkpoint["step"], weight_version=checkpoint["weight_version"],
        buffered_groups=len(buffered), kept_groups=len(checkpoint["kept"]),
        in_flight_prompts=len(checkpoint["in_flight"]),
        trajectory_bytes=groups_bytes(buffered) + groups_bytes(checkpoint["kept"]))
    return b"".join((summary.SerializeToString(), _BLOB_TAG, _wire.varint(size), head, body))


_BLOB_TAG = _wire.length_delimited_tag(pb.CheckpointResponse.DESCRIPTOR.fields_by_name["checkpoint"].number)


def prompt_cursor(cursor: dict) -> pb.PromptCursor:
    return pb.PromptCursor(marks=[pb.CursorMark(ds_index=ds, epoch=epoch, below=below, above=above)
                                  for ds, epoch, below, above in cursor["marks"]],
                           restores=cursor["restores"])


def list_workers_response(held: list[HeldGroup], max_groups_per_worker: int = 0,
                          loaded_versions: Optional[dict[str, int]] = None,
                          leases: Optional[dict[str, tuple[list[str], int]]] = None,
                          contact: Optional[Callable[[list[str]], dict[str, tuple[Optional[float], int]]]] = None
                          ) -> pb.ListWorkersResponse:
    """The held groups (oldest first) grouped by client id, ordered by client id, with the weight version each
    worker's engine reported loaded and the leases each trainer holds (`leases`: client id -> lease ids, groups); a
    client that reported a version or holds a lease is listed even when it runs no group. `contact(client ids)`:
    seconds since each was last heard (None: not heard) and its open watch streams."""
    loaded_versions, leases = loaded_versions or {}, leases or {}
    by_client: dict[str, list[HeldGroup]] = {client: [] for client in (*loaded_versions, *leases)}
    for group in held:
        by_client.setdefault(group.client_id, []).append(group)
    response = pb.ListWorkersResponse()
    heard = contact(list(by_client)) if contact is not None else {}
    for client, groups in sorted(by_client.items()):
        worker = response.workers.add(client_id=client, running=len(groups),
                                      oldest_held_seconds=max((g.held_seconds for g in groups), default=0.0))
        last_heard, streams = heard.get(client, (None, 0))
        if last_heard is not None:
            worker.last_heard_seconds = last_heard
        worker.watch_streams = streams
        if client in loaded_versions:
            worker.loaded_weight_version = loaded_versions[client]
        if client in leases:
            worker.lease_ids.extend(leases[client][0])
            worker.leased = leases[client][1]
        for g in groups[:max_groups_per_worker or None]:
            entry = worker.groups.add(prompt_id=g.prompt_id, seq=g.seq, ds_index=g.ds_index,
                                      held_seconds=g.held_seconds, trajectories=g.trajectories,
                                      group_size=g.group_size)
            if math.isfinite(g.lease_remaining_seconds):
                entry.lease_remaining_seconds = g.lease_remaining_seconds
    return response
