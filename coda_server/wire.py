"""Pass-through forms of the messages that carry trajectories: their token arrays stay undecoded bytes.

The server reads a trajectory's ids, status, reward and versions; it never reads the token ids, logprobs,
loss mask or metadata, which the trainer gets back exactly as the worker sent them. The classes here are
derived at import time from pacer.proto's own descriptors (so they cannot drift from it) and differ in one
respect: in `Trajectory` every repeated field (the packed numeric arrays and the metadata map) is
`repeated bytes` under the same field number, so each packed run, or map entry, is kept as the bytes it
arrived as. Parsing a Submit then copies those bytes instead of decoding every number, and writing a
trajectory back (Collect, Reset, the journal) copies them again. The encoding does not change: a view
serializes to the bytes the real message would, and an array sent unpacked (legal, unusual) arrives as an
unknown field, which is kept and written back too.
"""
from __future__ import annotations

from typing import Any

from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

from coda_client._proto import pacer_pb2

VIEW_PACKAGE = "coda.pacer.v1.passthrough"
# The messages the server builds or parses with trajectories inside.
VIEW_MESSAGES = ("Trajectory", "TrajectoryGroup", "SubmitRequest", "CollectResponse", "ResetResponse")


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
                if field.label == descriptor_pb2.FieldDescriptorProto.LABEL_REPEATED:
                    field.type = descriptor_pb2.FieldDescriptorProto.TYPE_BYTES
                    field.ClearField("type_name")
                    field.ClearField("options")  # `packed` applies to numbers only
    pool = descriptor_pool.DescriptorPool()
    for dependency in source.dependency:  # none today; kept so a future import does not break this
        dependency_proto = descriptor_pb2.FileDescriptorProto()
        descriptor_pool.Default().FindFileByName(dependency).CopyToProto(dependency_proto)
        pool.Add(dependency_proto)
    pool.Add(view)
    classes = message_factory.GetMessageClassesForFiles([view.name], pool)
    return {name: classes[f"{VIEW_PACKAGE}.{name}"] for name in VIEW_MESSAGES}


_VIEWS = _derive_views()
Trajectory = _VIEWS["Trajectory"]
TrajectoryGroup = _VIEWS["TrajectoryGroup"]
SubmitRequest = _VIEWS["SubmitRequest"]
CollectResponse = _VIEWS["CollectResponse"]
ResetResponse = _VIEWS["ResetResponse"]

# Bytes of a varint other than its last one have the high bit set.
_CONTINUATION_BYTES = bytes(range(0x80, 0x100))


def varint_count(runs: Any) -> int:
    """Numbers in packed varint runs (int32 arrays); -1 when a run ends inside a number."""
    count = 0
    for run in runs:
        if run and run[-1] & 0x80:
            return -1
        count += len(run) if run.isascii() else len(run.translate(None, _CONTINUATION_BYTES))
    return count


def fixed32_count(runs: Any) -> int:
    """Numbers in packed 4-byte runs (float arrays); -1 when a run is not a whole number of them."""
    count = 0
    for run in runs:
        if len(run) % 4:
            return -1
        count += len(run) // 4
    return count


def carried_bytes(trajectory: Any) -> int:
    """Bytes of the arrays, metadata and payload a trajectory carries (its size without the small fields)."""
    return (sum(map(len, trajectory.token_ids)) + sum(map(len, trajectory.logprobs))
            + sum(map(len, trajectory.loss_mask)) + sum(map(len, trajectory.metadata)) + len(trajectory.payload))
