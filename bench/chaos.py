"""Chaos run: a realistic job under seeded faults, checked for conservation (issue 25).

One durable server, WORKERS RolloutWorkers (FakeEngine) and a trainer on `batches()` (Reset WAIT + Resume at
every step boundary), each reaching the server through a TCP proxy of its own this script controls on 127.0.0.1
and each in a process of its own, run a fixed set of prompts to the end while faults are injected one at a
time, in a seeded order, each after the job made progress since the last:

    server_kill9      kill -9 of the server, restarted at once on the same state directory
    server_sigterm    a graceful restart (SIGTERM, as a rolling update), restarted at once
    worker_kill9      kill -9 of a worker, a new one started on its shard a second later
    worker_sigstop    SIGSTOP of a worker for 1.5 liveness graces, then SIGCONT
    worker_partition  a worker's traffic cut at its proxy (a black hole both ways) for 1.5 graces, restored
    trainer_kill9     kill -9 of the trainer at a random moment, restarted at once
    trainer_sigstop   SIGSTOP of the trainer for 1.5 liveness graces (its leases are taken back), then SIGCONT
    trainer_partition the trainer's traffic cut at its proxy for 1.5 graces (its leases are taken back), restored

Checked at the end, from what the workers' Submits had acknowledged and what the trainer trained:
nothing acknowledged lost (every prompt trained, every trajectory trained with the content of one of its
acknowledged submissions), nothing trained twice by one trainer process (a trainer killed -9 restarts
from its own record of what it trained and skips a batch delivered again: counted as redelivered), and
progress after every fault (time from the fault to the next batch and to the next step boundary).

    python bench/chaos.py                      # seeds 1, 2, 3; 12 faults each on 96 prompts
    python bench/chaos.py --seeds 7 --faults 6 --prompts 40    # a short run (tests/test_chaos.py runs one)
    python bench/chaos.py --trainer-id trainer   # every trainer process under one fixed client id, as a pod's

Exit status 1 when a conservation check fails.
"""
from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import random
import signal
import socket
import statistics
import struct
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

WORKERS = 3
B, N, M = 4, 2, 4  # groups per step, trajectories per group, trajectories per mini-batch (2 groups)
GRACE = 1.5  # server.worker_liveness_seconds of the run: short, so a run is short
FAULT_KINDS = ("server_kill9", "server_sigterm", "worker_kill9", "worker_sigstop", "worker_partition",
               "trainer_kill9", "trainer_sigstop", "trainer_partition")
PROGRESS_TIMEOUT = 60.0  # a fault after which the job makes no progress for this long fails the run


def fingerprint(t: Any) -> str:
    """The content of a trajectory as the trainer would train on it (ids, tokens, logprobs as float32, status,
    reward), the same whichever side reads it."""
    tokens = [int(x) for x in t.token_ids]
    logprobs = struct.pack(f"<{len(t.logprobs)}f", *[float(x) for x in t.logprobs])
    body = json.dumps([t.trajectory_id, tokens, int(t.status), float(t.reward)]).encode() + logprobs
    return hashlib.sha1(body).hexdigest()[:16]


def append_line(path: Path, record: dict) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")
        f.flush()
        os.fsync(f.fileno())


def read_lines(path: Path) -> list[dict]:
    if not path.exists():
        return []
    records = []
    for line in path.read_text().splitlines():
        try:
            records.append(json.loads(line))
        except ValueError:  # a line cut by kill -9
            pass
    return records


# ----------------------------------------------------------------------------- the worker process

def worker_main(address: str, index: int, prompts: int, seed: int, record: str) -> None:
    from coda_worker import ListPromptSource, Prompt, RolloutWorker
    from coda_worker.engines.base import SamplingParams
    from coda_worker.engines.fake import FakeEngine

    source = ListPromptSource(Prompt(f"p{i}", [1, 2, 3, i % 7], epoch=0, index=i) for i in range(prompts))
    record_path = Path(record)

    def acknowledged(trajectories: list) -> None:
        for t in trajectories:
            append_line(record_path, {"id": t.trajectory_id, "fp": fingerprint(t), "at": time.time()})

    # About half a second a response, a few several times that: faults land while groups are generating.
    engine = FakeEngine(seed=seed * 100 + index, mean_tokens=24, length_sigma=0.6, first_token_seconds=0.02,
                        seconds_per_token=0.02)
    RolloutWorker(address, engine, source.shard(index, WORKERS), worker_id=f"w{index}", max_groups=2,
                  sampling=SamplingParams(max_tokens=96), on_submitted=acknowledged,
                  client_options={"timeout": 10}).run()


# ----------------------------------------------------------------------------- the trainer process

def trainer_main(address: str, prompts: int, record: str, client_id: Optional[str] = None) -> None:
    """Trains (records) every batch, skipping one this trainer's earlier processes trained already; Reset
    WAIT + Resume after each step's B groups; ends when every prompt was trained. `client_id`: the same for every
    trainer process (None: each takes a default one of its own)."""
    from coda_client import PacerClient
    from coda_client.errors import PacerClientError

    record_path = Path(record)
    earlier = read_lines(record_path)
    trained = {r["id"] for r in earlier if r.get("kind") == "trained"}
    steps = sum(1 for r in earlier if r.get("kind") == "step")
    process = os.getpid()
    with PacerClient(address, timeout=120, client_id=client_id) as client:
        batches = client.batches(M, lease=30, poll=1, reconnect=120)
        threading.Thread(target=end_when_nothing_is_left, args=(client, batches, prompts), daemon=True).start()
        in_step = (len(trained) // N) % B
        for batch in batches:
            ids = [t.trajectory_id for t in batch.trajectories]
            again = [i for i in ids if i in trained]
            if again and len(again) == len(ids) and any(r.get("process") != process for r in earlier
                                                        if r.get("kind") == "trained" and r["id"] in again):
                append_line(record_path, {"kind": "redelivered", "ids": ids, "at": time.time()})
                continue  # delivered again after this trainer's own restart: it trained it before dying
            for t in batch.trajectories:
                append_line(record_path, {"kind": "trained", "id": t.trajectory_id, "fp": fingerprint(t),
                                          "process": process, "leases": list(batch.lease_ids), "at": time.time()})
                trained.add(t.trajectory_id)
            append_line(record_path, {"kind": "batch", "at": time.time()})
            in_step += len(ids) // N
            if in_step >= B:
                batches.ack()
                in_step = 0
                steps += 1
                request_id = f"step-{steps}"
                while True:  # the step boundary, retried with its request id through restarts
                    try:
                        client.reset("wait", resume=True, weight_version=steps, request_id=request_id)
                        break
                    except PacerClientError:
                        time.sleep(0.5)
                append_line(record_path, {"kind": "step", "at": time.time()})
            if len(trained) >= prompts * N:
                batches.ack()
                break
        append_line(record_path, {"kind": "done", "at": time.time()})


def end_when_nothing_is_left(client: Any, batches: Any, prompts: int) -> None:
    """Closes the iterator once every prompt was dispatched and nothing is left anywhere on the server (a group
    a Reset dropped is never trained: the run ends, and the check counts it as lost)."""
    while True:
        time.sleep(2.0)
        try:
            state = client.state()
            cursor = client.prompt_cursor()
        except Exception:  # noqa: BLE001 - the server restarting: ask again
            continue
        admitted = all(cursor.admitted(f"p{i}", 0, 0, i) for i in range(prompts))
        if admitted and not (state.running or state.buffered or state.leased or state.restored_kept):
            batches.close()
            return


# ----------------------------------------------------------------------------- the proxy

class Proxy:
    """A TCP proxy on 127.0.0.1 to the server; `cut()` stops carrying bytes both ways (a black hole: nothing
    is closed, the kernel's buffers fill), `restore()` carries them again (as TCP delivers after a partition)."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.loop = asyncio.new_event_loop()
        self._open: Optional[asyncio.Event] = None
        self.port = 0
        started = threading.Event()
        threading.Thread(target=self._run, args=(started,), daemon=True).start()
        started.wait(10)

    def _run(self, started: threading.Event) -> None:
        asyncio.set_event_loop(self.loop)
        self._open = asyncio.Event()
        self._open.set()
        server = self.loop.run_until_complete(asyncio.start_server(self._connection, "127.0.0.1", 0))
        self.port = server.sockets[0].getsockname()[1]
        started.set()
        self.loop.run_forever()

    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            upstream_reader, upstream_writer = await asyncio.open_connection("127.0.0.1", self.target_port)
        except OSError:
            writer.close()
            return
        await asyncio.gather(self._pump(reader, upstream_writer), self._pump(upstream_reader, writer),
                             return_exceptions=True)

    async def _pump(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                await self._open.wait()
                data = await reader.read(65536)
                if not data:
                    break
                await self._open.wait()
                writer.write(data)
                await writer.drain()
        finally:
            writer.close()

    def cut(self) -> None:
        self.loop.call_soon_threadsafe(self._open.clear)

    def restore(self) -> None:
        self.loop.call_soon_threadsafe(self._open.set)


# ----------------------------------------------------------------------------- the run

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Fault:
    kind: str
    at: float
    target: str = ""


@dataclass
class RunResult:
    seed: int
    faults: list[Fault] = field(default_factory=list)
    lost: list[str] = field(default_factory=list)  # acknowledged trajectories never trained
    altered: list[str] = field(default_factory=list)  # trained with content no Submit had acknowledged
    twice: list[tuple[str, float]] = field(default_factory=list)  # (trajectory id, when) trained twice by one process
    # Each trajectory trained twice: by which trainer process, under which leases, when (to read beside the server's
    # log, which names the leases it released and gave back; a run kept with --keep has it in processes.log).
    twice_how: list[str] = field(default_factory=list)
    redelivered: list[float] = field(default_factory=list)  # batches a restarted trainer skipped, when
    batches: list[float] = field(default_factory=list)
    steps: list[float] = field(default_factory=list)
    wall: float = 0.0
    finished: bool = False

    @property
    def ok(self) -> bool:
        return self.finished and not (self.lost or self.altered or self.twice)


class Job:
    """The processes of one run and the faults done to them."""

    def __init__(self, workdir: Path, seed: int, prompts: int, trainer_id: Optional[str] = None) -> None:
        self.workdir, self.seed, self.prompts, self.trainer_id = workdir, seed, prompts, trainer_id
        self.port = free_port()
        self.env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
        self.server: Optional[subprocess.Popen] = None
        self.proxies = [Proxy(self.port) for _ in range(WORKERS)]
        self.trainer_proxy = Proxy(self.port)
        self.workers: list[Optional[subprocess.Popen]] = [None] * WORKERS
        self.trainer: Optional[subprocess.Popen] = None
        self.trainer_record = workdir / "trainer.jsonl"
        self.logs = open(workdir / "processes.log", "ab")

    def start_server(self) -> None:
        port_file = self.workdir / "port.json"
        port_file.unlink(missing_ok=True)
        self.server = subprocess.Popen(
            [sys.executable, "-m", "coda_server", "--port-file", str(port_file),
             f"server.address=127.0.0.1:{self.port}", "server.metrics_address=", "server.log_rpcs=false",
             f"server.state_dir={self.workdir / 'state'}", "fully_async.sliding_window=no-window",
             "fully_async.stale_steps=1.0", f"data_source.num_prompts_per_step={B}",
             f"data_source.num_trajectories_per_prompt={N}", f"trainer.mini_batch_size={M}", "rollout.filter=[]",
             "rollout.continue_restored=true", f"server.worker_liveness_seconds={GRACE}",
             "server.inflight_lease_seconds=60", "server.shutdown_grace_seconds=2"],
            cwd=REPO_ROOT, env=self.env, stdout=self.logs, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 30
        while not port_file.exists():
            if self.server.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the server did not start (see {self.workdir / 'processes.log'})")
            time.sleep(0.02)

    def start_worker(self, index: int) -> None:
        self.workers[index] = subprocess.Popen(
            [sys.executable, __file__, "--worker", f"127.0.0.1:{self.proxies[index].port}", str(index),
             str(self.prompts), str(self.seed), str(self.workdir / f"worker-{index}.jsonl")],
            cwd=REPO_ROOT, env=self.env, stdout=self.logs, stderr=subprocess.STDOUT)

    def start_trainer(self) -> None:
        self.trainer = subprocess.Popen(
            [sys.executable, __file__, "--trainer", f"127.0.0.1:{self.trainer_proxy.port}", str(self.prompts),
             str(self.trainer_record), *([self.trainer_id] if self.trainer_id else [])],
            cwd=REPO_ROOT, env=self.env, stdout=self.logs, stderr=subprocess.STDOUT)

    def start(self) -> None:
        self.start_server()
        for index in range(WORKERS):
            self.start_worker(index)
        self.start_trainer()

    def records(self, kind: str) -> list[dict]:
        return [r for r in read_lines(self.trainer_record) if r.get("kind") == kind]

    def done(self) -> bool:
        return bool(self.records("done"))

    def wait_progress(self, since: float, timeout: float = PROGRESS_TIMEOUT) -> bool:
        """Until a batch was trained after `since` (or the job is done)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.done() or any(r["at"] > since for r in self.records("batch")):
                return True
            if self.trainer is not None and self.trainer.poll() is not None and not self.done():
                self.start_trainer()  # ended on its own (an error): a trainer is restarted, as a job would
            time.sleep(0.1)
        return False

    def inject(self, kind: str, rng: random.Random) -> Fault:
        index = rng.randrange(WORKERS)
        fault = Fault(kind, time.time(), f"w{index}" if kind.startswith("worker") else kind.split("_")[0])
        if kind == "server_kill9":
            self.server.kill()
            self.server.wait()
            self.start_server()
        elif kind == "server_sigterm":
            self.server.send_signal(signal.SIGTERM)
            self.server.wait(60)
            self.start_server()
        elif kind == "worker_kill9":
            self.workers[index].kill()
            self.workers[index].wait()
            time.sleep(1.0)
            self.start_worker(index)
        elif kind == "worker_sigstop":
            self.workers[index].send_signal(signal.SIGSTOP)
            time.sleep(1.5 * GRACE)
            self.workers[index].send_signal(signal.SIGCONT)
        elif kind == "worker_partition":
            self.proxies[index].cut()
            time.sleep(1.5 * GRACE)
            self.proxies[index].restore()
        elif kind == "trainer_kill9":
            time.sleep(rng.uniform(0, 0.5))  # a random moment: mid-batch, mid-Reset, mid-Ack
            self.trainer.kill()
            self.trainer.wait()
            self.start_trainer()
        elif kind == "trainer_sigstop":
            time.sleep(rng.uniform(0, 0.5))
            self.trainer.send_signal(signal.SIGSTOP)
            time.sleep(1.5 * GRACE)
            self.trainer.send_signal(signal.SIGCONT)
        elif kind == "trainer_partition":
            time.sleep(rng.uniform(0, 0.5))
            self.trainer_proxy.cut()
            time.sleep(1.5 * GRACE)
            self.trainer_proxy.restore()
        return fault

    def stop(self) -> None:
        for process in [self.trainer, *self.workers, self.server]:
            if process is not None and process.poll() is None:
                process.send_signal(signal.SIGCONT)
                process.kill()
                process.wait()
        for proxy in [*self.proxies, self.trainer_proxy]:
            proxy.loop.call_soon_threadsafe(proxy.loop.stop)
        self.logs.close()


def run(seed: int, faults: int, prompts: int, workdir: Path, trainer_id: Optional[str] = None) -> RunResult:
    """One seeded run: start, inject `faults` faults (each after progress since the last), run to the end; every
    trainer process under the client id `trainer_id` when given."""
    rng = random.Random(seed)
    kinds = [FAULT_KINDS[i % len(FAULT_KINDS)] for i in range(faults)]
    rng.shuffle(kinds)
    job = Job(workdir, seed, prompts, trainer_id)
    result = RunResult(seed)
    started = time.time()
    try:
        job.start()
        last = started
        for kind in kinds:
            if not job.wait_progress(last) or job.done():
                break
            time.sleep(rng.uniform(0.0, 1.0))
            fault = job.inject(kind, rng)
            result.faults.append(fault)
            last = fault.at
        deadline = time.monotonic() + 10 * PROGRESS_TIMEOUT
        while not job.done() and time.monotonic() < deadline:
            job.wait_progress(time.time(), timeout=5.0)
        result.finished = job.done()
    finally:
        job.stop()
    result.wall = time.time() - started
    check(job, result)
    return result


def check(job: Job, result: RunResult) -> None:
    acknowledged: dict[str, set[str]] = {}
    for index in range(WORKERS):
        for r in read_lines(job.workdir / f"worker-{index}.jsonl"):
            acknowledged.setdefault(r["id"], set()).add(r["fp"])
    records = read_lines(job.trainer_record)
    trained: dict[str, list[dict]] = {}
    for r in records:
        if r.get("kind") == "trained":
            trained.setdefault(r["id"], []).append(r)
    result.batches = [r["at"] for r in records if r.get("kind") == "batch"]
    result.steps = [r["at"] for r in records if r.get("kind") == "step"]
    result.redelivered = [r["at"] for r in records if r.get("kind") == "redelivered"]
    every = {f"p{i}#{j}" for i in range(job.prompts) for j in range(N)}
    result.lost = sorted((set(acknowledged) | every) - set(trained))
    for trajectory_id, times in trained.items():
        if any(t["fp"] not in acknowledged.get(trajectory_id, {t["fp"]}) for t in times):
            result.altered.append(trajectory_id)
        by_process: dict[int, int] = {}
        for t in times:
            by_process[t["process"]] = by_process.get(t["process"], 0) + 1
        if any(count > 1 for count in by_process.values()) or len(times) > 1:
            # more than once: by one process (a bug), or again by a restarted trainer that did not skip it
            result.twice.append((trajectory_id, times[1]["at"]))
            result.twice_how.append(f"{trajectory_id}: " + "; ".join(
                f"process {t['process']} leases {','.join(t.get('leases', [])) or '-'} at {t['at']:.2f}" for t in times))


def table(results: list[RunResult]) -> str:
    """One row per fault kind: how often, what was lost or trained twice after it, time to the next batch
    and to the next step (median / max over its faults)."""
    rows = [f"{'fault':<17} {'n':>3} {'lost':>5} {'twice':>6} {'redeliv':>8} {'next batch s':>14} "
            f"{'next step s':>14}"]

    def after(events: list[float], at: float) -> Optional[float]:
        later = [e - at for e in events if e > at]
        return min(later) if later else None

    def spread(values: list[float]) -> str:
        return f"{statistics.median(values):5.1f} / {max(values):5.1f}" if values else "    - /     -"

    attributed: dict[str, dict[str, int]] = {kind: {"twice": 0, "redelivered": 0} for kind in FAULT_KINDS}
    for result in results:
        faults = sorted(result.faults, key=lambda f: f.at)
        for what, events in (("twice", [at for _, at in result.twice]), ("redelivered", result.redelivered)):
            for at in events:
                before = [f for f in faults if f.at <= at]
                if before:
                    attributed[before[-1].kind][what] += 1
    for kind in FAULT_KINDS:
        batch_times, step_times, count = [], [], 0
        for result in results:
            for fault in result.faults:
                if fault.kind != kind:
                    continue
                count += 1
                for events, out in ((result.batches, batch_times), (result.steps, step_times)):
                    value = after(events, fault.at)
                    if value is not None:
                        out.append(value)
        rows.append(f"{kind:<17} {count:>3} {'-':>5} {attributed[kind]['twice']:>6} "
                    f"{attributed[kind]['redelivered']:>8} {spread(batch_times):>14} {spread(step_times):>14}")
    lost = sum(len(r.lost) for r in results)
    twice = sum(len(r.twice) for r in results)
    altered = sum(len(r.altered) for r in results)
    rows.append(f"{'all':<17} {sum(len(r.faults) for r in results):>3} {lost:>5} {twice:>6} "
                f"{sum(len(r.redelivered) for r in results):>8}   (altered {altered}; lost is per run, not per fault)")
    return "\n".join(rows)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--faults", type=int, default=12, help="faults per run")
    parser.add_argument("--prompts", type=int, default=96, help="prompt groups per run")
    parser.add_argument("--keep", type=Path, help="keep each run's directory (logs, records) under this one")
    parser.add_argument("--worker", nargs=5, help=argparse.SUPPRESS)
    parser.add_argument("--trainer-id", help="one fixed client id for every trainer process (default: each its own)")
    parser.add_argument("--trainer", nargs="+", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        address, index, prompts, seed, record = args.worker
        worker_main(address, int(index), int(prompts), int(seed), record)
        return 0
    if args.trainer:
        address, prompts, record, *client_id = args.trainer
        trainer_main(address, int(prompts), record, *client_id)
        return 0
    results = []
    for seed in args.seeds:
        if args.keep:
            workdir = args.keep / f"seed-{seed}"
            workdir.mkdir(parents=True, exist_ok=True)
            results.append(run(seed, args.faults, args.prompts, workdir, args.trainer_id))
        else:
            with tempfile.TemporaryDirectory() as tmp:
                results.append(run(seed, args.faults, args.prompts, Path(tmp), args.trainer_id))
        r = results[-1]
        print(f"seed {seed}: {len(r.faults)} faults, {'finished' if r.finished else 'DID NOT FINISH'} in "
              f"{r.wall:.0f} s; {len(r.batches)} batches, {len(r.steps)} steps; lost {len(r.lost)}, trained twice "
              f"{len(r.twice)}, altered {len(r.altered)}, redelivered {len(r.redelivered)}", flush=True)
        for how in r.twice_how:
            print(f"  trained twice: {how}", flush=True)
    print(table(results))
    return 0 if all(r.ok for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
