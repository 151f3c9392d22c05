"""User findings on plugins, through a real server: a filter or buffer replay strategy name two modules
register stops start-up naming both files (the Registry's rule, as for strategies), a will_collect answer that is no
bool is the strategy's incident at once (the group quarantined, not held silently), and the stall warning names a
custom strategy's own window instead of the formula C that does not bound it."""
from __future__ import annotations

import re
import textwrap
import threading
from pathlib import Path

import grpc
import pytest

from coda_client._proto import pacer_pb2 as pb
from server_harness import ServerProcess, refused_start, until

SMALL = ("data_source.num_prompts_per_step=2", "data_source.num_trajectories_per_prompt=1",
         "trainer.mini_batch_size=1", "fully_async.stale_steps=0", "server.state_dir=")
STALL = "while dispatch admits nothing"


def write_modules(directory: Path, **modules: str) -> Path:
    directory.mkdir()
    for name, text in modules.items():
        (directory / f"{name}.py").write_text(textwrap.dedent(text))
    return directory


# ------------------------------------------------------------------ 1. one name, two modules

FILTER = '''
    from coda_server import register_group_filter

    @register_group_filter("long-enough")
    def {function}(group, min_len=1):
        return {keep}
    '''

REPLAY = '''
    from coda_server import BufferReplayStrategy, register_buffer_replay_strategy

    @register_buffer_replay_strategy("newest-first")
    class {cls}(BufferReplayStrategy):
        def select(self, restored, count, step):
            return list(reversed(restored))[:count]
    '''


def test_a_filter_name_two_modules_register_stops_start_up_naming_both_files(tmp_path):
    """Was: the server started with the first module's filter; only the load warning said the second was skipped."""
    plugins = write_modules(tmp_path / "plugins", a_keep=FILTER.format(function="keep_all", keep="True"),
                            b_keep=FILTER.format(function="keep_none", keep="False"))
    output = refused_start(tmp_path, *SMALL, f"server.custom_strategy_dirs=[{plugins}]",
                           "rollout.filter=[status,long-enough]")
    assert "server exited with 2" in output
    (line,) = [line for line in output.splitlines() if "two modules register" in line]
    for text in ("rollout.filter = 'long-enough': two modules register the group filter name 'long-enough'",
                 f"keep_all in {plugins / 'a_keep.py'} (kept)", f"keep_none in {plugins / 'b_keep.py'} (refused",
                 "give one of them another name (@register_group_filter)"):
        assert text in line, line
    # The clash over a name the configuration does not choose stays a warning: the server starts.
    server = ServerProcess(tmp_path, *SMALL, f"server.custom_strategy_dirs=[{plugins}]", "rollout.filter=[status]")
    server.start().close()


def test_a_buffer_replay_strategy_name_two_modules_register_stops_start_up_naming_both_files(tmp_path):
    plugins = write_modules(tmp_path / "plugins", a_replay=REPLAY.format(cls="NewestFirst"),
                            b_replay=REPLAY.format(cls="NewestFirst2"))
    output = refused_start(tmp_path, *SMALL, f"server.custom_strategy_dirs=[{plugins}]",
                           "data_source.dataset.buffer_replay_strategy=newest-first")
    assert "server exited with 2" in output
    (line,) = [line for line in output.splitlines() if "two modules register" in line]
    for text in ("buffer_replay_strategy = 'newest-first': two modules register the buffer replay strategy name "
                 "'newest-first'", f"NewestFirst in {plugins / 'a_replay.py'} (kept)",
                 f"NewestFirst2 in {plugins / 'b_replay.py'} (refused",
                 "give one of them another name (@register_buffer_replay_strategy)"):
        assert text in line, line


# ------------------------------------------------------------------ 2. a will_collect answer that is no bool

GATES = '''
    import numpy
    from coda_server import SlidingWindowStrategy, register_sliding_window_strategy

    # What will_collect answers, by prompt id.
    ANSWERS = {"forgot": None, "one": 1, "yes": "yes", "np": numpy.bool_(True), "ok": True}


    @register_sliding_window_strategy("odd-gate")
    class OddGate(SlidingWindowStrategy):
        def compute_dispatch_count(self, buf_qsize):
            return max(0, 5 - self._running_count - buf_qsize)

        def will_collect(self, group):
            if not super().will_collect(group):
                return False
            return ANSWERS[next(iter(group.values())).prompt_id]
    '''


def test_a_will_collect_answer_that_is_no_bool_is_the_strategys_incident_at_once(tmp_path):
    """Was: None (a forgotten `return`) read as a refusal: the group held until the next Reset, said only by the stall
    warning after server.collect_stall_warning_seconds."""
    plugins = write_modules(tmp_path / "plugins", gates=GATES)
    with ServerProcess(tmp_path, *SMALL, f"server.custom_strategy_dirs=[{plugins}]",
                       "fully_async.sliding_window=odd-gate") as server:
        stub = server.stub()
        prompts = ["forgot", "one", "yes", "np", "ok"]
        answer = stub.Dispatch(pb.DispatchRequest(candidates=[pb.PromptRef(prompt_id=p) for p in prompts]), timeout=20)
        assert [a.prompt_id for a in answer.admitted] == prompts
        wrong = {"forgot": "None (NoneType)", "one": "1 (int)", "yes": "'yes' (str)"}
        for prompt in prompts:
            request = pb.SubmitRequest(trajectories=[pb.Trajectory(
                trajectory_id=f"{prompt}#0", prompt_id=prompt, status=pb.TRAJECTORY_STATUS_COMPLETED)])
            if prompt not in wrong:
                stub.Submit(request, timeout=20)
                continue
            with pytest.raises(grpc.RpcError) as caught:
                stub.Submit(request, timeout=20)
            details = caught.value.details()
            assert caught.value.code() == grpc.StatusCode.INTERNAL, details
            for text in ("strategy 'odd-gate' hook will_collect", f"for group {prompt!r} returned {wrong[prompt]}, "
                         "not a bool: it must return True or False", "the group was quarantined"):
                assert text in details, details
        state = stub.GetState(pb.GetStateRequest(), timeout=20)
        assert (state.running, state.buffered, state.quarantined) == (0, 2, 3)
        incidents = [(i.kind, i.hook, i.prompt_id, i.action) for i in state.recent_incidents]
        assert incidents == [("hook_failed", "will_collect", p, "quarantined") for p in wrong]
        # Nothing is lost: the next Reset hands the quarantined groups back.
        reset = stub.Reset(pb.ResetRequest(resume=True, weight_version=1), timeout=20)
        assert sorted(g.prompt_id for g in reset.quarantined) == sorted(wrong)
        log = server.log()
    warnings = [line for line in log.splitlines() if "hook will_collect" in line]
    assert len(warnings) == 3 and all("WARNING" in line for line in warnings), warnings  # once each
    assert "Traceback" not in log


# ------------------------------------------------------------------ 3. the stall warning's window

UNBOUNDED = '''
    from coda_server import SlidingWindowStrategy, register_sliding_window_strategy


    @register_sliding_window_strategy("shut-window")
    class ShutWindow(SlidingWindowStrategy):
        def compute_dispatch_count(self, buf_qsize):
            return 0
    '''


def stall_line(tmp_path: Path, *overrides: str, dispatch: tuple = ()) -> str:
    with ServerProcess(tmp_path, *SMALL, "server.collect_stall_warning_seconds=0.2", *overrides) as server:
        stub = server.stub()
        if dispatch:
            stub.Dispatch(pb.DispatchRequest(candidates=[pb.PromptRef(prompt_id=p) for p in dispatch]), timeout=20)
        waiting = threading.Thread(target=lambda: stub.Collect(pb.CollectRequest(num_groups=1, wait_seconds=5),
                                                               timeout=30), daemon=True)
        waiting.start()
        line = until(lambda: next((line for line in server.log().splitlines() if STALL in line), None),
                     "the stall warning")
        waiting.join(30)
    return line


def test_the_stall_warning_names_a_custom_strategys_own_window_not_the_formula_c(tmp_path):
    """Was: `window C = int(B * (1 + stale_steps)) = int(2 * (1 + 0)) = 2 groups (N = 1, strategy shut-window)` for
    a strategy that C does not bound."""
    plugins = write_modules(tmp_path / "plugins", unbounded=UNBOUNDED)
    line = stall_line(tmp_path, f"server.custom_strategy_dirs=[{plugins}]", "fully_async.sliding_window=shut-window")
    assert ("window: strategy shut-window's own (compute_dispatch_count), admitting 0 now, not bounded by "
            "C = int(B * (1 + stale_steps)) (N = 1)") in line, line
    assert not re.search(r"C = int\(B \* \(1 \+ stale_steps\)\) = int\(", line), line


def test_the_stall_warning_still_spells_out_c_for_a_strategy_bounded_by_it(tmp_path):
    line = stall_line(tmp_path, "fully_async.sliding_window=no-window", dispatch=("a", "b"))
    assert "window C = int(B * (1 + stale_steps)) = int(2 * (1 + 0)) = 2 groups (N = 1, strategy no-window)" in line, \
        line
