"""Child processes of the desktop server: the environment they get, commands run with
captured output and a time limit without blocking the event loop, and the register of what the
server started, so that a reset can end it (found by session id, never by name).

Every child starts in a session of its own (``start_new_session``): its session id is its pid,
and whatever it leaves running in the background keeps that id even after being re-parented.

Children get an allowlisted environment (``CHILD_ENV_ALLOW``), never the server's own: what a
child can read, the model can print (``env`` typed into a terminal lands in screenshots and in
the requests sent to the model), and the server's environment may hold its bearer token, the
image's credentials or, on a local desktop, the controller's API keys.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

from cua_rollout.desktop.errors import CommandTimeout

__all__ = [
    "APPS_DIR",
    "CHILD_ENV_ALLOW",
    "DESKTOP_ID_VAR",
    "ENV_ALLOW_VAR",
    "MAX_OUTPUT_BYTES",
    "PIPE_GRACE_S",
    "WARM_ACTIONS_VAR",
    "AppTracker",
    "Completed",
    "allowed_env",
    "child_env",
    "group_alive",
    "output_tail",
    "run_captured",
    "wait_exit",
]

DESKTOP_ID_VAR = "CUA_DESKTOP_ID"
"""The tag every process of a local desktop carries (``cua_rollout/envs/local_session.py``): its
reset kills the desktop's apps by it, so children must keep it."""
APPS_DIR = Path(__file__).resolve().parent / "apps"
"""Commands OSWorld's tasks expect that a desktop may lack under that name (``google-chrome``
on a desktop with Chromium): second on children's PATH, after the server's interpreter."""
ENV_ALLOW_VAR = "CUA_DESKTOP_ENV_ALLOW"
"""Names to add to ``CHILD_ENV_ALLOW`` for an image whose apps need more (e.g.
``http_proxy,https_proxy,no_proxy``), separated by commas or spaces; ``NAME*`` is a prefix.
It is read from the server's environment (a local desktop passes on the controller's)."""
WARM_ACTIONS_VAR = "CUA_DESKTOP_WARM_ACTIONS"
"""``0`` (or false, no, off) turns off the server's warm interpreter of actions
(``cua_rollout.desktop.actions``) where its command line does not say (``--[no-]warm-actions``); on
the
allowlist, so a local desktop's server gets it from the controller's environment."""
CHILD_ENV_ALLOW: tuple[str, ...] = (
    # the X display, the user, the shell, locale and time zone
    "DISPLAY", "XAUTHORITY", "HOME", "USER", "LOGNAME", "SHELL", "PATH", "TERM", "TZ",
    "LANG", "LANGUAGE", "LC_*",
    # the session: XDG directories, the session bus, temporary files (a local desktop's own)
    "XDG_*", "DBUS_SESSION_BUS_ADDRESS", "TMPDIR",
    # accessibility, which /accessibility and /terminal read from the apps
    "AT_SPI_BUS_ADDRESS", "NO_AT_BRIDGE", "GTK_MODULES", "GNOME_ACCESSIBILITY",
    "QT_ACCESSIBILITY", "QT_LINUX_ACCESSIBILITY_ALWAYS_ON",
    DESKTOP_ID_VAR,
    "CUA_CHROMIUM_PORT",  # where desktop/apps/google-chrome puts DevTools (protocol.py)
    "CUA_VLC_PORT",  # where desktop/apps/vlc opens VLC's HTTP interface (protocol.py)
    ENV_ALLOW_VAR,  # travels with the environment it shapes (a local desktop's server)
    WARM_ACTIONS_VAR,  # likewise: a local desktop's server reads it
)  # fmt: skip
"""The variables children of the desktop (and of a local desktop's launcher) inherit; a name
ending in ``*`` is a prefix. Everything else, tokens and API keys included, is dropped.
PYTHONPATH is not on it: ``python`` is the server's interpreter, which has pyautogui."""

# After a command exits, how long its output pipes may stay open (held by something it left in
# the background) before the answer goes out without waiting for their end.
PIPE_GRACE_S = 0.1
# Most output kept per stream; the rest is dropped and the text says so.
MAX_OUTPUT_BYTES = 16 * 1024 * 1024
# How often to look at a child's state where the kernel has no pidfd (Linux < 5.3), and at
# killed processes until they are gone.
_POLL_INTERVAL_S = 0.02
_READ_CHUNK_BYTES = 65536
# Most characters of a command's stderr quoted in an error message (its end).
_TAIL_CHARS = 2000


@dataclass(frozen=True)
class Completed:
    """What a finished command left: exit status and captured output (bytes)."""

    returncode: int
    stdout: bytes
    stderr: bytes

    @property
    def stdout_text(self) -> str:
        return self.stdout.decode("utf-8", "replace")

    @property
    def stderr_text(self) -> str:
        return self.stderr.decode("utf-8", "replace")


def allowed_env(environ: Mapping[str, str]) -> dict[str, str]:
    """The variables of ``environ`` on ``CHILD_ENV_ALLOW``, with the additions that
    ``environ`` names in ``ENV_ALLOW_VAR``."""
    extra = environ.get(ENV_ALLOW_VAR, "").replace(",", " ").split()
    names = {n for n in (*CHILD_ENV_ALLOW, *extra) if not n.endswith("*")}
    prefixes = tuple(n[:-1] for n in (*CHILD_ENV_ALLOW, *extra) if n.endswith("*"))
    return {k: v for k, v in environ.items() if k in names or k.startswith(prefixes)}


def child_env(base: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment of every child: the allowlisted part of the server's
    (``allowed_env``), with the directory of the server's own interpreter first on PATH so
    that ``python`` is one that has pyautogui (OSWorld's client posts
    ``["python", "-c", "import pyautogui; ..."]``)."""
    env = allowed_env(os.environ if base is None else base)
    bin_dir = str(Path(sys.executable).parent)
    ours = [bin_dir, str(APPS_DIR)]
    rest = [p for p in env.get("PATH", os.defpath).split(os.pathsep) if p and p not in ours]
    env["PATH"] = os.pathsep.join([*ours, *rest])
    return env


def output_tail(data: bytes) -> str:
    """The end of a command's output as text, for an error message."""
    return data.decode("utf-8", "replace")[-_TAIL_CHARS:].strip()


# ---------------------------------------------------------------------- waiting for an exit


async def wait_exit(proc: subprocess.Popen[bytes], timeout_s: float | None = None) -> int:
    """Wait (without a thread) until ``proc`` exits and reap it; return its exit status.

    Raises ``TimeoutError`` when ``timeout_s`` passes first (the process is left running).
    """
    if proc.poll() is not None:
        return proc.returncode
    return await asyncio.wait_for(_exited(proc), timeout_s)


async def _exited(proc: subprocess.Popen[bytes]) -> int:
    loop = asyncio.get_running_loop()
    try:
        pidfd = os.pidfd_open(proc.pid)
    except (AttributeError, OSError):  # no pidfd (old kernel) or already reaped
        while proc.poll() is None:
            await asyncio.sleep(_POLL_INTERVAL_S)
        return proc.returncode
    done: asyncio.Future[None] = loop.create_future()

    def on_exit() -> None:
        if not done.done():
            done.set_result(None)

    loop.add_reader(pidfd, on_exit)
    try:
        if proc.poll() is None:
            await done
    finally:
        loop.remove_reader(pidfd)
        os.close(pidfd)
    return proc.wait()  # readable pidfd: the process has exited, so this only reaps it


def _kill_group(pgid: int, sig: int = signal.SIGKILL) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


def group_alive(pgid: int) -> bool:
    """Whether any process is left in process group ``pgid``."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


# ---------------------------------------------------------------------- captured commands


class _PipeReader:
    """Reads one pipe through the event loop; after ``detach()`` it keeps reading (and drops
    what it reads) until the end, so a background writer never gets SIGPIPE from us."""

    def __init__(self, pipe: Any, loop: asyncio.AbstractEventLoop) -> None:
        self._pipe = pipe
        self._fd: int = pipe.fileno()
        self._loop = loop
        self._chunks: list[bytes] = []
        self._size = 0
        self._truncated = False
        self._keep = True
        self.eof: asyncio.Future[None] = loop.create_future()
        os.set_blocking(self._fd, False)
        loop.add_reader(self._fd, self._on_readable)

    def _on_readable(self) -> None:
        try:
            data = os.read(self._fd, _READ_CHUNK_BYTES)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:
            self._close()
            return
        if self._keep:
            room = MAX_OUTPUT_BYTES - self._size
            if len(data) > room:
                data, self._truncated = data[:room], True
            self._chunks.append(data)
            self._size += len(data)

    def _close(self) -> None:
        self._loop.remove_reader(self._fd)
        self._pipe.close()
        if not self.eof.done():
            self.eof.set_result(None)

    def drain(self) -> None:
        """Read whatever is buffered now, without waiting."""
        while not self.eof.done():
            before = self._size, len(self._chunks)
            self._on_readable()
            if (self._size, len(self._chunks)) == before and not self.eof.done():
                return

    def detach(self) -> bytes:
        """Stop collecting and return what was collected; keep draining in the background."""
        self.drain()
        self._keep = False
        data = b"".join(self._chunks)
        self._chunks = []
        if self._truncated:
            data += b"\n[output truncated]\n"
        return data

    def close_now(self) -> None:
        if not self.eof.done():
            self._close()


async def run_captured(
    argv: Sequence[str] | str,
    *,
    timeout_s: float,
    shell: bool = False,
    env: Mapping[str, str] | None = None,
    cwd: str | os.PathLike[str] | None = None,
    merge_stderr: bool = False,
    tracker: AppTracker | None = None,
    source: str = "execute",
) -> Completed:
    """Run a command like ``subprocess.run(capture_output=True, timeout=...)``, but on the
    event loop, and answer as soon as the command itself exits.

    On timeout (or cancellation) the command's whole process group is killed and
    ``CommandTimeout`` is raised. The command is registered with ``tracker`` from its start,
    so that a reset ends it even while it runs (its caller may have given up on it), and
    stays there while it leaves processes running in the background. Errors starting the
    command (``FileNotFoundError`` ...) propagate.
    """
    loop = asyncio.get_running_loop()
    proc = subprocess.Popen(
        argv,
        shell=shell,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT if merge_stderr else subprocess.PIPE,
        env=None if env is None else dict(env),
        cwd=cwd,
        start_new_session=True,
    )
    if tracker is not None:
        tracker.track(proc, argv, source)
    readers = [_PipeReader(p, loop) for p in (proc.stdout, proc.stderr) if p is not None]
    try:
        try:
            returncode = await wait_exit(proc, timeout_s)
        except TimeoutError:
            _kill_group(proc.pid)
            await wait_exit(proc)
            raise CommandTimeout(argv, timeout_s) from None
        pending = [r.eof for r in readers if not r.eof.done()]
        if pending:
            await asyncio.wait(pending, timeout=PIPE_GRACE_S)
        out = [r.detach() for r in readers]
    except BaseException:
        _kill_group(proc.pid)
        for r in readers:
            r.close_now()
        if proc.poll() is None:
            await asyncio.shield(wait_exit(proc))  # SIGKILLed: this returns at once
        raise
    if tracker is not None and not group_alive(proc.pid):
        tracker.forget(proc.pid)  # nothing left behind to end
    return Completed(returncode, out[0], out[1] if len(out) > 1 else b"")


# ---------------------------------------------------------------------- what the server started


@dataclass
class _Session:
    argv: Sequence[str] | str
    source: str
    started_s: float
    proc: subprocess.Popen[bytes] | None = None
    reaper: asyncio.Task[int] | None = field(default=None, repr=False)


class AppTracker:
    """The sessions of the processes the server started (apps from ``/setup/launch`` and
    ``/setup/open_file``, commands while they run and whatever they left running), so a reset
    can end them all.

    Membership is by session id, so an app that a launcher script started and left behind is
    still found after its parent exited; nothing is ever looked up by name.
    """

    def __init__(self) -> None:
        self._sessions: dict[int, _Session] = {}

    def launch(
        self,
        argv: Sequence[str] | str,
        *,
        shell: bool = False,
        env: Mapping[str, str] | None = None,
        source: str = "launch",
    ) -> subprocess.Popen[bytes]:
        """Start a long-running app in a new session and keep track of it (must run on the
        event loop: the app is reaped by it when it exits)."""
        proc = subprocess.Popen(
            argv,
            shell=shell,
            stdin=subprocess.DEVNULL,
            env=None if env is None else dict(env),
            start_new_session=True,
        )
        session = _Session(argv, source, time.time(), proc)
        # Reap the app the moment it exits, so no zombie lingers until the next reset.
        session.reaper = asyncio.get_running_loop().create_task(wait_exit(proc))
        self._sessions[proc.pid] = session
        return proc

    def track(self, proc: subprocess.Popen[bytes], argv: Sequence[str] | str, source: str) -> None:
        """Track the session of a command that runs to its end; whoever started it waits for
        it (and so reaps it)."""
        self._sessions[proc.pid] = _Session(argv, source, time.time(), proc)

    def forget(self, sid: int) -> None:
        """Stop tracking a session that has nothing left running."""
        self._sessions.pop(sid, None)

    def processes(self) -> list[psutil.Process]:
        """Live processes of the tracked sessions; sessions with none left are forgotten."""
        # Safe to call from a worker thread: only sessions known before the scan are pruned,
        # so one registered meanwhile by the event loop is never dropped unseen.
        known = set(self._sessions)
        if not known:
            return []
        me = os.getpid()
        found: list[psutil.Process] = []
        seen: set[int] = set()
        for p in psutil.process_iter(["status"]):
            if p.pid == me or p.info["status"] == psutil.STATUS_ZOMBIE:
                continue
            try:
                sid = os.getsid(p.pid)
            except OSError:
                continue
            if sid in known:
                found.append(p)
                seen.add(sid)
        for sid in known - seen:
            session = self._sessions.get(sid)
            leader = session.proc if session is not None else None
            if leader is None or leader.poll() is not None:
                self._sessions.pop(sid, None)
        return found

    def describe(self) -> list[dict[str, Any]]:
        """What ``GET /apps`` shows: one entry per live process."""
        entries = []
        for p in self.processes():
            with contextlib.suppress(psutil.Error):
                sid = os.getsid(p.pid)
                session = self._sessions.get(sid)
                entries.append(
                    {
                        "pid": p.pid,
                        "sid": sid,
                        "name": p.name(),
                        "cmdline": p.cmdline(),
                        "source": session.source if session else "",
                        "started_at": p.create_time(),
                    }
                )
        return entries

    async def kill_all(self, grace_s: float) -> dict[str, list[int]]:
        """End every tracked process: SIGTERM, then SIGKILL for those still alive after
        ``grace_s``. Returns the pids ended and those that survived even SIGKILL."""
        procs = await asyncio.to_thread(self.processes)
        for p in procs:
            with contextlib.suppress(psutil.Error):
                p.terminate()
        alive = await asyncio.to_thread(_still_running, procs, grace_s)
        for p in alive:
            with contextlib.suppress(psutil.Error):
                p.kill()
        survivors = await asyncio.to_thread(_still_running, alive, grace_s)
        reapers = [s.reaper for s in list(self._sessions.values()) if s.reaper is not None]
        if pending := [r for r in reapers if not r.done()]:
            await asyncio.wait(pending, timeout=grace_s)  # launched apps reaped: no zombies
        await asyncio.to_thread(self.processes)  # forget sessions that are now empty
        gone = sorted({p.pid for p in procs} - {p.pid for p in survivors})
        return {"killed": gone, "remaining": sorted(p.pid for p in survivors)}


def _still_running(procs: list[psutil.Process], timeout_s: float) -> list[psutil.Process]:
    """Those of ``procs`` still running after up to ``timeout_s`` (a zombie has ended).

    Nothing is reaped here (``psutil.wait_procs`` would reap the server's own children):
    whoever started a child reaps it, so a command's caller still learns its real exit
    status (killed by a signal) instead of the 0 that ``Popen`` reports for a child reaped
    behind its back.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        alive = []
        for p in procs:
            with contextlib.suppress(psutil.NoSuchProcess):
                if p.status() != psutil.STATUS_ZOMBIE:
                    alive.append(p)
        if not alive or time.monotonic() >= deadline:
            return alive
        time.sleep(_POLL_INTERVAL_S)
