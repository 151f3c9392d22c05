"""Client findings about waits and deadlines, each over a real server on 127.0.0.1:0.

1. A wait_for_ready client pointed at a server whose certificate it does not trust, at a web server, or where nothing
   listens ended with a bare "Deadline Exceeded": now its DeadlineExceededError (reason NOT_CONNECTED) says why, in
   the words a client that does not wait says at once. A slow server on a connected channel is unchanged.
2. A plain collect() that ran out its deadline while the server answered it late lost its groups silently: now it
   logs the warning an interrupted one logs, naming the request id that answers the same groups again.
3. batches() said "dispatch is paused" after up to 10 s (its check followed each 5 s poll), not the 5 s the docs
   give: each Collect's wait now ends when the warning falls due (checked with a clock the test moves by hand).
"""
from __future__ import annotations

import asyncio
import logging
import re
import shutil
import socket
import threading
from pathlib import Path

import pytest

from coda_client import AsyncPacerClient, DeadlineExceededError, PacerClient
from coda_client import batches as batches_module
from coda_client._channel import TlsConfig
from coda_client.batches import _BatchWait
from coda_client.errors import NOT_CONNECTED
from conftest import core_overrides
from fake_clock import FakeClock
from server_harness import ServerProcess, until
from test_durability_crash import free_port
from test_trainer_liveness import _fill

SMALL = core_overrides("no-window", B=2, stale=0.0, N=2, M=2)  # groups of 2, a mini-batch of one group


class HoldingProxy:
    """A TCP relay to a server whose answers (the server's bytes to the client) can be held back: a server that
    answers late, as its client sees it, over a connection that stays up (the client's channel READY)."""

    def __init__(self, upstream: str) -> None:
        host, port = upstream.rsplit(":", 1)
        self.upstream = (host, int(port))
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self.listener.getsockname()[1]}"
        self.flowing = threading.Event()
        self.flowing.set()
        self.sockets: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:  # closed
                return
            server = socket.create_connection(self.upstream)
            self.sockets += [client, server]
            threading.Thread(target=self._pump, args=(client, server, None), daemon=True).start()
            threading.Thread(target=self._pump, args=(server, client, self.flowing), daemon=True).start()

    @staticmethod
    def _pump(source: socket.socket, sink: socket.socket, gate: threading.Event | None) -> None:
        try:
            while data := source.recv(65536):
                if gate is not None:
                    gate.wait()
                sink.sendall(data)
        except OSError:
            pass
        finally:
            for end in (source, sink):
                try:
                    end.close()
                except OSError:
                    pass

    def hold(self) -> None:
        self.flowing.clear()

    def release(self) -> None:
        self.flowing.set()

    def __enter__(self) -> HoldingProxy:
        return self

    def __exit__(self, *exc) -> None:
        self.flowing.set()
        self.listener.close()
        for end in self.sockets:
            try:
                end.close()
            except OSError:
                pass


class _Lines(logging.Handler):
    """The lines a logger logs while in the block."""

    def __init__(self, logger: str) -> None:
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []
        self.logger = logging.getLogger(logger)

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(f"{record.levelname} {record.getMessage()}")

    def __enter__(self) -> _Lines:
        self.logger.addHandler(self)
        self.previous, self.logger.level = self.logger.level, logging.DEBUG
        return self

    def __exit__(self, *exc) -> None:
        self.logger.removeHandler(self)
        self.logger.setLevel(self.previous)


# --- 1. a wait_for_ready call that never connected says why ----------------------------------------------------------

CAUSES = {
    "nothing-listens": "Connection refused",
    "web-server": "something other than a gRPC server answers at that address",
    "untrusted-certificate": "the server's certificate is not signed by a CA this client trusts",
}


@pytest.fixture(scope="module")
def places(tmp_path_factory):
    """Where each cause is: a port where nothing listens, `python -m http.server`, a TLS pacer (and the CA of
    another, which the client is given)."""
    from test_worker_user_findings import web_server

    found: dict[str, tuple[str, TlsConfig | None]] = {"nothing-listens": (f"127.0.0.1:{free_port()}", None)}
    web = web_server(tmp_path_factory.mktemp("web"))  # a context manager
    found["web-server"] = (web.__enter__(), None)
    server = None
    if shutil.which("openssl") is not None:
        from test_security_transport import SERVER_LEAF, make_pki, tls_overrides

        certs = make_pki(tmp_path_factory.mktemp("certs"), ("rogue-server", SERVER_LEAF))
        server = ServerProcess(tmp_path_factory.mktemp("tls"), *SMALL, *tls_overrides(certs)).start()
        other_ca = TlsConfig(root_certificates=str(Path(certs) / "rogue-ca.pem"))
        found["untrusted-certificate"] = (server.address, other_ca)
    try:
        yield found
    finally:
        web.__exit__(None, None, None)  # stops the web server (by its PID)
        if server is not None:
            server.close()


def _check_not_connected(error: DeadlineExceededError, address: str, cause: str) -> None:
    text = str(error)
    assert error.reason == NOT_CONNECTED, text
    assert text.startswith(f"DEADLINE_EXCEEDED: no answer in time from the pacer at {address} (or no server "
                           "reachable there all along: the call waited for one, wait_for_ready=True)"), text
    assert f"the client could not connect within the call's deadline: cannot reach the pacer at {address}" in text
    assert CAUSES[cause] in text, text


@pytest.mark.parametrize("cause", list(CAUSES))
def test_a_blocking_wait_for_ready_call_that_never_connected_says_why(places, cause):
    if cause not in places:
        pytest.skip("needs the openssl command line")
    address, tls = places[cause]
    with PacerClient(address, tls=tls, timeout=1, wait_for_ready=True) as pacer:
        with pytest.raises(DeadlineExceededError) as caught:
            pacer.state()
    _check_not_connected(caught.value, address, cause)


@pytest.mark.parametrize("cause", list(CAUSES))
def test_an_async_wait_for_ready_call_that_never_connected_says_why(places, cause):
    if cause not in places:
        pytest.skip("needs the openssl command line")
    address, tls = places[cause]

    async def go() -> DeadlineExceededError:
        async with AsyncPacerClient(address, tls=tls, timeout=1, wait_for_ready=True) as pacer:
            with pytest.raises(DeadlineExceededError) as caught:
                await pacer.state()
            return caught.value

    _check_not_connected(asyncio.run(go()), address, cause)


def test_a_wait_for_ready_call_to_a_connected_but_slow_server_ends_as_before(tmp_path):
    """The channel is READY (connected through a relay that then holds the server's answers back): the deadline is
    the server's slowness, not a connection that was never made; the error is what it always was."""
    with ServerProcess(tmp_path, *SMALL) as server, HoldingProxy(server.address) as proxy:
        with PacerClient(proxy.address, timeout=1, wait_for_ready=True) as pacer:
            pacer.state()
            proxy.hold()
            with pytest.raises(DeadlineExceededError) as blocking:
                pacer.state()

        async def go() -> DeadlineExceededError:
            proxy.release()
            async with AsyncPacerClient(proxy.address, timeout=1, wait_for_ready=True) as client:
                await client.state()
                proxy.hold()
                with pytest.raises(DeadlineExceededError) as caught:
                    await client.state()
                return caught.value

        for error in (blocking.value, asyncio.run(go())):
            assert error.reason == "" and "could not connect" not in str(error), str(error)
            assert str(error).startswith(f"DEADLINE_EXCEEDED: no answer in time from the pacer at {proxy.address} "
                                         "(or no server reachable there all along"), str(error)


# --- 2. a plain collect() whose deadline passed before the server's late answer ---------------------------------------


def _deadline_warning(lines: list[str]) -> str:
    [warning] = [line for line in lines if "got no answer within its deadline" in line]
    return warning


def _named_request_id(warning: str) -> str:
    found = re.search(r"request_id ([0-9a-f-]{36}) got no answer within its deadline after it was sent", warning)
    assert found, warning
    rid = found.group(1)
    assert f"request_id={rid!r}" in warning
    for way in ("batches()", "lease=", "ack(result.lease_id)", "pass request_id="):
        assert way in warning
    return rid


def _feed_once_waiting(feeder: PacerClient, prompt_id: str) -> None:
    """Once the held client's Collect waits on the server, a group arrives: the server answers it at once."""
    until(lambda: feeder.state().waiting_calls == 1, "the Collect to wait on the server")
    _fill(feeder, [prompt_id])


def test_a_blocking_collect_answered_after_its_deadline_names_the_request_id_that_gets_its_groups(tmp_path):
    with ServerProcess(tmp_path, *SMALL) as server, HoldingProxy(server.address) as proxy, \
            PacerClient(server.address, client_id="feeder") as feeder, _Lines("coda_client.client") as logged:
        with PacerClient(proxy.address, timeout=1) as pacer:
            pacer.state()  # connected
            proxy.hold()  # the server's answers from now on reach the client only after its deadline
            threading.Thread(target=_feed_once_waiting, args=(feeder, "late-0"), daemon=True).start()
            with pytest.raises(DeadlineExceededError):
                pacer.collect(1, wait=3)  # the deadline: wait + 5 s
            assert feeder.state().buffered == 0  # taken by the Collect whose answer the client never read
            rid = _named_request_id(_deadline_warning(logged.lines))
            proxy.release()
            assert [g.prompt_id for g in pacer.collect(1, request_id=rid)] == ["late-0"]


def test_an_async_collect_answered_after_its_deadline_names_the_request_id_that_gets_its_groups(tmp_path):
    async def go(proxy: HoldingProxy, feeder: PacerClient) -> list[str]:
        async with AsyncPacerClient(proxy.address, timeout=1) as pacer:
            await pacer.state()
            proxy.hold()
            feeding = asyncio.ensure_future(asyncio.to_thread(_feed_once_waiting, feeder, "late-1"))
            with pytest.raises(DeadlineExceededError):
                await pacer.collect(1, wait=3)
            await feeding
            assert feeder.state().buffered == 0
            rid = _named_request_id(_deadline_warning(logged.lines))
            proxy.release()
            return [g.prompt_id for g in await pacer.collect(1, request_id=rid)]

    with ServerProcess(tmp_path, *SMALL) as server, HoldingProxy(server.address) as proxy, \
            PacerClient(server.address, client_id="feeder") as feeder, _Lines("coda_client.client") as logged:
        assert asyncio.run(go(proxy, feeder)) == ["late-1"]


def test_a_collect_that_never_connected_warns_of_no_lost_groups(tmp_path):
    """Nothing was sent (no server there): no request id to ask again, no warning; the error says why instead."""
    address = f"127.0.0.1:{free_port()}"
    with _Lines("coda_client.client") as logged:
        with PacerClient(address, timeout=1, wait_for_ready=True) as pacer:
            with pytest.raises(DeadlineExceededError) as caught:
                pacer.collect(1)

        async def go() -> None:
            async with AsyncPacerClient(address, timeout=1, wait_for_ready=True) as client:
                with pytest.raises(DeadlineExceededError):
                    await client.collect(1)

        asyncio.run(go())
    assert caught.value.reason == NOT_CONNECTED and "Connection refused" in str(caught.value)
    assert not [line for line in logged.lines if "request_id" in line], logged.lines


# --- 3. the paused warning after PAUSED_WARNING_SECONDS, not after the poll that follows -----------------------------


def test_each_collect_of_a_batch_wait_ends_when_the_paused_warning_falls_due(monkeypatch):
    """The user's timeline, on a clock moved by hand: the prefetch's Collect (poll 5 s) began at 0, the caller asked
    at 0.1 while dispatch is paused; that Collect ends at 5.0, 4.9 s after the ask, not yet due. The check follows
    each Collect, so the next must end at 5.1, when the warning falls due (it waited a whole poll: said at 10 s)."""
    clock = FakeClock(0.0)
    monkeypatch.setattr(batches_module, "_stall_clock", clock)
    wait = _BatchWait("mini-batch of 1 groups", "127.0.0.1:1")
    assert wait.poll(5.0, None, paused=False) == 5.0  # before the ask: at most the paused warning's delay
    assert wait.poll(30.0, None, paused=False) == batches_module.PAUSED_WARNING_SECONDS
    clock.now = 5.0
    assert not wait.due(0.1, paused=True)
    assert wait.poll(5.0, 0.1, paused=True) == pytest.approx(0.1)
    clock.now = 5.1
    assert wait.due(0.1, paused=True) and wait.poll(5.0, 0.1, paused=True) == 0.0
    wait.report(RuntimeError("x"), 0.1)
    assert wait.poll(5.0, 0.1, paused=True) == 5.0  # said: the next in STALL_REPEAT_SECONDS, polls as usual
    assert wait.poll(5.0, 0.1, paused=False) == 5.0  # not paused: due at 60 s
    assert _BatchWait("b", "t").poll(5.0, 0.0, paused=False) == 5.0


def test_a_trainer_waiting_while_dispatch_is_paused_is_told_at_5_s_whatever_its_poll(tmp_path, monkeypatch, caplog):
    """A Reset without its Resume, then next() on an iterator with a long poll: the warning waited for the Collect's
    whole poll to end. On a clock moved by hand (the server's Collects wait real seconds), the warning comes once
    PAUSED_WARNING_SECONDS have passed on it since the ask, and says that many seconds."""
    clock = FakeClock(1000.0)
    monkeypatch.setattr(batches_module, "_stall_clock", clock, raising=False)
    monkeypatch.setattr(batches_module, "STALL_WARNING_SECONDS", 3600.0)  # only the pause may warn in this test
    with ServerProcess(tmp_path, *SMALL) as server, PacerClient(server.address) as pacer, \
            caplog.at_level(logging.WARNING, logger="coda_client"):
        pacer.reset("wait", wait=0)  # paused; the trainer forgot resume()
        with pacer.batches(2, poll=120) as batches:
            until(lambda: batches._paused, "the iterator to hear that dispatch is paused")
            waiting = threading.Thread(target=lambda: next(batches, None), daemon=True)
            waiting.start()
            until(lambda: batches._asked_at is not None, "the caller to ask for its batch")
            assert "dispatch is paused" not in caplog.text  # no time has passed on the clock
            clock.now += batches_module.PAUSED_WARNING_SECONDS
            until(lambda: "dispatch is paused (step 0): a Reset without its Resume" in caplog.text,
                  "the paused warning", timeout=60)
            assert "no mini-batch of 1 groups for 5 s from the pacer" in caplog.text, caplog.text
            assert waiting.is_alive()
            pacer.resume(1)
            _fill(pacer, ["p0"])
            waiting.join(30)
            assert not waiting.is_alive()
