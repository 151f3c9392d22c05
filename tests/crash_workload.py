"""Worker processes of the durability crash test (tests/test_durability_crash.py), and what they share with it.

Each worker is a separate process (multiprocessing "spawn": no gRPC state crosses a fork) that loops
Dispatch -> Submit through `coda_client.PacerClient` while the test kills and restarts the server. Every
call carries an explicit request_id, and a call that fails because the server is gone (UNAVAILABLE,
DEADLINE_EXCEEDED) is retried with the SAME request_id until it is answered: the server applies it once and
a retry gets the first answer, even across restarts. What the server acknowledged is appended to the
worker's log file, flushed line by line:

    D <prompt_id>                         a Dispatch admitted this prompt
    T <trajectory_id> <prompt_id> <hash>  a Submit carrying this trajectory was acknowledged
    S <prompt_id>                         a Submit was refused STALE_GENERATION (a Reset dropped the group)
    E <prompt_id>                         a Submit was refused because the group's in-flight lease ran out
    RETRIES <n>                           calls retried after the server went away (written at the end)
    DONE                                  the worker stopped cleanly
    ERROR <message>                       anything unexpected (the test fails on it)
"""
from __future__ import annotations

import hashlib
import random
import time
import traceback
from pathlib import Path
from typing import Any, Callable, TypeVar

from coda_client import (
    DeadlineExceededError,
    PacerClient,
    StaleGenerationError,
    Trajectory,
    TrajectoryStatus,
    UnavailableError,
)

_T = TypeVar("_T")

# Reconnect quickly after a restart: gRPC's default backoff (1 s, growing 1.6x) would leave the workers
# idle for seconds after every kill. The values are ordinary client channel options.
FAST_RECONNECT = {
    "grpc.initial_reconnect_backoff_ms": 100,
    "grpc.min_reconnect_backoff_ms": 100,
    "grpc.max_reconnect_backoff_ms": 500,
}
CALL_TIMEOUT_SECONDS = 5.0  # per attempt; a server that is down makes the attempt wait for it this long
RETRY_BUDGET_SECONDS = 45.0  # one call may be retried for this long before the worker gives up (a test failure)
SERVER_GONE = (UnavailableError, DeadlineExceededError)


def fingerprint(trajectory: Trajectory) -> str:
    """Hash of everything the trajectory carries (its deterministic wire form): the trainer must get these bytes."""
    return hashlib.sha256(trajectory.to_pb().SerializeToString(deterministic=True)).hexdigest()


class Retrier:
    """Calls `fn` until the server answers, counting the attempts lost to a server that was down."""

    def __init__(self) -> None:
        self.retries = 0

    def __call__(self, fn: Callable[[], _T]) -> _T:
        give_up = time.monotonic() + RETRY_BUDGET_SECONDS
        while True:
            try:
                return fn()
            except SERVER_GONE:
                self.retries += 1
                if time.monotonic() > give_up:
                    raise
                time.sleep(0.05)


def make_trajectory(rng: random.Random, prompt_id: str, j: int, weight_version: int, worker: int,
                    status: TrajectoryStatus = TrajectoryStatus.COMPLETED) -> Trajectory:
    length = rng.randint(8, 48)
    return Trajectory(
        trajectory_id=f"{prompt_id}/t{j}", prompt_id=prompt_id, status=status,
        reward=float(rng.randint(0, 3)), token_ids=[rng.randrange(151_936) for _ in range(length)],
        logprobs=[-rng.randrange(4096) / 256 for _ in range(length)],  # exact in float32: the bytes round-trip
        loss_mask=[rng.randint(0, 1) for _ in range(length)], start_weight_version=weight_version,
        end_weight_version=weight_version, num_turns=1, metadata={"worker": str(worker), "j": str(j)},
        payload=rng.randbytes(rng.randint(16, 512)))


def run_worker(address: str, worker: int, log_path: str, stop: Any, seed: int, group_size: int) -> None:
    """Dispatch two prompts at a time, then submit each admitted group in one or two Submits, until `stop` is set."""
    rng = random.Random(seed * 1000 + worker)
    retry = Retrier()
    with open(log_path, "a", buffering=1) as log, PacerClient(address, timeout=CALL_TIMEOUT_SECONDS,
                                                             options=FAST_RECONNECT) as pacer:
        def note(line: str) -> None:
            log.write(line + "\n")
            log.flush()

        try:
            serial = calls = 0
            while not stop.is_set():
                candidates = [f"w{worker}-p{serial}", f"w{worker}-p{serial + 1}"]
                calls += 1
                request_id = f"w{worker}-c{calls}"
                answer = retry(lambda: pacer.dispatch(candidates, wait=0.5, request_id=request_id))
                if not answer.admitted:
                    continue  # window full or paused; the same prompt ids may be proposed again
                serial += 2
                for prompt_id in answer.admitted:
                    note(f"D {prompt_id}")
                for prompt_id in answer.admitted:
                    # One Submit, or two. Between the two halves a Reset may come: it drops the incomplete
                    # group, or, if the worker sees the pause first, the rest comes ABORTED (partial rollout)
                    # and the strategy's gate holds the complete group until the Reset returns it as restored.
                    cut = rng.choice([group_size, rng.randint(1, group_size - 1)]) if group_size > 1 else group_size
                    status, first = TrajectoryStatus.COMPLETED, 0
                    for last in sorted({cut, group_size}):
                        if first:
                            time.sleep(rng.uniform(0, 0.1))  # a slow second half: later groups wait at the gate
                            if retry(pacer.state).paused:
                                status = TrajectoryStatus.ABORTED
                        chunk = [make_trajectory(rng, prompt_id, j, answer.weight_version, worker, status)
                                 for j in range(first, last)]
                        first = last
                        calls += 1
                        request_id = f"w{worker}-c{calls}"
                        try:
                            retry(lambda: pacer.submit(chunk, request_id=request_id))
                        except StaleGenerationError:
                            note(f"S {prompt_id}")  # a Reset came first: the group is gone, move on
                            break
                        except Exception as exc:  # the group's in-flight lease ran out: also a refusal to expect
                            if getattr(exc, "reason", "") == "LEASE_EXPIRED":
                                note(f"E {prompt_id}")
                                break
                            raise
                        for t in chunk:
                            note(f"T {t.trajectory_id} {prompt_id} {fingerprint(t)}")
                    time.sleep(rng.uniform(0, 0.01))
            note(f"RETRIES {retry.retries}")
            note("DONE")
        except BaseException as exc:
            trace = " | ".join(traceback.format_exception(exc)).replace("\n", " ")
            note(f"ERROR {type(exc).__name__}: {exc} || {trace}")
            raise


class WorkerLog:
    """What one worker's log file says it got acknowledged."""

    def __init__(self, path: Path):
        self.admitted: list[str] = []
        self.acknowledged: dict[str, tuple[str, str]] = {}  # trajectory_id -> (prompt_id, fingerprint)
        self.stale: list[str] = []
        self.expired: list[str] = []
        self.retries = 0
        self.done = False
        self.errors: list[str] = []
        for line in Path(path).read_text().splitlines():
            kind, _, rest = line.partition(" ")
            if kind == "D":
                self.admitted.append(rest)
            elif kind == "T":
                trajectory_id, prompt_id, digest = rest.split()
                assert trajectory_id not in self.acknowledged, f"{trajectory_id} acknowledged twice by the worker"
                self.acknowledged[trajectory_id] = (prompt_id, digest)
            elif kind == "S":
                self.stale.append(rest)
            elif kind == "E":
                self.expired.append(rest)
            elif kind == "RETRIES":
                self.retries = int(rest)
            elif kind == "DONE":
                self.done = True
            elif kind == "ERROR":
                self.errors.append(rest)
