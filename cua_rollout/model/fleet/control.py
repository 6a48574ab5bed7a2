"""The supervisor's control API on ``model_pool.host`` (``GET /status``, ``POST /reload``,
bearer token from the 0600 ``control.json``; ``GET /endpoints``, the published endpoint list,
also for the replicas' key): thin routes that run each request on the supervisor's loop and
map its answers to HTTP, and the client the ``status`` and ``reload`` commands use."""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import os
import secrets
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx

from cua_rollout.core.errors import FleetError
from cua_rollout.core.http import ThreadedServer
from cua_rollout.model.fleet.state import read_control
from cua_rollout.model.fleet.supervisor import ReloadOutcome, ReloadRefusal, Supervisor

if TYPE_CHECKING:
    from starlette.applications import Starlette

__all__ = [
    "ENDPOINTS_PATH",
    "RELOAD_PATH",
    "STATUS_PATH",
    "ControlClient",
    "ControlServer",
    "create_app",
]

STATUS_PATH = "/status"
RELOAD_PATH = "/reload"
ENDPOINTS_PATH = "/endpoints"  # what endpoints.json holds, for clients on other machines
_START_TIMEOUT_S = 30.0

# HTTP status of each reason ``Supervisor.request_reload`` gives for a refusal.
_REFUSAL_STATUS = {
    ReloadRefusal.BUSY: 409,
    ReloadRefusal.NOT_STARTED: 409,
    ReloadRefusal.BAD_CHECKPOINT: 400,
}


def _reload_reply(outcome: ReloadOutcome) -> tuple[int, dict[str, Any]]:
    if outcome.refused is None:
        return 202, {"reload": outcome.reload}
    body: dict[str, Any] = {"error": outcome.error}
    if outcome.refused is ReloadRefusal.BUSY:
        body["reload"] = outcome.reload or {}
    return _REFUSAL_STATUS[outcome.refused], body


def create_app(supervisor: Supervisor, loop: asyncio.AbstractEventLoop, token: str,
               reader_key: str | None = None) -> Starlette:
    """The control routes of ``supervisor``, whose methods run on ``loop``. ``/endpoints``
    also answers ``reader_key`` (the replicas' key: who may generate may know where), and
    anyone when the replicas have no key (then they are on loopback)."""
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse, Response
    from starlette.routing import Route

    def authorized(request: Request, *keys: str | None) -> bool:
        given = request.headers.get("authorization", "").encode()
        return any(hmac.compare_digest(given, f"Bearer {k}".encode())
                   for k in (token, *keys) if k)

    async def endpoints(request: Request) -> Response:
        if reader_key is not None and not authorized(request, reader_key):
            return JSONResponse({"error": "unauthorized"}, status_code=401)
        published = supervisor.published
        if published is None:
            return JSONResponse({"error": "nothing published yet"}, status_code=503)
        body = json.dumps(published, separators=(",", ":")).encode()
        etag = '"' + hashlib.blake2b(body, digest_size=12).hexdigest() + '"'
        if request.headers.get("if-none-match") == etag:  # the client's copy is current
            return Response(status_code=304, headers={"ETag": etag})
        return Response(body, media_type="application/json", headers={"ETag": etag})

    async def on_loop(make: Callable[[], Awaitable[Any]]) -> Any:
        async def call() -> Any:
            return await make()

        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(call(), loop))

    async def status(request: Request) -> JSONResponse:
        if not authorized(request):
            return JSONResponse({"error": "unauthorized"}, status_code=401)
        return JSONResponse(await on_loop(supervisor.status))

    async def reload(request: Request) -> JSONResponse:
        if not authorized(request):
            return JSONResponse({"error": "unauthorized"}, status_code=401)
        try:
            body = await request.json()
            checkpoint = str(body["checkpoint"])
            batch = body.get("batch")
            if batch is not None and (type(batch) is not int or batch < 1):
                raise TypeError(batch)
        except (ValueError, KeyError, TypeError, AttributeError):
            return JSONResponse({"error": 'expected {"checkpoint": PATH, "batch": N >= 1 '
                                          '(optional)}'}, status_code=400)

        async def start() -> ReloadOutcome:
            return supervisor.request_reload(checkpoint, batch)

        code, payload = _reload_reply(await on_loop(start))
        return JSONResponse(payload, status_code=code)

    return Starlette(routes=[
        Route(STATUS_PATH, status, methods=["GET"]),
        Route(RELOAD_PATH, reload, methods=["POST"]),
        Route(ENDPOINTS_PATH, endpoints, methods=["GET"]),
    ])


class ControlServer:
    """Serves ``create_app`` from a thread (``cua_rollout.core.http.ThreadedServer``) while the
    supervisor runs; ``token`` is made here, the supervisor publishes it."""

    def __init__(self, supervisor: Supervisor) -> None:
        self.supervisor = supervisor
        self.token = secrets.token_urlsafe(24)
        self._server: ThreadedServer | None = None

    def start(self, loop: asyncio.AbstractEventLoop) -> str:
        """Start serving on ``model_pool.host`` and ``control_port``, each request run on
        ``loop``; the URL."""
        pool = self.supervisor.pool
        app = create_app(self.supervisor, loop, self.token, self.supervisor.replica_key)
        server = ThreadedServer(app, pool.host, pool.control_port)
        try:
            server.start(timeout_s=_START_TIMEOUT_S)
        except RuntimeError as exc:
            raise FleetError(f"the control server did not start on {pool.host}:"
                             f"{pool.control_port} (model_pool.control_port: is it in use?)"
                             ) from exc
        self._server = server
        return server.url

    def stop(self) -> None:
        if self._server is not None:
            self._server.stop()
            self._server = None


@dataclass(frozen=True)
class ControlClient:
    """Talks to the live supervisor of a state dir; each call raises ``httpx.HTTPError``
    when it does not answer and returns the reply as it is."""

    url: str
    token: str
    timeout_s: float

    @classmethod
    def find(cls, state_dir: Path, timeout_s: float) -> ControlClient | None:
        """The client of the supervisor that runs for ``state_dir``, None if none runs."""
        info = read_control(state_dir)
        if info is None:
            return None
        if info.pid is not None:
            try:
                os.kill(info.pid, 0)
            except ProcessLookupError:
                return None
            except PermissionError:
                pass
        return cls(info.url, info.token, timeout_s)

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.token}"}

    def status(self) -> httpx.Response:
        """``GET /status``: 200 with the published state plus each replica's load."""
        return httpx.get(self.url + STATUS_PATH, headers=self.headers, timeout=self.timeout_s)

    def reload(self, checkpoint: str, batch: int | None = None) -> httpx.Response:
        """``POST /reload``: 202 with the reload started, else 4xx with its ``error``.
        ``batch``: replicas reloaded at once this time (None: the pool's reload_batch)."""
        body: dict[str, Any] = {"checkpoint": checkpoint}
        if batch is not None:
            body["batch"] = batch
        return httpx.post(self.url + RELOAD_PATH, json=body, headers=self.headers,
                          timeout=self.timeout_s)
