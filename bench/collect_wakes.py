"""What waiting data-parallel ranks cost each Submit: the event loop's CPU per Submit with W ranks' Collects waiting.

Each rank of a data-parallel trainer long-polls for its share of the next global mini-batch (`batches(rank=r,
world_size=W)`). Every Submit changes the pacer; a waiting Collect that the change cannot answer (the mini-batch
is not complete yet) should cost next to nothing. This runs the pacing core's asyncio face in one process (no
gRPC): W Collects wait for their shares of a mini-batch that is never completed during the measurement, and 200
Submits of one complete group of 16 each are timed by the loop thread's CPU clock (median per Submit, the loop
given a few turns after each so the waiters' work is counted). With no rank waiting, the figure is the Submit's own.

    python bench/collect_wakes.py                      # W = 0, 4, 16, 64; 3 repeats, medians
    python bench/collect_wakes.py --ranks 0,256 --repeats 5
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


async def loop_cpu_per_submit(ranks: int) -> float:
    """Median microseconds of the loop thread's CPU per Submit with `ranks` Collects waiting for their shares."""
    groups = SUBMITS + 8
    pacer = Pacer(load_config(overrides=[f"data_source.num_prompts_per_step={4 * groups}",  # room for the mini-batch
                                         f"data_source.num_trajectories_per_prompt={GROUP_SIZE}",
                                         "trainer.mini_batch_size=16", "fully_async.sliding_window=no-window"]))
    facade = AsyncPacer(pacer)
    facade.bind_loop()
    waiting: list[asyncio.Future] = []
    try:
        await facade.dispatch([PromptRef(f"p{i}") for i in range(groups)])
        # More groups than are ever dispatched (a whole number per rank): every Submit leaves the ranks waiting.
        mini_batch = max(ranks, 1) * (groups // max(ranks, 1) + 1)
        waiting[:] = [asyncio.ensure_future(facade.collect(mini_batch, wait=600, lease_seconds=600,
                                                        shape=BatchShape(rank=r, world_size=ranks)))
                   for r in range(ranks)] if ranks > 1 else []
        while facade.waits.waiting_calls < len(waiting):
            for call in waiting:
                if call.done():
                    call.result()  # refused: say why
            await asyncio.sleep(0)
        times = []
        for i in range(SUBMITS):
            group = [Trajectory(f"p{i}/{j}", f"p{i}", size_bytes=10) for j in range(GROUP_SIZE)]
            started = time.thread_time()
            await facade.submit(group)
            for _ in range(3):  # the turns in which woken waiters attempt and wait again
                await asyncio.sleep(0)
            times.append(time.thread_time() - started)
        if facade.waits.waiting_calls != len(waiting):
            raise RuntimeError("a waiting rank was answered: the measurement is not of waiting ranks")
        return statistics.median(times) * 1e6
    finally:
        for call in waiting:
            call.cancel()
        await asyncio.gather(*waiting, return_exceptions=True)
        facade.drain()


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", default="0,4,16,64", help="comma-separated numbers of waiting ranks")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    counts = [int(r) for r in args.ranks.split(",") if r.strip()]
    if any(c == 1 or c < 0 for c in counts):
        parser.error("--ranks: 0 (none waiting) or a world size of at least 2")
    results: dict[int, list[float]] = {c: [] for c in counts}
    for _ in range(args.repeats):
        for count in counts:  # interleaved, so load from elsewhere falls on every count alike
            results[count].append(asyncio.run(loop_cpu_per_submit(count)))
    base = statistics.median(results[counts[0]])
    print(f"loop CPU per Submit (a group of {GROUP_SIZE}), median of {args.repeats} runs of {SUBMITS} Submits:")
    for count in counts:
        value = statistics.median(results[count])
        extra = f", {(value - base) / count:.1f} us per waiting rank" if count and counts[0] == 0 else ""
        print(f"  {count:4d} ranks waiting: {value:8.1f} us{extra}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
