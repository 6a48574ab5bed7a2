"""The transport of a step's hot requests (aiohttp, ``cua_rollout.core.http.hot_request``)
and the desktop client over it, against a real aiohttp server on loopback: each failure is
told apart, a streamed body of known size is never chunked, forms and uploads arrive as the
desktop server reads them, redirects are not followed, and the desktop client retries only
what is safe to repeat."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator

import aiohttp
import pytest
from aiohttp import web

from cua_rollout.config import DesktopsConfig
from cua_rollout.core.errors import DesktopError
from cua_rollout.core.http import TransportFailure, error_text, hot_request, hot_session
from cua_rollout.envs.client import RemoteDesktopEnv


class Server:
    def __init__(self) -> None:
        self.seen: list[dict] = []
        self.calls: dict[str, int] = {}
        self.app = web.Application(client_max_size=16 * 2**20)
        self.app.router.add_route("*", "/{tail:.*}", self.handle)
        self.runner: web.AppRunner | None = None
        self.url = ""

    async def handle(self, request: web.Request) -> web.StreamResponse:
        path = request.path
        self.calls[path] = self.calls.get(path, 0) + 1
        entry = {"path": path, "headers": dict(request.headers)}
        if request.content_type == "multipart/form-data":
            form = await request.post()
            entry["form"] = {k: (v.filename, v.file.read()) if hasattr(v, "file") else v
                             for k, v in form.items()}
        elif request.content_type == "application/x-www-form-urlencoded":
            entry["form"] = dict(await request.post())
        else:
            entry["body"] = await request.read()
        self.seen.append(entry)
        if path == "/slow":
            await asyncio.sleep(2)
        if path == "/hangup":
            assert request.transport is not None
            request.transport.close()
            await asyncio.sleep(1)
        if path == "/redirect":
            raise web.HTTPFound("/elsewhere")
        if path == "/flaky" and self.calls[path] < 3:
            return web.json_response({"message": "not yet"}, status=503)
        if path == "/screenshot":
            return web.Response(body=b"\x89PNG\r\n\x1a\n" + b"\0\0\0\rIHDR"
                                + (800).to_bytes(4, "big") + (600).to_bytes(4, "big") + b"x" * 50,
                                content_type="image/png")
        if path == "/execute":
            return web.json_response({"status": "error", "message": "boom"}, status=500)
        return web.json_response({"ok": True, "path": path})

    async def __aenter__(self) -> Server:
        self.runner = web.AppRunner(self.app)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self.url = f"http://127.0.0.1:{port}"
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self.runner is not None
        await self.runner.cleanup()


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
async def server() -> AsyncIterator[Server]:
    async with Server() as s:
        yield s


async def _call(path: str, server: Server, **kw) -> object:
    session = hot_session(4)
    try:
        return await hot_request(session, kw.pop("method", "GET"), server.url + path,
                                 timeout_s=kw.pop("timeout_s", 2.0), connect_timeout_s=2.0,
                                 **kw)
    finally:
        await session.close()


async def test_each_failure_is_told_apart(server: Server) -> None:
    session = hot_session(4)
    try:
        with pytest.raises(TransportFailure) as refused:
            await hot_request(session, "GET", f"http://127.0.0.1:{_closed_port()}/x",
                              timeout_s=2, connect_timeout_s=2)
        assert refused.value.kind == "connect"
        with pytest.raises(TransportFailure) as slow:
            await hot_request(session, "GET", server.url + "/slow", timeout_s=0.3,
                              connect_timeout_s=2)
        assert slow.value.kind == "timeout"
        with pytest.raises(TransportFailure) as hangup:
            await hot_request(session, "POST", server.url + "/hangup", timeout_s=3,
                              connect_timeout_s=2, json_body={"a": 1})
        assert hangup.value.kind == "disconnected"
    finally:
        await session.close()


async def test_a_streamed_body_of_known_size_is_sent_whole_and_never_chunked(
        server: Server) -> None:
    pieces = [b'{"a": "', b"x" * 300_000, b'"}']

    class Body:
        async def __aiter__(self):
            for p in pieces:
                yield p

    reply = await _call("/chat", server, method="POST", body=Body(),
                        content_length=sum(map(len, pieces)),
                        headers={"Content-Type": "application/json"})
    assert reply.status_code == 200 and reply.json()["path"] == "/chat"
    seen = server.seen[-1]
    assert "Transfer-Encoding" not in seen["headers"]
    assert seen["headers"]["Content-Length"] == str(300_009)
    assert seen["body"] == b"".join(pieces)


async def test_forms_and_uploads_arrive_as_fields(server: Server) -> None:
    await _call("/file", server, method="POST", form={"file_path": "/home/user/a b.txt"})
    assert server.seen[-1]["form"] == {"file_path": "/home/user/a b.txt"}
    await _call("/setup/upload", server, method="POST", form={"file_path": "/tmp/x.bin"},
                files={"file_data": ("x.bin", b"\0\1\2")})
    assert server.seen[-1]["form"] == {"file_path": "/tmp/x.bin",
                                       "file_data": ("x.bin", b"\0\1\2")}


async def test_redirects_are_not_followed_and_errors_are_read(server: Server) -> None:
    reply = await _call("/redirect", server)
    assert reply.status_code == 302 and server.calls.get("/elsewhere") is None
    reply = await _call("/execute", server, method="POST", json_body={})
    assert reply.status_code == 500 and error_text(reply) == "boom"


async def test_the_desktop_client_retries_reads_but_never_an_action(server: Server) -> None:
    cfg = DesktopsConfig(retries=3, request_timeout_s=0.5)
    env = RemoteDesktopEnv.for_lease(server.url, cfg, name="d1")
    try:
        shot = await env.observe()
        assert shot.size == (800, 600)
        reply = await env._json("GET", "/flaky", idempotent=True)  # 503, 503, then 200
        assert reply["ok"] and server.calls["/flaky"] == 3
        with pytest.raises(DesktopError, match=r"d1/execute: HTTP 500: boom"):
            await env.step("pyautogui.click(1, 2)")
        assert server.calls["/execute"] == 1   # a 5xx action is not repeated
        with pytest.raises(DesktopError, match=r"d1/slow: timed out after 0.5s"):
            await env._request("POST", "/slow", idempotent=False)
        assert server.calls["/slow"] == 1      # nor one that timed out
    finally:
        await env.close()
    refused = RemoteDesktopEnv.for_lease(f"http://127.0.0.1:{_closed_port()}",
                                         DesktopsConfig(retries=1), name="gone")
    try:
        with pytest.raises(DesktopError, match=r"gone/screenshot: cannot connect .* after "
                                               r"2 attempt\(s\)"):
            await refused.observe()
    finally:
        await refused.close()


async def test_proxies_come_from_the_environment(server: Server, monkeypatch) -> None:
    import cua_rollout.core.http as http

    monkeypatch.setenv("HTTP_PROXY", server.url)
    monkeypatch.setenv("NO_PROXY", "direct.invalid")
    http._env_proxies.cache_clear()
    http._proxy_for.cache_clear()
    try:
        session = hot_session(2)
        try:
            reply = await hot_request(session, "GET", "http://through-proxy.invalid/p",
                                      timeout_s=2, connect_timeout_s=2)
            assert reply.status_code == 200
            assert server.seen[-1]["headers"]["Host"] == "through-proxy.invalid"
            with pytest.raises(TransportFailure) as direct:  # NO_PROXY: resolved, and fails
                await hot_request(session, "GET", "http://direct.invalid/p", timeout_s=2,
                                  connect_timeout_s=2)
            assert direct.value.kind == "connect"
        finally:
            await session.close()
    finally:
        monkeypatch.delenv("HTTP_PROXY")
        monkeypatch.delenv("NO_PROXY")
        http._env_proxies.cache_clear()
        http._proxy_for.cache_clear()


def test_the_shared_session_is_one_per_loop_and_closed_with_its_loop():
    """``shared_client``: one session per loop; ``close_shared_client`` closes it, and a
    loop that ends without that call (a test's, a tool's ``asyncio.run``) closes it at its
    shutdown rather than leaving an open session to the end of the process."""
    from cua_rollout.envs.client import close_shared_client, shared_client

    async def used() -> aiohttp.ClientSession:
        session = shared_client(4)
        assert shared_client(4) is session
        return session

    async def closed() -> aiohttp.ClientSession:
        session = shared_client(4)
        await close_shared_client()
        assert shared_client(4) is not session  # a new one after the close
        return session

    left = asyncio.run(used())
    assert left.closed
    assert asyncio.run(closed()).closed
    assert asyncio.run(used()) is not left and left.closed
