"""A loopback HTTP/1.1 proxy in front of one server, for the chaos run: it keeps a server's URL
while the process behind it is killed and started again, and it can freeze a desktop in the
middle of an ``/execute``.

    gate = FaultProxy(upstream_port).start()     # http://127.0.0.1:<gate.port> forwards
    gate.down()          # the server died: every open connection is cut, new ones refused
    gate.up(new_port)    # a new server is behind the same URL again
    gate.freeze_on_execute()   # the next action /execute on some /d/<i>/ and everything
    gate.thaw()                # after it on that desktop hang until thaw()
    gate.slow(10)        # every answer takes 10x as long as the server took (slow(1): normal)

It serves exactly what ``benchmarks/sim_world.py`` serves (Content-Length bodies, no
chunked transfer, no pipelining), from an event loop in a thread of the calling process.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Coroutine
from typing import Any

__all__ = ["FaultProxy"]

_HEAD_END = b"\r\n\r\n"
_RESET_MARK = b"sim-reset"   # benchmarks.sim_world.RESET_COMMAND: a reset is not an action


def _content_length(head: bytes) -> int:
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            return int(value)
        if name.strip().lower() == b"transfer-encoding":
            raise ValueError("chunked bodies are not supported")
    return 0


class FaultProxy:
    """Forwards ``127.0.0.1:<port>`` to ``127.0.0.1:<upstream_port>`` with faults on demand."""

    def __init__(self, upstream_port: int, host: str = "127.0.0.1") -> None:
        self.host = host
        self.upstream_port = upstream_port
        self.port = 0
        self.frozen_prefix: bytes | None = None   # the desktop (b"/d/<i>/") that hangs
        self.frozen_at: float | None = None
        self.held = 0                             # requests held while frozen
        self.forwarded = 0
        self.cut = 0                              # connections cut by down()
        self.slow_factor = 1.0                    # answers held (factor - 1) x server time
        self.slowed = 0                           # answers held by slow()
        self._armed = False
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="chaos-proxy",
                                        daemon=True)
        self._server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()
        self._thawed: asyncio.Event | None = None

    # ----------------------------------------------------------------- control (any thread)

    def start(self) -> FaultProxy:
        self._thread.start()
        self._call(self._init())
        self._call(self._listen())
        return self

    def url(self, path: str = "") -> str:
        return f"http://{self.host}:{self.port}{path}"

    def down(self) -> None:
        """As if the server died: open connections are reset, new ones refused."""
        self._call(self._down())

    def up(self, upstream_port: int | None = None) -> None:
        """Serve again on the same port (in front of ``upstream_port`` if given)."""
        if upstream_port is not None:
            self.upstream_port = upstream_port
        self._call(self._listen())

    def freeze_on_execute(self) -> None:
        """The next ``/execute`` that is not a reset, and every later request to the same
        desktop (``/d/<i>/``), get no answer until ``thaw()``."""
        self._armed = True

    def slow(self, factor: float) -> None:
        """Every answer from now on reaches the client ``factor`` times as late as the
        server gave it (held ``(factor - 1)`` x the server's time); ``slow(1)``: normal."""
        if factor < 1:
            raise ValueError(f"slow factor {factor} < 1")
        self.slow_factor = float(factor)

    def thaw(self) -> None:
        """Answer what was held; the desktop serves normally again."""
        self._armed = False
        self._call(self._thaw())

    def stop(self) -> None:
        if not self._thread.is_alive():
            return
        with contextlib.suppress(Exception):
            self._call(self._down())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        if not self._thread.is_alive():
            self._loop.close()

    # ----------------------------------------------------------------- the loop

    def _call(self, coro: Coroutine[Any, Any, Any]) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout=30)

    async def _init(self) -> None:
        self._thawed = asyncio.Event()
        self._thawed.set()

    async def _listen(self) -> None:
        if self._server is not None:
            return
        self._server = await asyncio.start_server(self._client, self.host, self.port,
                                                  reuse_address=True)
        self.port = self._server.sockets[0].getsockname()[1]

    async def _down(self) -> None:
        if self._server is not None:
            self._server.close()
            self._server = None
        for writer in list(self._writers):
            self.cut += 1
            writer.transport.abort()
        self._writers.clear()

    async def _thaw(self) -> None:
        assert self._thawed is not None
        self.frozen_prefix = None
        self._thawed.set()

    async def _hold(self, path: bytes, body: bytes) -> None:
        assert self._thawed is not None
        if (self._armed and self.frozen_prefix is None and path.endswith(b"/execute")
                and _RESET_MARK not in body):
            self._armed = False
            self.frozen_prefix = path[: -len(b"execute")]
            self.frozen_at = time.time()
            self._thawed.clear()
        if self.frozen_prefix is not None and path.startswith(self.frozen_prefix):
            self.held += 1
            await self._thawed.wait()

    async def _client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
                      ) -> None:
        self._writers.add(writer)
        up: tuple[asyncio.StreamReader, asyncio.StreamWriter] | None = None
        try:
            while True:
                head = await reader.readuntil(_HEAD_END)
                body = await reader.readexactly(_content_length(head))
                path = head.split(b" ", 2)[1].split(b"?", 1)[0]
                await self._hold(path, body)
                if up is None:
                    up = await asyncio.open_connection(self.host, self.upstream_port)
                    self._writers.add(up[1])
                sent = time.monotonic()
                up[1].write(head + body)
                await up[1].drain()
                reply_head = await up[0].readuntil(_HEAD_END)
                reply = await up[0].readexactly(_content_length(reply_head))
                if self.slow_factor > 1:
                    self.slowed += 1
                    await asyncio.sleep((self.slow_factor - 1) * (time.monotonic() - sent))
                writer.write(reply_head + reply)
                await writer.drain()
                self.forwarded += 1
                if b"connection: close" in reply_head.lower():
                    break
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError,
                OSError, ValueError):
            pass  # either side went away: so does the other
        finally:
            for w in (writer, *(up[1:] if up else ())):
                self._writers.discard(w)
                w.transport.abort()
