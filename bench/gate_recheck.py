#!/usr/bin/env python
"""Cost of re-examining held groups on a timer (fully_async.gate_recheck_seconds), a benchmark, not a test.

Complete groups a strategy's `will_collect` refuses wait in the trajectory queue ("held"). Besides the pass
after every change of the strategy's state, the server re-examines them every `gate_recheck_seconds` (1 s by
default, and only when no pass ran within that time), so a gate that opens with time or on an outside flag
releases its groups. This script times one such pass with 10^2 .. 10^4 held groups and nothing to release
(the steady state: the gate stays shut), for

- an ordered gate (`windowed-fifo`: groups outside the window of B seqs; the pass stops at the first refusal);
- an unordered gate (a custom gate on an outside flag that refuses everything: the pass asks every group);

and, side by side in the same run, a Submit of one trajectory that completes a group (N = 1) with the same
number held (that Submit runs a change-triggered pass over the same groups; the groups it completes are held
too, so up to repeats x calls more are held by the end). It reports the median per pass
over repeats, the share of one core the timer costs at the default 1 s interval (pass / interval), and the
ratio timer pass / Submit.

    python bench/gate_recheck.py            # full run
    python bench/gate_recheck.py --quick    # fewer repeats

Timing uses this thread's CPU time (time.thread_time), with garbage collection paused while timing.
"""
from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from coda_server.core import Pacer, PromptRef, Trajectory, load_config  # noqa: E402
from coda_server.core.builtin_strategies import NoWindowStrategy  # noqa: E402
from coda_server.core.strategy import ThreadSafeStrategy  # noqa: E402

SIZES = (10**2, 10**3, 10**4)
INTERVAL_SECONDS = 1.0  # the default fully_async.gate_recheck_seconds


class ShutGate(NoWindowStrategy):
    """An unordered gate that stays shut (as one waiting on an outside flag does until the flag is set)."""

    def will_collect(self, group):
        return super().will_collect(group) and False


def held_pacer(kind: str, held: int, room: int) -> Pacer:
    """A pacer holding `held` complete groups its gate refuses, with room to dispatch `room` more."""
    # B = 1 and a large stale_steps: windowed-fifo's collection window is one seq while C leaves room for all.
    overrides = ["fully_async.stale_steps=" + str(float(held + room + 10)), "data_source.num_prompts_per_step=1",
                 "data_source.num_trajectories_per_prompt=1", "trainer.mini_batch_size=1", "rollout.filter=[status]"]
    if kind == "ordered":
        # The oldest group stays in flight (never submitted): every later complete group is outside the window.
        pacer = Pacer(load_config(overrides=["fully_async.sliding_window=windowed-fifo", *overrides]))
    else:
        config = load_config(overrides=["fully_async.sliding_window=no-window", *overrides])
        pacer = Pacer(config, strategy=ThreadSafeStrategy(ShutGate(config), "shut-gate"))
    pacer.dispatch([PromptRef("head")] + [PromptRef(f"g{i}") for i in range(held)])
    for start in range(0, held, 1000):
        pacer.submit([Trajectory(f"g{i}/t0", f"g{i}") for i in range(start, min(held, start + 1000))])
    state = pacer.state()
    assert state.buffered == 0 and state.running == held + 1, state
    return pacer


def time_passes(pacer: Pacer, repeats: int, per_repeat: int) -> float:
    """Median seconds of one timer pass (recheck_gates with no minimum age)."""
    samples = []
    for _ in range(repeats):
        gc.disable()
        start = time.thread_time()
        for _ in range(per_repeat):
            pacer.recheck_gates(min_age=0.0)
        samples.append((time.thread_time() - start) / per_repeat)
        gc.enable()
    return statistics.median(samples)


def time_submits(pacer: Pacer, repeats: int, per_repeat: int) -> float:
    """Median seconds of a Submit completing one new group while the others stay held."""
    samples, serial = [], 0
    for _ in range(repeats):
        ids = [f"s{serial + i}" for i in range(per_repeat)]
        serial += per_repeat
        pacer.dispatch([PromptRef(p) for p in ids])
        batches = [[Trajectory(f"{p}/t0", p)] for p in ids]
        gc.disable()
        start = time.thread_time()
        for batch in batches:
            pacer.submit(batch)
        samples.append((time.thread_time() - start) / per_repeat)
        gc.enable()
    return statistics.median(samples)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer repeats")
    args = parser.parse_args(argv)
    repeats, per_repeat = (5, 20) if args.quick else (15, 50)
    print(f"gate re-check pass vs Submit, median of {repeats} repeats x {per_repeat} calls, thread CPU time")
    print(f"{'gate':<10} {'held':>7} {'pass':>12} {'share of a core at 1 s':>24} {'Submit':>12} {'pass/Submit':>12}")
    for kind in ("ordered", "unordered"):
        for held in SIZES:
            pacer = held_pacer(kind, held, repeats * per_repeat)
            per_pass = time_passes(pacer, repeats, per_repeat)
            per_submit = time_submits(pacer, repeats, per_repeat)
            print(f"{kind:<10} {held:>7} {per_pass * 1e6:>10.1f}us {per_pass / INTERVAL_SECONDS:>23.4%} "
                  f"{per_submit * 1e6:>10.1f}us {per_pass / per_submit:>12.2f}")
            pacer.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
