"""A swarm of rollout workers on one coda-server: watch streams, Dispatch long-polls and a trainer (issue 16).

One run, in one process tree:

* our server, `python -m coda_server` on the shipped defaults (a free port for gRPC and metrics; anything
  else only through `--server-arg key=value`);
* `--processes` client processes holding `--streams` WatchControl streams in total over connections of
  `--per-connection` streams each (one `coda_client.AsyncPacerClient`, so one channel, per connection, each
  with its own client id); `--long-polls` of the streams' workers also long-poll Dispatch in a loop;
* a trainer in this process that, once every stream is open, measures the server idle (RSS, CPU) and then
  runs `--resets` rounds of Collect (no wait), GetState, Reset(resume) and Ack-free collecting, timing the
  delivery of each Reset's PAUSE to every watcher.

Printed: streams open; streams refused or cancelled, by status code; the trainer's calls refused; PAUSE
delivery from the start of Reset to each watcher, p50 / p99 / max per Reset and the median of each over
the Resets; server RSS per stream; server CPU while idle with every stream open.

    python bench/swarm.py                         # 4,096 streams, 512 long-polls, 5 Resets
    python bench/swarm.py --streams 10000 --processes 8
    python bench/swarm.py --streams 2000 --per-connection 50 --server-arg server.max_watch_streams=10000
    CODA_BENCH_PROFILE=/tmp/swarm.prof python bench/swarm.py --resets 3    # where the server's time goes
"""
from __future__ import annotations

import argparse
import asyncio
import collections
import json
import multiprocessing
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, Optional

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from coda_client import AsyncPacerClient, PacerClient  # noqa: E402
from coda_client.errors import PacerClientError  # noqa: E402
from coda_client.types import ControlEventType  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from rpc_throughput import stat_cpu_seconds  # noqa: E402

START_TIMEOUT_SECONDS = 60.0
# CODA_BENCH_PROFILE=/tmp/swarm.prof runs the server under cProfile (its figures are then not measurements).
PROFILE_ENV = "CODA_BENCH_PROFILE"
REPORT_INTERVAL_SECONDS = 0.2


def raise_fd_limit(needed: int) -> None:
    """Every connection is a socket on both ends: lift the soft descriptor limit to what the run needs."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = min(hard, max(soft, needed))
    if wanted > soft:
        resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))
    if wanted < needed:
        print(f"warning: the descriptor limit is {hard} (hard), the run needs about {needed}: raise `ulimit -Hn`")


# ----------------------------------------------------------------------------------------- server

async def serve_floor(port_file: Path) -> None:
    """The floor: a bare grpc.aio server with the same server options and the same fan-out shape, nothing else.

    WatchControl sends STATE, then whatever Reset publishes to every stream's queue (PAUSE, RESUME); Reset
    publishes and answers at once; a waiting Dispatch sleeps its wait and admits nothing; GetState and Collect
    answer empty. It is what Python gRPC costs for this workload on this machine.
    """
    import grpc

    from coda_client._proto import pacer_pb2 as pb
    from coda_client._proto import pacer_pb2_grpc
    from coda_server.core import load_config
    from coda_server.server import server_options

    queues: set[asyncio.Queue] = set()
    generation = 0

    class Floor(pacer_pb2_grpc.RolloutPacerServicer):
        async def WatchControl(self, request, context):
            queue: asyncio.Queue = asyncio.Queue()
            queues.add(queue)
            try:
                await context.write(pb.ControlEvent(type=pb.CONTROL_EVENT_TYPE_STATE))
                while True:
                    await context.write(await queue.get())
            finally:
                queues.discard(queue)

        async def Reset(self, request, context):
            nonlocal generation
            generation += 1
            pause = pb.ControlEvent(type=pb.CONTROL_EVENT_TYPE_PAUSE, generation=generation, paused=True)
            resume = pb.ControlEvent(type=pb.CONTROL_EVENT_TYPE_RESUME, generation=generation)
            for queue in queues:
                queue.put_nowait(pause)
            for queue in queues:
                queue.put_nowait(resume)
            return pb.ResetResponse(generation=generation)

        async def Dispatch(self, request, context):
            await asyncio.sleep(min(request.wait_seconds, 600))
            return pb.DispatchResponse()

        async def Collect(self, request, context):
            return pb.CollectResponse(timed_out=True)

        async def GetState(self, request, context):
            return pb.GetStateResponse()

    server = grpc.aio.server(options=server_options(load_config()))
    pacer_pb2_grpc.add_RolloutPacerServicer_to_server(Floor(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    temporary = port_file.with_suffix(".tmp")
    temporary.write_text(json.dumps({"address": f"127.0.0.1:{port}"}))
    temporary.replace(port_file)
    await server.wait_for_termination()


class Server:
    """python -m coda_server (or the floor) in a subprocess, on free ports."""

    def __init__(self, workdir: Path, overrides: list[str], floor: bool = False):
        self.port_file = workdir / ("floor" if floor else "server") / "port.json"
        self.port_file.parent.mkdir()
        self.log_path = self.port_file.parent / "server.log"
        self.overrides = overrides
        self.floor = floor
        self.process: Optional[subprocess.Popen] = None
        self.address = ""

    def start(self) -> "Server":
        profile = os.environ.get(PROFILE_ENV)
        runner = ["-m", "cProfile", "-o", profile] if profile else []
        if self.floor:
            command = [sys.executable, str(Path(__file__).resolve()), "--serve-floor", str(self.port_file)]
        else:
            command = [sys.executable, *runner, "-m", "coda_server", "--port-file", str(self.port_file),
                       "server.address=127.0.0.1:0", "server.metrics_address=127.0.0.1:0",
                       # the shipped durable default, in this run's own directory rather than ./coda-state
                       f"server.state_dir={self.port_file.parent / 'state'}", *self.overrides]
        self._log = open(self.log_path, "wb")
        self.process = subprocess.Popen(command, cwd=REPO_ROOT, stdout=self._log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + START_TIMEOUT_SECONDS
        while not self.port_file.exists():
            if self.process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the server did not start:\n{self.log_path.read_text()[-3000:]}")
            time.sleep(0.05)
        self.info = json.loads(self.port_file.read_text())
        self.address = self.info["address"]
        return self

    def rss_bytes(self) -> int:
        for line in Path(f"/proc/{self.process.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
        return 0

    def cpu_seconds(self) -> float:
        return stat_cpu_seconds(self.process.pid)

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)
        self._log.close()


# ----------------------------------------------------------------------------------------- workers

def worker_main(index: int, target: str, connections: int, per_connection: int, long_polls: int,
                long_poll_seconds: float, reports: Any, stop: Any) -> None:
    """One client process: `connections` clients, `per_connection` watch streams each, some long-polls."""
    raise_fd_limit(connections * 2 + 256)
    try:
        asyncio.run(_worker(index, target, connections, per_connection, long_polls, long_poll_seconds, reports, stop))
    except Exception:
        reports.put(("crash", index, traceback.format_exc()))


async def _worker(index: int, target: str, connections: int, per_connection: int, long_polls: int,
                  long_poll_seconds: float, reports: Any, stop: Any) -> None:
    clients = [AsyncPacerClient(target, client_id=f"swarm-{index}-{c}") for c in range(connections)]
    opened = 0
    ended: collections.Counter = collections.Counter()  # status code name (or "ENDED") -> streams
    pauses: list[tuple[int, float]] = []  # (ordinal of the PAUSE on its stream, time received), not yet reported
    polls: collections.Counter = collections.Counter()

    async def watch(client: AsyncPacerClient) -> None:
        nonlocal opened
        seen, is_open, outcome = 0, False, "ENDED"
        try:
            async for event in client.watch():
                if event.type == ControlEventType.STATE and not is_open:
                    opened, is_open = opened + 1, True
                elif event.type == ControlEventType.PAUSE:
                    pauses.append((seen, time.time()))
                    seen += 1
                elif event.type == ControlEventType.SHUTDOWN:
                    break
        except PacerClientError as exc:
            outcome = exc.code.name if exc.code is not None else type(exc).__name__
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - counted and shown, the run goes on
            outcome = type(exc).__name__
        # "open" streams that ended count apart from those refused (or cancelled) before their first event.
        ended[("after open " if is_open else "") + outcome] += 1

    async def long_poll(client: AsyncPacerClient, number: int) -> None:
        serial = 0
        while True:
            serial += 1
            try:
                result = await client.dispatch([f"swarm-{index}-{number}-{serial}"], wait=long_poll_seconds)
                polls["admitted" if result.admitted else "waited"] += 1
            except PacerClientError as exc:
                polls[exc.code.name if exc.code is not None else type(exc).__name__] += 1
                await asyncio.sleep(getattr(exc, "retry_after", None) or 1.0)

    tasks = []
    for c, client in enumerate(clients):
        for _ in range(per_connection):
            tasks.append(asyncio.ensure_future(watch(client)))
    for number in range(long_polls):
        tasks.append(asyncio.ensure_future(long_poll(clients[number % len(clients)], number)))
    loop = asyncio.get_running_loop()
    while not await loop.run_in_executor(None, stop.wait, REPORT_INTERVAL_SECONDS):
        batch, pauses[:] = list(pauses), []
        reports.put(("status", index, opened, dict(ended), dict(polls), batch))
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    batch = list(pauses)
    reports.put(("status", index, opened, dict(ended), dict(polls), batch))
    for client in clients:
        await client.close()
    reports.put(("done", index))


# ----------------------------------------------------------------------------------------- the run

class Swarm:
    """The workers' reports, merged."""

    def __init__(self, processes: int):
        self.opened = [0] * processes
        self.ended: list[dict[str, int]] = [{} for _ in range(processes)]
        self.polls: list[dict[str, int]] = [{} for _ in range(processes)]
        self.pauses: dict[int, list[float]] = collections.defaultdict(list)  # PAUSE ordinal -> receive times
        self.done = 0

    def drain(self, reports: Any, timeout: float = 0.0) -> None:
        deadline = time.monotonic() + timeout
        while True:
            try:
                message = reports.get(timeout=max(0.0, deadline - time.monotonic()) or 0.01)
            except Exception:  # queue.Empty
                return
            if message[0] == "status":
                _, index, opened, ended, polls, batch = message
                self.opened[index], self.ended[index], self.polls[index] = opened, ended, polls
                for ordinal, received in batch:
                    self.pauses[ordinal].append(received)
            elif message[0] == "crash":
                raise RuntimeError(f"worker {message[1]} crashed:\n{message[2]}")
            elif message[0] == "done":
                self.done += 1
            if time.monotonic() >= deadline:
                return

    def total_opened(self) -> int:
        return sum(self.opened)

    def open_now(self) -> int:
        return self.total_opened() - sum(n for k, n in self.total("ended").items() if k.startswith("after open"))

    def total(self, what: str) -> dict[str, int]:
        merged: collections.Counter = collections.Counter()
        for entry in getattr(self, what):
            merged.update(entry)
        return dict(merged)


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


def trainer_call(refused: collections.Counter, name: str, call: Any) -> Any:
    try:
        return call()
    except PacerClientError as exc:
        refused[f"{name} {exc.code.name if exc.code is not None else type(exc).__name__}"] += 1
        return None


def run(args: argparse.Namespace, workdir: Path, floor: bool = False) -> dict[str, Any]:
    connections_total = -(-args.streams // args.per_connection)
    raise_fd_limit(connections_total * 2 + 1024)
    server = Server(workdir, args.server_arg, floor=floor).start()
    ctx = multiprocessing.get_context("spawn")
    reports, stop = ctx.Queue(), ctx.Event()
    swarm = Swarm(args.processes)
    workers = []
    results: dict[str, Any] = {"server": "floor (bare grpc.aio)" if floor else "coda-server", "streams": args.streams, "per_connection": args.per_connection,
                               "connections": connections_total, "processes": args.processes,
                               "long_polls": args.long_polls, "server_args": args.server_arg}
    try:
        time.sleep(1.0)
        rss_before = server.rss_bytes()
        # Streams and long-polls are spread over the processes as evenly as whole connections allow.
        per_process = [connections_total // args.processes + (1 if p < connections_total % args.processes else 0)
                       for p in range(args.processes)]
        polls_per_process = [args.long_polls // args.processes + (1 if p < args.long_polls % args.processes else 0)
                             for p in range(args.processes)]
        started = time.monotonic()
        for p in range(args.processes):
            process = ctx.Process(target=worker_main, args=(p, server.address, per_process[p], args.per_connection,
                                                            polls_per_process[p], args.long_poll_seconds, reports, stop))
            process.start()
            workers.append(process)
        wanted = connections_total * args.per_connection
        trainer = PacerClient(server.address, client_id="trainer")
        refused: collections.Counter = collections.Counter()
        # While the streams open, the trainer keeps calling: its calls must get in whatever the swarm holds.
        while time.monotonic() - started < args.open_timeout:
            swarm.drain(reports, 0.5)
            trainer_call(refused, "GetState", trainer.state)
            ended = sum(swarm.total("ended").values())
            if swarm.total_opened() + ended >= wanted:
                break
        results["open_seconds"] = round(time.monotonic() - started, 2)
        time.sleep(2.0)
        swarm.drain(reports, 0.5)
        results["streams_open"] = swarm.open_now()
        results["streams_ended_while_opening"] = swarm.total("ended")
        rss_after = server.rss_bytes()
        cpu_before, clock_before = server.cpu_seconds(), time.monotonic()
        time.sleep(args.idle_seconds)
        idle = (server.cpu_seconds() - cpu_before) / (time.monotonic() - clock_before)
        swarm.drain(reports, 0.1)
        results["server_rss_mb"] = round(rss_after / 2**20, 1)
        results["server_rss_per_stream_kb"] = round((rss_after - rss_before) / max(1, results["streams_open"]) / 1024, 1)
        results["server_idle_cpu_percent"] = round(idle * 100, 1)
        rounds = []
        for r in range(args.resets):
            trainer_call(refused, "Collect", lambda: trainer.collect(16))
            trainer_call(refused, "GetState", trainer.state)
            expected = swarm.open_now()
            began = time.time()
            done = trainer_call(refused, "Reset", lambda: trainer.reset("abort", resume=True, weight_version=r + 1))
            reset_seconds = time.time() - began
            deadline = time.monotonic() + args.delivery_timeout
            while len(swarm.pauses[r]) < expected and time.monotonic() < deadline:
                swarm.drain(reports, 0.1)
            delays = [received - began for received in swarm.pauses[r]]
            rounds.append({"reset_ok": done is not None, "reset_ms": round(reset_seconds * 1000, 1),
                           "watchers": expected, "delivered": len(delays),
                           "p50_ms": round(percentile(delays, 0.5) * 1000, 1),
                           "p99_ms": round(percentile(delays, 0.99) * 1000, 1),
                           "max_ms": round(max(delays) * 1000, 1) if delays else float("nan")})
            time.sleep(args.pause_between)
        results["rounds"] = rounds
        for key in ("p50_ms", "p99_ms", "max_ms", "reset_ms"):
            results[f"median_{key}"] = statistics.median([entry[key] for entry in rounds]) if rounds else None
        swarm.drain(reports, 0.5)
        results["trainer_refused"] = dict(refused)
        results["streams_ended"] = swarm.total("ended")
        results["long_poll_outcomes"] = swarm.total("polls")
        trainer.close()
    finally:
        stop.set()
        deadline = time.monotonic() + 30
        while swarm.done < len(workers) and time.monotonic() < deadline:
            try:
                swarm.drain(reports, 0.5)
            except RuntimeError:
                break
        for process in workers:
            process.join(5)
            if process.is_alive():
                process.kill()
        server.stop()
        results["server_log_tail"] = [line for line in server.log_path.read_text().splitlines()
                                      if " WARNING " in line or " ERROR " in line][-5:]
    return results


def print_results(results: dict[str, Any]) -> None:
    print(f"== {results['server']}")
    print(f"streams wanted {results['streams']} over {results['connections']} connections "
          f"({results['per_connection']} per connection) from {results['processes']} processes; "
          f"{results['long_polls']} long-polling Dispatch; server args {results['server_args'] or 'none (defaults)'}")
    print(f"streams open: {results['streams_open']} (all open after {results['open_seconds']} s)")
    print(f"streams refused or cancelled while opening: {results['streams_ended_while_opening'] or 0}")
    print(f"streams ended during the run: {results['streams_ended'] or 0}")
    print(f"trainer calls refused: {results['trainer_refused'] or 0}")
    print(f"long-poll outcomes: {results['long_poll_outcomes']}")
    print(f"server RSS {results['server_rss_mb']} MB, {results['server_rss_per_stream_kb']} KB per stream; "
          f"idle CPU with every stream open {results['server_idle_cpu_percent']}% of one core")
    print("PAUSE delivery from the start of Reset (ms):")
    print("  reset  watchers  delivered   p50     p99     max   Reset call")
    for number, entry in enumerate(results["rounds"]):
        print(f"  {number:5d}  {entry['watchers']:8d}  {entry['delivered']:9d}  {entry['p50_ms']:6.1f}  "
              f"{entry['p99_ms']:6.1f}  {entry['max_ms']:6.1f}  {entry['reset_ms']:6.1f}{'' if entry['reset_ok'] else ' REFUSED'}")
    print(f"  median over {len(results['rounds'])} Resets: p50 {results['median_p50_ms']} ms, "
          f"p99 {results['median_p99_ms']} ms, max {results['median_max_ms']} ms")
    if results["server_log_tail"]:
        print("server warnings:", *results["server_log_tail"], sep="\n  ")


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--streams", type=int, default=4096)
    parser.add_argument("--per-connection", type=int, default=32, help="watch streams per client connection")
    parser.add_argument("--processes", type=int, default=4, help="client processes")
    parser.add_argument("--long-polls", type=int, default=512, help="workers also long-polling Dispatch")
    parser.add_argument("--long-poll-seconds", type=float, default=30.0)
    parser.add_argument("--resets", type=int, default=5)
    parser.add_argument("--pause-between", type=float, default=1.0, help="seconds between Resets")
    parser.add_argument("--idle-seconds", type=float, default=5.0)
    parser.add_argument("--open-timeout", type=float, default=180.0)
    parser.add_argument("--delivery-timeout", type=float, default=20.0)
    parser.add_argument("--server-arg", action="append", default=[], help="key=value for the server (repeatable)")
    parser.add_argument("--floor", action="store_true",
                        help="then run the same workload against a bare grpc.aio server (what gRPC itself costs)")
    parser.add_argument("--json", help="also write every figure to this file")
    parser.add_argument("--serve-floor", help=argparse.SUPPRESS)  # internal: the floor server's subprocess
    args = parser.parse_args(argv)
    if args.serve_floor:
        asyncio.run(serve_floor(Path(args.serve_floor)))
        return 0
    workdir = Path(tempfile.mkdtemp(prefix="coda-swarm-"))
    runs = []
    for floor in (False, True) if args.floor else (False,):
        load = os.getloadavg()
        print(f"load average before the run: {load[0]:.2f} {load[1]:.2f} {load[2]:.2f} on {os.cpu_count()} cores")
        results = run(args, workdir, floor)
        results["load_before"] = load
        print_results(results)
        runs.append(results)
    if len(runs) == 2 and runs[0]["median_max_ms"] and runs[1]["median_max_ms"]:
        print(f"PAUSE delivery, ours / floor: p50 {runs[0]['median_p50_ms'] / runs[1]['median_p50_ms']:.2f}, "
              f"max {runs[0]['median_max_ms'] / runs[1]['median_max_ms']:.2f}; RSS per stream "
              f"{runs[0]['server_rss_per_stream_kb']} / {runs[1]['server_rss_per_stream_kb']} KB")
    if args.json:
        Path(args.json).write_text(json.dumps(runs, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
