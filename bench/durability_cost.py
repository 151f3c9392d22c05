"""What durable state costs (issue 4, Performance): Submit throughput with server.state_dir off and on.

Runs, in one process tree and one run, four `python -m coda_server` subprocesses on `127.0.0.1:0`, identical
but for durability:

* `memory`: server.state_dir empty (the explicit choice of memory only);
* `fsync=off`, `fsync=normal` (the default policy: with the default state_dir, what a server started
  without settings does), `fsync=full`: server.state_dir set (each its own directory under --state-root)
  and server.fsync set to that policy.

The load is bench/rpc_throughput.py's, through the real gRPC server (its client worker processes,
request builder, server configuration and answer checks are imported from there): batched Submits of
64 trajectories x 1,000 tokens (~0.5 MB each, one group completed per call), and, for the per-call
commit cost, small Dispatches of 4 candidates. Every request carries a request_id. Runs interleave the
four servers in a rotating order, repeat, and report medians and ratios to `memory`.

    python bench/durability_cost.py            # normal run, about 4 minutes
    python bench/durability_cost.py --quick    # smoke run, under a minute
    python bench/durability_cost.py --state-root /mnt/volume    # measure the disk the journal will live on

Target: fsync=normal keeps >= 0.5 of the in-memory Submit throughput (exit status 1 otherwise).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

import grpc

sys.path.insert(0, str(Path(__file__).resolve().parent))
import rpc_throughput as rt  # noqa: E402  (the load, the server process and the answer checks)

POLICIES = ("off", "normal", "full")
CONFIGS = ("memory", *(f"fsync={p}" for p in POLICIES))
TARGET_CONFIG, TARGET_RATIO = "fsync=normal", 0.5
SCENARIOS = {
    "submit": f"Submit, {rt.GROUP_SIZE} traj x {rt.TOKENS_PER_TRAJECTORY} tokens",
    "dispatch": "Dispatch, 4 candidates, all admitted",
}
TARGET_SCENARIO = "submit"


def overrides_for(config: str, state_root: Path) -> list[str]:
    if config == "memory":
        return list(rt.OUR_OVERRIDES)
    policy = config.split("=", 1)[1]
    return [*rt.OUR_OVERRIDES, f"server.state_dir={state_root / policy}", f"server.fsync={policy}"]


def disk_write_bytes(pid: int) -> int:
    """Bytes the process caused to be sent to the storage layer (/proc/PID/io write_bytes)."""
    try:
        with open(f"/proc/{pid}/io") as f:
            for line in f:
                if line.startswith("write_bytes:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def directory_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) if path.exists() else 0


def measure(server: rt.ServerProcess, channel: grpc.Channel, clients: rt.Clients, scenario: str, args, tag: str,
            duration: Optional[float] = None) -> dict:
    """One run of `scenario` against one server (rpc_throughput's measure, plus the disk bytes written)."""
    rt.reset_server(channel)  # not measured; with a state_dir this Reset also writes a (small) snapshot
    duration = args.duration if duration is None else duration
    now = time.monotonic()
    start = now + 0.35
    warm_end = start + args.warmup
    end = warm_end + duration
    n = len(clients.connections)
    shares = [args.inflight // n + (1 if i < args.inflight % n else 0) for i in range(n)]
    clients.send([{"address": server.address, "scenario": scenario, "check": True, "tag": f"{tag}w{i}",
                   "candidates": 4, "inflight": shares[i], "start": start, "warm_end": warm_end, "end": end}
                  for i in range(n)])
    time.sleep(max(0.0, warm_end - time.monotonic()))
    cpu0, busy0, disk0 = server.cpu_seconds(), rt.machine_busy_ticks(), disk_write_bytes(server.process.pid)
    time.sleep(max(0.0, end - time.monotonic()))
    cpu1, busy1, disk1 = server.cpu_seconds(), rt.machine_busy_ticks(), disk_write_bytes(server.process.pid)
    results = clients.receive()
    summary = rt.summarize_run(results, duration, cpu1 - cpu0, busy0, busy1)
    completed = summary["completed"]
    summary["disk_kb_per_call"] = (disk1 - disk0) / 1024 / completed if completed else float("nan")
    summary["disk_mb_per_s"] = (disk1 - disk0) / 2**20 / duration
    return summary


median = rt.median


def print_report(args, runs: dict, request_mb: float) -> bool:
    keys = ("throughput", "p50_ms", "p99_ms", "server_cpu_ms_per_call", "disk_kb_per_call", "disk_mb_per_s",
            "machine_busy")
    header = (f"{'scenario':<36} {'durability':<13} {'calls/s':>8} {'MB/s in':>8} {'p50 ms':>8} {'p99 ms':>8} "
              f"{'srv ms/call':>11} {'disk KB/call':>12} {'disk MB/s':>9} {'busy':>5} | {'ratio':>5} "
              f"{'cpu ratio':>9} {'target':>6} {'result':>6}")
    print()
    print(header)
    print("-" * len(header))
    ok = True
    summary = {}
    for scenario in args.scenarios:
        rows = {config: {k: median([r[k] for r in runs[(scenario, config)]]) for k in keys} for config in CONFIGS}
        base = rows["memory"]
        summary[scenario] = {}
        for config in CONFIGS:
            row = rows[config]
            ratio = row["throughput"] / base["throughput"]
            cpu_ratio = base["server_cpu_ms_per_call"] / row["server_cpu_ms_per_call"]
            targeted = scenario == TARGET_SCENARIO and config == TARGET_CONFIG
            verdict = ("PASS" if ratio >= TARGET_RATIO else "FAIL") if targeted else ""
            ok = ok and verdict != "FAIL"
            errors = [r["errors"] for r in runs[(scenario, config)] if r["errors"]]
            ok = ok and not errors
            mb_in = row["throughput"] * request_mb if scenario == "submit" else float("nan")
            print(f"{(SCENARIOS[scenario] if config == 'memory' else ''):<36} {config:<13} {row['throughput']:>8.0f} "
                  f"{mb_in:>8.1f} {row['p50_ms']:>8.2f} {row['p99_ms']:>8.2f} {row['server_cpu_ms_per_call']:>11.3f} "
                  f"{row['disk_kb_per_call']:>12.1f} {row['disk_mb_per_s']:>9.1f} {row['machine_busy'] * 100:>4.0f}% | "
                  f"{ratio:>5.2f} {cpu_ratio:>9.2f} {(f'>={TARGET_RATIO}' if targeted else ''):>6} {verdict:>6}")
            if errors:
                print(f"{'':<36} ERRORS: {errors}")
            per_repeat = [r["throughput"] / b["throughput"] for r, b in zip(runs[(scenario, config)],
                                                                            runs[(scenario, "memory")])]
            summary[scenario][config] = {"ratio": ratio, "cpu_ratio": cpu_ratio, "per_repeat_ratios": per_repeat,
                                         **row}
        for config in CONFIGS[1:]:
            ratios = summary[scenario][config]["per_repeat_ratios"]
            print(f"{'':<36} per-repeat ratios {config:<13} {' '.join(f'{x:.2f}' for x in ratios)}")
    print()
    print(f"Medians over {args.repeats} repeats; in each repeat the four servers run one after another, "
          f"in a rotating order.")
    print("ratio     = median(calls/s) / median(calls/s of memory): the target applies to fsync=normal on Submit.")
    print("cpu ratio = memory's / this server's CPU per call (all threads: the journal writer thread included).")
    print(f"MB/s in   = request bytes received ({request_mb:.3f} MB per Submit); disk = /proc/PID/io write_bytes "
          f"of the server (journal pages; the in-memory server writes ~0).")
    print(f"busy      = % of all {os.cpu_count()} cores busy (the clients share them with the server).")
    if args.json:
        Path(args.json).write_text(json.dumps({"command": rt.command_line(), "summary": summary,
                                               "runs": {f"{k[0]}/{k[1]}": v for k, v in runs.items()}}, indent=2))
    return ok


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    rt.add_load_options(parser, repeats_help="rounds over the four servers per scenario")
    parser.add_argument("--scenarios", default="submit,dispatch", help="comma-separated subset of submit,dispatch")
    parser.add_argument("--state-root", help="directory for the journals (default: a temporary directory under "
                                             "$TMPDIR); put it on the disk the state will live on")
    parser.add_argument("--server-arg", action="append", default=[], metavar="KEY=VALUE",
                        help="extra configuration override for all four servers (repeatable)")
    parser.add_argument("--json", metavar="FILE", help="also write the figures as JSON")
    args = parser.parse_args(argv)
    args.repeats = args.repeats or (1 if args.quick else 5)
    args.duration = args.duration or (1.0 if args.quick else 3.0)
    args.prime = args.prime if args.prime is not None else (0.5 if args.quick else 1.5)
    args.warmup = args.warmup if args.warmup is not None else (0.3 if args.quick else 0.5)
    args.scenarios = [s.strip() for s in args.scenarios.split(",") if s.strip()]
    unknown = [s for s in args.scenarios if s not in SCENARIOS]
    if unknown:
        parser.error(f"unknown scenarios {unknown}; choose from {', '.join(SCENARIOS)}")

    from google.protobuf.internal import api_implementation

    request_mb = len(rt.SubmitBuilder(seed=0).build("p-00000000", "r-00000000")) / 2**20
    print(f"command: {rt.command_line()}")
    print(f"python {platform.python_version()}, grpcio {grpc.__version__}, protobuf {api_implementation.Type()}, "
          f"{os.cpu_count()} cores, load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    print(f"load: {args.inflight} calls in flight from {args.clients} client processes (grpc.aio); {args.repeats} "
          f"repeats x {args.duration:g} s measured (+{args.warmup:g} s warm-up) per server and scenario")

    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="coda-durability-bench-") as tmp, \
            tempfile.TemporaryDirectory(prefix="coda-durability-state-", dir=args.state_root) as state_root:
        state_root = Path(state_root)
        print(f"servers: python -m coda_server {' '.join(rt.OUR_OVERRIDES + args.server_arg)}")
        print(f"  memory: server.state_dir=\"\"; fsync=P: server.state_dir={state_root}/P server.fsync=P")
        servers = {config: rt.ServerProcess("ours", Path(tmp) / config.replace("=", "-"), None,
                                            overrides_for(config, state_root) + args.server_arg)
                   for config in CONFIGS}
        clients = None
        channels: dict[str, grpc.Channel] = {}
        ok = False
        try:
            for server in servers.values():
                server.workdir.mkdir(parents=True)
                server.start()
            clients = rt.Clients(args.clients)
            for config, server in servers.items():
                server.wait_ready()
                channels[config] = grpc.insecure_channel(server.address)
            runs: dict[tuple[str, str], list[dict]] = {(s, c): [] for s in args.scenarios for c in CONFIGS}
            for scenario in args.scenarios:  # priming: connections, caches, heaps, journal files (not reported)
                for config in CONFIGS:
                    result = measure(servers[config], channels[config], clients, scenario, args,
                                     tag=f"x{scenario[0]}{CONFIGS.index(config)}", duration=args.prime)
                    if result["errors"]:
                        raise RuntimeError(f"{config} server answered {scenario} with errors: {result['errors']}")
            print(f"  primed the four servers ({args.prime:g} s per scenario, not reported)", flush=True)
            turn = 0
            for repeat in range(args.repeats):
                for scenario in args.scenarios:
                    order = CONFIGS[turn % len(CONFIGS):] + CONFIGS[:turn % len(CONFIGS)]
                    turn += 1
                    for config in order:
                        result = measure(servers[config], channels[config], clients, scenario, args,
                                         tag=f"r{repeat}{scenario[0]}{CONFIGS.index(config)}")
                        runs[(scenario, config)].append(result)
                        print(f"  repeat {repeat + 1}/{args.repeats} {scenario:<8} {config:<12} "
                              f"{result['throughput']:8.0f} calls/s  p50 {result['p50_ms']:7.2f} ms  "
                              f"p99 {result['p99_ms']:7.2f} ms  server cpu {result['server_cpu_ms_per_call']:.3f} "
                              f"ms/call  disk {result['disk_kb_per_call']:.1f} KB/call"
                              f"{'  errors ' + str(result['errors']) if result['errors'] else ''}", flush=True)
            ok = print_report(args, runs, request_mb)
            sizes = ", ".join(f"{p} {directory_bytes(state_root / p) / 2**20:.1f} MB" for p in POLICIES)
            print(f"state directories at the end (SQLite does not shrink its file: the high-water mark): {sizes}")
            print(f"wall time {time.monotonic() - started:.0f} s")
        finally:
            for channel in channels.values():
                channel.close()
            if clients is not None:
                clients.close()
            for server in servers.values():
                server.stop()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
