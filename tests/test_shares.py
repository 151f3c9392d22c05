"""Data-parallel Collects: each rank's token-balanced share of one global mini-batch, token-budget mini-batches,
a dead rank's share delivered again, the split surviving a restart, and the trainer iterator over gRPC."""
from __future__ import annotations

import logging
import threading

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from coda_client import PacerClient, Trajectory as WireTrajectory, TrajectoryStatus as WireStatus
from coda_client.errors import BadRequestError
from coda_server.core import BatchShape, InvalidArgumentError, Pacer, PromptRef, Trajectory, load_config
from coda_server.core.shares import balanced_shares, largest_first
from fake_clock import FakeClock
from server_harness import ServerProcess


def make_pacer(journal=None) -> tuple[Pacer, FakeClock]:
    clock = FakeClock()
    config = load_config(overrides=["data_source.num_prompts_per_step=8", "data_source.num_trajectories_per_prompt=2",
                                    "trainer.mini_batch_size=2", "fully_async.sliding_window=no-window",
                                    "server.inflight_lease_seconds=0"])
    return Pacer(config, clock=clock, journal=journal), clock


def fill(pacer: Pacer, tokens: dict[str, int]) -> None:
    """One complete group of 2 per prompt, each trajectory `tokens[prompt]` tokens long, in this order."""
    pacer.dispatch([PromptRef(p) for p in tokens])
    for prompt_id, length in tokens.items():
        pacer.submit([Trajectory(f"{prompt_id}/{i}", prompt_id, num_tokens=length) for i in range(2)])


def tokens_of(groups) -> int:
    return sum(t.num_tokens for g in groups for t in g.trajectories)


LONG_TAILED = {"a": 10, "b": 400, "c": 20, "d": 30, "e": 350, "f": 15, "g": 25, "h": 40}


def test_balanced_shares_put_every_group_in_one_share_and_balance_tokens():
    tokens = [800, 20, 40, 700, 60, 30, 50, 25]
    shares = balanced_shares(tokens, 2, equal_counts=True)
    assert sorted(i for share in shares for i in share) == list(range(8))
    assert [len(share) for share in shares] == [4, 4]
    loads = [sum(tokens[i] for i in share) for share in shares]
    assert max(loads) - min(loads) <= 100  # the two long groups on different ranks
    # By tokens alone (no equal counts), the one long group can sit alone.
    assert balanced_shares([900, 100, 100, 100], 2, equal_counts=False) == [[0], [1, 2, 3]]


def test_an_exchange_evens_out_what_largest_first_leaves_uneven():
    # Largest first gives the ranks 90 + 70 + 60 = 220 and 90 + 70 + 20 = 180 tokens; swapping a 90 for a 70
    # gives 200 and 200.
    tokens = [90, 90, 70, 70, 60, 20]
    assert largest_first(tokens, 2, equal_counts=True)[1] == [220, 180]
    shares = balanced_shares(tokens, 2, equal_counts=True)
    assert [sum(tokens[i] for i in share) for share in shares] == [200, 200]
    assert [len(share) for share in shares] == [3, 3]


def test_every_rank_gets_a_group_when_some_groups_have_no_tokens():
    # Groups whose trajectories were all aborted before a token: by tokens alone, the first ranks would take them all.
    assert balanced_shares([50, 0, 0, 0], 3, equal_counts=False) == [[0], [1, 3], [2]]
    assert balanced_shares([0, 0], 2, equal_counts=False) == [[0], [1]]


@settings(max_examples=300, deadline=None)
@given(st.integers(1, 6).flatmap(lambda world_size: st.tuples(
    st.just(world_size), st.integers(1, 6), st.lists(st.integers(0, 40_000), min_size=world_size * 6,
                                                     max_size=world_size * 6), st.booleans())))
def test_shares_hold_every_group_once_and_the_exchanges_never_make_the_heaviest_heavier(case):
    world_size, per_rank, pool, equal_counts = case
    tokens = pool[:world_size * per_rank]
    shares = balanced_shares(tokens, world_size, equal_counts)
    assert sorted(i for share in shares for i in share) == list(range(len(tokens)))
    assert all(share == sorted(share) and share for share in shares)
    if equal_counts:
        assert [len(share) for share in shares] == [per_rank] * world_size
    assert max(sum(tokens[i] for i in share) for share in shares) <= max(largest_first(tokens, world_size,
                                                                                       equal_counts)[1])
    assert balanced_shares(tokens, world_size, equal_counts) == shares  # one split, whoever computes it


def _split(first: int) -> tuple[Pacer, dict]:
    pacer, _ = make_pacer()
    fill(pacer, LONG_TAILED)
    shape = [BatchShape(rank=r, world_size=2) for r in range(2)]
    answers = {}
    for rank in (first, 1 - first):
        answers[rank] = pacer.collect_now(8, lease_seconds=30, shape=shape[rank])
    return pacer, answers


def test_each_rank_gets_its_share_of_the_same_split_whichever_asks_first():
    pacer, answers = _split(0)
    ids = {rank: [g.prompt_id for g in answers[rank].groups] for rank in (0, 1)}
    assert sorted(ids[0] + ids[1]) == sorted(LONG_TAILED) and len(ids[0]) == len(ids[1]) == 4
    assert all(len(g.trajectories) == 2 for r in (0, 1) for g in answers[r].groups)  # groups whole
    assert ("b" in ids[0]) != ("e" in ids[0])  # the two long groups on different ranks
    loads = [tokens_of(answers[r].groups) for r in (0, 1)]
    assert max(loads) / (sum(loads) / 2) <= 1.1
    # The same split when rank 1 asks first (it depends only on the groups).
    _, reversed_answers = _split(1)
    assert {r: [g.prompt_id for g in reversed_answers[r].groups] for r in (0, 1)} == ids
    assert answers[0].lease_id != answers[1].lease_id
    assert pacer.ack(answers[0].lease_id) == 4 and pacer.ack(answers[1].lease_id) == 4
    state = pacer.state()
    assert (state.consumed, state.leased, state.buffered) == (8, 0, 0) and state.invariant_holds()


def test_a_rank_ahead_takes_the_next_mini_batch_and_the_other_rank_gets_both_shares_in_order():
    pacer, _ = make_pacer()
    fill(pacer, LONG_TAILED)
    shape = [BatchShape(rank=r, world_size=2) for r in range(2)]
    first0 = pacer.collect_now(4, lease_seconds=30, shape=shape[0])
    second0 = pacer.collect_now(4, lease_seconds=30, shape=shape[0])
    first1 = pacer.collect_now(4, lease_seconds=30, shape=shape[1])
    second1 = pacer.collect_now(4, lease_seconds=30, shape=shape[1])
    firsts = {g.prompt_id for g in first0.groups + first1.groups}
    assert firsts == {"a", "b", "c", "d"} and {g.prompt_id for g in second0.groups + second1.groups} == set("efgh")
    assert pacer.collect_now(4, lease_seconds=30, shape=shape[1]).timed_out  # nothing more for rank 1


def test_a_dead_ranks_share_returns_to_the_buffer_and_is_delivered_again():
    pacer, clock = make_pacer()
    fill(pacer, {"a": 10, "b": 20, "c": 30, "d": 40})
    shape = [BatchShape(rank=r, world_size=2) for r in range(2)]
    lost = pacer.collect_now(2, lease_seconds=30, shape=shape[0])  # rank 0 takes its share, then dies
    kept = pacer.collect_now(2, lease_seconds=30, shape=shape[1])
    pacer.ack(kept.lease_id)
    clock.now += 31
    assert pacer.expire_leases() == ([], [lost.lease_id])
    # The restarted rank 0 and rank 1 get the redelivered group (first in priority order again) in the next
    # global mini-batch, with the next group in the buffer.
    again = [pacer.collect_now(2, lease_seconds=30, shape=shape[r]) for r in (1, 0)]
    assert sorted(g.prompt_id for a in again for g in a.groups) == sorted([lost.groups[0].prompt_id, "c"])
    assert pacer.state().redelivered == 1


def test_a_released_share_returns_alone_and_at_once_while_the_other_rank_keeps_its_own():
    pacer, _ = make_pacer()
    fill(pacer, {"a": 10, "b": 20, "c": 30, "d": 40})
    shape = [BatchShape(rank=r, world_size=2) for r in range(2)]
    failed = pacer.collect_now(2, lease_seconds=600, shape=shape[0])  # rank 0's step raises: it gives its share back
    kept = pacer.collect_now(2, lease_seconds=600, shape=shape[1])
    assert pacer.release(failed.lease_id) == 1
    assert pacer.ack(kept.lease_id) == 1  # rank 1's share is untouched by rank 0's release
    state = pacer.state()
    assert (state.leased, state.buffered, state.redelivered) == (0, 3, 1)
    again = [pacer.collect_now(2, lease_seconds=600, shape=shape[r]) for r in (0, 1)]  # no lease had to run out
    assert sorted(g.prompt_id for a in again for g in a.groups) == sorted([failed.groups[0].prompt_id, "c"])


def test_a_share_no_rank_takes_lapses_and_its_rank_moves_on_to_the_next_mini_batch():
    pacer, clock = make_pacer()
    fill(pacer, {"a": 10, "b": 20})
    shape = [BatchShape(rank=r, world_size=2) for r in range(2)]
    taken = pacer.collect_now(2, lease_seconds=30, shape=shape[0])
    pacer.ack(taken.lease_id)
    clock.now += 31
    prompts, lapsed = pacer.expire_leases()
    assert len(lapsed) == 1  # rank 1's share, never taken
    late = pacer.collect_now(2, lease_seconds=30, shape=shape[1])
    assert late.timed_out and not late.groups  # its share went back: one group, not a mini-batch of two
    state = pacer.state()
    assert (state.buffered, state.leased) == (1, 0) and state.invariant_holds()


def test_token_budget_cuts_whole_groups_and_waits_for_the_budget():
    pacer, _ = make_pacer()
    fill(pacer, {"a": 100, "b": 100, "c": 300})  # groups of 200, 200, 600 tokens
    first = pacer.collect_now(0, lease_seconds=30, shape=BatchShape(token_budget=500))
    assert [g.prompt_id for g in first.groups] == ["a", "b"]  # c would go over the budget
    alone = pacer.collect_now(0, lease_seconds=30, shape=BatchShape(token_budget=500))
    assert [g.prompt_id for g in alone.groups] == ["c"]  # over the budget on its own: it goes alone
    fill(pacer, {"d": 100})
    assert pacer.collect_now(0, shape=BatchShape(token_budget=500)).timed_out  # 200 of 500: more may fit
    partial = pacer.collect_now(0, allow_partial=True, shape=BatchShape(token_budget=500))
    assert [g.prompt_id for g in partial.groups] == ["d"] and partial.timed_out


def test_token_budget_shares_are_balanced_by_tokens_alone():
    pacer, _ = make_pacer()
    fill(pacer, {"a": 300, "b": 50, "c": 50, "d": 50, "e": 50})  # 600, then four of 100
    shape = [BatchShape(token_budget=900, rank=r, world_size=2) for r in range(2)]
    shares = [pacer.collect_now(0, lease_seconds=30, shape=shape[r]) for r in range(2)]
    assert [[g.prompt_id for g in s.groups] for s in shares] == [["a"], ["b", "c", "d"]]
    assert [g.prompt_id for g in pacer.collect_now(1).groups] == ["e"]


def test_token_budget_gives_every_rank_a_group_when_some_groups_have_no_tokens():
    pacer, _ = make_pacer()
    fill(pacer, {"a": 25, "b": 0, "c": 0})  # 50 tokens, then two groups aborted before their first token
    shape = [BatchShape(token_budget=50, rank=r, world_size=3) for r in range(3)]
    shares = [pacer.collect_now(0, lease_seconds=30, shape=shape[r]) for r in range(3)]
    assert [[g.prompt_id for g in s.groups] for s in shares] == [["a"], ["b"], ["c"]]


@pytest.mark.parametrize("kwargs, field", [
    (dict(num_groups=3, lease_seconds=30, shape=BatchShape(rank=0, world_size=2)), "num_groups"),
    (dict(num_groups=4, lease_seconds=30, shape=BatchShape(rank=2, world_size=2)), "rank"),
    (dict(num_groups=2, lease_seconds=30, shape=BatchShape(rank=0, world_size=4)), "world_size"),
    (dict(num_groups=4, shape=BatchShape(rank=0, world_size=2)), "lease_seconds"),
    (dict(num_groups=0, shape=BatchShape()), "num_groups"),
])
def test_bad_shapes_are_refused_and_change_nothing(kwargs, field):
    pacer, _ = make_pacer()
    fill(pacer, LONG_TAILED)
    before = pacer.state()
    with pytest.raises(InvalidArgumentError) as caught:
        pacer.collect_now(**kwargs)
    assert caught.value.violations[0][0] == field
    assert pacer.state() == before


def test_the_open_shares_survive_a_restart(tmp_path):
    from coda_server.core.sqlite_journal import SqliteJournal

    shape = [BatchShape(rank=r, world_size=2) for r in range(2)]
    first, _ = make_pacer(journal=SqliteJournal(tmp_path / "state", fsync="off"))
    fill(first, LONG_TAILED)
    rank0 = first.collect_now(8, lease_seconds=30, shape=shape[0])
    expected = first.collect_now(8, lease_seconds=30, shape=shape[1])  # what rank 1 would have got
    first.journal.close()
    # The same history without rank 1's Collect: the restarted server still holds rank 1's share for it.
    second, _ = make_pacer(journal=SqliteJournal(tmp_path / "again", fsync="off"))
    fill(second, LONG_TAILED)
    assert second.collect_now(8, lease_seconds=30, shape=shape[0]).groups == rank0.groups
    second.journal.close()
    restarted, _ = make_pacer(journal=SqliteJournal(tmp_path / "again", fsync="off"))
    restarted.recover()
    rank1 = restarted.collect_now(8, lease_seconds=30, shape=shape[1])
    assert [g.prompt_id for g in rank1.groups] == [g.prompt_id for g in expected.groups]
    assert restarted.ack(rank0.lease_id) == 4 and restarted.ack(rank1.lease_id) == 4
    restarted.journal.close()


def _reversed_rule(tokens, world_size, equal_counts):
    """Another split rule, as a later server version might have: the shipped split with the ranks reversed."""
    return balanced_shares(tokens, world_size, equal_counts)[::-1]


def test_a_replay_hands_out_the_split_the_journal_recorded_whatever_rule_splits_now(tmp_path, monkeypatch):
    from coda_server.core import delivery
    from coda_server.core.sqlite_journal import SqliteJournal

    shape = [BatchShape(rank=r, world_size=2) for r in range(2)]
    first, _ = make_pacer(journal=SqliteJournal(tmp_path / "state", fsync="off"))
    fill(first, LONG_TAILED)
    rank0 = first.collect_now(8, lease_seconds=30, shape=shape[0])
    first.journal.close()
    # Restarted by a version whose rule splits this mini-batch otherwise: rank 0 holds its share already, so rank 1
    # must get the other groups, and rank 0's Ack must consume the groups rank 0 has.
    monkeypatch.setattr(delivery, "balanced_shares", _reversed_rule)
    restarted, _ = make_pacer(journal=SqliteJournal(tmp_path / "state", fsync="off"))
    restarted.recover()
    rank1 = restarted.collect_now(8, lease_seconds=30, shape=shape[1])
    got0, got1 = {g.prompt_id for g in rank0.groups}, {g.prompt_id for g in rank1.groups}
    assert got0.isdisjoint(got1) and got0 | got1 == set(LONG_TAILED)
    assert restarted.ack(rank0.lease_id) == 4 and restarted.ack(rank1.lease_id) == 4
    assert restarted.state().consumed == 8
    restarted.journal.close()


def test_a_collect_recorded_before_splits_were_reads_back_without_one():
    from coda_server.core.journal import Collected, PickledTrajectories, dumps, loads

    class OlderCollected:
        """Pickles as an older server wrote a rank's Collect: the event's fields up to num_groups."""

        def __reduce__(self):
            return Collected, (5.0, 8, False, "c-1", 30.0, 0, 0, 2, 8)

    read = loads(dumps(OlderCollected(), PickledTrajectories()), PickledTrajectories())
    assert read == Collected(5.0, 8, False, "c-1", 30.0, 0, 0, 2, 8, split=())


def test_a_recorded_split_that_does_not_fit_the_mini_batch_stops_the_replay_and_takes_nothing():
    pacer, _ = make_pacer()
    fill(pacer, LONG_TAILED)
    before = pacer.state()
    for split in [(0, 1), (0, 1, 0, 1, 0, 1, 0, 2)]:  # too few groups; a rank beyond the world size
        with pytest.raises(RuntimeError, match="recovery diverged"):
            pacer.apply_take(8, False, "c-1", 30.0, BatchShape(rank=0, world_size=2), 8, split=split)
    assert pacer.state() == before


# --- over gRPC, through the trainer's iterator ------------------------------------------------------------


def _wire_group(prompt_id: str, length: int) -> list[WireTrajectory]:
    return [WireTrajectory(trajectory_id=f"{prompt_id}/{i}", prompt_id=prompt_id, status=WireStatus.COMPLETED,
                           token_ids=np.arange(length, dtype=np.int32), logprobs=np.zeros(length, np.float32),
                           loss_mask=np.ones(length, np.int32)) for i in range(2)]


def _fill_over_grpc(worker: PacerClient, prompts: list[str], lengths: list[int]) -> None:
    """Dispatch `prompts` and submit one complete group of 2 for each, its trajectories `lengths[i]` tokens long."""
    worker.dispatch(prompts)
    for prompt_id, length in zip(prompts, lengths):
        worker.submit(_wire_group(prompt_id, length))


def _shape_warnings(caplog) -> list[str]:
    """The client's warnings of ranks that disagree on the shape (_IteratorBase._note_other_shapes)."""
    return [r.getMessage() for r in caplog.records if "another shape" in r.getMessage()]


def test_ranks_iterate_their_shares_of_every_global_mini_batch(tmp_path):
    lengths = [5, 300, 7, 9, 250, 11, 13, 17] * 2  # two global mini-batches of 8 groups
    prompts = [f"p{i}" for i in range(len(lengths))]
    with ServerProcess(tmp_path, "data_source.num_prompts_per_step=16", "data_source.num_trajectories_per_prompt=2",
                       "trainer.mini_batch_size=16") as server, PacerClient(server.address) as worker:
        _fill_over_grpc(worker, prompts, lengths)
        seen: dict[int, list[list[str]]] = {}
        tokens: dict[int, list[int]] = {}

        def rank_loop(rank: int) -> None:
            with PacerClient(server.address) as pacer, \
                    pacer.batches(16, rank=rank, world_size=2, num_batches=2, lease=60, poll=10) as batches:
                for batch in batches:
                    seen.setdefault(rank, []).append(list(dict.fromkeys(batch.prompt_id)))
                    tokens.setdefault(rank, []).append(batch.num_tokens)

        threads = [threading.Thread(target=rank_loop, args=(r,)) for r in (0, 1)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
        assert len(seen[0]) == len(seen[1]) == 2
        for step in range(2):
            union = seen[0][step] + seen[1][step]
            assert sorted(union) == sorted(prompts[8 * step:8 * step + 8])  # each global mini-batch, split
            assert len(seen[0][step]) == len(seen[1][step]) == 4
            assert max(tokens[0][step], tokens[1][step]) / ((tokens[0][step] + tokens[1][step]) / 2) <= 1.1
        state = worker.state()
        assert (state.consumed, state.leased, state.buffered) == (16, 0, 0)


def test_a_rank_collect_with_a_bad_shape_is_refused_over_grpc(tmp_path):
    with ServerProcess(tmp_path, "data_source.num_prompts_per_step=4", "data_source.num_trajectories_per_prompt=2",
                       "trainer.mini_batch_size=4") as server, PacerClient(server.address) as pacer:
        with pytest.raises(ValueError, match="world_size 2 does not divide"):
            pacer.batches(6, rank=0, world_size=2)
        from coda_client import _calls
        with pytest.raises(BadRequestError) as caught:
            pacer._run(_calls.collect(3, wait=0, allow_partial=False, request_id=None, timeout=10, lease=10,
                                      rank=0, world_size=2))
        assert "multiple of world_size" in str(caught.value)


def test_async_ranks_share_token_budget_mini_batches(tmp_path):
    """The async iterator: the group size comes from the server, the mini-batches are cut by tokens and
    split between two ranks running as tasks of one event loop."""
    import asyncio

    from coda_client import AsyncPacerClient

    lengths = [400, 10, 20, 30, 40, 50, 60, 70]  # groups of 2: 800, 20, 40, ... tokens
    prompts = [f"q{i}" for i in range(len(lengths))]
    with ServerProcess(tmp_path, "data_source.num_prompts_per_step=8", "data_source.num_trajectories_per_prompt=2",
                       "trainer.mini_batch_size=4") as server, PacerClient(server.address) as worker:
        _fill_over_grpc(worker, prompts, lengths)

        async def rank_loop(rank: int) -> list[tuple[list[str], int]]:
            taken = []
            async with AsyncPacerClient(server.address) as pacer:
                async with pacer.batches(token_budget=1099, rank=rank, world_size=2, num_batches=1, lease=60,
                                         poll=10) as batches:
                    async for batch in batches:
                        taken.append((list(dict.fromkeys(batch.prompt_id)), batch.num_tokens))
            return taken

        async def both() -> list:
            return await asyncio.gather(rank_loop(0), rank_loop(1))

        shares = asyncio.run(asyncio.wait_for(both(), 60))
        (ids0, tokens0), = shares[0]
        (ids1, tokens1), = shares[1]
        # The oldest groups within 1,099 tokens (800 + 20 + 40 + 60 + 80 = 1,000; the next, 100, would go over),
        # split by tokens alone: the long group alone on one rank, the four short ones on the other.
        assert sorted(ids0 + ids1) == prompts[:5]
        assert sorted([tokens0, tokens1]) == [200, 800]
        assert worker.state().buffered == 3


def test_a_rank_asking_with_another_shape_while_shares_wait_is_reported() -> None:
    """Ranks that disagree on the shape (here world_size) each get shares of different mini-batches: not refused (a
    trainer restarted with another world size leaves such shares behind), but the answer says which shapes' shares
    wait, and the server logs it."""
    pacer, _ = make_pacer()
    fill(pacer, LONG_TAILED)
    first = pacer.collect_now(4, lease_seconds=30, shape=BatchShape(rank=0, world_size=2))
    assert first.other_shapes_waiting == ()
    other = pacer.collect_now(4, lease_seconds=30, shape=BatchShape(rank=1, world_size=4))
    assert other.other_shapes_waiting == ((2, 4, 0),)  # rank 1's share of the world_size 2 mini-batch waits
    claimed = pacer.collect_now(4, lease_seconds=30, shape=BatchShape(rank=1, world_size=2))
    assert claimed.other_shapes_waiting == ()  # a share claimed, no new mini-batch taken: nothing to report
    fill(pacer, {"i": 10, "j": 20, "k": 30, "l": 40})
    again = pacer.collect_now(4, lease_seconds=30, shape=BatchShape(rank=1, world_size=4))
    assert again.groups and again.other_shapes_waiting == ()  # a new mini-batch; world_size 2's shares all taken
    assert pacer.state().invariant_holds()


def test_the_server_logs_ranks_that_disagree_on_the_shape(caplog) -> None:
    import asyncio
    import logging

    from coda_server.core.async_pacer import AsyncPacer

    pacer, _ = make_pacer()
    fill(pacer, LONG_TAILED)
    facade = AsyncPacer(pacer)

    async def run() -> None:
        facade.bind_loop()
        try:
            await facade.collect(4, lease_seconds=30, shape=BatchShape(rank=0, world_size=2))
            await facade.collect(4, lease_seconds=30, shape=BatchShape(rank=1, world_size=4))
        finally:
            facade.drain()

    with caplog.at_level(logging.WARNING, logger="coda_server.leases"):
        asyncio.run(run())
    warnings = [r.getMessage() for r in caplog.records if "wait for their ranks" in r.getMessage()]
    assert len(warnings) == 1
    assert "rank 1 took a new global mini-batch of world_size 4, 4 groups" in warnings[0]
    assert "shares of world_size 2, 4 groups wait" in warnings[0]


def test_ranks_that_disagree_on_the_shape_are_told_in_the_trainer_over_grpc(tmp_path, caplog):
    """Rank 0 passes world_size 2, rank 1 world_size 4: each is served, and the rank whose Collect took a new
    global mini-batch while the other shape's share waited gets the other shape in its answer, and its batches()
    logs a warning in the trainer's own process."""
    import logging

    from coda_client import CollectShape, _calls

    prompts = [f"p{i}" for i in range(10)]
    with ServerProcess(tmp_path, "data_source.num_prompts_per_step=12", "data_source.num_trajectories_per_prompt=2",
                       "trainer.mini_batch_size=8") as server, PacerClient(server.address) as pacer:
        _fill_over_grpc(pacer, prompts, [10] * len(prompts))
        with caplog.at_level(logging.WARNING, logger="coda_client.batches"):
            with pacer.batches(8, rank=0, world_size=2, num_batches=1, lease=60, poll=5) as first:
                next(first)
            assert not _shape_warnings(caplog)
            with pacer.batches(8, rank=1, world_size=4, num_batches=1, lease=60, poll=5) as other:
                next(other)
        warnings = _shape_warnings(caplog)
        assert len(warnings) == 1 and "rank 1 of 4" in warnings[0] and "(world_size 2, 4 groups)" in warnings[0]
        # The answer itself names every shape whose shares wait (for any client, in any language).
        raw = pacer._run(_calls.collect(2, wait=5, allow_partial=False, request_id=None, timeout=10, lease=60,
                                        rank=0, world_size=2))
        assert len(raw.groups) == 1
        assert set(raw.other_shapes_waiting) == {CollectShape(2, 4, 0), CollectShape(4, 4, 0)}


def test_the_async_iterator_warns_of_ranks_that_disagree_too(tmp_path, caplog):
    import asyncio
    import logging

    from coda_client import AsyncPacerClient

    prompts = [f"p{i}" for i in range(8)]
    with ServerProcess(tmp_path, "data_source.num_prompts_per_step=8", "data_source.num_trajectories_per_prompt=2",
                       "trainer.mini_batch_size=8") as server, PacerClient(server.address) as worker:
        _fill_over_grpc(worker, prompts, [10] * len(prompts))

        async def ranks() -> None:
            async with AsyncPacerClient(server.address) as pacer:
                for rank, world_size in ((0, 2), (3, 4)):
                    async with pacer.batches(8, rank=rank, world_size=world_size, num_batches=1, lease=60,
                                             poll=5) as batches:
                        async for _ in batches:
                            pass

        with caplog.at_level(logging.WARNING, logger="coda_client.batches"):
            asyncio.run(asyncio.wait_for(ranks(), 60))
        warnings = _shape_warnings(caplog)
        assert len(warnings) == 1 and "rank 3 of 4" in warnings[0] and "(world_size 2, 4 groups)" in warnings[0]


async def _all_waiting(facade, calls: list) -> None:
    """Until every one of `calls` waits in the pacer (one that ended early raises here)."""
    import asyncio

    while facade.waits.waiting_calls < len(calls):
        for call in calls:
            if call.done():
                call.result()
        await asyncio.sleep(0)


def test_waiting_ranks_sleep_through_submits_that_cannot_complete_their_mini_batch(poll_attempts) -> None:
    """Four ranks wait for their shares of a mini-batch of 8 groups: the first 7 Submits do not wake them (no
    attempt each, which 64 ranks paid on every Submit); the 8th answers all four, two groups each."""
    import asyncio

    from coda_server.core import polls
    from coda_server.core.async_pacer import AsyncPacer

    attempts = poll_attempts(polls.CollectPoll)
    pacer, _ = make_pacer()
    facade = AsyncPacer(pacer)
    prompts = list(LONG_TAILED)

    async def run() -> tuple[int, list[int]]:
        facade.bind_loop()
        try:
            await facade.dispatch([PromptRef(p) for p in prompts])
            ranks = [asyncio.ensure_future(facade.collect(8, wait=30, lease_seconds=30,
                                                          shape=BatchShape(rank=r, world_size=4)))
                     for r in range(4)]
            await asyncio.wait_for(_all_waiting(facade, ranks), 10)
            waiting_attempts = attempts[0]
            for prompt_id in prompts[:-1]:
                await facade.submit([Trajectory(f"{prompt_id}/{i}", prompt_id, num_tokens=LONG_TAILED[prompt_id])
                                     for i in range(2)])
                for _ in range(5):
                    await asyncio.sleep(0)
            slept = attempts[0] - waiting_attempts
            last = prompts[-1]
            await facade.submit([Trajectory(f"{last}/{i}", last, num_tokens=LONG_TAILED[last]) for i in range(2)])
            answers = await asyncio.wait_for(asyncio.gather(*ranks), 10)
            return slept, [len(answer.groups) for answer in answers]
        finally:
            facade.drain()

    slept, shares = asyncio.run(run())
    assert slept == 0
    assert shares == [2, 2, 2, 2]


def test_after_a_crash_each_rank_gets_the_share_it_was_split_and_nothing_twice(tmp_path):
    """kill -9 while rank 0 trains its share and rank 1 has not asked for its own: the restarted server (same port,
    same state) takes rank 0's Ack and hands rank 1 the rest of that mini-batch, each group once."""
    from test_durability_crash import free_port

    lengths = [5, 300, 7, 9, 250, 11, 13, 17]
    prompts = [f"p{i}" for i in range(len(lengths))]
    overrides = ("data_source.num_prompts_per_step=8", "data_source.num_trajectories_per_prompt=2",
                 "trainer.mini_batch_size=16", f"server.address=127.0.0.1:{free_port()}",
                 f"server.state_dir={tmp_path / 'state'}")
    running = ServerProcess(tmp_path, *overrides).start()
    try:
        with PacerClient(running.address, timeout=30) as worker, PacerClient(running.address, timeout=30) as rank0:
            _fill_over_grpc(worker, prompts, lengths)
            batches0 = rank0.batches(16, rank=0, world_size=2, num_batches=1, lease=120, poll=5)
            share0 = next(batches0)
            running.kill()  # kill -9: rank 1's share was split but never handed out
            running.close()
            running = ServerProcess(tmp_path, *overrides).start()
            assert batches0.ack() == 4  # lands on the restarted server, which kept the lease
            batches0.close()
            with PacerClient(running.address, timeout=30) as rank1, \
                    rank1.batches(16, rank=1, world_size=2, num_batches=1, lease=120, poll=5) as batches1:
                [share1] = list(batches1)
            got0, got1 = set(share0.prompt_id), set(share1.prompt_id)
            assert got0.isdisjoint(got1) and got0 | got1 == set(prompts) and len(got0) == len(got1) == 4
            state = worker.state()
            assert (state.consumed, state.redelivered, state.leased, state.buffered) == (8, 0, 0, 0), state
    finally:
        running.close()


def test_a_token_budget_a_full_window_cannot_reach_takes_the_full_buffer_over_grpc(tmp_path):
    """The window holds at most C = 4 groups; a budget above what they hold waited for ever (nothing more could
    arrive) and is answered with the whole buffer instead; ranks that could never each get a group are refused."""
    with ServerProcess(tmp_path, "data_source.num_prompts_per_step=4", "data_source.num_trajectories_per_prompt=2",
                       "trainer.mini_batch_size=2", "fully_async.sliding_window=windowed-fifo",
                       "fully_async.stale_steps=0") as server, PacerClient(server.address) as worker:
        prompts = ["w0", "w1", "w2", "w3"]
        _fill_over_grpc(worker, prompts, [3, 4, 5, 6])
        assert worker.dispatch(["w4"]).admitted == []  # the window is full: nothing more can arrive
        from coda_client import _calls
        first = worker._run(_calls.collect(0, wait=10, allow_partial=False, request_id=None, timeout=30, lease=60,
                                           token_budget=10**9))
        assert not first.timed_out and [g.prompt_id for g in first.groups] == prompts  # before: timed out, empty
        worker.release(first.lease_id)
        with worker.batches(token_budget=10**9, num_batches=1, lease=60, poll=5) as batches:
            batch, = list(batches)
            assert list(dict.fromkeys(batch.prompt_id)) == prompts and batch.num_tokens == 2 * (3 + 4 + 5 + 6)
        with pytest.raises(BadRequestError, match="world_size 5") as refused:
            with worker.batches(token_budget=100, rank=0, world_size=5, num_batches=1, lease=60, poll=5) as batches:
                next(iter(batches))
        assert "at most 4" in str(refused.value)


def test_a_collect_of_more_than_the_window_that_the_buffer_holds_now_is_answered_over_grpc(tmp_path):
    """Leased groups do not count against the window, so a lease given back can take the buffer past C. A Collect of
    what the buffer holds then was refused as one that "could never be answered"; it is answered. One of more than
    the buffer holds and than C is still refused at once."""
    with ServerProcess(tmp_path, "data_source.num_prompts_per_step=4", "data_source.num_trajectories_per_prompt=2",
                       "trainer.mini_batch_size=2", "fully_async.sliding_window=windowed-fifo",
                       "fully_async.stale_steps=0") as server, PacerClient(server.address) as pacer:
        _fill_over_grpc(pacer, ["o0", "o1", "o2", "o3"], [3, 3, 3, 3])
        leased = pacer.collect_result(4, lease=60)
        _fill_over_grpc(pacer, ["o4", "o5", "o6", "o7"], [3, 3, 3, 3])  # the window is free again: C = 4 more
        assert pacer.release(leased.lease_id) == 4
        assert pacer.state().buffered == 8
        with pytest.raises(BadRequestError, match="num_groups 9"):
            pacer.collect(9, wait=5)
        taken = pacer.collect(8, wait=5)
        assert sorted(g.prompt_id for g in taken) == [f"o{i}" for i in range(8)]


def test_a_token_budget_below_one_groups_tokens_is_warned_of_once(tmp_path, caplog):
    """Groups are never cut, so a group over token_budget comes as a mini-batch of its own: said once per iterator
    (it passed without a word: every batch over the budget), naming the group, its tokens and the budget."""
    with ServerProcess(tmp_path, "data_source.num_prompts_per_step=4", "data_source.num_trajectories_per_prompt=2",
                       "trainer.mini_batch_size=2") as server, PacerClient(server.address) as pacer:
        _fill_over_grpc(pacer, ["b0", "b1"], [30, 40])
        with caplog.at_level(logging.WARNING, logger="coda_client.batches"):
            with pacer.batches(token_budget=50, num_batches=2, lease=60, poll=5) as batches:
                sizes = [batch.num_tokens for batch in batches]
    assert sizes == [60, 80], sizes  # each group over the budget, alone in its mini-batch
    warned = [r.getMessage() for r in caplog.records if "more than token_budget" in r.getMessage()]
    assert len(warned) == 1 and "group 'b0' holds 60 tokens, more than token_budget=50" in warned[0], warned
