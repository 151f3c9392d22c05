"""The vLLM example end to end, when a vLLM venv is at hand ($CODA_VLLM_PYTHON); skipped, saying why, when not.

CI never installs vLLM (it takes minutes and gigabytes); run `bash examples/vllm_e2e/setup.sh` and point
CODA_VLLM_PYTHON at the venv's python to run this here.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
VLLM_PYTHON = os.environ.get("CODA_VLLM_PYTHON", "")

pytestmark = pytest.mark.skipif(
    not (VLLM_PYTHON and Path(VLLM_PYTHON).exists()),
    reason="vLLM is not installed here: set CODA_VLLM_PYTHON to the python of a venv made by "
           "examples/vllm_e2e/setup.sh to run the vLLM example (CI does not install vLLM)",
)


def test_vllm_example_trains_real_batches_and_loses_nothing(tmp_path):
    model = os.environ.get("CODA_VLLM_MODEL") or str(tmp_path / "model")
    completed = subprocess.run(
        [sys.executable, str(REPO / "examples" / "vllm_e2e" / "run.py"), "--steps", "2", "--model", model,
         "--workdir", str(tmp_path / "run"), "--vllm-port", "18231"],
        capture_output=True, text=True, timeout=1500, cwd=REPO)
    assert completed.returncode == 0, completed.stdout[-3000:] + completed.stderr[-3000:]
    summary = json.loads(completed.stdout.strip().splitlines()[-1])
    assert summary["steps"] == 2 and summary["lost"] == 0
    assert summary["trajectories_trained"] >= 2 * 4 * 4  # B = 4 groups of N = 4 per step
    assert summary["tokens_generated"] >= summary["tokens_trained_unmasked"] > 0
