"""Tasks to episode specs: reads the task source (cua_rollout/runtime/task_sources.py: an
OSWorld task list, a JSONL file or a directory of task files), filters it, skips episodes
already in the run's ``results.jsonl``, picks up new tasks in service mode; which rollouts of
them start when is the sampling plan's (cua_rollout/runtime/sampling.py), which the loader
feeds.

Never touches Ray or desktops: ``TaskLoader.poll()`` is plain file I/O on the driver.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

from cua_rollout.config import BenchmarkConfig, TasksConfig
from cua_rollout.core.files import JsonLine, iter_jsonl_lines
from cua_rollout.core.layout import RESULTS_FILE
from cua_rollout.core.types import EpisodeSpec
from cua_rollout.runtime.sampling import ResultLine, SamplingPlan
from cua_rollout.runtime.task_sources import (
    BenchmarkSource,
    SourceTask,
    TaskProblem,
    make_source,
)

__all__ = ["TaskLoader", "load_benchmark", "load_tasks", "resume_plan"]

logger = logging.getLogger(__name__)


def load_benchmark(bench: BenchmarkConfig
                   ) -> tuple[list[dict[str, Any]], list[TaskProblem]]:
    """Every item of a text benchmark as its task (``cua_rollout.text.benchmark.text_task``) and
    the problems of those that could not be read."""
    tasks, problems = BenchmarkSource(bench).scan(lambda domain, task_id: True)
    return [t.task for t in tasks], problems


def load_tasks(source: Path, examples_dir: Path | None = None
               ) -> tuple[list[tuple[str, str, dict[str, Any]]], list[TaskProblem]]:
    """Every task of ``source`` (a task list with its examples folder, a JSONL file or a
    folder of task files) as ``(domain, task_id, task)``, and the problems of those that could
    not be read: what the loader sees, for tools that check a task set."""
    loader_cfg = TasksConfig(source=source, examples_dir=examples_dir)
    tasks, problems = make_source(loader_cfg).scan(lambda domain, task_id: True)
    return [(t.domain, t.task_id, t.task) for t in tasks], problems


# --------------------------------------------------------------------------- loader


class TaskLoader:
    """Hands out each episode of the configured tasks once.

    ``poll()`` returns the episodes not handed out before and not finished in
    ``<run_dir>/results.jsonl``, the rollouts of one task next to each other, as its
    ``SamplingPlan`` plans them (passes, group sizes, the checkpoint ``barrier``; results fed
    in with ``record_result``). With ``poll_interval_s == 0`` the source is read once; in
    service mode ``poll(refresh=True)`` re-reads it (only files whose mtime or size changed)
    and adds what is new. ``problems`` lists the tasks that could not be loaded right now.
    What it holds and what a poll costs stay flat however long a service run goes on: the
    plan keeps the groups not final yet and counters, results.jsonl is read as a stream.
    """

    def __init__(self, cfg: TasksConfig, run_dir: Path,
                 check: Callable[[dict[str, Any]], list[Any]] | None = None,
                 barrier: Callable[[], str | None] | None = None, *,
                 plan: SamplingPlan | None = None, read_results: bool = True) -> None:
        self.cfg = cfg
        self.run_dir = Path(run_dir)
        # Pre-flight (cua_rollout.evaluation.preflight.TaskChecker): a task it finds problems
        # in is reported and skipped before any desktop or model time is spent on it.
        self._check = check
        self._checked: dict[tuple[str, str], tuple[dict[str, Any], list[Any]]] = {}
        self._source = make_source(cfg)
        self._domains = set(cfg.domains) if cfg.domains is not None else None
        self._task_ids = set(cfg.task_ids) if cfg.task_ids is not None else None
        self._service = cfg.poll_interval_s > 0
        self._polled = False
        self._tasks: list[SourceTask] = []
        self._problems: list[TaskProblem] = []
        self._logged: set[TaskProblem] = set()
        # ``plan``: one ``resume_plan`` read already (while Ray started); ``read_results``
        # False: a loader that only checks the task source.
        if plan is not None:
            plan.barrier = barrier
            self.plan = plan
        else:
            self.plan = SamplingPlan(cfg, barrier)
            if read_results:
                _read_results(self.plan, self.run_dir)

    # ----------------------------------------------------------------- public

    @property
    def problems(self) -> list[TaskProblem]:
        """Tasks that could not be loaded at the last poll (path, field at fault, message)."""
        return list(self._problems)

    @property
    def waiting(self) -> str | None:
        """Why new groups are held (the checkpoint barrier), or None."""
        return self.plan.waiting

    def poll(self, refresh: bool = True) -> list[EpisodeSpec]:
        """Episodes to start now: rollouts of groups already planned (a resumed run's), and
        the next group of each task whose groups so far are final. ``refresh``: re-read the
        source first (the first poll always reads it; later ones only in service mode)."""
        if not self._polled or (refresh and self._service):
            self._refresh()
        self._polled = True
        return self.plan.hand_out()

    def exhausted(self) -> bool:
        """Nothing more will be handed out: not a service, every pass of every task
        planned and handed out (results may still be coming)."""
        if self._service or not self._polled:
            return False
        return self.plan.exhausted()

    def record_result(self, record: dict[str, Any]) -> None:
        """An episode is final (a results.jsonl record): the plan hears of it."""
        self.plan.record_result(record)

    def success_rate(self, task_id: str, domain: str) -> float | None:
        """Mean reward of the task's recent episodes (``None`` before any)."""
        return self.plan.success_rate(task_id, domain)

    def rollouts_for(self, task_id: str, domain: str) -> int:
        """How many rollouts the task gets now (``SamplingPlan.rollouts_for``)."""
        return self.plan.rollouts_for(task_id, domain)

    def total_known(self) -> int:
        """Episodes of all tasks known so far, finished ones included (the progress total)."""
        return self.plan.total_known()

    def finished_before(self) -> int:
        """Episodes of known tasks already in ``results.jsonl`` when the loader started."""
        return self.plan.finished()

    # ----------------------------------------------------------------- internals

    def _wanted(self, domain: str, task_id: str | None) -> bool:
        if self._domains is not None and domain not in self._domains:
            return False
        return task_id is None or self._task_ids is None or task_id in self._task_ids

    def _refresh(self) -> None:
        tasks, problems = self._source.scan(self._wanted)
        unique: list[SourceTask] = []
        first: dict[tuple[str, str], Path] = {}
        for t in tasks:
            key = (t.domain, t.task_id)
            if key in first:
                problems.append(
                    TaskProblem(
                        t.path,
                        "id",
                        f"duplicate task {t.task_id!r} in domain "
                        f"{t.domain!r}, first defined in {first[key]}; ignored",
                    )
                )
                continue
            first[key] = t.path
            found = self._preflight(t)
            if found:
                problems.append(TaskProblem(t.path, "cannot run here",
                                            "; ".join(map(str, found))))
                continue
            unique.append(t)
        self._tasks = unique
        self.plan.set_tasks(unique)
        self._problems = problems
        for problem in problems:
            if problem not in self._logged:
                self._logged.add(problem)
                logger.warning("task skipped: %s", problem)

    def _preflight(self, t: SourceTask) -> list[Any]:
        """The checker's problems of a task, checked again only when its file changed (the
        source hands out a new dict then)."""
        if self._check is None:
            return []
        key = (t.domain, t.task_id)
        cached = self._checked.get(key)
        if cached is None or cached[0] is not t.task:
            cached = (t.task, list(self._check(t.task)))
            self._checked[key] = cached
        return cached[1]


def resume_plan(cfg: TasksConfig, run_dir: Path) -> SamplingPlan:
    """The sampling plan of a run resumed from its results.jsonl (``TaskLoader``'s ``plan``):
    plain file reading, so the driver does it while Ray starts."""
    plan = SamplingPlan(cfg)
    _read_results(plan, Path(run_dir))
    return plan


def _read_results(plan: SamplingPlan, run_dir: Path) -> None:
    """Resume: results.jsonl goes to the plan line by line as it is read
    (``SamplingPlan.resume``), so a long run's file is never held whole, nor an entry per
    episode: the plan keeps the groups not final yet and counts the others."""
    path = run_dir / RESULTS_FILE
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            plan.resume(path, _result_lines(path, iter_jsonl_lines(f)))
    except FileNotFoundError:
        return


def _result_lines(path: Path, lines: Iterable[JsonLine]) -> Iterator[ResultLine]:
    """What the plan reads of each line; a line that names no episode is skipped."""
    for line in lines:
        record = line.value
        try:
            if line.error is not None:
                raise line.error
            key = _episode_key(record)
        except (KeyError, TypeError, ValueError) as exc:
            # A crash can cut the last line short; that episode simply runs again.
            logger.warning("%s:%d: unreadable result line skipped (%s)", path,
                           line.number, exc)
            continue
        yield (key, record.get("status"), record.get("reward"),
               record.get("pass_index"), record.get("group_size"))


def _episode_key(record: Any) -> tuple[str, str, int]:
    if not isinstance(record, dict):
        raise TypeError("not a JSON object")
    if all(k in record for k in ("domain", "task_id", "rollout")):
        domain, task_id, rollout = record["domain"], record["task_id"], record["rollout"]
    elif isinstance(record.get("episode_id"), str):
        domain, rest = record["episode_id"].split("/", 1)
        task_id, rollout = rest.rsplit("/", 1)
    else:
        raise KeyError("needs domain, task_id and rollout (or episode_id)")
    if not isinstance(domain, str) or not isinstance(task_id, str):
        raise TypeError("domain and task_id must be strings")
    if isinstance(rollout, bool) or not isinstance(rollout, int | str):
        raise TypeError(f"rollout must be an integer, got {rollout!r}")
    rollout = int(rollout)
    if rollout < 0:
        raise ValueError(f"rollout must be >= 0, got {rollout}")
    return domain, task_id, rollout
