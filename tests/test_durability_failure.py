"""A state directory that cannot be written (a full disk, a failing volume): the cause is said plainly, changes
are refused UNAVAILABLE with a retry delay and nothing is applied meanwhile, and once the journal can write
again the server is ready again by itself, with nothing lost."""
from __future__ import annotations

import logging
import resource
import threading
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from coda_client import PacerClient
from coda_client.errors import UnavailableError
from coda_worker.engines.fake import FakeEngine
from coda_worker.worker import ListPromptSource, Prompt, RolloutWorker
from coda_client._proto import pacer_pb2 as pb
from coda_client.cli import render_state
from coda_server.core.journal import Submitted
from coda_server.core.sqlite_journal import SqliteJournal
from coda_server.core.types import Trajectory, TrajectoryStatus
from conftest import core_overrides
from server_harness import ServerProcess, refusal_of, until
from test_durability_crash import free_port



def group(prompt_id: str) -> list[pb.Trajectory]:
    return [pb.Trajectory(trajectory_id=f"{prompt_id}/t{i}", prompt_id=prompt_id, status=pb.TRAJECTORY_STATUS_COMPLETED,
                          reward=float(i), token_ids=list(range(50_000))) for i in range(2)]


def details_of(error: grpc.RpcError) -> tuple[str, float]:
    """The ErrorInfo reason and the RetryInfo delay of a refusal."""
    refused = refusal_of(error)
    return refused.reason, -1.0 if refused.retry_delay is None else refused.retry_delay


def test_a_journal_that_cannot_write_is_said_plainly_refuses_changes_and_recovers_by_itself(tmp_path):
    state_dir = tmp_path / "state"
    overrides = (*core_overrides("no-window", B=4, stale=1.0, N=2, filters="[]"), f"server.state_dir={state_dir}",
                 f"server.address=127.0.0.1:{free_port()}")
    server = ServerProcess(tmp_path, *overrides).start()
    try:
        channel = server.channel()
        stub = server.stub()
        health = health_pb2_grpc.HealthStub(channel)

        def readiness() -> int:
            return health.Check(health_pb2.HealthCheckRequest(service="readiness"), timeout=10).status

        stub.Dispatch(pb.DispatchRequest(candidates=[pb.PromptRef(prompt_id=p) for p in ("a", "b", "c")]), timeout=10)
        stub.Submit(pb.SubmitRequest(trajectories=group("a"), request_id="s-a"), timeout=10)
        # The journal's files may grow no more (as on a full disk): the server process's file size limit.
        largest = max(path.stat().st_size for path in state_dir.glob("pacer.sqlite3*"))
        resource.prlimit(server.process.pid, resource.RLIMIT_FSIZE, (largest, resource.RLIM_INFINITY))
        try:
            stub.Submit(pb.SubmitRequest(trajectories=group("b"), request_id="s-b"), timeout=10)
            raise AssertionError("a Submit the journal could not write was acknowledged")
        except grpc.RpcError as refused:
            assert refused.code() == grpc.StatusCode.UNAVAILABLE, refused
            assert details_of(refused) == ("STATE_DIR_UNWRITABLE", 1.0)
            message = refused.details()
        assert str(state_dir / "pacer.sqlite3") in message and "I/O error" in message, message
        assert "rollback" not in message, message
        until(lambda: readiness() == health_pb2.HealthCheckResponse.NOT_SERVING, "readiness NOT_SERVING")
        # While the journal fails nothing is applied: another change is refused before it runs.
        before = stub.GetState(pb.GetStateRequest(), timeout=10)
        try:
            stub.Submit(pb.SubmitRequest(trajectories=group("c"), request_id="s-c"), timeout=10)
            raise AssertionError("a Submit was taken while the journal could not write")
        except grpc.RpcError as refused:
            assert details_of(refused)[0] == "STATE_DIR_UNWRITABLE"
        assert stub.GetState(pb.GetStateRequest(), timeout=10).submitted == before.submitted
        assert "writing the journal" in server.log() and "failed" in server.log()
        # GetState says why, and so does `coda-client state`: an operator sees it where the counters are.
        assert str(state_dir / "pacer.sqlite3") in before.state_dir_problem, before.state_dir_problem
        with PacerClient(server.address) as client:
            shown = render_state(client.state()).splitlines()[-1]
        assert shown.startswith("STATE DIRECTORY NOT WRITABLE: ") and "I/O error" in shown, shown
        # Space comes back: the server writes what it held back and is ready again by itself.
        resource.prlimit(server.process.pid, resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
        until(lambda: readiness() == health_pb2.HealthCheckResponse.SERVING, "readiness SERVING again")
        assert stub.GetState(pb.GetStateRequest(), timeout=10).state_dir_problem == ""
        answer = stub.Submit(pb.SubmitRequest(trajectories=group("b"), request_id="s-b"), timeout=10)  # the retry
        assert (answer.accepted, answer.groups_completed) == (2, 1)  # the first call's answer: applied once
        stub.Submit(pb.SubmitRequest(trajectories=group("c"), request_id="s-c"), timeout=10)
        server.kill()
        server.close()
        server = ServerProcess(tmp_path, *overrides).start()
        state = server.stub().GetState(pb.GetStateRequest(), timeout=10)
        assert (state.buffered, state.submitted) == (3, 6), state  # nothing acknowledged was lost
    finally:
        server.close()


def test_a_trainers_lease_does_not_run_out_while_the_server_refuses_its_ack(tmp_path):
    """The state volume full: the trainer's Acks were refused STATE_DIR_UNWRITABLE while its Collect lease ran out
    (the server's own clock went on), so once the disk had room the retried Ack failed LEASE_EXPIRED and the groups,
    back in the buffer, were trained twice. Now no lease runs out while the journal cannot write, and each gets its
    full time again once it can: the retried Ack is taken."""
    state_dir = tmp_path / "state"
    lease = 5.0
    overrides = (*core_overrides("no-window", B=4, stale=1.0, N=2, filters="[]"), f"server.state_dir={state_dir}")
    with ServerProcess(tmp_path, *overrides) as server, PacerClient(server.address) as client:
        stub = server.stub()
        stub.Dispatch(pb.DispatchRequest(candidates=[pb.PromptRef(prompt_id=p) for p in ("a", "b", "c")]), timeout=10)
        stub.Submit(pb.SubmitRequest(trajectories=group("a") + group("b")), timeout=10)
        taken = client.collect_result(2, lease=lease)
        granted = time.monotonic()
        assert len(taken.groups) == 2 and taken.lease_id
        largest = max(path.stat().st_size for path in state_dir.glob("pacer.sqlite3*"))
        resource.prlimit(server.process.pid, resource.RLIMIT_FSIZE, (largest, resource.RLIM_INFINITY))
        with pytest.raises(grpc.RpcError):  # a worker's Submit meets the full volume first
            stub.Submit(pb.SubmitRequest(trajectories=group("c"), request_id="s-c"), timeout=10)
        with pytest.raises(UnavailableError, match="journal"):  # then the trainer's Ack, refused before it runs
            client.ack(taken.lease_id, request_id="ack-1")
        until(lambda: "clocks stopped while the journal cannot write" in server.log(), "the clocks stopped")
        # Well past the lease's deadline on any clock, with the server's lease ticks running all along.
        until(lambda: time.monotonic() > granted + lease + 2.0, "the lease's deadline to pass", timeout=lease + 30)
        state = client.state()
        assert (state.leased, state.buffered) == (2, 1), state  # c went in before the journal failed it
        assert "ran out without Ack" not in server.log()
        resource.prlimit(server.process.pid, resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
        until(lambda: "clocks restarted" in server.log(), "the clocks restarted")
        assert client.ack(taken.lease_id, request_id="ack-1") == 2  # the trainer's retry: taken, nothing redelivered
        state = client.state()
        assert (state.leased, state.buffered, state.consumed) == (0, 1, 2), state  # c, which the disk then took


def test_a_trainer_iterating_batches_says_once_that_the_server_refuses_its_calls_and_when_it_takes_them_again(
        tmp_path, caplog):
    """batches() asked again quietly while the server refused its Ack STATE_DIR_UNWRITABLE: the trainer's log said
    nothing for as long as the state volume was full. It says it once, with the server's reason, and says when
    the server takes calls again."""
    state_dir = tmp_path / "state"
    overrides = (*core_overrides("no-window", B=4, stale=1.0, N=2, M=2, filters="[]"), f"server.state_dir={state_dir}")
    with ServerProcess(tmp_path, *overrides) as server, PacerClient(server.address) as client:
        stub = server.stub()
        prompts = ("a", "b", "c", "d", "e")
        stub.Dispatch(pb.DispatchRequest(candidates=[pb.PromptRef(prompt_id=p) for p in prompts]), timeout=10)
        stub.Submit(pb.SubmitRequest(trajectories=[t for p in prompts[:4] for t in group(p)]), timeout=10)
        with caplog.at_level(logging.INFO, logger="coda_client.batches"), client.batches(2, lease=600.0) as batches:
            first = next(iter(batches))
            largest = max(path.stat().st_size for path in state_dir.glob("pacer.sqlite3*"))
            resource.prlimit(server.process.pid, resource.RLIMIT_FSIZE, (largest, resource.RLIM_INFINITY))
            with pytest.raises(grpc.RpcError):  # a worker's Submit meets the full volume first
                stub.Submit(pb.SubmitRequest(trajectories=group("e"), request_id="s-e"), timeout=10)
            following: list = []
            taker = threading.Thread(target=lambda: following.append(next(iter(batches))))  # acks the first
            taker.start()
            refused = "refuses calls for now"
            until(lambda: any(refused in r.getMessage() for r in caplog.records), "the trainer's warning")
            resource.prlimit(server.process.pid, resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
            taker.join(60)
        assert len(following) == 1 and len(first.groups) == 1, following  # M = 2 trajectories: one group
    said = [r.getMessage() for r in caplog.records if r.name == "coda_client.batches"]
    warned = [m for m in said if refused in m]
    assert len(warned) == 1 and "STATE_DIR_UNWRITABLE" in warned[0] and "journal" in warned[0], said
    assert any("takes calls again" in m for m in said), said


def test_a_worker_says_once_that_the_server_refuses_its_changes_without_calling_the_server_away_and_back(
        tmp_path, caplog):
    """The worker kit called a server refusing its Submits STATE_DIR_UNWRITABLE "away", then "answers again" at each
    KeepAlive it answered meanwhile, flapping for as long as the volume was full. A refusal is said once, as such,
    and its end when the server takes a change again."""
    state_dir = tmp_path / "state"
    overrides = (*core_overrides("no-window", B=4, stale=1.0, N=2, filters="[]"), f"server.state_dir={state_dir}")
    prompts = ListPromptSource([Prompt(f"p{i}", [1, 2, 3], epoch=0, index=i) for i in range(400)])
    with ServerProcess(tmp_path, *overrides) as server, caplog.at_level(logging.DEBUG, logger="coda_worker"):
        worker = RolloutWorker(server.address, FakeEngine(mean_tokens=4, first_token_seconds=0.01,
                                                          seconds_per_token=0.001), prompts, worker_id="w-full")
        worker.start()
        try:
            stub = server.stub()
            until(lambda: stub.GetState(pb.GetStateRequest(), timeout=10).submitted >= 2, "a group submitted")
            largest = max(path.stat().st_size for path in state_dir.glob("pacer.sqlite3*"))
            resource.prlimit(server.process.pid, resource.RLIMIT_FSIZE, (largest, resource.RLIM_INFINITY))
            until(lambda: sum("still refuses changes" in r.getMessage() for r in caplog.records) >= 2,
                  "the worker's refused changes retried twice")
            resource.prlimit(server.process.pid, resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
            until(lambda: any("takes changes again" in r.getMessage() for r in caplog.records), "changes taken again")
        finally:
            worker.stop()
            worker.join(60)
    said = [r.getMessage() for r in caplog.records if r.levelno >= logging.INFO and r.name.startswith("coda_worker")]
    refused = [m for m in said if "refuses changes for now" in m]
    assert len(refused) == 1 and "STATE_DIR_UNWRITABLE" in refused[0], said
    # The refusal is not said as the pacer away (a machine under load may still time a call out: that is away).
    assert not any("is away" in m and "STATE_DIR_UNWRITABLE" in m for m in said), said


class UnencodableTrajectories:
    """A trajectory codec that fails as a bug in the server would: not an OSError, nothing to do with the disk."""

    def encode(self, trajectory: Trajectory) -> bytes:
        raise AttributeError("'_pickle.Pickler' object attribute 'persistent_id' is read-only")

    def decode(self, data: bytes) -> Trajectory:
        raise AssertionError("nothing was written to read back")


def test_a_change_that_cannot_be_encoded_is_reported_as_the_servers_fault_not_the_disks(tmp_path):
    journal = SqliteJournal(tmp_path / "state", codec=UnencodableTrajectories())
    try:
        trajectory = Trajectory("p/0", "p", 0, TrajectoryStatus.COMPLETED, 1.0, 0, 0, 1, b"body", 4)
        ticket = journal.append(Submitted(0.0, [trajectory], "s-1"))
        with pytest.raises(RuntimeError) as failed:
            journal.wait(ticket, timeout=30)
        message = str(failed.value)
        assert "encoding the change raised AttributeError" in message, message
        assert "fault in the server, not in the state directory" in message, message
        assert "free space" not in message and "I/O error" not in message, message
        assert not journal.committed(ticket)  # refused, never half-written
    finally:
        journal.close()
