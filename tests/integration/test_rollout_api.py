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
