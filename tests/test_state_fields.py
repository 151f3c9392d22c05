"""PacerState's field list is declared once (coda_server/core/state.py): the proto, GetState's conversion,
the metrics and the client's PacerState must all agree with that declaration."""
from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest
from google.protobuf.descriptor import FieldDescriptor

from coda_client._proto import pacer_pb2 as pb
from coda_client.types import PacerState as ClientState
from coda_server.core.state import COUNTER, GAUGE, STATE_FIELD_NAMES, reported_fields

ROOT = Path(__file__).resolve().parents[1]
# proto scalar type -> the declaration's annotation
PROTO_TYPES = {FieldDescriptor.TYPE_UINT64: "int", FieldDescriptor.TYPE_INT64: "int",
               FieldDescriptor.TYPE_BOOL: "bool", FieldDescriptor.TYPE_STRING: "str", FieldDescriptor.TYPE_DOUBLE: "float"}


def proto_fields() -> list[tuple[str, str]]:
    fields = []
    for f in pb.GetStateResponse.DESCRIPTOR.fields:
        if f.message_type is not None and f.message_type.GetOptions().map_entry:
            kind = "Mapping[str, str]"
        elif f.message_type is not None:
            kind = f"list[{f.message_type.name}]"
        else:
            kind = PROTO_TYPES.get(f.type, f"proto type {f.type}")
            if f.is_repeated:
                kind = f"list[{kind}]"
        fields.append((f.name, kind))
    return fields


def test_the_proto_and_the_declaration_have_the_same_fields_in_the_same_order_and_types():
    declared = [(f.name, f.type) for f, _ in reported_fields()]
    assert proto_fields() == declared, ("proto/coda/pacer/v1/pacer.proto GetStateResponse and "
                                        "coda_server/core/state.py PacerState disagree")


def test_the_clients_pacer_state_is_what_the_generator_writes_from_the_declaration():
    sys.path.insert(0, str(ROOT / "scripts"))
    import gen_proto

    committed = gen_proto.CLIENT_TYPES.read_text(encoding="utf-8")
    assert gen_proto.with_client_state_fields(committed) == committed, \
        "coda_client/types.py PacerState is stale; run: python scripts/gen_proto.py"
    assert tuple(f.name for f in dataclasses.fields(ClientState)) == STATE_FIELD_NAMES


def test_every_gauge_and_counter_has_a_metric_and_the_getstate_conversion_sends_every_field():
    from coda_server import convert
    from coda_server.observability import PACER_METRICS

    metrics = {name for name, _, _, _ in PACER_METRICS}
    assert metrics == {f.name for f, how in reported_fields() if how.kind in (GAUGE, COUNTER)}
    assert all(metric.startswith("coda_pacer_") for _, metric, _, _ in PACER_METRICS)
    sent = set(convert.STATE_FIELDS) | {"config_summary", "recent_reports", "recent_incidents"}
    assert sent == set(STATE_FIELD_NAMES)


def test_getstate_carries_the_pacing_terms_typed_and_the_client_reads_them(tmp_path):
    from coda_client import PacerClient
    from server_harness import ServerProcess

    config = tmp_path / "two.yaml"
    config.write_text("data_source: {num_prompts_per_step: 6}\ntrainer: {mini_batch_size: 12}\n"
                      "fully_async: {stale_steps: 0.5}\n"
                      "data_sources: ['${data_source}', {num_trajectories_per_prompt: 4}]\n")
    with ServerProcess(tmp_path, config_file=config) as server, PacerClient(server.address, timeout=10) as client:
        state = client.state()
        assert (state.prompts_per_step, state.group_sizes, state.stale_steps, state.mini_batch_size) == (
            6, [8, 4], 0.5, 12)
        assert state.window_size == 9  # C = int(6 * 1.5)
        # The mini-batch needs one group size; two data sources differ: the client says so from the typed field.
        with pytest.raises(ValueError, match=r"different group sizes \(\[8, 4\]\)"):
            client.batches(mini_batch_size=16)
