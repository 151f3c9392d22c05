"""A group whose Submit the server refuses as malformed (INVALID_ARGUMENT) completes at once, against a live server.

Before, the worker dropped the refused trajectories and aborted the rest of the group, which it then submitted as
ABORTED: the server, which counts a group complete at its N trajectories, held the group in flight (and the step
waiting for it) until its in-flight lease ran out, 300 s by default. Now the refused trajectories are submitted once
more as FAILED stand-ins without their arrays, saying why, and so is the rest of the group: the group completes and
the status filter drops it. Stand-ins refused in their turn are dropped, never sent again.
"""
from __future__ import annotations

import asyncio
import logging
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import pytest

from coda_client import AsyncPacerClient, TrajectoryStatus
from coda_worker.engines import FinishReason, Generation, GenerationRequest
from coda_worker.worker import AsyncRolloutWorker, ListPromptSource, Prompt, WorkerStats
from conftest import core_overrides
from server_harness import ServerProcess
from test_worker_loop import make_worker, until_state

# Bounds a run() that must end long before it: past it the worker hangs, and the test fails saying so.
RUN_TIMEOUT = 30.0
# How long the group may take to leave the server once the worker is done: far below the in-flight lease (300 s)
# and the worker liveness grace (300 s) below, so only the worker's own Submits can complete it in time.
PROMPT_SECONDS = 5.0
LONG_LEASES = ("server.inflight_lease_seconds=300", "server.worker_liveness_seconds=300")
MAX_ID_LENGTH = 24


@dataclass
class OwnAnswer:
    """What an engine of the user's own may answer with instead of a Generation: the same fields, none checked."""

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: FinishReason = FinishReason.STOP

    @property
    def aborted(self) -> bool:
        return self.finish_reason is FinishReason.ABORT


class OneBadAnswerEngine:
    """An AsyncEngine for a group of three: `#1` answers at once; `#0`, once `#1` is acknowledged, answers with one
    logprob fewer than tokens (the client sends it as it is; the server refuses the Submit, INVALID_ARGUMENT);
    `#2` runs until the worker aborts it."""

    def __init__(self) -> None:
        self.first_acknowledged = asyncio.Event()
        self.running: dict[str, asyncio.Future] = {}
        self.aborted: list[str] = []

    async def generate(self, request: GenerationRequest) -> Any:
        if "#1-" in request.request_id:
            return Generation([5, 6, 7], [-0.5] * 3, FinishReason.STOP)
        if "#0-" in request.request_id:
            await self.first_acknowledged.wait()
            return OwnAnswer([5, 6, 7, 8], [-0.5] * 3)
        future = self.running[request.request_id] = asyncio.get_running_loop().create_future()
        await future
        return Generation([5], [-0.5], FinishReason.ABORT)

    async def abort(self, request_ids: Sequence[str]) -> None:
        self.aborted.extend(request_ids)
        for request_id in request_ids:
            future = self.running.get(request_id)
            if future is not None and not future.done():
                future.set_result(None)


class AnsweringEngine:
    """An AsyncEngine whose every request ends at once with three tokens."""

    async def generate(self, request: GenerationRequest) -> Generation:
        return Generation([5, 6, 7], [-0.5] * 3, FinishReason.STOP)

    async def abort(self, request_ids: Sequence[str]) -> None:
        pass


async def bounded_run(worker: AsyncRolloutWorker) -> WorkerStats:
    try:
        return await asyncio.wait_for(worker.run(), RUN_TIMEOUT)
    except asyncio.TimeoutError:
        pytest.fail(f"run() did not return within {RUN_TIMEOUT:g} s: the worker kept the refused group")


def test_a_group_refused_as_malformed_completes_at_once_and_is_dropped_by_the_status_filter(tmp_path, caplog):
    overrides = [*core_overrides("no-window", B=2, stale=1.0, N=3, M=3), *LONG_LEASES]
    with ServerProcess(tmp_path, *overrides) as server:
        async def go() -> tuple[WorkerStats, Any, list, list[str]]:
            engine = OneBadAnswerEngine()
            submitted: list = []

            def on_submitted(trajectories: list) -> None:
                submitted.extend(trajectories)
                if any(t.trajectory_id == "p0#1" for t in trajectories):
                    engine.first_acknowledged.set()

            async with AsyncPacerClient(server.address) as pacer:
                worker = make_worker(pacer, engine, ListPromptSource([Prompt("p0", [100, 7, 7])]),
                                     continue_restored=False, on_submitted=on_submitted)
                stats = await bounded_run(worker)
                # Acknowledged, the group is complete on the server at once: nothing waits for its lease.
                state = await until_state(pacer, lambda s: s.running == 0 and s.filtered == 1,
                                          "the refused group completed and filtered, long before its 300 s lease",
                                          timeout=PROMPT_SECONDS)
            return stats, state, submitted, engine.aborted

        with caplog.at_level(logging.ERROR, logger="coda_worker"):
            stats, state, submitted, aborted = asyncio.run(go())

    assert state.submitted == 3 and state.collected == 0 and state.buffered == 0, state
    assert aborted, "the rest of the refused group was not aborted on the engine"
    assert (stats.trajectories_submitted, stats.trajectories_failed_after_refusal, stats.trajectories_refused,
            stats.groups_done) == (3, 2, 0, 1), stats
    by_id = {t.trajectory_id: t for t in submitted}
    assert sorted(by_id) == ["p0#0", "p0#1", "p0#2"]
    assert by_id["p0#1"].status == TrajectoryStatus.COMPLETED  # acknowledged before the refusal: untouched
    for trajectory_id in ("p0#0", "p0#2"):  # the refused one, and the one still running then
        stand_in = by_id[trajectory_id]
        assert stand_in.status == TrajectoryStatus.FAILED and stand_in.metadata["finish_reason"] == "error"
        assert "non-empty token_ids, logprobs and loss_mask must have equal lengths" in stand_in.metadata["error"]
        assert len(stand_in.token_ids) == 0 and len(stand_in.logprobs) == 0 and len(stand_in.segment_lengths) == 0
    said = [r.getMessage() for r in caplog.records
            if r.levelno == logging.ERROR and "refused as malformed" in r.getMessage()]
    assert len(said) == 1, said
    assert "'p0'" in said[0] and "p0#0" in said[0] and "must have equal lengths" in said[0], said


def test_stand_ins_refused_in_their_turn_are_dropped_not_sent_again(tmp_path, caplog):
    """A prompt id as long as the server allows: the worker's trajectory ids (`prompt_id#i`) are longer, so the
    server refuses its trajectories whatever they carry, the FAILED stand-ins too. Each is sent as a stand-in once,
    then dropped; the worker ends."""
    overrides = [*core_overrides("no-window", B=2, stale=1.0, N=2, M=2), *LONG_LEASES,
                 f"server.max_id_length={MAX_ID_LENGTH}"]
    prompt_id = "q" * MAX_ID_LENGTH
    with ServerProcess(tmp_path, *overrides) as server:
        async def go() -> tuple[WorkerStats, list, Any]:
            sent: list = []
            async with AsyncPacerClient(server.address) as pacer:
                submit = pacer.submit

                async def counting_submit(trajectories: Sequence[Any], **options: Any) -> Any:
                    sent.append([(t.trajectory_id, TrajectoryStatus(t.status)) for t in trajectories])
                    return await submit(trajectories, **options)

                pacer.submit = counting_submit
                worker = make_worker(pacer, AnsweringEngine(), ListPromptSource([Prompt(prompt_id, [100, 7, 7])]),
                                     continue_restored=False)
                stats = await bounded_run(worker)
                return stats, sent, await pacer.state()

        with caplog.at_level(logging.ERROR, logger="coda_worker"):
            stats, sent, state = asyncio.run(go())

    attempts = Counter(attempt for call in sent for attempt in call)
    ids = [f"{prompt_id}#0", f"{prompt_id}#1"]
    # Each trajectory went as a FAILED stand-in exactly once (after at most one try as it was), then no more.
    assert {tid for tid, _ in attempts} == set(ids), sent
    assert all(attempts[tid, TrajectoryStatus.FAILED] == 1 for tid in ids), sent
    assert all(attempts[tid, TrajectoryStatus.COMPLETED] <= 1 for tid in ids), sent
    assert len(sent) <= 4, sent
    assert (stats.trajectories_refused, stats.trajectories_submitted, stats.trajectories_failed_after_refusal,
            stats.groups_done) == (2, 0, 0, 1), stats
    assert state.submitted == 0 and state.running == 1, state  # nothing could complete it: the lease will
    dropped = [r.getMessage() for r in caplog.records if "were refused too, dropped" in r.getMessage()]
    assert 1 <= len(dropped) <= 2 and all("is 26 characters long; at most 24" in m for m in dropped), dropped
