"""Worker-kit findings from users' runs, each against a live coda-server (or what answers in its place): a KeepAlive
crossing a group's last Submit, the log lines of a server stopped with SIGTERM, and an address where something other
than a gRPC server answers."""
from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import socket
import subprocess
import sys
from collections import Counter
from typing import Iterator

import grpc
import pytest

from coda_client import AsyncPacerClient, ControlEventType
from coda_client.errors import PacerClientError
from coda_worker.worker import AsyncRolloutWorker, WorkerFailedError
from conftest import core_overrides
from server_harness import ServerProcess, until as until_sync
from test_durability_crash import free_port
from test_worker_loop import CONDITION_TIMEOUT, HeldEngine, make_worker, prompts, until, until_state

LOST = "no longer in flight on the server"
OVERRIDES = core_overrides("no-window", B=2, stale=1.0, N=2, M=4)


@pytest.fixture
def server(tmp_path):
    with ServerProcess(tmp_path, *OVERRIDES) as process:
        yield process


def worker_lines(caplog, level: int = logging.INFO) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "coda_worker" and r.levelno >= level]


# ---------------------------------------------------------------------- a KeepAlive crossing a group's last Submit

class CrossingPacer(AsyncPacerClient):
    """Makes a KeepAlive naming group p0 reach the server after p0's last Submit completed the group there, as a
    KeepAlive sent at the same time as that Submit may: the server answers that p0 is no longer in flight.
    `answer_submit_first`: the worker reads the Submit's answer before the KeepAlive's; else the KeepAlive's first,
    while the Submit is still unanswered for the worker."""

    def __init__(self, *args, answer_submit_first: bool, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.answer_submit_first = answer_submit_first
        self.worker: AsyncRolloutWorker | None = None
        self.submitted: Counter[str] = Counter()
        self.landed = asyncio.Event()  # p0's last Submit was applied by the server
        self.crossing = asyncio.Event()  # the KeepAlive to cross it waits
        self.crossing_answer = None

    async def submit(self, trajectories, **kwargs):
        answer = await super().submit(trajectories, **kwargs)
        self.submitted.update(t.prompt_id for t in trajectories)
        if self.submitted["p0"] == 2 and not self.landed.is_set():
            self.landed.set()
            if not self.answer_submit_first:  # the worker reads the KeepAlive's answer before this one
                calls = self.worker.stats.keepalive_calls
                await until(lambda: self.worker.stats.keepalive_calls > calls, "the crossing KeepAlive's answer read")
        return answer

    async def keep_alive(self, prompt_ids, **kwargs):
        if "p0" not in prompt_ids or self.crossing.is_set():
            return await super().keep_alive(prompt_ids, **kwargs)
        self.crossing.set()
        await self.landed.wait()
        if self.answer_submit_first:
            await until(lambda: not any(p == "p0" for p, _ in self.worker._groups), "p0's Submit answer read")
        self.crossing_answer = await super().keep_alive(prompt_ids, **kwargs)
        return self.crossing_answer


@pytest.mark.parametrize("answer_submit_first", [True, False], ids=["submit-answered-first", "submit-unanswered"])
def test_a_keepalive_crossing_a_groups_last_submit_does_not_call_the_group_lost(server, caplog, answer_submit_first):
    """Users saw `rollout-0: 1 groups are no longer in flight on the server; aborting them` in clean runs (about one
    group in 450): a KeepAlive went out as the group's last Submit did, and the server, which completes a group at
    its last Submit, answered it as unknown. Nothing was lost. A group whose last trajectories were accepted, or are in
    a Submit not answered yet, is not called lost nor aborted."""
    async def go():
        engine = HeldEngine()
        async with CrossingPacer(server.address, answer_submit_first=answer_submit_first) as pacer:
            worker = make_worker(pacer, engine, prompts(3), max_groups=1, keepalive_seconds=0.05)
            pacer.worker = worker
            task = asyncio.create_task(worker.run())
            await until(lambda: len(engine.held) == 2, "p0's two requests held in the engine")
            await pacer.crossing.wait()  # a KeepAlive naming p0 is out, held back
            engine.release_all()  # p0 ends: its Submit goes while that KeepAlive is out
            await until(lambda: pacer.crossing_answer is not None and worker.stats.groups_done >= 1,
                        "the crossing KeepAlive answered and p0 acknowledged")
            engine.auto_release = True
            engine.release_all()
            worker.stop()
            stats = await asyncio.wait_for(task, CONDITION_TIMEOUT)
            return engine, stats, pacer.crossing_answer

    with caplog.at_level(logging.INFO, logger="coda_worker"):
        engine, stats, crossing = asyncio.run(go())
    assert "p0" in crossing.unknown_prompt_ids, crossing  # the server did answer that p0 is no longer in flight
    assert not [m for m in worker_lines(caplog, logging.WARNING) if LOST in m], worker_lines(caplog)
    assert not [r for r in engine.aborted if "-p0#" in r], engine.aborted  # nothing of p0 aborted
    assert stats.trajectories_refused == 0 and stats.trajectories_aborted == 0, stats
    assert stats.groups_done >= 1 and stats.trajectories_submitted >= 2, stats


class LateKeepAlive(AsyncPacerClient):
    """Holds its KeepAlives back until the server took a running group back (its in-flight lease ran out)."""

    async def keep_alive(self, prompt_ids, **kwargs):
        await until_state(self, lambda s: s.expired >= 1, "a group's in-flight lease to run out")
        return await super().keep_alive(prompt_ids, **kwargs)


def test_a_group_the_server_took_back_is_still_said_lost_and_aborted(tmp_path, caplog):
    """The other side of the crossing KeepAlive: a group still generating here whose in-flight lease ran out is said
    lost and its engine requests are aborted, as before."""
    overrides = (*OVERRIDES, "server.inflight_lease_seconds=1.0", "server.worker_liveness_seconds=600")
    with ServerProcess(tmp_path, *overrides) as server:
        async def go():
            engine = HeldEngine()
            async with LateKeepAlive(server.address) as pacer:
                worker = make_worker(pacer, engine, prompts(3), max_groups=1, keepalive_seconds=0.05)
                task = asyncio.create_task(worker.run())
                await until(lambda: any(LOST in m for m in worker_lines(caplog, logging.WARNING)),
                            "the lost group said")
                await until(lambda: len(engine.aborted) >= 2, "p0's requests aborted")
                engine.auto_release = True
                engine.release_all()
                worker.stop()
                await asyncio.wait_for(task, CONDITION_TIMEOUT)
                return engine

        with caplog.at_level(logging.INFO, logger="coda_worker"):
            engine = asyncio.run(go())
    [lost] = [m for m in worker_lines(caplog, logging.WARNING) if LOST in m]
    assert "1 groups are no longer in flight on the server; aborting them" in lost, lost
    assert all("-p0#" in r for r in engine.aborted[:2]), engine.aborted


# ---------------------------------------------------------------------- a Submit cut as the server stops

class CutSubmitPacer(AsyncPacerClient):
    """Its first Submit ends CANCELLED, as gRPC ends a call that reaches a server as it stops (the user's SIGTERM run:
    `Submit of 1 trajectories of group 'p220' refused, dropped (CANCELLED: CANCELLED)`); `applied`: after the server
    took it (the answer lost), else before it was sent."""

    def __init__(self, *args, applied: bool, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.applied = applied
        self.request_ids: list[str] = []

    async def submit(self, trajectories, **kwargs):
        self.request_ids.append(kwargs.get("request_id"))
        if len(self.request_ids) == 1:
            if self.applied:
                await super().submit(trajectories, **kwargs)
            raise PacerClientError(grpc.StatusCode.CANCELLED, "CANCELLED")
        return await super().submit(trajectories, **kwargs)


@pytest.mark.parametrize("applied", [False, True], ids=["not-applied", "applied"])
def test_a_submit_cut_cancelled_by_a_stopping_server_is_sent_again_not_dropped(server, applied):
    """A Submit ended CANCELLED by a server stopping was taken as refused: its trajectories dropped, the server held
    the group for the worker (which no longer did) until the worker's liveness grace ran out (the trainer's step
    waited 30 s). It is sent again with the same request id, as an unanswered one is, and applies once."""
    async def go():
        engine = HeldEngine()
        engine.auto_release = True
        async with CutSubmitPacer(server.address, applied=applied) as pacer:
            worker = make_worker(pacer, engine, prompts(1), max_groups=1)
            stats = await asyncio.wait_for(worker.run(), CONDITION_TIMEOUT)  # the source exhausted, p0 acknowledged
            return stats, pacer.request_ids, await pacer.state()

    stats, request_ids, state = asyncio.run(go())
    assert stats.trajectories_refused == 0 and stats.groups_done == 1 and stats.trajectories_submitted == 2, stats
    assert stats.submit_retries >= 1 and request_ids[1] == request_ids[0], request_ids
    assert state.running == 0 and state.buffered == 1, state  # p0 complete on the server, once


# ---------------------------------------------------------------------- a server stopped with SIGTERM

class HeldEventStream:
    """A watch stream that hands its reader events of one type only once `gate` is set: the order the event loop ran
    things in a user's run, made certain (here: SHUTDOWN only once the worker's connection watch looked at the failing
    connection)."""

    def __init__(self, stream, held_type: ControlEventType, gate: asyncio.Event) -> None:
        self._stream, self._held_type, self._gate = stream, held_type, gate

    def __aiter__(self):
        return self

    async def __anext__(self):
        event = await self._stream.__anext__()
        if event.type == self._held_type:
            await self._gate.wait()
        return event

    def cancel(self) -> None:
        self._stream.cancel()


class LateShutdownPacer(AsyncPacerClient):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.looked = asyncio.Event()  # connection_trouble answered that no connection can be made

    async def connection_trouble(self):
        found = await super().connection_trouble()
        if found is not None:
            self.looked.set()
        return found

    def watch(self):
        return HeldEventStream(super().watch(), ControlEventType.SHUTDOWN, self.looked)


def test_a_server_stopped_with_sigterm_is_said_to_shut_down_then_away_then_back_when_it_is(tmp_path, caplog):
    """On a server's SIGTERM the worker logged, at one instant: "is away: no connection can be made to it", "answers
    again after 0.0 s", "SHUTDOWN from the server", then "is away: control stream lost", though the server was down
    for seconds. Now: SHUTDOWN, then one warning that it is away (saying it announced its shutdown), then, once a
    server answers again, that it does, and nothing between."""
    overrides = [*OVERRIDES, f"server.address=127.0.0.1:{free_port()}", f"server.state_dir={tmp_path / 'state'}"]
    server = ServerProcess(tmp_path, *overrides).start()
    restarted = None
    try:
        async def go():
            nonlocal restarted
            engine = HeldEngine()
            # Waiting for ready, as RolloutWorker's client does: its calls wait for the server rather than fail.
            async with LateShutdownPacer(server.address, wait_for_ready=True) as pacer:
                worker = make_worker(pacer, engine, prompts(6))
                task = asyncio.create_task(worker.run())
                await until(lambda: len(engine.held) == 4, "4 requests held in the engine (2 groups x 2)")
                server.process.send_signal(signal.SIGTERM)
                await until(lambda: any("is away" in m for m in worker_lines(caplog, logging.WARNING)),
                            "the worker to say that the pacer is away")
                assert await asyncio.to_thread(server.process.wait, CONDITION_TIMEOUT) == 0
                said_before_restart = worker_lines(caplog)
                restarted = await asyncio.to_thread(ServerProcess(tmp_path, *overrides).start)
                await until(lambda: any("answers again" in m for m in worker_lines(caplog)), "the pacer back")
                engine.auto_release = True
                engine.release_all()
                worker.stop()
                stats = await asyncio.wait_for(task, CONDITION_TIMEOUT)
                return said_before_restart, stats

        with caplog.at_level(logging.INFO, logger="coda_worker"):
            said_before_restart, stats = asyncio.run(go())
    finally:
        server.close()
        if restarted is not None:
            restarted.close()
    assert not [m for m in said_before_restart if "answers again" in m], said_before_restart
    lines = [m for m in worker_lines(caplog) if "SHUTDOWN from the server" in m or "is away" in m
             or "answers again" in m]
    assert len(lines) == 3, lines
    shutdown, away, back = lines
    assert "SHUTDOWN from the server: dispatch stops until it is back; 2 groups kept" in shutdown, lines
    assert "is away: it announced its shutdown (SHUTDOWN) and is not back yet" in away, lines
    assert "answers again after" in back, lines
    assert stats.trajectories_refused == 0 and stats.groups_done >= 2, stats


# ---------------------------------------------------------------------- something other than a gRPC server

@contextlib.contextmanager
def web_server(directory) -> Iterator[str]:
    """`python -m http.server` on 127.0.0.1 (a wrong port a user gave); yields its address, stops it by its PID."""
    port = free_port()
    web = subprocess.Popen([sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1"], cwd=directory,
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def listens() -> bool:
        assert web.poll() is None, "python -m http.server exited"
        with socket.socket() as probe:
            return probe.connect_ex(("127.0.0.1", port)) == 0

    try:
        until_sync(listens, "python -m http.server to listen")
        yield f"127.0.0.1:{port}"
    finally:
        web.terminate()
        web.wait(CONDITION_TIMEOUT)


@pytest.mark.parametrize("wait_for_ready", [True, False], ids=["wait-for-ready", "fail-fast"])
def test_a_worker_pointed_at_a_web_server_stops_at_once_saying_it_is_no_grpc_server(tmp_path, caplog, wait_for_ready):
    """`python -m http.server` at the address (a wrong port): the kit said the pacer was away (nothing listens, or
    gRPC's "Failed parsing HTTP/2") and retried for good. Now run() raises WorkerFailedError at once, saying that
    something other than a gRPC server answers there."""
    async def go(address: str):
        async with AsyncPacerClient(address, timeout=60.0, wait_for_ready=wait_for_ready) as pacer:
            worker = make_worker(pacer, HeldEngine(), prompts(2), shutdown_grace=600.0)
            with pytest.raises(WorkerFailedError) as failed:
                await asyncio.wait_for(worker.run(), CONDITION_TIMEOUT)  # not the call's 60 s, nor for good
            return worker, str(failed.value)

    with web_server(tmp_path) as address, caplog.at_level(logging.INFO, logger="coda_worker"):
        worker, message = asyncio.run(go(address))
    assert f"no connection can be made to the pacer at {address}: something other than a gRPC server answers at " \
           "that address" in message, message
    assert "a wrong port?" in message and "the address must change" in message, message
    assert "TLS" not in message and "nothing listens" not in message, message
    assert worker.stats.dispatch_calls == 0 and worker.stats.groups_started == 0, worker.stats


HTTP2_DETAILS = ("failed to connect to all addresses; last error: UNAVAILABLE: ipv4:127.0.0.1:8000: Failed parsing "
                 "HTTP/2 (Expected SETTINGS frame as the first frame, got frame type 79)")


def test_something_else_answering_where_the_pacer_was_is_warned_of_once_and_waited_out(caplog):
    """Once the pacer has answered, something else at its address (its port taken while it restarts) is warned of
    once, clearly, even inside an outage already said; the worker goes on waiting for its server."""
    class Pacer:  # what _connection_failing asks
        target = "127.0.0.1:8000"

        async def connection_trouble(self):
            return HTTP2_DETAILS, None

    async def go():
        worker = AsyncRolloutWorker(None, HeldEngine(), prompts(1), worker_id="w")
        worker.pacer = Pacer()
        worker._stream_gone = asyncio.Event()
        worker._stream_gone.set()  # no control stream runs
        worker._outage.answered()  # the pacer answered before
        worker._outage.failed("control stream lost (UNAVAILABLE: Connection reset by peer)")  # an outage said
        for _ in range(3):
            await worker._connection_failing(False)
        return worker

    with caplog.at_level(logging.DEBUG, logger="coda_worker"):
        worker = asyncio.run(go())
    assert worker._failure is None
    warned = [m for m in worker_lines(caplog, logging.WARNING) if "something other than a gRPC server" in m]
    assert len(warned) == 1, worker_lines(caplog, logging.DEBUG)
    assert "w: the pacer is still away: no connection can be made to it: something other than a gRPC server " \
           "answers at that address" in warned[0], warned
