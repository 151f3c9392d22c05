"""Kept importable: moved to `coda_worker.engines.vllm`."""

from coda_worker.engines.vllm import *  # noqa: F401,F403
