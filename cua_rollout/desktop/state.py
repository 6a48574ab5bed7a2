"""What one desktop server is configured with (``ServerSettings``) and what it holds while it
runs (``ServerState``: screen, started apps, recorder, accessibility, download client, the
warm interpreter of actions).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import tempfile
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import httpx

from cua_rollout.desktop.accessibility import Accessibility
from cua_rollout.desktop.actions import ActionExecutor
from cua_rollout.desktop.click_focus import ClickFocus
from cua_rollout.desktop.display import write_placeholder_xauthority
from cua_rollout.desktop.processes import AppTracker, child_env
from cua_rollout.desktop.recording import Recorder
from cua_rollout.desktop.screen import Screen

__all__ = ["ServerSettings", "ServerState", "open_state"]


@dataclass(frozen=True)
class ServerSettings:
    """Limits and paths of one server; the defaults are OSWorld's where it has one."""

    token: str | None = None
    """Bearer token every request must carry (None: no check)."""
    execute_timeout_s: float = 120.0
    """Time limit of ``/execute`` and ``/setup/execute`` (OSWorld: 120 s)."""
    run_python_timeout_s: float = 30.0
    """Time limit of ``/run_python`` (OSWorld: 30 s)."""
    bash_default_timeout_s: float = 100.0
    """``/run_bash_script``'s limit when the request names none (OSWorld: 100 s)."""
    open_file_timeout_s: float = 1800.0
    """How long ``/setup/open_file`` waits for the file's window (OSWorld: 1800 s)."""
    window_poll_interval_s: float = 0.5
    """How often ``/setup/open_file`` looks for the window."""
    download_timeout_s: float = 300.0
    """Deadline of one ``/setup/download_file`` attempt (OSWorld: 300 s)."""
    download_connect_timeout_s: float = 10.0
    """Deadline to connect to the download's host."""
    download_attempts: int = 3
    """Attempts of a download before it fails (OSWorld: 3)."""
    a11y_timeout_s: float = 60.0
    """Deadline of one accessibility-tree dump."""
    a11y_python: str = "/usr/bin/python3"
    """Interpreter that can import pyatspi (Debian's python3-pyatspi)."""
    record_fps: int = 10
    """Frames per second of recordings."""
    record_start_timeout_s: float = 10.0
    """Deadline for ffmpeg to start writing a recording."""
    record_stop_timeout_s: float = 15.0
    """Deadline for ffmpeg to finish a recording after SIGINT (OSWorld: 15 s)."""
    kill_grace_s: float = 3.0
    """Between SIGTERM and SIGKILL when ``/apps/kill`` ends the launched apps."""
    warm_actions: bool = True
    """Run plain pyautogui actions of ``/execute`` in one warm interpreter instead of a new
    process each (``cua_rollout.desktop.actions``); off: every command in a fresh process, as
    OSWorld."""
    click_focus: bool = True
    """Activate the window a button press lands on when it is not the active one
    (``cua_rollout.desktop.click_focus``): the click-to-focus the desktops' openbox leaves out,
    since its
    grab on client windows lost clicks under load. Harmless under a window manager that does
    it itself."""


@dataclass
class ServerState:
    """What a running server holds; made by ``open_state``."""

    settings: ServerSettings
    workdir: Path
    """A private directory: temporary scripts, the recording, a placeholder X authority."""
    screen: Screen
    apps: AppTracker
    recorder: Recorder
    accessibility: Accessibility
    http: httpx.AsyncClient
    """For downloads."""
    env: dict[str, str]
    """The environment of every child."""
    actions: ActionExecutor
    """The warm interpreter of plain ``/execute`` actions (not an app: resets keep it)."""
    click_focus: ClickFocus | None = None
    """The click-to-focus watcher, when ``settings.click_focus``."""
    lease_token: str | None = None
    """A second bearer token (``/lease_token``: one lease's, installed by the desktop
    service), accepted beside ``settings.token`` on every path but that one."""


@contextlib.asynccontextmanager
async def open_state(settings: ServerSettings) -> AsyncIterator[ServerState]:
    """The state of a server for the X display in ``$DISPLAY``, for as long as it serves;
    afterwards the recording and every app it started are ended and its files removed."""
    display = os.environ.get("DISPLAY")
    if not display:
        raise RuntimeError("DISPLAY is not set: the desktop server serves the X display in it")
    workdir = Path(tempfile.mkdtemp(prefix="desktop-server-"))
    _ensure_xauthority(workdir)
    env = child_env()
    state = ServerState(
        settings=settings,
        workdir=workdir,
        screen=Screen(display),
        apps=AppTracker(),
        recorder=Recorder(
            workdir,
            display,
            fps=settings.record_fps,
            start_timeout_s=settings.record_start_timeout_s,
            stop_timeout_s=settings.record_stop_timeout_s,
        ),
        accessibility=Accessibility(
            python=settings.a11y_python, timeout_s=settings.a11y_timeout_s, env=env
        ),
        http=httpx.AsyncClient(
            timeout=httpx.Timeout(
                settings.download_timeout_s, connect=settings.download_connect_timeout_s
            ),
            follow_redirects=True,
        ),
        env=env,
        actions=ActionExecutor(env, enabled=settings.warm_actions),
    )
    state.actions.prestart()
    if settings.click_focus:
        state.click_focus = ClickFocus(display)
        await asyncio.to_thread(state.click_focus.start)
    try:
        yield state
    finally:
        if state.click_focus is not None:
            await asyncio.to_thread(state.click_focus.stop)
        await state.actions.close()
        await state.recorder.kill()
        await state.apps.kill_all(settings.kill_grace_s)
        await state.http.aclose()
        await asyncio.to_thread(state.screen.close)
        shutil.rmtree(workdir, ignore_errors=True)


def _ensure_xauthority(workdir: Path) -> None:
    """Point XAUTHORITY at a harmless file when the one X clients would read is missing or
    empty: python-xlib, and so pyautogui in every ``/execute``, refuses to connect without
    one, and prints a warning to stdout (into the command's output) when it has no entry."""
    current = os.environ.get("XAUTHORITY") or os.path.expanduser("~/.Xauthority")
    if os.path.isfile(current) and os.path.getsize(current) > 0:
        return
    path = workdir / "Xauthority"
    write_placeholder_xauthority(path)
    os.environ["XAUTHORITY"] = str(path)
