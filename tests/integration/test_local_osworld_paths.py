"""Local desktops have the paths and the initial state OSWorld's VM has where its tasks read
them (docs/osworld.md, "What a task can tell apart"): HOME at /home/user, a /tmp and a session
bus at /run/user/1000/bus of their own, each desktop's apart from the others' and from the
machine's; the GNOME settings, Chrome profile and default apps of OSWorld's image.

Two real local desktops (Xvfb, the session bus, the desktop server) through the pool, as a run
starts them."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from cua_rollout.config import DesktopsConfig
from cua_rollout.envs.client import RemoteDesktopEnv
from cua_rollout.envs.local_session import OSWORLD_HOME, OSWORLD_RUNTIME, SESSION_FILE
from cua_rollout.runtime.pool import DesktopPool

pytestmark = pytest.mark.skipif(shutil.which("Xvfb") is None, reason="needs Xvfb")


def _cfg(tmp_path: Path) -> DesktopsConfig:
    return DesktopsConfig(count=2, warm_spares=0, screen_width=1024, screen_height=768,
                          lease_timeout_s=60, reset_timeout_s=30,
                          local={"state_dir": tmp_path / "desktops", "start_timeout_s": 60})


@pytest.fixture
async def pool(tmp_path):
    pool = DesktopPool(_cfg(tmp_path))
    await pool.start()
    if not all(s.namespaced for s in pool.provider._sessions.values()):
        await pool.stop()
        pytest.skip("local desktops run without a mount namespace here (not root?)")
    try:
        yield pool
    finally:
        await pool.stop()
    assert list((tmp_path / "desktops").glob(f"*/{SESSION_FILE}")) == []


def _host_entries(path: Path) -> set[str]:
    try:
        return {p.name for p in path.iterdir()}
    except FileNotFoundError:
        return set()


async def _sh(env: RemoteDesktopEnv, command: str) -> str:
    reply = await env.execute(command, shell=True)
    assert reply["returncode"] == 0, reply
    return reply["output"]


async def test_each_desktop_has_osworlds_paths_of_its_own(pool):
    host_home, host_run = _host_entries(OSWORLD_HOME), _host_entries(OSWORLD_RUNTIME)
    host_tmp = _host_entries(Path("/tmp"))
    a, b = await pool.lease("ep-a"), await pool.lease("ep-b")
    env_a = RemoteDesktopEnv(a.url, pool.cfg, name=a.desktop_id)
    env_b = RemoteDesktopEnv(b.url, pool.cfg, name=b.desktop_id)
    # OSWorld's setup steps name absolute paths on its VM: /home/user/..., /tmp/...
    await env_a.reset({"id": "paths", "config": [
        {"type": "execute", "parameters": {"command": "mkdir -p /home/user/Desktop/dir1 && "
                                           "echo a > /home/user/Desktop/dir1/f.txt && "
                                           "echo t > /tmp/osworld-note", "shell": True}}]})
    assert (await _sh(env_a, "echo $HOME; pwd")).split() == ["/home/user", "/home/user"]
    assert await env_a.get_file("/home/user/Desktop/dir1/f.txt") == b"a\n"
    session_a = pool.provider._sessions[a.desktop_id]
    assert (session_a.home / "Desktop" / "dir1" / "f.txt").read_text() == "a\n"
    # The other desktop sees its own HOME and /tmp, the machine sees neither.
    assert await env_b.get_file("/home/user/Desktop/dir1/f.txt") is None
    assert "osworld-note" not in await _sh(env_b, "ls -a /tmp")
    assert _host_entries(OSWORLD_HOME) == host_home
    assert "osworld-note" not in _host_entries(Path("/tmp")) - host_tmp
    # The session bus where OSWorld's tasks name it (a task exports this address).
    out = await _sh(env_a, "DBUS_SESSION_BUS_ADDRESS=unix:path=/run/user/1000/bus "
                           "gsettings set org.gnome.desktop.interface text-scaling-factor 1.5"
                           " && gsettings get org.gnome.desktop.interface text-scaling-factor;"
                           " echo $XDG_RUNTIME_DIR")
    assert out.split() == ["1.5", "/run/user/1000"]
    assert (await _sh(env_b, "gsettings get org.gnome.desktop.interface "
                             "text-scaling-factor")).strip() == "1.0"
    assert _host_entries(OSWORLD_RUNTIME) == host_run
    # A reset gives the desktop back as it started: files, /tmp and settings.
    await pool.release(a.lease_id)
    again = await pool.lease("ep-c")
    env = RemoteDesktopEnv(again.url, pool.cfg, name=again.desktop_id)
    assert again.desktop_id == a.desktop_id  # b is still leased
    assert await env.get_file("/home/user/Desktop/dir1/f.txt") is None
    assert await env.get_file("/tmp/osworld-note") is None
    assert (await _sh(env, "gsettings get org.gnome.desktop.interface "
                           "text-scaling-factor")).strip() == "1.0"


async def test_the_initial_state_is_osworlds_where_tasks_read_it(pool):
    lease = await pool.lease("ep-state")
    env = RemoteDesktopEnv(lease.url, pool.cfg, name=lease.desktop_id)
    await env.reset({"id": "state", "config": []})
    # OSWorld's screen never locks: "lock my computer when I leave" must not pass untouched.
    assert (await _sh(env, "gsettings get org.gnome.desktop.screensaver "
                           "lock-enabled")).strip() == "false"
    if shutil.which("chromium") or shutil.which("google-chrome-stable"):
        # Chrome has been started on the image: its Preferences exist before any launch.
        prefs = await env.get_file("/home/user/.config/google-chrome/Default/Preferences")
        assert prefs is not None and b'"profile"' in prefs
    if os.path.exists("/usr/share/applications/org.gnome.Totem.desktop"):
        assert (await _sh(env, "xdg-mime query default video/mp4")).strip() == (
            "org.gnome.Totem.desktop")
    if shutil.which("sudo"):
        assert (await _sh(env, "echo password | sudo -S echo ok")).strip().endswith("ok")
