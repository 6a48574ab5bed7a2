"""The demo tasks (tasks/demo) played by the agents beyond UI-TARS on real local desktops:
OSWorld's prompt agent (each action space, each observation type) and Qwen-VL's computer-use
agent (tools offered and answered as tool_calls; described in the prompt and answered
inline), each driven by the scripted policy answering the reference solutions in that
agent's format. Every reference solution must score 1.0; every step records its agent and
action format, and the accessibility tree or marks it was shown."""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio

from cua_rollout.agents.scripted_policy import ScriptedPolicy, load_solutions, scripted_server
from cua_rollout.config import Config, load_config
from cua_rollout.model.client import ModelServicePool
from cua_rollout.runtime.pool import DesktopPool
from cua_rollout.runtime.replay import play, run_concurrently
from tests.integration.test_demo_tasks import DEMO_CONFIG, SUITE, TASKS

pytestmark = [pytest.mark.integration]

# (name, overrides, which tasks: None = all)
AGENTS: list[tuple[str, list[str], set[str] | None]] = [
    ("osworld-pyautogui-screenshot_a11y_tree", [
        "agent.name=osworld-prompt"], None),
    ("osworld-computer_13-a11y_tree", [
        "agent.name=osworld-prompt", "agent.osworld_prompt.action_space=computer_13",
        "agent.osworld_prompt.observation_type=a11y_tree"], None),
    ("osworld-pyautogui-som", [
        "agent.name=osworld-prompt", "agent.osworld_prompt.observation_type=som"],
     {"editor-append-line", "calc-add", "terminal-hello-file"}),
    ("qwen-tools-absolute", ["agent.name=qwen-computer-use"], None),
    ("qwen-inline-relative", [
        "agent.name=qwen-computer-use", "agent.qwen_computer_use.send_tools=false",
        "agent.qwen_computer_use.coordinates=relative"],
     {"editor-append-line", "calc-add", "terminal-hello-file"}),
]


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def desktops():
    state_dir = Path(tempfile.mkdtemp(prefix="agents-desktops-"))
    cfg = load_config(DEMO_CONFIG, [f"desktops.local.state_dir={state_dir}",
                                    "desktops.setup_timeout_s=60"])
    pool = DesktopPool(cfg.desktops)
    try:
        await pool.start()
        yield cfg, pool
    finally:
        await pool.stop()
        shutil.rmtree(state_dir, ignore_errors=True)


def _steps(folder: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for path in sorted(folder.rglob("traj.jsonl"))
            for line in path.read_text().splitlines()]


@pytest.mark.asyncio(loop_scope="module")
@pytest.mark.parametrize(("name", "sets", "only"), AGENTS, ids=[a[0] for a in AGENTS])
async def test_every_reference_solution_succeeds_with_the_agent(desktops, name, sets, only,
                                                                tmp_path):
    base, pool = desktops
    cfg: Config = load_config(DEMO_CONFIG, [
        *sets, f"desktops.local.state_dir={base.desktops.local.state_dir}",
        "desktops.setup_timeout_s=60"])
    tasks = [task for _, task in TASKS if only is None or task["id"] in only]
    policy = ScriptedPolicy(load_solutions([SUITE]), screen=(cfg.desktops.screen_width,
                                                             cfg.desktops.screen_height))
    with scripted_server(policy) as server:
        model = ModelServicePool(cfg.model.model_copy(update={"scripted": False,
                                                              "endpoints": [server.url]}))
        try:
            outcomes = await run_concurrently([
                (task["id"], play(cfg, pool, task, model=model,
                                  shots=tmp_path / task["id"])) for task in tasks
            ], cfg.desktops.count)
        finally:
            await model.close()
    failed = {task: r for task, r in outcomes.items() if r != 1.0}
    assert not failed, f"{name}: tasks the scripted policy did not solve: {failed}"
    assert policy.served == sum(len(t["reference_solution"]) for t in tasks)
    steps = _steps(tmp_path)
    assert len(steps) == policy.served
    fmt = {"osworld-prompt": cfg.agent.osworld_prompt.action_space,
           "qwen-computer-use": "qwen_tool_call"}[cfg.agent.name]
    for step in steps:
        assert step["agent"] == cfg.agent.name and step["action_format"] == fmt, step
        assert step["parse_retries"] == 0 and step["actions"], step["response"]
    observed = cfg.agent.osworld_prompt.observation_type
    if cfg.agent.name == "osworld-prompt" and observed != "screenshot":
        files = [next(tmp_path.rglob(s["a11y_tree_file"])) for s in steps]
        tables = [f.read_text() for f in files]
        header = "index\ttag" if observed == "som" else "tag\tname\ttext"
        assert all(t.startswith(header) for t in tables)
        # The apps' windows are in the tree: most steps show more than the header.
        assert sum(t.count("\n") > 2 for t in tables) >= len(tables) // 2, tables[:2]
        timing = [s["timing"]["a11y_tree_s"] for s in steps]
        print(f"\n{name}: accessibility tree per step: median "
              f"{sorted(timing)[len(timing) // 2] * 1000:.0f} ms, max {max(timing) * 1000:.0f} ms")
    if observed == "som" and cfg.agent.name == "osworld-prompt":
        assert all(next(tmp_path.rglob(s["marks_file"])).stat().st_size > 0 for s in steps)
    if cfg.agent.name == "qwen-computer-use" and cfg.agent.qwen_computer_use.send_tools:
        assert all(s["response_tool_calls"] for s in steps)
