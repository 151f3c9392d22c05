"""The command line and the client's small edges: text by default and JSON with --json on every command, the
worker's id in `coda-client workers`, our own messages for out-of-range numbers and oversized Submits."""
from __future__ import annotations

import asyncio
import io
import json
import re
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from coda_client import AsyncPacerClient, PacerClient, Trajectory, TrajectoryStatus
from coda_client import cli as client_cli
from coda_client.errors import BadRequestError, MessageTooLargeError, UnavailableError
from coda_worker import AsyncRolloutWorker, FakeEngine, ListPromptSource, Prompt
from conftest import core_overrides
from server_harness import ServerProcess
from test_durability_crash import free_port


@pytest.fixture
def server(tmp_path):
    with ServerProcess(tmp_path, *core_overrides("no-window", B=2, stale=1.0, N=2, M=2)) as process:
        yield process


def run_cli(address: str, *argv: str) -> tuple[int, str]:
    out = io.StringIO()
    return client_cli.main(["--address", address, *argv], out=out), out.getvalue()


def test_every_command_prints_text_by_default_and_json_with_the_flag(server, tmp_path):
    address = server.address
    commands = [("state",), ("workers",), ("health",), ("reset", "--mode", "wait", "--wait", "0"),
                ("resume", "--weight-version", "1"), ("checkpoint", str(tmp_path / "a.ckpt")),
                ("restore", str(tmp_path / "a.ckpt")), ("watch", "--count", "1"), ("end-job", "--wait", "0")]
    for command in commands:
        code, text = run_cli(address, *command)
        assert code == 0, (command, text)
        assert not text.lstrip().startswith("{"), f"{command[0]} printed JSON without --json: {text!r}"
    code, text = run_cli(address, "end-job", "--wait", "0")
    assert "job ended" in text and "left over 0" in text
    for command in commands:
        if command[0] in ("reset", "resume", "restore"):  # the job has ended: refused, as the server says
            code, text = run_cli(address, *command, "--json")
            assert code == 1
            continue
        code, text = run_cli(address, *command, "--json")
        assert code == 0, (command, text)
        for line in text.splitlines():
            json.loads(line)
    assert json.loads(run_cli(address, "end-job", "--json", "--wait", "0")[1])["state"]["job_ended"] is True


def test_the_workers_id_shows_in_coda_client_workers(server):
    async def go() -> str:
        source = ListPromptSource([Prompt(f"p{i}", [1, 2]) for i in range(100)])
        slow = FakeEngine(mean_tokens=5000, length_sigma=0, seconds_per_token=0.01)
        async with AsyncPacerClient(server.address) as pacer:  # the client has no client_id of its own
            worker = AsyncRolloutWorker(pacer, slow, source, worker_id="rollout-7", max_groups=1)
            task = asyncio.create_task(worker.run())
            deadline = time.monotonic() + 20
            while slow.running < 2:
                assert time.monotonic() < deadline
                await asyncio.sleep(0.01)
            listed = await asyncio.to_thread(run_cli, server.address, "workers")
            worker.stop()
            await slow.abort([])
            async with AsyncPacerClient(server.address) as trainer:
                await trainer.end_job("abort", wait=10)
            await asyncio.wait_for(task, 20)
            return listed[1]

    text = asyncio.run(go())
    assert text.startswith("rollout-7: 1 running") and "(no client id)" not in text


def test_out_of_range_numbers_get_a_message_naming_the_field_and_the_range(server):
    with PacerClient(server.address) as pacer:
        with pytest.raises(ValueError, match=r"num_groups -1 is out of range: .* 0 to 4294967295 .*uint32"):
            pacer.collect(-1)
        with pytest.raises(ValueError, match=r"weight_version 9223372036854775808 is out of range: .*int64"):
            pacer.resume(2**63)
        with pytest.raises(ValueError, match=r"max_continuations -2 is out of range"):
            pacer.dispatch(["a"], max_continuations=-2)
        with pytest.raises(ValueError, match=r"max_groups_per_worker"):
            pacer.list_workers(max_groups_per_worker=2**32)
        assert pacer.state().dispatched == 0  # nothing was sent


def test_a_number_of_the_wrong_kind_gets_a_type_error_naming_the_field_and_nothing_is_sent(server):
    with PacerClient(server.address) as pacer:
        with pytest.raises(TypeError, match=r"num_groups must be an integer, not 8\.0 \(float; "
                                            r"CollectRequest\.num_groups is of type uint32\)"):
            pacer.collect(8.0)
        with pytest.raises(TypeError, match=r"num_groups must be an integer, not True \(bool"):
            pacer.collect(True)
        with pytest.raises(TypeError, match=r"weight_version must be an integer, not 1\.5"):
            pacer.reset("wait", wait=0, resume=True, weight_version=1.5)
        with pytest.raises(TypeError, match=r"wait_seconds must be a number, not '1' \(str"):
            pacer.dispatch(["a"], wait="1")
        with pytest.raises(TypeError, match=r"wait_seconds must be a number, not '5' \(str; ResetRequest"):
            pacer.reset("wait", wait="5")
        assert pacer.state().dispatched == 0 and pacer.state().step == 0  # nothing was sent
        # NumPy's integers are integers (a count computed with NumPy, a rank from a launcher)
        assert pacer.collect(np.int64(1), wait=0) == []
        assert pacer.resume(np.int64(3)).weight_version == 3


def test_a_submit_over_the_limit_is_refused_before_it_is_built_naming_max_message_bytes(server):
    big = np.zeros(300_000_000, dtype=np.int32)  # 1.2 GB as token_ids, 1.2 GB as logprobs: ~2.4 GB on the wire
    trajectory = Trajectory(trajectory_id="a#0", prompt_id="a", status=TrajectoryStatus.COMPLETED, token_ids=big,
                            logprobs=big.view(np.float32))
    with PacerClient(server.address) as pacer:
        pacer.dispatch(["a"])
        started = time.monotonic()
        with pytest.raises(MessageTooLargeError) as refused:
            pacer.submit([trajectory])
        assert time.monotonic() - started < 1.0  # nothing encoded (encoding 2.4 GB takes seconds)
        assert isinstance(refused.value, BadRequestError) and refused.value.reason == "MESSAGE_TOO_LARGE"
        assert "max_message_bytes (67108864)" in str(refused.value) and "2400000" in str(refused.value)
        assert pacer.state().submitted == 0


def test_watch_says_so_when_its_server_dies_instead_of_ending_as_if_done(tmp_path, capsys):
    """kill -9 ended the watch's stream with UNAVAILABLE, which the watch took for a normal end: exit status 0."""
    class Frames(io.StringIO):
        def __init__(self) -> None:
            super().__init__()
            self.drawn = threading.Event()

        def flush(self) -> None:
            self.drawn.set()

    server = ServerProcess(tmp_path, *core_overrides("no-window", B=2, stale=1.0, N=2, M=2)).start()
    try:
        out, outcome = Frames(), []
        watching = threading.Thread(target=lambda: outcome.append(
            client_cli.main(["--address", server.address, "watch", "--interval", "30"], out=out)))
        watching.start()
        assert out.drawn.wait(30)  # the first frame: the stream is up
        server.kill()
        watching.join(60)
        assert outcome == [1]
        assert f"UNAVAILABLE: cannot reach the pacer at {server.address}" in capsys.readouterr().err
    finally:
        server.close()


@pytest.mark.parametrize("command", [("state",), ("health",), ("watch", "--count", "1")])
def test_an_address_grpc_would_dial_modulo_65536_stops_the_cli_with_exit_2(command, capsys):
    code, text = run_cli("127.0.0.1:99999", *command)  # gRPC would dial 127.0.0.1:34463
    assert (code, text) == (2, "")
    assert "target '127.0.0.1:99999' is not host:port with a port in 1..65535" in capsys.readouterr().err


def test_the_cli_finds_the_server_by_coda_address_as_the_docs_blocks_do_or_by_target(server, monkeypatch):
    """One variable for the address: the docs' Python blocks and coda-client both read CODA_ADDRESS; --target is
    --address under PacerClient's name for it."""
    monkeypatch.setenv("CODA_ADDRESS", server.address)
    out = io.StringIO()
    assert client_cli.main(["state", "--json"], out=out) == 0 and json.loads(out.getvalue())["step"] == 0
    monkeypatch.setenv("CODA_ADDRESS", "127.0.0.1:1")  # nothing listens there: --target must win
    out = io.StringIO()
    assert client_cli.main(["--target", server.address, "state", "--json"], out=out) == 0


@pytest.mark.parametrize("command, path, message", [
    ("checkpoint", "missing/dir/step-3.ckpt", "cannot write the checkpoint to '{path}': the directory '{parent}' does not "
                                              "exist"),
    ("checkpoint", ".", "cannot write the checkpoint to '{path}': it is a directory; name a file in it"),
    ("restore", "missing.ckpt", "cannot read the checkpoint '{path}': No such file or directory"),
])
def test_a_checkpoint_path_that_cannot_be_used_is_said_without_a_traceback(server, tmp_path, capsys, command, path,
                                                                           message):
    """Each raised a bare traceback (the write's, naming a temporary file, after the server had taken the checkpoint)."""
    path = str(tmp_path / path)
    status, printed = run_cli(server.address, command, path)
    error = capsys.readouterr().err
    assert status == 2 and printed == "" and "Traceback" not in error
    assert message.format(path=path, parent=str(Path(path).parent)) in error
    with PacerClient(server.address) as pacer:  # the library says the same, before asking the server
        with pytest.raises(OSError, match=re.escape(message.format(path=path, parent=str(Path(path).parent)))):
            pacer.checkpoint(path) if command == "checkpoint" else pacer.restore(path)


@pytest.mark.parametrize("timeout", [0.3, 1.0, 1.5])
def test_a_client_with_a_timeout_under_two_seconds_gets_answers(server, timeout):
    """gRPC Python ends a call at once when its channel's method config has a timeout under about two seconds
    (grpc/grpc#34547): every call of such a client failed with DEADLINE_EXCEEDED in a millisecond."""
    with PacerClient(server.address, timeout=timeout) as pacer:
        assert pacer.state().step == 0
        assert pacer.dispatch(["short-deadline"]).admitted == ["short-deadline"]

    async def asynchronous() -> int:
        async with AsyncPacerClient(server.address, timeout=timeout, wait_for_ready=True) as pacer:
            return (await pacer.state()).running

    assert asyncio.run(asynchronous()) == 1


@pytest.mark.parametrize("timeout", [0.3, 0.5, 1.0])
def test_a_short_timeout_where_nothing_listens_says_the_server_is_unreachable(timeout, capsys):
    """`coda-client --timeout 1 state` on a wrong port said DEADLINE_EXCEEDED "no answer in time": the UNAVAILABLE
    retries (up to 1.5 s of pauses) outlasted the deadline, and the refusal they met was lost. The retries now fit
    in half the client's timeout."""
    port = free_port()  # nothing listens there
    for _ in range(3):  # the pauses between retries are random: a few fresh clients each
        with PacerClient(f"127.0.0.1:{port}", timeout=timeout) as pacer:
            with pytest.raises(UnavailableError, match="Connection refused"):
                pacer.state()

        async def asynchronous() -> None:
            async with AsyncPacerClient(f"127.0.0.1:{port}", timeout=timeout) as pacer:
                await pacer.state()

        with pytest.raises(UnavailableError, match="Connection refused"):
            asyncio.run(asynchronous())
    assert client_cli.main(["--target", f"127.0.0.1:{port}", "--timeout", str(timeout), "state"]) == 1
    assert f"UNAVAILABLE: cannot reach the pacer at 127.0.0.1:{port}" in capsys.readouterr().err


@pytest.mark.parametrize("arguments, message", [
    (dict(timeout=0), "timeout must be a number of seconds > 0 (each call's deadline), not 0"),
    (dict(timeout=-1), "timeout must be a number of seconds > 0"),  # gRPC's C core logged a service-config error
    (dict(max_message_bytes=-1), "max_message_bytes must be an integer from 65536 to 2147483647, not -1"),
    (dict(max_message_bytes=0), "max_message_bytes must be an integer from 65536 to 2147483647, not 0"),
])
def test_a_client_that_could_never_make_a_call_is_refused_when_made(arguments, message):
    """A deadline of 0 failed every call with DEADLINE_EXCEEDED, and max_message_bytes=-1 (gRPC's "no limit") refused
    every Submit as too large: both only at the first call."""
    for client_class in (PacerClient, AsyncPacerClient):
        with pytest.raises(ValueError, match=re.escape(message)):
            client_class("127.0.0.1:50051", **arguments)


@pytest.mark.parametrize("argv, says", [
    (["--port", "50052"], "server.address=127.0.0.1:50052"),
    (["--port=6000"], "server.address=127.0.0.1:6000"),
    (["--host", "0.0.0.0"], "server.address=0.0.0.0:50051"),
    (["--conf", "run.yaml"], "did you mean --config or --config-name or --config-path?"),
    (["a.b=1", "--port", "6000", "c.d=2"], "server.address=127.0.0.1:6000"),
])
def test_coda_server_refuses_an_option_it_has_not_instead_of_taking_it_for_another(argv, says, tmp_path, monkeypatch,
                                                                                 capsys):
    """`coda-server --port 50052` was taken for `--port-file 50052`: the server started on its default port and wrote a
    file named 50052 where it was run, saying nothing of the port asked for."""
    from coda_server import cli as server_cli

    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as stopped:
        server_cli.parse_args(argv)
    assert stopped.value.code == 2
    assert says in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def test_coda_server_takes_overrides_before_between_and_after_its_options():
    """Was: `override 'c.d=2' comes after an option that follows other overrides` for the second run of overrides."""
    from coda_server import cli as server_cli

    args = server_cli.parse_args(["a.b=1", "--config", "run.yaml", "c.d=2", "--port-file", "p.json", "e.f=3"])
    assert (args.overrides, args.config, str(args.port_file)) == (["a.b=1", "c.d=2", "e.f=3"], "run.yaml", "p.json")


def test_coda_client_says_the_address_option_when_given_server_or_port(capsys):
    """`coda-client --server HOST:PORT state` was taken for --server-name (a TLS name check) and dialled the default
    address; `--port N state` said only that N is no command."""
    for argv in (["--server", "127.0.0.1:1", "state"], ["--port", "1", "state"]):
        with pytest.raises(SystemExit) as stopped:
            client_cli.main(argv)
        assert stopped.value.code == 2
        assert "the server's address is --address HOST:PORT" in capsys.readouterr().err


def test_both_commands_say_their_version_and_the_server_logs_it_at_start(server, capsys):
    """`--version` was an unrecognized argument; a bug report needs the version, and so does an operator reading a
    server's log."""
    from coda_server import cli as server_cli
    from coda_client.protocol import package_version, source_digest

    for main in (server_cli.parse_args, client_cli.main):
        with pytest.raises(SystemExit) as stopped:
            main(["--version"])
        assert stopped.value.code == 0
    out = capsys.readouterr().out.splitlines()
    assert out == [f"coda-server {package_version()} (source {source_digest()}, coda.pacer.v1.RolloutPacer)",
                   f"coda-client {package_version()} (source {source_digest()}, coda.pacer.v1.RolloutPacer)"]
    assert re.match(r"\d+\.\d+", package_version())  # installed (pip install -e) in the test environment
    assert re.fullmatch(r"[0-9a-f]{12}", source_digest())
    assert f"coda-pacer {package_version()}, source {source_digest()} (Python " in server.log()


def test_a_token_file_that_cannot_be_read_is_named_by_its_flag(tmp_path, capsys):
    missing = tmp_path / "no-such-token"
    assert client_cli.main(["--target", "127.0.0.1:50051", "--token-file", str(missing), "state"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"coda-client: --token-file {missing}: No such file or directory"), err
    assert len(err.strip().splitlines()) == 1, err


def test_health_where_nothing_listens_says_no_answer_came_besides_the_status(capsys):
    port = free_port()  # nothing listens there
    out = io.StringIO()
    assert client_cli.main(["--target", f"127.0.0.1:{port}", "--timeout", "1", "health"], out=out) == 1
    assert out.getvalue() == "readiness: UNAVAILABLE\n"  # the line scripts read, unchanged
    assert f"coda-client: no health answer from 127.0.0.1:{port}: UNAVAILABLE" in capsys.readouterr().err
