"""OSWorld's metrics: each compares what a getter fetched with what is expected and returns
a score in [0, 1]. Plain functions (file reads included): ``evaluate`` runs them in a thread,
off the runner's event loop. ``METRICS`` maps the names task files use to them."""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["METRICS", "Metric", "check_include_exclude", "check_list", "compare_text_file",
           "exact_match", "infeasible", "is_in_list"]

Metric = Callable[..., float]


def exact_match(result: Any, rules: Mapping[str, Any]) -> float:
    return 1.0 if result == rules["expected"] else 0.0


def check_include_exclude(result: Any, rules: Mapping[str, Any]) -> float:
    """Every ``include`` item is ``in`` the result and no ``exclude`` item is (substrings
    of a string, members of a list: Python's ``in``, as OSWorld's)."""
    if result is None:
        return 0.0
    include = rules.get("include", [])
    exclude = rules.get("exclude", [])
    ok = all(r in result for r in include) and all(r not in result for r in exclude)
    return 1.0 if ok else 0.0


def compare_text_file(actual: str | None, expected: str, **options: Any) -> float:
    """Two text files are equal; ``ignore_blanks`` folds whitespace runs to one space,
    ``ignore_case`` compares lower-cased. Files are read strictly as text (a file that is
    not valid in the locale's encoding raises, as in OSWorld)."""
    if not actual:
        return 0.0
    with open(actual) as f1:
        a = f1.read()
    with open(expected) as f2:
        b = f2.read()
    if options.get("ignore_blanks", False):
        a = re.sub(r"\s+", " ", re.sub(r"[\t\n]", " ", a).strip())
        b = re.sub(r"\s+", " ", re.sub(r"[\t\n]", " ", b).strip())
    if options.get("ignore_case", False):
        a, b = a.lower(), b.lower()
    return 1.0 if a == b else 0.0


def check_list(result: str | None, rules: Mapping[str, Any]) -> float:
    """Each ``expect`` regex matches some line of the file; no ``unexpect`` regex matches
    any line."""
    if result is None:
        return 0.0
    expect = [re.compile(p) for p in rules.get("expect", [])]
    unexpect = [re.compile(p) for p in rules.get("unexpect", [])]
    found = [False] * len(expect)
    clean = True
    with open(result) as f:
        for line in f:
            for i, pattern in enumerate(expect):
                found[i] = found[i] or pattern.search(line) is not None
            clean = clean and all(p.search(line) is None for p in unexpect)
    return float(all(found) and clean)


def is_in_list(result: Any, rules: Mapping[str, Any]) -> float:
    """The expected value is ``in`` the result (a None result raises, as in OSWorld)."""
    return 1.0 if rules["expected"] in result else 0.0


def infeasible(*_: Any, **__: Any) -> float:
    """Handled before any metric runs (see ``evaluate``); never scores by itself."""
    return 0.0


# Every function here gives OSWorld's result on the same input (and raises where OSWorld's
# raises): tests/integration/test_osworld_parity.py runs both on the same fixtures.
METRICS: dict[str, Metric] = {
    "exact_match": exact_match,
    "check_include_exclude": check_include_exclude,
    "compare_text_file": compare_text_file,
    "check_list": check_list,
    "is_in_list": is_in_list,
    "infeasible": infeasible,
}
