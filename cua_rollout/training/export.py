"""Training rows out of the index: one row per episode or per step, as dicts
(``export_rows``) or written to a JSONL or Parquet file (``export``).

Sources: a ``TrainingIndex`` (its groups, optionally of one run and one state), or groups in
hand (``ClaimedGroup`` / ``IndexedGroup``, e.g. what ``claim_groups`` returned). Step rows
read each episode's traj.jsonl unless the group was claimed with ``load_steps``.

Episode row keys: ``EPISODE_COLUMNS``; step rows add ``STEP_COLUMNS``. A key absent from the
records is None (``discarded``: []). ``advantage`` is None for a masked episode (not scored,
e.g. an infra error): drop those rows, never train on them as reward 0.
"""

from __future__ import annotations

import contextlib
import json
import os
import uuid
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any, Literal

from cua_rollout.training.groups import is_scored
from cua_rollout.training.index import (
    ClaimedGroup,
    IndexedGroup,
    TrainingIndex,
    TrainingIndexError,
    read_steps,
)

__all__ = ["EPISODE_COLUMNS", "FORMATS", "PER", "STEP_COLUMNS", "export", "export_rows",
           "format_of"]

PER = ("episode", "step")
FORMATS = ("jsonl", "parquet")
EPISODE_COLUMNS = (
    "run", "group_id", "episode_id", "domain", "task_id", "pass_index", "rollout", "status",
    "reward", "advantage", "group_mean", "group_std", "no_signal", "first_version",
    "last_version", "mixed_versions", "steps", "instruction", "dir",
)
STEP_COLUMNS = (
    "step_num", "model_version", "response", "action", "prompt_token_ids", "token_ids",
    "logprobs", "images", "image_spans", "observation_path", "discarded",
    # A text episode's turn: the reply's tool calls (as the server sent them), each call with
    # its result (what the model read next), the final answer on the last turn.
    "response_tool_calls", "tool_calls", "answer",
)
# Columns JSON-encoded as strings in Parquet (nested shapes that vary row to row).
_JSON_IN_PARQUET = ("images", "image_spans", "discarded", "response_tool_calls", "tool_calls")
# Rows per Parquet row group (bounded memory whatever the export's size).
_BATCH_ROWS = 512

Source = TrainingIndex | Iterable[ClaimedGroup | IndexedGroup]


def _groups(source: Source, run: str | None, state: str | None
            ) -> Iterable[ClaimedGroup | IndexedGroup]:
    if isinstance(source, TrainingIndex):
        groups = source.groups(run=run, state=state)
        if state is None:  # a failed group is listed only when asked for by its state
            return (g for g in groups if g.state != "failed_infra")
        return groups
    if run is not None or state is not None:
        raise ValueError("run and state select the groups of an index, not of a list")
    return source


def _episode_row(group: ClaimedGroup | IndexedGroup, episode: dict[str, Any]
                 ) -> dict[str, Any]:
    record = group.group
    steps = episode.get("steps")
    return {
        "run": group.run, "group_id": group.group_id, "episode_id": episode["episode_id"],
        "domain": episode.get("domain"), "task_id": episode.get("task_id"),
        "pass_index": episode.get("pass_index"), "rollout": episode.get("rollout"),
        "status": episode.get("status"),
        "reward": float(episode["reward"]) if is_scored(episode) else None,
        "advantage": record["advantages"].get(episode["episode_id"]),
        "group_mean": record["mean"], "group_std": record["std"],
        "no_signal": record["no_signal"], "first_version": episode.get("first_model_version"),
        "last_version": episode.get("model_version"),
        "mixed_versions": episode.get("mixed_versions"),
        "steps": len(steps) if isinstance(steps, list) else steps,
        "instruction": episode.get("instruction"), "dir": episode["dir"],
    }


def _step_row(row: dict[str, Any], step: dict[str, Any], directory: Path) -> dict[str, Any]:
    observation = step.get("observation_file")
    return {
        **row,
        "step_num": step.get("step_num"), "model_version": step.get("model_version"),
        "response": step.get("response"), "action": step.get("action"),
        "prompt_token_ids": step.get("prompt_token_ids"), "token_ids": step.get("token_ids"),
        "logprobs": step.get("logprobs"), "images": step.get("images"),
        "image_spans": step.get("image_spans"),
        "observation_path": str(directory / observation) if observation else None,
        "discarded": step.get("discarded") or [],
        "response_tool_calls": step.get("response_tool_calls"),
        "tool_calls": step.get("tool_calls"), "answer": step.get("answer"),
    }


def export_rows(source: Source, *, per: Literal["episode", "step"] = "episode",
                run: str | None = None, state: str | None = None) -> Iterator[dict[str, Any]]:
    """The rows of ``source``'s groups, group by group in their rollout order. ``run`` and
    ``state`` (ready/claimed/acked/failed_infra) select an index's groups (None: all but
    ``failed_infra`` ones, which are never trained: docs/training.md). Step rows need each
    episode's traj.jsonl: a missing or broken one raises ``TrainingIndexError`` (a masked
    episode without one has no step rows)."""
    if per not in PER:
        raise ValueError(f"per must be one of {', '.join(PER)}, not {per!r}")
    for group in _groups(source, run, state):
        for episode in group.episodes:
            row = _episode_row(group, episode)
            if per == "episode":
                yield row
                continue
            steps = episode.get("steps")
            if not isinstance(steps, list):
                steps = read_steps(episode["dir"], missing_ok=not is_scored(episode))
            directory = Path(episode["dir"])
            for step in steps:
                yield _step_row(row, step, directory)


def format_of(path: str | Path, fmt: str | None = None) -> str:
    """``fmt``, or the format of ``path``'s suffix (.parquet / .pq: parquet, else jsonl)."""
    if fmt is None:
        fmt = "parquet" if Path(path).suffix.lower() in (".parquet", ".pq") else "jsonl"
    if fmt not in FORMATS:
        raise ValueError(f"format must be one of {', '.join(FORMATS)}, not {fmt!r}")
    return fmt


def export(path: str | Path, source: Source, *, per: Literal["episode", "step"] = "episode",
           fmt: Literal["jsonl", "parquet"] | None = None, run: str | None = None,
           state: str | None = None) -> int:
    """Write ``export_rows(source, per=, run=, state=)`` to ``path`` as JSONL or Parquet
    (``fmt``; by default from the suffix, see ``format_of``), atomically: under a temporary
    name renamed at the end, so a reader never sees a partial file and a failed export
    leaves none. Returns the number of rows."""
    path = Path(path)
    fmt = format_of(path, fmt)
    rows = export_rows(source, per=per, run=run, state=state)
    write = _write_parquet if fmt == "parquet" else _write_jsonl
    if fmt == "parquet":
        _pyarrow()  # fail before any work
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        count = write(tmp, rows, per)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise
    return count


def _write_jsonl(tmp: Path, rows: Iterator[dict[str, Any]], per: str) -> int:
    count = 0
    with open(tmp, "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False, separators=(",", ":")) + "\n")
            count += 1
        f.flush()
        os.fsync(f.fileno())
    return count


def _pyarrow() -> Any:
    try:
        import pyarrow
        import pyarrow.parquet
    except ImportError:
        raise TrainingIndexError(
            "Parquet export needs pyarrow: pip install 'cua-rollout[parquet]'") from None
    return pyarrow


def _schema(pa: Any, per: str) -> Any:
    """A fixed schema, so every export (and every row group) has the same column types
    whatever values the first rows happen to hold."""
    fields = [
        ("run", pa.string()), ("group_id", pa.string()), ("episode_id", pa.string()),
        ("domain", pa.string()), ("task_id", pa.string()), ("pass_index", pa.int64()),
        ("rollout", pa.int64()), ("status", pa.string()), ("reward", pa.float64()),
        ("advantage", pa.float64()), ("group_mean", pa.float64()), ("group_std", pa.float64()),
        ("no_signal", pa.bool_()), ("first_version", pa.string()),
        ("last_version", pa.string()), ("mixed_versions", pa.bool_()), ("steps", pa.int64()),
        ("instruction", pa.string()), ("dir", pa.string()),
    ]
    if per == "step":
        fields += [
            ("step_num", pa.int64()), ("model_version", pa.string()), ("response", pa.string()),
            ("action", pa.string()), ("prompt_token_ids", pa.list_(pa.int64())),
            ("token_ids", pa.list_(pa.int64())), ("logprobs", pa.list_(pa.float64())),
            ("images", pa.string()), ("image_spans", pa.string()),
            ("observation_path", pa.string()), ("discarded", pa.string()),
            ("response_tool_calls", pa.string()), ("tool_calls", pa.string()),
            ("answer", pa.string()),
        ]
    return pa.schema(fields)


def _for_parquet(row: dict[str, Any]) -> dict[str, Any]:
    out = dict(row)
    for key in _JSON_IN_PARQUET:
        if key in out and out[key] is not None:
            out[key] = json.dumps(out[key], ensure_ascii=False, separators=(",", ":"))
    action = out.get("action")
    if action is not None and not isinstance(action, str):
        out["action"] = json.dumps(action, ensure_ascii=False, separators=(",", ":"))
    return out


def _write_parquet(tmp: Path, rows: Iterator[dict[str, Any]], per: str) -> int:
    pa = _pyarrow()
    import pyarrow.parquet as pq

    schema = _schema(pa, per)
    count = 0
    with pq.ParquetWriter(tmp, schema) as writer:
        batch: list[dict[str, Any]] = []

        def flush() -> None:
            try:
                table = pa.Table.from_pylist(batch, schema=schema)
            except (pa.ArrowInvalid, pa.ArrowTypeError, TypeError, ValueError) as exc:
                episodes = sorted({str(r.get("episode_id")) for r in batch})
                raise TrainingIndexError(
                    f"rows of {', '.join(episodes[:3])}{' ...' if len(episodes) > 3 else ''} "
                    f"do not fit the Parquet schema: {exc}") from exc
            writer.write_table(table)
            batch.clear()

        for row in rows:
            batch.append(_for_parquet(row))
            count += 1
            if len(batch) >= _BATCH_ROWS:
                flush()
        if batch:
            flush()
    return count
