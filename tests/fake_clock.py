"""A clock the test moves by hand (`clock.now += 31`), for a Pacer built with `clock=`."""
from __future__ import annotations


class FakeClock:
    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now
