"""The configuration schema (coda_server/core/settings.py) against conf/default.yaml and the docs, and what
start-up does with a key nobody declared: a typo in a file or an override, a bad strategy option (exit 2, two
lines, the closest known key named), while LoongSage's own keys keep loading."""
from __future__ import annotations

import re
import subprocess
import sys
import textwrap

import pytest
import yaml

from coda_server.core import ConfigError, load_config
from coda_server.core.config import strategy_option_sections
from coda_server.core.settings import LOONGSAGE_UNUSED, SCHEMA, setting
from server_harness import REPO_ROOT
from test_ops_docs import default_keys, documented_keys

# Keys whose value in conf/default.yaml is a structure the table shows whole.
WHOLE = {"data_sources", "rollout.filter"}


def declared() -> dict[str, object]:
    """Every key the service reads -> its declared default: the schema's and the strategies' options."""
    keys = {key.path: key.default for key in SCHEMA}
    for section, options in strategy_option_sections().items():
        keys.update({f"{section}.{key.path}": key.default for key in options})
    return keys


def test_conf_default_yaml_holds_exactly_the_declared_keys_with_their_defaults():
    in_file = {key: value for key, value in default_keys().items() if not key.startswith("rollout.filter.")}
    in_file["rollout.filter"] = yaml.safe_load((REPO_ROOT / "conf" / "default.yaml").read_text())["rollout"]["filter"]
    assert sorted(in_file) == sorted(declared()), "declare the key in settings.py and write it into conf/default.yaml"
    wrong = {key: (in_file[key], default) for key, default in declared().items() if in_file[key] != default}
    assert not wrong, f"conf/default.yaml vs the declared default: {wrong}"
    packaged = (REPO_ROOT / "coda_server" / "conf" / "default.yaml").read_text()
    assert packaged == (REPO_ROOT / "conf" / "default.yaml").read_text()


def test_docs_configuration_has_a_row_per_declared_key_and_every_declared_key_a_doc_line():
    documented = documented_keys()
    rows = {key for key in documented if not key.startswith("rollout.filter.")} | {"rollout.filter"}
    assert rows == set(declared()), f"rows vs declared keys: {sorted(rows ^ set(declared()))}"
    for key in SCHEMA + LOONGSAGE_UNUSED:
        assert key.doc and "\n" not in key.doc, key.path
    for options in strategy_option_sections().values():
        assert all(key.doc and "\n" not in key.doc for key in options)


def test_every_accepted_unused_loongsage_key_is_listed_in_coming_from_loongsage():
    page = (REPO_ROOT / "docs" / "coming-from-loongsage.md").read_text()
    missing = [key.path for key in LOONGSAGE_UNUSED if f"`{key.path}`" not in page]
    assert not missing, f"list these in docs/coming-from-loongsage.md: {missing}"


def test_setting_reads_typed_values_and_the_declared_default_when_absent():
    config = load_config(overrides=["server.max_wait_seconds=12.5"])
    assert setting(config, "server.max_wait_seconds") == 12.5
    assert setting({}, "fully_async.gate_recheck_seconds") == 1.0
    assert setting({"rollout": {}}, "rollout.continue_restored") is True


@pytest.mark.parametrize("override, named", [
    ("fully_async.sliding_windw=windowed-fifo", "fully_async.sliding_windw: unknown key (did you mean fully_async.sliding_window?)"),
    ("server.max_wait_secs=3", "server.max_wait_secs: unknown key (did you mean server.max_wait_seconds?)"),
    ("server.tls.cert=/x", "server.tls.cert: unknown key (did you mean server.tls.cert_file?)"),
    ("rollout.partal=true", "rollout.partal: unknown key (did you mean rollout.partial?)"),
    ("trainer.mini_bach_size=4", "trainer.mini_bach_size: unknown key (did you mean trainer.mini_batch_size?)"),
    ("fully_async.latency_aware.quiet_aftr=0.5",
     "fully_async.latency_aware.quiet_aftr: unknown key (did you mean fully_async.latency_aware.quiet_after?)"),
    # Far from every name of its section: the section's names, not a near miss elsewhere sharing the prefix.
    ("server.workers=3", "server.workers: unknown key (known keys here: server.abort_wait_seconds, server.address,"),
    # The right name in the wrong section: the section it belongs to.
    ("rollout.num_trajectories_per_prompt=4",
     "rollout.num_trajectories_per_prompt: unknown key (did you mean data_source.num_trajectories_per_prompt?)"),
    ("fully_async.mini_batch_size=4", "fully_async.mini_batch_size: unknown key (did you mean trainer.mini_batch_size?)"),
    # A near miss of a section the service reads: its settings would be ignored without a word.
    ("fuly_async.stale_steps=1",
     "fuly_async: unknown section (did you mean fully_async?); its settings would not be read"),
    ("servers.address=0.0.0.0:50051", "servers: unknown section (did you mean server?)"),
])
def test_an_unknown_key_in_an_override_is_refused_naming_the_closest_known_key(override, named):
    with pytest.raises(ConfigError) as caught:
        load_config(overrides=[override])
    assert named in str(caught.value)


def test_an_override_whose_value_is_not_yaml_is_named_with_how_to_quote_it():
    # A bare IPv6 address opens a YAML list; the error named neither the override nor the fix.
    with pytest.raises(ConfigError) as caught:
        load_config(overrides=["fully_async.stale_steps=1", "server.address=[::1]:0"])
    assert str(caught.value) == ("override 'server.address=[::1]:0': the value '[::1]:0' does not read as YAML (while "
                                 "parsing a flow node); to pass it as a string, quote it inside the shell's quotes: "
                                 "server.address='\"[::1]:0\"'")
    assert load_config(overrides=['server.address="[::1]:0"']).server.address == "[::1]:0"


def test_loongsages_other_sections_are_accepted_unread():
    """None of LoongSage's top-level names (conf/default.yaml) is taken for a near miss of the service's sections."""
    loongsage = ["run_mode=default", "seed=42", "colocate=true", "checkpoint_path=/c", "hf_model_path=/m",
                 "rollout_data_path=./r", "total_steps=3", "log_level=INFO", "agentflow.router.port=0",
                 "tracking.project_name=p", "megatron.model.bf16=true", "opd.enable=false",
                 "algorithm.advantage_estimator=grpo"]
    assert load_config(overrides=loongsage).fully_async.stale_steps == 0


def test_an_unknown_key_of_a_data_sources_entry_is_named_in_its_own_terms(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("data_sources:\n  - name: a\n  - name: b\n    num_trajectories_per_promt: 4\n")
    with pytest.raises(ConfigError) as caught:
        load_config(path)
    assert ("data_sources[1].num_trajectories_per_promt: unknown key (did you mean "
            "data_sources[1].num_trajectories_per_prompt?)") in str(caught.value)


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "coda_server", *args, "server.metrics_address="], cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=60)


def test_the_server_stops_at_once_with_exit_2_and_two_lines_on_a_typo_in_a_file(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("server:\n  adress: 127.0.0.1:0\n")
    done = run_cli("--config", str(path))
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip().splitlines() == [
        "coda-server: invalid configuration:", "  server.adress: unknown key (did you mean server.address?)"]


def test_a_bad_strategy_option_is_two_lines_and_exit_2_not_a_traceback():
    done = run_cli("fully_async.sliding_window=latency-aware", "fully_async.latency_aware.collect_window=0.5")
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip().splitlines() == [
        "coda-server: invalid configuration:",
        "  fully_async.latency_aware.collect_window = 0.5: must be a number >= 1 (in units of B)"]


# LoongSage's keys under the sections the service reads, with values as its conf/default.yaml and run configs
# write them (baidu-baige/LoongSage conf/): they load, and the service reads none of them.
LOONGSAGE_SECTIONS = textwrap.dedent("""\
    fully_async: {enable: true, sliding_window: windowed-fifo, stale_steps: 1}
    data_source:
      sandbox: {type: k8s, working_dir: /testbed, command_exec_timeout_seconds: 600}
      dataset:
        prompt_data_path: /data/prompts.jsonl
        eval_prompt_data_path: null
        max_prompt_len: null
        input_key: prompt
        label_key: label
        metadata_key: metadata
        shuffle: true
        data_pre_processor: r2e_gym
        buffer_replay_strategy: null
      agent: {name: mini-swe, step_limit: 100}
      reward: {name: dapo_math, overlong_penalty_length: 4096}
      teacher_name: ""
      max_response_len_per_trajectory: 32768
      num_prompts_per_step: 16
      num_trajectories_per_prompt: 8
      completion_params: {top_p: 0.9}
    data_sources:
      - ${data_source}
      - {teacher_name: math_expert, agent: {name: bcp, max_turns: 15}, num_prompts_per_step: 16}
    rollout:
      partial: true
      mask_offpolicy_in_partial_rollout: true
      use_fault_tolerance: true
      retry_limit: 3
      backend: sglang
      num_gpus_per_node: 8
      env_vars: {NCCL_CUMEM_ENABLE: "1"}
      sglang_args: {mem_fraction_static: 0.8, tp_size: 8}
      sglang_replicas: {regular: {num_nodes: 1, num_gpus_per_replica: 8}}
      sampler: {name: dynamic, num_oversample: 4, timeout: 7200}
      filter: {status: null, reward: {}}
      eval: {interval: -1, temperature: null}
    trainer:
      backend: megatron
      num_nodes: 1
      num_gpus_per_node: 8
      use_rollout_log_probs: false
      use_rollout_routing_replay: true
      use_fp32_lm_head: true
      temperature: 1.0
      mini_batch_size: 128
      micro_batch_size: 8
      max_tokens_per_gpu: 16440
      use_dynamic_batch_size: false
      deterministic_mode: false
      nccl_timeout_minutes: null
      gloo_timeout_minutes: null
      save_freq: -1
      async_save: true
      save_checkpoint: true
      save_hf: false
      env_vars: {PYTORCH_ALLOC_CONF: "expandable_segments:True"}
    """)


def test_loongsages_keys_under_the_service_sections_load_as_accepted_and_unused(tmp_path):
    path = tmp_path / "loongsage.yaml"
    path.write_text(LOONGSAGE_SECTIONS)
    config = load_config(path)
    assert [s.num_trajectories_per_prompt for s in config.data_sources] == [8, 8]
    assert config.trainer.micro_batch_size == 8 and config.rollout.sglang_args.tp_size == 8
    declared_unused = {key.path for key in LOONGSAGE_UNUSED}
    assert re.search(r"\bteacher_name\b", LOONGSAGE_SECTIONS) and "data_source.teacher_name" in declared_unused


def test_a_custom_strategys_declared_options_are_checked_at_start_up_and_read_typed(scratch_registry):
    from coda_server.core.settings import Key, read_options
    from coda_server.core.strategy import SlidingWindowStrategy, register_sliding_window_strategy

    @register_sliding_window_strategy("my-strategy")
    class MyStrategy(SlidingWindowStrategy):
        options = (Key("depth", "int", 4, "Groups admitted beyond the running ones", low=1),)

        def __init__(self, config):
            super().__init__(config)
            self.depth = read_options(config, "fully_async.my_strategy", self.options)["depth"]

        def compute_dispatch_count(self, buf_qsize: int) -> int:
            return max(0, self.depth - self._running_count - buf_qsize)

    with pytest.raises(ConfigError) as caught:
        load_config(overrides=["fully_async.sliding_window=my-strategy", "fully_async.my_strategy.depht=2"])
    assert "fully_async.my_strategy.depht: unknown key (did you mean fully_async.my_strategy.depth?)" in str(caught.value)
    with pytest.raises(ConfigError, match=r"fully_async.my_strategy.depth = 0: must be an integer >= 1"):
        load_config(overrides=["fully_async.sliding_window=my-strategy", "fully_async.my_strategy.depth=0"])
    from coda_server.core import Pacer
    pacer = Pacer(load_config(overrides=["fully_async.sliding_window=my-strategy"]))
    assert pacer.strategy.depth == 4  # the declared default
    pacer.close()
