"""Replay fidelity: every demo task's reference solution played on real local desktops, many
times and many at once; how often a correct solution does not score 1.0, and where.

    python benchmarks/bench_fidelity.py [--concurrency 4] [--repeat 1] [--tasks ID ...]
        [--suite DIR] [--tasks-file F] [--nothing] [--keep [DIR]] [--json OUT]

Starts ``--concurrency`` local desktops once (Xvfb + openbox + session bus + the desktop
server, through the same ``DesktopPool`` and ``local`` provider as run.py's demo; reset in the
background between replays, verified, quarantined and replaced as in a run) and plays each
task's ``reference_solution`` ``--repeat`` times with ``cua_rollout.runtime.replay.play``: lease,
reset(task) with its setup, each reply parsed and run with a wait until the screen settles,
the task's evaluator, release. At most ``--concurrency`` replays run at once.

A replay of a correct reference solution that does not score 1.0, or whose action the desktop
refused, is a *fidelity failure*. ``--nothing`` plays only ``finished()`` instead, for any task
set in OSWorld's layout (its own ``evaluation_examples`` too, which have no reference
solutions): the untouched desktop, scored as the evaluator scores an agent that did nothing;
a score above 0 is a failure (the desktop's initial state already passes the task's check,
the look-alike's difference docs/osworld.md lists and the local profile fixes).
Either way, a replay that raised an infrastructure error (a desktop request failed, a setup
step timed out, no desktop free: ``cua_rollout.core.errors.InfraError``, transport and OS
errors) is an *infra error*, counted apart, as are the pool's quarantined and replaced
desktops. Prints (rich tables) replays, failures by task and by action kind (the kinds of the
actions in the failing replays' solutions: click, left_double, drag, type, hotkey, scroll ...),
infra errors, wall time, replays per minute, and CPU seconds per action spent in the desktops
(their session processes and every descendant, live or reaped, sampled with psutil once a
second), in this controller and on the whole machine.

``--keep [DIR]`` saves each replay's screenshots (after setup, after every action), its step
log and, after scoring, the window list and what the evaluator read (the file, or the
accessibility tree); a replay that scores 1.0 has its folder removed again, a failing one's
stays (DIR, default a new folder under /tmp, is printed). ``--json OUT`` writes every figure
and every replay's record. Exit code 0 when every replay passed, 1 otherwise.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import signal
import statistics
import sys
import tempfile
import threading
import time
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import httpx  # noqa: E402
import psutil  # noqa: E402
from rich.markup import escape  # noqa: E402

from cua_rollout.agents.uitars import parse_response  # noqa: E402
from cua_rollout.config import Config, load_config  # noqa: E402
from cua_rollout.core.errors import InfraError  # noqa: E402
from cua_rollout.evaluation import Evaluator  # noqa: E402
from cua_rollout.runtime.pool import DesktopPool  # noqa: E402
from cua_rollout.runtime.replay import (  # noqa: E402
    NOTHING,
    play,
    run_concurrently,
    with_upload_root,
)

TERMINAL_KINDS = ("finished", "call_user")
SAMPLE_INTERVAL_S = 1.0
# Where --keep without a folder puts the failing replays (a new folder under /tmp).
KEEP_PREFIX = "bench-fidelity-"


# --------------------------------------------------------------------------- tasks


def load_tasks(suite: Path, only: list[str] | None) -> list[tuple[str, dict[str, Any]]]:
    """(domain, task) of the suite (OSWorld layout), in its index's order; ``only``: task
    ids, domains, or ``domain/id`` (OSWorld reuses a few ids across domains)."""
    index = json.loads((suite / "test_all.json").read_text(encoding="utf-8"))
    tasks = [(d, json.loads((suite / "examples" / d / f"{i}.json").read_text(encoding="utf-8")))
             for d, ids in index.items() for i in ids]
    if only:
        wanted = set(only)
        unknown = (wanted - {t["id"] for _, t in tasks} - set(index)
                   - {f"{d}/{t['id']}" for d, t in tasks})
        if unknown:
            raise SystemExit(f"no such task or domain in {suite}: {', '.join(sorted(unknown))}")
        tasks = [(d, t) for d, t in tasks
                 if t["id"] in wanted or d in wanted or f"{d}/{t['id']}" in wanted]
    return tasks


def action_kinds(cfg: Config, replies: list[str]) -> list[str]:
    """The kind of every action the replies run on the desktop (terminal ones left out)."""
    width, height = cfg.desktops.screen_width, cfg.desktops.screen_height
    kinds = []
    for text in replies:
        parsed = parse_response(text, width, height, cfg.agent.name,
                                min_pixels=cfg.agent.min_pixels, max_pixels=cfg.agent.max_pixels)
        kinds += [a.kind for a in parsed.actions if a.kind not in TERMINAL_KINDS]
    return kinds


def is_infra(exc: BaseException) -> bool:
    """An error of the machinery, not of the replayed solution: a desktop that broke, a
    setup step that did not finish, a request that failed. ``play`` raises AssertionError
    when the desktop ran an action and reported it failed: that one is the solution's."""
    return isinstance(exc, InfraError | httpx.HTTPError | OSError | TimeoutError)


# --------------------------------------------------------------------------- CPU


class DesktopCPU:
    """CPU seconds spent in each local desktop: its session's processes (Xvfb, window
    manager, buses, the server) with every live descendant (apps, the server's action
    worker), each with its reaped children, sampled every ``interval_s`` in a thread. A
    session's figure is the highest total seen minus its first (a desktop replaced mid-run
    keeps what it used). Processes re-parented away from the session when their parent was
    killed are missed (a lower bound)."""

    def __init__(self, provider: Any, interval_s: float = SAMPLE_INTERVAL_S) -> None:
        # The local provider's sessions (bench_desktops reads them the same way).
        self.sessions: dict[str, Any] | None = getattr(provider, "_sessions", None)
        self.interval_s = interval_s
        self.first: dict[str, float] = {}
        self.high: dict[str, float] = {}
        self.sampler_cpu_s = 0.0
        self.samples = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="desktop-cpu", daemon=True)

    @property
    def available(self) -> bool:
        return self.sessions is not None

    def start(self) -> None:
        if self.available:
            self.sample()
            self._thread.start()

    def stop(self) -> None:
        if self._thread.is_alive():
            self._stop.set()
            self._thread.join()
        if self.available:
            self.sample()  # the last figures, after the last reset

    def total_s(self) -> float:
        return sum(self.high[s] - self.first[s] for s in self.high)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.sample()

    def sample(self) -> None:
        started = time.thread_time()
        cpu: dict[int, float] = {}
        children: dict[int, list[int]] = defaultdict(list)
        for proc in psutil.process_iter(["ppid", "cpu_times"]):
            t = proc.info["cpu_times"]
            if t is None:  # gone, or not ours to read
                continue
            cpu[proc.pid] = t.user + t.system + t.children_user + t.children_system
            children[proc.info["ppid"]].append(proc.pid)
        assert self.sessions is not None
        for _ in range(3):  # the pool's thread may add or remove a session meanwhile
            try:
                sessions = list(self.sessions.items())
                break
            except RuntimeError:
                continue
        else:
            sessions = []
        for sid, session in sessions:
            try:
                roots = set(session.core_pids())
            except Exception:  # a session being stopped
                continue
            seen: set[int] = set()
            stack = list(roots)
            while stack:
                pid = stack.pop()
                if pid in seen:
                    continue
                seen.add(pid)
                stack.extend(children.get(pid, ()))
            total = sum(cpu.get(pid, 0.0) for pid in seen)
            self.first.setdefault(sid, total)
            self.high[sid] = max(self.high.get(sid, total), total)
        self.samples += 1
        self.sampler_cpu_s += time.thread_time() - started


def busy_cpu_s() -> float:
    """CPU seconds this machine has been busy (every core)."""
    t = psutil.cpu_times()
    return sum(t) - t.idle - getattr(t, "iowait", 0.0) - getattr(t, "guest", 0.0) \
        - getattr(t, "guest_nice", 0.0)


def own_cpu_s() -> float:
    t = psutil.Process().cpu_times()
    return t.user + t.system


# --------------------------------------------------------------------------- one replay


async def _diagnose(env: Any, task: dict[str, Any], folder: Path) -> None:
    """What a failing replay left: the window list and what the evaluator reads."""
    with contextlib.suppress(Exception):
        windows = await env.execute("wmctrl -lx", shell=True)
        (folder / "windows.txt").write_text(windows.get("output") or "")
    with contextlib.suppress(Exception):
        (folder / "final.png").write_bytes((await env.observe()).png)
    results = task["evaluator"].get("result") or []
    for i, spec in enumerate(results if isinstance(results, list) else [results]):
        kind = spec.get("type")
        with contextlib.suppress(Exception):
            if kind == "vm_file":
                data = await env.get_file(spec["path"])
                name = f"result{i}-{Path(spec['path']).name}"
                (folder / name).write_bytes(data if data is not None else b"<no such file>\n")
            elif kind == "accessibility_tree":
                (folder / f"result{i}-a11y.xml").write_text(await env.accessibility_tree())
            elif kind == "vm_command_line":
                out = await env.execute(spec["command"], shell=bool(spec.get("shell")))
                (folder / f"result{i}-command.txt").write_text(json.dumps(out, indent=1))


async def replay_once(cfg: Config, pool: DesktopPool, evaluator: Evaluator, domain: str,
                      task: dict[str, Any], kinds: list[str], round_: int, keep: Path | None,
                      done: Any, nothing: bool = False) -> dict[str, Any]:
    """One replay of the task's reference solution (``nothing``: of ``finished()`` alone,
    expected to score 0): its record (never raises)."""
    name = f"{domain}/{task['id']}#{round_}"
    folder = keep / f"{task['id']}-{round_}" if keep is not None else None
    lines: list[tuple[float, str]] = []
    stats: dict[str, Any] = {}
    where: dict[str, Any] = {}
    started = time.monotonic()

    def log(*parts: Any) -> None:
        lines.append((time.monotonic() - started, " ".join(map(str, parts))))

    async def then(env: Any, last_action: str | None) -> None:
        where["desktop"] = getattr(env, "name", None)
        where["last_action"] = last_action
        if folder is not None:
            await _diagnose(env, task, folder)

    record: dict[str, Any] = {"task": task["id"], "domain": domain, "round": round_,
                              "name": name, "kinds": kinds}
    try:
        replies = [NOTHING] if nothing else task["reference_solution"]
        value = await play(cfg, pool, task, replies, evaluator=evaluator, shots=folder,
                           log=log, stats=stats, then=then)
        expected = 0.0 if nothing else 1.0
        record["score"] = value
        record["outcome"] = "pass" if value == expected else "fail"
        record["detail"] = None if value == expected else f"score {value}"
    except Exception as exc:
        record["score"] = None
        record["outcome"] = "infra" if is_infra(exc) else "fail"
        record["error"] = f"{type(exc).__name__}: {exc}"
        record["detail"] = record["error"]
    record["replay_s"] = round(time.monotonic() - started, 3)
    record.update({k: round(v, 3) if isinstance(v, float) else v for k, v in stats.items()})
    if lines and "setup_s" in stats:  # the first line is logged right after the setup
        record["lease_wait_s"] = round(max(0.0, lines[0][0] - stats["setup_s"]), 3)
    record.update(where)
    if record["outcome"] != "pass":
        record["log"] = [f"{t:7.2f}s {text}" for t, text in lines]
        if folder is not None:
            folder.mkdir(parents=True, exist_ok=True)
            (folder / "steps.txt").write_text("\n".join(record["log"]) + "\n"
                                              + (record.get("error") or "") + "\n")
            record["kept"] = str(folder)
    elif folder is not None:
        shutil.rmtree(folder, ignore_errors=True)
    done(record)
    return record


# --------------------------------------------------------------------------- the run


async def _resets_done(pool: DesktopPool, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while pool.stats()["resetting"] and time.monotonic() < deadline:
        await asyncio.sleep(0.1)


async def run(args: argparse.Namespace, console: Any) -> dict[str, Any]:
    suite = (ROOT / args.suite).resolve()
    # A short path: Chromium's sockets live under it and UNIX socket paths are short.
    state_dir = Path(tempfile.mkdtemp(prefix="bf-", dir="/tmp"))
    cfg = load_config(ROOT / args.config, [
        "desktops.provider=local", f"desktops.count={args.concurrency}",
        "desktops.warm_spares=0", f"desktops.local.state_dir={state_dir}",
        f"desktops.local.start_timeout_s={args.start_timeout}", *args.set])
    cfg = with_upload_root(cfg, ROOT)
    tasks = load_tasks(suite, args.tasks)
    if not args.nothing:
        unsolved = [t["id"] for _, t in tasks if not t.get("reference_solution")]
        if unsolved:
            raise SystemExit(f"{len(unsolved)} tasks of {suite} have no reference_solution "
                             f"(first {unsolved[0]}): play them with --nothing")
    kinds = {t["id"]: [] if args.nothing else action_kinds(cfg, t["reference_solution"])
             for _, t in tasks}
    keep = args.keep
    if keep is not None:
        keep.mkdir(parents=True, exist_ok=True)
    pool = DesktopPool(cfg.desktops)
    evaluator = Evaluator.from_config(cfg)
    cpu = DesktopCPU(pool.provider)
    total = len(tasks) * args.repeat
    finished: list[dict[str, Any]] = []

    def done(record: dict[str, Any]) -> None:
        finished.append(record)
        style = {"pass": "green", "fail": "bold red", "infra": "yellow"}[record["outcome"]]
        extra = "" if record["outcome"] == "pass" else escape(f"  {record['detail']}"[:160])
        console.print(f"[{len(finished):>4}/{total}] {record['name']:34} "
                      f"[{style}]{record['outcome']:5}[/{style}] {record['replay_s']:6.1f}s"
                      f"{extra}", highlight=False)

    report: dict[str, Any] = {"suite": str(suite), "config": args.config,
                              "mode": "nothing" if args.nothing else "reference",
                              "concurrency": args.concurrency, "repeat": args.repeat,
                              "tasks": len(tasks), "cpus": psutil.cpu_count()}
    # The pool's start runs partly in threads that a cancel cannot stop: on Ctrl-C it is let
    # finish, so every desktop it started is known to the pool and stopped with it.
    starting = asyncio.ensure_future(pool.start())
    try:
        t0 = time.monotonic()
        await asyncio.shield(starting)
        report["pool_start_s"] = round(time.monotonic() - t0, 2)
        console.print(f"{args.concurrency} desktops up in {report['pool_start_s']:.1f} s; "
                      f"{total} replays of {len(tasks)} tasks", highlight=False)
        cpu.start()
        own0, busy0, wall0 = own_cpu_s(), busy_cpu_s(), time.monotonic()
        episodes = [(f"{d}/{t['id']}#{r}", replay_once(cfg, pool, evaluator, d, t, kinds[t["id"]],
                                                   r, keep, done, args.nothing))
                    for r in range(args.repeat) for d, t in tasks]
        try:
            outcomes = await run_concurrently(episodes, args.concurrency)
        finally:  # interrupted: the replays that never started are closed, not leaked
            for _, coro in episodes:
                with contextlib.suppress(RuntimeError):
                    coro.close()
        wall = time.monotonic() - wall0
        await _resets_done(pool, cfg.desktops.reset_timeout_s)  # their CPU is the replays'
        cpu.stop()
        own, busy = own_cpu_s() - own0, busy_cpu_s() - busy0
        records = [r for r in outcomes.values() if isinstance(r, dict)]
        report.update(summarize(records, wall))
        actions = report["actions"]
        desktop_cpu = cpu.total_s() if cpu.available else None
        report["cpu"] = {
            "desktops_s": _round(desktop_cpu),
            "desktops_s_per_action": _round(desktop_cpu / actions if desktop_cpu is not None
                                            and actions else None, 4),
            "desktops_s_per_replay": _round(desktop_cpu / len(records) if desktop_cpu
                                            is not None and records else None),
            "controller_s": _round(own - cpu.sampler_cpu_s),
            "controller_s_per_action": _round((own - cpu.sampler_cpu_s) / actions
                                              if actions else None, 4),
            "sampler_s": _round(cpu.sampler_cpu_s), "samples": cpu.samples,
            "machine_busy_s": _round(busy),
            "machine_utilization": _round(busy / (wall * (psutil.cpu_count() or 1)), 3),
        }
        stats = pool.stats(detail=True)
        report["pool"] = {k: stats[k] for k in ("leases", "resets", "reset_failures",
                                                "verify_failures", "quarantined", "replaced",
                                                "lease_timeouts", "reset_s_median",
                                                "reset_s_max", "verify_s_median")}
        report["pool"]["quarantine_reasons"] = [d["last_error"] for d in stats["desktops"]
                                                if d["last_error"]]
        report["records"] = sorted(records, key=lambda r: (r["task"], r["round"]))
    finally:
        if not starting.done():
            with contextlib.suppress(BaseException):
                await starting
        cpu.stop()
        if evaluator.bridge is not None:
            with contextlib.suppress(Exception):
                await evaluator.bridge.close()
        await pool.stop()
        shutil.rmtree(state_dir, ignore_errors=True)
    return report


def _round(value: float | None, digits: int = 2) -> float | None:
    return None if value is None else round(value, digits)


def _median(values: list[float]) -> float | None:
    return round(statistics.median(values), 2) if values else None


def summarize(records: list[dict[str, Any]], wall_s: float) -> dict[str, Any]:
    failed = [r for r in records if r["outcome"] == "fail"]
    infra = [r for r in records if r["outcome"] == "infra"]
    by_task: dict[str, dict[str, Any]] = {}
    for r in records:
        row = by_task.setdefault(r["task"], {
            "domain": r["domain"], "kinds": r["kinds"], "replays": 0, "pass": 0, "fail": 0,
            "infra": 0, "replay_s": [], "setup_s": []})
        row["replays"] += 1
        row[r["outcome"]] += 1
        row["replay_s"].append(r["replay_s"])
        if "setup_s" in r:
            row["setup_s"].append(r["setup_s"])
    for row in by_task.values():
        row["replay_s_median"] = _median(row.pop("replay_s"))
        row["setup_s_median"] = _median(row.pop("setup_s"))
    by_kind: dict[str, dict[str, int]] = {}
    for r in records:
        counts = Counter(r["kinds"]) if r["kinds"] else Counter({"(no action)": 0})
        for kind, steps in counts.items():
            row = by_kind.setdefault(kind, {"replays": 0, "fail": 0, "infra": 0, "steps": 0,
                                            "failing_steps": 0})
            row["replays"] += 1
            row["steps"] += steps
            if r["outcome"] == "fail":
                row["fail"] += 1
                row["failing_steps"] += steps
            elif r["outcome"] == "infra":
                row["infra"] += 1
    actions = sum(r.get("actions", 0) for r in records)
    return {
        "replays": len(records), "passed": len(records) - len(failed) - len(infra),
        "failures": len(failed), "infra_errors": len(infra), "actions": actions,
        "wall_s": round(wall_s, 1),
        "replays_per_min": round(len(records) / wall_s * 60, 2) if wall_s else None,
        "actions_per_s": round(actions / wall_s, 2) if wall_s else None,
        "replay_s_median": _median([r["replay_s"] for r in records]),
        "setup_s_median": _median([r["setup_s"] for r in records if "setup_s" in r]),
        "lease_wait_s_median": _median([r["lease_wait_s"] for r in records
                                        if "lease_wait_s" in r]),
        "evaluation_s_median": _median([r["evaluation_s"] for r in records
                                        if "evaluation_s" in r]),
        "by_task": by_task, "by_kind": by_kind,
        "failed": [{k: r.get(k) for k in ("name", "kinds", "detail", "desktop", "kept", "log")}
                   for r in failed],
        "infra": [{k: r.get(k) for k in ("name", "kinds", "detail", "actions", "kept", "log")}
                  for r in infra],
    }


# --------------------------------------------------------------------------- output


def print_report(console: Any, report: dict[str, Any]) -> None:
    from rich.table import Table

    def fmt(value: Any, spec: str = "") -> str:
        if value is None:
            return "-"
        return format(value, spec) if spec else str(value)

    cpu, pool = report["cpu"], report["pool"]
    what = "untouched desktops" if report.get("mode") == "nothing" else "replay fidelity"
    summary = Table(title=f"{what}: {report['tasks']} tasks x {report['repeat']} on "
                    f"{report['concurrency']} local desktops ({report['cpus']} CPUs)",
                    show_header=False)
    summary.add_column("figure")
    summary.add_column("value", justify="right")
    fail_style = "bold red" if report["failures"] else "green"
    rows = [
        ("replays", str(report["replays"])),
        ("passed (score 0.0 untouched)" if report.get("mode") == "nothing"
         else "passed (score 1.0)", str(report["passed"])),
        ("fidelity failures", f"[{fail_style}]{report['failures']}[/{fail_style}]"),
        ("infra errors (apart)", str(report["infra_errors"])),
        ("desktops quarantined / replaced", f"{pool['quarantined']} / {pool['replaced']}"),
        ("desktops' start (all at once)", f"{report['pool_start_s']:.1f} s"),
        ("wall time (replays)", f"{report['wall_s']:.1f} s"),
        ("replays / min", fmt(report["replays_per_min"], ".2f")),
        ("actions (run on desktops)", str(report["actions"])),
        ("actions / s", fmt(report["actions_per_s"], ".2f")),
        ("replay s, median (incl. lease wait)", fmt(report["replay_s_median"])),
        ("  lease wait / setup / evaluation s, median",
         f"{fmt(report['lease_wait_s_median'])} / {fmt(report['setup_s_median'])} / "
         f"{fmt(report['evaluation_s_median'])}"),
        ("reset s, median / max", f"{fmt(_round(pool['reset_s_median']))} / "
                                  f"{fmt(_round(pool['reset_s_max']))}"),
        ("desktop CPU s / action", fmt(cpu["desktops_s_per_action"], ".3f")),
        ("desktop CPU s / replay (incl. setup, reset)", fmt(cpu["desktops_s_per_replay"], ".2f")),
        ("controller CPU s / action (settle, resets)", fmt(cpu["controller_s_per_action"],
                                                           ".3f")),
        ("machine busy (all cores)", f"{fmt(cpu['machine_utilization'], '.0%')} "
                                     f"({fmt(cpu['machine_busy_s'], '.0f')} CPU s)"),
        ("CPU sampler's own cost", f"{fmt(cpu['sampler_s'])} s over {cpu['samples']} samples"),
    ]
    for figure, value in rows:
        summary.add_row(figure, value)
    console.print(summary)

    tasks = Table(title="by task")
    for col in ("domain", "task", "actions", "replays", "pass", "fail", "infra",
                "replay s p50", "setup s p50"):
        tasks.add_column(col, justify="left" if col in ("domain", "task", "actions")
                         else "right")
    for task, row in sorted(report["by_task"].items(), key=lambda kv: (kv[1]["domain"], kv[0])):
        counts = Counter(row["kinds"])
        tasks.add_row(row["domain"], task,
                      " ".join(f"{k}x{n}" if n > 1 else k for k, n in counts.items()) or "-",
                      str(row["replays"]), str(row["pass"]),
                      f"[bold red]{row['fail']}[/bold red]" if row["fail"] else "0",
                      f"[yellow]{row['infra']}[/yellow]" if row["infra"] else "0",
                      fmt(row["replay_s_median"]), fmt(row["setup_s_median"]))
    console.print(tasks)

    kinds = Table(title="by action kind (replays whose solution has the kind)")
    for col in ("kind", "replays", "steps", "failed replays", "failure rate", "infra"):
        kinds.add_column(col, justify="left" if col == "kind" else "right")
    for kind, row in sorted(report["by_kind"].items(), key=lambda kv: (-kv[1]["fail"], kv[0])):
        kinds.add_row(kind, str(row["replays"]), str(row["steps"]),
                      f"[bold red]{row['fail']}[/bold red]" if row["fail"] else "0",
                      f"{row['fail'] / row['replays']:.0%}", str(row["infra"]))
    console.print(kinds)

    for title, items in (("fidelity failures", report["failed"]),
                         ("infra errors", report["infra"])):
        if not items:
            continue
        table = Table(title=title)
        for col in ("replay", "detail", "kept"):
            table.add_column(col, overflow="fold")
        for item in items:
            table.add_row(item["name"], escape(item["detail"] or ""), item.get("kept") or "-")
        console.print(table)
    if pool["quarantine_reasons"]:
        console.print(escape("desktops' last errors: " + "; ".join(pool["quarantine_reasons"])),
                      highlight=False)


# --------------------------------------------------------------------------- CLI


def main(argv: list[str] | None = None) -> int:
    from rich.console import Console

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=1, help="replays of every task")
    parser.add_argument("--concurrency", type=int, default=4,
                        help="desktops, and replays at once")
    parser.add_argument("--tasks", nargs="+", metavar="ID", help="task ids or domains")
    parser.add_argument("--tasks-file", type=Path, metavar="F",
                        help="task ids, domains or domain/id, one per line (with --tasks: both)")
    parser.add_argument("--nothing", action="store_true",
                        help="play only finished(): every task's untouched desktop must score 0")
    parser.add_argument("--suite", default="tasks/demo")
    parser.add_argument("--config", default="configs/demo.yaml")
    parser.add_argument("--start-timeout", type=float, default=180.0,
                        help="seconds a desktop may take to start (all start at once)")
    parser.add_argument("--keep", type=Path, nargs="?", const=True, default=None,
                        metavar="DIR", help="keep failing replays' screenshots and logs")
    parser.add_argument("--json", type=Path, metavar="OUT", help="also write the figures here")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="a config override (repeatable)")
    args = parser.parse_args(argv)
    if args.repeat < 1 or args.concurrency < 1:
        parser.error("--repeat and --concurrency must be at least 1")
    if args.tasks_file is not None:
        try:
            listed = args.tasks_file.read_text(encoding="utf-8").split()
        except OSError as exc:
            parser.error(f"--tasks-file: {exc}")
        args.tasks = [*(args.tasks or []), *listed]
    if shutil.which("Xvfb") is None:
        print("needs Xvfb (scripts/setup_env.sh)", file=sys.stderr)
        return 2
    if args.keep is True:
        args.keep = Path(tempfile.mkdtemp(prefix=KEEP_PREFIX, dir="/tmp"))
    # Paths given relative to where the command runs, before the move to the repository.
    args.keep = args.keep.resolve() if args.keep is not None else None
    args.json = args.json.resolve() if args.json is not None else None
    args.suite = str(Path(args.suite).resolve()) if Path(args.suite).exists() else args.suite
    console = Console(width=None if sys.stdout.isatty() else 160)
    os.chdir(ROOT)  # task files name their files relative to the repository, as OSWorld's do
    # Ctrl-C, SIGINT or SIGTERM end the run cleanly: desktops stopped, their folder removed.
    # A shell's background job starts with SIGINT ignored: handle it anyway.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        report = asyncio.run(run(args, console))
    except KeyboardInterrupt:
        print("interrupted; desktops stopped", file=sys.stderr)
        return 130
    print_report(console, report)
    if args.keep is not None:
        kept = [r["kept"] for r in report["records"] if r.get("kept")]
        if kept:
            console.print(f"kept {len(kept)} failing replays under {args.keep}", highlight=False)
        else:
            with contextlib.suppress(OSError):
                args.keep.rmdir()  # empty: every replay passed
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))
    return 0 if report["failures"] == 0 and report["infra_errors"] == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
