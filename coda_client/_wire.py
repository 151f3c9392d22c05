"""Pass-through ("view") forms of the messages that carry trajectories, derived from pacer.proto's descriptors.

A view differs from the real message in one respect: in `Trajectory` each packed numeric array is one
`bytes` field holding its packed run, and the metadata map is `repeated bytes` (one raw entry each), under
the same field numbers. Parsing a view copies the arrays' bytes instead of decoding every number; a client
then exposes a fixed-width array as a NumPy array over those bytes, and the server passes them through
without reading them. A view serializes to the bytes the real message would.

Both sides use these classes: the server (coda_server/wire.py) for Submit requests and Collect/Reset answers,
the client (coda_client) for Collect/Reset answers, and to write Submit requests straight from array buffers.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

from google.protobuf import descriptor_pb2, descriptor_pool, message_factory
from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.unknown_fields import UnknownFieldSet

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


def is_fixed_width(name: str) -> bool:
    """Whether the array travels as fixed-width numbers (viewable in place) rather than varints."""
    return ARRAY_FIELDS[name].type in FIXED_DTYPES


def varint(value: int) -> bytes:
    """The base-128 varint encoding of a non-negative integer."""
    out = bytearray()
    while True:
        byte, value = value & 0x7F, value >> 7
        out.append(byte | (0x80 if value else 0))
        if not value:
            return bytes(out)


def length_delimited_tag(number: int) -> bytes:
    """The key of a length-delimited field (wire type 2): a message, bytes, string or packed array."""
    return varint(number << 3 | 2)


def parse_view(view_class: Any, real_class: Any) -> Callable[[bytes], Any]:
    """A deserializer into `view_class` that loses nothing: an array written in several packed runs (legal,
    unusual) would keep only its last run in a bytes field, which shows as a smaller encoded size; such a
    message is decoded the ordinary way and re-encoded in the usual form first."""

    def parse(data: bytes) -> Any:
        message = view_class.FromString(data)
        if message.ByteSize() != len(data):
            message = view_class.FromString(real_class.FromString(data).SerializeToString())
        return message

    return parse


def has_unknown_fields(message: Any) -> bool:
    """True when the message carries fields its class does not declare (e.g. an array sent unpacked)."""
    return len(UnknownFieldSet(message)) > 0


def normalized(view: Any) -> Any:
    """A trajectory view in the usual form: one packed run per array, nothing unknown. An array sent
    unpacked arrives in a view as an unknown field; re-encoding through the real message packs it."""
    if not has_unknown_fields(view):
        return view
    return Trajectory.FromString(pacer_pb2.Trajectory.FromString(view.SerializeToString()).SerializeToString())


class EncodedSubmitRequest:
    """A SubmitRequest already encoded from its trajectories' buffers; behaves as a message to the stub.

    The arrays are joined into the request's bytes once, straight from their buffers (NumPy arrays,
    array.array, bytes): no per-number encoding and no intermediate message holding a copy of them.
    """

    __slots__ = ("request_id", "trajectory_count", "_data")

    def __init__(self, encoded_trajectories: Iterable[list[Any]], request_id: str) -> None:
        parts: list[Any] = []
        count = 0
        for trajectory_parts in encoded_trajectories:
            size = sum(len(p) if isinstance(p, bytes) else memoryview(p).nbytes for p in trajectory_parts)
            parts += [_SUBMIT_TRAJECTORY_TAG, varint(size), *trajectory_parts]
            count += 1
        if request_id:
            encoded_id = request_id.encode()
            parts += [_SUBMIT_REQUEST_ID_TAG, varint(len(encoded_id)), encoded_id]
        self.request_id = request_id
        self.trajectory_count = count
        self._data = b"".join(parts)

    def SerializeToString(self) -> bytes:  # noqa: N802 (the protobuf message method name)
        return self._data

    def ByteSize(self) -> int:  # noqa: N802
        return len(self._data)


_SUBMIT_TRAJECTORY_TAG = length_delimited_tag(pacer_pb2.SubmitRequest.DESCRIPTOR.fields_by_name["trajectories"].number)
_SUBMIT_REQUEST_ID_TAG = length_delimited_tag(pacer_pb2.SubmitRequest.DESCRIPTOR.fields_by_name["request_id"].number)


def encode_trajectory(scalars: Mapping[str, Any], arrays: Mapping[str, Any]) -> list[Any]:
    """The parts of one encoded Trajectory: its scalar fields through protobuf, then each non-empty array
    as a packed field whose run is the array's own buffer (`arrays`: name -> little-endian buffer of a
    fixed-width field, or a sequence of numbers for a varint field). Field order does not matter on the wire."""
    parts: list[Any] = [pacer_pb2.Trajectory(**scalars).SerializeToString()]
    for name, run in arrays.items():
        field = ARRAY_FIELDS[name]
        if field.type in FIXED_DTYPES:
            size = memoryview(run).nbytes
            if size:
                parts += [length_delimited_tag(field.number), varint(size), run]
        elif len(run):
            parts.append(pacer_pb2.Trajectory(**{name: run}).SerializeToString())
    return parts


def serialize(message: Any) -> bytes:
    """Request serializer for messages of any class (real, view or EncodedSubmitRequest)."""
    return message.SerializeToString()


def passthrough_stub(channel: Any) -> Any:
    """The generated RolloutPacer stub, with the methods that carry trajectories going through views:
    Submit sends an encoded request as it is, Collect and Reset answers are parsed as views."""
    from ._proto import pacer_pb2_grpc

    stub = pacer_pb2_grpc.RolloutPacerStub(channel)
    service = pacer_pb2.DESCRIPTOR.services_by_name["RolloutPacer"].full_name
    stub.Submit = channel.unary_unary(f"/{service}/Submit", request_serializer=serialize,
                                      response_deserializer=pacer_pb2.SubmitResponse.FromString,
                                      _registered_method=True)
    stub.Collect = channel.unary_unary(f"/{service}/Collect", request_serializer=serialize,
                                       response_deserializer=parse_view(CollectResponse, pacer_pb2.CollectResponse),
                                       _registered_method=True)
    stub.Reset = channel.unary_unary(f"/{service}/Reset", request_serializer=serialize,
                                     response_deserializer=parse_view(ResetResponse, pacer_pb2.ResetResponse),
                                     _registered_method=True)
    return stub
