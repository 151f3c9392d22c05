"""The rollout worker kit: the generation-worker loop and its engine adapters, built on coda_client's public API.

`pip install 'coda-pacer[worker]'` adds httpx for the vLLM and SGLang HTTP adapters; the loop and the engine
protocol need only the client.
"""

from .engines import (AsyncEngine, Engine, EngineError, EngineUnreachableError, FakeEngine, FinishReason, Generation,
                      GenerationRequest, SamplingParams, ServedEngine)
from .worker import (
    AsyncRolloutWorker,
    ListPromptSource,
    Prompt,
    PromptSource,
    RewardFn,
    RolloutWorker,
    WorkerStats,
    trajectory_id_of,
)

__all__ = [
    "RolloutWorker",
    "AsyncRolloutWorker",
    "Prompt",
    "PromptSource",
    "ListPromptSource",
    "WorkerStats",
    "RewardFn",
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
