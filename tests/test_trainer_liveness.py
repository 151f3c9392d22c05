"""Trainer liveness: a trainer that dies holding leased batches (kill -9, a lost node) has them delivered again
within the liveness grace, first in line, not after its lease; a live one heartbeats and keeps them."""
from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import textwrap
import time
from typing import Any, Callable

import grpc
import pytest

from coda_client import PacerClient
from coda_client._proto import pacer_pb2 as pb, pacer_pb2_grpc
from coda_server.core import PromptRef
from coda_server.core.errors import InvalidArgumentError, LeaseExpiredError
from conftest import REPO_ROOT
from server_harness import ServerProcess, until
from test_leases import group, make_pacer

GRACE = 3.0  # seconds: short for the test, long enough for a heartbeat every second on a busy machine
LEASE = 600.0  # far beyond any wait here: only liveness can bring the groups back in time
N = 2


# --- in process ---------------------------------------------------------------------------------------


def _filled(*overrides: str, prompts: str = "abcd", journal=None):
    pacer, clock = make_pacer("server.inflight_lease_seconds=0", "server.worker_liveness_seconds=20", *overrides,
                              journal=journal)
    pacer.dispatch([PromptRef(p) for p in prompts])
    for prompt_id in prompts:
        pacer.submit(group(prompt_id))
    return pacer, clock


def test_a_silent_holders_leases_go_back_first_in_line_and_a_heard_ones_stay():
    pacer, clock = _filled()
    held = pacer.collect_now(2, lease_seconds=LEASE, holder="trainer-1")
    plain = pacer.collect_now(1, lease_seconds=LEASE)  # no holder: bound by its time alone
    clock.now += 15
    pacer.heard_from("trainer-1")  # a heartbeat
    clock.now += 15  # 30 s after the Collect, 15 after the heartbeat: alive
    assert pacer.release_silent_workers() == {}
    assert pacer.state().leased == 3
    clock.now += 6  # 21 s without a call: gone
    [(holder, lost)] = pacer.release_silent_workers().items()
    assert (holder, lost.lease_ids, lost.leased_groups, lost.prompt_ids) == ("trainer-1", [held.lease_id], 2, [])
    state = pacer.state()
    assert (state.leased, state.buffered, state.redelivered) == (1, 3, 2) and state.invariant_holds()
    assert [g.prompt_id for g in pacer.collect_now(3).groups] == ["a", "b", "d"]  # first in line, in order
    with pytest.raises(LeaseExpiredError, match="its holder trainer-1 was silent for 20 s"):  # taken as gone
        pacer.ack(held.lease_id)
    assert pacer.ack(plain.lease_id) == 1


@pytest.mark.parametrize("trainer_grace, lapses_after", [("120", 120), ("null", 20), ("0", None), ("5", 5)])
def test_a_trainers_grace_of_its_own_lets_a_step_be_silent_longer_than_a_worker_may(trainer_grace, lapses_after):
    """server.trainer_liveness_seconds: a step holding the GIL (and with it the heartbeats) for longer than the workers'
    grace kept its leases only by giving every worker that long grace too. A worker silent for its 20 s loses its
    running groups while the trainer's leases stay until the trainer's own grace (null: the workers', 0: never)."""
    pacer, clock = _filled(f"server.trainer_liveness_seconds={trainer_grace}", prompts="ab")
    pacer.dispatch([PromptRef("w0")], client_id="worker-1")
    pacer.watch_opened("worker-1")
    held = pacer.collect_now(2, lease_seconds=LEASE, holder="trainer-1")
    assert pacer.keep_alive([]).liveness_seconds == min(20, lapses_after or 20)  # the kits beat within the shorter
    clock.now += 4
    assert pacer.release_silent_workers() == {}
    clock.now += 17
    lost = pacer.release_silent_workers()
    assert lost["worker-1"].prompt_ids == ["w0"] and not lost["worker-1"].lease_ids
    assert ("trainer-1" in lost) == (lapses_after in (5, 20))
    for _ in range(3):  # silent for longer still: the worker's groups are not released twice
        clock.now += 50
        lost.update({holder: what for holder, what in pacer.release_silent_workers().items() if what.lease_ids})
        assert pacer.state().invariant_holds()
    assert ("trainer-1" in lost) == (lapses_after is not None)
    if lapses_after is None:
        assert pacer.ack(held.lease_id) == 2
        return
    assert lost["trainer-1"].lease_ids == [held.lease_id]
    with pytest.raises(LeaseExpiredError, match=f"its holder trainer-1 was silent for {lapses_after} s .*"
                                                f"server.trainer_liveness_seconds"):
        pacer.ack(held.lease_id)


def test_a_holder_without_a_lease_is_refused_and_changes_nothing():
    pacer, _ = _filled()
    before = pacer.state()
    with pytest.raises(InvalidArgumentError, match="release_when_silent applies to a leased Collect"):
        pacer.collect_now(2, holder="trainer-1")
    assert pacer.state() == before


def test_the_silent_ranks_shares_go_back_and_take_the_unclaimed_share_of_their_mini_batch_with_them():
    from coda_server.core.shares import BatchShape

    pacer, clock = _filled()
    rank0 = pacer.collect_now(2, lease_seconds=LEASE, shape=BatchShape(0, 0, 2), holder="rank-0")
    clock.now += 1
    rank1 = pacer.collect_now(2, lease_seconds=LEASE, shape=BatchShape(0, 1, 2), holder="rank-1")
    assert len(rank0.groups) == len(rank1.groups) == 1
    rank0_next = pacer.collect_now(2, lease_seconds=LEASE, shape=BatchShape(0, 0, 2), holder="rank-0")
    clock.now += 20.5  # rank 0 silent 20.5 s; rank 1 (heard at 1001) 20.5 s too, but it is heard now
    pacer.heard_from("rank-1")
    lost = pacer.release_silent_workers()
    assert list(lost) == ["rank-0"] and lost["rank-0"].lease_ids == [rank0.lease_id, rank0_next.lease_id]
    state = pacer.state()
    # rank 1's own share stays leased to it; its share of the second mini-batch, not claimed yet, went back with
    # rank 0's (so that both ranks take their next shares from one new mini-batch)
    assert (state.leased, state.buffered) == (1, 3) and state.invariant_holds()
    waiting = pacer.collect_now(2, lease_seconds=LEASE, shape=BatchShape(0, 1, 2), holder="rank-1")
    assert [g.prompt_id for g in waiting.groups] != [g.prompt_id for g in rank1.groups]
    assert pacer.ack(rank1.lease_id) == 1 and pacer.ack(waiting.lease_id) == 1


def test_after_a_restart_a_holder_that_does_not_come_back_loses_its_leases_within_the_grace(tmp_path):
    from coda_server.core.sqlite_journal import SqliteJournal

    first, _ = _filled(journal=SqliteJournal(tmp_path / "state", fsync="off"))
    held = first.collect_now(2, lease_seconds=LEASE, holder="trainer-1")
    first.journal.close()

    pacer, clock = make_pacer("server.inflight_lease_seconds=0", "server.worker_liveness_seconds=20",
                              journal=SqliteJournal(tmp_path / "state", fsync="off"))
    clock.now = 5.0  # another process's clock
    pacer.recover()
    assert pacer.state().leased == 2
    clock.now += 19
    assert pacer.release_silent_workers() == {}  # the grace runs from recovery
    clock.now += 2
    assert pacer.release_silent_workers()["trainer-1"].lease_ids == [held.lease_id]
    assert [g.prompt_id for g in pacer.collect_now(4).groups] == ["a", "b", "c", "d"]
    pacer.journal.close()


def test_a_silent_holder_that_comes_back_claims_its_leases_while_their_groups_still_wait():
    """A trainer stopped or cut off past the grace loses its leases; heard again naming them (a heartbeat's or
    Collect's held leases, an Ack), it gets back each lease whose groups all still wait, and its Ack lands."""
    pacer, clock = _filled("data_source.num_prompts_per_step=8", prompts="abcdef")
    first = pacer.collect_now(2, lease_seconds=LEASE, holder="trainer-1")
    second = pacer.collect_now(2, lease_seconds=LEASE, holder="trainer-1")
    clock.now += 21
    assert pacer.release_silent_workers()["trainer-1"].lease_ids == [first.lease_id, second.lease_id]
    other = pacer.collect_now(2, lease_seconds=LEASE, holder="trainer-2")  # the first in line: the first lease's
    assert [g.prompt_id for g in other.groups] == ["a", "b"]
    assert pacer.heard_from("trainer-2", [second.lease_id]) is None  # not its lease: nothing given back
    assert pacer.heard_from("trainer-1") is None  # a call naming no lease changes nothing
    reclaim = pacer.heard_from("trainer-1", [first.lease_id, second.lease_id, "lease-99"])
    assert (reclaim.lease_ids, reclaim.groups, reclaim.missed) == ([second.lease_id], 2, [first.lease_id])
    state = pacer.state()
    assert (state.leased, state.buffered) == (4, 2) and state.invariant_holds()
    assert (state.redelivered, state.reclaimed) == (4, 2)  # two went back and out again, two to their trainer
    assert pacer.heard_from("trainer-1", [second.lease_id]) is None  # given back once
    assert pacer.ack(second.lease_id) == 2
    with pytest.raises(LeaseExpiredError, match="its holder trainer-1 was silent"):  # its groups went to trainer-2
        pacer.ack(first.lease_id)
    assert [g.prompt_id for g in pacer.collect_now(2).groups] == ["e", "f"]  # c and d were trained once
    assert pacer.ack(other.lease_id) == 2 and pacer.state().consumed == 6


def test_a_lease_no_call_names_ends_within_the_grace_though_its_client_id_is_heard():
    """Two processes under one client id (ranks given the same id, a trainer restarted under its fixed id): a client
    whose heartbeats or Collects name the leases they hold is taken at its word, so a lease none of its calls named
    for the grace ends as its holder's silence would end it, first in line again, while the lease named stays; the
    process that comes back naming it gets it back."""
    pacer, clock = _filled()
    first = pacer.collect_now(2, lease_seconds=LEASE, holder="trainer")  # process A's
    second = pacer.collect_now(1, lease_seconds=LEASE, holder="trainer")  # process B's
    pacer.heard_from("trainer", [first.lease_id, second.lease_id])  # A's, naming both
    clock.now += 15
    pacer.heard_from("trainer", [second.lease_id])  # B's, after A was killed: B names its own
    clock.now += 6  # 21 s since A's last call named its lease, 6 since B's
    [(holder, lost)] = pacer.release_silent_workers().items()
    assert (holder, lost.lease_ids, lost.prompt_ids) == ("trainer", [], [])
    assert (lost.unnamed_lease_ids, lost.leased_groups) == ([first.lease_id], 2)
    state = pacer.state()
    assert (state.leased, state.buffered, state.redelivered) == (1, 3, 2) and state.invariant_holds()
    clock.now += 10
    pacer.heard_from("trainer", [second.lease_id])  # B still names its own: kept
    clock.now += 10
    assert pacer.release_silent_workers() == {} and pacer.state().leased == 1
    with pytest.raises(LeaseExpiredError, match="no call under its client id trainer named it for 20 s"):
        pacer.ack(first.lease_id)
    assert pacer.heard_from("trainer", [first.lease_id, second.lease_id]).lease_ids == [first.lease_id]  # A again
    assert pacer.ack(first.lease_id) == 2 and pacer.ack(second.lease_id) == 1


def test_a_lease_whose_answer_is_not_read_yet_stays_and_one_only_a_later_leases_naming_omits_ends():
    """A lease never named yet is its process's while that process has not read its answer (an async trainer's event
    loop blocked by a step: its heartbeats name the older leases it knows); it ends when calls under the id name a
    lease granted after it, but not it, for the grace (another process under the id holds that later one)."""
    pacer, clock = _filled()
    first = pacer.collect_now(1, lease_seconds=LEASE, holder="trainer")
    second = pacer.collect_now(1, lease_seconds=LEASE, holder="trainer")  # answered, not read yet
    for _ in range(3):
        clock.now += 10
        pacer.heard_from("trainer", [first.lease_id])  # the heartbeat names the one lease its process read
        assert pacer.release_silent_workers() == {}
    third = pacer.collect_now(1, lease_seconds=LEASE, holder="trainer")  # another process's, granted after
    for _ in range(2):
        pacer.heard_from("trainer", [third.lease_id])  # the other process names its own
        pacer.heard_from("trainer", [first.lease_id])
        assert pacer.release_silent_workers() == {}
        clock.now += 10.5
    [(_, lost)] = pacer.release_silent_workers().items()
    assert lost.unnamed_lease_ids == [second.lease_id]  # not first, named all along; not third
    assert pacer.state().leased == 2 and pacer.state().invariant_holds()


@pytest.mark.parametrize("named_at_grant, named_later, ends", [(True, False, True), (False, False, False),
                                                              (True, True, False)])
def test_a_lease_counted_named_at_its_grant_ends_a_grace_after_it_when_no_call_names_it(named_at_grant, named_later,
                                                                                       ends):
    """A Collect that says its process reads the answer at once and names the lease from then on (named_at_grant: the
    blocking iterator's) has its lease counted named at the grant: when that process dies before naming it, it ends a
    grace after the grant though another process under the client id goes on naming its own, older lease. Without
    the flag such a lease stays (its answer may not be read yet; only a later lease's naming ends it), and with it a
    lease its process does name stays."""
    pacer, clock = _filled()
    other = pacer.collect_now(1, lease_seconds=LEASE, holder="trainer")  # process B's, granted first
    mine = pacer.collect_now(2, lease_seconds=LEASE, holder="trainer", named_at_grant=named_at_grant)  # process A's
    for _ in range(2):
        clock.now += 10.5
        pacer.heard_from("trainer", [other.lease_id, mine.lease_id] if named_later else [other.lease_id])
        if named_later:
            named_later = False  # A named it once, then died
    lost = pacer.release_silent_workers()
    if not ends:
        assert lost == {} and pacer.state().leased == 3
        return
    assert lost["trainer"].unnamed_lease_ids == [mine.lease_id] and lost["trainer"].leased_groups == 2
    state = pacer.state()
    assert (state.leased, state.buffered, state.redelivered) == (1, 3, 2) and state.invariant_holds()
    with pytest.raises(LeaseExpiredError, match="no call under its client id trainer named it for 20 s"):
        pacer.ack(mine.lease_id)
    assert pacer.ack(other.lease_id) == 1


def test_named_at_grant_needs_a_holder_and_a_refused_collect_takes_nothing():
    pacer, _ = _filled()
    with pytest.raises(InvalidArgumentError, match="named_at_grant applies to a lease its holder's silence ends"):
        pacer.collect_now(2, lease_seconds=LEASE, named_at_grant=True)
    assert pacer.state().buffered == 4 and pacer.state().leased == 0


def test_a_client_that_never_names_its_leases_keeps_them_while_it_is_heard():
    """Naming is opt-in: a trainer whose heartbeats and Collects name none of the leases it holds (an older client, a
    loop of its own without lease_ids) keeps them as long as any call under its id is heard; an Ack naming its own
    lease does not opt it in."""
    pacer, clock = _filled()
    first = pacer.collect_now(2, lease_seconds=LEASE, holder="trainer")
    second = pacer.collect_now(1, lease_seconds=LEASE, holder="trainer")
    for _ in range(4):
        clock.now += 15
        pacer.heard_from("trainer", [first.lease_id], all_held=False)  # an Ack's
        pacer.heard_from("trainer")  # a heartbeat naming nothing
        assert pacer.release_silent_workers() == {}
    assert pacer.state().leased == 3 and pacer.ack(second.lease_id) == 1


def test_a_heartbeat_names_the_held_leases_that_are_not_live_any_more():
    """KeepAlive's lease_ids, after the give-back: those not live any more (their groups went to another trainer,
    acknowledged, never granted) are named in ended_lease_ids, so a trainer does not train a prefetched batch of
    one; a lease given back or still held is not."""
    pacer, clock = _filled("data_source.num_prompts_per_step=8", prompts="abcdef")
    first = pacer.collect_now(2, lease_seconds=LEASE, holder="trainer-1")
    second = pacer.collect_now(2, lease_seconds=LEASE, holder="trainer-1")
    kept = pacer.collect_now(1, lease_seconds=LEASE, holder="trainer-2")
    assert pacer.keep_alive([], lease_ids=[first.lease_id, second.lease_id]).ended_lease_ids == []
    clock.now += 15
    pacer.heard_from("trainer-2")
    clock.now += 6
    pacer.release_silent_workers()  # trainer-1's two leases end
    other = pacer.collect_now(2, lease_seconds=LEASE, holder="trainer-2")  # the first lease's groups
    assert pacer.ack(other.lease_id) == 2
    named = [first.lease_id, second.lease_id, kept.lease_id, other.lease_id, "lease-99"]
    pacer.heard_from("trainer-1", named)  # gives the second lease back, as the servicer does before keep_alive
    answer = pacer.keep_alive([], lease_ids=named)
    assert answer.ended_lease_ids == [first.lease_id, other.lease_id, "lease-99"]
    state = pacer.state()
    assert (state.leased, state.buffered, state.consumed) == (3, 1, 2) and state.invariant_holds()  # nothing moved


def test_a_lease_given_back_is_journaled_and_stays_given_back_after_a_restart(tmp_path):
    from coda_server.core.sqlite_journal import SqliteJournal

    first, clock = _filled(journal=SqliteJournal(tmp_path / "state", fsync="off"))
    held = first.collect_now(2, lease_seconds=LEASE, holder="trainer-1")
    clock.now += 21
    first.release_silent_workers()
    assert first.heard_from("trainer-1", [held.lease_id]).lease_ids == [held.lease_id]
    first.journal.close()

    pacer, _ = make_pacer("server.inflight_lease_seconds=0", "server.worker_liveness_seconds=20",
                          journal=SqliteJournal(tmp_path / "state", fsync="off"))
    pacer.recover()
    state = pacer.state()
    assert (state.leased, state.buffered) == (2, 2) and state.invariant_holds()
    assert (state.redelivered, state.reclaimed) == (2, 2)
    assert pacer.ack(held.lease_id) == 2
    assert [g.prompt_id for g in pacer.collect_now(2).groups] == ["c", "d"]
    pacer.journal.close()


def _restarted(tmp_path, first, snapshot: bool):
    """`first`'s state as a restarted server recovers it: from the journal's events, or from a snapshot of it."""
    from coda_server.core.sqlite_journal import SqliteJournal

    if snapshot:
        first.recorder.snapshot(first.export_state())
    first.journal.close()
    pacer, clock = make_pacer("server.inflight_lease_seconds=0", "server.worker_liveness_seconds=20",
                              "data_source.num_prompts_per_step=8", journal=SqliteJournal(tmp_path / "state", fsync="off"))
    pacer.recover()
    return pacer, clock


@pytest.mark.parametrize("snapshot", [False, True], ids=["replayed", "snapshot"])
def test_a_silent_holder_that_comes_back_after_a_server_restart_claims_its_leases(tmp_path, snapshot):
    """The silence that ended the leases is journaled with its holder (and kept in snapshots): a trainer stopped
    past the grace while the server restarted gets back what still waits for it, and only that."""
    from coda_server.core.sqlite_journal import SqliteJournal

    first, clock = _filled("data_source.num_prompts_per_step=8", prompts="abcdef",
                           journal=SqliteJournal(tmp_path / "state", fsync="off"))
    held = first.collect_now(2, lease_seconds=LEASE, holder="trainer-1")
    taken = first.collect_now(2, lease_seconds=LEASE, holder="trainer-1")
    clock.now += 21
    first.release_silent_workers()
    other = first.collect_now(2, lease_seconds=LEASE, holder="trainer-2")  # a and b, the first in line: `held`'s
    pacer, _ = _restarted(tmp_path, first, snapshot)
    reclaim = pacer.heard_from("trainer-1", [held.lease_id, taken.lease_id])
    assert (reclaim.lease_ids, reclaim.missed) == ([taken.lease_id], [held.lease_id])
    assert pacer.ack(taken.lease_id) == 2 and pacer.ack(other.lease_id) == 2
    with pytest.raises(LeaseExpiredError, match="its holder trainer-1 was silent for 20 s"):
        pacer.ack(held.lease_id)
    state = pacer.state()
    assert (state.consumed, state.leased, state.buffered, state.reclaimed) == (4, 0, 2, 2) and state.invariant_holds()
    pacer.journal.close()


def test_a_lease_given_back_once_is_not_claimable_again_after_a_restart(tmp_path):
    """Replaying the give-back forgets the lease's claim as the live call did: the lease, given back and then run
    out (not silence), stays ended after a restart, and its groups wait for anyone's next Collect."""
    from coda_server.core.sqlite_journal import SqliteJournal

    first, clock = _filled("data_source.num_prompts_per_step=8", journal=SqliteJournal(tmp_path / "state", fsync="off"))
    held = first.collect_now(2, lease_seconds=30, holder="trainer-1")
    clock.now += 21
    first.release_silent_workers()
    assert first.heard_from("trainer-1", [held.lease_id]).lease_ids == [held.lease_id]
    clock.now += 31
    assert first.expire_leases() == ([], [held.lease_id])  # ran out this time
    pacer, _ = _restarted(tmp_path, first, snapshot=False)
    assert pacer.heard_from("trainer-1", [held.lease_id]) is None  # as the live server would answer
    with pytest.raises(LeaseExpiredError, match="ran out before this Ack"):
        pacer.ack(held.lease_id)
    assert [g.prompt_id for g in pacer.collect_now(4).groups] == ["a", "b", "c", "d"]
    pacer.journal.close()


@pytest.mark.parametrize("snapshot", [False, True], ids=["replayed", "snapshot"])
def test_an_ack_after_a_restart_says_why_its_lease_ended(tmp_path, snapshot):
    from coda_server.core.sqlite_journal import SqliteJournal

    first, clock = _filled("data_source.num_prompts_per_step=8", prompts="abcdef",
                           journal=SqliteJournal(tmp_path / "state", fsync="off"))
    ran_out = first.collect_now(2, lease_seconds=5)
    released = first.collect_now(2, lease_seconds=LEASE)
    silent = first.collect_now(2, lease_seconds=LEASE, holder="trainer-1")
    clock.now += 6
    first.expire_leases()
    assert first.release(released.lease_id) == 2
    clock.now += 20
    first.release_silent_workers()
    pacer, _ = _restarted(tmp_path, first, snapshot)
    for lease, why in [(ran_out, "ran out before this Ack"), (released, r"was given back \(Release\)"),
                       (silent, "its holder trainer-1 was silent")]:
        with pytest.raises(LeaseExpiredError, match=why):
            pacer.ack(lease.lease_id)
    assert [g.prompt_id for g in pacer.collect_now(6).groups] == ["a", "b", "c", "d", "e", "f"]
    pacer.journal.close()


def test_a_collect_sent_before_its_holder_fell_silent_takes_nothing_of_what_it_held():
    """A stopped process's waiting Collect stays open: when the holder's leases lapse it must not take their groups
    again in an answer the holder may never read (and would train twice); it is answered at once, empty, so that a
    holder that comes back asks again, naming its leases, instead of waiting out the call's deadline; a Collect sent
    after takes as usual."""
    pacer, clock = _filled()
    held = pacer.collect_now(2, lease_seconds=LEASE, holder="trainer-1")
    waiting = pacer.collect_poll(3, lease_seconds=LEASE, holder="trainer-1")  # sent before the silence, not tried
    assert not waiting.could_answer()  # "c" and "d" wait: two of the three it asks for
    clock.now += 21
    pacer.release_silent_workers()
    assert waiting.could_answer()  # woken by the lapse, not left asleep until its deadline
    answer = waiting.attempt()  # before any deadline: the clock has not moved since the lapse
    assert answer is not None and (answer.groups, answer.timed_out) == ([], True)
    assert waiting.give_up().groups == []
    assert pacer.state().buffered == 4  # it took nothing
    assert pacer.heard_from("trainer-1", [held.lease_id]).lease_ids == [held.lease_id]
    fresh = pacer.collect_poll(2, lease_seconds=LEASE, holder="trainer-1").attempt()
    assert fresh is not None and [g.prompt_id for g in fresh.groups] == ["c", "d"]


# --- against a server ---------------------------------------------------------------------------------


def _server(tmp_path, *extra: str) -> ServerProcess:
    return ServerProcess(tmp_path, "fully_async.sliding_window=no-window", "data_source.num_prompts_per_step=64",
                         f"data_source.num_trajectories_per_prompt={N}", f"trainer.mini_batch_size={2 * N}",
                         "rollout.filter=[status]", f"server.worker_liveness_seconds={GRACE}", *extra)


def _fill(pacer: PacerClient, prompt_ids: list[str]) -> None:
    from coda_client import Trajectory, TrajectoryStatus

    pacer.dispatch(prompt_ids)
    for prompt_id in prompt_ids:
        pacer.submit([Trajectory(trajectory_id=f"{prompt_id}/{i}", prompt_id=prompt_id,
                                 status=TrajectoryStatus.COMPLETED, token_ids=[1, 2, 3]) for i in range(N)])


BLOCKING_TRAINER = """
    import time
    from coda_client import PacerClient
    pacer = PacerClient({address!r})
    batches = pacer.batches({size}, lease={lease}, poll=1)
    batch = next(batches)
    while pacer.state().leased < 4:  # the prefetch took the second batch too
        time.sleep(0.01)
    print(pacer.client_id, flush=True)
    time.sleep(600)  # "training": killed here
"""
ASYNC_TRAINER = """
    import asyncio, time
    from coda_client import AsyncPacerClient

    async def main():
        pacer = AsyncPacerClient({address!r})
        batches = pacer.batches({size}, lease={lease}, poll=1)
        batch = await batches.__anext__()
        while (await pacer.state()).leased < 4:  # the prefetch took the second batch too
            await asyncio.sleep(0.01)
        print(pacer.client_id, flush=True)
        await asyncio.sleep(600)  # "training": killed here

    asyncio.run(main())
"""


@pytest.mark.parametrize("script", [BLOCKING_TRAINER, ASYNC_TRAINER], ids=["blocking", "async"])
def test_a_trainer_killed_mid_batch_has_its_batches_back_within_the_grace_not_the_lease(tmp_path, script) -> None:
    """The batch in hand and the prefetched one, leased for 600 s, are first in line again about GRACE seconds after
    the kill: a trainer restarted at once trains them, in order, before the newer groups."""
    with _server(tmp_path) as running, PacerClient(running.address) as pacer:
        _fill(pacer, [f"k{i}" for i in range(4)])
        trainer = subprocess.Popen([sys.executable, "-c", textwrap.dedent(script).format(
            address=running.address, size=2 * N, lease=LEASE)], stdout=subprocess.PIPE, text=True, cwd=REPO_ROOT)
        try:
            trainer_id = trainer.stdout.readline().strip()
        finally:
            trainer.send_signal(signal.SIGKILL)
            trainer.wait(10)
        assert trainer_id.startswith("trainer-")
        _fill(pacer, ["k4", "k5"])  # newer groups, which a restarted trainer must not train first
        until(lambda: pacer.state().leased == 0, "the dead trainer's leases to be released", timeout=60)
        with pacer.batches(6 * N, lease=30, poll=5, num_batches=1) as batches:
            [again] = list(batches)
        assert [g.prompt_id for g in again.groups] == [f"k{i}" for i in range(6)]
        assert pacer.state().redelivered == 4


def test_a_trainer_restarted_under_its_fixed_client_id_gets_the_dead_ones_batches_within_the_grace(tmp_path) -> None:
    """A trainer with a client id of its own choosing (client_id="trainer", as on every pod it restarts in) killed -9
    and restarted at once: the new process heartbeats under the same id, which kept the dead one's leases alive for
    their whole lease before. Its calls name the leases it holds, so the dead one's, named by no call any more, are
    first in line again within about the grace, and the new process trains them, in order."""
    script = BLOCKING_TRAINER.replace("PacerClient({address!r})", "PacerClient({address!r}, client_id='trainer')")
    with _server(tmp_path) as running, PacerClient(running.address) as pacer:
        _fill(pacer, [f"k{i}" for i in range(4)])
        trainer = subprocess.Popen([sys.executable, "-c", textwrap.dedent(script).format(
            address=running.address, size=2 * N, lease=LEASE)], stdout=subprocess.PIPE, text=True, cwd=REPO_ROOT)
        try:
            assert trainer.stdout.readline().strip() == "trainer"
        finally:
            trainer.send_signal(signal.SIGKILL)
            trainer.wait(10)
        with PacerClient(running.address, client_id="trainer") as again, \
                again.batches(2 * N, lease=LEASE, poll=1, num_batches=3) as batches:
            until(lambda: pacer.state().redelivered == 4, "the dead process's leases to go back", timeout=60)
            _fill(pacer, ["k4", "k5"])  # newer groups, after the dead one's in line
            trained = [g.prompt_id for batch in batches for g in batch.groups]
        assert trained == [f"k{i}" for i in range(6)]
        assert "heard, but no call under that id named these for 3 s" in running.log()


def _counting_heartbeats(client: PacerClient) -> list[float]:
    """The times of the client's KeepAlive calls from now on, appended as they go out."""
    beats: list[float] = []
    run = client._run

    def counting(call):
        if call.method == "KeepAlive":
            beats.append(time.monotonic())
        return run(call)

    client._run = counting
    return beats


def test_a_live_trainer_keeps_its_batch_through_several_graces_and_acknowledges_it(tmp_path) -> None:
    """The iterator heartbeats on a thread of its own while the step trains: a batch held for several graces is
    still leased to it, and its Ack lands (without heartbeats the server would take it back after GRACE)."""
    with _server(tmp_path) as running, PacerClient(running.address) as pacer:
        _fill(pacer, ["h0", "h1"])
        with PacerClient(running.address) as trainer_client:
            beats = _counting_heartbeats(trainer_client)
            with trainer_client.batches(2 * N, lease=LEASE, poll=1, num_batches=1) as batches:
                batch = next(batches)
                held_from = time.monotonic()
                # a heartbeat every GRACE / 3 s: eight of them span more than two graces
                until(lambda: len(beats) >= 8, "eight heartbeats", timeout=120)
                assert time.monotonic() - held_from > GRACE and pacer.state().leased == 2
            assert [g.prompt_id for g in batch.groups] == ["h0", "h1"]
        state = pacer.state()
        assert (state.consumed, state.leased, state.redelivered) == (2, 0, 0)


def _recording_calls(monkeypatch) -> list[tuple[str, Any]]:
    """(method, request) of every Collect any iterator builds and every call any PacerClient makes from now on (the
    async iterator's heartbeats go through a blocking twin)."""
    from coda_client import _calls

    calls: list[tuple[str, Any]] = []
    collect, run = _calls.collect, PacerClient._run

    def building(*args, **kwargs):
        call = collect(*args, **kwargs)
        calls.append((call.method, call.request))
        return call

    def running(client, call):
        calls.append((call.method, call.request))
        return run(client, call)

    monkeypatch.setattr(_calls, "collect", building)
    monkeypatch.setattr(PacerClient, "_run", running)
    return calls


def _named(calls: list[tuple[str, Any]], lease_ids: list[str]) -> bool:
    """Whether a KeepAlive recorded in `calls` named all of these leases."""
    return any(method == "KeepAlive" and set(lease_ids) <= set(request.lease_ids) for method, request in calls)


def _two_batches_async(address: str, size: int, calls: list[tuple[str, Any]]) -> list[list[str]]:
    """Two batches through the async iterator under a chosen id, each held until a heartbeat named its lease."""
    from coda_client import AsyncPacerClient

    async def main() -> list[list[str]]:
        leases = []
        async with AsyncPacerClient(address, client_id="trainer") as client:
            async with client.batches(size, lease=LEASE, poll=1, num_batches=2) as batches:
                async for batch in batches:
                    leases.append(batch.lease_ids)
                    deadline = time.monotonic() + 60
                    while not _named(calls, batch.lease_ids):
                        assert time.monotonic() < deadline, f"no heartbeat named {batch.lease_ids}"
                        await asyncio.sleep(0.02)
        return leases

    return asyncio.run(main())


@pytest.mark.parametrize("kind", ["blocking", "async"])
def test_each_lease_counts_as_named_from_its_grant_without_a_heartbeat_per_batch(tmp_path, monkeypatch, kind) -> None:
    """Under a client id shared with another process, a lease its process never named would come back only a grace
    after a later lease is named, so a process killed right after its prefetched batch arrived would hold that batch
    a grace longer (only a client id the caller chose can be shared: the iterator's own default is unique). The
    blocking iterator reads each answer on a thread of its own as it arrives, so its Collects ask the server to count
    the lease named at its grant (named_at_grant) and no heartbeat goes per batch; the async iterator's answers may
    wait unread while a step blocks its event loop, so it names each lease by a heartbeat as it reads it. With a grace
    of 1800 s the periodic heartbeats are 600 s apart: any KeepAlive naming a lease here is one sent per batch."""
    calls = _recording_calls(monkeypatch)
    with _server(tmp_path, "server.worker_liveness_seconds=1800") as running, PacerClient(running.address) as pacer:
        _fill(pacer, [f"n{i}" for i in range(4)])
        if kind == "blocking":
            leases = []
            with PacerClient(running.address, client_id="trainer") as trainer_client, \
                    trainer_client.batches(2 * N, lease=LEASE, poll=1, num_batches=2) as batches:
                for batch in batches:
                    leases.append(batch.lease_ids)
                    until(lambda: pacer.state().leased == 4 or len(leases) == 2, "the prefetch to take its batch")
        else:
            leases = _two_batches_async(running.address, 2 * N, calls)
        assert pacer.state().consumed == 4 and len(leases) == 2
    collects = [request for method, request in calls if method == "CollectStream"]
    assert collects and all(request.release_when_silent for request in collects)
    if kind == "blocking":
        assert all(request.named_at_grant for request in collects)
        assert not [request for method, request in calls if method == "KeepAlive" and request.lease_ids]
    else:  # each lease named as it was read (_two_batches_async waited for it)
        assert not any(request.named_at_grant for request in collects)


def test_a_lease_counted_named_at_its_grant_that_its_process_never_names_goes_back_within_the_grace(tmp_path):
    """Over gRPC: process A under the client id "trainer" takes a batch with named_at_grant and dies before naming
    it; process B under the same id goes on, heartbeating with its own lease, granted before A's. A's batch is first
    in line again about a grace after its grant, and B keeps its own."""
    with _server(tmp_path) as running, PacerClient(running.address) as pacer, \
            PacerClient(running.address, client_id="trainer") as process_b:
        _fill(pacer, ["g0", "g1", "g2"])
        own = process_b.collect_result(1, lease=LEASE, release_when_silent=True)
        with grpc.insecure_channel(running.address) as channel:  # process A
            stub = pacer_pb2_grpc.RolloutPacerStub(channel)
            taken = stub.Collect(pb.CollectRequest(num_groups=2, lease_seconds=LEASE, release_when_silent=True,
                                                   named_at_grant=True), metadata=(("x-coda-client-id", "trainer"),),
                                 timeout=10)
        assert [g.prompt_id for g in taken.groups] == ["g1", "g2"]

        def back() -> bool:
            process_b.keep_alive([], lease_ids=[own.lease_id])
            return pacer.state().redelivered == 2

        until(back, "A's batch to go back", timeout=60)
        assert pacer.state().leased == 1
        assert [g.prompt_id for g in pacer.collect(2)] == ["g1", "g2"]
        assert process_b.ack(own.lease_id) == 1
        assert "heard, but no call under that id named these for 3 s" in running.log()


def test_after_close_the_heartbeats_go_on_until_the_batch_in_hand_is_acknowledged(tmp_path) -> None:
    """close() does not acknowledge the batch in hand, and ack() may still come after it: the heartbeats go on
    until then, so a step longer than the grace after close() still acknowledges its batch; then they stop."""
    with _server(tmp_path) as running, PacerClient(running.address) as pacer:
        _fill(pacer, ["c0", "c1"])
        with PacerClient(running.address) as trainer_client:
            beats = _counting_heartbeats(trainer_client)
            batches = trainer_client.batches(2 * N, lease=LEASE, poll=1)
            batch = next(batches)
            batches.close()
            closed_at = len(beats)
            until(lambda: len(beats) >= closed_at + 8, "eight heartbeats after close()", timeout=120)
            assert pacer.state().leased == 2
            assert batches.ack() == 2 and [g.prompt_id for g in batch.groups] == ["c0", "c1"]
            batches._heartbeat.join(30)
            assert not batches._heartbeat.is_alive()  # nothing in hand: no more heartbeats
        assert pacer.state().consumed == 2


def test_the_async_iterator_heartbeats_while_a_step_blocks_its_event_loop(tmp_path, monkeypatch) -> None:
    """An async trainer whose step runs on the event loop (blocking it) still heartbeats: from a thread, through a
    blocking twin of its client; its batch stays leased through several graces and its Ack lands."""
    from coda_client import AsyncPacerClient

    beats: list[float] = []
    run = PacerClient._run

    def counting(client, call):  # every PacerClient's calls, the twin's among them
        if call.method == "KeepAlive":
            beats.append(time.monotonic())
        return run(client, call)

    monkeypatch.setattr(PacerClient, "_run", counting)
    with _server(tmp_path) as running, PacerClient(running.address) as pacer:
        _fill(pacer, ["a0", "a1"])

        async def train() -> list[str]:
            async with AsyncPacerClient(running.address) as client:
                async with client.batches(2 * N, lease=LEASE, poll=1, num_batches=1) as batches:
                    batch = await batches.__anext__()
                    # the "step": blocks the event loop until eight heartbeats went out (more than two graces)
                    until(lambda: len(beats) >= 8, "eight heartbeats while the loop is blocked", timeout=120)
                    assert pacer.state().leased == 2
                return [g.prompt_id for g in batch.groups]

        assert asyncio.run(train()) == ["a0", "a1"]
        state = pacer.state()
        assert (state.consumed, state.leased, state.redelivered) == (2, 0, 0)


def test_list_workers_and_the_cli_show_which_trainer_holds_which_leases(tmp_path) -> None:
    """An operator seeing `leased` in the state can tell who holds them: the trainer is listed with its leases."""
    import io

    from coda_client import cli as client_cli

    with _server(tmp_path) as running, PacerClient(running.address) as pacer:
        _fill(pacer, [f"w{i}" for i in range(4)])
        with PacerClient(running.address, client_id="trainer@node-3") as trainer_client:
            with trainer_client.batches(2 * N, lease=LEASE, poll=1, num_batches=2) as batches:
                next(batches)
                until(lambda: pacer.state().leased == 4, "the prefetch to lease the second batch")
                [trainer] = pacer.list_workers("trainer@node-3")
                assert (trainer.running, trainer.leased, len(trainer.lease_ids)) == (0, 4, 2)
                assert [w.client_id for w in pacer.list_workers()] == ["trainer@node-3"]
                out = io.StringIO()
                assert client_cli.main(["--address", running.address, "workers"], out=out) == 0
                assert f"trainer@node-3: 0 running, oldest held 0.0s, 4 groups leased ({', '.join(trainer.lease_ids)})" \
                    in out.getvalue()
        assert pacer.list_workers() == []  # acknowledged: nothing held


def test_release_when_silent_needs_a_client_id_and_a_lease(tmp_path) -> None:
    with _server(tmp_path) as running, PacerClient(running.address) as pacer:
        _fill(pacer, ["q0", "q1"])
        with grpc.insecure_channel(running.address) as channel:
            stub = pacer_pb2_grpc.RolloutPacerStub(channel)
            with pytest.raises(grpc.RpcError) as anonymous:
                stub.Collect(pb.CollectRequest(num_groups=2, lease_seconds=60, release_when_silent=True), timeout=10)
            assert anonymous.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "needs the caller's client id" in anonymous.value.details()
            named = (("x-coda-client-id", "trainer-q"),)
            with pytest.raises(grpc.RpcError) as unleased:
                stub.Collect(pb.CollectRequest(num_groups=2, release_when_silent=True), metadata=named, timeout=10)
            assert unleased.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "applies to a leased Collect" in unleased.value.details()
            with pytest.raises(grpc.RpcError) as unheld:
                stub.Collect(pb.CollectRequest(num_groups=2, lease_seconds=60, named_at_grant=True), metadata=named,
                             timeout=10)
            assert unheld.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "named_at_grant applies to a lease its holder's silence ends" in unheld.value.details()
            assert "set release_when_silent too" in unheld.value.details()
            assert pacer.state().buffered == 2  # none took anything
            assert stub.KeepAlive(pb.KeepAliveRequest(), metadata=named, timeout=10).liveness_seconds == GRACE


def test_a_loop_of_its_own_heartbeats_with_its_leases_and_gets_them_back_after_a_silence(tmp_path) -> None:
    """A trainer on collect_result() and ack() rather than batches(): release_when_silent=True, and the lease ids it
    holds named in its keep_alive() heartbeat or its next Collect, as the iterators name theirs."""
    with _server(tmp_path) as running, PacerClient(running.address) as pacer, \
            PacerClient(running.address, client_id="trainer-own-loop") as trainer:
        _fill(pacer, ["r0", "r1", "r2", "r3"])
        first = trainer.collect_result(2, lease=LEASE, release_when_silent=True)
        until(lambda: pacer.state().leased == 0, "the silent trainer's lease to be taken back", timeout=60)
        assert trainer.keep_alive([], lease_ids=[first.lease_id]).liveness_seconds == GRACE
        assert pacer.state().leased == 2  # given back by the heartbeat that named it
        assert trainer.ack(first.lease_id) == 2

        second = trainer.collect_result(2, lease=LEASE, release_when_silent=True)
        until(lambda: pacer.state().leased == 0, "the silent trainer's lease to be taken back", timeout=60)
        after = trainer.collect_result(2, lease=LEASE, release_when_silent=True, held_lease_ids=[second.lease_id])
        assert after.groups == [] and after.timed_out  # given back before the Collect was served: nothing left
        assert trainer.ack(second.lease_id) == 2
        assert [g.prompt_id for g in first.groups + second.groups] == ["r0", "r1", "r2", "r3"]
        state = pacer.state()
        assert (state.consumed, state.leased, state.buffered) == (4, 0, 0)


STOPPED_TRAINER = """
    import sys, time
    from coda_client import PacerClient
    pacer = PacerClient({address!r})
    trained = []
    with pacer.batches({size}, lease={lease}, poll={poll}, num_batches={batches}) as batches:
        for i, batch in enumerate(batches):
            trained += [g.prompt_id for g in batch.groups]
            if i == 0:
                while pacer.state().leased < {leased}:  # the prefetch took the second batch, if there was one
                    time.sleep(0.01)
                print("holding", flush=True)
                sys.stdin.readline()  # "training": stopped (SIGSTOP) here, then told to go on
    print(" ".join(trained), flush=True)
"""
ASYNC_STOPPED_TRAINER = """
    import asyncio, sys, time
    from coda_client import AsyncPacerClient

    async def main():
        pacer = AsyncPacerClient({address!r})
        trained = []
        async with pacer.batches({size}, lease={lease}, poll={poll}, num_batches={batches}) as batches:
            i = 0
            async for batch in batches:
                trained += [g.prompt_id for g in batch.groups]
                if i == 0:
                    while (await pacer.state()).leased < {leased}:
                        await asyncio.sleep(0.01)
                    print("holding", flush=True)
                    sys.stdin.readline()  # blocks the event loop: stopped here, then told to go on
                i += 1
        print(" ".join(trained), flush=True)

    asyncio.run(main())
"""


def _stopped_past_the_grace(script: str, while_stopped: Callable[[], None], **fields: Any) -> list[str]:
    """Runs a trainer `script` (formatted with `fields`) until it holds its first batch, stops it (SIGSTOP) while
    `while_stopped()` runs, continues it, and returns the prompt ids it trained, in order (it must exit 0)."""
    trainer = subprocess.Popen([sys.executable, "-c", textwrap.dedent(script).format(**fields)],
                               stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=REPO_ROOT)
    try:
        assert trainer.stdout.readline().strip() == "holding"
        trainer.send_signal(signal.SIGSTOP)
        try:
            while_stopped()
        finally:
            trainer.send_signal(signal.SIGCONT)
        out, _ = trainer.communicate("go\n", timeout=120)
    finally:
        if trainer.poll() is None:
            trainer.kill()
    assert trainer.returncode == 0
    return out.split()


@pytest.mark.parametrize("script, prefetched", [(STOPPED_TRAINER, True), (ASYNC_STOPPED_TRAINER, True),
                                                (STOPPED_TRAINER, False)],
                         ids=["blocking", "async", "blocking-prefetch-waiting"])
def test_a_trainer_stopped_past_the_grace_goes_on_and_trains_each_group_once(tmp_path, script, prefetched) -> None:
    """SIGSTOP for longer than the grace (a frozen node, a pause, a cut network): the server takes the trainer as
    gone and its leases back. SIGCONT: its heartbeat (or its Ack, or its next Collect) names the leases it holds and
    gets them back, their groups still waiting; its Acks land and no group is trained twice. Prefetch waiting: the
    Collect it sent before the stop, still open (it would wait LEASE seconds, far longer than the test), must not
    take the lapsed groups again, and is answered empty at once, so that the trainer asks again when it goes on."""
    first = [f"s{i}" for i in range(4 if prefetched else 2)]
    with _server(tmp_path) as running, PacerClient(running.address) as pacer:
        _fill(pacer, first)

        def while_stopped() -> None:
            until(lambda: pacer.state().leased == 0, "the stopped trainer's leases to be taken back", timeout=60)
            _fill(pacer, ["s4", "s5"] if prefetched else ["s2", "s3"])  # newer groups

        trained = _stopped_past_the_grace(script, while_stopped, address=running.address, size=2 * N, lease=LEASE,
                                          batches=3 if prefetched else 2, poll=1 if prefetched else LEASE,
                                          leased=len(first))
        assert sorted(trained) == [f"s{i}" for i in range(6 if prefetched else 4)]  # each once
        state = pacer.state()
        assert (state.consumed, state.leased) == (len(trained), 0)


SUPERSEDED_TRAINER = """
    import sys, time
    from coda_client import PacerClient
    pacer = PacerClient({address!r})
    trained = []
    with pacer.batches({size}, lease={lease}, poll=1, num_batches=2) as batches:
        for i, batch in enumerate(batches):
            trained += [g.prompt_id for g in batch.groups]
            if i == 0:
                batches.ack()
                while pacer.state().leased < 2:  # the prefetch took the second batch: the only one held
                    time.sleep(0.01)
                print("holding", flush=True)
                sys.stdin.readline()  # stopped here, then told to go on
    print(" ".join(trained), batches.superseded, flush=True)
"""
ASYNC_SUPERSEDED_TRAINER = """
    import asyncio, sys, time
    from coda_client import AsyncPacerClient

    async def main():
        pacer = AsyncPacerClient({address!r})
        trained = []
        async with pacer.batches({size}, lease={lease}, poll=1, num_batches=2) as batches:
            i = 0
            async for batch in batches:
                trained += [g.prompt_id for g in batch.groups]
                if i == 0:
                    await batches.ack()
                    while (await pacer.state()).leased < 2:
                        await asyncio.sleep(0.01)
                    print("holding", flush=True)
                    sys.stdin.readline()  # blocks the event loop: stopped here, then told to go on
                i += 1
        print(" ".join(trained), batches.superseded, flush=True)

    asyncio.run(main())
"""


# The check before handing out a prefetched batch compared the lease's age with the grace the heartbeats' answers
# tell; a trainer stopped before the first answer came (the async iterator's heartbeats go through a second channel,
# which may still be connecting) took the unknown grace for "off", handed out the batch another trainer had trained
# meanwhile and failed at its Ack (LEASE_EXPIRED). This prelude keeps every heartbeat unanswered.
NO_HEARTBEAT_ANSWERED = """
    import time
    import coda_client.batches
    coda_client.batches._IteratorBase._heartbeats = lambda self, client: time.sleep(3600)
"""


@pytest.mark.parametrize("prelude", ["", NO_HEARTBEAT_ANSWERED], ids=["heartbeats", "no-heartbeat-answered"])
@pytest.mark.parametrize("script", [SUPERSEDED_TRAINER, ASYNC_SUPERSEDED_TRAINER], ids=["blocking", "async"])
def test_a_prefetched_batch_another_trainer_took_meanwhile_is_not_trained_again(tmp_path, script, prelude) -> None:
    """SIGSTOP past the grace while a prefetched batch waits to be handed out; meanwhile another trainer takes its
    groups (they went back first in line) and trains them. SIGCONT: the stopped trainer must not hand out that batch
    (its groups would be trained twice): it asks the server first, drops it, and trains the next one."""
    with _server(tmp_path) as running, PacerClient(running.address) as pacer, \
            PacerClient(running.address, client_id="trainer-other") as other:
        _fill(pacer, ["s0", "s1", "s2", "s3"])

        def while_stopped() -> None:
            until(lambda: pacer.state().leased == 0, "the stopped trainer's lease to be taken back", timeout=60)
            taken = other.collect_result(2, lease=LEASE)
            assert [g.prompt_id for g in taken.groups] == ["s2", "s3"]  # the prefetched batch's groups
            assert other.ack(taken.lease_id) == 2
            _fill(pacer, ["s4", "s5"])  # newer groups

        *trained, superseded = _stopped_past_the_grace(textwrap.dedent(prelude) + textwrap.dedent(script),
                                                       while_stopped, address=running.address, size=2 * N, lease=LEASE)
        assert trained == ["s0", "s1", "s4", "s5"] and superseded == "1"  # s2 and s3 trained by the other alone
        state = pacer.state()
        assert (state.consumed, state.leased, state.buffered) == (6, 0, 0)


def test_a_trainer_stopped_past_the_grace_while_the_server_restarts_trains_each_group_once(tmp_path) -> None:
    """SIGSTOP past the grace, and the server restarted (SIGTERM, a rolling update) before the trainer goes on: the
    restarted server knows from its journal whose silence ended the lease, so the trainer's heartbeat or Collect
    claims it back there, its Ack lands, and the groups are not delivered to it a second time."""
    from test_durability_crash import free_port

    overrides = (f"server.address=127.0.0.1:{free_port()}", f"server.state_dir={tmp_path / 'state'}")
    running = _server(tmp_path, *overrides).start()
    try:
        with PacerClient(running.address) as pacer:
            _fill(pacer, ["s0", "s1"])
        address = running.address

        def while_stopped() -> None:
            nonlocal running
            with PacerClient(address) as pacer:
                until(lambda: pacer.state().leased == 0, "the stopped trainer's lease to be taken back", timeout=60)
            assert running.terminate() == 0
            running.close()
            running = _server(tmp_path, *overrides).start()
            with PacerClient(address) as pacer:
                assert (pacer.state().buffered, pacer.state().leased) == (2, 0)
                _fill(pacer, ["s2", "s3"])  # newer groups

        trained = _stopped_past_the_grace(STOPPED_TRAINER, while_stopped, address=address, size=2 * N, lease=LEASE,
                                          batches=2, poll=LEASE, leased=2)
        assert trained == ["s0", "s1", "s2", "s3"]  # each once, in order
        with PacerClient(running.address) as pacer:
            state = pacer.state()
            assert (state.consumed, state.leased, state.reclaimed) == (4, 0, 2)
        assert "given back to it" in running.log()
    finally:
        running.close()


def test_a_trainer_grace_of_its_own_keeps_a_stopped_trainers_batches_while_a_silent_workers_groups_go(tmp_path):
    """server.trainer_liveness_seconds=60 beside the workers' 3 s: a trainer stopped (as a step holding the GIL stops
    its heartbeats) from before a worker fell silent keeps both its batches while the worker's running group is
    released; it goes on and acknowledges them, nothing delivered twice. One grace for both (null) took the trainer's
    batches back first."""
    from test_liveness import watched_worker_dispatching

    with _server(tmp_path, "server.trainer_liveness_seconds=60") as running, PacerClient(running.address) as pacer:
        _fill(pacer, ["s0", "s1", "s2", "s3"])

        def while_stopped() -> None:
            watched_worker_dispatching(running.address, "worker-1", "w0")()  # dispatches, then falls silent
            until(lambda: pacer.state().expired == 1, "the silent worker's group to be released", timeout=60)
            assert pacer.state().leased == 4  # the trainer, silent for longer than the worker, holds both batches
            assert pacer.keep_alive([]).liveness_seconds == GRACE  # the kits beat within the shorter grace

        trained = _stopped_past_the_grace(STOPPED_TRAINER, while_stopped, address=running.address, size=2 * N,
                                          lease=LEASE, batches=2, poll=1, leased=4)
        assert trained == ["s0", "s1", "s2", "s3"]
        state = pacer.state()
        assert (state.consumed, state.leased, state.redelivered) == (4, 0, 0)


WAITING_TRAINER = """
    from coda_client import PacerClient
    pacer = PacerClient({address!r}, timeout={timeout})
    trained = []
    with pacer.batches({size}, lease={lease}, poll={poll}, num_batches=1) as batches:
        print("waiting", flush=True)  # its first Collect waits on an empty buffer, and is stopped there
        for batch in batches:
            trained += [g.prompt_id for g in batch.groups]
    print(" ".join(trained), flush=True)
"""


def test_a_trainer_stopped_past_its_collects_deadline_goes_on(tmp_path) -> None:
    """SIGSTOP while the iterator's Collect waits, for longer than that call's deadline (poll + the client's timeout):
    the deadline passes while the process cannot read the answer. Going on, it asked again instead of ending the
    training loop with DEADLINE_EXCEEDED, and trains the groups once."""
    poll, timeout = 1.0, 1.0
    with _server(tmp_path) as running, PacerClient(running.address) as pacer:
        trainer = subprocess.Popen(
            [sys.executable, "-c", textwrap.dedent(WAITING_TRAINER).format(address=running.address, timeout=timeout,
                                                                           size=2 * N, lease=LEASE, poll=poll)],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO_ROOT)
        try:
            assert trainer.stdout.readline().strip() == "waiting"
            trainer.send_signal(signal.SIGSTOP)
            stopped_at = time.monotonic()
            try:
                _fill(pacer, ["d0", "d1"])
                # Past the call's deadline, and past the grace (the groups back in the buffer if the open Collect
                # had taken them).
                until(lambda: time.monotonic() - stopped_at > poll + timeout + GRACE + 1
                      and pacer.state().leased == 0, "the stopped trainer's Collect deadline to pass", timeout=60)
            finally:
                trainer.send_signal(signal.SIGCONT)
            out, err = trainer.communicate(timeout=120)
        finally:
            if trainer.poll() is None:
                trainer.kill()
        assert trainer.returncode == 0, err[-2000:]
        assert sorted(out.split()) == ["d0", "d1"]
        state = pacer.state()
        assert (state.consumed, state.leased, state.buffered) == (2, 0, 0)
