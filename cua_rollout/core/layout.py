"""The names of a run directory's files (docs/results_format.md), defined once for the writer
(storage_actor.py), the resume reader (task_loader.py) and the result tools (cua_rollout.results).

    <run>/run.json, results.jsonl, metrics.jsonl, index.db, .lock
    <run>/<domain>/<task_id>/<rollout>/task_config.json, traj.jsonl, step_<n>.png,
                                       episode.json, result.txt, messages.json
"""

from __future__ import annotations

__all__ = [
    "EPISODE_FILE",
    "GIVEN_TASKS_FILE",
    "INDEX_FILE",
    "MESSAGES_FILE",
    "METRICS_FILE",
    "OSWORLD_RESULT_FILE",
    "RESULTS_FILE",
    "RUN_FILE",
    "RUN_LOCK_FILE",
    "SUPERSEDED_RESULTS_FILE",
    "TASK_CONFIG_FILE",
    "TRAJ_FILE",
    "screenshot_name",
]

RUN_FILE = "run.json"                  # config snapshot, versions, start/end, summary
RUN_LOCK_FILE = ".lock"                # flock'ed by the one driver writing the run
RESULTS_FILE = "results.jsonl"         # one line per finished episode: the index
SUPERSEDED_RESULTS_FILE = "results.superseded.jsonl"  # lines a rerun or a repair replaced
METRICS_FILE = "metrics.jsonl"         # the coordinator's samples over time
INDEX_FILE = "index.db"                # the trainer's index (SQLite, WAL), cua_rollout.training
TASK_CONFIG_FILE = "task_config.json"  # the task as run
GIVEN_TASKS_FILE = "given_tasks.jsonl"  # tasks handed to Rollout(tasks=...): the run's source
TRAJ_FILE = "traj.jsonl"               # one line per step, OSWorld's fields + ours
EPISODE_FILE = "episode.json"          # the episode's result record
OSWORLD_RESULT_FILE = "result.txt"     # the reward, as OSWorld writes it (scored episodes)
MESSAGES_FILE = "messages.json"        # the last model request, images as file names


def screenshot_name(step: int) -> str:
    """The file of the screenshot observed after step ``step`` (0: after the reset)."""
    return f"step_{step}.png"
