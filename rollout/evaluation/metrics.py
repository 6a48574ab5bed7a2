"""OSWorld's metrics: each compares what a getter fetched with what is expected and returns
a score in [0, 1]. Plain functions (file reads included): ``evaluate`` runs them in a thread,
off the runner's event loop. ``METRICS`` maps the names task files use to them."""

from __future__ import annotations

import difflib
import re
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

__all__ = ["METRICS", "Metric", "check_include_exclude", "check_list", "compare_text_file",
           "exact_match", "fuzzy_match", "infeasible", "is_in_list"]

Metric = Callable[..., float]


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
