"""Hostile input over real gRPC: every RPC refuses with the right code and a message saying what was wrong,
and none of it changes the state or hurts the server. Then the overload caps and calls after shutdown."""
from __future__ import annotations

import asyncio
import contextlib
import math
import threading
import time

import grpc
import pytest
from google.protobuf.internal import api_implementation
from google.rpc import error_details_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_status import rpc_status

from coda_client._proto import pacer_pb2 as pb
from coda_client._proto import pacer_pb2_grpc
from server_harness import ServerProcess

MAX_ID = 64
CAP = 1000
MAX_MESSAGE = 1 << 20
CONFIG = ("data_source.num_prompts_per_step=8", "data_source.num_trajectories_per_prompt=2",
          "trainer.mini_batch_size=2", "fully_async.sliding_window=no-window", "fully_async.stale_steps=1.0",
          f"server.max_id_length={MAX_ID}", f"server.max_dispatch_candidates={CAP}",
          f"server.max_submit_trajectories={CAP}", f"server.max_collect_groups={CAP}",
          f"server.max_message_bytes={MAX_MESSAGE}")
COMPLETED = pb.TRAJECTORY_STATUS_COMPLETED
INVALID, NOT_FOUND, PRECONDITION = (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND,
                                    grpc.StatusCode.FAILED_PRECONDITION)
STATE_FIELDS = ("running", "buffered", "queued_trajectories", "step", "weight_version", "generation", "paused",
                "resetting", "dispatched", "submitted", "collected", "consumed", "filtered", "restored", "dropped",
                "duplicates")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with ServerProcess(tmp_path_factory.mktemp("hostile"), *CONFIG) as process:
        # A prompt in flight, for the Submit cases to aim at; nothing in this module completes it.
        process.stub().Dispatch(pb.DispatchRequest(candidates=[pb.PromptRef(prompt_id="live")]))
        yield process


@pytest.fixture(scope="module")
def stub(server):
    # Sends up to 8 MiB, so the server's own 1 MiB limit is what refuses an oversized request.
    channel = grpc.insecure_channel(server.address, options=[("grpc.max_send_message_length", 8 << 20)])
    yield pacer_pb2_grpc.RolloutPacerStub(channel)
    channel.close()


def snapshot(stub) -> dict:
    state = stub.GetState(pb.GetStateRequest(), timeout=10)
    return {name: getattr(state, name) for name in STATE_FIELDS}


def serving(server) -> bool:
    with grpc.insecure_channel(server.address) as channel:
        answer = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service="readiness"), timeout=10)
    return answer.status == health_pb2.HealthCheckResponse.SERVING and server.process.poll() is None


def violations_of(error: grpc.RpcError) -> list[tuple[str, str]]:
    status = rpc_status.from_call(error)
    found = []
    for detail in status.details if status else ():
        if detail.Is(error_details_pb2.BadRequest.DESCRIPTOR):
            bad = error_details_pb2.BadRequest()
            detail.Unpack(bad)
            found += [(v.field, v.description) for v in bad.field_violations]
    return found


def refused(stub, method: str, request, code: grpc.StatusCode, *says: str) -> grpc.RpcError:
    """Send, expect `code` with every phrase of `says` in the message or a field violation, and no state change."""
    before = snapshot(stub)
    with pytest.raises(grpc.RpcError) as caught:
        getattr(stub, method)(request, timeout=10)
    error = caught.value
    assert error.code() == code, (error.code(), error.details())
    text = error.details() + " " + " ".join(f"{field}: {description}" for field, description in violations_of(error))
    for phrase in says:
        assert phrase in text, (phrase, text)
    assert snapshot(stub) == before, "a refused call changed the state"
    return error


def ref(prompt_id="p", ds_index=0):
    return pb.PromptRef(prompt_id=prompt_id, ds_index=ds_index)


def traj(trajectory_id="live-t0", prompt_id="live", **fields):
    fields.setdefault("status", COMPLETED)
    return pb.Trajectory(trajectory_id=trajectory_id, prompt_id=prompt_id, **fields)


LONG_ID = "x" * (MAX_ID + 1)
CONTROL_IDS = ["a\x00b", "line\nbreak", "\x1b[31mred", "tab\there", "sep\u2028arator", "\u200bzero-width"]

CASES = [
    # ------------------------------------------------------------------ Dispatch
    ("Dispatch", pb.DispatchRequest(candidates=[ref(f"c{i}") for i in range(CAP + 1)]), INVALID,
     [f"{CAP + 1} candidates", f"at most {CAP}"]),
    ("Dispatch", pb.DispatchRequest(candidates=[ref(LONG_ID)]), INVALID, ["candidates[0].prompt_id", f"at most {MAX_ID}"]),
    ("Dispatch", pb.DispatchRequest(candidates=[ref("x" * 100_000)]), INVALID, ["100000 characters long"]),
    *[("Dispatch", pb.DispatchRequest(candidates=[ref(bad)]), INVALID, ["control or non-printable"])
      for bad in CONTROL_IDS],
    ("Dispatch", pb.DispatchRequest(candidates=[ref("")]), INVALID, ["non-empty"]),
    ("Dispatch", pb.DispatchRequest(candidates=[ref("ok", ds_index=5)]), INVALID, ["ds_index 5 is not configured"]),
    ("Dispatch", pb.DispatchRequest(candidates=[ref("ok", ds_index=2**32 - 1)]), INVALID, ["ds_index 4294967295"]),
    ("Dispatch", pb.DispatchRequest(candidates=[ref("twice"), ref("twice")]), INVALID, ["named twice"]),
    ("Dispatch", pb.DispatchRequest(candidates=[ref("live")]), INVALID, ["already in flight"]),
    ("Dispatch", pb.DispatchRequest(candidates=[ref("ok")], wait_seconds=math.nan), INVALID, ["wait_seconds", "finite"]),
    ("Dispatch", pb.DispatchRequest(candidates=[ref("ok")], wait_seconds=-1), INVALID, ["wait_seconds", ">= 0"]),
    ("Dispatch", pb.DispatchRequest(candidates=[ref("ok")], wait_seconds=math.inf), INVALID, ["wait_seconds"]),
    ("Dispatch", pb.DispatchRequest(candidates=[ref("ok")], request_id="r" * 10_000), INVALID,
     ["request_id is 10000 characters long", "at most 128"]),  # request/lease ids: max(max_id_length, 128)
    ("Dispatch", pb.DispatchRequest(candidates=[ref("ok")], request_id="id\x07bell"), INVALID,
     ["request_id", "control"]),
    # ------------------------------------------------------------------ Submit
    ("Submit", pb.SubmitRequest(trajectories=[traj(f"t{i}") for i in range(CAP + 1)]), INVALID,
     [f"{CAP + 1} trajectories", f"at most {CAP}"]),
    ("Submit", pb.SubmitRequest(trajectories=[traj(LONG_ID)]), INVALID, ["trajectory_id", f"at most {MAX_ID}"]),
    *[("Submit", pb.SubmitRequest(trajectories=[traj(prompt_id=bad)]), INVALID, ["prompt_id", "control"])
      for bad in CONTROL_IDS[:3]],
    ("Submit", pb.SubmitRequest(trajectories=[traj(trajectory_id="")]), INVALID, ["trajectory_id", "non-empty"]),
    ("Submit", pb.SubmitRequest(trajectories=[traj(status=pb.TRAJECTORY_STATUS_UNSPECIFIED)]), INVALID,
     ["trajectories[0].status TRAJECTORY_STATUS_UNSPECIFIED (0) is not allowed", "TRAJECTORY_STATUS_COMPLETED (1)"]),
    ("Submit", pb.SubmitRequest(trajectories=[traj(status=7)]), INVALID, ["status 7 is not allowed"]),
    ("Submit", pb.SubmitRequest(trajectories=[traj(status=-5)]), INVALID, ["status -5 is not allowed"]),
    *[("Submit", pb.SubmitRequest(trajectories=[traj(reward=bad)]), INVALID, ["reward", "finite"])
      for bad in (math.nan, math.inf, -math.inf)],
    ("Submit", pb.SubmitRequest(trajectories=[traj(token_ids=[1, 2, 3], logprobs=[-0.1, -0.2])]), INVALID,
     ["equal lengths", "token_ids=3, logprobs=2, loss_mask=0"]),
    ("Submit", pb.SubmitRequest(trajectories=[traj(token_ids=[1, 2], loss_mask=[1])]), INVALID,
     ["token_ids=2, logprobs=0, loss_mask=1"]),
    ("Submit", pb.SubmitRequest(trajectories=[traj(logprobs=[-0.5], loss_mask=[1, 1, 0])]), INVALID,
     ["logprobs=1, loss_mask=3"]),
    ("Submit", pb.SubmitRequest(trajectories=[traj(f"live-t{i}") for i in range(3)]), INVALID,
     ["more than its 2 trajectories"]),
    ("Submit", pb.SubmitRequest(trajectories=[traj(ds_index=1)]), INVALID, ["ds_index 1 differs"]),
    ("Submit", pb.SubmitRequest(trajectories=[traj(reward=1.0), traj(reward=2.0)]), INVALID,
     ["comes twice in this Submit, with different content"]),
    ("Submit", pb.SubmitRequest(trajectories=[traj(prompt_id="never-dispatched")]), NOT_FOUND, ["never dispatched"]),
    ("Submit", pb.SubmitRequest(trajectories=[traj("ok-t"), traj("bad", reward=math.nan)]), INVALID,
     ["trajectories[1].reward"]),  # all-or-nothing: the valid first trajectory is not accepted either
    # ------------------------------------------------------------------ Collect
    ("Collect", pb.CollectRequest(num_groups=0), INVALID, ["num_groups 0 is out of range", f"1..{CAP}"]),
    ("Collect", pb.CollectRequest(num_groups=CAP + 1), INVALID, [f"num_groups {CAP + 1}"]),
    ("Collect", pb.CollectRequest(num_groups=2**32 - 1), INVALID, ["num_groups 4294967295"]),
    ("Collect", pb.CollectRequest(num_groups=1, wait_seconds=math.nan), INVALID, ["wait_seconds"]),
    ("Collect", pb.CollectRequest(num_groups=1, request_id="\x00"), INVALID, ["request_id"]),
    *[("Collect", pb.CollectRequest(num_groups=1, lease_seconds=bad), INVALID, ["lease_seconds", "finite"])
      for bad in (math.nan, -1.0, math.inf)],
    # ------------------------------------------------------------------ Ack
    ("Ack", pb.AckRequest(lease_id="lease-424242"), NOT_FOUND, ["lease 'lease-424242' is not known"]),
    ("Ack", pb.AckRequest(lease_id=""), INVALID, ["lease_id", "non-empty"]),
    ("Ack", pb.AckRequest(lease_id="l" * 100_000), INVALID, ["lease_id is 100000 characters long", "at most 128"]),
    ("Ack", pb.AckRequest(lease_id="lease-1\x00"), INVALID, ["lease_id", "control"]),
    # ------------------------------------------------------------------ a flood of bad fields in one call
    ("Dispatch", pb.DispatchRequest(candidates=[ref("\x01" * MAX_ID) for _ in range(CAP)]), INVALID,
     ["candidates[0].prompt_id", "990 more violations not shown"]),
    ("Submit", pb.SubmitRequest(trajectories=[traj(f"t{i}", token_ids=[1], logprobs=[1.0, 2.0]) for i in range(CAP)]),
     INVALID, ["trajectories[0]", "equal lengths", "990 more violations not shown"]),
    # ------------------------------------------------------------------ Reset / Resume
    ("Reset", pb.ResetRequest(mode=9), INVALID, ["Reset mode 9 is not allowed"]),
    ("Reset", pb.ResetRequest(mode=-1), INVALID, ["Reset mode -1"]),
    ("EndJob", pb.EndJobRequest(mode=9), INVALID, ["EndJob mode 9 is not allowed"]),
    ("Reset", pb.ResetRequest(wait_seconds=-3), INVALID, ["wait_seconds"]),
    ("Reset", pb.ResetRequest(resume=True, weight_version=-1), INVALID, ["weight_version -1", ">= the current 0"]),
    ("Reset", pb.ResetRequest(request_id="x" * 129), INVALID, ["request_id is 129 characters long"]),
    ("Resume", pb.ResumeRequest(weight_version=-7), INVALID, ["weight_version -7"]),
    ("Resume", pb.ResumeRequest(weight_version=1, request_id="\n"), INVALID, ["request_id"]),
]


@pytest.mark.parametrize("method, request_message, code, says", CASES,
                         ids=[f"{case[0]}-{i}" for i, case in enumerate(CASES)])
def test_hostile_request_is_refused_with_a_reason_and_changes_nothing(server, stub, method, request_message, code, says):
    refused(stub, method, request_message, code, *says)
    assert serving(server)


NEGATIVE_ONE_VARINT = b"\xff" * 9 + b"\x01"  # -1 as a 64-bit varint: what a client writing int -1 sends


@pytest.mark.parametrize("method, data, says", [
    ("Dispatch", b"\xff\xff\xff", "Wire format was corrupt"),
    ("Submit", b"\x0a\x05\x0a\x03\xff\xfe\xfd", "bad UTF-8"),  # trajectory_id with invalid UTF-8
    ("Collect", b"\x0a\x02\x08", "corrupt"),
    ("Reset", b"\x08", "corrupt"),
    ("Resume", b"\x12\xff\xff\xff\xff\x0f", "corrupt"),
    ("GetState", b"\x07", "corrupt"),
    ("Ack", b"\x0a\x02\xc3\x28", "bad UTF-8"),
])
def test_bytes_that_are_no_protobuf_message_are_invalid_argument(server, method, data, says):
    before = snapshot(server.stub())
    with grpc.insecure_channel(server.address) as channel:
        with pytest.raises(grpc.RpcError) as caught:
            channel.unary_unary(f"/coda.pacer.v1.RolloutPacer/{method}")(data, timeout=10)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "is not a valid protobuf message" in caught.value.details()
    if api_implementation.Type() == "upb":  # the parser's own words; the server inherits this process's protobuf
        assert says in caught.value.details()
    assert snapshot(server.stub()) == before and serving(server)


def test_negative_num_groups_on_the_wire_is_refused(server):
    # num_groups is uint32: a client that writes -1 sends a 64-bit varint, read as 4294967295.
    with grpc.insecure_channel(server.address) as channel:
        with pytest.raises(grpc.RpcError) as caught:
            channel.unary_unary("/coda.pacer.v1.RolloutPacer/Collect")(b"\x08" + NEGATIVE_ONE_VARINT, timeout=10)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "num_groups 4294967295 is out of range" in caught.value.details()


def test_oversized_message_is_resource_exhausted_from_grpc_itself(server, stub):
    big = pb.SubmitRequest(trajectories=[traj(payload=b"\x00" * (MAX_MESSAGE + 1))])
    error = refused(stub, "Submit", big, grpc.StatusCode.RESOURCE_EXHAUSTED)
    assert "larger than max" in error.details() or "message" in error.details().lower()
    assert serving(server)


def test_a_group_larger_than_its_size_across_calls(server, stub):
    stub.Dispatch(pb.DispatchRequest(candidates=[ref("grow")]))
    assert stub.Submit(pb.SubmitRequest(trajectories=[traj(f"grow-t{i}", "grow") for i in range(2)])).groups_completed == 1
    refused(stub, "Submit", pb.SubmitRequest(trajectories=[traj("grow-t2", "grow")]), INVALID,
            "already complete and collected")
    # The identical re-send is a harmless duplicate, not an error.
    again = stub.Submit(pb.SubmitRequest(trajectories=[traj("grow-t0", "grow")]))
    assert (again.accepted, again.duplicates) == (0, 1)


def test_reset_and_resume_during_a_reset_are_failed_precondition(tmp_path):
    with ServerProcess(tmp_path, *CONFIG) as server:
        stub = server.stub()
        stub.Dispatch(pb.DispatchRequest(candidates=[ref("slow")]))
        first = stub.Reset.future(pb.ResetRequest(mode=pb.RESET_MODE_WAIT, wait_seconds=60, resume=True,
                                                  weight_version=1))
        deadline = time.monotonic() + 10
        while not stub.GetState(pb.GetStateRequest()).resetting:
            assert time.monotonic() < deadline
        refused(stub, "Reset", pb.ResetRequest(), PRECONDITION, "a Reset is already running")
        refused(stub, "Resume", pb.ResumeRequest(weight_version=5), PRECONDITION, "a Reset is running")
        stub.Submit(pb.SubmitRequest(trajectories=[traj(f"slow-t{i}", "slow") for i in range(2)]))
        assert first.result(timeout=30).weight_version == 1 and serving(server)


# ----------------------------------------------------------------------------------------------- overload


def test_default_limits_fit_10000_workers():
    from coda_server.core.config import load_config

    server = load_config().server
    assert min(server.max_concurrent_rpcs, server.max_waiting_calls, server.max_watch_streams) >= 10_000
    assert server.max_waiting_collects >= 64


def test_300_simultaneous_long_polls_are_all_answered(server):
    """With the default caps, 300 callers long-polling at once all get OK (timed out), none refused."""
    # Earlier tests on this module's server leave complete groups buffered: take them, so that every one of the
    # 300 partial long-polls below has nothing to answer with but its time-out.
    server.stub().Collect(pb.CollectRequest(num_groups=CAP, wait_seconds=0, allow_partial=True), timeout=10)

    async def run() -> list:
        async with grpc.aio.insecure_channel(server.address) as channel:
            stub = pacer_pb2_grpc.RolloutPacerStub(channel)
            calls = [asyncio.ensure_future(stub.Collect(pb.CollectRequest(num_groups=CAP, wait_seconds=5, allow_partial=True), timeout=30))
                     for _ in range(300)]
            most = 0
            deadline = time.monotonic() + 4.5
            while most < 300 and time.monotonic() < deadline:
                state = await stub.GetState(pb.GetStateRequest(), timeout=10)  # short calls still get in
                most = max(most, state.waiting_calls)
                await asyncio.sleep(0.05)
            return await asyncio.gather(*calls), most

    answers, most_waiting = asyncio.run(run())
    assert len(answers) == 300 and all(a.timed_out and not a.groups for a in answers)
    assert most_waiting == 300
    assert serving(server)


def test_waiter_cap_answers_resource_exhausted_at_once_with_a_retry_delay(tmp_path):
    with ServerProcess(tmp_path, *CONFIG, "server.max_waiting_calls=4", "server.max_waiting_collects=4") as server:
        stub = server.stub()
        stub.Dispatch(pb.DispatchRequest(candidates=[ref(f"fill{i}") for i in range(16)]))  # the window (8 x 2) full
        waiting = [stub.Collect.future(pb.CollectRequest(num_groups=1, wait_seconds=60)) for _ in range(4)]
        waiting += [stub.Dispatch.future(pb.DispatchRequest(candidates=[ref(f"w{i}")], wait_seconds=60))
                    for i in range(4)]
        deadline = time.monotonic() + 10
        while stub.GetState(pb.GetStateRequest()).waiting_calls < 8:
            assert time.monotonic() < deadline
        started = time.monotonic()
        for method, request, limit in (
                ("Collect", pb.CollectRequest(num_groups=1, wait_seconds=60), "max_waiting_collects"),
                ("Dispatch", pb.DispatchRequest(candidates=[ref(f"d{i}") for i in range(40)], wait_seconds=60),
                 "max_waiting_calls")):
            with pytest.raises(grpc.RpcError) as caught:
                getattr(stub, method)(request, timeout=30)
            error = caught.value
            assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert f"4 {method} long-polls are waiting (server.{limit} = 4)" in error.details()
            status = rpc_status.from_call(error)
            delays = []
            for detail in status.details:
                if detail.Is(error_details_pb2.RetryInfo.DESCRIPTOR):
                    info = error_details_pb2.RetryInfo()
                    detail.Unpack(info)
                    delays.append(info.retry_delay.ToTimedelta().total_seconds())
            assert len(delays) == 1 and 1.0 <= delays[0] <= 1.5  # 1 s, jittered by up to half of it
        assert time.monotonic() - started < 5  # refused at once, not after waiting
        # Short calls and a Reset (never capped) still run; the Reset wakes nobody's deadline early.
        assert stub.GetState(pb.GetStateRequest()).dispatched == 16
        stub.Reset(pb.ResetRequest(mode=pb.RESET_MODE_ABORT, wait_seconds=0, resume=True, weight_version=1), timeout=10)
        for call in waiting:
            call.cancel()
        deadline = time.monotonic() + 10
        while stub.GetState(pb.GetStateRequest()).waiting_calls:
            assert time.monotonic() < deadline
        assert stub.Collect(pb.CollectRequest(num_groups=1, wait_seconds=0.2)).timed_out  # room again
        assert serving(server)


def test_one_caller_with_a_huge_waiting_dispatch_does_not_stall_the_others(tmp_path):
    """A Dispatch of 30,000 long ids waiting for room is re-examined only when the window opens, not on every change."""
    config = ("data_source.num_prompts_per_step=1", "data_source.num_trajectories_per_prompt=32",
              "trainer.mini_batch_size=32", "fully_async.stale_steps=0.0", "fully_async.sliding_window=no-window",
              "server.max_dispatch_candidates=65536")
    with ServerProcess(tmp_path, *config) as server:
        stub = server.stub()
        stub.Dispatch(pb.DispatchRequest(candidates=[ref("only")]))  # the window (1) is full now
        huge = pb.DispatchRequest(candidates=[ref(f"{i:06d}" + "h" * 200) for i in range(30_000)], wait_seconds=60)
        waiting = stub.Dispatch.future(huge, timeout=90)
        deadline = time.monotonic() + 30
        while stub.GetState(pb.GetStateRequest()).waiting_calls < 1:
            assert time.monotonic() < deadline
        started = time.monotonic()
        for i in range(32):  # every Submit is a state change that wakes the waiting Dispatch
            stub.Submit(pb.SubmitRequest(trajectories=[traj(f"only-t{i}", "only")]), timeout=10)
            stub.GetState(pb.GetStateRequest(), timeout=10)
        took = time.monotonic() - started
        # Re-validating the 30,000 candidates on each wake-up would cost ~0.15 s each, ~5 s in all; milliseconds without.
        assert took < 1.5, f"32 Submit + GetState took {took:.3f}s while the huge Dispatch waited"
        assert not waiting.done()
        stub.Collect(pb.CollectRequest(num_groups=1))  # the window opens: the huge Dispatch admits one
        assert [a.prompt_id for a in waiting.result(timeout=60).admitted] == ["000000" + "h" * 200]


# ----------------------------------------------------------------------------------------------- shutdown


@contextlib.contextmanager
def in_process_server(*overrides: str):
    """A PacerServer on its own event loop thread; yields (server, address, run) where run(coro) runs in its loop."""
    from coda_server.core.config import load_config
    from coda_server.server import PacerServer

    config = load_config(overrides=[*CONFIG, "server.address=127.0.0.1:0", "server.metrics_address=",
                                    "server.state_dir=", *overrides])
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()

    def run(coroutine):
        return asyncio.run_coroutine_threadsafe(coroutine, loop).result(30)

    async def make():
        return PacerServer(config)

    server = run(make())
    try:
        run(server.start())
        yield server, f"127.0.0.1:{server.ports[0]}", run
    finally:
        run(server.stop(0))
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()


def test_calls_after_shutdown_began_are_unavailable_and_change_nothing():
    with in_process_server() as (server, address, run):
        with grpc.insecure_channel(address) as channel:
            stub = pacer_pb2_grpc.RolloutPacerStub(channel)
            stub.Dispatch(pb.DispatchRequest(candidates=[ref("before")]))
            run(server.drain())  # what SIGTERM does first; the listener stays up for the grace period
            before = snapshot(stub)
            for method, request in (
                ("Dispatch", pb.DispatchRequest(candidates=[ref("after")])),
                ("Submit", pb.SubmitRequest(trajectories=[traj("before-t0", "before")])),
                ("Collect", pb.CollectRequest(num_groups=1)),
                ("Reset", pb.ResetRequest()),
                ("Resume", pb.ResumeRequest(weight_version=1)),
            ):
                error = refused(stub, method, request, grpc.StatusCode.UNAVAILABLE, "shutting down")
                assert error.code() == grpc.StatusCode.UNAVAILABLE
            assert snapshot(stub) == before
            health = health_pb2_grpc.HealthStub(channel)
            assert health.Check(health_pb2.HealthCheckRequest(service="readiness")).status == \
                health_pb2.HealthCheckResponse.NOT_SERVING
            assert health.Check(health_pb2.HealthCheckRequest(service="liveness")).status == \
                health_pb2.HealthCheckResponse.SERVING


def test_admission_limits_past_a_c_int_start_a_server_that_answers(tmp_path):
    """The pending-call cap gRPC takes is their sum, a C int: 3,000,000,000 stopped start-up with an OverflowError."""
    with ServerProcess(tmp_path, "server.max_concurrent_rpcs=3000000000") as server:
        assert server.stub().GetState(pb.GetStateRequest(), timeout=10).step == 0
