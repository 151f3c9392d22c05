"""LoopWaits: a waiting coroutine attempts again after every change, gives up at its deadline, and leaves
nothing behind when its caller goes away."""
from __future__ import annotations

import asyncio
from typing import Optional

from coda_server.core.waiting import LoopWaits


class CountingPoll:
    """Answers once `ready` is set; counts its attempts."""

    def __init__(self) -> None:
        self.ready = False
        self.attempts = 0

    def attempt(self) -> Optional[str]:
        self.attempts += 1
        return "answered" if self.ready else None

    def give_up(self) -> str:
        return "gave up"


def test_every_waiter_is_answered_after_the_change_that_lets_it() -> None:
    async def run() -> tuple[list[str], int]:
        waits = LoopWaits(lambda: False, max_wait_seconds=60)
        polls = [CountingPoll() for _ in range(5)]
        tasks = [asyncio.ensure_future(waits.until(poll, 30)) for poll in polls]
        while waits.waiting_calls < len(polls):
            await asyncio.sleep(0)
        waits.wake_all()  # a change that answers nobody: each attempts once more and waits again
        while waits.waiting_calls < len(polls) or any(poll.attempts < 3 for poll in polls):
            await asyncio.sleep(0)
        for poll in polls:
            poll.ready = True
        waits.wake_all()
        answers = await asyncio.wait_for(asyncio.gather(*tasks), 10)
        return answers, waits.waiting_calls

    answers, still_waiting = asyncio.run(run())
    assert answers == ["answered"] * 5 and still_waiting == 0


def test_a_wait_without_a_change_gives_up_at_its_deadline() -> None:
    async def run() -> tuple[str, bool]:
        waits = LoopWaits(lambda: False, max_wait_seconds=60)
        answer = await asyncio.wait_for(waits.until(CountingPoll(), 0.05), 10)
        return answer, waits.anyone_waiting

    assert asyncio.run(run()) == ("gave up", False)


def test_a_cancelled_wait_leaves_no_waiter_behind() -> None:
    async def run() -> tuple[bool, bool, int]:
        waits = LoopWaits(lambda: False, max_wait_seconds=60)
        task = asyncio.ensure_future(waits.until(CountingPoll(), 30))
        while not waits.waiting_calls:
            await asyncio.sleep(0)
        registered = waits.anyone_waiting
        task.cancel()
        try:
            await task
        except asyncio.CancelledError:
            pass
        # Nobody waits any more, so a change has nobody to wake (AsyncPacer skips scheduling the wake-up).
        return registered, waits.anyone_waiting, waits.waiting_calls

    assert asyncio.run(run()) == (True, False, 0)
