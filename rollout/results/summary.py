"""The summary of one run that scripts/show_result.py prints and run.py shows at the end of
a run: ``summarize(run)`` computes it, ``print_table(summary)`` prints it as a table.

``summarize`` returns one object (schema "show_result/1", show_result.py's ``--json``):
  {"schema": "show_result/1", "run_dir": str, "layout": "cua-rollout" | "osworld",
   "problems": [str, ...],                      unreadable lines/files, skipped
   "overall": RATES, "feasible": RATES, "infeasible": RATES,
   "domains": {domain: RATES, ...},             sorted by name
   "groups": {"Office" | "Daily" | "Professional": RATES, ...}   only groups present}
RATES is ``Rates.to_json()`` (rollout/results/rates.py): episode and task counts, k_min and
k_max, success_rate, avg_at_k, pass_at_k (fractions in [0, 1], null when nothing is
scored), mean_steps, mean_duration_s and status_counts; infra_error and cancelled episodes
are counted but left out of every rate.
"""

from __future__ import annotations

import sys
from typing import Any

from rollout.results.cli import STATUS_ABBREV, fmt_float, fmt_rate
from rollout.results.rates import OSWORLD_GROUPS, compute_rates, group_of, k_label
from rollout.results.runs import Run
from rollout.types import STATUSES

__all__ = ["SUMMARY_SCHEMA", "print_table", "summarize"]

SUMMARY_SCHEMA = "show_result/1"


def summarize(run: Run) -> dict[str, Any]:
    """The summary object of a run (see the module docstring)."""
    episodes = run.episodes
    domains = sorted({e.domain for e in episodes})
    groups = {}
    for name in OSWORLD_GROUPS:
        members = [e for e in episodes if group_of(e.domain) == name]
        if members:
            groups[name] = compute_rates(members).to_json()
    return {
        "schema": SUMMARY_SCHEMA,
        "run_dir": str(run.path),
        "layout": run.layout,
        "problems": [str(p) for p in run.problems],
        "overall": compute_rates(episodes).to_json(),
        "feasible": compute_rates(e for e in episodes if not e.infeasible).to_json(),
        "infeasible": compute_rates(e for e in episodes if e.infeasible).to_json(),
        "domains": {
            d: compute_rates(e for e in episodes if e.domain == d).to_json() for d in domains
        },
        "groups": groups,
    }


def print_table(summary: dict[str, Any]) -> None:
    """Print a ``summarize`` object on stdout as a table: a row per domain, per group,
    feasible and infeasible (when the run has infeasible tasks) and all."""
    from rich.console import Console  # only when printing: reading a run needs no rich
    from rich.table import Table

    console = Console() if sys.stdout.isatty() else Console(width=160)
    k = k_label(summary["overall"])
    table = Table(title=f"{summary['run_dir']} ({summary['layout']})", title_justify="left")
    table.add_column("domain")
    for header in ("tasks", "episodes", "success", f"avg@{k}", f"pass@{k}"):
        table.add_column(header, justify="right")
    for status in STATUSES:
        table.add_column(STATUS_ABBREV[status], justify="right")
    table.add_column("steps", justify="right")
    table.add_column("time s", justify="right")

    def row(name: str, rates: dict[str, Any], *, style: str | None = None) -> None:
        counts = rates["status_counts"]
        table.add_row(
            name,
            str(rates["scored_tasks"]),
            str(rates["scored_episodes"]),
            fmt_rate(rates["success_rate"]),
            fmt_rate(rates["avg_at_k"]),
            fmt_rate(rates["pass_at_k"]),
            *(str(counts[s]) for s in STATUSES),
            fmt_float(rates["mean_steps"]),
            fmt_float(rates["mean_duration_s"]),
            style=style,
        )

    for name, rates in summary["domains"].items():
        row(name, rates)
    table.add_section()
    for name, rates in summary["groups"].items():
        row(name, rates, style="cyan")
    if summary["infeasible"]["episodes"]:
        row("feasible", summary["feasible"], style="cyan")
        row("infeasible", summary["infeasible"], style="magenta")
    table.add_section()
    row("all", summary["overall"], style="bold")
    console.print(table)
    console.print(
        "tasks/episodes: those with a score; success: mean reward of scored episodes; "
        f"avg@{k}: mean of per-task mean rewards; pass@{k}: tasks with a reward of 1.0; "
        "infra and cancel are excluded from every rate."
    )
