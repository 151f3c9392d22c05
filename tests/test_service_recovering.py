"""While the server rebuilds its state from server.state_dir: every RPC, streaming ones included, answers
UNAVAILABLE with reason RECOVERING, and /metrics answers 200 with what can be read (readiness, recovery)."""
from __future__ import annotations

import asyncio
import threading
import urllib.request

import grpc
import pytest
from google.rpc import error_details_pb2
from grpc_status import rpc_status

from coda_client._proto import pacer_pb2 as pb
from coda_client._proto import pacer_pb2_grpc
from coda_server.core import NoWindowStrategy, Pacer, PromptRef, load_config, register_sliding_window_strategy
from coda_server.core.sqlite_journal import SqliteJournal
from coda_server.server import PacerServer
from coda_server.service import RolloutPacerServicer

pytestmark = pytest.mark.usefixtures("scratch_registry")
BOUND = 30.0  # seconds any step may take before the test fails instead of hanging


def reason_of(error: grpc.RpcError) -> str:
    for detail in rpc_status.from_call(error).details:
        if detail.Is(error_details_pb2.ErrorInfo.DESCRIPTOR):
            info = error_details_pb2.ErrorInfo()
            detail.Unpack(info)
            return info.reason
    return ""


def scrape(port: int) -> tuple[int, str]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=BOUND) as response:
        return response.status, response.read().decode()


def test_watch_control_and_metrics_while_the_state_is_rebuilt(tmp_path):
    replaying, release = threading.Event(), threading.Event()
    hold = threading.Event()

    @register_sliding_window_strategy("test-held-replay")
    class HeldReplay(NoWindowStrategy):
        """Blocks the replay of the first recorded Dispatch until the test has looked at the recovering server."""

        def on_dispatched(self, groups):
            if hold.is_set():
                hold.clear()
                replaying.set()
                release.wait(BOUND)
            super().on_dispatched(groups)

    config = load_config(overrides=[
        "fully_async.sliding_window=test-held-replay", f"server.state_dir={tmp_path / 'state'}",
        "server.address=127.0.0.1:0", "server.metrics_address=127.0.0.1:0"])
    journal = SqliteJournal(tmp_path / "state", fsync="off")
    Pacer(config, journal=journal).dispatch([PromptRef("p0")])  # one event to replay
    journal.close()

    server = PacerServer(config)
    started, stop = threading.Event(), None
    loop = asyncio.new_event_loop()

    async def serve() -> None:
        nonlocal stop
        stop = asyncio.Event()
        await server.start()
        started.set()
        await stop.wait()
        await server.stop(0)

    hold.set()
    thread = threading.Thread(target=loop.run_until_complete, args=(serve(),), daemon=True)
    thread.start()
    try:
        assert replaying.wait(BOUND), "the server never began replaying"
        with grpc.insecure_channel(f"127.0.0.1:{server.listeners.tcp_port}") as channel:
            stub = pacer_pb2_grpc.RolloutPacerStub(channel)
            for call in (lambda: next(iter(stub.WatchControl(pb.WatchControlRequest(), timeout=BOUND))),
                         lambda: next(iter(stub.CollectStream(pb.CollectRequest(num_groups=1), timeout=BOUND))),
                         lambda: stub.GetState(pb.GetStateRequest(), timeout=BOUND)):
                with pytest.raises(grpc.RpcError) as caught:
                    call()
                assert caught.value.code() == grpc.StatusCode.UNAVAILABLE, caught.value.details()
                assert reason_of(caught.value) == "RECOVERING"
            status, text = scrape(server.metrics_port)
            assert status == 200
            assert "coda_server_recovering 1.0" in text and "coda_server_ready 0.0" in text
            assert "coda_pacer_running_groups" not in text and "coda_pacer_dispatched_groups_total" not in text
            assert "grpc_server_started_total" in text  # the metrics that can be read are there

            release.set()
            assert started.wait(BOUND), "the server never finished recovering"
            first = next(iter(stub.WatchControl(pb.WatchControlRequest(), timeout=BOUND)))
            assert first.type == pb.CONTROL_EVENT_TYPE_STATE
            status, text = scrape(server.metrics_port)
            assert status == 200 and "coda_server_ready 1.0" in text and "coda_server_recovering 0.0" in text
            assert "coda_pacer_dispatched_groups_total 1.0" in text and "coda_pacer_running_groups 1.0" in text
    finally:
        release.set()
        if stop is not None:
            loop.call_soon_threadsafe(stop.set)
        thread.join(BOUND)
        loop.close()
    assert not thread.is_alive()


def test_every_rpc_of_the_service_maps_core_errors_to_status_codes():
    service = pb.DESCRIPTOR.services_by_name["RolloutPacer"]
    unmapped = [method.name for method in service.methods
                if not getattr(getattr(RolloutPacerServicer, method.name), "maps_errors", False)]
    assert unmapped == []
    streaming = [method.name for method in service.methods if method.server_streaming]
    assert sorted(streaming) == ["CollectStream", "WatchControl"]  # both covered above, over real gRPC
