"""Which asyncio event loop runs the server process (server.event_loop): uvloop when installed, else asyncio's.

Every call the server answers passes through the event loop several times (gRPC's completion queue wakes it
through a socket, each handler is a task, each answer a callback), so the loop's own cost is a large part of
what a small call costs. uvloop (libuv, in Cython) runs the same asyncio API with less Python per wake-up: on
`bench/rpc_throughput.py` our server's CPU per call fell by about a tenth for a peek, a 4-prompt Dispatch and
GetState alike (bench/README.md, "the event loop"). It is in the `server` extra on Linux and macOS (it has no
Windows build); without it the server runs on asyncio's loop, as an embedding application's loop is its own.
"""
from __future__ import annotations

import asyncio
import sys
from typing import Any, Callable, Coroutine, Optional, TypeVar

from .core.errors import ConfigError
from .core.settings import SCHEMA_BY_PATH

T = TypeVar("T")

ASYNCIO, UVLOOP = "asyncio", "uvloop"  # "auto", the third choice, is what neither names
CHOICES = SCHEMA_BY_PATH["server.event_loop"].choices  # declared once, with the key


def _uvloop() -> Optional[Any]:
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop


def loop_factory(choice: str) -> Optional[Callable[[], asyncio.AbstractEventLoop]]:
    """The factory of the loop `choice` names (None: asyncio's own). `uvloop` without uvloop installed is a
    ConfigError that says how to install it or what else to choose; `auto` then falls back to asyncio."""
    if choice not in CHOICES:
        raise ConfigError(f"server.event_loop must be one of {', '.join(CHOICES)}, got {choice!r}")
    if choice == ASYNCIO:
        return None
    uvloop = _uvloop()
    if uvloop is None:
        if choice == UVLOOP:
            raise ConfigError("server.event_loop is uvloop but uvloop is not installed in this Python "
                              f"({sys.executable}): pip install 'coda-pacer[server]' (Linux and macOS), or set "
                              "server.event_loop=auto or asyncio")
        return None
    return uvloop.new_event_loop


def run(main: Coroutine[Any, Any, T], factory: Optional[Callable[[], asyncio.AbstractEventLoop]]) -> T:
    """`asyncio.run(main)` on the loop `factory` makes (`loop_factory`'s answer; None: asyncio's own)."""
    if factory is None:
        return asyncio.run(main)
    if sys.version_info >= (3, 11):
        with asyncio.Runner(loop_factory=factory) as runner:
            return runner.run(main)
    # 3.10 has no Runner: the process's policy makes asyncio.run's loop.
    asyncio.set_event_loop_policy(_uvloop().EventLoopPolicy())
    return asyncio.run(main)


def describe(loop: asyncio.AbstractEventLoop) -> str:
    """The running loop in words, for the start-up log: 'uvloop 0.21.0' or 'asyncio'."""
    module = type(loop).__module__.split(".")[0]
    if module == "uvloop":
        return f"uvloop {getattr(_uvloop(), '__version__', '')}".rstrip()
    return "asyncio"
