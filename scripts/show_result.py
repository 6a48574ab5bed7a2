"""Success rates of one run (run.py's results.jsonl or an OSWorld results tree): per domain,
per OSWorld group, feasible and infeasible apart, overall; avg@k, pass@k, status counts;
or per model version (--by-version) or per pass over the task set (--by-pass). Episodes
can be narrowed by version (--min-version, --exclude-mixed). Figures and --json schema:
cua_rollout/results/summary.py. Exit codes: 0, 2 on bad usage (an unknown --min-version too).

The code is ``cua_rollout.cli.show_result``; see ``cua-rollout --help``.
"""

from cua_rollout.cli.show_result import main

if __name__ == "__main__":
    raise SystemExit(main())
