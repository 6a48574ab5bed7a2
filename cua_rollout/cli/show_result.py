"""Success rates of one run (run.py's results.jsonl or an OSWorld results tree): per domain,
per OSWorld group, feasible and infeasible apart, overall; avg@k, pass@k, status counts;
or per model version (--by-version) or per pass over the task set (--by-pass). Episodes
can be narrowed by version (--min-version, --exclude-mixed). Figures and --json schema:
cua_rollout/results/summary.py. Exit codes: 0, 2 on bad usage (an unknown --min-version too)."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from cua_rollout.core.files import read_json
from cua_rollout.core.layout import RETENTION_STATE_FILE
from cua_rollout.results import (
    add_json_flag,
    add_version_filters,
    open_run,
    print_pass_table,
    print_table,
    print_version_table,
    results_parser,
    select_run,
    summarize,
)

__all__ = ["main", "retention_notes"]


def _parser() -> argparse.ArgumentParser:
    parser = results_parser(
        "show_result.py",
        "Success rate per domain and overall, avg@k and pass@k, status counts, "
        "mean steps and time of one run.",
        epilog="infra_error and cancelled episodes are counted but left out of every rate. "
        "The --json schema is in cua_rollout/results/summary.py.",
    )
    add_json_flag(parser)
    parser.add_argument(
        "--by-version", action="store_true",
        help="a row per model version instead of per domain: each episode under its first "
        "version, mixed ones also in a 'mixed' row (--json: the \"by_version\" key)",
    )  # fmt: skip
    parser.add_argument(
        "--by-pass", action="store_true",
        help="a row per pass over the task set (pass_index) instead of per domain "
        "(--json: the \"by_pass\" key)",
    )  # fmt: skip
    add_version_filters(parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    run = select_run(parser, open_run(parser, args.run_dir), args)
    summary = summarize(run, by_version=args.by_version, by_pass=args.by_pass)
    if not run.episodes:  # still exit 0: a run that has just started
        excluded = summary["selection"]["excluded_episodes"]
        note = f" ({excluded} left out by the version options)" if excluded else ""
        print(f"{run.path}: no finished episodes{note}",
              file=sys.stderr if args.json else sys.stdout)  # fmt: skip
    if args.json:
        print(json.dumps(summary, indent=2))
    elif run.episodes:
        if args.by_version:
            print_version_table(summary)
        if args.by_pass:
            print_pass_table(summary)
        if not (args.by_version or args.by_pass):
            print_table(summary)
    for note in retention_notes(run.path):
        print(note, file=sys.stderr if args.json else sys.stdout)
    return 0


def retention_notes(run_dir: Path) -> list[str]:
    """What ``storage.retention`` did to the run's images and whether it is over its budget
    (from the sweeper's state file: no walk of the episodes)."""
    state: Any = read_json(Path(run_dir) / RETENTION_STATE_FILE)
    if not isinstance(state, dict):
        return []
    totals = state.get("totals") or {}
    notes = []
    if totals.get("last_at"):
        when = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(float(totals["last_at"])))
        counts = []
        if totals.get("episodes_removed"):
            counts.append(f"{totals['episodes_removed']} episode(s) without images")
        if totals.get("episodes_reencoded"):
            counts.append(f"{totals['episodes_reencoded']} re-encoded "
                          f"({totals.get('reencode')})")
        what = (f"images removed by retention policy {totals.get('policy')}"
                if totals.get("episodes_removed") else "images re-encoded by retention")
        notes.append(f"{what} at {when} (latest): {', '.join(counts)}; "
                     f"{int(totals.get('bytes_freed') or 0) / 1e6:.1f} MB freed")
    if state.get("warning"):
        notes.append(f"warning: {state['warning']}")
    return notes


if __name__ == "__main__":
    sys.exit(main())
