"""The server extra's console commands (coda-server, coda-sim): each runs its package's command line, or, when the
extra is not installed, says so in one line (this module imports nothing beyond the standard library)."""
from __future__ import annotations

import importlib
import sys
from typing import Optional, Sequence

SERVER_EXTRA = "pip install 'coda-pacer[server]'"


def server(argv: Optional[Sequence[str]] = None) -> int:
    """`coda-server`: coda_server.cli."""
    return _run("coda-server", "coda_server.cli", argv)


def simulator(argv: Optional[Sequence[str]] = None) -> int:
    """`coda-sim`: coda_sim.cli."""
    return _run("coda-sim", "coda_sim.cli", argv)


def _run(command: str, module: str, argv: Optional[Sequence[str]]) -> int:
    try:
        main = importlib.import_module(module).main
    except ModuleNotFoundError as missing:
        package = (missing.name or "").split(".")[0]
        if not package or package.startswith("coda_"):  # our own code missing: a broken install, shown as it is
            raise
        # The plain distribution is the client alone (pyproject.toml): a traceback would bury what to do.
        print(f"{command}: the package {package!r} is not installed; {command} needs the server's packages: "
              f"{SERVER_EXTRA}", file=sys.stderr)
        return 1
    return main(argv)
