"""examples/dp_cpu/train.py: a data-parallel trainer (torch.distributed on gloo, DDP) against a real server, and the
docs' data-parallel fragments kept identical to it."""
from __future__ import annotations

import ast
import json
import re
import statistics
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from server_harness import ServerProcess

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "dp_cpu" / "train.py"
STEPS = 2
B = 64  # the default configuration's data_source.num_prompts_per_step: groups trained per step


def example_pieces() -> dict[str, str]:
    """The example's functions the docs show, by name, and run_rank's step loop (as "step loop")."""
    source = EXAMPLE.read_text(encoding="utf-8")
    lines = source.splitlines()
    functions = {node.name: node for node in ast.parse(source).body if isinstance(node, ast.FunctionDef)}
    pieces = {name: "\n".join(lines[functions[name].lineno - 1:functions[name].end_lineno])
              for name in ("train_step", "launch_run", "train_shares", "split_by_tokens", "train_scatter")}
    loop = next(node for node in functions["run_rank"].body if isinstance(node, ast.For))
    pieces["step loop"] = textwrap.dedent("\n".join(lines[loop.lineno - 1:loop.end_lineno]))
    return pieces


def test_the_data_parallel_fragments_are_the_example_s_code():
    """docs/trainer.md shows the example's functions and step loop as they are: edit one, copy it to the other."""
    trainer_md = (ROOT / "docs" / "trainer.md").read_text(encoding="utf-8")
    fragments = [block for block in re.findall(r"```python notest\n(.*?)```", trainer_md, re.DOTALL)
                 if "examples/dp_cpu/train.py" in block.splitlines()[0]]
    assert len(fragments) == 2, "docs/trainer.md shows the per-rank recipe and the scatter recipe"
    shown = "\n".join(fragments)
    missing = [name for name, piece in example_pieces().items() if piece not in shown]
    assert not missing, f"docs/trainer.md's data-parallel fragments differ from examples/dp_cpu/train.py: {missing}"


@pytest.mark.parametrize("recipe, world_size, extra", [
    ("shares", 2, []),
    ("scatter", 3, []),
    ("shares", 2, ["--token-budget", "4096"]),
], ids=["shares", "scatter", "token-budget"])
def test_the_ranks_train_every_group_once_with_equal_parameters(tmp_path, recipe, world_size, extra):
    pytest.importorskip("torch", reason="torch is not installed (optional: the example's trainer needs it)")
    with ServerProcess(tmp_path) as server:
        done = subprocess.run([sys.executable, str(EXAMPLE), "--address", server.address, "--recipe", recipe,
                               "--world-size", str(world_size), "--steps", str(STEPS), *extra],
                              capture_output=True, text=True, timeout=240, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    assert summary["trained_twice"] == 0 and summary["lost"] == 0, summary
    # DDP broadcast rank 0's parameters (each rank seeded its own) and averaged every gradient: equal everywhere.
    assert summary["max_parameter_spread"] == 0.0, summary
    per_rank = summary["groups_trained_per_rank"]
    assert len(per_rank) == world_size and all(per_rank) and sum(per_rank) == summary["groups_trained"]
    assert len(summary["token_imbalance_per_mini_batch"]) == summary["mini_batches"] == STEPS * 8
    if extra:  # cut by tokens: as many mini-batches, of whatever group counts fit the budget
        assert summary["groups_trained"] > 0
    else:  # 8 mini-batches of 8 groups a step
        assert summary["groups_trained"] == STEPS * B
    # Balanced by tokens: the server's split evens its shares out by exchanges; the scatter recipe's greedy split
    # of 8 groups among 3 ranks cannot always.
    bound = 1.05 if recipe == "shares" else 1.2
    assert statistics.median(summary["token_imbalance_per_mini_batch"]) <= bound, summary


def test_a_second_run_against_an_ended_job_says_so_before_any_rank_starts(tmp_path):
    pytest.importorskip("torch", reason="torch is not installed (optional: the example's trainer needs it)")
    from coda_client import PacerClient

    with ServerProcess(tmp_path) as server:
        with PacerClient(server.address) as pacer:
            pacer.end_job("abort", wait=0)
        done = subprocess.run([sys.executable, str(EXAMPLE), "--address", server.address, "--steps", "1"],
                              capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert done.returncode == 1
    assert "has ended its job" in done.stderr and "start a fresh coda-server" in done.stderr, done.stderr[-2000:]
    assert "spawn" not in done.stderr  # no rank was started
