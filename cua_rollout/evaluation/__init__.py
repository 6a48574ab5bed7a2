"""Scoring an episode from its task's ``evaluator`` block, with OSWorld's rules.

Getters (``getters.py``) fetch a state from the desktop (a file, a command's output, the
accessibility tree) or from the task (rules, cached files); metrics (``metrics.py``) compare
it with what is expected. Two routes give OSWorld's score (see docs/osworld.md):

- **native**: our own functions, each parity-tested against OSWorld's on fixtures, for the
  tasks whose every metric and getter has one (the demo's; no extra environment needed);
- **osworld**: OSWorld's own evaluator code in a warm worker process under its own
  interpreter (``osworld_bridge.py`` / ``osworld_worker.py``), for everything else.

``Evaluator`` picks the route per task (``evaluation.engine``); ``route_problem`` says up
front why a task cannot be scored. An unknown getter or metric raises
``UnsupportedEvaluator``: the episode is then an infrastructure error, never a silent 0.
Native getters reach the desktop only through ``cua_rollout.envs.contract.DesktopProbe``; a
metric reads only files of this evaluation or of the cache (``EvalContext.readable_roots``).
Metrics never run on the event loop (a thread, or the worker process).
"""

from __future__ import annotations

import asyncio
import os
import shutil
import tempfile
from collections.abc import Awaitable, Iterator, Mapping
from pathlib import Path
from typing import Any, Literal, NamedTuple

from cua_rollout.core.errors import (
    EvaluationError,
    EvaluatorRaised,
    RolloutError,
    UnsupportedEvaluator,
)
from cua_rollout.core.types import FAIL, is_infeasible
from cua_rollout.envs.contract import DesktopProbe
from cua_rollout.evaluation.getters import GETTERS, EvalContext, local_file
from cua_rollout.evaluation.metrics import METRICS, Metric, check_list, compare_text_file
from cua_rollout.evaluation.osworld_bridge import Catalog, OSWorldBridge

__all__ = ["GETTERS", "METRICS", "Evaluator", "Problem", "Route", "evaluate",
           "evaluator_functions", "route_problem"]

Route = Literal["native", "osworld"]

# How many of a metric's first arguments (result, expected) are paths of files it reads. A
# ``rule`` getter hands a metric any string the task holds: it must not name a file of this
# host outside the evaluation's own (``/proc/self/environ``, a key), or the score becomes an
# oracle on that file.
_FILE_ARGUMENTS: dict[Metric, int] = {compare_text_file: 2, check_list: 1}


def evaluator_functions(spec: Mapping[str, Any]) -> tuple[list[Any], list[Any]]:
    """The metric names and getter types an ``evaluator`` block names (as written: a
    malformed entry is returned as is, for the caller to report)."""
    funcs = spec.get("func")
    metrics = list(funcs) if isinstance(funcs, list) else [funcs]
    getters: list[Any] = []
    for key in ("result", "expected"):
        value = spec.get(key)
        for cfg in value if isinstance(value, list) else [value]:
            if cfg:
                getters.append(cfg.get("type") if isinstance(cfg, Mapping) else cfg)
    return metrics, getters


class Problem(NamedTuple):
    """Why part of a task cannot run: ``key`` names the part ("metric:NAME",
    "getter:NAME", "setup:TYPE", "app:NAME", "evaluator"), ``message`` the reason."""

    key: str
    message: str

    def __str__(self) -> str:
        return f"{self.key}: {self.message}"


def route_problem(spec: Any, engine: str, catalog: Catalog | None
                  ) -> tuple[Route | None, list[Problem]]:
    """Which route scores this evaluator block under ``engine``, or the problems that leave
    it none: ``(route, [])`` or ``(None, [Problem, ...])``. ``catalog`` is what OSWorld's
    evaluator environment offers (None: there is none, or it was not asked yet)."""
    if not isinstance(spec, Mapping) or "func" not in spec:
        return None, [Problem("evaluator", "missing, or without a 'func'")]
    if spec.get("func") == "infeasible":
        return "native", []
    metrics, getters = evaluator_functions(spec)
    lacking = [f"metric:{m}" for m in metrics if not isinstance(m, str) or m not in METRICS]
    lacking += [f"getter:{g}" for g in getters if not isinstance(g, str) or g not in GETTERS]
    if engine != "osworld" and not lacking:
        return "native", []
    if engine == "native":
        return None, [Problem(k, "no native implementation (evaluation.engine is 'native')")
                      for k in lacking]
    if catalog is None:
        return None, [Problem(k, "needs OSWorld's evaluator environment, which is not set up "
                              "(scripts/setup_env.sh --osworld, or evaluation.osworld_python)")
                      for k in lacking or [f"metric:{m}" for m in metrics]]
    problems = [Problem(f"metric:{m}", why) for m in metrics
                if (why := catalog.problem("metric", str(m)))]
    problems += [Problem(f"getter:{g}", why) for g in getters
                 if (why := catalog.problem("getter", str(g)))]
    return (None, problems) if problems else ("osworld", [])


class Evaluator:
    """Scores episodes for one process (a runner): native functions in a thread, OSWorld's
    in a warm worker started on first need (``OSWorldBridge``). ``downloads`` fetches
    ``cloud_file`` getters' files into the shared cache."""

    def __init__(self, cache_dir: Path, engine: str = "auto",
                 bridge: OSWorldBridge | None = None, downloads: Any = None) -> None:
        self.cache_dir = Path(cache_dir)
        self.engine = engine
        self.bridge = bridge
        self.downloads = downloads
        self._catalog: Catalog | None = None

    @classmethod
    def from_config(cls, cfg: Any) -> Evaluator:
        """From a whole ``Config`` (``desktops`` for the cache, ``evaluation``)."""
        from cua_rollout.envs.downloads import download_cache

        bridge = (OSWorldBridge.from_config(cfg.evaluation)
                  if cfg.evaluation.engine != "native" else None)
        return cls(cfg.desktops.download_cache_dir, cfg.evaluation.engine, bridge,
                   download_cache(cfg.desktops))

    async def route(self, spec: Mapping[str, Any]) -> Route:
        """The route of this evaluator block; ``UnsupportedEvaluator`` naming what is
        missing when it has none."""
        route, problems = route_problem(spec, self.engine, None)
        if route is None and self.bridge is not None and self.engine != "native":
            if self._catalog is None:
                self._catalog = await self.bridge.catalog()
            route, problems = route_problem(spec, self.engine, self._catalog)
        if route is None:
            raise UnsupportedEvaluator("; ".join(map(str, problems)))
        return route

    async def evaluate(self, probe: DesktopProbe, task: Mapping[str, Any],
                       last_action: str | None, *, task_id: str | None = None) -> float:
        """The episode's reward in [0, 1] by OSWorld's rules (see ``evaluate``)."""
        return await evaluate(probe, task, last_action, cache_dir=self.cache_dir,
                              task_id=task_id, evaluator=self)

    async def _osworld(self, probe: DesktopProbe, spec: Mapping[str, Any], scratch: Path,
                       task_id: str | None) -> float:
        assert self.bridge is not None
        address = getattr(probe, "address", None)
        desktop = address() if callable(address) else None
        if desktop is None:
            raise UnsupportedEvaluator(
                f"{type(probe).__name__} has no URL for OSWorld's evaluator code to reach")
        await self._prefetch(spec, scratch, task_id)
        return await self.bridge.evaluate(spec, desktop, scratch)

    async def _prefetch(self, spec: Mapping[str, Any], scratch: Path,
                        task_id: str | None) -> None:
        """Files of ``cloud_file`` getters, from the shared cache (fetched once per host),
        put where OSWorld's getter looks before it downloads: ``<cache_dir>/<dest>``."""
        for url, dest in _cloud_files(spec):
            await self.place_cloud_file(url, dest, scratch, task_id)

    async def place_cloud_file(self, url: str, dest: str, scratch: Path,
                               task_id: str | None) -> Path:
        target = local_file(scratch / dest, [scratch], "cloud_file dest")
        if self.downloads is None:
            raise UnsupportedEvaluator(f"cloud_file {url}: no download cache configured")
        cached = await self.downloads.fetch(url, os.path.basename(dest), task_id)
        await asyncio.to_thread(_link_or_copy, Path(cached), target)
        return target

    async def close(self) -> None:
        if self.bridge is not None:
            await self.bridge.close()


def _cloud_files(spec: Mapping[str, Any]) -> Iterator[tuple[str, str]]:
    for key in ("result", "expected"):
        value = spec.get(key)
        for cfg in value if isinstance(value, list) else [value]:
            if isinstance(cfg, Mapping) and cfg.get("type") == "cloud_file":
                paths, dests = cfg.get("path"), cfg.get("dest")
                if cfg.get("multi"):
                    yield from zip(paths or [], dests or [], strict=False)
                else:
                    yield str(paths), str(dests)


def _write_task_cache(files: Mapping[str, str], scratch: Path) -> None:
    """The files the task's setup saved (``execute`` with ``stdout``/``stderr``), written into
    this evaluation's cache directory."""
    for name, text in files.items():
        target = local_file(scratch / name, [scratch], "setup output")
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(text, encoding="utf-8")


def _link_or_copy(source: Path, target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.link(source, target)
    except OSError:
        shutil.copyfile(source, target)


async def evaluate(
    probe: DesktopProbe,
    task: Mapping[str, Any],
    last_action: str | None,
    *,
    cache_dir: Path,
    task_id: str | None = None,
    evaluator: Evaluator | None = None,
) -> float:
    """The episode's reward in [0, 1].

    Runs ``postconfig``; ``infeasible`` scores 1 only when the agent gave up (``FAIL``);
    otherwise a final ``FAIL`` scores 0, else each metric compares the ``result`` getter's
    value with the ``expected`` one; a list of metrics combines with ``conj`` ("and": mean,
    short-circuit on 0; "or": max). ``cache_dir`` holds files the task ships (``cache_file``
    getter) under ``<cache_dir>/<task_id>/``. Without ``evaluator`` only the native route
    exists; with one, its route (decided before any desktop call).
    """
    spec = task.get("evaluator")
    if not isinstance(spec, Mapping) or "func" not in spec:
        raise UnsupportedEvaluator(f"task {task.get('id')!r} has no evaluator with a 'func'")
    if evaluator is not None:
        route = await evaluator.route(spec)
    else:
        route, problems = route_problem(spec, "native", None)
        if route is None:
            raise UnsupportedEvaluator("; ".join(map(str, problems)))
    for index, step in enumerate(spec.get("postconfig") or []):
        await probe.run_setup_step(step, index)

    if is_infeasible(task):
        return 1.0 if last_action == FAIL else 0.0
    if last_action == FAIL:
        return 0.0

    # Files fetched for this evaluation live in a directory of its own, removed afterwards:
    # two rollouts of one task scored at once must not overwrite each other's files. It is
    # the task's cache as OSWorld's getters see it: what the setup saved there goes first.
    with tempfile.TemporaryDirectory(prefix="cua-eval-") as scratch:
        await asyncio.to_thread(_write_task_cache, getattr(probe, "task_cache", None) or {},
                                Path(scratch))
        if route == "osworld":
            assert evaluator is not None
            return await evaluator._osworld(probe, spec, Path(scratch), task_id)
        ctx = EvalContext(probe, Path(cache_dir), task_id, Path(scratch), evaluator)
        return await _score(ctx, spec, spec["func"])


async def _score(ctx: EvalContext, spec: Mapping[str, Any], funcs: Any) -> float:
    many = isinstance(funcs, list)
    names = funcs if many else [funcs]
    results = _as_list(spec.get("result"), len(names), many)
    expecteds = _as_list(spec.get("expected"), len(names), many)
    options = _as_list(spec.get("options"), len(names), many)
    metrics = [_metric(name) for name in names]  # fail on an unknown name before any I/O
    conj = spec.get("conj", "and")
    if conj not in ("and", "or"):
        raise UnsupportedEvaluator(f"evaluator conj {conj!r} (expected 'and' or 'or')")

    scores: list[float] = []
    result: Any = _UNBOUND
    for name, metric, result_cfg, expected_cfg, opts in zip(
        names, metrics, results, expecteds, options, strict=True
    ):
        # OSWorld: a result getter's FileNotFoundError scores 0 (under "or", the previous
        # metric's result is used again; on the first one OSWorld fails).
        try:
            result = await _raised_on_input(_get(ctx, result_cfg), f"getter {_kind(result_cfg)}"
                                            ) if result_cfg else None
        except FileNotFoundError:
            if not many or conj == "and":
                return 0.0
            if result is _UNBOUND:
                raise EvaluationError("the first result getter raised FileNotFoundError "
                                      "under conj 'or' (OSWorld: UnboundLocalError)") from None
        args = [result]
        if expected_cfg:
            args.append(await _raised_on_input(_get(ctx, expected_cfg),
                                               f"getter {_kind(expected_cfg)}"))
        for path in args[: _FILE_ARGUMENTS.get(metric, 0)]:
            if isinstance(path, str) and path:
                local_file(path, ctx.readable_roots(), f"metric {name}")
        # Metrics read files: off the event loop.
        score = float(await _raised_on_input(
            asyncio.to_thread(metric, *args, **(opts or {})), f"metric {name}"))
        scores.append(score)
        if conj == "and" and score == 0.0:
            return 0.0
        if conj == "or" and score == 1.0:
            return 1.0
    return sum(scores) / len(scores) if conj == "and" else max(scores)


_UNBOUND = object()


async def _raised_on_input(call: Awaitable[Any], what: str) -> Any:
    """Await a getter or a metric: an exception of its own (not one of ours: a desktop that
    did not answer, an unsupported evaluator; not FileNotFoundError, which OSWorld scores 0)
    was raised on what the agent left, and becomes ``EvaluatorRaised``."""
    try:
        return await call
    except (RolloutError, FileNotFoundError):
        raise
    except Exception as exc:
        raise EvaluatorRaised(f"{what} raised {type(exc).__name__}: {exc}") from exc


def _kind(cfg: Any) -> str:
    return str(cfg.get("type")) if isinstance(cfg, Mapping) else repr(cfg)


def _as_list(value: Any, n: int, many: bool) -> list[Any]:
    if not many:
        return [value]
    if value is None:
        return [None] * n
    if not isinstance(value, list) or len(value) != n:
        raise UnsupportedEvaluator(f"evaluator has {n} funcs but {value!r} does not match")
    return value


def _metric(name: Any) -> Metric:
    metric = METRICS.get(name) if isinstance(name, str) else None
    if metric is None:
        raise UnsupportedEvaluator(
            f"evaluator metric {name!r} is not supported (known: {', '.join(sorted(METRICS))})"
        )
    return metric


async def _get(ctx: EvalContext, cfg: Mapping[str, Any]) -> Any:
    kind = cfg.get("type") if isinstance(cfg, Mapping) else None
    getter = GETTERS.get(kind) if isinstance(kind, str) else None
    if getter is None:
        raise UnsupportedEvaluator(
            f"evaluator getter {kind!r} is not supported (known: {', '.join(sorted(GETTERS))})"
        )
    return await getter(ctx, cfg)
