#!/usr/bin/env python
"""Scaling benchmark of the pacing core (a benchmark, not a test).

For each built-in strategy and 10^2 .. 10^5 groups in flight, time the steady-state cycle

    dispatch 1 new group + submit N trajectories completing the OLDEST in-flight group + collect 1

so the number in flight stays constant. Reports the median per-cycle cost over repeats, the ratio
largest/smallest per strategy (target <= 2: no operation scans all pending groups), and, at 10^4 in
flight, trajectory submits per second in one thread (target >= 50,000/s), through the whole cycle
and for Submit alone (N-trajectory batches, and one trajectory per call).

A last, informational section times a Submit that collects an in-window group while 10^2 .. 10^5
complete groups wait outside windowed-fifo's window. Before the pacer stopped re-examining refused
groups at the first refusal (`ordered_gate`), every such Submit re-asked all of them: about 0.56 ms
with 100 held, 3.6 ms with 1,000 and 69 ms with 10,000 on the machine these figures came from.

    python bench/core_scaling.py            # full run
    python bench/core_scaling.py --quick    # fewer cycles and repeats
    python bench/core_scaling.py --profile windowed-fifo:100000   # cProfile one configuration

Timing uses this thread's CPU time by default (`--clock cpu`), so other processes on a shared
machine inflate the figures less; `--clock wall` uses time.perf_counter. The sizes of one strategy
are timed round-robin, one block each per repeat, so a burst of outside load hits all of them alike.
Garbage collection is paused while timing (as `timeit` does); set-up and trajectory building are not timed.
"""
from __future__ import annotations

import argparse
import cProfile
import gc
import pstats
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from coda_server.core import Pacer, PromptRef, Trajectory, load_config  # noqa: E402

STRATEGIES = ("no-window", "window-gated", "windowed-fifo")
SIZES = (10**2, 10**3, 10**4, 10**5)
N = 8  # trajectories per group
CHUNK = 50_000  # candidates per pre-dispatch call (below server.max_dispatch_candidates)
TARGET_RATIO = 2.0
TARGET_SUBMITS = 50_000
CLOCKS = {"cpu": time.thread_time, "wall": time.perf_counter}
clock = time.thread_time


def make_pacer(strategy: str, inflight: int) -> Pacer:
    """B = inflight and stale_steps = 1.0, so C = 2 x inflight leaves room for the cycle's new group."""
    config = load_config(overrides=[
        f"fully_async.sliding_window={strategy}",
        "fully_async.stale_steps=1.0",
        f"data_source.num_prompts_per_step={inflight}",
        f"data_source.num_trajectories_per_prompt={N}",
        f"trainer.mini_batch_size={N}",
        "rollout.filter=[status]",
    ])
    return Pacer(config)


class Fixture:
    """A pacer with `inflight` groups dispatched, and the trajectories for the cycles to come pre-built."""

    def __init__(self, strategy: str, inflight: int):
        self.pacer = make_pacer(strategy, inflight)
        self.inflight = inflight
        self.order: list[str] = []  # dispatch order: the oldest in flight is order[self.head]
        self.head = 0
        self.fresh = 0
        ids = [self._new_id() for _ in range(inflight)]
        for start in range(0, inflight, CHUNK):
            result = self.pacer.dispatch([PromptRef(p) for p in ids[start:start + CHUNK]])
            assert len(result.admitted) == len(ids[start:start + CHUNK]), "capacity too small for the pre-dispatch"
        self.order.extend(ids)

    def _new_id(self) -> str:
        self.fresh += 1
        return f"g{self.fresh}"

    def plan(self, cycles: int):
        """(new candidate, trajectories completing the then-oldest group) for each of the next cycles."""
        steps = []
        for i in range(cycles):
            new = self._new_id()
            self.order.append(new)
            oldest = self.order[self.head + i]
            batch = [Trajectory(f"{oldest}/t{j}", oldest, 0, reward=float(j)) for j in range(N)]
            steps.append(([PromptRef(new)], batch))
        return steps

    def run_cycles(self, cycles: int) -> float:
        """Run `cycles` steady-state cycles; return the seconds they took."""
        steps = self.plan(cycles)
        pacer = self.pacer
        dispatch, submit, collect_now = pacer.dispatch, pacer.submit, pacer.collect_now
        gc.collect()
        gc.disable()
        try:
            start = clock()
            for candidates, batch in steps:
                if not dispatch(candidates).admitted:
                    raise RuntimeError("dispatch admitted nothing: the cycle is not in steady state")
                submit(batch)
                if not collect_now(1).groups:
                    raise RuntimeError("collect got nothing: the oldest group was not collected")
            elapsed = clock() - start
        finally:
            gc.enable()
        self.head += cycles
        self.check()
        return elapsed

    def submit_block(self, count: int) -> float:
        """Seconds for `count` Submit(N) calls alone, each completing the oldest group.

        The `count` new groups are dispatched before and the groups collected after, untimed
        (in flight briefly goes up to inflight + count, count <= inflight / 2).
        """
        steps = self.plan(count)
        self.pacer.dispatch([c for candidates, _ in steps for c in candidates])
        submit = self.pacer.submit
        gc.collect()
        gc.disable()
        try:
            start = clock()
            for _, batch in steps:
                submit(batch)
            elapsed = clock() - start
        finally:
            gc.enable()
        assert len(self.pacer.collect_now(count).groups) == count
        self.head += count
        self.check()
        return elapsed

    def check(self) -> None:
        state = self.pacer.state()
        assert state.running == self.inflight and state.buffered == 0 and state.invariant_holds(), state

    def single_trajectory_submits(self, count: int) -> float:
        """Seconds per Submit call carrying one trajectory: the `count // N` oldest groups are
        completed one trajectory per call (every N-th call completes a group and collects it).
        Their replacements are dispatched before and the groups taken after, untimed."""
        groups = max(1, count // N)
        steps = self.plan(groups)
        self.pacer.dispatch([c for candidates, _ in steps for c in candidates])
        calls = [[t] for _, batch in steps for t in batch]
        submit = self.pacer.submit
        gc.collect()
        gc.disable()
        try:
            start = clock()
            for call in calls:
                submit(call)
            elapsed = clock() - start
        finally:
            gc.enable()
        assert len(self.pacer.collect_now(groups).groups) == groups
        self.head += groups
        self.check()
        return elapsed / len(calls)


def measure(strategy: str, cycles: int, repeats: int) -> list[dict]:
    """Time every size of `strategy`, round-robin: each repeat runs one block per size."""
    fixtures = {size: Fixture(strategy, size) for size in SIZES}
    per_cycle: dict[int, list[float]] = {size: [] for size in SIZES}
    per_submit: dict[int, list[float]] = {size: [] for size in SIZES}
    singles: list[float] = []
    for fixture in fixtures.values():
        fixture.run_cycles(max(50, cycles // 5))  # warm-up
    for _ in range(repeats):
        for size, fixture in fixtures.items():
            per_cycle[size].append(fixture.run_cycles(cycles) / cycles)
            block = min(cycles, size // 2)
            per_submit[size].append(fixture.submit_block(block) / block)
            if size == 10**4:
                singles.append(fixture.single_trajectory_submits(cycles))
    results = []
    for size, fixture in fixtures.items():
        result = {
            "strategy": strategy, "inflight": size,
            "cycle_us": statistics.median(per_cycle[size]) * 1e6,
            "cycle_min_us": min(per_cycle[size]) * 1e6, "cycle_max_us": max(per_cycle[size]) * 1e6,
            "submit_us": statistics.median(per_submit[size]) * 1e6,
        }
        if size == 10**4:
            result["single_submit_us"] = statistics.median(singles) * 1e6
        results.append(result)
        fixture.pacer.close()
    return results


def held_submit_cost(held: int, count: int, repeats: int) -> float:
    """windowed-fifo with `held` complete groups gated outside the window (B = held, C = 2B, N = 1):
    seconds per Submit that completes an in-window group other than the head (so it is collected
    and the gate is re-examined, but nothing held is released). Median over repeats, fresh pacer each."""
    times = []
    for _ in range(repeats):
        config = load_config(overrides=[
            "fully_async.sliding_window=windowed-fifo", "fully_async.stale_steps=1.0",
            f"data_source.num_prompts_per_step={held}", "data_source.num_trajectories_per_prompt=1",
            "trainer.mini_batch_size=1", "rollout.filter=[status]"])
        pacer = Pacer(config)
        ids = [f"g{i}" for i in range(2 * held)]
        for start in range(0, len(ids), CHUNK):
            pacer.dispatch([PromptRef(p) for p in ids[start:start + CHUNK]])
        for start in range(held, len(ids), CHUNK):
            pacer.submit([Trajectory(f"{p}/t0", p) for p in ids[start:start + CHUNK]])
        assert pacer.state().buffered == 0
        n = min(count, held - 1)
        batches = [[Trajectory(f"{p}/t0", p)] for p in ids[held - 1:held - 1 - n:-1]]
        gc.collect()
        gc.disable()
        try:
            start = clock()
            for batch in batches:
                pacer.submit(batch)
            times.append((clock() - start) / n)
        finally:
            gc.enable()
        assert pacer.state().buffered == n
        pacer.close()
    return statistics.median(times)


def profile(spec: str, cycles: int) -> None:
    strategy, _, size = spec.partition(":")
    fixture = Fixture(strategy, int(size or 10**4))
    fixture.run_cycles(100)
    profiler = cProfile.Profile()
    profiler.enable()
    fixture.run_cycles(cycles)
    profiler.disable()
    pstats.Stats(profiler).sort_stats("cumulative").print_stats(25)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer cycles and repeats (a smoke run)")
    parser.add_argument("--cycles", type=int, help="cycles per repeat (default 3000, --quick 400)")
    parser.add_argument("--repeats", type=int, help="repeats per configuration (default 5, --quick 3)")
    parser.add_argument("--clock", choices=sorted(CLOCKS), default="cpu",
                        help="cpu: this thread's CPU time (default); wall: perf_counter")
    parser.add_argument("--profile", metavar="STRATEGY:INFLIGHT", help="cProfile one configuration and exit")
    args = parser.parse_args(argv)
    global clock
    clock = CLOCKS[args.clock]
    cycles = args.cycles or (400 if args.quick else 3000)
    repeats = args.repeats or (3 if args.quick else 5)
    command = "python " + " ".join([sys.argv[0]] + (argv if argv is not None else sys.argv[1:]))
    if args.profile:
        profile(args.profile, cycles)
        return 0

    print(f"# {command}")
    print(f"# python {sys.version.split()[0]}, N = {N}, B = in-flight, stale_steps = 1.0 (C = 2 x in-flight), "
          f"{cycles} cycles x {repeats} repeats, {args.clock} clock, GC paused while timing")
    print("# cycle = dispatch 1 + submit N completing the oldest group + collect 1; times are medians")
    header = f"{'strategy':<14} {'in flight':>9} {'cycle us':>9} {'min':>8} {'max':>8} {'submit(N) us':>13}"
    print(header)
    print("-" * len(header))
    results = []
    for strategy in STRATEGIES:
        for r in measure(strategy, cycles, repeats):
            results.append(r)
            size = r["inflight"]
            print(f"{strategy:<14} {size:>9,} {r['cycle_us']:>9.1f} {r['cycle_min_us']:>8.1f} "
                  f"{r['cycle_max_us']:>8.1f} {r['submit_us']:>13.1f}", flush=True)

    ok = True
    print()
    print(f"{'strategy':<14} {'largest/smallest cycle cost':>28}  (target <= {TARGET_RATIO:g})")
    for strategy in STRATEGIES:
        costs = [r["cycle_us"] for r in results if r["strategy"] == strategy]
        ratio = max(costs) / min(costs)
        ok &= ratio <= TARGET_RATIO
        print(f"{strategy:<14} {ratio:>28.2f}  {'ok' if ratio <= TARGET_RATIO else 'MISSED'}")

    print()
    print(f"trajectory submits per second, one thread, 10^4 in flight (target >= {TARGET_SUBMITS:,}/s):")
    print(f"{'strategy':<14} {'whole cycle':>12} {'submit(N) alone':>16} {'submit(1) alone':>16}")
    for r in results:
        if r["inflight"] != 10**4:
            continue
        cycle_rate = N / (r["cycle_us"] / 1e6)
        submit_rate = N / (r["submit_us"] / 1e6)
        single_rate = 1 / (r["single_submit_us"] / 1e6)
        ok &= cycle_rate >= TARGET_SUBMITS
        print(f"{r['strategy']:<14} {cycle_rate:>10,.0f}/s {submit_rate:>14,.0f}/s {single_rate:>14,.0f}/s")
    print()
    print("windowed-fifo with complete groups held outside the window: Submit collecting an in-window group")
    print(f"{'held':>9} {'submit us':>10}")
    held_costs = []
    for held in SIZES:
        cost = held_submit_cost(held, cycles, repeats) * 1e6
        held_costs.append(cost)
        print(f"{held:>9,} {cost:>10.1f}", flush=True)
    print(f"largest/smallest {max(held_costs) / min(held_costs):.2f}  (informational: flat means no re-scan "
          f"of the held groups)")
    print()
    print("all targets met" if ok else "a target was MISSED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
