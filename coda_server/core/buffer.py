"""The pipeline buffer: complete groups waiting for the trainer, taken in priority order (a heap of (priority, group))."""
from __future__ import annotations

import heapq
from typing import Iterable, Iterator, Optional, Sequence

from .errors import MessageTooLargeError
from .inflight import ANSWER_OVERHEAD_BYTES, encoded_group_bound
from .types import TrajectoryGroup

Entry = tuple  # (priority, TrajectoryGroup)


class PipelineBuffer:
    """Complete groups by priority. `entries` is the heap itself, for reading only (strategies' BufferView,
    token-budget counting); every change goes through the methods, which keep it a heap."""

    __slots__ = ("entries",)

    def __init__(self) -> None:
        self.entries: list[Entry] = []

    def __len__(self) -> int:
        return len(self.entries)

    def __iter__(self) -> Iterator[Entry]:
        """The entries in heap (not priority) order."""
        return iter(self.entries)

    def push(self, entry: Entry) -> None:
        heapq.heappush(self.entries, entry)

    def push_all(self, entries: Iterable[Entry]) -> None:
        for entry in entries:
            heapq.heappush(self.entries, entry)

    def pop(self, count: int) -> list[Entry]:
        """The first `count` entries, oldest priority first (the buffer holds at least that many)."""
        return [heapq.heappop(self.entries) for _ in range(count)]

    def pop_fitting(self, count: int, limit: int) -> list[Entry]:
        """Up to `count` entries, oldest priority first, while their answer stays within `limit` bytes (0: no
        limit); the first alone over it is put back and refused (MessageTooLargeError)."""
        taken: list[Entry] = []
        size = ANSWER_OVERHEAD_BYTES
        entries = self.entries
        while len(taken) < count:
            entry = heapq.heappop(entries)
            group_size = encoded_group_bound(entry[1])
            if limit and size + group_size > limit:
                heapq.heappush(entries, entry)
                if not taken:
                    raise MessageTooLargeError(entry[1].prompt_id, group_size + ANSWER_OVERHEAD_BYTES, limit)
                break
            size += group_size
            taken.append(entry)
        return taken

    def take_exact(self, priorities: Sequence[tuple]) -> Optional[list[Entry]]:
        """The entries of exactly these priorities, in this order, taken out; None (nothing taken) when one of them
        is not here. Scans the buffer: for a lease given back to its holder (leases.py), not for every Collect."""
        wanted = set(priorities)
        found = {entry[0]: entry for entry in self.entries if entry[0] in wanted}
        if len(found) < len(wanted):
            return None
        self.replace(entry for entry in self.entries if entry[0] not in wanted)
        return [found[priority] for priority in priorities]

    def groups(self) -> list[TrajectoryGroup]:
        """The buffered groups, in heap (not priority) order."""
        return [group for _, group in self.entries]

    def replace(self, entries: Iterable[Entry]) -> None:
        """Hold exactly these entries (a snapshot's or a checkpoint's)."""
        self.entries = list(entries)
        heapq.heapify(self.entries)

    def export(self) -> list[Entry]:
        return list(self.entries)
