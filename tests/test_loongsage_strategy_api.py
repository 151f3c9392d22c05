"""The strategy author's API as LoongSage has it: abstract base, thread-safe proxy that is a strategy,
LoongSage's constructors, attribute names, status values and error types."""
from __future__ import annotations

import pytest
from omegaconf import OmegaConf

from coda_server.core import Pacer, PromptRef, Trajectory, TrajectoryGroup, TrajectoryStatus
from coda_server.core.strategy import (
    SLIDING_WINDOW_STRATEGY_REGISTRY,
    SlidingWindowStrategy,
    ThreadSafeStrategy,
    create_strategy,
    get_sliding_window_strategy,
    list_sliding_window_strategies,
    register_sliding_window_strategy,
)


class LoongSageStyle(SlidingWindowStrategy):
    """A strategy as LoongSage's users write one: its base built without the config; 8 groups at most."""

    def __init__(self, config):
        super().__init__()

    def compute_dispatch_count(self, buf_qsize):
        return 8 - self._running_count - buf_qsize


def loongsage_config(name="no-window", batch=4, stale=0.0):
    """The bare config LoongSage's own strategy tests build."""
    return OmegaConf.create({"data_sources": [{"num_prompts_per_step": batch}],
                             "fully_async": {"stale_steps": stale, "sliding_window": name}})


@pytest.mark.parametrize("name", ["no-window", "window-gated", "windowed-fifo"])
def test_create_strategy_returns_a_strategy_instance_the_proxy_included(name):
    strategy = create_strategy(loongsage_config(name))
    assert isinstance(strategy, ThreadSafeStrategy)
    assert isinstance(strategy, SlidingWindowStrategy)
    assert strategy.compute_dispatch_count(0) == 4


def test_base_class_is_abstract_and_registration_refuses_a_strategy_without_dispatch_count(scratch_registry):
    with pytest.raises(TypeError, match="abstract"):
        SlidingWindowStrategy()
    with pytest.raises(TypeError, match="'half-done'.*does not implement compute_dispatch_count"):
        @register_sliding_window_strategy("half-done")
        class HalfDone(SlidingWindowStrategy):
            def will_collect(self, group):
                return True
    assert "half-done" not in SLIDING_WINDOW_STRATEGY_REGISTRY


def test_loongsage_registry_names_work(scratch_registry):
    @register_sliding_window_strategy("everything")
    class Everything(SlidingWindowStrategy):
        def __init__(self, config):
            super().__init__()  # LoongSage's base takes no config
            self.capacity = int(config.data_sources[0].num_prompts_per_step)

        def compute_dispatch_count(self, buf_qsize):
            return self.capacity - self._running_count - buf_qsize

    assert "everything" in SLIDING_WINDOW_STRATEGY_REGISTRY
    assert get_sliding_window_strategy("everything") is Everything
    assert "everything" in list_sliding_window_strategies()
    strategy = create_strategy(loongsage_config("everything", batch=3))
    strategy.on_dispatched([TrajectoryGroup(prompt_id="p0", trajectories=[])])
    assert strategy.compute_dispatch_count(0) == 2


def test_unknown_strategy_is_a_value_error_in_loongsages_words():
    with pytest.raises(ValueError, match="Unknown sliding_window strategy 'nonexistent'"):
        create_strategy(loongsage_config("nonexistent"))


def test_windowed_fifo_unknown_prompt_is_a_runtime_error_and_still_a_key_error():
    strategy = create_strategy(loongsage_config("windowed-fifo"))
    group = {"ghost/t0": Trajectory("ghost/t0", "ghost")}
    with pytest.raises(RuntimeError, match="not in window mapping"):
        strategy.will_collect(group)
    with pytest.raises(KeyError):
        strategy.will_collect(group)


def test_trajectory_group_and_trajectory_construct_as_in_loongsage():
    group = TrajectoryGroup(prompt_id="p0", trajectories=[Trajectory(trajectory_id="p0_t0", prompt_id="p0",
                                                                     status=TrajectoryStatus.FAILED)])
    assert (group.prompt_id, group.seq, group.ds_index, len(group.trajectories)) == ("p0", 0, 0, 1)
    assert TrajectoryGroup(prompt_id="p1").trajectories == []


def test_trajectory_status_accepts_loongsages_values():
    assert TrajectoryStatus("completed") is TrajectoryStatus.COMPLETED
    assert TrajectoryStatus("failed") is TrajectoryStatus.FAILED
    assert TrajectoryStatus("ABORTED") is TrajectoryStatus.ABORTED
    assert TrajectoryStatus(2) is TrajectoryStatus.FAILED  # the wire numbers still work
    with pytest.raises(ValueError, match="not a final status"):
        TrajectoryStatus("pending")
    with pytest.raises(ValueError):
        TrajectoryStatus("unspecified")


def test_a_status_compares_equal_to_loongsages_string_value_as_its_str_enum_does():
    aborted = TrajectoryStatus.ABORTED
    assert aborted == "aborted" and "aborted" == aborted and aborted in ("completed", "aborted")
    assert not aborted != "aborted" and aborted != "completed" and aborted != "ABORTED"
    assert aborted == 3 and aborted == TrajectoryStatus.ABORTED and aborted != TrajectoryStatus.FAILED
    assert {aborted: "held"}[3] == "held"  # hashing stays the wire number's


def test_a_loongsage_gate_testing_status_strings_holds_a_group_with_an_aborted_trajectory(core_config):
    """LoongSage's statuses are strings: its users' gates test `t.status == "aborted"`. Such a gate must hold the
    group here too, not pass aborted work to the trainer without a word."""
    class CompleteOnly(LoongSageStyle):
        def will_collect(self, group):
            return not any(t.status == "aborted" for t in group.values())

    config = core_config("no-window", N=2)
    pacer = Pacer(config, strategy=ThreadSafeStrategy(CompleteOnly(config), "complete-only"))
    pacer.dispatch([PromptRef("p0"), PromptRef("p1")])
    pacer.submit([Trajectory("p0/t0", "p0", status=TrajectoryStatus.COMPLETED),
                  Trajectory("p0/t1", "p0", status=TrajectoryStatus.ABORTED),
                  Trajectory("p1/t0", "p1"), Trajectory("p1/t1", "p1")])
    assert [group.prompt_id for group in pacer.collect(2, allow_partial=True).groups] == ["p1"]
    state = pacer.state()
    assert (state.running, state.buffered) == (1, 0)  # p0 held back by the gate, not buffered
    pacer.close()


@pytest.mark.parametrize("failed", [TrajectoryStatus.FAILED, 2, "failed"])
def test_a_status_given_in_process_as_a_number_or_loongsages_string_is_a_status_to_the_filters(core_config, failed):
    pacer = Pacer(core_config("no-window", N=2))  # the `status` filter drops a group holding a FAILED trajectory
    pacer.dispatch([PromptRef("p0")])
    failing = Trajectory("p0/t1", "p0", status=failed)
    pacer.submit([Trajectory("p0/t0", "p0"), failing])
    assert failing.status is TrajectoryStatus.FAILED
    assert (pacer.state().filtered, pacer.state().buffered) == (1, 0)
    pacer.close()


def test_trajectories_expose_loongsages_attribute_names():
    t = Trajectory("p0_t0", "p0", start_weight_version=3, end_weight_version=5, metadata={"k": "v"}, num_tokens=7)
    assert (t.start_rollout_weight_version, t.end_rollout_weight_version) == (3, 5)
    assert t.metadata == {"k": "v"} and t.num_tokens == 7
    assert not t.same_content(Trajectory("p0_t0", "p0", start_weight_version=3, end_weight_version=5,
                                         metadata={"k": "other"}, num_tokens=7))


def test_will_collect_sees_loongsage_names_in_a_running_pacer(core_config):
    seen = []

    class Recording(LoongSageStyle):
        def will_collect(self, group):
            seen.extend((t.trajectory_id, t.prompt_id, t.status, t.reward, t.start_rollout_weight_version,
                         t.end_rollout_weight_version, dict(t.metadata)) for t in group.values())
            return super().will_collect(group)

    config = core_config("no-window", N=1)
    pacer = Pacer(config, strategy=ThreadSafeStrategy(Recording(config), "recording"))
    pacer.dispatch([PromptRef("p0")])
    pacer.submit([Trajectory("p0/t0", "p0", reward=1.0, start_weight_version=0, end_weight_version=1,
                             metadata={"turns": "2"})])
    assert seen == [("p0/t0", "p0", TrajectoryStatus.COMPLETED, 1.0, 0, 1, {"turns": "2"})]
    pacer.close()
