"""A minimal protobuf wire-format reader for google.rpc.Status and the three error details we use."""

# Why hand-written: the google.rpc protos ship in googleapis-common-protos, which the client must not
# depend on, and vendoring copies of them would register `google/rpc/*.proto` a second time in the
# default descriptor pool of a process that also loads the real ones (the server, via grpcio-status).
# Only the fields below are read; everything else is skipped, as protobuf parsers do.

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

# Trailing-metadata key under which gRPC servers send a serialized google.rpc.Status.
STATUS_DETAILS_KEY = "grpc-status-details-bin"

_VARINT, _I64, _LEN, _I32 = 0, 1, 2, 5
_BAD_REQUEST = "google.rpc.BadRequest"
_ERROR_INFO = "google.rpc.ErrorInfo"
_RETRY_INFO = "google.rpc.RetryInfo"


@dataclass(frozen=True)
class FieldViolation:
    """One google.rpc.BadRequest.FieldViolation: the offending field path and what is wrong with it."""

    field: str
    description: str


@dataclass(frozen=True)
class StatusDetails:
    """What the client reads from a google.rpc.Status: code, message and the known detail messages."""

    code: int = 0
    message: str = ""
    field_violations: tuple[FieldViolation, ...] = ()
    reason: str = ""
    domain: str = ""
    metadata: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))
    retry_delay: float | None = None


def _read_varint(data: bytes, pos: int) -> tuple[int, int]:
    """Decodes a base-128 varint at pos; returns (value, next position)."""
    result = shift = 0
    while True:
        if pos >= len(data):
            raise ValueError("truncated varint")
        byte = data[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return result, pos
        shift += 7
        if shift >= 70:
            raise ValueError("varint longer than 10 bytes")


def _signed64(value: int) -> int:
    """Reinterprets a varint as two's-complement int64 (negative int32/int64 use 10-byte varints)."""
    return value - (1 << 64) if value >= 1 << 63 else value


def iter_fields(data: bytes) -> Iterator[tuple[int, int, int | bytes]]:
    """Yields (field number, wire type, value) for each field; value is an int for varints, else bytes."""
    pos, end = 0, len(data)
    while pos < end:
        key, pos = _read_varint(data, pos)
        number, wire_type = key >> 3, key & 7
        if number == 0:
            raise ValueError("field number 0")
        if wire_type == _VARINT:
            value, pos = _read_varint(data, pos)
            yield number, wire_type, value
            continue
        if wire_type == _LEN:
            size, pos = _read_varint(data, pos)
        elif wire_type in (_I64, _I32):
            size = 8 if wire_type == _I64 else 4
        else:  # groups (3, 4) are proto2-only and never appear in these messages
            raise ValueError(f"unsupported wire type {wire_type}")
        if pos + size > end:
            raise ValueError("truncated field")
        yield number, wire_type, data[pos : pos + size]
        pos += size


def _strings(data: bytes, wanted: Mapping[int, str]) -> dict[str, str]:
    """Reads the length-delimited string fields named in wanted (number -> name); last one wins."""
    out = dict.fromkeys(wanted.values(), "")
    for number, wire_type, value in iter_fields(data):
        if number in wanted and wire_type == _LEN:
            out[wanted[number]] = bytes(value).decode("utf-8", "replace")
    return out


def _field_violations(data: bytes) -> list[FieldViolation]:
    """BadRequest: repeated FieldViolation field_violations = 1 {string field = 1; string description = 2}."""
    return [
        FieldViolation(**_strings(value, {1: "field", 2: "description"}))
        for number, wire_type, value in iter_fields(data)
        if number == 1 and wire_type == _LEN
    ]


def _error_info(data: bytes) -> tuple[str, str, dict[str, str]]:
    """ErrorInfo: string reason = 1; string domain = 2; map<string, string> metadata = 3."""
    head = _strings(data, {1: "reason", 2: "domain"})
    metadata = {}
    for number, wire_type, value in iter_fields(data):
        if number == 3 and wire_type == _LEN:
            entry = _strings(value, {1: "key", 2: "value"})
            metadata[entry["key"]] = entry["value"]
    return head["reason"], head["domain"], metadata


def _retry_delay(data: bytes) -> float | None:
    """RetryInfo: Duration retry_delay = 1 {int64 seconds = 1; int32 nanos = 2}, in seconds."""
    delay = None
    for number, wire_type, value in iter_fields(data):
        if number == 1 and wire_type == _LEN:
            seconds = nanos = 0
            for sub_number, sub_type, sub_value in iter_fields(value):
                if sub_type == _VARINT and sub_number == 1:
                    seconds = _signed64(sub_value)
                elif sub_type == _VARINT and sub_number == 2:
                    nanos = _signed64(sub_value)
            delay = seconds + nanos / 1e9
    return delay


def decode_status(data: bytes) -> StatusDetails:
    """Decodes a serialized google.rpc.Status; raises ValueError on malformed bytes.

    Status: int32 code = 1; string message = 2; repeated Any details = 3 {string type_url = 1; bytes value = 2}.
    Details of other types are ignored; BadRequest violations accumulate, ErrorInfo and RetryInfo: first wins.
    """
    code, message = 0, ""
    violations: list[FieldViolation] = []
    info: tuple[str, str, dict[str, str]] | None = None
    delay: float | None = None
    for number, wire_type, value in iter_fields(data):
        if number == 1 and wire_type == _VARINT:
            code = _signed64(value)
        elif number == 2 and wire_type == _LEN:
            message = bytes(value).decode("utf-8", "replace")
        elif number == 3 and wire_type == _LEN:
            any_fields = {1: b"", 2: b""}
            for sub_number, sub_type, sub_value in iter_fields(value):
                if sub_number in any_fields and sub_type == _LEN:
                    any_fields[sub_number] = sub_value
            type_name = bytes(any_fields[1]).decode("utf-8", "replace").rsplit("/", 1)[-1]
            payload = bytes(any_fields[2])
            if type_name == _BAD_REQUEST:
                violations.extend(_field_violations(payload))
            elif type_name == _ERROR_INFO and info is None:
                info = _error_info(payload)
            elif type_name == _RETRY_INFO and delay is None:
                delay = _retry_delay(payload)
    reason, domain, metadata = info if info is not None else ("", "", {})
    return StatusDetails(
        code=code,
        message=message,
        field_violations=tuple(violations),
        reason=reason,
        domain=domain,
        metadata=MappingProxyType(metadata),
        retry_delay=delay,
    )
