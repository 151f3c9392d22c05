"""The RolloutPacer servicer: converts messages, delegates to the AsyncPacer, maps errors to status codes.

Submit requests and Dispatch, Collect and Reset answers are pass-through views (wire.py), WatchControl
events are written as bytes encoded once per event; server.py registers the service with their
(de)serializers."""
from __future__ import annotations

import asyncio
import dataclasses
import functools
import inspect
import math
import types
from typing import Any, AsyncIterator, Callable, Optional

import grpc

from coda_client._proto import pacer_pb2 as pb
from coda_client.protocol import CLIENT_ID_PATTERN, CLIENT_ID_RULE
from coda_client._proto import pacer_pb2_grpc

from . import convert, wire
from .admission import client_id
from .core.async_pacer import AsyncPacer
from .core.errors import InvalidArgumentError, PacerError
from .core.types import CollectResult, ControlEvent
from .status import status_for

# Answer a long-poll this long before the caller's deadline, so the answer arrives in time.
DEADLINE_MARGIN_SECONDS = 0.05


def maps_errors(method: Callable[..., Any]) -> Callable[..., Any]:
    """Turn a core PacerError into the status code of the architecture's table, with rich details.

    Wraps unary handlers (coroutines) and streaming ones (async generators) alike; every RPC method of
    the servicer must carry it (tests/test_service_status.py checks). The registered handlers run the method
    under it and map the errors themselves (rpc_handlers.py); the mark keeps direct calls mapped too."""
    if inspect.isasyncgenfunction(method):
        @functools.wraps(method)
        async def stream(self, request, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            try:
                async for response in method(self, request, context):
                    yield response
            except PacerError as error:
                await context.abort_with_status(status_for(error))

        stream.maps_errors = True  # type: ignore[attr-defined]
        return stream

    @functools.wraps(method)
    async def wrapper(self, request, context: grpc.aio.ServicerContext):
        try:
            return await method(self, request, context)
        except PacerError as error:
            await context.abort_with_status(status_for(error))

    wrapper.maps_errors = True  # type: ignore[attr-defined]
    return wrapper


def without_error_mapping(method: Callable[..., Any]) -> Callable[..., Any]:
    """The servicer method under `maps_errors`, bound to the same servicer, for a caller that maps PacerError
    itself (each method's handler does, rpc_handlers.py: a coroutine level fewer per call); any other
    callable as it is."""
    servicer = getattr(method, "__self__", None)
    if servicer is None or not getattr(method, "maps_errors", False):
        return method
    return types.MethodType(method.__wrapped__, servicer)


def bounded_wait(requested: float, context: grpc.aio.ServicerContext) -> float:
    """The request's wait, no longer than the call's own deadline allows."""
    if requested == 0:  # the usual call, which does not wait: no deadline to consult
        return 0.0
    if not math.isfinite(requested) or requested < 0:
        raise InvalidArgumentError(f"wait_seconds {requested!r} must be a finite number >= 0",
                                   violations=[("wait_seconds", "must be a finite number >= 0")])
    remaining = context.time_remaining()
    if remaining is not None:
        requested = min(requested, max(0.0, remaining - DEADLINE_MARGIN_SECONDS))
    return requested


class RolloutPacerServicer(pacer_pb2_grpc.RolloutPacerServicer):
    def __init__(self, pacer: AsyncPacer, max_message_bytes: int = 64 * 1024 * 1024):
        self._pacer = pacer
        self._codec = convert.ProtoTrajectories()  # checkpoint blobs hold trajectories as their wire bytes
        self._max_message_bytes = max_message_bytes
        self._last_event: Optional[ControlEvent] = None
        self._last_encoded = b""
        self._state_answers = convert.StateAnswers()  # the last GetState answer, sent again while nothing changed

    @maps_errors
    async def Dispatch(self, request: pb.DispatchRequest, context) -> wire.DispatchResponse:
        caller = client_id(context)
        if caller:
            self._pacer.heard_from(caller)
            if request.HasField("loaded_weight_version"):
                self._pacer.note_loaded_version(caller, request.loaded_weight_version)
        # The usual calls, a peek (no candidates) and a call that does not wait, skip the calls they do not need.
        candidates, wait = request.candidates, request.wait_seconds
        result = await self._pacer.dispatch(convert.prompt_refs(candidates) if candidates else [],
                                            bounded_wait(wait, context) if wait else 0.0, request.request_id,
                                            caller,
                                            request.max_continuations if request.HasField("max_continuations") else None,
                                            request.max_response_bytes)
        return convert.dispatch_response(result)

    @maps_errors
    async def KeepAlive(self, request: pb.KeepAliveRequest, context) -> pb.KeepAliveResponse:
        caller = client_id(context)
        self._pacer.heard_from(caller, request.lease_ids)  # the worker's (or trainer's) heartbeat
        if request.HasField("loaded_weight_version"):
            self._pacer.note_loaded_version(caller, request.loaded_weight_version)
        return convert.keep_alive_response(self._pacer.keep_alive(list(request.prompt_ids),
                                                                  dict(request.dispatch_seqs), list(request.lease_ids)))

    @maps_errors
    async def Submit(self, request: wire.ParsedSubmit, context) -> pb.SubmitResponse:
        self._pacer.heard_from(client_id(context))
        result = await self._pacer.submit(convert.trajectories(request.trajectories),
                                          request.request_id, request.dispatch_seqs)
        return convert.submit_response(result)

    @maps_errors
    async def Collect(self, request: pb.CollectRequest, context) -> wire.EncodedAnswer:
        return convert.collect_response(await self._collect(request, context))

    @maps_errors
    async def CollectStream(self, request: pb.CollectRequest, context) -> AsyncIterator[wire.EncodedAnswer]:
        for message in convert.collect_stream(await self._collect(request, context)):
            yield message

    async def _collect(self, request: pb.CollectRequest, context) -> CollectResult:
        caller = client_id(context)
        self._pacer.heard_from(caller, request.held_lease_ids)
        return await self._pacer.collect(request.num_groups, bounded_wait(request.wait_seconds, context),
                                         request.allow_partial, request.request_id, request.lease_seconds,
                                         convert.batch_shape(request),
                                         request.trainer_step if request.HasField("trainer_step") else None,
                                         request.max_response_bytes, convert.lease_holder(request, caller),
                                         request.named_at_grant)

    @maps_errors
    async def Ack(self, request: pb.AckRequest, context) -> pb.AckResponse:
        self._pacer.heard_from(client_id(context), (request.lease_id,), all_held=False)
        return pb.AckResponse(groups=await self._pacer.ack(request.lease_id, request.request_id))

    @maps_errors
    async def Release(self, request: pb.ReleaseRequest, context) -> pb.ReleaseResponse:
        self._pacer.heard_from(client_id(context))
        return pb.ReleaseResponse(groups=await self._pacer.release(request.lease_id, request.request_id))

    @maps_errors
    async def Reset(self, request: pb.ResetRequest, context) -> wire.EncodedAnswer:
        # wait_seconds absent is not 0: the Reset then waits until every running group is assembled (in ABORT
        # mode within server.abort_wait_seconds), within what the call's deadline allows.
        wait = bounded_wait(request.wait_seconds, context) if request.HasField("wait_seconds") else None
        result = await self._pacer.reset(convert.reset_mode(request.mode), wait,
                                         request.resume, request.weight_version if request.resume else None,
                                         request.request_id,
                                         until_assembled=bounded_wait(self._pacer.max_wait_seconds, context),
                                         max_response_bytes=request.max_response_bytes)
        return convert.reset_response(result)

    @maps_errors
    async def Resume(self, request: pb.ResumeRequest, context) -> pb.ResumeResponse:
        result = await self._pacer.resume(request.weight_version, request.request_id)
        return convert.resume_response(result)

    @maps_errors
    async def GetState(self, request: pb.GetStateRequest, context) -> convert.Serialized:
        return self._state_answers.answer(self._pacer.read_state(), self._pacer.state_of)

    @maps_errors
    async def ListWorkers(self, request: pb.ListWorkersRequest, context) -> pb.ListWorkersResponse:
        wanted = request.client_id
        if wanted and not CLIENT_ID_PATTERN.fullmatch(wanted):
            raise InvalidArgumentError(f"client_id {wanted[:140]!r} is not a valid client id: {CLIENT_ID_RULE}",
                                       violations=[("client_id", CLIENT_ID_RULE)])
        loaded = {c: v for c, v in self._pacer.loaded_versions().items() if not wanted or c == wanted}
        return convert.list_workers_response(self._pacer.held_groups(wanted or None), request.max_groups_per_worker,
                                             loaded, self._pacer.held_leases(wanted or None),
                                             self._pacer.worker_contact)

    @maps_errors
    async def Checkpoint(self, request: pb.CheckpointRequest, context) -> bytes:
        # Encoded off the event loop, blob and answer at once (the RPC table sends the answer as these bytes).
        return await self._pacer.checkpoint(
            lambda checkpoint: convert.checkpoint_response(checkpoint, self._codec, self._max_message_bytes,
                                                          request.max_response_bytes))

    @maps_errors
    async def Restore(self, request: pb.RestoreRequest, context) -> pb.RestoreResponse:
        result = await self._pacer.restore(request.checkpoint, self._codec, request.request_id)
        return pb.RestoreResponse(**dataclasses.asdict(result))

    @maps_errors
    async def GetPromptCursor(self, request: pb.GetPromptCursorRequest, context) -> pb.PromptCursor:
        return convert.prompt_cursor(self._pacer.prompt_cursor())

    @maps_errors
    async def EndJob(self, request: pb.EndJobRequest, context) -> pb.EndJobResponse:
        report = await self._pacer.end_job(convert.reset_mode(request.mode, "EndJob"),
                                           bounded_wait(request.wait_seconds, context), request.request_id)
        return convert.end_job_response(report)

    @maps_errors
    async def WatchControl(self, request: pb.WatchControlRequest, context) -> None:
        # Written with context.write (not yielded), so that a watcher the fan-out drops while its write is
        # stuck (the client stopped reading) can still be ended with a status: its task is cancelled.
        caller = client_id(context)
        watcher = self._pacer.open_watch(caller)
        try:
            async for event in watcher:
                await context.write(self._encoded(event))
        except asyncio.CancelledError:
            if not watcher.dropped:  # the client went away
                raise
            # Not abort(): it awaits the status being sent, which queues behind the write the client does not
            # take. Set it and return: the stream's resources (and its admission slot) are released now, and
            # gRPC sends the status once the client reads or goes away.
            status = status_for(watcher.too_slow())
            context.set_code(status.code)
            context.set_details(status.details)
            context.set_trailing_metadata(status.trailing_metadata)
        finally:
            self._pacer.close_watch(watcher, caller)

    def _encoded(self, event: ControlEvent) -> bytes:
        """The event's wire bytes; every watcher is handed the same event object, so it is encoded once."""
        if event is not self._last_event:
            self._last_event, self._last_encoded = event, convert.control_event(event).SerializeToString()
        return self._last_encoded
