"""The Pacer's in-process calls: each through the request-id answers (`AnswerBook.once`), blocking its thread while
it waits (`ThreadWaits`). The asyncio face (async_pacer.py) makes the same calls from the same parts."""
from __future__ import annotations

from typing import Mapping, Optional, Sequence

from .checkpoints import validate
from .polls import ResetPoll
from .reset_steps import reset_wait
from .shares import PLAIN, BatchShape
from .types import (CollectResult, DispatchResult, JobEndReport, PromptRef, ResetMode, ResetResult, RestoreResult,
                    ResumeResult, SubmitResult, Trajectory)


class InProcessCalls:
    """Dispatch, Submit, Collect, Ack, Release, Reset, Resume, EndJob and Restore for callers in the Pacer's process
    (coda-sim, an embedded pacer, tests), over the Pacer's checks, polls and `apply_*` steps."""

    def dispatch(self, candidates: Sequence[PromptRef], wait: float = 0.0, request_id: str = "",
                 client_id: str = "", max_continuations: Optional[int] = None,
                 max_response_bytes: int = 0) -> DispatchResult:
        """Admit the first k candidates the strategy allows now, after up to `max_continuations` kept restored
        groups (those that fit an answer of `max_response_bytes`); with `wait`, wait up to that long for one slot.
        `client_id` names who holds the admitted groups (`held_groups`)."""
        if not candidates and max_continuations is None:  # a peek: answered at once, whatever the wait
            return self.peek(request_id)
        poll = self.dispatch_poll(candidates, request_id, client_id, max_continuations, max_response_bytes)
        return self.answers.once("Dispatch", request_id, lambda: self.waits.until(poll, wait), candidates,
                                 max_continuations)

    def submit(self, trajectories: Sequence[Trajectory], request_id: str = "",
               dispatch_seqs: Optional[Mapping[str, int]] = None) -> SubmitResult:
        """Accept finished trajectories all-or-nothing, then collect every group that became ready.
        `dispatch_seqs` (prompt id -> the seq its dispatch answered): the fence, see `InflightTable.check_fences`."""
        def call() -> SubmitResult:
            return self.apply_submit(trajectories, request_id, dispatch_seqs)

        return self.answers.once("Submit", request_id, call, trajectories, dispatch_seqs)

    def collect(self, num_groups: int, wait: float = 0.0, allow_partial: bool = False, request_id: str = "",
                lease_seconds: float = 0.0, shape: BatchShape = PLAIN, trainer_step: Optional[int] = None,
                max_bytes: int = 0, holder: str = "", named_at_grant: bool = False) -> CollectResult:
        """Take `num_groups` groups, oldest priority first, waiting up to `wait` seconds for them. Without
        `allow_partial`, fewer than `num_groups` at the deadline gives nothing and `timed_out`. With `lease_seconds`
        > 0 the groups are leased: they return to the buffer, in their original order, unless `ack(lease_id)` comes
        within that time (at-least-once delivery). `shape` cuts the mini-batch by a token budget and/or hands the
        caller one rank's share of it (shares.py). `max_bytes`: the largest answer the caller takes (0:
        server.max_message_bytes); `holder`, `named_at_grant`: see `apply_take`."""
        num_groups = self.checks.check_collect(num_groups, lease_seconds, shape, holder, named_at_grant)
        self.collect_bound.check(num_groups, allow_partial, shape, len(self.buffer))
        self.check_open()  # once: a waiter woken by close() answers with what is there
        poll = self.collect_poll(num_groups, allow_partial, request_id, lease_seconds, shape, trainer_step, max_bytes,
                                 holder, named_at_grant)

        def call() -> CollectResult:
            self.end_earlier_run(num_groups, shape)  # ranks started again: the earlier run's shares go back first
            return self.waits.until(poll, wait)

        return self.answers.once("Collect", request_id, call, num_groups, allow_partial, lease_seconds, shape)

    def collect_now(self, num_groups: int, allow_partial: bool = False, request_id: str = "",
                    lease_seconds: float = 0.0, shape: BatchShape = PLAIN, max_bytes: int = 0,
                    holder: str = "", named_at_grant: bool = False) -> CollectResult:
        """Non-waiting collect: all `num_groups`, or with `allow_partial` whatever is there."""
        num_groups = self.checks.check_collect(num_groups, lease_seconds, shape, holder, named_at_grant)
        self.collect_bound.check(num_groups, allow_partial, shape, len(self.buffer))
        poll = self.collect_poll(num_groups, allow_partial, request_id, lease_seconds, shape, None, max_bytes, holder,
                                 named_at_grant)

        def call() -> CollectResult:
            self.end_earlier_run(num_groups, shape)
            return poll.give_up()

        return self.answers.once("Collect", request_id, call, num_groups, allow_partial, lease_seconds, shape)

    def ack(self, lease_id: str, request_id: str = "") -> int:
        """The trainer has the leased groups: they are consumed for good. Returns how many."""
        self.checks.check_lease_id(lease_id)
        return self.answers.once("Ack", request_id, lambda: self.apply_ack(lease_id, request_id), lease_id)

    def reset(self, mode: ResetMode = ResetMode.UNSPECIFIED, wait: Optional[float] = 0.0, resume: bool = False,
              weight_version: Optional[int] = None, request_id: str = "", max_response_bytes: int = 0) -> ResetResult:
        """Pause, wait up to `wait` for running groups to assemble, restore/drop them, optionally resume.
        `max_response_bytes`: the largest answer the caller takes (BoundaryCalls.finish).

        `wait=None`: wait until every running group is assembled: in WAIT mode for at most
        server.max_wait_seconds, in ABORT mode (the workers submit what they have as ABORTED) for at most
        server.abort_wait_seconds. `wait=0`: drop the incomplete groups now."""
        def call() -> ResetResult:
            effective = self.begin_reset(mode, resume=resume, weight_version=weight_version)
            with self.lock:  # ready, then finished, with no change in between
                self.waits.until(ResetPoll(self), reset_wait(effective, wait, self.max_wait_seconds,
                                                             self.limits.abort_wait_seconds))
                return self.finish_reset(resume=resume, weight_version=weight_version, request_id=request_id,
                                         max_response_bytes=max_response_bytes)

        return self.answers.once("Reset", request_id, call, mode, resume, weight_version)

    def resume(self, weight_version: int, request_id: str = "") -> ResumeResult:
        """step += 1, record the weight version, reopen dispatch, tell watchers."""
        return self.answers.once("Resume", request_id, lambda: self.apply_resume(weight_version, request_id),
                                 weight_version)

    def end_job(self, mode: ResetMode = ResetMode.UNSPECIFIED, wait: float = 0.0, request_id: str = "") -> JobEndReport:
        """End the job: close dispatch, wait up to `wait` for the running groups to be assembled, report."""
        def call() -> JobEndReport:
            self.begin_end_job(mode)
            started = self.clock.now()
            with self.lock:
                self.waits.until(ResetPoll(self), wait)
                return self.job_end_report(self.clock.now() - started)

        return self.answers.once("EndJob", request_id, call, mode)

    def restore(self, checkpoint: dict, request_id: str = "") -> RestoreResult:
        """Bring the pacer back to `checkpoint` (a dict from `checkpoint()`), see `Checkpoints.restore`."""
        validate(checkpoint)  # whole, before anything changes
        return self.answers.once("Restore", request_id, lambda: self.apply_restore(checkpoint, request_id))

    def release(self, lease_id: str, request_id: str = "") -> int:
        """The trainer gives leased groups back untrained: they return to the buffer now, as if the lease had run
        out (the same expiry, journaled alike). Returns how many (0: the lease had run out already)."""
        self.checks.check_lease_id(lease_id)
        return self.answers.once("Release", request_id, lambda: self.apply_release(lease_id), lease_id)
