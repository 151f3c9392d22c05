"""Simulator configuration: built-in defaults, a preset, a --config file and key=value overrides.

One YAML holds both halves: the pacing service's own keys (fully_async, data_source, trainer, rollout,
server ...), handed to `coda_server.core.load_config` as they are, and the `sim:` section (workload
model), checked against `presets/defaults.yaml` so a misspelt key is an error, not a silent default.
"""
from __future__ import annotations

import importlib.resources
import json
from pathlib import Path
from typing import Iterable, Optional

from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import ConfigKeyError, OmegaConfBaseException

from coda_server.core import load_config
from coda_server.core.config import parse_overrides, read_yaml_mapping
from coda_server.core.errors import ConfigError
from coda_server.core.settings import unknown_key

DEFAULT_PRESET = "long_tail"


def presets_dir() -> Path:
    return Path(str(importlib.resources.files("coda_sim").joinpath("presets")))


def preset_names() -> list[str]:
    return sorted(p.stem for p in presets_dir().glob("*.yaml") if p.stem != "defaults")


def preset_path(name: str) -> Path:
    path = presets_dir() / f"{name}.yaml"
    if name == "defaults" or not path.is_file():
        raise ConfigError(f"unknown preset {name!r}; built-in presets: {', '.join(preset_names())}")
    return path


class SimConfig:
    """The merged configuration: `pacer_part` (plain dict) and `sim` (plain dict), plus where files live."""

    def __init__(self, merged: DictConfig, base_dir: Optional[Path]):
        container = OmegaConf.to_container(merged, resolve=True)
        self.sim: dict = container.pop("sim")
        self.pacer_part: dict = container
        self.base_dir = base_dir

    # --------------------------------------------------------------- pacer configs

    def pacer_overrides(self, strategy: Optional[str] = None, stale_steps: Optional[float] = None) -> list[str]:
        """Dotted overrides giving the core's load_config this configuration (plus a strategy / stale_steps)."""
        items = _dotlist(self.pacer_part)
        if self.sim["reward"]["filtered_group_prob"] > 0:
            filters = list(self.pacer_part.get("rollout", {}).get("filter") or ["status"])
            if "reward" not in filters:
                filters.append("reward")
            items.append(f"rollout.filter={json.dumps(filters)}")
        if strategy is not None:
            items.append(f"fully_async.sliding_window={json.dumps(strategy)}")
        if stale_steps is not None:
            items.append(f"fully_async.stale_steps={float(stale_steps)}")
        # The simulated data source continues restored groups itself (it re-proposes them with their
        # partial responses), so the Reset hands them back to it.
        items.append("rollout.continue_restored=false")
        return items

    def pacer_config(self, strategy: Optional[str] = None, stale_steps: Optional[float] = None) -> DictConfig:
        return load_config(None, self.pacer_overrides(strategy, stale_steps))

    @property
    def steps(self) -> int:
        return int(self.sim["steps"])

    @property
    def seed(self) -> int:
        return int(self.sim["seed"])


def load_sim_config(path: Optional[str | Path] = None, overrides: Iterable[str] = (), *,
                    preset: Optional[str] = None) -> SimConfig:
    """defaults.yaml, then the preset (long_tail unless `path` is given without one), then `path`, then overrides.

    A --config file is merged over the preset named by `preset` (default: over the defaults alone when
    a file is given, over long_tail otherwise), so a file may hold only the keys it changes.
    """
    try:
        defaults = OmegaConf.load(presets_dir() / "defaults.yaml")
        OmegaConf.set_struct(defaults.sim, True)  # a sim key not in defaults.yaml is an error
        layers = [defaults]
        if preset is None and path is None:
            preset = DEFAULT_PRESET
        if preset is not None:
            layers.append(OmegaConf.load(preset_path(preset)))
        base_dir = None
        if path is not None:
            layers.append(read_yaml_mapping(path, "pacer sections and a sim: section"))
            base_dir = Path(path).resolve().parent
        overrides = list(overrides)
        if overrides:
            layers.append(parse_overrides(overrides, example="sim.steps=20"))
        for layer in layers[1:]:  # before the merge, which would fail on a scalar over a mapping, or take it
            _check_shape(defaults.sim, layer.get("sim", _ABSENT), "sim")
        merged = OmegaConf.merge(*layers)
    except ConfigKeyError as exc:  # a sim key defaults.yaml does not have: named with the closest one it has
        parent = exc.full_key.rpartition(".")[0] if exc.full_key else ""
        section = OmegaConf.select(defaults, parent) if parent else None
        problem = (unknown_key(exc.full_key, [f"{parent}.{name}" for name in section.keys()])
                   if isinstance(section, DictConfig) else _first_line(exc))
        raise ConfigError(f"simulator configuration could not be loaded: {problem}") from None
    except OmegaConfBaseException as exc:
        raise ConfigError(f"simulator configuration could not be loaded: {_first_line(exc)}") from None
    except OSError as exc:
        raise ConfigError(f"simulator configuration file could not be read: {exc}") from None
    config = SimConfig(merged, base_dir)
    for key, low in (("seed", None), ("steps", 1)):  # read with int(): anything else is refused here, named
        value = config.sim[key]
        if not isinstance(value, int) or isinstance(value, bool) or (low is not None and value < low):
            allowed = f"an integer >= {low}" if low is not None else "an integer"
            raise ConfigError(f"sim.{key} = {value!r}: must be {allowed}")
    config.pacer_config()  # validate the pacer half now, with the core's own messages
    return config


_ABSENT = object()


def _check_shape(defaults: DictConfig, value: object, path: str) -> None:
    """ConfigError when `value` (a layer's `path`) is not a mapping where defaults.yaml has one, at any depth."""
    if value is _ABSENT:
        return
    if not isinstance(value, DictConfig):
        shown = OmegaConf.to_container(value) if isinstance(value, ListConfig) else value
        names = ", ".join(str(name) for name in defaults.keys())
        raise ConfigError(f"{path} = {shown!r}: must be a mapping of {names} "
                          f"(see coda_sim/presets/defaults.yaml)")
    for name in value.keys():
        if name in defaults and isinstance(defaults.get(name), DictConfig) and not OmegaConf.is_interpolation(value, name):
            _check_shape(defaults.get(name), value.get(name), f"{path}.{name}")


def _first_line(exc: Exception) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__


def _dotlist(tree: dict, prefix: str = "") -> list[str]:
    """Flatten nested mappings to key=value items; lists and scalars as JSON (which OmegaConf parses as YAML)."""
    items = []
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            items.extend(_dotlist(value, name + "."))
        else:
            items.append(f"{name}={json.dumps(value)}")
    return items
