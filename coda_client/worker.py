"""Kept importable for existing workers: the worker kit moved to the `coda_worker` package."""

from coda_worker.worker import *  # noqa: F401,F403
from coda_worker.worker import __all__  # noqa: F401
