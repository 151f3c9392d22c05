"""The wire forms of trajectories that skip per-number work, shared by the client and the server.

- Views: the messages that carry trajectories, derived from pacer.proto's descriptors, differing in one
  respect: in `Trajectory` each packed numeric array is one `bytes` field holding its packed run, and the
  metadata map is `repeated bytes`, under the same field numbers; a view serializes to the bytes the real
  message would. The server parses Submit requests into them (coda_server/wire.py).
- Framing: `fields` and `split_message` read a message's framing only, so the client takes the arrays of a
  Collect or Reset answer as slices of the received bytes (NumPy views over them) and decodes the rest.
- Writing: `encode_trajectory` and `EncodedSubmitRequest` join a Submit request straight from the arrays'
  buffers.
"""
from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from typing import Any

from google.protobuf import descriptor_pb2, descriptor_pool, message_factory
from google.protobuf.descriptor import FieldDescriptor

from ._proto import pacer_pb2

VIEW_PACKAGE = "coda.pacer.v1.passthrough"
_TRAJECTORY = pacer_pb2.Trajectory.DESCRIPTOR


def _derive_views() -> dict[str, Any]:
    source = descriptor_pb2.FileDescriptorProto()
    pacer_pb2.DESCRIPTOR.CopyToProto(source)
    original_prefix, view_prefix = f".{source.package}.", f".{VIEW_PACKAGE}."
    view = descriptor_pb2.FileDescriptorProto(name="coda/pacer/v1/passthrough.proto", package=VIEW_PACKAGE,
                                              syntax=source.syntax, dependency=source.dependency)
    view.enum_type.extend(source.enum_type)
    view.message_type.extend(source.message_type)
    for message in view.message_type:
        for field in message.field:
            if field.type_name.startswith(original_prefix):
                field.type_name = view_prefix + field.type_name[len(original_prefix):]
        if message.name == "Trajectory":
            for field in message.field:
                if field.label != descriptor_pb2.FieldDescriptorProto.LABEL_REPEATED:
                    continue
                if field.type == descriptor_pb2.FieldDescriptorProto.TYPE_MESSAGE:  # the map: raw entries
                    field.ClearField("type_name")
                else:  # a packed array: its one run
                    field.label = descriptor_pb2.FieldDescriptorProto.LABEL_OPTIONAL
                    field.ClearField("options")  # `packed` applies to numbers only
                field.type = descriptor_pb2.FieldDescriptorProto.TYPE_BYTES
            # A retired field number still present in a message (a sender built from an older proto) is
            # caught as a run of its own, so the server can refuse it by name instead of passing it on.
            for start, end in [(r.start, r.end) for r in message.reserved_range]:
                for number in range(start, end):
                    message.field.add(name=f"retired_{number}", number=number,
                                      type=descriptor_pb2.FieldDescriptorProto.TYPE_BYTES,
                                      label=descriptor_pb2.FieldDescriptorProto.LABEL_OPTIONAL)
            message.ClearField("reserved_range")
    pool = descriptor_pool.DescriptorPool()
    for dependency in source.dependency:  # none today; kept so a future import does not break this
        dependency_proto = descriptor_pb2.FileDescriptorProto()
        descriptor_pool.Default().FindFileByName(dependency).CopyToProto(dependency_proto)
        pool.Add(dependency_proto)
    pool.Add(view)
    classes = message_factory.GetMessageClassesForFiles([view.name], pool)
    return {message.name: classes[f"{VIEW_PACKAGE}.{message.name}"] for message in view.message_type}


VIEWS = _derive_views()
Trajectory = VIEWS["Trajectory"]
TrajectoryGroup = VIEWS["TrajectoryGroup"]
SubmitRequest = VIEWS["SubmitRequest"]
CollectResponse = VIEWS["CollectResponse"]
ResetResponse = VIEWS["ResetResponse"]
StepReport = VIEWS["StepReport"]

# The trajectory's numeric arrays, as the proto declares them: name -> field descriptor.
ARRAY_FIELDS: dict[str, FieldDescriptor] = {
    f.name: f for f in _TRAJECTORY.fields
    if f.is_repeated and f.type != FieldDescriptor.TYPE_MESSAGE
}
RETIRED_FIELDS: tuple[str, ...] = tuple(
    f.name for f in Trajectory.DESCRIPTOR.fields if f.name.startswith("retired_"))
# Little-endian NumPy dtype of each fixed-width field type (protobuf writes fixed-width numbers little-endian).
FIXED_DTYPES = {FieldDescriptor.TYPE_SFIXED32: "<i4", FieldDescriptor.TYPE_FIXED32: "<u4",
                FieldDescriptor.TYPE_FLOAT: "<f4", FieldDescriptor.TYPE_SFIXED64: "<i8",
                FieldDescriptor.TYPE_FIXED64: "<u8", FieldDescriptor.TYPE_DOUBLE: "<f8"}


# pacer.proto declares every trajectory array fixed-width (see its Trajectory comment); the code that
# views them relies on it.
assert all(f.type in FIXED_DTYPES for f in ARRAY_FIELDS.values()), "a trajectory array is not fixed-width"
DTYPES: dict[str, str] = {name: FIXED_DTYPES[f.type] for name, f in ARRAY_FIELDS.items()}
ITEM_SIZES: dict[str, int] = {name: int(dtype[2:]) for name, dtype in DTYPES.items()}


def varint(value: int) -> bytes:
    """The base-128 varint encoding of a non-negative integer."""
    # Sizes of fields (one per trajectory and group in every Submit and Collect) are mostly below 2**21.
    if value < 0x80:
        return _ONE_BYTE[value]
    if value < 0x4000:
        return bytes((value & 0x7F | 0x80, value >> 7))
    if value < 0x200000:
        return bytes((value & 0x7F | 0x80, value >> 7 & 0x7F | 0x80, value >> 14))
    out = bytearray()
    while True:
        byte, value = value & 0x7F, value >> 7
        out.append(byte | (0x80 if value else 0))
        if not value:
            return bytes(out)


_ONE_BYTE = [bytes((value,)) for value in range(0x80)]


def length_delimited_tag(number: int) -> bytes:
    """The key of a length-delimited field (wire type 2): a message, bytes, string or packed array."""
    return varint(number << 3 | 2)


LEN, _FIXED32, _FIXED64, _VARINT, _START_GROUP, _END_GROUP = 2, 5, 1, 0, 3, 4


def _varint_at(buffer: memoryview, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        byte = buffer[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, pos
        shift += 7


def fields(buffer: memoryview, start: int, end: int) -> Iterator[tuple[int, int, int, int, int]]:
    """Walks the fields of the message in buffer[start:end]: (number, wire type, field start, value start,
    value end). Only the framing is read; raises ValueError on bytes that are not a message."""
    pos = start
    try:
        while pos < end:
            field_start = pos
            key = buffer[pos]  # one-byte keys and sizes (field numbers below 16, values below 128) read inline
            if key < 0x80:
                pos += 1
            else:
                key, pos = _varint_at(buffer, pos)
            wire_type, value_start = key & 7, pos
            if wire_type == LEN:
                size = buffer[pos]
                if size < 0x80:
                    value_start = pos + 1
                else:
                    size, value_start = _varint_at(buffer, pos)
                pos = value_start + size
            elif wire_type == _VARINT:
                _, pos = _varint_at(buffer, pos)
            elif wire_type in (_FIXED32, _FIXED64):
                pos += 4 if wire_type == _FIXED32 else 8
            elif wire_type == _START_GROUP:  # legal in unknown fields (proto2 groups): skipped whole
                pos = _group_end(buffer, pos, end, key >> 3)
            elif wire_type == _END_GROUP:  # closes the group being skipped (see _group_end)
                pass
            else:
                raise ValueError(f"wire type {wire_type} where a field starts")
            if pos > end:
                raise ValueError("a field runs past the end of its message")
            yield key >> 3, wire_type, field_start, value_start, pos
    except IndexError:
        raise ValueError("the message ends inside a field") from None


def _group_end(buffer: memoryview, pos: int, end: int, number: int) -> int:
    """The position after the END_GROUP that closes group `number` starting at pos."""
    for inner_number, wire_type, _, _, inner_end in fields(buffer, pos, end):
        if wire_type == _END_GROUP:
            if inner_number != number:
                raise ValueError(f"group {number} closed by the end of group {inner_number}")
            return inner_end
    raise ValueError(f"group {number} is not closed")


def split_message(buffer: memoryview, message_class: Any,
                  kept: Mapping[int, str]) -> tuple[Any, dict[str, list[memoryview]]]:
    """Parses `buffer` as `message_class`, except the length-delimited fields numbered in `kept`
    (number -> name), which come back as slices of `buffer` (no copy), in order, instead of being decoded."""
    slices: dict[str, list[memoryview]] = {name: [] for name in kept.values()}
    rest: list[memoryview] = []
    for number, wire_type, field_start, value_start, value_end in fields(buffer, 0, len(buffer)):
        name = kept.get(number)
        if name is not None and wire_type == LEN:
            slices[name].append(buffer[value_start:value_end])
        else:
            rest.append(buffer[field_start:value_end])
    return message_class.FromString(b"".join(rest)), slices


class EncodedSubmitRequest:
    """A SubmitRequest already encoded from its trajectories' buffers; behaves as a message to the stub.

    The arrays are joined into the request's bytes once, straight from their buffers (NumPy arrays,
    array.array, bytes): no per-number encoding and no intermediate message holding a copy of them.
    """

    __slots__ = ("request_id", "trajectory_count", "_data")

    def __init__(self, encoded_trajectories: Iterable[list[Any]], request_id: str,
                 dispatch_seqs: Mapping[str, int] | None = None) -> None:
        parts: list[Any] = []
        count = 0
        for trajectory_parts in encoded_trajectories:
            size = sum(len(p) if isinstance(p, bytes) else memoryview(p).nbytes for p in trajectory_parts)
            parts += [_SUBMIT_TRAJECTORY_TAG, varint(size), *trajectory_parts]
            count += 1
        if request_id:
            encoded_id = request_id.encode()
            parts += [_SUBMIT_REQUEST_ID_TAG, varint(len(encoded_id)), encoded_id]
        if dispatch_seqs:  # small: through protobuf (field order does not matter on the wire)
            parts.append(pacer_pb2.SubmitRequest(dispatch_seqs=dict(dispatch_seqs)).SerializeToString())
        self.request_id = request_id
        self.trajectory_count = count
        self._data = b"".join(parts)

    def SerializeToString(self) -> bytes:  # noqa: N802 (the protobuf message method name)
        return self._data

    def ByteSize(self) -> int:  # noqa: N802
        return len(self._data)


_ARRAY_TAGS = {name: length_delimited_tag(field.number) for name, field in ARRAY_FIELDS.items()}
_SUBMIT_TRAJECTORY_TAG = length_delimited_tag(pacer_pb2.SubmitRequest.DESCRIPTOR.fields_by_name["trajectories"].number)
_SUBMIT_REQUEST_ID_TAG = length_delimited_tag(pacer_pb2.SubmitRequest.DESCRIPTOR.fields_by_name["request_id"].number)


def encode_trajectory(scalars: Mapping[str, Any], arrays: Mapping[str, Any]) -> list[Any]:
    """The parts of one encoded Trajectory: its scalar fields through protobuf, then each non-empty array
    as a packed field whose run is the array's own buffer (`arrays`: name -> buffer of little-endian
    numbers of the field's type). Field order does not matter on the wire."""
    try:
        parts: list[Any] = [pacer_pb2.Trajectory(**scalars).SerializeToString()]
    except (TypeError, ValueError) as exc:  # protobuf's message names no field ("must be real number, not str")
        raise _scalar_error(scalars, exc) from None
    for name, run in arrays.items():
        size = memoryview(run).nbytes
        if size:
            parts += [_ARRAY_TAGS[name], varint(size), run]
    return parts


# What each scalar field of a Trajectory takes, by protobuf's field type, for the error that names it.
_ALLOWED_BY_TYPE = {
    FieldDescriptor.TYPE_STRING: "a str", FieldDescriptor.TYPE_DOUBLE: "a float (an int is taken too)",
    FieldDescriptor.TYPE_FLOAT: "a float (an int is taken too)", FieldDescriptor.TYPE_INT32: "an int",
    FieldDescriptor.TYPE_INT64: "an int", FieldDescriptor.TYPE_UINT32: "an int >= 0",
    FieldDescriptor.TYPE_UINT64: "an int >= 0", FieldDescriptor.TYPE_ENUM: "a TrajectoryStatus",
    FieldDescriptor.TYPE_BOOL: "a bool",
}


def _scalar_error(scalars: Mapping[str, Any], cause: Exception) -> Exception:
    """The error for a Trajectory whose scalar fields protobuf refused: the first field refused on its own, its
    value and what it takes (the same exception type, so callers catching TypeError or ValueError still do)."""
    for name, value in scalars.items():
        try:
            pacer_pb2.Trajectory(**{name: value})
        except (TypeError, ValueError) as exc:
            field = _TRAJECTORY.fields_by_name[name]
            allowed = ("a dict of str to str" if field.message_type is not None and name == "metadata"
                       else _ALLOWED_BY_TYPE.get(field.type, "its protobuf type"))
            return type(exc)(f"Trajectory.{name} = {value!r} ({type(value).__name__}) is not allowed: it takes "
                             f"{allowed} ({exc})")
    return cause


def serialize(message: Any) -> bytes:
    """Request serializer for messages of any class (real, view or EncodedSubmitRequest)."""
    return message.SerializeToString()


def passthrough_stub(channel: Any) -> Any:
    """The generated RolloutPacer stub, with the methods that carry trajectories taking raw bytes: Submit
    sends an encoded request as it is, Collect, CollectStream and Reset answers arrive undecoded (types.py
    reads them, viewing the arrays in place)."""
    from ._proto import pacer_pb2_grpc

    stub = pacer_pb2_grpc.RolloutPacerStub(channel)
    service = pacer_pb2.DESCRIPTOR.services_by_name["RolloutPacer"].full_name
    stub.Submit = channel.unary_unary(f"/{service}/Submit", request_serializer=serialize,
                                      response_deserializer=pacer_pb2.SubmitResponse.FromString,
                                      _registered_method=True)
    for method in ("Collect", "Reset"):
        setattr(stub, method, channel.unary_unary(f"/{service}/{method}", request_serializer=serialize,
                                                  response_deserializer=None, _registered_method=True))
    stub.CollectStream = channel.unary_stream(f"/{service}/CollectStream", request_serializer=serialize,
                                              response_deserializer=None, _registered_method=True)
    return stub
