"""The names of a run directory's files (docs/results_format.md), defined once for the writer
(storage_actor.py), the resume reader (task_loader.py) and the result tools (cua_rollout.results).

    <run>/run.json, results.jsonl, metrics.jsonl, index.db, .lock
    <run>/<domain>/<task_id>/<rollout>/task_config.json, traj.jsonl, step_<n>.png,
                                       episode.json, result.txt, messages.json,
                                       retention.json (images removed or re-encoded)
    <run>/retention.state.json         the retention sweeper's cursors and totals
    <run>/.attempts/<staging name>/    the same files of an attempt still running
"""

from __future__ import annotations

import hashlib
from urllib.parse import quote

__all__ = [
    "ATTEMPTS_DIR",
    "EPISODE_FILE",
    "GIVEN_TASKS_FILE",
    "INDEX_FILE",
    "MESSAGES_FILE",
    "METRICS_FILE",
    "OSWORLD_RESULT_FILE",
    "RESULTS_FILE",
    "RETENTION_MARKER_FILE",
    "RETENTION_STATE_FILE",
    "RUN_FILE",
    "RUN_LOCK_FILE",
    "STATUS_URL_FILE",
    "SUPERSEDED_RESULTS_FILE",
    "TASK_CONFIG_FILE",
    "TRAJ_FILE",
    "observation_file_name",
    "screenshot_name",
    "staging_name",
]

RUN_FILE = "run.json"                  # config snapshot, versions, start/end, summary
RUN_LOCK_FILE = ".lock"                # flock'ed by the one driver writing the run
STATUS_URL_FILE = "status.url"         # where the running driver serves /healthz, /status
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
RETENTION_MARKER_FILE = "retention.json"  # an episode's images removed/re-encoded by policy
RETENTION_STATE_FILE = "retention.state.json"  # the sweeper's cursors and totals
ATTEMPTS_DIR = ".attempts"             # running attempts' files, moved into place when they end

# A flattened episode id longer than this is replaced by its digest in a staging name (a
# file name has at most 255 bytes; the attempt and a nonce follow it).
_MAX_FLAT_ID = 160


def screenshot_name(step: int) -> str:
    """The file of the screenshot observed after step ``step`` (0: after the reset)."""
    return f"step_{step}.png"


def observation_file_name(step: int, kind: str) -> str:
    """A file of what step ``step``'s request showed the model besides the screenshot
    (``kind``: ``a11y_tree.txt``, the accessibility tree as the prompt has it;
    ``marks.png``, the screenshot with numbered marks)."""
    return f"step_{step}_{kind}"


def staging_name(episode_id: str, attempt: int, nonce: str) -> str:
    """The directory (in ``ATTEMPTS_DIR``) of one run of an episode's attempt: one path
    component, unique by ``nonce``, so no host ever looked its name up before it existed."""
    flat = quote(episode_id, safe="")
    if len(flat) > _MAX_FLAT_ID:
        flat = hashlib.sha1(episode_id.encode()).hexdigest()
    return f"{flat}.{attempt}.{nonce}"
