"""When each waiting call (Dispatch, Collect, Reset) can be answered, and what it answers when the wait ends: its `Poll`."""
from __future__ import annotations

import dataclasses
import threading
from typing import Optional, Protocol, Sequence, Sized

from .leases import Leases
from .shares import PLAIN, BatchShape
from .types import CollectResult, DispatchResult, PromptRef


class Running(Protocol):
    groups: Sized  # the groups in flight


class Admitting(Protocol):
    """What a Dispatch waits on: the calls of the pacer's public face it makes (the Pacer is one)."""

    lock: threading.RLock
    closed: bool
    job_ended: bool
    inflight: Running
    restored: Sized  # the groups kept for continuation

    def check_open(self) -> None: ...
    def admissible_now(self) -> int: ...
    def apply_dispatch(self, candidates: Sequence[PromptRef], request_id: str = "", client_id: str = "",
                       max_continuations: Optional[int] = None, *,
                       max_response_bytes: int = 0) -> DispatchResult: ...


class Collecting(Protocol):
    """What a Collect waits on: the calls of the pacer's public face it makes (the Pacer is one)."""

    lock: threading.RLock
    buffer: Sized  # the pipeline buffer: len() is the groups waiting
    leases: Leases  # its `silences`: how many times each holder was taken as silent

    def check_trainer_step(self, trainer_step: Optional[int]) -> None: ...
    def report_incidents(self) -> None: ...
    def collect_must_attempt(self, trainer_step: Optional[int]) -> bool: ...
    def ready_count(self, num_groups: int, shape: BatchShape, partial: bool = False) -> Optional[int]: ...
    def apply_take(self, count: int, timed_out: bool, request_id: str = "", lease_seconds: float = 0.0,
                   shape: BatchShape = PLAIN, num_groups: int = 0, max_bytes: int = 0, split: Sequence[int] = (),
                   holder: str = "", named_at_grant: bool = False) -> CollectResult: ...


class Assembling(Protocol):
    """What a Reset (or EndJob) waits on: every running group assembled."""

    def reset_ready(self) -> bool: ...


class DispatchPoll:
    """Answered once something is admitted (or at once for a peek); each attempt admits what the window allows.

    A call without candidates that asks for continuations (max_continuations > 0: a worker whose prompts are all
    done) waits for a kept group while any group runs or is kept: a group whose worker dies is kept for
    continuation, and a worker that ended instead would leave it waiting for good (as would one ending while a
    Reset's kept groups wait for the RESUME). With nothing running or kept, none can come: answered."""

    __slots__ = ("_pacer", "_candidates", "_request_id", "_client_id", "_max_continuations", "_max_response_bytes",
                 "_last")

    def __init__(self, pacer: Admitting, candidates: Sequence[PromptRef], request_id: str, client_id: str = "",
                 max_continuations: Optional[int] = None, max_response_bytes: int = 0):
        self._pacer = pacer
        self._candidates = candidates
        self._request_id = request_id
        self._client_id = client_id
        self._max_continuations = max_continuations
        self._max_response_bytes = max_response_bytes
        self._last: Optional[DispatchResult] = None

    def attempt(self) -> Optional[DispatchResult]:
        pacer = self._pacer
        with pacer.lock:
            if self._last is None:  # the first attempt checks the call; a closed pacer refuses it
                pacer.check_open()
                candidates = self._candidates
            else:  # re-validating a large candidate list on every change would stall the loop: only with room
                candidates = self._candidates if pacer.admissible_now() else ()
            result = self._last = pacer.apply_dispatch(candidates, self._request_id, self._client_id,
                                                       self._max_continuations,
                                                       max_response_bytes=self._max_response_bytes)
            ended = result.job_ended  # nothing will ever be admitted: answer now
            if result.admitted_ids or result.continued or ended:
                return result
            if self._candidates or (self._only_continuations() and (result.running or pacer.restored)):
                return None
            return result

    def could_answer(self) -> bool:
        """False only when `attempt` would give None now (see waiting.Poll): no room in the window (for a call
        awaiting continuations: no kept group it could take, while groups run or are kept) and the job not ended.
        Cheap, changes nothing; a raising strategy raises here too, and its waiter is woken."""
        pacer = self._pacer
        with pacer.lock:
            if pacer.job_ended:
                return True
            if self._only_continuations() and not pacer.restored:
                return not pacer.inflight.groups  # none kept: answered once nothing runs
            return pacer.admissible_now() > 0

    def _only_continuations(self) -> bool:
        """No candidates, and kept groups asked for: a worker whose prompts are done (see the class docstring)."""
        return not self._candidates and bool(self._max_continuations)

    def give_up(self) -> DispatchResult:
        pacer = self._pacer
        with pacer.lock:
            if pacer.closed:  # answered because the pacer is going away: nothing will be admitted
                return dataclasses.replace(pacer.apply_dispatch((), self._request_id), paused=True, remaining=0)
            return self._last


class CollectPoll:
    """Answered once the buffer holds the mini-batch asked for (`num_groups`, or a token budget's worth) or a
    rank's share waits; at the deadline, whatever is there with `allow_partial`."""

    __slots__ = ("_pacer", "_num_groups", "_allow_partial", "_request_id", "_lease_seconds", "_shape", "_trainer_step",
                 "_max_bytes", "_holder", "_named_at_grant", "_silences")

    def __init__(self, pacer: Collecting, num_groups: int, allow_partial: bool, request_id: str, lease_seconds: float,
                 shape: BatchShape = PLAIN, trainer_step: Optional[int] = None, max_bytes: int = 0, holder: str = "",
                 named_at_grant: bool = False):
        self._pacer = pacer
        self._num_groups = num_groups
        self._allow_partial = allow_partial
        self._request_id = request_id
        self._lease_seconds = lease_seconds
        self._shape = shape
        self._trainer_step = trainer_step  # None: the trainer does not state its step
        self._max_bytes = max_bytes  # the largest answer the caller takes (0: the server's limit)
        self._holder = holder  # the client whose silence ends the lease too ("": none)
        self._named_at_grant = named_at_grant  # the lease counts as named by the holder at its grant
        self._silences = pacer.leases.silences.get(holder) if holder else None  # the holder taken as silent since?

    def attempt(self) -> Optional[CollectResult]:
        pacer = self._pacer
        with pacer.lock:
            pacer.check_trainer_step(self._trainer_step)  # on every attempt: a Restore may come while it waits
            pacer.report_incidents()  # a raising hook or a refused dirty group fails the trainer's Collect, once
            if self._away():
                return CollectResult([], timed_out=True)
            count = self._ready()
            return None if count is None else self._take(count, False)

    def could_answer(self) -> bool:
        """False only when `attempt` would give None now (see waiting.Poll): cheap, changes nothing."""
        pacer = self._pacer
        with pacer.lock:
            return pacer.collect_must_attempt(self._trainer_step) or self._away() or self._ready() is not None

    def _ready(self) -> Optional[int]:
        """What `attempt` would take now, or None (the caller holds the lock)."""
        if self._shape.plain:  # the common case, without the shape's bookkeeping
            return self._num_groups if len(self._pacer.buffer) >= self._num_groups else None
        return self._pacer.ready_count(self._num_groups, self._shape)

    def give_up(self) -> CollectResult:
        pacer = self._pacer
        with pacer.lock:
            pacer.check_trainer_step(self._trainer_step)
            pacer.report_incidents()
            if self._away():
                return CollectResult([], timed_out=True)
            count = pacer.ready_count(self._num_groups, self._shape)
            if count is not None:
                return self._take(count, False)
            count = pacer.ready_count(self._num_groups, self._shape, partial=True) if self._allow_partial else None
            if count:
                return self._take(count, True)
            return CollectResult([], timed_out=True)

    def _away(self) -> bool:
        """The holder was taken as silent since this Collect came (its leases lapsed): a stopped process's call stays
        open. It is answered at once, empty and timed out, so that the groups the holder held wait for it to come
        back and claim them (Workers.heard_from) instead of going out to it again in an answer it may never read, and
        so that a holder that does come back reads that answer and asks again at once, naming its leases, instead of
        waiting out this call's deadline."""
        return self._holder != "" and self._pacer.leases.silences.get(self._holder) != self._silences

    def _take(self, count: int, timed_out: bool) -> CollectResult:
        return self._pacer.apply_take(count, timed_out, self._request_id, self._lease_seconds, self._shape,
                                      self._num_groups, self._max_bytes, holder=self._holder,
                                      named_at_grant=self._named_at_grant)


class ResetPoll:
    """Answered (True) once every running group holds all its trajectories; False when the wait ends first."""

    __slots__ = ("_pacer",)

    def __init__(self, pacer: Assembling):
        self._pacer = pacer

    def attempt(self) -> Optional[bool]:
        return True if self._pacer.reset_ready() else None

    def give_up(self) -> bool:
        return False
