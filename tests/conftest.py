"""Shared fixtures. Keep this small: helpers used by one test file belong in that file."""
from __future__ import annotations

import copy
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]


def read_pyproject() -> dict:
    """pyproject.toml, parsed (tomllib is in the standard library from 3.11; the test extra installs tomli for 3.10)."""
    if sys.version_info >= (3, 11):
        import tomllib
    else:
        import tomli as tomllib
    return tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())
EXAMPLE_STRATEGIES = REPO_ROOT / "examples" / "strategies"


def core_overrides(strategy: str = "no-window", *, B: int = 4, stale: float = 1.0, N: int = 2, M: int | None = None,
                   filters: str = "[status]", continue_restored: bool = False,
                   extra: tuple[str, ...] = ()) -> list[str]:
    """Dotted overrides for a small pacing config (single data source unless `extra` adds more).

    Restored groups come back to the Reset's caller unless `continue_restored`: most tests follow a
    group through one step and look at it in the Reset answer; the continuation tests ask for it.
    """
    overrides = [
        f"rollout.continue_restored={'true' if continue_restored else 'false'}",
        f"fully_async.sliding_window={strategy}",
        f"fully_async.stale_steps={float(stale)}",
        f"data_source.num_prompts_per_step={B}",
        f"data_source.num_trajectories_per_prompt={N}",
        f"trainer.mini_batch_size={M if M is not None else N}",
        f"rollout.filter={filters}",
    ]
    if strategy == "fixed-capacity":
        overrides.append(f"server.custom_strategy_dirs=[{EXAMPLE_STRATEGIES}]")
    return overrides + list(extra)


_CONFIGS: dict = {}


def load_core_config(strategy: str = "no-window", **kwargs):
    """A validated DictConfig for `core_overrides(strategy, **kwargs)`; loaded once, a fresh copy each call."""
    from coda_server.core import load_config

    overrides = tuple(core_overrides(strategy, **kwargs))
    if overrides not in _CONFIGS:
        _CONFIGS[overrides] = load_config(overrides=overrides)
    return copy.deepcopy(_CONFIGS[overrides])


@pytest.fixture
def core_config():
    """`core_config(strategy, B=, stale=, N=, M=, filters=, extra=)` -> a validated DictConfig."""
    return load_core_config


@pytest.fixture
def core_pacer(core_config):
    """`core_pacer(strategy, **core_config kwargs)` -> a fresh `Pacer` (closed after the test)."""
    from coda_server.core import Pacer

    made = []

    def make(strategy: str = "no-window", **kwargs):
        pacer = Pacer(core_config(strategy, **kwargs))
        made.append(pacer)
        return pacer

    yield make
    for pacer in made:
        pacer.close()


@pytest.fixture
def scratch_registry():
    """Strategies and filters a test registers are forgotten after it, so later sweeps over every
    registered strategy (e.g. coda-sim --compare) see only the real ones. The shipped example stays."""
    from coda_server.core.filters import FILTERS
    from coda_server.core.plugins import load_custom_modules
    from coda_server.core.strategy import STRATEGIES

    load_custom_modules([str(EXAMPLE_STRATEGIES)])
    saved = {registry: registry.saved() for registry in (STRATEGIES, FILTERS)}
    yield
    for registry, classes in saved.items():
        registry.restore(classes)


@pytest.fixture
def poll_attempts(monkeypatch):
    """`poll_attempts(PollClass)` -> a one-item list counting that poll class's attempts from then on (whether a
    change woke a waiting call)."""
    def count(poll_class):
        attempts = [0]
        attempt = poll_class.attempt

        def counted(self):
            attempts[0] += 1
            return attempt(self)

        monkeypatch.setattr(poll_class, "attempt", counted)
        return attempts

    return count
