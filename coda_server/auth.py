"""Bearer-token authentication: a grpc.aio server interceptor comparing the token in constant time.

The token comes from `server.auth_token_file`, else from `$CODA_TOKEN`; with neither, no token is asked.
It is never logged. Every call must carry the metadata `authorization: Bearer <token>` (what
coda_client.PacerClient(token=...) sends), except grpc.health.v1 (probes carry no token) and server
reflection (only served when server.reflection is on, and it reveals the public .proto only).
"""
from __future__ import annotations

import hashlib
import hmac
import logging
import os
import time
from pathlib import Path
from typing import Any, Awaitable, Callable, Mapping, Optional

import grpc
from google.rpc import code_pb2, error_details_pb2, status_pb2
from grpc_status import rpc_status

from .core.errors import ConfigError
from .status import ERROR_DOMAIN

log = logging.getLogger("coda_server.auth")

TOKEN_ENV = "CODA_TOKEN"
# Methods reachable without a token: health for probes, reflection for tools (when enabled at all).
OPEN_METHOD_PREFIXES = (
    "/grpc.health.v1.Health/",
    "/grpc.reflection.v1alpha.ServerReflection/",
    "/grpc.reflection.v1.ServerReflection/",
)
# Shorter tokens are accepted, with a warning: they can be guessed.
MIN_RECOMMENDED_TOKEN_LENGTH = 16
# Refused calls are logged at most this often (with a count), so a misconfigured client cannot flood the log.
REJECTION_LOG_INTERVAL_SECONDS = 60.0


def load_token(server_config: Any, environ: Mapping[str, str] = os.environ) -> Optional[str]:
    """The configured token (file first, then $CODA_TOKEN), or None when authentication is off.

    Raises ConfigError naming the key (never the token) when the file is unreadable or the token unusable.
    """
    path = str(server_config.get("auth_token_file") or "")
    if path:
        try:
            token = Path(path).read_text(encoding="utf-8").strip()
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError(f"server.auth_token_file = {path!r}: cannot be read ({exc})") from None
        source = f"server.auth_token_file ({path})"
        if not token:
            raise ConfigError(f"server.auth_token_file = {path!r}: the file is empty")
    else:
        token = (environ.get(TOKEN_ENV) or "").strip()
        source = f"${TOKEN_ENV}"
        if not token:
            return None
    # The token travels in an HTTP/2 header value next to "Bearer ": visible ASCII only.
    if not all("!" <= c <= "~" for c in token):
        raise ConfigError(f"the bearer token from {source} must be printable ASCII without spaces "
                          f"({len(token)} characters read; the token itself is not shown)")
    if len(token) < MIN_RECOMMENDED_TOKEN_LENGTH:
        log.warning("the bearer token from %s has only %d characters; use at least %d random ones",
                    source, len(token), MIN_RECOMMENDED_TOKEN_LENGTH)
    log.info("bearer token authentication on (token from %s)", source)
    return token


def _unauthenticated(reason: str, message: str) -> grpc.Status:
    details = status_pb2.Status(code=code_pb2.UNAUTHENTICATED, message=message)
    details.details.add().Pack(error_details_pb2.ErrorInfo(reason=reason, domain=ERROR_DOMAIN))
    return rpc_status.to_status(details)


# Said in gRPC terms first, for a caller in any language; the Python client's form after.
MISSING = ("MISSING_TOKEN", "this server requires a bearer token: send the token as the call metadata "
           "(header) 'authorization: Bearer <token>' on every call (with the Python client: "
           "PacerClient(target, token=...))")
MALFORMED = ("MALFORMED_TOKEN", "the call metadata (header) 'authorization' must be sent once and read "
             "'Bearer <token>'")
WRONG = ("INVALID_TOKEN", "the bearer token in the 'authorization' metadata is not the one this server was "
         "configured with")


class BearerTokenInterceptor(grpc.aio.ServerInterceptor):
    """Lets a call through only with `authorization: Bearer <token>`; answers UNAUTHENTICATED otherwise."""

    def __init__(self, token: str, open_prefixes: tuple[str, ...] = OPEN_METHOD_PREFIXES):
        if not token:
            raise ValueError("an empty token would let everyone in")
        self._expected = hashlib.sha256(token.encode("ascii")).digest()
        self._open_prefixes = open_prefixes
        self._wrap: Callable[[str, grpc.RpcMethodHandler], grpc.RpcMethodHandler] = lambda method, handler: handler
        self._refusals: dict[tuple[str, str], grpc.RpcMethodHandler] = {}
        self.rejected = 0
        self._rejected_since_log = 0
        self._latest_rejection = ("", "")  # (method, reason) of the last refused call
        self._last_log = float("-inf")

    def wrap_refusals(self, wrap: Callable[[str, grpc.RpcMethodHandler], grpc.RpcMethodHandler]) -> None:
        """Build refusal handlers with `wrap(method, handler)` (observation: rpc_handlers.RpcHandlers.observed),
        so refused calls are counted and logged like the others."""
        self._wrap = wrap
        self._refusals.clear()

    def check(self, metadata: Any) -> Optional[tuple[str, str]]:
        """None when the metadata carries the right token, else (reason, message)."""
        values = [value for key, value in (metadata or ()) if key == "authorization"]
        if not values:
            return MISSING
        if len(values) > 1:
            return MALFORMED
        value = values[0].encode("utf-8", "replace") if isinstance(values[0], str) else bytes(values[0])
        scheme, _, presented = value.strip().partition(b" ")
        if scheme.lower() != b"bearer" or not presented.strip():
            return MALFORMED
        # Constant time: digests of equal length compared with compare_digest, so a wrong guess reveals
        # neither how much of it matched nor the token's length.
        if not hmac.compare_digest(hashlib.sha256(presented.strip()).digest(), self._expected):
            return WRONG
        return None

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[Optional[grpc.RpcMethodHandler]]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> Optional[grpc.RpcMethodHandler]:
        method = handler_call_details.method
        if method.startswith(self._open_prefixes):
            return await continuation(handler_call_details)
        problem = self.check(handler_call_details.invocation_metadata)
        handler = await continuation(handler_call_details)
        if problem is None or handler is None:
            return handler
        self._note_rejection(method, problem[0])
        # Built once per method and reason: a flood of refused calls builds nothing.
        key = (method, problem[0])
        refusal = self._refusals.get(key)
        if refusal is None:
            refusal = self._refusals[key] = self._wrap(method, _refusing(handler, _unauthenticated(*problem)))
        return refusal

    def _note_rejection(self, method: str, reason: str) -> None:
        self.rejected += 1
        self._rejected_since_log += 1
        self._latest_rejection = (method, reason)
        now = time.monotonic()
        if now - self._last_log >= REJECTION_LOG_INTERVAL_SECONDS:
            log.warning("refused %d call(s) without a valid token since the last report (latest: %s, %s); "
                        "next report in %.0fs at the earliest", self._rejected_since_log, method, reason,
                        REJECTION_LOG_INTERVAL_SECONDS)
            self._last_log, self._rejected_since_log = now, 0

    def report_pending_refusals(self) -> None:
        """Log the refusals the periodic summary has not reported yet (the server calls it as it stops, so the
        calls refused within the last interval are not lost with the process)."""
        if not self._rejected_since_log:
            return
        method, reason = self._latest_rejection
        log.warning("refused %d call(s) without a valid token since the last report (latest: %s, %s); "
                    "%d in all since start-up; the server is stopping", self._rejected_since_log, method, reason,
                    self.rejected)
        self._last_log, self._rejected_since_log = time.monotonic(), 0


def _ignore_request(_: bytes) -> None:
    """An unauthenticated request is not even decoded."""
    return None


def _refusing(handler: grpc.RpcMethodHandler, status: grpc.Status) -> grpc.RpcMethodHandler:
    """A handler of the same shape as `handler` that answers `status` without running the method."""

    async def unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
        await context.abort_with_status(status)

    async def streaming(request: Any, context: grpc.aio.ServicerContext) -> Any:
        await context.abort_with_status(status)
        yield  # pragma: no cover - makes this an async generator, as streaming handlers are

    serializer = handler.response_serializer
    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(streaming, _ignore_request, serializer)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(unary, _ignore_request, serializer)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(streaming, _ignore_request, serializer)
    return grpc.unary_unary_rpc_method_handler(unary, _ignore_request, serializer)


def token_interceptor(server_config: Any, environ: Mapping[str, str] = os.environ) -> Optional[BearerTokenInterceptor]:
    """The interceptor for the configured token, or None when no token is configured."""
    token = load_token(server_config, environ)
    return BearerTokenInterceptor(token) if token else None
