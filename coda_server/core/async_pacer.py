"""Asyncio face of the Pacer: long-polls awaited without a thread per waiter, durable answers, watchers, lease expiry."""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading
import time
from typing import Any, AsyncIterator, Awaitable, Callable, Mapping, Optional, Sequence

from . import checkpoints
from .collect_stalls import CollectStalls
from .content_keys import ContentKeys
from .errors import NotReadyError, ShuttingDownError, StateDirUnwritableError
from .journal import Journal, TrajectoryCodec
from .pacer import Pacer
from .reset_steps import log_reset_finished, warn_dropped
from .shares import PLAIN, BatchShape, describe_shape
from .state import PacerState
from .types import (
    CollectResult,
    ControlEvent,
    DispatchResult,
    HeldGroup,
    JobEndReport,
    KeepAliveResult,
    PromptRef,
    ResetMode,
    ResetResult,
    RestoreResult,
    ResumeResult,
    SubmitResult,
    Trajectory,
)
from .waiting import LoopWaits
from .watchers import DEFAULT_QUEUE_LIMIT, Watcher, WatcherFanout

log = logging.getLogger("coda_server.leases")
checkpoint_log = logging.getLogger("coda_server.checkpoints")

# Control events reach the watchers this long after they happen (see _queue_control).
CONTROL_FANOUT_DELAY_SECONDS = 0.002
# How often lease deadlines are checked; leases are meant in seconds to minutes, so this is plenty.
LEASE_TICK_SECONDS = 0.25


class AsyncPacer:
    """Wraps a `Pacer` for one asyncio event loop; waits are awaited conditions, each with a bound.

    Every call is the Pacer's own parts (its `apply_*` changes and `*_poll` waits) run through the same
    request-id answers (`AnswerBook.once_awaited`) and answered once what it changed is durable.
    """

    def __init__(self, pacer: Pacer, *, max_wait_seconds: float = 600.0, watch_queue_limit: int = DEFAULT_QUEUE_LIMIT):
        self.pacer = pacer
        self.waits = LoopWaits(lambda: pacer.closed, max_wait_seconds)
        self.watchers = WatcherFanout(watch_queue_limit)
        self._pending_control: list[ControlEvent] = []  # control events not yet handed to the watchers
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._loop_thread: Optional[int] = None
        self._draining = False
        self._clocks_stopped = False  # leases and liveness held still while the journal could not write
        self._lease_task: Optional[asyncio.Task] = None
        self._recheck_task: Optional[asyncio.Task] = None
        self._stalls = CollectStalls(pacer)
        self.content_keys = ContentKeys()
        self.recovering = False  # set while the state is rebuilt from the journal: pacer calls are refused
        # Called (on the loop) when the journal can no longer write: the server stops advertising readiness.
        self.on_journal_failure: Optional[Callable[[BaseException], None]] = None
        pacer.add_change_listener(self._on_change)
        pacer.add_control_listener(self._on_control)
        self.state_of: Callable[[tuple], PacerState] = pacer.state_of  # the PacerState of a reading (read_state)

    @property
    def max_wait_seconds(self) -> float:
        return self.waits.max_wait_seconds

    @property
    def waiting_calls(self) -> int:
        return self.waits.waiting_calls

    def clamp_wait(self, wait: float) -> float:
        return self.waits.clamp(wait)

    def bind_loop(self) -> None:
        """Attach to the running loop; call once from it before serving."""
        self._loop = asyncio.get_running_loop()
        self._loop_thread = threading.get_ident()
        self._lease_task = self._loop.create_task(self._expire_leases_periodically())
        if self.pacer.gate_recheck_seconds > 0:
            self._recheck_task = self._loop.create_task(self._recheck_gates_periodically())

    async def _expire_leases_periodically(self) -> None:
        """Reclaim in-flight groups and Collect leases whose time ran out (checked every LEASE_TICK_SECONDS)."""
        while not self._draining:
            await asyncio.sleep(LEASE_TICK_SECONDS)
            if self.recovering or self.pacer.closed:
                continue
            self._stalls.warn_if_stalled(asyncio.get_running_loop().time())
            journal = self.pacer.recorder.journal
            if journal is not None and journal.error is not None:
                # The server refuses every change while it cannot journal (an Ack, a Submit): no client can keep its
                # leases alive, so none runs out and nobody is taken as gone; their clocks restart when it writes.
                if not self._clocks_stopped:
                    self._clocks_stopped = True
                    log.warning("lease and liveness clocks stopped while the journal cannot write: no lease runs out "
                                "and no client is taken as gone while the server refuses their calls")
                continue
            if self._clocks_stopped:
                self._clocks_stopped = False
                self.pacer.restart_clocks()
                log.warning("lease and liveness clocks restarted: every lease has its full time again")
            try:
                prompts, leases = self.pacer.expire_leases()
            except Exception:  # a broken strategy hook must not stop lease expiry for good
                log.exception("lease expiry failed")
                continue
            if prompts:
                log.warning("in-flight lease ran out for %d running group(s) (%s%s): slots reclaimed, %s", len(prompts),
                            ", ".join(prompts[:5]), ", ..." if len(prompts) > 5 else "",
                            "kept for continuation (re-offered on Dispatch)" if self.pacer.checks.continue_restored
                            else "partial trajectories set aside for the next Reset")
            try:
                silent = self.pacer.release_silent_workers()
            except Exception:
                log.exception("releasing the groups of silent workers failed")
                continue
            for client, lost in silent.items():
                if lost.prompt_ids:
                    log.warning("worker %s silent for %.0f s (no heartbeat or call): its %d running group(s) released "
                                "(%s%s)", client, self.pacer.liveness_seconds, len(lost.prompt_ids),
                                ", ".join(lost.prompt_ids[:5]), ", ..." if len(lost.prompt_ids) > 5 else "")
                if lost.lease_ids or lost.unnamed_lease_ids:  # one or the other: an unnamed lease's holder is heard
                    log.warning("trainer %s %s: its lease(s) %s released, %d group(s) back in the buffer first in "
                                "line", client, lost.why_leases_went(self.pacer.trainer_liveness_seconds),
                                ", ".join(lost.lease_ids or lost.unnamed_lease_ids), lost.leased_groups)
            if leases:
                log.warning("Collect lease(s) %s ran out without Ack: their groups are back in the buffer",
                            ", ".join(leases))

    async def _recheck_gates_periodically(self) -> None:
        """Re-examine held groups every fully_async.gate_recheck_seconds (unless a change just did), so a gate
        that opens with time or on an outside flag releases them; a pass costs one will_collect per held group
        at most (one in all for an ordered gate), see bench/gate_recheck.py."""
        interval = self.pacer.gate_recheck_seconds
        while not self._draining:
            await asyncio.sleep(interval)
            if self.recovering or self.pacer.closed:
                continue
            try:
                self.pacer.recheck_gates(min_age=interval)
            except Exception:  # hook failures are incidents already; nothing else may stop the re-checks
                log.exception("re-examining held groups failed")

    # ------------------------------------------------------------- wake-ups

    def _on_change(self) -> None:
        # Most changes find nobody waiting. A waiter takes its future before it attempts, so one that
        # appears after this read sees the change itself.
        if self.waits.anyone_waiting:
            self._call_in_loop(self.waits.wake_answerable)

    def _on_control(self, event: ControlEvent) -> None:
        self._call_in_loop(lambda: self._queue_control(event))

    def _queue_control(self, event: ControlEvent) -> None:
        """Hand `event` to the watchers CONTROL_FANOUT_DELAY_SECONDS from now, after those queued before it.

        The call that caused it (the trainer's Reset or Resume) takes a few turns of the loop to send its
        answer; woken at once, thousands of watchers' writes would all run first and the trainer would wait
        for the whole fan-out.
        """
        self._pending_control.append(event)
        if len(self._pending_control) == 1:
            self._loop.call_later(CONTROL_FANOUT_DELAY_SECONDS, self._publish_pending)

    def _publish_pending(self) -> None:
        pending, self._pending_control = self._pending_control, []
        for event in pending:
            self.watchers.publish(event)

    def _call_in_loop(self, fn: Callable[[], None]) -> None:
        if self._loop is None:
            return
        if threading.get_ident() == self._loop_thread:
            fn()
        else:  # a change made by another thread (embedding, tests) still wakes our waiters
            self._loop.call_soon_threadsafe(fn)

    # ------------------------------------------------------------- operations

    async def dispatch(self, candidates: Sequence[PromptRef], wait: float = 0.0, request_id: str = "",
                       client_id: str = "", max_continuations: Optional[int] = None,
                       max_response_bytes: int = 0) -> DispatchResult:
        pacer = self.pacer
        if wait <= 0 and not pacer.answers.under_way("Dispatch", request_id):
            # The usual call, which does not wait: nothing suspends before its answer, so no retry of it can
            # arrive meanwhile and it needs neither once_awaited nor the wait's coroutines (a few per call).
            journal = self._applicable()
            if candidates or max_continuations is not None:
                result = pacer.answers.once("Dispatch", request_id, lambda: self.waits.now(
                    pacer.dispatch_poll(candidates, request_id, client_id, max_continuations, max_response_bytes)),
                    candidates, max_continuations)
            else:  # a peek: the window as it is (see Pacer.peek)
                result = pacer.peek(request_id)
            if journal is not None:
                await self._durable(journal)
            return result

        async def call() -> DispatchResult:
            return await self.waits.until(
                self.pacer.dispatch_poll(candidates, request_id, client_id, max_continuations, max_response_bytes), wait)

        return await self._applied("Dispatch", request_id, call, candidates, max_continuations)

    def heard_from(self, client_id: str, held_leases: Sequence[str] = (), all_held: bool = True) -> None:
        """A call from `client_id`: the worker or trainer is alive (see liveness.py). Cheap; made by every worker call.
        `held_leases`: the Collect leases a trainer says it holds, `all_held` or not (Workers.heard_from)."""
        if client_id:
            reclaim = self.pacer.heard_from(client_id, held_leases, all_held)
            if reclaim is not None:
                if reclaim.lease_ids:
                    log.warning("trainer %s heard again after its silence: its lease(s) %s given back to it, %d "
                                "group(s) that still waited in the buffer", client_id, ", ".join(reclaim.lease_ids),
                                reclaim.groups)
                if reclaim.missed:
                    log.warning("trainer %s heard again after its silence: its lease(s) %s cannot be given back, their "
                                "groups went out again meanwhile (an Ack of them fails LEASE_EXPIRED)", client_id,
                                ", ".join(reclaim.missed))

    def note_loaded_version(self, client_id: str, weight_version: int) -> None:
        """The weight version `client_id`'s engine reports loaded (ListWorkers shows it)."""
        self.pacer.note_loaded_version(client_id, weight_version)

    def loaded_versions(self) -> dict[str, int]:
        return self.pacer.loaded_versions()

    def worker_contact(self, client_ids: Sequence[str]) -> dict[str, tuple[Optional[float], int]]:
        return self.pacer.worker_contact(client_ids)

    def keep_alive(self, prompt_ids: Sequence[str], dispatch_seqs: Optional[Mapping[str, int]] = None,
                   lease_ids: Sequence[str] = ()) -> KeepAliveResult:
        """Renews in-flight leases at once (nothing to wait for: it is not journaled)."""
        self.check_ready()
        return self.pacer.keep_alive(prompt_ids, dispatch_seqs, lease_ids)

    async def submit(self, trajectories: Sequence[Trajectory], request_id: str = "",
                     dispatch_seqs: Optional[Mapping[str, int]] = None) -> SubmitResult:
        async def call() -> SubmitResult:
            keyed = self.content_keys.before_submit(trajectories)
            result = self.pacer.apply_submit(trajectories, request_id, dispatch_seqs)
            if not keyed:
                self.content_keys.after_submit(trajectories)
            return result

        return await self._applied("Submit", request_id, call, trajectories, dispatch_seqs)

    async def collect(self, num_groups: int, wait: float = 0.0, allow_partial: bool = False,
                      request_id: str = "", lease_seconds: float = 0.0, shape: BatchShape = PLAIN,
                      trainer_step: Optional[int] = None, max_bytes: int = 0, holder: str = "",
                      named_at_grant: bool = False) -> CollectResult:
        async def call() -> CollectResult:
            pacer = self.pacer
            if pacer.closed:  # like every other call; a Collect already waiting is answered timed_out instead
                raise ShuttingDownError("the pacer is shutting down and takes no new calls")
            groups = pacer.checks.check_collect(num_groups, lease_seconds, shape, holder, named_at_grant)
            pacer.check_collect_reachable(groups, allow_partial, shape)
            pacer.end_earlier_run(groups, shape)  # ranks started again: the earlier run's shares go back first
            loop = asyncio.get_running_loop()
            wait_id = self._stalls.begin(groups, loop.time())
            answer = None
            try:
                answer = await self.waits.until(pacer.collect_poll(groups, allow_partial, request_id, lease_seconds,
                                                                   shape, trainer_step, max_bytes, holder,
                                                                   named_at_grant), wait)
            finally:
                self._stalls.end(wait_id, answer is not None and bool(answer.groups), loop.time())
            return answer

        result = await self._applied("Collect", request_id, call, num_groups, allow_partial, lease_seconds, shape)
        if result.lease_id and result.groups:
            self.content_keys.after_collect(result.lease_id, result.groups)
        if result.other_shapes_waiting:
            log.warning("rank %d took a new global mini-batch of %s while shares of %s wait for their ranks: the ranks of "
                        "one trainer must send the same mini_batch_size (num_groups), token_budget and world_size, or "
                        "each trains on shares of different mini-batches; the waiting shares return to the buffer when "
                        "their leases run out (a trainer restarted with another world size leaves such shares behind)",
                        shape.rank, describe_shape(shape.key(num_groups)),
                        "; ".join(describe_shape(key) for key in result.other_shapes_waiting))
        return result

    async def reset(self, mode: ResetMode = ResetMode.UNSPECIFIED, wait: Optional[float] = 0.0, resume: bool = False,
                    weight_version: Optional[int] = None, request_id: str = "",
                    until_assembled: Optional[float] = None, max_response_bytes: int = 0) -> ResetResult:
        """`wait=None`: wait until every running group is assembled, for at most `until_assembled` seconds
        (default max_wait_seconds; the server passes what the call's deadline allows), and in ABORT mode at
        most server.abort_wait_seconds."""
        bound = self.max_wait_seconds if until_assembled is None else min(until_assembled, self.max_wait_seconds)

        async def call() -> ResetResult:
            effective = self.pacer.begin_reset(mode, resume=resume, weight_version=weight_version)
            try:
                await self.waits.until(self.pacer.reset_poll(), self.pacer.reset_wait(
                    effective, wait, bound, self.pacer.limits.abort_wait_seconds))
            except BaseException:
                self.pacer.abandon_reset()
                raise
            if self.pacer.closed and not self.pacer.reset_ready():
                # The server is going away (a restart): finishing now would drop the running groups its workers
                # will submit to the next server. Abandoned instead; the trainer's retry runs it there.
                self.pacer.abandon_reset()
                raise ShuttingDownError("the server shuts down while this Reset waits for running groups; it "
                                        "was abandoned (nothing dropped): retry it once the server is back")
            result = self.pacer.finish_reset(resume=resume, weight_version=weight_version, request_id=request_id,
                                             max_response_bytes=max_response_bytes)
            # Logged here, once per Reset: a retry answered the remembered result runs none of this.
            log_reset_finished(result, effective)
            if result.dropped_prompt_ids and wait != 0:  # it waited, and its bound ended the wait: work was lost
                warn_dropped(result, effective, wait, bound, self.pacer.limits.abort_wait_seconds,
                             self.pacer.boundary.dropped_holders(result))
            return result

        # The reset runs to its end even if the caller goes away: a half-done reset would leave dispatch
        # paused forever. A retry with the same request_id gets the answer.
        return await self._applied("Reset", request_id, call, mode, resume, weight_version, outlives_caller=True)

    async def ack(self, lease_id: str, request_id: str = "") -> int:
        await self.content_keys.before_ack(lease_id)  # keys computed in the keys thread: let them finish there

        async def call() -> int:
            self.pacer.checks.check_lease_id(lease_id)
            return self.pacer.apply_ack(lease_id, request_id)

        return await self._applied("Ack", request_id, call, lease_id)

    async def release(self, lease_id: str, request_id: str = "") -> int:
        """Pacer.release: the leased groups back to the buffer, untrained."""
        async def call() -> int:
            self.pacer.checks.check_lease_id(lease_id)
            return self.pacer.apply_release(lease_id)

        return await self._applied("Release", request_id, call, lease_id)

    async def resume(self, weight_version: int, request_id: str = "") -> ResumeResult:
        async def call() -> ResumeResult:
            return self.pacer.apply_resume(weight_version, request_id)

        return await self._applied("Resume", request_id, call, weight_version)

    async def checkpoint(self, encode: Callable[[dict], Any]) -> Any:
        """`encode(checkpoint)` of a checkpoint (checkpoints.take), run off the event loop: nothing pauses. The
        checkpoint shares the pacer's groups, which are never changed, so it may be read without the lock."""
        self.check_ready()
        taking = self.pacer.checkpoints
        checkpoint = taking.take()
        encoded = await asyncio.to_thread(encode, checkpoint)  # may refuse it (CHECKPOINT_TOO_LARGE): not counted
        taking.taken(checkpoint)
        checkpoint_log.info("checkpoint taken at step %d (weight version %d): %d buffered groups, %d kept, %d prompts "
                            "in flight", checkpoint["step"], checkpoint["weight_version"], len(checkpoint["buffer"]),
                            len(checkpoint["kept"]), len(checkpoint["in_flight"]),
                            extra={"fields": {"event": "checkpoint", "step": checkpoint["step"],
                                              "weight_version": checkpoint["weight_version"],
                                              "buffered": len(checkpoint["buffer"]), "kept": len(checkpoint["kept"]),
                                              "in_flight": len(checkpoint["in_flight"])}})
        return encoded

    async def restore(self, blob: bytes, codec: TrajectoryCodec, request_id: str = "") -> RestoreResult:
        """Restore the checkpoint in `blob` (decoded off the event loop), answered once it is durable."""
        self.check_ready()
        checkpoint = await asyncio.to_thread(checkpoints.decode, blob, codec)

        async def call() -> RestoreResult:
            result = self.pacer.apply_restore(checkpoint, request_id)  # decode validated it
            # Said here, where it happens: a retry answered the remembered result restores nothing.
            checkpoint_log.warning(checkpoints.restore_summary(result),
                                   extra={"fields": {"event": "restore", **dataclasses.asdict(result)}})
            return result

        return await self._applied("Restore", request_id, call, blob)

    def prompt_cursor(self) -> dict:
        self.check_ready()
        return self.pacer.prompt_cursor()

    async def end_job(self, mode: ResetMode = ResetMode.UNSPECIFIED, wait: float = 0.0,
                      request_id: str = "") -> JobEndReport:
        """End the job: dispatch closes for good, watchers get JOB_ENDED; waits up to `wait` seconds for the
        running groups to be assembled, then reports what was left."""
        async def call() -> JobEndReport:
            self.pacer.begin_end_job(mode)
            started = time.monotonic()  # the clock the wait is timed on (LoopWaits.until)
            await self.waits.until(self.pacer.reset_poll(), wait)
            return self.pacer.job_end_report(time.monotonic() - started)

        return await self._applied("EndJob", request_id, call, mode)

    async def _applied(self, method: str, request_id: str, call: Callable[[], Awaitable[Any]], *asked: Any,
                       outlives_caller: bool = False) -> Any:
        """Run `call` once per request_id (`asked`: its arguments, see AnswerBook.once), and answer only when what it
        changed is durable. While the journal cannot write, nothing is applied: the call is refused UNAVAILABLE
        (STATE_DIR_UNWRITABLE), to retry."""
        journal = self._applicable()
        answers = self.pacer.answers
        result = await answers.once_awaited(method, request_id, call, *asked, outlives_caller=outlives_caller)
        if journal is not None:  # state in memory: nothing to wait for
            await self._durable(journal)
        return result

    def _applicable(self) -> Optional[Journal]:
        """The journal (None: state in memory), once a call may be applied: the state is recovered and the
        journal can write (else UNAVAILABLE, STATE_DIR_UNWRITABLE: nothing is applied, retry)."""
        if self.recovering:  # check_ready's test first: no call of it on every call
            self.check_ready()
        journal = self.pacer.recorder.journal  # the attribute itself: Pacer.journal is a property (a call)
        if journal is not None and journal.error is not None:
            raise self._unwritable(journal)
        return journal

    def _unwritable(self, journal: Journal) -> StateDirUnwritableError:
        if self.on_journal_failure is not None:
            self.on_journal_failure(journal.error)
        return StateDirUnwritableError(f"{journal.error}; this call was not acknowledged, retry it (the same "
                                       f"request_id) once the server is ready again", retry_after=1.0)

    async def _durable(self, journal: Journal) -> None:
        """Wait (without blocking the loop) until the journal has committed every change made so far."""
        loop = asyncio.get_running_loop()
        committed = loop.create_future()
        ticket = self.pacer.last_ticket
        journal.on_durable(ticket,
                           lambda: loop.call_soon_threadsafe(lambda: committed.done() or committed.set_result(None)))
        await committed
        if journal.error is not None and not journal.committed(ticket):
            raise self._unwritable(journal)

    def check_ready(self) -> None:
        if self.recovering:
            raise NotReadyError("the server is still recovering its state from server.state_dir; retry shortly")

    def held_groups(self, client_id: Optional[str] = None) -> list[HeldGroup]:
        self.check_ready()
        return self.pacer.held_groups(client_id)

    def held_leases(self, client_id: Optional[str] = None) -> dict[str, tuple[list[str], int]]:
        self.check_ready()
        return self.pacer.held_leases(client_id)

    def state(self) -> PacerState:
        self.check_ready()
        return self.pacer.state(self.waits.waiting_calls, ages=True)

    def read_state(self) -> tuple:
        """What `state()` is made of, as a reading (Pacer.read_state; `state_of(reading)` is the state):
        cheaper to compare with an earlier reading than a PacerState to build."""
        self.check_ready()
        return self.pacer.read_state(self.waits.waiting_calls, ages=True)

    # ------------------------------------------------------------- watchers

    def open_watch(self, client_id: str = "") -> Watcher:
        """A watcher for the calling task: the current state first, then every control event until SHUTDOWN;
        dropped (and counted in `watchers.dropped`) if it falls `watch_queue_limit` events behind. Close it
        when the stream ends (`close_watch`). A `client_id` holding a stream is a watched worker (liveness.py)."""
        self.check_ready()
        watcher = self.watchers.open(self.pacer.current_state_event(), self.pacer.closed)
        self.pacer.watch_opened(client_id)
        return watcher

    def close_watch(self, watcher: Watcher, client_id: str = "") -> None:
        watcher.close()
        self.pacer.watch_closed(client_id)

    async def watch(self) -> AsyncIterator[ControlEvent]:
        """`open_watch()` as an async generator that closes the watcher when it ends."""
        watcher = self.open_watch()
        try:
            async for event in watcher:
                yield event
        finally:
            self.close_watch(watcher)

    @property
    def watcher_count(self) -> int:
        return len(self.watchers)

    # ------------------------------------------------------------- shutdown

    def drain(self) -> None:
        """Answer every waiting long-poll now (with its timed_out / paused flag) and end watch streams."""
        self._draining = True
        self.pacer.close()
        self.waits.wake_all()
        for task in (self._lease_task, self._recheck_task):
            if task is not None:
                task.cancel()
        self.content_keys.close()
