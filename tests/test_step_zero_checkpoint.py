"""docs/trainer.md's checkpointing loop, run as written against
a real server, recovers a trainer that dies before its first step-K checkpoint (its step-0 checkpoint), and the RL
example takes that checkpoint too (`--rollback-at 0`)."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from coda_client import PacerClient
from coda_worker import FakeEngine, ListPromptSource, Prompt, RolloutWorker
from server_harness import ServerProcess

ROOT = Path(__file__).resolve().parents[1]

# The names the fragment leaves to the trainer, as a trainer of no model would write them; CRASH_AT_STEP makes
# train_on raise in that step (the trainer dies there, its step's batches given back).
STAND_INS = '''
import os
from pathlib import Path

num_steps, M, K = 3, 64, 2
CRASH_AT_STEP = int(os.environ.get("CRASH_AT_STEP", "-1"))
model = {"weights": "initial"}


def load_model(path: Path) -> None:
    model["weights"] = path.read_text()


def save_model(path: Path) -> None:
    path.write_text(model["weights"])


def sync_weights(version: int) -> None:
    """Nothing to push: the FakeEngine worker generates the same under any weights."""


def checkpoint_version(directory: Path) -> int:
    return 0 if directory.name == "step-000000" else int(directory.name.split("-")[1])


def train_on(batch) -> None:
    if step == CRASH_AT_STEP:
        raise RuntimeError(f"the trainer dies in step {step}")
    model["weights"] = f"trained in step {step}"
'''


def checkpointing_loop() -> str:
    """docs/trainer.md's checkpointing loop, as a reader pastes it (its fragment line says what is the reader's)."""
    text = (ROOT / "docs" / "trainer.md").read_text(encoding="utf-8")
    section = text.split("## A checkpointing trainer loop", 1)[1]
    return re.search(r"```python notest\n(.*?)```", section, re.DOTALL).group(1)


def run_trainer(script: Path, workdir: Path, crash_at: int) -> subprocess.CompletedProcess:
    env = {**os.environ, "CRASH_AT_STEP": str(crash_at)}
    return subprocess.run([sys.executable, str(script)], cwd=workdir, env=env, capture_output=True, text=True,
                          timeout=240)


def test_the_checkpointing_loop_brings_back_a_trainer_that_died_before_its_first_step_k_checkpoint(tmp_path):
    """The loop took its first checkpoint after step K: a trainer that died in step 1 (K = 2) came back from its
    initial weights with nothing to restore, the server a step ahead, and its first Collect was refused
    (STEP_MISMATCH, "restore first"). The loop now checkpoints at step 0 too, and the restart restores it."""
    loop = checkpointing_loop()
    assert loop.splitlines()[0].startswith("# Fragment: load_model, save_model") and '"127.0.0.1:50051"' in loop
    script = tmp_path / "trainer.py"
    workdir = tmp_path / "trainer"
    workdir.mkdir()
    with ServerProcess(tmp_path) as server:
        # the reader's server is on the default address; the test's is where the harness started it
        script.write_text(STAND_INS + "\n" + loop.replace('"127.0.0.1:50051"', repr(server.address)),
                          encoding="utf-8")
        prompts = [Prompt(f"p{i}", [1, 2, 3, i], epoch=0, index=i) for i in range(5000)]
        worker = RolloutWorker(server.address, FakeEngine(seed=0), ListPromptSource(prompts), worker_id="rollout-0",
                               max_groups=64).start()
        try:
            died = run_trainer(script, workdir, crash_at=1)
            assert died.returncode != 0 and "the trainer dies in step 1" in died.stderr, died.stderr[-3000:]
            assert not (workdir / "ckpt" / "step-000002").exists()

            again = run_trainer(script, workdir, crash_at=-1)
            assert again.returncode == 0, again.stderr[-3000:]
            assert "back at step 0:" in again.stdout, again.stdout
            with PacerClient(server.address) as pacer:
                state = pacer.state()
                assert (state.step, state.restores, state.last_restore_step) == (3, 1, 0), state
                # the weight versions went on from the dead trainer's (1), never back: 2, 3, 4
                assert state.weight_version == 4 and (workdir / "ckpt" / "weight_version").read_text() == "4"
                pacer.end_job("abort", wait=30)
        finally:
            worker.join(timeout=30)


VLLM_PYTHON = os.environ.get("CODA_VLLM_PYTHON", "")


@pytest.mark.skipif(not (VLLM_PYTHON and Path(VLLM_PYTHON).exists()),
                    reason="vLLM is not installed here: set CODA_VLLM_PYTHON to the python of a venv made by "
                           "examples/rl_cpu/setup.sh to run the RL example (CI does not install vLLM)")
def test_the_rl_example_rolls_back_to_the_checkpoint_taken_before_the_first_batch(tmp_path):
    """`--rollback-at 0` was refused ("K from 1 to ..."): the example had no checkpoint before step 1, as the docs'
    loop had none. Now the trainer checkpoints its initial policy before the first batch, dies after step 2 and
    comes back from it: the pacer restored to step 0 and weight version 0, versions 1 and 2 never trained again."""
    model = os.environ.get("CODA_RL_MODEL") or str(tmp_path / "model")
    completed = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "rl_cpu" / "run.py"), "--steps", "3", "--rollback-at", "0",
         "--model", model, "--vllm-python", VLLM_PYTHON, "--server-python", sys.executable,
         "--workdir", str(tmp_path / "run"), "--vllm-port", "18237"],
        capture_output=True, text=True, timeout=1800, cwd=ROOT)
    assert completed.returncode == 0, completed.stdout[-3000:] + completed.stderr[-3000:]
    summary = json.loads(completed.stdout.strip().splitlines()[-1])
    run = summary["runs"][0]
    rollback = run["rollback"]
    assert run["steps"] == 3 and summary["lost"] == 0 and run["discarded_version_tokens_trained"] == 0
    assert rollback["checkpoint_step"] == 0 and rollback["checkpoint_version"] == 0
    assert rollback["discarded_versions"] == [1, 2]
    assert rollback["restored"]["step"] == 0 and rollback["restored"]["weight_version"] == 0
    assert summary["max_logprob_diff"] < 1e-4
