"""A RolloutWorker in a process of its own, for tests that kill, stop or cut off a worker:
`python tests/fault_worker.py ADDRESS WORKER_ID PROMPTS SECONDS_PER_TOKEN [MAX_GROUPS]` generates the prompts
p0..p{PROMPTS-1} with a FakeEngine (64-token responses at SECONDS_PER_TOKEN each) until stopped or killed."""
from __future__ import annotations

import logging
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from coda_worker import ListPromptSource, Prompt, RolloutWorker  # noqa: E402
from coda_worker.engines.fake import FakeEngine  # noqa: E402
from coda_worker.engines.base import SamplingParams  # noqa: E402


def main(argv: list[str]) -> None:
    address, worker_id, prompts, seconds_per_token = argv[:4]
    max_groups = int(argv[4]) if len(argv) > 4 else 2
    logging.basicConfig(level=logging.INFO, stream=sys.stdout, format="%(asctime)s %(name)s: %(message)s")
    source = ListPromptSource(Prompt(f"p{i}", [1, 2, 3]) for i in range(int(prompts)))
    engine = FakeEngine(seed=1, mean_tokens=64, length_sigma=0.0, first_token_seconds=0.0,
                        seconds_per_token=float(seconds_per_token))
    RolloutWorker(address, engine, source, worker_id=worker_id, max_groups=max_groups,
                  sampling=SamplingParams(max_tokens=64), client_options={"timeout": 10}).run()


if __name__ == "__main__":
    main(sys.argv[1:])
