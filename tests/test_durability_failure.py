"""A state directory that can no longer be written: changes are refused UNAVAILABLE and readiness turns off."""
from __future__ import annotations

import asyncio

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from coda_client._proto import pacer_pb2 as pb
from coda_client._proto import pacer_pb2_grpc
from coda_server.core import load_config
from coda_server.server import PacerServer


def test_journal_write_failure_refuses_changes_and_turns_readiness_off(tmp_path):
    config = load_config(overrides=["server.address=127.0.0.1:0", "server.metrics_address=",
                                    f"server.state_dir={tmp_path / 'state'}"])

    async def scenario() -> tuple:
        server = PacerServer(config)
        await server.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{server.ports[0]}") as channel:
                stub = pacer_pb2_grpc.RolloutPacerStub(channel)
                health = health_pb2_grpc.HealthStub(channel)
                ready_before = (await health.Check(health_pb2.HealthCheckRequest(service="readiness"))).status
                await stub.Dispatch(pb.DispatchRequest(candidates=[pb.PromptRef(prompt_id="a")]))

                def disk_full(batch):
                    raise OSError(28, "No space left on device")

                server.journal._commit = disk_full  # the next write fails, as a full disk would
                try:
                    await stub.Dispatch(pb.DispatchRequest(candidates=[pb.PromptRef(prompt_id="b")]))
                    refused = None
                except grpc.aio.AioRpcError as error:
                    refused = error
                for _ in range(100):  # the health update is scheduled on the loop; let it run
                    await asyncio.sleep(0)
                ready_after = (await health.Check(health_pb2.HealthCheckRequest(service="readiness"))).status
                return ready_before, refused, ready_after
        finally:
            await server.stop(0)

    ready_before, refused, ready_after = asyncio.run(scenario())
    assert ready_before == health_pb2.HealthCheckResponse.SERVING
    assert refused is not None and refused.code() == grpc.StatusCode.UNAVAILABLE
    assert "can no longer be written" in refused.details() and "No space left" in refused.details()
    assert ready_after == health_pb2.HealthCheckResponse.NOT_SERVING
