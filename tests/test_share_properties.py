"""Property-based: random histories of data-parallel ranks (Submits, each rank's Collects and Acks, leases running
out, restarts from the journal) against what the shares promise: every group to one rank at a time and whole,
equal counts, nothing lost or consumed twice, the same state after a restart."""
from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from coda_server.core import BatchShape, Pacer, PromptRef, Trajectory, load_config
from coda_server.core.sqlite_journal import SqliteJournal
from fake_clock import FakeClock

GROUPS = 24  # prompts dispatched up front, each a group of 2
LEASE_SECONDS = 30.0


def new_pacer(clock: FakeClock, journal: SqliteJournal) -> Pacer:
    config = load_config(overrides=[f"data_source.num_prompts_per_step={GROUPS}",
                                    "data_source.num_trajectories_per_prompt=2", "trainer.mini_batch_size=2",
                                    "fully_async.sliding_window=no-window", "server.inflight_lease_seconds=0"])
    return Pacer(config, clock=clock, journal=journal)


def counts(pacer: Pacer) -> tuple:
    state = pacer.state()
    return (state.buffered, state.leased, state.consumed, state.collected, state.redelivered)


operations = st.lists(st.one_of(
    # Groups complete, their trajectories this long (0: aborted before their first token).
    st.tuples(st.just("submit"), st.lists(st.one_of(st.just(0), st.integers(1, 400)), min_size=1, max_size=4)),
    st.tuples(st.just("collect"), st.integers(0, 3)),  # rank r asks for its share
    st.tuples(st.just("ack"), st.integers(0, 3)),  # rank r acknowledges its oldest share
    st.tuples(st.just("expire"), st.just(0)),  # time passes beyond every lease: the shares not acknowledged lapse
    st.tuples(st.just("restart"), st.just(0)),  # the server restarts from its journal
), min_size=1, max_size=60)


# per_rank: groups per rank of a global mini-batch of world_size x per_rank groups; or (per_rank 0) a token
# budget of 1,000 per global mini-batch, the counts free (at least one group per rank).
@pytest.mark.parametrize("world_size, per_rank", [(2, 1), (2, 2), (3, 2), (4, 1), (2, 0), (3, 0)])
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(history=operations)
def test_random_rank_histories_keep_every_group_once_and_whole(tmp_path_factory, world_size, per_rank, history):
    directory = tmp_path_factory.mktemp("state")
    clock = FakeClock()
    pacer = new_pacer(clock, SqliteJournal(directory, fsync="off"))
    pacer.dispatch([PromptRef(f"p{i}") for i in range(GROUPS)])
    mini_batch = world_size * per_rank
    budget = 0 if per_rank else 1000

    def shape(rank: int) -> BatchShape:
        return BatchShape(token_budget=budget, rank=rank, world_size=world_size)
    submitted = 0
    held: dict[int, list[tuple[str, list[str]]]] = {r: [] for r in range(world_size)}  # rank -> (lease, prompts)
    consumed: list[str] = []
    try:
        for op, arg in history:
            if op == "submit":
                for length in arg[:GROUPS - submitted]:
                    prompt_id = f"p{submitted}"
                    pacer.submit([Trajectory(f"{prompt_id}/{i}", prompt_id, num_tokens=length) for i in range(2)])
                    submitted += 1
            elif op == "collect" and arg < world_size:
                answer = pacer.collect_now(mini_batch, lease_seconds=LEASE_SECONDS, shape=shape(arg))
                if not answer.timed_out:
                    assert len(answer.groups) == per_rank if per_rank else answer.groups  # equal counts, or some
                    assert all(len(g.trajectories) == 2 for g in answer.groups)  # whole
                    held[arg].append((answer.lease_id, [g.prompt_id for g in answer.groups]))
                else:
                    assert not answer.groups
            elif op == "ack" and arg < world_size and held[arg]:
                lease_id, prompts = held[arg].pop(0)
                assert pacer.ack(lease_id) == len(prompts)
                consumed += prompts
            elif op == "expire":
                clock.now += LEASE_SECONDS + 1
                pacer.expire_leases()
                held = {r: [] for r in range(world_size)}  # the ranks' shares went back to the buffer
            elif op == "restart":
                before = counts(pacer)
                pacer.journal.close()
                pacer = new_pacer(clock, SqliteJournal(directory, fsync="off"))
                pacer.recover()
                assert counts(pacer) == before
            # A group is with one rank at a time, and once consumed never goes out again.
            out = [p for shares in held.values() for _, prompts in shares for p in prompts]
            assert len(out) == len(set(out)) and not set(out) & set(consumed)
            assert len(consumed) == len(set(consumed))
            state = pacer.state()
            assert state.invariant_holds()
            assert state.consumed == len(consumed)
            # Nothing lost: each complete group is buffered, leased (taken or waiting for its rank) or consumed.
            assert state.buffered + state.leased + state.consumed == submitted
        # Whatever is left drains: every rank takes and acknowledges its shares until fewer than a mini-batch wait.
        for lease_id, _ in (entry for shares in held.values() for entry in shares):
            pacer.ack(lease_id)
        clock.now += LEASE_SECONDS + 1
        pacer.expire_leases()  # shares waiting for a rank that never came back go back to the buffer
        while True:
            answers = [pacer.collect_now(mini_batch, lease_seconds=LEASE_SECONDS, shape=shape(r))
                       for r in range(world_size)]
            if all(a.timed_out for a in answers):
                break
            for answer in answers:
                assert not answer.timed_out  # every rank's share of the same global mini-batch
                pacer.ack(answer.lease_id)
        state = pacer.state()
        assert state.leased == 0
        if per_rank:
            assert state.buffered < mini_batch
        assert state.buffered + state.consumed == submitted
    finally:
        pacer.journal.close()
