"""Fitting a workload to measured runs: anchors in, fitted parameters and predictions out (`python -m coda_sim.calibrate`).

A calibration is falsifiable only if the rows it predicts played no part in the fit. The built-in
LoongSage fit therefore uses the colocate, colocate + partial and no-window rows of the published table
(`baidu-baige/LoongSage`, docs/en/fully-async-mode.md, section 5) as anchors, and reports the two
windowed-fifo rows as predictions next to what was measured.

    python -m coda_sim.calibrate                          # refit the loongsage_qwen3_30b preset, print the table
    python -m coda_sim.calibrate --evaluate-only          # the preset as shipped: anchors and predictions
    python -m coda_sim.calibrate --preset long_tail --strategy no-window --stale-steps 1.0 \\
        --target step_time=451.7 --target pipeline_buf_size=27 --target colocate_step_time=578.6 \\
        --fit sim.generation.decode.tokens_per_s_full=5:60 --fit sim.trainer.per_token_s=1e-5:1e-3

The fit is a Nelder-Mead search (in log space, inside the given bounds) of the weighted squared
relative errors of the anchors, every evaluation on the same seeds (common random numbers).
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

from coda_server.core.errors import ConfigError

from .config import load_sim_config
from .report import summarize
from .runner import colocate_baselines, simulate
from .sim import SimulationError
from .workload import WorkloadError

# Metric names a target may use: what they read from a run's summary (and the run's pacer totals).
METRICS: dict[str, str] = {
    "step_time": "mean async step time excluding step 0, s",
    "pipeline_buf_size": "mean pipeline_buf_size at the step boundaries, groups",
    "partial_ratio": "mean share of consumed trajectories whose start and end versions differ",
    "restored_trajectories": "mean trajectories restored per step boundary",
    "trainer_wait_ratio": "share of the time the trainer waited for a mini-batch",
    "masked_token_ratio": "share of consumed response tokens generated before a trajectory's last abort",
    "colocate_step_time": "mean colocate step time excluding step 0, s",
    "colocate_partial_step_time": "mean colocate + partial step time excluding step 0, s",
}
COLOCATE_METRICS = {"colocate_step_time", "colocate_partial_step_time"}
# Relative weights in the fit: step times are what the table is about; counts and ratios are noisier.
DEFAULT_WEIGHTS = {"step_time": 1.0, "colocate_step_time": 1.0, "colocate_partial_step_time": 1.0,
                   "pipeline_buf_size": 0.1, "partial_ratio": 0.3, "restored_trajectories": 0.1,
                   "trainer_wait_ratio": 0.3, "masked_token_ratio": 0.3}


@dataclass(frozen=True)
class Row:
    """One measured figure: `metric` of the run (strategy, stale_steps), or of a colocate baseline."""

    label: str
    metric: str
    target: float
    strategy: Optional[str] = None
    stale_steps: Optional[float] = None
    weight: float = 1.0


@dataclass(frozen=True)
class Parameter:
    key: str  # a dotted override key, e.g. sim.trainer.per_token_s
    low: float
    high: float

    def value(self, u: float) -> float:
        """u in [0, 1] -> the parameter, geometric between the bounds (both > 0) or linear otherwise."""
        u = min(1.0, max(0.0, u))
        if self.low > 0:
            return math.exp(math.log(self.low) + u * (math.log(self.high) - math.log(self.low)))
        return self.low + u * (self.high - self.low)

    def position(self, value: float) -> float:
        value = min(self.high, max(self.low, value))
        if self.low > 0:
            return (math.log(value) - math.log(self.low)) / (math.log(self.high) - math.log(self.low))
        return (value - self.low) / (self.high - self.low)


# The published table (LoongSage docs/en/fully-async-mode.md, section 5.2 - 5.4; steady state, excluding step 0).
LOONGSAGE_PRESET = "loongsage_qwen3_30b"
LOONGSAGE_ANCHORS = [
    Row("colocate", "colocate_step_time", 578.63),
    Row("colocate + partial", "colocate_partial_step_time", 486.34),
    Row("no-window, stale 1.0", "step_time", 451.74, "no-window", 1.0),
    Row("no-window, stale 1.0", "pipeline_buf_size", 27, "no-window", 1.0),
    Row("no-window, stale 1.0", "partial_ratio", 0.834, "no-window", 1.0),
    Row("no-window, stale 1.0", "restored_trajectories", 808, "no-window", 1.0),
]
LOONGSAGE_PREDICTIONS = [
    Row("windowed-fifo, stale 1.0", "step_time", 424.30, "windowed-fifo", 1.0),
    Row("windowed-fifo, stale 1.0", "pipeline_buf_size", 13, "windowed-fifo", 1.0),
    Row("windowed-fifo, stale 1.0", "partial_ratio", 0.852, "windowed-fifo", 1.0),
    Row("windowed-fifo, stale 1.0", "restored_trajectories", 920, "windowed-fifo", 1.0),
    Row("windowed-fifo, stale 2.0", "step_time", 414.58, "windowed-fifo", 2.0),
    Row("windowed-fifo, stale 2.0", "pipeline_buf_size", 18, "windowed-fifo", 2.0),
    Row("windowed-fifo, stale 2.0", "restored_trajectories", 1392, "windowed-fifo", 2.0),
]
# What the LoongSage fit may move, and how far (everything else in the preset is published or estimated).
LOONGSAGE_PARAMETERS = [
    Parameter("sim.generation.decode.tokens_per_s_full", 3.0, 40.0),
    Parameter("sim.generation.prefill_tokens_per_s", 5000.0, 100000.0),
    Parameter("sim.generation.length.median", 1500.0, 10000.0),
    Parameter("sim.trainer.per_token_s", 1.0e-5, 4.0e-4),
    Parameter("sim.reward.filtered_group_prob", 0.05, 0.6),
    Parameter("sim.colocate.oversample", 1.0, 2.0),
    Parameter("sim.colocate.partial_oversample", 1.0, 3.0),
    Parameter("sim.generation.decode.tokens_per_s_single", 60.0, 400.0),
]


@dataclass
class Evaluation:
    values: dict[str, float]  # row key -> simulated value
    seconds: float


@dataclass
class Calibration:
    """Inputs of one fit: the configuration to start from, the rows, the parameters, how to run."""

    preset: Optional[str] = LOONGSAGE_PRESET
    config_file: Optional[str] = None
    overrides: list[str] = field(default_factory=list)
    anchors: list[Row] = field(default_factory=lambda: list(LOONGSAGE_ANCHORS))
    predictions: list[Row] = field(default_factory=lambda: list(LOONGSAGE_PREDICTIONS))
    parameters: list[Parameter] = field(default_factory=lambda: list(LOONGSAGE_PARAMETERS))
    steps: int = 16
    seeds: tuple[int, ...] = (0,)

    def evaluate(self, point: dict[str, float], rows: Sequence[Row]) -> Evaluation:
        """Run what `rows` need with the parameters at `point`; the mean over the seeds of every row."""
        started = time.perf_counter()
        sums: dict[str, float] = {}
        for seed in self.seeds:
            overrides = [*self.overrides, f"sim.seed={seed}", f"sim.steps={self.steps}",
                         *(f"{key}={value!r}" for key, value in point.items())]
            config = load_sim_config(self.config_file, overrides, preset=self.preset)
            colocate = None
            if any(row.metric in COLOCATE_METRICS for row in rows):
                colocate = colocate_baselines(config, self.steps)
            runs: dict[tuple[str, float], dict] = {}
            for row in rows:
                if row.metric in COLOCATE_METRICS:
                    index = 0 if row.metric == "colocate_step_time" else 1
                    value = colocate[index].avg_step_time
                else:
                    key = (row.strategy, row.stale_steps)
                    if key not in runs:
                        run = simulate(config, row.strategy, row.stale_steps, steps=self.steps, with_colocate=False)
                        summary = summarize(run)
                        summary["restored_trajectories"] = run.totals["restored"] * run.group_size / len(run.steps)
                        summary["step_time"] = summary["avg_step_time_excl_step0"]
                        summary["pipeline_buf_size"] = summary["pipeline_buf_size_mean"]
                        runs[key] = summary
                    value = runs[key][row.metric]
                sums[row_key(row)] = sums.get(row_key(row), 0.0) + float(value)
        return Evaluation({k: v / len(self.seeds) for k, v in sums.items()}, time.perf_counter() - started)

    def loss(self, evaluation: Evaluation) -> float:
        total = 0.0
        for row in self.anchors:
            simulated = evaluation.values[row_key(row)]
            total += row.weight * DEFAULT_WEIGHTS.get(row.metric, 1.0) * ((simulated - row.target) / row.target) ** 2
        return total


def row_key(row: Row) -> str:
    return f"{row.metric}@{row.strategy}@{row.stale_steps}"


def nelder_mead(f: Callable[[list[float]], float], start: list[float], step: float = 0.15, max_evals: int = 60,
                tolerance: float = 1e-4) -> tuple[list[float], float, int]:
    """Minimise f over [0, 1]^n from `start` (points are clipped to the box); returns (x, f(x), evaluations)."""
    n = len(start)
    clip = lambda x: [min(1.0, max(0.0, v)) for v in x]  # noqa: E731
    simplex = [clip(start)]
    for i in range(n):
        point = list(start)
        point[i] = point[i] + step if point[i] + step <= 1.0 else point[i] - step
        simplex.append(clip(point))
    values = [f(x) for x in simplex]
    evals = len(simplex)
    while evals < max_evals:
        order = sorted(range(n + 1), key=lambda i: values[i])
        simplex, values = [simplex[i] for i in order], [values[i] for i in order]
        if values[-1] - values[0] < tolerance:
            break
        centroid = [sum(p[i] for p in simplex[:-1]) / n for i in range(n)]
        worst = simplex[-1]
        reflected = clip([c + (c - w) for c, w in zip(centroid, worst)])
        fr = f(reflected)
        evals += 1
        if fr < values[0]:
            expanded = clip([c + 2 * (c - w) for c, w in zip(centroid, worst)])
            fe = f(expanded)
            evals += 1
            simplex[-1], values[-1] = (expanded, fe) if fe < fr else (reflected, fr)
        elif fr < values[-2]:
            simplex[-1], values[-1] = reflected, fr
        else:
            contracted = clip([c + 0.5 * (w - c) for c, w in zip(centroid, worst)])
            fc = f(contracted)
            evals += 1
            if fc < values[-1]:
                simplex[-1], values[-1] = contracted, fc
            else:  # shrink towards the best point
                best = simplex[0]
                for i in range(1, n + 1):
                    simplex[i] = [b + 0.5 * (p - b) for b, p in zip(best, simplex[i])]
                    values[i] = f(simplex[i])
                    evals += 1
    best = min(range(n + 1), key=lambda i: values[i])
    return simplex[best], values[best], evals


def fit(calibration: Calibration, start: dict[str, float], max_evals: int = 60,
        log: Optional[Callable[[str], None]] = None) -> tuple[dict[str, float], float, int]:
    """Fit `calibration.parameters` to its anchors from `start`; returns (point, loss, evaluations)."""
    params = calibration.parameters

    def objective(u: list[float]) -> float:
        point = {p.key: p.value(x) for p, x in zip(params, u)}
        evaluation = calibration.evaluate(point, calibration.anchors)
        value = calibration.loss(evaluation)
        if log is not None:
            log(f"  loss {value:8.5f}  " + "  ".join(f"{k.rsplit('.', 1)[1]}={v:.4g}" for k, v in point.items())
                + f"  ({evaluation.seconds:.1f} s)")
        return value

    u, value, evals = nelder_mead(objective, [p.position(start[p.key]) for p in params], max_evals=max_evals)
    return {p.key: p.value(x) for p, x in zip(params, u)}, value, evals


def current_values(calibration: Calibration) -> dict[str, float]:
    """The parameters' values in the configuration as it stands (preset / file / overrides)."""
    config = load_sim_config(calibration.config_file, calibration.overrides, preset=calibration.preset)
    out = {}
    for p in calibration.parameters:
        node: object = {"sim": config.sim, **config.pacer_part}
        for part in p.key.split("."):
            node = node[part]  # type: ignore[index]
        out[p.key] = float(node)  # type: ignore[arg-type]
    return out


def table(calibration: Calibration, point: dict[str, float]) -> list[dict]:
    """Every anchor and prediction with the simulated value at `point` and the relative error."""
    rows = calibration.anchors + calibration.predictions
    base = next((row for row in rows if row.metric == "colocate_step_time"), None)
    evaluation = calibration.evaluate(point, rows)
    out = []
    for kind, group in (("anchor", calibration.anchors), ("predicted", calibration.predictions)):
        for row in group:
            simulated = evaluation.values[row_key(row)]
            out.append({"kind": kind, "label": row.label, "metric": row.metric, "measured": row.target,
                        "simulated": simulated, "error": (simulated - row.target) / row.target})
            if base is not None and row.metric in ("step_time", "colocate_partial_step_time"):
                # Speed-up over colocate, as the published table gives it: measured / measured, simulated / simulated.
                measured = base.target / row.target
                speedup = evaluation.values[row_key(base)] / simulated
                out.append({"kind": kind, "label": row.label, "metric": "speedup_vs_colocate", "measured": measured,
                            "simulated": speedup, "error": (speedup - measured) / measured})
    return out


def format_rows(rows: Sequence[dict]) -> str:
    lines = [f"{'kind':<10} {'config':<26} {'metric':<28} {'measured':>10} {'simulated':>10} {'error':>8}"]
    for r in rows:
        lines.append(f"{r['kind']:<10} {r['label']:<26} {r['metric']:<28} {r['measured']:>10.4g} "
                     f"{r['simulated']:>10.4g} {100 * r['error']:>+7.1f}%")
    return "\n".join(lines)


def _parse_target(text: str) -> tuple[str, float]:
    if "=" not in text:
        raise ConfigError(f"--target {text!r}: must look like metric=value, e.g. step_time=451.7")
    name, value = text.split("=", 1)
    if name not in METRICS:
        raise ConfigError(f"--target {text!r}: unknown metric {name!r}; allowed: {', '.join(METRICS)}")
    try:
        number = float(value)
    except ValueError:
        raise ConfigError(f"--target {text!r}: {value!r} is not a number") from None
    if not math.isfinite(number) or number <= 0:
        raise ConfigError(f"--target {text!r}: the measured value must be a finite number > 0")
    return name, number


def _parse_parameter(text: str) -> Parameter:
    try:
        key, bounds = text.split("=", 1)
        low, high = (float(x) for x in bounds.split(":"))
    except ValueError:
        raise ConfigError(f"--fit {text!r}: must look like key=low:high, e.g. sim.trainer.per_token_s=1e-5:1e-3") from None
    if not (math.isfinite(low) and math.isfinite(high)) or high <= low:
        raise ConfigError(f"--fit {text!r}: needs finite bounds with low < high")
    return Parameter(key, low, high)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m coda_sim.calibrate", description=__doc__.splitlines()[0])
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="configuration overrides")
    parser.add_argument("--preset", help=f"preset to start from (default {LOONGSAGE_PRESET} without --config)")
    parser.add_argument("--config", metavar="FILE", help="YAML to start from (pacer keys and a sim: section)")
    parser.add_argument("--strategy", help="strategy of the measured run (with --target)")
    parser.add_argument("--stale-steps", type=float, help="stale_steps of the measured run (with --target)")
    parser.add_argument("--target", action="append", default=[], metavar="METRIC=VALUE",
                        help="a measured figure of your run (repeatable): " + ", ".join(METRICS))
    parser.add_argument("--fit", action="append", default=[], metavar="KEY=LOW:HIGH",
                        help="a parameter to fit and its bounds (repeatable); default: the LoongSage fit's four")
    parser.add_argument("--steps", type=int, default=16, help="steps per simulated run (default 16)")
    parser.add_argument("--seeds", default="0", help="comma-separated seeds every evaluation averages (default 0)")
    parser.add_argument("--max-evals", type=int, default=60, help="evaluations the search may spend (default 60)")
    parser.add_argument("--evaluate-only", action="store_true", help="no search: the table at the configured values")
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        seeds = tuple(int(s) for s in args.seeds.split(",") if s.strip())
        if not seeds:
            raise ValueError
    except ValueError:
        print(f"calibrate: --seeds {args.seeds!r}: must be comma-separated integers, e.g. 0,1,2", file=sys.stderr)
        return 2
    if args.steps < 2:
        print(f"calibrate: --steps {args.steps}: needs at least 2 (step 0 is left out of every figure)", file=sys.stderr)
        return 2
    calibration = Calibration(preset=args.preset if (args.preset or args.config) else LOONGSAGE_PRESET,
                              config_file=args.config, overrides=list(args.overrides), steps=args.steps, seeds=seeds)
    try:
        if args.target:
            calibration.anchors = [Row("your run" if name not in COLOCATE_METRICS else name, name, value,
                                       None if name in COLOCATE_METRICS else args.strategy,
                                       None if name in COLOCATE_METRICS else args.stale_steps)
                                   for name, value in map(_parse_target, args.target)]
            calibration.predictions = []
        if args.fit:
            calibration.parameters = [_parse_parameter(text) for text in args.fit]
        start = current_values(calibration)
        log = None if args.json else (lambda line: print(line, file=sys.stderr))
        started = time.perf_counter()
        if args.evaluate_only:
            point, loss, evals = start, calibration.loss(calibration.evaluate(start, calibration.anchors)), 1
        else:
            point, loss, evals = fit(calibration, start, args.max_evals, log)
        rows = table(calibration, point)
        seconds = time.perf_counter() - started
    except (ConfigError, WorkloadError, KeyError) as exc:
        print(f"calibrate: {exc}", file=sys.stderr)
        return 2
    except SimulationError as exc:
        print(f"calibrate: {exc}", file=sys.stderr)
        return 1
    if args.json:
        json.dump({"parameters": point, "loss": loss, "evaluations": evals, "seconds": seconds, "rows": rows,
                   "steps": args.steps, "seeds": list(seeds)}, sys.stdout, indent=2)
        sys.stdout.write("\n")
        return 0
    print(f"calibrate: {evals} evaluations, loss {loss:.5f}, {seconds:.0f} s ({args.steps} steps, seeds {args.seeds})")
    print("fitted:" if not args.evaluate_only else "values:")
    for key, value in point.items():
        print(f"  {key}={value:.4g}")
    print(format_rows(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
