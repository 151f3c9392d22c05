"""The trainer iterator (coda_client.batches): packing, padding, group views, leases, prefetch, shutdown.

Packing is checked in process against hand-computed offsets and matrices. Everything else runs against
real servers: acknowledgement on the next request, redelivery in order after a trainer process is killed
mid-batch, a prefetch that spans a Reset, the step boundary (num_batches), a server shutdown, the async twin.
"""
from __future__ import annotations

import asyncio
import logging
import os
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest

from coda_client import (AsyncPacerClient, DeadlineExceededError, MiniBatch, PacerClient, ServerGoneError, Trajectory,
                         TrajectoryGroup, TrajectoryStatus)
from coda_client import batches as batches_module
from conftest import REPO_ROOT, core_overrides
from server_harness import ServerProcess
from test_durability_crash import free_port

N = 2  # trajectories per group in these tests


def _trajectory(prompt_id: str, i: int, length: int, *, logprobs: bool = True, mask: bool = True) -> Trajectory:
    tokens = np.arange(length, dtype=np.int32) + 100 * i
    return Trajectory(trajectory_id=f"{prompt_id}/{i}", prompt_id=prompt_id, status=TrajectoryStatus.COMPLETED,
                      reward=float(i), token_ids=tokens,
                      logprobs=-np.arange(length, dtype=np.float32) if logprobs else [],
                      loss_mask=(np.arange(length) % 2) if mask else [], start_weight_version=i,
                      end_weight_version=i + 1)


# --- packing, in process ------------------------------------------------------------------------------


def _batch() -> MiniBatch:
    groups = [TrajectoryGroup("a", seq=1, trajectories=[_trajectory("a", 0, 3), _trajectory("a", 1, 1)]),
              TrajectoryGroup("b", seq=2, epoch=0, index=5,
                              trajectories=[_trajectory("b", 0, 2, logprobs=False), _trajectory("b", 1, 0)])]
    return MiniBatch.from_groups(groups, "lease-1")


def test_packing_gives_flat_columns_and_offsets() -> None:
    batch = _batch()
    assert batch.cu_seqlens.tolist() == [0, 3, 4, 6, 6] and batch.num_tokens == 6 and len(batch) == 4
    assert batch.token_ids.tolist() == [0, 1, 2, 100, 0, 1]
    assert batch.token_ids.dtype == np.int32 and batch.logprobs.dtype == np.float32
    assert batch.group_index.tolist() == [0, 0, 1, 1] and batch.prompt_id == ("a", "a", "b", "b")
    assert batch.reward.tolist() == [0.0, 1.0, 0.0, 1.0]
    assert batch.start_weight_version.tolist() == [0, 1, 0, 1] and batch.end_weight_version.tolist() == [1, 2, 1, 2]
    # b/0 sent no logprobs: NaN keeps the column aligned; a missing mask would be ones.
    assert np.isnan(batch.logprobs[4:6]).all() and batch.logprobs[:4].tolist() == [0.0, -1.0, -2.0, 0.0]
    assert batch.loss_mask.tolist() == [0, 1, 0, 0, 0, 1]
    for column in (batch.token_ids, batch.cu_seqlens, batch.reward, batch.group_index):
        assert not column.flags.writeable


def test_to_torch_shares_the_batch_columns() -> None:
    torch = pytest.importorskip("torch", reason="torch is not installed (optional; never a dependency)")
    batch = _batch()
    tensors = batch.to_torch()
    assert tensors["token_ids"].tolist() == batch.token_ids.tolist() and tensors["cu_seqlens"].dtype == torch.int64
    # The batch owns its packed columns, so they are shared (no copy of a whole mini-batch per step).
    assert tensors["token_ids"].data_ptr() == batch.token_ids.ctypes.data


def test_groups_with_list_arrays_pack_the_same() -> None:
    def as_lists(t: Trajectory) -> Trajectory:
        return Trajectory(trajectory_id=t.trajectory_id, prompt_id=t.prompt_id, status=t.status, reward=t.reward,
                          token_ids=list(t.token_ids), logprobs=[float(x) for x in t.logprobs],
                          loss_mask=[int(x) for x in t.loss_mask], start_weight_version=t.start_weight_version,
                          end_weight_version=t.end_weight_version)

    arrays = _batch()
    lists = MiniBatch.from_groups([TrajectoryGroup(g.prompt_id, seq=g.seq, epoch=g.epoch, index=g.index,
                                                   trajectories=[as_lists(t) for t in g.trajectories])
                                   for g in arrays.source_groups])
    for name in ("token_ids", "logprobs", "loss_mask", "cu_seqlens", "group_index", "reward"):
        assert getattr(lists, name).tobytes() == getattr(arrays, name).tobytes(), name


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux only: elsewhere columns come from NumPy")
def test_a_large_column_lives_in_a_mapping_of_its_own_without_huge_pages() -> None:
    import mmap

    length = (4 << 20) // 4 + 1  # just over 4 MiB of int32: NumPy would ask for transparent huge pages here
    groups = [TrajectoryGroup("big", trajectories=[_trajectory("big", 0, length), _trajectory("big", 1, 5)])]
    batch = MiniBatch.from_groups(groups)

    def in_own_mapping(column: np.ndarray) -> bool:
        return isinstance(getattr(column.base, "obj", None), mmap.mmap)  # frombuffer: a memoryview of the mapping

    assert in_own_mapping(batch.token_ids) and in_own_mapping(batch.logprobs) and in_own_mapping(batch.loss_mask)
    expected = np.concatenate([np.arange(length, dtype=np.int32), np.arange(5, dtype=np.int32) + 100])
    assert batch.token_ids.dtype == np.int32 and np.array_equal(batch.token_ids, expected)
    assert not batch.token_ids.flags.writeable and batch.num_tokens == length + 5
    assert not in_own_mapping(_batch().token_ids)  # small columns: NumPy's own memory


def _big_batch(length: int = (4 << 20) // 4 + 1, first: int = 0) -> MiniBatch:
    return MiniBatch.from_groups([TrajectoryGroup("big", trajectories=[_trajectory("big", first, length)])])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux only: elsewhere columns come from NumPy")
def test_a_gone_columns_mapping_serves_the_next_batch_and_one_still_viewed_never_does() -> None:
    import gc
    import weakref

    def mapping_of(column: np.ndarray):
        return column.base.obj  # frombuffer: a memoryview of the mapping

    first = _big_batch()
    kept = weakref.ref(mapping_of(first.token_ids))
    del first
    gc.collect()
    second = _big_batch(first=1)
    assert mapping_of(second.token_ids) is kept()  # written over, not a new mapping zeroed by the kernel
    assert np.array_equal(second.token_ids, np.arange((4 << 20) // 4 + 1, dtype=np.int32) + 100)

    viewed = second.token_ids[10:20]  # a view keeps its column, and so the mapping, from reuse
    view_of_base = np.frombuffer(second.logprobs.base, dtype=np.float32)  # an array over the mapping itself
    held_mappings = {id(mapping_of(second.token_ids)), id(mapping_of(second.logprobs))}
    del second
    gc.collect()
    third = _big_batch(first=2)
    assert id(mapping_of(third.token_ids)) not in held_mappings and id(mapping_of(third.logprobs)) not in held_mappings
    assert viewed.tolist() == list(range(110, 120)) and view_of_base[1] == -1.0


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux only: elsewhere columns come from NumPy")
def test_no_more_mappings_are_kept_than_were_in_use_at_once_and_clear_lets_them_go() -> None:
    import gc

    from coda_client.batches import COLUMN_MAPPINGS

    COLUMN_MAPPINGS.clear()
    held = [_big_batch(), _big_batch()]  # 3 large columns each
    assert COLUMN_MAPPINGS.in_use == 6 and COLUMN_MAPPINGS.peak == 6
    column_bytes = held[0].token_ids.nbytes
    del held
    gc.collect()
    assert COLUMN_MAPPINGS.in_use == 0 and COLUMN_MAPPINGS.kept_bytes() == 6 * column_bytes
    batches = [_big_batch() for _ in range(3)]  # 6 reused, 3 new: 9 in use at once now
    assert COLUMN_MAPPINGS.peak == 9 and COLUMN_MAPPINGS.kept_bytes() == 0
    del batches
    gc.collect()
    assert COLUMN_MAPPINGS.kept_bytes() == 9 * column_bytes
    COLUMN_MAPPINGS.clear()
    assert COLUMN_MAPPINGS.kept_bytes() == 0 and COLUMN_MAPPINGS.peak == 0
    one = _big_batch()  # counting anew: one batch's columns at most are kept after it goes
    del one
    gc.collect()
    assert COLUMN_MAPPINGS.peak == 3 and COLUMN_MAPPINGS.kept_bytes() == 3 * column_bytes


def test_absent_loss_mask_is_ones() -> None:
    batch = MiniBatch.from_groups([TrajectoryGroup("m", trajectories=[_trajectory("m", 0, 3, mask=False)])])
    assert batch.loss_mask.tolist() == [1, 1, 1]


@pytest.mark.parametrize("side, expected_tokens, expected_attention", [
    ("right", [[0, 1, 2], [100, 9, 9], [0, 1, 9], [9, 9, 9]],
     [[1, 1, 1], [1, 0, 0], [1, 1, 0], [0, 0, 0]]),
    ("left", [[0, 1, 2], [9, 9, 100], [9, 0, 1], [9, 9, 9]],
     [[1, 1, 1], [0, 0, 1], [0, 1, 1], [0, 0, 0]]),
])
def test_to_padded_on_either_side(side, expected_tokens, expected_attention) -> None:
    padded = _batch().to_padded(side, pad_token_id=9)
    assert padded.token_ids.tolist() == expected_tokens
    assert padded.attention_mask.astype(int).tolist() == expected_attention
    assert (padded.loss_mask[~padded.attention_mask] == 0).all() and (padded.logprobs[~padded.attention_mask] == 0).all()
    flat = _batch()
    assert padded.loss_mask[padded.attention_mask].tolist() == flat.loss_mask.tolist()  # row-major = packed order
    wide = _batch().to_padded(side, length=5)
    assert wide.token_ids.shape == (4, 5) and wide.attention_mask.sum() == 6
    with pytest.raises(ValueError, match="shorter than the longest"):
        _batch().to_padded(side, length=2)


def test_to_padded_refuses_an_unknown_side() -> None:
    with pytest.raises(ValueError, match="'right' or 'left'"):
        _batch().to_padded("middle")  # type: ignore[arg-type]


def test_group_views_slice_the_batch() -> None:
    batch = _batch()
    a, b = batch.groups
    assert (a.prompt_id, a.seq, len(a), a.position) == ("a", 1, 2, 0)
    assert (b.prompt_id, b.epoch, b.index, b.start, b.stop) == ("b", 0, 5, 2, 4)
    assert a.token_ids.tolist() == [0, 1, 2, 100] and a.cu_seqlens.tolist() == [0, 3, 4]
    assert b.token_ids.tolist() == [0, 1] and b.cu_seqlens.tolist() == [0, 2, 2] and b.reward.tolist() == [0.0, 1.0]
    assert [t.trajectory_id for t in b.trajectories] == ["b/0", "b/1"]
    assert np.shares_memory(a.token_ids, batch.token_ids)


# --- against a server ---------------------------------------------------------------------------------


def _server(tmp_path, *extra: str) -> ServerProcess:
    return ServerProcess(tmp_path, "fully_async.sliding_window=no-window", "data_source.num_prompts_per_step=64",
                         f"data_source.num_trajectories_per_prompt={N}", f"trainer.mini_batch_size={2 * N}",
                         "rollout.filter=[status]", *extra)


def _fill(pacer: PacerClient, prompt_ids: list[str], length: int = 4) -> None:
    pacer.dispatch(prompt_ids)
    for prompt_id in prompt_ids:
        pacer.submit([_trajectory(prompt_id, i, length) for i in range(N)])


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with _server(tmp_path_factory.mktemp("batches")) as running:
        yield running


def _drain(pacer: PacerClient) -> None:
    while pacer.collect(64, allow_partial=True, wait=0.01):
        pass


async def _drain_and_fill_async(pacer: AsyncPacerClient, prompt_ids: list[str]) -> int:
    """_drain then _fill (trajectories of 3 tokens) through the async client; the consumed count before the fill."""
    while await pacer.collect(64, allow_partial=True, wait=0.01):
        pass
    consumed = (await pacer.state()).consumed
    await pacer.dispatch(prompt_ids)
    for prompt_id in prompt_ids:
        await pacer.submit([_trajectory(prompt_id, j, 3) for j in range(N)])
    return consumed


def test_asking_for_the_next_batch_acknowledges_the_last(server) -> None:
    with PacerClient(server.address) as pacer:
        _drain(pacer)
        consumed = pacer.state().consumed
        _fill(pacer, ["n0", "n1", "n2", "n3", "n4", "n5"])
        with pacer.batches(2 * N, lease=60, poll=1) as batches:
            first = next(batches)
            assert [g.prompt_id for g in first.groups] == ["n0", "n1"] and first.lease_id
            assert pacer.state().consumed == consumed  # in hand, leased: not consumed yet
            second = next(batches)
            assert [g.prompt_id for g in second.groups] == ["n2", "n3"]
            batches.wait_for_ack()  # the acknowledgement goes out with the request, and completes in the background
            assert pacer.state().consumed == consumed + 2  # the first was acknowledged by asking for the second
            assert batches.ack() == 2 and pacer.state().consumed == consumed + 4  # explicit ack
            third = next(batches)  # nothing left to acknowledge for the second: no error
            assert [g.prompt_id for g in third.groups] == ["n4", "n5"]
        assert pacer.state().consumed == consumed + 6  # leaving the block without an error acknowledged the third
        assert pacer.state().leased == 0


def test_num_batches_stops_at_the_step_boundary_without_leasing_more(server) -> None:
    with PacerClient(server.address) as pacer:
        _drain(pacer)
        _fill(pacer, [f"s{i}" for i in range(6)])
        seen = [[g.prompt_id for g in batch.groups] for batch in pacer.batches(2 * N, num_batches=2, poll=1)]
        assert seen == [["s0", "s1"], ["s2", "s3"]]
        state = pacer.state()
        assert (state.leased, state.buffered) == (0, 2)  # the next step's groups were never taken


def test_a_prefetch_spans_a_reset(server) -> None:
    """The iterator waits in a Collect while the trainer ends a step; groups of the new step arrive in it."""
    with PacerClient(server.address) as pacer:
        _drain(pacer)
        with pacer.batches(2 * N, lease=60, poll=0.5) as batches:
            _fill(pacer, ["r0", "r1"])
            first = next(batches)
            _fill(pacer, ["r-pending"])  # one of the next batch's groups before the Reset
            state = pacer.state()
            reset = pacer.reset("abort", resume=True, weight_version=state.weight_version + 1)
            assert reset.generation == state.generation + 1
            _fill(pacer, ["r2"])
            second = next(batches)  # acknowledges the first (leased across the Reset) and takes the next
            assert [g.prompt_id for g in first.groups] == ["r0", "r1"]
            assert [g.prompt_id for g in second.groups] == ["r-pending", "r2"]
        assert pacer.state().leased == 0


def test_a_trainer_killed_mid_batch_gets_its_groups_again_in_order(tmp_path) -> None:
    with _server(tmp_path) as running, PacerClient(running.address) as pacer:
        _fill(pacer, [f"k{i}" for i in range(4)])
        trainer = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
            import sys, time
            from coda_client import PacerClient
            pacer = PacerClient({running.address!r})
            batches = pacer.batches({2 * N}, lease=1.0, poll=1)
            batch = next(batches)
            while pacer.state().leased < 4:  # the prefetch took the second batch too
                time.sleep(0.01)
            print(",".join(g.prompt_id for g in batch.groups), flush=True)
            time.sleep(60)  # "training": killed here
        """)], stdout=subprocess.PIPE, text=True, cwd=REPO_ROOT)
        try:
            assert trainer.stdout.readline().strip() == "k0,k1"
        finally:
            trainer.send_signal(signal.SIGKILL)
            trainer.wait(10)
        with pacer.batches(4 * N, lease=30, poll=5, num_batches=1) as batches:
            [again] = list(batches)  # waits until both leases ran out and the groups came back
        assert [g.prompt_id for g in again.groups] == ["k0", "k1", "k2", "k3"]
        state = pacer.state()
        assert (state.redelivered, state.consumed, state.leased) == (4, 4, 0)


def _outage_lines(caplog, level: int) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "coda_client.batches" and r.levelno == level]


def _until_leased(pacer: PacerClient, groups: int) -> None:
    deadline = time.monotonic() + 20
    while pacer.state().leased < groups:
        assert time.monotonic() < deadline, f"the prefetch did not lease {groups} groups"
        time.sleep(0.01)


def test_a_trainer_that_fails_mid_batch_gives_its_batch_and_the_prefetched_one_back_at_once(server) -> None:
    """An exception in the training step (Ctrl-C, a crash caught by the launcher) left the batch in hand and the
    prefetched one leased until their lease ran out (600 s by default), a restarted trainer training newer groups
    meanwhile. Now both are released as the block exits: first in line again, in order, at once."""
    with PacerClient(server.address) as pacer:
        _drain(pacer)
        consumed = pacer.state().consumed
        _fill(pacer, [f"x{i}" for i in range(6)])
        with pytest.raises(RuntimeError, match="step failed"):
            with pacer.batches(2 * N, lease=600, poll=1) as batches:
                first = next(batches)
                _until_leased(pacer, 4)  # the prefetch took x2, x3
                raise RuntimeError("step failed")
        assert [g.prompt_id for g in first.groups] == ["x0", "x1"]
        state = pacer.state()
        assert (state.leased, state.consumed, state.buffered) == (0, consumed, 6)
        assert [g.prompt_id for g in pacer.collect(6, wait=0)] == [f"x{i}" for i in range(6)]  # no lease ran out


def test_a_step_failing_at_once_gives_back_the_prefetch_still_under_way_too(server) -> None:
    """The step raises as soon as it has the batch: the prefetch of the next is still under way (its answer on the
    way, or not sent yet). Cut short, a batch already leased to it stayed leased for the lease's 600 s, unknown to
    the client; now close() lets it arrive and gives it back."""
    with PacerClient(server.address) as pacer:
        for attempt in range(5):  # the race differs run to run: each must leave nothing leased
            _drain(pacer)
            consumed = pacer.state().consumed
            prompts = [f"z{attempt}-{i}" for i in range(6)]
            _fill(pacer, prompts)
            with pytest.raises(RuntimeError, match="step failed"):
                with pacer.batches(2 * N, lease=600, poll=1) as batches:
                    next(batches)
                    raise RuntimeError("step failed")
            state = pacer.state()
            assert (state.leased, state.consumed, state.buffered) == (0, consumed, 6), (attempt, state)
            assert [g.prompt_id for g in pacer.collect(6, wait=0)] == prompts


def test_leaving_the_loop_early_acknowledges_the_batch_trained_and_gives_the_prefetched_one_back(server) -> None:
    with PacerClient(server.address) as pacer:
        _drain(pacer)
        consumed = pacer.state().consumed
        _fill(pacer, [f"e{i}" for i in range(4)])
        with pacer.batches(2 * N, lease=600, poll=1) as batches:
            for batch in batches:
                _until_leased(pacer, 4)
                break  # trained on one batch, then done
        state = pacer.state()
        assert (state.leased, state.consumed) == (0, consumed + 2)
        assert [g.prompt_id for g in pacer.collect(2, wait=0)] == ["e2", "e3"]


def test_the_async_iterator_gives_back_what_it_holds_when_the_step_fails(server) -> None:
    async def scenario() -> tuple[list[str], int, list[str]]:
        async with AsyncPacerClient(server.address) as pacer:
            consumed = await _drain_and_fill_async(pacer, [f"y{i}" for i in range(4)])
            with pytest.raises(RuntimeError, match="step failed"):
                async with pacer.batches(2 * N, lease=600, poll=1) as batches:
                    batch = await batches.__anext__()
                    while (await pacer.state()).leased < 4:
                        await asyncio.sleep(0.01)
                    raise RuntimeError("step failed")
            state = await pacer.state()
            again = await pacer.collect(4, wait=0)
            return ([g.prompt_id for g in batch.groups], state.consumed - consumed + state.leased,
                    [g.prompt_id for g in again])

    first, taken, again = asyncio.run(scenario())
    assert first == ["y0", "y1"] and taken == 0 and again == ["y0", "y1", "y2", "y3"]


def test_the_async_iterator_gives_back_a_prefetch_still_under_way_when_the_step_fails_at_once(server) -> None:
    async def scenario() -> list[tuple[int, int, bool]]:
        outcomes = []
        async with AsyncPacerClient(server.address) as pacer:
            for attempt in range(5):
                prompts = [f"q{attempt}-{i}" for i in range(6)]
                consumed = await _drain_and_fill_async(pacer, prompts)
                with pytest.raises(RuntimeError, match="step failed"):
                    async with pacer.batches(2 * N, lease=600, poll=1) as batches:
                        await batches.__anext__()
                        raise RuntimeError("step failed")
                state = await pacer.state()
                again = [g.prompt_id for g in await pacer.collect(6, wait=0)]
                outcomes.append((state.leased, state.consumed - consumed, again == prompts))
        return outcomes

    assert asyncio.run(scenario()) == [(0, 0, True)] * 5


def test_a_graceful_server_restart_trains_no_batch_twice(tmp_path, caplog) -> None:
    """The trainer acknowledges the batch it trained while the server restarts (SIGTERM, as a rolling update
    does): the Ack waits for the restarted server, which kept the lease, so the batch is not delivered again;
    the iterator goes on with the next batch. The outage is logged once as it begins, and once as it ends."""
    caplog.set_level(logging.DEBUG, logger="coda_client.batches")
    overrides = (f"server.address=127.0.0.1:{free_port()}", f"server.state_dir={tmp_path / 'state'}")
    running = _server(tmp_path, *overrides).start()
    try:
        with PacerClient(running.address, timeout=30) as pacer:
            _fill(pacer, ["d0", "d1", "d2", "d3"])
            batches = pacer.batches(2 * N, lease=120, poll=5)
            first = next(batches)
            assert [g.prompt_id for g in first.groups] == ["d0", "d1"]
            assert batches.wait_watching(30)
            running.process.send_signal(signal.SIGTERM)  # the batch is trained meanwhile, then acknowledged
            assert running.process.wait(30) == 0
            acknowledged = []
            acking = threading.Thread(target=lambda: acknowledged.append(batches.ack()))
            acking.start()
            running.close()
            running = _server(tmp_path, *overrides).start()
            acking.join(60)
            assert acknowledged == [2]
            second = next(batches)  # the prefetch, cut by the shutdown, ran again on the restarted server
            assert [g.prompt_id for g in second.groups] == ["d2", "d3"]
            assert batches.ack() == 2
            batches.close()
            state = pacer.state()
            assert (state.consumed, state.redelivered, state.leased) == (4, 0, 0), state
        [began] = _outage_lines(caplog, logging.WARNING)
        assert f"pacer at {running.address} ended" in began and "reconnect=120 s" in began
        [ended] = _outage_lines(caplog, logging.INFO)
        assert re.fullmatch(rf"batches: control stream of the pacer at {running.address} back after [0-9.]+ s", ended)
    finally:
        running.close()


def test_a_client_that_waits_for_ready_rides_through_a_server_killed_and_restarted(tmp_path) -> None:
    """A trainer whose client waits for a server to be ready (as the worker's does): a call made while the server is
    down ends DEADLINE_EXCEEDED, not UNAVAILABLE. The iterator takes it as the server away, as it takes UNAVAILABLE:
    the Ack waits for the restarted server instead of ending the training with DeadlineExceededError."""
    overrides = (f"server.address=127.0.0.1:{free_port()}", f"server.state_dir={tmp_path / 'state'}")
    running = _server(tmp_path, *overrides).start()
    try:
        with PacerClient(running.address, timeout=1.0, wait_for_ready=True) as pacer:
            _fill(pacer, ["w0", "w1", "w2", "w3"])
            batches = pacer.batches(2 * N, lease=120, poll=0.5, reconnect=60)
            first = next(batches)
            assert [g.prompt_id for g in first.groups] == ["w0", "w1"]
            assert batches.wait_watching(30)
            running.kill()
            acknowledged = []
            acking = threading.Thread(target=lambda: acknowledged.append(batches.ack()))
            acking.start()
            with pytest.raises(DeadlineExceededError):  # while the Ack waits: down for longer than a deadline
                pacer.state()
            running.close()
            running = _server(tmp_path, *overrides).start()
            acking.join(60)
            assert acknowledged == [2]
            second = next(batches)
            assert [g.prompt_id for g in second.groups] == ["w2", "w3"]
            assert batches.ack() == 2
            batches.close()
    finally:
        running.close()


def test_the_iterator_raises_server_gone_when_no_server_comes_back(tmp_path, caplog) -> None:
    caplog.set_level(logging.DEBUG, logger="coda_client.batches")
    with _server(tmp_path) as running, PacerClient(running.address) as pacer:
        _fill(pacer, ["d0", "d1"])
        batches = pacer.batches(2 * N, lease=60, poll=30, reconnect=1.0)
        first = next(batches)  # the prefetch now waits in a 30 s long-poll for groups that never come
        assert [g.prompt_id for g in first.groups] == ["d0", "d1"]
        assert batches.wait_watching(30)
        os.kill(running.process.pid, signal.SIGTERM)
        assert running.process.wait(30) == 0
        with pytest.raises(ServerGoneError, match="announced SHUTDOWN"):
            next(batches)  # the Ack of the first batch, then the prefetch: neither finds a server
        assert batches.server_shut_down and batches.delivered == 1 and batches.acknowledged == 0
        batches.close()
    # One warning as the outage began, whatever the attempts to reconnect since (each at debug level only).
    [began] = _outage_lines(caplog, logging.WARNING)
    assert "reconnecting, and calls wait up to reconnect=1 s" in began
    assert not _outage_lines(caplog, logging.INFO)


def _stall_lines(caplog, level: int) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "coda_client.batches" and r.levelno == level
            and re.match(r"batches: (no .* for \d+ s from|the .* came after)", r.getMessage())]


def _until_logged(caplog, level: int, text: str, timeout: float = 30.0) -> str:
    deadline = time.monotonic() + timeout
    while not (lines := [m for m in _stall_lines(caplog, level) if text in m]):
        assert time.monotonic() < deadline, f"no log line with {text!r}; the iterator's: {_stall_lines(caplog, level)}"
        time.sleep(0.02)
    return lines[0]


def test_a_mini_batch_that_does_not_come_is_said_in_the_trainers_log_with_why(tmp_path, caplog, monkeypatch) -> None:
    """The natural mistake, a Reset without its Resume before the next batch, left the trainer waiting with nothing in
    its log (the server's collect-stall warning never fires for batches(), whose Collects each wait only `poll`).
    Now the iterator reads the server's state once the caller has waited STALL_WARNING_SECONDS and says why."""
    monkeypatch.setattr(batches_module, "STALL_WARNING_SECONDS", 0.3)
    monkeypatch.setattr(batches_module, "STALL_REPEAT_SECONDS", 3600.0)
    caplog.set_level(logging.INFO, logger="coda_client.batches")
    with _server(tmp_path) as server, PacerClient(server.address) as pacer:
        pacer.reset("abort")  # and no Resume
        with pacer.batches(2 * N, poll=0.2) as batches:
            # Fetched ahead while the caller does not ask (it trains on the batch before): nothing to say yet.
            created = time.monotonic()
            while time.monotonic() - created < 4 * batches_module.STALL_WARNING_SECONDS:
                time.sleep(0.05)
            assert _stall_lines(caplog, logging.WARNING) == []
            asked: dict = {}
            caller = threading.Thread(target=lambda: asked.update(batch=next(batches)), daemon=True)
            caller.start()
            paused = _until_logged(caplog, logging.WARNING, "dispatch is paused")
            assert f"no mini-batch of 2 groups for 0 s from the pacer at {server.address}" in paused
            assert "a Reset without its Resume" in paused
            pacer.resume(1)
            _fill(pacer, ["r0", "r1"])
            caller.join(30)
            assert [g.prompt_id for g in asked["batch"].groups] == ["r0", "r1"]
            assert _until_logged(caplog, logging.INFO, "the mini-batch of 2 groups came after")

        loop_errors: list[dict] = []

        async def no_worker() -> list[str]:  # the async iterator, dispatch open and no worker dispatching
            asyncio.get_running_loop().set_exception_handler(lambda loop, context: loop_errors.append(context))
            async with AsyncPacerClient(server.address) as client:
                async with client.batches(2 * N, poll=0.2, rank=1, world_size=2) as shares:
                    waiting = asyncio.create_task(shares.__anext__())
                    deadline = time.monotonic() + 30
                    while not [m for m in _stall_lines(caplog, logging.WARNING) if "rank 1" in m]:
                        assert time.monotonic() < deadline, "no warning for rank 1's share"
                        await asyncio.sleep(0.02)
                    await client.dispatch(["w0", "w1"])
                    for prompt_id in ["w0", "w1"]:
                        await client.submit([_trajectory(prompt_id, i, 4) for i in range(N)])
                    share = await asyncio.wait_for(waiting, 30)
                    return [g.prompt_id for g in share.groups]

        assert asyncio.run(no_worker()) == ["w1"]
        # The next share's prefetch, cut by leaving the block, ended quietly (no "exception never retrieved").
        assert loop_errors == []
    [idle] = [m for m in _stall_lines(caplog, logging.WARNING) if "rank 1" in m]
    assert "no share for rank 1 of 2 of a mini-batch of 2 groups" in idle
    assert "no group is running and 0 are buffered: no rollout worker is dispatching" in idle


def test_bad_arguments_are_refused(server) -> None:
    with PacerClient(server.address) as pacer:
        with pytest.raises(ValueError, match="multiple of the group size"):
            pacer.batches(3)
        with pytest.raises(ValueError, match="lease must be > 0"):
            pacer.batches(2 * N, lease=0)


def test_the_async_iterator_acknowledges_and_stops_like_the_blocking_one(server) -> None:
    async def scenario() -> tuple[list[list[str]], int, int]:
        async with AsyncPacerClient(server.address) as pacer:
            consumed = await _drain_and_fill_async(pacer, [f"a{i}" for i in range(4)])
            seen = []
            async with pacer.batches(2 * N, poll=1, num_batches=2) as batches:
                async for batch in batches:
                    seen.append([g.prompt_id for g in batch.groups])
                    assert batch.token_ids.tolist()[:3] == [0, 1, 2]
            state = await pacer.state()
            return seen, state.consumed - consumed, state.leased

    seen, consumed, leased = asyncio.run(scenario())
    assert seen == [["a0", "a1"], ["a2", "a3"]] and (consumed, leased) == (4, 0)


def test_a_client_closed_under_an_open_iterator_ends_its_watch_quietly(tmp_path, monkeypatch) -> None:
    """The iterator's control-stream thread reopens the stream when it ends; with the client closed under it
    that is impossible, and the thread stops without a traceback (the iterator's own next() says why)."""
    failures: list[str] = []
    monkeypatch.setattr(threading, "excepthook",
                        lambda args: failures.append(f"{args.thread.name}: {args.exc_value!r}"))
    with ServerProcess(tmp_path, "data_source.num_prompts_per_step=2", "data_source.num_trajectories_per_prompt=2",
                       "trainer.mini_batch_size=2") as server:
        client = PacerClient(server.address)
        batches = client.batches(2, poll=1)
        assert batches.wait_watching(30)
        client.close()  # ends the control stream: the watch thread tries to reopen it
        deadline = time.monotonic() + 30
        while any(t.name == "coda-batches-watch" for t in threading.enumerate()) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not any(t.name == "coda-batches-watch" for t in threading.enumerate())
        with pytest.raises(RuntimeError, match="is closed"):
            next(batches)
        batches.close()
    assert failures == []


@pytest.mark.parametrize("arguments, message", [
    (dict(mini_batch_size=64.0), "mini_batch_size must be an integer number of trajectories, not 64.0"),
    (dict(mini_batch_size=64, group_size=8.0), "group_size must be an integer number of trajectories, not 8.0"),
    (dict(mini_batch_size=True), "mini_batch_size must be an integer number of trajectories, not True"),
    (dict(mini_batch_size=64, rank=0.0, world_size=2), "rank must be an integer in 0..1"),
    (dict(mini_batch_size=64, num_batches=2.0), "num_batches must be an integer >= 0"),
])
def test_batches_refuses_a_float_where_a_count_goes_at_once(arguments, message):
    """A float count (a YAML value, M / N) used to be taken and fail at the first next() with protobuf's TypeError."""
    from coda_client.batches import BatchIterator, BatchShape

    options = {k: arguments.pop(k) for k in ("num_batches",) if k in arguments}
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(".", r"\.")):
        shape = BatchShape.of(arguments.pop("mini_batch_size"), arguments.pop("group_size", None), lambda: [8],
                              token_budget=None, rank=arguments.pop("rank", 0),
                              world_size=arguments.pop("world_size", 1))
        BatchIterator(None, shape, lease=60, poll=1, **options)


def test_batches_takes_numpy_integers_as_counts():
    """NumPy's integers (a count computed with NumPy; a launcher's rank) are integers: the shape holds Python ints."""
    from coda_client.batches import BatchShape

    shape = BatchShape.of(np.int64(64), None, lambda: [8], token_budget=None, rank=np.int64(1),
                          world_size=np.int32(2))
    assert shape == BatchShape(8, 0, 1, 2) and all(type(v) is int for v in (shape.num_groups, shape.rank,
                                                                            shape.world_size))
    assert BatchShape.of(None, None, lambda: [8], token_budget=np.int64(4096), rank=0, world_size=1).token_budget == 4096


def test_a_trainer_waiting_for_a_batch_while_dispatch_is_paused_is_told_so_within_seconds(tmp_path, monkeypatch, caplog):
    """A Reset without its Resume, then next(): nothing can come until a Resume, yet the iterator said so only after
    the minute it gives any slow batch. Knowing from the control stream that dispatch is paused, it says so after
    PAUSED_WARNING_SECONDS."""
    from server_harness import until

    monkeypatch.setattr(batches_module, "STALL_WARNING_SECONDS", 3600.0)  # only the pause may warn in this test
    with ServerProcess(tmp_path, *core_overrides("no-window", B=2, stale=0.0, N=2, M=2)) as server, \
            PacerClient(server.address) as pacer, caplog.at_level(logging.WARNING, logger="coda_client"):
        pacer.reset("wait", wait=0)  # paused; the trainer forgot resume()
        with pacer.batches(2, poll=1) as batches:
            waiting = threading.Thread(target=lambda: next(batches, None), daemon=True)
            waiting.start()
            until(lambda: "dispatch is paused (step 0): a Reset without its Resume" in caplog.text,
                  "the paused warning", timeout=60)
            assert waiting.is_alive()  # it waits on: another process may resume


def test_cancelling_a_task_waiting_in_the_async_iterator_ends_it(tmp_path) -> None:
    """A trainer task cancelled while its iterator waits for a mini-batch (asyncio.wait_for or asyncio.timeout around
    it, a supervisor stopping it): the cancel read as the server's SHUTDOWN cutting the Collect, which was sent again,
    and the task never ended. Now it ends cancelled, and a later iterator of the same client takes the groups."""

    async def scenario(address: str) -> tuple[bool, bool, list[str]]:
        async with AsyncPacerClient(address) as pacer:
            async def consume() -> None:
                async with pacer.batches(2 * N, lease=60, poll=30) as batches:
                    async for _ in batches:
                        raise AssertionError("no group was submitted: no batch can come")

            task = asyncio.create_task(consume())
            await asyncio.sleep(0.5)  # its first Collect is sent and waits (a 30 s poll)
            task.cancel()
            done, _ = await asyncio.wait({task}, timeout=20)
            ended = task in done
            cancelled = ended and task.cancelled()
            if not ended:
                return False, False, []
            with PacerClient(address) as worker:
                _fill(worker, ["c0", "c1"])
            async with pacer.batches(2 * N, lease=60, poll=5, num_batches=1) as batches:
                taken = [g.prompt_id async for batch in batches for g in batch.groups]
            return ended, cancelled, taken

    with _server(tmp_path) as running:
        ended, cancelled, taken = asyncio.run(asyncio.wait_for(scenario(running.address), 90))
    assert ended, "the cancelled task was still waiting 20 s after its cancel"
    assert cancelled and taken == ["c0", "c1"]
