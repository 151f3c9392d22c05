"""The HTTP plumbing both engine adapters share: one httpx.AsyncClient, JSON calls and their errors."""

from __future__ import annotations

from collections.abc import Mapping
from types import TracebackType
from typing import Any

try:
    import httpx
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise ImportError("the engine adapters need httpx: pip install 'coda-pacer[worker]'") from exc

from .base import EngineError

# Generation calls can take as long as a response does; the worker bounds them itself (aborts at a Reset).
DEFAULT_GENERATE_TIMEOUT_SECONDS = 3600.0
DEFAULT_CONTROL_TIMEOUT_SECONDS = 30.0


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
        self.base_url = base_url.rstrip("/")
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._generate_timeout = generate_timeout
        self._control_timeout = control_timeout
        self._http = httpx.AsyncClient(
            base_url=self.base_url,
            headers=headers,
            transport=transport,
            limits=httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections),
            # No proxy from the environment: an engine is a local or cluster-internal address.
            trust_env=False,
        )

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.base_url!r})"

    async def _post(
        self, path: str, body: Mapping[str, Any] | None = None, *, params: Mapping[str, str] | None = None,
        generate: bool = False,
    ) -> Any:
        """POSTs JSON and returns the decoded answer (None for an empty one); failures raise EngineError."""
        timeout = self._generate_timeout if generate else self._control_timeout
        try:
            response = await self._http.post(path, json=body if body is not None else {}, params=params,
                                             timeout=timeout)
        except httpx.HTTPError as exc:
            raise EngineError(f"{self!r}: POST {path} failed: {type(exc).__name__}: {exc}") from exc
        if response.status_code >= 400:
            raise EngineError(f"{self!r}: POST {path} answered HTTP {response.status_code}: {response.text[:500]}")
        if not response.content:
            return None
        try:
            return response.json()
        except ValueError as exc:
            raise EngineError(f"{self!r}: POST {path} answered with something that is not JSON: "
                              f"{response.text[:200]!r}") from exc

    async def aclose(self) -> None:
        """Closes the connection pool."""
        await self._http.aclose()

    async def __aenter__(self) -> HttpEngine:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.aclose()


def shape_error(engine: HttpEngine, what: str, answer: Any) -> EngineError:
    """An answer without the fields the adapter relies on (a different engine version, or a proxy's page)."""
    return EngineError(f"{engine!r}: unexpected answer, {what}: {str(answer)[:300]}")
