"""What the observability interceptor adds to each RPC, in microseconds of CPU, measured in one process.

For one unary call the interceptor counts the start, reads the clock, and at the end counts the status code,
observes the handling time and (with server.log_rpcs and level INFO) writes one log line. This bench runs
exactly that bookkeeping (`_MethodObserver.begin` / `end`) on a Submit request, with the log line off, in
text and in JSON (written to /dev/null), best of 7 repeats:

    python bench/observability_overhead.py            # about 10 seconds
    python bench/observability_overhead.py --calls 2000   # quicker, noisier

Compare the figures with the server CPU of a call in `bench/rpc_throughput.py` (srv ms/call).
"""
from __future__ import annotations

import argparse
import logging
import os
import timeit

from prometheus_client import CollectorRegistry

from coda_client._proto import pacer_pb2 as pb
from coda_server.observability import TEXT_FORMAT, GrpcServerMetrics, JsonFormatter, _MethodObserver


class FakeContext:
    """The two ServicerContext methods the observer calls."""

    def code(self):
        return None

    def peer(self) -> str:
        return "ipv4:127.0.0.1:40000"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--calls", type=int, default=20_000, help="calls per repeat (default 20000)")
    args = parser.parse_args()

    observer = _MethodObserver(GrpcServerMetrics(CollectorRegistry()), "unary", "/coda.pacer.v1.RolloutPacer/Submit")
    request = pb.SubmitRequest(request_id="5f0c7a4e-1111-2222-3333-444455556666")
    context = FakeContext()

    def one_call() -> None:
        observer.end(observer.begin(context), context, request, None)

    root = logging.getLogger()
    handler = logging.StreamHandler(open(os.devnull, "w"))
    root.handlers[:] = [handler]
    print(f"{'bookkeeping per RPC':<36} {'us/call':>8}")
    for label, level, formatter in (("metrics only (log line off)", "WARNING", None),
                                    ("metrics + text log line", "INFO", logging.Formatter(TEXT_FORMAT)),
                                    ("metrics + JSON log line", "INFO", JsonFormatter())):
        root.setLevel(level)
        if formatter is not None:
            handler.setFormatter(formatter)
        best = min(timeit.repeat(one_call, number=args.calls, repeat=7)) / args.calls
        print(f"{label:<36} {best * 1e6:8.1f}")


if __name__ == "__main__":
    main()
