"""The trainer's data path against the protobuf floor of the same work (issue 15's benchmark).

In one run and one process tree: a live coda-server on its shipped defaults (metrics on, per-RPC logs on)
holding 512 trajectories x 32,768 tokens (token ids, logprobs and loss mask all that long) in groups of 16,
then a trainer collecting them in mini-batches of 128 trajectories into NumPy arrays. Per repeat, with a
fresh server:

* Submit-from-NumPy: a worker submits the 32 groups (one Submit per group) from NumPy arrays through
  `PacerClient.submit`; floor: building the same SubmitRequests from the same arrays the fastest way
  protobuf allows (array bytes into the pass-through view's bytes fields), serializing them and parsing
  them as a view, in this process. Beside both, the same `PacerClient.submit` to an empty-handler gRPC
  server (rpc_throughput.py's floor server: our server's options and allocator setting, Submit parsed as
  our server parses it, nothing else done): what gRPC's transport alone costs, so the report can tell
  our server's share from gRPC's;
* server RSS per held byte: (server RSS with the 512 trajectories held - its RSS before) / held_bytes
  (the encoded size the server reports in GetState);
* Collect-to-NumPy: the trainer takes the 4 mini-batches with `PacerClient(arrays="numpy").collect_result`
  (leased, then acknowledged) and gets every trajectory's arrays as NumPy views; floor: serializing an
  identical CollectResponse (8 groups of 16) and parsing it as a view plus the NumPy views, in this process.
  The same figure is also given for what `batches()` does per mini-batch (a leased CollectStream, the same
  answer in messages of a few MiB, packed into flat columns: one more copy);
* prefetch gap: the groups submitted again, the trainer iterates `batches(128)` with a 2 s sleep standing
  in for each training step; the gap is the time from the end of a step to the next batch in hand.

MB/s counts array bytes (token ids, logprobs, loss mask: 12 bytes per token). Floor and ours are measured
request by request, alternately (the order rotating), so load from elsewhere hits both alike. Submit
figures are the median over every Submit of every repeat (one group, 6.3 MB, each: the floor's time per
request varies by a factor of two with the state of this process's allocator, which the median of a few
per-repeat sums did not smooth); so are the Collect figures, over every mini-batch of every repeat (a
repeat's first mini-batches meet a fresh server, as its first Submits do; each repeat's total is printed
too); the other figures are medians over the repeats. Ratios are median(ours) / median(floor).

With --concurrent (issue 29): 8 worker processes submit long-tailed groups while 4 trainer ranks iterate
batches(512, rank=r, world_size=4), against our server and against a relay (a gRPC server with our server's
options, routing and Submit parsing that queues each Submit's encoded trajectories and answers each Collect, and each
CollectStream in messages split as ours splits them, with the rank's share of the next global mini-batch in arrival
order, nothing else; --relay-split arrival: the next groups, whatever rank asks), alternately, after one
unmeasured run of each (--warmup: the first run is often slower, whichever server it meets):
aggregate MB/s in and out as ratios, token imbalance across ranks per step (max/mean, and over the least any split
of that step's groups into equal counts could reach), each rank's time in
next() (the prefetch gap; --step-seconds adds a training step), each Submit's time at the writers (p50, p90, p99: a
writer sends its next Submit when the last is answered, so the tail sets its pace), and the CPU time of the server,
of the writers and of the ranks (the clients share the machine's cores with the server, so the MB/s ratios are
whole-machine figures).

    python bench/payload_path.py             # 3 repeats, about 40 s on an idle machine
    python bench/payload_path.py --concurrent --repeats 3   # the many-writers, many-readers run (about 2 min)
    python bench/payload_path.py --concurrent --repeats 3 --relay-split arrival   # the relay of earlier rounds
    python bench/payload_path.py --quick     # 1 repeat of a quarter of the data, a smoke run
    python bench/payload_path.py --set server.allocator_retain_bytes=0   # glibc's allocator defaults
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from collections.abc import Iterator
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from rpc_throughput import (FLOOR_LOOP_ENV, FLOOR_PASSTHROUGH_ENV, ServerProcess, machine_busy_ticks,  # noqa: E402
                            percentile, run_on_floor_loop)

from coda_client import MiniBatch, PacerClient, Trajectory, TrajectoryStatus  # noqa: E402
from coda_client import _calls  # noqa: E402
from coda_client import wire_forms as _wire  # noqa: E402
from coda_server import wire  # noqa: E402

GROUP_SIZE = 16
MINI_BATCH = 128
STEP_SECONDS = 2.0
TARGETS = {"collect": 0.5, "submit": 0.5, "rss_per_held_byte": 1.3, "prefetch_gap_fraction": 0.05,
           "packed_vs_floor": 0.8, "packed_vs_submit": 0.9}


# --set KEY=VALUE: configuration overrides for both servers (e.g. server.allocator_retain_bytes=0).
EXTRA_OVERRIDES: list[str] = []


def overrides(groups: int) -> list[str]:
    """Shipped defaults, except the shape of the workload, free ports and --set."""
    return ["server.address=127.0.0.1:0", "server.metrics_address=127.0.0.1:0",
            "server.state_dir=",  # state in memory: the data path alone (bench/durability_cost.py measures the journal)
            f"data_source.num_prompts_per_step={groups}", f"data_source.num_trajectories_per_prompt={GROUP_SIZE}",
            f"trainer.mini_batch_size={MINI_BATCH}", *EXTRA_OVERRIDES]


def make_arrays(trajectories: int, tokens: int, seed: int = 0) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(seed)
    return [(rng.integers(0, 151_936, tokens, dtype=np.int32), -rng.exponential(2.0, tokens).astype(np.float32),
             (rng.random(tokens) < 0.9).astype(np.int32)) for _ in range(trajectories)]


def trajectories_of(prompt_id: str, arrays: list, round_: int) -> list[Trajectory]:
    return [Trajectory(trajectory_id=f"{prompt_id}/{j}/{round_}", prompt_id=prompt_id,
                       status=TrajectoryStatus.COMPLETED, reward=float(j), token_ids=t, logprobs=l, loss_mask=m)
            for j, (t, l, m) in enumerate(arrays)]


def array_bytes(arrays: list) -> int:
    return sum(t.nbytes + l.nbytes + m.nbytes for t, l, m in arrays)


def rss_bytes(pid: int) -> int:
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")


# ------------------------------------------------------------------------------------------- floors
# Floor and ours are measured request by request, alternately (the order flipping each time), so a burst of
# load from elsewhere on the machine hits both alike. What each produces is kept until the end of its
# measurement: a server keeps what it accepted, a trainer keeps its batches (fresh memory for each).

def submit_floor_one(g: int, arrays: list, kept: list) -> float:
    """Seconds to build the group's SubmitRequest from the arrays (their bytes into the pass-through view's
    bytes fields: the fastest way protobuf offers), serialize it and parse it as a view."""
    started = time.perf_counter()
    request = wire.SubmitRequest(request_id=f"r-{g}")
    for j, (t, l, m) in enumerate(arrays):
        request.trajectories.add(trajectory_id=f"p{g}/{j}", prompt_id=f"p{g}", status=1, reward=float(j),
                                 token_ids=t.tobytes(), logprobs=l.tobytes(), loss_mask=m.tobytes())
    parsed = wire.SubmitRequest.FromString(request.SerializeToString())
    elapsed = time.perf_counter() - started
    assert len(parsed.trajectories) == len(arrays)
    kept.append(parsed)
    return elapsed


def collect_response(groups: list[list], first: int) -> Any:
    """The CollectResponse our server would answer with for these groups, as a view (built untimed)."""
    response = _wire.CollectResponse(lease_id="lease-1")
    for g, arrays in enumerate(groups):
        group = response.groups.add(prompt_id=f"p{first + g}", seq=first + g)
        for j, (t, l, m) in enumerate(arrays):
            trajectory = Trajectory(trajectory_id=f"p{g}/{j}", prompt_id=f"p{first + g}", status=1, reward=float(j),
                                    token_ids=t, logprobs=l, loss_mask=m)
            group.trajectories.append(_wire.Trajectory.FromString(b"".join(trajectory.encoded_parts())))
    return response


def collect_floor_one(response: Any, kept: list) -> float:
    """Seconds to serialize the response (a view), parse it as a view and view every array as NumPy."""
    started = time.perf_counter()
    view = _wire.CollectResponse.FromString(response.SerializeToString())
    arrays = [(np.frombuffer(t.token_ids, "<i4"), np.frombuffer(t.logprobs, "<f4"), np.frombuffer(t.loss_mask, "<i4"))
              for g in view.groups for t in g.trajectories]
    elapsed = time.perf_counter() - started
    assert len(arrays) == sum(len(g.trajectories) for g in response.groups)
    kept.append(arrays)
    return elapsed


# ------------------------------------------------------------------------------------------- ours

class CpuMeter:
    """CPU seconds of this process (all its threads: the client's gRPC ones too) and of our server, summed over
    the calls timed with it: a figure load from elsewhere on the machine disturbs less than wall time."""

    def __init__(self, server: ServerProcess):
        self.server = server
        self.client_seconds = self.server_seconds = 0.0

    @contextlib.contextmanager
    def measuring(self) -> Iterator[None]:
        client, server = time.process_time(), self.server.cpu_seconds()
        try:
            yield
        finally:
            self.client_seconds += time.process_time() - client
            self.server_seconds += self.server.cpu_seconds() - server

    def per_100_mb(self, payload: int) -> tuple[float, float]:
        """(client, server) CPU milliseconds per 100 MB of arrays."""
        return self.client_seconds * 1e11 / payload, self.server_seconds * 1e11 / payload


def submit_ours_one(pacer: PacerClient, prompt_id: str, arrays: list, round_: int,
                    meter: CpuMeter | None = None) -> float:
    trajectories = trajectories_of(prompt_id, arrays, round_)  # the caller's own values, built untimed
    with meter.measuring() if meter else contextlib.nullcontext():
        started = time.perf_counter()
        result = pacer.submit(trajectories)
        elapsed = time.perf_counter() - started
    assert result.accepted == len(arrays) and result.groups_completed == 1, result
    return elapsed


def submit_sink_one(sink: PacerClient, prompt_id: str, arrays: list, round_: int) -> float:
    trajectories = trajectories_of(prompt_id, arrays, round_)
    started = time.perf_counter()
    sink.submit(trajectories)  # the empty handler answers accepted=0
    return time.perf_counter() - started


def submit_all(pacer: PacerClient, groups: list[list], round_: int, floor: bool = False,
               sink: PacerClient | None = None, meter: CpuMeter | None = None) -> dict[str, list[float]]:
    """Submits every group (ours), each next to its floor when `floor` and to the empty-handler server
    when `sink` is given, the order rotating group by group: the seconds of each Submit, by kind."""
    prompts = [f"p{g}-r{round_}" for g in range(len(groups))]
    answer = pacer.dispatch(prompts)
    assert answer.admitted == prompts, f"window too small: {answer}"
    seconds: dict[str, list[float]] = {"ours": [], "floor": [], "sink": []}
    kept: list = []
    for g, (prompt_id, arrays) in enumerate(zip(prompts, groups)):
        measures = {"ours": lambda: submit_ours_one(pacer, prompt_id, arrays, round_, meter)}
        if floor:
            measures["floor"] = lambda: submit_floor_one(g, arrays, kept)
        if sink is not None:
            measures["sink"] = lambda: submit_sink_one(sink, prompt_id, arrays, round_)
        names = list(measures)
        for name in names[g % len(names):] + names[:g % len(names)]:
            seconds[name].append(measures[name]())
    return seconds


def collect_ours_one(pacer: PacerClient, packed: bool, kept: list) -> tuple[float, int]:
    """Seconds for the trainer to take one leased mini-batch into NumPy arrays and acknowledge it: as views
    (collect_result, a Collect), or packed as batches() takes each (its leased CollectStream, its packing;
    without its background thread, so that nothing of ours runs while the floor is measured)."""
    started = time.perf_counter()
    if packed:
        result = pacer._run(_calls.collect(MINI_BATCH // GROUP_SIZE, wait=10, allow_partial=False, request_id=None,
                                           timeout=pacer.timeout, lease=60, arrays="numpy",
                                           max_response_bytes=pacer.max_receive_bytes, streamed=True))
    else:
        result = pacer.collect_result(MINI_BATCH // GROUP_SIZE, wait=10, lease=60)
    assert len(result.groups) == MINI_BATCH // GROUP_SIZE, result.timed_out
    if packed:
        batch = MiniBatch.from_collect(result)
        size = batch.token_ids.nbytes + batch.logprobs.nbytes + batch.loss_mask.nbytes
        kept.append(batch)
    else:
        size = sum(t.token_ids.nbytes + t.logprobs.nbytes + t.loss_mask.nbytes
                   for g in result.groups for t in g.trajectories)
        kept.append(result)
    pacer.ack(result.lease_id)
    return time.perf_counter() - started, size


def collect_all(pacer: PacerClient, batches: int, packed: bool, response: Any = None,
                meter: CpuMeter | None = None) -> tuple[list[float], list[float], int]:
    """Takes every mini-batch (ours), each next to its floor when `response` is given: the seconds of each
    (ours, floor) and the array bytes taken."""
    ours: list[float] = []
    floor_seconds: list[float] = []
    size = 0
    kept: list = []
    floor_kept: list = []
    for b in range(batches):
        if response is not None and b % 2:
            floor_seconds.append(collect_floor_one(response, floor_kept))
        with meter.measuring() if meter else contextlib.nullcontext():
            seconds, batch_size = collect_ours_one(pacer, packed, kept)
        ours.append(seconds)
        size += batch_size
        if response is not None and not b % 2:
            floor_seconds.append(collect_floor_one(response, floor_kept))
    return ours, floor_seconds, size


def prefetch_gaps(pacer: PacerClient, batches: int) -> list[float]:
    gaps = []
    with pacer.batches(MINI_BATCH, lease=120, poll=5, num_batches=batches) as iterator:
        next(iterator)
        for _ in range(batches - 1):
            time.sleep(STEP_SECONDS)  # the training step
            step_ended = time.perf_counter()
            next(iterator)
            gaps.append(time.perf_counter() - step_ended)
    return gaps


# ------------------------------------------------------------------------------- many writers, many readers
# --concurrent: WRITERS worker processes submit while RANKS trainer ranks iterate batches(rank=r, world_size=RANKS)
# of the global DP_MINI_BATCH, against our server and against a relay: a gRPC server with our server's options,
# routing and Submit parsing that keeps each Submit's encoded trajectories in a queue and answers each Collect (and CollectStream,
# what batches() calls, in messages split as ours splits them) with the rank's share of the next global mini-batch
# (num_groups / world_size groups, in arrival order, no balancing; --relay-split arrival: the next groups, whatever
# rank asks), nothing else. Same clients, same bytes.

WRITERS, RANKS = 8, 4
DP_MINI_BATCH = 512  # the global mini-batch: 32 groups of 16, 8 groups per rank
# Long runs, so that start-up and a scheduling hiccup weigh little: 32 groups per writer are 87 MB each way, under a
# second of load; 512 are 1.5 GB, about 10 s a run (bench/README.md, eighteenth round).
DP_GROUPS_PER_WRITER = 512
CONCURRENT_TARGETS = {"in": 0.9, "out": 0.9, "imbalance": 1.1}
# How the relay hands the ranks their groups (relay_servicer): shares of one global mini-batch, or the next groups
# as they arrived, whatever rank asks (the relay of earlier rounds, bench/README.md). --relay-split chooses.
RELAY_SPLITS = ("global", "arrival")
RELAY_SPLIT_ENV = "CODA_BENCH_RELAY_SPLIT"  # read by the relay's subprocess


def long_tailed_lengths(groups: int, seed: int, rng: np.random.Generator | None = None) -> list[list[int]]:
    """Response lengths of each group's trajectories: a per-prompt scale (lognormal around 1,024 tokens: a few
    prompts run long) times a per-response spread, clipped to 64..32,768 tokens. Drawn from `rng` when given
    (share_balance.py draws many mini-batches from one), else from a generator seeded with `seed`."""
    rng = rng if rng is not None else np.random.default_rng(seed)
    lengths = []
    for _ in range(groups):
        scale = rng.lognormal(np.log(1024), 1.0)
        lengths.append(np.clip(scale * rng.lognormal(0.0, 0.5, GROUP_SIZE), 64, 32_768).astype(int).tolist())
    return lengths


def writer_process(address: str, writer: int, lengths: list[list[int]], start: Any, results: Any) -> None:
    """One worker: dispatches its prompts, then submits one group per Submit (arrays built before the start), one
    at a time; records each Submit's time."""
    rng = np.random.default_rng(writer)
    prompts = [f"w{writer}-g{g}" for g in range(len(lengths))]
    groups = [[(rng.integers(0, 151_936, n, dtype=np.int32), -rng.exponential(2.0, n).astype(np.float32),
                np.ones(n, np.int32)) for n in group] for group in lengths]
    payload = sum(array_bytes(group) for group in groups)
    with PacerClient(address, timeout=120, client_id=f"writer-{writer}") as pacer:
        pacer.dispatch(prompts)
        start.wait()
        began, cpu_began = time.time(), time.process_time()
        submit_seconds = []
        for prompt_id, group in zip(prompts, groups):
            sent = time.perf_counter()
            pacer.submit(trajectories_of(prompt_id, group, 0))
            submit_seconds.append(time.perf_counter() - sent)
        results.put(("writer", writer, began, time.time(), payload, time.process_time() - cpu_began, submit_seconds))


def rank_process(address: str, rank: int, steps: int, step_seconds: float, start: Any, results: Any) -> None:
    """One trainer rank: iterates its shares of `steps` global mini-batches; records tokens, bytes and the time
    each next() waited (the prefetch gap after a step of `step_seconds`)."""
    records = []
    with PacerClient(address, arrays="numpy", timeout=120, client_id=f"rank-{rank}") as pacer:
        start.wait()
        began, cpu_began = time.time(), time.process_time()
        with pacer.batches(DP_MINI_BATCH, group_size=GROUP_SIZE, rank=rank, world_size=RANKS, num_batches=steps,
                           lease=300, poll=10) as batches:
            for _ in range(steps):
                asked = time.perf_counter()
                batch = next(batches)
                group_tokens = np.bincount(batch.group_index, weights=np.diff(batch.cu_seqlens)).astype(int).tolist()
                records.append((time.perf_counter() - asked, batch.num_tokens,
                                batch.token_ids.nbytes + batch.logprobs.nbytes + batch.loss_mask.nbytes, time.time(),
                                group_tokens))
                if step_seconds:
                    time.sleep(step_seconds)
        results.put(("rank", rank, began, time.time(), records, time.process_time() - cpu_began))


class RelayServer(ServerProcess):
    """The relay of the concurrent run, in a subprocess of this script."""

    def command(self) -> list[str]:
        return [sys.executable, str(Path(__file__).resolve()), "--serve-relay", str(self.port_file), *self.overrides]


def relay_servicer() -> Any:
    """The relay's servicer: each Submit's encoded trajectories (as our server's parse reads them) into a queue; each
    Collect (and CollectStream, what batches() calls, split as our server splits) answered with num_groups /
    world_size groups in arrival order, no balancing: by default (RELAY_SPLITS[0], "global") the rank's share of
    a global mini-batch, the next num_groups groups cut into world_size equal shares by the first rank to ask (the
    contract of batches(rank=, world_size=), which our server keeps: every rank trains on a share of the same
    mini-batch); with "arrival" the next groups whatever rank asks (ranks then train on groups of different
    mini-batches, and wake one by one rather than together). The other methods answer empty.
    handler_instructions.py's `cycle` counts it too (its `floor`; one rank, so both splits are the same)."""
    import asyncio

    from coda_client._proto import pacer_pb2 as pb
    from coda_client._proto import pacer_pb2_grpc
    from coda_server.wire import EncodedAnswer, EncodedTrajectory, group_parts, split_answer

    queue: list = []  # (prompt id, encoded trajectories) of each group, in arrival order
    shares: dict[int, list] = {}  # rank -> its shares of the global mini-batches cut so far, oldest first
    split = os.environ.get(RELAY_SPLIT_ENV, RELAY_SPLITS[0])
    arrived = asyncio.Condition()

    class Relay(pacer_pb2_grpc.RolloutPacerServicer):
        async def Dispatch(self, request, context):
            return pb.DispatchResponse()

        async def Submit(self, request, context):
            bodies = [EncodedTrajectory(t.encoded) for t in request.trajectories]
            async with arrived:
                queue.append((request.trajectories[0].fields.prompt_id, bodies))
                arrived.notify_all()
            return pb.SubmitResponse(accepted=len(bodies), groups_completed=1)

        async def Collect(self, request, context):
            message, groups = await self._take(request)
            return EncodedAnswer(message, {"groups": groups})

        async def CollectStream(self, request, context):  # what batches() calls: split as our server splits
            for answer in split_answer(*await self._take(request)):
                yield answer

        async def _take(self, request):
            world_size = max(1, request.world_size)
            count = request.num_groups // world_size
            rank = request.rank
            by_global_batch = split == RELAY_SPLITS[0] and world_size > 1

            def ready() -> bool:
                if by_global_batch:  # this rank's share of a mini-batch already cut, or a whole one to cut
                    return bool(shares.get(rank)) or len(queue) >= request.num_groups
                return len(queue) >= count

            async with arrived:
                try:
                    await asyncio.wait_for(arrived.wait_for(ready), request.wait_seconds)
                except asyncio.TimeoutError:
                    return pb.CollectResponse(timed_out=True), []
                if not by_global_batch:
                    taken, queue[:count] = queue[:count], []
                else:
                    if not shares.get(rank):  # the first rank to ask cuts the next global mini-batch for all
                        batch, queue[:request.num_groups] = queue[:request.num_groups], []
                        for share_rank in range(world_size):
                            shares.setdefault(share_rank, []).append(batch[share_rank * count:(share_rank + 1) * count])
                        arrived.notify_all()  # the ranks waiting for a whole mini-batch have their shares now
                    taken = shares[rank].pop(0)
            return pb.CollectResponse(lease_id="relay"), [group_parts(p, 0, 0, None, None, bodies) for p, bodies in taken]

        async def Ack(self, request, context):
            return pb.AckResponse()

        async def GetState(self, request, context):
            return pb.GetStateResponse()

        async def WatchControl(self, request, context):
            yield pb.ControlEvent(type=pb.CONTROL_EVENT_TYPE_STATE).SerializeToString()
            await asyncio.Event().wait()  # until the call is cancelled

    return Relay()


async def serve_relay(port_file: Path, server_overrides: list[str]) -> int:
    import asyncio
    import signal

    import grpc

    from coda_client._proto import pacer_pb2_grpc
    from coda_server.allocator import retain_freed_memory
    from coda_server.core import load_config
    from coda_server.method_wrapping import WrappingRegistrar
    from coda_server.server import SERVICE_NAME, server_options, tune_garbage_collector
    from coda_server.wire import PassthroughCodec

    config = load_config(overrides=server_overrides)
    retain_freed_memory(int(config.server.allocator_retain_bytes))  # the same process settings as ours
    tune_garbage_collector()
    server = grpc.aio.server(options=server_options(config))
    # Routed as our server routes (no method registered by name, see coda_server/method_wrapping.py): registered by
    # name, each of the 15 methods would cost the relay's every call about 5,500 instructions more than ours.
    pacer_pb2_grpc.add_RolloutPacerServicer_to_server(
        relay_servicer(), WrappingRegistrar(server, [PassthroughCodec(SERVICE_NAME)], by_name=()))
    port = server.add_insecure_port(str(config.server.address))
    await server.start()
    temporary = port_file.with_suffix(".tmp")
    temporary.write_text(json.dumps({"address": f"127.0.0.1:{port}", "port": port}))
    temporary.replace(port_file)
    stop = asyncio.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        asyncio.get_running_loop().add_signal_handler(signum, stop.set)
    await stop.wait()
    await server.stop(1.0)
    return 0


def least_imbalance(group_tokens: list[int], ranks: int, equal_counts: bool = True) -> float:
    """A lower bound of max/mean tokens per rank when `ranks` ranks get these whole groups: the rank holding the
    largest group holds, with equal counts, the others' count less one besides it, at best the smallest ones."""
    sizes = sorted(group_tokens)
    mean = sum(sizes) / ranks
    heaviest = sizes[-1] + (sum(sizes[:len(sizes) // ranks - 1]) if equal_counts else 0)
    return max(mean, heaviest) / mean


def concurrent_once(kind: str, workdir: Path, lengths: list[list[list[int]]], step_seconds: float) -> dict:
    """One run of the writers and ranks against `kind` ("ours" or "relay"): the figures of the run."""
    import multiprocessing

    total_groups = sum(len(w) for w in lengths)
    steps = total_groups * GROUP_SIZE // DP_MINI_BATCH
    server_overrides = [*overrides(total_groups), f"trainer.mini_batch_size={DP_MINI_BATCH}"]
    server = (RelayServer("relay", workdir, None, server_overrides) if kind == "relay"
              else ServerProcess("ours", workdir, None, server_overrides)).start()
    context = multiprocessing.get_context("spawn")
    start, results = context.Event(), context.Queue()
    try:
        server.wait_ready()
        rss_before = rss_bytes(server.process.pid)
        processes = [context.Process(target=writer_process, args=(server.address, w, lengths[w], start, results))
                     for w in range(WRITERS)]
        processes += [context.Process(target=rank_process, args=(server.address, r, steps, step_seconds, start,
                                                                  results)) for r in range(RANKS)]
        for process in processes:
            process.start()
        time.sleep(3.0)  # every process connected and its arrays built (the start event releases them together)
        # Start-up left out: the relay imports more (this script, NumPy).
        cpu_at_start, loop_cpu_at_start = server.cpu_seconds(), server.loop_thread_cpu_seconds()
        start.set()
        got = [results.get(timeout=600) for _ in processes]
        for process in processes:
            process.join(60)
        peak_rss, server_cpu = server.peak_rss_mb(), server.cpu_seconds() - cpu_at_start
        loop_cpu = server.loop_thread_cpu_seconds() - loop_cpu_at_start
    finally:
        server.stop()
    writers = [g for g in got if g[0] == "writer"]
    ranks = sorted((g for g in got if g[0] == "rank"), key=lambda g: g[1])
    began = min(g[2] for g in got)
    bytes_in = sum(g[4] for g in writers)
    bytes_out = sum(r[2] for g in ranks for r in g[4])
    per_step_tokens = [[g[4][step][1] for g in ranks] for step in range(steps)]
    imbalance = [max(t) / (sum(t) / len(t)) for t in per_step_tokens]
    # Each step's least possible imbalance with equal group counts per rank, whoever splits: the rank holding the
    # largest group holds the others' count less one besides it, at best the smallest ones.
    per_step_groups = [[size for g in ranks for size in g[4][step][4]] for step in range(steps)]
    least = [least_imbalance(sizes, RANKS) for sizes in per_step_groups]
    submit_ms = sorted(1000 * seconds for g in writers for seconds in g[6])
    return {
        "kind": kind, "steps": steps, "in_mb_s": bytes_in / 1e6 / (max(g[3] for g in writers) - began),
        "out_mb_s": bytes_out / 1e6 / (max(r[3] for g in ranks for r in g[4]) - began),
        "bytes_in": bytes_in, "bytes_out": bytes_out, "imbalance": imbalance, "least_imbalance": least,
        "gaps_ms": {g[1]: [1000 * r[0] for r in g[4]] for g in ranks}, "server_peak_rss_mb": peak_rss,
        "rss_before_mb": rss_before / 1e6, "server_cpu_s": server_cpu, "server_loop_cpu_s": loop_cpu,
        "writers_cpu_s": sum(g[5] for g in writers), "ranks_cpu_s": sum(g[5] for g in ranks),
        "submit_ms": {f"p{q}": percentile(submit_ms, q) for q in (50, 90, 99)},
    }


def concurrent_main(repeats: int, step_seconds: float, groups_per_writer: int, json_path: Path | None,
                    warmups: int = 1) -> int:
    lengths = [long_tailed_lengths(groups_per_writer, seed=100 + w) for w in range(WRITERS)]
    all_lengths = [n for w in lengths for g in w for n in g]
    print(f"payload_path --concurrent: {WRITERS} writer processes x {groups_per_writer} groups of {GROUP_SIZE}, "
          f"{RANKS} ranks iterating batches({DP_MINI_BATCH}, rank=r, world_size={RANKS}); response lengths "
          f"median {int(np.median(all_lengths))}, p90 {int(np.percentile(all_lengths, 90))}, max {max(all_lengths)} "
          f"tokens; step {step_seconds} s; python {platform.python_version()}, {os.cpu_count()} cores")
    runs: dict[str, list[dict]] = {"ours": [], "relay": []}
    warmup_runs: dict[str, list[dict]] = {"ours": [], "relay": []}
    with tempfile.TemporaryDirectory(prefix="payload-concurrent-") as tmp:
        def run(kind: str, name: str) -> dict:
            workdir = Path(tmp) / name
            workdir.mkdir()
            return concurrent_once(kind, workdir, lengths, step_seconds)

        # The first run is often slower, whichever server it meets (bench/README.md, "thirty-third round"), and repeat
        # 0 runs ours first: unmeasured pairs first, so that no measured run is that one.
        for warmup in range(warmups):
            for kind in ("ours", "relay"):
                warmup_runs[kind].append(run(kind, f"warmup-{kind}-{warmup}"))
            print(f"  warm-up pair {warmup + 1}/{warmups} done (not measured): in MB/s ours "
                  f"{warmup_runs['ours'][-1]['in_mb_s']:.1f}, relay {warmup_runs['relay'][-1]['in_mb_s']:.1f}", flush=True)
        busy0 = machine_busy_ticks()
        for repeat in range(repeats):
            for kind in (("relay", "ours") if repeat % 2 else ("ours", "relay")):
                runs[kind].append(run(kind, f"{kind}-{repeat}"))
            print(f"  repeat {repeat + 1}/{repeats} done", flush=True)
    busy1 = machine_busy_ticks()
    busy = 100 * (busy1[0] - busy0[0]) / max(1, busy1[1] - busy0[1])

    def med(kind: str, key: str) -> float:
        return statistics.median(r[key] for r in runs[kind])

    print(f"\n{repeats} repeat(s) after {warmups} unmeasured warm-up pair(s); {runs['ours'][0]['bytes_in'] / 1e6:.0f} MB "
          f"of arrays each way; machine busy {busy:.0f}% (all cores, anyone's) during the repeats\n")
    print(f"{'':38} {'ours':>9} {'relay':>9} {'ratio':>7}  target")
    ok = True
    for name, key in (("aggregate MB/s in (8 writers)", "in_mb_s"), ("aggregate MB/s out (4 ranks)", "out_mb_s")):
        ratio = med("ours", key) / med("relay", key)
        passed = ratio >= CONCURRENT_TARGETS[key.split("_")[0]]
        ok &= passed
        print(f"{name:38} {med('ours', key):9.1f} {med('relay', key):9.1f} {ratio:7.2f}  >= "
              f"{CONCURRENT_TARGETS[key.split('_')[0]]} {'PASS' if passed else 'FAIL'}")
    print("  per repeat, ours/relay in: " + ", ".join(f"{o['in_mb_s'] / r['in_mb_s']:.2f}"
                                                     for o, r in zip(runs["ours"], runs["relay"]))
          + "; out: " + ", ".join(f"{o['out_mb_s'] / r['out_mb_s']:.2f}" for o, r in zip(runs["ours"], runs["relay"]))
          # Each repeat runs both servers back to back: its own ratio is not moved by the machine's load changing
          # between repeats, which the ratio of the medians above is.
          + "; median of the per-repeat ratios, in / out: " + " / ".join(
              f"{statistics.median(o[key] / r[key] for o, r in zip(runs['ours'], runs['relay'])):.2f}"
              for key in ("in_mb_s", "out_mb_s")))
    ours_imbalance = [x for r in runs["ours"] for x in r["imbalance"]]
    relay_imbalance = [x for r in runs["relay"] for x in r["imbalance"]]
    passed = statistics.median(ours_imbalance) <= CONCURRENT_TARGETS["imbalance"]
    ok &= passed
    print(f"token imbalance across ranks per step (max/mean): ours median {statistics.median(ours_imbalance):.3f}, "
          f"max {max(ours_imbalance):.3f}  target <= {CONCURRENT_TARGETS['imbalance']} {'PASS' if passed else 'FAIL'}; "
          f"relay (groups in arrival order, no balancing) median {statistics.median(relay_imbalance):.3f}, "
          f"max {max(relay_imbalance):.3f}")
    over_least = [x / least for r in runs["ours"] for x, least in zip(r["imbalance"], r["least_imbalance"])]
    print(f"  ours over each step's least possible imbalance (equal group counts, whole groups): median "
          f"{statistics.median(over_least):.3f}, max {max(over_least):.3f}; the least itself median "
          f"{statistics.median(x for r in runs['ours'] for x in r['least_imbalance']):.3f}, max "
          f"{max(x for r in runs['ours'] for x in r['least_imbalance']):.3f}")
    # A rank's first next() waits for the writers to submit the first global mini-batch: the start of the run, not a
    # gap between steps, and the longest wait by far; it is reported apart.
    def gap_figures(kind: str, rank: int) -> str:
        gaps = [g for r in runs[kind] for g in r["gaps_ms"][rank][1:]]
        return f"median {statistics.median(gaps):.1f} max {max(gaps):.1f}" if gaps else "none (one batch a run)"

    for rank in range(RANKS):
        print(f"rank {rank} prefetch gap (time in next(), ms, after the first batch): ours {gap_figures('ours', rank)}; "
              f"relay {gap_figures('relay', rank)}")
    first_batch_ms = {kind: statistics.median(r["gaps_ms"][rank][0] for r in runs[kind] for rank in range(RANKS))
                      for kind in ("ours", "relay")}
    print(f"  the first batch (the first mini-batch submitted), median over repeats and ranks: ours "
          f"{first_batch_ms['ours']:.0f} ms; relay {first_batch_ms['relay']:.0f} ms")
    # A writer's next Submit waits for the last one's answer: the tail of these sets the writers' pace as much as
    # the median does.
    print("Submit time at the writers (ms), median over repeats of each run's p50 / p90 / p99: " + "; ".join(
        f"{kind} " + " / ".join(f"{statistics.median(r['submit_ms'][q] for r in runs[kind]):.1f}"
                                for q in ("p50", "p90", "p99")) for kind in ("ours", "relay")))
    print(f"server peak RSS: ours {med('ours', 'server_peak_rss_mb'):.0f} MB, relay "
          f"{med('relay', 'server_peak_rss_mb'):.0f} MB")
    # CPU is disturbed less than wall time by load from elsewhere: the steadier figure of what each server costs.
    print(f"server CPU s during the run: ours {med('ours', 'server_cpu_s'):.2f}, relay "
          f"{med('relay', 'server_cpu_s'):.2f}, relay / ours {med('relay', 'server_cpu_s') / med('ours', 'server_cpu_s'):.2f}")
    # Both servers run every handler on one event-loop thread, beside gRPC's own threads: where the difference lives.
    print(f"  of which the event-loop thread: ours {med('ours', 'server_loop_cpu_s'):.2f}, relay "
          f"{med('relay', 'server_loop_cpu_s'):.2f}; the other threads: ours "
          f"{statistics.median(r['server_cpu_s'] - r['server_loop_cpu_s'] for r in runs['ours']):.2f}, relay "
          f"{statistics.median(r['server_cpu_s'] - r['server_loop_cpu_s'] for r in runs['relay']):.2f}")
    # The clients share the machine's cores: what they spend is the rest of the MB/s ratios' story.
    print(f"client CPU s during the run (all processes): writers ours {med('ours', 'writers_cpu_s'):.2f}, relay "
          f"{med('relay', 'writers_cpu_s'):.2f}; ranks ours {med('ours', 'ranks_cpu_s'):.2f}, relay "
          f"{med('relay', 'ranks_cpu_s'):.2f}")
    if json_path:
        json_path.write_text(json.dumps({"runs": runs, "warmup_runs": warmup_runs, "busy_percent": busy}, indent=2))
    return 0 if ok else 1


# ------------------------------------------------------------------------------------------- run

def one_repeat(repeat: int, arrays: list, workdir: Path) -> dict:
    groups = [arrays[i:i + GROUP_SIZE] for i in range(0, len(arrays), GROUP_SIZE)]
    batches = len(arrays) // MINI_BATCH
    payload = array_bytes(arrays)
    workdir = workdir / f"repeat-{repeat}"  # a fresh port file: the previous server's must not be read
    workdir.mkdir()
    server = ServerProcess("ours", workdir, None, overrides(len(groups))).start()
    sink_server = ServerProcess("floor", workdir, None, overrides(len(groups))).start()
    try:
        server.wait_ready()
        sink_server.wait_ready()
        with PacerClient(server.address, arrays="numpy", timeout=120) as pacer, \
                PacerClient(sink_server.address, timeout=120) as sink:
            pacer.state()
            rss_before = rss_bytes(server.process.pid)
            meters = {phase: CpuMeter(server) for phase in ("submit", "views", "packed")}
            submit_seconds = submit_all(pacer, groups, 0, floor=True, sink=sink, meter=meters["submit"])
            state = pacer.state()
            rss_held = rss_bytes(server.process.pid)
            response = collect_response(groups[:MINI_BATCH // GROUP_SIZE], 0)
            collect_seconds, floor_collect, collected = collect_all(pacer, batches, False, response, meters["views"])
            assert collected == payload, (collected, payload)
            rss_consumed = rss_bytes(server.process.pid)  # everything acknowledged: nothing is held any more
            del response
            submit_all(pacer, groups, 1)
            packed_seconds = collect_all(pacer, batches, True, meter=meters["packed"])[0]
            submit_all(pacer, groups, 2)
            gaps = prefetch_gaps(pacer, batches)
    finally:
        server.stop()
        sink_server.stop()
    return {
        "repeat": repeat,
        "array_mb": payload / 1e6,
        # Per Submit (one group each): the report takes the median over every Submit of every repeat.
        "group_mb": payload / 1e6 / len(groups),
        "submit_seconds": submit_seconds,
        # Per mini-batch (MINI_BATCH trajectories each): the report takes the median over every mini-batch of
        # every repeat, as for Submits; each repeat's total is printed beside it.
        "batch_mb": payload / 1e6 / batches,
        "collect_seconds": {"views": collect_seconds, "packed": packed_seconds, "floor": floor_collect},
        "collect_mb_s": payload / 1e6 / sum(collect_seconds),
        "collect_packed_mb_s": payload / 1e6 / sum(packed_seconds),
        "collect_floor_mb_s": payload / 1e6 / sum(floor_collect),
        "held_bytes": state.held_bytes,
        "rss_growth_bytes": rss_held - rss_before,
        "rss_per_held_byte": (rss_held - rss_before) / state.held_bytes,
        "server_rss_mb": rss_held / 1e6,
        "rss_after_consumed_mb": rss_consumed / 1e6,
        "rss_before_mb": rss_before / 1e6,
        "gaps_ms": [g * 1000 for g in gaps],
        "gap_median_ms": statistics.median(gaps) * 1000,
        **{f"cpu_{phase}_{side}_ms": value for phase, meter in meters.items()
           for side, value in zip(("client", "server"), meter.per_100_mb(payload))},
    }


def report(runs: list[dict], busy: float) -> bool:
    med = {key: statistics.median(r[key] for r in runs) for key in runs[0]
           if key not in ("repeat", "gaps_ms", "submit_seconds", "collect_seconds")}
    for kind, key in (("ours", "submit_mb_s"), ("floor", "submit_floor_mb_s"), ("sink", "submit_sink_mb_s")):
        med[key] = runs[0]["group_mb"] / statistics.median(t for r in runs for t in r["submit_seconds"][kind])
        for r in runs:
            r[key] = r["group_mb"] / statistics.median(r["submit_seconds"][kind])
    # Collects as Submits: the median over every mini-batch of every repeat (a repeat's first mini-batches meet a
    # fresh server's and this process's allocator state, as its first Submits do); each repeat's total below.
    totals = {key: [r[key] for r in runs] for key in ("collect_mb_s", "collect_packed_mb_s", "collect_floor_mb_s")}
    for kind, key in (("views", "collect_mb_s"), ("packed", "collect_packed_mb_s"), ("floor", "collect_floor_mb_s")):
        med[key] = runs[0]["batch_mb"] / statistics.median(t for r in runs for t in r["collect_seconds"][kind])
    submit_ratio = med["submit_mb_s"] / med["submit_floor_mb_s"]
    collect_ratio = med["collect_mb_s"] / med["collect_floor_mb_s"]
    packed_ratio = med["collect_packed_mb_s"] / med["collect_floor_mb_s"]
    gap_fraction = med["gap_median_ms"] / 1000 / STEP_SECONDS
    rows = [
        ("Collect-to-NumPy MB/s (views)", med["collect_mb_s"], med["collect_floor_mb_s"], collect_ratio,
         f">= {TARGETS['collect']}", collect_ratio >= TARGETS["collect"]),
        ("  same, packed by batches()", med["collect_packed_mb_s"], med["collect_floor_mb_s"], packed_ratio,
         f">= {TARGETS['packed_vs_floor']}", packed_ratio >= TARGETS["packed_vs_floor"]),
        ("Submit-from-NumPy MB/s", med["submit_mb_s"], med["submit_floor_mb_s"], submit_ratio,
         f">= {TARGETS['submit']}", submit_ratio >= TARGETS["submit"]),
    ]
    sink_ratio = med["submit_sink_mb_s"] / med["submit_floor_mb_s"]
    rows.append(("  empty-handler gRPC server", med["submit_sink_mb_s"], med["submit_floor_mb_s"], sink_ratio, "", True))
    print(f"\n{len(runs)} repeat(s) of {runs[0]['array_mb']:.0f} MB of arrays; machine busy {busy:.0f}% "
          f"(all cores, anyone's) during the run\n")
    print(f"{'':34} {'ours':>9} {'floor':>9} {'ratio':>7}  target")
    for name, ours, floor, ratio, target, ok in rows:
        print(f"{name:34} {ours:9.1f} {floor:9.1f} {ratio:7.2f}  {target} {'' if not target else 'PASS' if ok else 'FAIL'}")
    print(f"Submit, ours / empty-handler gRPC server: {med['submit_mb_s'] / med['submit_sink_mb_s']:.2f} "
          f"(what our server adds to gRPC's transport)")
    packed_vs_submit = med["collect_packed_mb_s"] / med["submit_mb_s"]
    packed_ok = packed_vs_submit >= TARGETS["packed_vs_submit"]
    print(f"batches() (packed) / Submit-from-NumPy, ours: {packed_vs_submit:.2f}  target >= "
          f"{TARGETS['packed_vs_submit']} {'PASS' if packed_ok else 'FAIL'} (per repeat: "
          + ", ".join(f"{packed / r['submit_mb_s']:.2f}" for packed, r in zip(totals["collect_packed_mb_s"], runs))
          + " with each repeat's packed total)")
    cpu = {phase: (med[f"cpu_{phase}_client_ms"], med[f"cpu_{phase}_server_ms"]) for phase in ("submit", "views", "packed")}
    print("CPU ms per 100 MB of arrays, client (this process, all threads) + server, median over the repeats (load "
          "from elsewhere disturbs it less than wall time): " + "; ".join(
              f"{name} {cpu[phase][0]:.0f} + {cpu[phase][1]:.0f}" for name, phase in
              (("Submit", "submit"), ("Collect views", "views"), ("batches() packed", "packed")))
          + f"; Submit / batches() packed, in CPU: {sum(cpu['submit']) / sum(cpu['packed']):.2f}")
    rss_ok = med["rss_per_held_byte"] <= TARGETS["rss_per_held_byte"]
    print(f"\nserver RSS per held byte: {med['rss_per_held_byte']:.2f}  (RSS growth "
          f"{med['rss_growth_bytes'] / 1e6:.0f} MB for held_bytes {med['held_bytes'] / 1e6:.0f} MB; server RSS "
          f"{med['server_rss_mb']:.0f} MB)  target <= {TARGETS['rss_per_held_byte']} {'PASS' if rss_ok else 'FAIL'}")
    print(f"server RSS before the Submits {med['rss_before_mb']:.0f} MB, with everything held "
          f"{med['server_rss_mb']:.0f} MB, after the trainer took and acknowledged all {med['rss_after_consumed_mb']:.0f} MB")
    gap_ok = gap_fraction < TARGETS["prefetch_gap_fraction"]
    print(f"prefetch gap: {med['gap_median_ms']:.1f} ms after a {STEP_SECONDS:.0f} s step = {100 * gap_fraction:.2f}% "
          f"(every gap, ms: {[round(g, 1) for r in runs for g in r['gaps_ms']]})  target < 5% "
          f"{'PASS' if gap_ok else 'FAIL'}")
    print("\nper repeat (collect: the repeat's totals; packed as batches() takes them): " + "; ".join(
        f"collect {r['collect_mb_s']:.0f}/{r['collect_floor_mb_s']:.0f}, packed {r['collect_packed_mb_s']:.0f}, submit {r['submit_mb_s']:.0f}/"
        f"{r['submit_floor_mb_s']:.0f} (empty handler {r['submit_sink_mb_s']:.0f}), rss/held {r['rss_per_held_byte']:.2f}" for r in runs))
    return all(ok for *_, ok in rows) and rss_ok and gap_ok and packed_ok


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--trajectories", type=int, default=512)
    parser.add_argument("--tokens", type=int, default=32_768)
    parser.add_argument("--quick", action="store_true", help="1 repeat, 128 trajectories of 32,768 tokens")
    parser.add_argument("--json", type=Path, help="write every figure to this file")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="a configuration override for both servers, e.g. server.allocator_retain_bytes=0")
    parser.add_argument("--concurrent", action="store_true",
                        help=f"the many-writers run: {WRITERS} worker processes and {RANKS} ranks, ours against a relay")
    parser.add_argument("--step-seconds", type=float, default=0.0,
                        help="--concurrent: each rank's training step (a sleep) between batches")
    parser.add_argument("--groups-per-writer", type=int, default=DP_GROUPS_PER_WRITER)
    parser.add_argument("--warmup", type=int, default=1, metavar="PAIRS",
                        help="--concurrent: unmeasured runs of each server before the repeats (the first run is "
                             "often slower, whichever server it meets)")
    parser.add_argument("--floor-event-loop", choices=("asyncio", "uvloop"), default="asyncio",
                        help="the empty-handler server's (and the relay's) event loop: asyncio's (a plain grpc.aio "
                             "server) or uvloop, the loop our server runs on when uvloop is installed")
    parser.add_argument("--relay-split", choices=RELAY_SPLITS, default=RELAY_SPLITS[0],
                        help="--concurrent: how the relay hands ranks their groups: each its share of one global "
                             "mini-batch (as batches(rank=, world_size=) promises and our server does), or the next "
                             "groups as they arrived, whatever rank asks")
    args = parser.parse_args(argv)
    EXTRA_OVERRIDES[:] = args.set
    os.environ[FLOOR_LOOP_ENV] = args.floor_event_loop  # read by the floor's and the relay's subprocesses
    print(f"the floor's and the relay's event loop: {args.floor_event_loop} (--floor-event-loop)")
    if args.concurrent:
        os.environ[FLOOR_PASSTHROUGH_ENV] = "1"
        os.environ[RELAY_SPLIT_ENV] = args.relay_split  # read by the relay's subprocess
        print(f"the relay's split: {args.relay_split} (--relay-split)")
        return concurrent_main(args.repeats, args.step_seconds, args.groups_per_writer, args.json, args.warmup)
    if args.quick:
        args.repeats, args.trajectories = 1, 2 * MINI_BATCH
    if args.trajectories % MINI_BATCH:
        parser.error(f"--trajectories must be a multiple of {MINI_BATCH}")
    print(f"payload_path: {args.trajectories} trajectories x {args.tokens} tokens, groups of {GROUP_SIZE}, "
          f"mini-batches of {MINI_BATCH}; python {platform.python_version()}, {os.cpu_count()} cores")
    print("command: python bench/payload_path.py " + " ".join(argv if argv is not None else sys.argv[1:]))
    arrays = make_arrays(args.trajectories, args.tokens)
    os.environ[FLOOR_PASSTHROUGH_ENV] = "1"  # the empty-handler server parses Submit as ours does
    busy0 = machine_busy_ticks()
    runs = []
    with tempfile.TemporaryDirectory(prefix="payload-path-") as tmp:
        for repeat in range(args.repeats):
            runs.append(one_repeat(repeat, arrays, Path(tmp)))
            print(f"  repeat {repeat + 1}/{args.repeats} done", flush=True)
    busy1 = machine_busy_ticks()
    busy = 100 * (busy1[0] - busy0[0]) / max(1, busy1[1] - busy0[1])
    ok = report(runs, busy)
    if args.json:
        args.json.write_text(json.dumps({"runs": runs, "busy_percent": busy}, indent=2))
    return 0 if ok else 1


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--serve-relay":
        sys.exit(run_on_floor_loop(serve_relay, Path(sys.argv[2]), sys.argv[3:]))
    sys.exit(main())
