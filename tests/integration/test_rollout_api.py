"""The Python API (``cua_rollout.runtime.driver.Rollout``) as a trainer in the same process
uses it: real Ray, the real actors and the scripted policy, on the text demo's math items
(no desktops): blocking and async, a rerun that resumes with nothing left, a drain."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from cua_rollout.config import Config, load_config
from cua_rollout.runtime.driver import Rollout
from tests.support import REPO_ROOT

pytestmark = [pytest.mark.integration, pytest.mark.slow]

MATH = REPO_ROOT / "tasks" / "text_demo" / "math.jsonl"


def _config(tmp: Path, name: str = "api") -> Config:
    path = tmp / "api.yaml"
    path.write_text(json.dumps({
        "run": {"name": name, "output_dir": str(tmp / "results")},
        "tasks": {"rollouts_per_task": 2,
                  "benchmarks": [{"source": str(MATH), "mode": "math",
                                  "metric": "numeric_match"}]},
        "model": {"scripted": True, "sampling": {"temperature": 0.0}},
        "coordinator": {"max_concurrent_episodes": 4, "episodes_per_runner": 4},
        "ray": {"include_dashboard": False},
        "monitoring": {"progress_bar": False},
    }))
    return load_config(path)


def test_a_run_from_python_yields_each_result_and_resumes(tmp_path):
    items = [json.loads(line) for line in MATH.read_text().splitlines()]
    with Rollout(_config(tmp_path)) as rollout:
        records = list(rollout.results())
    assert rollout.status == "finished" and rollout.fatal is None
    assert sorted(r["task_id"] for r in records) == sorted(i["id"] for i in items for _ in "ab")
    on_disk = (rollout.run_dir / "results.jsonl").read_text().splitlines()
    assert sorted(json.loads(x)["episode_id"] for x in on_disk) == \
        sorted(r["episode_id"] for r in records)
    assert rollout.summary is not None
    run_json = json.loads((rollout.run_dir / "run.json").read_text())
    assert run_json["status"] == "finished" and run_json["summary"] == rollout.summary

    async def again() -> tuple[str, list[dict]]:
        async with Rollout(_config(tmp_path)) as second:
            records = [r async for r in second.aresults()]
        return second.status, records

    status, resumed = asyncio.run(again())
    assert resumed == [] and status == "finished"  # nothing is run twice


def test_a_drained_run_ends_interrupted_and_a_rerun_finishes_it(tmp_path):
    items = [json.loads(line) for line in MATH.read_text().splitlines()]
    rollout = Rollout(_config(tmp_path, "drained")).start()
    try:
        rollout.drain()  # before anything was handed out: nothing starts
        first = list(rollout.results())
    finally:
        rollout.stop()
    assert rollout.status == "interrupted" and first == []
    assert rollout.summary is None  # no finished episode
    rest = Rollout(_config(tmp_path, "drained")).run()
    assert len(rest) == 2 * len(items)


def test_tasks_handed_over_in_memory_run_on_real_desktops_and_resume(tmp_path):
    """A trainer's own task dicts (OSWorld format), not a task file: played on a real local
    desktop by the scripted policy, their file kept in the run directory, a rerun with the
    same tasks runs nothing twice."""
    examples = REPO_ROOT / "tasks" / "demo" / "examples"
    tasks = [json.loads((examples / d / f"{i}.json").read_text())
             for d, i in (("terminal", "terminal-hello-file"), ("calculator", "calc-add"))]
    for task in tasks:
        task["domain"] = "given"
    cfg = load_config(REPO_ROOT / "configs" / "demo.yaml", [
        "run.name=given", f"run.output_dir={tmp_path / 'results'}", "desktops.count=1",
        "tasks.rollouts_per_task=1", "coordinator.max_concurrent_episodes=1",
        "coordinator.episodes_per_runner=1", "ray.include_dashboard=false",
        f"desktops.local.state_dir={tmp_path / 'desktops'}"])
    with Rollout(cfg, tasks=tasks) as rollout:
        records = list(rollout.results())
    assert rollout.status == "finished", rollout.problems
    assert sorted((r["task_id"], r["status"]) for r in records) == [
        ("calc-add", "success"), ("terminal-hello-file", "success")]
    given = (rollout.run_dir / "given_tasks.jsonl").read_text().splitlines()
    assert [json.loads(x)["id"] for x in given] == ["terminal-hello-file", "calc-add"]
    again = Rollout(cfg, tasks=tasks).run()
    assert again == []
