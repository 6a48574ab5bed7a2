"""A GUI-Docker-Env environment manager for tests: our own implementation of the API of
``desktop_env/docker_server/server.py`` in github.com/Computer-use-agents/GUI-Docker-Env as
of commit e65796f350ea1ad155cdcaff7f97c6c5bb6932e6 (read, not copied; nothing of theirs is
in this repository), with each emulator a real local desktop (``LocalDesktopSession``, as
the ``local`` provider starts them) instead of a QEMU container.

Mirrored, with their status codes and message shapes (``{"message", "code"}``):

- the token, from the ``Authorization: Bearer`` header first, then a JSON body's
  ``"token"``, then the ``?token=`` query (their ``_extract_token``);
- ``GET|POST /start_emulator``: 401 without a token, 403 for one not configured, 429
  ``Token quota exceeded for '<token>': <current>/<limit>`` when its quota is full (decided
  under a lock, the slot taken before the start), 500 ``Failed to start emulator: <why>``
  with the slot given back (their rollback), else ``{"message", "code": 0, "data":
  {"emulator_id", "vnc_port", "chromium_port", "vlc_port", "server_port", "token"}}``
  once the desktop answers;
- ``POST /stop_emulator {"emulator_id"}`` and ``DELETE /emulators/<id>``: 400 without an id,
  404 ``Emulator not found``, with ``require_token`` 401 / 403 ``Forbidden: token does not
  own this emulator``;
- ``GET /emulator_status/<id>`` (``status: running``; 404 ``not_found``), ``GET /tokens``
  (``{token: {current, limit, emulator_count}}``), ``GET /emulators`` (``?token=``),
  ``GET /ping``, ``GET /status`` (emulators and tokens), ``POST /stop_all_emulators``.

Not mirrored: the dashboard and request logs, container resource figures, Docker cleanup
endpoints, ``/set_token_limit``. ``vnc_port`` is null (a local desktop has no VNC).
Chromium's and VLC's ports are the desktop's own (its ``/ports``).

``fail_next_starts`` makes starts fail (the rollback path); ``boots`` (begun), ``starts``
(done), ``refusals`` (429) and ``stopped`` count what happened; ``running()`` lists the
emulators alive.
"""

from __future__ import annotations

import asyncio
import threading
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from cua_rollout.core.http import ThreadedServer
from cua_rollout.envs.local_session import LocalDesktopSession

__all__ = ["GuiDockerEnvManager"]


@dataclass
class _Emulator:
    emulator_id: str
    token: str
    session: LocalDesktopSession
    server_port: int
    chromium_port: int
    vlc_port: int
    ports: dict[str, Any] = field(default_factory=dict)

    def view(self) -> dict[str, Any]:
        return {"emulator_id": self.emulator_id, "token": self.token, "vnc_port": None,
                "chromium_port": self.chromium_port, "vlc_port": self.vlc_port,
                "server_port": self.server_port}


def _reply(message: str, code: int, **more: Any) -> JSONResponse:
    return JSONResponse({"message": message, "code": code, **more},
                        status_code=200 if code == 0 else code)


class GuiDockerEnvManager:
    """The manager on a free loopback port (``url``); ``tokens``: token -> concurrency
    limit; emulators are desktops of ``width`` x ``height`` under ``state_dir``."""

    def __init__(self, state_dir: Path, tokens: dict[str, int], *, width: int = 1280,
                 height: int = 720, require_token: bool = True) -> None:
        self.state_dir = Path(state_dir)
        self.tokens = dict(tokens)
        self.width, self.height = width, height
        self.require_token = require_token
        self.emulators: dict[str, _Emulator] = {}
        self.usage: dict[str, dict[str, Any]] = {}
        self.lock = threading.Lock()
        self.fail_next_starts = 0
        self.boots = self.starts = self.refusals = self.stopped = 0
        self.server = ThreadedServer(self._app())

    @property
    def url(self) -> str:
        return self.server.url

    def start(self) -> GuiDockerEnvManager:
        self.server.start()
        return self

    def stop(self) -> None:
        """Stop the server and every emulator still running."""
        self.server.stop()
        for emu in list(self.emulators.values()):
            emu.session.stop()
        self.emulators.clear()

    def __enter__(self) -> GuiDockerEnvManager:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def running(self) -> list[str]:
        with self.lock:
            return list(self.emulators)

    # ----------------------------------------------------------------- the API

    @staticmethod
    async def _token(request: Request) -> str | None:
        auth = request.headers.get("Authorization")
        if auth and auth.startswith("Bearer "):
            return auth[len("Bearer "):].strip()
        if request.headers.get("content-type", "").startswith("application/json"):
            try:
                body = await request.json()
            except ValueError:
                body = None
            if isinstance(body, dict) and "token" in body:
                return str(body.get("token") or "").strip()
        if "token" in request.query_params:
            return request.query_params["token"].strip()
        return None

    def _usage(self, token: str) -> dict[str, Any]:
        return self.usage.setdefault(token, {"current": 0, "limit": self.tokens[token],
                                             "emulator_ids": set()})

    def _app(self) -> FastAPI:
        app = FastAPI()

        @app.get("/ping")
        def ping() -> dict[str, str]:
            return {"message": "Hello, World!"}

        @app.api_route("/start_emulator", methods=["GET", "POST"])
        async def start_emulator(request: Request) -> JSONResponse:
            token = await self._token(request)
            if not token:
                return _reply("Token required", 401)
            if token not in self.tokens:
                return _reply(f"Unknown or unauthorized token '{token}'", 403)
            emulator_id = str(uuid.uuid4())
            with self.lock:
                use = self._usage(token)
                if use["current"] >= use["limit"]:
                    self.refusals += 1
                    return _reply(f"Token quota exceeded for '{token}': "
                                  f"{use['current']}/{use['limit']}", 429)
                use["current"] += 1
                use["emulator_ids"].add(emulator_id)
            try:
                emu = await asyncio.to_thread(self._boot, emulator_id, token)
            except Exception as exc:
                with self.lock:  # their rollback: the slot goes back
                    use["current"] -= 1
                    use["emulator_ids"].discard(emulator_id)
                return _reply(f"Failed to start emulator: {exc}", 500)
            return _reply("Emulator started successfully", 0, data=emu.view())

        @app.post("/stop_emulator")
        async def stop_emulator(request: Request) -> JSONResponse:
            try:
                body = await request.json()
            except ValueError:
                body = {}
            emulator_id = body.get("emulator_id") if isinstance(body, dict) else None
            if not emulator_id:
                return _reply("emulator_id is required", 400)
            return await self._stop(emulator_id, await self._token(request))

        @app.delete("/emulators/{emulator_id}")
        async def delete_emulator(emulator_id: str, request: Request) -> JSONResponse:
            return await self._stop(emulator_id, await self._token(request))

        @app.get("/emulator_status/{emulator_id}")
        def emulator_status(emulator_id: str) -> JSONResponse:
            emu = self.emulators.get(emulator_id)
            if emu is None:
                return _reply("Emulator not found", 404, status="not_found")
            return JSONResponse({**emu.view(), "status": "running", "container_id": None})

        @app.get("/tokens")
        def tokens() -> dict[str, Any]:
            with self.lock:
                return {t: {"current": u["current"], "limit": u["limit"],
                            "emulator_count": len(u["emulator_ids"])}
                        for t, u in self.usage.items()}

        @app.get("/emulators")
        def emulators(token: str | None = None) -> list[dict[str, Any]]:
            return [e.view() for e in list(self.emulators.values())
                    if not token or e.token == token]

        @app.get("/status")
        def status() -> dict[str, Any]:
            with self.lock:
                views = [{"token": t, "current": u["current"], "limit": u["limit"],
                          "available": max(u["limit"] - u["current"], 0)}
                         for t, u in self.usage.items()]
            return {"total_emulators": len(self.emulators), "tokens": views}

        @app.post("/stop_all_emulators")
        async def stop_all(request: Request) -> JSONResponse:
            token = await self._token(request)
            if self.require_token and not token:
                return _reply("Token required", 401)
            ids = [i for i, e in list(self.emulators.items())
                   if not self.require_token or e.token == token]
            for emulator_id in ids:
                await self._stop(emulator_id, token)
            return _reply(f"Stopped {len(ids)} emulator(s), 0 failed", 0,
                          stopped_count=len(ids), failed_count=0, stopped_ids=ids)

        return app

    def _boot(self, emulator_id: str, token: str) -> _Emulator:
        self.boots += 1
        if self.fail_next_starts > 0:
            self.fail_next_starts -= 1
            raise RuntimeError("the test asked this start to fail")
        session = LocalDesktopSession(f"gde-{emulator_id[:8]}", self.state_dir, self.width,
                                      self.height, start_timeout_s=90)
        url = session.start()
        try:
            ports = httpx.get(url + "/ports", timeout=10).json()
            emu = _Emulator(emulator_id, token, session, int(url.rsplit(":", 1)[1]),
                            int(ports["chromium"]), int(ports["vlc"]))
        except Exception:
            session.stop()
            raise
        with self.lock:
            self.emulators[emulator_id] = emu
            self.starts += 1
        return emu

    async def _stop(self, emulator_id: str, requester: str | None) -> JSONResponse:
        emu = self.emulators.get(emulator_id)
        if emu is None:
            return _reply("Emulator not found", 404)
        if self.require_token:
            if not requester:
                return _reply("Token required", 401)
            if emu.token != requester:
                return _reply("Forbidden: token does not own this emulator", 403)
        await asyncio.to_thread(emu.session.stop)
        with self.lock:
            use = self.usage.get(emu.token)
            if use is not None:
                use["emulator_ids"].discard(emulator_id)
                use["current"] = max(0, use["current"] - 1)
            if self.emulators.pop(emulator_id, None) is not None:
                self.stopped += 1
        return _reply("Emulator stopped successfully", 0)
