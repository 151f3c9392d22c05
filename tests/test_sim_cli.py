"""The coda-sim command: JSON-only stdout, the table, plots, presets and error messages."""
from __future__ import annotations

import builtins
import json
import subprocess
import sys

import pytest

from coda_sim.cli import main

# A tiny hand-sized job (see test_sim_behaviour.TINY) so each command runs in well under a second.
TINY = [
    "data_source.num_prompts_per_step=4", "data_source.num_trajectories_per_prompt=2", "trainer.mini_batch_size=4",
    "sim.reward.filtered_group_prob=0.25", "sim.generation.length.median=100", "sim.generation.length.cap=400",
    "sim.generation.length.min=1", "sim.generation.decode.tokens_per_s_single=20.0",
    "sim.generation.decode.tokens_per_s_full=10.0", "sim.cluster.rollout_replicas=1",
    "sim.cluster.slots_per_replica=8", "sim.colocate.rollout_replicas=2", "sim.trainer.per_token_s=0.001",
]
REQUIRED_KEYS = {"strategy", "stale_steps", "avg_step_time", "speedup_vs_colocate", "trainer_wait_ratio",
                 "pipeline_buf_size_mean", "staleness_mean", "partial_ratio"}
BUILTINS = {"no-window", "window-gated", "windowed-fifo"}


def test_json_is_the_only_stdout_and_has_every_key(capsys):
    assert main(["--compare", "--stale-steps", "1.0,2.0", "--steps", "3", "--json", *TINY]) == 0
    out, err = capsys.readouterr()
    runs = json.loads(out)  # nothing but JSON on stdout
    assert isinstance(runs, list) and len(runs) >= 6
    assert {(r["strategy"], r["stale_steps"]) for r in runs} >= {(s, v) for s in BUILTINS for v in (1.0, 2.0)}
    for run in runs:
        assert REQUIRED_KEYS <= set(run)
        assert run["steps"] == 3 and run["speedup_vs_colocate"] > 0
    assert "run 1/" in err  # progress goes to stderr


def test_console_script_module_entry_json_parses():
    proc = subprocess.run([sys.executable, "-m", "coda_sim", "--steps", "2", "--json", "--seed", "5", *TINY],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    runs = json.loads(proc.stdout)
    assert [r["strategy"] for r in runs] == ["windowed-fifo"]  # the long_tail preset's configured strategy
    assert runs[0]["seed"] == 5 and REQUIRED_KEYS <= set(runs[0])


def test_table_has_the_report_rows(capsys):
    assert main(["--strategies", "no-window,window-gated", "--steps", "3", "--no-progress", *TINY]) == 0
    out = capsys.readouterr().out
    for row in ("avg step time, all steps", "avg step time, excl. step 0", "speedup vs colocate",
                "trainer wait ratio", "generation utilisation", "pipeline_buf_size mean", "partial_ratio",
                "partial_span_max", "restored groups", "dropped groups", "staleness p50 / p99 / max",
                "order bias"):
        assert row in out
    assert "no-window s=2" in out and "window-gated s=2" in out  # long_tail's stale_steps


def test_same_seed_same_json(capsys):
    args = ["--compare", "--steps", "3", "--json", "--no-progress", "--seed", "3", *TINY]
    main(args)
    first = json.loads(capsys.readouterr().out)
    main(args)
    second = json.loads(capsys.readouterr().out)
    for a, b in zip(first, second):
        a.pop("wall_seconds"), b.pop("wall_seconds"), a.pop("events_per_second"), b.pop("events_per_second")
    assert first == second


def test_plot_writes_three_pngs(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    assert main(["--strategies", "no-window,windowed-fifo", "--steps", "2", "--no-progress",
                 "--plot", str(tmp_path / "figs"), *TINY]) == 0
    for name in ("timeline.png", "staleness.png", "comparison.png"):
        data = (tmp_path / "figs" / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 1000


def test_plot_without_matplotlib_is_a_clear_error(monkeypatch, capsys, tmp_path):
    real_import = builtins.__import__

    def no_matplotlib(name, *args, **kwargs):
        if name == "matplotlib" or name.startswith("matplotlib."):
            raise ImportError("No module named 'matplotlib'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_matplotlib)
    assert main(["--steps", "1", "--plot", str(tmp_path), *TINY]) == 2
    err = capsys.readouterr().err
    assert "matplotlib" in err and "coda-pacer[plot]" in err


@pytest.mark.parametrize("args, message", [
    (["sim.cluster.replicas=3"], "replicas"),
    (["--strategies", "nope"], "unknown strategy 'nope'"),
    (["--stale-steps", "x"], "--stale-steps"),
    (["--preset", "nope"], "unknown preset"),
    (["fully_async.stale_steps=-2"], "fully_async.stale_steps"),
    (["sim.generation.length.sigma=-1"], "sigma"),
    (["not-an-override"], "key=value"),
])
def test_bad_input_exits_2_with_a_message(args, message, capsys):
    assert main([*args, "--steps", "1", "--no-progress"]) == 2
    assert message in capsys.readouterr().err


def test_list_presets(capsys):
    assert main(["--list-presets"]) == 0
    assert "long_tail" in capsys.readouterr().out


def test_config_file_and_custom_strategy_dir(tmp_path, capsys):
    from pathlib import Path

    examples = Path(__file__).resolve().parents[1] / "examples" / "strategies"
    config = tmp_path / "job.yaml"
    config.write_text("fully_async:\n  sliding_window: fixed-capacity\n  stale_steps: 1.0\n"
                      f"server:\n  custom_strategy_dirs: [{examples}]\n"
                      "sim:\n  steps: 2\n  cluster:\n    rollout_replicas: 1\n")
    assert main(["--config", str(config), "--json", "--no-progress", *TINY]) == 0
    runs = json.loads(capsys.readouterr().out)
    assert [r["strategy"] for r in runs] == ["fixed-capacity"] and runs[0]["steps"] == 2


@pytest.mark.parametrize("overrides, message", [
    (["sim.steps=abc"], "sim.steps = 'abc': must be an integer >= 1"),
    (["sim.steps=2.5"], "sim.steps = 2.5: must be an integer >= 1"),
    (["sim.seed=abc"], "sim.seed = 'abc': must be an integer"),
    (["sim=5"], "sim = 5: must be a mapping of seed, steps"),
    (["sim.cluster=5"], "sim.cluster = 5: must be a mapping of rollout_replicas"),
    (["server.tls=5"], "server.tls = 5: must be a mapping of cert_file"),
])
def test_a_sim_value_of_the_wrong_kind_exits_2_naming_key_and_value(overrides, message, capsys):
    assert main([*overrides, "--no-progress"]) == 2  # no --steps: it would override sim.steps
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("content, message", [
    ("fully_async:\n  sliding_window: no-window\n   stale_steps: 1\n", "is not valid YAML: mapping values are not allowed"),
    ("sim:\n  steps: abc\n", "sim.steps = 'abc': must be an integer >= 1"),
    ("sim: 5\n", "sim = 5: must be a mapping of"),
    ("- 1\n- 2\n", "must hold a mapping of configuration keys (pacer sections and a sim: section), not a list"),
])
def test_a_bad_config_file_exits_2_with_one_line_and_no_traceback(tmp_path, content, message):
    path = tmp_path / "job.yaml"
    path.write_text(content)
    proc = subprocess.run([sys.executable, "-m", "coda_sim", "--config", str(path), "--no-progress"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr and message in proc.stderr, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr


@pytest.mark.parametrize("args, message", [
    (["--stale-steps", "1,,2"], "--stale-steps '1,,2': must be comma-separated numbers"),
    (["--stale-steps", ""], "--stale-steps '': must be comma-separated numbers"),
    (["--seeds", ""], "--seeds '': must be comma-separated integers"),
    (["--seeds", "0,,1"], "--seeds '0,,1': must be comma-separated integers"),
])
def test_an_empty_item_in_a_list_option_is_refused(args, message, capsys):
    assert main([*args, "--steps", "1", "--no-progress", *TINY]) == 2
    assert message in capsys.readouterr().err
