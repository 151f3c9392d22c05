"""Pass-through views (coda_server/wire.py): the arrays stay bytes, and nothing a worker sends is changed.

In process: a view serializes to exactly the bytes of the real message, for any trajectory; requests that
are legal but not in the usual form (an array in several packed runs, an array sent unpacked) lose nothing.
Over gRPC: a malformed packed array is INVALID_ARGUMENT, and such requests come back to the trainer intact.
"""
from __future__ import annotations

import uuid

import grpc
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from coda_client import PacerClient
from coda_client._proto import pacer_pb2 as pb
from coda_server import wire
from server_harness import ServerProcess

INT32 = st.integers(min_value=-(2**31), max_value=2**31 - 1)
FLOAT32 = st.floats(width=32, allow_nan=False)
TEXT = st.text(max_size=8)

trajectories = st.builds(
    pb.Trajectory,
    trajectory_id=TEXT, prompt_id=TEXT, ds_index=st.integers(0, 2**32 - 1),
    status=st.sampled_from([0, 1, 2, 3, 7]), reward=st.floats(allow_nan=False),
    token_ids=st.lists(INT32, max_size=40), logprobs=st.lists(FLOAT32, max_size=40),
    loss_mask=st.lists(st.integers(0, 300), max_size=40),
    start_weight_version=st.integers(-(2**63), 2**63 - 1), end_weight_version=st.integers(0, 2**63 - 1),
    num_turns=st.integers(0, 2**32 - 1), metadata=st.dictionaries(TEXT, TEXT, max_size=4), payload=st.binary(max_size=64),
)


@settings(max_examples=200, deadline=None)
@given(st.lists(trajectories, max_size=5), TEXT)
def test_a_view_serializes_to_the_bytes_of_the_real_message(messages, request_id):
    data = pb.SubmitRequest(trajectories=messages, request_id=request_id).SerializeToString()
    parsed = wire.parse_submit(data)
    assert parsed.request_id == request_id
    assert [len(t.encoded) for t in parsed.trajectories] == [m.ByteSize() for m in messages]
    for message, submitted in zip(messages, parsed.trajectories):
        # (Compared decoded: a map's entries may be written in another order by each serialization.)
        assert pb.Trajectory.FromString(bytes(submitted.encoded)) == message
        for name in ("token_ids", "logprobs", "loss_mask"):
            assert wire.array_count(name, submitted.runs.get(name, b"")) == len(getattr(message, name))
        assert bytes(submitted.runs.get("payload", b"")) == message.payload
        assert (submitted.fields.trajectory_id, submitted.fields.reward, len(submitted.fields.metadata)) == (
            message.trajectory_id, message.reward, len(message.metadata))
        assert submitted.has_metadata == bool(message.metadata)  # seen by the parse, which the checks trust
        assert submitted.metadata_map() == dict(message.metadata)
        lengths = {len(message.token_ids), len(message.logprobs), len(message.loss_mask)} - {0}
        assert (wire.array_problem(submitted) is None) == (len(lengths) <= 1)
        group = wire.TrajectoryGroup(prompt_id="p", trajectories=[wire.Trajectory.FromString(bytes(submitted.encoded))])
        assert pb.TrajectoryGroup.FromString(group.SerializeToString()).trajectories[0] == message


def _field(number: int, wire_type: int, body: bytes = b"") -> bytes:
    key = _varint(number << 3 | wire_type)
    return key + (_varint(len(body)) + body if wire_type == 2 else body)


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte, value = value & 0x7F, value >> 7
        out.append(byte | (0x80 if value else 0))
        if not value:
            return bytes(out)


def _submit(trajectory_bytes: bytes) -> bytes:
    return _field(1, 2, trajectory_bytes) + _field(2, 2, b"r-1")


TOKENS = pb.Trajectory.DESCRIPTOR.fields_by_name["token_ids"].number
MASK = pb.Trajectory.DESCRIPTOR.fields_by_name["loss_mask"].number


def _int32s(*values: int) -> bytes:
    return b"".join(v.to_bytes(4, "little", signed=True) for v in values)


def test_the_arrays_are_fixed_width_under_new_numbers_and_the_old_ones_are_reserved():
    fields = pb.Trajectory.DESCRIPTOR.fields_by_name
    assert {name: (fields[name].number, fields[name].type) for name in ("token_ids", "logprobs", "loss_mask")} == {
        "token_ids": (14, fields["token_ids"].TYPE_SFIXED32), "logprobs": (7, fields["logprobs"].TYPE_FLOAT),
        "loss_mask": (15, fields["loss_mask"].TYPE_SFIXED32)}
    assert {f.number for f in pb.Trajectory.DESCRIPTOR.fields}.isdisjoint({6, 8})  # never reused


def test_an_array_in_several_packed_runs_is_read_whole():
    # token_ids = [1, 2] then [300] in a second run: legal, and a plain bytes field would keep only [300].
    trajectory = (_field(1, 2, b"t0") + _field(2, 2, b"p") + _field(TOKENS, 2, _int32s(1, 2))
                  + _field(TOKENS, 2, _int32s(300)))
    parsed = wire.parse_submit(_submit(trajectory))
    assert list(pb.Trajectory.FromString(bytes(parsed.trajectories[0].encoded)).token_ids) == [1, 2, 300]
    assert wire.array_count("token_ids", parsed.trajectories[0].runs["token_ids"]) == 3 and parsed.request_id == "r-1"


def test_an_array_sent_unpacked_is_packed_and_counted():
    trajectory = (_field(1, 2, b"t0") + _field(TOKENS, 5, _int32s(5)) + _field(TOKENS, 5, _int32s(-7))
                  + _field(13, 2, b"xy"))
    parsed = wire.parse_submit(_submit(trajectory))
    submitted = parsed.trajectories[0]
    assert submitted.runs["token_ids"] == _int32s(5, -7) and wire.array_count("token_ids", submitted.runs["token_ids"]) == 2
    decoded = pb.Trajectory.FromString(bytes(submitted.encoded))
    assert (list(decoded.token_ids), decoded.payload) == ([5, -7], b"xy")


LOGPROBS = pb.Trajectory.DESCRIPTOR.fields_by_name["logprobs"].number
SEGMENT_LENGTHS = pb.Trajectory.DESCRIPTOR.fields_by_name["segment_lengths"].number
SEGMENT_VERSIONS = pb.Trajectory.DESCRIPTOR.fields_by_name["segment_weight_versions"].number
def _int64s(*values: int) -> bytes:
    return b"".join(v.to_bytes(8, "little", signed=True) for v in values)


THREE_ARRAYS = (_field(TOKENS, 2, _int32s(1, 2, 3)) + _field(LOGPROBS, 2, _int32s(0, 0, 0))
                + _field(MASK, 2, _int32s(1, 1, 0)))


@pytest.mark.parametrize("arrays, says", [
    (THREE_ARRAYS, None),
    (_field(TOKENS, 2, b"") + _field(LOGPROBS, 2, b"") + _field(MASK, 2, b""), None),  # three empty runs
    # The usual form (all three arrays there) with one thing wrong: each is still found.
    (THREE_ARRAYS + _field(MASK, 2, _int32s(1)), "must have equal lengths"),  # the last run wins: 1 value
    (_field(TOKENS, 2, _int32s(1, 2) + b"\x01") + _field(LOGPROBS, 2, _int32s(0, 0)) + _field(MASK, 2, _int32s(1, 1)),
     "token_ids is not a valid packed array"),
    (THREE_ARRAYS + _field(SEGMENT_LENGTHS, 2, _int32s(2)) + _field(SEGMENT_VERSIONS, 2, _int64s(4)),
     "segment_lengths add up to 2 tokens but token_ids holds 3"),
    (THREE_ARRAYS + _field(SEGMENT_LENGTHS, 2, _int32s(3)), "segment_lengths and segment_weight_versions must have"),
    (THREE_ARRAYS + _field(SEGMENT_LENGTHS, 2, _int32s(1, 2)) + _field(SEGMENT_VERSIONS, 2, _int64s(4, 5)), None),
    (THREE_ARRAYS + _field(6, 2, b"\x01"), "uses field number 6, which pacer.proto has retired"),
])
def test_the_checks_of_the_usual_form_find_every_problem(arrays, says):
    submitted = wire.read_trajectory(_field(1, 2, b"t0") + _field(2, 2, b"p") + arrays)
    problem = wire.array_problem(submitted)
    assert problem is None if says is None else says in problem


SERVER_OVERRIDES = ("fully_async.sliding_window=no-window", "data_source.num_prompts_per_step=4",
                    "data_source.num_trajectories_per_prompt=1", "trainer.mini_batch_size=1")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with ServerProcess(tmp_path_factory.mktemp("wire"), *SERVER_OVERRIDES) as running:
        yield running


@pytest.fixture(scope="module")
def pure_python_protobuf_server(tmp_path_factory):
    """The same server on protobuf's pure-Python implementation (PROTOCOL_BUFFERS_PYTHON_IMPLEMENTATION=python, which
    some ML images set for the whole container): its parser raises other exceptions than upb's for the same bytes."""
    with ServerProcess(tmp_path_factory.mktemp("wire-python"), *SERVER_OVERRIDES,
                       env={"PROTOCOL_BUFFERS_PYTHON_IMPLEMENTATION": "python"}) as running:
        yield running


@pytest.mark.parametrize("array, says", [
    (_field(TOKENS, 2, b"\x01\x00\x00"), "token_ids is not a valid packed array"),  # 3 bytes of an int32
    (_field(7, 2, b"\x00\x00\x80\x3f\x00"), "logprobs is not a valid packed array"),  # 5 bytes of float32
    (_field(MASK, 2, b"\xff"), "loss_mask is not a valid packed array"),
    (_field(TOKENS, 2, _int32s(1, 2)) + _field(MASK, 2, _int32s(1)), "must have equal lengths"),
    # A sender built from the proto before the arrays moved: varint token_ids / loss_mask as fields 6 and 8.
    (_field(6, 2, b"\x01\x02"), "uses field number 6, which pacer.proto has retired"),
    (_field(8, 0, b"\x01"), "uses field number 8, which pacer.proto has retired"),  # unpacked
])
def test_a_malformed_packed_array_is_invalid_argument_and_changes_nothing(server, array, says):
    with PacerClient(server.address) as pacer:
        pacer.dispatch(["bad"])
        before = pacer.state()
        trajectory = _field(1, 2, b"t0") + _field(2, 2, b"bad") + _field(4, 0, b"\x01") + array
        with grpc.insecure_channel(server.address) as channel, pytest.raises(grpc.RpcError) as caught:
            channel.unary_unary("/coda.pacer.v1.RolloutPacer/Submit")(_submit(trajectory), timeout=10)
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT and says in caught.value.details()
        assert pacer.state() == before
        pacer.reset("abort", wait=0, resume=True, weight_version=before.weight_version)


@pytest.mark.parametrize("entry", [
    _field(1, 2, b"\xff\xfe") + _field(2, 2, b"x"),  # a key that is not UTF-8
    _field(1, 2, b"k") + _field(2, 2, b"\xc3"),  # a value cut inside a character
    b"\x0a\x05k",  # an entry whose key runs past its end
])
@pytest.mark.parametrize("protobuf", ["default", "pure-python"])
def test_a_metadata_entry_the_trainer_could_not_parse_is_refused_at_submit(request, protobuf, entry):
    """The server passes metadata through; an entry that is no string-to-string entry (another language's client,
    a hand-built message) would be accepted and then fail every Collect of its group in the trainer's parser."""
    server = request.getfixturevalue("server" if protobuf == "default" else "pure_python_protobuf_server")
    with PacerClient(server.address) as pacer:
        pacer.dispatch(["meta"])
        before = pacer.state()
        head = _field(1, 2, b"meta/0") + _field(2, 2, b"meta") + _field(4, 0, b"\x01")
        with grpc.insecure_channel(server.address) as channel, pytest.raises(grpc.RpcError) as caught:
            channel.unary_unary("/coda.pacer.v1.RolloutPacer/Submit")(_submit(head + _field(12, 2, entry)), timeout=10)
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "trajectories[0] metadata must map UTF-8 strings to UTF-8 strings" in caught.value.details()
        assert pacer.state() == before
        good = head + _field(12, 2, _field(1, 2, "clé".encode()) + _field(2, 2, b"v"))
        request = _field(1, 2, good) + _field(2, 2, f"meta-{uuid.uuid4().hex}".encode())  # _submit's id is taken
        with grpc.insecure_channel(server.address) as channel:
            answer = pb.SubmitResponse.FromString(
                channel.unary_unary("/coda.pacer.v1.RolloutPacer/Submit")(request, timeout=10))
        assert answer.accepted == 1
        [group] = pacer.collect(1, wait=5)
        assert dict(group.trajectories[0].metadata) == {"clé": "v"}
        pacer.reset("abort", wait=0, resume=True, weight_version=before.weight_version)


def test_unusual_encodings_reach_the_trainer_intact(server):
    """Several packed runs and an unpacked array, through Submit and Collect: the trainer decodes the data sent."""
    with PacerClient(server.address) as pacer:
        pacer.dispatch(["odd"])
        trajectory = (_field(1, 2, b"t0") + _field(2, 2, b"odd") + _field(4, 0, b"\x01")
                      + _field(TOKENS, 2, _int32s(1, 2)) + _field(TOKENS, 2, _int32s(300))  # token_ids in two runs
                      + _field(MASK, 5, _int32s(1)) + _field(MASK, 5, _int32s(0))
                      + _field(MASK, 5, _int32s(1)))  # loss_mask unpacked
        with grpc.insecure_channel(server.address) as channel:
            answer = pb.SubmitResponse.FromString(
                channel.unary_unary("/coda.pacer.v1.RolloutPacer/Submit")(_submit(trajectory), timeout=10))
        assert answer.accepted == 1
        [group] = pacer.collect(1, wait=5)
        [received] = group.trajectories
        assert (list(received.token_ids), list(received.loss_mask)) == ([1, 2, 300], [1, 0, 1])


def test_an_unknown_group_field_is_kept_and_framing_errors_are_value_errors():
    """A proto2 group in an unknown field (legal) passes through; bytes that are not a message raise
    ValueError, which the server answers as MALFORMED_REQUEST."""
    from coda_client import wire_forms as _wire

    group = _varint(99 << 3 | 3) + _field(1, 0, b"\x05") + _varint(99 << 3 | 4)
    trajectory = _field(1, 2, b"t0") + group + _field(TOKENS, 2, _int32s(4, 5))
    parsed = wire.parse_submit(_submit(trajectory))
    assert bytes(parsed.trajectories[0].encoded) == trajectory
    assert wire.array_count("token_ids", parsed.trajectories[0].runs["token_ids"]) == 2
    for broken in (b"\x0a\x05ab", b"\x08\xff", _varint(99 << 3 | 3) + b"\x08\x01"):
        with pytest.raises(ValueError):
            list(_wire.fields(memoryview(broken), 0, len(broken)))


@settings(max_examples=500, deadline=None)
@given(st.one_of(st.integers(0, 2**21 + 5), st.integers(0, 2**64 - 1)))
def test_varint_encodes_as_protobuf_does(value):
    from google.protobuf.internal import encoder

    from coda_client import wire_forms

    assert wire_forms.varint(value) == encoder._VarintBytes(value)
    for edge in (0, 0x7F, 0x80, 0x3FFF, 0x4000, 0x1FFFFF, 0x200000, 2**63):
        assert wire_forms.varint(edge) == encoder._VarintBytes(edge)


def test_a_refused_submit_names_every_trajectory_that_is_wrong_and_converts_the_usual_ones_with_their_metadata():
    """The conversion tells the usual trajectory in one test and checks the others in full: a Submit whose
    trajectories 1 and 3 are wrong (arrays of unequal lengths; a metadata entry that is not UTF-8) is refused naming
    both, and one whose trajectories are all right, metadata included, converts each with its token count."""
    from coda_server import convert
    from coda_server.core.errors import InvalidArgumentError

    def message(i: int, tokens: int = 3, **fields) -> pb.Trajectory:
        return pb.Trajectory(trajectory_id=f"t{i}", prompt_id="p", token_ids=list(range(tokens)),
                             logprobs=[-0.5] * tokens, loss_mask=[1] * tokens, **fields)

    entry = b"\x0a\x02\xff\xfe\x12\x01v"  # a map entry whose key is not UTF-8
    not_utf8 = message(3).SerializeToString() + b"\x62" + bytes([len(entry)]) + entry
    unequal = message(1)
    del unequal.logprobs[-1]
    trajectory_tag = b"\x0a"  # SubmitRequest.trajectories = 1
    encoded = (message(0).SerializeToString(), unequal.SerializeToString(),
               message(2, metadata={"k": "v"}).SerializeToString(), not_utf8)
    data = b"".join(trajectory_tag + bytes([len(t)]) + t for t in encoded)
    assert pb.SubmitRequest.DESCRIPTOR.fields_by_name["trajectories"].number == 1
    with pytest.raises(InvalidArgumentError) as refused:
        convert.trajectories(wire.parse_submit(data).trajectories)
    assert [field for field, _ in refused.value.violations] == ["trajectories[1]", "trajectories[3]"]
    assert "equal lengths" in refused.value.violations[0][1] and "UTF-8" in refused.value.violations[1][1]

    good = pb.SubmitRequest(trajectories=[message(0, tokens=5), message(1, tokens=2, metadata={"k": "v"})])
    converted = convert.trajectories(wire.parse_submit(good.SerializeToString()).trajectories)
    assert [(t.trajectory_id, t.num_tokens, dict(t.metadata)) for t in converted] == [
        ("t0", 5, {}), ("t1", 2, {"k": "v"})]
