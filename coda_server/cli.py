"""`coda-server [--config FILE | --config-path DIR --config-name NAME] [overrides]`: load, serve until SIGTERM, drain."""
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

import grpc

from coda_client.protocol import SERVICE, package_version, source_digest

from . import allocator, event_loop
from .core.config import config_summary, load_config
from .core.errors import ConfigError, RecoveryError
from .core.journal import StateDirError
from .core.recovery import RecoveryInterrupted
from .core.settings import setting
from .logs import TEXT_FORMAT, configure_logging, fields
from .server import BindError, PacerServer

log = logging.getLogger("coda_server")

CONFIG_ENV = "CODA_CONFIG"


def parse_args(argv: Optional[Sequence[str]]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        # No abbreviations: `--port 50052` would otherwise be taken for `--port-file 50052` (a file named 50052 written,
        # the server on its default port), and `--conf` for whichever option begins so.
        allow_abbrev=False,
        prog="coda-server",
        description="Serve the coda rollout pacer over gRPC. Starts on the built-in conf/default.yaml.",
        epilog="Examples: coda-server --config run.yaml server.address=0.0.0.0:50051 fully_async.stale_steps=2.0; "
               "a LoongSage run config, composed as its trainer composes it: coda-server --config-path conf "
               "--config-name qwen3_30b_a3b/dapo_h20_1node fully_async.enable=true server.address=0.0.0.0:50051",
    )
    parser.add_argument("--config", default=None,
                        help=f"YAML file merged over the defaults (default: ${CONFIG_ENV}, else none); a Hydra "
                             f"defaults list in it is composed from the file's own directory, or refused")
    parser.add_argument("--config-path", "-cp", default=None, metavar="DIR",
                        help="Hydra config directory (e.g. LoongSage's conf/); relative to the working directory")
    parser.add_argument("--config-name", "-cn", default=None, metavar="NAME",
                        help="config to compose from --config-path with Hydra, e.g. qwen3_30b_a3b/dapo_h20_1node; "
                             "overrides then use Hydra's syntax (key=value, +key=value, ~key)")
    parser.add_argument("--port-file", type=Path,
                        help="once serving, write {\"address\", \"port\", \"metrics_port\"} as JSON here (for scripts and tests), "
                             "plus \"uds\" and \"health_port\" when those listeners are set; address and port "
                             "are null without a TCP listener")
    parser.add_argument("--version", action="version",
                        version=f"coda-server {package_version()} (source {source_digest()}, {SERVICE})")
    parser.add_argument("overrides", nargs="*", metavar="key=value",
                        help="dotted overrides (before, between or after the options), applied last")
    # Intermixed: key=value overrides may come before, between and after the options (`a.b=1 --config f c.d=2`).
    args, unknown = parser.parse_known_intermixed_args(argv)
    if unknown:
        parser.error(unknown_option_message(parser, unknown, argv if argv is not None else sys.argv[1:]))
    hydra = args.config_path is not None or args.config_name is not None
    if hydra and args.config is not None:
        parser.error("--config FILE and --config-path/--config-name are two ways to name the run config; give one")
    if hydra and (args.config_path is None or args.config_name is None):
        parser.error("--config-path DIR and --config-name NAME go together, e.g. --config-path conf "
                     "--config-name qwen3_30b_a3b/dapo_h20_1node")
    args.config_from_env = False  # whether --config's file is $CODA_CONFIG's, for messages
    if not hydra and args.config is None:
        args.config = os.environ.get(CONFIG_ENV) or None
        args.config_from_env = args.config is not None
    return args


def config_env_problem(path: str) -> Optional[str]:
    """The refusal of a $CODA_CONFIG that names no readable file, naming the variable (a container or a shell
    profile may set it unseen), else None."""
    try:
        with open(path, "rb"):
            return None
    except OSError as exc:
        return (f"${CONFIG_ENV} = {path!r}: configuration file could not be read: {exc}; point {CONFIG_ENV} at a "
                f"readable YAML file, give --config FILE, or unset it to start on the built-in defaults")


def port_file_problem(port_file: Path) -> Optional[str]:
    """The refusal of a --port-file that could not be written once serving, else None: checked before anything
    starts, by writing (and removing) its temporary file as serve() will."""
    temporary = port_file.with_suffix(port_file.suffix + ".tmp")
    try:
        if port_file.is_dir():
            raise IsADirectoryError(f"{str(port_file)!r} is a directory")
        with open(temporary, "w"):
            pass
        temporary.unlink()
    except OSError as exc:
        return (f"--port-file {str(port_file)!r} cannot be written: {exc}; name a file in a directory that exists and "
                f"that this user can write")
    return None


# Options users reach for to choose where the server listens; the address is a setting (server.address).
_LISTEN_OPTIONS = ("--port", "--host", "--address", "--addr", "--bind", "--listen")


def unknown_option_message(parser: argparse.ArgumentParser, unknown: Sequence[str], argv: Sequence[str]) -> str:
    """What an unrecognized argument was and what to give instead: the server's address is the override
    server.address=HOST:PORT, and an option is spelled out in full."""
    first = unknown[0]
    name, _, value = first.partition("=")
    if name in _LISTEN_OPTIONS:
        if not value and first in argv and argv.index(first) + 1 < len(argv):
            value = argv[argv.index(first) + 1]
        typed_host, colon, typed_port = value.rpartition(":")
        port = typed_port if typed_port.isdigit() else "50051"
        host = typed_host if colon else ("127.0.0.1" if name == "--port" or not value else value)
        return (f"{first!r}: coda-server has no such option; where it listens is the setting server.address, "
                f"e.g. server.address={host}:{port} (port 0: a free one, which --port-file writes down)")
    options = sorted(o for action in parser._actions for o in action.option_strings if o.startswith("--"))
    near = [o for o in options if o.startswith(name)]
    hint = f"; did you mean {' or '.join(near)}? (options are spelled out in full)" if near else ""
    return f"unrecognized argument {first!r}{hint}; the options are {', '.join(options)}, then key=value overrides"


class StoppedBeforeServing(BaseException):
    """SIGTERM or SIGINT came during start-up, before serve() gave the signals to the event loop. A BaseException:
    the `except Exception` of configuration and plugin loading must not take it for their own failure."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def _stop_before_serving(signum: int, frame: object) -> None:
    raise StoppedBeforeServing(signum)


def main(argv: Optional[Sequence[str]] = None) -> int:
    # First of all: until serve() hands SIGTERM to the event loop, its default action would kill the process
    # (exit 143) while the configuration and custom strategy modules load, which may take seconds.
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, _stop_before_serving)
    phase = ["reading the command line"]  # where start-up is, for the line a stop there logs
    try:
        return _start(argv, phase)
    except StoppedBeforeServing as stop:
        logging.basicConfig(level=logging.INFO, format=TEXT_FORMAT)  # a no-op once logging is configured
        log.info("stopped before serving: %s came during start-up (%s); the state directory was not opened, "
                 "nothing was written", stop, phase[0], extra=fields(event="stopped_before_serving", phase=phase[0]))
        return 0


def _start(argv: Optional[Sequence[str]], phase: list[str]) -> int:
    """main() once the stop signals are caught: load the configuration, then serve; `phase[0]` says how far it got."""
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format=TEXT_FORMAT)
    # Before anything starts: a --port-file found unwritable once serving left the server's socket file behind.
    problem = ((config_env_problem(args.config) if args.config_from_env else None)
               or (port_file_problem(args.port_file) if args.port_file is not None else None))
    if problem is not None:
        print(f"coda-server: {problem}", file=sys.stderr)
        return 2
    phase[0] = "loading the configuration and custom strategy modules"
    try:
        config = load_config(args.config, args.overrides, config_dir=args.config_path, config_name=args.config_name)
    except ConfigError as exc:
        print(f"coda-server: {exc}", file=sys.stderr)
        return 2
    except Exception as exc:  # a config shape no check foresaw: still a message naming the problem, no traceback
        print(f"coda-server: configuration could not be loaded: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2
    configure_logging(str(config.server.log_format), str(config.server.log_level))
    phase[0] = "starting the event loop"  # serve() takes the signals over as its first step
    try:
        loop = event_loop.loop_factory(str(setting(config, "server.event_loop")))  # before the coroutine exists
        return event_loop.run(serve(config, port_file=args.port_file), loop)
    except RecoveryInterrupted:  # SIGTERM while recovering: said when it came (serve), the state left intact
        return 0
    except (BindError, StateDirError, RecoveryError) as exc:  # port taken; state directory unusable, held or unreadable
        log.error("%s", exc)
        return 1
    except ConfigError as exc:  # a file the configuration names (token, certificates) is unusable
        print(f"coda-server: {exc}", file=sys.stderr)
        return 2


async def serve(config, *, port_file: Optional[Path] = None) -> int:
    server = PacerServer(config)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()

    def stop_signal(signum: int) -> None:
        if stop.is_set():  # a second signal: the stop under way goes on, said once
            return
        stop.set()
        recovering = server.stop_recovery()  # None once the state is rebuilt (or there is none to rebuild)
        if recovering is not None:
            log.info("stopping during recovery: %s came while the state in %s was being rebuilt (%s); it stops "
                     "before the next event, having written nothing: the state directory is intact and the next "
                     "start recovers it", signal.Signals(signum).name, server.journal.directory, recovering,
                     extra=fields(event="recovery_stopped", state_dir=str(server.journal.directory)))

    # Before start(): a long recovery is part of it, and SIGTERM's default action would end the process with 143.
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop_signal, signum)
    try:
        await server.start()
        started(server, config)
        if port_file is not None:
            write_port_file(port_file, {**server.listeners.port_file(), "metrics_port": server.metrics_port})
    except BaseException:  # interrupted, state unreadable, a port taken, ...: leave nothing behind
        await server.close()
        raise
    await stop.wait()
    grace = float(config.server.shutdown_grace_seconds)
    log.info("shutting down: readiness NOT_SERVING, answering waiting calls, %.1fs grace", grace,
             extra=fields(event="shutdown", grace_seconds=grace))
    await server.stop()
    state = server.pacer.state()
    if server.journal is None:
        kept = "discarded (state in memory)"
    elif server.journal.error is not None:  # what the journal could not write is not what the next start sees
        kept = ("NOT all kept: the state directory could not be written at the end, so the next start recovers "
                "the state of its last successful write, not these figures")
    else:
        kept = "kept in the state directory"
    # Leased groups are held too (a trainer may still acknowledge them, or they return to the buffer).
    log.info("stopped: step %d, %d running, %d buffered and %d leased groups %s",
             state.step, state.running, state.buffered, state.leased, kept,
             extra=fields(event="stopped", step=state.step, running=state.running, buffered=state.buffered,
                          leased=state.leased))
    return 0


def started(server: PacerServer, config) -> None:
    """The start-up lines, once the server serves."""
    log.info("coda-pacer %s, source %s (Python %s, grpcio %s)", package_version(), source_digest(),
             sys.version.split()[0], grpc.__version__,
             extra=fields(event="version", version=package_version(), source=source_digest()))
    if not config.fully_async.enable:  # after start: a start-up that fails says so in one line
        log.info("fully_async.enable is false; the server paces all the same (the key is kept for LoongSage configs)")
    log.info("%s", allocator.describe(int(config.server.allocator_retain_bytes), server.allocator_retains))
    loop_name = event_loop.describe(asyncio.get_running_loop())
    log.info("event loop: %s (server.event_loop %s)", loop_name, setting(config, "server.event_loop"),
             extra=fields(event="event_loop", loop=loop_name))
    listeners = server.listeners  # TCP (address, port) if any, Unix socket and health-only port if set
    window = server.pacer.state().window_size
    durability = (f"state in {server.journal.directory}" if server.journal is not None else
                  "state in memory only (server.state_dir is \"\"): a restart loses running and buffered groups")
    pacing = pacing_summary(config, window)
    log.info("serving coda.pacer.v1.RolloutPacer on %s (%s; %s)",
             listeners.describe(), ", ".join(f"{key} {value}" for key, value in pacing.items()), durability,
             extra=fields(event="start", address=listeners.tcp_address, uds=listeners.uds_path,
                          health_port=listeners.health_port, strategy=str(config.fully_async.sliding_window),
                          window=window, metrics_port=server.metrics_port, pacing=pacing))


def write_port_file(port_file: Path, content: dict) -> None:
    """--port-file, replaced whole (readers never see a half-written file); ConfigError if it cannot be written
    after all (checked at start, but a disk may fill or a directory go since)."""
    temporary = port_file.with_suffix(port_file.suffix + ".tmp")
    try:
        temporary.write_text(json.dumps(content))
        temporary.replace(port_file)
    except OSError as exc:
        raise ConfigError(f"--port-file {str(port_file)!r} cannot be written: {exc}; the server stopped") from None


def pacing_summary(config, window: int) -> dict[str, str]:
    """The effective pacing values, in the symbols of the docs (B, N, M, C), for the start-up line."""
    summary = config_summary(config)
    return {
        "strategy": summary["sliding_window"],
        "B": summary["num_prompts_per_step"],
        "N": summary["num_trajectories_per_prompt"],
        "M": summary["mini_batch_size"],
        "stale_steps": summary["stale_steps"],
        "C": str(window),
        "reset mode": summary["reset_mode"],
        "filters": summary["filters"] or "none",
    }
