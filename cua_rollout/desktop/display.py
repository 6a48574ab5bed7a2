"""An X display for one desktop: the Xvfb server and, if asked, a window manager on it.

``XvfbDisplay`` owns exactly the processes it starts; it stops them by pid and never by name,
and hands out the environment X clients need to reach the display.
"""

from __future__ import annotations

import contextlib
import os
import select
import shutil
import struct
import subprocess
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

from cua_rollout.desktop.errors import DisplayError

__all__ = ["XvfbDisplay", "terminate_process", "write_placeholder_xauthority"]

# How often to look again while waiting for the window manager to announce itself.
_POLL_INTERVAL_S = 0.02
# How much of the head and of the tail of a failed process's log goes into the error.
_LOG_TAIL_BYTES = 800
# With min_display: how many display numbers to try, and what Xvfb says when one is in use.
_DISPLAY_ATTEMPTS = 100
_TAKEN_MARKERS = ("Server is already active", "Cannot establish any listening sockets")
# The locale X clients get when the caller's is not UTF-8: xdotool refuses multi-byte
# text ("Invalid multi-byte sequence") without one, and Debian always ships C.UTF-8.
_UTF8_LOCALE = "C.UTF-8"


class _DisplayTaken(Exception):
    """Xvfb exited because another server holds the display number it was given."""


class XvfbDisplay:
    """A virtual X screen of ``width`` x ``height`` pixels, optionally with a window manager.

    Use as a context manager, or call ``start()`` and ``stop()``. ``start()`` lets Xvfb pick
    the lowest free display number (``-displayfd``), or with ``min_display`` the first free
    one from there on, and returns once the server accepts clients (and the window manager,
    if any, has claimed the screen); it raises ``DisplayError`` naming what failed otherwise.
    ``stop()`` is idempotent.
    """

    def __init__(
        self,
        width: int = 1280,
        height: int = 800,
        depth: int = 24,
        *,
        window_manager: str | Sequence[str] | None = None,
        start_timeout_s: float = 10.0,
        stop_timeout_s: float = 5.0,
        min_display: int | None = None,
        xvfb: str = "Xvfb",
        xvfb_args: Sequence[str] = (),
        tmp_dir: Path | None = None,
        base_env: Mapping[str, str] | None = None,
    ) -> None:
        if width <= 0 or height <= 0:
            raise ValueError(f"screen size must be positive, got {width}x{height}")
        self.width = width
        self.height = height
        self.depth = depth
        if isinstance(window_manager, str):
            window_manager = [window_manager]
        self.window_manager: list[str] | None = list(window_manager) if window_manager else None
        self.start_timeout_s = start_timeout_s
        self.stop_timeout_s = stop_timeout_s
        self.min_display = min_display
        self.xvfb = xvfb
        self.xvfb_args = list(xvfb_args)
        self.tmp_dir = tmp_dir  # where the logs/authority workdir goes (None: the system's)
        # The environment Xvfb, the window manager and X clients start from (None: ours).
        # A local desktop passes an allowlisted one: secrets of the process that starts
        # desktops must not reach processes the agent can inspect.
        self.base_env = dict(base_env) if base_env is not None else None
        self._display: str | None = None
        self._xvfb: subprocess.Popen[bytes] | None = None
        self._wm: subprocess.Popen[bytes] | None = None
        self._workdir: Path | None = None

    # ------------------------------------------------------------------ public surface

    @property
    def display(self) -> str:
        """The display name, e.g. ``":57"``."""
        if self._display is None:
            raise DisplayError("the Xvfb display is not started")
        return self._display

    @property
    def pid(self) -> int | None:
        """The pid of the Xvfb server, or None when not started."""
        return self._xvfb.pid if self._xvfb is not None else None

    @property
    def wm_pid(self) -> int | None:
        """The pid of the window manager, or None when there is none."""
        return self._wm.pid if self._wm is not None else None

    @property
    def running(self) -> bool:
        """Whether every process this display started is still alive."""
        procs = [p for p in (self._xvfb, self._wm) if p is not None]
        return bool(procs) and all(p.poll() is None for p in procs)

    def env(self, base: Mapping[str, str] | None = None) -> dict[str, str]:
        """The environment for X clients of this display: ``base`` (default: ``base_env``,
        else ``os.environ``) with ``DISPLAY`` set, an X authority file that exists, and a
        UTF-8 locale."""
        env = dict(base if base is not None else self.base_env if self.base_env is not None
                   else os.environ)
        env["DISPLAY"] = self.display
        # python3-xlib (pulled in by pyautogui) refuses to connect when the authority file
        # is missing, even though this server needs no cookie; an empty file satisfies it.
        authority = env.get("XAUTHORITY") or (
            str(Path(env["HOME"]) / ".Xauthority") if env.get("HOME") else ""
        )
        if not authority or not Path(authority).is_file():
            assert self._workdir is not None
            env["XAUTHORITY"] = str(self._workdir / "Xauthority")
        _ensure_utf8_locale(env)
        return env

    def start(self) -> XvfbDisplay:
        """Start Xvfb (and the window manager); return self once they are ready."""
        if self._xvfb is not None:
            raise DisplayError(f"Xvfb display {self._display} is already started")
        try:
            self._workdir = Path(tempfile.mkdtemp(prefix="xvfb-", dir=self.tmp_dir))
            write_placeholder_xauthority(self._workdir / "Xauthority")
            deadline = time.monotonic() + self.start_timeout_s
            self._display = self._start_xvfb(deadline)
            if self.window_manager:
                self._start_window_manager(deadline)
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        """Stop what ``start()`` started, newest first: terminate, wait, then kill."""
        for attr in ("_wm", "_xvfb"):
            proc: subprocess.Popen[bytes] | None = getattr(self, attr)
            if proc is not None:
                terminate_process(proc, self.stop_timeout_s)
                setattr(self, attr, None)
        if self._workdir is not None:
            shutil.rmtree(self._workdir, ignore_errors=True)
            self._workdir = None
        self._display = None

    def __enter__(self) -> XvfbDisplay:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def __repr__(self) -> str:
        where = self._display or "not started"
        return f"XvfbDisplay({where}, {self.width}x{self.height}x{self.depth}, pid={self.pid})"

    # ------------------------------------------------------------------ start-up steps

    def _start_xvfb(self, deadline: float) -> str:
        if shutil.which(self.xvfb) is None:
            raise DisplayError(f"{self.xvfb} not found on PATH (Debian package: xvfb)")
        if self.min_display is None:
            return self._launch_xvfb(None, deadline)
        last = self.min_display + _DISPLAY_ATTEMPTS - 1
        for number in range(self.min_display, last + 1):
            try:
                return self._launch_xvfb(number, deadline)
            except _DisplayTaken:
                continue
        raise DisplayError(f"no free X display from :{self.min_display} to :{last}")

    def _launch_xvfb(self, number: int | None, deadline: float) -> str:
        """Run Xvfb on ``number`` (None: the lowest free one); the display it reports."""
        assert self._workdir is not None
        read_fd, write_fd = os.pipe()
        try:
            argv = [
                self.xvfb,
                *([f":{number}"] if number is not None else []),
                # The server writes its display number here once it accepts clients.
                "-displayfd",
                str(write_fd),
                "-screen",
                "0",
                f"{self.width}x{self.height}x{self.depth}",
                "-nolisten",
                "tcp",
                # Without it the server resets whenever its last client leaves, dropping
                # keymap changes and selections between two short-lived clients.
                "-noreset",
                *self.xvfb_args,
            ]
            self._xvfb = _spawn(argv, self._workdir / "xvfb.log", pass_fds=(write_fd,),
                                env=self.base_env)
            os.close(write_fd)
            write_fd = -1
            reported = _read_display_number(read_fd, self._xvfb, deadline)
        except OSError as exc:
            raise DisplayError(f"could not start {self.xvfb}: {exc}") from exc
        finally:
            os.close(read_fd)
            if write_fd >= 0:
                os.close(write_fd)
        if reported is not None:
            return f":{reported}"
        exited = self._xvfb.poll() is not None
        if exited and number is not None and self._log_says_taken():
            self._xvfb = None  # it has exited and been waited for
            raise _DisplayTaken
        problem = (
            "exited during start-up"
            if exited
            else f"reported no display number within {self.start_timeout_s} s"
        )
        raise DisplayError(self._failure("Xvfb", self._xvfb, problem))

    def _log_says_taken(self) -> bool:
        assert self._workdir is not None
        with contextlib.suppress(OSError):
            log = (self._workdir / "xvfb.log").read_text(errors="replace")
            return any(marker in log for marker in _TAKEN_MARKERS)
        return False

    def _start_window_manager(self, deadline: float) -> None:
        assert self.window_manager is not None and self._workdir is not None
        name = self.window_manager[0]
        if shutil.which(name) is None:
            raise DisplayError(f"window manager {name!r} not found on PATH")
        if shutil.which("xprop") is None:
            raise DisplayError("xprop not found on PATH (Debian package: x11-utils)")
        try:
            self._wm = _spawn(self.window_manager, self._workdir / "wm.log", env=self.env())
        except OSError as exc:
            raise DisplayError(f"could not start window manager {name!r}: {exc}") from exc
        # An EWMH window manager announces itself with _NET_SUPPORTING_WM_CHECK on the root
        # window once it manages the screen; windows mapped before that are not managed.
        while True:
            if self._wm.poll() is not None:
                raise DisplayError(self._failure(name, self._wm, "exited during start-up"))
            if self._wm_announced():
                return
            if time.monotonic() >= deadline:
                problem = (
                    f"did not announce itself (_NET_SUPPORTING_WM_CHECK) "
                    f"within {self.start_timeout_s} s"
                )
                raise DisplayError(self._failure(name, self._wm, problem))
            time.sleep(_POLL_INTERVAL_S)

    def _wm_announced(self) -> bool:
        try:
            out = subprocess.run(
                ["xprop", "-root", "_NET_SUPPORTING_WM_CHECK"],
                env=self.env(),
                capture_output=True,
                text=True,
                timeout=max(1.0, self.start_timeout_s),
                check=False,
            )
        except subprocess.TimeoutExpired:
            return False
        return "window id #" in out.stdout

    def _failure(self, what: str, proc: subprocess.Popen[bytes] | None, problem: str) -> str:
        """An error message with the process's exit status and the tail of its log."""
        status = "" if proc is None or proc.poll() is None else f" (exit status {proc.returncode})"
        log = ""
        if self._workdir is not None:
            path = self._workdir / ("xvfb.log" if what == "Xvfb" else "wm.log")
            with contextlib.suppress(OSError):
                raw = path.read_bytes()
                if len(raw) > 2 * _LOG_TAIL_BYTES:  # the cause is usually first, then usage
                    raw = raw[:_LOG_TAIL_BYTES] + b"\n[...]\n" + raw[-_LOG_TAIL_BYTES:]
                log = raw.decode("utf-8", "replace").strip()
        where = f" on {self._display}" if self._display else ""
        return f"{what}{where} {problem}{status}" + (f"; its output:\n{log}" if log else "")


# ---------------------------------------------------------------------- helpers


def write_placeholder_xauthority(path: Path) -> None:
    """An X authority file with one entry for a host that does not exist.

    python-xlib (so pyautogui) refuses to connect when the file is missing and prints a
    warning to stdout, into every command's output, when it is empty. With this entry nothing
    matches, so clients connect without a cookie, as they must to a server that needs none.
    """
    fields = [b"cua-no-such-host", b"0", b"MIT-MAGIC-COOKIE-1", bytes(16)]
    path.write_bytes(
        struct.pack(">H", 256) + b"".join(struct.pack(">H", len(f)) + f for f in fields)
    )


def _spawn(
    argv: Sequence[str],
    log_path: Path,
    *,
    env: Mapping[str, str] | None = None,
    pass_fds: Sequence[int] = (),
) -> subprocess.Popen[bytes]:
    # The log goes to a file, not a pipe: nobody reads a pipe during the run, and a full
    # pipe would block the X server.
    with open(log_path, "wb") as log:
        return subprocess.Popen(
            list(argv),
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=None if env is None else dict(env),
            pass_fds=tuple(pass_fds),
        )


def _read_display_number(
    read_fd: int, proc: subprocess.Popen[bytes], deadline: float
) -> int | None:
    """The number Xvfb writes to its ``-displayfd`` once it accepts clients; None when it
    closes the pipe (exits) or the deadline passes first."""
    data = b""
    while b"\n" not in data:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return None
        ready, _, _ = select.select([read_fd], [], [], remaining)
        if not ready:
            return None
        chunk = os.read(read_fd, 64)
        if not chunk:  # Xvfb closed the pipe: it is exiting; let its status be known
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            return None
        data += chunk
    text = data.split(b"\n", 1)[0].strip()
    return int(text) if text.isdigit() else None


def terminate_process(proc: subprocess.Popen[Any], timeout_s: float) -> None:
    """End a child we started, by pid: SIGTERM, wait up to ``timeout_s``, then SIGKILL;
    close the pipes we hold to it."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    for stream in (proc.stdin, proc.stdout, proc.stderr):
        if stream is not None:
            with contextlib.suppress(OSError):
                stream.close()


def _ensure_utf8_locale(env: dict[str, str]) -> None:
    def is_utf8(value: str) -> bool:
        return "utf-8" in value.lower() or "utf8" in value.lower()

    if env.get("LC_ALL"):
        if not is_utf8(env["LC_ALL"]):
            env["LC_ALL"] = _UTF8_LOCALE
        return
    if not is_utf8(env.get("LC_CTYPE") or env.get("LANG") or ""):
        env["LC_CTYPE"] = _UTF8_LOCALE
