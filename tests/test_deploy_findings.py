"""Findings of a user's deployment test (container, Kubernetes, Prometheus), checked against the deploy files, the
docs and real servers: the pod's restart policy, the Service's target port, the dashboard's waiting panel, the
container's settings, health check, working directory and build context, and the TLS component."""
from __future__ import annotations

import json
import re
import shlex
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import yaml

from coda_client import PacerClient, Trajectory, TrajectoryStatus
from coda_server.core import load_config
from ops_harness import MetricsServer
from server_harness import REPO_ROOT, ServerProcess

DEPLOY = REPO_ROOT / "deploy"
K8S = DEPLOY / "k8s"
OPERATIONS = (REPO_ROOT / "docs" / "operations.md").read_text()
DOCKERFILE = (REPO_ROOT / "Dockerfile").read_text()
CONTAINER_CONFIG = yaml.safe_load((DEPLOY / "container.yaml").read_text())


def k8s(directory: Path = K8S) -> dict[str, dict]:
    return {doc["kind"]: doc for path in sorted(directory.glob("*.yaml")) for doc in yaml.safe_load_all(path.read_text())
            if doc.get("kind") not in ("Kustomization", "Component")}


def sidecar(pod: dict) -> dict:
    return next(c for c in pod["spec"]["initContainers"] if c["name"] == "coda-pacer")


def port_of(address: str) -> int:
    return int(address.rsplit(":", 1)[1])


def dockerfile_instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) in order, line continuations joined, comments left out."""
    lines = [line for line in DOCKERFILE.splitlines() if not line.lstrip().startswith("#")]
    joined = "\n".join(lines).replace("\\\n", " ")
    return [(line.split(None, 1)[0].upper(), line.split(None, 1)[1]) for line in joined.splitlines() if line.strip()]


def healthcheck_command() -> list[str]:
    [argument] = [arguments for name, arguments in dockerfile_instructions() if name == "HEALTHCHECK"]
    return json.loads(argument.split("CMD", 1)[1])


def pyproject_version() -> str:
    return re.search(r'^version = "([^"]+)"', (REPO_ROOT / "pyproject.toml").read_text(), re.MULTILINE).group(1)


# ------------------------------------------------------------------------------------------------ Kubernetes


def test_the_pod_lets_the_trainer_stay_exited_so_the_sidecar_is_stopped():
    """Without a restartPolicy the Pod's default Always restarts a finished trainer and never stops the sidecar."""
    pod = k8s()["Pod"]
    assert pod["spec"].get("restartPolicy") in ("Never", "OnFailure"), \
        f"pod.yaml restartPolicy {pod['spec'].get('restartPolicy')!r}: the default Always never lets the trainer end"
    assert sidecar(pod)["restartPolicy"] == "Always"  # still a native sidecar


def test_the_service_targets_the_port_the_sidecar_listens_on_by_number():
    """A named targetPort of an init container resolves only from Kubernetes 1.32: on 1.29-1.31 no endpoints."""
    documents = k8s()
    [service_port] = documents["Service"]["spec"]["ports"]
    target = service_port["targetPort"]
    assert isinstance(target, int), f"service.yaml targetPort {target!r}: use the number, not a port name"
    container_ports = {p["name"]: p["containerPort"] for p in sidecar(documents["Pod"])["ports"]}
    server = yaml.safe_load(documents["ConfigMap"]["data"]["pacer.yaml"])["server"]
    assert target == container_ports["grpc"] == port_of(server["address"])
    if not server.get("tls"):  # plaintext: the probes use the same port (with TLS: the health-only port)
        probes = sidecar(documents["Pod"])
        assert {probes[p]["grpc"]["port"] for p in ("startupProbe", "readinessProbe", "livenessProbe")} == {target}


def test_pod_annotations_name_the_metrics_port_and_no_scrape_job_that_does_not_exist():
    pod = k8s()["Pod"]
    text = (K8S / "pod.yaml").read_text()
    prometheus = (DEPLOY / "prometheus" / "prometheus.yml").read_text()
    if "__meta_kubernetes_pod_annotation_prometheus_io" not in prometheus:
        assert not re.search(r"annotation-based scrape job of deploy/prometheus", text), \
            "pod.yaml names an annotation-based job that deploy/prometheus/prometheus.yml does not have"
    server = yaml.safe_load(k8s()["ConfigMap"]["data"]["pacer.yaml"])["server"]
    metrics = {p["name"]: p["containerPort"] for p in sidecar(pod)["ports"]}["metrics"]
    assert int(pod["metadata"]["annotations"]["prometheus.io/port"]) == metrics == port_of(server["metrics_address"])


def tls_patch() -> dict:
    return yaml.safe_load((K8S / "tls" / "sidecar-tls.yaml").read_text())


def test_the_plaintext_service_says_so_and_the_tls_component_is_a_consistent_server_configuration(tmp_path):
    """The token crosses the pod network through the Service: plaintext is said in the manifest, TLS is one step."""
    assert re.search(r"plaintext", (K8S / "service.yaml").read_text(), re.IGNORECASE)
    assert "deploy/k8s/tls" in (K8S / "service.yaml").read_text()
    component = yaml.safe_load((K8S / "tls" / "kustomization.yaml").read_text())
    assert component["kind"] == "Component" and component["patches"] == [{"path": "sidecar-tls.yaml"}]
    assert re.search(r"^# components:\n#   - tls$", (K8S / "kustomization.yaml").read_text(), re.MULTILINE)
    patch = tls_patch()
    [patched] = patch["spec"]["initContainers"]
    assert patched["name"] == "coda-pacer" and patch["metadata"]["name"] == k8s()["Pod"]["metadata"]["name"]
    config_file = tmp_path / "pacer.yaml"
    config_file.write_text(k8s()["ConfigMap"]["data"]["pacer.yaml"])
    config = load_config(config_file, patched["args"], load_plugins=False)  # args: key=value overrides
    tls_mount = next(m["mountPath"] for m in patched["volumeMounts"] if m["name"] == "tls")
    for key in ("cert_file", "key_file"):
        assert Path(config.server.tls[key]).parent == Path(tls_mount), key
    secret = next(v for v in patch["spec"]["volumes"] if v["name"] == "tls")["secret"]["secretName"]
    assert secret == "coda-pacer-tls"
    health = port_of(config.server.health_address)
    assert config.server.health_address.startswith("0.0.0.0:")  # the kubelet probes the pod IP
    assert {patched[p]["grpc"]["port"] for p in ("startupProbe", "readinessProbe", "livenessProbe")} == {health}
    assert {p["name"]: p["containerPort"] for p in patched["ports"]} == {"health": health}


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="needs kubectl (its built-in kustomize)")
def test_kustomize_builds_the_example_with_and_without_the_tls_component(tmp_path):
    def build(directory: Path) -> dict[str, dict]:
        out = subprocess.run(["kubectl", "kustomize", str(directory)], capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        return {doc["kind"]: doc for doc in yaml.safe_load_all(out.stdout)}

    plain = sidecar(build(K8S)["Pod"])
    assert "args" not in plain and plain["readinessProbe"]["grpc"]["port"] == 50051
    copy = tmp_path / "k8s"
    shutil.copytree(K8S, copy)
    kustomization = copy / "kustomization.yaml"
    kustomization.write_text(kustomization.read_text().replace("# components:\n#   - tls", "components:\n  - tls"))
    built = build(copy)
    tls = sidecar(built["Pod"])
    assert tls["args"] == tls_patch()["spec"]["initContainers"][0]["args"]
    assert {tls[p]["grpc"]["port"] for p in ("startupProbe", "readinessProbe", "livenessProbe")} == {8081}
    assert tls["readinessProbe"]["grpc"]["service"] == "readiness" and tls["livenessProbe"]["grpc"]["service"] == "liveness"
    assert {p["name"] for p in tls["ports"]} == {"grpc", "metrics", "health"}
    assert "coda-pacer-tls" in [v.get("secret", {}).get("secretName") for v in built["Pod"]["spec"]["volumes"]]
    assert built["Pod"]["spec"]["restartPolicy"] == "Never"


# ------------------------------------------------------------------------------------------------ Prometheus


def waiting_methods_of_the_dashboard() -> str:
    dashboard = json.loads((DEPLOY / "prometheus" / "grafana-dashboard.json").read_text())
    [panel] = [p for p in dashboard["panels"] if p["title"] == "Seconds waiting per second"]
    [expr] = [t["expr"] for t in panel["targets"]]
    return re.search(r'grpc_method=~"([^"]+)"', expr).group(1)


def waiting_matcher_of_the_bottleneck_rule() -> tuple[str, str]:
    rule = OPERATIONS.split("- **Generation is the bottleneck**", 1)[1].split("\n- ", 1)[0]
    operator, value = re.search(r'grpc_method(=~|=)"([^"]+)"', rule).groups()
    return operator, value


def test_the_waiting_panel_and_the_bottleneck_rule_cover_the_call_a_trainer_on_batches_waits_in(tmp_path):
    """A trainer on batches() with nothing to take: each method whose calls waited out the poll is in both queries."""
    poll = 1.0
    small = ("fully_async.sliding_window=no-window", "data_source.num_prompts_per_step=2",
             "data_source.num_trajectories_per_prompt=2", "trainer.mini_batch_size=2")
    with MetricsServer(tmp_path, *small) as server:
        taken = []
        with PacerClient(server.address, client_id="trainer") as trainer:
            batches = trainer.batches(mini_batch_size=2, poll=poll)
            waiting = threading.Thread(target=lambda: taken.append(next(batches)), daemon=True)
            waiting.start()

            def waited(scrape) -> set[str]:
                """Methods whose finished calls took at least most of a poll each: those that waited for groups."""
                methods = {s.labels["grpc_method"] for s in scrape.samples if s.name == "grpc_server_handled_total"}
                return {m for m in methods if scrape.value("grpc_server_handled_total", grpc_method=m, grpc_code="OK")
                        and scrape.value("grpc_server_handling_seconds_sum", grpc_method=m)
                        >= 0.9 * poll * sum(s.value for s in scrape.samples
                                            if s.name == "grpc_server_handled_total" and s.labels["grpc_method"] == m)}

            scrape = server.scrape_until(lambda s: waited(s), timeout=60)
            methods = waited(scrape)
            assert methods, "the trainer's wait shows in no method's handling time"
            with PacerClient(server.address, client_id="worker") as worker:  # one group ends the trainer's wait
                assert worker.dispatch(["p0"]).admitted == ["p0"]
                worker.submit([Trajectory(trajectory_id=f"p0/{i}", prompt_id="p0", status=TrajectoryStatus.COMPLETED,
                                          reward=float(i)) for i in range(2)])
            waiting.join(60)
            batches.close()
        assert taken, "batches() did not hand over the group"
    panel = waiting_methods_of_the_dashboard()
    operator, rule = waiting_matcher_of_the_bottleneck_rule()
    for method in methods:
        assert re.fullmatch(panel, method), f"the dashboard's waiting panel (grpc_method=~\"{panel}\") misses {method}"
        covered = re.fullmatch(rule, method) if operator == "=~" else method == rule
        assert covered, f"operations.md's bottleneck rule (grpc_method{operator}\"{rule}\") misses {method}"


# ------------------------------------------------------------------------------------------------ Container


def documented_docker_run() -> list[str]:
    blocks = re.findall(r"```bash\n(.*?)```", OPERATIONS, re.DOTALL)
    runs = [shlex.split(block.replace("\\\n", " ")) for block in blocks if "docker run" in block]
    assert runs, "docs/operations.md shows no `docker run` of the image"
    return runs[0]


def test_the_image_is_built_with_the_tag_the_pod_names():
    version = pyproject_version()
    assert f"docker build -t coda-pacer:{version} " in OPERATIONS, "operations.md: say how to build the image"
    assert f"docker build -t coda-pacer:{version} " in DOCKERFILE
    assert sidecar(k8s()["Pod"])["image"] == f"coda-pacer:{version}"


def test_a_config_of_your_own_with_the_documented_arguments_keeps_the_container_settings(tmp_path):
    """A run config mounted over /etc/coda/pacer.yaml replaces the baked-in file: the documented docker run
    passes the container's server keys as overrides, so none of them falls back to its loopback default."""
    command = documented_docker_run()
    image = next(i for i, word in enumerate(command) if word.startswith("coda-pacer:"))  # the image, by its tag
    overrides = command[image + 1:]
    assert any("/etc/coda/pacer.yaml" in word for word in command[:image]), "the example mounts a config of its own"
    run_config = tmp_path / "run.yaml"  # the user's: no server section
    run_config.write_text("fully_async:\n  sliding_window: windowed-fifo\n  stale_steps: 1.0\n")
    config = load_config(run_config, overrides, load_plugins=False)
    for key, value in CONTAINER_CONFIG["server"].items():
        assert config.server[key] == value, f"server.{key}: {config.server[key]!r}, the image sets {value!r}"
    # docker stop's default (10 s) is the server's drain: the documented timeout must exceed it.
    stop_timeout = int(command[command.index("--stop-timeout") + 1])
    assert stop_timeout > config.server.shutdown_grace_seconds
    assert re.search(r"docker stop -t (\d+)", OPERATIONS) and int(re.search(r"docker stop -t (\d+)", OPERATIONS)
                                                                   .group(1)) > config.server.shutdown_grace_seconds


def test_the_working_directory_outlives_the_build_and_is_the_state_volume():
    """WORKDIR /src was deleted by the install step: the server then ran in a directory that did not exist."""
    workdir, removed_after = None, []
    for name, arguments in dockerfile_instructions():
        if name == "WORKDIR":
            workdir, removed_after = arguments.strip(), []
        elif name == "RUN":
            removed_after += re.findall(r"rm -r[f]* (\S+)", arguments)
    assert workdir is not None
    assert not [path for path in removed_after if (workdir + "/").startswith(path.rstrip("/") + "/")], \
        f"the final WORKDIR {workdir} is removed by a later RUN"
    assert workdir == CONTAINER_CONFIG["server"]["state_dir"], "run where the server may write: the state volume"


def openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command line")
def test_the_image_health_check_passes_on_the_baked_in_config_with_tls_on(tmp_path):
    """The HEALTHCHECK probed plaintext 127.0.0.1:50051: unhealthy for ever once server.tls was set."""
    command = healthcheck_command()
    address = command[command.index("--address") + 1]
    health = CONTAINER_CONFIG["server"].get("health_address") or ""
    assert health and port_of(address) == port_of(health), \
        f"HEALTHCHECK probes {address}; deploy/container.yaml's plaintext health-only port is {health!r}"
    assert address.startswith("127.0.0.1:") and health.split(":")[0] in ("127.0.0.1", "0.0.0.0")
    # A server on the image's config with TLS on (ports 0 and a state directory of its own instead of the image's).
    openssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes", "-keyout",
            "server.key", "-out", "server.pem", "-days", "2", "-subj", "/CN=localhost",
            "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1", cwd=tmp_path)
    overrides = (f"server.tls.cert_file={tmp_path / 'server.pem'}", f"server.tls.key_file={tmp_path / 'server.key'}",
                 "server.health_address=127.0.0.1:0", f"server.state_dir={tmp_path / 'state'}",
                 "fully_async.sliding_window=no-window")
    with ServerProcess(tmp_path, *overrides, config_file=DEPLOY / "container.yaml") as server:
        client = Path(sys.executable).with_name(command[0])
        probe = [str(client), *command[1:]]
        on_health_port = probe.copy()
        on_health_port[probe.index(address)] = f"127.0.0.1:{server.info['health_port']}"
        result = subprocess.run(on_health_port, capture_output=True, text=True, timeout=60)
        assert result.returncode == 0, (result.stdout, result.stderr)
        # The main port speaks TLS only: the old check's plaintext probe of it fails.
        on_main_port = probe.copy()
        on_main_port[probe.index(address)] = server.address
        on_main_port.insert(1, "--timeout=5")
        assert subprocess.run(on_main_port, capture_output=True, text=True, timeout=60).returncode != 0


# ------------------------------------------------------------------------------------------------ Build context


def docker_ignores(path: str, patterns: list[str]) -> bool:
    """Whether Docker's .dockerignore rules leave `path` out of the build context: the last pattern matching the
    path or one of its parent directories decides; `!` re-includes; `*` stays within a directory, `**` does not."""
    def regex(pattern: str) -> str:
        out, i = "", 0
        while i < len(pattern):
            if pattern.startswith("**/", i):
                out, i = out + "(?:.*/)?", i + 3
            elif pattern.startswith("**", i):
                out, i = out + ".*", i + 2
            elif pattern[i] == "*":
                out, i = out + "[^/]*", i + 1
            elif pattern[i] == "?":
                out, i = out + "[^/]", i + 1
            elif pattern[i] == "[":
                end = pattern.index("]", i)
                out, i = out + pattern[i:end + 1], end + 1
            else:
                out, i = out + re.escape(pattern[i]), i + 1
        return out

    parts = path.split("/")
    candidates = ["/".join(parts[:n]) for n in range(1, len(parts) + 1)]
    ignored = False
    for pattern in patterns:
        negated = pattern.startswith("!")
        body = pattern[1:] if negated else pattern
        if any(re.fullmatch(regex(body.strip("/")), candidate) for candidate in candidates):
            ignored = not negated
    return ignored


def test_the_build_context_holds_what_the_dockerfile_copies_and_no_local_modules_or_environments():
    ignore_file = REPO_ROOT / ".dockerignore"
    assert ignore_file.exists(), "no .dockerignore: .git, .venv*, build/ and coda_server/custom/ modules go into the build"
    patterns = [line.strip() for line in ignore_file.read_text().splitlines()
                if line.strip() and not line.lstrip().startswith("#")]
    copied = [word for name, arguments in dockerfile_instructions() if name == "COPY"
              for word in shlex.split(arguments)[:-1]]
    needed = []
    for source in copied:
        path = REPO_ROOT / source
        files = [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file() or p.is_symlink()]
        needed += [p.relative_to(REPO_ROOT).as_posix() for p in files
                   if "__pycache__" not in p.parts and p.suffix != ".pyc"
                   and not (p.parent.name == "custom" and p.name != "__init__.py")]
    assert "coda_server/custom/__init__.py" in needed and "deploy/container.yaml" in needed
    left_out = [path for path in needed if docker_ignores(path, patterns)]
    assert not left_out, f".dockerignore leaves out what the Dockerfile copies: {left_out[:5]}"
    # Custom strategies are mounted (docs/custom-strategies.md, "Where to put the module"), never baked in unseen.
    for path in (".git/config", ".venv/bin/python", ".venv-3.12/bin/python", "venv/bin/python",
                 "build/lib/coda_server/__init__.py", "dist/coda_pacer-0.1.0.whl", "coda_pacer.egg-info/PKG-INFO",
                 "coda_server/custom/my_strategy.py", "coda_server/custom/team/x.py",
                 "coda_server/__pycache__/server.cpython-311.pyc", "coda_client/x.pyc", "coda-state/journal.sqlite",
                 "tests/test_x.py", ".pytest_cache/v/cache"):
        assert docker_ignores(path, patterns), f"{path} would go into the image's build context"
