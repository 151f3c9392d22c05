"""The HTTP plumbing both engine adapters share: connection pools, JSON calls and their errors, and the count
of generate calls in flight that a weight sync checks."""

from __future__ import annotations

import asyncio
import time
import urllib.parse
from collections.abc import Awaitable, Callable, Mapping
from types import TracebackType
from typing import Any

try:
    import httpx
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise ImportError("the engine adapters need httpx: pip install 'coda-pacer[worker]'") from exc

from .base import DEFAULT_GENERATE_TIMEOUT_SECONDS, EngineError, EngineUnreachableError

DEFAULT_CONTROL_TIMEOUT_SECONDS = 30.0
# Pooled connections are dropped after this idle time: under the 5 s after which vLLM's and SGLang's uvicorn
# servers close an idle keep-alive connection, so a request is never sent on one the engine is closing (it
# would fail with ReadError; seen when generation pauses for a weight sync).
KEEPALIVE_EXPIRY_SECONDS = 4.0
# How long a weight sync waits for the engine's running requests to drain (an aborted request can take a
# moment to free its KV blocks) before it refuses, and how often it asks meanwhile.
DEFAULT_DRAIN_TIMEOUT_SECONDS = 10.0
DRAIN_POLL_SECONDS = 0.05
# Connections per httpx pool: a call scans every connection of its pool, several times (httpcore's
# `_assign_requests_to_connections`, encode/httpcore#1035), so one pool of 256 connections spends more CPU on
# that bookkeeping than on the calls (measured: most of a rollout worker's CPU at 64 to 128 calls in flight).
# Calls are spread over pools of this many connections instead.
CONNECTIONS_PER_POOL = 16


def check_base_url(adapter: str, base_url: Any) -> str:
    """The engine server's root URL without a trailing slash, or ValueError: a URL without http(s):// reached no
    server (httpx: "unsupported protocol"), and the OpenAI API's base (.../v1, what an OpenAI client is given) would
    send every request to /v1/v1/...: answered 404, each trajectory failed."""
    parsed = urllib.parse.urlsplit(base_url) if isinstance(base_url, str) else None
    if parsed is None or parsed.scheme not in ("http", "https") or not parsed.netloc:
        raise ValueError(f"{adapter}: base_url {base_url!r} must be the engine server's URL with its scheme, e.g. "
                         f"http://127.0.0.1:8000")
    if parsed.path.rstrip("/").endswith("/v1"):
        raise ValueError(f"{adapter}: base_url {base_url!r} is the OpenAI API's base; give the server's root "
                         f"(without /v1), e.g. {parsed.scheme}://{parsed.netloc}: the adapter adds the API paths")
    return base_url.rstrip("/")


class HttpEngine:
    """An engine server at `base_url`; `transport` replaces the network (tests use httpx.MockTransport)."""

    def __init__(
        self,
        base_url: str,
        *,
        api_key: str | None = None,
        generate_timeout: float = DEFAULT_GENERATE_TIMEOUT_SECONDS,
        control_timeout: float = DEFAULT_CONTROL_TIMEOUT_SECONDS,
        max_connections: int = 256,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        self.base_url = check_base_url(type(self).__name__, base_url)
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._generate_timeout = generate_timeout
        self._generating = 0  # generate calls of this adapter awaiting their answer
        self._control_timeout = control_timeout
        if max_connections < 1:
            raise ValueError(f"max_connections {max_connections!r} must be >= 1")
        sizes = [CONNECTIONS_PER_POOL] * (max_connections // CONNECTIONS_PER_POOL)
        if max_connections % CONNECTIONS_PER_POOL:
            sizes.append(max_connections % CONNECTIONS_PER_POOL)
        self._pools = [httpx.AsyncClient(
            base_url=self.base_url,
            headers=headers,
            transport=transport,
            limits=httpx.Limits(max_connections=size, max_keepalive_connections=size,
                                keepalive_expiry=KEEPALIVE_EXPIRY_SECONDS),
            # No proxy from the environment: an engine is a local or cluster-internal address.
            trust_env=False,
        ) for size in sizes]
        self._pool_sizes = sizes
        self._pool_calls = [0] * len(self._pools)  # calls in flight on each pool

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.base_url!r})"

    @property
    def generating(self) -> int:
        """Generate calls this adapter has sent and not yet had answered."""
        return self._generating

    async def _send(
        self, method: str, path: str, body: Mapping[str, Any] | None = None, *,
        params: Mapping[str, str] | None = None, generate: bool = False,
    ) -> httpx.Response:
        """Sends one call and returns the response whatever its status; a failed exchange raises EngineError."""
        timeout = self._generate_timeout if generate else self._control_timeout
        pool = max(range(len(self._pools)), key=lambda k: self._pool_sizes[k] - self._pool_calls[k])  # most room
        self._pool_calls[pool] += 1
        try:
            if method == "GET":
                return await self._pools[pool].get(path, params=params, timeout=timeout)
            if generate:
                self._generating += 1
            try:
                return await self._pools[pool].post(path, json=body if body is not None else {}, params=params,
                                                    timeout=timeout)
            finally:
                if generate:
                    self._generating -= 1
        except (httpx.ConnectError, httpx.ConnectTimeout) as exc:  # the call never reached the engine
            raise EngineUnreachableError(f"{self!r}: {method} {path} failed: {type(exc).__name__}: {exc}") from exc
        except httpx.HTTPError as exc:
            raise EngineError(f"{self!r}: {method} {path} failed: {type(exc).__name__}: {exc}") from exc
        finally:
            self._pool_calls[pool] -= 1

    def _decoded(self, method: str, path: str, response: httpx.Response) -> Any:
        if response.status_code >= 400:
            raise EngineError(f"{self!r}: {method} {path} answered HTTP {response.status_code}: "
                              f"{response.text[:500]}")
        if not response.content:
            return None
        try:
            return response.json()
        except ValueError as exc:
            raise EngineError(f"{self!r}: {method} {path} answered with something that is not JSON: "
                              f"{response.text[:200]!r}") from exc

    async def _post(
        self, path: str, body: Mapping[str, Any] | None = None, *, params: Mapping[str, str] | None = None,
        generate: bool = False,
    ) -> Any:
        """POSTs JSON and returns the decoded answer (None for an empty one); failures raise EngineError."""
        return self._decoded("POST", path, await self._send("POST", path, body, params=params, generate=generate))

    async def _get(self, path: str) -> Any:
        """GETs a JSON answer; failures raise EngineError."""
        return self._decoded("GET", path, await self._send("GET", path))

    def _refuse_sync_while_generating(self) -> None:
        if self._generating:
            raise EngineError(
                f"{self!r}: refusing a weight sync: {self._generating} generate calls sent through this adapter "
                "are still running, and reloading under them would mix old and new weights within their "
                "responses. Pause generation first (Reset with ABORT, which waits for the workers' aborted "
                "requests), then sync the weights, then Resume.")

    async def _until_idle(self, attempt: Callable[[], Awaitable[bool]], timeout: float, refusal: str) -> None:
        """Repeats `attempt` (an engine call that succeeds only with no request running) until it succeeds;
        after `timeout` seconds raises EngineError with `refusal`, which says why that matters."""
        deadline = time.monotonic() + timeout
        tries = 0
        while True:
            tries += 1
            if await attempt():
                return
            if time.monotonic() >= deadline:
                raise EngineError(f"{self!r}: {refusal} (still refused after {tries} tries in {timeout:g} s)")
            await asyncio.sleep(DRAIN_POLL_SECONDS)

    async def ready(self) -> None:
        """Returns once the engine's server answers its health check (GET /health, which vLLM and SGLang serve),
        whatever it answers but 503: a router in front of the engines may not serve /health, and its requests
        say the rest. EngineUnreachableError while nothing accepts the connection or it answers 503 (the engine
        still loads its model)."""
        response = await self._send("GET", "/health")
        if response.status_code == 503:
            raise EngineUnreachableError(f"{self!r}: GET /health answered HTTP 503 (not serving yet): "
                                         f"{response.text[:200]}")

    async def _reported_weight_version(self, path: str) -> int | None:
        """The `weight_version` a GET of `path` reports, as an integer; None while it is none (the engines say
        "default" before any update)."""
        answer = await self._get(path)
        if not isinstance(answer, dict) or "weight_version" not in answer:
            raise shape_error(self, f"no weight_version in the {path} answer", answer)
        try:
            return int(answer["weight_version"])
        except (TypeError, ValueError):  # None or a name such as "default": no pacer version was recorded
            return None

    async def _confirm_loaded(self, version: int) -> int:
        """The version the engine reports loaded after a sync, which must be `version`."""
        loaded = await self.loaded_weight_version()
        if loaded != int(version):
            raise EngineError(f"{self!r}: the engine reports weight version {loaded} loaded after syncing {version}")
        return loaded

    async def aclose(self) -> None:
        """Closes the connection pools."""
        for pool in self._pools:
            await pool.aclose()

    async def __aenter__(self) -> HttpEngine:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.aclose()


def shape_error(engine: HttpEngine, what: str, answer: Any) -> EngineError:
    """An answer without the fields the adapter relies on (a different engine version, or a proxy's page)."""
    return EngineError(f"{engine!r}: unexpected answer, {what}: {str(answer)[:300]}")
