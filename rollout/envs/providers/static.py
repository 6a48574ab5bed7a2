"""The ``static`` provider: desktops that already run (e.g. OSWorld VMs), given by URL;
never started or stopped. A reset runs the configured command through ``/execute``."""

from __future__ import annotations

from config import DesktopsConfig
from rollout.envs.client import RemoteDesktopEnv
from rollout.envs.providers.base import Desktop, DesktopProvider
from rollout.errors import DesktopError
from rollout.http import redact_url

__all__ = ["StaticProvider"]


class StaticProvider(DesktopProvider):
    """Desktops that already run (e.g. OSWorld VMs), given by URL; never started or stopped.
    Reset runs the configured command through ``/execute`` and checks health."""

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
        if not await self.health(desktop):
            raise DesktopError(f"static desktop {redact_url(desktop.url)} does not answer")
        return desktop

    async def reset(self, desktop: Desktop) -> None:
        command = self.cfg.static.reset_command
        if command:
            reply = await self._env(desktop).execute(command, timeout_s=self.cfg.reset_timeout_s)
            if reply.get("returncode") not in (0, None):
                raise DesktopError(
                    f"{desktop.id}: reset command exited {reply.get('returncode')}: "
                    f"{str(reply.get('error') or '')[:300]}"
                )
        # The pool health-checks every desktop after its reset.

    async def stop(self, desktop: Desktop) -> None:
        """Static desktops belong to someone else: nothing to stop."""

    async def health(self, desktop: Desktop) -> bool:
        return await self._env(desktop).health()
