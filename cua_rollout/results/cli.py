"""What the result scripts (scripts/*.py) share: their argument parser with the RUN_DIR
help, opening a run or an output directory (one line and exit 2 when that fails), the
model-version options (--min-version, --exclude-mixed) and their selection, the report of
unreadable lines on stderr, and the formatting of figures in tables."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import NoReturn, TextIO

from cua_rollout.core.types import Status
from cua_rollout.results.runs import Problem, Run, RunDirError, load_run
from cua_rollout.results.versions import VersionError, select_versions

__all__ = [
    "RUN_DIR_HELP",
    "STATUS_ABBREV",
    "add_json_flag",
    "add_out_dir",
    "add_version_filters",
    "fail",
    "fmt_float",
    "fmt_rate",
    "make_out_dir",
    "open_run",
    "report_problems",
    "results_parser",
    "select_run",
]

# The run directory formats the scripts accept, for their --help.
RUN_DIR_HELP = (
    "RUN_DIR is a run directory of run.py (results.jsonl, see docs/results_format.md) or an "
    "OSWorld results tree (<domain>/<task_id>/result.txt); the format is detected."
)

# Short column headers for tables.
STATUS_ABBREV: dict[str, str] = {
    Status.SUCCESS: "succ",
    Status.FAILURE: "fail",
    Status.MAX_STEPS: "max_st",
    Status.TIMEOUT: "tmout",
    Status.INFRA_ERROR: "infra",
    Status.CANCELLED: "cancel",
}


def results_parser(
    prog: str, description: str, *, epilog: str | None = None, run_dir: bool = True
) -> argparse.ArgumentParser:
    """The parser of a result script: ``description`` followed by RUN_DIR_HELP and, unless
    ``run_dir`` is False (the script names its own run arguments), one RUN_DIR argument."""
    parser = argparse.ArgumentParser(
        prog=prog, description=f"{description} {RUN_DIR_HELP}", epilog=epilog
    )
    if run_dir:
        parser.add_argument("run_dir", metavar="RUN_DIR", help="the run directory")
    return parser


def add_json_flag(parser: argparse.ArgumentParser) -> None:
    """``--json``: print one JSON object instead of the table."""
    parser.add_argument("--json", action="store_true", help="print one JSON object instead")


def add_out_dir(parser: argparse.ArgumentParser, default: str) -> None:
    """``--out DIR``, an output directory that defaults to ``RUN_DIR/<default>``."""
    parser.add_argument("--out", metavar="DIR", type=Path,
                        help=f"output directory (default: RUN_DIR/{default})")  # fmt: skip


def add_version_filters(parser: argparse.ArgumentParser, *, runs: str = "the run") -> None:
    """``--min-version V`` and ``--exclude-mixed`` (read by ``select_run``); ``runs`` names
    what they apply to in the help."""
    group = parser.add_argument_group(
        "model versions",
        "Versions are ordered by first use in the run (episodes by start time); an episode "
        "belongs to the version of its first step. show_result.py --by-version lists them.",
    )
    group.add_argument(
        "--min-version", metavar="V",
        help=f"keep only the episodes of {runs} whose first model version is V or a later one "
        "(an episode that started on an older version is left out even if it ended on V; one "
        "without a version too); V must be a version of each run",
    )  # fmt: skip
    group.add_argument(
        "--exclude-mixed", action="store_true",
        help="leave out episodes whose steps came from more than one model version",
    )  # fmt: skip


def select_run(parser: argparse.ArgumentParser, run: Run, args: argparse.Namespace) -> Run:
    """The run narrowed by ``add_version_filters``' options; a --min-version that is not one
    of the run's versions exits 2 with one line naming it and the run's versions in order."""
    try:
        return select_versions(
            run, min_version=args.min_version, exclude_mixed=args.exclude_mixed
        )
    except VersionError as exc:
        fail(parser, f"--min-version {exc}")


def fail(parser: argparse.ArgumentParser, message: str) -> NoReturn:
    """Exit 2 with ``<prog>: error: <message>`` on stderr, as argparse does for bad usage."""
    parser.exit(2, f"{parser.prog}: error: {message}\n")


def report_problems(problems: Iterable[Problem], stream: TextIO | None = None) -> int:
    """Print each problem on its own line of stderr; return how many."""
    out = stream if stream is not None else sys.stderr
    n = 0
    for problem in problems:
        print(f"warning: {problem}", file=out)
        n += 1
    return n


def fmt_rate(value: float | None) -> str:
    """A rate as a percentage with one decimal, '-' when there is none."""
    return "-" if value is None else f"{100 * value:.1f}%"


def fmt_float(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def open_run(parser: argparse.ArgumentParser, path: str) -> Run:
    """``load_run`` for a CLI: a bad directory exits 2 with one line naming it; unreadable
    lines are reported on stderr and skipped."""
    try:
        run = load_run(path)
    except RunDirError as exc:
        fail(parser, str(exc))
    report_problems(run.problems)
    return run


def make_out_dir(parser: argparse.ArgumentParser, path: Path) -> Path:
    """Create an output directory for a CLI; one line and exit 2 when it cannot be made."""
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        fail(parser, f"{path}: cannot create ({exc.strerror})")
    return path
