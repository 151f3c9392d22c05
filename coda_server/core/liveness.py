"""Client liveness: which watched clients (workers with a control stream, trainers holding leases) went silent.

A worker that opens WatchControl with a client id is watched, and so is a trainer once it holds a Collect lease
that asked to end with its silence (release_when_silent): from then on every call it makes (a KeepAlive
heartbeat, a Dispatch, a Submit, a Collect, an Ack, another stream) says it is alive. Silent for `grace` seconds
(killed, stopped, cut off by the network: an open stream alone proves nothing, a stopped process keeps its
socket), it is taken as gone and the Pacer releases its incomplete running groups the way an expired in-flight
lease does, and its Collect leases the way a Release does (a trainer heard again naming those leases gets back the
ones whose groups still all wait: Workers.heard_from). Callers that never opened a stream (raw clients) are
not watched: their leases are their bound.
"""
from __future__ import annotations

from typing import Iterable


class Liveness:
    """When each watched client was last heard from; `silent(now)` takes those quiet for `grace` seconds."""

    def __init__(self, grace_seconds: float):
        self.grace = grace_seconds  # 0: off (only leases bound running groups)
        self._last_heard: dict[str, float] = {}
        self._streams: dict[str, int] = {}  # open control streams per client id
        # client id -> (the weight version its engine reports loaded, when it said so) for ListWorkers; not
        # journaled: every worker says it again on its next Dispatch or KeepAlive
        self._loaded: dict[str, tuple[int, float]] = {}

    def stream_opened(self, client_id: str, now: float) -> None:
        if not client_id or not self.grace:
            return
        self._streams[client_id] = self._streams.get(client_id, 0) + 1
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
        if client_id and (client_id in self._last_heard or client_id in self._streams):
            self._last_heard[client_id] = now

    def watched(self, client_id: str) -> bool:
        return bool(client_id) and client_id in self._last_heard

    def silent(self, now: float) -> list[str]:
        """The watched clients not heard from for `grace` seconds; they are no longer watched."""
        if not self.grace or not self._last_heard:
            return []
        cutoff = now - self.grace
        gone = [client_id for client_id, heard in list(self._last_heard.items()) if heard <= cutoff]
        for client_id in gone:
            del self._last_heard[client_id]
            self._loaded.pop(client_id, None)  # a gone worker's engine runs no version
        return gone

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
        if self.grace:
            for client_id in client_ids:
                if client_id:
                    self._last_heard[client_id] = now

    def restart_clocks(self, now: float) -> None:
        """After a restart every watched client gets the grace from `now`: a worker that does not come back
        within it loses its running groups (the lease it had is not granted again in full)."""
        for client_id in self._last_heard:
            self._last_heard[client_id] = now
