"""Fail fast on a dead address (issue 23, item 5): a call where nothing listens fails within the channel's retries
with UNAVAILABLE naming the target and the OS error; waiting for a server still starting stays possible."""
from __future__ import annotations

import socket
import threading

import pytest

from coda_client import AsyncPacerClient, PacerClient
from coda_client.errors import UnavailableError
from conftest import core_overrides
from server_harness import ServerProcess


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_a_call_where_nothing_listens_fails_unavailable_naming_the_target():
    target = f"127.0.0.1:{free_port()}"
    with PacerClient(target, timeout=60.0) as client:  # a deadline far longer than the failure takes
        with pytest.raises(UnavailableError) as failed:
            client.state()
    assert target in str(failed.value) and "Connection refused" in str(failed.value)


def test_the_async_client_fails_the_same_way():
    import asyncio

    target = f"127.0.0.1:{free_port()}"

    async def go():
        async with AsyncPacerClient(target, timeout=60.0) as client:
            await client.state()

    with pytest.raises(UnavailableError) as failed:
        asyncio.run(go())
    assert target in str(failed.value)


def test_wait_for_ready_waits_for_a_server_that_starts_later(tmp_path):
    port = free_port()
    answer: dict = {}
    client = PacerClient(f"127.0.0.1:{port}", timeout=60.0, wait_for_ready=True)
    caller = threading.Thread(target=lambda: answer.update(state=client.state()), daemon=True)
    caller.start()  # nothing listens yet: the call waits for the server instead of failing
    with ServerProcess(tmp_path, *core_overrides(), f"server.address=127.0.0.1:{port}"):
        caller.join(60)
    client.close()
    assert "state" in answer and answer["state"].step == 0


def test_the_async_client_reports_its_connection_failing_then_ready(tmp_path):
    """connection_state: TRANSIENT_FAILURE where nothing listens (what a client that waits for ready cannot tell
    otherwise before its deadline), READY once a server listens there, and RuntimeError once the client is closed."""
    import asyncio

    import grpc

    port = free_port()

    async def until(client, wanted, state=None):
        while state is not wanted:
            state = await asyncio.wait_for(client.connection_state(state), 60)
        return state

    async def go():
        client = AsyncPacerClient(f"127.0.0.1:{port}", timeout=60.0, wait_for_ready=True)
        failing = await until(client, grpc.ChannelConnectivity.TRANSIENT_FAILURE)
        with ServerProcess(tmp_path, *core_overrides(), f"server.address=127.0.0.1:{port}"):
            state = await client.state()  # a call makes the channel connect again
            ready = await until(client, grpc.ChannelConnectivity.READY)
        await client.close()
        with pytest.raises(RuntimeError, match="closed"):
            await client.connection_state()
        return failing, state, ready

    failing, state, ready = asyncio.run(go())
    assert failing is grpc.ChannelConnectivity.TRANSIENT_FAILURE and ready is grpc.ChannelConnectivity.READY
    assert state.step == 0
