"""The episode vocabulary every part shares: what to run (``EpisodeSpec``), how it ended
(``Status``, ``EpisodeResult``), which statuses are scores of the agent, and the task facts
several parts read (is it infeasible?). Defined once here; nothing here does I/O."""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from enum import StrEnum
from typing import Any

__all__ = [
    "DONE",
    "EXCLUDED_STATUSES",
    "FAIL",
    "SCORED_STATUSES",
    "SPECIAL_ACTIONS",
    "STATUSES",
    "SUCCESS_REWARD",
    "WAIT",
    "EpisodeResult",
    "EpisodeSpec",
    "Status",
    "group_id",
    "infra_result",
    "is_infeasible",
]


# OSWorld's special actions: ``step`` takes them besides pyautogui code. WAIT pauses, DONE
# and FAIL end the episode (FAIL: the agent gave up, which scores an infeasible task).
WAIT = "WAIT"
DONE = "DONE"
FAIL = "FAIL"
SPECIAL_ACTIONS = (DONE, FAIL, WAIT)


class Status(StrEnum):
    """How an episode ended: one of these on every result, never a bare bool or reward (the
    reward says how well a scored episode did, the status whether it was scored at all)."""

    SUCCESS = "success"          # scored, reward >= SUCCESS_REWARD
    FAILURE = "failure"          # scored, below it
    MAX_STEPS = "max_steps"      # the step budget ran out; still scored
    TIMEOUT = "timeout"          # the episode deadline passed; still scored
    INFRA_ERROR = "infra_error"  # desktop, model or evaluator broke: never a reward
    CANCELLED = "cancelled"      # stopped by the user: not recorded, a rerun runs it again


STATUSES: tuple[str, ...] = tuple(s.value for s in Status)
# Statuses whose reward is a score of the agent; the others never feed a success rate.
SCORED_STATUSES: frozenset[str] = frozenset(
    {Status.SUCCESS, Status.FAILURE, Status.MAX_STEPS, Status.TIMEOUT})
EXCLUDED_STATUSES: frozenset[str] = frozenset({Status.INFRA_ERROR, Status.CANCELLED})
# A reward at least this high is a solved task (evaluators return 1.0 for a full solve;
# partial credit counts as failure but keeps its reward).
SUCCESS_REWARD = 1.0


def is_infeasible(task: Mapping[str, Any]) -> bool:
    """OSWorld's infeasible tasks: the evaluator is ``infeasible`` (the agent must give up)."""
    evaluator = task.get("evaluator")
    func = evaluator.get("func") if isinstance(evaluator, Mapping) else None
    return func == "infeasible" or func == ["infeasible"]


@dataclass(frozen=True)
class EpisodeSpec:
    """One episode to run: rollout ``rollout`` of task ``task_id``. Picklable for Ray."""

    task_id: str
    domain: str
    rollout: int
    task: dict[str, Any] = field(compare=False, repr=False)
    attempt: int = 0
    pass_index: int = 0             # which pass over the task set (tasks.passes)
    group_size: int | None = None   # rollouts of this task in this pass (None: not planned)
    # Set by the coordinator for each dispatch (an outage or a cut reruns the same attempt):
    # names the staging directory of the files its runner writes (``layout.staging_name``).
    nonce: str = field(default="", compare=False)
    episode_id: str = field(init=False)
    group: str = field(init=False)     # the task: "<domain>/<task_id>"
    group_id: str = field(init=False)  # the task's group of this pass (the trainer's unit)

    def __post_init__(self) -> None:
        # Derived, never passed by hand: the id is the episode's path under the run dir.
        object.__setattr__(self, "group", f"{self.domain}/{self.task_id}")
        object.__setattr__(self, "group_id", group_id(self.domain, self.task_id,
                                                      self.pass_index))
        object.__setattr__(self, "episode_id", f"{self.domain}/{self.task_id}/{self.rollout}")


def group_id(domain: str, task_id: str, pass_index: int) -> str:
    """The id of a task's group of rollouts in one pass: ``<domain>/<task_id>/pass-<n>``."""
    return f"{domain}/{task_id}/pass-{pass_index}"


@dataclass
class EpisodeResult:
    """How an episode ended; ``record()`` is its results.jsonl line."""

    episode_id: str
    task_id: str
    domain: str
    rollout: int
    attempt: int
    status: str
    reward: float | None
    steps: int
    started_at: float
    ended_at: float
    instruction: str = ""
    infeasible: bool = False
    model_version: str | None = None        # the version of the last step's generation
    model_endpoints: list[str] = field(default_factory=list)
    first_model_version: str | None = None  # the version of the first step's generation
    model_versions: list[str] = field(default_factory=list)  # every version used, in order
    pass_index: int = 0
    group_id: str | None = None
    group_size: int | None = None
    desktop: str | None = None
    desktops_tried: list[str] = field(default_factory=list)
    error: str | None = None
    retryable: bool = False       # an infra error that another attempt may not hit
    last_action: str | None = None
    parse_failures: int = 0
    timing: dict[str, float] = field(default_factory=dict)
    runner: str | None = None
    node: str | None = None
    outage: str | None = None     # "model"/"desktop": that side was down (requeue, no attempt)
    fatal: bool = False           # no retry can fix it: the run stops, the episode is not recorded
    # A text episode's (math, py, rag, web): mode, benchmark, metric, variant, the final
    # answer, turns and tool-call counts. None for desktop episodes (left out of record()).
    text: dict[str, Any] | None = None
    # Why the evaluation scored 0 because it raised on what the agent left (a file it did
    # not write, one that does not parse): the agent's failure. Left out of record() if None.
    evaluation_error: str | None = None

    @property
    def mixed_versions(self) -> bool:
        """Steps of this episode came from more than one model version (a reload mid-way)."""
        return len(self.model_versions) > 1

    def record(self) -> dict[str, Any]:
        out = asdict(self)
        out["status"] = str(self.status)
        out["duration_s"] = round(self.ended_at - self.started_at, 4)
        out["mixed_versions"] = self.mixed_versions
        for scheduling_only in ("retryable", "outage", "fatal"):
            out.pop(scheduling_only)
        for absent in ("text", "evaluation_error"):
            if out[absent] is None:
                out.pop(absent)
        return out


def infra_result(spec: EpisodeSpec, error: str, *, retryable: bool = True,
                 runner: str | None = None, outage: str | None = None,
                 fatal: bool = False) -> EpisodeResult:
    """The result of an attempt that never reached (or lost) its runner."""
    now = time.time()
    return EpisodeResult(
        spec.episode_id, spec.task_id, spec.domain, spec.rollout, spec.attempt,
        Status.INFRA_ERROR, None, 0, now, now, instruction=str(spec.task.get("instruction", "")),
        infeasible=is_infeasible(spec.task), error=error, retryable=retryable, runner=runner,
        outage=outage, fatal=fatal, pass_index=spec.pass_index, group_id=spec.group_id,
        group_size=spec.group_size,
    )
