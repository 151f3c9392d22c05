"""Admission of every call by its kind, the caller's client id, and optional per-client rate limits.

Each method's handler (built once per method by rpc_handlers.py) asks it for each call before the
servicer runs:

* **Who calls**: the optional `x-coda-client-id` metadata (coda_client: `PacerClient(client_id=...)`),
  checked against the client's own rule (letters, digits and -_.:@/, at most 128 characters); a malformed id
  is answered INVALID_ARGUMENT. `read_caller(context)` reads it once per call; `client_id(context)` gives it
  to the servicer.
* **Per-client rate limits** (`server.client_rate_limits.*`, off by default): a token bucket per client
  id and method; over it, RESOURCE_EXHAUSTED (reason RATE_LIMITED) with the delay until the next token.
* **Room by kind of call** (`CALL_LIMITS`): long-lived streams, long-polls and the workers' short calls
  count against limits of their own; over a limit the caller gets RESOURCE_EXHAUSTED naming the limit,
  with a jittered retry delay. The trainer's control calls (Reset, Resume, Collect without a wait, Ack, Release,
  GetState) and health checks count against nothing, so no number of watchers or waiting workers can
  refuse them. gRPC's own `maximum_concurrent_rpcs`, which counted every call alike, is not used.
"""
from __future__ import annotations

import contextvars
import random
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import grpc

from coda_client.protocol import CLIENT_ID_METADATA_KEY, CLIENT_ID_PATTERN, CLIENT_ID_RULE, RPCS, method_path

from .core.errors import InvalidArgumentError, ResourceExhaustedError
from .core.settings import setting
from .status import status_for

HEALTH = "/grpc.health.v1.Health/"
# A refused caller waits its limit's delay times a random factor in [1, 1 + RETRY_JITTER): callers refused
# together (thousands of workers reconnecting after a restart) do not all come back at the same moment.
RETRY_JITTER = 0.5
# Rate-limit buckets kept before idle (full) ones are forgotten; a forgotten bucket starts full again.
MAX_RATE_BUCKETS = 65536


@dataclass
class CallLimit:
    """One limit on calls in progress at once: its configuration key, reason and what it counts."""

    key: str  # the configuration key, named in every refusal
    limit: int
    reason: str  # google.rpc.ErrorInfo reason of a refusal
    counts: str  # what is counted, for messages
    retry_after: float  # seconds, before jitter
    in_progress: int = 0
    refused: int = 0

    def release(self) -> None:
        """A call admitted against this limit has ended."""
        self.in_progress -= 1


def call_limits(server_config: Any) -> dict[str, CallLimit]:
    """The limits by kind of call, from the server configuration."""
    def limit(key: str, reason: str, counts: str, retry_after: float) -> CallLimit:
        return CallLimit(f"server.{key}", int(server_config.get(key)), reason, counts, retry_after)

    return {
        "watch": limit("max_watch_streams", "TOO_MANY_WATCH_STREAMS", "watch streams are open", 2.0),
        "waiting_dispatch": limit("max_waiting_calls", "TOO_MANY_WAITERS", "Dispatch long-polls are waiting", 1.0),
        "waiting_collect": limit("max_waiting_collects", "TOO_MANY_WAITERS", "Collect long-polls are waiting", 1.0),
        "worker": limit("max_concurrent_rpcs", "TOO_MANY_CALLS", "Submit and Dispatch calls are in progress", 0.5),
    }


# How each method is admitted (the RPC table's `admission`, coda_client/protocol.py): (kind of a call whose
# request does not wait, kind of one that waits, i.e. whose wait_seconds > 0). None: a control call, never
# refused for lack of room. Methods not listed here (health Check, reflection) are control calls too.
CALL_KINDS: dict[str, tuple[Optional[str], Optional[str]]] = {
    **{method_path(rpc.name): rpc.admission for rpc in RPCS if rpc.admission != (None, None)},
    HEALTH + "Watch": ("watch", "watch"),
}
# Methods a per-client rate limit may apply to: method -> configuration key under server.client_rate_limits.
RATE_LIMITED = {method_path(rpc.name): rpc.rate_limit_key for rpc in RPCS if rpc.rate_limit_key is not None}


# ------------------------------------------------------------------------------------------- client id

_client_id: contextvars.ContextVar[Optional[tuple[str, bool]]] = contextvars.ContextVar("coda_client_id", default=None)


def read_caller(context: grpc.aio.ServicerContext) -> tuple[str, bool]:
    """The caller's client id ("" when it sent none) and whether it is well formed, read from the metadata;
    kept for the rest of the call (every call runs in its own task), where `client_id` finds it."""
    for key, value in context.invocation_metadata() or ():
        if key == CLIENT_ID_METADATA_KEY:
            known = _KNOWN_CALLERS.get(value)
            if known is None:  # a caller not seen yet (or forgotten): checked against the rule
                text = value if isinstance(value, str) else value.decode("utf-8", "replace")
                known = (text, True) if CLIENT_ID_PATTERN.fullmatch(text) else ("", False)
                if known[1]:
                    if len(_KNOWN_CALLERS) >= MAX_KNOWN_CALLERS:
                        _KNOWN_CALLERS.clear()
                    _KNOWN_CALLERS[value] = known
            break
    else:
        known = _NO_CLIENT_ID
    _client_id.set(known)
    return known


_NO_CLIENT_ID = ("", True)
# Well-formed client ids already seen, as read_caller answers them: the same workers call again and again,
# so most calls skip the rule's regular expression. Forgotten all at once past MAX_KNOWN_CALLERS.
_KNOWN_CALLERS: dict[Any, tuple[str, bool]] = {}
MAX_KNOWN_CALLERS = 65536


def client_id(context: grpc.aio.ServicerContext) -> str:
    """The caller's client id ("" when it sent none, or a malformed one, which admission refuses)."""
    known = _client_id.get()
    return (known if known is not None else read_caller(context))[0]


BAD_CLIENT_ID = InvalidArgumentError(
    f"the metadata {CLIENT_ID_METADATA_KEY} is not a valid client id: {CLIENT_ID_RULE}",
    violations=[(CLIENT_ID_METADATA_KEY, CLIENT_ID_RULE)], reason="INVALID_CLIENT_ID")


# ----------------------------------------------------------------------------------------- rate limits

@dataclass
class _Bucket:
    tokens: float
    updated: float


@dataclass
class RateLimit:
    """A token bucket per client id: `rate` calls per second on average, up to `burst` at once."""

    key: str
    rate: float
    burst: float
    clock: Callable[[], float] = time.monotonic
    refused: int = 0
    _buckets: dict[str, _Bucket] = field(default_factory=dict)

    def take(self, client: str) -> float:
        """0 when the call may go ahead (a token is taken), else the seconds until the next token."""
        now = self.clock()
        bucket = self._buckets.get(client)
        if bucket is None:
            if len(self._buckets) >= MAX_RATE_BUCKETS:
                self._forget_idle(now)
            bucket = self._buckets[client] = _Bucket(self.burst, now)
        else:
            bucket.tokens = min(self.burst, bucket.tokens + (now - bucket.updated) * self.rate)
            bucket.updated = now
        if bucket.tokens >= 1.0:
            bucket.tokens -= 1.0
            return 0.0
        self.refused += 1
        return (1.0 - bucket.tokens) / self.rate

    def _forget_idle(self, now: float) -> None:
        """Drop the buckets that have refilled (a fresh one would be the same); if none has, the oldest half."""
        full = [c for c, b in self._buckets.items() if b.tokens + (now - b.updated) * self.rate >= self.burst]
        if not full:
            full = sorted(self._buckets, key=lambda c: self._buckets[c].updated)[:len(self._buckets) // 2]
        for client in full:
            del self._buckets[client]


def rate_limits(server_config: Any) -> dict[str, RateLimit]:
    """The configured per-client rate limits by method (those with a rate of 0 are off)."""
    burst = float(setting({"server": server_config}, "server.client_rate_limits.burst"))
    limits = {}
    for method, key in RATE_LIMITED.items():
        rate = float(setting({"server": server_config}, f"server.client_rate_limits.{key}") or 0)
        if rate > 0:
            limits[method] = RateLimit(f"server.client_rate_limits.{key}", rate, max(1.0, burst))
    return limits


# -------------------------------------------------------------------------------------------- admission

def _refusal(limit_key: str, reason: str, message: str, retry_after: float, **metadata: str) -> grpc.Status:
    return status_for(ResourceExhaustedError(message, retry_after=retry_after, reason=reason,
                                             metadata={"limit": limit_key, **metadata}))


# What a call's handler asks admission: (refusal, the limit it counts against, to release when it ends).
Admit = Callable[[Any, str], tuple[Optional[grpc.Status], Optional[CallLimit]]]


class Admission:
    """Per method: the client id check, the per-client rate limit, then room for the call's kind."""

    def __init__(self, server_config: Any, jitter: Callable[[], float] = random.random):
        self.limits = call_limits(server_config)
        self.rate_limits = rate_limits(server_config)
        self._jitter = jitter
        self.bad_client_id = status_for(BAD_CLIENT_ID)  # the same refusal every time: built once

    def admitter(self, method: str) -> Optional[Admit]:
        """`admit(request, caller)` for `method`, called once the caller's id is known to be well formed; None
        for a method with nothing to check (a control call without a rate limit). A call admitted against a
        limit must `release()` it when it ends, however it ends."""
        kinds = CALL_KINDS.get(method, (None, None))
        quiet, waiting = (self.limits[k] if k is not None else None for k in kinds)
        rate = self.rate_limits.get(method)
        if quiet is None and waiting is None and rate is None:
            return None

        def admit(request: Any, caller: str) -> tuple[Optional[grpc.Status], Optional[CallLimit]]:
            limit = waiting if waiting is not quiet and getattr(request, "wait_seconds", 0) > 0 else quiet
            if rate is not None:
                delay = rate.take(caller)
                if delay > 0:
                    return _refusal(rate.key, "RATE_LIMITED",
                                    f"client {caller or '(no client id)'} is over {rate.key} = {rate.rate:g} "
                                    f"calls per second (burst {rate.burst:g}); retry in {delay:.2f}s", delay,
                                    client=caller), None
            if limit is None:
                return None, None
            if limit.in_progress >= limit.limit:
                limit.refused += 1
                delay = limit.retry_after * (1.0 + RETRY_JITTER * self._jitter())
                return _refusal(limit.key, limit.reason,
                                f"{limit.in_progress} {limit.counts} ({limit.key} = {limit.limit}); retry in "
                                f"{delay:.1f}s", delay, value=str(limit.limit)), None
            limit.in_progress += 1
            return None, limit

        return admit
