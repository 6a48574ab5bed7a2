"""Reading a run's results for the scripts in this directory: a run directory (ours, per
docs/results_format.md, or OSWorld's own tree of ``result.txt`` files) becomes a list of
``Episode`` records; per-task aggregation and the rates (success rate, avg@k, pass@k) live here.

Plain file I/O with the standard library: no Ray, no project imports, so the scripts run
from any checkout or copy of ``scripts/``. A line or file that cannot be read becomes a
``Problem`` (path, line, message) that the scripts print on stderr and then skip.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, TextIO

RESULTS_FILE = "results.jsonl"
METRICS_FILE = "metrics.jsonl"
RUN_FILE = "run.json"
TRAJ_FILE = "traj.jsonl"
OSWORLD_RESULT_FILE = "result.txt"
TASK_CONFIG_FILE = "task_config.json"

# Episode statuses (DESIGN.md "Episode outcome"). The scored ones carry an evaluator reward;
# the excluded ones never do and are left out of every rate, only counted.
STATUSES = ("success", "failure", "max_steps", "timeout", "infra_error", "cancelled")
SCORED_STATUSES = frozenset({"success", "failure", "max_steps", "timeout"})
EXCLUDED_STATUSES = frozenset({"infra_error", "cancelled"})
# A task is solved (pass@k) when a rollout reaches the full score; partial rewards only add to
# the success rate and avg@k, as in OSWorld.
SOLVED_REWARD = 1.0

# Short column headers for tables.
STATUS_ABBREV = {
    "success": "succ",
    "failure": "fail",
    "max_steps": "max_st",
    "timeout": "tmout",
    "infra_error": "infra",
    "cancelled": "cancel",
}

LAYOUT_OURS = "cua-rollout"
LAYOUT_OSWORLD = "osworld"
Layout = Literal["cua-rollout", "osworld"]

# OSWorld's reporting groups (its show_result.py); our runs may name the office domains short.
OSWORLD_GROUPS: dict[str, frozenset[str]] = {
    "Office": frozenset({"libreoffice_calc", "libreoffice_impress", "libreoffice_writer"}),
    "Daily": frozenset({"vlc", "thunderbird", "chrome"}),
    "Professional": frozenset({"gimp", "vs_code"}),
}
_DOMAIN_ALIASES = {
    "calc": "libreoffice_calc",
    "impress": "libreoffice_impress",
    "writer": "libreoffice_writer",
}


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
        return self.scored and self.reward is not None and self.reward >= SOLVED_REWARD


@dataclass
class Run:
    """A run directory as read: its layout, its episodes (one per episode id, the last line
    wins) and what could not be read."""

    path: Path
    layout: Layout
    episodes: list[Episode]
    problems: list[Problem]

    @property
    def name(self) -> str:
        return self.path.resolve().name


# --------------------------------------------------------------------------- reading


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
    for number, raw in enumerate(text.splitlines(), start=1):
        if not raw.strip():
            continue
        try:
            value = json.loads(raw)
        except json.JSONDecodeError as exc:
            problems.append(Problem(path, f"not valid JSON, skipped ({exc.msg})", number))
            continue
        if not isinstance(value, dict):
            problems.append(Problem(path, "not a JSON object, skipped", number))
            continue
        rows.append((number, value))
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
        key = (episode.domain, episode.task_id, episode.rollout)
        if key in by_id:
            # Not expected from run.py; the later line is the newer outcome, as on resume.
            problems.append(Problem(path, f"{episode.episode_id} listed again, later wins", number))
        by_id[key] = episode
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
    episode_dir = _inside(run_dir, f"{domain}/{task_id}/{rollout}")
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
        dir=episode_dir,
        record=record,
    )


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
        episodes.append(
            Episode(
                domain=task_dir.parent.name,
                task_id=task_dir.name,
                rollout=0,
                status="success" if reward >= SOLVED_REWARD else "failure",
                reward=reward,
                steps=steps,
                instruction=instruction,
                infeasible=infeasible,
                dir=task_dir,
            )
        )
    return episodes, problems


def _task_config_facts(path: Path) -> tuple[str, bool]:
    """Instruction and infeasibility from a task_config.json, when one lies next to the
    result (OSWorld itself does not write it; copies made by other tools may)."""
    try:
        task = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return "", False
    if not isinstance(task, dict):
        return "", False
    instruction = task.get("instruction")
    evaluator = task.get("evaluator")
    func = evaluator.get("func") if isinstance(evaluator, dict) else None
    return (instruction if isinstance(instruction, str) else "", func == "infeasible")


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


# --------------------------------------------------------------------------- aggregation


def canonical_domain(domain: str) -> str:
    """OSWorld's name for a domain (``calc`` -> ``libreoffice_calc``); others unchanged."""
    return _DOMAIN_ALIASES.get(domain, domain)


def group_of(domain: str) -> str | None:
    """The OSWorld group (Office, Daily, Professional) of a domain, if any."""
    name = canonical_domain(domain)
    return next((g for g, members in OSWORLD_GROUPS.items() if name in members), None)


@dataclass(frozen=True)
class TaskSummary:
    """The rollouts of one task: scored rewards (any order), status counts, solved or not."""

    domain: str
    task_id: str
    instruction: str
    infeasible: bool
    rewards: tuple[float, ...]
    status_counts: dict[str, int]

    @property
    def scored(self) -> bool:
        return bool(self.rewards)

    @property
    def mean_reward(self) -> float | None:
        return statistics.fmean(self.rewards) if self.rewards else None

    @property
    def solved(self) -> bool:
        return any(r >= SOLVED_REWARD for r in self.rewards)


def summarize_tasks(episodes: Iterable[Episode]) -> dict[tuple[str, str], TaskSummary]:
    """Group episodes by (domain, task_id), sorted by that key."""
    grouped: dict[tuple[str, str], list[Episode]] = {}
    for e in episodes:
        grouped.setdefault(e.task_key, []).append(e)
    summaries = {}
    for key in sorted(grouped):
        group = sorted(grouped[key], key=lambda e: e.rollout)
        summaries[key] = TaskSummary(
            domain=key[0],
            task_id=key[1],
            instruction=next((e.instruction for e in group if e.instruction), ""),
            infeasible=any(e.infeasible for e in group),
            rewards=tuple(e.reward for e in group if e.scored and e.reward is not None),
            status_counts=dict(Counter(e.status for e in group)),
        )
    return summaries


@dataclass(frozen=True)
class Rates:
    """The figures of a set of episodes. Rates are None when nothing is scored.

    success_rate: mean reward over scored episodes (OSWorld's figure; metrics.jsonl's too).
    avg_at_k: mean over scored tasks of the task's mean reward over its scored rollouts.
    pass_at_k: fraction of scored tasks with a rollout at reward >= 1.0.
    k_min, k_max: fewest and most scored rollouts of a task (k of avg@k / pass@k).
    mean_steps, mean_duration_s: over scored episodes that report them.
    """

    episodes: int
    scored_episodes: int
    tasks: int
    scored_tasks: int
    solved_tasks: int
    k_min: int | None
    k_max: int | None
    success_rate: float | None
    avg_at_k: float | None
    pass_at_k: float | None
    mean_steps: float | None
    mean_duration_s: float | None
    status_counts: dict[str, int]

    def to_json(self) -> dict[str, Any]:
        return {
            "episodes": self.episodes,
            "scored_episodes": self.scored_episodes,
            "tasks": self.tasks,
            "scored_tasks": self.scored_tasks,
            "solved_tasks": self.solved_tasks,
            "k_min": self.k_min,
            "k_max": self.k_max,
            "success_rate": self.success_rate,
            "avg_at_k": self.avg_at_k,
            "pass_at_k": self.pass_at_k,
            "mean_steps": self.mean_steps,
            "mean_duration_s": self.mean_duration_s,
            "status_counts": dict(self.status_counts),
        }


def k_label(rates: dict[str, Any]) -> str:
    """The k of avg@k / pass@k for a RATES object: "4", or "2-4" when tasks differ."""
    k_min, k_max = rates["k_min"], rates["k_max"]
    if k_min is None:
        return "k"
    return str(k_max) if k_min == k_max else f"{k_min}-{k_max}"


def flat_rates(rates: dict[str, Any]) -> dict[str, Any]:
    """A RATES object as one flat row: status counts as columns, plus ``k``."""
    row = {name: value for name, value in rates.items() if name != "status_counts"}
    row.update(rates["status_counts"])
    row["k"] = k_label(rates) if rates["k_min"] is not None else ""
    return row


def compute_rates(episodes: Iterable[Episode]) -> Rates:
    episodes = list(episodes)
    scored = [e for e in episodes if e.scored]
    tasks = summarize_tasks(episodes)
    scored_tasks = [t for t in tasks.values() if t.scored]
    counts = Counter(e.status for e in episodes)
    steps = [e.steps for e in scored if e.steps is not None]
    durations = [e.duration_s for e in scored if e.duration_s is not None]
    ks = [len(t.rewards) for t in scored_tasks]
    return Rates(
        episodes=len(episodes),
        scored_episodes=len(scored),
        tasks=len(tasks),
        scored_tasks=len(scored_tasks),
        solved_tasks=sum(t.solved for t in scored_tasks),
        k_min=min(ks) if ks else None,
        k_max=max(ks) if ks else None,
        success_rate=_mean([e.reward for e in scored if e.reward is not None]),
        avg_at_k=_mean([t.mean_reward for t in scored_tasks if t.mean_reward is not None]),
        pass_at_k=_mean([1.0 if t.solved else 0.0 for t in scored_tasks]),
        mean_steps=_mean(steps),
        mean_duration_s=_mean(durations),
        status_counts={s: counts.get(s, 0) for s in STATUSES},
    )


def _mean(values: Sequence[float]) -> float | None:
    return statistics.fmean(values) if values else None


def mean_std(values: Iterable[float | None]) -> tuple[float | None, float | None]:
    """Mean and sample standard deviation (n - 1) of the values that are not None; the
    deviation is None with fewer than two values."""
    present = [v for v in values if v is not None]
    if not present:
        return None, None
    return statistics.fmean(present), statistics.stdev(present) if len(present) > 1 else None


# --------------------------------------------------------------------------- CLI helpers


# The run directory formats the scripts accept, for their --help.
RUN_DIR_HELP = (
    "RUN_DIR is a run directory of run.py (results.jsonl, see docs/results_format.md) or an "
    "OSWorld results tree (<domain>/<task_id>/result.txt); the format is detected."
)


def report_problems(problems: Iterable[Problem], stream: TextIO | None = None) -> int:
    """Print each problem on its own line of stderr; return how many."""
    out = stream if stream is not None else sys.stderr
    n = 0
    for problem in problems:
        print(f"warning: {problem}", file=out)
        n += 1
    return n


def fmt_rate(value: float | None) -> str:
    """A rate as a percentage with one decimal, '-' when there is none."""
    return "-" if value is None else f"{100 * value:.1f}%"


def fmt_float(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def open_run(parser: argparse.ArgumentParser, path: str) -> Run:
    """``load_run`` for a CLI: a bad directory exits 2 with one line naming it; unreadable
    lines are reported on stderr and skipped."""
    try:
        run = load_run(path)
    except RunDirError as exc:
        parser.exit(2, f"{parser.prog}: error: {exc}\n")
    report_problems(run.problems)
    return run


def make_out_dir(parser: argparse.ArgumentParser, path: Path) -> Path:
    """Create an output directory for a CLI; one line and exit 2 when it cannot be made."""
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        parser.exit(2, f"{parser.prog}: error: {path}: cannot create ({exc.strerror})\n")
    return path
