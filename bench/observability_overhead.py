"""What observability adds to each RPC, in microseconds of CPU, measured in one process.

For one unary call the RPC observer counts the start, reads the clock, and at the end counts the status
code, observes the handling time and (with server.log_rpcs and level INFO) notes one access-log line; the
access log formats and writes its lines in batches. This bench runs exactly that bookkeeping
(`MethodObserver.begin` / `end`, plus the batch writes, amortized) on a Submit request: with the log line
off, in text and in JSON (written to a file), and, for comparison, a line logged the ordinary way through
`logging` (one record per call), best of 7 repeats:

    python bench/observability_overhead.py            # about 10 seconds
    python bench/observability_overhead.py --calls 2000   # quicker, noisier

Compare the figures with the server CPU of a call in `bench/rpc_throughput.py` (srv ms/call).
"""
from __future__ import annotations

import argparse
import asyncio
import logging
import tempfile
import time
from typing import Optional

from prometheus_client import CollectorRegistry

from coda_client._proto import pacer_pb2 as pb
from coda_server.logs import TEXT_FORMAT, AccessLog, JsonFormatter, rpc_log
from coda_server.observability import GrpcServerMetrics, MethodObserver

REPEATS = 7


class FakeContext:
    """The ServicerContext methods a successful unary call touches in process: the observer's code() and
    peer(), time_remaining() for a long-poll's bound, invocation_metadata() for admission's client id
    (handler_instructions.py uses it too)."""

    def code(self) -> None:
        return None

    def peer(self) -> str:
        return "ipv4:127.0.0.1:40000"

    def time_remaining(self) -> Optional[float]:
        return None

    def invocation_metadata(self) -> tuple:
        return ()


async def per_call_seconds(observer: MethodObserver, access_log: AccessLog | None, calls: int) -> float:
    """Best of REPEATS: CPU seconds per call, including the access log's batch writes."""
    request = pb.SubmitRequest(request_id="5f0c7a4e-1111-2222-3333-444455556666")
    context = FakeContext()
    best = float("inf")
    for _ in range(REPEATS):
        started = time.process_time()
        for _ in range(calls):
            observer.end(observer.begin(context), context, request, None)
        if access_log is not None:
            access_log.flush()
        best = min(best, (time.process_time() - started) / calls)
    return best


def ordinary_log_line_seconds(calls: int) -> float:
    """Best of REPEATS: one `logging` record per call, as a per-RPC line costs without the access log."""
    best = float("inf")
    for _ in range(REPEATS):
        started = time.process_time()
        for _ in range(calls):
            rpc_log.info("%s peer=%s", "Submit OK 0.412ms request_id=5f0c7a4e", "ipv4:127.0.0.1:40000",
                         extra={"fields": {"event": "rpc", "method": "Submit", "code": "OK", "duration_ms": 0.412}})
        best = min(best, (time.process_time() - started) / calls)
    return best


async def main_async(calls: int) -> None:
    metrics = GrpcServerMetrics(CollectorRegistry())
    method = "/coda.pacer.v1.RolloutPacer/Submit"
    root = logging.getLogger()
    with tempfile.TemporaryFile("w") as sink:
        handler = logging.StreamHandler(sink)
        root.handlers[:] = [handler]
        print(f"{'bookkeeping per RPC':<44} {'us/call':>8}")
        root.setLevel("WARNING")
        seconds = await per_call_seconds(MethodObserver(metrics, "unary", method, None), None, calls)
        print(f"{'metrics only (log line off)':<44} {seconds * 1e6:8.1f}")
        root.setLevel("INFO")
        for label, log_format, formatter in (("metrics + text access-log line", "text", logging.Formatter(TEXT_FORMAT)),
                                             ("metrics + JSON access-log line", "json", JsonFormatter())):
            handler.setFormatter(formatter)
            access_log = AccessLog(log_format, max_pending=calls + 1)
            seconds = await per_call_seconds(MethodObserver(metrics, "unary", method, access_log), access_log, calls)
            print(f"{label:<44} {seconds * 1e6:8.1f}")
        for label, formatter in (("(one logging record per call, text)", logging.Formatter(TEXT_FORMAT)),
                                 ("(one logging record per call, JSON)", JsonFormatter())):
            handler.setFormatter(formatter)
            print(f"{label:<44} {ordinary_log_line_seconds(calls) * 1e6:8.1f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--calls", type=int, default=20_000, help="calls per repeat (default 20000)")
    args = parser.parse_args()
    asyncio.run(main_async(args.calls))


if __name__ == "__main__":
    main()
