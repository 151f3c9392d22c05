"""End to end on CPU: a coda server, a vLLM server and two rollout workers feeding a trainer loop.

    python examples/vllm_e2e/run.py --steps 3

starts `coda-server`, vLLM's OpenAI-compatible server (from its own venv, see setup.sh) serving a tiny
random Llama, and two worker processes (coda_worker.worker.AsyncRolloutWorker over VLLMEngine). The
trainer collects real mini-batches, runs a stand-in training step over them (group-normalised
advantages and a policy-gradient loss on the sampled log-probabilities, with tokens of older weight
versions masked by the batch iterator's off-policy mask), and between steps does Reset with ABORT and Resume with a new weight version. The
last line printed is a JSON summary.

`python examples/vllm_e2e/run.py worker ...` is the worker process the example starts (not for direct use).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from contextlib import ExitStack
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
if str(REPO) not in sys.path:  # run from a checkout without installing
    sys.path.insert(0, str(REPO))

from coda_client import PacerClient  # noqa: E402
from coda_client.batches import MiniBatch  # noqa: E402
from vllm_process import (  # noqa: E402
    DEFAULT_MODEL, DEFAULT_VENV, run_worker, start_vllm, stop, stop_vllm, wait_for_vllm, worker_arguments)

log = logging.getLogger("coda_example")


# ---------------------------------------------------------------------------------------------- setup

def vllm_setup(args: argparse.Namespace) -> tuple[str, Path]:
    """The vLLM venv's python and the model directory, creating either with setup.sh when missing."""
    python = args.vllm_python or os.environ.get("CODA_VLLM_PYTHON")
    model = Path(args.model or os.environ.get("CODA_VLLM_MODEL") or DEFAULT_MODEL)
    if python and (model / "config.json").exists():
        return python, model
    if python:  # a vLLM venv is given: only the model is missing
        env = {**os.environ, "HF_HUB_OFFLINE": "1"}
        subprocess.run([python, str(HERE / "make_model.py"), str(model)], check=True, env=env)
        return python, model
    subprocess.run(["bash", str(HERE / "setup.sh"), str(DEFAULT_VENV), str(model)], check=True)
    return str(DEFAULT_VENV / "bin" / "python"), model






def start_coda(args: argparse.Namespace, logs: Path) -> tuple[subprocess.Popen, str]:
    port_file = logs / "coda-port.json"
    port_file.unlink(missing_ok=True)
    overrides = [
        "server.address=127.0.0.1:0", "server.metrics_address=", f"server.state_dir={logs / 'coda-state'}",
        f"data_source.num_prompts_per_step={args.prompts_per_step}",
        f"data_source.num_trajectories_per_prompt={args.group_size}",
        f"trainer.mini_batch_size={args.mini_batch_size}",
        f"fully_async.stale_steps={args.stale_steps}", "rollout.partial=true",
        f"rollout.continue_restored={'true' if args.continuation == 'on' else 'false'}",
    ]
    process = subprocess.Popen([sys.executable, "-m", "coda_server", "--port-file", str(port_file), *overrides],
                               stdout=open(logs / "coda-server.log", "wb"), stderr=subprocess.STDOUT, cwd=REPO,
                               start_new_session=True)
    deadline = time.monotonic() + 30
    while not port_file.exists():
        if process.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError("coda-server did not start:\n" + (logs / "coda-server.log").read_text(errors="replace"))
        time.sleep(0.05)
    return process, json.loads(port_file.read_text())["address"]


def start_worker(args: argparse.Namespace, index: int, pacer: str, engine: str, logs: Path) -> subprocess.Popen:
    command = [sys.executable, str(Path(__file__).resolve()), "worker", "--pacer", pacer, "--engine", engine,
               "--index", str(index), "--count", str(args.workers), "--prompts", str(args.prompts),
               "--max-tokens", str(args.max_tokens), "--max-groups", str(args.max_groups),
               "--stats", str(logs / f"worker-{index}.json")]
    return subprocess.Popen(command, stdout=open(logs / f"worker-{index}.log", "wb"), stderr=subprocess.STDOUT,
                            start_new_session=True)


# ---------------------------------------------------------------------------------------------- worker

def example_prompts(count: int) -> list:
    from coda_worker.worker import Prompt

    prompts = []
    for i in range(count):
        rng = random.Random(i)
        prompts.append(Prompt(f"prompt-{i:04d}", [1] + [rng.randrange(3, 512) for _ in range(rng.randrange(8, 24))],
                              epoch=0, index=i))
    return prompts


def reward_of(prompt, tokens) -> float:
    """A stand-in verifier: the share of response tokens in the lower half of the vocabulary."""
    return sum(1 for t in tokens if t < 256) / len(tokens) if tokens else 0.0


def worker_main(argv: list[str]) -> int:
    from coda_worker.engines import SamplingParams
    from coda_worker.worker import ListPromptSource

    args = worker_arguments(argv)
    run_worker(args, ListPromptSource(example_prompts(args.prompts)).shard(args.index, args.count),
               lambda engine: {"sampling": SamplingParams(max_tokens=args.max_tokens, temperature=1.0),
                               "reward": reward_of, "on_resume": engine.update_weight_version})
    return 0


# ---------------------------------------------------------------------------------------------- trainer

class Trainer:
    """A stand-in training step over real batches, with the accounting the summary reports."""

    def __init__(self, train_seconds: float) -> None:
        self.train_seconds = train_seconds
        self.trajectories = 0
        self.tokens = 0
        self.tokens_unmasked = 0
        self.continued = 0
        self.losses: list[float] = []

    def train(self, batch: MiniBatch) -> float:
        """GRPO-style: advantages normalised within each group, loss = -mean(advantage * logprob) over the
        tokens loss_mask keeps (the iterator zeroes it on off-policy tokens with mask_offpolicy)."""
        import numpy as np

        advantages = np.zeros(len(batch), dtype=np.float64)
        for group in batch.groups:
            rewards = group.reward
            advantages[group.start:group.stop] = (rewards - rewards.mean()) / (rewards.std() + 1e-6)
        per_token = np.repeat(advantages, batch.seqlens)
        kept = (batch.loss_mask == 1) & ~np.isnan(batch.logprobs)
        loss = float(-(per_token[kept] * batch.logprobs[kept]).mean()) if kept.any() else 0.0
        time.sleep(self.train_seconds)  # the optimizer step would run here
        self.trajectories += len(batch)
        self.tokens += batch.num_tokens
        self.tokens_unmasked += int(kept.sum())
        self.continued += sum(t.metadata.get("continued") == "true" for t in batch.trajectories)
        self.losses.append(loss)
        return loss


def trainer_loop(args: argparse.Namespace, address: str, engine_url: str) -> dict:
    batches_per_step = args.prompts_per_step * args.group_size // args.mini_batch_size
    trainer = Trainer(args.train_seconds)
    # What became of each prompt group, last event wins: a kept group may be continued and trained later.
    fate: dict[str, str] = {}
    steps_log = []

    def boundary(reset) -> None:
        for prompt_id in reset.kept_prompt_ids:
            fate[prompt_id] = "kept"  # the server keeps it for continuation
        for group in [*reset.restored, *reset.expired]:  # handed back (continuation off): the trainer drops them
            fate[group.prompt_id] = "dropped_by_trainer"
        for prompt_id in reset.dropped_prompt_ids:
            fate[prompt_id] = "dropped_incomplete"  # the server's choice: not assembled when the Reset ended

    with PacerClient(address) as pacer:
        for step in range(args.steps):
            started = time.monotonic()
            # One step: leased mini-batches, the next one prefetched while this one trains, none past the step.
            with pacer.batches(args.mini_batch_size, num_batches=batches_per_step, lease=300.0,
                               mask_offpolicy=args.mask_offpolicy == "on") as batches:
                for batch in batches:
                    loss = trainer.train(batch)
                    fate.update((prompt_id, "trained") for prompt_id in batch.prompt_id)
            if batches.delivered < batches_per_step:
                raise RuntimeError(f"step {step}: the batch iterator stopped after {batches.delivered} batches")
            reset = pacer.reset("abort")
            boundary(reset)
            weight_version = step + 1
            sync_weights(engine_url, weight_version)  # stand-in for loading the trained weights into vLLM
            pacer.resume(weight_version)
            steps_log.append({"step": step, "loss": round(loss, 4), "seconds": round(time.monotonic() - started, 2),
                              "restored": reset.report.partial_restored_count, "dropped": len(reset.dropped_prompt_ids),
                              "partial_ratio": round(reset.report.partial_ratio, 3)})
            log.info("step %d done: %s", step, steps_log[-1])
        # The last boundary stops generation; what the server still holds then is counted, not lost.
        final = pacer.reset("abort")
        boundary(final)
        for group in final.restored:
            fate[group.prompt_id] = "held_at_end"
        while True:
            leftover = pacer.collect_result(1, wait=0.0)
            if not leftover.groups:
                break
            fate.update((g.prompt_id, "held_at_end") for g in leftover.groups)
        state = pacer.state()
    return {"trainer": trainer, "fate": fate, "steps_log": steps_log, "state": state}


def sync_weights(engine_url: str, version: int) -> None:
    request = urllib.request.Request(f"{engine_url}/update_weight_version", method="POST",
                                     data=json.dumps({"new_version": str(version)}).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=30):
        pass


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "worker":
        return worker_main(argv[1:])
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--prompts-per-step", type=int, default=4, help="B")
    parser.add_argument("--group-size", type=int, default=4, help="N")
    parser.add_argument("--mini-batch-size", type=int, default=8, help="M (trajectories)")
    parser.add_argument("--stale-steps", type=float, default=1.0)
    # Responses long enough, and training short enough, that every step boundary cuts generation short, even
    # on an idle machine (with 160 tokens and 1.5 s, an idle 2-core machine finished every group before a Reset).
    parser.add_argument("--max-tokens", type=int, default=400)
    parser.add_argument("--max-groups", type=int, default=4, help="groups each worker generates at once")
    parser.add_argument("--prompts", type=int, default=256)
    parser.add_argument("--train-seconds", type=float, default=0.5,
                        help="the stand-in training step's time per mini-batch")
    parser.add_argument("--continuation", choices=("on", "off"), default="on",
                        help="on: the server keeps restored groups and workers continue them; off: Reset hands "
                             "them to the trainer, which drops them (the old behaviour)")
    parser.add_argument("--mask-offpolicy", choices=("on", "off"), default="on",
                        help="mask tokens generated under older weight versions (mask_offpolicy_in_partial_rollout)")
    parser.add_argument("--vllm-python", help="python of the vLLM venv (default $CODA_VLLM_PYTHON, else setup.sh)")
    parser.add_argument("--model", help="model directory (default $CODA_VLLM_MODEL or ~/.cache/coda-pacer/tiny-llama)")
    parser.add_argument("--vllm-port", type=int, default=18123)
    parser.add_argument("--workdir", help="where logs and the coda state go (default: a temporary directory)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    wall_started = time.monotonic()
    python, model = vllm_setup(args)
    logs = Path(args.workdir or tempfile.mkdtemp(prefix="coda-vllm-e2e-"))
    logs.mkdir(parents=True, exist_ok=True)
    engine_url = f"http://127.0.0.1:{args.vllm_port}"
    with ExitStack() as cleanup:
        vllm = start_vllm(python, model, args.vllm_port, logs)
        cleanup.callback(stop_vllm, vllm)
        coda, address = start_coda(args, logs)
        cleanup.callback(stop, coda)
        vllm_seconds = wait_for_vllm(vllm, engine_url, logs)
        log.info("vLLM ready in %.0f s; coda-server on %s; logs in %s", vllm_seconds, address, logs)
        workers = [start_worker(args, i, address, engine_url, logs) for i in range(args.workers)]
        for worker in workers:
            cleanup.callback(stop, worker, signal.SIGKILL, 5.0)
        result = trainer_loop(args, address, engine_url)
        for worker in workers:
            stop(worker)
        stats = [json.loads((logs / f"worker-{i}.json").read_text()) for i in range(args.workers)]
    trainer: Trainer = result["trainer"]
    fate: dict[str, str] = result["fate"]
    acknowledged = {tid: prompt for s in stats for tid, prompt in s["acknowledged"].items()}
    by_fate: dict[str, int] = {}
    for prompt_id in acknowledged.values():
        by_fate[fate.get(prompt_id, "lost")] = by_fate.get(fate.get(prompt_id, "lost"), 0) + 1
    tokens_generated = sum(s["tokens_generated"] for s in stats)
    summary = {
        "steps": args.steps,
        "continuation": args.continuation,
        "mask_offpolicy": args.mask_offpolicy,
        "trajectories_trained": trainer.trajectories,
        "tokens_generated": tokens_generated,
        "tokens_trained": trainer.tokens,
        "tokens_trained_unmasked": trainer.tokens_unmasked,
        "unmasked_fraction": round(trainer.tokens_unmasked / tokens_generated, 4) if tokens_generated else 0.0,
        # Acknowledged COMPLETED after an abort at a Reset (by the workers' count), and those of them trained.
        "aborted_then_continued": sum(s["trajectories_continued"] for s in stats),
        "aborted_then_continued_trained": trainer.continued,
        "trajectories_aborted": sum(s["trajectories_aborted"] for s in stats),
        # Acknowledged trajectories (distinct ids) by what became of their group.
        "restored_trajectories_dropped_by_trainer": by_fate.get("dropped_by_trainer", 0),
        "kept_for_continuation_at_end": by_fate.get("kept", 0),
        "held_at_end": by_fate.get("held_at_end", 0),
        "dropped_incomplete": by_fate.get("dropped_incomplete", 0),
        "lost": by_fate.get("lost", 0),
        "vllm_start_seconds": round(vllm_seconds, 1),
        "wall_seconds": round(time.monotonic() - wall_started, 1),
        "per_step": result["steps_log"],
    }
    print(json.dumps(summary))
    return 0 if summary["lost"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
