"""Discovery of custom strategy (and filter) modules in coda_server/custom/ and configured directories, and where a
plugin's code is: its file, and the line it raised at."""
from __future__ import annotations

import hashlib
import importlib
import inspect
import logging
import os
import pkgutil
import sys
import traceback
import types
from pathlib import Path
from typing import Any, Iterable, Optional

log = logging.getLogger("coda_server.plugins")

BUILTIN_CUSTOM_PACKAGE = "coda_server.custom"


def load_custom_modules(directories: Iterable[str] = (), package: str = BUILTIN_CUSTOM_PACKAGE) -> list[str]:
    """Import every module of `package` and of each directory, sub-packages too; return the names imported.

    A module that fails to import is skipped with one warning naming its file and the line it failed at;
    start-up goes on.
    """
    loaded: list[str] = []
    try:
        root = importlib.import_module(package)
        loaded.extend(_import_tree(list(root.__path__), package, synthetic=False))
    except Exception as exc:  # a broken package __init__ must not stop the server
        log.warning("skipping custom module %s: %s", package, failure(exc))
    for directory in directories:
        path = Path(directory)
        if not path.is_dir():
            log.warning("skipping custom strategy directory %s: not a directory", directory)
            continue
        loaded.extend(_import_tree([str(path.resolve())], _directory_package(path), synthetic=True))
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


def _import_tree(paths: list[str], prefix: str, synthetic: bool) -> list[str]:
    loaded = []
    # walk_packages yields a sub-package before importing it to look inside; our import below has
    # already warned about one that fails, so its own error callback stays silent.
    for info in pkgutil.walk_packages(paths, prefix=prefix + ".", onerror=lambda name: None):
        try:
            importlib.import_module(info.name)
            loaded.append(info.name)
        except Exception as exc:
            origin = _origin(info)
            # A directory's package name is made up (coda_custom_<hash>): its file says more.
            shown = origin if synthetic and origin else f"{info.name} ({origin})" if origin else info.name
            log.warning("skipping custom module %s: %s", shown, failure(exc, getattr(info.module_finder, "path", None)))
    return loaded


def _origin(info: pkgutil.ModuleInfo) -> Optional[str]:
    """The file a module found by walk_packages is read from (a package's __init__.py), or None."""
    try:
        spec = info.module_finder.find_spec(info.name)  # type: ignore[call-arg]
    except Exception:  # a finder of another kind: the module's name alone must do
        return None
    return spec.origin if spec is not None else None


def failure(exc: BaseException, within: Optional[str] = None) -> str:
    """`Type: message (at FILE, line N, in function)`: an exception and where it was raised (`raised_at`)."""
    text = " ".join(str(exc).split())
    described = f"{type(exc).__name__}: {text}" if text else type(exc).__name__
    where = raised_at(exc, within)
    return f"{described} (at {where})" if where else described


def raised_at(exc: BaseException, within: Optional[str] = None) -> str:
    """Where `exc` was raised, as "FILE, line N, in function": the last frame of its traceback in the file or
    under the directory `within` (the plugin's own code, not the library it called), else its last frame; a
    SyntaxError's own file and line; "" when nothing says."""
    if isinstance(exc, SyntaxError) and exc.filename:
        return f"{exc.filename}, line {exc.lineno}"
    frames = traceback.extract_tb(exc.__traceback__)
    if within:
        root = os.path.abspath(within)
        inside = [frame for frame in frames
                  if (os.path.abspath(frame.filename) + os.sep).startswith(root + os.sep)]
        frames = inside or frames
    if not frames:
        return ""
    last = frames[-1]
    return f"{last.filename}, line {last.lineno}, in {last.name}"


def source_file(plugin: Any) -> Optional[str]:
    """The file a plugin (a class or a function) is defined in, or None (defined at run time, or built in)."""
    try:
        return inspect.getsourcefile(plugin)
    except TypeError:
        return None


def source_directory(plugin: Any) -> Optional[str]:
    """The directory of a plugin's file, where the frames of its own code (and of helpers beside it) are; or None."""
    source = source_file(plugin)
    return os.path.dirname(os.path.abspath(source)) if source else None


def signature_text(function: Any) -> str:
    """A callable's parameters as written ("(self, groups, count)"), or "(...)" when they cannot be read."""
    try:
        return str(inspect.signature(function)).split(" ->")[0]
    except (TypeError, ValueError):
        return "(...)"


def where(plugin: Any) -> str:
    """A plugin's name and its file ("Name in /path/file.py"), or its module and name when its file is unknown."""
    name = getattr(plugin, "__qualname__", type(plugin).__name__)
    source = source_file(plugin)
    return f"{name} in {source}" if source else f"{getattr(plugin, '__module__', '?')}.{name}"
