"""Group filters applied on collection: registry, `rollout.filter` parsing, and the built-in `status` and `reward`."""
from __future__ import annotations

import difflib
import inspect
from typing import Any, Callable, Mapping, Optional

from omegaconf import DictConfig, ListConfig, OmegaConf

from .errors import ConfigError, not_built
from .registry import Registry
from .types import TrajectoryGroup, TrajectoryStatus

FILTERS: Registry = Registry("group filter", "rollout.filter")


def register_group_filter(name: str):
    """Decorator: make a filter selectable by name in `rollout.filter`.

    Decorate a `GroupFilter` subclass (its keyword-only `__init__` parameters are the filter's parameters),
    or a function `fn(group: TrajectoryGroup, **params)` as LoongSage writes them: it returns the group (or
    True) to keep it and None (or False) to drop it.
    """
    return FILTERS.register(name)


class GroupFilter:
    """Decides whether a complete, collected group goes to the buffer (True) or is dropped (False).

    Parameters come from the configuration (`rollout.filter: {name: {threshold: 0.5}}`) as keyword
    arguments of `__init__`, after the configuration itself: `def __init__(self, config=None, *, threshold=0.5)`.
    A filter may declare them as `options` (`coda_server.core.settings.Key`s, as the service's own keys are
    declared): they are then checked at start-up by type and range, a misspelt one is refused naming the
    closest, and an option the configuration leaves out is passed with its declared default.
    """

    options: Optional[tuple] = None  # None: the parameters are checked against __init__'s signature only

    def __init__(self, config: Any = None):
        self.config = config

    def keep(self, group: Mapping[str, Any]) -> bool:
        raise NotImplementedError


class FunctionFilter(GroupFilter):
    """A filter registered as a function (LoongSage's form), bound to its configured parameters."""

    def __init__(self, name: str, function: Callable[..., Any], params: Mapping[str, Any], config: Any = None):
        super().__init__(config)
        self.name = name
        self._function = function
        self._params = dict(params)

    def keep(self, group: Mapping[str, Any]) -> bool:
        trajectories = list(group.values())
        prompt_id = trajectories[0].prompt_id if trajectories else ""
        result = self._function(TrajectoryGroup(prompt_id=prompt_id, trajectories=trajectories), **self._params)
        return result is not None and result is not False


@register_group_filter("status")
class StatusFilter(GroupFilter):
    """Drop a group holding a FAILED trajectory."""

    options = ()

    def keep(self, group: Mapping[str, Any]) -> bool:
        for t in group.values():  # a loop, not any() over a generator: this runs for every group
            if t.status is TrajectoryStatus.FAILED:  # `is`: statuses are members here (RequestChecks)
                return False
        return True


@register_group_filter("reward")
class RewardFilter(GroupFilter):
    """Drop a group whose rewards are all equal: it carries no advantage signal."""

    options = ()

    def keep(self, group: Mapping[str, Any]) -> bool:
        rewards = {t.reward for t in group.values()}
        return len(rewards) > 1


def filter_specs(spec: Any) -> list[tuple[str, dict]]:
    """`rollout.filter` as (name, parameters) pairs, in order, filters switched off left out.

    Two forms: LoongSage's mapping `{status: , reward: {}, mine: {threshold: 0.5}}` (null or {} = on without
    parameters, a mapping = on with those parameters, false = off) and a list of names or one-key mappings
    `[status, {mine: {threshold: 0.5}}]`. Raises ConfigError naming the entry that is neither.
    """
    spec = _plain(spec)
    if spec is None:
        return []
    if isinstance(spec, dict):
        items = list(spec.items())
    elif isinstance(spec, list):
        items = []
        for i, entry in enumerate(spec):
            if isinstance(entry, str):
                items.append((entry, None))
            elif isinstance(entry, dict) and len(entry) == 1:
                items.extend(entry.items())
            else:
                raise ConfigError(f"rollout.filter[{i}] = {entry!r}: a list entry is a filter name or a one-key "
                                  f"mapping {{name: {{parameter: value}}}}")
    else:
        raise ConfigError(f"rollout.filter = {spec!r}: must be a mapping of filter name to parameters "
                          f"(LoongSage's form, e.g. {{status: null, reward: false}}) or a list of filter names")
    specs = []
    for name, params in items:
        if params is False:
            continue  # switched off, e.g. `reward: false` over a default that has it
        if params is None or params is True:
            params = {}
        if not isinstance(name, str) or not isinstance(params, dict):
            raise ConfigError(f"rollout.filter.{name} = {params!r}: a filter's value is null (on), false (off) or "
                              f"a mapping of its parameters")
        specs.append((name, params))
    return specs


def normalize_filters(spec: Any) -> list:
    """The canonical list form of `rollout.filter`: names, or {name: parameters} where there are parameters."""
    return [name if not params else {name: params} for name, params in filter_specs(spec)]


def filter_problems(spec: Any, config: Any = None) -> list[str]:
    """Every problem of `rollout.filter`, one line each naming the key (empty when it is fine)."""
    try:
        specs = filter_specs(spec)
    except ConfigError as exc:
        return [str(exc)]
    problems = []
    for name, params in specs:
        if name not in FILTERS:
            problems.append(f"rollout.filter.{name}: unknown group filter {name!r}; registered filters: "
                            f"{', '.join(FILTERS.names())}{FILTERS.did_you_mean(name)}")
            continue
        refusal = FILTERS.clash_refusal(name, "rollout.filter")
        if refusal:  # the Registry's rule for a chosen name two modules register, as for strategies
            problems.append(refusal)
            continue
        problem = _parameter_problem(FILTERS.get(name), params)
        if problem:
            problems.append(f"rollout.filter.{name} = {params!r}: {problem}")
    return problems


def _parameter_problem(plugin: Any, params: dict) -> Optional[str]:
    """Why `params` cannot be given to the filter `plugin`: against its declared options, or checked on its
    signature without calling it."""
    options = getattr(plugin, "options", None)
    if options is not None:
        names = [key.path for key in options]
        unknown = [name for name in params if name not in names]
        if unknown:
            close = difflib.get_close_matches(unknown[0], names, n=1)
            hint = f"; did you mean {close[0]}?" if close else ""
            return (f"the filter does not take these parameters ({', '.join(map(str, unknown))}{hint}); "
                    f"it takes: {', '.join(names) or 'none'}")
        wrong = [f"{key.path} {key.problem(params[key.path])}" for key in options
                 if key.path in params and key.problem(params[key.path]) is not None]
        return "; ".join(wrong) or None
    try:  # the first parameter is the configuration (a class) or the group (a function)
        inspect.signature(plugin).bind(None, **params)
    except TypeError as exc:
        accepted = _parameter_names(plugin)
        return f"the filter does not take these parameters ({exc}); it takes: {', '.join(accepted) or 'none'}"
    except ValueError:  # no signature to inspect (a builtin): let the call decide
        return None
    return None


def _parameter_names(plugin: Any) -> list[str]:
    try:
        parameters = list(inspect.signature(plugin).parameters.values())[1:]
    except (TypeError, ValueError):
        return []
    return [p.name for p in parameters if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD, p.VAR_KEYWORD)]


def create_filters(spec: Any, config: Any = None) -> list[GroupFilter]:
    """Instantiate the filters `spec` (either form of `rollout.filter`) names, in order, with their parameters.

    An unknown name or parameters the filter does not take raise ConfigError naming the key.
    """
    problems = filter_problems(spec, config)
    if problems:
        raise ConfigError("invalid configuration:\n  " + "\n  ".join(problems))
    filters: list[GroupFilter] = []
    for name, params in filter_specs(spec):
        plugin = FILTERS.get(name)
        if isinstance(plugin, type):
            declared = {key.path: key.default for key in (getattr(plugin, "options", None) or ())}
            try:
                filters.append(plugin(config, **{**declared, **params}))
            except ConfigError:  # names its key already
                raise
            except Exception as exc:  # a custom filter's bug: said in one line at start-up, not a traceback
                raise not_built("rollout.filter", f"the filter {name!r}", exc,
                                "fix the filter or take it out of rollout.filter") from None
        else:
            filters.append(FunctionFilter(name, plugin, params, config))
    return filters


def _plain(value: Any) -> Any:
    """OmegaConf containers (also inside a plain list) as plain Python lists and dicts; anything else unchanged."""
    if isinstance(value, (DictConfig, ListConfig)):
        return OmegaConf.to_container(value, resolve=True)
    if isinstance(value, list):
        return [_plain(item) for item in value]
    return value
