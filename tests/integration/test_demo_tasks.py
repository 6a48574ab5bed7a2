"""The demo task suite (tasks/demo) on real local desktops: every task file is well formed,
every reference solution played through RemoteDesktopEnv scores 1.0, doing nothing scores 0,
and a reset leaves nothing of the previous episode behind."""

from __future__ import annotations

import asyncio
import json
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio

from cua_rollout.agents.scripted_policy import ScriptedPolicy, load_solutions, scripted_server
from cua_rollout.agents.uitars import parse_response, to_pyautogui
from cua_rollout.config import load_config
from cua_rollout.core.types import DONE
from cua_rollout.envs.client import RemoteDesktopEnv
from cua_rollout.model.client import ModelServicePool
from cua_rollout.runtime.pool import DesktopPool
from cua_rollout.runtime.replay import GIVE_UP, NOTHING, play, run_concurrently, score
from tests.support import REPO_ROOT

ROOT = REPO_ROOT
SUITE = ROOT / "tasks" / "demo"
DEMO_CONFIG = ROOT / "configs" / "demo.yaml"


def load_suite() -> list[tuple[str, dict[str, Any]]]:
    index = json.loads((SUITE / "test_all.json").read_text())
    return [
        (domain, json.loads((SUITE / "examples" / domain / f"{task_id}.json").read_text()))
        for domain, ids in index.items()
        for task_id in ids
    ]


TASKS = load_suite()


def is_infeasible(task: dict[str, Any]) -> bool:
    return task["evaluator"]["func"] in ("infeasible", ["infeasible"])


# --------------------------------------------------------------------------- static checks


def test_task_files_are_well_formed_and_solutions_parse():
    cfg = load_config(DEMO_CONFIG)
    width, height = cfg.desktops.screen_width, cfg.desktops.screen_height
    family = cfg.agent.name
    index = json.loads((SUITE / "test_all.json").read_text())
    on_disk = {(p.parent.name, p.stem) for p in (SUITE / "examples").glob("*/*.json")}
    assert on_disk == {(d, i) for d, ids in index.items() for i in ids}
    assert [task["id"] for _, task in TASKS] == [i for ids in index.values() for i in ids]
    assert len(TASKS) >= 12 and len(index) >= 3
    apps = {app for _, task in TASKS for app in task["related_apps"]}
    assert {"xterm", "mousepad", "galculator"} <= apps
    assert any(is_infeasible(task) for _, task in TASKS)
    for domain, task in TASKS:
        where = f"{domain}/{task['id']}"
        assert {"id", "snapshot", "instruction", "source", "config", "evaluator",
                "related_apps", "reference_solution"} <= task.keys(), where
        for step in task["config"]:
            assert set(step) == {"type", "parameters"}, where
        evaluator = task["evaluator"]
        if not is_infeasible(task):
            assert evaluator.get("result"), f"{where}: a feasible task needs a result getter"
        replies = task["reference_solution"]
        assert replies, where
        kinds = []
        for i, text in enumerate(replies):
            parsed = parse_response(text, width, height, family)
            assert parsed.thought, f"{where} reply {i}: no Thought"
            assert len(parsed.actions) == 1, f"{where} reply {i}: one action per reply"
            kinds.append(parsed.actions[0].kind)
            for action in parsed.actions:
                for point in (action.point, action.end_point):
                    if point is not None:
                        assert 0 <= point[0] < width and 0 <= point[1] < height, where
        want = "call_user" if is_infeasible(task) else "finished"
        assert kinds[-1] == want, f"{where}: the last reply must be {want}()"
        assert not {"finished", "call_user"} & set(kinds[:-1]), f"{where}: ends early"


# --------------------------------------------------------------------------- desktops


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def demo():
    """The demo's config (1280x720, two local desktops) with a private state dir, and a
    started pool that every test of this module shares."""
    state_dir = Path(tempfile.mkdtemp(prefix="demo-desktops-"))
    cfg = load_config(DEMO_CONFIG, [
        f"desktops.local.state_dir={state_dir}",
        "desktops.setup_timeout_s=60",  # a window that never shows fails the task quickly
    ])
    pool = DesktopPool(cfg.desktops)
    try:
        started = time.monotonic()
        await pool.start()
        start_s = time.monotonic() - started
        yield cfg, pool
        await _resets_done(pool, cfg.desktops.reset_timeout_s)  # complete reset figures
        stats = pool.stats()
        print(f"\ndemo pool: {cfg.desktops.count} desktops started in {start_s:.2f}s; "
              f"{stats['resets']} resets, median {stats['reset_s_median']:.2f}s, "
              f"max {stats['reset_s_max']:.2f}s")
    finally:
        await pool.stop()  # lets in-flight resets finish first
        shutil.rmtree(state_dir, ignore_errors=True)


async def _resets_done(pool: DesktopPool, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while pool.stats()["resetting"] and time.monotonic() < deadline:
        await asyncio.sleep(0.05)


@pytest.mark.integration
@pytest.mark.asyncio(loop_scope="module")
async def test_the_scripted_policy_solves_every_task(demo):
    """Each reference solution, served by the scripted policy over HTTP, asked for with the
    runner's messages through the model client, parsed and run through RemoteDesktopEnv on
    a pooled local desktop, scores 1.0."""
    cfg, pool = demo
    policy = ScriptedPolicy(load_solutions([SUITE]), screen=(cfg.desktops.screen_width,
                                                             cfg.desktops.screen_height))
    with scripted_server(policy) as server:
        model = ModelServicePool(cfg.model.model_copy(update={"scripted": False,
                                                              "endpoints": [server.url]}))
        try:
            outcomes = await run_concurrently([
                (task["id"], play(cfg, pool, task, model=model)) for _, task in TASKS
            ], cfg.desktops.count)
        finally:
            await model.close()
    failed = {name: r for name, r in outcomes.items() if r != 1.0}
    assert not failed, f"tasks the scripted policy did not solve: {failed}"
    assert policy.served == sum(len(t["reference_solution"]) for _, t in TASKS)


@pytest.mark.integration
@pytest.mark.asyncio(loop_scope="module")
async def test_doing_nothing_scores_0_and_giving_up_only_pays_on_infeasible_tasks(demo):
    cfg, pool = demo
    episodes = [(f"{task['id']}/DONE", play(cfg, pool, task, [NOTHING])) for _, task in TASKS]
    episodes += [
        (f"{task['id']}/FAIL", play(cfg, pool, task, [GIVE_UP]))
        for _, task in TASKS if is_infeasible(task)
    ]
    outcomes = await run_concurrently(episodes, cfg.desktops.count)
    errors = {name: r for name, r in outcomes.items() if isinstance(r, BaseException)}
    assert not errors
    expected = {name: 1.0 if name.endswith("/FAIL") else 0.0 for name in outcomes}
    assert outcomes == expected


@pytest.mark.integration
@pytest.mark.asyncio(loop_scope="module")
async def test_a_released_desktop_keeps_nothing_of_the_previous_episode(demo):
    cfg, pool = demo
    task = next(t for _, t in TASKS if t["id"] == "terminal-hello-file")
    first = await pool.lease("episode-1")
    try:
        env = RemoteDesktopEnv(first.url, cfg.desktops, name=first.desktop_id)
        await env.reset(task)
        # The episode types its command into xterm, which writes ~/Desktop/hello.txt.
        typed = parse_response(task["reference_solution"][0], cfg.desktops.screen_width,
                               cfg.desktops.screen_height, cfg.agent.name)
        assert (await env.step(to_pyautogui(typed.actions))).ok
        deadline = time.monotonic() + 30
        while await env.get_file("~/Desktop/hello.txt") is None:
            assert time.monotonic() < deadline, "the episode's file never appeared"
            await asyncio.sleep(0.1)
        assert "xterm" in (await env.execute("wmctrl -l", shell=True))["output"]
    finally:
        await pool.release(first.lease_id)
    # Taking every desktop of the pool waits for the reset and yields the same one again.
    leases = [await pool.lease(f"episode-2-{i}") for i in range(cfg.desktops.count)]
    try:
        again = next(x for x in leases if x.desktop_id == first.desktop_id)
        env = RemoteDesktopEnv(again.url, cfg.desktops, name=again.desktop_id)
        leftovers = await env.execute("find ~/Desktop ~/Documents ~/Downloads -mindepth 1",
                                      shell=True)
        assert leftovers["output"] == ""
        assert (await env.execute("wmctrl -l", shell=True))["output"] == ""
        assert await score(env, task, DONE, cfg) == 0.0
    finally:
        for lease in leases:
            await pool.release(lease.lease_id)
