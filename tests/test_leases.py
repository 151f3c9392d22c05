"""In-flight leases, Collect leases with Ack and redelivery, and the buffer/byte caps."""
from __future__ import annotations

import pytest

from coda_client import PacerClient, Trajectory as WireTrajectory, TrajectoryStatus as WireStatus
from coda_client.errors import FailedPreconditionError, UnknownPromptError
from coda_client.errors import UnknownLeaseError as ClientUnknownLeaseError
from coda_server.core import (
    InvalidArgumentError,
    Pacer,
    PromptRef,
    ResourceExhaustedError,
    Trajectory,
    default_config_path,
    load_config,
)
from coda_server.core.errors import LeaseExpiredError, StaleDispatchError, UnknownLeaseError
from fake_clock import FakeClock
from server_harness import ServerProcess


def make_pacer(*overrides: str, journal=None) -> tuple[Pacer, FakeClock]:
    clock = FakeClock()
    config = load_config(overrides=["data_source.num_prompts_per_step=2", "data_source.num_trajectories_per_prompt=2",
                                    "trainer.mini_batch_size=2", "fully_async.sliding_window=no-window", "fully_async.stale_steps=1.0",
                                    "server.inflight_lease_seconds=10", *overrides])
    return Pacer(config, clock=clock, journal=journal), clock


def group(prompt_id: str, count: int = 2, size: int = 0) -> list[Trajectory]:
    return [Trajectory(f"{prompt_id}/t{i}", prompt_id, size_bytes=size) for i in range(count)]


def test_silent_worker_loses_its_slot_and_late_submits_are_refused():
    pacer, clock = make_pacer("rollout.continue_restored=false")  # released groups go to the next Reset
    pacer.dispatch([PromptRef("a"), PromptRef("b"), PromptRef("c"), PromptRef("d")])
    assert pacer.dispatch([PromptRef("e")]).admitted == []  # window C = 4 is full
    pacer.submit(group("a", 1))
    clock.now += 6
    pacer.submit(group("b", 2))  # b completes; a's lease was extended at 1000 and runs to 1010
    clock.now += 5  # 1011: c and d (no Submit since dispatch at 1000) and a (last Submit at 1000) ran out
    prompts, leases = pacer.expire_leases()
    assert sorted(prompts) == ["a", "c", "d"] and leases == []
    state = pacer.state()
    assert (state.running, state.expired, state.buffered) == (0, 3, 1) and state.invariant_holds()
    assert [r.prompt_id for r in pacer.dispatch([PromptRef("e"), PromptRef("f")]).admitted] == ["e", "f"]
    with pytest.raises(LeaseExpiredError) as caught:
        pacer.submit([Trajectory("a/t1", "a")])
    assert "reclaimed" in str(caught.value)
    before = pacer.state()
    assert pacer.expire_leases() == ([], [])  # nothing more ran out; state unchanged
    assert pacer.state() == before
    reset = pacer.reset(wait=0)
    assert [g.prompt_id for g in reset.expired] == ["a", "c", "d"]
    assert [len(g.trajectories) for g in reset.expired] == [1, 0, 0]  # the partial data is handed back


def test_a_released_group_is_kept_for_continuation_and_its_old_dispatch_is_fenced_off():
    """With continuation on (the default), a group released from a silent worker is kept like a restored
    group and re-offered first; the worker that lost it cannot land late trajectories in its new dispatch."""
    pacer, clock = make_pacer("rollout.continue_restored=true")
    first = pacer.dispatch([PromptRef("a"), PromptRef("b")], client_id="w1")
    seq_a = first.first_seq
    pacer.submit([Trajectory("a/t0", "a")], dispatch_seqs={"a": seq_a})
    clock.now += 11
    assert sorted(pacer.expire_leases()[0]) == ["a", "b"]
    state = pacer.state()
    assert (state.running, state.expired, state.restored_kept) == (0, 2, 2), state
    with pytest.raises(LeaseExpiredError):  # not handed out again yet: the lease's refusal
        pacer.submit([Trajectory("a/t1", "a")], dispatch_seqs={"a": seq_a})
    again = pacer.dispatch([], client_id="w2", max_continuations=1)
    (continued,) = again.continued
    assert continued.prompt_id == "a" and [t.trajectory_id for t in continued.trajectories] == ["a/t0"]
    assert continued.seq != seq_a
    before = pacer.state()
    with pytest.raises(StaleDispatchError, match="released from its dispatch seq"):
        pacer.submit([Trajectory("a/t1", "a")], dispatch_seqs={"a": seq_a})  # w1, back from a partition
    assert pacer.state() == before  # refused whole: nothing changed
    assert pacer.keep_alive(["a"], {"a": seq_a}).unknown_prompt_ids == ["a"]  # w1's heartbeat: not its group
    assert pacer.keep_alive(["a"], {"a": continued.seq}).renewed == 1
    # w2 submits the whole group anew (a/t0 is no duplicate of the released group's copy) and completes it.
    result = pacer.submit([Trajectory("a/t0", "a"), Trajectory("a/t1", "a")], dispatch_seqs={"a": continued.seq})
    assert (result.accepted, result.duplicates, result.groups_completed) == (2, 0, 1)
    assert pacer.state().buffered == 1 and pacer.state().invariant_holds()
    with pytest.raises(StaleDispatchError):  # complete and collected by now: still w2's group, not w1's
        pacer.submit([Trajectory("a/t1", "a", reward=5.0)], dispatch_seqs={"a": seq_a})


def test_a_dispatch_asking_only_for_continuations_waits_while_groups_run_and_takes_a_released_one():
    """A worker whose prompts are done asks with no candidates and max_continuations: it is answered when a group
    is kept for it (released from a dead worker), or when nothing runs any more (none can come); not while groups
    run elsewhere. A peek, and a call opting out (max_continuations 0), answer at once as before."""
    pacer, clock = make_pacer("rollout.continue_restored=true")
    pacer.dispatch([PromptRef("a")], client_id="dead")
    pacer.dispatch([PromptRef("b")], client_id="alive")
    asking = pacer.dispatch_poll([], client_id="done", max_continuations=1)
    assert asking.attempt() is None and not asking.could_answer()  # a and b run: either may come back
    assert pacer.dispatch_poll([], max_continuations=0).attempt() is not None
    assert pacer.dispatch_poll([]).attempt() is not None
    clock.now += 6
    pacer.keep_alive(["b"])  # b's worker is alive; a's lease runs out
    clock.now += 5
    assert pacer.expire_leases()[0] == ["a"]
    assert asking.could_answer()
    taken = asking.attempt()
    assert [g.prompt_id for g in taken.continued] == ["a"] and taken.running == 2
    # Both run now, under live workers: a second finished worker waits, until neither runs.
    waiting = pacer.dispatch_poll([], client_id="done-too", max_continuations=1)
    assert waiting.attempt() is None
    pacer.submit(group("a"))
    assert waiting.attempt() is None and not waiting.could_answer()
    pacer.submit(group("b"))
    assert waiting.could_answer()
    answer = waiting.attempt()
    assert answer.continued == [] and answer.running == 0  # nothing runs: the worker may end


def test_submits_extend_the_lease_and_complete_groups_never_expire():
    pacer, clock = make_pacer("fully_async.sliding_window=windowed-fifo", "data_source.num_prompts_per_step=1",
                              "data_source.num_trajectories_per_prompt=4", "trainer.mini_batch_size=4")
    pacer.dispatch([PromptRef("head"), PromptRef("next")])
    pacer.submit(group("next", 4))  # complete, but held back by windowed-fifo behind the head
    for i in range(3):  # a Submit every 8 s keeps a 10 s lease alive
        clock.now += 8
        pacer.submit([Trajectory(f"head/t{i}", "head")])
        assert pacer.expire_leases() == ([], [])
    clock.now += 100
    prompts, _ = pacer.expire_leases()
    assert prompts == ["head"]  # "next" is complete (held) and keeps its slot until the gate opens
    assert pacer.state().buffered == 1  # the head left: next is released into the buffer


def test_collect_lease_redelivers_in_original_order_unless_acknowledged():
    pacer, clock = make_pacer("server.inflight_lease_seconds=0")
    pacer.dispatch([PromptRef("a"), PromptRef("b"), PromptRef("c")])
    for prompt_id in ("a", "b", "c"):
        pacer.submit(group(prompt_id))
    leased = pacer.collect_now(2, lease_seconds=30)
    assert [g.prompt_id for g in leased.groups] == ["a", "b"] and leased.lease_id
    state = pacer.state()
    assert (state.buffered, state.leased, state.consumed) == (1, 2, 0) and state.invariant_holds()
    clock.now += 31
    assert pacer.expire_leases() == ([], [leased.lease_id])
    assert pacer.state().redelivered == 2
    with pytest.raises(LeaseExpiredError, match="ran out before this Ack; its groups went back to the buffer"):
        pacer.ack(leased.lease_id)
    again = pacer.collect_now(3, lease_seconds=30)
    assert [g.prompt_id for g in again.groups] == ["a", "b", "c"]  # original priority order kept
    assert pacer.ack(again.lease_id) == 3
    with pytest.raises(UnknownLeaseError):
        pacer.ack(again.lease_id)
    state = pacer.state()
    assert (state.consumed, state.leased, state.buffered) == (3, 0, 0) and state.invariant_holds()


def test_a_released_lease_returns_its_groups_at_once_ahead_of_newer_ones():
    """Release: the trainer gives leased groups back untrained; they are first in line again, in their order, without
    waiting for the lease to run out (the same return as an expiry, counted as redelivered)."""
    pacer, clock = make_pacer("server.inflight_lease_seconds=0")
    pacer.dispatch([PromptRef("a"), PromptRef("b"), PromptRef("c")])
    for prompt_id in ("a", "b", "c"):
        pacer.submit(group(prompt_id))
    leased = pacer.collect_now(2, lease_seconds=600)
    assert pacer.release(leased.lease_id) == 2  # no time passed: not an expiry
    state = pacer.state()
    assert (state.buffered, state.leased, state.redelivered, state.consumed) == (3, 0, 2, 0) and state.invariant_holds()
    assert pacer.release(leased.lease_id) == 0  # given back already: nothing more to give
    with pytest.raises(LeaseExpiredError, match=r"was given back \(Release\) before this Ack"):
        pacer.ack(leased.lease_id)
    again = pacer.collect_now(3, lease_seconds=30)
    assert [g.prompt_id for g in again.groups] == ["a", "b", "c"]
    assert pacer.ack(again.lease_id) == 3
    before = pacer.state()
    with pytest.raises(UnknownLeaseError, match="never granted, already acknowledged, or ended so long ago"):
        pacer.release(again.lease_id)  # acknowledged: consumed for good, nothing to give back
    with pytest.raises(UnknownLeaseError):
        pacer.release("lease-999")
    with pytest.raises(InvalidArgumentError):
        pacer.release("")
    assert pacer.state() == before


def test_negative_lease_is_refused_and_changes_nothing():
    pacer, _ = make_pacer()
    pacer.dispatch([PromptRef("a")])
    pacer.submit(group("a"))
    before = pacer.state()
    with pytest.raises(InvalidArgumentError):
        pacer.collect_now(1, lease_seconds=-1)
    assert pacer.state() == before


def test_buffer_cap_refuses_with_retry_delay_and_changes_nothing():
    pacer, _ = make_pacer("server.max_buffered_groups=1", "server.inflight_lease_seconds=0")
    pacer.dispatch([PromptRef("a"), PromptRef("b")])
    pacer.submit(group("a"))
    before = pacer.state()
    with pytest.raises(ResourceExhaustedError) as caught:
        pacer.submit(group("b"))
    assert caught.value.retry_after > 0 and "max_buffered_groups = 1" in str(caught.value)
    assert pacer.state() == before
    pacer.collect_now(1)
    assert pacer.submit(group("b")).groups_completed == 1


def test_byte_cap_counts_queued_and_buffered_bytes_and_frees_them_on_consumption():
    pacer, _ = make_pacer("server.max_held_bytes=300", "server.inflight_lease_seconds=0")
    pacer.dispatch([PromptRef("a"), PromptRef("b")])
    pacer.submit(group("a", size=100))
    assert pacer.state().held_bytes == 200
    before = pacer.state()
    with pytest.raises(ResourceExhaustedError) as caught:
        pacer.submit(group("b", size=100))
    assert "max_held_bytes = 300" in str(caught.value) and pacer.state() == before
    pacer.collect_now(1)
    assert pacer.state().held_bytes == 0
    pacer.submit(group("b", size=100))
    assert pacer.state().held_bytes == 200


def test_a_group_a_filter_drops_frees_its_bytes_at_once():
    # group() gives every trajectory reward 0: the reward filter drops each group as it completes.
    pacer, _ = make_pacer("server.max_held_bytes=300", "server.inflight_lease_seconds=0", "rollout.filter=[reward]")
    pacer.dispatch([PromptRef("a"), PromptRef("b")])
    pacer.submit(group("a", size=100))
    state = pacer.state()
    assert (state.filtered, state.buffered, state.held_bytes) == (1, 0, 0)
    # Were a's 200 bytes still counted, b's 200 would be refused as over the 300-byte cap.
    assert pacer.submit(group("b", size=100)).accepted == 2
    assert pacer.state().held_bytes == 0 and pacer.state().filtered == 2


def test_ack_and_redelivery_over_grpc(tmp_path):
    with ServerProcess(tmp_path, "data_source.num_prompts_per_step=2", "data_source.num_trajectories_per_prompt=1",
                       "trainer.mini_batch_size=1") as server, PacerClient(server.address) as pacer:
        pacer.dispatch(["a", "b"])
        pacer.submit([WireTrajectory(trajectory_id=f"{p}/t", prompt_id=p, status=WireStatus.COMPLETED)
                      for p in ("a", "b")])
        with pacer.collect_leased(1, lease=60) as groups:  # acknowledged when the block completes
            assert [g.prompt_id for g in groups] == ["a"]
        lapsed = pacer.collect_result(1, lease=0.2)
        assert [g.prompt_id for g in lapsed.groups] == ["b"] and pacer.state().leased == 1
        redelivered = pacer.collect_result(1, wait=30)  # waits until the lease runs out and b comes back
        assert [g.prompt_id for g in redelivered.groups] == ["b"]
        with pytest.raises(FailedPreconditionError) as caught:
            pacer.ack(lapsed.lease_id)
        assert caught.value.reason == "LEASE_EXPIRED"
        with pytest.raises(ClientUnknownLeaseError) as caught:  # an UnknownPromptError too, as every NOT_FOUND was
            pacer.ack("lease-unknown")
        assert caught.value.reason == "UNKNOWN_LEASE" and isinstance(caught.value, UnknownPromptError)
        state = pacer.state()
        assert (state.consumed, state.redelivered, state.leased, state.buffered) == (2, 1, 0, 0)


def test_recovery_gives_in_flight_and_collect_leases_their_full_time_on_the_new_clock(tmp_path):
    from coda_server.core.sqlite_journal import SqliteJournal

    first, _ = make_pacer(journal=SqliteJournal(tmp_path / "state", fsync="off"))
    first.dispatch([PromptRef("a"), PromptRef("b"), PromptRef("c")])
    first.submit(group("a") + group("b"))
    leased = first.collect_now(1, lease_seconds=30)
    first.journal.close()

    pacer, clock = make_pacer(journal=SqliteJournal(tmp_path / "state", fsync="off"))
    clock.now = 5.0  # another process: its clock reads something else entirely
    pacer.recover()
    assert pacer.expire_leases() == ([], [])  # neither kind ran out on the old clock's account
    clock.now += 11
    assert pacer.expire_leases() == (["c"], [])  # the in-flight lease: 10 s from recovery
    clock.now += 20
    assert pacer.expire_leases() == ([], [leased.lease_id])  # the Collect lease: 30 s from recovery
    state = pacer.state()
    assert (state.expired, state.redelivered, state.buffered) == (1, 1, 2) and state.invariant_holds()
    pacer.journal.close()


def test_a_release_is_journaled_and_a_recovered_pacer_holds_the_groups_buffered_in_order(tmp_path):
    from coda_server.core.sqlite_journal import SqliteJournal

    first, _ = make_pacer("server.inflight_lease_seconds=0", journal=SqliteJournal(tmp_path / "state", fsync="off"))
    first.dispatch([PromptRef("a"), PromptRef("b"), PromptRef("c")])
    first.submit(group("a") + group("b") + group("c"))
    leased = first.collect_now(2, lease_seconds=600)
    assert first.release(leased.lease_id) == 2
    expected = first.state()
    first.journal.close()

    pacer, _ = make_pacer("server.inflight_lease_seconds=0", journal=SqliteJournal(tmp_path / "state", fsync="off"))
    pacer.recover()
    state = pacer.state()
    assert (state.buffered, state.leased, state.redelivered) == (3, 0, 2) == (expected.buffered, expected.leased,
                                                                              expected.redelivered)
    with pytest.raises(LeaseExpiredError, match=r"was given back \(Release\)"):  # still ended across the restart
        pacer.ack(leased.lease_id)
    assert [g.prompt_id for g in pacer.collect_now(3).groups] == ["a", "b", "c"]
    pacer.journal.close()


def test_release_over_grpc_and_collect_leased_gives_its_groups_back_on_an_exception(tmp_path):
    with ServerProcess(tmp_path, "data_source.num_prompts_per_step=3", "data_source.num_trajectories_per_prompt=1",
                       "trainer.mini_batch_size=1") as server, PacerClient(server.address) as pacer:
        pacer.dispatch(["a", "b", "c"])
        pacer.submit([WireTrajectory(trajectory_id=f"{p}/t", prompt_id=p, status=WireStatus.COMPLETED)
                      for p in ("a", "b", "c")])
        leased = pacer.collect_result(2, lease=600)
        assert pacer.release(leased.lease_id) == 2 and pacer.state().leased == 0
        assert pacer.release(leased.lease_id) == 0  # a retry after the answer was lost is harmless
        with pytest.raises(ClientUnknownLeaseError):
            pacer.release("lease-unknown")
        with pytest.raises(RuntimeError, match="the training step failed"):
            with pacer.collect_leased(2, lease=600) as groups:
                assert [g.prompt_id for g in groups] == ["a", "b"]
                raise RuntimeError("the training step failed")
        state = pacer.state()
        assert (state.leased, state.buffered, state.consumed, state.redelivered) == (0, 3, 0, 4)
        again = pacer.collect(3, wait=0)  # at once: no lease had to run out
        assert [g.prompt_id for g in again] == ["a", "b", "c"]


def test_a_configuration_without_the_lease_key_gets_the_shipped_default_lease():
    """One default for server.inflight_lease_seconds, the shipped file's: a Pacer built from a configuration
    that lacks the key (an embedding's own OmegaConf) reclaims silent groups after it too."""
    from omegaconf import OmegaConf

    shipped = float(OmegaConf.load(default_config_path()).server.inflight_lease_seconds)
    assert shipped > 0
    config = load_config(overrides=["fully_async.sliding_window=no-window"])
    OmegaConf.set_struct(config, False)
    del config.server["inflight_lease_seconds"]
    clock = FakeClock()
    pacer = Pacer(config, clock=clock)
    pacer.dispatch([PromptRef("a")])
    clock.now += shipped - 1
    assert pacer.expire_leases() == ([], [])
    clock.now += 2
    assert pacer.expire_leases() == (["a"], [])


def test_a_snapshot_written_before_reasons_were_kept_restores_its_ended_leases_without_one():
    from coda_server.core.leases import Leases

    leases = Leases(0)
    leases.restore({"leases": [], "lease_serial": 3, "lapsed_leases": ["lease-1"]}, now=0.0)
    with pytest.raises(LeaseExpiredError, match="ran out or was given back"):
        leases.acknowledge("lease-1")
    assert leases.reclaimable == {} and leases.serial == 3


def test_a_submit_fenced_with_a_seq_never_given_to_its_group_is_refused_as_such():
    """A seq later than the group's latest was never its dispatch: refused as a bad argument, not told that the group
    "was released from seq 999 and dispatched again to another worker" (false: this worker still holds it)."""
    pacer, _ = make_pacer()
    seq = pacer.dispatch([PromptRef("a")], client_id="w1").first_seq
    before = pacer.state()
    with pytest.raises(InvalidArgumentError, match=f"seq 999 for group 'a', a seq the server never gave it: its "
                                                   f"dispatch is seq {seq}"):
        pacer.submit([Trajectory("a/t0", "a")], dispatch_seqs={"a": 999})
    assert pacer.state() == before
    assert pacer.submit([Trajectory("a/t0", "a")], dispatch_seqs={"a": seq}).accepted == 1
