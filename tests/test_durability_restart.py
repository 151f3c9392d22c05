"""Durable state across restarts: the state-directory lock, an exact clean restart, request_id answers kept."""
from __future__ import annotations

import dataclasses
import hashlib
import sqlite3
import subprocess
import sys

import pytest

from coda_client import PacerClient, PromptRef, Trajectory, TrajectoryStatus
from crash_workload import FAST_RECONNECT, fingerprint
from server_harness import REPO_ROOT, ServerProcess
from test_durability_crash import B, N, check_invariant, durable_overrides, free_port


def trajectory(prompt_id: str, j: int, weight_version: int = 0) -> Trajectory:
    digest = hashlib.sha256(f"{prompt_id}/{j}".encode()).digest()
    return Trajectory(trajectory_id=f"{prompt_id}/t{j}", prompt_id=prompt_id, status=TrajectoryStatus.COMPLETED,
                      reward=float(digest[0] % 3), token_ids=list(digest[:12]),
                      logprobs=[-x / 256 for x in digest[:12]],
                      loss_mask=[1] * 12, start_weight_version=weight_version, end_weight_version=weight_version,
                      metadata={"j": str(j)}, payload=digest * 3)


def group(prompt_id: str, weight_version: int = 0) -> list[Trajectory]:
    return [trajectory(prompt_id, j, weight_version) for j in range(N)]


def comparable(state, timings: bool = True) -> dict:
    """Every GetState field except the live count of waiting long-polls (and, unless `timings`, measured pauses)."""
    values = dataclasses.asdict(state)
    values.pop("waiting_calls")
    if not timings:  # another server's Resets paused for other fractions of a second
        for report in values["recent_reports"]:
            report.pop("pause_delay")
    return values


def delivered(groups) -> list[tuple[str, list[str]]]:
    """Groups as (prompt id, fingerprints of their trajectories), in the order given."""
    return [(g.prompt_id, [fingerprint(t) for t in g.trajectories]) for g in groups]


class Restartable:
    """A durable server on a fixed port; `restart(kill=...)` stops it (SIGKILL or SIGTERM) and starts it again."""

    def __init__(self, tmp_path, name: str, *extra: str):
        self.tmp_path = tmp_path
        self.state_dir = tmp_path / name
        self.overrides = durable_overrides(self.state_dir, free_port(), *extra)
        self.server = ServerProcess(tmp_path, *self.overrides).start()
        self.client = PacerClient(self.server.address, timeout=10, options=FAST_RECONNECT)

    def restart(self, kill: bool) -> None:
        if kill:
            self.server.kill()
        else:
            assert self.server.terminate() == 0, self.server.log()
        self.server.close()
        self.server = ServerProcess(self.tmp_path, *self.overrides).start()

    def close(self) -> None:
        self.client.close()
        self.server.close()


@pytest.fixture
def durable(tmp_path):
    made = []

    def make(*extra: str) -> Restartable:
        made.append(Restartable(tmp_path, f"state-{len(made)}", *extra))
        return made[-1]

    yield make
    for server in made:
        server.close()


def test_a_second_server_on_the_same_state_dir_refuses_to_start(durable):
    first = durable()
    first.client.dispatch(["p0"], request_id="d-0")
    command = [sys.executable, "-m", "coda_server", "server.address=127.0.0.1:0", "server.metrics_address=",
               f"server.state_dir={first.state_dir}"]
    second = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True, timeout=60)
    output = second.stdout + second.stderr
    assert second.returncode == 1, output
    assert "Traceback" not in output, output
    lines = [line for line in output.splitlines() if line.strip()]
    assert len(lines) == 1, output  # one clear line, naming the directory and the holder
    assert "in use by another coda-server" in lines[0] and str(first.state_dir) in lines[0], output
    assert f"pid {first.server.process.pid}" in lines[0], output
    # The first server is untouched and still serving its state.
    assert first.client.state().dispatched == 1
    # Once it has stopped (even by SIGKILL, which releases the lock with the process), the directory is free.
    first.restart(kill=True)
    assert first.client.state().dispatched == 1


@pytest.mark.parametrize("make_path", [
    lambda tmp: tmp / "a-file",  # exists and is a file
    lambda tmp: tmp / "a-file" / "below",  # cannot be created: its parent is a file
])
def test_an_unusable_state_dir_is_one_clear_line_and_exit_1(tmp_path, make_path):
    (tmp_path / "a-file").write_text("not a directory")
    state_dir = make_path(tmp_path)
    command = [sys.executable, "-m", "coda_server", "server.address=127.0.0.1:0", "server.metrics_address=",
               f"server.state_dir={state_dir}"]
    run = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True, timeout=60)
    output = run.stdout + run.stderr
    assert run.returncode == 1 and "Traceback" not in output, output
    lines = [line for line in output.splitlines() if line.strip()]
    assert len(lines) == 1 and f"server.state_dir '{state_dir}' cannot be used" in lines[0], output


def start_with(state_dir, *overrides: str) -> subprocess.CompletedProcess:
    """Run coda-server on `state_dir` until it exits by itself (these tests expect it to refuse to start)."""
    command = [sys.executable, "-m", "coda_server", "server.address=127.0.0.1:0", "server.metrics_address=",
               f"server.state_dir={state_dir}", *overrides]
    return subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("recorded", [True, False], ids=["settings recorded", "state from before they were"])
def test_a_state_made_under_other_pacing_settings_is_refused_in_one_line_and_kept(durable, recorded):
    first = durable()
    first.client.dispatch([f"p{i}" for i in range(B)], request_id="d-0")  # fills the window of B * (1 + 1)
    first.client.dispatch([f"q{i}" for i in range(B)], request_id="d-1")
    first.client.submit(group("p0"), request_id="s-0")
    before = comparable(first.client.state())
    assert first.server.terminate() == 0
    if not recorded:  # drop the snapshot that records the settings, as a state directory of an older server
        with sqlite3.connect(first.state_dir / "pacer.sqlite3") as db:
            db.execute("DELETE FROM snapshot")
    changed = [o for o in first.overrides if not o.startswith(("data_source.num_prompts_per_step", "server."))]
    run = start_with(first.state_dir, *changed, f"data_source.num_prompts_per_step={B // 2}")
    output = run.stdout + run.stderr
    assert run.returncode == 1 and "Traceback" not in output, output
    lines = [line for line in output.splitlines() if line.strip()]
    assert len(lines) == 1 and str(first.state_dir) in lines[0], output
    if recorded:
        assert f"num_prompts_per_step '{B}' -> '{B // 2}'" in lines[0], output
    else:
        assert "replaying event" in lines[0] and "pacing configuration changed" in lines[0], output
    assert "move server.state_dir aside" in lines[0], output
    first.restart(kill=False)  # with its own settings, the state is all there
    assert comparable(first.client.state()) == before


def test_pacing_settings_may_change_at_a_restart_after_a_reset(durable):
    first = durable()
    first.client.dispatch(["p0", "p1"], request_id="d-0")
    first.client.submit(group("p0"), request_id="s-0")
    first.client.reset("abort", wait=0, resume=True, weight_version=1)  # the snapshot: nothing left to replay
    assert first.server.terminate() == 0
    changed = [o for o in first.overrides if not o.startswith("data_source.num_prompts_per_step")]
    second = ServerProcess(first.tmp_path, *changed, f"data_source.num_prompts_per_step={B // 2}").start()
    try:
        with PacerClient(second.address, timeout=10) as pacer:
            state = pacer.state()
            assert (state.window_size, state.buffered, state.step) == (B // 2 * 2, 1, 1)
            pacer.dispatch(["q0"], request_id="d-1")  # an event under the new settings...
        second.kill()
    finally:
        second.close()
    # ...replays under the new settings, which were recorded at start-up.
    restarted = ServerProcess(first.tmp_path, *changed, f"data_source.num_prompts_per_step={B // 2}").start()
    try:
        with PacerClient(restarted.address, timeout=10) as pacer:
            assert pacer.state().running == 1
    finally:
        restarted.close()


def build_state(pacer: PacerClient) -> list:
    """Step 0 consumed and reset; then prompts of step 1 with scrambled priorities, some complete, one partial,
    one complete but held by the windowed-fifo gate, some running with nothing yet. Returns the Collect answers."""
    answers = []
    pacer.dispatch([PromptRef(f"a{i}", epoch=0, index=i) for i in range(4)], request_id="d-a")
    for i in range(4):
        pacer.submit(group(f"a{i}"), request_id=f"s-a{i}")
    answers.append(pacer.collect(2, request_id="c-1"))
    pacer.reset("abort", resume=True, weight_version=7, request_id="r-1")  # a2, a3 stay buffered
    # Window C = 8 minus the 2 buffered: 6 admitted, their priorities (epoch, index) out of dispatch order.
    order = [5, 1, 4, 0, 3, 2]
    admitted = pacer.dispatch([PromptRef(f"b{k}", epoch=1, index=order[k]) for k in range(6)], request_id="d-b")
    assert admitted.admitted == [f"b{k}" for k in range(6)]
    for k in (1, 2, 3):
        pacer.submit(group(f"b{k}", 7), request_id=f"s-b{k}")
    pacer.submit(group("b0", 7)[:1], request_id="s-b0-part")  # b0 (the oldest in flight) stays incomplete...
    pacer.submit(group("b5", 7), request_id="s-b5")  # ...so windowed-fifo holds b5 (4 seqs past b0), complete
    answers.append(pacer.collect(1, request_id="c-2"))
    return answers


def finish(pacer: PacerClient) -> list:
    """What happens after the (possible) restart: complete b0, b4; take everything. Returns the groups in order."""
    pacer.submit(group("b0", 7)[1:], request_id="s-b0-rest")
    pacer.submit(group("b4", 7), request_id="s-b4")
    groups = []
    while True:
        got = pacer.collect(1, wait=0, allow_partial=True)
        if not got:
            return groups
        groups.extend(got)


@pytest.mark.parametrize("stop", ["SIGTERM", "SIGKILL"])
def test_restart_restores_step_generation_buffer_order_and_counters_exactly(durable, stop):
    restarted = durable()
    twin = durable()  # the same calls, never restarted
    assert delivered(sum(build_state(restarted.client), [])) == delivered(sum(build_state(twin.client), []))
    before = restarted.client.state()
    assert (before.step, before.weight_version, before.generation) == (1, 7, 1)
    # running: b0 (1 of N trajectories), b4 (none), b5 (complete, held); buffered: a3 b3 b1 b2 (a2 was taken)
    assert before.running == 3 and before.buffered == 4 and before.queued_trajectories == N + 1, before
    check_invariant(before)

    restarted.restart(kill=stop == "SIGKILL")
    after = restarted.client.state()
    assert comparable(after) == comparable(before)
    assert comparable(after, timings=False) == comparable(twin.client.state(), timings=False)

    # The recovered server goes on exactly like the one that never stopped: same groups, same order, same bytes.
    expected = finish(twin.client)
    got = finish(restarted.client)
    assert [prompt for prompt, _ in delivered(got)] == [prompt for prompt, _ in delivered(expected)]
    assert delivered(got) == delivered(expected)
    # Buffer order is (epoch, index): a3 (epoch 0), then b3 b1 b5 b4 b2 b0 (indexes 0..5); b5 left the
    # gate once b0 completed, b0 and b4 completed after the restart.
    assert [g.prompt_id for g in got] == ["a3", "b3", "b1", "b5", "b4", "b2", "b0"]
    final = restarted.client.state()
    assert comparable(final, timings=False) == comparable(twin.client.state(), timings=False)
    check_invariant(final)


@pytest.mark.parametrize("stop", ["SIGKILL", "SIGTERM"])
def test_request_id_answers_survive_a_restart(durable, stop):
    server = durable()
    pacer = server.client
    first = {
        "dispatch": pacer.dispatch(["p0", "p1", "p2"], request_id="d-1"),
        "submit": pacer.submit(group("p0"), request_id="s-1"),
    }
    pacer.submit(group("p1"), request_id="s-2")
    first["collect"] = pacer.collect_result(2, request_id="c-1")
    first["reset"] = pacer.reset("abort", wait=0, resume=True, weight_version=3, request_id="r-1")
    first["resume"] = pacer.reset("abort", wait=0, resume=True, weight_version=4, request_id="r-2")
    assert first["collect"].groups and first["reset"].dropped_prompt_ids == ["p2"]
    before = pacer.state()

    server.restart(kill=stop == "SIGKILL")
    # Each retry (same request_id, same arguments) gets the first answer and changes nothing.
    assert pacer.dispatch(["p0", "p1", "p2"], request_id="d-1") == first["dispatch"]
    assert pacer.submit(group("p0"), request_id="s-1") == first["submit"]  # accepted again, not "duplicates"
    retried = pacer.collect_result(2, request_id="c-1")
    assert delivered(retried.groups) == delivered(first["collect"].groups) and retried == first["collect"]
    assert pacer.reset("abort", wait=0, resume=True, weight_version=3, request_id="r-1") == first["reset"]
    assert pacer.reset("abort", wait=0, resume=True, weight_version=4, request_id="r-2") == first["resume"]
    assert comparable(pacer.state()) == comparable(before)
    # A new request_id is a new call.
    assert pacer.dispatch(["p0"], request_id="d-2").admitted == ["p0"]


def test_a_snapshot_in_another_format_is_refused_in_one_line_and_kept(durable):
    from coda_server.convert import ProtoTrajectories
    from coda_server.core.journal import dumps, loads

    first = durable()
    first.client.dispatch(["p0", "p1"], request_id="d-0")
    first.client.reset("abort", wait=0, resume=True, weight_version=1)  # writes a snapshot
    first.client.dispatch(["q0"], request_id="d-1")
    assert first.server.terminate() == 0
    database = first.state_dir / "pacer.sqlite3"
    with sqlite3.connect(database) as db:  # as an older version would have written it
        snapshot = loads(db.execute("SELECT body FROM snapshot").fetchone()[0], ProtoTrajectories())
        snapshot["format"] = 1
        db.execute("UPDATE snapshot SET body = ?", (dumps(snapshot, ProtoTrajectories()),))
    kept = database.read_bytes()
    run = start_with(first.state_dir, *[o for o in first.overrides if not o.startswith("server.")])
    output = run.stdout + run.stderr
    assert run.returncode == 1 and "Traceback" not in output, output
    lines = [line for line in output.splitlines() if line.strip()]
    assert len(lines) == 1 and str(first.state_dir) in lines[0], output
    assert "format 1, written by another version" in lines[0] and "move server.state_dir aside" in lines[0], output
    assert database.read_bytes() == kept


def test_a_server_started_without_settings_keeps_its_state_in_coda_state_beside_it(tmp_path):
    """Durable by default: the built-in state_dir is ./coda-state where the server starts; kill -9 loses nothing."""
    workdir = tmp_path / "job"
    workdir.mkdir()
    overrides = [o for o in durable_overrides(tmp_path / "unused", free_port()) if not o.startswith("server.state_dir")]
    server = ServerProcess(tmp_path, *overrides, cwd=workdir).start()
    try:
        with PacerClient(server.address, timeout=10, options=FAST_RECONNECT) as client:
            client.dispatch(["p0", "p1"], request_id="d-0")
            client.submit(group("p0"), request_id="s-0")
        assert f"state in {workdir / 'coda-state'}" in server.log(), server.log()
        server.kill()
        server.close()
        server = ServerProcess(tmp_path, *overrides, cwd=workdir).start()
        with PacerClient(server.address, timeout=10, options=FAST_RECONNECT) as client:
            state = client.state()
        assert (state.running, state.buffered, state.submitted) == (1, 1, N), state
        assert (workdir / "coda-state" / "pacer.sqlite3").exists()
    finally:
        server.close()


def test_memory_only_is_an_explicit_choice_said_in_the_start_up_line(tmp_path):
    workdir = tmp_path / "job"
    workdir.mkdir()
    with ServerProcess(tmp_path, "server.state_dir=", cwd=workdir) as server:
        log = server.log()
    assert 'state in memory only (server.state_dir is "")' in log, log
    assert not (workdir / "coda-state").exists()


def test_a_reset_waiting_when_the_server_shuts_down_is_abandoned_not_finished(durable):
    """A graceful restart in the middle of a WAIT Reset drops nothing: the Reset is abandoned (the trainer
    retries it on the next server) instead of finishing with the running groups dropped."""
    import threading
    import time

    import grpc

    from coda_client._proto import pacer_pb2 as pb

    server = durable()
    server.client.dispatch(["p0"], request_id="d-0")
    server.client.submit(group("p0")[:1], request_id="s-0")  # half assembled: the Reset waits for it
    stub = server.server.stub()
    outcome: list = []

    def reset() -> None:
        try:
            outcome.append(stub.Reset(pb.ResetRequest(mode=pb.RESET_MODE_WAIT, request_id="r-1"), timeout=60))
        except grpc.RpcError as error:
            outcome.append(error.code())

    caller = threading.Thread(target=reset)
    caller.start()
    deadline = time.monotonic() + 30
    while not server.client.state().resetting:
        assert time.monotonic() < deadline, "the Reset did not start waiting"
        time.sleep(0.05)
    server.restart(kill=False)
    caller.join(30)
    assert outcome == [grpc.StatusCode.UNAVAILABLE], outcome
    state = server.client.state()
    assert (state.generation, state.running, state.dropped, state.resetting) == (0, 1, 0, False), state
