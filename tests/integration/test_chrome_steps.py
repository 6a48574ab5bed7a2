"""Integration: OSWorld's chrome setup steps against a real headless Chromium, reached over
its DevTools endpoint as a desktop's browser is (``chrome_open_tabs``, ``chrome_close_tabs``),
with pages served by a loopback HTTP server; ``update_browse_history`` against a desktop whose
files are a local folder, on a History database Chromium made, which Chromium then shows.

Each browser runs in a process group of its own, started and ended by pid here.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import socket
import sqlite3
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from cua_rollout.config import DesktopsConfig
from cua_rollout.core.http import ThreadedServer
from cua_rollout.envs import chrome
from cua_rollout.envs.setup_steps import run_setup_step
from tests.support import unavailable

pytestmark = pytest.mark.integration

CHROMIUM = "/usr/bin/chromium"
# A browser's DevTools endpoint is up within this (a cold start on two cores takes ~5 s).
START_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 20.0
# How long each page's image takes to arrive: the load event comes after it.
SLOW_IMAGE_S = 1.0
# The chrome://history page lists entries within this.
HISTORY_PAGE_TIMEOUT_S = 20.0
# A 1x1 PNG.
PIXEL = bytes.fromhex(
    "89504e470d0a1a0a0000000d4948445200000001000000010806000000"
    "1f15c4890000000d49444154789c6360000002000001e221bc330000000049454e44ae426082")


# --------------------------------------------------------------------------- the browser


@dataclass
class Browser:
    process: subprocess.Popen[bytes]
    url: str
    profile: Path


def start_chromium(profile: Path, port: int = 0, *, wait: bool = True) -> Browser:
    """Headless Chromium on ``profile`` with remote debugging on ``port`` (0: one it picks,
    read from ``DevToolsActivePort`` once it listens; ``wait`` for that)."""
    if not Path(CHROMIUM).exists():
        unavailable(f"{CHROMIUM} is not installed")
    profile.mkdir(parents=True, exist_ok=True)
    log = open(profile.parent / f"{profile.name}.log", "wb")  # noqa: SIM115 — the child's
    process = subprocess.Popen(
        [CHROMIUM, "--headless=new", f"--remote-debugging-port={port}",
         f"--user-data-dir={profile}", "--no-sandbox", "--no-first-run"],
        stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    log.close()
    browser = Browser(process, f"http://127.0.0.1:{port}", profile)
    if not wait:
        return browser
    port_file = profile / "DevToolsActivePort"
    deadline = time.monotonic() + START_TIMEOUT_S
    while not (port_file.exists() and port_file.read_text().strip()):
        if process.poll() is not None or time.monotonic() > deadline:
            stop_chromium(browser)
            tail = (profile.parent / f"{profile.name}.log").read_text(errors="replace")[-2000:]
            pytest.fail(f"chromium did not start its DevTools endpoint: {tail}")
        time.sleep(0.1)
    browser.url = f"http://127.0.0.1:{int(port_file.read_text().split()[0])}"
    return browser


def stop_chromium(browser: Browser) -> None:
    """End the browser's process group (its own, made at start) by its pid: SIGTERM lets
    it write its profile out; SIGKILL if it does not end in time."""
    process = browser.process
    if process.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            process.wait()


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    folder = Path(tempfile.mkdtemp(prefix="cua-chrome-"))
    running = start_chromium(folder / "profile")
    try:
        yield running
    finally:
        stop_chromium(running)
        shutil.rmtree(folder, ignore_errors=True)


# --------------------------------------------------------------------------- the pages


class PageServer:
    """``/page/<name>``: a page titled ``<name>`` whose image takes ``SLOW_IMAGE_S``; the
    image's path is recorded in ``images_sent`` just before its bytes go out, so a page
    whose load event fired has its image recorded."""

    def __init__(self) -> None:
        self.images_sent: set[str] = set()
        self._server = ThreadedServer(self._app).start()
        self.url = self._server.url

    async def _app(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        path = scope["path"]
        if path.startswith("/page/"):
            name = path.removeprefix("/page/")
            body = (f"<html><head><title>{name}</title></head><body>"
                    f"<img src='/image/{name}.png'></body></html>").encode()
            kind = b"text/html"
            status = 200
        elif path.startswith("/image/"):
            await asyncio.sleep(SLOW_IMAGE_S)
            self.images_sent.add(path)
            body, kind, status = PIXEL, b"image/png", 200
        else:
            body, kind, status = b"not found", b"text/plain", 404
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", kind),
                                (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})

    def page(self, name: str) -> str:
        return f"{self.url}/page/{name}"

    def close(self) -> None:
        self._server.stop()


@pytest.fixture
def pages() -> Iterator[PageServer]:
    server = PageServer()
    try:
        yield server
    finally:
        server.close()


# --------------------------------------------------------------------------- the desktop


class FolderDesktop:
    """A desktop for setup steps whose home folder is ``home`` on this host: uploads to
    ``~/...`` land there and shell commands run with ``HOME=home``; its browser is at
    ``devtools_url``."""

    def __init__(self, cfg: DesktopsConfig, home: Path, devtools_url: str) -> None:
        self.cfg = cfg
        self.task_id: str | None = "chrome-task"
        self.home = home
        self.devtools_url = devtools_url
        self.client_password = None
        self.commands: list[tuple[str, int]] = []

    async def upload(self, path: str, data: bytes) -> None:
        assert path.startswith("~/"), f"expected a path in the home folder: {path}"
        target = self.home / path.removeprefix("~/")
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(data)

    async def setup_execute(self, command: list[str] | str, shell: bool = False
                            ) -> dict[str, Any]:
        done = await asyncio.to_thread(
            subprocess.run, command, shell=shell, capture_output=True, text=True,
            env={**os.environ, "HOME": str(self.home)}, timeout=30, check=False)
        self.commands.append((str(command), done.returncode))
        return {"returncode": done.returncode, "output": done.stdout, "error": done.stderr}


def desktop_for(browser_url: str, tmp: Path) -> FolderDesktop:
    cfg = DesktopsConfig(download_cache_dir=tmp / "cache", offline=True, request_timeout_s=10)
    return FolderDesktop(cfg, tmp / "home", browser_url)


async def page_tabs(url: str) -> list[chrome.Tab]:
    async with chrome.DevTools(url, timeout_s=10) as devtools:
        return await devtools.tabs()


# --------------------------------------------------------------------------- the tab steps


async def test_open_tabs_loads_each_url_and_closes_the_start_tab(
        browser: Browser, pages: PageServer, tmp: Path) -> None:
    before = await page_tabs(browser.url)
    assert before, "a browser starts with a tab"
    start_tab = before[-1]  # the least recently active: the tab the browser started with
    urls = [pages.page("first"), pages.page("second")]
    step = {"type": "chrome_open_tabs", "parameters": {"urls_to_open": urls}}

    await run_setup_step(desktop_for(browser.url, tmp), step)

    assert pages.images_sent == {"/image/first.png", "/image/second.png"}, \
        "the step returned before its pages had loaded"
    after = await page_tabs(browser.url)
    assert [(tab.url, tab.title) for tab in after[:2]] == [(urls[1], "second"),
                                                           (urls[0], "first")]
    ids = {tab.id for tab in after}
    assert start_tab.id not in ids
    assert {tab.id for tab in before[:-1]} <= ids, "only the start tab is closed"
    assert len(after) == len(before) + 1


async def test_open_tabs_waits_for_a_browser_that_is_starting(
        pages: PageServer, tmp: Path) -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    step = {"type": "chrome_open_tabs", "parameters": {"urls_to_open": [pages.page("late")]}}
    opening = asyncio.create_task(run_setup_step(desktop_for(url, tmp), step))
    await asyncio.sleep(1.0)  # the step asks a browser that is not there yet
    assert not opening.done()
    late = start_chromium(tmp / "late-profile", port, wait=False)
    try:
        await asyncio.wait_for(opening, START_TIMEOUT_S + 30)
        assert [(tab.url, tab.title) for tab in await page_tabs(url)] == \
            [(pages.page("late"), "late")]
    finally:
        opening.cancel()
        stop_chromium(late)


async def test_a_slow_or_failing_page_stays_open_with_a_warning(
        browser: Browser, pages: PageServer, caplog: pytest.LogCaptureFixture) -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))  # bound, not listening: the page is refused
        refused = f"http://127.0.0.1:{sock.getsockname()[1]}/"
        async with chrome.DevTools(browser.url, timeout_s=10) as devtools:
            opened = await chrome.open_tabs(devtools, [pages.page("slow"), refused],
                                            load_timeout_s=SLOW_IMAGE_S / 4)
            assert "/image/slow.png" not in pages.images_sent, "it waited past its timeout"
            listed = {tab.id: tab.url for tab in await devtools.tabs()}
    assert [tab.id in listed for tab in opened] == [True, True]
    assert listed[opened[0].id] == pages.page("slow")
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert any("slow" in w and "not loaded within" in w for w in warnings), warnings
    assert any(refused in w and "ERR_CONNECTION_REFUSED" in w for w in warnings), warnings


async def test_close_tabs_closes_the_oldest_matching_tab_per_url(
        browser: Browser, pages: PageServer, tmp: Path) -> None:
    async with chrome.DevTools(browser.url, timeout_s=10) as devtools:
        older = await devtools.new_tab(pages.page("dup"))
        other = await devtools.new_tab(pages.page("other"))
        newer = await devtools.new_tab(pages.page("dup"))
    # OSWorld's matching ignores the port; a URL no tab shows closes nothing.
    urls = ["http://127.0.0.1:1/page/dup", pages.page("other")]
    step = {"type": "chrome_close_tabs", "parameters": {"urls_to_close": urls}}

    await run_setup_step(desktop_for(browser.url, tmp), step)

    left = await page_tabs(browser.url)
    ids = {tab.id for tab in left}
    shown = f"older={older.id} other={other.id} newer={newer.id}, left: {left}"
    assert newer.id in ids, shown
    assert older.id not in ids and other.id not in ids, shown


async def test_close_tabs_without_a_match_closes_nothing(browser: Browser) -> None:
    async with chrome.DevTools(browser.url, timeout_s=10) as devtools:
        before = {tab.id for tab in await devtools.tabs()}
        closed = await chrome.close_tabs(devtools, ["https://nowhere.example/"],
                                         appear_wait_s=0.5)
        assert closed == []
        assert {tab.id for tab in await devtools.tabs()} == before


# --------------------------------------------------------------------------- History


def history_template(tmp: Path) -> Path:
    """The History database of a new Chromium profile (Chrome's current schema, no rows),
    as OSWorld's template is: Chromium makes it at start and writes it out when ended."""
    profile = tmp / "template-profile"
    stop_chromium(start_chromium(profile))
    made = profile / "Default" / "History"
    assert made.is_file(), "chromium made no History database"
    with contextlib.closing(sqlite3.connect(made)) as db:
        assert db.execute("SELECT count(*) FROM urls").fetchone() == (0,)
    return made


def chrome_time_of(moment: datetime) -> int:
    return (moment - datetime(1601, 1, 1, tzinfo=UTC)) // timedelta(microseconds=1)


# Collects the text of a page and of the shadow trees in it (chrome://history renders there).
PAGE_TEXT = ("(function text(node) { let out = ''; if (node.shadowRoot) out += "
             "text(node.shadowRoot); for (const child of node.childNodes) out += "
             "child.nodeType === 3 ? child.textContent + ' ' : text(child); return out; })"
             "(document.body)")


async def test_update_browse_history_fills_chromes_history(tmp: Path) -> None:
    desktop = desktop_for("http://127.0.0.1:9", tmp)
    cache = Path(desktop.cfg.download_cache_dir)
    cache.mkdir()
    shutil.copyfile(history_template(tmp), cache / chrome.HISTORY_TEMPLATE_NAME)
    (desktop.home / ".config" / "google-chrome" / "Default").mkdir(parents=True)
    history = [
        {"url": "https://alpha.example/one", "title": "Alpha page",
         "visit_time_from_now_in_seconds": 3600},
        {"url": "https://beta.example/", "title": "Beta page",
         "visit_time_from_now_in_seconds": 2 * 86400 + 5},
    ]
    step = {"type": "update_browse_history", "parameters": {"history": history}}

    started = datetime.now(UTC)
    await run_setup_step(desktop, step)
    ended = datetime.now(UTC)

    written = desktop.home / ".config" / "google-chrome" / "Default" / "History"
    with contextlib.closing(sqlite3.connect(written)) as db:
        urls = db.execute("SELECT id, url, title, visit_count, typed_count, last_visit_time, "
                          "hidden FROM urls ORDER BY id").fetchall()
        visits = db.execute("SELECT url, visit_time, from_visit, transition, segment_id, "
                            "visit_duration FROM visits ORDER BY id").fetchall()
    assert [(u[1], u[2], u[3], u[4], u[6]) for u in urls] == [
        ("https://alpha.example/one", "Alpha page", 1, 0, 0),
        ("https://beta.example/", "Beta page", 1, 0, 0)]
    for (url_id, *_rest, last_visit, _hidden), item, visit in zip(urls, history, visits,
                                                                 strict=True):
        ago = timedelta(seconds=item["visit_time_from_now_in_seconds"])
        assert chrome_time_of(started - ago) <= last_visit <= chrome_time_of(ended - ago)
        assert visit == (url_id, last_visit, 0, 0x30000000, 0, 0)
    assert [code for _, code in desktop.commands] == [0], desktop.commands

    # The browser takes it: its history page lists both entries.
    profile = tmp / "filled-profile"
    (profile / "Default").mkdir(parents=True)
    shutil.copyfile(written, profile / "Default" / "History")
    filled = start_chromium(profile)
    try:
        text = await history_page_text(filled.url, ("Alpha page", "Beta page"))
    finally:
        stop_chromium(filled)
    assert "Alpha page" in text and "Beta page" in text, text[-1000:]


async def history_page_text(url: str, wanted: tuple[str, ...]) -> str:
    """The text chrome://history shows, once it shows all of ``wanted`` (or the deadline)."""
    async with chrome.DevTools(url, timeout_s=10) as devtools:
        tab = await devtools.new_tab("chrome://history")
        async with devtools.session(tab) as cdp:
            deadline = time.monotonic() + HISTORY_PAGE_TIMEOUT_S
            while True:
                reply = await cdp.call("Runtime.evaluate",
                                       {"expression": PAGE_TEXT, "returnByValue": True})
                text = str(reply.get("result", {}).get("value") or "")
                if all(w in text for w in wanted) or time.monotonic() > deadline:
                    return text
                await asyncio.sleep(0.2)
