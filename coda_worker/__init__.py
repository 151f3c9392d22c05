"""The rollout worker kit: the generation-worker loop and its engine adapters, built on coda_client's public API.

`pip install 'coda-pacer[worker]'` adds httpx for the vLLM and SGLang HTTP adapters; the loop and the engine
protocol need only the client.
"""

from typing import Any

from .engines import (AsyncEngine, Engine, EngineError, EngineUnreachableError, FakeEngine, FinishReason, Generation,
                      GenerationRequest, SamplingParams, ServedEngine)
from .engines import _ADAPTERS  # the HTTP adapters engines/__init__.py imports on first use
from .worker import (
    AsyncRolloutWorker,
    EngineFailedError,
    ListPromptSource,
    Prompt,
    PromptSource,
    RewardFn,
    RewardFunctionError,
    RolloutWorker,
    WorkerFailedError,
    WorkerStats,
    trajectory_id_of,
)


def __getattr__(name: str) -> Any:
    """VLLMEngine and SGLangEngine, imported on first use (they need httpx, so they stay out of `__all__`):
    `from coda_worker import VLLMEngine` works as `from coda_worker.engines import VLLMEngine` does."""
    if name in _ADAPTERS:
        from . import engines

        return getattr(engines, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "RolloutWorker",
    "AsyncRolloutWorker",
    "Prompt",
    "PromptSource",
    "ListPromptSource",
    "WorkerStats",
    "RewardFn",
    "WorkerFailedError",
    "RewardFunctionError",
    "EngineFailedError",
    "trajectory_id_of",
    "AsyncEngine",
    "ServedEngine",
    "FakeEngine",
    "Engine",
    "EngineError",
    "EngineUnreachableError",
    "FinishReason",
    "Generation",
    "GenerationRequest",
    "SamplingParams",
]
