"""The example's task: random-token prompts, a reward for answering in a fixed set of tokens, and stop tokens
that give the responses a long tail of lengths. Standard library only (the workers and the trainer share it).

The reward is the share of response tokens (the closing stop token excluded) in TARGET_TOKENS, 32 of the
512-token vocabulary: 0.0625 by chance under the random initial model, 1.0 when the policy answers only in
the set. A response ends at one of STOP_TOKENS (16 of the vocabulary, outside the target set) or at the
token budget: under the initial model a response stops after 32 tokens on average (geometric), and with
the example's budget of 64 one in eight runs to it, so a synchronous step waits for its slowest response
while most are long done.
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
