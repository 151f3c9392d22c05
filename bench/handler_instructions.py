"""Machine instructions our Dispatch and Submit handlers execute per call, counted by valgrind: noise-free, in process.

`rpc_throughput.py` measures what users see, but on a shared machine its ratios move by about 0.1 from
run to run, so a change worth a few percent of our own work cannot be told from noise there. This
script counts instead: it runs the handler chain exactly as the server registers it (observability, the
malformed-request guard, the servicer, the AsyncPacer, the Pacer, the conversions) in one process,
without gRPC, under `valgrind --tool=cachegrind`. Each figure is the difference between a run that makes
`--calls` calls and a run that only prepares them, divided by `--calls`. With PYTHONHASHSEED fixed the
figures repeat to within a few hundred instructions, so two versions of the code can be compared exactly.

Layers (each includes the ones below it):

* `full`: request bytes -> the registered handler's deserializer, the handler server.py registers
  (observability, admission, the guard, error mapping: rpc_handlers.py; the pass-through codec) and the
  servicer -> response bytes
  (logging is not configured here, so the access log stays off: observability_overhead.py measures it);
* `servicer`: `RolloutPacerServicer.Dispatch` (or `.Submit`) on a decoded request, plus serializing the response;
* `async`: `AsyncPacer.dispatch` (`.submit`) on converted candidates (trajectories), request-id answers included;
* `pacer`: `Pacer.dispatch` (`.submit`) on converted candidates (trajectories);
* `refs`: `convert.prompt_refs` alone (Dispatch only);
* `floor`: the floor's empty handler of rpc_throughput.py with the generated (de)serializers.

A Submit carries one group of 64 trajectories of 1,000 tokens (rpc_throughput.py's Submit scenario) for a
prompt dispatched beforehand (in both runs, so the dispatches cancel out); its group completes and the
`reward` filter drops it. The requests are built one by one in both runs, so building them cancels out too;
holding 1,200 of them decoded would take hundreds of MB, so for Submit every layer includes decoding the
request into its pass-through views (`full` adds the wrappers and the servicer).

    python bench/handler_instructions.py                     # Dispatch (peek, 4 candidates) and Submit (~10 min)
    python bench/handler_instructions.py --rpcs dispatch --layers full --candidates 4
    python bench/handler_instructions.py --rpcs getstate --layers full,servicer,floor
    python bench/handler_instructions.py --rpcs dispatch --candidates 0 --layers full --variant no-metrics
    python bench/handler_instructions.py --rpcs cycle --layers full,floor --calls 20   # a trainer's round (~2 min)
        # what one per-call feature costs: the `full` figure without it (or, access-log, with the access log on)
    python bench/handler_instructions.py --rpcs cycle --layers full,floor --calls 20 --group-size 16
        # a trainer's round with groups of 16, as payload_path.py --concurrent submits them

Variants (`--variant`, `full` layer): `shipped` (the default), `no-metrics` (the observer counts, times and logs
nothing), `no-client-metrics` (no per-client call counts), `no-admission`, `no-guard` (the generated parser
alone), `no-client-id` (the client id metadata not read), `access-log` (the access log on, as a server on its
defaults writes it, to /dev/null: a line noted per call, formatted and written in batches).

`cycle` counts the data path per trajectory: one call is four Submits of a group of 64 (`--group-size`) trajectories
of 1,000 tokens each (kept: the `status` filter alone), a leased CollectStream of the four groups and its Ack,
through the registered handlers (`full`), or through the handlers of `payload_path.py --concurrent`'s relay
(`floor`: the same Submit parse and answer encoding, nothing else); it prints the figure per call and per
trajectory. The relay times its waits with `asyncio.wait_for`, so its count moves with the run's timing (by up to
a fifth between runs); ours repeats exactly.

Needs valgrind (`apt install valgrind`). The counts leave out what gRPC itself does per call and say
nothing about time by themselves; rpc_throughput.py remains the measure of the issue's targets.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any, Optional

BENCH_DIR = Path(__file__).resolve().parent
REPO_ROOT = BENCH_DIR.parent
LAYERS = ("full", "servicer", "async", "pacer", "refs", "floor")
RPCS = ("dispatch", "submit", "getstate", "cycle")
RPC_LAYERS = {"getstate": ("full", "servicer", "floor"), "cycle": ("full", "floor")}  # the others: every layer
CYCLE_GROUPS = 4  # Submits (one group each) per cycle, all taken by the cycle's Collect
CYCLE_PREPARED = 10  # cycles made (and counted in both runs) before the measured ones
PREPARED_CALLS = 200  # made (and counted in both runs) before the measured calls: caches and dicts warm
VARIANTS = ("shipped", "no-metrics", "no-client-metrics", "no-admission", "no-guard", "no-client-id", "access-log")
VARIANT_ENV = "CODA_BENCH_VARIANT"


def apply_variant(variant: str) -> None:
    """Take one per-call feature out of the handlers about to be built (or put the access log in)."""
    from coda_server import admission, observability, rpc_handlers

    if variant == "no-metrics":
        observability.MethodObserver.begin = lambda self, context: (0.0, "")
        observability.MethodObserver.end = lambda self, *args, **kwargs: None
    elif variant == "no-client-metrics":
        observability.ClientCallMetrics.count = lambda self, *args: None
    elif variant == "no-admission":
        admission.Admission.admitter = lambda self, method: None
    elif variant == "no-guard":
        rpc_handlers.safe_deserializer = lambda deserializer, method: deserializer
    elif variant == "no-client-id":
        rpc_handlers.read_caller = lambda context: ("", True)
    elif variant == "access-log":
        import logging

        from coda_server.logs import configure_logging

        logging.getLogger().addHandler(logging.StreamHandler(open(os.devnull, "w")))
        configure_logging("text", "INFO")


def child(rpc: str, layer: str, candidates: int, calls: int, measure: bool) -> None:
    """Build the server's handler of `rpc`, make PREPARED_CALLS calls, then `calls` more if `measure`."""
    sys.path[:0] = [str(REPO_ROOT), str(BENCH_DIR)]  # this tree's code, whatever is installed
    import rpc_throughput
    from observability_overhead import FakeContext
    from coda_client._proto import pacer_pb2 as pb
    from coda_client._proto import pacer_pb2_grpc
    from coda_server import convert
    from coda_server.core.config import load_config
    from coda_server.method_wrapping import WrappingRegistrar
    from coda_server.rpc_handlers import RpcHandlers
    from coda_server.server import SERVICE_NAME, PacerServer, tune_garbage_collector
    from coda_server.service import RolloutPacerServicer
    from coda_server.wire import PassthroughCodec

    class Capture:
        """Stands in for the grpc server: keeps the handlers a registration hands it."""

        handlers: dict[str, Any] = {}

        def add_registered_method_handlers(self, service: str, handlers: dict[str, Any]) -> None:
            self.handlers = handlers

        def add_generic_rpc_handlers(self, generic_handlers: Any) -> None:
            pass

    apply_variant(os.environ.get(VARIANT_ENV, "shipped"))
    overrides = [*rpc_throughput.OUR_OVERRIDES, "server.metrics_address="]
    if rpc == "cycle":  # the groups are kept for the Collect: no `reward` filter dropping them (equal rewards)
        overrides = [o for o in overrides if not o.startswith("rollout.filter=")] + ["rollout.filter=[status]"]
    config = load_config(overrides=overrides)
    server = PacerServer(config)
    capture = Capture()
    if layer == "floor" and rpc == "cycle":  # payload_path.py's relay, registered as serve_relay registers it
        import payload_path

        pacer_pb2_grpc.add_RolloutPacerServicer_to_server(
            payload_path.relay_servicer(), WrappingRegistrar(capture, [PassthroughCodec(SERVICE_NAME)]))
    elif layer == "floor":
        pacer_pb2_grpc.add_RolloutPacerServicer_to_server(rpc_throughput.FloorServicer(), capture)
    else:  # the handlers server.py registers
        handlers = RpcHandlers(server.observability.rpc_observer, server.admission, PassthroughCodec(SERVICE_NAME))
        pacer_pb2_grpc.add_RolloutPacerServicer_to_server(RolloutPacerServicer(server.async_pacer),
                                                          WrappingRegistrar(capture, [handlers]))
    if rpc == "submit":
        submit_child(server, capture.handlers["Submit"], layer, calls, measure)
        return
    if rpc == "getstate":
        getstate_child(server, capture.handlers["GetState"], layer, calls, measure)
        return
    if rpc == "cycle":
        cycle_child(server, capture.handlers, layer, calls, measure)
        return
    handler = capture.handlers["Dispatch"]
    servicer = RolloutPacerServicer(server.async_pacer)
    async_pacer = server.async_pacer
    context = FakeContext()
    total = PREPARED_CALLS + calls
    wires = [rpc_throughput.dispatch_request([f"p-{i}-{j}" for j in range(candidates)], f"w-{i:08d}")
             for i in range(total)]
    requests = [pb.DispatchRequest.FromString(data) for data in wires]

    async def one(i: int) -> None:
        if layer in ("full", "floor"):
            handler.response_serializer(await handler.unary_unary(handler.request_deserializer(wires[i]), context))
        elif layer == "servicer":
            (await servicer.Dispatch(requests[i], context)).SerializeToString()
        elif layer == "async":
            await async_pacer.dispatch(convert.prompt_refs(requests[i].candidates), 0.0, requests[i].request_id)
        elif layer == "pacer":
            async_pacer.pacer.dispatch(convert.prompt_refs(requests[i].candidates), request_id=requests[i].request_id)
        else:
            convert.prompt_refs(requests[i].candidates)

    async def run() -> None:
        tune_garbage_collector()
        async_pacer.bind_loop()
        for i in range(PREPARED_CALLS):
            await one(i)
        if measure:
            for i in range(PREPARED_CALLS, total):
                await one(i)

    asyncio.run(run())
    flush_access_log(server)


def getstate_child(server: Any, handler: Any, layer: str, calls: int, measure: bool) -> None:
    """GetState calls: `full` and `floor` through the registered handler, `servicer` (and below) through the
    servicer method on a decoded request."""
    from observability_overhead import FakeContext
    from coda_client._proto import pacer_pb2 as pb
    from coda_server.server import tune_garbage_collector
    from coda_server.service import RolloutPacerServicer

    servicer = RolloutPacerServicer(server.async_pacer)
    context = FakeContext()
    wire = pb.GetStateRequest().SerializeToString()
    request = pb.GetStateRequest()

    async def one() -> None:
        if layer in ("full", "floor"):
            handler.response_serializer(await handler.unary_unary(handler.request_deserializer(wire), context))
        else:
            (await servicer.GetState(request, context)).SerializeToString()

    async def run() -> None:
        tune_garbage_collector()
        server.async_pacer.bind_loop()
        for _ in range(PREPARED_CALLS):
            await one()
        if measure:
            for _ in range(calls):
                await one()

    asyncio.run(run())
    flush_access_log(server)


def submit_child(server: Any, handler: Any, layer: str, calls: int, measure: bool) -> None:
    """Submit calls of one complete group each, for prompts dispatched first (both runs make every dispatch)."""
    import rpc_throughput
    from observability_overhead import FakeContext
    from coda_server import convert
    from coda_server.core.types import PromptRef
    from coda_server.server import tune_garbage_collector
    from coda_server.service import RolloutPacerServicer

    servicer = RolloutPacerServicer(server.async_pacer)
    async_pacer = server.async_pacer
    context = FakeContext()
    builder = rpc_throughput.SubmitBuilder(seed=1)
    total = PREPARED_CALLS + calls

    async def one(i: int, call: bool) -> None:
        wire = builder.build(f"p-{i}", f"s-{i:08d}")  # built in both runs: its cost cancels out
        if not call:
            return
        if layer in ("full", "floor"):
            handler.response_serializer(await handler.unary_unary(handler.request_deserializer(wire), context))
            return
        request = handler.request_deserializer(wire)
        if layer == "servicer":
            (await servicer.Submit(request, context)).SerializeToString()
        elif layer == "async":
            await async_pacer.submit(convert.trajectories(request.trajectories), request.request_id)
        else:
            async_pacer.pacer.submit(convert.trajectories(request.trajectories),
                                     request_id=request.request_id)

    async def run() -> None:
        tune_garbage_collector()
        async_pacer.bind_loop()
        async_pacer.pacer.dispatch([PromptRef(f"p-{i}") for i in range(total)])
        for i in range(PREPARED_CALLS):
            await one(i, True)
        for i in range(PREPARED_CALLS, total):
            await one(i, measure)
        if layer != "floor":  # the floor's empty handler accepts nothing
            made = PREPARED_CALLS + (calls if measure else 0)
            submitted = async_pacer.pacer.state().submitted
            assert submitted == made * rpc_throughput.GROUP_SIZE, f"{submitted} trajectories accepted of {made} Submits"

    asyncio.run(run())
    flush_access_log(server)


def cycle_child(server: Any, handlers: dict[str, Any], layer: str, calls: int, measure: bool) -> None:
    """Cycles of CYCLE_GROUPS Submits, a leased CollectStream of their groups and its Ack, all through the
    registered handlers (prompts dispatched first, in both runs); `floor`: payload_path.py's relay's handlers."""
    import rpc_throughput
    from observability_overhead import FakeContext
    from coda_client._proto import pacer_pb2 as pb
    from coda_server.core.types import PromptRef
    from coda_server.server import tune_garbage_collector

    submit, collect, ack = handlers["Submit"], handlers["CollectStream"], handlers["Ack"]
    context = FakeContext()
    builder = rpc_throughput.SubmitBuilder(seed=1)
    total = CYCLE_PREPARED + calls

    async def one(i: int, call: bool) -> None:
        wires = [builder.build(f"p-{i}-{g}", f"s-{i}-{g}") for g in range(CYCLE_GROUPS)]  # built in both runs
        if not call:
            return
        for wire in wires:
            submit.response_serializer(await submit.unary_unary(submit.request_deserializer(wire), context))
        # A wait the answer never needs (the groups are there): the relay waits with asyncio.wait_for, which times
        # out at once with 0.
        request = pb.CollectRequest(num_groups=CYCLE_GROUPS, lease_seconds=300, request_id=f"c-{i}", wait_seconds=10)
        lease_id = None
        async for message in collect.unary_stream(collect.request_deserializer(request.SerializeToString()), context):
            answer = collect.response_serializer(message)
            lease_id = lease_id or pb.CollectResponse.FromString(answer).lease_id
        acked = pb.AckRequest(lease_id=lease_id).SerializeToString()
        ack.response_serializer(await ack.unary_unary(ack.request_deserializer(acked), context))

    async def run() -> None:
        tune_garbage_collector()
        async_pacer = server.async_pacer
        async_pacer.bind_loop()
        async_pacer.pacer.dispatch([PromptRef(f"p-{i}-{g}") for i in range(total) for g in range(CYCLE_GROUPS)])
        for i in range(CYCLE_PREPARED):
            await one(i, True)
        for i in range(CYCLE_PREPARED, total):
            await one(i, measure)
        if layer != "floor":  # the relay keeps no count
            made = CYCLE_PREPARED + (calls if measure else 0)
            consumed = async_pacer.pacer.state().consumed
            assert consumed == made * CYCLE_GROUPS, f"{consumed} groups consumed of {made} cycles"

    asyncio.run(run())


def flush_access_log(server: Any) -> None:
    """Write the access-log lines still noted (variant access-log), so that every call's line is counted."""
    if server.observability.access_log is not None:
        server.observability.access_log.flush()


def rpc_group_size() -> int:
    """Trajectories per Submit of rpc_throughput.py's SubmitBuilder."""
    sys.path.insert(0, str(BENCH_DIR))
    import rpc_throughput

    return rpc_throughput.GROUP_SIZE


def count_instructions(rpc: str, layer: str, candidates: int, calls: int, measure: bool,
                       variant: str = "shipped") -> int:
    command = ["valgrind", "--tool=cachegrind", "--cache-sim=no", "--cachegrind-out-file=/dev/null",
               sys.executable, str(Path(__file__).resolve()), "--child", rpc, layer, str(candidates), str(calls),
               "1" if measure else "0"]
    # Same string hashes, same dict layouts: repeatable counts.
    env = {**os.environ, "PYTHONHASHSEED": "0", VARIANT_ENV: variant}
    done = subprocess.run(command, capture_output=True, text=True, env=env)
    found = re.search(r"I\s+refs:\s+([\d,]+)", done.stderr)
    if done.returncode != 0 or found is None:
        raise RuntimeError(f"valgrind run failed ({' '.join(command)}):\n{done.stderr[-2000:]}")
    return int(found.group(1).replace(",", ""))


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rpcs", default=",".join(RPCS), help=f"comma-separated, from {', '.join(RPCS)}")
    parser.add_argument("--layers", default=",".join(LAYERS), help=f"comma-separated, from {', '.join(LAYERS)}")
    parser.add_argument("--candidates", default="0,4", help="comma-separated candidate counts per Dispatch")
    parser.add_argument("--calls", type=int, default=1000, help="measured calls per figure")
    parser.add_argument("--variant", default="shipped", choices=VARIANTS,
                        help="a per-call feature taken out (or the access log put in), see above")
    parser.add_argument("--group-size", type=int, default=0,
                        help="trajectories per Submit (default rpc_throughput.py's 64; the concurrent run's are 16)")
    parser.add_argument("--child", nargs=5, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.group_size:  # read by rpc_throughput.py as it is imported, here and in each counted child
        os.environ["CODA_BENCH_GROUP_SIZE"] = str(args.group_size)
    if args.child:
        rpc, layer, candidates, calls, measure = args.child
        child(rpc, layer, int(candidates), int(calls), measure == "1")
        return 0
    rpcs = [name.strip() for name in args.rpcs.split(",") if name.strip()]
    if any(name not in RPCS for name in rpcs):
        parser.error(f"unknown rpcs {rpcs}; choose from {', '.join(RPCS)}")
    layers = [name.strip() for name in args.layers.split(",") if name.strip()]
    unknown = [name for name in layers if name not in LAYERS]
    if unknown:
        parser.error(f"unknown layers {unknown}; choose from {', '.join(LAYERS)}")
    if shutil.which("valgrind") is None:
        print("valgrind is not installed (apt install valgrind); it counts the instructions", file=sys.stderr)
        return 2
    print(f"instructions per call, {args.calls} calls after {PREPARED_CALLS} unmeasured ones ({CYCLE_PREPARED} for a "
          f"cycle) (python {sys.version.split()[0]}, PYTHONHASHSEED=0, variant {args.variant})")
    figures = [("dispatch", int(c), f"Dispatch, {int(c)} candidates") for c in args.candidates.split(",")]
    figures.append(("submit", 0, f"Submit, {rpc_group_size()} trajectories"))
    figures.append(("getstate", 0, "GetState"))
    figures.append(("cycle", 0, f"cycle of {CYCLE_GROUPS} Submits"))
    for rpc, candidates, title in figures:
        if rpc not in rpcs:
            continue
        for layer in layers:
            if layer == "refs" and (candidates == 0 or rpc == "submit"):
                continue
            if layer not in RPC_LAYERS.get(rpc, LAYERS):
                continue
            prepared = count_instructions(rpc, layer, candidates, args.calls, measure=False, variant=args.variant)
            measured = count_instructions(rpc, layer, candidates, args.calls, measure=True, variant=args.variant)
            per_call = (measured - prepared) / args.calls
            per_trajectory = (f"  ({per_call / (CYCLE_GROUPS * rpc_group_size()):,.0f} per trajectory)"
                              if rpc == "cycle" else "")
            print(f"  {title:<24} {layer:<9} {per_call:>10,.0f}{per_trajectory}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
