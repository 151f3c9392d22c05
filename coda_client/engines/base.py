"""Kept importable: moved to `coda_worker.engines.base`."""

from coda_worker.engines.base import *  # noqa: F401,F403
