"""PNG figures of simulated runs (needs the optional `plot` extra: matplotlib)."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

from .sim import RunResult
from .stats import pareto_front

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
             _comparison(plt, out / "comparison.png", summaries),
             _pareto(plt, out / "pareto.png", [_point(s) for s in summaries], "seed " + str(summaries[0]["seed"]))]
    return paths


def write_pareto(directory: str | Path, entries: Sequence[dict[str, Any]]) -> Path:
    """pareto.png in `directory` from seed-aggregated entries (`coda_sim.stats.aggregate`), with 95 % CIs."""
    plt = require_matplotlib()
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    points = []
    for e in entries:
        m = e["metrics"]
        points.append({"strategy": e["strategy"], "stale_steps": e["stale_steps"],
                       **{k: (m[k]["mean"], m[k]["ci95"]) for k in ("staleness_mean", "avg_step_time_excl_step0",
                                                                     "useful_throughput")}})
    return _pareto(plt, out / "pareto.png", points, f"mean and 95% CI over {len(entries[0]['seeds'])} seeds")


def _point(summary: dict[str, Any]) -> dict[str, Any]:
    return {"strategy": summary["strategy"], "stale_steps": summary["stale_steps"],
            **{k: (summary[k], None) for k in ("staleness_mean", "avg_step_time_excl_step0", "useful_throughput")}}


def _pareto(plt, path: Path, points: Sequence[dict[str, Any]], note: str) -> Path:
    """Step time and useful throughput against staleness; every strategy a colour, every stale_steps a marker."""
    strategies = list(dict.fromkeys(p["strategy"] for p in points))
    stales = sorted({p["stale_steps"] for p in points})
    markers = "osD^vP*X"
    fig, axes = plt.subplots(1, 2, figsize=(12, 5))
    panels = [("avg_step_time_excl_step0", "step time, excl. step 0 (s)", False),
              ("useful_throughput", "useful throughput (unmasked tokens trained / s)", True)]
    for ax, (key, title, higher_better) in zip(axes, panels):
        xy = [(p["staleness_mean"][0], -p[key][0] if higher_better else p[key][0]) for p in points]
        front = set(pareto_front(xy))
        for i, p in enumerate(points):
            x, xerr = p["staleness_mean"]
            y, yerr = p[key]
            colour = f"C{strategies.index(p['strategy'])}"
            ax.errorbar(x, y, xerr=xerr, yerr=yerr, fmt=markers[stales.index(p["stale_steps"]) % len(markers)],
                        color=colour, ms=9 if i in front else 6, mfc=colour if i in front else "white", capsize=3)
        line = sorted((points[i]["staleness_mean"][0], points[i][key][0]) for i in front)
        ax.plot([a for a, _ in line], [b for _, b in line], color="0.6", ls="--", lw=0.8, zorder=0)
        ax.set_xlabel("mean staleness of consumed trajectories (versions)")
        ax.set_ylabel(title)
        ax.set_title(("higher" if higher_better else "lower") + " and to the left is better; filled: Pareto front",
                     fontsize=9)
    handles = [plt.Line2D([], [], color=f"C{i}", marker="o", ls="", label=name) for i, name in enumerate(strategies)]
    handles += [plt.Line2D([], [], color="0.3", marker=markers[i % len(markers)], ls="", mfc="white",
                           label=f"stale_steps {v:g}") for i, v in enumerate(stales)]
    fig.legend(handles=handles, loc="lower center", ncol=min(6, len(handles)), fontsize=8)
    fig.suptitle(f"strategies x stale_steps ({note})", fontsize=10)
    fig.tight_layout(rect=(0, 0.08, 1, 0.95))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


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
