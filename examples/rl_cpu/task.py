"""The example's task: random-token prompts, a reward for answering in a fixed set of tokens, and response
budgets that differ from prompt to prompt with a long tail. Standard library only (the workers and the
trainer share it).

The reward is the share of response tokens (the closing stop token excluded) in TARGET_TOKENS, 32 of the
512-token vocabulary: 0.0625 by chance under the random initial model, 1.0 when the policy answers only in
the set. A response ends at one of STOP_TOKENS (16 of the vocabulary, outside the target set) or at its
prompt's budget. The budgets are what keeps the lengths long-tailed while the policy learns: as it learns
to answer in the target set it stops emitting stop tokens, and every response runs to its budget, so one
budget for all prompts would leave every response the same length once trained (no tail). Prompts differ
in how long their answers run (a hard problem's reasoning runs longer than an easy one's): half the
prompts may run 16 tokens, a quarter 32, then 64, 128, ... up to the run's cap (256 by default: 1 prompt
in 16). A synchronous step waits for its longest response, usually 8 to 16 times its median.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

VOCAB_SIZE = 512
BOS = 1
TARGET_TOKENS = frozenset(range(100, 132))
STOP_TOKENS = tuple(range(300, 316))
_STOPS = frozenset(STOP_TOKENS)


def prompt_tokens(seed: int, index: int) -> list[int]:
    """Prompt `index` of the run seeded `seed`: BOS and 8 to 24 random tokens (any but the stop tokens)."""
    rng = random.Random(seed * 1_000_003 + index)
    tokens = [BOS]
    for _ in range(rng.randrange(8, 25)):
        token = rng.randrange(3, VOCAB_SIZE)
        tokens.append(token if token not in _STOPS else token + 16)
    return tokens


def response_budget(seed: int, index: int, cap: int) -> int:
    """Prompt `index`'s response budget: 16 tokens, doubled with probability 1/2 again and again, at most `cap`."""
    rng = random.Random(seed * 7_000_001 + index + 0x5EED)  # a stream of its own: the prompts stay as they were
    budget = min(16, cap)
    while budget < cap and rng.random() < 0.5:
        budget = min(2 * budget, cap)
    return budget


def prompt_id(index: int) -> str:
    return f"prompt-{index:05d}"


def reward(response: Sequence[int]) -> float:
    """The share of the response's tokens in TARGET_TOKENS, a closing stop token not counted."""
    tokens = list(response)
    if tokens and tokens[-1] in _STOPS:
        tokens.pop()
    if not tokens:
        return 0.0
    return sum(1 for t in tokens if t in TARGET_TOKENS) / len(tokens)


def ran_to_budget(response: Sequence[int]) -> bool:
    """A complete response that did not end at a stop token ran to its budget."""
    return not response or response[-1] not in _STOPS
