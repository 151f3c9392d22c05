"""The trainer's policy: the example's Llama in PyTorch (float32, CPU), a GRPO-style update, weight snapshots per
version, and the check that the engine's log-probabilities are the trainer's under each token's version.

Runs in the vLLM venv (torch, transformers, safetensors are vLLM's own dependencies).
"""

from __future__ import annotations

import shutil
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers import LlamaForCausalLM


# "clip": -min(r A, clip(r, 1 - eps, 1 + eps) A) with r = pi / pi_engine. "tis": -min(r, cap) A log pi (r not
# differentiated). One update a step on on-policy tokens (r = 1) makes both the same gradient, -A grad log pi;
# they differ on stale tokens: clip gives a token whose ratio left [1 - eps, 1 + eps] in its advantage's
# direction no gradient, tis weighs it by its ratio, truncated at cap.
LOSSES = ("clip", "tis")
# The most padded positions (rows x the longest row) one forward and backward of an update takes at once.
CHUNK_POSITIONS = 4096


@dataclass
class Rollouts:
    """Trajectories to train on, one entry per trajectory; groups are [start, stop) ranges of whole groups."""

    prompts: list[list[int]]
    responses: list[list[int]]
    engine_logprobs: list[list[float]]  # the engine's log-probability of each response token
    token_versions: list[list[int]]  # the weight version each response token was generated under
    loss_mask: list[list[int]]  # 0 on tokens the off-policy mask removes from the loss
    rewards: list[float]
    groups: list[tuple[int, int]]
    continued: list[bool] = field(default_factory=list)  # aborted at a boundary, then continued
    names: list[str] = field(default_factory=list)  # trajectory ids, for messages

    @classmethod
    def from_minibatch(cls, batch, prompt_of) -> Rollouts:
        """From a coda_client MiniBatch; `prompt_of(prompt_id)` gives a prompt's token ids."""
        cu = batch.cu_seqlens.tolist()
        spans = list(zip(cu[:-1], cu[1:]))
        return cls(
            prompts=[prompt_of(p) for p in batch.prompt_id],
            responses=[batch.token_ids[a:b].tolist() for a, b in spans],
            engine_logprobs=[batch.logprobs[a:b].tolist() for a, b in spans],
            token_versions=[batch.token_weight_version[a:b].tolist() for a, b in spans],
            loss_mask=[batch.loss_mask[a:b].tolist() for a, b in spans],
            rewards=batch.reward.tolist(),
            groups=[(g.start, g.stop) for g in batch.groups],
            continued=[t.metadata.get("continued") == "true" for t in batch.trajectories],
            names=[f'{t.trajectory_id}@{t.metadata.get("worker", "?")}' for t in batch.trajectories],
        )


@dataclass
class StepReport:
    """What one update did, and the consistency figures of its tokens."""

    loss: float
    reward: float
    tokens: int
    tokens_in_loss: int
    staleness: Counter  # trainer version - token version -> tokens


class Policy:
    """The model being trained, its optimizer and a snapshot of the weights of every published version."""

    def __init__(self, model_dir: Path, *, lr: float, clip: float, seed: int, loss: str = "clip",
                 tis_cap: float = 2.0) -> None:
        torch.manual_seed(seed)
        self.model = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa")
        self.model.eval()  # no dropout in Llama; eval() keeps the forward the same as the engine's
        self.reference = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa")
        self.reference.eval().requires_grad_(False)
        self.optimizer = torch.optim.Adam(self.model.parameters(), lr=lr)
        if loss not in LOSSES:
            raise ValueError(f"loss {loss!r}: expected one of {', '.join(LOSSES)}")
        self.clip, self.loss, self.tis_cap = clip, loss, tis_cap
        self.version = 0
        self.snapshots = {0: self._weights()}
        self._reference_version: int | None = None
        self._updates_since_publish = 0
        self.train_seconds = 0.0  # spent in train()
        # The consistency check: the largest |engine log-prob - trainer's under the token's version|, over every
        # token, over continued trajectories' tokens, and by staleness; tokens checked so far.
        self.max_logprob_diff = 0.0
        self.max_logprob_diff_continued = 0.0
        self.diff_by_staleness: dict[int, float] = {}
        self.checked_tokens = 0
        self._deferred: list[tuple] = []  # tokens of versions other than the training forward's, for audit()

    def _weights(self) -> dict[str, torch.Tensor]:
        return {name: value.detach().clone().contiguous() for name, value in self.model.state_dict().items()}

    def publish(self, version: int, directory: Path) -> Path:
        """Snapshots the weights as `version` and saves them as safetensors in directory/vVERSION."""
        self.version = version
        self.snapshots[version] = self._weights()
        self._updates_since_publish = 0
        out = directory / f"v{version}"
        out.mkdir(parents=True, exist_ok=True)
        save_file(self.snapshots[version], str(out / "model.safetensors"))
        old = directory / f"v{version - 2}"
        if old.exists():  # the engines have loaded a newer one
            shutil.rmtree(old, ignore_errors=True)
        return out

    def save(self, path: Path) -> None:
        """The trainer's checkpoint: model, optimizer, the current version and the snapshot of every version
        published so far (what the consistency check reads tokens against)."""
        torch.save({"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(),
                    "version": self.version, "snapshots": self.snapshots,
                    # the check's figures so far, and how many of the tokens waiting for the audit were trained by then
                    "checked_tokens": self.checked_tokens, "max_logprob_diff": self.max_logprob_diff,
                    "max_logprob_diff_continued": self.max_logprob_diff_continued,
                    "diff_by_staleness": dict(self.diff_by_staleness), "deferred": len(self._deferred)}, path)

    def load(self, path: Path) -> None:
        """Back to a checkpoint of `save`: what was trained after it is gone, versions published after it
        unknown (a token of one fails the check), the check's figures those of the checkpoint. (In this process
        the tokens trained before it still wait for the audit; a trainer restarted in a new one has lost them.)"""
        saved = torch.load(path, weights_only=True)
        self.model.load_state_dict(saved["model"])
        self.optimizer.load_state_dict(saved["optimizer"])
        self.version, self.snapshots = saved["version"], saved["snapshots"]
        self.checked_tokens, self.max_logprob_diff = saved["checked_tokens"], saved["max_logprob_diff"]
        self.max_logprob_diff_continued = saved["max_logprob_diff_continued"]
        self.diff_by_staleness = dict(saved["diff_by_staleness"])
        self._deferred = self._deferred[:saved["deferred"]]
        self._reference_version = None
        self._updates_since_publish = 0

    @staticmethod
    def _pack(rollouts: Rollouts, rows: list[int]) -> dict[str, torch.Tensor]:
        """Right-padded [rows, length] tensors: input ids, and per position the response token it predicts
        (its engine log-probability, weight version, loss mask; `response` marks the positions that predict
        one)."""
        sequences = [rollouts.prompts[i] + rollouts.responses[i] for i in rows]
        width = max(len(s) for s in sequences)
        out = {"ids": torch.zeros(len(rows), width, dtype=torch.long),
               "response": torch.zeros(len(rows), width - 1, dtype=torch.bool),
               "engine": torch.zeros(len(rows), width - 1),
               "version": torch.full((len(rows), width - 1), -1, dtype=torch.long),
               "mask": torch.zeros(len(rows), width - 1, dtype=torch.bool)}
        for row, i in enumerate(rows):
            out["ids"][row, :len(sequences[row])] = torch.tensor(sequences[row], dtype=torch.long)
            # position p predicts token p + 1: the response's tokens are predicted from len(prompt) - 1 on
            span = slice(len(rollouts.prompts[i]) - 1, len(sequences[row]) - 1)
            out["response"][row, span] = True
            out["engine"][row, span] = torch.tensor(rollouts.engine_logprobs[i], dtype=torch.float32)
            out["version"][row, span] = torch.tensor(rollouts.token_versions[i])
            out["mask"][row, span] = torch.tensor(rollouts.loss_mask[i], dtype=torch.bool)
        return out

    @staticmethod
    def _logprobs(model: LlamaForCausalLM, ids: torch.Tensor) -> torch.Tensor:
        """[rows, length - 1]: the log-probability of each next token. Right padding needs no attention mask:
        a causal model's real tokens never see the pads after them."""
        logits = model(input_ids=ids).logits[:, :-1].float()
        return torch.log_softmax(logits, dim=-1).gather(-1, ids[:, 1:].unsqueeze(-1)).squeeze(-1)

    def _under_version(self, version: int, ids: torch.Tensor) -> torch.Tensor:
        if version not in self.snapshots:
            raise RuntimeError(f"tokens of weight version {version}, which this trainer never published")
        if self._reference_version != version:
            self.reference.load_state_dict(self.snapshots[version])
            self._reference_version = version
        with torch.no_grad():
            return self._logprobs(self.reference, ids)

    @staticmethod
    def _chunks(rollouts: Rollouts, rows: list[int]) -> list[list[int]]:
        """The rows in chunks of similar length (longest first), each at most CHUNK_POSITIONS padded positions
        (or one row): padding every row to the batch's longest response would spend most of the update on pads
        when lengths are long-tailed."""
        ordered = sorted(rows, key=lambda i: len(rollouts.prompts[i]) + len(rollouts.responses[i]), reverse=True)
        chunks: list[list[int]] = []
        for i in ordered:
            if chunks:
                first = chunks[-1][0]
                width = len(rollouts.prompts[first]) + len(rollouts.responses[first])
                if (len(chunks[-1]) + 1) * width <= CHUNK_POSITIONS:
                    chunks[-1].append(i)
                    continue
            chunks.append([i])
        return chunks

    def train(self, rollouts: Rollouts) -> StepReport:
        """One GRPO-style update: group-normalised advantages, a clipped importance ratio against the engine's
        log-probabilities, the loss over the tokens loss_mask keeps; then the consistency check. The forward and
        backward run in chunks of rows of similar length, the gradients adding up to the whole batch's."""
        started = time.monotonic()
        rows = [i for i, r in enumerate(rollouts.responses) if r]
        advantages = torch.zeros(len(rollouts.rewards))
        for start, stop in rollouts.groups:
            rewards = torch.tensor(rollouts.rewards[start:stop], dtype=torch.float32)
            advantages[start:stop] = (rewards - rewards.mean()) / (rewards.std(unbiased=False) + 1e-6)
        chunks = [(chunk, self._pack(rollouts, chunk)) for chunk in self._chunks(rollouts, rows)]
        kept_of = [packed["mask"] & packed["response"] & torch.isfinite(packed["engine"]) for _, packed in chunks]
        kept_total = max(sum(int(kept.sum()) for kept in kept_of), 1)  # the loss is the mean over all kept tokens
        self.optimizer.zero_grad()
        loss_value, tokens, staleness = 0.0, 0, Counter()
        for (chunk, packed), kept in zip(chunks, kept_of):
            response, engine = packed["response"], packed["engine"]
            current = self._logprobs(self.model, packed["ids"])
            advantage = advantages[chunk].unsqueeze(-1)
            if self.loss == "clip":  # PPO's clipped ratio against the engine's (behaviour) log-probabilities
                ratio = torch.exp(current - engine)
                per_token = -torch.minimum(ratio * advantage, ratio.clamp(1 - self.clip, 1 + self.clip) * advantage)
            else:  # "tis": the policy gradient weighted by the truncated importance ratio to the behaviour policy
                weight = torch.exp(current.detach() - engine).clamp(max=self.tis_cap)
                per_token = -weight * advantage * current
            loss = per_token[kept].sum() / kept_total
            loss.backward()
            loss_value += float(loss)
            self._check(rollouts, chunk, packed, current.detach())
            staleness.update((self.version - packed["version"][response]).tolist())
            tokens += int(response.sum())
        self.optimizer.step()
        self._updates_since_publish += 1
        self.train_seconds += time.monotonic() - started
        return StepReport(loss=loss_value, reward=sum(rollouts.rewards) / len(rollouts.rewards),
                          tokens=tokens, tokens_in_loss=sum(int(kept.sum()) for kept in kept_of), staleness=staleness)

    def _check(self, rollouts: Rollouts, rows: list[int], packed: dict[str, torch.Tensor],
               current: torch.Tensor) -> None:
        """The check, over every token (masked ones too): the engine's log-probability against the trainer's
        under the weights of the token's version. The training forward is that version's when nothing was
        updated since it was published; tokens of any other version are checked by audit() after the run
        (an instrument, not training: a trainer in production would not recompute old versions)."""
        response, engine = packed["response"], packed["engine"]
        continued = torch.tensor([bool(rollouts.continued[i]) if i < len(rollouts.continued) else False
                                  for i in rows])
        for version in packed["version"][response].unique().tolist():
            at = response & (packed["version"] == version)
            if version == self.version and self._updates_since_publish == 0:
                self._record_diffs(self.version - version, (current - engine).abs(), at, continued)
            else:
                members = at.any(dim=1)
                self._deferred.append((version, self.version - version, packed["ids"][members], engine[members],
                                       at[members], continued[members]))

    def _record_diffs(self, staleness: int, diff: torch.Tensor, at: torch.Tensor, continued: torch.Tensor) -> None:
        diff = torch.nan_to_num(diff, nan=float("inf"))
        self.checked_tokens += int(at.sum())
        self.max_logprob_diff = max(self.max_logprob_diff, float(diff[at].max()))
        self.diff_by_staleness[staleness] = max(self.diff_by_staleness.get(staleness, 0.0), float(diff[at].max()))
        on_continued = at & continued.unsqueeze(-1)
        if on_continued.any():
            self.max_logprob_diff_continued = max(self.max_logprob_diff_continued, float(diff[on_continued].max()))

    def audit(self) -> float:
        """Checks the tokens train() could not (their version was not the training forward's), each under its
        version's snapshot; returns the seconds it took. The figures are in max_logprob_diff and friends."""
        started = time.monotonic()
        for version, staleness, ids, engine, at, continued in sorted(self._deferred, key=lambda d: d[0]):
            self._record_diffs(staleness, (self._under_version(version, ids) - engine).abs(), at, continued)
        self._deferred.clear()
        return time.monotonic() - started
