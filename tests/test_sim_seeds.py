"""coda-sim over several seeds: means with confidence intervals, paired differences, the Pareto plot."""
from __future__ import annotations

import json

import pytest

from coda_sim.cli import main
from coda_sim.stats import aggregate, mean_ci, pareto_front

pytestmark = pytest.mark.usefixtures("scratch_registry")

# A small long-tailed job: B = 8 groups of 4, two fetches a step, so each run takes a fraction of a second.
SMALL = [
    "data_source.num_prompts_per_step=8", "data_source.num_trajectories_per_prompt=4", "trainer.mini_batch_size=16",
    "sim.cluster.rollout_replicas=1", "sim.cluster.slots_per_replica=16", "sim.colocate.rollout_replicas=2",
    "--steps", "4", "--no-progress",
]


def test_mean_ci_by_hand():
    figure = mean_ci([1.0, 2.0, 3.0])
    # sd = 1, t(2 df, 97.5 %) = 4.303: half-width 4.303 / sqrt(3)
    assert figure["mean"] == pytest.approx(2.0)
    assert figure["ci95"] == pytest.approx(4.303 / 3 ** 0.5)
    assert mean_ci([5.0])["ci95"] is None


def test_pareto_front_keeps_only_undominated_points():
    points = [(1.0, 5.0), (2.0, 4.0), (2.0, 6.0), (3.0, 1.0), (3.5, 1.0)]
    assert pareto_front(points) == [0, 1, 3]


def test_aggregate_pairs_each_seed_with_the_baseline():
    per_seed = [
        [{"strategy": "a", "stale_steps": 1.0, "rollout_partial": "abort", "capacity": 8, "steps": 3,
          "avg_step_time_excl_step0": 10.0 + k},
         {"strategy": "b", "stale_steps": 1.0, "rollout_partial": "abort", "capacity": 8, "steps": 3,
          "avg_step_time_excl_step0": 12.0 + 3 * k}]
        for k in range(3)]
    entries = aggregate(per_seed, [0, 1, 2], "a")
    b = entries[1]["metrics"]["avg_step_time_excl_step0"]
    assert b["values"] == [12.0, 15.0, 18.0]
    assert b["diff_vs_baseline"]["values"] == [2.0, 4.0, 6.0]  # paired: b minus a on the same seed
    assert b["diff_vs_baseline"]["mean"] == pytest.approx(4.0)
    assert entries[0]["metrics"]["avg_step_time_excl_step0"]["diff_vs_baseline"]["values"] == [0.0, 0.0, 0.0]


def test_seeds_json_carries_means_intervals_and_paired_differences(capsys):
    assert main(["--strategies", "no-window,windowed-fifo", "--stale-steps", "1.0", "--seeds", "0,1,2",
                 "--baseline", "no-window", "--json", *SMALL]) == 0
    entries = json.loads(capsys.readouterr().out)
    assert [(e["strategy"], e["stale_steps"]) for e in entries] == [("no-window", 1.0), ("windowed-fifo", 1.0)]
    for e in entries:
        assert e["seeds"] == [0, 1, 2] and e["baseline"] == "no-window"
        for key in ("avg_step_time_excl_step0", "staleness_mean", "useful_throughput", "speedup_vs_colocate"):
            figure = e["metrics"][key]
            assert len(figure["values"]) == 3 and figure["ci95"] is not None and figure["ci95"] >= 0
            assert figure["mean"] == pytest.approx(sum(figure["values"]) / 3)
    nw, wf = (e["metrics"]["avg_step_time_excl_step0"] for e in entries)
    assert wf["diff_vs_baseline"]["values"] == pytest.approx([w - n for w, n in zip(wf["values"], nw["values"])])
    # Each seed is its own run: the three values are not all the same.
    assert len(set(nw["values"])) > 1
    # And the same seed on its own gives the value the aggregate holds for it.
    assert main(["--strategies", "no-window", "--stale-steps", "1.0", "--seed", "1", "--json", *SMALL]) == 0
    single = json.loads(capsys.readouterr().out)[0]
    assert single["avg_step_time_excl_step0"] == pytest.approx(nw["values"][1])


def test_seeds_table_and_bad_combinations(capsys):
    assert main(["--strategies", "no-window,windowed-fifo", "--seeds", "3,4", *SMALL]) == 0
    out = capsys.readouterr().out
    assert "±" in out and "minus windowed-fifo (paired)" in out and "seeds 3,4" in out
    assert main(["--seeds", "1,1", *SMALL]) == 2
    assert "each once" in capsys.readouterr().err
    assert main(["--seeds", "1", "--baseline", "nope", *SMALL]) == 2
    assert "--baseline 'nope'" in capsys.readouterr().err
    assert main(["--baseline", "no-window", *SMALL]) == 2
    assert "needs --seeds" in capsys.readouterr().err


def test_pareto_plot_of_every_strategy_and_stale_value(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    assert main(["--strategies", "no-window,windowed-fifo", "--stale-steps", "0.5,1.0", "--seeds", "0,1",
                 "--plot", str(tmp_path), *SMALL]) == 0
    data = (tmp_path / "pareto.png").read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 1000
