"""LoongSage's runtime behaviour through a live server: WAIT means wait, dirty data is refused, held groups are
re-examined over time, a raising hook is reported and never leaves a group stuck, LoongSage-form prompt ids order
the buffer. In-process where the wire cannot show it (on_reset, on_collected, recovery of a re-check)."""
from __future__ import annotations

import textwrap
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest
from grpc_status import rpc_status

from coda_client._proto import pacer_pb2 as pb
from coda_server.core import Pacer, PromptRef, ResetMode, Trajectory
from coda_server.core.builtin_strategies import NoWindowStrategy
from coda_server.core.errors import StrategyHookError
from coda_server.core.sqlite_journal import SqliteJournal
from coda_server.core.strategy import ThreadSafeStrategy
from google.rpc import error_details_pb2
from server_harness import ServerProcess

SMALL = ("data_source.num_prompts_per_step=4", "data_source.num_trajectories_per_prompt=2",
         "trainer.mini_batch_size=2", "fully_async.stale_steps=1.0")
OK, FAILED = pb.TRAJECTORY_STATUS_COMPLETED, pb.TRAJECTORY_STATUS_FAILED

# Custom strategies written for these tests, loaded by the server from server.custom_strategy_dirs.
STRATEGIES_PY = '''
import os
from coda_server import SlidingWindowStrategy, register_sliding_window_strategy


class _Capacity(SlidingWindowStrategy):
    def __init__(self, config):
        super().__init__()
        self._capacity = 8

    def compute_dispatch_count(self, buf_qsize):
        return self._capacity - self._running_count - buf_qsize


@register_sliding_window_strategy("flag-gate")
class FlagGate(_Capacity):
    """Collects nothing until the file named by $CODA_TEST_FLAG exists: a gate on an outside flag."""

    def will_collect(self, group):
        return super().will_collect(group) and os.path.exists(os.environ["CODA_TEST_FLAG"])


@register_sliding_window_strategy("boom-gate")
class BoomGate(_Capacity):
    """Raises in will_collect for prompts whose id starts with 'boom'; dispatch fails for a prompt 'nodispatch'."""

    def will_collect(self, group):
        prompt_id = next(iter(group.values())).prompt_id
        if prompt_id.startswith("boom"):
            raise ValueError(f"cannot judge {prompt_id}")
        return super().will_collect(group)

    def on_dispatched(self, groups):
        if any(g.prompt_id == "nodispatch" for g in groups):
            raise RuntimeError("refusing to track nodispatch")
        super().on_dispatched(groups)
'''


def traj(prompt_id: str, i: int, status: int = OK, reward: float | None = None) -> pb.Trajectory:
    return pb.Trajectory(trajectory_id=f"{prompt_id}/t{i}", prompt_id=prompt_id, status=status,
                         reward=float(i) if reward is None else reward)


def submit(stub, *trajectories, **kwargs):
    return stub.Submit(pb.SubmitRequest(trajectories=list(trajectories)), timeout=20, **kwargs)


def dispatch(stub, *prompt_ids):
    return stub.Dispatch(pb.DispatchRequest(candidates=[pb.PromptRef(prompt_id=p) for p in prompt_ids]), timeout=20)


def reason_of(error: grpc.RpcError) -> str:
    status = rpc_status.from_call(error)
    for detail in status.details:
        info = error_details_pb2.ErrorInfo()
        if detail.Unpack(info):
            return info.reason
    return ""


def state(stub) -> pb.GetStateResponse:
    return stub.GetState(pb.GetStateRequest(), timeout=20)


@pytest.fixture
def strategies_dir(tmp_path: Path) -> Path:
    directory = tmp_path / "strategies"
    directory.mkdir()
    (directory / "test_strategies.py").write_text(textwrap.dedent(STRATEGIES_PY))
    return directory


# ----------------------------------------------------------------------------- WAIT means wait


def test_a_wait_reset_without_wait_seconds_waits_until_every_running_group_is_assembled(tmp_path):
    with ServerProcess(tmp_path, *SMALL) as server, ThreadPoolExecutor(1) as pool:  # rollout.partial false: WAIT
        stub = server.stub()
        dispatch(stub, "p0", "p1")
        submit(stub, traj("p0", 0), traj("p0", 1), traj("p1", 0))
        request = pb.ResetRequest(resume=True, weight_version=1)
        assert not request.HasField("wait_seconds")  # optional: absent is not 0
        pending = pool.submit(stub.Reset, request, timeout=60)
        deadline = time.monotonic() + 20
        while not state(stub).resetting:  # the Reset paused dispatch and is waiting for p1
            assert time.monotonic() < deadline and not pending.done()
        assert not pending.done()
        submit(stub, traj("p1", 1))  # p1 is assembled: the Reset finishes
        answer = pending.result(timeout=30)
        buffered = state(stub).buffered
    assert list(answer.dropped_prompt_ids) == [] and list(answer.restored) == []  # nothing lost: p1 was waited for
    assert buffered == 2  # p0 and p1 both went to the buffer
    assert answer.report.partial_dropped_incomplete_group_count == 0


def test_an_explicit_zero_still_drops_the_incomplete_groups_now_and_abort_waits_at_most_abort_wait_seconds(tmp_path):
    with ServerProcess(tmp_path, *SMALL, "server.abort_wait_seconds=0.5") as server:
        stub = server.stub()
        dispatch(stub, "p0")
        submit(stub, traj("p0", 0))
        answer = stub.Reset(pb.ResetRequest(wait_seconds=0, resume=True, weight_version=1), timeout=20)
        assert list(answer.dropped_prompt_ids) == ["p0"]
        assert answer.report.partial_dropped_incomplete_count == 1  # trajectories, as LoongSage counts
        assert answer.report.partial_dropped_incomplete_group_count == 1
        dispatch(stub, "q0")
        answer = stub.Reset(pb.ResetRequest(mode=pb.RESET_MODE_ABORT, resume=True, weight_version=2), timeout=20)
        # ABORT without wait_seconds waits for the partial trajectories, at most server.abort_wait_seconds:
        # nobody submits q0's here, so it is dropped once that bound ran out.
        assert list(answer.dropped_prompt_ids) == ["q0"]
        assert answer.report.pause_delay >= 0.5


def test_waiting_is_bounded_by_max_wait_seconds(tmp_path):
    with ServerProcess(tmp_path, *SMALL, "server.max_wait_seconds=0.5") as server:
        stub = server.stub()
        dispatch(stub, "p0")
        answer = stub.Reset(pb.ResetRequest(resume=True, weight_version=1), timeout=30)
    assert list(answer.dropped_prompt_ids) == ["p0"]  # never assembled: dropped once the bound ran out


# ----------------------------------------------------------------------------- dirty data


def test_a_group_holding_a_failed_trajectory_without_the_status_filter_is_refused_visibly(tmp_path):
    with ServerProcess(tmp_path, *SMALL, "rollout.filter.status=false") as server:
        stub = server.stub()
        dispatch(stub, "dirty", "clean")
        submit(stub, traj("dirty", 0), traj("dirty", 1, FAILED))
        submit(stub, traj("clean", 0), traj("clean", 1))
        seen = state(stub)
        assert (seen.buffered, seen.quarantined, seen.collected) == (1, 1, 1)
        (incident,) = seen.recent_incidents
        assert (incident.kind, incident.prompt_id, incident.action) == ("dirty_group", "dirty", "quarantined")
        assert "dirty/t1" in incident.message
        with pytest.raises(grpc.RpcError) as caught:  # the trainer hears it, as LoongSage stops on dirty data
            stub.Collect(pb.CollectRequest(num_groups=1), timeout=20)
        assert caught.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert reason_of(caught.value) == "DIRTY_GROUP" and "'dirty'" in caught.value.details()
        groups = stub.Collect(pb.CollectRequest(num_groups=1), timeout=20).groups  # told once; the buffer stays
        assert [g.prompt_id for g in groups] == ["clean"]
        answer = stub.Reset(pb.ResetRequest(wait_seconds=0), timeout=20)
        assert [g.prompt_id for g in answer.quarantined] == ["dirty"]
        assert state(stub).quarantined == 1


def test_train_on_failed_buffers_failed_groups_when_asked(tmp_path):
    with ServerProcess(tmp_path, *SMALL, "rollout.filter=[]", "rollout.train_on_failed=true") as server:
        stub = server.stub()
        dispatch(stub, "dirty")
        submit(stub, traj("dirty", 0), traj("dirty", 1, FAILED))
        assert [g.prompt_id for g in stub.Collect(pb.CollectRequest(num_groups=1), timeout=20).groups] == ["dirty"]


# ----------------------------------------------------------------------------- gates re-checked over time


def test_a_gate_on_an_outside_flag_releases_its_group_without_any_state_change(tmp_path, strategies_dir):
    flag = tmp_path / "open"
    with ServerProcess(tmp_path, *SMALL, f"server.custom_strategy_dirs=[{strategies_dir}]",
                       "fully_async.sliding_window=flag-gate", "fully_async.gate_recheck_seconds=0.2",
                       env={"CODA_TEST_FLAG": str(flag)}) as server:
        stub = server.stub()
        dispatch(stub, "p0")
        submit(stub, traj("p0", 0), traj("p0", 1))
        assert (state(stub).buffered, state(stub).running) == (0, 1)  # complete, held by the gate
        flag.touch()  # nothing the pacer can see changes: only the periodic re-check can release it
        answer = stub.Collect(pb.CollectRequest(num_groups=1, wait_seconds=20), timeout=30)
    assert [g.prompt_id for g in answer.groups] == ["p0"] and not answer.timed_out


class ClockGate(NoWindowStrategy):
    """Opens for every group once `now()` reaches 10 (a gate that depends on time, not on pacer state)."""

    def __init__(self, config, now):
        super().__init__(config)
        self.now = now

    def will_collect(self, group):
        return super().will_collect(group) and self.now() >= 10.0


def clock_gated_pacer(config, clock, journal=None) -> Pacer:
    holder: list[Pacer] = []
    # The gate reads the pacer's clock, which replay sets to the time each recorded change was made.
    strategy = ThreadSafeStrategy(ClockGate(config, lambda: holder[0]._clock()), "clock-gate")
    holder.append(Pacer(config, strategy=strategy, clock=lambda: clock[0], journal=journal))
    return holder[0]


def test_recheck_releases_on_time_and_replays_after_a_restart(core_config, tmp_path):
    config = core_config("no-window", N=1)
    clock = [0.0]
    pacer = clock_gated_pacer(config, clock, SqliteJournal(tmp_path / "state", fsync="off"))
    pacer.dispatch([PromptRef("p0")])
    pacer.submit([Trajectory("p0/t0", "p0")])
    assert pacer.recheck_gates() == 0 and pacer.state().buffered == 0  # t=0: still shut
    clock[0] = 11.0
    assert pacer.recheck_gates(min_age=1.0) == 1  # the last pass was at t=0
    assert pacer.state().buffered == 1
    pacer.journal.close()
    recovered = clock_gated_pacer(config, clock, SqliteJournal(tmp_path / "state", fsync="off"))
    recovered.recover()  # Submit replayed at t=0 (held), then the recorded re-check at t=11 (released)
    assert (recovered.state().buffered, recovered.state().running) == (1, 0)
    recovered.journal.close()


def test_recheck_is_skipped_while_changes_keep_reexamining(core_config):
    config = core_config("no-window", N=1)
    clock = [0.0]
    pacer = clock_gated_pacer(config, clock)
    pacer.dispatch([PromptRef("p0"), PromptRef("p1")])
    pacer.submit([Trajectory("p0/t0", "p0")])
    clock[0] = 9.5
    pacer.dispatch([PromptRef("p2")])  # a change: the held group was re-examined at t=9.5
    clock[0] = 10.2
    assert pacer.recheck_gates(min_age=1.0) == 0  # only 0.7 s since that pass
    clock[0] = 10.6
    assert pacer.recheck_gates(min_age=1.0) == 1


# ----------------------------------------------------------------------------- raising hooks


def test_a_raising_will_collect_quarantines_the_group_and_everyone_hears_of_it(tmp_path, strategies_dir):
    with ServerProcess(tmp_path, *SMALL, f"server.custom_strategy_dirs=[{strategies_dir}]",
                       "fully_async.sliding_window=boom-gate") as server:
        stub = server.stub()
        dispatch(stub, "boom0", "fine0")
        request = pb.SubmitRequest(trajectories=[traj("boom0", 0), traj("boom0", 1)], request_id="s-1")
        with pytest.raises(grpc.RpcError) as caught:
            stub.Submit(request, timeout=20)
        error = caught.value
        assert error.code() == grpc.StatusCode.INTERNAL and reason_of(error) == "STRATEGY_HOOK_FAILED"
        assert "'boom-gate'" in error.details() and "will_collect" in error.details() and "quarantined" in error.details()
        seen = state(stub)
        # The trajectories were accepted; the group left the queue (its slot is free), nothing is stuck.
        assert (seen.submitted, seen.running, seen.quarantined, seen.buffered) == (2, 1, 1, 0)
        (incident,) = seen.recent_incidents
        assert (incident.kind, incident.strategy, incident.hook, incident.prompt_id) == (
            "hook_failed", "boom-gate", "will_collect", "boom0")
        assert "ValueError: cannot judge boom0" in incident.message
        assert stub.Submit(request, timeout=20).duplicates == 2  # a retry finds them accepted
        submit(stub, traj("fine0", 0), traj("fine0", 1))
        with pytest.raises(grpc.RpcError) as caught:  # the trainer's next Collect hears it once
            stub.Collect(pb.CollectRequest(num_groups=1), timeout=20)
        assert caught.value.code() == grpc.StatusCode.INTERNAL and "will_collect" in caught.value.details()
        assert [g.prompt_id for g in stub.Collect(pb.CollectRequest(num_groups=1), timeout=20).groups] == ["fine0"]
        answer = stub.Reset(pb.ResetRequest(wait_seconds=0), timeout=20)
        assert [g.prompt_id for g in answer.quarantined] == ["boom0"] and len(answer.quarantined[0].trajectories) == 2
        final = state(stub)
        assert final.dispatched == final.running + final.collected + final.filtered + final.restored + \
            final.dropped + final.expired + final.quarantined


def test_a_raising_on_dispatched_refuses_the_dispatch_and_changes_nothing(tmp_path, strategies_dir):
    with ServerProcess(tmp_path, *SMALL, f"server.custom_strategy_dirs=[{strategies_dir}]",
                       "fully_async.sliding_window=boom-gate") as server:
        stub = server.stub()
        before = state(stub)
        with pytest.raises(grpc.RpcError) as caught:
            dispatch(stub, "ok0", "nodispatch")
        assert caught.value.code() == grpc.StatusCode.INTERNAL
        assert "on_dispatched" in caught.value.details() and "nothing was admitted" in caught.value.details()
        after = state(stub)
        assert (after.dispatched, after.running, after.capacity) == (before.dispatched, 0, before.capacity)
        assert after.recent_incidents[-1].action == "refused"
        assert [a.prompt_id for a in dispatch(stub, "ok0").admitted] == ["ok0"]  # the pacer goes on


class RaisingOnReset(NoWindowStrategy):
    raise_on_reset = True

    def on_reset(self):
        if RaisingOnReset.raise_on_reset:
            raise RuntimeError("reset failed")
        super().on_reset()


class RaisingOnCollected(NoWindowStrategy):
    def on_collected(self, prompt_id):
        if prompt_id == "bad":
            raise KeyError(prompt_id)
        super().on_collected(prompt_id)


def test_a_raising_on_reset_refuses_the_reset_and_a_later_reset_can_finish(core_config):
    config = core_config("no-window", N=1)
    pacer = Pacer(config, strategy=ThreadSafeStrategy(RaisingOnReset(config), "raising"))
    pacer.dispatch([PromptRef("p0"), PromptRef("p1")])
    pacer.submit([Trajectory("p0/t0", "p0")])
    before = pacer.state()
    RaisingOnReset.raise_on_reset = True
    with pytest.raises(StrategyHookError, match="'raising' hook on_reset raised.*changed nothing"):
        pacer.reset(ResetMode.ABORT, wait=0)
    after = pacer.state()
    assert (after.running, after.buffered, after.generation, after.resetting) == (
        before.running, before.buffered, before.generation, False)
    assert after.paused and after.recent_incidents[-1].hook == "on_reset"
    RaisingOnReset.raise_on_reset = False
    assert pacer.reset(ResetMode.ABORT, wait=0).dropped_prompt_ids == ["p1"]


def test_a_raising_on_collected_quarantines_the_group(core_config):
    config = core_config("no-window", N=1)
    pacer = Pacer(config, strategy=ThreadSafeStrategy(RaisingOnCollected(config), "raising"))
    pacer.dispatch([PromptRef("bad"), PromptRef("good")])
    with pytest.raises(StrategyHookError, match="on_collected"):
        pacer.submit([Trajectory("bad/t0", "bad"), Trajectory("good/t0", "good")])
    st = pacer.state()
    assert (st.running, st.buffered, st.quarantined) == (0, 1, 1) and st.invariant_holds()
    with pytest.raises(StrategyHookError):
        pacer.collect_now(1)
    assert [g.prompt_id for g in pacer.collect_now(1).groups] == ["good"]
    assert [g.prompt_id for g in pacer.reset(ResetMode.ABORT, wait=0).quarantined] == ["bad"]


# ----------------------------------------------------------------------------- buffer order from prompt ids


def test_loongsage_form_prompt_ids_order_the_buffer_by_epoch_then_prompt_number(tmp_path):
    ids = ["epoch1_step3_ds0_prompt2", "epoch0_step2_ds0_prompt116", "epoch1_step3_ds0_prompt1",
           "epoch0_step1_ds0_prompt9"]
    with ServerProcess(tmp_path, *SMALL) as server:
        stub = server.stub()
        dispatch(stub, *ids)
        for prompt_id in ids:  # complete in dispatch order
            submit(stub, traj(prompt_id, 0), traj(prompt_id, 1))
        taken = [g.prompt_id for g in stub.Collect(pb.CollectRequest(num_groups=4), timeout=20).groups]
        assert taken == ["epoch0_step1_ds0_prompt9", "epoch0_step2_ds0_prompt116", "epoch1_step3_ds0_prompt1",
                         "epoch1_step3_ds0_prompt2"]
        other = ["zeta", "alpha", "mid"]  # not in that form: dispatch order
        dispatch(stub, *other)
        for prompt_id in reversed(other):
            submit(stub, traj(prompt_id, 0), traj(prompt_id, 1))
        assert [g.prompt_id for g in stub.Collect(pb.CollectRequest(num_groups=3), timeout=20).groups] == other


def test_explicit_epoch_and_index_win_over_the_prompt_id(core_config):
    pacer = Pacer(core_config("no-window", N=1))
    pacer.dispatch([PromptRef("epoch0_prompt1", epoch=5, index=0), PromptRef("epoch3_prompt0")])
    pacer.submit([Trajectory("a", "epoch0_prompt1"), Trajectory("b", "epoch3_prompt0")])
    assert [g.prompt_id for g in pacer.collect_now(2).groups] == ["epoch3_prompt0", "epoch0_prompt1"]


def test_will_collect_on_the_wire_sees_metadata_and_token_counts(tmp_path):
    seen_path = tmp_path / "seen.txt"
    strategies = tmp_path / "meta"
    strategies.mkdir()
    (strategies / "meta_strategy.py").write_text(textwrap.dedent(f'''
        from coda_server.core.builtin_strategies import NoWindowStrategy
        from coda_server import register_sliding_window_strategy

        @register_sliding_window_strategy("meta-recorder")
        class MetaRecorder(NoWindowStrategy):
            def will_collect(self, group):
                with open({str(seen_path)!r}, "a") as out:
                    for t in group.values():
                        out.write(f"{{t.trajectory_id}} {{dict(t.metadata)}} {{t.num_tokens}} "
                                  f"{{t.start_rollout_weight_version}} {{t.end_rollout_weight_version}}\\n")
                return super().will_collect(group)
        '''))
    with ServerProcess(tmp_path, *SMALL, f"server.custom_strategy_dirs=[{strategies}]",
                       "fully_async.sliding_window=meta-recorder", "data_source.num_trajectories_per_prompt=1",
                       "trainer.mini_batch_size=1") as server:
        stub = server.stub()
        dispatch(stub, "p0")
        submit(stub, pb.Trajectory(trajectory_id="p0/t0", prompt_id="p0", status=OK, token_ids=[5, 6, 7],
                                   logprobs=[-0.1, -0.2, -0.3], metadata={"agent": "swe"}, start_weight_version=2,
                                   end_weight_version=3))
    assert seen_path.read_text() == "p0/t0 {'agent': 'swe'} 3 2 3\n"

