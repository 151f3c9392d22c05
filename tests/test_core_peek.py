"""A peek (a Dispatch without candidates or max_continuations) answers through `Pacer.peek`, without a poll or
admission's bookkeeping: in every state it answers what admitting no candidates answers, and fails alike."""
from __future__ import annotations

import asyncio

import pytest

from coda_server.core import Pacer, PromptRef, Trajectory
from coda_server.core.async_pacer import AsyncPacer
from coda_server.core.builtin_strategies import NoWindowStrategy
from coda_server.core.errors import ShuttingDownError, StrategyHookError
from coda_server.core.strategy import register_sliding_window_strategy


def full_admission(pacer: Pacer):
    """The general path's answer to a peek: its poll's first attempt, admitting no candidates."""
    return pacer.dispatch_poll([]).attempt()


def test_a_peek_answers_what_admitting_no_candidates_answers_in_every_state(core_pacer):
    pacer = core_pacer("no-window", B=2, stale=1.0, N=2)
    assert pacer.peek() == full_admission(pacer) and pacer.peek().remaining == 4
    pacer.dispatch([PromptRef("a"), PromptRef("b")])
    pacer.submit([Trajectory("a/t0", "a"), Trajectory("a/t1", "a")])  # a buffered, b running
    busy = pacer.peek()
    assert busy == full_admission(pacer)
    assert (busy.running, busy.buffered, busy.remaining, busy.first_seq, busy.admitted_ids) == (1, 1, 2, 2, [])
    pacer.reset(wait=0)  # paused: b dropped
    paused = pacer.peek()
    assert paused == full_admission(pacer) and paused.paused and paused.remaining == 0
    # Through the in-process and the asyncio faces alike, remembered under its request_id.
    assert pacer.dispatch([], wait=5.0, request_id="peek") == paused
    pacer.resume(1)
    assert pacer.dispatch([], request_id="peek") == paused
    assert asyncio.run(AsyncPacer(pacer).dispatch([], request_id="peek")) == paused
    assert pacer.peek() == full_admission(pacer) and pacer.peek().step == 1
    pacer.close()
    for call in (pacer.peek, lambda: full_admission(pacer)):
        with pytest.raises(ShuttingDownError):
            call()


class Switchable(NoWindowStrategy):
    raising = False

    def compute_dispatch_count(self, buf_qsize: int) -> int:
        if self.raising:
            raise RuntimeError("broken window")
        return super().compute_dispatch_count(buf_qsize)


@pytest.mark.usefixtures("scratch_registry")
def test_a_peek_is_refused_by_a_raising_window_as_admission_is_and_records_the_incident(core_config):
    register_sliding_window_strategy("test-peek-switchable")(Switchable)
    pacer = Pacer(core_config("test-peek-switchable", B=1, stale=0.0, N=1))
    strategy = pacer.strategy.wrapped
    try:
        strategy.raising = True
        for call in (pacer.peek, lambda: full_admission(pacer)):
            with pytest.raises(StrategyHookError, match="compute_dispatch_count"):
                call()
        assert [i.hook for i in pacer.state().recent_incidents] == ["compute_dispatch_count"] * 2
        strategy.raising = False
        assert pacer.peek() == full_admission(pacer) and pacer.peek().remaining == 1
    finally:
        pacer.close()
