"""A rollout worker whose engine cannot be reached: at start (a wrong address, an engine still loading) it waits
before dispatching anything, and mid-run (the engine restarts) it holds its groups and dispatches nothing until the
engine answers again, then sends the requests again; after engine_wait it stops and says so. Before, every request
failed at once and the worker burned through its prompts, submitting them all as FAILED."""
from __future__ import annotations

import asyncio

import pytest

from coda_client import AsyncPacerClient, TrajectoryStatus
from coda_worker.engines import EngineError, EngineUnreachableError, FinishReason, Generation, SamplingParams
from coda_worker.worker import AsyncRolloutWorker
from conftest import core_overrides
from server_harness import ServerProcess
from test_durability_crash import free_port
from test_worker_loop import make_worker, prompts, until


class RestartingEngine:
    """An AsyncEngine that can be down: then its health check and its requests fail as a refused connection does."""

    def __init__(self, *, down: bool = False, down_at_first_request: bool = False) -> None:
        self.down = down
        self.down_at_first_request = down_at_first_request
        self.health_checks_while_down = 0
        self.refused = 0
        self.generated = 0

    async def ready(self) -> None:
        if self.down:
            self.health_checks_while_down += 1
            raise EngineUnreachableError("connection refused")

    async def generate(self, request) -> Generation:
        if self.down_at_first_request:  # the engine dies as the first requests arrive
            self.down_at_first_request, self.down = False, True
        if self.down:
            self.refused += 1
            raise EngineUnreachableError("connection refused")
        self.generated += 1
        return Generation([1, 2, 3], [-0.5, -0.5, -0.5], FinishReason.STOP)

    async def abort(self, request_ids) -> None:
        pass


@pytest.fixture
def server(tmp_path):
    with ServerProcess(tmp_path, *core_overrides("no-window", B=4, stale=1.0, N=2, M=4)) as process:
        yield process


def worker_on(pacer, engine, count: int, **kwargs) -> AsyncRolloutWorker:
    return make_worker(pacer, engine, prompts(count), **kwargs)  # two groups at once, prompts p0, p1, ...


def test_a_worker_waits_for_an_engine_that_is_still_loading_and_takes_no_prompt_meanwhile(server):
    async def go():
        engine = RestartingEngine(down=True)
        async with AsyncPacerClient(server.address) as pacer:
            run = asyncio.create_task(worker_on(pacer, engine, 4).run())
            await until(lambda: engine.health_checks_while_down >= 3, "three health checks of the loading engine")
            dispatched_while_loading = (await pacer.state()).dispatched
            engine.down = False  # loaded
            stats = await asyncio.wait_for(run, 30)
            return dispatched_while_loading, stats, await pacer.state()

    dispatched_while_loading, stats, state = asyncio.run(go())
    assert dispatched_while_loading == 0
    assert (stats.groups_done, stats.trajectories_failed, state.dispatched) == (4, 0, 4)


def test_an_engine_that_never_answers_stops_the_worker_before_it_dispatches_anything(server):
    async def go():
        engine = RestartingEngine(down=True)
        async with AsyncPacerClient(server.address) as pacer:
            with pytest.raises(EngineUnreachableError, match=r"did not answer its health check .* nothing was "
                                                             r"dispatched: connection refused"):
                await asyncio.wait_for(worker_on(pacer, engine, 4, engine_wait=1.0).run(), 30)
            return await pacer.state()

    assert asyncio.run(go()).dispatched == 0


def test_a_restarting_engine_holds_the_workers_groups_until_it_answers_and_nothing_fails(server):
    async def go():
        engine = RestartingEngine(down_at_first_request=True)
        async with AsyncPacerClient(server.address) as pacer:
            run = asyncio.create_task(worker_on(pacer, engine, 6).run())
            await until(lambda: engine.refused >= 1 and engine.health_checks_while_down >= 3,
                        "the engine down for three health checks")
            while_down = await pacer.state()
            engine.down = False  # restarted
            stats = await asyncio.wait_for(run, 30)
            groups = await pacer.collect(4, wait=5) + await pacer.collect(2, wait=5, allow_partial=True)
            return while_down, stats, groups

    while_down, stats, groups = asyncio.run(go())
    assert while_down.dispatched == 2 and while_down.running == 2  # its two groups held, no prompt taken meanwhile
    assert (stats.groups_done, stats.trajectories_failed) == (6, 0)
    assert sorted(g.prompt_id for g in groups) == [f"p{i}" for i in range(6)]
    assert {t.status for g in groups for t in g.trajectories} == {TrajectoryStatus.COMPLETED}


def test_an_engine_gone_for_engine_wait_stops_the_worker_with_the_error(server):
    async def go():
        engine = RestartingEngine(down_at_first_request=True)
        async with AsyncPacerClient(server.address) as pacer:
            worker = worker_on(pacer, engine, 6, engine_wait=1.0)
            with pytest.raises(EngineUnreachableError, match=r"could not be reached for \d+ s \(engine_wait 1 s\); "
                                                             r"the worker stopped"):
                await asyncio.wait_for(worker.run(), 30)
            return worker.stats, await pacer.state()

    stats, state = asyncio.run(go())
    # The two groups it held are settled as FAILED (the status filter drops them); no other prompt was taken.
    assert (stats.groups_done, stats.trajectories_failed, state.dispatched) == (2, 4, 2)


def test_the_http_adapters_tell_an_unreachable_engine_from_one_that_refuses():
    pytest.importorskip("httpx")
    from coda_worker.engines import SGLangEngine, VLLMEngine
    from coda_worker.engines.base import GenerationRequest

    async def go(engine_class):
        async with engine_class(f"http://127.0.0.1:{free_port()}") as engine:  # nothing listens there
            with pytest.raises(EngineUnreachableError, match="GET /health failed: ConnectError"):
                await engine.ready()
            with pytest.raises(EngineUnreachableError):
                await engine.generate(GenerationRequest("r0", [1, 2], 4, SamplingParams(max_tokens=4)))

    for engine_class in (VLLMEngine, SGLangEngine):
        asyncio.run(go(engine_class))


def test_a_reset_while_the_engine_is_away_gets_the_held_groups_as_aborted_at_once(server):
    async def go():
        engine = RestartingEngine(down_at_first_request=True)
        async with AsyncPacerClient(server.address) as pacer:
            worker = worker_on(pacer, engine, 6)
            run = asyncio.create_task(worker.run())
            await until(lambda: engine.health_checks_while_down >= 2, "the engine down for two health checks")
            reset = await pacer.reset("abort", wait=20)  # waits for the workers' ABORTED trajectories
            # The Submit's answer reaches the worker about when the Reset's reaches this caller, either first.
            await until(lambda: worker.stats.trajectories_aborted >= 4, "the ABORTED trajectories acknowledged")
            aborted = worker.stats.trajectories_aborted
            worker.stop()
            await asyncio.wait_for(run, 30)
            return reset, aborted, engine.down

    reset, aborted, still_down = asyncio.run(go())
    assert still_down and aborted == 4  # both held groups' trajectories, while the engine stayed away
    # The Reset settled both groups with their ABORTED trajectories (restored or dropped as the config says).
    assert sorted([g.prompt_id for g in reset.restored] + list(reset.dropped_prompt_ids)) == ["p0", "p1"]


@pytest.mark.parametrize("status, ready", [(200, True), (404, True), (401, True), (503, False)])
def test_an_http_engine_is_ready_when_its_server_answers_but_not_while_it_answers_503(status, ready):
    """503 is what an engine's server answers while its model still loads; a router in front of the engines may
    answer 404 (no /health) or 401, and is up all the same."""
    pytest.importorskip("httpx")
    import http.server
    import threading

    from coda_worker.engines import VLLMEngine

    class Health(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (http.server's name)
            self.send_response(status if self.path == "/health" else 404)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args) -> None:
            pass

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Health)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()

    async def go() -> None:
        async with VLLMEngine(f"http://127.0.0.1:{httpd.server_address[1]}") as engine:
            if ready:
                await engine.ready()
            else:
                with pytest.raises(EngineUnreachableError, match="GET /health answered HTTP 503 .not serving yet."):
                    await engine.ready()

    try:
        asyncio.run(go())
    finally:
        httpd.shutdown()
        httpd.server_close()


def test_an_engine_whose_health_check_answers_with_another_error_is_taken_as_up(server):
    class NoHealthRoute(RestartingEngine):  # e.g. a router in front of the engines, without /health
        async def ready(self) -> None:
            raise EngineError("GET /health answered HTTP 404")

    async def go():
        async with AsyncPacerClient(server.address) as pacer:
            return await asyncio.wait_for(worker_on(pacer, NoHealthRoute(), 2, engine_wait=60).run(), 30)

    stats = asyncio.run(go())
    assert (stats.groups_done, stats.trajectories_failed) == (2, 0)
