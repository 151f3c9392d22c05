"""The client's TLS files checked before any connection, and gRPC's connection errors read as a TLS misconfiguration,
a wrong address or an outage, with the likely fix."""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Union

PemSource = Union[bytes, str, os.PathLike, None]

# How a message names each TLS setting, and how to change it: the Python client's words, and coda-client's flags.
PYTHON_NAMES: Mapping[str, str] = {
    "root_certificates": "root_certificates", "certificate_chain": "certificate_chain", "private_key": "private_key",
    "use_ca": "the CA that signed it as TlsConfig(root_certificates=...)",
    "use_tls": "try tls=True (the system's roots), or tls=TlsConfig(root_certificates=...) for a private CA",
    "use_client_cert": "TlsConfig(certificate_chain=..., private_key=...)",
    "use_plaintext": "tls=None", "use_server_name": "TlsConfig(server_name=...)",
}
CLI_NAMES: Mapping[str, str] = {
    "root_certificates": "--ca-file", "certificate_chain": "--cert-file", "private_key": "--key-file",
    "use_ca": "the CA that signed it with --ca-file FILE",
    "use_tls": "try --tls, or --ca-file FILE for a private CA",
    "use_client_cert": "--cert-file FILE and --key-file FILE",
    "use_plaintext": "no --tls, --ca-file, --cert-file or --key-file", "use_server_name": "--server-name NAME",
}

_CERTIFICATE = re.compile(rb"-----BEGIN (?:TRUSTED |X509 )?CERTIFICATE-----")
_PRIVATE_KEY = re.compile(rb"-----BEGIN (?:RSA |EC |DSA |ENCRYPTED )?PRIVATE KEY-----")


class TlsFileError(ValueError):
    """A TLS file (or PEM value) that gRPC could not use: said before any connection, naming the setting."""


def _shown(source: PemSource) -> str:
    return "(PEM given)" if isinstance(source, bytes) or (
        isinstance(source, str) and source.lstrip().startswith("-----BEGIN")) else str(source)


def read_pem(source: PemSource, field: str, names: Mapping[str, str] = PYTHON_NAMES) -> bytes | None:
    """PEM bytes as given, PEM text as given, or the content of the file a str/path names; checked for what `field`
    must hold (a certificate, or an unencrypted private key), else TlsFileError; OSError naming the setting when the
    file cannot be read. gRPC would only fail at the first call, logging lines of its own, with "Failed to create
    security handshaker"."""
    if source is None:
        return None
    if isinstance(source, bytes):
        data = source
    elif isinstance(source, str) and source.lstrip().startswith("-----BEGIN"):
        data = source.encode("ascii")
    else:
        try:
            data = Path(source).read_bytes()
        except OSError as exc:  # the setting and the path, not Python's bare "[Errno 2] ... 'ca.pem'"
            error = type(exc)(f"{names[field]} {source}: {exc.strerror or exc}")
            error.errno = exc.errno
            raise error from None
    label = f"{names[field]} {_shown(source)}"
    has_certificate, has_key = bool(_CERTIFICATE.search(data)), bool(_PRIVATE_KEY.search(data))
    if field == "private_key":
        if not has_key:
            swapped = (f": it holds a certificate; are {names['certificate_chain']} and {names['private_key']} "
                       f"swapped?" if has_certificate else "")
            raise TlsFileError(f"{label} is not a PEM private key (no '-----BEGIN ... PRIVATE KEY-----' line){swapped}")
        if b"ENCRYPTED" in data:
            raise TlsFileError(f"{label} is an encrypted private key; gRPC takes only an unencrypted one")
    elif not has_certificate:
        what = "CA certificate" if field == "root_certificates" else "certificate"
        swapped = (f": it holds a private key; are {names['certificate_chain']} and {names['private_key']} swapped?"
                   if has_key and field == "certificate_chain" else ": it holds a private key" if has_key else "")
        raise TlsFileError(f"{label} is not a PEM {what} (no '-----BEGIN CERTIFICATE-----' line){swapped}")
    return data


def check_key_pair(certificate_chain: PemSource, private_key: PemSource,
                   names: Mapping[str, str] = PYTHON_NAMES) -> None:
    """TlsFileError when both are files and the key is not the certificate's (read with the standard library's ssl;
    PEM given as values is left to gRPC). Only a mismatch is refused: ssl's other complaints (a key its OpenSSL
    finds too weak) do not stop gRPC."""
    if not all(isinstance(s, (str, os.PathLike)) and _shown(s) == str(s) for s in (certificate_chain, private_key)):
        return
    try:
        import ssl
    except ImportError:  # a Python without ssl: gRPC says it at the first call
        return
    try:
        ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT).load_cert_chain(str(certificate_chain), str(private_key))
    except ssl.SSLError as exc:
        if "KEY_VALUES_MISMATCH" in str(exc) or "key values mismatch" in str(exc):
            raise TlsFileError(f"{names['private_key']} {private_key} is not the key of {names['certificate_chain']} "
                               f"{certificate_chain} (key values mismatch)") from None
    except (OSError, ValueError):
        return


@dataclass(frozen=True)
class ConnectionTrouble:
    """Why connections to the server fail, read from gRPC's connection error.

    kind: "tls-untrusted", "tls-expired", "tls-name", "tls-not-tls", "tls-files", "tls-client-cert" (the handshake
    failed on a setting), "closed" (the server closed each connection as it opened) or NOT_GRPC (what answers does
    not speak HTTP/2: no gRPC server there); `settled`: a TLS misconfiguration or a wrong address, which fails every
    attempt alike until a setting changes (not an outage: waiting does not help); `text`: what goes wrong and the
    likely fix, one clause."""

    kind: str
    settled: bool
    text: str


# ConnectionTrouble.kind when something other than a gRPC server answers at the address.
NOT_GRPC = "not-grpc"
# gRPC's words when what answers its connection preface does not speak HTTP/2 (an HTTP/1 server's reply, or bytes
# of some other protocol, read as an HTTP/2 frame).
_NOT_HTTP2 = re.compile(r"Failed parsing HTTP/2|Expected SETTINGS frame", re.IGNORECASE)


def not_grpc(details: str) -> ConnectionTrouble | None:
    """The trouble when gRPC's connection error `details` says that something other than a gRPC server answers at
    the address (it does not speak HTTP/2): a wrong port, e.g. a web server's or the metrics port; else None."""
    if not _NOT_HTTP2.search(details):
        return None
    return ConnectionTrouble(NOT_GRPC, True, "something other than a gRPC server answers at that address (it does "
                             "not speak HTTP/2: a web server, a metrics port?): a wrong port? The pacer listens at "
                             "its server.address")


def tidy(details: str) -> str:
    """gRPC's connection error without the ": OK" its TLS failures end with (the status of a step that went well)."""
    return details[:-4] if details.endswith(": OK") else details


def _after(details: str, marker: str) -> str:
    """The words following `marker` in gRPC's error, up to the end (": OK" removed)."""
    return tidy(details.split(marker, 1)[1]).strip(" :") if marker in details else ""


def diagnose(details: str, tls: Any, names: Mapping[str, str] = PYTHON_NAMES) -> ConnectionTrouble | None:
    """What gRPC's connection error `details` says about this client's TLS settings or the address (no gRPC server
    there), or None (refused, unreachable, no route...). `tls`: None for plaintext, the TlsConfig, or other
    credentials (unknown)."""
    plaintext, known = tls is None, hasattr(tls, "root_certificates")
    has_roots = known and tls.root_certificates is not None
    has_client_cert = known and tls.certificate_chain is not None
    if not plaintext and "CERTIFICATE_VERIFY_FAILED" in details:
        why = _after(details, "CERTIFICATE_VERIFY_FAILED") or "verification failed"
        if "expired" in why or "not yet valid" in why:
            return ConnectionTrouble("tls-expired", True, f"the TLS handshake failed: the server's certificate is not "
                                     f"valid now ({why}; or this machine's clock is wrong): renew the server's "
                                     f"certificate (server.tls.cert_file) and restart it")
        roots = "the CA this client was given" if has_roots else "the system's roots (no CA given)"
        return ConnectionTrouble("tls-untrusted", True, f"the TLS handshake failed: the server's certificate is not "
                                 f"signed by a CA this client trusts ({why}; it verifies against {roots}): give "
                                 f"{names['use_ca']}")
    if not plaintext and "Hostname Verification Check failed" in details:
        return ConnectionTrouble("tls-name", True, "the TLS handshake failed: the server's certificate is not for the "
                                 "name this client dialed: dial a name the certificate holds, or give the name it "
                                 f"holds with {names['use_server_name']}")
    if not plaintext and "WRONG_VERSION_NUMBER" in details:
        return ConnectionTrouble("tls-not-tls", True, "the TLS handshake failed (WRONG_VERSION_NUMBER): the server "
                                 "does not speak TLS there, it may be plaintext: connect without TLS "
                                 f"({names['use_plaintext']}), or give the server server.tls.cert_file and key_file")
    if not plaintext and "Failed to create security handshaker" in details:
        return ConnectionTrouble("tls-files", True, "gRPC could not make a TLS handshake from this client's TLS "
                                 f"settings: check {names['root_certificates']}, {names['certificate_chain']} and "
                                 f"{names['private_key']}")
    if not plaintext and re.search(r"CERTIFICATE_REQUIRED|ALERT_UNKNOWN_CA|ALERT_BAD_CERTIFICATE|"
                                   r"ALERT_CERTIFICATE_UNKNOWN|ALERT_ACCESS_DENIED", details):
        return ConnectionTrouble("tls-client-cert", True,
                                 _client_cert_text("the server refused the TLS handshake", has_client_cert, names))
    # Only when connecting failed so: a call or stream cut on a connection that had worked ("Stream removed", a
    # server killed or restarted) says "Socket closed" too, and is no TLS matter.
    if "Socket closed" in details and "failed to connect" in details:
        if plaintext:
            return ConnectionTrouble("closed", False, "the server closed each connection as it opened (this client "
                                     f"connects without TLS); the server may require TLS: {names['use_tls']}")
        if known:
            return ConnectionTrouble("closed", False, _client_cert_text(
                "the server closed each connection after the TLS handshake", has_client_cert, names))
    return not_grpc(details)


def _client_cert_text(what: str, has_client_cert: bool, names: Mapping[str, str]) -> str:
    if has_client_cert:
        return (f"{what}: it may not accept this client certificate (not signed by the CA in its "
                f"server.tls.client_ca_file, or not made for client authentication)")
    return f"{what}: it may require a client certificate (mutual TLS): give {names['use_client_cert']}"
