"""Wrapping of gRPC method handlers at registration: each wrapper is built once per method, not per call.

A grpc.aio server interceptor runs a chain of coroutines on every call before the handler even starts.
Observability and the malformed-request guard need nothing from the call that the handler itself does
not see, so they wrap the handlers when the services are registered instead: `WrappingRegistrar` stands
in for the server in the generated `add_*Servicer_to_server` functions (and in reflection's
`enable_server_reflection`) and hands the server wrapped handlers. Only authentication stays an
interceptor, so that a refused request is never decoded; it builds its refusal handlers with `wrap()`,
so refused calls are observed like every other call.
"""
from __future__ import annotations

import inspect
from typing import Any, Callable, Optional, Protocol, Sequence

import grpc


class MethodWrapper(Protocol):
    def wrap(self, method: str, handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
        """A handler doing what `handler` does plus this wrapper's part; `method` is '/pkg.Service/Method'."""


class WrappingRegistrar:
    """Registers services on `server` with every method handler wrapped by `wrappers` (outermost first)."""

    def __init__(self, server: Any, wrappers: Sequence[MethodWrapper]):
        self._server = server
        self._wrappers = tuple(wrappers)

    def wrap(self, method: str, handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
        for wrapper in reversed(self._wrappers):
            handler = wrapper.wrap(method, handler)
        return handler

    # The two registration calls generated code makes on a server.

    def add_registered_method_handlers(self, service: str, handlers: dict[str, grpc.RpcMethodHandler]) -> None:
        self._server.add_registered_method_handlers(
            service, {name: self.wrap(f"/{service}/{name}", handler) for name, handler in handlers.items()})

    def add_generic_rpc_handlers(self, generic_handlers: Sequence[grpc.GenericRpcHandler]) -> None:
        self._server.add_generic_rpc_handlers(tuple(_WrappedGenericHandler(self, g) for g in generic_handlers))


class _WrappedGenericHandler(grpc.GenericRpcHandler):
    """A generic handler (used for methods not registered by name) whose answers are wrapped once per method."""

    def __init__(self, registrar: WrappingRegistrar, inner: grpc.GenericRpcHandler):
        self._registrar = registrar
        self._inner = inner
        self._wrapped: dict[str, tuple[grpc.RpcMethodHandler, grpc.RpcMethodHandler]] = {}

    def service(self, handler_call_details: grpc.HandlerCallDetails) -> Optional[grpc.RpcMethodHandler]:
        handler = self._inner.service(handler_call_details)
        if handler is None:
            return None
        method = handler_call_details.method
        cached = self._wrapped.get(method)
        if cached is None or cached[0] is not handler:
            cached = self._wrapped[method] = (handler, self._registrar.wrap(method, handler))
        return cached[1]


# An admission check: (refusal, token). A refusal status ends the call before the handler runs; otherwise
# the token is handed to the release function once the call has ended, however it ended.
Admit = Callable[[Any, grpc.aio.ServicerContext], tuple[Optional[grpc.Status], Any]]


def admitting(handler: grpc.RpcMethodHandler, admit: Admit, release: Optional[Callable[[Any], None]] = None,
              request_deserializer: Optional[Callable[[bytes], Any]] = None) -> grpc.RpcMethodHandler:
    """`handler` with `admit(request, context)` run before it (unary-request methods: the request is decoded
    first), and `release(token)` after it. Request-streaming and synchronous handlers are left as they are.

    `request_deserializer` replaces the handler's own, e.g. with one that never raises.
    """
    if handler.request_streaming:
        return handler
    deserialize = request_deserializer or handler.request_deserializer
    serializer = handler.response_serializer
    inner = handler.unary_stream if handler.response_streaming else handler.unary_unary
    make = grpc.unary_stream_rpc_method_handler if handler.response_streaming else grpc.unary_unary_rpc_method_handler

    if inspect.iscoroutinefunction(inner):  # returns its response, or writes with context.write (a stream)

        async def behavior(request: Any, context: grpc.aio.ServicerContext) -> Any:
            refusal, token = admit(request, context)
            if refusal is not None:
                await context.abort_with_status(refusal)
            try:
                return await inner(request, context)
            finally:
                if release is not None:
                    release(token)

    elif handler.response_streaming and inspect.isasyncgenfunction(inner):  # yields its responses

        async def behavior(request: Any, context: grpc.aio.ServicerContext) -> Any:
            refusal, token = admit(request, context)
            if refusal is not None:
                await context.abort_with_status(refusal)
            try:
                async for response in inner(request, context):
                    yield response
            finally:
                if release is not None:
                    release(token)

    else:  # a synchronous handler: left as it is
        return handler
    return make(behavior, deserialize, serializer)
