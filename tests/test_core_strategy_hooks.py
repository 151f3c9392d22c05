"""The optional strategy hooks: the pacer's clock, on_submitted (with token counts), on_consumed, on_resume and the
buffer view; and the built-in latency-aware strategy that uses them. In process, then over gRPC."""
from __future__ import annotations

import pytest
from omegaconf import OmegaConf

from coda_client import PacerClient
from coda_client import Trajectory as WireTrajectory
from coda_client import TrajectoryStatus as WireStatus
from coda_server.core import (LatencyAwareStrategy, Pacer, PromptRef, ResetMode, SlidingWindowStrategy, Trajectory,
                              TrajectoryStatus, create_strategy, load_config, register_sliding_window_strategy)
from coda_server.core.errors import StrategyHookError
from fake_clock import FakeClock
from server_harness import ServerProcess

pytestmark = pytest.mark.usefixtures("scratch_registry")

BASE = ["data_source.num_prompts_per_step=2", "data_source.num_trajectories_per_prompt=2",
        "trainer.mini_batch_size=2", "fully_async.stale_steps=1.0"]


class Recorder(SlidingWindowStrategy):
    """Admits C - R - Q and writes down every optional hook call, with the clock and the buffer seen then."""

    def __init__(self, config):
        super().__init__(config)
        self.calls: list[tuple] = []

    def compute_dispatch_count(self, buf_qsize: int) -> int:
        return max(0, 4 - self._running_count - buf_qsize)

    def on_submitted(self, trajectory) -> None:
        self.calls.append(("submitted", trajectory.trajectory_id, trajectory.num_tokens, self.now()))

    def on_consumed(self, groups) -> None:
        self.calls.append(("consumed", [g.prompt_id for g in groups], len(self.buffer), self.now()))

    def on_reset(self) -> None:
        self.calls.append(("reset",))
        super().on_reset()

    def on_resume(self, weight_version: int) -> None:
        self.calls.append(("resume", weight_version, self.now()))


def pacer_with(strategy_cls, *overrides: str):
    register_sliding_window_strategy("test-hooks")(strategy_cls)
    clock = FakeClock(100.0)
    config = load_config(overrides=[*BASE, "fully_async.sliding_window=test-hooks", *overrides])
    pacer = Pacer(config, clock=clock)
    return pacer, pacer.strategy.wrapped, clock


def group(prompt_id: str, tokens: int = 10, status=TrajectoryStatus.COMPLETED) -> list[Trajectory]:
    return [Trajectory(f"{prompt_id}/t{i}", prompt_id, status=status, num_tokens=tokens + i) for i in range(2)]


def test_hooks_run_in_order_with_the_pacer_clock_and_a_live_buffer_view():
    pacer, strategy, clock = pacer_with(Recorder)
    pacer.dispatch([PromptRef("a"), PromptRef("b"), PromptRef("c")])
    clock.now = 105.0
    pacer.submit(group("a") + group("b", 20))
    assert [(c[0], c[1], c[2]) for c in strategy.calls] == [
        ("submitted", "a/t0", 10), ("submitted", "a/t1", 11), ("submitted", "b/t0", 20), ("submitted", "b/t1", 21)]
    assert {c[3] for c in strategy.calls} == {105.0}  # now() is the pacer's clock
    view = strategy.buffer
    assert len(view) == 2 and [g.prompt_id for g in view] == ["a", "b"] and view.tokens() == 62
    assert view.trajectories() == 4
    clock.now = 110.0
    pacer.collect_now(1)
    assert strategy.calls[-1] == ("consumed", ["a"], 1, 110.0)  # the view already shows what is left
    assert [g.prompt_id for g in view.groups()] == ["b"]
    heard = len(strategy.calls)
    leased = pacer.collect_now(1, lease_seconds=30)
    assert len(strategy.calls) == heard  # a leased Collect is not consumed yet ...
    pacer.ack(leased.lease_id)
    assert strategy.calls[-1] == ("consumed", ["b"], 0, 110.0)  # ... its Ack is
    clock.now = 120.0
    pacer.reset(ResetMode.ABORT, resume=True, weight_version=7, wait=0)
    assert strategy.calls[-2:] == [("reset",), ("resume", 7, 120.0)]


def test_a_strategy_whose_hook_raises_leaves_the_submit_undone():
    class Refuses(Recorder):
        def on_submitted(self, trajectory) -> None:
            raise RuntimeError("no")

    pacer, strategy, _ = pacer_with(Refuses)
    pacer.dispatch([PromptRef("a")])
    before = pacer.state()
    with pytest.raises(StrategyHookError, match="on_submitted"):
        pacer.submit(group("a"))
    after = pacer.state()
    assert (after.submitted, after.queued_trajectories, after.running, after.buffered) == (
        before.submitted, before.queued_trajectories, before.running, before.buffered)


def test_a_strategy_without_the_hooks_is_not_asked_and_now_works_alone():
    class Plain(SlidingWindowStrategy):
        def compute_dispatch_count(self, buf_qsize: int) -> int:
            return 1

    pacer, strategy, clock = pacer_with(Plain)
    assert pacer._on_submitted is None and pacer._on_consumed is None and pacer._on_resume is None
    assert strategy.now() == 100.0
    alone = Plain()  # not adopted by a pacer: monotonic time and an empty buffer
    assert alone.now() > 0 and len(alone.buffer) == 0


def test_the_pacer_owns_the_one_lock_and_the_strategy_proxy_runs_under_it():
    from coda_server.core.strategy import ThreadSafeStrategy
    config = load_config(overrides=BASE)
    made = Pacer(config)  # the proxy create_strategy makes for it is given the pacer's lock
    assert made.strategy.lock is made.lock
    proxy = ThreadSafeStrategy(LatencyAwareStrategy(config), "latency-aware")
    own = proxy.lock
    adopting = Pacer(config, strategy=proxy)  # a proxy passed in runs under the pacer's lock from then on
    assert proxy.lock is adopting.lock and adopting.lock is not own
    with pytest.raises(ValueError, match="another pacer's lock"):
        Pacer(config, strategy=proxy)  # one proxy, two pacers: its hooks could run under either lock alone


def test_a_strategy_is_attached_to_the_pacers_clock_and_buffer_through_its_public_attach():
    class Attached(Recorder):
        def attach(self, clock, buffer) -> None:
            self.calls.append(("attach", clock(), len(buffer)))
            super().attach(clock, buffer)

    pacer, strategy, clock = pacer_with(Attached)
    assert strategy.calls == [("attach", 100.0, 0)]
    clock.now = 101.0
    assert strategy.now() == 101.0


def test_the_proxy_forwards_the_hooks_under_its_lock():
    proxy = create_strategy(load_config(overrides=[*BASE, "fully_async.sliding_window=latency-aware"]))
    assert isinstance(proxy.wrapped, LatencyAwareStrategy)
    proxy.on_consumed([object(), object()])
    assert proxy.compute_dispatch_count(0) == 0  # B = 2 consumed: quiet
    proxy.on_resume(1)
    assert proxy.compute_dispatch_count(0) == 4  # C - R - Q again


def test_latency_aware_goes_quiet_once_the_step_is_consumed_and_wakes_on_resume():
    config = load_config(overrides=[*BASE, "fully_async.stale_steps=2.0", "fully_async.sliding_window=latency-aware"])
    clock = FakeClock(100.0)
    pacer = Pacer(config, clock=clock)
    pacer.dispatch([PromptRef(p) for p in "abcd"])
    pacer.submit(group("a") + group("b") + group("c"))
    assert pacer.admissible_now() == 2  # C = 6: 1 running, 3 buffered: windowed-fifo's C - R - Q
    pacer.collect_now(1)
    assert pacer.admissible_now() == 3 and pacer.strategy.wrapped.quiet_since is None
    clock.now = 130.0
    pacer.collect_now(1)  # the step's B = 2 groups are taken: a group started now would start on old weights
    assert pacer.admissible_now() == 0 and pacer.strategy.wrapped.quiet_since == 130.0
    assert pacer.dispatch([PromptRef("e")]).admitted_ids == []
    pacer.reset(ResetMode.ABORT, resume=True, weight_version=1, wait=0)
    assert pacer.admissible_now() > 0 and pacer.strategy.wrapped.quiet_since is None


def test_latency_aware_quiet_after_option():
    config = load_config(overrides=[*BASE, "data_source.num_prompts_per_step=4", "fully_async.sliding_window=latency-aware",
                                    "fully_async.latency_aware.quiet_after=0.5"])
    strategy = create_strategy(config)
    assert strategy.compute_dispatch_count(2) == 6  # C = 8: windowed-fifo's C - R - Q
    strategy.on_consumed([object(), object()])  # half of B = 4: quiet
    assert strategy.compute_dispatch_count(2) == 0  # the step's other 2 groups are buffered
    # Quiet, but never starving the trainer: with nothing running or buffered it admits what the step
    # still needs (B - consumed - R - Q = 2), no more.
    assert strategy.compute_dispatch_count(0) == 2
    strategy.on_dispatched([PromptRef("x")])
    assert strategy.compute_dispatch_count(0) == 1
    for bad_option in ("quiet_after=1.5", "quiet_after=0", "collect_window=0.5", "collect_window=wide",
                       "adaptive_depth=3"):
        overrides = [*BASE, "fully_async.sliding_window=latency-aware", f"fully_async.latency_aware.{bad_option}"]
        with pytest.raises(ValueError, match=bad_option.split("=")[0]):  # refused at start-up, in one line
            load_config(overrides=overrides)
        bad = OmegaConf.merge(load_config(overrides=overrides[:-1]), OmegaConf.from_dotlist(overrides[-1:]))
        with pytest.raises(ValueError, match=bad_option.split("=")[0]):  # and by the strategy built without it
            create_strategy(bad)


def test_latency_aware_depth_follows_the_buffer_surplus_at_each_resume():
    # B = 2, stale 3.0: C = 8. One fetch is 1 group (M = N = 2).
    config = load_config(overrides=[*BASE, "fully_async.stale_steps=3.0", "fully_async.sliding_window=latency-aware"])
    pacer = Pacer(config, clock=FakeClock(100.0))
    strategy = pacer.strategy.wrapped
    pacer.dispatch([PromptRef(p) for p in "abcdefgh"])
    pacer.submit([t for p in "abcdefgh" for t in group(p)])
    pacer.collect_now(1)
    pacer.collect_now(1)  # the step's B = 2; 6 stay buffered
    pacer.reset(ResetMode.WAIT, resume=True, weight_version=1, wait=0)
    # 6 buffered at the Resume, against the next step's B = 2: surplus 4, the depth shrinks by half of it.
    assert strategy.depth == 6
    assert pacer.admissible_now() == 0  # depth 6 - 6 buffered (windowed-fifo would admit C - 6 = 2)
    for _ in range(4):
        pacer.collect_now(1)
    pacer.reset(ResetMode.WAIT, resume=True, weight_version=2, wait=0)
    # 2 buffered: no surplus, and the next step's first fetch is there: the depth stays.
    assert strategy.depth == 6
    for _ in range(2):
        pacer.collect_now(1)
    pacer.reset(ResetMode.WAIT, resume=True, weight_version=3, wait=0)
    assert strategy.depth == 7  # nothing buffered for the first fetch: it grows back by one fetch
    pacer.reset(ResetMode.WAIT, resume=True, weight_version=4, wait=0)
    assert strategy.depth == 8  # and again, up to C
    off = load_config(overrides=[*BASE, "fully_async.stale_steps=3.0", "fully_async.sliding_window=latency-aware",
                                 "fully_async.latency_aware.adaptive_depth=false"])
    pacer = Pacer(off, clock=FakeClock(100.0))
    pacer.dispatch([PromptRef(p) for p in "abcdefgh"])
    pacer.submit([t for p in "abcdefgh" for t in group(p)])
    pacer.reset(ResetMode.WAIT, resume=True, weight_version=1, wait=0)
    assert pacer.strategy.wrapped.depth == 8  # adaptive_depth false: C whatever the buffer


def aborted(prompt_id: str, *tokens: int) -> list[Trajectory]:
    return [Trajectory(f"{prompt_id}/t{i}", prompt_id, status=TrajectoryStatus.ABORTED, num_tokens=n)
            for i, n in enumerate(tokens)]


def abort_boundary(pacer: Pacer, trajectories: list[Trajectory], weight_version: int) -> None:
    pacer.begin_reset(ResetMode.ABORT)
    pacer.submit(trajectories)
    pacer.finish_reset(resume=True, weight_version=weight_version)


def test_latency_aware_depth_stops_at_what_the_engines_run_plus_one_step():
    # B = 2, N = 2, stale 3.0: C = 8. Trajectories aborted at a boundary without a token since they were
    # dispatched waited behind the engines; the ones with new tokens show how many the engines run at once.
    config = load_config(overrides=[*BASE, "fully_async.stale_steps=3.0", "fully_async.sliding_window=latency-aware",
                                    "rollout.partial=true"])
    pacer = Pacer(config, clock=FakeClock(100.0))
    strategy = pacer.strategy.wrapped
    pacer.dispatch([PromptRef(p) for p in "abcd"])
    abort_boundary(pacer, aborted("a", 5, 7) + aborted("b", 3, 1) + aborted("c", 0, 0) + aborted("d", 0, 0), 1)
    # Some waited, so the 4 that generated are the engines' limit: 2 groups, plus one step's B = 2.
    assert (strategy.engine_concurrency, strategy.depth) == (4, 4)
    assert len(pacer.dispatch([], max_continuations=8).continued) == 4
    # The four come back: a with the same tokens as at the last boundary (idle this time), b, c and d
    # with new ones. 6 generated while 2 waited: the limit seen rises to 6, 3 groups + B.
    abort_boundary(pacer, aborted("a", 5, 7) + aborted("b", 4, 2) + aborted("c", 2, 2) + aborted("d", 4, 1), 2)
    assert (strategy.engine_concurrency, strategy.depth) == (6, 5)

    # Every aborted trajectory generated: nothing waited, so the engines' limit is not known and the
    # depth is only the buffer's business (nothing buffered: it grows by one fetch, to at most C).
    pacer = Pacer(config, clock=FakeClock(100.0))
    strategy = pacer.strategy.wrapped
    pacer.dispatch([PromptRef(p) for p in "abcd"])
    abort_boundary(pacer, aborted("a", 5, 7) + aborted("b", 3, 1) + aborted("c", 2, 9) + aborted("d", 1, 1), 1)
    assert (strategy.engine_concurrency, strategy.depth) == (0, 8)


def test_latency_aware_collects_within_its_window_of_seqs():
    # B = 2, collect_window 1.5 -> 3 seqs from the oldest in flight (windowed-fifo: 2; no-window: all).
    config = load_config(overrides=[*BASE, "fully_async.stale_steps=2.0", "fully_async.sliding_window=latency-aware"])
    pacer = Pacer(config, clock=FakeClock(100.0))
    pacer.dispatch([PromptRef(p) for p in "abcd"])
    pacer.submit(group("b") + group("c") + group("d"))  # a, the oldest, still runs
    state = pacer.state()
    assert (state.buffered, state.running) == (2, 2)  # b, c collected; d (3 seqs past a) held
    pacer.submit(group("a"))
    assert pacer.state().buffered == 4  # the window slid: a and d collected
    windowed = load_config(overrides=[*BASE, "fully_async.stale_steps=2.0", "fully_async.sliding_window=latency-aware",
                                      "fully_async.latency_aware.collect_window=1.0"])
    pacer = Pacer(windowed, clock=FakeClock(100.0))
    pacer.dispatch([PromptRef(p) for p in "abcd"])
    pacer.submit(group("b") + group("c") + group("d"))
    assert pacer.state().buffered == 1  # windowed-fifo's window of B = 2: only b


PLUGIN = '''
from coda_server import SlidingWindowStrategy, register_sliding_window_strategy


@register_sliding_window_strategy("token-budget")
class TokenBudget(SlidingWindowStrategy):
    """One more group may run for every 100 response tokens submitted so far (observable as `remaining`)."""

    def __init__(self, config):
        super().__init__(config)
        self.tokens = 0

    def on_submitted(self, trajectory):
        self.tokens += trajectory.num_tokens

    def compute_dispatch_count(self, buf_qsize):
        return 1 + self.tokens // 100 - self._running_count - buf_qsize
'''


def test_over_grpc_the_strategy_hears_each_trajectory_with_its_token_count(tmp_path):
    plugins = tmp_path / "plugins"
    plugins.mkdir()
    (plugins / "token_budget.py").write_text(PLUGIN)
    server = ServerProcess(tmp_path, *BASE, f"server.custom_strategy_dirs=[{plugins}]",
                           "fully_async.sliding_window=token-budget").start()
    try:
        with PacerClient(server.address) as pacer:
            assert pacer.dispatch(["p", "q"]).admitted == ["p"]  # nothing heard yet: 1 group
            trajectories = [WireTrajectory(trajectory_id=f"p/{i}", prompt_id="p", status=WireStatus.COMPLETED,
                                           token_ids=list(range(150)))
                            for i in range(2)]
            pacer.submit(trajectories)
            # 300 tokens heard: 1 + 3 - 0 running - 1 buffered = 3 more may start.
            assert pacer.dispatch().remaining == 3
    finally:
        server.close()
