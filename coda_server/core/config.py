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
from .journal import FSYNC_POLICIES
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
        if isinstance(config.get("server"), DictConfig) and config.server.get("fsync") is False:
            config.server.fsync = "off"  # YAML reads a bare `off` (fsync: off, server.fsync=off) as false
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
    no_address = address is None or (isinstance(address, str) and address.strip() == "")
    need((isinstance(address, str) and not no_address) or (no_address and bool(server.get("uds_path"))),
         "server.address", address, "must be host:port, e.g. 127.0.0.1:50051 (may be \"\" only when server.uds_path is set)")
    dirs = server.get("custom_strategy_dirs")
    need(isinstance(dirs, (list, ListConfig)), "server.custom_strategy_dirs", dirs, "must be a list of directories")
    for key in ("max_message_bytes", "request_id_cache_size", "remembered_generations", "max_collect_groups",
                "max_dispatch_candidates", "max_submit_trajectories", "max_id_length", "step_reports_kept",
                "max_concurrent_rpcs", "max_waiting_calls", "max_waiting_collects", "max_watch_streams",
                "metrics_max_clients", "watch_queue_events"):
        value = server.get(key)
        need(_is_int(value) and value >= 1, f"server.{key}", value, "must be an integer >= 1")
    _validate_transport(server, need)
    for key in ("max_buffered_groups", "max_held_bytes"):
        value = server.get(key)
        need(_is_int(value) and value >= 0, f"server.{key}", value, "must be an integer >= 0 (0: no cap)")
    lease = server.get("inflight_lease_seconds")
    need(_is_number(lease) and lease >= 0 and math.isfinite(lease), "server.inflight_lease_seconds", lease,
         "must be a finite number >= 0 (0: no lease)")
    state_dir = server.get("state_dir")
    need(isinstance(state_dir, str), "server.state_dir", state_dir, "must be a directory path, or \"\" for memory only")
    need(server.get("fsync") in FSYNC_POLICIES, "server.fsync", server.get("fsync"),
         f"allowed: {', '.join(FSYNC_POLICIES)}")
    need(server.get("log_format") in ("text", "json"), "server.log_format", server.get("log_format"),
         "must be text or json")
    need(isinstance(server.get("log_rpcs"), bool), "server.log_rpcs", server.get("log_rpcs"), "must be true or false")
    metrics = server.get("metrics_address")
    need(metrics in ("", None) or parse_host_port(metrics) is not None, "server.metrics_address", metrics,
         "must be host:port with a port in 0..65535, e.g. 127.0.0.1:9464, or \"\" to disable metrics")
    for key in ("max_wait_seconds", "shutdown_grace_seconds"):
        value = server.get(key)
        need(_is_number(value) and value >= 0 and math.isfinite(value), f"server.{key}", value,
             "must be a finite number >= 0")
    for key in ("metrics_require_token", "metrics_tls"):
        need(isinstance(server.get(key, False), bool), f"server.{key}", server.get(key), "must be true or false")
    rates = server.get("client_rate_limits") or {}
    for key in ("dispatch_per_second", "submit_per_second", "burst"):
        value = rates.get(key, 0)
        need(_is_number(value) and value >= 0 and math.isfinite(value), f"server.client_rate_limits.{key}", value,
             "must be a finite number >= 0 (a rate of 0: no limit)")


def _validate_transport(server: Any, need) -> None:
    """Security and listener keys: token file, TLS files, Unix socket, health-only port."""
    for key in ("auth_token_file", "uds_path", "health_address"):
        value = server.get(key, "")
        need(value is None or isinstance(value, str), f"server.{key}", value, "must be a string (\"\" for none)")
    tls = server.get("tls") or {}
    files = {key: tls.get(key) or "" for key in ("cert_file", "key_file", "client_ca_file")}
    for key, value in files.items():
        need(isinstance(value, str), f"server.tls.{key}", value, "must be a path string (\"\" for none)")
    if all(isinstance(value, str) for value in files.values()):
        need(bool(files["cert_file"]) == bool(files["key_file"]), "server.tls", files,
             "cert_file and key_file must be set together")
        need(not files["client_ca_file"] or bool(files["cert_file"]), "server.tls.client_ca_file",
             files["client_ca_file"], "mutual TLS needs the server's own cert_file and key_file too")
    mode = server.get("uds_mode", "0660")
    need(parse_file_mode(mode) is not None, "server.uds_mode", mode,
         "must be an octal file mode between \"0000\" and \"0777\", written as a quoted string, e.g. \"0660\"")


def parse_file_mode(value: Any) -> Optional[int]:
    """A file mode from an octal string ("0660", "0o660", "660") or an int (YAML 1.1 reads 0660 as 432); None if invalid."""
    if isinstance(value, str):
        digits = value.strip().lower().removeprefix("0o")
        if not digits or any(c not in "01234567" for c in digits):
            return None
        mode = int(digits, 8)
    elif _is_int(value):
        mode = value
    else:
        return None
    return mode if 0 <= mode <= 0o777 else None


def parse_host_port(value: Any) -> Optional[tuple[str, int]]:
    """'host:port' (IPv6 as '[::1]:9464') -> (host, port), port in 0..65535; None when it is not one."""
    if not isinstance(value, str):
        return None
    host, sep, port = value.strip().rpartition(":")
    host = host.removeprefix("[").removesuffix("]")
    if not sep or not host or not port.isdigit() or int(port) > 65535:
        return None
    return host, int(port)


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
