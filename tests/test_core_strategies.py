"""Built-in strategies and the seed example (fixed-capacity): dispatch, collection, reset, unknown prompt.

Thread safety lives in test_core_threads.py, random sequences in test_core_properties.py.
"""
from __future__ import annotations

from types import SimpleNamespace

import pytest
from omegaconf import OmegaConf

from coda_server import SlidingWindowStrategy, TrajectoryStatus, create_strategy
from coda_server.core import (
    LatencyAwareStrategy,
    NoWindowStrategy,
    PromptRef,
    StaleGenerationError,
    Trajectory,
    UnknownPromptError,
    WindowedFifoStrategy,
    WindowGatedStrategy,
)
from coda_server.core.strategy import STRATEGIES, ThreadSafeStrategy

BUILTINS = ["no-window", "window-gated", "windowed-fifo"]
ALL = BUILTINS + ["fixed-capacity"]

OK, FAILED, ABORTED = TrajectoryStatus.COMPLETED, TrajectoryStatus.FAILED, TrajectoryStatus.ABORTED


def traj(pid: str, i: int, status=OK, reward: float | None = None, ds: int = 0) -> Trajectory:
    return Trajectory(f"{pid}/t{i}", pid, ds, status, reward=float(i) if reward is None else reward)


def finish(pacer, pid: str, n: int, statuses=None, start: int = 0):
    """Submit trajectories start..n-1 of `pid` (statuses default COMPLETED)."""
    statuses = statuses or [OK] * n
    return pacer.submit([traj(pid, i, statuses[i]) for i in range(start, n)])


def dispatch(pacer, *pids: str, ds: int = 0):
    return pacer.dispatch([PromptRef(p, ds) for p in pids])


def admitted(result) -> list[str]:
    return [a.prompt_id for a in result.admitted]


def bare_config(strategy: str, B: int = 4, stale: float = 1.0):
    return OmegaConf.create({"data_sources": [{"num_prompts_per_step": B}],
                             "fully_async": {"stale_steps": stale, "sliding_window": strategy}})


def capacity(strategy: str, B: int, stale: float) -> int:
    return B if strategy == "fixed-capacity" else int(B * (1 + stale))


@pytest.fixture(autouse=True)
def _fixed_capacity_registered(core_config):
    """fixed-capacity lives in examples/strategies; loading a config that names it imports it."""
    core_config("fixed-capacity")
    assert "fixed-capacity" in STRATEGIES


# ----------------------------------------------------------------------------- construction


def test_create_strategy_from_a_bare_omegaconf():
    s = create_strategy(OmegaConf.create({"data_sources": [{"num_prompts_per_step": 4}],
                                          "fully_async": {"stale_steps": 1.0, "sliding_window": "no-window"}}))
    assert isinstance(s, ThreadSafeStrategy)
    assert s.name == "no-window"
    assert isinstance(s.wrapped, NoWindowStrategy)
    assert s.compute_dispatch_count(0) == 8
    assert s.compute_dispatch_count(3) == 5
    assert s.compute_dispatch_count(20) == 0


@pytest.mark.parametrize("name,cls", [("no-window", NoWindowStrategy), ("window-gated", WindowGatedStrategy),
                                      ("windowed-fifo", WindowedFifoStrategy), ("latency-aware", LatencyAwareStrategy)])
def test_create_strategy_builds_each_builtin_by_name(name, cls):
    s = create_strategy(bare_config(name))
    assert s.name == name and type(s.wrapped) is cls
    assert isinstance(s.wrapped, SlidingWindowStrategy)
    # The name argument wins over the config.
    assert type(create_strategy(bare_config("no-window"), name=name).wrapped) is cls


def test_create_strategy_defaults_to_no_window_and_accepts_plain_objects():
    cfg = OmegaConf.create({"data_sources": [{"num_prompts_per_step": 3}], "fully_async": {"stale_steps": 0.0}})
    assert create_strategy(cfg).name == "no-window"
    # Any object with attribute access works when the name is given (no `.get` needed).
    plain = SimpleNamespace(data_sources=[SimpleNamespace(num_prompts_per_step=3)],
                            fully_async=SimpleNamespace(stale_steps=2.0))
    assert create_strategy(plain, name="windowed-fifo").compute_dispatch_count(0) == 9


@pytest.mark.parametrize("strategy", ALL)
@pytest.mark.parametrize("stale,expected_c", [(0.0, 4), (0.5, 6), (1.0, 8), (1.3, 9), (2.0, 12)])
def test_first_dispatch_admits_capacity(core_pacer, strategy, stale, expected_c):
    pacer = core_pacer(strategy, B=4, stale=stale)
    c = 4 if strategy == "fixed-capacity" else expected_c
    assert pacer.state().capacity == c
    result = dispatch(pacer, *[f"p{i}" for i in range(20)])
    assert admitted(result) == [f"p{i}" for i in range(c)]
    assert [a.seq for a in result.admitted] == list(range(c))
    assert result.running == c and result.remaining == 0 and result.capacity == int(4 * (1 + stale))
    assert pacer.state().running == c
    # Fewer candidates than slots: all admitted, the rest stays open.
    pacer2 = core_pacer(strategy, B=4, stale=stale)
    assert admitted(dispatch(pacer2, "a", "b")) == ["a", "b"]
    assert pacer2.state().capacity == c - 2


# ----------------------------------------------------------------------------- dispatch formulas


@pytest.mark.parametrize("strategy", ["no-window", "windowed-fifo", "fixed-capacity"])
def test_dispatch_count_is_capacity_minus_running_minus_buffered(core_pacer, strategy):
    pacer = core_pacer(strategy, B=4, stale=1.0, N=2)
    c = capacity(strategy, 4, 1.0)
    dispatch(pacer, *[f"p{i}" for i in range(c)])
    assert pacer.state().capacity == 0
    finish(pacer, "p0", 2)
    finish(pacer, "p1", 2)
    st = pacer.state()
    assert (st.running, st.buffered, st.capacity) == (c - 2, 2, 0)  # R + Q = C: nothing to admit
    assert admitted(dispatch(pacer, "x")) == []
    got = pacer.collect_now(1)
    assert [g.prompt_id for g in got.groups] == ["p0"]
    assert pacer.state().capacity == 1  # C - (C-2) - 1
    assert admitted(dispatch(pacer, "n1", "n2", "n3")) == ["n1"]
    pacer.collect_now(1)
    st = pacer.state()
    assert (st.running, st.buffered, st.capacity) == (c - 1, 0, 1)


def test_strategy_objects_follow_their_formulas_directly():
    nw = create_strategy(bare_config("no-window", B=4, stale=1.0))
    gated = create_strategy(bare_config("window-gated", B=4, stale=1.0))
    fifo = create_strategy(bare_config("windowed-fifo", B=4, stale=1.0))
    groups = [SimpleNamespace(prompt_id=f"p{i}", seq=i) for i in range(6)]
    for s in (nw, gated, fifo):
        s.on_dispatched(groups)
        assert s.running_count == 6
        assert s.compute_dispatch_count(0) == 2
    assert nw.compute_dispatch_count(5) == 0  # max(0, 8 - 6 - 5)
    assert fifo.compute_dispatch_count(5) == 0
    assert gated.compute_dispatch_count(5) == -3  # the doc's min(...) has no clamp; the Pacer clamps to 0
    # Collect p1..p5 (not the head p0): R=1.
    for s in (nw, gated, fifo):
        for i in range(1, 6):
            s.on_collected(f"p{i}")
        assert s.running_count == 1
    assert nw.compute_dispatch_count(0) == 7
    assert fifo.compute_dispatch_count(0) == 7
    # window-gated: min_seq=0, next_seq=6 -> 0 + 8 - 6 = 2 though 7 slots are free.
    assert gated.compute_dispatch_count(0) == 2
    gated.on_collected("p0")  # head collected: min_seq = next_seq = 6
    assert gated.compute_dispatch_count(0) == 8
    assert gated.compute_dispatch_count(3) == 5


def test_window_gated_one_slow_head_group_stops_dispatch_although_later_groups_finished(core_pacer):
    pacer = core_pacer("window-gated", B=2, stale=1.0, N=2)  # C = 4
    dispatch(pacer, "p0", "p1", "p2", "p3")
    for pid in ("p1", "p2", "p3"):
        finish(pacer, pid, 2)
    assert pacer.state().buffered == 3
    assert [g.prompt_id for g in pacer.collect_now(3).groups] == ["p1", "p2", "p3"]
    st = pacer.state()
    assert (st.running, st.buffered) == (1, 0)
    # C - R - Q = 3 free slots, but min_seq 0 + C 4 - next_seq 4 = 0.
    assert st.capacity == 0
    assert admitted(dispatch(pacer, "n0", "n1", "n2")) == []
    # A half-finished head still blocks.
    finish(pacer, "p0", 1)
    assert admitted(dispatch(pacer, "n0")) == []
    # The head arrives: the window slides to next_seq and R + Q bounds again.
    finish(pacer, "p0", 2, start=1)
    st = pacer.state()
    assert (st.running, st.buffered, st.capacity) == (0, 1, 3)
    assert admitted(dispatch(pacer, "n0", "n1", "n2", "n3")) == ["n0", "n1", "n2"]


def test_no_window_does_not_stop_on_a_slow_head_group(core_pacer):
    """The contrast case to window-gated: same history, three groups admitted."""
    pacer = core_pacer("no-window", B=2, stale=1.0, N=2)
    dispatch(pacer, "p0", "p1", "p2", "p3")
    for pid in ("p1", "p2", "p3"):
        finish(pacer, pid, 2)
    pacer.collect_now(3)
    assert admitted(dispatch(pacer, "n0", "n1", "n2", "n3")) == ["n0", "n1", "n2"]


def test_window_gated_head_span_after_partial_collection(core_pacer):
    pacer = core_pacer("window-gated", B=2, stale=1.0, N=1)  # C = 4
    dispatch(pacer, "p0", "p1", "p2", "p3")
    finish(pacer, "p0", 1)  # head collected: min_seq -> 1
    pacer.collect_now(1)
    assert pacer.state().capacity == 1  # min(1 + 4 - 4, 4 - 3 - 0)
    assert admitted(dispatch(pacer, "a", "b")) == ["a"]
    finish(pacer, "p2", 1)  # not the head: no span change
    pacer.collect_now(1)
    assert pacer.state().capacity == 0  # min(1 + 4 - 5, 4 - 3 - 0)


# ----------------------------------------------------------------------------- collection gate


def test_windowed_fifo_holds_groups_outside_the_window_and_releases_them_as_the_head_moves(core_pacer):
    pacer = core_pacer("windowed-fifo", B=2, stale=1.0, N=2)  # C = 4, window B = 2
    dispatch(pacer, "p0", "p1", "p2", "p3")
    finish(pacer, "p3", 2)  # seq 3 - min 0 >= 2: held
    finish(pacer, "p2", 2)  # seq 2 - min 0 >= 2: held
    st = pacer.state()
    assert (st.running, st.buffered, st.queued_trajectories, st.collected) == (4, 0, 4, 0)
    assert st.capacity == 0  # held groups still count in R
    finish(pacer, "p1", 2)  # seq 1 - 0 < 2: collected; p2, p3 still held (min still 0)
    st = pacer.state()
    assert (st.running, st.buffered, st.queued_trajectories) == (3, 1, 4)
    assert pacer.collect_now(2).groups == []  # no partial mini-batch
    finish(pacer, "p0", 2)  # head moves: p0 collected, then p2 (2-2<2), then p3
    st = pacer.state()
    assert (st.running, st.buffered, st.queued_trajectories, st.collected) == (0, 4, 0, 4)
    assert [g.prompt_id for g in pacer.collect_now(4).groups] == ["p0", "p1", "p2", "p3"]
    assert st.invariant_holds()


def test_windowed_fifo_release_is_partial_when_the_new_head_is_still_running(core_pacer):
    pacer = core_pacer("windowed-fifo", B=2, stale=2.0, N=1)  # C = 6
    dispatch(pacer, *[f"p{i}" for i in range(6)])
    for pid in ("p5", "p4", "p3"):
        finish(pacer, pid, 1)
    assert pacer.state().buffered == 0
    finish(pacer, "p0", 1)  # min -> 1: p3 - 1 = 2, still held
    assert pacer.state().buffered == 1
    finish(pacer, "p1", 1)  # min -> 2: p3 (1 < 2) released; p4 (2) held
    st = pacer.state()
    assert (st.running, st.buffered) == (3, 3)
    finish(pacer, "p2", 1)  # min -> next_seq: everything out
    assert pacer.state().buffered == 6 and pacer.state().running == 0


@pytest.mark.parametrize("strategy", BUILTINS)
def test_complete_group_outside_window_is_still_counted_in_running_for_dispatch(core_pacer, strategy):
    pacer = core_pacer(strategy, B=2, stale=1.0, N=1)
    dispatch(pacer, "p0", "p1", "p2", "p3")
    finish(pacer, "p3", 1)
    st = pacer.state()
    if strategy == "windowed-fifo":  # gated: stays in the trajectory queue, counts in R
        assert (st.running, st.buffered, st.queued_trajectories, st.capacity) == (4, 0, 1, 0)
        return
    assert (st.running, st.buffered, st.capacity) == (3, 1, 0)
    assert len(pacer.collect_now(1).groups) == 1
    # no-window: C - R - Q = 1; window-gated: min(0 + 4 - 4, 1) = 0 (the head p0 is still running).
    assert pacer.state().capacity == {"no-window": 1, "window-gated": 0}[strategy]


@pytest.mark.parametrize("strategy", ALL)
def test_aborted_group_is_refused_and_stays_running(core_pacer, strategy):
    pacer = core_pacer(strategy, B=2, stale=1.0, N=2)
    dispatch(pacer, "p0", "p1")
    finish(pacer, "p1", 2, [OK, ABORTED])
    st = pacer.state()
    assert (st.running, st.buffered, st.collected, st.filtered, st.queued_trajectories) == (2, 0, 0, 0, 2)
    finish(pacer, "p0", 2)  # the head moving does not release an aborted group either
    st = pacer.state()
    assert (st.running, st.buffered, st.queued_trajectories) == (1, 1, 2)
    assert [g.prompt_id for g in pacer.collect_now(1).groups] == ["p0"]
    assert pacer.collect_now(1).groups == []


@pytest.mark.parametrize("strategy", ALL)
def test_will_collect_default_gate(strategy):
    s = create_strategy(bare_config(strategy, B=2))
    s.on_dispatched([SimpleNamespace(prompt_id="p0", seq=0)])
    good = {"p0/t0": traj("p0", 0), "p0/t1": traj("p0", 1, FAILED)}
    bad = {"p0/t0": traj("p0", 0), "p0/t1": traj("p0", 1, ABORTED)}
    assert s.will_collect(good) is True  # FAILED is the filter's business, not the gate's
    assert s.will_collect(bad) is False


def test_buffer_serves_epoch_index_priority_before_seq(core_pacer):
    pacer = core_pacer("no-window", B=4, stale=1.0, N=1)
    pacer.dispatch([PromptRef("late", 0, epoch=1, index=0), PromptRef("early", 0, epoch=0, index=5),
                    PromptRef("plain", 0), PromptRef("earliest", 0, epoch=0, index=1)])
    for pid in ("late", "early", "plain", "earliest"):
        finish(pacer, pid, 1)
    assert [g.prompt_id for g in pacer.collect_now(4).groups] == ["earliest", "early", "late", "plain"]


# ----------------------------------------------------------------------------- unknown prompt


@pytest.mark.parametrize("strategy", ALL)
def test_submit_for_unknown_prompt_raises_and_changes_nothing(core_pacer, strategy):
    pacer = core_pacer(strategy, B=2, stale=1.0, N=2)
    dispatch(pacer, "p0")
    finish(pacer, "p0", 1)
    before = pacer.state()
    with pytest.raises(UnknownPromptError):
        pacer.submit([traj("ghost", 0)])
    with pytest.raises(UnknownPromptError):  # all-or-nothing: the good trajectory is not taken either
        pacer.submit([traj("p0", 1), traj("ghost", 0)])
    assert pacer.state() == before


def test_windowed_fifo_strategy_refuses_unknown_prompt_with_keyerror_and_changes_nothing():
    s = create_strategy(bare_config("windowed-fifo", B=2, stale=1.0))
    s.on_dispatched([SimpleNamespace(prompt_id="p0", seq=0), SimpleNamespace(prompt_id="p1", seq=1)])
    inner = s.wrapped

    def snapshot():
        return (inner._running_count, dict(inner._seqs._seq_of), inner._seqs.next_seq, inner._seqs.min_seq(),
                s.compute_dispatch_count(0))

    before = snapshot()
    with pytest.raises(KeyError):
        s.will_collect({"ghost/t0": traj("ghost", 0)})
    assert snapshot() == before
    with pytest.raises(KeyError):
        s.on_collected("ghost")
    assert snapshot() == before
    # Aborted groups are refused before the lookup: no error, just False.
    assert s.will_collect({"ghost/t0": traj("ghost", 0, ABORTED)}) is False
    # A known prompt still works afterwards.
    assert s.will_collect({"p1/t0": traj("p1", 0)}) is True
    s.on_collected("p1")
    assert s.running_count == 1
    # Collected once, it is unknown again.
    with pytest.raises(KeyError):
        s.on_collected("p1")
    assert s.running_count == 1


# ----------------------------------------------------------------------------- reset


@pytest.mark.parametrize("strategy", ALL)
def test_reset_restores_complete_drops_incomplete_keeps_buffer(core_pacer, strategy):
    pacer = core_pacer(strategy, B=3, stale=1.0, N=2)
    c = capacity(strategy, 3, 1.0)
    pids = [f"p{i}" for i in range(c)]
    dispatch(pacer, *pids)
    finish(pacer, "p0", 2)  # collected into the buffer
    finish(pacer, "p1", 2, [ABORTED, OK])  # complete but refused by the gate
    finish(pacer, "p2", 1)  # incomplete
    # p2 never completes; for windowed-fifo a complete later group would also be gated:
    gated = None
    if strategy == "windowed-fifo":
        gated = pids[-1]  # seq c-1 - min 1 >= B=3 -> held
        finish(pacer, gated, 2)
        assert pacer.state().buffered == 1
    before = pacer.state()
    result = pacer.reset(resume=True, weight_version=7)

    restored = [g.prompt_id for g in result.restored]
    assert restored == ["p1"] + ([gated] if gated else [])
    assert all(len(g.trajectories) == 2 for g in result.restored)
    assert {t.status for t in result.restored[0].trajectories} == {ABORTED, OK}
    expected_dropped = [p for p in pids[2:] if p != gated]
    assert result.dropped_prompt_ids == expected_dropped
    assert (result.generation, result.step, result.weight_version, result.paused) == (1, 1, 7, False)
    # In trajectories, as LoongSage counts them (p2 submitted one of its two before it was dropped) ...
    assert result.report.partial_restored_count == 2 * len(restored)
    assert result.report.partial_dropped_incomplete_count == 1
    # ... and in groups.
    assert result.report.partial_restored_group_count == len(restored)
    assert result.report.partial_dropped_incomplete_group_count == len(expected_dropped)

    st = pacer.state()
    assert (st.running, st.buffered, st.queued_trajectories, st.generation) == (0, 1, 0, before.generation + 1)
    assert st.restored == len(restored) and st.dropped == len(expected_dropped)
    assert st.invariant_holds()
    assert pacer.strategy.running_count == 0
    # The window is back to C - Q (Q = the kept p0).
    assert st.capacity == c - 1

    # Stale-generation refusal for every prompt of the old generation, complete or not.
    for pid in ("p2", "p1"):
        with pytest.raises(StaleGenerationError):
            pacer.submit([traj(pid, 5)])
    assert pacer.state().stale_rejected == 2
    # The kept buffer is served after the reset.
    assert [g.prompt_id for g in pacer.collect_now(1).groups] == ["p0"]
    # A restored prompt may be dispatched again in the new generation and takes trajectories again.
    assert admitted(dispatch(pacer, "p1")) == ["p1"]
    assert finish(pacer, "p1", 2).groups_completed == 1
    assert pacer.state().invariant_holds()


@pytest.mark.parametrize("strategy", ALL)
def test_reset_without_resume_stays_paused_until_resume(core_pacer, strategy):
    pacer = core_pacer(strategy, B=2, stale=1.0, N=1)
    dispatch(pacer, "p0")
    result = pacer.reset()
    assert result.paused and result.dropped_prompt_ids == ["p0"] and result.step == 0
    paused = dispatch(pacer, "a")
    assert paused.paused and admitted(paused) == []
    assert pacer.state().capacity == 0
    assert pacer.resume(3).step == 1
    resumed = dispatch(pacer, "a")
    assert not resumed.paused and admitted(resumed) == ["a"]
    assert resumed.weight_version == 3 and resumed.generation == 1


def test_window_gated_and_fifo_windows_restart_after_reset(core_pacer):
    for strategy in ("window-gated", "windowed-fifo"):
        pacer = core_pacer(strategy, B=2, stale=1.0, N=1)
        dispatch(pacer, "p0", "p1", "p2", "p3")
        finish(pacer, "p3", 1)  # gated or buffered, p0 head never finishes
        pacer.reset(resume=True, weight_version=1)
        st = pacer.state()
        assert st.running == 0
        assert st.capacity == 4 - st.buffered
        got = admitted(dispatch(pacer, "a", "b", "c", "d"))
        assert len(got) == 4 - st.buffered
        # The new generation's head behaves as a head.
        finish(pacer, got[-1], 1)
        if strategy == "windowed-fifo" and len(got) > 2:
            assert pacer.state().buffered == st.buffered  # outside the window of the new head


def test_inflight_seqs_oldest_matches_a_plain_minimum_through_compaction_redispatch_and_clear():
    import random

    from coda_server.core.builtin_strategies import InflightSeqs

    seqs, expected = InflightSeqs(), {}  # expected: prompt id -> seq, recomputed by hand
    seqs.COMPACT_AFTER = 16  # cut the front often
    compacted = False
    rng = random.Random(7)
    serial = 0
    for round_ in range(40):
        new = [f"p{serial + i}" for i in range(rng.randint(1, 120))]
        serial += len(new)
        if expected and rng.random() < 0.3:  # a collected prompt dispatched again gets a later seq
            gone = [p for p in (f"p{i}" for i in range(serial)) if p not in expected and p not in new]
            new += gone[:2]
        for prompt_id in new:
            expected[prompt_id] = seqs.next_seq + new.index(prompt_id)
        seqs.add_all(new)
        for prompt_id in rng.sample(sorted(expected), k=len(expected) * 2 // 3):
            seqs.remove(prompt_id)
            del expected[prompt_id]
            assert seqs.min_seq() == min(expected.values(), default=seqs.next_seq)
            assert seqs._head < 16 or 2 * seqs._head < len(seqs._order)  # a long skipped front is cut off
            compacted = compacted or seqs._first_seq > 0
        if round_ == 30:
            assert compacted
            seqs.clear()
            expected.clear()
            assert seqs.min_seq() == seqs.next_seq
    assert {p: seqs.seq_of(p) for p in expected} == expected
