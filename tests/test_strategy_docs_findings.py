"""A user's test of custom pacing strategies: the stall warning names what holds the trainer (the strategy's gate or
its window, not the workers), coda-sim simulates strategies not bounded by C (the docs' token-budget) with workers of
bounded room and reports a raising hook in one line, and a strategies directory imports its helpers relatively."""
from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from coda_client import PacerClient, Trajectory, TrajectoryStatus
from coda_server.core.collect_stalls import CollectStalls
from conftest import core_overrides
from server_harness import ServerProcess

pytestmark = pytest.mark.usefixtures("scratch_registry")

ROOT = Path(__file__).resolve().parents[1]
CONDITION_TIMEOUT = 60.0
STALL = "while dispatch admits nothing"

# Two strategies that hold the trainer until a flag file appears (so each test ends its own wait): one whose
# will_collect refuses every complete group (False; a forgotten `return`'s None is the strategy's incident at once:
# tests/test_plugin_findings.py), one whose window stays at 0.
HOLDING = '''
import os
from coda_server import SlidingWindowStrategy, register_sliding_window_strategy
from coda_server.core.settings import Key, read_options


@register_sliding_window_strategy("gate-forgot-return")
class GateForgotReturn(SlidingWindowStrategy):
    options = (Key("flag", "str", "", "file that opens the gate"),)

    def __init__(self, config):
        super().__init__(config)
        self.flag = read_options(config, "fully_async.gate_forgot_return", self.options)["flag"]
        self.b = int(config.data_sources[0].num_prompts_per_step)

    def compute_dispatch_count(self, buf_qsize):
        return max(0, self.b - self._running_count - buf_qsize)

    def will_collect(self, group):
        ok = super().will_collect(group)
        return ok if os.path.exists(self.flag) else False


@register_sliding_window_strategy("closed-window")
class ClosedWindow(SlidingWindowStrategy):
    options = (Key("flag", "str", "", "file that opens the window"),)

    def __init__(self, config):
        super().__init__(config)
        self.flag = read_options(config, "fully_async.closed_window", self.options)["flag"]

    def compute_dispatch_count(self, buf_qsize):
        return 1 - self._running_count - buf_qsize if os.path.exists(self.flag) else 0
'''


def stall_line(server: ServerProcess) -> str:
    deadline = time.monotonic() + CONDITION_TIMEOUT
    while STALL not in server.log():
        assert time.monotonic() < deadline, f"no stall warning logged:\n{server.log()}"
        time.sleep(0.05)
    return next(line for line in server.log().splitlines() if STALL in line)


def holding_server(tmp_path: Path, strategy: str, *extra: str) -> ServerProcess:
    plugins = tmp_path / "strategies"
    plugins.mkdir()
    (plugins / "holding.py").write_text(HOLDING)
    section = strategy.replace("-", "_")
    return ServerProcess(tmp_path, *core_overrides(strategy, B=2, stale=0.0, N=1),
                         f"server.custom_strategy_dirs=[{plugins}]", f"fully_async.{section}.flag={tmp_path / 'open'}",
                         "server.collect_stall_warning_seconds=0.2", *extra)


def test_the_stall_warning_blames_the_strategys_gate_for_complete_groups_it_holds(tmp_path):
    """Was: `0 buffered, 2 running ...; running groups must complete (are workers generating?)` though both groups
    were complete and held by the strategy's will_collect."""
    with holding_server(tmp_path, "gate-forgot-return") as server:
        with PacerClient(server.address) as worker, PacerClient(server.address) as trainer:
            assert list(worker.dispatch(["a", "b"]).admitted) == ["a", "b"]
            worker.submit([Trajectory(trajectory_id=f"{p}#0", prompt_id=p, status=TrajectoryStatus.COMPLETED)
                           for p in ("a", "b")])
            answer: dict = {}
            waiting = threading.Thread(target=lambda: answer.update(groups=trainer.collect(1, wait=120)), daemon=True)
            waiting.start()
            line = stall_line(server)
            assert "0 buffered, 2 running" in line
            assert "all 2 complete group(s) are held by strategy gate-forgot-return's will_collect" in line
            assert "workers have nothing left to generate" in line
            assert "are workers generating?" not in line
            (tmp_path / "open").touch()  # the gate opens; the periodic re-check releases the groups
            waiting.join(CONDITION_TIMEOUT)
            assert [g.prompt_id for g in answer["groups"]] == ["a"]


def test_the_stall_warning_blames_the_strategys_window_when_nothing_runs(tmp_path):
    """Was: `0 buffered, 0 running ...; running groups must complete (are workers generating?)` though nothing ran
    and the strategy's window (compute_dispatch_count 0) was what refused."""
    with holding_server(tmp_path, "closed-window") as server:
        with PacerClient(server.address) as worker, PacerClient(server.address) as trainer:
            assert list(worker.dispatch(["a"]).admitted) == []
            answer: dict = {}
            waiting = threading.Thread(target=lambda: answer.update(groups=trainer.collect(1, wait=120)), daemon=True)
            waiting.start()
            line = stall_line(server)
            assert "0 buffered, 0 running" in line
            assert ("nothing is running: strategy closed-window's window (compute_dispatch_count) admits 0 with 0 "
                    "buffered, so only the strategy can let groups in; workers cannot") in line
            assert "are workers generating?" not in line
            (tmp_path / "open").touch()
            assert list(worker.dispatch(["a"]).admitted) == ["a"]
            worker.submit([Trajectory(trajectory_id="a#0", prompt_id="a", status=TrajectoryStatus.COMPLETED)])
            waiting.join(CONDITION_TIMEOUT)
            assert [g.prompt_id for g in answer["groups"]] == ["a"]


def test_the_stall_hint_for_each_holder():
    hint = CollectStalls._hint
    assert hint("s", running=3, buffered=0, held=1, aborted=0) == (
        "; 1 complete group(s) are held by strategy s's will_collect, which refused them so far: only the strategy "
        "can let them go (it is asked again when its state changes and every fully_async.gate_recheck_seconds), or "
        "a Reset returns them; the other 2 running group(s) must complete (are workers generating?)")
    assert "(1 of them hold an ABORTED trajectory" in hint("s", running=2, buffered=0, held=2, aborted=1)
    assert hint("s", running=0, buffered=1, held=0, aborted=0).endswith(
        "(or the trainer takes the 1 buffered in a smaller Collect); workers cannot")
    assert hint("s", running=2, buffered=0, held=0, aborted=0) == (
        "; running groups must complete (are workers generating?) or the trainer must take what is buffered")


# ------------------------------------------------------------------ coda-sim

# A hand-sized job: B = 4 groups of N = 2, one fetch per step, responses 100 tokens at 10 tok/s.
TINY = [
    "data_source.num_prompts_per_step=4", "data_source.num_trajectories_per_prompt=2", "trainer.mini_batch_size=8",
    "rollout.filter=[status]", "sim.reward.filtered_group_prob=0.0",
    "sim.generation.length.distribution=constant", "sim.generation.length.median=100",
    "sim.generation.length.min=1", "sim.generation.decode.tokens_per_s_single=10.0",
    "sim.generation.decode.tokens_per_s_full=10.0", "sim.trainer.minibatch_fixed_s=4.0",
    "sim.trainer.per_token_s=0.0", "sim.trainer.weight_sync_s=1.0", "sim.cluster.rollout_replicas=1",
    "sim.cluster.slots_per_replica=64", "sim.colocate.rollout_replicas=1", "sim.steps=4",
]


def docs_block(heading_text: str) -> str:
    """The first Python block of docs/custom-strategies.md after `heading_text`."""
    text = (ROOT / "docs" / "custom-strategies.md").read_text()
    return text[text.index(heading_text):].split("```python\n", 1)[1].split("```", 1)[0]


def test_coda_sim_simulates_the_docs_token_budget_strategy_with_workers_of_bounded_room(tmp_path):
    """Was: exit 1, `no progress in step 0: 6400 fresh prompts started ... do the filters ['status'] drop (nearly)
    every group?`: the simulated workers proposed every group the strategy admitted, which grows without bound."""
    from coda_sim import load_sim_config, simulate

    (tmp_path / "token_budget.py").write_text(docs_block("Example: a strategy that lets one more group run"))
    # Responses of 2000 tokens: every trajectory submitted lets 20 more groups in.
    overrides = TINY + [f"server.custom_strategy_dirs=[{tmp_path}]", "sim.generation.length.median=2000"]
    run = simulate(load_sim_config(overrides=overrides), "token-budget", 1.0, check_invariants=True,
                   with_colocate=False)  # the invariants checked include the workers' room (2 x C = 16 groups)
    assert run.totals["consumed"] == 4 * 4 and run.fates["filtered"] == 0
    small = load_sim_config(overrides=overrides + ["sim.cluster.worker_max_groups=3"])
    run = simulate(small, "token-budget", 1.0, check_invariants=True, with_colocate=False)  # room for 3 groups
    assert run.totals["consumed"] == 4 * 4


def test_coda_sim_blames_a_strategy_that_admits_far_more_than_the_trainer_takes_not_the_filters(tmp_path):
    from coda_sim import SimulationError, load_sim_config, simulate

    (tmp_path / "unbounded.py").write_text(
        "from coda_server import SlidingWindowStrategy, register_sliding_window_strategy\n\n"
        "@register_sliding_window_strategy('sim-unbounded')\n"
        "class Unbounded(SlidingWindowStrategy):\n"
        "    def compute_dispatch_count(self, buf_qsize):\n"
        "        return 10 ** 6\n")
    # Responses of one token, a trainer that takes 1000 s a fetch: workers churn through prompts meanwhile.
    config = load_sim_config(overrides=TINY + [f"server.custom_strategy_dirs=[{tmp_path}]",
                                               "sim.generation.length.median=1", "sim.trainer.minibatch_fixed_s=1000"])
    with pytest.raises(SimulationError) as stopped:
        simulate(config, "sim-unbounded", 1.0, with_colocate=False)
    message = str(stopped.value)
    assert "(0 groups filtered this step" in message and "drop (nearly) every group" not in message
    assert "strategy 'sim-unbounded' admits more than the trainer takes" in message
    assert "count the buffered groups (buf_qsize)" in message and "sim.cluster.worker_max_groups = 16" in message


def test_coda_sim_says_a_stall_is_the_strategys_gate_holding_complete_groups(tmp_path):
    from coda_sim import SimulationError, load_sim_config, simulate

    (tmp_path / "forgot.py").write_text(
        "from coda_server import SlidingWindowStrategy, register_sliding_window_strategy\n\n"
        "@register_sliding_window_strategy('sim-forgot-return')\n"
        "class ForgotReturn(SlidingWindowStrategy):\n"
        "    def compute_dispatch_count(self, buf_qsize):\n"
        "        return 4 - self._running_count - buf_qsize\n\n"
        "    def will_collect(self, group):\n"
        "        return False  # refuses every group\n")
    config = load_sim_config(overrides=TINY + [f"server.custom_strategy_dirs=[{tmp_path}]"])
    with pytest.raises(SimulationError, match=r"stalled .* running 4 \(4 of them complete, held by the strategy's "
                                              r"will_collect\), buffered 0"):
        simulate(config, "sim-forgot-return", 1.0, with_colocate=False)


RAISING = '''
from coda_server import SlidingWindowStrategy, register_sliding_window_strategy


class Bounded(SlidingWindowStrategy):
    def __init__(self, config):
        super().__init__(config)
        self.b = int(config.data_sources[0].num_prompts_per_step)

    def compute_dispatch_count(self, buf_qsize):
        return max(0, self.b - self._running_count - buf_qsize)


@register_sliding_window_strategy("sim-raises-on-consumed")
class RaisesOnConsumed(Bounded):
    def on_consumed(self, groups):
        raise KeyError("no such step")


@register_sliding_window_strategy("sim-raises-on-submitted")
class RaisesOnSubmitted(Bounded):
    def on_submitted(self, trajectory):
        raise KeyError("no such step")
'''


def coda_sim(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "coda_sim", "--no-progress", "--steps", "2", *TINY,
                           f"server.custom_strategy_dirs=[{tmp_path}]", *args],
                          capture_output=True, text=True, timeout=300, cwd=tmp_path,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})


@pytest.mark.parametrize("hook", ["on_consumed", "on_submitted"])
def test_a_hook_that_raises_in_coda_sim_is_one_line_naming_strategy_hook_and_exception(tmp_path, hook):
    """Was: a full Python traceback ending in StrategyHookError."""
    (tmp_path / "raising.py").write_text(RAISING)
    strategy = f"sim-raises-{hook.replace('_', '-')}"
    done = coda_sim(tmp_path, "--strategies", strategy)
    assert done.returncode == 1, done.stderr
    assert done.stdout == ""
    [line] = done.stderr.splitlines()
    assert line.startswith(f"coda-sim: strategy '{strategy}' hook {hook} raised KeyError: 'no such step' at t=")
    assert line.endswith("; --debug shows the traceback")
    debug = coda_sim(tmp_path, "--strategies", strategy, "--debug")
    assert debug.returncode == 1
    assert "Traceback (most recent call last)" in debug.stderr
    assert debug.stderr.splitlines()[-1].startswith(f"coda-sim: strategy '{strategy}' hook {hook} raised")
    if hook == "on_submitted":  # raised inside the call that failed: the traceback reaches the strategy's line
        assert 'raise KeyError("no such step")' in debug.stderr


def test_the_workers_room_is_a_checked_sim_key(capsys):
    from coda_sim.cli import main

    assert main(["--no-progress", *TINY, "sim.cluster.worker_max_groups=-1"]) == 2
    assert "sim.cluster.worker_max_groups = -1: must be an integer >= 0" in capsys.readouterr().err


# ------------------------------------------------------------------ a strategies directory's helpers


def test_a_strategies_directory_imports_its_helper_relatively_and_a_plain_import_is_skipped(tmp_path, caplog):
    """What docs/custom-strategies.md says: `from .helper import ...` works, a plain `import helper` does not."""
    from coda_server.core.plugins import load_custom_modules
    from coda_server.core.strategy import STRATEGIES

    (tmp_path / "helper.py").write_text("LIMIT = 3\n")
    (tmp_path / "relative.py").write_text(
        "from coda_server import SlidingWindowStrategy, register_sliding_window_strategy\n"
        "from .helper import LIMIT\n\n"
        "@register_sliding_window_strategy('helper-relative')\n"
        "class Relative(SlidingWindowStrategy):\n"
        "    def compute_dispatch_count(self, buf_qsize):\n"
        "        return LIMIT\n")
    (tmp_path / "plain.py").write_text(
        "from coda_server import SlidingWindowStrategy, register_sliding_window_strategy\n"
        "import helper\n\n"
        "@register_sliding_window_strategy('helper-plain')\n"
        "class Plain(SlidingWindowStrategy):\n"
        "    def compute_dispatch_count(self, buf_qsize):\n"
        "        return helper.LIMIT\n")
    load_custom_modules([str(tmp_path)])
    assert "helper-relative" in STRATEGIES.names() and "helper-plain" not in STRATEGIES.names()
    assert "No module named 'helper'" in caplog.text
