"""The grpc.health.v1 Health/Check call's two messages, encoded by hand: the client needs only grpcio and protobuf."""

from __future__ import annotations

from .protocol import SERVICE

# The full method name, for channel.unary_unary.
HEALTH_CHECK_METHOD = "/grpc.health.v1.Health/Check"
# The service names a coda server's health service answers for (a NOT_FOUND names none of them).
SERVER_SERVICES = ("", "readiness", "liveness", SERVICE)
# HealthCheckResponse.ServingStatus, by number.
SERVING_STATUS = {0: "UNKNOWN", 1: "SERVING", 2: "NOT_SERVING", 3: "SERVICE_UNKNOWN"}

_VARINT, _I64, _LEN, _I32 = 0, 1, 2, 5


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        low, value = value & 0x7F, value >> 7
        if value:
            out.append(low | 0x80)
        else:
            out.append(low)
            return bytes(out)


def _read_varint(data: bytes, at: int) -> tuple[int, int]:
    """The varint at `at` and where the next field starts; ValueError when the message ends inside it."""
    value = shift = 0
    while True:
        if at >= len(data) or shift > 63:
            raise ValueError("a truncated HealthCheckResponse")
        byte = data[at]
        value |= (byte & 0x7F) << shift
        at, shift = at + 1, shift + 7
        if not byte & 0x80:
            return value, at


def encode_request(service: str) -> bytes:
    """HealthCheckRequest{string service = 1}: an empty service (the server as a whole) is the empty message."""
    name = service.encode("utf-8")
    return b"\x0a" + _varint(len(name)) + name if name else b""


def decode_response(data: bytes) -> int:
    """HealthCheckResponse{ServingStatus status = 1}'s status number (0, UNKNOWN, when absent); fields this client
    does not know are skipped, as protobuf does."""
    status, at = 0, 0
    while at < len(data):
        key, at = _read_varint(data, at)
        number, kind = key >> 3, key & 7
        if kind == _VARINT:
            value, at = _read_varint(data, at)
            if number == 1:
                status = value
        elif kind == _LEN:
            length, at = _read_varint(data, at)
            at += length
        elif kind in (_I64, _I32):
            at += 8 if kind == _I64 else 4
        else:
            raise ValueError(f"a HealthCheckResponse field of wire type {kind}, which it never holds")
        if at > len(data):
            raise ValueError("a truncated HealthCheckResponse")
    return status


def unknown_service(service: str) -> str:
    """What a NOT_FOUND answer to Check means: the server answered, and serves no health service of that name."""
    known = ", ".join(f'"{name}"' for name in SERVER_SERVICES)
    return f"{service or '(server)'}: the server knows no health service of that name; it serves: {known}"


def status_name(number: int) -> str:
    """The ServingStatus's name (a number newer than this client as the number itself)."""
    return SERVING_STATUS.get(number, str(number))
