"""Delivery to the trainer: buffered groups handed out (at once, leased, or as ranks' shares), Acked, consumed."""
from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

from .answers import AnswerBook
from .buffer import PipelineBuffer
from .errors import MessageTooLargeError
from .incidents import HOOK_FAILED, HookFailures, describe_exception
from .inflight import ANSWER_OVERHEAD_BYTES, HeldBytes, InflightTable, encoded_group_bound
from .leases import CollectLease, Leases
from .limits import Limits
from .shares import BatchShape, balanced_shares, budget_count, group_tokens
from .signals import Signals
from .steps import StepBoundary
from .types import CollectResult, TrajectoryGroup


class Delivery:
    """Takes groups from the buffer for a Collect (whole mini-batches, within the answer's byte limit), leases
    them or splits them into ranks' shares, and, once the trainer has them for good (a Collect without lease,
    an Ack), counts them consumed and lets their bodies go. Its callers hold the pacer's lock."""

    def __init__(self, buffer: PipelineBuffer, leases: Leases, inflight: InflightTable, steps: StepBoundary,
                 held_bytes: HeldBytes, totals: dict, answers: AnswerBook, signals: Signals, failures: HookFailures,
                 limits: Limits, on_consumed: Optional[Callable[[list[TrajectoryGroup]], Any]], buffer_bound: int = 0):
        self._buffer, self._leases, self._inflight, self._steps = buffer, leases, inflight, steps
        self._held_bytes, self._totals, self._answers, self._signals = held_bytes, totals, answers, signals
        self._failures, self._limits = failures, limits
        self._on_consumed = on_consumed  # the strategy's optional hook, None when it does not define one
        # The most groups the buffer can ever hold (CollectLimit.limit; 0: no bound known): a token budget the buffer
        # cannot reach even when full takes what a full buffer holds instead of waiting for ever.
        self._buffer_bound = buffer_bound

    def ready_count(self, num_groups: int, shape: BatchShape, partial: bool = False) -> Optional[int]:
        """Groups the next Collect of this shape takes from the buffer now (0: a rank's share of a mini-batch
        already taken is waiting), or None when it is not ready; with `partial`, what is there at a deadline."""
        if shape.world_size > 1 and self._leases.claimable(shape.key(num_groups), shape.rank):
            return 0
        entries = self._buffer.entries
        available = len(entries)
        if shape.token_budget:
            most = min(num_groups, self._buffer_bound) if self._buffer_bound else num_groups
            count = budget_count(entries, shape.token_budget, most, shape.world_size)
            return count if count is not None or not partial or available < shape.world_size else available
        if available >= num_groups:
            return num_groups
        return available if partial and available >= shape.world_size else None

    def take(self, count: int, timed_out: bool, lease_seconds: float, shape: BatchShape, num_groups: int,
             max_bytes: int, now: float, split: Sequence[int] = (), holder: str = ""
             ) -> tuple[CollectResult, int, tuple[int, ...]]:
        """The answer handing `count` groups to the trainer, how many it took (fewer when cut to fit), and, when it
        took a new data-parallel mini-batch, each group's rank in the order taken (else empty). `split`: the ranks
        a journal recorded for that mini-batch (replay), used instead of splitting it again. `holder`: the client
        whose silence ends the lease too (see Leases)."""
        limit = self._limits.answer_bytes(max_bytes)
        if shape.world_size > 1:
            key = shape.key(num_groups)
            others = self._leases.waiting_shapes(key) if count else ()  # only when a new mini-batch is taken
            lease, split = self._take_share(count, lease_seconds, key, shape, now, limit, split, holder)
            return CollectResult([group for _, group in lease.entries], timed_out=timed_out,
                                 lease_id=lease.lease_id, other_shapes_waiting=others), count, split
        entries = self._buffer.pop_fitting(count, limit)
        cut_to_fit, count = len(entries) < count, len(entries)
        if lease_seconds > 0:
            lease = self._leases.grant(entries, lease_seconds, now, holder)
            self._signals.notify()
            return CollectResult([group for _, group in lease.entries], timed_out=timed_out, lease_id=lease.lease_id,
                                 cut_to_fit=cut_to_fit), count, ()
        groups = [group for _, group in entries]
        self.consume(groups, now)
        return CollectResult(groups, timed_out=timed_out, cut_to_fit=cut_to_fit), count, ()

    def _take_share(self, count: int, lease_seconds: float, key: tuple, shape: BatchShape, now: float,
                    limit: int = 0, split: Sequence[int] = (), holder: str = "") -> tuple[CollectLease, tuple[int, ...]]:
        if not count:
            lease = self._leases.claim(key, shape.rank, now, holder)
            if lease is None:
                raise RuntimeError("recovery diverged: no share of a data-parallel mini-batch waits for this rank")
            return lease, ()
        if split and (len(split) != count or not all(0 <= rank < shape.world_size for rank in split)):
            raise RuntimeError(f"recovery diverged: the journal splits a mini-batch of {count} groups over "
                               f"{shape.world_size} ranks as {tuple(split)}")
        entries = self._buffer.pop(count)
        if split:
            shares = [[i for i, rank in enumerate(split) if rank == r] for r in range(shape.world_size)]
        else:
            shares = balanced_shares([group_tokens(group) for _, group in entries], shape.world_size,
                                     equal_counts=not shape.token_budget)
        if limit:  # every rank's share must reach it: refused, nothing taken, when one would not fit
            sizes = [ANSWER_OVERHEAD_BYTES + sum(encoded_group_bound(entries[i][1]) for i in share) for share in shares]
            if max(sizes) > limit:
                self._buffer.push_all(entries)
                largest = shares[sizes.index(max(sizes))]
                raise MessageTooLargeError(f"a rank's share ({len(largest)} groups, from "
                                           f"{entries[largest[0]][1].prompt_id})", max(sizes), limit)
        lease = self._leases.grant_shares(key, [[entries[i] for i in share] for share in shares], shape.rank,
                                          lease_seconds, now, holder, shape.run)
        self._signals.notify()
        ranks = [0] * count
        for rank, share in enumerate(shares):
            for i in share:
                ranks[i] = rank
        return lease, tuple(ranks)

    def ack(self, lease_id: str, now: float) -> int:
        """The trainer has the leased groups: they are consumed. Returns how many."""
        lease = self._leases.acknowledge(lease_id)
        self.consume([group for _, group in lease.entries], now)
        # The caller has the answer it acknowledges: a retry of that Collect cannot come any more, and a
        # remembered answer would keep the consumed trajectories alive.
        self._answers.forget("Collect", lambda answer: answer.lease_id == lease_id)
        return len(lease.entries)

    def reclaim(self, holder: str, now: float, claimed: Sequence[tuple]) -> tuple[list[tuple], list[str]]:
        """Leases of `holder` that ended with its silence, claimed back by it (`Leases.claimed`, or a replay's
        journal): each one whose groups all still wait in the buffer is its again (same lease id, its full time from
        `now`). Returns (those given back, as claimed, for the journal; the ids of those whose groups went elsewhere
        meanwhile)."""
        reclaimed, missed = [], []
        for lease_id, seconds, priorities in claimed:
            entries = self._buffer.take_exact(priorities)
            if entries is None:
                missed.append(lease_id)
                continue
            self._leases.regrant(lease_id, entries, seconds, now, holder)
            self._totals["reclaimed"] += len(entries)
            reclaimed.append((lease_id, seconds, priorities))
        if reclaimed:
            self._signals.notify()  # fewer groups buffered: a strategy counting them may admit a waiting Dispatch
        return reclaimed, missed

    def consume(self, groups: list[TrajectoryGroup], now: float) -> None:
        """The trainer has these groups for good: count them, free their bytes (the pacer keeps only each
        trajectory's content key, for duplicate detection), tell listeners."""
        if self._on_consumed is not None:
            try:
                self._on_consumed(groups)
            except Exception as exc:  # reported; the trainer has the groups all the same
                self._failures.incident(HOOK_FAILED, "", "on_consumed", describe_exception(exc), "consumed")
        self._totals["consumed"] += len(groups)
        tally, held_bytes = self._steps.tally, self._held_bytes
        for group in groups:
            tally.count_consumed(group)
            held_bytes.release(group.trajectories)
        self._inflight.left([trajectory for group in groups for trajectory in group.trajectories])
        signals = self._signals
        if signals.hears_consumed:
            signals.consumed(groups, self._steps.weight_version, now)
        signals.notify()
