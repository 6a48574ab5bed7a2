"""Windows and apps on the desktop: the window list (wmctrl), activating and closing windows,
opening a file (or starting a command) and waiting for its window, and the command that opens a
file with its default application (xdg-open, or the same lookup when xdg-utils is missing).
"""

from __future__ import annotations

import asyncio
import mimetypes
import shlex
import shutil
from collections.abc import Mapping
from configparser import ConfigParser
from configparser import Error as ConfigParserError
from dataclasses import dataclass
from pathlib import Path

from cua_rollout.desktop.errors import (
    CommandTimeout,
    NoApplication,
    NothingToOpen,
    OpenFailed,
    WindowCommandFailed,
    WindowTimeout,
)
from cua_rollout.desktop.files import expand_path
from cua_rollout.desktop.processes import AppTracker, output_tail, run_captured

__all__ = [
    "ACTIVATE",
    "CLOSE",
    "WMCTRL_TIMEOUT_S",
    "Window",
    "WindowMatch",
    "activate_window_id",
    "control_window",
    "list_windows",
    "open_command",
    "open_file",
    "wmctrl_argv",
]

# How long one wmctrl call may take before the X server is presumed stuck.
WMCTRL_TIMEOUT_S = 10.0
# wmctrl's actions: activate (raise and focus) a window, close it gracefully.
ACTIVATE = "a"
CLOSE = "c"
# Bytes read to tell a text file from a binary one when its name says nothing.
_SNIFF_BYTES = 4096


@dataclass(frozen=True)
class Window:
    id: str
    title: str


@dataclass(frozen=True)
class WindowMatch:
    """What one wmctrl action found: whether a window matched, and wmctrl's complaint when
    none did."""

    matched: bool
    detail: str = ""


async def list_windows(env: Mapping[str, str]) -> list[Window]:
    """The managed windows (``wmctrl -l``); empty when there is no window manager."""
    result = await run_captured(["wmctrl", "-l"], timeout_s=WMCTRL_TIMEOUT_S, env=env)
    windows = []
    for line in result.stdout.decode("utf-8", "replace").splitlines():
        fields = line.split(None, 3)
        if len(fields) >= 3:
            windows.append(Window(fields[0], fields[3] if len(fields) == 4 else ""))
    return windows


def wmctrl_argv(action: str, window_name: str, *, strict: bool, by_class: bool) -> list[str]:
    """OSWorld's wmctrl call: ``-x`` matches WM_CLASS instead of the title, ``-F`` the whole
    string case-sensitively; ``action`` is ``a`` (activate) or ``c`` (close gracefully)."""
    return ["wmctrl", f"-{'x' if by_class else ''}{'F' if strict else ''}{action}", window_name]


async def activate_window_id(window_id: str, env: Mapping[str, str]) -> bool:
    result = await run_captured(
        ["wmctrl", "-i", "-a", window_id], timeout_s=WMCTRL_TIMEOUT_S, env=env
    )
    return result.returncode == 0


async def control_window(
    action: str,
    window_name: str,
    *,
    strict: bool,
    by_class: bool,
    env: Mapping[str, str],
    timeout_s: float,
) -> WindowMatch:
    """Apply wmctrl's ``action`` (``ACTIVATE`` or ``CLOSE``) to the window named
    ``window_name`` (see ``wmctrl_argv``). Raises ``WindowCommandFailed`` when wmctrl cannot
    run or takes longer than ``timeout_s``."""
    argv = wmctrl_argv(action, window_name, strict=strict, by_class=by_class)
    try:
        result = await run_captured(argv, timeout_s=timeout_s, env=env)
    except (OSError, CommandTimeout) as exc:
        raise WindowCommandFailed(exc) from exc
    if result.returncode != 0:
        return WindowMatch(False, output_tail(result.stderr))
    return WindowMatch(True)


async def open_file(
    target: str,
    *,
    apps: AppTracker,
    env: Mapping[str, str],
    timeout_s: float,
    poll_interval_s: float,
) -> None:
    """Open ``target`` as OSWorld's ``open_file`` does, and return once its window is active.

    ``target`` is a file (``~`` and ``$VARS`` expanded), opened with its default application,
    or else a command on PATH, started as is; either runs as an app of ``apps`` (source
    ``open_file``). The window is the first whose title contains the file's name (or stem),
    or the command. Raises ``NothingToOpen``, ``OpenFailed`` (the opener could not start or
    exited with an error) or ``WindowTimeout`` (no window within ``timeout_s``).
    """
    path = expand_path(target)
    try:
        if path.exists():
            argv = await asyncio.to_thread(open_command, path, env)
            names = (path.name, path.stem)
        elif shutil.which(target, path=env.get("PATH")):
            argv, names = [target], (target,)
        else:
            raise NothingToOpen(target)
        proc = apps.launch(argv, env=env, source="open_file")
    except (NoApplication, OSError) as exc:
        raise OpenFailed(target, exc) from exc
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while True:
        for window in await list_windows(env):
            if any(name and name in window.title for name in names):
                await activate_window_id(window.id, env)
                return
        if proc.poll() not in (None, 0):  # the opener failed: no window will come
            raise OpenFailed(target, f"{argv[0]} exited with {proc.returncode}")
        if loop.time() >= deadline:
            raise WindowTimeout(names[0], timeout_s)
        await asyncio.sleep(poll_interval_s)


# ---------------------------------------------------------------------- default applications


def open_command(path: Path, env: Mapping[str, str]) -> list[str]:
    """The command that opens ``path`` with its default application: ``xdg-open`` when
    installed, else the Exec line of the desktop entry xdg-open would pick."""
    if shutil.which("xdg-open", path=env.get("PATH")):
        return ["xdg-open", str(path)]
    mime = _mime_type(path)
    entry = _default_entry(mime, env)
    if entry is None and mime.startswith("text/") and mime != "text/plain":
        entry = _default_entry("text/plain", env)
    if entry is None:
        raise NoApplication(f"no installed application opens {mime} (file {path})")
    return _exec_argv(entry, path)


def _mime_type(path: Path) -> str:
    if path.is_dir():
        return "inode/directory"
    guessed, _ = mimetypes.guess_type(path.name)
    if guessed:
        return guessed
    try:
        with open(path, "rb") as f:
            head = f.read(_SNIFF_BYTES)
    except OSError:
        return "application/octet-stream"
    if b"\0" in head:
        return "application/octet-stream"
    try:
        head.decode("utf-8")
    except UnicodeDecodeError as exc:
        if exc.start < len(head) - 4:  # not just a character cut at the end of the sample
            return "application/octet-stream"
    return "text/plain"


def _data_dirs(env: Mapping[str, str]) -> list[Path]:
    home = Path(env.get("HOME") or Path.home())
    data_home = Path(env.get("XDG_DATA_HOME") or home / ".local" / "share")
    dirs = env.get("XDG_DATA_DIRS") or "/usr/local/share:/usr/share"
    return [data_home, *(Path(d) for d in dirs.split(":") if d)]


def _config_dirs(env: Mapping[str, str]) -> list[Path]:
    home = Path(env.get("HOME") or Path.home())
    config_home = Path(env.get("XDG_CONFIG_HOME") or home / ".config")
    dirs = env.get("XDG_CONFIG_DIRS") or "/etc/xdg"
    return [config_home, *(Path(d) for d in dirs.split(":") if d)]


def _read_ini(path: Path) -> ConfigParser | None:
    parser = ConfigParser(interpolation=None, strict=False)
    parser.optionxform = str  # type: ignore[assignment,method-assign]  # keys are case-sensitive
    try:
        parser.read(path, encoding="utf-8")
    except (OSError, ConfigParserError, UnicodeDecodeError):
        return None
    return parser


def _find_entry(desktop_id: str, env: Mapping[str, str]) -> Path | None:
    for d in _data_dirs(env):
        candidate = d / "applications" / desktop_id
        if candidate.is_file():
            return candidate
    return None


def _default_entry(mime: str, env: Mapping[str, str]) -> Path | None:
    # 1. [Default Applications] of the mimeapps.list files, user's first.
    lists = [d / "mimeapps.list" for d in _config_dirs(env)]
    lists += [d / "applications" / "mimeapps.list" for d in _data_dirs(env)]
    for path in lists:
        parser = _read_ini(path) if path.is_file() else None
        if parser is None or not parser.has_option("Default Applications", mime):
            continue
        for desktop_id in parser.get("Default Applications", mime).split(";"):
            if desktop_id and (entry := _find_entry(desktop_id.strip(), env)):
                return entry
    # 2. Any installed application that declares the type (first in data-dir order, by name).
    for d in _data_dirs(env):
        apps = d / "applications"
        if not apps.is_dir():
            continue
        for entry in sorted(apps.glob("*.desktop")):
            parser = _read_ini(entry)
            if parser is None or not parser.has_section("Desktop Entry"):
                continue
            section = parser["Desktop Entry"]
            if section.get("NoDisplay") == "true" or section.get("Hidden") == "true":
                continue
            if mime in [m.strip() for m in section.get("MimeType", "").split(";")]:
                return entry
    return None


def _exec_argv(entry: Path, path: Path) -> list[str]:
    parser = _read_ini(entry)
    exec_line = parser.get("Desktop Entry", "Exec", fallback="") if parser else ""
    argv: list[str] = []
    placed = False
    for arg in shlex.split(exec_line):
        if arg in ("%f", "%F", "%u", "%U"):
            argv.append(str(path))
            placed = True
        elif len(arg) == 2 and arg.startswith("%"):
            continue  # %i, %c, %k ...: icon, name, entry location are not needed
        else:
            argv.append(arg.replace("%%", "%"))
    if not argv:
        raise NoApplication(f"{entry} has no Exec line")
    if not placed:
        argv.append(str(path))
    return argv
