"""The desktop as an environment: the OSWorld-protocol client (``RemoteDesktopEnv``).

One ``httpx2.AsyncClient`` per process and event loop serves every desktop. Requests that may
have reached the desktop are retried only when repeating them is harmless (reads); an action
is retried only when the connection failed before it was sent.
"""

from __future__ import annotations

import abc
import asyncio
import functools
import json
import logging
import os
import ssl
import time
import uuid
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx2

from config import DesktopsConfig, secret_from_env
from rollout.errors import (
    ConfigError,
    DesktopError,
    DesktopUnavailable,
    TaskSetupError,
    UnsupportedSetupStep,
)
from rollout.screenshot import Screenshot
from ui_tars_utils import DONE, FAIL, WAIT, execute_command

log = logging.getLogger(__name__)

SPECIAL_ACTIONS = (DONE, FAIL, WAIT)


@dataclass
class StepResult:
    """What executing one action did on the desktop."""

    action: str
    returncode: int | None = None
    output: str = ""
    error: str = ""
    duration_s: float = 0.0

    @property
    def ok(self) -> bool:
        return self.returncode in (None, 0)


# --------------------------------------------------------------------------- shared client

_CLIENTS: dict[int, tuple[asyncio.AbstractEventLoop, httpx2.AsyncClient]] = {}


def shared_client(max_connections: int) -> httpx2.AsyncClient:
    """The process's client for desktops on the running loop (created on first use)."""
    loop = asyncio.get_running_loop()
    entry = _CLIENTS.get(id(loop))
    if entry is None or entry[0] is not loop or entry[1].is_closed:
        client = httpx2.AsyncClient(
            limits=httpx2.Limits(
                max_connections=max_connections, max_keepalive_connections=max_connections
            ),
            timeout=httpx2.Timeout(30.0),
            verify=_ssl_context(),
        )
        _CLIENTS[id(loop)] = (loop, client)
        return client
    return entry[1]


def lease_client(cfg: DesktopsConfig) -> httpx2.AsyncClient:
    """A client for the one desktop an episode leased; the episode closes it when it gives
    the desktop back. The episode's requests follow one another, so its pool keeps a single
    connection, and httpx2's work on each request (it probes every idle connection of the
    pool) stays constant. In the process's shared pool that work grows with every
    connection kept alive there, up to ``max_connections``."""
    return httpx2.AsyncClient(
        limits=httpx2.Limits(max_connections=cfg.max_connections,
                             max_keepalive_connections=1),  # requests are sequential
        timeout=httpx2.Timeout(30.0),
        verify=_ssl_context(),
    )


@functools.cache
def _ssl_context() -> ssl.SSLContext:
    """httpx2's default TLS context, built once per process (loading the CA bundle takes
    ~35 ms, which every new client would otherwise pay)."""
    return httpx2.create_ssl_context()


async def close_shared_client() -> None:
    """Close this loop's shared client (at actor or test shutdown)."""
    entry = _CLIENTS.pop(id(asyncio.get_running_loop()), None)
    if entry is not None:
        await entry[1].aclose()


# --------------------------------------------------------------------------- the client


class RemoteDesktopEnv:
    """One desktop reached over OSWorld's in-desktop HTTP protocol.

    ``reset(task)`` runs the task's setup steps and returns the first screenshot,
    ``step(action)`` runs pyautogui code (or handles ``WAIT``/``DONE``/``FAIL``) and waits
    ``pause_s``, ``observe()`` returns the screenshot, ``evaluate(task, last_action)`` scores.
    """

    def __init__(
        self,
        base_url: str,
        cfg: DesktopsConfig,
        *,
        name: str | None = None,
        client: httpx2.AsyncClient | None = None,
        python: str = "python",
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.cfg = cfg
        self.name = name or self.base_url
        self._client = client
        self._python = python
        token = secret_from_env(cfg.token_env, "desktops.token_env")
        self._headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._password = (
            secret_from_env(cfg.client_password_env, "desktops.client_password_env")
            if cfg.client_password_env
            else None
        )
        self.task_id: str | None = None

    # ----------------------------------------------------------------- environment API

    async def reset(self, task: Mapping[str, Any]) -> Screenshot:
        """Run ``task["config"]`` (OSWorld setup steps) and return the first observation."""
        self.task_id = str(task.get("id", "")) or None
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
        body = {"command": execute_command(action, self._python), "shell": False}
        reply = await self._json("POST", "/execute", json=body, idempotent=False)
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
        response = await self._request("GET", "/screenshot", idempotent=True)
        try:
            shot = Screenshot(response.content)
            shot.size  # noqa: B018 — validates the PNG header now, not in the runner
        except ValueError as exc:
            raise DesktopError(f"{self.name}: /screenshot did not return a PNG") from exc
        return shot

    async def evaluate(self, task: Mapping[str, Any], last_action: str | None = None) -> float:
        """Score the episode with the task's evaluator (see ``evaluators.py``)."""
        import evaluators  # the evaluator stack is imported only where scoring happens

        return await evaluators.evaluate(self, task, last_action)

    async def close(self) -> None:
        """Nothing to release per desktop: the HTTP client is shared by the process."""

    # ----------------------------------------------------------------- protocol calls

    async def execute(
        self, command: list[str] | str, *, shell: bool = False, timeout_s: float | None = None
    ) -> dict[str, Any]:
        """``/execute``: ``{status, output, error, returncode}``."""
        return await self._json(
            "POST", "/execute", json={"command": command, "shell": shell},
            idempotent=False, timeout_s=timeout_s,
        )

    async def run_python(self, code: str) -> dict[str, Any]:
        return await self._json("POST", "/run_python", json={"code": code}, idempotent=False)

    async def get_file(self, path: str) -> bytes | None:
        """The bytes of a file on the desktop, or None if it does not exist."""
        response = await self._request(
            "POST", "/file", data={"file_path": path}, idempotent=True, allow_status=(404,)
        )
        return None if response.status_code == 404 else response.content

    async def upload(self, path: str, data: bytes) -> None:
        await self._request(
            "POST", "/setup/upload", data={"file_path": path},
            files={"file_data": (os.path.basename(path) or "file", data)}, idempotent=True,
            timeout_s=self.cfg.setup_timeout_s,
        )

    async def accessibility_tree(self) -> str:
        reply = await self._json("GET", "/accessibility", idempotent=True)
        return str(reply.get("AT") or "")

    async def terminal_output(self) -> str:
        reply = await self._json("GET", "/terminal", idempotent=True)
        return str(reply.get("output") or "")

    async def cursor_position(self) -> tuple[int, int]:
        """``/cursor_position``: the pointer's screen coordinates."""
        response = await self._request("GET", "/cursor_position", idempotent=True)
        try:
            x, y = response.json()
            return int(x), int(y)
        except (ValueError, TypeError) as exc:
            raise DesktopError(f"{self.name}/cursor_position: unexpected reply "
                               f"{response.text[:100]!r}") from exc

    async def health(self) -> bool:
        """True when the desktop answers ``/screen_size`` quickly."""
        try:
            await self._request("POST", "/screen_size", idempotent=True, retries=0,
                                timeout_s=min(5.0, self.cfg.request_timeout_s))
        except DesktopError:
            return False
        return True

    # ----------------------------------------------------------------- task setup

    async def run_setup_step(self, step: Mapping[str, Any], index: int = 0) -> None:
        """One OSWorld setup step ``{"type": ..., "parameters": {...}}``."""
        kind = step.get("type") if isinstance(step, Mapping) else None
        params = (step.get("parameters") or {}) if isinstance(step, Mapping) else {}
        where = f"task {self.task_id or '?'} config[{index}]"
        if not isinstance(kind, str) or not isinstance(params, Mapping):
            raise TaskSetupError(f"{where}: a setup step needs a 'type' and 'parameters' mapping")
        params = self._fill_placeholders(params, where)
        handler = getattr(self, f"_setup_{kind}", None)
        if handler is None:
            raise UnsupportedSetupStep(f"{where}: setup step type {kind!r} is not supported")
        try:
            await handler(**params)
        except TypeError as exc:
            raise TaskSetupError(f"{where}: bad parameters for {kind!r}: {exc}") from exc
        except DesktopError as exc:
            if isinstance(exc, TaskSetupError):
                raise
            raise TaskSetupError(f"{where} ({kind}) failed: {exc}") from exc

    async def _setup_launch(self, command: list[str] | str, shell: bool = False) -> None:
        await self._request("POST", "/setup/launch", json={"command": command, "shell": shell},
                            idempotent=False, timeout_s=self.cfg.setup_timeout_s)

    async def _setup_execute(
        self,
        command: list[str] | str,
        shell: bool = False,
        stdout: str = "",
        stderr: str = "",
        until: Mapping[str, Any] | None = None,
    ) -> None:
        # stdout/stderr name files on the OSWorld host for logs; nothing to do with them here.
        del stdout, stderr
        deadline = time.monotonic() + self.cfg.setup_timeout_s
        while True:
            reply = await self._json(
                "POST", "/setup/execute", json={"command": command, "shell": shell},
                idempotent=False, timeout_s=self.cfg.setup_timeout_s,
            )
            if not until or _until_met(reply, until):
                return
            if time.monotonic() > deadline:
                raise TaskSetupError(f"execute {command!r}: 'until' {dict(until)} not met in time")
            await asyncio.sleep(0.3)

    _setup_command = _setup_execute

    async def _setup_open(self, path: str) -> None:
        await self._request("POST", "/setup/open_file", json={"path": path},
                            idempotent=False, timeout_s=self.cfg.setup_timeout_s)

    async def _setup_sleep(self, seconds: float) -> None:
        await asyncio.sleep(float(seconds))

    async def _setup_activate_window(
        self, window_name: str, strict: bool = False, by_class: bool = False
    ) -> None:
        await self._window_step("/setup/activate_window", window_name, strict, by_class)

    async def _setup_close_window(
        self, window_name: str, strict: bool = False, by_class: bool = False
    ) -> None:
        await self._window_step("/setup/close_window", window_name, strict, by_class)

    async def _window_step(self, path: str, window_name: str, strict: bool, by_class: bool
                           ) -> None:
        await self._request(
            "POST", path,
            json={"window_name": window_name, "strict": strict, "by_class": by_class},
            idempotent=True,
        )

    async def _setup_upload_file(self, files: list[Mapping[str, str]]) -> None:
        for f in files:
            local = Path(f["local_path"])
            try:
                data = await asyncio.to_thread(local.read_bytes)
            except OSError as exc:
                raise TaskSetupError(f"upload_file: cannot read {local}: {exc.strerror}") from exc
            await self.upload(f["path"], data)

    async def _setup_download(self, files: list[Mapping[str, str]]) -> None:
        """There is no network: each file must already be in ``download_cache_dir``."""
        for f in files:
            url, path = f["url"], f["path"]
            local = self._cached_download(url, path)
            data = await asyncio.to_thread(local.read_bytes)
            await self.upload(path, data)

    def _cached_download(self, url: str, path: str) -> Path:
        cache = Path(self.cfg.download_cache_dir)
        base = os.path.basename(path)
        # OSWorld's own cache layout first, so an existing OSWorld cache works as is.
        candidates = [cache / f"{uuid.uuid5(uuid.NAMESPACE_URL, url)}_{base}"]
        if self.task_id:
            candidates.append(cache / self.task_id / base)
        candidates += [cache / base, cache / os.path.basename(url.split("?", 1)[0])]
        for candidate in candidates:
            if candidate.is_file():
                return candidate
        raise TaskSetupError(
            f"download of {url} to {path}: not in the local cache (looked for "
            f"{', '.join(str(c) for c in candidates)}); there is no network here, so put the "
            "file in desktops.download_cache_dir first"
        )

    def _fill_placeholders(self, value: Any, where: str) -> Any:
        if isinstance(value, str):
            if "{CLIENT_PASSWORD}" in value:
                if self._password is None:
                    raise ConfigError(
                        f"{where} uses {{CLIENT_PASSWORD}} but desktops.client_password_env "
                        "is not set"
                    )
                value = value.replace("{CLIENT_PASSWORD}", self._password)
            w, h = self.cfg.screen_width, self.cfg.screen_height
            for key, number in (
                ("{SCREEN_WIDTH_HALF}", w // 2), ("{SCREEN_HEIGHT_HALF}", h // 2),
                ("{SCREEN_WIDTH}", w), ("{SCREEN_HEIGHT}", h),
            ):
                value = value.replace(key, str(number))
            return value
        if isinstance(value, Mapping):
            return {k: self._fill_placeholders(v, where) for k, v in value.items()}
        if isinstance(value, list):
            return [self._fill_placeholders(v, where) for v in value]
        return value

    # ----------------------------------------------------------------- transport

    def _http(self) -> httpx2.AsyncClient:
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
    ) -> httpx2.Response:
        """One request with a deadline; transient failures retried with capped backoff.

        Connection failures before sending are always retried; read errors, timeouts and
        5xx only for idempotent requests (an action must not run twice).
        """
        attempts = 1 + (self.cfg.retries if retries is None else retries)
        timeout = httpx2.Timeout(timeout_s or self.cfg.request_timeout_s, connect=5.0)
        url = self.base_url + path
        last: str = ""
        for attempt in range(attempts):
            if attempt:
                await asyncio.sleep(min(2.0, 0.2 * 2 ** (attempt - 1)))
            try:
                response = await self._http().request(
                    method, url, headers=self._headers, timeout=timeout, **kw
                )
            except (httpx2.ConnectError, httpx2.ConnectTimeout, httpx2.PoolTimeout) as exc:
                last = f"cannot connect ({type(exc).__name__})"
                continue
            except httpx2.TimeoutException as exc:
                last = f"timed out after {timeout.read}s ({type(exc).__name__})"
                if idempotent:
                    continue
                raise DesktopError(f"{self.name}{path}: {last}") from exc
            except httpx2.TransportError as exc:
                last = f"{type(exc).__name__}: {exc}"
                if idempotent:
                    continue
                raise DesktopError(f"{self.name}{path}: {last}") from exc
            if response.status_code < 400 or response.status_code in allow_status:
                return response
            detail = _error_detail(response)
            if response.status_code == 401:
                raise DesktopError(f"{self.name}{path}: unauthorized (check desktops.token_env)")
            if response.status_code >= 500 and idempotent:
                last = f"HTTP {response.status_code}: {detail}"
                continue
            raise DesktopError(f"{self.name}{path}: HTTP {response.status_code}: {detail}")
        raise DesktopError(f"{self.name}{path}: {last} after {attempts} attempt(s)")


def _error_detail(response: httpx2.Response) -> str:
    try:
        body = response.json()
    except ValueError:
        return response.text[:300]
    if isinstance(body, dict):
        for key in ("message", "error", "detail"):
            if body.get(key):
                return str(body[key])[:300]
    return json.dumps(body)[:300]


def _until_met(reply: Mapping[str, Any], until: Mapping[str, Any]) -> bool:
    """OSWorld's ``until``: every given field matches (returncode equal, text contained)."""
    if "returncode" in until and reply.get("returncode") != until["returncode"]:
        return False
    if "stdout" in until and str(until["stdout"]) not in str(reply.get("output") or ""):
        return False
    return not ("stderr" in until and str(until["stderr"]) not in str(reply.get("error") or ""))



# --------------------------------------------------------------------------- the pool


@dataclass
class Desktop:
    """A desktop the pool owns; ``url`` is its server's base URL."""

    id: str
    url: str
    state: str = "starting"  # starting | free | leased | resetting | quarantined | stopped
    info: dict[str, Any] = field(default_factory=dict)
    leases: int = 0
    failures: int = 0
    last_error: str | None = None
    quarantined_at: float = 0.0


@dataclass(frozen=True)
class Lease:
    """A desktop lent to ``owner`` until ``deadline`` (``time.time()`` seconds)."""

    lease_id: str
    desktop_id: str
    url: str
    owner: str
    deadline: float


class DesktopProvider(abc.ABC):
    """Where desktops come from. One method per lifecycle step; ``replaceable`` says whether
    a broken desktop is stopped and a new one started (else it is retried later)."""

    replaceable = True

    @abc.abstractmethod
    async def start(self, index: int) -> Desktop:
        """Bring up desktop number ``index``."""

    @abc.abstractmethod
    async def reset(self, desktop: Desktop) -> None:
        """Return the desktop to a clean state; raise if that fails."""

    @abc.abstractmethod
    async def stop(self, desktop: Desktop) -> None:
        """Stop what ``start`` started."""

    @abc.abstractmethod
    async def health(self, desktop: Desktop) -> bool:
        """Whether the desktop can be handed out."""

    def capacity(self) -> int | None:
        """The most desktops this provider can have (None: no limit)."""
        return None


class StaticProvider(DesktopProvider):
    """Desktops that already run (e.g. OSWorld VMs), given by URL; never started or stopped.
    Reset runs the configured command through ``/execute`` and checks health."""

    replaceable = False

    def __init__(self, cfg: DesktopsConfig) -> None:
        self.cfg = cfg

    def capacity(self) -> int | None:
        return len(self.cfg.static.urls)

    def _env(self, desktop: Desktop) -> RemoteDesktopEnv:
        return RemoteDesktopEnv(desktop.url, self.cfg, name=desktop.id)

    async def start(self, index: int) -> Desktop:
        urls = self.cfg.static.urls
        if index >= len(urls):
            raise DesktopError(f"desktops.static.urls has {len(urls)} URLs; no desktop #{index}")
        desktop = Desktop(id=f"static-{index}", url=urls[index].rstrip("/"))
        if not await self.health(desktop):
            raise DesktopError(f"static desktop {desktop.url} does not answer")
        return desktop

    async def reset(self, desktop: Desktop) -> None:
        command = self.cfg.static.reset_command
        if command:
            reply = await self._env(desktop).execute(command, timeout_s=self.cfg.reset_timeout_s)
            if reply.get("returncode") not in (0, None):
                raise DesktopError(
                    f"{desktop.id}: reset command exited {reply.get('returncode')}: "
                    f"{str(reply.get('error') or '')[:300]}"
                )
        # The pool health-checks every desktop after its reset.

    async def stop(self, desktop: Desktop) -> None:
        """Static desktops belong to someone else: nothing to stop."""

    async def health(self, desktop: Desktop) -> bool:
        return await self._env(desktop).health()


class LocalProvider(DesktopProvider):
    """Desktops on this machine: each an Xvfb display with a window manager, a session bus,
    its own HOME and the desktop server (see ``desktop/session.py``). Desktops left by a
    crashed earlier run are found through the state dir and removed before the first start."""

    replaceable = True

    def __init__(self, cfg: DesktopsConfig) -> None:
        self.cfg = cfg
        self._sessions: dict[str, Any] = {}
        self._swept = False
        self.stale_removed: list[str] = []

    async def start(self, index: int) -> Desktop:
        from desktop.session import LocalDesktopSession, sweep_stale_sessions

        if not self._swept:
            self._swept = True
            self.stale_removed = await asyncio.to_thread(
                sweep_stale_sessions, self.cfg.local.state_dir
            )
            if self.stale_removed:
                log.warning("removed stale local desktops: %s", ", ".join(self.stale_removed))
        # The pid keeps two runs sharing a state dir apart; the index keeps desktops apart.
        desktop_id = f"local-{os.getpid()}-{index}"
        session = LocalDesktopSession(
            desktop_id, self.cfg.local.state_dir, self.cfg.screen_width, self.cfg.screen_height,
            window_manager=self.cfg.local.window_manager,
            home_template=self.cfg.local.home_template, token_env=self.cfg.token_env,
            start_timeout_s=self.cfg.local.start_timeout_s,
        )
        url = await asyncio.to_thread(session.start)
        self._sessions[desktop_id] = session
        return Desktop(id=desktop_id, url=url, info={"display": session.display.display})

    async def reset(self, desktop: Desktop) -> None:
        timings = await asyncio.to_thread(self._sessions[desktop.id].reset)
        desktop.info["last_reset"] = timings

    async def stop(self, desktop: Desktop) -> None:
        session = self._sessions.pop(desktop.id, None)
        if session is not None:
            await asyncio.to_thread(session.stop)

    async def health(self, desktop: Desktop) -> bool:
        session = self._sessions.get(desktop.id)
        if session is None or not session.alive():
            return False
        return await RemoteDesktopEnv(desktop.url, self.cfg, name=desktop.id).health()


def make_provider(cfg: DesktopsConfig) -> DesktopProvider:
    if cfg.provider == "static":
        return StaticProvider(cfg)
    if cfg.provider == "local":
        return LocalProvider(cfg)
    raise ConfigError(f"desktops.provider {cfg.provider!r} is not available yet")


class DesktopPool:
    """M desktops lent to episodes. Run it as an async Ray actor (``ray.remote(DesktopPool)``)
    or in-process.

    ``lease(owner, timeout_s)`` hands out a free desktop (never one that is resetting or
    quarantined) or raises ``DesktopUnavailable``; ``release(lease_id, healthy)`` returns it
    and resets it in the background, outside any lock, so other leases never wait for a reset.
    A desktop that fails its reset or health check is quarantined, then replaced (local,
    Kubernetes) or re-checked later (static). Leases past ``lease_max_s`` are reclaimed.
    """

    def __init__(self, cfg: DesktopsConfig, provider: DesktopProvider | None = None) -> None:
        self.cfg = cfg
        self.provider = provider or make_provider(cfg)
        self._desktops: dict[str, Desktop] = {}
        self._free: list[str] = []                 # desktop ids, oldest ready first
        self._waiters: list[asyncio.Future[str]] = []
        self._leases: dict[str, Lease] = {}
        self._tasks: set[asyncio.Task[Any]] = set()
        self._housekeeper: asyncio.Task[Any] | None = None
        self._next_index = 0
        self._started = False
        self._stopping = False
        self.counters = {"leases": 0, "releases": 0, "resets": 0, "reset_failures": 0,
                         "quarantined": 0, "replaced": 0, "reclaimed": 0, "lease_timeouts": 0}
        self.reset_durations_s: list[float] = []

    # ----------------------------------------------------------------- lifecycle

    def target_size(self) -> int:
        want = self.cfg.count + self.cfg.warm_spares
        cap = self.provider.capacity()
        return want if cap is None else min(want, cap)

    async def start(self) -> dict[str, Any]:
        """Start the desktops concurrently; returns ``stats()``. Fails if none comes up."""
        if self._started:
            return self.stats()
        self._started = True
        results = await asyncio.gather(
            *(self._start_one() for _ in range(self.target_size())), return_exceptions=True
        )
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors and len(errors) == len(results):
            raise DesktopError(f"no desktop could be started: {errors[0]}") from errors[0]
        for err in errors:
            log.error("a desktop failed to start: %s", err)
        self._housekeeper = self._spawn(self._housekeeping())
        return self.stats()

    async def stop(self) -> None:
        """Stop every desktop this pool started and cancel its background work."""
        self._stopping = True
        if self._housekeeper is not None:
            self._housekeeper.cancel()
        # Resets and replacements run partly in threads that cancelling cannot stop: let them
        # finish (bounded), or one could recreate a desktop's files after it was stopped.
        busy = [t for t in self._tasks if t is not self._housekeeper]
        if busy:
            _, late = await asyncio.wait(busy, timeout=self.cfg.reset_timeout_s)
            for task in late:
                task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for waiter in self._waiters:
            if not waiter.done():
                waiter.set_exception(DesktopUnavailable("the desktop pool is stopping"))
        await asyncio.gather(
            *(self._stop_quietly(d) for d in self._desktops.values()), return_exceptions=True
        )
        await close_shared_client()

    # ----------------------------------------------------------------- leases

    async def lease(
        self, owner: str, timeout_s: float | None = None, avoid: Iterable[str] = ()
    ) -> Lease:
        """A free desktop for ``owner``; ``DesktopUnavailable`` after ``timeout_s``.
        Desktops in ``avoid`` (where an earlier attempt failed) are handed out only when no
        other one is free."""
        if self._stopping:
            raise DesktopUnavailable("the desktop pool is stopping")
        wait_s = self.cfg.lease_timeout_s if timeout_s is None else timeout_s
        desktop_id = self._take_free(frozenset(avoid))
        if desktop_id is None:
            waiter: asyncio.Future[str] = asyncio.get_running_loop().create_future()
            self._waiters.append(waiter)
            try:
                # shield: a timeout must not lose a desktop handed over at the same moment.
                desktop_id = await asyncio.wait_for(asyncio.shield(waiter), wait_s)
            except (TimeoutError, asyncio.CancelledError) as exc:
                handed = waiter.result() if waiter.done() and not waiter.cancelled() else None
                waiter.cancel()
                if isinstance(exc, asyncio.CancelledError):
                    if handed is not None:
                        self._make_free(handed)
                    raise
                if handed is None:
                    self.counters["lease_timeouts"] += 1
                    raise DesktopUnavailable(
                        f"no desktop free for {owner} within {wait_s:.0f}s ({self._summary()})"
                    ) from None
                desktop_id = handed
            finally:
                if waiter in self._waiters:
                    self._waiters.remove(waiter)
        desktop = self._desktops[desktop_id]
        desktop.state = "leased"
        desktop.leases += 1
        lease = Lease(uuid.uuid4().hex, desktop.id, desktop.url, owner,
                      time.time() + self.cfg.lease_max_s)
        self._leases[lease.lease_id] = lease
        self.counters["leases"] += 1
        return lease

    async def release(self, lease_id: str, healthy: bool = True) -> None:
        """Give a desktop back; it is reset in the background before anyone else gets it."""
        lease = self._leases.pop(lease_id, None)
        if lease is None:
            log.warning("release of unknown or reclaimed lease %s ignored", lease_id)
            return
        self.counters["releases"] += 1
        desktop = self._desktops[lease.desktop_id]
        if not healthy:
            desktop.failures += 1
        desktop.state = "resetting"
        self._spawn(self._reset(desktop))

    async def release_owned(self, owner_prefix: str, healthy: bool = True) -> int:
        """Release every lease whose owner starts with ``owner_prefix`` (the leases of a
        runner that died); returns how many."""
        ids = [i for i, lease in self._leases.items() if lease.owner.startswith(owner_prefix)]
        for lease_id in ids:
            await self.release(lease_id, healthy)
        return len(ids)

    def stats(self) -> dict[str, Any]:
        by_state = {s: 0 for s in ("starting", "free", "leased", "resetting", "quarantined")}
        for d in self._desktops.values():
            if d.state in by_state:
                by_state[d.state] += 1
        resets = sorted(self.reset_durations_s)
        return {
            **by_state,
            "waiting": len(self._waiters),
            **self.counters,
            "reset_s_median": resets[len(resets) // 2] if resets else None,
            "reset_s_max": resets[-1] if resets else None,
            "desktops": [
                {"id": d.id, "url": d.url, "state": d.state, "leases": d.leases,
                 "last_error": d.last_error} for d in self._desktops.values()
            ],
        }

    # ----------------------------------------------------------------- internals

    def _summary(self) -> str:
        s = self.stats()
        return ", ".join(f"{k} {s[k]}" for k in ("free", "leased", "resetting", "quarantined",
                                                  "starting"))

    def _take_free(self, avoid: frozenset[str] = frozenset()) -> str | None:
        self._free = [d for d in self._free if self._desktops[d].state == "free"]
        if not self._free:
            return None
        preferred = next((d for d in self._free if d not in avoid), self._free[0])
        self._free.remove(preferred)
        return preferred

    def _make_free(self, desktop_id: str) -> None:
        desktop = self._desktops[desktop_id]
        while self._waiters:
            waiter = self._waiters.pop(0)
            if not waiter.done():
                desktop.state = "leased"  # reserved for this waiter
                waiter.set_result(desktop_id)
                return
        desktop.state = "free"
        self._free.append(desktop_id)

    def _spawn(self, coro: Any) -> asyncio.Task[Any]:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def _start_one(self) -> Desktop:
        index = self._next_index
        self._next_index += 1
        desktop = await self.provider.start(index)
        self._desktops[desktop.id] = desktop
        self._make_free(desktop.id)
        return desktop

    async def _reset(self, desktop: Desktop) -> None:
        started = time.monotonic()
        try:
            await asyncio.wait_for(self.provider.reset(desktop), self.cfg.reset_timeout_s)
            if not await self.provider.health(desktop):
                raise DesktopError("unhealthy after reset")
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # any failure of a reset quarantines the desktop
            self.counters["reset_failures"] += 1
            await self._quarantine(desktop, f"reset failed: {exc!r}")
            return
        self.counters["resets"] += 1
        self.reset_durations_s.append(time.monotonic() - started)
        self._make_free(desktop.id)

    async def _quarantine(self, desktop: Desktop, reason: str) -> None:
        log.warning("desktop %s quarantined: %s", desktop.id, reason)
        desktop.state = "quarantined"
        desktop.last_error = reason
        desktop.quarantined_at = time.monotonic()
        self.counters["quarantined"] += 1
        if self.provider.replaceable and not self._stopping:
            self._spawn(self._replace(desktop))

    async def _replace(self, desktop: Desktop) -> None:
        await self._stop_quietly(desktop)
        del self._desktops[desktop.id]
        try:
            await self._start_one()
            self.counters["replaced"] += 1
        except Exception as exc:  # keep the pool running with one desktop fewer
            log.error("replacement of %s failed: %s", desktop.id, exc)

    async def _stop_quietly(self, desktop: Desktop) -> None:
        try:
            await self.provider.stop(desktop)
        except Exception as exc:  # stopping is best effort; the reason is logged
            log.error("stopping %s failed: %s", desktop.id, exc)
        desktop.state = "stopped"

    async def _housekeeping(self) -> None:
        """Reclaim expired leases, health-check idle desktops, retry quarantined static ones."""
        while True:
            await asyncio.sleep(min(self.cfg.health_interval_s, 5.0))
            now = time.time()
            for lease in [x for x in self._leases.values() if x.deadline < now]:
                log.warning("lease %s of %s by %s expired; reclaiming", lease.lease_id,
                            lease.desktop_id, lease.owner)
                self.counters["reclaimed"] += 1
                await self.release(lease.lease_id, healthy=False)
            idle = [d for d in self._desktops.values() if d.state == "free"]
            healthy = await asyncio.gather(*(self.provider.health(d) for d in idle))
            for desktop, ok in zip(idle, healthy, strict=True):
                if not ok and desktop.state == "free":  # not leased while we were checking
                    self._free.remove(desktop.id)
                    await self._quarantine(desktop, "failed its health check while idle")
            if not self.provider.replaceable:
                retry_after = self.cfg.static.retry_quarantined_s
                for desktop in [d for d in self._desktops.values() if d.state == "quarantined"]:
                    if time.monotonic() - desktop.quarantined_at >= retry_after:
                        desktop.state = "resetting"
                        self._spawn(self._reset(desktop))


__all__ = [
    "Desktop",
    "DesktopPool",
    "DesktopProvider",
    "Lease",
    "LocalProvider",
    "RemoteDesktopEnv",
    "StaticProvider",
    "StepResult",
    "close_shared_client",
    "lease_client",
    "shared_client",
]
