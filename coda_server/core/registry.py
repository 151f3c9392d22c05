"""Name -> class registries for pluggable strategies and group filters."""
from __future__ import annotations

import difflib
from typing import Callable, Generic, TypeVar

from .errors import ConfigError
from .plugins import where

T = TypeVar("T", bound=type)


class Registry(Generic[T]):
    """Maps configuration names to plugin classes; `register` is the decorator plugins use."""

    def __init__(self, kind: str, config_key: str):
        self.kind = kind
        self.config_key = config_key
        # What plugins register with ("group filter": register_group_filter), named by a clash's remedy.
        self.decorator = "register_" + kind.replace(" ", "_")
        self._classes: dict[str, T] = {}
        # name -> (the class kept, what names it and the refused one with their files): choosing a name two plugins
        # claim is refused (`clash`). Said now: the refused class's module is gone from sys.modules once skipped.
        self._clashes: dict[str, tuple[T, str]] = {}

    def register(self, name: str) -> Callable[[T], T]:
        if not isinstance(name, str) or not name:
            raise ValueError(f"{self.kind} name must be a non-empty string, got {name!r}")

        def decorate(cls: T) -> T:
            existing = self._classes.get(name)
            # Re-importing the same module (e.g. reloaded plugins) re-registers the same qualified class.
            if existing is not None and _qualified(existing) != _qualified(cls):
                kept, refused = where(existing), where(cls)
                self._clashes[name] = (existing, f"{kept} (kept) and {refused} (refused, its module skipped)")
                raise ValueError(f"{self.kind} name {name!r} is already registered by {kept}; {refused} must use "
                                 f"another name")
            self._classes[name] = cls
            return cls

        return decorate

    def get(self, name: str) -> T:
        try:
            return self._classes[name]
        except (KeyError, TypeError):
            raise ConfigError(
                f"{self.config_key}: Unknown {self.kind} {name!r}; registered: {', '.join(self.names())}"
                f"{self.did_you_mean(name)}"
            ) from None

    def clash(self, name: object) -> str:
        """What makes `name` ambiguous ("" if nothing): two plugins registered it, and only the first was kept."""
        if not isinstance(name, str) or name not in self._clashes:
            return ""
        return f"two modules register the {self.kind} name {name!r}: {self._clashes[name][1]}"

    def clash_refusal(self, name: object, key: str = "") -> str:
        """The one-line refusal of a configuration choosing `name` (at `key`) that two modules register, naming
        both files; "" when `name` is not ambiguous. Only a chosen name is refused: another clash is the load
        warning alone, so a stray module cannot stop a server that does not use it."""
        clash = self.clash(name)
        if not clash:
            return ""
        return (f"{key or self.config_key} = {name!r}: {clash}; give one of them another name (@{self.decorator}) or "
                f"take its module out of server.custom_strategy_dirs (and coda_server/custom/)")

    def chosen(self, name: str, key: str = "") -> T:
        """The class registered as `name`, which a configuration chose (at `key`): ConfigError for an unknown name
        (`get`) and for a name two modules register (`clash_refusal`)."""
        plugin = self.get(name)
        refusal = self.clash_refusal(name, key)
        if refusal:
            raise ConfigError(refusal)
        return plugin

    def names(self) -> list[str]:
        return sorted(self._classes)

    def did_you_mean(self, name: object) -> str:
        """"; did you mean 'x'?" naming the registered name closest to a mistyped `name`, or "" when none is close."""
        close = difflib.get_close_matches(name, self.names(), n=1) if isinstance(name, str) else []
        return f"; did you mean {close[0]!r}?" if close else ""

    def keys(self) -> list[str]:
        """The registered names in registration order (LoongSage's Registry.keys)."""
        return list(self._classes)

    def __len__(self) -> int:
        return len(self._classes)

    def __contains__(self, name: object) -> bool:
        return name in self._classes

    def saved(self) -> dict[str, T]:
        """What is registered now, for `restore` (tests that register plugins of their own)."""
        return dict(self._classes)

    def restore(self, saved: dict[str, T]) -> None:
        """Forget every registration made since `saved()`."""
        self._classes.clear()
        self._classes.update(saved)
        self._clashes = {name: pair for name, pair in self._clashes.items() if saved.get(name) is pair[0]}


def _qualified(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"
