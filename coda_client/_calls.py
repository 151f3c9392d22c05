"""Request building and response conversion for each RPC, shared by the sync and async clients."""

from __future__ import annotations

import functools
import numbers
import operator
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from google.protobuf.descriptor import FieldDescriptor

from . import wire_forms as _wire
from ._channel import LONG_POLL_CAP_SECONDS, call_timeout
from ._proto import pacer_pb2
from .arrays import ArrayMode
from .errors import MessageTooLargeError
from .protocol import RPC_BY_NAME
from .types import (
    Checkpoint,
    CollectResult,
    DispatchResult,
    JobEndReport,
    KeepAliveResult,
    PacerState,
    PromptCursor,
    PromptRef,
    ResetMode,
    ResetResult,
    RestoreResult,
    ResumeResult,
    SubmitResult,
    Trajectory,
    WorkerHoldings,
)

_T = TypeVar("_T")


@dataclass(frozen=True)
class Call(Generic[_T]):
    """One call with one request, ready to send: stub method name, request, deadline and response converter
    (given the answer message, or the list of messages of a server-streaming RPC)."""

    method: str
    request: Any
    timeout: float
    convert: Callable[[Any], _T]

    @property
    def streamed(self) -> bool:
        """Its answer comes as a stream of messages (the RPC table's server-streaming RPCs)."""
        return RPC_BY_NAME[self.method].streaming


# Integer field types of the wire messages and their ranges, for a message of our own before protobuf's bare
# "Value out of range".
_INT32, _INT64 = (-2**31, 2**31 - 1), (-2**63, 2**63 - 1)
_UINT32, _UINT64 = (0, 2**32 - 1), (0, 2**64 - 1)
_INTEGER_RANGES = {
    FieldDescriptor.TYPE_UINT32: ("uint32", *_UINT32), FieldDescriptor.TYPE_FIXED32: ("fixed32", *_UINT32),
    FieldDescriptor.TYPE_UINT64: ("uint64", *_UINT64), FieldDescriptor.TYPE_FIXED64: ("fixed64", *_UINT64),
    FieldDescriptor.TYPE_INT32: ("int32", *_INT32), FieldDescriptor.TYPE_SINT32: ("sint32", *_INT32),
    FieldDescriptor.TYPE_SFIXED32: ("sfixed32", *_INT32), FieldDescriptor.TYPE_INT64: ("int64", *_INT64),
    FieldDescriptor.TYPE_SINT64: ("sint64", *_INT64), FieldDescriptor.TYPE_SFIXED64: ("sfixed64", *_INT64),
}


# The floating-point field types, which take any real number (NumPy's included) and nothing else.
_REAL_TYPES = {FieldDescriptor.TYPE_DOUBLE: "double", FieldDescriptor.TYPE_FLOAT: "float"}


def check_numbers(message_type: Any, **fields: Any) -> None:
    """Raises TypeError naming the field when a number field is given something else (an integer field a float
    or a bool, a number field a string), and ValueError naming the field and its range when an integer does not
    fit its wire type. NumPy's integers count as integers, as protobuf takes them."""
    by_name = message_type.DESCRIPTOR.fields_by_name
    for name, value in fields.items():
        field = by_name.get(name)
        if field is None or field.is_repeated or value is None:  # None: the field left unset, as protobuf takes it
            continue
        where = f"{message_type.DESCRIPTOR.name}.{name}"
        if field.type in _REAL_TYPES:
            if isinstance(value, bool) or not isinstance(value, numbers.Real):
                raise TypeError(f"{name} must be a number, not {value!r} ({type(value).__name__}; {where} is a "
                                f"{_REAL_TYPES[field.type]})")
            continue
        limits = _INTEGER_RANGES.get(field.type)
        if limits is None:
            continue
        kind, low, high = limits
        if isinstance(value, bool) or not hasattr(type(value), "__index__"):
            raise TypeError(f"{name} must be an integer, not {value!r} ({type(value).__name__}; {where} is of type "
                            f"{kind})")
        if not low <= operator.index(value) <= high:
            raise ValueError(f"{name} {value} is out of range: it must be an integer from {low} to {high} "
                             f"({where} is of type {kind})")


def _message(message_type: Any, **fields: Any) -> Any:
    """The request message, its number fields checked first (check_numbers)."""
    check_numbers(message_type, **fields)
    return message_type(**fields)


def request_id_or_new(request_id: str | None) -> str:
    """The caller's id, or a fresh one: every attempt of this call (channel retries included) shares it,
    so the server applies a mutating call once however often it is delivered."""
    return str(uuid.uuid4()) if request_id is None else request_id


def dispatch(
    candidates: Iterable[PromptRef | str], *, wait: float, request_id: str | None, timeout: float,
    max_continuations: int | None = None, loaded_weight_version: int | None = None, max_response_bytes: int = 0,
) -> Call[DispatchResult]:
    """Dispatch: candidates are prompt ids or PromptRefs, in preference order. Restored groups kept for
    continuation come first: by default (None) in place of as many candidates, else up to
    `max_continuations` of them on top (0: none), as many as fit `max_response_bytes` (the largest answer this
    client receives). `loaded_weight_version`: what the caller's engine reports loaded (shown by ListWorkers)."""
    if isinstance(candidates, (str, bytes)):
        # A bare string would otherwise be iterated as one candidate per character.
        raise TypeError("candidates must be a list of prompt ids or PromptRefs, not a single string")
    request = _message(
        pacer_pb2.DispatchRequest,
        candidates=[PromptRef.of(c).to_pb() for c in candidates],
        wait_seconds=wait,
        request_id=request_id_or_new(request_id),
        **({} if max_continuations is None else {"max_continuations": max_continuations}),
        loaded_weight_version=loaded_weight_version,
        max_response_bytes=max(0, max_response_bytes),
    )
    return Call("Dispatch", request, call_timeout(timeout, wait), DispatchResult.from_pb)


def keep_alive(prompt_ids: Sequence[str], *, timeout: float, dispatch_seqs: Mapping[str, int] | None = None,
               loaded_weight_version: int | None = None, lease_ids: Sequence[str] = ()) -> Call[KeepAliveResult]:
    """KeepAlive: renewing a lease twice is harmless, so no request id. `dispatch_seqs`: the fences (see submit);
    `loaded_weight_version`: as for dispatch; `lease_ids`: the Collect leases a trainer holds."""
    if isinstance(prompt_ids, (str, bytes)):
        raise TypeError("prompt_ids must be a list of prompt ids, not a single string")
    request = _message(pacer_pb2.KeepAliveRequest, prompt_ids=list(prompt_ids), dispatch_seqs=dispatch_seqs or {},
                       loaded_weight_version=loaded_weight_version, lease_ids=list(lease_ids))
    return Call("KeepAlive", request, timeout, KeepAliveResult.from_pb)


# Bytes a trajectory's fields other than its arrays and payload may take on the wire (ids, status, reward,
# versions, tags), on top of what estimated_submit_bytes counts.
_TRAJECTORY_OVERHEAD_BYTES = 64


def estimated_submit_bytes(trajectories: Sequence[Trajectory]) -> int:
    """What a Submit of these trajectories takes on the wire, from the arrays' and strings' sizes alone
    (len() of each, nothing encoded): 4 bytes per token, logprob and mask value, the payload and metadata."""
    total = 0
    for t in trajectories:
        total += (4 * (len(t.token_ids) + len(t.logprobs) + len(t.loss_mask)) + 12 * len(t.segment_lengths)
                  + len(t.payload or b"") + sum(len(k) + len(v) + 4 for k, v in t.metadata.items())
                  + len(t.trajectory_id) + len(t.prompt_id) + _TRAJECTORY_OVERHEAD_BYTES)
    return total


def submit(trajectories: Sequence[Trajectory], *, request_id: str | None, timeout: float,
           dispatch_seqs: Mapping[str, int] | None = None, max_message_bytes: int | None = None) -> Call[SubmitResult]:
    """Submit: all-or-nothing on the server side. The request is encoded here, arrays straight from their
    buffers (see _wire.EncodedSubmitRequest), so an encoding error surfaces before anything is sent.
    `dispatch_seqs` (prompt id -> the seq of the dispatch the caller holds it under) fences the Submit: a
    group handed out again since is refused (STALE_DISPATCH) instead of taking late trajectories."""
    if isinstance(trajectories, Trajectory):
        raise TypeError("trajectories must be a list of Trajectory, not a single Trajectory")
    if max_message_bytes:
        trajectories = [_trajectory(t) for t in trajectories]
        try:
            size = estimated_submit_bytes(trajectories)
        except (TypeError, AttributeError):  # a field of the wrong type: the encoding below names it
            size = 0
        if size > max_message_bytes:
            raise MessageTooLargeError(len(trajectories), size, max_message_bytes)
    request = _wire.EncodedSubmitRequest((_trajectory(t).encoded_parts() for t in trajectories),
                                         request_id_or_new(request_id), dispatch_seqs)
    return Call("Submit", request, timeout, SubmitResult.from_pb)


def _trajectory(value: Any) -> Trajectory:
    if not isinstance(value, Trajectory):
        raise TypeError(f"Submit takes Trajectory values, not {type(value).__name__}")
    return value


def collect(
    num_groups: int, *, wait: float, allow_partial: bool, request_id: str | None, timeout: float, lease: float = 0.0,
    arrays: ArrayMode = "list", rank: int = 0, world_size: int = 1, token_budget: int = 0,
    trainer_step: int | None = None, max_response_bytes: int = 0, streamed: bool = False,
    release_when_silent: bool = False, held_lease_ids: Sequence[str] = (), named_at_grant: bool = False,
) -> Call[CollectResult]:
    """Collect: a retried Collect must not take a second batch, hence the request id here too. `rank` and
    `world_size` ask for one rank's share of a data-parallel mini-batch; `token_budget` cuts it by tokens. With
    `trainer_step`, the server refuses it unless it is at that step (a trainer restarted from a checkpoint).
    `max_response_bytes`: the largest answer this client receives, so the server cuts the answer to fit.
    `streamed`: through CollectStream, the same answer in messages of a few MiB (received faster when large).
    `release_when_silent`: the lease also ends once this client (its client id) stops heartbeating;
    `held_lease_ids`: the leases it holds, given back to it first if its silence ended them; `named_at_grant`: the
    lease counts as named at its grant (this client reads the answer as it arrives and names the lease from then on)."""
    request = _message(
        pacer_pb2.CollectRequest,
        num_groups=num_groups,
        wait_seconds=wait,
        allow_partial=allow_partial,
        request_id=request_id_or_new(request_id),
        lease_seconds=lease,
        rank=rank,
        world_size=world_size,
        token_budget=token_budget,
        max_response_bytes=max(0, max_response_bytes),
        release_when_silent=release_when_silent,
        held_lease_ids=list(held_lease_ids),
        named_at_grant=named_at_grant,
    )
    if trainer_step is not None:
        check_numbers(pacer_pb2.CollectRequest, trainer_step=trainer_step)
        request.trainer_step = trainer_step
    if streamed:
        return Call("CollectStream", request, call_timeout(timeout, wait),
                    functools.partial(CollectResult.from_stream, arrays_as=arrays))
    return Call("Collect", request, call_timeout(timeout, wait), functools.partial(CollectResult.from_pb, arrays_as=arrays))


def ack(lease_id: str, *, request_id: str | None, timeout: float) -> Call[int]:
    """Ack: consumes a leased Collect's groups for good; the request id makes a retry harmless."""
    request = _message(pacer_pb2.AckRequest, lease_id=lease_id, request_id=request_id_or_new(request_id))
    return Call("Ack", request, timeout, lambda response: response.groups)


def release(lease_id: str, *, request_id: str | None, timeout: float) -> Call[int]:
    """Release: a leased Collect's groups back to the buffer, untrained; the request id makes a retry harmless."""
    request = _message(pacer_pb2.ReleaseRequest, lease_id=lease_id, request_id=request_id_or_new(request_id))
    return Call("Release", request, timeout, lambda response: response.groups)


def reset(
    mode: ResetMode | str | None,
    *,
    wait: float | None,
    resume: bool,
    weight_version: int,
    request_id: str | None,
    timeout: float,
    arrays: ArrayMode = "list",
    max_response_bytes: int = 0,
) -> Call[ResetResult]:
    """Reset: mode "abort", "wait" or None (the server default); wait None leaves wait_seconds absent.
    `max_response_bytes`: the largest answer this client receives; the groups that would not fit stay on the server
    (ResetResult.cut_to_fit, kept_prompt_ids)."""
    request = _message(
        pacer_pb2.ResetRequest,
        mode=ResetMode.parse(mode),
        resume=resume,
        weight_version=weight_version,
        request_id=request_id_or_new(request_id),
        max_response_bytes=max(0, max_response_bytes),
    )
    if wait is not None:
        check_numbers(pacer_pb2.ResetRequest, wait_seconds=wait)
        request.wait_seconds = wait
    # Absent, a Reset waits until every running group is assembled, as long as the server allows
    # (server.max_wait_seconds; server.abort_wait_seconds in ABORT mode): the deadline must not cut that short.
    deadline = call_timeout(timeout, wait) if wait is not None else max(timeout, LONG_POLL_CAP_SECONDS)
    return Call("Reset", request, deadline, functools.partial(ResetResult.from_pb, arrays_as=arrays))


def resume(weight_version: int, *, request_id: str | None, timeout: float) -> Call[ResumeResult]:
    """Resume: a retry must not increment the step twice, hence the request id."""
    request = _message(pacer_pb2.ResumeRequest, weight_version=weight_version, request_id=request_id_or_new(request_id))
    return Call("Resume", request, timeout, ResumeResult.from_pb)


def end_job(mode: ResetMode | str | None, *, wait: float, request_id: str | None,
            timeout: float) -> Call[JobEndReport]:
    """EndJob: ends the job; a retry with the same request id answers the first report."""
    request = _message(pacer_pb2.EndJobRequest, mode=ResetMode.parse(mode), wait_seconds=wait,
                                      request_id=request_id_or_new(request_id))
    return Call("EndJob", request, call_timeout(timeout, wait), JobEndReport.from_pb)


def get_state(*, timeout: float) -> Call[PacerState]:
    """GetState: read-only, no request id."""
    return Call("GetState", pacer_pb2.GetStateRequest(), timeout, PacerState.from_pb)


def checkpoint(*, timeout: float, max_response_bytes: int = 0) -> Call[Checkpoint]:
    """Checkpoint: changes nothing the pacing depends on, so no request id. `max_response_bytes`: the largest
    answer this client receives, so the server refuses a larger checkpoint before counting it taken."""
    return Call("Checkpoint", pacer_pb2.CheckpointRequest(max_response_bytes=max(0, max_response_bytes)), timeout,
                Checkpoint.from_pb)


def restore(blob: bytes, *, request_id: str | None, timeout: float) -> Call[RestoreResult]:
    """Restore: a retry must not restore twice (it would discard what ran since), hence the request id."""
    if not isinstance(blob, (bytes, bytearray, memoryview)):
        raise TypeError(f"restore takes the checkpoint's bytes (or a Checkpoint, or a path), not {type(blob).__name__}")
    request = _message(pacer_pb2.RestoreRequest, checkpoint=bytes(blob), request_id=request_id_or_new(request_id))
    return Call("Restore", request, timeout, RestoreResult.from_pb)


def prompt_cursor(*, timeout: float) -> Call[PromptCursor]:
    """GetPromptCursor: read-only, no request id."""
    return Call("GetPromptCursor", pacer_pb2.GetPromptCursorRequest(), timeout, PromptCursor.from_pb)


def list_workers(client_id: str | None, max_groups_per_worker: int, *, timeout: float) -> Call[list[WorkerHoldings]]:
    """ListWorkers: read-only, no request id."""
    request = _message(pacer_pb2.ListWorkersRequest, client_id=client_id or "",
                       max_groups_per_worker=max_groups_per_worker)
    return Call("ListWorkers", request, timeout, lambda msg: [WorkerHoldings.from_pb(w) for w in msg.workers])


WATCH_METHOD = "WatchControl"


def watch_request() -> pacer_pb2.WatchControlRequest:
    """WatchControl takes no parameters; the stream has no deadline."""
    return pacer_pb2.WatchControlRequest()
