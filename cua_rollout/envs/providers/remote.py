"""The ``remote`` provider: desktops leased from an environment cluster instead of started
by the run (``desktops.remote``, ``docs/remote_desktops.md``). Each pool desktop is one
remote desktop: a lease of our desktop service (``kind: cua``,
``cua_rollout/envs/service_client.py``) or an emulator of a GUI-Docker-Env manager
(``kind: gui-docker-env``, ``cua_rollout/envs/gui_docker_env.py``)."""

from __future__ import annotations

import abc
import asyncio
import contextlib
import hashlib
import json
import logging
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from cua_rollout.config import DesktopsConfig
from cua_rollout.core.aio import TaskSet
from cua_rollout.core.errors import DesktopError
from cua_rollout.core.files import read_json, write_atomic
from cua_rollout.core.http import redact_url
from cua_rollout.envs.contract import DesktopAccess
from cua_rollout.envs.gui_docker_env import Emulator, GuiDockerEnvClient
from cua_rollout.envs.providers.base import (
    Desktop,
    DesktopProvider,
    run_is_gone,
    run_label,
    server_answers,
    wait_serving,
)
from cua_rollout.envs.service_client import (
    DesktopServiceClient,
    KeepAlive,
    LeaseGone,
    ServiceError,
    ServiceRefused,
)

__all__ = ["RemoteProvider"]

log = logging.getLogger(__name__)


@dataclass
class _Held:
    """One remote desktop this provider holds, and what gives it back."""

    remote_id: str                     # the service's env id, the manager's emulator id
    url: str
    access: DesktopAccess
    info: dict[str, Any]
    emulator: Emulator | None = None   # gui-docker-env
    service: DesktopServiceClient | None = None  # cua: the service that lent it ...
    beats: KeepAlive | None = None     # ... its heartbeats
    stack: contextlib.AsyncExitStack = field(default_factory=contextlib.AsyncExitStack)


class _Backend(abc.ABC):
    """One kind of environment cluster: take a desktop, give it back, say if it lives."""

    @abc.abstractmethod
    async def take(self, label: str) -> _Held: ...

    @abc.abstractmethod
    async def give_back(self, held: _Held) -> None:
        """Raise only when the desktop may go on running (a leak to report)."""

    @abc.abstractmethod
    async def alive(self, held: _Held) -> bool | None:
        """False: the cluster says it is gone; None: it cannot say now."""

    async def close(self) -> None:
        return None


class _Service(_Backend):
    """Leases of our desktop service: a clean desktop (no task: the episode runs its setup
    over the desktop's URL), heartbeated in the background at the interval the lease reply
    gives; a lease the service no longer knows (expired, lost in a restart) is dead."""

    def __init__(self, cfg: DesktopsConfig, urls: list[str], token: str) -> None:
        self.r = cfg.remote
        self._urls, self._token = urls, token
        self._clients: dict[str, DesktopServiceClient] = {}
        self._turn = 0

    def _client(self, url: str) -> DesktopServiceClient:
        if url not in self._clients:  # on the loop that uses it
            self._clients[url] = DesktopServiceClient(url, self._token,
                                                      timeout_s=self.r.start_timeout_s)
        return self._clients[url]

    async def take(self, label: str) -> _Held:
        self._turn += 1
        order = self._urls[self._turn % len(self._urls):] + self._urls[
            :self._turn % len(self._urls)]
        errors: list[ServiceError] = []
        for url in order:
            client = self._client(url)
            try:
                reply = await client.lease(None, wait_s=self.r.wait_s, access=self.r.access,
                                           observe=(), label=label)
            except ServiceRefused:
                raise  # the token or address: no other service is asked in vain
            except ServiceError as exc:
                errors.append(exc)
                continue
            desktop_url, token = reply.desktop_url, reply.desktop_token
            if reply.access == "relay":  # through the service, with the tenant's token
                desktop_url = (url + desktop_url if desktop_url.startswith("/")
                               else desktop_url)
                token = token or self._token
            held = _Held(reply.env_id, desktop_url.rstrip("/"), DesktopAccess(token=token),
                         {"service": redact_url(url), "env_id": reply.env_id,
                          "remote_desktop": reply.desktop_id, "access": reply.access},
                         service=client)
            held.beats = await held.stack.enter_async_context(
                client.keep_alive(reply.env_id, reply.heartbeat_s))
            return held
        # Every service refused for now (quota, no desktop, unreachable): the last says why.
        raise errors[-1]

    async def give_back(self, held: _Held) -> None:
        await held.stack.aclose()  # the heartbeats end first
        assert held.service is not None
        try:
            await held.service.release(held.remote_id)
        except LeaseGone:
            pass  # expired or lost already: nothing is held
        except ServiceError as exc:  # the service reclaims it when its heartbeats stop
            log.warning("releasing %s: %s (it expires at the service)", held.remote_id, exc)

    async def alive(self, held: _Held) -> bool | None:
        return not (held.beats is not None and isinstance(held.beats.error, LeaseGone))

    async def close(self) -> None:
        for client in self._clients.values():
            await client.close()


class _Ledger:
    """The emulators the runs of this machine hold: a JSON file each in
    ``desktops.remote.state_dir``, written when a manager grants one and removed once it is
    stopped. A run killed with SIGKILL leaves its records; the next run's start finds those
    whose run is gone (``run_is_gone``: a process of this host that no longer runs) and
    stops their emulators, which their managers would never expire."""

    def __init__(self, directory: Path, run: str) -> None:
        self.dir = directory
        self.run = run

    def _path(self, emu: Emulator) -> Path:
        key = hashlib.sha256(f"{emu.manager} {emu.emulator_id}".encode()).hexdigest()[:20]
        return self.dir / f"{key}.json"

    def record(self, emu: Emulator) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        write_atomic(self._path(emu), json.dumps({"run": self.run, **asdict(emu)}).encode(),
                     mode=0o600)

    def forget(self, emu: Emulator) -> None:
        self._path(emu).unlink(missing_ok=True)

    def stale(self) -> list[Emulator]:
        """Emulators recorded by runs that are gone. A record that cannot be read is named
        in the log and left alone (it is never taken for a run's)."""
        found: list[Emulator] = []
        for path in sorted(self.dir.glob("*.json")) if self.dir.is_dir() else []:
            body = read_json(path)
            try:
                run = body.pop("run")
                emu = Emulator(**body)
            except (AttributeError, KeyError, TypeError):
                log.warning("%s is not an emulator record; left alone", path)
                continue
            if run_is_gone(run):
                found.append(emu)
        return found


class _Managers(_Backend):
    """Emulators of GUI-Docker-Env managers: started under the token's quota, stopped by
    us. Their managers never expire an emulator, so each one we hold is recorded
    (``_Ledger``) until it is stopped, and the first start stops those of dead runs."""

    def __init__(self, cfg: DesktopsConfig, urls: list[str], token: str, run: str) -> None:
        self.r = cfg.remote
        self.client = GuiDockerEnvClient(urls, token, timeout_s=self.r.request_timeout_s,
                                         start_timeout_s=self.r.start_timeout_s)
        self.ledger = _Ledger(self.r.state_dir, run)
        self._swept: asyncio.Future[list[str]] | None = None
        self.stale_stopped: list[str] = []

    async def sweep(self) -> list[str]:
        """Stop the emulators of runs that are gone (each once per provider; every start
        waits for it, so what it frees counts for this run's quota). The ids stopped; one
        that cannot be stopped now keeps its record for the next run."""
        if self._swept is None:
            self._swept = asyncio.ensure_future(self._sweep())
        return await asyncio.shield(self._swept)

    async def _sweep(self) -> list[str]:
        stopped: list[str] = []
        for emu in self.ledger.stale():
            try:
                await self.client.stop(emu)
            except DesktopError as exc:
                log.warning("an emulator of a run that is gone could not be stopped (its "
                            "record stays for the next run): %s", exc)
                continue
            self.ledger.forget(emu)
            stopped.append(emu.emulator_id)
        if stopped:
            log.warning("stopped %d emulator(s) of runs that are gone: %s", len(stopped),
                        ", ".join(stopped))
        self.stale_stopped = stopped
        return stopped

    async def take(self, label: str) -> _Held:
        await self.sweep()
        emu = await self.client.start(wait_s=self.r.wait_s)
        try:
            self.ledger.record(emu)
        except OSError as exc:  # unrecorded, a kill -9 would leak it: not kept
            await self.client.stop(emu)
            raise DesktopError(f"desktops.remote.state_dir {self.ledger.dir}: cannot record "
                               f"emulator {emu.emulator_id} ({exc}); it was stopped") from exc
        return _Held(emu.emulator_id, emu.desktop_url,
                     DesktopAccess(chromium_port=emu.chromium_port, vlc_port=emu.vlc_port),
                     {"manager": redact_url(emu.manager), "emulator_id": emu.emulator_id,
                      "server_port": emu.server_port, "chromium_port": emu.chromium_port,
                      "vlc_port": emu.vlc_port, "vnc_port": emu.vnc_port},
                     emulator=emu)

    async def give_back(self, held: _Held) -> None:
        assert held.emulator is not None
        await self.client.stop(held.emulator)
        self.ledger.forget(held.emulator)

    async def alive(self, held: _Held) -> bool | None:
        assert held.emulator is not None
        return await self.client.running(held.emulator)

    async def close(self) -> None:
        if self._swept is not None and not self._swept.done():
            self._swept.cancel()
        await self.client.close()


class RemoteProvider(DesktopProvider):
    """Desktops leased from an environment cluster. ``start`` takes a remote desktop and
    waits until its server answers; ``reset`` gives it back and takes another (the service
    resets and verifies what it is given back before lending it again; a GUI-Docker-Env
    emulator is stopped and a new one started, as their own client resets); ``stop`` gives
    it back; ``health``: the cluster still holds it for us and its server answers.

    ``verify_resets`` is false: a reset here never returns the same desktop, so there is no
    first state of ours to compare with (the service checks its own resets; a new emulator
    is new). A refusal (quota full, no desktop) past ``desktops.remote.wait_s`` fails the
    start, and the pool's refill asks again with backoff; a lease lost or an emulator gone
    makes the desktop unhealthy, and the pool replaces it.

    Every exit path we control gives back what was taken: a start whose desktop never
    answers, a reset cancelled by the pool's deadline (what it brings later is given back),
    ``stop`` and ``close``; a give-back that failed is tried again at ``close``."""

    replaceable = True
    verify_resets = False

    def __init__(self, cfg: DesktopsConfig) -> None:
        self.cfg = cfg
        urls, token = cfg.remote.server_urls(), cfg.remote.token()
        self._label = run_label()
        self.backend: _Backend = (_Service(cfg, urls, token) if cfg.remote.kind == "cua"
                                  else _Managers(cfg, urls, token, self._label))
        self._held: dict[str, _Held] = {}
        self._unreturned: list[_Held] = []   # give-backs that failed: tried again at close
        self._late = TaskSet()               # takes whose caller stopped waiting

    async def start(self, index: int) -> Desktop:
        desktop_id = f"remote-{index}"
        held = await self._take(desktop_id)
        self._held[desktop_id] = held
        return Desktop(id=desktop_id, url=held.url, info=dict(held.info), access=held.access)

    async def reset(self, desktop: Desktop) -> None:
        started = time.monotonic()
        old = self._held.pop(desktop.id, None)
        if old is not None:
            await self._give_back(old)
        held = await self._take(desktop.id)
        self._held[desktop.id] = held
        desktop.url, desktop.access = held.url, held.access
        desktop.info = {**held.info, "last_reset": {"seconds": time.monotonic() - started}}

    async def stop(self, desktop: Desktop) -> None:
        held = self._held.pop(desktop.id, None)
        if held is not None:
            await self._give_back(held)

    async def health(self, desktop: Desktop) -> bool:
        held = self._held.get(desktop.id)
        if held is None or await self.backend.alive(held) is False:
            return False
        return await server_answers(self.cfg, desktop)

    async def close(self) -> None:
        # Takes whose caller stopped waiting, then the give-backs of what they brought.
        deadline = time.monotonic() + self.cfg.remote.start_timeout_s
        while self._late:
            late = await self._late.wait(max(0.0, deadline - time.monotonic()))
            if late:  # past the deadline: what they bring may stay (logged)
                log.error("%d remote desktop(s) still being started at close; a desktop "
                          "they bring may be left running", len(late))
                await self._late.cancel_all()
        retry, self._unreturned = self._unreturned, []
        for held in retry:
            await self._give_back(held)
        await self.backend.close()
        if self._unreturned:
            raise DesktopError("could not give back " + ", ".join(
                f"{h.remote_id} ({h.info})" for h in self._unreturned))

    # ----------------------------------------------------------------- internals

    async def _take(self, desktop_id: str) -> _Held:
        """A remote desktop whose server answers. Run as a task of its own, so that when
        the caller stops waiting (the pool's reset deadline, a cancelled start) the desktop
        it brings later is given back rather than left running."""
        task = asyncio.ensure_future(self._take_serving(desktop_id))
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            self._late.add(task)
            task.add_done_callback(self._return_late)
            raise

    def _return_late(self, task: asyncio.Future[_Held]) -> None:
        if task.cancelled() or task.exception() is not None:
            return
        self._late.spawn(self._give_back(task.result()))

    async def _take_serving(self, desktop_id: str) -> _Held:
        started = time.monotonic()
        held = await self.backend.take(f"{self._label} {desktop_id}")
        try:
            await wait_serving(self.cfg, Desktop(desktop_id, held.url, access=held.access),
                               started + self.cfg.remote.start_timeout_s)
        except BaseException:
            await self._give_back(held)
            raise
        held.info["start_s"] = round(time.monotonic() - started, 3)
        return held

    async def _give_back(self, old: _Held) -> None:
        try:
            await self.backend.give_back(old)
        except Exception as exc:  # it may still run: said now, tried again at close
            log.error("giving back remote desktop %s failed: %s", old.remote_id, exc)
            self._unreturned.append(old)
