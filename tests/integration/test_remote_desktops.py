"""``desktops.provider: remote`` with ``kind: gui-docker-env`` against the GUI-Docker-Env
stand-in (tests/doubles/gui_docker_env.py: their manager's API, each emulator a real local
desktop): a desktop's own ports reach its client and OSWorld's evaluator bridge, a reset is
a new emulator, a full quota is waited out, a refused token stops the start, a failed start
falls through to the next manager, an emulator gone behind our back is replaced, and every
exit path stops what was started; then the demo end to end through run.py."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from cua_rollout.config import DesktopsConfig
from cua_rollout.core.errors import ConfigError
from cua_rollout.envs.providers.remote import RemoteProvider
from cua_rollout.runtime.desktop_episode import open_leased_desktop
from cua_rollout.runtime.pool import DesktopPool
from tests.doubles.gui_docker_env import GuiDockerEnvManager
from tests.support import REPO_ROOT, assert_every_episode_succeeded, until

pytestmark = [pytest.mark.integration]

TOKEN_VAR = "CUA_TEST_GDE_TOKEN"
RUN_TIMEOUT_S = 900


@pytest.fixture
def token(monkeypatch) -> str:
    monkeypatch.setenv(TOKEN_VAR, "alpha")
    return "alpha"


@pytest.fixture
def manager(tmp_path, token):
    with GuiDockerEnvManager(tmp_path / "gde", {token: 2, "other": 1}) as m:
        yield m


def _cfg(*urls: str, **kw) -> DesktopsConfig:
    remote = {"kind": "gui-docker-env", "urls": list(urls), "token_env": TOKEN_VAR,
              "wait_s": 3, "start_timeout_s": 120, **kw.pop("remote", {})}
    base = dict(provider="remote", count=1, warm_spares=0, screen_width=1280,
                screen_height=720, lease_timeout_s=60, reset_timeout_s=120,
                health_interval_s=0.5, remote=remote)
    base.update(kw)
    return DesktopsConfig(**base)


async def test_an_emulator_is_a_desktop_with_its_own_ports_and_a_reset_is_a_new_one(manager):
    pool = DesktopPool(_cfg(manager.url))
    await pool.start()
    try:
        lease = await pool.lease("e0")
        [first] = manager.running()
        emu = manager.emulators[first]
        assert lease.access is not None and lease.access.chromium_port == emu.chromium_port
        assert lease.url == f"http://127.0.0.1:{emu.server_port}"
        env = open_leased_desktop(lease, pool.cfg)
        try:
            shot = await env.observe()
            assert shot.size == (1280, 720)
            address = env.address()  # what OSWorld's evaluator code is given
            assert (address.url, address.chromium_port, address.vlc_port) == (
                lease.url, emu.chromium_port, emu.vlc_port)
            reply = await env.execute(["bash", "-c", "echo left > ~/left.txt"])
            assert reply["returncode"] == 0
        finally:
            await env.close()
        await pool.release(lease.lease_id)
        await until(lambda: pool.stats()["free"] == 1, 120, 0.1)
        [second] = manager.running()
        assert second != first  # given back and a new one taken
        again = await pool.lease("e1")
        env = open_leased_desktop(again, pool.cfg)
        try:
            assert await env.get_file("/home/user/left.txt") is None
        finally:
            await env.close()
        await pool.release(again.lease_id)
    finally:
        await pool.stop()
    assert manager.running() == [] and manager.stopped == manager.starts >= 2


async def test_a_full_quota_is_waited_out_and_the_pool_refills(manager, token):
    manager.tokens[token] = 1
    pool = DesktopPool(_cfg(manager.url, count=2))
    await pool.start()  # one desktop now; the other start was refused (429) past wait_s
    try:
        assert len(manager.running()) == 1 and manager.refusals >= 1
        assert pool.stats()["free"] == 1
        manager.tokens[token] = 2
        manager.usage[token]["limit"] = 2  # what their /set_token_limit does
        await until(lambda: len(manager.running()) == 2, 240, 0.2)  # the refill, backoff
        await until(lambda: pool.stats()["free"] == 2, 60, 0.1)
    finally:
        await pool.stop()
    assert manager.running() == []


async def test_a_refused_token_stops_the_start_with_the_key_named(manager, monkeypatch):
    monkeypatch.setenv(TOKEN_VAR, "nobody")
    pool = DesktopPool(_cfg(manager.url))
    with pytest.raises(ConfigError, match=r"desktops\.remote\.token_env.*403"):
        await pool.start()
    await pool.stop()
    monkeypatch.delenv(TOKEN_VAR)
    with pytest.raises(ConfigError, match=f"desktops.remote.token_env names \\${TOKEN_VAR}"):
        RemoteProvider(_cfg(manager.url))


async def test_a_failed_start_falls_through_to_the_next_manager(manager, tmp_path, token):
    with GuiDockerEnvManager(tmp_path / "second", {token: 1}) as second:
        manager.fail_next_starts = 5
        provider = RemoteProvider(_cfg(manager.url, second.url))
        desktop = await provider.start(0)
        try:
            assert manager.running() == [] and len(second.running()) == 1
            assert manager.usage[token]["current"] == 0  # their rollback
            assert desktop.info["manager"] == second.url
        finally:
            await provider.stop(desktop)
            await provider.close()
        assert second.running() == []


async def test_an_emulator_stopped_behind_our_back_is_replaced(manager, token):
    pool = DesktopPool(_cfg(manager.url))
    await pool.start()
    try:
        [first] = manager.running()
        async with __import__("httpx2").AsyncClient() as http:
            r = await http.delete(f"{manager.url}/emulators/{first}",
                                  headers={"Authorization": f"Bearer {token}"})
            assert r.status_code == 200
        await until(lambda: manager.running() not in ([], [first]), 240, 0.2)
        await until(lambda: pool.stats()["free"] == 1, 60, 0.1)
        assert pool.counters["quarantined"] >= 1
    finally:
        await pool.stop()
    assert manager.running() == []


async def test_a_reset_cut_by_its_deadline_gives_back_what_it_brings_later(manager):
    provider = RemoteProvider(_cfg(manager.url))
    desktop = await provider.start(0)
    task = asyncio.create_task(provider.reset(desktop))
    await until(lambda: manager.boots == 2, 60, 0.01)
    task.cancel()  # the pool's reset deadline, while the new emulator boots
    with pytest.raises(asyncio.CancelledError):
        await task
    await provider.close()  # waits for the late start and stops what it brought
    assert manager.starts == manager.stopped == 2
    assert manager.running() == [] and manager.usage["alpha"]["current"] == 0


def test_the_demo_through_run_py_on_gui_docker_env_emulators(tmp_path, token):
    """The whole demo as users run it, its desktops emulators of the stand-in. Another
    client holds one of the token's two slots while the run starts and its first episodes
    run: the run's second desktop is refused (429) until that client stops its emulator,
    then the pool's refill gets it. Every episode is scored as on local desktops, a full
    quota is never an episode's failure, and no emulator is left after the run."""
    tasks = [json.loads(p.read_text())["id"]
             for p in sorted((REPO_ROOT / "tasks" / "demo" / "examples").glob("*/*.json"))]
    run_dir = tmp_path / "results" / "demo"
    with GuiDockerEnvManager(tmp_path / "gde", {token: 2}) as manager:
        auth = {"Authorization": f"Bearer {token}"}
        other = httpx.post(f"{manager.url}/start_emulator", headers=auth, timeout=120).json()
        args = [sys.executable, str(REPO_ROOT / "run.py"), "--config",
                str(REPO_ROOT / "configs" / "demo.yaml")]
        for s in (f"run.output_dir={tmp_path / 'results'}", "desktops.provider=remote",
                  "desktops.remote.kind=gui-docker-env",
                  f"desktops.remote.urls={json.dumps([manager.url])}",
                  f"desktops.remote.token_env={TOKEN_VAR}", "desktops.remote.wait_s=5",
                  "ray.include_dashboard=false"):
            args += ["--set", s]
        proc = subprocess.Popen(args, cwd=REPO_ROOT, stdout=subprocess.DEVNULL,
                                stderr=subprocess.PIPE, text=True,
                                env={**os.environ, TOKEN_VAR: token})
        try:
            deadline = time.monotonic() + RUN_TIMEOUT_S
            results = run_dir / "results.jsonl"
            while not (results.exists() and len(results.read_text().splitlines()) >= 2):
                assert proc.poll() is None, "the run ended early"
                assert time.monotonic() < deadline
                time.sleep(0.5)
            assert manager.refusals >= 1  # the run's second desktop: refused so far
            httpx.delete(f"{manager.url}/emulators/{other['data']['emulator_id']}",
                         headers=auth, timeout=60)
            _, err = proc.communicate(timeout=RUN_TIMEOUT_S)
        finally:
            if proc.poll() is None:
                proc.send_signal(signal.SIGINT)
                proc.communicate(timeout=120)
        assert proc.returncode == 0, err[-4000:]
        records = assert_every_episode_succeeded(run_dir, tasks)
        assert all(r["desktop"].startswith("remote-") for r in records)
        # The refill's desktop (the next index) ran episodes too, beside the first one.
        assert len({r["desktop"] for r in records}) == 2
        assert manager.running() == [], "emulators left after the run"
        assert manager.starts == manager.stopped
    assert not list(Path(tmp_path / "gde").glob("*/session.json"))


# --------------------------------------------------------------------------- kind: cua

TENANT_VAR = "CUA_TEST_TENANT_TOKEN"
DESKTOP_VAR = "CUA_TEST_DESKTOP_TOKEN"


def _serve(tmp_path: Path, env: dict[str, str]) -> tuple[subprocess.Popen[str], str]:
    """Our desktop service on 2 local desktops, as a subprocess: it and its URL."""
    config = tmp_path / "service.yaml"
    config.write_text(
        "desktops: {provider: local, count: 2, warm_spares: 0, screen_width: 1280,\n"
        f"  screen_height: 720, token_env: {DESKTOP_VAR},\n"
        f"  local: {{state_dir: {tmp_path / 'svc-desktops'}}}}}\n"
        f"service: {{port: 0, lease_ttl_s: 15, tenants: [{{name: run, token_env: {TENANT_VAR},"
        " max_leases: 2}]}\n")
    proc = subprocess.Popen([sys.executable, "-m", "cua_rollout.service", "--config",
                             str(config)], cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert line.startswith("desktop service on "), (line, proc.stderr.read()[-3000:]
                                                     if proc.poll() is not None else "")
    return proc, line.split()[3]


def test_the_demo_through_run_py_on_leases_of_our_desktop_service(tmp_path):
    """run.py with ``kind: cua`` against the real service (a subprocess on local desktops):
    every episode scored, and when the run has ended the service holds no lease of it."""
    tasks = ["terminal-hello-file", "calc-divide-keyboard", "terminal-wifi-infeasible"]
    env = {**os.environ, TENANT_VAR: "tenant-secret", DESKTOP_VAR: "desktop-secret"}
    service, url = _serve(tmp_path, env)
    try:
        args = [sys.executable, str(REPO_ROOT / "run.py"), "--config",
                str(REPO_ROOT / "configs" / "demo.yaml")]
        for s in (f"run.output_dir={tmp_path / 'results'}", "desktops.provider=remote",
                  "desktops.remote.kind=cua", f"desktops.remote.urls={json.dumps([url])}",
                  f"desktops.remote.token_env={TENANT_VAR}", "ray.include_dashboard=false",
                  f"tasks.task_ids={json.dumps(tasks)}"):
            args += ["--set", s]
        done = subprocess.run(args, cwd=REPO_ROOT, capture_output=True, text=True,
                              timeout=RUN_TIMEOUT_S, env={**env, DESKTOP_VAR: ""})
        assert done.returncode == 0, done.stderr[-4000:]
        records = assert_every_episode_succeeded(tmp_path / "results" / "demo", tasks)
        assert all(r["desktop"].startswith("remote-") for r in records)
        status = httpx.get(url + "/status", headers={"Authorization": "Bearer tenant-secret"},
                           timeout=10).json()
        assert not status.get("leases"), status
    finally:
        service.send_signal(signal.SIGTERM)
        service.communicate(timeout=120)
    assert not list((tmp_path / "svc-desktops").glob("*/session.json"))
