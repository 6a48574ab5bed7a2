"""The client side of a step's three hot requests, by HTTP client: CPU per request.

    python benchmarks/bench_http_clients.py [--requests 400] [--concurrency 32] [--json]

A rollout step makes three requests: the chat completion to the model (a ~2.3 MB JSON body:
five base64 screenshots of 1920x1080 in the history window, sent as pieces, a ~1 KB reply),
the action to the desktop (``POST /execute``, ~200 B each way) and the next screenshot
(``GET /screenshot``, a ~330 KB PNG back). This measures what each costs the process that
sends it (user + system CPU of this process, ``time.process_time``), for:

  httpx2    what the runners use (``httpx2.AsyncClient``, one pool per endpoint as
            ``ModelServicePool`` and ``lease_client`` build them; the body sent as pieces,
            as ``RequestBody`` does);
  aiohttp   ``aiohttp.ClientSession``, the same requests, the body streamed from the same
            pieces with its Content-Length (the server refuses a chunked body here: that is
            what aiohttp sends for an async iterator without one), as
            ``cua_rollout.core.http.hot_request`` sends it;
  raw       a minimal HTTP/1.1 client on asyncio streams written here (keep-alive, one
            connection per in-flight request, Content-Length only): the floor of what any
            client can cost in Python, not a candidate.

The server is another process (aiohttp's web server, answering canned replies at once), so
its CPU is not counted. ``--concurrency`` requests are kept in flight, as a runner keeps one
per episode. Each client is measured in a fresh child process (no warm state shared).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import os
import random
import socket
import subprocess
import sys
import time
from typing import Any

CHAT_PATH = "/v1/chat/completions"
EXECUTE_PATH = "/execute"
SCREENSHOT_PATH = "/screenshot"
SCREENSHOT_BYTES = 330_000
IMAGES_PER_REQUEST = 5
REPLY = json.dumps({
    "id": "x", "object": "chat.completion", "model": "m",
    "choices": [{"index": 0, "finish_reason": "stop", "message": {
        "role": "assistant", "content": "Thought: click it.\nAction: click(start_box='(1,2)')"}}],
    "usage": {"prompt_tokens": 15000, "completion_tokens": 60, "total_tokens": 15060},
}).encode()
EXECUTE_REPLY = json.dumps({"status": "success", "output": "", "error": "",
                            "returncode": 0}).encode()
EXECUTE_BODY = json.dumps({"command": ["python", "-c", "import pyautogui; "
                                       "pyautogui.click(960, 540)"], "shell": False}).encode()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# ---------------------------------------------------------------------------- the server

def serve(port: int) -> None:
    from aiohttp import web

    png = random.Random(0).randbytes(SCREENSHOT_BYTES)

    async def chat(request: web.Request) -> web.Response:
        if request.headers.get("Transfer-Encoding"):
            raise SystemExit("chunked body: the client did not send Content-Length")
        await request.read()
        return web.Response(body=REPLY, content_type="application/json")

    async def execute(request: web.Request) -> web.Response:
        await request.read()
        return web.Response(body=EXECUTE_REPLY, content_type="application/json")

    async def screenshot(request: web.Request) -> web.Response:
        return web.Response(body=png, content_type="image/png")

    app = web.Application(client_max_size=64 * 2**20)
    app.router.add_post(CHAT_PATH, chat)
    app.router.add_post(EXECUTE_PATH, execute)
    app.router.add_get(SCREENSHOT_PATH, screenshot)
    web.run_app(app, host="127.0.0.1", port=port, print=None, access_log=None)


# ---------------------------------------------------------------------------- the clients

def _images() -> list[str]:
    rng = random.Random(1)
    return ["data:image/png;base64," + base64.b64encode(rng.randbytes(SCREENSHOT_BYTES))
            .decode("ascii") for _ in range(IMAGES_PER_REQUEST)]


def _chat_body(images: list[str]) -> Any:
    from cua_rollout.core.screenshot import DataURL
    from cua_rollout.model.openai_protocol import RequestBody

    content: list[dict[str, Any]] = []
    for url in images:
        content.append({"type": "image_url", "image_url": {"url": DataURL(url)}})
    messages = [{"role": "system", "content": "You are a GUI agent." * 50},
                {"role": "user", "content": content}]
    return RequestBody({"model": "m", "messages": messages, "max_tokens": 128})


class Httpx2Client:
    def __init__(self, base: str, concurrency: int) -> None:
        import httpx2

        limits = httpx2.Limits(max_connections=concurrency,
                               max_keepalive_connections=concurrency)
        self.model = httpx2.AsyncClient(limits=limits, timeout=60)
        self.base = base
        self.concurrency = concurrency
        self._desktops: list[Any] = []

    def desktop(self) -> Any:
        import httpx2

        return httpx2.AsyncClient(limits=httpx2.Limits(max_connections=10,
                                                       max_keepalive_connections=1),
                                  timeout=60)

    async def chat(self, body: Any) -> bytes:
        r = await self.model.post(self.base + CHAT_PATH, content=body, headers={
            "Content-Type": "application/json", "Content-Length": str(body.length)})
        return r.content

    async def execute(self, desktop: Any) -> bytes:
        r = await desktop.post(self.base + EXECUTE_PATH, content=EXECUTE_BODY,
                               headers={"Content-Type": "application/json"})
        return r.content

    async def screenshot(self, desktop: Any) -> bytes:
        r = await desktop.get(self.base + SCREENSHOT_PATH)
        return r.content

    async def close(self, desktop: Any = None) -> None:
        await (desktop or self.model).aclose()


class AiohttpClient:
    def __init__(self, base: str, concurrency: int) -> None:
        import aiohttp

        self.model = aiohttp.ClientSession(connector=aiohttp.TCPConnector(
            limit=concurrency, limit_per_host=concurrency))
        self.base = base

    def desktop(self) -> Any:
        import aiohttp

        return aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=10))

    async def chat(self, body: Any) -> bytes:
        async with self.model.post(self.base + CHAT_PATH, data=body.__aiter__(), headers={
                "Content-Type": "application/json",
                "Content-Length": str(body.length)}) as r:
            return await r.read()

    async def execute(self, desktop: Any) -> bytes:
        async with desktop.post(self.base + EXECUTE_PATH, data=EXECUTE_BODY,
                                headers={"Content-Type": "application/json"}) as r:
            return await r.read()

    async def screenshot(self, desktop: Any) -> bytes:
        async with desktop.get(self.base + SCREENSHOT_PATH) as r:
            return await r.read()

    async def close(self, desktop: Any = None) -> None:
        await (desktop or self.model).close()


class _RawConnection:
    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def request(self, method: str, path: str, pieces: list[Any], length: int) -> bytes:
        if self.writer is None:
            self.reader, self.writer = await asyncio.open_connection(self.host, self.port)
        assert self.reader is not None
        head = (f"{method} {path} HTTP/1.1\r\nHost: {self.host}:{self.port}\r\n"
                f"Content-Length: {length}\r\nContent-Type: application/json\r\n\r\n")
        self.writer.write(head.encode())
        for p in pieces:
            self.writer.write(p.encode("ascii") if isinstance(p, str) else p)
        await self.writer.drain()
        status = await self.reader.readuntil(b"\r\n\r\n")
        size = 0
        for line in status.split(b"\r\n"):
            if line.lower().startswith(b"content-length:"):
                size = int(line.split(b":", 1)[1])
        return await self.reader.readexactly(size)


class RawClient:
    def __init__(self, base: str, concurrency: int) -> None:
        host, port = base.removeprefix("http://").split(":")
        self.host, self.port = host, int(port)
        self.free: list[_RawConnection] = []

    def desktop(self) -> Any:
        return _RawConnection(self.host, self.port)

    async def chat(self, body: Any) -> bytes:
        conn = self.free.pop() if self.free else _RawConnection(self.host, self.port)
        out = await conn.request("POST", CHAT_PATH, body._pieces, body.length)
        self.free.append(conn)
        return out

    async def execute(self, desktop: Any) -> bytes:
        return await desktop.request("POST", EXECUTE_PATH, [EXECUTE_BODY], len(EXECUTE_BODY))

    async def screenshot(self, desktop: Any) -> bytes:
        return await desktop.request("GET", SCREENSHOT_PATH, [], 0)

    async def close(self, desktop: Any = None) -> None:
        conns = [desktop] if desktop is not None else self.free
        for c in conns:
            if c.writer is not None:
                c.writer.close()


CLIENTS = {"httpx2": Httpx2Client, "aiohttp": AiohttpClient, "raw": RawClient}


async def _measure(name: str, base: str, requests: int, concurrency: int) -> dict[str, Any]:
    client = CLIENTS[name](base, concurrency)
    body = _chat_body(_images())
    desktops = [client.desktop() for _ in range(concurrency)]
    out: dict[str, Any] = {"client": name}

    async def run(kind: str, n: int) -> float:
        async def worker(i: int) -> None:
            for _ in range(i, n, concurrency):
                if kind == "chat":
                    await client.chat(body)
                elif kind == "execute":
                    await client.execute(desktops[i])
                else:
                    got = await client.screenshot(desktops[i])
                    assert len(got) == SCREENSHOT_BYTES, len(got)

        await asyncio.gather(*(worker(i) for i in range(concurrency)))  # warm connections
        cpu0 = time.process_time()
        await asyncio.gather(*(worker(i) for i in range(concurrency)))
        return (time.process_time() - cpu0) / n * 1000

    for kind in ("chat", "execute", "screenshot"):
        n = requests if kind != "chat" else max(concurrency, requests // 2)
        out[f"{kind}_cpu_ms"] = round(await run(kind, n), 3)
    out["step_cpu_ms"] = round(out["chat_cpu_ms"] + out["execute_cpu_ms"]
                               + out["screenshot_cpu_ms"], 3)
    for d in desktops:
        await client.close(d)
    await client.close()
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=400)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--clients", nargs="+", default=list(CLIENTS), choices=list(CLIENTS))
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--serve", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--base", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.serve:
        serve(args.serve)
        return 0
    if args.child:
        row = asyncio.run(_measure(args.child, args.base, args.requests, args.concurrency))
        print(json.dumps(row))
        return 0
    port = _free_port()
    server = subprocess.Popen([sys.executable, __file__, "--serve", str(port)],
                              start_new_session=True)
    rows = []
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                if time.monotonic() > deadline or server.poll() is not None:
                    raise SystemExit("the test server did not start") from None
                time.sleep(0.1)
        for name in args.clients:
            out = subprocess.run(
                [sys.executable, __file__, "--child", name, "--base",
                 f"http://127.0.0.1:{port}", "--requests", str(args.requests),
                 "--concurrency", str(args.concurrency)],
                check=True, capture_output=True, text=True, env={**os.environ})
            rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
    finally:
        server.terminate()
        server.wait(10)
    if args.json:
        print(json.dumps(rows, indent=2))
    else:
        print(f"{'client':<8} {'chat ms':>8} {'execute ms':>11} {'screenshot ms':>14} "
              f"{'step ms':>8}   (CPU of the sending process per request)")
        for r in rows:
            print(f"{r['client']:<8} {r['chat_cpu_ms']:>8.3f} {r['execute_cpu_ms']:>11.3f} "
                  f"{r['screenshot_cpu_ms']:>14.3f} {r['step_cpu_ms']:>8.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
