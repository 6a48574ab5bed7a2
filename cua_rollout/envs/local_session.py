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
"""

from __future__ import annotations

import contextlib
import hashlib
import json
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

MARKER = DESKTOP_ID_VAR
SESSION_FILE = "session.json"
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
            self._start_dbus(deadline)
            if os.path.exists(AT_SPI_LAUNCHER):
                self._procs["at-spi"] = self._spawn(
                    "at-spi", [AT_SPI_LAUNCHER, "--launch-immediately"]
                )
            self.url = self._start_server(deadline)
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
            office_pipe(self.home).unlink()
        return len(victims)

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

    def _spawn(self, name: str, argv: list[str], **kw: object) -> subprocess.Popen[bytes]:
        log = open(self.dir / f"{name}.log", "ab")  # noqa: SIM115 — handed to the child
        try:
            return subprocess.Popen(
                argv,
                env=kw.pop("env", self._env),
                stdin=subprocess.DEVNULL,
                stdout=kw.pop("stdout", log),
                stderr=log,
                start_new_session=True,
                **kw,
            )  # type: ignore[arg-type]
        finally:
            log.close()

    def _start_dbus(self, deadline: float) -> None:
        if shutil.which("dbus-daemon") is None:
            raise DesktopError("dbus-daemon not found (Debian package: dbus)")
        argv = ["dbus-daemon", "--session", "--nofork", "--print-address"]
        # The bus socket in the desktop's own directory (removed with it): the session
        # default, a socket file in /tmp, stays behind when the daemon is killed. A socket
        # path has at most 107 bytes; a longer directory keeps the default.
        if len(str(self.dir)) < 80:
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
