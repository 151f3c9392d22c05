"""Thin Python client of the coda-pacer rollout pacing service (depends only on grpcio and protobuf)."""

# The public names load on first use (PEP 562), so `import coda_client.protocol` (the plain-data module the
# server and its grpc-free core share with the client) does not import grpc.
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_MODULE_OF = {
    "TlsConfig": "_channel",
    "AsyncBatchIterator": "batches",
    "BatchIterator": "batches",
    "GroupView": "batches",
    "MiniBatch": "batches",
    "PaddedBatch": "batches",
    "AsyncControlStream": "client",
    "AsyncPacerClient": "client",
    "ControlStream": "client",
    "PacerClient": "client",
    "BadRequestError": "errors",
    "DeadlineExceededError": "errors",
    "FailedPreconditionError": "errors",
    "FieldViolation": "errors",
    "PacerClientError": "errors",
    "ResourceExhaustedError": "errors",
    "ServerGoneError": "errors",
    "StaleGenerationError": "errors",
    "UnauthenticatedError": "errors",
    "UnavailableError": "errors",
    "UnknownPromptError": "errors",
    "UnknownLeaseError": "errors",
    "translate": "errors",
    "Checkpoint": "types",
    "CollectResult": "types",
    "CollectShape": "types",
    "ControlEvent": "types",
    "ControlEventType": "types",
    "DispatchResult": "types",
    "HeldGroup": "types",
    "JobEndReport": "types",
    "Incident": "types",
    "KeepAliveResult": "types",
    "PacerState": "types",
    "PromptCursor": "types",
    "PromptRef": "types",
    "ResetMode": "types",
    "ResetResult": "types",
    "RestoreResult": "types",
    "ResumeResult": "types",
    "StepReport": "types",
    "SubmitResult": "types",
    "Trajectory": "types",
    "TrajectoryGroup": "types",
    "TrajectoryStatus": "types",
    "WorkerHoldings": "types",
}

if TYPE_CHECKING:  # what static tools see: the same names, imported eagerly
    from ._channel import TlsConfig  # noqa: F401
    from .batches import AsyncBatchIterator, BatchIterator, GroupView, MiniBatch, PaddedBatch  # noqa: F401
    from .client import AsyncControlStream, AsyncPacerClient, ControlStream, PacerClient  # noqa: F401
    from .errors import (  # noqa: F401
        BadRequestError, DeadlineExceededError, FailedPreconditionError, FieldViolation, PacerClientError,
        ResourceExhaustedError, ServerGoneError, StaleGenerationError, UnauthenticatedError, UnavailableError,
        UnknownLeaseError, UnknownPromptError, translate,
    )
    from .types import (  # noqa: F401
        Checkpoint, CollectResult, CollectShape, ControlEvent, ControlEventType, DispatchResult, HeldGroup, Incident,
        JobEndReport, KeepAliveResult, PacerState, PromptCursor, PromptRef, ResetMode, ResetResult, RestoreResult,
        ResumeResult, StepReport, SubmitResult, Trajectory, TrajectoryGroup, TrajectoryStatus, WorkerHoldings,
    )


# The rollout worker kit's public names (coda_worker.__all__ and its HTTP adapters), which users reach for here: the
# import says where they are. An ImportError, as `from coda_client import RolloutWorker` would otherwise replace an
# AttributeError's message with Python's plain "cannot import name".
_IN_THE_WORKER_KIT = frozenset({
    "RolloutWorker", "AsyncRolloutWorker", "Prompt", "PromptSource", "ListPromptSource", "WorkerStats", "RewardFn",
    "WorkerFailedError", "RewardFunctionError", "EngineFailedError", "trajectory_id_of", "AsyncEngine", "ServedEngine",
    "FakeEngine", "Engine", "EngineError", "EngineUnreachableError", "FinishReason", "Generation", "GenerationRequest",
    "SamplingParams", "VLLMEngine", "SGLangEngine",
})


def __getattr__(name: str) -> Any:
    module = _MODULE_OF.get(name)
    if module is None:
        if name in _IN_THE_WORKER_KIT:
            raise ImportError(f"{name} is in the rollout worker kit, not the client: from coda_worker import {name} "
                              "(the same distribution; pip install 'coda-pacer[worker]' adds httpx for the vLLM and "
                              "SGLang adapters)", name=name)
        raise AttributeError(f"module 'coda_client' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_MODULE_OF))


__all__ = [
    "PacerClient",
    "AsyncPacerClient",
    "ControlStream",
    "AsyncControlStream",
    "TlsConfig",
    "BatchIterator",
    "AsyncBatchIterator",
    "MiniBatch",
    "GroupView",
    "PaddedBatch",
    "Trajectory",
    "StepReport",
    "Incident",
    "TrajectoryStatus",
    "TrajectoryGroup",
    "PromptRef",
    "HeldGroup",
    "WorkerHoldings",
    "DispatchResult",
    "KeepAliveResult",
    "SubmitResult",
    "CollectResult",
    "CollectShape",
    "ResetResult",
    "ResumeResult",
    "Checkpoint",
    "RestoreResult",
    "PromptCursor",
    "PacerState",
    "ControlEvent",
    "ControlEventType",
    "JobEndReport",
    "ResetMode",
    "PacerClientError",
    "BadRequestError",
    "UnknownPromptError",
    "UnknownLeaseError",
    "StaleGenerationError",
    "FailedPreconditionError",
    "ResourceExhaustedError",
    "UnauthenticatedError",
    "UnavailableError",
    "ServerGoneError",
    "DeadlineExceededError",
    "FieldViolation",
    "translate",
]
