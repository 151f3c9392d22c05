"""Discovery of custom strategy (and filter) modules in coda_server/custom/ and configured directories."""
from __future__ import annotations

import hashlib
import importlib
import logging
import pkgutil
import sys
import types
from pathlib import Path
from typing import Iterable

log = logging.getLogger("coda_server.plugins")

BUILTIN_CUSTOM_PACKAGE = "coda_server.custom"


def load_custom_modules(directories: Iterable[str] = (), package: str = BUILTIN_CUSTOM_PACKAGE) -> list[str]:
    """Import every module of `package` and of each directory, sub-packages too; return the names imported.

    A module that fails to import is skipped with one warning naming it; start-up goes on.
    """
    loaded: list[str] = []
    try:
        root = importlib.import_module(package)
        loaded.extend(_import_tree(list(root.__path__), package))
    except Exception as exc:  # a broken package __init__ must not stop the server
        log.warning("skipping custom module %s: %s: %s", package, type(exc).__name__, exc)
    for directory in directories:
        path = Path(directory)
        if not path.is_dir():
            log.warning("skipping custom strategy directory %s: not a directory", directory)
            continue
        loaded.extend(_import_tree([str(path.resolve())], _directory_package(path)))
    return loaded


def _directory_package(directory: Path) -> str:
    """Register a synthetic package whose path is `directory`, so its modules import normally.

    The name is stable per directory: two directories' same-named files stay apart, and loading
    the same directory twice imports nothing new.
    """
    resolved = str(directory.resolve())
    name = "coda_custom_" + hashlib.sha1(resolved.encode()).hexdigest()[:12]
    if name not in sys.modules:
        package = types.ModuleType(name, f"custom strategies from {resolved}")
        package.__path__ = [resolved]
        sys.modules[name] = package
    return name


def _import_tree(paths: list[str], prefix: str) -> list[str]:
    loaded = []
    # walk_packages yields a sub-package before importing it to look inside; our import below has
    # already warned about one that fails, so its own error callback stays silent.
    for info in pkgutil.walk_packages(paths, prefix=prefix + ".", onerror=lambda name: None):
        try:
            importlib.import_module(info.name)
            loaded.append(info.name)
        except Exception as exc:
            log.warning("skipping custom module %s: %s: %s", info.name, type(exc).__name__, exc)
    return loaded

