"""The desktop service's client (``cua-rollout desktops serve``): ``DesktopServiceClient``
speaks ``service_protocol.py`` over aiohttp, and turns the service's error bodies into the
project's error tree, so a caller tells a wait (``ServiceUnavailable``) from a lost lease
(``LeaseGone``) and a refusal no retry fixes (``ServiceRefused``).

    ServiceError(DesktopError)          .code, .status, .retry_after_s; message = the body's error
    ├── ServiceUnavailable              over_quota, no_desktop, stopping, service unreachable
    │                                   (also DesktopUnavailable: an outage, retried later)
    ├── LeaseGone                       unknown_env, lease_lost: lease again
    ├── BadServiceRequest               bad_request, too_large, unparseable: the caller's bug
    └── ServiceRefused                  unauthorized, address_not_allowed, forbidden
                                        (also ConfigError: fatal)
    desktop_died and setup_failed are ServiceError itself (blames the desktop; retryable).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator, Iterable
from typing import Any, TypeVar

import aiohttp
from pydantic import BaseModel, ValidationError

from cua_rollout.core.errors import ConfigError, DesktopError, DesktopUnavailable
from cua_rollout.core.http import TransportFailure, hot_request, hot_session, redact_url
from cua_rollout.envs.service_protocol import (
    ActReply,
    ActRequest,
    DesktopAction,
    DesktopsReply,
    ErrorBody,
    EvaluateReply,
    EvaluateRequest,
    HeartbeatReply,
    LeaseInfo,
    LeaseReply,
    LeaseRequest,
    Observation,
    ObserveRequest,
    ReleaseReply,
    ServicePaths,
)

__all__ = [
    "BadServiceRequest",
    "DesktopServiceClient",
    "KeepAlive",
    "LeaseGone",
    "ServiceError",
    "ServiceRefused",
    "ServiceUnavailable",
    "service_error",
]

log = logging.getLogger(__name__)

_T = TypeVar("_T", bound=BaseModel)

# Connecting to the service is fast or not at all.
_CONNECT_TIMEOUT_S = 10.0
# Requests that failed before anything was sent (no connection) are tried this many times.
_CONNECT_ATTEMPTS = 3
_CONNECT_BACKOFF_S = 0.5
# Connections kept to the service by one client.
_MAX_CONNECTIONS = 64


class ServiceError(DesktopError):
    """The desktop service answered an error (or could not be reached: ``code`` None).
    ``code`` is the body's ``ErrorCode``, ``status`` the HTTP status, ``retry_after_s`` when
    asking again may work (over quota, no desktop)."""

    def __init__(self, message: str, *, code: str | None = None, status: int | None = None,
                 retry_after_s: float | None = None, where: str = "") -> None:
        super().__init__(message)
        self.code = code
        self.status = status
        self.retry_after_s = retry_after_s
        self.where = where
        """The service and path asked (the message is the service's own words)."""


class ServiceUnavailable(ServiceError, DesktopUnavailable):
    """No desktop for now: the tenant's quota stayed full, no desktop came free, the service
    is stopping or cannot be reached. An outage: ask again later (``retry_after_s``)."""

    blames_desktop = False
    outage = "desktop"


class LeaseGone(ServiceError):
    """The env id is unknown (released, expired) or was granted by an earlier instance of
    the service: the lease is over, lease again."""

    blames_desktop = False


class BadServiceRequest(ServiceError):
    """The service refused the request's content (a field, a body too large, an action it
    cannot turn into code): the same request fails again."""

    retryable = False
    blames_desktop = False


class ServiceRefused(ServiceError, ConfigError):
    """The token, the caller's address or the env id's tenant is refused: no request can
    succeed until the configuration changes."""

    retryable = False
    blames_desktop = False
    fatal = True


_CLASSES: dict[str, type[ServiceError]] = {
    "over_quota": ServiceUnavailable, "no_desktop": ServiceUnavailable,
    "stopping": ServiceUnavailable,
    "unknown_env": LeaseGone, "lease_lost": LeaseGone,
    "bad_request": BadServiceRequest, "too_large": BadServiceRequest,
    "unparseable": BadServiceRequest,
    "unauthorized": ServiceRefused, "address_not_allowed": ServiceRefused,
    "forbidden": ServiceRefused,
}


def service_error(status: int, content: bytes, headers: dict[str, str] | None = None,
                  where: str = "") -> ServiceError:
    """The error of a reply with ``status`` >= 400: its ``ErrorBody`` when it has one (the
    class by its code; the message is the body's ``error``), else a ``ServiceError`` quoting
    the start of the body (a proxy's page, not the service's answer)."""
    try:
        body = ErrorBody.model_validate_json(content)
    except ValidationError:
        text = content[:300].decode("utf-8", "replace")
        cls = ServiceUnavailable if status in (502, 503, 504) else ServiceError
        return cls(f"{where}: HTTP {status}: {text}" if where else f"HTTP {status}: {text}",
                   status=status, where=where)
    retry_after = body.retry_after_s
    if retry_after is None and headers and headers.get("Retry-After", "").isdigit():
        retry_after = float(headers["Retry-After"])
    cls = _CLASSES.get(body.code, ServiceError)
    return cls(body.error, code=body.code, status=status, retry_after_s=retry_after,
               where=where)


class KeepAlive:
    """What ``keep_alive`` is doing: heartbeats sent, and the last error (``LeaseGone`` ends
    the heartbeats: there is no lease to keep)."""

    def __init__(self) -> None:
        self.beats = 0
        self.error: ServiceError | None = None
        self.expires_at: float | None = None


class DesktopServiceClient:
    """One service, one tenant's token. Every method is one request with a deadline of
    ``timeout_s`` (a lease's wait and setup included); an error reply raises its
    ``ServiceError`` subclass. Create it on the loop that uses it, or pass a ``session``."""

    def __init__(self, url: str, token: str | None = None, *, timeout_s: float = 300.0,
                 session: aiohttp.ClientSession | None = None) -> None:
        if not url.startswith(("http://", "https://")):
            raise ConfigError(f"desktop service URL {url!r} is not http(s)://host:port")
        self.url = url.rstrip("/")
        self.timeout_s = timeout_s
        self._headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._session = session
        self._owns_session = session is None

    # ----------------------------------------------------------------- leases

    async def lease(self, task: dict[str, Any] | None = None, *, wait_s: float | None = None,
                    access: str | None = None, observe: Iterable[str] = ("screenshot",),
                    label: str = "") -> LeaseReply:
        """Lease a desktop (for ``task``: its setup runs first); waits up to ``wait_s`` (None:
        the service's default) for quota and a free desktop."""
        body = _body(LeaseRequest, task=task, wait_s=wait_s, access=access,
                     observe=list(observe), label=label)
        timeout_s = self.timeout_s + (wait_s or 0.0)
        return await self._call("POST", ServicePaths.LEASES, LeaseReply, body,
                                timeout_s=timeout_s)

    async def act(self, env_id: str, *, kind: str, code: str | None = None,
                  reply: str | None = None, action: dict[str, Any] | None = None,
                  pause_s: float | None = None,
                  observe: Iterable[str] = ("screenshot",)) -> ActReply:
        """One action (``kind``: pyautogui, uitars, computer13, special) and the observation
        after it."""
        body = _body(ActRequest, kind=kind, code=code, reply=reply, action=action,
                     pause_s=pause_s, observe=list(observe))
        return await self._call("POST", _path(ServicePaths.ACT, env_id), ActReply, body)

    async def observe(self, env_id: str, observe: Iterable[str] = ("screenshot",)
                      ) -> Observation:
        body = _body(ObserveRequest, observe=list(observe))
        return await self._call("POST", _path(ServicePaths.OBSERVE, env_id), Observation, body)

    async def screenshot(self, env_id: str) -> bytes:
        """The desktop's screen as PNG bytes."""
        return await self._request("GET", _path(ServicePaths.SCREENSHOT, env_id))

    async def evaluate(self, env_id: str, last_action: str | None = None) -> EvaluateReply:
        body = _body(EvaluateRequest, last_action=last_action)
        return await self._call("POST", _path(ServicePaths.EVALUATE, env_id), EvaluateReply,
                                body)

    async def heartbeat(self, env_id: str) -> HeartbeatReply:
        return await self._call("POST", _path(ServicePaths.HEARTBEAT, env_id), HeartbeatReply)

    async def release(self, env_id: str) -> ReleaseReply:
        return await self._call("DELETE", _path(ServicePaths.LEASE, env_id), ReleaseReply)

    async def info(self, env_id: str) -> LeaseInfo:
        return await self._call("GET", _path(ServicePaths.LEASE, env_id), LeaseInfo)

    # ----------------------------------------------------------------- service

    async def status(self) -> dict[str, Any]:
        """``/status``: everything for the operator, a tenant's own leases for a tenant."""
        content = await self._request("GET", ServicePaths.STATUS)
        return _json(content, ServicePaths.STATUS)

    async def desktops(self) -> DesktopsReply:
        return await self._call("GET", ServicePaths.DESKTOPS, DesktopsReply)

    async def desktop_action(self, desktop_id: str, action: str) -> DesktopAction:
        """``release``, ``quarantine`` or ``remove`` a desktop (operator token)."""
        path = ServicePaths.of(ServicePaths.DESKTOP_ACTION, desktop_id=desktop_id,
                               action=action)
        return await self._call("POST", path, DesktopAction)

    @contextlib.asynccontextmanager
    async def keep_alive(self, env_id: str, every_s: float) -> AsyncIterator[KeepAlive]:
        """Heartbeat ``env_id`` every ``every_s`` in the background until the block ends (a
        long model call between actions keeps the lease)."""
        if every_s <= 0:
            raise ValueError(f"keep_alive: every_s must be > 0, got {every_s}")
        state = KeepAlive()
        task = asyncio.create_task(self._beat(env_id, every_s, state),
                                   name=f"heartbeat {env_id}")
        try:
            yield state
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def _beat(self, env_id: str, every_s: float, state: KeepAlive) -> None:
        while True:
            await asyncio.sleep(every_s)
            try:
                reply = await self.heartbeat(env_id)
            except LeaseGone as exc:
                state.error = exc
                log.warning("heartbeat of %s: %s", env_id, exc)
                return
            except ServiceError as exc:  # a hiccup: the next beat may pass
                state.error = exc
                log.warning("heartbeat of %s: %s", env_id, exc)
                continue
            state.beats += 1
            state.expires_at = reply.expires_at

    async def close(self) -> None:
        """Close the session this client made (a caller's session is left open)."""
        if self._owns_session and self._session is not None:
            session, self._session = self._session, None
            await session.close()

    async def __aenter__(self) -> DesktopServiceClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # ----------------------------------------------------------------- transport

    async def _call(self, method: str, path: str, reply: type[_T],
                    body: dict[str, Any] | None = None, *,
                    timeout_s: float | None = None) -> _T:
        content = await self._request(method, path, body, timeout_s=timeout_s)
        try:
            return reply.model_validate_json(content)
        except ValidationError as exc:
            raise ServiceError(f"{self._where(path)}: unexpected reply "
                               f"{content[:200]!r}: {exc.errors()[0]['msg']}") from exc

    async def _request(self, method: str, path: str, body: dict[str, Any] | None = None, *,
                       timeout_s: float | None = None) -> bytes:
        if self._session is None:
            self._session = hot_session(_MAX_CONNECTIONS)
        url = self.url + path
        last: TransportFailure | None = None
        for attempt in range(_CONNECT_ATTEMPTS):
            if attempt:
                await asyncio.sleep(_CONNECT_BACKOFF_S * attempt)
            try:
                response = await hot_request(
                    self._session, method, url, headers=self._headers, json_body=body,
                    timeout_s=timeout_s or self.timeout_s, connect_timeout_s=_CONNECT_TIMEOUT_S)
            except TransportFailure as exc:
                last = exc
                if exc.kind == "connect":  # nothing was sent: trying again is harmless
                    continue
                raise ServiceUnavailable(f"{self._where(path)}: {exc}",
                                         where=self._where(path)) from exc
            if response.status_code >= 400:
                raise service_error(response.status_code, response.content,
                                    where=self._where(path))
            return response.content
        raise ServiceUnavailable(f"{self._where(path)}: cannot connect ({last}) after "
                                 f"{_CONNECT_ATTEMPTS} attempts", where=self._where(path)
                                 ) from last

    def _where(self, path: str) -> str:
        return f"desktop service {redact_url(self.url)}{path}"


def _path(template: str, env_id: str) -> str:
    if not env_id or "/" in env_id:
        raise ValueError(f"env id {env_id!r} is not an env id")
    return ServicePaths.of(template, env_id=env_id)


def _body(model: type[BaseModel], **fields: Any) -> dict[str, Any]:
    """The request body, checked here so a wrong field fails before it is sent."""
    try:
        return model(**fields).model_dump(mode="json", exclude_none=True)
    except ValidationError as exc:
        raise BadServiceRequest(f"{model.__name__}: {_first_error(exc)}",
                                code="bad_request") from exc


def _first_error(exc: ValidationError) -> str:
    first = exc.errors()[0]
    where = ".".join(str(part) for part in first["loc"])
    return f"{where}: {first['msg']}" if where else first["msg"]


def _json(content: bytes, path: str) -> dict[str, Any]:
    try:
        value = json.loads(content)
    except ValueError as exc:
        raise ServiceError(f"desktop service {path}: reply is not JSON") from exc
    if not isinstance(value, dict):
        raise ServiceError(f"desktop service {path}: unexpected reply {value!r:.200}")
    return value
