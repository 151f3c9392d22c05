"""AsyncPacer request-id replay: a retry that arrives while the first call still waits shares its outcome."""
from __future__ import annotations

import asyncio

import pytest

from coda_server.core.async_pacer import AsyncPacer
from coda_server.core.errors import InvalidArgumentError
from coda_server.core.types import PromptRef, Trajectory


def refs(*prompt_ids: str) -> list[PromptRef]:
    return [PromptRef(p) for p in prompt_ids]


def test_a_retry_of_a_waiting_dispatch_gets_the_first_answer_and_admits_once(core_pacer):
    pacer = core_pacer("no-window", B=1, stale=0.0, N=1)  # window of one group
    facade = AsyncPacer(pacer)

    async def run():
        facade.bind_loop()
        assert [a.prompt_id for a in (await facade.dispatch(refs("first"))).admitted] == ["first"]
        waiting = asyncio.ensure_future(facade.dispatch(refs("second"), wait=30, request_id="r-1"))
        for _ in range(3):
            await asyncio.sleep(0)  # let it start waiting: the window is full
        assert not waiting.done()
        retry = asyncio.ensure_future(facade.dispatch(refs("second"), wait=0, request_id="r-1"))
        await asyncio.sleep(0)
        assert not retry.done()  # it joined the first call instead of answering "nothing admitted"
        await facade.submit([Trajectory("t0", "first")])  # the group completes...
        assert len((await facade.collect(1)).groups) == 1  # ...and the trainer takes it: a slot frees
        first, again = await asyncio.wait_for(asyncio.gather(waiting, retry), 10)
        facade.drain()
        return first, again

    first, again = asyncio.run(run())
    assert [a.prompt_id for a in first.admitted] == ["second"] and again == first
    assert pacer.state().dispatched == 2


def test_a_request_id_that_may_not_be_kept_is_refused_without_waiting(core_pacer):
    facade = AsyncPacer(core_pacer("no-window"))

    async def run():
        facade.bind_loop()
        try:
            with pytest.raises(InvalidArgumentError, match="request_id"):
                await facade.dispatch(refs("p"), wait=0, request_id="bad\nid")
            with pytest.raises(InvalidArgumentError, match="request_id"):
                await facade.dispatch(refs("p"), wait=5, request_id="bad\nid")
        finally:
            facade.drain()

    asyncio.run(run())
    assert facade.pacer.state().dispatched == 0


def test_retries_of_a_running_call_share_its_error_and_a_later_retry_runs_again():
    import threading

    from coda_server.core.answers import AnswerBook
    from coda_server.core.limits import Limits

    answers = AnswerBook(Limits.shipped(), threading.RLock(), check_request_id=lambda request_id: None)
    runs = []

    async def run():
        release = asyncio.Event()

        async def failing():
            runs.append("failing")
            await release.wait()
            raise InvalidArgumentError("first attempt failed")

        async def succeeding():
            runs.append("succeeding")
            return "answer"

        first = asyncio.ensure_future(answers.once_awaited("Submit", "r-1", failing))
        await asyncio.sleep(0)
        retries = [asyncio.ensure_future(answers.once_awaited("Submit", "r-1", succeeding)) for _ in range(2)]
        await asyncio.sleep(0)
        release.set()
        outcomes = await asyncio.gather(first, *retries, return_exceptions=True)
        later = await answers.once_awaited("Submit", "r-1", succeeding)  # nothing was remembered: the call runs again
        return outcomes, later

    outcomes, later = asyncio.run(run())
    assert [str(o) for o in outcomes] == ["first attempt failed"] * 3
    assert all(isinstance(o, InvalidArgumentError) for o in outcomes)
    assert runs == ["failing", "succeeding"] and later == "answer"
