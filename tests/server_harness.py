"""Starts a real coda-server in a subprocess on 127.0.0.1:0 and hands tests its address and raw stubs."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Sequence

import grpc
from google.rpc import error_details_pb2
from grpc_status import rpc_status

from coda_client._proto import pacer_pb2_grpc

REPO_ROOT = Path(__file__).resolve().parents[1]
START_TIMEOUT_SECONDS = 30.0


def until(condition, what: str, timeout: float = 30.0, poll: float = 0.02):
    """`condition()`'s first truthy value, polled every `poll` seconds; fails naming `what` after `timeout`."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(poll)


class ServerProcess:
    """A coda-server subprocess; `address` is host:port once `start()` returned."""

    def __init__(self, tmp_path: Path, *overrides: str, config_file: Optional[Path] = None, env: Optional[dict] = None,
                 config_args: Sequence[str] = (), cwd: Optional[Path] = None):
        self.tmp_path = Path(tmp_path)
        self.overrides = overrides
        self.config_file = config_file
        self.config_args = list(config_args)  # e.g. ["--config-path", DIR, "--config-name", NAME]
        self.env = env
        # Where the server starts. Elsewhere than the repository, a server without a state_dir override uses
        # the built-in default (./coda-state in that directory) instead of one of its own under tmp.
        self.cwd = Path(cwd) if cwd is not None else REPO_ROOT
        self.process: Optional[subprocess.Popen] = None
        self.address: Optional[str] = None
        self.log_path = self.tmp_path / f"server-{os.getpid()}-{id(self)}.log"
        self._channels: list[grpc.Channel] = []

    def command(self, port_file: Path) -> list[str]:
        command = [sys.executable, "-m", "coda_server", "--port-file", str(port_file)]
        if self.config_file is not None:
            command += ["--config", str(self.config_file)]
        command += self.config_args
        # Metrics on a free port too: servers of parallel tests must not fight over the default 9464. The
        # state directory too: each server its own under tmp (never ./coda-state in the repository), unless
        # the test names one (or "" for memory only) in its overrides or its config file.
        return command + ["server.address=127.0.0.1:0", "server.metrics_address=127.0.0.1:0",
                          *self.default_state_dir(), *self.overrides]

    def default_state_dir(self) -> list[str]:
        named = any(o.split("=", 1)[0].lstrip("+") == "server.state_dir" for o in self.overrides)
        in_file = self.config_file is not None and "state_dir" in Path(self.config_file).read_text()
        if named or in_file or self.cwd != REPO_ROOT:
            return []
        return [f"server.state_dir={self.tmp_path / f'state-{os.getpid()}-{id(self)}'}"]

    def start(self) -> "ServerProcess":
        port_file = self.tmp_path / f"port-{id(self)}.json"
        # A restarted server's harness object can reuse a freed one's id(): its stale port file would read as ready.
        port_file.unlink(missing_ok=True)
        env = {**os.environ, **(self.env or {})}
        if self.cwd != REPO_ROOT:  # the code under test is imported from the repository wherever it starts
            env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
        self._log = open(self.log_path, "wb")
        self.process = subprocess.Popen(self.command(port_file), cwd=self.cwd, stdout=self._log,
                                        stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + START_TIMEOUT_SECONDS
        while not port_file.exists():
            if self.process.poll() is not None:
                raise RuntimeError(f"server exited with {self.process.returncode}:\n{self.log()}")
            if time.monotonic() > deadline:
                self.kill()
                raise RuntimeError(f"server did not start in {START_TIMEOUT_SECONDS}s:\n{self.log()}")
            time.sleep(0.02)
        # The whole --port-file content (uds, health_port when set); address is null without a TCP listener
        # (override server.address= to serve on server.uds_path only): then the socket is the address.
        self.info = json.loads(port_file.read_text())
        self.address = self.info["address"] or f"unix:{self.info['uds']}"
        return self

    def channel(self) -> grpc.Channel:
        channel = grpc.insecure_channel(self.address)
        self._channels.append(channel)
        return channel

    def stub(self) -> pacer_pb2_grpc.RolloutPacerStub:
        return pacer_pb2_grpc.RolloutPacerStub(self.channel())

    def terminate(self, timeout: float = 30.0) -> int:
        """SIGTERM and wait; returns the exit code."""
        self.process.send_signal(signal.SIGTERM)
        return self.process.wait(timeout)

    def kill(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait(10)

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def close(self) -> None:
        for channel in self._channels:
            channel.close()
        self.kill()
        if hasattr(self, "_log"):
            self._log.close()

    def __enter__(self) -> "ServerProcess":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()


def refused_start(tmp_path: Path, *overrides: str) -> str:
    """Starts a server expected to stop at start-up; its output. A server that serves fails the test at once."""
    server = ServerProcess(tmp_path, *overrides)
    try:
        try:
            server.start()
        except RuntimeError as refused:
            assert "server exited with" in str(refused), refused
            return str(refused)
        raise AssertionError(f"the server started and served with {overrides}")
    finally:
        server.close()


@dataclass
class Refusal:
    """What a failed call said: its code and message, and the google.rpc.Status details the server sent (`rich`)."""

    code: grpc.StatusCode
    message: str
    rich: bool = False
    reason: str = ""  # ErrorInfo
    violations: list[tuple[str, str]] = field(default_factory=list)  # BadRequest: (field, description)
    retry_delay: Optional[float] = None  # RetryInfo, seconds


def refusal_of(error: grpc.RpcError) -> Refusal:
    """The code, message and rich details of a failed call."""
    refusal = Refusal(error.code(), error.details())
    status = rpc_status.from_call(error)
    if status is None:
        return refusal
    refusal.rich = True
    for detail in status.details:
        if detail.Is(error_details_pb2.ErrorInfo.DESCRIPTOR):
            info = error_details_pb2.ErrorInfo()
            detail.Unpack(info)
            refusal.reason = info.reason
        elif detail.Is(error_details_pb2.BadRequest.DESCRIPTOR):
            bad = error_details_pb2.BadRequest()
            detail.Unpack(bad)
            refusal.violations = [(v.field, v.description) for v in bad.field_violations]
        elif detail.Is(error_details_pb2.RetryInfo.DESCRIPTOR):
            retry = error_details_pb2.RetryInfo()
            detail.Unpack(retry)
            refusal.retry_delay = retry.retry_delay.ToNanoseconds() / 1e9
    return refusal
