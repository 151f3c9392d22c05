"""The rollout worker against a live coda-server, with an in-process engine of the test's own (no network).

The engine hands out a few tokens per request at once and then holds the request until the test releases
it or the worker aborts it, so every step is driven by conditions, never by timing.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path

import pytest

from coda_client import AsyncPacerClient, PacerClient, TrajectoryStatus
from coda_worker.engines import FinishReason, Generation, GenerationRequest, SamplingParams
from coda_worker import worker as worker_module
from coda_worker.worker import AsyncRolloutWorker, ListPromptSource, Prompt, RolloutWorker, trajectory_id_of
from conftest import core_overrides
from server_harness import ServerProcess
from test_durability_crash import free_port
from test_liveness import watched_worker_dispatching

REPO = Path(__file__).resolve().parents[1]
FIRST_TOKENS = 3  # tokens a request produces before it is held
LATER_TOKENS = 2  # tokens it adds when released
CONDITION_TIMEOUT = 20.0


class HeldEngine:
    """An AsyncEngine: each request returns FIRST_TOKENS at once when aborted, FIRST + LATER when released.

    Token values are the position in the full sequence (prompt included), so a continued trajectory
    shows where it continued from.
    """

    def __init__(self) -> None:
        self.requests: list[GenerationRequest] = []
        self.held: dict[str, asyncio.Future] = {}
        self.aborted: list[str] = []
        self.auto_release = False

    async def generate(self, request: GenerationRequest) -> Generation:
        self.requests.append(request)
        future = asyncio.get_running_loop().create_future()
        self.held[request.request_id] = future
        if self.auto_release:
            future.set_result("done")
        outcome = await future
        self.held.pop(request.request_id, None)
        count = min(request.max_tokens, FIRST_TOKENS if outcome == "abort" else FIRST_TOKENS + LATER_TOKENS)
        start = len(request.input_ids)
        reason = FinishReason.ABORT if outcome == "abort" else FinishReason.STOP
        return Generation(list(range(start, start + count)), [-0.5] * count, reason)

    async def abort(self, request_ids: Sequence[str]) -> None:
        self.aborted.extend(request_ids)
        for request_id in request_ids:
            future = self.held.get(request_id)
            if future is not None and not future.done():
                future.set_result("abort")

    def release_all(self) -> None:
        for future in list(self.held.values()):
            if not future.done():
                future.set_result("done")


async def until(condition, what: str, timeout: float = CONDITION_TIMEOUT) -> None:
    """Waits for a condition (polled); fails naming it when it does not come."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.01)


async def until_state(pacer, condition, what: str, timeout: float = CONDITION_TIMEOUT):
    """Waits until the server's state meets a condition (polled over GetState)."""
    deadline = time.monotonic() + timeout
    while not condition(state := await pacer.state()):
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}; last state {state}")
        await asyncio.sleep(0.02)
    return state


def prompts(count: int, prefix: str = "p") -> ListPromptSource:
    return ListPromptSource([Prompt(f"{prefix}{i}", [100 + i, 7, 7]) for i in range(count)])


@pytest.fixture
def server(tmp_path):
    with ServerProcess(tmp_path, *core_overrides("no-window", B=2, stale=1.0, N=2, M=4)) as process:
        yield process


def make_worker(pacer, engine, source, **kwargs) -> AsyncRolloutWorker:
    kwargs.setdefault("max_groups", 2)
    kwargs.setdefault("dispatch_wait", 0.5)
    return AsyncRolloutWorker(pacer, engine, source, sampling=SamplingParams(max_tokens=16), **kwargs)


@contextlib.asynccontextmanager
async def running_worker(address: str, source: ListPromptSource | None = None, engine: HeldEngine | None = None,
                         client_id: str | None = None, **kwargs):
    """A worker running on a HeldEngine, once its first two groups (4 requests) are held in the engine."""
    engine = engine if engine is not None else HeldEngine()
    async with AsyncPacerClient(address, client_id=client_id) as pacer:
        worker = make_worker(pacer, engine, source if source is not None else prompts(10), **kwargs)
        task = asyncio.create_task(worker.run())
        await until(lambda: len(engine.held) == 4, "4 requests held in the engine (2 groups x 2)")
        yield pacer, engine, worker, task


def test_worker_generates_groups_and_submits_them_with_segments_and_rewards(server):
    async def go():
        engine = HeldEngine()
        engine.auto_release = True
        acknowledged = []
        async with AsyncPacerClient(server.address) as pacer:
            worker = make_worker(pacer, engine, prompts(4), reward=lambda prompt, tokens: float(len(tokens)),
                                 on_submitted=acknowledged.extend)
            stats = await worker.run()  # ends when the source is exhausted and everything is acknowledged
            groups = await pacer.collect(4, wait=5)
        return stats, groups, acknowledged

    stats, groups, acknowledged = asyncio.run(go())
    assert sorted(g.prompt_id for g in groups) == ["p0", "p1", "p2", "p3"]
    assert stats.groups_done == 4 and stats.trajectories_submitted == 8 and len(acknowledged) == 8
    for group in groups:
        assert sorted(t.trajectory_id for t in group.trajectories) == [trajectory_id_of(group.prompt_id, i)
                                                                       for i in range(2)]
        for t in group.trajectories:
            assert t.status == TrajectoryStatus.COMPLETED
            assert t.token_ids == list(range(3, 3 + FIRST_TOKENS + LATER_TOKENS))
            assert t.reward == float(FIRST_TOKENS + LATER_TOKENS) and len(t.logprobs) == len(t.token_ids)
            assert t.metadata["finish_reason"] == "stop"
    assert stats.tokens_generated == 8 * (FIRST_TOKENS + LATER_TOKENS)


def test_admitting_dispatches_are_said_at_info_level_once_a_minute_and_each_at_debug_level(server, caplog,
                                                                                          monkeypatch):
    """A line per admitting Dispatch at info level was one per group a worker ran. Now: the first at once, then what
    they admitted since, once DISPATCH_LOG_SECONDS (60 s) have passed; each Dispatch at debug level."""
    def run(prefix: str):
        async def go():
            engine = HeldEngine()
            engine.auto_release = True
            async with AsyncPacerClient(server.address) as pacer:
                await pacer.collect(64, allow_partial=True)  # the window's room back from the run before
                return await make_worker(pacer, engine, prompts(4, prefix), max_groups=1).run()

        caplog.clear()
        with caplog.at_level(logging.DEBUG, logger="coda_worker"):
            stats = asyncio.run(go())
        said = [(r.levelno, r.getMessage()) for r in caplog.records if ": dispatched " in r.getMessage()]
        groups = [(level, int(re.search(r"dispatched (\d+) groups", text).group(1)), text) for level, text in said]
        return stats, groups

    stats, groups = run("a")
    info = [g for g in groups if g[0] == logging.INFO]
    debug = [g for g in groups if g[0] == logging.DEBUG]
    assert len(info) == 1 and len(debug) == 3, groups  # max_groups 1: four admitting Dispatches
    assert sum(n for _, n, _ in debug) + info[0][1] == stats.groups_started == 4

    monkeypatch.setattr(worker_module, "DISPATCH_LOG_SECONDS", 0.0)  # every Dispatch comes a "minute" later
    stats, groups = run("b")
    assert all(level == logging.INFO for level, _, _ in groups) and len(groups) == 4, groups
    assert sum(n for _, n, _ in groups) == stats.groups_started == 4
    assert all(re.search(r"dispatched \d+ groups in \d+ s", text) for _, _, text in groups[1:]), groups


def test_pause_with_abort_aborts_the_engine_requests_and_submits_partial_tokens_as_aborted(server):
    async def go():
        async with running_worker(server.address) as (pacer, engine, worker, task):
            reset = await pacer.reset("abort", wait=CONDITION_TIMEOUT)
            held_after = dict(engine.held)
            worker.stop()
            await pacer.resume(1)
            stats = await asyncio.wait_for(task, CONDITION_TIMEOUT)
        return engine, reset, held_after, stats

    engine, reset, held_after, stats = asyncio.run(go())
    assert reset.dropped_prompt_ids == []  # every running group was assembled: nothing lost at the boundary
    assert len(reset.restored) == 2
    for group in reset.restored:
        assert [t.status for t in group.trajectories] == [TrajectoryStatus.ABORTED] * 2
        for t in group.trajectories:
            assert t.token_ids == list(range(3, 3 + FIRST_TOKENS))  # the partial tokens, not an empty response
            assert t.metadata["finish_reason"] == "abort"
    assert sorted(engine.aborted) == sorted(r.request_id for r in engine.requests[:4])
    assert held_after == {} and stats.trajectories_aborted == 4


def test_pause_with_wait_lets_running_requests_finish_and_aborts_nothing(server):
    async def go():
        async with running_worker(server.address) as (pacer, engine, worker, task):
            reset_task = asyncio.create_task(pacer.reset("wait", wait=CONDITION_TIMEOUT))
            await until(lambda: worker._paused, "the worker to see the PAUSE")
            engine.release_all()
            reset = await reset_task
            state = await pacer.state()
            worker.stop()
            await pacer.resume(1)
            await asyncio.wait_for(task, CONDITION_TIMEOUT)
        return engine, reset, state

    engine, reset, state = asyncio.run(go())
    assert engine.aborted == [] and reset.dropped_prompt_ids == []
    assert state.buffered == 2 and state.dispatched == 2  # both groups completed; nothing new while paused


def test_resume_records_the_weight_version_and_calls_on_resume_before_dispatching_again(server):
    async def go():
        versions_seen = []
        async with running_worker(server.address, on_resume=versions_seen.append) as (pacer, engine, worker, task):
            await pacer.reset("abort", wait=CONDITION_TIMEOUT, resume=True, weight_version=7)
            await until(lambda: worker.weight_version == 7, "the worker to record weight version 7")
            engine.auto_release = True
            engine.release_all()
            groups = await pacer.collect(2, wait=CONDITION_TIMEOUT)
            worker.stop()
            engine.release_all()
            await asyncio.wait_for(task, CONDITION_TIMEOUT)
        return versions_seen, groups

    versions_seen, groups = asyncio.run(go())
    assert versions_seen == [7]
    for group in groups:
        for t in group.trajectories:
            assert (t.start_weight_version, t.end_weight_version) == (7, 7)
            assert t.segment_lengths == [len(t.token_ids)] and t.segment_weight_versions == [7]


class VersionedEngine(HeldEngine):
    """A HeldEngine that reports the weight version it has loaded, which the test changes (a weight sync)."""

    def __init__(self) -> None:
        super().__init__()
        self.loaded = 0

    async def loaded_weight_version(self) -> int:
        return self.loaded


def test_segments_are_tagged_with_the_version_the_engine_reports_loaded_not_the_one_resume_announced(server,
                                                                                                    monkeypatch):
    monkeypatch.setattr(worker_module, "ENGINE_VERSION_RECHECK_SECONDS", 0.0)  # ask before every lagging request

    async def go():
        engine = VersionedEngine()
        async with running_worker(server.address, prompts(40), engine=engine,
                                  client_id="versioned-worker") as (pacer, engine, worker, task):
            # RESUME announces 7, but nobody synced the engine: it still runs version 0.
            await pacer.reset("abort", wait=CONDITION_TIMEOUT, resume=True, weight_version=7)
            await until(lambda: worker.weight_version == 7, "the worker to record weight version 7")
            engine.auto_release = True
            engine.release_all()
            before_sync = await pacer.collect(2, wait=CONDITION_TIMEOUT)
            engine.loaded = 7  # the sync happens late
            after_sync = []
            deadline = time.monotonic() + CONDITION_TIMEOUT
            while time.monotonic() < deadline:  # the worker asks again before new requests while the engine lags
                after_sync = await pacer.collect(2, wait=CONDITION_TIMEOUT)
                if any(t.segment_weight_versions == [7] for g in after_sync for t in g.trajectories):
                    break
            assert worker.engine_weight_version == 7
            # The server knows what the worker's engine runs: Dispatch and KeepAlive carry it, ListWorkers shows it.
            deadline = time.monotonic() + CONDITION_TIMEOUT
            while (listed := {w.client_id: w.loaded_weight_version for w in await pacer.list_workers()}
                   ).get(worker.worker_id) != 7 and time.monotonic() < deadline:
                await asyncio.sleep(0.02)
            assert listed[worker.worker_id] == 7
            worker.stop()
            engine.release_all()
            await asyncio.wait_for(task, CONDITION_TIMEOUT)
        return before_sync, after_sync

    before_sync, after_sync = asyncio.run(go())
    assert {v for g in before_sync for t in g.trajectories for v in t.segment_weight_versions} == {0}
    assert any(t.segment_weight_versions == [7] and t.start_weight_version == 7
               for g in after_sync for t in g.trajectories)


def test_requests_starting_while_the_engine_is_being_asked_wait_for_its_answer():
    """A Dispatch answered after Resume(7) starts many trajectories at once while the engine still counts as
    version 0 here: the first asks the engine, the others must wait for that answer, not tag with the old one."""
    class SlowlyAnswering(VersionedEngine):
        async def loaded_weight_version(self) -> int:
            await asyncio.sleep(0.05)
            return self.loaded

    async def go():
        engine = SlowlyAnswering()
        worker = make_worker(None, engine, prompts(1))
        worker.engine_weight_version, worker.weight_version, engine.loaded = 0, 7, 7
        return await asyncio.gather(*(worker._tag_version() for _ in range(8)))

    assert asyncio.run(go()) == [7] * 8


def test_a_worker_rides_through_a_graceful_server_restart_and_stop_is_safe_after_it_ended(tmp_path):
    """SHUTDOWN is "the server is going away for now": the worker keeps what it holds, submits it to the
    restarted server and dispatches again; only stop() ends it, and stop() after the end does nothing."""
    overrides = [*core_overrides("no-window", B=2, stale=1.0, N=2, M=4), f"server.address=127.0.0.1:{free_port()}",
                 f"server.state_dir={tmp_path / 'state'}"]
    server = ServerProcess(tmp_path, *overrides).start()
    try:
        async def go():
            async with running_worker(server.address, prompts(6)) as (pacer, engine, worker, task):
                server.process.send_signal(signal.SIGTERM)
                assert server.process.wait(CONDITION_TIMEOUT) == 0
                restarted = ServerProcess(tmp_path, *overrides).start()
                try:
                    assert not task.done()  # SHUTDOWN did not end the worker
                    engine.auto_release = True
                    engine.release_all()  # the two groups it held finish: submitted to the restarted server
                    state = await until_state(pacer, lambda s: s.collected >= 4, "four groups collected: two from before the restart, two dispatched after it")
                    worker.stop()
                    stats = await asyncio.wait_for(task, CONDITION_TIMEOUT)
                finally:
                    restarted.close()
            return engine, stats, state, worker

        engine, stats, state, worker = asyncio.run(go())
        assert engine.aborted == []  # nothing was aborted for the restart
        assert stats.trajectories_refused == 0 and stats.groups_done >= 4
        assert state.expired == 0
        worker.stop()  # after run() ended, its loop closed: does nothing, raises nothing
    finally:
        server.close()


def test_a_worker_rides_through_a_server_down_for_longer_than_its_call_timeout(tmp_path):
    """kill -9, and the server stays away for longer than the client's call timeout: a call that waits for a server
    (wait_for_ready, as RolloutWorker sets it) ends DEADLINE_EXCEEDED with none answering. The worker retries it with
    the same request id, as it retries UNAVAILABLE: the Submit it was making is not dropped, and the worker goes on
    with the restarted server."""
    overrides = [*core_overrides("no-window", B=2, stale=1.0, N=2, M=4), f"server.address=127.0.0.1:{free_port()}",
                 f"server.state_dir={tmp_path / 'state'}"]
    server = ServerProcess(tmp_path, *overrides).start()
    try:
        async def go():
            async with AsyncPacerClient(server.address, timeout=1.0, wait_for_ready=True) as pacer:
                engine = HeldEngine()
                worker = make_worker(pacer, engine, prompts(6))
                task = asyncio.create_task(worker.run())
                await until(lambda: len(engine.held) == 4, "4 requests held in the engine (2 groups x 2)")
                server.process.kill()
                server.process.wait(CONDITION_TIMEOUT)
                engine.auto_release = True
                engine.release_all()  # the two groups finish while no server answers
                await until(lambda: worker.stats.submit_retries >= 2, "a Submit retried after its deadline, twice")
                restarted = ServerProcess(tmp_path, *overrides).start()
                try:
                    # Not the worker's client (1 s deadlines); waiting for ready, as the connection to the address it
                    # shares with the worker's may still be in its back-off.
                    async with AsyncPacerClient(restarted.address, wait_for_ready=True) as observer:
                        state = await until_state(observer, lambda s: s.collected >= 4, "four groups collected")
                    worker.stop()
                    stats = await asyncio.wait_for(task, CONDITION_TIMEOUT)
                finally:
                    restarted.close()
            return stats, state

        stats, state = asyncio.run(go())
        assert stats.trajectories_refused == 0, stats  # nothing dropped for the outage
        assert stats.groups_done >= 4 and state.collected >= 4
    finally:
        server.close()


def test_a_worker_where_nothing_listens_says_so_at_once_and_stop_ends_it_at_once(caplog):
    """A worker on a client that waits for ready (as RolloutWorker's does), started where nothing listens (a wrong
    port): it said nothing until the call's deadline (the client's timeout, 60 s here), and stop() then waited for the
    call until the shutdown grace ran out. Now the failing connection is warned of at once, and the first call, a
    read, ends at stop() itself."""
    address = f"127.0.0.1:{free_port()}"

    async def go():
        async with AsyncPacerClient(address, timeout=60.0, wait_for_ready=True) as pacer:
            worker = make_worker(pacer, HeldEngine(), prompts(2), shutdown_grace=600.0)
            task = asyncio.create_task(worker.run())
            await until(lambda: "GetState" in worker._calls_in_flight.values(), "the first call waiting")
            await until(lambda: any("no connection can be made" in r.getMessage() for r in caplog.records),
                        "a warning that the pacer cannot be reached, long before the call's 60 s")
            worker.stop()
            done, _ = await asyncio.wait({task}, timeout=CONDITION_TIMEOUT)  # not the grace's 600 s
            assert done, "run() still waits for the call after stop()"
            return task.result()  # a stop is not a failure: the worker held nothing

    with caplog.at_level(logging.WARNING, logger="coda_worker"):
        stats = asyncio.run(go())
    assert stats.groups_started == 0 and stats.trajectories_submitted == 0, stats
    stopped = [r.getMessage() for r in caplog.records if "stopped before it started" in r.getMessage()]
    assert len(stopped) == 1, stopped
    assert f"GetState not answered before stop(): the pacer at {address} did not answer" in stopped[0], stopped
    away = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and "is away" in r.getMessage()]
    assert len(away) == 1 and f"the pacer at {address} is away: no connection can be made to it" in away[0], away


def test_stop_before_run_ends_the_run_at_once_where_nothing_listens():
    """stop() before run() on a worker whose server is not there: run()'s first call waited for the call's deadline
    (60 s here), the grace never having begun; then it raised UNAVAILABLE. Now run() makes no call and returns."""
    async def go():
        async with AsyncPacerClient(f"127.0.0.1:{free_port()}", timeout=60.0, wait_for_ready=True) as pacer:
            worker = make_worker(pacer, HeldEngine(), prompts(2), shutdown_grace=600.0)
            worker.stop()
            task = asyncio.create_task(worker.run())
            done, _ = await asyncio.wait({task}, timeout=CONDITION_TIMEOUT)
            assert done, "run() after stop() waits for a server that is not there"
            return task.result()

    stats = asyncio.run(go())
    assert stats.groups_started == 0, stats


def test_stop_before_run_returns_at_once_without_an_error_where_the_server_answers(server):
    """stop() before run() (or a RolloutWorker stopped as it starts) with the server up: run() raised UNAVAILABLE
    saying the pacer at that address "did not answer" (the first GetState was ended by the stop before its answer
    came), which was false. Now it returns its empty stats; the pacer saw no dispatch."""
    async def go():
        async with AsyncPacerClient(server.address, timeout=60.0, wait_for_ready=True) as pacer:
            worker = make_worker(pacer, HeldEngine(), prompts(2), shutdown_grace=600.0)
            worker.stop()
            stats = await asyncio.wait_for(worker.run(), CONDITION_TIMEOUT)
            return stats, await pacer.state()

    stats, state = asyncio.run(go())
    assert stats.groups_started == 0 and state.running == 0 and state.dispatched == 0, (stats, state)


def test_stop_ends_a_submit_waiting_for_a_dead_server_when_the_grace_runs_out(tmp_path, caplog):
    """kill -9, then stop(): a Submit waiting for a server (wait_for_ready) ended at its deadline (60 s here), not
    at shutdown_grace; what it carried is given up (counted and logged; the server refused nothing), and run()
    returns."""
    overrides = [*core_overrides("no-window", B=2, stale=1.0, N=2, M=4), f"server.state_dir={tmp_path / 'state'}"]
    server = ServerProcess(tmp_path, *overrides).start()
    try:
        async def go():
            async with AsyncPacerClient(server.address, timeout=60.0, wait_for_ready=True) as pacer:
                engine = HeldEngine()
                worker = make_worker(pacer, engine, prompts(6), shutdown_grace=1.0)
                task = asyncio.create_task(worker.run())
                await until(lambda: len(engine.held) == 4, "4 requests held in the engine (2 groups x 2)")
                server.process.kill()
                server.process.wait(CONDITION_TIMEOUT)
                engine.auto_release = True
                engine.release_all()
                await until(lambda: "Submit" in worker._calls_in_flight.values(), "a Submit waiting for a server")
                worker.stop()
                return await asyncio.wait_for(task, CONDITION_TIMEOUT)  # the grace, not the Submit's 60 s

        with caplog.at_level(logging.WARNING, logger="coda_worker"):
            stats = asyncio.run(go())
        assert stats.trajectories_given_up == 4 and stats.groups_given_up == 2, stats
        assert stats.trajectories_refused == 0 and stats.trajectories_submitted == 0 and stats.groups_done == 0, stats
        # Said by the Submit cut at the grace, or by run() giving its groups up then, whichever comes first.
        assert any("not answered within the 1 s shutdown grace after stop()" in r.getMessage()
                   or "2 groups not acknowledged within the 1 s grace, given up" in r.getMessage()
                   for r in caplog.records)
    finally:
        server.close()


def test_a_server_outage_is_logged_once_as_it_begins_and_once_as_it_ends(tmp_path, caplog):
    """kill -9 under a worker whose client fails fast (no wait_for_ready): its Dispatches, Submits, keep-alives and
    control stream fail every few seconds while no server is up. The outage is one warning as it begins and one info
    line when a server answers again; the retries between are at debug level."""
    caplog.set_level(logging.DEBUG, logger="coda_worker")
    overrides = [*core_overrides("no-window", B=2, stale=1.0, N=2, M=4), f"server.address=127.0.0.1:{free_port()}",
                 f"server.state_dir={tmp_path / 'state'}"]
    server = ServerProcess(tmp_path, *overrides).start()

    def retries() -> list[logging.LogRecord]:  # at any level: the old worker warned at each
        return [r for r in caplog.records if r.name == "coda_worker" and "not answered" in r.getMessage()]

    try:
        async def go():
            async with running_worker(server.address, prompts(6)) as (pacer, engine, worker, task):
                server.process.kill()
                server.process.wait(CONDITION_TIMEOUT)
                engine.auto_release = True
                engine.release_all()  # their Submits fail while no server is up
                await until(lambda: len(retries()) >= 4, "four calls retried while the server is away")
                restarted = ServerProcess(tmp_path, *overrides).start()
                try:
                    await until(lambda: any("answers again" in r.getMessage() for r in caplog.records),
                                "the worker to find the server back")
                    worker.stop()
                    stats = await asyncio.wait_for(task, CONDITION_TIMEOUT)
                finally:
                    restarted.close()
            return stats

        stats = asyncio.run(go())
        assert stats.trajectories_refused == 0, stats
        lines = [(r.levelno, r.getMessage()) for r in caplog.records if r.name == "coda_worker"]
        away = [m for level, m in lines if level >= logging.WARNING]
        assert len(away) == 1 and f"the pacer at {server.address} is away" in away[0], away
        assert {r.levelno for r in retries()} == {logging.DEBUG}
        [back] = [m for level, m in lines if level == logging.INFO and "answers again" in m]
        assert re.search(r"answers again after \d+\.\d s$", back), back
    finally:
        server.close()


SIGNALLED_WORKER = """
import json, sys
from coda_worker import FakeEngine, ListPromptSource, RolloutWorker
from coda_worker.worker import Prompt
engine = FakeEngine(first_token_seconds=float(sys.argv[2]), mean_tokens=4, length_sigma=0)
source = ListPromptSource([Prompt(f"p{i}", [1, 2, 3]) for i in range(1000)])
stats = RolloutWorker(sys.argv[1], engine, source, max_groups=2, shutdown_grace=30).run()
print(json.dumps({"groups_done": stats.groups_done, "refused": stats.trajectories_refused}))
"""


def _signalled_worker(address: str, request_seconds: float) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", SIGNALLED_WORKER, address, str(request_seconds)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=Path(__file__).parent)


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_signal_stops_a_blocking_worker_as_stop_does(server, signum):
    """Ctrl-C, or a container's SIGTERM, ended RolloutWorker.run() at once with a traceback: its running groups
    stayed held on the server (until the worker's liveness ran out) and what they had generated was lost. Now the
    first signal stops it as stop() does: what runs is finished and submitted, and run() returns."""
    with PacerClient(server.address) as pacer:
        dispatched = pacer.state().dispatched
        worker = _signalled_worker(server.address, 0.5)
        try:
            deadline = time.monotonic() + CONDITION_TIMEOUT
            while pacer.state().running == 0:
                assert time.monotonic() < deadline and worker.poll() is None, "the worker never dispatched"
                time.sleep(0.02)
            worker.send_signal(signum)
            out, err = worker.communicate(timeout=CONDITION_TIMEOUT)
        finally:
            worker.kill()
        assert worker.returncode == 0, err
        stats = json.loads(out.splitlines()[-1])
        assert stats["groups_done"] >= 1 and stats["refused"] == 0
        assert f"{signal.Signals(signum).name}: stopping: nothing more is dispatched" in err
        state = pacer.state()
        assert state.running == 0 and state.dispatched - dispatched == stats["groups_done"]  # none left held


def test_a_second_signal_ends_a_stopping_worker_at_once(server):
    with PacerClient(server.address) as pacer:
        worker = _signalled_worker(server.address, 600.0)  # requests that would outlast the 30 s grace
        lines: list[str] = []
        reader = threading.Thread(target=lambda: lines.extend(iter(worker.stderr.readline, "")), daemon=True)
        reader.start()
        try:
            deadline = time.monotonic() + CONDITION_TIMEOUT
            while pacer.state().running == 0:
                assert time.monotonic() < deadline and worker.poll() is None, "the worker never dispatched"
                time.sleep(0.02)
            worker.send_signal(signal.SIGTERM)
            while not any("SIGTERM: stopping" in line for line in lines):  # the first was taken: a second is new
                assert time.monotonic() < deadline and worker.poll() is None, f"no stopping line: {lines}"
                time.sleep(0.02)
            worker.send_signal(signal.SIGTERM)
            worker.wait(CONDITION_TIMEOUT)  # not the grace's 30 s, nor the requests' 600
            reader.join(CONDITION_TIMEOUT)
        finally:
            worker.kill()
        assert worker.returncode != 0 and any("KeyboardInterrupt" in line for line in lines)


def test_blocking_rollout_worker_runs_a_blocking_engine_on_threads(server):
    class BlockingEngine:
        def __init__(self):
            self.calls = 0
            self.lock = threading.Lock()

        def generate(self, request):
            with self.lock:
                self.calls += 1
            return Generation([1, 2], [-0.1, -0.2], FinishReason.LENGTH)

        def abort(self, request_ids):
            pass

    engine = BlockingEngine()
    worker = RolloutWorker(server.address, engine, prompts(3), sampling=SamplingParams(max_tokens=2),
                           max_groups=2, dispatch_wait=0.5)
    stats = worker.start().join(timeout=60)
    assert stats is not None and stats.groups_done == 3 and engine.calls == 6
    with PacerClient(server.address) as pacer:
        groups = pacer.collect(3, wait=5)
    assert {t.metadata["finish_reason"] for g in groups for t in g.trajectories} == {"length"}


KILLED_WORKER = r'''
import asyncio, json, sys
from coda_client import AsyncPacerClient
from coda_worker.engines import FinishReason, Generation
from coda_worker import worker as worker_module
from coda_worker.worker import AsyncRolloutWorker, ListPromptSource, Prompt
from coda_worker.engines import SamplingParams

class OneHangs:
    """Trajectory 1 of every group never ends; trajectory 0 ends at once."""
    async def generate(self, request):
        if "#1-" in request.request_id:
            await asyncio.Event().wait()
        return Generation([5, 6, 7], [-1.0, -1.0, -1.0], FinishReason.STOP)
    async def abort(self, ids):
        pass

log = open(sys.argv[2], "a", buffering=1)
def acknowledged(trajectories):
    for t in trajectories:
        log.write(t.trajectory_id + "\n")

async def main():
    async with AsyncPacerClient(sys.argv[1]) as pacer:
        source = ListPromptSource([Prompt(f"k{i}", [1, 2]) for i in range(2)])
        await AsyncRolloutWorker(pacer, OneHangs(), source, max_groups=2, dispatch_wait=0.5,
                                 sampling=SamplingParams(max_tokens=8), on_submitted=acknowledged).run()
asyncio.run(main())
'''


def test_a_killed_worker_loses_no_acknowledged_work(tmp_path):
    overrides = core_overrides("no-window", B=2, stale=1.0, N=2, M=4)
    with ServerProcess(tmp_path, *overrides, "server.inflight_lease_seconds=1.0",
                       f"server.state_dir={tmp_path / 'state'}") as server:
        script, log = tmp_path / "worker.py", tmp_path / "acknowledged.txt"
        script.write_text(KILLED_WORKER)
        worker = subprocess.Popen([sys.executable, str(script), server.address, str(log)], cwd=REPO,
                                  env={**os.environ, "PYTHONPATH": str(REPO)})
        try:
            deadline = time.monotonic() + CONDITION_TIMEOUT
            while not (log.exists() and len(log.read_text().split()) >= 2):
                assert worker.poll() is None, "the worker exited early"
                assert time.monotonic() < deadline, "the worker acknowledged nothing"
                time.sleep(0.02)
        finally:
            worker.kill()
            worker.wait(10)
        acknowledged = set(log.read_text().split())
        with PacerClient(server.address) as pacer:
            deadline = time.monotonic() + CONDITION_TIMEOUT
            while pacer.state().expired < 2:  # the dead worker's groups run out of their lease
                assert time.monotonic() < deadline, "the dead worker's groups were never reclaimed"
                time.sleep(0.05)
            reset = pacer.reset("abort", wait=0)
    returned = {t.trajectory_id for g in reset.expired for t in g.trajectories}
    assert acknowledged == {"k0#0", "k1#0"} and acknowledged <= returned
    assert all(t.token_ids == [5, 6, 7] for g in reset.expired for t in g.trajectories)


def test_restored_groups_are_continued_from_their_partial_tokens_under_the_new_weights(tmp_path):
    with ServerProcess(tmp_path, *core_overrides("no-window", B=2, stale=1.0, N=2, M=4, continue_restored=True)) as server:
        async def go():
            async with running_worker(server.address, prompts(2)) as (pacer, engine, worker, task):
                reset = await pacer.reset("abort", wait=CONDITION_TIMEOUT, resume=True, weight_version=1)
                engine.auto_release = True
                groups = await pacer.collect(2, wait=CONDITION_TIMEOUT)
                stats = await asyncio.wait_for(task, CONDITION_TIMEOUT)  # the source is exhausted: it ends
            return engine, reset, groups, stats

        engine, reset, groups, stats = asyncio.run(go())
    assert reset.kept_prompt_ids == ["p0", "p1"] and reset.restored == []
    assert sorted(g.prompt_id for g in groups) == ["p0", "p1"]
    for group in groups:
        for t in group.trajectories:
            assert t.status == TrajectoryStatus.COMPLETED and t.metadata["continued"] == "true"
            # 3 tokens before the abort (positions 3..5 after the 3-token prompt), then 5 after it.
            assert t.token_ids == list(range(3, 3 + FIRST_TOKENS + FIRST_TOKENS + LATER_TOKENS))
            assert t.segment_lengths == [FIRST_TOKENS, FIRST_TOKENS + LATER_TOKENS]
            assert t.segment_weight_versions == [0, 1]
            assert (t.start_weight_version, t.end_weight_version) == (0, 1)
    continued_requests = engine.requests[4:]
    assert len(continued_requests) == 4
    for request in continued_requests:  # prompt + the partial response, with what is left of the budget
        assert len(request.input_ids) == 3 + FIRST_TOKENS and request.max_tokens == 16 - FIRST_TOKENS
    assert stats.groups_continued == 2 and stats.trajectories_continued == 4


def test_a_prompt_with_its_own_budget_bounds_its_responses_continuations_included(tmp_path):
    budgets = {"p0": 4, "p1": None}  # p1: the worker's sampling.max_tokens (16)
    source = ListPromptSource([Prompt(f"p{i}", [100 + i, 7, 7], max_tokens=budgets[f"p{i}"]) for i in range(2)])
    with ServerProcess(tmp_path, *core_overrides("no-window", B=2, stale=1.0, N=2, M=4, continue_restored=True)) as server:
        async def go():
            async with running_worker(server.address, source) as (pacer, engine, worker, task):
                await pacer.reset("abort", wait=CONDITION_TIMEOUT, resume=True, weight_version=1)
                engine.auto_release = True
                engine.release_all()
                groups = await pacer.collect(2, wait=CONDITION_TIMEOUT)
                await asyncio.wait_for(task, CONDITION_TIMEOUT)
            return engine, groups

        engine, groups = asyncio.run(go())
    asked = {}
    for request in engine.requests:
        asked.setdefault(request.request_id.split("#")[0].rsplit("-", 1)[-1], []).append(request.max_tokens)
    # First requests ask for the whole budget; the continuations (3 tokens in) for what is left of it.
    assert asked == {"p0": [4, 4, 4 - FIRST_TOKENS, 4 - FIRST_TOKENS], "p1": [16, 16, 16 - FIRST_TOKENS, 16 - FIRST_TOKENS]}
    lengths = {g.prompt_id: sorted(len(t.token_ids) for t in g.trajectories) for g in groups}
    assert lengths == {"p0": [4, 4], "p1": [FIRST_TOKENS * 2 + LATER_TOKENS] * 2}


def test_a_prompt_budget_below_one_token_is_refused():
    with pytest.raises(ValueError, match="prompt 'p0': max_tokens 0 must be an integer >= 1 or None"):
        Prompt("p0", [1, 2], max_tokens=0)


@pytest.mark.parametrize("keepalive", [True, False])
def test_keep_alive_holds_the_leases_of_groups_still_generating(tmp_path, keepalive):
    lease = 1.0
    with ServerProcess(tmp_path, *core_overrides("no-window", B=2, stale=1.0, N=2, M=4),
                       f"server.inflight_lease_seconds={lease}") as server:
        async def go():
            engine = HeldEngine()
            async with AsyncPacerClient(server.address) as pacer:
                # Without keep-alive (the control case) the first renewal would come long after the lease.
                worker = make_worker(pacer, engine, prompts(2), keepalive_seconds=None if keepalive else 3600.0)
                task = asyncio.create_task(worker.run())
                await until(lambda: len(engine.held) == 4, "4 requests held")
                if keepalive:
                    # Three renewals at a third of the lease each: the requests have been held past one lease.
                    await until(lambda: worker.stats.keepalive_calls >= 4, "four KeepAlive calls")
                else:
                    await until_state(pacer, lambda st: st.expired == 2, "the leases to run out")
                state = await pacer.state()
                engine.release_all()
                worker.stop()
                stats = await asyncio.wait_for(task, CONDITION_TIMEOUT)
            return state, stats

        state, stats = asyncio.run(go())
    if keepalive:
        assert (state.expired, state.running) == (0, 2)
        assert stats.trajectories_submitted == 4 and stats.trajectories_refused == 0
    else:
        assert state.expired == 2 and stats.trajectories_refused == 4  # late Submits refused: LEASE_EXPIRED


def test_prompt_source_shards_hand_out_each_prompt_once_and_find_every_prompt():
    source = prompts(5)
    shards = [source.shard(i, 2) for i in range(2)]
    taken = [[p.prompt_id for p in shard.take(10)] for shard in shards]
    assert taken == [["p0", "p2", "p4"], ["p1", "p3"]]
    assert shards[1].get("p4").input_ids == [104, 7, 7]  # a restored group may come from the other shard
    shards[0].give_back([Prompt("p2", [1]), Prompt("p4", [1])])
    assert [p.prompt_id for p in shards[0].take(1)] == ["p2"]
    with pytest.raises(KeyError, match="'nope' is not in this source"):
        source.get("nope")
    with pytest.raises(ValueError, match="appears twice"):
        ListPromptSource([Prompt("a", [1]), Prompt("a", [2])])
    with pytest.raises(ValueError, match="max_groups 0 must be an integer >= 1"):
        AsyncRolloutWorker(None, HeldEngine(), source, max_groups=0)


def test_a_group_settled_late_does_not_drop_the_continuation_of_its_prompt_that_replaced_it():
    """The server released a group from this worker (silent past its grace: SIGSTOP, a partition) and handed the
    prompt back to it as a continuation under a new seq; the old group's queued Submit settles afterwards (refused
    as a stale dispatch, or accepted). The continuation must stay tracked: forgotten, the worker could end with it
    running, and the group would wait for a worker forever (a chaos run on Python 3.13 stalled so)."""
    worker = AsyncRolloutWorker(None, engine=HeldEngine(), source=ListPromptSource([]), worker_id="w")
    prompt = Prompt("p", [1, 2, 3])
    old = worker_module._Group(prompt, 0, [worker_module._Traj("p#0")], False, seq=1)
    continuation = worker_module._Group(prompt, 0, [worker_module._Traj("p#0")], True, seq=2)
    worker._groups["p", 1] = old
    worker._groups["p", 2] = continuation  # what _launch does with the continuation
    # Both run here meanwhile: both count against max_groups, both are aborted at a PAUSE, cancelled at the end.
    worker._acknowledged([(old, old.trajectories[0])])
    assert worker._groups == {("p", 2): continuation}
    worker._acknowledged([(continuation, continuation.trajectories[0])])
    assert worker._groups == {}


def test_a_worker_whose_prompts_are_done_stays_to_continue_a_group_released_from_a_dead_worker(tmp_path, caplog):
    """A finite run: this worker's prompts are done while another worker, which then dies, still holds a group.
    Released at the dead worker's liveness grace, the group is kept for continuation; the worker that finished
    must still be there to take it (ended, it would leave the group waiting, and the trainer with it, for good).
    It ends once nothing runs."""
    grace = 3.0  # seconds: the finished worker reaches its last Dispatch well before the dead one's group is released
    overrides = (*core_overrides("no-window", B=2, stale=1.0, N=2, M=2, continue_restored=True),
                 f"server.worker_liveness_seconds={grace}", "server.inflight_lease_seconds=600")
    with ServerProcess(tmp_path, *overrides) as server:
        watched_worker_dispatching(server.address, "dead-worker", "orphan")()  # one group, then silence

        async def go():
            engine = HeldEngine()
            engine.auto_release = True
            async with AsyncPacerClient(server.address) as pacer:
                # Workers share the prompts and each takes its shard: this one takes p0, and finds every prompt.
                source = ListPromptSource([Prompt("p0", [100, 7, 7]), Prompt("orphan", [101, 7, 7])]).shard(0, 2)
                worker = make_worker(pacer, engine, source)
                task = asyncio.create_task(worker.run())
                await until(lambda: worker.stats.groups_done == 1, "the worker's own group to be acknowledged")
                finished = await pacer.state()  # its prompts are done; the dead worker's group not yet released
                stats = await asyncio.wait_for(task, CONDITION_TIMEOUT)
                groups = await pacer.collect(2, wait=CONDITION_TIMEOUT)
                return finished, stats, groups, await pacer.state()

        with caplog.at_level(logging.INFO, logger="coda_worker"):
            finished, stats, groups, state = asyncio.run(go())
    assert (finished.running, finished.expired, finished.restored_kept) == (1, 0, 0), finished
    assert any("its prompts are done; it stays to continue groups" in r.getMessage() for r in caplog.records)
    assert stats.groups_done == 2 and stats.groups_continued == 1
    assert sorted(g.prompt_id for g in groups) == ["orphan", "p0"]
    assert all(t.status == TrajectoryStatus.COMPLETED for g in groups for t in g.trajectories)
    assert (state.running, state.restored_kept) == (0, 0), state
