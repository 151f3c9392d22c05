"""What a trainer checkpoint of the pacer costs: the blob's size against the buffer it holds, and the time to
take it (Checkpoint) and to restore it (Restore) with a full buffer of long trajectories.

One `python -m coda_server` subprocess on 127.0.0.1:0, durable as shipped (server.state_dir in a temporary
directory, fsync normal; `--memory` keeps the state in memory), its message limit raised to fit the blob.
The buffer is filled through the real gRPC path: Dispatch, then Submit of `--groups` groups of
`--group-size` trajectories of `--tokens` tokens (token ids, logprobs and loss mask, as
bench/payload_path.py's: 512 x 32,768 tokens by default). Then, `--repeats` times: Checkpoint (timed at the
client, the blob in hand), and Restore of that blob (timed at the client: decode, apply, and with a state
directory the journal's snapshot of the restored state committed before the answer). While the first
Checkpoint is taken, another thread keeps calling GetState and Dispatch (a peek): their slowest answer says
what taking a checkpoint costs the rest of the job. Prints the figures; no target (issue 28 asks for them).

    python bench/checkpoint_cost.py            # 512 x 32K tokens, 3 repeats, about a minute
    python bench/checkpoint_cost.py --quick    # 64 x 32K tokens, 1 repeat
    python bench/checkpoint_cost.py --memory   # the same, state in memory only
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from coda_client import PacerClient, PromptRef, Trajectory, TrajectoryStatus  # noqa: E402

MESSAGE_BYTES = 2 * 1024 * 1024 * 1024 - 1  # gRPC's ceiling: the blob of a large buffer is one message


def start_server(workdir: Path, overrides: list[str]) -> tuple[subprocess.Popen, str]:
    port_file = workdir / "port.json"
    log = open(workdir / "server.log", "wb")
    process = subprocess.Popen([sys.executable, "-m", "coda_server", "--port-file", str(port_file),
                                "server.address=127.0.0.1:0", "server.metrics_address=", *overrides],
                               cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 60
    while not port_file.exists():
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            raise RuntimeError(f"server did not start:\n{(workdir / 'server.log').read_text()}")
        time.sleep(0.05)
    return process, json.loads(port_file.read_text())["address"]


def fill(pacer: PacerClient, groups: int, group_size: int, tokens: int) -> None:
    """Dispatch and complete `groups` groups: every one lands in the buffer."""
    rng = np.random.default_rng(0)
    refs = [PromptRef(f"epoch0_ds0_prompt{i}", 0, 0, i) for i in range(groups)]
    admitted = pacer.dispatch(refs).admitted
    assert len(admitted) == groups, f"admitted {len(admitted)} of {groups}: raise the window"
    for i in range(groups):
        pacer.submit([Trajectory(trajectory_id=f"{refs[i].prompt_id}#{j}", prompt_id=refs[i].prompt_id,
                                 status=TrajectoryStatus.COMPLETED, reward=1.0,
                                 token_ids=rng.integers(0, 151_936, tokens, dtype=np.int32),
                                 logprobs=-rng.exponential(2.0, tokens).astype(np.float32),
                                 loss_mask=np.ones(tokens, np.int32), start_weight_version=0, end_weight_version=0)
                      for j in range(group_size)])


class Prober(threading.Thread):
    """Calls GetState and a Dispatch peek back to back; keeps the slowest answer of each."""

    def __init__(self, address: str):
        super().__init__(daemon=True)
        self.client = PacerClient(address, timeout=600)
        self.stop = threading.Event()
        self.slowest = {"GetState": 0.0, "Dispatch": 0.0}
        self.calls = 0

    def run(self) -> None:
        while not self.stop.is_set():
            for name, call in (("GetState", self.client.state), ("Dispatch", lambda: self.client.dispatch([]))):
                started = time.perf_counter()
                call()
                self.slowest[name] = max(self.slowest[name], time.perf_counter() - started)
                self.calls += 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--groups", type=int, default=64)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=32_768)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--memory", action="store_true", help="state in memory only (server.state_dir=)")
    parser.add_argument("--quick", action="store_true", help="8 groups, 1 repeat")
    args = parser.parse_args(argv)
    if args.quick:
        args.groups, args.repeats = 8, 1
    with tempfile.TemporaryDirectory(prefix="checkpoint-cost-") as tmp:
        workdir = Path(tmp)
        overrides = [f"data_source.num_prompts_per_step={args.groups}",
                     f"data_source.num_trajectories_per_prompt={args.group_size}",
                     f"trainer.mini_batch_size={args.group_size}", "fully_async.sliding_window=no-window",
                     "fully_async.stale_steps=1.0", f"server.max_message_bytes={MESSAGE_BYTES}",
                     "server.state_dir=" + ("" if args.memory else str(workdir / "state"))]
        process, address = start_server(workdir, overrides)
        try:
            with PacerClient(address, timeout=600, max_message_bytes=MESSAGE_BYTES) as pacer:
                fill(pacer, args.groups, args.group_size, args.tokens)
                pacer.reset("abort", wait=0, resume=True, weight_version=1)
                held = pacer.state().held_bytes
                prober = Prober(address)
                prober.start()
                time.sleep(0.2)  # its first calls are under way
                takes, restores, sizes = [], [], []
                for repeat in range(args.repeats):
                    started = time.perf_counter()
                    taken = pacer.checkpoint()
                    takes.append(time.perf_counter() - started)
                    if repeat == 0:
                        prober.stop.set()
                        prober.join()
                    sizes.append(len(taken.blob))
                    pacer.dispatch([PromptRef("after", 0, 0, 10**6)])  # something to discard
                    started = time.perf_counter()
                    restored = pacer.restore(taken)
                    restores.append(time.perf_counter() - started)
                    assert restored.reinstated_groups == args.groups and restored.discarded_groups == args.groups + 1
                state = pacer.state()
                assert state.buffered == args.groups and state.held_bytes == held
        finally:
            process.terminate()
            process.wait(60)
    mb = 1024 * 1024
    print(f"checkpoint_cost: {args.groups} groups x {args.group_size} trajectories x {args.tokens} tokens in the "
          f"buffer, state {'in memory' if args.memory else 'durable (fsync normal)'}, {args.repeats} repeats, "
          f"python {sys.version.split()[0]}, {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}")
    print(f"  buffer held (GetState held_bytes)    {held / mb:10.1f} MiB")
    print(f"  checkpoint blob                      {statistics.median(sizes) / mb:10.1f} MiB "
          f"({statistics.median(sizes) / held:.4f} x the buffer)")
    print(f"  take (Checkpoint, blob in hand)      {statistics.median(takes):10.3f} s median "
          f"(min {min(takes):.3f}, max {max(takes):.3f})")
    print(f"  restore (Restore, answered)          {statistics.median(restores):10.3f} s median "
          f"(min {min(restores):.3f}, max {max(restores):.3f})")
    print(f"  while the first was taken: slowest GetState {prober.slowest['GetState'] * 1000:.1f} ms, slowest "
          f"Dispatch {prober.slowest['Dispatch'] * 1000:.1f} ms ({prober.calls} calls)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
