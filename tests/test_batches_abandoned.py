"""An iterator dropped without close() or its `with` block gives its leases back once it is collected.

Its threads and tasks used to hold it, so it was never collected and its heartbeats kept its leases alive for the
life of the process: its groups never went to another rank. Each test drops an iterator that holds a batch in hand and
a prefetched one, against a real server whose lease (600 s) and trainer grace (300 s) are far beyond the test's
waits: only a Release brings the groups back in time, first in line for the next iterator.
"""
from __future__ import annotations

import asyncio
import gc
import logging
import threading

from coda_client import AsyncPacerClient, PacerClient, Trajectory, TrajectoryStatus
from server_harness import ServerProcess, until

N = 2  # trajectories per group
LEASE = 600.0
GRACE = 300.0
BACK_WITHIN = 20.0  # seconds for the leases to come back: far less than the lease and the grace
ABANDONED = "abandoned without close()"


def _server(tmp_path) -> ServerProcess:
    return ServerProcess(tmp_path, "fully_async.sliding_window=no-window", "data_source.num_prompts_per_step=64",
                         f"data_source.num_trajectories_per_prompt={N}", f"trainer.mini_batch_size={2 * N}",
                         "rollout.filter=[status]", f"server.trainer_liveness_seconds={GRACE}")


def _fill(pacer: PacerClient, prompt_ids: list[str]) -> None:
    pacer.dispatch(prompt_ids)
    for prompt_id in prompt_ids:
        pacer.submit([Trajectory(trajectory_id=f"{prompt_id}/{i}", prompt_id=prompt_id,
                                 status=TrajectoryStatus.COMPLETED, token_ids=[1, 2, 3]) for i in range(N)])


def _abandoned_warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "coda_client.batches" and ABANDONED in r.getMessage()]


def _assert_given_back(pacer: PacerClient, heartbeat: threading.Thread, caplog) -> None:
    until(lambda: pacer.state().leased == 0, "the dropped iterator's leases to be given back", timeout=BACK_WITHIN)
    state = pacer.state()
    assert (state.buffered, state.consumed) == (4, 0)
    heartbeat.join(BACK_WITHIN)
    assert not heartbeat.is_alive()  # nothing keeps the server from giving back what it may still hold
    until(lambda: _abandoned_warnings(caplog), "the warning", timeout=BACK_WITHIN)
    [warning] = _abandoned_warnings(caplog)
    assert "were given back (4 groups)" in warning and "(1 batches delivered, 0 acknowledged)" in warning


def test_a_blocking_iterator_dropped_without_close_gives_its_leases_back(tmp_path, caplog) -> None:
    caplog.set_level(logging.WARNING, logger="coda_client.batches")
    with _server(tmp_path) as running, PacerClient(running.address) as pacer:
        _fill(pacer, ["d0", "d1", "d2", "d3"])

        def take_one(client: PacerClient) -> tuple[list[str], threading.Thread]:
            """Takes one batch and returns from within the loop: the iterator is neither closed nor acknowledged."""
            batches = client.batches(2 * N, lease=LEASE, poll=1)
            for batch in batches:
                until(lambda: pacer.state().leased == 4, "the prefetch to lease the second batch")
                return [g.prompt_id for g in batch.groups], batches._heartbeat
            raise AssertionError("no batch")

        with PacerClient(running.address) as trainer:
            taken, heartbeat = take_one(trainer)
            assert taken == ["d0", "d1"]
            gc.collect()
            _assert_given_back(pacer, heartbeat, caplog)
            # First in line again, in order, for the next iterator.
            with trainer.batches(2 * N, lease=LEASE, poll=1, num_batches=2) as again:
                assert [[g.prompt_id for g in batch.groups] for batch in again] == [["d0", "d1"], ["d2", "d3"]]
        assert len(_abandoned_warnings(caplog)) == 1
        assert pacer.state().consumed == 4


async def _take_one(client: AsyncPacerClient, pacer: PacerClient, kept: list | None = None
                    ) -> tuple[list[str], threading.Thread]:
    """Takes one batch, waits for the prefetch to lease the next, and returns from within the loop (keeping the
    iterator in `kept` when given)."""
    batches = client.batches(2 * N, lease=LEASE, poll=1)
    if kept is not None:
        kept.append(batches)
    async for batch in batches:
        while pacer.state().leased < 4:
            await asyncio.sleep(0.02)
        return [g.prompt_id for g in batch.groups], batches._heartbeat
    raise AssertionError("no batch")


def test_an_async_iterator_dropped_without_close_gives_its_leases_back(tmp_path, caplog) -> None:
    caplog.set_level(logging.WARNING)
    with _server(tmp_path) as running, PacerClient(running.address) as pacer:
        _fill(pacer, ["a0", "a1", "a2", "a3"])

        async def train() -> None:
            async with AsyncPacerClient(running.address) as client:
                taken, heartbeat = await asyncio.wait_for(_take_one(client, pacer), 30)
                assert taken == ["a0", "a1"]
                gc.collect()
                for _ in range(int(BACK_WITHIN / 0.02)):  # the loop runs meanwhile: the iterator's tasks are cut on it
                    if pacer.state().leased == 0:
                        break
                    await asyncio.sleep(0.02)
                _assert_given_back(pacer, heartbeat, caplog)
                async with client.batches(2 * N, lease=LEASE, poll=1, num_batches=2) as again:
                    assert [[g.prompt_id for g in batch.groups] async for batch in again] == [["a0", "a1"],
                                                                                             ["a2", "a3"]]

        asyncio.run(train())
        gc.collect()
        assert len(_abandoned_warnings(caplog)) == 1 and pacer.state().consumed == 4
        # The cut tasks' ends were read: asyncio has nothing to say about them.
        assert not [r.getMessage() for r in caplog.records if r.name == "asyncio"]


def test_an_async_iterator_dropped_after_its_event_loop_ended_gives_its_leases_back(tmp_path, caplog) -> None:
    """asyncio.run ended with the iterator still referenced (its heartbeats, from a thread, went on); dropped then,
    its leases are given back through a blocking client of its own."""
    caplog.set_level(logging.WARNING, logger="coda_client.batches")
    with _server(tmp_path) as running, PacerClient(running.address) as pacer:
        _fill(pacer, ["e0", "e1", "e2", "e3"])
        kept: list = []

        async def train() -> tuple[list[str], threading.Thread]:
            async with AsyncPacerClient(running.address) as client:
                return await asyncio.wait_for(_take_one(client, pacer, kept), 30)

        taken, heartbeat = asyncio.run(train())
        assert taken == ["e0", "e1"] and pacer.state().leased == 4 and heartbeat.is_alive()
        kept.clear()
        gc.collect()
        _assert_given_back(pacer, heartbeat, caplog)
        assert [g.prompt_id for g in pacer.collect(4)] == ["e0", "e1", "e2", "e3"]
