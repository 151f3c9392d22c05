"""Configuration: load conf/default.yaml + a user file + dotted overrides, inherit data sources, validate."""
from __future__ import annotations

import importlib.resources
import math
from pathlib import Path
from typing import Any, Iterable, Optional

from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from .errors import ConfigError
from .filters import FILTERS
from .plugins import load_custom_modules
from .strategy import STRATEGIES

RESET_MODES_BY_PARTIAL = {True: "abort", False: "wait"}


def default_config_path() -> Path:
    """The built-in conf/default.yaml, wherever the package is installed."""
    return Path(str(importlib.resources.files("coda_server").joinpath("conf", "default.yaml")))


def load_config(
    path: Optional[str | Path] = None,
    overrides: Iterable[str] = (),
    *,
    load_plugins: bool = True,
) -> DictConfig:
    """Defaults, then the file at `path` merged over them, then `key=value` overrides; validated.

    With `load_plugins`, custom strategy modules are imported first so their names validate.
    """
    try:
        config = OmegaConf.load(default_config_path())
        if path is not None:
            config = OmegaConf.merge(config, OmegaConf.load(path))
        overrides = list(overrides)
        for item in overrides:
            if "=" not in item:
                raise ConfigError(f"override {item!r} must look like key=value, e.g. fully_async.stale_steps=2.0")
        if overrides:
            config = OmegaConf.merge(config, OmegaConf.from_dotlist(overrides))
        config = inherit_data_source_defaults(config)
    except OmegaConfBaseException as exc:
        raise ConfigError(f"configuration could not be loaded: {exc}") from None
    except OSError as exc:
        raise ConfigError(f"configuration file could not be read: {exc}") from None
    if load_plugins:
        load_custom_modules(config.server.get("custom_strategy_dirs") or [])
    validate_config(config)
    return config


def inherit_data_source_defaults(config: DictConfig) -> DictConfig:
    """Give every `data_sources` entry the `data_source` defaults it does not set itself."""
    defaults = OmegaConf.to_container(config.get("data_source") or {}, resolve=True)
    entries = config.get("data_sources")
    if entries is None:
        entries = [defaults]
    if not isinstance(entries, (ListConfig, list)):
        raise ConfigError(f"data_sources = {entries!r}: must be a list of data source entries")
    merged = []
    for entry in entries:
        own = OmegaConf.to_container(entry, resolve=True) if isinstance(entry, (DictConfig, ListConfig)) else entry
        if not isinstance(own, dict):
            raise ConfigError(f"data_sources entry {own!r}: must be a mapping of data source options")
        merged.append({**defaults, **own})
    config.data_sources = merged
    return config


def validate_config(config: Any) -> None:
    """Raise ConfigError naming every invalid key, its value and what is allowed."""
    problems: list[str] = []

    def need(ok: bool, key: str, value: Any, allowed: str) -> None:
        if not ok:
            problems.append(f"{key} = {value!r}: {allowed}")

    stale = config.fully_async.get("stale_steps")
    need(_is_number(stale) and stale >= 0 and math.isfinite(stale), "fully_async.stale_steps", stale,
         "must be a finite number >= 0")
    sources = config.get("data_sources") or []
    need(len(sources) >= 1, "data_sources", list(sources), "must hold at least one data source")
    for i, source in enumerate(sources):
        b = source.get("num_prompts_per_step")
        n = source.get("num_trajectories_per_prompt")
        need(_is_int(b) and b >= 1, f"data_sources[{i}].num_prompts_per_step", b, "must be an integer >= 1")
        need(_is_int(n) and n >= 1, f"data_sources[{i}].num_trajectories_per_prompt", n,
             "group size must be an integer >= 1")
    m = config.trainer.get("mini_batch_size")
    need(_is_int(m) and m >= 1, "trainer.mini_batch_size", m, "must be an integer >= 1")
    if not problems and sources:
        b, n = sources[0].num_prompts_per_step, sources[0].num_trajectories_per_prompt
        need((b * n) % m == 0, "trainer.mini_batch_size", m,
             f"(B x N) = {b} x {n} = {b * n} must be a multiple of the mini-batch size")
    name = config.fully_async.get("sliding_window")
    need(name in STRATEGIES, "fully_async.sliding_window", name, f"registered strategies: {', '.join(STRATEGIES.names())}")
    filters = config.rollout.get("filter")
    filter_names = list(filters) if isinstance(filters, (list, ListConfig)) else None
    need(filter_names is not None, "rollout.filter", filters, "must be a list of filter names")
    for name in filter_names or []:
        need(name in FILTERS, "rollout.filter", name, f"registered filters: {', '.join(FILTERS.names())}")
    need(isinstance(config.rollout.get("partial"), bool), "rollout.partial", config.rollout.get("partial"),
         "must be true or false")
    _validate_server(config.server, need)
    if problems:
        raise ConfigError("invalid configuration:\n  " + "\n  ".join(problems))


def _validate_server(server: Any, need) -> None:
    address = server.get("address")
    need(isinstance(address, str) and address.strip() != "", "server.address", address,
         "must be host:port, e.g. 127.0.0.1:50051")
    dirs = server.get("custom_strategy_dirs")
    need(isinstance(dirs, (list, ListConfig)), "server.custom_strategy_dirs", dirs, "must be a list of directories")
    for key in ("max_message_bytes", "request_id_cache_size", "remembered_generations", "max_collect_groups",
                "max_dispatch_candidates", "max_submit_trajectories", "max_id_length", "step_reports_kept",
                "max_concurrent_rpcs"):
        value = server.get(key)
        need(_is_int(value) and value >= 1, f"server.{key}", value, "must be an integer >= 1")
    for key in ("max_wait_seconds", "shutdown_grace_seconds"):
        value = server.get(key)
        need(_is_number(value) and value >= 0 and math.isfinite(value), f"server.{key}", value,
             "must be a finite number >= 0")


def config_summary(config: Any) -> dict[str, str]:
    """The few settings that explain the window, as strings for GetState."""
    source = config.data_sources[0]
    return {
        "sliding_window": str(config.fully_async.sliding_window),
        "stale_steps": str(config.fully_async.stale_steps),
        "num_prompts_per_step": str(source.num_prompts_per_step),
        "num_trajectories_per_prompt": ",".join(str(s.num_trajectories_per_prompt) for s in config.data_sources),
        "mini_batch_size": str(config.trainer.mini_batch_size),
        "rollout_partial": str(config.rollout.partial).lower(),
        "filters": ",".join(config.rollout.filter),
    }


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)
