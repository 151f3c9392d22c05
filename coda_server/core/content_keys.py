"""Content keys of accepted trajectories: when and in which thread their digests are made (AsyncPacer's part)."""
from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import logging
from typing import Iterable, Sequence

from .types import Trajectory, TrajectoryGroup

log = logging.getLogger("coda_server.leases")

# A Submit of at most this many encoded bytes has its content keys computed on the loop (`ContentKeys.before_submit`),
# a larger one in the keys thread (`ContentKeys.after_submit`). At 1 MiB the loop spends about 0.5 ms on them;
# bench/README.md, "Issue 29, tenth round".
KEY_ON_LOOP_MAX_BYTES = 1 << 20


class ContentKeys:
    """Makes the content keys (what duplicate detection keeps of a trajectory once it has left: a digest of its body,
    which the body caches) before anyone waits for them: as a Submit arrives (a large one once accepted), and for a
    leased Collect whose keys are not made yet, while its answer is sent; an Ack awaits its lease's."""

    def __init__(self) -> None:
        # One thread, whatever the number of Submits and leases at once: the fingerprints hold the GIL between
        # their digests of the arrays, and each thread more wanting it back makes the loop hand it over more often.
        self.thread = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="coda-content-keys")
        self._keying: dict[str, asyncio.Future] = {}  # lease id -> its keys being computed (after_collect)
        self._closed = False

    def before_submit(self, trajectories: Sequence[Trajectory]) -> bool:
        """A Submit's trajectories, before the intake: those of a Submit of up to KEY_ON_LOOP_MAX_BYTES are keyed here,
        on the loop (their digests cost less than handing them to the thread, which takes the GIL back after each
        array's digest and so makes the loop wait). A body then lets go of what the Submit's parse read of it
        (wire.EncodedTrajectory); a group the filters drop at once, and the later Collect and Ack, find the keys made.
        False for a larger Submit: `after_submit` keys it, in the thread, once accepted."""
        size = 0
        for trajectory in trajectories:
            size += trajectory.size_bytes
        if size > KEY_ON_LOOP_MAX_BYTES:
            return False
        try:
            compute(trajectories)
        except Exception as exc:  # computed again, and reported, by the Collect or Ack
            log.debug("content keys could not be computed as the Submit arrived: %s", exc)
        return True

    def after_submit(self, trajectories: Sequence[Trajectory]) -> None:
        """An accepted Submit over KEY_ON_LOOP_MAX_BYTES: keyed in the thread, whose digests (most of the work there)
        run beside the loop, without the GIL."""
        if not self._closed:
            self.thread.submit(compute, trajectories).add_done_callback(_keyed_ahead)

    def after_collect(self, lease_id: str, groups: Sequence[TrajectoryGroup]) -> None:
        """A leased Collect's groups: keys not made yet (a journal's replay, a large Submit's still in the thread) are
        computed in the thread while the answer is sent and the trainer trains: digesting a mini-batch's arrays on
        the loop would stall every other call for tens of milliseconds."""
        if lease_id in self._keying or self._closed or all_keyed(groups):
            return
        keying = asyncio.get_running_loop().run_in_executor(
            self.thread, compute, itertools.chain.from_iterable(g.trajectories for g in groups))
        self._keying[lease_id] = keying
        keying.add_done_callback(lambda done: self._keyed(lease_id, done))

    async def before_ack(self, lease_id: str) -> None:
        """Wait until the lease's keys computed in the thread are made (at once when none are)."""
        keying = self._keying.get(lease_id)
        if keying is not None:
            await asyncio.wait((keying,))

    def _keyed(self, lease_id: str, done: asyncio.Future) -> None:
        self._keying.pop(lease_id, None)
        if not done.cancelled() and done.exception() is not None:  # the Ack computes them itself, and reports
            log.warning("content keys of lease %s could not be computed ahead of its Ack: %s", lease_id,
                        done.exception())

    def close(self) -> None:
        """Keys being computed are finished; an Ack computes any others itself."""
        self._closed = True
        self.thread.shutdown(wait=False)


def compute(trajectories: Iterable[Trajectory]) -> None:
    for trajectory in trajectories:
        trajectory.prepare_content_key()


def all_keyed(groups: Sequence[TrajectoryGroup]) -> bool:
    """Every trajectory of these groups has its content key made."""
    for group in groups:
        for trajectory in group.trajectories:
            if not trajectory.content_key_ready():
                return False
    return True


def _keyed_ahead(done: concurrent.futures.Future) -> None:
    if not done.cancelled() and done.exception() is not None:  # computed again, and reported, by the Collect or Ack
        log.debug("content keys could not be computed ahead of the Collect: %s", done.exception())
