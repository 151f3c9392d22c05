"""Unit tests of coda_client that need no server: conversions, status details, errors, channel config."""

from __future__ import annotations

import asyncio
import dataclasses
import io
import json
import logging
import re
import socket
import subprocess
import sys
import textwrap
import threading
import uuid
from pathlib import Path
from typing import Any

import grpc
import grpc.aio
import pytest
from google.protobuf import any_pb2, duration_pb2
from google.rpc import error_details_pb2, status_pb2  # tests may use googleapis; the client must not
from hypothesis import given, settings
from hypothesis import strategies as st

import coda_client
from coda_client import _calls, _channel
from coda_client import cli as client_cli
from coda_client import client as client_module
from coda_client._proto import pacer_pb2
from coda_client._status import FieldViolation, decode_status
from coda_client.errors import (
    BadRequestError,
    DeadlineExceededError,
    FailedPreconditionError,
    PacerClientError,
    ResourceExhaustedError,
    StaleGenerationError,
    UnauthenticatedError,
    UnavailableError,
    UnknownPromptError,
    translate,
)
from coda_client.types import (
    CollectResult,
    ControlEvent,
    ControlEventType,
    DispatchResult,
    PacerState,
    PromptRef,
    ResetMode,
    ResetResult,
    ResumeResult,
    SubmitResult,
    Trajectory,
    TrajectoryGroup,
    TrajectoryStatus,
)

ROOT = Path(__file__).resolve().parent.parent


def _trajectory(**overrides: Any) -> Trajectory:
    values: dict[str, Any] = dict(
        trajectory_id="epoch0_p0_t0",
        prompt_id="epoch0_p0",
        status=TrajectoryStatus.COMPLETED,
        ds_index=1,
        reward=0.75,
        token_ids=[151644, 8948, 0, -1],
        logprobs=[-0.5, -1.25, 0.0, -3.0],  # float32-exact: logprobs travel as float32
        loss_mask=[0, 1, 1, 1],
        start_weight_version=3,
        end_weight_version=4,
        num_turns=2,
        metadata={"env": "math", "ünï": "cødé"},
        payload=bytes(range(256)),
    )
    values.update(overrides)
    return Trajectory(**values)


# --- enums -------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("enum_cls", "proto_enum", "prefix"),
    [
        (TrajectoryStatus, pacer_pb2.TrajectoryStatus, "TRAJECTORY_STATUS_"),
        (ResetMode, pacer_pb2.ResetMode, "RESET_MODE_"),
        (ControlEventType, pacer_pb2.ControlEventType, "CONTROL_EVENT_TYPE_"),
    ],
)
def test_enum_values_equal_proto_numbers(enum_cls: Any, proto_enum: Any, prefix: str) -> None:
    ours = {prefix + member.name: member.value for member in enum_cls}
    theirs = dict(proto_enum.items())
    assert ours == theirs


def test_reset_mode_parse() -> None:
    assert ResetMode.parse("abort") is ResetMode.ABORT
    assert ResetMode.parse("WAIT") is ResetMode.WAIT
    assert ResetMode.parse(None) is ResetMode.UNSPECIFIED
    assert ResetMode.parse(2) is ResetMode.WAIT
    with pytest.raises(ValueError, match="abort"):
        ResetMode.parse("drain")


# --- conversions -------------------------------------------------------------------------------------


def test_trajectory_round_trips_through_the_wire() -> None:
    original = _trajectory()
    wire = original.to_pb().SerializeToString()
    back = Trajectory.from_pb(pacer_pb2.Trajectory.FromString(wire))
    assert back == original
    assert isinstance(back.status, TrajectoryStatus)
    assert type(back.token_ids) is list and type(back.metadata) is dict
    # What the trainer gets re-encodes to exactly what the worker sent.
    assert back.to_pb().SerializeToString(deterministic=True) == original.to_pb().SerializeToString(deterministic=True)


@settings(max_examples=60, deadline=None)
@given(
    tokens=st.lists(st.integers(-(2**31), 2**31 - 1), max_size=20),
    logprobs=st.lists(st.floats(width=32, allow_nan=False), max_size=20),
    metadata=st.dictionaries(st.text(max_size=8), st.text(max_size=8), max_size=4),
    payload=st.binary(max_size=64),
    reward=st.floats(allow_nan=False),
)
def test_trajectory_round_trip_property(
    tokens: list[int], logprobs: list[float], metadata: dict[str, str], payload: bytes, reward: float
) -> None:
    original = _trajectory(token_ids=tokens, logprobs=logprobs, loss_mask=[], metadata=metadata, payload=payload,
                           reward=reward)
    assert Trajectory.from_pb(pacer_pb2.Trajectory.FromString(original.to_pb().SerializeToString())) == original


def test_trajectory_status_is_required() -> None:
    with pytest.raises(TypeError):
        Trajectory(trajectory_id="t", prompt_id="p")  # type: ignore[call-arg]


def test_unknown_enum_number_is_kept_as_int() -> None:
    back = Trajectory.from_pb(pacer_pb2.Trajectory(trajectory_id="t", prompt_id="p", status=7))
    assert back.status == 7 and not isinstance(back.status, TrajectoryStatus)


def test_prompt_ref_optional_fields_keep_zero_apart_from_absent() -> None:
    zero = PromptRef("p", ds_index=2, epoch=0, index=0)
    absent = PromptRef("p")
    assert zero.to_pb().HasField("epoch") and not absent.to_pb().HasField("epoch")
    assert PromptRef.from_pb(pacer_pb2.PromptRef.FromString(zero.to_pb().SerializeToString())) == zero
    assert PromptRef.from_pb(pacer_pb2.PromptRef.FromString(absent.to_pb().SerializeToString())) == absent
    assert PromptRef.of("q") == PromptRef("q", 0, None, None)
    with pytest.raises(TypeError):
        PromptRef.of(3)  # type: ignore[arg-type]


def test_trajectory_group_round_trips() -> None:
    group = TrajectoryGroup("epoch0_p0", seq=7, ds_index=1, epoch=0, index=None,
                            trajectories=[_trajectory(), _trajectory(trajectory_id="t1", payload=b"")])
    wire = group.to_pb().SerializeToString()
    assert TrajectoryGroup.from_pb(pacer_pb2.TrajectoryGroup.FromString(wire)) == group


# Each result type mirrors its response message: a field added to one and not the other fails here.
@pytest.mark.parametrize(
    ("cls", "message", "extra"),
    [
        (DispatchResult, pacer_pb2.DispatchResponse, {"seqs"}),
        (SubmitResult, pacer_pb2.SubmitResponse, set()),
        (CollectResult, pacer_pb2.CollectResponse, set()),
        (ResetResult, pacer_pb2.ResetResponse, set()),
        (ResumeResult, pacer_pb2.ResumeResponse, set()),
        (PacerState, pacer_pb2.GetStateResponse, set()),
        (ControlEvent, pacer_pb2.ControlEvent, set()),
        (Trajectory, pacer_pb2.Trajectory, set()),
        (TrajectoryGroup, pacer_pb2.TrajectoryGroup, set()),
        (PromptRef, pacer_pb2.PromptRef, set()),
    ],
)
def test_types_cover_every_message_field(cls: Any, message: Any, extra: set[str]) -> None:
    ours = {f.name for f in dataclasses.fields(cls)}
    assert ours == set(message.DESCRIPTOR.fields_by_name) | extra


def test_response_conversions() -> None:
    dispatch = DispatchResult.from_pb(
        pacer_pb2.DispatchResponse(
            admitted=[pacer_pb2.AdmittedPrompt(prompt_id="a", seq=4), pacer_pb2.AdmittedPrompt(prompt_id="b", seq=5)],
            step=2, weight_version=3, generation=1, running=6, buffered=1, capacity=8, remaining=1,
        )
    )
    assert (dispatch.admitted, dispatch.seqs, dispatch.capacity, dispatch.remaining) == (["a", "b"], [4, 5], 8, 1)
    state = PacerState.from_pb(pacer_pb2.GetStateResponse(strategy="windowed-fifo", window_size=96, consumed=3,
                                                          config_summary={"stale_steps": "0.5"}))
    assert (state.strategy, state.window_size, state.consumed) == ("windowed-fifo", 96, 3)
    assert state.config_summary == {"stale_steps": "0.5"} and type(state.config_summary) is dict
    reset = ResetResult.from_pb(pacer_pb2.ResetResponse(restored=[TrajectoryGroup("p", seq=1).to_pb()],
                                                        dropped_prompt_ids=["q"], pause_delay_seconds=1.5, paused=True))
    assert reset.restored == [TrajectoryGroup("p", seq=1)] and reset.dropped_prompt_ids == ["q"] and reset.paused
    event = ControlEvent.from_pb(pacer_pb2.ControlEvent(type=2, mode=1, weight_version=5, paused=True))
    assert (event.type, event.mode, event.weight_version) == (ControlEventType.PAUSE, ResetMode.ABORT, 5)


# --- google.rpc.Status decoding ----------------------------------------------------------------------


def _packed(*details: Any) -> list[any_pb2.Any]:
    packed = []
    for detail in details:
        item = any_pb2.Any()
        item.Pack(detail)
        packed.append(item)
    return packed


def _status_bytes(code: int, message: str, *details: Any) -> bytes:
    return status_pb2.Status(code=code, message=message, details=_packed(*details)).SerializeToString()


def test_status_decoder_reads_violations_reason_and_retry_delay() -> None:
    bad_request = error_details_pb2.BadRequest(
        field_violations=[
            error_details_pb2.BadRequest.FieldViolation(field="trajectories[0].status", description="must be set"),
            error_details_pb2.BadRequest.FieldViolation(field="trajectories[1].logprobs", description="length 3 != 4"),
        ]
    )
    info = error_details_pb2.ErrorInfo(reason="STALE_GENERATION", domain="coda.pacer.v1", metadata={"prompt_id": "p"})
    retry = error_details_pb2.RetryInfo(retry_delay=duration_pb2.Duration(seconds=2, nanos=500_000_000))
    debug = error_details_pb2.DebugInfo(detail="ignored")  # an unknown detail type is skipped
    status = decode_status(_status_bytes(9, "stale prompt", debug, bad_request, info, retry))
    assert status.code == 9 and status.message == "stale prompt"
    assert status.field_violations == (
        FieldViolation("trajectories[0].status", "must be set"),
        FieldViolation("trajectories[1].logprobs", "length 3 != 4"),
    )
    assert (status.reason, status.domain) == ("STALE_GENERATION", "coda.pacer.v1")
    assert dict(status.metadata) == {"prompt_id": "p"}
    assert status.retry_delay == pytest.approx(2.5)


def test_status_decoder_defaults_and_large_values() -> None:
    empty = decode_status(b"")
    assert (empty.code, empty.message, empty.field_violations, empty.reason, empty.retry_delay) == (0, "", (), "", None)
    retry = error_details_pb2.RetryInfo(retry_delay=duration_pb2.Duration(seconds=10**12, nanos=1))
    assert decode_status(_status_bytes(8, "", retry)).retry_delay == pytest.approx(10**12)
    negative = error_details_pb2.RetryInfo(retry_delay=duration_pb2.Duration(seconds=-1, nanos=-500_000_000))
    assert decode_status(_status_bytes(8, "", negative)).retry_delay == pytest.approx(-1.5)


@pytest.mark.parametrize("cut", [1, 3, 10])
def test_status_decoder_rejects_truncated_bytes(cut: int) -> None:
    data = _status_bytes(3, "a message long enough", error_details_pb2.ErrorInfo(reason="X"))
    with pytest.raises(ValueError):
        decode_status(data[:-cut])


# --- error translation -------------------------------------------------------------------------------


class FakeRpcError(grpc.RpcError):
    """What a sync call raises: code(), details() and trailing_metadata()."""

    def __init__(self, code: grpc.StatusCode, details: str = "", trailing: tuple = ()) -> None:
        super().__init__()
        self._code, self._details, self._trailing = code, details, trailing

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details

    def trailing_metadata(self) -> tuple:
        return self._trailing


@pytest.mark.parametrize(
    ("code", "expected"),
    [
        (grpc.StatusCode.INVALID_ARGUMENT, BadRequestError),
        (grpc.StatusCode.NOT_FOUND, UnknownPromptError),
        (grpc.StatusCode.FAILED_PRECONDITION, FailedPreconditionError),
        (grpc.StatusCode.RESOURCE_EXHAUSTED, ResourceExhaustedError),
        (grpc.StatusCode.UNAUTHENTICATED, UnauthenticatedError),
        (grpc.StatusCode.UNAVAILABLE, UnavailableError),
        (grpc.StatusCode.DEADLINE_EXCEEDED, DeadlineExceededError),
        (grpc.StatusCode.INTERNAL, PacerClientError),
    ],
)
def test_translate_by_code(code: grpc.StatusCode, expected: type) -> None:
    error = translate(FakeRpcError(code, "message"))
    assert type(error) is expected
    assert (error.code, error.details, error.field_violations, error.retry_delay) == (code, "message", (), None)


def test_translate_stale_generation_by_reason() -> None:
    info = error_details_pb2.ErrorInfo(reason="STALE_GENERATION", domain="coda.pacer.v1")
    trailer = (("grpc-status-details-bin", _status_bytes(9, "stale", info)),)
    error = translate(FakeRpcError(grpc.StatusCode.FAILED_PRECONDITION, "stale", trailer))
    assert type(error) is StaleGenerationError and isinstance(error, FailedPreconditionError)
    assert (error.reason, error.domain) == ("STALE_GENERATION", "coda.pacer.v1")
    other = error_details_pb2.ErrorInfo(reason="RESET_IN_PROGRESS", domain="coda.pacer.v1")
    trailer = (("grpc-status-details-bin", _status_bytes(9, "busy", other)),)
    busy = translate(FakeRpcError(grpc.StatusCode.FAILED_PRECONDITION, "busy", trailer))
    assert type(busy) is FailedPreconditionError


def test_translate_unknown_lease_by_reason() -> None:
    info = error_details_pb2.ErrorInfo(reason="UNKNOWN_LEASE", domain="coda.pacer.v1")
    trailer = (("grpc-status-details-bin", _status_bytes(5, "lease 'x' is not known", info)),)
    error = translate(FakeRpcError(grpc.StatusCode.NOT_FOUND, "lease 'x' is not known", trailer))
    assert type(error) is coda_client.UnknownLeaseError and isinstance(error, UnknownPromptError)
    info = error_details_pb2.ErrorInfo(reason="UNKNOWN_PROMPT", domain="coda.pacer.v1")
    trailer = (("grpc-status-details-bin", _status_bytes(5, "prompt 'p' was never dispatched", info)),)
    assert type(translate(FakeRpcError(grpc.StatusCode.NOT_FOUND, "prompt", trailer))) is UnknownPromptError


@pytest.mark.parametrize(("code", "said"), [
    (grpc.StatusCode.UNAVAILABLE, "cannot reach the pacer at 10.0.0.5:50051: failed to connect"),
    (grpc.StatusCode.DEADLINE_EXCEEDED, "no answer in time from the pacer at 10.0.0.5:50051: failed to connect"),
])
def test_translate_names_the_target_of_an_error_the_server_did_not_send(code: grpc.StatusCode, said: str) -> None:
    assert translate(FakeRpcError(code, "failed to connect"), "10.0.0.5:50051").details == said
    assert translate(FakeRpcError(code, "failed to connect")).details == "failed to connect"  # no target given
    info = error_details_pb2.ErrorInfo(reason="SHUTTING_DOWN", domain="coda.pacer.v1")
    trailer = (("grpc-status-details-bin", _status_bytes(code.value[0], "draining", info)),)
    assert translate(FakeRpcError(code, "draining", trailer), "10.0.0.5:50051").details == "draining"  # the server's


def test_a_client_that_waits_for_ready_says_that_no_server_may_ever_have_been_there() -> None:
    """A wait_for_ready call to an address where nothing listens waits out its deadline: "no answer in time" alone
    read as a slow server."""
    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{probe.getsockname()[1]}"
    with coda_client.PacerClient(address, timeout=0.5, wait_for_ready=True) as pacer:
        with pytest.raises(coda_client.DeadlineExceededError) as waited:
            pacer.state()
    assert (f"no answer in time from the pacer at {address} (or no server reachable there all along: the call waited "
            f"for one, wait_for_ready=True)") in str(waited.value)


def test_translate_bad_request_and_retry_delay() -> None:
    violation = error_details_pb2.BadRequest.FieldViolation(field="candidates[1].prompt_id", description="named twice")
    bad_request = error_details_pb2.BadRequest(field_violations=[violation])
    trailer = (
        ("some-other-key", "x"),
        ("grpc-status-details-bin", _status_bytes(3, "bad", bad_request)),
    )
    error = translate(FakeRpcError(grpc.StatusCode.INVALID_ARGUMENT, "bad", trailer))
    assert error.field_violations == (FieldViolation("candidates[1].prompt_id", "named twice"),)
    assert "candidates[1].prompt_id: named twice" in str(error)
    retry = error_details_pb2.RetryInfo(retry_delay=duration_pb2.Duration(nanos=250_000_000))
    trailer = (("grpc-status-details-bin", _status_bytes(8, "full", retry)),)
    assert translate(FakeRpcError(grpc.StatusCode.RESOURCE_EXHAUSTED, "full", trailer)).retry_delay == 0.25


def test_translate_survives_garbled_details() -> None:
    trailer = (("grpc-status-details-bin", b"\x1a\xff\xff"),)
    error = translate(FakeRpcError(grpc.StatusCode.NOT_FOUND, "nope", trailer))
    assert type(error) is UnknownPromptError and error.details == "nope" and error.reason == ""


def test_translate_aio_error_uses_status_message_when_details_empty() -> None:
    info = error_details_pb2.ErrorInfo(reason="STALE_GENERATION", domain="coda.pacer.v1")
    trailing = grpc.aio.Metadata(("grpc-status-details-bin", _status_bytes(9, "from status", info)))
    error = translate(grpc.aio.AioRpcError(grpc.StatusCode.FAILED_PRECONDITION, grpc.aio.Metadata(), trailing, None))
    assert type(error) is StaleGenerationError and error.details == "from status"


# --- channel configuration ---------------------------------------------------------------------------


def _service_config(options: list[tuple[str, Any]]) -> dict[str, Any]:
    return json.loads(dict(options)["grpc.service_config"])


def test_service_config_retries_only_unavailable_on_every_method() -> None:
    config = _service_config(_channel.channel_options())
    named = [(n["service"], n["method"]) for entry in config["methodConfig"] for n in entry["name"]]
    service = pacer_pb2.DESCRIPTOR.services_by_name["RolloutPacer"]
    assert sorted(named) == sorted((service.full_name, m.name) for m in service.methods)  # each method once
    waiting = _service_config(_channel.channel_options(wait_for_ready=True))
    assert all(entry["waitForReady"] is True for entry in waiting["methodConfig"])
    for entry in config["methodConfig"]:
        assert entry["waitForReady"] is False  # fail fast where nothing listens, unless asked to wait
        assert entry["retryPolicy"] == {
            "maxAttempts": 5,
            "initialBackoff": "0.1s",
            "maxBackoff": "2s",
            "backoffMultiplier": 2,
            "retryableStatusCodes": ["UNAVAILABLE"],
        }
    assert config["retryThrottling"] == {"maxTokens": 10, "tokenRatio": 0.1}
    # Each call's own deadline bounds it: a method config timeout under about 2 s ends calls at once in gRPC Python.
    assert not [entry["timeout"] for entry in config["methodConfig"] if "timeout" in entry]


def test_channel_options_message_limits_and_overrides() -> None:
    defaults = dict(_channel.channel_options())
    assert defaults["grpc.max_send_message_length"] == defaults["grpc.max_receive_message_length"] == 64 * 2**20
    assert defaults["grpc.enable_retries"] == 1
    custom = dict(_channel.channel_options(max_message_bytes=2**20, options={"grpc.keepalive_time_ms": 60_000}))
    assert custom["grpc.max_receive_message_length"] == 2**20 and custom["grpc.keepalive_time_ms"] == 60_000
    client = coda_client.PacerClient("127.0.0.1:1", options=[("grpc.max_send_message_length", 5)])
    assert dict(client._options)["grpc.max_send_message_length"] == 5
    client.close()


def test_a_client_tries_a_server_that_is_away_again_well_within_the_worker_liveness() -> None:
    """gRPC's own back-off between connection attempts grows to 120 s: a worker could then find its restarted
    server only after the server had released its groups for silence (server.worker_liveness_seconds)."""
    from coda_server.core.settings import SCHEMA

    [liveness] = [key.default for key in SCHEMA if key.path == "server.worker_liveness_seconds"]
    options = dict(_channel.channel_options())
    assert options["grpc.max_reconnect_backoff_ms"] / 1000 <= liveness / 4
    assert options["grpc.initial_reconnect_backoff_ms"] <= options["grpc.max_reconnect_backoff_ms"]


@pytest.mark.parametrize("timeout, attempts", [(None, 5), (30.0, 5), (3.0, 5), (1.0, 3), (0.3, 2), (0.1, 1)])
def test_the_retries_of_an_unreachable_server_fit_in_half_the_clients_timeout(timeout, attempts) -> None:
    assert _channel.retry_attempts(timeout) == attempts
    longest_pauses = sum(min(0.1 * 2 ** i, 2.0) for i in range(attempts - 1))
    assert timeout is None or longest_pauses <= timeout / 2
    client = coda_client.PacerClient("127.0.0.1:50051", **({} if timeout is None else {"timeout": timeout}))
    policies = [entry.get("retryPolicy") for entry in _service_config(client._options)["methodConfig"]]
    client.close()
    # One attempt is no retry policy at all (gRPC refuses maxAttempts 1).
    assert {p["maxAttempts"] if p else 1 for p in policies} == {attempts}


def test_call_timeout_stretches_for_long_polls() -> None:
    assert _channel.call_timeout(30.0, 0.0) == 30.0
    assert _channel.call_timeout(30.0, 10.0) == 30.0
    assert _channel.call_timeout(30.0, 60.0) == 60.0 + _channel.WAIT_MARGIN_SECONDS
    assert _calls.collect(2, wait=100.0, allow_partial=False, request_id=None, timeout=30.0).timeout > 100.0
    assert _calls.get_state(timeout=7.0).timeout == 7.0


def test_bearer_token_metadata() -> None:
    assert _channel.call_metadata("s3cret") == (("authorization", "Bearer s3cret"),)
    assert _channel.call_metadata(None) == ()


def test_tls_pem_sources(tmp_path: Path) -> None:
    pem = b"-----BEGIN CERTIFICATE-----\nAAAA\n-----END CERTIFICATE-----\n"
    path = tmp_path / "ca.pem"
    path.write_bytes(pem)
    assert _channel._pem(pem) == pem
    assert _channel._pem(pem.decode()) == pem
    assert _channel._pem(str(path)) == pem and _channel._pem(path) == pem
    assert _channel.TlsConfig.of({"root_certificates": path}) == _channel.TlsConfig(root_certificates=path)
    assert _channel.resolve_tls(None) == (None, [])
    credentials, extra = _channel.resolve_tls(_channel.TlsConfig(root_certificates=pem, server_name="pacer"))
    assert isinstance(credentials, grpc.ChannelCredentials)
    assert extra == [("grpc.ssl_target_name_override", "pacer")]
    with pytest.raises(ValueError, match="both"):
        _channel.TlsConfig(certificate_chain=pem).credentials()
    with pytest.raises(TypeError):
        _channel.TlsConfig.of("yes")  # type: ignore[arg-type]


# --- request building --------------------------------------------------------------------------------


def test_mutating_calls_get_a_request_id() -> None:
    first = _calls.submit([_trajectory()], request_id=None, timeout=1.0).request.request_id
    second = _calls.submit([_trajectory()], request_id=None, timeout=1.0).request.request_id
    assert first != second and uuid.UUID(first)
    assert _calls.submit([], request_id="mine", timeout=1.0).request.request_id == "mine"
    assert _calls.submit([], request_id="", timeout=1.0).request.request_id == ""  # explicit: no de-duplication
    for call in (
        _calls.dispatch([], wait=0.0, request_id=None, timeout=1.0),
        _calls.collect(1, wait=0.0, allow_partial=False, request_id=None, timeout=1.0),
        _calls.reset(None, wait=0.0, resume=False, weight_version=0, request_id=None, timeout=1.0),
        _calls.resume(1, request_id=None, timeout=1.0),
    ):
        assert uuid.UUID(call.request.request_id)


def test_dispatch_request_from_ids_and_refs() -> None:
    call = _calls.dispatch(["a", PromptRef("b", ds_index=1, epoch=2, index=3)], wait=1.5, request_id="r", timeout=1.0)
    assert call.method == "Dispatch" and call.request.wait_seconds == 1.5
    assert [PromptRef.from_pb(c) for c in call.request.candidates] == [PromptRef("a"), PromptRef("b", 1, 2, 3)]
    with pytest.raises(TypeError, match="single string"):
        _calls.dispatch("abc", wait=0.0, request_id=None, timeout=1.0)


def test_reset_request_modes() -> None:
    def mode(value: Any) -> int:
        return _calls.reset(value, wait=0.0, resume=True, weight_version=4, request_id="r", timeout=1.0).request.mode

    assert (mode("abort"), mode("wait"), mode(None)) == (
        pacer_pb2.RESET_MODE_ABORT,
        pacer_pb2.RESET_MODE_WAIT,
        pacer_pb2.RESET_MODE_UNSPECIFIED,
    )
    with pytest.raises(ValueError):
        mode("later")


# --- clients without a server ------------------------------------------------------------------------


class FakeChannel:
    def __init__(self) -> None:
        self.closed = False

    def close(self) -> None:
        self.closed = True


class FakeStub:
    """Records each call; answers with a canned response or raises a canned error."""

    def __init__(self, response: Any = None, error: Exception | None = None) -> None:
        self.calls: list[tuple[str, Any, dict[str, Any]]] = []
        self.response, self.error = response, error

    def __getattr__(self, method: str) -> Any:
        def rpc(request: Any, **kwargs: Any) -> Any:
            self.calls.append((method, request, kwargs))
            if self.error is not None:
                raise self.error
            return self.response

        return rpc


def _with_stub(client: Any, stub: FakeStub) -> FakeChannel:
    channel = FakeChannel()
    client._channel, client._stub = channel, stub
    return channel


def test_sync_client_sends_deadline_and_token_and_translates_errors() -> None:
    client = coda_client.PacerClient("127.0.0.1:1", token="tok", timeout=10.0)
    stub = FakeStub(pacer_pb2.CollectResponse(groups=[TrajectoryGroup("p", 3).to_pb()], timed_out=False))
    channel = _with_stub(client, stub)
    assert client.collect(1, wait=120.0) == [TrajectoryGroup("p", 3)]
    method, request, kwargs = stub.calls[0]
    assert method == "Collect" and request.num_groups == 1 and request.wait_seconds == 120.0
    assert kwargs == {"timeout": 120.0 + _channel.WAIT_MARGIN_SECONDS, "metadata": (("authorization", "Bearer tok"),)}
    stub.error = FakeRpcError(grpc.StatusCode.NOT_FOUND, "never dispatched")
    with pytest.raises(UnknownPromptError, match="never dispatched") as info:
        client.submit([_trajectory()])
    assert isinstance(info.value.__cause__, grpc.RpcError)
    with client:
        pass
    assert channel.closed
    with pytest.raises(RuntimeError, match="closed"):
        client.state()


def test_async_client_sends_deadline_and_translates_errors() -> None:
    class AsyncStub(FakeStub):
        def __getattr__(self, method: str) -> Any:
            sync = super().__getattr__(method)

            async def rpc(request: Any, **kwargs: Any) -> Any:
                return sync(request, **kwargs)

            return rpc

    async def scenario() -> None:
        stub = AsyncStub(pacer_pb2.ResumeResponse(step=3, weight_version=9))
        async with coda_client.AsyncPacerClient("127.0.0.1:1", timeout=4.0) as client:
            client._channel, client._stub = None, stub
            assert await client.resume(9) == ResumeResult(step=3, weight_version=9)
            assert stub.calls[0][2] == {"timeout": 4.0, "metadata": ()}
            stub.error = FakeRpcError(grpc.StatusCode.UNAVAILABLE, "draining")
            with pytest.raises(UnavailableError):
                await client.dispatch(["a"])

    asyncio.run(scenario())


def test_fork_hook_makes_the_child_build_a_new_channel() -> None:
    client = coda_client.PacerClient("127.0.0.1:1")
    stub = client._stub_for_process()  # creating a channel does not connect
    assert client._stub_for_process() is stub
    inherited = client._channel
    try:
        client_module._after_fork_in_child()  # what os.register_at_fork runs in a child
        assert client._channel is None
        assert inherited in client_module._INHERITED_CHANNELS  # kept alive, not closed
        assert client._stub_for_process() is not stub
    finally:
        client_module._INHERITED_CHANNELS.remove(inherited)
        inherited.close()
        client.close()


# --- watch streams -----------------------------------------------------------------------------------


class FakeStreamCall:
    """A server-streaming call: yields events, then ends or fails; cancel() fails pending reads."""

    def __init__(self, events: list[Any], error: grpc.RpcError | None = None) -> None:
        self.events, self.error, self.cancelled = list(events), error, False

    def __next__(self) -> Any:
        if self.cancelled:
            raise FakeRpcError(grpc.StatusCode.CANCELLED, "Locally cancelled by application!")
        if self.events:
            return self.events.pop(0)
        if self.error is not None:
            raise self.error
        raise StopIteration

    async def read(self) -> Any:
        if self.cancelled:
            raise asyncio.CancelledError()
        try:
            return self.__next__()
        except StopIteration:
            return grpc.aio.EOF

    def cancel(self) -> None:
        self.cancelled = True


def _events() -> list[Any]:
    return [pacer_pb2.ControlEvent(type=1), pacer_pb2.ControlEvent(type=2, mode=2, paused=True)]


def test_control_stream_iterates_and_ends_on_cancel() -> None:
    stream = client_module.ControlStream(FakeStreamCall(_events() * 2))
    first = next(stream)
    assert first.type is ControlEventType.STATE
    stream.cancel()
    assert list(stream) == []


def test_control_stream_translates_server_errors() -> None:
    stream = client_module.ControlStream(FakeStreamCall(_events(), FakeRpcError(grpc.StatusCode.UNAUTHENTICATED)))
    seen = []
    with pytest.raises(UnauthenticatedError):
        for event in stream:
            seen.append(event.type)
    assert seen == [ControlEventType.STATE, ControlEventType.PAUSE]


def test_closing_the_client_ends_its_watch() -> None:
    client = coda_client.PacerClient("127.0.0.1:1")
    _with_stub(client, FakeStub(FakeStreamCall(_events() * 3)))  # WatchControl answers with this call
    stream = client.watch()
    assert next(stream).type is ControlEventType.STATE
    client.close()
    assert list(stream) == []


def test_async_control_stream() -> None:
    async def scenario() -> list[Any]:
        stream = client_module.AsyncControlStream(FakeStreamCall(_events()))
        got = [event.mode async for event in stream]
        cancelled = client_module.AsyncControlStream(FakeStreamCall(_events()))
        cancelled.cancel()
        assert [e async for e in cancelled] == []
        uncancelled = client_module.AsyncControlStream(FakeStreamCall(_events()))
        uncancelled._call.cancelled = True  # cancelled by someone else: the CancelledError propagates
        with pytest.raises(asyncio.CancelledError):
            await uncancelled.__anext__()
        return got

    assert asyncio.run(scenario()) == [ResetMode.UNSPECIFIED, ResetMode.WAIT]


# --- dependencies ------------------------------------------------------------------------------------


def test_client_imports_only_grpc_protobuf_and_stdlib() -> None:
    probe = textwrap.dedent(
        """
        import sys
        sys.path.insert(0, sys.argv[1])
        import coda_client
        forbidden = ("coda", "coda_server", "omegaconf", "yaml", "grpc_status", "google.rpc")
        loaded = sorted(m for m in sys.modules if any(m == f or m.startswith(f + ".") for f in forbidden))
        assert not loaded, loaded
        """
    )
    result = subprocess.run([sys.executable, "-c", probe, str(ROOT)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_public_api_is_exported() -> None:
    for name in ("PacerClient", "AsyncPacerClient", "Trajectory", "TrajectoryStatus", "TrajectoryGroup", "PromptRef",
                 "DispatchResult", "SubmitResult", "ResetResult", "ResumeResult", "PacerState", "ControlEvent",
                 "ResetMode", "PacerClientError", "BadRequestError", "UnknownPromptError", "StaleGenerationError",
                 "FailedPreconditionError", "ResourceExhaustedError", "UnauthenticatedError", "UnavailableError"):
        assert name in coda_client.__all__ and hasattr(coda_client, name), name


def test_a_worker_kit_name_imported_from_the_client_says_where_it_is() -> None:
    import coda_worker
    from coda_worker.engines import _ADAPTERS

    # Every public name of the kit, and only those, gets the hint (the list in coda_client must follow the kit's).
    assert coda_client._IN_THE_WORKER_KIT == set(coda_worker.__all__) | set(_ADAPTERS)
    for name in ("RolloutWorker", "VLLMEngine"):
        with pytest.raises(ImportError, match=f"from coda_worker import {name}"):
            exec(f"from coda_client import {name}", {})
    assert not hasattr(coda_client, "NoSuchName")  # any other missing name stays a plain AttributeError


class _StuckStream(grpc.RpcError):
    """A streamed call as gRPC's iterator leaves it in grpc/grpc#20562: the call ended with UNAVAILABLE (its done
    callbacks ran) while a read it had started never completes."""

    def __init__(self) -> None:
        self.released = threading.Event()

    def __iter__(self):
        self.released.wait()  # the stuck read: returns only when the test ends
        return iter(())

    def add_done_callback(self, callback) -> None:
        callback(self)

    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.UNAVAILABLE


class _EndedStream(grpc.RpcError):
    def __init__(self, messages, code=grpc.StatusCode.OK, error=None) -> None:
        self.messages, self._code, self.error = messages, code, error

    def __iter__(self):
        if self.error is not None:
            raise self.error
        return iter(self.messages)

    def add_done_callback(self, callback) -> None:
        callback(self)

    def code(self) -> grpc.StatusCode:
        return self._code


def test_read_stream_raises_the_calls_error_when_grpcs_read_never_completes(monkeypatch) -> None:
    monkeypatch.setattr(_channel, "STREAM_END_GRACE_SECONDS", 0.05)
    stuck = _StuckStream()
    try:
        with pytest.raises(grpc.RpcError) as caught:
            _channel.read_stream(stuck)
        assert caught.value is stuck  # the call itself: the RpcError with the status it ended with
    finally:
        stuck.released.set()


def test_read_stream_returns_every_message_or_the_reads_own_error() -> None:
    assert _channel.read_stream(_EndedStream(["a", "b"])) == ["a", "b"]
    failure = grpc.RpcError("cut")
    with pytest.raises(grpc.RpcError) as caught:
        _channel.read_stream(_EndedStream([], grpc.StatusCode.CANCELLED, failure))
    assert caught.value is failure


@pytest.mark.parametrize("target", ["127.0.0.1:99999", "127.0.0.1:0", "localhost:abc", ":50051", "", "127.0.0.1:-5"])
def test_a_target_grpc_would_dial_elsewhere_or_never_is_refused_at_construction(target: str) -> None:
    # gRPC dials 127.0.0.1:99999 as 34463 (modulo 65536); port 0 and a port that is no number fail only at a call.
    for client_class in (coda_client.PacerClient, coda_client.AsyncPacerClient):
        with pytest.raises(ValueError, match=r"host:port.*e\.g\. 127\.0\.0\.1:50051"):
            client_class(target)


@pytest.mark.parametrize("target, tls", [("127.0.0.1:50051", None), ("pacer.example.com", True), ("[::1]:50051", None),
                                         ("dns:///pacer.svc:50051", None), ("unix:/tmp/pacer.sock", None),
                                         ("ipv4:127.0.0.1:50051", None)])
def test_targets_in_grpcs_own_forms_are_taken_as_they_are(target: str, tls) -> None:
    """A name without a port is gRPC's port 443: taken over TLS (a load balancer's name), refused in plaintext (below)."""
    client = coda_client.PacerClient(target, tls=tls)
    assert client.target == target
    client.close()


@pytest.mark.parametrize("target, says", [
    ("http://127.0.0.1:50051", "is a URL; a gRPC target is host:port without a scheme, here '127.0.0.1:50051'"),
    ("grpc://pacer:50051/", "is a URL; a gRPC target is host:port without a scheme, here 'pacer:50051'"),
    ("localhost", "has no port: without TLS gRPC would dial port 443, its default for TLS; give host:port, "
                  "e.g. localhost:50051"),
    (" 127.0.0.1:50051", "holds white space"),
])
def test_an_address_no_call_could_reach_is_refused_when_the_client_is_made(target: str, says: str) -> None:
    """A URL or a name with a leading space failed only at the first call, as UNAVAILABLE "cannot reach the pacer"
    (a resolver error), as if the server were down; a plaintext name without a port dialled 443."""
    for client_class in (coda_client.PacerClient, coda_client.AsyncPacerClient):
        with pytest.raises(ValueError, match=re.escape(says)):
            client_class(target)
    with pytest.raises(ValueError, match=re.escape(says)):
        client_cli.probe_health(target, "readiness", 1.0, io.StringIO())


@pytest.mark.parametrize("field, value, error, takes", [
    ("reward", "1.0", TypeError, "a float"),
    ("trajectory_id", 5, TypeError, "a str"),
    ("ds_index", 1.5, TypeError, "an int >= 0"),
    ("num_turns", -1, ValueError, "an int >= 0"),
    ("metadata", {"a": 1}, TypeError, "a dict of str to str"),
])
def test_a_scalar_field_protobuf_refuses_is_named_with_what_it_takes(field: str, value: Any, error: type,
                                                                    takes: str) -> None:
    fields = {"trajectory_id": "t", "prompt_id": "p", "status": coda_client.TrajectoryStatus.COMPLETED, field: value}
    with pytest.raises(error, match=rf"^Trajectory\.{field} = {re.escape(repr(value))} \({type(value).__name__}\) "
                                    rf"is not allowed: it takes {takes}"):
        coda_client.Trajectory(**fields).encoded_parts()


def test_an_outage_is_one_warning_debug_lines_between_and_one_info_line_at_its_end(caplog):
    """A worker id or an address may hold braces or percent signs: the texts are put in by replacement."""
    from coda_client._outage import OutageLog

    logger = logging.getLogger("coda_client.outage_test")
    caplog.set_level(logging.DEBUG, logger=logger.name)
    outage = OutageLog(logger, began="w{0}%s: away: {reason}", attempt="w{0}%s: still: {reason}",
                       back="w{0}%s: back after {seconds} s", extra={"fields": {"worker": "w{0}%s"}})
    outage.answered()  # no outage: nothing to say
    outage.failed("refused")
    outage.failed("refused again")
    outage.answered()
    outage.answered()
    assert [(r.levelno, r.getMessage()) for r in caplog.records] == [
        (logging.WARNING, "w{0}%s: away: refused"), (logging.DEBUG, "w{0}%s: still: refused again"),
        (logging.INFO, caplog.records[-1].getMessage())]
    assert re.fullmatch(r"w\{0\}%s: back after \d+\.\d s", caplog.records[-1].getMessage())
    assert caplog.records[0].fields == {"worker": "w{0}%s"}


@pytest.mark.parametrize("field, value, named", [("prompt_id", 5, "Trajectory.prompt_id = 5"),
                                                 ("metadata", {"a": 1}, "Trajectory.metadata"),
                                                 ("payload", "text", "Trajectory.payload")])
def test_a_submitted_field_of_the_wrong_type_is_named_before_the_size_check(field, value, named) -> None:
    """The size estimate (len() of the strings and arrays) ran first and failed with a bare "object of type 'int' has
    no len()", naming no field; the encoding's error names it."""
    from coda_client import Trajectory, TrajectoryStatus, _calls

    fields = {**dict(trajectory_id="c0#0", prompt_id="c0", status=TrajectoryStatus.COMPLETED, token_ids=[1],
                     logprobs=[-0.1]), field: value}
    with pytest.raises(TypeError, match=re.escape(named)):
        _calls.submit([Trajectory(**fields)], request_id=None, timeout=1, max_message_bytes=1 << 20)
