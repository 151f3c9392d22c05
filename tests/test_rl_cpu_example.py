"""The RL-on-CPU example end to end (vLLM generates, PyTorch trains, weights sync every step), when a vLLM venv is
at hand ($CODA_VLLM_PYTHON); skipped, saying why, when not.

CI never installs vLLM (it takes minutes and gigabytes); run `bash examples/rl_cpu/setup.sh` and point
CODA_VLLM_PYTHON at the venv's python to run this here. The run is short (a few steps, not to the target
reward): what it checks is that nothing is lost, that boundaries cut generation and the cut trajectories are
continued, and that every trained token's engine log-probability is the trainer's under the token's version.
"""
from __future__ import annotations

import importlib.util
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
           "examples/rl_cpu/setup.sh to run the RL example (CI does not install vLLM)",
)


def test_rl_cpu_example_learns_through_the_service_with_consistent_logprobs(tmp_path):
    model = os.environ.get("CODA_RL_MODEL") or str(tmp_path / "model")
    completed = subprocess.run(
        # A boundary must find groups generating, early enough that their continuation is trained. With C = 2B
        # (stale steps 1) the engine, faster than a training step here, had the window full of finished groups
        # at most boundaries (0 running; only the last cut any, and whether one was continued before the run
        # stopped was a race; with stale steps 3, C = 4B, the first boundary found 16 running but the window
        # full in one run of two). With no-window and stale steps 7, C = 8B = 64: the first boundaries come long
        # before the engine has finished the 72 groups the window then allows, so the workers' 16 slots are busy
        # and the cut trajectories are continued in the next steps. latency-aware (the
        # default) learns a shallow depth while the first steps' responses are short and may let the window
        # drain (its 24-step runs cut hundreds, docs/rl-cpu.md).
        [sys.executable, str(REPO / "examples" / "rl_cpu" / "run.py"), "--steps", "4", "--model", model,
         "--strategy", "no-window", "--stale-steps", "7", "--vllm-python", VLLM_PYTHON,
         "--server-python", sys.executable,
         "--workdir", str(tmp_path / "run"), "--vllm-port", "18232"],
        capture_output=True, text=True, timeout=1800, cwd=REPO)
    assert completed.returncode == 0, completed.stdout[-3000:] + completed.stderr[-3000:]
    summary = json.loads(completed.stdout.strip().splitlines()[-1])
    run = summary["runs"][0]
    assert run["steps"] == 4 and summary["lost"] == 0
    assert summary["max_logprob_diff"] < 1e-4
    assert summary["trajectories_aborted"] > 0 and summary["aborted_then_continued"] > 0
    assert sum(summary["staleness_histogram"].values()) == run["tokens_trained"] > 0
    assert 0.0 <= summary["reward_first"] <= 1.0
    # The curve is drawn in the server's python (this one) when it has matplotlib (the plot extra), else not.
    if importlib.util.find_spec("matplotlib") is not None:
        assert Path(summary["curve_png"]).is_file()
    else:
        assert summary["curve_png"] is None
    # Where each step's seconds went: the trainer's update, the boundary (Reset, weight sync, Resume), the rest
    # (waiting for a batch), and the engine's generation rate; they add up to the step.
    curve = json.loads((tmp_path / "run" / "curves.json").read_text())[0]["curve"]
    assert len(curve) == 4
    for step in curve:
        assert {"train", "reset", "sync", "resume", "other"} <= set(step["phases"])
        assert abs(sum(step["phases"].values()) - step["step_seconds"]) < 0.05 and step["engine_tokens_per_second"] >= 0
    # Not every step: a step may see no tokens counted (the window full while the trainer trains, or vLLM's counter
    # not moved yet; seen on a busy machine: a step of 1.9 s, all training, in which the count did not move).
    assert any(step["engine_tokens_per_second"] > 0 for step in curve), curve
    assert run["seconds_per_step_by_phase"]["step"] > 0


def test_rl_cpu_example_rolls_back_to_a_checkpoint_and_trains_nothing_of_a_discarded_version(tmp_path):
    model = os.environ.get("CODA_RL_MODEL") or str(tmp_path / "model")
    completed = subprocess.run(
        [sys.executable, str(REPO / "examples" / "rl_cpu" / "run.py"), "--steps", "5", "--rollback-at", "2",
         "--model", model, "--vllm-python", VLLM_PYTHON, "--server-python", sys.executable,
         "--workdir", str(tmp_path / "run"), "--vllm-port", "18233"],
        capture_output=True, text=True, timeout=1800, cwd=REPO)
    assert completed.returncode == 0, completed.stdout[-3000:] + completed.stderr[-3000:]
    summary = json.loads(completed.stdout.strip().splitlines()[-1])
    run = summary["runs"][0]
    rollback = run["rollback"]
    assert run["steps"] == 5 and summary["lost"] == 0 and run["discarded_version_tokens_trained"] == 0
    assert rollback["checkpoint_step"] == 2 and rollback["discarded_versions"] == [3, 4]
    assert rollback["restored"]["step"] == 2 and rollback["restored"]["weight_version"] == 2
    assert rollback["restored"]["discarded_groups"] > 0 and rollback["restored"]["reoffered_prompts"] > 0
    assert summary["max_logprob_diff"] < 1e-4
