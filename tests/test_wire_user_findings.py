"""What a caller driving the server from pacer.proto alone (no Python client) reads in its refusals, and the
contract's comments against what the server does: each over real gRPC against a server subprocess."""
from __future__ import annotations

import re
from pathlib import Path

import grpc
import pytest

from coda_client import PacerClient
from coda_client.batches import BatchShape as ClientBatchShape
from coda_client._proto import pacer_pb2 as pb
from coda_server.core.checks import SubmitSorting
from coda_server.core.errors import LeaseExpiredError
from server_harness import REPO_ROOT, ServerProcess, refusal_of, until

# A window of int(2 * (1 + 10)) = 22 groups: the tests sharing one server never fill it.
SMALL = ("data_source.num_prompts_per_step=2", "data_source.num_trajectories_per_prompt=2",
         "trainer.mini_batch_size=2", "fully_async.stale_steps=10")
PROTO = REPO_ROOT / "proto" / "coda" / "pacer" / "v1" / "pacer.proto"
# What a non-Python reader should not have to decode: a Python repr, a Python exception's words, the Python client.
PYTHON_SPEAK = ("<TrajectoryStatus", "pickle", "codec", "load key", "PacerClient.checkpoint()", "Traceback")
TIMEOUT = 10


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with ServerProcess(tmp_path_factory.mktemp("wire-findings"), *SMALL) as process:
        yield process


def refusal(call, request, **kwargs) -> tuple[grpc.StatusCode, str, str, list[str]]:
    """(code, message, ErrorInfo reason, BadRequest fields) of a call that must fail."""
    with pytest.raises(grpc.RpcError) as caught:
        call(request, timeout=TIMEOUT, **kwargs)
    refused = refusal_of(caught.value)
    return refused.code, refused.message, refused.reason, [name for name, _ in refused.violations]


def counters(stub) -> tuple:
    state = stub.GetState(pb.GetStateRequest(), timeout=TIMEOUT)
    return (state.dispatched, state.submitted, state.buffered, state.consumed, state.leased, state.restores,
            state.step)


def dispatch(stub, *prompt_ids: str, **kwargs) -> dict[str, int]:
    answer = stub.Dispatch(pb.DispatchRequest(candidates=[pb.PromptRef(prompt_id=p) for p in prompt_ids], **kwargs),
                           timeout=TIMEOUT)
    return {a.prompt_id: a.seq for a in answer.admitted}


def trajectory(prompt_id: str, i: int, status=pb.TRAJECTORY_STATUS_COMPLETED) -> pb.Trajectory:
    return pb.Trajectory(trajectory_id=f"{prompt_id}#{i}", prompt_id=prompt_id, status=status, reward=1.0)


def complete_group(stub, prompt_id: str) -> None:
    assert prompt_id in dispatch(stub, prompt_id)
    stub.Submit(pb.SubmitRequest(trajectories=[trajectory(prompt_id, 0), trajectory(prompt_id, 1)]), timeout=TIMEOUT)


def proto_comment(rpc: str) -> str:
    """The comment block right above `rpc <name>(` in pacer.proto, joined into one line."""
    lines = PROTO.read_text().splitlines()
    at = next(i for i, line in enumerate(lines) if re.match(rf"\s*rpc {rpc}\(", line))
    comment = []
    for line in reversed(lines[:at]):
        if not line.strip().startswith("//"):
            break
        comment.insert(0, line.strip()[2:].strip())
    return " ".join(comment)


# ------------------------------------------------------------------ A: messages name the field, in wire terms


@pytest.mark.parametrize("prompt_id, says", [
    ("", "Dispatch refused, nothing admitted: candidates[1].prompt_id must be a non-empty string"),
    ("x" * 513, "Dispatch refused, nothing admitted: candidates[1].prompt_id is 513 characters long; at most 512"),
])
def test_a_dispatch_refusal_message_names_the_field(server, prompt_id, says):
    stub = server.stub()
    before = counters(stub)
    code, message, reason, fields = refusal(stub.Dispatch, pb.DispatchRequest(candidates=[
        pb.PromptRef(prompt_id="fine"), pb.PromptRef(prompt_id=prompt_id)]))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and reason == "INVALID_ARGUMENT"
    assert message.startswith(says), message
    assert fields == ["candidates[1].prompt_id"]
    assert counters(stub) == before


def test_a_keep_alive_refusal_reads_like_the_others(server):
    code, message, _, fields = refusal(server.stub().KeepAlive, pb.KeepAliveRequest(prompt_ids=["ok", "", "a\nb"]))
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert message.startswith("KeepAlive refused, nothing renewed: prompt_ids[1] must be a non-empty string"), message
    assert "1 more field violation" in message and fields == ["prompt_ids[1]", "prompt_ids[2]"]


@pytest.mark.parametrize("status", [pb.TRAJECTORY_STATUS_UNSPECIFIED, 99])
def test_a_refused_status_is_named_as_the_proto_names_it(server, status):
    stub = server.stub()
    dispatch(stub, f"status-{status}")
    before = counters(stub)
    code, message, _, fields = refusal(stub.Submit, pb.SubmitRequest(trajectories=[
        trajectory(f"status-{status}", 0, status=status)]))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and fields == ["trajectories[0].status"]
    shown = (f"{pb.TrajectoryStatus.Name(status)} ({status})" if status in pb.TrajectoryStatus.values()
             else str(status))
    assert f"Submit refused, nothing accepted: trajectories[0].status {shown} is not allowed" in message, message
    for allowed in ("COMPLETED", "FAILED", "ABORTED"):
        value = pb.TrajectoryStatus.Value(f"TRAJECTORY_STATUS_{allowed}")
        assert f"{pb.TrajectoryStatus.Name(value)} ({value})" in message
    assert not any(word in message for word in PYTHON_SPEAK), message
    assert counters(stub) == before


def test_a_restore_of_bytes_that_are_no_checkpoint_says_so_in_wire_terms(server):
    stub = server.stub()
    complete_group(stub, "ck")
    blob = stub.Checkpoint(pb.CheckpointRequest(), timeout=TIMEOUT).checkpoint
    flipped = bytearray(blob)
    flipped[len(flipped) // 2] ^= 0xFF
    before = counters(stub)
    for bad in (b"hello", blob[:len(blob) // 2], blob[:-3], bytes(flipped), blob[:25]):
        code, message, reason, fields = refusal(stub.Restore, pb.RestoreRequest(checkpoint=bad))
        assert (code, reason, fields) == (grpc.StatusCode.INVALID_ARGUMENT, "CHECKPOINT_FORMAT", ["checkpoint"])
        assert message.startswith("Restore refused, nothing changed: checkpoint "), message
        assert "an earlier Checkpoint call returned" in message, message
        assert not any(word in message for word in PYTHON_SPEAK) and "PacerClient" not in message, message
    assert counters(stub) == before


def test_unauthenticated_says_the_metadata_first_and_the_python_client_second(tmp_path):
    token = "a-token-of-enough-length-0123456789"
    token_file = tmp_path / "token"
    token_file.write_text(token)
    with ServerProcess(tmp_path, *SMALL, f"server.auth_token_file={token_file}") as guarded:
        stub = guarded.stub()
        code, message, reason, _ = refusal(stub.GetState, pb.GetStateRequest())
        assert (code, reason) == (grpc.StatusCode.UNAUTHENTICATED, "MISSING_TOKEN")
        wire, python = message.find("'authorization: Bearer <token>'"), message.find("Python client")
        assert 0 <= wire < python, message
        assert "coda_client:" not in message
        code, message, reason, _ = refusal(stub.GetState, pb.GetStateRequest(),
                                           metadata=[("authorization", "Bearer wrong")])
        assert (code, reason) == (grpc.StatusCode.UNAUTHENTICATED, "INVALID_TOKEN")
        assert "'authorization' metadata" in message, message
        assert stub.GetState(pb.GetStateRequest(), metadata=[("authorization", f"Bearer {token}")], timeout=TIMEOUT)


# ------------------------------------------------------------------ B: a late Submit hears what became of the group


def late_submit_refused(leased: ServerProcess) -> tuple[object, str]:
    """A group's trajectory submitted after its in-flight lease ran out (fenced to its dispatch): the stub and the
    LEASE_EXPIRED refusal's message."""
    stub = leased.stub()
    seq = dispatch(stub, "late")["late"]
    stub.Submit(pb.SubmitRequest(trajectories=[trajectory("late", 0)]), timeout=TIMEOUT)
    until(lambda: stub.GetState(pb.GetStateRequest(), timeout=TIMEOUT).expired >= 1, "the group's lease to run out")
    code, message, reason, _ = refusal(stub.Submit, pb.SubmitRequest(
        trajectories=[trajectory("late", 1)], dispatch_seqs={"late": seq}))
    assert (code, reason) == (grpc.StatusCode.FAILED_PRECONDITION, "LEASE_EXPIRED")
    return stub, message


def test_a_late_submit_hears_the_group_is_kept_and_re_offered_as_it_is(tmp_path):
    with ServerProcess(tmp_path, *SMALL, "server.inflight_lease_seconds=0.3") as leased:
        stub, message = late_submit_refused(leased)
        assert "re-offers it on Dispatch as a continuation" in message, message
        assert "slots reclaimed, kept for continuation (re-offered on Dispatch)" in leased.log()  # the log says so too
        assert "rollout.continue_restored" in message, message
        # What the message says is what happens (continue_restored is on by default): the group comes back as a
        # continuation, with the trajectory it had.
        again = stub.Dispatch(pb.DispatchRequest(max_continuations=1), timeout=TIMEOUT)
        assert [(g.prompt_id, [t.trajectory_id for t in g.trajectories]) for g in again.continuations] == [
            ("late", ["late#0"])]


def test_a_late_submit_hears_the_next_reset_returns_the_group_without_continuation(tmp_path):
    with ServerProcess(tmp_path, *SMALL, "server.inflight_lease_seconds=0.3", "rollout.continue_restored=false") as leased:
        stub, message = late_submit_refused(leased)
        assert "returned by the next Reset" in message and "re-offer" not in message, message
        assert "slots reclaimed, partial trajectories set aside for the next Reset" in leased.log()
        reset = stub.Reset(pb.ResetRequest(mode=pb.RESET_MODE_WAIT, wait_seconds=0), timeout=TIMEOUT)
        assert [(g.prompt_id, [t.trajectory_id for t in g.trajectories]) for g in reset.expired] == [
            ("late", ["late#0"])]


@pytest.mark.parametrize("kept, says, never", [
    (True, "re-offers it on Dispatch as a continuation", "returned by the next Reset"),
    (False, "returned by the next Reset", "re-offer"),
])
def test_lease_expired_told_the_configuration_says_only_what_happens_under_it(kept, says, never):
    sorting = SubmitSorting(expired=["p"])
    with pytest.raises(LeaseExpiredError) as caught:
        sorting.refuse(1, 4, 30.0, kept)
    assert says in caught.value.message and never not in caught.value.message


# ------------------------------------------------------------------ C: a rank needs a world_size above it


@pytest.mark.parametrize("rank, world_size", [(3, 0), (1, 1), (1, 0)])
def test_a_rank_without_a_world_size_above_it_is_refused_and_takes_nothing(server, rank, world_size):
    stub = server.stub()
    complete_group(stub, f"rank-{rank}-{world_size}")
    before = counters(stub)
    code, message, reason, fields = refusal(stub.Collect, pb.CollectRequest(
        num_groups=1, rank=rank, world_size=world_size, lease_seconds=30))
    assert (code, reason) == (grpc.StatusCode.INVALID_ARGUMENT, "INVALID_ARGUMENT")
    assert f"rank {rank} needs world_size > {rank}" in message and "rank is 0" in message, message
    assert fields == ["rank", "world_size"]
    assert counters(stub) == before
    # The single consumer's rank 0 is served, with world_size 0 (unset) or 1 alike.
    taken = stub.Collect(pb.CollectRequest(num_groups=1, rank=0, world_size=world_size), timeout=TIMEOUT)
    assert len(taken.groups) == 1


def test_the_client_refuses_the_same_ranks_before_sending():
    for rank, world_size in [(1, 1), (3, 0), (2, 2)]:
        with pytest.raises(ValueError, match="world_size|rank"):
            ClientBatchShape.of(2, 2, None, token_budget=None, rank=rank, world_size=world_size)
    assert ClientBatchShape.of(4, 2, None, token_budget=None, rank=1, world_size=2).rank == 1


# ------------------------------------------------------------------ E: the contract's comments say what the server does


def test_release_of_a_released_lease_answers_zero_and_an_acknowledged_one_is_unknown(server):
    stub = server.stub()
    complete_group(stub, "rel")
    lease = stub.Collect(pb.CollectRequest(num_groups=1, lease_seconds=30), timeout=TIMEOUT).lease_id
    assert stub.Release(pb.ReleaseRequest(lease_id=lease), timeout=TIMEOUT).groups == 1
    assert stub.Release(pb.ReleaseRequest(lease_id=lease), timeout=TIMEOUT).groups == 0
    lease = stub.Collect(pb.CollectRequest(num_groups=1, lease_seconds=30), timeout=TIMEOUT).lease_id
    assert stub.Ack(pb.AckRequest(lease_id=lease), timeout=TIMEOUT).groups == 1
    code, message, reason, _ = refusal(stub.Release, pb.ReleaseRequest(lease_id=lease))
    assert (code, reason) == (grpc.StatusCode.NOT_FOUND, "UNKNOWN_LEASE")
    assert "already acknowledged or released" not in message and "already acknowledged" in message, message
    comment = proto_comment("Release")
    assert "UNKNOWN_LEASE" in comment and "already acknowledged or released" not in comment, comment
    assert "released already answers 0 groups" in comment, comment


def test_reset_and_resume_after_end_job_are_job_ended_as_the_proto_says(tmp_path):
    with ServerProcess(tmp_path, *SMALL) as ended:
        stub = ended.stub()
        stub.EndJob(pb.EndJobRequest(wait_seconds=0), timeout=TIMEOUT)
        for rpc, request in [("Reset", pb.ResetRequest(wait_seconds=0)), ("Resume", pb.ResumeRequest())]:
            code, _, reason, _ = refusal(getattr(stub, rpc), request)
            assert (code, reason) == (grpc.StatusCode.FAILED_PRECONDITION, "JOB_ENDED")
            assert "JOB_ENDED" in proto_comment(rpc), (rpc, proto_comment(rpc))
    assert "RESET_IN_PROGRESS" in proto_comment("Resume") and "RESET_IN_PROGRESS" in proto_comment("Reset")


def test_the_proto_header_names_the_reason_a_second_reset_gets():
    header = PROTO.read_text().split("syntax =")[0]
    assert "without that reason: e.g. a second Reset" not in header
    assert "RESET_IN_PROGRESS" in header
