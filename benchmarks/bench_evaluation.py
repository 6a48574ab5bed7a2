"""Time per evaluation: how long scoring an episode takes, by metric and route (native, or
OSWorld's own code in the warm evaluator worker), on real local desktops.

    python benchmarks/bench_evaluation.py [--suite tasks/osworld_demo] [--repeats 5] [--json F]

For each task of the suite (OSWorld layout) it plays the reference solution on a local
desktop (tasks/*/examples: setup, actions), then runs the task's evaluator ``--repeats``
times on that solved desktop (getters, postconfig and metrics: the whole of what a runner
awaits after the last step) and prints per task and per metric the median and slowest time,
and the evaluator worker's cold start (the first bridged evaluation of a runner pays it once).
Needs the osworld desktop profile and .venv-osworld (scripts/setup_env.sh --osworld).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from cua_rollout.config import load_config  # noqa: E402
from cua_rollout.evaluation import Evaluator, route_problem  # noqa: E402
from cua_rollout.runtime.pool import DesktopPool  # noqa: E402
from cua_rollout.runtime.replay import play, run_concurrently, score, with_upload_root  # noqa: E402


def _tasks(suite: Path) -> list[tuple[str, dict[str, Any]]]:
    index = json.loads((suite / "test_all.json").read_text())
    return [(d, json.loads((suite / "examples" / d / f"{i}.json").read_text()))
            for d, ids in index.items() for i in ids]


def _metric(task: dict[str, Any]) -> str:
    func = task["evaluator"]["func"]
    return "+".join(func) if isinstance(func, list) else str(func)


async def _run(args: argparse.Namespace) -> dict[str, Any]:
    suite = Path(args.suite).resolve()
    state_dir = Path(tempfile.mkdtemp(prefix="be-", dir="/tmp"))
    cfg = load_config(args.config, [f"desktops.local.state_dir={state_dir}",
                                    f"desktops.count={args.desktops}"])
    cfg = with_upload_root(cfg, ROOT)
    pool = DesktopPool(cfg.desktops)
    evaluator = Evaluator.from_config(cfg)
    rows: list[dict[str, Any]] = []
    cold_s = None
    try:
        if evaluator.bridge is not None:  # the worker's start, once per runner process
            started = time.monotonic()
            await evaluator.bridge.catalog()
            cold_s = time.monotonic() - started
        await pool.start()

        async def one(domain: str, task: dict[str, Any]) -> None:
            times: list[float] = []
            scores: list[float] = []

            async def again(env: Any, last_action: str | None) -> None:
                for _ in range(args.repeats - 1):
                    started = time.monotonic()
                    scores.append(await score(env, task, last_action, cfg, evaluator))
                    times.append(time.monotonic() - started)

            stats: dict[str, Any] = {}
            first = await play(cfg, pool, task, task["reference_solution"],
                               evaluator=evaluator, stats=stats, then=again,
                               shots=args.shots / task["id"] if args.shots else None)
            times.insert(0, stats["evaluation_s"])
            route = route_problem(task["evaluator"], "auto", None)[0]
            rows.append({"domain": domain, "task": task["id"], "metric": _metric(task),
                         "route": "native" if route is not None else "osworld",
                         "score": first, "repeat_scores": scores,
                         "median_s": statistics.median(times), "max_s": max(times),
                         "times_s": times})

        outcomes = await run_concurrently(
            [(t["id"], one(d, t)) for d, t in _tasks(suite)], cfg.desktops.count)
        errors = {k: f"{type(v).__name__}: {v}" for k, v in outcomes.items()
                  if isinstance(v, BaseException)}
    finally:
        if evaluator.bridge is not None:
            await evaluator.bridge.close()
        await pool.stop()
        shutil.rmtree(state_dir, ignore_errors=True)
    every = [t for r in rows for t in r["times_s"]]
    slowest = max(rows, key=lambda r: r["median_s"]) if rows else None
    return {"suite": str(suite), "repeats": args.repeats, "worker_cold_start_s": cold_s,
            "evaluations": len(every),
            "median_s": statistics.median(every) if every else None,
            "slowest": slowest and {"task": slowest["task"], "metric": slowest["metric"],
                                    "median_s": slowest["median_s"]},
            "by_route": {route: statistics.median([t for r in rows if r["route"] == route
                                                   for t in r["times_s"]])
                         for route in {r["route"] for r in rows}},
            "tasks": sorted(rows, key=lambda r: (r["domain"], r["task"])), "errors": errors}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--suite", default="tasks/osworld_demo")
    parser.add_argument("--config", default="configs/osworld_demo.yaml")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--desktops", type=int, default=2)
    parser.add_argument("--json", type=Path, help="also write the figures here")
    parser.add_argument("--shots", type=Path, help="screenshots of each episode, per task")
    args = parser.parse_args(argv)
    os.chdir(ROOT)  # task files name their uploads relative to the repository
    report = asyncio.run(_run(args))
    print(f"{'domain':20} {'task':32} {'metric':34} {'route':7} score  median    max")
    for r in report["tasks"]:
        print(f"{r['domain']:20} {r['task'][:32]:32} {r['metric'][:34]:34} {r['route']:7} "
              f"{r['score']:<5}  {r['median_s']:6.3f}s {r['max_s']:6.3f}s")
    if report["evaluations"]:
        print(f"\n{report['evaluations']} evaluations: median {report['median_s']:.3f} s; "
              f"by route {({k: round(v, 3) for k, v in report['by_route'].items()})}; slowest "
              f"{report['slowest']['metric']} ({report['slowest']['task']}) "
              f"{report['slowest']['median_s']:.3f} s median; worker cold start "
              f"{report['worker_cold_start_s'] or 0:.2f} s")
    for name, error in report["errors"].items():
        print(f"ERROR {name}: {error}")
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))
    return 1 if report["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
