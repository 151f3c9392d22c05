"""Start-up as a deployment meets it: SIGTERM before the event loop runs, a long recovery's progress
lines, and the client CA file's dates; each against a real coda-server on 127.0.0.1:0."""
from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from coda_client import PacerClient
from coda_server.core import recovery
from conftest import core_overrides
from server_harness import REPO_ROOT, ServerProcess, until

B, N = 2, 2

# A custom strategy module that says it is being imported (the file $SLOW_MARKER) and then takes its time: the
# server is then certainly loading its configuration, before any event loop, when the test sends the signal.
SLOW_MODULE = """\
    import os
    import time
    from pathlib import Path

    Path(os.environ["SLOW_MARKER"]).touch()
    deadline = time.monotonic() + 60  # never hold a broken test's server for ever
    while time.monotonic() < deadline:
        time.sleep(0.05)
    """


def launchers() -> list:
    """`python -m coda_server` (the harness's way) and the installed console script, when there is one."""
    found = [pytest.param(None, id="python-m")]
    script = Path(sys.executable).parent / "coda-server"
    if script.exists():
        found.append(pytest.param(str(script), id="console-script"))
    return found


# ------------------------------------------------------------------ 1. SIGTERM before the event loop runs

@pytest.mark.parametrize("launcher", launchers())
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_stop_signal_while_the_configuration_loads_is_a_clean_stop_in_one_line(tmp_path, launcher, signum):
    plugins = tmp_path / "plugins"
    plugins.mkdir()
    (plugins / "slow_import.py").write_text(textwrap.dedent(SLOW_MODULE))
    marker, state_dir, port_file = tmp_path / "importing", tmp_path / "state", tmp_path / "port.json"
    server = ServerProcess(tmp_path, f"server.state_dir={state_dir}", f"server.custom_strategy_dirs=[{plugins}]")
    command = server.command(port_file)
    if launcher is not None:
        command = [launcher, *command[3:]]  # [python, -m, coda_server, ...] -> [coda-server, ...]
    log_path = tmp_path / "server.log"
    with open(log_path, "wb") as log:
        process = subprocess.Popen(command, cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT,
                                   env={**os.environ, "SLOW_MARKER": str(marker)})
    try:
        until(lambda: marker.exists() or process.poll() is not None, "the server to import the slow module")
        assert process.poll() is None, log_path.read_text()
        process.send_signal(signum)
        code = process.wait(60)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(10)
    output = log_path.read_text()
    assert code == 0, f"exit {code}:\n{output}"
    said = [line for line in output.splitlines() if "stopped before serving" in line]
    assert len(said) == 1, output
    assert (f"stopped before serving: {signum.name} came during start-up (loading the configuration and custom "
            f"strategy modules); the state directory was not opened, nothing was written") in said[0], said[0]
    assert "Traceback" not in output and "serving coda.pacer.v1.RolloutPacer" not in output, output
    assert not state_dir.exists() and not port_file.exists()  # nothing half-written: nothing at all


# `coda-server` (the console script, the Dockerfile's ENTRYPOINT) with the import of coda_server.cli held until the
# test creates $GO: the signal certainly comes while the server's packages import, before cli.main() runs.
IMPORT_HELD = """\
import importlib, os, sys, time
from pathlib import Path

real_import = importlib.import_module

def held_import(name, *args):
    if name == "coda_server.cli":
        Path(os.environ["SLOW_MARKER"]).touch()
        deadline = time.monotonic() + 60
        while not Path(os.environ["GO"]).exists() and time.monotonic() < deadline:
            time.sleep(0.01)
    return real_import(name, *args)

importlib.import_module = held_import
from coda_client.commands import server
sys.exit(server(sys.argv[1:]))
"""


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_stop_signal_while_the_console_script_imports_the_server_is_a_clean_stop(tmp_path, signum):
    marker, go, state_dir = tmp_path / "importing", tmp_path / "go", tmp_path / "state"
    command = [sys.executable, "-c", IMPORT_HELD, "server.address=127.0.0.1:0", "server.metrics_address=127.0.0.1:0",
               f"server.state_dir={state_dir}"]
    process = subprocess.Popen(command, cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               env={**os.environ, "SLOW_MARKER": str(marker), "GO": str(go)})
    try:
        until(lambda: marker.exists() or process.poll() is not None, "the console script to import the server")
        assert process.poll() is None, process.stdout.read()
        process.send_signal(signum)
        # The handler runs once the held import's sleep returns to Python; the import may then go on.
        go.touch()
        output, _ = process.communicate(timeout=60)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(10)
    assert process.returncode == 0, f"exit {process.returncode}:\n{output}"
    assert output.strip().splitlines() == [
        f"coda-server: stopped before serving: {signum.name} came during start-up (importing the server's "
        f"packages); the state directory was not opened, nothing was written"], output
    assert not state_dir.exists()


def test_after_an_early_stop_the_same_command_starts_and_serves(tmp_path):
    """The early handler is the event loop's once serving: SIGTERM then drains as ever ("shutting down", exit 0)."""
    with ServerProcess(tmp_path) as server:
        assert server.terminate() == 0, server.log()
        assert "shutting down" in server.log() and "stopped before serving" not in server.log(), server.log()


# ------------------------------------------------------------------ 2. a long recovery says how far it got

def journal_with_dispatches(state_dir: Path, events: int) -> None:
    """A state directory holding `events` Dispatch events (one prompt each) after no snapshot."""
    from coda_server.convert import ProtoTrajectories
    from coda_server.core.config import load_config
    from coda_server.core.pacer import Pacer
    from coda_server.core.sqlite_journal import SqliteJournal
    from coda_server.core.types import PromptRef

    journal = SqliteJournal(state_dir, fsync="off", codec=ProtoTrajectories())
    try:
        pacer = Pacer(load_config(None, core_overrides(B=events, N=N)), journal=journal)
        for i in range(events):
            assert pacer.apply_dispatch([PromptRef(f"p{i}")]).admitted_ids == [f"p{i}"]
    finally:
        journal.close()


class SteppingClock:
    """A monotonic clock that moves `step` seconds at each reading: the progress lines' pace without any waiting."""

    def __init__(self, step: float):
        self.now, self.step = 1000.0, step

    def __call__(self) -> float:
        self.now += self.step
        return self.now


def recover_with_clock(state_dir: Path, events: int, clock, caplog) -> list[str]:
    """Recover `state_dir` in process with the progress lines on `clock` (every 10 of its seconds); their text."""
    from coda_server.convert import ProtoTrajectories
    from coda_server.core.config import load_config
    from coda_server.core.pacer import Pacer
    from coda_server.core.sqlite_journal import SqliteJournal

    journal = SqliteJournal(state_dir, fsync="off", codec=ProtoTrajectories())
    try:
        pacer = Pacer(load_config(None, core_overrides(B=events, N=N)), journal=journal)
        pacer.recovery.progress_clock, pacer.recovery.progress_seconds = clock, 10.0
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="coda_server.recovery"):
            assert pacer.recover() == events
        assert pacer.state().running == events
    finally:
        journal.close()
    return [record.getMessage() for record in caplog.records if record.name == "coda_server.recovery"]


def test_a_long_recovery_logs_what_it_reads_then_its_progress_at_the_clock_s_pace(tmp_path, caplog):
    events = recovery.FIRST_LINE_EVENTS + 200
    state_dir = tmp_path / "state"
    journal_with_dispatches(state_dir, events)
    # Each event read and each replayed reads the clock once, a tenth of a second apiece: ~240 clock seconds in
    # all, a progress line every 10 of them.
    lines = recover_with_clock(state_dir, events, SteppingClock(0.1), caplog)
    assert lines[0] == (f"recovering the state in {state_dir}: reading its snapshot and the {events} events recorded "
                        f"after it, then replaying them (a progress line every 10s)"), lines[:3]
    progress = lines[1:]
    read = [line for line in progress if line.endswith("events/s)") and f"of {events} events read" in line]
    replayed = [line for line in progress if line.endswith("events/s)") and f"of {events} events replayed" in line]
    assert read and replayed and progress == read + replayed, lines  # reading first, then replaying; nothing else
    assert 20 <= len(progress) <= 26, lines

    def counts(chosen: list[str]) -> list[int]:
        return [int(line.split(": ", 1)[1].split(" of ")[0]) for line in chosen]

    assert counts(read) == sorted(counts(read)) and counts(replayed) == sorted(counts(replayed)), lines
    assert "(10 events/s)" in read[-1] and "(10 events/s)" in replayed[-1], lines  # ten events a clock second

    # A clock that does not move: a recovery shorter than the interval says only its first line.
    assert recover_with_clock(state_dir, events, SteppingClock(0.0), caplog) == lines[:1]


def test_a_short_journal_recovers_without_a_first_line(tmp_path, caplog):
    """Rebuilt in well under a second: the "recovered" line follows at once, and a refused start stays one line."""
    events = recovery.FIRST_LINE_EVENTS - 1
    state_dir = tmp_path / "state"
    journal_with_dispatches(state_dir, events)
    assert recover_with_clock(state_dir, events, SteppingClock(0.0), caplog) == []


def test_a_restarted_server_says_at_once_that_it_recovers_and_how_many_events(tmp_path):
    events = recovery.FIRST_LINE_EVENTS
    state_dir = tmp_path / "state"
    journal_with_dispatches(state_dir, events)
    with ServerProcess(tmp_path, f"server.state_dir={state_dir}", *core_overrides(B=events, N=N)) as server:
        lines = server.log().splitlines()
        begin = [i for i, line in enumerate(lines) if "coda_server.recovery: recovering the state in" in line]
        end = [i for i, line in enumerate(lines) if "recovered state from" in line]
        assert len(begin) == 1 and len(end) == 1 and begin[0] < end[0], server.log()
        assert (f"recovering the state in {state_dir}: reading its snapshot and the {events} events recorded after "
                f"it, then replaying them (a progress line every 5s)") in lines[begin[0]], lines[begin[0]]
        assert f"{events} events replayed since the last snapshot" in lines[end[0]], lines[end[0]]
        with PacerClient(server.address, timeout=10) as pacer:
            assert pacer.state().running == events
        assert server.terminate() == 0, server.log()


# ------------------------------------------------------------------ 3. the client CA file's dates

def openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> Path:
    """make_pki's CA, server and client certificates, and expired-ca.pem: a self-signed CA certificate valid from
    2020-01-01 to 2020-01-02 (`openssl ca` sets the dates; `openssl req -x509` cannot)."""
    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed")
    from test_security_transport import make_pki

    directory = make_pki(tmp_path_factory.mktemp("pki"))
    (directory / "index.txt").write_text("")
    (directory / "serial").write_text("01\n")
    (directory / "ca.cnf").write_text("[ca]\ndefault_ca = test\n[test]\ndatabase = index.txt\nnew_certs_dir = .\n"
                                      "serial = serial\ndefault_md = sha256\npolicy = anything\nunique_subject = no\n"
                                      "[anything]\ncommonName = supplied\n"
                                      "[ca_ext]\nbasicConstraints = critical,CA:TRUE\n"
                                      "keyUsage = critical,keyCertSign,cRLSign\n")
    openssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", "/CN=expired-ca", "-keyout", "expired-ca.key",
            "-out", "expired-ca.csr", cwd=directory)
    openssl("ca", "-batch", "-config", "ca.cnf", "-extensions", "ca_ext", "-selfsign", "-keyfile", "expired-ca.key",
            "-in", "expired-ca.csr", "-startdate", "20200101000000Z", "-enddate", "20200102000000Z",
            "-out", "expired-ca.pem", cwd=directory)
    return directory


def start_up_refusal(tmp_path: Path, *overrides: str) -> tuple[int, str]:
    """(exit code, output) of a coda-server expected to stop at start-up; one that serves fails the test."""
    server = ServerProcess(tmp_path, "server.state_dir=", *overrides)
    try:
        server.start()
    except RuntimeError as exc:  # it exited before serving: the harness says with what
        return server.process.returncode, str(exc)
    finally:
        server.close()
    pytest.fail(f"the server started serving:\n{server.log()}")


def mutual(pki: Path, ca_file: Path) -> tuple[str, ...]:
    return (f"server.tls.cert_file={pki / 'server.pem'}", f"server.tls.key_file={pki / 'server.key'}",
            f"server.tls.client_ca_file={ca_file}")


def refusal_lines(output: str) -> list[str]:
    return [line for line in output.splitlines() if line.startswith("coda-server:")]


def test_an_expired_client_ca_certificate_stops_start_up_naming_the_file_and_its_dates(tmp_path, pki):
    ca_file = pki / "expired-ca.pem"
    code, output = start_up_refusal(tmp_path, *mutual(pki, ca_file))
    assert code == 2, output
    [line] = refusal_lines(output)
    assert (f"server.tls.client_ca_file = {str(ca_file)!r}: its certificate expired on 2020-01-02 00:00:00 UTC "
            f"(notAfter), so the server refuses every client certificate it issued ('certificate has expired'); "
            f"it was valid from 2020-01-01 00:00:00 UTC: renew it") in line, line
    assert "Traceback" not in output, output


def test_a_client_ca_file_that_holds_no_certificate_stops_start_up_in_one_line(tmp_path, pki):
    ca_file = pki / "ca.key"  # the CA's private key given for its certificate: PEM, but no certificate in it
    code, output = start_up_refusal(tmp_path, *mutual(pki, ca_file))
    assert code == 2, output
    [line] = refusal_lines(output)
    assert (f"server.tls.client_ca_file = {str(ca_file)!r}: holds no certificate (no -----BEGIN CERTIFICATE----- "
            f"line)") in line, line
    assert "Traceback" not in output, output


def test_one_expired_ca_of_several_is_warned_about_and_the_others_still_admit_clients(tmp_path, pki):
    from coda_client._channel import TlsConfig

    bundle = tmp_path / "cas.pem"
    bundle.write_text((pki / "expired-ca.pem").read_text() + (pki / "ca.pem").read_text())
    with ServerProcess(tmp_path, "server.state_dir=", *mutual(pki, bundle)) as server:
        warned = [line for line in server.log().splitlines() if " WARNING " in line and str(bundle) in line]
        assert len(warned) == 1, server.log()
        assert "certificate 1 of 2 expired on 2020-01-02 00:00:00 UTC (notAfter)" in warned[0], warned[0]
        assert "the file's other certificates are valid" in warned[0], warned[0]
        tls = TlsConfig(root_certificates=pki / "ca.pem", certificate_chain=pki / "client.pem",
                        private_key=pki / "client.key")
        with PacerClient(server.address, timeout=10, tls=tls) as pacer:
            assert pacer.state().running == 0
        assert server.terminate() == 0, server.log()
