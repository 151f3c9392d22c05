"""Partial-rollout continuation: the restored groups the pacer keeps, and the buffer replay strategies that
choose which of them a Dispatch re-offers, in what order.

A Reset restores the groups that were assembled (their trajectories submitted, aborted ones with their
partial tokens). With `rollout.continue_restored` on, the pacer keeps them and re-offers them to workers
before any new prompt; the data source's `dataset.buffer_replay_strategy` (LoongSage's key; null is `fifo`,
oldest first, as in LoongSage) picks which ones go first. A custom strategy is a class, not LoongSage's
function (config, step, buffer, num) that pops from the buffer itself: it registers like a sliding-window
strategy, and one that does not keep this API stops start-up in one line (`create_replay_strategy`):

    from coda_server import BufferReplayStrategy, register_buffer_replay_strategy

    @register_buffer_replay_strategy("newest-first")
    class NewestFirst(BufferReplayStrategy):
        def select(self, restored, count, step):
            return list(reversed(restored))[:count]
"""
from __future__ import annotations

import inspect
from typing import AbstractSet, Any, Callable, Iterable, Optional, Sequence

from .errors import ConfigError, not_built
from .plugins import signature_text, where
from .registry import Registry
from .types import TrajectoryGroup

REPLAY_STRATEGIES: Registry = Registry("buffer replay strategy", "data_sources[].dataset.buffer_replay_strategy")
DEFAULT_REPLAY_STRATEGY = "fifo"


def register_buffer_replay_strategy(name: str):
    """Class decorator: make a `BufferReplayStrategy` selectable by name in `dataset.buffer_replay_strategy`.

    Whatever it decorates is registered; what does not keep the API (LoongSage's function form among others)
    is refused when a configuration chooses it (`check_replay_strategy`), in one line naming it.
    """
    return REPLAY_STRATEGIES.register(name)


class BufferReplayStrategy:
    """Chooses the restored groups of one data source that a Dispatch re-offers.

    `select` gets the groups waiting for continuation in the order they were kept (oldest Reset first;
    within a Reset, in the order their first trajectory arrived), how many the Dispatch can take, and the
    trainer step; it returns at most `count` of them, in the order they are offered. It must not change
    `restored`, and it runs under the pacer's lock: keep it quick.
    """

    def __init__(self, config: Any = None):
        self.config = config

    def select(self, restored: Sequence[TrajectoryGroup], count: int, step: int) -> list[TrajectoryGroup]:
        raise NotImplementedError


@register_buffer_replay_strategy("fifo")
class FifoReplay(BufferReplayStrategy):
    """Oldest restored first (LoongSage's default)."""

    def select(self, restored: Sequence[TrajectoryGroup], count: int, step: int) -> list[TrajectoryGroup]:
        return list(restored[:count])


# What a buffer replay strategy must be, as a refusal says it.
REPLAY_API = ("a class derived from coda_server.BufferReplayStrategy, built with (config), whose "
              "select(self, restored, count, step) returns at most `count` of the `restored` groups, in the order "
              "to re-offer them, without changing `restored`")


def check_replay_strategy(name: Any, key: str = REPLAY_STRATEGIES.config_key) -> type:
    """The class registered as `name` (None or "": fifo), checked against the API before anything is built.

    ConfigError, in one line, for an unknown name (listing the registered ones) and for a plugin that does
    not keep the API (e.g. LoongSage's function form): naming `key`, the plugin and its file, what it is and
    what is required.
    """
    chosen = name or DEFAULT_REPLAY_STRATEGY
    plugin = REPLAY_STRATEGIES.chosen(chosen, key)
    problem = _api_problem(plugin)
    if problem is not None:
        raise ConfigError(f"{key} = {name!r}: the buffer replay strategy {chosen!r} ({where(plugin)}) {problem}; "
                          f"a buffer replay strategy is {REPLAY_API} (docs/partial-rollouts.md)")
    return plugin


def create_replay_strategy(name: Any, config: Any = None,
                           key: str = REPLAY_STRATEGIES.config_key) -> BufferReplayStrategy:
    """The named strategy (None or "" is the default, fifo), built from `config`.

    As `create_strategy` and `create_filters` do, every refusal is a one-line ConfigError naming `key`: an
    unknown name, a plugin that does not keep the API (`check_replay_strategy`), an `__init__` that raises.
    """
    cls = check_replay_strategy(name, key)
    try:
        return cls(config)
    except ConfigError:  # names its key already
        raise
    except Exception as exc:  # a custom strategy's bug: one line at start-up, not a traceback
        registered = ", ".join(REPLAY_STRATEGIES.names())
        raise not_built(f"{key} = {name!r}", "the buffer replay strategy", exc,
                        f"fix it ({where(cls)}) or choose another (registered: {registered})") from None


def create_replay_strategies(config: Any) -> list[BufferReplayStrategy]:
    """Each data source's strategy (`data_sources[i].dataset.buffer_replay_strategy`), in data-source order: what a
    Pacer is built with. Built before anything else by a server, so that a refusal stops start-up before the state
    directory is touched."""
    return [create_replay_strategy((source.get("dataset") or {}).get("buffer_replay_strategy"), config,
                                   f"data_sources[{i}].dataset.buffer_replay_strategy")
            for i, source in enumerate(config.data_sources)]


def _api_problem(plugin: Any) -> Optional[str]:
    """What `plugin` is that keeps it from serving as a buffer replay strategy, or None when it keeps the API."""
    if not isinstance(plugin, type):
        if inspect.isfunction(plugin) or inspect.ismethod(plugin) or inspect.isbuiltin(plugin):
            return (f"is a function taking {signature_text(plugin)} (LoongSage's form, which pops the groups from "
                    f"the buffer itself), not a class")
        return f"is a {type(plugin).__name__} object, not a class"
    select = getattr(plugin, "select", None)
    if not callable(select) or select is BufferReplayStrategy.select:
        return "is a class without a select method of its own"
    try:
        inspect.signature(select).bind(None, [], 1, 0)  # (self, restored, count, step)
    except TypeError:
        return f"is a class whose select takes {signature_text(select)}"
    except ValueError:  # no signature to read (a builtin): let it be tried
        pass
    return None


class RestoredGroups:
    """Restored groups kept for continuation, per data source in the order they were restored."""

    def __init__(self, clock: Callable[[], float], strategies: Sequence[BufferReplayStrategy]):
        self._clock = clock
        self._strategies = list(strategies)  # one per data source
        self._groups: list[TrajectoryGroup] = []
        self._ids: set[str] = set()
        self._kept_at: dict[str, float] = {}  # when each was kept: an unclaimed group's age is in GetState

    def __len__(self) -> int:
        return len(self._groups)

    def __contains__(self, prompt_id: object) -> bool:
        return prompt_id in self._ids

    @property
    def ids(self) -> AbstractSet[str]:
        """The kept groups' prompt ids (read-only, live): a Dispatch checks each candidate against it without
        a call per candidate."""
        return self._ids

    def keep(self, groups: Iterable[TrajectoryGroup]) -> list[str]:
        """Keep these groups (a Reset restored them); returns their prompt ids."""
        kept = []
        now = self._clock()
        for group in groups:
            self._groups.append(group)
            self._ids.add(group.prompt_id)
            self._kept_at[group.prompt_id] = now
            kept.append(group.prompt_id)
        return kept

    def oldest_age(self) -> float:
        """Seconds the longest-kept group has waited to be re-offered (0 when none waits)."""
        return max(0.0, self._clock() - min(self._kept_at.values())) if self._kept_at else 0.0

    def choose(self, count: int, step: int) -> list[TrajectoryGroup]:
        """Up to `count` groups to re-offer, data source by data source, each in its strategy's order (not taken yet)."""
        chosen: list[TrajectoryGroup] = []
        for ds_index, strategy in enumerate(self._strategies):
            if len(chosen) >= count:
                break
            waiting = [g for g in self._groups if g.ds_index == ds_index]
            if not waiting:
                continue
            picked = strategy.select(waiting, count - len(chosen), step)
            known = {id(g) for g in waiting}
            if len(picked) > count - len(chosen) or any(id(g) not in known for g in picked) or \
                    len({id(g) for g in picked}) != len(picked):
                raise RuntimeError(f"buffer replay strategy {type(strategy).__name__} must return at most "
                                   f"{count - len(chosen)} distinct groups of those it was given")
            chosen.extend(picked)
        return chosen

    def by_ids(self, prompt_ids: Sequence[str]) -> list[TrajectoryGroup]:
        """The kept groups with these ids, in this order (replaying a recorded Dispatch)."""
        index = {g.prompt_id: g for g in self._groups}
        missing = [p for p in prompt_ids if p not in index]
        if missing:
            raise RuntimeError(f"recovery diverged: restored group {missing[0]!r} is not kept for continuation")
        return [index[p] for p in prompt_ids]

    def take(self, groups: Sequence[TrajectoryGroup]) -> None:
        """These groups are dispatched again: no longer kept."""
        taken = {g.prompt_id for g in groups}
        self._groups = [g for g in self._groups if g.prompt_id not in taken]
        self._ids -= taken
        for prompt_id in taken:
            self._kept_at.pop(prompt_id, None)

    def export(self) -> list[TrajectoryGroup]:
        return list(self._groups)

    def restore(self, groups: Optional[Iterable[TrajectoryGroup]]) -> None:
        self._groups = []
        self._ids = set()
        self._kept_at = {}
        self.keep(groups or ())
