"""LoongSage run configs as LoongSage writes them: Hydra composition through the real CLI, defaults lists,
LoongSage's defaults, and `rollout.filter` in its mapping form with parameters."""
from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from coda_client._proto import pacer_pb2 as pb
from coda_server.core import ConfigError, Pacer, load_config
from coda_server.core.filters import GroupFilter, create_filters, register_group_filter
from coda_server.core.types import Trajectory, TrajectoryStatus
from server_harness import REPO_ROOT, ServerProcess

# A configuration directory in LoongSage's layout, written for these tests: conf/default.yaml holds the
# framework's defaults (a few of them, with values of our own), conf/<model>/<run>.yaml a run config on top.
DEFAULT_YAML = """\
run_mode: default
checkpoint_path: ???
fully_async:
  enable: false
  sliding_window: no-window
  stale_steps: 0
data_source:
  dataset:
    prompt_data_path: ???
  num_prompts_per_step: 16
  num_trajectories_per_prompt: 4
data_sources:
  - ${data_source}
rollout:
  partial: false
  filter:
    status:
trainer:
  mini_batch_size: 16
"""

RUN_YAML = """\
# @package _global_
# A run config as LoongSage's examples write one: its defaults list starts from /default.
defaults:
  - /default
  - _self_

checkpoint_path: ./checkpoints
fully_async:
  enable: true
  sliding_window: windowed-fifo
  stale_steps: 1.5
data_source:
  num_prompts_per_step: 8
  num_trajectories_per_prompt: 2
rollout:
  partial: true
  filter:
    reward: {}
trainer:
  mini_batch_size: 4
"""


@pytest.fixture
def conf_dir(tmp_path: Path) -> Path:
    conf = tmp_path / "conf"
    (conf / "toy_model").mkdir(parents=True)
    (conf / "default.yaml").write_text(DEFAULT_YAML)
    (conf / "toy_model" / "fully_async_1node.yaml").write_text(RUN_YAML)
    return conf


def run_cli(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    """coda-server with arguments that make it stop at start-up (it exits before serving)."""
    return subprocess.run([sys.executable, "-m", "coda_server", *args], cwd=REPO_ROOT, capture_output=True,
                          text=True, timeout=timeout)


# ----------------------------------------------------------------------------- Hydra composition


def test_cli_composes_a_loongsage_layout_with_hydra_and_getstate_shows_the_composed_values(tmp_path, conf_dir):
    args = ["--config-path", str(conf_dir), "--config-name", "toy_model/fully_async_1node"]
    # Hydra override syntax: a change of a key the config has, and one that adds a key.
    with ServerProcess(tmp_path, "fully_async.stale_steps=2.0", "+rollout.filter.status=false",
                       config_args=args) as server:
        state = server.stub().GetState(pb.GetStateRequest(), timeout=20)
        summary = dict(state.config_summary)
        log = server.log()
    assert state.strategy == "windowed-fifo"
    assert summary["sliding_window"] == "windowed-fifo"
    assert summary["stale_steps"] == "2.0"
    assert summary["num_prompts_per_step"] == "8" and summary["num_trajectories_per_prompt"] == "2"
    assert summary["mini_batch_size"] == "4"
    assert summary["rollout_partial"] == "true" and summary["reset_mode"] == "abort"
    assert summary["window_size"] == "24"  # C = int(B * (1 + stale_steps)) = int(8 * 3.0)
    # default.yaml's `status` came in through the defaults list, the run config added `reward`, the override
    # turned `status` off again (LoongSage's merge rule for filter mappings).
    assert summary["filters"] == "reward"
    assert state.window_size == int(8 * (1 + 2.0))
    # The start-up line shows the effective pacing values too.
    assert "strategy windowed-fifo, B 8, N 2, M 4, stale_steps 2.0, C 24, reset mode abort, filters reward" in log


def test_hydra_overrides_follow_hydras_rules(conf_dir):
    def compose(*overrides):
        return load_config(config_dir=conf_dir, config_name="toy_model/fully_async_1node", overrides=overrides)

    assert compose().fully_async.stale_steps == 1.5
    # A key neither the run config nor the service has is refused, with Hydra's hint to use +key.
    with pytest.raises(ConfigError, match=r"Could not override 'nothere.x'.*\+nothere\.x=1"):
        compose("nothere.x=1")
    assert compose("+nothere.x=1").nothere.x == 1
    assert "checkpoint_path" not in compose("~checkpoint_path")
    # The service's own keys, absent from the run config, take plain key=value, over the merged result.
    config = compose("server.address=127.0.0.1:0", "server.max_wait_seconds=5")
    assert config.server.address == "127.0.0.1:0" and config.server.max_wait_seconds == 5
    assert config.server.shutdown_grace_seconds == 10.0  # the rest of server.* keeps its defaults
    with pytest.raises(ConfigError, match="could not be parsed"):
        compose("fully_async.stale_steps=[1")


def test_unknown_config_name_and_missing_directory_are_named(conf_dir):
    with pytest.raises(ConfigError, match="Cannot find primary config 'toy_model/nope'"):
        load_config(config_dir=conf_dir, config_name="toy_model/nope")
    with pytest.raises(ConfigError, match="not a directory"):
        load_config(config_dir=conf_dir / "absent", config_name="x")


def test_config_path_and_config_name_go_together_and_exclude_config(conf_dir):
    only_name = run_cli("--config-name", "toy_model/fully_async_1node")
    assert only_name.returncode == 2 and "go together" in only_name.stderr
    both = run_cli("--config", str(conf_dir / "default.yaml"), "--config-path", str(conf_dir),
                   "--config-name", "toy_model/fully_async_1node")
    assert both.returncode == 2 and "give one" in both.stderr


# ----------------------------------------------------------------------------- --config and defaults lists


def test_config_file_with_an_unresolvable_defaults_list_stops_and_shows_the_command(conf_dir):
    run = conf_dir / "toy_model" / "fully_async_1node.yaml"
    result = run_cli("--config", str(run))
    assert result.returncode == 2
    assert "defaults: [/default, _self_]" in result.stderr
    assert (f"coda-server --config-path {conf_dir.resolve()} --config-name toy_model/fully_async_1node"
            in result.stderr)
    assert "Traceback" not in result.stderr


def test_config_file_whose_defaults_list_resolves_from_its_directory_is_composed(tmp_path):
    (tmp_path / "base.yaml").write_text("fully_async:\n  sliding_window: window-gated\n  stale_steps: 3\n")
    (tmp_path / "run.yaml").write_text("defaults:\n  - base\n  - _self_\nfully_async:\n  stale_steps: 0.5\n")
    config = load_config(tmp_path / "run.yaml")
    assert config.fully_async.sliding_window == "window-gated"  # from the defaults list
    assert config.fully_async.stale_steps == 0.5  # _self_ last: the file wins
    assert "defaults" not in config


def test_a_defaults_list_of_only_self_is_the_file_itself(tmp_path):
    (tmp_path / "run.yaml").write_text("defaults: [_self_]\nfully_async:\n  stale_steps: 2.0\n")
    config = load_config(tmp_path / "run.yaml")
    assert config.fully_async.stale_steps == 2.0 and "defaults" not in config


# ----------------------------------------------------------------------------- LoongSage's defaults


def test_loongsage_defaults_file_loads_and_means_what_it_means_there(conf_dir):
    config = load_config(conf_dir / "default.yaml")
    assert config.fully_async.sliding_window == "no-window" and config.fully_async.stale_steps == 0
    assert config.rollout.partial is False and list(config.rollout.filter) == ["status"]
    assert Pacer(config).state().window_size == 16  # B * (1 + 0): the window does not double


def test_keys_a_run_config_leaves_out_have_loongsages_defaults(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("data_source:\n  num_prompts_per_step: 32\n")
    config = load_config(path)
    pacer = Pacer(config)
    assert pacer.state().window_size == 32
    assert dict(pacer.state().config_summary)["rollout_partial"] == "false"  # a Reset waits, as there


# ----------------------------------------------------------------------------- filters


def test_filter_mapping_merges_key_by_key_and_false_turns_a_filter_off(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("rollout:\n  filter:\n    reward: {}\n")
    assert list(load_config(path).rollout.filter) == ["status", "reward"]
    assert list(load_config(path, ["rollout.filter.status=false"]).rollout.filter) == ["reward"]
    # The list form replaces instead of merging.
    assert list(load_config(path, ["rollout.filter=[reward]"]).rollout.filter) == ["reward"]
    assert list(load_config(None, ["rollout.filter=[]"]).rollout.filter) == []


@pytest.mark.usefixtures("scratch_registry")
def test_filter_plugins_take_parameters_as_class_or_as_loongsage_function():
    @register_group_filter("min_reward_spread")
    class MinRewardSpread(GroupFilter):
        def __init__(self, config=None, *, spread: float = 0.5):
            super().__init__(config)
            self.spread = spread

        def keep(self, group):
            rewards = [t.reward for t in group.values()]
            return max(rewards) - min(rewards) >= self.spread

    seen = []

    @register_group_filter("short_prompt_ids")
    def short_prompt_ids(traj_group, max_length=8):
        seen.append((traj_group.prompt_id, len(traj_group.trajectories)))
        return traj_group if len(traj_group.prompt_id) <= max_length else None

    config = load_config(None, ["rollout.filter={min_reward_spread: {spread: 2.0}, short_prompt_ids: {max_length: 3}}"])
    assert list(config.rollout.filter) == ["status", {"min_reward_spread": {"spread": 2.0}},
                                           {"short_prompt_ids": {"max_length": 3}}]
    status, spread, short = create_filters(list(config.rollout.filter), config)
    assert spread.spread == 2.0

    def group(prompt_id, *rewards):
        return {f"{prompt_id}/t{i}": Trajectory(f"{prompt_id}/t{i}", prompt_id, reward=r) for i, r in enumerate(rewards)}

    assert spread.keep(group("p1", 0.0, 3.0)) and not spread.keep(group("p1", 0.0, 1.0))
    assert short.keep(group("p1", 1.0)) and not short.keep(group("long-id", 1.0))
    assert seen == [("p1", 1), ("long-id", 1)]
    with pytest.raises(ConfigError, match=r"rollout.filter.min_reward_spread = \{'width': 1\}.*it takes: spread"):
        load_config(None, ["rollout.filter={min_reward_spread: {width: 1}}"])
    with pytest.raises(ConfigError, match=r"rollout.filter.short_prompt_ids = \{'limit': 1\}.*it takes: max_length"):
        load_config(None, ["rollout.filter=[{short_prompt_ids: {limit: 1}}]"])


def test_builtin_filters_refuse_parameters_and_bad_forms_are_named():
    with pytest.raises(ConfigError, match=r"rollout.filter.status = \{'x': 1\}: the filter does not take"):
        load_config(None, ["rollout.filter={status: {x: 1}}"])
    with pytest.raises(ConfigError, match=r"rollout.filter.nope: unknown group filter 'nope'"):
        load_config(None, ["rollout.filter={nope: {}}"])
    with pytest.raises(ConfigError, match=r"rollout.filter = 7: must be a mapping"):
        load_config(None, ["rollout.filter=7"])
    with pytest.raises(ConfigError, match=r"rollout.filter\[0\] = \[1\]"):
        load_config(None, ["rollout.filter=[[1]]"])


def test_status_filter_from_the_mapping_form_drops_failed_groups_in_the_pacer():
    pacer = Pacer(load_config(None, ["data_source.num_prompts_per_step=2", "data_source.num_trajectories_per_prompt=1",
                                     "trainer.mini_batch_size=1"]))
    from coda_server.core import PromptRef

    pacer.dispatch([PromptRef("p0"), PromptRef("p1")])
    pacer.submit([Trajectory("p0/t0", "p0", status=TrajectoryStatus.FAILED),
                  Trajectory("p1/t0", "p1", status=TrajectoryStatus.COMPLETED)])
    state = pacer.state()
    assert (state.filtered, state.buffered) == (1, 1)
    pacer.close()


@pytest.mark.parametrize("override, key", [
    ("fully_async=5", "fully_async = 5: must be a mapping"),
    ("data_source=3", "data_source = 3: must be a mapping"),
    ("fully_async.stale_steps=${nowhere}", "at key fully_async.stale_steps"),
    ("rollout.filter={status: {x: 1}}", "rollout.filter.status"),
])
def test_unloadable_configs_exit_2_naming_the_key_without_a_traceback(conf_dir, override, key):
    result = run_cli("--config", str(conf_dir / "default.yaml"), override)
    assert result.returncode == 2, result.stderr
    assert key in result.stderr
    assert "Traceback" not in result.stderr


def test_configuration_docs_show_the_hydra_command():
    text = (REPO_ROOT / "docs" / "configuration.md").read_text()
    assert "--config-path" in text and "--config-name" in text
    assert textwrap.dedent("defaults: [/default, _self_]") in text
