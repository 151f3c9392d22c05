"""Documentation and deployment files checked against the code: the configuration reference against
conf/default.yaml, the protocol page against the service, the Kubernetes and Prometheus files against what
the server needs."""
from __future__ import annotations

import json
import re
from pathlib import Path

import yaml

from coda_client._proto import pacer_pb2
from coda_server.core import load_config
from server_harness import REPO_ROOT

DOCS = REPO_ROOT / "docs"
K8S = REPO_ROOT / "deploy" / "k8s"
CONFIG_ROW = re.compile(r"^\| `([^`]+)` \| `([^`]*)` \|", re.MULTILINE)


def default_keys() -> dict[str, object]:
    """Every leaf of conf/default.yaml as dotted key -> raw YAML value (lists are leaves)."""
    leaves: dict[str, object] = {}

    def walk(prefix: str, node: object) -> None:
        if isinstance(node, dict):
            for key, value in node.items():
                walk(f"{prefix}.{key}" if prefix else key, value)
        else:
            leaves[prefix] = node

    walk("", yaml.safe_load((REPO_ROOT / "conf" / "default.yaml").read_text()))
    return leaves


def documented_keys() -> dict[str, str]:
    rows = CONFIG_ROW.findall((DOCS / "configuration.md").read_text())
    keys = [key for key, _ in rows]
    assert len(keys) == len(set(keys)), "a key is documented twice"
    return dict(rows)


def test_every_default_key_is_documented_and_every_documented_key_exists():
    defaults, documented = default_keys(), documented_keys()
    undocumented = sorted(set(defaults) - set(documented))
    unknown = sorted(set(documented) - set(defaults))
    assert not undocumented, f"add a row to docs/configuration.md for: {undocumented}"
    assert not unknown, f"docs/configuration.md documents keys conf/default.yaml does not have: {unknown}"


def test_documented_defaults_equal_the_defaults_file():
    defaults, documented = default_keys(), documented_keys()
    wrong = {key: (documented[key], defaults[key]) for key in defaults.keys() & documented.keys()
             if yaml.safe_load(documented[key]) != defaults[key]}
    assert not wrong, f"documented default vs conf/default.yaml: {wrong}"


def test_protocol_page_covers_every_rpc_and_status_code():
    text = (DOCS / "protocol.md").read_text()
    service = pacer_pb2.DESCRIPTOR.services_by_name["RolloutPacer"]
    for method in service.methods:
        assert f"### {method.name}\n" in text, f"docs/protocol.md has no section for {method.name}"
        section = text.split(f"### {method.name}\n", 1)[1].split("\n### ", 1)[0]
        assert "Errors:" in section and "Retry:" in section, f"{method.name}: say its errors and retry safety"
    from coda_server.status import _CODES  # every code the server maps a core error to
    for _, code in _CODES:
        assert f"| {code.name} |" in text, code.name
    from coda_server.core import errors
    reasons = {cls.reason for cls in vars(errors).values() if isinstance(cls, type) and issubclass(cls, errors.PacerError)}
    for reason in reasons - {"PACER_ERROR", "FAILED_PRECONDITION", "RESOURCE_EXHAUSTED"}:
        assert f"`{reason}`" in text, f"docs/protocol.md does not name the reason {reason}"


def test_operations_page_covers_what_operators_need():
    text = (DOCS / "operations.md").read_text()
    for heading in ("## Deploy", "## Probes", "## Upgrades", "## Durability", "## Security", "## Metrics", "## Logs"):
        assert f"\n{heading}" in text, heading
    assert "](security.md)" in text
    assert "in memory" in text and "a restart loses" in text


def test_operations_page_lists_every_metric_the_server_exports():
    from coda_server.observability import PACER_METRICS, STEP_REPORT_GAUGES

    text = (DOCS / "operations.md").read_text()
    names = [name for _, name, _ in STEP_REPORT_GAUGES]
    names += [f"{name}_total" if counter else name for _, name, _, counter in PACER_METRICS]
    names += ["coda_server_ready", "coda_server_recovering", "coda_pacer_info", "coda_pacer_watchers", "coda_pacer_step_reports_total",
              "coda_pacer_dispatch_to_collect_seconds", "coda_pacer_staleness_versions",
              "grpc_server_started_total", "grpc_server_handled_total", "grpc_server_handling_seconds"]
    missing = [name for name in names if f"`{name}`" not in text]
    assert not missing, f"docs/operations.md does not describe {missing}"


def test_docs_link_only_to_files_that_exist():
    for page in DOCS.glob("*.md"):
        for target in re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", page.read_text()):
            if target == "security.md" and not (DOCS / target).exists():
                continue  # written with the security issue (issue 5)
            assert (page.parent / target).resolve().exists(), f"{page.name} links to missing {target}"


def k8s_documents() -> dict[str, dict]:
    documents = {}
    for path in sorted(K8S.glob("*.yaml")):
        for document in yaml.safe_load_all(path.read_text()):
            documents[document["kind"]] = document
    return documents


def test_kubernetes_pod_runs_the_server_as_a_native_sidecar_with_grpc_probes():
    pod = k8s_documents()["Pod"]["spec"]
    sidecar = next(c for c in pod["initContainers"] if c["name"] == "coda-pacer")
    assert sidecar["restartPolicy"] == "Always"
    ports = {p["name"]: p["containerPort"] for p in sidecar["ports"]}
    assert ports == {"grpc": 50051, "metrics": 9464}
    assert sidecar["readinessProbe"]["grpc"] == {"port": 50051, "service": "readiness"}
    assert sidecar["livenessProbe"]["grpc"] == {"port": 50051, "service": "liveness"}
    assert sidecar["startupProbe"]["grpc"]["service"] == "readiness"
    assert sidecar["resources"]["requests"] == {"cpu": "250m", "memory": "256Mi"}
    mounts = {m["name"]: m["mountPath"] for m in sidecar["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes[next(n for n, p in mounts.items() if p == "/var/run/coda")]["emptyDir"] is not None
    assert volumes[next(n for n, p in mounts.items() if p == "/etc/coda/token")]["secret"]["secretName"] == "coda-pacer-token"
    env = {e["name"]: e["value"] for e in sidecar["env"]}
    config_volume = next(n for n, p in mounts.items() if env["CODA_CONFIG"].startswith(p + "/"))
    assert volumes[config_volume]["configMap"]["name"] == "coda-pacer-config"
    assert pod["terminationGracePeriodSeconds"] > 10  # more than server.shutdown_grace_seconds


def test_kubernetes_config_map_is_a_valid_server_configuration(tmp_path):
    documents = k8s_documents()
    config_file = tmp_path / "pacer.yaml"
    config_file.write_text(documents["ConfigMap"]["data"]["pacer.yaml"])
    config = load_config(config_file, load_plugins=False)
    assert config.server.address == "0.0.0.0:50051" and config.server.metrics_address == "0.0.0.0:9464"
    assert config.server.auth_token_file == "/etc/coda/token/token"
    assert Path(config.server.uds_path).parent == Path("/var/run/coda")
    pod = documents["Pod"]["spec"]
    sidecar = next(c for c in pod["initContainers"] if c["name"] == "coda-pacer")
    state_volume = next(m["name"] for m in sidecar["volumeMounts"] if m["mountPath"] == config.server.state_dir)
    assert "emptyDir" in next(v for v in pod["volumes"] if v["name"] == state_volume)
    assert "token" in documents["Secret"]["stringData"]


def test_prometheus_scrape_config_targets_the_metrics_port():
    prometheus = yaml.safe_load((REPO_ROOT / "deploy" / "prometheus" / "prometheus.yml").read_text())
    jobs = {job["job_name"]: job for job in prometheus["scrape_configs"]}
    assert jobs["coda-pacer-local"]["static_configs"][0]["targets"] == ["127.0.0.1:9464"]
    keep = jobs["coda-pacer"]["relabel_configs"][0]
    assert keep["action"] == "keep" and keep["regex"] == "coda-pacer;metrics"
    assert all(job.get("metrics_path", "/metrics") == "/metrics" for job in jobs.values())


def test_grafana_dashboard_is_valid_json_without_overlapping_panels():
    dashboard = json.loads((REPO_ROOT / "deploy" / "prometheus" / "grafana-dashboard.json").read_text())
    cells: dict[tuple[int, int], str] = {}
    for panel in dashboard["panels"]:
        grid = panel["gridPos"]
        assert 0 <= grid["x"] and grid["x"] + grid["w"] <= 24, panel["title"]
        for x in range(grid["x"], grid["x"] + grid["w"]):
            for y in range(grid["y"], grid["y"] + grid["h"]):
                assert (x, y) not in cells, f"{panel['title']!r} overlaps {cells[(x, y)]!r}"
                cells[(x, y)] = panel["title"]
    assert len({panel["id"] for panel in dashboard["panels"]}) == len(dashboard["panels"])


def test_grafana_dashboard_is_what_its_generator_writes():
    import importlib.util

    path = REPO_ROOT / "deploy" / "prometheus" / "gen_dashboard.py"
    spec = importlib.util.spec_from_file_location("gen_dashboard", path)
    generator = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(generator)
    assert (REPO_ROOT / "deploy" / "prometheus" / "grafana-dashboard.json").read_text() == generator.render(), \
        "run: python deploy/prometheus/gen_dashboard.py"
