"""PNG plots of one run: episodes finished, steps/s and desktops over time (metrics.jsonl),
model and env latency per step (traj.jsonl), success rate per domain; on request (--plots)
the run's timeline (what each desktop and each runner did over time, from results.jsonl and
traj.jsonl: cua_rollout.results.timeline) and the utilization of the desktops and the model
servers. A plot without input is skipped with a message on stderr. Exit codes: 0, 2 on bad
usage or RUN_DIR missing.

The code is ``cua_rollout.cli.plot_run``; see ``cua-rollout --help``.
"""

from cua_rollout.cli.plot_run import main

if __name__ == "__main__":
    raise SystemExit(main())
