"""Pass-through forms of the messages that carry trajectories: their token arrays stay undecoded bytes.

The server reads a trajectory's ids, status, reward and versions; it never reads the token ids, logprobs,
loss mask or metadata, which the trainer gets back exactly as the worker sent them. The classes here are
derived at import time from pacer.proto's own descriptors (so they cannot drift from it) and differ in one
respect: in `Trajectory` each packed numeric array is one `bytes` field and the metadata map is `repeated
bytes` (one raw entry each), under the same field numbers. Parsing a Submit then copies those bytes instead
of decoding every number (about 0.05 ms instead of 1.3 ms for 64 trajectories of 1,000 tokens), and writing
a trajectory back (Collect, Reset, the journal) copies them again.

The encoding does not change: a view serializes to the bytes the real message would. `parse_submit`
checks that nothing was lost in the view: every encoder writes a packed array as one run, but the format
also allows several runs, which a `bytes` field would not keep (the last run would win). When the sizes do
not add up to the request's length, the request is decoded the ordinary way and re-encoded in the usual
form first. An array sent unpacked (legal, unusual) arrives as an unknown field, which is kept and written
back too.
"""
from __future__ import annotations

from typing import Any

import grpc
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

from coda_client._proto import pacer_pb2

VIEW_PACKAGE = "coda.pacer.v1.passthrough"


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

# Bytes of a varint other than its last one have the high bit set.
_CONTINUATION_BYTES = bytes(range(0x80, 0x100))


class ParsedSubmit:
    """A SubmitRequest view with the encoded size of each trajectory (what the byte cap counts)."""

    __slots__ = ("request_id", "trajectories", "sizes")

    def __init__(self, request: Any, sizes: list[int]):
        self.request_id: str = request.request_id
        self.trajectories = request.trajectories
        self.sizes = sizes


def _varint_length(value: int) -> int:
    return max(1, (value.bit_length() + 6) // 7)


def parse_submit(data: bytes) -> ParsedSubmit:
    """Parse a SubmitRequest as views; raises DecodeError like the ordinary parser."""
    request = SubmitRequest.FromString(data)
    sizes = [t.ByteSize() for t in request.trajectories]
    request_id = len(request.request_id.encode()) if request.request_id else -1
    encoded = (sum(1 + _varint_length(size) + size for size in sizes)
               + (1 + _varint_length(request_id) + request_id if request_id >= 0 else 0))
    if encoded != len(data):  # not in the usual form (see above): decode and re-encode it first
        request = SubmitRequest.FromString(pacer_pb2.SubmitRequest.FromString(data).SerializeToString())
        sizes = [t.ByteSize() for t in request.trajectories]
    return ParsedSubmit(request, sizes)


def varint_count(run: bytes) -> int:
    """Numbers in a packed varint run (an int32 array); -1 when it ends inside a number."""
    if run and run[-1] & 0x80:
        return -1
    return len(run) if run.isascii() else len(run.translate(None, _CONTINUATION_BYTES))


def fixed32_count(run: bytes) -> int:
    """Numbers in a packed 4-byte run (a float array); -1 when it is not a whole number of them."""
    return -1 if len(run) % 4 else len(run) // 4


def _as_encoded(message: bytes) -> bytes:
    return message


def _serialize(message: Any) -> bytes:
    return message.SerializeToString()


class PassthroughCodec:
    """A method wrapper (see method_wrapping) giving the RolloutPacer methods that carry trajectories their
    pass-through (de)serializers: Submit requests are parsed with `parse_submit`, and Collect and Reset
    answers, built as views by convert.py, are serialized as what they are. WatchControl events come
    already encoded (the servicer encodes each event once for all watchers) and are sent as they are."""

    def __init__(self, service: str):
        self._submit = f"/{service}/Submit"
        self._view_responses = (f"/{service}/Collect", f"/{service}/Reset")
        self._encoded_responses = (f"/{service}/WatchControl",)  # written as bytes, encoded once per event

    def wrap(self, method: str, handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
        if method == self._submit:
            return handler._replace(request_deserializer=parse_submit)
        if method in self._view_responses:
            return handler._replace(response_serializer=_serialize)
        if method in self._encoded_responses:
            return handler._replace(response_serializer=_as_encoded)
        return handler
