#!/usr/bin/env python
"""How evenly the server splits a global mini-batch among data-parallel ranks, a benchmark, not a test.

For each shape (groups per global mini-batch, ranks, equal counts or a token budget's free counts) it draws
mini-batches of whole groups from payload_path.py's long-tailed length mix (a lognormal per-prompt scale around
1,024 tokens times a per-response spread, groups of 16, 64..32,768 tokens each) and reports the imbalance of
each split (tokens of the heaviest share / the mean), median and 90th percentile, for

- the placement alone (`coda_server.core.shares.largest_first`: largest group first, to the lightest share);
- the server's split (`balanced_shares`: that placement, then exchanges that lower the heaviest share);
- the floor no split of those whole groups can go under (with equal counts: the rank holding the largest group
  holds the others' count less one besides it, at best the smallest ones; with free counts: the largest group,
  or the mean),

and the CPU time of one split (it runs on the server's event loop, once per global mini-batch), median and max.

    python bench/share_balance.py           # 200 mini-batches per shape (fewer for the largest)
    python bench/share_balance.py --quick   # 20 per shape
"""
from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from coda_server.core.shares import balanced_shares, largest_first  # noqa: E402
from payload_path import least_imbalance, long_tailed_lengths  # noqa: E402

# (groups per global mini-batch, ranks, equal counts): 4 to 8 groups per rank, as at small and large scale,
# and token budgets (free counts).
SHAPES = ((32, 4, True), (64, 8, True), (32, 8, True), (128, 8, True), (256, 64, True), (512, 64, True),
          (32, 4, False), (512, 16, False))


def group_tokens(groups: int, rng: np.random.Generator) -> list[int]:
    """Tokens of each of `groups` groups, in payload_path.py's long-tailed mix."""
    return [sum(lengths) for lengths in long_tailed_lengths(groups, 0, rng)]


def imbalance(tokens: list[int], shares: list[list[int]]) -> float:
    loads = [sum(tokens[i] for i in share) for share in shares]
    return max(loads) / (sum(loads) / len(loads))


def measure(groups: int, ranks: int, equal_counts: bool, splits: int, seed: int) -> dict:
    rng = np.random.default_rng(seed)
    placed, split, floor, seconds = [], [], [], []
    for _ in range(splits):
        tokens = group_tokens(groups, rng)
        placed.append(imbalance(tokens, largest_first(tokens, ranks, equal_counts)[0]))
        gc.disable()
        began = time.thread_time()
        shares = balanced_shares(tokens, ranks, equal_counts)
        seconds.append(time.thread_time() - began)
        gc.enable()
        split.append(imbalance(tokens, shares))
        floor.append(least_imbalance(tokens, ranks, equal_counts))
    return {"placed": placed, "split": split, "floor": floor, "seconds": seconds}


def p90(values: list[float]) -> float:
    return sorted(values)[int(0.9 * (len(values) - 1))]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="20 mini-batches per shape")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    print(f"share_balance: python {sys.version.split()[0]}; imbalance = heaviest share's tokens / mean "
          f"(median, p90 over the mini-batches)")
    print(f"{'groups':>6} {'ranks':>5} {'counts':>6} {'splits':>6}  {'largest first':>15}  {'server split':>15}  "
          f"{'floor':>15}  {'ms per split (median, max)':>26}")
    for groups, ranks, equal_counts in SHAPES:
        splits = 20 if args.quick else (200 if groups <= 128 else 40)
        r = measure(groups, ranks, equal_counts, splits, args.seed)
        cells = [f"{statistics.median(r[k]):.3f}, {p90(r[k]):.3f}" for k in ("placed", "split", "floor")]
        print(f"{groups:>6} {ranks:>5} {'equal' if equal_counts else 'free':>6} {splits:>6}  {cells[0]:>15}  "
              f"{cells[1]:>15}  {cells[2]:>15}  {1e3 * statistics.median(r['seconds']):>12.2f}, "
              f"{1e3 * max(r['seconds']):.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
