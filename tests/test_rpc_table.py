"""The table of RPCs (coda_client/protocol.py) against the proto's service and every layer it drives: an RPC
declared in pacer.proto but missing from the table, or half-registered, fails here."""
from __future__ import annotations

import json

from coda_client import _calls, _channel
from coda_client._proto import pacer_pb2
from coda_client.protocol import RPC_BY_NAME, RPCS, SERVICE, method_path, remembered_methods
from coda_server import admission, wire
from coda_server.core.answers import AnswerBook
from coda_server.core.config import load_config
from coda_server.core.limits import Limits
from coda_server.service import RolloutPacerServicer

SERVICE_DESCRIPTOR = pacer_pb2.DESCRIPTOR.services_by_name["RolloutPacer"]


def test_every_rpc_of_the_proto_service_has_one_row_and_every_row_an_rpc():
    assert SERVICE_DESCRIPTOR.full_name == SERVICE
    in_proto = [method.name for method in SERVICE_DESCRIPTOR.methods]
    in_table = [rpc.name for rpc in RPCS]
    assert sorted(in_proto) == sorted(in_table), "add a row to coda_client/protocol.py RPCS for each RPC"
    assert len(set(in_table)) == len(in_table)


def test_each_row_agrees_with_the_proto_messages():
    for method in SERVICE_DESCRIPTOR.methods:
        rpc = RPC_BY_NAME[method.name]
        request_fields = method.input_type.fields_by_name
        assert rpc.streaming == method.server_streaming, method.name
        assert rpc.long_poll == ("wait_seconds" in request_fields), f"{method.name}: long_poll iff wait_seconds"
        if rpc.remembered is not None:
            assert "request_id" in request_fields, f"{method.name}: a remembered answer needs a request_id"
            assert rpc.mutating, f"{method.name}: only a change needs its answer remembered"
        if rpc.mutating and "request_id" not in request_fields:
            assert method.name == "KeepAlive", f"{method.name} changes state without a request_id to de-duplicate"
        assert rpc.request_form in ("message", *wire.PassthroughCodec.REQUEST_DESERIALIZERS), method.name
        assert rpc.response_form in ("message", *wire.PassthroughCodec.RESPONSE_SERIALIZERS), method.name
        if rpc.response_form == "views":
            assert any(field.message_type is not None and field.message_type.name == "TrajectoryGroup"
                       for field in method.output_type.fields), f"{method.name}: views answers carry groups"


def test_the_servicer_and_the_client_implement_every_rpc():
    for rpc in RPCS:
        handler = getattr(RolloutPacerServicer, rpc.name, None)
        assert handler is not None and getattr(handler, "maps_errors", False), f"servicer lacks {rpc.name}"
    source = open(_calls.__file__).read()
    missing = [rpc.name for rpc in RPCS if not rpc.streaming and f'Call("{rpc.name}"' not in source]
    assert not missing, f"coda_client/_calls.py builds no call for {missing}"


def test_the_client_channel_configures_every_rpc_and_retries_exactly_the_retry_safe_ones():
    config = json.loads(dict(_channel.channel_options())["grpc.service_config"])
    retried, configured = set(), set()
    for entry in config["methodConfig"]:
        for name in entry["name"]:
            assert name["service"] == SERVICE
            configured.add(name["method"])
            if "retryPolicy" in entry:
                retried.add(name["method"])
    assert configured == {rpc.name for rpc in RPCS}
    assert retried == {rpc.name for rpc in RPCS if rpc.retry_safe}


def test_admission_and_rate_limits_come_from_the_table():
    limits = admission.call_limits(load_config(load_plugins=False).server)
    for rpc in RPCS:
        kinds = admission.CALL_KINDS.get(method_path(rpc.name), (None, None))
        assert kinds == rpc.admission, rpc.name
        assert all(kind is None or kind in limits for kind in kinds), rpc.name
        if rpc.rate_limit_key is not None:
            assert admission.RATE_LIMITED[method_path(rpc.name)] == rpc.rate_limit_key
            assert rpc.rate_limit_key in load_config(load_plugins=False).server.client_rate_limits


def test_the_answer_book_keeps_a_book_for_each_remembered_rpc():
    import threading

    book = AnswerBook(Limits.shipped(), threading.RLock(), lambda request_id: None)
    assert set(book.export()) == {rpc.name for rpc in RPCS if rpc.remembered is not None}
    assert remembered_methods() == {"Dispatch": False, "Submit": False, "Collect": True, "Ack": False, "Release": False,
                                    "Reset": True, "Resume": False, "Restore": False, "EndJob": False}


def test_core_and_client_dispatch_records_answer_to_the_same_names():
    from coda_client import wire_forms
    from coda_client.types import DispatchResult as ClientResult
    from coda_server import convert
    from coda_server.core.types import DispatchResult as CoreResult

    core = CoreResult(["p0", "p1", "p2"], 7, paused=False, step=1, weight_version=2, generation=3, running=3,
                      buffered=0, capacity=8, remaining=5)
    client = ClientResult.from_pb(pacer_pb2.DispatchResponse.FromString(
        wire_forms.serialize(convert.dispatch_response(core))))
    for name in ("admitted_ids", "first_seq", "seqs", "continued", "continuations", "capacity", "remaining"):
        assert getattr(client, name) == getattr(core, name), name
    assert (client.admitted_ids, client.first_seq, client.seqs) == (["p0", "p1", "p2"], 7, [7, 8, 9])
