"""The ``vm`` provider: desktops as QEMU virtual machines of a disk image the user names
(``desktops.vm``), through the VM machine layer (``cua_rollout/vm/``).

- **Up front** (the first start): VMs of dead runs are swept from ``desktops.vm.state_dir``;
  QEMU, the image (a disk, not writable by the VMs), OVMF and the memory for the pool's VMs
  are checked, each failure named; the accelerator is chosen (``auto``: KVM when a probe
  guest makes progress under it, else TCG with one warning that says why).
- **The ready state**: the first time an image is used (with these machine settings), one
  VM boots it, the pool waits until the image's server answers and the screen has been
  still for ``ready_still_s``, and its RAM, devices and disk are saved under
  ``ready_state_dir``, keyed by the image's identity. A broken state is rebuilt, never
  restored.
- **Start and reset** restore that state into a fresh QEMU process on a fresh overlay: the
  in-VM server comes back as it was saved, on the VM's own forwarded ports, and nothing of
  the previous episode survives (RAM, disk, devices). The pool's reset check
  (``cua_rollout/envs/verify.py``) runs after every restore, as on every provider.
- **Ports**: the guest's server, DevTools and VLC ports are forwarded to 127.0.0.1 only
  (user-mode networking with ``restrict=on``: the guest reaches nothing else of the host).
  Each is reached through a gate on ``bind_host`` (``cua_rollout/vm/gate.py``); the server's
  gate checks the desktops' bearer token, removes it, and answers ``/ports`` with the
  host-side ports (so clients find each VM's DevTools and VLC): the token never enters the
  guest, whose server (OSWorld's) has no authentication.
- **Faults**: a QEMU that died, a QMP that does not answer, a full overlay disk or a guest
  whose server stops answering make ``health`` false (the pool quarantines and replaces the
  desktop); a restore that fails is a ``DesktopError``. ``stop`` removes the VM's process,
  overlay, sockets and directory.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import time
from pathlib import Path

from cua_rollout.config import DesktopsConfig
from cua_rollout.core.errors import ConfigError, DesktopError
from cua_rollout.core.http import reachable_host
from cua_rollout.envs.client import RemoteDesktopEnv
from cua_rollout.envs.providers.base import Desktop, DesktopProvider, bring_up
from cua_rollout.envs.verify import changed_cells, thumbnail
from cua_rollout.vm import (
    Machine,
    MachineSpec,
    ReadyState,
    ReadyStateCache,
    VMError,
    check_machine,
    probe_kvm,
    sweep,
)
from cua_rollout.vm.gate import TokenGate
from cua_rollout.vm.images import check_image

__all__ = ["VMProvider"]

log = logging.getLogger(__name__)

_POLL_S = 0.25
# Screens this many thumbnail cells apart still count as the same (a blinking caret, a clock).
_STILL_CELLS = 1


class VMProvider(DesktopProvider):
    """Desktops as QEMU VMs restored from the image's ready state."""

    replaceable = True

    def __init__(self, cfg: DesktopsConfig) -> None:
        self.cfg = cfg
        self.vcfg = cfg.vm
        if self.vcfg.image is None:
            raise ConfigError("desktops.vm.image: no disk image given")
        self.root = Path(self.vcfg.state_dir).absolute()
        self.cache = ReadyStateCache(Path(self.vcfg.ready_state_dir).expanduser()
                                     if self.vcfg.ready_state_dir else
                                     ReadyStateCache().root)
        self.token = os.environ.get(cfg.token_env) if cfg.token_env else None
        self.spec: MachineSpec | None = None
        self.state: ReadyState | None = None
        self.accel_reason: str | None = None
        self.stale_removed: list[str] = []
        self._prepared: asyncio.Lock | None = None
        self._machines: dict[str, Machine] = {}
        self._gates: dict[str, list[TokenGate]] = {}

    # ----------------------------------------------------------------- up front

    async def _prepare(self) -> tuple[MachineSpec, ReadyState]:
        """Once per provider: sweep, checks, accelerator, the ready state."""
        if self._prepared is None:
            self._prepared = asyncio.Lock()
        async with self._prepared:
            if self.spec is not None and self.state is not None:
                return self.spec, self.state
            self.root.mkdir(parents=True, exist_ok=True)
            self.stale_removed = await asyncio.to_thread(sweep, self.root)
            if self.stale_removed:
                log.warning("removed VMs of runs that are gone: %s",
                            ", ".join(self.stale_removed))
            spec = await self._spec()
            try:
                await asyncio.to_thread(check_machine, spec, self.cfg.count
                                        + self.cfg.warm_spares)
            except VMError as exc:
                raise ConfigError(f"desktops.vm: {exc}") from exc
            try:
                state = await self.cache.get_or_build(
                    spec, lambda directory: self._build_state(spec, directory))
            except VMError as exc:
                raise DesktopError(f"the ready state of {spec.image}: {exc}") from exc
            if self.cache.last_rejection:
                log.warning("%s", self.cache.last_rejection)
            self.spec, self.state = spec, state
            return spec, state

    async def _spec(self) -> MachineSpec:
        v = self.vcfg
        assert v.image is not None
        image = Path(v.image).expanduser().absolute()
        fmt = v.image_format
        if fmt == "auto":
            try:
                info = await asyncio.to_thread(check_image, image, "auto", bootable=False)
            except VMError as exc:
                raise ConfigError(f"desktops.vm.image: {exc}") from exc
            fmt = info.get("format", "qcow2")
        accel = v.accel
        if accel == "auto":
            usable, why = await probe_kvm()
            accel = "kvm" if usable else "tcg"
            if not usable:
                self.accel_reason = why
                log.warning("VM desktops run under TCG (emulation, several times slower than "
                            "KVM): %s", why)
        elif accel == "kvm":
            usable, why = await probe_kvm()
            if not usable:
                raise ConfigError(f"desktops.vm.accel is kvm, but KVM does not work here: {why}")
        return MachineSpec(
            image=image, image_format=fmt, firmware=v.firmware, ovmf_code=v.ovmf_code,
            ovmf_vars=v.ovmf_vars, memory_mb=v.memory_mb, cpus=v.cpus,
            screen_width=self.cfg.screen_width, screen_height=self.cfg.screen_height,
            accel=accel, forwards={v.server_port: 0, v.chromium_port: 0, v.vlc_port: 0})

    async def _build_state(self, spec: MachineSpec, directory: Path) -> None:
        """Boot the image once, wait until it is ready, save its state into ``directory``."""
        machine = Machine(spec, self.root, name=f"ready-{secrets.token_hex(3)}")
        started = time.monotonic()
        log.info("first boot of %s to save its ready state (under %s)", spec.image, spec.accel)
        try:
            await machine.start_fresh()
            await self._wait_still(machine, time.monotonic() + self.vcfg.boot_timeout_s)
            await machine.save_state(directory)
        finally:
            await machine.stop()
        log.info("ready state of %s saved in %.0f s", spec.image, time.monotonic() - started)

    async def _wait_still(self, machine: Machine, deadline: float) -> None:
        """Until the guest's server answers and its screen has been still for
        ``ready_still_s`` (an 8x8 thumbnail within one cell); ``VMError`` past ``deadline``."""
        url = f"http://127.0.0.1:{machine.ports[self.vcfg.server_port]}"
        # Straight to the guest, which has no token: the token never goes in.
        env = RemoteDesktopEnv(url, self.cfg.model_copy(update={"token_env": None}),
                               name=machine.name)
        still_since: float | None = None
        previous: bytes | None = None
        try:
            while True:
                if time.monotonic() > deadline:
                    raise VMError(f"{machine.name}: the image's server did not answer with a "
                                  f"still screen within {self.vcfg.boot_timeout_s:g} s; the "
                                  f"serial log ends:\n{_tail(machine.serial_log)}")
                if (problem := await machine.health()) is not None:
                    raise VMError(f"{machine.name}: {problem}")
                shot = None
                with contextlib.suppress(DesktopError):
                    shot = await env.observe()
                if shot is None:
                    still_since = previous = None
                else:
                    cells = thumbnail(shot.png)
                    now = time.monotonic()
                    if previous is None or changed_cells(previous, cells) > _STILL_CELLS:
                        still_since = now
                    previous = cells
                    if still_since is not None and now - still_since >= self.vcfg.ready_still_s:
                        return
                await asyncio.sleep(_POLL_S)
        finally:
            await env.close()

    # ----------------------------------------------------------------- lifecycle

    async def start(self, index: int) -> Desktop:
        spec, state = await self._prepare()
        desktop_id = f"vm-{os.getpid()}-{index}-{secrets.token_hex(2)}"
        started = time.monotonic()
        machine = Machine(spec, self.root, name=desktop_id,
                          start_timeout_s=self.vcfg.start_timeout_s)
        self._machines[desktop_id] = machine

        async def serving() -> Desktop:
            try:
                await machine.start_from(state)
            except VMError as exc:
                raise DesktopError(f"{desktop_id}: restoring the ready state failed: "
                                   f"{exc}") from exc
            url = await self._open_gates(desktop_id, machine)
            desktop = Desktop(id=desktop_id, url=url,
                              info={"pid": machine.pid, "accel": spec.accel,
                                    "ports": {str(k): v for k, v in machine.ports.items()}})
            await self._wait_serving(desktop, machine, started)
            return desktop

        return await bring_up(self, self.cfg, desktop_id, started, serving, baseline=False)

    async def _open_gates(self, desktop_id: str, machine: Machine) -> str:
        """The gates of a VM's ports on ``bind_host``; the server's URL."""
        v = self.vcfg
        gates = self._gates.setdefault(desktop_id, [])
        if not gates:
            devtools = TokenGate(v.bind_host, 0, "127.0.0.1", machine.ports[v.chromium_port],
                                 None)
            vlc = TokenGate(v.bind_host, 0, "127.0.0.1", machine.ports[v.vlc_port], None)
            ports = {"chromium": await devtools.start(), "vlc": await vlc.start()}
            server = TokenGate(v.bind_host, 0, "127.0.0.1", machine.ports[v.server_port],
                               self.token, answers={"GET /ports": ports})
            await server.start()
            gates += [server, devtools, vlc]
        return f"http://{reachable_host(v.bind_host)}:{gates[0].port}"

    async def _wait_serving(self, desktop: Desktop, machine: Machine, started: float) -> None:
        env = RemoteDesktopEnv(desktop.url, self.cfg, name=desktop.id)
        deadline = started + self.vcfg.start_timeout_s
        try:
            while not await env.health():
                if (problem := await machine.health()) is not None:
                    raise DesktopError(f"{desktop.id}: {problem}")
                if time.monotonic() > deadline:
                    raise DesktopError(f"{desktop.id}: its server did not answer within "
                                       f"{self.vcfg.start_timeout_s:g} s of the restore")
                await asyncio.sleep(0.05)
        finally:
            await env.close()

    async def reset(self, desktop: Desktop) -> None:
        """Restore the ready state into a fresh process (same ports, same gates)."""
        started = time.monotonic()
        machine = self._machines.get(desktop.id)
        if machine is None or self.state is None:
            raise DesktopError(f"{desktop.id}: not a VM of this pool")
        try:
            await machine.restore(self.state)
        except VMError as exc:
            raise DesktopError(f"{desktop.id}: restoring the ready state failed: {exc}") from exc
        await self._wait_serving(desktop, machine, started)
        desktop.info["pid"] = machine.pid
        desktop.info["last_reset"] = {"how": "restore", "seconds": time.monotonic() - started}

    async def stop(self, desktop: Desktop) -> None:
        for gate in self._gates.pop(desktop.id, []):
            with contextlib.suppress(Exception):
                await gate.close()
        machine = self._machines.pop(desktop.id, None)
        if machine is not None:
            await machine.stop()

    async def health(self, desktop: Desktop) -> bool:
        machine = self._machines.get(desktop.id)
        if machine is None or await machine.health() is not None:
            return False
        env = RemoteDesktopEnv(desktop.url, self.cfg, name=desktop.id)
        try:
            return await env.health()
        finally:
            await env.close()

    async def close(self) -> None:
        for desktop_id in list(self._machines):
            await self.stop(Desktop(id=desktop_id, url=""))

    def machine(self, desktop_id: str) -> Machine | None:
        """The VM behind a desktop (tests, the operator's tools)."""
        return self._machines.get(desktop_id)


def _tail(path: Path, limit: int = 1500) -> str:
    try:
        data = path.read_bytes()[-limit:]
    except OSError:
        return "(no serial log)"
    return data.decode(errors="replace")

