"""A static, offline HTML report of a run's trajectories: index.html, a sortable table of
tasks x rollouts (under the run's timeline, when plot_run.py drew it), and a page per episode
with each step's screenshot, the action drawn over it, thought, response and timings. A text
episode's page (math, py, rag, web: docs/text_modes.md) has no images: the question, each
turn's reply and tool calls (arguments, output, return code, error), and the final answer
against the task's reference answer, its metric and score. Exit codes: 0, 2 on bad usage or
RUN_DIR missing.

The code is ``cua_rollout.cli.view_trajectory``; see ``cua-rollout --help``.
"""

from cua_rollout.cli.view_trajectory import main

if __name__ == "__main__":
    raise SystemExit(main())
