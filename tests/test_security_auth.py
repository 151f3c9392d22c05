"""Bearer-token authentication: the interceptor's rules, then a real server with a token file and one with $CODA_TOKEN."""
from __future__ import annotations

import io
import re

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from grpc_status import rpc_status
from google.protobuf import symbol_database
from google.rpc import error_details_pb2
from omegaconf import OmegaConf

from coda_client import PacerClient, Trajectory, TrajectoryStatus
from coda_client import cli as client_cli
from coda_client._proto import pacer_pb2 as pb
from coda_client.errors import UnauthenticatedError
from coda_server.auth import BearerTokenInterceptor, load_token
from coda_server.core.errors import ConfigError
from server_harness import ServerProcess

TOKEN = "tok-7f3a9c1e5b2d4f60a8e1c3b5d7f9a2c4"
SMALL = ("data_source.num_prompts_per_step=2", "data_source.num_trajectories_per_prompt=2",
         "trainer.mini_batch_size=2", "fully_async.sliding_window=no-window")


# ----------------------------------------------------------------------------------------------- unit


@pytest.mark.parametrize("metadata, reason", [
    ((), "MISSING_TOKEN"),
    ((("x-other", "Bearer " + TOKEN),), "MISSING_TOKEN"),
    ((("authorization", TOKEN),), "MALFORMED_TOKEN"),
    ((("authorization", "Basic " + TOKEN),), "MALFORMED_TOKEN"),
    ((("authorization", "Bearer "),), "MALFORMED_TOKEN"),
    ((("authorization", "Bearer " + TOKEN), ("authorization", "Bearer " + TOKEN)), "MALFORMED_TOKEN"),
    ((("authorization", "Bearer " + TOKEN[:-1]),), "INVALID_TOKEN"),
    ((("authorization", "Bearer " + TOKEN + "x"),), "INVALID_TOKEN"),
    ((("authorization", "Bearer " + TOKEN.upper()),), "INVALID_TOKEN"),
    ((("authorization", "Bearer " + TOKEN),), None),
    ((("authorization", "bearer " + TOKEN),), None),  # the scheme is case-insensitive (RFC 6750)
    ((("authorization", "Bearer " + TOKEN.encode().decode()),), None),
])
def test_interceptor_accepts_exactly_the_configured_token(metadata, reason):
    problem = BearerTokenInterceptor(TOKEN).check(metadata)
    assert (problem[0] if problem else None) == reason
    if problem:
        assert TOKEN not in problem[1]  # a refusal never echoes the token


def test_token_comes_from_the_file_first_then_the_environment(tmp_path):
    token_file = tmp_path / "token"
    token_file.write_text(f"  {TOKEN}\n")
    assert load_token(OmegaConf.create({"auth_token_file": str(token_file)}), {"CODA_TOKEN": "other"}) == TOKEN
    assert load_token(OmegaConf.create({"auth_token_file": ""}), {"CODA_TOKEN": TOKEN}) == TOKEN
    assert load_token(OmegaConf.create({"auth_token_file": ""}), {}) is None


@pytest.mark.parametrize("content, message", [
    (None, "cannot be read"),
    ("\n", "the file is empty"),
    ("two words", "printable ASCII without spaces"),
    ("caf\u00e9-token-0123456789", "printable ASCII without spaces"),
])
def test_unusable_token_file_is_a_config_error_that_does_not_show_the_token(tmp_path, content, message):
    token_file = tmp_path / "token"
    if content is not None:
        token_file.write_text(content, encoding="utf-8")
    with pytest.raises(ConfigError, match=message) as caught:
        load_token(OmegaConf.create({"auth_token_file": str(token_file)}), {})
    assert "server.auth_token_file" in str(caught.value) or "from server.auth_token_file" in str(caught.value)
    if content and content.strip():
        assert content.strip() not in str(caught.value)


# ----------------------------------------------------------------------------------------------- real server


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    directory = tmp_path_factory.mktemp("auth")
    token_file = directory / "token"
    token_file.write_text(TOKEN + "\n")
    with ServerProcess(directory, *SMALL, f"server.auth_token_file={token_file}", "server.reflection=true",
                       "server.log_level=DEBUG", env={"CODA_TOKEN": ""}) as process:
        process.token_file = token_file
        yield process


def refusal(call, *args, **kwargs) -> tuple[grpc.StatusCode, str, str]:
    with pytest.raises(grpc.RpcError) as caught:
        result = call(*args, timeout=10, **kwargs)
        if hasattr(result, "__next__"):  # a stream fails on its first read
            next(result)
    error = caught.value
    status = rpc_status.from_call(error)
    reason = ""
    for detail in status.details if status else ():
        if detail.Is(error_details_pb2.ErrorInfo.DESCRIPTOR):
            info = error_details_pb2.ErrorInfo()
            detail.Unpack(info)
            reason = info.reason
    return error.code(), error.details(), reason


def test_every_pacer_rpc_refuses_a_missing_or_wrong_token(server):
    """Every method the service declares (new ones included), with a harmless request of its input type."""
    channel = server.channel()
    wrong = (("authorization", "Bearer " + TOKEN[::-1]),)
    service = pb.DESCRIPTOR.services_by_name["RolloutPacer"]
    harmless = {"Dispatch": pb.DispatchRequest(candidates=[pb.PromptRef(prompt_id="p")]),
                "Reset": pb.ResetRequest(resume=True, weight_version=1), "Resume": pb.ResumeRequest(weight_version=1)}
    assert len(service.methods) >= 8
    for method in service.methods:
        request = harmless.get(method.name) or symbol_database.Default().GetSymbol(method.input_type.full_name)()
        path = f"/{service.full_name}/{method.name}"
        stream = channel.unary_stream if method.server_streaming else channel.unary_unary
        call = stream(path, request_serializer=lambda m: m.SerializeToString(), response_deserializer=lambda b: b)
        code, message, reason = refusal(call, request)
        assert (code, reason) == (grpc.StatusCode.UNAUTHENTICATED, "MISSING_TOKEN"), method.name
        assert "authorization: Bearer <token>" in message
        code, message, reason = refusal(call, request, metadata=wrong)
        assert (code, reason) == (grpc.StatusCode.UNAUTHENTICATED, "INVALID_TOKEN"), method.name
        assert "not the one this server was configured with" in message
    # Nothing of the refused calls was applied.
    state = server.stub().GetState(pb.GetStateRequest(), metadata=(("authorization", f"Bearer {TOKEN}"),))
    assert (state.dispatched, state.step, state.weight_version, state.paused) == (0, 0, 0, False)


def test_an_unauthenticated_call_is_refused_before_its_request_or_caller_is_read(server):
    """Neither the request bytes (they do not decode) nor the client id (malformed) is looked at: a caller
    without the token learns nothing but UNAUTHENTICATED, and takes no admission slot."""
    call = server.channel().unary_unary(f"/{pb.DESCRIPTOR.services_by_name['RolloutPacer'].full_name}/Submit",
                                        request_serializer=None, response_deserializer=lambda b: b)
    for token in (None, "Bearer " + TOKEN[::-1]):
        metadata = (("x-coda-client-id", "not a valid id!"),) + ((("authorization", token),) if token else ())
        code, _, reason = refusal(call, b"\xff\xff\xff", metadata=metadata)
        assert code == grpc.StatusCode.UNAUTHENTICATED, reason
    # With the token, the same call is read: its client id, then its bytes.
    authorized = (("authorization", "Bearer " + TOKEN),)
    code, _, reason = refusal(call, b"\xff\xff\xff", metadata=authorized + (("x-coda-client-id", "not a valid id!"),))
    assert (code, reason) == (grpc.StatusCode.INVALID_ARGUMENT, "INVALID_CLIENT_ID")
    code, _, reason = refusal(call, b"\xff\xff\xff", metadata=authorized)
    assert (code, reason) == (grpc.StatusCode.INVALID_ARGUMENT, "MALFORMED_REQUEST")


def test_health_and_reflection_need_no_token(server):
    channel = server.channel()
    health = health_pb2_grpc.HealthStub(channel)
    for service in ("", "liveness", "readiness"):
        assert health.Check(health_pb2.HealthCheckRequest(service=service), timeout=5).status == \
            health_pb2.HealthCheckResponse.SERVING
    watch = health.Watch(health_pb2.HealthCheckRequest(service="readiness"), timeout=5)
    assert next(watch).status == health_pb2.HealthCheckResponse.SERVING
    watch.cancel()
    reflection = reflection_pb2_grpc.ServerReflectionStub(channel)
    [answer] = reflection.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]),
                                               timeout=5)
    names = {s.name for s in answer.list_services_response.service}
    assert "coda.pacer.v1.RolloutPacer" in names and "grpc.health.v1.Health" in names


def test_client_with_the_token_runs_the_cycle_and_without_it_gets_unauthenticated(server):
    with PacerClient(server.address, token=TOKEN, timeout=5) as client:
        assert client.dispatch(["auth-p0"]).admitted == ["auth-p0"]
        client.submit([Trajectory(trajectory_id=f"auth-t{i}", prompt_id="auth-p0", status=TrajectoryStatus.COMPLETED)
                       for i in range(2)])
        [group] = client.collect(1, wait=5)
        assert group.prompt_id == "auth-p0"
    for token in (None, "wrong-token-0123456789"):
        with PacerClient(server.address, token=token, timeout=5) as client:
            with pytest.raises(UnauthenticatedError):
                client.state()


def test_command_line_client_reads_the_token_file(server, monkeypatch):
    monkeypatch.delenv("CODA_TOKEN", raising=False)
    monkeypatch.delenv("CODA_TOKEN_FILE", raising=False)
    out = io.StringIO()
    assert client_cli.main(["--address", server.address, "--token-file", str(server.token_file), "state", "--json"],
                           out=out) == 0
    assert '"strategy": "no-window"' in out.getvalue()
    assert client_cli.main(["--address", server.address, "state"], out=io.StringIO()) == 1
    out = io.StringIO()
    assert client_cli.main(["--address", server.address, "health"], out=out) == 0  # probes need no token
    assert out.getvalue() == "readiness: SERVING\n"


def test_the_token_never_reaches_the_log(server):
    # The module's calls ran with DEBUG logging, right and wrong tokens included.
    log = server.log()
    assert "bearer token authentication on (token from server.auth_token_file" in log
    assert "refused" in log and "MISSING_TOKEN" in log
    assert TOKEN not in log and TOKEN[::-1] not in log


def test_token_from_the_environment(tmp_path):
    with ServerProcess(tmp_path, *SMALL, env={"CODA_TOKEN": TOKEN}) as server:
        assert "token from $CODA_TOKEN" in server.log()
        with PacerClient(server.address, token=TOKEN, timeout=5) as client:
            assert client.state().step == 0
        with PacerClient(server.address, timeout=5) as client:
            with pytest.raises(UnauthenticatedError, match="requires a bearer token"):
                client.state()
        assert TOKEN not in server.log()


def test_unreadable_token_file_stops_start_up(tmp_path):
    server = ServerProcess(tmp_path, *SMALL, f"server.auth_token_file={tmp_path / 'missing'}")
    with pytest.raises(RuntimeError, match="server exited with 2") as caught:
        server.start()
    server.close()
    assert "server.auth_token_file" in str(caught.value) and "cannot be read" in str(caught.value)


def test_refusals_not_yet_reported_are_logged_at_shutdown(tmp_path):
    """Refused calls are summed up at most once a minute; those refused after the last summary are in one more line
    when the server stops, so a stop within the minute loses none of them."""
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    with ServerProcess(tmp_path, *SMALL, f"server.auth_token_file={token_file}", env={"CODA_TOKEN": ""}) as server:
        stub = server.stub()
        for _ in range(4):
            with pytest.raises(grpc.RpcError) as caught:
                stub.GetState(pb.GetStateRequest(), timeout=10)
            assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert server.terminate() == 0
        log = server.log()
    counts = [int(n) for n in re.findall(r"refused (\d+) call\(s\) without a valid token", log)]
    assert sum(counts) == 4, log
    assert "3 call(s) without a valid token since the last report (latest: /coda.pacer.v1.RolloutPacer/GetState, " \
           "MISSING_TOKEN); 4 in all since start-up; the server is stopping" in log, log
    assert log.index("4 in all since start-up") < log.index("stopped: step 0")  # written before the last line
    assert TOKEN not in log
