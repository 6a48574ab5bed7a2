"""``cua_rollout/vm`` with real QEMU (TCG) and the tiny test guest (``tests/doubles/vm_guest.py``):
a fresh boot, a ready state saved and restored into several VMs on their own ports and
overlays, reset of RAM and disk, a killed QEMU, a corrupt ready state, the sweep of a dead
owner's VMs, the KVM probe. Every test stops its QEMU processes by pid and removes its
directories."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
from collections.abc import AsyncIterator, Iterator
from dataclasses import replace
from pathlib import Path

import httpx
import pytest

from cua_rollout.vm import Machine, MachineSpec, ReadyStateCache, probe_kvm, sweep
from cua_rollout.vm.readystate import DISK_FILE, MANIFEST_FILE, RAM_FILE, ReadyState
from tests.doubles.vm_guest import (
    GUEST_HTTP_PORT,
    READY_LINE,
    TestGuest,
    make_base_disk,
)
from tests.support import REPO_ROOT, small_filesystem, unavailable, vm_test_guest

pytestmark = [pytest.mark.integration, pytest.mark.slow]

BOOT_TIMEOUT_S = 120      # TCG on a busy 2-core machine: the guest takes 5-15 s
HTTP_TIMEOUT_S = 30
MEMORY_MB = 1024


@pytest.fixture(scope="module")
def guest() -> TestGuest:
    return vm_test_guest()


@pytest.fixture(scope="module")
def workdir() -> Iterator[Path]:
    """Short paths: the VMs' QMP sockets live under it."""
    path = Path(tempfile.mkdtemp(prefix="cua-vm-"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="module")
def spec(guest: TestGuest, workdir: Path) -> MachineSpec:
    base = make_base_disk(workdir / "base.qcow2")
    return MachineSpec(image=base, firmware="bios", memory_mb=MEMORY_MB, cpus=1, accel="tcg",
                       kernel=guest.kernel, initrd=guest.initrd, append=guest.cmdline,
                       forwards={GUEST_HTTP_PORT: 0})


def _digest(path: Path) -> tuple[str, int]:
    return hashlib.sha256(path.read_bytes()).hexdigest(), path.stat().st_mtime_ns


async def _get(machine: Machine, path: str) -> httpx.Response:
    """GET on the VM's forwarded port, retried until the guest answers (a deadline, no
    fixed sleep)."""
    url = f"http://127.0.0.1:{machine.ports[GUEST_HTTP_PORT]}{path}"
    deadline = asyncio.get_running_loop().time() + HTTP_TIMEOUT_S
    async with httpx.AsyncClient(timeout=10) as client:
        while True:
            try:
                return await client.get(url)
            except httpx.TransportError:
                if asyncio.get_running_loop().time() > deadline:
                    raise
                await asyncio.sleep(0.1)


async def _boot_and_save(spec: MachineSpec, vm_root: Path, dest: Path) -> None:
    """Boot the guest, write ``saved`` on its disk and save its state into ``dest``."""
    machine = Machine(spec, vm_root)
    try:
        await machine.start_fresh()
        await machine.wait_serial(READY_LINE, BOOT_TIMEOUT_S)
        assert (await _get(machine, "/cgi-bin/disk-write?saved")).status_code == 200
        await machine.save_state(dest)
    finally:
        await machine.stop()


@pytest.fixture(scope="module")
def cache(workdir: Path) -> ReadyStateCache:
    return ReadyStateCache(workdir / "states")


@pytest.fixture(scope="module")
def state(spec: MachineSpec, cache: ReadyStateCache, workdir: Path) -> ReadyState:
    """The module's ready state, built once (its own event loop: machines are loop-bound,
    and this one is stopped before the loop ends)."""
    return asyncio.run(cache.get_or_build(
        spec, lambda dest: _boot_and_save(spec, workdir / "vms", dest)))


@pytest.fixture
async def machines(workdir: Path) -> AsyncIterator[list[Machine]]:
    """Machines a test starts; each stopped afterwards, and its QEMU pid checked gone."""
    started: list[Machine] = []
    try:
        yield started
    finally:
        for machine in started:
            pid = machine.pid
            await machine.stop()
            assert not machine.directory.exists()
            if pid is not None:
                assert not Path(f"/proc/{pid}").exists() or _is_zombie(pid)


def _is_zombie(pid: int) -> bool:
    with contextlib.suppress(OSError):
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    return True


def _new(spec: MachineSpec, workdir: Path, machines: list[Machine]) -> Machine:
    machine = Machine(spec, workdir / "vms")
    machines.append(machine)
    return machine


async def test_a_fresh_vm_serves_on_its_forwarded_port_and_writes_only_its_overlay(
        spec, workdir, machines):
    base_before = _digest(spec.image)
    machine = _new(spec, workdir, machines)
    await machine.start_fresh()
    await machine.wait_serial(READY_LINE, BOOT_TIMEOUT_S)
    assert machine.alive() and machine.pid
    reply = await _get(machine, "/hello")
    assert reply.status_code == 200 and reply.text == "hello from the test guest\n"
    assert (await _get(machine, "/cgi-bin/disk-write?fresh")).text == "wrote fresh\n"
    assert (await _get(machine, "/cgi-bin/disk-read")).text.strip() == "fresh"

    overlay = machine.directory / "overlay.qcow2"
    info = subprocess.run(["qemu-img", "info", "-U", str(overlay)], capture_output=True,
                          text=True, check=True).stdout
    assert f"backing file: {spec.image.resolve()}" in info
    assert _digest(spec.image) == base_before  # the write went to the overlay
    assert not os.access(spec.image, os.W_OK) or spec.image.stat().st_mode & 0o222 == 0


async def test_vms_started_from_one_ready_state_each_serve_on_their_own_port(
        spec, state, workdir, machines):
    base_before = _digest(spec.image)
    first, second = _new(spec, workdir, machines), _new(spec, workdir, machines)
    await asyncio.gather(first.start_from(state), second.start_from(state))
    assert first.ports[GUEST_HTTP_PORT] != second.ports[GUEST_HTTP_PORT]
    assert first.pid != second.pid
    for machine in (first, second):
        assert (await _get(machine, "/hello")).status_code == 200
        # the disk as it was at the save, not the base's
        assert (await _get(machine, "/cgi-bin/disk-read")).text.strip() == "saved"

    # each on its own overlay: a write in one is not seen in the other, nor in the state
    state_disk_before = _digest(state.disk)
    assert (await _get(first, "/cgi-bin/disk-write?first")).status_code == 200
    assert (await _get(first, "/cgi-bin/disk-read")).text.strip() == "first"
    assert (await _get(second, "/cgi-bin/disk-read")).text.strip() == "saved"
    assert _digest(state.disk) == state_disk_before
    assert _digest(spec.image) == base_before


async def test_restore_resets_the_guests_ram_and_disk_on_the_same_port(
        spec, state, workdir, machines):
    machine = _new(spec, workdir, machines)
    await machine.start_from(state)
    port, old_pid = machine.ports[GUEST_HTTP_PORT], machine.pid
    assert (await _get(machine, "/mark")).status_code == 404
    assert (await _get(machine, "/cgi-bin/mark")).status_code == 200
    assert (await _get(machine, "/mark")).text == "dirty\n"               # RAM (tmpfs) changed
    assert (await _get(machine, "/cgi-bin/disk-write?episode")).status_code == 200

    await machine.restore(state)

    assert machine.alive() and machine.pid != old_pid
    assert machine.ports[GUEST_HTTP_PORT] == port
    assert not Path(f"/proc/{old_pid}").exists() or _is_zombie(old_pid)
    assert (await _get(machine, "/mark")).status_code == 404              # RAM as saved
    assert (await _get(machine, "/cgi-bin/disk-read")).text.strip() == "saved"  # disk as saved


async def test_a_killed_qemu_is_seen_dead_and_stop_cleans_up(spec, state, workdir, machines):
    machine = _new(spec, workdir, machines)
    await machine.start_from(state)
    directory, pid = machine.directory, machine.pid
    assert pid is not None and machine.alive()
    os.kill(pid, signal.SIGKILL)
    for _ in range(500):
        if not machine.alive():
            break
        await asyncio.sleep(0.01)
    assert not machine.alive()
    await machine.stop()
    assert not directory.exists()


async def test_a_corrupt_ready_state_is_rebuilt_never_restored(spec, state, workdir, machines):
    cache = ReadyStateCache(workdir / "states-corrupt")
    builds: list[Path] = []

    async def build(dest: Path) -> None:  # a copy of the module's good state
        builds.append(dest)
        for name in (RAM_FILE, DISK_FILE):
            shutil.copyfile(state.directory / name, dest / name)

    good = await cache.get_or_build(spec, build)
    assert len(builds) == 1 and cache.load(spec) == good

    ram = good.ram
    with open(ram, "r+b") as f:
        f.truncate(ram.stat().st_size // 2)
    assert cache.load(spec) is None
    assert "ram" in (cache.last_rejection or "") and not good.directory.exists()

    rebuilt = await cache.get_or_build(spec, build)
    assert len(builds) == 2
    machine = _new(spec, workdir, machines)
    await machine.start_from(rebuilt)
    assert (await _get(machine, "/cgi-bin/disk-read")).text.strip() == "saved"

    # a partial build (no manifest) and a tampered manifest are rejected too
    (rebuilt.directory / MANIFEST_FILE).write_text(
        (rebuilt.directory / MANIFEST_FILE).read_text().replace('"size": ', '"size": 1'))
    assert cache.load(spec) is None and "hash" in (cache.last_rejection or "")
    await cache.get_or_build(spec, build)
    (cache.directory(spec) / MANIFEST_FILE).unlink()
    assert cache.load(spec) is None and "partial" in (cache.last_rejection or "")


OWNER_SCRIPT = textwrap.dedent("""
    import asyncio, json, sys
    from pathlib import Path
    from cua_rollout.vm import Machine, MachineSpec
    from cua_rollout.vm.readystate import ReadyState

    async def main():
        spec = MachineSpec(**json.loads(sys.argv[1]))
        state = ReadyState(Path(sys.argv[3]), json.loads(sys.argv[4]))
        machine = Machine(spec, Path(sys.argv[2]), name="orphan")
        await machine.start_from(state)
        print(machine.pid, flush=True)
        await asyncio.sleep(3600)

    asyncio.run(main())
""")


async def test_sweep_removes_the_vms_of_a_dead_owner_and_leaves_a_live_ones(
        spec, state, workdir, machines):
    root = workdir / "sweep"
    spec_json = {"image": str(spec.image), "firmware": "bios", "memory_mb": spec.memory_mb,
                 "cpus": 1, "accel": "tcg", "kernel": str(spec.kernel),
                 "initrd": str(spec.initrd), "append": spec.append,
                 "forwards": {GUEST_HTTP_PORT: 0}}
    owner = subprocess.Popen(
        [sys.executable, "-c", OWNER_SCRIPT, json.dumps(spec_json), str(root),
         str(state.directory), json.dumps(state.manifest)],
        cwd=REPO_ROOT, stdout=subprocess.PIPE, env={**os.environ, "PYTHONPATH": str(REPO_ROOT)})
    try:
        assert owner.stdout is not None
        orphan_pid = int(await asyncio.wait_for(asyncio.to_thread(owner.stdout.readline), 120))
    finally:
        owner.kill()  # the owner dies without stopping its VM
        owner.wait()
        if owner.stdout is not None:
            owner.stdout.close()
    assert Path(f"/proc/{orphan_pid}").exists()

    mine = Machine(spec, root, name="mine")
    machines.append(mine)
    await mine.start_from(state)

    assert sweep(root) == ["orphan"]
    assert not (root / "orphan").exists()
    assert not Path(f"/proc/{orphan_pid}").exists() or _is_zombie(orphan_pid)
    assert mine.alive() and (root / "mine").exists()
    assert sweep(root) == []


async def test_probe_kvm_answers_with_a_reason():
    if shutil.which("qemu-system-x86_64") is None:
        unavailable("qemu-system-x86_64 is not installed (scripts/setup_env.sh --vm)")
    usable, reason = await probe_kvm(timeout_s=5)
    assert isinstance(usable, bool) and reason
    assert await probe_kvm(timeout_s=5) == (usable, reason)  # cached per process


async def test_a_uefi_vm_boots_saves_and_restores_with_its_own_variables(spec, workdir, machines):
    """OVMF with the code read-only once and a per-VM copy of the variables template; the
    state carries the variables as they were at the save."""
    code = Path("/usr/share/OVMF/OVMF_CODE_4M.fd")
    template = Path("/usr/share/OVMF/OVMF_VARS_4M.fd")
    if not code.exists() or not template.exists():
        unavailable("OVMF is not installed (scripts/setup_env.sh --vm)")
    uefi = replace(spec, firmware="uefi", ovmf_code=code, ovmf_vars=template)
    template_before = _digest(template)
    machine = _new(uefi, workdir, machines)
    await machine.start_fresh()
    cmdline = Path(f"/proc/{machine.pid}/cmdline").read_bytes().decode().split("\0")
    assert sum(str(code) in arg for arg in cmdline) == 1
    assert any(arg.endswith(f"file={machine.directory / 'vars.fd'}") for arg in cmdline)
    await machine.wait_serial(READY_LINE, BOOT_TIMEOUT_S)

    cache = ReadyStateCache(workdir / "states-uefi")
    state = await cache.get_or_build(uefi, machine.save_state)
    assert state.vars is not None and state.vars.exists()
    await machine.restore(state)
    assert (await _get(machine, "/hello")).status_code == 200
    assert _digest(template) == template_before


async def test_a_full_overlay_disk_is_named_and_the_vm_paused(spec, state, workdir, machines):
    """The VM's directory on an 8 MB filesystem; the guest writes 24 MB to its disk: QEMU
    pauses the VM (werror=enospc) and health() says the disk is full."""
    with small_filesystem(workdir / "small", 8 * 2**20) as small:
        machine = Machine(spec, small)
        machines.append(machine)
        await machine.start_from(state)
        assert await machine.health() is None
        url = f"http://127.0.0.1:{machine.ports[GUEST_HTTP_PORT]}/cgi-bin/disk-fill?24"
        async with httpx.AsyncClient(timeout=1) as client:
            with contextlib.suppress(httpx.TimeoutException):  # the paused VM never answers
                await client.get(url)
        for _ in range(600):
            if (problem := await machine.health()) is not None:
                break
            await asyncio.sleep(0.1)
        assert problem is not None and problem.startswith("disk full"), problem
        await machine.stop()
        assert not machine.directory.exists()


async def test_health_names_a_dead_qemu(spec, state, workdir, machines):
    machine = _new(spec, workdir, machines)
    await machine.start_from(state)
    assert await machine.health() is None
    os.kill(machine.pid or 0, signal.SIGKILL)
    for _ in range(500):
        if not machine.alive():
            break
        await asyncio.sleep(0.01)
    assert (await machine.health() or "").startswith("QEMU exited")


async def test_the_launcher_serves_resets_and_stops_one_vm(spec, state, workdir, tmp):
    """``python -m cua_rollout.vm`` (a pod's launcher) with the module's ready state cached:
    a JSON line with the ports, a reset on SIGUSR1, a clean stop on SIGTERM."""
    spec_file = tmp / "spec.json"
    spec_file.write_text(json.dumps({
        "image": str(spec.image), "firmware": "bios", "memory_mb": spec.memory_mb, "cpus": 1,
        "accel": "tcg", "kernel": str(spec.kernel), "initrd": str(spec.initrd),
        "append": spec.append, "forwards": {str(GUEST_HTTP_PORT): 0}}))
    root = workdir / "launched"
    launcher = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "cua_rollout.vm", "--spec", str(spec_file), "--root", str(root),
        "--cache", str(state.directory.parent), cwd=REPO_ROOT, stdout=subprocess.PIPE,
        env={**os.environ, "PYTHONPATH": str(REPO_ROOT)})
    assert launcher.stdout is not None
    try:
        started = json.loads(await asyncio.wait_for(launcher.stdout.readline(), 120))
        port = started["ports"][str(GUEST_HTTP_PORT)]
        async with httpx.AsyncClient(timeout=10) as client:
            url = f"http://127.0.0.1:{port}"
            assert (await client.get(f"{url}/cgi-bin/mark")).status_code == 200
            launcher.send_signal(signal.SIGUSR1)
            reset = json.loads(await asyncio.wait_for(launcher.stdout.readline(), 120))
            assert reset["reset"] and reset["pid"] != started["pid"]
            assert (await client.get(f"{url}/mark")).status_code == 404
        launcher.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(launcher.wait(), 60) == 0
    finally:
        if launcher.returncode is None:
            launcher.kill()
            await launcher.wait()
    assert list(root.iterdir()) == []
    assert not Path(f"/proc/{reset['pid']}").exists() or _is_zombie(reset["pid"])


def test_save_and_restore_work_under_uvloop(spec, state, workdir):
    """Ray runs actors (the desktop pool among them) on uvloop, whose transports hide the
    socket QMP passes state files over: a restore and a save must work there too."""
    import uvloop

    async def round_trip() -> None:
        machine = Machine(spec, workdir / "vms")
        try:
            await machine.start_from(state)
            assert (await _get(machine, "/hello")).status_code == 200
            await machine.save_state(workdir / "uvloop-state")
            assert (workdir / "uvloop-state" / "ram").stat().st_size > 0
        finally:
            await machine.stop()

    uvloop.run(round_trip())
