"""The ``local`` provider: desktops on this machine, each an Xvfb display with a window
manager, a session bus, its own HOME and the desktop server (``cua_rollout/envs/local_session.py``).
For demos and tests: the desktops run as the user who runs the rollout."""

from __future__ import annotations

import asyncio
import logging
import os
from typing import Any

from cua_rollout.config import DesktopsConfig
from cua_rollout.envs.providers.base import Desktop, DesktopProvider, server_answers

__all__ = ["LocalProvider"]

log = logging.getLogger(__name__)


class LocalProvider(DesktopProvider):
    """Desktops on this machine: each an Xvfb display with a window manager, a session bus,
    its own HOME and the desktop server (see ``cua_rollout/envs/local_session.py``). Desktops
    left by a crashed earlier run are found through the state dir and removed before the first
    start."""

    replaceable = True

    def __init__(self, cfg: DesktopsConfig) -> None:
        self.cfg = cfg
        self._sessions: dict[str, Any] = {}
        self._swept = False
        self.stale_removed: list[str] = []

    async def start(self, index: int) -> Desktop:
        from cua_rollout.envs.local_session import LocalDesktopSession, sweep_stale_sessions

        if not self._swept:
            self._swept = True
            self.stale_removed = await asyncio.to_thread(
                sweep_stale_sessions, self.cfg.local.state_dir
            )
            if self.stale_removed:
                log.warning("removed stale local desktops: %s", ", ".join(self.stale_removed))
        # The pid keeps two runs sharing a state dir apart; the index keeps desktops apart.
        desktop_id = f"local-{os.getpid()}-{index}"
        session = LocalDesktopSession(
            desktop_id, self.cfg.local.state_dir, self.cfg.screen_width, self.cfg.screen_height,
            window_manager=self.cfg.local.window_manager,
            home_template=self.cfg.local.home_template, token_env=self.cfg.token_env,
            start_timeout_s=self.cfg.local.start_timeout_s, host=self.cfg.local.host,
        )
        url = await asyncio.to_thread(session.start)
        self._sessions[desktop_id] = session
        return Desktop(id=desktop_id, url=url, info={"display": session.display.display})

    async def reset(self, desktop: Desktop) -> None:
        timings = await asyncio.to_thread(self._sessions[desktop.id].reset)
        desktop.info["last_reset"] = timings

    async def stop(self, desktop: Desktop) -> None:
        session = self._sessions.pop(desktop.id, None)
        if session is not None:
            await asyncio.to_thread(session.stop)

    async def health(self, desktop: Desktop) -> bool:
        session = self._sessions.get(desktop.id)
        if session is None or not session.alive():
            return False
        return await server_answers(self.cfg, desktop)


