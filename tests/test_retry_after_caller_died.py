"""Retries as documented: a retry with the first call's request_id, whose caller was killed -9, gets the
first call's answer (waiting for it while it runs), for every mutating RPC."""
from __future__ import annotations

import subprocess
import sys
import threading

import pytest

from coda_client import PacerClient, Trajectory, TrajectoryStatus
from coda_client._proto import pacer_pb2 as pb
from conftest import core_overrides
from server_harness import REPO_ROOT, ServerProcess, until

N = 2
WAIT_SECONDS = 60.0

# A caller that makes one call and then hangs on, so the test can kill it -9 while the call runs (or after).
CALLER = """
import sys, time
sys.path.insert(0, sys.argv[4])
import grpc
from coda_client._proto import pacer_pb2 as pb, pacer_pb2_grpc
address, method, request_hex = sys.argv[1:4]
stub = pacer_pb2_grpc.RolloutPacerStub(grpc.insecure_channel(address))
request = getattr(pb, method + "Request").FromString(bytes.fromhex(request_hex))
print("calling", flush=True)
getattr(stub, method)(request, timeout=600)
print("answered", flush=True)
time.sleep(600)
"""


def trajectory(prompt_id: str, j: int) -> Trajectory:
    return Trajectory(trajectory_id=f"{prompt_id}/t{j}", prompt_id=prompt_id, status=TrajectoryStatus.COMPLETED,
                      reward=float(j), token_ids=[1, 2, 3], logprobs=[-0.1, -0.2, -0.3])


def wire_trajectory(prompt_id: str, j: int) -> pb.Trajectory:
    return pb.Trajectory(trajectory_id=f"{prompt_id}/t{j}", prompt_id=prompt_id, status=pb.TRAJECTORY_STATUS_COMPLETED,
                         reward=float(j), token_ids=[1, 2, 3], logprobs=[-0.1, -0.2, -0.3])



class Caller:
    """A separate process making one raw call; `kill()` is kill -9."""

    def __init__(self, address: str, method: str, request) -> None:
        self.method = method
        self.process = subprocess.Popen(
            [sys.executable, "-c", CALLER, address, method, request.SerializeToString().hex(), str(REPO_ROOT)],
            stdout=subprocess.PIPE, text=True)
        assert self.process.stdout.readline().strip() == "calling"

    def wait_answered(self) -> None:
        assert self.process.stdout.readline().strip() == "answered"

    def kill(self) -> None:
        self.process.kill()
        self.process.wait(10)


@pytest.fixture
def server(tmp_path):
    # B=1, stale 0: the window holds one group, so a second Dispatch waits for a slot.
    with ServerProcess(tmp_path, *core_overrides("no-window", B=1, stale=0.0, N=N, filters="[]")) as server:
        yield server


def cancelled_on_server(server: ServerProcess, method: str) -> bool:
    return f"{method} CANCELLED" in server.log()


def test_a_reset_retried_after_its_caller_was_killed_waits_for_the_first_reset_and_returns_its_answer(server):
    with PacerClient(server.address, timeout=WAIT_SECONDS + 10) as client:
        client.dispatch(["p0"])
        client.submit([trajectory("p0", 0)])  # the group is half assembled: a WAIT Reset waits for it
        first = Caller(server.address, "Reset", pb.ResetRequest(mode=pb.RESET_MODE_WAIT, wait_seconds=WAIT_SECONDS,
                                                                 request_id="reset-1"))
        until(lambda: client.state().resetting, "the first Reset to be waiting")
        first.kill()
        until(lambda: cancelled_on_server(server, "Reset"), "the server to see the caller gone")
        answers: list = []
        retry = threading.Thread(target=lambda: answers.append(
            client.reset("wait", wait=WAIT_SECONDS, request_id="reset-1")))
        retry.start()
        # The retry waits for the first Reset, which still waits for the group: assemble it.
        client.submit([trajectory("p0", 1)])
        retry.join(WAIT_SECONDS)
        assert answers, "the retry did not return"
        (answer,) = answers
        assert answer.generation == 1 and answer.dropped_prompt_ids == []  # waited for p0, did not drop it
        state = client.state()
        assert (state.generation, state.buffered, state.dropped) == (1, 1, 0), state  # one Reset ran, not two
        # Later retries get the same answer without running anything.
        assert client.reset("wait", wait=0, request_id="reset-1").generation == answer.generation


def test_a_long_poll_whose_caller_was_killed_runs_once_for_its_retry(server):
    """Dispatch and Collect long-polls: the caller's death cancels the wait (nothing was applied); the retry
    with the same id runs it, and only once."""
    with PacerClient(server.address, timeout=WAIT_SECONDS + 10) as client:
        client.dispatch(["p0"])  # the one slot is taken: a Dispatch of p1 waits
        first = Caller(server.address, "Dispatch", pb.DispatchRequest(
            candidates=[pb.PromptRef(prompt_id="p1")], wait_seconds=WAIT_SECONDS, request_id="dispatch-1"))
        until(lambda: client.state().waiting_calls == 1, "the first Dispatch to wait")
        first.kill()
        until(lambda: cancelled_on_server(server, "Dispatch"), "the server to see the Dispatch caller gone")
        collector = Caller(server.address, "Collect", pb.CollectRequest(
            num_groups=1, wait_seconds=WAIT_SECONDS, request_id="collect-1"))
        until(lambda: client.state().waiting_calls == 1, "the first Collect to wait")
        collector.kill()
        until(lambda: cancelled_on_server(server, "Collect"), "the server to see the Collect caller gone")
        client.submit([trajectory("p0", 0), trajectory("p0", 1)])
        groups = client.collect(1, wait=WAIT_SECONDS, request_id="collect-1")
        assert [g.prompt_id for g in groups] == ["p0"]
        assert [g.prompt_id for g in client.collect(1, request_id="collect-1")] == ["p0"]  # the same answer
        admitted = client.dispatch(["p1"], wait=WAIT_SECONDS, request_id="dispatch-1").admitted
        assert admitted == ["p1"]
        assert client.dispatch(["p1"], request_id="dispatch-1").admitted == ["p1"]
        state = client.state()
        assert (state.dispatched, state.collected, state.consumed) == (2, 1, 1), state


@pytest.mark.parametrize("method", ["Dispatch", "Submit", "Ack", "Resume"])
def test_a_call_applied_before_its_caller_was_killed_answers_its_retry_with_the_first_answer(server, method):
    with PacerClient(server.address, timeout=30) as client:
        setup = {"Dispatch": lambda: None,
                 "Submit": lambda: client.dispatch(["p0"]),
                 "Ack": lambda: (client.dispatch(["p0"]), client.submit([trajectory("p0", 0), trajectory("p0", 1)])),
                 "Resume": lambda: client.reset("abort", wait=0)}
        setup[method]()
        lease_id = client.collect_result(1, lease=60).lease_id if method == "Ack" else ""
        request = {"Dispatch": pb.DispatchRequest(candidates=[pb.PromptRef(prompt_id="p0")], request_id="call-1"),
                   "Submit": pb.SubmitRequest(trajectories=[wire_trajectory("p0", 0)], request_id="call-1"),
                   "Ack": pb.AckRequest(lease_id=lease_id, request_id="call-1"),
                   "Resume": pb.ResumeRequest(weight_version=7, request_id="call-1")}[method]
        before = client.state()
        first = Caller(server.address, method, request)
        first.wait_answered()
        first.kill()
        retry = {"Dispatch": lambda: client.dispatch(["p0"], request_id="call-1").admitted,
                 "Submit": lambda: (client.submit([trajectory("p0", 0)], request_id="call-1").accepted,
                                    client.submit([trajectory("p0", 0)], request_id="call-1").duplicates),
                 "Ack": lambda: client.ack(lease_id, request_id="call-1"),
                 "Resume": lambda: client.resume(7, request_id="call-1").step}[method]
        expected = {"Dispatch": ["p0"], "Submit": (1, 0), "Ack": 1, "Resume": before.step + 1}[method]
        assert retry() == expected
        after = client.state()
        assert (after.dispatched, after.submitted, after.consumed, after.step) == {
            "Dispatch": (1, 0, 0, before.step), "Submit": (1, 1, 0, before.step),
            "Ack": (1, 2, 1, before.step), "Resume": (before.dispatched, 0, 0, before.step + 1)}[method], after
