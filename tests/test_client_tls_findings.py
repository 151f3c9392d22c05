"""A user's test of TLS and tokens with the client, the command and the worker kit, each case over a real server.

A failed TLS handshake is a configuration error: the worker kit stopped only at stop(), warning that nothing
listened; the command printed gRPC's own log lines before its line, with no hint for TLS against plaintext or a
missing client certificate; bad TLS files surfaced at the first call; a token read with its newline failed every
call with INTERNAL; the command named the Python client's token=, and a health-only port's UNIMPLEMENTED plainly.
Certificates are made with the `openssl` command line, as tests/test_security_transport.py makes them.
"""
from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from coda_client import PacerClient
from coda_client._channel import TlsConfig
from coda_client.errors import UnavailableError
from coda_worker.engines.fake import FakeEngine
from coda_worker.worker import ListPromptSource, Prompt, RolloutWorker, WorkerFailedError
from server_harness import ServerProcess, until
from test_durability_crash import free_port
from test_security_transport import SERVER_LEAF, make_pki, tls_overrides

pytestmark = pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command line")

REPO = Path(__file__).resolve().parents[1]
TOKEN = "tls-findings-token-0123456789abcdef"
SMALL = ("data_source.num_prompts_per_step=2", "data_source.num_trajectories_per_prompt=2",
         "trainer.mini_batch_size=2", "fully_async.sliding_window=no-window")
# How long a worker test lets a worker run before it calls stop(): far beyond what the fixed code needs (it
# fails or warns at the first failed connection), so stop() is what ends the old code's worker.
STOP_AFTER_SECONDS = 60.0


@pytest.fixture(scope="module")
def certs(tmp_path_factory) -> Path:
    directory = make_pki(tmp_path_factory.mktemp("certs"), ("rogue-server", SERVER_LEAF))
    (directory / "token").write_text(TOKEN + "\n")
    return directory


def _server(tmp_path_factory, certs: Path, *overrides: str):
    server = ServerProcess(tmp_path_factory.mktemp("server"), *SMALL, f"server.auth_token_file={certs / 'token'}",
                           *overrides)
    return server.start()


@pytest.fixture(scope="module")
def tls_server(tmp_path_factory, certs):
    server = _server(tmp_path_factory, certs, *tls_overrides(certs), "server.health_address=127.0.0.1:0")
    yield server
    server.close()


@pytest.fixture(scope="module")
def mtls_server(tmp_path_factory, certs):
    server = _server(tmp_path_factory, certs, *tls_overrides(certs, mutual=True))
    yield server
    server.close()


@pytest.fixture(scope="module")
def plain_server(tmp_path_factory, certs):
    server = _server(tmp_path_factory, certs)
    yield server
    server.close()


def command(*args: str, module: bool = False, env: dict | None = None) -> subprocess.CompletedProcess:
    """coda-client as a user runs it (the installed console script, or `python -m coda_client.cli`), importing the
    code of this checkout, with no GRPC_VERBOSITY or CODA_* variable of the caller's."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("CODA_", "GRPC_VERBOSITY", "GRPC_TRACE"))}
    clean["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    script = Path(sys.executable).with_name("coda-client")
    program = [sys.executable, "-m", "coda_client.cli"] if module else [str(script)]
    if not module and not script.exists():
        pytest.skip("the coda-client console script is not installed beside this Python")
    return subprocess.run([*program, "--timeout", "10", *args], capture_output=True, text=True, timeout=120,
                          env={**clean, **(env or {})}, cwd=REPO)


def one_line(result: subprocess.CompletedProcess) -> str:
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr  # the command's own line, no gRPC log line before it
    return lines[0]


# ------------------------------------------------------------------------------------ 1. the worker kit


def _prompts(name: str) -> ListPromptSource:
    return ListPromptSource([Prompt(f"{name}-p{i}", [1, 2, 3], epoch=0, index=i) for i in range(4)])


def _run_worker(target: str, tls: TlsConfig | None, name: str) -> tuple[RolloutWorker, threading.Timer]:
    worker = RolloutWorker(target, FakeEngine(mean_tokens=4, first_token_seconds=0.01, seconds_per_token=0.001),
                           _prompts(name), client_options={"token": TOKEN, "tls": tls}, worker_id=f"w-{name}")
    stopper = threading.Timer(STOP_AFTER_SECONDS, worker.stop)
    stopper.start()
    worker.start()
    return worker, stopper


@pytest.mark.parametrize("case", ["wrong-ca", "tls-to-plaintext"])
def test_a_worker_whose_tls_handshake_fails_on_a_setting_stops_saying_so(case, certs, tls_server, plain_server):
    """It retried until stop() (run() returning empty stats), warning that nothing listened at the address."""
    if case == "wrong-ca":
        target, tls, said = tls_server.address, TlsConfig(root_certificates=certs / "rogue-ca.pem"), (
            "not signed by a CA this client trusts", "root_certificates")
    else:
        target, tls, said = plain_server.address, TlsConfig(root_certificates=certs / "ca.pem"), (
            "WRONG_VERSION_NUMBER", "it may be plaintext", "tls=None")
    worker, stopper = _run_worker(target, tls, case)
    try:
        with pytest.raises(WorkerFailedError) as caught:
            worker.join(STOP_AFTER_SECONDS + 60)
    finally:
        stopper.cancel()
        worker.stop()
    message = str(caught.value)
    assert f"no connection can be made to the pacer at {target}: the TLS handshake failed" in message, message
    assert all(part in message for part in said), message
    assert "nothing listens" not in message and not message.rstrip(")").endswith(": OK"), message


@pytest.mark.parametrize("case", ["plaintext-to-tls", "mtls-without-certificate"])
def test_a_worker_whose_server_closes_each_connection_warns_once_naming_tls(case, certs, tls_server, mtls_server,
                                                                           caplog):
    """"Socket closed" is also what a port forward says before its server is up: the worker keeps waiting, but
    its one warning names the likely TLS setting (it said that nothing listened at the address)."""
    if case == "plaintext-to-tls":
        target, tls, said = tls_server.address, None, "the server may require TLS: try tls=True"
    else:
        target, tls, said = (mtls_server.address, TlsConfig(root_certificates=certs / "ca.pem"),
                             "it may require a client certificate (mutual TLS): give TlsConfig(certificate_chain=")
    with caplog.at_level(logging.WARNING, logger="coda_worker"):
        worker, stopper = _run_worker(target, tls, case)
        try:
            until(lambda: any(said in r.getMessage() for r in caplog.records), "a warning naming the TLS setting",
                  timeout=STOP_AFTER_SECONDS - 10)
        finally:
            stopper.cancel()
            worker.stop()
        stats = worker.join(60)
    assert stats is not None and stats.groups_started == 0, stats
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and "is away" in r.getMessage()]
    assert len(warned) == 1 and "Socket closed" in warned[0] and "nothing listens" not in warned[0], warned


def test_a_worker_that_was_answered_keeps_waiting_when_the_server_comes_back_with_an_untrusted_certificate(
        tmp_path, certs, caplog):
    """Mid-run the same handshake failure is warned of (once, as its own cause) and the worker keeps its groups and
    waits for the server to be fixed: failing then would give up what it holds."""
    port = free_port()
    address = f"127.0.0.1:{port}"
    good = ServerProcess(tmp_path, *SMALL, f"server.auth_token_file={certs / 'token'}", *tls_overrides(certs),
                         f"server.address={address}").start()
    rogue = ServerProcess(tmp_path, *SMALL, f"server.auth_token_file={certs / 'token'}",
                          f"server.tls.cert_file={certs / 'rogue-server.pem'}",
                          f"server.tls.key_file={certs / 'rogue-server.key'}", f"server.address={address}")
    worker = None
    try:
        with caplog.at_level(logging.INFO, logger="coda_worker"):
            worker, stopper = _run_worker(address, TlsConfig(root_certificates=certs / "ca.pem"), "midrun")
            until(lambda: any("started (max" in r.getMessage() for r in caplog.records), "the worker started")
            good.terminate()
            rogue.start()
            until(lambda: any("not signed by a CA this client trusts" in r.getMessage() and r.levelno == logging.WARNING
                              for r in caplog.records), "a warning naming the untrusted certificate",
                  timeout=STOP_AFTER_SECONDS - 10)
            assert worker._thread.is_alive()  # still waiting: not failed
            stopper.cancel()
            worker.stop()
            worker.join(60)  # returns: a stop, not a failure
    finally:
        if worker is not None:
            worker.stop()
        good.close()
        rogue.close()


# ------------------------------------------------------------------------------------ 2. the command's messages


def test_the_command_says_a_failed_handshake_in_one_line_with_its_fix(certs, tls_server, plain_server, mtls_server):
    ca, rogue = str(certs / "ca.pem"), str(certs / "rogue-ca.pem")
    token = ("--token-file", str(certs / "token"))
    wrong_ca = command("--address", tls_server.address, "--ca-file", rogue, *token, "state")
    line = one_line(wrong_ca)
    assert wrong_ca.returncode == 1 and "CERTIFICATE_VERIFY_FAILED" in line, line
    assert "not signed by a CA this client trusts" in line and "with --ca-file FILE" in line, line
    assert ": OK" not in line, line  # gRPC's "...: unable to get local issuer certificate: OK"

    to_plaintext = command("--address", plain_server.address, "--ca-file", ca, *token, "state")
    line = one_line(to_plaintext)
    assert "WRONG_VERSION_NUMBER" in line and "it may be plaintext" in line and "no --tls, --ca-file" in line, line

    no_certificate = command("--address", mtls_server.address, "--ca-file", ca, *token, "state")
    line = one_line(no_certificate)
    assert "Socket closed" in line and "it may require a client certificate (mutual TLS): give --cert-file" in line

    health = command("--address", tls_server.address, "--ca-file", rogue, "health")
    assert health.returncode == 1 and "not signed by a CA this client trusts" in one_line(health)


def test_the_command_checks_its_tls_files_before_any_connection(certs, mtls_server, tmp_path):
    ca, cert, key = (str(certs / name) for name in ("ca.pem", "client.pem", "client.key"))
    token = ("--token-file", str(certs / "token"))
    swapped = command("--address", mtls_server.address, "--ca-file", ca, "--cert-file", key, "--key-file", cert,
                      *token, "state")
    assert swapped.returncode == 2, swapped.stderr
    assert one_line(swapped) == (f"coda-client: --cert-file {key} is not a PEM certificate (no '-----BEGIN "
                                 f"CERTIFICATE-----' line): it holds a private key; are --cert-file and --key-file "
                                 f"swapped?")
    not_pem = command("--address", mtls_server.address, "--ca-file", str(certs / "token"), *token, "state")
    assert not_pem.returncode == 2 and one_line(not_pem) == (
        f"coda-client: --ca-file {certs / 'token'} is not a PEM CA certificate (no '-----BEGIN CERTIFICATE-----' "
        f"line)")
    missing = command("--address", mtls_server.address, "--ca-file", str(tmp_path / "nope.crt"), *token, "state")
    assert missing.returncode == 2 and one_line(missing) == (
        f"coda-client: --ca-file {tmp_path / 'nope.crt'}: No such file or directory")
    # The same files as the command's flags, with the command working: it connects.
    works = command("--address", mtls_server.address, "--ca-file", ca, "--cert-file", cert, "--key-file", key,
                    *token, "state")
    assert works.returncode == 0 and "strategy no-window" in works.stdout, works.stderr


def test_the_python_client_refuses_unusable_tls_files_when_it_is_made(certs, mtls_server):
    ca, cert, key, rogue_key = (certs / n for n in ("ca.pem", "client.pem", "client.key", "rogue-server.key"))
    with pytest.raises(ValueError, match="certificate_chain .* is not a PEM certificate.*are certificate_chain and "
                                         "private_key swapped"):
        PacerClient(mtls_server.address, tls=TlsConfig(ca, certificate_chain=key, private_key=cert))
    with pytest.raises(ValueError, match=f"private_key {rogue_key} is not the key of certificate_chain {cert}"):
        PacerClient(mtls_server.address, tls=TlsConfig(ca, certificate_chain=cert, private_key=rogue_key))
    with PacerClient(mtls_server.address, token=TOKEN, tls=TlsConfig(ca, certificate_chain=cert, private_key=key),
                     timeout=10) as client:
        assert client.state().step == 0


# ------------------------------------------------------------------------------------ 3. the token's newline


def test_a_token_read_with_its_newline_is_sent_without_it(certs, plain_server):
    with PacerClient(plain_server.address, token=(certs / "token").read_text(), timeout=10) as client:
        assert client.state().step == 0  # it failed with INTERNAL "Invalid metadata"
    with PacerClient(plain_server.address, token=TOKEN + "\r\n", timeout=10) as client:
        assert client.state().step == 0
    crlf = command("--address", plain_server.address, "state", env={"CODA_TOKEN": TOKEN + "\r"})
    assert crlf.returncode == 0 and "strategy no-window" in crlf.stdout, crlf.stderr
    with pytest.raises(ValueError, match="the token holds characters a gRPC header cannot carry"):
        PacerClient(plain_server.address, token=TOKEN[:10] + "\x00" + TOKEN[10:])


# ------------------------------------------------------------------------------------ 4. the command's own words


def test_the_command_names_its_own_flags_and_what_a_health_only_port_is(certs, plain_server, tls_server):
    missing = command("--address", plain_server.address, "state")
    line = one_line(missing)
    assert missing.returncode == 1 and "requires a bearer token: give --token-file FILE" in line, line
    assert "PacerClient(" not in line, line

    health_port = f"127.0.0.1:{tls_server.info['health_port']}"
    not_a_pacer = command("--address", health_port, "--token-file", str(certs / "token"), "state")
    line = one_line(not_a_pacer)
    assert "UNIMPLEMENTED" in line and "not a coda pacer" in line and "health-only port" in line, line


def test_python_m_coda_client_cli_runs_the_command(certs, plain_server):
    result = command("--address", plain_server.address, "--token-file", str(certs / "token"), "state", module=True)
    assert result.returncode == 0 and "strategy no-window" in result.stdout, (result.stdout, result.stderr)


def test_a_stream_cut_by_a_killed_server_is_not_said_as_a_tls_setting(tmp_path):
    """A plaintext client's watch stream cut by a server killed with kill -9 ends "Stream removed (Socket closed)":
    it was said as "the server closed each connection as it opened ... may require TLS", which sent an on-call
    engineer after TLS. Only connecting that fails so is a TLS matter."""
    with ServerProcess(tmp_path) as server, PacerClient(server.address, timeout=10) as client:
        events = client.watch()
        next(events)  # the STATE event: the stream is open
        server.kill()
        with pytest.raises(UnavailableError) as cut:
            next(events)
    assert "TLS" not in str(cut.value) and "closed each connection" not in str(cut.value), str(cut.value)
