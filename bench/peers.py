"""The trainer's data path through what RL users would use instead of this service, in one run (issue 29).

The same workload through each system, one after another in this run (the order rotating per repeat), each
system's "server" in a process of its own on 127.0.0.1, every figure a ratio to this service's:

* **this service** (`ours`): a `python -m coda_server` on the shipped defaults (state in memory, as
  payload_path.py), a worker submitting one group per Submit from NumPy arrays (`PacerClient.submit`), then
  a trainer iterating `batches(M)` (leased Collects packed into flat columns, each batch acknowledged);
* **Ray** (`ray`): a queue actor holding object refs, as verl's fully-async `MessageQueue` does: the
  worker `ray.put`s each trajectory's arrays and hands the refs to the actor; the trainer takes M refs from
  the actor, `ray.get`s them (zero-copy views of the object store) and packs them;
* **DeepMind Reverb** (`reverb`, the transport limit: C++ gRPC, chunked tensors): a `Queue` table on a
  `reverb.Server`; the worker appends each trajectory with a `TrajectoryWriter` and creates an item of it;
  the trainer `client.sample`s M items and packs them;
* **Atropos** (`atropos`, NousResearch's rollout API server, FastAPI with JSON bodies): `uvicorn
  atroposlib.api.server:app`; the worker POSTs each group to `/scored_data` (tokens, masks, logprobs as JSON
  lists), the trainer GETs `/batch` (batch size M) and packs it.

Packing is the same for every peer (one `np.concatenate` per column, as `MiniBatch` does), so "out" always
means "mini-batches of packed columns in the trainer's hands". MB/s counts array bytes (token ids int32,
logprobs float32, loss mask int32: 12 bytes a token). The server's peak RSS is VmHWM of its process (Ray:
of the queue actor's worker process and the raylet, whose object store holds the arrays).

Each peer runs in a Python of its own (its own virtual environment when its pins clash with ours): pass it
with `--ray-python`, `--reverb-python`, `--atropos-python` (default: /work/venvs-peers/NAME/bin/python when
it exists). A peer whose Python lacks its package, or fails, is reported as skipped with the reason.
Traffic goes only to 127.0.0.1; every step is bounded in time.

    python bench/peers.py                      # 128 trajectories x 32,768 tokens, 1 repeat
    python bench/peers.py --trajectories 512 --repeats 3
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Optional

import numpy as np

BENCH_DIR = Path(__file__).resolve().parent
REPO_ROOT = BENCH_DIR.parent
GROUP_SIZE = 16
MINI_BATCH = 128
PEERS = ("ours", "ray", "reverb", "atropos")
PEER_TIMEOUT_SECONDS = 900
START_TIMEOUT_SECONDS = 120


# ------------------------------------------------------------------------------------- shared by the drivers

def make_groups(trajectories: int, tokens: int, seed: int = 0) -> list[list[tuple[np.ndarray, np.ndarray, np.ndarray]]]:
    rng = np.random.default_rng(seed)
    arrays = [(rng.integers(0, 151_936, tokens, dtype=np.int32), -rng.exponential(2.0, tokens).astype(np.float32),
               (rng.random(tokens) < 0.9).astype(np.int32)) for _ in range(trajectories)]
    return [arrays[i:i + GROUP_SIZE] for i in range(0, trajectories, GROUP_SIZE)]


def pack(columns: list[tuple[Any, Any, Any]]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A mini-batch's three columns end to end, one copy each (what MiniBatch.from_groups does)."""
    return tuple(np.concatenate([np.asarray(c[i]) for c in columns]) for i in range(3))  # type: ignore[return-value]


def peak_rss_mb(pid: int) -> float:
    try:
        for line in open(f"/proc/{pid}/status"):
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return float("nan")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(condition: Callable[[], bool], what: str, timeout: float = START_TIMEOUT_SECONDS) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what} did not happen within {timeout:.0f} s")
        time.sleep(0.05)


def timed_run(submit_all: Callable[[], None], collect_all: Callable[[], int], payload: int) -> dict:
    started = time.perf_counter()
    submit_all()
    submitted = time.perf_counter()
    received = collect_all()
    ended = time.perf_counter()
    assert received == payload, f"received {received} array bytes of {payload}"
    return {"in_mb_s": payload / 1e6 / (submitted - started), "out_mb_s": payload / 1e6 / (ended - submitted),
            "wall_s": ended - started}


def array_bytes(groups: list) -> int:
    """The array bytes of the workload's groups (each a list of (token_ids, logprobs, loss_mask))."""
    return sum(t.nbytes + l.nbytes + m.nbytes for g in groups for t, l, m in g)


def terminate(process: subprocess.Popen) -> None:
    """SIGTERM, then SIGKILL if the process has not exited within 30 s."""
    process.send_signal(signal.SIGTERM)
    try:
        process.wait(30)
    except subprocess.TimeoutExpired:
        process.kill()


# ------------------------------------------------------------------------------------------------ drivers
# Each runs in the peer's own Python (`--driver NAME`) and prints one JSON line of figures.


def drive_ours(groups: list, workdir: Path) -> dict:
    sys.path.insert(0, str(REPO_ROOT))
    from coda_client import PacerClient, Trajectory, TrajectoryStatus

    payload = array_bytes(groups)
    port_file = workdir / "ours.port.json"
    log = open(workdir / "ours.log", "wb")
    server = subprocess.Popen([sys.executable, "-m", "coda_server", "--port-file", str(port_file),
                               "server.address=127.0.0.1:0", "server.metrics_address=", "server.state_dir=",
                               f"data_source.num_prompts_per_step={len(groups)}",
                               f"data_source.num_trajectories_per_prompt={GROUP_SIZE}",
                               f"trainer.mini_batch_size={MINI_BATCH}"], cwd=REPO_ROOT, stdout=log, stderr=log)
    try:
        wait_for(port_file.exists, "the coda server's start")
        address = json.loads(port_file.read_text())["address"]
        with PacerClient(address, arrays="numpy", timeout=300) as pacer:
            pacer.state()  # warm-up, untimed: the channel is connected
            prompts = [f"p{g}" for g in range(len(groups))]

            def submit_all() -> None:
                pacer.dispatch(prompts)
                for prompt_id, group in zip(prompts, groups):
                    pacer.submit([Trajectory(trajectory_id=f"{prompt_id}/{j}", prompt_id=prompt_id,
                                             status=TrajectoryStatus.COMPLETED, token_ids=t, logprobs=l, loss_mask=m)
                                  for j, (t, l, m) in enumerate(group)])

            def collect_all() -> int:
                received = 0
                with pacer.batches(MINI_BATCH, group_size=GROUP_SIZE, num_batches=len(groups) * GROUP_SIZE // MINI_BATCH,
                                   lease=300, poll=30) as batches:
                    for batch in batches:
                        received += batch.token_ids.nbytes + batch.logprobs.nbytes + batch.loss_mask.nbytes
                return received

            figures = timed_run(submit_all, collect_all, payload)
        figures["server_peak_rss_mb"] = peak_rss_mb(server.pid)
        return figures
    finally:
        terminate(server)


def drive_ray(groups: list, workdir: Path) -> dict:
    import ray

    payload = array_bytes(groups)
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, _temp_dir=str(workdir / "ray"),
             object_store_memory=max(512 << 20, 3 * payload))

    @ray.remote(num_cpus=0)
    class MessageQueue:
        """verl's fully-async MessageQueue in short: the actor holds the samples' refs, in order."""

        def __init__(self) -> None:
            self.queue: list = []

        def put_samples(self, refs: list) -> int:
            self.queue.extend(refs)
            return len(self.queue)

        def get_samples(self, count: int) -> list:
            taken, self.queue[:count] = self.queue[:count], []
            return taken

        def pid(self) -> int:
            return os.getpid()

    try:
        queue = MessageQueue.remote()
        actor_pid = ray.get(queue.pid.remote())

        def submit_all() -> None:
            for group in groups:
                # A list holding the refs: Ray passes refs nested in an argument as refs, not values.
                ray.get(queue.put_samples.remote([[ray.put(arrays) for arrays in group]]))

        def collect_all() -> int:
            received = 0
            per_batch = MINI_BATCH // GROUP_SIZE
            for _ in range(len(groups) // per_batch):
                group_refs = ray.get(queue.get_samples.remote(per_batch))
                columns = ray.get([ref for refs in group_refs for ref in refs])
                token_ids, logprobs, loss_mask = pack(columns)
                received += token_ids.nbytes + logprobs.nbytes + loss_mask.nbytes
            return received

        figures = timed_run(submit_all, collect_all, payload)
        raylets = [int(p) for p in subprocess.run(["pgrep", "-f", f"raylet.*{workdir}"], capture_output=True,
                                                   text=True).stdout.split()]
        figures["server_peak_rss_mb"] = peak_rss_mb(actor_pid) + sum(peak_rss_mb(p) for p in raylets)
        return figures
    finally:
        ray.shutdown()


REVERB_COLUMNS = ("token_ids", "logprobs", "loss_mask")
REVERB_SERVER = """
import sys, time, reverb
server = reverb.Server(tables=[reverb.Table.queue(name="trajectories", max_size=1_000_000)], port=int(sys.argv[1]))
open(sys.argv[2], "w").write("ready")
server.wait()
"""


def drive_reverb(groups: list, workdir: Path) -> dict:
    import reverb

    payload = array_bytes(groups)
    port, ready = free_port(), workdir / "reverb.ready"
    log = open(workdir / "reverb.log", "wb")
    server = subprocess.Popen([sys.executable, "-c", REVERB_SERVER, str(port), str(ready)], stdout=log, stderr=log)
    try:
        wait_for(ready.exists, "the Reverb server's start")
        client = reverb.Client(f"127.0.0.1:{port}")
        with client.trajectory_writer(num_keep_alive_refs=1) as writer:  # warm-up, untimed: one item in and out
            writer.append(dict(zip(REVERB_COLUMNS, groups[0][0])))
            writer.create_item("trajectories", priority=1.0,
                               trajectory={name: writer.history[name][-1] for name in REVERB_COLUMNS})
        list(client.sample("trajectories", num_samples=1, emit_timesteps=False))

        def submit_all() -> None:
            with client.trajectory_writer(num_keep_alive_refs=1) as writer:
                for group in groups:
                    for token_ids, logprobs, loss_mask in group:
                        writer.append({"token_ids": token_ids, "logprobs": logprobs, "loss_mask": loss_mask})
                        writer.create_item("trajectories", priority=1.0,
                                           trajectory={name: writer.history[name][-1] for name in REVERB_COLUMNS})
                    writer.flush()

        def collect_all() -> int:
            received = 0
            for _ in range(len(groups) * GROUP_SIZE // MINI_BATCH):
                samples = list(client.sample("trajectories", num_samples=MINI_BATCH, emit_timesteps=False))
                # Without a table signature the data come back flattened, in the order of the dict's sorted keys.
                data = [s.data if isinstance(s.data, dict) else dict(zip(sorted(REVERB_COLUMNS), s.data))
                        for s in samples]
                columns = [(d["token_ids"], d["logprobs"], d["loss_mask"]) for d in data]
                token_ids, logprobs, loss_mask = pack(columns)
                received += token_ids.nbytes + logprobs.nbytes + loss_mask.nbytes
            return received

        figures = timed_run(submit_all, collect_all, payload)
        figures["server_peak_rss_mb"] = peak_rss_mb(server.pid)
        return figures
    finally:
        terminate(server)


def drive_atropos(groups: list, workdir: Path) -> dict:
    import urllib.request

    import atroposlib.api.server  # noqa: F401  (fails here, with the reason, when the package is missing)

    payload = array_bytes(groups)
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    log = open(workdir / "atropos.log", "wb")
    server = subprocess.Popen([sys.executable, "-m", "uvicorn", "atroposlib.api.server:app", "--host", "127.0.0.1",
                               "--port", str(port), "--log-level", "warning"], stdout=log, stderr=log)

    def call(path: str, body: Any = None) -> Any:
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(base + path, data=data, method="GET" if body is None else "POST",
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=300) as response:
            return json.loads(response.read())

    def up() -> bool:
        try:
            call("/")
            return True
        except OSError:
            return False

    try:
        wait_for(up, "the Atropos API server's start")
        tokens = len(groups[0][0][0])
        call("/register", {"wandb_group": "bench", "wandb_project": "bench", "batch_size": MINI_BATCH,
                           "max_token_len": tokens, "checkpoint_dir": str(workdir), "save_checkpoint_interval": 0,
                           "starting_step": 0, "num_steps": 1_000_000})
        call("/register-env", {"max_token_length": tokens, "desired_name": "bench", "weight": 1.0,
                               "group_size": GROUP_SIZE})

        def submit_all() -> None:
            for group in groups:
                call("/scored_data", {"tokens": [t.tolist() for t, _, _ in group],
                                      "masks": [m.tolist() for _, _, m in group],
                                      "inference_logprobs": [l.tolist() for _, l, _ in group],
                                      "scores": [float(j) for j in range(len(group))], "env_id": 0})

        def collect_all() -> int:
            received = 0
            for _ in range(len(groups) * GROUP_SIZE // MINI_BATCH):
                batch = None
                deadline = time.monotonic() + 300
                while batch is None and time.monotonic() < deadline:
                    batch = call("/batch")["batch"]
                columns = [(np.asarray(tokens, np.int32), np.asarray(logprobs, np.float32), np.asarray(masks, np.int32))
                           for group in batch for tokens, logprobs, masks in
                           zip(group["tokens"], group["inference_logprobs"], group["masks"])]
                token_ids, logprobs, loss_mask = pack(columns)
                received += token_ids.nbytes + logprobs.nbytes + loss_mask.nbytes
            return received

        figures = timed_run(submit_all, collect_all, payload)
        figures["server_peak_rss_mb"] = peak_rss_mb(server.pid)
        return figures
    finally:
        terminate(server)


DRIVERS = {"ours": drive_ours, "ray": drive_ray, "reverb": drive_reverb, "atropos": drive_atropos}


def driver_main(name: str, trajectories: int, tokens: int, workdir: Path) -> int:
    figures = DRIVERS[name](make_groups(trajectories, tokens), workdir)
    print("FIGURES " + json.dumps(figures), flush=True)
    return 0


# --------------------------------------------------------------------------------------------------- run

def peer_python(name: str, given: Optional[str]) -> Optional[str]:
    if name == "ours":
        return sys.executable
    if given:
        return given
    default = Path(f"/work/venvs-peers/{name}/bin/python")
    return str(default) if default.exists() else None


def run_peer(name: str, python: str, trajectories: int, tokens: int, workdir: Path) -> dict:
    workdir.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT) if name == "ours" else ""}
    try:
        done = subprocess.run([python, str(Path(__file__).resolve()), "--driver", name, "--trajectories",
                               str(trajectories), "--tokens", str(tokens), "--workdir", str(workdir)],
                              capture_output=True, text=True, timeout=PEER_TIMEOUT_SECONDS, env=env, cwd=REPO_ROOT)
    except subprocess.TimeoutExpired:
        return {"skipped": f"did not finish within {PEER_TIMEOUT_SECONDS} s"}
    for line in done.stdout.splitlines():
        if line.startswith("FIGURES "):
            return json.loads(line[len("FIGURES "):])
    reason = (done.stderr.strip().splitlines() or ["no output"])[-1]
    return {"skipped": f"exit {done.returncode}: {reason[:200]}"}


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trajectories", type=int, default=128)
    parser.add_argument("--tokens", type=int, default=32_768)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--peers", default=",".join(PEERS), help=f"comma-separated subset of {','.join(PEERS)}")
    for name in PEERS[1:]:
        parser.add_argument(f"--{name}-python", help=f"the Python with {name} installed "
                                                     f"(default /work/venvs-peers/{name}/bin/python)")
    parser.add_argument("--json", type=Path, help="write every figure to this file")
    parser.add_argument("--driver", help=argparse.SUPPRESS)
    parser.add_argument("--workdir", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.driver:
        return driver_main(args.driver, args.trajectories, args.tokens, args.workdir)
    if args.trajectories % MINI_BATCH:
        parser.error(f"--trajectories must be a multiple of {MINI_BATCH}")
    peers = [p for p in args.peers.split(",") if p]
    if "ours" not in peers:
        peers.insert(0, "ours")
    print(f"peers: {args.trajectories} trajectories x {args.tokens} tokens (token ids, logprobs, loss mask), groups of "
          f"{GROUP_SIZE}, mini-batches of {MINI_BATCH}; python {platform.python_version()}, {os.cpu_count()} cores")
    print("command: python bench/peers.py " + " ".join(argv if argv is not None else sys.argv[1:]))
    results: dict[str, list[dict]] = {p: [] for p in peers}
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="peers-") as tmp:
        for repeat in range(args.repeats):
            order = peers[repeat % len(peers):] + peers[:repeat % len(peers)]
            for name in order:
                python = peer_python(name, getattr(args, f"{name}_python", None))
                if python is None:
                    results[name].append({"skipped": f"no Python with it: install it in /work/venvs-peers/{name} "
                                                     f"or pass --{name}-python"})
                    continue
                result = run_peer(name, python, args.trajectories, args.tokens, Path(tmp) / f"{name}-{repeat}")
                results[name].append(result)
                print(f"  repeat {repeat + 1}, {name}: " + (result["skipped"] if "skipped" in result else
                      f"in {result['in_mb_s']:.1f} MB/s, out {result['out_mb_s']:.1f} MB/s, wall "
                      f"{result['wall_s']:.1f} s, peak RSS {result['server_peak_rss_mb']:.0f} MB"), flush=True)
    print(f"\nload average {load_before:.1f} before the run, {os.getloadavg()[0]:.1f} after "
          f"(2-core machine: figures under load are pessimistic; read the ratios)\n")
    keys = ("in_mb_s", "out_mb_s", "wall_s", "server_peak_rss_mb")

    def median(name: str, key: str) -> float:
        values = [r[key] for r in results[name] if "skipped" not in r]
        return statistics.median(values) if values else float("nan")

    ours = {key: median("ours", key) for key in keys}
    print(f"{'':10} {'MB/s in':>9} {'MB/s out':>9} {'wall s':>8} {'peak RSS MB':>12} | {'in/ours':>8} "
          f"{'out/ours':>9} {'wall/ours':>10} {'RSS/ours':>9}")
    for name in peers:
        if all("skipped" in r for r in results[name]):
            print(f"{name:10} skipped: {results[name][-1]['skipped']}")
            continue
        values = {key: median(name, key) for key in keys}
        print(f"{name:10} {values['in_mb_s']:9.1f} {values['out_mb_s']:9.1f} {values['wall_s']:8.1f} "
              f"{values['server_peak_rss_mb']:12.0f} | {values['in_mb_s'] / ours['in_mb_s']:8.2f} "
              f"{values['out_mb_s'] / ours['out_mb_s']:9.2f} {values['wall_s'] / ours['wall_s']:10.2f} "
              f"{values['server_peak_rss_mb'] / ours['server_peak_rss_mb']:9.2f}")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
