"""The in-flight group (a dispatched prompt assembling its trajectories) and the step tally of what the trainer took."""
from __future__ import annotations

import math
from typing import Iterable

from .prompt_ids import loongsage_order
from .types import PromptRef, StepReport, Trajectory, TrajectoryGroup, TrajectoryStatus

_NO_PRIORITY = float("inf")
_NO_ARRIVAL = 1 << 62  # no trajectory yet


class InflightGroup:
    """A dispatched group that has not left the trajectory queue; handed to strategy hooks."""

    __slots__ = ("prompt_id", "ds_index", "epoch", "index", "seq", "group_size", "trajectories", "deadline",
                 "dispatched_at", "held", "client_id", "arrival")

    def __init__(self, ref: PromptRef, seq: int, group_size: int, now: float, client_id: str = ""):
        self.prompt_id = ref.prompt_id
        self.ds_index = ref.ds_index
        self.epoch = ref.epoch
        self.index = ref.index
        self.seq = seq
        self.group_size = group_size
        self.trajectories: dict[str, Trajectory] = {}
        self.dispatched_at = now
        self.held = False  # complete, but the strategy's will_collect refused it so far
        self.deadline = math.inf  # when its in-flight lease runs out (extended by every Submit for it)
        self.client_id = client_id  # who dispatched it (x-coda-client-id; "" when the caller sent none)
        self.arrival = _NO_ARRIVAL  # order of its first trajectory's arrival in this generation (Reset order)

    @property
    def complete(self) -> bool:
        return len(self.trajectories) >= self.group_size

    def priority(self) -> tuple:
        """Buffer order: the prompt's (epoch, index) when the dispatcher gave both; else (E, N) read from a
        LoongSage-form prompt id `epoch{E}_..._prompt{N}`, as LoongSage's buffer orders; else dispatch seq."""
        if self.epoch is not None and self.index is not None:
            return (self.epoch, self.index, self.seq)
        order = loongsage_order(self.prompt_id)
        if order is not None:
            return (order[0], order[1], self.seq)
        return (_NO_PRIORITY, _NO_PRIORITY, self.seq)

    def to_group(self) -> TrajectoryGroup:
        return TrajectoryGroup(self.prompt_id, self.seq, self.ds_index, list(self.trajectories.values()),
                               self.epoch, self.index, self.dispatched_at)


class DispatchedGroup:
    """A group as `on_dispatched` sees it, in LoongSage's form: its ids and, in `trajectories`, the N pending
    trajectories of a new group (status UNSPECIFIED, LoongSage's PENDING; trajectory_id "" as the worker names
    them) or the trajectories a continued group brings back. Built when asked for: a strategy that reads
    only `prompt_id` and `seq`, as the built-ins do, costs one small object per group."""

    __slots__ = ("prompt_id", "seq", "ds_index", "epoch", "index", "group_size", "dispatched_at", "_brought")

    def __init__(self, group: InflightGroup, brought: "list[Trajectory] | None" = None):
        self.prompt_id = group.prompt_id
        self.seq = group.seq
        self.ds_index = group.ds_index
        self.epoch = group.epoch
        self.index = group.index
        self.group_size = group.group_size
        self.dispatched_at = group.dispatched_at
        self._brought = brought

    @property
    def trajectories(self) -> list[Trajectory]:
        if self._brought is not None:
            return list(self._brought)
        return [Trajectory("", self.prompt_id, self.ds_index, TrajectoryStatus.UNSPECIFIED)
                for _ in range(self.group_size)]


class StepTally:
    """What the trainer took since the last Reset, for the step report."""

    def __init__(self) -> None:
        self.trajectories = 0
        self.partial = 0
        self.span_max = 0
        self.filtered = 0

    def count_consumed(self, group: TrajectoryGroup) -> None:
        for t in group.trajectories:
            span = t.end_weight_version - t.start_weight_version
            self.trajectories += 1
            if span != 0:
                self.partial += 1
            self.span_max = max(self.span_max, span)

    def report(self, step: int, buffered: int, restored: list[TrajectoryGroup], dropped: list[InflightGroup],
               pause_delay: float) -> StepReport:
        """The step report a Reset closes the step with; restored and dropped are counted in trajectories, as
        LoongSage's partial_restored_count / partial_dropped_incomplete_count are, and in groups."""
        return StepReport(
            step=step,
            pipeline_buf_size=buffered,
            filter_drop=self.filtered,
            partial_ratio=(self.partial / self.trajectories) if self.trajectories else 0.0,
            partial_span_max=self.span_max,
            partial_restored_count=sum(len(group.trajectories) for group in restored),
            partial_dropped_incomplete_count=sum(len(group.trajectories) for group in dropped),
            pause_delay=pause_delay,
            partial_restored_group_count=len(restored),
            partial_dropped_incomplete_group_count=len(dropped),
        )


def bytes_of(trajectories: Iterable[Trajectory]) -> int:
    return sum(t.size_bytes for t in trajectories)


# Framing a length-delimited field adds at most a 1-byte tag (field numbers below 16) and a 5-byte length.
_FIELD_FRAMING_BYTES = 6
# A group's header fields besides its prompt id: seq, ds_index, epoch, index (tags and varints, at most).
_GROUP_HEADER_BYTES = 48
# An answer's fields besides its groups (timed_out, cut_to_fit, a lease id of at most 128 characters).
ANSWER_OVERHEAD_BYTES = 160


def encoded_group_bound(group: TrajectoryGroup) -> int:
    """An upper bound on the bytes a group adds to an answer (its trajectories are held at their encoded size)."""
    return (_FIELD_FRAMING_BYTES + _GROUP_HEADER_BYTES + _FIELD_FRAMING_BYTES + len(group.prompt_id.encode())
            + sum(t.size_bytes + _FIELD_FRAMING_BYTES for t in group.trajectories))
