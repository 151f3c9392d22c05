"""Configuration: load conf/default.yaml + a user file + dotted overrides, inherit data sources, validate."""
from __future__ import annotations

import importlib.resources
import logging
from pathlib import Path
from typing import Any, Iterable, Optional

import yaml
from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from .errors import ConfigError
from .filters import FILTERS, filter_problems, filter_specs, normalize_filters
from .plugins import load_custom_modules
from .replay import REPLAY_STRATEGIES, check_replay_strategy
from .settings import (SCHEMA, SCHEMA_BY_PATH, SECTIONS, lookup, mapping_paths, mapping_problem,  # noqa: F401
                       setting, parse_file_mode, parse_host_port, unknown_key_problems)
from .strategy import STRATEGIES, options_section, window_size

RESET_MODES_BY_PARTIAL = {True: "abort", False: "wait"}
_ABSENT = object()

log = logging.getLogger("coda_server.config")


def default_config_path() -> Path:
    """The built-in conf/default.yaml, wherever the package is installed."""
    return Path(str(importlib.resources.files("coda_server").joinpath("conf", "default.yaml")))


def load_config(
    path: Optional[str | Path] = None,
    overrides: Iterable[str] = (),
    *,
    config_dir: Optional[str | Path] = None,
    config_name: Optional[str] = None,
    load_plugins: bool = True,
) -> DictConfig:
    """The built-in defaults, the run configuration over them, then the overrides; validated.

    The run configuration is either the YAML file at `path` (merged as it is; a Hydra defaults list in it is
    composed with Hydra from the file's own directory, or refused) or, with `config_dir` and `config_name`,
    composed by Hydra exactly as a Hydra application (LoongSage's trainer) composes it; then the overrides use
    Hydra's syntax. With `load_plugins`, custom strategy modules are imported first so their names validate.
    """
    overrides = [str(item) for item in overrides]
    try:
        config = OmegaConf.load(default_config_path())
        if config_name is not None or config_dir is not None:
            config = _merge_layer(config, *compose_hydra(config_dir, config_name, overrides, config))
            log.info("run config %s composed with Hydra from %s", config_name, Path(config_dir).resolve())
        else:
            if path is not None:
                config = _merge_layer(config, read_config_file(path))
            if overrides:
                config = _merge_layer(config, parse_overrides(overrides, hydra_by="--config-path/--config-name"))
        _check_sections(config)
        config = inherit_data_source_defaults(config)
        if isinstance(config.get("server"), DictConfig) and config.server.get("fsync") is False:
            config.server.fsync = "off"  # YAML reads a bare `off` (fsync: off, server.fsync=off) as false
    except OmegaConfBaseException as exc:
        raise ConfigError(_omegaconf_problem(exc)) from None
    except OSError as exc:
        raise ConfigError(f"configuration file could not be read: {exc}") from None
    try:
        if load_plugins:
            load_custom_modules(_plugin_directories(config))
        validate_config(config)
        config.rollout.filter = normalize_filters(config.rollout.filter)
    except OmegaConfBaseException as exc:  # e.g. an interpolation to a key that does not exist
        raise ConfigError(_omegaconf_problem(exc)) from None
    return config


def _plugin_directories(config: DictConfig) -> list[str]:
    """server.custom_strategy_dirs, checked before anything is imported from it (a bare path string would otherwise
    be read one character at a time, and "." or "/" import whatever lies there)."""
    key = SCHEMA_BY_PATH["server.custom_strategy_dirs"]
    directories = config.server.get("custom_strategy_dirs")
    if directories is None:
        return []
    problem = key.problem(directories)
    if problem is not None:
        shown = OmegaConf.to_container(directories) if isinstance(directories, ListConfig) else directories
        raise ConfigError(f"invalid configuration:\n  {key.path} = {shown!r}: {problem}")
    return [str(directory) for directory in directories]


def read_yaml_mapping(path: str | Path, holds: str = "section: {key: value}") -> DictConfig:
    """The YAML file at `path` (a --config file), which must hold a mapping; ConfigError naming the file and what is
    wrong with it (`holds`: what the mapping holds, for the message)."""
    try:
        raw = OmegaConf.load(path)
    except OmegaConfBaseException as exc:
        raise ConfigError(f"--config {path}: {_omegaconf_problem(exc)}") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"--config {path} is not valid YAML: {' '.join(str(exc).split())}") from None
    if not isinstance(raw, DictConfig):
        what = "a list" if isinstance(raw, ListConfig) else f"a {type(raw).__name__}"
        raise ConfigError(f"--config {path} must hold a mapping of configuration keys ({holds}), not {what}")
    return raw


def read_config_file(path: str | Path) -> DictConfig:
    """The YAML file at `path`; a Hydra defaults list in it is composed by Hydra or refused, never ignored."""
    path = Path(path)
    raw = read_yaml_mapping(path)
    defaults = raw.get("defaults")
    if defaults is None:
        return raw
    entries = OmegaConf.to_container(defaults) if isinstance(defaults, ListConfig) else defaults
    if isinstance(entries, list) and all(entry == "_self_" for entry in entries):
        del raw["defaults"]  # nothing to compose: the file is its own configuration
        return raw
    try:
        composed, _ = compose_hydra(path.parent, path.stem, [], None)
    except ConfigError as exc:
        directory, name = _suggest_hydra_layout(path, entries)
        raise ConfigError(
            f"--config {path} starts from a Hydra defaults list (defaults: {_flow(entries)}) that cannot be "
            f"resolved from the file's own directory {path.parent} ({exc}). Compose it the way the training job "
            f"does: coda-server --config-path {directory} --config-name {name} [key=value ...]") from None
    log.info("--config %s: composed its defaults list %s with Hydra from %s", path, _flow(entries), path.parent)
    return composed


def compose_hydra(config_dir: Optional[str | Path], config_name: Optional[str], overrides: list[str],
                  service_defaults: Optional[DictConfig]) -> tuple[DictConfig, DictConfig]:
    """Compose `config_name` from `config_dir` with Hydra's compose API (defaults lists, packages, overrides).

    Returns (composed run config, service overrides). An override of a key the run configuration does not
    have but `service_defaults` does (the service's own options, e.g. server.address) cannot go through
    Hydra, which refuses unknown keys; it is applied over the merged result, with the same syntax.
    """
    if config_dir is None or config_name is None:
        raise ConfigError("--config-path DIR and --config-name NAME go together (Hydra composition), "
                          "e.g. --config-path conf --config-name qwen3_30b_a3b/dapo_h20_1node")
    directory = Path(config_dir).resolve()
    if not directory.is_dir():
        raise ConfigError(f"--config-path {config_dir}: not a directory")
    name = str(config_name).removesuffix(".yaml")
    try:
        from hydra import compose, initialize_config_dir
        from hydra.core.global_hydra import GlobalHydra
        from hydra.core.override_parser.overrides_parser import OverridesParser
        from hydra.core.override_parser.types import OverrideType
        from hydra.errors import HydraException
    except ImportError as exc:  # a dependency of the server; missing only in a broken install
        raise ConfigError(f"--config-path/--config-name need hydra-core: {exc}") from None
    try:
        parsed = OverridesParser.create().parse_overrides(overrides)
    except HydraException as exc:
        raise ConfigError(f"override could not be parsed (Hydra syntax, e.g. key=value, +key=value, ~key): "
                          f"{_first_line(exc)}") from None
    GlobalHydra.instance().clear()  # compose may run more than once in a process (tests, the simulator)
    try:
        with initialize_config_dir(config_dir=str(directory), version_base=None):
            plain = compose(config_name=name)
            hydra_lines, service = [], []
            for override, line in zip(parsed, overrides):
                ours = (service_defaults is not None and override.type == OverrideType.CHANGE and override.package is None
                        and not _has_key(plain, override.key_or_group) and _has_key(service_defaults, override.key_or_group))
                (service if ours else hydra_lines).append((override, line))
            composed = compose(config_name=name, overrides=[line for _, line in hydra_lines]) if hydra_lines else plain
    except HydraException as exc:
        raise ConfigError(f"Hydra could not compose --config-name {name} from --config-path {directory}: "
                          f"{_one_line(exc)}") from None
    finally:
        GlobalHydra.instance().clear()
    OmegaConf.set_struct(composed, False)
    updates = OmegaConf.create()
    for override, _ in service:
        OmegaConf.update(updates, override.key_or_group, override.value(), merge=True)
    return composed, updates


def _has_key(config: DictConfig, dotted: str) -> bool:
    node: Any = config
    for part in dotted.split("."):
        if not isinstance(node, DictConfig) or part not in node:
            return False
        node = node._get_node(part)
    return True


def _merge_layer(base: DictConfig, *layers: DictConfig) -> DictConfig:
    """OmegaConf.merge, except for `rollout.filter`: two mappings merge key by key (LoongSage's rule: a same-name
    key overrides, `name: false` turns a filter off, a new key appends), anything else (a list) replaces."""
    for layer in layers:
        # Before the merge: a section or sub-mapping given as a scalar would be replaced by (or merge into) a
        # later layer's keys and lose every default under it, to fail far from the key that is wrong.
        _refuse_non_mappings(layer, sections_may_be_null=False)
        replacement: Any = _ABSENT
        rollout = layer.get("rollout") if isinstance(layer, DictConfig) else None
        if isinstance(rollout, DictConfig) and "filter" in rollout:
            theirs = OmegaConf.to_container(rollout)["filter"]
            base_rollout = base.get("rollout")
            ours = OmegaConf.to_container(base_rollout).get("filter") if isinstance(base_rollout, DictConfig) else None
            if not (isinstance(theirs, dict) and isinstance(ours, dict)):
                replacement = theirs
                layer = layer.copy()
                del layer.rollout["filter"]
        base = OmegaConf.merge(base, layer)
        if replacement is not _ABSENT:
            base.rollout.filter = replacement
    return base


def _refuse_non_mappings(config: Any, *, sections_may_be_null: bool) -> None:
    """ConfigError naming every section, sub-mapping (server.tls, server.client_rate_limits,
    data_source.dataset) or strategy option section (fully_async.latency_aware) of `config` (a layer or the
    merged configuration) that holds something other than a mapping; null is allowed below the sections."""
    paths = mapping_paths(strategy_option_sections())
    problems: list[str] = []

    def visit(node: Any, path: str, shown: str) -> None:
        for name in list(node.keys()):
            child_path = f"{path}.{name}" if path else str(name)
            if child_path not in paths or _is_interpolation(node, name):
                continue  # an interpolation is judged once resolved (_check_sections)
            value = node.get(name)
            child_shown = f"{shown}.{name}" if shown else str(name)
            if isinstance(value, (DictConfig, dict)):
                visit(value, child_path, child_shown)
            elif value is not None or (child_path in SECTIONS and not sections_may_be_null):
                shown_value = OmegaConf.to_container(value) if isinstance(value, ListConfig) else value
                problems.append(mapping_problem(child_shown, shown_value, paths[child_path]))

    if not isinstance(config, (DictConfig, dict)):
        return
    visit(config, "", "")
    entries = None if _is_interpolation(config, "data_sources") else config.get("data_sources")
    if isinstance(entries, (ListConfig, list)):
        for i in range(len(entries)):
            entry = None if _is_interpolation(entries, i) else entries[i]
            if isinstance(entry, (DictConfig, dict)):
                visit(entry, "data_source", f"data_sources[{i}]")
    if problems:
        raise ConfigError("invalid configuration:\n  " + "\n  ".join(problems))


def _is_interpolation(node: Any, key: Any) -> bool:
    if not isinstance(node, (DictConfig, ListConfig)):
        return False
    try:
        return OmegaConf.is_interpolation(node, key)
    except (OmegaConfBaseException, KeyError, IndexError, ValueError):
        return False


def parse_overrides(overrides: list[str], example: str = "fully_async.stale_steps=2.0",
                    hydra_by: str = "") -> DictConfig:
    """`key=value` overrides as one configuration layer, each value read as YAML; ConfigError naming an override
    that is not key=value (`example` shows one) or whose value is not YAML (a bare `[::1]:0` opens a YAML list),
    and how to pass it as a string. An override in Hydra's syntax (`+key=value`, `~key`) is refused saying so,
    where that syntax is valid (`hydra_by`: the options that compose with Hydra, if the command has them) and the
    plain override to write instead."""
    for item in overrides:
        refusal = _hydra_syntax_refusal(item, hydra_by)
        if refusal is not None:
            raise ConfigError(refusal)
        if "=" not in item:
            raise ConfigError(f"override {item!r} must look like key=value, e.g. {example}")
    try:
        return OmegaConf.from_dotlist(overrides)
    except yaml.YAMLError:
        for item in overrides:
            try:
                OmegaConf.from_dotlist([item])
            except yaml.YAMLError as exc:
                key, _, value = item.partition("=")
                raise ConfigError(f"override {item!r}: the value {value!r} does not read as YAML ({_first_line(exc)}); "
                                  f"to pass it as a string, quote it inside the shell's quotes: {key}='\"{value}\"'"
                                  ) from None
        raise


def _hydra_syntax_refusal(item: str, hydra_by: str) -> Optional[str]:
    """The refusal of a plain override written in Hydra's syntax (+key=value, ++key=value, ~key), or None: OmegaConf
    would take the prefix for part of the key name (an unknown section "+rollout"), and ~key has no "="."""
    prefix = next((p for p in ("++", "+", "~") if item.startswith(p)), None)
    if prefix is None:
        return None
    key, has_value, value = item[len(prefix):].partition("=")
    key = key.strip()
    where = (f"valid with {hydra_by} (a run config Hydra composes); without them" if hydra_by
             else "which these overrides do not take;")
    if prefix == "~":
        what = "~key (delete a key)"
        if key.startswith("rollout.filter.") and key != "rollout.filter.":
            instead = f"cannot delete a key; a filter is turned off by its name set to false: write {key}=false"
        elif key == "rollout.filter":
            instead = "cannot delete a key; every filter is taken out by an empty list: write rollout.filter=[]"
        else:
            instead = (f"cannot delete a key: set {key} to the value you want (conf/default.yaml has the defaults) or "
                       f"leave it out of the --config file")
    else:
        what = f"{prefix}key=value ({'add or override' if prefix == '++' else 'add'} a key)"
        instead = f"adds a key or changes it: write {key}={value if has_value else 'VALUE'}"
    return (f"override {item!r}: {what} is Hydra's override syntax, {where} an override is plain key=value, "
            f"which {instead}")


def _omegaconf_problem(exc: OmegaConfBaseException) -> str:
    key = getattr(exc, "full_key", None)
    where = f" at key {key}" if key else ""
    return f"configuration could not be loaded{where}: {_first_line(exc)}"


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def _one_line(exc: BaseException) -> str:
    """Hydra's message (its hint on a second line included), without the search-path listing it may append."""
    text = str(exc).split("\n\nConfig search path")[0]
    return " ".join(line.strip() for line in text.splitlines() if line.strip()) or type(exc).__name__


def _flow(entries: Any) -> str:
    """A defaults list as YAML flow text, e.g. [/default, _self_]."""
    if isinstance(entries, list):
        return "[" + ", ".join(_flow(entry) for entry in entries) + "]"
    if isinstance(entries, dict):
        return "{" + ", ".join(f"{key}: {_flow(value)}" for key, value in entries.items()) + "}"
    return str(entries)


def _suggest_hydra_layout(path: Path, entries: Any) -> tuple[str, str]:
    """(--config-path, --config-name) under which the defaults list of `path` resolves: the nearest directory
    above the file holding every config the list names; placeholders when there is none."""
    named = [entry for entry in (entries if isinstance(entries, list) else [entries]) if entry != "_self_"]
    resolved = path.resolve()
    for directory in resolved.parents:
        name = resolved.relative_to(directory).with_suffix("")
        if all(_defaults_entry_exists(directory, name.parent, entry) for entry in named):
            return str(directory), name.as_posix()
    return "CONF_DIR", f"{path.stem}  (CONF_DIR: the directory the defaults list's names are relative to)"


def _defaults_entry_exists(root: Path, group: Path, entry: Any) -> bool:
    if isinstance(entry, str):
        target = entry
    elif isinstance(entry, dict) and len(entry) == 1:
        ((key, value),) = entry.items()
        key = str(key).split("@")[0].removeprefix("override ").removeprefix("optional ").strip()
        target = f"{key}/{value}"
    else:
        return False
    target = target.split("@")[0]
    base = root if target.startswith("/") else root / group
    return (base / f"{target.lstrip('/')}.yaml").is_file()


def _check_sections(config: DictConfig) -> None:
    """Each section the service reads must be a mapping; anything else stops here, naming it."""
    wrong = [mapping_problem(section, config.get(section), ())
             for section in SECTIONS if not isinstance(config.get(section), DictConfig)]
    if wrong:
        raise ConfigError("invalid configuration:\n  " + "\n  ".join(wrong))
    for section in SECTIONS:  # resolve what the service reads now, so a broken interpolation is named by its key
        OmegaConf.to_container(config[section], resolve=True)


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
    """Raise ConfigError naming every invalid key, its value and what is allowed: each key against its
    declaration in the schema (settings.py), unknown keys under the service's sections, the registered
    strategies' and filters' options, and the rules that tie several keys together."""
    # First, as everything below reads into them: sections and sub-mappings that are mappings (a custom
    # strategy's option section is known only now, its module imported).
    _refuse_non_mappings(config, sections_may_be_null=True)
    problems: list[str] = unknown_key_problems(config, strategy_option_sections())

    def need(ok: bool, key: str, value: Any, allowed: str) -> None:
        if not ok:
            problems.append(f"{key} = {value!r}: {allowed}")

    sources = config.get("data_sources") or []
    for key in SCHEMA:
        if key.path.startswith("data_source.") or key.path in ("data_sources", "rollout.filter"):
            continue  # checked per data source below; the filters check their own
        value = lookup(config, key.path, _ABSENT)
        if value is not _ABSENT:
            problem = key.problem(value)
            need(problem is None, key.path, value, problem or "")
    need(len(sources) >= 1, "data_sources", list(sources), "must hold at least one data source")
    for i, source in enumerate(sources):
        for key in SCHEMA:
            if key.path.startswith("data_source.") and key.path != "data_source.dataset.buffer_replay_strategy":
                value = lookup(source, key.path.removeprefix("data_source."), _ABSENT)
                problem = key.problem(value) if value is not _ABSENT else None
                need(problem is None, f"data_sources[{i}].{key.path.removeprefix('data_source.')}", value, problem or "")
    for section, options in strategy_option_sections().items():  # every registered strategy's, chosen or not
        for key in options:
            value = lookup(config, f"{section}.{key.path}", _ABSENT)
            problem = key.problem(value) if value is not _ABSENT else None
            need(problem is None, f"{section}.{key.path}", value, problem or "")
    m = config.trainer.get("mini_batch_size")
    if not problems and sources:
        b, n = sources[0].num_prompts_per_step, sources[0].num_trajectories_per_prompt
        need((b * n) % m == 0, "trainer.mini_batch_size", m,
             f"(B x N) = {b} x {n} = {b * n} must be a multiple of the mini-batch size")
    name = config.fully_async.get("sliding_window")
    need(name in STRATEGIES, "fully_async.sliding_window", name,
         f"registered strategies: {', '.join(STRATEGIES.names())}{STRATEGIES.did_you_mean(name)}")
    problems.extend(filter_problems(config.rollout.get("filter"), config))
    for i, source in enumerate(sources):
        dataset = source.get("dataset") or {}
        replay = dataset.get("buffer_replay_strategy") if isinstance(dataset, (dict, DictConfig)) else dataset
        need(replay is None or replay in REPLAY_STRATEGIES, f"data_sources[{i}].dataset.buffer_replay_strategy",
             replay, f"null (fifo) or a registered buffer replay strategy: {', '.join(REPLAY_STRATEGIES.names())}"
                     f"{REPLAY_STRATEGIES.did_you_mean(replay)}")
    _validate_server(config.server, need)
    if problems:
        raise ConfigError("invalid configuration:\n  " + "\n  ".join(problems))
    for i, source in enumerate(sources):  # a chosen plugin not keeping the API: one line, before anything is built
        check_replay_strategy((source.get("dataset") or {}).get("buffer_replay_strategy"),
                              f"data_sources[{i}].dataset.buffer_replay_strategy")


def strategy_option_sections() -> dict[str, tuple]:
    """The registered strategies' declared options, by their section (e.g. fully_async.latency_aware)."""
    sections: dict[str, tuple] = {}
    for strategy_name in STRATEGIES.names():
        cls = STRATEGIES.get(strategy_name)
        options = tuple(getattr(cls, "options", ()) or ())
        if options:
            sections[f"fully_async.{options_section(cls, strategy_name)}"] = options
    return sections


def _validate_server(server: Any, need) -> None:
    """The server keys the schema cannot check one by one: listeners and TLS files that go together."""
    address = server.get("address")
    no_address = address is None or (isinstance(address, str) and address.strip() == "")
    # Checked here, not left to gRPC: it takes a port past 65535 modulo 65536 and a missing port as 443, and would
    # serve somewhere the clients are not told of.
    need(parse_host_port(address) is not None or (no_address and bool(server.get("uds_path"))),
         "server.address", address, "must be host:port with a port in 0..65535 (0: a free port), e.g. 127.0.0.1:50051 "
         "(may be \"\" only when server.uds_path is set)")
    tls = server.get("tls") or {}
    files = {key: tls.get(key) or "" for key in ("cert_file", "key_file", "client_ca_file")}
    if all(isinstance(value, str) for value in files.values()):
        need(bool(files["cert_file"]) == bool(files["key_file"]), "server.tls", files,
             "cert_file and key_file must be set together")
        need(not files["client_ca_file"] or bool(files["cert_file"]), "server.tls.client_ca_file",
             files["client_ca_file"], "mutual TLS needs the server's own cert_file and key_file too")


def config_summary(config: Any) -> dict[str, str]:
    """The effective pacing settings (strategy, B, N, M, stale_steps, C, reset mode, filters), as strings for
    GetState and the start-up line."""
    source = config.data_sources[0]
    return {
        "sliding_window": str(config.fully_async.sliding_window),
        "stale_steps": str(config.fully_async.stale_steps),
        "num_prompts_per_step": str(source.num_prompts_per_step),
        "num_trajectories_per_prompt": ",".join(str(s.num_trajectories_per_prompt) for s in config.data_sources),
        "mini_batch_size": str(config.trainer.mini_batch_size),
        "window_size": str(window_size(config)),
        "rollout_partial": str(config.rollout.partial).lower(),
        "reset_mode": RESET_MODES_BY_PARTIAL[bool(config.rollout.partial)],
        "continue_restored": str(setting(config, "rollout.continue_restored")).lower(),
        "filters": ",".join(name for name, _ in filter_specs(config.rollout.filter)),
        "train_on_failed": str(bool(setting(config, "rollout.train_on_failed"))).lower(),
    }
