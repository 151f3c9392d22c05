"""Two builds of one version tell themselves apart: --version and the start-up line carry a digest of the source."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from coda_client.protocol import source_digest
from conftest import core_overrides
from server_harness import REPO_ROOT, ServerProcess

PACKAGES = ("coda_client", "coda_server", "coda_worker", "coda_sim")


def digest_of_tree(root: Path) -> str:
    probe = "from coda_client.protocol import source_digest; print(source_digest())"
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, cwd=root,
                          env={**os.environ, "PYTHONPATH": str(root)})
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def test_the_digest_follows_the_source_not_where_it_is_installed(tmp_path):
    """A rebuilt image under the same version tag (a fix, a rollback) printed the same `coda-pacer 0.1.0`: nothing
    in the log said which code ran. The digest is the same for a copy of the source anywhere and changes with any
    change to it."""
    copy = tmp_path / "copy"
    for package in PACKAGES:
        shutil.copytree(REPO_ROOT / package, copy / package, ignore=shutil.ignore_patterns("__pycache__"))
    assert digest_of_tree(copy) == source_digest()
    changed = copy / "coda_server" / "core" / "strategy.py"
    changed.write_text(changed.read_text() + "\n# a one-line change\n")
    assert digest_of_tree(copy) != source_digest()


def test_the_start_up_line_names_the_source_in_json_too(tmp_path):
    """(`--version` and the text line: tests/test_cli_edges.py.)"""
    with ServerProcess(tmp_path, *core_overrides(), "server.log_format=json") as server:
        assert server.terminate() == 0
        lines = [json.loads(line) for line in server.log().splitlines() if line.startswith("{")]
    [version] = [line for line in lines if line.get("event") == "version"]
    assert version["source"] == source_digest() and source_digest() in version["msg"], version
