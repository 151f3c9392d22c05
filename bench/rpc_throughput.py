"""RPC throughput of coda-server against the floor of Python gRPC on this machine (issue 3, Performance).

Runs, in one process tree and one run:

* a *floor* server: a grpc.aio server for the same `coda.pacer.v1.RolloutPacer` service, the same
  generated registration (so requests are parsed the same way) and the same server options
  (`coda_server.server.server_options`), whose handlers return an empty
  response at once;
* *our* server: `python -m coda_server` on its shipped defaults except what makes every call real work
  that succeeds (a huge window so Dispatch admits, group size 64 so one Submit completes one group);
* client worker processes (grpc.aio, `--inflight` calls in flight in total) that load one server at a
  time with the same requests, byte for byte, and check our server's answers (admitted, accepted == 64).

Each server runs in its own subprocess. Runs alternate floor/ours for every scenario and repeat, and the
order within a pair flips each time, so machine noise affects both alike. The report gives medians over
the repeats and the ratio of the medians, plus each server's CPU time per call: on a small machine the
clients share the cores with the server, so calls/s ratios are whole-machine figures, and the
CPU-per-call ratio shows the server's own cost directly.

    python bench/rpc_throughput.py            # normal run, about 2 minutes
    python bench/rpc_throughput.py --quick    # smoke run, under 30 seconds
    python bench/rpc_throughput.py --server-arg server.log_level=WARNING    # what-if on our server's config
    CODA_BENCH_PROFILE=/tmp/prof python bench/rpc_throughput.py --quick --scenarios submit --repeats 2
        # both servers under cProfile (measured windows only); prints where the event loop's time goes.
        # The calls/s figures of a profiled run are not valid measurements.
"""
from __future__ import annotations

import argparse
import asyncio
import collections
import json
import multiprocessing
import os
import platform
import random
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, Callable, Coroutine, Optional

import grpc

from coda_client._proto import pacer_pb2 as pb
from coda_client._proto import pacer_pb2_grpc

REPO_ROOT = Path(__file__).resolve().parents[1]
PROFILE_ENV = "CODA_BENCH_PROFILE"
FLOOR_PASSTHROUGH_ENV = "CODA_BENCH_FLOOR_PASSTHROUGH"
FLOOR_GENERIC_ENV = "CODA_BENCH_FLOOR_GENERIC"
FLOOR_LOOP_ENV = "CODA_BENCH_FLOOR_LOOP"
SERVICE = "/coda.pacer.v1.RolloutPacer/"
CALL_TIMEOUT_SECONDS = 60.0
START_TIMEOUT_SECONDS = 60.0

# The configuration both servers load (the floor only uses its server options). Everything else keeps the
# shipped defaults (logging, metrics, request-id replay), since that is the server users run. The window is huge so
# Dispatch always admits; one Submit of 64 trajectories completes one group of 64; the `reward` filter
# drops those groups (all rewards equal) so the buffer stays empty and memory stays bounded without a
# trainer collecting 30 MB/s back over the same two cores; a Reset between runs clears the rest.
# Trajectories per Submit (and per group); CODA_BENCH_GROUP_SIZE sets another, e.g. handler_instructions.py
# --group-size 16 for the Submits of payload_path.py's concurrent run.
GROUP_SIZE_ENV = "CODA_BENCH_GROUP_SIZE"
GROUP_SIZE = int(os.environ.get(GROUP_SIZE_ENV, "64"))
OUR_OVERRIDES = [
    "server.address=127.0.0.1:0",
    "server.metrics_address=127.0.0.1:0",  # a free port: never collide with another server on this machine
    "server.state_dir=",  # state in memory: the RPC path alone (bench/durability_cost.py measures the journal)
    "fully_async.sliding_window=windowed-fifo",
    "fully_async.stale_steps=1.0",
    "data_source.num_prompts_per_step=1048576",
    f"data_source.num_trajectories_per_prompt={GROUP_SIZE}",
    "rollout.filter=[status,reward]",
]

TOKENS_PER_TRAJECTORY = 1000
REFILL_PROMPTS = 256  # prompts one refill Dispatch of the Submit scenario asks for


class Scenario:
    def __init__(self, name: str, title: str, target: float):
        self.name, self.title, self.target = name, title, target


def scenarios(candidates: int) -> dict[str, Scenario]:
    return {
        "peek": Scenario("peek", "Dispatch, no candidates (peek)", 0.9),
        "dispatch": Scenario("dispatch", f"Dispatch, {candidates} candidates, all admitted", 0.9),
        "submit": Scenario("submit", f"Submit, {GROUP_SIZE} traj x {TOKENS_PER_TRAJECTORY} tokens", 0.6),
        "getstate": Scenario("getstate", "GetState", 0.8),
    }


# ----------------------------------------------------------------------------------------- floor server

class FloorServicer(pacer_pb2_grpc.RolloutPacerServicer):
    """Empty handlers: what Python gRPC costs for these messages when the service does nothing."""

    async def Dispatch(self, request, context):
        return pb.DispatchResponse()

    async def Submit(self, request, context):
        return pb.SubmitResponse()

    async def Collect(self, request, context):
        return pb.CollectResponse()

    async def Reset(self, request, context):
        return pb.ResetResponse()

    async def Resume(self, request, context):
        return pb.ResumeResponse()

    async def GetState(self, request, context):
        return pb.GetStateResponse()


async def serve_floor(port_file: Path, overrides: list[str]) -> int:
    from coda_server.allocator import retain_freed_memory
    from coda_server.core import load_config
    from coda_server.server import server_options

    config = load_config(overrides=overrides)
    retain_freed_memory(int(config.server.allocator_retain_bytes))  # the same process settings as ours
    server = grpc.aio.server(options=server_options(config))
    registrar = server
    if os.environ.get(FLOOR_PASSTHROUGH_ENV) or os.environ.get(FLOOR_GENERIC_ENV):
        from coda_server.method_wrapping import WrappingRegistrar
        from coda_server.server import SERVICE_NAME
        from coda_server.wire import PassthroughCodec

        # --floor-passthrough: parse Submit as our server does; --floor-generic: no method registered by name,
        # as our server registers them (coda_server/method_wrapping.py)
        wrappers = [PassthroughCodec(SERVICE_NAME)] if os.environ.get(FLOOR_PASSTHROUGH_ENV) else []
        registrar = WrappingRegistrar(server, wrappers, by_name=() if os.environ.get(FLOOR_GENERIC_ENV) else None)
    pacer_pb2_grpc.add_RolloutPacerServicer_to_server(FloorServicer(), registrar)
    port = server.add_insecure_port(str(config.server.address))
    await server.start()
    temporary = port_file.with_suffix(".tmp")
    temporary.write_text(json.dumps({"address": f"127.0.0.1:{port}", "port": port}))
    temporary.replace(port_file)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    await stop.wait()
    await server.stop(1.0)
    return 0


def run_on_floor_loop(serve: Callable[..., Coroutine[Any, Any, int]], *args: Any) -> int:
    """`serve(*args)` on the comparison server's event loop: asyncio's (the issue's floor: a plain grpc.aio
    server), or uvloop with --floor-event-loop uvloop, our server's loop (coda_server/event_loop.py). Used by the
    floor here and by payload_path.py's relay."""
    from coda_server import event_loop

    loop = event_loop.loop_factory(os.environ.get(FLOOR_LOOP_ENV, event_loop.ASYNCIO))  # before the coroutine exists
    return event_loop.run(serve(*args), loop)


def profile_serve(name: str, profile_path: Path, port_file: Path, overrides: list[str]) -> int:
    """Run the floor or our server in this process with a cProfile profiler the bench turns on and off.

    Only the event-loop thread is profiled (handlers, interceptors, asyncio, and the gRPC Cython layer as
    one opaque block); gRPC's C-core threads show in the CPU figures, not here.
    """
    import cProfile

    # The default wall-clock timer: a thread-CPU timer would be immune to preemption and GIL waits, but costs
    # ~2.5 us per reading on these VMs (10x perf_counter), which would swamp every small Python function.
    profiler = cProfile.Profile()
    signal.signal(signal.SIGUSR1, lambda *_: profiler.enable())
    signal.signal(signal.SIGUSR2, lambda *_: profiler.disable())
    try:
        if name == "floor":
            return run_on_floor_loop(serve_floor, port_file, overrides)
        from coda_server.cli import main as server_main

        return server_main(["--port-file", str(port_file), *overrides])
    finally:
        profiler.disable()
        profiler.dump_stats(str(profile_path))


# ----------------------------------------------------------------------------------------- subprocesses

class ServerProcess:
    """One server subprocess (floor or ours), optionally under cProfile."""

    # How long it may take to start and to stop, and its environment (None: this process's).
    start_timeout = START_TIMEOUT_SECONDS
    stop_timeout = 15.0
    env: Optional[dict] = None

    def __init__(self, name: str, workdir: Path, profile_dir: Optional[Path], overrides: list[str]):
        self.name = name
        self.overrides = overrides
        self.workdir = workdir
        self.port_file = workdir / f"{name}.port.json"
        self.log_path = workdir / f"{name}.log"
        self.profile_path = profile_dir / f"{name}.prof" if profile_dir else None
        self.process: Optional[subprocess.Popen] = None
        self.address = ""

    def command(self) -> list[str]:
        if self.profile_path is not None:  # this file's profiling bootstrap runs the same server in-process
            return [sys.executable, str(Path(__file__).resolve()), "--profile-serve", self.name, str(self.profile_path),
                    str(self.port_file), *self.overrides]
        if self.name == "floor":
            return [sys.executable, str(Path(__file__).resolve()), "--serve-floor", str(self.port_file), *self.overrides]
        return [sys.executable, "-m", "coda_server", "--port-file", str(self.port_file), *self.overrides]

    def profiling(self, on: bool) -> None:
        """Profile only measured windows: SIGUSR1 starts the server's profiler, SIGUSR2 pauses it."""
        if self.profile_path is not None:
            self.process.send_signal(signal.SIGUSR1 if on else signal.SIGUSR2)

    def start(self) -> "ServerProcess":
        self._log = open(self.log_path, "wb")
        self.process = subprocess.Popen(self.command(), cwd=REPO_ROOT, stdout=self._log, stderr=subprocess.STDOUT,
                                        env=self.env)
        return self

    def wait_ready(self) -> None:
        deadline = time.monotonic() + self.start_timeout
        while not self.port_file.exists():
            if self.process.poll() is not None:
                raise RuntimeError(f"{self.name} server exited with {self.process.returncode}:\n{self.log()}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"{self.name} server did not start in {self.start_timeout}s:\n{self.log()}")
            time.sleep(0.02)
        self.address = json.loads(self.port_file.read_text())["address"]

    def cpu_seconds(self) -> float:
        """utime + stime of the whole server process (all threads)."""
        return stat_cpu_seconds(self.process.pid)

    def loop_thread_cpu_seconds(self) -> float:
        """utime + stime of the server's main thread alone: the one running its event loop (every handler, and
        gRPC's Cython layer under it), apart from gRPC's own threads (event_engine, the poller) and any other."""
        return stat_cpu_seconds(self.process.pid, thread=self.process.pid)

    def peak_rss_mb(self) -> float:
        try:
            for line in open(f"/proc/{self.process.pid}/status"):
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
        except OSError:
            pass
        return float("nan")

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-4000:]
        except OSError:
            return ""

    def stop(self) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(30 if self.profile_path else self.stop_timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(10)
        self._log.close()


def stat_cpu_seconds(pid: int, thread: Optional[int] = None) -> float:
    """utime + stime of process `pid` (all its threads), or of its thread `thread` alone, from /proc."""
    path = f"/proc/{pid}/stat" if thread is None else f"/proc/{pid}/task/{thread}/stat"
    with open(path) as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def machine_busy_ticks() -> tuple[int, int]:
    """(busy, total) jiffies of all CPUs, from /proc/stat."""
    with open("/proc/stat") as f:
        values = [int(v) for v in f.readline().split()[1:]]
    idle = values[3] + (values[4] if len(values) > 4 else 0)
    return sum(values) - idle, sum(values)


# ----------------------------------------------------------------------------------------- requests

def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def _length_delimited(field_number: int, data: bytes) -> bytes:
    return _varint((field_number << 3) | 2) + _varint(len(data)) + data


class SubmitBuilder:
    """Serialized SubmitRequests of 64 trajectories of 1,000 tokens, built by concatenation.

    The numeric arrays are serialized once; per call only the ids change. Building 64 messages with the
    protobuf API per call would make the client, which shares the cores with the server, the bottleneck.
    """

    def __init__(self, seed: int):
        rng = random.Random(seed)
        n = TOKENS_PER_TRAJECTORY
        rest = pb.Trajectory(
            ds_index=0,
            status=pb.TRAJECTORY_STATUS_COMPLETED,
            reward=0.0,  # equal rewards: the `reward` filter drops the group once complete (bounded memory)
            token_ids=[rng.randrange(151_936) for _ in range(n)],
            logprobs=[-rng.expovariate(2.0) for _ in range(n)],
            loss_mask=[1] * n,
            start_weight_version=0,
            end_weight_version=0,
        )
        self._rest = rest.SerializeToString()
        self._trajectories_field = pb.SubmitRequest.DESCRIPTOR.fields_by_name["trajectories"].number
        self._request_id_field = pb.SubmitRequest.DESCRIPTOR.fields_by_name["request_id"].number
        self._trajectory_id_field = pb.Trajectory.DESCRIPTOR.fields_by_name["trajectory_id"].number
        self._prompt_id_field = pb.Trajectory.DESCRIPTOR.fields_by_name["prompt_id"].number
        self._check(rest)

    def build(self, prompt_id: str, request_id: str) -> bytes:
        prompt = _length_delimited(self._prompt_id_field, prompt_id.encode())
        rest = self._rest
        parts = [
            _length_delimited(self._trajectories_field,
                              _length_delimited(self._trajectory_id_field, f"{prompt_id}/{j}".encode()) + prompt + rest)
            for j in range(GROUP_SIZE)
        ]
        parts.append(_length_delimited(self._request_id_field, request_id.encode()))
        return b"".join(parts)

    def _check(self, rest: pb.Trajectory) -> None:
        """The concatenated bytes are the message the protobuf API would build."""
        expected = pb.SubmitRequest(request_id="r-1")
        for j in range(GROUP_SIZE):
            t = expected.trajectories.add()
            t.CopyFrom(rest)
            t.trajectory_id, t.prompt_id = f"p-1/{j}", "p-1"
        parsed = pb.SubmitRequest.FromString(self.build("p-1", "r-1"))
        assert parsed == expected, "hand-built SubmitRequest differs from the protobuf-built one"
        assert all(len(t.token_ids) == len(t.logprobs) == len(t.loss_mask) == TOKENS_PER_TRAJECTORY
                   for t in parsed.trajectories)


def dispatch_request(prompt_ids: list[str], request_id: str) -> bytes:
    return pb.DispatchRequest(candidates=[pb.PromptRef(prompt_id=p, ds_index=0) for p in prompt_ids],
                              request_id=request_id).SerializeToString()


# ----------------------------------------------------------------------------------------- client workers

class BadResponse(Exception):
    pass


async def run_load(spec: dict, channels: dict, builder: SubmitBuilder) -> dict:
    """One measured run of one scenario against one server, `spec["inflight"]` calls in flight."""
    address = spec["address"]
    if address not in channels:
        channels[address] = grpc.aio.insecure_channel(address, options=[
            ("grpc.max_send_message_length", 64 << 20), ("grpc.max_receive_message_length", 64 << 20)])
        await asyncio.wait_for(channels[address].channel_ready(), 30)
    channel = channels[address]
    dispatch = channel.unary_unary(SERVICE + "Dispatch", request_serializer=None,
                                   response_deserializer=pb.DispatchResponse.FromString)
    submit = channel.unary_unary(SERVICE + "Submit", request_serializer=None,
                                 response_deserializer=pb.SubmitResponse.FromString)
    get_state = channel.unary_unary(SERVICE + "GetState", request_serializer=None,
                                    response_deserializer=pb.GetStateResponse.FromString)
    state_request = pb.GetStateRequest().SerializeToString()
    scenario, check, tag = spec["scenario"], spec["check"], spec["tag"]
    candidates = spec["candidates"]
    loop = asyncio.get_running_loop()
    clock = time.monotonic
    warm_end, end = spec["warm_end"], spec["end"]
    latencies: list[float] = []
    completed = [0]
    errors: collections.Counter = collections.Counter()
    cpu = {}
    loop.call_at(loop.time() + (warm_end - clock()), lambda: cpu.__setitem__("start", time.process_time()))
    loop.call_at(loop.time() + (end - clock()), lambda: cpu.__setitem__("end", time.process_time()))
    pool: collections.deque = collections.deque()
    refill_lock = asyncio.Lock()
    counter = [0]

    def next_id() -> str:
        counter[0] += 1
        return f"{tag}-{counter[0]:08d}"

    async def refill() -> None:
        ids = [f"p{next_id()}" for _ in range(REFILL_PROMPTS)]
        response = await dispatch(dispatch_request(ids, next_id()), timeout=CALL_TIMEOUT_SECONDS)
        if check and len(response.admitted) != len(ids):
            raise BadResponse(f"refill Dispatch admitted {len(response.admitted)} of {len(ids)}")
        pool.extend(ids)

    async def one_call() -> None:
        if scenario == "peek":
            response = await dispatch(dispatch_request([], next_id()), timeout=CALL_TIMEOUT_SECONDS)
        elif scenario == "getstate":
            response = await get_state(state_request, timeout=CALL_TIMEOUT_SECONDS)
            if check and not response.strategy:
                raise BadResponse("GetState answered without the strategy's name")
        elif scenario == "dispatch":
            ids = [f"p{next_id()}" for _ in range(candidates)]
            response = await dispatch(dispatch_request(ids, next_id()), timeout=CALL_TIMEOUT_SECONDS)
            if check and len(response.admitted) != candidates:
                raise BadResponse(f"Dispatch admitted {len(response.admitted)} of {candidates}")
        else:
            response = await submit(builder.build(pool.popleft(), next_id()), timeout=CALL_TIMEOUT_SECONDS)
            if check and (response.accepted != GROUP_SIZE or response.groups_completed != 1):
                raise BadResponse(f"Submit accepted {response.accepted} of {GROUP_SIZE}, "
                                  f"completed {response.groups_completed} groups")

    async def slot() -> None:
        while True:
            if scenario == "submit" and not pool:
                async with refill_lock:  # a refill is not a measured call; both servers get the same ones
                    if not pool:
                        await refill()
            started = clock()
            if started >= end:
                return
            try:
                await one_call()
            except (grpc.RpcError, BadResponse) as exc:
                errors[str(exc.code()) if isinstance(exc, grpc.RpcError) else str(exc)] += 1
                if sum(errors.values()) > 100:
                    return
                continue
            finished = clock()
            if warm_end <= finished <= end:
                completed[0] += 1
            if started >= warm_end:
                latencies.append(finished - started)

    if scenario == "submit":
        await refill()
    await asyncio.sleep(max(0.0, spec["start"] - clock()))
    await asyncio.gather(*(slot() for _ in range(spec["inflight"])))
    return {"completed": completed[0], "latencies": latencies, "errors": dict(errors),
            "cpu": cpu.get("end", time.process_time()) - cpu.get("start", 0.0)}


def worker_main(conn, worker_index: int) -> None:
    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    channels: dict = {}
    builder = SubmitBuilder(seed=worker_index)
    conn.send("ready")
    while True:
        spec = conn.recv()
        if spec is None:
            break
        try:
            conn.send(loop.run_until_complete(run_load(spec, channels, builder)))
        except BaseException:
            conn.send({"fatal": traceback.format_exc()})
    for channel in channels.values():
        loop.run_until_complete(channel.close())
    loop.close()


class Clients:
    """Client worker processes (spawned, so no gRPC state crosses a fork)."""

    def __init__(self, count: int):
        context = multiprocessing.get_context("spawn")
        self.connections = []
        self.processes = []
        for i in range(count):
            parent, child = context.Pipe()
            process = context.Process(target=worker_main, args=(child, i), daemon=True)
            process.start()
            self.connections.append(parent)
            self.processes.append(process)
        for conn in self.connections:
            if not conn.poll(START_TIMEOUT_SECONDS):
                raise RuntimeError("a client worker did not start")
            assert conn.recv() == "ready"

    def send(self, specs: list[dict]) -> None:
        for conn, spec in zip(self.connections, specs):
            conn.send(spec)

    def receive(self) -> list[dict]:
        results = [conn.recv() for conn in self.connections]
        for result in results:
            if "fatal" in result:
                raise RuntimeError(f"client worker failed:\n{result['fatal']}")
        return results

    def close(self) -> None:
        for conn in self.connections:
            try:
                conn.send(None)
            except OSError:
                pass
        for process in self.processes:
            process.join(10)
            if process.is_alive():
                process.terminate()


# ----------------------------------------------------------------------------------------- coordinator

def percentile(sorted_values: list[float], q: float) -> float:
    if not sorted_values:
        return float("nan")
    rank = max(0, min(len(sorted_values) - 1, int(round(q / 100 * len(sorted_values) + 0.5)) - 1))
    return sorted_values[rank]


def reset_server(channel: grpc.Channel) -> None:
    """Between runs (not measured): drop what the last run left (our server), a no-op on the floor."""
    grpc_reset = channel.unary_unary(SERVICE + "Reset", request_serializer=pb.ResetRequest.SerializeToString,
                                     response_deserializer=pb.ResetResponse.FromString)
    grpc_reset(pb.ResetRequest(mode=pb.RESET_MODE_ABORT, wait_seconds=0.0, resume=True, weight_version=0),
               timeout=CALL_TIMEOUT_SECONDS)


def measure(server: ServerProcess, channel: grpc.Channel, clients: Clients, scenario: str, args, tag: str,
            duration: Optional[float] = None) -> dict:
    measured = duration is None
    reset_server(channel)
    duration = args.duration if duration is None else duration
    now = time.monotonic()
    start = now + 0.25 + (0.1 if scenario == "submit" else 0.0)
    warm_end = start + args.warmup
    end = warm_end + duration
    n = len(clients.connections)
    shares = [args.inflight // n + (1 if i < args.inflight % n else 0) for i in range(n)]
    clients.send([{"address": server.address, "scenario": scenario, "check": server.name == "ours",
                   "tag": f"{tag}w{i}", "candidates": args.candidates, "inflight": shares[i],
                   "start": start, "warm_end": warm_end, "end": end} for i in range(n)])
    time.sleep(max(0.0, warm_end - time.monotonic()))
    cpu0, busy0 = server.cpu_seconds(), machine_busy_ticks()
    if measured:
        server.profiling(True)
    time.sleep(max(0.0, end - time.monotonic()))
    if measured:
        server.profiling(False)
    cpu1, busy1 = server.cpu_seconds(), machine_busy_ticks()
    results = clients.receive()
    summary = summarize_run(results, duration, cpu1 - cpu0, busy0, busy1)
    summary["server_cpu_share"] = (cpu1 - cpu0) / duration
    summary["client_cpu_share"] = sum(r["cpu"] for r in results) / duration
    return summary


def summarize_run(results: list[dict], duration: float, server_cpu: float, busy0: tuple, busy1: tuple) -> dict:
    """Throughput, latency percentiles, server CPU per call, machine busy share and errors of one measured run."""
    completed = sum(r["completed"] for r in results)
    latencies = sorted(x for r in results for x in r["latencies"])
    errors: collections.Counter = collections.Counter()
    for r in results:
        errors.update(r["errors"])
    return {
        "completed": completed,
        "throughput": completed / duration,
        "p50_ms": percentile(latencies, 50) * 1e3,
        "p99_ms": percentile(latencies, 99) * 1e3,
        "server_cpu_ms_per_call": server_cpu * 1e3 / completed if completed else float("nan"),
        "machine_busy": (busy1[0] - busy0[0]) / max(1, busy1[1] - busy0[1]),
        "errors": dict(errors),
    }


def median(values: list[float]) -> float:
    values = [v for v in values if v == v]
    return statistics.median(values) if values else float("nan")


def print_report(args, runs: dict, scenario_defs: dict[str, Scenario], servers: dict) -> bool:
    ok = True
    keys = ("throughput", "p50_ms", "p99_ms", "server_cpu_ms_per_call", "server_cpu_share", "client_cpu_share",
            "machine_busy")
    header = (f"{'scenario':<40} {'server':<6} {'calls/s':>8} {'p50 ms':>8} {'p99 ms':>8} {'srv ms/call':>11} "
              f"{'srv cpu':>7} {'cli cpu':>7} {'busy':>5} | {'ratio':>5} {'target':>6} {'result':>6} | "
              f"{'cpu ratio':>9} {'result':>6}")
    print()
    print(header)
    print("-" * len(header))
    summary = {}
    for name in args.scenarios:
        sc = scenario_defs[name]
        row = {server: {key: median([r[key] for r in runs[(name, server)]]) for key in keys}
               for server in ("floor", "ours")}
        ratio = row["ours"]["throughput"] / row["floor"]["throughput"]
        cpu_ratio = row["floor"]["server_cpu_ms_per_call"] / row["ours"]["server_cpu_ms_per_call"]
        errors = sum(sum(r["errors"].values()) for r in runs[(name, "ours")])
        verdict = "ERROR" if errors else ("PASS" if ratio >= sc.target else "MISS")
        cpu_verdict = "ERROR" if errors else ("PASS" if cpu_ratio >= sc.target else "MISS")
        ok = ok and not errors
        for server in ("floor", "ours"):
            m = row[server]
            tail = (f"{ratio:>5.2f} {'>=' + format(sc.target, '.1f'):>6} {verdict:>6} | {cpu_ratio:>9.2f} {cpu_verdict:>6}"
                    if server == "ours" else f"{'':>5} {'':>6} {'':>6} | {'':>9} {'':>6}")
            print(f"{(sc.title if server == 'floor' else ''):<40} {server:<6} {m['throughput']:>8.0f} "
                  f"{m['p50_ms']:>8.2f} {m['p99_ms']:>8.2f} {m['server_cpu_ms_per_call']:>11.3f} "
                  f"{m['server_cpu_share'] * 100:>6.0f}% {m['client_cpu_share'] * 100:>6.0f}% "
                  f"{m['machine_busy'] * 100:>4.0f}% | {tail}")
        pair_ratios = [o["throughput"] / f["throughput"] for o, f in zip(runs[(name, "ours")], runs[(name, "floor")])]
        print(f"{'':<40} per-pair calls/s ratios: {' '.join(f'{x:.2f}' for x in pair_ratios)}")
        if errors:
            print(f"{'':<40} ERRORS from our server: {[r['errors'] for r in runs[(name, 'ours')]]}")
        summary[name] = {"ratio": ratio, "cpu_ratio": cpu_ratio, "target": sc.target, "verdict": verdict,
                         "cpu_verdict": cpu_verdict, "floor": row["floor"], "ours": row["ours"],
                         "pair_ratios": pair_ratios}
    print()
    print(f"calls/s, p50, p99, srv ms/call, srv/cli cpu, busy: medians over {args.repeats} interleaved repeats "
          f"(p50/p99 of each run's calls).")
    print("ratio     = median(ours calls/s) / median(floor calls/s); the issue's target applies to it.")
    print("cpu ratio = floor / ours server CPU per call (all server threads): the calls/s ratio a server with a core")
    print("            of its own would show. Clients share this machine's cores with the server, and so does")
    print("            anything else running here, so calls/s is a whole-machine figure and the cpu ratio is the")
    print("            steadier measure of the server's own cost.")
    print(f"srv cpu / cli cpu = % of one core used by the server / by all client processes; busy = % of all "
          f"{os.cpu_count()} cores busy (anyone's).")
    with open(servers["ours"].log_path, errors="replace") as log_file:  # the start-up lines, before the access log
        loop_lines = [line for line in log_file.read(65536).splitlines() if "event loop:" in line]
    print(f"our server's {loop_lines[-1].split('coda_server: ', 1)[-1] if loop_lines else 'event loop: not logged'}")
    print(f"Peak server RSS: floor {servers['floor'].peak_rss_mb():.0f} MB, ours {servers['ours'].peak_rss_mb():.0f} MB.")
    if args.json:
        Path(args.json).write_text(json.dumps({"command": command_line(), "summary": summary,
                                               "runs": {f"{k[0]}/{k[1]}": v for k, v in runs.items()}}, indent=2))
    return ok


RPC_METHODS = ("Dispatch", "Submit", "Collect", "Reset", "Resume", "GetState")
CONTEXT_RUN = "<method 'run' of '_contextvars.Context' objects>"


# Small stdlib helpers whose time belongs to whoever called them (like built-ins).
HELPER_FILES = ("<frozen posixpath>", "<frozen abc>", "_weakrefset.py", "inspect.py", "threading.py", "typing.py",
                "<frozen genericpath>", "functools.py", "contextlib.py", "copy.py", "weakref.py", "types.py")


def _layer(filename: str, function: str) -> Optional[str]:
    """The layer a profiled function belongs to; None for the idle wait; "~" for time charged to callers."""
    if filename == "~":
        if "poll' of 'select.epoll'" in function:
            return None
        if function == CONTEXT_RUN:
            return "gRPC Cython/C-core + protobuf C (parse, serialize), opaque"
        if any(name in function for name in ("FromString", "SerializeToString", "ParseFromString", "MergeFromString")):
            return "protobuf C: parse / serialize called from Python"
        return "~"
    path = filename.replace("\\", "/")
    if path.endswith(HELPER_FILES):
        return "~"
    for marker, layer in (("/asyncio/", "asyncio event loop (Python)"), ("/logging/", "logging"),
                          ("/prometheus_client/", "prometheus_client"), ("/grpc/", "grpc (Python parts)"),
                          ("/google/protobuf/", "protobuf (Python parts)"), ("/enum.py", "enum (stdlib)"),
                          ("/dataclasses.py", "dataclasses (stdlib)"), ("/selectors.py", "asyncio event loop (Python)")):
        if marker in path:
            return layer
    if "/coda_server/" in path or "/coda_client/" in path:
        return path[path.rindex("/coda_"):].lstrip("/")
    if path == str(Path(__file__).resolve()) or path.endswith("rpc_throughput.py"):
        return "floor handlers (this bench)"
    if path.startswith("<string>"):
        return "generated __init__ (dataclasses)"
    return "other: " + path.rsplit("/", 1)[-1]


def _charged_layer(stats: dict, function: tuple, depth: int = 0) -> str:
    """The layer of `function`, or, for a built-in or helper, of its main caller (a few levels up)."""
    layer = _layer(function[0], function[2]) or "~"
    if layer != "~":
        return layer
    callers = stats.get(function, (0, 0, 0, 0, {}))[4]
    if depth >= 4 or not callers:
        return "built-ins and stdlib helpers"
    main_caller = max(callers.items(), key=lambda item: item[1][2])[0]
    return _charged_layer(stats, main_caller, depth + 1)


def profile_layers(path: Path) -> tuple[dict[str, tuple[float, int]], int, dict]:
    """(own seconds, function calls) per layer (built-ins charged to their callers' layers), RPCs, raw stats."""
    import pstats

    stats = pstats.Stats(str(path)).stats
    layers: collections.Counter = collections.Counter()
    counts: collections.Counter = collections.Counter()  # function calls per layer (the profiler's cost grows with them)
    calls = 0
    for (filename, _line, function), (_cc, ncalls, own, _cum, callers) in stats.items():
        layer = _layer(filename, function)
        if layer is None:
            continue
        if layer == "~":  # a built-in or helper: its time belongs to whoever called it
            total = sum(c[2] for c in callers.values()) or 1.0
            for caller, c in callers.items():
                charged = _charged_layer(stats, caller)
                layers[charged] += own * c[2] / total
                counts[charged] += c[1]
            continue
        layers[layer] += own
        counts[layer] += ncalls
        if function in RPC_METHODS and (filename.endswith("service.py") or filename.endswith("rpc_throughput.py")):
            calls += ncalls
    return {layer: (seconds, counts[layer]) for layer, seconds in layers.items()}, calls, stats


def print_profile(profile_dir: Path, top: int) -> None:
    import pstats

    summaries = {}
    for name in ("floor", "ours"):
        path = profile_dir / f"{name}.prof"
        if path.exists():
            summaries[name] = profile_layers(path)
    if not summaries:
        print(f"(no profiles were written in {profile_dir})")
        return
    print("\n===== Where the event-loop thread's busy time goes, measured windows only (cProfile, wall "
          "time of the event-loop thread) =====")
    print("Caveats: the profiler adds ~0.5 us per Python function call (see calls/RPC), so Python-heavy layers read "
          "high;\nwall time also counts preemption (spread over all layers) and GIL waits (charged to the opaque "
          "gRPC block).")
    for name, (layers, calls, _stats) in summaries.items():
        busy = sum(seconds for seconds, _count in layers.values())
        rpcs = max(1, calls)
        print(f"\n{name}: {calls} RPCs handled, {busy:.2f} s busy = {busy / rpcs * 1e6:.0f} us per RPC")
        print(f"  {'share':>6} {'us/RPC':>9} {'calls/RPC':>9}  layer")
        for layer, (seconds, count) in sorted(layers.items(), key=lambda item: -item[1][0]):
            if seconds / busy >= 0.005:
                print(f"  {seconds / busy * 100:5.1f}% {seconds / rpcs * 1e6:9.1f} {count / rpcs:9.1f}  {layer}")
    if "ours" in summaries:
        print(f"\n===== ours: top {top} functions by own time (measured windows only) =====")
        stats = pstats.Stats(str(profile_dir / "ours.prof"))
        stats.sort_stats("tottime").print_stats(top)
        print(f"===== ours: top {top} by cumulative time =====")
        stats.sort_stats("cumulative").print_stats(top)


def command_line() -> str:
    return shlex.join([os.path.relpath(sys.executable) if sys.executable.startswith(str(REPO_ROOT)) else sys.executable,
                       *sys.argv])


def add_load_options(parser: argparse.ArgumentParser, *, repeats_help: str) -> None:
    """The load and timing options every server benchmark here shares."""
    parser.add_argument("--quick", action="store_true", help="short smoke run (1 repeat, 1 s runs)")
    parser.add_argument("--repeats", type=int, help=f"{repeats_help} (default 5, quick 1)")
    parser.add_argument("--duration", type=float, help="measured seconds per run (default 3, quick 1)")
    parser.add_argument("--warmup", type=float, help="unmeasured seconds of load before each run (default 0.5)")
    parser.add_argument("--prime", type=float, help="unreported seconds of load per server and scenario before "
                                                    "the repeats (default 1.5, quick 0.5)")
    parser.add_argument("--inflight", type=int, default=64, help="calls in flight in total (default 64)")
    parser.add_argument("--clients", type=int, default=2, help="client worker processes (default 2)")


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_load_options(parser, repeats_help="interleaved floor/ours pairs per scenario")
    parser.add_argument("--candidates", type=int, default=4, help="candidates per Dispatch (default 4)")
    parser.add_argument("--scenarios", default="peek,dispatch,submit",
                        help="comma-separated subset of peek,dispatch,submit,getstate")
    parser.add_argument("--profile", metavar="DIR", default=os.environ.get(PROFILE_ENV) or None,
                        help=f"run both servers under cProfile, write DIR/ours.prof and DIR/floor.prof and print "
                             f"the top functions (default: ${PROFILE_ENV})")
    parser.add_argument("--profile-top", type=int, default=30, help="rows of the printed profile")
    parser.add_argument("--server-arg", action="append", default=[], metavar="KEY=VALUE",
                        help="extra configuration override for our server (repeatable), e.g. server.log_level=WARNING")
    parser.add_argument("--json", metavar="FILE", help="also write the figures as JSON")
    parser.add_argument("--floor-passthrough", action="store_true",
                        help="the floor parses Submit into the same pass-through views as our server (coda_server/"
                             "wire.py) instead of decoding every token: shows how much of the Submit ratio that "
                             "parse accounts for")
    parser.add_argument("--floor-generic", action="store_true",
                        help="the floor registers no method by name either, as our server does (coda_server/"
                             "method_wrapping.py): what our server's per-call features cost on the same routing")
    parser.add_argument("--floor-event-loop", choices=("asyncio", "uvloop"), default="asyncio",
                        help="the floor's event loop: asyncio's (the default: a plain grpc.aio server) or uvloop, "
                             "the loop our server runs on when uvloop is installed (server.event_loop auto)")
    parser.add_argument("--serve-floor", metavar="PORT_FILE", help=argparse.SUPPRESS)
    parser.add_argument("--profile-serve", choices=("floor", "ours"), help=argparse.SUPPRESS)
    args, rest = parser.parse_known_args(argv)
    if args.serve_floor:
        return run_on_floor_loop(serve_floor, Path(args.serve_floor), rest)
    if args.profile_serve:
        return profile_serve(args.profile_serve, Path(rest[0]), Path(rest[1]), rest[2:])
    if rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    args.repeats = args.repeats or (1 if args.quick else 5)
    args.duration = args.duration or (1.0 if args.quick else 3.0)
    args.prime = args.prime if args.prime is not None else (0.5 if args.quick else 1.5)
    args.warmup = args.warmup if args.warmup is not None else (0.3 if args.quick else 0.5)
    args.scenarios = [s.strip() for s in args.scenarios.split(",") if s.strip()]
    scenario_defs = scenarios(args.candidates)
    unknown = [s for s in args.scenarios if s not in scenario_defs]
    if unknown:
        parser.error(f"unknown scenarios {unknown}; choose from {', '.join(scenario_defs)}")
    profile_dir = Path(args.profile).resolve() if args.profile else None
    if profile_dir:
        profile_dir.mkdir(parents=True, exist_ok=True)

    from google.protobuf.internal import api_implementation

    print(f"command: {command_line()}")
    print(f"python {platform.python_version()}, grpcio {grpc.__version__}, protobuf {api_implementation.Type()}, "
          f"{os.cpu_count()} cores, load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    print(f"load: {args.inflight} calls in flight from {args.clients} client processes (grpc.aio); "
          f"{args.repeats} repeats x {args.duration:g} s measured (+{args.warmup:g} s warm-up) per server and "
          f"scenario, floor/ours interleaved")
    print(f"our server: python -m coda_server {' '.join(OUR_OVERRIDES + args.server_arg)}")
    if args.floor_passthrough:
        os.environ[FLOOR_PASSTHROUGH_ENV] = "1"  # read by the floor subprocess only
        print("floor: parses Submit into pass-through views, as our server does (--floor-passthrough)")
    if args.floor_generic:
        os.environ[FLOOR_GENERIC_ENV] = "1"  # read by the floor subprocess only
        print("floor: no method registered by name, served by generic handlers as our server's are (--floor-generic)")
    os.environ[FLOOR_LOOP_ENV] = args.floor_event_loop  # read by the floor subprocess only
    print(f"floor's event loop: {args.floor_event_loop} (--floor-event-loop)")
    if profile_dir:
        print(f"PROFILING: both servers run under cProfile ({profile_dir}); the figures below are NOT valid "
              f"measurements of either server")

    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="coda-bench-") as tmp:
        overrides = OUR_OVERRIDES + args.server_arg
        servers = {name: ServerProcess(name, Path(tmp), profile_dir, overrides) for name in ("floor", "ours")}
        clients = None
        channels: dict[str, grpc.Channel] = {}
        try:
            for server in servers.values():
                server.start()
            clients = Clients(args.clients)
            for name, server in servers.items():
                server.wait_ready()
                channels[name] = grpc.insecure_channel(server.address)
            runs: dict[tuple[str, str], list[dict]] = {(s, n): [] for s in args.scenarios for n in servers}
            # Priming, not reported: connections, caches, and the heap our server grows while it holds a run's
            # trajectories (a long-running server reuses that memory step after step; a fresh one pays page faults).
            for scenario in args.scenarios:
                for name in servers:
                    result = measure(servers[name], channels[name], clients, scenario, args, tag=f"x{scenario[0]}{name[0]}",
                                     duration=args.prime)
                    if result["errors"]:
                        raise RuntimeError(f"{name} server answered {scenario} with errors: {result['errors']}")
            print(f"  primed both servers ({args.prime:g} s per scenario, not reported)", flush=True)
            pair = 0
            for repeat in range(args.repeats):
                for scenario in args.scenarios:
                    order = ("floor", "ours") if pair % 2 == 0 else ("ours", "floor")
                    pair += 1
                    for name in order:
                        result = measure(servers[name], channels[name], clients, scenario, args,
                                         tag=f"r{repeat}{scenario[0]}{name[0]}")
                        runs[(scenario, name)].append(result)
                        print(f"  repeat {repeat + 1}/{args.repeats} {scenario:<8} {name:<5} "
                              f"{result['throughput']:8.0f} calls/s  p50 {result['p50_ms']:7.2f} ms  "
                              f"p99 {result['p99_ms']:7.2f} ms  server cpu {result['server_cpu_ms_per_call']:.3f} ms/call"
                              f"{'  errors ' + str(result['errors']) if result['errors'] else ''}", flush=True)
            ok = print_report(args, runs, scenario_defs, servers)
            print(f"wall time {time.monotonic() - started:.0f} s")
        finally:
            for channel in channels.values():
                channel.close()
            if clients is not None:
                clients.close()
            for server in servers.values():
                server.stop()
        if profile_dir:
            print_profile(profile_dir, args.profile_top)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
