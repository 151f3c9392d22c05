"""`coda-client`: state, health, watch, workers, reset, resume, checkpoint, restore and end-job against a running
server, for humans (text, the default) and scripts (`--json` on every command)."""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import queue
import sys
import threading
import time
from typing import Any, Optional, Sequence, TextIO, Union


def _quiet_grpc_core() -> None:
    """As the coda-client command (not when imported), gRPC's C core logs only errors, unless GRPC_VERBOSITY says
    otherwise: its INFO lines ("Handshake failed ...", one per connection attempt) came before the command's own
    line saying the same. Read by gRPC when it is imported, so set before."""
    command = os.path.basename(sys.argv[0]) if sys.argv else ""
    if "grpc" not in sys.modules and (__name__ == "__main__" or command.startswith("coda-client")):
        os.environ.setdefault("GRPC_VERBOSITY", "ERROR")


_quiet_grpc_core()

import grpc  # noqa: E402  (after _quiet_grpc_core)

from . import _health, _tls  # noqa: E402
from ._channel import TlsConfig, check_target, check_token, proxy_options, resolve_tls  # noqa: E402
from .client import PacerClient  # noqa: E402
from .errors import PacerClientError, UnauthenticatedError  # noqa: E402
from .protocol import SERVICE, package_version, source_digest  # noqa: E402
from .types import (  # noqa: E402
    ControlEvent, ControlEventType, JobEndReport, PacerState, ResetResult, StepReport, WorkerHoldings,
)

DEFAULT_ADDRESS = "127.0.0.1:50051"
# How long `reset` and `end-job` wait, by default, for the running groups to be submitted (--wait): a worker that
# died holding a group must not keep the command (and the server's pause) waiting until its in-flight lease runs out.
DEFAULT_WAIT_SECONDS = 60.0
# A waiting call's deadline is its --wait plus this margin (the client's own, coda_client._channel.WAIT_MARGIN_SECONDS).
WAIT_MARGIN_NOTE = "--wait plus 5 s"
INT64_MAX = 2**63 - 1
UINT32_MAX = 2**32 - 1


def build_parser() -> argparse.ArgumentParser:
    # No abbreviations of the options before the command: `--server HOST:PORT` would be taken for --server-name.
    parser = argparse.ArgumentParser(prog="coda-client", description="Talk to a running coda-server.",
                                     allow_abbrev=False)
    parser.add_argument("--version", action="version",
                        version=f"coda-client {package_version()} (source {source_digest()}, {SERVICE})")
    parser.add_argument("--address", "--target", default=os.environ.get("CODA_ADDRESS", DEFAULT_ADDRESS),
                        help=f"server host:port, PacerClient's target (default: $CODA_ADDRESS, else {DEFAULT_ADDRESS})")
    parser.add_argument("--timeout", type=float, default=10.0,
                        help="seconds per call, each call's deadline (default 10); a call that waits (reset, "
                             f"end-job) gets at least its {WAIT_MARGIN_NOTE}")
    parser.add_argument("--token-file", default=os.environ.get("CODA_TOKEN_FILE"),
                        help="file holding the bearer token (default: $CODA_TOKEN_FILE; $CODA_TOKEN also works)")
    parser.add_argument("--client-id", default=os.environ.get("CODA_CLIENT_ID"),
                        help="who is calling, shown in the server's logs and metrics (default: $CODA_CLIENT_ID)")
    tls = parser.add_argument_group("TLS (the address may also be unix:/path/to/socket, always plaintext)")
    tls.add_argument("--tls", action="store_true", help="connect with TLS, verifying the server against the system "
                                                        "roots (or --ca-file); implied by --ca-file and --cert-file")
    tls.add_argument("--ca-file", default=os.environ.get("CODA_TLS_CA_FILE"),
                     help="PEM CA bundle to verify the server with (default: $CODA_TLS_CA_FILE)")
    tls.add_argument("--cert-file", default=os.environ.get("CODA_TLS_CERT_FILE"),
                     help="PEM client certificate, for mutual TLS (default: $CODA_TLS_CERT_FILE)")
    tls.add_argument("--key-file", default=os.environ.get("CODA_TLS_KEY_FILE"),
                     help="PEM client private key, for mutual TLS (default: $CODA_TLS_KEY_FILE)")
    tls.add_argument("--server-name", help="name to check the server certificate against (e.g. when dialing an IP)")
    commands = parser.add_subparsers(dest="command", required=True)

    # Every command prints text by default and JSON with --json (one object per line, for scripts).
    as_json_flag = argparse.ArgumentParser(add_help=False)
    as_json_flag.add_argument("--json", action="store_true", help="print JSON (one object per line), for scripts")

    def command(name: str, **kwargs: Any) -> argparse.ArgumentParser:
        return commands.add_parser(name, parents=[as_json_flag], **kwargs)

    command("state", help="print the pacer's counters")

    health = command("health", help="probe grpc.health.v1; exit 0 only when SERVING")
    health.add_argument("--service", default="readiness", help='health service name: "", liveness or readiness')

    watch = command("watch", help="live view of the window, refreshed on every control event")
    watch.add_argument("--count", type=int, default=0, help="stop after this many frames (0: until SHUTDOWN)")
    watch.add_argument("--interval", type=float, default=1.0, help="refresh at least this often, seconds")

    reset = command("reset", help="step boundary: pause, restore/drop running groups")
    reset.add_argument("--mode", choices=["abort", "wait"], default=None, help="default: the server's rollout.partial")
    reset.add_argument("--wait", type=float, default=DEFAULT_WAIT_SECONDS,
                       help=f"seconds to wait at most for the running groups to be submitted (default "
                            f"{DEFAULT_WAIT_SECONDS:g}, within server.max_wait_seconds; in ABORT mode too, instead of "
                            "server.abort_wait_seconds); it ends as soon as all are in, and drops those still "
                            "incomplete then; 0: drop the incomplete ones now. Ctrl-C leaves the reset running on the "
                            "server until its wait ends")
    reset.add_argument("--resume", action="store_true", help="resume at once with --weight-version")
    reset.add_argument("--weight-version", type=int, default=0)

    workers = command("workers", help="which worker (client id) holds which running groups, since when, and which "
                                      "trainer holds which leases")
    workers.add_argument("--client", default=None, help="only this client id's groups")
    workers.add_argument("--groups", type=int, default=5, help="groups listed per worker, oldest first (0: all)")

    resume = command("resume", help="step += 1, set the weight version, reopen dispatch")
    resume.add_argument("--weight-version", type=int, required=True)

    checkpoint = command("checkpoint", help="write a pacer checkpoint (to keep beside the model's) to PATH")
    checkpoint.add_argument("path")

    restore = command("restore", help="bring the server back to the pacer checkpoint in PATH")
    restore.add_argument("path")

    end_job = command("end-job", help="end the job: dispatch closes for good, workers submit and stop")
    end_job.add_argument("--mode", choices=["abort", "wait"], default=None,
                         help="what workers do with the groups they hold; default: the server's rollout.partial")
    end_job.add_argument("--wait", type=float, default=DEFAULT_WAIT_SECONDS,
                         help=f"seconds to wait for the running groups to be assembled (default "
                              f"{DEFAULT_WAIT_SECONDS:g}); 0: end now")
    return parser


def read_token(token_file: Optional[str]) -> Optional[str]:
    """The token from --token-file (or CODA_TOKEN_FILE), else CODA_TOKEN, without the white space around it (a
    `CODA_TOKEN="$(cat file)"` of a CRLF file keeps its CR); OSError naming the flag when the file cannot be read,
    ValueError naming where the token came from when it holds what a gRPC header cannot carry."""
    if token_file:
        try:
            with open(token_file, encoding="utf-8") as handle:
                token, source = handle.read(), f"--token-file {token_file}"
        except (OSError, UnicodeDecodeError) as error:
            why = error.strerror if isinstance(error, OSError) else "not UTF-8 text"
            raise OSError(f"--token-file {token_file}: {why or error} (the file holding the server's "
                          f"bearer token; or set CODA_TOKEN)") from error
    else:
        token, source = os.environ.get("CODA_TOKEN"), "$CODA_TOKEN"
    try:
        return check_token(token)
    except ValueError as error:
        raise ValueError(f"{source}: {error}") from None


def tls_config(args: argparse.Namespace) -> Optional[TlsConfig]:
    """TLS settings from --tls/--ca-file/--cert-file/--key-file/--server-name; None for plaintext. ValueError, naming
    the flags, for a client certificate without its key or a key without its certificate."""
    if not (args.tls or args.ca_file or args.cert_file or args.key_file):
        return None
    if bool(args.cert_file) != bool(args.key_file):
        given, missing = (("--cert-file", "--key-file") if args.cert_file else ("--key-file", "--cert-file"))
        raise ValueError(f"mutual TLS needs both --cert-file and --key-file (or $CODA_TLS_CERT_FILE and "
                         f"$CODA_TLS_KEY_FILE): {given} is given, {missing} is not")
    return TlsConfig(root_certificates=args.ca_file, certificate_chain=args.cert_file, private_key=args.key_file,
                     server_name=args.server_name)


class _CommandClient(PacerClient):
    """The command's client: its errors' hints name the command's TLS flags (--ca-file ...), not TlsConfig's."""

    _tls_names = _tls.CLI_NAMES


def _seconds(allow_zero: bool) -> tuple[Any, str]:
    if allow_zero:
        return (lambda v: 0 <= v < math.inf), "a number of seconds >= 0"
    return (lambda v: 0 < v < math.inf), "a number of seconds > 0"


def _integer(low: int, high: Optional[int] = None) -> tuple[Any, str]:
    if high is None:
        return (lambda v: v >= low), f"an integer >= {low}"
    return (lambda v: low <= v <= high), f"an integer from {low} to {high}"


# Every numeric option, by command ("" before the command): (flag, attribute, (check, what it takes)).
NUMERIC_OPTIONS: dict[str, list[tuple[str, str, tuple[Any, str]]]] = {
    "": [("--timeout", "timeout", _seconds(allow_zero=False))],
    "watch": [("--count", "count", _integer(0)), ("--interval", "interval", _seconds(allow_zero=False))],
    "reset": [("--wait", "wait", _seconds(allow_zero=True)),
              ("--weight-version", "weight_version", _integer(0, INT64_MAX))],
    "workers": [("--groups", "groups", _integer(0, UINT32_MAX))],
    "resume": [("--weight-version", "weight_version", _integer(0, INT64_MAX))],
    "end-job": [("--wait", "wait", _seconds(allow_zero=True))],
}


def bad_number(args: argparse.Namespace) -> Optional[str]:
    """The first numeric option out of its range, as one line naming the flag and what it takes; None if none is."""
    for where in ("", args.command):
        for flag, attribute, (check, takes) in NUMERIC_OPTIONS.get(where, ()):
            value = getattr(args, attribute)
            if not check(value):
                command = f"{where} " if where else ""
                return f"{command}{flag} must be {takes}, not {value:g}" if isinstance(value, float) else \
                    f"{command}{flag} must be {takes}, not {value}"
    return None


def refuse_unknown_options(parser: argparse.ArgumentParser, argv: Sequence[str]) -> None:
    """Stop at an option before the command that is not one (argparse would take its value for the command and
    say only that the command is not known), saying which options there are; --server, --host, --port: --address."""
    known = {o for action in parser._actions for o in action.option_strings}
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices
    for argument in argv:
        if argument in commands:
            return
        name = argument.partition("=")[0]
        if name.startswith("--") and name not in known:
            where = (" the server's address is --address HOST:PORT (or $CODA_ADDRESS);"
                     if name in ("--server", "--host", "--port", "--addr") else "")
            parser.error(f"unrecognized option {name!r};{where} the options before the command are "
                         f"{', '.join(sorted(o for o in known if o.startswith('--')))} (spelled out in full)")


def main(argv: Optional[Sequence[str]] = None, out: TextIO = sys.stdout) -> int:
    parser = build_parser()
    refuse_unknown_options(parser, sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(argv)
    refused = bad_number(args)
    if refused is not None:  # said in one line, as argparse's own type errors are not: exit 2, nothing is called
        print(f"coda-client: {refused}", file=sys.stderr)
        return 2
    try:
        tls = tls_config(args)
        if tls is not None:  # an unreadable or unusable TLS file fails here, with a message naming its flag
            tls.checked_credentials(_tls.CLI_NAMES)
        if args.command == "health":
            return probe_health(args.address, args.service, args.timeout, out, tls=tls, json_lines=args.json)
        client = _CommandClient(args.address, token=read_token(args.token_file), tls=tls, timeout=args.timeout,
                                client_id=args.client_id or None)
    except (OSError, ValueError) as error:  # unreadable certificate, key without certificate, bad id or address
        print(f"coda-client: {error}", file=sys.stderr)
        return 2
    try:
        with client:
            if args.command == "watch":
                run_watch(client, out, count=args.count, interval=args.interval, json_lines=args.json)
                return 0
            answer, text = run_command(client, args)
            if args.json:  # one object per line; a list (workers) one line per item
                items = answer if isinstance(answer, list) else [answer]
                text = "".join(json.dumps(as_json(item), sort_keys=True) + "\n" for item in items)
            out.write(text)
    except PacerClientError as error:
        print(f"coda-client: {token_hint(error, args)}", file=sys.stderr)
        return 1
    except OSError as error:  # a checkpoint file that cannot be written or read: nothing was asked of the server
        print(f"coda-client: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return 0


def run_command(client: PacerClient, args: argparse.Namespace) -> tuple[Any, str]:
    """Runs one command: (its answer, for --json; its text)."""
    if args.command == "state":
        state = client.state()
        return state, render_state(state) + "\n"
    if args.command == "reset":
        return run_reset(client, args)
    if args.command == "resume":
        resumed = client.resume(args.weight_version)
        return resumed, f"resumed: step {resumed.step}, weight version {resumed.weight_version}\n"
    if args.command == "checkpoint":
        taken = client.checkpoint(args.path)
        summary = {f.name: getattr(taken, f.name) for f in dataclasses.fields(taken) if f.name != "blob"}
        return ({"path": args.path, "bytes": len(taken.blob), **summary},
                f"checkpoint of step {taken.step} (weight version {taken.weight_version}) written to {args.path}: "
                f"{len(taken.blob)} bytes, {taken.buffered_groups} buffered and {taken.kept_groups} kept groups, "
                f"{taken.in_flight_prompts} prompts in flight\n")
    if args.command == "restore":
        restored = client.restore(args.path)
        return restored, (f"restored step {restored.step} (weight version {restored.weight_version}): "
                          f"{restored.reinstated_groups} group(s) back in the buffer, {restored.kept_groups} kept, "
                          f"{restored.discarded_groups} discarded ({restored.dropped_running} running), "
                          f"{restored.reoffered_prompts} prompts offered again\n")
    if args.command == "end-job":
        announce_wait(client, args, "end-job", "--wait 0 ends the job now")
        report = client.end_job(args.mode, wait=args.wait)
        return report, render_end_job(report)
    if args.command == "workers":
        holdings = client.list_workers(args.client, max_groups_per_worker=max(0, args.groups))
        # ListWorkers names the holder of a lease only when it ends with its holder's silence (batches()'): the
        # leases of the others (collect_leased(), collect_result(lease=...)) are counted from GetState, for the text.
        unnamed = 0 if args.json or args.client else client.state().leased - sum(w.leased for w in holdings)
        return holdings, render_workers(holdings, unnamed_leased=max(0, unnamed))
    raise ValueError(f"unknown command {args.command!r}")


def token_hint(error: PacerClientError, args: argparse.Namespace) -> str:
    """The error's line; a refused token says it in the command's words (the server's message names the Python
    client's token=...), and where the token sent came from."""
    if isinstance(error, UnauthenticatedError) and error.reason == "MISSING_TOKEN":
        return (f"UNAUTHENTICATED: the server at {args.address} requires a bearer token: give --token-file FILE (or "
                f"set $CODA_TOKEN_FILE, or $CODA_TOKEN to the token itself) (reason MISSING_TOKEN)")
    if isinstance(error, UnauthenticatedError) and error.reason == "INVALID_TOKEN":
        source = f"--token-file {args.token_file}" if args.token_file else "$CODA_TOKEN"
        return f"{error}; the token sent came from {source}"
    return str(error)


def _groups(count: int) -> str:
    return f"{count} running group{'' if count == 1 else 's'}"


def announce_wait(client: PacerClient, args: argparse.Namespace, command: str, alternative: str) -> int:
    """Says on stderr, before a command that waits for the running groups (reset, end-job), what it waits for and
    for how long at most; returns how many groups are running (0: nothing said, nothing to wait for)."""
    if args.wait <= 0:
        return 0
    state = client.state()
    if not state.running or state.resetting:  # nothing to wait for, or a reset already running: the call says so
        return 0
    mode = (args.mode or state.config_summary.get("reset_mode") or "").upper()
    what = ("the partial trajectories of" if mode == "ABORT" else "all the trajectories of")
    print(f"coda-client: {command} is waiting up to {args.wait:g} s for {what} {_groups(state.running)} to be "
          f"submitted ({mode or 'server default'} mode); {alternative}", file=sys.stderr, flush=True)
    return state.running


def run_reset(client: PacerClient, args: argparse.Namespace) -> tuple[ResetResult, str]:
    """The Reset: says first what it waits for and for how long at most (--wait), and at its end what happened."""
    running = announce_wait(client, args, "reset",
                            "--wait 0 drops them now, Ctrl-C leaves the reset running on the server until then")
    started = time.monotonic()
    try:
        result = client.reset(args.mode, wait=args.wait, resume=args.resume, weight_version=args.weight_version)
    except KeyboardInterrupt:
        try:  # a Ctrl-C may come before the Reset reached the server: said as it is
            running_on = client.state().resetting
        except PacerClientError:
            running_on = None
        if running_on is False:
            print("coda-client: interrupted; no reset is running on the server (the call had not reached it, or it "
                  "ended): `coda-client state` says where it stands", file=sys.stderr, flush=True)
        else:
            print(f"coda-client: interrupted; the reset keeps running on the server (at most {args.wait:g} s from its "
                  "start), then dispatch stays paused: `coda-client state` says \"reset in progress\" until it "
                  "ends, `coda-client resume --weight-version V` reopens dispatch after it", file=sys.stderr,
                  flush=True)
        raise
    if running:
        dropped = len(result.dropped_prompt_ids)
        outcome = (f"{dropped} incomplete group{'' if dropped == 1 else 's'} dropped" if dropped
                   else "no group dropped")
        expired = f", {len(result.expired)} expired (their worker went silent)" if result.expired else ""
        released = len(released_kept(result))
        kept = f", {released} released from silent workers and kept for continuation" if released else ""
        paused = "" if not result.paused else "; dispatch stays paused until `coda-client resume --weight-version V`"
        print(f"coda-client: the reset ended after {time.monotonic() - started:.1f} s: "
              f"{outcome}{expired}{kept}{paused}", file=sys.stderr, flush=True)
    return result, render_reset(result)


def released_kept(result: ResetResult) -> list[str]:
    """The kept groups a silent worker's release kept (not this Reset's restore): the server lists them first in
    `kept_prompt_ids`, and the step report counts the groups the Reset itself restored."""
    released = len(result.kept_prompt_ids) - result.report.partial_restored_group_count
    return result.kept_prompt_ids[:released] if released > 0 else []


def _some(prompt_ids: Sequence[str], shown: int = 5) -> str:
    """The first few prompt ids, for a line a human reads (`--json` has them all)."""
    more = f" and {len(prompt_ids) - shown} more" if len(prompt_ids) > shown else ""
    return ", ".join(prompt_ids[:shown]) + more


def render_reset(result: ResetResult) -> str:
    released = released_kept(result)
    kept = (f", {len(result.kept_prompt_ids)} kept for continuation" if result.kept_prompt_ids else "") + (
        f" ({len(released)} released from silent workers: {_some(released)})" if released else "")
    expired = f" ({_some([group.prompt_id for group in result.expired])})" if result.expired else ""
    return (f"reset: generation {result.generation}, step {result.step}, weight version {result.weight_version}, "
            f"{'paused' if result.paused else 'resumed'}; {len(result.restored)} groups restored{kept}, "
            f"{len(result.dropped_prompt_ids)} dropped, {len(result.expired)} expired{expired}, "
            f"{len(result.quarantined)} quarantined; pause delay {result.pause_delay_seconds:.3f}s\n")


def render_end_job(report: JobEndReport) -> str:
    state = report.state
    return (f"job ended ({_name(report.mode).lower()}) after waiting {report.waited_seconds:.1f}s: "
            f"{state.consumed} groups trained on; left over {report.left_over}: "
            f"{len(report.buffered_prompt_ids)} buffered, {report.leased} leased, {len(report.held_prompt_ids)} held, "
            f"{len(report.in_flight_prompt_ids)} in flight, {len(report.kept_prompt_ids)} kept, "
            f"{len(report.expired_prompt_ids)} expired, {len(report.quarantined_prompt_ids)} quarantined; "
            f"dropped {state.dropped}, filtered {state.filtered} in all\n")


def probe_health(address: str, service: str, timeout: float, out: TextIO, tls: Optional[TlsConfig] = None,
                 json_lines: bool = False) -> int:
    """Exit code for orchestration: 0 SERVING, 1 anything else (including unreachable, and a service name the server
    does not know).

    Health needs no token; over TLS (`tls`) the server certificate is verified as for any call.
    """
    credentials, tls_options = resolve_tls(tls)
    check_target(address, plaintext=credentials is None)  # a port gRPC would dial modulo 65536 probes another server
    options = [*proxy_options(address).items(), *tls_options]  # a sidecar's probe must not go through a proxy
    channel = (grpc.secure_channel(address, credentials, options) if credentials
               else grpc.insecure_channel(address, options))
    with channel:
        # A generic call with the messages encoded by hand: grpcio-health-checking is the server's dependency, not
        # the client's, and a client-only install has no grpc_health.
        check = channel.unary_unary(_health.HEALTH_CHECK_METHOD, request_serializer=_health.encode_request,
                                    response_deserializer=_health.decode_response)
        try:
            response = check(service, timeout=timeout)
        except grpc.RpcError as error:
            status = error.code().name
            if error.code() == grpc.StatusCode.NOT_FOUND:  # the server answered: no health service of that name
                line = _health.unknown_service(service)
                if json_lines:
                    print(f"coda-client: {line}", file=sys.stderr)
                    out.write(json.dumps({"service": service, "status": status}) + "\n")
                else:
                    out.write(line + "\n")
                return 1
            details = _tls.tidy(error.details() or "")
            trouble = (_tls.diagnose(details, tls, _tls.CLI_NAMES) if error.code() == grpc.StatusCode.UNAVAILABLE
                       else None)
            if credentials is None and trouble is not None and trouble.kind == "closed":
                print(f"coda-client: {address} closed the connection; the server may require TLS: try --tls, or "
                      "--ca-file FILE for a private CA", file=sys.stderr)
            else:  # the status line alone would not say the server was never reached
                hint = f"; {trouble.text}" if trouble is not None else ""
                print(f"coda-client: no health answer from {address}: {status}: {details}{hint}", file=sys.stderr)
        else:
            status = _health.status_name(response)
    out.write(json.dumps({"service": service, "status": status}) + "\n" if json_lines
              else f"{service or '(server)'}: {status}\n")
    return 0 if status == "SERVING" else 1


def render_workers(holdings: Sequence[WorkerHoldings], unnamed_leased: int = 0) -> str:
    """One line per worker (running groups, oldest held) or trainer (groups leased to it by batches()), then its
    listed groups indented; then the leased groups no holder is named for (`unnamed_leased`), if any."""
    unnamed = (f"{unnamed_leased} {'more ' if holdings else ''}group{'' if unnamed_leased == 1 else 's'} leased, "
               "holder not named: Collect leases that do not end with their holder's silence (collect_leased(), "
               "collect_result(lease=...)); back in the buffer unless acknowledged before they run out\n"
               if unnamed_leased else "")
    if not holdings:
        return unnamed or "no running groups, and no groups leased to trainers\n"
    lines = []
    for worker in holdings:
        loaded = (f", engine at weight version {worker.loaded_weight_version}"
                  if worker.loaded_weight_version is not None else "")
        leased = f", {worker.leased} groups leased ({', '.join(worker.lease_ids)})" if worker.lease_ids else ""
        # For a worker holding groups, how recently the server heard it and whether it hears PAUSE: a killed one
        # still lists its groups (with their leases) until its liveness grace or their leases release them. (An
        # idle worker waits quietly on its stream: its silence says nothing.)
        named_holder = bool(worker.client_id) and worker.running > 0
        streams = worker.watch_streams
        if not named_holder:
            heard = watch = ""
        elif streams is None:  # an older server: it says neither, which is not "never heard, no stream"
            heard, watch = ", last heard and watch streams not reported by this server (an older release)", ""
        else:
            heard = (", never heard" if worker.last_heard_seconds is None
                     else f", last heard {worker.last_heard_seconds:.0f} s ago")
            watch = (", no watch stream" if not streams
                     else f", {streams} watch stream{'' if streams == 1 else 's'} open")
        lines.append(f"{worker.client_id or '(no client id)'}: {worker.running} running, oldest held "
                     f"{worker.oldest_held_seconds:.1f}s{heard}{watch}{loaded}{leased}"
                     + (" to this trainer, not yet acknowledged" if worker.lease_ids and not worker.running else ""))
        for g in worker.groups:
            lease = f", lease {g.lease_remaining_seconds:.0f}s left" if g.lease_remaining_seconds is not None else ""
            lines.append(f"  {g.prompt_id} seq {g.seq}: {g.trajectories}/{g.group_size} trajectories, held "
                         f"{g.held_seconds:.1f}s{lease}")
    return "\n".join(lines) + "\n" + unnamed


def as_json(value: Any) -> Any:
    """A command's answer as plain JSON values (dataclasses as objects, enums by name, bytes as hex)."""
    if dataclasses.is_dataclass(value):
        return {f.name: as_json(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, (list, tuple)):
        return [as_json(v) for v in value]
    if isinstance(value, dict):
        return {k: as_json(v) for k, v in value.items()}
    if isinstance(value, bytes):
        return value.hex()
    if hasattr(value, "name") and isinstance(value, int):  # IntEnum
        return value.name
    return value


def render_state(state: PacerState) -> str:
    window = state.window_size or 1
    bar_width = 40
    running = round(bar_width * state.running / window)
    buffered = round(bar_width * state.buffered / window)
    bar = ("R" * running + "Q" * buffered).ljust(bar_width, ".")[:bar_width]
    return "\n".join([
        f"strategy {state.strategy}   step {state.step}   weight version {state.weight_version}   "
        f"generation {state.generation}   "
        f"{'JOB ENDED (EndJob: dispatch closed for good)' if state.job_ended else 'PAUSED' if state.paused else 'running'}"
        f"{'  (reset in progress)' if state.resetting else ''}",
        f"window [{bar}] running {state.running} + buffered {state.buffered} of {state.window_size}; "
        + over_the_window(state) + f"dispatch would admit {state.capacity}"
        + (f"; {state.leased} leased to trainers, not yet acknowledged (outside the window)" if state.leased else ""),
        f"totals dispatched {state.dispatched}  submitted {state.submitted}  collected {state.collected}  "
        f"consumed {state.consumed}  filtered {state.filtered}  restored {state.restored}  dropped {state.dropped}  "
        f"expired {state.expired}  stale {state.stale_rejected}  duplicates {state.duplicates}   "
        f"kept for continuation {state.restored_kept}"
        + (f" (oldest waiting {state.restored_kept_oldest_seconds:.1f}s)" if state.restored_kept else ""),
        f"queued trajectories {state.queued_trajectories}   waiting long-polls {state.waiting_calls}",
        render_report(state.recent_reports[-1]) if state.recent_reports else "no step report yet (none before the first Reset)",
    ] + ([f"STATE DIRECTORY NOT WRITABLE: {state.state_dir_problem}"] if state.state_dir_problem else []))


def over_the_window(state: PacerState) -> str:
    """Why running + buffered can pass the window's size: leased groups are outside it, so workers fill it again
    meanwhile, and groups a trainer gives back (a Release, a lease run out, a silent trainer) come back on top."""
    over = state.running + state.buffered - state.window_size
    if over <= 0 or not state.window_size:
        return ""
    return (f"over the window by {over} (groups given back by a trainer count in it again; dispatch admits "
            f"again once enough are collected); ")


def render_report(report: StepReport) -> str:
    """One line for the latest step report (the seed framework's step-boundary metrics)."""
    return (f"step {report.step} report: pipeline_buf_size {report.pipeline_buf_size}  filter_drop {report.filter_drop}  "
            f"partial_ratio {report.partial_ratio:.3f}  partial_span_max {report.partial_span_max}  "
            f"restored {report.partial_restored_group_count} ({report.partial_restored_count} traj)  "
            f"dropped_incomplete {report.partial_dropped_incomplete_group_count} "
            f"({report.partial_dropped_incomplete_count} traj)  "
            f"pause_delay {report.pause_delay:.3f}s")


def run_watch(client: PacerClient, out: TextIO, *, count: int = 0, interval: float = 1.0,
              json_lines: bool = False) -> int:
    """Redraw the window on each control event and at least every `interval` s; returns frames drawn. With
    `json_lines`, each frame is one JSON line: the state and the last control event.

    A reader thread moves stream events into a queue, so the view refreshes from GetState between events.
    """
    clear = "\x1b[H\x1b[2J" if out.isatty() and not json_lines else ""
    events: "queue.Queue[Union[ControlEvent, PacerClientError, None]]" = queue.Queue()
    frames = 0
    last: Optional[ControlEvent] = None
    state: Optional[PacerState] = None
    with client.watch() as stream:
        reader = threading.Thread(target=_pump, args=(stream, events), daemon=True)
        reader.start()
        while True:
            try:
                event = events.get(timeout=interval)
            except queue.Empty:
                event = last
            else:
                if event is None:  # the stream ended
                    return frames
                if isinstance(event, PacerClientError):  # e.g. the server died: said, exit status 1
                    raise event
                last = event
            shutting_down = last is not None and last.type == ControlEventType.SHUTDOWN
            try:
                state = client.state()
            except PacerClientError:
                if not shutting_down or state is None:
                    raise
                # The server announced SHUTDOWN and went before this frame asked: drawn with the state seen last.
            if json_lines:
                out.write(json.dumps({"state": as_json(state), "last_event": as_json(last)}, sort_keys=True) + "\n")
            else:
                note = f"last control event: {_name(last.type)}" if last is not None else "waiting for the first event"
                if shutting_down:
                    note += " (the server is shutting down; as it was last seen)"
                out.write(f"{clear}{render_state(state)}\n{note}\n")
            out.flush()
            frames += 1
            if (count and frames >= count) or shutting_down:
                return frames


def _pump(stream: Any, events: "queue.Queue[Union[ControlEvent, PacerClientError, None]]") -> None:
    """Moves the stream's events into `events`; then None when the stream ended, or the error it ended with."""
    try:
        for event in stream:
            events.put(event)
    except PacerClientError as error:  # raised by run_watch: a server gone is not a normal end of the watch
        events.put(error)
    else:
        events.put(None)


def _name(value: Any) -> str:
    return value.name if hasattr(value, "name") else str(value)


if __name__ == "__main__":  # python -m coda_client.cli, as the coda-client command
    sys.exit(main())
