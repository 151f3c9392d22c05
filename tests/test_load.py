"""Load on loopback, bounded in count and time: 64 concurrent clients run the whole cycle for a fixed number of steps.

Clients: 1 trainer and 47 generation workers as threads of this process, plus 16 workers in 4 processes
(4 threads each); every one has its own PacerClient, so its own channel and connection. Workers
dispatch one prompt at a time (long-polling up to 1 s), submit its whole group (N trajectories with a
PAYLOAD_BYTES payload each) and go again; the trainer collects M // N groups at a time until it has B,
then resets (alternating ABORT and WAIT, waiting for running groups, resuming with the next weight
version) for STEPS steps. Then the workers stop and the trainer drains what is left.

Asserted:
- every trajectory a worker got accepted reaches the trainer exactly once (collected or restored by a
  Reset), with its payload intact; nothing is dropped, and the server ends with nothing running or buffered;
- the server's memory returns near its baseline once the buffer is drained.

"Near", and why: the baseline is the server's RSS (VmRSS from /proc/<pid>/status) after WARMUP_STEPS
warm-up steps run at full concurrency and drained (after one step, the allocators had not always reached
the working set: the RSS then went on to grow by up to 40 MiB and stay there, with no leak behind it; 40
cycles of 13 MiB each leave a server's RSS within a few MiB; with three warm-up steps, a run inside the full
suite still grew by 32.2 MiB where the same test alone grew by 2.6: the allocators had not yet seen the
peak concurrency of the measured steps, so ten warm-up steps now come first). By then the allocators (pymalloc, glibc malloc, gRPC's own) hold
the working set this load needs - memory a process frees is mostly kept for reuse, not returned to
the OS - so RSS before and after the measured steps compare like with like. The live data is bounded
by the window (C groups of N x PAYLOAD_BYTES, a few MiB), while the measured steps push several times
NEAR_RSS_BYTES of payload through the server. Allowing NEAR_RSS_BYTES (32 MiB) of growth leaves room
for allocator noise, yet a server keeping even a third of what passed through it fails. The server's
request-id replay caches are the one bounded exception (Collect and Reset answers carry trajectories):
server.request_id_cache_size=4 bounds them to 4 answers per method, and the test sends a few empty
Collects and Resets with request ids at the end so none of them still holds a payload.
"""
from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Callable


from coda_client import PacerClient, Trajectory, TrajectoryStatus
from coda_client.errors import StaleGenerationError

B, N, M = 24, 4, 16  # groups per step, group size, trajectories per trainer fetch
STALE_STEPS = 1.0  # window C = int(B * (1 + STALE_STEPS)) = 48 groups
STEPS = 20
WARMUP_STEPS = 10  # before the baseline: the allocators reach the working set this load needs
THREAD_WORKERS = 47
PROCESSES, THREADS_PER_PROCESS = 4, 4  # 16 more workers; with the trainer, 64 clients
PAYLOAD_BYTES = 128 * 1024
NEAR_RSS_BYTES = 32 << 20
TIME_LIMIT_SECONDS = 120.0
CONFIG = (f"data_source.num_prompts_per_step={B}", f"data_source.num_trajectories_per_prompt={N}",
          f"trainer.mini_batch_size={M}", f"fully_async.stale_steps={STALE_STEPS}",
          "server.request_id_cache_size=4", "server.log_level=WARNING", "rollout.continue_restored=false")


def payload(trajectory_id: str) -> bytes:
    """A payload the trainer can check: the id's digest, then filler up to PAYLOAD_BYTES."""
    head = hashlib.sha256(trajectory_id.encode()).digest()
    return head + bytes(PAYLOAD_BYTES - len(head))


def payload_ok(trajectory: Trajectory) -> bool:
    return len(trajectory.payload) == PAYLOAD_BYTES and trajectory.payload[:32] == hashlib.sha256(
        trajectory.trajectory_id.encode()).digest()


def worker(address: str, name: str, stop: Callable[[], bool]) -> dict:
    """A generation worker: dispatch one prompt, submit its whole group, repeat until `stop()`."""
    accepted: list[str] = []
    stale = 0
    with PacerClient(address, timeout=60) as client:
        k = 0
        while not stop():
            prompt_id = f"{name}-{k}"
            if not client.dispatch([prompt_id], wait=1.0).admitted:
                continue  # paused by a Reset, or the window is full: ask again
            k += 1
            group = [Trajectory(trajectory_id=f"{prompt_id}-t{i}", prompt_id=prompt_id,
                                status=TrajectoryStatus.COMPLETED, reward=float(i), token_ids=[1, 2, 3, i],
                                logprobs=[-0.5] * 4, payload=payload(f"{prompt_id}-t{i}")) for i in range(N)]
            try:
                result = client.submit(group)
            except StaleGenerationError:  # a Reset that gave up waiting for this group: not accepted
                stale += N
                continue
            assert result.accepted + result.duplicates == N
            accepted += [t.trajectory_id for t in group]
    return {"accepted": accepted, "stale": stale}


def run_threads(address: str, names: list[str], stop: Callable[[], bool]) -> tuple[list[threading.Thread], list]:
    results: list = []

    def run(name: str) -> None:
        try:
            results.append(worker(address, name, stop))
        except BaseException as exc:  # reported by the test, not lost in a thread
            results.append({"error": repr(exc)})

    threads = [threading.Thread(target=run, args=(name,), daemon=True) for name in names]
    for thread in threads:
        thread.start()
    return threads, results


def rss_bytes(pid: int, field: str = "VmRSS") -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no {field} for pid {pid}")


class Trainer:
    """The trainer client: collects, resets, and records every trajectory it receives."""

    def __init__(self, address: str):
        self.client = PacerClient(address, timeout=60)
        self.delivered: Counter = Counter()
        self.bad_payloads: list[str] = []
        self.dropped: list[str] = []

    def take(self, groups) -> None:
        for group in groups:
            for t in group.trajectories:
                self.delivered[t.trajectory_id] += 1
                if not payload_ok(t):
                    self.bad_payloads.append(t.trajectory_id)

    def step(self, number: int) -> None:
        got = 0
        while got < B:
            groups = self.client.collect(M // N, wait=30)
            assert groups, f"step {number}: no groups within 30 s"
            self.take(groups)
            got += len(groups)
        result = self.client.reset("abort" if number % 2 else "wait", wait=30, resume=True, weight_version=number + 1)
        self.take(result.restored)
        self.dropped += result.dropped_prompt_ids

    def quiesce(self) -> None:
        """Pause (a Reset waiting for running groups, no resume), drain the buffer, then push the answers that
        carried trajectories out of the size-4 Collect and Reset replay caches with empty ones."""
        result = self.client.reset("wait", wait=30)
        self.take(result.restored)
        self.dropped += result.dropped_prompt_ids
        while groups := self.client.collect(M // N, allow_partial=True):
            self.take(groups)
        for _ in range(4):
            assert not self.client.collect(1, allow_partial=True)
            assert not self.client.reset("wait", wait=30).restored


def test_64_clients_full_cycle_exactly_once_and_memory_returns(tmp_path):
    from server_harness import ServerProcess

    started = time.monotonic()
    with ServerProcess(tmp_path, *CONFIG) as server:
        pid = server.process.pid
        stop_file = tmp_path / "stop"
        stop = threading.Event()
        processes = []
        for p in range(PROCESSES):
            ready = tmp_path / f"ready-{p}"
            processes.append((subprocess.Popen(
                [sys.executable, __file__, server.address, str(stop_file), str(ready), f"proc{p}"],
                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=Path(__file__).parent), ready))
        threads, results = run_threads(server.address, [f"thr{i}" for i in range(THREAD_WORKERS)], stop.is_set)
        trainer = Trainer(server.address)
        try:
            deadline = time.monotonic() + 60
            while not all(ready.exists() for _, ready in processes):
                assert all(proc.poll() is None for proc, _ in processes), [proc.communicate() for proc, _ in processes]
                assert time.monotonic() < deadline, "worker processes did not start"
                time.sleep(0.05)

            # Warm-up steps at full concurrency, then paused and drained: the baseline.
            for number in range(WARMUP_STEPS):
                trainer.step(number)
            trainer.quiesce()
            baseline = rss_bytes(pid)
            delivered_before = sum(trainer.delivered.values())
            trainer.client.resume(weight_version=WARMUP_STEPS)

            for number in range(WARMUP_STEPS, WARMUP_STEPS + STEPS):
                trainer.step(number)
            measured = sum(trainer.delivered.values()) - delivered_before
        finally:
            stop.set()
            stop_file.touch()
            for thread in threads:
                thread.join(30)
            outputs = []
            for proc, _ in processes:
                out, err = proc.communicate(timeout=60)
                outputs.append((proc.returncode, out, err))
        trainer.quiesce()
        state = trainer.client.state()
        final = rss_bytes(pid)
        peak = rss_bytes(pid, "VmHWM")
        trainer.client.close()
        elapsed = time.monotonic() - started

        for code, out, err in outputs:
            assert code == 0, err
            results += json.loads(out)
        assert not [r for r in results if "error" in r], [r for r in results if "error" in r]
        assert all(not thread.is_alive() for thread in threads)
        assert len(results) == THREAD_WORKERS + PROCESSES * THREADS_PER_PROCESS == 63

        accepted = Counter(t for r in results for t in r["accepted"])
        assert all(count == 1 for count in accepted.values())  # trajectory ids are unique per worker
        # Exactly once: everything accepted was delivered, nothing twice, nothing that was never accepted.
        assert trainer.delivered == accepted, (len(trainer.delivered), len(accepted))
        assert not trainer.bad_payloads and not trainer.dropped
        assert sum(r["stale"] for r in results) == 0
        assert (state.running, state.buffered, state.queued_trajectories, state.leased) == (0, 0, 0, 0)
        assert state.dispatched == state.collected + state.filtered + state.restored + state.dropped + state.expired
        assert state.step == WARMUP_STEPS + STEPS + 1 and state.paused  # warm-up, resume after the baseline, the steps
        # Every client took part.
        assert len({t.rsplit("-", 2)[0] for t in accepted}) == 63

        passed_through = measured * PAYLOAD_BYTES
        print(f"\nload: {len(accepted)} trajectories ({len(accepted) * PAYLOAD_BYTES / 2**20:.0f} MiB of payload), "
              f"{STEPS} measured steps in {elapsed:.1f}s; server RSS baseline {baseline / 2**20:.1f} MiB, "
              f"peak {peak / 2**20:.1f} MiB, after drain {final / 2**20:.1f} MiB "
              f"({(final - baseline) / 2**20:+.1f} MiB; {passed_through / 2**20:.0f} MiB passed through)")
        assert passed_through > 3 * NEAR_RSS_BYTES, "too little data to tell a leak from noise"
        assert final - baseline < NEAR_RSS_BYTES, (
            f"server RSS grew by {(final - baseline) / 2**20:.1f} MiB (baseline {baseline / 2**20:.1f} MiB, "
            f"after drain {final / 2**20:.1f} MiB) while {passed_through / 2**20:.0f} MiB passed through")
        assert elapsed < TIME_LIMIT_SECONDS


def process_main(address: str, stop_file: str, ready_file: str, name: str) -> None:
    """A worker process: THREADS_PER_PROCESS workers until the stop file appears; prints their results as JSON."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    with PacerClient(address, timeout=60) as client:
        client.state()  # connected
    Path(ready_file).touch()
    threads, results = run_threads(address, [f"{name}.{i}" for i in range(THREADS_PER_PROCESS)],
                                   lambda: os.path.exists(stop_file))
    for thread in threads:
        thread.join()
    errors = [r for r in results if "error" in r]
    if errors:
        print(json.dumps(errors), file=sys.stderr)
        sys.exit(1)
    print(json.dumps(results))


if __name__ == "__main__":
    process_main(*sys.argv[1:5])
