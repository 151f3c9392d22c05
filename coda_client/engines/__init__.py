"""Kept importable for existing workers: the engine adapters moved to `coda_worker.engines`."""

from typing import Any

import coda_worker.engines as _engines
from coda_worker.engines import __all__  # noqa: F401
from coda_worker.engines.base import (  # noqa: F401
    AsyncEngine,
    Engine,
    EngineError,
    FinishReason,
    Generation,
    GenerationRequest,
    SamplingParams,
)


def __getattr__(name: str) -> Any:  # VLLMEngine and SGLangEngine load httpx on first use, as in coda_worker.engines
    return getattr(_engines, name)
