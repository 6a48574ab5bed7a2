"""Episodes per minute of each text mode on this machine: ``run.py`` as a user runs it (its own
Ray, the scripted policy replaying the demo benchmarks' tool calls, the real sandbox, embedding
model and corpus server), one run per mode.

    python benchmarks/bench_text.py [--rollouts 10] [--concurrency 16] [--modes math py rag web]
        [--latency-s 0.0] [--json out.json]

Each run repeats its mode's demo benchmark (``tasks/text_demo/<mode>.jsonl``) ``--rollouts``
times per item; ``--latency-s`` adds a model latency per reply (the scripted policy answers at
once by default, so the figure is the service's and the tools' own cost; with a latency it is
served from this process, ``model.scripted`` having no such knob). Episodes per minute
are counted over the window from the first episode's start to the last one's end
(results.jsonl), so Ray's start-up is left out; tool seconds are the mean and median per call
from the episodes' traj.jsonl (py's demo includes a runaway loop killed at the 5 s limit).
Prints a table; ``--json`` writes it.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from cua_rollout.config import load_config  # noqa: E402
from cua_rollout.runtime.launch import scripted_policy_server  # noqa: E402

CONFIG = ROOT / "configs" / "text_demo.yaml"
METRICS = {"math": "numeric_match", "py": "numeric_match", "rag": "contains_answer",
           "web": "contains_answer"}


def run_mode(mode: str, rollouts: int, concurrency: int, latency_s: float,
             tmp: Path) -> dict[str, Any]:
    bench = [{"source": str(ROOT / "tasks" / "text_demo" / f"{mode}.jsonl"), "mode": mode,
              "metric": METRICS[mode]}]
    sets = [f"run.output_dir={tmp}", f"run.name={mode}", f"tasks.benchmarks={json.dumps(bench)}",
            f"tasks.rollouts_per_task={rollouts}",
            f"coordinator.max_concurrent_episodes={concurrency}",
            f"coordinator.episodes_per_runner={concurrency}",
            f"text.rag.cache_dir={tmp / 'rag-cache'}",
            "ray.include_dashboard=false", "monitoring.progress_bar=false"]
    with contextlib.ExitStack() as stack:
        if latency_s:
            with contextlib.chdir(ROOT):  # the config's relative paths, as run.py sees them
                server = scripted_policy_server(load_config(CONFIG, sets), latency_s=latency_s)
            stack.enter_context(server)
            sets += ["model.scripted=false", f"model.endpoints={json.dumps([server.url])}"]
        args = [sys.executable, str(ROOT / "run.py"), "--config", str(CONFIG)]
        for s in sets:
            args += ["--set", s]
        started = time.monotonic()
        done = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=1800)
        wall = time.monotonic() - started
    if done.returncode != 0:
        raise SystemExit(f"{mode}: run.py exited {done.returncode}:\n{done.stderr[-2000:]}")
    run_dir = tmp / mode
    records = [json.loads(x) for x in (run_dir / "results.jsonl").read_text().splitlines()]
    first = min(r["started_at"] for r in records)
    last = max(r["ended_at"] for r in records)
    tool_s: list[float] = []
    turns = 0
    for r in records:
        traj = run_dir / r["domain"] / r["task_id"] / str(r["rollout"]) / "traj.jsonl"
        for line in traj.read_text().splitlines():
            step = json.loads(line)
            turns += 1
            tool_s += [c["duration_s"] for c in step.get("tool_calls") or []]
    return {
        "mode": mode, "episodes": len(records),
        "success": sum(r["status"] == "success" for r in records),
        "episodes_per_min": round(len(records) / max(last - first, 1e-9) * 60, 1),
        "turns_per_s": round(turns / max(last - first, 1e-9), 2),
        "mean_episode_s": round(statistics.fmean(r["duration_s"] for r in records), 3),
        "tool_calls": len(tool_s),
        "mean_tool_s": round(statistics.fmean(tool_s), 4) if tool_s else None,
        "median_tool_s": round(statistics.median(tool_s), 4) if tool_s else None,
        "window_s": round(last - first, 1), "wall_s": round(wall, 1),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--modes", nargs="+", default=list(METRICS), choices=list(METRICS))
    parser.add_argument("--rollouts", type=int, default=10)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--latency-s", type=float, default=0.0)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-text-") as tmp:
        for mode in args.modes:
            rows.append(run_mode(mode, args.rollouts, args.concurrency, args.latency_s,
                                 Path(tmp)))
            print(json.dumps(rows[-1]), flush=True)
    print(f"\n{'mode':6} {'episodes':>8} {'success':>7} {'ep/min':>8} {'turns/s':>8} "
          f"{'episode s':>9} {'tool calls':>10} {'tool s':>8} {'median':>8}")
    for r in rows:
        tool = "-" if r["mean_tool_s"] is None else f"{r['mean_tool_s']:.4f}"
        median = "-" if r["median_tool_s"] is None else f"{r['median_tool_s']:.4f}"
        print(f"{r['mode']:6} {r['episodes']:8} {r['success']:7} {r['episodes_per_min']:8} "
              f"{r['turns_per_s']:8} {r['mean_episode_s']:9} {r['tool_calls']:10} {tool:>8} "
              f"{median:>8}")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
