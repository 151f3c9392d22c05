"""EndJob: dispatch closes for good, watchers hear JOB_ENDED, the worker kit submits what it holds and returns,
the trainer gets a report of what was left, and a restarted server stays ended; batches(num_batches="step")."""
from __future__ import annotations

import asyncio
import threading
import time

import grpc
import pytest

from coda_client import (AsyncPacerClient, ControlEventType, FailedPreconditionError, PacerClient, ResetMode,
                         Trajectory, TrajectoryStatus)
from coda_client._proto import pacer_pb2 as pb
from coda_worker import AsyncRolloutWorker, FakeEngine, ListPromptSource, Prompt, SamplingParams
from conftest import core_overrides
from server_harness import ServerProcess

WAIT = 20.0


def trajectory(prompt_id: str, index: int, status: TrajectoryStatus = TrajectoryStatus.COMPLETED) -> Trajectory:
    return Trajectory(trajectory_id=f"{prompt_id}#{index}", prompt_id=prompt_id, status=status, reward=float(index),
                      token_ids=[1, 2], logprobs=[-0.1, -0.2])


@pytest.fixture
def server(tmp_path):
    with ServerProcess(tmp_path, *core_overrides("no-window", B=2, stale=1.0, N=2, M=2)) as process:
        yield process


def watch_until(pacer: PacerClient, kind: ControlEventType, found: list, ready: threading.Event) -> threading.Thread:
    """Follows the control stream on a thread until an event of `kind` (kept in `found`)."""
    def follow() -> None:
        with pacer.watch() as stream:
            for event in stream:
                ready.set()
                if event.type == kind:
                    found.append(event)
                    return

    thread = threading.Thread(target=follow, daemon=True)
    thread.start()
    return thread


def test_end_job_closes_dispatch_tells_watchers_and_reports_what_was_left(server):
    with PacerClient(server.address) as pacer:
        assert pacer.dispatch(["a", "b", "c"]).admitted == ["a", "b", "c"]
        pacer.submit([trajectory("a", 0), trajectory("a", 1), trajectory("b", 0)])  # a complete, b half, c nothing
        events: list = []
        ready = threading.Event()
        watcher = watch_until(pacer, ControlEventType.JOB_ENDED, events, ready)
        assert ready.wait(WAIT)

        report = pacer.end_job("abort", wait=0)

        assert report.mode == ResetMode.ABORT
        assert report.buffered_prompt_ids == ["a"]
        assert report.in_flight_prompt_ids == ["b", "c"]
        assert (report.held_prompt_ids, report.kept_prompt_ids, report.leased) == ([], [], 0)
        assert report.state.job_ended and report.state.paused
        assert report.left_over == 3
        watcher.join(WAIT)
        assert events and events[0].mode == ResetMode.ABORT and events[0].job_ended
        assert "job ended (EndJob, mode abort) at step 0" in server.log()

        # Dispatch closed for good: answered at once (not after its wait), nothing admitted, saying why.
        started = time.monotonic()
        answer = pacer.dispatch(["d"], wait=10)
        assert answer.job_ended and answer.paused and answer.admitted == []
        assert time.monotonic() - started < 5
        # Workers hand in what they hold; the trainer may still take what is buffered.
        pacer.submit([trajectory("b", 1)])
        assert [g.prompt_id for g in pacer.collect(2, wait=WAIT)] == ["a", "b"]
        # There is no next step.
        for call in (lambda: pacer.reset("wait", wait=0), lambda: pacer.resume(1)):
            with pytest.raises(FailedPreconditionError) as refused:
                call()
            assert refused.value.reason == "JOB_ENDED"
        # A second EndJob reports the present and changes nothing.
        again = pacer.end_job("wait", wait=0)
        assert again.mode == ResetMode.ABORT and again.in_flight_prompt_ids == ["c"] and again.buffered_prompt_ids == []
        assert again.state.consumed == 2
        # A watcher that connects now learns it from its first event.
        with pacer.watch() as stream:
            first = next(iter(stream))
        assert first.type == ControlEventType.STATE and first.job_ended


def test_end_job_waits_for_the_running_groups_and_refuses_bad_input(server):
    with PacerClient(server.address) as pacer:
        pacer.dispatch(["a"])
        pacer.submit([trajectory("a", 0)])
        with pytest.raises(Exception) as bad:
            pacer.end_job("wait", wait=-1)
        assert "wait_seconds" in str(bad.value)
        assert not pacer.state().job_ended  # refused: nothing changed

        def late_submit() -> None:
            time.sleep(0.3)
            pacer.submit([trajectory("a", 1, TrajectoryStatus.ABORTED)])

        thread = threading.Thread(target=late_submit)
        thread.start()
        report = pacer.end_job("abort", wait=WAIT)
        thread.join()
        # The aborted group is complete (it came in during the wait) but the gate holds ABORTED groups.
        assert report.in_flight_prompt_ids == [] and report.held_prompt_ids == ["a"]
        assert report.waited_seconds < WAIT


def test_a_restarted_server_stays_ended(tmp_path):
    overrides = [*core_overrides("no-window", B=2, stale=1.0, N=2, M=2), f"server.state_dir={tmp_path / 'state'}"]
    with ServerProcess(tmp_path, *overrides) as first:
        with PacerClient(first.address) as pacer:
            pacer.dispatch(["a"])
            pacer.end_job("wait", wait=0)
    with ServerProcess(tmp_path, *overrides) as second:
        with PacerClient(second.address) as pacer:
            state = pacer.state()
            assert state.job_ended and state.paused
            assert pacer.dispatch(["b"]).job_ended
            with pytest.raises(FailedPreconditionError):
                pacer.resume(1)


@pytest.mark.parametrize("mode", [ResetMode.ABORT, ResetMode.WAIT])
def test_a_stream_opened_after_the_end_hears_how_the_job_ended_also_after_a_restart(tmp_path, mode):
    """A worker that reconnects after EndJob gets STATE, not the JOB_ENDED event it missed: the STATE carries EndJob's
    mode, so in ABORT mode the worker aborts what it holds instead of finishing it (it finished, mode not said)."""
    overrides = [*core_overrides("no-window", B=2, stale=1.0, N=2, M=2), f"server.state_dir={tmp_path / 'state'}"]
    with ServerProcess(tmp_path, *overrides) as first, PacerClient(first.address) as pacer:
        pacer.end_job(mode.name.lower(), wait=0)
        with pacer.watch() as stream:
            event = next(stream)
        assert (event.type, event.job_ended, event.mode) == (ControlEventType.STATE, True, mode)
        assert first.terminate() == 0
    with ServerProcess(tmp_path, *overrides) as second, PacerClient(second.address) as pacer:
        with pacer.watch() as stream:
            event = next(stream)
        assert (event.type, event.job_ended, event.mode) == (ControlEventType.STATE, True, mode)


def test_the_worker_kit_submits_what_it_holds_and_returns_at_job_ended(server):
    async def go():
        source = ListPromptSource([Prompt(f"p{i}", [1, 2, 3]) for i in range(1000)])
        # Slow requests (about 2 s each): the worker holds groups when the job ends.
        engine = FakeEngine(seed=0, mean_tokens=2000, length_sigma=0, seconds_per_token=0.001)
        async with AsyncPacerClient(server.address) as trainer, AsyncPacerClient(server.address,
                                                                                  client_id="w0") as pacer:
            worker = AsyncRolloutWorker(pacer, engine, source, sampling=SamplingParams(max_tokens=4000),
                                        max_groups=2, dispatch_wait=30)
            task = asyncio.create_task(worker.run())
            deadline = time.monotonic() + WAIT
            while engine.running < 4:
                assert time.monotonic() < deadline, "the worker never held 2 groups"
                await asyncio.sleep(0.01)
            report = await trainer.end_job("abort", wait=WAIT)
            stats = await asyncio.wait_for(task, WAIT)
            return report, stats, await trainer.state()

    report, stats, state = asyncio.run(go())
    assert stats.groups_started == 2 and stats.trajectories_aborted == 4 and stats.trajectories_refused == 0
    assert report.in_flight_prompt_ids == [] and sorted(report.held_prompt_ids) == ["p0", "p1"]
    assert state.dispatched == 2 and state.submitted == 4


def test_batches_yield_exactly_one_step_with_num_batches_step(tmp_path):
    # B=4 groups of N=2 per step, M=4: a step is 4 * 2 / 4 = 2 mini-batches of 2 groups.
    with ServerProcess(tmp_path, *core_overrides("no-window", B=4, stale=1.0, N=2, M=4)) as server:
        with PacerClient(server.address) as pacer:
            ids = [f"p{i}" for i in range(6)]
            pacer.dispatch(ids)
            pacer.submit([trajectory(p, i) for p in ids for i in range(2)])
            state = pacer.state()
            assert (state.prompts_per_step, state.group_sizes, state.mini_batch_size) == (4, [2], 4)
            with pacer.batches(mini_batch_size=4, num_batches="step", lease=60) as batches:
                seen = [list(batch.prompt_id) for batch in batches]
            assert seen == [["p0", "p0", "p1", "p1"], ["p2", "p2", "p3", "p3"]]
            assert pacer.state().buffered == 2  # the next step's groups were not taken
            with pytest.raises(ValueError, match="multiple of mini_batch_size 6"):
                pacer.batches(mini_batch_size=6, num_batches="step")

            async def async_step() -> list:
                async with AsyncPacerClient(server.address) as client:
                    async with client.batches(mini_batch_size=2, num_batches="step", lease=60) as batches:
                        return [batch.prompt_id for batch in [b async for b in batches]]

            pacer.dispatch(["q0", "q1"])
            pacer.submit([trajectory(p, i) for p in ("q0", "q1") for i in range(2)])
            assert len(asyncio.run(async_step())) == 4  # 4 * 2 / 2


def test_end_job_request_ids_answer_a_retry_with_the_first_report(server):
    channel = grpc.insecure_channel(server.address)
    from coda_client._proto import pacer_pb2_grpc

    stub = pacer_pb2_grpc.RolloutPacerStub(channel)
    stub.Dispatch(pb.DispatchRequest(candidates=[pb.PromptRef(prompt_id="a")]))
    first = stub.EndJob(pb.EndJobRequest(mode=pb.RESET_MODE_WAIT, request_id="end-1"))
    stub.Submit(pb.SubmitRequest(trajectories=[pb.Trajectory(trajectory_id="a#0", prompt_id="a", status=1)]))
    retry = stub.EndJob(pb.EndJobRequest(mode=pb.RESET_MODE_WAIT, request_id="end-1"))
    assert retry == first and list(first.in_flight_prompt_ids) == ["a"]
    channel.close()


def test_the_batch_iterators_end_when_the_job_has_ended_and_nothing_more_comes(server):
    with PacerClient(server.address) as pacer:
        pacer.dispatch(["a", "b"])
        pacer.submit([trajectory("a", 0), trajectory("a", 1), trajectory("b", 0)])  # b stays incomplete
        seen: list = []
        batches = pacer.batches(mini_batch_size=2, poll=0.5, lease=60)
        assert batches.wait_watching(WAIT)

        def train() -> None:
            with batches:
                for batch in batches:  # without num_batches: until the job ends and nothing more comes
                    seen.append(batch.prompt_id[0])
                    pacer.end_job("wait", wait=0)

        trainer = threading.Thread(target=train, daemon=True)
        trainer.start()
        trainer.join(WAIT)
        assert not trainer.is_alive(), "the iterator kept polling after the job ended"
        assert seen == ["a"] and batches.job_ended

    async def async_loop() -> list:
        async with AsyncPacerClient(server.address) as client:
            async with client.batches(mini_batch_size=2, poll=0.5, lease=60) as batches:
                return [batch async for batch in batches]

    assert asyncio.run(asyncio.wait_for(async_loop(), WAIT)) == []  # ended before it started: no batch, no hang
