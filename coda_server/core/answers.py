"""Request-id answers: the one retry mechanism ("answered already: here is that answer" / "remember this answer").

Every operation whose answer the RPC table (coda_client/protocol.py, plain data) marks as remembered
(Dispatch, Submit, Collect, Reset, Resume, Ack, Restore) runs through `AnswerBook.once`
(in-process callers) or `AnswerBook.once_awaited` (the asyncio face), never through code of its own:

* a call whose request_id was answered gets that first answer back, and nothing runs;
* a retry arriving while the first call still runs (asyncio) awaits the first call's answer;
* the final answer of a call is remembered, whether or not it changed anything (a peek, a Collect that
  timed out empty, a Submit of duplicates): a retry always sees what the first call saw. Answers of
  calls that changed nothing are kept in memory and in the next snapshot, but are not journaled (a
  journal event is written only for a change), so after a restart such a retry runs again, harmlessly;
* a call that fails (raises) is not remembered: its retry runs again;
* a call under an answered (or running) request_id whose request differs from the first's in what it asks for
  (`asked`: the call's arguments, summed up by REQUEST_SUMMARIES: the trajectory ids of a Submit, the lease of an
  Ack, ...) is refused (INVALID_ARGUMENT): answering it the first call's answer would drop what it asked for without
  a word. The summaries are kept in memory beside the answers, not in snapshots: after a restart, or for an answer
  a replay rebuilt, a retry is answered without the comparison, as before;
* remembering is idempotent (the first answer stays). The one change that ends in a snapshot, the end of
  a Reset, remembers its answer just before taking it, since the snapshot replaces the Reset's event.

The answers are part of the pacer's state: they are in every snapshot and rebuilt by replay.
"""
from __future__ import annotations

import asyncio
import threading
from collections import OrderedDict
from types import MappingProxyType
from typing import Any, Awaitable, Callable, Mapping, Optional, Sequence, TypeVar

from coda_client.protocol import remembered_methods

from .checks import well_formed_id
from .errors import InvalidArgumentError
from .limits import Limits

R = TypeVar("R")
# Method -> whether its answers carry trajectories (then fewer are kept, and their bytes count).
REMEMBERED_METHODS: Mapping[str, bool] = MappingProxyType(remembered_methods())
ANSWERED_METHODS = tuple(REMEMBERED_METHODS)
# What a call asks for, as REQUEST_SUMMARIES sums its arguments up for the comparison with a retry: (field name,
# value) pairs.
Request = tuple
DATA_METHODS = tuple(method for method, carries_data in REMEMBERED_METHODS.items() if carries_data)


class AnswerBook:
    """The remembered answers of recent mutating calls, by method and request_id, oldest dropped first."""

    def __init__(self, limits: Limits, lock: threading.RLock, check_request_id: Callable[[str], None],
                 methods: Mapping[str, bool] = REMEMBERED_METHODS,
                 retry_checks: Mapping[str, Callable[..., None]] = MappingProxyType({})):
        """`methods`: the remembered methods -> whether their answers carry trajectories (the RPC table's).
        `retry_checks`: method -> a check run, under the lock, with the arguments of a retry about to be answered
        from memory: what the summaries cannot afford to compare on every call (a Submit's content) is compared
        there, on the rare retry only; it raises to refuse the retry."""
        self._retry_checks = retry_checks
        self._lock = lock  # the pacer's lock: answers change together with the state they answer for
        self._check_request_id = check_request_id  # says what is wrong with an id that is not well formed
        self._id_limit = limits.max_opaque_id_length  # the usual well-formed id is told here, without that call
        self._answers: dict[str, OrderedDict] = {method: OrderedDict() for method in methods}
        self._kept = {method: limits.data_answers_kept if carries_data else limits.answers_kept
                      for method, carries_data in methods.items()}
        # The trajectories of remembered Collect and Reset answers stay in memory with them (a Collect that
        # took them without a lease is their only holder): beyond this many bytes the oldest are forgotten,
        # the newest answer always kept (its retry is the likely one).
        self._byte_budget = limits.remembered_answer_bytes
        self._bytes = {method: 0 for method, carries_data in methods.items() if carries_data}
        self._running: dict[tuple[str, str], Optional[asyncio.Future]] = {}  # calls under way, see once_awaited
        # What each answered or running call asked for (its Request), by method and request_id: a retry must ask the
        # same. Dropped with its answer, or when its call fails.
        self._requests: dict[str, dict[str, Request]] = {method: {} for method in methods}

    def of(self, method: str) -> Mapping[str, Any]:
        """The remembered answers of `method`, by request_id: read-only and live."""
        return MappingProxyType(self._answers[method])

    def under_way(self, method: str, request_id: str) -> bool:
        """A call of `method` with this request_id is running now (`once_awaited`): a retry must await it."""
        return (method, request_id) in self._running

    def once(self, method: str, request_id: str, call: Callable[[], R], *asked: Any) -> R:
        """In-process callers: the remembered answer of `request_id`, else `call()`'s, remembered. `asked`: the
        call's arguments, which a retry under the same request_id must repeat (see the module docstring)."""
        if not request_id:
            return call()
        if not well_formed_id(request_id, self._id_limit):
            self._check_request_id(request_id)
        request = _summary(method, asked)
        with self._lock:
            answers = self._answers[method]
            answer = answers.get(request_id)
            if answer is not None:
                self._check_same_request(method, request_id, request)
                self._check_retry(method, asked)
                return answer
            result = self._noting_request(method, request_id, request, call)
            self._keep(method, answers, request_id, result)  # remember(), under the lock already held
            return result

    async def once_awaited(self, method: str, request_id: str, call: Callable[[], Awaitable[R]], *asked: Any,
                           outlives_caller: bool = False) -> R:
        """The asyncio face: as `once`, and a retry arriving while the first call runs awaits its answer.

        The future such a retry awaits is made by the first retry, not by every call: most calls finish
        without a retry arriving, and many (a Dispatch that does not wait) without ever suspending.
        `outlives_caller`: the call runs to its end even if its caller goes away (a Reset: half done, it would
        leave dispatch paused for good), and its answer is remembered when it ends, for the caller's retry.
        """
        if not request_id:
            return await (asyncio.shield(asyncio.ensure_future(call())) if outlives_caller else call())
        if not well_formed_id(request_id, self._id_limit):
            self._check_request_id(request_id)
        request = _summary(method, asked)
        answer = self._answers[method].get(request_id)  # a single dict read is atomic: no lock to see it
        if answer is not None:
            self._check_same_request(method, request_id, request)
            if method in self._retry_checks:
                with self._lock:
                    self._check_retry(method, asked)
            return answer
        key = (method, request_id)
        running = self._running
        if key in running:
            self._check_same_request(method, request_id, request)
            shared = running[key]
            if shared is None:
                shared = running[key] = asyncio.get_running_loop().create_future()
            return await asyncio.shield(shared)
        if request:
            self._requests[method][request_id] = request
        if outlives_caller:
            # The call's own task is what retries await: it stays under way (and in `running`) when the
            # first caller goes away, so a retry waits for its answer instead of starting it a second time.
            task = running[key] = asyncio.ensure_future(call())
            task.add_done_callback(lambda done: self._settle_detached(method, request_id, key, done))
            return await asyncio.shield(task)
        running[key] = None
        try:
            result = await call()
        except BaseException as exc:
            self._requests[method].pop(request_id, None)
            shared = running.pop(key)
            if shared is not None:
                shared.set_exception(exc)
                shared.exception()  # mark retrieved: the retries may be gone
            raise
        self.remember(method, request_id, result)
        shared = running.pop(key)
        if shared is not None:
            shared.set_result(result)
        return result

    def _remember_outcome(self, method: str, request_id: str, done: asyncio.Future) -> None:
        if not done.cancelled() and done.exception() is None:
            self.remember(method, request_id, done.result())
        else:
            self._requests[method].pop(request_id, None)

    def _noting_request(self, method: str, request_id: str, request: Request, call: Callable[[], R]) -> R:
        """`call()`, with `request` noted as what `request_id` asked for while it runs and once it is answered."""
        if not request:
            return call()
        requests = self._requests[method]
        requests[request_id] = request
        try:
            return call()
        except BaseException:
            requests.pop(request_id, None)
            raise

    def _check_same_request(self, method: str, request_id: str, request: Request) -> None:
        """Refuse a call that reuses the request_id of an earlier one which asked for something else."""
        first = self._requests[method].get(request_id)
        if not first or not request or first == request:
            return
        names = [name for (name, was), (_, now) in zip(first, request) if was != now] or [name for name, _ in request]
        raise InvalidArgumentError(
            f"{method} refused, nothing done: request_id {request_id!r} was used by an earlier {method} that asked for "
            f"other {', '.join(names)}; a retry must repeat its call as it was (it then gets the first call's "
            f"answer), and a new call needs a new request_id",
            violations=[("request_id", f"already used by a {method} with other {', '.join(names)}")])

    def _check_retry(self, method: str, asked: tuple) -> None:
        check = self._retry_checks.get(method)
        if check is not None and asked:
            check(*asked)

    def _settle_detached(self, method: str, request_id: str, key: tuple[str, str], done: asyncio.Future) -> None:
        """A detached call ended: remember its answer (a failure is not remembered), then let retries run anew."""
        self._remember_outcome(method, request_id, done)
        self._running.pop(key, None)

    def remember(self, method: str, request_id: str, result: Any) -> None:
        """Keep `result` as the answer to `request_id` (an empty one is never kept); the first answer stays."""
        if not request_id:
            return
        with self._lock:
            self._keep(method, self._answers[method], request_id, result)

    def _keep(self, method: str, answers: OrderedDict, request_id: str, result: Any) -> None:
        """`remember` under the lock, `answers` being `method`'s."""
        if request_id in answers:
            return
        answers[request_id] = result
        kept = self._kept[method]
        if method in self._bytes:
            self._bytes[method] += _trajectory_bytes(result)
            while len(answers) > kept or (
                    self._byte_budget and len(answers) > 1 and self._bytes[method] > self._byte_budget):
                self._dropped(method, *answers.popitem(last=False))
        else:  # answers without trajectories: bounded by their count alone (no bytes to count down)
            while len(answers) > kept:
                self._dropped(method, *answers.popitem(last=False))

    def remembered_bytes(self) -> int:
        """Trajectory bytes of the remembered Collect and Reset answers."""
        with self._lock:
            return sum(self._bytes.values())

    def _dropped(self, method: str, request_id: str, answer: Any) -> None:
        self._requests[method].pop(request_id, None)
        if method in self._bytes:
            self._bytes[method] -= _trajectory_bytes(answer)

    def forget(self, method: str, matches: Callable[[Any], bool]) -> None:
        """Drop the remembered answers of `method` that `matches` (a retry of them then runs again)."""
        with self._lock:
            answers = self._answers[method]
            for request_id in [r for r, answer in answers.items() if matches(answer)]:
                self._dropped(method, request_id, answers.pop(request_id))

    def export(self) -> dict[str, list]:
        with self._lock:
            return {method: list(answers.items()) for method, answers in self._answers.items()}

    def restore(self, exported: Mapping[str, list]) -> None:
        with self._lock:
            for method, items in exported.items():
                self._answers[method].update(items)
            for method in self._bytes:
                self._bytes[method] = sum(map(_trajectory_bytes, self._answers[method].values()))


# What each remembered call asks for, summed up from its arguments for `once`'s comparison with a retry: only what a
# retry repeats, never a wait or a deadline (a client retrying may send what is left of them), nor the answer size a
# receiver takes. Made only for a call with a request_id.

def _dispatch(candidates: Sequence[Any] = (), max_continuations: Optional[int] = None) -> Request:
    return ("candidates", tuple(c.prompt_id for c in candidates)), ("max_continuations", max_continuations)


def _submit(trajectories: Sequence[Any], dispatch_seqs: Optional[Mapping[str, int]]) -> Request:
    # The count and the first and last trajectory ids tell another batch: every Submit pays for this, and a tuple of
    # every id cost 460 instructions a trajectory (a third of a percent of a Submit's). The fences are copied: an
    # in-process caller may change its mapping after.
    ids = (len(trajectories), trajectories[0].trajectory_id, trajectories[-1].trajectory_id) if trajectories else ()
    return ("trajectories", ids), ("dispatch_seqs", dict(dispatch_seqs) if dispatch_seqs else None)


def _collect(num_groups: int, allow_partial: bool, lease_seconds: float, shape: Any) -> Request:
    return (("num_groups", num_groups), ("allow_partial", allow_partial), ("lease", lease_seconds > 0),
            ("token_budget, rank and world_size", shape))


def _lease(lease_id: str) -> Request:
    return (("lease_id", lease_id),)


def _reset(mode: Any, resume: bool, weight_version: Optional[int]) -> Request:
    return ("mode", mode), ("resume", resume), ("weight_version", weight_version)


def _resume(weight_version: int) -> Request:
    return (("weight_version", weight_version),)


def _end_job(mode: Any) -> Request:
    return (("mode", mode),)


def _restore(blob: bytes) -> Request:
    return (("checkpoint", hash(blob)),)


REQUEST_SUMMARIES: Mapping[str, Callable[..., Request]] = MappingProxyType({
    "Dispatch": _dispatch, "Submit": _submit, "Collect": _collect, "Ack": _lease, "Release": _lease, "Reset": _reset,
    "Resume": _resume, "EndJob": _end_job, "Restore": _restore})


def _summary(method: str, asked: tuple) -> Request:
    """What a call of `method` with these arguments asks for (none given: nothing to compare)."""
    return REQUEST_SUMMARIES[method](*asked) if asked else ()


def _trajectory_bytes(answer: Any) -> int:
    measure = getattr(answer, "trajectory_bytes", None)
    return measure() if measure is not None else 0
