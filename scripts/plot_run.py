"""PNG plots of one run: episodes finished, steps/s and desktops over time (metrics.jsonl),
model and env latency per step (traj.jsonl), success rate per domain. A plot without input
is skipped with a message on stderr. Exit codes: 0, 2 on bad usage or RUN_DIR missing."""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path
from typing import Any

from rollout.layout import METRICS_FILE
from rollout.results import (
    Problem,
    Run,
    add_out_dir,
    compute_rates,
    make_out_dir,
    open_run,
    read_metrics,
    read_traj,
    report_problems,
    results_parser,
)

__all__ = ["PLOTS", "main", "step_latencies"]

PLOTS = ("progress", "desktops", "latency", "success_by_domain")
_DPI = 100
_HIST_BINS = 30
_DESKTOP_STATES = ("leased", "free", "resetting", "starting", "quarantined")


def _series(samples: list[dict[str, Any]], *path: str) -> tuple[list[float], list[float]]:
    """(elapsed_s, value) of the samples that have a number at ``path``."""
    xs, ys = [], []
    for sample in samples:
        value: Any = sample
        for key in path:
            value = value.get(key) if isinstance(value, dict) else None
        x = sample.get("elapsed_s")
        if all(isinstance(v, int | float) and not isinstance(v, bool) for v in (x, value)):
            xs.append(float(x))
            ys.append(float(value))
    return xs, ys


def _plot_progress(plt: Any, samples: list[dict[str, Any]], path: Path) -> bool:
    t_done, done = _series(samples, "episodes_done")
    t_rate, rate = _series(samples, "steps_per_s")
    if not done and not rate:
        return False
    fig, (top, bottom) = plt.subplots(2, 1, sharex=True, figsize=(9, 6))
    try:
        top.plot(t_done, done, drawstyle="steps-post")
        top.set_ylabel("episodes finished")
        bottom.plot(t_rate, rate, color="tab:orange")
        bottom.set_ylabel("steps/s")
        bottom.set_xlabel("elapsed s")
        top.set_title("progress")
        fig.tight_layout()
        fig.savefig(path, dpi=_DPI)
    finally:
        plt.close(fig)
    return True


def _plot_desktops(plt: Any, samples: list[dict[str, Any]], path: Path) -> bool:
    curves = {state: _series(samples, "desktops", state) for state in _DESKTOP_STATES}
    if not curves["leased"][0]:
        return False
    fig, ax = plt.subplots(figsize=(9, 4))
    try:
        for state, (xs, ys) in curves.items():
            if xs and (state == "leased" or any(ys)):
                ax.plot(xs, ys, label=state, drawstyle="steps-post",
                        linewidth=2.5 if state == "leased" else 1.0)  # fmt: skip
        ax.set_xlabel("elapsed s")
        ax.set_ylabel("desktops")
        ax.set_title("desktops over time")
        ax.legend(loc="upper right")
        fig.tight_layout()
        fig.savefig(path, dpi=_DPI)
    finally:
        plt.close(fig)
    return True


def step_latencies(run: Run) -> tuple[list[float], list[float], list[Problem]]:
    """``timing.model_s`` and ``timing.env_s`` of every step of the run's episodes."""
    model_s, env_s, problems = [], [], []
    for episode in run.episodes:
        lines, found = read_traj(episode)
        problems.extend(found)
        for line in lines:
            timing = line.get("timing")
            if not isinstance(timing, dict):
                continue
            for name, out in (("model_s", model_s), ("env_s", env_s)):
                value = timing.get(name)
                if isinstance(value, int | float) and not isinstance(value, bool):
                    out.append(float(value))
    return model_s, env_s, problems


def _plot_latency(plt: Any, model_s: list[float], env_s: list[float], path: Path) -> bool:
    if not model_s and not env_s:
        return False
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    try:
        for ax, values, name in ((axes[0], model_s, "model"), (axes[1], env_s, "env")):
            if values:
                median = statistics.median(values)
                ax.hist(values, bins=_HIST_BINS)
                ax.axvline(median, color="k", linestyle="--", label=f"median {median:.2f} s")
                ax.legend()
            ax.set_title(f"{name} latency per step ({len(values)} steps)")
            ax.set_xlabel("s")
        axes[0].set_ylabel("steps")
        fig.tight_layout()
        fig.savefig(path, dpi=_DPI)
    finally:
        plt.close(fig)
    return True


def _plot_success(plt: Any, run: Run, path: Path) -> bool:
    domains = sorted({e.domain for e in run.episodes})
    rates = {d: compute_rates(e for e in run.episodes if e.domain == d) for d in domains}
    rates = {d: r for d, r in rates.items() if r.success_rate is not None}
    if not rates:
        return False
    overall = compute_rates(run.episodes).success_rate
    fig, ax = plt.subplots(figsize=(max(6, 0.8 * len(rates) + 2), 4))
    try:
        names = list(rates)
        bars = ax.bar(names, [rates[d].success_rate for d in names])
        for bar, d in zip(bars, names, strict=True):
            ax.annotate(f"n={rates[d].scored_episodes}", (bar.get_x() + bar.get_width() / 2,
                        bar.get_height()), ha="center", va="bottom", fontsize=8)  # fmt: skip
        if overall is not None:
            ax.axhline(overall, color="k", linestyle="--", label=f"all {overall:.1%}")
            ax.legend()
        ax.set_ylim(0, 1.05)
        ax.set_ylabel("success rate (mean reward)")
        ax.set_title("success rate per domain (infra_error, cancelled excluded)")
        ax.tick_params(axis="x", labelrotation=30)
        fig.tight_layout()
        fig.savefig(path, dpi=_DPI)
    finally:
        plt.close(fig)
    return True


def make_plots(run: Run, out_dir: Path) -> dict[str, Path | None]:
    """Write the plots into ``out_dir``; each plot's path, or None when it was skipped
    because its input is missing (no metrics.jsonl, no step timings, nothing scored)."""
    import matplotlib

    matplotlib.use("Agg")  # files only, never a window, also without a display
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    made: dict[str, Path | None] = dict.fromkeys(PLOTS)
    samples, problems = read_metrics(run.path)
    report_problems(problems)
    if samples is None:
        print(f"{run.path / METRICS_FILE}: missing, skipping progress and desktops plots",
              file=sys.stderr)  # fmt: skip
    else:
        for name, plot in (("progress", _plot_progress), ("desktops", _plot_desktops)):
            path = out_dir / f"{name}.png"
            if plot(plt, samples, path):
                made[name] = path
            else:
                print(f"{run.path / METRICS_FILE}: no samples for the {name} plot, skipped",
                      file=sys.stderr)  # fmt: skip
    model_s, env_s, problems = step_latencies(run)
    report_problems(problems)
    if _plot_latency(plt, model_s, env_s, out_dir / "latency.png"):
        made["latency"] = out_dir / "latency.png"
    else:
        print(
            f"{run.path}: no step timings in traj.jsonl, skipping the latency plot", file=sys.stderr
        )
    if _plot_success(plt, run, out_dir / "success_by_domain.png"):
        made["success_by_domain"] = out_dir / "success_by_domain.png"
    else:
        print(f"{run.path}: no scored episodes, skipping the success plot", file=sys.stderr)
    return made


def _parser() -> argparse.ArgumentParser:
    parser = results_parser(
        "plot_run.py",
        "PNG plots of a run: episodes finished and steps/s over time, desktops "
        "leased over time (metrics.jsonl), model and env latency histograms (traj.jsonl), "
        "success rate per domain.",
    )
    add_out_dir(parser, "plots")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    run = open_run(parser, args.run_dir)
    out_dir = make_out_dir(parser, args.out if args.out is not None else run.path / "plots")
    if not run.episodes:
        print(f"{run.path}: no finished episodes")
    made = make_plots(run, out_dir)
    for name, path in made.items():
        print(f"{name}: {path if path is not None else 'skipped'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
