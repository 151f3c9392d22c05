"""Thousands of workers, in miniature: admission by kind of call, client ids, per-client rate limits and
the metrics listener's token, each against a real server with small limits (times are in bench/swarm.py)."""
from __future__ import annotations

import io
import time
import urllib.error
import urllib.request

import grpc
import pytest
from google.rpc import error_details_pb2
from grpc_status import rpc_status

from coda_client import PacerClient
from coda_client import cli as client_cli
from coda_client._proto import pacer_pb2 as pb
from coda_client._proto import pacer_pb2_grpc
from coda_client.errors import ResourceExhaustedError
from ops_harness import MetricsServer, Scrape
from server_harness import ServerProcess

# Window C = 2 x (1 + 1) = 4 groups of 2.
SMALL = ("data_source.num_prompts_per_step=2", "data_source.num_trajectories_per_prompt=2",
         "trainer.mini_batch_size=2", "fully_async.sliding_window=no-window", "fully_async.stale_steps=1.0")
LIMITS = ("server.max_watch_streams=3", "server.max_waiting_calls=2", "server.max_waiting_collects=1")
TOKEN = "a-token-long-enough-for-the-server"


def error_info(error: grpc.RpcError) -> tuple[error_details_pb2.ErrorInfo, float]:
    """The ErrorInfo and the RetryInfo delay (seconds) of a refusal."""
    info, delay = error_details_pb2.ErrorInfo(), None
    for detail in rpc_status.from_call(error).details:
        if detail.Is(error_details_pb2.ErrorInfo.DESCRIPTOR):
            detail.Unpack(info)
        elif detail.Is(error_details_pb2.RetryInfo.DESCRIPTOR):
            retry = error_details_pb2.RetryInfo()
            detail.Unpack(retry)
            delay = retry.retry_delay.ToTimedelta().total_seconds()
    return info, delay


def open_stream(stub: pacer_pb2_grpc.RolloutPacerStub):
    """A WatchControl stream that has delivered its first event (STATE), or the error that refused it."""
    call = stub.WatchControl(pb.WatchControlRequest())
    try:
        first = next(call)
    except grpc.RpcError as error:
        return None, error
    assert first.type == pb.CONTROL_EVENT_TYPE_STATE
    return call, None


def wait_until(ready, timeout: float = 20.0):
    deadline = time.monotonic() + timeout
    while not ready():
        assert time.monotonic() < deadline, "the server did not get there in time"
        time.sleep(0.02)


def test_trainer_calls_get_in_while_more_watchers_and_long_polls_than_the_limits_admit(tmp_path):
    with MetricsServer(tmp_path, *SMALL, *LIMITS) as server:
        stub = server.stub()
        # The window's 4 slots taken, so every further Dispatch with a wait has to wait.
        assert len(stub.Dispatch(pb.DispatchRequest(candidates=[pb.PromptRef(prompt_id=f"f{i}")
                                                                for i in range(4)])).admitted) == 4
        streams, stream_refusals = [], []
        for _ in range(5):
            call, error = open_stream(stub)
            (streams if call is not None else stream_refusals).append(call or error)
        assert len(streams) == 3 and len(stream_refusals) == 2
        polls = [stub.Dispatch.future(pb.DispatchRequest(candidates=[pb.PromptRef(prompt_id=f"w{i}")],
                                                         wait_seconds=60), timeout=90) for i in range(2)]
        wait_until(lambda: stub.GetState(pb.GetStateRequest()).waiting_calls == 2)
        with pytest.raises(grpc.RpcError) as poll_refused:
            stub.Dispatch(pb.DispatchRequest(candidates=[pb.PromptRef(prompt_id="w9")], wait_seconds=60), timeout=30)
        # Every kind of the trainer's call still gets in: Collect without a wait, a waiting Collect (its own
        # limit), GetState, Reset, Resume; and a Dispatch that does not wait is not a long-poll.
        assert stub.Collect(pb.CollectRequest(num_groups=1)).timed_out
        assert stub.Collect(pb.CollectRequest(num_groups=1, wait_seconds=0.2), timeout=30).timed_out
        assert not stub.Dispatch(pb.DispatchRequest(candidates=[pb.PromptRef(prompt_id="peek")])).admitted
        reset = stub.Reset(pb.ResetRequest(mode=pb.RESET_MODE_ABORT, wait_seconds=0), timeout=30)
        assert stub.GetState(pb.GetStateRequest()).paused
        assert stub.Resume(pb.ResumeRequest(weight_version=1), timeout=30).step == reset.step + 1
        # The three admitted watchers saw the Reset: PAUSE then RESUME.
        for call in streams:
            assert [next(call).type, next(call).type] == [pb.CONTROL_EVENT_TYPE_PAUSE, pb.CONTROL_EVENT_TYPE_RESUME]
        # The waiting Dispatches were answered by the reopened window.
        assert all(len(poll.result(timeout=30).admitted) == 1 for poll in polls)

        for error, limit, reason in [(stream_refusals[0], "server.max_watch_streams", "TOO_MANY_WATCH_STREAMS"),
                                     (poll_refused.value, "server.max_waiting_calls", "TOO_MANY_WAITERS")]:
            assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert f"({limit} = " in error.details() and "Concurrent RPC limit" not in error.details()
            info, delay = error_info(error)
            assert info.reason == reason and info.domain == "coda.pacer.v1" and info.metadata["limit"] == limit
            assert delay is not None and delay > 0
        scrape = server.scrape()
        assert scrape.value("coda_admission_refused_total", limit="server.max_watch_streams") == 2
        assert scrape.value("coda_admission_refused_total", limit="server.max_waiting_calls") == 1
        assert scrape.value("coda_admission_limit", limit="server.max_watch_streams") == 3
        assert scrape.value("coda_admission_in_progress", limit="server.max_watch_streams") == 3
        for call in streams:
            call.cancel()


def test_a_closed_stream_gives_its_room_back(tmp_path):
    with ServerProcess(tmp_path, *SMALL, "server.max_watch_streams=1") as server:
        stub = server.stub()
        first, _ = open_stream(stub)
        _, refused = open_stream(stub)
        assert refused.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        first.cancel()
        deadline = time.monotonic() + 20
        while True:  # the cancel reaches the server shortly after: then the next stream is admitted
            second, error = open_stream(stub)
            if second is not None:
                break
            assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and time.monotonic() < deadline
        second.cancel()


def test_the_client_sees_the_limit_and_its_retry_delay(tmp_path):
    with ServerProcess(tmp_path, *SMALL, "server.max_waiting_collects=1") as server:
        with PacerClient(server.address, client_id="trainer-0") as client:
            waiting = server.stub().Collect.future(pb.CollectRequest(num_groups=1, wait_seconds=60), timeout=90)
            wait_until(lambda: client.state().waiting_calls == 1)
            with pytest.raises(ResourceExhaustedError) as refused:
                client.collect(1, wait=30)
            assert refused.value.reason == "TOO_MANY_WAITERS"
            assert refused.value.metadata["limit"] == "server.max_waiting_collects"
            assert refused.value.retry_delay is not None and refused.value.retry_delay >= 1.0
            waiting.cancel()


def test_client_ids_reach_the_log_line_and_per_client_metrics_with_a_cap(tmp_path):
    with MetricsServer(tmp_path, *SMALL, "server.metrics_max_clients=2") as server:
        for name in ("worker-1", "worker-2", "worker-3", "worker-3"):
            with PacerClient(server.address, client_id=name) as client:
                client.state()
        server.stub().GetState(pb.GetStateRequest())  # no client id
        assert client_cli.main(["--address", server.address, "--client-id", "bad id", "state"], out=io.StringIO()) == 2
        assert client_cli.main(["--address", server.address, "--client-id", "worker-1", "state"], out=io.StringIO()) == 0
        scrape = server.scrape_until(lambda s: s.value("coda_client_calls_total", client="(none)",
                                                       grpc_method="GetState") >= 1)
        calls = {(s.labels["client"], s.labels["grpc_method"]): s.value for s in scrape.samples
                 if s.name == "coda_client_calls_total" and s.labels["grpc_code"] == "OK"}
        # The first two ids by name; the third beyond metrics_max_clients = 2 is counted as "(other)".
        assert calls == {("worker-1", "GetState"): 2, ("worker-2", "GetState"): 1, ("(other)", "GetState"): 2,
                         ("(none)", "GetState"): 1}
        assert scrape.value("coda_client_ids") == 2
        wait_until(lambda: "GetState OK" in server.log() and "client=worker-3" in server.log())
        lines = [line for line in server.log().splitlines() if "coda_server.rpc" in line]
        assert any("client=worker-1 peer=" in line for line in lines)
        assert any("client=" not in line for line in lines)  # the call without an id says none


def test_a_malformed_client_id_is_refused_with_what_is_allowed(tmp_path):
    with pytest.raises(ValueError, match="letter, a digit"):
        PacerClient("127.0.0.1:1", client_id="has space")
    with pytest.raises(ValueError):
        PacerClient("127.0.0.1:1", client_id="x" * 129)
    with ServerProcess(tmp_path, *SMALL) as server:
        stub = server.stub()
        for bad in ("two words", "x" * 129, "", "semi;colon"):
            with pytest.raises(grpc.RpcError) as caught:
                stub.GetState(pb.GetStateRequest(), metadata=(("x-coda-client-id", bad),))
            assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "x-coda-client-id" in caught.value.details() and "128 characters" in caught.value.details()
            assert error_info(caught.value)[0].reason == "INVALID_CLIENT_ID"
        assert stub.GetState(pb.GetStateRequest(), metadata=(("x-coda-client-id", "ok-worker_1.a:b@c/d"),)).step == 0


def test_per_client_rate_limit_on_dispatch_refuses_one_client_and_not_another(tmp_path):
    overrides = ("server.client_rate_limits.dispatch_per_second=0.01", "server.client_rate_limits.burst=2")
    with ServerProcess(tmp_path, *SMALL, *overrides) as server:
        with PacerClient(server.address, client_id="greedy") as greedy, \
                PacerClient(server.address, client_id="polite") as polite:
            greedy.dispatch([])
            greedy.dispatch([])
            with pytest.raises(ResourceExhaustedError) as refused:
                greedy.dispatch(["p1"])
            assert refused.value.reason == "RATE_LIMITED"
            assert refused.value.metadata["limit"] == "server.client_rate_limits.dispatch_per_second"
            assert refused.value.metadata["client"] == "greedy"
            assert refused.value.retry_delay is not None and refused.value.retry_delay > 1
            assert "client greedy is over server.client_rate_limits.dispatch_per_second" in str(refused.value)
            assert polite.dispatch(["p1"]).admitted  # another client has its own budget
            assert greedy.state().dispatched == 1  # the refused Dispatch changed nothing; GetState is not limited


@pytest.mark.parametrize("overrides, message", [
    (("server.max_watch_streams=0",), "server.max_watch_streams = 0: must be an integer >= 1"),
    (("server.client_rate_limits.submit_per_second=-1",), "server.client_rate_limits.submit_per_second = -1"),
    (("server.metrics_require_token=maybe",), "server.metrics_require_token = 'maybe': must be true or false"),
])
def test_admission_keys_are_validated_with_the_config(overrides, message):
    from coda_server.core import load_config
    from coda_server.core.errors import ConfigError

    with pytest.raises(ConfigError) as caught:
        load_config(overrides=[*SMALL, *overrides])
    assert message in str(caught.value)


def scrape_status(port: int, token: str = "") -> tuple[int, str]:
    request = urllib.request.Request(f"http://127.0.0.1:{port}/metrics")
    if token:
        request.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode()


def test_metrics_listener_can_require_the_bearer_token(tmp_path):
    with MetricsServer(tmp_path, *SMALL, "server.metrics_require_token=true", env={"CODA_TOKEN": TOKEN}) as server:
        status, body = scrape_status(server.metrics_port)
        assert status == 401 and "Authorization: Bearer" in body and "coda_pacer" not in body
        assert scrape_status(server.metrics_port, "wrong-token")[0] == 401
        status, body = scrape_status(server.metrics_port, TOKEN)
        assert status == 200 and Scrape(body).value("coda_pacer_window_size_groups") == 4


def test_metrics_token_without_a_configured_token_stops_start_up(tmp_path):
    server = ServerProcess(tmp_path, *SMALL, "server.metrics_require_token=true", env={"CODA_TOKEN": ""})
    with pytest.raises(RuntimeError, match="metrics_require_token = true needs the bearer token"):
        server.start()
    server.close()


def test_a_watcher_that_does_not_read_is_dropped_and_counted_without_holding_up_the_others(tmp_path):
    with MetricsServer(tmp_path, *SMALL, "server.watch_queue_events=8") as server:
        # A client that reads its first event and then nothing: a small HTTP/2 window (no BDP growth), so
        # the server's writes to it stop completing after a few dozen events.
        slow_channel = grpc.insecure_channel(server.address, options=[("grpc.http2.lookahead_bytes", 1024),
                                                                     ("grpc.http2.bdp_probe", 0)])
        slow = pacer_pb2_grpc.RolloutPacerStub(slow_channel).WatchControl(pb.WatchControlRequest())
        assert next(slow).type == pb.CONTROL_EVENT_TYPE_STATE
        with PacerClient(server.address, client_id="reader") as reader, reader.watch() as stream:
            events = [next(stream)]
            stub = server.stub()
            resets = 0
            while server.scrape().value("coda_pacer_watchers_dropped_total") == 0:
                for _ in range(10):
                    resets += 1
                    stub.Reset(pb.ResetRequest(mode=pb.RESET_MODE_ABORT, resume=True, weight_version=resets),
                               timeout=30)
                assert resets < 2000, "the watcher that does not read was never dropped"
            # The reader saw every PAUSE and RESUME of every Reset, and is still watching.
            while len(events) < 1 + 2 * resets:
                events.append(next(stream))
            assert [e.type.name for e in events[1:]] == ["PAUSE", "RESUME"] * resets
            assert [e.weight_version for e in events[2::2]] == list(range(1, resets + 1))
            scrape = server.scrape()
            assert scrape.value("coda_pacer_watchers_dropped_total") == 1
            assert scrape.value("coda_pacer_watchers") == 1
            assert scrape.value("coda_admission_in_progress", limit="server.max_watch_streams") == 1
        # The dropped client, reading again, gets what was sent before the drop, then the reason.
        with pytest.raises(grpc.RpcError) as ended:
            for _ in slow:
                pass
        assert ended.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        info, delay = error_info(ended.value)
        assert info.reason == "WATCHER_TOO_SLOW" and info.metadata["limit"] == "server.watch_queue_events"
        assert delay is not None and "fell 8 control events behind" in ended.value.details()
        wait_until(lambda: "dropped 1 watch stream(s) that fell 8 control events behind" in server.log())
        slow_channel.close()


def test_list_workers_shows_who_holds_which_groups_and_survives_a_restart(tmp_path):
    from coda_client import Trajectory, TrajectoryStatus
    from coda_client.errors import BadRequestError

    state_dir = tmp_path / "state"
    state_dir.mkdir()
    overrides = (*SMALL, f"server.state_dir={state_dir}")
    with ServerProcess(tmp_path, *overrides) as server:
        with PacerClient(server.address, client_id="w-1") as w1, PacerClient(server.address, client_id="w-2") as w2, \
                PacerClient(server.address) as anonymous:
            assert len(w1.dispatch(["p1", "p2"]).admitted) == 2
            assert len(w2.dispatch(["p3"]).admitted) == 1
            assert len(anonymous.dispatch(["p4"]).admitted) == 1
            w1.submit([Trajectory(trajectory_id="p1-t0", prompt_id="p1", status=TrajectoryStatus.COMPLETED)])
            holdings = anonymous.list_workers()
            assert [(w.client_id, w.running, [g.prompt_id for g in w.groups]) for w in holdings] == [
                ("", 1, ["p4"]), ("w-1", 2, ["p1", "p2"]), ("w-2", 1, ["p3"])]
            p1 = holdings[1].groups[0]
            assert (p1.trajectories, p1.group_size) == (1, 2)
            assert p1.held_seconds >= 0 and 0 < p1.lease_remaining_seconds <= 1800
            assert holdings[1].oldest_held_seconds >= holdings[1].groups[1].held_seconds
            only = w2.list_workers("w-1", max_groups_per_worker=1)
            assert [(w.client_id, w.running, [g.prompt_id for g in w.groups]) for w in only] == [("w-1", 2, ["p1"])]
            with pytest.raises(BadRequestError):
                w1.list_workers("not valid")
            out = io.StringIO()
            assert client_cli.main(["--address", server.address, "workers"], out=out) == 0
            assert "w-1: 2 running" in out.getvalue() and "p1 seq 0: 1/2 trajectories" in out.getvalue()
        assert server.terminate() == 0
    with ServerProcess(tmp_path, *overrides) as server:  # the in-flight records come back with their holders
        with PacerClient(server.address) as client:
            assert [(w.client_id, w.running) for w in client.list_workers()] == [("", 1), ("w-1", 2), ("w-2", 1)]
            client.reset("abort", wait=0)  # nobody submits the partials here: drop the running groups at once
            assert client.list_workers() == []


def test_rate_limit_bucket_refills_with_time_and_forgets_idle_clients():
    from coda_server import admission

    now = [0.0]
    limit = admission.RateLimit("server.client_rate_limits.submit_per_second", rate=2.0, burst=3.0,
                                clock=lambda: now[0])
    assert [limit.take("a") for _ in range(3)] == [0.0, 0.0, 0.0]  # the burst
    assert limit.take("a") == pytest.approx(0.5)  # one token comes back every 1 / rate seconds
    assert limit.take("b") == 0.0  # another client has its own bucket
    now[0] = 0.25
    assert limit.take("a") == pytest.approx(0.25)
    now[0] = 0.5
    assert limit.take("a") == 0.0 and limit.refused == 2
    now[0] = 100.0  # every bucket has refilled: forgetting them changes nothing a client can see
    limit._forget_idle(now[0])
    assert limit._buckets == {}
    assert [limit.take("a") for _ in range(4)][-1] > 0


def test_fanout_drops_only_the_watcher_that_falls_behind_and_keeps_the_order():
    import asyncio

    from coda_server.core.types import ControlEvent, ControlEventType
    from coda_server.core.watchers import WatcherFanout

    async def run():
        fanout = WatcherFanout(limit=3)
        state = ControlEvent(ControlEventType.STATE)
        received = []

        async def reader():
            watcher = fanout.open(state, closed=False)
            try:
                async for event in watcher:
                    received.append(event.type)
                    if event.type == ControlEventType.SHUTDOWN:
                        return
            finally:
                watcher.close()

        async def stuck():  # takes its first event, then hangs as a stream whose client stopped reading does
            watcher = fanout.open(state, closed=False)
            await watcher.__anext__()
            await asyncio.Event().wait()

        reading = asyncio.ensure_future(reader())
        hanging = asyncio.ensure_future(stuck())
        await asyncio.sleep(0)
        for _ in range(5):  # the reader keeps up: it takes each event before the next is published
            fanout.publish(ControlEvent(ControlEventType.PAUSE))
            fanout.publish(ControlEvent(ControlEventType.RESUME))
            await asyncio.sleep(0)
        fanout.publish(ControlEvent(ControlEventType.SHUTDOWN))
        await reading
        with pytest.raises(asyncio.CancelledError):
            await hanging  # dropped: its task was cancelled, wherever it waited
        return fanout, received

    fanout, received = asyncio.run(run())
    assert received == [ControlEventType.STATE] + [ControlEventType.PAUSE, ControlEventType.RESUME] * 5 + [
        ControlEventType.SHUTDOWN]
    assert fanout.dropped == 1 and len(fanout) == 0


def test_the_server_raises_its_open_file_limit_up_to_the_hard_limit_and_warns_below_it():
    import subprocess
    import sys

    script = """
import logging, resource, sys
logging.basicConfig(level=logging.INFO, stream=sys.stdout, format="%(levelname)s %(message)s")
from coda_server.transport import raise_open_file_limit
resource.setrlimit(resource.RLIMIT_NOFILE, (256, 2048))
print("limits", raise_open_file_limit(1000))
print("limits", raise_open_file_limit(4000))
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=True).stdout
    assert "limits (1000, 2048)" in out and "raised the open-file limit from 256 to 1000" in out
    assert "limits (2048, 2048)" in out
    assert "WARNING the open-file limit is 2048, fewer than the 4000 connections" in out and "ulimit -Hn" in out
