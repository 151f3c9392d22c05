"""A rollout worker whose own code fails: a reward function that raises fails only the trajectories it could not score
(FAILED, saying why), and one that fails on every trajectory stops the worker with RewardFunctionError; a helper task
that dies stops the worker with WorkerFailedError. Before, the first reward error killed the submitting task without
a word, and the worker held its groups for ever, dispatching nothing. An engine that fails every request stops the
worker too (EngineFailedError), instead of turning every prompt into FAILED trajectories. Arguments and parts a worker could never run
with are refused when it is made, naming what goes there."""
from __future__ import annotations

import asyncio
import logging

import pytest

from coda_client import AsyncPacerClient, TrajectoryStatus
from coda_worker import EngineError, EngineFailedError, RewardFunctionError, WorkerFailedError
from conftest import core_overrides
from server_harness import ServerProcess
from coda_worker import worker as worker_module
from test_worker_loop import HeldEngine, make_worker, prompts, until

RUN_TIMEOUT = 60.0


@pytest.fixture
def server(tmp_path):
    with ServerProcess(tmp_path, *core_overrides("no-window", B=2, stale=1.0, N=2, M=4)) as process:
        yield process


def released_engine() -> HeldEngine:
    engine = HeldEngine()
    engine.auto_release = True
    return engine


def run_until_stopped(server, error_class, engine, **options):
    """A worker over 50 prompts, run until it stops with `error_class`: its stats, that error and the server's state."""
    async def go():
        async with AsyncPacerClient(server.address) as pacer:
            worker = make_worker(pacer, engine, prompts(50), **options)
            with pytest.raises(error_class) as stopped:
                await asyncio.wait_for(worker.run(), RUN_TIMEOUT)
            return worker.stats, stopped.value, await pacer.state()

    return asyncio.run(go())


def test_a_reward_function_that_raises_fails_only_what_it_could_not_score(server, caplog):
    def reward(prompt, tokens) -> float:
        if prompt.prompt_id in ("p1", "p3"):
            raise ValueError(f"cannot parse the answer to {prompt.prompt_id}")
        return 1.0

    async def go():
        async with AsyncPacerClient(server.address) as pacer:
            worker = make_worker(pacer, released_engine(), prompts(4), reward=reward)
            stats = await asyncio.wait_for(worker.run(), RUN_TIMEOUT)
            return stats, await pacer.collect(4, wait=0, allow_partial=True), await pacer.state()

    with caplog.at_level(logging.ERROR, logger="coda_worker"):
        stats, groups, state = asyncio.run(go())
    assert stats.reward_errors == 4 and stats.trajectories_failed == 4 and stats.trajectories_submitted == 8
    assert sorted(g.prompt_id for g in groups) == ["p0", "p2"]  # scored; the status filter dropped p1 and p3
    assert all(t.reward == 1.0 and t.status == TrajectoryStatus.COMPLETED for g in groups for t in g.trajectories)
    assert state.filtered == 2 and state.submitted == 8  # nothing vanished: the failed groups are counted
    failures = [r for r in caplog.records if "the reward function failed: ValueError: cannot parse" in r.getMessage()]
    assert len(failures) == 4 and sum(r.exc_info is not None for r in failures) == 1  # one traceback, then counted


def test_the_failed_trajectory_says_why(server):
    async def go():
        async with AsyncPacerClient(server.address) as pacer:
            submitted = []
            worker = make_worker(pacer, released_engine(), prompts(1), reward=lambda prompt, tokens: None,
                                 on_submitted=submitted.extend)
            await asyncio.wait_for(worker.run(), RUN_TIMEOUT)
            return submitted

    submitted = asyncio.run(go())
    assert len(submitted) == 2 and all(t.status == TrajectoryStatus.FAILED for t in submitted)
    assert submitted[0].metadata["error"].startswith("the reward function failed: TypeError: float() argument")


def test_a_reward_function_that_never_works_stops_the_worker(server):
    def reward(prompt, tokens) -> float:
        raise RuntimeError("the verifier's sandbox is not installed")

    stats, error, state = run_until_stopped(server, RewardFunctionError, released_engine(), reward=reward,
                                            reward_failure_limit=3)
    assert "failed on 3 completed trajectories in a row (reward_failure_limit 3)" in str(error)
    assert "RuntimeError: the verifier's sandbox is not installed" in str(error)
    # It stopped within its first groups, and what it held was submitted (FAILED), not dropped.
    assert stats.groups_started <= 4 and state.submitted == stats.trajectories_submitted == stats.trajectories_failed
    assert stats.trajectories_refused == 0


@pytest.mark.parametrize("argument, value, message", [
    ("reward_failure_limit", 0, "reward_failure_limit 0 must be an integer >= 1"),
    ("engine_failure_limit", 1.5, "engine_failure_limit 1.5 must be an integer >= 1"),
    ("max_groups", 2.5, "max_groups 2.5 must be an integer >= 1"),  # failed in run() with a bare TypeError
    ("engine_retries", -1, "engine_retries -1 must be an integer >= 0"),
    ("keepalive_seconds", 0, "keepalive_seconds 0 must be a number of seconds > 0"),  # renewed without a pause
    ("shutdown_grace", -1, "shutdown_grace -1 must be a number of seconds >= 0"),
    ("engine_wait", "10", "engine_wait '10' must be a number of seconds >= 0"),
    ("dispatch_wait", 0, "dispatch_wait 0 must be a number of seconds > 0"),
    ("generate_timeout", 0, "generate_timeout 0 must be a number of seconds > 0"),
])
def test_a_worker_argument_out_of_its_range_is_refused_when_the_worker_is_made(argument, value, message):
    with pytest.raises(ValueError, match=message.replace(".", r"\.")):
        make_worker(None, released_engine(), prompts(1), **{argument: value})


def test_a_helper_task_that_dies_stops_the_worker_and_run_raises(server, caplog):
    async def broken_keep_alive() -> None:
        raise RuntimeError("keep-alive bug")

    async def go():
        async with AsyncPacerClient(server.address) as pacer:
            worker = make_worker(pacer, released_engine(), prompts(50))
            worker._keep_alive = broken_keep_alive
            with pytest.raises(WorkerFailedError) as stopped:
                await asyncio.wait_for(worker.run(), RUN_TIMEOUT)
            return stopped.value

    with caplog.at_level(logging.ERROR, logger="coda_worker"):
        error = asyncio.run(go())
    assert "keepalive task failed (RuntimeError: keep-alive bug); the worker stopped" in str(error)
    assert isinstance(error.__cause__, RuntimeError)
    assert any(r.exc_info is not None and "keep-alive bug" in r.getMessage() for r in caplog.records)


def test_a_worker_made_of_the_wrong_parts_is_refused_when_made_naming_what_goes_there():
    """Each failed only in run(): 'list' object has no attribute 'take', FakeEngine.ready() missing 'self', an
    AsyncRolloutWorker over a blocking PacerClient awaiting a PacerState."""
    from coda_client import PacerClient
    from coda_worker import AsyncRolloutWorker, FakeEngine, Prompt

    with pytest.raises(TypeError, match=r"source must be a PromptSource \(take and get\), e\.g\. "
                                        r"ListPromptSource\(prompts\), not list"):
        AsyncRolloutWorker(None, FakeEngine(), [Prompt("p0", [1])])
    with pytest.raises(TypeError, match=r"engine must be an engine object with generate\(\), e\.g\. FakeEngine\(\)"):
        AsyncRolloutWorker(None, FakeEngine, prompts(1))
    with PacerClient("127.0.0.1:50051") as blocking:  # never called
        with pytest.raises(TypeError, match=r"pacer must be an AsyncPacerClient, not PacerClient; a blocking worker "
                                            r"takes the address instead: RolloutWorker\(target"):
            AsyncRolloutWorker(blocking, FakeEngine(), prompts(1))


def test_prompts_without_tokens_or_that_are_not_prompts_are_refused():
    from coda_worker import ListPromptSource, Prompt

    with pytest.raises(ValueError, match=r"prompt 'p0' has no token ids: engines refuse an empty prompt"):
        ListPromptSource([Prompt("p0", [])])
    with pytest.raises(ValueError, match=r"prompt 'p0': input_ids must be the prompt's token ids, not 'hello'"):
        Prompt("p0", "hello")
    with pytest.raises(ValueError, match=r"a prompt's id must be a non-empty str, not ''"):
        Prompt("", [1])
    with pytest.raises(TypeError, match=r"ListPromptSource takes Prompt values, e\.g\. Prompt\('p0', \[1, 2, 3\]\); "
                                        r"item 1 is 'b' \(str\)"):
        ListPromptSource([Prompt("a", [1]), "b"])


def test_a_restored_group_missing_from_the_source_is_failed_not_left_open(tmp_path, caplog):
    """A worker whose source cannot find a restored group's prompt cannot continue its aborted trajectories. It sent
    them back unchanged, which the server takes as duplicates: the continued group stayed open (running) and the
    worker, seeing a group that could still come to it, never ended. They go back FAILED now: the group completes,
    the status filter drops it."""
    from coda_client import Trajectory

    overrides = core_overrides("no-window", B=2, stale=1.0, N=2, M=4, continue_restored=True)
    with ServerProcess(tmp_path, *overrides) as server:
        async def go():
            async with AsyncPacerClient(server.address) as pacer:
                assert (await pacer.dispatch(["elsewhere"])).admitted == ["elsewhere"]
                reset = asyncio.create_task(pacer.reset("abort", wait=30))
                await asyncio.sleep(0)
                await pacer.submit([Trajectory(trajectory_id=f"elsewhere#{i}", prompt_id="elsewhere",
                                               status=TrajectoryStatus.ABORTED, token_ids=[5, 6], logprobs=[-1, -1])
                                    for i in range(2)])
                assert (await reset).kept_prompt_ids == ["elsewhere"]
                await pacer.resume(1)
                worker = make_worker(pacer, released_engine(), prompts(1, prefix="mine"))
                stats = await asyncio.wait_for(worker.run(), RUN_TIMEOUT)
                return stats, await pacer.state()

        with caplog.at_level(logging.ERROR, logger="coda_worker"):
            stats, state = asyncio.run(go())
    assert stats.groups_continued == 1 and stats.groups_done == 2 and stats.trajectories_failed == 2
    assert state.running == 0 and state.filtered == 1  # the group completed, and the filter dropped it: counted
    assert any("restored group 'elsewhere' is not in this worker's prompt source; submitting what it cannot continue "
               "as FAILED" in r.getMessage() for r in caplog.records)


class RefusingEngine:
    """An engine that answers every request with an error, as a gateway does to a wrong API key; or only the requests
    of the prompts named in `refuse`."""

    def __init__(self, refuse: set[str] | None = None) -> None:
        self.refuse = refuse
        self.inner = released_engine()

    async def generate(self, request):
        if self.refuse is None or any(f"-{prompt}#" in request.request_id for prompt in self.refuse):
            raise EngineError("POST /v1/completions: 401 Unauthorized")
        return await self.inner.generate(request)

    async def abort(self, request_ids):
        await self.inner.abort(request_ids)


def test_an_engine_that_fails_every_request_stops_the_worker_within_its_first_groups(server):
    stats, error, state = run_until_stopped(server, EngineFailedError, RefusingEngine(), engine_retries=0,
                                            engine_failure_limit=3)
    assert "the engine failed 3 requests in a row (engine_failure_limit 3" in str(error)
    assert "401 Unauthorized" in str(error)
    assert stats.groups_started <= 4 and state.submitted == stats.trajectories_submitted == stats.trajectories_failed


def test_an_engine_that_fails_some_requests_fails_only_those(server):
    async def go():
        async with AsyncPacerClient(server.address) as pacer:
            worker = make_worker(pacer, RefusingEngine(refuse={"p1"}), prompts(4), engine_retries=0,
                                 engine_failure_limit=3)
            return await asyncio.wait_for(worker.run(), RUN_TIMEOUT)

    stats = asyncio.run(go())
    # p1's two requests are the only failures: two in a row at most, under the limit; the worker goes on.
    assert stats.groups_done == 4 and stats.trajectories_failed == 2 and stats.trajectories_submitted == 8


class SilentEngine:
    """An engine that never answers the requests of the prompts in `silent` and does nothing on an abort (a wedged
    engine, or a user's engine with a bug); the others it answers at once. Records every abort it is sent."""

    def __init__(self, silent: set[str]) -> None:
        self.silent = silent
        self.inner = released_engine()
        self.aborted: list[str] = []
        self.unanswered: list[str] = []

    async def generate(self, request):
        if any(f"-{prompt}#" in request.request_id for prompt in self.silent):
            self.unanswered.append(request.request_id)
            await asyncio.get_running_loop().create_future()  # never set
        return await self.inner.generate(request)

    async def abort(self, request_ids):
        self.aborted.extend(request_ids)


def test_an_engine_that_stops_answering_fails_the_request_at_generate_timeout(server):
    """Without a bound the group of the unanswered requests stays running, held (its lease renewed) for ever, and
    the trainer waits for its mini-batch with no word said."""
    engine = SilentEngine({"p1"})

    async def go():
        async with AsyncPacerClient(server.address) as pacer:
            worker = make_worker(pacer, engine, prompts(4), generate_timeout=0.3, engine_retries=1)
            stats = await asyncio.wait_for(worker.run(), RUN_TIMEOUT)
            return stats, await pacer.state()

    stats, state = asyncio.run(go())
    # p1's two trajectories, each tried twice (engine_retries 1): four requests, each aborted on the engine.
    assert len(engine.unanswered) == 4 and sorted(engine.aborted) == sorted(engine.unanswered)
    assert stats.groups_done == 4 and stats.trajectories_failed == 2 and stats.trajectories_submitted == 8
    assert state.running == 0 and state.filtered == 1  # the group completed as FAILED; the filter dropped it


def test_an_abort_the_engine_ignores_is_said_once_and_ends_at_generate_timeout(server, caplog, monkeypatch):
    """A PAUSE with ABORT while the engine ignores aborts: the worker repeats the abort every half second (one can
    overtake its request) at debug level, says it once at info level and once, as a warning, that the engine does
    not act on it; generate_timeout ends the requests, and the Reset gets their trajectories as ABORTED."""
    monkeypatch.setattr(worker_module, "ABORT_UNANSWERED_WARN_SECONDS", 0.2)
    caplog.set_level(logging.DEBUG, logger="coda_worker")
    engine = SilentEngine({"p0"})

    async def go():
        async with AsyncPacerClient(server.address) as pacer:
            worker = make_worker(pacer, engine, prompts(1), generate_timeout=3.0)
            task = asyncio.create_task(worker.run())
            await until(lambda: len(engine.unanswered) == 2, "p0's two requests sent")
            reset = await pacer.reset("abort", wait=RUN_TIMEOUT)
            await pacer.resume(1)
            return reset, await asyncio.wait_for(task, RUN_TIMEOUT)

    reset, stats = asyncio.run(go())
    assert [g.prompt_id for g in reset.restored] == ["p0"] and reset.dropped_prompt_ids == []
    assert stats.trajectories_aborted == 2
    aborting = [r for r in caplog.records if r.name == "coda_worker" and "aborting 2 engine requests" in r.getMessage()]
    assert len(aborting) >= 3, "the abort is repeated while the requests run"
    assert [r.levelno for r in aborting if r.levelno > logging.DEBUG] == [logging.INFO]
    [warned] = [r.getMessage() for r in caplog.records if r.name == "coda_worker" and r.levelno == logging.WARNING]
    assert "the engine does not act on aborts; each ends at generate_timeout (3 s)" in warned
