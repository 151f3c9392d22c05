"""A data-parallel trainer's run (CollectRequest.run): ranks killed together and started again at once, before the
server learnt of their death, all begin at one new global mini-batch; the run change survives a restart; a run
where it does not belong is refused."""
from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import threading

import grpc
import pytest

from coda_client import AsyncPacerClient, PacerClient, _calls
from coda_client._proto import pacer_pb2 as pb
from coda_client.errors import FailedPreconditionError
from coda_server.core import BatchShape
from coda_server.core.errors import LeaseExpiredError
from coda_server.core.leases import Leases
from server_harness import REPO_ROOT, ServerProcess, refusal_of, until
from test_shares import _fill_over_grpc, fill, make_pacer

M = 8  # trajectories: a global mini-batch of 4 groups of 2, a share of 2 groups for each of 2 ranks
GROUPS = M // 2  # a raw Collect's num_groups: the global mini-batch's
PROMPTS = [f"p{i:02d}" for i in range(12)]  # three global mini-batches, p00-p03 the oldest
# Far longer than the test: the server never learns of the killed ranks' death while it runs (as when the ranks
# are started again within server.trainer_liveness_seconds).
GRACE = 600.0

# An earlier launch's rank: it connects as the example's ranks do (client id rank-R, the same after a restart), takes
# `batches` shares (not acknowledging the last; the iterator prefetches the next), says "holding", and is killed.
OLD_RANK = """
import sys, time
from coda_client import PacerClient
address, rank, run, count = sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4])
pacer = PacerClient(address, client_id=f"rank-{rank}", timeout=30)
pacer.state()
if count:
    batches = pacer.batches(8, rank=rank, world_size=2, lease=600, poll=10, run=run)
    for _ in range(count):
        next(batches)
print("holding", flush=True)
time.sleep(600)
"""


def _server(tmp_path, *extra: str) -> ServerProcess:
    return ServerProcess(tmp_path, f"data_source.num_prompts_per_step={len(PROMPTS)}",
                         "data_source.num_trajectories_per_prompt=2", f"trainer.mini_batch_size={M}",
                         f"server.trainer_liveness_seconds={GRACE}", *extra)


def _fill(worker: PacerClient) -> None:
    _fill_over_grpc(worker, PROMPTS, [10] * len(PROMPTS))
    assert worker.state().buffered == len(PROMPTS)


def _take_share(client: PacerClient, rank: int, run: str = ""):
    """One rank's Collect of its share under `run` (a rank outside an iterator)."""
    call = _calls.collect(GROUPS, wait=10, allow_partial=False, request_id=None, timeout=30, lease=600.0, rank=rank,
                          world_size=2)
    call.request.run = run
    return client._run(call)


def _ids(groups) -> list[str]:
    return sorted(group.prompt_id for group in groups)


def _counts(state) -> tuple[int, ...]:
    return state.leased, state.buffered, state.redelivered, state.consumed


def _kill_the_earlier_launch(tmp_path, address: str, worker: PacerClient, run: str) -> None:
    """The earlier launch: rank 0 takes its share of the first mini-batch and its iterator prefetches its share of
    the second (rank 1's shares of both wait for it), rank 1 has taken none yet; then both are killed (-9)."""
    script = tmp_path / "old_rank.py"
    script.write_text(OLD_RANK)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))}
    ranks = [subprocess.Popen([sys.executable, str(script), address, str(rank), run, str(count)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
             for rank, count in ((0, 1), (1, 0))]
    try:
        for process in ranks:
            assert process.stdout.readline().strip() == "holding", process.stderr.read() if process.poll() else ""
        until(lambda: worker.state().leased == 8, "rank 0's prefetch to cut the second mini-batch", timeout=60)
    finally:
        for process in ranks:
            process.send_signal(signal.SIGKILL)
            process.wait(30)
            process.stdout.close()
            process.stderr.close()
    assert _counts(worker.state()) == (8, 4, 0, 0)  # nothing went back: the server does not know they died


def _start_ranks_again(address: str, run: str, num_batches: int | None, poll: float) -> dict[int, list[list[str]]]:
    """New ranks 0 and 1 (the same client ids) under `run`, each in its own client (thread): rank 1 first, rank 0
    once rank 1 has its first batch. Each batch's prompt ids, by rank."""
    seen: dict[int, list[list[str]]] = {0: [], 1: []}
    failures: list[BaseException] = []
    first = threading.Event()

    def rank_loop(rank: int) -> None:
        try:
            with PacerClient(address, timeout=30, client_id=f"rank-{rank}") as pacer, \
                    pacer.batches(M, rank=rank, world_size=2, lease=600, num_batches=num_batches, poll=poll,
                                  run=run) as batches:
                for batch in batches:
                    seen[rank].append(sorted(set(batch.prompt_id)))
                    first.set()
        except BaseException as exc:  # raised in the test's thread below
            failures.append(exc)
        finally:
            first.set()

    threads = {rank: threading.Thread(target=rank_loop, args=(rank,), daemon=True) for rank in (1, 0)}
    threads[1].start()
    assert first.wait(60), "rank 1 never got a batch"
    threads[0].start()
    for thread in threads.values():
        thread.join(120)
    assert not any(thread.is_alive() for thread in threads.values()), f"a rank never finished: {seen}"
    assert not failures, failures
    return seen


def test_ranks_killed_together_and_started_again_at_once_under_a_new_run_begin_at_one_mini_batch(tmp_path):
    """The user's torchrun restart: every rank killed at once and started again before the server learnt of it. Rank
    1 asks first: before, it claimed its still open share of the first mini-batch (cut by the dead rank 0, whose own
    share of it was still leased to the dead process) while the new rank 0 cut a new one, their k-th batches shares
    of different mini-batches, and at the end of the job one rank hung in its all-reduce. Under a new run the earlier
    run's shares all go back first (an Ack of one says why), and the ranks stay aligned to the end."""
    with _server(tmp_path) as server, PacerClient(server.address) as worker:
        _fill(worker)
        _kill_the_earlier_launch(tmp_path, server.address, worker, run="launch-0")
        stepped = _start_ranks_again(server.address, "launch-1", num_batches=2, poll=10)
        for k in range(2):
            assert sorted(stepped[0][k] + stepped[1][k]) == PROMPTS[4 * k:4 * k + 4], (k, stepped)
        assert worker.state().redelivered == 8  # the earlier run's four shares (two held, two waiting)
        with pytest.raises(FailedPreconditionError, match="started again as run 'launch-1'"):
            worker.ack("lease-1")  # the dead rank 0's share of the first mini-batch
        worker.end_job("abort", wait=5)
        drained = _start_ranks_again(server.address, "launch-1", num_batches=None, poll=1)
        assert len(drained[0]) == len(drained[1]) == 1, drained  # the last mini-batch, p08-p11, split
        trained = [prompt for rank in (0, 1) for batch in stepped[rank] + drained[rank] for prompt in batch]
        assert sorted(trained) == PROMPTS  # nothing twice, nothing lost
        assert _counts(worker.state()) == (0, 0, 8, len(PROMPTS))
        assert "started again as run 'launch-1': 4 share(s)" in server.log()


def test_without_a_run_ranks_started_again_at_once_take_shares_of_different_mini_batches(tmp_path):
    """The limit a run lifts: the same restart with no run named (an older client, or a trainer that names none). The
    new rank 1 claims its share of the first mini-batch, whose other share the dead rank 0 still holds, and the new
    rank 0 cuts the third: their first batches are shares of different mini-batches. Without a run, ranks killed
    together are restarted only after server.trainer_liveness_seconds (docs/trainer.md)."""
    with _server(tmp_path) as server, PacerClient(server.address) as worker:
        _fill(worker)
        _kill_the_earlier_launch(tmp_path, server.address, worker, run="")
        first = _start_ranks_again(server.address, "", num_batches=1, poll=10)
        assert set(first[1][0]) < set(PROMPTS[:4]) and set(first[0][0]) < set(PROMPTS[8:]), first
        assert worker.state().redelivered == 0


@pytest.mark.parametrize("reset", [False, True], ids=["journal", "snapshot"])
def test_a_server_killed_right_after_the_run_change_holds_the_same_state(tmp_path, reset):
    """kill -9 of the server right after rank 1 of a new run ended the earlier run's shares and cut a new mini-batch
    (with a Reset between: from its snapshot): the restarted server holds the same counts, tells an Ack of an earlier
    share why it ended, gives rank 0 its share of that new mini-batch (the run is the shape's: its Collect ends
    nothing), and a rank of a later run still ends the shares cut under this one."""
    state_dir = tmp_path / "state"
    server = _server(tmp_path, f"server.state_dir={state_dir}").start()
    try:
        with PacerClient(server.address) as worker:
            _fill(worker)
            old = _take_share(worker, 0, "A")  # rank 1's share of it waits
            first = _take_share(worker, 1, "B")  # A's shares go back first: a new cut of p00-p03
            assert set(_ids(first.groups)) < set(PROMPTS[:4])
            if reset:
                worker.reset("abort", wait=0, resume=True)  # the step boundary's snapshot holds the runs
            before = worker.state()
            assert _counts(before) == (4, 8, 4, 0)
        server.kill()
        server.close()
        server = _server(tmp_path, f"server.state_dir={state_dir}").start()
        with PacerClient(server.address) as worker:
            assert _counts(worker.state()) == _counts(before)
            with pytest.raises(FailedPreconditionError, match="started again as run 'B'"):
                worker.ack(old.lease_id)
            second = _take_share(worker, 0, "B")  # its share of rank 1's mini-batch, not a new one
            assert sorted(_ids(first.groups) + _ids(second.groups)) == PROMPTS[:4]
            assert _counts(worker.state()) == (4, 8, 4, 0)
            _take_share(worker, 0, "C")
            assert _counts(worker.state()) == (4, 8, 8, 0)  # B's two shares went back, then C's cut took 4
            with pytest.raises(FailedPreconditionError, match="started again as run 'C'"):
                worker.ack(first.lease_id)
    finally:
        server.close()


@pytest.mark.parametrize("request_fields, problem", [
    (dict(num_groups=GROUPS, lease_seconds=60, run="launch-0"), "needs world_size > 1"),
    (dict(num_groups=GROUPS, lease_seconds=60, world_size=1, token_budget=100, run="launch-0"),
     "needs world_size > 1"),
    (dict(num_groups=GROUPS, lease_seconds=60, world_size=2, run="r" * 65), "is 65 characters long; at most 64"),
    (dict(num_groups=GROUPS, lease_seconds=60, world_size=2, run="launch\n0"), "non-printable"),
], ids=["plain", "token-budget-single", "too-long", "not-printable"])
def test_a_run_where_it_does_not_belong_is_refused_naming_the_field(tmp_path, request_fields, problem):
    with _server(tmp_path, "server.max_id_length=64") as server, PacerClient(server.address) as worker:
        _fill(worker)
        with pytest.raises(grpc.RpcError) as raised:
            server.stub().Collect(pb.CollectRequest(**request_fields), timeout=30)
        refusal = refusal_of(raised.value)
        assert refusal.code == grpc.StatusCode.INVALID_ARGUMENT, refusal
        assert [name for name, _ in refusal.violations] == ["run"] and problem in refusal.violations[0][1], refusal
        assert _counts(worker.state()) == (0, 12, 0, 0)  # nothing taken


def test_the_iterators_take_a_run_only_with_world_size_above_one():
    """Said as the iterator is made, before any call (the server would refuse every Collect)."""
    with PacerClient("127.0.0.1:1") as client:
        with pytest.raises(ValueError, match="world_size > 1"):
            client.batches(token_budget=100, run="launch-0")

    async def make_async() -> None:
        async with AsyncPacerClient("127.0.0.1:1") as client:
            client.batches(token_budget=100, run="launch-0")

    with pytest.raises(ValueError, match="world_size > 1"):
        asyncio.run(make_async())


def test_the_async_iterator_sends_its_run(tmp_path):
    """AsyncPacerClient.batches(run=...): its rank Collects name the run, so the earlier run's shares go back."""
    with _server(tmp_path) as server, PacerClient(server.address) as worker:
        _fill(worker)
        old = _take_share(worker, 0, "A")

        async def take() -> list[str]:
            async with AsyncPacerClient(server.address) as client:
                async with client.batches(M, rank=0, world_size=2, num_batches=1, lease=60, poll=10,
                                          run="B") as batches:
                    return [sorted(set(batch.prompt_id)) async for batch in batches][0]

        assert asyncio.run(take()) == _ids(old.groups)  # the same groups (the same split), in a new mini-batch
        with pytest.raises(FailedPreconditionError, match="started again as run 'B'"):
            worker.ack(old.lease_id)


def test_an_empty_run_ends_nothing_and_a_first_named_run_ends_what_was_cut_under_none():
    """In process: a rank Collect naming no run is no new run (it keeps the shape's run); the first run named after
    shares cut under none is a change (a trainer that starts naming runs starts clean), as is any other run."""
    shape = {run: [BatchShape(rank=r, world_size=2, run=run) for r in range(2)] for run in ("", "x", "y")}
    pacer, _ = make_pacer()
    fill(pacer, {c: 10 for c in "abcdefgh"})
    unnamed = pacer.collect_now(4, lease_seconds=600, shape=shape[""][0])
    named = pacer.collect_now(4, lease_seconds=600, shape=shape["x"][1])  # ends the share cut under no run
    assert pacer.state().redelivered == 4 and _ids(named.groups) != [] and pacer.leases.runs[(2, 4, 0)][0] == "x"
    again = pacer.collect_now(4, lease_seconds=600, shape=shape[""][0])  # claims x's share: no run, no change
    assert sorted(_ids(named.groups) + _ids(again.groups)) == list("abcd") and pacer.state().redelivered == 4
    assert pacer.leases.runs[(2, 4, 0)][0] == "x"
    with pytest.raises(LeaseExpiredError, match="started again as run 'x'"):
        pacer.ack(unnamed.lease_id)
    pacer.collect_now(4, lease_seconds=600, shape=shape["y"][0])
    assert pacer.state().redelivered == 8  # x's two shares (both handed out) went back


def test_a_snapshot_keeps_each_shape_s_run_and_one_written_before_loads():
    """Leases.export/restore: the runs round-trip; a snapshot written before they were kept loads with none."""
    leases = Leases(0)
    leases.grant_shares((2, 4, 0), [[(1, "g1")], [(2, "g2")]], 0, 600, 0.0, "rank-0", "launch-0")
    snapshot = leases.export()
    restored = Leases(0)
    restored.restore(snapshot, 5.0)
    assert restored.runs == leases.runs == {(2, 4, 0): ("launch-0", ["lease-1", "lease-2"])}
    assert restored.run_change((2, 4, 0), "launch-1") == ["lease-1", "lease-2"]
    assert restored.run_change((2, 4, 0), "launch-0") == restored.run_change((2, 4, 0), "") == []
    older = Leases(0)
    older.restore({key: value for key, value in snapshot.items() if key != "share_runs"}, 5.0)
    assert older.runs == {} and older.run_change((2, 4, 0), "launch-1") == []
