"""The episode loop as a component: a real TrajectoryRunner, DesktopPool, StorageActor and
model client (over real HTTP to a fake OpenAI server on loopback), with function-built
desktops instead of Xvfb. Each test drives one path of "One step, as data" and reads what an
episode leaves on disk."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from cua_rollout.config import Config, load_config
from cua_rollout.core.errors import DesktopError
from cua_rollout.core.types import EpisodeResult, EpisodeSpec
from cua_rollout.model.fleet.state import write_state
from cua_rollout.runtime.pool import DesktopPool
from cua_rollout.runtime.runner import TrajectoryRunner
from cua_rollout.runtime.storage import StorageActor
from tests.doubles.fake_desktop import FakeDesktop, FakeProvider
from tests.doubles.fake_openai import FakeOpenAIServer
from tests.support import REPO_ROOT, run_recorded

ROOT = REPO_ROOT
SCREEN = (1280, 720)
# The file the "app" of these tests writes when clicked, and the evaluator that reads it.
CLICKED = "/home/user/clicked.txt"
TASK = {
    "id": "t1", "instruction": "click the button", "config": [],
    "evaluator": {"func": "check_include_exclude",
                  "result": {"type": "vm_file", "path": CLICKED, "dest": "clicked.txt"},
                  "expected": {"type": "rule", "rules": {"include": []}}},
}


def clicking_desktop(desktop_id: str, **kw: Any) -> FakeDesktop:
    """A desktop whose one app writes CLICKED on any click."""
    desktop: FakeDesktop

    def step(code: str) -> None:
        if "pyautogui.click(" in code:
            desktop.files[CLICKED] = b"clicked\n"

    desktop = FakeDesktop(step_func=step, size=SCREEN, name=desktop_id, **kw)
    return desktop


@dataclass
class World:
    cfg: Config
    runner: TrajectoryRunner
    pool: DesktopPool
    provider: FakeProvider
    storage: StorageActor
    model: FakeOpenAIServer
    replies: list[str]

    @property
    def run_dir(self) -> Path:
        return self.cfg.run_dir

    async def run(self, task: dict[str, Any] = TASK, rollout: int = 0) -> EpisodeResult:
        return await run_recorded(self.runner, self.storage,
                                  EpisodeSpec(task["id"], "d", rollout, task))

    def traj(self, episode: str = "d/t1/0") -> list[dict[str, Any]]:
        text = (self.run_dir / episode / "traj.jsonl").read_text()
        return [json.loads(line) for line in text.splitlines()]


@pytest.fixture
async def make_world(tmp_path: Path) -> AsyncIterator[Callable[..., Any]]:
    made: list[World] = []

    async def make(*sets: str, desktop: Callable[[str], FakeDesktop] = clicking_desktop,
                   replies: list[str | Callable[[], str]] | None = None,
                   model_state_dir: Path | None = None) -> World:
        """``replies``: texts, or functions called when their turn comes (returning the
        text); ``model_state_dir``: the model endpoints are run_model.py's list there
        (the test publishes it) instead of ``model.endpoints``."""
        queue = list(replies or [])

        def reply(body: dict[str, Any]) -> str:
            if not queue:
                return "Thought: done\nAction: finished()"
            nxt = queue.pop(0)
            return nxt() if callable(nxt) else nxt

        server = FakeOpenAIServer(reply=reply)
        server.start()
        endpoints = [] if model_state_dir is not None else [server.url]
        cfg = load_config(ROOT / "configs" / "demo.yaml", [
            f"run.output_dir={tmp_path / 'results'}",
            "model.scripted=false", f"model.endpoints={json.dumps(endpoints)}",
            "model.retries=0", "desktops.count=1", "runner.action_pause_s=0",
            "agent.max_parse_retries=1", f"desktops.screen_width={SCREEN[0]}",
            f"desktops.screen_height={SCREEN[1]}", f"desktops.download_cache_dir={tmp_path}",
            *sets,
        ])
        provider = FakeProvider(desktop_factory=desktop)
        pool = DesktopPool(cfg.desktops, provider)
        await pool.start()
        storage = StorageActor(cfg.run_dir, cfg.storage)
        await storage.start_run({"run": "component"})
        runner = TrajectoryRunner(
            cfg, pool, storage, "r0",
            str(model_state_dir) if model_state_dir is not None else None,
            env_factory=provider.env_factory)
        world = World(cfg, runner, pool, provider, storage, server, queue)
        made.append(world)
        return world

    yield make
    for world in made:
        await world.runner.close()
        await world.pool.stop()
        await world.storage.close()
        world.model.stop()


async def test_a_solved_episode_leaves_osworlds_files_and_ours(make_world):
    world = await make_world(replies=[
        "Thought: the button\nAction: click(start_box='(100,200)')",
        "Thought: done\nAction: finished(content='ok')",
    ])
    result = await world.run()
    assert (result.status, result.reward, result.steps) == ("success", 1.0, 2)
    desktop = world.provider.desktops["fake-0"]
    # UI-TARS-1.5 points are pixels of the smart-resized screenshot: the click lands scaled.
    assert desktop.actions[0].startswith("pyautogui.click(")
    assert result.last_action == "DONE" and result.desktop == "fake-0"

    traj = world.traj()
    assert [(s["step_num"], s["done"], s["reward"]) for s in traj] == [(1, False, 0),
                                                                      (2, True, 1.0)]
    assert traj[0]["screenshot_file"] == "step_1.png" and traj[0]["observation_file"] == \
        "step_0.png"
    assert traj[1]["action"] == "DONE" and set(traj[0]["timing"]) == {
        "model_s", "env_s", "overhead_s", "step_s", "action_s", "pause_s", "screenshot_s",
        "started_at"}
    episode_dir = world.run_dir / "d/t1/0"
    assert {p.name for p in episode_dir.iterdir()} >= {
        "task_config.json", "traj.jsonl", "step_0.png", "step_1.png", "result.txt",
        "episode.json", "messages.json"}
    assert (episode_dir / "result.txt").read_text() == "1.0\n"
    messages = json.loads((episode_dir / "messages.json").read_text())
    images = [part["image_url"]["url"] for m in messages for part in m["content"]
              if isinstance(part, dict) and part.get("type") == "image_url"]
    assert images == ["step_0.png", "step_1.png"]  # file names, never base64
    # The desktop went back to the pool and was reset before anyone else gets it.
    await asyncio.sleep(0.05)
    assert world.pool.stats()["free"] == 1 and world.provider.resets == ["fake-0"]
    assert desktop.closed == 1


async def test_the_step_budget_ends_as_max_steps_and_is_still_scored(make_world):
    world = await make_world("runner.max_steps=3", replies=[
        "Thought: again\nAction: click(start_box='(10,10)')"] * 5)
    result = await world.run()
    assert (result.status, result.steps, result.reward) == ("max_steps", 3, 1.0)
    assert [s["done"] for s in world.traj()] == [False, False, True]


async def test_unparseable_replies_are_asked_again_then_fail_which_solves_an_infeasible_task(
        make_world):
    world = await make_world(replies=["I would rather not.", "Still no action here."])
    infeasible = {**TASK, "evaluator": {"func": "infeasible"}}
    result = await world.run(infeasible)
    assert (result.status, result.reward, result.parse_failures) == ("success", 1.0, 2)
    assert result.infeasible and result.last_action == "FAIL"
    assert len(world.model.requests) == 2  # max_parse_retries=1: asked twice


async def test_call_user_waits_as_configured_then_fails(make_world):
    world = await make_world("agent.call_user=wait", "agent.call_user_max_waits=1",
                             "runner.wait_s=0", replies=["Action: call_user()"] * 2)
    result = await world.run()
    assert (result.status, result.steps, result.last_action) == ("failure", 2, "FAIL")
    # The first call_user waited on the desktop; the second ended the episode (FAIL runs
    # nothing on the desktop).
    assert world.provider.desktops["fake-0"].actions == ["WAIT"]


async def test_a_desktop_that_dies_mid_step_is_a_retryable_infra_error(make_world):
    def dying(desktop_id: str) -> FakeDesktop:
        def step(code: str) -> None:
            raise DesktopError(f"{desktop_id}/execute: cannot connect (ConnectError)")
        return FakeDesktop(step_func=step, size=SCREEN, name=desktop_id)

    world = await make_world(desktop=dying,
                             replies=["Action: click(start_box='(10,10)')"])
    result = await world.run()
    assert (result.status, result.reward, result.retryable) == ("infra_error", None, True)
    assert result.error.startswith("desktop fake-0: ")
    record = json.loads((world.run_dir / "d/t1/0/episode.json").read_text())
    assert record["status"] == "infra_error" and "retryable" not in record
    assert not (world.run_dir / "d/t1/0/result.txt").exists()  # never a reward


async def test_an_unsupported_setup_step_is_not_retried_and_leaves_the_desktop_healthy(
        make_world):
    world = await make_world()
    task = {**TASK, "config": [{"type": "googledrive", "parameters": {}}]}
    result = await world.run(task)
    assert (result.status, result.retryable) == ("infra_error", False)
    assert "'googledrive'" in result.error and "desktops.accounts_dir" in result.error
    await asyncio.sleep(0.05)
    assert world.pool.stats(detail=True)["desktops"][0]["state"] == "free"
    assert world.pool.stats(detail=True)["desktops"][0]["failures"] == 0  # released healthy


async def test_a_model_that_rejects_the_request_is_not_retried(make_world):
    world = await make_world()
    world.model.faults.append(400)
    result = await world.run()
    assert (result.status, result.retryable) == ("infra_error", False)
    assert result.error.startswith("model rejected the request")


async def test_the_episode_deadline_ends_as_timeout_and_is_still_scored(make_world):
    def slow(desktop_id: str) -> FakeDesktop:
        async def step(code: str) -> None:
            await asyncio.sleep(5)
        return FakeDesktop(step_func=step, size=SCREEN, name=desktop_id)

    world = await make_world("runner.episode_timeout_s=0.5", desktop=slow,
                             replies=["Action: click(start_box='(10,10)')"])
    result = await world.run()
    assert result.status == "timeout" and result.reward == 0.0  # the file was never written
    assert "deadline" in result.error


async def test_cancelling_a_running_episode_returns_its_desktop(make_world):
    started = asyncio.Event()

    def stuck(desktop_id: str) -> FakeDesktop:
        async def step(code: str) -> None:
            started.set()
            await asyncio.sleep(60)
        return FakeDesktop(step_func=step, size=SCREEN, name=desktop_id)

    world = await make_world(desktop=stuck, replies=["Action: click(start_box='(10,10)')"])
    running = asyncio.ensure_future(world.run())
    await asyncio.wait_for(started.wait(), 10)
    assert await world.runner.cancel() == 1
    result = await asyncio.wait_for(running, 10)
    assert result.status == "cancelled"
    for _ in range(100):
        if world.pool.stats()["leased"] == 0:
            break
        await asyncio.sleep(0.02)
    assert world.pool.stats()["leased"] == 0 and world.pool.stats()["releases"] == 1


async def test_token_ids_and_logprobs_are_recorded_when_asked(make_world):
    world = await make_world("model.sampling.return_token_ids=true",
                             "model.sampling.logprobs=true",
                             replies=["Action: click(start_box='(10,10)')\n\nfinished()"])
    result = await world.run()
    assert result.status == "success" and result.steps == 1
    step = world.traj()[0]
    assert step["token_ids"] and step["prompt_token_ids"] and step["logprobs"]
    assert world.model.requests[0]["return_token_ids"] is True


# --------------------------------------------------------------------------- outages (review H1)


async def test_a_model_outage_mid_episode_is_waited_out_with_the_deadline_stopped(make_world):
    """The model goes down after the first step for longer than the whole episode deadline:
    the episode waits (its deadline stopped), then finishes as if nothing happened."""
    world = await make_world("runner.episode_timeout_s=1.5", "model.outage_wait_s=30",
                             "model.endpoint_failures_to_eject=1", replies=[
                                 "Thought: the button\nAction: click(start_box='(100,200)')",
                                 "Thought: done\nAction: finished(content='ok')"])
    server = world.model

    def go_down(body: dict[str, Any]) -> str:
        text = world.replies.pop(0)
        server.healthy = False
        server.faults.extend([503] * 1000)
        return text

    server.reply = go_down
    running = asyncio.ensure_future(world.run())
    for _ in range(200):
        if world.runner.stats()["model_waiting"]:
            break
        await asyncio.sleep(0.02)
    assert world.runner.stats()["model_waiting"] == 1
    assert world.runner.stats()["model_outage"] == "0 live, 0 draining, 1 down"
    await asyncio.sleep(2.0)  # longer than the episode's deadline
    server.faults.clear()
    server.reply = lambda body: world.replies.pop(0)
    server.healthy = True
    result = await asyncio.wait_for(running, 30)
    assert (result.status, result.reward, result.steps) == ("success", 1.0, 2)
    assert result.timing["outage_wait_s"] >= 2.0


async def test_an_outage_longer_than_outage_wait_s_is_an_outage_not_an_attempt(make_world):
    world = await make_world("model.outage_wait_s=0.3", "model.endpoint_failures_to_eject=1")
    world.model.healthy = False
    world.model.faults.extend([503] * 100)
    result = await world.run()
    assert (result.status, result.outage, result.fatal) == ("infra_error", "model", False)
    assert "no model endpoint for 0s (0 live, 0 draining, 1 down)" in result.error
    await asyncio.sleep(0.05)
    assert world.pool.stats()["free"] == 1  # the desktop went back


@pytest.mark.parametrize("status", [401, 403, 404])
async def test_credentials_or_an_unknown_model_are_fatal_for_the_run(make_world, status):
    world = await make_world()
    world.model.faults.append(status)
    result = await world.run()
    assert (result.status, result.fatal, result.outage) == ("infra_error", True, None)
    assert f"HTTP {status}" in result.error


async def test_no_desktop_within_the_lease_timeout_is_a_desktop_outage(make_world):
    world = await make_world("desktops.lease_timeout_s=0.2")
    held = await world.pool.lease("someone-else")
    result = await world.run()
    assert (result.status, result.outage) == ("infra_error", "desktop")
    await world.pool.release(held.lease_id)


async def test_a_slow_metric_times_out_without_freezing_the_runner(make_world, monkeypatch):
    """Review M6: metrics run off the runner's event loop, so one that blocks for seconds
    ends its own episode at evaluation_timeout_s while the runner keeps answering."""
    import time as time_module

    from cua_rollout.evaluation import METRICS

    monkeypatch.setitem(METRICS, "slow_metric", lambda *a, **k: time_module.sleep(2) or 1.0)
    world = await make_world("runner.evaluation_timeout_s=0.3",
                             replies=["Action: click(start_box='(10,10)')\n\nfinished()"])
    task = {**TASK, "evaluator": {**TASK["evaluator"], "func": "slow_metric"}}
    running = asyncio.ensure_future(world.run(task))
    ticks = 0
    while not running.done():  # the loop keeps turning while the metric blocks its thread
        ticks += 1
        await asyncio.sleep(0.01)
    result = running.result()
    assert (result.status, result.retryable) == ("infra_error", True)
    assert "evaluation timed out" in (result.error or "")
    assert ticks > 10 and world.runner.stats()["active"] == 0


async def test_an_episode_spanning_a_reload_records_each_steps_version(make_world, tmp_path):
    """run_model.py reloads the checkpoint in place mid-episode: each step records the
    version that produced it; the episode its first and last and that it mixed them."""
    state_dir = tmp_path / "pool"
    state_dir.mkdir()

    mtime = [0]

    def publish(version: str) -> str:  # as run_model.py does: the file's mtime always moves
        entry = {"url": world.model.url, "healthy": True, "model_version": version}
        mtime[0] = write_state(state_dir, {"endpoints": [entry], "model_version": version},
                               min_mtime_ns=mtime[0])
        time.sleep(0.05)  # a reply slower than the 20 ms between looks at the list, as real ones
        return "Thought: the button\nAction: click(start_box='(100,200)')"

    world = await make_world(model_state_dir=state_dir, replies=[
        "Thought: the button\nAction: click(start_box='(100,200)')",
        lambda: publish("ckpt-2"),  # this reply was made by ckpt-1; the next ones by 2
        "Thought: done\nAction: finished(content='ok')",
    ])
    publish("ckpt-1")
    result = await world.run()
    assert [s["model_version"] for s in world.traj()] == ["ckpt-1", "ckpt-1", "ckpt-2"]
    record = result.record()
    assert (record["first_model_version"], record["model_version"],
            record["model_versions"], record["mixed_versions"]) == (
        "ckpt-1", "ckpt-2", ["ckpt-1", "ckpt-2"], True)
    assert record["group_id"] == "d/t1/pass-0" and record["pass_index"] == 0


async def test_an_evaluation_that_raises_on_what_the_agent_left_is_its_failure(make_world):
    """The agent never wrote the file the metric reads, and the metric raises on its absence.
    That is the agent's failure (reward 0, the reason kept, the desktop healthy), not an
    infra_error retried elsewhere; a desktop that does not answer the evaluation stays an
    infra_error."""
    world = await make_world(replies=["Thought: done\nAction: finished()"] * 2)
    missing = {**TASK, "evaluator": {"func": "is_in_list",
                                     "result": {"type": "vm_file", "path": "/home/user/out.txt",
                                                "dest": "out.txt"},
                                     "expected": {"type": "rule", "rules": {"expected": "x"}}}}
    result = await world.run(missing)
    assert (result.status, result.reward, result.error) == ("failure", 0.0, None)
    assert result.evaluation_error.startswith("EvaluatorRaised: metric is_in_list raised "
                                              "TypeError")
    record = json.loads((world.run_dir / "d/t1/0/episode.json").read_text())
    assert record["evaluation_error"] == result.evaluation_error
    await asyncio.sleep(0.05)
    assert world.pool.stats()["quarantined"] == 0

    def broken(command: Any, shell: bool) -> dict[str, Any]:
        raise DesktopError("connection reset")

    world.provider.desktops["fake-0"]._execute_func = broken
    commanding = {**TASK, "evaluator": {
        "func": "exact_match", "result": {"type": "vm_command_line", "command": ["true"]},
        "expected": {"type": "rule", "rules": {"expected": ""}}}}
    result = await world.run(commanding, rollout=1)
    assert result.status == "infra_error" and result.evaluation_error is None
    assert "connection reset" in (result.error or "")


A11Y_TREE = """<desktop-frame xmlns:st="https://accessibility.ubuntu.example.org/ns/state"
 xmlns:cp="https://accessibility.ubuntu.example.org/ns/component">
 <application name="editor"><push-button name="Start" st:enabled="true" st:showing="true"
  st:visible="true" cp:screencoord="(90,190)" cp:size="(20,20)">Start</push-button>
 </application></desktop-frame>"""


def tree_desktop(tree: str) -> Callable[[str], FakeDesktop]:
    def make(desktop_id: str) -> FakeDesktop:
        desktop = clicking_desktop(desktop_id)
        desktop.accessibility = tree
        return desktop
    return make


async def test_an_agent_that_observes_the_tree_gets_it_each_step_and_it_is_kept(make_world):
    world = await make_world(
        "agent.name=osworld-prompt", "agent.osworld_prompt.observation_type=screenshot_a11y_tree",
        desktop=tree_desktop(A11Y_TREE),
        replies=["```python\npyautogui.click(100, 200)\n```", "```DONE```"])
    result = await world.run()
    assert (result.status, result.reward, result.steps) == ("success", 1.0, 2), result.error
    traj = world.traj()
    assert [(s["agent"], s["action_format"]) for s in traj] == [
        ("osworld-prompt", "pyautogui")] * 2
    for step in traj:
        table = (world.run_dir / "d/t1/0" / step["a11y_tree_file"]).read_text()
        assert "push-button" in table and "Start" in table  # the linearized table
        assert step["timing"]["env_s"] > 0
    prompt = json.dumps(world.model.requests[0]["messages"])
    assert "push-button" in prompt and "Start" in prompt


async def test_a_tree_that_is_not_xml_is_the_desktops_fault_and_retried(make_world):
    world = await make_world("agent.name=osworld-prompt",
                             "agent.osworld_prompt.observation_type=a11y_tree",
                             desktop=tree_desktop("<desktop-frame><unclosed>"))
    result = await world.run()
    assert result.status == "infra_error" and result.retryable, result
    assert "accessibility tree is not XML" in (result.error or "")
    assert world.model.requests == [], "nothing was asked of the model"
