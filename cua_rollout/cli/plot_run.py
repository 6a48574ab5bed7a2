"""PNG plots of one run: episodes finished, steps/s and desktops over time (metrics.jsonl),
model and env latency per step (traj.jsonl), success rate per domain; on request (--plots)
the run's timeline (what each desktop and each runner did over time, from results.jsonl and
traj.jsonl: cua_rollout.results.timeline) and the utilization of the desktops and the model
servers. A plot without input is skipped with a message on stderr. Exit codes: 0, 2 on bad
usage or RUN_DIR missing."""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path
from typing import Any

from cua_rollout.core.layout import METRICS_FILE
from cua_rollout.results import (
    Problem,
    Run,
    add_out_dir,
    compute_rates,
    fail,
    make_out_dir,
    open_run,
    read_metrics,
    read_traj,
    report_problems,
    results_parser,
)
from cua_rollout.results.timeline import (
    IDLE,
    PHASES,
    Lanes,
    Segment,
    activity_series,
    desktop_time_split,
    episode_segments,
    lanes,
    run_span,
)

__all__ = ["ALL_PLOTS", "COLOURS", "DEFAULT_LANES", "PLOTS", "main", "make_plots",
           "step_latencies"]  # fmt: skip

# The plots made by default (every one; --plots NAME ... picks some). ``timeline`` also
# writes timeline_runners.png.
PLOTS = ("progress", "desktops", "latency", "success_by_domain", "timeline", "utilization")
ALL_PLOTS = PLOTS
DEFAULT_LANES = 64
# One colour per phase of a desktop's time (cua_rollout.results.PHASES, IDLE) in every plot; the
# utilization samples' states take the colour of the phase they stand for.
COLOURS = {
    "setup": "#9467bd",
    "model": "#1f77b4",
    "action": "#2ca02c",
    "pause": "#bcbd22",
    "screenshot": "#17becf",
    "overhead": "#8c8c8c",
    "evaluation": "#d62728",
    "leased": "#ff9f4a",
    IDLE: "#e8e8e8",
    "resetting": "#c5b0d5",
}
_SAMPLE_STATES = {  # utilization.desktop's states, stacked in this order
    "acting": "action",
    "model_wait": "model",
    "pause": "pause",
    "other": "leased",
    "resetting": "resetting",
    "idle": IDLE,
}
_STEP_PARTS = ("model", "action", "pause", "screenshot", "overhead")
# Windows of the split computed from the timeline: the first step >= span / _WINDOWS.
_WINDOWS = 150
_WINDOW_STEPS_S = (1, 2, 5, 10, 15, 30, 60, 120, 300, 600, 900, 1800, 3600)
_HIDDEN_NAMED = 6  # lanes left out named in a timeline's title
_DPI = 100
_HIST_BINS = 30
_DESKTOP_STATES = ("leased", "free", "resetting", "starting", "quarantined")


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _series(samples: list[dict[str, Any]], *path: str,
            t0: float | None = None) -> tuple[list[float], list[float]]:  # fmt: skip
    """(elapsed_s, value) of the samples that have a number at ``path``; with ``t0``, x is
    the sample's ``t`` minus t0 (the timeline's clock) where the sample has one."""
    xs, ys = [], []
    for sample in samples:
        value: Any = sample
        for key in path:
            value = value.get(key) if isinstance(value, dict) else None
        x = sample.get("elapsed_s")
        if t0 is not None and _is_number(sample.get("t")):
            x = sample["t"] - t0
        if all(_is_number(v) for v in (x, value)):
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


# --------------------------------------------------------------------------- timeline


def _percent_line(split: dict[str, float]) -> str:
    parts = [(name, split.get(name, 0.0)) for name in (*PHASES, IDLE)]
    return ", ".join(f"{name} {100 * v:.0f}%" for name, v in parts if v >= 0.005)


def _legend(fig: Any, names: list[str], labels: dict[str, str] | None = None) -> None:
    from matplotlib.patches import Patch

    handles = [Patch(facecolor=COLOURS[n], edgecolor="#999999", linewidth=0.5,
                     label=(labels or {}).get(n, n)) for n in names]  # fmt: skip
    fig.legend(handles=handles, loc="lower center", ncol=min(len(handles), 9), fontsize=8,
               frameon=False)  # fmt: skip


def _plot_lanes(plt: Any, chosen: Lanes, span: tuple[float, float], title: str,
                note: str, empty: str, path: Path) -> None:  # fmt: skip
    """One lane per row, top to bottom; one broken_barh per lane and phase (and one for the
    lane's time on nothing, ``empty`` in the legend)."""
    t0, t1 = span
    n = len(chosen.names)
    height = min(3.0 + 0.22 * n, 24.0)
    fig, ax = plt.subplots(figsize=(14, height))
    try:
        left = min([0.0, *(g[0].start - t0 for g in chosen.segments.values() if g)])
        used: set[str] = set()
        for row, name in enumerate(chosen.names):
            y = (row - 0.4, 0.8)
            ax.broken_barh([(left, t1 - t0 - left)], y, facecolors=COLOURS[IDLE], linewidth=0)
            by_phase: dict[str, list[tuple[float, float]]] = {}
            for s in chosen.segments[name]:
                by_phase.setdefault(s.phase, []).append((s.start - t0, s.end - s.start))
            for phase, ranges in by_phase.items():
                ax.broken_barh(ranges, y, facecolors=COLOURS.get(phase, "k"), linewidth=0)
                used.add(phase)
        ax.set_yticks(range(n), chosen.names, fontsize=max(5, min(9, 500 // max(n, 1))))
        ax.set_ylim(n - 0.5, -0.5)
        ax.set_xlim(left, t1 - t0)
        ax.set_xlabel("seconds since the run's start")
        ax.set_title(f"{title}\n{note}", fontsize=10)
        ax.grid(axis="x", color="#cccccc", linewidth=0.5)
        ax.set_axisbelow(True)
        _legend(fig, [p for p in PHASES if p in used] + [IDLE], {IDLE: empty})
        fig.tight_layout(rect=(0, 0.45 / height, 1, 1))  # the legend's 0.45 in below
        fig.savefig(path, dpi=_DPI)
    finally:
        plt.close(fig)


def _plot_timeline(plt: Any, run: Run, segments: list[Segment], span: tuple[float, float],
                   max_lanes: int, out_dir: Path) -> dict[str, Path]:  # fmt: skip
    """timeline.png (a lane per desktop) and timeline_runners.png (lanes per runner)."""
    made = {}
    split = desktop_time_split(segments, *span)
    for name in ("timeline", "timeline_runners"):
        by_desktop = name == "timeline"
        chosen = lanes(segments, "desktop" if by_desktop else "runner", max_lanes)
        total = len(chosen.names) + len(chosen.hidden)
        what = ("desktop" if by_desktop else "runner lane") + ("s" if total > 1 else "")
        shown = f"{total} {what}" if not chosen.hidden else (
            f"the {len(chosen.names)} busiest of {total} {what} (--lanes)")
        if chosen.hidden:
            names = ", ".join(chosen.hidden[:_HIDDEN_NAMED])
            more = ", ..." if len(chosen.hidden) > _HIDDEN_NAMED else ""
            shown += f"; least busy, not shown: {names}{more}"
        if by_desktop:
            title = f"{run.name}: what each desktop did ({shown})"
            note = f"desktops' time: {_percent_line(split)}"
            empty = "idle / resetting (no episode)"
        else:
            title = f"{run.name}: the episodes of each runner ({shown})"
            note = "a runner runs several episodes at once: one lane per episode in flight"
            empty = "no episode"
        _plot_lanes(plt, chosen, span, title, note, empty, out_dir / f"{name}.png")
        made[name] = out_dir / f"{name}.png"
    return made


# --------------------------------------------------------------------------- utilization


def _window_s(span: tuple[float, float]) -> float:
    wanted = (span[1] - span[0]) / _WINDOWS
    return float(next((w for w in _WINDOW_STEPS_S if w >= wanted), _WINDOW_STEPS_S[-1]))


def _sample_split(samples: list[dict[str, Any]], t0: float | None
                  ) -> tuple[list[float], dict[str, list[float]], list[float]]:  # fmt: skip
    """x, each state's fractions (utilization.desktop, states in _SAMPLE_STATES) and the
    leased fraction (NaN where missing) of the samples that carry the split."""
    xs: list[float] = []
    ys: dict[str, list[float]] = {state: [] for state in _SAMPLE_STATES}
    leased: list[float] = []
    for sample in samples:
        split = (sample.get("utilization") or {}).get("desktop")
        if not isinstance(split, dict) or not any(_is_number(split.get(k)) for k in ys):
            continue
        x = _sample_x(sample, t0)
        if x is None:
            continue
        xs.append(float(x))
        for state, values in ys.items():
            value = split.get(state)
            values.append(float(value) if _is_number(value) else 0.0)
        value = split.get("leased")
        leased.append(float(value) if _is_number(value) else float("nan"))
    return xs, {k: v for k, v in ys.items() if any(v)}, leased


def _sample_x(sample: dict[str, Any], t0: float | None) -> float | None:
    """A sample's place on the x axis: seconds since ``t0`` (the run's start) when it has a
    time, else its ``elapsed_s``; None without either."""
    x = sample.get("elapsed_s")
    if t0 is not None and _is_number(sample.get("t")):
        x = sample["t"] - t0
    return float(x) if _is_number(x) else None


def _model_server_series(samples: list[dict[str, Any]], t0: float | None
                         ) -> dict[str, tuple[list[float], list[float]]]:  # fmt: skip
    """running, waiting, kv_cache_usage over time: model_servers.summary, else the sum
    (the mean for kv_cache_usage) over model_servers.endpoints."""
    out: dict[str, tuple[list[float], list[float]]] = {
        k: ([], []) for k in ("running", "waiting", "kv_cache_usage")}
    for sample in samples:
        servers = sample.get("model_servers")
        if not isinstance(servers, dict):
            continue
        x = _sample_x(sample, t0)
        if x is None:
            continue
        summary = servers.get("summary") if isinstance(servers.get("summary"), dict) else {}
        endpoints = [e for e in servers.get("endpoints") or [] if isinstance(e, dict)]
        for key, (xs, ys) in out.items():
            value = summary.get(key)
            if not _is_number(value):
                values = [e[key] for e in endpoints if _is_number(e.get(key))]
                value = (sum(values) / (len(values) if key == "kv_cache_usage" else 1)
                         if values else None)  # fmt: skip
            if _is_number(value):
                xs.append(float(x))
                ys.append(float(value))
    return {k: v for k, v in out.items() if v[0]}


def _plot_utilization(plt: Any, run: Run, samples: list[dict[str, Any]] | None,
                      segments: list[Segment], span: tuple[float, float] | None,
                      path: Path) -> bool:  # fmt: skip
    """Stacked desktop time split, actions/min, per-step time split, model servers; each
    panel from the metrics samples when they carry it, the split and the rate from the
    timeline otherwise (runs before those samples)."""
    samples = samples or []
    t0 = span[0] if span is not None else None
    panels: list[tuple[str, Any]] = []
    where = run.path / METRICS_FILE
    xs, states, leased = _sample_split(samples, t0)
    window_s = _window_s(span) if span is not None else 0.0
    windows = (activity_series(segments, *span, window_s)
               if segments and span is not None and not states else [])  # fmt: skip
    if states:
        panels.append(("samples split", (xs, states, leased)))
    elif windows:
        print(f"{where}: no utilization samples, the desktop split comes from the timeline",
              file=sys.stderr)  # fmt: skip
        panels.append(("timeline split", windows))
    rate, unit = _series(samples, "utilization", "actions_per_min", t0=t0), "actions/min"
    if not rate[0]:  # older samples: steps (an action each, but for the last) per second
        per_s = _series(samples, "steps_per_s", t0=t0)
        rate, unit = (per_s[0], [60 * v for v in per_s[1]]), "steps/min"
    if not rate[0] and windows and t0 is not None:
        rate = ([(w.start + w.end) / 2 - t0 for w in windows],
                [60 * w.steps / (w.end - w.start) for w in windows])
    if rate[0]:
        panels.append(("rate", (rate, unit)))
    parts = {k: _series(samples, "utilization", "step_s", k, t0=t0) for k in _STEP_PARTS}
    if any(v[0] for v in parts.values()):
        panels.append(("step split", parts))
    servers = _model_server_series(samples, t0)
    if servers:
        panels.append(("servers", servers))
    else:
        print(f"{where}: no model_servers samples, skipping the model servers panel",
              file=sys.stderr)  # fmt: skip
    if not panels or panels[0][0] not in ("samples split", "timeline split"):
        return False
    fig, axes = plt.subplots(len(panels), 1, sharex=True, figsize=(12, 2.6 * len(panels) + 1))
    axes = list(axes) if len(panels) > 1 else [axes]
    try:
        for ax, (kind, data) in zip(axes, panels, strict=True):
            if kind == "samples split":
                xs, states, leased = data
                names = list(states)
                # A sample tells of the interval before it: steps drawn backwards ("pre").
                ax.stackplot(xs, *(states[n] for n in names), step="pre", linewidth=0,
                             colors=[COLOURS[_SAMPLE_STATES[n]] for n in names],
                             labels=names)  # fmt: skip
                if any(v == v for v in leased):  # not all NaN
                    ax.plot(xs, leased, color="k", linewidth=1, drawstyle="steps-pre",
                            label="leased")  # fmt: skip
                ax.set_ylim(0, 1)
                ax.set_ylabel("desktops' time")
                ax.set_title("desktop time split (metrics.jsonl utilization)", fontsize=10)
                ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8)
            elif kind == "timeline split":
                # Each window as a block: its start, and the last one's end once more.
                edges = [w.start - (t0 or 0.0) for w in data] + [data[-1].end - (t0 or 0.0)]
                names = [p for p in (*PHASES, IDLE) if any(w.split[p] for w in data)]
                ax.stackplot(edges, *([w.split[n] for w in [*data, data[-1]]] for n in names),
                             colors=[COLOURS[n] for n in names], labels=names, step="post",
                             linewidth=0)  # fmt: skip
                ax.set_ylim(0, 1)
                ax.set_ylabel("desktops' time")
                ax.set_title(f"desktop time split from the timeline ({window_s:g} s windows; "
                             "idle includes resetting)", fontsize=10)  # fmt: skip
                ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8)
            elif kind == "rate":
                (xs, ys), unit = data
                ax.plot(xs, ys, color=COLOURS["action"])
                ax.set_ylabel(unit)
                ax.set_ylim(bottom=0)
            elif kind == "step split":
                names = [k for k in _STEP_PARTS if data[k][0]]
                longest = max(names, key=lambda k: len(data[k][0]))
                xs = data[longest][0]
                stacks = []
                for k in names:
                    got = dict(zip(*data[k], strict=True))
                    stacks.append([got.get(x, 0.0) for x in xs])
                ax.stackplot(xs, *stacks, colors=[COLOURS[k] for k in names], labels=names,
                             step="pre", linewidth=0)  # fmt: skip
                ax.set_title("mean step (metrics.jsonl utilization.step_s)", fontsize=10)
                ax.set_ylabel("s per step")
                ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8)
            elif kind == "servers":
                for key, colour in (("running", COLOURS["model"]), ("waiting", "#d62728")):
                    if key in data:
                        ax.plot(*data[key], label=f"requests {key}", color=colour,
                                drawstyle="steps-post")  # fmt: skip
                ax.set_ylabel("requests")
                ax.set_ylim(bottom=0)
                handles, labels = ax.get_legend_handles_labels()
                if "kv_cache_usage" in data:
                    kv = ax.twinx()
                    kv.plot(*data["kv_cache_usage"], color="#7f7f7f", linestyle="--",
                            label="KV cache usage")  # fmt: skip
                    kv.set_ylim(0, 1.05)
                    kv.set_ylabel("KV cache usage")
                    more = kv.get_legend_handles_labels()
                    handles, labels = handles + more[0], labels + more[1]
                ax.set_title("model servers", fontsize=10)
                ax.legend(handles, labels, loc="upper left", bbox_to_anchor=(1.06, 1.0),
                          fontsize=8)  # fmt: skip
        axes[0].set_xlim(left=min(0.0, axes[0].get_xlim()[0]))
        axes[-1].set_xlabel("seconds since the run's start")
        fig.suptitle(f"{run.name}: utilization")
        fig.tight_layout()
        fig.savefig(path, dpi=_DPI)
    finally:
        plt.close(fig)
    return True


# --------------------------------------------------------------------------- the CLI


def make_plots(run: Run, out_dir: Path, plots: tuple[str, ...] = PLOTS, *,
               max_lanes: int = DEFAULT_LANES) -> dict[str, Path | None]:  # fmt: skip
    """Write the ``plots`` (names of ALL_PLOTS) into ``out_dir``; each plot's path, or None
    when it was skipped because its input is missing (no metrics.jsonl, no step timings,
    nothing scored, no desktop times). ``timeline`` also writes ``timeline_runners``."""
    import matplotlib

    matplotlib.use("Agg")  # files only, never a window, also without a display
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    made: dict[str, Path | None] = {}
    for name in plots:
        made[name] = None
        if name == "timeline":
            made["timeline_runners"] = None
    samples, problems = read_metrics(run.path)
    report_problems(problems)
    metric_plots = [name for name in ("progress", "desktops") if name in plots]
    if samples is None and metric_plots:
        print(f"{run.path / METRICS_FILE}: missing, skipping "
              f"{' and '.join(metric_plots)} plot{'s' if len(metric_plots) > 1 else ''}",
              file=sys.stderr)  # fmt: skip
    elif samples is not None:
        for name, plot in (("progress", _plot_progress), ("desktops", _plot_desktops)):
            if name not in plots:
                continue
            path = out_dir / f"{name}.png"
            if plot(plt, samples, path):
                made[name] = path
            else:
                print(f"{run.path / METRICS_FILE}: no samples for the {name} plot, skipped",
                      file=sys.stderr)  # fmt: skip
    if "latency" in plots:
        model_s, env_s, problems = step_latencies(run)
        report_problems(problems)
        if _plot_latency(plt, model_s, env_s, out_dir / "latency.png"):
            made["latency"] = out_dir / "latency.png"
        else:
            print(f"{run.path}: no step timings in traj.jsonl, skipping the latency plot",
                  file=sys.stderr)  # fmt: skip
    if "success_by_domain" in plots:
        if _plot_success(plt, run, out_dir / "success_by_domain.png"):
            made["success_by_domain"] = out_dir / "success_by_domain.png"
        else:
            print(f"{run.path}: no scored episodes, skipping the success plot", file=sys.stderr)
    if "timeline" in plots or "utilization" in plots:
        found: list[Problem] = []
        segments = episode_segments(run, found)
        if "latency" not in plots:  # else reported above, as the same lines
            report_problems(found)
        span = run_span(run, segments)
        if "timeline" in plots:
            if segments and span is not None:
                made |= _plot_timeline(plt, run, segments, span, max_lanes, out_dir)
            else:
                print(f"{run.path}: no episode with a desktop and its times in "
                      "results.jsonl, skipping the timeline", file=sys.stderr)  # fmt: skip
        if "utilization" in plots:
            if _plot_utilization(plt, run, samples, segments, span, out_dir / "utilization.png"):
                made["utilization"] = out_dir / "utilization.png"
            else:
                print(f"{run.path}: no utilization samples in metrics.jsonl and no desktop "
                      "timeline, skipping the utilization plot", file=sys.stderr)  # fmt: skip
    return made


def _parser() -> argparse.ArgumentParser:
    parser = results_parser(
        "plot_run.py",
        "PNG plots of a run: episodes finished and steps/s over time, desktops "
        "leased over time (metrics.jsonl), model and env latency histograms (traj.jsonl), "
        "success rate per domain; on request the run's timeline (what each desktop and "
        "each runner did, second by second: setup, model, action, pause, screenshot, "
        "overhead, evaluation, idle) and the utilization of the desktops and model servers.",
    )
    add_out_dir(parser, "plots")
    parser.add_argument(
        "--plots", nargs="+", metavar="NAME", choices=(*ALL_PLOTS, "all"),
        help=f"the plots to make, of {', '.join(ALL_PLOTS)}, or all (default: "
        f"{' '.join(PLOTS)}); timeline also writes timeline_runners.png",
    )  # fmt: skip
    parser.add_argument(
        "--lanes", type=int, default=DEFAULT_LANES, metavar="N",
        help=f"timeline: at most N lanes per figure, the busiest (default {DEFAULT_LANES})",
    )  # fmt: skip
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.lanes < 1:
        fail(parser, f"--lanes {args.lanes}: must be at least 1")
    plots = PLOTS if not args.plots else (
        ALL_PLOTS if "all" in args.plots else tuple(dict.fromkeys(args.plots)))
    run = open_run(parser, args.run_dir)
    out_dir = make_out_dir(parser, args.out if args.out is not None else run.path / "plots")
    if not run.episodes:
        print(f"{run.path}: no finished episodes")
    made = make_plots(run, out_dir, plots, max_lanes=args.lanes)
    for name, path in made.items():
        print(f"{name}: {path if path is not None else 'skipped'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
