"""A Submit's fences (dispatch_seqs) over gRPC: a fence for a group the Submit carries nothing of is refused, not
ignored (the Submit would otherwise go unfenced without a word)."""
from __future__ import annotations

import pytest

from coda_client import PacerClient, Trajectory, TrajectoryStatus
from coda_client.errors import BadRequestError
from server_harness import ServerProcess


def trajectory(prompt_id: str, i: int) -> Trajectory:
    return Trajectory(trajectory_id=f"{prompt_id}#{i}", prompt_id=prompt_id, status=TrajectoryStatus.COMPLETED,
                      reward=1.0, token_ids=[1, 2], logprobs=[-0.1, -0.2], loss_mask=[1, 1])


def test_a_fence_naming_a_prompt_the_submit_does_not_carry_is_refused_and_changes_nothing(tmp_path):
    with ServerProcess(tmp_path, "data_source.num_prompts_per_step=2", "data_source.num_trajectories_per_prompt=2",
                       "trainer.mini_batch_size=2") as server, PacerClient(server.address) as client:
        seq = client.dispatch(["se-a"]).first_seq
        with pytest.raises(BadRequestError, match="dispatch_seqs names prompt 'zzz', which no trajectory of this "
                                                  "Submit belongs to") as refused:
            client.submit([trajectory("se-a", 0)], dispatch_seqs={"se-a": seq, "zzz": 1})
        assert [v.field for v in refused.value.field_violations] == ["dispatch_seqs['zzz']"]
        assert client.state().submitted == 0
        assert client.submit([trajectory("se-a", 0)], dispatch_seqs={"se-a": seq}).accepted == 1
