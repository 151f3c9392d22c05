"""An on-call engineer's findings on the server's observability: who holds what a Reset dropped and whether it hears
the PAUSE, when each worker was last heard (ListWorkers, `coda-client workers`), a Reset's line that agrees with the
expired total, the expired counter's HELP text, and the shipped Prometheus alert rules naming real metrics."""
from __future__ import annotations

import re
import shutil
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest
import yaml

from coda_client import PacerClient, Trajectory, TrajectoryStatus
from conftest import core_overrides
from server_harness import REPO_ROOT, ServerProcess, until
from test_reset_wait_report import run_cli, watching

ALERTS = REPO_ROOT / "deploy" / "prometheus" / "alerts.yaml"


def overrides(*extra: str, continue_restored: bool = True) -> list[str]:
    return core_overrides("no-window", B=4, stale=1.0, N=2, M=2, continue_restored=continue_restored, extra=extra)


def trajectory(prompt_id: str, index: int) -> Trajectory:
    return Trajectory(trajectory_id=f"{prompt_id}#{index}", prompt_id=prompt_id, status=TrajectoryStatus.COMPLETED,
                      token_ids=[1, 2])


def test_a_reset_that_drops_groups_names_their_holders_and_says_waiting_does_not_help_one_that_never_watches(
        tmp_path):
    """A raw client that dispatched and never opened WatchControl never hears the PAUSE: the warning names it, says
    it has no stream, and does not advise raising the wait; a watching holder is named with its stream."""
    with ServerProcess(tmp_path, *overrides("server.inflight_lease_seconds=0")) as server, \
            PacerClient(server.address, client_id="badworker") as bad, \
            PacerClient(server.address, client_id="w1") as good, PacerClient(server.address) as trainer:
        stream = good.watch()
        try:
            assert watching(stream).wait(30), "the watch stream never delivered its first event"
            assert bad.dispatch(["bad0", "bad1"]).admitted == ["bad0", "bad1"]
            assert good.dispatch(["g0"]).admitted == ["g0"]
            result = trainer.reset("abort", wait=1)
        finally:
            stream.cancel()
        assert sorted(result.dropped_prompt_ids) == ["bad0", "bad1", "g0"]
        line = until(lambda: next((l for l in server.log().splitlines() if "incomplete group(s)" in l), None),
                     "the Reset's warning")
    assert "the wait ended at its wait_seconds (1 s)" in line, line
    assert "held by badworker (2, no WatchControl stream open), w1 (1, watch stream open)" in line, line
    assert "badworker never heard the PAUSE" in line and "waiting longer would not help" in line, line
    assert "raise it to wait longer" not in line, line


def test_a_reset_whose_holders_all_watch_still_says_raise_the_wait(tmp_path):
    with ServerProcess(tmp_path, *overrides("server.inflight_lease_seconds=0")) as server, \
            PacerClient(server.address, client_id="w1") as good, PacerClient(server.address) as trainer:
        stream = good.watch()
        try:
            assert watching(stream).wait(30)
            assert good.dispatch(["g0"]).admitted == ["g0"]
            assert trainer.reset("abort", wait=1).dropped_prompt_ids == ["g0"]
        finally:
            stream.cancel()
        line = until(lambda: next((l for l in server.log().splitlines() if "incomplete group(s)" in l), None),
                     "the Reset's warning")
    assert "held by w1 (1, watch stream open); raise it to wait longer" in line, line


WORKER = """
import sys, time
from coda_client import PacerClient
with PacerClient(sys.argv[1], client_id="w0") as pacer:
    stream = pacer.watch()
    next(iter(stream))
    assert pacer.dispatch(["p0", "p1"]).admitted == ["p0", "p1"]
    print("ready", flush=True)
    time.sleep(600)
"""


def test_list_workers_says_when_a_killed_worker_was_last_heard_and_that_its_watch_stream_closed(tmp_path):
    """kill -9 of a watching worker: until its liveness grace releases its groups, ListWorkers (and `coda-client
    workers`) say how long ago it was last heard and that it holds no watch stream any more."""
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    with ServerProcess(tmp_path, *overrides("server.worker_liveness_seconds=600")) as server, \
            PacerClient(server.address) as pacer:
        worker = subprocess.Popen([sys.executable, str(script), server.address], stdout=subprocess.PIPE, text=True)
        try:
            assert worker.stdout.readline().strip() == "ready"
            alive = {w.client_id: w for w in pacer.list_workers()}["w0"]
            assert alive.watch_streams == 1 and alive.last_heard_seconds is not None, alive
            code, text = run_cli(server.address, "workers")
            assert code == 0 and "w0: 2 running" in text and "1 watch stream open" in text, text
            worker.kill()
            worker.wait(30)
            gone = until(lambda: next((w for w in pacer.list_workers() if w.client_id == "w0"
                                       and w.watch_streams == 0), None), "the worker's stream to close")
        finally:
            if worker.poll() is None:
                worker.kill()
                worker.wait(30)
        assert gone.running == 2 and gone.last_heard_seconds is not None and gone.last_heard_seconds >= 0, gone
        code, text = run_cli(server.address, "workers")
    assert code == 0, text
    assert re.search(r"w0: 2 running, oldest held [0-9.]+s, last heard \d+ s ago, no watch stream", text), text


def test_a_reset_line_counts_the_groups_released_from_a_silent_worker_as_the_expired_total_does(tmp_path):
    """continue_restored: the dead worker's groups released by its liveness grace during the Reset's wait are kept;
    the Reset's line says they expired this step, as the expired total counts them."""
    liveness = ("server.inflight_lease_seconds=0", "server.worker_liveness_seconds=2")
    with ServerProcess(tmp_path, *overrides(*liveness)) as server, \
            PacerClient(server.address, client_id="w0") as dead, PacerClient(server.address) as trainer:
        stream = dead.watch()
        try:
            assert watching(stream).wait(30)
            assert dead.dispatch(["a", "b"]).admitted == ["a", "b"]
            dead.submit([trajectory("a", 0)])
            result = trainer.reset("abort", wait=120)
        finally:
            stream.cancel()
        assert sorted(result.kept_prompt_ids) == ["a", "b"] and result.expired == [], result
        assert trainer.state().expired == 2
        line = until(lambda: next((l for l in server.log().splitlines() if "Reset finished" in l), None),
                     "the Reset's line")
    assert "2 kept for continuation (2 of them expired this step: worker silent or in-flight lease run out)" in line, \
        line
    assert "0 expired and handed back" in line, line


def scrape(server: ServerProcess) -> str:
    port = server.info["metrics_port"]
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as response:
        return response.read().decode()


def test_the_expired_counter_help_names_the_liveness_release_too(tmp_path):
    with ServerProcess(tmp_path, *overrides()) as server:
        text = scrape(server)
    help_line = next(l for l in text.splitlines() if l.startswith("# HELP coda_pacer_expired_groups_total"))
    assert "in-flight lease ran out" in help_line and "server.worker_liveness_seconds" in help_line, help_line


def test_the_shipped_alert_rules_name_only_metrics_a_real_server_exports(tmp_path):
    rules = yaml.safe_load(ALERTS.read_text())
    alerts = [rule for group in rules["groups"] for rule in group["rules"]]
    assert {"alert", "expr", "labels", "annotations"} <= set(alerts[0]), alerts[0]
    with ServerProcess(tmp_path, *overrides()) as server:
        exported = {l.split()[2] for l in scrape(server).splitlines() if l.startswith("# TYPE ")}
    exported |= {f"{name}_{suffix}" for name in exported for suffix in ("total", "bucket", "sum", "count", "created")}
    for rule in alerts:
        assert rule["annotations"].get("summary") and rule["annotations"].get("runbook"), rule
        named = set(re.findall(r"\b(coda_[a-z_]+)", rule["expr"]))
        assert named, rule
        assert named <= exported, (rule["alert"], named - exported)
    names = {rule["alert"] for rule in alerts}
    assert len(names) == len(alerts) and len(alerts) >= 7, names


def test_every_alert_links_a_runbook_section_that_exists():
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces as hyphens. A link to an anchor the
    runbook does not have lands an on-call engineer at the top of the page."""
    runbook = (REPO_ROOT / "docs" / "runbook.md").read_text()
    anchors = {re.sub(r"[^a-z0-9 -]", "", line.lstrip("#").strip().lower()).replace(" ", "-")
               for line in runbook.splitlines() if line.startswith("#")}
    rules = yaml.safe_load(ALERTS.read_text())
    for rule in (rule for group in rules["groups"] for rule in group["rules"]):
        page, _, anchor = rule["annotations"]["runbook"].partition("#")
        assert page == "docs/runbook.md" and anchor in anchors, (rule["alert"], anchor, sorted(anchors))


def test_promtool_accepts_the_alert_rules_when_it_is_installed():
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool is not installed (apt-get install prometheus)")
    checked = subprocess.run([promtool, "check", "rules", str(ALERTS)], capture_output=True, text=True, timeout=60)
    assert checked.returncode == 0 and "SUCCESS" in checked.stdout, checked.stdout + checked.stderr


def test_the_window_line_says_why_groups_a_trainer_gave_back_fill_the_window_past_its_size(tmp_path):
    """Leased groups are outside the window, so a worker fills it again meanwhile; a trainer that gives its lease
    back (Release, or a lease that ran out) puts them in the buffer again on top: `buffered 8 of 4` alone reads as a
    broken counter. The line says by how much the window is over and why, and that dispatch waits for it."""
    from coda_client.cli import render_state

    with ServerProcess(tmp_path, *core_overrides("windowed-fifo", B=4, stale=0.0, N=1, M=1)) as server, \
            PacerClient(server.address) as client:
        def fill(tag: str) -> None:
            admitted = client.dispatch([f"{tag}{n}" for n in range(client.state().capacity)]).admitted
            assert admitted, "nothing admitted: the window did not free"
            client.submit([trajectory(p, 0) for p in admitted])

        fill("first-")
        leased = client.collect_result(client.state().buffered, lease=600.0)
        fill("second-")
        assert client.release(leased.lease_id) == len(leased.groups)
        state = client.state()
        assert state.running + state.buffered > state.window_size
        window_line = render_state(state).splitlines()[1]
    over = state.running + state.buffered - state.window_size
    assert f"over the window by {over}" in window_line, window_line
    assert "given back" in window_line, window_line


def test_workers_against_an_older_server_says_contact_is_not_reported_not_that_a_live_worker_is_dead():
    """A server from before ListWorkers reported contact (fields 8 and 9 of WorkerHoldings) sends neither: the
    CLI read that as `never heard, no watch stream` for a live worker, which the runbook reads as dead or deaf. The
    bytes here are what such a server sends; the same worker from this server still reads as before."""
    from coda_client._proto import pacer_pb2 as pb
    from coda_client.cli import render_workers
    from coda_client.types import WorkerHoldings

    older = pb.WorkerHoldings(client_id="kit-1", running=6, oldest_held_seconds=2.5,
                              groups=[pb.HeldGroup(prompt_id="p0", seq=1, trajectories=1, group_size=4)])
    line = render_workers([WorkerHoldings.from_pb(pb.WorkerHoldings.FromString(older.SerializeToString()))])
    assert "not reported by this server" in line and "never heard" not in line and "no watch stream" not in line, line
    current = pb.WorkerHoldings()
    current.CopyFrom(older)
    current.watch_streams = 0  # this server always sets it: here a worker it never heard, without a stream
    line = render_workers([WorkerHoldings.from_pb(pb.WorkerHoldings.FromString(current.SerializeToString()))])
    assert "never heard, no watch stream" in line, line
