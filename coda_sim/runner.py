"""Running simulations: one run, or a sweep over strategies x stale_steps sharing one colocate baseline."""
from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

from coda_server.core.strategy import STRATEGIES

from .config import SimConfig
from .sim import AsyncSimulation, ColocateResult, RunResult, run_colocate
from .workload import Workload


def make_workload(config: SimConfig, pacer_config: Any) -> Workload:
    source = pacer_config.data_sources[0]
    return Workload(config.sim, int(source.num_trajectories_per_prompt), config.base_dir,
                    batch_groups=int(source.num_prompts_per_step))


def colocate_baseline(config: SimConfig, steps: Optional[int] = None, *, partial: bool = False) -> ColocateResult:
    """The synchronous baseline on all GPUs; `partial` continues the groups cut off at B (colocate + partial)."""
    pacer_config = config.pacer_config()
    return run_colocate(pacer_config, make_workload(config, pacer_config), steps or config.steps, partial)


def colocate_baselines(config: SimConfig, steps: Optional[int] = None) -> tuple[ColocateResult, ColocateResult]:
    """(colocate, colocate + partial) on the same prompts."""
    return colocate_baseline(config, steps), colocate_baseline(config, steps, partial=True)


def simulate(config: SimConfig, strategy: Optional[str] = None, stale_steps: Optional[float] = None, *,
             steps: Optional[int] = None, colocate: Optional[tuple[ColocateResult, ColocateResult]] = None,
             with_colocate: bool = True,
             check_invariants: bool = False, record_timeline: bool = False,
             on_step: Optional[Callable[[int, int], None]] = None) -> RunResult:
    """One fully-async run of the real Pacer (strategy / stale_steps default to the configuration's).

    `colocate` is the (colocate, colocate + partial) pair from `colocate_baselines`, computed here when
    not given (unless `with_colocate` is false).
    """
    steps = steps or config.steps
    pacer_config = config.pacer_config(strategy, stale_steps)
    sim = AsyncSimulation(pacer_config, make_workload(config, pacer_config), steps, check_invariants=check_invariants,
                          record_timeline=record_timeline, on_step=on_step)
    result = sim.run()
    if colocate is None and with_colocate:
        colocate = colocate_baselines(config, steps)
    if colocate is not None:
        result.colocate, result.colocate_partial = colocate
    return result


def registered_strategies(config: SimConfig) -> list[str]:
    """Every strategy name registered once the configuration's plugins are loaded (built-ins and custom)."""
    config.pacer_config()  # loads coda_server/custom and server.custom_strategy_dirs
    return STRATEGIES.names()


def sweep(config: SimConfig, strategies: Sequence[str], stale_values: Sequence[Optional[float]], *,
          steps: Optional[int] = None, check_invariants: bool = False, record_timeline: bool = False,
          progress: Optional[Callable[[int, int, str, int, int], None]] = None) -> list[RunResult]:
    """strategies x stale_values runs; `progress(run_index, runs, label, step, steps)` after every step."""
    steps = steps or config.steps
    colocate = colocate_baselines(config, steps)
    combos = [(s, v) for s in strategies for v in stale_values]
    results = []
    for i, (strategy, stale) in enumerate(combos):
        label = f"{strategy}" + (f" s={stale:g}" if stale is not None else "")
        hook = None
        if progress is not None:
            def hook(step: int, total: int, _i: int = i, _label: str = label) -> None:
                progress(_i, len(combos), _label, step, total)
        results.append(simulate(config, strategy, stale, steps=steps, colocate=colocate,
                                check_invariants=check_invariants, record_timeline=record_timeline, on_step=hook))
    return results
