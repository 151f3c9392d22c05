"""Logs: one structured line per RPC (JSON or text by server.log_format), lifecycle lines once each, and the
validation of the operations keys."""
from __future__ import annotations

import json
import re

import grpc
import pytest

from coda_client import ControlEventType, PacerClient
from coda_client._proto import pacer_pb2 as pb
from coda_server.core import load_config
from coda_server.core.errors import ConfigError
from ops_harness import trajectory
from server_harness import REPO_ROOT, ServerProcess

CONFIG = ("fully_async.sliding_window=no-window", "fully_async.stale_steps=1.0", "data_source.num_prompts_per_step=2",
          "data_source.num_trajectories_per_prompt=1", "trainer.mini_batch_size=1")
PEER = re.compile(r"^ipv[46]:.+:\d+$")


def test_json_log_has_one_line_per_rpc_and_each_lifecycle_event_once(tmp_path):
    server = ServerProcess(tmp_path, *CONFIG, "server.log_format=json").start()
    try:
        with PacerClient(server.address) as pacer:
            pacer.dispatch(["p0"], request_id="dispatch-1")
            pacer.submit([trajectory("p0", 0)], request_id="submit-1")
            pacer.state()
            pacer.reset("wait", wait=1, request_id="reset-1")
            pacer.resume(weight_version=4, request_id="resume-1")
        with pytest.raises(grpc.RpcError):
            server.stub().Collect(pb.CollectRequest(num_groups=0), timeout=10)
        assert server.terminate() == 0
    finally:
        server.close()
    lines = [json.loads(line) for line in server.log().splitlines()]  # every line is one JSON object
    assert all({"ts", "level", "logger", "msg"} <= line.keys() for line in lines)
    rpcs = [line for line in lines if line.get("event") == "rpc"]
    assert [(r["method"], r["code"], r.get("request_id")) for r in rpcs] == [
        ("Dispatch", "OK", "dispatch-1"),
        ("Submit", "OK", "submit-1"),
        ("GetState", "OK", None),  # GetState carries no request_id: the key is left out
        ("Reset", "OK", "reset-1"),
        ("Resume", "OK", "resume-1"),
        ("Collect", "INVALID_ARGUMENT", None),  # the raw request's request_id is empty: left out too
    ]
    for r in rpcs:
        assert r["logger"] == "coda_server.rpc" and r["service"] == "coda.pacer.v1.RolloutPacer"
        assert isinstance(r["duration_ms"], float) and 0 <= r["duration_ms"] < 5000
        assert PEER.match(r["peer"]), r["peer"]
    events = [line["event"] for line in lines if line.get("event") not in (None, "rpc")]
    assert events == ["metrics", "recovered", "version", "event_loop", "start", "pause", "reset_finished", "resume",
                      "shutdown", "stopped"]
    loop = next(line for line in lines if line.get("event") == "event_loop")
    assert loop["loop"].split()[0] in ("uvloop", "asyncio")
    start = next(line for line in lines if line.get("event") == "start")
    assert (start["address"], start["strategy"], start["window"]) == (server.address, "no-window", 4)
    pause = next(line for line in lines if line.get("event") == "pause")
    assert (pause["mode"], pause["step"], pause["running"], pause["buffered"]) == ("wait", 0, 0, 1)
    resume = next(line for line in lines if line.get("event") == "resume")
    assert (resume["step"], resume["weight_version"], resume["generation"]) == (1, 4, 1)
    finished = next(line for line in lines if line.get("event") == "reset_finished")
    assert (finished["mode"], finished["step"], finished["generation"], finished["paused"]) == ("wait", 0, 1, True)


def lifecycle(log: str) -> dict[str, list[dict]]:
    """The JSON lines of a server log that carry an `event` other than `rpc`, by event."""
    by_event: dict[str, list[dict]] = {}
    for line in log.splitlines():
        entry = json.loads(line)
        if entry.get("event") not in (None, "rpc"):
            by_event.setdefault(entry["event"], []).append(entry)
    return by_event


def test_checkpoint_restore_reset_and_recovery_lines_carry_their_event_and_figures(tmp_path):
    """A log shipper selects these lines by their `event` (they had none but the Reset's pause and resume), and the
    end of a Reset says in one line what it did with the groups it found."""
    state_dir = f"server.state_dir={tmp_path / 'state'}"
    with ServerProcess(tmp_path, *CONFIG, "server.log_format=json", state_dir) as server, \
            PacerClient(server.address) as pacer:
        pacer.dispatch(["p0", "p1"])
        pacer.submit([trajectory("p0", 0)])  # p0 complete and buffered, p1 running
        taken = pacer.checkpoint()
        pacer.dispatch(["p2"])
        pacer.submit([trajectory("p2", 0)])
        pacer.restore(taken.blob, request_id="restore-1")  # discards p2 (buffered) and p1 (running); p0 back
        pacer.dispatch(["q0", "q1"])
        pacer.submit([trajectory("q0", 0)])  # q0 buffered, q1 still running: a Reset without waiting drops it
        first = pacer.reset("wait", wait=0, request_id="reset-1")
        again = pacer.reset("wait", wait=0, request_id="reset-1")  # a retry: the remembered answer, logged once
        assert first.dropped_prompt_ids == again.dropped_prompt_ids == ["q1"]
        assert server.terminate() == 0
        before = lifecycle(server.log())
    with ServerProcess(tmp_path, *CONFIG, "server.log_format=json", state_dir) as restarted:
        assert restarted.terminate() == 0
        after = lifecycle(restarted.log())

    [checkpoint] = before["checkpoint"]
    assert checkpoint["logger"] == "coda_server.checkpoints" and checkpoint["level"] == "INFO"
    assert {k: checkpoint[k] for k in ("step", "weight_version", "buffered", "kept", "in_flight")} == \
        {"step": 0, "weight_version": 0, "buffered": 1, "kept": 0, "in_flight": 1}
    [restore] = before["restore"]
    assert restore["logger"] == "coda_server.checkpoints" and restore["level"] == "WARNING"
    assert {k: restore[k] for k in ("step", "generation", "discarded_groups", "dropped_running", "reinstated_groups")} \
        == {"step": 0, "generation": 1, "discarded_groups": 3, "dropped_running": 1, "reinstated_groups": 1}
    assert sorted(restore["discarded_prompt_ids"]) == ["p0", "p1", "p2"]
    [finished] = before["reset_finished"]
    assert finished["logger"] == "coda_server" and finished["level"] == "INFO"
    assert {k: finished[k] for k in ("mode", "step", "weight_version", "generation", "restored", "kept", "dropped",
                                     "expired", "quarantined", "paused")} == \
        {"mode": "wait", "step": 0, "weight_version": 0, "generation": 2, "restored": 0, "kept": 0, "dropped": 1,
         "expired": 0, "quarantined": 0, "paused": True}
    assert isinstance(finished["pause_delay_seconds"], float) and finished["pause_delay_seconds"] >= 0
    assert "1 incomplete dropped" in finished["msg"] and "dispatch stays paused" in finished["msg"]
    # Both starts rebuilt their state from the directory; the second found what the first left.
    [fresh] = before["recovered"]
    assert (fresh["step"], fresh["generation"], fresh["running"], fresh["buffered"]) == (0, 0, 0, 0)
    [recovered] = after["recovered"]
    assert recovered["logger"] == "coda_server" and recovered["state_dir"] == str(tmp_path / "state")
    assert {k: recovered[k] for k in ("step", "weight_version", "generation", "running", "buffered", "leased",
                                      "paused")} == \
        {"step": 0, "weight_version": 0, "generation": 2, "running": 0, "buffered": 2, "leased": 0, "paused": True}
    assert isinstance(recovered["replayed_events"], int) and isinstance(recovered["seconds"], float)


def test_the_docs_list_every_event_value_the_server_logs():
    """docs/operations.md's table of `event` values against every `event=` / `"event": ...` in the server's code, both
    ways: a log shipper's filter is written from that table."""
    code = "\n".join(path.read_text() for path in (REPO_ROOT / "coda_server").rglob("*.py"))
    in_code = (set(re.findall(r"""event=["'](\w+)["']""", code))
               | set(re.findall(r"""["']event["']: ["'](\w+)["']""", code)))
    docs = (REPO_ROOT / "docs" / "operations.md").read_text()
    table = docs[docs.index("**Lifecycle lines**"):]
    table = table[:table.index("\n\n", table.index("| `event` |"))]
    documented = set(re.findall(r"^\| `(\w+)` \|", table, flags=re.MULTILINE)) - {"event"}
    assert {"rpc", "start", "stopped"} <= in_code  # the patterns find the known values
    assert in_code == documented, (sorted(in_code - documented), sorted(documented - in_code))


def test_text_log_has_a_readable_line_per_rpc(tmp_path):
    with ServerProcess(tmp_path, *CONFIG) as server, PacerClient(server.address) as pacer:
        pacer.dispatch(["p0"], request_id="abc")
        pacer.state()
        assert server.terminate() == 0  # the access log is written in batches; shutdown writes the last one
        log = server.log()
    assert re.search(r" INFO coda_server\.rpc: Dispatch OK \d+\.\d{3}ms request_id=abc peer=ipv[46]:\S+\n", log), log
    assert re.search(r" INFO coda_server\.rpc: GetState OK \d+\.\d{3}ms peer=ipv[46]:\S+\n", log), log
    assert "{" not in log.split("coda_server.rpc:", 1)[1].splitlines()[0]


def test_cancelled_watch_streams_are_logged_and_the_server_lives_on(tmp_path):
    """Regression: the peer of a call is read when it starts. Reading it from the context of a cancelled
    stream, once the call has ended, crashed the server (SIGSEGV) within a few dozen cancellations."""
    with ServerProcess(tmp_path, *CONFIG) as server, PacerClient(server.address, timeout=10) as pacer:
        for _ in range(100):
            with pacer.watch() as stream:
                assert next(stream).type == ControlEventType.STATE
            assert pacer.state().step == 0  # the server answers after every cancellation
        assert server.process.poll() is None
        assert server.terminate() == 0  # a clean exit; every cancellation has been handled by then
        log = server.log()
    assert log.count("coda_server.rpc: WatchControl CANCELLED") == 100


def test_rpc_lines_can_be_turned_off_keeping_the_lifecycle_lines(tmp_path):
    with ServerProcess(tmp_path, *CONFIG, "server.log_rpcs=false") as server, PacerClient(server.address) as pacer:
        pacer.reset("abort", resume=True, weight_version=1)
        assert server.terminate() == 0
    log = server.log()
    assert "coda_server.rpc" not in log
    for line in ("serving coda.pacer.v1.RolloutPacer", "paused dispatch for a Reset (mode abort)",
                 "resumed dispatch: step 1, weight version 1", "shutting down"):
        assert log.count(line) == 1, line


def test_a_restore_is_logged_once_as_a_restore_even_when_its_retry_is_answered_again(tmp_path):
    with ServerProcess(tmp_path, *CONFIG) as server, PacerClient(server.address) as pacer:
        taken = pacer.checkpoint()
        pacer.dispatch(["p0"])
        first = pacer.restore(taken.blob, request_id="restore-1")
        again = pacer.restore(taken.blob, request_id="restore-1")  # a retry: the remembered answer, nothing restored
        assert (again.step, again.generation) == (first.step, first.generation)
        assert pacer.state().restores == 1
        assert server.terminate() == 0
    log = server.log()
    assert log.count("restored the checkpoint of step 0") == 1, log
    assert "told the workers to abort what they generate for a Restore (mode abort)" in log, log
    assert "paused dispatch for a Reset" not in log, log


@pytest.mark.parametrize("override, problem", [
    ("server.log_rpcs=sometimes", "server.log_rpcs = 'sometimes': must be true or false"),
    ("server.log_format=xml", "server.log_format = 'xml': must be text or json"),
    ("server.metrics_address=9464", "server.metrics_address = 9464: must be host:port"),
    ("server.metrics_address=localhost:99999", "server.metrics_address = 'localhost:99999'"),
    ("server.metrics_address=:9464", "server.metrics_address = ':9464'"),
    # gRPC itself would listen on 34463 (99999 modulo 65536), on 443 without a port, and on 65531 for -5.
    ("server.address=127.0.0.1:99999", "server.address = '127.0.0.1:99999': must be host:port with a port in 0..65535"),
    ("server.address=localhost", "server.address = 'localhost': must be host:port"),
    ("server.address=127.0.0.1:-5", "server.address = '127.0.0.1:-5': must be host:port"),
    ("server.health_address=127.0.0.1:70000", "server.health_address = '127.0.0.1:70000': must be host:port"),
])
def test_invalid_operations_keys_stop_start_up_naming_the_key(override, problem):
    with pytest.raises(ConfigError) as caught:
        load_config(overrides=[override], load_plugins=False)
    assert problem in str(caught.value)


@pytest.mark.parametrize("value", ["''", "0.0.0.0:9464", "'[::1]:0'", "localhost:0"])
def test_valid_metrics_addresses_load(value):
    assert load_config(overrides=[f"server.metrics_address={value}"], load_plugins=False) is not None


@pytest.mark.parametrize("overrides, key, expected", [
    (["server.address=0.0.0.0:50051"], "address", "0.0.0.0:50051"),
    (["server.address='[::1]:0'"], "address", "[::1]:0"),
    (["server.address=localhost:65535"], "address", "localhost:65535"),
    (["server.health_address=0.0.0.0:8081"], "health_address", "0.0.0.0:8081"),
    (["server.address=''", "server.uds_path=/tmp/pacer.sock"], "address", ""),
])
def test_valid_listener_addresses_load(overrides, key, expected):
    assert load_config(overrides=overrides, load_plugins=False).server[key] == expected


def test_the_stop_and_recovered_lines_count_the_leased_groups_kept_too(tmp_path):
    """Groups leased to a trainer at shutdown are kept like buffered ones (a trainer may still acknowledge them after
    the restart): the last line says how many, beside the buffered, and so does the next start's `recovered` line
    (it counted running and buffered groups only: an operator saw 4 leased groups stopped and none come back)."""
    overrides = (*CONFIG, "server.log_format=json", f"server.state_dir={tmp_path / 'state'}")
    with ServerProcess(tmp_path, *overrides) as server, PacerClient(server.address) as pacer:
        pacer.dispatch(["p0", "p1"])
        pacer.submit([trajectory("p0", 0), trajectory("p1", 0)])
        server.stub().Collect(pb.CollectRequest(num_groups=1, lease_seconds=600), timeout=10)  # held at the stop
        assert server.terminate() == 0
        stopped = [json.loads(line) for line in server.log().splitlines() if '"stopped"' in line]
    with ServerProcess(tmp_path, *overrides) as server:  # the same state directory: its start counts them alike
        assert server.terminate() == 0
        recovered = [json.loads(line) for line in server.log().splitlines() if '"recovered"' in line]
    assert [(line["buffered"], line["leased"]) for line in stopped] == [(1, 1)]
    assert "1 buffered and 1 leased groups kept in the state directory" in stopped[0]["msg"]
    assert [(line["buffered"], line["leased"]) for line in recovered] == [(1, 1)], recovered
    assert "1 buffered and 1 leased groups" in recovered[0]["msg"], recovered[0]["msg"]


def test_a_restart_does_not_log_again_the_pauses_and_resumes_its_recovery_replays(tmp_path):
    overrides = (*CONFIG, f"server.state_dir={tmp_path / 'state'}")
    with ServerProcess(tmp_path, *overrides) as first, PacerClient(first.address) as pacer:
        pacer.reset("wait", wait=0)
        pacer.resume(1)
        pacer.reset("wait", wait=0)  # the last Reset's snapshot: the Resume after it is replayed at the restart
        pacer.resume(2)
        assert first.terminate() == 0
    with ServerProcess(tmp_path, *overrides) as second:
        with PacerClient(second.address) as pacer:
            assert (pacer.state().step, pacer.state().weight_version) == (2, 2)  # recovered
        assert second.terminate() == 0
        log = second.log()
    assert "recovered state from" in log, log
    assert "paused dispatch for a Reset" not in log and "resumed dispatch" not in log, log
