"""The ``vm`` desktop provider (``cua_rollout/envs/providers/vm.py``) with real QEMU (TCG) and
the tiny test guest (``tests/doubles/vm_guest.py``), mostly under a real ``DesktopPool``: the
ready state built once and restored into each VM, each reached through its token gate (the
token never reaching the guest), reset by restore on the same ports, a killed QEMU quarantined
and replaced, a corrupt ready state rebuilt, a SIGKILLed owner's VMs swept, and the up-front
errors.

The pools run with ``verify.enabled: false``: the reset check runs ``python3`` on the desktop,
and the tiny guest has no python3 (only busybox). Every test checks that no QEMU child of
this process is left, and removes its state directory (short, under /tmp: QMP sockets live
there). Start and reset times are printed (``-s``) for the notes; nothing asserts on them.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest

from cua_rollout.config import DesktopsConfig
from cua_rollout.core.errors import ConfigError
from cua_rollout.envs.client import RemoteDesktopEnv, close_shared_client
from cua_rollout.envs.providers.base import Desktop
from cua_rollout.envs.providers.vm import VMProvider
from cua_rollout.runtime.pool import DesktopPool
from cua_rollout.vm import probe_kvm
from cua_rollout.vm.readystate import MANIFEST_FILE, RAM_FILE
from tests.doubles.vm_guest import (
    SCREEN_HEIGHT,
    SCREEN_WIDTH,
    TestGuest,
    make_base_disk,
)
from tests.support import REPO_ROOT, kill_qemu_children, vm_test_guest

pytestmark = [pytest.mark.integration, pytest.mark.slow]

TOKEN_ENV = "CUA_VMT_TOKEN"
TOKEN = "vm-test-token-7f3a"
MEMORY_MB = 1024
WAIT_S = 120  # TCG on a busy 2-core machine: a first boot takes 5-20 s


@pytest.fixture(scope="module")
def guest() -> TestGuest:
    return vm_test_guest()


@pytest.fixture(scope="module")
def files() -> Iterator[Path]:
    """The module's base image and ready-state cache."""
    path = Path(tempfile.mkdtemp(prefix="vmt-files-", dir="/tmp"))
    try:
        make_base_disk(path / "base.qcow2")
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def state_dir() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="vmt-", dir="/tmp"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(autouse=True)
def no_qemu_left(monkeypatch) -> Iterator[None]:
    """The token in the environment; after the test, no QEMU child of this process."""
    monkeypatch.setenv(TOKEN_ENV, TOKEN)
    yield
    left = kill_qemu_children()  # not left for the next test, whatever this one asserted
    assert left == [], f"QEMU processes left: {left}"


def _cfg(guest: TestGuest, files: Path, state_dir: Path, *, states: Path | None = None,
         vm: dict[str, Any] | None = None, **kw: Any) -> DesktopsConfig:
    settings: dict[str, Any] = dict(
        image=files / "base.qcow2", firmware="bios", memory_mb=MEMORY_MB, cpus=1, accel="tcg",
        kernel=guest.kernel, initrd=guest.initrd, append=guest.cmdline, state_dir=state_dir,
        ready_state_dir=states or files / "states", boot_timeout_s=WAIT_S, ready_still_s=1,
        start_timeout_s=60)
    settings.update(vm or {})
    base: dict[str, Any] = dict(
        provider="vm", count=1, warm_spares=0, screen_width=SCREEN_WIDTH,
        screen_height=SCREEN_HEIGHT, token_env=TOKEN_ENV, lease_timeout_s=WAIT_S,
        reset_timeout_s=60, health_interval_s=60, verify={"enabled": False}, vm=settings)
    base.update(kw)
    return DesktopsConfig(**base)


def _gone(pid: int | None) -> bool:
    if pid is None:
        return True
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


async def _until(condition, what: str, timeout_s: float = WAIT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"not within {timeout_s:g} s: {what}"
        await asyncio.sleep(0.1)


def _auth() -> dict[str, str]:
    return {"Authorization": f"Bearer {TOKEN}"}


async def _screen(url: str) -> bytes:
    async with httpx.AsyncClient(timeout=30) as client:
        reply = await client.get(f"{url}/screenshot", headers=_auth())
    assert reply.status_code == 200 and reply.content.startswith(b"\x89PNG")
    return reply.content


def _states(root: Path) -> list[Path]:
    return [p for p in root.iterdir() if not p.name.startswith(".")] if root.exists() else []


# --------------------------------------------------------------------------- the pool


async def test_a_pool_of_vm_desktops_serves_each_through_its_token_gate(guest, files,
                                                                        state_dir, tmp):
    states = tmp / "states"
    cfg = _cfg(guest, files, state_dir, states=states, count=2)
    pool = DesktopPool(cfg)
    await pool.start()
    provider = pool.provider
    assert isinstance(provider, VMProvider)
    try:
        assert provider.build_s is not None and len(_states(states)) == 1  # built once
        desktops = list(pool._desktops.values())
        assert len(desktops) == 2
        pids = {d.info["pid"] for d in desktops}
        assert len(pids) == 2 and None not in pids
        assert len({d.url for d in desktops}) == 2
        async with httpx.AsyncClient(timeout=30) as client:
            for desktop in desktops:
                url, gates = desktop.url, desktop.info["gates"]
                size = await client.post(f"{url}/screen_size", headers=_auth())
                assert size.status_code == 200
                assert size.json() == {"width": SCREEN_WIDTH, "height": SCREEN_HEIGHT}
                assert (await client.post(f"{url}/screen_size")).status_code == 401
                wrong = await client.get(f"{url}/screenshot",
                                         headers={"Authorization": "Bearer wrong"})
                assert wrong.status_code == 401
                ports = await client.get(f"{url}/ports", headers=_auth())
                assert ports.json() == {"chromium": gates["chromium"], "vlc": gates["vlc"]}
                assert (await client.get(f"{url}/ports")).status_code == 401
                # the guest's own ports are forwarded to loopback only, behind the gates
                assert set(desktop.info["forwards"]) == {"5000", "9222", "8080"}
                assert gates["server"] not in desktop.info["forwards"].values()

                env = RemoteDesktopEnv(url, cfg, name=desktop.id)
                try:
                    assert await env.health()
                    assert (await env.observe()).size == (SCREEN_WIDTH, SCREEN_HEIGHT)
                    await env.learn_ports()
                    assert (env.chromium_port, env.vlc_port) == (gates["chromium"],
                                                                 gates["vlc"])
                finally:
                    await env.close()

                seen = await client.get(f"{url}/requests", headers=_auth())
                assert "GET /requests" in seen.text and "POST /screen_size" in seen.text
                assert "authorization" not in seen.text.lower() and TOKEN not in seen.text
        print(f"\nready state built in {provider.build_s:.1f} s; starts from it (2 VMs at "
              f"once): {[d.info['start_s'] for d in desktops]} s")
    finally:
        await pool.stop()
    assert all(_gone(pid) for pid in pids)
    assert list(state_dir.iterdir()) == []


async def test_a_reset_restores_the_ready_state_on_the_same_ports(guest, files, state_dir):
    cfg = _cfg(guest, files, state_dir)
    pool = DesktopPool(cfg)
    await pool.start()
    try:
        (desktop,) = pool._desktops.values()
        clean = await _screen(desktop.url)
        gates, forwards = dict(desktop.info["gates"]), dict(desktop.info["forwards"])
        resets: list[float] = []
        for round_ in range(3):
            lease = await pool.lease(f"episode-{round_}")
            pid = pool.provider.machine(lease.desktop_id).pid
            async with httpx.AsyncClient(timeout=30) as client:
                assert (await client.get(f"{lease.url}/cgi-bin/mark",
                                         headers=_auth())).status_code == 200
                assert (await client.get(f"{lease.url}/mark", headers=_auth())).text == "dirty\n"
            assert await _screen(lease.url) != clean  # the guest's screen changed

            await pool.release(lease.lease_id)
            await _until(lambda n=round_: pool.counters["resets"] == n + 1, "the reset")

            assert desktop.info["last_reset"]["how"] == "restore"
            resets.append(desktop.info["last_reset"]["seconds"])
            assert pool.provider.machine(desktop.id).pid != pid and _gone(pid)
            assert desktop.info["gates"] == gates and desktop.info["forwards"] == forwards
            async with httpx.AsyncClient(timeout=30) as client:
                assert (await client.get(f"{desktop.url}/mark",
                                         headers=_auth())).status_code == 404  # RAM as saved
            assert await _screen(desktop.url) == clean
        print(f"\nstart {desktop.info['start_s']} s; resets {resets} s "
              f"(median {statistics.median(resets):.2f})")
    finally:
        await pool.stop()


async def test_a_killed_qemu_is_unhealthy_quarantined_and_replaced(guest, files, state_dir,
                                                                   caplog):
    cfg = _cfg(guest, files, state_dir, count=2, health_interval_s=1)
    pool = DesktopPool(cfg)
    await pool.start()
    provider = pool.provider
    try:
        # One killed while leased: the episode gives it back unhealthy; the reset names the
        # fault instead of restoring over it, and the pool replaces the desktop.
        lease = await pool.lease("victim")
        leased = provider.machine(lease.desktop_id)
        os.kill(leased.pid, signal.SIGKILL)
        await _until(lambda: not leased.alive(), "QEMU's exit")
        await pool.release(lease.lease_id, healthy=False)
        await _until(lambda: lease.desktop_id not in pool._desktops
                     and len(pool._desktops) == 2 and pool.counters["replaced"] == 1,
                     "the replacement of the leased desktop")

        # One killed while free: its health check fails, the pool replaces it.
        free = next(d for d in pool._desktops.values() if d.state == "free")
        machine = provider.machine(free.id)
        os.kill(machine.pid, signal.SIGKILL)
        await _until(lambda: not machine.alive(), "QEMU's exit")
        with caplog.at_level(logging.WARNING, logger="cua_rollout.envs.providers.vm"):
            assert await provider.health(free) is False
        assert "QEMU exited" in caplog.text
        await _until(lambda: free.id not in pool._desktops and len(pool._desktops) == 2
                     and pool.counters["replaced"] == 2, "the replacement of the free desktop")
        assert pool.counters["quarantined"] == 2

        again = await pool.lease("next")
        assert again.desktop_id not in (lease.desktop_id, free.id)
        assert await provider.health(pool._desktops[again.desktop_id])
        await pool.release(again.lease_id)
    finally:
        await pool.stop()
    assert list(state_dir.iterdir()) == []


async def test_a_guest_that_stops_while_qemu_answers_is_replaced(guest, files, state_dir,
                                                                caplog):
    """A hung guest: QEMU and its QMP answer, the guest runs nothing (stopped through QMP, as
    a guest stuck in its kernel looks from outside). Its server is silent: unhealthy, and the
    pool replaces it."""
    cfg = _cfg(guest, files, state_dir, count=1, health_interval_s=1)
    pool = DesktopPool(cfg)
    await pool.start()
    provider = pool.provider
    try:
        (desktop,) = pool._desktops.values()
        machine = provider.machine(desktop.id)
        await machine._execute("stop")  # QMP answers; the guest is frozen
        assert machine.alive()
        with caplog.at_level(logging.WARNING, logger="cua_rollout.envs.providers.vm"):
            assert await provider.health(desktop) is False
        await _until(lambda: desktop.id not in pool._desktops and len(pool._desktops) == 1
                     and pool.counters["replaced"] == 1, "the replacement of the hung desktop")
        lease = await pool.lease("after")
        assert await provider.health(pool._desktops[lease.desktop_id])
        await pool.release(lease.lease_id)
    finally:
        await pool.stop()
    assert list(state_dir.iterdir()) == []


async def test_a_corrupt_ready_state_is_rebuilt_never_restored(guest, files, state_dir, tmp,
                                                               caplog):
    states = tmp / "states"
    first = DesktopPool(_cfg(guest, files, state_dir, states=states))
    await first.start()
    await first.stop()
    (state,) = _states(states)
    manifest = json.loads((state / MANIFEST_FILE).read_text())
    with open(state / RAM_FILE, "r+b") as f:  # between two runs: a disk that filled up
        f.truncate((state / RAM_FILE).stat().st_size // 2)

    second = DesktopPool(_cfg(guest, files, state_dir, states=states))
    with caplog.at_level(logging.WARNING, logger="cua_rollout.envs.providers.vm"):
        await second.start()
    try:
        assert "unusable" in caplog.text and RAM_FILE in caplog.text
        assert second.provider.build_s is not None  # rebuilt by this pool
        (rebuilt,) = _states(states)
        remade = json.loads((rebuilt / MANIFEST_FILE).read_text())
        assert remade["created_unix_s"] > manifest["created_unix_s"]
        assert (rebuilt / RAM_FILE).stat().st_size == remade["files"][RAM_FILE]["size"]
        (desktop,) = second._desktops.values()
        assert await second.provider.health(desktop)
    finally:
        await second.stop()


OWNER_SCRIPT = textwrap.dedent("""
    import asyncio, json, sys
    from cua_rollout.config import DesktopsConfig
    from cua_rollout.envs.providers.vm import VMProvider

    async def main():
        provider = VMProvider(DesktopsConfig(**json.loads(sys.argv[1])))
        desktop = await provider.start(0)
        print(json.dumps({"id": desktop.id, "pid": desktop.info["pid"]}), flush=True)
        await asyncio.sleep(3600)

    asyncio.run(main())
""")


async def test_the_vms_of_a_sigkilled_owner_are_swept_at_the_next_start(guest, files,
                                                                        state_dir):
    cfg = _cfg(guest, files, state_dir)
    owner = subprocess.Popen(
        [sys.executable, "-c", OWNER_SCRIPT, cfg.model_dump_json()], cwd=REPO_ROOT,
        stdout=subprocess.PIPE, env={**os.environ, "PYTHONPATH": str(REPO_ROOT)})
    try:
        assert owner.stdout is not None
        line = await asyncio.wait_for(asyncio.to_thread(owner.stdout.readline), WAIT_S)
        orphan = json.loads(line)
    finally:
        owner.send_signal(signal.SIGKILL)  # dies without stopping its VM
        owner.wait()
        if owner.stdout is not None:
            owner.stdout.close()
    try:
        assert psutil.Process(orphan["pid"]).is_running()  # QEMU outlived its owner
        assert (state_dir / orphan["id"]).exists()

        provider = VMProvider(cfg)
        desktop = await provider.start(0)
        try:
            assert provider.stale_removed == [orphan["id"]]
            assert _gone(orphan["pid"]) and not (state_dir / orphan["id"]).exists()
            assert await provider.health(desktop)
        finally:
            await provider.stop(desktop)
            await provider.close()
    finally:
        if not _gone(orphan["pid"]):  # the sweep failed: not left behind anyway
            os.kill(orphan["pid"], signal.SIGKILL)
        await close_shared_client()
    assert list(state_dir.iterdir()) == []


# --------------------------------------------------------------------------- up front


async def _refused(cfg: DesktopsConfig, match: str) -> None:
    provider = VMProvider(cfg)
    try:
        with pytest.raises(ConfigError, match=match):
            await provider.start(0)
    finally:
        await provider.close()


async def test_what_cannot_work_is_a_config_error_naming_it(guest, files, state_dir, tmp):
    def cfg(**vm: Any) -> DesktopsConfig:
        return _cfg(guest, files, state_dir, vm=vm)

    await _refused(cfg(image=tmp / "missing.qcow2"), "missing.qcow2 does not exist")
    text = tmp / "notes.txt"
    text.write_text("not a disk\n")
    # booting its own bootloader (no kernel given), a raw image must be a bootable disk
    await _refused(cfg(image=text, kernel=None, initrd=None, append=""),
                   "not a bootable disk")
    writable = tmp / "writable.qcow2"
    make_base_disk(writable).chmod(0o644)
    await _refused(cfg(image=writable), "writable")
    await _refused(cfg(memory_mb=10**8), "available")
    await _refused(cfg(initrd=tmp / "no-initrd"), "initrd .* is missing")
    assert list(state_dir.iterdir()) == []  # nothing was started


async def test_kvm_asked_where_it_does_not_work_is_refused_and_auto_warns_once(
        guest, files, state_dir, caplog):
    usable, why = await probe_kvm()
    if usable:
        pytest.skip(f"KVM works on this machine ({why})")
    await _refused(_cfg(guest, files, state_dir, vm={"accel": "kvm"}), "KVM does not work")

    provider = VMProvider(_cfg(guest, files, state_dir, vm={"accel": "auto"}))
    desktops: list[Desktop] = []
    try:
        with caplog.at_level(logging.WARNING, logger="cua_rollout.envs.providers.vm"):
            desktops += [await provider.start(0), await provider.start(1)]
        warnings = [r for r in caplog.records if "TCG" in r.getMessage()]
        assert len(warnings) == 1 and why in warnings[0].getMessage()
        assert all(d.info["accel"] == "tcg" for d in desktops)
    finally:
        for desktop in desktops:
            await provider.stop(desktop)
        await provider.close()
        await close_shared_client()
