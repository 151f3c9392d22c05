"""An HTTP proxy in the environment (http_proxy and the like, common on clusters) and the client: a loopback target
is reached directly, whatever the proxy, and an error through a proxy says so."""
from __future__ import annotations

import io

import pytest

from coda_client import PacerClient
from coda_client import cli as client_cli
from coda_client._channel import is_loopback, proxy_in_use, target_host
from coda_client.errors import DeadlineExceededError, UnavailableError
from server_harness import ServerProcess

# Nothing listens on port 9 (discard) here: a channel through this proxy cannot connect.
DEAD_PROXY = "http://127.0.0.1:9"


@pytest.fixture
def server(tmp_path):
    with ServerProcess(tmp_path, "data_source.num_prompts_per_step=2", "data_source.num_trajectories_per_prompt=2",
                       "trainer.mini_batch_size=2") as running:
        yield running


@pytest.mark.parametrize("variable", ["http_proxy", "https_proxy", "grpc_proxy"])
def test_a_loopback_server_is_reached_directly_with_a_proxy_in_the_environment(server, monkeypatch, variable):
    monkeypatch.setenv(variable, DEAD_PROXY)
    with PacerClient(server.address, timeout=10) as pacer:
        assert pacer.state().step == 0
    out = io.StringIO()
    assert client_cli.main(["--address", server.address, "health"], out=out) == 0, out.getvalue()
    assert out.getvalue() == "readiness: SERVING\n"


def test_a_channel_sent_through_the_proxy_names_it_when_it_fails(server, monkeypatch):
    monkeypatch.setenv("http_proxy", DEAD_PROXY)
    monkeypatch.delenv("no_grpc_proxy", raising=False)
    monkeypatch.delenv("no_proxy", raising=False)
    # The caller's own channel argument wins over the loopback default: this channel goes through the proxy.
    with PacerClient(server.address, timeout=5, options={"grpc.enable_http_proxy": 1}) as pacer:
        with pytest.raises((UnavailableError, DeadlineExceededError)) as failed:
            pacer.state()
    assert (f"the pacer at {server.address} through the HTTP proxy {DEAD_PROXY} (from $http_proxy); to connect "
            f"directly, add the host to no_grpc_proxy or pass options={{'grpc.enable_http_proxy': 0}}") in str(
        failed.value)


@pytest.mark.parametrize("target, host", [("127.0.0.1:50051", "127.0.0.1"), ("[::1]:50051", "::1"),
                                          ("Pacer.Svc:50051", "pacer.svc"), ("dns:///pacer.svc:50051", "pacer.svc"),
                                          ("localhost", "localhost"), ("unix:/tmp/pacer.sock", None),
                                          ("ipv4:127.0.0.1:50051,10.0.0.2:50051", "127.0.0.1"),
                                          ("ipv6:[::1]:50051", "::1")])
def test_the_target_host_is_read_as_grpc_reads_it(target, host):
    assert target_host(target) == host


@pytest.mark.parametrize("host, loopback", [("127.0.0.1", True), ("127.8.9.10", True), ("::1", True),
                                            ("localhost", True), ("pacer.localhost", True), ("10.0.0.1", False),
                                            ("pacer.svc", False), (None, False)])
def test_loopback_hosts(host, loopback):
    assert is_loopback(host) is loopback


@pytest.mark.parametrize("no_proxy, used", [(None, True), ("", True), ("other.svc", True), ("pacer.svc", False),
                                            (".svc", False), ("svc", False), ("*", False), ("a, pacer.svc ,b", False)])
def test_no_proxy_excludes_a_host_or_its_domain(monkeypatch, no_proxy, used):
    monkeypatch.setenv("https_proxy", "http://proxy:3128")
    monkeypatch.delenv("grpc_proxy", raising=False)
    monkeypatch.delenv("no_grpc_proxy", raising=False)
    monkeypatch.delenv("no_proxy", raising=False)
    if no_proxy is not None:
        monkeypatch.setenv("no_proxy", no_proxy)
    expected = "http://proxy:3128 (from $https_proxy)" if used else None
    assert proxy_in_use("pacer.svc:50051", {}) == expected
    assert proxy_in_use("pacer.svc:50051", {"grpc.enable_http_proxy": 0}) is None
