"""One local desktop on the controller's machine, the ``local`` provider's launcher (a
desktop image does not need this module): Xvfb + window manager + its own D-Bus session bus
and AT-SPI, its own HOME, and the desktop server, all tagged so a reset can find its apps.

Every process of a session carries ``CUA_DESKTOP_ID`` in its environment (children inherit
it), so reset kills exactly this desktop's apps, wherever they were started from. Pids are
recorded with their start times in ``<state_dir>/<id>/session.json``, so the desktops of a
crashed run are found and removed at the next start, never by process name.

A session starts from the allowlisted part of the controller's environment
(``cua_rollout.desktop.processes.allowed_env``), never all of it: the controller's holds the
model's API
key, cloud and Hugging Face credentials, and whatever a desktop's process can read, the model
can print. The desktop server alone receives the bearer token, and removes it once read.

**OSWorld's paths.** OSWorld's tasks name the user's files by absolute path: 279 of its 369
tasks write or read ``/home/user/...`` (its VM's user), and some ``/tmp/...``. A local desktop
therefore runs its session bus, AT-SPI and server (and so every app and command they start)
in a mount namespace of its own (``unshare --mount``, as root), where ``/home/user`` is the
desktop's HOME and ``/tmp`` its own temporary directory (the X server's socket directory
bound into it): each desktop sees the paths OSWorld's VM has, none sees another's files, and
nothing a task writes lands in the machine's own ``/home`` or ``/tmp``. HOME is
``/home/user`` there. Where a mount namespace cannot be made (not root, no ``unshare``), the
session runs as before, HOME its own directory, and tasks that name ``/home/user`` cannot be
done there (one warning says so; ``namespaced`` is False).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import select
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil

import cua_rollout.desktop as desktop
from cua_rollout.core.errors import DesktopError
from cua_rollout.core.http import reachable_host
from cua_rollout.desktop.actions import WORKER_FILE
from cua_rollout.desktop.display import XvfbDisplay, terminate_process
from cua_rollout.desktop.errors import DisplayError
from cua_rollout.desktop.processes import DESKTOP_ID_VAR, allowed_env
from cua_rollout.desktop.profile import provision
from cua_rollout.desktop.protocol import CHROMIUM_PORT_VAR, VLC_PORT_VAR

__all__ = ["MARKER", "SESSION_FILE", "LocalDesktopSession", "office_pipe", "sweep_stale_sessions"]

log = logging.getLogger(__name__)

MARKER = DESKTOP_ID_VAR
SESSION_FILE = "session.json"
# The user's HOME on OSWorld's VM, where a namespaced session's HOME is mounted.
OSWORLD_HOME = Path("/home/user")
# The session bus's socket on OSWorld's VM (uid 1000's runtime dir); a task's commands name it.
OSWORLD_RUNTIME = Path("/run/user/1000")
# Run first in a new mount namespace (private propagation: nothing reaches the machine's
# mounts), then exec the command: sh -c _NS_SETUP sh TMP HOME RUNTIME [KEEP...] -- COMMAND...
# TMP (the session's tmp dir) becomes /tmp, with the X server's sockets bound into it; HOME
# becomes /home/user, RUNTIME /run/user/1000; each KEEP (a directory under the machine's /tmp
# the session's processes use: its own directory, the interpreter's, the package's) stays at
# its path.
_NS_SETUP = """set -e
T=$1; H=$2; R=$3; shift 3
while [ "$1" != -- ]; do
  mkdir -p "$T/${1#/tmp/}"; mount --bind "$1" "$T/${1#/tmp/}"; shift
done
shift
mount --bind /tmp/.X11-unix "$T/.X11-unix"
mount --bind "$H" """ + str(OSWORLD_HOME) + """
mount --bind "$R" """ + str(OSWORLD_RUNTIME) + """
mount --rbind "$T" /tmp
exec "$@"
"""
AT_SPI_LAUNCHER = "/usr/libexec/at-spi-bus-launcher"
# Openbox's settings for every desktop: fixed window placement (the demo tasks' reference
# solutions click at fixed coordinates) and no binding a stray scroll or hotkey could trigger.
OPENBOX_RC = Path(desktop.__file__).with_name("openbox-rc.xml")
_HOME_DIRS = ("Desktop", "Documents", "Downloads")
# Variables of the controller's own desktop session, if it runs in one: a local desktop has
# its own bus, accessibility bus, X authority and HOME, and must not reach the controller's.
_CONTROLLER_SESSION_VARS = (
    "DBUS_SESSION_BUS_ADDRESS",
    "AT_SPI_BUS_ADDRESS",
    "XAUTHORITY",
    "XDG_CACHE_HOME",
    "XDG_CONFIG_HOME",
    "XDG_DATA_HOME",
    "XDG_STATE_HOME",
)
_STOP_TIMEOUT_S = 5.0


class LocalDesktopSession:
    """Start, reset and stop one desktop on this machine (blocking calls: run them in a
    thread from async code)."""

    def __init__(
        self,
        desktop_id: str,
        state_dir: Path,
        width: int,
        height: int,
        *,
        window_manager: str = "openbox",
        home_template: Path | None = None,
        token_env: str | None = None,
        start_timeout_s: float = 60.0,
        host: str = "127.0.0.1",
    ) -> None:
        self.id = desktop_id
        self.dir = Path(state_dir).resolve() / desktop_id
        self.home = self.dir / "home"
        self.width, self.height = width, height
        self.window_manager = window_manager
        self.home_template = home_template
        self.token_env = token_env
        self.start_timeout_s = start_timeout_s
        self.host = host  # the server's bind address
        self.display: XvfbDisplay | None = None
        self.url: str | None = None
        self._procs: dict[str, subprocess.Popen[bytes]] = {}
        self._env: dict[str, str] = {}
        self.namespaced = _mount_namespaces_work()
        self._ns_pid: int | None = None  # the first process of the session's mount namespace
        self._tmp_at_start: set[str] = set()  # its /tmp's entries once it was up

    # ----------------------------------------------------------------- lifecycle

    def start(self) -> str:
        """Bring the desktop up; return its server's base URL once it answers."""
        deadline = time.monotonic() + self.start_timeout_s
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            self._restore_home()
            runtime = self.dir / "runtime"
            runtime.mkdir(mode=0o700, exist_ok=True)
            # Everything the session writes to "/tmp" lands in its own dir instead, which the
            # stop and the stale sweep remove even when a process was killed mid-way.
            tmp = self.dir / "tmp"
            tmp.mkdir(exist_ok=True)
            base = allowed_env(os.environ)
            for name in _CONTROLLER_SESSION_VARS:
                base.pop(name, None)
            base.update(
                {
                    MARKER: self.id,
                    "HOME": str(self.home),
                    "XDG_RUNTIME_DIR": str(runtime),
                    "TMPDIR": str(tmp),
                    "NO_AT_BRIDGE": "0",
                }
            )
            wm = self.window_manager
            self.display = XvfbDisplay(
                self.width,
                self.height,
                window_manager=[wm, "--config-file", str(OPENBOX_RC)] if wm == "openbox" else wm,
                tmp_dir=tmp,
                start_timeout_s=max(1.0, deadline - time.monotonic()),
                base_env=base,
            )
            try:
                self.display.start()
            except DisplayError as exc:  # the desktop side's error, in the controller's tree
                raise DesktopError(f"{self.id}: {exc}") from exc
            self._env = self.display.env(base)
            if self.namespaced:
                (tmp / ".X11-unix").mkdir(exist_ok=True)
                for mount_point in (OSWORLD_HOME, OSWORLD_RUNTIME):
                    mount_point.mkdir(parents=True, exist_ok=True)
            self._start_dbus(deadline)
            if os.path.exists(AT_SPI_LAUNCHER):
                self._procs["at-spi"] = self._spawn(
                    "at-spi", [AT_SPI_LAUNCHER, "--launch-immediately"]
                )
            self.url = self._start_server(deadline)
            self._tmp_at_start = set(os.listdir(tmp))
            self._record()
        except BaseException:
            self.stop()
            raise
        return self.url

    def reset(self) -> dict[str, float]:
        """Kill the session's apps, release stuck keys, restore HOME; returns timings."""
        t0 = time.monotonic()
        killed = self.kill_apps()
        t1 = time.monotonic()
        self._restore_home()
        self._restore_tmp()
        t2 = time.monotonic()
        # A previous episode may have left a modifier held (keydown without keyup) and the
        # pointer anywhere; put both back where a fresh desktop has them.
        subprocess.run(
            [
                "xdotool",
                "keyup",
                "shift",
                "ctrl",
                "alt",
                "super",
                "mousemove",
                str(self.width // 2),
                str(self.height // 2),
            ],
            env=self._env,
            capture_output=True,
            timeout=10,
            check=False,
        )
        return {
            "kill_s": t1 - t0,
            "home_s": t2 - t1,
            "input_s": time.monotonic() - t2,
            "killed": float(killed),
        }

    def stop(self) -> None:
        """Stop everything this session started (apps, server, buses, WM, Xvfb)."""
        with contextlib.suppress(Exception):
            self.kill_apps()
        for name in reversed(list(self._procs)):
            terminate_process(self._procs.pop(name), _STOP_TIMEOUT_S)
        if self.display is not None:
            self.display.stop()
            self.display = None
        with contextlib.suppress(OSError):
            (self.dir / SESSION_FILE).unlink()
        shutil.rmtree(self.dir, ignore_errors=True)

    @property
    def desktop_home(self) -> Path:
        """HOME as the desktop's processes name it (``home`` is where it is on this
        machine)."""
        return OSWORLD_HOME if self.namespaced else self.home

    def alive(self) -> bool:
        """Whether every core process of the session still runs."""
        return (
            self.display is not None
            and self.display.running
            and all(p.poll() is None for p in self._procs.values())
        )

    def core_pids(self) -> set[int]:
        pids = {p.pid for p in self._procs.values()}
        if self.display is not None:
            pids |= {pid for pid in (self.display.pid, self.display.wm_pid) if pid}
        return pids

    def kill_apps(self) -> int:
        """Kill every process tagged with this desktop's id that is not part of the session
        itself: apps launched by tasks or actions, their children, clipboard owners.

        The session's own machinery (Xvfb, window manager, buses, AT-SPI and whatever those
        spawned, such as the accessibility registry) is kept; the server's children are not.
        """
        protected = self.core_pids() | {os.getpid()}
        server = self._procs.get("server")
        for pid in self.core_pids() - ({server.pid} if server else set()):
            with contextlib.suppress(psutil.Error):
                protected |= {c.pid for c in psutil.Process(pid).children(recursive=True)}
        if server is not None:  # the server's warm action interpreter is machinery too
            with contextlib.suppress(psutil.Error):
                protected |= {c.pid for c in psutil.Process(server.pid).children()
                              if str(WORKER_FILE) in c.cmdline()}
        victims = []
        for proc in psutil.process_iter(["pid"]):
            if proc.pid in protected:
                continue
            try:
                if proc.environ().get(MARKER) == self.id:
                    victims.append(proc)
            except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                continue
        # Chromium overwrites its own environment (its process titles take that memory), so
        # the tag cannot be read from it: what the server launched is found as its
        # descendants, and what tagged processes started as theirs.
        seen = {p.pid for p in victims}
        roots = [p.pid for p in victims] + ([server.pid] if server else [])
        for root in roots:
            with contextlib.suppress(psutil.Error):
                for child in psutil.Process(root).children(recursive=True):
                    if child.pid not in protected and child.pid not in seen:
                        seen.add(child.pid)
                        victims.append(child)
        for proc in victims:
            with contextlib.suppress(psutil.NoSuchProcess):
                proc.kill()
        _wait_dead(victims, _STOP_TIMEOUT_S)
        with contextlib.suppress(OSError):  # a killed LibreOffice leaves its socket behind
            self._office_pipe().unlink()
        return len(victims)

    def _office_pipe(self) -> Path:
        """Where this session's LibreOffice leaves its socket, on the machine's side."""
        if not self.namespaced:
            return office_pipe(self.home)
        pipe = office_pipe(OSWORLD_HOME)  # in the namespace's /tmp: the session's tmp dir
        return self.dir / "tmp" / pipe.relative_to("/tmp")

    # ----------------------------------------------------------------- parts

    def _restore_home(self) -> None:
        # Emptied in place, not replaced: the server's working directory is HOME.
        self.home.mkdir(parents=True, exist_ok=True)
        for entry in list(self.home.iterdir()):
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry)
            else:
                entry.unlink()
        if self.home_template is not None:
            shutil.copytree(self.home_template, self.home, symlinks=True, dirs_exist_ok=True)
        for name in _HOME_DIRS:
            (self.home / name).mkdir(exist_ok=True)
        provision(self.home)  # the desktop profile: apps start as on OSWorld's image

    def _restore_tmp(self) -> None:
        """Remove what the last episode left in the session's /tmp (its apps are dead by
        now), as OSWorld's snapshot revert does; the session's own entries stay."""
        tmp = self.dir / "tmp"
        with contextlib.suppress(FileNotFoundError):
            for name in set(os.listdir(tmp)) - self._tmp_at_start:
                entry = tmp / name
                if entry.is_dir() and not entry.is_symlink():
                    shutil.rmtree(entry, ignore_errors=True)
                else:
                    with contextlib.suppress(FileNotFoundError):
                        entry.unlink()

    def _spawn(self, name: str, argv: list[str], **kw: object) -> subprocess.Popen[bytes]:
        """Start one process of the session: in its mount namespace when it has one (the
        first such process makes it; the others enter it: ``nsenter`` execs in place, so
        the pid is the command's)."""
        env = dict(kw.pop("env", self._env))  # type: ignore[call-overload]
        if self.namespaced:
            env.update(HOME=str(OSWORLD_HOME), TMPDIR="/tmp",
                       XDG_RUNTIME_DIR=str(OSWORLD_RUNTIME))
            if self._ns_pid is None:
                argv = ["unshare", "--mount", "--propagation", "private", "--", "sh", "-c",
                        _NS_SETUP, "sh", str(self.dir / "tmp"), str(self.home),
                        str(self.dir / "runtime"),
                        *self._kept_under_tmp(), "--", *argv]
            else:
                argv = ["nsenter", f"--mount=/proc/{self._ns_pid}/ns/mnt", "--", *argv]
                cwd = kw.pop("cwd", None)
                if cwd is not None:  # as the namespace names it: nsenter's --wd would open
                    # the path in this namespace (the machine's empty /home/user)
                    where = OSWORLD_HOME if Path(str(cwd)) == self.home else cwd
                    argv[3:3] = ["sh", "-c", 'cd "$1" && shift && exec "$@"', "sh", str(where)]
        out = open(self.dir / f"{name}.log", "ab")  # noqa: SIM115 — handed to the child
        try:
            proc = subprocess.Popen(
                argv,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=kw.pop("stdout", out),
                stderr=out,
                start_new_session=True,
                **kw,
            )  # type: ignore[arg-type]
        finally:
            out.close()
        if self.namespaced and self._ns_pid is None:
            self._ns_pid = proc.pid
        return proc

    def _kept_under_tmp(self) -> list[str]:
        """The directories under /tmp the namespace keeps at their paths (outermost only)."""
        root = Path(desktop.__file__).resolve().parent.parent
        dirs = sorted({Path(p).resolve() for p in (self.dir, sys.prefix, sys.base_prefix,
                                                    root)})
        tmp, kept = Path("/tmp"), []
        for d in dirs:
            if d.is_relative_to(tmp) and d != tmp and not any(d.is_relative_to(k) for k in kept):
                kept.append(d)
        return [str(d) for d in kept]

    def _start_dbus(self, deadline: float) -> None:
        if shutil.which("dbus-daemon") is None:
            raise DesktopError("dbus-daemon not found (Debian package: dbus)")
        argv = ["dbus-daemon", "--session", "--nofork", "--print-address"]
        # The bus socket in the desktop's own directory (removed with it): the session
        # default, a socket file in /tmp, stays behind when the daemon is killed. A socket
        # path has at most 107 bytes; a longer directory keeps the default.
        if self.namespaced:  # where OSWorld's VM has it (its runtime dir: the session's)
            argv.append(f"--address=unix:path={OSWORLD_RUNTIME / 'bus'}")
        elif len(str(self.dir)) < 80:
            argv.append(f"--address=unix:dir={self.dir}")
        proc = self._spawn(
            "dbus",
            argv,
            stdout=subprocess.PIPE,
        )
        self._procs["dbus"] = proc
        assert proc.stdout is not None
        line = b""
        while not line.endswith(b"\n"):
            remaining = deadline - time.monotonic()
            ready, _, _ = select.select([proc.stdout], [], [], max(0.0, remaining))
            chunk = os.read(proc.stdout.fileno(), 512) if ready else b""
            if not chunk:
                raise DesktopError(
                    f"{self.id}: dbus-daemon gave no bus address (see {self.dir / 'dbus.log'})"
                )
            line += chunk
        proc.stdout.close()
        self._env["DBUS_SESSION_BUS_ADDRESS"] = line.decode().strip()

    def _start_server(self, deadline: float) -> str:
        port = _free_port(self.host)
        # Desktops of one host share its network: each browser gets a DevTools port of its
        # own, each VLC an HTTP port (cua_rollout/desktop/apps/ listen there; the server reports
        # them at
        # /ports).
        self._env[CHROMIUM_PORT_VAR] = str(_free_port())
        self._env[VLC_PORT_VAR] = str(_free_port())
        argv = [sys.executable, "-m", "cua_rollout.desktop.server",
                "--host", self.host, "--port", str(port)]
        # Apps the server launches start in the desktop's HOME, as on a real desktop; the
        # desktop package stays importable for the server through PYTHONPATH (its parent
        # directory: the server needs desktop/ alone), which its children do not inherit.
        root = str(Path(desktop.__file__).resolve().parent.parent)
        env = dict(self._env)
        env["PYTHONPATH"] = os.pathsep.join(
            p for p in (root, os.environ.get("PYTHONPATH", "")) if p
        )
        headers = {}
        if self.token_env:
            argv += ["--token-env", self.token_env]
            # The only process given the token; the server removes it from its environment.
            token = os.environ.get(self.token_env)
            if token:
                env[self.token_env] = token
                headers["Authorization"] = f"Bearer {token}"
        proc = self._spawn("server", argv, cwd=str(self.home), env=env)
        self._procs["server"] = proc
        url = f"http://{reachable_host(self.host)}:{port}"
        while True:
            if proc.poll() is not None:
                log = (self.dir / "server.log").read_text(errors="replace")[-800:]
                raise DesktopError(f"{self.id}: desktop server exited ({proc.returncode}):\n{log}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.post(url + "/screen_size", headers=headers, timeout=2).status_code == 200:
                    return url
            if time.monotonic() > deadline:
                raise DesktopError(
                    f"{self.id}: desktop server on port {port} did not answer "
                    f"within {self.start_timeout_s:.0f}s"
                )
            time.sleep(0.05)

    def _record(self) -> None:
        """Write the pids (with start times) so a later run can remove a stale session."""
        me = psutil.Process()
        entries = []
        for pid in sorted(self.core_pids()):
            with contextlib.suppress(psutil.NoSuchProcess):
                entries.append({"pid": pid, "create_time": psutil.Process(pid).create_time()})
        state = {
            "id": self.id,
            "url": self.url,
            "display": self.display.display if self.display else None,
            "owner": {"pid": me.pid, "create_time": me.create_time()},
            "processes": entries,
        }
        tmp = self.dir / (SESSION_FILE + ".tmp")
        tmp.write_text(json.dumps(state, indent=1))
        os.replace(tmp, self.dir / SESSION_FILE)


def sweep_stale_sessions(state_dir: Path) -> list[str]:
    """Remove the desktops of runs that died without stopping them; returns their ids.

    A session is stale when the process that started it is gone. Only pids whose start time
    matches the record are killed (a reused pid belongs to someone else), plus the apps
    tagged with the session's id.
    """
    removed = []
    root = Path(state_dir)
    if not root.is_dir():
        return removed
    for path in sorted(root.glob(f"*/{SESSION_FILE}")):
        try:
            state = json.loads(path.read_text())
            owner = state["owner"]
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if _same_process(owner["pid"], owner["create_time"]):
            continue  # its run is alive (maybe another run sharing the state dir)
        victims = [
            psutil.Process(e["pid"])
            for e in state.get("processes", [])
            if _same_process(e["pid"], e["create_time"])
        ]
        for proc in psutil.process_iter(["pid"]):
            with contextlib.suppress(psutil.Error):
                if proc.environ().get(MARKER) == state.get("id"):
                    victims.append(proc)
        for proc in victims:
            with contextlib.suppress(psutil.NoSuchProcess):
                proc.kill()
        _wait_dead(victims, _STOP_TIMEOUT_S)
        shutil.rmtree(path.parent, ignore_errors=True)
        removed.append(str(state.get("id")))
    return removed


_NAMESPACES: bool | None = None


def _mount_namespaces_work() -> bool:
    """Whether this process can give a session a mount namespace (root, ``unshare`` and
    ``nsenter`` present, the kernel allows it): probed once; one warning when not."""
    global _NAMESPACES
    if _NAMESPACES is None:
        why = None
        if os.geteuid() != 0:
            why = "not root"
        elif not (shutil.which("unshare") and shutil.which("nsenter")):
            why = "unshare/nsenter not found (Debian package: util-linux)"
        else:
            probe = subprocess.run(["unshare", "--mount", "--propagation", "private", "true"],
                                   capture_output=True, text=True, timeout=10, check=False)
            if probe.returncode != 0:
                why = f"unshare --mount failed: {probe.stderr.strip()[:200]}"
        _NAMESPACES = why is None
        if why is not None:
            log.warning("local desktops run without a mount namespace (%s): HOME is each "
                        "desktop's own directory, not /home/user, so OSWorld tasks that "
                        "name /home/user cannot be done on them", why)
    return _NAMESPACES


def _same_process(pid: int, create_time: float) -> bool:
    try:
        return abs(psutil.Process(pid).create_time() - create_time) < 0.01
    except psutil.Error:
        return False


def office_pipe(home: Path) -> Path:
    """LibreOffice's single-instance socket for the profile in ``home``: always in /tmp
    (whatever TMPDIR says), named after the MD5 of the profile's URL in UTF-16, each byte in
    unpadded hex, as LibreOffice names it (82 such files were left in /tmp here before)."""
    url = f"file://{home}/.config/libreoffice/4".encode("utf-16-le")
    digest = "".join(format(b, "x") for b in hashlib.md5(url, usedforsecurity=False).digest())
    return Path("/tmp") / f"OSL_PIPE_{os.getuid()}_SingleOfficeIPC_{digest}"


def _free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def _wait_dead(procs: list[psutil.Process], timeout_s: float) -> None:
    """Wait until each killed process is gone or a zombie: a zombie holds nothing, and one
    re-parented to a container's init may wait seconds for its reaping."""
    deadline = time.monotonic() + timeout_s
    pending = list(procs)
    while pending and time.monotonic() < deadline:
        still = []
        for proc in pending:
            try:
                if proc.status() != psutil.STATUS_ZOMBIE:
                    still.append(proc)
            except psutil.NoSuchProcess:
                continue
        pending = still
        if pending:
            time.sleep(0.01)
