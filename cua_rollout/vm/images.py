"""Up-front checks of what VMs need, each failing with a ``VMError`` that names what is wrong:
the QEMU binary and qemu-img, the base image (there, a disk, the declared format, not
writable), the UEFI firmware files, and the host memory for the VMs asked for."""

from __future__ import annotations

import functools
import json
import os
import shutil
import stat
import subprocess
from pathlib import Path

from cua_rollout.vm.errors import VMError
from cua_rollout.vm.spec import MachineSpec

__all__ = ["QEMU_OVERHEAD_MB", "available_memory_mb", "check_base_read_only", "check_firmware",
           "check_image", "check_machine", "check_memory", "check_qemu", "qemu_version"]

# QEMU's own memory per VM on top of the guest's RAM (devices, TCG's translation cache, the
# VGA's video memory), rounded up from what benchmarks/bench_vm.py measures.
QEMU_OVERHEAD_MB = 256
TOOL_TIMEOUT_S = 60
MBR_SIGNATURE = b"\x55\xaa"    # at offset 510 of a bootable raw disk (MBR or GPT's protective MBR)


def check_qemu(binary: str = "qemu-system-x86_64") -> str:
    """The QEMU binary's path, and qemu-img present."""
    path = shutil.which(binary)
    if path is None:
        raise VMError(f"QEMU binary {binary!r} not found: apt-get install qemu-system-x86 "
                      "(scripts/setup_env.sh --vm)", permanent=True)
    if shutil.which("qemu-img") is None:
        raise VMError("qemu-img not found: apt-get install qemu-utils "
                      "(scripts/setup_env.sh --vm)", permanent=True)
    return path


@functools.cache
def qemu_version(binary: str = "qemu-system-x86_64") -> str:
    """``QEMU emulator version 7.2.22 (...)``: a saved state restores only into the QEMU that
    saved it."""
    try:
        done = subprocess.run([binary, "--version"], capture_output=True, text=True,
                              timeout=TOOL_TIMEOUT_S, check=True)
    except (OSError, subprocess.SubprocessError) as exc:
        raise VMError(f"QEMU binary {binary!r} does not run: {exc}", permanent=True) from exc
    return done.stdout.splitlines()[0].strip() if done.stdout else "unknown"


def check_image(path: Path, image_format: str, *, bootable: bool = True) -> dict:
    """``qemu-img info`` of the image, after checking that it exists, is a disk of a format
    QEMU runs (qcow2 or raw) and is the format declared (``auto``: either). ``bootable``: a
    raw image must carry a boot signature (firmware boots it; a kernel booted directly needs
    none)."""
    path = Path(path)
    if not path.exists():
        raise VMError(f"VM image {path} does not exist", permanent=True)
    if not path.is_file():
        raise VMError(f"VM image {path} is not a file", permanent=True)
    try:
        done = subprocess.run(["qemu-img", "info", "--output=json", "-U", str(path)],
                              capture_output=True, text=True, timeout=TOOL_TIMEOUT_S, check=False)
    except FileNotFoundError as exc:
        raise VMError("qemu-img not found: apt-get install qemu-utils", permanent=True) from exc
    if done.returncode != 0:
        raise VMError(f"VM image {path} is not a disk image qemu-img can read: "
                      f"{done.stderr.strip()}", permanent=True)
    info = json.loads(done.stdout)
    found = info.get("format")
    if found not in {"qcow2", "raw"}:
        raise VMError(f"VM image {path} is {found}, not qcow2 or raw", permanent=True)
    if image_format != "auto" and found != image_format:
        raise VMError(f"VM image {path} is {found}, but {image_format} was declared",
                      permanent=True)
    if found == "raw" and bootable:
        with open(path, "rb") as f:
            f.seek(510)
            if f.read(2) != MBR_SIGNATURE:
                raise VMError(f"VM image {path} is not a bootable disk (no boot signature at "
                              "byte 510: not an MBR or GPT disk)", permanent=True)
    return info


def check_base_read_only(path: Path) -> None:
    """Refuse a base image anyone may write. Every VM's overlay and every ready state is a
    difference against the base as it is now: a single write to it (someone booting it
    directly, a tool opening it read-write) silently corrupts all of them. QEMU itself opens
    it read-only (as a backing file); the mode guards against everything else, root included,
    since tools check the mode before they write. Fix: ``chmod a-w``."""
    mode = Path(path).stat().st_mode
    if mode & (stat.S_IWUSR | stat.S_IWGRP | stat.S_IWOTH):
        raise VMError(f"VM base image {path} is writable (mode {stat.filemode(mode)}): every "
                      f"overlay and ready state depends on it as it is; make it read-only "
                      f"with: chmod a-w {path}", permanent=True)


def check_firmware(spec: MachineSpec) -> None:
    """Under UEFI: OVMF's code and a variables template, distinct files (passing the code
    file twice is a known cause of VMs hanging at the bootloader)."""
    if spec.firmware != "uefi":
        return
    for what, path in (("code", spec.ovmf_code), ("variables", spec.ovmf_vars)):
        if not Path(path).is_file():
            raise VMError(f"OVMF {what} file {path} is missing: apt-get install ovmf",
                          permanent=True)
    if Path(spec.ovmf_code).resolve() == Path(spec.ovmf_vars).resolve():
        raise VMError(f"OVMF code and variables are the same file ({spec.ovmf_code}): the "
                      "variables must be a separate template (OVMF_VARS*.fd)", permanent=True)


def available_memory_mb() -> int:
    """MemAvailable of /proc/meminfo: what can be given to new processes without swapping."""
    for line in Path("/proc/meminfo").read_text(encoding="utf-8").splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) // 1024
    raise VMError("/proc/meminfo has no MemAvailable")


def check_memory(count: int, memory_mb: int, *, available_mb: int | None = None,
                 overhead_mb: int = QEMU_OVERHEAD_MB) -> None:
    """Room for ``count`` VMs of ``memory_mb`` each (plus QEMU's own overhead) in the memory
    available now. Counted in full: a guest's RAM fills up as it runs."""
    available_mb = available_memory_mb() if available_mb is None else available_mb
    needed_mb = count * (memory_mb + overhead_mb)
    if needed_mb > available_mb:
        fit = available_mb // (memory_mb + overhead_mb)
        raise VMError(f"{count} VMs of {memory_mb} MB need about {needed_mb} MB "
                      f"({overhead_mb} MB of QEMU's own each), but {available_mb} MB are "
                      f"available: {fit} fit", permanent=True)


def check_machine(spec: MachineSpec, count: int = 1) -> None:
    """Every check that applies to ``count`` VMs of ``spec``, in the order a user fixes them."""
    check_qemu(spec.qemu_binary)
    check_image(spec.image, spec.image_format, bootable=spec.kernel is None)
    check_base_read_only(spec.image)
    check_firmware(spec)
    if spec.kernel is not None and not os.path.isfile(spec.kernel):
        raise VMError(f"kernel {spec.kernel} is missing", permanent=True)
    check_memory(count, spec.memory_mb)
