"""The pacer's clock: the time every change is stamped with, pinned to a recorded time while a change is replayed."""
from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Callable, Iterator


class PacerClock:
    """Reads `source` (time.monotonic by default); inside `pinned(at)` reads `at`, as the replayed call saw it.

    Callable: `clock()` is the time now. Strategies, the restored groups and the waits read it through, so
    a replay pins them all at once.
    """

    __slots__ = ("_source", "_now")

    def __init__(self, source: Callable[[], float] = time.monotonic):
        self._source = source
        self._now = source

    def __call__(self) -> float:
        return self._now()

    @contextmanager
    def pinned(self, at: float) -> Iterator[None]:
        """Within the block the clock reads `at`; nesting restores the outer reading on exit."""
        outer = self._now
        self._now = lambda: at
        try:
            yield
        finally:
            self._now = outer
