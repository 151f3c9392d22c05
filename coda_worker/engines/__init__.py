"""Inference engines a RolloutWorker drives: the engine protocol, HTTP adapters for vLLM and SGLang, and FakeEngine.

The protocol, the request types and FakeEngine (no GPU, no model) need nothing beyond the standard
library; the HTTP adapters need httpx (`pip install 'coda-pacer[worker]'`) and are imported on first use.
"""

from __future__ import annotations

from typing import Any

from .base import (
    AsyncEngine,
    Engine,
    EngineError,
    EngineUnreachableError,
    FinishReason,
    Generation,
    GenerationRequest,
    SamplingParams,
    ServedEngine,
)
from .fake import FakeEngine

__all__ = [
    "AsyncEngine",
    "Engine",
    "EngineError",
    "EngineUnreachableError",
    "FinishReason",
    "Generation",
    "GenerationRequest",
    "SamplingParams",
    "ServedEngine",
    "FakeEngine",
    "VLLMEngine",
    "SGLangEngine",
]

_ADAPTERS = {"VLLMEngine": ".vllm", "SGLangEngine": ".sglang"}


def __getattr__(name: str) -> Any:
    if name in _ADAPTERS:
        from importlib import import_module

        return getattr(import_module(_ADAPTERS[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
