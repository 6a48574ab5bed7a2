"""Scoring an episode from its task's ``evaluator`` block, with OSWorld's rules.

Getters fetch a state from the desktop (a file, a command's output, the accessibility tree)
or from the task (rules, cached files); metrics compare it with what is expected. An unknown
getter or metric raises ``UnsupportedEvaluator``: the episode is then an infrastructure
error, never a silent 0.
"""

from __future__ import annotations

import contextvars
import difflib
import os
import re
import tempfile
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rollout.errors import UnsupportedEvaluator
from ui_tars_utils import FAIL

if TYPE_CHECKING:
    from env_k8s import RemoteDesktopEnv

Getter = Callable[["RemoteDesktopEnv", Mapping[str, Any]], Awaitable[Any]]
Metric = Callable[..., float]


async def evaluate(
    env: RemoteDesktopEnv, task: Mapping[str, Any], last_action: str | None
) -> float:
    """The episode's reward in [0, 1].

    Runs ``postconfig``; ``infeasible`` scores 1 only when the agent gave up (``FAIL``);
    otherwise a final ``FAIL`` scores 0, else each metric compares the ``result`` getter's
    value with the ``expected`` one; a list of metrics combines with ``conj`` ("and": mean,
    short-circuit on 0; "or": max).
    """
    spec = task.get("evaluator")
    if not isinstance(spec, Mapping) or "func" not in spec:
        raise UnsupportedEvaluator(f"task {task.get('id')!r} has no evaluator with a 'func'")
    for index, step in enumerate(spec.get("postconfig") or []):
        await env.run_setup_step(step, index)

    funcs = spec["func"]
    if funcs == "infeasible" or (isinstance(funcs, list) and funcs == ["infeasible"]):
        return 1.0 if last_action == FAIL else 0.0
    if last_action == FAIL:
        return 0.0

    # Files fetched for this evaluation live in a directory of its own, removed afterwards:
    # two rollouts of one task scored at once must not overwrite each other's files.
    with tempfile.TemporaryDirectory(prefix="cua-eval-") as scratch:
        token = _SCRATCH.set(Path(scratch))
        try:
            return await _score(env, spec, funcs)
        finally:
            _SCRATCH.reset(token)


async def _score(env: RemoteDesktopEnv, spec: Mapping[str, Any], funcs: Any) -> float:
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
    for metric, result_cfg, expected_cfg, opts in zip(
        metrics, results, expecteds, options, strict=True
    ):
        result = await _get(env, result_cfg) if result_cfg else None
        args = [result]
        if expected_cfg:
            args.append(await _get(env, expected_cfg))
        score = float(metric(*args, **(opts or {})))
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


async def _get(env: RemoteDesktopEnv, cfg: Mapping[str, Any]) -> Any:
    kind = cfg.get("type") if isinstance(cfg, Mapping) else None
    getter = GETTERS.get(kind) if isinstance(kind, str) else None
    if getter is None:
        raise UnsupportedEvaluator(
            f"evaluator getter {kind!r} is not supported (known: {', '.join(sorted(GETTERS))})"
        )
    return await getter(env, cfg)


# --------------------------------------------------------------------------- getters


_SCRATCH: contextvars.ContextVar[Path] = contextvars.ContextVar("evaluation_scratch_dir")


async def get_vm_file(env: RemoteDesktopEnv, cfg: Mapping[str, Any]) -> Any:
    """Files from the desktop, saved locally; returns the local path (None if missing).
    ``multi: true`` takes lists ``path``/``dest`` and returns a list."""
    if cfg.get("multi"):
        pairs = list(zip(cfg["path"], cfg["dest"], strict=True))
    else:
        pairs = [(cfg["path"], cfg.get("dest") or os.path.basename(cfg["path"]))]
    out: list[str | None] = []
    for remote, dest in pairs:
        data = await env.get_file(remote)
        if data is None:
            out.append(None)
            continue
        local = _SCRATCH.get() / os.path.basename(dest)
        local.write_bytes(data)
        out.append(str(local))
    return out if cfg.get("multi") else out[0]


async def get_vm_command_line(env: RemoteDesktopEnv, cfg: Mapping[str, Any]) -> str:
    """The standard output of a command run on the desktop."""
    reply = await env.execute(cfg["command"], shell=bool(cfg.get("shell", False)))
    return str(reply.get("output") or "")


async def get_vm_terminal_output(env: RemoteDesktopEnv, cfg: Mapping[str, Any]) -> str:
    return await env.terminal_output()


async def get_accessibility_tree(env: RemoteDesktopEnv, cfg: Mapping[str, Any]) -> str:
    return await env.accessibility_tree()


async def get_rule(env: RemoteDesktopEnv, cfg: Mapping[str, Any]) -> Any:
    return cfg["rules"]


async def get_cache_file(env: RemoteDesktopEnv, cfg: Mapping[str, Any]) -> str:
    """A file the task ships (expected outputs), under ``desktops.download_cache_dir``."""
    root = Path(env.cfg.download_cache_dir)
    for candidate in (root / (env.task_id or "") / cfg["path"], root / cfg["path"]):
        if candidate.is_file():
            return str(candidate)
    raise UnsupportedEvaluator(f"cache_file {cfg['path']!r} is not in {root}")


GETTERS: dict[str, Getter] = {
    "vm_file": get_vm_file,
    "vm_command_line": get_vm_command_line,
    "vm_terminal_output": get_vm_terminal_output,
    "accessibility_tree": get_accessibility_tree,
    "rule": get_rule,
    "cache_file": get_cache_file,
}


# --------------------------------------------------------------------------- metrics


def exact_match(result: Any, rules: Mapping[str, Any]) -> float:
    return 1.0 if result == rules["expected"] else 0.0


def check_include_exclude(result: Any, rules: Mapping[str, Any]) -> float:
    """Every ``include`` string is in the result and no ``exclude`` string is."""
    if result is None:
        return 0.0
    text = str(result)
    include = rules.get("include", [])
    exclude = rules.get("exclude", [])
    ok = all(s in text for s in include) and not any(s in text for s in exclude)
    return 1.0 if ok else 0.0


def compare_text_file(
    actual: str | None, expected: str | None, ignore_blanks: bool = False,
    ignore_case: bool = False,
) -> float:
    """Two text files are equal (optionally ignoring whitespace and case)."""
    if not actual or not expected:
        return 0.0
    a = Path(actual).read_text(errors="replace")
    b = Path(expected).read_text(errors="replace")
    if ignore_blanks:
        a, b = re.sub(r"\s+", " ", a).strip(), re.sub(r"\s+", " ", b).strip()
    if ignore_case:
        a, b = a.lower(), b.lower()
    return 1.0 if a == b else 0.0


def check_list(result: str | None, rules: Mapping[str, Any]) -> float:
    """Each ``expect`` regex matches some line of the file; no ``unexpect`` regex matches
    any line."""
    if not result:
        return 0.0
    expect = [re.compile(p) for p in rules.get("expect", [])]
    unexpect = [re.compile(p) for p in rules.get("unexpect", [])]
    found = [False] * len(expect)
    with open(result, errors="replace") as f:
        for line in f:
            for i, pattern in enumerate(expect):
                found[i] = found[i] or pattern.search(line) is not None
            if any(p.search(line) for p in unexpect):
                return 0.0
    return 1.0 if all(found) else 0.0


def is_in_list(result: Any, rules: Mapping[str, Any]) -> float:
    """The expected value is one of the result's items."""
    if result is None:
        return 0.0
    return 1.0 if rules["expected"] in result else 0.0


def fuzzy_match(result: Any, rules: Mapping[str, Any]) -> float:
    """Similarity in [0, 1] of the result to the expected text (matching-blocks ratio)."""
    if result is None:
        return 0.0
    return difflib.SequenceMatcher(None, str(result), str(rules["expected"])).ratio()


def infeasible(*_: Any, **__: Any) -> float:
    """Handled before any metric runs (see ``evaluate``); never scores by itself."""
    return 0.0


METRICS: dict[str, Metric] = {
    "exact_match": exact_match,
    "check_include_exclude": check_include_exclude,
    "compare_text_file": compare_text_file,
    "check_list": check_list,
    "is_in_list": is_in_list,
    "fuzzy_match": fuzzy_match,
    "infeasible": infeasible,
}
