"""The workload model: what each prompt group generates, how fast replicas decode, how long training takes.

Every draw for prompt number k comes from its own `random.Random` seeded by (seed, k), so prompt k
is the same in every run of a sweep and in the colocate baseline (common random numbers: strategy
comparisons are not blurred by sampling noise), and the same seed always gives the same workload.
"""
from __future__ import annotations

import math
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Sequence

import yaml

from coda_server.core import TrajectoryStatus


class WorkloadError(ValueError):
    """An invalid `sim.*` value; the message names the key, the value and what is allowed."""


@dataclass(frozen=True)
class TrajSpec:
    """One trajectory's fate, fixed when its prompt is drawn."""

    turns: tuple[int, ...]  # response tokens generated in each turn (the last turn ends early on failure)
    tool_waits: tuple[float, ...]  # seconds of tool call after each turn but the last
    status: TrajectoryStatus  # COMPLETED, or FAILED (after generating `turns`)
    reward: float
    nominal_tokens: int  # the drawn response length (what the trajectory would produce without failing)

    @property
    def tokens(self) -> int:
        return sum(self.turns)


@dataclass(frozen=True)
class KvReserve:
    """SGLang-style admission against KV reserved for future tokens, and retraction when decode runs out.

    A request is admitted onto a replica only if its context plus min(max_new_tokens - generated,
    clip_max_new_tokens) fits in the free cache less what the running requests reserve: each
    min(its remaining max_new_tokens, clip) x the replica's new-token ratio. The ratio starts at
    init_ratio, falls by (init_ratio - min_ratio) / decay_steps each decode step, is set again from the
    survivors after a retraction, and returns to init_ratio whenever the replica is idle.
    """

    init_ratio: float
    min_ratio: float
    decay_steps: float
    clip_max_new_tokens: int
    retract_decode_steps: int

    @property
    def decay_per_step(self) -> float:
        return (self.init_ratio - self.min_ratio) / self.decay_steps


@dataclass(frozen=True)
class PromptSpec:
    number: int
    prompt_id: str
    epoch: int
    index: int
    trajs: tuple[TrajSpec, ...]
    slowdown: float  # work per token (1.0, or the straggler slowdown)
    all_equal_reward: bool

    @property
    def nominal_tokens(self) -> int:
        return sum(t.nominal_tokens for t in self.trajs)


class Workload:
    """Draws prompt groups and answers the timing questions of the simulator."""

    def __init__(self, sim: Any, group_size: int, base_dir: Optional[Path] = None, batch_groups: int = 1):
        self.seed = int(sim["seed"])
        self.group_size = int(group_size)
        self.batch_groups = max(1, int(batch_groups))  # B: prompt k belongs to step k // B (length drift)
        self.dataset_size = _positive_int(sim, "dataset_size")
        gen, length = sim["generation"], sim["generation"]["length"]
        cluster = sim["cluster"]
        self.replicas = _positive_int(cluster, "rollout_replicas", "sim.cluster.")
        self.slots_per_replica = _positive_int(cluster, "slots_per_replica", "sim.cluster.")
        # The router in front of the replicas: at most this many requests generate at once across all of
        # them (0 = no limit beyond the slots); the rest wait in the FIFO queue.
        self.max_concurrent_requests = _non_negative_int(cluster, "max_concurrent_requests", "sim.cluster.")
        self.kv_cache_tokens = _non_negative(cluster, "kv_cache_tokens", "sim.cluster.")
        self.kv_admit_watermark = _number(cluster, "kv_admit_watermark", "sim.cluster.")
        if not 0.0 < self.kv_admit_watermark <= 1.0:
            raise WorkloadError(f"sim.cluster.kv_admit_watermark = {self.kv_admit_watermark}: must be in (0, 1]")
        self.kv_reserve = _kv_reserve(cluster["kv_reserve"], self.kv_cache_tokens)
        # Groups the workers generate at once, all together (0: the simulation's default, 2 x C).
        self.worker_max_groups = _non_negative_int(cluster, "worker_max_groups", "sim.cluster.")
        self.prompt_tokens = _non_negative(gen, "prompt_tokens", "sim.generation.")
        self.prefill_s = _non_negative(gen, "prefill_s", "sim.generation.")
        self.prefill_tokens_per_s = _non_negative(gen, "prefill_tokens_per_s", "sim.generation.")
        decode = gen["decode"]
        single = _positive(decode, "tokens_per_s_single", "sim.generation.decode.")
        full = _positive(decode, "tokens_per_s_full", "sim.generation.decode.")
        if full > single:
            raise WorkloadError(f"sim.generation.decode.tokens_per_s_full = {full}: must be <= tokens_per_s_single "
                                f"({single}); a busier replica decodes each request no faster")
        self.decode_single = single
        self.decode_full = full
        # Attention reads every cached token at every decode step: seconds added to a step per token in
        # the replica's KV cache (given per million tokens).
        self.kv_step_seconds_per_token = _non_negative(decode, "kv_step_s_per_mtoken", "sim.generation.decode.") / 1e6

        self.distribution = str(length["distribution"])
        if self.distribution not in ("lognormal", "constant", "empirical"):
            raise WorkloadError(f"sim.generation.length.distribution = {self.distribution!r}: "
                                f"allowed: lognormal, constant, empirical")
        self.median = _positive(length, "median", "sim.generation.length.")
        self.sigma = _non_negative(length, "sigma", "sim.generation.length.")
        self.prompt_corr = float(length["prompt_corr"])
        if not 0.0 <= self.prompt_corr <= 1.0:
            raise WorkloadError(f"sim.generation.length.prompt_corr = {self.prompt_corr}: must be in [0, 1]")
        self.min_len = _positive_int(length, "min", "sim.generation.length.")
        self.cap = _positive_int(length, "cap", "sim.generation.length.")
        if self.cap < self.min_len:
            raise WorkloadError(f"sim.generation.length.cap = {self.cap}: must be >= min ({self.min_len})")
        self.tail_prob = _probability(length, "tail_prob", "sim.generation.length.")
        self.tail_factor = _positive(length, "tail_factor", "sim.generation.length.")
        self.tail_sigma = _non_negative(length, "tail_sigma", "sim.generation.length.")
        self.drift_per_step = _number(length, "drift_per_step", "sim.generation.length.")
        if self.drift_per_step <= -1.0:
            raise WorkloadError(f"sim.generation.length.drift_per_step = {self.drift_per_step}: must be > -1")
        self.empirical: Optional[list[int]] = None
        if self.distribution == "empirical":
            self.empirical = load_lengths(length.get("file"), base_dir)

        turns = gen["turns"]
        self.turns_min = _positive_int(turns, "min", "sim.generation.turns.")
        self.turns_max = _positive_int(turns, "max", "sim.generation.turns.")
        if self.turns_max < self.turns_min:
            raise WorkloadError(f"sim.generation.turns.max = {self.turns_max}: must be >= min ({self.turns_min})")
        self.tool_latency_s = _non_negative(turns, "tool_latency_s", "sim.generation.turns.")
        self.fail_prob = _probability(gen, "fail_prob", "sim.generation.")
        stragglers = gen["stragglers"]
        self.straggler_prob = _probability(stragglers, "prob", "sim.generation.stragglers.")
        self.straggler_indices = frozenset(int(i) for i in (stragglers.get("indices") or []))
        self.straggler_slowdown = _positive(stragglers, "slowdown", "sim.generation.stragglers.")
        self.filtered_group_prob = _probability(sim["reward"], "filtered_group_prob", "sim.reward.")

        trainer = sim["trainer"]
        self.minibatch_fixed_s = _non_negative(trainer, "minibatch_fixed_s", "sim.trainer.")
        self.per_token_s = _non_negative(trainer, "per_token_s", "sim.trainer.")
        self.weight_sync_s = _non_negative(trainer, "weight_sync_s", "sim.trainer.")
        self.mask_partial_tokens = trainer["mask_partial_tokens"]
        if not isinstance(self.mask_partial_tokens, bool):
            raise WorkloadError(f"sim.trainer.mask_partial_tokens = {self.mask_partial_tokens!r}: must be true or false")
        reset = sim["reset"]
        self.abort_latency_s = _non_negative(reset, "abort_latency_s", "sim.reset.")
        self.wait_timeout_s = _non_negative(reset, "wait_timeout_s", "sim.reset.")
        colocate = sim["colocate"]
        self.colocate_replicas = _positive_int(colocate, "rollout_replicas", "sim.colocate.")
        self.colocate_trainer_speedup = _positive(colocate, "trainer_speedup", "sim.colocate.")
        self.colocate_switch_s = _non_negative(colocate, "switch_s", "sim.colocate.")
        self.colocate_oversample = _number(colocate, "oversample", "sim.colocate.")
        if self.colocate_oversample < 1.0:
            raise WorkloadError(f"sim.colocate.oversample = {self.colocate_oversample}: must be >= 1.0")
        if colocate.get("partial_oversample") is None:
            self.colocate_partial_oversample = self.colocate_oversample
        else:
            self.colocate_partial_oversample = _number(colocate, "partial_oversample", "sim.colocate.")
            if self.colocate_partial_oversample < 1.0:
                raise WorkloadError(f"sim.colocate.partial_oversample = {self.colocate_partial_oversample}: "
                                    f"must be >= 1.0 (or null: the same as oversample)")
        self.colocate_refill_ratio = _number(colocate, "refill_ratio", "sim.colocate.")
        if self.colocate_refill_ratio < 1.0:
            raise WorkloadError(f"sim.colocate.refill_ratio = {self.colocate_refill_ratio}: must be >= 1.0")
        max_refill = colocate["max_refill"]
        if isinstance(max_refill, bool) or not isinstance(max_refill, int) or max_refill < 0:
            raise WorkloadError(f"sim.colocate.max_refill = {max_refill!r}: must be an integer >= 0 (0 = no limit)")
        self.colocate_max_refill = max_refill

        # Per-request decode step time with n requests decoding: a + b * n seconds per token.
        k = self.slots_per_replica
        self._b = (1.0 / full - 1.0 / single) / (k - 1) if k > 1 else 0.0
        self._a = 1.0 / single - self._b
        self._steps = [self._a + self._b * max(1, n) for n in range(k + 1)]
        self._rates = [1.0 / step for step in self._steps]
        self._mu = math.log(self.median)
        self._cache: dict[int, PromptSpec] = {}

    # ------------------------------------------------------------------ timing

    def decode_rate(self, decoding: int) -> float:
        """Tokens/s each request gets on a replica decoding `decoding` requests at once (empty KV cache)."""
        return self._rates[decoding]

    def decode_step_seconds(self, decoding: int) -> float:
        """Seconds of one decode step (one token for each request) with `decoding` requests, before the
        KV-cache term (`kv_step_seconds_per_token` x tokens in the cache)."""
        return self._steps[decoding]

    def train_seconds(self, tokens: int) -> float:
        """Seconds for one fully-async trainer fetch holding `tokens` prompt + response tokens."""
        return self.minibatch_fixed_s + self.per_token_s * tokens

    def trainer_tokens(self, response_tokens: int, trajectories: int) -> int:
        return int(response_tokens + self.prompt_tokens * trajectories)

    def prefill_seconds(self, context_tokens: float) -> float:
        """Seconds a replica spends prefilling one request of `context_tokens` (serial prefill only)."""
        return context_tokens / self.prefill_tokens_per_s

    # ------------------------------------------------------------------ prompts

    def prompt(self, number: int) -> PromptSpec:
        """Prompt group number `number` (0, 1, 2 ...): identical for a given seed, whoever asks."""
        spec = self._cache.get(number)
        if spec is None:
            spec = self._draw(number)
            self._cache[number] = spec
        return spec

    def forget(self, number: int) -> None:
        """Drop a cached prompt nobody will ask for again (keeps long runs small)."""
        self._cache.pop(number, None)

    def _draw(self, number: int) -> PromptSpec:
        rng = random.Random((self.seed << 40) + number)  # one stream per (seed, prompt number)
        n = self.group_size
        straggler = number in self.straggler_indices or (self.straggler_prob > 0 and rng.random() < self.straggler_prob)
        all_equal = self.filtered_group_prob > 0 and rng.random() < self.filtered_group_prob
        rewards = self._rewards(rng, n, all_equal)
        prompt_z = rng.gauss(0.0, 1.0)
        stretch = (1.0 + self.drift_per_step) ** (number // self.batch_groups) if self.drift_per_step else 1.0
        trajs = []
        for j in range(n):
            length = self._length(rng, prompt_z, stretch)
            trajs.append(self._trajectory(rng, length, rewards[j]))
        epoch, index = divmod(number, self.dataset_size)
        return PromptSpec(number, f"e{epoch}_p{index}", epoch, index, tuple(trajs),
                          self.straggler_slowdown if straggler else 1.0, all_equal)

    def _length(self, rng: random.Random, prompt_z: float, stretch: float = 1.0) -> int:
        if self.distribution == "constant":
            return max(self.min_len, min(self.cap, int(round(self.median * stretch))))
        if self.distribution == "empirical":
            value = self.empirical[rng.randrange(len(self.empirical))] * stretch
        else:
            z = math.sqrt(self.prompt_corr) * prompt_z + math.sqrt(1.0 - self.prompt_corr) * rng.gauss(0.0, 1.0)
            mu, sigma = self._mu, self.sigma
            if self.tail_prob > 0 and rng.random() < self.tail_prob:  # the long component
                mu, sigma = mu + math.log(self.tail_factor), self.tail_sigma
            value = math.exp(mu + sigma * z) * stretch
        return max(self.min_len, min(self.cap, int(round(value))))

    @staticmethod
    def _rewards(rng: random.Random, n: int, all_equal: bool) -> list[float]:
        if all_equal:
            return [float(rng.random() < 0.5)] * n
        if n == 1:
            return [float(rng.random() < 0.5)]
        rewards = [float(rng.random() < 0.5) for _ in range(n)]
        if len(set(rewards)) == 1:  # a kept group must carry signal: the reward filter keeps it
            rewards[rng.randrange(n)] = 1.0 - rewards[0]
        return rewards

    def _trajectory(self, rng: random.Random, length: int, reward: float) -> TrajSpec:
        turns = rng.randint(self.turns_min, self.turns_max) if self.turns_max > self.turns_min else self.turns_min
        parts = _split(rng, length, turns)
        waits = tuple(rng.expovariate(1.0 / self.tool_latency_s) if self.tool_latency_s > 0 else 0.0
                      for _ in range(len(parts) - 1))
        status = TrajectoryStatus.COMPLETED
        if self.fail_prob > 0 and rng.random() < self.fail_prob:
            status = TrajectoryStatus.FAILED
            parts = _truncate(parts, max(1, int(length * rng.random())))
            waits = waits[:len(parts) - 1]
        return TrajSpec(tuple(parts), waits, status, reward, length)


def _split(rng: random.Random, length: int, turns: int) -> list[int]:
    """`length` tokens in `turns` positive parts at random cut points (fewer turns when too short)."""
    turns = max(1, min(turns, length))
    if turns == 1:
        return [length]
    cuts = sorted(rng.sample(range(1, length), turns - 1))
    bounds = [0, *cuts, length]
    return [bounds[i + 1] - bounds[i] for i in range(turns)]


def _truncate(parts: Sequence[int], tokens: int) -> list[int]:
    out = []
    for part in parts:
        take = min(part, tokens)
        out.append(take)
        tokens -= take
        if tokens <= 0:
            break
    return out


def load_lengths(file: Any, base_dir: Optional[Path] = None) -> list[int]:
    """Response lengths from a file: one integer a line (# comments allowed), or a JSON / YAML list."""
    if not file:
        raise WorkloadError("sim.generation.length.file is not set: distribution 'empirical' needs a file of lengths")
    path = Path(str(file))
    if not path.is_absolute() and base_dir is not None and not path.exists():
        path = base_dir / path
    try:
        text = path.read_text()
    except OSError as exc:
        raise WorkloadError(f"sim.generation.length.file = {str(file)!r}: cannot be read ({exc.strerror})") from None
    values: Any
    stripped = text.lstrip()
    if stripped.startswith(("[", "- ")):
        try:
            values = yaml.safe_load(text)  # a JSON list is YAML too
        except yaml.YAMLError:
            raise WorkloadError(f"sim.generation.length.file = {str(file)!r}: not a valid JSON / YAML list") from None
        if not isinstance(values, list):
            raise WorkloadError(f"sim.generation.length.file = {str(file)!r}: must hold a list of lengths")
    else:
        values = [line.split("#", 1)[0].strip() for line in text.splitlines()]
        values = [v for v in values if v]
    try:
        lengths = [int(float(v)) for v in values]
    except (TypeError, ValueError):
        raise WorkloadError(f"sim.generation.length.file = {str(file)!r}: every entry must be a number of tokens") from None
    if not lengths or min(lengths) < 1:
        raise WorkloadError(f"sim.generation.length.file = {str(file)!r}: needs at least one length, each >= 1")
    return lengths


def _kv_reserve(section: Any, kv_cache_tokens: float) -> Optional[KvReserve]:
    """`sim.cluster.kv_reserve`, or None when it is off."""
    prefix = "sim.cluster.kv_reserve."
    enabled = section["enabled"]
    if not isinstance(enabled, bool):
        raise WorkloadError(f"{prefix}enabled = {enabled!r}: must be true or false")
    if not enabled:
        return None
    if kv_cache_tokens <= 0:
        raise WorkloadError(f"{prefix}enabled = true needs a KV cache to reserve in: set sim.cluster.kv_cache_tokens "
                            f"(> 0, tokens per replica)")
    init_ratio = _number(section, "init_ratio", prefix)
    if not 0.0 < init_ratio <= 1.0:
        raise WorkloadError(f"{prefix}init_ratio = {init_ratio}: must be in (0, 1]")
    min_ratio = _number(section, "min_ratio", prefix)
    if not 0.0 <= min_ratio <= init_ratio:
        raise WorkloadError(f"{prefix}min_ratio = {min_ratio}: must be in [0, init_ratio ({init_ratio})]")
    return KvReserve(init_ratio, min_ratio, _positive(section, "decay_steps", prefix),
                     _positive_int(section, "clip_max_new_tokens", prefix),
                     _positive_int(section, "retract_decode_steps", prefix))


def _number(section: Any, key: str, prefix: str) -> float:
    value = section[key]
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise WorkloadError(f"{prefix}{key} = {value!r}: must be a finite number")
    return float(value)


def _positive(section: Any, key: str, prefix: str = "sim.") -> float:
    value = _number(section, key, prefix)
    if value <= 0:
        raise WorkloadError(f"{prefix}{key} = {value!r}: must be > 0")
    return value


def _non_negative(section: Any, key: str, prefix: str = "sim.") -> float:
    value = _number(section, key, prefix)
    if value < 0:
        raise WorkloadError(f"{prefix}{key} = {value!r}: must be >= 0")
    return value


def _probability(section: Any, key: str, prefix: str = "sim.") -> float:
    value = _number(section, key, prefix)
    if not 0.0 <= value <= 1.0:
        raise WorkloadError(f"{prefix}{key} = {value!r}: must be a probability in [0, 1]")
    return value


def _non_negative_int(section: Any, key: str, prefix: str = "sim.") -> int:
    value = section[key]
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise WorkloadError(f"{prefix}{key} = {value!r}: must be an integer >= 0")
    return value


def _positive_int(section: Any, key: str, prefix: str = "sim.") -> int:
    value = section[key]
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise WorkloadError(f"{prefix}{key} = {value!r}: must be an integer >= 1")
    return value
