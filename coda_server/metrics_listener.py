"""The /metrics HTTP listener: plaintext or TLS (server.metrics_tls), optionally behind the bearer token.

With `server.metrics_require_token` a scrape must send `Authorization: Bearer <token>`, the same token the
gRPC port asks for (compared the same way, in constant time); otherwise it is answered 401. With
`server.metrics_tls` the listener serves HTTPS with `server.tls`'s certificate and key, and requires a client
certificate when `server.tls.client_ca_file` is set, as the gRPC port does.
"""
from __future__ import annotations

import socket
import ssl
import threading
from typing import Any, Callable, Iterable, Optional
from wsgiref.simple_server import WSGIRequestHandler, make_server

from prometheus_client import CollectorRegistry, make_wsgi_app
from prometheus_client.exposition import ThreadingWSGIServer

from .core.errors import ConfigError
from .core.settings import setting

# Checks the Authorization header values of a request: None when they carry the right token, else
# (reason, message) (auth.BearerTokenInterceptor.check).
TokenCheck = Callable[[list[tuple[str, str]]], Optional[tuple[str, str]]]


class _QuietHandler(WSGIRequestHandler):
    """No line on stderr per scrape; a connection that stalls is dropped (its thread with it)."""

    timeout = 30.0

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base class's name
        pass


def _require_token(app: Callable, check: TokenCheck) -> Callable:
    def guarded(environ: dict, start_response: Callable) -> Iterable[bytes]:
        header = environ.get("HTTP_AUTHORIZATION")
        problem = check([("authorization", header)] if header is not None else [])
        if problem is not None:
            body = (f"401 Unauthorized: {problem[1]} (reason {problem[0]}); this listener asks for the same "
                    "bearer token as the gRPC port: send 'Authorization: Bearer <token>'\n").encode()
            start_response("401 Unauthorized", [("Content-Type", "text/plain; charset=utf-8"),
                                                ("Content-Length", str(len(body))),
                                                ("WWW-Authenticate", 'Bearer realm="coda-pacer metrics"')])
            return [body]
        return app(environ, start_response)

    return guarded


def tls_context(server_config: Any) -> ssl.SSLContext:
    """The HTTPS context of the listener, from server.tls (ConfigError when it is not set or unreadable)."""
    tls = server_config.get("tls") or {}
    cert_file, key_file, ca_file = (str(tls.get(key) or "") for key in ("cert_file", "key_file", "client_ca_file"))
    if not cert_file or not key_file:
        raise ConfigError("server.metrics_tls = true needs server.tls.cert_file and server.tls.key_file "
                          "(the listener serves the gRPC port's certificate)")
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        context.load_cert_chain(cert_file, key_file)
        if ca_file:
            context.load_verify_locations(cafile=ca_file)
            context.verify_mode = ssl.CERT_REQUIRED
    except (OSError, ssl.SSLError) as exc:
        raise ConfigError(f"server.metrics_tls: cannot load server.tls files ({exc})") from None
    return context


def check_metrics_security(server_config: Any, token_check: Optional[TokenCheck]) -> None:
    """ConfigError now, before anything binds, when the listener's security options cannot be met."""
    if not str(server_config.get("metrics_address") or ""):
        return
    if bool(setting({"server": server_config}, "server.metrics_require_token")) and token_check is None:
        raise ConfigError("server.metrics_require_token = true needs the bearer token configured "
                          "(server.auth_token_file or $CODA_TOKEN)")
    if bool(setting({"server": server_config}, "server.metrics_tls")):
        tls_context(server_config)


def start_metrics_listener(host: str, port: int, registry: CollectorRegistry, server_config: Any,
                           token_check: Optional[TokenCheck] = None) -> tuple[Any, str, str]:
    """Serve `registry` on host:port in a daemon thread; returns (server, scheme, what guards it).

    Raises OSError when the address cannot be bound, ConfigError when the security options cannot be met.
    """
    check_metrics_security(server_config, token_check)
    app = make_wsgi_app(registry)
    guards = []
    if bool(setting({"server": server_config}, "server.metrics_require_token")):
        app = _require_token(app, token_check)
        guards.append("bearer token")

    class Server(ThreadingWSGIServer):
        address_family = socket.AF_INET6 if ":" in host else socket.AF_INET

    httpd = make_server(host, port, app, Server, handler_class=_QuietHandler)
    scheme = "http"
    if bool(setting({"server": server_config}, "server.metrics_tls")):
        context = tls_context(server_config)
        # The handshake happens in the request's own thread (on its first read), not in accept(): a client
        # that connects and says nothing cannot stall the listener.
        httpd.socket = context.wrap_socket(httpd.socket, server_side=True, do_handshake_on_connect=False)
        scheme = "https"
        guards.append("client certificate" if context.verify_mode == ssl.CERT_REQUIRED else "TLS")
    threading.Thread(target=httpd.serve_forever, name="coda-metrics", daemon=True).start()
    return httpd, scheme, f" ({', '.join(guards)})" if guards else " (no authentication)"
