"""Success rates of one run: per domain, per OSWorld group, feasible and infeasible tasks
apart, overall; with several rollouts per task avg@k and pass@k; episode status counts, mean
steps and episode time. Reads run.py's results.jsonl or an OSWorld results tree.

Rates leave out ``infra_error`` and ``cancelled`` episodes (they are only counted):
  success rate  mean reward over scored episodes (OSWorld's figure);
  avg@k         mean over tasks of the mean reward of the task's scored rollouts;
  pass@k        fraction of tasks with a rollout at reward >= 1.0;
  mean steps, mean time (duration_s) over scored episodes.

Exit codes: 0 (also for a run with no finished episodes yet, which prints
"no finished episodes"), 2 bad usage or RUN_DIR missing / not a directory.

``--json`` prints one object (schema "show_result/1"):
  {"schema": "show_result/1", "run_dir": str, "layout": "cua-rollout" | "osworld",
   "problems": [str, ...],                      unreadable lines/files, skipped
   "overall": RATES, "feasible": RATES, "infeasible": RATES,
   "domains": {domain: RATES, ...},             sorted by name
   "groups": {"Office" | "Daily" | "Professional": RATES, ...}   only groups present}
  RATES = {"episodes": int, "scored_episodes": int, "tasks": int, "scored_tasks": int,
           "solved_tasks": int, "k_min": int | null, "k_max": int | null,
           "success_rate": float | null, "avg_at_k": float | null,
           "pass_at_k": float | null, "mean_steps": float | null,
           "mean_duration_s": float | null,
           "status_counts": {"success": int, "failure": int, "max_steps": int,
                             "timeout": int, "infra_error": int, "cancelled": int}}
  Rates are fractions in [0, 1]; null when nothing is scored.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

# Run as `python scripts/show_result.py` or imported by tests: find results_io either way.
_SCRIPTS_DIR = str(Path(__file__).resolve().parent)
if _SCRIPTS_DIR not in sys.path:
    sys.path.insert(0, _SCRIPTS_DIR)

import results_io as rio  # noqa: E402

SCHEMA = "show_result/1"


def summarize(run: rio.Run) -> dict[str, Any]:
    """The --json object of a run (see the module docstring)."""
    episodes = run.episodes
    domains = sorted({e.domain for e in episodes})
    groups = {}
    for name in rio.OSWORLD_GROUPS:
        members = [e for e in episodes if rio.group_of(e.domain) == name]
        if members:
            groups[name] = rio.compute_rates(members).to_json()
    return {
        "schema": SCHEMA,
        "run_dir": str(run.path),
        "layout": run.layout,
        "problems": [str(p) for p in run.problems],
        "overall": rio.compute_rates(episodes).to_json(),
        "feasible": rio.compute_rates(e for e in episodes if not e.infeasible).to_json(),
        "infeasible": rio.compute_rates(e for e in episodes if e.infeasible).to_json(),
        "domains": {
            d: rio.compute_rates(e for e in episodes if e.domain == d).to_json() for d in domains
        },
        "groups": groups,
    }


def print_table(summary: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console() if sys.stdout.isatty() else Console(width=160)
    k = rio.k_label(summary["overall"])
    table = Table(title=f"{summary['run_dir']} ({summary['layout']})", title_justify="left")
    table.add_column("domain")
    for header in ("tasks", "episodes", "success", f"avg@{k}", f"pass@{k}"):
        table.add_column(header, justify="right")
    for status in rio.STATUSES:
        table.add_column(rio.STATUS_ABBREV[status], justify="right")
    table.add_column("steps", justify="right")
    table.add_column("time s", justify="right")

    def row(name: str, rates: dict[str, Any], *, style: str | None = None) -> None:
        counts = rates["status_counts"]
        table.add_row(
            name,
            str(rates["scored_tasks"]),
            str(rates["scored_episodes"]),
            rio.fmt_rate(rates["success_rate"]),
            rio.fmt_rate(rates["avg_at_k"]),
            rio.fmt_rate(rates["pass_at_k"]),
            *(str(counts[s]) for s in rio.STATUSES),
            rio.fmt_float(rates["mean_steps"]),
            rio.fmt_float(rates["mean_duration_s"]),
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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="show_result.py",
        description="Success rate per domain and overall, avg@k and pass@k, status counts, "
        "mean steps and time of one run. " + rio.RUN_DIR_HELP,
        epilog="infra_error and cancelled episodes are counted but left out of every rate. "
        "The --json schema is in this script's docstring.",
    )
    parser.add_argument("run_dir", metavar="RUN_DIR", help="the run directory")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    run = rio.open_run(parser, args.run_dir)
    summary = summarize(run)
    if not run.episodes:
        print(f"{run.path}: no finished episodes", file=sys.stderr if args.json else sys.stdout)
    if args.json:
        print(json.dumps(summary, indent=2))
    elif run.episodes:
        print_table(summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
