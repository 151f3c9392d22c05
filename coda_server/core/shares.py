"""Collects shaped for data-parallel trainers: a mini-batch cut by a group count or by a token budget, split
into token-balanced shares, one per rank, each rank's share leased to it alone.

A rank's Collect names its rank and the world size. The first rank to ask for a global mini-batch takes it
from the buffer and the server splits it (a deterministic function of the groups: every rank is served
from the same split); each share is a Collect lease of its own, the asking rank's handed out at once, the
others' kept open for their ranks. A share no rank takes, or a taken one never acknowledged, returns to
the buffer when its lease runs out, like any leased Collect, and is delivered again in a later mini-batch.
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import Optional, Sequence

from coda_client.protocol import describe_collect_shape  # plain data, as the RPC table

from .types import TrajectoryGroup


@dataclass(frozen=True)
class BatchShape:
    """How a Collect cuts its mini-batch: `num_groups` groups, or (`token_budget` > 0) whole groups up to that
    many tokens; for one rank of a data-parallel trainer (`world_size` > 1), which share of it (`rank`)."""

    token_budget: int = 0
    rank: int = 0
    world_size: int = 1

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


def balanced_shares(tokens: Sequence[int], world_size: int, equal_counts: bool) -> list[list[int]]:
    """Indices of the groups each rank gets, balanced by tokens: largest group first, each to the share with
    the fewest tokens so far (the lowest rank on a tie), among those not full when `equal_counts` (then
    every share holds len(tokens) // world_size groups). Each share lists its indices in ascending order."""
    cap = len(tokens) // world_size if equal_counts else len(tokens)
    shares: list[list[int]] = [[] for _ in range(world_size)]
    loads = [0] * world_size
    for index in sorted(range(len(tokens)), key=lambda i: (-tokens[i], i)):
        rank = min((r for r in range(world_size) if len(shares[r]) < cap), key=lambda r: (loads[r], r))
        shares[rank].append(index)
        loads[rank] += tokens[index]
    return [sorted(share) for share in shares]
