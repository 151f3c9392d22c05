"""Inference engines a RolloutWorker drives: the engine protocol and HTTP adapters for vLLM and SGLang.

The protocol and request types need nothing beyond the standard library; the adapters need httpx
(`pip install 'coda-pacer[worker]'`) and are imported on first use.
"""

from __future__ import annotations

from typing import Any

from .base import (
    AsyncEngine,
    Engine,
    EngineError,
    FinishReason,
    Generation,
    GenerationRequest,
    SamplingParams,
)

__all__ = [
    "AsyncEngine",
    "Engine",
    "EngineError",
    "FinishReason",
    "Generation",
    "GenerationRequest",
    "SamplingParams",
    "VLLMEngine",
    "SGLangEngine",
]

_ADAPTERS = {"VLLMEngine": ".vllm", "SGLangEngine": ".sglang"}


def __getattr__(name: str) -> Any:
    if name in _ADAPTERS:
        from importlib import import_module

        return getattr(import_module(_ADAPTERS[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
