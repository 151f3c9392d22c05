"""Worker liveness: a worker killed, stopped or cut off loses its running groups within the liveness grace
(not at its lease's end), a restart does not grant them a fresh lease, and raw clients keep their lease."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Callable

import grpc
import pytest

from coda_client import PacerClient
from coda_client._proto import pacer_pb2 as pb, pacer_pb2_grpc
from conftest import core_overrides
from fake_clock import FakeClock
from server_harness import ServerProcess, until
from test_durability_crash import free_port

GRACE = 3.0  # seconds: short for the test, long enough for a worker on a busy machine to heartbeat in time
LEASE = 600.0  # far beyond any wait here: only liveness can release the groups in time
CALL_TIMEOUT = 60.0
WORKER = Path(__file__).resolve().parent / "fault_worker.py"
OVERRIDES = (*core_overrides("no-window", B=2, stale=1.0, N=2, filters="[]"),
             f"server.worker_liveness_seconds={GRACE}", f"server.inflight_lease_seconds={LEASE}")


def start_worker(address: str, worker_id: str, seconds_per_token: float = 1000.0) -> subprocess.Popen:
    """A kit worker whose engine never finishes a response (1000 s a token)."""
    return subprocess.Popen([sys.executable, str(WORKER), address, worker_id, "2", str(seconds_per_token)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def watched_worker_dispatching(address: str, client_id: str, prompt_id: str) -> Callable[[], None]:
    """A worker by hand: a control stream under `client_id` (so the server watches it), then a Dispatch of
    `prompt_id`. Returns what makes it go silent for good (the stream cancelled, the channel closed)."""
    channel = grpc.insecure_channel(address)
    metadata = (("x-coda-client-id", client_id),)
    stub = pacer_pb2_grpc.RolloutPacerStub(channel)
    stream = stub.WatchControl(pb.WatchControlRequest(), metadata=metadata)
    next(stream)  # STATE: the stream is open
    stub.Dispatch(pb.DispatchRequest(candidates=[pb.PromptRef(prompt_id=prompt_id)]), metadata=metadata, timeout=10)

    def go_silent() -> None:
        stream.cancel()
        channel.close()

    return go_silent


def holding(client: PacerClient, worker_id: str) -> int:
    return sum(len(w.groups) for w in client.list_workers(worker_id))


@pytest.fixture
def server(tmp_path):
    with ServerProcess(tmp_path, *OVERRIDES) as server:
        yield server


def test_a_killed_worker_releases_its_groups_within_the_grace_so_a_waiting_reset_ends(server):
    worker = start_worker(server.address, "doomed")
    try:
        with PacerClient(server.address, timeout=CALL_TIMEOUT) as client:
            until(lambda: holding(client, "doomed") == 2, "the worker to hold two groups")
            worker.kill()
            worker.wait(10)
            # The trainer's step boundary waits for every running group (WAIT, no wait given): it ends once the
            # dead worker's groups are released, long before their lease would run out.
            result = client.reset("wait")
            assert sorted(g.prompt_id for g in result.expired) == ["p0", "p1"], result
            state = client.state()
            assert (state.running, state.expired) == (0, 2), state
            assert "worker doomed silent" in server.log()
    finally:
        worker.kill()


def test_a_stopped_worker_loses_its_groups_though_its_connection_stays_open(server):
    worker = start_worker(server.address, "frozen")
    try:
        with PacerClient(server.address, timeout=CALL_TIMEOUT) as client:
            until(lambda: holding(client, "frozen") == 2, "the worker to hold two groups")
            os.kill(worker.pid, signal.SIGSTOP)  # a long GC pause, a stuck host: the socket stays open
            until(lambda: client.state().expired == 2, "the stopped worker's groups to be released")
            assert client.state().running == 0
    finally:
        worker.kill()


def test_a_raw_client_without_a_control_stream_keeps_its_groups_for_the_lease(server):
    """Callers that never opened WatchControl are not watched: only their lease bounds their groups."""
    worker = start_worker(server.address, "watched")
    raw = PacerClient(server.address, timeout=CALL_TIMEOUT, client_id="raw-client")
    try:
        with PacerClient(server.address, timeout=CALL_TIMEOUT) as client:
            until(lambda: holding(client, "watched") == 2, "the worker to hold two groups")
            raw.dispatch(["raw-0"])
            worker.kill()
            until(lambda: client.state().expired == 2, "the killed worker's groups to be released")
            assert [g.prompt_id for w in client.list_workers("raw-client") for g in w.groups] == ["raw-0"]
    finally:
        worker.kill()
        raw.close()


def test_after_a_restart_a_dead_worker_gets_the_grace_from_recovery_not_a_fresh_lease(tmp_path):
    port = free_port()
    overrides = (*OVERRIDES, f"server.address=127.0.0.1:{port}", f"server.state_dir={tmp_path / 'state'}")
    server = ServerProcess(tmp_path, *overrides).start()
    gone = watched_worker_dispatching(server.address, "gone-worker", "p0")
    server.kill()
    gone()
    server.close()
    server = ServerProcess(tmp_path, *overrides).start()
    try:
        with PacerClient(server.address, timeout=CALL_TIMEOUT) as client:
            assert client.state().running == 1  # recovered, still held for the worker ...
            # ... until the grace, counted from recovery, runs out without the worker coming back
            until(lambda: client.state().expired == 1, "the dead worker's group to be released after the restart")
    finally:
        server.close()


def test_a_live_worker_keeps_its_groups_for_many_graces(server):
    """The kit heartbeats: groups that take about four graces to generate are completed, not released."""
    worker = start_worker(server.address, "alive", seconds_per_token=4 * GRACE / 64)
    try:
        with PacerClient(server.address, timeout=CALL_TIMEOUT) as client:
            until(lambda: client.state().collected == 2, "the worker's two groups to be complete", timeout=60)
            assert client.state().expired == 0
    finally:
        worker.kill()


def test_another_worker_continues_the_groups_a_dead_worker_left(tmp_path):
    """Released groups are kept for continuation (rollout.continue_restored, the default): another kit
    worker takes them over, generates what is missing and completes them."""
    with ServerProcess(tmp_path, *OVERRIDES, "rollout.continue_restored=true") as server:
        doomed = start_worker(server.address, "doomed")
        try:
            with PacerClient(server.address, timeout=CALL_TIMEOUT) as client:
                until(lambda: holding(client, "doomed") == 2, "the worker to hold two groups")
                doomed.kill()
                until(lambda: client.state().restored_kept == 2, "the dead worker's groups to be kept")
                heir = start_worker(server.address, "heir", seconds_per_token=0.001)
                try:
                    until(lambda: client.state().collected == 2, "the heir to complete both groups", timeout=60)
                    groups = client.collect(2)
                finally:
                    heir.kill()
        finally:
            doomed.kill()
    assert sorted(g.prompt_id for g in groups) == ["p0", "p1"]
    assert {t.metadata["worker"] for g in groups for t in g.trajectories} == {"heir"}
    assert all(len(g.trajectories) == 2 for g in groups)


def test_an_engines_reported_version_is_listed_while_its_worker_is_believed_alive():
    """ListWorkers lists a worker that reported the version its engine runs even while it holds nothing, so a
    trainer can wait for every engine to load new weights; a dead worker listed there at its old version for good
    would hold such a trainer back. A watched worker's report goes when it is taken as gone; a caller that is not
    watched, inflight_lease_seconds after it last said it."""
    from coda_server.core import Pacer, load_config

    clock = FakeClock()
    pacer = Pacer(load_config(overrides=[*core_overrides("no-window", B=2, stale=1.0, N=2, filters="[]"),
                                         "server.worker_liveness_seconds=20", "server.inflight_lease_seconds=300"]),
                  clock=clock)
    pacer.watch_opened("kit-worker")
    pacer.note_loaded_version("kit-worker", 3)
    pacer.note_loaded_version("raw-client", 3)
    assert pacer.loaded_versions() == {"kit-worker": 3, "raw-client": 3}
    clock.now += 200  # the kit worker heartbeats; the raw client says nothing more
    pacer.heard_from("kit-worker")
    assert pacer.loaded_versions() == {"kit-worker": 3, "raw-client": 3}
    clock.now += 101  # past the lease bound for the raw client's report; the kit worker is still heard from
    pacer.heard_from("kit-worker")
    assert pacer.loaded_versions() == {"kit-worker": 3}
    pacer.note_loaded_version("raw-client", 4)  # said again: listed again
    assert pacer.loaded_versions() == {"kit-worker": 3, "raw-client": 4}
    pacer.watch_closed("kit-worker")
    clock.now += 21  # silent past the liveness grace: taken as gone
    pacer.release_silent_workers()
    assert pacer.loaded_versions() == {"raw-client": 4}


def test_client_ids_unseen_for_a_day_are_forgotten_though_listworkers_is_never_asked():
    """Every call notes when its client id was last seen, for ListWorkers. A job whose workers restart under new
    ids (a pid in the id) would grow that table for as long as the server runs if only ListWorkers pruned it; the
    server's periodic tick forgets ids unseen for SEEN_KEPT_SECONDS, liveness on or off."""
    from coda_server.core import Pacer, load_config
    from coda_server.core.liveness import SEEN_KEPT_SECONDS

    clock = FakeClock()
    pacer = Pacer(load_config(overrides=[*core_overrides("no-window", B=2, stale=1.0, N=2, filters="[]"),
                                         "server.worker_liveness_seconds=0"]), clock=clock)
    for n in range(1000):
        pacer.heard_from(f"worker-restart-{n}")
    pacer.release_silent_workers()
    clock.now += SEEN_KEPT_SECONDS / 2
    pacer.heard_from("worker-now")
    clock.now += SEEN_KEPT_SECONDS / 2 + 1
    pacer.release_silent_workers()  # what the tick calls; no ListWorkers in between
    remembered = pacer.liveness._seen
    assert sorted(remembered) == ["worker-now"], f"{len(remembered)} client ids still remembered"
