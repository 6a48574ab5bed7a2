"""Desktops as QEMU VMs of the VM test image (``scripts/build_vm_image.sh``) through the pool,
as a run uses them: the conformance checker on a VM desktop, and what an episode leaves gone
after the pool's restore and its reset check (``verify``, on: the image has python3, wmctrl,
a HOME). Every QEMU started is gone after. The ready state is the user's
(``~/.cache/cua-rollout/vm-states``): built once, as ``configs/demo_vm.yaml``'s run builds it
(the demo on VM desktops is run as users run it, not here: under TCG it takes ~8 minutes)."""

from __future__ import annotations

import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from cua_rollout.config import DesktopsConfig
from cua_rollout.envs.checker import check_desktop_env
from cua_rollout.envs.client import RemoteDesktopEnv
from cua_rollout.runtime.pool import DesktopPool
from tests.support import REPO_ROOT, qemu_children, release_and_lease, unavailable

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(1800)]

BUILD = REPO_ROOT / "scripts" / "build_vm_image.sh"
SCREEN = (1280, 720)


@pytest.fixture(scope="module")
def image() -> Path:
    for tool in ("qemu-system-x86_64", "qemu-img"):
        if shutil.which(tool) is None:
            unavailable(f"{tool} is not installed (scripts/setup_env.sh --vm)")
    done = subprocess.run(["bash", str(BUILD)], cwd=REPO_ROOT, capture_output=True, text=True,
                          timeout=3600, env={**os.environ, "PYTHON": sys.executable},
                          check=False)
    if done.returncode != 0 and os.geteuid() != 0:
        unavailable("the VM image is not built and building it needs root")
    assert done.returncode == 0, done.stderr[-3000:]
    return Path(done.stdout.strip().splitlines()[-1])


@pytest.fixture
def state_dir() -> Iterator[Path]:
    # Short: each VM's QMP socket lives under it (a UNIX socket path holds 107 bytes).
    path = Path(tempfile.mkdtemp(prefix="vmi-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _qemus() -> list[int]:
    return [p.pid for p in qemu_children()]


def _cfg(image: Path, state_dir: Path, **kw) -> DesktopsConfig:
    base = dict(provider="vm", count=1, warm_spares=0, screen_width=SCREEN[0],
                screen_height=SCREEN[1], lease_timeout_s=300, reset_timeout_s=120,
                vm={"image": image, "memory_mb": 1024, "cpus": 1, "state_dir": state_dir})
    base.update(kw)
    return DesktopsConfig(**base)


async def test_a_vm_desktop_conforms_and_a_restore_leaves_nothing_of_an_episode(image,
                                                                              state_dir):
    before = image.stat()
    cfg = _cfg(image, state_dir)
    assert cfg.verify.enabled  # the reset check runs after each restore
    pool = DesktopPool(cfg)
    await pool.start()
    resets: list[float] = []
    try:
        lease = await pool.lease("conformance")
        env = RemoteDesktopEnv.for_lease(lease.url, cfg, name=lease.desktop_id)
        seen = await check_desktop_env(env, screen_size=SCREEN)
        assert seen["step"].returncode == 0  # pyautogui ran on the VM's display
        # What an episode leaves: a file in HOME, an app on the screen.
        env = RemoteDesktopEnv.for_lease(lease.url, cfg, name=lease.desktop_id)
        try:
            await env.execute(["bash", "-c", "echo x > ~/Desktop/left.txt; (xterm &); sleep 3"])
            assert await env.get_file("/home/user/Desktop/left.txt") == b"x\n"
        finally:
            await env.close()
        lease, took = await release_and_lease(pool, lease, 3)
        resets += took
        stats = pool.stats()
        # The restore passed the reset check every time (nothing quarantined or replaced).
        assert (stats["verify_failures"], stats["quarantined"], stats["replaced"]) == (0, 0, 0)
        env = RemoteDesktopEnv.for_lease(lease.url, cfg, name=lease.desktop_id)
        try:
            assert await env.get_file("/home/user/Desktop/left.txt") is None
            assert (await env.execute(["pgrep", "-x", "xterm"])).get("returncode") == 1
            # The guest's clock is the host's, not the moment the ready state was saved
            # (the conformance check and three restores ago, at least): cua-clock.service.
            guest = int((await env.execute(["date", "+%s"]))["output"])
            assert abs(guest - time.time()) < 3, f"guest clock {guest - time.time():+.0f} s"
        finally:
            await env.close()
        await pool.release(lease.lease_id)
    finally:
        await pool.stop()
    assert _qemus() == [], "QEMU processes left after the pool stopped"
    after = image.stat()  # the base of every VM: never written
    assert (after.st_mtime_ns, after.st_size) == (before.st_mtime_ns, before.st_size)
    assert not any(state_dir.iterdir()), "VM directories left after the pool stopped"
    print(f"\nvm release + restore + verify + lease s: {[round(r, 2) for r in resets]} "
          f"(median {statistics.median(resets):.2f})")

