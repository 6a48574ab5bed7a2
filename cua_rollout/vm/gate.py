"""The host side of a VM's forwarded port: an HTTP/1.1 gate that checks the desktop's bearer
token on every request and forwards it upstream without the ``Authorization`` header, so the
guest's server (which has no authentication) is reached only with the token and never sees it.

    gate = TokenGate("0.0.0.0", 0, "127.0.0.1", forwarded_port, token)
    port = await gate.start()          # clients send Authorization: Bearer <token>
    ...
    await gate.close()                 # the listener and every open connection

Requests are parsed on the client side one after another (head, then a Content-Length or a
chunked body, forwarded as it arrives); responses are piped back raw and in order on the one
upstream connection each client connection gets, so keep-alive and pipelining work without
parsing them. A websocket (``Connection: Upgrade``) becomes a raw two-way pipe once its
request has passed. ``token=None`` checks and strips nothing: for ports whose clients cannot
send a token (Chrome DevTools' /json and websocket, VLC's HTTP interface, as OSWorld's
evaluators use them); such a gate must listen only where the run's own hosts reach it.

Some requests the gate answers itself and never forwards: ``answers`` (fixed JSON, e.g. a VM's
host-side ports at ``GET /ports``) and ``handlers`` (a coroutine's status and JSON, e.g. a
launcher's ``POST /vm/reset``), both after the token check; ``public`` handlers before it (a
readiness probe, which carries no token). Each such reply closes its connection.

Standard library only, as all of ``cua_rollout.vm``.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import re
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

__all__ = ["GateStats", "Handler", "TokenGate"]

# A request the gate answers itself: () -> (HTTP status, a JSON value for the body).
Handler = Callable[[], Awaitable[tuple[int, object]]]

_TOKEN = rb"[!#$%&'*+\-.^_`|~0-9A-Za-z]+"  # RFC 9110 token: methods and header names
_REQUEST_LINE = re.compile(rb"(" + _TOKEN + rb") ([^\x00-\x20\x7f]+) HTTP/1\.([01])")
_HEADER_NAME = re.compile(_TOKEN)
_BAD_VALUE = re.compile(rb"[\x00\r\n]")  # a bare CR or LF would let a lenient upstream split
_CHUNK_SIZE = re.compile(rb"[0-9A-Fa-f]{1,16}")
_HEAD_END = b"\r\n\r\n"
_IO_BYTES = 256 * 1024  # one read of a body or of a raw stream, and the upstream's buffer
_REASONS = {200: "OK", 400: "Bad Request", 401: "Unauthorized", 413: "Content Too Large",
            431: "Request Header Fields Too Large", 500: "Internal Server Error",
            502: "Bad Gateway", 503: "Service Unavailable"}


@dataclass(frozen=True)
class GateStats:
    connections: int  # client connections accepted
    requests: int     # requests forwarded upstream
    refused: int      # requests answered 401 (missing or wrong token)


class _Malformed(Exception):
    """A request head this gate will not forward (answered 400)."""


class _Abort(Exception):
    """The client broke the protocol after part of its request went upstream: both sides are
    cut, as no answer can follow a half-forwarded request cleanly."""


@dataclass(frozen=True)
class _Request:
    head: bytes               # as forwarded: request line and headers (token stripped), CRLFCRLF
    credentials: list[bytes]  # the values of every Authorization header
    content_length: int
    chunked: bool
    upgrade: bool


def _parse_head(head: bytes, *, strip_authorization: bool) -> _Request:
    """One request head (without its final blank line); raises ``_Malformed``."""
    lines = head.split(b"\r\n")
    match = _REQUEST_LINE.fullmatch(lines[0])
    if match is None:
        raise _Malformed("malformed request line")
    kept = [lines[0]]
    credentials: list[bytes] = []
    lengths: list[bytes] = []
    codings: list[bytes] = []
    connection: list[bytes] = []
    upgrade = False
    for line in lines[1:]:
        name, colon, value = line.partition(b":")
        # A name with spaces around it or a folded line (leading whitespace) is refused, not
        # guessed at: RFC 9112 5.1 and 5.2.
        if not colon or _HEADER_NAME.fullmatch(name) is None or _BAD_VALUE.search(value):
            raise _Malformed("malformed header line")
        key, value = name.lower(), value.strip(b" \t")
        if key == b"authorization":
            credentials.append(value)
            if strip_authorization:
                continue
        elif key == b"content-length":
            lengths.append(value)
        elif key == b"transfer-encoding":
            codings += [c.strip(b" \t").lower() for c in value.split(b",")]
        elif key == b"connection":
            connection += [c.strip(b" \t").lower() for c in value.split(b",")]
        elif key == b"upgrade":
            upgrade = True
        kept.append(line)
    chunked, length = False, 0
    if codings:
        # Both framings at once is the classic smuggling vector: refused (RFC 9112 6.1).
        if lengths or match.group(3) == b"0" or codings[-1] != b"chunked":
            raise _Malformed("unsupported Transfer-Encoding")
        chunked = True
    elif lengths:
        if len(set(lengths)) != 1 or not lengths[0].isdigit():
            raise _Malformed("invalid Content-Length")
        length = int(lengths[0])
    return _Request(head=b"\r\n".join(kept) + _HEAD_END, credentials=credentials,
                    content_length=length, chunked=chunked,
                    upgrade=upgrade and b"upgrade" in connection)


class TokenGate:
    """Listens on ``listen_host:listen_port`` (an address; port 0: a free one, which
    ``start()`` returns) and forwards to ``upstream_host:upstream_port`` every request that
    carries ``Authorization: Bearer <token>``, without that header. A missing or wrong token
    gets 401, a malformed request 400, a head over ``max_head_bytes`` 431, an unreachable
    upstream 502 (JSON bodies ``{"error": ...}``); each then closes its connection.

    No deadline applies while a connection waits for its client's next request or for the
    upstream's reply: responses are not parsed, so a slow reply is not told from an idle
    connection; the client's own timeouts and ``close()`` end those.
    """

    def __init__(self, listen_host: str, listen_port: int, upstream_host: str,
                 upstream_port: int, token: str | None, *,
                 max_head_bytes: int = 64 * 1024,   # a request line and headers, at most
                 connect_timeout_s: float = 5.0,    # to open the upstream connection
                 stall_timeout_s: float = 300.0,    # a body or reply in flight without progress
                 linger_s: float = 2.0,             # around an error reply (see _refuse)
                 answers: dict[str, object] | None = None,
                 handlers: dict[str, Handler] | None = None,
                 public: dict[str, Handler] | None = None) -> None:
        if token == "":
            raise ValueError("token must be a non-empty string, or None for no check")
        self.listen_host = listen_host
        self.listen_port = listen_port
        self.upstream_host = upstream_host
        self.upstream_port = upstream_port
        self.max_head_bytes = max_head_bytes
        self.connect_timeout_s = connect_timeout_s
        self.stall_timeout_s = stall_timeout_s
        self.linger_s = linger_s
        self.port: int | None = None
        # "GET /path" -> a JSON value the gate answers itself (after the token check), e.g.
        # a VM's host-side ports at /ports; the connection then closes.
        self.answers = {k.encode(): json.dumps(v).encode() for k, v in (answers or {}).items()}
        # "POST /path" -> a coroutine giving (status, JSON value): after the token check
        # (``handlers``) or before it (``public``: for callers that cannot send the token).
        self.handlers = {k.encode(): v for k, v in (handlers or {}).items()}
        self.public = {k.encode(): v for k, v in (public or {}).items()}
        self._token = token.encode() if token is not None else None
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._closing = False
        self._connections = self._requests = self._refused = 0

    async def start(self) -> int:
        """Start listening; returns the bound port."""
        if self._server is not None:
            raise RuntimeError("TokenGate already started")
        self._closing = False
        self._server = await asyncio.start_server(
            self._accept, self.listen_host, self.listen_port, limit=self.max_head_bytes)
        self.port = self._server.sockets[0].getsockname()[1]
        return self.port

    async def close(self) -> None:
        """Stop listening and cut every open connection (its upstream side too)."""
        self._closing = True
        server, self._server = self._server, None
        if server is not None:
            server.close()
        while self._tasks:
            tasks = list(self._tasks)
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        if server is not None:
            await server.wait_closed()

    def stats(self) -> GateStats:
        return GateStats(self._connections, self._requests, self._refused)

    def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        # A plain callback (called from connection_made), so every connection has its task
        # in _tasks before close() can look, and its socket is closed even if the task is
        # cancelled before it first runs.
        if self._closing:
            writer.transport.abort()
            return
        self._connections += 1
        task = asyncio.get_running_loop().create_task(_Connection(self, reader, writer).serve())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        task.add_done_callback(
            lambda _: None if writer.transport.is_closing() else writer.transport.abort())

    def _authorized(self, credentials: list[bytes]) -> bool:
        if self._token is None:
            return True
        if len(credentials) != 1:
            return False
        scheme, _, secret = credentials[0].partition(b" ")
        return scheme.lower() == b"bearer" and hmac.compare_digest(secret.strip(b" "),
                                                                   self._token)


class _Connection:
    """One client connection and the upstream connection it opens on its first good request.
    The task of ``serve`` reads requests; a second task (the pump) copies the upstream's bytes
    back to the client."""

    def __init__(self, gate: TokenGate, reader: asyncio.StreamReader,
                 writer: asyncio.StreamWriter) -> None:
        self.gate = gate
        self.client_reader = reader
        self.client_writer = writer
        self.upstream_reader: asyncio.StreamReader | None = None
        self.upstream_writer: asyncio.StreamWriter | None = None
        self.pump: asyncio.Task[None] | None = None
        self.raw = False      # upgraded: bytes flow both ways unparsed
        self.ending = False   # the client side is done: the pump delivers what is owed, no more

    async def serve(self) -> None:
        graceful = False
        try:
            await self._serve_requests()
            graceful = True
        except (_Abort, OSError):  # OSError: resets, and TimeoutError of a stalled transfer
            pass
        finally:
            try:
                if graceful:
                    await self._close_gracefully()
            finally:
                await self._cut()

    # ----------------------------------------------------------------- client -> upstream

    async def _serve_requests(self) -> None:
        gate = self.gate
        while True:
            try:
                head = await self.client_reader.readuntil(_HEAD_END)
            except asyncio.IncompleteReadError as exc:
                if exc.partial.strip(b"\r\n"):
                    raise _Abort from exc  # cut in the middle of a head
                break
            except asyncio.LimitOverrunError:
                await self._refuse(431, f"request head over {gate.max_head_bytes} bytes")
                return
            # RFC 9112 2.2: empty lines before a request line are ignored.
            head = head[:-len(_HEAD_END)].lstrip(b"\r\n")
            if not head:
                continue
            try:
                request = _parse_head(head, strip_authorization=gate._token is not None)
            except _Malformed as exc:
                await self._refuse(400, str(exc))
                return
            route = b" ".join(head.split(b" ", 2)[:2])  # b"GET /path"
            if (handler := gate.public.get(route)) is not None:
                await self._handle(request, handler)
                return
            if not gate._authorized(request.credentials):
                gate._refused += 1
                await self._refuse(401, "missing or wrong bearer token", authenticate=True)
                return
            answer = gate.answers.get(route)
            if answer is not None and not request.content_length and not request.chunked:
                await self._reply(200, answer)
                return
            if (handler := gate.handlers.get(route)) is not None:
                await self._handle(request, handler)
                return
            if self.upstream_writer is None:
                try:
                    await self._connect()
                except OSError as exc:
                    await self._refuse(502, f"upstream {gate.upstream_host}:"
                                            f"{gate.upstream_port} unreachable: {exc}")
                    return
            upstream = self.upstream_writer
            assert upstream is not None
            upstream.write(request.head)
            gate._requests += 1
            if request.chunked:
                await self._forward_chunked()
            else:
                await self._forward_bytes(request.content_length)
            await self._drain(upstream)
            if request.upgrade:
                self.raw = True
                await self._forward_raw()
                break
        await self._finish_upstream(self.gate.stall_timeout_s)

    async def _handle(self, request: _Request, handler: Handler) -> None:
        """Answer a request with what ``handler`` returns; its body (none is expected) is read
        and dropped. The replies owed on this connection go out first, and the upstream is no
        longer listened to, so a handler that restarts it (a VM's reset) does not cut this
        connection."""
        if request.chunked or request.content_length > self.gate.max_head_bytes:
            await self._refuse(413, "this path takes no request body")
            return
        with contextlib.suppress(asyncio.IncompleteReadError):
            async with asyncio.timeout(self.gate.stall_timeout_s):
                await self.client_reader.readexactly(request.content_length)
        if not await self._finish_upstream(self.gate.linger_s):
            raise _Abort
        try:
            status, value = await handler()
        except Exception as exc:  # a handler's bug is the client's 500, not a dead gate
            status, value = 500, {"error": f"{type(exc).__name__}: {exc}"}
        await self._reply(status, json.dumps(value).encode())

    async def _connect(self) -> None:
        gate = self.gate
        async with asyncio.timeout(gate.connect_timeout_s):
            self.upstream_reader, self.upstream_writer = await asyncio.open_connection(
                gate.upstream_host, gate.upstream_port, limit=_IO_BYTES)
        self.pump = asyncio.get_running_loop().create_task(self._pump())

    async def _forward_bytes(self, count: int) -> None:
        upstream = self.upstream_writer
        assert upstream is not None
        while count > 0:
            async with asyncio.timeout(self.gate.stall_timeout_s):
                data = await self.client_reader.read(min(count, _IO_BYTES))
            if not data:
                raise _Abort  # the client closed in the middle of a body
            upstream.write(data)
            count -= len(data)
            await self._drain(upstream)

    async def _forward_chunked(self) -> None:
        """Copy one chunked body as it comes, chunk by chunk, checking its framing."""
        upstream = self.upstream_writer
        assert upstream is not None
        while True:
            line = await self._read_line()
            size = line[:-2].split(b";", 1)[0].strip(b" \t")
            if _CHUNK_SIZE.fullmatch(size) is None or _BAD_VALUE.search(line[:-2]):
                raise _Abort
            upstream.write(line)
            if int(size, 16) == 0:
                break
            await self._forward_bytes(int(size, 16))
            async with asyncio.timeout(self.gate.stall_timeout_s):
                end = await self.client_reader.readexactly(2)
            if end != b"\r\n":
                raise _Abort
            upstream.write(end)
        while True:  # trailer fields up to the blank line
            line = await self._read_line()
            name, colon, value = line[:-2].partition(b":")
            if line != b"\r\n" and (not colon or _HEADER_NAME.fullmatch(name) is None
                                    or _BAD_VALUE.search(value)):
                raise _Abort
            upstream.write(line)
            if line == b"\r\n":
                return

    async def _read_line(self) -> bytes:
        try:
            async with asyncio.timeout(self.gate.stall_timeout_s):
                return await self.client_reader.readuntil(b"\r\n")
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError) as exc:
            raise _Abort from exc

    async def _forward_raw(self) -> None:
        upstream = self.upstream_writer
        assert upstream is not None
        while True:
            # No deadline: an upgraded stream (a DevTools websocket) idles as long as it likes.
            data = await self.client_reader.read(_IO_BYTES)
            if not data:
                return
            upstream.write(data)
            await self._drain(upstream)

    async def _drain(self, writer: asyncio.StreamWriter) -> None:
        async with asyncio.timeout(self.gate.stall_timeout_s):
            await writer.drain()

    # ----------------------------------------------------------------- upstream -> client

    async def _pump(self) -> None:
        upstream, client = self.upstream_reader, self.client_writer
        assert upstream is not None
        try:
            while data := await upstream.read(_IO_BYTES):
                client.write(data)
                await self._drain(client)
        except OSError:
            pass
        if self.ending:
            return  # the serving task closes both sides
        if self.raw:
            with contextlib.suppress(OSError):
                client.write_eof()  # a tunnel passes on a half-close
            return
        # The upstream closed (after a reply or in the middle of one): so does the client's
        # connection, after what was received; the serving task then sees its end.
        client.close()

    # ----------------------------------------------------------------- endings

    async def _finish_upstream(self, wait_s: float) -> bool:
        """No more requests: pass the half-close on, so the upstream answers what it was
        asked and closes, and wait up to ``wait_s`` for those answers to reach the client.
        False if they did not all arrive in time."""
        self.ending = True
        if self.upstream_writer is None or self.pump is None:
            return True
        with contextlib.suppress(OSError):
            if self.upstream_writer.can_write_eof():
                self.upstream_writer.write_eof()
        done, _ = await asyncio.wait({self.pump}, timeout=wait_s)
        return bool(done)

    async def _refuse(self, status: int, message: str, *, authenticate: bool = False) -> None:
        """Answer ``status`` with ``{"error": message}`` (see ``_reply``)."""
        await self._reply(status, json.dumps({"error": message}).encode(),
                          authenticate=authenticate)

    async def _reply(self, status: int, body: bytes, *, authenticate: bool = False) -> None:
        """Answer ``status`` with the JSON ``body`` after the replies owed on this connection,
        then close it. An upstream still replying after ``linger_s`` is cut with the client: a
        reply cannot be appended to one unfinished."""
        if not await self._finish_upstream(self.gate.linger_s):
            raise _Abort
        client = self.client_writer
        if client.is_closing():
            return
        reason = _REASONS.get(status, "Status")
        head = (f"HTTP/1.1 {status} {reason}\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(body)}\r\nConnection: close\r\n"
                + ("WWW-Authenticate: Bearer\r\n" if authenticate else "") + "\r\n")
        client.write(head.encode() + body)
        with contextlib.suppress(OSError):
            client.write_eof()
        await self._drain(client)
        # Closing with unread input makes the kernel send a reset, which can destroy the
        # reply before the client reads it: read (and drop) what it still sends, briefly.
        with contextlib.suppress(OSError):
            async with asyncio.timeout(self.gate.linger_s):
                while await self.client_reader.read(_IO_BYTES):
                    pass

    async def _close_gracefully(self) -> None:
        writers = [w for w in (self.upstream_writer, self.client_writer) if w is not None]
        for writer in writers:
            writer.close()
        with contextlib.suppress(OSError):
            async with asyncio.timeout(self.gate.stall_timeout_s):
                for writer in writers:
                    await writer.wait_closed()

    async def _cut(self) -> None:
        """Abort whatever is still open; a no-op after a graceful close. Runs on cancellation
        too, so it waits only for what abort() guarantees to finish at once."""
        if self.pump is not None and not self.pump.done():
            self.pump.cancel()
            await asyncio.wait({self.pump})
        for writer in (self.upstream_writer, self.client_writer):
            if writer is not None:
                writer.transport.abort()
                with contextlib.suppress(OSError):
                    await writer.wait_closed()
