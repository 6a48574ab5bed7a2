"""What the trainer's index (cua_rollout/training) costs: the write per finished episode and the
latency of a claim with many ready groups, on SQLite (a run directory's index.db) and, with
``--postgres-url``, on PostgreSQL.

    python benchmarks/bench_training_index.py [--episodes 2000] [--group-size 8]
        [--ready-groups 10000] [--claims 200] [--postgres-url URL] [--json]

write: ``record_episode`` one episode at a time, ``--episodes`` of them in groups of
``--group-size`` (each group's last episode also makes the group). claim: ``--ready-groups``
ready groups (filled in batches with ``record_episodes``), then ``claim_groups(n=8)``
``--claims`` times (each claim acked; on PostgreSQL after an ANALYZE, see ``bench``). The
PostgreSQL database is shared: the benchmark's rows are under run names of their own,
claims are filtered by run, and they are deleted at the end.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from sqlalchemy import create_engine, text

from cua_rollout.training import TrainingIndex, default_url

CLAIM_N = 8


def _ms(values: list[float]) -> dict[str, float]:
    ordered = sorted(values)
    return {"mean": round(1000 * statistics.fmean(ordered), 3),
            "p50": round(1000 * ordered[len(ordered) // 2], 3),
            "p99": round(1000 * ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))], 3)}


def _record(group: int, rollout: int, size: int) -> dict[str, Any]:
    task = f"task{group:05d}"
    version = f"v{group // 1000}"
    return {
        "episode_id": f"bench/{task}/{rollout}", "task_id": task, "domain": "bench",
        "rollout": rollout, "attempt": 0, "status": "success" if rollout % 2 else "failure",
        "reward": float(rollout % 2), "steps": 15, "started_at": time.time(),
        "ended_at": time.time(), "instruction": f"benchmark task {group}",
        "model_version": version, "pass_index": 0, "group_id": f"bench/{task}/pass-0",
        "group_size": size, "first_model_version": version, "model_versions": [version],
        "mixed_versions": False, "model_endpoints": ["http://127.0.0.1:8000"],
        "timing": {"model_s": 12.5, "env_s": 30.1, "eval_s": 2.0},
    }


def bench(url: str, args: argparse.Namespace) -> dict[str, Any]:
    tag = uuid.uuid4().hex[:8]
    write_run, claim_run = f"bench-{tag}-write", f"bench-{tag}-claim"
    out: dict[str, Any] = {"url": url.split("@")[-1]}
    index = TrainingIndex(url)
    try:
        times, completing = [], []
        groups = args.episodes // args.group_size
        for group in range(groups):
            for rollout in range(args.group_size):
                t0 = time.perf_counter()
                made = index.record_episode(write_run, "/runs/bench",
                                            _record(group, rollout, args.group_size))
                dt = time.perf_counter() - t0
                times.append(dt)
                if made is not None:
                    completing.append(dt)
        out["record_episode_ms"] = _ms(times)
        out["record_episode_completing_group_ms"] = _ms(completing)

        t0 = time.perf_counter()
        batch = 100
        for first in range(0, args.ready_groups, batch):
            index.record_episodes(claim_run, "/runs/bench", [
                _record(g, r, args.group_size)
                for g in range(first, min(first + batch, args.ready_groups))
                for r in range(args.group_size)])
        out["fill_s"] = round(time.perf_counter() - t0, 2)
        if not url.startswith("sqlite"):
            # The planner's statistics, as autovacuum keeps them for a table that grows at
            # the pace of a run; right after a bulk fill they still describe an empty table
            # (sequential scans: claims ~10x slower until autovacuum catches up).
            engine = create_engine(url)
            with engine.connect() as conn:
                conn.execute(text("ANALYZE groups"))
                conn.execute(text("ANALYZE episodes"))
                conn.commit()
            engine.dispose()
        out["ready_groups"] = index.status(claim_run)["groups"]["ready"]

        claims, acks = [], []
        for _ in range(args.claims):
            t0 = time.perf_counter()
            got = index.claim_groups(CLAIM_N, "bench", run=claim_run)
            claims.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            index.ack(got)
            acks.append(time.perf_counter() - t0)
        out[f"claim_groups_n{CLAIM_N}_ms"] = _ms(claims)
        out["ack_ms"] = _ms(acks)
    finally:
        index.close()
        if not url.startswith("sqlite"):
            engine = create_engine(url)
            with engine.begin() as conn:
                for table in ("groups", "episodes"):
                    conn.execute(text(f"DELETE FROM {table} WHERE run IN (:a, :b)"),
                                 {"a": write_run, "b": claim_run})
            engine.dispose()
    return out


def _print(name: str, figures: dict[str, Any]) -> None:
    print(f"{name} ({figures['url']})")
    for key, value in figures.items():
        if isinstance(value, dict):
            print(f"  {key:38s} mean {value['mean']:8.3f}  p50 {value['p50']:8.3f}  "
                  f"p99 {value['p99']:8.3f}")
        elif key != "url":
            print(f"  {key:38s} {value}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--episodes", type=int, default=2000)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--ready-groups", type=int, default=10_000)
    parser.add_argument("--claims", type=int, default=200)
    parser.add_argument("--postgres-url", help="also measure this PostgreSQL database")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    args = parser.parse_args(argv)
    results = {}
    with tempfile.TemporaryDirectory(prefix="bench-index-") as tmp:
        results["sqlite"] = bench(default_url(tmp), args)
    if args.postgres_url:
        results["postgresql"] = bench(args.postgres_url, args)
    if args.json:
        print(json.dumps(results, indent=2))
    else:
        for name, figures in results.items():
            _print(name, figures)
    return 0


if __name__ == "__main__":
    sys.exit(main())
