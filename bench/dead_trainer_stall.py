"""How long a dead trainer keeps its batches from a trainer restarted at once, with the shipped defaults.

A server on the built-in configuration (its own state directory under tmp), three mini-batches of groups buffered,
a trainer in a process of its own that takes one batch with `batches()` (the prefetch leases the second) and
"trains" on it, kill -9 of that trainer; the figure is the time from the kill until its two leased batches are
back in the buffer (GetState's `leased` 0, read every 0.1 s). Until then a trainer restarted at once is handed the
third batch first. The restarted trainer's first batch is then checked to be the dead one's.

    python bench/dead_trainer_stall.py              # about the liveness grace (20 s) on today's defaults
    python bench/dead_trainer_stall.py --cap 700    # bound the wait (code before trainer liveness: the 600 s lease)
    python bench/dead_trainer_stall.py --client-id trainer   # a fixed client id, the restart started at once

With `--client-id`, the trainer has a client id of its own choosing and its restart, under the same id, starts right
after the kill (as a pod restarted by its orchestrator does) and heartbeats while it waits: the figure is the time
from the kill until the dead one's batches are back in the buffer (GetState's `redelivered`; the restart holds the
third batch meanwhile), and the restart's next two batches are checked to be the dead one's, in order.
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
from typing import Callable, Optional

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from checkpoint_cost import fill, start_server  # noqa: E402
from coda_client import PacerClient  # noqa: E402

BATCHES = 3

TRAINER = textwrap.dedent("""
    import sys, time
    from coda_client import PacerClient
    pacer = PacerClient(sys.argv[1], client_id=sys.argv[3] if len(sys.argv) > 3 else None)
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
    parser.add_argument("--client-id", help="the trainer's fixed client id, its restart's too, started at once")
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
                named = [args.client_id] if args.client_id else []
                trainer = subprocess.Popen([sys.executable, "-c", TRAINER, address, str(state.mini_batch_size), *named],
                                           stdout=subprocess.PIPE, text=True, env=env)
                first = trainer.stdout.readline().strip().split(",")
                if first == [""]:
                    print(f"the trainer ended before taking its batch (exit status {trainer.wait()})")
                    return 1
                trainer.kill()
                trainer.wait()
                killed = time.monotonic()
                if args.client_id:
                    return restarted_at_once(address, args.client_id, state.mini_batch_size, per_batch, first, killed,
                                             args.cap)
                back = seconds_until(lambda: client.state().leased == 0, killed, args.cap)
                server_line = described(client)
                if back is not None:
                    with client.batches(state.mini_batch_size, num_batches=1) as restarted:
                        again = [g.prompt_id for g in next(restarted).groups]
                    order = "its first batch" if again == first else f"another batch first ({again[0]}...)"
            print(f"a dead trainer (kill -9, 2 leased batches of {per_batch} groups) kept them for "
                  f"{shown(back, args.cap)}")
            if back is not None:
                print(f"the trainer restarted after that trained {order}")
            print(server_line)
        finally:
            if trainer is not None:
                trainer.kill()
            server.kill()
            server.wait()
    return 0


def restarted_at_once(address: str, client_id: str, mini_batch_size: int, per_batch: int, first: list[str],
                      killed: float, cap: float) -> int:
    """The restart under the dead trainer's client id, started at once: seconds until the dead one's two batches are
    back (the restart heartbeating meanwhile, holding the third batch), then the order it trains them in."""
    with PacerClient(address, client_id=client_id, timeout=30) as client:
        restarted = client.batches(mini_batch_size)
        try:
            back = seconds_until(lambda: client.state().redelivered >= 2 * per_batch, killed, cap)
            print(f"a dead trainer (kill -9, 2 leased batches of {per_batch} groups, client id {client_id!r}, "
                  f"restarted at once under it) kept them for {shown(back, cap)}")
            if back is not None:
                order = [[g.prompt_id for g in next(restarted).groups] for _ in range(3)]
                print("the restart trained the third batch it held, then "
                      + ("the dead one's first batch and its second" if order[1] == first else
                         f"another batch ({order[1][0]}...) where the dead one's first was due"))
            print(described(client))
        finally:
            restarted.close()
    return 0


def seconds_until(condition: Callable[[], bool], since: float, cap: float) -> Optional[float]:
    """Seconds from `since` until `condition()` held (read every 0.1 s), or None when `cap` seconds passed first."""
    while time.monotonic() - since < cap:
        if condition():
            return time.monotonic() - since
        time.sleep(0.1)
    return None


def shown(back: Optional[float], cap: float) -> str:
    return f"{back:.1f} s" if back is not None else f"more than {cap:.0f} s (gave up)"


def described(client: PacerClient) -> str:
    """The report's last line: the server's liveness grace and the code measured."""
    try:  # the heartbeat alone answers the grace; a server older than it refuses an empty KeepAlive
        liveness = f"{client.keep_alive([]).liveness_seconds:g} s"
    except Exception:  # noqa: BLE001
        liveness = "none (older server)"
    return f"server: built-in defaults (liveness grace {liveness}); code at {REPO_ROOT}"


if __name__ == "__main__":
    sys.exit(main())
