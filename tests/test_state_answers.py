"""GetState's answer is encoded again only when the state changed (convert.StateAnswers): a repeated answer is
the same bytes, and every change in between shows in the next answer."""
from __future__ import annotations

from coda_client._proto import pacer_pb2 as pb
from coda_server import convert
from coda_server.core.state import PacerState
from coda_server.core.types import PromptRef
from server_harness import ServerProcess


def test_an_unchanged_state_is_answered_with_the_bytes_already_encoded_and_a_changed_one_anew(core_pacer):
    answers = convert.StateAnswers()
    pacer = core_pacer()
    fields = {**pacer.state_fields(), "running": 2}
    first = answers.answer(fields)
    assert pb.GetStateResponse.FromString(first.SerializeToString()).running == 2
    assert answers.answer(dict(fields)) is first  # equal, though another object: not encoded again
    changed = answers.answer({**fields, "running": 3})
    assert changed is not first
    assert pb.GetStateResponse.FromString(changed.SerializeToString()).running == 3
    assert answers.answer({**fields, "running": 3, "recent_incidents": []}) is changed


def test_state_fields_are_the_state_and_compare_equal_until_something_changes(core_pacer):
    pacer = core_pacer()
    fields = pacer.state_fields()
    assert PacerState(**fields) == pacer.state()
    assert pacer.state_fields() == fields
    pacer.dispatch([PromptRef("p0")])
    changed = pacer.state_fields()
    assert changed != fields
    assert (changed["running"], changed["dispatched"]) == (1, 1)


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
