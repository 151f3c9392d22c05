"""Re-examining gate-refused groups: cheap for ordered gates, complete for any other gate."""
from __future__ import annotations

import pytest

from coda_server import SlidingWindowStrategy, TrajectoryStatus
from coda_server.core import NoWindowStrategy, Pacer, PromptRef, Trajectory, WindowedFifoStrategy, WindowGatedStrategy
from coda_server.core.strategy import ThreadSafeStrategy, gate_is_ordered


def submit_one(pacer, pid, status=TrajectoryStatus.COMPLETED):
    return pacer.submit([Trajectory(f"{pid}/t0", pid, 0, status)])


class CountingFifo(WindowedFifoStrategy):
    ordered_gate = True  # overriding will_collect drops the inherited promise; this one keeps the gate

    calls = 0

    def will_collect(self, group):
        CountingFifo.calls += 1
        return super().will_collect(group)


def test_builtins_promise_an_ordered_gate_custom_strategies_do_not_by_default():
    for cls in (NoWindowStrategy, WindowGatedStrategy, WindowedFifoStrategy, CountingFifo):
        assert gate_is_ordered(object.__new__(cls))

    class BaseGate(SlidingWindowStrategy):  # the base class is abstract: the least a strategy defines
        def compute_dispatch_count(self, buf_qsize):
            return 0

    assert not gate_is_ordered(object.__new__(BaseGate))

    class Overrides(WindowedFifoStrategy):
        def will_collect(self, group):
            return True

    class InheritsOverride(Overrides):
        pass

    assert not gate_is_ordered(object.__new__(Overrides))
    assert not gate_is_ordered(object.__new__(InheritsOverride))


def test_windowed_fifo_re_examination_follows_released_groups_not_held_ones(core_config):
    B = 50
    config = core_config("windowed-fifo", B=B, stale=1.0, N=1)  # C = 100
    pacer = Pacer(config, strategy=ThreadSafeStrategy(CountingFifo(config), "windowed-fifo"))
    pids = [f"p{i}" for i in range(2 * B)]
    pacer.dispatch([PromptRef(p) for p in pids])
    pacer.submit([Trajectory(f"{p}/t0", p) for p in pids[B:]])  # 50 groups outside the window: held
    assert pacer.state().buffered == 0
    CountingFifo.calls = 0
    for p in reversed(pids[1:B]):  # 49 in-window groups, never the head: each collected at once
        submit_one(pacer, p)
    assert pacer.state().buffered == B - 1
    # A full re-scan of the 50 held groups after each collection would ask >= 49 x 50 times.
    assert CountingFifo.calls <= 4 * (B - 1)
    CountingFifo.calls = 0
    submit_one(pacer, "p0")  # the head: everything held is released, oldest first
    st = pacer.state()
    assert (st.running, st.buffered) == (0, 2 * B)
    assert CountingFifo.calls <= 1 + B + 3


def test_aborted_groups_wait_for_reset_without_being_re_asked(core_config):
    config = core_config("windowed-fifo", B=4, stale=1.0, N=1)
    pacer = Pacer(config, strategy=ThreadSafeStrategy(CountingFifo(config), "windowed-fifo"))
    pids = [f"p{i}" for i in range(8)]
    pacer.dispatch([PromptRef(p) for p in pids])
    for p in pids[1:]:
        submit_one(pacer, p, TrajectoryStatus.ABORTED)
    CountingFifo.calls = 0
    submit_one(pacer, "p0")  # the head moves; aborted groups are not asked again
    assert CountingFifo.calls == 1
    st = pacer.state()
    assert (st.running, st.buffered) == (7, 1)
    assert [g.prompt_id for g in pacer.reset().restored] == pids[1:]


class AllowList(SlidingWindowStrategy):
    """A gate that is not ordered: a group may pass while older ones are still refused."""

    def __init__(self, config):
        super().__init__(config)
        self.allowed: set[str] = set()

    def compute_dispatch_count(self, buf_qsize):
        return max(0, 16 - self._running_count - buf_qsize)

    def on_dispatched(self, groups):
        super().on_dispatched(groups)
        self.allowed |= {g.prompt_id.removeprefix("allow-") for g in groups if g.prompt_id.startswith("allow-")}

    def will_collect(self, group):
        return next(iter(group.values())).prompt_id in self.allowed


class FifoWithAllowList(WindowedFifoStrategy):
    """Overrides a built-in's gate without repeating the promise: must get full re-examination."""

    def __init__(self, config):
        super().__init__(config)
        self.allowed: set[str] = set()

    def on_dispatched(self, groups):
        super().on_dispatched(groups)
        self.allowed |= {g.prompt_id.removeprefix("allow-") for g in groups if g.prompt_id.startswith("allow-")}

    def will_collect(self, group):
        return next(iter(group.values())).prompt_id in self.allowed


@pytest.mark.parametrize("cls", [AllowList, FifoWithAllowList])
def test_unordered_gate_is_re_asked_for_every_refused_group(core_config, cls):
    config = core_config("no-window", B=8, stale=1.0, N=1)
    pacer = Pacer(config, strategy=ThreadSafeStrategy(cls(config), "allow-list"))
    pacer.dispatch([PromptRef(p) for p in ("g0", "g1", "g2", "g3")])
    for p in ("g0", "g1", "g2", "g3"):
        submit_one(pacer, p)
    assert pacer.state().buffered == 0
    pacer.dispatch([PromptRef("allow-g2")])  # strategy state changed: g2 passes though g0, g1 are refused
    assert pacer.state().buffered == 1
    pacer.dispatch([PromptRef("allow-g3"), PromptRef("allow-g0")])
    assert [g.prompt_id for g in pacer.collect_now(3).groups] == ["g0", "g2", "g3"]
    assert pacer.state().running == 4  # g1 and the three allow-* groups


def test_on_dispatched_gets_loongsage_form_groups_unless_the_strategy_promises_to_read_only_ids(core_config):
    """The built-ins read only the ids: they get the in-flight groups themselves (no copy per admitted group);
    an override of on_dispatched that does not repeat the promise gets each group's N pending trajectories."""
    from coda_server.core.strategy import dispatched_ids_only

    for cls in (NoWindowStrategy, WindowGatedStrategy, WindowedFifoStrategy, CountingFifo):
        assert dispatched_ids_only(object.__new__(cls))

    class ReadsTrajectories(WindowedFifoStrategy):
        seen: list = []

        def on_dispatched(self, groups):
            ReadsTrajectories.seen.extend((g.prompt_id, len(g.trajectories)) for g in groups)
            super().on_dispatched(groups)

    assert not dispatched_ids_only(object.__new__(ReadsTrajectories))
    assert not dispatched_ids_only(object.__new__(type("Inherits", (ReadsTrajectories,), {})))
    config = core_config("windowed-fifo", B=8, stale=1.0, N=3)
    pacer = Pacer(config, strategy=ThreadSafeStrategy(ReadsTrajectories(config), "reads-trajectories"))
    pacer.dispatch([PromptRef("d0"), PromptRef("d1")])
    assert ReadsTrajectories.seen == [("d0", 3), ("d1", 3)]  # a group's N pending trajectories, not its received ones
