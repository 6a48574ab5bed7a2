"""What observing the accessibility tree costs a step (OSWorld's prompt agent with
``observation_type`` a11y_tree, screenshot_a11y_tree or som), on a real local Xvfb desktop:
per demo app, the desktop's ``/accessibility`` dump (AT-SPI, over HTTP), the linearization,
the set-of-marks drawing, beside the screenshot a step takes anyway.

    python benchmarks/bench_a11y_tree.py [--repeats 20] [--tasks ID ...] [--json F]

Each task's setup runs first (its app open, as an episode's first step sees it); then each
part is timed ``--repeats`` times. Figures, never assertions.
"""

from __future__ import annotations

import argparse
import asyncio
import json
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

from cua_rollout.agents.osworld.a11y import draw_marks, linearize  # noqa: E402
from cua_rollout.config import load_config  # noqa: E402
from cua_rollout.envs.client import RemoteDesktopEnv  # noqa: E402
from cua_rollout.runtime.pool import DesktopPool  # noqa: E402
from cua_rollout.runtime.replay import with_upload_root  # noqa: E402

SUITE = ROOT / "tasks" / "demo"
DEFAULT_TASKS = ["terminal-hello-file", "editor-append-line", "calc-add"]


def _task(task_id: str) -> dict[str, Any]:
    found = next(SUITE.glob(f"examples/*/{task_id}.json"), None)
    if found is None:
        raise SystemExit(f"no demo task {task_id}")
    return json.loads(found.read_text())


def _ms(values: list[float]) -> dict[str, float]:
    ordered = sorted(values)
    return {"median_ms": round(statistics.median(ordered) * 1000, 1),
            "p90_ms": round(ordered[int(0.9 * (len(ordered) - 1))] * 1000, 1),
            "max_ms": round(ordered[-1] * 1000, 1)}


async def _timed(repeats: int, call: Any) -> tuple[list[float], Any]:
    times, result = [], None
    for _ in range(repeats):
        started = time.monotonic()
        result = await call()
        times.append(time.monotonic() - started)
    return times, result


async def _run(args: argparse.Namespace) -> list[dict[str, Any]]:
    state_dir = Path(tempfile.mkdtemp(prefix="ba-", dir="/tmp"))
    cfg = with_upload_root(load_config(ROOT / "configs" / "demo.yaml", [
        f"desktops.local.state_dir={state_dir}", "desktops.count=1"]), ROOT)
    pool = DesktopPool(cfg.desktops)
    rows = []
    try:
        await pool.start()
        lease = await pool.lease("bench-a11y")
        env = RemoteDesktopEnv(lease.url, cfg.desktops, name=lease.desktop_id)
        try:
            for task_id in args.tasks:
                await env.reset(_task(task_id))
                shot_s, shot = await _timed(args.repeats, env.observe)
                tree_s, tree = await _timed(args.repeats, env.accessibility_tree)

                async def lin(tree: str = tree) -> str:
                    return linearize(tree)

                async def som(tree: str = tree, png: bytes = shot.png) -> Any:
                    return draw_marks(png, tree)

                lin_s, table = await _timed(args.repeats, lin)
                som_s, (_, marks, _) = await _timed(args.repeats, som)
                rows.append({"task": task_id, "tree_bytes": len(tree),
                             "table_rows": table.count("\n"), "table_chars": len(table),
                             "marks": len(marks), "screenshot": _ms(shot_s),
                             "a11y_tree": _ms(tree_s), "linearize": _ms(lin_s),
                             "som_marks": _ms(som_s)})
        finally:
            await env.close()
            await pool.release(lease.lease_id)
    finally:
        await pool.stop()
        shutil.rmtree(state_dir, ignore_errors=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--tasks", nargs="+", default=DEFAULT_TASKS)
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args(argv)
    rows = asyncio.run(_run(args))
    print(f"{'task':24} {'tree KB':>8} {'rows':>5} {'marks':>5}  median / p90 ms: "
          f"{'screenshot':>12} {'a11y tree':>12} {'linearize':>11} {'som marks':>11}")
    for r in rows:
        cells = [f"{r[k]['median_ms']:.0f} / {r[k]['p90_ms']:.0f}"
                 for k in ("screenshot", "a11y_tree", "linearize", "som_marks")]
        print(f"{r['task']:24} {r['tree_bytes'] / 1024:8.1f} {r['table_rows']:5d} "
              f"{r['marks']:5d}  {cells[0]:>28} {cells[1]:>12} {cells[2]:>11} {cells[3]:>11}")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
