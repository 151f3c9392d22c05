"""The one retry mechanism: a request_id answered once gets that answer again, whether the call changed anything."""
from __future__ import annotations

import asyncio

import pytest

from coda_server.core import InvalidArgumentError, PromptRef, Trajectory
from coda_server.core.async_pacer import AsyncPacer


def test_in_process_a_retry_gets_the_first_answer_even_of_a_call_that_changed_nothing(core_pacer):
    pacer = core_pacer("no-window", B=1, stale=0.0, N=1)  # window of one group
    peek = pacer.dispatch([], request_id="peek-1")
    assert peek.remaining == 1
    pacer.dispatch([PromptRef("a")])  # the window is full now
    # The peek changed nothing, yet its retry answers what the first call saw, not the state now.
    assert pacer.dispatch([], request_id="peek-1") == peek
    assert pacer.dispatch([], request_id="peek-2").remaining == 0
    empty = pacer.collect_now(1, request_id="c-1")
    assert empty.groups == [] and empty.timed_out
    pacer.submit([Trajectory("a/t0", "a")])
    assert pacer.collect_now(1, request_id="c-1") == empty  # remembered: the retry does not take the new group
    assert [g.prompt_id for g in pacer.collect_now(1, request_id="c-2").groups] == ["a"]


def test_answers_are_bounded_by_their_count_per_method_the_oldest_forgotten_first(core_pacer):
    pacer = core_pacer("no-window", B=1, stale=0.0, N=1, extra=("server.request_id_cache_size=2",))
    for request_id in ("peek-a", "peek-b", "peek-c"):
        assert pacer.dispatch([], request_id=request_id).remaining == 1
    pacer.dispatch([PromptRef("a")])  # the window is full now
    assert pacer.dispatch([], request_id="peek-c").remaining == 1  # remembered
    assert pacer.dispatch([], request_id="peek-a").remaining == 0  # forgotten: it runs again
    assert pacer.dispatch([], request_id="peek-b").remaining == 0  # pushed out by peek-a's new answer
    assert list(pacer.answers.of("Dispatch")) == ["peek-a", "peek-b"]


def test_in_process_a_failed_call_is_not_remembered_and_its_retry_runs_again(core_pacer):
    pacer = core_pacer("no-window", B=1, stale=0.0, N=1)
    with pytest.raises(InvalidArgumentError):
        pacer.dispatch([PromptRef("a", ds_index=7)], request_id="d-1")
    assert [a.prompt_id for a in pacer.dispatch([PromptRef("a")], request_id="d-1").admitted] == ["a"]
    assert pacer.state().dispatched == 1


def test_the_asyncio_face_remembers_every_answer_a_submit_and_a_peek_included(core_pacer):
    pacer = core_pacer("no-window", B=1, stale=0.0, N=2)
    facade = AsyncPacer(pacer)

    async def run():
        facade.bind_loop()
        try:
            peek = await facade.dispatch([], request_id="peek")
            await facade.dispatch([PromptRef("a")], request_id="d")
            batch = [Trajectory("a/t0", "a"), Trajectory("a/t1", "a")]
            first = await facade.submit(batch, request_id="s")
            again = await facade.submit(batch, request_id="s")
            return peek, await facade.dispatch([], request_id="peek"), first, again
        finally:
            facade.drain()

    peek, peek_again, first, again = asyncio.run(run())
    assert peek_again == peek and peek.remaining == 1
    # The retry gets the first answer (2 accepted), not the answer a second call would get (2 duplicates).
    assert (first.accepted, first.duplicates) == (2, 0) and again == first
    assert pacer.state().duplicates == 0 and pacer.state().submitted == 2


def test_remembered_collect_answers_are_bounded_by_the_bytes_they_hold(core_pacer):
    """An unleased Collect's answer is its groups' only holder: beyond server.remembered_answer_bytes the
    oldest answers are forgotten (a retry of one runs again), the newest always kept."""
    pacer = core_pacer("no-window", B=4, stale=0.0, N=1, M=1, extra=["server.remembered_answer_bytes=250"])
    pacer.dispatch([PromptRef(p) for p in "abcd"])
    pacer.submit([Trajectory(f"{p}/t0", p, size_bytes=100) for p in "abcd"])
    first, second, third = (pacer.collect_now(1, request_id=f"c-{i}") for i in range(3))
    assert [g.prompt_id for r in (first, second, third) for g in r.groups] == ["a", "b", "c"]
    assert pacer.answers.remembered_bytes() == 200  # c-0's 100 bytes were over the budget of 250
    assert pacer.collect_now(1, request_id="c-2") == third and pacer.collect_now(1, request_id="c-1") == second
    # The forgotten one runs again: it takes the next group rather than answering "a" again.
    assert [g.prompt_id for g in pacer.collect_now(1, request_id="c-0").groups] == ["d"]


def test_the_newest_answer_is_kept_even_when_it_alone_is_over_the_budget(core_pacer):
    pacer = core_pacer("no-window", B=1, stale=0.0, N=1, M=1, extra=["server.remembered_answer_bytes=10"])
    pacer.dispatch([PromptRef("a")])
    pacer.submit([Trajectory("a/t0", "a", size_bytes=100)])
    taken = pacer.collect_now(1, request_id="big")
    assert pacer.collect_now(1, request_id="big") == taken and pacer.answers.remembered_bytes() == 100
