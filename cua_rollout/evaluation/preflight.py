"""Pre-flight: can a task run here, before any desktop or model time is spent on it?

Each setup step (``config`` and the evaluator's ``postconfig``) is checked by the setup
steps' own rules (``cua_rollout.envs.setup_steps.step_problem``: a known type, its parameters,
credentials, cached files when offline), and the evaluator by the route that would score it
(``cua_rollout.evaluation.route_problem``: a native implementation, or OSWorld's evaluator
environment's catalog), and the apps the task names (``related_apps``) by what the desktops
have (``cua_rollout.envs.apps``). The task loader skips a task with problems and reports them;
``scripts/check_tasks.py`` prints the same report for any task set.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from cua_rollout.envs.apps import DesktopApps, desktop_apps
from cua_rollout.evaluation import Problem, route_problem
from cua_rollout.evaluation.osworld_bridge import Catalog, OSWorldBridge, catalog_of

__all__ = ["CheckedTask", "TaskChecker", "coverage"]


@dataclass(frozen=True)
class CheckedTask:
    domain: str
    task_id: str
    problems: list[Problem] = field(default_factory=list)

    @property
    def runnable(self) -> bool:
        return not self.problems


class TaskChecker:
    """Checks tasks against this machine's configuration: ``checker(task)`` -> problems.

    ``catalog`` is what OSWorld's evaluator environment offers; by default it is read (from
    the on-disk cache, or a worker run once) on the first task that needs it, and a missing
    environment is a problem of exactly the tasks that need it."""

    def __init__(self, cfg: Any, catalog: Catalog | None = None) -> None:
        self.desktops = cfg.desktops
        self.engine = cfg.evaluation.engine
        self._evaluation = cfg.evaluation
        self._catalog = catalog
        self._asked = catalog is not None
        self.catalog_error: str | None = None
        self._apps: DesktopApps | None = None

    def catalog(self) -> Catalog | None:
        if not self._asked:
            self._asked = True
            try:
                bridge = OSWorldBridge.from_config(self._evaluation)
                self._catalog = catalog_of(bridge) if bridge is not None else None
            except Exception as exc:  # the environment is broken: say so on each task
                self.catalog_error = f"{type(exc).__name__}: {exc}"
        return self._catalog

    def __call__(self, task: Mapping[str, Any]) -> list[Problem]:
        from cua_rollout.envs.setup_steps import step_problem
        from cua_rollout.text.benchmark import is_text_task

        if is_text_task(task):  # no desktop, no OSWorld evaluator: an answer metric
            return []
        problems: list[Problem] = self._app_problems(task)
        evaluator = task.get("evaluator")
        steps = [("config", task.get("config"))]
        if isinstance(evaluator, Mapping):
            steps.append(("evaluator.postconfig", evaluator.get("postconfig")))
        for where, listed in steps:
            for index, step in enumerate(listed if isinstance(listed, list) else []):
                kind = step.get("type") if isinstance(step, Mapping) else None
                why = step_problem(step, self.desktops, task_id=str(task.get("id") or "")
                                   or None)
                if why:
                    problems.append(Problem(f"setup:{kind}", f"{where}[{index}]: {why}"))
        route, why = route_problem(evaluator, self.engine, None)
        if route is None and self.engine != "native":
            catalog = self.catalog()
            if catalog is not None:
                route, why = route_problem(evaluator, self.engine, catalog)
            elif self.catalog_error:
                why = [Problem(p.key, f"OSWorld's evaluator environment is broken: "
                                      f"{self.catalog_error}") for p in why]
        return problems + why

    def _app_problems(self, task: Mapping[str, Any]) -> list[Problem]:
        """An app of the task's ``related_apps`` that the desktops lack (``envs.apps``)."""
        wanted = _related_apps(task)
        if not wanted:
            return []
        if self._apps is None:
            self._apps = desktop_apps(self.desktops)
        return [Problem(f"app:{app}", f"related_apps: the desktops have no {app} (by "
                                      f"{self._apps.source})")
                for app in self._apps.lacks(wanted)]


def _related_apps(task: Mapping[str, Any]) -> list[str]:
    apps = task.get("related_apps")
    return [a for a in apps if isinstance(a, str)] if isinstance(apps, list) else []


def coverage(checked: Iterable[CheckedTask]) -> dict[str, Any]:
    """The report ``scripts/check_tasks.py --json`` prints: totals, what is missing with
    the number of tasks it blocks, per domain, and each task's problems."""
    checked = list(checked)
    missing: Counter[str] = Counter()
    domains: dict[str, dict[str, int]] = {}
    for t in checked:
        row = domains.setdefault(t.domain, {"total": 0, "runnable": 0})
        row["total"] += 1
        row["runnable"] += t.runnable
        for key in sorted({p.key for p in t.problems}):
            missing[key] += 1
    return {
        "total": len(checked),
        "runnable": sum(t.runnable for t in checked),
        "missing": dict(missing.most_common()),
        "domains": dict(sorted(domains.items())),
        "tasks": [{"domain": t.domain, "id": t.task_id, "runnable": t.runnable,
                   "problems": [str(p) for p in t.problems]} for t in checked],
    }
