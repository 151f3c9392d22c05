"""TLS, mutual TLS, the Unix socket and the plaintext health-only port, each over a real connection.

Throw-away certificates are made per test module with the `openssl` command line (a CA, a server
certificate for localhost / 127.0.0.1, a client certificate, and a rogue CA with its own client).
"""
from __future__ import annotations

import io
import os
import re
import shutil
import socket
import stat
import subprocess
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from coda_client import PacerClient, Trajectory, TrajectoryStatus
from coda_client import cli as client_cli
from coda_client._channel import TlsConfig
from coda_client._proto import pacer_pb2 as pb
from coda_client._proto import pacer_pb2_grpc
from coda_client.errors import PacerClientError, UnauthenticatedError
from server_harness import ServerProcess

pytestmark = pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command line")

SMALL = ("data_source.num_prompts_per_step=2", "data_source.num_trajectories_per_prompt=2",
         "trainer.mini_batch_size=2", "fully_async.sliding_window=no-window")


def openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


def make_ca(directory: Path, name: str) -> None:
    openssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
            "-keyout", f"{name}.key", "-out", f"{name}.pem", "-days", "2", "-subj", f"/CN={name}",
            "-addext", "basicConstraints=critical,CA:TRUE", "-addext", "keyUsage=critical,keyCertSign,cRLSign",
            cwd=directory)


def make_leaf(directory: Path, name: str, ca: str, extensions: str) -> None:
    openssl("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
            "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN={name}", cwd=directory)
    (directory / f"{name}.ext").write_text(extensions)
    openssl("x509", "-req", "-in", f"{name}.csr", "-CA", f"{ca}.pem", "-CAkey", f"{ca}.key", "-CAcreateserial",
            "-out", f"{name}.pem", "-days", "2", "-extfile", f"{name}.ext", cwd=directory)


SERVER_LEAF = "subjectAltName=DNS:localhost,IP:127.0.0.1\nbasicConstraints=CA:FALSE\nextendedKeyUsage=serverAuth\n"
CLIENT_LEAF = "basicConstraints=CA:FALSE\nextendedKeyUsage=clientAuth\n"


def make_pki(directory: Path, *rogue_leaves: tuple[str, str]) -> Path:
    """A CA with a server and a client certificate, and a rogue CA with these (name, extensions) leaves of its own."""
    make_ca(directory, "ca")
    make_leaf(directory, "server", "ca", SERVER_LEAF)
    make_leaf(directory, "client", "ca", CLIENT_LEAF)
    make_ca(directory, "rogue-ca")
    for name, extensions in rogue_leaves:
        make_leaf(directory, name, "rogue-ca", extensions)
    return directory


@pytest.fixture(scope="module")
def certs(tmp_path_factory) -> Path:
    return make_pki(tmp_path_factory.mktemp("certs"), ("rogue-client", CLIENT_LEAF))


def tls_overrides(certs: Path, *, mutual: bool = False) -> tuple[str, ...]:
    overrides = (f"server.tls.cert_file={certs / 'server.pem'}", f"server.tls.key_file={certs / 'server.key'}")
    return overrides + ((f"server.tls.client_ca_file={certs / 'ca.pem'}",) if mutual else ())


def one_cycle(client: PacerClient, prompt: str) -> None:
    """Dispatch, submit a full group, collect it: the whole path works over this connection."""
    assert client.dispatch([prompt]).admitted == [prompt]
    client.submit([Trajectory(trajectory_id=f"{prompt}-t{i}", prompt_id=prompt, status=TrajectoryStatus.COMPLETED,
                              reward=float(i), payload=b"\x00secret") for i in range(2)])
    [group] = client.collect(1, wait=5)
    assert group.prompt_id == prompt and sorted(t.payload for t in group.trajectories) == [b"\x00secret"] * 2


def fails_to_connect(client: PacerClient) -> PacerClientError:
    with pytest.raises(PacerClientError) as caught:
        client.state()
    return caught.value


def handshake_fails(address: str, tls: TlsConfig | None = None) -> None:
    """A raw channel (no wait-for-ready, unlike PacerClient) fails at once with UNAVAILABLE: no call runs."""
    channel = grpc.secure_channel(address, tls.credentials()) if tls else grpc.insecure_channel(address)
    with channel:
        with pytest.raises(grpc.RpcError) as caught:
            pacer_pb2_grpc.RolloutPacerStub(channel).GetState(pb.GetStateRequest(), timeout=10)
    assert caught.value.code() == grpc.StatusCode.UNAVAILABLE, caught.value


def probe(*args: str) -> tuple[int, str]:
    out = io.StringIO()
    code = client_cli.main(["--timeout", "5", *args], out=out)
    return code, out.getvalue()


# ----------------------------------------------------------------------------------------------- TLS


def test_tls_serves_verified_clients_only(tmp_path, certs):
    with ServerProcess(tmp_path, *SMALL, *tls_overrides(certs)) as server:
        assert "(TLS)" in server.log()
        with PacerClient(server.address, tls=TlsConfig(root_certificates=certs / "ca.pem"), timeout=5) as client:
            one_cycle(client, "tls-p0")
        # Plaintext against a TLS port, or a client trusting another CA: the handshake fails, no call runs.
        handshake_fails(server.address)
        handshake_fails(server.address, TlsConfig(root_certificates=certs / "rogue-ca.pem"))
        code, out = probe("--address", server.address, "--ca-file", str(certs / "ca.pem"), "health")
        assert (code, out) == (0, "readiness: SERVING\n")
        code, _ = probe("--address", server.address, "health")  # plaintext probe of a TLS port fails
        assert code == 1


def test_mutual_tls_requires_a_client_certificate_from_the_configured_ca(tmp_path, certs):
    token = "mtls-and-token-0123456789abcdef"
    token_file = tmp_path / "token"
    token_file.write_text(token + "\n")
    overrides = (*tls_overrides(certs, mutual=True), f"server.auth_token_file={token_file}")
    with ServerProcess(tmp_path, *SMALL, *overrides) as server:
        assert "(mutual TLS)" in server.log()
        good = TlsConfig(root_certificates=certs / "ca.pem", certificate_chain=certs / "client.pem",
                         private_key=certs / "client.key")
        with PacerClient(server.address, tls=good, token=token, timeout=5) as client:
            one_cycle(client, "mtls-p0")
        # A certificate alone is not enough when a token is configured too.
        with PacerClient(server.address, tls=good, timeout=5) as no_token:
            assert isinstance(fails_to_connect(no_token), UnauthenticatedError)
        no_cert = TlsConfig(root_certificates=certs / "ca.pem")
        rogue = TlsConfig(root_certificates=certs / "ca.pem", certificate_chain=certs / "rogue-client.pem",
                          private_key=certs / "rogue-client.key")
        for tls in (no_cert, rogue):
            handshake_fails(server.address, tls)
        code, out = probe("--address", server.address, "--ca-file", str(certs / "ca.pem"), "--cert-file",
                          str(certs / "client.pem"), "--key-file", str(certs / "client.key"), "health")
        assert (code, out) == (0, "readiness: SERVING\n")
        assert token not in server.log()


def test_plaintext_health_port_next_to_a_tls_listener(tmp_path, certs):
    """The Kubernetes gRPC probe speaks neither TLS nor tokens: it gets a plaintext port with health only."""
    token_file = tmp_path / "token"
    token_file.write_text("health-port-token-0123456789")
    overrides = (*tls_overrides(certs, mutual=True), f"server.auth_token_file={token_file}",
                 "server.health_address=127.0.0.1:0")
    with ServerProcess(tmp_path, *SMALL, *overrides) as server:
        health_port = server.info["health_port"]
        assert server.info["port"] == int(server.address.rsplit(":", 1)[1]) != health_port
        for service in ("", "liveness", "readiness"):
            code, out = probe("--address", f"127.0.0.1:{health_port}", "health", "--service", service)
            assert code == 0 and out.endswith(": SERVING\n")
        with grpc.insecure_channel(f"127.0.0.1:{health_port}") as channel:
            watch = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(service="readiness"),
                                                             timeout=5)
            assert next(watch).status == health_pb2.HealthCheckResponse.SERVING
            watch.cancel()
            # Nothing but health is served there: the pacer is not reachable around TLS and the token.
            with pytest.raises(grpc.RpcError) as caught:
                pacer_pb2_grpc.RolloutPacerStub(channel).GetState(pb.GetStateRequest(), timeout=5)
            assert caught.value.code() == grpc.StatusCode.UNIMPLEMENTED
        # Draining turns the probe port NOT_SERVING too (one HealthServicer behind both listeners).
        server.process.send_signal(15)
        assert server.process.wait(30) == 0


# ----------------------------------------------------------------------------------------------- Unix socket


def test_unix_socket_only_with_restricted_mode(tmp_path):
    socket_path = tmp_path / "pacer.sock"
    with ServerProcess(tmp_path, *SMALL, "server.address=", f"server.uds_path={socket_path}") as server:
        assert server.info["address"] is None and server.info["port"] is None
        assert server.info["uds"] == str(socket_path) and server.address == f"unix:{socket_path}"
        info = os.stat(socket_path)
        assert stat.S_ISSOCK(info.st_mode) and stat.S_IMODE(info.st_mode) == 0o660
        with PacerClient(server.address, timeout=5) as client:
            one_cycle(client, "uds-p0")
        code, out = probe("--address", server.address, "health")
        assert (code, out) == (0, "readiness: SERVING\n")
        [start_line] = [line for line in server.log().splitlines() if "serving coda.pacer.v1.RolloutPacer on" in line]
        assert f"on unix:{socket_path} (mode 0660) (strategy" in start_line
        assert server.terminate() == 0
    assert not socket_path.exists()  # removed on shutdown


def test_unix_socket_next_to_tls_tcp_with_token(tmp_path, certs):
    """Same-pod callers on the socket (plaintext, file mode + token), other pods over TLS."""
    socket_path = tmp_path / "pacer.sock"
    token = "uds-token-0123456789abcdef"
    overrides = (*tls_overrides(certs), f"server.uds_path={socket_path}", "server.uds_mode=0600")
    with ServerProcess(tmp_path, *SMALL, *overrides, env={"CODA_TOKEN": token}) as server:
        assert stat.S_IMODE(os.stat(socket_path).st_mode) == 0o600
        assert server.info["uds"] == str(socket_path) and server.info["port"] > 0
        with PacerClient(f"unix:{socket_path}", token=token, timeout=5) as local:
            local.dispatch(["both-p0"])
        with PacerClient(server.address, tls=TlsConfig(root_certificates=certs / "ca.pem"), token=token,
                         timeout=5) as remote:
            assert remote.state().running == 1  # one pacer behind both listeners
        with PacerClient(f"unix:{socket_path}", timeout=5) as anonymous:
            assert isinstance(fails_to_connect(anonymous), UnauthenticatedError)


def test_stale_socket_is_replaced_but_a_live_one_or_a_file_is_not(tmp_path):
    socket_path = tmp_path / "pacer.sock"
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stale.bind(str(socket_path))  # bound, never listening: what a crashed server leaves behind
    stale.close()
    with ServerProcess(tmp_path, *SMALL, "server.address=", f"server.uds_path={socket_path}") as first:
        assert "removing stale socket" in first.log()
        # gRPC itself would unlink the socket of the running server and take its callers over.
        second = ServerProcess(tmp_path, *SMALL, "server.address=", f"server.uds_path={socket_path}")
        with pytest.raises(RuntimeError, match="another server is listening on it"):
            second.start()
        second.close()
        with PacerClient(first.address, timeout=5) as client:
            assert client.state().step == 0  # the first server still owns the socket
    regular = tmp_path / "not-a-socket"
    regular.write_text("precious")
    third = ServerProcess(tmp_path, *SMALL, "server.address=", f"server.uds_path={regular}")
    with pytest.raises(RuntimeError, match="exists and is not a socket"):
        third.start()
    third.close()
    assert regular.read_text() == "precious"


# ----------------------------------------------------------------------------------------------- start-up errors


@pytest.mark.parametrize("overrides, message", [
    (("server.tls.cert_file=/etc/hostname",), "cert_file and key_file must be set together"),
    (("server.tls.client_ca_file=/etc/hostname",), "mutual TLS needs the server's own cert_file and key_file"),
    (("server.address=",), "may be \"\" only when server.uds_path is set"),
    (("server.uds_mode=777",), "server.uds_mode = 777"),
    (("server.uds_mode=0o1777",), "must be an octal file mode between"),
])
def test_transport_keys_are_validated_with_the_config(overrides, message):
    from coda_server.core.config import load_config
    from coda_server.core.errors import ConfigError

    with pytest.raises(ConfigError, match=re.escape(message)):
        load_config(overrides=overrides)


@pytest.mark.parametrize("overrides, exit_code, message", [
    (("server.tls.cert_file=/nonexistent/server.pem", "server.tls.key_file=/nonexistent/server.key"), 2,
     "server.tls.cert_file = '/nonexistent/server.pem': cannot be read"),
    (("server.uds_path=/nonexistent-dir/pacer.sock",), 1, "directory '/nonexistent-dir' does not exist"),
    (("server.uds_path=/tmp/" + "x" * 120,), 1, "longer than 107 bytes"),
])
def test_unusable_listener_settings_stop_start_up_with_a_message(tmp_path, overrides, exit_code, message):
    server = ServerProcess(tmp_path, *SMALL, *overrides)
    with pytest.raises(RuntimeError) as caught:
        server.start()
    server.close()
    assert f"server exited with {exit_code}" in str(caught.value) and message in str(caught.value)


def test_metrics_listener_over_tls_with_client_certificates(tmp_path, certs):
    """server.metrics_tls: /metrics over HTTPS with the gRPC port's certificate; mutual TLS asks scrapers
    for a certificate from the configured CA."""
    import ssl
    import urllib.error
    import urllib.request

    with ServerProcess(tmp_path, *SMALL, *tls_overrides(certs, mutual=True), "server.metrics_tls=true") as server:
        url = f"https://127.0.0.1:{server.info['metrics_port']}/metrics"
        with pytest.raises((urllib.error.URLError, ConnectionError)):  # plaintext HTTP to the TLS port: no answer
            urllib.request.urlopen(url.replace("https", "http"), timeout=10)
        no_cert = ssl.create_default_context(cafile=str(certs / "ca.pem"))
        with pytest.raises((urllib.error.URLError, ssl.SSLError, ConnectionError)):
            urllib.request.urlopen(url, timeout=10, context=no_cert).read()
        with_cert = ssl.create_default_context(cafile=str(certs / "ca.pem"))
        with_cert.load_cert_chain(str(certs / "client.pem"), str(certs / "client.key"))
        with urllib.request.urlopen(url, timeout=10, context=with_cert) as response:
            assert response.status == 200 and "coda_pacer_window_size_groups" in response.read().decode()
