"""How long one dead worker stalls a step with the shipped defaults (issue 25).

A server on the built-in configuration (its own state directory under tmp), three RolloutWorkers in processes
of their own (two groups each) whose engine takes an hour per response, kill -9 of one of them; the figure is
the time from the kill until the dead worker's two groups are released (GetState's `expired`, read every
0.1 s): until then a trainer's step boundary, Reset(WAIT) with no wait given, waits for them (bounded by
server.max_wait_seconds, 600 s).

    python bench/dead_worker_stall.py              # about the liveness grace (20 s) on today's defaults
    python bench/dead_worker_stall.py --cap 700    # bound the wait (code without worker liveness: 1800 s)
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from coda_client import PacerClient  # noqa: E402

WORKERS = 3


class NeverEngine:
    """An AsyncEngine whose responses take an hour (aborts end them at once)."""

    def __init__(self) -> None:
        self._events: dict[str, asyncio.Event] = {}

    async def generate(self, request):
        from coda_worker.engines.base import FinishReason, Generation

        event = self._events.setdefault(request.request_id, asyncio.Event())
        try:
            await asyncio.wait_for(event.wait(), 3600)
        except asyncio.TimeoutError:
            pass
        return Generation([], [], FinishReason.ABORT)

    async def abort(self, request_ids) -> None:
        for request_id in request_ids:
            self._events.setdefault(request_id, asyncio.Event()).set()


def run_worker(address: str, worker_id: str) -> None:
    from coda_worker import ListPromptSource, Prompt, RolloutWorker

    source = ListPromptSource(Prompt(f"{worker_id}-p{i}", [1, 2, 3]) for i in range(64))
    RolloutWorker(address, NeverEngine(), source, worker_id=worker_id, max_groups=2).run()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cap", type=float, default=900.0, help="give up after this many seconds")
    parser.add_argument("--worker", nargs=2, metavar=("ADDRESS", "ID"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        run_worker(*args.worker)
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        port_file = Path(tmp) / "port.json"
        # The built-in configuration but for the listeners, and its state directory under tmp (the default,
        # ./coda-state, would land in the working directory).
        server = subprocess.Popen([sys.executable, "-m", "coda_server", "--port-file", str(port_file),
                                   "server.address=127.0.0.1:0", "server.metrics_address=",
                                   f"server.state_dir={Path(tmp) / 'state'}", "server.log_rpcs=false"],
                                  cwd=REPO_ROOT, stdout=open(Path(tmp) / "server.log", "wb"), stderr=subprocess.STDOUT,
                                  env={**os.environ, "PYTHONPATH": str(REPO_ROOT)})
        workers = []
        try:
            while not port_file.exists():
                if server.poll() is not None:
                    print((Path(tmp) / "server.log").read_text())
                    return 1
                time.sleep(0.05)
            address = json.loads(port_file.read_text())["address"]
            workers = [subprocess.Popen([sys.executable, __file__, "--worker", address, f"w{i}"],
                                        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                        env={**os.environ, "PYTHONPATH": str(REPO_ROOT)}) for i in range(WORKERS)]
            with PacerClient(address, timeout=30) as client:
                deadline = time.monotonic() + 60
                while client.state().running < 2 * WORKERS:
                    if time.monotonic() > deadline:
                        print("the workers did not dispatch in 60 s")
                        return 1
                    time.sleep(0.1)
                defaults = client.state().config_summary
                workers[0].kill()
                workers[0].wait()
                killed = time.monotonic()
                released = None
                while time.monotonic() - killed < args.cap:
                    if client.state().expired >= 2:
                        released = time.monotonic() - killed
                        break
                    time.sleep(0.1)
            shown = f"{released:.1f} s" if released is not None else f"more than {args.cap:.0f} s (gave up)"
            print(f"one dead worker (kill -9, 2 running groups) held its groups, and a WAIT Reset, for {shown}")
            print(f"server: built-in defaults ({defaults.get('sliding_window', '?')}); code at {REPO_ROOT}")
        finally:
            for worker in workers:
                worker.kill()
            server.kill()
            server.wait()
    return 0


if __name__ == "__main__":
    sys.exit(main())
