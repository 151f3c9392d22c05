"""`coda-client reset` with a group no worker will ever submit: it says at once what it waits for and for how long
at most (--wait, default 60 s), ends within that bound whatever --timeout says, and reports what happened; every
numeric option is checked in one line; the TLS flags and a plaintext call to a TLS listener are said in CLI terms.

The command runs as a subprocess, as a user runs it (`coda-client` is `coda_client.cli:main`)."""
from __future__ import annotations

import io
import shutil
import signal
import subprocess
import sys
import threading

import pytest

from coda_client import PacerClient
from coda_client import cli as client_cli
from conftest import core_overrides
from server_harness import REPO_ROOT, ServerProcess, until

# The console script's entry point, run by this interpreter with this test run's PYTHONPATH (so the code under test).
CODA_CLIENT = [sys.executable, "-c", "import sys; from coda_client.cli import main; sys.exit(main())"]


@pytest.fixture
def server(tmp_path):
    with ServerProcess(tmp_path, *core_overrides("no-window", B=2, stale=1.0, N=2, M=2)) as process:
        yield process


def coda_client(address: str, *argv: str, timeout: float = 120.0) -> subprocess.CompletedProcess:
    return subprocess.run([*CODA_CLIENT, "--address", address, *argv], capture_output=True, text=True,
                          timeout=timeout, cwd=REPO_ROOT)


def dispatch_and_never_submit(address: str, *prompt_ids: str) -> None:
    """A worker that dies right after its Dispatch: its groups stay running until their in-flight lease runs out."""
    with PacerClient(address) as pacer:
        assert pacer.dispatch(list(prompt_ids)).admitted == list(prompt_ids)


def test_reset_says_what_it_waits_for_and_ends_within_its_wait_whatever_the_timeout(server):
    address = server.address
    quiet = coda_client(address, "--timeout", "3", "reset", "--resume", "--weight-version", "1")
    assert quiet.returncode == 0, quiet.stderr
    assert quiet.stderr == "", "nothing running: nothing to wait for, nothing said"
    dispatch_and_never_submit(address, "p0")
    # --timeout 3 is each call's deadline; the Reset's wait is its --wait (the call's deadline stretched to it).
    done = coda_client(address, "--timeout", "3", "reset", "--wait", "4")
    assert done.returncode == 0, done.stderr
    said = done.stderr.splitlines()
    assert len(said) == 2, done.stderr
    assert said[0].startswith("coda-client: reset is waiting up to 4 s for all the trajectories of 1 running group "
                              "to be submitted (WAIT mode)"), said[0]
    assert "--wait 0 drops them now" in said[0] and "Ctrl-C leaves the reset running on the server" in said[0]
    assert said[1].startswith("coda-client: the reset ended after ") and "1 incomplete group dropped" in said[1]
    assert "coda-client resume --weight-version" in said[1], "paused: it says how to reopen dispatch"
    assert "1 dropped" in done.stdout and "paused" in done.stdout
    with PacerClient(address) as pacer:
        state = pacer.state()
    assert state.paused and not state.resetting and state.running == 0


def test_reset_waits_60_s_at_most_by_default_and_ctrl_c_leaves_it_running_on_the_server(server):
    address = server.address
    dispatch_and_never_submit(address, "p0", "p1")
    reset = subprocess.Popen([*CODA_CLIENT, "--address", address, "--timeout", "3", "reset"], cwd=REPO_ROOT,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        first: list[str] = []
        reader = threading.Thread(target=lambda: first.append(reset.stderr.readline()), daemon=True)
        reader.start()
        reader.join(60)  # said at once (the old command said nothing for as long as the groups' lease)
        assert first and first[0].startswith(
            "coda-client: reset is waiting up to 60 s for all the trajectories of 2 running groups"), first
        with PacerClient(address) as pacer:  # the line comes just before the Reset is sent: wait for it to arrive
            until(lambda: pacer.state().resetting, "the Reset to reach the server", timeout=60)
        reset.send_signal(signal.SIGINT)
        out, rest = reset.communicate(timeout=60)
    finally:
        if reset.poll() is None:
            reset.kill()
            reset.wait(10)
    assert reset.returncode == 130, rest
    assert "interrupted; the reset keeps running on the server (at most 60 s from its start)" in rest, rest
    assert "Traceback" not in rest and out == ""
    with PacerClient(address) as pacer:
        assert pacer.state().resetting, "the Reset runs on after its caller left"


def test_reset_and_end_job_help_name_their_default_wait_and_the_timeout_its_stretch():
    parser = client_cli.build_parser()
    text = " ".join(parser.format_help().split())
    assert "each call's deadline (default 10); a call that waits (reset, end-job) gets at least its --wait plus 5 s" \
        in text
    commands = next(a for a in parser._actions if a.dest == "command").choices
    for name in ("reset", "end-job"):
        assert commands[name].get_default("wait") == 60.0
        assert "(default 60" in " ".join(commands[name].format_help().split())


@pytest.mark.parametrize("argv, says", [
    (("--timeout", "-1", "state"), "--timeout must be a number of seconds > 0, not -1"),
    (("--timeout", "nan", "health"), "--timeout must be a number of seconds > 0, not nan"),
    (("watch", "--interval", "-1"), "watch --interval must be a number of seconds > 0, not -1"),
    (("watch", "--interval", "0"), "watch --interval must be a number of seconds > 0, not 0"),
    (("watch", "--count", "-1"), "watch --count must be an integer >= 0, not -1"),
    (("reset", "--wait", "-1"), "reset --wait must be a number of seconds >= 0, not -1"),
    (("reset", "--wait", "inf"), "reset --wait must be a number of seconds >= 0, not inf"),
    (("reset", "--resume", "--weight-version", "-1"), "reset --weight-version must be an integer from 0 to "),
    (("workers", "--groups", "-1"), "workers --groups must be an integer from 0 to 4294967295, not -1"),
    (("resume", "--weight-version", "-2"), "resume --weight-version must be an integer from 0 to "),
    (("resume", "--weight-version", str(2**63)), "resume --weight-version must be an integer from 0 to "),
    (("end-job", "--wait", "-1"), "end-job --wait must be a number of seconds >= 0, not -1"),
    (("end-job", "--wait", "nan"), "end-job --wait must be a number of seconds >= 0, not nan"),
])
def test_every_numeric_option_out_of_range_is_one_line_naming_the_flag_exit_2(argv, says, capsys):
    # Nothing listens on port 1: a command that got past its checks would fail otherwise (exit 1).
    assert client_cli.main(["--address", "127.0.0.1:1", *argv], out=io.StringIO()) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"coda-client: {says}") and err.count("\n") == 1, err


@pytest.mark.parametrize("given, missing", [("--cert-file", "--key-file"), ("--key-file", "--cert-file")])
def test_a_client_certificate_without_its_key_is_said_in_the_flags_names(given, missing, capsys, tmp_path,
                                                                          monkeypatch):
    for variable in ("CODA_TLS_CA_FILE", "CODA_TLS_CERT_FILE", "CODA_TLS_KEY_FILE"):
        monkeypatch.delenv(variable, raising=False)
    pem = tmp_path / "one.pem"
    pem.write_text("not used")
    assert client_cli.main(["--address", "127.0.0.1:1", given, str(pem), "state"], out=io.StringIO()) == 2
    err = capsys.readouterr().err
    assert f"{given} is given, {missing} is not" in err and "certificate_chain" not in err, err


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command line")
def test_a_plaintext_call_to_a_tls_listener_says_the_server_may_require_tls(tmp_path, capsys):
    from test_security_transport import make_ca, make_leaf, tls_overrides

    certs = tmp_path / "certs"
    certs.mkdir()
    make_ca(certs, "ca")
    make_leaf(certs, "server", "ca", "subjectAltName=DNS:localhost,IP:127.0.0.1\n"
                                     "basicConstraints=CA:FALSE\nextendedKeyUsage=serverAuth\n")
    with ServerProcess(tmp_path, *core_overrides("no-window", B=2, N=2, M=2), *tls_overrides(certs)) as server:
        assert client_cli.main(["--address", server.address, "--timeout", "5", "state"], out=io.StringIO()) == 1
        err = capsys.readouterr().err
        assert "the server may require TLS: try --tls, or --ca-file FILE" in err, err
        out = io.StringIO()
        assert client_cli.main(["--address", server.address, "--ca-file", str(certs / "ca.pem"), "state"],
                               out=out) == 0
        assert "strategy no-window" in out.getvalue()
