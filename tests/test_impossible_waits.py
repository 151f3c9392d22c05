"""A wait that cannot end is refused at once (issue 23, item 3): a Collect, or batches(), asking for more groups
than the window can ever hold; and a trainer waiting on a full window is told so in the server log."""
from __future__ import annotations

import asyncio
import re
import threading
import time

import pytest

from coda_client import AsyncPacerClient, PacerClient, Trajectory, TrajectoryStatus
from coda_client.errors import BadRequestError
from conftest import core_overrides
from server_harness import ServerProcess

CONDITION_TIMEOUT = 30.0


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    # B = 8, N = 2, stale_steps 1: C = 16 groups, so a mini-batch of 128 trajectories (64 groups) never fills.
    with ServerProcess(tmp_path_factory.mktemp("impossible"),
                       *core_overrides("no-window", B=8, stale=1.0, N=2, M=2)) as running:
        yield running


def test_a_collect_for_more_groups_than_the_window_holds_is_refused_at_once(server):
    with PacerClient(server.address) as trainer:
        with pytest.raises(BadRequestError) as refused:
            trainer.collect(64, wait=10)
        message = str(refused.value)
        for term in ("num_groups 64", "C = int(B * (1 + stale_steps)) = int(8 * (1 + 1)) = 16",
                     "num_trajectories_per_prompt 2", "stale_steps 1"):
            assert term in message
        assert trainer.state().collect_limit == 16
        # Within the window, or with allow_partial, the same wait is fine.
        assert trainer.collect_result(64, allow_partial=True).timed_out
        assert trainer.collect_result(16).timed_out


def test_batches_that_the_window_can_never_fill_fail_when_asked_for(server):
    pytest.importorskip("numpy")
    outcome: dict = {}

    def ask() -> None:
        with PacerClient(server.address) as trainer:
            try:
                trainer.batches(128, num_batches=1, poll=1.0)
            except ValueError as exc:
                outcome["error"] = str(exc)

    caller = threading.Thread(target=ask, daemon=True)
    caller.start()
    caller.join(CONDITION_TIMEOUT)
    assert not caller.is_alive(), "batches(128) waits for a mini-batch the window can never fill"
    assert "mini_batch_size 128 needs 64 groups" in outcome["error"] and "= 16" in outcome["error"]


@pytest.mark.parametrize("group_size", [1, 4])
def test_a_group_size_the_server_does_not_have_is_refused_before_any_batch(server, group_size):
    """A wrong group_size would size every mini-batch by it: 4 with the server's N = 2 gave half the trajectories
    asked for, 1 twice as many, without a word."""
    pytest.importorskip("numpy")
    expected = (f"group_size {group_size} is not the server's group size (its data sources' "
                "num_trajectories_per_prompt: 2)")
    with PacerClient(server.address) as trainer:
        with pytest.raises(ValueError, match=re.escape(expected)):
            trainer.batches(8, group_size=group_size, num_batches=1)
        trainer.batches(8, group_size=2, num_batches=1).close()  # the server's own is fine

    async def ask_async() -> None:
        async with AsyncPacerClient(server.address) as trainer:
            with pytest.raises(ValueError, match=re.escape(expected)):
                async with trainer.batches(8, group_size=group_size, num_batches=1) as batches:
                    await batches.__anext__()

    asyncio.run(asyncio.wait_for(ask_async(), CONDITION_TIMEOUT))


def test_a_collect_waiting_on_a_full_window_is_logged_with_the_windows_terms(tmp_path):
    overrides = core_overrides("no-window", B=2, stale=0.0, N=1)
    with ServerProcess(tmp_path, *overrides, "server.collect_stall_warning_seconds=0.2") as server:
        with PacerClient(server.address) as worker, PacerClient(server.address) as trainer:
            worker.dispatch(["a", "b"])  # the window (C = 2) is full; nothing is complete
            answer: dict = {}
            waiting = threading.Thread(target=lambda: answer.update(groups=trainer.collect(2, wait=60)), daemon=True)
            waiting.start()
            deadline = time.monotonic() + CONDITION_TIMEOUT
            while "while dispatch admits nothing" not in server.log():
                assert time.monotonic() < deadline, f"no stall warning logged:\n{server.log()}"
                time.sleep(0.05)
            line = next(line for line in server.log().splitlines() if "while dispatch admits nothing" in line)
            assert "Collect for 2 groups" in line and "0 buffered, 2 running" in line and "= 2 groups" in line
            assert re.search(r"a trainer has waited \d+ s for groups", line)
            worker.submit([Trajectory(trajectory_id=f"{p}#0", prompt_id=p, status=TrajectoryStatus.COMPLETED)
                           for p in ("a", "b")])
            waiting.join(CONDITION_TIMEOUT)
            assert [g.prompt_id for g in answer["groups"]] == ["a", "b"]


def test_a_trainer_polling_in_short_collects_is_logged_once_its_wait_spans_the_threshold(tmp_path):
    """batches() waits in Collects of `poll` seconds each; none alone reaches the threshold, and the warning never
    came for the most common trainer. The wait now runs from the first Collect since groups were last taken."""
    overrides = core_overrides("no-window", B=2, stale=0.0, N=1)
    with ServerProcess(tmp_path, *overrides, "server.collect_stall_warning_seconds=1.0") as server:
        with PacerClient(server.address) as trainer:
            trainer.reset("abort")  # and no Resume: dispatch stays paused
            with trainer.batches(1, poll=0.2) as batches:
                deadline = time.monotonic() + CONDITION_TIMEOUT
                while "while dispatch admits nothing" not in server.log():
                    assert time.monotonic() < deadline, f"no stall warning logged:\n{server.log()}"
                    time.sleep(0.05)
                trainer.resume(1)
                trainer.dispatch(["a"])
                trainer.submit([Trajectory(trajectory_id="a#0", prompt_id="a", status=TrajectoryStatus.COMPLETED)])
                assert [g.prompt_id for g in next(batches).groups] == ["a"]
        [line] = [line for line in server.log().splitlines() if "while dispatch admits nothing" in line]
        assert "Collect for 1 groups, in one call or several polls" in line and "dispatch paused" in line
