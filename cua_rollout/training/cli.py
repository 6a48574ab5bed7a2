"""``python -m cua_rollout.training``: the trainer's index from a shell.

    python -m cua_rollout.training [--db URL | --run-dir DIR] [--password-env NAME] COMMAND
        status [--run RUN]
        reindex RUN_DIR [--run NAME]
        claim -n N --consumer NAME [--lease-s S] [--min-version V] [--max-staleness K]
              [--run RUN] [--skip-no-signal] [--json [--steps]]
        ack --claims FILE          (FILE: the lines claim printed; - for stdin)
        release --claims FILE
        export OUT [--per step|episode] [--format jsonl|parquet] [--state S|any] [--run RUN]

The database is ``--db`` (an SQLAlchemy URL), else the run directory's own index
(``<DIR>/index.db``; ``reindex`` uses its RUN_DIR). A password never has to be written down:
``--password-env NAME`` reads it from that environment variable.

``claim`` prints one JSON line per claimed group: run, group_id, claim_id, consumer,
lease_expires (``--json``: also the group record and its episodes). Errors are one line on
stderr; exit 2 for bad usage or input (URL, run directory, claims file), 1 for a database
that fails or for claims that could not be acked (lost to another consumer).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, NoReturn

from sqlalchemy.engine import URL
from sqlalchemy.exc import SQLAlchemyError

from cua_rollout.training.export import FORMATS, PER, export, format_of
from cua_rollout.training.index import (
    STATES,
    ClaimRef,
    TrainingIndex,
    TrainingIndexError,
    default_url,
    index_url,
    redacted,
)

__all__ = ["EXIT_DB", "EXIT_OK", "EXIT_USAGE", "build_parser", "main"]

EXIT_OK = 0
EXIT_DB = 1
EXIT_USAGE = 2
PROG = "python -m cua_rollout.training"


class _Usage(Exception):
    """Bad usage or input: exit 2 with this line."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        # One line, not argparse's usage block.
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message} (see --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog=PROG, description="The trainer's index of runs: claim groups "
                     "exactly once, ack or release them, export training rows.")
    where = parser.add_mutually_exclusive_group()
    where.add_argument("--db", metavar="URL", help="SQLAlchemy database URL "
                       "(default: the run directory's index.db)")
    where.add_argument("--run-dir", metavar="DIR", type=Path,
                       help="a run directory: its index.db is the database")
    parser.add_argument("--password-env", metavar="NAME",
                        help="environment variable holding the database password")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    status = commands.add_parser("status", help="counts of groups by state, consumers")
    status.add_argument("--run", help="only this run")

    reindex = commands.add_parser("reindex", help="bring a run's rows in line with its files")
    reindex.add_argument("run_dir_arg", metavar="RUN_DIR", type=Path)
    reindex.add_argument("--run", help="the run's name (default: run.json's, or the dir's)")

    claim = commands.add_parser("claim", help="claim up to N ready groups")
    claim.add_argument("-n", type=int, required=True, metavar="N")
    claim.add_argument("--consumer", required=True, metavar="NAME")
    claim.add_argument("--lease-s", type=float, default=600.0, metavar="S")
    claim.add_argument("--min-version", metavar="V")
    claim.add_argument("--max-staleness", type=int, metavar="K")
    claim.add_argument("--run", help="only this run's groups")
    claim.add_argument("--skip-no-signal", action="store_true",
                       help="skip groups without a learning signal")
    claim.add_argument("--json", action="store_true",
                       help="print the whole claim: group record and episodes")
    claim.add_argument("--steps", action="store_true",
                       help="with --json: each episode's traj.jsonl lines as its steps")

    for name, text in (("ack", "mark claimed groups trained on"),
                       ("release", "give claimed groups back")):
        sub = commands.add_parser(name, help=text)
        sub.add_argument("--claims", required=True, metavar="FILE",
                         help="JSON lines with run, group_id, claim_id (what claim printed); "
                              "- for stdin")

    out = commands.add_parser("export", help="write training rows (JSONL or Parquet)")
    out.add_argument("out", metavar="OUT", type=Path)
    out.add_argument("--per", choices=PER, default="episode")
    out.add_argument("--format", choices=FORMATS, dest="fmt",
                     help="default: from OUT's suffix (.parquet), else jsonl")
    out.add_argument("--state", choices=[*STATES, "any"], default="any")
    out.add_argument("--run", help="only this run's groups")
    return parser


def _url(args: argparse.Namespace) -> URL:
    if args.db:
        url = args.db
    else:
        run_dir = args.run_dir if args.run_dir is not None else getattr(args, "run_dir_arg",
                                                                         None)
        if run_dir is None:
            raise _Usage("no database: give --db URL or --run-dir DIR")
        if not run_dir.is_dir():
            raise _Usage(f"{run_dir}: no such run directory")
        url = default_url(run_dir)
    try:
        return index_url(url, args.password_env)
    except ValueError as exc:
        raise _Usage(str(exc)) from None


def _read_claims(name: str) -> list[ClaimRef]:
    try:
        text = sys.stdin.read() if name == "-" else Path(name).read_text(encoding="utf-8")
    except OSError as exc:
        raise _Usage(f"{name}: cannot read ({exc.strerror})") from None
    except UnicodeDecodeError:
        raise _Usage(f"{name}: not UTF-8 text") from None
    claims = []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            value = json.loads(line)
        except json.JSONDecodeError as exc:
            raise _Usage(f"{name}:{number}: not JSON ({exc.msg})") from None
        if not (isinstance(value, dict)
                and all(isinstance(value.get(k), str) for k in ("run", "group_id", "claim_id"))):
            raise _Usage(f"{name}:{number}: not a claim (needs run, group_id, claim_id)")
        claims.append((value["run"], value["group_id"], value["claim_id"]))
    if not claims:
        raise _Usage(f"{name}: no claims in it")
    return claims


def _print(value: Any) -> None:
    print(json.dumps(value, ensure_ascii=False, separators=(",", ":")), flush=True)


def _run(args: argparse.Namespace, index: TrainingIndex) -> int:
    if args.command == "status":
        print(json.dumps(index.status(args.run), indent=2, ensure_ascii=False))
    elif args.command == "reindex":
        if not args.run_dir_arg.is_dir():
            raise _Usage(f"{args.run_dir_arg}: no such run directory")
        try:
            _print(index.reindex(args.run_dir_arg, args.run))
        except FileNotFoundError as exc:
            raise _Usage(str(exc)) from None
    elif args.command == "claim":
        if args.n < 1:
            raise _Usage(f"-n must be at least 1, not {args.n}")
        if args.lease_s <= 0:
            raise _Usage(f"--lease-s must be positive, not {args.lease_s}")
        try:
            claims = index.claim_groups(
                args.n, args.consumer, lease_s=args.lease_s, min_version=args.min_version,
                max_staleness=args.max_staleness, run=args.run,
                include_no_signal=not args.skip_no_signal, load_steps=args.json and args.steps)
        except ValueError as exc:
            raise _Usage(str(exc)) from None
        for claim in claims:
            line = {"run": claim.run, "group_id": claim.group_id, "claim_id": claim.claim_id,
                    "consumer": claim.consumer, "lease_expires": claim.lease_expires}
            if args.json:
                line |= {"group": claim.group, "episodes": claim.episodes}
            _print(line)
    elif args.command == "ack":
        claims = _read_claims(args.claims)
        lost = index.ack(claims)
        _print({"acked": len(claims) - len(lost), "lost": [list(x) for x in lost]})
        if lost:
            names = ", ".join(f"{run} {group}" for run, group in lost[:5])
            print(f"{PROG}: error: {len(lost)} of {len(claims)} claims could not be acked "
                  f"(claimed by another consumer since, or released): {names}"
                  f"{' ...' if len(lost) > 5 else ''}", file=sys.stderr)
            return EXIT_DB
    elif args.command == "release":
        _print({"released": index.release(_read_claims(args.claims))})
    elif args.command == "export":
        try:
            fmt = format_of(args.out, args.fmt)
        except ValueError as exc:
            raise _Usage(str(exc)) from None
        if not args.out.parent.is_dir():
            raise _Usage(f"{args.out.parent}: no such directory")
        count = export(args.out, index, per=args.per, fmt=fmt, run=args.run,
                       state=None if args.state == "any" else args.state)
        _print({"rows": count, "out": str(args.out), "per": args.per, "format": fmt})
    return EXIT_OK


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    url: URL | str = ""
    try:
        url = _url(args)
        with TrainingIndex(url) as index:
            return _run(args, index)
    except _Usage as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except ValueError as exc:  # a bad URL, an unknown version
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except TrainingIndexError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return EXIT_DB
    except OSError as exc:  # the export's file
        print(f"{PROG}: error: {exc.filename or ''}: {exc.strerror or exc}", file=sys.stderr)
        return EXIT_DB
    except SQLAlchemyError as exc:
        first = (str(getattr(exc, "orig", None) or exc).strip().splitlines() or [""])[0]
        print(f"{PROG}: error: {redacted(url)}: {type(exc).__name__}: {first}", file=sys.stderr)
        return EXIT_DB
