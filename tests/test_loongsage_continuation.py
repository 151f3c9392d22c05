"""LoongSage's continuation and order (issue 23, item 6): kept groups re-offered first to every Dispatch (a caller
may opt out), an unclaimed kept group visible with its age, restored groups ordered by first trajectory arrival,
LoongSage's status strings and keyword names on Trajectory, and on_dispatched seeing N pending trajectories."""
from __future__ import annotations

import textwrap
import time

import pytest

from coda_client import PacerClient, Trajectory, TrajectoryStatus
from conftest import core_overrides
from server_harness import ServerProcess

CONDITION_TIMEOUT = 30.0


def aborted(prompt_id: str, n: int = 2) -> list[Trajectory]:
    return [Trajectory(trajectory_id=f"{prompt_id}#{i}", prompt_id=prompt_id, status=TrajectoryStatus.ABORTED,
                       token_ids=[1, 2]) for i in range(n)]


@pytest.fixture
def server(tmp_path):
    with ServerProcess(tmp_path, *core_overrides("no-window", B=4, stale=1.0, N=2, continue_restored=True)) as running:
        yield running


def test_restored_groups_keep_the_order_their_first_trajectories_arrived_in(server):
    with PacerClient(server.address) as client:
        client.dispatch(["a", "b", "c"])
        client.submit(aborted("c")[:1])  # c's first trajectory arrives first, then b's, then a's
        client.submit(aborted("b"))
        client.submit(aborted("a"))
        client.submit(aborted("c")[1:])
        reset = client.reset("abort", wait=0, resume=True, weight_version=1)
        assert reset.kept_prompt_ids == ["c", "b", "a"]
        assert [g.prompt_id for g in client.dispatch(["x", "y", "z"]).continuations] == ["c", "b", "a"]


def test_kept_groups_are_reoffered_first_to_a_plain_dispatch_unless_it_opts_out(server):
    with PacerClient(server.address) as client:
        client.dispatch(["a", "b"])
        client.submit(aborted("a") + aborted("b"))
        client.reset("abort", wait=0, resume=True, weight_version=1)
        opted_out = client.dispatch(["n0"], max_continuations=0)
        assert opted_out.admitted == ["n0"] and opted_out.continuations == []
        plain = client.dispatch(["n1", "n2", "n3"])  # no max_continuations: kept groups first, in their place
        assert [g.prompt_id for g in plain.continuations] == ["a", "b"] and plain.admitted == ["n1"]
        assert [len(g.trajectories) for g in plain.continuations] == [2, 2]
        assert client.state().restored_kept == 0


def test_an_unclaimed_kept_group_shows_in_get_state_with_its_age(server):
    with PacerClient(server.address) as client:
        client.dispatch(["a"])
        client.submit(aborted("a"))
        client.reset("abort", wait=0, resume=True, weight_version=1)
        deadline = time.monotonic() + CONDITION_TIMEOUT
        while (state := client.state()).restored_kept_oldest_seconds <= 0:
            assert time.monotonic() < deadline, f"the kept group's age never shows: {state}"
            time.sleep(0.05)
        assert state.restored_kept == 1
        client.dispatch(["n0"])  # re-offered and taken: nothing waits any more
        assert client.state().restored_kept_oldest_seconds == 0


def test_trajectory_takes_loongsage_status_strings_and_keyword_names():
    loong = Trajectory(trajectory_id="t", prompt_id="p", status="aborted", start_rollout_weight_version=2,
                       end_rollout_weight_version=3, tokens=[7, 7, 1, 2, 3], loss_masks=[1, 1, 0],
                       rollout_log_probs=[-0.5, -0.25, 0.0], rollout_weight_versions=[2, 3, 3])
    assert loong.status is TrajectoryStatus.ABORTED
    assert (loong.start_weight_version, loong.end_weight_version) == (2, 3)
    assert (list(loong.token_ids), list(loong.loss_mask)) == ([1, 2, 3], [1, 1, 0])
    assert (loong.segment_lengths, loong.segment_weight_versions) == ([1, 2], [2, 3])
    assert loong.start_rollout_weight_version == 2 and list(loong.rollout_log_probs) == [-0.5, -0.25, 0.0]
    assert Trajectory.from_pb(loong.to_pb()) == loong
    assert Trajectory(trajectory_id="t", prompt_id="p", status="COMPLETED").status is TrajectoryStatus.COMPLETED
    with pytest.raises(ValueError, match="not a final status"):
        Trajectory(trajectory_id="t", prompt_id="p", status="pending")
    with pytest.raises(TypeError, match="both"):
        Trajectory(trajectory_id="t", prompt_id="p", status=1, logprobs=[0.0], rollout_log_probs=[0.0])


RECORDING_STRATEGY = '''
    import logging
    from coda_server import register_sliding_window_strategy
    from coda_server.core.builtin_strategies import NoWindowStrategy

    @register_sliding_window_strategy("records-dispatch")
    class RecordsDispatch(NoWindowStrategy):
        def on_dispatched(self, groups):
            logging.getLogger("coda_server").warning("on_dispatched saw %s", ",".join(
                f"{g.prompt_id}={len(g.trajectories)}:{'/'.join(str(int(t.status)) for t in g.trajectories)}"
                for g in groups))
            super().on_dispatched(groups)
'''


def test_on_dispatched_sees_the_pending_trajectories_of_each_group(tmp_path):
    (tmp_path / "strategies").mkdir()
    (tmp_path / "strategies" / "records_dispatch.py").write_text(textwrap.dedent(RECORDING_STRATEGY))
    overrides = core_overrides("records-dispatch", B=4, stale=1.0, N=3, continue_restored=True)
    with ServerProcess(tmp_path, *overrides, f"server.custom_strategy_dirs=[{tmp_path / 'strategies'}]") as server:
        with PacerClient(server.address) as client:
            client.dispatch(["p0", "p1"])
            deadline = time.monotonic() + CONDITION_TIMEOUT
            while "on_dispatched saw" not in server.log():
                assert time.monotonic() < deadline, server.log()
                time.sleep(0.05)
    assert "on_dispatched saw p0=3:0/0/0,p1=3:0/0/0" in server.log()  # N pending (UNSPECIFIED) trajectories each
