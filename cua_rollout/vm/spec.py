"""What a virtual machine is made of: ``MachineSpec``, a frozen value that both the machine
(``machine.py``, which turns it into a QEMU command line) and the ready-state cache
(``readystate.py``, which keys saved states by the settings a restore must match) read."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

__all__ = ["DEFAULT_FORWARDS", "MachineSpec"]

# OSWorld's ports inside its VM: its server, Chrome DevTools (forwarded by socat in the VM),
# VLC's HTTP interface. Host port 0: the machine picks a free one.
DEFAULT_FORWARDS: dict[int, int] = {5000: 0, 9222: 0, 8080: 0}


@dataclass(frozen=True)
class MachineSpec:
    """One VM's settings. ``forwards`` maps guest TCP ports to host ports on 127.0.0.1 (0: a
    free port chosen at start). ``kernel``/``initrd``/``append`` boot a kernel directly (the
    tests' tiny guest); an image's own bootloader runs otherwise."""

    image: Path
    image_format: Literal["qcow2", "raw"] = "qcow2"
    firmware: Literal["uefi", "bios"] = "uefi"
    ovmf_code: Path = Path("/usr/share/OVMF/OVMF_CODE_4M.fd")
    ovmf_vars: Path = Path("/usr/share/OVMF/OVMF_VARS_4M.fd")
    memory_mb: int = 4096
    cpus: int = 4
    screen_width: int = 1920
    screen_height: int = 1080
    accel: Literal["kvm", "tcg"] = "tcg"
    # None: "host" under KVM (native speed), QEMU's default model under TCG.
    cpu_model: str | None = None
    forwards: dict[int, int] = field(default_factory=lambda: dict(DEFAULT_FORWARDS))
    kernel: Path | None = None
    initrd: Path | None = None
    append: str = ""
    qemu_binary: str = "qemu-system-x86_64"

    def __hash__(self) -> int:  # forwards is a dict: hash what identifies the machine
        return hash((self.image, self.memory_mb, self.cpus, self.accel))

    def state_settings(self) -> dict[str, object]:
        """The settings a saved state can only be restored under: the same devices, memory,
        firmware, accelerator and CPU model. Host ports are free to differ; guest ports are
        part of the network device's configuration."""
        return {
            "image_format": self.image_format,
            "firmware": self.firmware,
            "ovmf_code": str(self.ovmf_code) if self.firmware == "uefi" else None,
            "memory_mb": self.memory_mb,
            "cpus": self.cpus,
            "screen": [self.screen_width, self.screen_height],
            "accel": self.accel,
            "cpu_model": self.cpu_model,
            "guest_ports": sorted(self.forwards),
            "kernel": str(self.kernel) if self.kernel else None,
            "initrd": str(self.initrd) if self.initrd else None,
            "append": self.append,
        }
