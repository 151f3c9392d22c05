"""FakeEngine: an AsyncEngine that needs no GPU and no model, for trying the worker kit, tests and docs.

It behaves as the HTTP adapters do where the worker loop can tell: each request takes time (a fixed
first-token delay plus a per-token time, over a response length with a heavy tail, so a few requests
run far longer than the rest), `abort(ids)` ends those requests at once with the tokens generated so
far and FinishReason.ABORT, an id that is not running is ignored (as vLLM ignores it: an abort can
overtake its request), and a response that reaches its token budget ends with FinishReason.LENGTH.
Tokens are random (seeded) or scripted. Everything drawn for a request comes from a generator seeded
with (seed, request id), so a run is reproducible whatever order the requests arrive in.
"""

from __future__ import annotations

import asyncio
import math
import random
import time
from collections.abc import Callable, Sequence
from types import TracebackType
from typing import Union

from .base import FinishReason, Generation, GenerationRequest

__all__ = ["FakeEngine", "Script"]

# A script answers a request with the whole response it would generate (cut to the request's budget).
Script = Union[Callable[[GenerationRequest], Sequence[int]], Sequence[Sequence[int]]]


class _Running:
    """One request being generated: when it started, and the event that ends it early."""

    __slots__ = ("aborted", "started")

    def __init__(self) -> None:
        self.aborted = asyncio.Event()
        self.started = time.monotonic()


class FakeEngine:
    """An AsyncEngine that generates made-up tokens on a clock, without a model.

    seed: seeds every request's draws (with its request id). mean_tokens: the median response length;
    length_sigma: the spread of the log-normal length distribution (0: every response is mean_tokens
    long; 1.0, the default, gives a heavy tail: about 1 response in 20 is 5 times the median or more).
    first_token_seconds and seconds_per_token: the request's latency is first_token_seconds +
    length * seconds_per_token. vocab_size: random tokens are drawn from [0, vocab_size); eos_token_id:
    the token a response that ends on its own ends with (STOP), None for none. script: instead of random
    tokens, `script(request)` or the i-th sequence of a list (cycled, in request order) is the response.
    """

    def __init__(
        self,
        *,
        seed: int = 0,
        mean_tokens: int = 64,
        length_sigma: float = 1.0,
        first_token_seconds: float = 0.005,
        seconds_per_token: float = 0.0002,
        vocab_size: int = 32000,
        eos_token_id: int | None = None,
        script: Script | None = None,
    ) -> None:
        if mean_tokens < 1:
            raise ValueError(f"mean_tokens {mean_tokens!r} must be >= 1")
        if length_sigma < 0:
            raise ValueError(f"length_sigma {length_sigma!r} must be >= 0")
        if first_token_seconds < 0 or seconds_per_token < 0:
            raise ValueError("first_token_seconds and seconds_per_token must be >= 0")
        if vocab_size < 1:
            raise ValueError(f"vocab_size {vocab_size!r} must be >= 1")
        self.seed = seed
        self.mean_tokens = mean_tokens
        self.length_sigma = length_sigma
        self.first_token_seconds = first_token_seconds
        self.seconds_per_token = seconds_per_token
        self.vocab_size = vocab_size
        self.eos_token_id = eos_token_id
        self.script = script
        self.weight_version: int | str = 0
        self.synced_from: str | None = None
        self.paused = False
        self.requests = 0  # generate calls answered
        self.aborted = 0  # of them, ended by an abort
        self._script_index = 0
        self._running: dict[str, _Running] = {}

    def __repr__(self) -> str:
        return f"FakeEngine(seed={self.seed}, mean_tokens={self.mean_tokens}, length_sigma={self.length_sigma})"

    def _response(self, request: GenerationRequest, rng: random.Random) -> tuple[list[int], FinishReason]:
        """The whole response this request would get if nothing aborted it, and how it would end."""
        if self.script is not None:
            if callable(self.script):
                tokens = [int(t) for t in self.script(request)]
            else:
                tokens = [int(t) for t in self.script[self._script_index % len(self.script)]]
                self._script_index += 1
            if len(tokens) > request.max_tokens:
                return tokens[:request.max_tokens], FinishReason.LENGTH
            return tokens, FinishReason.STOP
        length = max(1, round(self.mean_tokens * math.exp(rng.gauss(0.0, self.length_sigma)))) \
            if self.length_sigma else self.mean_tokens
        finish = FinishReason.STOP
        if length >= request.max_tokens:
            length, finish = request.max_tokens, FinishReason.LENGTH
        tokens = [rng.randrange(self.vocab_size) for _ in range(length)]
        if finish is FinishReason.STOP and self.eos_token_id is not None:
            tokens[-1] = self.eos_token_id
        return tokens, finish

    def _latency(self, tokens: int) -> float:
        return self.first_token_seconds + tokens * self.seconds_per_token

    async def generate(self, request: GenerationRequest) -> Generation:
        """Generates on the clock; an abort ends it early with the tokens made until then and FinishReason.ABORT."""
        rng = random.Random(f"{self.seed}:{request.request_id}")
        tokens, finish = self._response(request, rng)
        logprobs = [-rng.expovariate(1.0) for _ in tokens]
        running = self._running[request.request_id] = _Running()
        try:
            try:
                await asyncio.wait_for(running.aborted.wait(), self._latency(len(tokens)))
            except asyncio.TimeoutError:  # ran to its end
                return Generation(tokens, logprobs, finish)
            # Aborted: the tokens generated in the time it ran (the first one only after the first-token delay).
            elapsed = time.monotonic() - running.started - self.first_token_seconds
            made = len(tokens) if self.seconds_per_token == 0 else int(max(0.0, elapsed) / self.seconds_per_token)
            made = min(made, len(tokens)) if elapsed > 0 else 0
            self.aborted += 1
            return Generation(tokens[:made], logprobs[:made], FinishReason.ABORT)
        finally:
            self.requests += 1
            del self._running[request.request_id]

    async def abort(self, request_ids: Sequence[str]) -> None:
        """Ends these requests now (they answer with their partial tokens); ids not running are ignored."""
        for request_id in request_ids:
            running = self._running.get(request_id)
            if running is not None:
                running.aborted.set()

    async def pause(self, mode: str = "abort") -> None:
        """Records the pause; with "abort", aborts every running request, as the engines' pause does."""
        self.paused = True
        if mode == "abort":
            await self.abort(list(self._running))

    async def resume(self) -> None:
        self.paused = False

    async def update_weight_version(self, version: int | str) -> None:
        """Records the weight version (a real engine would load or tag the new weights here)."""
        self.weight_version = version

    async def ready(self) -> None:
        """Always ready: there is nothing to connect to."""

    async def loaded_weight_version(self) -> int | None:
        """The version last recorded (update_weight_version or sync_weights), as the worker asks it."""
        try:
            return int(self.weight_version)
        except (TypeError, ValueError):
            return None

    async def sync_weights(self, weights_path: str, version: int) -> int | None:
        """Records `version` as loaded (there are no weights to read); returns it, as the real adapters do."""
        self.weight_version = version
        self.synced_from = weights_path
        return await self.loaded_weight_version()

    @property
    def running(self) -> int:
        """Requests generating right now."""
        return len(self._running)

    async def aclose(self) -> None:
        """Aborts whatever still runs (nothing to release otherwise)."""
        await self.abort(list(self._running))

    async def __aenter__(self) -> FakeEngine:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.aclose()
