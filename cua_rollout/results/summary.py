"""The summary of one run that scripts/show_result.py prints and run.py shows at the end of
a run: ``summarize(run)`` computes it, ``print_table(summary)`` prints it as a table (and
``print_version_table`` / ``print_pass_table`` its per-version / per-pass rows).

``summarize`` returns one object (schema "show_result/1", show_result.py's ``--json``):
  {"schema": "show_result/1", "run_dir": str, "layout": "cua-rollout" | "osworld",
   "problems": [str, ...],                      unreadable lines/files, skipped
   "versions": [str, ...],                      the run's model versions, in order of first
                                                use (cua_rollout/results/versions.py)
   "mixed_episodes": int,                       episodes (of those summarised) whose steps
                                                came from more than one version
   "selection": {"min_version": str | null, "exclude_mixed": bool,
                 "excluded_episodes": int},     --min-version / --exclude-mixed, and how
                                                many episodes they left out
   "overall": RATES, "feasible": RATES, "infeasible": RATES,
   "domains": {domain: RATES, ...},             sorted by name
   "groups": {"Office" | "Daily" | "Professional": RATES, ...}   only groups present
   "by_version": {"rows": [{"version": str | null, **RATES}, ...], "mixed": RATES}
                                                only with by_version=True (--by-version):
                                                episodes under their first version, from
                                                min_version on; version null: none known
   "by_pass": [{"pass_index": int, **RATES}, ...]   only with by_pass=True (--by-pass)
   "text": TEXT | null}                          text benchmarks' scores per benchmark, mode
                                                and metric (cua_rollout/results/text.py)
RATES is ``Rates.to_json()`` (cua_rollout/results/rates.py): episode and task counts, k_min and
k_max, success_rate, avg_at_k, pass_at_k (fractions in [0, 1], null when nothing is
scored), mean_steps, mean_duration_s, status_counts and mixed_episodes; infra_error and
cancelled episodes are counted but left out of every rate. "versions" is the whole run's
list even when the episodes were narrowed by version.
"""

from __future__ import annotations

import sys
from typing import Any

from cua_rollout.core.types import STATUSES
from cua_rollout.results.cli import STATUS_ABBREV, fmt_float, fmt_rate
from cua_rollout.results.rates import OSWORLD_GROUPS, compute_rates, group_of, k_label
from cua_rollout.results.runs import Run
from cua_rollout.results.text import print_text_table, text_summary
from cua_rollout.results.versions import by_pass as pass_rows
from cua_rollout.results.versions import by_version as version_rows
from cua_rollout.results.versions import describe_selection, selection_json, version_order

__all__ = [
    "SUMMARY_SCHEMA",
    "print_pass_table",
    "print_table",
    "print_version_table",
    "summarize",
]

SUMMARY_SCHEMA = "show_result/1"


def summarize(run: Run, *, by_version: bool = False, by_pass: bool = False) -> dict[str, Any]:
    """The summary object of a run (see the module docstring); ``by_version`` and
    ``by_pass`` add those sections."""
    episodes = run.episodes
    versions = version_order(run)
    domains = sorted({e.domain for e in episodes})
    groups = {}
    for name in OSWORLD_GROUPS:
        members = [e for e in episodes if group_of(e.domain) == name]
        if members:
            groups[name] = compute_rates(members).to_json()
    summary: dict[str, Any] = {
        "schema": SUMMARY_SCHEMA,
        "run_dir": str(run.path),
        "layout": run.layout,
        "problems": [str(p) for p in run.problems],
        "versions": versions,
        "mixed_episodes": sum(e.mixed_versions for e in episodes),
        "selection": selection_json(run),
        "overall": compute_rates(episodes).to_json(),
        "feasible": compute_rates(e for e in episodes if not e.infeasible).to_json(),
        "infeasible": compute_rates(e for e in episodes if e.infeasible).to_json(),
        "domains": {
            d: compute_rates(e for e in episodes if e.domain == d).to_json() for d in domains
        },
        "groups": groups,
        "text": text_summary(episodes),
    }
    if by_version:
        min_version = run.selection.min_version if run.selection is not None else None
        shown = versions[versions.index(min_version):] if min_version in versions else versions
        summary["by_version"] = version_rows(episodes, shown)
    if by_pass:
        summary["by_pass"] = pass_rows(episodes)
    return summary


def print_table(summary: dict[str, Any]) -> None:
    """Print a ``summarize`` object on stdout as a table: a row per domain, per group,
    feasible and infeasible (when the run has infeasible tasks) and all; then the legend,
    the run's versions and the selection."""
    table = _Table(summary, "domain")
    for name, rates in summary["domains"].items():
        table.row(name, rates)
    table.section()
    for name, rates in summary["groups"].items():
        table.row(name, rates, style="cyan")
    if summary["infeasible"]["episodes"]:
        table.row("feasible", summary["feasible"], style="cyan")
        table.row("infeasible", summary["infeasible"], style="magenta")
    table.section()
    table.row("all", summary["overall"], style="bold")
    table.print()
    if summary.get("text"):
        print_text_table(summary["text"])


def print_version_table(summary: dict[str, Any]) -> None:
    """The ``by_version`` section of a ``summarize(..., by_version=True)`` object as a
    table: a row per version (episodes under their first version), '(no version)', 'mixed'
    (each mixed episode also counted under its first version; when there are any) and all."""
    table = _Table(summary, "version", mixed=True)
    section = summary["by_version"]
    for rates in section["rows"]:
        name = rates["version"]
        table.row("(no version)" if name is None else name, rates)
    table.section()
    if section["mixed"]["episodes"]:
        table.row("mixed", section["mixed"], style="magenta")
    table.row("all", summary["overall"], style="bold")
    table.print("version: the episode's first model version, in order of first use; mixed: "
                "episodes that used several versions, also counted under their first; ")


def print_pass_table(summary: dict[str, Any]) -> None:
    """The ``by_pass`` section of a ``summarize(..., by_pass=True)`` object as a table: a
    row per pass over the task set, and all."""
    table = _Table(summary, "pass", mixed=True)
    for rates in summary["by_pass"]:
        table.row(str(rates["pass_index"]), rates)
    table.section()
    table.row("all", summary["overall"], style="bold")
    table.print("pass: the pass over the task set (pass_index); ")


class _Table:
    """The rich table all three printers share: a first column, then the figures of a
    RATES object (plus its mixed_episodes with ``mixed``)."""

    def __init__(self, summary: dict[str, Any], first: str, *, mixed: bool = False):
        from rich.table import Table  # only when printing: reading a run needs no rich

        self.summary = summary
        self.mixed = mixed
        self.k = k_label(summary["overall"])
        self.table = Table(title=f"{summary['run_dir']} ({summary['layout']})",
                           title_justify="left")  # fmt: skip
        self.table.add_column(first)
        for header in ("tasks", "episodes", "success", f"avg@{self.k}", f"pass@{self.k}"):
            self.table.add_column(header, justify="right")
        for status in STATUSES:
            self.table.add_column(STATUS_ABBREV[status], justify="right")
        if mixed:
            self.table.add_column("mixed", justify="right")
        self.table.add_column("steps", justify="right")
        self.table.add_column("time s", justify="right")

    def row(self, name: str, rates: dict[str, Any], *, style: str | None = None) -> None:
        from rich.text import Text

        counts = rates["status_counts"]
        self.table.add_row(
            Text(name),  # a version or domain name is text, never rich markup
            str(rates["scored_tasks"]),
            str(rates["scored_episodes"]),
            fmt_rate(rates["success_rate"]),
            fmt_rate(rates["avg_at_k"]),
            fmt_rate(rates["pass_at_k"]),
            *(str(counts[s]) for s in STATUSES),
            *((str(rates.get("mixed_episodes", 0)),) if self.mixed else ()),
            fmt_float(rates["mean_steps"]),
            fmt_float(rates["mean_duration_s"]),
            style=style,
        )

    def section(self) -> None:
        self.table.add_section()

    def print(self, legend: str = "") -> None:
        from rich.console import Console

        console = Console() if sys.stdout.isatty() else Console(width=160)
        console.print(self.table)
        k = self.k
        console.print(
            f"{legend}tasks/episodes: those with a score; success: mean reward of scored "
            f"episodes; avg@{k}: mean of per-task mean rewards; pass@{k}: tasks with a "
            "reward of 1.0; infra and cancel are excluded from every rate.",
            markup=False,
            highlight=False,
        )
        for line in _version_lines(self.summary):
            console.print(line, markup=False, highlight=False)
        raised = (self.summary.get("overall") or {}).get("evaluation_errors")
        if raised:
            console.print(f"failures whose evaluation raised on what the agent left (scored 0, "
                          f"reason in results.jsonl's evaluation_error): {raised}",
                          markup=False, highlight=False)


def _version_lines(summary: dict[str, Any]) -> list[str]:
    """The run's versions (the first and last few when there are many), its mixed
    episodes, and what --min-version / --exclude-mixed left out."""
    versions = summary.get("versions") or []
    lines = []
    if versions:
        shown = versions if len(versions) <= 6 else [*versions[:2], "...", *versions[-2:]]
        lines.append(
            f"model versions in order of first use ({len(versions)}): {', '.join(shown)}; "
            f"mixed episodes: {summary.get('mixed_episodes', 0)}"
        )
    selected = describe_selection(summary.get("selection") or {})
    if selected is not None:
        lines.append(f"selected: {selected}")
    return lines
