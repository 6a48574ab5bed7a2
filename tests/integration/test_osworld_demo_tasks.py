"""The OSWorld-format demo suite (tasks/osworld_demo): at least two tasks per OSWorld domain,
on the apps of the osworld desktop profile, set up with OSWorld's setup steps and scored with
OSWorld's getters and metrics (ours where native, OSWorld's own code in the evaluator worker
otherwise). Every reference solution, served by the scripted policy and played on a real
local desktop, scores 1.0; an untouched desktop scores 0.0."""

from __future__ import annotations

import json
import os
import shutil
import statistics
import tempfile
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio

from cua_rollout.agents.scripted_policy import ScriptedPolicy, load_solutions, scripted_server
from cua_rollout.agents.uitars import parse_response
from cua_rollout.config import load_config
from cua_rollout.envs.setup_steps import step_problem
from cua_rollout.evaluation import Evaluator, route_problem
from cua_rollout.evaluation.preflight import TaskChecker
from cua_rollout.model.client import ModelServicePool
from cua_rollout.runtime.pool import DesktopPool
from cua_rollout.runtime.replay import NOTHING, play, run_concurrently, with_upload_root
from tests.support import REPO_ROOT, unavailable

SUITE = REPO_ROOT / "tasks" / "osworld_demo"
CONFIG = REPO_ROOT / "configs" / "osworld_demo.yaml"
# OSWorld's domains (its test_all.json), VS Code aside: it has no Debian package.
DOMAINS = {"chrome", "gimp", "libreoffice_calc", "libreoffice_impress", "libreoffice_writer",
           "multi_apps", "os", "thunderbird", "vlc"}
APPS = ("chromium", "libreoffice", "gimp", "vlc", "thunderbird", "xterm", "mousepad",
        "socat", "Xvfb", "ffmpeg")
OSWORLD_PYTHON = REPO_ROOT / ".venv-osworld" / "bin" / "python"


def load_suite() -> list[tuple[str, dict[str, Any]]]:
    index = json.loads((SUITE / "test_all.json").read_text())
    return [(domain, json.loads((SUITE / "examples" / domain / f"{task_id}.json").read_text()))
            for domain, ids in index.items() for task_id in ids]


TASKS = load_suite()


def config(state_dir: Path | None = None) -> Any:
    """The suite's config, with paths made absolute as run.py makes them (task files name
    their uploads relative to the repository root)."""
    overrides = [f"desktops.local.state_dir={state_dir}"] if state_dir else []
    return with_upload_root(load_config(CONFIG, overrides), REPO_ROOT)


def metrics(task: dict[str, Any]) -> list[str]:
    func = task["evaluator"]["func"]
    return func if isinstance(func, list) else [func]


# --------------------------------------------------------------------------- static checks


def test_every_domain_has_two_well_formed_tasks_with_solutions(monkeypatch):
    monkeypatch.chdir(REPO_ROOT)  # uploads are named relative to it, as OSWorld's are
    cfg = config()
    index = json.loads((SUITE / "test_all.json").read_text())
    on_disk = {(p.parent.name, p.stem) for p in (SUITE / "examples").glob("*/*.json")}
    assert on_disk == {(d, i) for d, ids in index.items() for i in ids}
    assert set(index) == DOMAINS
    assert all(len(ids) >= 2 for ids in index.values()), index
    width, height = cfg.desktops.screen_width, cfg.desktops.screen_height
    for domain, task in TASKS:
        where = f"{domain}/{task['id']}"
        assert {"id", "snapshot", "instruction", "source", "config", "evaluator",
                "related_apps", "reference_solution"} <= task.keys(), where
        assert "infeasible" not in metrics(task), f"{where}: a demo task is feasible"
        assert task["evaluator"].get("result"), where
        for step in [*task["config"], *task["evaluator"].get("postconfig", [])]:
            assert set(step) == {"type", "parameters"}, where
            problem = step_problem(step, cfg.desktops)
            assert problem is None, f"{where}: {problem}"
        kinds = []
        for i, text in enumerate(task["reference_solution"]):
            parsed = parse_response(text, width, height, cfg.agent.name)
            assert parsed.thought and len(parsed.actions) == 1, f"{where} reply {i}"
            kinds.append(parsed.actions[0].kind)
            for point in (parsed.actions[0].point, parsed.actions[0].end_point):
                if point is not None:
                    assert 0 <= point[0] < width and 0 <= point[1] < height, where
        assert kinds[-1] == "finished" and "finished" not in kinds[:-1], where


def test_the_suite_uses_osworlds_own_metrics_and_passes_preflight(monkeypatch):
    """Every task is runnable by pre-flight; the suite exercises OSWorld's own code (metrics
    with no native version) in every domain but os, and the metrics the issue names."""
    if not OSWORLD_PYTHON.exists():
        unavailable("OSWorld's evaluator environment (.venv-osworld) is not installed")
    monkeypatch.chdir(REPO_ROOT)
    checker = TaskChecker(config())
    problems = {task["id"]: [str(p) for p in checker(task)] for _, task in TASKS}
    assert not any(problems.values()), problems
    bridged = {domain for domain, task in TASKS
               if route_problem(task["evaluator"], "auto", None)[0] is None}
    assert DOMAINS - {"os"} <= bridged, DOMAINS - bridged
    used = {name for _, task in TASKS for name in metrics(task)}
    assert {"compare_table", "compare_docx_files", "compare_pptx_files"} <= used, used


# --------------------------------------------------------------------------- on desktops


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def suite():
    """Two local desktops with the osworld profile's apps, and one evaluator (its OSWorld
    worker warm across the tasks), run from the repository root."""
    missing = [app for app in APPS if shutil.which(app) is None]
    if missing:
        unavailable(f"the osworld desktop profile is not installed (missing: {missing}); "
                    "bash scripts/setup_env.sh --osworld")
    if not OSWORLD_PYTHON.exists():
        unavailable("OSWorld's evaluator environment (.venv-osworld) is not installed")
    # A short path: Chromium's sockets live under it.
    state_dir = Path(tempfile.mkdtemp(prefix="owd-", dir="/tmp"))
    cfg = config(state_dir)
    pool = DesktopPool(cfg.desktops)
    evaluator = Evaluator.from_config(cfg)
    cwd = os.getcwd()
    os.chdir(REPO_ROOT)
    try:
        await pool.start()
        yield cfg, pool, evaluator
    finally:
        os.chdir(cwd)
        if evaluator.bridge is not None:
            await evaluator.bridge.close()
        await pool.stop()
        shutil.rmtree(state_dir, ignore_errors=True)


def _figures(stats: dict[str, dict[str, Any]]) -> str:
    evals = {name: s["evaluation_s"] for name, s in stats.items() if "evaluation_s" in s}
    setups = [s["setup_s"] for s in stats.values() if "setup_s" in s]
    if not evals:
        return "no figures"
    slowest = max(evals, key=evals.__getitem__)
    return (f"setup median {statistics.median(setups):.1f} s, max {max(setups):.1f} s; "
            f"evaluation median {statistics.median(evals.values()):.2f} s, slowest "
            f"{evals[slowest]:.2f} s ({slowest})")


@pytest.mark.integration
@pytest.mark.asyncio(loop_scope="module")
async def test_reference_solutions_score_1(suite):
    cfg, pool, evaluator = suite
    policy = ScriptedPolicy(load_solutions([SUITE]), screen=(cfg.desktops.screen_width,
                                                             cfg.desktops.screen_height))
    stats: dict[str, dict[str, Any]] = {task["id"]: {} for _, task in TASKS}
    with scripted_server(policy) as server:
        model = ModelServicePool(cfg.model.model_copy(update={"scripted": False,
                                                              "endpoints": [server.url]}))
        try:
            outcomes = await run_concurrently([
                (task["id"], play(cfg, pool, task, model=model, evaluator=evaluator,
                                  stats=stats[task["id"]]))
                for _, task in TASKS], cfg.desktops.count)
        finally:
            await model.close()
    print(f"\nosworld demo, solutions: {_figures(stats)}")
    failed = {name: r for name, r in outcomes.items() if r != 1.0}
    assert not failed, f"tasks whose reference solution did not score 1.0: {failed}"


@pytest.mark.integration
@pytest.mark.asyncio(loop_scope="module")
async def test_untouched_desktops_score_0(suite):
    cfg, pool, evaluator = suite
    stats: dict[str, dict[str, Any]] = {task["id"]: {} for _, task in TASKS}
    outcomes = await run_concurrently([
        (task["id"], play(cfg, pool, task, [NOTHING], evaluator=evaluator,
                          stats=stats[task["id"]]))
        for _, task in TASKS], cfg.desktops.count)
    print(f"\nosworld demo, untouched: {_figures(stats)}")
    assert outcomes == {task["id"]: 0.0 for _, task in TASKS}
