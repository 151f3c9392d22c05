"""Group filters: status and reward, dropped groups still leave the trajectory queue and are counted."""
from __future__ import annotations

import uuid

import pytest

from coda_server import GroupFilter, TrajectoryStatus, register_group_filter
from coda_server.core import ConfigError, NoWindowStrategy, Pacer, PromptRef, Trajectory, WindowedFifoStrategy
from coda_server.core.filters import FILTERS, RewardFilter, StatusFilter, create_filters
from coda_server.core.strategy import ThreadSafeStrategy

# Strategies and filters registered here must not leak into other tests' registries.
pytestmark = pytest.mark.usefixtures("scratch_registry")

OK, FAILED, ABORTED = TrajectoryStatus.COMPLETED, TrajectoryStatus.FAILED, TrajectoryStatus.ABORTED


def traj(pid, i, status=OK, reward=None):
    return Trajectory(f"{pid}/t{i}", pid, 0, status, reward=float(i) if reward is None else reward)


def recording(base):
    class Recording(base):
        def __init__(self, config):
            super().__init__(config)
            self.collected: list[str] = []

        def on_collected(self, prompt_id):
            super().on_collected(prompt_id)
            self.collected.append(prompt_id)

    return Recording


def make(core_config, filters, base=NoWindowStrategy, name="no-window", **kwargs):
    config = core_config(name, B=2, stale=1.0, N=2, filters=filters, **kwargs)
    strategy = ThreadSafeStrategy(recording(base)(config), name)
    return Pacer(config, strategy=strategy), strategy.wrapped


def test_status_filter_drops_groups_with_a_failed_trajectory(core_config):
    pacer, rec = make(core_config, "[status]")
    pacer.dispatch([PromptRef("bad"), PromptRef("good")])
    pacer.submit([traj("bad", 0), traj("bad", 1, FAILED)])
    st = pacer.state()
    assert rec.collected == ["bad"]  # on_collected ran for the dropped group
    assert (st.running, st.buffered, st.filtered, st.collected, st.queued_trajectories) == (1, 0, 1, 0, 0)
    assert rec._running_count == 1
    assert st.capacity == 3  # C - R - Q = 4 - 1 - 0: the slot is free again
    pacer.submit([traj("good", 0), traj("good", 1)])
    st = pacer.state()
    assert rec.collected == ["bad", "good"]
    assert (st.running, st.buffered, st.filtered, st.collected) == (0, 1, 1, 1)
    assert [g.prompt_id for g in pacer.collect_now(1).groups] == ["good"]
    assert st.invariant_holds()
    report = pacer.reset(resume=True).report
    assert report.filter_drop == 1


def test_reward_filter_drops_groups_whose_rewards_are_all_equal(core_config):
    pacer, rec = make(core_config, "[status,reward]")
    pacer.dispatch([PromptRef("flat"), PromptRef("varied")])
    pacer.submit([traj("flat", 0, reward=1.0), traj("flat", 1, reward=1.0)])
    pacer.submit([traj("varied", 0, reward=0.0), traj("varied", 1, reward=1.0)])
    st = pacer.state()
    assert rec.collected == ["flat", "varied"]
    assert (st.running, st.buffered, st.filtered, st.collected) == (0, 1, 1, 1)
    assert [g.prompt_id for g in pacer.collect_now(1).groups] == ["varied"]
    assert st.invariant_holds()


def test_without_filters_flat_groups_are_kept_and_failed_ones_trained_on_only_when_asked(core_config):
    pacer, rec = make(core_config, "[]", extra=("rollout.train_on_failed=true",))
    pacer.dispatch([PromptRef("a"), PromptRef("b")])
    pacer.submit([traj("a", 0, FAILED, reward=0.0), traj("a", 1, reward=0.0)])
    pacer.submit([traj("b", 0, reward=0.0), traj("b", 1, reward=0.0)])
    st = pacer.state()
    assert (st.buffered, st.filtered, st.quarantined) == (2, 0, 0)


def test_reward_filter_alone_lets_failed_groups_through_to_the_dirty_data_check(core_config):
    pacer, _ = make(core_config, "[reward]")
    pacer.dispatch([PromptRef("a")])
    pacer.submit([traj("a", 0, FAILED, reward=0.0), traj("a", 1, reward=1.0)])
    st = pacer.state()
    assert (st.buffered, st.quarantined) == (0, 1)  # not trained on: see test_loongsage_runtime.py
    assert st.invariant_holds()


def test_aborted_group_never_reaches_the_filters(core_config):
    pacer, rec = make(core_config, "[status]")
    pacer.dispatch([PromptRef("a")])
    pacer.submit([traj("a", 0, FAILED), traj("a", 1, ABORTED)])
    st = pacer.state()
    assert rec.collected == [] and (st.running, st.filtered) == (1, 0)
    assert [g.prompt_id for g in pacer.reset().restored] == ["a"]


def test_dropped_head_group_moves_the_windowed_fifo_window(core_config):
    pacer, rec = make(core_config, "[status]", base=WindowedFifoStrategy, name="windowed-fifo")
    pacer.dispatch([PromptRef(p) for p in ("p0", "p1", "p2", "p3")])  # C = 4, window B = 2
    pacer.submit([traj("p2", 0), traj("p2", 1)])  # held: 2 - 0 >= 2
    pacer.submit([traj("p3", 0), traj("p3", 1)])  # held
    assert pacer.state().buffered == 0
    pacer.submit([traj("p0", 0, FAILED), traj("p0", 1)])  # head dropped by the filter: min -> 1
    st = pacer.state()
    assert rec.collected == ["p0", "p2"]  # p2: 2 - 1 < 2 released; p3: 3 - 1 still held
    assert (st.running, st.buffered, st.filtered) == (2, 1, 1)


def test_filter_objects_directly():
    failed = {"a": traj("x", 0), "b": traj("x", 1, FAILED)}
    fine = {"a": traj("x", 0), "b": traj("x", 1)}
    assert StatusFilter().keep(failed) is False and StatusFilter().keep(fine) is True
    flat = {"a": traj("x", 0, reward=0.5), "b": traj("x", 1, reward=0.5)}
    assert RewardFilter().keep(flat) is False and RewardFilter().keep(fine) is True
    single = {"a": traj("x", 0, reward=0.5)}
    assert RewardFilter().keep(single) is False  # one trajectory: no spread, no advantage


def test_unknown_filter_name_is_a_config_error_listing_known_ones():
    with pytest.raises(ConfigError) as info:
        create_filters(["status", "nope"])
    for name in FILTERS.names():
        assert name in str(info.value)


def test_custom_filter_registers_and_runs(core_config):
    name = f"short-{uuid.uuid4().hex[:8]}"

    @register_group_filter(name)
    class DropOdd(GroupFilter):
        def keep(self, group):
            return not next(iter(group.values())).prompt_id.endswith("1")

    config = core_config("no-window", B=2, stale=1.0, N=1, filters=f"[{name}]")
    pacer = Pacer(config)
    pacer.dispatch([PromptRef("p0"), PromptRef("p1")])
    pacer.submit([traj("p0", 0), traj("p1", 0)])
    st = pacer.state()
    assert (st.buffered, st.filtered) == (1, 1)
