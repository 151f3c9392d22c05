"""Data-parallel alignment: a rank's share given back unacknowledged (Release, its holder silent, its lease run out)
while another rank's share of its mini-batch still waits takes that mini-batch back whole, so that every rank's k-th
batch stays its share of one global mini-batch, across a server restart too."""
from __future__ import annotations

import threading

import pytest

from coda_client import PacerClient, _calls
from coda_client.errors import FailedPreconditionError
from coda_server.core import BatchShape
from server_harness import ServerProcess, until
from test_shares import _fill_over_grpc, fill, make_pacer

M = 8  # trajectories: a global mini-batch of 4 groups of 2, a share of 2 groups for each of 2 ranks
GROUPS = M // 2  # a raw Collect's num_groups: the global mini-batch's
PROMPTS = [f"p{i:02d}" for i in range(12)]  # three global mini-batches, p00-p03 the oldest
GRACE = 3.0  # server.trainer_liveness_seconds: short for the test, long enough for the live ranks' heartbeats


def _server(tmp_path, *extra: str) -> ServerProcess:
    return ServerProcess(tmp_path, f"data_source.num_prompts_per_step={len(PROMPTS)}",
                         "data_source.num_trajectories_per_prompt=2", f"trainer.mini_batch_size={M}", *extra)


def _fill(worker: PacerClient) -> None:
    _fill_over_grpc(worker, PROMPTS, [10] * len(PROMPTS))
    assert worker.state().buffered == len(PROMPTS)


def _take_share(client: PacerClient, rank: int, lease: float = 600.0, release_when_silent: bool = False):
    """One rank's Collect of its share (a dead or restarted rank's, outside an iterator)."""
    return client._run(_calls.collect(GROUPS, wait=10, allow_partial=False, request_id=None, timeout=30, lease=lease,
                                      rank=rank, world_size=2, release_when_silent=release_when_silent))


def _ids(groups) -> list[str]:
    return sorted(group.prompt_id for group in groups)


def _run_ranks(address: str, **batches_kwargs) -> dict[int, list[list[str]]]:
    """Both ranks iterate their shares at once, each in its own client (thread); each batch's prompt ids, by rank."""
    seen: dict[int, list[list[str]]] = {0: [], 1: []}
    failures: list[BaseException] = []

    def rank_loop(rank: int) -> None:
        try:
            with PacerClient(address, timeout=30) as pacer, \
                    pacer.batches(M, rank=rank, world_size=2, lease=600, **batches_kwargs) as batches:
                for batch in batches:
                    seen[rank].append(sorted(set(batch.prompt_id)))
        except BaseException as exc:  # raised in the test's thread below
            failures.append(exc)

    threads = [threading.Thread(target=rank_loop, args=(rank,), daemon=True) for rank in (0, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert not any(thread.is_alive() for thread in threads), f"a rank never finished: {seen}"
    assert not failures, failures
    return seen


def _check_aligned_to_the_end(address: str, worker: PacerClient) -> None:
    """The ranks' k-th batches are shares of the k-th global mini-batch (the oldest groups first, p00-p03 again), and
    after the job ends both drain the same count: every group trained once, by one rank."""
    stepped = _run_ranks(address, num_batches=2, poll=10)
    for k in range(2):
        assert sorted(stepped[0][k] + stepped[1][k]) == PROMPTS[4 * k:4 * k + 4], (k, stepped)
    worker.end_job("abort", wait=5)
    drained = _run_ranks(address, poll=1)
    assert len(drained[0]) == len(drained[1]) == 1, drained  # the last mini-batch, p08-p11, split
    trained = [prompt for rank in (0, 1) for batch in stepped[rank] + drained[rank] for prompt in batch]
    assert sorted(trained) == PROMPTS  # nothing twice, nothing lost
    state = worker.state()
    assert (state.consumed, state.leased, state.buffered) == (len(PROMPTS), 0, 0), state


def test_a_share_released_before_the_other_rank_asks_takes_its_mini_batch_back_and_the_ranks_stay_aligned(tmp_path):
    """The user's repro: rank 0's first step raises (its iterator releases its share) before rank 1 asked for its
    own. Rank 1's share went back with it: before, rank 1 then claimed its share of that mini-batch while rank 0 took
    a new one, every later pair of k-th batches came from two mini-batches, and after the end the ranks drained
    unequal counts (one rank's all-reduce hangs)."""
    with _server(tmp_path) as server, PacerClient(server.address) as worker:
        _fill(worker)
        with PacerClient(server.address, client_id="rank-0") as first_life:
            with pytest.raises(RuntimeError, match="step failed"):
                with first_life.batches(M, rank=0, world_size=2, num_batches=1, lease=600, poll=10) as batches:
                    assert set(next(batches).prompt_id) < set(PROMPTS[:4])
                    raise RuntimeError("rank 0's step failed")
        state = worker.state()
        assert (state.leased, state.buffered, state.redelivered) == (0, 12, 4), state  # before: 2 leased, 10, 2
        _check_aligned_to_the_end(server.address, worker)


def test_a_silent_ranks_share_takes_its_mini_batch_back_and_the_ranks_stay_aligned(tmp_path):
    """Rank 0 dies (as with kill -9: not a call more) holding its share, bound to its liveness, before rank 1 asked:
    its silence ends its share and rank 1's with it. An Ack of rank 1's share, had it been handed out, says so."""
    with _server(tmp_path, f"server.trainer_liveness_seconds={GRACE}") as server, \
            PacerClient(server.address) as worker:
        _fill(worker)
        with PacerClient(server.address, client_id="rank-0-dead") as dead:
            share = _take_share(dead, 0, release_when_silent=True)  # then not a call more: taken as gone
        until(lambda: worker.state().redelivered, "the dead rank's share to go back", timeout=60)
        state = worker.state()
        assert (state.leased, state.buffered, state.redelivered) == (0, 12, 4), state  # before: 2 leased, 10, 2
        with pytest.raises(FailedPreconditionError, match="was silent"):
            worker.ack(share.lease_id)
        sibling = f"lease-{int(share.lease_id.split('-')[1]) + 1}"  # rank 1's share, granted with it
        with pytest.raises(FailedPreconditionError, match="given back with the mini-batch it belonged to"):
            worker.ack(sibling)
        _check_aligned_to_the_end(server.address, worker)


def test_a_share_whose_lease_runs_out_goes_back_with_the_unclaimed_shares_of_its_mini_batch(tmp_path):
    """Rank 0's lease runs out before rank 1 asked. A guard: the unclaimed shares of a mini-batch get the lease of
    the Collect that cut it and a claim restarts a share's time, so they run out with that share (or before a
    share claimed later): this passed before the fix as well."""
    with _server(tmp_path) as server, PacerClient(server.address) as worker:
        _fill(worker)
        _take_share(worker, 0, lease=1.0)
        until(lambda: worker.state().leased == 0, "rank 0's lease to run out", timeout=60)
        state = worker.state()
        assert (state.leased, state.buffered, state.redelivered) == (0, 12, 4), state
        _check_aligned_to_the_end(server.address, worker)


def test_a_rank_heard_again_after_its_silence_does_not_get_back_a_share_whose_mini_batch_went_back():
    """In process: rank 0 cut off for longer than the grace, before rank 1 asked, is heard again naming its share. A
    single trainer gets its batch back then; this share is not given back, as its mini-batch went back whole (rank 0
    holding it again while rank 1 takes a share of a new mini-batch would misalign them). A share whose mini-batch's
    other shares were all handed out is still given back."""
    shape = [BatchShape(rank=r, world_size=2) for r in range(2)]
    pacer, clock = make_pacer()
    fill(pacer, {c: 10 for c in "abcdefgh"})
    alone = pacer.collect_now(4, lease_seconds=600, shape=shape[0], holder="rank-0")
    clock.now += 21  # silent for the grace (20 s)
    assert pacer.release_silent_workers()["rank-0"].lease_ids == [alone.lease_id]
    assert pacer.heard_from("rank-0", [alone.lease_id]) is None  # before the fix: its share given back
    assert (pacer.state().leased, pacer.state().buffered) == (0, 8)
    both = [pacer.collect_now(4, lease_seconds=600, shape=shape[r], holder=f"rank-{r}") for r in (0, 1)]
    assert sorted(g.prompt_id for share in both for g in share.groups) == list("abcd")
    clock.now += 21
    pacer.heard_from("rank-1")
    assert pacer.release_silent_workers()["rank-0"].lease_ids == [both[0].lease_id]
    assert pacer.heard_from("rank-0", [both[0].lease_id]).lease_ids == [both[0].lease_id]
    assert pacer.ack(both[0].lease_id) == pacer.ack(both[1].lease_id) == 2


def test_a_snapshot_keeps_which_shares_make_a_mini_batch_and_one_written_before_loads():
    """Leases.export/restore: the link from each share to its mini-batch round-trips; a snapshot written before it
    was kept (no such key) loads, those shares then ending alone, as they did."""
    from coda_server.core.leases import Leases

    leases = Leases(0)
    held = leases.grant_shares((2, 4, 0), [[(1, "g1")], [(2, "g2")]], 0, 600, 0.0, "rank-0")
    snapshot = leases.export()
    restored = Leases(0)
    restored.restore(snapshot, 5.0)
    assert restored.mini_batches == leases.mini_batches == {"lease-1": ("lease-1", "lease-2"),
                                                            "lease-2": ("lease-1", "lease-2")}
    assert [lease.lease_id for lease in restored.end([held.lease_id], "released")] == ["lease-1", "lease-2"]
    assert restored.open_shares == {}
    older = Leases(0)
    older.restore({key: value for key, value in snapshot.items() if key != "share_mini_batches"}, 5.0)
    assert older.mini_batches == {}
    assert [lease.lease_id for lease in older.end([held.lease_id], "released")] == ["lease-1"]


def _counts(state) -> tuple[int, ...]:
    return state.leased, state.buffered, state.redelivered, state.consumed


@pytest.mark.parametrize("kill", [False, True], ids=["sigterm", "kill-9"])
@pytest.mark.parametrize("released", ["before-restart", "after-restart", "after-a-reset-and-restart"])
def test_a_restarted_server_takes_back_the_same_mini_batch(tmp_path, kill, released):
    """A restart (SIGTERM or kill -9; the journal replayed) between rank 0's share going back and the ranks asking
    again holds what the live server held; and one between rank 0 taking its share and giving it back still knows
    which shares the mini-batch had, so the Release takes it back whole: from the journal's Collect, or from the
    snapshot a Reset wrote meanwhile (which keeps that link)."""
    state_dir = tmp_path / "state"
    server = _server(tmp_path, f"server.state_dir={state_dir}").start()
    try:
        with PacerClient(server.address) as worker:
            _fill(worker)
            first = _take_share(worker, 0)
            if released == "before-restart":
                assert worker.release(first.lease_id) == 2
            elif released == "after-a-reset-and-restart":
                worker.reset("abort", wait=0, resume=True)  # the step boundary's snapshot holds the leases
            before = worker.state()
        if kill:
            server.kill()
        else:
            assert server.terminate() == 0, server.log()
        server.close()
        server = _server(tmp_path, f"server.state_dir={state_dir}").start()
        with PacerClient(server.address) as worker:
            if released == "before-restart":
                assert _counts(worker.state()) == _counts(before) == (0, 12, 4, 0)  # before the fix: (2, 10, 2, 0)
            else:
                assert _counts(worker.state()) == _counts(before) == (4, 8, 0, 0)
                assert worker.release(first.lease_id) == 2
                assert _counts(worker.state()) == (0, 12, 4, 0)
            # Both ranks take their shares of a new mini-batch: the same groups, split as before.
            shares = {rank: _take_share(worker, rank) for rank in (1, 0)}
            assert _ids(shares[0].groups) == _ids(first.groups)
            assert sorted(_ids(shares[0].groups) + _ids(shares[1].groups)) == PROMPTS[:4]
            assert worker.ack(shares[0].lease_id) == worker.ack(shares[1].lease_id) == 2
    finally:
        server.close()
