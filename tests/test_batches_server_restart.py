"""A graceful server restart (SIGTERM, then a server again on the same address and state) while the trainer holds the
last batch of its iterator: the iterator closes itself after it (num_batches), and its acknowledgement, sent as it
closed, must still land on the restarted server, with the heartbeats keeping the lease meanwhile. Before, a closed
iterator no longer followed the control stream, so nothing told it the server was back: the Ack waited out
`reconnect` without trying the address, ended in a ServerGoneError saying no server had answered, and the heartbeats
had stopped, so the server's liveness grace handed the trained batch out again."""
from __future__ import annotations

import asyncio

import pytest

from coda_client import AsyncPacerClient, PacerClient
from server_harness import ServerProcess, until
from test_durability_crash import free_port
from test_trainer_liveness import GRACE, LEASE, N, _fill, _server

RECONNECT = 30.0  # the iterator's bound on waiting for a server; the restart takes a few seconds


def _restart(running: ServerProcess, tmp_path, overrides) -> ServerProcess:
    assert running.terminate() == 0  # graceful: the iterator hears SHUTDOWN on its control stream
    running.close()
    return _server(tmp_path, *overrides).start()


@pytest.mark.parametrize("kind", ["blocking", "async"])
def test_the_last_batchs_ack_lands_on_the_restarted_server_and_nothing_is_delivered_again(tmp_path, kind):
    overrides = (f"server.address=127.0.0.1:{free_port()}", f"server.state_dir={tmp_path / 'state'}")
    running = _server(tmp_path, *overrides).start()
    address = running.address
    try:
        with PacerClient(address) as pacer:
            _fill(pacer, ["r0", "r1"])
        trained: list[str] = []
        if kind == "blocking":
            with PacerClient(address) as trainer:
                with trainer.batches(2 * N, lease=LEASE, poll=1, num_batches=1, reconnect=RECONNECT) as batches:
                    for batch in batches:
                        trained += [group.prompt_id for group in batch.groups]
                        running = _restart(running, tmp_path, overrides)
        else:
            async def train() -> None:
                nonlocal running
                async with AsyncPacerClient(address) as trainer:
                    async with trainer.batches(2 * N, lease=LEASE, poll=1, num_batches=1,
                                               reconnect=RECONNECT) as batches:
                        async for batch in batches:
                            trained.extend(group.prompt_id for group in batch.groups)
                            running = await asyncio.to_thread(_restart, running, tmp_path, overrides)

            asyncio.run(train())
        assert trained == ["r0", "r1"]
        with PacerClient(address) as pacer:
            until(lambda: pacer.state().consumed == 2, "the acknowledgement to land", timeout=RECONNECT)
            state = pacer.state()
            assert (state.leased, state.buffered, state.redelivered) == (0, 0, 0)
    finally:
        running.close()
