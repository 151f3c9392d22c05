"""PNG figures of simulated runs (needs the optional `plot` extra: matplotlib)."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

from .sim import RunResult

INSTALL_HINT = "--plot needs matplotlib, the optional 'plot' extra: pip install 'coda-pacer[plot]'"


class PlotUnavailable(RuntimeError):
    pass


def require_matplotlib() -> Any:
    """Import matplotlib with a file-only backend, or raise PlotUnavailable with the install hint."""
    try:
        import matplotlib
    except ImportError:
        raise PlotUnavailable(INSTALL_HINT) from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _label(summary: dict[str, Any]) -> str:
    return f"{summary['strategy']} s={summary['stale_steps']:g}"


def write_plots(directory: str | Path, runs: Sequence[RunResult], summaries: Sequence[dict[str, Any]]) -> list[Path]:
    """timeline.png, staleness.png and comparison.png in `directory`; returns the paths written."""
    plt = require_matplotlib()
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    paths = [_timeline(plt, out / "timeline.png", runs, summaries),
             _staleness(plt, out / "staleness.png", runs, summaries),
             _comparison(plt, out / "comparison.png", summaries)]
    return paths


def _timeline(plt, path: Path, runs: Sequence[RunResult], summaries) -> Path:
    fig, axes = plt.subplots(len(runs), 1, figsize=(11, 2.6 * len(runs)), sharex=True, squeeze=False)
    for ax, run, summary in zip(axes[:, 0], runs, summaries):
        if run.timeline:
            t = [p[0] for p in run.timeline] + [run.sim_time]
            running = [p[1] for p in run.timeline] + [run.timeline[-1][1]]
            buffered = [p[2] for p in run.timeline] + [run.timeline[-1][2]]
            ax.step(t, [r + b for r, b in zip(running, buffered)], where="post", color="0.6", lw=0.8,
                    label="running + buffered")
            ax.step(t, running, where="post", color="tab:blue", lw=1.0, label="running R")
            ax.step(t, buffered, where="post", color="tab:orange", lw=1.0, label="buffered Q")
        ax.axhline(run.capacity, color="tab:red", ls="--", lw=1.0, label=f"capacity C = {run.capacity}")
        for step in run.steps:
            ax.axvline(step.ended, color="0.85", lw=0.6, zorder=0)
        ax.set_ylabel("groups")
        ax.set_title(_label(summary), fontsize=10, loc="left")
        ax.set_ylim(0, run.capacity * 1.1)
    axes[0, 0].legend(loc="upper right", fontsize=8, ncol=4)
    axes[-1, 0].set_xlabel("simulated time (s); grey lines: step boundaries")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _staleness(plt, path: Path, runs: Sequence[RunResult], summaries) -> Path:
    fig, ax = plt.subplots(figsize=(9, 4.5))
    top = max((max(r.staleness) for r in runs if r.staleness), default=0)
    width = 0.8 / max(1, len(runs))
    for i, (run, summary) in enumerate(zip(runs, summaries)):
        total = sum(run.staleness.values()) or 1
        xs = [v + (i - (len(runs) - 1) / 2) * width for v in range(top + 1)]
        ax.bar(xs, [run.staleness.get(v, 0) / total for v in range(top + 1)], width=width, label=_label(summary))
    ax.set_xticks(range(top + 1))
    ax.set_xlabel("staleness of a consumed trajectory (weight version at consumption - start version)")
    ax.set_ylabel("share of consumed trajectories")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _comparison(plt, path: Path, summaries) -> Path:
    panels = [("speedup_vs_colocate", "speedup vs colocate (x)"),
              ("pipeline_buf_size_mean", "pipeline_buf_size at boundaries (groups)"),
              ("trainer_wait_ratio", "trainer wait ratio"),
              ("staleness_mean", "mean staleness (versions)")]
    labels = [_label(s) for s in summaries]
    fig, axes = plt.subplots(2, 2, figsize=(11, 7))
    for ax, (key, title) in zip(axes.flat, panels):
        values = [s.get(key) or 0.0 for s in summaries]
        bars = ax.bar(range(len(values)), values, color=[f"C{i}" for i in range(len(values))])
        ax.bar_label(bars, fmt="%.2f", fontsize=8)
        ax.set_title(title, fontsize=10)
        ax.set_xticks(range(len(values)), labels, rotation=30, ha="right", fontsize=8)
        if key == "speedup_vs_colocate":
            ax.axhline(1.0, color="0.4", ls="--", lw=0.8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
