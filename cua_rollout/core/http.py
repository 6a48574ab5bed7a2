"""HTTP pieces shared by the clients (model endpoints, desktops) and the in-process servers
(the scripted policy, the model fleet's control server, the fakes of the tests and
benchmarks): one TLS context per process, one reading of an error body, one way to serve an
ASGI app from a thread."""

from __future__ import annotations

import functools
import ipaddress
import json
import re
import socket
import ssl
import threading
import time
from typing import Any

from cua_rollout.core.errors import ConfigError

__all__ = [
    "ThreadedServer",
    "error_text",
    "host_entry",
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
    start of the body. ``response`` is an httpx or httpx2 response."""
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
        self._thread = threading.Thread(target=self._server.run, daemon=True)
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not self._server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError(f"{type(self).__name__} did not start")
            time.sleep(0.01)
        self.port = self._server.servers[0].sockets[0].getsockname()[1]
        return self

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
