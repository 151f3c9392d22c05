"""A user's test of the client installed alone in an engine's environment, used from asyncio: the health probe without
grpcio-health-checking, batches() entered while the server restarts, watch() of a client that waits for ready where
nothing listens, a plain collect() interrupted after it was sent, and trainers' leases in `coda-client workers`."""
from __future__ import annotations

import asyncio
import io
import logging
import re
import signal
import socket
import subprocess
import sys
import threading

import grpc
import pytest

from coda_client import AsyncPacerClient, PacerClient, UnavailableError
from coda_client import cli as client_cli
from server_harness import REPO_ROOT, ServerProcess, until
from test_durability_crash import free_port
from test_trainer_liveness import N, _fill, _server

# --- 1. coda-client health with grpcio and protobuf alone ------------------------------------------------------------

# The CLI as a client-only install runs it: grpc_health (grpcio-health-checking, the server's extra) cannot be imported.
WITHOUT_GRPC_HEALTH = ("import sys; sys.modules['grpc_health'] = None; from coda_client.cli import main; "
                       "sys.exit(main())")


def _health_cli(address: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", WITHOUT_GRPC_HEALTH, "--address", address, "health", *args],
                          capture_output=True, text=True, cwd=REPO_ROOT, timeout=60)


def test_coda_client_health_needs_no_grpc_health_module(tmp_path):
    with ServerProcess(tmp_path) as server:
        until(lambda: _health_cli(server.address).returncode == 0, "the server to be ready", timeout=30, poll=0.2)
        probed = _health_cli(server.address)
        assert (probed.returncode, probed.stdout, probed.stderr) == (0, "readiness: SERVING\n", "")
        probed = _health_cli(server.address, "--service", "liveness", "--json")
        assert (probed.returncode, probed.stdout) == (0, '{"service": "liveness", "status": "SERVING"}\n')
        probed = _health_cli(server.address, "--service", "")
        assert (probed.returncode, probed.stdout) == (0, "(server): SERVING\n")
    refused = _health_cli(server.address)  # the server is gone: UNAVAILABLE, exit 1, no traceback
    assert refused.returncode == 1 and refused.stdout == "readiness: UNAVAILABLE\n"
    assert "Traceback" not in refused.stderr and "no health answer" in refused.stderr


def test_the_hand_written_health_messages_read_and_write_as_grpc_healths():
    from grpc_health.v1 import health_pb2  # in the dev environment (the server's extra): the reference

    from coda_client import _health

    for service in ("", "readiness", "coda.pacer.v1.RolloutPacer", "é" * 100):
        assert _health.encode_request(service) == health_pb2.HealthCheckRequest(service=service).SerializeToString()
    for number, name in _health.SERVING_STATUS.items():
        wire = health_pb2.HealthCheckResponse(status=number).SerializeToString()
        assert _health.decode_response(wire) == number
        assert _health.status_name(number) == health_pb2.HealthCheckResponse.ServingStatus.Name(number) == name
    # Fields a newer server may add are skipped, whatever their wire type.
    unknown = b"\x12\x03abc" + b"\x19" + bytes(8) + b"\x25" + bytes(4) + b"\x28\x96\x01"
    assert _health.decode_response(unknown + b"\x08\x02") == 2
    assert _health.status_name(7) == "7"
    with pytest.raises(ValueError):
        _health.decode_response(b"\x08")  # truncated


# --- 2. batches() entered while the server restarts ------------------------------------------------------------------


class _Lines(logging.Handler):
    """Keeps the lines of a logger; `seen(text)` is set once a line holding it was logged."""

    def __init__(self, logger: str) -> None:
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []
        self.events: dict[str, threading.Event] = {}
        self.logger = logging.getLogger(logger)

    def emit(self, record: logging.LogRecord) -> None:
        line = record.getMessage()
        self.lines.append(f"{record.levelname} {line}")
        for text, event in self.events.items():
            if text in line:
                event.set()

    def seen(self, text: str) -> threading.Event:
        return self.events.setdefault(text, threading.Event())

    def __enter__(self) -> _Lines:
        self.logger.addHandler(self)
        self.previous = self.logger.level
        self.logger.setLevel(logging.DEBUG)
        return self

    def __exit__(self, *exc) -> None:
        self.logger.removeHandler(self)
        self.logger.setLevel(self.previous)


STARTING_AWAY = "did not answer as the iterator started"


@pytest.mark.parametrize("kind", ["blocking", "async"])
def test_batches_entered_while_the_server_restarts_waits_for_it_within_reconnect(tmp_path, kind):
    """The user restarted the server at a step boundary and entered batches() meanwhile: UnavailableError from the
    GetState the iterator asks as it starts, ~1.5 s later, though `reconnect` (120 s) bounds its other calls."""
    overrides = (f"server.address=127.0.0.1:{free_port()}", f"server.state_dir={tmp_path / 'state'}")
    running = [_server(tmp_path, *overrides).start()]
    address = running[0].address
    with PacerClient(address) as pacer:
        _fill(pacer, ["r0", "r1"])  # journaled: buffered again on the restarted server
    assert running[0].terminate() == 0
    running[0].close()
    given_up = threading.Event()

    with _Lines("coda_client.batches") as logged:
        def restart() -> None:  # once the iterator has said it waits for a server (or the test gave up)
            waiting = logged.seen(STARTING_AWAY)
            while not (waiting.wait(0.05) or given_up.is_set()):
                pass
            if not given_up.is_set():
                running.append(_server(tmp_path, *overrides).start())

        restarter = threading.Thread(target=restart, daemon=True)
        restarter.start()
        trained: list[str] = []
        try:
            if kind == "blocking":
                with PacerClient(address) as trainer:
                    with trainer.batches(2 * N, num_batches=1, reconnect=60) as batches:
                        trained += [group.prompt_id for batch in batches for group in batch.groups]
            else:
                async def train() -> None:
                    async with AsyncPacerClient(address) as trainer:
                        async with trainer.batches(2 * N, num_batches=1, reconnect=60) as batches:
                            async for batch in batches:
                                trained.extend(group.prompt_id for group in batch.groups)

                asyncio.run(train())
        finally:
            given_up.set()
            restarter.join(60)
            for server in running:
                server.close()
    assert trained == ["r0", "r1"]
    said = [line for line in logged.lines if f"the pacer at {address}" in line and "iterator start" in line]
    assert said[0].startswith(f"WARNING batches: the pacer at {address} {STARTING_AWAY} (UNAVAILABLE: ")
    assert said[0].endswith("asking again for up to reconnect=60 s")
    assert said[-1].startswith(f"INFO batches: the pacer at {address} answered after ")


@pytest.mark.parametrize("kind", ["blocking", "async"])
def test_batches_gives_up_on_a_server_that_never_comes_within_reconnect(kind):
    address = _nothing_listening()
    said = (rf"batches\(\): the pacer at {address} could not be reached as the iterator started and no server "
            r"answered within reconnect=0\.5 s")
    with pytest.raises(UnavailableError, match=said) as gone:
        if kind == "blocking":
            with PacerClient(address) as trainer:
                trainer.batches(2 * N, reconnect=0.5)
        else:
            async def enter() -> None:
                async with AsyncPacerClient(address) as trainer:
                    async with trainer.batches(2 * N, reconnect=0.5):
                        pass

            asyncio.run(enter())
    assert gone.value.reason == "SERVER_GONE"
    with pytest.raises(ValueError, match="reconnect must be >= 0 seconds, not nan"):
        with PacerClient(address) as trainer:
            trainer.batches(2 * N, reconnect=float("nan"))


# --- 3. watch() of a client that waits for ready, nothing listening --------------------------------------------------


def _nothing_listening() -> str:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{probe.getsockname()[1]}"


NO_FIRST_EVENT = r"cannot reach the pacer at 127\.0\.0\.1:\d+: no control event within 1 s \(the client's timeout\)"


def test_a_blocking_watch_waiting_for_ready_fails_after_the_timeout_where_nothing_listens():
    with PacerClient(_nothing_listening(), wait_for_ready=True, timeout=1) as pacer:
        stream = pacer.watch()
        outcome: list[BaseException | object] = []

        def read() -> None:
            try:
                outcome.append(next(stream))
            except BaseException as exc:  # noqa: BLE001 - checked below
                outcome.append(exc)

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        reader.join(60)  # a bound on a hang, not a timing check: it waited for good before
        stream.cancel()
        assert not reader.is_alive(), "the watch said nothing at all"
    [error] = outcome
    assert isinstance(error, UnavailableError), error
    assert error.code == grpc.StatusCode.UNAVAILABLE
    assert re.search(NO_FIRST_EVENT, str(error))


def test_an_async_watch_waiting_for_ready_fails_after_the_timeout_where_nothing_listens():
    async def first() -> None:
        async with AsyncPacerClient(_nothing_listening(), wait_for_ready=True, timeout=1) as pacer:
            stream = pacer.watch()
            try:
                await asyncio.wait_for(stream.__anext__(), 60)  # a bound on a hang: it waited for good before
            finally:
                stream.cancel()

    with pytest.raises(UnavailableError, match=NO_FIRST_EVENT):
        asyncio.run(first())


@pytest.mark.parametrize("kind", ["blocking", "async"])
def test_a_watch_waiting_for_ready_has_no_bound_once_its_first_event_came(tmp_path, kind):
    from coda_client import ControlEventType

    # The second read waits longer than the timeout (1 s) for its event, which a Reset then sends.
    with ServerProcess(tmp_path) as server, PacerClient(server.address) as control:
        if kind == "blocking":
            with PacerClient(server.address, wait_for_ready=True, timeout=1) as pacer, pacer.watch() as stream:
                assert next(stream).type == ControlEventType.STATE
                read: list[object] = []

                def second() -> None:
                    try:
                        read.append(next(stream))
                    except BaseException as exc:  # noqa: BLE001 - checked below
                        read.append(exc)

                reader = threading.Thread(target=second, daemon=True)
                reader.start()
                reader.join(2.5)
                control.reset("abort", wait=0)
                reader.join(60)
                assert getattr(read[0], "type", read[0]) == ControlEventType.PAUSE
        else:
            async def watch() -> None:
                async with AsyncPacerClient(server.address, wait_for_ready=True, timeout=1) as pacer:
                    async with pacer.watch() as stream:
                        assert (await stream.__anext__()).type == ControlEventType.STATE
                        second = asyncio.ensure_future(stream.__anext__())
                        await asyncio.wait((second,), timeout=2.5)
                        await asyncio.to_thread(control.reset, "abort", wait=0)
                        assert (await asyncio.wait_for(second, 60)).type == ControlEventType.PAUSE

            asyncio.run(watch())


# --- 4. a plain collect() interrupted after it was sent --------------------------------------------------------------


def _interrupted_warning(lines: list[str]) -> list[str]:
    return [line for line in lines if "was interrupted" in line]


def test_an_async_collect_cancelled_while_it_waits_says_its_groups_may_be_lost(tmp_path):
    async def go(server: ServerProcess) -> None:
        async with AsyncPacerClient(server.address) as pacer, AsyncPacerClient(server.address) as watcher:
            for kwargs in ({}, {"request_id": "mine-1"}, {"lease": 60.0}):
                while (await watcher.state()).waiting_calls:  # the Collect cancelled before has ended on the server
                    await asyncio.sleep(0.02)
                call = (pacer.collect(1, wait=30, **kwargs) if "lease" not in kwargs
                        else pacer.collect_result(1, wait=30, **kwargs))
                task = asyncio.ensure_future(call)
                while not (await watcher.state()).waiting_calls:  # the Collect is on the server
                    await asyncio.sleep(0.02)
                task.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await task

    with ServerProcess(tmp_path) as server, _Lines("coda_client.client") as logged:
        asyncio.run(go(server))
    [warning] = _interrupted_warning(logged.lines)  # the plain one only: the others can be asked again or return
    rid = re.search(r"request_id ([0-9a-f-]{36}) was interrupted \(CancelledError\)", warning)
    assert rid, warning
    assert warning.startswith("WARNING collect: ")
    assert f"request_id={rid.group(1)!r}" in warning
    for way in ("batches()", "lease=", "ack(result.lease_id)", "pass request_id="):
        assert way in warning


def test_a_blocking_collect_interrupted_by_ctrl_c_says_its_groups_may_be_lost(tmp_path):
    with ServerProcess(tmp_path) as server, _Lines("coda_client.client") as logged:
        with PacerClient(server.address) as pacer, PacerClient(server.address) as watcher:
            main = threading.main_thread().ident
            assert threading.get_ident() == main  # Ctrl-C goes to the main thread

            def interrupt() -> None:
                until(lambda: watcher.state().waiting_calls == 1, "the Collect to wait on the server")
                signal.pthread_kill(main, signal.SIGINT)

            threading.Thread(target=interrupt, daemon=True).start()
            with pytest.raises(KeyboardInterrupt):
                pacer.collect(1, wait=30)
    [warning] = _interrupted_warning(logged.lines)
    assert "was interrupted (KeyboardInterrupt) after it was sent" in warning


def test_the_request_id_a_cancelled_collect_names_gets_its_groups_back(tmp_path):
    """The user's loop: collect(1) cancelled at random instants lost 12 groups of 40, silently. Whatever the instants
    turn out to be, every group is received: by the collect, by the request id a warning names, or left buffered.
    (task.cancel(), not asyncio.wait_for: before Python 3.12 wait_for may drop a result that arrived as it timed out,
    which no client can see.)"""
    import random

    from coda_client import Trajectory, TrajectoryStatus

    async def go(server: ServerProcess) -> tuple[list[str], list[str]]:
        received, recovered = [], []
        async with AsyncPacerClient(server.address, client_id="feeder") as pacer:
            for k in range(30):
                prompt_id = f"c{k}"
                admitted = await pacer.dispatch([prompt_id])
                await pacer.submit([Trajectory(trajectory_id=f"{prompt_id}/{i}", prompt_id=prompt_id,
                                               status=TrajectoryStatus.COMPLETED, token_ids=[1, 2]) for i in range(2)],
                                   dispatch_seqs={prompt_id: admitted.seqs[0]})
                said = len(logged.lines)
                task = asyncio.ensure_future(pacer.collect(1, wait=0))
                await asyncio.sleep(random.uniform(0.0, 0.004))
                task.cancel()
                try:
                    received += [g.prompt_id for g in await task]
                    continue
                except asyncio.CancelledError:
                    pass
                for warning in _interrupted_warning(logged.lines[said:]):
                    rid = re.search(r"request_id=('[0-9a-f-]{36}')", warning).group(1).strip("'")
                    recovered += [g.prompt_id for g in await pacer.collect(1, request_id=rid, wait=0)]
            while (await pacer.state()).buffered:
                received += [g.prompt_id for g in await pacer.collect(1, wait=0)]
        return received, recovered

    with ServerProcess(tmp_path, "data_source.num_trajectories_per_prompt=2") as server, \
            _Lines("coda_client.client") as logged:
        received, recovered = asyncio.run(go(server))
    assert sorted(received + recovered) == sorted(f"c{k}" for k in range(30)), (received, recovered)


# --- 5. coda-client workers: trainers' leases ------------------------------------------------------------------------


def test_coda_client_workers_shows_the_trainers_leases_and_those_no_holder_is_named_for(tmp_path):
    with _server(tmp_path) as running, PacerClient(running.address) as pacer:
        out = io.StringIO()
        assert client_cli.main(["--address", running.address, "workers"], out=out) == 0
        assert out.getvalue() == "no running groups, and no groups leased to trainers\n"
        _fill(pacer, ["w0", "w1", "w2"])
        with PacerClient(running.address, client_id="trainer-a") as trainer:
            with trainer.batches(2 * N, num_batches=1) as batches:
                next(batches)
                with pacer.collect_leased(1, lease=60):  # a lease no holder is named for
                    out = io.StringIO()
                    assert client_cli.main(["--address", running.address, "workers"], out=out) == 0
                    [lease_id] = pacer.list_workers("trainer-a")[0].lease_ids
                    assert out.getvalue() == (
                        f"trainer-a: 0 running, oldest held 0.0s, 2 groups leased ({lease_id}) to this trainer, not "
                        "yet acknowledged\n"
                        "1 more group leased, holder not named: Collect leases that do not end with their holder's "
                        "silence (collect_leased(), collect_result(lease=...)); back in the buffer unless "
                        "acknowledged before they run out\n")
                    out = io.StringIO()  # --json: the holders as ListWorkers answers, one a line, nothing else
                    assert client_cli.main(["--address", running.address, "workers", "--json"], out=out) == 0
                    assert len(out.getvalue().splitlines()) == 1 and '"leased": 2' in out.getvalue()
