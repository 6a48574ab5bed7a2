"""Routes that start and end apps and handle windows: ``/setup/launch``, ``/setup/open_file``,
``/setup/activate_window``, ``/setup/close_window``, and ``/apps`` for resets.
"""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response

from cua_rollout.desktop.commands import launch_app, read_command
from cua_rollout.desktop.errors import (
    CommandError,
    NothingToOpen,
    OpenFileError,
    WindowCommandFailed,
)
from cua_rollout.desktop.protocol import AppsReply, KillAppsReply, MessageReply, Paths
from cua_rollout.desktop.routes.common import State, json_reply, read_json, text_reply
from cua_rollout.desktop.state import ServerState
from cua_rollout.desktop.windows import ACTIVATE, CLOSE, control_window, open_file

__all__ = ["router"]

router = APIRouter()


@router.post(Paths.SETUP_LAUNCH)
async def launch(request: Request, state: State) -> Response:
    data = await read_json(request)
    try:
        command = read_command(data)
        launch_app(command, apps=state.apps, env=state.env)
    except CommandError as exc:
        return json_reply(MessageReply(status="error", message=str(exc)), 500)
    shown = command.command if command.shell else " ".join(command.command)
    return text_reply(f"{shown} launched successfully")


@router.post(Paths.SETUP_OPEN_FILE)
async def setup_open_file(request: Request, state: State) -> PlainTextResponse:
    target = (await read_json(request)).get("path")
    if not target:
        return text_reply("Path not supplied!", 400)
    try:
        await open_file(
            str(target),
            apps=state.apps,
            env=state.env,
            timeout_s=state.settings.open_file_timeout_s,
            poll_interval_s=state.settings.window_poll_interval_s,
        )
    except NothingToOpen as exc:
        return text_reply(str(exc), 404)
    except OpenFileError as exc:
        return text_reply(str(exc), 500)
    return text_reply("File opened and window activated successfully")


@router.post(Paths.SETUP_ACTIVATE_WINDOW)
async def activate_window(request: Request, state: State) -> PlainTextResponse:
    return await _window(request, state, ACTIVATE, "Window activated successfully")


@router.post(Paths.SETUP_CLOSE_WINDOW)
async def close_window(request: Request, state: State) -> PlainTextResponse:
    return await _window(request, state, CLOSE, "Window closed successfully.")


async def _window(
    request: Request, state: ServerState, action: str, done: str
) -> PlainTextResponse:
    """OSWorld ignores wmctrl's result on Linux: 200 whether or not a window matched."""
    data = await read_json(request)
    name = data.get("window_name")
    if not name or not isinstance(name, str):
        return text_reply("window_name required", 400)
    try:
        match = await control_window(
            action,
            name,
            strict=bool(data.get("strict")),
            by_class=bool(data.get("by_class")),
            env=state.env,
            timeout_s=state.settings.execute_timeout_s,
        )
    except WindowCommandFailed as exc:
        return text_reply(str(exc), 500)
    return text_reply(done if match.matched else f"No window matched {name!r}: {match.detail}")


@router.get(Paths.APPS)
async def list_apps(state: State) -> JSONResponse:
    """Processes the server started that are still running (not in OSWorld)."""
    return json_reply(AppsReply(apps=await asyncio.to_thread(state.apps.describe)))


@router.post(Paths.APPS_KILL)
async def kill_apps(state: State) -> JSONResponse:
    """End every process the server started: what ``/setup/launch`` and
    ``/setup/open_file`` started and what commands left running (not in OSWorld)."""
    # An action running in the warm interpreter is a running command too (the idle
    # interpreter is not an app, and stays).
    await state.actions.interrupt(state.settings.kill_grace_s)
    ended = await state.apps.kill_all(state.settings.kill_grace_s)
    return json_reply(KillAppsReply(**ended))
