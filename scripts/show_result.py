"""Success rates of one run (run.py's results.jsonl or an OSWorld results tree): per domain,
per OSWorld group, feasible and infeasible apart, overall; avg@k, pass@k, status counts.
Figures and --json schema: rollout/results/summary.py. Exit codes: 0, 2 on bad usage."""

from __future__ import annotations

import argparse
import json
import sys

from rollout.results import add_json_flag, open_run, print_table, results_parser, summarize

__all__ = ["main"]


def _parser() -> argparse.ArgumentParser:
    parser = results_parser(
        "show_result.py",
        "Success rate per domain and overall, avg@k and pass@k, status counts, "
        "mean steps and time of one run.",
        epilog="infra_error and cancelled episodes are counted but left out of every rate. "
        "The --json schema is in rollout/results/summary.py.",
    )
    add_json_flag(parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    run = open_run(parser, args.run_dir)
    summary = summarize(run)
    if not run.episodes:  # still exit 0: a run that has just started
        print(f"{run.path}: no finished episodes", file=sys.stderr if args.json else sys.stdout)
    if args.json:
        print(json.dumps(summary, indent=2))
    elif run.episodes:
        print_table(summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
