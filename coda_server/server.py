"""Server wiring: the grpc.aio server with the pacer service, health, reflection, limits and graceful drain."""
from __future__ import annotations

import asyncio
import logging
from typing import Any, Optional

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from coda_client._proto import pacer_pb2, pacer_pb2_grpc

from .core.async_pacer import AsyncPacer
from .core.pacer import Pacer
from .service import RolloutPacerServicer

log = logging.getLogger("coda_server")

SERVICE_NAME = pacer_pb2.DESCRIPTOR.services_by_name["RolloutPacer"].full_name
HEALTH_SERVICES = ("", "liveness", "readiness", SERVICE_NAME)


class BindError(RuntimeError):
    """The configured address could not be bound (in use, or not a local address)."""


def server_options(config: Any) -> list[tuple[str, Any]]:
    """Channel arguments of the server; each one is here for a reason."""
    max_bytes = int(config.server.max_message_bytes)
    return [
        # A second server on the same port must fail loudly, not silently share (and steal) traffic.
        ("grpc.so_reuseport", 0),
        ("grpc.max_receive_message_length", max_bytes),
        ("grpc.max_send_message_length", max_bytes),
        # Keepalive: ping idle connections every 60 s so dead workers' connections are noticed,
        # and accept client pings as often as every 10 s (the client pings every 30 s).
        ("grpc.keepalive_time_ms", 60_000),
        ("grpc.keepalive_timeout_ms", 20_000),
        ("grpc.http2.min_ping_interval_without_data_ms", 10_000),
        ("grpc.keepalive_permit_without_calls", 1),
    ]


class PacerServer:
    """One pacing server: owns the Pacer, its asyncio face, the grpc.aio server and the health states."""

    def __init__(self, config: Any, pacer: Optional[Pacer] = None):
        self.config = config
        self.pacer = pacer if pacer is not None else Pacer(config)
        self.async_pacer = AsyncPacer(
            self.pacer,
            max_wait_seconds=float(config.server.max_wait_seconds),
            request_id_cache_size=int(config.server.request_id_cache_size),
        )
        self.health = health.aio.HealthServicer()
        self.server: Optional[grpc.aio.Server] = None
        self.ports: list[int] = []

    async def start(self) -> list[int]:
        """Bind, start serving and turn readiness on; returns the bound port(s)."""
        self.async_pacer.bind_loop()
        self.server = grpc.aio.server(
            options=server_options(self.config),
            maximum_concurrent_rpcs=int(self.config.server.max_concurrent_rpcs),
        )
        pacer_pb2_grpc.add_RolloutPacerServicer_to_server(RolloutPacerServicer(self.async_pacer), self.server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        services = [SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name]
        if self.config.server.reflection:
            from grpc_reflection.v1alpha import reflection

            reflection.enable_server_reflection([*services, reflection.SERVICE_NAME], self.server)
        address = str(self.config.server.address)
        self.ports = [self._bind(address)]
        for name in HEALTH_SERVICES:
            await self.health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
        await self.health.set("liveness", health_pb2.HealthCheckResponse.SERVING)
        await self.server.start()
        # State is in memory and ready the moment the server starts.
        for name in ("", "readiness", SERVICE_NAME):
            await self.health.set(name, health_pb2.HealthCheckResponse.SERVING)
        return self.ports

    def _bind(self, address: str) -> int:
        try:
            port = self.server.add_insecure_port(address)
        except RuntimeError as exc:
            raise BindError(f"cannot listen on {address}: {exc}") from None
        if port == 0:
            raise BindError(f"cannot listen on {address}: the address is in use or not available")
        return port

    async def drain(self) -> None:
        """Stop taking work: readiness NOT_SERVING, waiting long-polls answered now, watchers told SHUTDOWN."""
        for name in ("", "readiness", SERVICE_NAME):
            await self.health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
        self.async_pacer.drain()

    async def stop(self, grace: Optional[float] = None) -> None:
        """Drain, then give in-flight RPCs `grace` seconds (default server.shutdown_grace_seconds) to finish."""
        if grace is None:
            grace = float(self.config.server.shutdown_grace_seconds)
        await self.drain()
        if self.server is not None:
            await self.server.stop(grace)

    async def wait_for_termination(self) -> None:
        if self.server is not None:
            await self.server.wait_for_termination()
