"""The ``static`` provider: desktops that already run (e.g. OSWorld VMs), given by URL;
never started or stopped. Each is reset between episodes (``desktops.static.reset``):

- ``builtin`` (the default): when the pool first sees a VM it archives its HOME and records
  its processes and window classes (on the VM, kept across runs); a
  reset closes the windows and ends the processes that were not there then (by pid, only the
  VM user's, or on a desktop of ours only those tagged with its id) and restores HOME from the
  archive. Everything runs on the VM through ``/execute`` with its ``python3``; the baseline
  lives in ``$TMPDIR/.cua-baseline`` (a VM: ``/tmp``; our desktops: their own directory).
- ``command``: ``reset_command`` run on the VM;
- ``http``: a POST to ``reset_url`` (the user's VM manager, e.g. a snapshot revert), then
  wait for the VM's server to answer again;
- ``none``: nothing beyond each task's own setup.

The pool then verifies the result (``cua_rollout/envs/verify.py``) before lending the VM again.
"""

from __future__ import annotations

import asyncio
import time

import httpx2

from cua_rollout.config import DesktopsConfig
from cua_rollout.core.errors import DesktopError
from cua_rollout.core.http import error_text, redact_url
from cua_rollout.envs.client import RemoteDesktopEnv
from cua_rollout.envs.providers.base import (
    Desktop,
    DesktopProvider,
    builtin_reset,
    take_baseline,
)

__all__ = ["StaticProvider"]

class StaticProvider(DesktopProvider):
    """Desktops that already run (e.g. OSWorld VMs), given by URL; never started or stopped.
    Reset as ``desktops.static.reset`` says; the pool checks health and the initial state
    after it."""

    replaceable = False

    def __init__(self, cfg: DesktopsConfig) -> None:
        self.cfg = cfg

    def capacity(self) -> int | None:
        return len(self.cfg.static.urls)

    def _env(self, desktop: Desktop) -> RemoteDesktopEnv:
        return RemoteDesktopEnv(desktop.url, self.cfg, name=desktop.id)

    async def start(self, index: int) -> Desktop:
        urls = self.cfg.static.urls
        if index >= len(urls):
            raise DesktopError(f"desktops.static.urls has {len(urls)} URLs; no desktop #{index}")
        desktop = Desktop(id=f"static-{index}", url=urls[index].rstrip("/"))
        desktop.info["index"] = index
        if not await self.health(desktop):
            raise DesktopError(f"static desktop {redact_url(desktop.url)} does not answer")
        if self.cfg.static.reset == "builtin":
            await take_baseline(self.cfg, desktop)
        return desktop

    async def reset(self, desktop: Desktop) -> None:
        how = self.cfg.static.reset
        started = time.monotonic()
        if how == "builtin":
            await builtin_reset(self.cfg, desktop)
        elif how == "command":
            assert self.cfg.static.reset_command
            reply = await self._env(desktop).execute(self.cfg.static.reset_command,
                                                     timeout_s=self.cfg.reset_timeout_s)
            if reply.get("returncode") not in (0, None):
                raise DesktopError(
                    f"{desktop.id}: reset command exited {reply.get('returncode')}: "
                    f"{str(reply.get('error') or '')[:300]}")
        elif how == "http":
            await self._reset_by_http(desktop)
        desktop.info["last_reset"] = {"how": how, "seconds": time.monotonic() - started}
        # The pool health-checks and verifies every desktop after its reset.

    async def _reset_by_http(self, desktop: Desktop) -> None:
        url = self.cfg.static.reset_url
        assert url
        body = {"desktop": desktop.id, "url": desktop.url, "index": desktop.info.get("index")}
        async with httpx2.AsyncClient(timeout=self.cfg.reset_timeout_s) as client:
            try:
                reply = await client.post(url, json=body)
            except httpx2.HTTPError as exc:
                raise DesktopError(f"{desktop.id}: reset_url {redact_url(url)}: "
                                   f"{type(exc).__name__}: {exc}") from exc
        if reply.status_code >= 300:
            raise DesktopError(f"{desktop.id}: reset_url {redact_url(url)} answered HTTP "
                               f"{reply.status_code}: {error_text(reply, 300)}")
        # A snapshot revert restarts the VM's server: wait until it answers again.
        deadline = time.monotonic() + self.cfg.reset_timeout_s
        while not await self.health(desktop):
            if time.monotonic() > deadline:
                raise DesktopError(f"{desktop.id}: not answering after the reset by "
                                   f"{redact_url(url)}")
            await asyncio.sleep(1.0)

    async def stop(self, desktop: Desktop) -> None:
        """Static desktops belong to someone else: nothing to stop."""

    async def health(self, desktop: Desktop) -> bool:
        return await self._env(desktop).health()
