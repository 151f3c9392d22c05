"""Channel construction shared by the sync and async clients: service config, options, credentials; reading a
streamed answer."""

from __future__ import annotations

import ipaddress
import json
import math
import numbers
import os
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Union

import grpc

from . import _tls
from .protocol import RPCS, SERVICE  # noqa: F401  (SERVICE was defined here)

DEFAULT_TIMEOUT_SECONDS = 30.0
# Added to a call's wait to get its deadline: the server answers a long-poll when the wait ends, and the
# answer still needs time to be built and to travel.
WAIT_MARGIN_SECONDS = 5.0
# The deadline of a Reset that waits as long as the server's default (its wait not given): the server bounds its
# waits far below it.
LONG_POLL_CAP_SECONDS = 3600.0
DEFAULT_MAX_MESSAGE_BYTES = 64 * 1024 * 1024

from .protocol import CLIENT_ID_METADATA_KEY, CLIENT_ID_PATTERN, CLIENT_ID_RULE, MAX_CLIENT_ID_LENGTH  # noqa: F401

ChannelOptions = Union[Sequence[tuple[str, Any]], Mapping[str, Any], None]
PemSource = Union[bytes, str, os.PathLike, None]


# How long the messages of a streamed answer whose call has ended with an error may still take to be read; see
# read_stream.
STREAM_END_GRACE_SECONDS = 2.0


def read_stream(call: Any) -> list[Any]:
    """Every message of a server-streamed answer (a sync unary-stream call), or the call's error.

    gRPC's own iterator can wait forever when the call fails just as a read starts (seen with UNAVAILABLE while
    the server restarted: the call's status is set, its read is never completed, grpc/grpc#20562). So the
    messages are read in a thread of their own, and when the call has ended with an error and that thread has
    not returned STREAM_END_GRACE_SECONDS later, the call's error is raised here (the reader, stuck in gRPC,
    is left behind: a daemon thread)."""
    changed = threading.Event()
    read = threading.Event()
    outcome: dict[str, Any] = {}

    def reader() -> None:
        try:
            outcome["messages"] = list(call)
        except BaseException as exc:  # noqa: BLE001 - handed to the caller as it is
            outcome["error"] = exc
        finally:
            read.set()
            changed.set()

    threading.Thread(target=reader, name="coda-stream-read", daemon=True).start()
    call.add_done_callback(lambda _: changed.set())
    changed.wait()
    if not read.is_set() and call.code() is not grpc.StatusCode.OK:
        if not read.wait(STREAM_END_GRACE_SECONDS):
            raise call  # the call is its own RpcError, with the status it ended with
    read.wait()
    if "error" in outcome:
        raise outcome["error"]
    return outcome["messages"]


def call_timeout(timeout: float, wait: float = 0.0) -> float:
    """Per-call deadline: the client timeout, stretched for a long-poll so the wait is never cut short."""
    return max(timeout, wait + WAIT_MARGIN_SECONDS) if wait > 0 else timeout


# UNAVAILABLE retries (gRPC A6): at most this many attempts, the pauses between them drawn at random below a
# back-off that starts at 0.1 s and doubles up to 2 s.
RETRY_MAX_ATTEMPTS = 5
_RETRY_BACKOFF_SECONDS = (0.1, 2.0)


def retry_attempts(timeout: float | None) -> int:
    """Attempts of a call that finds no server: RETRY_MAX_ATTEMPTS, or fewer so that the longest pauses between them
    take at most half the client's timeout. A call where nothing listens then ends UNAVAILABLE, naming the refusal,
    before its deadline: with all five (up to 1.5 s of pauses) a client with timeout=1 got DEADLINE_EXCEEDED."""
    attempts, paused, backoff = 1, 0.0, _RETRY_BACKOFF_SECONDS[0]
    while attempts < RETRY_MAX_ATTEMPTS and (timeout is None or paused + backoff <= timeout / 2):
        attempts, paused, backoff = attempts + 1, paused + backoff, min(backoff * 2, _RETRY_BACKOFF_SECONDS[1])
    return attempts


def service_config(wait_for_ready: bool = False, timeout: float | None = None) -> dict[str, Any]:
    """The channel's service config (gRPC A6/A2): wait-for-ready and UNAVAILABLE retries, per method; as many
    attempts as fit the client's `timeout` (retry_attempts).

    No method timeout: every call carries its own deadline (the client's timeout, stretched for a long-poll by
    call_timeout), and gRPC Python ends a call at once when a method config's timeout is under about two seconds
    (and about a second early above that, grpc/grpc#34547), so a client with timeout=1 failed every call."""
    # Only UNAVAILABLE is retried: it means the call never reached a working server (or the server was
    # draining and refused it). Mutating calls carry a request_id the server de-duplicates, so even a
    # retry of a call that did land is applied once.
    attempts = retry_attempts(timeout)
    retry_policy = {
        "maxAttempts": attempts,
        "initialBackoff": f"{_RETRY_BACKOFF_SECONDS[0]:g}s",
        "maxBackoff": f"{_RETRY_BACKOFF_SECONDS[1]:g}s",
        "backoffMultiplier": 2,
        "retryableStatusCodes": ["UNAVAILABLE"],
    }
    configs = []
    for retried in (True, False):
        names = [rpc.name for rpc in RPCS if rpc.retry_safe == retried]
        if not names:
            continue
        config: dict[str, Any] = {
            "name": [{"service": SERVICE, "method": m} for m in names],
            # Off (the default): a call to an address where nothing listens fails after the retries
            # (at most 1.5 s, and half the timeout) with UNAVAILABLE naming the target and the OS error, instead
            # of waiting out its deadline. On (wait_for_ready=True, as the worker kit sets it): calls queue while the server
            # (re)starts; the deadline still bounds the wait.
            "waitForReady": wait_for_ready,
        }
        if retried and attempts > 1:  # gRPC takes a retry policy of two attempts or more
            config["retryPolicy"] = retry_policy
        configs.append(config)
    return {
        "methodConfig": configs,
        # Stop retrying when most calls fail (server down for good): each failure costs a token, each
        # success gives back 0.1; retries stop below half of maxTokens.
        "retryThrottling": {"maxTokens": 10, "tokenRatio": 0.1},
    }


# The longest pause between two attempts to connect to a server that is away.
RECONNECT_BACKOFF_MAX_MS = 4000


def channel_options(
    *,
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
    options: ChannelOptions = None,
    wait_for_ready: bool = False,
    timeout: float | None = None,
) -> list[tuple[str, Any]]:
    """gRPC channel arguments; entries in `options` override the defaults key by key. `timeout`: the client's
    call timeout, which bounds the retries (retry_attempts)."""
    merged: dict[str, Any] = {
        # A Submit of a few long trajectories easily exceeds gRPC's 4 MiB default.
        "grpc.max_send_message_length": max_message_bytes,
        "grpc.max_receive_message_length": max_message_bytes,
        "grpc.enable_retries": 1,
        # A request larger than the retry buffer (256 KiB by default) is silently not retried; size it
        # so a large Submit is retried like any other call.
        "grpc.per_rpc_retry_buffer_size": max_message_bytes,
        "grpc.service_config": json.dumps(service_config(wait_for_ready, timeout), sort_keys=True),
        # Keepalive pings detect a dead server (or a silently dropped connection) during a long watch or
        # long-poll. A gRPC server answers pings more frequent than its
        # grpc.http2.min_ping_interval_without_data_ms (5 min by default) with GOAWAY "too_many_pings";
        # coda-server accepts one every 10 s, so 30 s is safe. Raise it for a server with the default.
        "grpc.keepalive_time_ms": 30_000,
        # Declare the connection dead when a ping is not acknowledged within this time.
        "grpc.keepalive_timeout_ms": 20_000,
        # No pings without an active call: an idle client has nothing to lose.
        "grpc.keepalive_permit_without_calls": 0,
        # A server that is back is found within a few seconds: gRPC's own back-off between connection attempts
        # grows to 120 s, so after an outage of a minute a worker could stay away from a restarted server long
        # enough (server.worker_liveness_seconds, 20 s) to have its running groups released.
        "grpc.initial_reconnect_backoff_ms": 500,
        "grpc.max_reconnect_backoff_ms": RECONNECT_BACKOFF_MAX_MS,
        "grpc.primary_user_agent": "coda-pacer-client",
    }
    if options:
        merged.update(dict(options.items() if isinstance(options, Mapping) else options))
    return list(merged.items())


def _pem(source: PemSource) -> bytes | None:
    """PEM bytes as given, PEM text as given, or the content of the file a str/path names."""
    if source is None or isinstance(source, bytes):
        return source
    if isinstance(source, str) and source.lstrip().startswith("-----BEGIN"):
        return source.encode("ascii")
    return Path(source).read_bytes()


@dataclass(frozen=True)
class TlsConfig:
    """TLS settings: each PEM value is bytes, PEM text, or a file path.

    root_certificates: CA bundle to verify the server (None: the system roots).
    certificate_chain / private_key: the client's certificate and key, for mutual TLS (both or neither).
    server_name: overrides the name checked against the server certificate (e.g. connecting by IP).
    """

    root_certificates: PemSource = None
    certificate_chain: PemSource = None
    private_key: PemSource = None
    server_name: str | None = None

    @classmethod
    def of(cls, tls: TlsSpec) -> TlsConfig | None:
        """Normalises the `tls` argument: None/False (plaintext), True (system roots), a mapping or a TlsConfig."""
        if tls is None or tls is False:
            return None
        if tls is True:
            return cls()
        if isinstance(tls, TlsConfig):
            return tls
        if isinstance(tls, Mapping):
            return cls(**tls)
        raise TypeError(f"tls must be None, True, a TlsConfig, a mapping or grpc.ChannelCredentials, not {tls!r}")

    def credentials(self) -> grpc.ChannelCredentials:
        """Channel credentials; ValueError when only one of certificate_chain/private_key is set, TlsFileError (a
        ValueError) naming the setting when one is not PEM of its kind (a key given as the certificate, a CA file
        that is no certificate) or the key is not the certificate's, OSError when a file cannot be read."""
        return self.checked_credentials(_tls.PYTHON_NAMES)

    def checked_credentials(self, names: Mapping[str, str]) -> grpc.ChannelCredentials:
        """credentials(), its errors naming the settings as `names` does (coda-client: its flags)."""
        if (self.certificate_chain is None) != (self.private_key is None):
            raise ValueError("mutual TLS needs both certificate_chain and private_key")
        # Checked here: gRPC takes any bytes, then fails every call with "Failed to create security handshaker"
        # after logging lines of its own.
        roots = _tls.read_pem(self.root_certificates, "root_certificates", names)
        chain = _tls.read_pem(self.certificate_chain, "certificate_chain", names)
        key = _tls.read_pem(self.private_key, "private_key", names)
        _tls.check_key_pair(self.certificate_chain, self.private_key, names)
        return grpc.ssl_channel_credentials(root_certificates=roots, private_key=key, certificate_chain=chain)


TlsSpec = Union[TlsConfig, Mapping[str, Any], bool, grpc.ChannelCredentials, None]


def resolve_tls(tls: TlsSpec) -> tuple[grpc.ChannelCredentials | None, list[tuple[str, Any]]]:
    """Credentials (None: plaintext) and the extra channel options the TLS settings need."""
    if isinstance(tls, grpc.ChannelCredentials):
        return tls, []
    config = TlsConfig.of(tls)
    if config is None:
        return None, []
    extra = [("grpc.ssl_target_name_override", config.server_name)] if config.server_name else []
    return config.credentials(), extra


# Targets in gRPC's name syntax (dns:///host:port, unix:/path, ipv4:..., ...) go to gRPC as they are.
_TARGET_SCHEMES = ("dns:", "unix:", "unix-abstract:", "ipv4:", "ipv6:", "vsock:", "xds:")


def _host_and_port(name: str) -> tuple[str, str | None]:
    """A `host:port` name split; port None when there is none (gRPC's default) or the name is a bare IPv6 address."""
    host, sep, port = name.rpartition(":")
    if not sep or (":" in host and not host.startswith("[")):
        return name, None
    return host, port


# URL schemes users paste (a gRPC target is no URL): gRPC reports them only at the first call, as a name it cannot
# resolve, which reads as a server that is down.
_URL_SCHEMES = ("http://", "https://", "grpc://", "grpcs://")


def check_target(target: str, plaintext: bool = False) -> str:
    """`target` if gRPC can dial it as given, else ValueError saying why: a plain `host:port` needs a port in
    1..65535 (gRPC would dial 99999 as 34463, and port 0 or one that is no number only fails at the first call);
    a URL or a name with spaces fails every call as unreachable; and without TLS (`plaintext`) a name without a
    port dials 443, gRPC's default for TLS, where no plaintext pacer listens."""
    example = "e.g. 127.0.0.1:50051"
    if not isinstance(target, str) or not target.strip():
        raise ValueError(f"target {target!r} is not an address: give host:port, {example}")
    if target != target.strip() or any(c.isspace() for c in target):
        raise ValueError(f"target {target!r} holds white space; give host:port alone, {example}")
    if target.lower().startswith(_URL_SCHEMES):
        bare = target.split("://", 1)[1].rstrip("/")
        raise ValueError(f"target {target!r} is a URL; a gRPC target is host:port without a scheme, here {bare!r} "
                         f"(TLS is the client's tls= setting, not https://)")
    if "://" in target or target.startswith(_TARGET_SCHEMES):
        return target
    host, port = _host_and_port(target)
    if port is not None and (not host or not port.isdigit() or not 0 < int(port) <= 65535):
        raise ValueError(f"target {target!r} is not host:port with a port in 1..65535, {example}")
    if port is None and plaintext:
        raise ValueError(f"target {target!r} has no port: without TLS gRPC would dial port 443, its default for TLS; "
                         f"give host:port, e.g. {target}:50051")
    return target


# A client's message limit: below 64 KiB the small calls' answers (GetState's, ListWorkers') may not fit; above
# 2**31 - 1 gRPC takes no limit (its channel arguments are C ints).
MIN_MESSAGE_BYTES, MAX_MESSAGE_BYTES = 64 * 1024, 2**31 - 1


def check_client_limits(timeout: Any, max_message_bytes: Any) -> tuple[float, int]:
    """`timeout` and `max_message_bytes` as a float and an int, or ValueError naming what is allowed: a deadline
    of 0 or less fails every call, and a message limit of 0 (or gRPC's -1 for "none") refuses every Submit."""
    if isinstance(timeout, bool) or not isinstance(timeout, numbers.Real) or not 0 < timeout < math.inf:
        raise ValueError(f"timeout must be a number of seconds > 0 (each call's deadline), not {timeout!r}")
    if (isinstance(max_message_bytes, bool) or not hasattr(type(max_message_bytes), "__index__")
            or not MIN_MESSAGE_BYTES <= max_message_bytes <= MAX_MESSAGE_BYTES):
        raise ValueError(f"max_message_bytes must be an integer from {MIN_MESSAGE_BYTES} to {MAX_MESSAGE_BYTES}, not "
                         f"{max_message_bytes!r}: it is the largest message this client sends or takes (Submits are "
                         f"measured against it, Collect answers cut to it); gRPC's -1 for no limit is not taken")
    return float(timeout), int(max_message_bytes)


# The environment variables gRPC's C core reads, in its order, for the HTTP CONNECT proxy of every channel, and
# those that exclude hosts from it.
_PROXY_VARIABLES = ("grpc_proxy", "https_proxy", "http_proxy")
_NO_PROXY_VARIABLES = ("no_grpc_proxy", "no_proxy")
_ENABLE_PROXY = "grpc.enable_http_proxy"


def target_host(target: str) -> str | None:
    """The host of a `host:port`, `dns:///host:port` or `ipv4:`/`ipv6:` target (the first address of a list); None
    for other gRPC names, e.g. unix:."""
    name = target
    for prefix in ("dns:///", "ipv4:", "ipv6:"):
        if target.startswith(prefix):
            name = target[len(prefix):].split(",")[0]
    if "://" in name or name.startswith(_TARGET_SCHEMES):
        return None
    return _host_and_port(name)[0].removeprefix("[").removesuffix("]").lower()


def is_loopback(host: str | None) -> bool:
    """Whether `host` names this machine's loopback interface."""
    if host is None:
        return False
    if host == "localhost" or host.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def proxy_options(target: str) -> dict[str, Any]:
    """Channel arguments that keep a loopback target off an HTTP proxy from the environment: a proxy elsewhere
    cannot reach this machine's loopback, and a sidecar's clients and probes would fail with the proxy's error
    (the caller's own `grpc.enable_http_proxy` still wins)."""
    return {_ENABLE_PROXY: 0} if is_loopback(target_host(target)) else {}


def proxy_in_use(target: str, options: Mapping[str, Any]) -> str | None:
    """The HTTP proxy gRPC sends this target's channel through, as "URL (from $variable)", or None: no proxy
    variable set, the channel argument turning it off, a gRPC name other than host:port, or the host in
    no_grpc_proxy / no_proxy (matched as gRPC does for names: the entry, or a domain suffix of it)."""
    if not options.get(_ENABLE_PROXY, 1):
        return None
    host = target_host(target)
    variable = next((name for name in _PROXY_VARIABLES if os.environ.get(name)), None)
    if host is None or variable is None:
        return None
    excluded = next((os.environ[name] for name in _NO_PROXY_VARIABLES if os.environ.get(name) is not None), "")
    for entry in (e.strip().lower() for e in excluded.split(",")):
        if entry == "*" or (entry and (host == entry.lstrip(".") or host.endswith("." + entry.lstrip(".")))):
            return None
    return f"{os.environ[variable]} (from ${variable})"


def unreachable_target(target: str, options: Mapping[str, Any]) -> str:
    """How an UNAVAILABLE error names where the client tried to reach: the target, and the proxy it went through."""
    proxy = proxy_in_use(target, options)
    if proxy is None:
        return target
    return (f"{target} through the HTTP proxy {proxy}; to connect directly, add the host to no_grpc_proxy or pass "
            f"options={{'{_ENABLE_PROXY}': 0}}")


def check_client_id(client_id: str) -> str:
    """`client_id` if it is a valid client id, else ValueError saying what is allowed (the server's rule too)."""
    if not isinstance(client_id, str) or not CLIENT_ID_PATTERN.fullmatch(client_id):
        shown = client_id if not isinstance(client_id, str) or len(client_id) <= MAX_CLIENT_ID_LENGTH else (
            client_id[:MAX_CLIENT_ID_LENGTH] + "...")
        raise ValueError(f"client id {shown!r} is not allowed: {CLIENT_ID_RULE}")
    return client_id


def check_token(token: str | None) -> str | None:
    """The bearer token without the white space around it (a file's trailing newline or CRLF, as
    `open(path).read()` or `$(cat file)` keep it: the server strips its own token file alike); None when nothing is
    left. ValueError, without the token, when it holds what a gRPC header cannot carry: gRPC would fail every call
    with INTERNAL "Invalid metadata" after logging a trace of its own."""
    if token is None:
        return None
    if not isinstance(token, str):
        raise TypeError(f"token must be a str, not {type(token).__name__}")
    token = token.strip()
    bad = sorted({f"{c!r}" for c in token if not " " <= c <= "~"})
    if bad:
        raise ValueError(f"the token holds characters a gRPC header cannot carry ({', '.join(bad[:5])}; printable "
                         f"ASCII only): is it the right file or variable?")
    return token or None


def call_metadata(token: str | None, client_id: str | None = None) -> tuple[tuple[str, str], ...]:
    """Metadata sent with every call: the bearer token and the client id, when configured.

    Sent as plain call metadata rather than call credentials, which gRPC refuses on plaintext
    channels (a sidecar on localhost often runs without TLS).
    """
    token = check_token(token)
    metadata: tuple[tuple[str, str], ...] = (("authorization", f"Bearer {token}"),) if token else ()
    if client_id is not None:
        metadata += ((CLIENT_ID_METADATA_KEY, check_client_id(client_id)),)
    return metadata
