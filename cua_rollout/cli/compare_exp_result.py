"""What changed between two runs: the episodes (or, with ``--by task``, the tasks) whose
reward or status differs, both ways, written to a file (the fields: ``compare``'s docstring);
a summary on stdout, with the text benchmarks' scores A vs B and the text items whose score
changed when both runs have text episodes. --min-version / --exclude-mixed narrow both runs
by model version first. Exit codes: 0, 2 on bad usage (a --min-version that is not a version
of both runs too) or a RUN_DIR missing / not a directory."""

from __future__ import annotations

import argparse
import csv
import json
import statistics
import sys
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from cua_rollout.results import (
    Episode,
    Run,
    add_version_filters,
    compute_rates,
    describe_selection,
    fail,
    fmt_rate,
    k_label,
    open_run,
    results_parser,
    select_run,
    selection_json,
    summarize_tasks,
    version_order,
)
from cua_rollout.results.text import text_summary

__all__ = ["main"]

CHANGES = ("a_better", "b_better", "status_changed", "only_in_a", "only_in_b")
FIELDS = (
    "change", "key", "domain", "task_id", "rollout", "instruction",
    "status_a", "reward_a", "status_b", "reward_b", "delta",
)  # fmt: skip
# A text item's record also has these (CSV: columns after FIELDS when some change has them).
TEXT_FIELDS = ("metric", "answer_a", "answer_b")


@dataclass(frozen=True)
class Change:
    change: str
    key: str
    domain: str
    task_id: str
    rollout: int | None
    instruction: str
    status_a: str | None
    reward_a: float | None
    status_b: str | None
    reward_b: float | None
    delta: float | None
    text: dict[str, Any] | None = None  # a text item's TEXT_FIELDS


@dataclass(frozen=True)
class _Outcome:
    """What one run says about one key: its status and reward (None when unscored); for a
    text item, the reward is its score and ``text`` its metric and answer."""

    domain: str
    task_id: str
    rollout: int | None
    instruction: str
    status: str
    reward: float | None
    text: dict[str, Any] | None = None


def _text(e: Episode) -> dict[str, Any] | None:
    text = e.record.get("text")
    return text if isinstance(text, dict) else None


def _text_score(e: Episode) -> float | None:
    """A text episode's score, as in the text benchmarks' (cua_rollout/results/text.py): an
    infra error counts 0, a cancelled episode has none."""
    if e.status == "cancelled":
        return None
    return 0.0 if e.status == "infra_error" or e.reward is None else e.reward


def _by_episode(run: Run) -> dict[str, _Outcome]:
    outcomes = {}
    for e in run.episodes:
        text = _text(e)
        if text is None:
            outcome = _Outcome(e.domain, e.task_id, e.rollout, e.instruction, e.status, e.reward)
        else:
            outcome = _Outcome(e.domain, e.task_id, e.rollout, e.instruction, e.status,
                               _text_score(e), {"metric": text.get("metric"),
                                                "answer": text.get("answer")})  # fmt: skip
        outcomes[e.episode_id] = outcome
    return outcomes


def _by_task(run: Run) -> dict[str, _Outcome]:
    texts: dict[tuple[str, str], list[Episode]] = {}
    for e in run.episodes:
        if _text(e) is not None:
            texts.setdefault(e.task_key, []).append(e)
    outcomes = {}
    for (domain, task_id), task in summarize_tasks(run.episodes).items():
        status = "solved" if task.solved else "unsolved" if task.scored else "unscored"
        reward, text = task.mean_reward, None
        if (domain, task_id) in texts:
            members = texts[(domain, task_id)]
            scores = [s for s in map(_text_score, members) if s is not None]
            reward = statistics.fmean(scores) if scores else None
            metrics = sorted({str(m) for e in members if (m := (_text(e) or {}).get("metric"))})
            text = {"metric": ", ".join(metrics) or None, "answer": None}
        outcomes[f"{domain}/{task_id}"] = _Outcome(
            domain, task_id, None, task.instruction, status, reward, text
        )
    return outcomes


def compare(run_a: Run, run_b: Run, *, by: str = "episode") -> list[Change]:
    """Every key whose outcome differs between the runs, sorted by change then key.

    The kinds of change, each a record with the domain and instruction:
      a_better        both scored, A's reward is higher
      b_better        both scored, B's reward is higher
      status_changed  same reward (or one side unscored: infra_error, cancelled) but another
                      status, e.g. failure -> timeout or infra_error -> success
      only_in_a       finished in A only
      only_in_b       finished in B only
    ``by="episode"``: the key is domain/task_id/rollout. ``by="task"``: the reward is the
    mean over the task's scored rollouts and the status is "solved" (a reward of 1.0),
    "unsolved" or "unscored" (no scored rollout).

    A text item (math, py, rag, web: an episode whose result line has ``text``) is compared
    by its score, as the text benchmarks' score counts it (cua_rollout/results/text.py): the
    reward, 0 for an infra error (so infra_error -> success is b_better, delta 1.0), none for
    a cancelled episode; per task, the mean over its rollouts that are not cancelled.

    The file main() writes (``-o``: ``.csv`` for CSV, any other name JSON lines; default
    ``compare_<A>_vs_<B>.jsonl`` in the current directory, <A> and <B> the runs' directory
    names) holds one record per Change: {"change", "key", "domain", "task_id", "rollout"
    (null per task), "instruction", "status_a", "reward_a", "status_b", "reward_b", "delta"
    (reward_b - reward_a, null unless both scored)}, in this order; a text item's record
    then has "metric" (the answer metric; per task, its metrics joined by ", "), "answer_a"
    and "answer_b" (the final answers; null per task, and when the run has none).
    """
    outcomes = _by_task if by == "task" else _by_episode
    a, b = outcomes(run_a), outcomes(run_b)
    changes = []
    for key in sorted(a.keys() | b.keys()):
        oa, ob = a.get(key), b.get(key)
        if oa is None or ob is None:
            change = "only_in_b" if oa is None else "only_in_a"
        elif oa.reward is not None and ob.reward is not None and oa.reward != ob.reward:
            change = "a_better" if oa.reward > ob.reward else "b_better"
        elif oa.status != ob.status or oa.reward != ob.reward:
            change = "status_changed"
        else:
            continue
        either = oa if oa is not None else ob
        assert either is not None
        delta = None
        if oa is not None and ob is not None and oa.reward is not None and ob.reward is not None:
            delta = ob.reward - oa.reward
        text = None
        if (oa is not None and oa.text is not None) or (ob is not None and ob.text is not None):
            ta = (oa.text if oa is not None else None) or {}
            tb = (ob.text if ob is not None else None) or {}
            text = {"metric": ta.get("metric") or tb.get("metric"),
                    "answer_a": ta.get("answer"), "answer_b": tb.get("answer")}  # fmt: skip
        changes.append(
            Change(
                change=change,
                key=key,
                domain=either.domain,
                task_id=either.task_id,
                rollout=either.rollout,
                instruction=(oa and oa.instruction) or (ob and ob.instruction) or "",
                status_a=oa.status if oa else None,
                reward_a=oa.reward if oa else None,
                status_b=ob.status if ob else None,
                reward_b=ob.reward if ob else None,
                delta=delta,
                text=text,
            )
        )
    changes.sort(key=lambda c: (CHANGES.index(c.change), c.key))
    return changes


def _record(change: Change) -> dict[str, Any]:
    """A change as written: FIELDS, then a text item's TEXT_FIELDS."""
    record = asdict(change)
    text = record.pop("text")
    return record | text if text is not None else record


def write_changes(changes: list[Change], path: Path) -> None:
    if path.suffix.lower() == ".csv":
        fields = FIELDS + TEXT_FIELDS if any(c.text is not None for c in changes) else FIELDS
        with path.open("w", newline="", encoding="utf-8") as f:
            writer = csv.DictWriter(f, fieldnames=fields)
            writer.writeheader()
            for c in changes:
                writer.writerow({k: ("" if v is None else v) for k, v in _record(c).items()})
    else:
        with path.open("w", encoding="utf-8") as f:
            for c in changes:
                f.write(json.dumps(_record(c), ensure_ascii=False) + "\n")


def _print_summary(run_a: Run, run_b: Run, changes: list[Change], by: str) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console() if sys.stdout.isatty() else Console(width=140)
    counts = Counter(c.change for c in changes)
    console.print(f"A = {run_a.path}\nB = {run_b.path}", markup=False, highlight=False)
    table = Table()
    table.add_column("change")
    table.add_column(f"{by}s", justify="right")
    for name in CHANGES:
        table.add_row(name, str(counts.get(name, 0)))
    console.print(table)
    for name, run in (("A", run_a), ("B", run_b)):
        r = compute_rates(run.episodes)
        console.print(
            f"{name}: success {fmt_rate(r.success_rate)}, "
            f"avg@{k_label(r.to_json())} {fmt_rate(r.avg_at_k)}, "
            f"pass@{k_label(r.to_json())} {fmt_rate(r.pass_at_k)} "
            f"over {r.scored_episodes} scored episodes"
        )
        versions = version_order(run)
        if versions:
            shown = versions if len(versions) <= 4 else [*versions[:2], "...", versions[-1]]
            console.print(
                f"   model versions ({len(versions)}): {', '.join(shown)}; "
                f"mixed episodes: {r.mixed_episodes}",
                markup=False,
                highlight=False,
            )
        selected = describe_selection(selection_json(run))
        if selected is not None:
            console.print(f"   selected: {selected}", markup=False, highlight=False)
    better = [c for c in changes if c.change in ("a_better", "b_better")]
    for c in [c for c in better if c.text is None][:10]:
        console.print(
            f"  {c.change}: {c.key} {c.reward_a:.3g} -> {c.reward_b:.3g}  {c.instruction[:70]}",
            markup=False,
            highlight=False,
        )
    text_a, text_b = text_summary(run_a.episodes), text_summary(run_b.episodes)
    if text_a is not None and text_b is not None:
        _print_text_scores(console, text_a, text_b, [c for c in better if c.text is not None])


def _print_text_scores(console: Any, text_a: dict[str, Any], text_b: dict[str, Any],
                       changed: list[Change]) -> None:  # fmt: skip
    """The text benchmarks' scores A vs B (a row per benchmark, and all), then the text
    items whose score changed (the first 10), with their answers."""
    from rich.table import Table
    from rich.text import Text

    rows_a, rows_b = text_a["rows"], text_b["rows"]
    table = Table(title="text benchmarks: score", title_justify="left")
    for header in ("benchmark", "A", "B", "delta", "episodes A", "episodes B"):
        table.add_column(header, justify="left" if header == "benchmark" else "right")

    def add(name: str, a: dict[str, Any] | None, b: dict[str, Any] | None,
            style: str | None = None) -> None:  # fmt: skip
        score_a, score_b = (None if a is None else a["score"]), (None if b is None else b["score"])
        delta = ("-" if score_a is None or score_b is None
                 else f"{100 * (score_b - score_a):+.1f} pp")  # fmt: skip
        table.add_row(Text(name), fmt_rate(score_a), fmt_rate(score_b), delta,
                      str(0 if a is None else a["episodes"]),
                      str(0 if b is None else b["episodes"]), style=style)  # fmt: skip

    for name in sorted(rows_a["benchmarks"].keys() | rows_b["benchmarks"].keys()):
        add(name, rows_a["benchmarks"].get(name), rows_b["benchmarks"].get(name))
    table.add_section()
    add("all", rows_a["all"], rows_b["all"], "bold")
    console.print(table)
    console.print(
        f"text items whose score changed: {len(changed)} (score: the answer metric, an infra "
        "error counting 0)",
        markup=False,
        highlight=False,
    )
    for c in changed[:10]:
        console.print(
            f"  {c.change}: {c.key} {c.reward_a:.3g} -> {c.reward_b:.3g}  {c.instruction[:70]}",
            markup=False,
            highlight=False,
        )
        text = c.text or {}
        if c.rollout is not None:  # an episode's answers (a task has several)
            console.print(
                f"      answer {_short(text.get('answer_a'))} -> {_short(text.get('answer_b'))}",
                markup=False,
                highlight=False,
            )


def _short(answer: Any, limit: int = 50) -> str:
    if answer is None:
        return "(none)"
    shown = json.dumps(str(answer), ensure_ascii=False)
    return shown if len(shown) <= limit else shown[: limit - 2] + "…\""


def _parser() -> argparse.ArgumentParser:
    parser = results_parser(
        "compare_exp_result.py",
        "Episodes or tasks whose reward or status differs between two runs "
        "(A better, B better, status changed, only in one run); with text episodes in both, "
        "the text benchmarks' scores A vs B.",
        epilog="The record fields and the change kinds are in this script's compare() "
        "docstring.",
        run_dir=False,
    )
    parser.add_argument("run_a", metavar="RUN_A", help="the first run directory")
    parser.add_argument("run_b", metavar="RUN_B", help="the second run directory")
    parser.add_argument(
        "-o", "--output", metavar="FILE", type=Path,
        help="where to write the changes: .csv for CSV, else JSON lines "
        "(default: compare_<A>_vs_<B>.jsonl in the current directory)",
    )  # fmt: skip
    parser.add_argument(
        "--by",
        choices=("episode", "task"),
        default="episode",
        help="compare single episodes (default) or tasks over their rollouts",
    )
    add_version_filters(parser, runs="both runs")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    run_a = select_run(parser, open_run(parser, args.run_a), args)
    run_b = select_run(parser, open_run(parser, args.run_b), args)
    output = args.output or Path(f"compare_{run_a.name}_vs_{run_b.name}.jsonl")
    if not output.parent.is_dir():
        fail(parser, f"{output.parent}: no such directory")
    for run in (run_a, run_b):
        if not run.episodes:
            print(f"{run.path}: no finished episodes", file=sys.stderr)
    changes = compare(run_a, run_b, by=args.by)
    write_changes(changes, output)
    _print_summary(run_a, run_b, changes, args.by)
    print(f"wrote {len(changes)} changes to {output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
