"""A disk budget on a real run: run.py (a subprocess on real Ray, the demo's local desktops and
scripted policy) samples three demo tasks over many passes with ``storage.retention:
{images: after_ack, max_gb: <small>}``, next to a trainer (this test's thread, the training
API) that claims groups with their steps and acks them. Every claimed group has all the
screenshots its steps name; the run writes several budgets' worth of screenshots, and the
run directory stays within the budget plus what is in flight, and ends within it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from cua_rollout.core.layout import RETENTION_STATE_FILE
from cua_rollout.core.retention import read_marker
from cua_rollout.training import TrainingIndex, default_url
from tests.support import REPO_ROOT, run_results

pytestmark = [pytest.mark.integration, pytest.mark.slow]

DEMO = REPO_ROOT / "configs" / "demo.yaml"
TASKS = ["terminal-hello-file", "calc-add", "editor-save-new-file"]
ROLLOUTS, PASSES = 2, 16
# ~4 MB of SQLite WAL (kept at its largest), results and traj lines, and a few groups' ~40 KB
# screenshots.
BUDGET_BYTES = 5_500_000
RUN_TIMEOUT_S = 600


def _du(path: Path) -> int:
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(root, name)).st_size
            except OSError:
                continue  # removed while walking
    return total


def _pngs(path: Path) -> int:
    return sum(1 for _ in path.rglob("step_*.png"))


def test_a_run_with_after_ack_and_a_trainer_stays_within_its_budget(tmp):
    run_dir = tmp / "results" / "budget"
    args = [sys.executable, str(REPO_ROOT / "run.py"), "--config", str(DEMO)]
    retention = {"images": "after_ack", "max_gb": BUDGET_BYTES / 1e9, "sweep_interval_s": 0.5}
    for s in (f"run.output_dir={tmp / 'results'}", "run.name=budget",
              f"desktops.local.state_dir={tmp / 'desktops'}", "ray.include_dashboard=false",
              f"tasks.task_ids={json.dumps(TASKS)}", f"tasks.rollouts_per_task={ROLLOUTS}",
              f"tasks.passes={PASSES}", "runner.action_pause_s=0.2",
              f"storage.retention={json.dumps(retention)}"):
        args += ["--set", s]
    driver = subprocess.Popen(args, cwd=REPO_ROOT, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)
    stop = threading.Event()
    claimed: list[str] = []
    problems: list[Any] = []
    sizes: list[int] = []

    def trainer() -> None:
        try:
            while not (run_dir / "index.db").exists() and not stop.is_set():
                time.sleep(0.2)
            with TrainingIndex(default_url(run_dir)) as index:
                while not stop.is_set():
                    for claim in index.claim_groups(4, "trainer", lease_s=120,
                                                    load_steps=True):
                        for episode in claim.episodes:
                            names = [s["screenshot_file"] for s in episode["steps"]
                                     if s.get("screenshot_file")]
                            gone = [n for n in names
                                    if not (Path(episode["dir"]) / n).is_file()]
                            if gone or read_marker(episode["dir"]) is not None:
                                problems.append((claim.group_id, gone))
                        assert index.ack([claim]) == []
                        claimed.append(claim.group_id)
                    sizes.append(_du(run_dir))
                    stop.wait(0.3)
        except BaseException as exc:
            problems.append(exc)

    thread = threading.Thread(target=trainer, daemon=True)
    thread.start()
    try:
        _, err = driver.communicate(timeout=RUN_TIMEOUT_S)
        assert driver.returncode == 0, err[-3000:]
        deadline = time.monotonic() + 60
        while len(claimed) < len(TASKS) * PASSES and time.monotonic() < deadline:
            time.sleep(0.2)
    finally:
        stop.set()
        if driver.poll() is None:
            driver.kill()
            driver.wait()
        thread.join(30)

    results = run_results(run_dir)
    assert problems == []
    assert len(results) == len(TASKS) * ROLLOUTS * PASSES
    assert sorted(claimed) == sorted({r["group_id"] for r in results})
    # Retention acted: most episodes have a marker, and the run wrote several budgets.
    markers = [read_marker(run_dir / r["episode_id"]) for r in results]
    removed = [m for m in markers if m is not None]
    freed = sum(m.bytes_freed for m in removed)
    assert removed and all(m.policy == "after_ack" for m in removed)
    written = freed + sum(p.stat().st_size for p in run_dir.rglob("step_*.png"))
    others = {p.name: p.stat().st_size for p in run_dir.iterdir() if p.is_file()}
    assert written > 2 * BUDGET_BYTES, (written, freed, others)
    # While episodes kept coming the run directory stayed near its budget: over it only by
    # what the sweep interval and the trainer's lag let in (a few groups' screenshots).
    one_episode = written / len(results)
    slack = 4 * ROLLOUTS * one_episode
    assert sizes and max(sizes) <= BUDGET_BYTES + slack, (max(sizes), BUDGET_BYTES, slack)
    state = json.loads((run_dir / RETENTION_STATE_FILE).read_text())
    assert state["totals"]["bytes_freed"] == freed
    # (A warning may stand: the run's last sweep can see groups the trainer had not acked.)
    assert state["warning"] is None or "not acked yet" in state["warning"]
    # After the run the storage's last sweeps had every group acked: within the budget.
    assert _du(run_dir) <= BUDGET_BYTES + slack
    print(f"\nwritten {written / 1e6:.1f} MB, freed {freed / 1e6:.1f} MB, "
          f"max run dir {max(sizes) / 1e6:.1f} MB (budget {BUDGET_BYTES / 1e6:.1f} MB), "
          f"{_pngs(run_dir)} screenshots left")
