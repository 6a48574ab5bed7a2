"""Integration: plain pyautogui actions run in the desktop server's warm interpreter
(``cua_rollout/desktop/actions.py``, ``cua_rollout/desktop/action_worker.py``) and do what a fresh
``python -c`` does.

The grammar cases (``plain_action``) need no display. The rest share one real desktop per
module: Xvfb with openbox (no key or mouse bindings), ``tests/apps/probe_window.py`` (a Tk
window logging every input event and its Text widget's content) and ``python -m
cua_rollout.desktop.server`` on a free loopback port; every case talks to the server over HTTP and
checks
what reached the window, where the pointer is, and the server's ``/actions`` counters.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest

from cua_rollout.agents.uitars import Action, to_pyautogui
from cua_rollout.desktop.actions import (
    PYTHON_NAMES,
    ActionExecutor,
    interpreter_names,
    plain_action,
)
from cua_rollout.desktop.display import XvfbDisplay, terminate_process
from cua_rollout.desktop.processes import child_env
from cua_rollout.desktop.protocol import CommandRequest, execute_command
from tests.support import REPO_ROOT, TESTS_DIR, ProbeWindow, unavailable

SCREEN_W, SCREEN_H = 1280, 800
PROBE_APP = TESTS_DIR / "apps" / "probe_window.py"
PROBE_SIZE = "1000x700"
MIN_DISPLAY = 100  # far from :0 and :1, which stray clients default to
EXECUTE_LIMIT_S = 8.0  # the server's /execute limit here
START_TIMEOUT_S = 30.0
WAIT_TIMEOUT_S = 20.0
REQUEST_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 10.0
POLL_S = 0.02
# A sleeping action and the deadline its timeout must be reported by (the limit is 1 s).
SLEEP_S = 100
TIMEOUT_REPORTED_WITHIN_S = 3.0
# How long a running action is given to reach the worker before it is killed under it.
IN_FLIGHT_S = 1.0
CONCURRENT = 20
STAGGER_S = 0.05  # between the concurrent posts, so their order of arrival is known
ACTION_SLEEP_S = 0.2  # each concurrent action's own sleep (pyautogui adds its 0.1 s PAUSE)

OPENBOX_RC = """<?xml version="1.0" encoding="UTF-8"?>
<openbox_config xmlns="http://openbox.org/3.4/rc">
  <focus><focusNew>yes</focusNew><followMouse>no</followMouse></focus>
  <keyboard></keyboard>
  <mouse></mouse>
</openbox_config>
"""

_TOOLS = ("Xvfb", "openbox", "xdotool", "xmodmap")
pytestmark = [pytest.mark.integration]

Event = dict[str, Any]
Point = tuple[int, int]


# --------------------------------------------------------------------------- the grammar


def _code(*actions: Action) -> str:
    return to_pyautogui(list(actions))


GENERATED = {
    "click": _code(Action("click", point=(120, 340))),
    "left_double": _code(Action("left_double", point=(5, 6))),
    "right_single": _code(Action("right_single", point=(640, 400))),
    "hover": _code(Action("hover", point=(1, 2))),
    "drag": _code(Action("drag", point=(10, 20), end_point=(300, 400))),
    "hotkey": _code(Action("hotkey", keys=["ctrl", "shift", "t"])),
    "press": _code(Action("press", keys=["enter"])),
    "keydown": _code(Action("keydown", keys=["shift"])),
    "keyup": _code(Action("keyup", keys=["shift"])),
    "scroll_up": _code(Action("scroll", point=(50, 60), direction="up")),
    "scroll_down_here": _code(Action("scroll", direction="down")),
    "scroll_left": _code(Action("scroll", point=(50, 60), direction="left")),
    "scroll_right": _code(Action("scroll", direction="right")),
    "type_ascii": _code(Action("type", content="Hello, world! <b> 'quoted' \"dq\" \\ end\n")),
    "type_empty": _code(Action("type", content="")),
    "several": _code(Action("click", point=(1, 1)), Action("type", content="abc"),
                     Action("hotkey", keys=["ctrl", "a"])),
}


@pytest.mark.parametrize("kind", sorted(GENERATED))
def test_the_code_ui_tars_generates_is_plain(kind: str) -> None:
    code = GENERATED[kind]
    command = execute_command(code)
    assert plain_action(command) == command[2]
    assert plain_action(CommandRequest(command=command)) == command[2]
    for python in ("python3", sys.executable, f"python3.{sys.version_info.minor}"):
        assert plain_action(execute_command(code, python)) == command[2]


PLAIN_EXTRAS = [
    "import pyautogui, time\npyautogui.FAILSAFE = True\npass",
    "import time; time.sleep(0.5)",
    "import pyautogui; pyautogui.moveTo(-5, +7.5, duration=0.0, tween=None)",
    "import pyautogui; pyautogui.press(['a', 'b'], presses=2)",
    "import pyautogui; pyautogui.click((1, 2), clicks=2, interval=0.1, button='right')",
    "import pyautogui; pyautogui.dragRel(10, -10, 0.2, button='left', mouseDownUp=True)",
    "",
]


@pytest.mark.parametrize("code", PLAIN_EXTRAS)
def test_the_grammar_takes_literal_calls_imports_and_failsafe(code: str) -> None:
    assert plain_action(["python", "-c", code]) == code


REFUSED = {
    "unicode helper": _code(Action("type", content="héllo wörld")),
    "import os": "import pyautogui; import os",
    "__import__": "import pyautogui; __import__('os').system('true')",
    "from import": "from pyautogui import click; click(1, 2)",
    "import as": "import pyautogui as p; p.click(1, 2)",
    "attribute chain": "import pyautogui; pyautogui.platformModule._display.close()",
    "name argument": "import pyautogui; x = 1; pyautogui.click(x)",
    "bare name argument": "import pyautogui; pyautogui.click(x)",
    "exec": "exec('import os')",
    "eval in argument": "import pyautogui; pyautogui.write(eval('1'))",
    "print": "import pyautogui; print(pyautogui.size())",
    "other function": "import pyautogui; pyautogui.screenshot('/tmp/x.png')",
    "other time function": "import time; time.time()",
    "PAUSE set": "import pyautogui; pyautogui.PAUSE = 0",
    "FAILSAFE not a bool": "import pyautogui; pyautogui.FAILSAFE = 0",
    "f-string": "import pyautogui; pyautogui.write(f'{1}')",
    "arithmetic": "import pyautogui; pyautogui.click(1 + 2, 3)",
    "star args": "import pyautogui; pyautogui.click(*[1, 2])",
    "star kwargs": "import pyautogui; pyautogui.click(**{'x': 1})",
    "comprehension": "import pyautogui; pyautogui.hotkey([k for k in 'ab'])",
    "lambda": "import pyautogui; pyautogui.moveTo(1, 2, tween=lambda n: n)",
    "subprocess": "import subprocess; subprocess.run(['true'])",
    "string statement": "'docstring'; import pyautogui",
    "loop": "import pyautogui\nfor i in range(3): pyautogui.press('a')",
    "bytes": "import pyautogui; pyautogui.write(b'abc')",
    "complex": "import pyautogui; pyautogui.click(1j, 2)",
    "too deep": "import pyautogui; pyautogui.click([[[[1]]]])",
    "repeated keyword": "import pyautogui; pyautogui.click(x=1, x=2)",
    "syntax error": "import pyautogui; pyautogui.click(",
    "null byte": "import pyautogui; pyautogui.write('\0')\0",
    "lone surrogate": "import pyautogui; pyautogui.write('\ud800')",
    "walrus": "import pyautogui; pyautogui.click((y := 1), 2)",
    "assignment": "import pyautogui; pyautogui.click = None",
    "method on literal": "import pyautogui; pyautogui.write('a'.upper())",
}


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_the_grammar_refuses_everything_else(name: str) -> None:
    assert plain_action(["python", "-c", REFUSED[name]]) is None


@pytest.mark.parametrize(
    "command",
    [
        ["python", "-c", "import pyautogui", "extra"],
        ["python", "-m", "pyautogui"],
        ["bash", "-c", "import pyautogui"],
        ["/usr/bin/env", "-c", "import pyautogui"],
        ["python2", "-c", "import pyautogui"],
        ["python", "-c"],
        "python -c 'import pyautogui'",
    ],
    ids=repr,
)
def test_only_python_dash_c_code_is_plain(command: list[str] | str) -> None:
    assert plain_action(command) is None
    request = CommandRequest(command=["python", "-c", "import pyautogui"], shell=True)
    assert plain_action(request) is None


def test_interpreter_names_are_those_that_run_the_servers_own_python() -> None:
    names = interpreter_names(child_env())
    assert sys.executable in names and names <= PYTHON_NAMES
    assert "python" in names  # the venv's bin directory is first on a child's PATH
    assert interpreter_names({"PATH": "/nonexistent"}) == {sys.executable}
    assert plain_action(["python", "-c", "pass"], pythons={sys.executable}) is None


def test_an_executor_that_cannot_start_leaves_actions_to_fresh_processes() -> None:
    command = ["python", "-c", "pass"]

    async def go(executor: ActionExecutor) -> dict[str, Any]:
        try:
            assert await executor.run("pass", command, timeout_s=WAIT_TIMEOUT_S) is None
            # No new attempt before retry_after_s: the next action goes fresh at once.
            assert await executor.run("pass", command, timeout_s=WAIT_TIMEOUT_S) is None
            return executor.stats()
        finally:
            await executor.close()

    stats = asyncio.run(go(ActionExecutor(child_env(), python="/bin/false")))
    assert (stats["starts"], stats["start_failures"], stats["worker_pid"]) == (1, 1, None)
    assert "ended at its start (exit status 1)" in stats["last_error"]
    no_display = {k: v for k, v in child_env().items() if k != "DISPLAY"}
    stats = asyncio.run(go(ActionExecutor(no_display)))  # importing pyautogui fails
    assert (stats["starts"], stats["start_failures"], stats["warm"]) == (1, 1, 0)
    assert "KeyError: 'DISPLAY'" in stats["last_error"]


# --------------------------------------------------------------------------- the desktop


@dataclass
class Desktop:
    display: XvfbDisplay
    env: dict[str, str]
    probe: ProbeWindow
    ready: Event
    server: subprocess.Popen[bytes]
    url: str
    client: httpx.Client
    log_path: Path

    def run(self, *argv: str) -> str:
        return subprocess.run(argv, env=self.env, capture_output=True, text=True,
                              timeout=WAIT_TIMEOUT_S, check=True).stdout

    def pointer(self) -> Point:
        values = dict(line.split("=", 1)
                      for line in self.run("xdotool", "getmouselocation", "--shell").split())
        return int(values["X"]), int(values["Y"])

    def execute(self, command: list[str] | str, **extra: Any) -> httpx.Response:
        return self.client.post("/execute", json={"command": command, **extra})

    def act(self, code: str) -> dict[str, Any]:
        """Post pyautogui code as OSWorld's client does; the reply, which must be a success."""
        r = self.execute(execute_command(code))
        assert r.status_code == 200, r.text
        return r.json()

    def stats(self) -> dict[str, Any]:
        r = self.client.get("/actions")
        assert r.status_code == 200, r.text
        return r.json()

    def fresh_run(self, command: list[str]) -> subprocess.CompletedProcess[str]:
        """The command as a fresh /execute process runs it (the server's child environment)."""
        return subprocess.run(command, env=child_env(self.env), capture_output=True, text=True,
                              timeout=WAIT_TIMEOUT_S, check=False, cwd=REPO_ROOT,
                              stdin=subprocess.DEVNULL)

    def canvas_point(self, fx: float, fy: float) -> Point:
        x, y, w, h = self.ready["canvas"]
        return x + round(w * fx), y + round(h * fy)

    def server_log(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def wait_until(probe: Callable[[], Any], what: str, timeout_s: float = WAIT_TIMEOUT_S) -> Any:
    deadline = time.monotonic() + timeout_s
    while not (value := probe()):
        if time.monotonic() >= deadline:
            pytest.fail(f"no {what} within {timeout_s} s")
        time.sleep(POLL_S)
    return value


@contextlib.contextmanager
def serve(env: dict[str, str], workdir: Path, *extra: str) -> Iterator[
        tuple[subprocess.Popen[bytes], str, httpx.Client, Path]]:
    """``python -m cua_rollout.desktop.server`` on a free port; stopped by pid at the end."""
    port = _free_port()
    log_path = workdir / f"server-{port}.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "cua_rollout.desktop.server",
             "--host", "127.0.0.1", "--port", str(port),
             "--execute-timeout-s", str(EXECUTE_LIMIT_S), "--kill-grace-s", "2", *extra],
            cwd=REPO_ROOT, env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=log,
        )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    client = httpx.Client(base_url=url, timeout=REQUEST_TIMEOUT_S)
    try:

        def ready() -> bool:
            if proc.poll() is not None:
                pytest.fail(f"the server exited ({proc.returncode}):\n{log_path.read_text()}")
            with contextlib.suppress(httpx.TransportError):
                return client.get("/platform").status_code == 200
            return False

        wait_until(ready, "answer from the desktop server", START_TIMEOUT_S)
        yield proc, url, client, log_path
    finally:
        client.close()
        children = []
        with contextlib.suppress(psutil.Error):
            children = psutil.Process(proc.pid).children(recursive=True)
        terminate_process(proc, STOP_TIMEOUT_S)
        # Its worker ends with it (end of its stdin); make sure, by pid.
        for child in children:
            with contextlib.suppress(psutil.Error):
                if child.status() != psutil.STATUS_ZOMBIE:
                    child.wait(STOP_TIMEOUT_S)


@pytest.fixture(scope="module")
def desktop() -> Iterator[Desktop]:
    missing = [t for t in _TOOLS if shutil.which(t) is None]
    if missing:
        unavailable(f"needs {', '.join(missing)} on PATH")
    root = Path(tempfile.mkdtemp(prefix="cua-actions-"))
    try:
        home = root / "home"
        home.mkdir()
        (root / "openbox-rc.xml").write_text(OPENBOX_RC)
        wm = ["openbox", "--config-file", str(root / "openbox-rc.xml")]
        base = {k: v for k, v in os.environ.items() if "proxy" not in k.lower()}
        base["HOME"] = str(home)
        with XvfbDisplay(SCREEN_W, SCREEN_H, window_manager=wm, min_display=MIN_DISPLAY,
                         tmp_dir=root) as display:
            env = display.env(base)
            log_path = root / "events.jsonl"
            log_path.touch()
            with open(root / "probe.stderr", "wb") as stderr:
                probe_proc = subprocess.Popen(
                    [sys.executable, str(PROBE_APP), str(log_path), PROBE_SIZE],
                    stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=stderr, env=env,
                )  # fmt: skip
            try:
                probe = ProbeWindow(probe_proc, log_path, timeout_s=WAIT_TIMEOUT_S)
                ready = probe.events[probe.wait_for(lambda e: e["event"] == "ready", "ready")]
                with serve(env, root) as (server, url, client, server_log):
                    d = Desktop(display, env, probe, ready, server, url, client, server_log)
                    wait_until(lambda: d.stats()["worker_pid"], "warm worker at server start")
                    yield d
                    assert server.poll() is None, f"the server died:\n{d.server_log()}"
            finally:
                assert probe_proc.stdin is not None
                with contextlib.suppress(BrokenPipeError):
                    probe_proc.stdin.close()
                try:
                    probe_proc.wait(timeout=STOP_TIMEOUT_S)
                except subprocess.TimeoutExpired:
                    terminate_process(probe_proc, STOP_TIMEOUT_S)
    finally:
        shutil.rmtree(root, ignore_errors=True)


OK = {"status": "success", "output": "", "error": "", "returncode": 0}


# --------------------------------------------------------------------------- what actions do


def test_the_worker_is_no_app_and_its_settings_show(desktop: Desktop) -> None:
    stats = desktop.stats()
    assert stats["enabled"] is True and stats["start_failures"] == 0
    pid = stats["worker_pid"]
    assert psutil.Process(pid).ppid() == desktop.server.pid
    assert os.getsid(pid) == pid  # a session (and process group) of its own
    assert pid not in [a["pid"] for a in desktop.client.get("/apps").json()["apps"]]
    # A reset's /apps/kill leaves the idle worker alone.
    r = desktop.client.post("/apps/kill")
    assert r.status_code == 200 and pid not in r.json()["killed"]
    assert desktop.stats()["worker_pid"] == pid and not _gone(pid)


def test_a_click_moves_the_real_pointer_and_clicks(desktop: Desktop) -> None:
    before = desktop.stats()
    target = desktop.canvas_point(0.3, 0.5)
    start = desktop.probe.command("sync")
    assert desktop.act(_code(Action("click", point=target))) == OK
    x, y = target
    i = desktop.probe.wait_for(lambda e: e["event"] == "press" and (e["x"], e["y"]) == target
                               and e["button"] == 1, "press at the target", start=start)
    desktop.probe.wait_for(lambda e: e["event"] == "release" and (e["x"], e["y"]) == target,
                           "release at the target", start=i)
    assert desktop.pointer() == (x, y)
    after = desktop.stats()
    assert after["warm"] == before["warm"] + 1
    assert after["fresh"] == before["fresh"]
    assert after["worker_pid"] == before["worker_pid"]


def test_write_types_into_a_real_text_widget(desktop: Desktop) -> None:
    probe = desktop.probe
    probe.command("clear")
    probe.command("focus")
    start = len(probe.events)
    text = "Warm typing, 42 <keys> & 'quotes'!"
    before = desktop.stats()
    assert desktop.act(_code(Action("type", content=text))) == OK
    probe.text_after(start, text)
    assert desktop.stats()["warm"] == before["warm"] + 1


def test_an_exception_answers_as_a_fresh_process_would(desktop: Desktop) -> None:
    command = execute_command("pyautogui.click(1, 2, button='nope')")
    r = desktop.execute(command)
    fresh = desktop.fresh_run(command)
    assert fresh.returncode == 1 and "PyAutoGUIException" in fresh.stderr
    assert r.status_code == 200
    assert r.json() == {"status": "success", "output": fresh.stdout, "error": fresh.stderr,
                        "returncode": 1}
    assert r.json()["error"].startswith('Traceback (most recent call last):\n  File "<string>"')


def test_every_action_starts_from_pyautoguis_defaults(desktop: Desktop) -> None:
    """OSWorld's prefix turns the fail-safe off; the next action that does not is back at
    pyautogui's default (on) in the worker too, and fails in the corner as a fresh one."""
    assert desktop.act("pyautogui.moveTo(300, 300)") == OK  # FAILSAFE = False in this one
    before = desktop.stats()
    command = ["python", "-c", "import pyautogui; pyautogui.moveTo(0, 0); pyautogui.moveTo(9, 9)"]
    warm = desktop.execute(command).json()
    assert desktop.stats()["warm"] == before["warm"] + 1
    desktop.run("xdotool", "mousemove", "300", "300")
    fresh = desktop.fresh_run(command)
    assert fresh.returncode == 1 and "FailSafeException" in fresh.stderr
    assert warm == {"status": "success", "output": fresh.stdout, "error": fresh.stderr,
                    "returncode": 1}
    assert desktop.pointer() == (0, 0)
    assert desktop.act("pyautogui.moveTo(9, 9)") == OK  # with the prefix, fine again


def test_a_time_limit_kills_the_worker_and_the_next_action_gets_a_new_one(
    desktop: Desktop,
) -> None:
    before = desktop.stats()
    old = before["worker_pid"]
    started = time.monotonic()
    r = desktop.execute(["python", "-c", f"import time; time.sleep({SLEEP_S})"], timeout=1)
    assert time.monotonic() - started < TIMEOUT_REPORTED_WITHIN_S
    assert r.status_code == 500, r.text
    assert r.json()["status"] == "error"
    assert "timed out after 1 seconds" in r.json()["message"]
    assert _gone(old)
    target = desktop.canvas_point(0.6, 0.4)
    assert desktop.act(_code(Action("hover", point=target))) == OK
    assert desktop.pointer() == target
    after = desktop.stats()
    assert after["timeouts"] == before["timeouts"] + 1
    assert after["warm"] == before["warm"] + 2
    assert after["worker_pid"] not in (None, old)
    assert after["restarts"] == before["restarts"] + 1 and after["deaths"] == before["deaths"]


def test_a_killed_worker_is_replaced(desktop: Desktop) -> None:
    before = desktop.stats()
    old = before["worker_pid"]
    os.kill(old, signal.SIGKILL)
    wait_until(lambda: desktop.stats()["deaths"] == before["deaths"] + 1, "the death counted")
    target = desktop.canvas_point(0.2, 0.2)
    assert desktop.act(_code(Action("hover", point=target))) == OK
    assert desktop.pointer() == target
    after = desktop.stats()
    assert after["worker_pid"] not in (None, old)
    assert after["warm"] == before["warm"] + 1 and after["fresh"] == before["fresh"]


def _in_background(desktop: Desktop, command: list[str]) -> tuple[threading.Thread, list[Any]]:
    answers: list[Any] = []

    def post() -> None:
        answers.append(httpx.post(f"{desktop.url}/execute", json={"command": command},
                                  timeout=REQUEST_TIMEOUT_S))

    thread = threading.Thread(target=post)
    thread.start()
    return thread, answers


def test_an_action_whose_worker_dies_answers_like_a_killed_process(desktop: Desktop) -> None:
    old = desktop.stats()["worker_pid"]
    thread, answers = _in_background(desktop, ["python", "-c", "import time; time.sleep(30)"])
    time.sleep(IN_FLIGHT_S)
    os.kill(old, signal.SIGKILL)
    thread.join(WAIT_TIMEOUT_S)
    assert answers, "no answer after the worker was killed"
    r = answers[0]
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["returncode"] == -signal.SIGKILL
    assert "ended while running this action" in body["error"]
    assert desktop.act("pyautogui.moveTo(33, 44)") == OK
    assert desktop.stats()["worker_pid"] not in (None, old)


def test_apps_kill_ends_a_running_action(desktop: Desktop) -> None:
    """A reset ends a command that runs; in the worker, as in a fresh process, with SIGTERM."""
    old = desktop.stats()["worker_pid"]
    thread, answers = _in_background(desktop, ["python", "-c", "import time; time.sleep(30)"])
    time.sleep(IN_FLIGHT_S)
    killed = desktop.client.post("/apps/kill").json()
    assert killed["remaining"] == []
    thread.join(WAIT_TIMEOUT_S)
    assert answers and answers[0].json()["returncode"] == -signal.SIGTERM
    assert _gone(old)
    assert desktop.act("pyautogui.moveTo(55, 66)") == OK


def test_other_commands_still_run_in_a_fresh_process(desktop: Desktop) -> None:
    before = desktop.stats()
    worker = before["worker_pid"]
    r = desktop.execute(["python", "-c", "import os; print(os.getpid())"])
    assert r.status_code == 200 and r.json()["returncode"] == 0
    assert int(r.json()["output"]) != worker
    r = desktop.execute(["python3", "-c", "import pyautogui; print(pyautogui.size())"])
    assert r.json()["output"] == f"Size(width={SCREEN_W}, height={SCREEN_H})\n"
    r = desktop.execute("echo $PPID", shell=True)
    assert r.json()["output"].strip() == str(desktop.server.pid)
    after = desktop.stats()
    assert after["fresh"] == before["fresh"] + 3 and after["fallbacks"] == before["fallbacks"]
    assert after["warm"] == before["warm"] and after["worker_pid"] == worker


def test_concurrent_actions_run_one_at_a_time_in_order(desktop: Desktop) -> None:
    before = desktop.stats()

    async def post_all() -> list[tuple[int, float, dict[str, Any]]]:
        async with httpx.AsyncClient(base_url=desktop.url, timeout=REQUEST_TIMEOUT_S) as client:

            async def one(i: int) -> tuple[int, float, dict[str, Any]]:
                await asyncio.sleep(i * STAGGER_S)
                code = f"pyautogui.moveTo({100 + i}, 200); time.sleep({ACTION_SLEEP_S})"
                r = await client.post("/execute", json={"command": execute_command(code)})
                return i, time.monotonic(), r.json()

            return await asyncio.gather(*(one(i) for i in range(CONCURRENT)))

    started = time.monotonic()
    results = asyncio.run(post_all())
    assert all(body == OK for _, _, body in results)
    by_end = sorted(results, key=lambda x: x[1])
    assert [i for i, _, _ in by_end] == list(range(CONCURRENT))
    ends = [end for _, end, _ in by_end]
    # One at a time: each answer comes at least one action's sleep after the one before.
    assert all(b - a >= ACTION_SLEEP_S * 0.9 for a, b in itertools.pairwise(ends))
    assert ends[-1] - started >= CONCURRENT * ACTION_SLEEP_S
    assert desktop.pointer() == (100 + CONCURRENT - 1, 200)
    assert desktop.stats()["warm"] == before["warm"] + CONCURRENT


def _keymap(desktop: Desktop) -> dict[int, str]:
    """keycode -> its ``xmodmap -pke`` line (``keycode  38 = a A a A``)."""
    out = {}
    for line in desktop.run("xmodmap", "-pke").splitlines():
        head, _, _ = line.partition("=")
        out[int(head.split()[1])] = line.strip()
    return out


def _keycode_of(keymap: dict[int, str], keysym: str) -> int:
    return next(code for code, line in keymap.items() if line.partition("=")[2].split()[:1]
                == [keysym])


def test_a_changed_keyboard_mapping_is_not_typed_with_stale_keycodes(desktop: Desktop) -> None:
    """pyautogui reads the keycodes of characters at import; after a remap a fresh process
    types with the new ones, and so does the server (the action falls back, and the next
    worker reads the new mapping)."""
    keymap = _keymap(desktop)
    a, q = _keycode_of(keymap, "a"), _keycode_of(keymap, "q")
    probe = desktop.probe
    before = desktop.stats()
    desktop.run("xmodmap", "-e", f"keycode {a} = q Q", "-e", f"keycode {q} = a A")
    try:
        probe.command("clear")
        probe.command("focus")
        start = len(probe.events)
        assert desktop.act("pyautogui.write('aq')") == OK
        probe.text_after(start, "aq")
        assert desktop.act("pyautogui.write('qa')") == OK
        probe.text_after(start, "aqqa")
        after = desktop.stats()
        assert after["fallbacks"] == before["fallbacks"] + 1
        assert after["warm"] == before["warm"] + 1
        assert after["worker_pid"] != before["worker_pid"]
    finally:
        desktop.run("xmodmap", "-e", keymap[a], "-e", keymap[q])
    assert _keymap(desktop) == keymap


def test_without_warm_actions_every_command_runs_fresh(desktop: Desktop) -> None:
    root = Path(tempfile.mkdtemp(prefix="cua-actions-off-"))
    env = {**desktop.env, "CUA_DESKTOP_WARM_ACTIONS": "0"}
    try:
        with serve(env, root) as (proc, _url, client, _log):
            stats = client.get("/actions").json()
            assert stats["enabled"] is False and stats["worker_pid"] is None
            assert psutil.Process(proc.pid).children() == []
            command = execute_command("pyautogui.click(1, 2, button='nope')")
            fresh = client.post("/execute", json={"command": command}).json()
            warm = desktop.execute(command).json()
            assert fresh == warm and fresh["returncode"] == 1
            r = client.post("/execute", json={"command": execute_command("pyautogui.moveTo(7, 8)")})
            assert r.json() == OK and desktop.pointer() == (7, 8)
            stats = client.get("/actions").json()
            assert (stats["warm"], stats["fresh"], stats["fallbacks"]) == (0, 2, 0)
    finally:
        shutil.rmtree(root, ignore_errors=True)
