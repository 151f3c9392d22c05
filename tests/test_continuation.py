"""Partial-rollout continuation: restored groups kept by the server, re-offered first on Dispatch in the
replay strategy's order, with their partial trajectories, journaled across restarts; and KeepAlive."""
from __future__ import annotations

import pytest

from coda_client import PacerClient, Trajectory as WireTrajectory, TrajectoryStatus as WireStatus
from coda_client.errors import BadRequestError
from coda_server.core import ConfigError, InvalidArgumentError, Pacer, PromptRef, Trajectory, TrajectoryStatus, load_config
from coda_server.core.replay import BufferReplayStrategy, register_buffer_replay_strategy
from conftest import core_overrides, load_core_config
from fake_clock import FakeClock
from server_harness import ServerProcess
from test_durability_restart import Restartable

ABORTED, COMPLETED = TrajectoryStatus.ABORTED, TrajectoryStatus.COMPLETED


def continuing_pacer(*extra: str, clock=None, B: int = 2) -> Pacer:
    config = load_core_config("no-window", B=B, stale=1.0, N=2, continue_restored=True, extra=extra)
    return Pacer(config, clock=clock) if clock is not None else Pacer(config)


def aborted_group(prompt_id: str, tokens: int = 3) -> list[Trajectory]:
    return [Trajectory(f"{prompt_id}#{i}", prompt_id, status=ABORTED, body=("partial", prompt_id, i, tokens),
                       size_bytes=10) for i in range(2)]


def restore(pacer: Pacer, *prompt_ids: str) -> None:
    """Dispatch these groups, submit them aborted, Reset (ABORT) and resume at weight version 1."""
    assert pacer.dispatch([PromptRef(p) for p in prompt_ids]).admitted_ids == list(prompt_ids)
    for prompt_id in prompt_ids:
        pacer.submit(aborted_group(prompt_id))
    reset = pacer.reset(wait=0)
    assert reset.restored == [] and reset.kept_prompt_ids == list(prompt_ids) and reset.dropped_prompt_ids == []
    pacer.resume(1)


def test_restored_groups_are_kept_and_re_offered_first_with_their_partial_trajectories():
    pacer = continuing_pacer()
    restore(pacer, "a", "b")
    state = pacer.state()
    assert state.restored_kept == 2 and state.held_bytes == 40  # kept groups' bytes stay held
    result = pacer.dispatch([PromptRef("c"), PromptRef("d")], max_continuations=1)
    assert [g.prompt_id for g in result.continued] == ["a"]  # FIFO: the oldest restored first
    continued = result.continued[0]
    assert [t.body for t in continued.trajectories] == [("partial", "a", 0, 3), ("partial", "a", 1, 3)]
    assert [t.status for t in continued.trajectories] == [ABORTED, ABORTED]
    # Continuations take the first seqs of the call, then the candidates (window C = 4 admits 3 more).
    assert continued.seq == 2 and result.admitted_ids == ["c", "d"] and result.first_seq == 3
    state = pacer.state()
    assert (state.running, state.restored_kept, state.held_bytes) == (3, 1, 20) and state.invariant_holds()
    # The continued group is an ordinary running group: its worker submits all N again, completed now.
    pacer.submit([Trajectory(f"a#{i}", "a", status=COMPLETED, body=("done", i)) for i in range(2)])
    assert [g.prompt_id for g in pacer.collect(1).groups] == ["a"]


def test_a_dispatch_that_opts_out_gets_no_continuation_and_a_kept_prompt_is_not_a_candidate():
    pacer = continuing_pacer()
    restore(pacer, "a")
    # max_continuations 0: workers that cannot continue (by default a Dispatch gets kept groups first)
    assert pacer.dispatch([PromptRef("c")], max_continuations=0).continued == []
    before = pacer.state()
    with pytest.raises(InvalidArgumentError) as refused:
        pacer.dispatch([PromptRef("d"), PromptRef("a")])
    assert refused.value.violations[0][0] == "candidates[1].prompt_id" and "kept for continuation" in str(refused.value)
    assert pacer.state() == before  # nothing admitted, nothing taken
    with pytest.raises(InvalidArgumentError, match="max_continuations -1 must be an integer >= 0"):
        pacer.dispatch([PromptRef("d")], max_continuations=-1)


def test_a_dispatch_asking_only_for_continuations_waits_through_a_reset_for_its_kept_groups():
    """Between a Reset (ABORT) and its RESUME nothing runs, but the restored groups are kept: a worker whose
    prompts are done, asking only for continuations, is not told that nothing can come; it gets them after RESUME."""
    pacer = continuing_pacer()
    assert pacer.dispatch([PromptRef("a")]).admitted_ids == ["a"]
    pacer.submit(aborted_group("a"))
    assert pacer.reset(wait=0).kept_prompt_ids == ["a"]
    asking = pacer.dispatch_poll([], max_continuations=1)
    assert pacer.state().running == 0 and asking.attempt() is None and not asking.could_answer()
    pacer.resume(1)
    assert asking.could_answer()
    assert [g.prompt_id for g in asking.attempt().continued] == ["a"]


def test_continuations_count_against_the_window_and_wait_while_paused():
    pacer = continuing_pacer()
    restore(pacer, "a", "b")
    pacer.dispatch([PromptRef("x"), PromptRef("y"), PromptRef("z")], max_continuations=0)  # C = 4: one slot left
    result = pacer.dispatch([], max_continuations=2)
    assert [g.prompt_id for g in result.continued] == ["a"] and pacer.state().restored_kept == 1
    assert pacer.dispatch([], max_continuations=2).continued == []  # the window is full
    pacer.begin_reset()
    assert pacer.dispatch([], max_continuations=2).continued == []  # paused: nothing is handed out


def test_the_old_behaviour_hands_restored_groups_to_the_reset_caller():
    config = load_core_config("no-window", B=2, N=2, continue_restored=False)
    pacer = Pacer(config)
    pacer.dispatch([PromptRef("a")])
    pacer.submit(aborted_group("a"))
    reset = pacer.reset(wait=0)
    assert [g.prompt_id for g in reset.restored] == ["a"] and reset.kept_prompt_ids == []
    assert pacer.state().restored_kept == 0 and pacer.dispatch([], max_continuations=4).continued == []


def test_a_registered_replay_strategy_orders_the_re_offer(scratch_registry):
    @register_buffer_replay_strategy("test-newest-first")
    class NewestFirst(BufferReplayStrategy):
        def select(self, restored, count, step):
            return list(reversed(restored))[:count]

    pacer = continuing_pacer("data_source.dataset.buffer_replay_strategy=test-newest-first", B=3)
    restore(pacer, "a", "b", "c")
    assert [g.prompt_id for g in pacer.dispatch([], max_continuations=2).continued] == ["c", "b"]


def test_a_replay_strategy_must_pick_among_the_groups_it_was_given(scratch_registry):
    @register_buffer_replay_strategy("test-forger")
    class Forger(BufferReplayStrategy):
        def select(self, restored, count, step):
            return [*restored, *restored][:count]  # the same group twice

    pacer = continuing_pacer("data_source.dataset.buffer_replay_strategy=test-forger")
    restore(pacer, "a")
    before = pacer.state()
    with pytest.raises(RuntimeError, match="at most 2 distinct groups"):
        pacer.dispatch([], max_continuations=2)
    assert pacer.state() == before


def test_unknown_replay_strategy_stops_start_up_naming_the_registered_ones():
    with pytest.raises(ConfigError) as refused:
        load_config(overrides=["data_source.dataset.buffer_replay_strategy=lifo-ish"])
    assert "data_sources[0].dataset.buffer_replay_strategy" in str(refused.value) and "fifo" in str(refused.value)
    with pytest.raises(ConfigError, match="rollout.continue_restored"):
        load_config(overrides=["rollout.continue_restored=sometimes"])


def test_keep_alive_renews_running_leases_and_names_groups_no_longer_in_flight():
    clock = FakeClock(100.0)
    pacer = continuing_pacer("server.inflight_lease_seconds=10", clock=clock)
    pacer.dispatch([PromptRef("a"), PromptRef("b")])
    clock.now += 8
    answer = pacer.keep_alive(["a", "gone"])
    assert (answer.renewed, answer.unknown_prompt_ids, answer.lease_seconds) == (1, ["gone"], 10.0)
    clock.now += 4  # 112: b's lease (to 110) ran out, a's was renewed to 118
    assert pacer.expire_leases() == (["b"], [])
    clock.now += 5  # 117: still within a's renewed lease
    assert pacer.expire_leases() == ([], [])
    clock.now += 2  # 119: a renewal lasts one lease, no longer
    assert pacer.expire_leases() == (["a"], [])
    assert pacer.keep_alive(["b"]).unknown_prompt_ids == ["b"]  # reclaimed: the worker should stop
    heartbeat = pacer.keep_alive([])  # no prompt ids: a heartbeat alone (a trainer holding leases), renewing nothing
    assert (heartbeat.renewed, heartbeat.unknown_prompt_ids) == (0, [])
    with pytest.raises(InvalidArgumentError, match=r"prompt_ids\[0\] must be a non-empty string"):
        pacer.keep_alive([""])


def test_kept_groups_survive_a_kill_and_a_dispatch_that_took_them_is_replayed(tmp_path):
    durable = Restartable(tmp_path, "state", "rollout.continue_restored=true")
    try:
        pacer = durable.client
        pacer.dispatch(["a", "b", "c"])
        pacer.submit([WireTrajectory(trajectory_id=f"{p}#{i}", prompt_id=p, status=WireStatus.ABORTED,
                                     token_ids=[1, 2, i], logprobs=[-1.0, -1.0, -1.0], segment_lengths=[3],
                                     segment_weight_versions=[0]) for p in "abc" for i in range(2)])
        reset = pacer.reset("abort", wait=5, resume=True, weight_version=1)
        assert reset.kept_prompt_ids == ["a", "b", "c"] and reset.restored == []
        durable.restart(kill=True)  # kept groups are in the Reset's snapshot
        assert pacer.state().restored_kept == 3
        taken = pacer.dispatch(["d"], max_continuations=1, request_id="take-a")
        assert [g.prompt_id for g in taken.continuations] == ["a"] and taken.admitted == ["d"]
        assert [t.token_ids for t in taken.continuations[0].trajectories] == [[1, 2, 0], [1, 2, 1]]
        assert taken.continuations[0].trajectories[0].segment_weight_versions == [0]
        durable.restart(kill=True)  # the Dispatch is replayed with the group it handed out
        state = pacer.state()
        assert (state.restored_kept, state.running) == (2, 2)
        again = pacer.dispatch(["d"], max_continuations=1, request_id="take-a")  # a retry: the same answer
        assert [g.prompt_id for g in again.continuations] == ["a"] and again.seqs == taken.seqs
        assert [g.prompt_id for g in pacer.dispatch([], max_continuations=2).continuations] == ["b", "c"]
    finally:
        durable.close()


def test_keep_alive_and_continuations_over_grpc(tmp_path):
    with ServerProcess(tmp_path, *core_overrides("no-window", B=2, N=2, continue_restored=True),
                       "server.inflight_lease_seconds=30") as server, PacerClient(server.address) as pacer:
        pacer.dispatch(["a"])
        answer = pacer.keep_alive(["a", "z"])
        assert (answer.renewed, answer.unknown_prompt_ids, answer.lease_seconds) == (1, ["z"], 30.0)
        assert pacer.keep_alive([]).renewed == 0  # a heartbeat alone
        with pytest.raises(BadRequestError) as refused:
            pacer.keep_alive([""])
        assert refused.value.field_violations[0].field == "prompt_ids[0]"
        pacer.submit([WireTrajectory(trajectory_id=f"a#{i}", prompt_id="a", status=WireStatus.ABORTED,
                                     token_ids=[7] * (i + 1), segment_lengths=[i + 1], segment_weight_versions=[0])
                      for i in range(2)])
        reset = pacer.reset("abort", wait=5, resume=True, weight_version=3)
        assert reset.kept_prompt_ids == ["a"] and pacer.state().restored_kept == 1
        with pytest.raises(BadRequestError, match="kept for continuation"):
            pacer.dispatch(["a"])
        result = pacer.dispatch(["b"], max_continuations=4)
        assert result.admitted == ["b"] and [g.prompt_id for g in result.continuations] == ["a"]
        assert result.seqs[0] == result.continuations[0].seq + 1
        assert [t.token_ids for t in result.continuations[0].trajectories] == [[7], [7, 7]]


def segmented(prompt_id: str, i: int, lengths: list[int], versions: list[int]) -> WireTrajectory:
    tokens = sum(lengths)
    return WireTrajectory(trajectory_id=f"{prompt_id}#{i}", prompt_id=prompt_id, status=WireStatus.COMPLETED,
                          token_ids=list(range(tokens)), logprobs=[-0.5] * tokens, loss_mask=[1] * tokens,
                          start_weight_version=versions[0] if versions else 0,
                          end_weight_version=versions[-1] if versions else 0, segment_lengths=lengths,
                          segment_weight_versions=versions)


def test_the_batch_iterator_masks_tokens_of_older_weight_versions(tmp_path):
    pytest.importorskip("numpy", reason="the batch iterator needs NumPy (the test extra installs it)")
    with ServerProcess(tmp_path, *core_overrides("no-window", B=2, N=2, M=4)) as server, \
            PacerClient(server.address) as pacer:
        pacer.dispatch(["a", "b"])
        unsegmented = WireTrajectory(trajectory_id="b#0", prompt_id="b", status=WireStatus.COMPLETED,
                                     token_ids=[5, 6], start_weight_version=0, end_weight_version=1)
        pacer.submit([segmented("a", 0, [2, 3], [0, 1]), segmented("a", 1, [4], [1]), unsegmented,
                      segmented("b", 1, [1, 1, 1], [0, 0, 1])])
        with pacer.batches(4, mask_offpolicy=True, num_batches=1) as batches:
            batch = next(iter(batches))
            # Collect order is seq order: a#0 a#1 b#0 b#1 (b#0 has no segments: one version throughout).
            assert [t.trajectory_id for t in batch.trajectories] == ["a#0", "a#1", "b#0", "b#1"]
            assert list(batch.token_weight_version) == [0, 0, 1, 1, 1] + [1] * 4 + [1, 1] + [0, 0, 1]
            assert list(batch.loss_mask) == [0, 0, 1, 1, 1] + [1] * 4 + [1, 1] + [0, 0, 1]
            assert list(batch.offpolicy_mask()) == list(batch.loss_mask)
        assert pacer.dispatch(["c"]).admitted == ["c"]
        bad = segmented("c", 0, [4], [0])
        with pytest.raises(BadRequestError, match="segment_lengths add up to 3 tokens but token_ids holds 4"):
            pacer.submit([WireTrajectory(**{**bad.__dict__, "segment_lengths": [3]})])
        with pytest.raises(BadRequestError, match="segment_lengths and segment_weight_versions must have equal"):
            pacer.submit([WireTrajectory(**{**bad.__dict__, "segment_weight_versions": [0, 1]})])
        assert pacer.state().submitted == 4  # nothing of the refused Submits was taken
