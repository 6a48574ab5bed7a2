"""Figures of several runs side by side: per run the success rate, avg@k, pass@k, status
counts, mean steps and time; their mean and sample deviation; the any-correct rate; for runs
with text episodes, each text benchmark's (mode's, metric's) score per run and its mean and
deviation (JSON and CSV layout: ``collect``'s docstring). --min-version / --exclude-mixed
narrow every run by model version first. Exit codes: 0, 2 on bad usage (an unknown
--min-version too) or a RUN_DIR missing."""

from __future__ import annotations

import argparse
import csv
import json
import sys
from pathlib import Path
from typing import Any

from cua_rollout.core.types import STATUSES
from cua_rollout.results import (
    STATUS_ABBREV,
    Run,
    add_json_flag,
    add_version_filters,
    compute_rates,
    describe_selection,
    fail,
    flat_rates,
    fmt_float,
    fmt_rate,
    mean_std,
    open_run,
    results_parser,
    select_run,
    selection_json,
    version_order,
)
from cua_rollout.results.text import labelled_rows, text_summary

__all__ = ["main"]

SCHEMA = "experiment_result_stats/1"
# Columns that get a mean and a standard deviation across runs.
NUMERIC_COLUMNS = (
    "episodes",
    "scored_episodes",
    "scored_tasks",
    "solved_tasks",
    "success_rate",
    "avg_at_k",
    "pass_at_k",
    *STATUSES,
    "mean_steps",
    "mean_duration_s",
    "mixed_episodes",
)
CSV_COLUMNS = ("run", "layout", "k", *NUMERIC_COLUMNS)
_RATE_COLUMNS = frozenset({"success_rate", "avg_at_k", "pass_at_k"})
# Short headers keep the table inside 160 columns.
_HEADERS = {
    "episodes": "episodes",
    "scored_episodes": "scored",
    "scored_tasks": "tasks",
    "solved_tasks": "solved",
    "success_rate": "success",
    "avg_at_k": "avg@k",
    "pass_at_k": "pass@k",
    **STATUS_ABBREV,
    "mean_steps": "steps",
    "mean_duration_s": "time s",
    "mixed_episodes": "mixed",
}


def collect(runs: list[Run]) -> dict[str, Any]:
    """The --json object (schema "experiment_result_stats/1"):
      {"schema": "experiment_result_stats/1",
       "runs": [{"run": str, "run_dir": str, "layout": str, "versions": [str, ...],
                 "selection": {"min_version": str | null, "exclude_mixed": bool,
                               "excluded_episodes": int}, **RATES}, ...],
       "mean": {column: float | null}, "std": {column: float | null},
       "pooled": RATES,
       "any_correct": {"rate": float | null, "solved_tasks": int, "tasks": int},
       "text": TEXT}                     only when some run has text episodes
    RATES is ``Rates.to_json()`` (cua_rollout/results/rates.py), flattened in "runs" (status
    counts as columns, plus "k"). "versions" are the run's model versions in order of first
    use (the whole run's, even when --min-version / --exclude-mixed narrowed it; "selection"
    says how), "mixed_episodes" (a RATES figure) its episodes that used several. "mean" and
    "std" are the mean and the sample standard
    deviation (n - 1) over the runs that have the figure (a run with nothing scored has no
    rates); the deviation is null for a single run. The any-correct rate is the fraction of
    tasks scored in some run that some rollout of some run solved: pass@k of all runs'
    episodes pooled, the row "pooled".

    TEXT: the text benchmarks' scores (cua_rollout/results/text.py: the mean of the answer metric
    over the final episodes, an infra error counting 0), each run's from its ``text_summary``:
      {"runs": [str, ...],                    the runs' names, as in "runs"
       "benchmarks": {name: SCORES}, "modes": {mode: SCORES}, "metrics": {metric: SCORES},
       "all": SCORES}
      SCORES: {"scores": [float | null, ...], "episodes": [int, ...],   one per run (null, 0:
               the run has no such episodes), "mean": float | null, "std": float | null}
    "mean" and "std" over the runs that have the row, as above.

    ``-o FILE.csv`` writes the table: a header (CSV_COLUMNS), then one row per run, "mean",
    "std", "pooled"; full precision, empty cells for figures that do not exist (the text
    section is in the JSON only).
    """
    names = [r.name for r in runs]
    rows = []
    for run in runs:
        # Two runs with the same directory name: tell them apart by the path given.
        name = run.name if names.count(run.name) == 1 else str(run.path)
        rows.append(
            {
                "run": name,
                "run_dir": str(run.path),
                "layout": run.layout,
                "versions": version_order(run),
                "selection": selection_json(run),
                **flat_rates(compute_rates(run.episodes).to_json()),
            }
        )
    mean, std = {}, {}
    for column in NUMERIC_COLUMNS:
        mean[column], std[column] = mean_std(row[column] for row in rows)
    pooled = compute_rates(e for run in runs for e in run.episodes)
    stats = {
        "schema": SCHEMA,
        "runs": rows,
        "mean": mean,
        "std": std,
        "pooled": pooled.to_json(),
        "any_correct": {
            "rate": pooled.pass_at_k,
            "solved_tasks": pooled.solved_tasks,
            "tasks": pooled.scored_tasks,
        },
    }
    text = text_stats(runs, [row["run"] for row in rows])
    if text is not None:
        stats["text"] = text
    return stats


def text_stats(runs: list[Run], names: list[str]) -> dict[str, Any] | None:
    """The "text" section of ``collect`` (its docstring), or None when no run has text
    episodes."""
    sections = [text_summary(run.episodes) for run in runs]
    if all(section is None for section in sections):
        return None

    def scores(rows: list[dict[str, Any] | None]) -> dict[str, Any]:
        values = [None if row is None else row["score"] for row in rows]
        mean, std = mean_std(values)
        return {"scores": values, "episodes": [0 if row is None else row["episodes"]
                                               for row in rows],
                "mean": mean, "std": std}  # fmt: skip

    out: dict[str, Any] = {"runs": names}
    for key in ("benchmarks", "modes", "metrics"):
        names_of = sorted({name for s in sections if s is not None for name in s["rows"][key]})
        out[key] = {
            name: scores([None if s is None else s["rows"][key].get(name) for s in sections])
            for name in names_of
        }
    out["all"] = scores([None if s is None else s["rows"]["all"] for s in sections])
    return out


def write_csv(stats: dict[str, Any], path: Path) -> None:
    pooled = {"run": "pooled", "layout": "", **flat_rates(stats["pooled"])}
    with path.open("w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=CSV_COLUMNS, extrasaction="ignore")
        writer.writeheader()
        for row in stats["runs"]:
            writer.writerow(_csv_row(row))
        writer.writerow(_csv_row({"run": "mean", **stats["mean"]}))
        writer.writerow(_csv_row({"run": "std", **stats["std"]}))
        writer.writerow(_csv_row(pooled))


def _csv_row(row: dict[str, Any]) -> dict[str, Any]:
    # Full precision in the file; empty cells for figures that do not exist.
    return {c: ("" if row.get(c) is None else row.get(c)) for c in CSV_COLUMNS}


def _print_table(stats: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console() if sys.stdout.isatty() else Console(width=160)
    table = Table(title=f"{len(stats['runs'])} runs", title_justify="left")
    table.add_column("run")
    table.add_column("k", justify="right")
    for column in NUMERIC_COLUMNS:
        table.add_column(_HEADERS[column], justify="right")

    def cells(row: dict[str, Any]) -> list[str]:
        out = []
        for column in NUMERIC_COLUMNS:
            value = row.get(column)
            if column in _RATE_COLUMNS:
                out.append(fmt_rate(value))
            elif isinstance(value, int):
                out.append(str(value))
            else:
                out.append(fmt_float(value, 2))
        return out

    for row in stats["runs"]:
        table.add_row(row["run"], row["k"], *cells(row))
    table.add_section()
    table.add_row("mean", "", *cells(stats["mean"]), style="bold")
    table.add_row("std", "", *cells(stats["std"]))
    pooled = flat_rates(stats["pooled"])
    table.add_section()
    table.add_row("pooled", pooled["k"], *cells(pooled), style="cyan")
    console.print(table)
    any_correct = stats["any_correct"]
    console.print(
        f"any-correct rate: {fmt_rate(any_correct['rate'])} "
        f"({any_correct['solved_tasks']}/{any_correct['tasks']} tasks solved in some run); "
        "std is the sample deviation (n - 1) across runs; "
        "infra_error and cancelled are excluded from every rate; mixed: episodes that used "
        "several model versions.",
        markup=False,
        highlight=False,
    )
    for row in stats["runs"]:
        selected = describe_selection(row["selection"])
        if selected is not None:
            console.print(f"{row['run']}: {selected}", markup=False, highlight=False)
    if stats.get("text") is not None:
        _print_text_table(stats["text"], console)


def _print_text_table(text: dict[str, Any], console: Any) -> None:
    """The text benchmarks' scores: a row per benchmark, mode, metric and all; a column per
    run, then the mean and the deviation across the runs."""
    from rich.table import Table
    from rich.text import Text

    table = Table(title=f"text benchmarks: score across {len(text['runs'])} runs",
                  title_justify="left")  # fmt: skip
    table.add_column("benchmark")
    for name in text["runs"]:
        table.add_column(Text(name), justify="right")
    table.add_column("mean", justify="right")
    table.add_column("std", justify="right")

    def add(name: str, row: dict[str, Any], style: str | None = None) -> None:
        table.add_row(Text(name), *(fmt_rate(v) for v in row["scores"]), fmt_rate(row["mean"]),
                      fmt_rate(row["std"]), style=style)  # fmt: skip

    for label, row, style in labelled_rows(text):
        if row is None:
            table.add_section()
        else:
            add(label, row, style)
    console.print(table)
    console.print(
        "score: the mean of the answer metric over every final text episode (an infra error "
        "or a missing answer counts 0); '-': the run has no such episodes; std is the sample "
        "deviation (n - 1) across the runs that have them.",
        markup=False,
        highlight=False,
    )


def _parser() -> argparse.ArgumentParser:
    parser = results_parser(
        "experiment_result_stats.py",
        "Per-run success rate, avg@k, pass@k and status counts of several runs, "
        "their mean and standard deviation, and the any-correct rate; with text episodes, "
        "each text benchmark's score per run, its mean and standard deviation.",
        run_dir=False,
    )
    parser.add_argument("run_dirs", metavar="RUN_DIR", nargs="+", help="run directories")
    parser.add_argument(
        "-o",
        "--output",
        metavar="FILE.csv",
        type=Path,
        help="also write the table as CSV to this file",
    )
    add_json_flag(parser)
    add_version_filters(parser, runs="each run")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.output is not None and not args.output.parent.is_dir():
        fail(parser, f"{args.output.parent}: no such directory")
    runs = [select_run(parser, open_run(parser, path), args) for path in args.run_dirs]
    for run in runs:
        if not run.episodes:
            print(f"{run.path}: no finished episodes", file=sys.stderr)
    stats = collect(runs)
    if args.json:
        print(json.dumps(stats, indent=2))
    else:
        _print_table(stats)
    if args.output is not None:
        write_csv(stats, args.output)
        print(f"wrote {args.output}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
