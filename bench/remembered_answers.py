"""What remembered request-id answers cost at each Reset: Reset time, server RSS and state size against N kept answers.

The server keeps the answer of every Dispatch, Submit, Ack (and Collect) by request_id, up to
server.request_id_cache_size per RPC (65,536 by default; Collect fewer), and writes them all into the snapshot
every Reset takes (coda_server/core/answers.py AnswerBook.export, the journal's snapshot). This runs, in one
process tree and one run, one `python -m coda_server` subprocess per N on `127.0.0.1:0`, each durable as
shipped (server.state_dir in its own temporary directory, fsync normal), and fills each through real RPCs, as
a worker and a trainer would, every call with its own request id: Dispatch of one prompt, Submit of its one
trajectory (groups of 1), Collect of one group under a lease, Ack of that lease; N times, so each server keeps
N answers of Dispatch, Submit and Ack (and min(N, the Collect limit) of Collect). The buffer ends empty.
A control server gets the same rounds as the second largest N with server.request_id_cache_size=1: what that
traffic leaves (journal pages, allocator high-water marks) without the answers.

Then, `--repeats` rounds over the servers (the order rotating each round, so machine noise hits all alike):
a Reset (ABORT, wait 0, resume, timed at the client: the snapshot is committed before the answer) with an
empty buffer. Reported: median Reset time, server RSS, state directory size and the snapshot row's size (read
from the SQLite file), with ratios to N=0 measured side by side in the same run.

    python bench/remembered_answers.py            # N = 0, 4096, 16384, 65536; under 4 minutes
    python bench/remembered_answers.py --quick    # N = 0, 2048, 8192; about 30 seconds
"""
from __future__ import annotations

import argparse
import asyncio
import os
import platform
import sqlite3
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Optional

sys.path.insert(0, str(Path(__file__).resolve().parent))
import durability_cost  # noqa: E402  (directory_bytes)
import rpc_throughput as rt  # noqa: E402  (the server process, the command line, medians)

from coda_client import AsyncPacerClient, PacerClient, PromptRef, Trajectory, TrajectoryStatus  # noqa: E402

DEFAULT_COUNTS = (0, 4096, 16384, 65536)
QUICK_COUNTS = (0, 2048, 8192)
CONTROL_OVERRIDE = "server.request_id_cache_size=1"
TOKENS = 16  # per trajectory: small, so what is measured is the answers, not the buffer
OVERRIDES = [
    "server.address=127.0.0.1:0",
    "server.metrics_address=127.0.0.1:0",
    "server.log_rpcs=false",  # as answers_probe.py ran; the per-RPC log is not what is measured
    "fully_async.sliding_window=windowed-fifo",
    "fully_async.stale_steps=1.0",
    "data_source.num_prompts_per_step=1048576",  # Dispatch always admits
    "data_source.num_trajectories_per_prompt=1",  # one Submit completes one group
    "trainer.mini_batch_size=1",
]


def rid() -> str:
    return uuid.uuid4().hex


async def fill(address: str, count: int, inflight: int, offset: int = 0) -> None:
    """`count` rounds of Dispatch, Submit, Collect (lease) and Ack, `inflight` rounds at a time."""
    async with AsyncPacerClient(address, client_id="remembered-answers-bench", timeout=120) as pacer:
        next_index = iter(range(offset, offset + count))

        async def one_round(i: int) -> None:
            ref = PromptRef(f"epoch0_ds0_prompt{i}", 0, 0, i)
            admitted = (await pacer.dispatch([ref], request_id=rid())).admitted
            assert len(admitted) == 1, f"Dispatch admitted {admitted}"
            result = await pacer.submit([Trajectory(trajectory_id=f"{ref.prompt_id}#0", prompt_id=ref.prompt_id,
                                                    status=TrajectoryStatus.COMPLETED, reward=1.0,
                                                    token_ids=list(range(TOKENS)), logprobs=[-0.5] * TOKENS,
                                                    loss_mask=[1] * TOKENS)], request_id=rid())
            assert result.accepted == 1, f"Submit answered {result}"
            while True:  # another round may have taken the group this one completed: wait for the next
                collected = await pacer.collect_result(1, wait=10.0, request_id=rid(), lease=600.0)
                if collected.groups:
                    break
            assert await pacer.ack(collected.lease_id, request_id=rid()) == 1

        async def runner() -> None:
            for i in next_index:
                await one_round(i)

        await asyncio.gather(*(runner() for _ in range(inflight)))


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def snapshot_bytes(state_dir: Path) -> float:
    """Size of the snapshot row in the SQLite journal (NaN when it cannot be read)."""
    try:
        db = sqlite3.connect(f"file:{state_dir / 'pacer.sqlite3'}?mode=ro", uri=True, timeout=5)
        try:
            row = db.execute("SELECT length(body) FROM snapshot WHERE id = 1").fetchone()
        finally:
            db.close()
        return float(row[0]) if row else float("nan")
    except sqlite3.Error:
        return float("nan")


def timed_reset(pacer: PacerClient) -> float:
    version = pacer.state().weight_version + 1
    started = time.perf_counter()
    pacer.reset("abort", wait=0, resume=True, weight_version=version)
    return time.perf_counter() - started


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help=f"N in {QUICK_COUNTS}, 3 repeats")
    parser.add_argument("--counts", help=f"comma-separated N (default {','.join(map(str, DEFAULT_COUNTS))})")
    parser.add_argument("--repeats", type=int, help="Resets timed per server (default 7, quick 3)")
    parser.add_argument("--inflight", type=int, default=32, help="fill rounds in flight per server (default 32)")
    parser.add_argument("--state-root", help="directory for the state directories (default: a temporary "
                                             "directory under $TMPDIR)")
    parser.add_argument("--server-arg", action="append", default=[], metavar="KEY=VALUE",
                        help="extra configuration override for every server (repeatable)")
    parser.add_argument("--control", type=int, metavar="ROUNDS",
                        help="rounds of the control server, which keeps 1 answer per RPC "
                             "(server.request_id_cache_size=1): what the same traffic leaves without the answers "
                             "(default: the second largest N; 0: none)")
    args = parser.parse_args(argv)
    counts = tuple(int(x) for x in args.counts.split(",")) if args.counts else (
        QUICK_COUNTS if args.quick else DEFAULT_COUNTS)
    counts = tuple(sorted(set(counts) | {0}))
    repeats = args.repeats or (3 if args.quick else 7)
    control = args.control if args.control is not None else (counts[-2] if len(counts) > 2 else 0)
    # Label -> (fill rounds, configuration of its own): the N servers, then the control.
    specs: dict[str, tuple[int, list[str]]] = {str(n): (n, []) for n in counts}
    if control:
        specs[f"{control} kept 1"] = (control, [CONTROL_OVERRIDE])

    print(f"command: {rt.command_line()}")
    print(f"python {platform.python_version()}, {os.cpu_count()} cores, load average "
          f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="coda-answers-bench-") as tmp, \
            tempfile.TemporaryDirectory(prefix="coda-answers-state-", dir=args.state_root) as state_root:
        state_dirs = {label: Path(state_root) / f"s{i}" for i, label in enumerate(specs)}
        servers = {label: rt.ServerProcess(f"s{i}", Path(tmp), None,
                                           [*OVERRIDES, f"server.state_dir={state_dirs[label]}", *extra,
                                            *args.server_arg])
                   for i, (label, (_, extra)) in enumerate(specs.items())}
        print(f"servers: python -m coda_server {' '.join(OVERRIDES + args.server_arg)} server.state_dir=DIR/sI"
              + (f"; control ({control} rounds) also {CONTROL_OVERRIDE}" if control else ""))
        clients: dict[str, PacerClient] = {}
        try:
            for server in servers.values():
                server.start()
            for n, server in servers.items():
                server.wait_ready()
                clients[n] = PacerClient(server.address, client_id="remembered-answers-bench", timeout=120)
            for label, (rounds, _) in specs.items():
                if rounds:
                    began = time.monotonic()
                    asyncio.run(fill(servers[label].address, rounds, args.inflight))
                    state = clients[label].state()
                    assert state.buffered == 0, f"N={label}: {state.buffered} groups left in the buffer"
                    print(f"  filled N={label}: {4 * rounds} calls in {time.monotonic() - began:.1f} s", flush=True)
            for client in clients.values():  # unreported: the first snapshot of each, after the fill
                timed_reset(client)
            labels = list(specs)
            times: dict[str, list[float]] = {label: [] for label in labels}
            for repeat in range(repeats):
                order = labels[repeat % len(labels):] + labels[:repeat % len(labels)]
                for label in order:
                    times[label].append(timed_reset(clients[label]))
                print(f"  repeat {repeat + 1}/{repeats}: "
                      + "  ".join(f"N={label} {times[label][-1] * 1000:.1f} ms" for label in labels), flush=True)
            rows = {n: {"reset_ms": rt.median(times[n]) * 1000, "min_ms": min(times[n]) * 1000,
                        "max_ms": max(times[n]) * 1000, "rss_mb": rss_mb(servers[n].process.pid),
                        "dir_mb": durability_cost.directory_bytes(state_dirs[n]) / 2**20,
                        "snap_mb": snapshot_bytes(state_dirs[n]) / 2**20} for n in labels}
        finally:
            for client in clients.values():
                client.close()
            for server in servers.values():
                server.stop()
    base = rows["0"]
    header = (f"{'N answers/RPC':>15} {'Reset ms':>9} {'(min-max)':>17} {'RSS MB':>7} {'state dir MB':>12} "
              f"{'snapshot MB':>11} | {'x Reset':>8} {'x RSS':>6} {'x dir':>6} {'x snap':>7}")
    print()
    print(header)
    print("-" * len(header))
    for n in labels:
        row = rows[n]
        spread = f"({row['min_ms']:.1f}-{row['max_ms']:.1f})"
        print(f"{n:>15} {row['reset_ms']:>9.1f} {spread:>17} "
              f"{row['rss_mb']:>7.1f} {row['dir_mb']:>12.2f} {row['snap_mb']:>11.3f} | "
              f"{row['reset_ms'] / base['reset_ms']:>8.1f} {row['rss_mb'] / base['rss_mb']:>6.2f} "
              f"{row['dir_mb'] / base['dir_mb']:>6.1f} {row['snap_mb'] / base['snap_mb']:>7.1f}")
    print()
    print(f"N: answers kept per RPC for Dispatch, Submit and Ack (Collect: min(N, its limit)), each filled by N "
          f"Dispatch+Submit+Collect+Ack rounds with fresh request ids; buffer empty at every Reset.")
    if control:
        print(f"'{control} kept 1': the control server, the same {control} rounds with {CONTROL_OVERRIDE} (1 answer "
              f"kept per RPC): what that traffic leaves in memory and on disk without the answers.")
    print(f"Reset ms: median of {repeats} Resets (ABORT, wait 0, resume) per server, timed at the client, the "
          f"servers taken in a rotating order; x = ratio to N=0 in the same run.")
    print("RSS: the server's VmRSS after the Resets; state dir: every file in server.state_dir (SQLite does not "
          "shrink its file); snapshot: length of the snapshot row.")
    print(f"wall time {time.monotonic() - started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
