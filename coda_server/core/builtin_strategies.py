"""The three built-in sliding-window strategies: no-window, window-gated and windowed-fifo."""
from __future__ import annotations

import heapq
from typing import Any, Iterable, Mapping, Sequence

from .strategy import SlidingWindowStrategy, register_sliding_window_strategy, window_size


class InflightSeqs:
    """Dispatch sequence numbers of in-flight prompts, with the oldest found in O(log n).

    A min-heap with lazy deletion: collected entries stay in the heap until they reach the top.
    """

    def __init__(self) -> None:
        self.next_seq = 0
        self._seq_of: dict[str, int] = {}
        self._heap: list[tuple[int, str]] = []

    def add_all(self, prompt_ids: Iterable[str]) -> None:
        """Newly dispatched prompts, in dispatch order; each gets the next seq."""
        seq, seq_of, heap = self.next_seq, self._seq_of, self._heap
        for prompt_id in prompt_ids:
            seq_of[prompt_id] = seq
            heapq.heappush(heap, (seq, prompt_id))
            seq += 1
        self.next_seq = seq

    def seq_of(self, prompt_id: str) -> int:
        try:
            return self._seq_of[prompt_id]
        except KeyError:
            raise KeyError(f"unknown prompt {prompt_id!r}: it is not in flight for this strategy") from None

    def remove(self, prompt_id: str) -> None:
        self.seq_of(prompt_id)  # unknown prompt is an error, before anything changes
        del self._seq_of[prompt_id]

    def min_seq(self) -> int:
        """Oldest in-flight seq, or `next_seq` when nothing is in flight."""
        heap = self._heap
        while heap and self._seq_of.get(heap[0][1]) != heap[0][0]:
            heapq.heappop(heap)
        return heap[0][0] if heap else self.next_seq

    def clear(self) -> None:
        self._seq_of.clear()
        self._heap.clear()


class _WindowStrategy(SlidingWindowStrategy):
    """Shared parts: capacity C, batch size B, and the in-flight seq tracker."""

    def __init__(self, config: Any):
        super().__init__(config)
        self._batch_size = int(config.data_sources[0].num_prompts_per_step)
        self._capacity = window_size(config)
        self._seqs = InflightSeqs()

    def on_dispatched(self, groups: Sequence[Any]) -> None:
        self._seqs.add_all([group.prompt_id for group in groups])
        super().on_dispatched(groups)

    def on_collected(self, prompt_id: str) -> None:
        self._seqs.remove(prompt_id)
        super().on_collected(prompt_id)

    def on_reset(self) -> None:
        self._seqs.clear()
        super().on_reset()

    def _free_slots(self, buf_qsize: int) -> int:
        return self._capacity - self._running_count - buf_qsize


@register_sliding_window_strategy("no-window")
class NoWindowStrategy(SlidingWindowStrategy):
    """Keep C groups running or buffered; collect any complete, non-aborted group."""

    ordered_gate = True  # refuses aborted groups; otherwise opens oldest-first

    def __init__(self, config: Any):
        super().__init__(config)
        self._capacity = window_size(config)

    def compute_dispatch_count(self, buf_qsize: int) -> int:
        return max(0, self._capacity - self._running_count - buf_qsize)


@register_sliding_window_strategy("window-gated")
class WindowGatedStrategy(_WindowStrategy):
    """Never let the newest dispatched seq run more than C ahead of the oldest uncollected one."""

    ordered_gate = True  # refuses aborted groups; otherwise opens oldest-first

    def compute_dispatch_count(self, buf_qsize: int) -> int:
        span_left = self._seqs.min_seq() + self._capacity - self._seqs.next_seq
        return min(span_left, self._free_slots(buf_qsize))


@register_sliding_window_strategy("windowed-fifo")
class WindowedFifoStrategy(_WindowStrategy):
    """Dispatch like no-window; collect only groups within B seqs of the oldest in-flight one."""

    ordered_gate = True  # refuses aborted groups; otherwise opens oldest-first

    def compute_dispatch_count(self, buf_qsize: int) -> int:
        return max(0, self._free_slots(buf_qsize))

    def will_collect(self, group: Mapping[str, Any]) -> bool:
        if not super().will_collect(group):
            return False
        prompt_id = next(iter(group.values())).prompt_id
        return self._seqs.seq_of(prompt_id) - self._seqs.min_seq() < self._batch_size
