"""HTTP pieces shared by the clients (model endpoints, desktops) and the in-process servers
(the scripted policy, the model fleet's control server, the fakes of the tests and
benchmarks): one TLS context per process, one reading of an error body, one way to serve an
ASGI app from a thread, and the transport of a step's hot requests.

The hot requests (the chat completion, the action, the screenshot: three per step, from
every episode of a runner's event loop) go through aiohttp (``hot_session``,
``hot_request``): measured by benchmarks/bench_http_clients.py, it costs a runner 1.2 ms of
CPU for a step's three requests where httpx2 cost 5.3 ms (0.11 ms against 0.65 ms for a small
request: its parser is C, httpx2's is h11 in Python under anyio). Calls off the hot path keep
httpx2."""

from __future__ import annotations

import contextlib
import functools
import ipaddress
import json
import re
import socket
import ssl
import threading
import time
import urllib.parse
import urllib.request
from collections.abc import AsyncIterable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

import aiohttp

from cua_rollout.core.errors import ConfigError

__all__ = [
    "Reply",
    "ThreadedServer",
    "TransportFailure",
    "error_text",
    "host_entry",
    "hot_request",
    "hot_session",
    "is_loopback",
    "reachable_host",
    "redact_url",
    "redact_urls",
    "ssl_context",
]

_WILDCARDS = ("0.0.0.0", "::", "")


def is_loopback(host: str) -> bool:
    """Whether a server bound to ``host`` is reachable from this machine only (a name other
    than ``localhost`` counts as reachable from elsewhere)."""
    try:
        return host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def reachable_host(host: str) -> str:
    """Where others reach a server bound to ``host``, as a URL's host: a wildcard bind is
    reached by this machine's name, an IPv6 address in brackets."""
    if host in _WILDCARDS:
        return socket.getfqdn()
    return f"[{host}]" if ":" in host else host


@functools.cache
def ssl_context() -> ssl.SSLContext:
    """httpx2's default TLS context, built once per process (loading the CA bundle takes
    ~35 ms, which every new client would otherwise pay)."""
    import httpx2

    return httpx2.create_ssl_context()


def error_text(response: Any, limit: int = 500) -> str:
    """What an error reply says: OpenAI's ``{"error": {"message": ...}}``, the desktop
    server's ``{"message": ...}`` / ``{"error": ...}``, FastAPI's ``{"detail": ...}``, else the
    start of the body. ``response`` is an httpx or httpx2 response, or a ``Reply``."""
    try:
        body = response.json()
    except ValueError:
        return response.text[:limit]
    if isinstance(body, dict):
        err = body.get("error")
        if isinstance(err, dict) and "message" in err:
            return str(err["message"])[:limit]
        for key in ("message", "error", "detail"):
            if body.get(key):
                return str(body[key])[:limit]
    return json.dumps(body)[:limit]


# --------------------------------------------------------------------------- hot requests

@dataclass(frozen=True, slots=True)
class Reply:
    """A whole reply of ``hot_request``: its status and body, read before the connection
    went back to its pool."""

    status_code: int
    content: bytes

    def json(self) -> Any:
        """The body as JSON (``ValueError`` when it is not)."""
        return json.loads(self.content)

    @property
    def text(self) -> str:
        return self.content.decode("utf-8", "replace")


class TransportFailure(Exception):
    """A hot request that got no reply. ``kind`` says what a caller may do about it:
    ``connect`` (no connection was made, or none came free from the pool: nothing was
    sent), ``disconnected`` (the server closed the connection before answering: it stopped,
    or was killed mid-request), ``timeout`` (no reply, or none of its bytes, in time) or
    ``other`` (any other transport error)."""

    def __init__(self, kind: Literal["connect", "disconnected", "timeout", "other"],
                 cause: BaseException) -> None:
        self.kind = kind
        self.cause_name = type(cause).__name__
        super().__init__(f"{self.cause_name}: {cause}".rstrip(": "))


@functools.cache
def _env_proxies() -> dict[str, str]:
    """The process's proxy variables (``HTTP_PROXY``, ``HTTPS_PROXY``, ``NO_PROXY`` ...),
    read once."""
    return urllib.request.getproxies_environment()


@functools.lru_cache(maxsize=4096)
def _proxy_for(scheme: str, host: str) -> str | None:
    """The proxy the environment names for ``scheme://host`` (None: direct), as httpx2 and
    aiohttp's ``trust_env`` read it. Asked once per host: aiohttp's ``trust_env`` reads the
    variables and ``~/.netrc`` (in a thread) again on every request, 28% of its CPU on a
    runner."""
    proxies = _env_proxies()
    if not proxies or urllib.request.proxy_bypass_environment(host, proxies):
        return None
    return proxies.get(scheme) or proxies.get("all")


def hot_session(limit: int, *, headers: Mapping[str, str] | None = None
                ) -> aiohttp.ClientSession:
    """A client session for one endpoint or one desktop (call it on the loop that uses it):
    at most ``limit`` connections, kept alive between requests; TLS verified with
    ``ssl_context()``; redirects are never followed. Proxies come from the environment
    (``hot_request``); ``~/.netrc`` is not read (endpoints and desktops take their
    credentials from ``model.api_key_env`` and ``desktops.token_env``)."""
    connector = aiohttp.TCPConnector(limit=limit, limit_per_host=0, ssl=ssl_context())
    return aiohttp.ClientSession(connector=connector, headers=dict(headers or {}),
                                 trust_env=False, auto_decompress=True,
                                 timeout=aiohttp.ClientTimeout(total=None))


async def hot_request(
    session: aiohttp.ClientSession,
    method: str,
    url: str,
    *,
    timeout_s: float,
    connect_timeout_s: float,
    headers: Mapping[str, str] | None = None,
    json_body: Any = None,
    body: bytes | AsyncIterable[bytes] | None = None,
    content_length: int | None = None,
    form: Mapping[str, str] | None = None,
    files: Mapping[str, tuple[str, bytes]] | None = None,
) -> Reply:
    """One request and its whole reply. ``timeout_s`` bounds the wait for a connection from
    the pool and every wait for the reply's bytes (httpx2's read and pool timeouts),
    ``connect_timeout_s`` making a connection. ``body`` with ``content_length`` is sent as
    is, never chunked (a streamed body of known size: ``RequestBody``); ``form`` is
    url-encoded, or a multipart form with ``files`` (name: (filename, bytes)). Any failure to
    get the reply raises ``TransportFailure``."""
    send_headers = dict(headers or {})
    data: Any = body
    if json_body is not None:
        data = json.dumps(json_body).encode()
        send_headers.setdefault("Content-Type", "application/json")
    elif files:
        multipart = aiohttp.FormData()
        for key, value in (form or {}).items():
            multipart.add_field(key, value)
        for key, (filename, content) in files.items():
            multipart.add_field(key, content, filename=filename,
                                content_type="application/octet-stream")
        data = multipart
    elif form is not None:
        data = dict(form)
    if content_length is not None:
        send_headers["Content-Length"] = str(content_length)
    timeout = aiohttp.ClientTimeout(total=None, connect=timeout_s,
                                    sock_connect=connect_timeout_s, sock_read=timeout_s)
    parts = urllib.parse.urlsplit(url)
    proxy = _proxy_for(parts.scheme, parts.hostname or "")
    try:
        async with session.request(method, url, data=data, headers=send_headers,
                                   timeout=timeout, allow_redirects=False,
                                   proxy=proxy) as response:
            return Reply(response.status, await response.read())
    except (aiohttp.ClientConnectorError, aiohttp.ConnectionTimeoutError) as exc:
        raise TransportFailure("connect", exc) from exc
    except aiohttp.ServerDisconnectedError as exc:
        raise TransportFailure("disconnected", exc) from exc
    except (TimeoutError, aiohttp.SocketTimeoutError) as exc:
        raise TransportFailure("timeout", exc) from exc
    except aiohttp.ClientError as exc:
        raise TransportFailure("other", exc) from exc


# scheme://user:password@host — the userinfo part is a credential.
_USERINFO_RE = re.compile(r"(?P<scheme>[A-Za-z][A-Za-z0-9+.-]*://)[^/@\s]+@")


def redact_url(text: str) -> str:
    """``text`` with the credentials of every URL in it replaced by ``***`` (for run.json,
    records and logs; the requests themselves use the real URL)."""
    return _USERINFO_RE.sub(r"\g<scheme>***@", text)


def redact_urls(value: Any) -> Any:
    """``redact_url`` over every string of a JSON-like value (a config dump, argv)."""
    if isinstance(value, str):
        return redact_url(value)
    if isinstance(value, dict):
        return {k: redact_urls(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [redact_urls(v) for v in value]
    return value


class ThreadedServer:
    """Any ASGI 3 app (a FastAPI app, any async callable) served by uvicorn in a thread with
    its own loop (run.py serves the scripted policy so; the fleet its control API; tests and
    benchmarks their fakes). Port 0 picks a free one, kept across a stop and a start."""

    def __init__(self, app: Any, host: str = "127.0.0.1", port: int = 0) -> None:
        self.app = app
        self.host = host
        self.port = port
        self._server: Any = None
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        return f"http://{reachable_host(self.host)}:{self.port}"

    def start(self, timeout_s: float = 10.0) -> ThreadedServer:
        import uvicorn

        # ASGI 3 said, not guessed: uvicorn takes a bound method (an app's handler) for ASGI 2.
        config = uvicorn.Config(
            self.app, host=self.host, port=self.port, log_level="error", lifespan="off",
            timeout_graceful_shutdown=1, interface="asgi3",
        )
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not self._server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError(f"{type(self).__name__} did not start")
            time.sleep(0.01)
        self.port = self._server.servers[0].sockets[0].getsockname()[1]
        return self

    def _serve(self) -> None:
        # uvicorn calls sys.exit when it cannot bind: the thread ends, start() says so.
        with contextlib.suppress(SystemExit):
            self._server.run()

    def stop(self) -> None:
        if self._server is not None and self._thread is not None:
            self._server.should_exit = True
            self._thread.join(timeout=10)
            self._server = None

    def __enter__(self) -> ThreadedServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def host_entry(entry: str, key: str) -> (tuple[str, int | None]
                                        | ipaddress.IPv4Network | ipaddress.IPv6Network):
    """One entry of an address allow-list: a CIDR network, or ``(host, port)`` from ``host``
    (any port: None), ``host:port`` or ``[v6]:port``, the host lower-cased. Raises
    ``ConfigError`` naming ``key`` and the malformed entry."""
    text = entry.strip().lower()
    try:
        return ipaddress.ip_network(text, strict=False)
    except ValueError:
        pass
    host, port = text, None
    if text.startswith("["):  # [v6]:port
        host, _, rest = text[1:].partition("]")
        port = rest[1:] if rest.startswith(":") else rest or None
    elif text.count(":") == 1:
        host, port = text.split(":")
    if port is not None and not (port.isdigit() and 0 < int(port) < 65536):
        raise ConfigError(f"{key}: {entry!r} has no valid port")
    if not host or not re.fullmatch(r"[a-z0-9._:-]+", host) or host.startswith(("-", ".")):
        raise ConfigError(f"{key}: {entry!r} is not a host, host:port or CIDR network")
    return host, int(port) if port else None
