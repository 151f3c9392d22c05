"""Request bytes that are not a valid protobuf message answer INVALID_ARGUMENT, saying why.

Without this, grpc.aio answers a request it cannot decode (corrupt wire format, a string field with
invalid UTF-8) with UNKNOWN and a Python exception text. Every unary-request method's handler
(rpc_handlers.py) decodes with `safe_deserializer`: a request that fails to decode becomes a `Malformed`
stand-in, which the handler answers INVALID_ARGUMENT (reason MALFORMED_REQUEST) instead of running the servicer.
"""
from __future__ import annotations

from typing import Any, Callable

from google.protobuf.message import DecodeError

from .core.errors import InvalidArgumentError


class Malformed:
    """Stands in for a request that could not be decoded; `error` says why."""

    __slots__ = ("error",)

    def __init__(self, error: InvalidArgumentError):
        self.error = error


def _message_name(method: str) -> str:
    """'/coda.pacer.v1.RolloutPacer/Submit' -> 'coda.pacer.v1.RolloutPacer/Submit'."""
    return method.lstrip("/")


def safe_deserializer(deserializer: Callable[[bytes], Any], method: str) -> Callable[[bytes], Any]:
    """`deserializer`, answering a `Malformed` instead of raising for bytes that do not decode."""
    def deserialize(data: bytes) -> Any:
        try:
            return deserializer(data)
        except (DecodeError, UnicodeDecodeError, ValueError) as exc:
            detail = str(exc) or type(exc).__name__
            return Malformed(InvalidArgumentError(
                f"the request of {_message_name(method)} is not a valid protobuf message: {detail}",
                violations=[("request", f"could not be decoded: {detail}")], reason="MALFORMED_REQUEST"))

    return deserialize
