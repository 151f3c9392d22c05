"""coda-sim: a deterministic discrete-event simulator of a fully-async RL job driving the real pacing core."""
try:
    from .config import SimConfig, load_sim_config, preset_names
    from .report import format_table, summarize
    from .runner import colocate_baseline, colocate_baselines, registered_strategies, simulate, sweep
    from .sim import AsyncSimulation, ColocateResult, RunResult, SimulationError, run_colocate
    from .workload import Workload, WorkloadError
except ModuleNotFoundError as missing:  # coda-sim is in the server extra
    from coda_client.commands import exit_if_run_as_module

    exit_if_run_as_module(missing)
    raise

__all__ = [
    "AsyncSimulation", "ColocateResult", "RunResult", "SimConfig", "SimulationError", "Workload", "WorkloadError",
    "colocate_baseline", "colocate_baselines", "format_table", "load_sim_config", "preset_names", "registered_strategies", "run_colocate",
    "simulate", "summarize", "sweep",
]
