"""Faults a user test found in the rollout worker, each against a live coda-server:

* stop() while the server pushes back (BUFFER_FULL): run() never returned. The submitter's back-pressure pause
  (`asyncio.wait_for(shield(grace))`) swallowed the cancel run() sent it as the grace ran out (Python 3.10/3.11),
  and the log called the pacer, which had answered every call, "unreachable".
* a reward function returning NaN or inf: the server refused the whole Submit, valid trajectories with it, and the
  worker counted no reward error (reward_failure_limit never applied).
* what stop() gave up at its grace was counted as refused by the server and its groups as done.
"""
from __future__ import annotations

import asyncio
import logging
import math
from collections import Counter
from typing import Any

import pytest

from coda_client import AsyncPacerClient, TrajectoryStatus
from coda_worker import RewardFunctionError
from coda_worker.worker import AsyncRolloutWorker, Prompt, WorkerStats
from conftest import core_overrides
from server_harness import ServerProcess
from test_worker_loop import HeldEngine, make_worker, prompts, until

# Bounds a run() that must end long before it: past it the worker hangs, and the test fails saying so.
RUN_TIMEOUT = 60.0


def released_engine() -> HeldEngine:
    engine = HeldEngine()
    engine.auto_release = True
    return engine


async def bounded_run(worker: AsyncRolloutWorker, task: asyncio.Task, what: str) -> WorkerStats:
    """run()'s stats once it ended; a failure naming what still runs when it does not end within RUN_TIMEOUT."""
    done, _ = await asyncio.wait({task}, timeout=RUN_TIMEOUT)
    if not done:
        stuck = sorted(t.get_name() for t in asyncio.all_tasks() if t is not asyncio.current_task() and not t.done())
        task.cancel()
        pytest.fail(f"run() did not return within {RUN_TIMEOUT:g} s {what}; tasks still running: {stuck}")
    return task.result()


def test_stop_ends_the_worker_within_its_grace_while_the_pacer_pushes_back_with_buffer_full(tmp_path, caplog):
    # A buffer of one group: the Submit completing the worker's groups is refused BUFFER_FULL for as long as no
    # trainer collects, which none does here.
    overrides = [*core_overrides("no-window", B=4, stale=1.0, N=2, M=2), "server.max_buffered_groups=1"]
    with ServerProcess(tmp_path, *overrides) as server:
        async def go() -> tuple[WorkerStats, Any]:
            async with AsyncPacerClient(server.address) as pacer:
                worker = make_worker(pacer, released_engine(), prompts(3), max_groups=3, shutdown_grace=1.2)
                task = asyncio.create_task(worker.run())
                await until(lambda: worker.stats.submit_retries >= 1, "a Submit refused for now (BUFFER_FULL)")
                worker.stop()
                stats = await bounded_run(worker, task, "after stop() with a 1.2 s grace, the pacer pushing back")
                return stats, await pacer.state()

        with caplog.at_level(logging.INFO, logger="coda_worker"):
            stats, state = asyncio.run(go())
    messages = [r.getMessage() for r in caplog.records]
    # Nothing was refused for good: what was not acknowledged was given up, and the server still holds it.
    assert stats.groups_given_up >= 1 and stats.groups_done + stats.groups_given_up == 3, stats
    assert stats.trajectories_given_up == 2 * stats.groups_given_up and stats.trajectories_refused == 0, stats
    assert state.running == stats.groups_given_up, (state, stats)
    # The log says what held them: the pacer's back-pressure, not a pacer away.
    assert not [m for m in messages if "unreachable" in m or "did not answer" in m], messages
    assert any("given up" in m and "kept refusing" in m and "BUFFER_FULL" in m for m in messages), messages


def test_a_reward_that_is_no_finite_number_fails_only_its_trajectory(server_small, caplog):
    # The first trajectory scored of p1, p2 and p3 gets a bad value; everything else scores 1.0.
    bad_values: dict[str, Any] = {"p1": float("nan"), "p2": float("inf"), "p3": "1.0"}
    calls: Counter[str] = Counter()

    def reward(prompt: Prompt, tokens: Any) -> Any:
        calls[prompt.prompt_id] += 1
        return bad_values.get(prompt.prompt_id, 1.0) if calls[prompt.prompt_id] == 1 else 1.0

    async def go() -> tuple[WorkerStats, list, list, Any]:
        async with AsyncPacerClient(server_small.address) as pacer:
            submitted: list = []
            worker = make_worker(pacer, released_engine(), prompts(4), reward=reward, on_submitted=submitted.extend)
            stats = await bounded_run(worker, asyncio.create_task(worker.run()), "over 4 prompts")
            return stats, submitted, await pacer.collect(4, wait=0, allow_partial=True), await pacer.state()

    with caplog.at_level(logging.ERROR, logger="coda_worker"):
        stats, submitted, groups, state = asyncio.run(go())
    # Each bad value is a reward error, as a raising reward function is: FAILED, saying why; nothing refused.
    assert stats.reward_errors == 3 and stats.trajectories_failed == 3, stats
    assert stats.trajectories_refused == 0 and stats.trajectories_submitted == 8 and stats.groups_done == 4, stats
    failed = [t for t in submitted if t.status == TrajectoryStatus.FAILED]
    assert sorted(t.prompt_id for t in failed) == ["p1", "p2", "p3"]
    assert all("a reward must be a finite number" in t.metadata["error"] and t.reward == 0.0 for t in failed), failed
    # The valid trajectories reached the server: every one submitted, the clean group buffered with its rewards.
    assert state.submitted == 8 and state.filtered == 3, state
    assert [g.prompt_id for g in groups] == ["p0"]
    assert all(math.isfinite(t.reward) and t.reward == 1.0 for t in groups[0].trajectories)
    assert sum("a reward must be a finite number" in r.getMessage() for r in caplog.records) == 3


def test_a_reward_function_that_only_gives_nan_stops_the_worker_at_its_failure_limit(server_small):
    async def go() -> tuple[WorkerStats, BaseException]:
        async with AsyncPacerClient(server_small.address) as pacer:
            worker = make_worker(pacer, released_engine(), prompts(50), reward=lambda prompt, tokens: math.nan,
                                 reward_failure_limit=3)
            with pytest.raises(RewardFunctionError) as stopped:
                await asyncio.wait_for(worker.run(), RUN_TIMEOUT)
            return worker.stats, stopped.value

    stats, error = asyncio.run(go())
    assert "failed on 3 completed trajectories in a row (reward_failure_limit 3)" in str(error)
    assert "it returned nan; a reward must be a finite number" in str(error)
    assert stats.groups_started <= 4 and stats.trajectories_refused == 0, stats


def test_what_stop_gives_up_at_its_grace_is_counted_as_given_up_not_refused_nor_done(server_small, caplog):
    async def go() -> tuple[WorkerStats, Any]:
        async with AsyncPacerClient(server_small.address) as pacer:
            engine = HeldEngine()  # holds every request: nothing ends before the grace runs out
            worker = make_worker(pacer, engine, prompts(4), shutdown_grace=0.5)
            task = asyncio.create_task(worker.run())
            await until(lambda: len(engine.held) == 4, "4 requests held in the engine (2 groups x 2)")
            worker.stop()
            stats = await bounded_run(worker, task, "after stop() with a 0.5 s grace")
            return stats, await pacer.state()

    with caplog.at_level(logging.INFO, logger="coda_worker"):
        stats, state = asyncio.run(go())
    assert (stats.groups_given_up, stats.trajectories_given_up) == (2, 4), stats
    assert (stats.groups_done, stats.trajectories_refused, stats.trajectories_submitted) == (0, 0, 0), stats
    assert state.running == 2, state  # the server refused nothing: it holds them until their lease runs out
    stopped = [r.getMessage() for r in caplog.records if ": stopped: " in r.getMessage()]
    assert len(stopped) == 1 and "stopped: 0 groups done" in stopped[0], stopped
    assert "2 groups given up at stop() (4 trajectories not acknowledged)" in stopped[0], stopped


@pytest.fixture
def server_small(tmp_path):
    with ServerProcess(tmp_path, *core_overrides("no-window", B=2, stale=1.0, N=2, M=4)) as process:
        yield process
