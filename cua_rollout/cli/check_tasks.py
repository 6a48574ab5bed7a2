"""Which tasks of a task set can run here, and what the others miss: the pre-flight check
run.py applies when tasks load, for any task set, before any desktop or model time.

    python scripts/check_tasks.py TASKS_JSON [--examples-dir DIR] [--config C] [--set k=v]
                                  [--json]

TASKS_JSON is an OSWorld task list ({domain: [id, ...]}, task files in
``<its folder>/examples`` or --examples-dir), a JSONL file or a folder of task files. The
configuration decides what is available (``evaluation.engine``, OSWorld's evaluator
environment, ``desktops.accounts_dir``, ``desktops.offline``); without --config the defaults.
Exit codes: 0 every task runnable, 1 some are not, 2 bad usage or an unreadable task set.
``--json``: {"total", "runnable", "missing": {"metric:NAME"|"getter:NAME"|"setup:TYPE": n},
"domains": {domain: {"total", "runnable"}}, "unreadable": [...], "tasks": [{"domain", "id",
"runnable", "problems"}]}.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from rich.console import Console
from rich.table import Table

from cua_rollout.config import add_config_arguments, load_config
from cua_rollout.core.errors import ConfigError
from cua_rollout.evaluation.preflight import CheckedTask, TaskChecker, coverage
from cua_rollout.runtime.launch import absolute_paths
from cua_rollout.runtime.loader import load_tasks

__all__ = ["main"]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="check_tasks.py",
        description="Which tasks of a task set can be set up and scored here, and what the "
        "others miss.")
    parser.add_argument("tasks", type=Path, help="task list JSON, JSONL file or folder")
    parser.add_argument("--examples-dir", type=Path, default=None,
                        help="folder of the task files (default: <task list's folder>/examples)")
    add_config_arguments(parser, required=False)
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        cfg = load_config(args.config, args.overrides)
        # As run.py sees them: the task set's own folder is one tasks may upload files from.
        cfg = absolute_paths(cfg.model_copy(update={"tasks": cfg.tasks.model_copy(
            update={"source": args.tasks, "examples_dir": args.examples_dir})}))
        tasks, unreadable = load_tasks(args.tasks, args.examples_dir)
    except ConfigError as exc:
        print(f"check_tasks.py: error: {exc}", file=sys.stderr)
        return 2
    check = TaskChecker(cfg)
    checked = [CheckedTask(domain, task_id, check(task)) for domain, task_id, task in tasks]
    report = coverage(checked)
    report["unreadable"] = [str(p) for p in unreadable]
    if args.json:
        print(json.dumps(report, indent=1))
    else:
        _print(report, check)
    return 0 if report["runnable"] == report["total"] and not unreadable else 1


def _print(report: dict, check: TaskChecker) -> None:
    console = Console()
    table = Table(title=f"{report['runnable']} of {report['total']} tasks runnable here")
    for column in ("domain", "tasks", "runnable", "%"):
        table.add_column(column, justify="left" if column == "domain" else "right")
    for domain, row in report["domains"].items():
        share = 100 * row["runnable"] / row["total"] if row["total"] else 0
        table.add_row(domain, str(row["total"]), str(row["runnable"]), f"{share:.1f}")
    console.print(table)
    if report["missing"]:
        missing = Table(title="What the other tasks miss")
        missing.add_column("missing")
        missing.add_column("tasks", justify="right")
        missing.add_column("why (first task)")
        why = {}
        for task in report["tasks"]:
            for problem in task["problems"]:
                why.setdefault(problem.split(": ", 1)[0], problem.split(": ", 1)[-1])
        for key, n in report["missing"].items():
            missing.add_row(key, str(n), why.get(key, ""))
        console.print(missing)
    for problem in report["unreadable"]:
        console.print(f"unreadable: {problem}", style="red")
    catalog = check.catalog() if check.engine != "native" else None
    if catalog is not None:
        console.print(f"OSWorld evaluators: {len(catalog.metrics)} metrics, "
                      f"{len(catalog.getters)} getters from {catalog.source}")


if __name__ == "__main__":
    sys.exit(main())
