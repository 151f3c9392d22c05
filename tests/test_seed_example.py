"""The seed guide's example strategy ships unchanged but for its import line, and works."""
from __future__ import annotations

from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
GUIDE = REPO.parent / "shared" / "seed" / "custom-sliding-window-guide.txt"
EXAMPLE = REPO / "examples" / "strategies" / "fixed_capacity.py"
IMPORT_LINE = "from coda_server import SlidingWindowStrategy, register_sliding_window_strategy"


def guide_example() -> list[str]:
    lines = GUIDE.read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith('@register_sliding_window_strategy("fixed-capacity")'))
    end = next(i for i in range(start, len(lines)) if lines[i].strip().startswith("return max("))
    return lines[start:end + 1]


@pytest.mark.skipif(not GUIDE.exists(), reason="the seed guide lies in ../shared beside the repository (as in CI)")
def test_example_is_the_guide_code_with_only_an_import_line_added():
    code = [line for line in EXAMPLE.read_text().splitlines() if line.strip()]
    docstring, import_line, *body = code
    assert docstring.startswith('"""') and import_line == IMPORT_LINE
    assert body == [line for line in guide_example() if line.strip()]


def test_example_runs_as_a_plugin_with_the_guides_semantics():
    from coda_server.core import Pacer, PromptRef, load_config

    config = load_config(overrides=[f"server.custom_strategy_dirs=[{EXAMPLE.parent}]",
                                    "fully_async.sliding_window=fixed-capacity", "fully_async.stale_steps=3.0",
                                    "data_source.num_prompts_per_step=4", "data_source.num_trajectories_per_prompt=1",
                                    "trainer.mini_batch_size=1"])
    pacer = Pacer(config)
    # Capacity is B = 4 whatever stale_steps says; running + buffered count against it.
    assert len(pacer.dispatch([PromptRef(f"p{i}") for i in range(10)]).admitted) == 4
    assert pacer.dispatch([PromptRef("x")]).admitted == []
