"""Every status code of the architecture's table, provoked over real gRPC against a server subprocess."""
from __future__ import annotations


import grpc
import pytest

from coda_client._proto import pacer_pb2 as pb
from server_harness import ServerProcess, refusal_of

SMALL = ("data_source.num_prompts_per_step=2", "data_source.num_trajectories_per_prompt=2",
         "trainer.mini_batch_size=2", "fully_async.sliding_window=no-window", "fully_async.stale_steps=1.0")


@pytest.fixture
def server(tmp_path):
    with ServerProcess(tmp_path, *SMALL) as process:
        yield process


def details_of(error: grpc.RpcError):
    """(ErrorInfo reason, [(field, description)]) from the rich status details."""
    refused = refusal_of(error)
    assert refused.rich, "the server must send google.rpc.Status details"
    return refused.reason or None, refused.violations


def trajectories(prompt_id: str, count: int, start: int = 0, status=pb.TRAJECTORY_STATUS_COMPLETED):
    return [pb.Trajectory(trajectory_id=f"{prompt_id}-t{i}", prompt_id=prompt_id, status=status, reward=float(i))
            for i in range(start, start + count)]


def dispatch(stub, *prompt_ids, **kwargs):
    return stub.Dispatch(pb.DispatchRequest(candidates=[pb.PromptRef(prompt_id=p) for p in prompt_ids], **kwargs))


def test_fresh_server_starts_at_step_zero_and_peek_admits_nothing(server):
    stub = server.stub()
    state = stub.GetState(pb.GetStateRequest())
    assert (state.step, state.weight_version, state.paused, state.window_size) == (0, 0, False, 4)
    peek = stub.Dispatch(pb.DispatchRequest())
    assert list(peek.admitted) == [] and peek.remaining == 4 and peek.capacity == 4


def test_malformed_dispatch_is_invalid_argument_with_field_violations(server):
    stub = server.stub()
    with pytest.raises(grpc.RpcError) as caught:
        stub.Dispatch(pb.DispatchRequest(candidates=[pb.PromptRef(prompt_id="ok"), pb.PromptRef(prompt_id=""),
                                                     pb.PromptRef(prompt_id="x", ds_index=7)]))
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    reason, violations = details_of(caught.value)
    assert reason == "INVALID_ARGUMENT"
    fields = [field for field, _ in violations]
    assert fields == ["candidates[1].prompt_id", "candidates[2].ds_index"]
    assert "allowed: 0..0" in violations[1][1]
    assert stub.GetState(pb.GetStateRequest()).dispatched == 0  # nothing half-applied


def test_mismatched_array_lengths_are_refused(server):
    stub = server.stub()
    dispatch(stub, "p")
    bad = pb.Trajectory(trajectory_id="t", prompt_id="p", status=pb.TRAJECTORY_STATUS_COMPLETED,
                        token_ids=[1, 2, 3], logprobs=[0.1, 0.2])
    with pytest.raises(grpc.RpcError) as caught:
        stub.Submit(pb.SubmitRequest(trajectories=[bad]))
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "equal lengths" in details_of(caught.value)[1][0][1]
    assert stub.GetState(pb.GetStateRequest()).submitted == 0


def test_unspecified_status_and_duplicate_with_different_content(server):
    stub = server.stub()
    dispatch(stub, "p")
    with pytest.raises(grpc.RpcError) as caught:
        stub.Submit(pb.SubmitRequest(trajectories=[pb.Trajectory(trajectory_id="t", prompt_id="p")]))
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    stub.Submit(pb.SubmitRequest(trajectories=trajectories("p", 1)))
    changed = trajectories("p", 1)[0]
    changed.reward = 42.0
    with pytest.raises(grpc.RpcError) as caught:
        stub.Submit(pb.SubmitRequest(trajectories=[changed]))
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "different content" in caught.value.details()
    same = stub.Submit(pb.SubmitRequest(trajectories=trajectories("p", 1)))
    assert (same.accepted, same.duplicates) == (0, 1)


def test_trajectory_for_never_dispatched_prompt_is_not_found(server):
    stub = server.stub()
    with pytest.raises(grpc.RpcError) as caught:
        stub.Submit(pb.SubmitRequest(trajectories=trajectories("never", 1)))
    assert caught.value.code() == grpc.StatusCode.NOT_FOUND
    assert details_of(caught.value)[0] == "UNKNOWN_PROMPT"


def test_prompt_from_before_the_last_reset_is_stale_generation(server):
    stub = server.stub()
    dispatch(stub, "old")
    stub.Reset(pb.ResetRequest(mode=pb.RESET_MODE_ABORT, wait_seconds=0, resume=True, weight_version=1))
    with pytest.raises(grpc.RpcError) as caught:
        stub.Submit(pb.SubmitRequest(trajectories=trajectories("old", 1)))
    assert caught.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert details_of(caught.value)[0] == "STALE_GENERATION"
    assert stub.GetState(pb.GetStateRequest()).stale_rejected == 1


def test_second_reset_while_one_runs_is_failed_precondition(server):
    stub = server.stub()
    dispatch(stub, "slow")
    first = stub.Reset.future(pb.ResetRequest(mode=pb.RESET_MODE_WAIT, wait_seconds=60))
    # The first Reset is running once the server reports it; only then is the second one a conflict.
    while not stub.GetState(pb.GetStateRequest()).resetting:
        pass
    with pytest.raises(grpc.RpcError) as caught:
        stub.Reset(pb.ResetRequest())
    assert caught.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert details_of(caught.value)[0] == "RESET_IN_PROGRESS"
    stub.Submit(pb.SubmitRequest(trajectories=trajectories("slow", 2)))  # lets the first Reset finish
    result = first.result(timeout=30)
    assert [g.prompt_id for g in result.restored] == [] and result.generation == 1
    assert stub.GetState(pb.GetStateRequest()).buffered == 1


def test_paused_dispatch_and_empty_collect_are_ok_with_flags(server):
    stub = server.stub()
    stub.Reset(pb.ResetRequest(mode=pb.RESET_MODE_WAIT))
    paused = dispatch(stub, "a")
    assert paused.paused and list(paused.admitted) == []
    empty = stub.Collect(pb.CollectRequest(num_groups=1))
    assert empty.timed_out and list(empty.groups) == []


def test_long_poll_is_bounded_by_the_call_deadline(server):
    stub = server.stub()
    # Asks to wait an hour, but the call's own deadline is two seconds: the server answers OK in time.
    answer = stub.Collect(pb.CollectRequest(num_groups=1, wait_seconds=3600), timeout=2)
    assert answer.timed_out


def test_calls_after_shutdown_are_unavailable(tmp_path):
    server = ServerProcess(tmp_path, *SMALL).start()
    try:
        stub = server.stub()
        stub.GetState(pb.GetStateRequest())
        assert server.terminate() == 0
        with pytest.raises(grpc.RpcError) as caught:
            stub.GetState(pb.GetStateRequest(), timeout=5)
        assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        server.close()


def test_retried_call_with_same_request_id_applies_once(server):
    stub = server.stub()
    first = dispatch(stub, "a", "b", request_id="dispatch-1")
    again = dispatch(stub, "a", "b", request_id="dispatch-1")
    assert again == first and [a.prompt_id for a in first.admitted] == ["a", "b"]
    batch = pb.SubmitRequest(trajectories=trajectories("a", 2), request_id="submit-1")
    assert stub.Submit(batch) == stub.Submit(batch) == pb.SubmitResponse(accepted=2, groups_completed=1)
    state = stub.GetState(pb.GetStateRequest())
    assert (state.dispatched, state.submitted, state.duplicates) == (2, 2, 0)
