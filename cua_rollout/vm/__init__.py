"""The VM machine layer: QEMU virtual machines started, saved, restored and stopped.

Standalone: it imports nothing else of ``cua_rollout`` (the standard library and
``qemu.qmp`` only; an import-linter contract), so it can run alone as a launcher inside a
Kubernetes pod. The desktop provider builds on it and translates its ``VMError``.

    spec.py        MachineSpec: what a VM is made of
    machine.py     Machine: one QEMU process (start, save_state, restore, stop); sweep()
    readystate.py  ReadyStateCache: saved states keyed by the image and machine settings
    images.py      up-front checks (QEMU, image, firmware, memory)
    kvm.py         probe_kvm(): whether guests make progress under KVM here
    gate.py        TokenGate: a VM port's host side, checking the desktops' bearer token
    launcher.py    one VM behind its gates, what a Kubernetes pod runs (python -m cua_rollout.vm)
    errors.py      VMError
"""

from cua_rollout.vm.errors import VMError
from cua_rollout.vm.gate import TokenGate
from cua_rollout.vm.images import check_machine
from cua_rollout.vm.kvm import probe_kvm
from cua_rollout.vm.machine import Machine, sweep
from cua_rollout.vm.readystate import ReadyState, ReadyStateCache
from cua_rollout.vm.spec import MachineSpec

__all__ = ["Machine", "MachineSpec", "ReadyState", "ReadyStateCache", "TokenGate", "VMError",
           "check_machine", "probe_kvm", "sweep"]
