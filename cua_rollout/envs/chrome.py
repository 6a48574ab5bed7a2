"""The desktop's browser as OSWorld's chrome setup steps use it: a small client of Chromium's
DevTools endpoint (its HTTP listing of tabs, and the protocol over a WebSocket where a page
must be watched), the tab operations of ``chrome_open_tabs`` / ``chrome_close_tabs``, the URL
matching OSWorld applies to tabs, and Chrome's History database as ``update_browse_history``
fills it.

OSWorld drives the browser through Playwright's ``connect_over_cdp``; what it does with it is
small enough that the endpoint's own HTTP routes and a few protocol calls reach the same end
state without a browser-automation dependency.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import itertools
import json
import logging
import shutil
import sqlite3
import tempfile
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import ParseResult, quote, urlparse, urlsplit, urlunparse

import httpx2
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import WebSocketException

from cua_rollout.core.errors import DesktopError, TaskSetupError
from cua_rollout.core.http import error_text, redact_url

__all__ = [
    "HISTORY_PATH",
    "HISTORY_TEMPLATE_NAME",
    "HISTORY_TEMPLATE_URL",
    "CDPSession",
    "DevTools",
    "Tab",
    "chrome_time",
    "close_tabs",
    "history_database",
    "open_tabs",
    "same_page_url",
]

log = logging.getLogger(__name__)

# How long a chrome step waits for the browser's endpoint to answer: OSWorld tries to connect
# 15 times, 5 s apart (the task's own ``launch`` of the browser usually comes just before).
_BROWSER_WAIT_S = 70.0
_BROWSER_POLL_S = 0.5
# A tab's page gets this long to fire its load event (OSWorld: ``page.goto(url,
# timeout=60000)``); a page that misses it stays open, with a warning, as in OSWorld.
_PAGE_LOAD_TIMEOUT_S = 60.0
# ``chrome_close_tabs`` follows a launch of the browser with its tabs: OSWorld waits 5 s for
# them first. Tabs that show up sooner are closed sooner; one not there by then is left be.
_TABS_APPEAR_WAIT_S = 5.0
_TABS_POLL_S = 0.25
# How often a closed tab is looked for until it has gone from the endpoint's list.
_CLOSE_POLL_S = 0.05
# Largest protocol message accepted from the browser.
_MAX_MESSAGE_BYTES = 16 << 20
# Protocol events kept for a later wait while a call waits for its reply.
_MAX_BUFFERED_EVENTS = 1000
_ERROR_TEXT_CHARS = 200

# OSWorld's empty History database (Chrome's schema, no rows), which its
# ``update_browse_history`` fills and puts in place of the desktop's own.
HISTORY_TEMPLATE_URL = (
    "https://huggingface.co/datasets/xlangai/ubuntu_osworld_file_cache/resolve/main/chrome/"
    "44ee5668-ecd5-4366-a6ce-c1c9b8d4e938/history_empty.sqlite?download=true"
)
# The name OSWorld caches that template under (``<cache_dir>/history_new.sqlite``).
HISTORY_TEMPLATE_NAME = "history_new.sqlite"
# The desktop browser's History: OSWorld's Linux path (Chrome's default profile, or
# Chromium installed under the name ``google-chrome``); the desktop expands ``~``.
HISTORY_PATH = "~/.config/google-chrome/Default/History"
# Chrome's clock counts microseconds from 1601-01-01 UTC (Windows' FILETIME epoch).
_CHROME_EPOCH_OFFSET_S = 11_644_473_600
# The transition OSWorld gives each visit: a link (core type 0) that starts and ends its
# redirect chain (CHAIN_START 0x10000000 | CHAIN_END 0x20000000).
_VISIT_TRANSITION = 0x30000000


# --------------------------------------------------------------------------- the client


@dataclass(frozen=True)
class Tab:
    """A page target as the endpoint lists it."""

    id: str
    url: str
    title: str
    ws_path: str
    """Path of its protocol WebSocket (``/devtools/page/<id>``), reached on the endpoint's
    own host and port: the host the browser writes into the URL may be one only the
    desktop can reach (behind OSWorld's socat forward)."""


class DevTools:
    """A desktop's DevTools endpoint (``http://<host>:<port>``). Use it as an async context
    manager: the HTTP client is made on the running loop and closed on exit. Every request
    has ``timeout_s``; failures raise ``DesktopError`` naming the endpoint."""

    def __init__(self, base_url: str, *, timeout_s: float) -> None:
        self.base_url = base_url.rstrip("/")
        self.timeout_s = timeout_s
        self._client: httpx2.AsyncClient | None = None

    async def __aenter__(self) -> DevTools:
        self._client = httpx2.AsyncClient(timeout=httpx2.Timeout(self.timeout_s))
        return self

    async def __aexit__(self, *exc: object) -> None:
        client, self._client = self._client, None
        if client is not None:
            await client.aclose()

    # ----------------------------------------------------------------- HTTP routes

    async def version(self) -> dict[str, Any]:
        """``/json/version``: the browser's name and its protocol endpoint."""
        body = await self._json("GET", "/json/version")
        if not isinstance(body, dict):
            raise DesktopError(f"{self._shown}/json/version: unexpected reply {body!r:.200}")
        return body

    async def wait_until_up(self, wait_s: float = _BROWSER_WAIT_S) -> dict[str, Any]:
        """``version()`` once the browser answers, polling for up to ``wait_s`` (a task's
        setup starts the browser a moment before its chrome steps). ``TaskSetupError`` if it
        never does."""
        deadline = time.monotonic() + wait_s
        while True:
            try:
                return await self.version()
            except DesktopError as exc:
                if time.monotonic() + _BROWSER_POLL_S > deadline:
                    raise TaskSetupError(
                        f"no browser answered at {self._shown} within {wait_s:g}s: {exc} "
                        "(the task's setup must start the browser with remote debugging; "
                        "desktops.chromium_port names the port)"
                    ) from exc
            await asyncio.sleep(_BROWSER_POLL_S)

    async def tabs(self) -> list[Tab]:
        """``/json/list``'s pages (tabs), most recently active first as the browser lists
        them; other targets (workers, the browser's own UI) are left out."""
        body = await self._json("GET", "/json/list")
        if not isinstance(body, list):
            raise DesktopError(f"{self._shown}/json/list: unexpected reply {body!r:.200}")
        return [_tab(item) for item in body
                if isinstance(item, Mapping) and item.get("type") == "page"]

    async def new_tab(self, url: str) -> Tab:
        """``PUT /json/new?<url>``: a new foreground tab loading ``url``. The browser
        unquotes the query once, so the URL goes in quoted whole."""
        body = await self._json("PUT", "/json/new?" + quote(url, safe=""))
        if not isinstance(body, Mapping):
            raise DesktopError(f"{self._shown}/json/new: unexpected reply {body!r:.200}")
        return _tab(body)

    async def close_tab(self, tab_id: str) -> bool:
        """``/json/close/<id>``, returning once the tab is gone from the list (the browser
        answers while the tab is still closing; Playwright's ``page.close()``, which OSWorld
        uses, waits for it too). False when the tab was already gone; ``DesktopError`` if it
        is still listed ``timeout_s`` later."""
        response = await self._request("GET", f"/json/close/{quote(tab_id, safe='')}",
                                       allow_status=(404,))
        if response.status_code == 404:
            return False
        deadline = time.monotonic() + self.timeout_s
        while any(tab.id == tab_id for tab in await self.tabs()):
            if time.monotonic() > deadline:
                raise DesktopError(f"{self._shown}: tab {tab_id} is still open "
                                   f"{self.timeout_s:g}s after closing it")
            await asyncio.sleep(_CLOSE_POLL_S)
        return True

    # ----------------------------------------------------------------- the protocol

    @contextlib.asynccontextmanager
    async def session(self, tab: Tab) -> AsyncIterator[CDPSession]:
        """A protocol session with ``tab`` over its WebSocket, closed on exit."""
        ws_url = "ws" + self.base_url.removeprefix("http") + tab.ws_path
        try:
            ws = await connect(ws_url, max_size=_MAX_MESSAGE_BYTES, open_timeout=self.timeout_s)
        except (OSError, TimeoutError, WebSocketException) as exc:
            raise DesktopError(f"{self._shown}: cannot open the protocol socket of tab "
                               f"{tab.id}: {type(exc).__name__}: {exc}") from exc
        try:
            yield CDPSession(ws, f"{self._shown} tab {tab.id}", self.timeout_s)
        finally:
            await ws.close()

    # ----------------------------------------------------------------- transport

    @property
    def _shown(self) -> str:
        return redact_url(self.base_url)

    async def _json(self, method: str, path: str) -> Any:
        response = await self._request(method, path)
        try:
            return response.json()
        except ValueError as exc:
            raise DesktopError(f"{self._shown}{path}: reply is not JSON: "
                               f"{response.text[:_ERROR_TEXT_CHARS]!r}") from exc

    async def _request(self, method: str, path: str, *, allow_status: tuple[int, ...] = ()
                       ) -> httpx2.Response:
        if self._client is None:
            raise RuntimeError("DevTools is used outside 'async with'")
        try:
            response = await self._client.request(method, self.base_url + path)
        except httpx2.HTTPError as exc:
            raise DesktopError(f"{self._shown}{path}: {type(exc).__name__}: {exc}") from exc
        if response.status_code >= 400 and response.status_code not in allow_status:
            raise DesktopError(f"{self._shown}{path}: HTTP {response.status_code}: "
                               f"{error_text(response, _ERROR_TEXT_CHARS)}")
        return response


class CDPSession:
    """Calls and events of one target's protocol session, used by one coroutine at a time:
    a call reads the socket until its reply arrives and keeps the events it passes over for
    ``wait_event``, so no reader task has to be kept and cancelled."""

    def __init__(self, ws: ClientConnection, name: str, timeout_s: float) -> None:
        self._ws = ws
        self._name = name
        self._timeout_s = timeout_s
        self._ids = itertools.count(1)
        self._events: deque[dict[str, Any]] = deque(maxlen=_MAX_BUFFERED_EVENTS)

    async def call(self, method: str, params: Mapping[str, Any] | None = None, *,
                   timeout_s: float | None = None) -> dict[str, Any]:
        """The result of ``method``; ``DesktopError`` with the browser's message if it
        refused, or when no reply came within ``timeout_s`` (default: the session's)."""
        timeout_s = self._timeout_s if timeout_s is None else timeout_s
        call_id = next(self._ids)
        try:
            await self._ws.send(json.dumps({"id": call_id, "method": method,
                                            "params": dict(params or {})}))
        except WebSocketException as exc:
            raise DesktopError(f"{self._name}: cannot send {method}: {exc}") from exc
        try:
            async with asyncio.timeout(timeout_s):
                while True:
                    message = await self._receive()
                    if message.get("id") == call_id:
                        break
                    if "method" in message:
                        self._events.append(message)
        except TimeoutError as exc:
            raise DesktopError(f"{self._name}: no reply to {method} within "
                               f"{timeout_s:g}s") from exc
        if "error" in message:
            error = message["error"]
            text = error.get("message") if isinstance(error, Mapping) else error
            raise DesktopError(f"{self._name}: {method} refused: {text}")
        result = message.get("result")
        return result if isinstance(result, dict) else {}

    async def wait_event(self, predicate: Callable[[dict[str, Any]], bool],
                         timeout_s: float | None) -> dict[str, Any] | None:
        """The first event (``{"method", "params"}``), kept or new, for which ``predicate``
        holds; None if none came within ``timeout_s`` (None: no limit of its own, for a
        caller whose own deadline bounds the wait)."""
        for event in list(self._events):
            if predicate(event):
                self._events.remove(event)
                return event
        try:
            async with asyncio.timeout(timeout_s):
                while True:
                    message = await self._receive()
                    if "method" not in message:
                        continue
                    if predicate(message):
                        return message
                    self._events.append(message)
        except TimeoutError:
            return None

    async def _receive(self) -> dict[str, Any]:
        try:
            raw = await self._ws.recv()
        except WebSocketException as exc:  # the tab or the browser went away
            raise DesktopError(f"{self._name}: protocol socket closed: {exc}") from exc
        try:
            message = json.loads(raw)
        except ValueError as exc:
            raise DesktopError(f"{self._name}: a protocol message is not JSON: "
                               f"{str(raw)[:_ERROR_TEXT_CHARS]!r}") from exc
        if not isinstance(message, dict):
            raise DesktopError(f"{self._name}: unexpected protocol message {message!r:.200}")
        return message


# --------------------------------------------------------------------------- the tab steps


async def open_tabs(devtools: DevTools, urls: Iterable[str], *,
                    load_timeout_s: float = _PAGE_LOAD_TIMEOUT_S) -> list[Tab]:
    """OSWorld's ``chrome_open_tabs``: each URL in a new tab, in order, each waited for until
    its page has loaded (at most ``load_timeout_s``: a slower or failing page is left open
    with a warning, as OSWorld does); after the first, the tab the browser started with is
    closed. Returns the new tabs.

    "The tab the browser started with" is Playwright's first page of the default context;
    the endpoint lists tabs by last activity, so with several tabs open before the step it is
    the least recently active one. The caller has waited for the browser (``wait_until_up``).
    """
    before = await devtools.tabs()
    opened: list[Tab] = []
    for index, url in enumerate(urls):
        tab = await devtools.new_tab("about:blank")
        opened.append(tab)
        async with devtools.session(tab) as cdp:
            await _navigate_and_wait_for_load(cdp, url, load_timeout_s)
        if index == 0 and before:
            await devtools.close_tab(before[-1].id)
    return opened


async def close_tabs(devtools: DevTools, urls: Iterable[str], *,
                     appear_wait_s: float = _TABS_APPEAR_WAIT_S) -> list[Tab]:
    """OSWorld's ``chrome_close_tabs``: for each URL, the first tab (oldest first) whose URL
    matches it (``same_page_url``) is closed; one tab per URL given. Tabs are looked for
    until all URLs matched or ``appear_wait_s`` passed (OSWorld waits that long once, for a
    browser just launched with its tabs); a URL no tab shows by then closes nothing, as in
    OSWorld. Returns the closed tabs."""
    pending = list(urls)
    closed: list[Tab] = []
    deadline = time.monotonic() + appear_wait_s
    while pending:
        oldest_first = list(reversed(await devtools.tabs()))
        unmatched = []
        for url in pending:
            gone = {tab.id for tab in closed}
            match = next((tab for tab in oldest_first
                          if tab.id not in gone and same_page_url(tab.url, url)), None)
            if match is None:
                unmatched.append(url)
                continue
            await devtools.close_tab(match.id)
            closed.append(match)
        pending = unmatched
        if pending and time.monotonic() + _TABS_POLL_S > deadline:
            log.info("no tab shows %s after %gs: nothing closed for it", pending, appear_wait_s)
            break
        if pending:
            await asyncio.sleep(_TABS_POLL_S)
    return closed


async def _navigate_and_wait_for_load(cdp: CDPSession, url: str, timeout_s: float) -> None:
    """Navigate the (blank) tab to ``url`` and wait for the load event of the document that
    replaces the blank one (lifecycle events carry the document's loader, so the blank
    page's own load, which the browser may report again, does not count)."""
    await cdp.call("Page.enable")
    tree = await cdp.call("Page.getFrameTree")
    frame = tree.get("frameTree", {}).get("frame", {})
    frame_id, blank_loader = frame.get("id"), frame.get("loaderId")
    await cdp.call("Page.setLifecycleEventsEnabled", {"enabled": True})

    def loaded(event: dict[str, Any]) -> bool:
        params = event.get("params") or {}
        return (event.get("method") == "Page.lifecycleEvent" and params.get("name") == "load"
                and params.get("frameId") == frame_id
                and params.get("loaderId") != blank_loader)

    try:
        # One deadline for navigating and loading, as Playwright's goto timeout in OSWorld;
        # the call's own limit is longer, so this deadline is the one that ends it.
        async with asyncio.timeout(timeout_s):
            reply = await cdp.call("Page.navigate", {"url": url}, timeout_s=2 * timeout_s)
            if reply.get("errorText"):
                log.warning("opening %s failed: %s (the tab stays, as in OSWorld)", url,
                            reply["errorText"])
                return
            if reply.get("loaderId"):  # else a same-document navigation: nothing to load
                await cdp.wait_event(loaded, None)
    except TimeoutError:
        log.warning("opening %s: not loaded within %gs (the tab stays, as in OSWorld)", url,
                    timeout_s)


def _tab(item: Mapping[str, Any]) -> Tab:
    ws_url = str(item.get("webSocketDebuggerUrl") or "")
    tab_id = str(item.get("id") or "")
    if not tab_id:
        raise DesktopError(f"a DevTools target without an id: {dict(item)!r:.200}")
    return Tab(id=tab_id, url=str(item.get("url") or ""), title=str(item.get("title") or ""),
               ws_path=urlsplit(ws_url).path or f"/devtools/page/{tab_id}")


# --------------------------------------------------------------------------- URL matching

# Second-level labels that, under a two-letter country code, are part of the public suffix
# (co.uk, com.sg, org.au ...). OSWorld drops a host's public suffix with tldextract and the
# whole Public Suffix List; this rule gives the same answer for ordinary hosts without it.
_SECOND_LEVEL_LABELS = frozenset(
    {"ac", "co", "com", "edu", "go", "gob", "gov", "mil", "ne", "net", "nic", "or", "org"})


def same_page_url(a: str | None, b: str | None) -> bool:
    """OSWorld's ``compare_urls`` (full): the same page when equal after normalising: a
    missing scheme means ``http``; the host loses its port, its public suffix and a lone
    ``www`` (``www.airbnb.com`` ~ ``airbnb.com.sg``); a path of ``/`` is empty; query and
    fragment count."""
    if a is None or b is None:
        return a == b
    return _normal_url(a) == _normal_url(b)


def _normal_url(url: str) -> str:
    parsed = urlparse(url if _has_scheme(url) else f"http://{url}")
    host = (parsed.hostname or "").lower()
    subdomain, domain = _split_host(host)
    netloc = f"{subdomain}.{domain}" if subdomain and subdomain != "www" else domain
    return urlunparse(ParseResult(
        scheme=parsed.scheme.lower(), netloc=netloc,
        path="" if parsed.path == "/" else parsed.path,
        params=parsed.params, query=parsed.query, fragment=parsed.fragment,
    ))


def _has_scheme(url: str) -> bool:
    scheme, sep, _ = url.partition("://")
    return bool(sep) and scheme[:1].isalpha() and all(
        c.isalnum() or c in "+-." for c in scheme)


def _split_host(host: str) -> tuple[str, str]:
    """(subdomain, registrable name without its public suffix) of a host name."""
    try:
        ipaddress.ip_address(host)
        return "", host
    except ValueError:
        pass
    labels = host.split(".")
    if len(labels) < 2:
        return "", host
    suffix = 2 if (len(labels) >= 3 and len(labels[-1]) == 2
                   and labels[-2] in _SECOND_LEVEL_LABELS) else 1
    return ".".join(labels[:-suffix - 1]), labels[-suffix - 1]


# --------------------------------------------------------------------------- History


def chrome_time(unix_s: float) -> int:
    """A Unix time as Chrome stores times: whole microseconds since 1601-01-01 UTC."""
    # The offset added as an integer: in floating point the sum would lose microseconds.
    return round(unix_s * 1_000_000) + _CHROME_EPOCH_OFFSET_S * 1_000_000


def history_database(template: Path, history: Iterable[Mapping[str, Any]], now_s: float
                     ) -> bytes:
    """OSWorld's ``update_browse_history``: a copy of the History ``template`` with a row in
    ``urls`` (visited once, not typed, not hidden) and one in ``visits`` (a link, no referrer,
    no duration) per item, visited ``visit_time_from_now_in_seconds`` before ``now_s``.
    Returns the database's bytes; blocking (call it in a thread).

    Times are UTC, as Chrome reads them; OSWorld computes them from the host's local wall
    clock, which is the same on a host that keeps UTC. ``ValueError`` for an ill-formed item,
    ``TaskSetupError`` when the template is not a History database."""
    items = [_history_item(item) for item in history]
    with tempfile.TemporaryDirectory(prefix="history-") as folder:
        db_path = Path(folder) / "History"
        shutil.copyfile(template, db_path)
        try:
            with contextlib.closing(sqlite3.connect(db_path)) as db, db:
                for url, title, ago_s in items:
                    visited = chrome_time(now_s - ago_s)
                    row = db.execute(
                        "INSERT INTO urls (url, title, visit_count, typed_count, "
                        "last_visit_time, hidden) VALUES (?, ?, 1, 0, ?, 0)",
                        (url, title, visited))
                    db.execute(
                        "INSERT INTO visits (url, visit_time, from_visit, transition, "
                        "segment_id, visit_duration) VALUES (?, ?, 0, ?, 0, 0)",
                        (row.lastrowid, visited, _VISIT_TRANSITION))
        except sqlite3.Error as exc:
            raise TaskSetupError(f"update_browse_history: {template} is not a usable "
                                 f"History database: {exc}") from exc
        return db_path.read_bytes()


def _history_item(item: Mapping[str, Any]) -> tuple[str, str, float]:
    if not isinstance(item, Mapping):
        raise ValueError(f"a history item must be a mapping, not {item!r:.100}")
    url, title = item.get("url"), item.get("title")
    ago_s = item.get("visit_time_from_now_in_seconds")
    if not isinstance(url, str) or not isinstance(title, str):
        raise ValueError(f"a history item needs a 'url' and a 'title' string: {dict(item)!r:.200}")
    if isinstance(ago_s, bool) or not isinstance(ago_s, int | float):
        raise ValueError("a history item needs a number 'visit_time_from_now_in_seconds': "
                         f"{dict(item)!r:.200}")
    return url, title, float(ago_s)
