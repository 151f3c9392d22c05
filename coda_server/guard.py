"""Request bytes that are not a valid protobuf message answer INVALID_ARGUMENT, saying why.

Without this, grpc.aio answers a request it cannot decode (corrupt wire format, a string field with
invalid UTF-8) with UNKNOWN and a Python exception text. This wrapper (applied at registration, see
method_wrapping) wraps the deserializer of every unary-request method: a request that fails to decode
is answered INVALID_ARGUMENT (reason MALFORMED_REQUEST) instead of reaching the servicer.
"""
from __future__ import annotations

from typing import Any, Callable, Optional

import grpc
from google.protobuf.message import DecodeError

from .core.errors import InvalidArgumentError
from .method_wrapping import admitting
from .status import status_for


class _Malformed:
    """Stands in for a request that could not be decoded."""

    __slots__ = ("error",)

    def __init__(self, error: InvalidArgumentError):
        self.error = error


def _message_name(method: str) -> str:
    """'/coda.pacer.v1.RolloutPacer/Submit' -> 'coda.pacer.v1.RolloutPacer/Submit'."""
    return method.lstrip("/")


def _safe(deserializer: Callable[[bytes], Any], method: str) -> Callable[[bytes], Any]:
    def deserialize(data: bytes) -> Any:
        try:
            return deserializer(data)
        except (DecodeError, UnicodeDecodeError, ValueError) as exc:
            detail = str(exc) or type(exc).__name__
            return _Malformed(InvalidArgumentError(
                f"the request of {_message_name(method)} is not a valid protobuf message: {detail}",
                violations=[("request", f"could not be decoded: {detail}")], reason="MALFORMED_REQUEST"))

    return deserialize


def _refuse_malformed(request: Any, context: grpc.aio.ServicerContext) -> tuple[Optional[grpc.Status], None]:
    return (status_for(request.error) if isinstance(request, _Malformed) else None), None


class MalformedRequestGuard:
    """Answers INVALID_ARGUMENT for a unary request that does not decode (streaming requests pass as they are)."""

    def wrap(self, method: str, handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
        if handler.request_streaming or handler.request_deserializer is None:
            return handler
        return admitting(handler, _refuse_malformed, request_deserializer=_safe(handler.request_deserializer, method))
