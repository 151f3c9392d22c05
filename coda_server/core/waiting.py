"""Waiting, kept apart from the pacing rule: a long-poll is a `Poll` (the rule's side), run by a waiter (this side).

The Pacer says once, per operation, when a call can be answered (`Poll.attempt`) and what it answers
when the wait ends unanswered (`Poll.give_up`). How a caller waits is the waiter's business: a thread
blocks on a condition of the pacer's lock (`ThreadWaits`, for in-process callers: tests, the simulator,
embedding without a network), a coroutine awaits a future (`LoopWaits`, for the asyncio server). Both run
every poll the same way: attempt now; then, until the deadline or the pacer closes, attempt again after
every change (`LoopWaits`: every change that could answer it, when the poll can tell); then give up.
"""
from __future__ import annotations

import asyncio
import threading
import time
from typing import Callable, Optional, Protocol, TypeVar

R = TypeVar("R")
R_co = TypeVar("R_co", covariant=True)


class Poll(Protocol[R_co]):
    """One waiting call, as the rule sees it. A poll may also offer `could_answer() -> bool`: cheap, changing
    nothing, False only when `attempt` would surely give None now; LoopWaits then leaves its waiter asleep through
    a change that cannot answer it (see `LoopWaits.wake_answerable`)."""

    def attempt(self) -> Optional[R_co]:
        """The answer if the call can be answered now, else None (not yet). Takes the pacer lock itself."""

    def give_up(self) -> R_co:
        """The answer when the wait ends unanswered: the deadline passed or the pacer closed."""


class ThreadWaits:
    """Blocking waits for in-process callers: a condition of the pacer's lock, which a wait releases."""

    def __init__(self, lock: threading.RLock, clock: Callable[[], float], closed: Callable[[], bool]):
        self._changed = threading.Condition(lock)
        self._clock = clock
        self._closed = closed
        self.blocked = 0  # threads waiting now: the pacer skips the wake-up when there are none
        # Called (holding the lock) each time a thread starts waiting; a public hook for tests and tracing.
        self.on_block: Optional[Callable[[], None]] = None

    def wake_all(self) -> None:
        self._changed.notify_all()

    def until(self, poll: Poll[R], wait: float) -> R:
        result = poll.attempt()
        if result is not None:
            return result
        if wait <= 0:
            return poll.give_up()
        deadline = self._clock() + wait
        with self._changed:
            while not self._closed():
                result = poll.attempt()  # again under the lock: a change since the first attempt is seen
                if result is not None:
                    return result
                remaining = deadline - self._clock()
                if remaining <= 0:
                    break
                self.blocked += 1
                try:
                    if self.on_block is not None:
                        self.on_block()
                    self._changed.wait(remaining)
                finally:
                    self.blocked -= 1
            return poll.give_up()


class LoopWaits:
    """Waits for coroutines on one event loop: each awaits the next change, for at most max_wait_seconds.

    How many may wait at once is admission's business (coda_server/admission.py limits waiting Dispatches
    and Collects apart), not the core's: this only counts them (`waiting_calls`, for GetState).
    """

    def __init__(self, closed: Callable[[], bool], max_wait_seconds: float):
        self._closed = closed
        self.max_wait_seconds = max_wait_seconds
        # One future per waiter, each with a timer of its own: the next change sets them all. (A future shared
        # by every waiter, awaited through asyncio.wait for its timeout, cost each waiter a set, a waiter
        # future, callbacks and a timer on every change: half of a waiting Collect's time with eight writers.)
        # Each waiter's future maps to its poll's could_answer (None: woken by every change).
        self._waiters: dict[asyncio.Future, Optional[Callable[[], bool]]] = {}
        self._pass_scheduled = False
        self.waiting_calls = 0

    @property
    def anyone_waiting(self) -> bool:
        return bool(self._waiters)

    def wake_all(self) -> None:
        """Every waiter attempts again; call on the loop's thread."""
        waiters, self._waiters = self._waiters, {}
        for waiter in waiters:
            _wake(waiter)

    def wake_answerable(self) -> None:
        """After a change: every waiter whose poll could be answered now attempts again, once the change under way
        is complete (the next turn of the loop, so it sees the pacer's state whole, and several changes in a row
        cost one pass); call on the loop's thread. A waiter woken by every change costs a task switch, a future
        and a timer each time: 64 data-parallel ranks waiting for their shares, each Submit woke all 64."""
        if self._pass_scheduled:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # a change made outside the running loop (its thread, the loop stopped): as wake_all
            self.wake_all()
            return
        self._pass_scheduled = True
        loop.call_soon(self._wake_answerable)

    def _wake_answerable(self) -> None:
        self._pass_scheduled = False
        waiters, self._waiters = self._waiters, {}
        closed = self._closed()
        for waiter, could_answer in waiters.items():
            if closed or could_answer is None or _could_answer(could_answer):
                _wake(waiter)
            else:
                self._waiters[waiter] = could_answer  # nothing for it yet: left asleep

    def clamp(self, wait: float) -> float:
        return min(max(0.0, float(wait)), self.max_wait_seconds)

    @staticmethod
    def now(poll: Poll[R]) -> R:
        """`until(poll, 0)` without a coroutine: the answer of a call that does not wait."""
        result = poll.attempt()
        return result if result is not None else poll.give_up()

    async def until(self, poll: Poll[R], wait: float) -> R:
        """As ThreadWaits.until, for at most max_wait_seconds."""
        result = poll.attempt()
        if result is not None or wait <= 0:
            return result if result is not None else poll.give_up()
        loop = asyncio.get_running_loop()
        # Timed on time.monotonic (the pacer clock's source), not loop.time(): uvloop's reads in whole milliseconds,
        # behind the monotonic clock by a varying fraction of one, so a wait timed by it could end up to a
        # millisecond before `wait` had passed (a Reset's pause_delay under its abort_wait_seconds). A timer that
        # fires early only makes the wait go round again, for what is left.
        deadline = time.monotonic() + self.clamp(wait)
        could_answer = getattr(poll, "could_answer", None)
        while True:
            waiter = loop.create_future()
            self._waiters[waiter] = could_answer  # before the attempt, so no wake-up is lost
            try:
                if self._closed():
                    return poll.give_up()
                result = poll.attempt()
                if result is not None:
                    return result
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return poll.give_up()
                self.waiting_calls += 1
                timer = loop.call_later(remaining, _wake, waiter)
                try:
                    await waiter
                finally:
                    timer.cancel()
                    self.waiting_calls -= 1
            finally:
                self._waiters.pop(waiter, None)


def _wake(waiter: asyncio.Future) -> None:
    if not waiter.done():
        waiter.set_result(None)


def _could_answer(could_answer: Callable[[], bool]) -> bool:
    try:
        return bool(could_answer())
    except Exception:  # woken: its attempt raises again, and the call answers with the error
        return True
