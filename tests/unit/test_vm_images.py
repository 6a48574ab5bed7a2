"""``cua_rollout/vm/images.py``'s up-front checks, each failing with a ``VMError`` that names
what is wrong; and the KVM probe's boot sector matching its assembly source."""

from __future__ import annotations

import shutil
import subprocess
from dataclasses import replace
from pathlib import Path

import pytest

from cua_rollout.vm import MachineSpec, VMError, check_machine
from cua_rollout.vm.images import (
    check_base_read_only,
    check_firmware,
    check_image,
    check_memory,
    check_qemu,
)
from cua_rollout.vm.kvm import probe_guest
from tests.support import REPO_ROOT, unavailable


@pytest.fixture
def qemu_img() -> None:
    if shutil.which("qemu-img") is None:
        unavailable("qemu-img is not installed (scripts/setup_env.sh --vm)")


def _qcow2(path: Path, read_only: bool = True) -> Path:
    subprocess.run(["qemu-img", "create", "-q", "-f", "qcow2", str(path), "16M"], check=True)
    if read_only:
        path.chmod(0o444)
    return path


def test_a_missing_image_is_named(tmp):
    with pytest.raises(VMError, match=r"does-not-exist\.qcow2 does not exist") as info:
        check_image(tmp / "does-not-exist.qcow2", "qcow2")
    assert info.value.permanent


def test_a_file_that_is_not_a_disk_is_refused(tmp, qemu_img):
    text = tmp / "notes.qcow2"
    text.write_text("not a disk\n" * 100)
    with pytest.raises(VMError, match="is raw, but qcow2 was declared"):
        check_image(text, "qcow2")
    # declared raw, booted by firmware: a raw disk must carry a boot signature
    with pytest.raises(VMError, match="not a bootable disk"):
        check_image(text, "raw")
    check_image(text, "raw", bootable=False)
    with pytest.raises(VMError, match="is not a file"):
        check_image(tmp, "qcow2")


def test_a_qcow2_declared_raw_is_refused(tmp, qemu_img):
    with pytest.raises(VMError, match="is qcow2, but raw was declared"):
        check_image(_qcow2(tmp / "disk.qcow2"), "raw")


def test_a_writable_base_image_is_refused_with_the_fix(tmp, qemu_img):
    base = _qcow2(tmp / "base.qcow2", read_only=False)
    with pytest.raises(VMError, match=r"writable .* chmod a-w"):
        check_base_read_only(base)
    base.chmod(0o444)
    check_base_read_only(base)


def test_a_missing_qemu_binary_is_named():
    with pytest.raises(VMError, match="'qemu-system-nonexistent' not found"):
        check_qemu("qemu-system-nonexistent")


def test_missing_or_doubled_ovmf_files_are_named(tmp):
    spec = MachineSpec(image=tmp / "x.qcow2", ovmf_code=tmp / "CODE.fd", ovmf_vars=tmp / "VARS.fd")
    with pytest.raises(VMError, match=r"OVMF code file .*CODE\.fd is missing"):
        check_firmware(spec)
    (tmp / "CODE.fd").write_bytes(b"\0" * 16)
    with pytest.raises(VMError, match=r"OVMF variables file .*VARS\.fd is missing"):
        check_firmware(spec)
    with pytest.raises(VMError, match="the same file"):
        check_firmware(replace(spec, ovmf_vars=tmp / "CODE.fd"))
    check_firmware(replace(spec, firmware="bios"))


def test_too_little_memory_says_how_many_fit():
    check_memory(8, 1024, available_mb=16_000, overhead_mb=256)
    with pytest.raises(VMError, match=r"8 VMs of 4096 MB .* 10000 MB are available: 2 fit"):
        check_memory(8, 4096, available_mb=10_000, overhead_mb=256)


def test_check_machine_passes_a_good_spec_and_stops_at_the_first_fault(tmp, qemu_img):
    if shutil.which("qemu-system-x86_64") is None:
        unavailable("qemu-system-x86_64 is not installed (scripts/setup_env.sh --vm)")
    kernel = tmp / "vmlinuz"
    kernel.write_bytes(b"\0")
    spec = MachineSpec(image=_qcow2(tmp / "base.qcow2"), firmware="bios", memory_mb=64,
                       kernel=kernel)
    check_machine(spec, count=2)
    with pytest.raises(VMError, match=r"kernel .* is missing"):
        check_machine(replace(spec, kernel=tmp / "nope"))
    with pytest.raises(VMError, match="fit"):
        check_machine(replace(spec, memory_mb=1 << 30))


def test_the_kvm_probes_boot_sector_is_its_assembly_source(tmp):
    """kvm.py carries the assembled bytes of vm/kvm_probe.S; rebuilt here where binutils are."""
    guest = probe_guest()
    assert len(guest) == 512 and guest.endswith(b"\x55\xaa")
    if shutil.which("as") is None or shutil.which("ld") is None:
        pytest.skip("binutils (as, ld) are not installed: the bytes are not re-assembled")
    source = REPO_ROOT / "cua_rollout" / "vm" / "kvm_probe.S"
    subprocess.run(["as", "--64", "-o", str(tmp / "p.o"), str(source)], check=True)
    subprocess.run(["ld", "-Ttext", "0", "--oformat", "binary", "-o", str(tmp / "p.bin"),
                    str(tmp / "p.o")], check=True)
    assert (tmp / "p.bin").read_bytes() == guest
