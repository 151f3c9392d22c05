"""How the server carries trajectories without decoding them: views to read, encoded slices to hold.

The server reads a trajectory's ids, status, reward and versions; it never decodes the token ids, logprobs,
loss mask, metadata or payload, which the trainer gets back exactly as the worker sent them.

- Reading: a Submit is parsed into pass-through views (classes derived from pacer.proto's descriptors in
  coda_client/wire_forms.py, where each packed array is one `bytes` field), for the fields the server reads and
  the checks of the arrays (`array_problem`: whole numbers of values, equal lengths, no retired field).
- Holding: each trajectory's body is its encoded bytes, a slice of the request (`EncodedTrajectory`), so
  the server holds one copy of what it accepted, in the form it came in.
- Writing: Collect and Reset answers (`EncodedAnswer`) and the journal write those bytes as they are,
  joined once, instead of copying them into a message and serializing that.

A bytes field keeps only the last of several packed runs of one array (legal, unusual), and an array sent
unpacked is not a run at all: `parse_submit` re-encodes a request holding either in the usual form (one
packed run per array) first, so what is held, checked and written back is always in that form.
"""
from __future__ import annotations

import operator
from typing import Any, Optional

import grpc
from google.protobuf.message import DecodeError

from coda_client import wire_forms as _wire
from coda_client.protocol import RPCS
from coda_client._proto import pacer_pb2

try:  # XXH3 (xxhash, in the server extra): about four times zlib's CRC-32 here, and 64 bits wide
    from xxhash import xxh3_64_intdigest as _digest
    DIGEST = "XXH3-64"
except ImportError:  # the server without its extra (embedded): CRC-32, called alike (fingerprints stay in the process)
    from zlib import crc32 as _digest
    DIGEST = "CRC-32"

# The view classes are derived once, in the client package, which reads Collect answers through them too.
VIEW_PACKAGE = _wire.VIEW_PACKAGE
VIEWS = _wire.VIEWS
Trajectory = _wire.Trajectory
TrajectoryGroup = _wire.TrajectoryGroup
SubmitRequest = _wire.SubmitRequest
CollectResponse = _wire.CollectResponse
ResetResponse = _wire.ResetResponse
StepReport = _wire.StepReport

class EncodedTrajectory:
    """A trajectory's body as the server holds it: its encoded bytes, a slice of the Submit request that
    brought it (no copy; the request's bytes stay alive while one of its trajectories is held). Collect and
    Reset answers, and the journal, write these bytes as they are. `parsed`: what the Submit's parse read of
    it (SubmittedTrajectory), kept until the fingerprint is computed so that it need not read the bytes again."""

    __slots__ = ("encoded", "_fingerprint", "_parsed")

    def __init__(self, encoded: memoryview, parsed: Optional["SubmittedTrajectory"] = None):
        self.encoded = encoded
        self._fingerprint: Optional[int] = None
        self._parsed = parsed

    def __len__(self) -> int:
        return len(self.encoded)

    def __eq__(self, other: object) -> bool:
        return (isinstance(other, EncodedTrajectory) and self.fingerprint() == other.fingerprint()
                and self._routing_fields() == other._routing_fields())

    def _routing_fields(self) -> tuple:
        """The fields the fingerprint leaves out, read from the bytes (comparing two bodies is rare)."""
        m = read_trajectory(self.encoded).fields
        return (m.trajectory_id, m.prompt_id, m.ds_index, m.status, m.reward, m.start_weight_version,
                m.end_weight_version, m.num_turns)

    __hash__ = None  # type: ignore[assignment]

    def SerializeToString(self) -> bytes:  # noqa: N802 (what the message classes call it)
        return bytes(self.encoded)

    def fingerprinted(self) -> bool:
        """Whether `fingerprint()` is computed already (then it costs nothing)."""
        return self._fingerprint is not None

    def fingerprint(self) -> int:
        """A digest of the trajectory's arrays, payload and metadata: what duplicate detection keeps of them once
        the trajectory has left the server, beside its routing fields (ids, status, reward, versions, turns), which
        `Trajectory.content_key` holds as they are (the servicer's Trajectory read them already; reading them from
        the parse again cost about 5,000 instructions per trajectory). Field order and the order of the
        metadata entries do not change it; every array value, payload byte and entry does, up to a collision of
        the arrays' and payload's digest (DIGEST). Computed once (AsyncPacer makes it as the
        Submit is accepted); safe to call from any thread (AsyncPacer's keys thread makes those of Submits over
        1 MiB and of a journal's replay)."""
        if self._fingerprint is None:
            # The Submit's parse when there is one (a second walk over the framing cost twice the digest itself);
            # read_trajectory reads the bytes as that parse does, so both give the same digest.
            parsed = self._parsed or read_trajectory(self.encoded)
            # Each run's digest seeded with its field number (so bytes moved from one array to another change it),
            # added up: a sum does not depend on the order the runs came in. An empty run counts as an absent one,
            # as it does to any parser. (Both digests release the GIL on large buffers.)
            digest = 0
            for name, run in parsed.runs.items():
                if run:
                    digest += _digest(run, _RUN_SEEDS[name])
            metadata = tuple(sorted(parsed.metadata_map().items())) if parsed.has_metadata else ()
            self._fingerprint = hash((metadata, digest))
            self._parsed = None  # the parse holds views of the request: let them go with the digest made
        return self._fingerprint


def decoded_metadata(entries: Any) -> dict[str, str]:
    """A trajectory's metadata map from its encoded entries as a view holds them (`repeated bytes`); a later
    entry for the same key wins, as protobuf's map parsing does. DecodeError when an entry is not a string-to-
    string entry (e.g. a key or value that is not UTF-8)."""
    decoded = {}
    for raw in entries:
        try:
            entry = _METADATA_ENTRY.FromString(raw)
        except UnicodeDecodeError as exc:  # protobuf's pure-Python parser says invalid UTF-8 so; upb says DecodeError
            raise DecodeError(f"an entry is not UTF-8: {exc}") from None
        decoded[entry.key] = entry.value
    return decoded


_METADATA_ENTRY = pacer_pb2.Trajectory.MetadataEntry


# The fields the server never decodes, by number: the arrays, and the payload (opaque to the server,
# possibly large). A Submit keeps them as slices of the request; a fingerprint digests them in place.
_RUN_NAMES = {**{field.number: name for name, field in _wire.ARRAY_FIELDS.items()},
              pacer_pb2.Trajectory.DESCRIPTOR.fields_by_name["payload"].number: "payload"}
_RUN_SEEDS = {name: number for number, name in _RUN_NAMES.items()}  # a fingerprint seeds each run's digest with these


class SubmittedTrajectory:
    """One trajectory of a Submit as the server reads it: its other fields decoded (`fields`, a view
    whose arrays are empty), its arrays and payload as slices of the request (`runs`: not decoded, not
    copied), its whole encoded bytes (`encoded`, what the server holds), the retired field numbers it
    uses (`retired`: a sender built from an older pacer.proto) and whether it has metadata entries
    (`has_metadata`, seen by the parse: asking the view costs a container each time)."""

    __slots__ = ("fields", "runs", "encoded", "retired", "has_metadata", "_metadata")

    def __init__(self, fields: Any, runs: dict[str, memoryview], encoded: memoryview, retired: tuple[int, ...] = (),
                 has_metadata: bool = True):
        self.fields = fields
        self.runs = runs
        self.encoded = encoded
        self.retired = retired
        self.has_metadata = has_metadata
        self._metadata: Optional[dict[str, str]] = None if has_metadata else {}

    def metadata_map(self) -> dict[str, str]:
        """The metadata map, decoded once (`decoded_metadata`: DecodeError for an entry that is not one); the
        Submit's check and the fingerprint both read it."""
        if self._metadata is None:
            self._metadata = decoded_metadata(self.fields.metadata)
        return self._metadata


class ParsedSubmit:
    """A SubmitRequest parsed for the servicer: its trajectories (SubmittedTrajectory), request id and fences."""

    __slots__ = ("request_id", "trajectories", "dispatch_seqs")

    def __init__(self, request_id: str, trajectories: list[SubmittedTrajectory],
                 dispatch_seqs: Optional[dict[str, int]] = None):
        self.request_id = request_id
        self.trajectories = trajectories
        self.dispatch_seqs = dispatch_seqs or {}


_SUBMIT_TRAJECTORIES = pacer_pb2.SubmitRequest.DESCRIPTOR.fields_by_name["trajectories"].number


class _UnusualForm(Exception):
    """An array in several packed runs, or not packed: re-encoded before it is read (module docstring)."""


def parse_submit(data: bytes) -> ParsedSubmit:
    """Parse a SubmitRequest for the servicer; raises DecodeError like the ordinary parser.

    Only the framing of the arrays is read: every byte of a Submit is copied once, by gRPC, into `data`,
    which the held trajectories are slices of. (Decoding the whole request as a message would copy every
    array again, and reading a bytes field of it once more.)"""
    try:
        try:
            return _split_submit(memoryview(data))
        except _UnusualForm:
            return _split_submit(memoryview(pacer_pb2.SubmitRequest.FromString(data).SerializeToString()))
    except ValueError as exc:  # the framing is broken: what the ordinary parser reports as DecodeError
        raise DecodeError(f"Error parsing message: {exc}") from None


def read_trajectory(data: bytes) -> SubmittedTrajectory:
    """One encoded trajectory read as parse_submit reads each of a Submit's (the journal's records)."""
    try:
        return _split_trajectory(memoryview(data))
    except _UnusualForm:
        return _split_trajectory(memoryview(pacer_pb2.Trajectory.FromString(data).SerializeToString()))


def _split_submit(data: memoryview) -> ParsedSubmit:
    request, slices = _wire.split_message(data, SubmitRequest, {_SUBMIT_TRAJECTORIES: "trajectories"})
    return ParsedSubmit(request.request_id, [_split_trajectory(encoded) for encoded in slices["trajectories"]],
                        dict(request.dispatch_seqs))


def _split_trajectory(encoded: memoryview) -> SubmittedTrajectory:
    runs: dict[str, memoryview] = {}
    rest: list[memoryview] = []
    retired: list[int] = []
    has_metadata = False
    for number, wire_type, field_start, value_start, value_end in _wire.fields(encoded, 0, len(encoded)):
        name = _RUN_NAMES.get(number)
        if number in _RETIRED_NUMBERS:  # packed or not: either way the trajectory is refused
            retired.append(number)
        elif name is None:
            rest.append(encoded[field_start:value_end])
            if number == _METADATA_NUMBER:
                has_metadata = True
        elif name == "payload":  # a bytes field: the last occurrence wins, as in any parser
            runs[name] = encoded[value_start:value_end]
        elif wire_type != _wire.LEN or name in runs:
            raise _UnusualForm
        else:
            runs[name] = encoded[value_start:value_end]
    return SubmittedTrajectory(Trajectory.FromString(b"".join(rest)), runs, encoded, tuple(retired), has_metadata)


_METADATA_NUMBER = pacer_pb2.Trajectory.DESCRIPTOR.fields_by_name["metadata"].number


_SERIALIZE = operator.methodcaller("SerializeToString")


def group_parts(prompt_id: str, seq: int, ds_index: int, epoch: Optional[int], index: Optional[int],
                bodies: list[EncodedTrajectory]) -> list[Any]:
    """The encoded fields of one TrajectoryGroup: its header through protobuf, then each trajectory's
    held bytes as they are."""
    header = pacer_pb2.TrajectoryGroup(prompt_id=prompt_id, seq=seq, ds_index=ds_index, epoch=epoch, index=index)
    parts: list[Any] = [header.SerializeToString()]
    for body in bodies:
        parts += [_GROUP_TRAJECTORY_TAG, _wire.varint(len(body.encoded)), body.encoded]
    return parts


_GROUP_TRAJECTORY_TAG = _wire.length_delimited_tag(
    pacer_pb2.TrajectoryGroup.DESCRIPTOR.fields_by_name["trajectories"].number)


class EncodedAnswer:
    """A Collect or Reset answer: the message without its groups, and the groups as encoded parts,
    joined once when gRPC serializes it (one copy of the trajectories' bytes, no message holding them).
    `encoded`: more of the answer's fields already encoded (e.g. GetState's configuration summary, the same
    in every answer), written as they are."""

    __slots__ = ("message", "groups", "encoded")

    def __init__(self, message: Any, groups: dict[str, list[list[Any]]], encoded: bytes = b""):
        self.message = message
        self.groups = groups
        self.encoded = encoded

    def SerializeToString(self) -> bytes:  # noqa: N802
        parts: list[Any] = [self.encoded, self.message.SerializeToString()]
        fields = self.message.DESCRIPTOR.fields_by_name
        for name, groups in self.groups.items():
            tag = _wire.length_delimited_tag(fields[name].number)
            for group in groups:
                parts += [tag, _wire.varint(parts_size(group)), *group]
        return b"".join(parts)


def parts_size(parts: list[Any]) -> int:
    """Bytes of encoded parts (bytes and memoryviews) joined."""
    return sum(len(p) if isinstance(p, bytes) else p.nbytes for p in parts)


# A streamed answer's messages hold whole groups up to about this many bytes (a larger group goes alone): up to
# a 6.3 MB group a message, the per-byte cost is flat; at 12 MB and more a message it rises, on both sides
# (bench/collect_transport.py, docs/protocol.md "CollectStream").
STREAM_MESSAGE_BYTES = 4 * 2**20


def split_answer(message: Any, groups: list[list[Any]], message_bytes: int = STREAM_MESSAGE_BYTES) -> list[EncodedAnswer]:
    """An answer carrying `groups` (each its encoded parts) as a stream's messages: the groups whole and in order,
    a message closed when the next group would take it over `message_bytes`, each message with `message`'s other
    fields (CollectStream's flags and lease); an answer without groups is one message."""
    messages: list[EncodedAnswer] = []
    batch: list[list[Any]] = []
    size = 0
    for parts in groups:
        group_size = parts_size(parts)
        if batch and size + group_size > message_bytes:
            messages.append(EncodedAnswer(message, {"groups": batch}))
            batch, size = [], 0
        batch.append(parts)
        size += group_size
    if batch or not messages:
        messages.append(EncodedAnswer(message, {"groups": batch}))
    return messages


_RETIRED_NUMBERS = {Trajectory.DESCRIPTOR.fields_by_name[name].number: name for name in _wire.RETIRED_FIELDS}
_ARRAYS_NOW = ", ".join(f"{name}={field.number}" for name, field in _wire.ARRAY_FIELDS.items())


def usual_token_count(trajectory: SubmittedTrajectory) -> Optional[int]:
    """The token count of the usual trajectory, told in one test: the three per-token arrays, each a whole number of
    values, of one length, and no segments nor retired field; None for anything else (`array_problem` says what is
    wrong, if anything). Every submitted trajectory is checked on arrival."""
    runs = trajectory.runs
    token_ids, logprobs, loss_mask = runs.get("token_ids"), runs.get("logprobs"), runs.get("loss_mask")
    if token_ids is not None and logprobs is not None and loss_mask is not None and not trajectory.retired:
        count = len(token_ids) // TOKEN_ID_WIDTH
        if (count * TOKEN_ID_WIDTH == len(token_ids) and len(logprobs) == count * _LOGPROB_WIDTH
                and len(loss_mask) == count * _LOSS_MASK_WIDTH
                and "segment_lengths" not in runs and "segment_weight_versions" not in runs):
            return count
    return None


def array_problem(trajectory: SubmittedTrajectory) -> Optional[str]:
    """What is wrong with a submitted trajectory's arrays, or None: a retired field number (a sender built
    from an older pacer.proto), a run that is not a whole number of values, or non-empty arrays of
    different lengths."""
    runs = trajectory.runs
    if usual_token_count(trajectory) is not None:  # the usual trajectory, told in one test
        return None
    if trajectory.retired:
        retired = sorted(set(trajectory.retired))
        return (f"uses field number {retired[0]}, which pacer.proto has retired (token_ids and loss_mask "
                f"were varint int32 fields 6 and 8; they are packed sfixed32 now): build the client from the "
                f"current pacer.proto, whose arrays are fields {_ARRAYS_NOW}")
    counts = {}
    for name in _wire.ARRAY_FIELDS:
        count = array_count(name, runs[name]) if name in runs else 0
        if count < 0:
            return f"{name} is not a valid packed array (it ends inside a number)"
        counts[name] = count
    logprob_count, mask_count = counts["logprobs"], counts["loss_mask"]
    first = counts["token_ids"] or logprob_count or mask_count  # every non-empty one must have its length
    if (logprob_count and logprob_count != first) or (mask_count and mask_count != first):
        return ("non-empty token_ids, logprobs and loss_mask must have equal lengths; got "
                + ", ".join(f"{name}={counts[name]}" for name in PER_TOKEN_ARRAYS))
    return _segments_problem(runs, counts)


TOKEN_ID_WIDTH = _wire.ITEM_SIZES["token_ids"]  # bytes per token id (convert.py counts a trajectory's tokens with it)
_LOGPROB_WIDTH, _LOSS_MASK_WIDTH = _wire.ITEM_SIZES["logprobs"], _wire.ITEM_SIZES["loss_mask"]

# The arrays with one value per response token; the segment arrays have one per segment.
PER_TOKEN_ARRAYS = ("token_ids", "logprobs", "loss_mask")


def _segments_problem(runs: dict[str, memoryview], counts: dict[str, int]) -> Optional[str]:
    """Segments (a few numbers, so they are read): as many versions as lengths, the lengths adding up to
    the response; absent segments are fine."""
    segments, versions = counts["segment_lengths"], counts["segment_weight_versions"]
    if not (segments or versions):
        return None
    if segments != versions:
        return (f"segment_lengths and segment_weight_versions must have equal lengths; got "
                f"segment_lengths={segments}, segment_weight_versions={versions}")
    lengths = runs["segment_lengths"]
    total = sum(int.from_bytes(lengths[i:i + 4], "little") for i in range(0, len(lengths), 4))
    if total != counts["token_ids"]:
        return f"segment_lengths add up to {total} tokens but token_ids holds {counts['token_ids']}"
    return None


def array_count(name: str, run: memoryview) -> int:
    """Numbers in the packed run of trajectory array `name`; -1 when the run ends inside a number."""
    width = _wire.ITEM_SIZES[name]
    return -1 if len(run) % width else len(run) // width


class PassthroughCodec:
    """A method wrapper (see method_wrapping) giving the RolloutPacer methods their (de)serializers by the
    RPC table's wire forms (coda_client/protocol.py): a "submit" request is parsed with `parse_submit`;
    "views" answers (Dispatch, Collect, Reset), built as views by convert.py, and "assembled" ones (GetState,
    an EncodedAnswer), are serialized as what they are; "encoded" answers (WatchControl events, encoded once for all watchers) are sent as they are."""

    REQUEST_DESERIALIZERS = {"submit": parse_submit}
    # methodcaller: the answer's own SerializeToString, without a Python frame; None: bytes are sent as they are.
    RESPONSE_SERIALIZERS = {"views": _SERIALIZE, "assembled": _SERIALIZE, "encoded": None}

    def __init__(self, service: str):
        self._forms = {f"/{service}/{rpc.name}": rpc for rpc in RPCS}

    def wrap(self, method: str, handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
        rpc = self._forms.get(method)
        if rpc is None:
            return handler
        changes = {}
        if rpc.request_form != "message":
            changes["request_deserializer"] = self.REQUEST_DESERIALIZERS[rpc.request_form]
        if rpc.response_form != "message":
            changes["response_serializer"] = self.RESPONSE_SERIALIZERS[rpc.response_form]
        return handler._replace(**changes) if changes else handler
