"""Figures of several runs side by side: per run the success rate, avg@k, pass@k, status
counts, mean steps and time; their mean and sample deviation; the any-correct rate; for runs
with text episodes, each text benchmark's (mode's, metric's) score per run and its mean and
deviation (JSON and CSV layout: ``collect``'s docstring). --min-version / --exclude-mixed
narrow every run by model version first. Exit codes: 0, 2 on bad usage (an unknown
--min-version too) or a RUN_DIR missing.

The code is ``cua_rollout.cli.experiment_result_stats``; see ``cua-rollout --help``.
"""

from cua_rollout.cli.experiment_result_stats import main

if __name__ == "__main__":
    raise SystemExit(main())
