"""Listeners: TCP (plaintext, TLS or mutual TLS), a Unix domain socket, and a plaintext health-only port.

Which to use when is in docs/security.md. In short: the Unix socket for callers in the same pod (the
file mode decides who may connect), TLS or mutual TLS for callers in other pods, the health-only port
for the Kubernetes gRPC probe (which speaks neither TLS nor bearer tokens).
"""
from __future__ import annotations

import contextlib
import errno
import logging
import os
import resource
import socket
import ssl
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import grpc
from grpc_health.v1 import health_pb2_grpc

from .core.settings import parse_file_mode, parse_host_port, setting
from .core.errors import ConfigError

log = logging.getLogger("coda_server")

# sun_path holds 108 bytes on Linux, including the terminating NUL.
MAX_UDS_PATH_BYTES = 107
# The health-only server answers probes: a few at a time is plenty, and tiny messages.
HEALTH_MAX_CONCURRENT_RPCS = 64
HEALTH_MAX_MESSAGE_BYTES = 4096


class BindError(RuntimeError):
    """The configured address could not be bound (in use, or not a local address)."""


@dataclass
class Listeners:
    """What the server listens on, once bound."""

    tcp_host: Optional[str] = None
    tcp_port: Optional[int] = None
    tls: str = "plaintext"  # "plaintext", "TLS" or "mutual TLS" (the TCP listener; the socket is always plaintext)
    uds_path: Optional[str] = None
    uds_mode: Optional[int] = None
    health_host: Optional[str] = None
    health_port: Optional[int] = None

    @property
    def tcp_address(self) -> Optional[str]:
        return f"{self.tcp_host}:{self.tcp_port}" if self.tcp_port is not None else None

    def port_file(self) -> dict[str, Any]:
        """The --port-file content: the main TCP listener (null without one), plus the socket and health port if set."""
        content: dict[str, Any] = {"address": self.tcp_address, "port": self.tcp_port}
        if self.uds_path is not None:
            content["uds"] = self.uds_path
        if self.health_port is not None:
            content["health_port"] = self.health_port
            content["health_address"] = f"{self.health_host}:{self.health_port}"
        return content

    def describe(self) -> str:
        """One line for the start-up log."""
        parts = []
        if self.tcp_port is not None:
            parts.append(f"{self.tcp_address} ({self.tls})")
        if self.uds_path is not None:
            parts.append(f"unix:{self.uds_path} (mode {self.uds_mode:04o})")
        if self.health_port is not None:
            parts.append(f"health only {self.health_host}:{self.health_port} (plaintext)")
        return ", ".join(parts)


def _read(key: str, path: str) -> bytes:
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise ConfigError(f"server.tls.{key} = {path!r}: cannot be read ({exc.strerror or exc})") from None
    if b"-----BEGIN" not in data:
        raise ConfigError(f"server.tls.{key} = {path!r}: not a PEM file (no -----BEGIN line)")
    return data


def check_tls_files(config: Any) -> Optional[tuple[bytes, bytes, Optional[bytes]]]:
    """server.tls's files as read (certificate chain, private key, client CA or None), or None without TLS;
    ConfigError naming the key when they cannot serve: unreadable, not PEM, or a private key that is not the
    certificate's (gRPC would only fail to bind, naming neither). Call before anything else starts;
    server_credentials builds the credentials from what it returns."""
    tls = config.server.get("tls") or {}
    cert_file, key_file, ca_file = (str(tls.get(key) or "") for key in ("cert_file", "key_file", "client_ca_file"))
    if not cert_file:
        return None
    chain, key = _read("cert_file", cert_file), _read("key_file", key_file)
    roots = _read("client_ca_file", ca_file) if ca_file else None
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:  # the password callback: an encrypted key fails here instead of prompting on the terminal
        context.load_cert_chain(cert_file, key_file, password=lambda: b"")
    except (ssl.SSLError, OSError) as exc:
        keys = f"server.tls.cert_file = {cert_file!r} and server.tls.key_file = {key_file!r}"
        reason = getattr(exc, "reason", None) or " ".join(str(exc).split())
        if b"CERTIFICATE-----" in key and b"PRIVATE KEY-----" in chain:
            advice = "they look swapped: cert_file takes the certificate, key_file its private key"
        elif b"PRIVATE KEY-----" not in key:
            advice = "key_file holds no private key (no -----BEGIN ... PRIVATE KEY----- line); set it to the certificate's key"
        elif b"CERTIFICATE-----" not in chain:
            advice = "cert_file holds no certificate (no -----BEGIN CERTIFICATE----- line)"
        elif reason == "KEY_VALUES_MISMATCH":
            advice = "the private key is not the certificate's; set key_file to the key the certificate was issued for"
        elif b"ENCRYPTED" in key:
            advice = "the private key is encrypted; give key_file an unencrypted key (openssl pkey -in KEY -out KEY2)"
        else:
            advice = ("they are not a PEM certificate chain and its matching private key; cert_file takes the "
                      "certificate (chain), key_file its private key")
        raise ConfigError(f"{keys}: {advice} ({reason})") from None
    return chain, key, roots


def server_credentials(config: Any) -> tuple[Optional[grpc.ServerCredentials], str]:
    """(credentials, kind) for the TCP listener: (None, "plaintext") unless server.tls.cert_file is set."""
    files = check_tls_files(config)
    if files is None:
        return None, "plaintext"
    chain, key, roots = files
    if roots is not None:
        # Mutual TLS: the handshake fails for a client without a certificate chaining to `roots`.
        return grpc.ssl_server_credentials([(key, chain)], root_certificates=roots, require_client_auth=True), "mutual TLS"
    return grpc.ssl_server_credentials([(key, chain)]), "TLS"


def bind(server: grpc.aio.Server, config: Any) -> Listeners:
    """Add the TCP listener (when server.address is set) and the Unix socket (when server.uds_path is set).

    Call before `server.start()`; call `secure_socket` after it.
    """
    listeners = Listeners()
    address = str(config.server.get("address") or "").strip()
    if address:
        credentials, listeners.tls = server_credentials(config)
        listeners.tcp_port = _add_port(server, address, credentials)
        listeners.tcp_host = address.rsplit(":", 1)[0]
    uds_path = str(config.server.get("uds_path") or "")
    if uds_path:
        mode = parse_file_mode(setting(config, "server.uds_mode"))
        path = os.path.abspath(uds_path)
        _check_socket_path(path)
        # The socket is created with the process umask: narrow it during the bind, so there is no moment
        # in which the socket is more open than `mode` (chmod afterwards would leave such a window).
        previous = os.umask(0o777 & ~mode)
        try:
            _add_port(server, f"unix:{path}", None)
        finally:
            os.umask(previous)
        listeners.uds_path, listeners.uds_mode = path, mode
    return listeners


def secure_socket(listeners: Listeners) -> None:
    """After start: apply the socket's mode explicitly (the umask can only remove bits, never add them)."""
    if listeners.uds_path is not None and os.path.exists(listeners.uds_path):
        os.chmod(listeners.uds_path, listeners.uds_mode)


def _add_port(server: grpc.aio.Server, address: str, credentials: Optional[grpc.ServerCredentials]) -> int:
    in_use = _in_use(address)  # first: gRPC's own error says only "Failed to bind", after lines of its C core
    if in_use:
        raise BindError(in_use)
    try:
        port = server.add_secure_port(address, credentials) if credentials else server.add_insecure_port(address)
    except RuntimeError as exc:
        raise BindError(_in_use(address) or f"cannot listen on {address}: {exc}") from None
    if port == 0:
        raise BindError(_in_use(address) or f"cannot listen on {address}: the address is in use or not available")
    return port


def _in_use(address: str) -> Optional[str]:
    """The refusal of a TCP `address` whose port another socket already listens on (tried with a socket of our
    own, as gRPC binds: SO_REUSEADDR, no SO_REUSEPORT); None when it is free, port 0, or not plain TCP."""
    if address.startswith("unix:"):
        return None
    parsed = parse_host_port(address)
    if parsed is None or parsed[1] == 0:
        return None
    host, port = parsed
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except (OSError, UnicodeError):
        return None
    for family, kind, proto, _, sockaddr in infos:
        try:
            probe = socket.socket(family, kind, proto)
        except OSError:
            continue
        try:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            probe.bind(sockaddr)
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                return (f"cannot listen on {address}: the address is already in use (another coda-server, or "
                        f"another program, listens on port {port}); stop it, or choose another port (port 0: a free "
                        f"one, which --port-file writes down)")
        finally:
            probe.close()
    return None


def _check_socket_path(path: str) -> None:
    """Refuse a path gRPC would mishandle; remove a stale socket left by a crashed server.

    gRPC unlinks whatever socket sits at the path before binding, so a second server would silently take
    the socket over from a running one: find out first whether someone still listens there.
    """
    if len(os.fsencode(path)) > MAX_UDS_PATH_BYTES:
        raise BindError(f"server.uds_path {path!r} is longer than {MAX_UDS_PATH_BYTES} bytes, the Unix socket limit")
    parent = os.path.dirname(path)
    if not os.path.isdir(parent):
        raise BindError(f"server.uds_path {path!r}: directory {parent!r} does not exist")
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(info.st_mode):
        raise BindError(f"server.uds_path {path!r} exists and is not a socket; refusing to replace it")
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.settimeout(1.0)
        probe.connect(path)
    except OSError as exc:
        if exc.errno not in (errno.ECONNREFUSED, errno.ENOENT):
            raise BindError(f"server.uds_path {path!r}: cannot tell whether it is in use ({exc})") from None
        log.info("removing stale socket %s (nobody listens on it)", path)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
    else:
        raise BindError(f"cannot listen on unix:{path}: another server is listening on it")
    finally:
        probe.close()


def raise_open_file_limit(wanted: int) -> tuple[int, int]:
    """Raise the soft limit on open files towards `wanted` (never above the hard limit); returns (soft, hard).

    Every client connection is a file descriptor, and the usual soft limit (1,024) is far below what
    thousands of workers, each with its own connection, need: past it, accept() fails and clients see
    UNAVAILABLE. The hard limit is the operator's (ulimit -Hn, systemd LimitNOFILE, the container runtime).
    """
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
    if target > soft:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            log.info("raised the open-file limit from %d to %d for client connections", soft, target)
            soft = target
        except (ValueError, OSError) as exc:
            log.warning("cannot raise the open-file limit from %d to %d: %s", soft, target, exc)
    if soft < wanted:
        log.warning("the open-file limit is %d, fewer than the %d connections server.max_watch_streams "
                    "workers may open; clients beyond it get UNAVAILABLE: raise the hard limit (ulimit -Hn, "
                    "LimitNOFILE, docker --ulimit nofile=...)", soft, wanted)
    return soft, hard


def health_only_server(config: Any, health_servicer: Any) -> tuple[Optional[grpc.aio.Server], Optional[str], Optional[int]]:
    """A second, plaintext grpc.aio server with grpc.health.v1 only, on server.health_address (None if unset).

    It shares the main server's HealthServicer, so readiness flips on both at once. No token is asked:
    probes send none, and health reveals nothing but SERVING / NOT_SERVING.
    """
    address = str(config.server.get("health_address") or "").strip()
    if not address:
        return None, None, None
    server = grpc.aio.server(
        options=[
            ("grpc.so_reuseport", 0),
            ("grpc.max_receive_message_length", HEALTH_MAX_MESSAGE_BYTES),
            ("grpc.max_send_message_length", HEALTH_MAX_MESSAGE_BYTES),
        ],
        maximum_concurrent_rpcs=HEALTH_MAX_CONCURRENT_RPCS,
    )
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    port = _add_port(server, address, None)
    return server, address.rsplit(":", 1)[0], port
