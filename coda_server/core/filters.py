"""Group filters applied on collection: registry, and the built-in `status` and `reward` filters."""
from __future__ import annotations

from typing import Any, Mapping

from .registry import Registry
from .types import TrajectoryStatus

FILTERS: Registry = Registry("group filter", "rollout.filter")


def register_group_filter(name: str):
    """Class decorator: make a `GroupFilter` selectable by name in `rollout.filter`."""
    return FILTERS.register(name)


class GroupFilter:
    """Decides whether a complete, collected group goes to the buffer (True) or is dropped (False)."""

    def __init__(self, config: Any = None):
        self.config = config

    def keep(self, group: Mapping[str, Any]) -> bool:
        raise NotImplementedError


@register_group_filter("status")
class StatusFilter(GroupFilter):
    """Drop a group holding a FAILED trajectory."""

    def keep(self, group: Mapping[str, Any]) -> bool:
        return not any(t.status == TrajectoryStatus.FAILED for t in group.values())


@register_group_filter("reward")
class RewardFilter(GroupFilter):
    """Drop a group whose rewards are all equal: it carries no advantage signal."""

    def keep(self, group: Mapping[str, Any]) -> bool:
        rewards = {t.reward for t in group.values()}
        return len(rewards) > 1


def create_filters(names: list[str], config: Any = None) -> list[GroupFilter]:
    """Instantiate the named filters in order; an unknown name raises ConfigError listing the known ones."""
    return [FILTERS.get(name)(config) for name in names]
