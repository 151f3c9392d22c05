"""LoopWaits: a waiting coroutine attempts again after every change that could answer it, gives up at its
deadline, and leaves nothing behind when its caller goes away."""
from __future__ import annotations

import asyncio
import random
import time
from typing import Optional

import pytest

from coda_server import event_loop
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


class TimedPoll(CountingPoll):
    """Notes when it is first attempted: the moment a Reset stamps its pause on the pacer's clock, then waits."""

    started: float = 0.0

    def attempt(self) -> Optional[str]:
        if not self.attempts:
            self.started = time.monotonic()
        return super().attempt()


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_a_wait_never_ends_before_its_time_has_passed(loop) -> None:
    """uvloop's clock reads in whole milliseconds, behind the monotonic clock by a varying fraction of one: a wait
    timed by it could end up to a millisecond early (a few waits in a hundred, started at random points of a
    millisecond). Timed on the monotonic clock, none does: a Reset's pause_delay is never under its
    abort_wait_seconds."""
    if loop == "uvloop" and event_loop._uvloop() is None:
        pytest.skip("uvloop is not installed (the server extra brings it)")
    phases = random.Random(7)
    waits_made = 200

    async def run() -> list[float]:
        waits = LoopWaits(lambda: False, max_wait_seconds=60)
        shortfalls = []
        for _ in range(waits_made):
            spin_until = time.perf_counter() + phases.random() / 1000  # start at a random point of a millisecond
            while time.perf_counter() < spin_until:
                pass
            poll = TimedPoll()
            assert await waits.until(poll, 0.002) == "gave up"
            shortfalls.append(0.002 - (time.monotonic() - poll.started))
        return shortfalls

    early = [s for s in event_loop.run(run(), event_loop.loop_factory(loop)) if s > 0]
    assert not early, f"{len(early)} of {waits_made} waits ended early, by up to {max(early) * 1e6:.0f} us"


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


class SelectivePoll(CountingPoll):
    """A CountingPoll that also says whether it could be answered now (the waiter sleeps through other changes)."""

    def __init__(self, raises: bool = False) -> None:
        super().__init__()
        self.raises = raises

    def could_answer(self) -> bool:
        if self.raises:
            raise RuntimeError("a broken could_answer")
        return self.ready


async def _all_waiting(waits: LoopWaits, count: int) -> None:
    while waits.waiting_calls < count:
        await asyncio.sleep(0)


async def _attempted_again(poll: CountingPoll, attempts: int) -> None:
    while poll.attempts == attempts:
        await asyncio.sleep(0)


async def _error_of(call: "asyncio.Future") -> str:
    """The error a waiting call answers with, within 10 s (not at its deadline)."""
    from coda_server.core.errors import PacerError

    try:
        await asyncio.wait_for(call, 10)
    except PacerError as exc:
        return str(exc)
    return "answered without an error"


async def _turns(count: int = 5) -> None:
    for _ in range(count):
        await asyncio.sleep(0)


def test_a_change_wakes_only_the_waiters_it_could_answer() -> None:
    async def run() -> tuple[list[int], list[int], str, list[str]]:
        waits = LoopWaits(lambda: False, max_wait_seconds=60)
        polls = [SelectivePoll() for _ in range(3)]
        plain = CountingPoll()  # offers no could_answer: woken by every change, as before
        tasks = [asyncio.ensure_future(waits.until(poll, 30)) for poll in [*polls, plain]]
        await _all_waiting(waits, 4)
        before = [poll.attempts for poll in [*polls, plain]]
        waits.wake_answerable()
        await _turns()
        await _all_waiting(waits, 4)
        after_nothing = [poll.attempts for poll in [*polls, plain]]
        polls[1].ready = True
        waits.wake_answerable()
        answered = await asyncio.wait_for(tasks[1], 10)
        for poll in polls:
            poll.ready = True
        plain.ready = True
        waits.wake_answerable()
        rest = await asyncio.wait_for(asyncio.gather(tasks[0], tasks[2], tasks[3]), 10)
        return before, after_nothing, answered, rest

    before, after_nothing, answered, rest = asyncio.run(run())
    assert after_nothing[:3] == before[:3]  # slept through a change that could not answer them: no attempt
    assert after_nothing[3] == before[3] + 1  # the poll without could_answer attempted again
    assert answered == "answered" and rest == ["answered"] * 3


def test_closing_wakes_every_waiter_and_a_broken_could_answer_wakes_its_own() -> None:
    async def run() -> tuple[str, list[str]]:
        closed = [False]
        waits = LoopWaits(lambda: closed[0], max_wait_seconds=60)
        broken, sleeping = SelectivePoll(raises=True), SelectivePoll()
        tasks = [asyncio.ensure_future(waits.until(poll, 30)) for poll in (broken, sleeping)]
        await _all_waiting(waits, 2)
        attempts = broken.attempts
        waits.wake_answerable()  # the raising could_answer does not escape: its waiter attempts instead
        await asyncio.wait_for(_attempted_again(broken, attempts), 10)
        broken.ready = True
        waits.wake_answerable()
        first = await asyncio.wait_for(tasks[0], 10)
        closed[0] = True
        waits.wake_answerable()
        return first, [await asyncio.wait_for(tasks[1], 10)]

    assert asyncio.run(run()) == ("answered", ["gave up"])


def test_a_waiting_dispatch_sleeps_until_the_window_has_room(poll_attempts) -> None:
    """A worker's Dispatch waits on a full window: the Submits that free no slot do not wake it (no attempt);
    the Collect that frees one admits its candidate."""
    from coda_server.core import Pacer, PromptRef, Trajectory, load_config, polls
    from coda_server.core.async_pacer import AsyncPacer

    attempts = poll_attempts(polls.DispatchPoll)
    facade = AsyncPacer(Pacer(load_config(overrides=[
        "data_source.num_prompts_per_step=2", "data_source.num_trajectories_per_prompt=2",
        "trainer.mini_batch_size=2", "fully_async.sliding_window=no-window", "fully_async.stale_steps=0"])))

    async def run() -> tuple[int, list[str]]:
        facade.bind_loop()
        try:
            await facade.dispatch([PromptRef("a"), PromptRef("b")])  # the window (C = 2) is full
            waiting = asyncio.ensure_future(facade.dispatch([PromptRef("c")], wait=30))
            await asyncio.wait_for(_all_waiting(waits=facade.waits, count=1), 10)
            before = attempts[0]
            await facade.submit([Trajectory("a/0", "a")])  # a group still running: no slot frees
            await _turns()
            await facade.submit([Trajectory("a/1", "a")])  # complete, buffered: still no slot
            await _turns()
            slept = attempts[0] - before
            await facade.collect(1)  # the trainer takes it: one slot
            answer = await asyncio.wait_for(waiting, 10)
            return slept, answer.admitted_ids
        finally:
            facade.drain()

    assert asyncio.run(run()) == (0, ["c"])


def test_a_change_made_outside_the_running_loop_wakes_the_waiters() -> None:
    """A change from a thread with no running loop (the pacer used directly, the loop paused between runs) wakes the
    waiters as wake_all does, instead of failing the change."""
    loop = asyncio.new_event_loop()
    try:
        waits = LoopWaits(lambda: False, max_wait_seconds=60)
        poll = SelectivePoll()
        task = loop.create_task(waits.until(poll, 30))
        loop.run_until_complete(asyncio.wait_for(_all_waiting(waits, 1), 10))
        poll.ready = True
        waits.wake_answerable()  # no loop runs on this thread now
        assert loop.run_until_complete(asyncio.wait_for(task, 10)) == "answered"
    finally:
        loop.close()


def test_a_waiting_collect_stating_its_step_is_refused_when_the_step_moves_on() -> None:
    """The trainer's Collect states step 0 and waits on a short buffer; the step boundary (Reset, Resume) moves the
    server to step 1: the change cannot fill the buffer, yet the waiting Collect is woken and refused at once."""
    from coda_server.core import Pacer, PromptRef, load_config
    from coda_server.core.async_pacer import AsyncPacer

    facade = AsyncPacer(Pacer(load_config(overrides=[
        "data_source.num_prompts_per_step=2", "data_source.num_trajectories_per_prompt=2",
        "trainer.mini_batch_size=2", "fully_async.sliding_window=no-window"])))

    async def run() -> str:
        facade.bind_loop()
        try:
            await facade.dispatch([PromptRef("a")])
            waiting = asyncio.ensure_future(facade.collect(1, wait=30, trainer_step=0))
            await asyncio.wait_for(_all_waiting(waits=facade.waits, count=1), 10)
            await facade.reset(resume=True, weight_version=1)
            return await _error_of(waiting)
        finally:
            facade.drain()

    assert "the trainer states step 0, the server is at step 1" in asyncio.run(run())


def test_a_waiting_collect_is_answered_at_once_by_an_incident(scratch_registry) -> None:
    """A change that leaves the buffer short but records an incident (a filter raised) wakes the waiting Collect,
    which answers with the error, not at its deadline."""
    import uuid

    from coda_server import GroupFilter, register_group_filter
    from coda_server.core import BatchShape, Pacer, PromptRef, Trajectory, load_config
    from coda_server.core.async_pacer import AsyncPacer
    from coda_server.core.errors import PacerError

    name = f"exploding-{uuid.uuid4().hex[:8]}"

    @register_group_filter(name)
    class Exploding(GroupFilter):
        def keep(self, group):
            raise RuntimeError("the filter broke")

    config = load_config(overrides=["data_source.num_prompts_per_step=8", "data_source.num_trajectories_per_prompt=2",
                                    "trainer.mini_batch_size=2", "fully_async.sliding_window=no-window",
                                    f"rollout.filter=[{name}]"])
    facade = AsyncPacer(Pacer(config))

    async def run() -> str:
        facade.bind_loop()
        try:
            await facade.dispatch([PromptRef("a")])
            waiting = asyncio.ensure_future(facade.collect(2, wait=30, lease_seconds=30,
                                                           shape=BatchShape(rank=0, world_size=2)))
            await asyncio.wait_for(_all_waiting(waits=facade.waits, count=1), 10)
            try:
                await facade.submit([Trajectory(f"a/{i}", "a") for i in range(2)])
            except PacerError:
                pass  # the Submit is accepted; the broken filter is reported to its caller too
            return await _error_of(waiting)
        finally:
            facade.drain()

    assert "the filter broke" in asyncio.run(run())
