"""The server extra's console commands (coda-server, coda-sim): each runs its package's command line, or, when the
extra is not installed, says so in one line (this module imports nothing beyond the standard library)."""
from __future__ import annotations

import importlib
import signal
import sys
from typing import Optional, Sequence

SERVER_EXTRA = "pip install 'coda-pacer[server]'"


def server(argv: Optional[Sequence[str]] = None) -> int:
    """`coda-server`: coda_server.cli."""
    # SIGTERM (or SIGINT) while the server's packages import, most of a second, is a stop before serving, not a
    # kill (exit 143) or a traceback; coda_server.cli.main() takes the signals over as its first statement.
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, _stopped_while_importing)
    return _run("coda-server", "coda_server.cli", argv)


def _stopped_while_importing(signum: int, frame: object) -> None:
    print(f"coda-server: stopped before serving: {signal.Signals(signum).name} came during start-up (importing the "
          f"server's packages); the state directory was not opened, nothing was written", file=sys.stderr)
    raise SystemExit(0)


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
        print(missing_extra_line(command, package), file=sys.stderr)
        return 1
    return main(argv)


def missing_extra_line(command: str, package: str) -> str:
    """What `command` says when the server extra's `package` is not installed."""
    return f"{command}: the package {package!r} is not installed; {command} needs the server's packages: {SERVER_EXTRA}"


def exit_if_run_as_module(missing: ModuleNotFoundError) -> None:
    """Called by the server extra's packages when an import of theirs is missing: under `python -m coda_server`
    (or coda_sim), which is loading them (argv[0] is "-m" only then), the process ends with the console command's one
    line instead of a traceback through the package's import. Otherwise returns: an importer gets the error."""
    package = (missing.name or "").split(".")[0]
    if sys.argv[:1] != ["-m"] or not package or package.startswith("coda_"):
        return
    orig_argv = getattr(sys, "orig_argv", [])
    module = orig_argv[orig_argv.index("-m") + 1] if "-m" in orig_argv[:-1] else "the module"
    print(missing_extra_line(f"python -m {module}", package), file=sys.stderr)
    raise SystemExit(1)
