"""Whether KVM runs guests here: ``probe_kvm`` boots a 512-byte guest under KVM with a deadline
(``/dev/kvm`` answering is not enough: on nested hypervisors without SVM/VMX it opens, creates
VMs, and the guest never makes progress). The result is cached per process; the caller warns
once and falls back to TCG."""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import os
import subprocess
import tempfile
import time
from pathlib import Path

__all__ = ["PROBE_STEPS", "probe_guest", "probe_kvm"]

KVM_DEVICE = Path("/dev/kvm")
KVM_GET_API_VERSION = 0xAE00   # ioctl number (linux/kvm.h)
KVM_API_VERSION = 12
# The probe's guest (cua_rollout/vm/kvm_probe.S, assembled): it prints one letter per step
# of the path a kernel takes, on COM1.
PROBE_STEPS = {
    "R": "ran in real mode",
    "T": "got timer interrupts",
    "P": "entered protected mode",
    "L": "entered long mode",
    "C": "finished a 2^26-iteration loop",
}
PROBE_CODE_HEX = (
    "fa31c08ed88ed0bc007cbaf803b052eefb8b1e6c0483c303f4391e6c0472f9fab054ee660f0116f07c0f20c0"
    "6683c8010f22c066ea3b7c0000080066b810008ed88ec08ed066baf803b050eebf0010000031c0b9000c0000"
    "f3abc7050010000003200000c7050020000003300000c7050030000083000000b8001000000f22d80f20e083"
    "c8200f22e0b9800000c00f320d000100000f300f20c00d000000800f22c0eaa97c0000180066baf803b04cee"
    "b90000000448c7c001000000486bc003ffc975f8b043eeb00aeef4ebfd0f1f000000000000000000ffff0000"
    "009acf00ffff00000092cf00ffff0000009aaf001f00d07c"
)
POLL_S = 0.02

_results: dict[tuple[str, str | None], tuple[bool, str]] = {}


def probe_guest() -> bytes:
    """The probe's boot sector: its code, zero padding, the boot signature."""
    code = bytes.fromhex(PROBE_CODE_HEX)
    return code + bytes(510 - len(code)) + b"\x55\xaa"


async def probe_kvm(timeout_s: float = 10.0, *, qemu_binary: str = "qemu-system-x86_64",
                    cpu_model: str | None = "host") -> tuple[bool, str]:
    """(usable, reason): whether a guest makes progress under KVM, and why not (or what
    was checked). Probed once per process per QEMU binary and CPU model."""
    key = (qemu_binary, cpu_model)
    if key not in _results:
        _results[key] = await _probe(timeout_s, qemu_binary, cpu_model)
    return _results[key]


async def _probe(timeout_s: float, qemu_binary: str, cpu_model: str | None) -> tuple[bool, str]:
    if not KVM_DEVICE.exists():
        return False, f"{KVM_DEVICE} does not exist (no KVM module, or not passed to this host)"
    try:
        fd = os.open(KVM_DEVICE, os.O_RDWR | os.O_CLOEXEC)
    except OSError as exc:
        return False, f"{KVM_DEVICE} is not accessible: {exc.strerror} (group kvm?)"
    try:
        version = fcntl.ioctl(fd, KVM_GET_API_VERSION)
    except OSError as exc:
        return False, f"{KVM_DEVICE} does not answer KVM's ioctls: {exc.strerror}"
    finally:
        os.close(fd)
    if version != KVM_API_VERSION:
        return False, f"{KVM_DEVICE} speaks KVM API {version}, not {KVM_API_VERSION}"

    with tempfile.TemporaryDirectory(prefix="cua-kvm-probe-") as work:
        disk, serial = Path(work) / "probe.img", Path(work) / "serial"
        disk.write_bytes(probe_guest())
        cmd = [qemu_binary, "-accel", "kvm", "-m", "16", "-nodefaults", "-no-user-config",
               "-display", "none", "-no-reboot", "-serial", f"file:{serial}",
               "-drive", f"file={disk},format=raw,if=floppy,readonly=on"]
        if cpu_model:
            cmd += ["-cpu", cpu_model]
        try:
            proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                    stderr=subprocess.PIPE, start_new_session=True)
        except OSError as exc:
            return False, f"QEMU ({qemu_binary}) does not start: {exc}"
        try:
            deadline = time.monotonic() + timeout_s
            while True:
                seen = serial.read_bytes().decode(errors="replace") if serial.exists() else ""
                if "C" in seen:
                    return True, "a guest ran under KVM (" + ", ".join(
                        PROBE_STEPS[s] for s in PROBE_STEPS if s in seen) + ")"
                if proc.poll() is not None:
                    err = (proc.stderr.read() if proc.stderr else b"").decode(errors="replace")
                    last = err.strip().splitlines()[-1] if err.strip() else "no message"
                    return False, (f"QEMU exited ({proc.returncode}) running a guest under KVM: "
                                   f"{last}")
                if time.monotonic() > deadline:
                    steps = [PROBE_STEPS[s] for s in PROBE_STEPS if s in seen]
                    how_far = f"it only {', '.join(steps)}" if steps else "it printed nothing"
                    return False, (f"{KVM_DEVICE} is present but a guest made no progress in "
                                   f"{timeout_s:g} s under KVM ({how_far}; nested "
                                   "virtualization without SVM/VMX?)")
                await asyncio.sleep(POLL_S)
        finally:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            proc.wait()
            if proc.stderr:
                proc.stderr.close()
