"""What a strategy author's mistakes lead to, through a real server: the window's number is checked and clamped
before anything is admitted, a broken strategy stops start-up in one line naming its file (not at the first
Dispatch), a restore() that raises at recovery is not reported as a corrupt snapshot, and hook and import
failures are logged with the file and line they came from."""
from __future__ import annotations

import textwrap
from pathlib import Path

import grpc
import pytest

from coda_client._proto import pacer_pb2 as pb
from server_harness import ServerProcess, refused_start, until

SMALL = ("data_source.num_prompts_per_step=2", "data_source.num_trajectories_per_prompt=2",
         "trainer.mini_batch_size=2", "fully_async.stale_steps=0")
MAX_DISPATCH_COUNT = 2**63 - 1  # the documented bound of the window (coda_server.core.strategy)

STRATEGIES = '''
import math
from coda_server import SlidingWindowStrategy, register_sliding_window_strategy


@register_sliding_window_strategy("huge-window")
class HugeWindow(SlidingWindowStrategy):
    """'No limit', said with a number larger than the wire's uint64."""

    def compute_dispatch_count(self, buf_qsize):
        return 2**64  # a uint64 holds at most 2**64 - 1


# What compute_dispatch_count returns after each Reset: an int first (start-up asks it once), then wrong answers.
ANSWERS = [1, None, 2.7, "3", True, float("nan"), math.inf]


@register_sliding_window_strategy("wrong-answers")
class WrongAnswers(SlidingWindowStrategy):
    def __init__(self, config):
        super().__init__(config)
        self.resets = 0

    def on_reset(self):
        super().on_reset()
        self.resets += 1

    def compute_dispatch_count(self, buf_qsize):
        return ANSWERS[self.resets]


@register_sliding_window_strategy("raising-dispatched")
class RaisingDispatched(SlidingWindowStrategy):
    def compute_dispatch_count(self, buf_qsize):
        return max(0, 2 - self._running_count - buf_qsize)

    def on_dispatched(self, groups):
        raise ZeroDivisionError("boom in on_dispatched")


@register_sliding_window_strategy("no-super-dispatched")
class NoSuperDispatched(SlidingWindowStrategy):
    def __init__(self, config):
        super().__init__(config)
        self.seen = []

    def on_dispatched(self, groups):  # forgot super().on_dispatched(groups): _running_count stays 0
        self.seen.extend(g.prompt_id for g in groups)

    def compute_dispatch_count(self, buf_qsize):
        return max(0, 2 - self._running_count - buf_qsize)


@register_sliding_window_strategy("renamed-key")
class RenamedKey(SlidingWindowStrategy):
    """state() saves "tokens"; restore() reads "token_count" (renamed in a later version of the strategy)."""

    def __init__(self, config):
        super().__init__(config)
        self.tokens = 7

    def compute_dispatch_count(self, buf_qsize):
        return max(0, 2 - self._running_count - buf_qsize)

    def state(self):
        return {"tokens": self.tokens}

    def restore(self, state):
        self.tokens = state["token_count"]
'''


@pytest.fixture
def strategies_dir(tmp_path: Path) -> Path:
    directory = tmp_path / "strategies"
    directory.mkdir()
    (directory / "authored.py").write_text(textwrap.dedent(STRATEGIES))
    return directory


def line_of(path: Path, text: str) -> int:
    """The (1-based) number of the first line of `path` holding `text`."""
    return next(n for n, line in enumerate(path.read_text().splitlines(), 1) if text in line)


def serve(tmp_path: Path, strategies: Path, name: str, *overrides: str) -> ServerProcess:
    return ServerProcess(tmp_path, *SMALL, f"server.custom_strategy_dirs=[{strategies}]",
                         f"fully_async.sliding_window={name}", *overrides).start()


def dispatch(stub, *prompt_ids: str) -> pb.DispatchResponse:
    return stub.Dispatch(pb.DispatchRequest(candidates=[pb.PromptRef(prompt_id=p) for p in prompt_ids]), timeout=20)


def state(stub) -> pb.GetStateResponse:
    return stub.GetState(pb.GetStateRequest(), timeout=20)


# ------------------------------------------------------------------ 1. the window's number

def test_a_window_too_large_for_the_wire_is_clamped_and_dispatch_and_getstate_answer(tmp_path, strategies_dir):
    server = serve(tmp_path, strategies_dir, "huge-window")
    try:
        stub = server.stub()
        answer = dispatch(stub, "a", "b")
        assert [a.prompt_id for a in answer.admitted] == ["a", "b"]
        assert answer.remaining == MAX_DISPATCH_COUNT  # 2**64, clamped: it fits a uint64 (and an int64)
        seen = state(stub)
        assert (seen.running, seen.capacity) == (2, MAX_DISPATCH_COUNT)
    finally:
        server.close()


def test_a_window_that_is_no_int_fails_the_dispatch_as_an_incident_admitting_nothing(tmp_path, strategies_dir):
    # One server walks every wrong answer, one Reset each (start-up asked the first answer, an int).
    server = serve(tmp_path, strategies_dir, "wrong-answers")
    try:
        stub = server.stub()
        for said in ["None (NoneType)", "2.7 (float)", "'3' (str)", "True (bool)", "nan (float)", "inf (float)"]:
            stub.Reset(pb.ResetRequest(resume=True, weight_version=1), timeout=20)
            with pytest.raises(grpc.RpcError) as caught:
                dispatch(stub, "x0", "x1")
            error = caught.value
            assert error.code() == grpc.StatusCode.INTERNAL, error.details()
            details = error.details()
            for text in ("strategy 'wrong-answers'", "hook compute_dispatch_count", f"returned {said}, not an int",
                         "it must return an int", "nothing was admitted"):
                assert text in details, details
            seen = state(stub)
            assert seen.running == 0 and seen.capacity == 0  # nothing admitted; the window reads as 0
            incident = seen.recent_incidents[-1]
            assert (incident.kind, incident.hook, incident.action) == (
                "hook_failed", "compute_dispatch_count", "refused")
            assert f"returned {said}" in incident.message
    finally:
        server.close()


# ------------------------------------------------------------------ 2. restore() raising at recovery

def test_a_restore_that_raises_at_recovery_names_the_strategy_and_says_the_snapshot_is_fine(tmp_path, strategies_dir):
    state_dir = tmp_path / "state"
    server = serve(tmp_path, strategies_dir, "renamed-key", f"server.state_dir={state_dir}")
    try:
        # A Reset snapshots the state, the strategy's state() ({"tokens": 7}) in it.
        server.stub().Reset(pb.ResetRequest(resume=True, weight_version=1), timeout=20)
        assert server.terminate() == 0
    finally:
        server.close()
    output = refused_start(tmp_path, *SMALL, f"server.custom_strategy_dirs=[{strategies_dir}]",
                           "fully_async.sliding_window=renamed-key", f"server.state_dir={state_dir}")
    assert "server exited with 1" in output
    module = strategies_dir / "authored.py"
    where = f"(at {module}, line {line_of(module, 'self.tokens = state[')}, in restore)"
    for text in ("strategy 'renamed-key' hook restore raised: KeyError: 'token_count'", where,
                 "the snapshot itself was read", "do not move it aside"):
        assert text in output, output
    assert "cannot read the state snapshot" not in output
    assert "Traceback" not in output


# ------------------------------------------------------------------ 3. where a hook or an import failed

def test_a_raising_hook_is_logged_once_with_its_traceback(tmp_path, strategies_dir):
    server = serve(tmp_path, strategies_dir, "raising-dispatched")
    try:
        with pytest.raises(grpc.RpcError) as caught:
            dispatch(server.stub(), "p")
        assert caught.value.code() == grpc.StatusCode.INTERNAL
        line = line_of(strategies_dir / "authored.py", 'raise ZeroDivisionError("boom in on_dispatched")')
        frame = f'File "{strategies_dir / "authored.py"}", line {line}, in on_dispatched'
        log = until(lambda: server.log() if frame in server.log() else None, "the hook's traceback in the log")
    finally:
        server.close()
    warning = "WARNING coda_server.strategy: strategy 'raising-dispatched' hook on_dispatched raised: ZeroDivisionError"
    assert log.count(warning) == 1, log
    assert log.count("Traceback (most recent call last)") == 1, log


def test_a_module_failing_at_import_is_skipped_naming_its_file_and_the_line_that_failed(tmp_path, strategies_dir):
    broken = strategies_dir / "sub"
    broken.mkdir()
    (broken / "__init__.py").write_text("")
    (broken / "helper.py").write_text("def load_table():\n    return {'a': 1}['b']\n")
    (broken / "raises_at_import.py").write_text("from .helper import load_table\nTABLE = load_table()\n")
    server = serve(tmp_path, strategies_dir, "huge-window")
    try:
        log = server.log()
    finally:
        server.close()
    skipped = [line for line in log.splitlines() if "skipping custom module" in line]
    assert len(skipped) == 1, log
    assert str(broken / "raises_at_import.py") in skipped[0], skipped
    assert f"KeyError: 'b' (at {broken / 'helper.py'}, line 2, in load_table)" in skipped[0], skipped
    assert "coda_custom_" not in skipped[0]  # the made-up package name says nothing to the author


# ------------------------------------------------------------------ 4. and 5. refused at start-up

BROKEN = {
    "not-derived": ('''
        from coda_server import register_sliding_window_strategy

        @register_sliding_window_strategy("not-derived")
        class Duck:
            def __init__(self, config):
                pass

            def compute_dispatch_count(self, buf_qsize):
                return 1
        ''', ["Duck in {file}", "is a class not derived from SlidingWindowStrategy"]),
    "a-function": ('''
        from coda_server import register_sliding_window_strategy

        @register_sliding_window_strategy("a-function")
        def fn_strategy(config):
            return 3
        ''', ["fn_strategy in {file}", "is a function taking (config), not a class"]),
    "forgot-super": ('''
        from coda_server import SlidingWindowStrategy, register_sliding_window_strategy

        @register_sliding_window_strategy("forgot-super")
        class ForgotSuper(SlidingWindowStrategy):
            def __init__(self, config):
                self.depth = 3

            def compute_dispatch_count(self, buf_qsize):
                return max(0, self.depth - self._running_count - buf_qsize)
        ''', ["ForgotSuper in {file}", "does not call super().__init__(config)"]),
    "window-none": ('''
        from coda_server import SlidingWindowStrategy, register_sliding_window_strategy

        @register_sliding_window_strategy("window-none")
        class WindowNone(SlidingWindowStrategy):
            def compute_dispatch_count(self, buf_qsize):
                pass  # forgot the return
        ''', ["WindowNone in {file}", "compute_dispatch_count(0) returned None (NoneType), not an int"]),
    "window-raises": ('''
        from coda_server import SlidingWindowStrategy, register_sliding_window_strategy

        @register_sliding_window_strategy("window-raises")
        class WindowRaises(SlidingWindowStrategy):
            def compute_dispatch_count(self, buf_qsize):
                return self.depth - buf_qsize
        ''', ["compute_dispatch_count(0) raised AttributeError", "(at {file}, line 7, in compute_dispatch_count)"]),
}


@pytest.mark.parametrize("name", sorted(BROKEN))
def test_a_strategy_that_cannot_work_stops_start_up_in_one_line_naming_its_file(tmp_path, name):
    source, says = BROKEN[name]
    plugins = tmp_path / "plugins"
    plugins.mkdir()
    module = plugins / f"{name.replace('-', '_')}.py"
    module.write_text(textwrap.dedent(source))
    output = refused_start(tmp_path, *SMALL, f"server.custom_strategy_dirs=[{plugins}]",
                           f"fully_async.sliding_window={name}")
    assert "server exited with 2" in output
    lines = output.splitlines()[1:]  # after "server exited with 2:"
    assert len(lines) == 1 and lines[0].startswith(f"coda-server: fully_async.sliding_window = '{name}': "), output
    for text in says:
        assert text.format(file=module) in lines[0], lines[0]


def test_two_modules_registering_the_chosen_name_stop_start_up_naming_both_files(tmp_path, strategies_dir):
    module = '''
        from coda_server import SlidingWindowStrategy, register_sliding_window_strategy

        @register_sliding_window_strategy("depth-window")
        class {cls}(SlidingWindowStrategy):
            def compute_dispatch_count(self, buf_qsize):
                return max(0, {depth} - self._running_count - buf_qsize)
        '''
    plugins = tmp_path / "plugins"
    plugins.mkdir()
    (plugins / "a_depth.py").write_text(textwrap.dedent(module.format(cls="DepthWindow", depth=4)))
    (plugins / "b_depth.py").write_text(textwrap.dedent(module.format(cls="DepthWindow2", depth=6)))
    output = refused_start(tmp_path, *SMALL, f"server.custom_strategy_dirs=[{plugins}]",
                           "fully_async.sliding_window=depth-window")
    assert "server exited with 2" in output
    (line,) = [line for line in output.splitlines() if line.startswith("coda-server:")]
    for text in ("two modules register the sliding_window strategy name 'depth-window'",
                 f"DepthWindow in {plugins / 'a_depth.py'} (kept)", f"DepthWindow2 in {plugins / 'b_depth.py'}"):
        assert text in line, line
    # A clash over a name the configuration does not choose is only warned about: the server starts.
    serve(tmp_path, plugins, "no-window").close()


# ------------------------------------------------------------------ 6. an on_dispatched without super()

def test_an_on_dispatched_override_without_super_is_warned_about_once(tmp_path, strategies_dir):
    server = serve(tmp_path, strategies_dir, "no-super-dispatched")
    try:
        stub = server.stub()
        for i in range(3):  # the strategy never counts them: each Dispatch admits 2 more
            assert len(dispatch(stub, f"a{i}", f"b{i}").admitted) == 2
        assert state(stub).running == 6
        warned = "does NoSuperDispatched.on_dispatched in"
        log = until(lambda: server.log() if warned in server.log() else None, "the warning in the log")
    finally:
        server.close()
    (line,) = [line for line in log.splitlines() if warned in line]
    assert "WARNING" in line and "strategy 'no-super-dispatched'" in line, line
    assert f"{strategies_dir / 'authored.py'} call super().on_dispatched(groups)?" in line, line
