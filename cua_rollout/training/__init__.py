"""The trainer's side of a run: an index of its episodes and *groups* (every rollout of one
task in one pass) in a database, from which trainer processes claim groups exactly once,
ack or release them, and export training rows.

    groups.py   group_record(): a group's rewards, masked episodes, GRPO advantages and
                model versions from its episodes' result records (pure)
    index.py    TrainingIndex: the database (SQLAlchemy 2; SQLite in WAL mode at
                <run_dir>/index.db by default, PostgreSQL or MySQL by URL); record_episode,
                reindex, claim_groups / ack / release / extend, status
    export.py   export_rows() / export(): episode or step rows as dicts, JSONL or Parquet
    cli.py      python -m cua_rollout.training [--db URL | --run-dir DIR]
                {status, reindex, claim, ack, release, export}

The run directory (results.jsonl, each episode's traj.jsonl) stays the source of truth: the
database is an index that ``reindex`` rebuilds from it at any time.
"""

from cua_rollout.training.export import export, export_rows
from cua_rollout.training.groups import fill_defaults, group_record
from cua_rollout.training.index import (
    ClaimedGroup,
    IndexedGroup,
    TrainingIndex,
    TrainingIndexError,
    default_url,
    index_url,
    read_steps,
)

__all__ = [
    "ClaimedGroup",
    "IndexedGroup",
    "TrainingIndex",
    "TrainingIndexError",
    "default_url",
    "export",
    "export_rows",
    "fill_defaults",
    "group_record",
    "index_url",
    "read_steps",
]
