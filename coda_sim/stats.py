"""Several seeds: each figure as a mean with a 95 % confidence interval, and paired differences to a baseline."""
from __future__ import annotations

import math
from typing import Any, Optional, Sequence

from .report import render_table

# Figures aggregated over seeds (keys of `report.summarize`), in the order the table shows them.
AGGREGATED: list[tuple[str, str, str]] = [
    ("avg step time, excl. step 0", "avg_step_time_excl_step0", "s"),
    ("speedup vs colocate", "speedup_vs_colocate", "x"),
    ("speedup vs colocate + partial", "speedup_vs_colocate_partial", "x"),
    ("useful throughput (tok/s)", "useful_throughput", "tok"),
    ("staleness mean", "staleness_mean", "f"),
    ("partial_ratio", "partial_ratio", "%"),
    ("masked token ratio", "masked_token_ratio", "%"),
    ("pipeline_buf_size mean", "pipeline_buf_size_mean", "f"),
    ("trainer wait ratio", "trainer_wait_ratio", "%"),
    ("generation utilisation", "generation_utilisation", "%"),
    ("restored groups", "restored", "f"),
    ("KV preemptions", "preemptions", "f"),
]

# Two-sided 95 % quantiles of Student's t for 1 .. 30 degrees of freedom (beyond: the normal 1.96).
_T95 = [12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145, 2.131,
        2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042]


def t95(df: int) -> float:
    return _T95[df - 1] if 1 <= df <= len(_T95) else 1.96


def mean_ci(values: Sequence[float]) -> dict[str, Any]:
    """{'mean', 'ci95' (half-width; None for one value), 'values'}."""
    n = len(values)
    mean = sum(values) / n
    ci = None
    if n > 1:
        sd = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1))
        ci = t95(n - 1) * sd / math.sqrt(n)
    return {"mean": mean, "ci95": ci, "values": list(values)}


def run_label(strategy: str, stale_steps: float) -> str:
    return f"{strategy} s={stale_steps:g}"


def aggregate(per_seed: Sequence[Sequence[dict[str, Any]]], seeds: Sequence[int],
              baseline: Optional[str]) -> list[dict[str, Any]]:
    """`per_seed[i]` holds the summaries of seed `seeds[i]` (the same runs, in the same order, for every seed).

    Returns one object per (strategy, stale_steps): every AGGREGATED figure as mean / ci95 / values
    and, when `baseline` is one of the strategies, `diff_vs_baseline`: the per-seed differences to the
    baseline strategy at the same stale_steps (run minus baseline), as mean / ci95 / values.
    """
    runs = per_seed[0]
    index = {(s["strategy"], s["stale_steps"]): i for i, s in enumerate(runs)}
    out = []
    for i, first in enumerate(runs):
        entry: dict[str, Any] = {"strategy": first["strategy"], "stale_steps": first["stale_steps"],
                                 "rollout_partial": first["rollout_partial"], "capacity": first["capacity"],
                                 "steps": first["steps"], "seeds": list(seeds), "baseline": baseline, "metrics": {}}
        base_i = index.get((baseline, first["stale_steps"])) if baseline else None
        for _, key, _ in AGGREGATED:
            values = [seed_runs[i].get(key) for seed_runs in per_seed]
            if any(v is None for v in values):
                continue
            figure = mean_ci([float(v) for v in values])
            if base_i is not None:
                base = [seed_runs[base_i].get(key) for seed_runs in per_seed]
                if all(b is not None for b in base):
                    figure["diff_vs_baseline"] = mean_ci([float(v) - float(b) for v, b in zip(values, base)])
            entry["metrics"][key] = figure
        out.append(entry)
    return out


def _fmt(value: Optional[float], kind: str, signed: bool = False) -> str:
    if value is None:
        return "-"
    sign = "+" if signed else ""
    if kind == "s":
        return f"{value:{sign}.1f}s"
    if kind == "x":
        return f"{value:{sign}.3f}x"
    if kind == "%":
        return f"{100 * value:{sign}.1f}%"
    if kind == "tok":
        return f"{value:{sign}.0f}"
    return f"{value:{sign}.2f}"


def _with_ci(figure: dict[str, Any], kind: str, signed: bool = False) -> str:
    text = _fmt(figure["mean"], kind, signed)
    if figure["ci95"] is not None:
        text += " ±" + _fmt(figure["ci95"], kind).lstrip("+")
    return text


def format_seed_table(entries: Sequence[dict[str, Any]]) -> str:
    """Means ± 95 % CI, then the paired differences to the baseline (when there is one)."""
    headers = [run_label(e["strategy"], e["stale_steps"]) for e in entries]
    blocks = [("", lambda f, k: _with_ci(f, k))]
    if any(e["baseline"] for e in entries):
        blocks.append((f"  minus {entries[0]['baseline']} (paired)",
                       lambda f, k: _with_ci(f["diff_vs_baseline"], k, signed=True) if "diff_vs_baseline" in f else "-"))
    rows = []
    for suffix, render in blocks:
        if suffix:
            rows.append((f"difference{suffix}", ["" for _ in entries]))
        for label, key, kind in AGGREGATED:
            cells = [render(e["metrics"][key], kind) if key in e["metrics"] else "-" for e in entries]
            if all(c == "-" for c in cells):
                continue
            rows.append(((" " * 2 if suffix else "") + label, cells))
    return render_table(headers, rows)


def pareto_front(points: Sequence[tuple[float, float]]) -> list[int]:
    """Indices of the points no other point beats on both axes (both to be minimised)."""
    front = []
    for i, (x, y) in enumerate(points):
        if not any((x2 <= x and y2 <= y) and (x2 < x or y2 < y) for j, (x2, y2) in enumerate(points) if j != i):
            front.append(i)
    return front
