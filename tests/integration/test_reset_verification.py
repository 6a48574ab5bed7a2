"""Resets of desktops the pool does not own, and the check after every reset: a real
desktop server (a local desktop: Xvfb, openbox, our server) reached by URL through the
static provider, as an OSWorld VM is. The builtin reset brings it back (files, apps,
windows); a reset that leaves something behind is caught, quarantined and counted; local
desktops pass the same check after every reset."""

from __future__ import annotations

import asyncio
import shutil
import tempfile
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from cua_rollout.config import DesktopsConfig
from cua_rollout.envs.client import RemoteDesktopEnv
from cua_rollout.envs.providers.local import LocalProvider
from cua_rollout.envs.providers.static import StaticProvider
from cua_rollout.envs.verify import DesktopVerifier
from cua_rollout.runtime.pool import DesktopPool
from tests.support import unavailable

pytestmark = pytest.mark.integration


def _cfg(state: Path, **kw) -> DesktopsConfig:
    base = dict(count=1, warm_spares=0, screen_width=1024, screen_height=768,
                lease_timeout_s=30, reset_timeout_s=60, health_interval_s=60,
                local={"state_dir": state / "desktops", "start_timeout_s": 60})
    base.update(kw)
    return DesktopsConfig(**base)


@pytest.fixture
async def vm(tmp_path) -> AsyncIterator[str]:
    """A desktop server that plays an OSWorld VM: started here, reached only by its URL."""
    if shutil.which("Xvfb") is None or shutil.which("wmctrl") is None:
        unavailable("Xvfb and wmctrl are needed for a local desktop")
    state = Path(tempfile.mkdtemp(prefix="vm-"))
    provider = LocalProvider(_cfg(state))
    desktop = await provider.start(0)
    try:
        yield desktop.url
    finally:
        await provider.stop(desktop)
        shutil.rmtree(state, ignore_errors=True)


async def _dirty(url: str, cfg: DesktopsConfig) -> RemoteDesktopEnv:
    """What an episode leaves: a file and a folder in HOME, an app with a window."""
    env = RemoteDesktopEnv(url, cfg)
    await env.execute(["sh", "-c", "echo left > ~/left.txt && mkdir -p ~/Desktop/new"])
    await env.launch(["xterm", "-T", "leftover-term"])
    for _ in range(100):
        out = (await env.execute(["wmctrl", "-l"]))["output"]
        if "leftover-term" in out:
            break
        await asyncio.sleep(0.1)
    else:
        raise AssertionError("the xterm window never showed")
    return env


async def _pool(url: str, tmp_path: Path, **static) -> DesktopPool:
    cfg = _cfg(tmp_path, provider="static", static={"urls": [url], **static})
    pool = DesktopPool(cfg, StaticProvider(cfg))
    await pool.start()
    return pool


async def _reset_done(pool: DesktopPool) -> None:
    for _ in range(600):
        stats = pool.stats()
        if stats["resetting"] == 0:
            return
        await asyncio.sleep(0.1)
    raise AssertionError("the reset never ended")


async def test_the_builtin_reset_restores_a_vm_and_passes_the_check(vm, tmp_path):
    pool = await _pool(vm, tmp_path)
    try:
        home_before = (await RemoteDesktopEnv(vm, pool.cfg).execute(
            ["sh", "-c", "ls -A ~ | sort"]))["output"]
        for _ in range(2):  # twice: the baseline is reused, not retaken
            lease = await pool.lease("episode")
            env = await _dirty(lease.url, pool.cfg)
            await pool.release(lease.lease_id)
            await _reset_done(pool)
            stats = pool.stats(detail=True)
            assert stats["free"] == 1 and stats["verify_failures"] == 0, stats
            assert stats["desktops"][0]["last_error"] is None
            out = (await env.execute(["sh", "-c", "ls -A ~ | sort; wmctrl -l; "
                                      "pgrep -x xterm || true"]))["output"]
            assert "left.txt" not in out and "leftover-term" not in out
            assert (await env.execute(["sh", "-c", "ls -A ~ | sort"]))["output"] == home_before
            assert (await env.execute(["sh", "-c", "test -d ~/Desktop/new; echo $?"])
                    )["output"].strip() == "1"
        print(f"\nbuiltin reset + check: median {stats['reset_s_median']:.2f} s, "
              f"check {stats['verify_s_median']:.2f} s")
    finally:
        await pool.stop()


async def test_a_reset_that_leaves_things_behind_is_quarantined_and_counted(vm, tmp_path):
    pool = await _pool(vm, tmp_path, reset="none", retry_quarantined_s=3600)
    try:
        lease = await pool.lease("episode")
        await _dirty(lease.url, pool.cfg)
        await pool.release(lease.lease_id)
        await _reset_done(pool)
        stats = pool.stats(detail=True)
        assert stats["quarantined"] == 1 and stats["verify_failures"] == 1, stats
        error = stats["desktops"][0]["last_error"]
        assert "initial state" in error
        assert "xterm" in error  # the process, and its window
        assert "leftover-term" in error
        assert "+left.txt" in error and "+Desktop/new" in error
    finally:
        await pool.stop()


async def test_the_check_sees_each_kind_of_leftover_alone(vm, tmp_path):
    cfg = _cfg(tmp_path, verify={"screenshot_max_distance": 6})
    verifier = DesktopVerifier(cfg)
    env = RemoteDesktopEnv(vm, cfg)
    await verifier.remember("vm", vm)
    assert await verifier.check("vm", vm) == []  # nothing changed
    await env.execute(["sh", "-c", "echo x > ~/Documents_note.txt"])
    [problem] = await verifier.check("vm", vm)
    assert problem.startswith("HOME differs") and "+Documents_note.txt" in problem
    await env.execute(["sh", "-c", "rm ~/Documents_note.txt"])
    await env.launch(["sleep", "300"])  # a process with no window
    await asyncio.sleep(0.5)
    problems = await verifier.check("vm", vm)
    # sleep is one of the check's own transient names: not a leftover by itself.
    assert problems == []
    await env.launch(["xterm", "-T", "lonely", "-geometry", "200x60+0+0"])
    for _ in range(100):  # until the window is listed and painted
        problems = await verifier.check("vm", vm)
        if (any("windows left open" in p for p in problems)
                and any(p.startswith("the screen differs") for p in problems)):
            break
        await asyncio.sleep(0.1)
    kinds = {p.split(":")[0] for p in problems}
    assert {"processes left running", "windows left open"} <= kinds
    assert any(p.startswith("the screen differs") for p in problems), problems
    # The fixture's stop ends the desktop's processes (by pid, as it started them).


async def test_local_desktops_pass_the_check_after_every_reset(tmp_path):
    if shutil.which("Xvfb") is None:
        unavailable("Xvfb is not installed")
    cfg = _cfg(tmp_path, count=2)
    pool = DesktopPool(cfg)
    await pool.start()
    try:
        for n in range(3):
            leases = [await pool.lease(f"e{n}{i}") for i in range(2)]
            for lease in leases:
                await _dirty(lease.url, cfg)
            for lease in leases:
                await pool.release(lease.lease_id)
            await _reset_done(pool)
        stats = pool.stats()
        assert stats["resets"] == 6 and stats["verify_failures"] == 0, stats
        print(f"\nlocal reset: median {stats['reset_s_median']:.2f} s, check median "
              f"{stats['verify_s_median']:.2f} s")
    finally:
        await pool.stop()
