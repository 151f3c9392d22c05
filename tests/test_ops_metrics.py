"""/metrics of a real server after a known workload: exact counters, gauges equal to GetState, histograms,
the standard gRPC server metrics, and the Grafana dashboard's metric names."""
from __future__ import annotations

import json
import re

import grpc
import pytest

from coda_client import ControlEventType, PacerClient, TrajectoryStatus, UnauthenticatedError, UnknownPromptError
from coda_client._proto import pacer_pb2 as pb
from ops_harness import MetricsServer, trajectory
from server_harness import REPO_ROOT

# B = 4 prompts per step, N = 2 trajectories per group, M = 2 (one group per fetch), stale_steps 0.5:
# window C = int(4 * 1.5) = 6.
CONFIG = ("fully_async.sliding_window=no-window", "fully_async.stale_steps=0.5", "data_source.num_prompts_per_step=4",
          "data_source.num_trajectories_per_prompt=2", "trainer.mini_batch_size=2", "rollout.filter=[status]")
DASHBOARD = REPO_ROOT / "deploy" / "prometheus" / "grafana-dashboard.json"


@pytest.fixture(scope="module")
def after_workload(tmp_path_factory):
    """Runs the workload once; yields (GetState after it, the scrape after that, the server)."""
    with MetricsServer(tmp_path_factory.mktemp("metrics"), *CONFIG) as server:
        with PacerClient(server.address) as pacer:
            admitted = pacer.dispatch([f"p{i}" for i in range(8)]).admitted  # 6 of 8: the window is 6
            assert admitted == [f"p{i}" for i in range(6)]
            # Weight versions the trajectories started with; the trainer takes p0 and p1 at version 2.
            pacer.submit([trajectory("p0", 0, start=0), trajectory("p0", 1, start=1)])
            pacer.submit([trajectory("p1", 0, start=2), trajectory("p1", 1, start=2)])
            pacer.submit([trajectory("p2", 0), trajectory("p2", 1)])
            pacer.submit([trajectory("p3", 0), trajectory("p3", 1, status=TrajectoryStatus.FAILED)])  # filtered
            pacer.submit([trajectory("p4", 0), trajectory("p4", 1)])
            pacer.submit([trajectory("p5", 0)])  # p5 stays running: one of its two trajectories
            assert pacer.submit([trajectory("p0", 0, start=0), trajectory("p0", 1, start=1)]).duplicates == 2
            with pytest.raises(UnknownPromptError):
                pacer.submit([trajectory("never-dispatched", 0)])
            assert pacer.resume(weight_version=2).step == 1
            taken = [g.prompt_id for _ in range(2) for g in pacer.collect(1)]
            assert taken == ["p0", "p1"]
            with pytest.raises(grpc.RpcError) as bad:  # a raw stub: the client would refuse 0 itself
                server.stub().Collect(pb.CollectRequest(num_groups=0), timeout=10)
            assert bad.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            with pacer.watch() as stream:  # one server-streaming call, cancelled by the client
                assert next(stream).type == ControlEventType.STATE
            state = pacer.state()
        scrape = server.scrape_until(lambda s: s.value("grpc_server_handled_total", grpc_method="WatchControl",
                                                       grpc_code="CANCELLED") == 1)
        yield state, scrape, server


def test_pacer_counters_have_the_exact_values_the_workload_implies(after_workload):
    state, scrape, _ = after_workload
    expected = {
        "coda_pacer_dispatched_groups_total": 6,
        "coda_pacer_submitted_trajectories_total": 11,  # 5 groups of 2, and one trajectory of p5
        "coda_pacer_collected_groups_total": 4,  # p0, p1, p2, p4
        "coda_pacer_filtered_groups_total": 1,  # p3 held a FAILED trajectory
        "coda_pacer_consumed_groups_total": 2,
        "coda_pacer_duplicate_trajectories_total": 2,
        "coda_pacer_restored_groups_total": 0,
        "coda_pacer_dropped_groups_total": 0,
        "coda_pacer_stale_rejected_trajectories_total": 0,
        "coda_pacer_step_reports_total": 0,
    }
    assert {name: scrape.value(name) for name in expected} == expected
    assert (state.dispatched, state.submitted, state.collected, state.consumed) == (6, 11, 4, 2)


def test_pacer_gauges_equal_get_state(after_workload):
    state, scrape, _ = after_workload
    gauges = {
        "coda_pacer_running_groups": state.running,
        "coda_pacer_buffered_groups": state.buffered,
        "coda_pacer_queued_trajectories": state.queued_trajectories,
        "coda_pacer_capacity_groups": state.capacity,
        "coda_pacer_window_size_groups": state.window_size,
        "coda_pacer_paused": int(state.paused),
        "coda_pacer_step": state.step,
        "coda_pacer_weight_version": state.weight_version,
        "coda_pacer_generation": state.generation,
        "coda_pacer_waiting_calls": state.waiting_calls,
    }
    assert {name: scrape.value(name) for name in gauges} == gauges
    # And the values themselves: R = p5, Q = p2 + p4, capacity C - R - Q = 6 - 1 - 2.
    assert (state.running, state.buffered, state.queued_trajectories, state.capacity) == (1, 2, 1, 3)
    assert (state.step, state.weight_version, state.window_size) == (1, 2, 6)
    assert scrape.value("coda_pacer_info", strategy="no-window") == 1


def test_standard_grpc_server_metrics_count_every_call_by_code(after_workload):
    _, scrape, _ = after_workload
    handled = {
        ("Dispatch", "OK"): 1,
        ("Submit", "OK"): 7,
        ("Submit", "NOT_FOUND"): 1,
        ("Resume", "OK"): 1,
        ("Collect", "OK"): 2,
        ("Collect", "INVALID_ARGUMENT"): 1,
        ("GetState", "OK"): 1,
        ("Reset", "OK"): 0,  # pre-initialised at zero
        ("WatchControl", "CANCELLED"): 1,
    }
    assert {key: scrape.rpc(*key) for key in handled} == handled
    service = "coda.pacer.v1.RolloutPacer"
    assert scrape.value("grpc_server_started_total", grpc_method="Submit", grpc_service=service, grpc_type="unary") == 8
    assert scrape.value("grpc_server_started_total", grpc_method="WatchControl", grpc_type="server_stream") == 1
    assert scrape.value("grpc_server_handling_seconds_count", grpc_method="Submit") == 8
    assert scrape.value("grpc_server_handling_seconds_count", grpc_method="Collect") == 3
    assert 0 < scrape.value("grpc_server_handling_seconds_sum", grpc_method="Submit") < 8 * 5.0
    # Every observation falls in the last bucket; buckets are cumulative.
    assert scrape.value("grpc_server_handling_seconds_bucket", grpc_method="Submit", le="+Inf") == 8


def test_consumption_histograms_hold_dispatch_to_collect_latency_and_staleness(after_workload):
    _, scrape, _ = after_workload
    assert scrape.value("coda_pacer_dispatch_to_collect_seconds_count") == 2  # p0 and p1
    assert 0 < scrape.value("coda_pacer_dispatch_to_collect_seconds_sum") < 60
    # Taken at weight version 2: p0 started at 0 and 1, p1 at 2 and 2 -> staleness 2, 1, 0, 0.
    assert scrape.value("coda_pacer_staleness_versions_count") == 4
    assert scrape.value("coda_pacer_staleness_versions_sum") == 3
    buckets = {le: scrape.value("coda_pacer_staleness_versions_bucket", le=le) for le in ("0.0", "1.0", "2.0", "+Inf")}
    assert buckets == {"0.0": 2, "1.0": 3, "2.0": 4, "+Inf": 4}


def test_every_dashboard_panel_queries_metrics_the_server_exports(after_workload):
    _, scrape, _ = after_workload
    dashboard = json.loads(DASHBOARD.read_text())
    assert dashboard["title"] and dashboard["panels"]
    checked = set()
    for panel in dashboard["panels"]:
        if panel.get("type") == "row":
            continue
        exprs = [target["expr"] for target in panel.get("targets", [])]
        assert exprs, f"panel {panel.get('title')!r} has no query"
        for expr in exprs:
            names = set(re.findall(r"\b(?:coda_pacer|grpc_server)_[a-z_]+\b", expr))
            assert names, f"panel {panel['title']!r}: no metric in {expr!r}"
            missing = names - scrape.names
            assert not missing, f"panel {panel['title']!r} queries {sorted(missing)}, not in a real scrape"
            checked |= names
    # The dashboard shows the window, the consumption histograms, the step reports and the gRPC metrics.
    for name in ("coda_pacer_running_groups", "coda_pacer_buffered_groups", "coda_pacer_staleness_versions_bucket",
                 "coda_pacer_dispatch_to_collect_seconds_bucket", "coda_pacer_step_report_partial_ratio",
                 "grpc_server_handled_total", "grpc_server_handling_seconds_bucket"):
        assert name in checked, name


def test_metrics_listener_can_be_disabled_and_a_taken_port_stops_start_up(after_workload, tmp_path):
    _, _, running = after_workload
    with MetricsServer(tmp_path, "server.metrics_address=") as quiet:
        assert quiet.metrics_port is None
        with PacerClient(quiet.address) as pacer:
            assert pacer.state().step == 0
        assert "Prometheus" not in quiet.log()
    taken = MetricsServer(tmp_path, f"server.metrics_address=127.0.0.1:{running.metrics_port}")
    with pytest.raises(RuntimeError) as caught:
        taken.start()
    assert f"cannot serve metrics on 127.0.0.1:{running.metrics_port}" in str(caught.value)
    assert "start this one with server.metrics_address=127.0.0.1:0" in str(caught.value).lower()
    taken.close()


def test_calls_refused_by_authentication_are_counted_and_logged(tmp_path):
    """Refusals are built with the observing wrapper: an UNAUTHENTICATED answer is counted and logged too."""
    with MetricsServer(tmp_path, env={"CODA_TOKEN": "s3cret-token"}) as server:
        with PacerClient(server.address) as anonymous, pytest.raises(UnauthenticatedError):
            anonymous.state()
        with PacerClient(server.address, token="s3cret-token") as pacer:
            pacer.state()
        scrape = server.scrape()
        assert server.terminate() == 0  # writes the last batch of the access log
        log = server.log()
    assert (scrape.rpc("GetState", "UNAUTHENTICATED"), scrape.rpc("GetState", "OK")) == (1, 1)
    assert re.search(r"coda_server\.rpc: GetState UNAUTHENTICATED \d+\.\d{3}ms peer=", log), log
    assert "s3cret-token" not in log


def test_handling_histogram_buckets_are_cumulative_and_counted_per_code():
    """The standard metrics are plain numbers read at scrape time; the exposition must be what a Histogram gives."""
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from coda_server.observability import GrpcServerMetrics

    registry = CollectorRegistry()
    metrics = GrpcServerMetrics(registry)
    stats = metrics.method("unary", "svc", "M")
    for code, seconds in (("OK", 0.0004), ("OK", 0.0005), ("OK", 0.003), ("NOT_FOUND", 7.0), ("OK", 1e6)):
        stats.started += 1
        stats.observe(code, seconds)
    samples = {(sample.name, tuple(sorted(sample.labels.items()))): sample.value
               for family in text_string_to_metric_families(generate_latest(registry).decode())
               for sample in family.samples}

    def value(name: str, **extra: str) -> float:
        labels = {"grpc_type": "unary", "grpc_service": "svc", "grpc_method": "M", **extra}
        return samples[(name, tuple(sorted(labels.items())))]

    assert value("grpc_server_started_total") == 5
    assert value("grpc_server_handled_total", grpc_code="OK") == 4
    assert value("grpc_server_handled_total", grpc_code="NOT_FOUND") == 1
    # le is inclusive: 0.0005 falls in the first bucket; 1e6 only in +Inf.
    assert [value("grpc_server_handling_seconds_bucket", le=le) for le in ("0.0005", "0.001", "0.005", "5.0", "10.0",
                                                                           "600.0", "+Inf")] == [2, 2, 3, 3, 4, 4, 5]
    assert value("grpc_server_handling_seconds_count") == 5
    assert value("grpc_server_handling_seconds_sum") == pytest.approx(0.0004 + 0.0005 + 0.003 + 7.0 + 1e6)
