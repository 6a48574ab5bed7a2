"""The trainer hand-off as a user runs it: run.py (a subprocess on real Ray, real local
desktops) samples three demo tasks over three passes from a model "pool" whose endpoint
list this test publishes as run_model.py does (endpoints.json in model_pool.state_dir; the
scripted policy behind it). Mid-run the test plays a trainer's checkpoint reload: while the
list says a reload is under way, no new group starts (the checkpoint barrier); once it says
ckpt-2 is served, the later passes run on it. Two trainers follow the live run through the
index (the API in this process takes the first final group, then the docs' example as a
process takes the rest): every final group is claimed exactly once, and the export
reproduces the files' rewards."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from cua_rollout.agents.scripted_policy import ScriptedPolicy, load_solutions, scripted_server
from cua_rollout.model.fleet.state import write_state
from cua_rollout.training import TrainingIndex, default_url, export
from tests.support import REPO_ROOT, run_results

pytestmark = [pytest.mark.integration, pytest.mark.slow]

DEMO = REPO_ROOT / "configs" / "demo.yaml"
TASKS = ["terminal-hello-file", "calc-add", "editor-save-new-file"]
ROLLOUTS, PASSES = 2, 3
RUN_TIMEOUT_S = 420


_MTIME = [0]


def _publish(state_dir: Path, url: str, version: str, reload: dict[str, Any] | None) -> None:
    """endpoints.json as run_model.py writes it: one replica serving ``version`` (and an
    mtime that always moves forward, however coarse the file system's clock)."""
    _MTIME[0] = write_state(state_dir, min_mtime_ns=_MTIME[0], state={
        "format": 1, "updated_at": time.time(), "model": "ui-tars-1.5-7b",
        "checkpoint": f"/ckpt/{version}", "model_version": version, "supervisor": None,
        "reload": reload, "endpoints": [{"index": 0, "url": url, "healthy": True,
                                         "draining": False, "model_version": version}]})


def _wait(predicate: Any, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


def test_a_trainer_follows_a_run_over_passes_and_a_checkpoint_reload(tmp):
    # An imperfect policy (some episodes fail): groups with and without signal.
    policy = ScriptedPolicy(load_solutions([REPO_ROOT / "tasks" / "demo"]), error_rate=0.15,
                            seed=7, screen=(1280, 720))
    server = scripted_server(policy, model_name="ui-tars-1.5-7b").start()
    state_dir = tmp / "pool"
    state_dir.mkdir()
    _publish(state_dir, server.url, "ckpt-1", None)
    run_dir = tmp / "results" / "handoff"
    args = [sys.executable, str(REPO_ROOT / "run.py"), "--config", str(DEMO)]
    for s in (f"run.output_dir={tmp / 'results'}", "run.name=handoff",
              f"desktops.local.state_dir={tmp / 'desktops'}", "ray.include_dashboard=false",
              "model.scripted=false", "model.endpoints=[]", f"model_pool.state_dir={state_dir}",
              f"tasks.task_ids={json.dumps(TASKS)}", f"tasks.rollouts_per_task={ROLLOUTS}",
              f"tasks.passes={PASSES}", "tasks.checkpoint_barrier.enabled=true",
              "runner.action_pause_s=0.2"):
        args += ["--set", s]
    claimed_file = tmp / "claimed-by-example.tsv"
    driver = subprocess.Popen(args, cwd=REPO_ROOT, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)
    example: subprocess.Popen[str] | None = None
    mine: list[tuple[str, str]] = []
    errors: list[BaseException] = []
    stop, took_one = threading.Event(), threading.Event()

    def consume() -> None:
        """A trainer through the API, in this process: it claims the first final group, then
        leaves the rest to the example (started once it has one), so both take part
        whatever the timing. (Its failures are the test's: kept, not lost with the thread.)"""
        try:
            _wait(lambda: (run_dir / "index.db").exists(), 120, "the run's index")
            with TrainingIndex(default_url(run_dir)) as index:
                while not stop.is_set() and not mine:
                    claims = index.claim_groups(1, "in-test", lease_s=60)
                    mine.extend((c.run, c.group_id) for c in claims)
                    assert index.ack(claims) == []
                    time.sleep(0.3)
        except BaseException as exc:
            errors.append(exc)
        finally:
            took_one.set()

    consumer = threading.Thread(target=consume, daemon=True)
    consumer.start()
    try:
        # Pass 0 runs on ckpt-1; once one of its episodes is done, a reload starts.
        _wait(lambda: len(_lines(run_dir)) >= 1, RUN_TIMEOUT_S, "a first result")
        _publish(state_dir, server.url, "ckpt-1", {"id": 1, "state": "running",
                                                   "version": "ckpt-2", "batches_done": 0,
                                                   "batches_total": 1})
        # The groups already started finish (the first is the in-test trainer's).
        assert took_one.wait(RUN_TIMEOUT_S), "the in-test trainer claimed nothing"
        assert errors == [] and mine, errors
        example = subprocess.Popen(
            [sys.executable, str(REPO_ROOT / "docs" / "examples" / "trainer_loop.py"),
             "--run-dir", str(run_dir), "--consumer", "example", "--batch", "2",
             "--claimed", str(claimed_file)],
            cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        # The groups already started finish; none starts while the reload runs.
        _wait(lambda: len(_lines(run_dir)) >= len(TASKS) * ROLLOUTS, RUN_TIMEOUT_S,
              "pass 0 to finish")
        time.sleep(4)
        pass0 = _lines(run_dir)
        assert {r["pass_index"] for r in pass0} == {0}
        assert not [r for r in pass0  # no directory of pass 1's first rollout either
                    if (run_dir / r["domain"] / r["task_id"] / str(ROLLOUTS)).exists()]
        _publish(state_dir, server.url, "ckpt-2", {"id": 1, "state": "done",
                                                   "version": "ckpt-2", "batches_done": 1,
                                                   "batches_total": 1})
        _, err = driver.communicate(timeout=RUN_TIMEOUT_S)
        assert driver.returncode == 0, err[-3000:]
        _, example_err = example.communicate(timeout=120)
        assert example.returncode == 0, example_err[-3000:]
    finally:
        stop.set()
        for process in (driver, example):
            if process is not None and process.poll() is None:
                process.kill()
                process.wait()
        consumer.join(timeout=30)
        server.stop()

    results = run_results(run_dir)
    assert len(results) == len(TASKS) * ROLLOUTS * PASSES
    for r in results:
        assert r["rollout"] // ROLLOUTS == r["pass_index"]
        assert r["group_id"] == f"{r['domain']}/{r['task_id']}/pass-{r['pass_index']}"
        version = "ckpt-1" if r["pass_index"] == 0 else "ckpt-2"
        assert (r["first_model_version"], r["model_version"], r["mixed_versions"]) == (
            version, version, False), r

    # Every final group was claimed once, by one of the two trainers.
    by_example = [tuple(line.split("\t")) for line in claimed_file.read_text().splitlines()]
    claimed = by_example + mine
    assert len(claimed) == len(set(claimed)) == len(TASKS) * PASSES
    assert {g for _, g in claimed} == {r["group_id"] for r in results}
    assert by_example and len(mine) == 1  # both took part
    assert errors == []

    # The export's episode rows reproduce results.jsonl's rewards and the advantages sum
    # to ~0 within each group with signal.
    out_file = tmp / "episodes.jsonl"
    with TrainingIndex(default_url(run_dir)) as index:
        export(out_file, index, per="episode")
        assert index.status()["groups"]["acked"] == len(TASKS) * PASSES
    rows = [json.loads(x) for x in out_file.read_text().splitlines()]
    assert {(r["episode_id"], r["reward"]) for r in rows} == {
        (r["episode_id"], r["reward"]) for r in results}
    for group_id in {r["group_id"] for r in rows}:
        advantages = [r["advantage"] for r in rows if r["group_id"] == group_id]
        assert abs(sum(a for a in advantages if a is not None)) < 1e-6


def _lines(run_dir: Path) -> list[dict[str, Any]]:
    try:
        return run_results(run_dir)
    except FileNotFoundError:
        return []
