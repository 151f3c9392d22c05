"""Client liveness: which watched clients (workers with a control stream, trainers holding leases) went silent.

A worker that opens WatchControl with a client id is watched, and so is a trainer once it holds a Collect lease
that asked to end with its silence (release_when_silent): from then on every call it makes (a KeepAlive
heartbeat, a Dispatch, a Submit, a Collect, an Ack, another stream) says it is alive. Silent for `grace` seconds
(killed, stopped, cut off by the network: an open stream alone proves nothing, a stopped process keeps its
socket), it is taken as gone as a worker and the Pacer releases its incomplete running groups the way an expired
in-flight lease does; silent for `trainer_grace` seconds (server.trainer_liveness_seconds, the same by default),
as a trainer: its Collect leases go back the way a Release gives them (a trainer heard again naming those leases
gets back the ones whose groups still all wait: Workers.heard_from). Two graces, because a trainer's step may hold
the GIL, and so its heartbeats, far longer than a worker is ever quiet (serializing its weights in memory for the
engines). Callers that never opened a stream (raw clients) are not watched: their leases are their bound.
"""
from __future__ import annotations

from typing import Iterable, Optional

# How long a client id's last call is remembered for ListWorkers: a day covers any stall an operator looks at, and
# bounds the memory of ids that never come back.
SEEN_KEPT_SECONDS = 86400.0


class Liveness:
    """When each watched client was last heard from; `silent(now)` takes those quiet for a grace."""

    def __init__(self, grace_seconds: float, trainer_grace_seconds: Optional[float] = None):
        self.grace = grace_seconds  # a worker's; 0: off (only leases bound running groups)
        # a trainer's, for the leases that end with its silence; 0: off (the lease's own length bounds them)
        self.trainer_grace = grace_seconds if trainer_grace_seconds is None else trainer_grace_seconds
        self._on = bool(self.grace or self.trainer_grace)
        self._last_heard: dict[str, float] = {}
        self._streams: dict[str, int] = {}  # open control streams per client id
        # client id -> (the weight version its engine reports loaded, when it said so) for ListWorkers; not
        # journaled: every worker says it again on its next Dispatch or KeepAlive
        self._loaded: dict[str, tuple[int, float]] = {}
        # client id -> when any call or stream last came under it, watched or not, for ListWorkers (an operator
        # tells a dead worker from a slow one by it); forgotten after SEEN_KEPT_SECONDS
        self._seen: dict[str, float] = {}
        self._next_forget = 0.0  # when `silent` next drops the ids unseen for SEEN_KEPT_SECONDS

    @property
    def shortest_grace(self) -> float:
        """The shortest silence the server acts on (0: none), which a KeepAlive's answer tells callers to beat within."""
        return min((g for g in (self.grace, self.trainer_grace) if g), default=0.0)

    def stream_opened(self, client_id: str, now: float) -> None:
        if not client_id:
            return
        # Counted with liveness off too: ListWorkers and a Reset's warning say who holds a stream.
        self._streams[client_id] = self._streams.get(client_id, 0) + 1
        self._seen[client_id] = now
        if self._on:
            self._last_heard[client_id] = now

    def stream_closed(self, client_id: str) -> None:
        # The grace still runs from the last call: a closed stream is a worker that died or one reconnecting.
        count = self._streams.get(client_id, 0) - 1
        if count > 0:
            self._streams[client_id] = count
        else:
            self._streams.pop(client_id, None)

    def heard(self, client_id: str, now: float) -> None:
        """A call from `client_id`: alive (a client released as silent is watched again while it holds a stream)."""
        if not client_id:
            return
        self._seen[client_id] = now
        if self._on and (client_id in self._last_heard or client_id in self._streams):
            self._last_heard[client_id] = now

    def streams(self, client_id: str) -> int:
        """The WatchControl streams open under `client_id` now (one that never opens any never hears a PAUSE)."""
        return self._streams.get(client_id, 0)

    def contact(self, client_ids: Iterable[str], now: float) -> dict[str, tuple[Optional[float], int]]:
        """For each of these client ids: (seconds since a call or stream last came under it, None: never, or not
        for SEEN_KEPT_SECONDS), the WatchControl streams it holds open now."""
        self._forget_unseen(now)
        return {client_id: (max(0.0, now - self._seen[client_id]) if client_id in self._seen else None,
                            self._streams.get(client_id, 0)) for client_id in client_ids}

    def _forget_unseen(self, now: float) -> None:
        for client_id in [c for c, seen in self._seen.items() if now - seen > SEEN_KEPT_SECONDS]:
            del self._seen[client_id]

    def watched(self, client_id: str) -> bool:
        return bool(client_id) and client_id in self._last_heard

    def silent(self, now: float) -> tuple[set[str], set[str]]:
        """The watched clients not heard from for `grace` seconds (gone as workers) and for `trainer_grace` seconds
        (gone as trainers); one silent for both is no longer watched. Asking again before then names it again."""
        if now >= self._next_forget:  # here, as the server calls it every tick: ListWorkers may never be asked
            self._next_forget = now + SEEN_KEPT_SECONDS / 24
            self._forget_unseen(now)
        if not self._on or not self._last_heard:
            return set(), set()
        workers_cutoff = now - self.grace if self.grace else float("-inf")
        trainers_cutoff = now - self.trainer_grace if self.trainer_grace else float("-inf")
        forget_cutoff = now - max(self.grace, self.trainer_grace)
        workers, trainers = set(), set()
        for client_id, heard in list(self._last_heard.items()):
            if heard <= workers_cutoff:
                workers.add(client_id)
                self._loaded.pop(client_id, None)  # a gone worker's engine runs no version
            if heard <= trainers_cutoff:
                trainers.add(client_id)
            if heard <= forget_cutoff:
                del self._last_heard[client_id]
        return workers, trainers

    def note_loaded(self, client_id: str, weight_version: int, now: float) -> None:
        self._loaded[client_id] = (weight_version, now)

    def loaded(self, now: float, unwatched_for: float) -> dict[str, int]:
        """The weight version each worker's engine last reported loaded, by client id, while it is believable: a
        watched worker's until it is taken as gone (`silent`), another caller's for `unwatched_for` seconds after
        it last said it (0: for ever). A dead worker listed at an old version would hold back a trainer waiting
        for every engine to load the new weights."""
        cutoff = now - unwatched_for if unwatched_for else float("-inf")
        for client_id in [c for c, (_, said) in self._loaded.items() if said < cutoff and c not in self._last_heard]:
            del self._loaded[client_id]
        return {client_id: version for client_id, (version, _) in self._loaded.items()}

    def watch(self, client_ids: Iterable[str], now: float) -> None:
        """These clients hold something their silence should give back (a trainer's lease; in a replay, what a watched
        worker dispatched): watched from `now` on."""
        if self._on:
            for client_id in client_ids:
                if client_id:
                    self._last_heard[client_id] = now

    def restart_clocks(self, now: float) -> None:
        """After a restart every watched client gets the grace from `now`: a worker that does not come back
        within it loses its running groups (the lease it had is not granted again in full)."""
        for client_id in self._last_heard:
            self._last_heard[client_id] = now
