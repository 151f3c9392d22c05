"""Kept importable: moved to `coda_worker.engines.sglang`."""

from coda_worker.engines.sglang import *  # noqa: F401,F403
