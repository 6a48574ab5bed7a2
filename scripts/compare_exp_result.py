"""What changed between two runs: the episodes (or, with ``--by task``, the tasks) whose
reward or status differs, both ways, written to a file (the fields: ``compare``'s docstring);
a summary on stdout. --min-version / --exclude-mixed narrow both runs by model version
first. Exit codes: 0, 2 on bad usage (a --min-version that is not a version of both runs
too) or a RUN_DIR missing / not a directory."""

from __future__ import annotations

import argparse
import csv
import json
import sys
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path

from rollout.results import (
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

__all__ = ["main"]

CHANGES = ("a_better", "b_better", "status_changed", "only_in_a", "only_in_b")
FIELDS = (
    "change", "key", "domain", "task_id", "rollout", "instruction",
    "status_a", "reward_a", "status_b", "reward_b", "delta",
)  # fmt: skip


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


@dataclass(frozen=True)
class _Outcome:
    """What one run says about one key: its status and reward (None when unscored)."""

    domain: str
    task_id: str
    rollout: int | None
    instruction: str
    status: str
    reward: float | None


def _by_episode(run: Run) -> dict[str, _Outcome]:
    return {
        e.episode_id: _Outcome(e.domain, e.task_id, e.rollout, e.instruction, e.status, e.reward)
        for e in run.episodes
    }


def _by_task(run: Run) -> dict[str, _Outcome]:
    outcomes = {}
    for (domain, task_id), task in summarize_tasks(run.episodes).items():
        status = "solved" if task.solved else "unsolved" if task.scored else "unscored"
        outcomes[f"{domain}/{task_id}"] = _Outcome(
            domain, task_id, None, task.instruction, status, task.mean_reward
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

    The file main() writes (``-o``: ``.csv`` for CSV, any other name JSON lines; default
    ``compare_<A>_vs_<B>.jsonl`` in the current directory, <A> and <B> the runs' directory
    names) holds one record per Change: {"change", "key", "domain", "task_id", "rollout"
    (null per task), "instruction", "status_a", "reward_a", "status_b", "reward_b", "delta"
    (reward_b - reward_a, null unless both scored)}, in this order.
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
            )
        )
    changes.sort(key=lambda c: (CHANGES.index(c.change), c.key))
    return changes


def write_changes(changes: list[Change], path: Path) -> None:
    if path.suffix.lower() == ".csv":
        with path.open("w", newline="", encoding="utf-8") as f:
            writer = csv.DictWriter(f, fieldnames=FIELDS)
            writer.writeheader()
            for c in changes:
                writer.writerow({k: ("" if v is None else v) for k, v in asdict(c).items()})
    else:
        with path.open("w", encoding="utf-8") as f:
            for c in changes:
                f.write(json.dumps(asdict(c), ensure_ascii=False) + "\n")


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
    for c in [c for c in changes if c.change in ("a_better", "b_better")][:10]:
        console.print(
            f"  {c.change}: {c.key} {c.reward_a:.3g} -> {c.reward_b:.3g}  {c.instruction[:70]}",
            markup=False,
            highlight=False,
        )


def _parser() -> argparse.ArgumentParser:
    parser = results_parser(
        "compare_exp_result.py",
        "Episodes or tasks whose reward or status differs between two runs "
        "(A better, B better, status changed, only in one run).",
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
