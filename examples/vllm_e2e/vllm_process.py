"""The processes the examples start: vLLM (where its venv and model live, start it, wait until healthy), a rollout
worker process's body, and stopping any."""
from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import signal
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

DEFAULT_VENV = Path.home() / ".cache" / "coda-pacer" / "vllm-venv"
DEFAULT_MODEL = Path.home() / ".cache" / "coda-pacer" / "tiny-llama"
VLLM_START_TIMEOUT_SECONDS = 900.0  # the first start compiles the model (minutes on two cores)
# vLLM holds nothing to save: serving, it stops within a second of SIGTERM; stopped while it starts, its workers' start
# fails and its server waits on them until killed, so a longer grace would only delay an interrupted run's end.
VLLM_STOP_GRACE_SECONDS = 10.0


def start_vllm(python: str, model: Path, port: int, logs: Path, *, cores: Sequence[int] = ()) -> subprocess.Popen:
    """vLLM's OpenAI server for `model` on 127.0.0.1:port, logging to logs/vllm.log; pinned to `cores` if given.

    VLLM_SERVER_DEV_MODE exposes /collective_rpc, which the weight sync's reload goes through."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_SERVER_DEV_MODE": "1", "VLLM_CPU_KVCACHE_SPACE": "1",
           "VLLM_LOGGING_LEVEL": "WARNING"}
    pinned = ["taskset", "-c", ",".join(map(str, cores))] if cores else []
    command = [*pinned, python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
               "--served-model-name", "tiny", "--host", "127.0.0.1", "--port", str(port), "--max-model-len", "512",
               "--dtype", "float32"]
    return subprocess.Popen(command, stdout=open(logs / "vllm.log", "wb"), stderr=subprocess.STDOUT, env=env,
                            start_new_session=True)


def wait_for_vllm(process: subprocess.Popen, base_url: str, logs: Path) -> float:
    """Seconds until vLLM answers /health; raises with its log's tail if it exits or is not ready in time."""
    started = time.monotonic()
    while True:
        if process.poll() is not None:
            raise RuntimeError(f"vLLM exited with {process.returncode}; see {logs / 'vllm.log'}:\n"
                               + (logs / "vllm.log").read_text(errors="replace")[-3000:])
        try:
            with urllib.request.urlopen(f"{base_url}/health", timeout=2) as answer:
                if answer.status == 200:
                    return time.monotonic() - started
        except (urllib.error.URLError, OSError):
            pass
        if time.monotonic() - started > VLLM_START_TIMEOUT_SECONDS:
            raise RuntimeError(f"vLLM did not become healthy in {VLLM_START_TIMEOUT_SECONDS:.0f} s; "
                               f"see {logs / 'vllm.log'}")
        time.sleep(1.0)


def stop(process: subprocess.Popen, sig: int = signal.SIGTERM, timeout: float = 60.0) -> None:
    """Sends `sig` to the process's group (each is started in a session of its own), then SIGKILL after `timeout`."""
    if process.poll() is None:
        try:
            os.killpg(process.pid, sig)
        except ProcessLookupError:
            return
        try:
            process.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(10)


def stop_vllm(process: subprocess.Popen) -> None:
    """Stops vLLM (`stop`, SIGKILL after VLLM_STOP_GRACE_SECONDS)."""
    stop(process, signal.SIGTERM, VLLM_STOP_GRACE_SECONDS)


def worker_arguments(argv: Sequence[str], *, extra_integers: Sequence[str] = ()) -> argparse.Namespace:
    """A worker process's command line (`run.py worker ...`): where the pacer and the engine are, its shard
    (--index of --count), --prompts, --max-tokens, --max-groups and --stats (where its stats go), plus
    `extra_integers`; with the examples' logging set up."""
    parser = argparse.ArgumentParser(prog="run.py worker")
    for name in ("--pacer", "--engine", "--stats"):
        parser.add_argument(name, required=True)
    for name in ("--index", "--count", "--prompts", "--max-tokens", "--max-groups", *extra_integers):
        parser.add_argument(name, type=int, required=True)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    return args


def run_worker(args: argparse.Namespace, source: Any, worker_options: Callable[[Any], dict]) -> None:
    """One AsyncRolloutWorker over VLLMEngine (`args` from worker_arguments; its other options
    `worker_options(engine)`) until its source is done or SIGTERM stops it; writes its stats and every trajectory the server acknowledged (id -> prompt id: what the trainer
    checks for loss) as JSON to args.stats."""
    from coda_client import AsyncPacerClient
    from coda_worker import AsyncRolloutWorker
    from coda_worker.engines import VLLMEngine

    acknowledged: dict[str, str] = {}

    def record(trajectories: Any) -> None:
        for t in trajectories:
            acknowledged[t.trajectory_id] = t.prompt_id

    async def main() -> dict:
        async with AsyncPacerClient(args.pacer, client_id=f"worker-{args.index}") as pacer, \
                VLLMEngine(args.engine, model="tiny") as engine:
            worker = AsyncRolloutWorker(pacer, engine, source, max_groups=args.max_groups,
                                        worker_id=f"worker-{args.index}", on_submitted=record,
                                        **worker_options(engine))
            asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, worker.stop)
            stats = await worker.run()
            return {**stats.as_dict(), "acknowledged": acknowledged}

    Path(args.stats).write_text(json.dumps(asyncio.run(main())))
