"""Integration: the desktop server (``python -m cua_rollout.desktop.server``) on a real Xvfb
desktop.

One desktop session per module, as a desktop runs it: Xvfb with openbox, its own HOME and
runtime directory, a D-Bus session bus and the AT-SPI bus launcher. The server runs as a
subprocess on a free loopback port with a bearer token and short time limits; every case talks
to it over real HTTP with httpx and checks what happened on the desktop (pointer, windows,
files, processes). Statuses of bad requests are the ones OSWorld's own server gives.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import os
import secrets
import select
import shutil
import signal
import socket
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import httpx
import psutil
import pytest
from PIL import Image
from starlette.applications import Starlette
from starlette.routing import Mount
from starlette.staticfiles import StaticFiles

from cua_rollout.core.http import ThreadedServer
from cua_rollout.desktop.display import XvfbDisplay, terminate_process
from cua_rollout.desktop.profile import provision
from cua_rollout.desktop.protocol import execute_command
from tests.support import REPO_ROOT

REPO = REPO_ROOT
SCREEN_W, SCREEN_H = 1280, 800
TOKEN_ENV = "DESKTOP_SERVER_TEST_TOKEN"
# Server-side time limits, short so that the limit cases end quickly (OSWorld: 120 s, 30 s).
EXECUTE_LIMIT_S = 8.0
RUN_PYTHON_LIMIT_S = 8.0
BASH_LIMIT_S = 2
# Client-side deadlines, generous: other test suites share the two cores of this machine.
START_TIMEOUT_S = 30.0
REQUEST_TIMEOUT_S = 60.0
WAIT_TIMEOUT_S = 20.0
STOP_TIMEOUT_S = 10.0
POLL_INTERVAL_S = 0.1
# Longer than every time limit above: a request that needs this long was not limited.
LIMITED_REQUEST_TIMEOUT_S = 30.0
SLEEP_FOREVER_S = 300
AT_SPI_LAUNCHER = "/usr/libexec/at-spi-bus-launcher"
ST = "https://accessibility.ubuntu.example.org/ns/state"
CP = "https://accessibility.ubuntu.example.org/ns/component"

_TOOLS = (
    "Xvfb",
    "openbox",
    "xdotool",
    "xprop",
    "wmctrl",
    "xterm",
    "mousepad",
    "galculator",
    "ffmpeg",
)
_MISSING = [t for t in (*_TOOLS, "dbus-daemon") if shutil.which(t) is None]
_MISSING += [] if os.path.exists(AT_SPI_LAUNCHER) else [AT_SPI_LAUNCHER]
pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(bool(_MISSING), reason=f"needs {', '.join(_MISSING)}"),
]

T = TypeVar("T")


def wait_for(probe: Callable[[], T | None], what: str, timeout_s: float = WAIT_TIMEOUT_S) -> T:
    """Poll ``probe`` until it returns something truthy; fail naming ``what`` otherwise."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = probe()
        if value:
            return value
        if time.monotonic() >= deadline:
            pytest.fail(f"no {what} within {timeout_s} s")
        time.sleep(POLL_INTERVAL_S)


def _stop(procs: list[subprocess.Popen[bytes]]) -> None:
    """Terminate (then kill) the processes we started, newest first, by pid."""
    for proc in reversed(procs):
        terminate_process(proc, STOP_TIMEOUT_S)


def _gone(pid: int) -> bool:
    """Dead: no such process, or a zombie nobody reaped yet (its parent is not ours)."""
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


# --------------------------------------------------------------------------- the desktop session


@dataclass
class Session:
    display: XvfbDisplay
    env: dict[str, str]
    home: Path

    def run(self, *argv: str) -> str:
        return subprocess.run(
            argv, env=self.env, capture_output=True, text=True, timeout=WAIT_TIMEOUT_S, check=True
        ).stdout

    def pointer(self) -> tuple[int, int]:
        values = dict(
            line.split("=", 1)
            for line in self.run("xdotool", "getmouselocation", "--shell").split()
        )
        return int(values["X"]), int(values["Y"])

    def window_titles(self) -> list[str]:
        lines = self.run("wmctrl", "-l").splitlines()
        return [
            fields[3] if len(fields) == 4 else "" for fields in (ln.split(None, 3) for ln in lines)
        ]

    def active_title(self) -> str:
        try:
            return self.run("xdotool", "getactivewindow", "getwindowname").strip()
        except subprocess.CalledProcessError:
            return ""


def _read_line(fd: int, proc: subprocess.Popen[bytes], what: str) -> str:
    deadline = time.monotonic() + START_TIMEOUT_S
    data = b""
    while b"\n" not in data:
        ready, _, _ = select.select([fd], [], [], max(0.0, deadline - time.monotonic()))
        chunk = os.read(fd, 4096) if ready else b""
        if not chunk:
            pytest.fail(f"{what} did not report its address (exit status {proc.poll()})")
        data += chunk
    return data.split(b"\n", 1)[0].decode().strip()


def _start_session_bus(env: dict[str, str], log: Any) -> tuple[subprocess.Popen[bytes], str]:
    read_fd, write_fd = os.pipe()
    try:
        bus = subprocess.Popen(
            ["dbus-daemon", "--session", "--nofork", f"--print-address={write_fd}"],
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=log,
            pass_fds=(write_fd,),
        )
    finally:
        os.close(write_fd)
    try:
        return bus, _read_line(read_fd, bus, "dbus-daemon")
    except BaseException:
        _stop([bus])
        raise
    finally:
        os.close(read_fd)


@pytest.fixture(scope="module")
def session(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Session]:
    """Xvfb + openbox, a session bus and AT-SPI, with a HOME and runtime dir of its own."""
    root = tmp_path_factory.mktemp("desktop")
    home, runtime = root / "home", root / "run"
    home.mkdir()
    provision(home)  # the desktop profile's: .txt opens in the text editor
    runtime.mkdir(mode=0o700)
    base = {k: v for k, v in os.environ.items() if "proxy" not in k.lower()}
    base.update(HOME=str(home), XDG_RUNTIME_DIR=str(runtime))
    base.pop("DBUS_SESSION_BUS_ADDRESS", None)
    base.pop("AT_SPI_BUS_ADDRESS", None)
    procs: list[subprocess.Popen[bytes]] = []
    helpers: list[psutil.Process] = []
    with (
        XvfbDisplay(SCREEN_W, SCREEN_H, window_manager="openbox") as display,
        open(root / "session.log", "wb") as log,
    ):
        env = display.env(base)
        try:
            bus, env["DBUS_SESSION_BUS_ADDRESS"] = _start_session_bus(env, log)
            procs.append(bus)
            launcher = subprocess.Popen(
                [AT_SPI_LAUNCHER, "--launch-immediately"],
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=log,
            )
            procs.append(launcher)
            s = Session(display, env, home)
            wait_for(
                lambda: "AT_SPI_BUS(STRING)" in s.run("xprop", "-root", "AT_SPI_BUS"), "AT-SPI bus"
            )
            helpers = psutil.Process(launcher.pid).children(recursive=True)
            yield s
        finally:
            _stop(procs)
            # The launcher's own bus daemon ends with it; make sure, by pid.
            for helper in helpers:
                with contextlib.suppress(psutil.Error):
                    if helper.status() != psutil.STATUS_ZOMBIE:
                        helper.terminate()
                        helper.wait(STOP_TIMEOUT_S)


# --------------------------------------------------------------------------- the server


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Server:
    url: str
    proc: subprocess.Popen[bytes]
    log_path: Path
    client: httpx.Client

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:]

    def post_json(self, path: str, body: Any, **kwargs: Any) -> httpx.Response:
        return self.client.post(path, json=body, **kwargs)


@contextlib.contextmanager
def serve(env: dict[str, str], workdir: Path, token: str | None, *extra: str) -> Iterator[Server]:
    """``python -m cua_rollout.desktop.server`` on a free port with ``env``; stopped (by pid) at
    the end."""
    port = _free_port()
    env = dict(env)
    argv = [sys.executable, "-m", "cua_rollout.desktop.server",
            "--host", "127.0.0.1", "--port", str(port)]
    headers = {}
    if token is not None:
        env[TOKEN_ENV] = token
        argv += ["--token-env", TOKEN_ENV]
        headers["Authorization"] = f"Bearer {token}"
    log_path = workdir / f"server-{port}.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [*argv, *extra], cwd=REPO, env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=log
        )
    url = f"http://127.0.0.1:{port}"
    client = httpx.Client(base_url=url, headers=headers, timeout=REQUEST_TIMEOUT_S)
    server = Server(url, proc, log_path, client)
    try:

        def ready() -> bool:
            if proc.poll() is not None:
                pytest.fail(f"the server exited ({proc.returncode}):\n{server.log()}")
            with contextlib.suppress(httpx.TransportError):
                return client.get("/platform").status_code == 200
            return False

        wait_for(ready, "answer from the desktop server", START_TIMEOUT_S)
        yield server
    finally:
        client.close()
        _stop([proc])


@pytest.fixture(scope="module")
def server(session: Session, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with serve(
        session.env,
        tmp_path_factory.mktemp("server"),
        secrets.token_urlsafe(16),
        "--execute-timeout-s", str(EXECUTE_LIMIT_S),
        "--run-python-timeout-s", str(RUN_PYTHON_LIMIT_S),
        "--open-file-timeout-s", str(WAIT_TIMEOUT_S),
        "--kill-grace-s", "2",
    ) as srv:  # fmt: skip
        yield srv
        assert srv.proc.poll() is None, f"the server died:\n{srv.log()}"


@pytest.fixture
def apps(server: Server) -> Iterator[Server]:
    """The server, with everything it started ended after the case (its reset hook)."""
    yield server
    r = server.client.post("/apps/kill")
    assert r.status_code == 200 and r.json()["remaining"] == [], r.text


def launch(server: Server, command: list[str] | str, **extra: Any) -> None:
    r = server.post_json("/setup/launch", {"command": command, **extra})
    assert r.status_code == 200, r.text
    assert r.text.endswith("launched successfully")


def _pixels(image: Image.Image, box: tuple[int, int, int, int]) -> list[tuple[int, int, int]]:
    raw = image.crop(box).tobytes()
    return list(zip(raw[0::3], raw[1::3], raw[2::3], strict=True))


def _shot(server: Server) -> Image.Image:
    r = server.client.get("/screenshot")
    assert r.status_code == 200
    assert r.headers["content-type"] == "image/png"
    assert r.content.startswith(b"\x89PNG\r\n\x1a\n")
    image = Image.open(io.BytesIO(r.content))
    image.load()
    return image.convert("RGB")


# --------------------------------------------------------------------------- access and observation


def test_every_request_needs_the_token(server: Server, session: Session) -> None:
    marker = session.home / "should-not-exist"
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "Basic x"}):
        r = httpx.get(f"{server.url}/platform", headers=headers, timeout=REQUEST_TIMEOUT_S)
        assert r.status_code == 401
        assert r.headers["www-authenticate"] == "Bearer"
        r = httpx.post(
            f"{server.url}/execute",
            json={"command": ["touch", str(marker)]},
            headers=headers,
            timeout=REQUEST_TIMEOUT_S,
        )
        assert r.status_code == 401
    assert not marker.exists()
    r = server.client.get("/platform")
    assert (r.status_code, r.text) == (200, "Linux")


def test_screen_size_cursor_position_and_desktop_path(server: Server, session: Session) -> None:
    assert server.client.post("/screen_size").json() == {"width": SCREEN_W, "height": SCREEN_H}
    session.run("xdotool", "mousemove", "345", "456")
    assert server.client.get("/cursor_position").json() == [345, 456]
    assert server.client.post("/desktop_path").status_code == 404
    (session.home / "Desktop").mkdir()
    try:
        r = server.client.post("/desktop_path")
        assert r.json() == {"desktop_path": str(session.home / "Desktop")}
    finally:
        (session.home / "Desktop").rmdir()


def test_screenshot_is_a_png_of_the_screen_with_the_cursor_drawn_in(
    server: Server, session: Session
) -> None:
    # The bare root window is black; openbox's arrow cursor is black with a white outline.
    here, elsewhere = (400, 300), (900, 600)
    box = (here[0] - 2, here[1] - 2, here[0] + 24, here[1] + 32)
    session.run("xdotool", "mousemove", *map(str, here))
    with_cursor = _shot(server)
    session.run("xdotool", "mousemove", *map(str, elsewhere))
    without = _shot(server)
    assert with_cursor.size == without.size == (SCREEN_W, SCREEN_H)
    white = [p for p in _pixels(with_cursor, box) if min(p) > 200]
    assert len(white) > 20, "no cursor outline near the pointer"
    assert all(p == (0, 0, 0) for p in _pixels(without, box))
    # The arrow's tip is at the pointer (within the theme's hotspot offset of a few pixels).
    above_left = (here[0] - 12, here[1] - 12, here[0] - 3, here[1] - 3)
    assert all(p == (0, 0, 0) for p in _pixels(with_cursor, above_left))


# --------------------------------------------------------------------------- commands


def test_execute_runs_pyautogui_code_as_osworlds_client_sends_it(
    server: Server, session: Session
) -> None:
    command = execute_command("pyautogui.moveTo(321, 234)")
    assert command[0] == "python"  # resolved through the server's PATH to one with pyautogui
    r = server.post_json("/execute", {"command": command})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body == {"status": "success", "output": "", "error": "", "returncode": 0}
    assert session.pointer() == (321, 234)
    assert server.client.get("/cursor_position").json() == [321, 234]


def test_execute_splits_strings_expands_home_and_runs_shells(
    server: Server, session: Session
) -> None:
    r = server.post_json("/execute", {"command": "printf '%s|' ~/notes 'a b' ~x"})
    assert r.json()["output"] == f"{session.home}/notes|a b|~x|"
    r = server.post_json(
        "/setup/execute", {"command": "echo $((6*7)); echo oops >&2; exit 3", "shell": True}
    )
    assert r.status_code == 200
    assert r.json() == {"status": "success", "output": "42\n", "error": "oops\n", "returncode": 3}
    r = server.post_json("/execute", {"command": ["echo $0-$1", "x", "y"], "shell": True})
    assert r.json()["output"] == "x-y\n"


def test_execute_answers_without_waiting_for_what_it_left_running(apps: Server) -> None:
    # OSWorld's server would wait until the background sleep closed the output pipe.
    r = apps.post_json(
        "/execute",
        {"command": f"sleep {SLEEP_FOREVER_S} & echo started", "shell": True},
        timeout=LIMITED_REQUEST_TIMEOUT_S,
    )
    assert r.status_code == 200, r.text
    assert r.json()["output"] == "started\n"
    listed = apps.client.get("/apps").json()["apps"]
    sleeps = [a for a in listed if a["cmdline"] == ["sleep", str(SLEEP_FOREVER_S)]]
    assert [a["source"] for a in sleeps] == ["execute"]
    r = apps.client.post("/apps/kill")
    assert sleeps[0]["pid"] in r.json()["killed"]
    assert _gone(sleeps[0]["pid"])


async def test_time_limits_end_commands_and_their_children(
    server: Server, session: Session
) -> None:
    pid_file = session.home / "limited.pid"
    headers = dict(server.client.headers)
    async with httpx.AsyncClient(
        base_url=server.url, headers=headers, timeout=LIMITED_REQUEST_TIMEOUT_S
    ) as client:
        execute, python, bash = await asyncio.gather(
            client.post(
                "/execute",
                json={
                    "command": ["sh", "-c", f"sleep {SLEEP_FOREVER_S} & echo $! > {pid_file}; wait"]
                },
            ),
            client.post(
                "/run_python", json={"code": f"import time\ntime.sleep({SLEEP_FOREVER_S})"}
            ),
            client.post(
                "/run_bash_script",
                json={"script": f"sleep {SLEEP_FOREVER_S}", "timeout": BASH_LIMIT_S},
            ),
        )
    assert execute.status_code == 500
    assert execute.json()["status"] == "error"
    assert f"timed out after {EXECUTE_LIMIT_S:g} seconds" in execute.json()["message"]
    assert _gone(int(pid_file.read_text()))  # the whole process group was killed
    assert python.status_code == 500
    assert python.json() == {
        "status": "error",
        "message": "Execution timeout: Code took too long to execute",
        "error": "TimeoutExpired",
        "need_more": False,
        "output": None,
    }
    assert bash.status_code == 500
    assert bash.json() == {
        "status": "error",
        "output": f"Script execution timed out after {BASH_LIMIT_S} seconds",
        "error": "",
        "returncode": -1,
    }


def test_a_command_ends_at_its_callers_deadline(server: Server, session: Session) -> None:
    """A ``timeout`` shorter than the server's limit ends the command then: it does not run
    on after its caller gave up."""
    pid_file = session.home / "deadline.pid"
    started = time.monotonic()
    r = server.post_json(
        "/execute",
        {"command": f"echo $$ > {pid_file}; exec sleep {SLEEP_FOREVER_S}", "shell": True,
         "timeout": 1},
        timeout=LIMITED_REQUEST_TIMEOUT_S,
    )  # fmt: skip
    assert r.status_code == 500, r.text
    assert "timed out after 1 seconds" in r.json()["message"]
    assert time.monotonic() - started < EXECUTE_LIMIT_S
    assert _gone(int(pid_file.read_text()))
    for bad in (0, -1, "soon", True):
        r = server.post_json("/execute", {"command": ["true"], "timeout": bad})
        assert r.status_code == 500
        assert "timeout must be a positive number" in r.json()["message"]


def test_apps_kill_ends_a_command_while_it_runs(apps: Server, session: Session) -> None:
    """A command whose caller gave up still belongs to the server while it runs: a reset's
    ``/apps/kill`` ends it, and the answer, if anyone still waits, says it was killed."""
    pid_file = session.home / "running.pid"
    body = {"command": f"echo $$ > {pid_file}; exec sleep {SLEEP_FOREVER_S}", "shell": True}
    with ThreadPoolExecutor(1) as waiter:
        answer = waiter.submit(
            httpx.post,
            f"{apps.url}/execute",
            json=body,
            headers=dict(apps.client.headers),
            timeout=LIMITED_REQUEST_TIMEOUT_S,
        )
        running = wait_for(
            lambda: [
                a
                for a in apps.client.get("/apps").json()["apps"]
                if a["cmdline"] == ["sleep", str(SLEEP_FOREVER_S)]
            ],
            "the running command in /apps",
        )
        assert [a["source"] for a in running] == ["execute"]
        assert running[0]["pid"] == int(pid_file.read_text())
        killed = apps.client.post("/apps/kill").json()
        assert running[0]["pid"] in killed["killed"] and killed["remaining"] == []
        r = answer.result(timeout=WAIT_TIMEOUT_S)
    assert r.status_code == 200, r.text
    assert r.json()["returncode"] == -signal.SIGTERM
    assert _gone(running[0]["pid"])


def test_run_python_reports_output_errors_and_return_code(server: Server) -> None:
    code = "import sys, pyautogui\nprint(pyautogui.size())\nprint('careful', file=sys.stderr)"
    r = server.post_json("/run_python", {"code": code})
    assert r.status_code == 200
    assert r.json() == {
        "status": "success",
        "message": f"Size(width={SCREEN_W}, height={SCREEN_H})\n\ncareful\n",
        "need_more": False,
        "output": f"Size(width={SCREEN_W}, height={SCREEN_H})\n",
        "error": "careful\n",
        "return_code": 0,
    }
    r = server.post_json("/run_python", {"code": "raise SystemExit(5)"})
    body = r.json()
    assert (r.status_code, body["status"], body["return_code"]) == (200, "error", 5)
    assert body["error"] == "Process exited with code 5"
    r = server.post_json("/run_python", {"code": "1/0"})
    assert r.json()["return_code"] == 1 and "ZeroDivisionError" in r.json()["error"]


def test_run_bash_script_merges_output_and_honours_working_dir(
    server: Server, session: Session
) -> None:
    script = "echo out; echo err >&2; pwd; exit 4"
    r = server.post_json("/run_bash_script", {"script": script, "working_dir": "~"})
    assert r.status_code == 200
    assert r.json() == {
        "status": "error",
        "output": f"out\nerr\n{session.home}\n",
        "error": "",
        "returncode": 4,
    }
    r = server.post_json("/run_bash_script", {"script": "echo $BASH_VERSION | cut -c1"})
    assert r.json()["status"] == "success" and r.json()["output"].strip().isdigit()


# --------------------------------------------------------------------------- files


def test_upload_file_list_directory_round_trip(server: Server, session: Session) -> None:
    data = os.urandom(200_000)
    r = server.client.post(
        "/setup/upload",
        data={"file_path": "~/docs/sub/blob.bin"},
        files={"file_data": ("blob.bin", data, "application/octet-stream")},
    )
    assert (r.status_code, r.text) == (200, f"File Uploaded: {len(data)} bytes")
    assert (session.home / "docs" / "sub" / "blob.bin").read_bytes() == data
    r = server.client.post("/file", data={"file_path": "~/docs/sub/blob.bin"})
    assert r.status_code == 200 and r.content == data
    assert r.headers["content-disposition"].startswith("attachment")
    r = server.post_json("/list_directory", {"path": str(session.home / "docs")})
    assert r.json() == {
        "directory_tree": {
            "type": "directory",
            "name": "docs",
            "children": [
                {
                    "type": "directory",
                    "name": "sub",
                    "children": [{"type": "file", "name": "blob.bin"}],
                }
            ],
        }
    }
    # `~` is the desktop user's HOME here too, as for the other file routes.
    assert server.post_json("/list_directory", {"path": "~/docs"}).json() == r.json()


def test_download_file_fetches_reachable_urls_and_explains_failures(
    server: Server, session: Session, tmp_path: Path
) -> None:
    (tmp_path / "payload.txt").write_text("downloaded text\n")
    files = ThreadedServer(Starlette(routes=[
        Mount("/", StaticFiles(directory=str(tmp_path)))])).start()
    try:
        base = files.url
        r = server.post_json(
            "/setup/download_file", {"url": f"{base}/payload.txt", "path": "~/dl/p.txt"}
        )
        assert (r.status_code, r.text) == (200, "File downloaded successfully: 16 bytes")
        assert (session.home / "dl" / "p.txt").read_text() == "downloaded text\n"
        # A missing file, and a port nothing listens on (the probe socket is closed again).
        for url in (f"{base}/missing.txt", f"http://127.0.0.1:{_free_port()}/x"):
            r = server.post_json("/setup/download_file", {"url": url, "path": "~/dl/x.txt"})
            assert r.status_code == 500
            assert r.text.startswith(f"Failed to download {url}. No retries left. Error:")
        assert not (session.home / "dl" / "x.txt").exists()
    finally:
        files.stop()


# --------------------------------------------------------------------------- bad requests


JSON_ENDPOINTS = [
    "/execute",
    "/setup/execute",
    "/setup/launch",
    "/run_python",
    "/run_bash_script",
    "/list_directory",
    "/setup/open_file",
    "/setup/activate_window",
    "/setup/close_window",
    "/setup/download_file",
]


@pytest.mark.parametrize("path", JSON_ENDPOINTS)
def test_json_endpoints_refuse_bodies_flask_would_refuse(server: Server, path: str) -> None:
    r = server.client.post(path, content=b"command=ls", headers={"Content-Type": "text/plain"})
    assert r.status_code == 415  # Flask's request.json without a JSON content type
    r = server.client.post(path, content=b"{not json", headers={"Content-Type": "application/json"})
    assert r.status_code == 400  # malformed JSON
    r = server.post_json(path, ["a", "list"])
    assert r.status_code == 500  # OSWorld's handlers crash on data.get of a non-object


@pytest.mark.parametrize(
    ("path", "body", "status"),
    [
        ("/execute", {}, 500),  # no command: OSWorld's subprocess.run([]) fails
        ("/execute", {"command": ["no-such-program-here"]}, 500),
        ("/execute", {"command": "unbalanced 'quote"}, 500),
        ("/setup/launch", {}, 500),
        ("/setup/launch", {"command": ["no-such-program-here"]}, 500),
        ("/run_python", {}, 400),
        ("/run_bash_script", {}, 400),
        ("/run_bash_script", {"script": "true", "working_dir": "/no/such/dir"}, 400),
        ("/list_directory", {}, 400),
        ("/list_directory", {"path": "/no/such/dir"}, 400),
        ("/list_directory", {"path": "/etc/hostname"}, 400),
        ("/setup/open_file", {}, 400),
        ("/setup/open_file", {"path": "/no/such/file.txt"}, 404),
        ("/setup/activate_window", {}, 400),
        ("/setup/close_window", {"strict": True}, 400),
        ("/setup/download_file", {}, 400),
        ("/setup/download_file", {"url": "http://127.0.0.1:9/x"}, 400),
    ],
)
def test_missing_fields_and_paths_get_osworlds_status(
    server: Server, path: str, body: dict[str, Any], status: int
) -> None:
    r = server.post_json(path, body)
    assert r.status_code == status, r.text


def test_form_endpoints_get_osworlds_status(server: Server, session: Session) -> None:
    client = server.client
    assert client.post("/file", data={}).status_code == 400
    assert (
        client.post("/file", json={"file_path": "/etc/hostname"}).status_code == 400
    )  # not a form
    assert client.post("/file", data={"file_path": "~/no/such/file"}).json() == {
        "error": "File not found"
    }
    assert client.post("/file", data={"file_path": "~/no/such/file"}).status_code == 404
    assert client.post("/file", data={"file_path": str(session.home)}).status_code == 500
    assert client.post("/setup/upload", data={"file_path": "~/x"}).status_code == 400
    r = client.post("/setup/upload", files={"file_data": ("x", b"x")})
    assert r.status_code == 400
    assert client.post("/window_size", data={}).status_code == 400
    assert client.post("/window_size", data={"app_class_name": "no-such-app"}).status_code == 500
    assert client.get("/execute").status_code == 405


# --------------------------------------------------------------------------- apps and windows


def test_launch_activate_and_close_windows(apps: Server, session: Session) -> None:
    launch(apps, ["xterm", "-title", "probe-xterm"])
    launch(apps, "mousepad")
    wait_for(lambda: "probe-xterm" in session.window_titles(), "xterm window")
    wait_for(lambda: any("Mousepad" in t for t in session.window_titles()), "mousepad window")
    size = apps.client.post("/window_size", data={"app_class_name": "XTerm"}).json()
    assert size["width"] > 100 and size["height"] > 100

    r = apps.post_json("/setup/activate_window", {"window_name": "probe-xterm", "strict": True})
    assert (r.status_code, r.text) == (200, "Window activated successfully")
    wait_for(lambda: session.active_title() == "probe-xterm", "active xterm")
    r = apps.post_json("/setup/activate_window", {"window_name": "mousepad", "by_class": True})
    assert r.status_code == 200
    wait_for(lambda: "Mousepad" in session.active_title(), "active mousepad")
    r = apps.post_json("/setup/activate_window", {"window_name": "no-such-window"})
    assert r.status_code == 200 and r.text.startswith("No window matched 'no-such-window'")

    xterms = [a for a in apps.client.get("/apps").json()["apps"] if a["name"] == "xterm"]
    assert [a["source"] for a in xterms] == ["launch"]
    r = apps.post_json("/setup/close_window", {"window_name": "probe-xterm"})
    assert (r.status_code, r.text) == (200, "Window closed successfully.")
    wait_for(lambda: "probe-xterm" not in session.window_titles(), "xterm window to close")
    wait_for(lambda: _gone(xterms[0]["pid"]), "xterm to exit")


def test_open_file_opens_the_default_app_and_waits_for_its_window(
    apps: Server, session: Session
) -> None:
    (session.home / "notes.txt").write_text("hello from the test\n")
    r = apps.post_json("/setup/open_file", {"path": "~/notes.txt"})
    assert (r.status_code, r.text) == (200, "File opened and window activated successfully")
    assert any("notes.txt" in t for t in session.window_titles())
    wait_for(lambda: "notes.txt" in session.active_title(), "active notes.txt window")
    # The opener (xdg-open when installed, which may stay alive) and the app it started are
    # registered as the open_file's processes; the app is among them.
    opened = apps.client.get("/apps").json()["apps"]
    assert {a["source"] for a in opened} == {"open_file"}
    assert any(a["name"] == "mousepad" for a in opened), opened
    # A path that is no file but a command on PATH starts that app (as OSWorld does).
    r = apps.post_json("/setup/open_file", {"path": "galculator"})
    assert (r.status_code, r.text) == (200, "File opened and window activated successfully")
    wait_for(lambda: "galculator" in session.active_title().lower(), "active galculator window")


def test_apps_kill_ends_what_launch_and_commands_left_running(apps: Server) -> None:
    launch(apps, f"sleep {SLEEP_FOREVER_S} & exec sleep {SLEEP_FOREVER_S}", shell=True)
    r = apps.post_json("/execute", {"command": f"(sleep {SLEEP_FOREVER_S} &)", "shell": True})
    assert r.status_code == 200
    listed = wait_for(
        lambda: [a for a in apps.client.get("/apps").json()["apps"] if a["name"] == "sleep"],
        "listed sleeps",
    )
    wait_for(lambda: len(apps.client.get("/apps").json()["apps"]) == 3, "three sleeps")
    killed = apps.client.post("/apps/kill").json()
    assert killed["remaining"] == []
    assert set(killed["killed"]) >= {a["pid"] for a in listed}
    assert apps.client.get("/apps").json() == {"apps": []}
    assert all(_gone(pid) for pid in killed["killed"])


# --------------------------------------------------------------------------- accessibility


def _a11y_apps(server: Server) -> list[ET.Element]:
    r = server.client.get("/accessibility")
    assert r.status_code == 200, r.text
    root = ET.fromstring(r.json()["AT"])
    assert root.tag == "desktop-frame"
    return [el for el in root if el.tag == "application" and el.get("name") == "mousepad"]


def test_accessibility_tree_has_mousepads_widgets(apps: Server, session: Session) -> None:
    launch(apps, ["mousepad"])
    mousepad = wait_for(lambda: _a11y_apps(apps), "mousepad in the accessibility tree")[0]
    frame = mousepad.find("frame")
    assert frame is not None and "Mousepad" in (frame.get("name") or "")
    assert frame.get(f"{{{ST}}}showing") == "true"
    assert frame.get(f"{{{CP}}}screencoord", "").startswith("(")
    names = {(el.tag, el.get("name")) for el in mousepad.iter()}
    assert ("menu", "File") in names
    assert ("push-button", "Save") in names
    editors = [el for el in mousepad.iter("text") if el.get(f"{{{ST}}}editable") == "true"]
    assert editors, "no editable text widget"
    # No accessible terminal is open (xterm has no AT-SPI support): OSWorld answers null.
    r = apps.client.get("/terminal")
    assert (r.status_code, r.json()) == (200, {"output": None, "status": "success"})


def test_accessibility_without_at_spi_answers_501(tmp_path: Path) -> None:
    base = {
        k: v
        for k, v in os.environ.items()
        if k not in ("DBUS_SESSION_BUS_ADDRESS", "AT_SPI_BUS_ADDRESS")
    }
    base.update(HOME=str(tmp_path), XDG_RUNTIME_DIR=str(tmp_path))
    with XvfbDisplay(640, 480) as display, serve(display.env(base), tmp_path, None) as srv:
        for path in ("/accessibility", "/terminal"):
            r = srv.client.get(path)
            assert r.status_code == 501
            assert r.json()["status"] == "error"
            assert "no AT-SPI bus" in r.json()["message"]


# --------------------------------------------------------------------------- recording


def test_recording_returns_an_mp4_of_the_screen(
    server: Server, session: Session, tmp_path: Path
) -> None:
    assert server.client.post("/end_recording").status_code == 400
    r = server.client.post("/start_recording")
    assert (r.status_code, r.json()["status"]) == (200, "success")
    assert server.client.post("/start_recording").status_code == 400
    for x in range(100, 600, 100):
        session.run("xdotool", "mousemove", str(x), "200")
    r = server.client.post("/end_recording")
    assert r.status_code == 200
    assert r.headers["content-type"] == "video/mp4"
    assert r.content[4:8] == b"ftyp"
    video = tmp_path / "recording.mp4"
    video.write_bytes(r.content)
    probe = subprocess.run(
        [
            "ffprobe",
            "-v",
            "error",
            "-show_entries",
            "stream=codec_type,width,height",
            "-of",
            "json",
            str(video),
        ],
        capture_output=True,
        text=True,
        timeout=WAIT_TIMEOUT_S,
        check=True,
    )
    streams = json.loads(probe.stdout)["streams"]
    assert streams == [{"codec_type": "video", "width": SCREEN_W, "height": SCREEN_H}]
    assert server.client.post("/end_recording").status_code == 400
