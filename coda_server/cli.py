"""`coda-server [--config FILE] [key=value ...]`: load the configuration, serve until SIGTERM, drain, exit 0."""
from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import signal
import sys
from pathlib import Path
from typing import Optional, Sequence

from .core.config import load_config
from .core.errors import ConfigError, RecoveryError
from .core.journal import StateDirError
from .logs import TEXT_FORMAT, configure_logging, fields
from .server import BindError, PacerServer

log = logging.getLogger("coda_server")

CONFIG_ENV = "CODA_CONFIG"


def parse_args(argv: Optional[Sequence[str]]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="coda-server",
        description="Serve the coda rollout pacer over gRPC. Starts on the built-in conf/default.yaml.",
        epilog="Example: coda-server --config run.yaml server.address=0.0.0.0:50051 fully_async.stale_steps=2.0",
    )
    parser.add_argument("--config", default=os.environ.get(CONFIG_ENV) or None,
                        help=f"YAML file merged over the defaults (default: ${CONFIG_ENV}, else none)")
    parser.add_argument("--port-file", type=Path,
                        help="once serving, write {\"address\", \"port\", \"metrics_port\"} as JSON here (for scripts and tests), "
                             "plus \"uds\" and \"health_port\" when those listeners are set; address and port "
                             "are null without a TCP listener")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="dotted overrides, applied last")
    return parser.parse_args(argv)


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format=TEXT_FORMAT)
    try:
        config = load_config(args.config, args.overrides)
    except ConfigError as exc:
        print(f"coda-server: {exc}", file=sys.stderr)
        return 2
    configure_logging(str(config.server.log_format), str(config.server.log_level))
    try:
        return asyncio.run(serve(config, port_file=args.port_file))
    except (BindError, StateDirError, RecoveryError) as exc:  # port taken; state directory unusable, held or unreadable
        log.error("%s", exc)
        return 1
    except ConfigError as exc:  # a file the configuration names (token, certificates) is unusable
        print(f"coda-server: {exc}", file=sys.stderr)
        return 2


async def serve(config, *, port_file: Optional[Path] = None) -> int:
    server = PacerServer(config)
    if not config.fully_async.enable:
        log.info("fully_async.enable is false; the server paces all the same (the key is kept for LoongSage configs)")
    await server.start()
    listeners = server.listeners  # TCP (address, port) if any, Unix socket and health-only port if set
    window = server.pacer.state().window_size
    durability = f"state in {server.journal.directory}" if server.journal is not None else "state in memory"
    log.info("serving coda.pacer.v1.RolloutPacer on %s (strategy %s, window %d, %s)",
             listeners.describe(), config.fully_async.sliding_window, window, durability,
             extra=fields(event="start", address=listeners.tcp_address, uds=listeners.uds_path,
                          health_port=listeners.health_port, strategy=str(config.fully_async.sliding_window),
                          window=window, metrics_port=server.metrics_port))
    if port_file is not None:
        temporary = port_file.with_suffix(port_file.suffix + ".tmp")
        temporary.write_text(json.dumps({**listeners.port_file(), "metrics_port": server.metrics_port}))
        temporary.replace(port_file)  # readers never see a half-written file
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    await stop.wait()
    grace = float(config.server.shutdown_grace_seconds)
    log.info("shutting down: readiness NOT_SERVING, answering waiting calls, %.1fs grace", grace,
             extra=fields(event="shutdown", grace_seconds=grace))
    await server.stop()
    state = server.pacer.state()
    kept = "kept in the state directory" if server.journal is not None else "discarded (state in memory)"
    log.info("stopped: step %d, %d running, %d buffered groups %s",
             state.step, state.running, state.buffered, kept,
             extra=fields(event="stopped", step=state.step, running=state.running, buffered=state.buffered))
    return 0
