"""A policy learns through the service: vLLM (CPU) generates, PyTorch trains, weights sync every step.

    python examples/rl_cpu/run.py                 # fully-async through coda-server, one seed
    python examples/rl_cpu/run.py --compare       # the synchronous loop and three strategies, 3 seeds each
    python examples/rl_cpu/run.py --kill-server-at 5
    python examples/rl_cpu/run.py --rollback-at 5   # the trainer dies after step 7, restarts from step 5's checkpoint
    python examples/rl_cpu/run.py --rollback-at 0   # ... after step 2, from the checkpoint taken before the first batch

starts, on 127.0.0.1, vLLM's OpenAI-compatible server (CPU build, pinned to core 0) serving the example's tiny
Llama, and per run coda-server (durable state in the run's directory), worker processes
(`coda_worker.AsyncRolloutWorker` over `VLLMEngine`) and the trainer in this process (PyTorch on core 1, one
thread): GRPO-style updates on `batches()` mini-batches; at every step boundary Reset(ABORT), the new weights
saved and synced into every engine once (`VLLMEngine.sync_weights`), Resume with the new version. The last
line printed is a JSON summary; a reward curve is written as PNG. Exit code 1 when a trajectory was lost or
an engine log-probability differs from the trainer's under the token's weight version by 1e-4 or more.

The trainer and the workers need torch and the client: they run in the vLLM venv (setup.sh installs the
client there); this script re-runs itself under that venv's python when started from another one, and runs
coda-server with the python it was started from (`--server-python`). `run.py worker ...` is the worker
process and `run.py plot ...` draws the curve (with matplotlib, in the server's python); neither is for
direct use.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import functools
import itertools
import json
import logging
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
for path in (str(HERE.parent / "vllm_e2e"), str(HERE), str(REPO)):  # the checkout's client, the examples' modules
    if path not in sys.path:
        sys.path.insert(0, path)

import task  # noqa: E402
from vllm_process import DEFAULT_VENV, run_worker, start_vllm, stop, stop_vllm, wait_for_vllm, worker_arguments  # noqa: E402

log = logging.getLogger("rl_cpu")
ENGINE_CORE, TRAINER_CORE = 0, 1
# The example's model (setup.sh writes it): hidden size 256, 4 layers, 2.9M parameters, so that a step's
# training costs about what its generation does, as with large models on GPUs (docs/rl-cpu.md).
DEFAULT_MODEL = Path.home() / ".cache" / "coda-pacer" / "rl-llama"
ASYNC_STRATEGIES = ("no-window", "windowed-fifo", "latency-aware")
RESET_WAIT_SECONDS = 60.0
# What may become of a group whose trajectories the server acknowledged ("kept" at a boundary is not final).
ACCOUNTED_FATES = ("trained", "held_at_end", "handed_back", "dropped_incomplete", "rolled_back")


# ---------------------------------------------------------------------------------------------- processes

def all_cores() -> set[int]:
    return set(range(os.cpu_count() or 1))


def unpinned() -> None:
    """A child's affinity: every core (the trainer pins itself, and children would inherit that)."""
    os.sched_setaffinity(0, all_cores())


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]






def start_coda(args: argparse.Namespace, config: dict, run_dir: Path, port: int) -> subprocess.Popen:
    """coda-server on 127.0.0.1:port with its state in run_dir/coda-state (a restart finds it there)."""
    overrides = [
        f"server.address=127.0.0.1:{port}", "server.metrics_address=", f"server.state_dir={run_dir / 'coda-state'}",
        f"data_source.num_prompts_per_step={args.prompts_per_step}",
        f"data_source.num_trajectories_per_prompt={args.group_size}",
        f"trainer.mini_batch_size={args.mini_batch_size}",
        f"fully_async.sliding_window={config['strategy']}", f"fully_async.stale_steps={config['stale_steps']}",
        "rollout.partial=true", "rollout.continue_restored=true",
    ]
    process = subprocess.Popen([args.server_python, "-m", "coda_server", *overrides],
                               stdout=open(run_dir / "coda-server.log", "ab"), stderr=subprocess.STDOUT, cwd=REPO,
                               start_new_session=True, preexec_fn=unpinned,
                               env={**os.environ, "PYTHONPATH": str(REPO)})
    deadline = time.monotonic() + 60
    while True:
        if process.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError("coda-server did not start:\n" + (run_dir / "coda-server.log").read_text(errors="replace"))
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return process
        except OSError:
            time.sleep(0.05)


def worker_prompts(args: argparse.Namespace) -> int:
    """How many prompts the workers' source holds: task.prompt_id(0) up to this, epoch 0, index i."""
    return args.prompts_per_step * (args.steps + 4)


def start_worker(args: argparse.Namespace, index: int, pacer: str, engine: str, seed: int, run_dir: Path
                 ) -> subprocess.Popen:
    command = [sys.executable, str(Path(__file__).resolve()), "worker", "--pacer", pacer, "--engine", engine,
               "--index", str(index), "--count", str(args.workers), "--seed", str(seed),
               "--prompts", str(worker_prompts(args)), "--max-tokens", str(args.max_tokens),
               "--max-groups", str(args.max_groups), "--stats", str(run_dir / f"worker-{index}.json")]
    return subprocess.Popen(command, stdout=open(run_dir / f"worker-{index}.log", "wb"), stderr=subprocess.STDOUT,
                            start_new_session=True, preexec_fn=unpinned)


# ---------------------------------------------------------------------------------------------- worker

def sampling(max_tokens: int):
    from coda_worker.engines import SamplingParams

    return SamplingParams(max_tokens=max_tokens, temperature=1.0, stop_token_ids=task.STOP_TOKENS)


def worker_main(argv: list[str]) -> int:
    from coda_worker import ListPromptSource, Prompt

    args = worker_arguments(argv, extra_integers=("--seed",))
    prompts = [Prompt(task.prompt_id(i), task.prompt_tokens(args.seed, i), epoch=0, index=i,
                      max_tokens=task.response_budget(args.seed, i, args.max_tokens))
               for i in range(args.prompts)]
    run_worker(args, ListPromptSource(prompts).shard(args.index, args.count),
               lambda engine: {"sampling": sampling(args.max_tokens), "engine_retries": 3,
                               "reward": lambda prompt, tokens: task.reward(tokens)})
    return 0


# ---------------------------------------------------------------------------------------------- trainer

class Ledger:
    """What became of every prompt group (last event wins), for `lost`; and the per-step figures."""

    def __init__(self) -> None:
        self.fate: dict[str, str] = {}
        self.steps: list[dict] = []
        self.staleness: Counter = Counter()
        self.trained_tokens = 0
        self.continued_trained = 0
        self.filtered_groups = 0  # dropped by the server's filter (a FAILED trajectory) or a Reset: counted there
        self.started = time.monotonic()
        self.discarded_versions: set[int] = set()  # --rollback-at: the versions the rollback threw away
        self.discarded_version_tokens_trained = 0  # tokens of those trained after it (must stay 0)
        # Where a step's seconds go: `clocks()` gives each phase's seconds so far (a step records the growth);
        # `engine_tokens()` the engines' own count of generated tokens; the trained responses' lengths.
        self.clocks: Callable[[], dict[str, float]] = dict
        self.engine_tokens: Callable[[], float] = lambda: 0.0
        self._at_last_step: tuple[float, dict[str, float], float] | None = None
        self._lengths: list[int] = []
        self._ran_out = 0  # trained responses that ran to their budget (no stop token)

    def trained(self, rollouts, prompt_ids, report) -> None:
        if self.discarded_versions:
            self.discarded_version_tokens_trained += sum(
                v in self.discarded_versions for versions in rollouts.token_versions for v in versions)
        self.fate.update((p, "trained") for p in prompt_ids)
        self.staleness.update(report.staleness)
        self.trained_tokens += report.tokens
        self.continued_trained += sum(rollouts.continued)
        self._lengths += [len(r) for r in rollouts.responses]
        self._ran_out += sum(task.ran_to_budget(r) for r in rollouts.responses)

    def boundary(self, reset) -> None:
        for prompt_id in reset.kept_prompt_ids:
            self.fate[prompt_id] = "kept"
        for group in [*reset.restored, *reset.expired]:
            self.fate[group.prompt_id] = "handed_back"
        for prompt_id in reset.dropped_prompt_ids:
            self.fate[prompt_id] = "dropped_incomplete"

    def memory(self) -> dict:
        """What the trainer knows of its run, saved with its checkpoint (a restarted trainer has only that)."""
        return {"fate": dict(self.fate), "steps": list(self.steps), "staleness": Counter(self.staleness),
                "trained_tokens": self.trained_tokens, "continued_trained": self.continued_trained}

    def recall(self, memory: dict) -> None:
        """Back to what `memory()` returned (read from JSON: the staleness histogram's keys come back as text)."""
        self.fate, self.steps = dict(memory["fate"]), list(memory["steps"])
        self.staleness = Counter({int(k): v for k, v in memory["staleness"].items()})
        self.trained_tokens, self.continued_trained = memory["trained_tokens"], memory["continued_trained"]

    def start(self) -> None:
        """The run's clock starts (and the first step's)."""
        self.started = time.monotonic()
        self._at_last_step = (self.started, self.clocks(), self.engine_tokens())

    def step_done(self, step: int, report) -> None:
        now, clocks, tokens = time.monotonic(), self.clocks(), self.engine_tokens()
        then, then_clocks, then_tokens = self._at_last_step or (self.started, {}, 0.0)
        seconds = now - then
        phases = {name: value - then_clocks.get(name, 0.0) for name, value in clocks.items()}
        phases["other"] = seconds - sum(phases.values())  # fully-async: mostly the trainer waiting for a batch
        lengths, self._lengths = sorted(self._lengths), []
        ran_out, self._ran_out = self._ran_out, 0
        self._at_last_step = (now, clocks, tokens)
        self.steps.append({
            "step": step + 1, "seconds": round(now - self.started, 3), "reward": round(report.reward, 4),
            "loss": round(report.loss, 4), "tokens": report.tokens, "step_seconds": round(seconds, 3),
            "phases": {name: round(value, 3) for name, value in phases.items()},
            "engine_tokens_per_second": round((tokens - then_tokens) / seconds, 1) if seconds > 0 else None,
            "length_mean": round(statistics.mean(lengths), 1) if lengths else 0.0,
            "length_max": lengths[-1] if lengths else 0,
            "at_budget": round(ran_out / len(lengths), 3) if lengths else 0.0})
        log.info("step %d: reward %.3f, %.1f s (%s; engine %.0f tokens/s), length mean %.1f max %d, "
                 "%.2f at budget", step + 1, report.reward, self.steps[-1]["seconds"],
                 ", ".join(f"{k} {v:.2f}" for k, v in phases.items()), self.steps[-1]["engine_tokens_per_second"] or 0,
                 self.steps[-1]["length_mean"], self.steps[-1]["length_max"], self.steps[-1]["at_budget"])


class TimedPacer:
    """A PacerClient whose Reset and Resume calls are timed (the step boundary's share of a step)."""

    def __init__(self, pacer) -> None:
        self._pacer = pacer
        self.seconds = {"reset": 0.0, "resume": 0.0}

    def __getattr__(self, name: str):
        return getattr(self._pacer, name)

    def _timed(self, phase: str, call, *args, **kwargs):
        started = time.monotonic()
        try:
            return call(*args, **kwargs)
        finally:
            self.seconds[phase] += time.monotonic() - started

    def reset(self, *args, **kwargs):
        return self._timed("reset", self._pacer.reset, *args, **kwargs)

    def resume(self, *args, **kwargs):
        return self._timed("resume", self._pacer.resume, *args, **kwargs)


class EngineSet:
    """The run's inference engines, driven from the trainer's (blocking) code on one private event loop."""

    def __init__(self, urls: list[str]) -> None:
        from coda_worker.engines import VLLMEngine

        self._loop = asyncio.new_event_loop()
        self.engines = [VLLMEngine(url, model="tiny") for url in urls]
        self.sync_seconds = self.generate_seconds = 0.0

    def sync_weights(self, weights: Path, version: int) -> None:
        """Loads the weights into every engine once (they refuse while requests generate)."""
        started = time.monotonic()
        for engine in self.engines:
            self._loop.run_until_complete(engine.sync_weights(str(weights), version, drain_timeout=60.0))
        self.sync_seconds += time.monotonic() - started

    def generate(self, requests: list) -> list:
        """Runs the requests (spread over the engines) and waits for all of them; a failed call is retried
        once (an idle keep-alive connection the engine closed fails the next request sent on it)."""
        from coda_worker.engines import EngineError

        async def one(n: int, request) -> object:
            try:
                return await self.engines[n % len(self.engines)].generate(request)
            except EngineError:
                retried = dataclasses.replace(request, request_id=request.request_id + "-retry")
                return await self.engines[n % len(self.engines)].generate(retried)

        async def all_of() -> list:
            return await asyncio.gather(*(one(n, r) for n, r in enumerate(requests)))
        started = time.monotonic()
        try:
            return self._loop.run_until_complete(all_of())
        finally:
            self.generate_seconds += time.monotonic() - started

    def generated_tokens(self) -> float:
        """The engines' own count of generated tokens so far (vLLM's /metrics), for tokens/s per step."""
        import urllib.request

        total = 0.0
        for engine in self.engines:
            with urllib.request.urlopen(f"{engine.base_url}/metrics", timeout=5) as answer:
                for line in answer.read().decode().splitlines():
                    if line.startswith("vllm:generation_tokens_total"):
                        total += float(line.rsplit(" ", 1)[1])
        return total

    def close(self) -> None:
        for engine in self.engines:
            self._loop.run_until_complete(engine.aclose())
        self._loop.close()


def train_fully_async(pacer, engines, policy, prompts, ledger, args, *, on_step=None, after_step=None, start=0,
                      versions=None) -> None:
    """The trainer's loop with coda-server pacing the rollout workers (docs/trainer.md shows it).

    Each step trains on `batches()` mini-batches (whole groups, tokens of older weight versions masked out
    of the loss), then crosses the step boundary: Reset(ABORT) pauses generation (the workers abort their
    engine requests and submit the partial trajectories, which the server keeps and re-offers), the new
    weights go into every engine once, and Resume opens dispatch at the new version. Every Collect states the
    trainer's step (`batches(step=...)`), so a trainer restarted from a checkpoint without restoring the pacer
    is refused. `start` and `versions` (the weight versions to publish, in order): where a restarted trainer
    goes on from; `after_step(steps_done, version)`: --rollback-at's checkpoint, and the trainer's death.
    """
    from policy import Rollouts

    versions = versions if versions is not None else itertools.count(1)
    if after_step is not None and start == 0:
        after_step(0, 0)  # --rollback-at 0: the checkpoint of the initial policy, before the first batch
    for step in range(start, args.steps):
        with pacer.batches(args.mini_batch_size, num_batches=args.batches_per_step, lease=300.0,
                           mask_offpolicy=True, step=step) as batches:
            for batch in batches:
                rollouts = Rollouts.from_minibatch(batch, prompts.tokens)
                report = policy.train(rollouts)
                ledger.trained(rollouts, batch.prompt_id, report)
        if on_step is not None:
            on_step(step)  # --kill-server-at: the server is killed and restarted while workers generate
        ledger.boundary(pacer.reset("abort", wait=RESET_WAIT_SECONDS))
        version = next(versions)
        weights = policy.publish(version, args.weights_dir)
        engines.sync_weights(weights, version)  # into every engine once, however many workers share it
        pacer.resume(version)
        ledger.step_done(step, report)
        if after_step is not None:
            after_step(step + 1, version)  # --rollback-at: the trainer's checkpoint, or its death


class TrainerDied(Exception):
    """--rollback-at: the trainer dies after step K + 2 (raised out of its loop)."""


class Rollback:
    """--rollback-at K: after step K (K = 0: before the first batch, with the initial policy) the trainer saves its
    checkpoint (policy, what it knows of the run) and the pacer's beside it; after step K + 2 it dies. `restart()`
    is the trainer coming back from that checkpoint: generation paused, the engines given step K's weights back,
    the pacer restored, the loop going on from step K with new weight versions (the two thrown away are never
    used again)."""

    def __init__(self, at: int, directory: Path) -> None:
        self.at, self.directory = at, directory
        self.figures: dict = {}
        self._version = 0

    def after_step(self, pacer, policy, ledger, steps_done: int, version: int) -> None:
        from safetensors.torch import save_file

        if "restored" in self.figures:
            return
        if steps_done == self.at:
            self.directory.mkdir(parents=True, exist_ok=True)
            policy.save(self.directory / "policy.pt")
            save_file(policy.snapshots[version], str(self.directory / "model.safetensors"))
            (self.directory / "ledger.json").write_text(json.dumps(ledger.memory()))
            taken = pacer.checkpoint(self.directory / "pacer.ckpt")
            self._version = version
            self.figures.update(checkpoint_step=steps_done, checkpoint_version=version,
                                checkpoint_bytes=len(taken.blob), checkpoint_buffered_groups=taken.buffered_groups,
                                checkpoint_in_flight_prompts=taken.in_flight_prompts)
        elif steps_done == self.at + 2:
            self.figures["discarded_versions"] = list(range(self._version + 1, version + 1))
            raise TrainerDied(f"the trainer dies after step {steps_done}")

    def restart(self, pacer, engines, policy, ledger) -> int:
        """The trainer back from its step-K checkpoint; returns the step it goes on from."""
        log.info("the trainer restarts from its step-%d checkpoint", self.at)
        policy.load(self.directory / "policy.pt")
        ledger.recall(json.loads((self.directory / "ledger.json").read_text()))
        ledger.discarded_versions = set(self.figures["discarded_versions"])
        ledger.boundary(pacer.reset("abort", wait=RESET_WAIT_SECONDS))  # generation pauses ...
        engines.sync_weights(self.directory, self._version)  # ... the engines get step K's weights back ...
        restored = pacer.restore(self.directory / "pacer.ckpt")  # ... and the pacer goes back with them
        log.info("pacer restored: %s", {k: v for k, v in dataclasses.asdict(restored).items()
                                          if k != "discarded_prompt_ids"})
        for prompt_id in restored.discarded_prompt_ids:  # counted by the Restore, offered again: not lost
            if ledger.fate.get(prompt_id) in (None, "kept"):  # "kept" at a boundary is not final
                ledger.fate[prompt_id] = "rolled_back"
        self.figures["restored"] = {name: getattr(restored, name) for name in (
            "step", "weight_version", "discarded_groups", "discarded_trajectories", "discarded_newer_trajectories",
            "dropped_running", "reinstated_groups", "kept_groups", "reoffered_prompts")}
        return restored.step


def rolled_back_undispatched(cursor, ledger, prompts: int) -> None:
    """The prompts the rollback took back and no worker dispatched again by the end, as the server's prompt cursor
    tells: admitted after the checkpoint (their groups trained by the trainer that died, whose fates the restarted
    trainer never knew, or discarded by the Restore), they are offered again, so the cursor no longer lists them
    as admitted. Rolled back, not lost. A group the server lost would still be listed as admitted."""
    for index in range(prompts):
        prompt_id = task.prompt_id(index)
        if ledger.fate.get(prompt_id) in (None, "kept") and not cursor.admitted(prompt_id, 0, 0, index):
            ledger.fate[prompt_id] = "rolled_back"


def train_synchronous(engines, policy, prompts, ledger, args) -> None:
    """The synchronous loop (the reference's colocate row): generate B groups, wait for all, train, sync."""
    from coda_worker.engines import GenerationRequest

    from policy import Rollouts

    params = sampling(args.max_tokens)

    def generate(step: int) -> Rollouts:
        ids = range(step * args.prompts_per_step, (step + 1) * args.prompts_per_step)
        requests = [GenerationRequest(f"sync-{step}-{i}-{k}", prompts.tokens(task.prompt_id(i)),
                                      task.response_budget(prompts.seed, i, args.max_tokens), params)
                    for i in ids for k in range(args.group_size)]
        answers = engines.generate(requests)
        return Rollouts(prompts=[list(r.input_ids) for r in requests],
                        responses=[a.token_ids for a in answers], engine_logprobs=[a.logprobs for a in answers],
                        token_versions=[[policy.version] * len(a.token_ids) for a in answers],
                        loss_mask=[[1] * len(a.token_ids) for a in answers],
                        rewards=[task.reward(a.token_ids) for a in answers],
                        groups=[(g * args.group_size, (g + 1) * args.group_size)
                                for g in range(args.prompts_per_step)],
                        continued=[False] * len(answers))

    for step in range(args.steps):
        rollouts = generate(step)
        report = policy.train(rollouts)
        ledger.trained(rollouts, [], report)
        weights = policy.publish(step + 1, args.weights_dir)
        engines.sync_weights(weights, step + 1)
        ledger.step_done(step, report)


class PromptBook:
    """The prompts of a run, by id (the workers derive the same ones from the seed)."""

    def __init__(self, seed: int) -> None:
        self.seed = seed
        self._cache: dict[str, list[int]] = {}

    def tokens(self, prompt_id: str) -> list[int]:
        if prompt_id not in self._cache:
            self._cache[prompt_id] = task.prompt_tokens(self.seed, int(prompt_id.rsplit("-", 1)[1]))
        return self._cache[prompt_id]


# ---------------------------------------------------------------------------------------------- one run

def reset_engines(engine_urls: list[str], model: Path) -> None:
    """Every engine back at the initial weights, as weight version 0."""
    from coda_worker.engines import VLLMEngine

    async def go() -> None:
        for url in engine_urls:
            async with VLLMEngine(url, model="tiny") as engine:
                await engine.sync_weights(str(model), 0, drain_timeout=60.0)

    asyncio.run(go())


def run_one(args: argparse.Namespace, config: dict, seed: int, engine_urls: list[str], model: Path,
            workdir: Path) -> dict:
    """One configuration, one seed: a fresh policy, engines at version 0, a fresh coda-server (async)."""
    from coda_client import PacerClient

    from policy import Policy

    name = f"{config['name']}-seed{seed}"
    run_dir = workdir / name
    run_dir.mkdir(parents=True, exist_ok=True)
    args.weights_dir = run_dir / "weights"
    reset_engines(engine_urls, model)
    policy = Policy(model, lr=args.lr, clip=args.clip, seed=seed, loss=args.loss, tis_cap=args.tis_cap)
    prompts = PromptBook(seed)
    ledger = Ledger()
    engines = EngineSet(engine_urls)
    timed: dict[str, float] = {}  # the pacer's Reset and Resume seconds (fully-async)
    ledger.clocks = lambda: {"generate": engines.generate_seconds, "train": policy.train_seconds,
                             "sync": engines.sync_seconds, **timed}
    ledger.engine_tokens = engines.generated_tokens
    cleanup_engines = engines.close
    log.info("run %s", name)
    stats: list[dict] = []
    killed_at, rollback = None, None
    with ExitStack() as cleanup:
        if config["kind"] == "sync":
            ledger.start()
            train_synchronous(engines, policy, prompts, ledger, args)
        else:
            port = free_port()
            address = f"127.0.0.1:{port}"
            coda = [start_coda(args, config, run_dir, port)]
            cleanup.callback(lambda: stop(coda[0]))
            workers = [start_worker(args, i, address, engine_urls[i % len(engine_urls)], seed, run_dir)
                       for i in range(args.workers)]
            for worker in workers:
                cleanup.callback(stop, worker, signal.SIGKILL, 5.0)

            with PacerClient(address) as client:
                pacer = TimedPacer(client)
                timed = pacer.seconds
                def maybe_kill(step: int) -> None:
                    nonlocal killed_at
                    if args.kill_server_at is None or step + 1 != args.kill_server_at:
                        return
                    time.sleep(0.2)  # the workers are generating the next step's groups
                    log.info("step %d: SIGKILL to coda-server (pid %d), restarting it on %s", step + 1, coda[0].pid,
                             run_dir / "coda-state")
                    stop(coda[0], signal.SIGKILL)
                    coda[0] = start_coda(args, config, run_dir, port)
                    killed_at = step + 1
                    wait_until_answering(pacer)


                ledger.start()
                versions = itertools.count(1)  # never back, even after a rollback
                after_step = None
                if args.rollback_at is not None:
                    rollback = Rollback(args.rollback_at, run_dir / "checkpoint")
                    after_step = functools.partial(rollback.after_step, pacer, policy, ledger)
                try:
                    train_fully_async(pacer, engines, policy, prompts, ledger, args, on_step=maybe_kill,
                                      after_step=after_step, versions=versions)
                except TrainerDied:
                    start = rollback.restart(pacer, engines, policy, ledger)
                    train_fully_async(pacer, engines, policy, prompts, ledger, args, on_step=maybe_kill,
                                      after_step=after_step, start=start, versions=versions)
                wall = time.monotonic() - ledger.started
                # The end of the job: the workers abort what they hold, submit it and stop; what the server
                # still holds then is named in the report, counted, not lost.
                ended = pacer.end_job("abort", wait=RESET_WAIT_SECONDS)
                ledger.filtered_groups = ended.state.filtered + ended.state.dropped
                for ids in (ended.buffered_prompt_ids, ended.held_prompt_ids, ended.in_flight_prompt_ids,
                            ended.kept_prompt_ids, ended.expired_prompt_ids, ended.quarantined_prompt_ids):
                    ledger.fate.update((p, "held_at_end") for p in ids)
                if args.rollback_at is not None:
                    rolled_back_undispatched(pacer.prompt_cursor(), ledger, worker_prompts(args))
            for worker in workers:
                try:
                    worker.wait(60)
                except subprocess.TimeoutExpired:
                    stop(worker)
            stats = [json.loads((run_dir / f"worker-{i}.json").read_text()) for i in range(args.workers)]
        wall = time.monotonic() - ledger.started
    cleanup_engines()
    audit_seconds = policy.audit()  # after the timed run: the check of tokens of older versions
    result = result_of(args, config, seed, ledger, stats, wall, killed_at)
    result.update(max_logprob_diff=policy.max_logprob_diff, max_logprob_diff_continued=policy.max_logprob_diff_continued,
                  max_logprob_diff_by_staleness={str(k): v for k, v in sorted(policy.diff_by_staleness.items())},
                  tokens_checked=policy.checked_tokens, train_seconds=round(policy.train_seconds, 2),
                  sync_seconds=round(engines.sync_seconds, 2), generate_seconds=round(engines.generate_seconds, 2),
                  audit_seconds=round(audit_seconds, 2))
    if args.rollback_at is not None:
        result.update(rollback=rollback.figures if rollback else None,
                      discarded_version_tokens_trained=ledger.discarded_version_tokens_trained)
    return result


def wait_until_answering(pacer, timeout: float = 120.0) -> None:
    """Polls GetState until the restarted server answers (its channel reconnects with backoff)."""
    from coda_client.errors import UnavailableError

    deadline = time.monotonic() + timeout
    while True:
        try:
            pacer.state()
            return
        except UnavailableError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def phase_means(steps: list[dict]) -> dict:
    """A run's step on average: seconds per phase, the engines' tokens/s; the trained responses' lengths and the
    share that ran to the budget over the first and the last five steps (the tail, and whether it lasts)."""
    if not steps:
        return {}
    names = dict.fromkeys(name for s in steps for name in s["phases"])
    means: dict = {name: round(statistics.mean(s["phases"].get(name, 0.0) for s in steps), 3) for name in names}
    means["step"] = round(statistics.mean(s["step_seconds"] for s in steps), 3)
    means["engine_tokens_per_second"] = round(statistics.mean(s["engine_tokens_per_second"] or 0 for s in steps))
    for key in ("length_mean", "at_budget"):
        means[f"{key}_first_5"] = round(statistics.mean(s[key] for s in steps[:5]), 3)
        means[f"{key}_last_5"] = round(statistics.mean(s[key] for s in steps[-5:]), 3)
    return means


def result_of(args, config, seed, ledger: Ledger, stats: list[dict], wall: float, killed_at) -> dict:
    acknowledged = {tid: prompt for s in stats for tid, prompt in s["acknowledged"].items()}
    by_fate = Counter(ledger.fate.get(prompt, "lost") for prompt in acknowledged.values())
    # Groups the server dropped (its status filter drops a group holding a FAILED trajectory) are counted by
    # the server, not named: that many groups without a fate are accounted for.
    unaccounted = sum(1 for p in acknowledged.values() if ledger.fate.get(p, "lost") not in ACCOUNTED_FATES)
    rewards = [s["reward"] for s in ledger.steps]
    reached = next((s for s in ledger.steps if s["reward"] >= args.target), None)
    generated = sum(s["tokens_generated"] for s in stats) if stats else ledger.trained_tokens
    tail = rewards[-3:]
    return {
        "config": config["name"], "seed": seed, "steps": len(ledger.steps),
        "reward_first": rewards[0] if rewards else None,
        "reward_final": round(sum(tail) / len(tail), 4) if tail else None,
        "steps_to_target": reached["step"] if reached else None,
        "seconds_to_target": reached["seconds"] if reached else None,
        "wall_seconds": round(wall, 2),
        # Acknowledged by the server, yet neither trained, nor named at the end, nor handed back: must be 0.
        "lost": max(0, unaccounted - args.group_size * ledger.filtered_groups),
        "groups_dropped_by_server": ledger.filtered_groups,
        "handed_back_or_dropped": by_fate.get("handed_back", 0) + by_fate.get("dropped_incomplete", 0),
        "trajectories_aborted": sum(s["trajectories_aborted"] for s in stats),
        "aborted_then_continued": sum(s["trajectories_continued"] for s in stats),
        "aborted_then_continued_trained": ledger.continued_trained,
        "staleness_histogram": {str(k): v for k, v in sorted(ledger.staleness.items())},
        "tokens_generated": generated, "tokens_trained": ledger.trained_tokens,
        "generated_per_trained_token": round(generated / ledger.trained_tokens, 3) if ledger.trained_tokens else None,
        "held_at_end": by_fate.get("held_at_end", 0),
        "seconds_per_step_by_phase": phase_means(ledger.steps),
        "server_killed_at_step": killed_at,
        # --rollback-at: trajectories whose group the rollback took back (the Restore discarded it, or the trainer
        # that died had trained it after the checkpoint) and that were not generated again by the end; not lost:
        # their prompts are offered again
        "discarded_by_restore": by_fate.get("rolled_back", 0),
        "curve": ledger.steps,
    }


# ---------------------------------------------------------------------------------------------- summary

def spread(values: list) -> dict:
    """Median, min and max of the values that exist (None: the target was not reached)."""
    present = [v for v in values if v is not None]
    if not present:
        return {"median": None, "min": None, "max": None, "n": 0}
    return {"median": round(statistics.median(present), 4), "min": round(min(present), 4),
            "max": round(max(present), 4), "n": len(present)}


def mean_staleness(histogram: dict) -> float:
    total = sum(histogram.values())
    return sum(int(k) * v for k, v in histogram.items()) / total if total else 0.0


def compare_table(results: list[dict]) -> dict:
    table = {}
    for name in dict.fromkeys(r["config"] for r in results):
        runs = [r for r in results if r["config"] == name]
        table[name] = {
            "seeds": [r["seed"] for r in runs],
            "reached_target": sum(r["seconds_to_target"] is not None for r in runs),
            "seconds_to_target": spread([r["seconds_to_target"] for r in runs]),
            "steps_to_target": spread([r["steps_to_target"] for r in runs]),
            "reward_final": spread([r["reward_final"] for r in runs]),
            "seconds_per_step": spread([r["wall_seconds"] / r["steps"] for r in runs]),
            "generated_per_trained_token": spread([r["generated_per_trained_token"] for r in runs]),
            "mean_staleness": spread([mean_staleness(r["staleness_histogram"]) for r in runs]),
            "trajectories_aborted": spread([r["trajectories_aborted"] for r in runs]),
            "aborted_then_continued": spread([r["aborted_then_continued"] for r in runs]),
        }
    return table


def markdown_table(table: dict, speedups: dict) -> str:
    """The compare table as Markdown: medians with [min, max] over the seeds."""
    def cell(figure: dict, digits: int = 2) -> str:
        if figure["median"] is None:
            return "not reached"
        return f"{figure['median']:.{digits}f} [{figure['min']:.{digits}f}, {figure['max']:.{digits}f}]"

    lines = ["| configuration | reached 0.9 | seconds to target | steps to target | speedup vs sync | final reward "
             "| s / step | generated / trained token | mean staleness | aborted | continued |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for name, row in table.items():
        speedup = speedups.get(name)
        lines.append(" | ".join([
            f"| {name}", f"{row['reached_target']}/{len(row['seeds'])}", cell(row["seconds_to_target"], 1),
            cell(row["steps_to_target"], 0), "1 (baseline)" if name == "sync" else
            (f"{speedup:.2f}x" if speedup else "-"), cell(row["reward_final"], 3), cell(row["seconds_per_step"]),
            cell(row["generated_per_trained_token"]), cell(row["mean_staleness"]),
            cell(row["trajectories_aborted"], 0), cell(row["aborted_then_continued"], 0)]) + " |")
    return "\n".join(lines) + "\n"


def summarize(args, results: list[dict], vllm_seconds: float, wall: float, plot_path: Path | None) -> dict:
    totals = {
        "lost": sum(r["lost"] for r in results),
        "trajectories_aborted": sum(r["trajectories_aborted"] for r in results),
        "aborted_then_continued": sum(r["aborted_then_continued"] for r in results),
        "aborted_then_continued_trained": sum(r["aborted_then_continued_trained"] for r in results),
        "max_logprob_diff": max(r["max_logprob_diff"] for r in results),
        "max_logprob_diff_continued": max(r["max_logprob_diff_continued"] for r in results),
    }
    staleness: Counter = Counter()
    for r in results:
        staleness.update({int(k): v for k, v in r["staleness_histogram"].items()})
    summary = {
        "target": args.target,
        "reward_first": results[0]["reward_first"], "reward_final": results[0]["reward_final"],
        "steps_to_target": results[0]["steps_to_target"], "seconds_to_target": results[0]["seconds_to_target"],
        **totals,
        "staleness_histogram": {str(k): v for k, v in sorted(staleness.items())},
        "runs": [{k: v for k, v in r.items() if k != "curve"} for r in results],
        "vllm_start_seconds": round(vllm_seconds, 1), "wall_seconds": round(wall, 1),
        "load_average": [round(x, 2) for x in os.getloadavg()],
        "curve_png": str(plot_path) if plot_path else None,
    }
    if args.compare:
        table = compare_table(results)
        summary["compare"] = table
        sync = table.get("sync", {}).get("seconds_to_target", {}).get("median")
        summary["speedup_vs_sync"] = {
            name: (round(sync / row["seconds_to_target"]["median"], 3)
                   if sync and row["seconds_to_target"]["median"] else None)
            for name, row in table.items() if name != "sync"}
        summary["compare_markdown"] = markdown_table(table, summary["speedup_vs_sync"])
    return summary


def plot_main(argv: list[str]) -> int:
    """Draws the reward curves (reward against wall seconds and against steps, one line per configuration)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    curves_path, out, target = Path(argv[0]), Path(argv[1]), float(argv[2])
    results = json.loads(curves_path.read_text())
    fig, (by_time, by_step) = plt.subplots(1, 2, figsize=(12, 4.5))
    colors = {}
    for r in results:
        color = colors.setdefault(r["config"], f"C{len(colors)}")
        label = r["config"] if sum(x["config"] == r["config"] for x in results[:results.index(r) + 1]) == 1 else None
        by_time.plot([s["seconds"] for s in r["curve"]], [s["reward"] for s in r["curve"]], color=color, alpha=0.8,
                     label=label)
        by_step.plot([s["step"] for s in r["curve"]], [s["reward"] for s in r["curve"]], color=color, alpha=0.8,
                     label=label)
    for axis, xlabel in ((by_time, "wall seconds (trainer start to step end)"), (by_step, "training step")):
        axis.axhline(target, color="grey", linestyle=":", linewidth=1)
        axis.set_xlabel(xlabel)
        axis.set_ylabel("mean reward of the trained batch")
        axis.grid(alpha=0.3)
        axis.legend()
    fig.suptitle("the example's Llama on 2 CPU cores: vLLM generates, PyTorch trains (one line per seed)")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    return 0


# ---------------------------------------------------------------------------------------------- main

def vllm_setup(args: argparse.Namespace) -> tuple[str, Path]:
    """The vLLM venv's python and the model directory, creating either with setup.sh when missing."""
    python = args.vllm_python or os.environ.get("CODA_VLLM_PYTHON")
    model = Path(args.model or os.environ.get("CODA_RL_MODEL") or DEFAULT_MODEL)
    if python and (model / "config.json").exists():
        return python, model
    venv = Path(python).parent.parent if python else DEFAULT_VENV
    subprocess.run(["bash", str(HERE / "setup.sh"), str(venv), str(model)], check=True)
    return str(venv / "bin" / "python"), model


def has_torch() -> bool:
    try:
        import torch  # noqa: F401
        import transformers  # noqa: F401
    except ImportError:
        return False
    return True


def registered_strategies() -> set[str] | None:
    """The strategies coda-server knows, where its package is importable here (the vLLM venv may not have it)."""
    try:
        from coda_server.core.strategy import STRATEGIES
    except ImportError:
        return None
    return set(STRATEGIES.names())


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=24, help="training steps of every run")
    parser.add_argument("--target", type=float, default=0.9, help="the reward steps_to_target counts up to")
    parser.add_argument("--compare", action="store_true",
                        help="run the synchronous loop and the strategies side by side (--seeds each)")
    parser.add_argument("--seeds", type=int, default=None, help="seeds per configuration (default 3 with --compare)")
    parser.add_argument("--seed", type=int, default=0, help="the first seed")
    parser.add_argument("--strategy", default="latency-aware", help="without --compare: the strategy, or 'sync'")
    parser.add_argument("--strategies", default=",".join(ASYNC_STRATEGIES), help="with --compare")
    parser.add_argument("--stale-steps", type=float, default=1.0)
    parser.add_argument("--kill-server-at", type=int, default=None,
                        help="SIGKILL coda-server at this step (while workers generate) and restart it")
    parser.add_argument("--rollback-at", type=int, default=None,
                        help="checkpoint the trainer and the pacer after this step (0: before the first batch, with "
                             "the initial policy); after two more steps the trainer dies and restarts from that "
                             "checkpoint, restoring the pacer")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--prompts-per-step", type=int, default=8, help="B")
    parser.add_argument("--group-size", type=int, default=8, help="N")
    parser.add_argument("--mini-batch-size", type=int, default=64, help="M (trajectories); B*N/M updates a step")
    parser.add_argument("--max-tokens", type=int, default=256,
                        help="the largest response budget (the tail's end; task.response_budget draws each prompt's)")
    parser.add_argument("--max-groups", type=int, default=8, help="groups each worker generates at once")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--clip", type=float, default=0.2, help="the ratio clip of --loss clip")
    parser.add_argument("--loss", choices=("clip", "tis"), default="tis",
                        help="clip: PPO's clipped ratio to the engine's log-probs; tis: truncated importance "
                             "weights (policy.py)")
    parser.add_argument("--tis-cap", type=float, default=2.0, help="the truncation of --loss tis")
    parser.add_argument("--vllm-python", help="python of the vLLM venv (default $CODA_VLLM_PYTHON, else setup.sh)")
    parser.add_argument("--server-python", default=os.environ.get("CODA_SERVER_PYTHON"),
                        help="python with coda-server's packages (default: the one this script was started with)")
    parser.add_argument("--model", help="model directory (default $CODA_RL_MODEL or ~/.cache/coda-pacer/rl-llama, "
                                        "which setup.sh writes)")
    parser.add_argument("--vllm-port", type=int, default=18124)
    parser.add_argument("--vllm-url", help="use this running vLLM (VLLM_SERVER_DEV_MODE=1, serving the model as "
                                           "'tiny', pinned to core 0) instead of starting one")
    parser.add_argument("--workdir", help="logs, weights and coda state (default: a temporary directory)")
    parser.add_argument("--plot", help="where the reward curve PNG goes (default WORKDIR/reward-curve.png)")
    args = parser.parse_args(argv)
    # Checked now, not after vLLM's minute of start-up.
    for flag, value in (("--steps", args.steps), ("--workers", args.workers), ("--prompts-per-step",
                        args.prompts_per_step), ("--group-size", args.group_size), ("--max-tokens", args.max_tokens),
                        ("--max-groups", args.max_groups), ("--seeds", 1 if args.seeds is None else args.seeds)):
        if value < 1:
            parser.error(f"{flag} must be at least 1, got {value}")
    if not 0 <= args.stale_steps < float("inf"):
        parser.error(f"--stale-steps must be a finite number >= 0, got {args.stale_steps}")
    if args.kill_server_at is not None and not 1 <= args.kill_server_at <= args.steps:
        parser.error(f"--kill-server-at must be a step from 1 to --steps ({args.steps}), got {args.kill_server_at}")
    if args.rollback_at is not None and not 0 <= args.rollback_at <= args.steps - 2:
        parser.error(f"--rollback-at K needs steps K + 1 and K + 2 to run (the trainer dies after K + 2): K from 0 to "
                     f"{args.steps - 2} with --steps {args.steps}, got {args.rollback_at}")
    known = registered_strategies()
    if known is not None:
        asked = args.strategies.split(",") if args.compare else [] if args.strategy == "sync" else [args.strategy]
        unknown = [name for name in asked if name not in known]
        if unknown:
            parser.error(f"unknown strategy {unknown[0]!r}; registered: {', '.join(sorted(known))}"
                         f"{'' if args.compare else ', or sync'}")
    if args.mini_batch_size <= 0 or (args.prompts_per_step * args.group_size) % args.mini_batch_size:
        parser.error(f"--mini-batch-size {args.mini_batch_size} must divide B*N = "
                     f"{args.prompts_per_step * args.group_size}")
    args.batches_per_step = args.prompts_per_step * args.group_size // args.mini_batch_size
    return args


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "worker":
        return worker_main(argv[1:])
    if argv and argv[0] == "plot":
        return plot_main(argv[1:])
    args = parse(argv)
    # SIGTERM (timeout, an orchestrator) ends the run as Ctrl-C does: the clean-up below stops vLLM, coda-server and
    # the workers, which a plain SIGTERM left running.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    wall_started = time.monotonic()
    python, model = vllm_setup(args)
    if not has_torch():  # the trainer and the workers run in the vLLM venv
        os.execv(python, [python, str(Path(__file__).resolve()), *argv, "--vllm-python", python,
                          "--server-python", args.server_python or sys.executable, "--model", str(model)])
    args.server_python = args.server_python or sys.executable
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="coda-rl-cpu-"))
    workdir.mkdir(parents=True, exist_ok=True)
    seeds = [args.seed + i for i in range(args.seeds or (3 if args.compare else 1))]
    if args.compare:
        configs = [{"name": "sync", "kind": "sync"}] + [
            {"name": f"{s}@{args.stale_steps:g}", "kind": "async", "strategy": s, "stale_steps": args.stale_steps}
            for s in args.strategies.split(",")]
    elif args.strategy == "sync":
        configs = [{"name": "sync", "kind": "sync"}]
    else:
        configs = [{"name": f"{args.strategy}@{args.stale_steps:g}", "kind": "async", "strategy": args.strategy,
                    "stale_steps": args.stale_steps}]
    engine_url = args.vllm_url or f"http://127.0.0.1:{args.vllm_port}"
    results = []
    with ExitStack() as cleanup:
        vllm_seconds = 0.0
        if not args.vllm_url:
            vllm = start_vllm(python, model, args.vllm_port, workdir, cores=[ENGINE_CORE])
            cleanup.callback(stop_vllm, vllm)
            vllm_seconds = wait_for_vllm(vllm, engine_url, workdir)
        log.info("vLLM ready in %.0f s; logs in %s", vllm_seconds, workdir)
        import torch

        os.sched_setaffinity(0, {TRAINER_CORE})  # generation on core 0 (vLLM), training on core 1
        torch.set_num_threads(1)
        # Seeds innermost-last: every configuration's first seed runs before any second seed, so a load
        # change on the machine spreads over all configurations.
        for seed in seeds:
            for config in configs:
                results.append(run_one(args, config, seed, [engine_url], model, workdir))
                log.info("%s", {k: v for k, v in results[-1].items() if k != "curve"})
    curves = workdir / "curves.json"
    curves.write_text(json.dumps(results))
    plot_path = Path(args.plot) if args.plot else workdir / "reward-curve.png"
    drawn = subprocess.run([args.server_python, str(Path(__file__).resolve()), "plot", str(curves), str(plot_path),
                            str(args.target)], preexec_fn=unpinned)
    summary = summarize(args, results, vllm_seconds, time.monotonic() - wall_started,
                        plot_path if drawn.returncode == 0 else None)
    if "compare_markdown" in summary:
        (workdir / "compare.md").write_text(summary["compare_markdown"])
    print(json.dumps(summary))
    unchecked = sum(r["tokens_trained"] - r["tokens_checked"] for r in results)
    trained_discarded = sum(r.get("discarded_version_tokens_trained", 0) for r in results)
    ok = summary["lost"] == 0 and summary["max_logprob_diff"] < 1e-4 and unchecked == 0 and trained_discarded == 0
    return 0 if ok else 1


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:  # Ctrl-C or SIGTERM: the clean-up has run on the way out
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        print("run.py: interrupted; vLLM, coda-server and the workers it started are stopped (the runs' logs are in "
              "the work directory named at the start)", file=sys.stderr)
        sys.exit(130)
