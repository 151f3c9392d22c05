"""A request_id reused by a call that asks for something else is refused, over gRPC: answering it the first call's
answer would drop what it asked for without a word. A true retry (the same call again) still gets the first answer."""
from __future__ import annotations

import dataclasses

import pytest

from coda_client import PacerClient, Trajectory, TrajectoryStatus
from coda_client.errors import BadRequestError
from server_harness import ServerProcess

N = 2  # trajectories per group


def group(prompt_id: str) -> list[Trajectory]:
    return [Trajectory(trajectory_id=f"{prompt_id}#{i}", prompt_id=prompt_id, status=TrajectoryStatus.COMPLETED,
                       reward=float(i), token_ids=[1, 2, 3], logprobs=[-0.1, -0.2, -0.3], loss_mask=[1, 1, 1])
            for i in range(N)]


@pytest.fixture
def client(tmp_path):
    with ServerProcess(tmp_path, "data_source.num_prompts_per_step=2", f"data_source.num_trajectories_per_prompt={N}",
                       "trainer.mini_batch_size=2", "fully_async.stale_steps=1.0") as server:
        with PacerClient(server.address) as pacer_client:
            yield pacer_client


def test_a_submit_reusing_a_request_id_for_other_trajectories_is_refused_and_changes_nothing(client):
    client.dispatch(["ru-a", "ru-b"])
    first = client.submit(group("ru-a"), request_id="worker-7-submit-1")
    assert (first.accepted, first.groups_completed) == (N, 1)
    before = client.state()
    with pytest.raises(BadRequestError, match="request_id 'worker-7-submit-1' was used by an earlier Submit that asked "
                                              "for other trajectories") as refused:
        client.submit(group("ru-b"), request_id="worker-7-submit-1")
    assert ("request_id", "already used by a Submit with other trajectories") in [
        (v.field, v.description) for v in refused.value.field_violations]
    after = client.state()
    assert (after.submitted, after.running, after.buffered) == (before.submitted, before.running, before.buffered)
    again = client.submit(group("ru-a"), request_id="worker-7-submit-1")  # a true retry: the first answer
    assert (again.accepted, again.duplicates, again.groups_completed) == (first.accepted, first.duplicates,
                                                                         first.groups_completed)
    fresh = client.submit(group("ru-b"), request_id="worker-7-submit-2")  # the new call under a new id goes in
    assert (fresh.accepted, client.state().running) == (N, 0)


def test_a_submit_retried_under_its_request_id_with_other_content_is_refused_not_answered_accepted(client):
    """A retry carrying the same trajectory ids with another reward was answered `accepted` from memory, and the new
    reward was dropped without a word (the trainer got the first). It is refused now, as long as the generation keeps
    what it accepted: while the group is held and after the trainer took it."""
    client.dispatch(["rc-a"])
    first = client.submit(group("rc-a"), request_id="worker-3-submit-1")
    changed = group("rc-a")
    changed[1] = dataclasses.replace(changed[1], reward=5.0)
    for holder in ("the buffer", "the trainer"):
        before = client.state()
        with pytest.raises(BadRequestError, match="differ in content from the ones accepted under those ids") as refused:
            client.submit(changed, request_id="worker-3-submit-1")
        assert ("trajectories[1]", "'rc-a#1' differs from the trajectory accepted under this id") in [
            (v.field, v.description) for v in refused.value.field_violations], holder
        after = client.state()
        assert (after.submitted, after.duplicates, after.buffered) == (before.submitted, before.duplicates,
                                                                       before.buffered), holder
        again = client.submit(group("rc-a"), request_id="worker-3-submit-1")  # a true retry: the first answer
        assert (again.accepted, again.groups_completed) == (first.accepted, first.groups_completed), holder
        if holder == "the buffer":
            taken = client.collect_result(1)
            assert [t.reward for t in taken.groups[0].trajectories] == [0.0, 1.0]


def test_dispatch_collect_ack_and_resume_reusing_a_request_id_for_another_request_are_refused(client):
    admitted = client.dispatch(["d-a"], request_id="dispatch-1")
    assert list(admitted.admitted) == ["d-a"]
    with pytest.raises(BadRequestError, match="earlier Dispatch that asked for other candidates"):
        client.dispatch(["d-b"], request_id="dispatch-1")
    assert client.state().running == 1  # d-b was not admitted
    assert list(client.dispatch(["d-a"], request_id="dispatch-1").admitted) == ["d-a"]

    client.dispatch(["d-b"])
    client.submit(group("d-a") + group("d-b"))
    taken = client.collect_result(1, request_id="collect-1", lease=60.0)
    assert len(taken.groups) == 1
    with pytest.raises(BadRequestError, match="earlier Collect that asked for other num_groups"):
        client.collect_result(2, request_id="collect-1", lease=60.0)
    assert client.state().buffered == 1  # the other group is still there

    other = client.collect_result(1, lease=60.0)
    assert client.ack(taken.lease_id, request_id="ack-1") == 1
    with pytest.raises(BadRequestError, match="earlier Ack that asked for other lease_id"):
        client.ack(other.lease_id, request_id="ack-1")
    assert client.ack(other.lease_id, request_id="ack-2") == 1  # not consumed by the refused call: acknowledged now

    client.reset("wait", wait=0)
    resumed = client.resume(1, request_id="resume-1")
    with pytest.raises(BadRequestError, match="earlier Resume that asked for other weight_version"):
        client.resume(5, request_id="resume-1")
    state = client.state()
    assert (state.step, state.weight_version) == (resumed.step, 1)
