"""Crash test: a real workload through the client while the server is killed with SIGKILL and restarted.

Worker processes (tests/crash_workload.py) loop Dispatch -> Submit, a trainer thread here collects and
resets each step, and the test kills the server at random (seeded) moments and restarts it on the same
port and server.state_dir. Every call carries a request_id and is retried with the same id until answered.
At the end it proves, from what the server acknowledged: every acknowledged trajectory reached the trainer
exactly once with the bytes sent, or came back from a Reset (restored, expired, or part of a dropped
incomplete group); none twice; and the server's counters agree with the clients and with each other.

    CODA_CRASH_SEED=7 CODA_CRASH_KILLS=12 pytest tests/test_durability_crash.py -s   # another run, figures printed
"""
from __future__ import annotations

import multiprocessing
import os
import random
import re
import socket
import threading
import time
from collections import Counter
from pathlib import Path

import crash_workload
from coda_client import PacerClient
from crash_workload import FAST_RECONNECT, Retrier, WorkerLog, fingerprint
from server_harness import ServerProcess

B, N, M = 4, 2, 4  # prompts per step, group size, trainer mini-batch (trajectories): one fetch takes M // N groups
WORKERS = 3
SEED = int(os.environ.get("CODA_CRASH_SEED", "20261129"))
KILLS = int(os.environ.get("CODA_CRASH_KILLS", "7"))


def free_port() -> int:
    """A free port below the kernel's ephemeral range: a server restarted on it must find it still free,
    and a port from that range can be taken meanwhile by any outgoing connection (the reconnecting client's
    own included), which then fails the restart with "Address already in use"."""
    try:
        low = int(open("/proc/sys/net/ipv4/ip_local_port_range").read().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    for port in random.sample(range(max(1024, low - 12000), low), 200):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port below the ephemeral range")


def durable_overrides(state_dir: Path, port: int, *extra: str) -> list[str]:
    """A small pacing config on a fixed port (restarts keep the address) with durable state."""
    return [f"data_source.num_prompts_per_step={B}", f"data_source.num_trajectories_per_prompt={N}",
            f"trainer.mini_batch_size={M}", "fully_async.stale_steps=1.0", "fully_async.sliding_window=windowed-fifo",
            f"server.state_dir={state_dir}", f"server.address=127.0.0.1:{port}", "server.metrics_address=",
            # The trainer here takes restored groups back from each Reset (continuation has its own tests).
            "rollout.continue_restored=false", *extra]


def check_invariant(state) -> None:
    """GetState's counters add up (fields from later protocol versions count when present)."""
    expired = getattr(state, "expired", 0)
    leased = getattr(state, "leased", 0)
    assert state.dispatched == (state.running + state.collected + state.filtered + state.restored + state.dropped
                                + expired), state
    assert state.buffered == state.collected - state.consumed - leased, state


class Trainer(threading.Thread):
    """Collects B groups per step (M // N per fetch), then Reset(abort, resume) with the next weight version.

    Every call has a request_id and is retried with it until answered; a Collect answered empty (timed
    out) is answered, so the next attempt takes a new id.
    """

    def __init__(self, address: str):
        super().__init__(name="trainer", daemon=True)
        self.client = PacerClient(address, timeout=crash_workload.CALL_TIMEOUT_SECONDS, options=FAST_RECONNECT)
        self.retry = Retrier()
        self.halt = threading.Event()
        self.consumed: list = []  # TrajectoryGroup, in delivery order
        self.restored: list = []
        self.expired: list = []
        self.dropped: list[str] = []
        self.steps = 0
        self.calls = 0
        self.error: BaseException | None = None

    def request_id(self, kind: str) -> str:
        self.calls += 1
        return f"trainer-{kind}{self.calls}"

    def run(self) -> None:
        try:
            while not self.halt.is_set():
                for _ in range(B * N // M):
                    while not self.halt.is_set():
                        request_id = self.request_id("c")
                        answer = self.retry(lambda: self.client.collect_result(M // N, wait=1.0, request_id=request_id))
                        if answer.groups:
                            assert len(answer.groups) == M // N
                            self.consumed.extend(answer.groups)
                            break
                self.reset(weight_version=self.steps + 1)
                self.steps += 1
        except BaseException as exc:  # surfaced by the test
            self.error = exc

    def reset(self, weight_version: int, resume: bool = True):
        request_id = self.request_id("r")
        answer = self.retry(lambda: self.client.reset("abort", wait=0.1, resume=resume, weight_version=weight_version,
                                                      request_id=request_id))
        self.restored.extend(answer.restored)
        self.expired.extend(getattr(answer, "expired", []))
        self.dropped.extend(answer.dropped_prompt_ids)
        return answer

    def drain(self) -> None:
        while True:
            request_id = self.request_id("d")
            groups = self.retry(lambda: self.client.collect(64, wait=0, allow_partial=True, request_id=request_id))
            if not groups:
                return
            self.consumed.extend(groups)


def test_sigkill_at_random_points_loses_and_duplicates_no_acknowledged_trajectory(tmp_path):
    rng = random.Random(SEED)
    port = free_port()
    overrides = durable_overrides(tmp_path / "state", port)
    started = time.monotonic()
    servers = [ServerProcess(tmp_path, *overrides).start()]
    address = servers[0].address
    context = multiprocessing.get_context("spawn")
    stop = context.Event()
    logs = [tmp_path / f"worker-{i}.log" for i in range(WORKERS)]
    workers = [context.Process(target=crash_workload.run_worker, args=(address, i, str(logs[i]), stop, SEED, N),
                               daemon=True) for i in range(WORKERS)]
    trainer = Trainer(address)
    kill_times: list[float] = []
    recovered_states = []
    try:
        for worker in workers:
            worker.start()
        trainer.start()
        # Kill only once every worker is pacing (a spawned interpreter takes a moment to import gRPC).
        deadline = time.monotonic() + 30
        while not all(log.exists() and "D " in log.read_text() for log in logs):
            assert time.monotonic() < deadline, "workers did not start dispatching within 30 s"
            assert all(w.is_alive() for w in workers), "a worker died at start"
            time.sleep(0.05)

        observer = PacerClient(address, timeout=crash_workload.CALL_TIMEOUT_SECONDS, options=FAST_RECONNECT)
        observe = Retrier()
        long_outage = rng.randrange(KILLS)
        for k in range(KILLS):
            time.sleep(rng.uniform(0.3, 2.0))  # a random point of the workload
            servers[-1].kill()  # SIGKILL: no drain, no journal close, the lock dies with the process
            kill_times.append(time.monotonic() - started)
            # Calls wait for the server (wait-for-ready) up to their deadline; one outage outlasts it, so
            # calls fail DEADLINE_EXCEEDED and the clients retry them with the same request_id.
            time.sleep(crash_workload.CALL_TIMEOUT_SECONDS + 0.5 if k == long_outage else rng.uniform(0.0, 0.3))
            servers.append(ServerProcess(tmp_path, *overrides).start())
            state = observe(observer.state)
            check_invariant(state)  # the recovered state adds up
            recovered_states.append(state)
            assert trainer.is_alive(), f"trainer stopped: {trainer.error!r}"
        time.sleep(1.0)  # the workload runs on after the last restart

        stop.set()
        for worker, log in zip(workers, logs):
            worker.join(60)
            if worker.exitcode != 0:
                errors = WorkerLog(log).errors
                raise AssertionError(f"{worker.name} exited with {worker.exitcode}: "
                                     f"{errors[-1][:2000] if errors else 'no error logged'}")
        trainer.halt.set()
        trainer.join(60)
        assert not trainer.is_alive(), "trainer did not stop"
        assert trainer.error is None, f"trainer failed: {trainer.error!r}"
        # The end: a final Reset returns what is in flight, and the buffer is drained.
        trainer.reset(weight_version=trainer.steps + 1, resume=False)
        trainer.drain()
        final = observe(observer.state)
        observer.close()
    finally:
        stop.set()
        trainer.halt.set()
        for worker in workers:
            if worker.is_alive():
                worker.join(10)
            if worker.is_alive():
                worker.kill()
        for server in servers:
            server.close()
        trainer.client.close()
    duration = time.monotonic() - started

    worker_logs = [WorkerLog(log) for log in logs]
    for i, log in enumerate(worker_logs):
        assert not log.errors, f"worker {i}: {log.errors}"
        assert log.done, f"worker {i} did not stop cleanly"
    acknowledged: dict[str, tuple[str, str]] = {}
    for log in worker_logs:
        acknowledged.update(log.acknowledged)
    admitted = [p for log in worker_logs for p in log.admitted]

    # What came back to the trainer, by trajectory id: each at most once, across deliveries and Resets.
    delivered = [t for g in trainer.consumed for t in g.trajectories]
    returned = [t for g in (*trainer.restored, *trainer.expired) for t in g.trajectories]
    seen = Counter(t.trajectory_id for t in (*delivered, *returned))
    twice = {tid: n for tid, n in seen.items() if n > 1}
    assert not twice, f"delivered or returned more than once: {sorted(twice)[:10]}"
    dropped = Counter(trainer.dropped)
    assert all(n == 1 for n in dropped.values()), f"prompts dropped twice: {[p for p, n in dropped.items() if n > 1]}"
    came_back_prompts = {g.prompt_id for g in (*trainer.consumed, *trainer.restored, *trainer.expired)}
    assert not came_back_prompts & set(dropped), "a dropped group was also delivered or restored"

    # Nothing acknowledged is lost: delivered, returned by a Reset, or part of a group a Reset dropped.
    lost = [tid for tid, (prompt_id, _) in acknowledged.items() if tid not in seen and prompt_id not in dropped]
    assert not lost, f"{len(lost)} acknowledged trajectories never came back: {lost[:10]}"
    # Nothing comes back that was not acknowledged, and it comes back byte for byte.
    unknown = [t.trajectory_id for t in (*delivered, *returned) if t.trajectory_id not in acknowledged]
    assert not unknown, f"came back without an acknowledged Submit: {unknown[:10]}"
    altered = [t.trajectory_id for t in (*delivered, *returned) if fingerprint(t) != acknowledged[t.trajectory_id][1]]
    assert not altered, f"bytes differ from what the worker sent: {altered[:10]}"

    # The server's counters agree with each other and with what the clients were told.
    check_invariant(final)
    assert final.running == 0 and final.buffered == 0 and getattr(final, "leased", 0) == 0, final
    assert final.dispatched == len(admitted) == len(set(admitted)), (final.dispatched, len(admitted))
    assert final.submitted == len(acknowledged), (final.submitted, len(acknowledged))
    assert final.duplicates == 0, final  # every retry was answered from the request_id memory, not re-applied
    assert final.consumed == len(trainer.consumed)
    assert final.restored == len(trainer.restored) and final.dropped == len(trainer.dropped)
    assert getattr(final, "expired", 0) == len(trainer.expired)
    assert final.filtered == 0
    assert final.step == trainer.steps and final.weight_version == trainer.steps

    # The run did real work across the kills.
    assert len(kill_times) == KILLS
    assert trainer.steps >= KILLS // 2, f"only {trainer.steps} training steps in {duration:.0f}s"
    assert any(s.running or s.buffered for s in recovered_states), "no kill caught groups running or buffered"
    replayed = [int(m) for server in servers[1:] for m in re.findall(r"(\d+) events replayed", server.log())]
    assert len(replayed) == KILLS and sum(replayed) > 0, replayed
    retries = sum(log.retries for log in worker_logs) + trainer.retry.retries
    assert retries > 0, "no call outlived the long outage: the same-request_id retry path was not exercised"
    assert duration < 90, f"the crash test took {duration:.0f}s"
    print(f"\ncrash test (seed {SEED}): {KILLS} SIGKILLs at {', '.join(f'{t:.1f}' for t in kill_times)} s; "
          f"{duration:.1f} s; {len(admitted)} groups dispatched, {len(acknowledged)} trajectories acknowledged, "
          f"{len(delivered)} delivered in {len(trainer.consumed)} groups over {trainer.steps} steps, "
          f"{len(returned)} returned by Resets ({len(trainer.restored)} restored / {len(trainer.expired)} expired "
          f"groups), {len(trainer.dropped)} incomplete groups dropped; {retries} calls failed (deadline) and were "
          f"retried; "
          f"events replayed per recovery {replayed}; running/buffered groups recovered "
          f"{[(s.running, s.buffered) for s in recovered_states]}")
