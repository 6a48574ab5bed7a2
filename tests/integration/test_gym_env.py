"""CuaDesktopEnv against the real desktop service (``python -m cua_rollout.service``) on two
local Xvfb desktops of configs/demo.yaml:

- Gymnasium's own env checker passes (``gymnasium.make(...).unwrapped``; the determinism
  checks are skipped by Gymnasium for an env registered nondeterministic);
- a demo task's reference solution scores 1.0 through ``step`` (UI-TARS replies parsed by
  the service), the lease goes back when the episode ends;
- truncation at ``max_steps`` is scored; an infeasible task pays FAIL only (computer13);
  a computer13 action that is not JSON is a parse error, nothing runs;
- the async env with the accessibility tree, kept alive by heartbeats past the lease TTL;
- a lease the service lost raises ``LeaseEnded`` naming it; a screen of another size is
  refused and the lease released;
- the SkyRL-gym wrapper plays the reference solution (skipped only without skyrl_gym).
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import gymnasium
import numpy as np
import psutil
import pytest
from gymnasium.utils.env_checker import check_env

from cua_rollout.core.errors import ConfigError
from cua_rollout.envs.service_client import DesktopServiceClient, LeaseGone
from cua_rollout.gym import ENV_ID, AsyncCuaDesktopEnv, CuaDesktopEnv, LeaseEnded
from tests.support import REPO_ROOT

pytestmark = [pytest.mark.integration, pytest.mark.slow]

DEMO = REPO_ROOT / "configs" / "demo.yaml"
TASKS = REPO_ROOT / "tasks" / "demo" / "examples"
TOKEN_ENV = "CUA_GYM_TEST_TOKEN"
OPERATOR_ENV = "CUA_GYM_TEST_OPERATOR"
LEASE_TTL_S = 6.0
SCREEN = (1280, 720)
START_TIMEOUT_S = 180


def task(domain: str, task_id: str) -> dict[str, Any]:
    return json.loads((TASKS / domain / f"{task_id}.json").read_text())


class Service:
    """The service as a child process in a process group of its own."""

    def __init__(self, tmp: Path) -> None:
        self.env = {**os.environ, TOKEN_ENV: "tenant-secret", OPERATOR_ENV: "operator-secret",
                    "PYTHONPATH": str(REPO_ROOT)}
        sets = [f"desktops.local.state_dir={tmp / 'desktops'}", "desktops.count=2",
                "service.port=0", "service.default_access=relay",
                f"service.lease_ttl_s={LEASE_TTL_S}", "service.default_wait_s=120",
                f"service.operator_token_env={OPERATOR_ENV}",
                "service.tenants=" + json.dumps(
                    [{"name": "gym", "token_env": TOKEN_ENV, "max_leases": 2}])]
        args = [sys.executable, "-m", "cua_rollout.service", "--config", str(DEMO)]
        for s in sets:
            args += ["--set", s]
        self.log = open(tmp / "service.log", "w+")  # noqa: SIM115 — closed in stop()
        self.proc = subprocess.Popen(args, cwd=REPO_ROOT, env=self.env, text=True,
                                     stdout=subprocess.PIPE, stderr=self.log,
                                     start_new_session=True)
        self.url = self._wait_url()

    def _wait_url(self) -> str:
        found: list[str] = []
        def read() -> None:
            for line in self.proc.stdout:  # type: ignore[union-attr]
                match = re.search(r"desktop service on (http://\S+)", line)
                if match and not found:
                    found.append(match.group(1))
        threading.Thread(target=read, daemon=True).start()
        deadline = time.monotonic() + START_TIMEOUT_S
        while not found:
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.log.seek(0)
                raise AssertionError(f"the service did not start: {self.log.read()[-3000:]}")
            time.sleep(0.1)
        return found[0]

    def stop(self) -> None:
        # SIGTERM to the service alone: it stops its desktops itself (the group would lose
        # them before it could); the group is killed only if it does not end.
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=90)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.proc.stdout.close()  # type: ignore[union-attr]
        self.log.close()


@pytest.fixture(scope="module")
def service() -> Iterator[Service]:
    tmp = Path(tempfile.mkdtemp(prefix="cua-gym-"))
    os.environ[TOKEN_ENV] = "tenant-secret"
    running = Service(tmp)
    try:
        yield running
    finally:
        running.stop()
        os.environ.pop(TOKEN_ENV, None)
        left = _kill_left_desktops(tmp / "desktops")
        shutil.rmtree(tmp, ignore_errors=True)
        assert not left, f"the service left desktops running: {left}"


def _kill_left_desktops(state_dir: Path) -> list[str]:
    """Desktops a stopped service left (their session.json): named, and their processes
    (by pid and start time) killed so that nothing outlives the test."""
    left = []
    for session in state_dir.glob("*/session.json"):
        left.append(session.parent.name)
        for entry in json.loads(session.read_text()).get("processes", []):
            try:
                process = psutil.Process(entry["pid"])
                if abs(process.create_time() - entry["create_time"]) < 1:
                    process.kill()
            except psutil.NoSuchProcess:
                pass
    return left


def own_leases(service: Service) -> list[str]:
    """The env ids the service holds for the tenant (its /status)."""
    async def status() -> dict[str, Any]:
        async with DesktopServiceClient(service.url, service.env[OPERATOR_ENV]) as client:
            return await client.status()
    body = asyncio.run(status())
    return [row["env_id"] for row in body.get("leases", [])]


def make(service: Service, **kwargs: Any) -> CuaDesktopEnv:
    return CuaDesktopEnv(service.url, token_env=TOKEN_ENV, screen=SCREEN, **kwargs)


# --------------------------------------------------------------------------- Gymnasium


def test_gymnasiums_env_checker_passes(service):
    """Every warning is an error here (pytest's filterwarnings): the checker's warnings too."""
    env = gymnasium.make(ENV_ID, url=service.url, token_env=TOKEN_ENV, screen=SCREEN,
                         max_steps=3, render_mode="rgb_array", pause_s=0.0)
    try:
        check_env(env.unwrapped)
        assert env.unwrapped.spec.nondeterministic is True
    finally:
        env.close()
    assert own_leases(service) == []


def test_the_reference_solution_scores_1_and_the_lease_goes_back(service):
    demo = task("terminal", "terminal-hello-file")
    env = make(service, action_kind="uitars", max_steps=15, render_mode="rgb_array")
    try:
        obs, info = env.reset(options={"task": demo})
        assert obs.shape == (720, 1280, 3) and obs.dtype == np.uint8 and obs.any()
        assert info["task_id"] == demo["id"] and info["instruction"] == demo["instruction"]
        assert info["screen"] == SCREEN and info["setup_s"] > 0
        assert own_leases(service) == [info["env_id"]]
        replies = demo["reference_solution"]
        for i, reply in enumerate(replies, start=1):
            obs, reward, terminated, truncated, step = env.step(reply)
            assert step["step"] == i and step["parse_error"] is None, step
            if i < len(replies):
                assert (reward, terminated, truncated) == (0.0, False, False)
                assert step["executed"] and step["returncode"] == 0, step
            assert obs in env.observation_space
        assert (reward, terminated, truncated) == (1.0, True, False)
        assert step["terminal"] == "DONE" and step["evaluated"] is True
        assert step["evaluation_error"] is None
        assert np.array_equal(env.render(), obs)
        assert own_leases(service) == []          # given back with the episode's end
        with pytest.raises(gymnasium.error.ResetNeeded):
            env.step(replies[0])
    finally:
        env.close()


def test_truncation_is_scored_and_infeasible_tasks_pay_fail_only(service):
    env = make(service, action_kind="computer13", max_steps=2, pause_s=0.0)
    try:
        env.reset(options={"task": task("terminal", "terminal-hello-file")})
        _, reward, terminated, truncated, info = env.step("{not json")
        assert info["parse_error"] and "JSON" in info["parse_error"]
        assert info["executed"] is None and (terminated, truncated) == (False, False)
        _, reward, terminated, truncated, info = env.step({"action_type": "WAIT"})
        assert (reward, terminated, truncated) == (0.0, False, True)
        assert info["evaluated"] is True                # scored at the step limit

        infeasible = task("terminal", "terminal-wifi-infeasible")
        env.reset(options={"task": infeasible})
        _, reward, terminated, _, info = env.step('{"action_type": "DONE"}')
        assert (reward, terminated, info["terminal"]) == (0.0, True, "DONE")
        env.reset(options={"task": infeasible})
        _, reward, terminated, _, info = env.step("FAIL")
        assert (reward, terminated, info["terminal"]) == (1.0, True, "FAIL")
    finally:
        env.close()
    assert own_leases(service) == []


async def test_the_async_env_observes_the_tree_and_heartbeats_keep_its_lease(service):
    env = AsyncCuaDesktopEnv(service.url, token_env=TOKEN_ENV, screen=SCREEN,
                             observe=("screenshot", "a11y_tree"))
    try:
        demo = task("editor", "editor-save-new-file")
        obs, info = await env.reset(options={"task": demo})
        assert set(obs) == {"screenshot", "a11y_tree"} and obs in env.observation_space
        assert "mousepad" in obs["a11y_tree"].lower(), obs["a11y_tree"][:500]
        # Longer than the lease's TTL with no call of ours: only the heartbeats keep it.
        await asyncio.sleep(LEASE_TTL_S * 2)
        lease = await env.client.info(info["env_id"])
        assert lease.env_id == info["env_id"]
        obs, reward, terminated, _, step = await env.step("pyautogui.press('a')")
        assert step["returncode"] == 0 and not terminated and reward == 0.0
    finally:
        await env.close()
        await env.close()


def test_a_lease_the_service_lost_raises_lease_ended_naming_it(service):
    env = make(service, max_steps=5)
    try:
        _, info = env.reset(options={"task": task("calculator", "calc-add")})
        env.run(env.client.release(info["env_id"]))    # the lease ends behind the env's back
        with pytest.raises(LeaseEnded, match=re.escape(info["env_id"])) as raised:
            env.step("pyautogui.press('1')")
        assert isinstance(raised.value, LeaseGone) and "calc-add" in str(raised.value)
        with pytest.raises(gymnasium.error.ResetNeeded):
            env.step("WAIT")
        env.reset()                                     # and a new lease works
    finally:
        env.close()
    assert own_leases(service) == []


def test_a_screen_of_another_size_is_refused_and_the_lease_released(service):
    env = CuaDesktopEnv(service.url, token_env=TOKEN_ENV, screen=(1920, 1080))
    try:
        with pytest.raises(ConfigError, match=r"1280x720.*screen=\(1920, 1080\)"):
            env.reset()
        assert own_leases(service) == []
    finally:
        env.close()


@pytest.mark.skipif(importlib.util.find_spec("skyrl_gym") is None,
                    reason="skyrl-gym is not installed (pip install skyrl-gym)")
def test_the_skyrl_wrapper_plays_a_reference_solution(service):
    import skyrl_gym

    from cua_rollout.gym.skyrl import SKYRL_ENV_ID, register

    register()
    demo = task("calculator", "calc-add")
    env = skyrl_gym.make(SKYRL_ENV_ID, env_config={
        "url": service.url, "token_env": TOKEN_ENV, "screen": list(SCREEN), "max_turns": 15},
        extras={"task": demo})
    try:
        prompt = [{"role": "system", "content": "You are a GUI agent."}]
        chat, metadata = env.init(prompt)
        assert chat[0] == prompt[0] and metadata["task_id"] == demo["id"]
        assert chat[-1]["content"][0]["image_url"]["url"].startswith("data:image/png;base64,")
        replies = demo["reference_solution"]
        for i, reply in enumerate(replies, start=1):
            out = env.step(reply)
            assert out["metadata"]["parse_error"] is None
            assert out["done"] is (i == len(replies))
            assert bool(out["observations"]) is (i < len(replies))
        assert out["reward"] == 1.0 and env.get_metrics()["turns"] == len(replies)
    finally:
        env.close()
    assert own_leases(service) == []
