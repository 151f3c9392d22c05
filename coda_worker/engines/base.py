"""What a rollout worker asks of an inference engine: requests, results and the engine protocols."""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

__all__ = [
    "SamplingParams",
    "GenerationRequest",
    "Generation",
    "FinishReason",
    "Engine",
    "AsyncEngine",
    "ServedEngine",
    "EngineError",
]

# The longest one generate call of an engine may take before it counts as failed: the shipped adapters' HTTP
# timeout, and the worker loop's own bound for any engine (AsyncRolloutWorker's generate_timeout). A response can
# take minutes; one that takes an hour is an engine that stopped answering.
DEFAULT_GENERATE_TIMEOUT_SECONDS = 3600.0


class EngineError(RuntimeError):
    """The engine refused a request or could not be reached; the message says which and why."""


class EngineUnreachableError(EngineError):
    """No connection to the engine could be made (refused, unresolvable, or timed out while connecting): the
    request never reached it, so sending it again once the engine answers is safe."""


class FinishReason(str, enum.Enum):
    """Why a generation ended; the values are the engines' own words (vLLM and SGLang agree on them)."""

    STOP = "stop"  # an end-of-sequence or stop token
    LENGTH = "length"  # the token budget ran out
    ABORT = "abort"  # aborted (a Reset asked for it): the tokens are the partial response so far

    @classmethod
    def parse(cls, value: Any) -> FinishReason:
        """An engine's finish reason; an unknown word reads as STOP (the engine ended it on its own terms)."""
        try:
            return cls(str(value))
        except ValueError:
            return cls.STOP


@dataclass(frozen=True)
class SamplingParams:
    """Sampling settings of every trajectory a worker generates.

    max_tokens bounds a trajectory's whole response, continuations included: a trajectory continued
    after a Reset gets what is left of it. `extra` goes into the engine's request body as it is
    (engine-specific fields, e.g. vLLM's `min_tokens` or SGLang's `ignore_eos`).
    """

    max_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1: off
    stop_token_ids: tuple[int, ...] = ()
    seed: int | None = None
    extra: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens {self.max_tokens!r} must be an integer >= 1")
        if not self.temperature >= 0:
            raise ValueError(f"temperature {self.temperature!r} must be >= 0")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p {self.top_p!r} must be in (0, 1]")


@dataclass(frozen=True)
class GenerationRequest:
    """One generation call: the engine continues `input_ids` (the prompt, then any tokens generated so far)
    by at most `max_tokens` tokens. `request_id` is unique per call, so it can be aborted."""

    request_id: str
    input_ids: Sequence[int]
    max_tokens: int
    sampling: SamplingParams


def _as_list(values: Any, kind: type) -> list:
    """A list of Python numbers from a list, tuple, array.array or NumPy array (whose truth value is ambiguous)."""
    tolist = getattr(values, "tolist", None)
    if tolist is not None:
        values = tolist()
    return [kind(v) for v in values]


@dataclass(frozen=True)
class Generation:
    """What one generation call produced: the new tokens only, with their log-probabilities.

    token_ids and logprobs may be lists, tuples or NumPy arrays; they are kept as lists of Python numbers.
    finish_reason may be the engine's word ("stop", "length", "abort").
    """

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: FinishReason

    def __post_init__(self) -> None:
        object.__setattr__(self, "token_ids", _as_list(self.token_ids, int))
        object.__setattr__(self, "logprobs", _as_list(self.logprobs if self.logprobs is not None else (), float))
        if not isinstance(self.finish_reason, FinishReason):
            object.__setattr__(self, "finish_reason", FinishReason.parse(self.finish_reason))
        if self.logprobs and len(self.logprobs) != len(self.token_ids):
            raise EngineError(f"the engine returned {len(self.token_ids)} tokens but {len(self.logprobs)} logprobs")

    @property
    def aborted(self) -> bool:
        return self.finish_reason is FinishReason.ABORT


@runtime_checkable
class AsyncEngine(Protocol):
    """An engine driven from asyncio: the two calls the rollout worker's loop makes. `generate` returns
    when the request ends, also when it was aborted (then with the tokens generated until the abort and
    FinishReason.ABORT); `abort` ignores ids that are not running."""

    async def generate(self, request: GenerationRequest) -> Generation: ...

    async def abort(self, request_ids: Sequence[str]) -> None: ...


@runtime_checkable
class ServedEngine(AsyncEngine, Protocol):
    """What the shipped engines (VLLMEngine, SGLangEngine, FakeEngine) add to AsyncEngine: what the worker
    asks when present (`loaded_weight_version()`, the version a segment is tagged with; `ready()`, which returns
    once the engine answers and raises EngineUnreachableError while it cannot be reached) and what the
    documented worker and trainer programs call around the loop: `async with engine:` (closes its
    connections), `pause(mode)` / `resume()` of the whole engine, `sync_weights(weights_path, version)`
    (load new weights while nothing generates). VLLMEngine and FakeEngine also have
    `update_weight_version(version)`, a usual `on_resume` callback. The loop itself needs only AsyncEngine."""

    async def __aenter__(self) -> Any: ...

    async def __aexit__(self, exc_type: Any, exc: Any, tb: Any) -> None: ...

    async def aclose(self) -> None: ...

    async def pause(self, mode: str = "abort") -> None: ...

    async def resume(self) -> None: ...

    async def loaded_weight_version(self) -> int | None: ...

    async def ready(self) -> None: ...

    async def sync_weights(self, weights_path: str, version: int) -> int | None: ...


@runtime_checkable
class Engine(Protocol):
    """The blocking form of AsyncEngine; a worker calls `generate` from several threads at once."""

    def generate(self, request: GenerationRequest) -> Generation: ...

    def abort(self, request_ids: Sequence[str]) -> None: ...
