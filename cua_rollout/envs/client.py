"""The OSWorld desktop client: ``RemoteDesktopEnv`` speaks the in-desktop HTTP protocol
(``cua_rollout/desktop/protocol.py``) with a deadline on every request and retries only where
repeating is harmless (reads; an action only when the connection failed before it was sent).
It meets
``DesktopEnv`` and ``DesktopProbe``; task setup steps are interpreted by ``setup_steps.py``.

Requests go through aiohttp (``cua_rollout.core.http.hot_request``: the action and the
screenshot are two of a step's three hot requests): one session per process and event loop
serves every desktop (``shared_client``), or one per lease (``lease_client``).
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import AsyncGenerator, Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import aiohttp

from cua_rollout.config import DesktopsConfig, secret_from_env
from cua_rollout.core.aio import backoff_s
from cua_rollout.core.errors import DesktopError
from cua_rollout.core.http import (
    Reply,
    TransportFailure,
    error_text,
    hot_request,
    hot_session,
    redact_url,
)
from cua_rollout.core.screenshot import Screenshot
from cua_rollout.core.types import SPECIAL_ACTIONS, WAIT
from cua_rollout.desktop.protocol import (
    FILE_DATA_FIELD,
    FILE_PATH_FIELD,
    CommandRequest,
    LeaseTokenRequest,
    OpenFileRequest,
    Paths,
    RunPythonRequest,
    WindowRequest,
    execute_command,
)
from cua_rollout.envs import setup_steps
from cua_rollout.envs.contract import DesktopAccess, DesktopAddress, StepResult

__all__ = ["RemoteDesktopEnv", "close_shared_client", "lease_client", "shared_client"]

log = logging.getLogger(__name__)

# Connecting to a desktop is fast or not at all (a desktop is on the same network).
_CONNECT_TIMEOUT_S = 5.0
# Backoff between retries of one request: full jitter, capped.
_RETRY_BACKOFF_INITIAL_S = 0.2
_RETRY_BACKOFF_MAX_S = 2.0
# A health check answers fast or the desktop is not healthy.
_HEALTH_TIMEOUT_S = 5.0
# Longest error text quoted from a desktop's reply.
_ERROR_TEXT_CHARS = 300
# Of a command request's deadline, the part left to the desktop server for killing a command
# that overran and answering: it is told to end the command this much earlier.
_COMMAND_KILL_MARGIN_S = 2.0


# --------------------------------------------------------------------------- shared client

@dataclass
class _Shared:
    loop: asyncio.AbstractEventLoop
    session: aiohttp.ClientSession
    closer: AsyncGenerator[None, None]   # closes the session at its loop's shutdown
    started: asyncio.Future[None]


_CLIENTS: dict[int, _Shared] = {}


def shared_client(max_connections: int) -> aiohttp.ClientSession:
    """The process's session for desktops on the running loop (created on first use). It is
    closed by ``close_shared_client``, or else when its loop shuts down (``asyncio.run`` and
    ``asyncio.Runner`` close a loop's async generators before the loop), so a loop that ends
    without the call leaves no open session behind."""
    loop = asyncio.get_running_loop()
    entry = _CLIENTS.get(id(loop))
    if entry is None or entry.loop is not loop or entry.session.closed:
        for key in [k for k, e in _CLIENTS.items() if e.loop.is_closed() and e.session.closed]:
            del _CLIENTS[key]  # closed with their loops (one a loop left open stays held)
        session = hot_session(max_connections)
        closer = _closed_at_shutdown(session)
        # Its first step registers it with the loop (the loop's async generator hook).
        started = asyncio.ensure_future(closer.__anext__())
        _CLIENTS[id(loop)] = _Shared(loop, session, closer, started)
        return session
    return entry.session


async def _closed_at_shutdown(session: aiohttp.ClientSession) -> AsyncGenerator[None, None]:
    try:
        yield
    finally:
        await session.close()


def lease_client(cfg: DesktopsConfig) -> aiohttp.ClientSession:
    """A session for the one desktop an episode leased; the episode closes it when it gives
    the desktop back. The episode's requests follow one another, so its pool keeps a single
    connection alive."""
    return hot_session(cfg.max_connections)


async def close_shared_client() -> None:
    """Close this loop's shared session (at actor or test shutdown)."""
    entry = _CLIENTS.pop(id(asyncio.get_running_loop()), None)
    if entry is not None:
        await entry.started
        await entry.closer.aclose()  # closes the session


# --------------------------------------------------------------------------- the client


class RemoteDesktopEnv:
    """One desktop reached over OSWorld's in-desktop HTTP protocol.

    ``reset(task)`` runs the task's setup steps and returns the first screenshot,
    ``step(action)`` runs pyautogui code (or handles ``WAIT``/``DONE``/``FAIL``) and waits
    ``pause_s``, ``observe()`` returns the screenshot. Scoring reads the desktop through the
    ``DesktopProbe`` methods (``get_file``, ``execute`` ...), see ``cua_rollout.evaluation``.
    """

    def __init__(
        self,
        base_url: str,
        cfg: DesktopsConfig,
        *,
        name: str | None = None,
        client: aiohttp.ClientSession | None = None,
        python: str = "python",
        access: DesktopAccess | None = None,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.cfg = cfg
        self.name = name or redact_url(self.base_url)  # errors and logs show the name
        self._client = client
        self._owns_client = False
        self._python = python
        access = access or DesktopAccess()
        # A desktop lent with a token of its own (a remote lease) is reached with that one.
        token = access.token or secret_from_env(cfg.token_env, "desktops.token_env")
        self._headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._password = (
            secret_from_env(cfg.client_password_env, "desktops.client_password_env")
            if cfg.client_password_env
            else None
        )
        self.task_id: str | None = None
        # What the task's setup wrote into its cache (``execute``'s stdout/stderr files):
        # this episode's, for the cache_file getter (SetupTarget.task_cache).
        self.task_cache: dict[str, str] = {}
        # Ports the provider handed out with the desktop (an emulator's) win over what the
        # desktop's /ports says: a server in a container knows only its side of a mapping.
        self._chromium_port: int | None = access.chromium_port
        self._vlc_port: int | None = access.vlc_port
        self._ports_known = access.chromium_port is not None and access.vlc_port is not None

    @classmethod
    def for_lease(cls, base_url: str, cfg: DesktopsConfig, *, name: str | None = None,
                  access: DesktopAccess | None = None) -> RemoteDesktopEnv:
        """A client for one leased desktop with a connection pool of its own
        (``lease_client``), closed by ``close()`` when the episode gives the desktop back."""
        env = cls(base_url, cfg, name=name, client=lease_client(cfg), access=access)
        env._owns_client = True
        return env

    # ----------------------------------------------------------------- environment API

    async def reset(self, task: Mapping[str, Any]) -> Screenshot:
        """Run ``task["config"]`` (OSWorld setup steps) and return the first observation."""
        self.task_id = str(task.get("id", "")) or None
        self.task_cache = {}
        await self.learn_ports()
        for index, step in enumerate(task.get("config") or []):
            await self.run_setup_step(step, index)
        return await self.observe()

    async def step(self, action: str, pause_s: float = 0.0) -> StepResult:
        """Execute pyautogui code, or ``WAIT`` (just pause) / ``DONE`` / ``FAIL`` (nothing)."""
        started = time.monotonic()
        if action in SPECIAL_ACTIONS:
            if action == WAIT:
                await asyncio.sleep(pause_s)
            return StepResult(action, duration_s=time.monotonic() - started)
        timeout_s = self.cfg.request_timeout_s
        body = _command(execute_command(action, self._python), False, timeout_s)
        reply = await self._json("POST", Paths.EXECUTE, json_body=body, idempotent=False,
                                 timeout_s=timeout_s)
        result = StepResult(
            action,
            returncode=reply.get("returncode"),
            output=str(reply.get("output") or ""),
            error=str(reply.get("error") or reply.get("message") or ""),
        )
        if pause_s:
            await asyncio.sleep(pause_s)
        result.duration_s = time.monotonic() - started
        return result

    async def observe(self) -> Screenshot:
        """The current screen as PNG bytes (size read from the header, nothing decoded)."""
        response = await self._request("GET", Paths.SCREENSHOT, idempotent=True)
        try:
            shot = Screenshot(response.content)
            shot.size  # noqa: B018 — validates the PNG header now, not in the runner
        except ValueError as exc:
            raise DesktopError(f"{self.name}: {Paths.SCREENSHOT} did not return a PNG") from exc
        return shot

    async def close(self) -> None:
        """Close the connection pool this object made (``for_lease``); a shared or a
        caller's client is left open. The desktop itself belongs to the pool."""
        if self._owns_client and self._client is not None:
            client, self._client = self._client, None
            await client.close()

    # ----------------------------------------------------------------- probe and protocol

    async def execute(
        self, command: list[str] | str, *, shell: bool = False, timeout_s: float | None = None
    ) -> dict[str, Any]:
        """``/execute``: ``{status, output, error, returncode}``."""
        timeout_s = timeout_s or self.cfg.request_timeout_s
        return await self._json("POST", Paths.EXECUTE,
                                json_body=_command(command, shell, timeout_s),
                                idempotent=False, timeout_s=timeout_s)

    async def run_python(self, code: str) -> dict[str, Any]:
        return await self._json("POST", Paths.RUN_PYTHON,
                                json_body=RunPythonRequest(code=code).body(), idempotent=False)

    async def get_file(self, path: str) -> bytes | None:
        """The bytes of a file on the desktop, or None if it does not exist."""
        response = await self._request(
            "POST", Paths.FILE, form={FILE_PATH_FIELD: path}, idempotent=True,
            allow_status=(404,),
        )
        return None if response.status_code == 404 else response.content

    async def upload(self, path: str, data: bytes) -> None:
        await self._request(
            "POST", Paths.SETUP_UPLOAD, form={FILE_PATH_FIELD: path},
            files={FILE_DATA_FIELD: (os.path.basename(path) or "file", data)}, idempotent=True,
            timeout_s=self.cfg.setup_timeout_s,
        )

    async def accessibility_tree(self) -> str:
        reply = await self._json("GET", Paths.ACCESSIBILITY, idempotent=True)
        return str(reply.get("AT") or "")

    async def terminal_output(self) -> str:
        reply = await self._json("GET", Paths.TERMINAL, idempotent=True)
        return str(reply.get("output") or "")

    async def cursor_position(self) -> tuple[int, int]:
        """``/cursor_position``: the pointer's screen coordinates."""
        response = await self._request("GET", Paths.CURSOR_POSITION, idempotent=True)
        try:
            x, y = response.json()
            return int(x), int(y)
        except (ValueError, TypeError) as exc:
            raise DesktopError(f"{self.name}{Paths.CURSOR_POSITION}: unexpected reply "
                               f"{response.text[:100]!r}") from exc

    async def health(self) -> bool:
        """True when the desktop answers ``/screen_size`` quickly. Asked twice: a pooled
        connection the server closed as idle (uvicorn's keep-alive is 5 s, the pool's idle
        checks come every 5 s) fails the first ask without the desktop being unwell."""
        try:
            await self._request("POST", Paths.SCREEN_SIZE, idempotent=True, retries=1,
                                timeout_s=min(_HEALTH_TIMEOUT_S, self.cfg.request_timeout_s))
        except DesktopError:
            return False
        return True

    async def set_lease_token(self, token: str | None) -> None:
        """``/lease_token``: accept ``token`` as a second bearer token until it is cleared
        (None); needs the desktop's own token (``desktops.token_env``)."""
        await self._request("POST", Paths.LEASE_TOKEN,
                            json_body=LeaseTokenRequest(token=token).model_dump(),
                            idempotent=True, retries=1)

    # ----------------------------------------------------------------- setup calls

    async def run_setup_step(self, step: Mapping[str, Any], index: int = 0) -> None:
        """One OSWorld setup step ``{"type": ..., "parameters": {...}}`` (``setup_steps.py``)."""
        await setup_steps.run_setup_step(self, step, index)

    async def launch(self, command: list[str] | str, shell: bool = False) -> None:
        """``/setup/launch``: start an app and return at once."""
        await self._request("POST", Paths.SETUP_LAUNCH,
                            json_body=CommandRequest(command=command, shell=shell).body(),
                            idempotent=False, timeout_s=self.cfg.setup_timeout_s)

    async def setup_execute(self, command: list[str] | str, shell: bool = False
                            ) -> dict[str, Any]:
        """``/setup/execute``: run a command to its end; ``{status, output, error, returncode}``."""
        timeout_s = self.cfg.setup_timeout_s
        return await self._json("POST", Paths.SETUP_EXECUTE,
                                json_body=_command(command, shell, timeout_s),
                                idempotent=False, timeout_s=timeout_s)

    async def open_file(self, path: str) -> None:
        """``/setup/open_file``: open a file (or start a program) and wait for its window."""
        await self._request("POST", Paths.SETUP_OPEN_FILE,
                            json_body=OpenFileRequest(path=path).body(),
                            idempotent=False, timeout_s=self.cfg.setup_timeout_s)

    async def activate_window(self, window_name: str, strict: bool = False,
                              by_class: bool = False) -> None:
        await self._window(Paths.SETUP_ACTIVATE_WINDOW, window_name, strict, by_class)

    async def close_window(self, window_name: str, strict: bool = False,
                           by_class: bool = False) -> None:
        await self._window(Paths.SETUP_CLOSE_WINDOW, window_name, strict, by_class)

    async def _window(self, path: str, window_name: str, strict: bool, by_class: bool) -> None:
        await self._request(
            "POST", path,
            json_body=WindowRequest(window_name=window_name, strict=strict,
                               by_class=by_class).body(),
            idempotent=True,
        )

    @property
    def client_password(self) -> str | None:
        """The desktop user's password (``{CLIENT_PASSWORD}`` in task files), if configured."""
        return self._password

    async def learn_ports(self) -> None:
        """Ask the desktop where its own services listen (``/ports``: local desktops share a
        host, so each has its DevTools and VLC ports); a desktop without the endpoint (an
        OSWorld VM) uses the configured ports."""
        if self._ports_known:
            return
        try:
            reply = await self._json("GET", Paths.PORTS, idempotent=True, retries=0)
            if isinstance(reply.get("chromium"), int) and self._chromium_port is None:
                self._chromium_port = reply["chromium"]
            if isinstance(reply.get("vlc"), int) and self._vlc_port is None:
                self._vlc_port = reply["vlc"]
        except DesktopError:
            pass
        self._ports_known = True

    @property
    def chromium_port(self) -> int:
        return self._chromium_port or self.cfg.chromium_port

    @property
    def vlc_port(self) -> int:
        return self._vlc_port or self.cfg.vlc_port

    @property
    def devtools_url(self) -> str:
        """The desktop browser's DevTools endpoint on the desktop's host: the port it
        reported (``learn_ports``, done by ``reset``), else ``desktops.chromium_port``."""
        host = urlsplit(self.base_url).hostname or ""
        return f"http://{f'[{host}]' if ':' in host else host}:{self.chromium_port}"

    def address(self) -> DesktopAddress:
        """Where OSWorld's own evaluator code reaches this desktop (its server with the
        token, Chromium's and VLC's ports on its host): see cua_rollout/evaluation/."""
        return DesktopAddress(self.base_url, self._headers.get("Authorization", "")
                              .removeprefix("Bearer ") or None,
                              self.chromium_port, self.vlc_port)

    # ----------------------------------------------------------------- transport

    def _http(self) -> aiohttp.ClientSession:
        return self._client or shared_client(self.cfg.max_connections)

    async def _json(self, method: str, path: str, **kw: Any) -> dict[str, Any]:
        response = await self._request(method, path, **kw)
        try:
            body = response.json()
        except ValueError as exc:
            raise DesktopError(f"{self.name}{path}: reply is not JSON: {response.text[:200]!r}"
                               ) from exc
        if not isinstance(body, dict):
            raise DesktopError(f"{self.name}{path}: unexpected reply {body!r:.200}")
        return body

    async def _request(
        self,
        method: str,
        path: str,
        *,
        idempotent: bool,
        retries: int | None = None,
        timeout_s: float | None = None,
        allow_status: tuple[int, ...] = (),
        **kw: Any,
    ) -> Reply:
        """One request with a deadline; transient failures retried with capped backoff.

        Connection failures before sending are always retried; read errors, timeouts and
        5xx only for idempotent requests (an action must not run twice).
        """
        attempts = 1 + (self.cfg.retries if retries is None else retries)
        timeout_s = timeout_s or self.cfg.request_timeout_s
        url = self.base_url + path
        last: str = ""
        for attempt in range(attempts):
            if attempt:
                await asyncio.sleep(
                    backoff_s(attempt, _RETRY_BACKOFF_INITIAL_S, _RETRY_BACKOFF_MAX_S))
            try:
                response = await hot_request(
                    self._http(), method, url, headers=self._headers, timeout_s=timeout_s,
                    connect_timeout_s=_CONNECT_TIMEOUT_S, **kw)
            except TransportFailure as exc:
                if exc.kind == "connect":
                    last = f"cannot connect ({exc.cause_name})"
                    continue
                last = (f"timed out after {timeout_s}s ({exc.cause_name})"
                        if exc.kind == "timeout" else str(exc))
                if idempotent:
                    continue
                raise DesktopError(f"{self.name}{path}: {last}") from exc
            if response.status_code < 400 or response.status_code in allow_status:
                return response
            detail = error_text(response, _ERROR_TEXT_CHARS)
            if response.status_code == 401:
                raise DesktopError(f"{self.name}{path}: unauthorized (check desktops.token_env)")
            if response.status_code >= 500 and idempotent:
                last = f"HTTP {response.status_code}: {detail}"
                continue
            raise DesktopError(f"{self.name}{path}: HTTP {response.status_code}: {detail}")
        raise DesktopError(f"{self.name}{path}: {last} after {attempts} attempt(s)")


def _command(command: list[str] | str, shell: bool, timeout_s: float) -> dict[str, Any]:
    """The body of a command the client waits ``timeout_s`` for: it carries that deadline,
    less the server's margin, so that our desktop server ends the command (and says so)
    before the client gives up on it, instead of letting it run on into the next episode
    (OSWorld's own servers ignore it)."""
    deadline = max(timeout_s - _COMMAND_KILL_MARGIN_S, timeout_s / 2)
    return CommandRequest(command=command, shell=shell, timeout=deadline).body()
