"""Asyncio face of the Pacer: bounded long-polls without a thread per waiter, request-id replay, watchers."""
from __future__ import annotations

import asyncio
import logging
import dataclasses
import threading
from typing import Any, AsyncIterator, Awaitable, Callable, Optional, Sequence

from .errors import NotReadyError, ResourceExhaustedError, ShuttingDownError
from .pacer import ANSWERED_METHODS, Pacer
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

log = logging.getLogger("coda_server.leases")

WATCH_QUEUE_LIMIT = 1024
# How often lease deadlines are checked; leases are meant in seconds to minutes, so this is plenty.
LEASE_TICK_SECONDS = 0.25
# Retry delay suggested to a long-poll refused because server.max_waiting_calls callers already wait.
WAITERS_RETRY_AFTER_SECONDS = 1.0


class RequestDeduplicator:
    """Makes a retried call (same request_id) apply once.

    The Pacer remembers the answers of calls that changed its state (that memory is part of the
    state and survives a restart); a retry arriving while the first call still runs awaits it. The future
    such a retry awaits is made by the first retry, not by every call: most calls finish without a retry
    arriving, and many (a Dispatch that does not wait) without ever suspending.
    """

    def __init__(self, answered: Callable[[str], Any], check: Optional[Callable[[str], None]] = None):
        self._answered = answered
        self._check = check  # validates a non-empty request_id before it is used
        self._running: dict[str, Optional[asyncio.Future]] = {}  # request_id -> what retries await, once one came

    async def run(self, request_id: str, call: Callable[[], Awaitable[Any]]) -> Any:
        if not request_id:
            return await call()
        if self._check is not None:
            self._check(request_id)
        answer = self._answered(request_id)
        if answer is not None:
            return answer
        if request_id in self._running:
            shared = self._running[request_id]
            if shared is None:
                shared = self._running[request_id] = asyncio.get_running_loop().create_future()
            return await asyncio.shield(shared)
        self._running[request_id] = None
        try:
            result = await call()
        except BaseException as exc:
            shared = self._running.pop(request_id)
            if shared is not None:
                shared.set_exception(exc)
                shared.exception()  # mark retrieved: the retries may be gone
            raise
        shared = self._running.pop(request_id)
        if shared is not None:
            shared.set_result(result)
        return result


class AsyncPacer:
    """Wraps a `Pacer` for one asyncio event loop; waits are awaited conditions, each with a bound."""

    def __init__(self, pacer: Pacer, *, max_wait_seconds: float = 600.0,
                 max_waiting_calls: int = 512):
        self.pacer = pacer
        self.max_wait_seconds = max_wait_seconds
        self.max_waiting_calls = max_waiting_calls
        check = getattr(pacer, "check_request_id", None)
        self._replay = {method: RequestDeduplicator(pacer.answers_of(method).get, check)
                        for method in ANSWERED_METHODS}
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._loop_thread: Optional[int] = None
        self._change: Optional[asyncio.Future] = None
        self._watchers: set[asyncio.Queue] = set()
        self._draining = False
        self._lease_task: Optional[asyncio.Task] = None
        self.waiting_calls = 0
        self.recovering = False  # set while the state is rebuilt from the journal: pacer calls are refused
        # Called (on the loop) when the journal can no longer write: the server stops advertising readiness.
        self.on_journal_failure: Optional[Callable[[BaseException], None]] = None
        pacer.add_change_listener(self._on_change)
        pacer.add_control_listener(self._on_control)

    def bind_loop(self) -> None:
        """Attach to the running loop; call once from it before serving."""
        self._loop = asyncio.get_running_loop()
        self._loop_thread = threading.get_ident()
        self._lease_task = self._loop.create_task(self._expire_leases_periodically())

    async def _expire_leases_periodically(self) -> None:
        """Reclaim in-flight groups and Collect leases whose time ran out (checked every LEASE_TICK_SECONDS)."""
        while not self._draining:
            await asyncio.sleep(LEASE_TICK_SECONDS)
            if self.recovering or self.pacer.closed:
                continue
            try:
                prompts, leases = self.pacer.expire_leases()
            except Exception:  # a broken strategy hook must not stop lease expiry for good
                log.exception("lease expiry failed")
                continue
            if prompts:
                log.warning("in-flight lease ran out for %d running group(s) (%s%s): slots reclaimed, partial "
                            "trajectories set aside for the next Reset", len(prompts), ", ".join(prompts[:5]),
                            ", ..." if len(prompts) > 5 else "")
            if leases:
                log.warning("Collect lease(s) %s ran out without Ack: their groups are back in the buffer",
                            ", ".join(leases))

    # ------------------------------------------------------------- wake-ups

    def _on_change(self) -> None:
        # Most changes find nobody waiting. A waiter takes its future before it checks the state, so one
        # that appears after this read sees the change itself.
        if self._change is not None:
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

    async def _wait_until(self, ready: Callable[[], bool], wait: float, capped: bool = True) -> bool:
        """Await `ready()` for at most `wait` seconds (clamped); False on timeout or shutdown.

        `capped`: refuse with ResourceExhaustedError, before waiting at all, when max_waiting_calls callers
        already wait (Reset is not capped: only one runs at a time, and it must finish).
        """
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.clamp_wait(wait)
        first = True
        while True:
            change = self._next_change()  # taken before the check, so no wake-up is lost
            if self._draining or self.pacer.closed:
                return False
            if ready():
                return True
            remaining = deadline - loop.time()
            if remaining <= 0:
                return False
            if first and capped and self.waiting_calls >= self.max_waiting_calls:
                raise ResourceExhaustedError(
                    f"{self.waiting_calls} long-polls are already waiting (server.max_waiting_calls = "
                    f"{self.max_waiting_calls}); retry in {WAITERS_RETRY_AFTER_SECONDS:g}s or poll with wait_seconds = 0",
                    retry_after=WAITERS_RETRY_AFTER_SECONDS, reason="TOO_MANY_WAITERS")
            first = False
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
            result = self.pacer.dispatch(candidates, request_id=request_id)
            if result.admitted_ids or not candidates or wait <= 0:
                return result
            holder = [result]

            def admitted_some() -> bool:
                # Re-validating a large candidate list on every change would let one caller stall the loop:
                # only try again when the window has room.
                if not self.pacer.admissible_now():
                    return False
                holder[0] = self.pacer.dispatch(candidates, request_id=request_id)
                return bool(holder[0].admitted_ids)

            await self._wait_until(admitted_some, wait)
            if self._draining:  # answered because the server is going away: nothing will be admitted
                return dataclasses.replace(holder[0], paused=True, remaining=0)
            return holder[0]

        return await self._applied("Dispatch", request_id, call)

    async def submit(self, trajectories: Sequence[Trajectory], request_id: str = "") -> SubmitResult:
        async def call() -> SubmitResult:
            return self.pacer.submit(trajectories, request_id=request_id)

        return await self._applied("Submit", request_id, call)

    async def collect(self, num_groups: int, wait: float = 0.0, allow_partial: bool = False,
                      request_id: str = "", lease_seconds: float = 0.0) -> CollectResult:
        async def call() -> CollectResult:
            if self.pacer.closed:  # like every other call; a Collect already waiting is answered timed_out instead
                raise ShuttingDownError("the pacer is shutting down and takes no new calls")
            holder: list[CollectResult] = []

            def got_all() -> bool:
                result = self.pacer.collect_now(num_groups, request_id=request_id, lease_seconds=lease_seconds)
                if result.groups:
                    holder.append(result)
                return bool(result.groups)

            if await self._wait_until(got_all, wait):
                return holder[0]
            return self.pacer.collect_now(num_groups, allow_partial, request_id=request_id, lease_seconds=lease_seconds)

        return await self._applied("Collect", request_id, call)

    async def reset(self, mode: ResetMode = ResetMode.UNSPECIFIED, wait: float = 0.0, resume: bool = False,
                    weight_version: Optional[int] = None, request_id: str = "") -> ResetResult:
        async def call() -> ResetResult:
            self.pacer.begin_reset(mode, resume=resume, weight_version=weight_version)
            # The reset runs to its end even if the caller goes away: a half-done reset would
            # leave dispatch paused forever. A retry with the same request_id gets the answer.
            task = asyncio.ensure_future(self._finish_reset(wait, resume, weight_version, request_id))
            return await asyncio.shield(task)

        return await self._applied("Reset", request_id, call)

    async def _finish_reset(self, wait: float, resume: bool, weight_version: Optional[int],
                            request_id: str) -> ResetResult:
        try:
            await self._wait_until(self.pacer.reset_ready, wait, capped=False)
        except BaseException:
            self.pacer.abandon_reset()
            raise
        return self.pacer.finish_reset(resume=resume, weight_version=weight_version, request_id=request_id)

    async def ack(self, lease_id: str, request_id: str = "") -> int:
        async def call() -> int:
            return self.pacer.ack(lease_id, request_id=request_id)

        return await self._applied("Ack", request_id, call)

    async def resume(self, weight_version: int, request_id: str = "") -> ResumeResult:
        async def call() -> ResumeResult:
            return self.pacer.resume(weight_version, request_id=request_id)

        return await self._applied("Resume", request_id, call)

    async def _applied(self, method: str, request_id: str, call: Callable[[], Awaitable[Any]]) -> Any:
        """Run `call` once per request_id, and answer only when what it changed is durable."""
        self.check_ready()
        result = await self._replay[method].run(request_id, call)
        self.pacer.remember_answer(method, request_id, result)
        journal = self.pacer.journal
        if journal is not None:  # state in memory: nothing to wait for
            await self._durable(journal)
        return result

    async def _durable(self, journal: Any) -> None:
        """Wait (without blocking the loop) until the journal has committed every change made so far."""
        loop = asyncio.get_running_loop()
        committed = loop.create_future()
        journal.on_durable(self.pacer.last_ticket,
                           lambda: loop.call_soon_threadsafe(lambda: committed.done() or committed.set_result(None)))
        await committed
        if journal.error is not None:
            if self.on_journal_failure is not None:
                self.on_journal_failure(journal.error)
            raise ShuttingDownError(f"the state directory can no longer be written ({journal.error}); "
                                    f"the change is not acknowledged")

    def check_ready(self) -> None:
        if self.recovering:
            raise NotReadyError("the server is still recovering its state from server.state_dir; retry shortly")

    def state(self) -> PacerState:
        self.check_ready()
        return dataclasses.replace(self.pacer.state(), waiting_calls=self.waiting_calls)

    # ------------------------------------------------------------- watchers

    async def watch(self) -> AsyncIterator[ControlEvent]:
        """The current state first, then every control event until SHUTDOWN (or the watcher lags too far)."""
        self.check_ready()
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
        if self._lease_task is not None:
            self._lease_task.cancel()
