"""Machine instructions a live server spends per small call, ours against the empty-handler floor, counted by valgrind.

`rpc_throughput.py` times both servers under load, and on a shared 2-core machine its figures move by 0.1 or
more between runs (the clients, and anything else running, share the server's cores). `handler_instructions.py`
counts exactly, but only our handler chain in process: not what gRPC does per call, nor the access log's lines,
the peer's address or the metadata read from a real call. This script counts the whole server process (every
thread: the event loop, gRPC's own threads, the access log's writes) under `valgrind --tool=callgrind`:

* each server (rpc_throughput.py's floor, then ours on rpc_throughput's configuration, access log on as shipped)
  starts under callgrind with counting off;
* a client in this process makes `--warmup` calls (`--inflight` at once), then counting is turned on
  (`callgrind_control -i on`), `--calls` calls are made, counting is turned off and the counts dumped;
* the figure is the instructions counted divided by `--calls`; `ratio` = floor / ours, the calls/s ratio the two
  would show on a core of their own at equal instructions per cycle (what rpc_throughput's cpu ratio estimates).

Two runs of the same code agree to within about 0.5%. Under valgrind a call takes about 50 times longer, so
what is done once per batch of calls (the access log's write, every 50 ms) weighs more here than at full speed.

    python bench/live_instructions.py                          # peek and GetState, about 4 minutes
    python bench/live_instructions.py --scenarios dispatch --calls 2000
    python bench/live_instructions.py --server-arg server.log_rpcs=false
    python bench/live_instructions.py --scenarios peek --keep /tmp/live   # then callgrind_annotate /tmp/live/*/*.callgrind*

Needs valgrind (`apt install valgrind`, which brings `callgrind_control`).
"""
from __future__ import annotations

import argparse
import asyncio
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Optional

BENCH_DIR = Path(__file__).resolve().parent
sys.path[:0] = [str(BENCH_DIR.parent), str(BENCH_DIR)]  # this tree's code, whatever is installed

import grpc  # noqa: E402

import rpc_throughput  # noqa: E402
from coda_client._proto import pacer_pb2 as pb  # noqa: E402

# A server under valgrind starts about 50 times slower than without.
START_TIMEOUT_SECONDS = 600.0
CALL_TIMEOUT_SECONDS = 600.0
TARGETS = {"peek": 0.9, "dispatch": 0.9, "getstate": 0.8}  # issue 29, as rpc_throughput's scenarios
TITLES = {"peek": "Dispatch, no candidates (peek)", "dispatch": "Dispatch, {candidates} candidates, all admitted",
          "getstate": "GetState"}


class CountedServer(rpc_throughput.ServerProcess):
    """A floor or our server (rpc_throughput.py's commands) under callgrind, counting only when told to."""

    start_timeout = START_TIMEOUT_SECONDS
    stop_timeout = 120.0  # callgrind writes its last dump at exit

    def __init__(self, name: str, workdir: Path, overrides: list[str]):
        super().__init__(name, workdir, None, overrides)
        self.out_file = workdir / f"{name}.callgrind"
        self.env = {**os.environ, "PYTHONHASHSEED": "0"}  # the same dict layouts as the other server's run
        self.env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(BENCH_DIR.parent), self.env.get("PYTHONPATH")]))

    def command(self) -> list[str]:
        return ["valgrind", "--tool=callgrind", "--instr-atstart=no", f"--callgrind-out-file={self.out_file}",
                *super().command()]

    def start(self) -> "CountedServer":
        super().start()
        self.wait_ready()
        return self

    def counting(self, on: bool) -> None:
        subprocess.run(["callgrind_control", "-i", "on" if on else "off", str(self.process.pid)], check=True,
                       capture_output=True)

    def dump(self) -> None:
        """Write out what was counted so far (read by `counted` once the server has stopped)."""
        subprocess.run(["callgrind_control", "-d", str(self.process.pid)], check=True, capture_output=True)

    def counted(self) -> int:
        """Instructions counted while counting was on, from every dump (the dumps and the one at exit)."""
        total = 0
        for part in self.out_file.parent.glob(self.out_file.name + "*"):
            # A part's figure is on its `totals:` line (its `summary:` line may read 0).
            found = re.findall(r"^(?:summary|totals): (\d+)", part.read_text(errors="replace"), re.MULTILINE)
            total += max(map(int, found), default=0)
        return total


async def make_calls(address: str, scenario: str, calls: int, inflight: int, candidates: int, tag: str) -> None:
    """`calls` calls of `scenario`, `inflight` at once, each answer checked as rpc_throughput.py checks it."""
    async with grpc.aio.insecure_channel(address) as channel:
        await asyncio.wait_for(channel.channel_ready(), START_TIMEOUT_SECONDS)
        dispatch = channel.unary_unary(rpc_throughput.SERVICE + "Dispatch", request_serializer=None,
                                       response_deserializer=pb.DispatchResponse.FromString)
        get_state = channel.unary_unary(rpc_throughput.SERVICE + "GetState", request_serializer=None,
                                        response_deserializer=pb.GetStateResponse.FromString)
        state_request = pb.GetStateRequest().SerializeToString()
        left = [calls]
        checked = not tag.startswith("floor")

        async def slot(index: int) -> None:
            made = 0
            while left[0] > 0:
                left[0] -= 1
                made += 1
                name = f"{tag}-{index}-{made}"
                if scenario == "getstate":
                    answer = await get_state(state_request, timeout=CALL_TIMEOUT_SECONDS)
                    assert not checked or answer.strategy, "GetState answered without the strategy's name"
                else:
                    ids = [f"p{name}-{j}" for j in range(candidates if scenario == "dispatch" else 0)]
                    answer = await dispatch(rpc_throughput.dispatch_request(ids, name), timeout=CALL_TIMEOUT_SECONDS)
                    assert not checked or len(answer.admitted) == len(ids), f"admitted {len(answer.admitted)} of {ids}"

        await asyncio.gather(*(slot(i) for i in range(inflight)))


def count(name: str, scenario: str, args: argparse.Namespace, workdir: Path, overrides: list[str]) -> float:
    """Instructions per call of one server for one scenario (a fresh server each time)."""
    server = CountedServer(name, workdir, overrides).start()
    try:
        asyncio.run(make_calls(server.address, scenario, args.warmup, args.inflight, args.candidates, f"{name}w"))
        server.counting(True)
        asyncio.run(make_calls(server.address, scenario, args.calls, args.inflight, args.candidates, name))
        server.counting(False)
        server.dump()
    finally:
        server.stop()
    return server.counted() / args.calls


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scenarios", default="peek,getstate", help="comma-separated, from peek, dispatch, getstate")
    parser.add_argument("--calls", type=int, default=3000, help="counted calls per server and scenario")
    parser.add_argument("--warmup", type=int, default=500, help="uncounted calls first")
    parser.add_argument("--inflight", type=int, default=64, help="calls in flight at once")
    parser.add_argument("--candidates", type=int, default=4, help="candidates per Dispatch of the dispatch scenario")
    parser.add_argument("--server-arg", action="append", default=[], metavar="KEY=VALUE",
                        help="an override for our server (repeatable), as rpc_throughput.py --server-arg")
    parser.add_argument("--keep", type=Path, default=None, metavar="DIR",
                        help="keep the callgrind out files in DIR (for callgrind_annotate) instead of a temporary one")
    parser.add_argument("--floor-generic", action="store_true",
                        help="the floor registers no method by name either, as our server (rpc_throughput.py's option)")
    args = parser.parse_args(argv)
    scenarios = [s.strip() for s in args.scenarios.split(",") if s.strip()]
    unknown = [s for s in scenarios if s not in TARGETS]
    if unknown:
        parser.error(f"unknown scenarios {unknown}; choose from {', '.join(TARGETS)}")
    missing = [tool for tool in ("valgrind", "callgrind_control") if shutil.which(tool) is None]
    if missing:
        print(f"{' and '.join(missing)} not found (apt install valgrind)", file=sys.stderr)
        return 2
    overrides = rpc_throughput.OUR_OVERRIDES + args.server_arg
    if args.floor_generic:
        os.environ[rpc_throughput.FLOOR_GENERIC_ENV] = "1"  # read by the floor's process only
    print(f"instructions per call of the whole server process (callgrind), {args.calls} calls after {args.warmup}, "
          f"{args.inflight} in flight; our server: {' '.join(overrides)}")
    if args.floor_generic:
        print("floor: no method registered by name, served by generic handlers as our server's are (--floor-generic)")
    print(f"{'scenario':<40} {'floor':>9} {'ours':>9} {'ratio':>6} {'target':>6}")
    ok = True
    with tempfile.TemporaryDirectory(prefix="coda-live-instructions-") as scratch:
        tmp = scratch
        if args.keep is not None:
            args.keep.mkdir(parents=True, exist_ok=True)
            tmp = str(args.keep)
        for scenario in scenarios:
            figures = {}
            for name in ("floor", "ours"):
                workdir = Path(tmp) / f"{scenario}-{name}"
                workdir.mkdir()
                figures[name] = count(name, scenario, args, workdir, overrides)
            ratio = figures["floor"] / figures["ours"]
            ok = ok and ratio >= TARGETS[scenario]
            print(f"{TITLES[scenario].format(candidates=args.candidates):<40} {figures['floor']:>9,.0f} "
                  f"{figures['ours']:>9,.0f} {ratio:>6.2f} {'>=' + format(TARGETS[scenario], '.1f'):>6}", flush=True)
    print("ratio = floor / ours instructions per call: the calls/s ratio on a core of the server's own at equal IPC.")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
