"""Pass-through views (coda_server/wire.py): the arrays stay bytes, and nothing a worker sends is changed.

In process: a view serializes to exactly the bytes of the real message, for any trajectory; requests that
are legal but not in the usual form (an array in several packed runs, an array sent unpacked) lose nothing.
Over gRPC: a malformed packed array is INVALID_ARGUMENT, and such requests come back to the trainer intact.
"""
from __future__ import annotations

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
    assert wire.SubmitRequest(trajectories=parsed.trajectories, request_id=parsed.request_id).SerializeToString() == data
    assert parsed.sizes == [m.ByteSize() for m in messages]
    for message, view in zip(messages, parsed.trajectories):
        # (Compared decoded: a map's entries may be written in another order by each serialization.)
        assert pb.Trajectory.FromString(view.SerializeToString()) == message
        assert wire.varint_count(view.token_ids) == len(message.token_ids)
        assert wire.fixed32_count(view.logprobs) == len(message.logprobs)
        assert wire.varint_count(view.loss_mask) == len(message.loss_mask)
        group = wire.TrajectoryGroup(prompt_id="p", trajectories=[view]).SerializeToString()
        assert pb.TrajectoryGroup.FromString(group).trajectories[0] == message


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


def test_an_array_in_several_packed_runs_is_read_whole():
    # token_ids = [1, 2] then [300] in a second run: legal, and a plain bytes field would keep only [300].
    trajectory = _field(1, 2, b"t0") + _field(2, 2, b"p") + _field(6, 2, b"\x01\x02") + _field(6, 2, _varint(300))
    parsed = wire.parse_submit(_submit(trajectory))
    assert list(pb.Trajectory.FromString(parsed.trajectories[0].SerializeToString()).token_ids) == [1, 2, 300]
    assert wire.varint_count(parsed.trajectories[0].token_ids) == 3 and parsed.request_id == "r-1"


def test_an_array_sent_unpacked_is_kept():
    trajectory = _field(1, 2, b"t0") + _field(6, 0, _varint(5)) + _field(6, 0, _varint(7)) + _field(13, 2, b"xy")
    parsed = wire.parse_submit(_submit(trajectory))
    decoded = pb.Trajectory.FromString(parsed.trajectories[0].SerializeToString())
    assert (list(decoded.token_ids), decoded.payload) == ([5, 7], b"xy")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with ServerProcess(tmp_path_factory.mktemp("wire"), "fully_async.sliding_window=no-window",
                       "data_source.num_prompts_per_step=4", "data_source.num_trajectories_per_prompt=1",
                       "trainer.mini_batch_size=1") as running:
        yield running


@pytest.mark.parametrize("array, says", [
    (_field(6, 2, b"\x01\x81"), "token_ids is not a valid packed array"),  # ends inside a varint
    (_field(7, 2, b"\x00\x00\x80\x3f\x00"), "logprobs is not a valid packed array"),  # 5 bytes of float32
    (_field(8, 2, b"\xff"), "loss_mask is not a valid packed array"),
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
        pacer.reset("abort", resume=True, weight_version=before.weight_version)


def test_unusual_encodings_reach_the_trainer_intact(server):
    """Several packed runs and an unpacked array, through Submit and Collect: the trainer decodes the data sent."""
    with PacerClient(server.address) as pacer:
        pacer.dispatch(["odd"])
        trajectory = (_field(1, 2, b"t0") + _field(2, 2, b"odd") + _field(4, 0, b"\x01")
                      + _field(6, 2, b"\x01\x02") + _field(6, 2, _varint(300))  # token_ids in two runs
                      + _field(8, 0, b"\x01") + _field(8, 0, b"\x00") + _field(8, 0, b"\x01"))  # loss_mask unpacked
        with grpc.insecure_channel(server.address) as channel:
            answer = pb.SubmitResponse.FromString(
                channel.unary_unary("/coda.pacer.v1.RolloutPacer/Submit")(_submit(trajectory), timeout=10))
        assert answer.accepted == 1
        [group] = pacer.collect(1, wait=5)
        [received] = group.trajectories
        assert (list(received.token_ids), list(received.loss_mask)) == ([1, 2, 300], [1, 0, 1])
