"""The relay: a lease's desktop paths (``/v1/leases/{id}/desktop/<path>``) streamed to its
desktop's own server and back, for clients that cannot reach the desktop. The tenant's token
is checked on the way in (``app.py``) and replaced by the desktop's own on the way out;
bodies stream in both directions (a file upload or a recording is never held whole)."""

from __future__ import annotations

from collections.abc import AsyncIterator

import aiohttp
from fastapi import Request
from fastapi.responses import StreamingResponse

from cua_rollout.core.http import hot_session
from cua_rollout.service.failures import Refusal
from cua_rollout.service.metrics import ServiceMetrics
from cua_rollout.service.session import DesktopSession

__all__ = ["Relay"]

# Headers that belong to one hop (RFC 9110 7.6.1) or that the relay sets itself.
_HOP_HEADERS = frozenset({"connection", "keep-alive", "proxy-authenticate",
                          "proxy-authorization", "te", "trailer", "transfer-encoding",
                          "upgrade", "host", "authorization", "content-length"})
_CONNECTIONS = 256
_CONNECT_TIMEOUT_S = 5.0


class Relay:
    """One aiohttp session to every desktop (made on the serving loop at first use)."""

    def __init__(self, metrics: ServiceMetrics, request_timeout_s: float) -> None:
        self.metrics = metrics
        self.request_timeout_s = request_timeout_s
        self._session: aiohttp.ClientSession | None = None

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def forward(self, request: Request, session: DesktopSession, tenant: str,
                      path: str) -> StreamingResponse:
        if self._session is None:
            self._session = hot_session(_CONNECTIONS)
        address = session.env.address()
        url = f"{address.url}/{path.lstrip('/')}"
        if request.url.query:
            url += f"?{request.url.query}"
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP_HEADERS}
        if address.token:
            headers["Authorization"] = f"Bearer {address.token}"
        length = request.headers.get("content-length")
        if length is not None:
            headers["Content-Length"] = length  # sent as is, not chunked
        has_body = request.method not in ("GET", "HEAD") and (length not in (None, "0")
                                                              or "transfer-encoding"
                                                              in request.headers)
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=_CONNECT_TIMEOUT_S,
                                        sock_read=self.request_timeout_s)
        try:
            response = await self._session.request(
                request.method, url, data=self._upload(request) if has_body else None,
                headers=headers, allow_redirects=False, timeout=timeout)
        except (aiohttp.ClientError, TimeoutError) as exc:
            what = (f"desktop {session.desktop_id} did not answer the relayed "
                    f"{request.method} /{path}: {type(exc).__name__}: {exc}")
            if await session.env.health():  # this request's failure, not the desktop's
                raise Refusal("relay_failed", what) from exc
            raise Refusal("desktop_died", f"{what}; it stopped answering: the lease has "
                          "ended and the desktop is being replaced") from exc
        self.metrics.relayed_requests.labels(tenant).inc()
        out = {k: v for k, v in response.headers.items() if k.lower() not in _HOP_HEADERS}
        return StreamingResponse(self._download(response), status_code=response.status,
                                 headers=out)

    async def _upload(self, request: Request) -> AsyncIterator[bytes]:
        async for chunk in request.stream():
            self.metrics.relayed_bytes.labels("to_desktop").inc(len(chunk))
            yield chunk

    async def _download(self, response: aiohttp.ClientResponse) -> AsyncIterator[bytes]:
        try:
            async for chunk in response.content.iter_any():
                self.metrics.relayed_bytes.labels("from_desktop").inc(len(chunk))
                yield chunk
        finally:
            response.release()
