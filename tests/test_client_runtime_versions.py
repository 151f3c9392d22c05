"""An engine's environment may pin grpcio or protobuf older than the versions coda_client's modules were generated
with: `import coda_client` then fails in one line naming coda-pacer, what it needs and what is installed, not in
grpc's or protobuf's words (which name neither the package nor a fix a user can apply)."""
from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent

OLD_RUNTIMES = {
    "grpcio": "import grpc\ngrpc.__version__ = '1.71.0'\n",
    "protobuf": textwrap.dedent("""
        from google.protobuf import runtime_version

        validate = runtime_version.ValidateProtobufRuntimeVersion

        def too_old(domain, major, minor, patch, suffix, location):
            if location.startswith("coda/"):  # protobuf's own modules match their runtime
                raise runtime_version.VersionError("Detected mismatched Protobuf Gencode/Runtime major versions")
            validate(domain, major, minor, patch, suffix, location)

        runtime_version.ValidateProtobufRuntimeVersion = too_old
        """),
}


@pytest.mark.parametrize("runtime", sorted(OLD_RUNTIMES))
def test_an_older_runtime_fails_the_import_in_one_line_naming_what_coda_pacer_needs(tmp_path, runtime):
    (tmp_path / "sitecustomize.py").write_text(OLD_RUNTIMES[runtime])
    run = subprocess.run([sys.executable, "-c", "from coda_client import PacerClient"], capture_output=True,
                         text=True, cwd=tmp_path, env={"PYTHONPATH": f"{tmp_path}:{REPO_ROOT}", "PATH": "/usr/bin"})
    last = run.stderr.strip().splitlines()[-1]
    assert run.returncode == 1 and last.startswith("ImportError: coda-pacer's client needs grpcio >= "), run.stderr
    from coda_client._proto import GRPCIO_GENERATED, PROTOBUF_GENERATED
    assert f"'grpcio>={GRPCIO_GENERATED}'" in last and f"'protobuf>={PROTOBUF_GENERATED},<" in last, last
    assert "pip install" in last and "installed: grpcio " in last


def test_the_generating_versions_are_those_pyproject_asks_for_at_least():
    from coda_client._proto import GRPCIO_GENERATED, PROTOBUF_GENERATED
    from conftest import read_pyproject
    dependencies = read_pyproject()["project"]["dependencies"]
    assert f"grpcio>={GRPCIO_GENERATED}" in dependencies and any(
        d.startswith(f"protobuf>={PROTOBUF_GENERATED},") for d in dependencies), dependencies
