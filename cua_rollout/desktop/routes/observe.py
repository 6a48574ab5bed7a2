"""Routes that look at the desktop: screenshot, screen and window sizes, pointer, platform,
the Desktop directory, the accessibility tree and the terminal's text.
"""

from __future__ import annotations

import os
import platform

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response

from cua_rollout.desktop.errors import AccessibilityError, AccessibilityUnavailable
from cua_rollout.desktop.files import desktop_directory
from cua_rollout.desktop.protocol import (
    APP_CLASS_NAME_FIELD,
    CHROMIUM_PORT_VAR,
    VLC_PORT_VAR,
    AccessibilityReply,
    DesktopPathReply,
    ErrorReply,
    MessageReply,
    Paths,
    PortsReply,
    ScreenSizeReply,
    TerminalReply,
    WindowSizeReply,
)
from cua_rollout.desktop.routes.common import State, json_reply

__all__ = ["router"]

router = APIRouter()


@router.get(Paths.SCREENSHOT)
async def screenshot(state: State) -> Response:
    return Response(await state.screen.screenshot_png(), media_type="image/png")


@router.post(Paths.SCREEN_SIZE)
async def screen_size(state: State) -> JSONResponse:
    width, height = await state.screen.size()
    return json_reply(ScreenSizeReply(width=width, height=height))


@router.get(Paths.CURSOR_POSITION)
async def cursor_position(state: State) -> JSONResponse:
    x, y = await state.screen.pointer()
    return JSONResponse([x, y])


@router.post(Paths.WINDOW_SIZE)
async def window_size(request: Request, state: State) -> JSONResponse:
    app_class = (await request.form()).get(APP_CLASS_NAME_FIELD)
    if not isinstance(app_class, str):
        return json_reply(ErrorReply(error=f"{APP_CLASS_NAME_FIELD} is required"), 400)
    size = await state.screen.window_size(app_class)
    if size is None:  # OSWorld's view returns None here, which Flask turns into a 500
        return json_reply(ErrorReply(error=f"no window of class {app_class!r}"), 500)
    return json_reply(WindowSizeReply(width=size[0], height=size[1]))


@router.get(Paths.PORTS)
async def get_ports() -> JSONResponse:
    def port(var: str) -> int | None:
        value = os.environ.get(var, "")
        return int(value) if value.isdigit() else None

    return JSONResponse(PortsReply(chromium=port(CHROMIUM_PORT_VAR), vlc=port(VLC_PORT_VAR))
                        .model_dump())


@router.get(Paths.PLATFORM)
async def get_platform() -> PlainTextResponse:
    return PlainTextResponse(platform.system())


@router.post(Paths.DESKTOP_PATH)
async def desktop_path() -> JSONResponse:
    path = desktop_directory()
    if path is None:
        error = "Unsupported operating system or desktop path not found"
        return json_reply(ErrorReply(error=error), 404)
    return json_reply(DesktopPathReply(desktop_path=str(path)))


@router.get(Paths.ACCESSIBILITY)
async def accessibility(state: State) -> JSONResponse:
    try:
        return json_reply(AccessibilityReply(AT=await state.accessibility.tree()))
    except AccessibilityError as exc:
        return _unavailable(exc)


@router.get(Paths.TERMINAL)
async def terminal(state: State) -> JSONResponse:
    try:
        return json_reply(TerminalReply(output=await state.accessibility.terminal()))
    except AccessibilityError as exc:
        return _unavailable(exc)


def _unavailable(exc: AccessibilityError) -> JSONResponse:
    status = 501 if isinstance(exc, AccessibilityUnavailable) else 500
    return json_reply(MessageReply(status="error", message=str(exc)), status)
