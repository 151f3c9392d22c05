"""How long a dead trainer keeps its batches from a trainer restarted at once, with the shipped defaults.

A server on the built-in configuration (its own state directory under tmp), three mini-batches of groups buffered,
a trainer in a process of its own that takes one batch with `batches()` (the prefetch leases the second) and
"trains" on it, kill -9 of that trainer; the figure is the time from the kill until its two leased batches are
back in the buffer (GetState's `leased` 0, read every 0.1 s). Until then a trainer restarted at once is handed the
third batch first. The restarted trainer's first batch is then checked to be the dead one's.

    python bench/dead_trainer_stall.py              # about the liveness grace (20 s) on today's defaults
    python bench/dead_trainer_stall.py --cap 700    # bound the wait (code before trainer liveness: the 600 s lease)
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from checkpoint_cost import fill, start_server  # noqa: E402
from coda_client import PacerClient  # noqa: E402

BATCHES = 3

TRAINER = textwrap.dedent("""
    import sys, time
    from coda_client import PacerClient
    pacer = PacerClient(sys.argv[1])
    batches = pacer.batches(int(sys.argv[2]))  # the server's mini_batch_size, the default lease (600 s)
    batch = next(batches)
    while pacer.state().leased < 2 * len(batch.groups):  # the prefetch has leased the second batch
        time.sleep(0.01)
    print(",".join(g.prompt_id for g in batch.groups), flush=True)
    time.sleep(3600)  # "training": killed here
""")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cap", type=float, default=900.0, help="give up after this many seconds")
    args = parser.parse_args()
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    with tempfile.TemporaryDirectory() as tmp:
        # The built-in configuration but for the listeners, and its state directory under tmp.
        server, address = start_server(Path(tmp), [f"server.state_dir={Path(tmp) / 'state'}", "server.log_rpcs=false"])
        trainer = None
        try:
            with PacerClient(address, timeout=30) as client:
                state = client.state()
                group_size = state.group_sizes[0] if state.group_sizes else 1
                per_batch = state.mini_batch_size // group_size
                fill(client, BATCHES * per_batch, group_size, tokens=16)
                trainer = subprocess.Popen([sys.executable, "-c", TRAINER, address, str(state.mini_batch_size)],
                                           stdout=subprocess.PIPE, text=True, env=env)
                first = trainer.stdout.readline().strip().split(",")
                if first == [""]:
                    print(f"the trainer ended before taking its batch (exit status {trainer.wait()})")
                    return 1
                trainer.kill()
                trainer.wait()
                killed = time.monotonic()
                back = None
                while time.monotonic() - killed < args.cap:
                    if client.state().leased == 0:
                        back = time.monotonic() - killed
                        break
                    time.sleep(0.1)
                try:  # the heartbeat alone answers the grace; a server older than it refuses an empty KeepAlive
                    liveness = f"{client.keep_alive([]).liveness_seconds:g} s"
                except Exception:  # noqa: BLE001
                    liveness = "none (older server)"
                if back is not None:
                    with client.batches(state.mini_batch_size, num_batches=1) as restarted:
                        again = [g.prompt_id for g in next(restarted).groups]
                    order = "its first batch" if again == first else f"another batch first ({again[0]}...)"
            shown = f"{back:.1f} s" if back is not None else f"more than {args.cap:.0f} s (gave up)"
            print(f"a dead trainer (kill -9, 2 leased batches of {per_batch} groups) kept them for {shown}")
            if back is not None:
                print(f"the trainer restarted after that trained {order}")
            print(f"server: built-in defaults (liveness grace {liveness}); code at {REPO_ROOT}")
        finally:
            if trainer is not None:
                trainer.kill()
            server.kill()
            server.wait()
    return 0


if __name__ == "__main__":
    sys.exit(main())
