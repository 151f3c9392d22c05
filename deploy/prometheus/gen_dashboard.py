"""Generates grafana-dashboard.json (the panels are easier to read and edit here than in the JSON).

    python deploy/prometheus/gen_dashboard.py      # rewrites grafana-dashboard.json next to this file

tests/test_ops_docs.py fails when the JSON differs from what this script generates, and tests/test_ops_metrics.py
checks that every metric a panel queries exists in a real scrape.
"""
from __future__ import annotations

import json
from pathlib import Path

OUTPUT = Path(__file__).resolve().with_name("grafana-dashboard.json")
SEL = 'instance=~"$instance"'  # every query follows the dashboard's instance selector
R = "$__rate_interval"
SVC = 'grpc_service="coda.pacer.v1.RolloutPacer"'
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
# The long-polls whose handling time is waiting: the trainer's (Collect, and CollectStream, which batches() uses),
# the workers' Dispatch, the step boundary's Reset.
WAITING_METHODS = "Collect|CollectStream|Dispatch|Reset"
WIDTH = 24  # Grafana's grid width


class Layout:
    """Places panels left to right in rows of the 24-column grid; `row` starts a titled section."""

    def __init__(self) -> None:
        self.panels: list[dict] = []
        self.x = self.y = self.height = 0

    def _next_id(self) -> int:
        return len(self.panels) + 1

    def _new_line(self) -> None:
        self.x, self.y, self.height = 0, self.y + self.height, 0

    def row(self, title: str) -> None:
        if self.x:
            self._new_line()
        self.panels.append({"id": self._next_id(), "type": "row", "title": title, "collapsed": False,
                            "gridPos": {"h": 1, "w": WIDTH, "x": 0, "y": self.y}, "panels": []})
        self.y += 1

    def panel(self, title: str, description: str, targets: list[tuple[str, str]], *, kind: str = "timeseries",
              w: int = 12, h: int = 8, unit: str = "short", options: dict | None = None) -> None:
        if self.x + w > WIDTH:
            self._new_line()
        if options is None:
            options = {"legend": {"displayMode": "list", "placement": "bottom"}} if kind == "timeseries" else {}
        self.panels.append({
            "id": self._next_id(), "type": kind, "title": title, "description": description,
            "datasource": DATASOURCE, "gridPos": {"h": h, "w": w, "x": self.x, "y": self.y},
            "targets": [{"refId": chr(ord("A") + i), "expr": expr, "legendFormat": legend, "datasource": DATASOURCE}
                        for i, (expr, legend) in enumerate(targets)],
            "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
            "options": options,
        })
        self.x += w
        self.height = max(self.height, h)


layout = Layout()
row, panel = layout.row, layout.panel

row("Window")
panel("Window: running, buffered, admissible", "R (running) + Q (buffered) never exceed the window C. "
      "Buffered near C and admissible 0: the trainer is the bottleneck. Buffered near 0: generation is.",
      [(f"coda_pacer_running_groups{{{SEL}}}", "running R {{instance}}"),
       (f"coda_pacer_buffered_groups{{{SEL}}}", "buffered Q {{instance}}"),
       (f"coda_pacer_capacity_groups{{{SEL}}}", "Dispatch would admit {{instance}}"),
       (f"coda_pacer_window_size_groups{{{SEL}}}", "window C {{instance}}")])
panel("Step, weight version, paused", "Resume increments the step and sets the weight version; paused is 1 during a Reset.",
      [(f"coda_pacer_step{{{SEL}}}", "step {{instance}}"),
       (f"coda_pacer_weight_version{{{SEL}}}", "weight version {{instance}}"),
       (f"coda_pacer_paused{{{SEL}}}", "paused {{instance}}")])
panel("Trajectory queue, waiting long-polls, watchers", "Trajectories of running groups held in the server; "
      "long-polls (Dispatch, Collect, CollectStream, Reset) waiting now; WatchControl streams open.",
      [(f"coda_pacer_queued_trajectories{{{SEL}}}", "queued trajectories {{instance}}"),
       (f"coda_pacer_waiting_calls{{{SEL}}}", "waiting long-polls {{instance}}"),
       (f"coda_pacer_watchers{{{SEL}}}", "watchers {{instance}}")])
panel("Strategy", "The pacing strategy (fully_async.sliding_window) and the reset generation.",
      [(f"coda_pacer_info{{{SEL}}}", "{{strategy}}"), (f"coda_pacer_generation{{{SEL}}}", "generation {{instance}}")],
      kind="stat", options={"textMode": "value_and_name", "reduceOptions": {"calcs": ["lastNotNull"]}})

row("Throughput: is generation or training the bottleneck?")
panel("Groups per second", "Dispatched (generation starts), collected (complete groups into the buffer), "
      "consumed (the trainer takes them).",
      [(f"sum(rate(coda_pacer_dispatched_groups_total{{{SEL}}}[{R}]))", "dispatched"),
       (f"sum(rate(coda_pacer_collected_groups_total{{{SEL}}}[{R}]))", "collected"),
       (f"sum(rate(coda_pacer_consumed_groups_total{{{SEL}}}[{R}]))", "consumed")], unit="ops")
panel("Seconds waiting per second", "Collect and CollectStream (the trainer's batches() waits in CollectStream) "
      "near 1 per trainer process: the trainer is starved (generation is the bottleneck). Dispatch high: workers "
      "wait for slots (training is the bottleneck). Reset: pause delay.",
      [(f"sum by (grpc_method) (rate(grpc_server_handling_seconds_sum{{{SEL},{SVC},grpc_method=~\"{WAITING_METHODS}\"}}[{R}]))",
        "{{grpc_method}}")], unit="s")
panel("Trajectories per second", "Accepted by Submit, and re-sent duplicates.",
      [(f"sum(rate(coda_pacer_submitted_trajectories_total{{{SEL}}}[{R}]))", "submitted"),
       (f"sum(rate(coda_pacer_duplicate_trajectories_total{{{SEL}}}[{R}]))", "duplicates")], unit="ops")
panel("Groups lost or set aside", "Filtered (rollout.filter), dropped incomplete and restored at a Reset, "
      "trajectories refused as STALE_GENERATION.",
      [(f"sum(increase(coda_pacer_filtered_groups_total{{{SEL}}}[{R}]))", "filtered"),
       (f"sum(increase(coda_pacer_dropped_groups_total{{{SEL}}}[{R}]))", "dropped incomplete"),
       (f"sum(increase(coda_pacer_restored_groups_total{{{SEL}}}[{R}]))", "restored"),
       (f"sum(increase(coda_pacer_stale_rejected_trajectories_total{{{SEL}}}[{R}]))", "stale-rejected trajectories")])

panel("Leases", "Running groups reclaimed after their in-flight lease ran out (a worker went silent), leased groups "
      "redelivered because no Ack came (and of those, given back to their trainer heard again), groups leased now.",
      [(f"sum(increase(coda_pacer_expired_groups_total{{{SEL}}}[{R}]))", "expired (in-flight lease)"),
       (f"sum(increase(coda_pacer_redelivered_groups_total{{{SEL}}}[{R}]))", "redelivered (Collect lease)"),
       (f"sum(increase(coda_pacer_reclaimed_groups_total{{{SEL}}}[{R}]))", "given back to their silent trainer"),
       (f"coda_pacer_leased_groups{{{SEL}}}", "leased now {{instance}}")])
panel("Bytes held", "Trajectory bytes queued, buffered or leased (capped by server.max_held_bytes when set).",
      [(f"coda_pacer_held_bytes{{{SEL}}}", "{{instance}}")], unit="bytes")
row("Staleness and latency")
panel("Staleness of consumed trajectories (weight versions)", "Weight version when the trainer took a trajectory "
      "minus the version its generation started with.",
      [(f"histogram_quantile({q}, sum by (le) (rate(coda_pacer_staleness_versions_bucket{{{SEL}}}[{R}])))", f"p{int(q*100)}")
       for q in (0.5, 0.9, 0.99)] +
      [(f"sum(rate(coda_pacer_staleness_versions_sum{{{SEL}}}[{R}])) / sum(rate(coda_pacer_staleness_versions_count{{{SEL}}}[{R}]))", "mean")])
panel("Dispatch to Collect latency", "Seconds from Dispatch admitting a group to the trainer taking it.",
      [(f"histogram_quantile({q}, sum by (le) (rate(coda_pacer_dispatch_to_collect_seconds_bucket{{{SEL}}}[{R}])))", f"p{int(q*100)}")
       for q in (0.5, 0.9, 0.99)], unit="s")

row("Step reports (latest Reset)")
panel("Partial rollouts", "partial_ratio: share of consumed trajectories whose start and end weight versions differ; "
      "partial_span_max: the largest difference.",
      [(f"coda_pacer_step_report_partial_ratio{{{SEL}}}", "partial_ratio {{instance}}"),
       (f"coda_pacer_step_report_partial_span_max{{{SEL}}}", "partial_span_max {{instance}}")], w=8)
panel("Buffer and drops at the step boundary", "pipeline_buf_size: groups carried into the next step; filter_drop; "
      "restored and dropped-incomplete groups of the Reset.",
      [(f"coda_pacer_step_report_pipeline_buf_size{{{SEL}}}", "pipeline_buf_size {{instance}}"),
       (f"coda_pacer_step_report_filter_drop{{{SEL}}}", "filter_drop {{instance}}"),
       (f"coda_pacer_step_report_partial_restored_groups{{{SEL}}}", "restored groups {{instance}}"),
       (f"coda_pacer_step_report_partial_dropped_incomplete_groups{{{SEL}}}", "dropped incomplete groups {{instance}}")],
      w=8)
panel("Pause delay and steps per hour", "Seconds a Reset waited for running groups; training steps (Resets) per hour.",
      [(f"coda_pacer_step_report_pause_delay_seconds{{{SEL}}}", "pause_delay s {{instance}}"),
       (f"sum(rate(coda_pacer_step_reports_total{{{SEL}}}[{R}])) * 3600", "steps per hour")], w=8)

row("gRPC server")
panel("RPCs per second by method and code", "From grpc_server_handled_total.",
      [(f"sum by (grpc_method, grpc_code) (rate(grpc_server_handled_total{{{SEL}}}[{R}]))", "{{grpc_method}} {{grpc_code}}")],
      unit="reqps")
panel("Errors per second (code not OK)", "INVALID_ARGUMENT and NOT_FOUND are caller bugs; FAILED_PRECONDITION "
      "STALE_GENERATION follows a Reset; RESOURCE_EXHAUSTED is overload; UNAUTHENTICATED is a token problem.",
      [(f"sum by (grpc_method, grpc_code) (rate(grpc_server_handled_total{{{SEL},grpc_code!=\"OK\"}}[{R}]))",
        "{{grpc_method}} {{grpc_code}}")], unit="reqps")
panel("p99 handling time by method", "Long-polls (Dispatch, Collect, CollectStream, Reset with a wait) include "
      "their wait.",
      [(f"histogram_quantile(0.99, sum by (le, grpc_method) (rate(grpc_server_handling_seconds_bucket{{{SEL}}}[{R}])))",
        "{{grpc_method}}")], unit="s")
panel("RPCs in flight", "Started minus handled, by method (WatchControl streams stay in flight).",
      [(f"sum by (grpc_method) (grpc_server_started_total{{{SEL}}}) - sum by (grpc_method) (grpc_server_handled_total{{{SEL}}})",
        "{{grpc_method}}")])

dashboard = {
    "title": "coda-pacer: rollout pacing",
    "uid": "coda-pacer",
    "description": "Window, throughput, staleness, step reports and gRPC metrics of coda-server (deploy/prometheus).",
    "tags": ["coda-pacer", "rl", "grpc"],
    "timezone": "browser",
    "editable": True,
    "schemaVersion": 39,
    "version": 1,
    "refresh": "30s",
    "time": {"from": "now-6h", "to": "now"},
    "templating": {"list": [
        {"name": "datasource", "label": "Data source", "type": "datasource", "query": "prometheus",
         "current": {}, "hide": 0},
        {"name": "instance", "label": "Instance", "type": "query",
         "datasource": {"type": "prometheus", "uid": "${datasource}"},
         "query": {"query": "label_values(coda_pacer_step, instance)", "refId": "instance"},
         "definition": "label_values(coda_pacer_step, instance)",
         "includeAll": True, "multi": True, "allValue": ".*", "current": {}, "refresh": 2, "hide": 0},
    ]},
    "annotations": {"list": []},
    "panels": layout.panels,
}


def render() -> str:
    return json.dumps(dashboard, indent=2) + "\n"


if __name__ == "__main__":
    OUTPUT.write_text(render())
    print(f"wrote {OUTPUT} ({len(layout.panels)} panels)")
