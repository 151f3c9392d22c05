"""Every method's handler as one coroutine, built at registration: observation, admission, the guard, error mapping.

Each of these was a wrapper of its own, a coroutine level per call each: a Dispatch that admits nothing
spent more instructions in them than in the pacer. `RpcHandlers` (the method wrapper server.py registers
every service with, see method_wrapping) builds for each method a single coroutine (an async generator
for a generator method) that, in order:

1. starts the method's observation (observability.MethodObserver: metrics, access log);
2. reads the caller's client id (admission.read_caller) and refuses a malformed one;
3. asks admission (rate limit, room by kind of call), refusing with its status;
4. refuses a request that did not decode (guard.Malformed: the deserializer is guard.safe_deserializer);
5. runs the servicer's method, mapping a core PacerError to its status (the servicer marks its methods with
   `maps_errors`: the handler calls the method under the mark and maps the errors itself, one level fewer);
6. releases the admission slot and ends the observation, however the call ended.

The RolloutPacer methods get the (de)serializers of the RPC table's wire forms first (wire.PassthroughCodec).
Request-streaming methods (reflection) are observed only, as admission and the guard read one request;
synchronous handlers are left as they are. Authentication's refusals are observed only (`observed`): an
unauthenticated call is neither decoded nor admitted.
"""
from __future__ import annotations

import inspect
from typing import Any, Callable, Optional

import grpc

from .admission import Admission, read_caller
from .core.errors import PacerError
from .guard import Malformed, safe_deserializer
from .observability import MethodObserver, RpcObserver
from .service import without_error_mapping
from .status import status_for
from .wire import PassthroughCodec

_MAKERS = {(False, False): grpc.unary_unary_rpc_method_handler, (False, True): grpc.unary_stream_rpc_method_handler,
           (True, False): grpc.stream_unary_rpc_method_handler, (True, True): grpc.stream_stream_rpc_method_handler}


def _behavior(handler: grpc.RpcMethodHandler) -> Callable[..., Any]:
    if handler.request_streaming:
        return handler.stream_stream if handler.response_streaming else handler.stream_unary
    return handler.unary_stream if handler.response_streaming else handler.unary_unary


class RpcHandlers:
    """The method wrapper building each method's one handler from the observer, admission and codec."""

    def __init__(self, observer: RpcObserver, admission: Admission, codec: Optional[PassthroughCodec] = None):
        self._observer = observer
        self._admission = admission
        self._codec = codec

    def wrap(self, method: str, handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
        if self._codec is not None:
            handler = self._codec.wrap(method, handler)
        inner = without_error_mapping(_behavior(handler))
        observer = self._observer.method(method, handler)
        if handler.request_streaming:
            behavior = _observed_only(inner, observer)
        elif inspect.iscoroutinefunction(inner):
            behavior = _unary_request(inner, observer, self._admission.admitter(method), self._admission.bad_client_id)
        elif inspect.isasyncgenfunction(inner):
            behavior = _unary_request_generator(inner, observer, self._admission.admitter(method),
                                                self._admission.bad_client_id)
        else:
            behavior = None
        if behavior is None:  # a synchronous handler (run in a thread by gRPC): left as it is
            return handler
        deserializer = handler.request_deserializer
        if deserializer is not None and not handler.request_streaming:
            deserializer = safe_deserializer(deserializer, method)
        return _MAKERS[(bool(handler.request_streaming), bool(handler.response_streaming))](
            behavior, request_deserializer=deserializer, response_serializer=handler.response_serializer)

    def observed(self, method: str, handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
        """`handler` observed only, its (de)serializers as they are: for refusals made before the request is
        read (authentication's)."""
        behavior = _observed_only(_behavior(handler), self._observer.method(method, handler))
        if behavior is None:
            return handler
        return _MAKERS[(bool(handler.request_streaming), bool(handler.response_streaming))](
            behavior, request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer)


def _refusal(request: Any, caller: str, valid: bool, admit: Optional[Callable[..., Any]],
             bad_client_id: grpc.Status) -> tuple[Optional[grpc.Status], Any]:
    """(the status refusing the call or None, the admission slot taken or None): a malformed client id, then
    admission, then a request that did not decode (steps 2-4 of the module's list)."""
    if not valid:
        return bad_client_id, None
    refusal, limit = admit(request, caller) if admit is not None else (None, None)
    if refusal is None and request.__class__ is Malformed:
        refusal = status_for(request.error)
    return refusal, limit


def _unary_request(inner: Callable[..., Any], observer: MethodObserver, admit: Optional[Callable[..., Any]],
                   bad_client_id: grpc.Status) -> Callable[..., Any]:
    """A unary-request coroutine method (it returns its response, or writes its stream with context.write)."""
    begin, end = observer.begin, observer.end

    async def behavior(request: Any, context: grpc.aio.ServicerContext) -> Any:
        begun = begin(context)
        caller, valid = read_caller(context)
        limit = error = None
        try:
            try:
                refusal, limit = _refusal(request, caller, valid, admit, bad_client_id)
                if refusal is not None:
                    await context.abort_with_status(refusal)
                return await inner(request, context)
            except PacerError as exc:
                await context.abort_with_status(status_for(exc))
        except BaseException as exc:
            error = exc
            raise
        finally:
            if limit is not None:
                limit.in_progress -= 1  # CallLimit.release(), without a call of its own
            end(begun, context, request, error, caller)

    return behavior


def _unary_request_generator(inner: Callable[..., Any], observer: MethodObserver, admit: Optional[Callable[..., Any]],
                             bad_client_id: grpc.Status) -> Callable[..., Any]:
    """A unary-request async generator method (it yields its responses)."""
    begin, end = observer.begin, observer.end

    async def generator(request: Any, context: grpc.aio.ServicerContext) -> Any:
        begun = begin(context)
        caller, valid = read_caller(context)
        limit = error = None
        try:
            try:
                refusal, limit = _refusal(request, caller, valid, admit, bad_client_id)
                if refusal is not None:
                    await context.abort_with_status(refusal)
                async for response in inner(request, context):
                    yield response
            except PacerError as exc:
                await context.abort_with_status(status_for(exc))
        except BaseException as exc:
            error = exc
            raise
        finally:
            if limit is not None:
                limit.in_progress -= 1  # CallLimit.release(), without a call of its own
            end(begun, context, request, error, caller)

    return generator


def _observed_only(inner: Callable[..., Any], observer: MethodObserver) -> Optional[Callable[..., Any]]:
    """Observation alone (request-streaming methods, authentication's refusals); None for a synchronous handler.
    The request (the first, for a request stream) is not read: it is not given to the access log."""
    begin, end = observer.begin, observer.end
    if inspect.isasyncgenfunction(inner):
        async def generator(request: Any, context: grpc.aio.ServicerContext) -> Any:
            begun = begin(context)
            caller = read_caller(context)[0]
            error: Optional[BaseException] = None
            try:
                async for response in inner(request, context):
                    yield response
            except BaseException as exc:
                error = exc
                raise
            finally:
                end(begun, context, None, error, caller)

        return generator
    if not inspect.iscoroutinefunction(inner):
        return None

    async def behavior(request: Any, context: grpc.aio.ServicerContext) -> Any:
        begun = begin(context)
        caller = read_caller(context)[0]
        error: Optional[BaseException] = None
        try:
            return await inner(request, context)
        except BaseException as exc:
            error = exc
            raise
        finally:
            end(begun, context, None, error, caller)

    return behavior
