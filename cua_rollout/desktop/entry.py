"""The desktop image's entry point (``python -m cua_rollout.desktop.entry``;
deploy/desktop-image/Containerfile):
an X screen with its window manager, a D-Bus session bus and AT-SPI, a HOME as OSWorld's image
has it, and the desktop server, in one container. It stays PID 1: it reaps orphaned processes
(apps the agent started and a reset killed), and a SIGTERM stops the server, then the rest.

Settings come from the environment, so any engine or pod template can set them:

    CUA_DESKTOP_HOST        bind address (default 0.0.0.0: the container's network)
    CUA_DESKTOP_PORT        port (default 5000, OSWorld's)
    CUA_DESKTOP_TOKEN_ENV   the variable holding the bearer token (default CUA_DESKTOP_TOKEN);
                            required unless the host is loopback: a desktop runs any code sent
    CUA_DESKTOP_INSECURE_NO_TOKEN=1   no token although listening beyond loopback: only when
                            the port is published on the host's loopback alone (the
                            ``container`` provider without desktops.token_env)
    SCREEN_WIDTH, SCREEN_HEIGHT   the screen (default 1920x1080)
    CUA_DESKTOP_ID          the tag of the desktop's processes (default: the host name)
    CUA_DESKTOP_WARM_ACTIONS=0   every /execute command in a fresh process (default: plain
                            pyautogui actions in the server's warm interpreter)
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from cua_rollout.desktop.display import XvfbDisplay, terminate_process
from cua_rollout.desktop.processes import DESKTOP_ID_VAR
from cua_rollout.desktop.profile import provision

__all__ = ["main"]

OPENBOX_RC = Path(__file__).with_name("openbox-rc.xml")
AT_SPI_LAUNCHER = "/usr/libexec/at-spi-bus-launcher"
_HOME_DIRS = ("Desktop", "Documents", "Downloads")
_START_TIMEOUT_S = 30.0
_STOP_TIMEOUT_S = 5.0


def _setting(name: str, default: str) -> str:
    return os.environ.get(name) or default


def _loopback(host: str) -> bool:
    try:
        return host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _bus_address(proc: subprocess.Popen[bytes], deadline: float) -> str:
    assert proc.stdout is not None
    line = b""
    while not line.endswith(b"\n"):
        ready, _, _ = select.select([proc.stdout], [], [], max(0.0, deadline - time.monotonic()))
        chunk = os.read(proc.stdout.fileno(), 512) if ready else b""
        if not chunk:
            raise RuntimeError("dbus-daemon gave no bus address")
        line += chunk
    proc.stdout.close()
    return line.decode().strip()


def main() -> int:
    host = _setting("CUA_DESKTOP_HOST", "0.0.0.0")
    port = int(_setting("CUA_DESKTOP_PORT", "5000"))
    token_env = _setting("CUA_DESKTOP_TOKEN_ENV", "CUA_DESKTOP_TOKEN")
    width = int(_setting("SCREEN_WIDTH", "1920"))
    height = int(_setting("SCREEN_HEIGHT", "1080"))
    insecure = os.environ.pop("CUA_DESKTOP_INSECURE_NO_TOKEN", "") == "1"
    if not os.environ.get(token_env) and not _loopback(host) and not insecure:
        print(f"desktop: ${token_env} is empty and the server would listen on {host}: set a "
              "bearer token (anyone reaching the port could run any code), or "
              "CUA_DESKTOP_INSECURE_NO_TOKEN=1 when only this host reaches the container",
              file=sys.stderr)
        return 2
    home = Path.home()
    for name in _HOME_DIRS:
        (home / name).mkdir(parents=True, exist_ok=True)
    provision(home)
    env = dict(os.environ)
    env.pop(token_env, None)  # the server alone gets it
    env[DESKTOP_ID_VAR] = _setting(DESKTOP_ID_VAR, socket.gethostname())
    env.setdefault("XDG_RUNTIME_DIR", str(Path("/tmp") / f"runtime-{os.getuid()}"))
    Path(env["XDG_RUNTIME_DIR"]).mkdir(mode=0o700, exist_ok=True)
    env["NO_AT_BRIDGE"] = "0"

    stopping = False

    def stop(signum: int, frame: object) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    deadline = time.monotonic() + _START_TIMEOUT_S
    display = XvfbDisplay(width, height, window_manager=["openbox", "--config-file",
                                                         str(OPENBOX_RC)],
                          start_timeout_s=_START_TIMEOUT_S, base_env=env)
    procs: list[subprocess.Popen[bytes]] = []
    try:
        display.start()
        env = display.env(env)
        if shutil.which("dbus-daemon"):
            bus = subprocess.Popen(["dbus-daemon", "--session", "--nofork", "--print-address"],
                                   env=env, stdout=subprocess.PIPE, stdin=subprocess.DEVNULL)
            procs.append(bus)
            env["DBUS_SESSION_BUS_ADDRESS"] = _bus_address(bus, deadline)
        if os.path.exists(AT_SPI_LAUNCHER):
            procs.append(subprocess.Popen([AT_SPI_LAUNCHER, "--launch-immediately"], env=env,
                                          stdin=subprocess.DEVNULL))
        server_env = dict(env)
        if os.environ.get(token_env):
            server_env[token_env] = os.environ[token_env]
        argv = [sys.executable, "-m", "cua_rollout.desktop.server",
                "--host", host, "--port", str(port)]
        if os.environ.get(token_env):
            argv += ["--token-env", token_env]
        server = subprocess.Popen(argv, env=server_env, cwd=home, stdin=subprocess.DEVNULL)
        procs.append(server)
        code = _reap_until(server, lambda: stopping)
    finally:
        for proc in reversed(procs):
            terminate_process(proc, _STOP_TIMEOUT_S)
        display.stop()
    return code


def _reap_until(server: subprocess.Popen[bytes], stopping: object) -> int:
    """As PID 1: reap every child that ends (orphans included) until the server ends or a
    stop is asked; the server's exit code (0 on a stop)."""
    while True:
        if stopping():  # type: ignore[operator]
            return 0
        with contextlib.suppress(ChildProcessError, InterruptedError):
            pid, status = os.waitpid(-1, os.WNOHANG)
            while pid:
                if pid == server.pid:
                    server.returncode = os.waitstatus_to_exitcode(status)
                    print(f"desktop: the server ended ({server.returncode})", file=sys.stderr)
                    return server.returncode or 1
                pid, status = os.waitpid(-1, os.WNOHANG)
        time.sleep(0.2)


if __name__ == "__main__":
    raise SystemExit(main())
