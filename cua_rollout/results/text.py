"""Text benchmarks' figures (math, py, rag, web episodes): the score per benchmark, per mode,
per metric and overall, as the seeds' benchmark reports it (the mean of the answer metric),
except that every episode with a final result counts: an ``infra_error`` episode (or one with
no answer) counts as 0, where the original silently dropped failed items from the average.
Cancelled episodes (never final) are left out.

``text_summary(episodes)`` returns None for a run without text episodes, else (schema of
show_result's ``text`` section):

  {"rows": {"benchmarks": {name: ROW}, "modes": {mode: ROW}, "metrics": {metric: ROW},
            "all": ROW}}
  ROW: {"episodes": int, "score": float | null, "scored_episodes": int,
        "success": int, "infra_errors": int, "answered": int,
        "mean_turns": float | null, "tool_calls_per_episode": float | null,
        "tool_errors": int, "malformed_calls": int, "unknown_tools": int,
        "modes": [str], "metrics": {metric: episodes}}

``score``: mean reward over ``episodes`` (infra errors as 0); ``answered``: episodes whose
agent gave a final answer. A benchmark whose items name other metrics lists each.
"""

from __future__ import annotations

import statistics
import sys
from collections import Counter
from collections.abc import Iterable, Iterator
from typing import Any

from cua_rollout.results.cli import fmt_float, fmt_rate
from cua_rollout.results.runs import Episode

__all__ = ["labelled_rows", "print_text_table", "text_summary"]

_FINAL_EXCLUDED = ("cancelled",)


def _text(e: Episode) -> dict[str, Any] | None:
    text = e.record.get("text")
    return text if isinstance(text, dict) else None


def _row(episodes: list[Episode]) -> dict[str, Any]:
    texts = [_text(e) or {} for e in episodes]
    rewards = [float(e.reward) if e.status != "infra_error" and e.reward is not None else 0.0
               for e in episodes]
    turns = [t["turns"] for t in texts if isinstance(t.get("turns"), int)]
    calls = [t.get("tool_calls", 0) for t in texts]
    return {
        "episodes": len(episodes),
        "score": statistics.fmean(rewards) if rewards else None,
        "scored_episodes": sum(1 for e in episodes if e.scored),
        "success": sum(1 for e in episodes if e.status == "success"),
        "infra_errors": sum(1 for e in episodes if e.status == "infra_error"),
        "answered": sum(1 for t in texts if t.get("answer") is not None),
        "mean_turns": statistics.fmean(turns) if turns else None,
        "tool_calls_per_episode": statistics.fmean(calls) if calls else None,
        "tool_errors": sum(int(t.get("tool_errors", 0)) for t in texts),
        "malformed_calls": sum(int(t.get("malformed_calls", 0)) for t in texts),
        "unknown_tools": sum(int(t.get("unknown_tools", 0)) for t in texts),
        "modes": sorted({str(t["mode"]) for t in texts if t.get("mode")}),
        "metrics": dict(sorted(Counter(str(t["metric"]) for t in texts
                                       if t.get("metric")).items())),
    }


def text_summary(episodes: Iterable[Episode]) -> dict[str, Any] | None:
    """The text section of a run's summary (module docstring), or None without text
    episodes."""
    final = [e for e in episodes if _text(e) is not None and e.status not in _FINAL_EXCLUDED]
    if not final:
        return None

    def by(key: str) -> dict[str, dict[str, Any]]:
        groups: dict[str, list[Episode]] = {}
        for e in final:
            groups.setdefault(str((_text(e) or {}).get(key) or "?"), []).append(e)
        return {name: _row(members) for name, members in sorted(groups.items())}

    benchmarks: dict[str, list[Episode]] = {}
    for e in final:
        benchmarks.setdefault(e.domain, []).append(e)
    return {"rows": {
        "benchmarks": {name: _row(members) for name, members in sorted(benchmarks.items())},
        "modes": by("mode"),
        "metrics": by("metric"),
        "all": _row(final),
    }}


def labelled_rows(rows: dict[str, Any]
                  ) -> Iterator[tuple[str, dict[str, Any] | None, str | None]]:
    """The rows of a text section in the tables' order, as (label, row, style): each
    benchmark, then ``mode M`` and ``metric X``, then ``all``; a row of None is a section
    break."""
    for name, row in rows["benchmarks"].items():
        yield name, row, None
    yield "", None, None
    for name, row in rows["modes"].items():
        yield f"mode {name}", row, "cyan"
    for name, row in rows["metrics"].items():
        yield f"metric {name}", row, "magenta"
    yield "", None, None
    yield "all", rows["all"], "bold"


def print_text_table(section: dict[str, Any], title: str = "text benchmarks") -> None:
    """The text section as a table: a row per benchmark, per mode, per metric, and all."""
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    table = Table(title=title, title_justify="left")
    for header, justify in (("benchmark", "left"), ("mode", "left"), ("metric", "left"),
                            ("episodes", "right"), ("score", "right"), ("success", "right"),
                            ("answered", "right"), ("infra", "right"), ("turns", "right"),
                            ("tools/ep", "right"), ("err/malf/unk", "right")):
        table.add_column(header, justify=justify)  # type: ignore[arg-type]

    def add(name: str, row: dict[str, Any], style: str | None = None) -> None:
        metrics = row["metrics"]
        modes = row["modes"]
        table.add_row(Text(name), Text(modes[0] if len(modes) == 1 else f"{len(modes)} modes"),
                      Text(next(iter(metrics)) if len(metrics) == 1
                           else f"{len(metrics)} metrics"),
                      str(row["episodes"]), fmt_rate(row["score"]), str(row["success"]),
                      str(row["answered"]), str(row["infra_errors"]),
                      fmt_float(row["mean_turns"]), fmt_float(row["tool_calls_per_episode"]),
                      f"{row['tool_errors']}/{row['malformed_calls']}/{row['unknown_tools']}",
                      style=style)

    for label, row, style in labelled_rows(section["rows"]):
        if row is None:
            table.add_section()
        else:
            add(label, row, style)
    console = Console() if sys.stdout.isatty() else Console(width=160)
    console.print(table)
    console.print("score: the mean of the answer metric over every final episode (an infra "
                  "error or a missing answer counts 0); success: episodes scoring 1.0; "
                  "answered: episodes with a final answer; tools/ep: tool calls per episode; "
                  "err/malf/unk: calls a tool refused, with arguments that were not a JSON "
                  "object, of a tool that does not exist.",
                  markup=False, highlight=False)
