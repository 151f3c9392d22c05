"""CollectStream: Collect's answer in messages of a few MiB, whole groups in order, each carrying the answer's
lease and flags; the same refusals as Collect; batches() collects through it (issue 29, item 3)."""
from __future__ import annotations

from collections.abc import Sequence

import grpc
import pytest

from coda_client import AsyncPacerClient, CollectResult, PacerClient, Trajectory, TrajectoryGroup, TrajectoryStatus
from coda_client._proto import pacer_pb2 as pb
from coda_server import convert
from coda_server.core import types as core
from coda_server.wire import EncodedTrajectory
from conftest import core_overrides
from ops_harness import MetricsServer
from server_harness import until

MB = 1_000_000
STREAM = "/coda.pacer.v1.RolloutPacer/CollectStream"


def payload_trajectories(prompt_id: str, count: int, size: int) -> list[Trajectory]:
    return [Trajectory(trajectory_id=f"{prompt_id}#{i}", prompt_id=prompt_id, status=TrajectoryStatus.COMPLETED,
                       payload=bytes([i + 1]) * size, token_ids=[i, i + 1]) for i in range(count)]


def fill(client: PacerClient, prompt_ids: Sequence[str], size: int) -> None:
    client.dispatch(list(prompt_ids))
    for prompt_id in prompt_ids:
        client.submit(payload_trajectories(prompt_id, 2, size))


def stream_messages(address: str, request: pb.CollectRequest) -> list[pb.CollectResponse]:
    with grpc.insecure_channel(address) as channel:
        call = channel.unary_stream(STREAM, request_serializer=pb.CollectRequest.SerializeToString,
                                    response_deserializer=pb.CollectResponse.FromString)
        return list(call(request, timeout=30))


@pytest.fixture
def server(tmp_path):
    with MetricsServer(tmp_path, *core_overrides("no-window", B=4, stale=1.0, N=2)) as process:
        yield process


def test_large_groups_come_one_per_message_small_ones_together_each_message_with_the_lease(server):
    with PacerClient(server.address) as client:
        fill(client, ["big0", "big1", "big2"], int(1.5 * MB))  # 3 MB a group: two would pass 4 MiB
        fill(client, ["s0", "s1", "s2"], 1000)
        messages = stream_messages(server.address, pb.CollectRequest(num_groups=6, lease_seconds=60))
        assert [[g.prompt_id for g in m.groups] for m in messages] == [["big0"], ["big1"], ["big2", "s0", "s1", "s2"]]
        lease_ids = {m.lease_id for m in messages}
        assert len(lease_ids) == 1 and lease_ids != {""}
        assert not any(m.timed_out or m.cut_to_fit for m in messages)
        assert [t.payload for t in messages[1].groups[0].trajectories] == [b"\x01" * int(1.5 * MB),
                                                                             b"\x02" * int(1.5 * MB)]
        assert client.ack(lease_ids.pop()) == 6  # one lease for the whole answer
        state = client.state()
        assert (state.consumed, state.leased, state.buffered) == (6, 0, 0)


def test_an_answer_without_groups_is_one_message_saying_it_timed_out(server):
    messages = stream_messages(server.address, pb.CollectRequest(num_groups=1, wait_seconds=0.05))
    assert len(messages) == 1 and messages[0].timed_out and not messages[0].groups


def test_a_stream_is_refused_as_collect_is_and_takes_nothing(server):
    with PacerClient(server.address) as client:
        fill(client, ["big"], 600_000)
        with pytest.raises(grpc.RpcError) as refused:
            stream_messages(server.address, pb.CollectRequest(num_groups=0))
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "num_groups" in refused.value.details()
        with pytest.raises(grpc.RpcError) as too_large:
            stream_messages(server.address, pb.CollectRequest(num_groups=1, lease_seconds=30,
                                                              max_response_bytes=1_000_000))
        assert too_large.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "'big'" in too_large.value.details()
        state = client.state()
        assert (state.buffered, state.consumed, state.leased) == (1, 0, 0)


def test_batches_collect_through_the_stream(server):
    pytest.importorskip("numpy")
    with PacerClient(server.address, arrays="numpy") as client:
        fill(client, ["g0", "g1", "g2", "g3"], int(1.5 * MB))
        with client.batches(8, lease=60.0, num_batches=1, poll=1.0) as batches:
            batch = next(batches)
        assert [g.prompt_id for g in batch.groups] == ["g0", "g1", "g2", "g3"]
        assert len(batch.lease_ids) == 1
        assert batch.token_ids.tolist() == [0, 1, 1, 2] * 4
        state = client.state()
        assert (state.consumed, state.leased, state.buffered) == (4, 0, 0)
    scrape = server.scrape_until(lambda s: s.rpc("CollectStream") >= 1)
    assert (scrape.rpc("CollectStream"), scrape.rpc("Collect")) == (1, 0)


def test_closing_the_iterator_cuts_its_waiting_stream_and_takes_nothing(server):
    pytest.importorskip("numpy")
    with PacerClient(server.address, arrays="numpy") as client:
        batches = client.batches(4, lease=60.0, poll=60.0)
        until(lambda: client.state().waiting_calls == 1, "the iterator's CollectStream to wait on the server")
        batches.close()
        until(lambda: client.state().waiting_calls == 0, "the server to see the stream cancelled", timeout=10)
        fill(client, ["g0", "g1"], 1000)
        state = client.state()
        assert (state.buffered, state.leased, state.consumed) == (2, 0, 0)


def test_the_async_client_joins_a_streamed_answer(server):
    import asyncio

    from coda_client import _calls

    with PacerClient(server.address) as filler:
        fill(filler, ["g0", "g1"], int(2.5 * MB))

    async def collect() -> CollectResult:
        async with AsyncPacerClient(server.address) as client:
            return await client._run(_calls.collect(2, wait=1.0, allow_partial=False, request_id=None, timeout=30,
                                                    lease=30.0, streamed=True))

    result = asyncio.run(collect())
    assert [g.prompt_id for g in result.groups] == ["g0", "g1"] and result.lease_id
    assert [len(t.payload) for g in result.groups for t in g.trajectories] == [int(2.5 * MB)] * 4


# ------------------------------------------------------------------------------------ in process

def _core_group(prompt_id: str, sizes: Sequence[int]) -> core.TrajectoryGroup:
    bodies = [pb.Trajectory(trajectory_id=f"{prompt_id}/{i}", prompt_id=prompt_id, payload=b"x" * size)
              for i, size in enumerate(sizes)]
    return core.TrajectoryGroup(prompt_id, trajectories=[
        core.Trajectory(b.trajectory_id, prompt_id, body=EncodedTrajectory(memoryview(b.SerializeToString())))
        for b in bodies])


def test_the_stream_is_cut_between_whole_groups_by_size():
    groups = [_core_group("a", [400]), _core_group("b", [300, 300]), _core_group("c", [1500]), _core_group("d", [10])]
    result = core.CollectResult(groups, timed_out=False, lease_id="L", cut_to_fit=True)
    messages = [pb.CollectResponse.FromString(m.SerializeToString()) for m in convert.collect_stream(result, 1000)]
    assert [[g.prompt_id for g in m.groups] for m in messages] == [["a"], ["b"], ["c"], ["d"]]
    messages = [pb.CollectResponse.FromString(m.SerializeToString()) for m in convert.collect_stream(result, 2000)]
    assert [[g.prompt_id for g in m.groups] for m in messages] == [["a", "b"], ["c", "d"]]
    assert all(m.lease_id == "L" and m.cut_to_fit and not m.timed_out for m in messages)
    whole = pb.CollectResponse.FromString(convert.collect_response(result).SerializeToString())
    assert [g for m in messages for g in m.groups] == list(whole.groups)


def test_a_streamed_answer_joins_into_one_result():
    parts = [pb.CollectResponse(groups=[TrajectoryGroup("p0", 1).to_pb()], lease_id="L", cut_to_fit=True),
             pb.CollectResponse(groups=[TrajectoryGroup("p1", 2).to_pb(), TrajectoryGroup("p2", 3).to_pb()],
                                lease_id="L", cut_to_fit=True)]
    result = CollectResult.from_stream([p.SerializeToString() for p in parts], "list")
    assert result == CollectResult([TrajectoryGroup("p0", 1), TrajectoryGroup("p1", 2), TrajectoryGroup("p2", 3)],
                                   timed_out=False, lease_id="L", cut_to_fit=True)
    with pytest.raises(ValueError, match="without an answer"):
        CollectResult.from_stream([])


class ServerWithoutStream:
    """A server older than CollectStream, as a client meets it: a gRPC proxy on 127.0.0.1:0 forwarding every
    RolloutPacer method's bytes to a real server, except CollectStream, which it does not have (UNIMPLEMENTED,
    from gRPC itself)."""

    def __init__(self, target: str):
        from concurrent import futures

        from coda_client.protocol import RPCS, SERVICE, method_path

        self._channel = grpc.insecure_channel(target)
        handlers = {}
        for rpc in RPCS:
            if rpc.name == "CollectStream":
                continue
            if rpc.streaming:
                forward = self._channel.unary_stream(method_path(rpc.name))
                handlers[rpc.name] = grpc.unary_stream_rpc_method_handler(
                    lambda request, context, forward=forward: forward(request, metadata=context.invocation_metadata()))
            else:
                forward = self._channel.unary_unary(method_path(rpc.name))
                handlers[rpc.name] = grpc.unary_unary_rpc_method_handler(
                    lambda request, context, forward=forward: forward(request, metadata=context.invocation_metadata()))
        self._server = grpc.server(futures.ThreadPoolExecutor(16))
        self._server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(SERVICE, handlers)])
        self.address = f"127.0.0.1:{self._server.add_insecure_port('127.0.0.1:0')}"
        self._server.start()

    def __enter__(self) -> "ServerWithoutStream":
        return self

    def __exit__(self, *exc) -> None:
        self._server.stop(0)
        self._channel.close()


def test_batches_from_a_server_without_collect_stream_come_through_collect(tmp_path, caplog):
    with MetricsServer(tmp_path, *core_overrides("no-window", B=4, stale=1.0, N=2)) as process, \
            ServerWithoutStream(process.address) as older:
        with PacerClient(older.address, timeout=30) as client:
            fill(client, ["a", "b", "c", "d"], 1000)
            with pytest.raises(Exception) as refused:  # the proxy really has no CollectStream
                stream_messages(older.address, pb.CollectRequest(num_groups=1))
            assert refused.value.code() == grpc.StatusCode.UNIMPLEMENTED
            with caplog.at_level("WARNING", logger="coda_client.batches"):
                with client.batches(4, num_batches=2) as batches:
                    got = [[t.trajectory_id for t in batch.trajectories] for batch in batches]
            assert sorted(i for ids in got for i in ids) == sorted(f"{p}#{i}" for p in "abcd" for i in range(2))
            assert "has no CollectStream" in caplog.text
            until(lambda: client.state().leased == 0 and client.state().consumed == 4,
                  "every batch acknowledged")


def test_a_rank_share_from_a_server_without_collect_stream_is_refused_not_misread(tmp_path):
    from coda_client.errors import PacerClientError

    with MetricsServer(tmp_path, *core_overrides("no-window", B=4, stale=1.0, N=2)) as process, \
            ServerWithoutStream(process.address) as older:
        with PacerClient(older.address, timeout=30) as client:
            fill(client, ["a", "b", "c", "d"], 1000)
            with client.batches(4, rank=0, world_size=2, num_batches=1) as batches:
                with pytest.raises(PacerClientError) as refused:
                    next(batches)
            assert refused.value.code == grpc.StatusCode.UNIMPLEMENTED
            assert "upgrade the server" in str(refused.value) and "world_size" in str(refused.value)
            assert client.state().buffered == 4 and client.state().leased == 0  # nothing was taken


def test_async_batches_from_a_server_without_collect_stream_come_through_collect(tmp_path):
    import asyncio

    async def run(address: str) -> list[str]:
        async with AsyncPacerClient(address, timeout=30) as client:
            ids = []
            async with client.batches(4, num_batches=2) as batches:
                async for batch in batches:
                    ids += [t.trajectory_id for t in batch.trajectories]
            return ids

    with MetricsServer(tmp_path, *core_overrides("no-window", B=4, stale=1.0, N=2)) as process, \
            ServerWithoutStream(process.address) as older:
        with PacerClient(older.address, timeout=30) as client:
            fill(client, ["a", "b", "c", "d"], 1000)
        assert sorted(asyncio.run(run(older.address))) == sorted(f"{p}#{i}" for p in "abcd" for i in range(2))
