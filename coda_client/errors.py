"""The client's exception hierarchy and the translation of grpc.RpcError into it."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from types import MappingProxyType

import grpc

from ._status import STATUS_DETAILS_KEY, FieldViolation, StatusDetails, decode_status
from ._tls import tidy

__all__ = [
    "STALE_GENERATION",
    "NOT_CONNECTED",
    "ERROR_DOMAIN",
    "FieldViolation",
    "PacerClientError",
    "BadRequestError",
    "UnknownPromptError",
    "UnknownLeaseError",
    "FailedPreconditionError",
    "StaleGenerationError",
    "ResourceExhaustedError",
    "UnauthenticatedError",
    "UnavailableError",
    "DeadlineExceededError",
    "MessageTooLargeError",
    "ServerGoneError",
    "refuses_for_now",
    "translate",
]

# google.rpc.ErrorInfo reason for a trajectory whose prompt was dispatched before the last Reset or Restore.
STALE_GENERATION = "STALE_GENERATION"
# google.rpc.ErrorInfo reason for an Ack naming a lease the server does not know.
UNKNOWN_LEASE = "UNKNOWN_LEASE"
# DeadlineExceededError.reason (set by the client, not the server) when a call that waited for ready (wait_for_ready)
# ran out its deadline without a connection to any server: nothing was sent; its message says why, as the
# UnavailableError of a client that does not wait would (nothing listens, not a gRPC server, an untrusted certificate).
NOT_CONNECTED = "NOT_CONNECTED"
# google.rpc.ErrorInfo domain the server uses.
ERROR_DOMAIN = "coda.pacer.v1"


class PacerClientError(Exception):
    """A failed pacer call: the gRPC code, the server's message and the decoded status details."""

    def __init__(
        self,
        code: grpc.StatusCode,
        details: str = "",
        *,
        field_violations: tuple[FieldViolation, ...] = (),
        reason: str = "",
        domain: str = "",
        metadata: Mapping[str, str] | None = None,
        retry_delay: float | None = None,
    ) -> None:
        self.code = code
        self.details = details
        self.field_violations = tuple(field_violations)
        self.reason = reason
        self.domain = domain
        self.metadata = MappingProxyType(dict(metadata or {}))
        self.retry_delay = retry_delay
        super().__init__(self._describe())

    def _describe(self) -> str:
        """One line for logs: code, message, then the violations or the reason."""
        text = f"{self.code.name}: {self.details}" if self.details else self.code.name
        if self.field_violations:
            text += " [" + "; ".join(f"{v.field}: {v.description}" for v in self.field_violations) + "]"
        if self.reason:
            text += f" (reason {self.reason})"
        return text


class BadRequestError(PacerClientError):
    """INVALID_ARGUMENT: malformed request, bad value, or a known id with different content."""


class UnknownPromptError(PacerClientError):
    """NOT_FOUND: a trajectory for a prompt that was never dispatched (UnknownLeaseError: an unknown lease)."""


class UnknownLeaseError(UnknownPromptError):
    """NOT_FOUND with reason UNKNOWN_LEASE: an Ack names a lease never granted, or one already acknowledged. A
    subclass of UnknownPromptError, which caught every NOT_FOUND before it existed."""


class FailedPreconditionError(PacerClientError):
    """FAILED_PRECONDITION: the call conflicts with the pacer's state (e.g. a Reset is already running)."""


class StaleGenerationError(FailedPreconditionError):
    """FAILED_PRECONDITION with reason STALE_GENERATION: the prompt was dispatched before the last Reset or Restore."""


class MessageTooLargeError(BadRequestError):
    """A Submit larger than the client's max_message_bytes, refused before it is encoded (nothing was sent):
    split it, or raise max_message_bytes (and the server's server.max_message_bytes)."""

    def __init__(self, trajectories: int, size: int, limit: int) -> None:
        super().__init__(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"a Submit of {trajectories} trajectories takes about {size} bytes, more than max_message_bytes "
            f"({limit}) lets one message carry; nothing was sent. Submit them in several calls, or raise "
            f"max_message_bytes (PacerClient(..., max_message_bytes=...)) and the server's "
            f"server.max_message_bytes",
            field_violations=(FieldViolation("trajectories", f"about {size} bytes; max_message_bytes is {limit}"),),
            reason="MESSAGE_TOO_LARGE", metadata={"limit": "max_message_bytes", "value": str(limit)})


class ResourceExhaustedError(PacerClientError):
    """RESOURCE_EXHAUSTED: a buffer or byte cap is full; retry after `retry_delay` seconds (None: unknown)."""


class UnauthenticatedError(PacerClientError):
    """UNAUTHENTICATED: missing or wrong bearer token."""


class UnavailableError(PacerClientError):
    """UNAVAILABLE: the server is unreachable or shutting down (after the channel's own retries)."""


class ServerGoneError(UnavailableError):
    """The server announced SHUTDOWN or could not be reached, and no server answered again on the address
    within the waiting call's bound (e.g. the batch iterator's `reconnect` seconds); nothing more was done."""

    def __init__(self, details: str) -> None:
        super().__init__(grpc.StatusCode.UNAVAILABLE, details, reason="SERVER_GONE")


class DeadlineExceededError(PacerClientError):
    """DEADLINE_EXCEEDED: no answer in time; with wait_for_ready=True, also a server that never became reachable:
    then `reason` is NOT_CONNECTED and the message says why the client could not connect."""


_BY_CODE: dict[grpc.StatusCode, type[PacerClientError]] = {
    grpc.StatusCode.INVALID_ARGUMENT: BadRequestError,
    grpc.StatusCode.NOT_FOUND: UnknownPromptError,
    grpc.StatusCode.FAILED_PRECONDITION: FailedPreconditionError,
    grpc.StatusCode.RESOURCE_EXHAUSTED: ResourceExhaustedError,
    grpc.StatusCode.UNAUTHENTICATED: UnauthenticatedError,
    grpc.StatusCode.UNAVAILABLE: UnavailableError,
    grpc.StatusCode.DEADLINE_EXCEEDED: DeadlineExceededError,
}


def _status_details(rpc_error: grpc.RpcError) -> StatusDetails:
    """Decodes the grpc-status-details-bin trailer; missing or malformed details read as empty."""
    trailing = getattr(rpc_error, "trailing_metadata", None)
    try:
        for key, value in (trailing() if callable(trailing) else None) or ():
            if key == STATUS_DETAILS_KEY and isinstance(value, bytes):
                return decode_status(value)
    except ValueError:
        # Details are a best-effort extra: a garbled trailer must not hide the real error code.
        pass
    return StatusDetails()


def refuses_for_now(error: object) -> bool:
    """Whether `error` is the server, up, refusing calls for now for a reason of its own (UNAVAILABLE with a reason:
    its state directory cannot be written, it is still recovering), which is said apart from a server away or
    shutting down (no reason, or SHUTTING_DOWN): a control stream stays open through it."""
    return (isinstance(error, PacerClientError) and error.code == grpc.StatusCode.UNAVAILABLE and bool(error.reason)
            and error.reason != "SHUTTING_DOWN")


def translate(rpc_error: grpc.RpcError, target: str | None = None, waited_for_ready: bool = False,
              explain: Callable[[str], str | None] | None = None) -> PacerClientError:
    """Maps a grpc.RpcError (sync or grpc.aio) to the most specific PacerClientError subclass. With `target`, an
    UNAVAILABLE or DEADLINE_EXCEEDED the server did not send (nothing reachable there, or no answer) names where
    the call was sent, and an UNIMPLEMENTED says the server there has no such method; `waited_for_ready`: the call
    waited for a server to be reachable there (wait_for_ready), so a deadline may also mean that none ever was;
    `explain`: given such an UNAVAILABLE's message, the likely cause and fix to add (the client's TLS settings
    read against gRPC's connection error), or None."""
    code_fn = getattr(rpc_error, "code", None)
    code = code_fn() if callable(code_fn) else None
    if not isinstance(code, grpc.StatusCode):
        code = grpc.StatusCode.UNKNOWN
    details_fn = getattr(rpc_error, "details", None)
    status = _status_details(rpc_error)
    message = (details_fn() if callable(details_fn) else None) or status.message
    cls = _BY_CODE.get(code, PacerClientError)
    if cls is FailedPreconditionError and status.reason == STALE_GENERATION:
        cls = StaleGenerationError
    elif cls is UnknownPromptError and status.reason == UNKNOWN_LEASE:
        cls = UnknownLeaseError
    if cls is ResourceExhaustedError and not status.reason and "larger than max" in (message or ""):
        # gRPC's own refusal of a message over a limit ("Received message larger than max (N vs. M)"): no reason,
        # no retry delay; a retry fails alike.
        if "CLIENT: Received message larger than max" in message:  # this client refused the answer: the server answered, the caller got none
            message = (f"the answer is larger than this client takes ({message}): this client's limit is its "
                       f"max_message_bytes; raise it, or ask for less per call (ListWorkers: max_groups_per_worker)")
        else:  # the server refused the request, before any handler ran
            message = (f"the request is larger than the server takes ({message}): the server's limit is its "
                       f"server.max_message_bytes; send less per call (a Submit: fewer or shorter trajectories) or "
                       f"raise that limit, and the client's max_message_bytes with it (it refuses such a call before "
                       f"sending)")
    elif cls is UnavailableError and target and not status.reason:
        message = f"cannot reach the pacer at {target}: {tidy(message or '')}"
        hint = explain(message) if explain is not None else None
        if hint:
            message = f"{message.rstrip('.')}; {hint}"
    elif (code == grpc.StatusCode.UNIMPLEMENTED and target and not status.reason
          and "Method not found" in (message or "")):
        # gRPC's own answer for a service the server does not have: not a pacer, or one older than this call.
        message = (f"the server at {target} does not serve this call of coda.pacer.v1.RolloutPacer ({message}): it "
                   f"is not a coda pacer (e.g. the pacer's health-only port, server.health_address; the pacer "
                   f"listens on server.address), or a pacer older than this client")
    elif cls is DeadlineExceededError and target and not status.reason:
        waited = (" (or no server reachable there all along: the call waited for one, wait_for_ready=True)"
                  if waited_for_ready else "")
        message = f"no answer in time from the pacer at {target}{waited}: {message}"
    return cls(
        code,
        message,
        field_violations=status.field_violations,
        reason=status.reason,
        domain=status.domain,
        metadata=status.metadata,
        retry_delay=status.retry_delay,
    )
