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

    __slots__ = ("now",)

    def __init__(self, source: Callable[[], float] = time.monotonic):
        self.now = source  # the reading: `clock.now()` costs no Python frame outside a replay

    def __call__(self) -> float:
        return self.now()

    @contextmanager
    def pinned(self, at: float) -> Iterator[None]:
        """Within the block the clock reads `at`; nesting restores the outer reading on exit."""
        outer = self.now
        self.now = lambda: at
        try:
            yield
        finally:
            self.now = outer
