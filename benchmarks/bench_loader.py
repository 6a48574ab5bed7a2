"""What the driver's loader costs as a service run ages (issue 33; the scale review's §4a and
§4b): one driver iteration's loader calls with 10^4 to 10^6 episodes recorded, and a
restart's reading of a results.jsonl of that many lines.

    python benchmarks/bench_loader.py [--sizes 10000 100000 1000000] [--tasks 369]
        [--rollouts 8] [--batch 8] [--iterations 30] [--index]
        [--skip-iteration] [--skip-start] [--json]

iteration: a loader in service mode (``tasks.passes: 0``, ``--tasks`` tasks of ``--rollouts``
rollouts a pass) is filled to each size by handing out and recording whole passes; then, per
iteration, ``record_result`` for ``--batch`` handed-out episodes, ``poll(refresh=False)`` and
``total_known()``, as the driver's loop calls them (cua_rollout/runtime/driver.py). Also the
process's RSS and how much of it the loader holds.

start: a results.jsonl of that many lines (records as the coordinator writes them, ~0.8 KB, with
a few infra errors, cancelled lines rerun later and a last line cut by a crash), then the
steps of a restart in that order, each in a process of its own for its peak memory: the
storage's repair and compaction (``StorageActor.start_run``'s), the loader's resume scan, and
with ``--index`` the trainer index's reindex (a first one into an empty database, then the
one a restart does).

Prints figures; asserts nothing. Each size runs in fresh processes.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from cua_rollout.config import TasksConfig
from cua_rollout.core.types import EpisodeResult

# One in this many episodes ends as an infra error (dropped and rerun by a restart), one in
# this many was cut as a straggler first (a cancelled line, then its final one).
_INFRA_EVERY = 199
_CANCELLED_EVERY = 313


def _rss_mb() -> float:
    """The process's resident memory now."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _peak_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _write_tasks(path: Path, tasks: int) -> Path:
    with open(path, "w") as f:
        for i in range(tasks):
            f.write(json.dumps({"id": f"t{i:04d}", "domain": f"d{i % 7}",
                                "instruction": f"benchmark task {i}"}) + "\n")
    return path


def _tasks_cfg(source: Path, rollouts: int) -> TasksConfig:
    return TasksConfig(source=source, rollouts_per_task=rollouts, passes=0,
                       poll_interval_s=3600.0)


def _result(task_id: str, domain: str, rollout: int, pass_index: int, size: int,
            status: str) -> dict[str, Any]:
    reward = None if status in ("infra_error", "cancelled") else float(rollout % 3 == 0)
    return {"task_id": task_id, "domain": domain, "rollout": rollout,
            "episode_id": f"{domain}/{task_id}/{rollout}", "status": status, "reward": reward,
            "pass_index": pass_index, "group_size": size}


def example_result(task_id: str, domain: str, rollout: int, *, attempt: int = 0,
                   pass_index: int = 0, group_size: int | None = None,
                   status: str = "success", reward: float | None = 1.0,
                   started_at: float = 1.7e9) -> EpisodeResult:
    """An episode's result as a runner returns it, with the fields a real one fills (its
    results.jsonl line is ~0.8 KB): what the benchmarks of the central components write,
    record and send."""
    return EpisodeResult(
        f"{domain}/{task_id}/{rollout}", task_id, domain, rollout, attempt, status, reward, 12,
        started_at, started_at + 48.0,
        instruction="benchmark task: open the file in the editor and change the first line",
        model_version="ckpt-00012", model_endpoints=["http://10.0.3.17:8000/v1"],
        first_model_version="ckpt-00012", model_versions=["ckpt-00012"],
        pass_index=pass_index, group_id=f"{domain}/{task_id}/pass-{pass_index}",
        group_size=group_size,
        desktop="cua-r0123456789ab-17-9f3c", desktops_tried=["cua-r0123456789ab-17-9f3c"],
        last_action="pyautogui.hotkey('ctrl', 's')", runner="runner-3", node="10.0.3.4",
        timing={"model_s": 21.4, "action_s": 9.7, "screenshot_s": 3.1, "pause_s": 10.0,
                "reset_s": 2.2, "evaluate_s": 1.5},
    )


# --------------------------------------------------------------------------- iteration


def _iteration(args: argparse.Namespace, size: int, work: Path) -> dict[str, Any]:
    base_rss = _rss_mb()
    loader, outstanding, fill_s = fill_loader(size, work, args.tasks, args.rollouts)
    rss = _rss_mb()
    timed = time_iterations(loader, outstanding, args.batch, args.iterations)
    return {"size": size, "fill_s": round(fill_s, 2),
            **{k: _ms(v) for k, v in timed.items()},
            "rss_mb": round(rss, 1), "loader_mb": round(rss - base_rss, 1)}


def fill_loader(size: int, work: Path, tasks: int, rollouts: int
                ) -> tuple[Any, list[Any], float]:
    """A loader in service mode (``tasks`` tasks of ``rollouts`` rollouts a pass, the task
    file written into ``work``) that has handed out and recorded ``size`` episodes, whole
    passes; with what it handed out and is not recorded yet, and the seconds the filling
    took."""
    from cua_rollout.runtime.loader import TaskLoader

    cfg = _tasks_cfg(_write_tasks(work / "tasks.jsonl", tasks), rollouts)
    loader = TaskLoader(cfg, work / "run")
    outstanding: list[Any] = []
    recorded = 0
    t0 = time.perf_counter()
    while recorded < size:
        if not outstanding:
            outstanding = loader.poll(refresh=False)
        take = min(len(outstanding), size - recorded)
        for spec in outstanding[:take]:
            loader.record_result(_spec_result(spec))
        outstanding = outstanding[take:]
        recorded += take
    fill_s = time.perf_counter() - t0
    loader.total_known()
    return loader, outstanding, fill_s


def time_iterations(loader: Any, outstanding: list[Any], batch: int, iterations: int
                    ) -> dict[str, list[float]]:
    """The driver's loop (cua_rollout/runtime/driver.py) ``iterations`` times: ``batch``
    results arrive, the loader hears of them (``record_result``), hands out what they made
    possible (``poll``) and the progress line asks for the total (``total_known``). Seconds
    per iteration of each (``record_batch``, ``poll``, ``total_known``) and of the whole
    (``iteration``). ``outstanding`` (handed out, not recorded) is used and refilled."""
    iters: list[float] = []
    polls: list[float] = []
    totals: list[float] = []
    records: list[float] = []
    for _ in range(iterations):
        if len(outstanding) < batch:
            outstanding.extend(loader.poll(refresh=False))
        now, rest = outstanding[:batch], outstanding[batch:]
        outstanding[:] = rest
        t0 = time.perf_counter()
        for spec in now:
            loader.record_result(_spec_result(spec))
        t1 = time.perf_counter()
        outstanding.extend(loader.poll(refresh=False))
        t2 = time.perf_counter()
        loader.total_known()
        t3 = time.perf_counter()
        records.append(t1 - t0)
        polls.append(t2 - t1)
        totals.append(t3 - t2)
        iters.append(t3 - t0)
    return {"iteration_ms": iters, "record_batch_ms": records, "poll_ms": polls,
            "total_known_ms": totals}


def _spec_result(spec: Any) -> dict[str, Any]:
    return _result(spec.task_id, spec.domain, spec.rollout, spec.pass_index,
                   spec.group_size or 0, "success")


def _ms(values: list[float]) -> dict[str, float]:
    ordered = sorted(values)
    return {"p50": round(1000 * statistics.median(ordered), 3),
            "max": round(1000 * ordered[-1], 3)}


# --------------------------------------------------------------------------- start-up


def _write_results(path: Path, size: int, tasks: int, rollouts: int) -> int:
    """``size`` result lines of a service run, pass after pass (the last one partial), as
    the coordinator writes them; a few infra errors, cancelled lines with their reruns later
    in the file, and a last line cut short. Returns the bytes written."""
    template = example_result("t0000", "d0", 0).record()
    dumps = json.JSONEncoder(ensure_ascii=False, separators=(",", ":")).encode
    written = 0
    rerun: list[dict[str, Any]] = []
    with open(path, "w", encoding="utf-8") as f:
        n = 0
        while n < size:
            p = n // (tasks * rollouts)
            i = (n // rollouts) % tasks
            r = p * rollouts + n % rollouts
            task_id, domain = f"t{i:04d}", f"d{i % 7}"
            status = "infra_error" if n % _INFRA_EVERY == 0 else "success" if r % 3 == 0 \
                else "failure"
            record = {**template, **_result(task_id, domain, r, p, rollouts, status),
                      "group_id": f"{domain}/{task_id}/pass-{p}",
                      "started_at": 1.7e9 + n, "ended_at": 1.7e9 + n + 48.0}
            if n % _CANCELLED_EVERY == 0 and status != "infra_error":
                rerun.append(record)
                record = {**record, "status": "cancelled", "reward": None,
                          "error": "straggler cut"}
            line = dumps(record) + "\n"
            f.write(line)
            written += len(line)
            n += 1
            if len(rerun) > 8 or (n >= size and rerun):
                for again in rerun:
                    line = dumps(again) + "\n"
                    f.write(line)
                    written += len(line)
                rerun = []
        f.write('{"episode_id":"d0/t0000/999999","status":"succ')  # a crash's cut line
    return written


def _start_step(step: str, args: argparse.Namespace, work: Path) -> dict[str, Any]:
    from cua_rollout.core.files import repair_jsonl_tail
    from cua_rollout.core.layout import RESULTS_FILE, SUPERSEDED_RESULTS_FILE

    run_dir = work / "run"
    base = _rss_mb()
    t0 = time.perf_counter()
    out: dict[str, Any] = {}
    if step == "storage":
        from cua_rollout.runtime.storage import compact_results

        out["cut_bytes"] = repair_jsonl_tail(run_dir / RESULTS_FILE)
        out["compacted"] = compact_results(run_dir / RESULTS_FILE,
                                           run_dir / SUPERSEDED_RESULTS_FILE, ("infra_error",))
    elif step == "loader":
        from cua_rollout.runtime.loader import TaskLoader

        loader = TaskLoader(_tasks_cfg(work / "tasks.jsonl", args.rollouts), run_dir)
        out["to_hand_out"] = len(loader.poll(refresh=False))
        out["finished_before"] = loader.finished_before()
        out["total_known"] = loader.total_known()
    else:
        from cua_rollout.training import TrainingIndex, default_url

        with TrainingIndex(default_url(run_dir)) as index:
            done = index.reindex(run_dir, "bench")
        out["inserted"], out["unchanged"] = done["inserted"], done["unchanged"]
    out["seconds"] = round(time.perf_counter() - t0, 2)
    out["peak_mb"] = round(_peak_mb() - base, 1)
    return out


# --------------------------------------------------------------------------- driver


def _child(argv: list[str]) -> dict[str, Any]:
    """Run one measurement in a fresh interpreter; its JSON result."""
    done = subprocess.run([sys.executable, __file__, *argv], capture_output=True, text=True,
                          check=False)
    if done.returncode != 0:
        return {"error": done.stderr.strip().splitlines()[-1:] or [f"exit {done.returncode}"]}
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[10_000, 100_000, 1_000_000])
    parser.add_argument("--tasks", type=int, default=369)
    parser.add_argument("--rollouts", type=int, default=8)
    parser.add_argument("--batch", type=int, default=8, help="results per driver iteration")
    parser.add_argument("--iterations", type=int, default=30)
    parser.add_argument("--index", action="store_true", help="also time the index's reindex")
    parser.add_argument("--skip-iteration", action="store_true")
    parser.add_argument("--skip-start", action="store_true")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--child", nargs=3, metavar=("WHAT", "SIZE", "WORK"),
                        help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    common = ["--tasks", str(args.tasks), "--rollouts", str(args.rollouts),
              "--batch", str(args.batch), "--iterations", str(args.iterations)]
    if args.child:
        what, size, work = args.child
        result = (_iteration(args, int(size), Path(work)) if what == "iteration"
                  else _start_step(what, args, Path(work)))
        print(json.dumps(result))
        return 0

    rows = []
    for size in args.sizes:
        row: dict[str, Any] = {"size": size}
        with tempfile.TemporaryDirectory(prefix="bench-loader-") as tmp:
            work = Path(tmp)
            if not args.skip_iteration:
                row["iteration"] = _child(["--child", "iteration", str(size), tmp, *common])
                shutil.rmtree(work / "run", ignore_errors=True)
            if not args.skip_start:
                (work / "run").mkdir(exist_ok=True)
                _write_tasks(work / "tasks.jsonl", args.tasks)
                row["results_mb"] = round(_write_results(
                    work / "run" / "results.jsonl", size, args.tasks, args.rollouts) / 2**20, 1)
                steps = ["storage", "loader"] + (["index", "index"] if args.index else [])
                for n, step in enumerate(steps):
                    name = step if step != "index" or steps[:n].count("index") == 0 \
                        else "index_restart"
                    row[name] = _child(["--child", step, str(size), tmp, *common])
        rows.append(row)
        if not args.json:
            _print_row(row)
    if args.json:
        print(json.dumps(rows, indent=2))
    return 0


def _print_row(row: dict[str, Any]) -> None:
    print(f"== {row['size']:,} episodes")
    it = row.get("iteration")
    if it and "error" not in it:
        print(f"  iteration: {it['iteration_ms']['p50']:.3f} ms p50 "
              f"({it['iteration_ms']['max']:.3f} max): record_result x batch "
              f"{it['record_batch_ms']['p50']:.3f}, poll {it['poll_ms']['p50']:.3f}, "
              f"total_known {it['total_known_ms']['p50']:.3f}; "
              f"RSS {it['rss_mb']} MB, loader {it['loader_mb']} MB (filled in {it['fill_s']} s)")
    elif it:
        print(f"  iteration: failed: {it['error']}")
    if "results_mb" in row:
        print(f"  start, results.jsonl {row['results_mb']} MB:")
        for step in ("storage", "loader", "index", "index_restart"):
            if step in row:
                got = row[step]
                if "error" in got:
                    print(f"    {step}: failed: {got['error']}")
                    continue
                extra = ", ".join(f"{k} {v}" for k, v in got.items()
                                  if k not in ("seconds", "peak_mb"))
                print(f"    {step}: {got['seconds']} s, peak +{got['peak_mb']} MB ({extra})")
    sys.stdout.flush()


if __name__ == "__main__":
    raise SystemExit(main())
