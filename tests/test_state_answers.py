"""GetState's answer is encoded again only when the state changed (convert.StateAnswers): a repeated answer is
the same bytes, and every change in between shows in the next answer."""
from __future__ import annotations

import dataclasses

import pytest

from coda_client._proto import pacer_pb2 as pb
from coda_server import convert
from coda_server.core.state import StateReader
from coda_server.core.types import PromptRef
from server_harness import ServerProcess


def test_an_unchanged_state_is_answered_with_the_bytes_already_encoded_and_a_changed_one_anew(core_pacer):
    answers = convert.StateAnswers()
    pacer = core_pacer()
    made = []

    def state_of(reading):  # the running count is the reading's second field
        made.append(reading)
        return dataclasses.replace(pacer.state_of(reading), running=reading[1])

    reading = pacer.read_state()
    first = answers.answer((0, 2, *reading[2:]), state_of)
    assert pb.GetStateResponse.FromString(first.SerializeToString()).running == 2
    assert answers.answer((0, 2, *reading[2:]), state_of) is first  # equal, though another object: not encoded again
    changed = answers.answer((0, 3, *reading[2:]), state_of)
    assert changed is not first and len(made) == 2
    assert pb.GetStateResponse.FromString(changed.SerializeToString()).running == 3
    assert answers.answer((0, 3, *reading[2:]), state_of) is changed


def test_a_reading_is_the_state_and_readings_compare_equal_until_something_changes(core_pacer):
    pacer = core_pacer()
    reading = pacer.read_state()
    assert pacer.state_of(reading) == pacer.state()
    assert pacer.read_state() == reading
    pacer.dispatch([PromptRef("p0")])
    changed = pacer.read_state()
    assert changed != reading
    assert (pacer.state_of(changed).running, pacer.state_of(changed).dispatched) == (1, 1)
    assert pacer.state_of(pacer.read_state(waiting_calls=3)).waiting_calls == 3


def test_getstate_over_grpc_shows_each_change_made_between_two_calls(tmp_path):
    with ServerProcess(tmp_path, "data_source.num_prompts_per_step=4", "data_source.num_trajectories_per_prompt=2",
                       "trainer.mini_batch_size=4",
                       "fully_async.sliding_window=windowed-fifo", "server.state_dir=") as server:
        stub = server.stub()
        before = stub.GetState(pb.GetStateRequest(), timeout=20)
        assert stub.GetState(pb.GetStateRequest(), timeout=20) == before
        admitted = stub.Dispatch(pb.DispatchRequest(candidates=[pb.PromptRef(prompt_id="p0")]), timeout=20).admitted
        assert len(admitted) == 1
        after = stub.GetState(pb.GetStateRequest(), timeout=20)
        assert (before.running, after.running) == (0, 1)
        assert after.capacity == before.capacity - 1
        assert after.strategy == before.strategy and after.config_summary == before.config_summary


def test_a_reader_that_would_leave_a_field_of_the_state_unread_is_refused_when_built(core_pacer):
    pacer = core_pacer()
    owners = (pacer.lock, pacer.steps, pacer.checkpoints, pacer.inflight, pacer.buffer, pacer.admission, pacer.leases,
              pacer.held_bytes, pacer.restored, pacer.incidents, pacer.totals, pacer.lifecycle, pacer.recorder)
    fixed = {name: getattr(pacer.state(), name) for name in ("window_size", "strategy", "config_summary", "stale_steps",
                                                             "collect_limit", "prompts_per_step", "group_sizes")}
    with pytest.raises(RuntimeError, match="mini_batch_size"):
        StateReader(*owners, fixed)
    assert StateReader(*owners, {**fixed, "mini_batch_size": 4}).read() == pacer.read_state()
