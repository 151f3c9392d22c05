"""Writes a tiny random-initialised Llama and a tokenizer made here (no hub download) for the vLLM example.

Run with the vLLM venv's Python (it has torch, transformers and tokenizers):

    HF_HUB_OFFLINE=1 python examples/vllm_e2e/make_model.py OUT_DIR [--hidden-size 128] [--layers 2]

The model is small enough to serve on two CPU cores: by default hidden size 128 with 2 attention heads
(head_dim 64; vLLM's CPU attention refuses head_dim 16), 2 layers, a vocabulary of 512 tokens;
`--hidden-size` (a multiple of 64: one head per 64, an MLP twice as wide) and `--layers` make a larger one
(examples/rl_cpu uses 256 and 4). The weights are random (seeded), so the text is noise, but every token
goes through the real engine.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

VOCAB_SIZE = 512
SPECIAL_TOKENS = ["<unk>", "<s>", "</s>"]
# A little text to learn the tokenizer's merges from; any text would do, the model is random anyway.
CORPUS = [
    "the quick brown fox jumps over the lazy dog",
    "reinforcement learning from verifiable rewards trains a policy on its own samples",
    "a rollout worker generates trajectories while the trainer consumes complete groups",
    "partial rollouts continue under new weights after a step boundary",
    "solve: 12 + 30 = 42; 7 * 6 = 42; 84 / 2 = 42",
] * 20


def build_tokenizer(out: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(CORPUS, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="<unk>", bos_token="<s>",
                                   eos_token="</s>")
    fast.save_pretrained(out)


def build_model(out: Path, layers: int, seed: int, hidden_size: int = 128) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=layers,
        num_attention_heads=hidden_size // 64,
        num_key_value_heads=hidden_size // 64,
        max_position_embeddings=1024,
        bos_token_id=SPECIAL_TOKENS.index("<s>"),
        eos_token_id=SPECIAL_TOKENS.index("</s>"),
        tie_word_embeddings=False,
        torch_dtype="float32",
    )
    model = LlamaForCausalLM(config)
    model.save_pretrained(out, safe_serialization=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, help="directory to write the model and tokenizer to")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--hidden-size", type=int, default=128, help="a multiple of 64 (one attention head per 64)")
    args = parser.parse_args(argv)
    if args.hidden_size < 64 or args.hidden_size % 64:
        parser.error(f"--hidden-size {args.hidden_size} must be a positive multiple of 64 (vLLM's CPU attention "
                     "needs head_dim 64)")
    args.out.mkdir(parents=True, exist_ok=True)
    build_tokenizer(args.out)
    build_model(args.out, args.layers, args.seed, args.hidden_size)
    (args.out / "coda_example.json").write_text(json.dumps({"vocab_size": VOCAB_SIZE, "layers": args.layers,
                                                             "hidden_size": args.hidden_size, "seed": args.seed}))
    print(f"wrote a tiny Llama (hidden size {args.hidden_size}, {args.layers} layers, vocab {VOCAB_SIZE}) to "
          f"{args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
