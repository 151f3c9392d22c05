"""An AsyncPacerClient used from a second event loop: after the first has ended (a second asyncio.run, as tests and
notebooks do) it works; while the first still runs, the call is refused, saying why."""
from __future__ import annotations

import asyncio
import threading

import pytest

from coda_client import AsyncPacerClient
from server_harness import ServerProcess


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with ServerProcess(tmp_path_factory.mktemp("loops"), "data_source.num_prompts_per_step=2",
                       "data_source.num_trajectories_per_prompt=2", "trainer.mini_batch_size=2") as running:
        yield running


def test_a_client_keeps_working_in_the_next_asyncio_run(server):
    client = AsyncPacerClient(server.address)

    async def dispatch(prompt_id: str) -> list[str]:
        return (await client.dispatch([prompt_id])).admitted

    assert asyncio.run(dispatch("a")) == ["a"]
    assert asyncio.run(dispatch("b")) == ["b"]  # was: RuntimeError("Event loop is closed")

    async def close() -> int:
        running = (await client.state()).running
        await client.close()
        return running

    assert asyncio.run(close()) == 2


def test_a_client_in_use_on_a_loop_that_still_runs_is_refused_on_another(server):
    other = asyncio.new_event_loop()
    thread = threading.Thread(target=other.run_forever, daemon=True)
    thread.start()
    client = AsyncPacerClient(server.address)

    async def step() -> int:
        return (await client.state()).step

    try:
        assert asyncio.run_coroutine_threadsafe(step(), other).result(30) == 0
        with pytest.raises(RuntimeError, match="in use on another event loop, which still runs: an AsyncPacerClient "
                                               "serves one event loop; make one client per loop"):
            asyncio.run(step())
        assert asyncio.run_coroutine_threadsafe(step(), other).result(30) == 0  # its own loop is unaffected
        asyncio.run_coroutine_threadsafe(client.close(), other).result(30)
    finally:
        other.call_soon_threadsafe(other.stop)
        thread.join(30)
        other.close()
