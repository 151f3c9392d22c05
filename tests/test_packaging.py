"""What can be checked of the container image and the package without a container engine."""
from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import tomllib
import venv
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DOCKERFILE = (REPO / "Dockerfile").read_text()
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())
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
