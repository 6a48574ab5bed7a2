"""Real local desktops (Xvfb + openbox + session bus + desktop server) in a DesktopPool,
driven through RemoteDesktopEnv: isolation, reset, replacement and stale-desktop sweeping."""

from __future__ import annotations

import asyncio
import functools
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import httpx
import psutil
import pytest

from cua_rollout.config import DesktopsConfig, StaticDesktopsConfig
from cua_rollout.core.errors import DesktopError
from cua_rollout.desktop.protocol import Paths
from cua_rollout.envs.checker import check_desktop_env
from cua_rollout.envs.client import RemoteDesktopEnv
from cua_rollout.envs.local_session import MARKER, SESSION_FILE, sweep_stale_sessions
from cua_rollout.envs.providers.local import LocalProvider
from cua_rollout.envs.providers.static import StaticProvider
from cua_rollout.runtime.pool import DesktopPool
from tests import support
from tests.support import REPO_ROOT

pytestmark = pytest.mark.integration

ROOT = REPO_ROOT


def desktops_cfg(tmp_path: Path, **kw) -> DesktopsConfig:
    base = dict(count=2, warm_spares=0, screen_width=1024, screen_height=768,
                lease_timeout_s=60, reset_timeout_s=30, health_interval_s=0.5,
                local={"state_dir": tmp_path / "desktops", "start_timeout_s": 60})
    base.update(kw)
    return DesktopsConfig(**base)


def tagged(desktop_id: str) -> list[psutil.Process]:
    out = []
    for proc in psutil.process_iter(["pid"]):
        try:
            if proc.environ().get(MARKER) == desktop_id:
                out.append(proc)
        except psutil.Error:
            continue
    return out


until = functools.partial(support.until, timeout_s=30.0, poll_s=0.05)


@pytest.fixture
async def pool(tmp_path):
    pool = DesktopPool(desktops_cfg(tmp_path))
    await pool.start()
    try:
        yield pool
    finally:
        await pool.stop()
    assert list((tmp_path / "desktops").glob(f"*/{SESSION_FILE}")) == []


async def test_leases_are_exclusive_and_reset_restores_a_clean_desktop(pool):
    cfg = pool.cfg
    a = await pool.lease("ep-a")
    b = await pool.lease("ep-b")
    assert a.desktop_id != b.desktop_id and a.url != b.url
    env = RemoteDesktopEnv(a.url, cfg, name=a.desktop_id)
    task = {"id": "write-file", "config": [
        {"type": "launch", "parameters": {"command": ["xterm"]}},
        {"type": "execute", "parameters": {
            "command": "echo episode-1 > ~/Desktop/note.txt", "shell": True}},
    ]}
    first = await env.reset(task)
    assert first.size == (cfg.screen_width, cfg.screen_height)
    home = Path(pool.provider._sessions[a.desktop_id].home)
    assert (home / "Desktop" / "note.txt").read_text() == "episode-1\n"
    await until(lambda: any("xterm" in " ".join(p.cmdline()) for p in tagged(a.desktop_id)))
    # The other desktop has its own HOME: it does not see this one's files there.
    other = RemoteDesktopEnv(b.url, cfg, name=b.desktop_id)
    assert (await other.execute("ls ~/Desktop", shell=True))["output"].strip() == ""
    await pool.release(a.lease_id)
    await until(lambda: pool.stats()["free"] == 1)
    assert not (home / "Desktop" / "note.txt").exists()
    assert not any("xterm" in " ".join(p.cmdline()) for p in tagged(a.desktop_id))
    again = await pool.lease("ep-c")
    assert again.desktop_id == a.desktop_id
    env = RemoteDesktopEnv(again.url, cfg)
    reply = await env.execute("ls ~/Desktop", shell=True)
    assert reply["output"].strip() == ""
    stats = pool.stats()
    assert stats["resets"] == 1 and stats["reset_s_max"] < 5.0


async def test_actions_reach_the_desktop(pool):
    lease = await pool.lease("ep")
    env = RemoteDesktopEnv(lease.url, pool.cfg)
    await env.reset({"id": "t", "config": []})
    result = await env.step("pyautogui.moveTo(123, 321)", pause_s=0.0)
    assert result.ok, result
    assert await env.cursor_position() == (123, 321)
    assert (await env.step("WAIT", pause_s=0.01)).returncode is None
    # Plain actions run in the server's warm interpreter, which a reset keeps (it is the
    # server's machinery, not an app the episode left).
    actions = httpx.get(lease.url + Paths.ACTIONS, timeout=10).json()
    assert actions["warm"] >= 1 and actions["worker_pid"], actions
    resets = pool.stats()["resets"]
    await pool.release(lease.lease_id)
    deadline = time.monotonic() + 60
    while pool.stats()["resets"] == resets:  # the released desktop is reset in the background
        assert time.monotonic() < deadline, pool.stats()
        await asyncio.sleep(0.1)
    after = httpx.get(lease.url + Paths.ACTIONS, timeout=10).json()
    assert (after["worker_pid"], after["deaths"]) == (actions["worker_pid"], 0), after


async def test_an_action_is_ended_by_the_server_before_the_client_gives_up(pool, tmp_path):
    """The client sends its deadline with an action; the server ends the action before it,
    so a slow action never runs on after the episode moved on (into the next one)."""
    lease = await pool.lease("ep-slow")
    cfg = pool.cfg.model_copy(update={"request_timeout_s": 3.0})
    env = RemoteDesktopEnv(lease.url, cfg, name=lease.desktop_id)
    # In the desktop's HOME: the desktop has a /tmp of its own, not this machine's.
    pid_file = pool.provider._sessions[lease.desktop_id].home / "action.pid"
    action = ("import os; open(os.path.expanduser('~/action.pid'), 'w')"
              ".write(str(os.getpid())); time.sleep(300)")
    started = time.monotonic()
    with pytest.raises(DesktopError, match=r"timed out after 1\.5 seconds"):
        await env.step(action)
    assert time.monotonic() - started < cfg.request_timeout_s
    pid = int(pid_file.read_text())
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    await pool.release(lease.lease_id)


async def test_a_killed_desktop_server_is_quarantined_and_replaced(pool):
    victim = await pool.lease("ep-dead")
    survivor = await pool.lease("ep-alive")
    session = pool.provider._sessions[victim.desktop_id]
    os.kill(session._procs["server"].pid, signal.SIGKILL)
    await pool.release(victim.lease_id, healthy=False)
    await until(lambda: pool.stats()["replaced"] == 1, timeout_s=60)
    # The other episode went on undisturbed.
    env = RemoteDesktopEnv(survivor.url, pool.cfg)
    assert (await env.observe()).size == (pool.cfg.screen_width, pool.cfg.screen_height)
    fresh = await pool.lease("ep-new")
    assert fresh.desktop_id not in (victim.desktop_id, survivor.desktop_id)
    assert await RemoteDesktopEnv(fresh.url, pool.cfg).health()
    assert tagged(victim.desktop_id) == []


async def test_stale_desktops_of_a_crashed_run_are_swept(tmp_path):
    cfg = desktops_cfg(tmp_path, count=1)
    # A "run" in another process starts a desktop and dies without stopping it.
    script = textwrap.dedent(f"""
        import asyncio, os, signal, sys
        sys.path.insert(0, {str(ROOT)!r})
        from cua_rollout.config import DesktopsConfig
        from cua_rollout.envs.providers.local import LocalProvider
        cfg = DesktopsConfig.model_validate_json({cfg.model_dump_json()!r})
        async def main():
            desktop = await LocalProvider(cfg).start(0)
            print(desktop.id, flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        asyncio.run(main())
    """)
    crashed = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                             timeout=120, check=False)
    assert crashed.returncode == -signal.SIGKILL, crashed.stderr
    stale_id = crashed.stdout.split()[0]
    record = json.loads((cfg.local.state_dir / stale_id / SESSION_FILE).read_text())
    leftover_pids = [e["pid"] for e in record["processes"]] + [p.pid for p in tagged(stale_id)]
    assert all(psutil.pid_exists(p) for p in leftover_pids)  # Xvfb, openbox, bus, server
    assert sweep_stale_sessions(cfg.local.state_dir) == [stale_id]
    assert tagged(stale_id) == []
    assert not any(psutil.pid_exists(p) and psutil.Process(p).status() != "zombie"
                   for p in leftover_pids)
    # A live run's desktops are never swept.
    provider = LocalProvider(cfg)
    desktop = await provider.start(0)
    try:
        assert sweep_stale_sessions(cfg.local.state_dir) == []
        assert await provider.health(desktop)
    finally:
        await provider.stop(desktop)


async def test_local_desktops_and_a_real_server_behind_the_static_provider_conform(pool):
    """The conformance checker on real desktops: a local one through the pool's lease, and
    the same kind of desktop server reached by URL through the static provider."""
    cfg = pool.cfg
    lease = await pool.lease("conformance")
    env = RemoteDesktopEnv.for_lease(lease.url, cfg, name=lease.desktop_id)
    seen = await check_desktop_env(env, screen_size=(cfg.screen_width, cfg.screen_height))
    assert seen["step"].returncode == 0  # pyautogui ran on the real display
    static_cfg = cfg.model_copy(update={
        "provider": "static", "count": 1,
        "static": StaticDesktopsConfig(urls=[lease.url])})
    provider = StaticProvider(static_cfg)
    desktop = await provider.start(0)
    await check_desktop_env(RemoteDesktopEnv.for_lease(desktop.url, static_cfg),
                            screen_size=(cfg.screen_width, cfg.screen_height))
    await pool.release(lease.lease_id)


async def test_a_local_desktop_on_a_network_address_requires_its_token(tmp_path, monkeypatch):
    """``desktops.local.host``: the server binds an address other hosts reach (here this
    machine's first non-loopback IPv4), its URL names it, and it answers only with the
    token (which the config requires off loopback)."""
    import httpx
    import psutil as ps

    address = next((a.address for addrs in ps.net_if_addrs().values() for a in addrs
                    if a.family.name == "AF_INET" and not a.address.startswith("127.")), None)
    if address is None:
        support.unavailable("this machine has no non-loopback IPv4 address")
    monkeypatch.setenv("LOCAL_NET_TOKEN", "tok-local-net")
    cfg = desktops_cfg(tmp_path, count=1, token_env="LOCAL_NET_TOKEN",
                       local={"state_dir": tmp_path / "desktops", "start_timeout_s": 60,
                              "host": address})
    provider = LocalProvider(cfg)
    desktop = await provider.start(0)
    try:
        assert desktop.url.startswith(f"http://{address}:")
        assert await provider.health(desktop)
        assert httpx.post(desktop.url + "/screen_size", timeout=10).status_code == 401
        ok = httpx.post(desktop.url + "/screen_size", timeout=10,
                        headers={"Authorization": "Bearer tok-local-net"})
        assert ok.status_code == 200
    finally:
        await provider.stop(desktop)
