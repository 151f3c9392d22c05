"""What can be checked of the container image and the package without a container engine."""
from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import venv
from pathlib import Path

import pytest

from conftest import read_pyproject

REPO = Path(__file__).resolve().parents[1]
DOCKERFILE = (REPO / "Dockerfile").read_text()
PYPROJECT = read_pyproject()
SCRIPTS = PYPROJECT["project"]["scripts"]


def instructions(name: str) -> list[str]:
    """Arguments of every `name` instruction, with line continuations joined."""
    joined = DOCKERFILE.replace("\\\n", " ")
    return [line.split(None, 1)[1] for line in joined.splitlines() if line.strip().upper().startswith(name + " ")]


def exec_form(argument: str) -> list[str]:
    return json.loads(argument) if argument.lstrip().startswith("[") else shlex.split(argument)


def test_every_path_the_dockerfile_copies_exists():
    copies = instructions("COPY")
    assert copies, "the Dockerfile copies the source tree"
    for argument in copies:
        *sources, _destination = exec_form(argument)
        for source in sources:
            assert (REPO / source).exists(), f"COPY {source}: no such path in the repository"


def test_dockerfile_commands_name_real_console_scripts():
    entrypoint = exec_form(instructions("ENTRYPOINT")[0])
    assert entrypoint[0] == "coda-server" and entrypoint[0] in SCRIPTS
    healthcheck = instructions("HEALTHCHECK")[0]
    command = exec_form(healthcheck.split("CMD", 1)[1])
    assert command[0] in SCRIPTS and "health" in command


def test_dockerfile_runs_as_non_root_and_exposes_the_server_port():
    user = instructions("USER")[-1].strip()
    assert user not in ("root", "0")
    assert "50051" in instructions("EXPOSE")[0]
    assert instructions("FROM")[0].startswith("python:") and "slim" in instructions("FROM")[0]


def test_console_scripts_point_at_real_functions():
    for name, target in SCRIPTS.items():
        module, function = target.split(":")
        imported = __import__(module, fromlist=[function])
        assert callable(getattr(imported, function)), f"{name} -> {target}"


def test_client_package_imports_only_grpc_and_protobuf():
    # The worker loop and the engine protocol too: the HTTP adapters (httpx, the `worker` extra) load on first use.
    code = ("import sys, coda_client, coda_client.cli, coda_client.worker, coda_client.engines, coda_worker, coda_worker.engines; "
            "bad = sorted(m for m in sys.modules "
            "if m.split('.')[0] in {'omegaconf', 'yaml', 'coda_server', 'coda', 'httpx'}); "
            "print(bad)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, check=True).stdout
    assert out.strip() == "[]"


@pytest.mark.skipif(os.environ.get("CODA_SKIP_INSTALL_TEST") == "1", reason="install test disabled by environment")
def test_the_dockerfile_install_step_succeeds_in_a_fresh_virtual_environment(tmp_path):
    run_steps = [step for step in instructions("RUN") if "pip install" in step]
    assert run_steps, "the Dockerfile installs the package with pip"
    install = re.search(r"pip install ([^&]*)", run_steps[0]).group(1).split()
    environment = tmp_path / "venv"
    venv.create(environment, with_pip=True)
    python = environment / "bin" / "python"
    # Same arguments as the image; built from a copy of the source tree, like COPY does.
    subprocess.run([str(python), "-m", "pip", "install", "-q", *install], cwd=REPO, check=True, timeout=900)
    config = subprocess.run([str(environment / "bin" / "python"), "-c",
                             "from coda_server.core import load_config; print(load_config().server.address)"],
                            capture_output=True, text=True, cwd=tmp_path, check=True).stdout
    assert config.strip() == "127.0.0.1:50051"  # the packaged default config, found outside the source tree
    for script in ("coda-server", "coda-client"):
        help_text = subprocess.run([str(environment / "bin" / script), "--help"], capture_output=True, text=True,
                                   cwd=tmp_path, check=True).stdout
        assert script in help_text


def _requirement(text: str) -> tuple[str, str]:
    """(name, version specifier) of a PEP 508 requirement without markers, e.g. ('grpcio', '>=1.85.1')."""
    name = re.match(r"[A-Za-z0-9_.-]+", text).group(0)
    return name.lower(), text[len(name):].split(";")[0].strip()


def test_the_plain_distribution_is_the_client_needing_only_grpcio_and_protobuf_with_lower_bounds():
    requirements = dict(_requirement(r) for r in PYPROJECT["project"]["dependencies"])
    assert set(requirements) == {"grpcio", "protobuf"}
    for name, specifier in requirements.items():
        assert ">=" in specifier and "==" not in specifier, f"{name}{specifier}: a lower bound, never an exact pin"
    # Nothing a worker or trainer installs pins exactly (the test extra's grpcio-tools generates the stubs).
    for extra in ("server", "worker", "numpy"):
        for requirement in PYPROJECT["project"]["optional-dependencies"][extra]:
            assert "==" not in requirement, f"[{extra}] {requirement}: lower bounds only"


def test_the_oldest_python_tested_is_the_oldest_the_package_accepts():
    # scripts/test_other_pythons.sh (CI) runs the suite on every version the classifiers name
    tested = sorted(tuple(int(part) for part in c.rsplit(" :: ", 1)[1].split("."))
                    for c in PYPROJECT["project"]["classifiers"] if re.fullmatch(r"Programming Language :: Python :: 3\.\d+", c))
    assert tested, "the classifiers name the Python versions the suite runs on"
    assert PYPROJECT["project"]["requires-python"] == ">={}.{}".format(*tested[0])
    assert [minor for _, minor in tested] == list(range(tested[0][1], tested[-1][1] + 1)), "no version skipped"


def test_the_client_floors_are_the_versions_the_stubs_were_generated_with():
    requirements = dict(_requirement(r) for r in PYPROJECT["project"]["dependencies"])
    grpc_stub = (REPO / "coda_client" / "_proto" / "pacer_pb2_grpc.py").read_text()
    generated_grpc = re.search(r"GRPC_GENERATED_VERSION = '([0-9.]+)'", grpc_stub).group(1)
    assert requirements["grpcio"] == f">={generated_grpc}"
    message_stub = (REPO / "coda_client" / "_proto" / "pacer_pb2.py").read_text()
    generated_protobuf = re.search(r"# Protobuf Python Version: ([0-9.]+)", message_stub).group(1)
    assert requirements["protobuf"].split(",")[0] == f">={generated_protobuf}"
    tools = dict(_requirement(r) for r in PYPROJECT["project"]["optional-dependencies"]["test"])
    assert tools["grpcio-tools"] == f"=={generated_grpc}", "one grpcio-tools version generates the stubs"


def test_the_server_imports_only_the_public_and_protocol_parts_of_the_client():
    import ast

    # coda_client.commands: the console commands' one-line refusal when the server extra is missing
    allowed = {"coda_client", "coda_client.protocol", "coda_client.wire_forms", "coda_client._proto",
               "coda_client.commands"}

    def is_allowed(name: str) -> bool:
        return name in allowed or name.startswith("coda_client._proto.")

    offending = []
    for path in sorted((REPO / "coda_server").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([node.module] if isinstance(node, ast.ImportFrom) and node.module and node.level == 0
                     else [alias.name for alias in node.names] if isinstance(node, ast.Import) else [])
            for name in names:
                if name.split(".")[0] in ("coda_client", "coda_worker") and not is_allowed(name):
                    offending.append(f"{path.relative_to(REPO)}: {name}")
    assert offending == []


@pytest.mark.skipif(os.environ.get("CODA_SKIP_INSTALL_TEST") == "1", reason="install test disabled by environment")
def test_the_plain_install_brings_the_client_alone_and_coda_server_names_its_extra(tmp_path):
    environment = tmp_path / "venv"
    venv.create(environment, with_pip=True)
    python = environment / "bin" / "python"
    subprocess.run([str(python), "-m", "pip", "install", "-q", str(REPO)], check=True, timeout=900)
    listed = json.loads(subprocess.run([str(python), "-m", "pip", "list", "--format", "json"], capture_output=True,
                                       text=True, check=True).stdout)
    installed = {package["name"].lower() for package in listed} - {"pip", "setuptools", "wheel"}
    assert installed <= {"coda-pacer", "grpcio", "protobuf", "typing-extensions", "typing_extensions"}, installed
    subprocess.run([str(python), "-c", "import coda_client, coda_worker, coda_client.worker"], check=True, cwd=tmp_path)
    for command in ("coda-server", "coda-sim"):  # the server extra's commands say what to install, in one line
        refused = subprocess.run([str(environment / "bin" / command)], capture_output=True, text=True, cwd=tmp_path)
        assert refused.returncode == 1, (command, refused.stderr)
        assert refused.stderr.startswith(f"{command}: the package ") and "Traceback" not in refused.stderr, refused.stderr
        assert refused.stderr.strip().endswith("pip install 'coda-pacer[server]'"), refused.stderr
    for module in ("coda_server", "coda_sim"):  # and so do their `python -m` forms
        refused = subprocess.run([str(python), "-m", module, "--help"], capture_output=True, text=True, cwd=tmp_path)
        assert refused.returncode == 1, (module, refused.stderr)
        assert refused.stderr.startswith(f"python -m {module}: the package ") and "Traceback" not in refused.stderr, \
            refused.stderr
        assert refused.stderr.strip().endswith("pip install 'coda-pacer[server]'"), refused.stderr
