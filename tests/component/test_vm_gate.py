"""Component: the VM's host-side token gate (``cua_rollout.vm.gate``) on real loopback
sockets, in front of a real uvicorn server that records what reached it. A good token passes
and is stripped; a missing or wrong one is refused on every request of a keep-alive
connection; bodies (Content-Length and chunked) and a large reply pass intact; a websocket
works after its upgrade; an unreachable upstream is a 502, an oversized head a 431; close()
ends open connections and leaves no socket behind.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import socket
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any

import httpx2
import psutil
import pytest
from websockets.asyncio.client import connect as ws_connect
from websockets.exceptions import InvalidStatus

from cua_rollout.core.http import ThreadedServer
from cua_rollout.vm.gate import TokenGate

TOKEN = "s3cret-token"
GOOD = {"Authorization": f"Bearer {TOKEN}"}
BIG_BYTES = bytes(range(256)) * (8 * 1024)      # 2 MiB reply
UPLOAD_BYTES = bytes(range(251)) * 1200         # ~300 KB request body


# --------------------------------------------------------------------------- the upstream


class Upstream:
    """An ASGI app standing in for the guest's server: records every request's headers and
    body digest; ``/big`` replies 2 MiB, anything else JSON with what it received;
    ``/ws`` is a websocket that echoes each message upper-cased."""

    def __init__(self) -> None:
        self.seen: list[dict[str, Any]] = []

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        headers = {k.decode().lower(): v.decode() for k, v in scope["headers"]}
        if scope["type"] == "websocket":
            self.seen.append({"path": scope["path"], "headers": headers})
            await receive()  # websocket.connect
            await send({"type": "websocket.accept"})
            while (message := await receive())["type"] == "websocket.receive":
                await send({"type": "websocket.send", "text": message["text"].upper()})
            return
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        self.seen.append({"path": scope["path"], "headers": headers})
        if scope["path"] == "/big":
            payload, kind = BIG_BYTES, b"application/octet-stream"
        else:
            payload = json.dumps({"path": scope["path"], "length": len(body),
                                  "sha256": hashlib.sha256(body).hexdigest(),
                                  "headers": headers}).encode()
            kind = b"application/json"
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", kind),
                                (b"content-length", str(len(payload)).encode())]})
        await send({"type": "http.response.body", "body": payload})


@pytest.fixture(scope="module")
def server() -> Iterator[tuple[ThreadedServer, Upstream]]:
    app = Upstream()
    with ThreadedServer(app) as srv:
        yield srv, app


@pytest.fixture
def upstream(server: tuple[ThreadedServer, Upstream]) -> Iterator[Upstream]:
    server[1].seen.clear()
    yield server[1]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _sockets_of(port: int) -> list[Any]:
    """This process's sockets on ``port`` at either end (a listener, accepted or outgoing)."""
    return [c for c in psutil.Process().net_connections(kind="tcp")
            if (c.laddr and c.laddr.port == port) or (c.raddr and c.raddr.port == port)]


MakeGate = Callable[..., Awaitable[TokenGate]]


@pytest.fixture
async def make_gate(server: tuple[ThreadedServer, Upstream]) -> AsyncIterator[MakeGate]:
    """Starts gates (in front of the upstream unless told otherwise); closes them after the
    test and checks that none left a socket: not its listener, not a client's or an upstream
    connection."""
    gates: list[TokenGate] = []

    async def make(token: str | None = TOKEN, upstream_port: int | None = None,
                   **kw: Any) -> TokenGate:
        gate = TokenGate("127.0.0.1", 0, "127.0.0.1", upstream_port or server[0].port, token,
                         **kw)
        gates.append(gate)
        await gate.start()
        return gate

    yield make
    for gate in gates:
        await gate.close()
        assert gate.port is not None
        assert _sockets_of(gate.port) == []
    # The gate's own upstream connections: outgoing, to the upstream's port (the upstream's
    # accepted ends have that port as laddr and close in their own time).
    assert [c for c in psutil.Process().net_connections(kind="tcp")
            if c.raddr and c.raddr.port == server[0].port] == []


def _client(gate: TokenGate) -> httpx2.AsyncClient:
    return httpx2.AsyncClient(base_url=f"http://127.0.0.1:{gate.port}", trust_env=False)


# --------------------------------------------------------------------------- the token


async def test_a_good_token_passes_and_the_upstream_never_sees_it(make_gate, upstream):
    gate = await make_gate()
    async with _client(gate) as client:
        reply = await client.get("/state", headers=GOOD)
    assert reply.status_code == 200
    assert "authorization" not in reply.json()["headers"]
    assert [r["path"] for r in upstream.seen] == ["/state"]
    assert gate.stats().requests == 1 and gate.stats().refused == 0


@pytest.mark.parametrize("headers", [
    {}, {"Authorization": "Bearer wrong"}, {"Authorization": f"Basic {TOKEN}"},
    {"Authorization": f"Bearer {TOKEN}x"},
], ids=["missing", "wrong", "other-scheme", "longer"])
async def test_a_missing_or_wrong_token_is_refused_before_the_upstream(make_gate, upstream,
                                                                     headers):
    gate = await make_gate()
    async with _client(gate) as client:
        reply = await client.post("/execute", headers=headers, json={"command": "id"})
    assert reply.status_code == 401
    assert reply.headers["www-authenticate"] == "Bearer"
    assert reply.headers["connection"] == "close"
    assert "error" in reply.json()
    assert upstream.seen == []
    assert gate.stats().refused == 1 and gate.stats().requests == 0


async def test_every_request_of_a_keep_alive_connection_is_checked(make_gate, upstream):
    gate = await make_gate()
    async with _client(gate) as client:
        first = await client.get("/one", headers=GOOD)
        second = await client.get("/two")
    assert (first.status_code, second.status_code) == (200, 401)
    assert gate.stats().connections == 1  # both went over one connection
    assert [r["path"] for r in upstream.seen] == ["/one"]


async def test_pipelined_requests_are_answered_in_order(make_gate, upstream):
    gate = await make_gate()
    reader, writer = await asyncio.open_connection("127.0.0.1", gate.port)
    request = "GET /{} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + TOKEN + "\r\n{}\r\n"
    writer.write((request.format("a", "") + request.format("b", "")
                  + request.format("c", "Connection: close\r\n")).encode())
    await writer.drain()
    received = await reader.read()  # to the end: the upstream closes after /c, so does the gate
    writer.close()
    await writer.wait_closed()
    assert received.count(b"HTTP/1.1 200 OK\r\n") == 3
    assert [received.index(f'"path": "/{p}"'.encode()) for p in "abc"] == sorted(
        received.index(f'"path": "/{p}"'.encode()) for p in "abc")
    assert [r["path"] for r in upstream.seen] == ["/a", "/b", "/c"]


async def test_a_bad_request_in_a_pipeline_is_refused_last_and_never_forwarded(make_gate,
                                                                             upstream):
    gate = await make_gate()
    reader, writer = await asyncio.open_connection("127.0.0.1", gate.port)
    good = f"GET /{{}} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {TOKEN}\r\n\r\n"
    writer.write((good.format("a") + "GET /b HTTP/1.1\r\nHost: x\r\n\r\n"
                  + good.format("c")).encode())
    writer.write_eof()
    received = await reader.read()
    writer.close()
    await writer.wait_closed()
    # The 401 comes after whatever the upstream answered before it (how much of a pipeline
    # an upstream answers once told that no more requests come is its own business).
    assert received.endswith(b'\r\n\r\n{"error": "missing or wrong bearer token"}')
    assert b"HTTP/1.1 401 " in received
    assert {r["path"] for r in upstream.seen} <= {"/a"}


async def test_no_token_configured_checks_and_strips_nothing(make_gate, upstream):
    gate = await make_gate(token=None)
    async with _client(gate) as client:
        bare = await client.get("/json")
        carried = await client.get("/json", headers={"Authorization": "Bearer anything"})
    assert (bare.status_code, carried.status_code) == (200, 200)
    assert carried.json()["headers"]["authorization"] == "Bearer anything"


# --------------------------------------------------------------------------- bodies


async def test_request_bodies_arrive_intact_by_length_and_chunked(make_gate, upstream):
    gate = await make_gate()

    async def chunks() -> AsyncIterator[bytes]:
        for start in range(0, len(UPLOAD_BYTES), 7000):  # chunks that do not align with reads
            yield UPLOAD_BYTES[start:start + 7000]

    digest = hashlib.sha256(UPLOAD_BYTES).hexdigest()
    async with _client(gate) as client:
        by_length = await client.post("/upload", headers=GOOD, content=UPLOAD_BYTES)
        chunked = await client.post("/upload", headers=GOOD, content=chunks())
        after = await client.get("/after", headers=GOOD)  # the framing held: one more request
    assert by_length.json()["length"] == len(UPLOAD_BYTES)
    assert by_length.json()["sha256"] == digest
    assert chunked.json()["headers"]["transfer-encoding"] == "chunked"
    assert chunked.json()["length"] == len(UPLOAD_BYTES)
    assert chunked.json()["sha256"] == digest
    assert after.status_code == 200
    assert gate.stats().connections == 1


async def test_a_large_reply_streams_back_intact(make_gate, upstream):
    gate = await make_gate()
    async with _client(gate) as client, client.stream("GET", "/big", headers=GOOD) as reply:
        body = b"".join([part async for part in reply.aiter_raw()])
    assert body == BIG_BYTES


async def test_an_upstream_closing_mid_reply_closes_the_client(make_gate):
    async def half_reply(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 1000\r\n\r\nonly part")
        await writer.drain()
        writer.close()
        await writer.wait_closed()

    broken = await asyncio.start_server(half_reply, "127.0.0.1", 0)
    try:
        gate = await make_gate(upstream_port=broken.sockets[0].getsockname()[1])
        async with _client(gate) as client:
            with pytest.raises(httpx2.RemoteProtocolError):
                await client.get("/x", headers=GOOD)
    finally:
        broken.close()
        await broken.wait_closed()


async def test_a_client_that_half_closes_after_its_request_gets_the_reply(make_gate,
                                                                          upstream):
    gate = await make_gate()
    reader, writer = await asyncio.open_connection("127.0.0.1", gate.port)
    writer.write(f"GET /last HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {TOKEN}\r\n\r\n"
                 .encode())
    writer.write_eof()
    received = await reader.read()
    writer.close()
    await writer.wait_closed()
    assert received.startswith(b"HTTP/1.1 200 OK\r\n")
    assert received.endswith(b"}")  # the whole JSON body
    assert json.loads(received.partition(b"\r\n\r\n")[2])["path"] == "/last"


@pytest.mark.parametrize("body", [
    b"5\r\nhello\r\n3\r\nabc",       # the client stops in the middle
    b"5\r\nhelloXX",                    # no CRLF after the data
    b"zz\r\nhello\r\n0\r\n\r\n",        # not a size
    b"5\r\nhello\r\n0\r\nX: a\nY: b\r\n\r\n",  # a bare LF in a trailer
], ids=["cut", "no-crlf", "bad-size", "bare-lf-trailer"])
async def test_a_broken_chunked_body_cuts_the_connection(make_gate, upstream, body):
    gate = await make_gate()
    reader, writer = await asyncio.open_connection("127.0.0.1", gate.port)
    writer.write(f"POST /up HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {TOKEN}\r\n"
                 "Transfer-Encoding: chunked\r\n\r\n".encode() + body)
    writer.write_eof()
    try:
        received = await reader.read()
    except ConnectionResetError:
        received = b""
    writer.close()
    with contextlib.suppress(ConnectionResetError):
        await writer.wait_closed()
    assert received == b""  # no reply can follow a half-forwarded request


# --------------------------------------------------------------------------- websocket


async def test_a_websocket_flows_both_ways_after_its_upgrade(make_gate, upstream):
    gate = await make_gate()
    url = f"ws://127.0.0.1:{gate.port}/ws"
    async with ws_connect(url, additional_headers=GOOD, proxy=None) as ws:
        for text in ["hello", "x" * 100_000]:
            await ws.send(text)
            assert await ws.recv() == text.upper()
    assert upstream.seen[0]["path"] == "/ws"
    assert "authorization" not in upstream.seen[0]["headers"]

    with pytest.raises(InvalidStatus) as refused:
        async with ws_connect(url, proxy=None):
            pass
    assert refused.value.response.status_code == 401
    assert len(upstream.seen) == 1


# --------------------------------------------------------------------------- errors


async def test_an_unreachable_upstream_is_a_502(make_gate):
    gate = await make_gate(upstream_port=_free_port())
    async with _client(gate) as client:
        reply = await client.get("/", headers=GOOD)
    assert reply.status_code == 502
    assert "unreachable" in reply.json()["error"]


async def test_an_oversized_head_is_a_431(make_gate, upstream):
    gate = await make_gate(max_head_bytes=16 * 1024)
    async with _client(gate) as client:
        reply = await client.get("/", headers={**GOOD, "X-Filler": "a" * 100_000})
    assert reply.status_code == 431
    assert upstream.seen == []


@pytest.mark.parametrize("request_bytes", [
    b"GET / HTTP/1.1\r\nHost: x\r\n folded: line\r\n\r\n",
    b"GET / HTTP/1.1\r\nHost : x\r\n\r\n",
    b"GET / HTTP/2.0\r\nHost: x\r\n\r\n",
    b"POST / HTTP/1.1\r\nContent-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n",
    b"POST / HTTP/1.1\r\nContent-Length: 5\r\nContent-Length: 6\r\n\r\n",
    b"POST / HTTP/1.1\r\nX: a\nContent-Length: 5\r\n\r\n",
], ids=["folded", "space-before-colon", "version", "both-framings", "two-lengths", "bare-lf"])
async def test_a_malformed_head_is_a_400_and_never_forwarded(make_gate, upstream,
                                                             request_bytes):
    gate = await make_gate()
    head = request_bytes.replace(b"\r\n\r\n", f"\r\nAuthorization: Bearer {TOKEN}\r\n\r\n"
                                 .encode(), 1)
    reader, writer = await asyncio.open_connection("127.0.0.1", gate.port)
    writer.write(head)
    writer.write_eof()
    received = await reader.read()
    writer.close()
    await writer.wait_closed()
    assert received.startswith(b"HTTP/1.1 400 ")
    assert upstream.seen == []


# --------------------------------------------------------------------------- close()


async def test_close_ends_open_connections_and_releases_the_port(make_gate, upstream):
    gate = await make_gate()
    port = gate.port
    idle_reader, idle_writer = await asyncio.open_connection("127.0.0.1", port)
    async with _client(gate) as client, ws_connect(f"ws://127.0.0.1:{port}/ws",
                                                   additional_headers=GOOD, proxy=None) as ws:
        assert (await client.get("/kept", headers=GOOD)).status_code == 200  # kept alive
        await ws.send("ping")
        assert await ws.recv() == "PING"
        assert gate.stats().connections == 3

        await gate.close()

        assert await idle_reader.read() == b""
        with pytest.raises(httpx2.TransportError):  # the kept connection is gone: no retry
            await client.get("/after", headers=GOOD)
        await ws.wait_closed()
    idle_writer.close()
    await idle_writer.wait_closed()
    with pytest.raises(OSError):
        await asyncio.open_connection("127.0.0.1", port)
    assert _sockets_of(port) == []


async def test_the_gate_answers_its_own_paths_after_the_token_check(make_gate, upstream):
    """A VM's host-side ports are the gate's to tell (``GET /ports``): the guest knows only
    its own. Other paths still reach the upstream; the answer needs the token too."""
    gate = await make_gate(answers={"GET /ports": {"chromium": 41001, "vlc": 41002}})
    async with _client(gate) as client:
        ports = await client.get("/ports", headers=GOOD)
        refused = await client.get("/ports")
        other = await client.get("/state", headers=GOOD)
    assert ports.status_code == 200 and ports.json() == {"chromium": 41001, "vlc": 41002}
    assert refused.status_code == 401
    assert other.status_code == 200
    assert [r["path"] for r in upstream.seen] == ["/state"]


async def test_handlers_answer_after_the_token_check_and_public_ones_before_it(make_gate,
                                                                               upstream):
    """A launcher's own paths: ``POST /vm/reset`` (a handler: the token is checked first) and
    ``GET /vm/ready`` (public: a readiness probe carries no token). Neither reaches the
    upstream; a body is read and dropped, a chunked one refused; a handler that raises is a
    500 naming the error, and the gate goes on serving."""
    calls: list[str] = []

    async def reset() -> tuple[int, object]:
        calls.append("reset")
        return 200, {"reset": True}

    async def ready() -> tuple[int, object]:
        calls.append("ready")
        return 503, {"ready": False, "error": "QEMU is not running"}

    async def broken() -> tuple[int, object]:
        raise RuntimeError("no VM")

    async def chunks() -> AsyncIterator[bytes]:
        yield b"a"
        yield b"b"

    gate = await make_gate(handlers={"POST /vm/reset": reset, "POST /vm/broken": broken},
                           public={"GET /vm/ready": ready})
    async with _client(gate) as client:
        refused = await client.post("/vm/reset")
        done = await client.post("/vm/reset", headers=GOOD, json={"ignored": True})
        probe = await client.get("/vm/ready")
        chunked = await client.post("/vm/reset", headers=GOOD, content=chunks())
        failed = await client.post("/vm/broken", headers=GOOD)
        other = await client.get("/state", headers=GOOD)
    assert refused.status_code == 401
    assert done.status_code == 200 and done.json() == {"reset": True}
    assert done.headers["connection"] == "close"
    assert probe.status_code == 503 and probe.json()["error"] == "QEMU is not running"
    assert chunked.status_code == 413
    assert failed.status_code == 500 and failed.json() == {"error": "RuntimeError: no VM"}
    assert other.status_code == 200
    assert calls == ["reset", "ready"]
    assert [r["path"] for r in upstream.seen] == ["/state"]
    assert gate.stats().refused == 1


async def test_a_handler_that_restarts_the_upstream_keeps_its_clients_connection(make_gate,
                                                                                 upstream):
    """A keep-alive connection that already reached the upstream asks for a reset: the reply
    owed comes first, then the handler runs (closing the upstream meanwhile, as a VM's
    restore does) and its answer still reaches the client."""
    reply_first: list[int] = []

    async def reset() -> tuple[int, object]:
        await asyncio.sleep(0.2)
        return 200, {"reset": True}

    gate = await make_gate(handlers={"POST /vm/reset": reset})
    async with _client(gate) as client:
        reply_first.append((await client.get("/state", headers=GOOD)).status_code)
        done = await client.post("/vm/reset", headers=GOOD)
    assert reply_first == [200]
    assert done.status_code == 200 and done.json() == {"reset": True}
