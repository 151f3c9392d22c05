"""Running simulations: one run, or a sweep over strategies x stale_steps sharing one colocate baseline."""
from __future__ import annotations

from typing import Callable, Optional, Sequence

from coda_server.core.strategy import STRATEGIES

from .config import SimConfig
from .sim import AsyncSimulation, ColocateResult, RunResult, run_colocate
from .workload import Workload


def make_workload(config: SimConfig, group_size: int) -> Workload:
    return Workload(config.sim, group_size, config.base_dir)


def colocate_baseline(config: SimConfig, steps: Optional[int] = None) -> ColocateResult:
    pacer_config = config.pacer_config()
    workload = make_workload(config, int(pacer_config.data_sources[0].num_trajectories_per_prompt))
    return run_colocate(pacer_config, workload, steps or config.steps)


def simulate(config: SimConfig, strategy: Optional[str] = None, stale_steps: Optional[float] = None, *,
             steps: Optional[int] = None, colocate: Optional[ColocateResult] = None, with_colocate: bool = True,
             check_invariants: bool = False, record_timeline: bool = False,
             on_step: Optional[Callable[[int, int], None]] = None) -> RunResult:
    """One fully-async run of the real Pacer (strategy / stale_steps default to the configuration's)."""
    steps = steps or config.steps
    pacer_config = config.pacer_config(strategy, stale_steps)
    workload = make_workload(config, int(pacer_config.data_sources[0].num_trajectories_per_prompt))
    sim = AsyncSimulation(pacer_config, workload, steps, check_invariants=check_invariants,
                          record_timeline=record_timeline, on_step=on_step)
    result = sim.run()
    if colocate is None and with_colocate:
        colocate = colocate_baseline(config, steps)
    result.colocate = colocate
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
    colocate = colocate_baseline(config, steps)
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
