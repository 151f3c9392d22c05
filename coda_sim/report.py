"""Metrics of a run (a flat dict, what --json prints) and the text table the CLI prints."""
from __future__ import annotations

from collections import Counter
from typing import Any, Sequence

from .sim import RunResult


def percentile(counts: Counter, q: float) -> float:
    """Nearest-rank percentile (q in [0, 100]) of integer values given as value -> count."""
    total = sum(counts.values())
    if not total:
        return 0.0
    rank = max(1, -(-q * total // 100))  # ceil(q / 100 * total), at least 1
    seen = 0
    for value in sorted(counts):
        seen += counts[value]
        if seen >= rank:
            return float(value)
    return float(max(counts))


def summarize(run: RunResult) -> dict[str, Any]:
    """Every reported metric of one run, JSON-ready."""
    steps = run.steps
    times = [s.duration for s in steps]
    steady = times[1:] or times
    avg = sum(times) / len(times)
    avg_steady = sum(steady) / len(steady)
    reports = [s.report for s in steps]
    T = run.sim_time or 1.0
    stale_total = sum(run.staleness.values())
    stale_mean = (sum(v * c for v, c in run.staleness.items()) / stale_total) if stale_total else 0.0
    consumed_len = run.consumed_nominal_tokens / run.consumed_trajectories if run.consumed_trajectories else 0.0
    population_len = (run.population_nominal_tokens / run.population_trajectories
                      if run.population_trajectories else 0.0)
    colocate = run.colocate
    colocate_avg = colocate.avg_step_time if colocate else 0.0
    colocate_partial = run.colocate_partial
    colocate_partial_avg = colocate_partial.avg_step_time if colocate_partial else 0.0
    steady_steps = steps[1:] or steps
    steady_time = sum(s.duration for s in steady_steps)
    consumed_tokens = sum(s.consumed_tokens for s in steps)
    masked_tokens = sum(s.masked_tokens for s in steps)
    useful = (sum(s.consumed_tokens - s.masked_tokens for s in steady_steps) / steady_time) if steady_time > 0 else 0.0
    out: dict[str, Any] = {
        "strategy": run.strategy,
        "stale_steps": run.stale_steps,
        "capacity": run.capacity,
        "rollout_partial": "abort" if run.partial else "wait",
        "steps": len(steps),
        "seed": run.seed,
        "avg_step_time": avg,
        "avg_step_time_excl_step0": avg_steady,
        "colocate_step_time": colocate_avg,
        "speedup_vs_colocate": (colocate_avg / avg_steady) if colocate and avg_steady > 0 else None,
        "speedup_vs_colocate_all_steps": (colocate_avg / avg) if colocate and avg > 0 else None,
        "colocate_partial_step_time": colocate_partial_avg,
        "speedup_vs_colocate_partial": (colocate_partial_avg / avg_steady) if colocate_partial and avg_steady > 0 else None,
        "colocate_speedup_partial": (colocate_avg / colocate_partial_avg) if colocate and colocate_partial_avg else None,
        "useful_throughput": useful,
        "colocate_useful_throughput": colocate.useful_throughput if colocate else None,
        "colocate_partial_useful_throughput": colocate_partial.useful_throughput if colocate_partial else None,
        "useful_throughput_vs_colocate": (useful / colocate.useful_throughput
                                          if colocate and colocate.useful_throughput > 0 else None),
        "consumed_tokens": consumed_tokens,
        "masked_tokens": masked_tokens,
        "masked_token_ratio": masked_tokens / consumed_tokens if consumed_tokens else 0.0,
        "preemptions": run.preemptions,
        "reprefill_tokens": run.reprefill_tokens,
        "prefill_share": run.prefill_seconds / (run.replicas * run.sim_time) if run.sim_time > 0 else 0.0,
        "trainer_wait_ratio": run.trainer_wait / T,
        "trainer_pause_ratio": run.pause_wait / T,
        "trainer_busy_ratio": run.trainer_busy / T,
        "generation_utilisation": run.slot_seconds_busy / (run.total_slots * T),
        "colocate_generation_utilisation": (colocate.slot_seconds_busy / (colocate.total_slots * sum(colocate.step_times))
                                            if colocate and sum(colocate.step_times) > 0 else None),
        "pipeline_buf_size_mean": sum(r.pipeline_buf_size for r in reports) / len(reports),
        "pipeline_buf_size_max": max(r.pipeline_buf_size for r in reports),
        "buffered_time_mean": run.buffered_integral / T,
        "running_time_mean": run.running_integral / T,
        "partial_ratio": sum(r.partial_ratio for r in reports) / len(reports),
        "partial_ratio_overall": (run.partial_consumed / run.consumed_trajectories) if run.consumed_trajectories else 0.0,
        "partial_span_max": max(r.partial_span_max for r in reports),
        "restored": sum(r.partial_restored_group_count for r in reports),
        "dropped": sum(r.partial_dropped_incomplete_group_count for r in reports),
        "filtered": run.totals["filtered"],
        "pause_delay_mean": sum(r.pause_delay for r in reports) / len(reports),
        "staleness_mean": stale_mean,
        "staleness_p50": percentile(run.staleness, 50),
        "staleness_p99": percentile(run.staleness, 99),
        "staleness_max": float(max(run.staleness)) if run.staleness else 0.0,
        "consumed_mean_response_len": consumed_len,
        "population_mean_response_len": population_len,
        "order_bias": (consumed_len / population_len) if population_len else None,
        "tokens_generated": run.tokens_generated,
        "tokens_wasted": run.tokens_wasted,
        "sim_time": run.sim_time,
        "events": run.events,
        "wall_seconds": run.wall_seconds,
        "events_per_second": run.events / run.wall_seconds if run.wall_seconds > 0 else None,
        "step_times": times,
        "pipeline_buf_size": [r.pipeline_buf_size for r in reports],
        "totals": dict(run.totals),
    }
    return out


# (label, key, format) rows of the table; format "s" seconds, "x" ratio, "%" percent, "f" float, "d" int.
TABLE_ROWS: list[tuple[str, str, str]] = [
    ("capacity C", "capacity", "d"),
    ("rollout.partial", "rollout_partial", "str"),
    ("avg step time, all steps", "avg_step_time", "s"),
    ("avg step time, excl. step 0", "avg_step_time_excl_step0", "s"),
    ("colocate step time", "colocate_step_time", "s"),
    ("speedup vs colocate", "speedup_vs_colocate", "x"),
    ("colocate + partial step time", "colocate_partial_step_time", "s"),
    ("speedup vs colocate + partial", "speedup_vs_colocate_partial", "x"),
    ("useful throughput (tok/s)", "useful_throughput", "tok"),
    ("useful throughput vs colocate", "useful_throughput_vs_colocate", "x"),
    ("masked token ratio", "masked_token_ratio", "%"),
    ("KV preemptions", "preemptions", "d"),
    ("replica time prefilling", "prefill_share", "%"),
    ("trainer wait ratio", "trainer_wait_ratio", "%"),
    ("trainer pause ratio (boundary)", "trainer_pause_ratio", "%"),
    ("generation utilisation", "generation_utilisation", "%"),
    ("pipeline_buf_size mean", "pipeline_buf_size_mean", "f"),
    ("pipeline_buf_size max", "pipeline_buf_size_max", "d"),
    ("buffered (time mean)", "buffered_time_mean", "f"),
    ("running (time mean)", "running_time_mean", "f"),
    ("partial_ratio", "partial_ratio", "%"),
    ("partial_span_max", "partial_span_max", "d"),
    ("restored groups", "restored", "d"),
    ("dropped groups", "dropped", "d"),
    ("filtered groups", "filtered", "d"),
    ("pause_delay mean", "pause_delay_mean", "s"),
    ("staleness mean", "staleness_mean", "f"),
    ("staleness p50 / p99 / max", "staleness_pcts", "str"),
    ("consumed mean response len", "consumed_mean_response_len", "tok"),
    ("population mean response len", "population_mean_response_len", "tok"),
    ("order bias (consumed/population)", "order_bias", "x"),
]


def _cell(value: Any, kind: str) -> str:
    if value is None:
        return "-"
    if kind == "s":
        return f"{value:.1f}s"
    if kind == "x":
        return f"{value:.2f}x"
    if kind == "%":
        return f"{100 * value:.1f}%"
    if kind == "f":
        return f"{value:.2f}"
    if kind == "d":
        return f"{int(value)}"
    if kind == "tok":
        return f"{value:.0f}"
    return str(value)


def format_table(summaries: Sequence[dict[str, Any]]) -> str:
    """Metrics as rows, one column per run."""
    headers = [f"{s['strategy']} s={s['stale_steps']:g}" for s in summaries]
    rows = []
    for label, key, kind in TABLE_ROWS:
        cells = []
        for s in summaries:
            if key == "staleness_pcts":
                cells.append(f"{s['staleness_p50']:.0f} / {s['staleness_p99']:.0f} / {s['staleness_max']:.0f}")
            else:
                cells.append(_cell(s.get(key), kind))
        rows.append((label, cells))
    return render_table(headers, rows)


def render_table(headers: Sequence[str], rows: Sequence[tuple[str, Sequence[str]]]) -> str:
    """A text table: a "metric" column of row labels, then one right-aligned column per header."""
    first = max(len("metric"), *(len(label) for label, _ in rows))
    widths = [max(len(h), *(len(cells[i]) for _, cells in rows)) for i, h in enumerate(headers)]
    lines = ["  ".join(["metric".ljust(first), *(h.rjust(w) for h, w in zip(headers, widths))]),
             "  ".join(["-" * first, *("-" * w for w in widths)])]
    for label, cells in rows:
        lines.append("  ".join([label.ljust(first), *(c.rjust(w) for c, w in zip(cells, widths))]))
    return "\n".join(lines)

