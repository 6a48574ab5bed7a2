"""Text benchmark items as the service's tasks.

A benchmark file (the seeds' format) is a JSON list or a JSONL file of items
``{"id", "question", "answer", "metadata"}``; ``answer`` is a string, a number or a list of
them (any one matches), ``metadata`` an optional object whose ``evaluation_metric`` overrides
the file's metric for that item. :func:`text_task` checks one item and turns it into the task
dict the loader hands out and the runner reads:

    {"id", "instruction": question, "question", "answer", "metadata",
     "mode": "math" | "py" | "rag" | "web", "benchmark": <name>,
     "metric": {"name", "variant", "tolerance"}}

``instruction`` is the question, so everything that shows a task (progress, results, the
trainer's rows) reads text tasks as it reads desktop tasks. The mode is what the runner
dispatches on (``is_text_task``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from cua_rollout.config import TEXT_MODES
from cua_rollout.text.metrics import METRICS, VARIANTS, resolve_metric

__all__ = ["ItemProblem", "is_text_task", "task_metric", "text_task"]


class ItemProblem(ValueError):
    """An item that cannot be a task: ``field`` is the key at fault (None: the whole item)."""

    def __init__(self, field: str | None, message: str) -> None:
        super().__init__(message)
        self.field = field
        self.message = message


def _answer_problem(answer: Any) -> str | None:
    items = answer if isinstance(answer, list) else [answer]
    if not items:
        return "must not be an empty list"
    for item in items:
        if isinstance(item, bool) or not isinstance(item, str | int | float):
            return f"must be a string, a number or a list of them, got {answer!r:.80}"
    return None


def text_task(item: Any, *, mode: str, benchmark: str, metric: str, variant: str,
              tolerance: float) -> dict[str, Any]:
    """The task of one benchmark item; :class:`ItemProblem` names the field at fault. An id
    may be a string or an integer (kept as its string: it names the episode's directory)."""
    if mode not in TEXT_MODES:
        raise ValueError(f"unknown text mode {mode!r}; known: {', '.join(TEXT_MODES)}")
    if not isinstance(item, dict):
        raise ItemProblem(None, f"an item must be a JSON object, not {type(item).__name__}")
    if "id" not in item:
        raise ItemProblem("id", "missing")
    item_id = item["id"]
    if isinstance(item_id, bool) or not isinstance(item_id, str | int) or item_id == "":
        raise ItemProblem("id", f"must be a non-empty string or an integer, got {item_id!r}")
    question = item.get("question")
    if "question" not in item:
        raise ItemProblem("question", "missing")
    if not isinstance(question, str) or not question.strip():
        raise ItemProblem("question", f"must be a non-empty string, got {question!r:.80}")
    if "answer" not in item:
        raise ItemProblem("answer", "missing")
    if (bad := _answer_problem(item["answer"])) is not None:
        raise ItemProblem("answer", bad)
    metadata = item.get("metadata")
    if metadata is None:
        metadata = {}
    if not isinstance(metadata, dict):
        raise ItemProblem("metadata", f"must be an object, got {type(metadata).__name__}")
    try:
        item_metric = resolve_metric(metadata, metric, item_id=item_id)
    except ValueError as exc:
        raise ItemProblem("metadata.evaluation_metric", str(exc)) from None
    if variant not in VARIANTS:
        raise ValueError(f"unknown metric variant {variant!r}")
    return {
        "id": str(item_id),
        "instruction": question,
        "question": question,
        "answer": item["answer"],
        "metadata": metadata,
        "mode": mode,
        "benchmark": benchmark,
        "metric": {"name": item_metric, "variant": variant, "tolerance": tolerance},
    }


def is_text_task(task: Mapping[str, Any]) -> bool:
    """Whether a task runs in a text environment (else on a desktop)."""
    return task.get("mode") in TEXT_MODES


def task_metric(task: Mapping[str, Any]) -> tuple[str, str, float]:
    """A text task's (metric, variant, tolerance)."""
    spec = task.get("metric") or {}
    name = spec.get("name", "exact_match")
    if name not in METRICS:
        raise ValueError(f"task {task.get('id')!r}: unknown metric {name!r}")
    return name, spec.get("variant", "normalized"), float(spec.get("tolerance", 1e-6))
