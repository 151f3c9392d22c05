"""`coda-sim`: simulate a fully-async RL job on the real pacing core and compare strategies.

    coda-sim                                   # built-in long_tail preset, its configured strategy
    coda-sim --compare --stale-steps 1.0,2.0   # every registered strategy x those stale_steps
    coda-sim --config my.yaml sim.cluster.rollout_replicas=12 --steps 100 --seed 3
    coda-sim --compare --json > runs.json      # JSON only on stdout; progress on stderr
    coda-sim --compare --plot figures/         # timeline.png, staleness.png, comparison.png, pareto.png
    coda-sim --compare --seeds 0,1,2,3,4 --baseline windowed-fifo   # means, 95 % CIs, paired differences
"""
from __future__ import annotations

import argparse
import json
import logging
import math
import sys
import time
import traceback
from typing import Optional, Sequence

from coda_server.core.errors import ConfigError, StrategyHookError

from . import config as sim_config
from .plot import PlotUnavailable, require_matplotlib, write_pareto, write_plots
from .report import format_table, summarize
from .stats import aggregate, format_seed_table
from .runner import registered_strategies, sweep
from .sim import SimulationError
from .workload import WorkloadError


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="coda-sim",
        description="Deterministic discrete-event simulator of a fully-async RL job driving the real coda pacing "
                    "core: choose sliding_window and stale_steps before spending GPU hours.",
        epilog="Overrides are dotted key=value pairs over the preset / --config file, e.g. "
               "fully_async.sliding_window=no-window sim.cluster.rollout_replicas=12 rollout.partial=false. "
               "Workload keys are documented in docs/simulator.md and coda_sim/presets/defaults.yaml.",
    )
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="configuration overrides")
    parser.add_argument("--config", metavar="FILE", help="YAML merged over the defaults (pacer keys and a sim: section)")
    parser.add_argument("--preset", metavar="NAME",
                        help=f"built-in workload preset (default: {sim_config.DEFAULT_PRESET} unless --config is given); "
                             f"--list-presets shows them")
    parser.add_argument("--list-presets", action="store_true", help="print the built-in presets and exit")
    parser.add_argument("--compare", action="store_true", help="run every registered strategy (or --strategies)")
    parser.add_argument("--strategies", metavar="A,B", help="comma-separated strategy names to run")
    parser.add_argument("--stale-steps", metavar="X,Y", help="comma-separated fully_async.stale_steps values to sweep")
    parser.add_argument("--steps", type=int, metavar="N", help="training steps per run (sim.steps)")
    parser.add_argument("--seed", type=int, metavar="S", help="random seed (sim.seed); same seed, same result")
    parser.add_argument("--seeds", metavar="S1,S2", help="run every strategy on each of these seeds and report each "
                        "figure as mean and 95%% confidence interval, plus the paired difference to --baseline")
    parser.add_argument("--baseline", metavar="NAME", help="with --seeds: the strategy the others are compared to, "
                        "seed by seed at the same stale_steps (default: windowed-fifo when it runs, else the first)")
    parser.add_argument("--json", action="store_true", help="write only JSON to stdout: a list, one object per run "
                        "(with --seeds: per strategy and stale_steps, the aggregated figures)")
    parser.add_argument("--plot", metavar="DIR", help="write timeline.png, staleness.png, comparison.png and pareto.png "
                        "to DIR (with --seeds: pareto.png)")
    parser.add_argument("--check-invariants", action="store_true",
                        help="check the pacer invariant and the workers' bookkeeping after every event (slower)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    parser.add_argument("--debug", action="store_true", help="on an error, and with the pacer's warnings, print the "
                        "Python traceback too (e.g. of a strategy hook that raised)")
    return parser


class ServerWarnings(logging.Handler):
    """The pacing core's warnings (a skipped plugin module, a strategy hook's incident) on stderr, one line each
    as `coda-sim: ...`, with the traceback only under --debug. A hook's incident also stops the run with its own
    error line, so the strategy's warnings are held until the run ends, and those of the hook it stopped on dropped."""

    def __init__(self, debug: bool, stream=None):
        super().__init__(logging.WARNING)
        self.debug = debug
        self.stream = stream if stream is not None else sys.stderr
        self.held: list[str] = []
        self.setFormatter(logging.Formatter("coda-sim: %(message)s"))

    def emit(self, record: logging.LogRecord) -> None:
        if not self.debug:
            record = logging.makeLogRecord({**record.__dict__, "exc_info": None, "exc_text": None, "stack_info": None})
        line = self.format(record)
        if not self.debug and record.name == "coda_server.strategy":
            self.held.append(line)
        else:
            self.stream.write(line + "\n")

    def run_ended(self, error: Optional[BaseException] = None) -> None:
        """The run ended (with `error`): print the held lines but those of the hook it stopped on (its error says it)."""
        hook = error.__cause__ if error is not None else None
        said = f"strategy {hook.strategy!r} hook {hook.hook} " if isinstance(hook, StrategyHookError) else None
        for line in self.held:
            if said is None or said not in line:
                self.stream.write(line + "\n")
        self.held.clear()

    def __enter__(self) -> "ServerWarnings":
        logger = logging.getLogger("coda_server")
        self._saved = (logger.propagate, logger.level)
        logger.addHandler(self)
        logger.propagate = False  # not also through the root logger (or Python's last-resort handler)
        if logger.level == logging.NOTSET or logger.level > logging.WARNING:
            logger.setLevel(logging.WARNING)
        return self

    def __exit__(self, *exc) -> None:
        logger = logging.getLogger("coda_server")
        logger.removeHandler(self)
        logger.propagate, level = self._saved
        logger.setLevel(level)


class Progress:
    """A one-line progress bar on stderr (a line per finished run when stderr is not a terminal)."""

    def __init__(self, enabled: bool, stream=None):
        self.enabled = enabled
        self.stream = stream if stream is not None else sys.stderr
        self.tty = enabled and hasattr(stream, "isatty") and stream.isatty()
        self.started = time.perf_counter()

    def __call__(self, run: int, runs: int, label: str, step: int, steps: int) -> None:
        if not self.enabled:
            return
        done = (run + step / steps) / runs
        elapsed = time.perf_counter() - self.started
        if self.tty:
            width = 30
            filled = int(round(done * width))
            self.stream.write(f"\r[{'#' * filled}{'.' * (width - filled)}] {100 * done:5.1f}%  run {run + 1}/{runs} "
                              f"{label:<24} step {step}/{steps}  {elapsed:6.1f}s\x1b[K")
            self.stream.flush()
        elif step == steps:
            self.stream.write(f"coda-sim: run {run + 1}/{runs} {label} done ({elapsed:.1f}s)\n")
            self.stream.flush()

    def close(self) -> None:
        if self.tty:
            self.stream.write("\n")
            self.stream.flush()


def _seeds(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",")]  # an empty item ("0,,1", "") is refused, not skipped
    except ValueError:
        raise ConfigError(f"--seeds {text!r}: must be comma-separated integers, e.g. 0,1,2,3,4") from None
    if not values or len(set(values)) != len(values):
        raise ConfigError(f"--seeds {text!r}: needs at least one seed, each once")
    return values


def _floats(text: str, option: str) -> list[float]:
    try:
        values = [float(x) for x in text.split(",")]  # an empty item ("1,,2", "") is refused, not skipped
    except ValueError:
        raise ConfigError(f"{option} {text!r}: must be comma-separated numbers, e.g. 1.0,2.0") from None
    if not values or any(not math.isfinite(v) or v < 0 for v in values):
        raise ConfigError(f"{option} {text!r}: every value must be a finite number >= 0")
    return values


def workload_line(cfg: sim_config.SimConfig, pacer) -> str:
    sim = cfg.sim
    gen, length = sim["generation"], sim["generation"]["length"]
    source = pacer.data_sources[0]
    dist = length["distribution"]
    if dist == "lognormal":
        dist = f"lognormal median {length['median']:g} sigma {length['sigma']:g} cap {length['cap']}"
    elif dist == "constant":
        dist = f"constant {length['median']:g}"
    else:
        dist = f"empirical {length['file']} cap {length['cap']}"
    filtered = sim["reward"]["filtered_group_prob"]
    return (f"B={source.num_prompts_per_step} N={source.num_trajectories_per_prompt} "
            f"M={pacer.trainer.mini_batch_size}, {sim['cluster']['rollout_replicas']} replicas x "
            f"{sim['cluster']['slots_per_replica']} slots (colocate {sim['colocate']['rollout_replicas']}), "
            f"responses {dist} tokens, {gen['decode']['tokens_per_s_full']:g}-{gen['decode']['tokens_per_s_single']:g} "
            f"tok/s, reward-filtered groups {100 * filtered:g}%")


def main(argv: Optional[Sequence[str]] = None) -> int:
    # Intermixed: key=value overrides may come before, between and after options (`a.b=1 --steps 5 c.d=2`).
    args = build_parser().parse_intermixed_args(argv)
    if args.list_presets:
        for name in sim_config.preset_names():
            first = (sim_config.preset_path(name).read_text().splitlines() or [""])[0].lstrip("# ")
            print(f"{name:<16} {first}")
        return 0
    with ServerWarnings(args.debug) as warnings:
        return _run(args, warnings)


def _failed(args: argparse.Namespace, exc: BaseException, code: int) -> int:
    """The one `coda-sim:` line of an error (and, with --debug, its traceback first)."""
    if args.debug:
        traceback.print_exception(exc, file=sys.stderr)
    hint = "; --debug shows the traceback" if isinstance(exc.__cause__, StrategyHookError) and not args.debug else ""
    print(f"coda-sim: {exc}{hint}", file=sys.stderr)
    return code


def _run(args: argparse.Namespace, warnings: ServerWarnings) -> int:
    try:
        if args.plot:
            require_matplotlib()
        overrides = list(args.overrides)
        if args.steps is not None:
            overrides.append(f"sim.steps={args.steps}")
        if args.seed is not None:
            overrides.append(f"sim.seed={args.seed}")
        cfg = sim_config.load_sim_config(args.config, overrides, preset=args.preset)
        if cfg.steps < 1:
            raise ConfigError(f"sim.steps = {cfg.steps}: must be >= 1")
        pacer = cfg.pacer_config()
        known = registered_strategies(cfg)
        if args.strategies:
            strategies = [s.strip() for s in args.strategies.split(",") if s.strip()]
        elif args.compare:
            strategies = known
        else:
            strategies = [str(pacer.fully_async.sliding_window)]
        unknown = [s for s in strategies if s not in known]
        if unknown:
            raise ConfigError(f"unknown strategy {unknown[0]!r}; registered: {', '.join(known)}")
        stale_values = _floats(args.stale_steps, "--stale-steps") if args.stale_steps is not None else [
            float(pacer.fully_async.stale_steps)]
        runs_total = len(strategies) * len(stale_values)
        seeds = _seeds(args.seeds) if args.seeds is not None else None
        baseline = None
        if seeds is not None:
            if args.seed is not None:
                raise ConfigError("--seed and --seeds exclude each other: give the seeds to run in --seeds")
            baseline = args.baseline or ("windowed-fifo" if "windowed-fifo" in strategies else strategies[0])
            if baseline not in strategies:
                raise ConfigError(f"--baseline {baseline!r} is not among the strategies run: {', '.join(strategies)}")
        elif args.baseline:
            raise ConfigError("--baseline needs --seeds (differences are paired seed by seed)")
        progress = Progress(not args.no_progress)
        try:
            if seeds is None:
                runs = sweep(cfg, strategies, stale_values, check_invariants=args.check_invariants,
                             record_timeline=bool(args.plot), progress=progress)
            else:
                per_seed = []
                for k, seed in enumerate(seeds):
                    seed_cfg = sim_config.load_sim_config(args.config, [*overrides, f"sim.seed={seed}"],
                                                          preset=args.preset)
                    def seed_progress(run, runs, label, step, steps, _k=k):
                        progress(_k * runs + run, runs * len(seeds), f"{label} seed {seed}", step, steps)
                    per_seed.append([summarize(r) for r in sweep(seed_cfg, strategies, stale_values,
                                                                 check_invariants=args.check_invariants,
                                                                 progress=seed_progress)])
        finally:
            progress.close()
    except PlotUnavailable as exc:
        return _failed(args, exc, 2)
    except (ConfigError, WorkloadError) as exc:
        warnings.run_ended(exc)
        return _failed(args, exc, 2)
    except SimulationError as exc:
        warnings.run_ended(exc)
        return _failed(args, exc, 1)
    warnings.run_ended()
    if seeds is not None:
        entries = aggregate(per_seed, seeds, baseline)
        if args.plot:
            paths = [write_pareto(args.plot, entries)]
            print("coda-sim: wrote " + ", ".join(str(p) for p in paths), file=sys.stderr)
        try:
            if args.json:
                json.dump(entries, sys.stdout, indent=2)
                sys.stdout.write("\n")
            else:
                print(f"coda-sim: {workload_line(cfg, pacer)}; {cfg.steps} steps, seeds {','.join(map(str, seeds))}, "
                      f"{runs_total} run(s) per seed")
                print(format_seed_table(entries))
                print(f"mean ± 95% confidence interval over {len(seeds)} seeds (Student's t); differences are run "
                      f"minus {baseline} on the same seed and stale_steps")
            sys.stdout.flush()
        except BrokenPipeError:
            sys.stderr.close()
        return 0
    summaries = [summarize(run) for run in runs]
    if args.plot:
        paths = write_plots(args.plot, runs, summaries)
        print("coda-sim: wrote " + ", ".join(str(p) for p in paths), file=sys.stderr)
    try:
        if args.json:
            json.dump(summaries, sys.stdout, indent=2)
            sys.stdout.write("\n")
        else:
            print(f"coda-sim: {workload_line(cfg, pacer)}; {cfg.steps} steps, seed {cfg.seed}, {runs_total} run(s)")
            print(format_table(summaries))
            print("speedup = colocate step time / async step time excluding step 0 (pipeline fill); staleness = "
                  "weight version at consumption - trajectory start version")
        sys.stdout.flush()
    except BrokenPipeError:  # e.g. piped into head: not an error of ours
        sys.stderr.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
