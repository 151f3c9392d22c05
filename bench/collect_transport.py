"""The response-direction transport floor: gRPC moving a Collect answer of pre-built bytes, against Submit.

Where does `batches()` lose against Submit? This bench takes our server out of the picture: an empty-handler
gRPC server (bench/rpc_throughput.py's floor: our server options and allocator setting) answers each Collect
with the pre-built bytes of an answer (no encoding, an identity serializer) and takes each Submit's bytes
without parsing them. Our client receives them exactly as `batches()` does (the pass-through stub, the same
channel options), in one run, alternately, at the sizes of the payload bench:

* one mini-batch answer: 128 trajectories x 32,768 tokens in one message (~50 MB), and
* one group: 16 trajectories (~6.3 MB), the size of each Submit.

Per size and direction: MB/s of the call alone (bytes in hand), and for Collect also the views
(CollectResult.from_pb) and the packed batch (MiniBatch.from_collects); "8 x one group": the mini-batch fetched
as one-group Collects, all in flight at once; "stream": the mini-batch as one server-streaming call (what
CollectStream does) with 1/4, 1/2, 1, 2 or 4 groups' worth per message; last, our own server (`python -m
coda_server`) answering the mini-batch through Collect and through CollectStream, alternately. Beside each, the CPU the client process
(all its threads) and the server process spent per 100 MB, which load from elsewhere on the machine disturbs
less than wall time. Server variants: the grpc.aio server (our server's) and the sync thread-pool server, to tell
the aio write path's cost from the transport's (the streams on the aio server only).

    python bench/collect_transport.py                 # both servers, 5 repeats, about a minute idle
    python bench/collect_transport.py --server aio --repeats 3
    python bench/collect_transport.py --profile /tmp/ct   # cProfile of the client's receive path per case
    MALLOC_MMAP_THRESHOLD_=268435456 MALLOC_TRIM_THRESHOLD_=268435456 python bench/collect_transport.py
        # the client's allocator keeping freed memory (glibc tunables; the server keeps its own settings)
"""
from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import grpc

sys.path.insert(0, str(Path(__file__).resolve().parent))
from payload_path import GROUP_SIZE, MINI_BATCH, collect_response, make_arrays, overrides  # noqa: E402
from rpc_throughput import stat_cpu_seconds  # noqa: E402

from coda_client import CollectResult, MiniBatch, PacerClient, _calls  # noqa: E402
from coda_client._channel import channel_options  # noqa: E402
from coda_client._proto import pacer_pb2 as pb  # noqa: E402

SERVICE = "/coda.pacer.v1.RolloutPacer/"
TOKENS = 32_768
nan = float("nan")


def answers(tokens: int) -> dict[int, Any]:
    """The encoded CollectResponse of 1, 2, 4 and 8 groups (one mini-batch), by group count; under -k, the
    mini-batch's answer as a list of messages holding 1/k of a group each."""
    arrays = make_arrays(MINI_BATCH, tokens)
    groups = [arrays[i:i + GROUP_SIZE] for i in range(0, len(arrays), GROUP_SIZE)]
    encoded = {n: collect_response(groups[:n], 0).SerializeToString() for n in (MINI_BATCH // GROUP_SIZE, 1, 2, 4)}
    for parts in (1, 2, 4):  # -k: each group's answer in k messages (smaller messages, for the experiment only)
        n = GROUP_SIZE // parts
        encoded[-parts] = [collect_response([group[i:i + n]], g).SerializeToString()
                           for g, group in enumerate(groups) for i in range(0, GROUP_SIZE, n)]
    return encoded


# ------------------------------------------------------------------------------------------ servers

def _handlers(encoded: dict[int, bytes]) -> grpc.GenericRpcHandler:
    identity: Callable[[bytes], bytes] = lambda data: data  # noqa: E731

    def collect(request: pb.CollectRequest, context: Any) -> bytes:
        return encoded[request.num_groups]

    def submit(request: bytes, context: Any) -> bytes:
        return b""

    return grpc.method_handlers_generic_handler("coda.pacer.v1.RolloutPacer", {
        "Collect": grpc.unary_unary_rpc_method_handler(collect, request_deserializer=pb.CollectRequest.FromString,
                                                       response_serializer=identity),
        "Submit": grpc.unary_unary_rpc_method_handler(submit, request_deserializer=identity,
                                                      response_serializer=identity),
    })


def _aio_handlers(encoded: dict[int, bytes]) -> grpc.GenericRpcHandler:
    identity: Callable[[bytes], bytes] = lambda data: data  # noqa: E731

    async def collect(request: pb.CollectRequest, context: Any) -> bytes:
        return encoded[request.num_groups]

    async def submit(request: bytes, context: Any) -> bytes:
        return b""

    async def stream(request: pb.CollectRequest, context: Any) -> Any:
        # The mini-batch in messages of num_groups groups each, or with world_size > 1 each group in that many.
        per, parts = request.num_groups, encoded[-max(1, request.world_size)]
        for i in range(0, len(parts), per):
            yield b"".join(parts[i:i + per])

    return grpc.method_handlers_generic_handler("coda.pacer.v1.RolloutPacer", {
        "CollectStream": grpc.unary_stream_rpc_method_handler(stream, request_deserializer=pb.CollectRequest.FromString,
                                                              response_serializer=identity),
        "Collect": grpc.unary_unary_rpc_method_handler(collect, request_deserializer=pb.CollectRequest.FromString,
                                                       response_serializer=identity),
        "Submit": grpc.unary_unary_rpc_method_handler(submit, request_deserializer=identity,
                                                      response_serializer=identity),
    })


def serve(kind: str, port_file: Path, tokens: int) -> int:
    from coda_server.allocator import retain_freed_memory
    from coda_server.core import load_config
    from coda_server.server import server_options

    config = load_config(overrides=overrides(32))
    retain_freed_memory(int(config.server.allocator_retain_bytes))
    encoded = answers(tokens)
    stop_requested = []

    def announce(port: int) -> None:
        port_file.with_suffix(".tmp").write_text(json.dumps({"address": f"127.0.0.1:{port}"}))
        port_file.with_suffix(".tmp").replace(port_file)

    if kind == "sync":
        server = grpc.server(concurrent.futures.ThreadPoolExecutor(8), options=server_options(config),
                             handlers=[_handlers(encoded)])
        announce(server.add_insecure_port("127.0.0.1:0"))
        server.start()
        signal.signal(signal.SIGTERM, lambda *_: stop_requested.append(1) or server.stop(0))
        server.wait_for_termination()
        return 0

    async def main() -> None:
        server = grpc.aio.server(options=server_options(config))
        server.add_generic_rpc_handlers([_aio_handlers(encoded)])
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        announce(port)
        stop = asyncio.Event()
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
        await stop.wait()
        await server.stop(0.5)

    asyncio.run(main())
    return 0


class Server:
    def __init__(self, kind: str, workdir: Path, tokens: int):
        self.kind = kind
        self.port_file = workdir / f"{kind}.port.json"
        # glibc's MALLOC_* tunables in the environment are for the client only (see the module docstring).
        env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
        self.process = subprocess.Popen([sys.executable, __file__, "--serve", kind, str(self.port_file), str(tokens)],
                                        env=env)
        deadline = time.monotonic() + 120
        while not self.port_file.exists():
            if self.process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{kind} server did not start")
            time.sleep(0.05)
        self.address = json.loads(self.port_file.read_text())["address"]

    def cpu_seconds(self) -> float:
        return stat_cpu_seconds(self.process.pid)

    def stop(self) -> None:
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(15)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


# ------------------------------------------------------------------------------------------ client

class Client:
    """Our client's channel and pass-through methods (as coda_client.wire_forms.passthrough_stub)."""

    def __init__(self, address: str):
        self.channel = grpc.insecure_channel(address, options=channel_options())
        self.collect = self.channel.unary_unary(SERVICE + "Collect", request_serializer=pb.CollectRequest.SerializeToString,
                                                response_deserializer=None)
        self.stream = self.channel.unary_stream(SERVICE + "CollectStream",
                                                request_serializer=pb.CollectRequest.SerializeToString,
                                                response_deserializer=None)
        self.submit = self.channel.unary_unary(SERVICE + "Submit", request_serializer=None, response_deserializer=None)
        self.pool = concurrent.futures.ThreadPoolExecutor(MINI_BATCH // GROUP_SIZE)

    def close(self) -> None:
        self.pool.shutdown()
        self.channel.close()


def collect_once(client: Client, groups: int, stage: str) -> tuple[float, int]:
    started = time.perf_counter()
    return finish_stage([client.collect(pb.CollectRequest(num_groups=groups), timeout=120)], stage, started)


def collect_split(client: Client, stage: str) -> tuple[float, int]:
    """The mini-batch as one-group Collects, every one in flight at once (futures on one channel)."""
    started = time.perf_counter()
    futures = [client.collect.future(pb.CollectRequest(num_groups=1), timeout=120)
               for _ in range(MINI_BATCH // GROUP_SIZE)]
    return finish_stage([f.result() for f in futures], stage, started)


def collect_stream(client: Client, per_message: int, stage: str) -> tuple[float, int]:
    """The mini-batch as one server-streaming call, `per_message` groups per message (-k: a group in k)."""
    started = time.perf_counter()
    request = (pb.CollectRequest(num_groups=per_message) if per_message > 0
               else pb.CollectRequest(num_groups=1, world_size=-per_message))
    return finish_stage(list(client.stream(request, timeout=120)), stage, started)


def finish_stage(datas: list[bytes], stage: str, started: float) -> tuple[float, int]:
    """The received answers taken as far as `stage` (call: received; views: NumPy views; packed: a
    MiniBatch), then (seconds since `started`, bytes received)."""
    size = sum(len(d) for d in datas)
    if stage != "call":
        results = [CollectResult.from_pb(d, "numpy") for d in datas]
        if stage == "packed":
            MiniBatch.from_collects(results)
    return time.perf_counter() - started, size


def submit_once(client: Client, payload: bytes) -> tuple[float, int]:
    started = time.perf_counter()
    client.submit(payload, timeout=120)
    return time.perf_counter() - started, len(payload)


def measure(server: Server, repeats: int, encoded: dict[int, Any], profile: Path | None) -> dict[str, tuple[float, float, float]]:
    client = Client(server.address)
    big, small = MINI_BATCH // GROUP_SIZE, 1
    cases: dict[str, Callable[[], tuple[float, int]]] = {
        "submit 50 MB": lambda: submit_once(client, encoded[big]),
        "submit 6.3 MB": lambda: submit_once(client, encoded[small]),
        "collect 50 MB call": lambda: collect_once(client, big, "call"),
        "collect 50 MB views": lambda: collect_once(client, big, "views"),
        "collect 50 MB packed": lambda: collect_once(client, big, "packed"),
        "collect 6.3 MB call": lambda: collect_once(client, small, "call"),
        "collect 6.3 MB views": lambda: collect_once(client, small, "views"),
        "collect 6.3 MB packed": lambda: collect_once(client, small, "packed"),
        "collect 8 x 6.3 MB call": lambda: collect_split(client, "call"),
        "collect 8 x 6.3 MB packed": lambda: collect_split(client, "packed"),
    }
    if server.kind == "aio":
        for per, label in ((-4, "1/4 group"), (-2, "1/2 group"), (1, "1 group"), (2, "2 groups"), (4, "4 groups")):
            cases[f"stream, {label}/msg call"] = lambda per=per: collect_stream(client, per, "call")
            cases[f"stream, {label}/msg packed"] = lambda per=per: collect_stream(client, per, "packed")
    for run in cases.values():  # warm-up: connection, allocator
        run()
    rates: dict[str, list[float]] = {name: [] for name in cases}
    cpu: dict[str, list[float]] = {name: [] for name in cases}  # client CPU ms (all threads) per 100 MB
    server_cpu: dict[str, list[float]] = {name: [0.0, 0] for name in cases}  # the server's seconds and bytes (summed:
    # /proc counts clock ticks of 10 ms)
    names = list(cases)
    for repeat in range(repeats):
        for name in names[repeat % len(names):] + names[:repeat % len(names)]:
            reps = 1 if "50" in name or "8 x" in name or "stream" in name else 8
            server_started, total = server.cpu_seconds(), 0
            for _ in range(reps):
                cpu_started = time.process_time()
                seconds, size = cases[name]()
                cpu[name].append((time.process_time() - cpu_started) * 1e3 * 1e8 / size)
                rates[name].append(size / 1e6 / seconds)
                total += size
            server_cpu[name][0] += server.cpu_seconds() - server_started
            server_cpu[name][1] += total
    if profile is not None:
        import cProfile
        import pstats

        for name in ("collect 50 MB packed", "stream, 1 group/msg packed", "submit 50 MB"):
            profiler = cProfile.Profile()
            profiler.enable()
            for _ in range(3):
                cases[name]()
            profiler.disable()
            path = profile / f"{server.kind}-{name.replace(' ', '_')}.prof"
            profiler.dump_stats(str(path))
            print(f"\n--- client profile, {server.kind} server, {name} (3 calls)")
            pstats.Stats(str(path)).sort_stats("cumulative").print_stats(12)
    client.close()
    return {name: (statistics.median(rates[name]), statistics.median(cpu[name]),
                   server_cpu[name][0] * 1e3 * 1e8 / server_cpu[name][1]) for name in cases}


def measure_ours(workdir: Path, repeats: int, tokens: int) -> dict[str, tuple[float, float, float]]:
    """Our server (`python -m coda_server`, shipped defaults, state in memory) holding one mini-batch at a time,
    taken by a leased Collect (one 50 MB answer) or by batches()'s leased CollectStream, alternately, and packed."""
    import payload_path

    arrays = make_arrays(MINI_BATCH, tokens, seed=1)
    groups = [arrays[i:i + GROUP_SIZE] for i in range(0, len(arrays), GROUP_SIZE)]
    server = payload_path.ServerProcess("ours", workdir, None, overrides(len(groups))).start()
    rates: dict[str, list[float]] = {"ours: Collect, packed": [], "ours: CollectStream, packed": []}
    cpu: dict[str, list[float]] = {name: [] for name in rates}
    server_cpu: dict[str, list[float]] = {name: [0.0, 0] for name in rates}
    try:
        server.wait_ready()
        with PacerClient(server.address, arrays="numpy", timeout=120) as pacer:
            for round_ in range(2 * repeats + 2):  # two rounds of warm-up
                name = list(rates)[round_ % 2]
                payload_path.submit_all(pacer, groups, round_)
                client_started, server_started = time.process_time(), server.cpu_seconds()
                started = time.perf_counter()
                result = pacer._run(_calls.collect(len(groups), wait=10, allow_partial=False, request_id=None,
                                                   timeout=120, lease=60, arrays="numpy",
                                                   streamed="Stream" in name))
                batch = MiniBatch.from_collect(result)
                seconds, client_seconds = time.perf_counter() - started, time.process_time() - client_started
                server_seconds = server.cpu_seconds() - server_started
                size = batch.token_ids.nbytes + batch.logprobs.nbytes + batch.loss_mask.nbytes
                pacer.ack(result.lease_id)
                if round_ >= 2:
                    rates[name].append(size / 1e6 / seconds)
                    cpu[name].append(client_seconds * 1e11 / size)
                    server_cpu[name][0] += server_seconds
                    server_cpu[name][1] += size
    finally:
        server.stop()
    return {name: (statistics.median(rates[name]), statistics.median(cpu[name]),
                   server_cpu[name][0] * 1e11 / server_cpu[name][1]) for name in rates}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--server", choices=("aio", "sync", "both"), default="both")
    parser.add_argument("--tokens", type=int, default=TOKENS)
    parser.add_argument("--profile", type=Path)
    args = parser.parse_args(argv)
    encoded = answers(args.tokens)
    kinds = ("aio", "sync") if args.server == "both" else (args.server,)
    print(f"collect_transport: answers of {len(encoded[8]) / 1e6:.1f} MB (8 groups) and {len(encoded[1]) / 1e6:.1f} MB "
          f"(1 group); python {platform.python_version()}, grpc {grpc.__version__}, {os.cpu_count()} cores")
    if args.profile:
        args.profile.mkdir(parents=True, exist_ok=True)
    results: dict[str, dict[str, tuple[float, float, float]]] = {}
    with tempfile.TemporaryDirectory(prefix="collect-transport-") as tmp:
        for kind in kinds:
            server = Server(kind, Path(tmp), args.tokens)
            try:
                results[kind] = measure(server, args.repeats, encoded, args.profile)
            finally:
                server.stop()
        results[kinds[0]].update(measure_ours(Path(tmp), args.repeats, args.tokens))
    print(f"\nMB/s of message bytes; CPU ms per 100 MB of the client (all its threads; median) and of the "
          f"server (over the run); medians over {args.repeats} repeats (6.3 MB cases: 8 calls per repeat; "
          f"\"ours\": our server, MB/s and client CPU of the array bytes, below the first server's columns)")
    print(f"{'':34}" + "".join(f"{k + ' MB/s':>11}{'client':>8}{'server':>8}" for k in kinds))
    for name in results[kinds[0]]:
        print(f"{name:34}" + "".join("{:11.0f}{:8.0f}{:8.0f}".format(*results[k].get(name, (nan, nan, nan)))
                                     for k in kinds))
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--serve":
        sys.exit(serve(sys.argv[2], Path(sys.argv[3]), int(sys.argv[4])))
    sys.exit(main())
