"""ABORT means abort and gather (issue 23, item 1): without an explicit wait, an ABORT-mode Reset waits for the
workers' ABORTED partial trajectories (within server.abort_wait_seconds) and restores every running group."""
from __future__ import annotations

import threading

from coda_client import ControlEventType, PacerClient, ResetMode, Trajectory, TrajectoryStatus
from conftest import core_overrides
from server_harness import ServerProcess

GROUPS = [f"g{i}" for i in range(4)]


def aborting_worker(client: PacerClient, prompt_ids: list[str]) -> threading.Thread:
    """Submits the groups' partial trajectories as ABORTED once a PAUSE with ABORT arrives, as the worker kit
    does; returns once it follows the control stream."""
    stream = client.watch()
    watching = threading.Event()

    def run() -> None:
        with stream:
            for event in stream:
                watching.set()
                if event.type == ControlEventType.PAUSE and event.mode == ResetMode.ABORT:
                    client.submit([Trajectory(trajectory_id=f"{p}#{i}", prompt_id=p, status=TrajectoryStatus.ABORTED,
                                              token_ids=[1, 2, 3]) for p in prompt_ids for i in range(2)])
                    return

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    assert watching.wait(30), "the worker's control stream never delivered its first event"
    return thread


def test_abort_reset_without_a_wait_gathers_the_partial_trajectories(tmp_path):
    with ServerProcess(tmp_path, *core_overrides("no-window", B=4, stale=1.0, N=2, continue_restored=True)) as server:
        with PacerClient(server.address) as trainer, PacerClient(server.address) as worker:
            trainer.dispatch(GROUPS)
            thread = aborting_worker(worker, GROUPS)
            result = trainer.reset("abort")
            thread.join(30)
            assert sorted(result.kept_prompt_ids) == GROUPS and result.dropped_prompt_ids == []
            assert result.report.partial_restored_count == 8
            assert trainer.state().stale_rejected == 0


def test_an_explicit_zero_wait_still_drops_at_once(tmp_path):
    with ServerProcess(tmp_path, *core_overrides("no-window", B=4, stale=1.0, N=2, continue_restored=True)) as server:
        with PacerClient(server.address) as trainer:
            trainer.dispatch(GROUPS)
            result = trainer.reset("abort", wait=0)
            assert sorted(result.dropped_prompt_ids) == GROUPS and result.kept_prompt_ids == []


def test_the_abort_wait_is_bounded_by_its_setting(tmp_path):
    overrides = core_overrides("no-window", B=4, stale=1.0, N=2, continue_restored=True)
    with ServerProcess(tmp_path, *overrides, "server.abort_wait_seconds=0.5") as server:
        with PacerClient(server.address) as trainer:
            trainer.dispatch(GROUPS)
            trainer.submit([Trajectory(trajectory_id="g0#0", prompt_id="g0", status=TrajectoryStatus.ABORTED)])
            answer: dict = {}
            thread = threading.Thread(target=lambda: answer.update(result=trainer.reset("abort")), daemon=True)
            thread.start()
            thread.join(60)  # nobody submits the rest: the Reset ends after abort_wait_seconds, not max_wait_seconds
            assert not thread.is_alive()
            assert sorted(answer["result"].dropped_prompt_ids) == GROUPS
            assert answer["result"].report.pause_delay >= 0.5
