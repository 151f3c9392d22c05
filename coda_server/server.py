"""Server wiring: the grpc.aio server with the pacer service, health, reflection, limits and graceful drain."""
from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import os
import re
import ssl
import stat
import time
from datetime import datetime, timezone
from typing import Any, Optional

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from coda_client._proto import pacer_pb2, pacer_pb2_grpc

from . import auth, transport
from .allocator import HeapTrimmer, in_a_thread, retain_freed_memory
from .admission import Admission, call_limits
from .convert import ProtoTrajectories
from .core.async_pacer import AsyncPacer
from .core.errors import ConfigError
from .core.filters import create_filters
from .core.replay import create_replay_strategies
from .core.strategy import create_strategy
from .core.sqlite_journal import SqliteJournal
from .core.pacer import Pacer
from .core.recovery import RecoveryInterrupted
from .logs import fields
from .method_wrapping import WrappingRegistrar
from .metrics_listener import check_metrics_security
from .observability import Observability
from .rpc_handlers import RpcHandlers
from .service import RolloutPacerServicer
from .wire import PassthroughCodec
from .transport import BindError  # re-exported: the CLI and tests import it from here

log = logging.getLogger("coda_server")

SERVICE_NAME = pacer_pb2.DESCRIPTOR.services_by_name["RolloutPacer"].full_name
HEALTH_SERVICES = ("", "liveness", "readiness", SERVICE_NAME)
# Control calls (trainer, probes) the pending-call queue holds on top of everything the limits admit.
CONTROL_CALL_ROOM = 1024
GRPC_INT_MAX = 2**31 - 1  # gRPC's channel arguments are C ints
# The cyclic collector's thresholds (CPython's defaults are 700, 10, 10). A young collection walks only the young
# generation but frees the cyclic garbage found there, and gRPC leaves a few objects of it per call: at 50,000 a
# collection held the loop for 10 to 50 ms, at 5,000 for under 6 ms and a third less CPU in all (bench/README.md,
# "eleventh round"). The older generations keep their old pace: one middle collection per 1,000,000 allocations,
# a full one per 100 of those at most.
GC_YOUNG_THRESHOLD = 5_000
GC_MIDDLE_THRESHOLD = 200
GC_OLD_THRESHOLD = 100
# A journal that cannot write for this long turns liveness NOT_SERVING too, so an orchestrator restarts the
# server (a failing volume may come back on a new mount); until then it may recover by itself (space freed).
JOURNAL_FAILURE_LIVENESS_SECONDS = 60.0


def server_options(config: Any) -> list[tuple[str, Any]]:
    """Channel arguments of the server; each one is here for a reason."""
    max_bytes = int(config.server.max_message_bytes)
    return [
        # A second server on the same port must fail loudly, not silently share (and steal) traffic.
        ("grpc.so_reuseport", 0),
        ("grpc.max_receive_message_length", max_bytes),
        ("grpc.max_send_message_length", max_bytes),
        # Keepalive: ping idle connections every 60 s so dead workers' connections are noticed,
        # and accept client pings as often as every 10 s (the client pings every 30 s).
        ("grpc.keepalive_time_ms", 60_000),
        ("grpc.keepalive_timeout_ms", 20_000),
        ("grpc.http2.min_ping_interval_without_data_ms", 10_000),
        ("grpc.keepalive_permit_without_calls", 1),
        # Calls that arrived but that the event loop has not picked up yet: beyond 1,000 of them gRPC drops
        # new ones at random, beyond 3,000 all of them, with CANCELLED (a burst of a few thousand watchers
        # opening at once lost some that way). Admission (admission.py) is what limits calls, with our own
        # answer: let the queue hold every call its limits could admit, plus the control calls. Every method
        # shares the one queue (none is registered by name, see method_wrapping).
        ("grpc.server.max_pending_requests", admitted_calls(config)),
        ("grpc.server.max_pending_requests_hard_limit", admitted_calls(config)),
    ]


def admitted_calls(config: Any) -> int:
    """The most calls the admission limits let run at once, plus room for control calls; at most gRPC's largest
    channel argument (a C int), which already means no limit of gRPC's own (larger stopped start-up with an
    OverflowError)."""
    return min(sum(limit.limit for limit in call_limits(config.server).values()) + CONTROL_CALL_ROOM, GRPC_INT_MAX)


# What a certificate out of its dates does, per file of server.tls: the server's own makes clients refuse the
# handshake; the client CA's makes the server refuse every client certificate it issued.
_WHO_REFUSES = {
    "cert_file": "clients refuse the handshake",
    "client_ca_file": "the server refuses every client certificate it issued",
}


def check_certificate_dates(config: Any, now: Optional[datetime] = None) -> None:
    """The dates of server.tls.cert_file's and server.tls.client_ca_file's certificates, against `now`.

    The server's certificate (the first of cert_file) expired, or a client CA file whose certificates have all
    expired or that holds none, is a ConfigError naming the file and the dates: every handshake would fail with
    'certificate has expired' (or 'unknown ca'), and the server would say nothing. A certificate not valid yet (a
    clock behind the issuer's: it becomes valid by itself), an expired one further down the server's chain
    (clients may build another path, as with a cross-signed root) and one expired CA of several are warned about."""
    tls = config.server.get("tls") or {}
    if not str(tls.get("cert_file") or ""):  # without it the listener is plaintext: client_ca_file is not used
        return
    now = now or datetime.now(timezone.utc)
    for key in _WHO_REFUSES:
        path = str(tls.get(key) or "")
        if path:
            _check_file_dates(key, path, now)


def _check_file_dates(key: str, path: str, now: datetime) -> None:
    """check_certificate_dates for one file of server.tls (`key`: cert_file or client_ca_file)."""
    with open(path, encoding="ascii", errors="replace") as handle:  # read already by check_tls_files
        blocks = re.findall(r"-----BEGIN CERTIFICATE-----.*?-----END CERTIFICATE-----", handle.read(), re.S)
    if not blocks and key == "client_ca_file":  # cert_file without one failed check_tls_files already
        raise ConfigError(f"server.tls.{key} = {path!r}: holds no certificate (no -----BEGIN CERTIFICATE----- "
                          f"line), so {_WHO_REFUSES[key]}: give the PEM certificate(s) of the CA that issues the "
                          f"clients' certificates")
    dated = []
    for index, block in enumerate(blocks, 1):
        try:
            dated.append((index, *certificate_validity(ssl.PEM_cert_to_DER_cert(block))))
        except (ValueError, IndexError):  # not the DER expected: gRPC's own check of the chain is the judge then
            continue
    # The server presents its first certificate; a client CA file trusts each of its certificates alike.
    fatal = ({1} if key == "cert_file" else
             {index for index, _, _ in dated} if all(not_after < now for _, _, not_after in dated) else set())
    for index, not_before, not_after in dated:
        which = ("its certificate" if len(blocks) == 1 or (index == 1 and key == "cert_file") else
                 f"certificate {index} of its chain" if key == "cert_file" else f"certificate {index} of {len(blocks)}")
        if not_after < now:
            problem = (f"server.tls.{key} = {path!r}: {which} expired on {_utc(not_after)} (notAfter), so "
                       f"{_WHO_REFUSES[key]} ('certificate has expired')")
            dates = f"it was valid from {_utc(not_before)}"
            if index in fatal:
                raise ConfigError(f"{problem}; {dates}: renew it")
            if key == "cert_file":
                log.warning("%s unless they find another path to a root they trust; %s", problem, dates)
            else:
                log.warning("%s; %s; the file's other certificates are valid", problem, dates)
        elif not_before > now:
            log.warning("server.tls.%s = %r: %s is not valid before %s (notBefore; now %s): %s until then (is this "
                        "machine's clock, or the issuer's, wrong?)", key, path, which, _utc(not_before), _utc(now),
                        _WHO_REFUSES[key])


def certificate_validity(der: bytes) -> tuple[datetime, datetime]:
    """(notBefore, notAfter) of a DER X.509 certificate: the ssl module reads them only from a live connection
    (or from CA certificates), so the few DER fields before them are walked here."""

    def element(at: int) -> tuple[int, int, int]:  # (tag, where its value starts, where it ends)
        tag, length, at = der[at], der[at + 1], at + 2
        if length & 0x80:
            size = length & 0x7F
            length, at = int.from_bytes(der[at:at + size], "big"), at + size
        return tag, at, at + length

    _, at, _ = element(0)  # Certificate ::= SEQUENCE { tbsCertificate, ... }
    _, at, _ = element(at)  # TBSCertificate ::= SEQUENCE { [0] version OPTIONAL, serial, signature, issuer, validity
    tag, _, end = element(at)
    if tag == 0xA0:  # the explicit version
        at = end
    for _ in range(3):  # serialNumber, signature, issuer
        at = element(at)[2]
    _, at, _ = element(at)  # Validity ::= SEQUENCE { notBefore Time, notAfter Time }
    times = []
    for _ in range(2):
        tag, start, at = element(at)
        text = der[start:at].decode("ascii")
        if tag == 0x17:  # UTCTime, YYMMDDHHMMSSZ: years 50-99 are 19xx (RFC 5280)
            text = ("19" if int(text[:2]) >= 50 else "20") + text
        elif tag != 0x18:  # neither it nor GeneralizedTime (YYYYMMDDHHMMSSZ)
            raise ValueError(f"unexpected time tag {tag:#x}")
        times.append(datetime.strptime(text, "%Y%m%d%H%M%SZ").replace(tzinfo=timezone.utc))
    return times[0], times[1]


def _utc(moment: datetime) -> str:
    return moment.strftime("%Y-%m-%d %H:%M:%S UTC")


def tune_garbage_collector() -> None:
    """Rare full collections: the server holds many long-lived objects (queued and buffered trajectories), which
    every full collection would walk again, stalling the event loop; short young ones (see GC_YOUNG_THRESHOLD)."""
    gc.freeze()  # everything loaded at start-up stays out of every collection
    gc.set_threshold(GC_YOUNG_THRESHOLD, GC_MIDDLE_THRESHOLD, GC_OLD_THRESHOLD)


class PacerServer:
    """One pacing server: owns the Pacer, its asyncio face, the grpc.aio server and the health states."""

    def __init__(self, config: Any, pacer: Optional[Pacer] = None):
        self.config = config
        # The strategy, filters and replay strategies first: one whose __init__ fails stops start-up before the state
        # directory is touched.
        strategy = create_strategy(config) if pacer is None else None
        filters = create_filters(list(config.rollout.filter), config) if pacer is None else None
        replay_strategies = create_replay_strategies(config) if pacer is None else None
        transport.check_tls_files(config)  # so is a certificate and key that do not go together
        check_certificate_dates(config)  # and an expired certificate, which every client would refuse
        state_dir = str(config.server.state_dir or "")
        # The journal takes the state directory's lock now: a second server on it fails before binding.
        self.journal = (SqliteJournal(state_dir, fsync=str(config.server.fsync), codec=ProtoTrajectories())
                        if state_dir and pacer is None else None)
        self.pacer = pacer if pacer is not None else Pacer(config, strategy=strategy, filters=filters, journal=self.journal,
                                                           replay_strategies=replay_strategies)
        self._journal_failure_reported = False
        self.async_pacer = AsyncPacer(
            self.pacer,
            max_wait_seconds=float(config.server.max_wait_seconds),
            watch_queue_limit=int(config.server.watch_queue_events),
        )
        # None when no token is configured; reads server.auth_token_file or $CODA_TOKEN (ConfigError if unusable).
        self.auth = auth.token_interceptor(config.server)
        check_metrics_security(config.server, self.auth.check if self.auth is not None else None)
        self.listeners = transport.Listeners()  # what start() bound: TCP, Unix socket, health-only port
        self.health_server: Optional[grpc.aio.Server] = None  # the plaintext health-only server, if configured
        self.health = health.aio.HealthServicer()
        self.admission = Admission(config.server)
        self.observability = Observability(config, self.async_pacer, self.admission)
        self.server: Optional[grpc.aio.Server] = None
        self.ports: list[int] = []
        self.metrics_port: Optional[int] = None  # bound port of the /metrics listener; None when disabled
        self.allocator_retains = False  # whether server.allocator_retain_bytes applied (set by start)
        self.heap_trimmer: Optional[HeapTrimmer] = None  # returns freed heap pages once held bytes fall (start)
        self._recovered = self.journal is None  # whether start() has rebuilt the state (nothing to rebuild: True)
        self._stop_requested = False  # stop_recovery() was called: start() must not go on to serve

    async def start(self) -> list[int]:
        """Bind, start serving and turn readiness on; returns the bound port(s)."""
        tune_garbage_collector()
        retain_bytes = int(self.config.server.allocator_retain_bytes)
        self.allocator_retains = retain_freed_memory(retain_bytes)
        if self.allocator_retains:
            loop = asyncio.get_running_loop()
            self.heap_trimmer = HeapTrimmer(retain_bytes, start=lambda run: loop.call_soon_threadsafe(in_a_thread, run))
            self.async_pacer.pacer.held_bytes.watch(self.heap_trimmer.held_bytes_changed)
        # A descriptor per connection: at most one per worker (its stream, long-poll and Submits share it).
        transport.raise_open_file_limit(int(self.config.server.max_watch_streams) + CONTROL_CALL_ROOM)
        self.async_pacer.bind_loop()
        # Authentication is the one interceptor, so a refused request is never decoded. No
        # maximum_concurrent_rpcs: it counts every call alike, so watchers could starve the trainer's Reset;
        # admission limits calls by kind instead.
        self.server = grpc.aio.server(
            interceptors=[self.auth] if self.auth is not None else None,
            options=server_options(self.config),
        )
        # Every method's handler is built once, at registration, as one coroutine (rpc_handlers.py): observed
        # (counted, timed, logged, refused calls included), admitted (client id, rate limits, room by kind of
        # call), refused INVALID_ARGUMENT if its request bytes do not decode, its core errors mapped to status
        # codes; with the pass-through (de)serializers of the messages carrying trajectories (wire.py).
        handlers = RpcHandlers(self.observability.rpc_observer, self.admission, PassthroughCodec(SERVICE_NAME))
        # No method registered by name: each one would cost every call a done callback (method_wrapping).
        registrar = WrappingRegistrar(self.server, [handlers], by_name=())
        if self.auth is not None:
            self.auth.wrap_refusals(handlers.observed)
        pacer_pb2_grpc.add_RolloutPacerServicer_to_server(
            RolloutPacerServicer(self.async_pacer, int(self.config.server.max_message_bytes)), registrar)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, registrar)
        services = [SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name]
        if self.config.server.reflection:
            from grpc_reflection.v1alpha import reflection

            reflection.enable_server_reflection([*services, reflection.SERVICE_NAME], registrar)
        # TCP (plaintext, TLS or mutual TLS) and/or the Unix socket; then the plaintext health-only port.
        self.listeners = transport.bind(self.server, self.config)
        self.ports = [self.listeners.tcp_port] if self.listeners.tcp_port is not None else []
        self.health_server, self.listeners.health_host, self.listeners.health_port = \
            transport.health_only_server(self.config, self.health)
        try:
            self.metrics_port = self.observability.start_metrics(self.auth.check if self.auth is not None else None)
        except OSError as exc:
            host = str(self.config.server.metrics_address).rpartition(":")[0] or "127.0.0.1"
            raise BindError(f"cannot serve metrics on {self.config.server.metrics_address}: {exc}. Another "
                            f"coda-server on this machine? Start this one with server.metrics_address={host}:0 "
                            f"(a free port, named in the start-up line), another port, or server.metrics_address= "
                            f"(no metrics)") from None
        for name in HEALTH_SERVICES:
            await self.health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
        await self.health.set("liveness", health_pb2.HealthCheckResponse.SERVING)
        await self.server.start()
        transport.secure_socket(self.listeners)
        if self.health_server is not None:
            await self.health_server.start()
        await self._recover()
        self.async_pacer.on_journal_failure = self._journal_failed
        if self.journal is not None:  # said by the journal's writer thread: failing, or working again
            loop = asyncio.get_running_loop()
            self.journal.on_health = lambda error: loop.call_soon_threadsafe(self._journal_health, error)
        await self._set_readiness(True)
        return self.ports

    async def _set_readiness(self, serving: bool) -> None:
        """Readiness as every probe sees it: the health service (all but liveness) and the metrics."""
        self.observability.ready = serving
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in ("", "readiness", SERVICE_NAME):
            await self.health.set(name, status)

    async def _recover(self) -> None:
        """Rebuild the state from server.state_dir, off the event loop; until then pacer calls get UNAVAILABLE."""
        if self.journal is None:
            return
        if self._stop_requested:  # the signal came before recovery began: do not begin it
            raise RecoveryInterrupted("stopped before reading the journal")
        self.async_pacer.recovering = True
        started = time.monotonic()
        # Not reset when recovery fails or is interrupted: a state rebuilt in part must be neither served nor
        # written to (pacer calls stay refused, lease expiry idles) until the process exits.
        replayed = await asyncio.get_running_loop().run_in_executor(None, self.pacer.recover)
        self._recovered = True
        if self._stop_requested:  # asked to stop as the last event was replayed: still no serving
            raise RecoveryInterrupted(f"stopped after replaying all {replayed} events")
        self.async_pacer.recovering = False
        state, seconds = self.pacer.state(), time.monotonic() - started
        # The groups as the `stopped` line counts them: leased ones are kept across the restart too.
        log.info("recovered state from %s in %.2fs: %d events replayed since the last snapshot; step %d, "
                 "generation %d, %d running, %d buffered and %d leased groups%s", self.journal.directory,
                 seconds, replayed, state.step, state.generation, state.running, state.buffered, state.leased,
                 ", dispatch paused" if state.paused else "",
                 extra=fields(event="recovered", state_dir=str(self.journal.directory), seconds=round(seconds, 3),
                              replayed_events=replayed, step=state.step, weight_version=state.weight_version,
                              generation=state.generation, running=state.running, buffered=state.buffered,
                              leased=state.leased, paused=state.paused))

    def stop_recovery(self) -> Optional[str]:
        """A stop asked for before the state is rebuilt (SIGTERM during a long recovery): the recovery stops before
        its next event, having written nothing, and start() raises RecoveryInterrupted instead of serving.
        Returns how far it got, for the log line; None when there is nothing to stop (no state directory, or
        recovered already)."""
        if self._recovered:
            return None
        self._stop_requested = True
        self.pacer.recovery.interrupt()
        progress = self.pacer.recovery.progress
        return (f"{progress[0]} of {progress[1]} events replayed" if progress is not None else
                "reading the journal")

    async def close(self) -> None:
        """After a start() that failed or was interrupted: stop what it started, at once, so that nothing is left
        behind (a listener, the Unix socket file). The journal stays open: closing it would fold its write-ahead
        log into the database file, and a failed start leaves the state directory as it found it (the process
        exits next, which releases the directory's lock)."""
        # Each step on its own: the start-up failure is what gets reported, not a failure to clean up after it.
        with contextlib.suppress(Exception):  # lease expiry and the gate re-checks end: they would write
            self.async_pacer.drain()
        for server in (self.server, self.health_server):
            if server is not None:
                with contextlib.suppress(Exception):
                    await server.stop(0)
        with contextlib.suppress(Exception):
            await self.observability.stop()
        # gRPC removes the socket when a started server stops; one bound but never started keeps its file.
        path = self.listeners.uds_path
        with contextlib.suppress(OSError):
            if path is not None and stat.S_ISSOCK(os.lstat(path).st_mode):
                os.unlink(path)

    def _journal_failed(self, error: BaseException) -> None:
        """The state directory cannot be written now: no caller should be sent here until it can again."""
        self._journal_health(error)

    def _journal_health(self, error: Optional[BaseException]) -> None:
        """Readiness follows the journal: NOT_SERVING while it cannot write, SERVING again once it can (the
        writer retries by itself); liveness NOT_SERVING too once it has failed for
        JOURNAL_FAILURE_LIVENESS_SECONDS, so that the orchestrator restarts the server."""
        if self.async_pacer.pacer.closed:
            return
        if error is None:
            if self._journal_failure_reported:
                self._journal_failure_reported = False
                log.warning("state directory %s can be written again: readiness SERVING", self.journal.directory)
                asyncio.ensure_future(self._set_readiness(True))
                asyncio.ensure_future(self.health.set("liveness", health_pb2.HealthCheckResponse.SERVING))
            return
        if not self._journal_failure_reported:
            self._journal_failure_reported = True
            log.error("readiness NOT_SERVING while the state directory cannot be written (changes are refused "
                      "with UNAVAILABLE, reason STATE_DIR_UNWRITABLE); liveness follows after %.0f s: %s",
                      JOURNAL_FAILURE_LIVENESS_SECONDS, error)
            asyncio.ensure_future(self._set_readiness(False))
            asyncio.get_running_loop().call_later(JOURNAL_FAILURE_LIVENESS_SECONDS, self._journal_still_failing)

    def _journal_still_failing(self) -> None:
        journal = self.journal
        if journal is None or journal.failing_since is None or self.async_pacer.pacer.closed:
            return
        if time.monotonic() - journal.failing_since >= JOURNAL_FAILURE_LIVENESS_SECONDS:
            log.error("state directory %s has not been writable for %.0f s: liveness NOT_SERVING, for a restart",
                      journal.directory, time.monotonic() - journal.failing_since)
            asyncio.ensure_future(self.health.set("liveness", health_pb2.HealthCheckResponse.NOT_SERVING))
        else:  # it recovered and failed again since: check again at the end of this spell's allowance
            asyncio.get_running_loop().call_later(
                JOURNAL_FAILURE_LIVENESS_SECONDS - (time.monotonic() - journal.failing_since),
                self._journal_still_failing)

    async def drain(self) -> None:
        """Stop taking work: readiness NOT_SERVING, waiting long-polls answered now, watchers told SHUTDOWN."""
        await self._set_readiness(False)
        self.async_pacer.drain()

    async def stop(self, grace: Optional[float] = None) -> None:
        """Drain, then give in-flight RPCs `grace` seconds (default server.shutdown_grace_seconds) to finish."""
        if grace is None:
            grace = float(self.config.server.shutdown_grace_seconds)
        await self.drain()
        if self.server is not None:
            await self.server.stop(grace)
        if self.auth is not None:  # after the last call: every refusal is counted in the summary
            self.auth.report_pending_refusals()
        if self.health_server is not None:  # last: probes see NOT_SERVING until the main server is gone
            await self.health_server.stop(0)
        await self.observability.stop()
        if self.journal is not None:  # after the last RPC: everything acknowledged is written
            await asyncio.get_running_loop().run_in_executor(None, self.journal.close)

    async def wait_for_termination(self) -> None:
        if self.server is not None:
            await self.server.wait_for_termination()
