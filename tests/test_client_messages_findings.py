"""Client and worker-kit messages users found untrue or unhelpful, each over a real server (or what answers in its
place): a web server at the address, a Restore a worker missed, a job end a Dispatch answer said first, and a health
service name the server does not know."""
from __future__ import annotations

import asyncio
import logging
import os
import subprocess
import sys

import pytest

from coda_client import AsyncPacerClient, ControlEventType, PacerClient
from coda_client.errors import ServerGoneError, UnavailableError
from coda_worker.worker import AsyncRolloutWorker
from conftest import core_overrides
from server_harness import REPO_ROOT, ServerProcess
from test_worker_loop import CONDITION_TIMEOUT, HeldEngine, make_worker, prompts, until
from test_worker_user_findings import HeldEventStream, web_server

NOT_GRPC = "something other than a gRPC server answers at that address"
WRONG_PORT = "a wrong port? The pacer listens at its server.address"
OVERRIDES = core_overrides("no-window", B=2, stale=1.0, N=2, M=4)


def command(*args: str) -> subprocess.CompletedProcess:
    """coda-client as a user runs it, importing this checkout's code."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("CODA_", "GRPC_VERBOSITY", "GRPC_TRACE"))}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))
    return subprocess.run([sys.executable, "-m", "coda_client.cli", *args], capture_output=True, text=True,
                          env=env, cwd=REPO_ROOT, timeout=120)


def worker_lines(caplog, level: int = logging.INFO) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "coda_worker" and r.levelno >= level]


@pytest.fixture
def server(tmp_path):
    with ServerProcess(tmp_path, *OVERRIDES) as process:
        yield process


# ---------------------------------------------------------------------- a web server at the pacer's address

@pytest.fixture
def web_address(tmp_path):
    with web_server(tmp_path) as address:
        yield address


def test_the_clients_calls_say_a_web_server_answers_and_batches_does_not_wait_for_it(web_address):
    """PacerClient.state() said `cannot reach the pacer ... Failed parsing HTTP/2 (...)` and batches() asked again for
    `reconnect` seconds, then ServerGoneError. Now the error says in words that no gRPC server answers there, with the
    likely fix, and batches() raises it at once: waiting does not change the address."""
    with PacerClient(web_address, timeout=5.0) as pacer:
        with pytest.raises(UnavailableError) as state_error:
            pacer.state()
        with pytest.raises(UnavailableError) as batches_error:
            with pacer.batches(2, reconnect=10.0) as batches:
                next(iter(batches))
    for error in (state_error.value, batches_error.value):
        assert NOT_GRPC in str(error) and WRONG_PORT in str(error), str(error)
    assert not isinstance(batches_error.value, ServerGoneError), str(batches_error.value)


def test_the_async_clients_batches_does_not_wait_for_a_web_server(web_address):
    async def go():
        async with AsyncPacerClient(web_address, timeout=5.0) as pacer:
            async with pacer.batches(2, reconnect=10.0) as batches:
                async for _ in batches:
                    break

    with pytest.raises(UnavailableError) as error:
        asyncio.run(go())
    assert NOT_GRPC in str(error.value) and not isinstance(error.value, ServerGoneError), str(error.value)


@pytest.mark.parametrize("args", [("state",), ("watch",), ("health",)], ids=["state", "watch", "health"])
def test_coda_client_says_a_web_server_answers_at_the_address(web_address, args):
    done = command("--address", web_address, "--timeout", "5", *args)
    assert done.returncode != 0, done
    assert NOT_GRPC in done.stderr and WRONG_PORT in done.stderr, done.stderr


# ---------------------------------------------------------------------- a Restore a worker missed

def _restore_event(pacer: PacerClient) -> tuple[object, object]:
    """The trainer's run: checkpoint at step 3 (weight version 3), on to step 5, Restore, then on to step 7 at weight
    version 9. Returns the Restore's live PAUSE (as a connected worker hears it) and the STATE a worker reconnecting
    afterwards gets."""
    for version in (1, 2, 3):
        pacer.reset("abort", wait=5, resume=True, weight_version=version)
    checkpoint = pacer.checkpoint()
    for version in (4, 5):
        pacer.reset("abort", wait=5, resume=True, weight_version=version)
    with pacer.watch() as stream:
        assert next(stream).type == ControlEventType.STATE
        pacer.restore(checkpoint)
        live = next(event for event in stream if event.restores == 1)
    for version in (6, 7, 8, 9):
        pacer.reset("abort", wait=5, resume=True, weight_version=version)
    state = pacer.state()
    assert (state.step, state.weight_version, state.restores) == (7, 9, 1), state
    with pacer.watch() as stream:
        reconnect = next(stream)
    assert (reconnect.type, reconnect.step, reconnect.weight_version) == (ControlEventType.STATE, 7, 9), reconnect
    return live, reconnect


def test_a_worker_says_the_servers_values_after_a_restore_not_as_the_checkpoints(server, caplog):
    """After a reconnect a worker logged `the server restored a checkpoint (step 7, weight version 9)`: the server's
    values now, not the checkpoint's (step 3, version 3). The line now says what they are."""
    with PacerClient(server.address) as pacer:
        live, reconnect = _restore_event(pacer)

    async def hear(event) -> None:
        worker = AsyncRolloutWorker(None, HeldEngine(), prompts(1), worker_id="w")
        await worker._on_event(event)

    with caplog.at_level(logging.INFO, logger="coda_worker"):
        asyncio.run(hear(reconnect))
        asyncio.run(hear(live))
    said = [m for m in worker_lines(caplog, logging.WARNING) if "checkpoint" in m]
    assert len(said) == 2, worker_lines(caplog)
    assert said[0].startswith("w: the server was restored from a checkpoint since this worker last heard it; it is "
                              "now at step 7, weight version 9: aborting 0 groups"), said
    assert said[1].startswith("w: the server restored a checkpoint; it is now at step 3, weight version 3:"), said
    assert not [m for m in said if "checkpoint (step" in m], said


# ---------------------------------------------------------------------- a job end a Dispatch answer says first

class JobEndFirstByDispatch(AsyncPacerClient):
    """Holds the control stream's JOB_ENDED back until a Dispatch answer said the job ended, as happens when that
    answer overtakes the event."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.dispatch_said_end = asyncio.Event()

    async def dispatch(self, *args, **kwargs):
        result = await super().dispatch(*args, **kwargs)
        if result.job_ended:
            self.dispatch_said_end.set()
        return result

    def watch(self):
        return HeldEventStream(super().watch(), ControlEventType.JOB_ENDED, self.dispatch_said_end)


def test_a_job_end_said_by_dispatch_first_is_not_called_modeless(server, caplog):
    """end_job("abort") while a worker's Dispatch waits: its answer's job_ended came before the control stream's
    JOB_ENDED, and the kit logged `JOB_ENDED (mode not said by the server: finishing)`, then aborted at the event.
    Now it says where it learned of the end, and the mode when the event brings it."""
    async def go():
        engine = HeldEngine()
        async with AsyncPacerClient(server.address) as trainer, JobEndFirstByDispatch(server.address) as pacer:
            # Room for more groups than the window lets out (4): a Dispatch waits when the job ends.
            worker = make_worker(pacer, engine, prompts(10), max_groups=6, dispatch_wait=30)
            task = asyncio.create_task(worker.run())
            await until(lambda: len(engine.held) == 8, "the window's four groups held in the engine")
            await trainer.end_job("abort", wait=0)
            stats = await asyncio.wait_for(task, CONDITION_TIMEOUT)
            return stats, pacer.dispatch_said_end.is_set()

    with caplog.at_level(logging.INFO, logger="coda_worker"):
        stats, by_dispatch = asyncio.run(go())
    assert by_dispatch
    lines = [m for m in worker_lines(caplog) if "the job ended (from" in m or "JOB_ENDED" in m]
    assert not [m for m in lines if "mode not said" in m], lines
    assert len(lines) == 2, lines
    assert "the job ended (from a Dispatch answer); its mode comes on the control stream" in lines[0], lines
    assert "JOB_ENDED (abort), the mode of the end a Dispatch answer said" in lines[1], lines
    assert stats.trajectories_aborted == 8, stats


# ---------------------------------------------------------------------- a health service name the server lacks

def test_health_of_an_unknown_service_says_the_names_the_server_serves(server):
    """`coda-client health --service nosuch` printed `nosuch: NOT_FOUND` and `no health answer from ...: NOT_FOUND:`,
    though the server answered. It now says the server knows no such service, names those it serves, and exits 1."""
    done = command("--address", server.address, "health", "--service", "nosuch")
    assert done.returncode == 1, done
    assert done.stdout == ('nosuch: the server knows no health service of that name; it serves: "", "readiness", '
                           '"liveness", "coda.pacer.v1.RolloutPacer"\n'), done
    assert "no health answer" not in done.stderr, done.stderr
    served = command("--address", server.address, "health", "--service", "liveness")
    assert (served.returncode, served.stdout) == (0, "liveness: SERVING\n"), served
