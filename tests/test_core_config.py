"""Configuration: defaults, LoongSage configs unedited, data-source inheritance, validation, doc completeness."""
from __future__ import annotations

import textwrap

import pytest
import yaml
from omegaconf import DictConfig, OmegaConf

from coda_server.core import ConfigError, Pacer, default_config_path, load_config
from coda_server.core.filters import FILTERS
from coda_server.core.strategy import STRATEGIES

BUILTIN_STRATEGIES = ("no-window", "window-gated", "windowed-fifo")

LOONGSAGE_YAML = textwrap.dedent("""\
    # A LoongSage run config: sections the pacer does not read stay as they are, and so do LoongSage's keys
    # under the sections it reads (data_source.dataset, max_response_len_per_trajectory, trainer.save_freq, ...).
    model:
      path: /models/Qwen3-30B-A3B
      dtype: bf16
    actor:
      optim:
        lr: 1.0e-6
      ppo_epochs: 1
      ulysses_sequence_parallel_size: 2
    data_source:
      name: math
      dataset:
        prompt_data_path: ${model.path}/../data/math.parquet
      num_prompts_per_step: 64
      num_trajectories_per_prompt: 8
      max_response_len_per_trajectory: 20480
    data_sources:
      - ${data_source}
      - name: b
        num_trajectories_per_prompt: 4
      - name: c
        num_prompts_per_step: 5
    trainer:
      mini_batch_size: 128
      save_freq: 200
    rollout:
      partial: true
      filter: [status]
      retry_limit: 3
    fully_async:
      enable: true
      sliding_window: windowed-fifo
      stale_steps: 2.0
    """)


@pytest.fixture
def loongsage_file(tmp_path):
    path = tmp_path / "loongsage_run.yaml"
    path.write_text(LOONGSAGE_YAML)
    return path


# ----------------------------------------------------------------------------- loading


def test_defaults_load_and_validate():
    config = load_config()
    assert isinstance(config, DictConfig)
    assert config.fully_async.sliding_window in BUILTIN_STRATEGIES
    # LoongSage's defaults (its conf/default.yaml) for every key both read.
    assert config.fully_async.sliding_window == "no-window"
    assert config.fully_async.stale_steps == 0
    assert config.fully_async.enable is False
    assert len(config.data_sources) == 1
    source = config.data_sources[0]
    assert (source.num_prompts_per_step, source.num_trajectories_per_prompt) == (64, 8)
    assert config.trainer.mini_batch_size == 64
    assert config.rollout.partial is False and list(config.rollout.filter) == ["status"]
    assert config.server.address == "127.0.0.1:50051"
    assert list(config.server.custom_strategy_dirs) == []
    # A Pacer builds from the defaults: C = int(64 * 1.0).
    pacer = Pacer(config)
    assert pacer.state().window_size == 64
    pacer.close()


def test_default_config_file_is_the_packaged_one():
    path = default_config_path()
    assert path.is_file()
    assert yaml.safe_load(path.read_text())["server"]["address"] == "127.0.0.1:50051"


def test_loongsage_config_loads_unedited(loongsage_file):
    config = load_config(loongsage_file)
    # Unrelated sections survive, interpolations into them resolve.
    assert config.model.dtype == "bf16" and config.actor.ppo_epochs == 1
    a, b, c = config.data_sources
    assert a.name == "math" and a.dataset.prompt_data_path == "/models/Qwen3-30B-A3B/../data/math.parquet"
    assert (a.num_prompts_per_step, a.num_trajectories_per_prompt) == (64, 8)
    # `b` inherits B from data_source, sets its own N; `c` the reverse.
    assert (b.name, b.num_prompts_per_step, b.num_trajectories_per_prompt) == ("b", 64, 4)
    assert (c.name, c.num_prompts_per_step, c.num_trajectories_per_prompt) == ("c", 5, 8)
    assert b.max_response_len_per_trajectory == 20480
    assert config.fully_async.sliding_window == "windowed-fifo" and config.fully_async.stale_steps == 2.0
    # Keys the file does not set keep their defaults.
    assert config.server.address == "127.0.0.1:50051"
    pacer = Pacer(config)
    assert pacer.state().window_size == 192
    assert pacer._group_sizes == [8, 4, 8]
    pacer.close()


def test_override_of_data_source_changes_every_entry_that_inherits(loongsage_file):
    config = load_config(loongsage_file, ["data_source.num_prompts_per_step=2", "trainer.mini_batch_size=16"])
    assert [s.num_prompts_per_step for s in config.data_sources] == [2, 2, 5]
    config = load_config(loongsage_file, ["data_source.num_trajectories_per_prompt=2", "trainer.mini_batch_size=8"])
    assert [s.num_trajectories_per_prompt for s in config.data_sources] == [2, 4, 2]


def test_quoted_flow_list_with_interpolation_loads(tmp_path):
    # `${...}` inside a YAML flow list must be quoted (an unquoted `{` opens a flow mapping in any YAML parser).
    path = tmp_path / "flow.yaml"
    path.write_text('data_sources: ["${data_source}", {name: b, num_trajectories_per_prompt: 4}]\n')
    config = load_config(path)
    assert [(s.name, s.num_trajectories_per_prompt) for s in config.data_sources] == [("default", 8), ("b", 4)]


def test_overrides_apply_after_the_file(loongsage_file):
    config = load_config(loongsage_file, ["fully_async.sliding_window=no-window", "fully_async.stale_steps=0.5"])
    assert config.fully_async.sliding_window == "no-window" and config.fully_async.stale_steps == 0.5


def test_malformed_override_is_a_config_error():
    with pytest.raises(ConfigError, match="key=value"):
        load_config(overrides=["fully_async.stale_steps"])


def test_missing_file_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="could not be read"):
        load_config(tmp_path / "nope.yaml")


# ----------------------------------------------------------------------------- validation


def _message(overrides, path=None) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(path, overrides)
    return str(info.value)


def test_negative_stale_steps_names_key_value_and_allowed():
    msg = _message(["fully_async.stale_steps=-0.5"])
    assert "fully_async.stale_steps" in msg and "-0.5" in msg and ">= 0" in msg


@pytest.mark.parametrize("value", ["0", "-3"])
def test_group_size_below_one_names_key_value_and_allowed(value):
    msg = _message([f"data_source.num_trajectories_per_prompt={value}"])
    assert "data_sources[0].num_trajectories_per_prompt" in msg and f"= {value}" in msg and ">= 1" in msg


@pytest.mark.parametrize("value", ["100", "-1", "99999999999"])
def test_a_message_limit_grpc_cannot_take_or_no_call_fits_names_key_value_and_allowed(value):
    """99999999999 stopped start-up with gRPC's OverflowError; 100 started a server that refused every Submit."""
    msg = _message([f"server.max_message_bytes={value}"])
    assert f"server.max_message_bytes = {value}: must be an integer from 65536 (64 KiB) to 2147483647" in msg


def test_group_size_of_a_later_data_source_is_checked(tmp_path):
    path = tmp_path / "two.yaml"
    path.write_text("data_sources:\n  - ${data_source}\n  - name: b\n    num_trajectories_per_prompt: 0\n")
    msg = _message([], path)
    assert "data_sources[1].num_trajectories_per_prompt" in msg and "= 0" in msg


def test_batch_not_a_multiple_of_mini_batch_names_key_value_and_allowed():
    msg = _message(["data_source.num_prompts_per_step=3", "data_source.num_trajectories_per_prompt=2",
                    "trainer.mini_batch_size=4"])
    assert "trainer.mini_batch_size" in msg and "= 4" in msg
    assert "3 x 2" in msg and "multiple" in msg
    # And the valid neighbour loads.
    load_config(overrides=["data_source.num_prompts_per_step=4", "data_source.num_trajectories_per_prompt=2",
                           "trainer.mini_batch_size=4"])


def test_unknown_strategy_lists_every_registered_name():
    msg = _message(["fully_async.sliding_window=queue-aware"])
    assert "fully_async.sliding_window" in msg and "'queue-aware'" in msg
    names = STRATEGIES.names()
    assert set(BUILTIN_STRATEGIES) <= set(names)
    for name in names:
        assert name in msg


def test_unknown_filter_names_key_value_and_allowed():
    msg = _message(["rollout.filter=[status,toxicity]"])
    assert "rollout.filter" in msg and "'toxicity'" in msg
    for name in FILTERS.names():
        assert name in msg
    assert {"status", "reward"} <= set(FILTERS.names())


@pytest.mark.parametrize("override, suggestion", [
    ("fully_async.sliding_window=latency-awre", "; did you mean 'latency-aware'?"),
    ("fully_async.sliding_window=windowed_fifo", "; did you mean 'windowed-fifo'?"),
    ("rollout.filter=[stauts]", "; did you mean 'status'?"),
    ("fully_async.sliding_window=queue-aware", None),  # nothing close: the list alone
])
def test_a_mistyped_plugin_name_gets_the_closest_registered_one(override, suggestion):
    msg = _message([override])
    if suggestion is None:
        assert "did you mean" not in msg
    else:
        assert suggestion in msg


def test_several_problems_are_reported_together():
    msg = _message(["fully_async.stale_steps=-1", "fully_async.sliding_window=nope"])
    assert "fully_async.stale_steps" in msg and "fully_async.sliding_window" in msg


# ----------------------------------------------------------------------------- doc completeness


def _keys_with_lines(node, prefix=""):
    """(dotted key, 0-based line, is_section) for every key of a composed YAML mapping."""
    for key_node, value_node in node.value:
        dotted = f"{prefix}{key_node.value}"
        is_section = isinstance(value_node, yaml.MappingNode)
        yield dotted, key_node.start_mark.line, is_section
        if is_section:
            yield from _keys_with_lines(value_node, dotted + ".")


def test_every_option_in_default_yaml_has_a_comment_line_directly_above():
    text = default_config_path().read_text()
    lines = text.splitlines()
    keys = list(_keys_with_lines(yaml.compose(text)))
    assert len(keys) > 20
    undocumented = [
        dotted for dotted, line, is_section in keys
        if not is_section and not (line > 0 and lines[line - 1].lstrip().startswith("#"))
    ]
    assert undocumented == []


def test_every_loaded_option_is_listed_in_default_yaml():
    """Validation reads nothing the defaults file does not list (so the doc test covers every option)."""
    listed = {dotted for dotted, _, _ in _keys_with_lines(yaml.compose(default_config_path().read_text()))}
    for key in ("fully_async.enable", "fully_async.sliding_window", "fully_async.stale_steps",
                "data_source.num_prompts_per_step", "data_source.num_trajectories_per_prompt", "data_sources",
                "trainer.mini_batch_size", "rollout.partial", "rollout.filter", "server.address",
                "server.custom_strategy_dirs", "server.max_wait_seconds", "server.remembered_generations"):
        assert key in listed


def test_sliding_window_comment_lists_every_builtin_and_filter_comment_every_filter():
    text = default_config_path().read_text()
    lines = text.splitlines()
    keys = {dotted: line for dotted, line, _ in _keys_with_lines(yaml.compose(text))}

    def comment_block_above(line):
        block = []
        line -= 1
        while line >= 0 and lines[line].lstrip().startswith("#"):
            block.append(lines[line])
            line -= 1
        return "\n".join(block)

    window_doc = comment_block_above(keys["fully_async.sliding_window"])
    for name in BUILTIN_STRATEGIES:
        assert name in window_doc
    filter_doc = comment_block_above(keys["rollout.filter"])
    for name in ("status", "reward"):
        assert name in filter_doc


def test_default_yaml_round_trips_through_omegaconf():
    raw = OmegaConf.load(default_config_path())
    assert OmegaConf.select(raw, "fully_async.sliding_window") == load_config().fully_async.sliding_window
