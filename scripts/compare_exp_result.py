"""What changed between two runs: the episodes (or, with ``--by task``, the tasks) whose
reward or status differs, both ways, written to a file (the fields: ``compare``'s docstring);
a summary on stdout, with the text benchmarks' scores A vs B and the text items whose score
changed when both runs have text episodes. --min-version / --exclude-mixed narrow both runs
by model version first. Exit codes: 0, 2 on bad usage (a --min-version that is not a version
of both runs too) or a RUN_DIR missing / not a directory.

The code is ``cua_rollout.cli.compare_exp_result``; see ``cua-rollout --help``.
"""

from cua_rollout.cli.compare_exp_result import main

if __name__ == "__main__":
    raise SystemExit(main())
