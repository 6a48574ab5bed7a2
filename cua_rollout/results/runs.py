"""Reading a run directory: ours (docs/results_format.md) or OSWorld's own tree of
``result.txt`` files becomes a ``Run`` of ``Episode`` records, plus the per-episode
``traj.jsonl`` and the run's ``metrics.jsonl``.

Plain file I/O with the standard library and the project's vocabulary (cua_rollout.core.types,
cua_rollout.core.layout, cua_rollout.core.files): no Ray. A line or file that cannot be read
becomes a
``Problem`` (path, line, message) that the callers report and then skip.

Records written before the model-version fields (``first_model_version``,
``model_versions``, ``mixed_versions``, ``pass_index``, ``group_id``, ``group_size``) read
with their defaults (docs/results_format.md).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from cua_rollout.core.files import iter_jsonl, read_json
from cua_rollout.core.layout import (
    METRICS_FILE,
    OSWORLD_RESULT_FILE,
    RESULTS_FILE,
    RUN_FILE,
    TASK_CONFIG_FILE,
    TRAJ_FILE,
)
from cua_rollout.core.types import (
    EXCLUDED_STATUSES,
    SCORED_STATUSES,
    STATUSES,
    SUCCESS_REWARD,
    Status,
    is_infeasible,
)
from cua_rollout.core.types import group_id as task_group_id

__all__ = [
    "LAYOUT_OSWORLD",
    "LAYOUT_OURS",
    "Episode",
    "Layout",
    "Problem",
    "Run",
    "RunDirError",
    "Selection",
    "load_run",
    "read_jsonl",
    "read_metrics",
    "read_traj",
]

LAYOUT_OURS = "cua-rollout"
LAYOUT_OSWORLD = "osworld"
Layout = Literal["cua-rollout", "osworld"]


class RunDirError(Exception):
    """The path given is not a readable run directory (missing, not a directory)."""


@dataclass(frozen=True)
class Problem:
    """Something unreadable, skipped: the file, the 1-based line (JSONL) and why."""

    path: Path
    message: str
    line: int | None = None

    def __str__(self) -> str:
        where = f"{self.path}:{self.line}" if self.line is not None else str(self.path)
        return f"{where}: {self.message}"


@dataclass(frozen=True)
class Episode:
    """One finished episode: a results.jsonl line, or one OSWorld task directory."""

    domain: str
    task_id: str
    rollout: int
    status: str
    reward: float | None
    steps: int | None = None
    duration_s: float | None = None
    instruction: str = ""
    infeasible: bool = False
    error: str | None = None
    # The episode's directory (traj.jsonl, screenshots); None when the record names none.
    dir: Path | None = None
    started_at: float | None = None
    # Model versions: the first and the last step's, every distinct one in the order used
    # (first and last included), and whether there were several. None / () when no step
    # reached a model (an early infra_error) or the layout records none (OSWorld's).
    first_model_version: str | None = None
    model_version: str | None = None
    model_versions: tuple[str, ...] = ()
    mixed_versions: bool = False
    # The pass over the task set, and the task's group of rollouts in that pass.
    pass_index: int = 0
    group_id: str = ""
    group_size: int | None = None
    record: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @property
    def episode_id(self) -> str:
        return f"{self.domain}/{self.task_id}/{self.rollout}"

    @property
    def task_key(self) -> tuple[str, str]:
        return (self.domain, self.task_id)

    @property
    def scored(self) -> bool:
        return self.status in SCORED_STATUSES and self.reward is not None

    @property
    def solved(self) -> bool:
        # Solved (pass@k) at the full score; partial rewards only add to the rates, as OSWorld.
        return self.scored and self.reward is not None and self.reward >= SUCCESS_REWARD


@dataclass(frozen=True)
class Selection:
    """How a Run's episodes were narrowed by model version (``select_versions``): the
    options, the version order of the whole run they were taken from, how many were left
    out. ``to_json()``: {"min_version": str | null, "exclude_mixed": bool,
    "excluded_episodes": int}."""

    min_version: str | None
    exclude_mixed: bool
    versions: tuple[str, ...]
    excluded: int

    def to_json(self) -> dict[str, Any]:
        return {
            "min_version": self.min_version,
            "exclude_mixed": self.exclude_mixed,
            "excluded_episodes": self.excluded,
        }


@dataclass
class Run:
    """A run directory as read: its layout, its episodes (one per episode id, the last line
    wins) and what could not be read; ``selection`` when its episodes were narrowed by
    model version (cua_rollout.results.versions.select_versions)."""

    path: Path
    layout: Layout
    episodes: list[Episode]
    problems: list[Problem]
    selection: Selection | None = None

    @property
    def name(self) -> str:
        return self.path.resolve().name


def read_jsonl(path: Path) -> tuple[list[tuple[int, dict[str, Any]]], list[Problem]]:
    """The JSON objects of a JSONL file with their 1-based line numbers; a line that is not a
    JSON object (a crash can cut the last one short) becomes a Problem. A missing file reads
    as empty; an unreadable one is a Problem."""
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except FileNotFoundError:
        return [], []
    except OSError as exc:
        return [], [Problem(path, f"cannot read: {exc}")]
    rows: list[tuple[int, dict[str, Any]]] = []
    problems: list[Problem] = []
    for line in iter_jsonl(text):
        if line.error is not None:
            message = f"not valid JSON, skipped ({line.error.msg})"
            problems.append(Problem(path, message, line.number))
        elif not isinstance(line.value, dict):
            problems.append(Problem(path, "not a JSON object, skipped", line.number))
        else:
            rows.append((line.number, line.value))
    return rows, problems


def load_run(path: str | Path) -> Run:
    """Read a run directory. Ours when it holds ``results.jsonl`` or ``run.json``; otherwise
    OSWorld's layout, found by its ``result.txt`` files. Raises RunDirError when ``path`` is
    not a directory; an empty directory is a run with no episodes."""
    run_dir = Path(path)
    if not run_dir.exists():
        raise RunDirError(f"{run_dir}: no such directory")
    if not run_dir.is_dir():
        raise RunDirError(f"{run_dir}: not a directory")
    if (run_dir / RESULTS_FILE).exists() or (run_dir / RUN_FILE).exists():
        episodes, problems = _load_ours(run_dir)
        return Run(run_dir, LAYOUT_OURS, episodes, problems)
    episodes, problems = _load_osworld(run_dir)
    return Run(run_dir, LAYOUT_OSWORLD, episodes, problems)


def read_traj(episode: Episode) -> tuple[list[dict[str, Any]], list[Problem]]:
    """The step lines of an episode's traj.jsonl (empty when it has none)."""
    if episode.dir is None:
        return [], []
    rows, problems = read_jsonl(episode.dir / TRAJ_FILE)
    return [row for _, row in rows], problems


def read_metrics(run_dir: Path) -> tuple[list[dict[str, Any]] | None, list[Problem]]:
    """The samples of metrics.jsonl, or None when the run has no such file."""
    path = run_dir / METRICS_FILE
    if not path.exists():
        return None, []
    rows, problems = read_jsonl(path)
    return [row for _, row in rows], problems


# --------------------------------------------------------------------------- ours


def _load_ours(run_dir: Path) -> tuple[list[Episode], list[Problem]]:
    path = run_dir / RESULTS_FILE
    rows, problems = read_jsonl(path)
    by_id: dict[tuple[str, str, int], Episode] = {}
    for number, record in rows:
        try:
            episode = _episode_from_record(record, run_dir)
        except (KeyError, TypeError, ValueError) as exc:
            problems.append(Problem(path, f"{exc}, skipped", number))
            continue
        # One record per episode: a later line (a rerun's) supersedes an earlier one, as on
        # resume; run.py also compacts the file to one line per episode at each start.
        by_id.pop((episode.domain, episode.task_id, episode.rollout), None)
        by_id[(episode.domain, episode.task_id, episode.rollout)] = episode
    return list(by_id.values()), problems


def _episode_from_record(record: dict[str, Any], run_dir: Path) -> Episode:
    """One results.jsonl line as an Episode; raises with the field at fault."""
    if all(k in record for k in ("domain", "task_id", "rollout")):
        domain, task_id, rollout = record["domain"], record["task_id"], record["rollout"]
    elif isinstance(record.get("episode_id"), str) and record["episode_id"].count("/") >= 2:
        domain, rest = record["episode_id"].split("/", 1)
        task_id, rollout = rest.rsplit("/", 1)
    else:
        raise KeyError("field domain/task_id/rollout (or episode_id): missing")
    if not isinstance(domain, str) or not domain or not isinstance(task_id, str) or not task_id:
        raise TypeError(f"field domain/task_id: must be non-empty strings, got {domain!r}")
    if isinstance(rollout, bool) or not isinstance(rollout, int | str):
        raise TypeError(f"field rollout: must be an integer, got {rollout!r}")
    rollout = int(rollout)
    if rollout < 0:
        raise ValueError(f"field rollout: must be >= 0, got {rollout}")
    status = record.get("status")
    if status not in STATUSES:
        raise ValueError(f"field status: must be one of {', '.join(STATUSES)}, got {status!r}")
    reward = _number(record, "reward")
    if status in SCORED_STATUSES and reward is None:
        raise ValueError(f"field reward: a {status} episode needs a number, got null")
    if status in EXCLUDED_STATUSES:
        reward = None  # never a score, whatever the line says
    steps = record.get("steps")
    steps = steps if isinstance(steps, int) and not isinstance(steps, bool) else None
    instruction = record.get("instruction")
    error = record.get("error")
    versions = _versions(record)
    pass_index = _count(record, "pass_index")
    group = record.get("group_id")
    if group is not None and not isinstance(group, str):
        raise TypeError(f"field group_id: must be a string or null, got {group!r}")
    return Episode(
        domain=domain,
        task_id=task_id,
        rollout=rollout,
        status=status,
        reward=reward,
        steps=steps,
        duration_s=_number(record, "duration_s"),
        instruction=instruction if isinstance(instruction, str) else "",
        infeasible=record.get("infeasible") is True,
        error=error if isinstance(error, str) else None,
        dir=_inside(run_dir, f"{domain}/{task_id}/{rollout}"),
        started_at=_number(record, "started_at"),
        **versions,
        pass_index=0 if pass_index is None else pass_index,
        group_id=group or task_group_id(domain, task_id, pass_index or 0),
        group_size=_count(record, "group_size"),
        record=record,
    )


def _versions(record: dict[str, Any]) -> dict[str, Any]:
    """The model-version fields of a record, with the defaults of records written before
    them: first = the first of model_versions, else model_version; model_versions = the
    distinct versions of first, model_versions and model_version in that order (so [last]
    when only model_version is there); mixed = more than one of them."""
    last = _version(record, "model_version")
    first = _version(record, "first_model_version")
    listed = record.get("model_versions")
    if listed is None:
        listed = []
    elif not isinstance(listed, list) or not all(isinstance(v, str) and v for v in listed):
        raise TypeError(f"field model_versions: must be a list of strings, got {listed!r}")
    if first is None:
        first = listed[0] if listed else last
    versions = tuple(dict.fromkeys(v for v in (first, *listed, last) if v is not None))
    mixed = record.get("mixed_versions")
    if mixed is not None and not isinstance(mixed, bool):
        raise TypeError(f"field mixed_versions: must be true, false or null, got {mixed!r}")
    return {
        "first_model_version": first,
        "model_version": last,
        "model_versions": versions,
        "mixed_versions": len(versions) > 1 if mixed is None else mixed,
    }


def _version(record: dict[str, Any], name: str) -> str | None:
    value = record.get(name)
    if value is None or value == "":
        return None
    if not isinstance(value, str):
        raise TypeError(f"field {name}: must be a string or null, got {value!r}")
    return value


def _count(record: dict[str, Any], name: str) -> int | None:
    value = record.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise TypeError(f"field {name}: must be an integer >= 0 or null, got {value!r}")
    return value


def _number(record: dict[str, Any], name: str) -> float | None:
    value = record.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise TypeError(f"field {name}: must be a finite number or null, got {value!r}")
    return float(value)


def _inside(run_dir: Path, relative: str) -> Path | None:
    """``run_dir / relative`` unless the names would climb out of the run directory."""
    parts = Path(relative).parts
    if Path(relative).is_absolute() or any(p in ("..", "") for p in parts):
        return None
    return run_dir.joinpath(*parts)


# --------------------------------------------------------------------------- OSWorld


def _load_osworld(run_dir: Path) -> tuple[list[Episode], list[Problem]]:
    """OSWorld: .../<domain>/<task_id>/result.txt holding the reward; one rollout per task."""
    episodes: list[Episode] = []
    problems: list[Problem] = []
    for result in sorted(run_dir.rglob(OSWORLD_RESULT_FILE)):
        task_dir = result.parent
        if task_dir == run_dir:
            problems.append(Problem(result, "result.txt directly in the run dir, no task, skipped"))
            continue
        try:
            reward = float(result.read_text(encoding="utf-8").strip())
        except (OSError, UnicodeDecodeError, ValueError) as exc:
            problems.append(Problem(result, f"reward: not a float, skipped ({exc})"))
            continue
        if not math.isfinite(reward):
            problems.append(Problem(result, f"reward: not finite ({reward}), skipped"))
            continue
        traj = task_dir / TRAJ_FILE
        steps = None
        if traj.exists():
            try:
                lines = traj.read_text(encoding="utf-8", errors="replace").splitlines()
                steps = sum(1 for line in lines if line.strip())
            except OSError as exc:
                problems.append(Problem(traj, f"cannot read: {exc}"))
        instruction, infeasible = _task_config_facts(task_dir / TASK_CONFIG_FILE)
        solved = reward >= SUCCESS_REWARD
        episodes.append(
            Episode(
                domain=task_dir.parent.name,
                task_id=task_dir.name,
                rollout=0,
                status=(Status.SUCCESS if solved else Status.FAILURE).value,
                reward=reward,
                steps=steps,
                instruction=instruction,
                infeasible=infeasible,
                dir=task_dir,
                group_id=task_group_id(task_dir.parent.name, task_dir.name, 0),
            )
        )
    return episodes, problems


def _task_config_facts(path: Path) -> tuple[str, bool]:
    """Instruction and infeasibility from a task_config.json, when one lies next to the
    result (OSWorld itself does not write it; copies made by other tools may)."""
    task = read_json(path)
    if not isinstance(task, dict):
        return "", False
    instruction = task.get("instruction")
    return (instruction if isinstance(instruction, str) else "", is_infeasible(task))
