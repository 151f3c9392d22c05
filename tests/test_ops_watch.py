"""The `coda-client watch` live view and `state --json`, rendered against a live server (no TTY)."""
from __future__ import annotations

import io
import json
import threading
import time

import pytest

from coda_client import PacerClient
from coda_client import cli as client_cli
from ops_harness import MetricsServer, trajectory

# B = 4, N = 2, M = 2, stale_steps 0.5: window C = 6.
CONFIG = ("fully_async.sliding_window=no-window", "fully_async.stale_steps=0.5", "data_source.num_prompts_per_step=4",
          "data_source.num_trajectories_per_prompt=2", "trainer.mini_batch_size=2")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with MetricsServer(tmp_path_factory.mktemp("watch"), *CONFIG) as process, PacerClient(process.address) as pacer:
        pacer.dispatch(["a0", "a1"])
        pacer.submit([trajectory("a0", 0, 0, 1), trajectory("a0", 1)])
        pacer.collect(1)
        pacer.reset("abort", wait=0, resume=True, weight_version=3)  # a1 dropped; a report for step 0
        pacer.dispatch(["b0", "b1", "b2"])
        pacer.submit([trajectory("b0", 0, 3), trajectory("b0", 1, 3)])
        pacer.submit([trajectory("b1", 0, 3), trajectory("b1", 1, 3)])
        pacer.submit([trajectory("b2", 0, 3)])
        yield process


def run_cli(*argv: str) -> tuple[int, str]:
    out = io.StringIO()
    return client_cli.main(list(argv), out=out), out.getvalue()


def test_watch_draws_the_window_step_version_and_latest_report(server):
    code, text = run_cli("--address", server.address, "watch", "--count", "2", "--interval", "0.05")
    assert code == 0
    lines = text.splitlines()
    assert "\x1b[" not in text  # no screen clearing without a TTY
    assert sum(line.startswith("strategy no-window") for line in lines) == 2  # two frames
    first = lines[:lines.index("last control event: STATE") + 1]
    assert first[0] == "strategy no-window   step 1   weight version 3   generation 1   running"
    # R = b2 (one of two trajectories), Q = b0 + b1, C = 6: 6 - 1 - 2 = 3 admissible.
    assert first[1] == f"window [{'R' * 7}{'Q' * 13}{'.' * 20}] running 1 + buffered 2 of 6; dispatch would admit 3"
    assert first[2].startswith("totals dispatched 5  submitted 7  collected 3  consumed 1  filtered 0  restored 0  "
                               "dropped 1")
    assert first[3] == "queued trajectories 1   waiting long-polls 0"
    # Step 0 took a0 (t0 spanned 0 -> 1): partial_ratio 1/2, span 1; the Reset dropped a1.
    assert first[4].startswith("step 0 report: pipeline_buf_size 0  filter_drop 0  partial_ratio 0.500  "
                               "partial_span_max 1  restored 0 (0 traj)  dropped_incomplete 1 (0 traj)  pause_delay ")


def test_watch_redraws_on_pause_and_resume(tmp_path):
    server = MetricsServer(tmp_path, *CONFIG).start()
    out = io.StringIO()
    frames: list[int] = []

    def watch() -> None:
        frames.append(client_cli.main(["--address", server.address, "watch", "--count", "3", "--interval", "60"],
                                      out=out))

    thread = threading.Thread(target=watch)
    thread.start()
    # Wait until the watch stream is open (the server exports its watcher count), then pause and resume.
    server.scrape_until(lambda s: s.value("coda_pacer_watchers") == 1, timeout=30)
    # ... and until the first frame is drawn: it shows the state read when it is drawn, which must be
    # before the Reset.
    deadline = time.monotonic() + 30
    while "last control event: STATE" not in out.getvalue() and time.monotonic() < deadline:
        time.sleep(0.01)
    with PacerClient(server.address) as pacer:
        pacer.reset("wait", wait=5, resume=True, weight_version=5)
    thread.join(30)
    server.close()
    assert frames == [0]
    lines = out.getvalue().splitlines()
    notes = [line for line in lines if line.startswith("last control event")]
    assert notes == ["last control event: STATE", "last control event: PAUSE", "last control event: RESUME"]
    heads = [line for line in lines if line.startswith("strategy ")]
    assert heads[0].startswith("strategy no-window   step 0   weight version 0   generation 0")
    assert heads[-1].startswith("strategy no-window   step 1   weight version 5   generation 1   running")


def test_state_json_is_one_object_for_scripts(server):
    code, text = run_cli("--address", server.address, "state", "--json")
    assert code == 0 and text.count("\n") == 1
    state = json.loads(text)
    assert state["window_size"] == 6 and state["strategy"] == "no-window"
    assert {"running", "buffered", "capacity", "step", "weight_version", "paused", "waiting_calls"} <= state.keys()
    # a1 was dropped before any of its trajectories came: one group, no trajectories (LoongSage's unit).
    assert state["recent_reports"][0]["partial_dropped_incomplete_group_count"] == 1
    assert state["recent_reports"][0]["partial_dropped_incomplete_count"] == 0


def test_watch_ends_0_on_the_servers_shutdown_with_a_last_frame_saying_so(tmp_path):
    """A clean SIGTERM: the server announces SHUTDOWN and goes; the watch draws that frame from the state it saw last
    (the server cannot be asked any more) and ends 0, as documented, not 1 with "cannot reach the pacer"."""
    server = MetricsServer(tmp_path, *CONFIG).start()
    out = io.StringIO()
    codes: list[int] = []
    thread = threading.Thread(target=lambda: codes.append(
        client_cli.main(["--address", server.address, "watch", "--interval", "60"], out=out)))
    thread.start()
    try:
        deadline = time.monotonic() + 30
        while "last control event: STATE" not in out.getvalue() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert server.terminate() == 0
        thread.join(30)
    finally:
        server.close()
    assert codes == [0], out.getvalue()
    notes = [line for line in out.getvalue().splitlines() if line.startswith("last control event")]
    assert notes == ["last control event: STATE",
                     "last control event: SHUTDOWN (the server is shutting down; as it was last seen)"]


def test_state_shows_the_groups_leased_to_trainers_and_a_job_ended(tmp_path):
    with MetricsServer(tmp_path, *CONFIG) as server, PacerClient(server.address) as pacer:
        pacer.dispatch(["l0", "l1"])
        pacer.submit([trajectory("l0", 0), trajectory("l0", 1), trajectory("l1", 0), trajectory("l1", 1)])
        pacer.collect_result(2, lease=60.0)
        lines = run_cli("--address", server.address, "state")[1].splitlines()
        assert lines[1].endswith("; 2 leased to trainers, not yet acknowledged (outside the window)"), lines[1]
        pacer.end_job(wait=0)
        head = run_cli("--address", server.address, "state")[1].splitlines()[0]
        assert head.endswith("JOB ENDED (EndJob: dispatch closed for good)"), head
