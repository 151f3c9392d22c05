"""coda-sim driving the real Pacer: determinism, conservation, known answers, and the seed's findings."""
from __future__ import annotations

from pathlib import Path

import pytest

from coda_server.core import LatencyAwareStrategy, register_sliding_window_strategy
from coda_sim import (SimulationError, colocate_baseline, load_sim_config, registered_strategies, simulate,
                      summarize, sweep)

# Strategies and filters registered here must not leak into other tests' registries.
pytestmark = pytest.mark.usefixtures("scratch_registry")

BUILTINS = ["no-window", "window-gated", "windowed-fifo"]
EXAMPLE_STRATEGIES = Path(__file__).resolve().parents[1] / "examples" / "strategies"

# A workload small enough to work out by hand: B = 4 groups of N = 2, one fetch of M = 8 per step,
# every response 100 tokens at a constant 10 tok/s (10 s), 4 s of training per fetch, 1 s weight sync.
TINY = [
    "data_source.num_prompts_per_step=4", "data_source.num_trajectories_per_prompt=2", "trainer.mini_batch_size=8",
    "rollout.filter=[status]", "sim.reward.filtered_group_prob=0.0",
    "sim.generation.length.distribution=constant", "sim.generation.length.median=100",
    "sim.generation.length.min=1",
    "sim.generation.decode.tokens_per_s_single=10.0", "sim.generation.decode.tokens_per_s_full=10.0",
    "sim.generation.prefill_s=0.0", "sim.generation.prefill_tokens_per_s=0.0", "sim.cluster.kv_cache_tokens=0",
    "sim.trainer.minibatch_fixed_s=4.0", "sim.trainer.per_token_s=0.0",
    "sim.trainer.weight_sync_s=1.0", "sim.reset.abort_latency_s=0.0", "sim.cluster.rollout_replicas=1",
    "sim.cluster.slots_per_replica=64", "sim.colocate.rollout_replicas=1", "sim.colocate.trainer_speedup=2.0",
    "sim.colocate.switch_s=3.0", "sim.colocate.oversample=1.0", "sim.steps=6",
]

# A small long-tailed job for the bookkeeping tests: fast, but with stragglers, aborts and restores.
SMALL_LONG_TAIL = [
    "data_source.num_prompts_per_step=16", "data_source.num_trajectories_per_prompt=4",
    "trainer.mini_batch_size=16", "sim.cluster.rollout_replicas=2", "sim.cluster.slots_per_replica=16",
    "sim.colocate.rollout_replicas=3", "sim.steps=6",
]

VOLATILE = {"wall_seconds", "events_per_second"}


def stable(summary: dict) -> dict:
    return {k: v for k, v in summary.items() if k not in VOLATILE}


# ------------------------------------------------------------------ determinism


def test_same_seed_identical_report_other_seed_different():
    config = load_sim_config(overrides=SMALL_LONG_TAIL + ["sim.seed=11"])
    first = [stable(summarize(r)) for r in sweep(config, BUILTINS, [1.0])]
    again = [stable(summarize(r)) for r in sweep(config, BUILTINS, [1.0])]
    assert first == again
    other = [stable(summarize(r)) for r in sweep(load_sim_config(overrides=SMALL_LONG_TAIL + ["sim.seed=12"]),
                                                 BUILTINS, [1.0])]
    assert [s["step_times"] for s in other] != [s["step_times"] for s in first]


# ------------------------------------------------------------------ conservation


@pytest.mark.parametrize("strategy", BUILTINS)
@pytest.mark.parametrize("variant", [
    [],  # partial rollout (abort), reward filter on
    ["rollout.partial=false", "sim.reset.wait_timeout_s=60.0"],  # wait mode that gives up: groups dropped
    ["sim.generation.fail_prob=0.05", "sim.generation.turns.max=3", "sim.generation.turns.tool_latency_s=5.0",
     "sim.generation.stragglers.prob=0.05"],  # failures (status filter), multi-turn, stragglers
    ["sim.cluster.max_concurrent_requests=24", "sim.generation.decode.kv_step_s_per_mtoken=0.5",
     "sim.cluster.kv_cache_tokens=40000", "sim.generation.prefill_tokens_per_s=20000.0"],  # a router limit below
    # the 32 slots, a decode step that grows with the cache, a cache small enough to preempt
    ["sim.cluster.max_concurrent_requests=24", "sim.cluster.kv_cache_tokens=40000",
     "sim.generation.prefill_tokens_per_s=20000.0", "sim.cluster.kv_reserve.enabled=true"],  # SGLang's
    # reservation and retraction on the same cache: retracted requests wait in the engines' queue
    ["rollout.partial=false", "sim.reset.wait_timeout_s=60.0", "sim.cluster.max_concurrent_requests=24",
     "sim.cluster.kv_cache_tokens=12000", "sim.cluster.kv_reserve.enabled=true"],  # ... and groups dropped
    # with requests waiting there (14 - 28 of them cancelled from the engines' queue in this run)
], ids=["abort", "wait-timeout", "fail-multiturn", "router-kv", "kv-reserve", "kv-reserve-wait-timeout"])
def test_every_dispatched_group_is_accounted_for(strategy, variant):
    config = load_sim_config(overrides=SMALL_LONG_TAIL + variant)
    run = simulate(config, strategy, 1.0, check_invariants=True)  # the pacer invariant, checked after every event
    t = run.totals
    # Pacer totals: every dispatch ended consumed, buffered, filtered, restored or dropped (nothing runs now).
    assert run.final_running == 0
    assert t["dispatched"] == t["consumed"] + run.final_buffered + t["filtered"] + t["restored"] + t["dropped"]
    # Per prompt (restored groups are dispatched again): each one consumed, filtered, dropped, or still waiting.
    fates = run.fates
    assert run.prompts_created == (fates["consumed"] + fates["filtered"] + fates["dropped"]
                                   + run.final_buffered + run.final_candidates)
    assert fates["consumed"] == t["consumed"] == 16 * 6
    assert fates["filtered"] == t["filtered"] and fates["dropped"] == t["dropped"]
    assert t["stale_rejected"] == 0 and t["duplicates"] == 0
    if "sim.reset.wait_timeout_s=60.0" in variant:
        assert t["dropped"] > 0 and run.tokens_wasted > 0
    else:
        assert t["dropped"] == 0 and t["restored"] > 0
    if "sim.generation.fail_prob=0.05" in variant:
        assert t["filtered"] > 0
    if "sim.cluster.kv_reserve.enabled=true" in variant:
        assert run.preemptions > 0  # retractions happened (and were re-admitted: every group accounted for)


def test_step_reports_agree_with_the_simulation():
    run = simulate(load_sim_config(overrides=SMALL_LONG_TAIL), "windowed-fifo", 2.0)
    summary = summarize(run)
    # Every step consumes exactly B x N trajectories, so the mean of the pacer's per-step partial_ratio
    # equals the share of partial trajectories the simulated trainer counted.
    assert summary["partial_ratio"] == pytest.approx(summary["partial_ratio_overall"])
    assert 0 < summary["partial_ratio"] < 1 and summary["partial_span_max"] >= 1
    assert summary["restored"] == run.totals["restored"]
    assert summary["dropped"] == run.totals["dropped"] == 0
    assert summary["staleness_max"] >= summary["staleness_p99"] >= summary["staleness_p50"] >= 0
    assert sum(run.staleness.values()) == run.totals["consumed"] * 4


# ------------------------------------------------------------------ known answers


@pytest.mark.parametrize("partial", ["false", "true"])
@pytest.mark.parametrize("stale", [0.0, 1.0])
def test_constant_generation_time_all_strategies_coincide(partial, stale):
    config = load_sim_config(overrides=TINY + [f"rollout.partial={partial}"])
    runs = sweep(config, BUILTINS, [stale], check_invariants=True)
    times = [[round(s.duration, 9) for s in run.steps] for run in runs]
    assert times[0] == times[1] == times[2]
    # Colocate by hand: generate 10 s, train 4 s / 2, switch 3 s.
    assert runs[0].colocate.step_times == pytest.approx([15.0] * 6)
    if partial == "false" and stale == 0.0:
        # Wait mode, C = B: step 0 = 10 s generation + next batch generating 10 s + 1 s sync = 21 s;
        # then the buffer is full at each resume: max(generation 10 s, training 4 s) + sync 1 s.
        assert times[0] == pytest.approx([21.0, 11.0, 11.0, 11.0, 11.0, 11.0])
    if partial == "true" and stale == 0.0:
        # Abort mode: the next batch runs 4 s during training, is aborted, continues 6 s after the resume.
        assert times[0] == pytest.approx([15.0, 11.0, 11.0, 11.0, 11.0, 11.0])


def test_one_very_slow_group_stops_window_gated_dispatch_only():
    # C = 8 (B = 4, stale 1); one fetch = one group; prompt 0 decodes 1000x slower than the rest.
    config = load_sim_config(overrides=TINY + [
        "trainer.mini_batch_size=2", "sim.generation.stragglers.indices=[0]",
        "sim.generation.stragglers.slowdown=1000.0", "sim.steps=2"])
    dispatched = {}
    for strategy in BUILTINS:
        run = simulate(config, strategy, 1.0, check_invariants=True, with_colocate=False)
        dispatched[strategy] = run.steps[0].dispatched_before_boundary  # the slow group still runs then
    assert dispatched["window-gated"] == 8  # newest seq may not run C ahead of the slow head: stops at C
    assert dispatched["no-window"] > 8
    assert dispatched["windowed-fifo"] > 8  # dispatches on; only collection waits for the head


# ------------------------------------------------------------------ the seed framework's findings


def test_long_tail_async_beats_colocate_and_windowed_fifo_wastes_less():
    config = load_sim_config(overrides=["sim.steps=12"])  # the built-in long_tail preset
    runs = {run.strategy: run for run in sweep(config, BUILTINS, [2.0])}
    summaries = {name: summarize(run) for name, run in runs.items()}
    for strategy, summary in summaries.items():
        assert summary["speedup_vs_colocate"] > 1.0, strategy
        assert summary["avg_step_time"] < summary["colocate_step_time"], strategy
    nw, wf = summaries["no-window"], summaries["windowed-fifo"]
    # windowed-fifo holds complete groups in the trajectory queue (they count in R): fewer requests run
    # when a Reset aborts, so fewer tokens are masked and fewer are re-prefilled after the weight sync.
    assert wf["masked_token_ratio"] < nw["masked_token_ratio"]
    assert wf["useful_throughput"] > nw["useful_throughput"]
    assert runs["windowed-fifo"].reprefill_tokens < runs["no-window"].reprefill_tokens


# ------------------------------------------------------------------ custom strategies


def test_custom_strategies_are_simulated_and_a_stall_is_reported(tmp_path, request):
    from coda_server.core.strategy import STRATEGIES

    # The registry is process-wide: take the stalling test strategy out again, or a later --compare
    # in this session would sweep it too.
    request.addfinalizer(lambda: STRATEGIES._classes.pop("sim-test-never", None))
    plugin = tmp_path / "never.py"
    plugin.write_text(
        "from coda_server import SlidingWindowStrategy, register_sliding_window_strategy\n\n"
        "@register_sliding_window_strategy('sim-test-never')\n"
        "class Never(SlidingWindowStrategy):\n"
        "    def compute_dispatch_count(self, buf_qsize):\n"
        "        return 0\n")
    config = load_sim_config(overrides=TINY + [f"server.custom_strategy_dirs=[{EXAMPLE_STRATEGIES},{tmp_path}]"])
    names = registered_strategies(config)
    assert {"fixed-capacity", "sim-test-never", *BUILTINS} <= set(names)
    run = simulate(config, "fixed-capacity", 1.0, check_invariants=True, with_colocate=False)
    assert run.totals["consumed"] == 4 * 6
    with pytest.raises(SimulationError, match="stalled"):
        simulate(config, "sim-test-never", 1.0, with_colocate=False)


@pytest.mark.parametrize("partial", [False, True])
def test_latency_aware_quiet_tail_never_starves_the_trainer(partial):
    # Quiet after the first fetch of each step, with reward-filtered groups: what is running and buffered
    # then cannot cover the step, and a quiet tail that admitted nothing would stall the run.
    config = load_sim_config(overrides=SMALL_LONG_TAIL + [
        f"rollout.partial={str(partial).lower()}", "sim.reward.filtered_group_prob=0.3",
        "fully_async.latency_aware.quiet_after=0.25"])
    run = simulate(config, "latency-aware", 1.0, check_invariants=True, with_colocate=False)
    assert run.totals["consumed"] == 16 * 6


def test_filters_that_drop_everything_stop_with_a_message_not_a_hang():
    config = load_sim_config(overrides=TINY + ["sim.reward.filtered_group_prob=1.0"])
    with pytest.raises(SimulationError, match="drop"):
        simulate(config, "no-window", 1.0, with_colocate=False)
    with pytest.raises(SimulationError, match="colocate baseline"):
        colocate_baseline(config, steps=1)


def test_colocate_baselines_cut_the_tail_at_b_and_partial_continues_it():
    # B = 2 groups of 1, constant 100 tokens at 10 tok/s (10 s); prompts 1 and 3 decode 2.5x slower (25 s).
    # The sampler dispatches 2 x B = 4 groups and stops generating once 2 are accepted.
    config = load_sim_config(overrides=TINY + [
        "data_source.num_prompts_per_step=2", "data_source.num_trajectories_per_prompt=1", "trainer.mini_batch_size=2",
        "sim.generation.stragglers.indices=[1,3]", "sim.generation.stragglers.slowdown=2.5",
        "sim.colocate.oversample=2.0", "sim.cluster.slots_per_replica=8", "sim.steps=3"])
    plain = colocate_baseline(config, 3)
    # Every step: the two fast groups finish at 10 s; what still runs is thrown away (step 0: the two slow
    # ones, 40 tokens each; later steps: two fast groups finished at the same moment, not needed).
    assert plain.gen_times == pytest.approx([10.0, 10.0, 10.0])
    assert plain.discarded_groups == 6 and plain.restored_groups == 0
    assert colocate_baseline(config, 1).tokens_wasted == pytest.approx(80.0)
    partial = colocate_baseline(config, 3, partial=True)
    # Step 0 as before, but 1 and 3 are carried over (40 tokens done) and dispatched first in step 1, where
    # they reach 80 tokens by the time two fresh groups finish; in step 2 they need 20 more: done at 5 s.
    assert partial.gen_times == pytest.approx([10.0, 10.0, 5.0])
    # Their 80 tokens from before the last abort are masked out of what step 2 trains on.
    assert partial.masked_tokens == pytest.approx([0.0, 0.0, 160.0])
    assert partial.consumed_tokens == pytest.approx([200.0, 200.0, 200.0])
    assert partial.restored_groups == 6 and partial.discarded_groups == 0
    # Step time = generation + training (4 s / speed-up 2) + 3 s switch.
    assert partial.step_times == pytest.approx([15.0, 15.0, 10.0])


def test_latency_aware_learns_the_engines_limit_at_an_abort_boundary():
    # B = 16 groups of N = 4, stale 2.0: C = 48 groups (192 trajectories), but a router lets only 24
    # requests generate. The first ABORT boundary shows requests that never started; the ones that did
    # are the limit, and the depth is held to 24 / 4 + B = 22 groups from then on.
    seen: list[tuple[int, int]] = []

    @register_sliding_window_strategy("sim-test-latency-probe")
    class Probe(LatencyAwareStrategy):
        def on_resume(self, weight_version: int) -> None:
            super().on_resume(weight_version)
            seen.append((self.engine_concurrency, self.depth))

    config = load_sim_config(overrides=SMALL_LONG_TAIL + ["rollout.partial=true", "sim.cluster.max_concurrent_requests=24"])
    probe = simulate(config, "sim-test-latency-probe", 2.0, check_invariants=True, with_colocate=False)
    assert seen[0] == (24, 22) and all(depth <= 22 for _, depth in seen)
    fixed = simulate(load_sim_config(overrides=SMALL_LONG_TAIL + [
        "rollout.partial=true", "sim.cluster.max_concurrent_requests=24", "fully_async.latency_aware.adaptive_depth=false"]),
        "latency-aware", 2.0, with_colocate=False)
    # Held to what can start, its groups cross fewer boundaries than at the full depth C.
    assert summarize(probe)["partial_ratio"] < summarize(fixed)["partial_ratio"]
