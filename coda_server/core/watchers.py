"""Fan-out of control events to watch streams: a bounded queue per watcher; one that falls behind is dropped and counted."""
from __future__ import annotations

import asyncio
import collections
import logging
import time
from typing import Callable, Optional

from .errors import ResourceExhaustedError
from .types import ControlEvent, ControlEventType

log = logging.getLogger("coda_server.watchers")

# Events a watcher may fall behind before it is dropped (server.watch_queue_events).
DEFAULT_QUEUE_LIMIT = 1024
# Dropped watchers are logged at most this often (with a count), so a swarm of stuck clients cannot flood the log.
DROP_LOG_INTERVAL_SECONDS = 60.0
# A dropped watcher's client is told to come back after this long (it then gets the current state first).
DROPPED_RETRY_AFTER_SECONDS = 1.0


class Watcher:
    """One watch stream: the current state first, then every control event until SHUTDOWN.

    Iterated by the task that serves the stream. When that stream falls `limit` events behind (its client
    stopped reading, so the task is stuck handing an event over), the fan-out drops it: `dropped` turns
    true and the task is cancelled wherever it waits, so the stream ends instead of holding its place and
    memory for ever; `too_slow()` is the error to end it with.
    """

    __slots__ = ("_fanout", "_events", "_waiter", "_task", "_ended", "dropped")

    def __init__(self, fanout: "WatcherFanout", first: ControlEvent, closed: bool):
        self._fanout = fanout
        self._events: collections.deque[ControlEvent] = collections.deque([first])
        if closed:
            self._events.append(ControlEvent(ControlEventType.SHUTDOWN))
        self._waiter: Optional[asyncio.Future] = None
        self._task = asyncio.current_task()
        self._ended = False
        self.dropped = False

    def put(self, event: ControlEvent) -> None:
        self._events.append(event)
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def __aiter__(self) -> "Watcher":
        return self

    async def __anext__(self) -> ControlEvent:
        if self.dropped:
            raise self.too_slow()
        if self._ended:
            raise StopAsyncIteration
        events = self._events
        while not events:
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
            if self.dropped:
                raise self.too_slow()
        event = events.popleft()
        if event.type == ControlEventType.SHUTDOWN:
            self._ended = True
        return event

    @property
    def behind(self) -> int:
        """Events published to this watcher and not yet taken."""
        return len(self._events)

    def too_slow(self) -> ResourceExhaustedError:
        limit = self._fanout.limit
        return ResourceExhaustedError(
            f"this watch stream fell {limit} control events behind (server.watch_queue_events = {limit}): the "
            f"client stopped reading it. Watch again (the first event is the current state) and read every event",
            retry_after=DROPPED_RETRY_AFTER_SECONDS, reason="WATCHER_TOO_SLOW",
            metadata={"limit": "server.watch_queue_events", "value": str(limit)})

    def close(self) -> None:
        """The stream ended: no more events for it."""
        self._fanout.discard(self)


class WatcherFanout:
    """Every open watcher; `publish` hands each event to all of them, dropping those `limit` events behind.

    Publishing costs the same whatever the watchers do: a watcher whose client does not read only grows its
    own queue, up to `limit`, and never delays the others.
    """

    def __init__(self, limit: int = DEFAULT_QUEUE_LIMIT, clock: Callable[[], float] = time.monotonic):
        if limit < 1:
            raise ValueError(f"the watch queue limit must be >= 1, not {limit}")
        self.limit = limit
        self._clock = clock
        self._watchers: set[Watcher] = set()
        self.dropped = 0  # watchers dropped for falling behind, since start
        self._dropped_since_log = 0
        self._last_log = float("-inf")

    def open(self, first: ControlEvent, closed: bool) -> Watcher:
        """A new watcher for the calling task (call it from that task), starting with `first`."""
        watcher = Watcher(self, first, closed)
        if not closed:
            self._watchers.add(watcher)
        return watcher

    def discard(self, watcher: Watcher) -> None:
        self._watchers.discard(watcher)

    def __len__(self) -> int:
        return len(self._watchers)

    def publish(self, event: ControlEvent) -> None:
        limit = self.limit
        lagging = []
        for watcher in self._watchers:
            if len(watcher._events) >= limit:
                lagging.append(watcher)
            else:
                watcher.put(event)
        for watcher in lagging:
            self._drop(watcher)

    def _drop(self, watcher: Watcher) -> None:
        self._watchers.discard(watcher)
        watcher.dropped = True
        self.dropped += 1
        # It is behind, so its task is not waiting for events: it is stuck handing one over (or about to
        # run). Cancelled, it ends the stream with too_slow() instead of waiting for a reader for ever.
        if watcher._task is not None:
            watcher._task.cancel()
        self._dropped_since_log += 1
        now = self._clock()
        if now - self._last_log >= DROP_LOG_INTERVAL_SECONDS:
            log.warning("dropped %d watch stream(s) that fell %d control events behind since the last report "
                        "(their clients stopped reading); %d dropped since start", self._dropped_since_log,
                        self.limit, self.dropped)
            self._last_log, self._dropped_since_log = now, 0
