"""RolloutWorker and AsyncRolloutWorker: the generation-worker loop between a pacer and an inference engine.

The loop every fully-async RL job needs, so its users do not write it again:

* long-poll **Dispatch** with candidate prompts from a `PromptSource` (restored groups the server
  re-offers come first, with their partial trajectories, and are continued from where they stopped);
* generate the `N` trajectories of each admitted group concurrently on the engine, and **Submit** each
  as it ends (a request id per call; UNAVAILABLE is retried with the same id, so nothing applies twice);
* follow **WatchControl**: PAUSE with ABORT aborts this worker's engine requests and submits what they
  have as ABORTED, with the partial tokens; PAUSE with WAIT lets them finish; RESUME records the new
  weight version (and calls `on_resume`); SHUTDOWN (a restart) stops dispatch until the server is back,
  keeping what it holds; JOB_ENDED (the trainer's EndJob) aborts (ABORT) or finishes (WAIT) what it holds,
  submits it and returns;
* keep the in-flight leases of its groups alive (KeepAlive) while it generates, so a slow group is
  never reclaimed from a live worker;
* log progress and errors in the service's log style (logger `coda_worker`, figures as
  `extra={"fields": ...}`, which the server's JSON formatter writes as keys).

What the server acknowledged is the server's: a worker that crashes loses nothing acknowledged. Its
unfinished groups run out of their in-flight lease and come back, partial data included, at the next
Reset (`expired`).

Each trajectory records the weight version of every segment it was generated in
(`segment_lengths`, `segment_weight_versions`), so a trainer can mask the tokens of older versions. The
version a segment is tagged with is the one its engine reports loaded (`loaded_weight_version()`, asked at
start and at every RESUME, and again before each request while it lags the pacer's), not the one RESUME
announced: an engine whose weight sync has not happened yet generates, and is tagged, under its old
weights. An engine that cannot report its version is taken to serve the pacer's.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import inspect
import itertools
import logging
import math
import numbers
import os
import re
import signal
import threading
import time
import uuid
from collections import deque
from collections.abc import Awaitable, Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any, Protocol, Union, runtime_checkable

import grpc

from coda_client import _tls
from coda_client._calls import estimated_submit_bytes
from coda_client._outage import OutageLog
from coda_client.client import AsyncPacerClient
from coda_client.protocol import LOONGSAGE_PROMPT_ID
from .engines.base import (DEFAULT_GENERATE_TIMEOUT_SECONDS, AsyncEngine, Engine, EngineError, EngineUnreachableError,
                           FinishReason, Generation, GenerationRequest, SamplingParams)
from coda_client.errors import (
    BadRequestError,
    DeadlineExceededError,
    FailedPreconditionError,
    PacerClientError,
    refuses_for_now,
    ResourceExhaustedError,
    UnavailableError,
    UnknownPromptError,
)
from coda_client.types import (
    ControlEvent,
    PromptCursor,
    ControlEventType,
    PromptRef,
    ResetMode,
    Trajectory,
    TrajectoryGroup,
    TrajectoryStatus,
)

__all__ = [
    "Prompt",
    "PromptSource",
    "ListPromptSource",
    "RolloutWorker",
    "AsyncRolloutWorker",
    "WorkerStats",
    "RewardFn",
    "trajectory_id_of",
]

logger = logging.getLogger("coda_worker")
# ListPromptSource's own lines (a child: the same handlers), so a job that knowingly runs prompts without an index
# can silence that warning alone.
prompts_logger = logging.getLogger("coda_worker.prompts")

# Figures of a log line, shown as JSON keys by the server's JSON formatter (coda_server.logs.fields).
def _fields(**values: Any) -> dict[str, Any]:
    return {"fields": values}


RewardFn = Callable[["Prompt", Sequence[int]], Union[float, Awaitable[float]]]

# How long one Dispatch long-poll waits for a slot; the worker re-polls, so this only bounds how stale
# its view can get.
DEFAULT_DISPATCH_WAIT_SECONDS = 5.0
# Backoff of the worker's own retries of UNAVAILABLE (after the channel's), while the server restarts.
RETRY_INITIAL_SECONDS = 0.2
RETRY_MAX_SECONDS = 5.0
# How often the worker looks again at why its connection to the pacer fails while it keeps failing (gRPC tries to
# connect again at most every 4 s, coda_client._channel.RECONNECT_BACKOFF_MAX_MS).
CONNECTION_LOOK_SECONDS = 5.0
# An abort can reach the engine before the request it names: aborts are repeated this often until every
# aborted request has answered.
ABORT_REPEAT_SECONDS = 0.5
# How long the worker waits for an engine's answer to an abort it sends alone (of a request past generate_timeout).
ENGINE_ABORT_TIMEOUT_SECONDS = 10.0
# Aborted requests still running this long after the abort: the engine is said not to act on aborts.
ABORT_UNANSWERED_WARN_SECONDS = 30.0
# How long a worker waits for an engine it cannot connect to (at start: it may still be loading its model; later:
# it restarts) before it stops with EngineUnreachableError; how often it asks meanwhile, and says it is waiting.
DEFAULT_ENGINE_WAIT_SECONDS = 600.0
ENGINE_PROBE_SECONDS = (0.5, 5.0)  # first and longest pause between health checks
ENGINE_WAIT_LOG_SECONDS = 30.0
# While the engine reports an older weight version than the pacer's (its sync has not happened yet), it is
# asked again before a request at most this often.
ENGINE_VERSION_RECHECK_SECONDS = 0.2
# Failures in a row of the reward function (none scored between), or of the engine (none generated between, retries
# spent), after which the worker stops: about four groups of 8, so a reward function or an engine that cannot work
# at all (a wrong signature, a wrong API key or model name) stops the worker within its first groups instead of
# turning every prompt into FAILED trajectories, while one that fails now and then only fails those.
DEFAULT_REWARD_FAILURE_LIMIT = 32
DEFAULT_ENGINE_FAILURE_LIMIT = 32
REWARD_ERROR_CHARS = 500  # of a reward function's error, kept in the FAILED trajectory's metadata
REFUSAL_ERROR_CHARS = 500  # of the server's refusal of a malformed Submit, kept in the FAILED stand-ins' metadata
# The Dispatches that admitted groups are said at info level once a minute at most (the first at once), each one at
# debug level: a worker admits about one group each time one of its groups ends, a line per group otherwise.
DISPATCH_LOG_SECONDS = 60.0


class WorkerFailedError(RuntimeError):
    """The worker could not go on (one of its tasks failed): it stopped, and run() raised this."""


class RewardFunctionError(WorkerFailedError):
    """The reward function failed on reward_failure_limit completed trajectories in a row: the worker stopped."""


class EngineFailedError(WorkerFailedError):
    """The engine failed engine_failure_limit requests in a row (retries spent): the worker stopped."""


class _FailureStreak:
    """Failures in a row of one kind (none succeeding between); `failed()` says when they reach `limit`."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.count = 0

    def failed(self) -> bool:
        self.count += 1
        return self.count >= self.limit

    def succeeded(self) -> None:
        self.count = 0


class _DispatchTally:
    """The groups this worker's Dispatches admitted since it last said so at info level (DISPATCH_LOG_SECONDS)."""

    def __init__(self) -> None:
        self.said_at: float | None = None  # monotonic time of the last info line; None: none yet
        self.groups = self.continued = 0
        self.first_seq: int | None = None

    def add(self, groups: int, continued: int, first_seq: int) -> bool:
        """Counts a Dispatch's admitted groups; True when the tally is due at info level (then `said` resets it)."""
        self.groups += groups
        self.continued += continued
        self.first_seq = first_seq if self.first_seq is None else self.first_seq
        return self.said_at is None or time.monotonic() - self.said_at >= DISPATCH_LOG_SECONDS

    def said(self) -> None:
        self.said_at = time.monotonic()
        self.groups = self.continued = 0
        self.first_seq = None


@dataclass(frozen=True)
class Prompt:
    """A prompt group to generate: its id, its token ids and where it comes from (its buffer priority).

    epoch, index: the prompt's epoch and its position in the epoch's order, unique per ds_index and epoch. The
    server's prompt cursor records admitted prompts by them, so a restarted worker skips what was admitted; a
    prompt without an index (nor a LoongSage-form id) is not recorded and is proposed, and run, again.

    max_tokens: this prompt's response budget, when prompts differ in how long an answer may run (None:
    the worker's `sampling.max_tokens`); like that one, it bounds a trajectory's whole response,
    continuations included.
    """

    prompt_id: str
    input_ids: Sequence[int]
    ds_index: int = 0
    epoch: int | None = None
    index: int | None = None
    max_tokens: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.prompt_id, str) or not self.prompt_id:
            raise ValueError(f"a prompt's id must be a non-empty str, not {self.prompt_id!r}")
        if isinstance(self.input_ids, (str, bytes)) or not hasattr(self.input_ids, "__len__"):
            raise ValueError(f"prompt {self.prompt_id!r}: input_ids must be the prompt's token ids, not "
                             f"{self.input_ids!r}")
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 1):
            raise ValueError(f"prompt {self.prompt_id!r}: max_tokens {self.max_tokens!r} must be an integer >= 1 "
                             "or None (the worker's sampling.max_tokens)")

    def ref(self) -> PromptRef:
        return PromptRef(self.prompt_id, self.ds_index, self.epoch, self.index)


@runtime_checkable
class PromptSource(Protocol):
    """Where a worker's candidate prompts come from.

    `take(count)` hands out up to `count` prompts never handed out before ([] when exhausted);
    `get(prompt_id)` finds any prompt by id, for restored groups the server re-offers, which another
    worker may have started. Prompts a Dispatch did not admit stay with the worker and are proposed
    again; `give_back(prompts)`, when the source has it, takes them back when the worker stops.
    `resume_from(cursor)`, when the source has it, is given the server's prompt cursor (a
    `coda_client.PromptCursor`) when the worker starts and after every Restore: from then on the source
    hands out only prompts the cursor does not list as admitted (see ListPromptSource.resume_from). The
    cursor knows a prompt by its (ds_index, epoch, index), or a LoongSage-form id: one with neither is never
    listed as admitted, so a source of such prompts proposes them all again after a restart.
    """

    def take(self, count: int) -> list[Prompt]: ...

    def get(self, prompt_id: str) -> Prompt: ...


def _cursor_position(prompt: Prompt) -> tuple[int, int, int] | None:
    """(ds_index, epoch, index): where the server's prompt cursor records the prompt once a Dispatch admitted it
    (no epoch counts as epoch 0; no index: its LoongSage-form id `epoch{E}_..._prompt{N}` gives both), or None
    when it has neither an index nor such an id: the cursor does not track it (it keeps no ids, so that it stays
    the size of the gaps, not of the run), and cannot tell a restarted worker that it was admitted."""
    if prompt.index is None:
        match = LOONGSAGE_PROMPT_ID.fullmatch(prompt.prompt_id)
        if match is None:
            return None
        return prompt.ds_index, int(match.group(1)), int(match.group(2))
    return prompt.ds_index, 0 if prompt.epoch is None else prompt.epoch, prompt.index


class _UntrackedPrompts:
    """The prompts of a ListPromptSource (and its shards) the cursor cannot track, said once as a warning when the
    source is first resumed from the cursor: before, a restarted worker re-ran such prompts without a word."""

    EXAMPLES = 3

    def __init__(self, prompt_ids: list[str], total: int) -> None:
        self.count, self.total, self.examples = len(prompt_ids), total, prompt_ids[:self.EXAMPLES]
        self._lock = threading.Lock()  # the workers of a source's shards resume on threads of their own
        self._said = False

    def say_once(self) -> None:
        with self._lock:
            if self._said or not self.count:
                return
            self._said = True
        examples = ", ".join(repr(prompt_id) for prompt_id in self.examples)
        prompts_logger.warning(
            "ListPromptSource: %d of its %d prompts carry no index (nor a LoongSage-form id), e.g. %s, so the "
            "server's prompt cursor cannot track them: a worker restarted on these prompts cannot skip those a "
            "Dispatch already admitted and runs them again (the server admits again those it no longer holds: "
            "prompts already trained are trained twice), and after a checkpoint Restore all of them are proposed "
            "again. Give each Prompt its epoch and index (its position in the epoch's order): "
            "Prompt(prompt_id, input_ids, epoch=e, index=i)", self.count, self.total,
            examples + (", ..." if self.count > len(self.examples) else ""),
            extra=_fields(untracked_prompts=self.count, prompts=self.total))


class ListPromptSource:
    """A PromptSource over prompts in memory, shared safely by the workers of one process.

    `shard(index, count)` gives worker `index` of `count` every count-th prompt to take, while `get`
    still finds every prompt (a restored group may have been started by any worker).

    Give each prompt its epoch and index (`Prompt(id, tokens, epoch=e, index=i)`, its position in the epoch's
    order), unique per data source and epoch: the server's prompt cursor, which a restarted worker resumes from,
    knows prompts by them. A source with prompts that have neither (nor a LoongSage-form id) says so in a warning
    the first time a worker resumes it, as a restarted worker re-runs those already admitted; two prompts at one
    (ds_index, epoch, index) are refused, as one of them would be skipped once the other was admitted.
    """

    def __init__(self, prompts: Iterable[Prompt]) -> None:
        self._all: dict[str, Prompt] = {}
        positions: dict[tuple[int, int, int], str] = {}
        untracked: list[str] = []
        for i, prompt in enumerate(prompts):
            if not isinstance(prompt, Prompt):
                raise TypeError(f"ListPromptSource takes Prompt values, e.g. Prompt('p0', [1, 2, 3]); item {i} is "
                                f"{prompt!r} ({type(prompt).__name__})")
            if not len(prompt.input_ids):  # (a worker's own stand-in for a prompt it cannot find has none)
                raise ValueError(f"prompt {prompt.prompt_id!r} has no token ids: engines refuse an empty prompt")
            if prompt.prompt_id in self._all:
                raise ValueError(f"prompt id {prompt.prompt_id!r} appears twice")
            position = _cursor_position(prompt)
            if position is None:
                untracked.append(prompt.prompt_id)
            elif position in positions:
                ds_index, epoch, index = position
                raise ValueError(f"prompts {positions[position]!r} and {prompt.prompt_id!r} are both at ds_index "
                                 f"{ds_index}, epoch {epoch}, index {index}: the prompt cursor knows a prompt by "
                                 f"these, so once one was admitted a restarted worker would skip the other; give "
                                 f"each prompt of an epoch its own index")
            else:
                positions[position] = prompt.prompt_id
            self._all[prompt.prompt_id] = prompt
        self._order: list[Prompt] = list(self._all.values())  # this source's prompts, in the order handed out
        self._queue: deque[Prompt] = deque(self._order)
        self._lock = threading.Lock()
        self._synced_restores: int | None = None  # the cursor's `restores` this source last resumed from
        self._untracked = _UntrackedPrompts(untracked, len(self._all))  # shared with its shards

    def __len__(self) -> int:
        with self._lock:
            return len(self._queue)

    def take(self, count: int) -> list[Prompt]:
        with self._lock:
            return [self._queue.popleft() for _ in range(min(count, len(self._queue)))]

    def give_back(self, prompts: Sequence[Prompt]) -> None:
        with self._lock:
            self._queue.extendleft(reversed(list(prompts)))

    def resume_from(self, cursor: PromptCursor) -> int:
        """Hand out, from now on, this source's prompts (in order) that the server's prompt cursor does not
        list as admitted: after a restart, what was dispatched is not proposed again; after a Restore, the
        prompts in flight at the checkpoint and those admitted since are. Applied once per `cursor.restores`
        (the workers sharing a source each call it). Returns how many prompts are left to hand out.

        Prompts without an index (nor a LoongSage-form id) are not in the cursor: they are all handed out
        again, admitted or not; the first call says so in a warning (see the class)."""
        self._untracked.say_once()
        with self._lock:
            if self._synced_restores != cursor.restores:
                self._synced_restores = cursor.restores
                self._queue = deque(p for p in self._order
                                    if not cursor.admitted(p.prompt_id, p.ds_index, p.epoch, p.index))
            return len(self._queue)

    def get(self, prompt_id: str) -> Prompt:
        try:
            return self._all[prompt_id]
        except KeyError:
            raise KeyError(f"prompt {prompt_id!r} is not in this source") from None

    def shard(self, index: int, count: int) -> ListPromptSource:
        """Worker `index` of `count`: takes every count-th prompt, finds all of them."""
        if not 0 <= index < count:
            raise ValueError(f"shard index {index} must be in 0..{count - 1}")
        shard = ListPromptSource([])
        shard._all, shard._untracked = self._all, self._untracked
        with self._lock:
            shard._order = [p for i, p in enumerate(self._queue) if i % count == index]
            shard._queue = deque(shard._order)
        return shard


def _check_count(name: str, value: Any, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} {value!r} must be an integer >= {minimum}")


def _check_seconds(name: str, value: Any, *, positive: bool) -> None:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not (value > 0 if positive else value >= 0):
        raise ValueError(f"{name} {value!r} must be a number of seconds {'> 0' if positive else '>= 0'}")


def _finite_reward(value: Any) -> float:
    """A reward function's answer as a float; ValueError or TypeError when it is no finite number. The server
    refuses NaN and inf in a Submit, and that refusal would take the group's valid trajectories with it; a str is
    refused though float() parses one ("nan" among them): a verifier that returns text has a bug."""
    if isinstance(value, (str, bytes)):
        raise TypeError(f"it returned {value!r} ({type(value).__name__}); a reward must be a finite number")
    reward = float(value)  # bool, int, NumPy and torch scalars convert; None and other objects raise TypeError
    if not math.isfinite(reward):
        raise ValueError(f"it returned {reward!r}; a reward must be a finite number")
    return reward


def default_worker_id() -> str:
    """A worker id unique on this machine and run: worker-PID-random."""
    return f"worker-{os.getpid()}-{uuid.uuid4().hex[:6]}"


def trajectory_id_of(prompt_id: str, index: int) -> str:
    """The id of a group's `index`-th trajectory: stable, so a continued trajectory keeps its id."""
    return f"{prompt_id}#{index}"


@dataclass
class WorkerStats:
    """What one worker did; `as_dict()` for logs and summaries."""

    groups_started: int = 0
    groups_continued: int = 0  # restored groups taken back from the server and continued
    groups_done: int = 0  # every trajectory acknowledged (or refused as stale)
    groups_given_up: int = 0  # not all acknowledged when stop()'s grace ran out: left to the server's lease
    trajectories_submitted: int = 0  # acknowledged by the server
    trajectories_aborted: int = 0  # submitted as ABORTED (at a PAUSE with ABORT)
    trajectories_continued: int = 0  # ABORTED trajectories this worker continued after a Reset
    trajectories_failed: int = 0  # the engine or the reward function failed them (submitted as FAILED)
    trajectories_refused: int = 0  # refused by the server (stale generation, lease ran out): not acknowledged
    # Not acknowledged when stop()'s grace ran out (still generating, their Submit unanswered or pushed back): given
    # up, the server reclaims their groups by lease. Not "refused": the server refused nothing.
    trajectories_given_up: int = 0
    trajectories_too_large: int = 0  # larger than a message may be: submitted as FAILED, saying why
    # Of a group whose Submit the server refused as malformed (INVALID_ARGUMENT): acknowledged as FAILED stand-ins
    # saying why (the refused ones sent once more, the rest of the group as it ended), so the group completes.
    trajectories_failed_after_refusal: int = 0
    tokens_generated: int = 0
    submit_calls: int = 0
    submit_retries: int = 0
    dispatch_calls: int = 0
    keepalive_calls: int = 0
    engine_aborts: int = 0
    reward_errors: int = 0  # calls of the reward function that raised or gave no finite number (None, a str, NaN, inf)

    def as_dict(self) -> dict[str, int]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


class _Traj:
    """One trajectory being generated: the response so far and its segments (length, weight version)."""

    __slots__ = ("trajectory_id", "token_ids", "logprobs", "segments", "status", "finish", "start_version",
                 "was_aborted", "done", "failed_after_refusal")

    def __init__(self, trajectory_id: str) -> None:
        self.trajectory_id = trajectory_id
        self.token_ids: list[int] = []
        self.logprobs: list[float] = []
        self.segments: list[tuple[int, int]] = []
        self.status = TrajectoryStatus.UNSPECIFIED
        self.finish: FinishReason | None = None
        self.start_version: int | None = None
        self.was_aborted = False  # came back ABORTED from an earlier generation
        self.done = False  # nothing left to generate (an earlier COMPLETED or FAILED answer)
        self.failed_after_refusal = False  # sent as a FAILED stand-in: its group's Submit was refused as malformed

    @classmethod
    def resumed(cls, t: Trajectory) -> _Traj:
        """A trajectory a restored group brought back: continue it unless it had ended."""
        traj = cls(t.trajectory_id)
        traj.token_ids = list(t.token_ids)
        traj.logprobs = list(t.logprobs)
        lengths, versions = list(t.segment_lengths), list(t.segment_weight_versions)
        if lengths and len(lengths) == len(versions) and sum(lengths) == len(traj.token_ids):
            traj.segments = list(zip(lengths, versions))
        elif traj.token_ids:  # written without segments: one segment, at the version it ended with
            traj.segments = [(len(traj.token_ids), t.end_weight_version)]
        traj.start_version = t.start_weight_version if traj.token_ids else None
        traj.was_aborted = t.status == TrajectoryStatus.ABORTED
        traj.done = not traj.was_aborted
        traj.status = TrajectoryStatus(t.status) if t.status in (1, 2, 3) else TrajectoryStatus.FAILED
        traj.finish = FinishReason.parse(t.metadata.get("finish_reason", "stop")) if traj.done else None
        return traj

    def add(self, token_ids: Sequence[int], logprobs: Sequence[float], version: int) -> None:
        if not token_ids:
            return
        if self.start_version is None:
            self.start_version = version
        self.token_ids.extend(token_ids)
        self.logprobs.extend(logprobs if logprobs else [float("nan")] * len(token_ids))
        if self.segments and self.segments[-1][1] == version:
            self.segments[-1] = (self.segments[-1][0] + len(token_ids), version)
        else:
            self.segments.append((len(token_ids), version))


class _Group:
    """A dispatched group this worker works on, in the reset generation it was admitted in."""

    def __init__(self, prompt: Prompt, generation: int, trajectories: list[_Traj], continued: bool,
                 seq: int | None = None) -> None:
        self.prompt = prompt
        self.generation = generation
        self.seq = seq  # the dispatch seq it was handed out under: the fence its Submits and KeepAlives carry
        self.trajectories = trajectories
        self.continued = continued
        self.abort_requested = False
        self.unacknowledged = len(trajectories)
        self.given_up = False  # some of it was not acknowledged when stop()'s grace ran out
        # The server's message when it refused a Submit of this group as malformed (INVALID_ARGUMENT): the rest of
        # the group is submitted as FAILED stand-ins carrying it.
        self.refusal: str | None = None
        self.task: asyncio.Task | None = None
        # Its trajectories in Submits sent and not answered yet: when they are all it has left, the server may have
        # completed the group already, and a KeepAlive crossing that Submit names it as no longer in flight.
        self.submitting = 0


class _ThreadedEngine:
    """A blocking Engine driven from asyncio: its calls run on a pool of threads."""

    def __init__(self, engine: Engine, threads: int) -> None:
        self._engine = engine
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=threads, thread_name_prefix="coda-engine")

    async def generate(self, request: GenerationRequest) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._pool, self._engine.generate, request)

    async def abort(self, request_ids: Sequence[str]) -> None:
        await asyncio.get_running_loop().run_in_executor(self._pool, self._engine.abort, list(request_ids))

    def __getattr__(self, name: str) -> Any:
        """The optional calls the worker asks for when the engine has them, run on the pool."""
        if name not in ("loaded_weight_version", "ready") or not hasattr(self._engine, name):
            raise AttributeError(name)
        call = getattr(self._engine, name)

        async def on_the_pool() -> Any:
            return await asyncio.get_running_loop().run_in_executor(self._pool, call)
        return on_the_pool

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


_CANDIDATE_FIELD = re.compile(r"^candidates\[(\d+)\]")
# gRPC's own refusal of a message over its limit, on either side ("Sent/Received message larger than max").
_MESSAGE_LIMIT = re.compile(r"message larger than max", re.IGNORECASE)


class _TooLarge(Exception):
    """A Submit larger than the server takes (gRPC's message limit): sent again, it would fail again."""

    def __init__(self, details: str) -> None:
        super().__init__(details)
        self.limit_text = f"the server's message limit ({details})"


class _GivenUp(Exception):
    """A Submit the worker stopped trying when stop()'s grace ran out, nothing acknowledged; says what the pacer
    last did (answered nothing, or kept pushing back): the server still holds its groups and reclaims them by
    their in-flight lease, so these are given up, not refused."""



class AsyncRolloutWorker:
    """The rollout loop on asyncio. `await worker.run()` works until the source is exhausted (and every
    group it started is acknowledged, and, with continue_restored, no group runs or is kept anywhere in the job
    that could come to it to continue) or `stop()` is called; returns WorkerStats. A server's SHUTDOWN (a
    restart, a rolling update) does not end it: it stops dispatching, keeps generating and submitting what
    it holds (retrying while the server is away), and dispatches again once the server is back.

    pacer: an AsyncPacerClient (the worker does not close it). engine: an AsyncEngine (e.g. VLLMEngine).
    source: a PromptSource. sampling: SamplingParams of every trajectory. reward: optional
    `reward(prompt, response_token_ids) -> float` (or a coroutine) for completed trajectories; a call that raises
    (or gives no finite number: None, a str, NaN, inf) makes its trajectory FAILED, the error in its metadata
    ("error") and the log, and the others go on; reward_failure_limit such failures in a row, none scored between, stop the worker and
    run() raises RewardFunctionError (a reward function that cannot run at all would otherwise turn every prompt
    of the source into FAILED trajectories); so do engine_failure_limit requests in a row that the engine failed
    (retries spent; EngineFailedError).
    max_groups: groups this worker generates at once. on_resume: optional callback (or coroutine)
    `on_resume(weight_version)` run at RESUME before dispatching again, e.g. to load the new weights
    (when the trainer does not sync the engines itself). Segments are tagged with the version the engine
    reports loaded when it has `loaded_weight_version()` (see the module docstring).
    continue_restored: take restored groups the server re-offers and continue them (default True).
    keepalive_seconds: how often the in-flight leases of running groups are renewed (None: a third of
    the server's lease, as the server reports it). engine_retries: how often a failed engine call is
    retried before the trajectory is submitted as FAILED. generate_timeout: the longest one generate call may take
    (3600 s, the shipped adapters' HTTP timeout; None: no bound of the worker's own): past it the request is aborted
    on the engine and fails as any engine error does (retried, then FAILED), so an engine that stops answering
    cannot hold its group, and the trainer's mini-batch, for ever. engine_wait: how long the worker waits for an
    engine it cannot connect to (EngineUnreachableError), at start and whenever a request finds it gone, dispatching nothing
    meanwhile (its running groups keep their leases and their requests are sent again once it answers); after
    that run() stops and raises EngineUnreachableError. shutdown_grace: seconds calls keep being retried
    after `stop()` while the server is unreachable (then what is left is dropped, and run() returns), and the
    longest `stop()` waits for running groups to be acknowledged.
    on_submitted: optional callback with the trajectories of each acknowledged Submit (metrics, audit).
    worker_id: the worker's name (default: the client's client_id, else a generated one); a client without a
    client_id is named after it, so the server's ListWorkers, logs and liveness watch show it.
    """

    def __init__(
        self,
        pacer: AsyncPacerClient,
        engine: AsyncEngine,
        source: PromptSource,
        *,
        sampling: SamplingParams | None = None,
        reward: RewardFn | None = None,
        max_groups: int = 4,
        worker_id: str | None = None,
        dispatch_wait: float = DEFAULT_DISPATCH_WAIT_SECONDS,
        on_resume: Callable[[int], Any] | None = None,
        continue_restored: bool = True,
        keepalive_seconds: float | None = None,
        engine_retries: int = 1,
        engine_wait: float = DEFAULT_ENGINE_WAIT_SECONDS,
        generate_timeout: float | None = DEFAULT_GENERATE_TIMEOUT_SECONDS,
        shutdown_grace: float = 10.0,
        on_submitted: Callable[[list[Trajectory]], Any] | None = None,
        reward_failure_limit: int = DEFAULT_REWARD_FAILURE_LIMIT,
        engine_failure_limit: int = DEFAULT_ENGINE_FAILURE_LIMIT,
    ) -> None:
        # Checked here, before any call: each of these failed only in run(), with an error naming none of them.
        if not callable(getattr(pacer, "dispatch", None)) or not inspect.iscoroutinefunction(pacer.dispatch):
            if pacer is not None:  # None: made to be looked at, never run (tests)
                raise TypeError(f"pacer must be an AsyncPacerClient, not {type(pacer).__name__}; a blocking worker "
                                f"takes the address instead: RolloutWorker(target, engine, source, ...)")
        if isinstance(engine, type) or not callable(getattr(engine, "generate", None)):
            raise TypeError(f"engine must be an engine object with generate(), e.g. FakeEngine() or "
                            f"VLLMEngine(url), not {engine!r}")
        if not (callable(getattr(source, "take", None)) and callable(getattr(source, "get", None))):
            raise TypeError(f"source must be a PromptSource (take and get), e.g. ListPromptSource(prompts), not "
                            f"{type(source).__name__}")
        # A float count or a non-positive interval would fail, or spin, mid-run.
        _check_count("max_groups", max_groups, 1)
        _check_count("engine_retries", engine_retries, 0)
        _check_count("reward_failure_limit", reward_failure_limit, 1)
        _check_count("engine_failure_limit", engine_failure_limit, 1)
        _check_seconds("dispatch_wait", dispatch_wait, positive=True)
        _check_seconds("engine_wait", engine_wait, positive=False)
        if generate_timeout is not None:
            _check_seconds("generate_timeout", generate_timeout, positive=True)
        _check_seconds("shutdown_grace", shutdown_grace, positive=False)
        if keepalive_seconds is not None:
            _check_seconds("keepalive_seconds", keepalive_seconds, positive=True)
        self.pacer = pacer
        self.engine = engine
        self.source = source
        self.sampling = sampling or SamplingParams()
        self.reward = reward
        self.max_groups = max_groups
        # The pacer's client id names this worker to the server (liveness, ListWorkers) when it has one.
        self.worker_id = worker_id or getattr(pacer, "client_id", None) or default_worker_id()
        adopt = getattr(pacer, "adopt_client_id", None)
        if adopt is not None:  # an unnamed client calls as this worker: ListWorkers, logs and liveness show its id
            adopt(self.worker_id)
        self.dispatch_wait = dispatch_wait
        self.on_resume = on_resume
        self.continue_restored = continue_restored
        self.keepalive_seconds = keepalive_seconds
        self.engine_retries = engine_retries
        self.engine_wait = engine_wait
        self.generate_timeout = generate_timeout
        self.shutdown_grace = shutdown_grace
        self.on_submitted = on_submitted
        self.reward_failure_limit = reward_failure_limit
        self.engine_failure_limit = engine_failure_limit
        # The server's outages, logged once each (its calls, its control stream and its keep-alives all fail while
        # it is away, each retried every few seconds).
        self._outage = OutageLog(
            logger, began=f"{self.worker_id}: the pacer at {getattr(pacer, 'target', '?')} is away: {{reason}}; "
                          "retrying its calls (with the same request ids) until it answers; the groups this worker "
                          "holds, if any, go on generating meanwhile",
            attempt=f"{self.worker_id}: the pacer is still away: {{reason}}",
            back=f"{self.worker_id}: the pacer at {getattr(pacer, 'target', '?')} answers again after {{seconds}} s",
            extra=_fields(worker=self.worker_id))
        # Changes the pacer refuses for now while it answers (its state directory cannot be written, it recovers):
        # said apart from an outage, so that a KeepAlive it answers meanwhile does not read as its return.
        self._refusals = OutageLog(
            logger, began=f"{self.worker_id}: the pacer at {getattr(pacer, 'target', '?')} refuses changes for now: "
                          "{reason}; retrying them (with the same request ids) until it takes them; the groups this "
                          "worker holds, if any, go on generating meanwhile",
            attempt=f"{self.worker_id}: the pacer still refuses changes: {{reason}}",
            back=f"{self.worker_id}: the pacer at {getattr(pacer, 'target', '?')} takes changes again after "
                 "{seconds} s",
            extra=_fields(worker=self.worker_id))
        self.stats = WorkerStats()
        self.weight_version = 0
        self.engine_weight_version: int | None = None  # what the engine reports loaded; None: it cannot say
        self._engine_version_asked_at = 0.0  # when the last answer came
        self._engine_question: asyncio.Future | None = None  # the question to the engine out now, if any
        self.generation = 0
        self._group_sizes: list[int] = []
        # By (prompt id, dispatch seq): a prompt the server released from this worker and handed back to it as a
        # continuation runs here twice for a while (the old group's last requests and Submits, and the new one).
        self._groups: dict[tuple[str, int | None], _Group] = {}
        self._pending: deque[Prompt] = deque()  # taken from the source, not admitted yet
        self._requests: dict[str, _Group] = {}  # engine request id -> its group, while the request runs
        self._request_serial = itertools.count()
        self._submit_queue: deque[tuple[_Group, _Traj]] = deque()
        self._submit_wakeup: asyncio.Event | None = None
        self._changed: asyncio.Event | None = None  # a group ended, a control event came, or stop()
        self._paused = False
        self._restores = 0  # Restores the server had made when this worker last heard (ControlEvent.restores)
        self._resync = False  # a Restore happened: the dispatch loop drops its pending prompts, re-reads the cursor
        self._stopping = False
        # Pacer calls waiting for an answer (what each is); the future set at stop(), which ends the calls that only
        # read; and the one set when stop()'s grace runs out, which ends the others, gives up the groups still held
        # and ends back-pressure waits: a call waiting for a server that is not there would otherwise hold stop() for
        # the client's whole timeout.
        self._calls_in_flight: dict[asyncio.Future[Any], str] = {}
        self._stop_asked: asyncio.Future[None] | None = None
        self._grace_over: asyncio.Future[None] | None = None
        # The back-pressure refusal a Submit waits out now, if one does: a give-up at the grace names it as the cause.
        self._pushed_back: ResourceExhaustedError | None = None
        self._stream_up = False  # the control stream's first event (STATE) arrived
        # Set while no control stream delivers events (none yet, or the last one ended): the connection watch says
        # that the pacer is away only then, after what the stream said (a SHUTDOWN comes on it as the server goes).
        self._stream_gone: asyncio.Event | None = None
        self._shutdown_said = False  # the server announced SHUTDOWN and no control event came since
        # Set when the channel (re)connects: the control stream then reconnects at once rather than after its
        # back-off (up to RETRY_MAX_SECONDS), so that the worker hears that the server is back when it is.
        self._connected: asyncio.Event | None = None
        self._staying_logged = False  # said that its prompts are done and it stays for continuations
        self._job_ended = False  # the trainer ended the job (JOB_ENDED): submit what is held, then return
        self._job_mode_said = False  # the end's mode was logged (a Dispatch answer's end does not carry it)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._abort_task: asyncio.Task | None = None
        # The engine could not be reached: since when (None: it answers), the task asking it meanwhile, the event
        # its requests wait on, and the error run() raises once it stayed away for engine_wait.
        self._engine_lost_at: float | None = None
        self._engine_probe: asyncio.Task | None = None
        self._engine_back: asyncio.Event | None = None
        # Why the worker cannot go on (the engine gone for engine_wait, the reward function failing on every
        # trajectory, a helper task that died): run() stops, submits what it holds, and raises it.
        self._failure: Exception | None = None
        self._dispatched = _DispatchTally()
        self._reward_failures = _FailureStreak(reward_failure_limit)
        self._engine_failures = _FailureStreak(engine_failure_limit)

    # ------------------------------------------------------------------ control from outside

    def stop(self) -> None:
        """Ends the loop: no more dispatching; running groups finish and are submitted, within `shutdown_grace`
        seconds: what is not acknowledged by then is given up (logged; the server reclaims those groups when
        their in-flight lease runs out). Thread-safe, and safe at any time: before run(), while it runs, and
        after it ended (then it does nothing)."""
        loop = self._loop
        if loop is not None:
            try:
                loop.call_soon_threadsafe(self._request_stop)
                return
            except RuntimeError:  # the loop closed since (run() ended): nothing left to stop
                pass
        self._stopping = True

    def _request_stop(self) -> None:
        if not self._stopping:
            self._stopping = True
            self._begin_grace()
        self._poke()

    def _begin_grace(self) -> None:
        """stop() on the loop (or run() after an early stop()): calls that only read end now; the others, waiting now
        or made from now on, end when the grace runs out (one answered meanwhile, e.g. a Dispatch that admitted
        groups, is not cut)."""
        assert self._stop_asked is not None and self._grace_over is not None
        _settle(self._stop_asked)
        asyncio.get_running_loop().call_later(self.shutdown_grace, _settle, self._grace_over)

    def _poke(self) -> None:
        if self._changed is not None:
            self._changed.set()

    # ------------------------------------------------------------------ the loop

    async def run(self) -> WorkerStats:
        """Runs the loop until the source is exhausted and nothing runs or is kept that it could continue, `stop()`,
        or the end of the job (JOB_ENDED: what it holds is aborted or finished as the trainer asked, and submitted);
        returns what it did."""
        self._loop = asyncio.get_running_loop()
        self._stop_asked, self._grace_over = self._loop.create_future(), self._loop.create_future()
        if self._stopping:  # stop() came before run()
            self._begin_grace()
        self._changed = asyncio.Event()
        self._submit_wakeup = asyncio.Event()
        self._engine_back = asyncio.Event()
        self._engine_back.set()
        self._stream_gone = asyncio.Event()
        self._stream_gone.set()
        self._connected = asyncio.Event()
        connection = asyncio.create_task(self._watch_connection(), name=f"{self.worker_id}-connection")
        try:
            return await self._run()
        finally:
            connection.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await connection

    async def _run(self) -> WorkerStats:
        state = await self._starting_state()
        if state is None:  # stopped before it started: it holds nothing, so there is nothing to finish or submit
            return self.stats
        await self._engine_ready_at_start()
        self._group_sizes = list(state.group_sizes) or [1]
        self.weight_version, self.generation, self._paused = state.weight_version, state.generation, state.paused
        await self._ask_engine_version()
        await self._resume_source()
        logger.info("%s: started (max %d groups, group sizes %s, weight version %d)", self.worker_id,
                    self.max_groups, self._group_sizes, self.weight_version,
                    extra=_fields(worker=self.worker_id, weight_version=self.weight_version))
        helpers = [asyncio.create_task(self._watch(), name=f"{self.worker_id}-watch"),
                   asyncio.create_task(self._submitter(), name=f"{self.worker_id}-submit"),
                   asyncio.create_task(self._keep_alive(), name=f"{self.worker_id}-keepalive")]
        for task in helpers:
            task.add_done_callback(self._helper_ended)
        try:
            await self._dispatch_loop()
            await self._drain()
        finally:
            for task in helpers:
                task.cancel()
            for task in helpers:
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
            for group in list(self._groups.values()):
                if group.task is not None:
                    group.task.cancel()
            if self._engine_probe is not None:
                self._engine_probe.cancel()
            self._return_pending()
        given_up = (f", {self.stats.groups_given_up} groups given up at stop() ({self.stats.trajectories_given_up} "
                    f"trajectories not acknowledged)" if self.stats.groups_given_up else "")
        logger.info("%s: stopped: %d groups done, %d trajectories acknowledged (%d aborted, %d continued), "
                    "%d tokens%s", self.worker_id, self.stats.groups_done, self.stats.trajectories_submitted,
                    self.stats.trajectories_aborted, self.stats.trajectories_continued, self.stats.tokens_generated,
                    given_up, extra=_fields(worker=self.worker_id, **self.stats.as_dict()))
        if self._failure is not None:
            raise self._failure
        return self.stats

    async def _starting_state(self) -> Any:
        """The pacer's state the worker starts from, or None when stop() came first: before run() (no call is made)
        or while the first GetState was unanswered (the pacer away or slow). A stop is not a failure: run() then
        returns its empty stats; that the pacer never answered is said in the log."""
        if self._stopping:
            logger.info("%s: stopped before it started (stop() before run()); nothing was dispatched", self.worker_id,
                        extra=_fields(worker=self.worker_id))
            return None
        try:
            return await self._retrying("GetState", self.pacer.state, reads_only=True)
        except UnavailableError as exc:
            if self._failure is not None:  # the connection cannot be made as configured (_connection_failing)
                raise self._failure from None
            if not self._stopping:
                raise
            logger.warning("%s: stopped before it started: %s; nothing was dispatched", self.worker_id, exc.details,
                           extra=_fields(worker=self.worker_id))
            return None

    def _helper_ended(self, task: asyncio.Task) -> None:
        """A helper (control stream, submitter, keep-alive) that raised would leave the worker holding its groups
        with nothing to submit or renew them: the worker stops instead, and run() raises."""
        if task.cancelled() or task.exception() is None:
            return
        exc = task.exception()
        error = WorkerFailedError(f"{self.worker_id}: its {task.get_name()} task failed ({type(exc).__name__}: "
                                  f"{exc}); the worker stopped")
        error.__cause__ = exc
        self._fail(error, exc)

    async def _resume_source(self) -> None:
        """Give the source the server's prompt cursor (when it takes one), so it proposes nothing admitted."""
        resume_from = getattr(self.source, "resume_from", None)
        if resume_from is None:
            return
        try:
            cursor = await self._retrying("GetPromptCursor", self.pacer.prompt_cursor, reads_only=True)
        except PacerClientError as exc:
            logger.warning("%s: the prompt cursor could not be read (%s); the source goes on where it is",
                           self.worker_id, exc, extra=_fields(worker=self.worker_id))
            return
        self._restores = max(self._restores, cursor.restores)
        left = resume_from(cursor)
        logger.info("%s: prompt source resumed from the server's cursor (%s prompts left, %d restores)",
                    self.worker_id, left, cursor.restores, extra=_fields(worker=self.worker_id, prompts_left=left))

    async def _dispatch_loop(self) -> None:
        assert self._changed is not None
        while not (self._stopping or self._job_ended):
            self._changed.clear()
            if self._resync:  # here, between this worker's Dispatches: what they admitted is in the cursor
                self._resync = False
                self._pending.clear()  # the source proposes them again if a Dispatch has not admitted them
                await self._resume_source()
                continue
            free = self.max_groups - len(self._groups)
            # Not before the control stream is up: it is how the server knows this worker is one to watch
            # (liveness), and its STATE says whether dispatch is paused.
            if self._paused or free <= 0 or not self._stream_up or self._engine_lost_at is not None:
                await self._changed.wait()
                continue
            while len(self._pending) < free:
                fresh = self.source.take(free - len(self._pending))
                if not fresh:
                    break
                self._pending.extend(fresh)
            candidates = list(self._pending)[:free]
            if not candidates:
                # The source is exhausted. Once nothing runs here, the worker asks for kept groups to continue:
                # the call waits for one while groups run or are kept anywhere (a group whose worker dies is
                # kept, and a worker that ended would leave it waiting for good); with none, the loop ends.
                if self._groups:
                    await self._changed.wait()
                    continue
                if not self.continue_restored:
                    return
                asked = time.monotonic()
                answered = await self._dispatch([], free)
                if answered is None or answered[1]:
                    continue
                if not answered[0].running and not await self._kept_elsewhere():
                    return
                if not self._staying_logged:  # why run() has not returned yet, said once
                    self._staying_logged = True
                    logger.info("%s: its prompts are done; it stays to continue groups released from other workers "
                                "while any runs or is kept (%d running in the job), and ends when none is",
                                self.worker_id, answered[0].running,
                                extra=_fields(worker=self.worker_id, running=answered[0].running))
                # A server that answers such a call at once (an older one) is asked again after dispatch_wait.
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self._changed.wait(), asked + self.dispatch_wait - time.monotonic())
                continue
            # A long-poll: it returns when something was admitted or its wait ended (then it is asked again).
            await self._dispatch(candidates, free)

    async def _kept_elsewhere(self) -> int:
        """Kept groups waiting on the server (GetState): a Reset's, until its RESUME lets them be handed out."""
        try:
            return (await self._retrying("GetState", self.pacer.state, reads_only=True)).restored_kept
        except UnavailableError:  # only raised once the worker is stopping
            return 0

    async def _dispatch(self, candidates: list[Prompt], free: int) -> tuple[Any, list[TrajectoryGroup]] | None:
        """One Dispatch; starts what it admitted. None when the call failed and was dealt with."""
        request_id = str(uuid.uuid4())  # one per proposal: a retry that already landed answers the same
        wants = free if self.continue_restored else 0
        refs = [p.ref() for p in candidates]
        loaded = self._loaded_version_field()
        call = lambda: self.pacer.dispatch(refs, wait=self.dispatch_wait, request_id=request_id,  # noqa: E731
                                           max_continuations=wants, **loaded)
        try:
            result = await self._retrying("Dispatch", call)
        except BadRequestError as exc:
            self._drop_refused_candidates(candidates, exc)
            return None
        except UnavailableError:  # only raised once the worker is stopping
            return None
        self.stats.dispatch_calls += 1
        if result.job_ended:  # the control stream says so too; whichever comes first ends the dispatching
            self._end_of_job(ResetMode.UNSPECIFIED, from_dispatch=True)
        # Whether dispatch is paused is the control stream's to say (PAUSE, RESUME, the STATE on connect): a
        # Dispatch answered just before a RESUME could otherwise pause the worker after it.
        self._observe(result.generation, result.weight_version)
        continuations = result.continuations
        for restored in continuations:
            self._start_continuation(restored, result.generation)
        admitted = set(result.admitted)
        if admitted:
            by_id = {p.prompt_id: p for p in candidates}
            self._pending = deque(p for p in self._pending if p.prompt_id not in admitted)
            for prompt_id, seq in zip(result.admitted, result.seqs):
                self._start_group(by_id[prompt_id], result.generation, seq)
            self._log_dispatched(len(admitted), len(continuations), result)
        elif continuations:
            logger.info("%s: continuing %d restored groups; %d running here", self.worker_id, len(continuations),
                        len(self._groups), extra=_fields(worker=self.worker_id, continued=len(continuations)))
        return result, continuations

    def _log_dispatched(self, admitted: int, continued: int, result: Any) -> None:
        """Each admitting Dispatch at debug level; at info level the first, then what they admitted since, once a
        minute at most."""
        tally = self._dispatched
        if tally.add(admitted, continued, result.seqs[0]):  # the tally since the last info line
            level, groups, continuing, first_seq = logging.INFO, tally.groups, tally.continued, tally.first_seq
            since = "" if tally.said_at is None else f" in {time.monotonic() - tally.said_at:.0f} s"
            tally.said()
        elif logger.isEnabledFor(logging.DEBUG):  # this Dispatch alone
            level, groups, continuing, first_seq, since = logging.DEBUG, admitted, continued, result.seqs[0], ""
        else:
            return
        logger.log(level, "%s: dispatched %d groups%s (seqs %d..%d)%s; %d running here, window R=%d Q=%d C=%d",
                   self.worker_id, groups, since, first_seq, result.seqs[-1],
                   f", continuing {continuing} restored" if continuing else "", len(self._groups),
                   result.running, result.buffered, result.capacity,
                   extra=_fields(worker=self.worker_id, admitted=groups, continued=continuing,
                                 generation=result.generation))

    def _drop_refused_candidates(self, candidates: list[Prompt], exc: BadRequestError) -> None:
        """A Dispatch refused as malformed: drop the candidates it names (all when it names none)."""
        named = {int(m.group(1)) for v in exc.field_violations if (m := _CANDIDATE_FIELD.match(v.field))}
        refused = [c for i, c in enumerate(candidates) if i in named] or candidates
        refused_ids = {p.prompt_id for p in refused}
        self._pending = deque(p for p in self._pending if p.prompt_id not in refused_ids)
        logger.error("%s: Dispatch refused %d candidates, dropped: %s", self.worker_id, len(refused), exc,
                     extra=_fields(worker=self.worker_id, refused=sorted(refused_ids)))

    @property
    def tag_version(self) -> int:
        """The weight version new segments are tagged with: the engine's, when it reports one."""
        return self.engine_weight_version if self.engine_weight_version is not None else self.weight_version

    async def _ask_engine_version(self) -> int | None:
        """Asks the engine which weight version it has loaded (when it can say); keeps the last answer. Callers
        arriving while a question is out wait for its answer rather than tag with the one before it."""
        if self._engine_question is None or self._engine_question.done():
            self._engine_question = asyncio.ensure_future(self._ask_engine_once())
        return await asyncio.shield(self._engine_question)

    async def _ask_engine_once(self) -> int | None:
        ask = getattr(self.engine, "loaded_weight_version", None)
        if ask is None:
            return None
        try:
            value = ask()
            if inspect.isawaitable(value):
                value = await value
        except EngineError as exc:
            logger.warning("%s: could not ask the engine for its weight version: %s", self.worker_id, exc,
                           extra=_fields(worker=self.worker_id))
            return self.engine_weight_version
        finally:
            self._engine_version_asked_at = time.monotonic()
        if value is not None:
            self.engine_weight_version = int(value)
        return self.engine_weight_version

    def _loaded_version_field(self) -> dict[str, int]:
        """Dispatch's and KeepAlive's report of the version the engine has loaded (the server lists it)."""
        if self.engine_weight_version is None:
            return {}
        return {"loaded_weight_version": self.engine_weight_version}

    async def _tag_version(self) -> int:
        """The version to tag a new request's tokens with; asks the engine again while it lags the pacer."""
        if self._engine_question is not None and not self._engine_question.done():
            await asyncio.shield(self._engine_question)
        elif (self.engine_weight_version is not None and self.engine_weight_version < self.weight_version
                and time.monotonic() - self._engine_version_asked_at >= ENGINE_VERSION_RECHECK_SECONDS):
            await self._ask_engine_version()
        return self.tag_version

    def _observe(self, generation: int, weight_version: int) -> None:
        """Takes in the pacer's generation and weight version as a call or event reports them."""
        if weight_version > self.weight_version:
            self.weight_version = weight_version
        if generation > self.generation:
            self.generation = generation
            # Groups of an earlier generation were dropped or restored by a Reset: whatever they still
            # submit is refused as stale, so stop generating for them.
            stale = [g for g in self._groups.values() if g.generation < generation and not g.abort_requested]
            if stale:
                self._request_abort(stale, reason=f"generation {generation} began")

    # ------------------------------------------------------------------ groups and trajectories

    def _group_size(self, ds_index: int) -> int:
        if not 0 <= ds_index < len(self._group_sizes):
            raise ValueError(f"ds_index {ds_index} is not configured on the server (group sizes {self._group_sizes})")
        return self._group_sizes[ds_index]

    def _start_group(self, prompt: Prompt, generation: int, seq: int | None = None) -> None:
        n = self._group_size(prompt.ds_index)
        group = _Group(prompt, generation, [_Traj(trajectory_id_of(prompt.prompt_id, i)) for i in range(n)], False,
                       seq)
        self.stats.groups_started += 1
        self._launch(group)

    def _start_continuation(self, restored: TrajectoryGroup, generation: int) -> None:
        """Continue a group the server kept: restored by a Reset (all N, some ABORTED) or released from a
        worker taken as gone (some of its N, or none): the missing trajectories are generated afresh."""
        try:
            base = self.source.get(restored.prompt_id)
        except KeyError:
            logger.error("%s: restored group %r is not in this worker's prompt source; submitting what it cannot "
                         "continue as FAILED", self.worker_id, restored.prompt_id, extra=_fields(worker=self.worker_id))
            base = Prompt(restored.prompt_id, [], restored.ds_index)
        prompt = Prompt(base.prompt_id, base.input_ids, restored.ds_index, restored.epoch, restored.index,
                        base.max_tokens)
        resumed = {t.trajectory_id: _Traj.resumed(t) for t in restored.trajectories}
        fresh = [_Traj(trajectory_id_of(prompt.prompt_id, i)) for i in range(self._group_size(prompt.ds_index))]
        trajectories = [*resumed.values(), *(t for t in fresh if t.trajectory_id not in resumed)]
        trajectories = trajectories[:max(len(resumed), self._group_size(prompt.ds_index))]
        if not base.input_ids:  # nothing to generate from: the completed ones are submitted as they came; the
            # missing and the aborted ones as FAILED (an aborted one sent back unchanged would keep the group open)
            for traj in trajectories:
                traj.done = True
                if traj.trajectory_id not in resumed or traj.status != TrajectoryStatus.COMPLETED:
                    traj.status = TrajectoryStatus.FAILED
        group = _Group(prompt, generation, trajectories, True, restored.seq)
        self.stats.groups_continued += 1
        self._launch(group)

    def _launch(self, group: _Group) -> None:
        self._groups[group.prompt.prompt_id, group.seq] = group
        group.task = asyncio.create_task(self._run_group(group), name=f"{self.worker_id}-{group.prompt.prompt_id}")

    async def _run_group(self, group: _Group) -> None:
        await asyncio.gather(*(self._run_trajectory(group, traj) for traj in group.trajectories))

    async def _run_trajectory(self, group: _Group, traj: _Traj) -> None:
        attempts = 0
        while not traj.done:
            budget = group.prompt.max_tokens if group.prompt.max_tokens is not None else self.sampling.max_tokens
            remaining = budget - len(traj.token_ids)
            if group.abort_requested:
                traj.status, traj.finish = TrajectoryStatus.ABORTED, FinishReason.ABORT
                break
            if remaining <= 0:
                traj.status, traj.finish = TrajectoryStatus.COMPLETED, FinishReason.LENGTH
                break
            request_id = f"{self.worker_id}-{traj.trajectory_id}-{group.generation}-{next(self._request_serial)}"
            version = await self._tag_version()
            self._requests[request_id] = group
            try:
                generation = await self._generate(GenerationRequest(
                    request_id, [*group.prompt.input_ids, *traj.token_ids], remaining, self.sampling))
            except EngineError as exc:
                unreachable = isinstance(exc, EngineUnreachableError)
                if unreachable and not group.abort_requested and await self._engine_answers_again(exc, group):
                    continue  # the request never reached the engine: sent again, not counted as a failure
                attempts += 1
                if unreachable or attempts > self.engine_retries or group.abort_requested:
                    logger.error("%s: generation of %s failed: %s", self.worker_id, traj.trajectory_id, exc,
                                 extra=_fields(worker=self.worker_id, trajectory_id=traj.trajectory_id))
                    if not (unreachable or group.abort_requested) and self._engine_failures.failed():
                        self._fail(EngineFailedError(
                            f"{self.worker_id}: the engine failed {self._engine_failures.count} requests in a row "
                            f"(engine_failure_limit {self.engine_failure_limit}; each retried engine_retries "
                            f"{self.engine_retries} times), none generated between: the worker stopped, its "
                            f"trajectories submitted as FAILED. The last: {exc}"))
                    traj.status = TrajectoryStatus.ABORTED if group.abort_requested else TrajectoryStatus.FAILED
                    traj.finish = FinishReason.ABORT if group.abort_requested else None
                    break
                logger.warning("%s: generation of %s failed, retrying: %s", self.worker_id, traj.trajectory_id,
                               exc, extra=_fields(worker=self.worker_id, trajectory_id=traj.trajectory_id))
                continue
            finally:
                self._requests.pop(request_id, None)
            self._engine_answered()
            self._engine_failures.succeeded()
            traj.add(generation.token_ids, generation.logprobs, version)
            self.stats.tokens_generated += len(generation.token_ids)
            if generation.aborted:
                traj.status, traj.finish = TrajectoryStatus.ABORTED, FinishReason.ABORT
            else:
                traj.status, traj.finish = TrajectoryStatus.COMPLETED, generation.finish_reason
            break
        self._enqueue(group, traj)

    async def _generate(self, request: GenerationRequest) -> Generation:
        """The engine's generate, bounded by generate_timeout: an engine that stops answering would otherwise hold
        its group, and the trainer's mini-batch, for ever. Past the bound the request is aborted on the engine and
        fails with EngineError, retried as any engine failure."""
        if self.generate_timeout is None:
            return await self.engine.generate(request)
        try:
            return await asyncio.wait_for(self.engine.generate(request), self.generate_timeout)
        except asyncio.TimeoutError:
            pass
        with contextlib.suppress(EngineError, asyncio.TimeoutError):  # best effort: it may not answer this either
            await asyncio.wait_for(self.engine.abort([request.request_id]), ENGINE_ABORT_TIMEOUT_SECONDS)
        raise EngineError(f"the engine did not answer request {request.request_id} within generate_timeout "
                          f"{self.generate_timeout:g} s (aborted on the engine)")

    # ------------------------------------------------------------------ an engine that cannot be reached

    async def _engine_ready_at_start(self) -> None:
        """Before the first Dispatch: wait for the engine to answer its health check (when it has one), so that a
        wrong address or an engine still loading takes no prompt; EngineUnreachableError after engine_wait. An
        engine that answers with another error is taken as up: its requests say what is wrong."""
        ready = getattr(self.engine, "ready", None)
        if ready is None:
            return
        began = time.monotonic()
        try:
            await ready()
            return
        except EngineUnreachableError as exc:
            gone = await self._until_engine_answers(ready, lambda: began, exc, say=True)
        except EngineError as exc:
            logger.warning("%s: the engine's health check answered with an error; taking it as up: %s",
                           self.worker_id, exc, extra=_fields(worker=self.worker_id))
            return
        waited = time.monotonic() - began
        if gone is not None:
            raise EngineUnreachableError(
                f"{self.worker_id}: the engine did not answer its health check in {waited:.0f} s "
                f"(engine_wait {self.engine_wait:g} s); nothing was dispatched: {gone}") from gone
        logger.info("%s: the engine answers after %.1f s", self.worker_id, waited, extra=_fields(worker=self.worker_id))

    async def _until_engine_answers(self, ready: Callable[[], Awaitable[Any]], since: Callable[[], float | None],
                                    exc: EngineUnreachableError, *, say: bool) -> EngineUnreachableError | None:
        """Asks the engine's health check, pausing longer each time, until it answers (None: also when `since()`,
        the moment it was lost, is None, as another request saw it answer), or it has been away for engine_wait
        (its last refusal). `say`: log the wait every ENGINE_WAIT_LOG_SECONDS."""
        pause, said_at = ENGINE_PROBE_SECONDS[0], None
        while True:
            lost_at = since()
            if lost_at is None:
                return None
            away = time.monotonic() - lost_at
            if away >= self.engine_wait:
                return exc
            if say and (said_at is None or time.monotonic() - said_at >= ENGINE_WAIT_LOG_SECONDS):
                said_at = time.monotonic()
                logger.warning("%s: waiting for the engine before dispatching (%.0f s of engine_wait %g s): %s",
                               self.worker_id, away, self.engine_wait, exc, extra=_fields(worker=self.worker_id))
            await asyncio.sleep(min(pause, self.engine_wait - away))
            pause = min(pause * 2, ENGINE_PROBE_SECONDS[1])
            try:
                await ready()
            except EngineUnreachableError as again:
                exc = again
                continue
            except EngineError:  # it answers, if with an error (e.g. still loading): its requests say the rest
                pass
            return None

    async def _engine_answers_again(self, exc: EngineUnreachableError, group: _Group) -> bool:
        """A request could not reach the engine: wait, with every other request, until it answers again (True:
        send it again), has been away for engine_wait (False; the worker then stops, and run() raises), or the
        group is aborted meanwhile (False: a Reset waits for its ABORTED trajectories)."""
        assert self._engine_back is not None
        if self._failure is not None:
            return False
        if self._engine_lost_at is None:
            self._engine_lost_at = time.monotonic()
            self._engine_back.clear()
            logger.warning("%s: the engine cannot be reached; dispatching nothing and holding %d groups until it "
                           "answers (at most engine_wait %g s): %s", self.worker_id, len(self._groups),
                           self.engine_wait, exc, extra=_fields(worker=self.worker_id))
        if self._engine_probe is None or self._engine_probe.done():  # a new round of asking: the requests wait for it
            self._engine_back.clear()
            self._engine_probe = asyncio.create_task(self._probe_engine(exc), name=f"{self.worker_id}-engine")
        while not self._engine_back.is_set():
            if group.abort_requested:
                return False
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._engine_back.wait(), ABORT_REPEAT_SECONDS)
        return self._failure is None

    async def _probe_engine(self, exc: EngineUnreachableError) -> None:
        """Asks the engine (its health check; without one, the requests themselves) until it answers, or gives up
        once it has been away for engine_wait."""
        assert self._engine_back is not None and self._engine_lost_at is not None
        ready = getattr(self.engine, "ready", None)
        if ready is not None:
            gone = await self._until_engine_answers(ready, lambda: self._engine_lost_at, exc, say=False)
            if gone is None:
                self._engine_answered()
                return
        else:
            away = time.monotonic() - self._engine_lost_at
            if away < self.engine_wait:
                await asyncio.sleep(min(ENGINE_PROBE_SECONDS[0], self.engine_wait - away))
                self._engine_back.set()  # the waiting requests are sent again: the first to get through says it answers
                return
            gone = exc
        away = time.monotonic() - self._engine_lost_at  # set: only a lost engine is given up on
        self._fail(EngineUnreachableError(
            f"{self.worker_id}: the engine could not be reached for {away:.0f} s (engine_wait "
            f"{self.engine_wait:g} s); the worker stopped, its running trajectories submitted as FAILED: {gone}"))
        self._engine_back.set()

    def _fail(self, error: Exception, cause: BaseException | None = None) -> None:
        """The worker cannot go on: it stops (what it holds is still submitted, within shutdown_grace), and run()
        raises `error`. The first failure is the one raised."""
        if self._failure is not None:
            return
        self._failure = error
        logger.error("%s", error, exc_info=cause, extra=_fields(worker=self.worker_id))
        self._request_stop()

    def _engine_answered(self) -> None:
        """The engine answered (a request, or its health check): what waited for it goes on."""
        if self._engine_lost_at is not None and self._failure is None:
            logger.info("%s: the engine answers again after %.1f s", self.worker_id,
                        time.monotonic() - self._engine_lost_at, extra=_fields(worker=self.worker_id))
            self._engine_lost_at = None
            if self._engine_back is not None:
                self._engine_back.set()
            self._poke()

    async def _reward_of(self, group: _Group, traj: _Traj) -> tuple[float, str | None]:
        """The trajectory's reward, and None; or 0.0 and what went wrong when the reward function raised or gave no
        finite number (the trajectory then goes FAILED, saying so)."""
        if self.reward is None or traj.status != TrajectoryStatus.COMPLETED:
            return 0.0, None
        try:
            value = self.reward(group.prompt, traj.token_ids)
            if inspect.isawaitable(value):
                value = await value
            reward = _finite_reward(value)
        except Exception as exc:  # the user's verifier: one response it cannot score must not stop the others
            return 0.0, self._reward_failed(traj, exc)
        self._reward_failures.succeeded()
        return reward, None

    def _reward_failed(self, traj: _Traj, exc: Exception) -> str:
        """Logs a reward function's failure (the first with its traceback) and stops the worker once it failed on
        reward_failure_limit trajectories in a row; returns the error the FAILED trajectory carries."""
        self.stats.reward_errors += 1
        stop = self._reward_failures.failed()
        error = f"the reward function failed: {type(exc).__name__}: {exc}"[:REWARD_ERROR_CHARS]
        logger.error("%s: %s: %s (submitted as FAILED; %d in a row, the worker stops at reward_failure_limit %d)",
                     self.worker_id, traj.trajectory_id, error, self._reward_failures.count,
                     self.reward_failure_limit, exc_info=exc if self.stats.reward_errors == 1 else None,
                     extra=_fields(worker=self.worker_id, trajectory_id=traj.trajectory_id))
        if stop:
            self._fail(RewardFunctionError(
                f"{self.worker_id}: the reward function failed on {self._reward_failures.count} completed "
                f"trajectories in a row (reward_failure_limit {self.reward_failure_limit}), none scored between: "
                f"the worker stopped, its trajectories submitted as FAILED. The last: {error}"))
        return error

    async def _to_wire(self, group: _Group, traj: _Traj) -> Trajectory:
        start = traj.start_version if traj.start_version is not None else self.tag_version
        end = traj.segments[-1][1] if traj.segments else start
        metadata = {"worker": self.worker_id}
        if traj.finish is not None:
            metadata["finish_reason"] = traj.finish.value
        if traj.was_aborted:
            metadata["continued"] = "true"  # aborted at a Reset, then continued under newer weights
        # The rest of a group the server refused as malformed goes as FAILED, so nothing is scored.
        reward, reward_error = (0.0, None) if group.refusal is not None else await self._reward_of(group, traj)
        if reward_error is not None:
            traj.status = TrajectoryStatus.FAILED
            metadata["error"] = reward_error
        message = Trajectory(
            trajectory_id=traj.trajectory_id, prompt_id=group.prompt.prompt_id, ds_index=group.prompt.ds_index,
            status=traj.status, reward=reward, token_ids=traj.token_ids,
            logprobs=traj.logprobs, start_weight_version=start, end_weight_version=end, metadata=metadata,
            segment_lengths=[n for n, _ in traj.segments],
            segment_weight_versions=[v for _, v in traj.segments],
        )
        if group.refusal is not None:
            return self._refusal_stand_in(traj, message, group.refusal)
        return message

    # ------------------------------------------------------------------ submitting

    def _enqueue(self, group: _Group, traj: _Traj) -> None:
        assert self._submit_wakeup is not None
        self._submit_queue.append((group, traj))
        self._submit_wakeup.set()

    async def _submitter(self) -> None:
        """Submits ended trajectories, batching those that ended together into one call."""
        assert self._submit_wakeup is not None
        while True:
            await self._submit_wakeup.wait()
            self._submit_wakeup.clear()
            while self._submit_queue:
                batch = [self._submit_queue.popleft() for _ in range(len(self._submit_queue))]
                await self._submit_batch(batch)

    async def _submit_batch(self, batch: list[tuple[_Group, _Traj]], wire: list[Trajectory] | None = None) -> None:
        if wire is None:
            wire = [await self._to_wire(group, traj) for group, traj in batch]
        parts = self._parts_that_fit(batch, wire)
        if parts is not None:  # one Submit would be larger than a message may be: several, each within it
            for entries, messages in parts:
                await self._submit_batch(entries, messages)
            return
        fences = {group.prompt.prompt_id: group.seq for group, _ in batch if group.seq is not None}
        try:
            with self._sending(batch):
                await self._submit(wire, fences)
        except _TooLarge as exc:  # larger than the server takes (its limit is below the client's)
            if len(batch) > 1:
                half = len(batch) // 2
                await self._submit_batch(batch[:half], wire[:half])
                await self._submit_batch(batch[half:], wire[half:])
            else:
                await self._submit_batch(batch, [self._too_large(batch[0], wire[0], exc.limit_text)])
            return
        except (FailedPreconditionError, UnknownPromptError, BadRequestError) as exc:
            if len({group.prompt.prompt_id for group, _ in batch}) > 1:
                # All-or-nothing: one refused group refuses the batch. Submit group by group instead.
                by_group: dict[str, tuple[list[tuple[_Group, _Traj]], list[Trajectory]]] = {}
                for entry, message in zip(batch, wire):
                    part = by_group.setdefault(entry[0].prompt.prompt_id, ([], []))
                    part[0].append(entry)
                    part[1].append(message)
                for entries, messages in by_group.values():
                    await self._submit_batch(entries, messages)
                return
            if isinstance(exc, BadRequestError):  # its content: the group is ours and can still complete
                await self._submit_refused_as_failed(batch, wire, fences, exc)
                return
            self._refused(batch, exc)  # stale or unknown: the group is not this worker's any more
            return
        except _GivenUp as exc:  # stop()'s grace ran out first: the server refused nothing
            self._given_up(batch, str(exc))
            return
        except PacerClientError as exc:
            self._refused(batch, exc)
            return
        self._acknowledged(batch, wire)

    def _parts_that_fit(self, batch: list[tuple[_Group, _Traj]],
                        wire: list[Trajectory]) -> list[tuple[list[tuple[_Group, _Traj]], list[Trajectory]]] | None:
        """None when one Submit of `wire` fits the client's send limit; else the parts, in order, each within
        it, a trajectory over it alone replaced by a FAILED one saying why (it can never be sent)."""
        limit = getattr(self.pacer, "max_message_bytes", 0)
        if not limit:
            return None
        # The client's own measure (it refuses a Submit over its limit by the same estimate), nothing encoded.
        sizes = [estimated_submit_bytes([t]) for t in wire]
        if sum(sizes) <= limit:
            return None
        parts: list[tuple[list[tuple[_Group, _Traj]], list[Trajectory]]] = []
        size = 0
        for entry, message, message_size in zip(batch, wire, sizes):
            if message_size > limit:
                message = self._too_large(entry, message, f"the client's max_message_bytes ({limit} bytes)",
                                          message_size)
                message_size = estimated_submit_bytes([message])
            if not parts or size + message_size > limit:
                parts.append(([], []))
                size = 0
            parts[-1][0].append(entry)
            parts[-1][1].append(message)
            size += message_size
        return parts

    def _too_large(self, entry: tuple[_Group, _Traj], message: Trajectory, limit: str, size: int = 0) -> Trajectory:
        """The FAILED trajectory submitted instead of one too large to send: the group completes (and the status
        filter drops it) instead of waiting for a Submit that can never go through."""
        group, traj = entry
        reason = (f"trajectory too large to submit: about {size or estimated_submit_bytes([message])} bytes, over "
                  f"{limit}; raise max_message_bytes on the client and server.max_message_bytes, or shorten max_tokens")
        logger.error("%s: %s: %s (submitted as FAILED)", self.worker_id, traj.trajectory_id, reason,
                     extra=_fields(worker=self.worker_id, trajectory_id=traj.trajectory_id))
        traj.status = TrajectoryStatus.FAILED
        self.stats.trajectories_too_large += 1
        return _failed_without_arrays(message, {**message.metadata, "error": reason, "finish_reason": "error"})

    @contextlib.contextmanager
    def _sending(self, batch: list[tuple[_Group, _Traj]]) -> Iterator[None]:
        """Counts `batch` in its groups' `submitting` while its Submit is out (the KeepAlive's verdict reads it)."""
        for group, _traj in batch:
            group.submitting += 1
        try:
            yield
        finally:
            for group, _traj in batch:
                group.submitting -= 1

    async def _submit(self, trajectories: list[Trajectory], fences: dict[str, int] | None = None) -> None:
        """Submits `trajectories` until acknowledged; raises what the server refused them with, or _GivenUp when
        stop()'s grace ran out before an answer or while the server pushed back."""
        try:
            await self._submit_until_answered(trajectories, fences)
        finally:
            self._pushed_back = None

    async def _submit_until_answered(self, trajectories: list[Trajectory], fences: dict[str, int] | None) -> None:
        assert self._grace_over is not None
        request_id = str(uuid.uuid4())
        while True:
            if self._pushed_back is not None and self._grace_over.done():
                # Checked before calling again: a call made now would be cut at once and read as unanswered.
                raise _GivenUp(f"the pacer at {self._target} kept refusing it for now with "
                               f"{self._pushed_back.reason or 'RESOURCE_EXHAUSTED'} (back-pressure: nothing accepted) "
                               f"until the {self.shutdown_grace:g} s shutdown grace after stop() ran out")
            try:
                await self._retrying("Submit", lambda: self.pacer.submit(trajectories, request_id=request_id,
                                                                        dispatch_seqs=fences))
                self.stats.submit_calls += 1
                return
            except UnavailableError as exc:  # a Submit is retried while unanswered until the grace, never after
                if not self._grace_over.done():
                    raise
                raise _GivenUp(exc.details or str(exc)) from exc
            except ResourceExhaustedError as exc:
                if _MESSAGE_LIMIT.search(exc.details or "") and not exc.reason:
                    # gRPC's own message limit (not the server's back-pressure): the same call would fail again.
                    raise _TooLarge(exc.details) from exc
                self._pushed_back = exc  # (_drain names it if the grace runs out meanwhile)
                if self._grace_over.done():
                    continue  # given up above, saying so
                # Back-pressure: nothing was applied. Wait as the server asks, then propose the same again.
                delay = exc.retry_delay if exc.retry_delay is not None else 1.0
                logger.warning("%s: Submit of %d trajectories refused for now (%s); retrying in %.1f s",
                               self.worker_id, len(trajectories), exc.reason or "resource exhausted", delay,
                               extra=_fields(worker=self.worker_id, retry_in=delay))
                self.stats.submit_retries += 1
                request_id = str(uuid.uuid4())  # the refusal may be remembered under the old id
                await self._pause(delay)

    def _acknowledged(self, batch: list[tuple[_Group, _Traj]], sent: Sequence[Trajectory] = ()) -> None:
        """The server acknowledged `batch`, submitted as `sent` (what on_submitted hears)."""
        for group, traj in batch:
            self.stats.trajectories_submitted += 1
            if traj.status == TrajectoryStatus.ABORTED:
                self.stats.trajectories_aborted += 1
            elif traj.was_aborted and traj.status == TrajectoryStatus.COMPLETED:
                self.stats.trajectories_continued += 1
            if traj.status == TrajectoryStatus.FAILED:
                self.stats.trajectories_failed += 1
            if traj.failed_after_refusal:
                self.stats.trajectories_failed_after_refusal += 1
            self._trajectory_settled(group)
        if sent and self.on_submitted is not None:
            try:
                self.on_submitted(list(sent))
            except Exception:
                logger.exception("%s: on_submitted failed", self.worker_id, extra=_fields(worker=self.worker_id))

    async def _submit_refused_as_failed(self, batch: list[tuple[_Group, _Traj]], wire: list[Trajectory],
                                        fences: dict[str, int], exc: BadRequestError) -> None:
        """A Submit of one group's trajectories refused as malformed (INVALID_ARGUMENT: nothing of it accepted). The
        server counts a group complete at its N trajectories, so without these it would hold the group in flight,
        and its step with it, until the group's in-flight lease runs out. They are submitted once more (same fence)
        as FAILED stand-ins without their arrays, saying why, and so is the rest of the group as it ends (its
        requests are aborted): the group completes at once and the status filter drops it. Stand-ins refused too
        are dropped, as any refusal is: never sent a third time."""
        group = batch[0][0]
        prompt_id, ids = group.prompt.prompt_id, [traj.trajectory_id for _, traj in batch]
        error = (exc.details or str(exc))[:REFUSAL_ERROR_CHARS]
        if group.refusal is None:
            group.refusal = error
        if not group.abort_requested:  # nothing more of this group is worth generating
            self._request_abort([group], reason="the server refused its trajectories as malformed")
        if all(traj.failed_after_refusal for _, traj in batch):  # already the stand-ins: the same would be refused
            self._stand_ins_refused(batch, exc)
            return
        logger.error("%s: Submit of group %r refused as malformed: %s; submitting its trajectories %s once more as "
                     "FAILED, without their arrays, so the group completes instead of holding its step until its "
                     "in-flight lease runs out", self.worker_id, prompt_id, exc, ", ".join(ids),
                     extra=_fields(worker=self.worker_id, prompt_id=prompt_id, trajectory_ids=ids, reason=exc.reason))
        stand_ins = [self._refusal_stand_in(traj, message, error) for (_, traj), message in zip(batch, wire)]
        try:
            with self._sending(batch):
                await self._submit(stand_ins, fences)
        except _GivenUp as given_up:  # stop()'s grace ran out first: the server refused nothing
            self._given_up(batch, str(given_up))
            return
        except _TooLarge as too_large:  # (without arrays a stand-in is a few hundred bytes: not expected)
            self._stand_ins_refused(batch, too_large)
            return
        except PacerClientError as again:
            self._stand_ins_refused(batch, again)
            return
        self._acknowledged(batch, stand_ins)

    def _refusal_stand_in(self, traj: _Traj, message: Trajectory, error: str) -> Trajectory:
        """The FAILED trajectory submitted in place of one of a group the server refused as malformed: none of its
        arrays (they may be what was refused), `error` (the server's message) in its metadata."""
        traj.status = TrajectoryStatus.FAILED
        traj.failed_after_refusal = True
        return _failed_without_arrays(message, {"worker": self.worker_id, "error": error, "finish_reason": "error"})

    def _stand_ins_refused(self, batch: list[tuple[_Group, _Traj]], exc: Exception) -> None:
        """FAILED stand-ins of a refused group were refused too: dropped (counted as refused), said once."""
        group = batch[0][0]
        prompt_id, ids = group.prompt.prompt_id, [traj.trajectory_id for _, traj in batch]
        logger.error("%s: the FAILED stand-ins %s of group %r were refused too, dropped: %s; the server holds the "
                     "group until its in-flight lease runs out", self.worker_id, ", ".join(ids), prompt_id, exc,
                     extra=_fields(worker=self.worker_id, prompt_id=prompt_id, trajectory_ids=ids))
        self._drop_refused(batch)

    def _refused(self, batch: list[tuple[_Group, _Traj]], exc: PacerClientError) -> None:
        group = batch[0][0]
        logger.warning("%s: Submit of %d trajectories of group %r refused, dropped (%s)", self.worker_id, len(batch),
                       group.prompt.prompt_id, exc,
                       extra=_fields(worker=self.worker_id, prompt_id=group.prompt.prompt_id, reason=exc.reason))
        self._drop_refused(batch)

    def _drop_refused(self, batch: list[tuple[_Group, _Traj]]) -> None:
        """Refused trajectories are settled unacknowledged; their group's other requests are aborted."""
        for group, _traj in batch:
            if self._groups.get((group.prompt.prompt_id, group.seq)) is not group:
                continue  # settled already, and counted: given up when the shutdown grace ran out
            self.stats.trajectories_refused += 1
            if not group.abort_requested:  # nothing more of this group will be taken: stop its other requests
                self._request_abort([group], reason="the server refused its trajectories")
            self._trajectory_settled(group)

    def _given_up(self, batch: list[tuple[_Group, _Traj]], why: str) -> None:
        """A Submit ended by stop()'s grace: its trajectories are given up (the server refused nothing)."""
        group = batch[0][0]
        logger.warning("%s: Submit of %d trajectories of group %r given up: %s", self.worker_id, len(batch),
                       group.prompt.prompt_id, why,
                       extra=_fields(worker=self.worker_id, prompt_id=group.prompt.prompt_id))
        for group, _traj in batch:
            if self._groups.get((group.prompt.prompt_id, group.seq)) is not group:
                continue  # settled already, and counted: given up by run() when the grace ran out
            self.stats.trajectories_given_up += 1
            group.given_up = True
            self._trajectory_settled(group)

    def _trajectory_settled(self, group: _Group) -> None:
        group.unacknowledged -= 1
        if group.unacknowledged == 0:
            self._groups.pop((group.prompt.prompt_id, group.seq), None)
            if group.given_up:
                self.stats.groups_given_up += 1
            else:
                self.stats.groups_done += 1
            self._poke()

    # ------------------------------------------------------------------ control events

    async def _watch(self) -> None:
        """Follows WatchControl, reconnecting (with back-off) whenever the stream ends: a SHUTDOWN, a lost
        connection, a restarted server."""
        assert self._stream_gone is not None and self._connected is not None
        delay = RETRY_INITIAL_SECONDS
        while True:
            self._connected.clear()  # set from now on, it means the channel (re)connected since this attempt began
            stream = self.pacer.watch()
            try:
                async for event in stream:
                    delay = RETRY_INITIAL_SECONDS
                    self._stream_gone.clear()
                    if event.type != ControlEventType.SHUTDOWN:  # a server going away does not answer again
                        self._shutdown_said = False
                        self._pacer_answered()
                    if await self._on_event(event):
                        return
            except UnavailableError as exc:
                self._pacer_away(f"control stream lost ({exc}); reconnecting")
            finally:
                self._stream_gone.set()
                stream.cancel()
            connected = asyncio.ensure_future(self._connected.wait())
            try:
                await asyncio.wait([connected], timeout=delay)
            finally:
                connected.cancel()
            delay = min(delay * 2, RETRY_MAX_SECONDS)

    async def _on_event(self, event: ControlEvent) -> bool:
        """Acts on one control event; True when the worker is to follow no more events."""
        if event.restores > self._restores:
            await self._on_restore(event)
        elif event.restores < self._restores:  # another server (one whose state was in memory): count from its
            self._restores = event.restores
        if event.type == ControlEventType.PAUSE:
            self._paused = True
            self._observe(event.generation, event.weight_version)
            mine = [g for g in self._groups.values() if g.generation <= event.generation]
            logger.info("%s: PAUSE (%s): %d groups here", self.worker_id,
                        "abort" if event.mode == ResetMode.ABORT else "wait", len(mine),
                        extra=_fields(worker=self.worker_id, mode=int(event.mode), generation=event.generation))
            if event.mode == ResetMode.ABORT:
                self._request_abort(mine, reason="PAUSE with ABORT")
        elif event.type == ControlEventType.RESUME:
            self._observe(event.generation, event.weight_version)
            await self._load_weights(event.weight_version)
            self._paused = False
            logger.info("%s: RESUME at weight version %d (step %d)", self.worker_id, event.weight_version, event.step,
                        extra=_fields(worker=self.worker_id, weight_version=event.weight_version, step=event.step))
            self._poke()
        elif event.type == ControlEventType.JOB_ENDED or (event.type == ControlEventType.STATE and event.job_ended):
            self._observe(event.generation, event.weight_version)
            self._paused = True
            self._stream_up = self._stream_up or event.type == ControlEventType.STATE
            self._end_of_job(event.mode)
        elif event.type == ControlEventType.STATE:
            self._observe(event.generation, event.weight_version)
            self._paused = event.paused
            self._stream_up = True
            self._poke()
        elif event.type == ControlEventType.SHUTDOWN:
            # The server is going away for now (a restart, a rolling update): keep what is held (generating and
            # submitting it, retried until a server is back) and dispatch again after the next server's STATE.
            logger.info("%s: SHUTDOWN from the server: dispatch stops until it is back; %d groups kept",
                        self.worker_id, len(self._groups), extra=_fields(worker=self.worker_id))
            self._shutdown_said = True
            self._stream_up = False
            self._poke()
        return False

    async def _on_restore(self, event: ControlEvent) -> None:
        """The server restored a checkpoint: what runs here was dispatched before it (its trajectories are refused
        as stale now), the pending prompts may have been admitted since, and the weights go back to the
        checkpoint's version. A STATE event (a reconnect that missed the Restore) loads them now; PAUSE waits
        for the RESUME that follows it."""
        self._restores = event.restores
        self._resync = True
        # The event carries the server's values now, not the checkpoint's: on a reconnect's STATE the trainer may
        # have stepped on since the Restore.
        when = ("was restored from a checkpoint since this worker last heard it" if event.type == ControlEventType.STATE
                else "restored a checkpoint")
        logger.warning("%s: the server %s; it is now at step %d, weight version %d: aborting %d groups, re-reading "
                       "the prompt cursor", self.worker_id, when, event.step, event.weight_version,
                       len(self._groups), extra=_fields(worker=self.worker_id, step=event.step,
                                                        weight_version=event.weight_version))
        self._request_abort([g for g in self._groups.values() if not g.abort_requested],
                            reason="the server restored a checkpoint")
        self.weight_version = event.weight_version
        if event.type == ControlEventType.STATE and not event.paused:
            await self._load_weights(event.weight_version)
        self._poke()

    async def _load_weights(self, weight_version: int) -> None:
        """RESUME (or a Restore): record the version, let `on_resume` load it, check what the engine has."""
        self.weight_version = weight_version
        if self.on_resume is not None:
            try:
                value = self.on_resume(weight_version)
                if inspect.isawaitable(value):
                    await value
            except Exception:
                logger.exception("%s: on_resume(%d) failed", self.worker_id, weight_version,
                                 extra=_fields(worker=self.worker_id))
        loaded = await self._ask_engine_version()
        if loaded is not None and loaded != weight_version:
            logger.warning("%s: RESUME announced weight version %d but the engine reports %d loaded; its "
                           "segments are tagged %d until it reports the new one", self.worker_id,
                           weight_version, loaded, loaded,
                           extra=_fields(worker=self.worker_id, weight_version=weight_version,
                                         engine_weight_version=loaded))

    def _end_of_job(self, mode: ResetMode | int, *, from_dispatch: bool = False) -> None:
        """The trainer ended the job: no more dispatching; abort (ABORT) or finish what is held, submit it,
        return. A Dispatch answer (`from_dispatch`) says the end without its mode, which the control stream's
        JOB_ENDED brings (logged then); a mode not given by an event (an older server's STATE) lets the groups
        finish."""
        if from_dispatch:
            if not self._job_ended:
                self._job_ended = True
                logger.info("%s: the job ended (from a Dispatch answer); its mode comes on the control stream: no "
                            "more dispatching, submitting the %d groups here, then stopping", self.worker_id,
                            len(self._groups), extra=_fields(worker=self.worker_id, groups=len(self._groups)))
                self._poke()
            return
        if self._job_ended and self._job_mode_said:
            if mode == ResetMode.ABORT:
                self._request_abort(list(self._groups.values()), reason="the job ended (abort)")
            return
        first = not self._job_ended
        self._job_ended = self._job_mode_said = True
        # A STATE after EndJob carries its mode (a server older than that says none: the groups then finish).
        how = ("abort" if mode == ResetMode.ABORT else "finish" if mode == ResetMode.WAIT
               else "mode not said by the server: finishing")
        if first:
            logger.info("%s: JOB_ENDED (%s): submitting the %d groups here, then stopping", self.worker_id, how,
                        len(self._groups), extra=_fields(worker=self.worker_id, mode=int(mode),
                                                         groups=len(self._groups)))
        else:  # the end came first in a Dispatch answer: this event brings its mode
            logger.info("%s: JOB_ENDED (%s), the mode of the end a Dispatch answer said: submitting the %d groups "
                        "here, then stopping", self.worker_id, how, len(self._groups),
                        extra=_fields(worker=self.worker_id, mode=int(mode), groups=len(self._groups)))
        if mode == ResetMode.ABORT:
            self._request_abort(list(self._groups.values()), reason="the job ended (abort)")
        self._poke()

    def _request_abort(self, groups: list[_Group], *, reason: str) -> None:
        """Aborts these groups' engine requests; their trajectories are then submitted as ABORTED."""
        for group in groups:
            group.abort_requested = True
        if groups and (self._abort_task is None or self._abort_task.done()):
            self._abort_task = asyncio.create_task(self._abort_until_answered(reason))

    async def _abort_until_answered(self, reason: str) -> None:
        """Aborts the requests of aborting groups until each has answered (an abort can overtake its request)."""
        began, said, warned, abort_failed = time.monotonic(), False, False, False
        while True:
            ids = [rid for rid, group in self._requests.items() if group.abort_requested]
            if not ids:
                return
            self.stats.engine_aborts += 1
            # Said once; the repeats (every ABORT_REPEAT_SECONDS) are the same request, at debug level; an engine
            # that leaves them running is said once more, as a warning.
            logger.log(logging.DEBUG if said else logging.INFO, "%s: aborting %d engine requests (%s)",
                       self.worker_id, len(ids), reason, extra=_fields(worker=self.worker_id, requests=len(ids)))
            said = True
            if not warned and time.monotonic() - began >= ABORT_UNANSWERED_WARN_SECONDS:
                warned = True
                bound = f"{self.generate_timeout:g} s" if self.generate_timeout is not None else "none"
                logger.warning("%s: %d aborted engine requests still running after %.0f s: the engine does not act on "
                               "aborts; each ends at generate_timeout (%s)", self.worker_id, len(ids),
                               time.monotonic() - began, bound, extra=_fields(worker=self.worker_id, requests=len(ids)))
            try:
                await self.engine.abort(ids)
            except EngineError as exc:
                logger.log(logging.DEBUG if abort_failed else logging.WARNING, "%s: engine abort failed: %s",
                           self.worker_id, exc, extra=_fields(worker=self.worker_id))
                abort_failed = True
            await asyncio.sleep(ABORT_REPEAT_SECONDS)

    # ------------------------------------------------------------------ leases

    async def _keep_alive(self) -> None:
        """The heartbeat: renews the in-flight leases of the groups held here and tells the server this worker is
        alive (a worker silent for server.worker_liveness_seconds loses its running groups), every third of the
        shorter of the two as the server reports them (or every `keepalive_seconds`)."""
        keep_alive = getattr(self.pacer, "keep_alive", None)
        if keep_alive is None:
            return
        interval = self.keepalive_seconds
        while True:
            await asyncio.sleep(interval if interval is not None else 1.0)
            # Aborting groups too: until their ABORTED trajectories are in, the server holds them for this worker.
            # Of a prompt held twice (its continuation besides the old group), the one launched last, as _groups
            # keeps launch order: the latest dispatch, the server's.
            held = {g.prompt.prompt_id: g for g in self._groups.values() if g.generation == self.generation}
            if not held:
                continue
            asked_at = time.monotonic()
            try:
                answer = await keep_alive(list(held), dispatch_seqs={p: g.seq for p, g in held.items()
                                                                     if g.seq is not None},
                                          **self._loaded_version_field())
            except PacerClientError as exc:
                if _server_away(exc):
                    self._pacer_away(f"KeepAlive not answered ({exc})")
                    continue
                logger.warning("%s: KeepAlive failed: %s", self.worker_id, exc, extra=_fields(worker=self.worker_id))
                continue
            self._pacer_answered(asked_at)
            self.stats.keepalive_calls += 1
            if self.keepalive_seconds is None:  # the server's bounds may change across a restart: follow them
                bounds = [b for b in (answer.lease_seconds, getattr(answer, "liveness_seconds", 0.0)) if b > 0]
                if not bounds:  # the server never reclaims running groups: nothing to renew
                    return
                interval = max(0.05, min(bounds) / 3)
            lost = [held[p] for p in answer.unknown_prompt_ids if p in held and self._released_by_server(held[p])]
            if lost:
                logger.warning("%s: %d groups are no longer in flight on the server; aborting them", self.worker_id,
                               len(lost), extra=_fields(worker=self.worker_id, lost=[g.prompt.prompt_id for g in lost]))
                self._request_abort(lost, reason="their lease is gone")

    def _released_by_server(self, group: _Group) -> bool:
        """Whether a group a KeepAlive's answer names as no longer in flight was taken from this worker (its lease ran
        out, or the server took the worker as gone): not when it is aborting already, when it was settled meanwhile (its last Submit accepted, or
        refused, which said so), nor when all it has left is in a Submit not answered yet. The server completes a
        group at its last Submit, so a KeepAlive crossing that Submit names it (nothing is lost); the Submit's answer
        says whether it was taken, and a refusal is logged there."""
        if group.abort_requested or self._groups.get((group.prompt.prompt_id, group.seq)) is not group:
            return False
        return group.submitting < group.unacknowledged

    # ------------------------------------------------------------------ ending

    async def _drain(self) -> None:
        """Waits until every group started here is acknowledged (or refused), at most until the grace that
        stop() began runs out."""
        assert self._changed is not None and self._grace_over is not None
        while self._groups:
            self._changed.clear()
            if self._grace_over.done():
                # Why, when the pacer answered: its back-pressure, not a pacer away, held them.
                why = (f" (the pacer at {self._target} kept refusing Submits for now with "
                       f"{self._pushed_back.reason or 'RESOURCE_EXHAUSTED'}: back-pressure, nothing accepted)"
                       if self._pushed_back is not None else "")
                logger.warning("%s: %d groups not acknowledged within the %g s grace, given up: %s%s", self.worker_id,
                               len(self._groups), self.shutdown_grace,
                               ", ".join(g.prompt.prompt_id for g in list(self._groups.values())[:5]), why,
                               extra=_fields(worker=self.worker_id, given_up=len(self._groups)))
                for group in list(self._groups.values()):  # nothing more of them is sent; the server refused none
                    self.stats.trajectories_given_up += max(0, group.unacknowledged)
                    group.given_up = True
                    group.unacknowledged = 1
                    self._trajectory_settled(group)
                return
            changed = asyncio.ensure_future(self._changed.wait())
            try:
                await asyncio.wait([changed, self._grace_over], return_when=asyncio.FIRST_COMPLETED)
            finally:
                changed.cancel()

    def _return_pending(self) -> None:
        if self._pending:
            give_back = getattr(self.source, "give_back", None)
            if give_back is not None:
                give_back(list(self._pending))
            self._pending.clear()

    async def _retrying(self, what: str, call: Callable[[], Awaitable[Any]], reads_only: bool = False) -> Any:
        """Runs a pacer call, retrying UNAVAILABLE and DEADLINE_EXCEEDED only (the server restarting or away: a call
        that waits for a server, as wait_for_ready makes it, ends with its deadline while none answers), with
        backoff; the caller's request id stays the same across attempts, so a call that landed is applied once,
        and while the server is away it is retried as long as it takes. After stop(), only Submits are retried,
        for `shutdown_grace` seconds; then the call's error is an UnavailableError. A call that `reads_only` (it
        changes nothing on the server) ends at stop() itself: nothing waits for its answer then."""
        delay = RETRY_INITIAL_SECONDS
        ends_it, grace = self._stop_asked if reads_only else self._grace_over, self._grace_over
        assert ends_it is not None and grace is not None  # made by run() before any call
        while True:
            asked_at = time.monotonic()
            attempt = asyncio.ensure_future(call())
            self._calls_in_flight[attempt] = what
            try:
                # After stop() a call may wait for a server that is not coming back: stop() or its grace bounds it.
                await asyncio.wait([attempt, ends_it], return_when=asyncio.FIRST_COMPLETED)
                if not attempt.done():
                    attempt.cancel()
                    raise self._ended_by_stop(what, reads_only)
                answer = attempt.result()
            except asyncio.CancelledError:
                attempt.cancel()  # the worker's own task was cancelled: so is its call
                raise
            except PacerClientError as exc:
                if not _server_away(exc):
                    raise
                if (what != "Submit" and self._stopping) or grace.done():
                    if isinstance(exc, UnavailableError):
                        raise
                    raise UnavailableError(grpc.StatusCode.UNAVAILABLE, f"{what} not answered: {exc}") from exc
                if what == "Submit":
                    self.stats.submit_retries += 1
                if refuses_for_now(exc):
                    self._refusals.failed(f"{what} refused ({exc}); retrying in {delay:.1f} s")
                else:
                    self._pacer_away(f"{what} not answered ({exc}); retrying in {delay:.1f} s")
                await self._pause(delay, ends_it)
                delay = min(delay * 2, RETRY_MAX_SECONDS)
                continue
            finally:
                self._calls_in_flight.pop(attempt, None)
            self._pacer_answered(asked_at)
            if not reads_only:
                self._refusals.answered()
            return answer

    def _pacer_away(self, reason: str, kind: str | None = None) -> None:
        """The pacer cannot be reached (OutageLog: the first failure of an outage warned of, the rest at debug level);
        after a SHUTDOWN the warning says that the server announced it."""
        if self._shutdown_said:
            reason = f"it announced its shutdown (SHUTDOWN) and is not back yet: {reason}"
        self._outage.failed(reason, kind=kind)

    def _pacer_answered(self, asked_at: float | None = None) -> None:
        """The pacer answered: ends the outage, unless the answer is to a call made before the outage began (a
        stopping server finishes the calls it has: that it answers them does not mean it is back)."""
        since = self._outage.since
        if since is not None and asked_at is not None and asked_at < since:
            self._outage.answered_once = True
            return
        self._outage.answered()

    def _ended_by_stop(self, what: str, reads_only: bool) -> UnavailableError:
        """The error of a call still unanswered at stop() (one that reads only) or when its grace ran out."""
        target = self._target
        if reads_only:
            return UnavailableError(grpc.StatusCode.UNAVAILABLE, f"{what} not answered before stop(): the pacer at "
                                    f"{target} did not answer")
        return UnavailableError(grpc.StatusCode.UNAVAILABLE, f"{what} not answered within the {self.shutdown_grace:g} s "
                                f"shutdown grace after stop(): the pacer at {target} did not answer it")

    @property
    def _target(self) -> str:
        return str(getattr(self.pacer, "target", "?"))

    async def _pause(self, seconds: float, ends: asyncio.Future[None] | None = None) -> None:
        """Sleeps `seconds`, less if `ends` (default: stop()'s grace running out) is set meanwhile."""
        ends = self._grace_over if ends is None else ends
        assert ends is not None
        # Not wait_for(shield(ends)): on Python 3.10 and 3.11, wait_for returns the shielded future's result when
        # its task is cancelled in the same turn of the loop as `ends` is set, swallowing the cancel (as happens
        # when the grace runs out and run() cancels the helpers at once); a helper that lost its cancel kept
        # run() waiting for it for ever. asyncio.wait never cancels `ends` and always passes a cancel on.
        await asyncio.wait([ends], timeout=seconds)

    async def _watch_connection(self) -> None:
        """Says at once that the pacer cannot be reached, and why: its calls wait for it (wait_for_ready, as
        RolloutWorker makes them), silently until their deadline, while the channel's connection attempts fail from
        the first (nothing listens at the address, it cannot be reached, or the TLS handshake fails). One warning,
        the outage's (OutageLog), and one more if the cause turns out to be a TLS setting; the first answer ends it.
        While a control stream still delivers events the server is not said away until it ends (a stopping server
        says SHUTDOWN on it first). A TLS misconfiguration before the pacer ever answered (a CA that did not sign the
        server's certificate, TLS against a plaintext server), or something other than a gRPC server at the address,
        stops the worker: waiting would not cure it. A pacer client that cannot tell its connection's state (not
        AsyncPacerClient) is not watched."""
        connection_state = getattr(self.pacer, "connection_state", None)
        if connection_state is None:
            return
        failing = grpc.ChannelConnectivity.TRANSIENT_FAILURE
        state = None
        closed_before = False  # the last look found the server closing the connection (see _connection_failing)
        try:
            while state is not grpc.ChannelConnectivity.SHUTDOWN:
                if state is failing:
                    # gRPC stays in TRANSIENT_FAILURE while its attempts keep failing: looked at again every few
                    # seconds, so that a cause that changes (the server up, with a certificate refused here) is said.
                    try:
                        state = await asyncio.wait_for(connection_state(state), CONNECTION_LOOK_SECONDS)
                    except asyncio.TimeoutError:
                        pass
                else:
                    state = await connection_state(state)
                if state is failing:
                    closed_before = await self._connection_failing(closed_before)
                elif state is grpc.ChannelConnectivity.READY and self._connected is not None:
                    self._connected.set()  # a control stream waiting out its back-off reconnects now
        except (RuntimeError, grpc.RpcError) as exc:  # the client closed, or a channel of another loop: its calls say
            logger.debug("%s: the connection's state is not watched: %s", self.worker_id, exc)

    async def _connection_failing(self, closed_before: bool) -> bool:
        """The connection to the pacer fails: said (or the worker stopped) after what the client reads from gRPC's
        connection error (AsyncPacerClient.connection_trouble). Returns whether the server closed the connection."""
        assert self._stream_gone is not None
        found = await self._connection_trouble()
        if found is not None and not self._stream_gone.is_set():
            # The control stream still runs on the connection gRPC is replacing: a stopping server says SHUTDOWN on
            # it before it goes. Said after the stream ends, so that the log follows what the stream said.
            await self._stream_gone.wait()
            found = await self._connection_trouble()
        if found is None:  # it connected meanwhile
            return False
        details, trouble = found
        if trouble is None:
            trouble = _tls.not_grpc(details)  # a pacer client that reads no cause: the shared reading
        if trouble is None:
            self._pacer_away(f"no connection can be made to it ({details})")
            return False
        if trouble.kind == "closed" and not closed_before:
            # A server closes connections as it stops, and a port forward before its server is up: said only when
            # the next look finds it so again.
            logger.debug("%s: the pacer closed the connection (%s)", self.worker_id, details)
            return True
        if trouble.settled and not self._outage.answered_once:
            change = "the address" if trouble.kind == _tls.NOT_GRPC else "a TLS setting"
            self._fail(WorkerFailedError(
                f"{self.worker_id}: no connection can be made to the pacer at {self._target}: {trouble.text} (gRPC: "
                f"{details}); the worker stopped: {change} must change, waiting would not help"))
            return False
        self._pacer_away(f"no connection can be made to it: {trouble.text} (gRPC: {details})", kind=trouble.kind)
        return trouble.kind == "closed"

    async def _connection_trouble(self) -> tuple[str, Any] | None:
        """The client's reading of why it cannot connect now (None: it can), or a generic one from a client that
        cannot say."""
        ask = getattr(self.pacer, "connection_trouble", None)
        if ask is None:
            return "nothing listens at that address, or it cannot be reached from here", None
        return await ask()


def _server_away(exc: PacerClientError) -> bool:
    """Whether a call's error says the server was away or going (the call is retried with its request id, so it
    applies once), not a refusal: UNAVAILABLE, DEADLINE_EXCEEDED (a call waiting for a server that did not come), or
    CANCELLED, which only the other side gives (this worker's own cancel is asyncio's): gRPC ends so a call that
    reaches a server as it stops. Read as a refusal, a Submit cut so was dropped, and the server held its group
    until the worker's liveness grace ran out."""
    return isinstance(exc, (UnavailableError, DeadlineExceededError)) or exc.code == grpc.StatusCode.CANCELLED


def _failed_without_arrays(message: Trajectory, metadata: dict[str, str]) -> Trajectory:
    """`message` as FAILED: its ids and weight versions, no arrays, `metadata`. Submitted in place of a trajectory
    that can never be accepted as it is, so that its group completes (and the status filter drops it)."""
    return Trajectory(trajectory_id=message.trajectory_id, prompt_id=message.prompt_id, ds_index=message.ds_index,
                      status=TrajectoryStatus.FAILED, start_weight_version=message.start_weight_version,
                      end_weight_version=message.end_weight_version, metadata=metadata)


def _settle(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


class RolloutWorker:
    """The blocking twin of AsyncRolloutWorker: `run()` blocks until done, `start()` runs it on a thread.

    target: the pacer's address; client_options: AsyncPacerClient keyword arguments (token, tls, ...).
    engine: an Engine (blocking; its calls run on `engine_threads` threads) or an AsyncEngine. Every other
    argument is AsyncRolloutWorker's.
    """

    def __init__(
        self,
        target: str,
        engine: Engine | AsyncEngine,
        source: PromptSource,
        *,
        client_options: Mapping[str, Any] | None = None,
        engine_threads: int = 64,
        **worker_options: Any,
    ) -> None:
        self.target = target
        self.engine = engine
        self.source = source
        self.client_options = dict(client_options or {})
        self.engine_threads = engine_threads
        self.worker_options = worker_options
        self.stats: WorkerStats | None = None
        self._worker: AsyncRolloutWorker | None = None
        self._ready = threading.Event()
        self._stop_requested = False
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    async def _main(self, signals: bool = False) -> WorkerStats:
        threaded = None
        handled: list[int] = []
        engine: Any = self.engine
        if not inspect.iscoroutinefunction(getattr(engine, "generate", None)):
            engine = threaded = _ThreadedEngine(engine, self.engine_threads)
        try:
            options = dict(self.client_options)
            options.setdefault("wait_for_ready", True)  # a worker may start before its server: wait for it
            # The worker's id is its client id: the server's ListWorkers and logs name it so, and worker
            # liveness (a watched worker is one holding a control stream under a client id) needs one.
            worker_id = self.worker_options.get("worker_id") or options.get("client_id") or default_worker_id()
            options.setdefault("client_id", worker_id)
            self.worker_options["worker_id"] = worker_id
            async with AsyncPacerClient(self.target, **options) as pacer:
                self._worker = AsyncRolloutWorker(pacer, engine, self.source, **self.worker_options)
                if self._stop_requested:
                    self._worker.stop()
                if signals:
                    handled = self._stop_on_signals()
                self._ready.set()
                self.stats = await self._worker.run()
                return self.stats
        finally:
            loop = asyncio.get_running_loop()
            for signum in handled:
                loop.remove_signal_handler(signum)
            self._ready.set()
            if threaded is not None:
                threaded.shutdown()

    def run(self) -> WorkerStats:
        """Runs the loop in this thread until done; returns what it did. On the main thread, SIGINT (Ctrl-C) and
        SIGTERM (a container's stop) stop it as stop() does, and run() returns once what runs is submitted; a
        second signal ends it at once with KeyboardInterrupt."""
        return asyncio.run(self._main(signals=threading.current_thread() is threading.main_thread()))

    def _stop_on_signals(self) -> list[int]:
        """Makes SIGINT and SIGTERM stop the worker (the process's default would end it at once, leaving its
        running groups held on the server until its liveness runs out and what they generated lost)."""
        loop, handled = asyncio.get_running_loop(), []
        for signum in (signal.SIGINT, signal.SIGTERM):
            try:
                loop.add_signal_handler(signum, self._on_signal, signum)
            except (NotImplementedError, RuntimeError, ValueError):  # a loop or platform without them (Windows)
                continue
            handled.append(signum)
        return handled

    def _on_signal(self, signum: int) -> None:
        worker = self._worker
        if self._stop_requested or worker is None:
            raise KeyboardInterrupt  # the second: at once
        logger.warning("%s: %s: stopping: nothing more is dispatched; the %d groups running here are finished and "
                       "submitted, for at most shutdown_grace %g s (a second signal: stop at once)", worker.worker_id,
                       signal.Signals(signum).name, len(worker._groups), worker.shutdown_grace,
                       extra=_fields(worker=worker.worker_id))
        self.stop()

    def start(self) -> RolloutWorker:
        """Runs the loop on a background thread; `join()` waits for it, `stop()` ends it."""
        def target() -> None:
            try:
                self.run()
            except BaseException as exc:  # handed to join()
                self._error = exc

        self._thread = threading.Thread(target=target, name="coda-rollout-worker", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Ends the loop: no more dispatching, running groups finish and are submitted. Thread-safe."""
        self._stop_requested = True
        if self._worker is not None:
            self._worker.stop()

    def join(self, timeout: float | None = None) -> WorkerStats | None:
        """Waits for a started worker; re-raises what ended it, if anything did."""
        if self._thread is not None:
            self._thread.join(timeout)
        if self._error is not None:
            raise self._error
        return self.stats

    @property
    def worker_id(self) -> str | None:
        return self._worker.worker_id if self._worker is not None else None
