"""A client of GUI-Docker-Env's environment manager (DART-GUI's; github.com/Computer-use-agents/
GUI-Docker-Env, ``desktop_env/docker_server/server.py`` as of commit e65796f): an emulator
(one OSWorld desktop) started under a token's concurrency quota, its status, its stop. Our
own code, written from their server and their ``docker_server`` provider's client; it
speaks the same requests as that client, so a team keeps its environment cluster.

What it relies on (their server):

- ``POST /start_emulator``, the token as ``Authorization: Bearer`` and as ``{"token"}``
  (their client sends both): ``{"code": 0, "data": {"emulator_id", "server_port",
  "chromium_port", "vlc_port", "vnc_port", "token"}}``; 429 when the token's quota is full,
  401 without a token, 403 for a token it does not know, 500 when the emulator failed (their
  server gives the quota back). It answers once the emulator's desktop server answers.
- ``DELETE /emulators/<id>`` (404 or 405: the older ``POST /stop_emulator {"emulator_id"}``).
- ``GET /emulator_status/<id>``: 200 while it runs, 404 once it is gone.
- The desktop is OSWorld's server at ``http://<manager host>:<server_port>``; Chromium's
  DevTools and VLC at their own ports on that host.

Several managers are tried in turn for each new emulator (their client tries
``OSWORLD_BASE_URL``'s list in order; we start each try one manager further, so a pool's
emulators spread over them). Their client first reads ``GET /tokens`` to skip a full
manager; we rely on the 429 instead, which their server decides under its lock (the
``/tokens`` read is a race), and wait a full quota out with backoff. There is no lease
expiry on their side: an emulator runs until someone stops it.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import httpx2

from cua_rollout.core.aio import backoff_s
from cua_rollout.core.errors import ConfigError, DesktopError, DesktopUnavailable
from cua_rollout.core.http import error_text, redact_url

__all__ = ["Emulator", "GuiDockerEnvClient", "QuotaFull"]

# A full quota everywhere: asked again after these delays (full jitter, capped).
_QUOTA_BACKOFF_INITIAL_S = 1.0
_QUOTA_BACKOFF_MAX_S = 15.0
_ERROR_TEXT_CHARS = 300


class QuotaFull(DesktopUnavailable):
    """Every manager refused a new emulator for a full quota (429) until the wait ran out."""


@dataclass(frozen=True)
class Emulator:
    """One emulator a manager started for us."""

    emulator_id: str
    manager: str          # the base URL of the manager that started it
    server_port: int
    chromium_port: int
    vlc_port: int
    vnc_port: int | None = None

    @property
    def host(self) -> str:
        return urlsplit(self.manager).hostname or ""

    @property
    def desktop_url(self) -> str:
        """The emulator's OSWorld server, on the manager's host."""
        host = self.host
        return f"http://{f'[{host}]' if ':' in host else host}:{self.server_port}"


class GuiDockerEnvClient:
    """The managers at ``urls``, known by ``token``. Every call has a deadline
    (``timeout_s``; a start ``start_timeout_s``: the manager boots the emulator first)."""

    def __init__(self, urls: list[str], token: str, *, timeout_s: float = 30.0,
                 start_timeout_s: float = 600.0) -> None:
        if not urls:
            raise ConfigError("GUI-Docker-Env: no manager URL")
        self.urls = [u.rstrip("/") for u in urls]
        self.timeout_s = timeout_s
        self.start_timeout_s = start_timeout_s
        self._token = token
        self._headers = {"Authorization": f"Bearer {token}"}
        self._client: httpx2.AsyncClient | None = None
        self._turn = itertools.count()
        self.refusals = 0  # 429s seen: how often a full quota was waited out

    def _http(self) -> httpx2.AsyncClient:
        if self._client is None:  # made on the loop that uses it
            self._client = httpx2.AsyncClient(headers=self._headers)
        return self._client

    async def close(self) -> None:
        if self._client is not None:
            client, self._client = self._client, None
            await client.aclose()

    # ----------------------------------------------------------------- emulators

    async def start(self, *, wait_s: float) -> Emulator:
        """A new emulator from the first manager, in turn, that grants one. A full quota on
        every manager is asked again with backoff until ``wait_s`` has passed
        (``QuotaFull``); a token refused (401/403) is a ``ConfigError``; other failures of
        every manager a ``DesktopError`` naming each."""
        deadline = time.monotonic() + wait_s
        first = next(self._turn) % len(self.urls)
        order = self.urls[first:] + self.urls[:first]
        for attempt in itertools.count(1):
            failures: list[str] = []
            full: list[str] = []
            for manager in order:
                outcome = await self._start_on(manager)
                if isinstance(outcome, Emulator):
                    return outcome
                kind, why = outcome
                (full if kind == "full" else failures).append(f"{redact_url(manager)}: {why}")
            if failures:
                raise DesktopError("GUI-Docker-Env: no manager started an emulator: "
                                   + "; ".join(failures + full))
            left_s = deadline - time.monotonic()
            if left_s <= 0:
                raise QuotaFull(f"GUI-Docker-Env: the token's quota stayed full for "
                                f"{wait_s:.0f}s: " + "; ".join(full))
            await asyncio.sleep(min(left_s, backoff_s(attempt, _QUOTA_BACKOFF_INITIAL_S,
                                                      _QUOTA_BACKOFF_MAX_S)))
        raise AssertionError("unreachable")

    async def _start_on(self, manager: str) -> Emulator | tuple[str, str]:
        """One ``/start_emulator``: the emulator, or ``("full" | "failed", why)``."""
        try:
            reply = await self._http().post(manager + "/start_emulator",
                                            json={"token": self._token},
                                            timeout=self.start_timeout_s)
        except httpx2.HTTPError as exc:
            return "failed", f"{type(exc).__name__}: {exc}"
        if reply.status_code == 429:
            self.refusals += 1
            return "full", error_text(reply, _ERROR_TEXT_CHARS)
        if reply.status_code in (401, 403):
            raise ConfigError(f"GUI-Docker-Env {redact_url(manager)} refused the token of "
                              f"desktops.remote.token_env (HTTP {reply.status_code}: "
                              f"{error_text(reply, _ERROR_TEXT_CHARS)})")
        try:
            body = reply.json()
            data = body["data"]
            if reply.status_code != 200 or body.get("code") != 0:
                raise ValueError
            return Emulator(str(data["emulator_id"]), manager, int(data["server_port"]),
                            int(data["chromium_port"]), int(data["vlc_port"]),
                            _port(data.get("vnc_port")))
        except (ValueError, KeyError, TypeError):
            return "failed", (f"HTTP {reply.status_code}: "
                              f"{error_text(reply, _ERROR_TEXT_CHARS)}")

    async def stop(self, emulator: Emulator) -> None:
        """Stop ``emulator`` (gone already: nothing to do). ``DesktopError`` when its manager
        cannot be reached or fails to answer."""
        where = f"GUI-Docker-Env {redact_url(emulator.manager)}"
        try:
            reply = await self._http().delete(
                f"{emulator.manager}/emulators/{emulator.emulator_id}", timeout=self.timeout_s)
            if reply.status_code in (404, 405):  # an older manager: the POST it had first
                reply = await self._http().post(
                    emulator.manager + "/stop_emulator",
                    json={"emulator_id": emulator.emulator_id}, timeout=self.timeout_s)
        except httpx2.HTTPError as exc:
            raise DesktopError(f"{where}: stopping emulator {emulator.emulator_id}: "
                               f"{type(exc).__name__}: {exc}") from exc
        if reply.status_code >= 400 and reply.status_code != 404:
            raise DesktopError(f"{where}: stopping emulator {emulator.emulator_id}: HTTP "
                               f"{reply.status_code}: {error_text(reply, _ERROR_TEXT_CHARS)}")

    async def running(self, emulator: Emulator) -> bool | None:
        """Whether the manager still runs ``emulator``: True, False (it says not found), or
        None when it cannot say (unreachable, an error): a manager's outage is not a
        desktop's death."""
        try:
            reply = await self._http().get(
                f"{emulator.manager}/emulator_status/{emulator.emulator_id}",
                timeout=self.timeout_s)
        except httpx2.HTTPError:
            return None
        if reply.status_code == 404:
            return False
        if reply.status_code != 200:
            return None
        return _status(reply) == "running"


def _port(value: Any) -> int | None:
    try:
        return int(value)
    except (TypeError, ValueError):
        return None


def _status(reply: httpx2.Response) -> str | None:
    try:
        body = reply.json()
    except ValueError:
        return None
    return body.get("status") if isinstance(body, dict) else None
