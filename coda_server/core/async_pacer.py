"""Asyncio face of the Pacer: bounded long-polls without a thread per waiter, request-id replay, watchers."""
from __future__ import annotations

import asyncio
import dataclasses
import threading
from collections import OrderedDict
from typing import Any, AsyncIterator, Awaitable, Callable, Optional, Sequence

from .pacer import Pacer
from .types import (
    CollectResult,
    ControlEvent,
    ControlEventType,
    DispatchResult,
    PacerState,
    PromptRef,
    ResetMode,
    ResetResult,
    ResumeResult,
    SubmitResult,
    Trajectory,
)

WATCH_QUEUE_LIMIT = 1024
# Answers that carry trajectories (Collect, Reset) are large: only the most recent few are kept for replay.
DATA_REPLAY_LIMIT = 64


class RequestReplayCache:
    """Remembers the answers of recent mutating calls by request_id so a retry applies once.

    A retry that arrives while the first call still runs awaits the same result. Only successful
    answers are kept: a failed call may be retried and run again.
    """

    def __init__(self, size: int):
        self._size = size
        self._done: OrderedDict[str, Any] = OrderedDict()
        self._running: dict[str, asyncio.Future] = {}

    async def run(self, request_id: str, call: Callable[[], Awaitable[Any]]) -> Any:
        if not request_id:
            return await call()
        key = request_id
        if key in self._done:
            self._done.move_to_end(key)
            return self._done[key]
        if key in self._running:
            return await asyncio.shield(self._running[key])
        future = asyncio.get_running_loop().create_future()
        self._running[key] = future
        try:
            result = await call()
        except BaseException as exc:
            future.set_exception(exc)
            future.exception()  # mark retrieved: waiters may not exist
            raise
        finally:
            del self._running[key]
        future.set_result(result)
        self._done[key] = result
        if len(self._done) > self._size:
            self._done.popitem(last=False)
        return result


class AsyncPacer:
    """Wraps a `Pacer` for one asyncio event loop; waits are awaited conditions, each with a bound."""

    def __init__(self, pacer: Pacer, *, max_wait_seconds: float = 600.0, request_id_cache_size: int = 65536):
        self.pacer = pacer
        self.max_wait_seconds = max_wait_seconds
        self._replay = {method: RequestReplayCache(request_id_cache_size) for method in ("Dispatch", "Submit", "Resume")}
        self._replay.update({method: RequestReplayCache(min(DATA_REPLAY_LIMIT, request_id_cache_size))
                             for method in ("Collect", "Reset")})
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._loop_thread: Optional[int] = None
        self._change: Optional[asyncio.Future] = None
        self._watchers: set[asyncio.Queue] = set()
        self._draining = False
        self.waiting_calls = 0
        pacer.add_change_listener(self._on_change)
        pacer.add_control_listener(self._on_control)

    def bind_loop(self) -> None:
        """Attach to the running loop; call once from it before serving."""
        self._loop = asyncio.get_running_loop()
        self._loop_thread = threading.get_ident()

    # ------------------------------------------------------------- wake-ups

    def _on_change(self) -> None:
        self._call_in_loop(self._wake)

    def _on_control(self, event: ControlEvent) -> None:
        self._call_in_loop(lambda: self._publish(event))

    def _call_in_loop(self, fn: Callable[[], None]) -> None:
        if self._loop is None:
            return
        if threading.get_ident() == self._loop_thread:
            fn()
        else:  # a change made by another thread (embedding, tests) still wakes our waiters
            self._loop.call_soon_threadsafe(fn)

    def _wake(self) -> None:
        change, self._change = self._change, None
        if change is not None and not change.done():
            change.set_result(None)

    def _next_change(self) -> asyncio.Future:
        if self._change is None:
            self._change = asyncio.get_running_loop().create_future()
        return self._change

    async def _wait_until(self, ready: Callable[[], bool], wait: float) -> bool:
        """Await `ready()` for at most `wait` seconds (clamped); False on timeout or shutdown."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.clamp_wait(wait)
        while True:
            change = self._next_change()  # taken before the check, so no wake-up is lost
            if self._draining or self.pacer.closed:
                return False
            if ready():
                return True
            remaining = deadline - loop.time()
            if remaining <= 0:
                return False
            self.waiting_calls += 1
            try:
                await asyncio.wait((change,), timeout=remaining)
            finally:
                self.waiting_calls -= 1

    def clamp_wait(self, wait: float) -> float:
        return min(max(0.0, float(wait)), self.max_wait_seconds)

    # ------------------------------------------------------------- operations

    async def dispatch(self, candidates: Sequence[PromptRef], wait: float = 0.0, request_id: str = "") -> DispatchResult:
        async def call() -> DispatchResult:
            result = self.pacer.dispatch(candidates)
            if result.admitted or not candidates or wait <= 0:
                return result
            holder = [result]

            def admitted_some() -> bool:
                holder[0] = self.pacer.dispatch(candidates)
                return bool(holder[0].admitted)

            await self._wait_until(admitted_some, wait)
            if self._draining:  # answered because the server is going away: nothing will be admitted
                return dataclasses.replace(holder[0], paused=True, remaining=0)
            return holder[0]

        return await self._replay["Dispatch"].run(request_id, call)

    async def submit(self, trajectories: Sequence[Trajectory], request_id: str = "") -> SubmitResult:
        async def call() -> SubmitResult:
            return self.pacer.submit(trajectories)

        return await self._replay["Submit"].run(request_id, call)

    async def collect(self, num_groups: int, wait: float = 0.0, allow_partial: bool = False,
                      request_id: str = "") -> CollectResult:
        async def call() -> CollectResult:
            holder: list[CollectResult] = []

            def got_all() -> bool:
                result = self.pacer.collect_now(num_groups)
                if result.groups:
                    holder.append(result)
                return bool(result.groups)

            if await self._wait_until(got_all, wait):
                return holder[0]
            return self.pacer.collect_now(num_groups, allow_partial)

        return await self._replay["Collect"].run(request_id, call)

    async def reset(self, mode: ResetMode = ResetMode.UNSPECIFIED, wait: float = 0.0, resume: bool = False,
                    weight_version: Optional[int] = None, request_id: str = "") -> ResetResult:
        async def call() -> ResetResult:
            self.pacer.begin_reset(mode, resume=resume, weight_version=weight_version)
            # The reset runs to its end even if the caller goes away: a half-done reset would
            # leave dispatch paused forever. A retry with the same request_id gets the answer.
            task = asyncio.ensure_future(self._finish_reset(wait, resume, weight_version))
            return await asyncio.shield(task)

        return await self._replay["Reset"].run(request_id, call)

    async def _finish_reset(self, wait: float, resume: bool, weight_version: Optional[int]) -> ResetResult:
        try:
            await self._wait_until(self.pacer.reset_ready, wait)
        except BaseException:
            self.pacer.abandon_reset()
            raise
        return self.pacer.finish_reset(resume=resume, weight_version=weight_version)

    async def resume(self, weight_version: int, request_id: str = "") -> ResumeResult:
        async def call() -> ResumeResult:
            return self.pacer.resume(weight_version)

        return await self._replay["Resume"].run(request_id, call)

    def state(self) -> PacerState:
        return dataclasses.replace(self.pacer.state(), waiting_calls=self.waiting_calls)

    # ------------------------------------------------------------- watchers

    async def watch(self) -> AsyncIterator[ControlEvent]:
        """The current state first, then every control event until SHUTDOWN (or the watcher lags too far)."""
        queue: asyncio.Queue = asyncio.Queue(maxsize=WATCH_QUEUE_LIMIT)
        self._watchers.add(queue)
        try:
            yield self.pacer.current_state_event()
            if self.pacer.closed:
                yield ControlEvent(ControlEventType.SHUTDOWN)
                return
            while True:
                event = await queue.get()
                if event is None:  # overflowed: end the stream; the client reconnects and gets STATE first
                    return
                yield event
                if event.type == ControlEventType.SHUTDOWN:
                    return
        finally:
            self._watchers.discard(queue)

    def _publish(self, event: ControlEvent) -> None:
        for queue in list(self._watchers):
            if queue.qsize() >= WATCH_QUEUE_LIMIT - 1:
                self._watchers.discard(queue)
                queue.put_nowait(None)
            else:
                queue.put_nowait(event)

    @property
    def watcher_count(self) -> int:
        return len(self._watchers)

    # ------------------------------------------------------------- shutdown

    def drain(self) -> None:
        """Answer every waiting long-poll now (with its timed_out / paused flag) and end watch streams."""
        self._draining = True
        self.pacer.close()
        self._wake()
