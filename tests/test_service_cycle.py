"""End-to-end over real gRPC: a fully-async cycle, control events, health and shutdown, plugins, the CLI."""
from __future__ import annotations

import hashlib
import io
import json
import signal
import threading

import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from coda_client import (
    ControlEventType,
    PacerClient,
    ResetMode,
    StaleGenerationError,
    Trajectory,
    TrajectoryStatus,
)
from coda_client import cli as client_cli
from coda_client._proto import pacer_pb2 as pb
from server_harness import ServerProcess

B, N, M = 4, 2, 4  # prompts per step, group size, mini-batch (trajectories): a fetch takes M // N groups


def make_trajectory(prompt_id: str, i: int, weight_version: int) -> Trajectory:
    digest = hashlib.sha256(f"{prompt_id}/{i}".encode()).digest()
    return Trajectory(trajectory_id=f"{prompt_id}/t{i}", prompt_id=prompt_id, status=TrajectoryStatus.COMPLETED,
                      reward=float(digest[0] % 3), token_ids=list(digest[:16]), logprobs=[-x / 256 for x in digest[:16]],
                      loss_mask=[1] * 16, start_weight_version=weight_version, end_weight_version=weight_version,
                      metadata={"worker": "test"}, payload=digest * 4)


@pytest.fixture
def server(tmp_path):
    with ServerProcess(tmp_path, f"data_source.num_prompts_per_step={B}", f"data_source.num_trajectories_per_prompt={N}",
                       f"trainer.mini_batch_size={M}", "fully_async.stale_steps=1.0",
                       "fully_async.sliding_window=windowed-fifo", "rollout.continue_restored=false") as process:
        yield process


def test_full_fully_async_cycle_delivers_every_trajectory_exactly_once(server):
    steps = 4
    sent: dict[str, Trajectory] = {}
    sent_lock = threading.Lock()
    stop = threading.Event()
    errors: list[BaseException] = []

    def worker(name: str) -> None:
        serial = 0
        try:
            with PacerClient(server.address) as pacer:
                while not stop.is_set():
                    candidates = [f"{name}-p{serial + i}" for i in range(2)]
                    d = pacer.dispatch(candidates, wait=0.2)
                    serial += 2
                    for prompt_id in d.admitted:
                        batch = [make_trajectory(prompt_id, i, d.weight_version) for i in range(N)]
                        try:
                            pacer.submit(batch)
                        except StaleGenerationError:
                            continue  # a Reset came between dispatch and submit: the group was dropped
                        with sent_lock:
                            sent.update({t.trajectory_id: t for t in batch})
        except BaseException as exc:  # surfaced by the main thread
            errors.append(exc)

    workers = [threading.Thread(target=worker, args=(f"w{i}",)) for i in range(3)]
    for thread in workers:
        thread.start()
    consumed: list[Trajectory] = []
    set_aside: list[Trajectory] = []  # restored at a Reset, or part of a dropped incomplete group
    dropped_prompts: set[str] = set()
    try:
        with PacerClient(server.address) as trainer:
            for step in range(steps):
                for _ in range(B * N // M):
                    groups = trainer.collect(M // N, wait=30)
                    assert len(groups) == M // N
                    consumed.extend(t for g in groups for t in g.trajectories)
                result = trainer.reset("wait" if step % 2 else "abort", wait=10, resume=True, weight_version=step + 1)
                assert (result.step, result.weight_version, result.generation) == (step + 1, step + 1, step + 1)
                set_aside.extend(t for g in result.restored for t in g.trajectories)
                dropped_prompts.update(result.dropped_prompt_ids)
            stop.set()
            for thread in workers:
                thread.join(30)
            final = trainer.reset("wait", wait=10)
            set_aside.extend(t for g in final.restored for t in g.trajectories)
            dropped_prompts.update(final.dropped_prompt_ids)
            consumed.extend(t for g in trainer.collect(10_000, allow_partial=True) for t in g.trajectories)
            state = trainer.state()
    finally:
        stop.set()
    assert not errors, errors
    consumed_ids = [t.trajectory_id for t in consumed]
    assert len(consumed_ids) == len(set(consumed_ids)), "a trajectory was delivered twice"
    for t in consumed:
        assert t == sent[t.trajectory_id], "the trainer must get back exactly what the worker sent"
    accounted = set(consumed_ids) | {t.trajectory_id for t in set_aside}
    accounted |= {tid for tid, t in sent.items() if t.prompt_id in dropped_prompts}
    assert accounted == set(sent), "every acknowledged trajectory is consumed, restored or dropped"
    assert state.dispatched == state.running + state.collected + state.filtered + state.restored + state.dropped
    assert state.consumed == len(consumed_ids) // N and state.buffered == 0 and state.running == 0
    assert len(state.recent_reports) == steps + 1


def test_watch_control_reports_state_then_pause_and_resume_in_order(server):
    with PacerClient(server.address) as pacer:
        with pacer.watch() as stream:
            first = next(stream)
            assert (first.type, first.step, first.paused) == (ControlEventType.STATE, 0, False)
            pacer.reset("abort", resume=True, weight_version=7)
            pause, resume = next(stream), next(stream)
    assert (pause.type, pause.mode, pause.paused) == (ControlEventType.PAUSE, ResetMode.ABORT, True)
    assert (resume.type, resume.weight_version, resume.step, resume.paused) == (ControlEventType.RESUME, 7, 1, False)


def test_shutdown_turns_readiness_off_answers_waiters_and_exits_zero(server):
    health = health_pb2_grpc.HealthStub(server.channel())
    readiness = health.Watch(health_pb2.HealthCheckRequest(service="readiness"))
    assert next(readiness).status == health_pb2.HealthCheckResponse.SERVING
    with PacerClient(server.address) as pacer, pacer.watch() as stream:
        assert next(stream).type == ControlEventType.STATE
        # A raw stub's future, so the long-poll waits in the background while the test goes on.
        waiting_collect = server.stub().Collect.future(pb.CollectRequest(num_groups=1, wait_seconds=120))
        while pacer.state().waiting_calls < 1:
            pass
        server.process.send_signal(signal.SIGTERM)
        assert next(readiness).status == health_pb2.HealthCheckResponse.NOT_SERVING
        answer = waiting_collect.result(timeout=30)  # answered at once, not after 120 s
        assert answer.timed_out and len(answer.groups) == 0
        assert next(stream).type == ControlEventType.SHUTDOWN
    assert server.process.wait(30) == 0


def test_seed_example_strategy_loads_from_a_plugin_directory(tmp_path):
    with ServerProcess(tmp_path, "server.custom_strategy_dirs=[examples/strategies]",
                       "fully_async.sliding_window=fixed-capacity", "data_source.num_prompts_per_step=3",
                       "data_source.num_trajectories_per_prompt=1", "trainer.mini_batch_size=1") as server:
        with PacerClient(server.address) as pacer:
            assert pacer.state().strategy == "fixed-capacity"
            # fixed-capacity allows B = 3 running or buffered, whatever stale_steps says.
            assert pacer.dispatch([f"p{i}" for i in range(10)]).admitted == ["p0", "p1", "p2"]


def test_unknown_strategy_stops_start_up_listing_the_registered_ones(tmp_path):
    server = ServerProcess(tmp_path, "fully_async.sliding_window=nope")
    with pytest.raises(RuntimeError) as caught:
        server.start()
    assert "registered strategies: latency-aware, no-window, window-gated, windowed-fifo" in str(caught.value)
    server.close()


def test_second_server_on_the_same_port_fails_loudly(server, tmp_path):
    port = server.address.rsplit(":", 1)[1]
    second = ServerProcess(tmp_path)
    second.overrides = (f"server.address=127.0.0.1:{port}",)  # applied after the harness's port 0
    with pytest.raises(RuntimeError) as caught:
        second.start()
    assert "cannot listen on 127.0.0.1:" + port in str(caught.value)
    second.close()


def run_cli(*argv: str) -> tuple[int, str]:
    out = io.StringIO()
    code = client_cli.main(list(argv), out=out)
    return code, out.getvalue()


def test_command_line_client_against_a_live_server(server):
    address = ("--address", server.address)
    assert run_cli(*address, "health") == (0, "readiness: SERVING\n")
    code, text = run_cli(*address, "state", "--json")
    state = json.loads(text)
    assert code == 0 and state["step"] == 0 and state["window_size"] == 2 * B and state["strategy"] == "windowed-fifo"
    code, text = run_cli(*address, "reset", "--mode", "wait", "--resume", "--weight-version", "3", "--json")
    assert code == 0 and json.loads(text)["weight_version"] == 3
    code, text = run_cli(*address, "resume", "--weight-version", "2")
    assert code == 1  # lower than the current version: refused
    code, text = run_cli(*address, "watch", "--count", "1")
    assert code == 0 and "step 1" in text and "weight version 3" in text and "last control event: STATE" in text
    code, text = run_cli("--address", "127.0.0.1:1", "--timeout", "1", "health")
    assert code == 1 and ("UNAVAILABLE" in text or "DEADLINE_EXCEEDED" in text)
