"""No message larger than its receiver takes, nothing consumed that was not delivered (issue 23, item 2).

Collect answers are cut to fit the caller's receive limit (or the server's own), always whole groups; a group
larger than the limit alone is refused before anything is taken; batches() builds a mini-batch from several
Collects; the worker kit splits its Submits to fit and submits a trajectory that can never fit as FAILED.
"""
from __future__ import annotations

import asyncio
from collections.abc import Sequence

import grpc
import pytest

from coda_client import AsyncPacerClient, PacerClient, Trajectory, TrajectoryStatus
from coda_client._proto import pacer_pb2
from coda_client.errors import FailedPreconditionError
from coda_worker.engines import FinishReason, Generation, GenerationRequest, SamplingParams
from coda_worker.worker import AsyncRolloutWorker, ListPromptSource, Prompt
from conftest import core_overrides
from server_harness import ServerProcess

KB = 1024
LIMIT = 1_000_000  # the client's message limit in these tests


def payload_trajectories(prompt_id: str, count: int, size: int) -> list[Trajectory]:
    return [Trajectory(trajectory_id=f"{prompt_id}#{i}", prompt_id=prompt_id, status=TrajectoryStatus.COMPLETED,
                       payload=bytes([i]) * size) for i in range(count)]


def fill(client: PacerClient, prompt_ids: Sequence[str], size: int, n: int = 2) -> None:
    client.dispatch(list(prompt_ids))
    for prompt_id in prompt_ids:
        client.submit(payload_trajectories(prompt_id, n, size))


def two_groups_of_600_kb(client: PacerClient, status: TrajectoryStatus = TrajectoryStatus.ABORTED) -> None:
    """Dispatches and fills groups "a" and "b", about 600 KB each: one fits a 1 MB answer, two do not."""
    client.dispatch(["a", "b"])
    for prompt_id in ("a", "b"):
        client.submit([Trajectory(trajectory_id=f"{prompt_id}#{i}", prompt_id=prompt_id, status=status,
                                  payload=b"x" * (300 * KB)) for i in range(2)])


@pytest.fixture
def server(tmp_path):
    with ServerProcess(tmp_path, *core_overrides("no-window", B=4, stale=1.0, N=2)) as process:
        yield process


def test_collect_answers_only_what_fits_the_callers_limit_and_keeps_the_rest(server):
    with PacerClient(server.address) as filler, PacerClient(server.address, max_message_bytes=LIMIT) as trainer:
        fill(filler, ["g0", "g1", "g2", "g3"], 200 * KB)  # a group is about 400 KB: two fit in 1 MB
        first = trainer.collect_result(4)
        assert [g.prompt_id for g in first.groups] == ["g0", "g1"]
        assert first.cut_to_fit and not first.timed_out
        state = trainer.state()
        assert (state.consumed, state.buffered) == (2, 2)  # nothing taken that was not delivered
        rest = trainer.collect_result(2)
        assert [g.prompt_id for g in rest.groups] == ["g2", "g3"] and not rest.cut_to_fit
        assert [len(t.payload) for g in first.groups + rest.groups for t in g.trajectories] == [200 * KB] * 8


def test_a_group_larger_than_the_limit_alone_is_refused_and_stays_buffered(server):
    with PacerClient(server.address) as filler, PacerClient(server.address, max_message_bytes=LIMIT) as trainer:
        fill(filler, ["big"], 600 * KB)
        with pytest.raises(FailedPreconditionError) as refused:
            trainer.collect_result(1, lease=30.0)
        assert refused.value.reason == "MESSAGE_TOO_LARGE"
        assert "'big'" in refused.value.details and "server.max_message_bytes" in refused.value.details
        assert str(LIMIT) in refused.value.details
        state = trainer.state()
        assert (state.buffered, state.consumed, state.leased) == (1, 0, 0)
        assert len(filler.collect(1)[0].trajectories) == 2  # a client with room for it still gets it


def test_the_servers_own_limit_applies_when_the_caller_says_none(tmp_path):
    overrides = core_overrides("no-window", B=4, stale=1.0, N=2)
    with ServerProcess(tmp_path, *overrides, f"server.max_message_bytes={LIMIT}") as server:
        with PacerClient(server.address, max_message_bytes=LIMIT) as client:
            fill(client, ["g0", "g1", "g2"], 200 * KB)
        # A caller that receives anything and does not say its limit: the server's limit bounds the answer.
        channel = grpc.insecure_channel(server.address, options=[("grpc.max_receive_message_length", -1)])
        stub = channel.unary_unary("/coda.pacer.v1.RolloutPacer/Collect",
                                   request_serializer=pacer_pb2.CollectRequest.SerializeToString,
                                   response_deserializer=pacer_pb2.CollectResponse.FromString)
        answer = stub(pacer_pb2.CollectRequest(num_groups=3), timeout=30)
        channel.close()
        assert [g.prompt_id for g in answer.groups] == ["g0", "g1"] and answer.cut_to_fit


def test_batches_builds_one_mini_batch_from_several_collects(server):
    pytest.importorskip("numpy")
    with PacerClient(server.address) as filler, PacerClient(server.address, max_message_bytes=LIMIT) as trainer:
        fill(filler, ["g0", "g1", "g2", "g3"], 200 * KB)
        with trainer.batches(8, lease=60.0, num_batches=1, poll=1.0) as batches:
            batch = next(batches)
            assert [g.prompt_id for g in batch.groups] == ["g0", "g1", "g2", "g3"]
            assert len(batch.lease_ids) == 2 and batch.lease_id == batch.lease_ids[0]
        state = trainer.state()
        assert (state.consumed, state.leased, state.buffered) == (4, 0, 0)  # every lease acknowledged


class LongEngine:
    """An AsyncEngine answering each request at once with as many tokens as its prompt's first id says."""

    async def generate(self, request: GenerationRequest) -> Generation:
        count = min(request.max_tokens, request.input_ids[0])
        return Generation(list(range(count)), [-0.5] * count, FinishReason.STOP)

    async def abort(self, request_ids: Sequence[str]) -> None:
        pass


def test_worker_splits_submits_to_fit_and_fails_a_trajectory_that_never_can(tmp_path):
    # 4 trajectories of 40,000 tokens (about 320 KB each with logprobs) end together: one Submit would be
    # 1.3 MB, over the worker's 1 MB. A trajectory of 150,000 tokens (1.2 MB) can never be sent by it.
    with ServerProcess(tmp_path, *core_overrides("no-window", B=2, stale=1.0, N=4, M=4)) as server:
        async def go():
            async with AsyncPacerClient(server.address, max_message_bytes=LIMIT) as pacer:
                source = ListPromptSource([Prompt("fits", [40_000]), Prompt("huge", [150_000])])
                worker = AsyncRolloutWorker(pacer, LongEngine(), source, max_groups=1, dispatch_wait=0.5,
                                            sampling=SamplingParams(max_tokens=200_000), shutdown_grace=5.0)
                return await asyncio.wait_for(worker.run(), 60)

        stats = asyncio.run(go())
        with PacerClient(server.address) as trainer:  # the default limit (64 MB) takes the whole group
            state, collected = trainer.state(), trainer.collect(1)
    assert stats.trajectories_too_large == 4  # every trajectory of the huge group
    assert stats.submit_calls >= 3  # the fitting group needed two Submits at least
    assert (state.submitted, state.collected, state.filtered) == (8, 1, 1)  # the FAILED group: dropped by status
    assert [g.prompt_id for g in collected] == ["fits"]
    assert [len(t.token_ids) for t in collected[0].trajectories] == [40_000] * 4


def test_stop_ends_a_worker_within_its_grace_while_its_submits_are_refused(tmp_path):
    # server.max_held_bytes of 1 byte: every Submit is refused RESOURCE_EXHAUSTED (back-pressure), for ever.
    overrides = core_overrides("no-window", B=2, stale=1.0, N=2, M=2)
    with ServerProcess(tmp_path, *overrides, "server.max_held_bytes=1") as server:
        async def go():
            async with AsyncPacerClient(server.address) as pacer:
                worker = AsyncRolloutWorker(pacer, LongEngine(), ListPromptSource([Prompt("p0", [50])]),
                                            max_groups=1, dispatch_wait=0.5, shutdown_grace=1.0,
                                            sampling=SamplingParams(max_tokens=100))
                task = asyncio.create_task(worker.run())
                deadline = asyncio.get_running_loop().time() + 30
                while worker.stats.submit_retries < 1:
                    assert asyncio.get_running_loop().time() < deadline, "the Submit was never refused"
                    await asyncio.sleep(0.02)
                worker.stop()
                return await asyncio.wait_for(task, 30)  # the grace is 1 s: it ends, it does not retry for ever

        stats = asyncio.run(go())
    assert stats.trajectories_given_up == 2 and stats.groups_given_up == 1 and stats.trajectories_refused == 0


def test_a_dispatch_reoffers_only_the_kept_groups_its_answer_can_carry(tmp_path):
    overrides = core_overrides("no-window", B=4, stale=1.0, N=2, continue_restored=True)
    with ServerProcess(tmp_path, *overrides, f"server.max_message_bytes={LIMIT}") as server:
        with PacerClient(server.address, max_message_bytes=LIMIT) as client:
            two_groups_of_600_kb(client)
            client.reset("abort", wait=0, resume=True, weight_version=1)
            first = client.dispatch(["n0", "n1"])
            assert [g.prompt_id for g in first.continuations] == ["a"] and first.admitted == ["n0"]
            second = client.dispatch(["n2"])
            assert [g.prompt_id for g in second.continuations] == ["b"] and second.admitted == []


def test_a_submit_over_the_servers_limit_is_refused_naming_that_limit(tmp_path):
    """A client allowing more than the server takes: gRPC refuses the request before any handler, with a bare
    RESOURCE_EXHAUSTED "Received message larger than max" (no reason, no setting named); the client says what to
    change. Nothing is accepted."""
    from coda_client.errors import ResourceExhaustedError

    overrides = core_overrides("no-window", B=4, stale=1.0, N=2)
    with ServerProcess(tmp_path, *overrides, f"server.max_message_bytes={LIMIT}") as server:
        with PacerClient(server.address) as client:  # its own limit: the default, far over the server's
            client.dispatch(["big"])
            with pytest.raises(ResourceExhaustedError) as refused:
                client.submit(payload_trajectories("big", 2, 600 * KB))
            assert "server.max_message_bytes" in refused.value.details and "larger than max" in refused.value.details
            assert refused.value.retry_delay is None
            state = client.state()
            assert (state.running, state.buffered) == (1, 0)
            client.submit(payload_trajectories("big", 2, 100 * KB))  # what fits is taken
            assert client.state().buffered == 1


def test_a_reset_answers_only_the_restored_groups_its_caller_can_receive_and_keeps_the_rest(tmp_path):
    """rollout.continue_restored=false: a Reset returns the assembled groups to its caller. Their trajectories once
    went into one answer whatever its size: a trainer whose client takes less than that got RESOURCE_EXHAUSTED (worded
    as its own request being too large), while the server had already handed the groups over, and a retry under the
    same request id got the same answer again: the groups were lost. The answer now carries what fits the caller's
    limit, oldest first, and the rest stay on the server, kept for continuation and named in kept_prompt_ids."""
    overrides = core_overrides("no-window", B=4, stale=1.0, N=2, continue_restored=False)
    with ServerProcess(tmp_path, *overrides) as server:  # the server's own limit: the default, far over LIMIT
        with PacerClient(server.address, max_message_bytes=LIMIT) as client:
            two_groups_of_600_kb(client)
            result = client.reset("abort", wait=0, resume=True, weight_version=1)
            assert [g.prompt_id for g in result.restored] == ["a"] and result.cut_to_fit
            assert result.kept_prompt_ids == ["b"]
            state = client.state()
            assert (state.restored, state.restored_kept) == (2, 1)
            continued = client.dispatch(["n0"])  # the group left out is re-offered, whole
            assert [g.prompt_id for g in continued.continuations] == ["b"]
            assert len(continued.continuations[0].trajectories) == 2
        assert "the Reset's answer carries 1 of 2 restored" in server.log(), server.log()


def test_quarantined_groups_a_reset_answer_cannot_carry_come_with_the_next_reset(tmp_path):
    """Quarantined groups (a FAILED trajectory with no status filter) are returned by the Reset; those its caller's
    limit leaves out stay quarantined and the next Reset returns them."""
    overrides = core_overrides("no-window", B=4, stale=1.0, N=2, filters="[]")
    with ServerProcess(tmp_path, *overrides) as server:
        with PacerClient(server.address, max_message_bytes=LIMIT) as client:
            two_groups_of_600_kb(client, TrajectoryStatus.FAILED)
            assert client.state().quarantined == 2
            first = client.reset("abort", wait=0, resume=True, weight_version=1)
            assert [g.prompt_id for g in first.quarantined] == ["a"] and first.cut_to_fit
            second = client.reset("abort", wait=0, resume=True, weight_version=2)
            assert [g.prompt_id for g in second.quarantined] == ["b"] and not second.cut_to_fit
            assert len(second.quarantined[0].trajectories) == 2


def test_a_dispatch_reoffers_only_the_kept_groups_its_callers_limit_can_carry(tmp_path):
    """A worker whose client takes less than the server's limit: the kept groups re-offered on Dispatch were sized to
    the server's limit, so the answer could exceed what the worker receives; its gRPC refused it after the server had
    handed the groups to it (running under it until a lease or its silence gave them back), and a retry under the
    same request id got the same answer again. Now they are sized to the caller's limit too."""
    overrides = core_overrides("no-window", B=4, stale=1.0, N=2, continue_restored=True)
    with ServerProcess(tmp_path, *overrides) as server:  # the server's own limit: the default, far over LIMIT
        with PacerClient(server.address) as trainer, PacerClient(server.address, max_message_bytes=LIMIT) as worker:
            two_groups_of_600_kb(trainer)
            assert trainer.reset("abort", wait=0, resume=True, weight_version=1).kept_prompt_ids == ["a", "b"]
            first = worker.dispatch(["n0", "n1"])
            assert [g.prompt_id for g in first.continuations] == ["a"] and first.admitted == ["n0"]
            second = worker.dispatch(["n2"])
            assert [g.prompt_id for g in second.continuations] == ["b"] and second.admitted == []


def test_an_answer_over_the_clients_own_limit_is_said_as_such_not_as_a_request_too_large(tmp_path):
    """gRPC's refusal of an answer at the client ("CLIENT: Received message larger than max") was worded as the
    client's request being over the server's limit, pointing at server.max_message_bytes and Submits. ListWorkers
    of a thousand held groups to a client taking 64 KiB: the error names the client's own limit."""
    from coda_client.errors import ResourceExhaustedError

    with ServerProcess(tmp_path, *core_overrides("no-window", B=1024, stale=1.0, N=2)) as server:
        with PacerClient(server.address, client_id="w1") as worker:
            worker.dispatch([f"prompt-{i:04d}-" + "x" * 100 for i in range(1000)])
        with PacerClient(server.address, max_message_bytes=65536) as operator:
            with pytest.raises(ResourceExhaustedError) as refused:
                operator.list_workers()
            assert len(operator.list_workers(max_groups_per_worker=10)[0].groups) == 10  # asking for less works
    assert "larger than this client takes" in refused.value.details, refused.value.details
    assert "server.max_message_bytes" not in refused.value.details, refused.value.details
