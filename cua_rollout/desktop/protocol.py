"""The wire protocol of a desktop, defined once: OSWorld's in-desktop HTTP protocol (the paths,
request and reply shapes of ``desktop_env/server/main.py``) plus ``/apps`` for resets.

The desktop server serves it; the controller's client and the benchmark's simulated desktops
import this module to speak it. It imports nothing but pydantic and the standard library, so
both sides can use it without pulling in the other.

Requests are built with the request models and sent as ``model.body()``. Replies parse with
the reply models, which keep fields they do not know (``extra="allow"``), so the answers of
OSWorld's own servers, which carry a few more, parse too. Status codes are the server's
business; ``cua_rollout/desktop/server.py``'s docstring lists them.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict

__all__ = [
    "APP_CLASS_NAME_FIELD",
    "CHROMIUM_PORT_VAR",
    "FILE_DATA_FIELD",
    "FILE_PATH_FIELD",
    "VLC_PORT_VAR",
    "AccessibilityReply",
    "ActionsReply",
    "AppInfo",
    "AppsReply",
    "CommandReply",
    "CommandRequest",
    "DesktopPathReply",
    "DownloadRequest",
    "ErrorReply",
    "KillAppsReply",
    "LeaseTokenRequest",
    "ListDirectoryReply",
    "ListDirectoryRequest",
    "MessageReply",
    "OpenFileRequest",
    "Paths",
    "PortsReply",
    "ReplyModel",
    "RequestModel",
    "RunBashScriptRequest",
    "RunPythonErrorReply",
    "RunPythonReply",
    "RunPythonRequest",
    "ScreenSizeReply",
    "TerminalReply",
    "WindowRequest",
    "WindowSizeReply",
    "execute_command",
]


class Paths:
    """Every path a desktop serves (method in the comment)."""

    # Observation
    SCREENSHOT = "/screenshot"  # GET: PNG
    SCREEN_SIZE = "/screen_size"  # POST: ScreenSizeReply
    CURSOR_POSITION = "/cursor_position"  # GET: [x, y]
    WINDOW_SIZE = "/window_size"  # POST form APP_CLASS_NAME_FIELD: WindowSizeReply
    PLATFORM = "/platform"  # GET: text, e.g. "Linux"
    DESKTOP_PATH = "/desktop_path"  # POST: DesktopPathReply
    ACCESSIBILITY = "/accessibility"  # GET: AccessibilityReply
    TERMINAL = "/terminal"  # GET: TerminalReply
    # Commands
    EXECUTE = "/execute"  # POST CommandRequest: CommandReply
    SETUP_EXECUTE = "/setup/execute"  # POST CommandRequest: CommandReply
    RUN_PYTHON = "/run_python"  # POST RunPythonRequest: RunPythonReply
    RUN_BASH_SCRIPT = "/run_bash_script"  # POST RunBashScriptRequest: CommandReply
    ACTIONS = "/actions"  # GET: ActionsReply (not in OSWorld)
    # Files
    LIST_DIRECTORY = "/list_directory"  # POST ListDirectoryRequest: ListDirectoryReply
    FILE = "/file"  # POST form FILE_PATH_FIELD: the file's bytes
    SETUP_UPLOAD = "/setup/upload"  # POST form FILE_PATH_FIELD + FILE_DATA_FIELD: text
    SETUP_DOWNLOAD_FILE = "/setup/download_file"  # POST DownloadRequest: text
    # Apps and windows
    SETUP_LAUNCH = "/setup/launch"  # POST CommandRequest: text
    SETUP_OPEN_FILE = "/setup/open_file"  # POST OpenFileRequest: text
    SETUP_ACTIVATE_WINDOW = "/setup/activate_window"  # POST WindowRequest: text
    SETUP_CLOSE_WINDOW = "/setup/close_window"  # POST WindowRequest: text
    PORTS = "/ports"  # GET: PortsReply (not in OSWorld: its VMs use the fixed ports)
    APPS = "/apps"  # GET: AppsReply (not in OSWorld)
    APPS_KILL = "/apps/kill"  # POST: KillAppsReply (not in OSWorld)
    # A second bearer token, for one lease (not in OSWorld): base token only
    LEASE_TOKEN = "/lease_token"  # POST LeaseTokenRequest: MessageReply
    # Recording
    START_RECORDING = "/start_recording"  # POST: MessageReply
    END_RECORDING = "/end_recording"  # POST: the MP4's bytes


FILE_PATH_FIELD = "file_path"
"""Form field of ``/file`` and ``/setup/upload``: the path on the desktop (``~`` expanded)."""
FILE_DATA_FIELD = "file_data"
"""Form field (a file part) of ``/setup/upload``: the file's content."""
APP_CLASS_NAME_FIELD = "app_class_name"
"""Form field of ``/window_size``: the WM_CLASS of the window."""


# ---------------------------------------------------------------------- requests


class RequestModel(BaseModel):
    """A JSON request body."""

    def body(self) -> dict[str, Any]:
        """The JSON object to send; fields left at None are left out (the server's default)."""
        return self.model_dump(exclude_none=True)


class CommandRequest(RequestModel):
    """``/execute``, ``/setup/execute`` and ``/setup/launch``. A string ``command`` is split
    like a shell would (shlex) unless ``shell``; with ``shell`` it runs through ``/bin/sh -c``
    (a list as ``sh -c list[0] list[1:]``). Arguments starting with ``~/`` are expanded."""

    command: list[str] | str
    shell: bool = False
    timeout: float | None = None
    """Seconds the caller waits for the answer (not in OSWorld, whose servers ignore it): the
    server ends the command by then, or by its own limit when that comes first, so that a
    command its caller gave up on does not run on. None: the server's limit. ``/setup/launch``
    ignores it (an app runs until a reset)."""


class LeaseTokenRequest(RequestModel):
    """``/lease_token``: install ``token`` as a second bearer token, accepted on every path
    but this one until it is replaced or cleared (null). Only the server's own token may
    ask; the desktop service gives each lease a fresh one and clears it before the reset."""

    token: str | None = None


class RunPythonRequest(RequestModel):
    """``/run_python``: Python source run by the server's interpreter."""

    code: str


class RunBashScriptRequest(RequestModel):
    """``/run_bash_script``: a bash script (stdout and stderr merged into ``output``)."""

    script: str
    timeout: float | None = None
    """Seconds (None: the server's default, OSWorld's is 100)."""
    working_dir: str | None = None
    """Directory to run in (``~`` expanded); None: the server's."""


class ListDirectoryRequest(RequestModel):
    path: str


class OpenFileRequest(RequestModel):
    """``/setup/open_file``: a file (opened with its default application) or a command on
    PATH; the answer comes once a window whose title names it is active."""

    path: str


class DownloadRequest(RequestModel):
    """``/setup/download_file``: the desktop downloads ``url`` to ``path``."""

    url: str
    path: str


class WindowRequest(RequestModel):
    """``/setup/activate_window`` and ``/setup/close_window`` (wmctrl): ``by_class`` matches
    the WM_CLASS instead of the title; ``strict`` the whole string, case-sensitively."""

    window_name: str
    strict: bool = False
    by_class: bool = False


# ---------------------------------------------------------------------- replies


class ReplyModel(BaseModel):
    """A JSON reply; fields this module does not know are kept."""

    model_config = ConfigDict(extra="allow")


class ErrorReply(ReplyModel):
    """The body of most refusals: ``{"error": text}``."""

    error: str


class MessageReply(ReplyModel):
    """``{"status": "success"|"error", "message": text}``: the failures of commands,
    accessibility and recording, and ``/start_recording``'s answer."""

    status: str
    message: str


class CommandReply(ReplyModel):
    """``/execute``'s answer (``status`` is "success" whenever the command ran), and
    ``/run_bash_script``'s (``status`` "error" when the script exited non-zero; ``error`` is
    always empty there, stderr being merged into ``output``)."""

    status: str
    output: str
    error: str
    returncode: int


class RunPythonReply(ReplyModel):
    """``/run_python``'s answer when the code ran; ``message`` is output and error joined."""

    status: str
    message: str
    need_more: bool = False
    output: str
    error: str
    return_code: int


class RunPythonErrorReply(ReplyModel):
    """``/run_python``'s answer when the code could not run or ran past its time limit."""

    status: str = "error"
    message: str
    error: str
    need_more: bool = False
    output: str | None = None


class ActionsReply(ReplyModel):
    """How ``/execute`` ran its commands (not in OSWorld): plain pyautogui actions in the
    server's warm interpreter, the rest in fresh processes (``cua_rollout/desktop/actions.py``)."""

    enabled: bool
    """Whether plain actions run in the warm interpreter (the server's ``--warm-actions``)."""
    worker_pid: int | None
    """The warm interpreter's pid; None while none runs."""
    warm: int
    """Actions run in the warm interpreter."""
    fresh: int
    """Commands run in a fresh process."""
    fallbacks: int
    """Of ``fresh``: plain actions the warm interpreter could not take (not started, or the
    display changed under it)."""
    starts: int
    restarts: int
    """Starts of the warm interpreter after the first."""
    timeouts: int
    deaths: int
    """Ends of the warm interpreter the server did not ask for (a crash, a kill)."""
    start_failures: int
    last_error: str | None = None
    click_focus: bool = False
    """Whether the click-to-focus watcher runs (``cua_rollout/desktop/click_focus.py``)."""
    click_focus_presses: int = 0
    click_focus_activations: int = 0
    """Windows it activated because a press landed on them while another was active."""
    click_focus_error: str | None = None
    """Why it does not run, when asked to."""


class ScreenSizeReply(ReplyModel):
    width: int
    height: int


class WindowSizeReply(ReplyModel):
    width: int
    height: int


class DesktopPathReply(ReplyModel):
    desktop_path: str


CHROMIUM_PORT_VAR = "CUA_CHROMIUM_PORT"
"""Set on a desktop that shares its host's network with others (local desktops): the port
its browser's DevTools listens on (``desktop/apps/google-chrome`` moves it there)."""


VLC_PORT_VAR = "CUA_VLC_PORT"
"""Likewise: the port of VLC's HTTP interface (``desktop/apps/vlc`` opens it there; OSWorld's
VMs use 8080)."""


class PortsReply(ReplyModel):
    """Ports of the desktop's own services on its host, where they differ from OSWorld's
    fixed ones (None: the client's configured default, e.g. 9222 for DevTools)."""

    chromium: int | None = None
    vlc: int | None = None


class AccessibilityReply(ReplyModel):
    """The accessibility tree as XML, in the layout of OSWorld's Linux tree."""

    AT: str


class TerminalReply(ReplyModel):
    """The text of the focused terminal of the active window (None: there is none)."""

    output: str | None
    status: str = "success"


class ListDirectoryReply(ReplyModel):
    """``{"type": "directory", "name", "children": [...]}`` nodes, files as
    ``{"type": "file", "name"}``; ``{"error": text}`` for a directory that cannot be read."""

    directory_tree: dict[str, Any]


class AppInfo(ReplyModel):
    """One live process the server started (or a command left running)."""

    pid: int
    sid: int
    name: str
    cmdline: list[str]
    source: str
    """What started it: launch, open_file, execute, run_python or run_bash_script."""
    started_at: float
    """Start time, seconds since the epoch."""


class AppsReply(ReplyModel):
    apps: list[AppInfo]


class KillAppsReply(ReplyModel):
    """The pids ended, and those still alive even after SIGKILL."""

    killed: list[int]
    remaining: list[int]


# ---------------------------------------------------------------------- helpers


def execute_command(code: str, python: str = "python") -> list[str]:
    """The argv OSWorld's client posts to a desktop's ``/execute`` for pyautogui code."""
    return [python, "-c", f"import pyautogui; import time; pyautogui.FAILSAFE = False; {code}"]
