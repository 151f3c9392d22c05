"""Start-up and shutdown as a deployment meets them: SIGTERM during recovery, --port-file, $CODA_CONFIG, an
unreadable journal, an expired certificate; one line each, and nothing left behind."""
from __future__ import annotations

import os
import pickle
import shutil
import signal
import socket
import sqlite3
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from coda_client import PacerClient, Trajectory, TrajectoryStatus
from conftest import core_overrides
from server_harness import REPO_ROOT, ServerProcess, until

SERVER = [sys.executable, "-m", "coda_server"]
B, N = 2, 2

# A strategy that, once GATE_DIR is set, holds the first replayed Submit until the test creates GATE_DIR/go:
# recovery is then certainly under way when the test sends SIGTERM, however fast the machine.
GATED_STRATEGY = """\
    import os
    import time
    from pathlib import Path

    from coda_server import register_sliding_window_strategy
    from coda_server.core.builtin_strategies import NoWindowStrategy


    @register_sliding_window_strategy("gated-replay")
    class GatedReplay(NoWindowStrategy):
        held = False

        def on_submitted(self, trajectory):
            gate = os.environ.get("GATE_DIR")
            if gate and not GatedReplay.held:
                GatedReplay.held = True
                Path(gate, "entered").touch()
                deadline = time.monotonic() + 60  # never hold a broken test's server for ever
                while not Path(gate, "go").exists() and time.monotonic() < deadline:
                    time.sleep(0.01)
    """


def fill(server: ServerProcess, groups: int = B, submit: int = N) -> None:
    """Dispatch `groups` groups and submit `submit` trajectories of each, one at a time: 1 + groups * submit events."""
    with PacerClient(server.address, timeout=10) as pacer:
        admitted = pacer.dispatch([f"g{i}" for i in range(groups)]).admitted
        assert len(admitted) == groups
        for prompt_id in admitted:
            for j in range(submit):
                pacer.submit([Trajectory(trajectory_id=f"{prompt_id}#{j}", prompt_id=prompt_id,
                                         status=TrajectoryStatus.COMPLETED, reward=float(j), token_ids=[1, 2, 3],
                                         logprobs=[-0.1, -0.2, -0.3])])


def journal_rows(state_dir: Path) -> tuple:
    """Everything the journal holds (snapshot and events), to tell that a start changed nothing."""
    db = sqlite3.connect(f"file:{state_dir / 'pacer.sqlite3'}?mode=ro", uri=True)
    try:
        return (db.execute("SELECT id, body FROM snapshot").fetchall(),
                db.execute("SELECT id, body FROM events ORDER BY id").fetchall())
    finally:
        db.close()


def journal_files(state_dir: Path) -> dict[str, bytes]:
    """The bytes of the journal's files (the database, and its write-ahead log when one holds anything)."""
    return {path.name: path.read_bytes() for path in sorted(state_dir.glob("pacer.sqlite3*"))
            if not path.name.endswith("-shm") and path.stat().st_size}


def filled_state_dir(tmp_path: Path, *overrides: str, submit: int = N) -> Path:
    """A state directory holding a snapshot and 1 + B * submit events, its server stopped with SIGTERM."""
    state_dir = tmp_path / "state"
    with ServerProcess(tmp_path, f"server.state_dir={state_dir}", *overrides) as server:
        fill(server, submit=submit)
        assert server.terminate() == 0, server.log()
    assert len(journal_rows(state_dir)[1]) == 1 + B * submit
    return state_dir


def run_server(*overrides: str, options: tuple[str, ...] = (), env: dict | None = None,
               timeout: float = 60) -> subprocess.CompletedProcess:
    """coda-server expected to stop at start-up (one that serves is killed by the timeout, failing the test)."""
    base = ["server.address=127.0.0.1:0", "server.metrics_address=127.0.0.1:0"]
    return subprocess.run([*SERVER, *options, *base, *overrides], capture_output=True, text=True, timeout=timeout,
                          cwd=REPO_ROOT, env={**os.environ, **(env or {})})


def error_lines(output: str) -> list[str]:
    return [line for line in output.splitlines() if " ERROR " in line or line.startswith("coda-server:")]


# ------------------------------------------------------------------ SIGTERM while the state is recovered

def test_sigterm_during_recovery_says_so_in_one_line_exits_0_and_leaves_the_state_intact(tmp_path):
    plugins = tmp_path / "plugins"
    plugins.mkdir()
    (plugins / "gated.py").write_text(textwrap.dedent(GATED_STRATEGY))
    pacing = [*core_overrides("gated-replay", B=B, N=N), f"server.custom_strategy_dirs=[{plugins}]"]
    # Groups left running (one trajectory of N each): a state rebuilt in part whose lease expiry ran would journal
    # their expiry (the interrupted server's in-flight lease is tiny, so their time is up at once).
    state_dir = filled_state_dir(tmp_path, *pacing, submit=1)
    before, files = journal_rows(state_dir), journal_files(state_dir)

    gate = tmp_path / "gate"
    gate.mkdir()
    second = ServerProcess(tmp_path, f"server.state_dir={state_dir}", *pacing, "server.inflight_lease_seconds=0.001")
    log_path = tmp_path / "second.log"
    with open(log_path, "wb") as log:
        process = subprocess.Popen(second.command(tmp_path / "second.json"), cwd=REPO_ROOT, stdout=log,
                                   stderr=subprocess.STDOUT, env={**os.environ, "GATE_DIR": str(gate)})
    try:
        until(lambda: (gate / "entered").exists() or process.poll() is not None, "the replay to reach the gate")
        assert process.poll() is None, log_path.read_text()
        process.send_signal(signal.SIGTERM)
        # Once the server has taken the signal in, the replay may go on: it stops before its next event.
        until(lambda: "stopping during recovery" in log_path.read_text() or process.poll() is not None,
              "the server to take SIGTERM in")
        (gate / "go").touch()
        code = process.wait(60)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(10)
    output = log_path.read_text()
    assert code == 0, f"exit {code}:\n{output}"
    said = [line for line in output.splitlines() if "stopping during recovery" in line]
    assert len(said) == 1, output
    assert "SIGTERM came while the state in" in said[0] and str(state_dir) in said[0], said[0]
    assert "the state directory is intact" in said[0], said[0]
    assert "Traceback" not in output and "serving coda.pacer.v1.RolloutPacer" not in output, output
    assert not (tmp_path / "second.json").exists()  # it never served
    assert journal_rows(state_dir) == before and journal_files(state_dir) == files  # nothing written

    with ServerProcess(tmp_path, f"server.state_dir={state_dir}", *pacing) as third:  # and it recovers in full
        assert f"{1 + B} events replayed" in third.log(), third.log()
        with PacerClient(third.address, timeout=10) as pacer:
            state = pacer.state()
            assert (state.running, state.buffered) == (B, 0)
        assert third.terminate() == 0, third.log()


def test_a_recovery_told_to_stop_raises_before_reading_and_a_journal_stops_reading(tmp_path):
    from coda_server.convert import ProtoTrajectories
    from coda_server.core.config import load_config
    from coda_server.core.pacer import Pacer
    from coda_server.core.recovery import RecoveryInterrupted
    from coda_server.core.sqlite_journal import LoadInterrupted, SqliteJournal

    state_dir = filled_state_dir(tmp_path, *core_overrides(B=B, N=N))
    before = journal_rows(state_dir)
    journal = SqliteJournal(state_dir, codec=ProtoTrajectories())
    try:
        journal.interrupt()
        with pytest.raises(LoadInterrupted):
            journal.load()
        pacer = Pacer(load_config(None, core_overrides(B=B, N=N)), journal=journal)
        pacer.recovery.interrupt()
        with pytest.raises(RecoveryInterrupted, match="while reading the journal"):
            pacer.recover()
    finally:
        journal.close()
    assert journal_rows(state_dir) == before


# ------------------------------------------------------------------ --port-file, $CODA_CONFIG

@pytest.mark.parametrize("where", ["missing-directory", "under-a-file"])
def test_a_port_file_that_cannot_be_written_stops_start_up_in_one_line_before_serving(tmp_path, where):
    if where == "missing-directory":
        port_file = tmp_path / "no-such-dir" / "port.json"
    else:  # a path under a regular file cannot be made, even by root
        (tmp_path / "file").write_text("")
        port_file = tmp_path / "file" / "port.json"
    sock = tmp_path / "s.sock"
    proc = run_server("server.state_dir=", f"server.uds_path={sock}", options=("--port-file", str(port_file)))
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    assert "serving coda.pacer.v1.RolloutPacer" not in proc.stderr, proc.stderr  # checked before serving
    assert error_lines(proc.stderr) == proc.stderr.strip().splitlines(), proc.stderr
    assert f"--port-file {str(port_file)!r} cannot be written" in proc.stderr, proc.stderr
    assert not sock.exists()


def test_a_coda_config_that_names_no_readable_file_is_named_as_the_variable(tmp_path):
    missing = tmp_path / "missing.yaml"
    proc = run_server("server.state_dir=", env={"CODA_CONFIG": str(missing)})
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines() == [proc.stderr.strip()], proc.stderr
    assert f"$CODA_CONFIG = {str(missing)!r}: configuration file could not be read" in proc.stderr, proc.stderr


# ------------------------------------------------------------------ no start-up failure leaves the socket

@pytest.mark.parametrize("failure", ["metrics-port-taken", "unreadable-journal"])
def test_no_start_up_failure_leaves_the_unix_socket_behind(tmp_path, failure):
    sock = tmp_path / "s.sock"
    if failure == "metrics-port-taken":
        taken = socket.socket()
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        extra = ["server.state_dir=", f"server.metrics_address=127.0.0.1:{taken.getsockname()[1]}"]
    else:
        state_dir = filled_state_dir(tmp_path)
        damage_event(state_dir, 3, truncate=True)
        extra = [f"server.state_dir={state_dir}"]
    try:
        proc = run_server(f"server.uds_path={sock}", *extra)
    finally:
        if failure == "metrics-port-taken":
            taken.close()
    assert proc.returncode == 1, proc.stderr
    assert "Traceback" not in proc.stderr and len(error_lines(proc.stderr)) == 1, proc.stderr
    assert not sock.exists(), proc.stderr


# ------------------------------------------------------------------ a journal that cannot be read back

def damage_event(state_dir: Path, number: int, *, truncate: bool) -> None:
    """Event `number` (from 1) cut in half, or replaced by a pickle the restricted unpickler refuses."""
    db = sqlite3.connect(state_dir / "pacer.sqlite3")
    try:
        row_id, body = db.execute("SELECT id, body FROM events ORDER BY id").fetchall()[number - 1]
        db.execute("UPDATE events SET body = ? WHERE id = ?", (body[: len(body) // 2] if truncate else
                                                                  pickle.dumps(os.system), row_id))
        db.commit()
    finally:
        db.close()


@pytest.mark.parametrize("truncate, says", [
    (True, "UnpicklingError: pickle data was truncated"),
    (False, "which it may not contain"),
])
def test_an_unreadable_journal_record_stops_start_up_in_one_line_naming_the_event(tmp_path, truncate, says):
    state_dir = filled_state_dir(tmp_path)
    damage_event(state_dir, 3, truncate=truncate)
    files = journal_files(state_dir)
    proc = run_server(f"server.state_dir={state_dir}")
    assert proc.returncode == 1, proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    [line] = error_lines(proc.stderr)
    for text in (f"event 3 of {1 + B * N} since the last snapshot in {state_dir / 'pacer.sqlite3'}",
                 "could not be read back", says, "the state directory was not modified",
                 "move server.state_dir aside"):
        assert text in line, line
    assert journal_files(state_dir) == files


def test_a_state_dir_whose_database_is_no_database_says_so_not_who_may_write(tmp_path):
    state_dir = tmp_path / "state"
    state_dir.mkdir()
    (state_dir / "pacer.sqlite3").write_bytes(bytes(range(256)) * 400)
    proc = run_server(f"server.state_dir={state_dir}")
    assert proc.returncode == 1, proc.stderr
    [line] = error_lines(proc.stderr)
    assert "is not a readable coda-server journal" in line and "this user can write" not in line, line


# ------------------------------------------------------------------ server certificates out of their dates

@pytest.fixture(scope="module")
def dated_certificates(tmp_path_factory):
    """srv.key with two self-signed certificates: expired.crt (2020-01-01 to 2020-01-02) and future.crt (from
    2099-01-01); `openssl ca` sets the dates (`openssl req -x509` cannot)."""
    openssl = shutil.which("openssl")
    if openssl is None:
        pytest.skip("openssl is not installed")
    directory = tmp_path_factory.mktemp("dated")
    (directory / "index.txt").write_text("")
    (directory / "serial").write_text("01\n")
    (directory / "ca.cnf").write_text("[ca]\ndefault_ca = test\n[test]\ndatabase = index.txt\nnew_certs_dir = .\n"
                                      "serial = serial\ndefault_md = sha256\npolicy = anything\nunique_subject = no\n"
                                      "[anything]\ncommonName = supplied\n")
    subprocess.run([openssl, "req", "-newkey", "rsa:2048", "-nodes", "-subj", "/CN=127.0.0.1", "-keyout", "srv.key",
                    "-out", "srv.csr"], cwd=directory, check=True, capture_output=True)
    for name, start, end in (("expired", "20200101000000Z", "20200102000000Z"),
                             ("future", "20990101000000Z", "21000101000000Z")):
        subprocess.run([openssl, "ca", "-batch", "-config", "ca.cnf", "-selfsign", "-keyfile", "srv.key", "-in",
                        "srv.csr", "-startdate", start, "-enddate", end, "-out", f"{name}.crt"],
                       cwd=directory, check=True, capture_output=True)
    return directory


def test_an_expired_server_certificate_stops_start_up_naming_the_file_and_its_not_after(tmp_path, dated_certificates):
    cert = dated_certificates / "expired.crt"
    proc = run_server("server.state_dir=", f"server.tls.cert_file={cert}",
                      f"server.tls.key_file={dated_certificates / 'srv.key'}")
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines() == [proc.stderr.strip()], proc.stderr
    assert f"server.tls.cert_file = {str(cert)!r}: its certificate expired on 2020-01-02 00:00:00 UTC (notAfter)" \
        in proc.stderr, proc.stderr


def test_a_server_certificate_not_valid_yet_is_warned_about_with_its_not_before(tmp_path, dated_certificates):
    cert = dated_certificates / "future.crt"
    with ServerProcess(tmp_path, "server.state_dir=", f"server.tls.cert_file={cert}",
                       f"server.tls.key_file={dated_certificates / 'srv.key'}") as server:
        warned = [line for line in server.log().splitlines() if " WARNING " in line and str(cert) in line]
        assert len(warned) == 1, server.log()
        assert "is not valid before 2099-01-01 00:00:00 UTC (notBefore" in warned[0], warned[0]
        assert server.terminate() == 0, server.log()
