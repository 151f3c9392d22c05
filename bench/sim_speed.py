#!/usr/bin/env python
"""Speed of coda-sim (issue 7, Performance): simulated events per second on the long-tail preset.

Target: 100 training steps of B = 64, N = 8 (M = 128) on the built-in long_tail workload finish in
under a minute for one strategy. The run drives the real Pacer exactly as `coda-sim` does; the
colocate baseline, computed once per sweep, is timed apart.

    python bench/sim_speed.py                          # windowed-fifo, 100 steps
    python bench/sim_speed.py --strategy no-window --steps 200
    python bench/sim_speed.py --check-invariants       # with the per-event invariant check the tests use

Prints wall time, events handled, events per second, simulated seconds per wall second, and
PASS / FAIL against the one-minute target (exit status 1 on FAIL). Wall time on a shared machine
includes other processes' load; the CPU time of this process is printed beside it.
"""
from __future__ import annotations

import argparse
import sys
import time

from coda_sim import colocate_baselines, load_sim_config, simulate, summarize

TARGET_SECONDS = 60.0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--strategy", default="windowed-fifo")
    parser.add_argument("--stale-steps", type=float, default=2.0)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--check-invariants", action="store_true")
    args = parser.parse_args(argv)

    config = load_sim_config(preset="long_tail", overrides=[f"sim.seed={args.seed}"])
    pacer = config.pacer_config(args.strategy, args.stale_steps)
    source = pacer.data_sources[0]
    print(f"coda-sim speed: long_tail preset, B={source.num_prompts_per_step} N={source.num_trajectories_per_prompt} "
          f"M={pacer.trainer.mini_batch_size}, {args.strategy} stale_steps={args.stale_steps:g}, {args.steps} steps, "
          f"seed {args.seed}{', invariants checked at every event' if args.check_invariants else ''}")

    wall0, cpu0 = time.perf_counter(), time.process_time()
    run = simulate(config, args.strategy, args.stale_steps, steps=args.steps, with_colocate=False,
                   check_invariants=args.check_invariants)
    wall, cpu = time.perf_counter() - wall0, time.process_time() - cpu0

    wall1 = time.perf_counter()
    run.colocate, run.colocate_partial = colocate_baselines(config, args.steps)
    colocate_wall = time.perf_counter() - wall1
    summary = summarize(run)

    t = run.totals
    print(f"  async run:   {wall:6.2f} s wall ({cpu:.2f} s CPU), {run.events:,} events -> "
          f"{run.events / wall:,.0f} events/s; {run.sim_time:,.0f} simulated s ({run.sim_time / wall:,.0f}x real time)")
    print(f"               pacer calls behind it: {t['dispatched']:,} groups dispatched, {t['submitted']:,} trajectories "
          f"submitted, {t['consumed']:,} groups consumed, {t['restored']:,} restored")
    print(f"  colocate:    {colocate_wall:6.2f} s wall (both baselines, colocate and colocate + partial, once per sweep)")
    print(f"  result:      avg step {summary['avg_step_time_excl_step0']:.1f} s (excl. step 0), "
          f"speedup vs colocate {summary['speedup_vs_colocate']:.2f}x")
    ok = wall < TARGET_SECONDS
    print(f"  target:      {args.steps} steps in < {TARGET_SECONDS:.0f} s for one strategy: "
          f"{'PASS' if ok else 'FAIL'} ({wall:.1f} s)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
