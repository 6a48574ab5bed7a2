"""The HTTP routes of the desktop server, grouped by what they do; each reads its request,
calls the logic modules of ``desktop/`` and maps their result or error to OSWorld's reply.
"""

from __future__ import annotations

from fastapi import APIRouter

from cua_rollout.desktop.routes import access, apps, commands, files, observe, recording

__all__ = ["ROUTERS"]

ROUTERS: tuple[APIRouter, ...] = (
    observe.router,
    commands.router,
    files.router,
    apps.router,
    recording.router,
    access.router,
)
"""Every router of the server, to be included in its app."""
