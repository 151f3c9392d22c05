"""What waiting calls cost each Submit: the event loop's CPU per Submit with W long-polls waiting that it cannot answer.

Each rank of a data-parallel trainer long-polls for its share of the next global mini-batch (`batches(rank=r,
world_size=W)`), and workers long-poll Dispatch while the window is full. Every Submit changes the pacer; a waiting
call that the change cannot answer should cost next to nothing. This runs the pacing core's asyncio face in one
process (no gRPC), 200 Submits timed by the loop thread's CPU clock (median per Submit, the loop given a few turns
after each so the waiters' work is counted):

* `--kind collect` (default): W ranks' Collects wait for their shares of a mini-batch no Submit completes; each
  Submit brings one complete group of 16;
* `--kind dispatch`: the window is full and W workers' Dispatches wait for room; each Submit brings one trajectory
  of a running group (no slot frees).

With no call waiting, the figure is the Submit's own.

    python bench/collect_wakes.py                      # W = 0, 4, 16, 64; 3 repeats, medians
    python bench/collect_wakes.py --kind dispatch --waiting 0,64,512
"""
from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path
from typing import Optional

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this tree's code, whatever is installed

from coda_server.core import BatchShape, Pacer, PromptRef, Trajectory, load_config  # noqa: E402
from coda_server.core.async_pacer import AsyncPacer  # noqa: E402

GROUP_SIZE = 16
SUBMITS = 200


async def loop_cpu_per_submit(kind: str, count: int) -> float:
    """Median microseconds of the loop thread's CPU per Submit with `count` calls of `kind` waiting."""
    groups = SUBMITS + 8
    group_size = GROUP_SIZE if kind == "collect" else SUBMITS + 1  # dispatch: the groups stay running
    pacer = Pacer(load_config(overrides=[f"data_source.num_prompts_per_step={4 * groups}",  # room for the mini-batch
                                         f"data_source.num_trajectories_per_prompt={group_size}",
                                         "trainer.mini_batch_size=16", "fully_async.sliding_window=no-window"]))
    facade = AsyncPacer(pacer)
    facade.bind_loop()
    waiting: list[asyncio.Future] = []
    try:
        if kind == "collect":
            await facade.dispatch([PromptRef(f"p{i}") for i in range(groups)])
            # More groups than are ever dispatched (a whole number per rank): every Submit leaves the ranks waiting.
            mini_batch = max(count, 1) * (groups // max(count, 1) + 1)
            waiting[:] = [asyncio.ensure_future(facade.collect(mini_batch, wait=600, lease_seconds=600,
                                                               shape=BatchShape(rank=r, world_size=count)))
                          for r in range(count)] if count > 1 else []
        else:
            await facade.dispatch([PromptRef(f"p{i}") for i in range(4 * groups)])  # the window full
            waiting[:] = [asyncio.ensure_future(facade.dispatch([PromptRef(f"w{i}")], wait=600))
                          for i in range(count)]
        while facade.waits.waiting_calls < len(waiting):
            for call in waiting:
                if call.done():
                    call.result()  # refused: say why
            await asyncio.sleep(0)
        times = []
        for i in range(SUBMITS):
            if kind == "collect":
                submitted = [Trajectory(f"p{i}/{j}", f"p{i}", size_bytes=10) for j in range(GROUP_SIZE)]
            else:
                submitted = [Trajectory(f"p0/{i}", "p0", size_bytes=10)]
            started = time.thread_time()
            await facade.submit(submitted)
            for _ in range(3):  # the turns in which woken waiters attempt and wait again
                await asyncio.sleep(0)
            times.append(time.thread_time() - started)
        if facade.waits.waiting_calls != len(waiting):
            raise RuntimeError("a waiting call was answered: the measurement is not of waiting calls")
        return statistics.median(times) * 1e6
    finally:
        for call in waiting:
            call.cancel()
        await asyncio.gather(*waiting, return_exceptions=True)
        facade.drain()


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kind", choices=("collect", "dispatch"), default="collect",
                        help="collect: ranks waiting for their shares; dispatch: workers waiting for room")
    parser.add_argument("--waiting", "--ranks", default="0,4,16,64", help="comma-separated numbers of waiting calls")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    counts = [int(c) for c in args.waiting.split(",") if c.strip()]
    if any(c < 0 for c in counts) or (args.kind == "collect" and 1 in counts):
        parser.error("--waiting: 0 (none waiting) or more; for collect, a world size of at least 2")
    results: dict[int, list[float]] = {c: [] for c in counts}
    for _ in range(args.repeats):
        for count in counts:  # interleaved, so load from elsewhere falls on every count alike
            results[count].append(asyncio.run(loop_cpu_per_submit(args.kind, count)))
    base = statistics.median(results[counts[0]])
    what = "ranks' Collects" if args.kind == "collect" else "workers' Dispatches"
    print(f"loop CPU per Submit, {what} waiting, median of {args.repeats} runs of {SUBMITS} Submits:")
    for count in counts:
        value = statistics.median(results[count])
        extra = f", {(value - base) / count:.1f} us per waiting call" if count and counts[0] == 0 else ""
        print(f"  {count:4d} waiting: {value:8.1f} us{extra}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
