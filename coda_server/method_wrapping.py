"""Wrapping of gRPC method handlers at registration: each wrapper is built once per method, not per call.

A grpc.aio server interceptor runs a chain of coroutines on every call before the handler even starts.
Observability, admission and the malformed-request guard need nothing from the call that the handler
itself does not see, so they are built into the handlers when the services are registered instead
(rpc_handlers.py): `WrappingRegistrar` stands in for the server in the generated `add_*Servicer_to_server`
functions (and in reflection's `enable_server_reflection`) and hands the server wrapped handlers. Only
authentication stays an interceptor, so that a refused request is never decoded.

The server registers no method by name (`by_name=()`): every service is served through a generic handler (a
dict lookup per call). grpc.aio keeps a task per method registered by name waiting for that method's next
call, and on every call that arrives, whatever its method, waits on all of them again
(`asyncio.wait(FIRST_COMPLETED)`: the task set built, a done callback added and removed on each): each method
registered by name cost every call about 5,500 instructions: the pacer's 15 and health's 3 took 100,000 of a
peek's 625,000 in the live server (bench/live_instructions.py), more than our whole handler chain does.
"""
from __future__ import annotations

from typing import Any, Collection, Optional, Protocol, Sequence

import grpc


class MethodWrapper(Protocol):
    def wrap(self, method: str, handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
        """A handler doing what `handler` does plus this wrapper's part; `method` is '/pkg.Service/Method'."""


class WrappingRegistrar:
    """Registers services on `server` with every method handler wrapped by `wrappers` (outermost first)."""

    def __init__(self, server: Any, wrappers: Sequence[MethodWrapper], by_name: Optional[Collection[str]] = None):
        """`by_name`: the services whose methods are registered by name (see the module's docstring); None: every
        one, as the generated code registers them; the others are served through a generic handler."""
        self._server = server
        self._wrappers = tuple(wrappers)
        self._by_name = None if by_name is None else frozenset(by_name)

    def wrap(self, method: str, handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
        for wrapper in reversed(self._wrappers):
            handler = wrapper.wrap(method, handler)
        return handler

    # The two registration calls generated code makes on a server.

    def add_registered_method_handlers(self, service: str, handlers: dict[str, grpc.RpcMethodHandler]) -> None:
        wrapped = {name: self.wrap(f"/{service}/{name}", handler) for name, handler in handlers.items()}
        if self._by_name is None or service in self._by_name:
            self._server.add_registered_method_handlers(service, wrapped)
        else:
            self._server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service, wrapped),))

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

