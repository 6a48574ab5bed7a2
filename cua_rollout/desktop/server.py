"""The HTTP server inside a desktop: its app (lifespan, bearer auth, error replies, the routes
of ``cua_rollout.desktop.routes``) and its command line. It speaks
``cua_rollout.desktop.protocol``: OSWorld's
in-desktop protocol for the X display in ``$DISPLAY``, plus ``/apps`` for resets.

It answers as OSWorld's ``desktop_env/server/main.py`` does: same paths, request and response
shapes and status codes.

    python -m cua_rollout.desktop.server --host 127.0.0.1 --port 5000 [--token-env NAME]

Executing code is the point of this server: anyone who reaches it owns the desktop. Run it on
an isolated machine, container or pod, keep it on loopback unless the network is trusted, and
set a token (``--token-env``) when it listens anywhere else. The server takes the token out of
its environment once read, and every process it starts (commands, apps, scripts) gets an
allowlisted environment (``cua_rollout.desktop.processes.CHILD_ENV_ALLOW``; an image adds names with
``$CUA_DESKTOP_ENV_ALLOW``, e.g. ``http_proxy,https_proxy``): what the model runs never sees
the token or any other secret of the server's environment.

Status codes are OSWorld's, including where OSWorld's come from an unhandled exception (then
the body here says what went wrong instead of an HTML page):

    any JSON endpoint       415 body not declared as JSON, 400 malformed JSON,
                            500 JSON that is not an object
    /execute                500 {status: error, message} when the command cannot start
                            (missing ``command``, no such program, a ``timeout`` that is
                            not a positive number) or exceeds its time limit
    /setup/launch           500 {status: error, message} when the command cannot start
    /run_python             400 no ``code``; 500 over the time limit
    /run_bash_script        400 no ``script`` or no such ``working_dir``; 500 over the limit
    /list_directory         400 no ``path`` or not a directory
    /file                   400 no ``file_path``; 404 no such file; 500 unreadable (directory)
    /setup/upload           400 no ``file_path`` or ``file_data``
    /window_size            400 no ``app_class_name``; 500 no such window
    /desktop_path           404 no ~/Desktop
    /setup/open_file        400 no ``path``; 404 neither a file nor a command; 500 no window
    /setup/activate_window, /setup/close_window
                            400 no ``window_name``; 200 otherwise (OSWorld ignores wmctrl's
                            result on Linux; the text here says whether a window matched)
    /setup/download_file    400 no ``url`` or ``path``; 500 download failed
    /start_recording        400 already recording; 500 ffmpeg failed
    /end_recording          400 not recording; 500 no usable file
    /accessibility, /terminal
                            501 AT-SPI is not available (the reason in ``message``)
    every path              401 without ``Authorization: Bearer <token>`` when a token is set
                            (the server's, or the lease token of ``/lease_token``)
    /lease_token            401 but with the server's own token; 400 not {"token": str|null};
                            409 the server has no token

Deliberate differences: a command's answer does not wait for processes it left in the
background (OSWorld waits until they close its output pipes); every child runs in a session of
its own and a time limit kills its whole process group; ``/execute`` takes an optional
``timeout`` (seconds the caller waits) and ends the command by then when that comes before its
own limit, so a command its caller gave up on does not run on; ``/run_python`` runs the
server's own interpreter (the one with pyautogui); children get an allowlisted environment, not
the server's; the recording is per server, not ``/tmp/recording.mp4``.

Plain pyautogui actions (the code OSWorld's client posts for the agent's clicks, keys and
typing, ``cua_rollout.desktop.actions.plain_action``) run in one warm interpreter instead of a new
process
each, with the same output, exit status and time limit; ``--no-warm-actions`` (or
``$CUA_DESKTOP_WARM_ACTIONS=0``) runs every command in a fresh process. ``GET /actions`` (not
in OSWorld) counts how commands ran. A press on a window other than the active one activates
it (``cua_rollout.desktop.click_focus``; ``--no-click-focus`` turns that off).

Not in OSWorld, for resets: ``GET /apps`` lists the live processes the server started (apps of
``/setup/launch`` and ``/setup/open_file``, commands still running and whatever commands left
running, found by session id); ``POST /apps/kill`` ends them all (SIGTERM, SIGKILL after a
grace) and answers ``{killed: [pids], remaining: [pids]}``.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import hmac
import os
import platform
from collections.abc import AsyncIterator, Awaitable, Callable, MutableMapping
from dataclasses import replace
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from cua_rollout.desktop.errors import RequestBodyError
from cua_rollout.desktop.processes import WARM_ACTIONS_VAR
from cua_rollout.desktop.protocol import ErrorReply, MessageReply, Paths
from cua_rollout.desktop.routes import ROUTERS
from cua_rollout.desktop.routes.common import body_error_reply, json_reply
from cua_rollout.desktop.state import ServerSettings, open_state

__all__ = ["ServerSettings", "create_app", "main"]

Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]


class _BearerAuth:
    """Answers 401 to every request without ``Authorization: Bearer <token>``: the server's
    token, or the lease token its holder installed (``POST /lease_token``, which only the
    server's own token reaches)."""

    def __init__(self, app: Callable[[Scope, Receive, Send], Awaitable[None]], token: str) -> None:
        self.app = app
        self._expected = f"Bearer {token}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            got = b""
            for name, value in scope["headers"]:
                if name == b"authorization":
                    got = value
                    break
            allowed = hmac.compare_digest(got, self._expected)
            if not allowed and scope["path"] != Paths.LEASE_TOKEN:
                state = getattr(scope["app"].state, "desktop", None)
                lease = state.lease_token if state is not None else None
                allowed = lease is not None and hmac.compare_digest(
                    got, f"Bearer {lease}".encode())
            if not allowed:
                await _unauthorized(scope, receive, send)
                return
        await self.app(scope, receive, send)


async def _unauthorized(scope: Scope, receive: Receive, send: Send) -> None:
    response = JSONResponse(
        ErrorReply(error="missing or wrong bearer token").model_dump(),
        status_code=401,
        headers={"WWW-Authenticate": "Bearer"},
    )
    await response(scope, receive, send)


async def _crash_reply(request: Request, exc: Exception) -> Response:
    # Still a 500, as OSWorld's server answers an unexpected error, but one that says why.
    return json_reply(MessageReply(status="error", message=f"{type(exc).__name__}: {exc}"), 500)


def create_app(settings: ServerSettings | None = None) -> FastAPI:
    """The desktop server's ASGI app for the display in ``$DISPLAY`` (the display is opened
    when the app starts serving, not here)."""
    settings = settings or ServerSettings()

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        async with open_state(settings) as state:
            # What routes receive (cua_rollout.desktop.routes.common.State).
            app.state.desktop = state
            yield

    app = FastAPI(
        title="desktop server",
        lifespan=lifespan,
        docs_url=None,
        redoc_url=None,
        openapi_url=None,
    )
    if settings.token:
        app.add_middleware(_BearerAuth, token=settings.token)
    app.add_exception_handler(RequestBodyError, body_error_reply)
    app.add_exception_handler(Exception, _crash_reply)
    for router in ROUTERS:
        app.include_router(router)
    return app


# ---------------------------------------------------------------------- CLI


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m cua_rollout.desktop.server",
        description="OSWorld-compatible desktop server for the X display in $DISPLAY. It runs "
        "any command it is sent: use it only on an isolated machine, container or pod.",
        epilog="What it starts gets only the allowlisted part of its environment "
        "(cua_rollout.desktop.processes.CHILD_ENV_ALLOW); $CUA_DESKTOP_ENV_ALLOW adds names, "
        "comma- or "
        "space-separated, NAME* for a prefix (e.g. 'http_proxy,https_proxy,no_proxy').",
    )
    d = ServerSettings()
    p.add_argument("--host", default="127.0.0.1", help="bind address (default: loopback)")
    p.add_argument("--port", type=int, default=5000, help="port (OSWorld's: 5000)")
    p.add_argument(
        "--token-env",
        metavar="NAME",
        help="environment variable holding the bearer token every request must carry "
        "(removed from the environment once read, so no child inherits it)",
    )
    for name, help_text in (
        ("execute_timeout_s", "time limit of /execute"),
        ("run_python_timeout_s", "time limit of /run_python"),
        ("bash_default_timeout_s", "default time limit of /run_bash_script"),
        ("open_file_timeout_s", "how long /setup/open_file waits for the window"),
        ("download_timeout_s", "deadline of one download attempt"),
        ("a11y_timeout_s", "deadline of one accessibility-tree dump"),
        ("kill_grace_s", "SIGTERM-to-SIGKILL grace of /apps/kill"),
    ):
        p.add_argument(
            "--" + name.replace("_", "-"),
            type=float,
            default=getattr(d, name),
            help=f"{help_text} (default: %(default)s)",
        )
    p.add_argument(
        "--warm-actions",
        action=argparse.BooleanOptionalAction,
        default=_env_flag(WARM_ACTIONS_VAR, d.warm_actions),
        help="run plain pyautogui actions of /execute in one warm interpreter instead of a new "
        f"process each (default: ${WARM_ACTIONS_VAR}, else on)",
    )
    p.add_argument(
        "--click-focus",
        action=argparse.BooleanOptionalAction,
        default=d.click_focus,
        help="activate the window a button press lands on when another is active (the "
        "click-to-focus the desktops' openbox configuration leaves out; default: on)",
    )
    p.add_argument("--a11y-python", default=d.a11y_python, help="interpreter with pyatspi")
    p.add_argument("--record-fps", type=int, default=d.record_fps, help="recording frame rate")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    p.add_argument("--access-log", action="store_true", help="log every request")
    return p


def _env_flag(name: str, default: bool) -> bool:
    """A yes/no setting from ``$name`` (0, false, no, off: no); ``default`` when unset."""
    value = os.environ.get(name, "").strip().lower()
    if not value:
        return default
    return value not in ("0", "false", "no", "off")


def _take_secret(name: str) -> str | None:
    """The value of ``$name``, removed from this process's environment: from ``os.environ``,
    so that no child inherits it, and from the block the kernel shows in
    ``/proc/<pid>/environ``, which any process of the same user (whatever the model runs)
    could read otherwise: ``unsetenv`` drops only the pointer to the string, not the string.
    """
    value = os.environ.get(name)
    if value is None:
        return None
    prefix = f"{name}=".encode()
    # The C environ array; at start-up its strings are that block, which is overwritten here.
    environ = ctypes.POINTER(ctypes.c_void_p).in_dll(ctypes.CDLL(None), "environ")
    i = 0
    while (address := environ[i]) is not None:
        entry = ctypes.string_at(address)
        if entry.startswith(prefix):
            ctypes.memset(address + len(prefix), 0, len(entry) - len(prefix))
        i += 1
    del os.environ[name]
    return value


# glibc's mallopt parameters, and the values the server sets (see _keep_screen_buffers).
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_MMAP_THRESHOLD_BYTES = 64 << 20
_TRIM_THRESHOLD_BYTES = 128 << 20


def _keep_screen_buffers() -> bool:
    """Let this process reuse the memory of a screenshot's buffers (~30 MB for 1920x1080:
    the grab, Pillow's image, the RGB and scanline copies) instead of asking the kernel for
    fresh zeroed pages every time. glibc serves such large blocks with mmap and gives them
    back on free, and in the server's X thread its dynamic threshold did not take over: a
    1920x1080 screenshot cost 28 ms of CPU, 17 of them in the kernel's page faults, and 10 ms
    with these settings (benchmarks/bench_screenshot.py). Only this process: children do not
    inherit it (environment variables would). False where the C library is not glibc."""
    if platform.libc_ver()[0] != "glibc":
        return False
    try:
        libc = ctypes.CDLL(None)
        return bool(libc.mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD_BYTES)) and bool(
            libc.mallopt(_M_TRIM_THRESHOLD, _TRIM_THRESHOLD_BYTES))
    except (OSError, AttributeError):
        return False


def main(argv: list[str] | None = None) -> None:
    args = _parser().parse_args(argv)
    _keep_screen_buffers()
    token = None
    if args.token_env:
        token = _take_secret(args.token_env)
        if not token:
            _parser().error(f"--token-env names ${args.token_env}, which is not set")
    if not os.environ.get("DISPLAY"):
        _parser().error("DISPLAY is not set: the server serves the X display named in it")
    settings = replace(
        ServerSettings(),
        token=token,
        **{
            name: getattr(args, name)
            for name in (
                "execute_timeout_s",
                "run_python_timeout_s",
                "bash_default_timeout_s",
                "open_file_timeout_s",
                "download_timeout_s",
                "a11y_timeout_s",
                "kill_grace_s",
                "a11y_python",
                "record_fps",
                "warm_actions",
                "click_focus",
            )
        },
    )
    uvicorn.run(
        create_app(settings),
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        access_log=args.access_log,
        timeout_graceful_shutdown=5,
        # Not uvloop (uvicorn's "auto" when it is installed): its connect_read_pipe and
        # connect_write_pipe close their descriptor twice (uvloop issue 763), and the action
        # worker's pipes (actions.py) would then close, now and then, a descriptor another
        # thread just opened (a screenshot, a file). HTTP parsing stays httptools.
        loop="asyncio",
    )


if __name__ == "__main__":
    main()
