"""The figures of a set of episodes: per-task aggregation (``TaskSummary``), the rates
(``Rates``: success rate, avg@k, pass@k, status counts, mean steps and time), the mean and
deviation across runs, and OSWorld's domain groups. Pure computation, no I/O.

Rates leave out ``infra_error`` and ``cancelled`` episodes (they are only counted).
"""

from __future__ import annotations

import statistics
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from cua_rollout.core.types import STATUSES, SUCCESS_REWARD
from cua_rollout.results.runs import Episode

__all__ = [
    "OSWORLD_GROUPS",
    "Rates",
    "TaskSummary",
    "canonical_domain",
    "compute_rates",
    "flat_rates",
    "group_of",
    "k_label",
    "mean_std",
    "summarize_tasks",
]

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
        return any(r >= SUCCESS_REWARD for r in self.rewards)


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
    mixed_episodes: episodes (any status) whose steps came from more than one model version.
    evaluation_errors: failures scored 0 because the evaluation raised on what the agent
      left (their ``evaluation_error``; counted apart from plain failures).

    ``to_json()`` is the RATES object of the tools' JSON output:
      {"episodes": int, "scored_episodes": int, "tasks": int, "scored_tasks": int,
       "solved_tasks": int, "k_min": int | null, "k_max": int | null,
       "success_rate": float | null, "avg_at_k": float | null, "pass_at_k": float | null,
       "mean_steps": float | null, "mean_duration_s": float | null,
       "status_counts": {"success": int, "failure": int, "max_steps": int,
                         "timeout": int, "infra_error": int, "cancelled": int},
       "mixed_episodes": int, "evaluation_errors": int}
    Rates are fractions in [0, 1].
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
    mixed_episodes: int = 0
    evaluation_errors: int = 0

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
            "mixed_episodes": self.mixed_episodes,
            "evaluation_errors": self.evaluation_errors,
        }


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
        mixed_episodes=sum(e.mixed_versions for e in episodes),
        evaluation_errors=sum(1 for e in episodes if e.record.get("evaluation_error")),
    )


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


def _mean(values: Sequence[float]) -> float | None:
    return statistics.fmean(values) if values else None


def mean_std(values: Iterable[float | None]) -> tuple[float | None, float | None]:
    """Mean and sample standard deviation (n - 1) of the values that are not None; the
    deviation is None with fewer than two values."""
    present = [v for v in values if v is not None]
    if not present:
        return None, None
    return statistics.fmean(present), statistics.stdev(present) if len(present) > 1 else None
