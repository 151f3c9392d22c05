"""Bad input raises a typed error and leaves the pacer exactly as it was (counters and internal queues)."""
from __future__ import annotations

import copy

import pytest

from coda_server import TrajectoryStatus
from coda_server.core import (
    InvalidArgumentError,
    PacerError,
    PromptRef,
    ResetInProgressError,
    StaleGenerationError,
    Trajectory,
    UnknownPromptError,
)

OK, FAILED, ABORTED = TrajectoryStatus.COMPLETED, TrajectoryStatus.FAILED, TrajectoryStatus.ABORTED
TWO_SOURCES = ("data_sources=['${data_source}',{name: b, num_trajectories_per_prompt: 3}]",)


def traj(pid, i, status=OK, reward=None, ds=0, body=None):
    return Trajectory(f"{pid}/t{i}", pid, ds, status, reward=float(i) if reward is None else reward,
                      body=body if body is not None else {"tokens": [i, i + 1]})


def snapshot(pacer):
    """Everything observable, deep-copied: the state, the running groups, and what a snapshot would keep."""
    exported = pacer.export_state()
    del exported["totals"]  # the state's counters
    return copy.deepcopy({
        "state": pacer.state(),
        "running": [(g.prompt_id, g.seq, g.ds_index, [(t.trajectory_id, t.status, t.reward, t.body)
                                                     for t in g.trajectories]) for g in pacer.running_groups()],
        "exported": exported,
        "strategy_running": pacer.strategy.running_count,
        "flags": (pacer.paused, pacer.resetting, pacer.step, pacer.weight_version, pacer.generation),
    })


@pytest.fixture(params=["no-window", "window-gated", "windowed-fifo", "latency-aware"])
def busy(request, core_pacer):
    """A pacer one reset in (weight_version 5), with groups in every place: buffer, collected, partial, gated."""
    # latency-aware with windowed-fifo's window of B, so that p5 below is held by both
    window = ("fully_async.latency_aware.collect_window=1.0",) if request.param == "latency-aware" else ()
    pacer = core_pacer(request.param, B=4, stale=1.0, N=2, extra=TWO_SOURCES + window)  # C = 8
    pacer.dispatch([PromptRef("old")])
    pacer.submit([traj("old", 0)])
    pacer.reset(resume=True, weight_version=5)
    pacer.dispatch([PromptRef("p0"), PromptRef("p1"), PromptRef("p2"), PromptRef("q0", 1), PromptRef("p3"),
                    PromptRef("p4"), PromptRef("p5")])
    pacer.submit([traj("p0", 0), traj("p0", 1)])  # -> buffer, then the trainer takes it
    assert [g.prompt_id for g in pacer.collect_now(1).groups] == ["p0"]
    pacer.submit([traj("p1", 0), traj("p1", 1)])  # -> buffer, stays there
    pacer.submit([traj("p2", 0)])  # partial
    pacer.submit([traj("q0", 0, ds=1)])  # partial, group size 3
    pacer.submit([traj("p5", 0), traj("p5", 1)])  # windowed-fifo: seq 6 - min 2 >= 4 -> held
    pacer.submit([traj("p4", 0), traj("p4", 1, ABORTED)])  # gate-refused everywhere
    st = pacer.state()
    assert st.buffered == (1 if request.param in ("windowed-fifo", "latency-aware") else 2)  # same gate
    assert st.invariant_holds()
    return pacer


def assert_unchanged(pacer, call, error=PacerError, match=None):
    before = snapshot(pacer)
    with pytest.raises(error, match=match) as info:
        call()
    assert snapshot(pacer) == before
    return info.value


# ----------------------------------------------------------------------------- submit


@pytest.mark.parametrize("bad", [
    pytest.param(lambda: Trajectory("", "p2", 0, OK), id="empty-trajectory-id"),
    pytest.param(lambda: Trajectory("p2/x", "", 0, OK), id="empty-prompt-id"),
    pytest.param(lambda: Trajectory("p2/x", "p2", 0, TrajectoryStatus.UNSPECIFIED), id="unspecified-status"),
    pytest.param(lambda: Trajectory("p2/x", "p2", 0, OK, reward=float("nan")), id="nan-reward"),
    pytest.param(lambda: Trajectory("p2/x", "p2", 7, OK), id="unknown-ds-index"),
    pytest.param(lambda: Trajectory("p2/x", "p2", 1, OK), id="ds-index-not-the-prompts"),
    pytest.param(lambda: Trajectory("p2/\x00", "p2", 0, OK), id="control-char-id"),
    pytest.param(lambda: Trajectory("x" * 600, "p2", 0, OK), id="overlong-id"),
])
def test_malformed_trajectory_is_refused_and_nothing_changes(busy, bad):
    # A valid trajectory in the same batch is not taken either (all-or-nothing).
    err = assert_unchanged(busy, lambda: busy.submit([traj("p3", 0), bad()]), InvalidArgumentError)
    assert err.violations and err.violations[0][0].startswith("trajectories[1]")


def test_oversized_group_in_one_batch(busy):
    assert_unchanged(busy, lambda: busy.submit([traj("p3", 0), traj("p3", 1), traj("p3", 2)]),
                     InvalidArgumentError, match="more than its 2")


def test_oversized_group_across_batches(busy):
    assert_unchanged(busy, lambda: busy.submit([traj("p2", 1), traj("p2", 2)]), InvalidArgumentError)
    assert_unchanged(busy, lambda: busy.submit([traj("q0", 1, ds=1), traj("q0", 2, ds=1), traj("q0", 3, ds=1)]),
                     InvalidArgumentError, match="more than its 3")


def test_submit_to_a_group_that_already_left_the_queue(busy):
    assert_unchanged(busy, lambda: busy.submit([traj("p1", 9)]), InvalidArgumentError, match="already complete")
    assert_unchanged(busy, lambda: busy.submit([traj("p0", 9)]), InvalidArgumentError, match="already complete")


@pytest.mark.parametrize("pid,where", [("p2", "partial"), ("p1", "buffer"), ("p0", "taken"), ("p5", "held"),
                                       ("p4", "aborted")])
def test_duplicate_id_with_different_content_is_refused(busy, pid, where):
    for changed in (traj(pid, 0, reward=99.0), traj(pid, 0, FAILED), traj(pid, 0, body={"tokens": [7]})):
        assert_unchanged(busy, lambda: busy.submit([changed]), InvalidArgumentError, match="different content")
    # Same id, other prompt: also different content.
    other = Trajectory(f"{pid}/t0", "p3", 0, OK, reward=0.0, body={"tokens": [0, 1]})
    assert_unchanged(busy, lambda: busy.submit([other]), InvalidArgumentError)


@pytest.mark.parametrize("pid", ["p2", "p1", "p0", "p5", "p4"])
def test_duplicate_id_with_same_content_is_a_counted_harmless_retry(busy, pid):
    before = snapshot(busy)
    result = busy.submit([traj(pid, 0)])
    assert (result.accepted, result.duplicates, result.groups_completed) == (0, 1, 0)
    after = snapshot(busy)
    assert after["state"].duplicates == before["state"].duplicates + 1
    before["state"].duplicates += 1
    assert after == before


def test_duplicate_within_one_batch(busy):
    result = busy.submit([traj("p3", 0), traj("p3", 0)])
    assert (result.accepted, result.duplicates) == (1, 1)
    assert_unchanged(busy, lambda: busy.submit([traj("p3", 1), traj("p3", 1, reward=5.0)]), InvalidArgumentError)


def test_unknown_prompt(busy):
    assert_unchanged(busy, lambda: busy.submit([traj("p3", 0), traj("never", 0)]), UnknownPromptError)


def test_stale_prompt_only_counts_the_rejection(busy):
    before = snapshot(busy)
    with pytest.raises(StaleGenerationError) as info:
        busy.submit([traj("p3", 0), traj("old", 1)])
    assert info.value.reason == "STALE_GENERATION"
    after = snapshot(busy)
    assert after["state"].stale_rejected == before["state"].stale_rejected + 1
    before["state"].stale_rejected += 1
    assert after == before
    # A re-send of the trajectory accepted before the reset is stale too, not a duplicate.
    with pytest.raises(StaleGenerationError):
        busy.submit([traj("old", 0)])


def test_oversized_submit_call(core_pacer):
    pacer = core_pacer("no-window", N=1, extra=("server.max_submit_trajectories=2",))
    pacer.dispatch([PromptRef("a"), PromptRef("b"), PromptRef("c")])
    assert_unchanged(pacer, lambda: pacer.submit([traj(p, 0) for p in "abc"]), InvalidArgumentError)


# ----------------------------------------------------------------------------- dispatch


@pytest.mark.parametrize("candidates", [
    pytest.param([PromptRef("new"), PromptRef("p2")], id="in-flight"),
    pytest.param([PromptRef("new"), PromptRef("p4")], id="in-flight-aborted"),
    pytest.param([PromptRef("new"), PromptRef("new")], id="named-twice"),
    pytest.param([PromptRef("new"), PromptRef("")], id="empty-id"),
    pytest.param([PromptRef("new"), PromptRef("x", 2)], id="unknown-ds-index"),
    pytest.param([PromptRef("new"), PromptRef("x", -1)], id="negative-ds-index"),
])
def test_bad_dispatch_admits_nothing(busy, candidates):
    assert_unchanged(busy, lambda: busy.dispatch(candidates), InvalidArgumentError)


def test_too_many_candidates(core_pacer):
    pacer = core_pacer("no-window", extra=("server.max_dispatch_candidates=3",))
    assert_unchanged(pacer, lambda: pacer.dispatch([PromptRef(f"c{i}") for i in range(4)]), InvalidArgumentError)


# ----------------------------------------------------------------------------- collect


@pytest.mark.parametrize("num_groups", [0, -1, 65537, 1.5, True, "2", None])
def test_collect_num_groups_out_of_range(busy, num_groups):
    assert_unchanged(busy, lambda: busy.collect(num_groups), InvalidArgumentError)
    assert_unchanged(busy, lambda: busy.collect_now(num_groups), InvalidArgumentError)


def test_collect_more_than_buffered_without_partial_changes_nothing(busy):
    before = snapshot(busy)
    result = busy.collect_now(5)
    assert result.groups == [] and result.timed_out
    assert snapshot(busy) == before


# ----------------------------------------------------------------------------- reset / resume


@pytest.mark.parametrize("version", [4, 0, -1, 5.5, "6", True])
def test_resume_with_a_lower_or_bad_weight_version(busy, version):
    assert_unchanged(busy, lambda: busy.resume(version), InvalidArgumentError)
    assert_unchanged(busy, lambda: busy.reset(resume=True, weight_version=version), InvalidArgumentError)
    assert not busy.paused  # the refused Reset did not even pause


def test_resume_with_the_same_weight_version_is_allowed(busy):
    assert busy.resume(5).step == busy.step


def test_reset_during_reset(busy):
    busy.begin_reset()
    assert busy.resetting and busy.paused
    assert_unchanged(busy, lambda: busy.begin_reset(), ResetInProgressError)
    assert_unchanged(busy, lambda: busy.reset(), ResetInProgressError)
    assert_unchanged(busy, lambda: busy.resume(6), ResetInProgressError)
    result = busy.finish_reset(resume=True, weight_version=6)
    assert not result.paused and result.weight_version == 6
    assert busy.state().invariant_holds()


def test_finish_reset_without_begin(busy):
    assert_unchanged(busy, lambda: busy.finish_reset(), ResetInProgressError)


def test_bad_reset_mode(busy):
    assert_unchanged(busy, lambda: busy.begin_reset(17), InvalidArgumentError)
