"""Scoring an episode from its task's ``evaluator`` block, with OSWorld's rules.

Getters (``getters.py``) fetch a state from the desktop (a file, a command's output, the
accessibility tree) or from the task (rules, cached files); metrics (``metrics.py``) compare
it with what is expected. An unknown getter or metric raises ``UnsupportedEvaluator``: the
episode is then an infrastructure error, never a silent 0. The desktop is reached only
through ``rollout.envs.contract.DesktopProbe``. A metric reads only files of this evaluation
or of the task's cache (``EvalContext.readable_roots``), whatever path the task gives it.
"""

from __future__ import annotations

import asyncio
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from rollout.envs.contract import FAIL, DesktopProbe
from rollout.errors import UnsupportedEvaluator
from rollout.evaluation.getters import GETTERS, EvalContext, local_file
from rollout.evaluation.metrics import METRICS, Metric, check_list, compare_text_file
from rollout.types import is_infeasible

__all__ = ["GETTERS", "METRICS", "evaluate"]

# How many of a metric's first arguments (result, expected) are paths of files it reads. A
# ``rule`` getter hands a metric any string the task holds: it must not name a file of this
# host outside the evaluation's own (``/proc/self/environ``, a key), or the score becomes an
# oracle on that file.
_FILE_ARGUMENTS: dict[Metric, int] = {compare_text_file: 2, check_list: 1}


async def evaluate(
    probe: DesktopProbe,
    task: Mapping[str, Any],
    last_action: str | None,
    *,
    cache_dir: Path,
    task_id: str | None = None,
) -> float:
    """The episode's reward in [0, 1].

    Runs ``postconfig``; ``infeasible`` scores 1 only when the agent gave up (``FAIL``);
    otherwise a final ``FAIL`` scores 0, else each metric compares the ``result`` getter's
    value with the ``expected`` one; a list of metrics combines with ``conj`` ("and": mean,
    short-circuit on 0; "or": max). ``cache_dir`` holds files the task ships (``cache_file``
    getter) under ``<cache_dir>/<task_id>/``.
    """
    spec = task.get("evaluator")
    if not isinstance(spec, Mapping) or "func" not in spec:
        raise UnsupportedEvaluator(f"task {task.get('id')!r} has no evaluator with a 'func'")
    for index, step in enumerate(spec.get("postconfig") or []):
        await probe.run_setup_step(step, index)

    if is_infeasible(task):
        return 1.0 if last_action == FAIL else 0.0
    if last_action == FAIL:
        return 0.0

    # Files fetched for this evaluation live in a directory of its own, removed afterwards:
    # two rollouts of one task scored at once must not overwrite each other's files.
    with tempfile.TemporaryDirectory(prefix="cua-eval-") as scratch:
        ctx = EvalContext(probe, Path(cache_dir), task_id, Path(scratch))
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
    for name, metric, result_cfg, expected_cfg, opts in zip(
        names, metrics, results, expecteds, options, strict=True
    ):
        result = await _get(ctx, result_cfg) if result_cfg else None
        args = [result]
        if expected_cfg:
            args.append(await _get(ctx, expected_cfg))
        for path in args[: _FILE_ARGUMENTS.get(metric, 0)]:
            if isinstance(path, str) and path:
                local_file(path, ctx.readable_roots(), f"metric {name}")
        # Metrics read files: off the event loop.
        score = float(await asyncio.to_thread(metric, *args, **(opts or {})))
        scores.append(score)
        if conj == "and" and score == 0.0:
            return 0.0
        if conj == "or" and score == 1.0:
            return 1.0
    return sum(scores) / len(scores) if conj == "and" else max(scores)


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
