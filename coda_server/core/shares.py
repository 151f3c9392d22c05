"""Collects shaped for data-parallel trainers: a mini-batch cut by a group count or by a token budget, split
into token-balanced shares, one per rank, each rank's share leased to it alone.

A rank's Collect names its rank and the world size. The first rank to ask for a global mini-batch takes it
from the buffer and the server splits it (a deterministic function of the groups: every rank is served
from the same split); each share is a Collect lease of its own, the asking rank's handed out at once, the
others' kept open for their ranks. A share no rank takes, or a taken one never acknowledged, returns to
the buffer when its lease runs out, like any leased Collect, and is delivered again in a later mini-batch.
"""
from __future__ import annotations

import bisect
import heapq
from dataclasses import dataclass
from typing import Optional, Sequence

from coda_client.protocol import describe_collect_shape  # plain data, as the RPC table

from .types import TrajectoryGroup


@dataclass(frozen=True)
class BatchShape:
    """How a Collect cuts its mini-batch: `num_groups` groups, or (`token_budget` > 0) whole groups up to that
    many tokens; for one rank of a data-parallel trainer (`world_size` > 1), which share of it (`rank`), and the
    launch of the ranks it belongs to (`run`, "": none named; not part of `key`: a new run of one trainer ends the
    shares cut under its earlier run, Leases.run_change)."""

    token_budget: int = 0
    rank: int = 0
    world_size: int = 1
    run: str = ""

    @property
    def plain(self) -> bool:
        return not self.token_budget and self.world_size == 1

    def key(self, num_groups: int) -> tuple[int, int, int]:
        """What the ranks of one trainer have in common: their open mini-batches are kept under it."""
        return (self.world_size, num_groups, self.token_budget)


PLAIN = BatchShape()


def describe_shape(key: tuple[int, int, int]) -> str:
    """A `BatchShape.key` as the ranks' settings that make it, for messages."""
    return describe_collect_shape(*key)


def group_tokens(group: TrajectoryGroup) -> int:
    """Response tokens of a group (the length of each trajectory's token ids)."""
    return sum(t.num_tokens for t in group.trajectories)


def budget_count(buffer: list, token_budget: int, max_groups: int, min_groups: int) -> Optional[int]:
    """Groups of the next token-budget mini-batch: the longest prefix of the buffer (priority order) within
    the budget, at least `min_groups` (a single group above the budget goes out alone: it could never fit),
    at most `max_groups`. None while the buffer holds fewer tokens than the budget (and fewer than
    `max_groups` groups): more groups may still fit."""
    if len(buffer) < min_groups:
        return None
    if len(buffer) < max_groups and sum(group_tokens(g) for _, g in buffer) < token_budget:
        return None
    count = total = 0
    for _, group in heapq.nsmallest(min(len(buffer), max_groups), buffer):
        total += group_tokens(group)
        if total > token_budget and count >= min_groups:
            break
        count += 1
    return max(count, min_groups)


# A share this close to the mean is left as it is: a rank's step time does not notice less.
EVEN_ENOUGH = 1.002


def balanced_shares(tokens: Sequence[int], world_size: int, equal_counts: bool) -> list[list[int]]:
    """Indices of the groups each rank gets, balanced by tokens: placed largest first (`largest_first`), then
    evened out by exchanges (`_even_out`). Each share lists its indices in ascending order; none is empty when
    there are at least world_size groups."""
    shares, loads = largest_first(tokens, world_size, equal_counts)
    _even_out(tokens, shares, loads, moves=not equal_counts)
    return [sorted(share) for share in shares]


def largest_first(tokens: Sequence[int], world_size: int, equal_counts: bool) -> tuple[list[list[int]], list[int]]:
    """The placement `balanced_shares` starts from, and each share's tokens: largest group first, each to the share
    with the fewest tokens so far (then the fewest groups, then the lowest rank), among those not full when
    `equal_counts` (then every share holds len(tokens) // world_size groups)."""
    cap = len(tokens) // world_size if equal_counts else len(tokens)
    shares: list[list[int]] = [[] for _ in range(world_size)]
    loads = [0] * world_size
    # (load, groups, rank) of the shares not full, a heap: on equal loads the one with fewer groups, so that every
    # rank gets a group even when some have no tokens (an aborted group's).
    open_shares = [(0, 0, rank) for rank in range(world_size)]
    for index in sorted(range(len(tokens)), key=lambda i: (-tokens[i], i)):
        load, count, rank = heapq.heappop(open_shares)
        shares[rank].append(index)
        loads[rank] = load + tokens[index]
        if count + 1 < cap:
            heapq.heappush(open_shares, (loads[rank], count + 1, rank))
    return shares, loads


def _even_out(tokens: Sequence[int], shares: list[list[int]], loads: list[int], moves: bool) -> None:
    """Lower the heaviest share by exchanges: the placement above leaves it a few percent over the mean when each rank
    gets a handful of groups (bench/README.md, "Issue 29, seventeenth round"). Each round makes, of every swap of a
    group of the heaviest share (the lowest rank on a tie) with a group of a lighter one (and, with `moves`, every
    move of one), the one that leaves the larger of the pair's two loads smallest (then the lowest rank, the lowest
    indices). The rounds stop when none lowers it, when it is within EVEN_ENOUGH of the mean, or after one per rank
    (each exchange lowers the sum of squared loads, so they would end anyway; the cap bounds the time a split holds
    the loop)."""
    world_size = len(shares)
    enough = sum(loads) / world_size * EVEN_ENOUGH
    # Each share's (tokens, index) in ascending order, for the search by bisection; two change per round.
    partners = [sorted((tokens[j], j) for j in share) for share in shares]
    for _ in range(world_size):
        heavy = max(range(world_size), key=lambda r: (loads[r], -r))
        if loads[heavy] <= enough:
            return
        best: Optional[tuple[int, int, int, int]] = None  # (the pair's larger load after, other rank, given, taken)
        for other in sorted(range(world_size), key=lambda r: (loads[r], r)):
            gap = loads[heavy] - loads[other]
            if gap <= 0 or (best is not None and loads[other] + gap / 2 > best[0]):
                break  # the lightest first: no heavier one can leave the pair's larger load under half the gap
            candidates = [(0, -1), *partners[other]] if moves else partners[other]  # (0, -1): nothing given back
            for given in shares[heavy]:
                # The pair's larger load is least when the exchange moves gap / 2 tokens: the partners nearest
                # tokens[given] - gap / 2, one on each side, are the only ones that can do best.
                at = bisect.bisect_left(candidates, (tokens[given] - gap / 2,))
                for size, taken in candidates[max(at - 1, 0):at + 1]:
                    moved = tokens[given] - size
                    if 0 < moved < gap:
                        candidate = (max(loads[heavy] - moved, loads[other] + moved), other, given, taken)
                        if best is None or candidate < best:
                            best = candidate
        if best is None:
            return
        _, other, given, taken = best
        moved = tokens[given] - (tokens[taken] if taken >= 0 else 0)
        shares[heavy].remove(given)
        shares[other].append(given)
        if taken >= 0:
            shares[other].remove(taken)
            shares[heavy].append(taken)
        loads[heavy] -= moved
        loads[other] += moved
        for rank in (heavy, other):
            partners[rank] = sorted((tokens[j], j) for j in shares[rank])
