"""Integration: the desktops' window manager set-up on a real Xvfb + openbox with the
desktops' own configuration (``desktop/openbox-rc.xml``) and the desktop server's
click-to-focus watcher (``cua_rollout/desktop/click_focus.py``).

- A press on a window other than the active one activates it, and reaches it unchanged,
  without openbox grabbing the client area (its synchronous grab lost double-clicks' second
  clicks under load); without the watcher the same press leaves the focus where it was, so the
  watcher is what focuses.
- ``alt+Tab`` sent as agents send it (all four key events at once, by XTest) switches to the
  other window every time and leaves no keyboard grab behind (the interactive cycle it
  replaced kept the keyboard when Alt's release overtook its grab).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from cua_rollout.desktop.display import XvfbDisplay, terminate_process
from cua_rollout.desktop.entry import OPENBOX_RC
from tests.support import REPO_ROOT, unavailable

pytestmark = [pytest.mark.integration]

SCREEN_W, SCREEN_H = 1280, 720
MIN_DISPLAY = 140
WAIT_S = 10.0
POLL_S = 0.01
ROUNDS = 12
ALT_TABS = 40

# Two top-level windows: "main" (a normal window: openbox maximizes it) and "dialog" (a
# dialog transient for it, 300x200, which openbox centres on it and keeps above it). Each logs
# its button presses and focus changes as JSON lines.
APP = r"""
import json, sys, tkinter as tk
log = open(sys.argv[1], "a", buffering=1)
def write(**r): log.write(json.dumps(r) + "\n")
root = tk.Tk(className="wmprobe"); root.title("main")
dialog = tk.Toplevel(root); dialog.title("dialog"); dialog.geometry("300x200")
dialog.transient(root); dialog.attributes("-type", "dialog")
for name, w in (("main", root), ("dialog", dialog)):
    w.bind("<ButtonPress>", lambda e, n=name: write(event="press", window=n, x=e.x_root,
                                                    y=e.y_root, button=e.num))
    w.bind("<FocusIn>", lambda e, n=name: write(event="focus", window=n)
           if e.widget in (root, dialog) else None)
def ready():
    write(event="ready")
root.after(500, ready)
root.mainloop()
"""


@dataclass
class Screen:
    env: dict[str, str]
    log: Path
    workdir: Path

    def active_title(self) -> str | None:
        out = subprocess.run(["xdotool", "getactivewindow", "getwindowname"], env=self.env,
                             capture_output=True, text=True, timeout=WAIT_S)
        return out.stdout.strip() if out.returncode == 0 else None

    def wait_active(self, title: str) -> None:
        deadline = time.monotonic() + WAIT_S
        while (got := self.active_title()) != title:
            if time.monotonic() > deadline:
                pytest.fail(f"{title!r} not active within {WAIT_S} s (active: {got!r})")
            time.sleep(POLL_S)

    def geometry(self, title: str) -> tuple[int, int, int, int]:
        out = subprocess.run(["xdotool", "search", "--name", f"^{title}$",
                              "getwindowgeometry", "--shell"], env=self.env, check=True,
                             capture_output=True, text=True, timeout=WAIT_S).stdout
        values = dict(line.split("=", 1) for line in out.split() if "=" in line)
        return (int(values["X"]), int(values["Y"]), int(values["WIDTH"]),
                int(values["HEIGHT"]))

    def xdotool(self, *args: str) -> None:
        subprocess.run(["xdotool", *args], env=self.env, check=True, timeout=WAIT_S)

    def events(self) -> list[dict[str, Any]]:
        return [json.loads(line) for line in self.log.read_text().splitlines() if line]


@pytest.fixture(scope="module")
def screen() -> Iterator[Screen]:
    missing = [t for t in ("Xvfb", "openbox", "xdotool") if shutil.which(t) is None]
    if missing:
        unavailable(f"needs {', '.join(missing)} on PATH")
    root = Path(tempfile.mkdtemp(prefix="cua-wm-"))
    try:
        base = {k: v for k, v in os.environ.items() if "proxy" not in k.lower()}
        base["HOME"] = str(root)
        wm = ["openbox", "--config-file", str(OPENBOX_RC)]
        with XvfbDisplay(SCREEN_W, SCREEN_H, window_manager=wm, min_display=MIN_DISPLAY,
                         tmp_dir=root) as xvfb:
            env = xvfb.env(base)
            log = root / "events.jsonl"
            log.touch()
            app = subprocess.Popen([sys.executable, "-c", APP, str(log)], env=env,
                                   stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL)
            try:
                s = Screen(env, log, root)
                deadline = time.monotonic() + WAIT_S
                while not any(e["event"] == "ready" for e in s.events()):
                    assert app.poll() is None and time.monotonic() < deadline, "no window"
                    time.sleep(POLL_S)
                yield s
            finally:
                terminate_process(app, WAIT_S)
    finally:
        shutil.rmtree(root, ignore_errors=True)


@contextlib.contextmanager
def server(screen: Screen, *flags: str) -> Iterator[httpx.Client]:
    """The desktop server on this display (its click-to-focus watcher on unless a flag says
    otherwise), on a free loopback port; stopped by pid."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    log_path = screen.workdir / f"server-{port}.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "cua_rollout.desktop.server", "--host", "127.0.0.1", "--port",
             str(port), *flags],
            cwd=REPO_ROOT, env=screen.env, stdin=subprocess.DEVNULL, stdout=log, stderr=log)
    client = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=WAIT_S)
    try:
        deadline = time.monotonic() + 3 * WAIT_S
        while True:
            assert proc.poll() is None, f"the server exited:\n{log_path.read_text()}"
            with contextlib.suppress(httpx.TransportError):
                if client.get("/actions").status_code == 200:
                    break
            assert time.monotonic() < deadline, "the desktop server did not answer"
            time.sleep(0.05)
        yield client
    finally:
        client.close()
        terminate_process(proc, WAIT_S)


def _click(screen: Screen, x: int, y: int) -> None:
    screen.xdotool("mousemove", str(x), str(y), "click", "1")


def _presses_since(screen: Screen, start: int) -> list[dict[str, Any]]:
    return [e for e in screen.events()[start:] if e["event"] == "press"]


def test_a_press_on_an_inactive_window_activates_it_and_reaches_it(screen: Screen) -> None:
    mx, my, mw, mh = screen.geometry("main")
    assert mw >= SCREEN_W - 10 and mh >= SCREEN_H - 60, f"main is not maximized: {mw}x{mh}"
    dx, dy, dw, dh = screen.geometry("dialog")
    on_main = (mx + 40, my + mh - 40)  # away from the centred dialog
    on_dialog = (dx + dw // 2, dy + dh // 2)
    with server(screen) as client:
        before = client.get("/actions").json()
        assert before["click_focus"] is True and before["click_focus_error"] is None
        for _ in range(ROUNDS):
            for title, (x, y) in (("main", on_main), ("dialog", on_dialog)):
                start = len(screen.events())
                _click(screen, x, y)
                screen.wait_active(title)
                deadline = time.monotonic() + WAIT_S
                while not (presses := _presses_since(screen, start)):
                    assert time.monotonic() < deadline, f"no press reached {title}"
                    time.sleep(POLL_S)
                time.sleep(0.05)  # a second (wrong) press would have arrived by now
                presses = _presses_since(screen, start)
                assert [(p["window"], p["x"], p["y"], p["button"]) for p in presses] == [
                    (title, x, y, 1)]
        stats = client.get("/actions").json()
    assert stats["click_focus_presses"] - before["click_focus_presses"] == 2 * ROUNDS
    # every press landed on the inactive window
    assert stats["click_focus_activations"] - before["click_focus_activations"] == 2 * ROUNDS


def test_without_the_watcher_a_press_does_not_move_the_focus(screen: Screen) -> None:
    """The configuration binds nothing in the client area: focusing is the watcher's job."""
    mx, my, _, mh = screen.geometry("main")
    dx, dy, dw, dh = screen.geometry("dialog")
    with server(screen):
        _click(screen, dx + dw // 2, dy + dh // 2)
        screen.wait_active("dialog")
    with server(screen, "--no-click-focus") as client:
        assert client.get("/actions").json()["click_focus"] is False
        start = len(screen.events())
        _click(screen, mx + 40, my + mh - 40)
        deadline = time.monotonic() + WAIT_S
        while not _presses_since(screen, start):
            assert time.monotonic() < deadline, "the press did not reach main"
            time.sleep(POLL_S)
        time.sleep(0.3)
        assert screen.active_title() == "dialog"


def test_alt_tab_as_agents_send_it_switches_every_time(
        screen: Screen) -> None:
    with server(screen):
        _click(screen, 40, SCREEN_H - 40)
        screen.wait_active("main")
    # All four key events at once, as pyautogui.hotkey('alt', 'tab') and xdotool send them.
    # An interactive cycle that missed Alt's release would keep the keyboard and not switch.
    current = "main"
    for _ in range(ALT_TABS):
        screen.xdotool("key", "alt+Tab")
        current = "dialog" if current == "main" else "main"
        screen.wait_active(current)
