"""The three built-in sliding-window strategies: no-window, window-gated and windowed-fifo."""
from __future__ import annotations

from typing import Any, Iterable, Mapping, Sequence

from .strategy import SlidingWindowStrategy, register_sliding_window_strategy, window_size


class NotInWindowError(RuntimeError, KeyError):
    """A hook named a prompt the strategy does not have in flight: a RuntimeError, as LoongSage raises it, and
    a KeyError, as this server raised it before (so either `except` keeps working)."""

    __str__ = RuntimeError.__str__  # the message as written, not quoted like a KeyError's


class InflightSeqs:
    """Dispatch sequence numbers of in-flight prompts, with the oldest found in amortized O(1).

    Seqs are handed out in increasing order, so dispatch order is seq order: the prompt ids are kept in a
    list in that order (the id at position i has seq `_first_seq + i`), and collected ones are skipped
    lazily from the front: no heap, and no tuple per prompt.
    """

    # Positions skipped at the front of the order list are cut off once there are this many and they are
    # at least half of it, so the list stays proportional to what is in flight.
    COMPACT_AFTER = 1024

    def __init__(self) -> None:
        self.next_seq = 0
        self._seq_of: dict[str, int] = {}
        self._order: list[str] = []  # prompt ids by seq, from _first_seq on; entries before _head are gone
        self._first_seq = 0
        self._head = 0

    def add_all(self, prompt_ids: Iterable[str]) -> None:
        """Newly dispatched prompts, in dispatch order; each gets the next seq."""
        seq, seq_of, order = self.next_seq, self._seq_of, self._order
        for prompt_id in prompt_ids:  # a plain loop: in CPython it beats dict.update(zip(...)) here
            seq_of[prompt_id] = seq
            order.append(prompt_id)
            seq += 1
        self.next_seq = seq

    def seq_of(self, prompt_id: str) -> int:
        try:
            return self._seq_of[prompt_id]
        except KeyError:
            raise NotInWindowError(f"group: {prompt_id!r} is not in window mapping: it is not in flight for "
                                   f"this strategy (check the order of hook calls)") from None

    def remove(self, prompt_id: str) -> None:
        self.seq_of(prompt_id)  # unknown prompt is an error, before anything changes
        del self._seq_of[prompt_id]

    def min_seq(self) -> int:
        """Oldest in-flight seq, or `next_seq` when nothing is in flight."""
        order, seq_of, head, first = self._order, self._seq_of, self._head, self._first_seq
        # A position is gone when its prompt was collected (and maybe dispatched again under a later seq).
        while head < len(order) and seq_of.get(order[head]) != first + head:
            head += 1
        if head >= self.COMPACT_AFTER and 2 * head >= len(order):
            del order[:head]
            self._first_seq = first = first + head
            head = 0
        self._head = head
        return first + head if head < len(order) else self.next_seq

    def clear(self) -> None:
        self._seq_of.clear()
        self._order.clear()
        self._first_seq, self._head = self.next_seq, 0


class _WindowStrategy(SlidingWindowStrategy):
    """Shared parts: capacity C, batch size B, and the in-flight seq tracker."""

    bounded_by_window = True  # admits at most C - R - Q

    def __init__(self, config: Any):
        super().__init__(config)
        self._batch_size = int(config.data_sources[0].num_prompts_per_step)
        self._capacity = window_size(config)
        self._seqs = InflightSeqs()

    dispatched_ids_only = True  # on_dispatched reads each group's prompt_id

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
    bounded_by_window = True  # admits at most C - R - Q

    def __init__(self, config: Any):
        super().__init__(config)
        self._capacity = window_size(config)

    def compute_dispatch_count(self, buf_qsize: int) -> int:
        free = self._capacity - self._running_count - buf_qsize
        return free if free > 0 else 0  # not max(0, ...): asked on every Dispatch, and max() parses keywords


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

    compute_dispatch_count = NoWindowStrategy.compute_dispatch_count  # max(0, C - R - Q), one definition

    def will_collect(self, group: Mapping[str, Any]) -> bool:
        if not super().will_collect(group):
            return False
        prompt_id = next(iter(group.values())).prompt_id
        return self._seqs.seq_of(prompt_id) - self._seqs.min_seq() < self._batch_size
