"""The service's HTTP edge: thin routes over ``DesktopService``, the address allow-list and
the body limit (ASGI middleware: a refused request is never read), the bearer token of
every path but ``/healthz``, and errors as ``ErrorBody`` with their status."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ValidationError

from cua_rollout.envs.service_protocol import (
    ActRequest,
    EvaluateRequest,
    LeaseRequest,
    ObserveRequest,
    ServicePaths,
)
from cua_rollout.service.core import DesktopService
from cua_rollout.service.failures import Refusal
from cua_rollout.service.metrics import CONTENT_TYPE
from cua_rollout.service.relay import Relay
from cua_rollout.service.tenants import AddressAllowList, Tenant

__all__ = ["create_app"]

Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]
M = TypeVar("M", bound=BaseModel)


class _TooLarge(Exception):
    pass


class _Guard:
    """Before any route: the caller's address against the allow-list (``/healthz`` is open
    to all), and the body's size: a declared ``Content-Length`` over the limit is refused
    before a byte is read, a chunked body as soon as it passes it."""

    def __init__(self, app: ASGIApp, allow: AddressAllowList, max_body_bytes: int,
                 on_refusal: Callable[[str], None]) -> None:
        self.app = app
        self.allow = allow
        self.max_body_bytes = max_body_bytes
        self.on_refusal = on_refusal

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        client = scope.get("client")
        if scope["path"] != ServicePaths.HEALTHZ and not self.allow.allows(
                client[0] if client else None):
            await self._refuse(Refusal("address_not_allowed", f"address "
                                       f"{client[0] if client else '?'} is not on the "
                                       "service's allow-list (service.allow)"), scope, receive,
                               send)
            return
        for name, value in scope["headers"]:
            if name == b"content-length" and value.isdigit() and \
                    int(value) > self.max_body_bytes:
                await self._refuse(self._too_large(), scope, receive, send)
                return
        seen = 0
        over = started = False

        async def counted() -> MutableMapping[str, Any]:
            nonlocal seen, over
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > self.max_body_bytes:
                over = True
                raise _TooLarge
            return message

        async def sending(message: MutableMapping[str, Any]) -> None:
            nonlocal started
            if over:
                return  # the app's answer to a body cut short: the 413 replaces it
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, counted, sending)
        except Exception:
            if not over:
                raise
        if over and not started:
            await self._refuse(self._too_large(), scope, receive, send)

    def _too_large(self) -> Refusal:
        return Refusal("too_large", f"the body exceeds the service's limit of "
                       f"{self.max_body_bytes} bytes (service.max_body_bytes)")

    async def _refuse(self, refusal: Refusal, scope: Scope, receive: Receive, send: Send
                      ) -> None:
        self.on_refusal(refusal.code)
        await _error_reply(refusal)(scope, receive, send)


def _error_reply(refusal: Refusal) -> JSONResponse:
    headers = {}
    if refusal.retry_after_s is not None:
        headers["Retry-After"] = str(max(1, round(refusal.retry_after_s)))
    if refusal.code == "unauthorized":
        headers["WWW-Authenticate"] = "Bearer"
    return JSONResponse(refusal.body().model_dump(exclude_none=True),
                        status_code=refusal.status, headers=headers)


async def _body(request: Request, model: type[M]) -> M:
    """The request's JSON body as ``model``; any fault is a 400 naming the field."""
    raw = await request.body()
    try:
        return model.model_validate_json(raw or b"{}")
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        raise Refusal("bad_request", f"{model.__name__}: {where + ': ' if where else ''}"
                      f"{first['msg']}") from None


def create_app(service: DesktopService, allow: AddressAllowList, relay: Relay) -> ASGIApp:
    """The service's ASGI app (the routes inside the guard)."""
    app = FastAPI(title="desktop service", docs_url=None, redoc_url=None, openapi_url=None)
    metrics = service.metrics

    @app.exception_handler(Refusal)
    async def refused(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, Refusal)
        metrics.refusals.labels(exc.code).inc()
        return _error_reply(exc)

    def tenant(request: Request) -> Tenant:
        return service.tenants.authenticate(request.headers.get("authorization"))

    def operator(request: Request) -> Tenant:
        who = tenant(request)
        if not who.is_operator:
            raise Refusal("forbidden", "this path is the operator's (service.operator_token_env)")
        return who

    @app.get(ServicePaths.HEALTHZ)
    async def healthz() -> dict[str, Any]:
        return {"ok": not service.stopping, "boot": service.table.boot}

    @app.get(ServicePaths.STATUS)
    async def status(request: Request) -> dict[str, Any]:
        return service.status(tenant(request))

    @app.get(ServicePaths.METRICS)
    async def prometheus(request: Request) -> Response:
        tenant(request)
        return Response(metrics.scrape(), media_type=CONTENT_TYPE)

    @app.post(ServicePaths.LEASES, status_code=201)
    async def lease(request: Request) -> Response:
        who = tenant(request)
        reply = await service.lease(who, await _body(request, LeaseRequest))
        return JSONResponse(reply.model_dump(), status_code=201)

    @app.get(ServicePaths.LEASE)
    async def info(env_id: str, request: Request) -> Response:
        return JSONResponse(service.info(tenant(request), env_id).model_dump())

    @app.delete(ServicePaths.LEASE)
    async def release(env_id: str, request: Request) -> Response:
        reply = await service.release(tenant(request), env_id)
        return JSONResponse(reply.model_dump())

    @app.post(ServicePaths.HEARTBEAT)
    async def heartbeat(env_id: str, request: Request) -> Response:
        reply = await service.heartbeat(tenant(request), env_id)
        return JSONResponse(reply.model_dump())

    @app.post(ServicePaths.ACT)
    async def act(env_id: str, request: Request) -> Response:
        who = tenant(request)
        reply = await service.act(who, env_id, await _body(request, ActRequest))
        return JSONResponse(reply.model_dump())

    @app.post(ServicePaths.OBSERVE)
    async def observe(env_id: str, request: Request) -> Response:
        who = tenant(request)
        body = await _body(request, ObserveRequest)
        return JSONResponse((await service.observe(who, env_id, body.observe)).model_dump())

    @app.get(ServicePaths.SCREENSHOT)
    async def screenshot(env_id: str, request: Request) -> Response:
        png = await service.screenshot(tenant(request), env_id)
        return Response(png, media_type="image/png")

    @app.post(ServicePaths.EVALUATE)
    async def evaluate(env_id: str, request: Request) -> Response:
        who = tenant(request)
        body = await _body(request, EvaluateRequest)
        return JSONResponse((await service.evaluate(who, env_id, body.last_action)
                             ).model_dump())

    @app.api_route(ServicePaths.RELAY + "/{path:path}",
                   methods=["GET", "POST", "PUT", "DELETE", "PATCH", "HEAD"])
    async def relayed(env_id: str, path: str, request: Request) -> Response:
        who = tenant(request)
        async with service.using(who, env_id, exclusive=False) as entry:
            return await relay.forward(request, entry.session, entry.tenant, path)

    @app.get(ServicePaths.DESKTOPS)
    async def desktops(request: Request) -> Response:
        operator(request)
        return JSONResponse(service.desktops().model_dump())

    @app.post(ServicePaths.DESKTOP_ACTION)
    async def desktop_action(desktop_id: str, action: str, request: Request) -> Response:
        operator(request)
        reply = await service.desktop_action(desktop_id, action)
        return JSONResponse(reply.model_dump())

    return _Guard(app, allow, service.scfg.max_body_bytes,
                  lambda code: metrics.refusals.labels(code).inc())
