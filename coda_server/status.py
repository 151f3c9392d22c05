"""Maps the core's typed errors to gRPC status codes with google.rpc rich details."""
from __future__ import annotations

import grpc
from google.protobuf import duration_pb2
from google.rpc import code_pb2, error_details_pb2, status_pb2
from grpc_status import rpc_status

from .core import errors

ERROR_DOMAIN = "coda.pacer.v1"
# The status travels in trailers, which clients refuse beyond 8 KiB (soft) / 16 KiB (hard): a request with
# thousands of bad fields must still get its INVALID_ARGUMENT, so message and violations are bounded.
MAX_MESSAGE_CHARS = 512
MAX_VIOLATIONS = 10
MAX_DESCRIPTION_CHARS = 200

# Most specific class first: StaleGenerationError is a FailedPreconditionError.
_CODES: list[tuple[type, grpc.StatusCode]] = [
    (errors.InvalidArgumentError, grpc.StatusCode.INVALID_ARGUMENT),
    (errors.UnknownPromptError, grpc.StatusCode.NOT_FOUND),
    (errors.UnknownLeaseError, grpc.StatusCode.NOT_FOUND),
    (errors.FailedPreconditionError, grpc.StatusCode.FAILED_PRECONDITION),
    (errors.ResourceExhaustedError, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (errors.ShuttingDownError, grpc.StatusCode.UNAVAILABLE),
    (errors.NotReadyError, grpc.StatusCode.UNAVAILABLE),
]


def code_for(error: errors.PacerError) -> grpc.StatusCode:
    for cls, code in _CODES:
        if isinstance(error, cls):
            return code
    return grpc.StatusCode.INTERNAL


def status_for(error: errors.PacerError) -> grpc.Status:
    """A grpc.Status carrying the message, ErrorInfo(reason), BadRequest field violations and RetryInfo."""
    code = code_for(error)
    details = status_pb2.Status(code=getattr(code_pb2, code.name), message=_clip(error.message, MAX_MESSAGE_CHARS))
    info = error_details_pb2.ErrorInfo(reason=error.reason, domain=ERROR_DOMAIN, metadata=getattr(error, "metadata", None))
    details.details.add().Pack(info)
    if error.violations:
        shown = list(error.violations[:MAX_VIOLATIONS])
        if len(error.violations) > MAX_VIOLATIONS:
            shown.append(("...", f"{len(error.violations) - MAX_VIOLATIONS} more violations not shown"))
        bad_request = error_details_pb2.BadRequest(field_violations=[
            error_details_pb2.BadRequest.FieldViolation(field=_clip(field, MAX_DESCRIPTION_CHARS),
                                                        description=_clip(description, MAX_DESCRIPTION_CHARS))
            for field, description in shown
        ])
        details.details.add().Pack(bad_request)
    retry_after = getattr(error, "retry_after", None)  # a refusal that says when to try again
    if retry_after is not None:
        delay = duration_pb2.Duration()
        delay.FromNanoseconds(int(retry_after * 1e9))
        details.details.add().Pack(error_details_pb2.RetryInfo(retry_delay=delay))
    return rpc_status.to_status(details)


def _clip(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[:limit - 16] + " ... (truncated)"
