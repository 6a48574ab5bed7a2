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
  desktop; the reason is logged and kept in ``info["problem"]``); a restore that fails is a
  ``DesktopError``. ``stop`` removes the VM's process, overlay, sockets and directory.
- **Errors**: the machine layer's ``VMError`` is translated here: a permanent one (a missing
  image or binary, a setting the host cannot meet) is a ``ConfigError``, any other a
  ``DesktopError`` (the pool retries, another desktop takes the episode).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import time
from dataclasses import replace
from pathlib import Path

from cua_rollout.config import DesktopsConfig, secret_from_env
from cua_rollout.core.errors import ConfigError, DesktopError
from cua_rollout.core.http import reachable_host
from cua_rollout.envs.client import RemoteDesktopEnv
from cua_rollout.envs.providers.base import (
    Desktop,
    DesktopProvider,
    bring_up,
    server_answers,
    wait_serving,
)
from cua_rollout.envs.verify import changed_cells, thumbnail
from cua_rollout.vm import (
    Machine,
    MachineSpec,
    ReadyState,
    ReadyStateCache,
    TokenGate,
    VMError,
    check_machine,
    probe_kvm,
    sweep,
)
from cua_rollout.vm.images import check_image
from cua_rollout.vm.readystate import DEFAULT_CACHE_ROOT

__all__ = ["VMProvider"]

log = logging.getLogger(__name__)

_POLL_S = 0.25          # the first boot's screenshots
_SERVING_POLL_S = 0.05  # the server after a restore (it answers within a second or so)
# Screens this many thumbnail cells apart still count as the same (a blinking caret, a clock).
_STILL_CELLS = 1
# A desktop id's length, at most (vm-<pid>-<index>-<hex>): the state_dir's QMP sockets are
# checked up front with a name this long.
_LONGEST_ID = 32
_SERIAL_TAIL_BYTES = 1500


class VMProvider(DesktopProvider):
    """Desktops as QEMU VMs restored from the image's ready state."""

    replaceable = True

    def __init__(self, cfg: DesktopsConfig) -> None:
        self.cfg = cfg
        self.vcfg = cfg.vm
        if self.vcfg.image is None:
            raise ConfigError("desktops.vm.image: no disk image given")
        self.root = Path(self.vcfg.state_dir).expanduser().absolute()
        self.cache = ReadyStateCache(Path(self.vcfg.ready_state_dir).expanduser()
                                     if self.vcfg.ready_state_dir else DEFAULT_CACHE_ROOT)
        # (the config refuses a bind_host other hosts reach without a token)
        self.token = secret_from_env(cfg.token_env, "desktops.token_env")
        self.spec: MachineSpec | None = None
        self.accel_reason: str | None = None
        self.stale_removed: list[str] = []
        self.build_s: float | None = None  # the ready state's build by this provider
        self._prepared: asyncio.Lock | None = None
        self._state_lock: asyncio.Lock | None = None
        self._machines: dict[str, Machine] = {}
        self._gates: dict[str, list[TokenGate]] = {}

    # ----------------------------------------------------------------- up front

    async def _prepare(self) -> MachineSpec:
        """Once per provider (until it succeeds): sweep, checks, accelerator."""
        if self._prepared is None:  # created on the running loop, not in __init__
            self._prepared = asyncio.Lock()
            self._state_lock = asyncio.Lock()
        async with self._prepared:
            if self.spec is None:
                self.spec = await self._check()
            return self.spec

    async def _check(self) -> MachineSpec:
        v = self.vcfg
        assert v.image is not None
        try:
            self.root.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ConfigError(f"desktops.vm.state_dir {self.root}: {exc}") from exc
        self.stale_removed = await asyncio.to_thread(sweep, self.root)
        if self.stale_removed:
            log.warning("removed VMs of runs that are gone: %s", ", ".join(self.stale_removed))
        image = Path(v.image).expanduser().absolute()
        fmt = v.image_format
        if fmt == "auto":
            try:
                info = await asyncio.to_thread(check_image, image, "auto", bootable=False)
            except VMError as exc:
                raise ConfigError(f"desktops.vm.image: {exc}") from exc
            fmt = info["format"]
        spec = MachineSpec(
            image=image, image_format=fmt, firmware=v.firmware, ovmf_code=v.ovmf_code,
            ovmf_vars=v.ovmf_vars, memory_mb=v.memory_mb, cpus=v.cpus,
            screen_width=self.cfg.screen_width, screen_height=self.cfg.screen_height,
            accel="tcg", forwards={v.server_port: 0, v.chromium_port: 0, v.vlc_port: 0},
            kernel=Path(v.kernel).expanduser().absolute() if v.kernel else None,
            initrd=Path(v.initrd).expanduser().absolute() if v.initrd else None,
            append=v.append)
        try:
            await asyncio.to_thread(check_machine, spec, self.cfg.count + self.cfg.warm_spares)
            if spec.initrd is not None and not spec.initrd.is_file():
                raise VMError(f"initrd {spec.initrd} is missing", permanent=True)
            Machine(spec, self.root, name="x" * _LONGEST_ID)  # checks the socket's path
        except VMError as exc:
            raise ConfigError(f"desktops.vm: {exc}") from exc
        return replace(spec, accel=await self._accel())

    async def _accel(self) -> str:
        """``desktops.vm.accel`` resolved: ``auto`` is KVM where a probe guest makes progress
        under it, else TCG with one warning saying why."""
        accel = self.vcfg.accel
        if accel == "tcg":
            return accel
        usable, why = await probe_kvm()
        if usable:
            return "kvm"
        if accel == "kvm":
            raise ConfigError(f"desktops.vm.accel is kvm, but KVM does not work here: {why}")
        self.accel_reason = why
        log.warning("VM desktops run under TCG (emulation, several times slower than KVM): %s",
                    why)
        return "tcg"

    async def _ready_state(self, spec: MachineSpec) -> ReadyState:
        """The image's ready state, checked before every restore: built by a first boot when
        there is none, rebuilt when the one cached is broken (never restored)."""
        assert self._state_lock is not None
        async with self._state_lock:  # one build at a time here (the cache locks across)
            try:
                state = await self.cache.get_or_build(
                    spec, lambda directory: self._build_state(spec, directory))
            except VMError as exc:
                raise _translate(exc, f"the ready state of {spec.image}") from exc
            if self.cache.last_rejection:
                log.warning("%s", self.cache.last_rejection)
                self.cache.last_rejection = None
            return state

    async def _build_state(self, spec: MachineSpec, directory: Path) -> None:
        """Boot the image once, wait until it is ready, save its state into ``directory``."""
        machine = Machine(spec, self.root, name=f"ready-{secrets.token_hex(3)}",
                          start_timeout_s=self.vcfg.start_timeout_s)
        started = time.monotonic()
        log.info("first boot of %s to save its ready state (under %s)", spec.image, spec.accel)
        try:
            await machine.start_fresh()
            await self._wait_still(machine, started + self.vcfg.boot_timeout_s)
            await machine.save_state(directory)
        finally:
            await machine.stop()
        self.build_s = time.monotonic() - started
        log.info("ready state of %s saved in %.1f s", spec.image, self.build_s)

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
                    if still_since is not None and \
                            now - still_since >= self.vcfg.ready_still_s:
                        return
                await asyncio.sleep(_POLL_S)
        finally:
            await env.close()

    # ----------------------------------------------------------------- lifecycle

    async def start(self, index: int) -> Desktop:
        spec = await self._prepare()
        state = await self._ready_state(spec)  # the first start builds it: not start time
        desktop_id = f"vm-{os.getpid()}-{index}-{secrets.token_hex(2)}"
        started = time.monotonic()
        machine = Machine(spec, self.root, name=desktop_id,
                          start_timeout_s=self.vcfg.start_timeout_s)
        self._machines[desktop_id] = machine

        async def serving() -> Desktop:
            try:
                await machine.start_from(state)
            except VMError as exc:
                raise _translate(exc, f"{desktop_id}: restoring the ready state") from exc
            gates = await self._open_gates(desktop_id, machine)
            desktop = Desktop(
                id=desktop_id, url=f"http://{reachable_host(self.vcfg.bind_host)}:"
                                   f"{gates['server']}",
                info={"pid": machine.pid, "accel": spec.accel, "gates": gates,
                      "forwards": {str(k): v for k, v in machine.ports.items()}})
            await self._wait_serving(desktop, machine, started)
            return desktop

        return await bring_up(self, self.cfg, desktop_id, started, serving, baseline=False)

    async def _open_gates(self, desktop_id: str, machine: Machine) -> dict[str, int]:
        """The gates of a VM's ports on ``bind_host``; their ports by what they reach."""
        v = self.vcfg
        gates = self._gates.setdefault(desktop_id, [])
        try:
            # DevTools and VLC clients send no token (OSWorld's getters): unchecked gates,
            # on bind_host only.
            devtools = TokenGate(v.bind_host, 0, "127.0.0.1", machine.ports[v.chromium_port],
                                 None)
            gates.append(devtools)
            vlc = TokenGate(v.bind_host, 0, "127.0.0.1", machine.ports[v.vlc_port], None)
            gates.append(vlc)
            ports = {"chromium": await devtools.start(), "vlc": await vlc.start()}
            server = TokenGate(v.bind_host, 0, "127.0.0.1", machine.ports[v.server_port],
                               self.token, answers={"GET /ports": ports})
            gates.append(server)
            return {"server": await server.start(), **ports}
        except OSError as exc:
            raise DesktopError(f"{desktop_id}: cannot listen on {v.bind_host}: {exc}") from exc

    async def _wait_serving(self, desktop: Desktop, machine: Machine, started: float) -> None:
        """Until the server answers through its gate (token and all); ``DesktopError`` at
        once when the VM dies, or past ``start_timeout_s``."""
        async def late() -> str:
            return (f" ({self.vcfg.start_timeout_s:g} s of the restore); the serial log "
                    f"ends:\n{_tail(machine.serial_log)}")

        await wait_serving(self.cfg, desktop, started + self.vcfg.start_timeout_s,
                           gone=machine.health, late=late, poll_s=_SERVING_POLL_S)

    async def reset(self, desktop: Desktop) -> None:
        """Restore the ready state into a fresh process (same ports, same gates). A VM that
        broke during the episode (QEMU killed, its disk full) is not silently restored: the
        fault is named and the pool quarantines and replaces the desktop."""
        started = time.monotonic()
        machine = self._machines.get(desktop.id)
        if machine is None:
            raise DesktopError(f"{desktop.id}: not a VM of this pool")
        if (problem := await machine.health()) is not None:
            desktop.info["problem"] = problem
            raise DesktopError(f"{desktop.id}: {problem}")
        state = await self._ready_state(machine.spec)
        try:
            await machine.restore(state)
        except VMError as exc:
            raise _translate(exc, f"{desktop.id}: restoring the ready state") from exc
        await self._wait_serving(desktop, machine, started)
        desktop.info["pid"] = machine.pid
        desktop.info.pop("problem", None)
        desktop.info["last_reset"] = {"how": "restore",
                                      "seconds": round(time.monotonic() - started, 3)}

    async def stop(self, desktop: Desktop) -> None:
        try:
            for gate in self._gates.pop(desktop.id, []):
                await gate.close()
        finally:
            machine = self._machines.pop(desktop.id, None)
            if machine is not None:
                await machine.stop()

    async def health(self, desktop: Desktop) -> bool:
        machine = self._machines.get(desktop.id)
        if machine is None:
            return False
        problem = await machine.health()
        if problem is None and not await server_answers(self.cfg, desktop):
            problem = "its server does not answer (QEMU runs)"
        if problem is not None:
            log.warning("VM desktop %s is unhealthy: %s", desktop.id, problem)
            desktop.info["problem"] = problem
            return False
        return True

    async def close(self) -> None:
        """Stop the VMs the pool did not (a start cut short, a pool that never stopped)."""
        await asyncio.gather(*(self.stop(Desktop(id=i, url="")) for i in list(self._machines)),
                             return_exceptions=True)

    def machine(self, desktop_id: str) -> Machine | None:
        """The VM behind a desktop (tests, the operator's tools)."""
        return self._machines.get(desktop_id)


def _translate(exc: VMError, what: str) -> ConfigError | DesktopError:
    """A machine layer's error at this boundary: permanent (nothing retried can fix it) is
    the configuration's, anything else a desktop's."""
    cls = ConfigError if exc.permanent else DesktopError
    return cls(f"{what}: {exc}")


def _tail(path: Path, limit: int = _SERIAL_TAIL_BYTES) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - limit))
            data = f.read()
    except OSError:
        return "(no serial log)"
    return data.decode(errors="replace")
