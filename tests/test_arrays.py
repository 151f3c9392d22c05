"""Trajectory arrays as NumPy arrays or lists: encoded from their buffers, received as read-only views.

In process: every accepted dtype and edge (empty, one element, 1M elements, NaN logprobs) encodes to the
numbers' wire form and decodes back bit for bit; bad values are refused naming the field. Over gRPC: the
same arrays go through a real server and come back byte for byte, as arrays or as lists; the plain client
works in a process where NumPy cannot be imported.
"""
from __future__ import annotations

import subprocess
import sys
import textwrap

import numpy as np
import pytest

from coda_client import PacerClient, Trajectory, TrajectoryGroup, TrajectoryStatus, arrays, wire_forms as _wire
from coda_client._proto import pacer_pb2 as pb
from conftest import REPO_ROOT
from server_harness import ServerProcess

INT_DTYPES = ["int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64", ">i4"]
FLOAT_DTYPES = ["float16", "float32", "float64", ">f4", "int32"]
LENGTHS = [0, 1, 1_000_000]


def _trajectory(tokens, logprobs, mask, **extra) -> Trajectory:
    prompt_id = extra.pop("prompt_id", "p")  # trajectory ids are unique in a generation, across groups
    return Trajectory(trajectory_id=f"{prompt_id}/t0", prompt_id=prompt_id,
                      status=TrajectoryStatus.COMPLETED, token_ids=tokens, logprobs=logprobs, loss_mask=mask, **extra)


def _wire_bytes(values, dtype: str) -> bytes:
    """What the numbers are on the wire: little-endian `dtype` (int32 for ids and mask, float32 logprobs)."""
    return np.asarray(values).astype(dtype).tobytes()


def _round_trip(trajectory: Trajectory, mode: str = "numpy") -> Trajectory:
    """Encode as Submit would, decode as the Collect path does (arrays viewed in the encoded bytes)."""
    return Trajectory.from_encoded(memoryview(b"".join(trajectory.encoded_parts())), mode)


@pytest.mark.parametrize("length", LENGTHS)
@pytest.mark.parametrize("dtype", INT_DTYPES)
def test_integer_arrays_of_every_dtype_round_trip_bit_for_bit(dtype: str, length: int) -> None:
    info = np.iinfo(np.dtype(dtype))
    low, high = max(info.min, -(2**31)), min(info.max, 2**31 - 1)
    values = np.linspace(low, high, num=length).astype(dtype) if length > 1 else np.full(length, high, dtype=dtype)
    back = _round_trip(_trajectory(values, [], values))
    for received in (back.token_ids, back.loss_mask):
        assert received.dtype == np.dtype("<i4") and not received.flags.writeable
        assert received.tobytes() == _wire_bytes(values.astype(np.int64), "<i4")
    assert len(back.logprobs) == 0


@pytest.mark.parametrize("length", LENGTHS)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_logprobs_of_every_dtype_round_trip_as_float32_with_nan(dtype: str, length: int) -> None:
    values = np.linspace(-30.0, 0.0, num=length).astype(dtype)
    if length and np.dtype(dtype).kind == "f":
        values[0] = np.nan
    back = _round_trip(_trajectory([], values, []))
    assert back.logprobs.dtype == np.dtype("<f4") and not back.logprobs.flags.writeable
    assert back.logprobs.tobytes() == _wire_bytes(values, "<f4")
    if length and np.dtype(dtype).kind == "f":
        assert np.isnan(back.logprobs[0])


def test_nan_payloads_and_signed_zero_keep_their_bits() -> None:
    bits = np.array([0x7FC00000, 0x7FC00001, 0xFFC00000, 0x7F800001, 0x80000000], dtype="<u4")  # NaNs, -0.0
    logprobs = bits.view("<f4")
    back = _round_trip(_trajectory([1, 2, 3, 4, 5], logprobs, []))
    assert back.logprobs.view("<u4").tolist() == bits.tolist()
    assert back == _trajectory([1, 2, 3, 4, 5], logprobs, [])  # equality compares bits: NaN equals itself


def test_lists_tuples_and_array_module_are_accepted_and_equal_to_arrays() -> None:
    import array

    as_list = _trajectory([5, 6, 7], [-0.5, -1.5, -2.5], [0, 1, 1])
    as_tuple = _trajectory((5, 6, 7), (-0.5, -1.5, -2.5), (0, 1, 1))
    as_module = _trajectory(array.array("i", [5, 6, 7]), array.array("d", [-0.5, -1.5, -2.5]), range(0, 2) and [0, 1, 1])
    as_numpy = _trajectory(np.array([5, 6, 7]), np.array([-0.5, -1.5, -2.5]), np.array([False, True, True]))
    encoded = {b"".join(bytes(memoryview(p).cast("B")) for p in t.encoded_parts())
               for t in (as_list, as_tuple, as_module, as_numpy)}
    assert len(encoded) == 1
    assert as_list == as_numpy == as_tuple == as_module
    back = _round_trip(as_list, "list")
    assert (back.token_ids, back.logprobs, back.loss_mask) == ([5, 6, 7], [-0.5, -1.5, -2.5], [0, 1, 1])
    assert pb.Trajectory.FromString(b"".join(as_numpy.encoded_parts())) == as_list.to_pb()


def test_the_real_message_reads_what_the_encoder_writes() -> None:
    trajectory = _trajectory(np.arange(10), np.linspace(-1, 0, 10), np.ones(10, np.int8), reward=0.5,
                             metadata={"k": "v"}, payload=b"\x00\x01", start_weight_version=3, num_turns=2)
    message = pb.Trajectory.FromString(b"".join(trajectory.encoded_parts()))
    assert list(message.token_ids) == list(range(10)) and list(message.loss_mask) == [1] * 10
    assert np.array(message.logprobs, np.float32).tobytes() == _wire_bytes(np.linspace(-1, 0, 10), "<f4")
    assert (message.reward, dict(message.metadata), message.payload, message.start_weight_version) == (
        0.5, {"k": "v"}, b"\x00\x01", 3)
    assert Trajectory.from_pb(message) == trajectory  # the real message decodes to the same value


@pytest.mark.parametrize("field, values, error, says", [
    ("token_ids", np.array([2**31]), ValueError, "outside"),
    ("token_ids", [2**31], ValueError, "outside"),
    ("loss_mask", np.array([-1], np.int64) - 2**31, ValueError, "outside"),
    ("token_ids", np.array([1.5]), TypeError, "integers"),
    ("token_ids", [1.5], TypeError, "numbers"),
    ("token_ids", "abc", TypeError, "not str"),
    ("logprobs", np.array(["x"]), TypeError, "numbers"),
    ("token_ids", np.zeros((2, 2), np.int32), ValueError, "1-D"),
])
def test_values_that_do_not_fit_are_refused_naming_the_field(field, values, error, says) -> None:
    trajectory = _trajectory(**{"tokens": [], "logprobs": [], "mask": [],
                                {"token_ids": "tokens", "logprobs": "logprobs", "loss_mask": "mask"}[field]: values})
    with pytest.raises(error, match=says) as caught:
        trajectory.encoded_parts()
    assert field in str(caught.value)


def test_views_share_the_received_bytes_and_cannot_be_written() -> None:
    received = b"".join(_trajectory(np.arange(1000), [], []).encoded_parts())
    back = Trajectory.from_encoded(memoryview(received), "numpy")
    assert np.shares_memory(back.token_ids, np.frombuffer(received, np.uint8))  # a view, not a copy
    with pytest.raises(ValueError, match="read-only"):
        back.token_ids[0] = 7


@pytest.mark.parametrize("mode", ["numpy", "list"])
def test_an_unpacked_array_or_one_in_several_runs_is_decoded_whole(mode: str) -> None:
    """Legal but unusual encodings (numbers one by one, not packed; an array in two runs) still read right."""
    number = pb.Trajectory.DESCRIPTOR.fields_by_name["loss_mask"].number
    key, one = _wire.varint(number << 3 | 5), (1).to_bytes(4, "little")  # wire type 5: one fixed32 number
    data = b"".join(_trajectory([3, 4], [], []).encoded_parts()) + key + one + key + one
    back = Trajectory.from_encoded(memoryview(data), mode)
    assert list(back.loss_mask) == [1, 1] and list(back.token_ids) == [3, 4]
    twice = b"".join(_trajectory([3, 4], [], []).encoded_parts() + _trajectory([5], [], []).encoded_parts()[1:])
    assert list(Trajectory.from_encoded(memoryview(twice), mode).token_ids) == [3, 4, 5]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with ServerProcess(tmp_path_factory.mktemp("arrays"), "fully_async.sliding_window=no-window",
                       "data_source.num_prompts_per_step=64", "data_source.num_trajectories_per_prompt=1",
                       "trainer.mini_batch_size=1") as running:
        yield running


def _through_server(server, trajectory: Trajectory, mode: str) -> Trajectory:
    with PacerClient(server.address, arrays=mode) as pacer:
        pacer.dispatch([trajectory.prompt_id])
        assert pacer.submit([trajectory]).accepted == 1
        [group] = pacer.collect(1, wait=10)
    [received] = group.trajectories
    return received


@pytest.mark.parametrize("length", LENGTHS)
def test_arrays_round_trip_through_a_server_byte_for_byte(server, length: int) -> None:
    tokens = np.arange(length, dtype=np.int64) % 151_000
    logprobs = -np.linspace(0, 20, length, dtype=np.float32)
    if length:
        logprobs[-1] = np.nan
    mask = (np.arange(length) % 3 != 0)
    sent = _trajectory(tokens, logprobs, mask, prompt_id=f"len-{length}")
    received = _through_server(server, sent, "numpy")
    assert received.token_ids.tobytes() == _wire_bytes(tokens, "<i4")
    assert received.logprobs.tobytes() == logprobs.tobytes()
    assert received.loss_mask.tobytes() == _wire_bytes(mask, "<i4")
    assert received == sent


def test_lists_still_work_end_to_end(server) -> None:
    sent = _trajectory([1, 2, 3], [-0.25, float("nan"), -1.0], [1, 1, 0], prompt_id="lists", metadata={"a": "b"})
    received = _through_server(server, sent, "list")
    assert type(received.token_ids) is list and received.token_ids == [1, 2, 3] and received.loss_mask == [1, 1, 0]
    assert received == sent and received.metadata == {"a": "b"}


def test_reset_restores_groups_with_array_views(server) -> None:
    with PacerClient(server.address, arrays="numpy") as pacer:
        state = pacer.state()
        pacer.dispatch(["restored"])
        pacer.submit([_trajectory(np.arange(4), [], [], prompt_id="restored")])
        [pacer.collect(1, wait=0) for _ in range(state.buffered + 1)]  # empty the buffer
        reset = pacer.reset("abort", resume=True, weight_version=state.weight_version)
    restored_or_none = [g for g in reset.restored if g.prompt_id == "restored"]
    for group in restored_or_none:  # present when the group was still in the queue at the Reset
        assert isinstance(group, TrajectoryGroup) and group.trajectories[0].token_ids.tolist() == [0, 1, 2, 3]


def test_the_plain_client_works_where_numpy_cannot_be_imported(server) -> None:
    script = textwrap.dedent(f"""
        import sys
        class NoNumpy:
            def find_spec(self, name, path=None, target=None):
                if name == "numpy" or name.startswith("numpy."):
                    raise ImportError("numpy blocked for this test")
        sys.meta_path.insert(0, NoNumpy())
        from coda_client import PacerClient, Trajectory
        with PacerClient({server.address!r}) as pacer:
            pacer.dispatch(["no-numpy"])
            pacer.submit([Trajectory(trajectory_id="t", prompt_id="no-numpy", status=1, token_ids=[7, 8],
                                     logprobs=[-0.5, -1.0], loss_mask=(1, 0))])
            [group] = pacer.collect(1, wait=10)
            t = group.trajectories[0]
            assert (t.token_ids, t.logprobs, t.loss_mask) == ([7, 8], [-0.5, -1.0], [1, 0]), t
            try:
                PacerClient({server.address!r}, arrays="numpy")
            except ImportError as exc:
                assert "coda-pacer[numpy]" in str(exc)
            else:
                raise AssertionError("arrays='numpy' without numpy must fail")
        assert "numpy" not in sys.modules
        print("ok")
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, cwd=REPO_ROOT)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr


def test_to_torch_shares_or_copies_the_array() -> None:
    torch = pytest.importorskip("torch", reason="torch is not installed (optional; never a dependency)")
    values = np.arange(5, dtype=np.int32)
    shared = arrays.to_torch(values)
    assert torch.equal(shared, torch.arange(5, dtype=torch.int32))
    shared[0] = 9
    assert values[0] == 9  # a writable array is shared, not copied
    received = values.tobytes()
    read_only = np.frombuffer(received, np.int32)
    copied = arrays.to_torch(read_only)
    assert copied.tolist() == [9, 1, 2, 3, 4]
    copied[1] = 7
    assert read_only[1] == 1 and received == values.tobytes()  # the immutable bytes under a view stay as they are
