"""coda-sim's command line takes key=value overrides anywhere among its options."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_overrides_before_between_and_after_options_all_apply(tmp_path):
    """Was: `coda-sim: error: unrecognized arguments: fully_async.stale_steps=0.5` for an override after an option
    that follows another override."""
    done = subprocess.run(
        [sys.executable, "-m", "coda_sim", "data_source.num_prompts_per_step=4", "--steps", "1", "--no-progress",
         "trainer.mini_batch_size=8", "--json", "fully_async.stale_steps=0.5", "--seed", "3",
         "fully_async.sliding_window=no-window"],
        capture_output=True, text=True, timeout=300, cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stderr
    [run] = json.loads(done.stdout)
    # Every override applied, wherever it stood: C = int(4 * (1 + 0.5)) = 6.
    assert (run["strategy"], run["stale_steps"], run["capacity"], run["steps"], run["seed"]) == (
        "no-window", 0.5, 6, 1, 3)


def test_an_unknown_option_among_overrides_is_still_refused(tmp_path):
    done = subprocess.run([sys.executable, "-m", "coda_sim", "fully_async.stale_steps=0.5", "--steps", "1",
                           "--no-such-option", "trainer.mini_batch_size=8"],
                          capture_output=True, text=True, timeout=300, cwd=tmp_path,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 2
    assert "unrecognized arguments: --no-such-option" in done.stderr
