"""The ``web`` text environment's tools: ``search`` (a query to a search backend, the top
results as numbered lines) and ``fetch`` (a page by URL, as its title and readable text).

Backends (``backend`` of ``WebToolConfig``, the config's ``text.web``, which every tool here
takes), each an implementation of :class:`SearchBackend`:

- ``corpus``: our own web corpus server (``cua_rollout.text.web_corpus``), ``GET
  {search_url}/search?q=...&k=...`` answering ``{"results": [{"title", "url", "snippet"}]}``.
  The tests and the offline demo use it; its pages are fetched from the same server.
- ``serper``: Google results through serper.dev: ``POST https://google.serper.dev/search``
  with the key in the ``X-API-KEY`` header and ``{"q": ..., "num": ...}`` as the JSON body;
  the reply's ``organic`` list holds ``{"title", "link", "snippet", "position"}``.
- ``brave``: the Brave Search API: ``GET https://api.search.brave.com/res/v1/web/search``
  with ``q`` and ``count`` (at most 20) as query parameters and the key in the
  ``X-Subscription-Token`` header; the reply's ``web.results`` list holds ``{"title", "url",
  "description"}`` (the description marks the query's words with ``<strong>``, which we strip).

A real API's key is read from the environment variable ``api_key_env`` names (never written in
the config); an unset variable is a ``ConfigError`` naming it when the backend is made, and a
key the API rejects (HTTP 401/403) is one too, when the first search meets it: every episode
would meet the same, so the run stops rather than telling each model "HTTP 401".

Failure handling, the point of this module: every failure the model can hear about raises
``ToolError`` with one line (timeouts, HTTP errors with the start of the body, malformed
replies, pages that are not text, disallowed schemes, invalid URLs); backends translate every
``httpx2`` and JSON exception. Each call runs under one total deadline
(``asyncio.timeout(request_timeout_s)``), since httpx2's read timeout restarts with every
chunk and a server that drips bytes would otherwise hold a call forever. Pages are streamed
and reading stops at ``max_page_bytes``; the text the model gets is cut at
``max_page_chars`` with a ``[truncated: N of M characters shown]`` line. Redirects are
followed by hand, up to ``max_redirects``, so every hop's scheme is checked.

HTML to text uses selectolax (its Lexbor engine: a complete HTML5 parser in C, MIT licensed,
no dependencies, a wheel for every platform, ~1 ms for a typical page). We walk its tree
ourselves so block elements become lines, list items ``- `` lines, ``<pre>`` keeps its layout
and scripts, styles and other non-text elements are dropped. The alternatives: html2text is
GPL-licensed (this project is Apache-2.0); trafilatura's boilerplate removal pulls in lxml,
courlan, htmldate and justext and drops the content of short pages; BeautifulSoup's
``get_text`` does no block layout either and its pure-Python parsing is ~10x slower.
selectolax is imported on first use, so the settings and backends load without the ``text``
extra.

Addresses (``AddressPolicy``): the model chooses what ``fetch`` reads, so by default fetch
reaches public addresses only (a search backend calls only its configured URL, with an
unguarded client that honours the proxy variables). Every connection's host is resolved and
each address checked as the socket is opened (the client's network backend, so a redirect or
a name that resolves to an internal address is caught at the hop that meets it, and the
checked address is the one connected to: a name cannot resolve to a public address for the
check and a private one for the connection). Loopback, private, link-local (cloud metadata
at 169.254.169.254 included), shared, reserved, multicast and unspecified addresses, and IPv6
forms of them, are refused unless ``allow_private`` is set or ``allow_hosts`` names them (a
host, ``host:port`` or a CIDR network). The search backend's own ``search_url`` host and
port are always allowed: a corpus server's pages are fetched from it. A guarded client ignores
proxy variables (``HTTP_PROXY`` and friends): through a proxy the guard would check the proxy,
not the page.

Each tool makes its own client (:func:`make_client`, guarded for fetch), which its ``close``
closes, or uses one passed in.

One file on purpose: the address guard and the clients that must go through it are
reviewed together (fetch, redirects, every backend).
"""

from __future__ import annotations

import asyncio
import codecs
import html
import ipaddress
import json
import os
import re
import socket
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol, runtime_checkable
from urllib.parse import urljoin, urlsplit

import httpcore2
import httpx2

from cua_rollout.config import WebToolConfig
from cua_rollout.core.errors import ConfigError, ToolError, ToolUnavailable
from cua_rollout.core.http import error_text, host_entry, redact_url, ssl_context
from cua_rollout.envs.tools import ToolSpec, check_arguments

__all__ = [
    "ALLOWED_SCHEMES",
    "BACKENDS",
    "MAX_TOP_K",
    "AddressPolicy",
    "BraveSearch",
    "CorpusSearch",
    "FetchTool",
    "PageText",
    "SearchBackend",
    "SearchResult",
    "SearchTool",
    "SerperSearch",
    "html_to_text",
    "make_client",
    "make_search_backend",
    "plain_title",
]

BACKENDS = ("corpus", "serper", "brave")
ALLOWED_SCHEMES = ("http", "https")
"""The URL schemes fetch reads."""
MAX_TOP_K = 20  # Brave's largest ``count``; more results than this only fill the context
MAX_QUERY_CHARS = 1000
SNIPPET_CHARS = 500  # of a result's snippet shown to the model
USER_AGENT = "cua-rollout-web/0.1 (research agent)"
SERPER_URL = "https://google.serper.dev/search"
BRAVE_URL = "https://api.search.brave.com/res/v1/web/search"
_REPLY_BYTES = 4_000_000  # the most of a search reply we read
_ERROR_BODY_BYTES = 64_000  # the most of an error reply we read
_REDIRECTS = frozenset({301, 302, 303, 307, 308})


@dataclass(frozen=True)
class SearchResult:
    title: str
    url: str
    snippet: str


@runtime_checkable
class SearchBackend(Protocol):
    """A search API. ``search`` raises ``ToolError`` (one line, for the model) or
    ``ConfigError`` (the key was rejected), never an httpx2 or JSON exception."""

    async def search(self, query: str, k: int) -> list[SearchResult]:
        ...

    async def close(self) -> None:
        ...


def make_client(settings: WebToolConfig, *, guard: bool = True) -> httpx2.AsyncClient:
    """A web tool's client: the settings' timeout, redirects left to the tools, the process's
    TLS context, and with ``guard`` (fetch's) the settings' ``AddressPolicy`` checked on every
    connection (unless ``allow_private``)."""
    policy = AddressPolicy.of(settings) if guard else None
    return httpx2.AsyncClient(
        timeout=httpx2.Timeout(settings.request_timeout_s),
        follow_redirects=False,
        verify=ssl_context(),
        headers={"User-Agent": USER_AGENT},
        transport=None if policy is None else _GuardedTransport(policy),
    )


# --------------------------------------------------------------------------- addresses


def _non_public(address: ipaddress.IPv4Address | ipaddress.IPv6Address) -> str | None:
    """What kind of non-public address ``address`` is, or None for a public one."""
    if isinstance(address, ipaddress.IPv6Address):
        embedded = address.ipv4_mapped or address.sixtofour or (
            address.teredo[1] if address.teredo else None)
        if embedded is not None:
            return _non_public(embedded)
        if address in _NAT64:  # the IPv4 address in its last 32 bits
            return _non_public(ipaddress.IPv4Address(int(address) & 0xFFFFFFFF))
    for kind in ("loopback", "unspecified", "link_local", "multicast", "reserved", "private"):
        if getattr(address, f"is_{kind}"):
            return kind.replace("_", "-")
    if not address.is_global:
        return "non-public"  # shared (100.64/10) and other special-purpose ranges
    return None


_NAT64 = ipaddress.IPv6Network("64:ff9b::/96")


class AddressPolicy:
    """Which addresses the web tools may connect to: public ones; non-public ones only when
    ``allow_hosts`` names them, by host name or address (any port), ``host:port`` or CIDR
    network, or when they are ``search_url``'s host and port. Raises ``ConfigError`` naming a
    malformed entry."""

    def __init__(self, allow_hosts: Iterable[str] = (), *,
                 search_url: str | None = None) -> None:
        self.hosts: set[tuple[str, int | None]] = set()
        self.networks: list[ipaddress.IPv4Network | ipaddress.IPv6Network] = []
        for entry in allow_hosts:
            self._add(entry)
        if search_url:
            parts = urlsplit(search_url)
            if parts.hostname:
                default = 443 if parts.scheme == "https" else 80
                self.hosts.add((parts.hostname.lower(), parts.port or default))

    @classmethod
    def of(cls, settings: WebToolConfig) -> AddressPolicy | None:
        """The settings' policy; None when ``allow_private`` lets every address through."""
        if settings.allow_private:
            return None
        return cls(settings.allow_hosts, search_url=settings.search_url)

    def _add(self, entry: str) -> None:
        allowed = host_entry(entry, "text.web.allow_hosts")
        if isinstance(allowed, tuple):
            self.hosts.add(allowed)
        else:
            self.networks.append(allowed)

    def _named(self, name: str, port: int) -> bool:
        name = name.lower().strip("[]").rstrip(".")
        return (name, port) in self.hosts or (name, None) in self.hosts

    def refusal(self, host: str, port: int, address: str) -> str | None:
        """Why ``address`` (which ``host`` resolved to) may not be reached on ``port``, or
        None when it may."""
        try:
            ip = ipaddress.ip_address(address.split("%", 1)[0])
        except ValueError:
            return f"{address} is not an IP address"
        kind = _non_public(ip)
        if kind is None or self._named(host, port) or self._named(str(ip), port):
            return None
        if any(ip.version == net.version and ip in net for net in self.networks):
            return None
        shown = host if host == address else f"{host} ({address})"
        article = "an" if kind[0] in "aeiou" else "a"
        return (f"{shown} is {article} {kind} address, which the web tools may not reach "
                "(allow it with text.web.allow_hosts)")


class _GuardedBackend(httpcore2.AsyncNetworkBackend):
    """The network backend of a guarded client: resolves each connection's host, refuses the
    addresses its policy refuses, and connects to a checked address itself."""

    def __init__(self, policy: AddressPolicy) -> None:
        self.policy = policy
        self._inner = httpcore2.AnyIOBackend()

    async def connect_tcp(self, host: str, port: int, timeout: float | None = None,
                          local_address: str | None = None,
                          socket_options: Iterable[Any] | None = None,
                          ) -> httpcore2.AsyncNetworkStream:
        try:
            infos = await asyncio.get_running_loop().getaddrinfo(
                host, port, type=socket.SOCK_STREAM)
        except (OSError, UnicodeError) as exc:
            raise httpcore2.ConnectError(f"cannot resolve {host}: {exc}") from exc
        addresses = list(dict.fromkeys(str(info[4][0]) for info in infos))
        refusals = [self.policy.refusal(host, port, a) for a in addresses]
        allowed = [a for a, why in zip(addresses, refusals, strict=True) if why is None]
        if not allowed:
            raise httpcore2.ConnectError(next(why for why in refusals if why))
        failure: Exception | None = None
        for address in allowed:
            try:
                return await self._inner.connect_tcp(address, port, timeout, local_address,
                                                     socket_options)
            except (httpcore2.ConnectError, httpcore2.ConnectTimeout) as exc:
                failure = exc
        assert failure is not None
        raise failure

    async def connect_unix_socket(self, path: str, timeout: float | None = None,
                                  socket_options: Iterable[Any] | None = None,
                                  ) -> httpcore2.AsyncNetworkStream:
        raise httpcore2.ConnectError("the web tools do not connect to Unix sockets")

    async def sleep(self, seconds: float) -> None:
        await self._inner.sleep(seconds)


class _GuardedTransport(httpx2.AsyncHTTPTransport):
    """httpx2's transport over a connection pool whose network backend is a
    ``_GuardedBackend`` (the transport takes no backend, its pool does); proxies from the
    environment are not used (the guard would check the proxy's address, not the page's)."""

    def __init__(self, policy: AddressPolicy) -> None:
        super().__init__(verify=ssl_context(), trust_env=False)
        self._pool = httpcore2.AsyncConnectionPool(
            ssl_context=ssl_context(), max_connections=100, max_keepalive_connections=20,
            keepalive_expiry=5.0, network_backend=_GuardedBackend(policy))


# --------------------------------------------------------------------------- HTML to text


class PageText(NamedTuple):
    title: str
    text: str


_DROPPED_TAGS = frozenset({"script", "style", "noscript", "template", "svg", "math", "canvas",
                           "iframe", "object", "embed", "select", "button", "head"})
_BLOCK_TAGS = frozenset({
    "address", "article", "aside", "blockquote", "body", "caption", "dd", "details", "dialog",
    "div", "dl", "dt", "fieldset", "figcaption", "figure", "footer", "form", "header", "hgroup",
    "hr", "html", "legend", "li", "main", "nav", "ol", "p", "section", "summary", "table",
    "tbody", "tfoot", "thead", "tr", "ul", "h1", "h2", "h3", "h4", "h5", "h6",
})
_PARAGRAPH_TAGS = frozenset({"p", "h1", "h2", "h3", "h4", "h5", "h6", "blockquote", "table",
                             "ul", "ol", "dl", "figure", "section", "article", "header",
                             "footer", "main", "nav", "aside"})
_HEADINGS = ("h1", "h2", "h3", "h4", "h5", "h6")


class _Lines:
    """The text of a walk over the tree, as lines: inline text joins the current line (its
    whitespace collapsed), a block boundary ends it, a paragraph boundary leaves one blank
    line, preformatted text keeps its own lines."""

    def __init__(self) -> None:
        self.lines: list[str] = []
        self.current: list[str] = []
        self.prefix = ""  # put before the next line with text (a list item's "- ")

    def add(self, text: str) -> None:
        self.current.append(text)

    def has_text(self) -> bool:
        return bool("".join(self.current).strip())

    def end_line(self, blank: bool = False) -> None:
        line = " ".join("".join(self.current).split())
        self.current = []
        if line:
            self.lines.append(self.prefix + line)
            self.prefix = ""
        if blank and self.lines and self.lines[-1]:
            self.lines.append("")

    def add_pre(self, text: str) -> None:
        self.end_line(blank=True)
        rows = [row.rstrip() for row in text.replace("\r\n", "\n").split("\n")]
        while rows and not rows[0].strip():
            rows.pop(0)
        while rows and not rows[-1].strip():
            rows.pop()
        self.lines.extend(rows)
        self.end_line(blank=True)

    def text(self) -> str:
        self.end_line()
        return "\n".join(self.lines).strip()


def _collapse(text: str) -> str:
    return " ".join(text.split())


def html_to_text(markup: str | bytes) -> PageText:
    """The title (``<title>``, else the first heading) and readable text of an HTML page:
    block elements on their own lines, paragraphs apart, list items as ``- `` lines, table
    cells joined by `` | ``, ``<pre>`` as it is; scripts, styles and the like dropped."""
    try:
        from selectolax.lexbor import LexborHTMLParser
    except ImportError as exc:  # the `text` extra is not installed
        raise ToolUnavailable("reading HTML needs selectolax: pip install "
                              "'cua-rollout[text]'") from exc
    if isinstance(markup, bytes):
        markup = markup.decode("utf-8", errors="replace")
    tree = LexborHTMLParser(markup)
    title_node = tree.css_first("title")
    title = _collapse(title_node.text()) if title_node is not None else ""
    if not title:
        heading = tree.css_first(", ".join(_HEADINGS))
        title = _collapse(heading.text()) if heading is not None else ""
    root = tree.body or tree.root
    if root is None:
        return PageText(title, "")
    out = _Lines()
    pre_text: list[str] | None = None
    pre_depth = 0
    # An explicit stack (pages nest deeper than Python's recursion limit); a (None, element)
    # entry marks the end of that element. Dropped elements are skipped, not removed from the
    # tree (removing a node frees its children, which the parser's node list may still hold).
    stack: list[Any] = [root]
    while stack:
        node = stack.pop()
        if isinstance(node, tuple):  # (None, element): leaving it
            tag = node[1].tag
            if tag == "pre":
                pre_depth -= 1
                if pre_depth == 0 and pre_text is not None:
                    out.add_pre("".join(pre_text))
                    pre_text = None
            elif tag in _BLOCK_TAGS:
                out.end_line(blank=tag in _PARAGRAPH_TAGS)
            continue
        tag = node.tag
        if tag == "-text":
            text = node.text_content or ""
            if pre_text is not None:
                pre_text.append(text)
            else:
                out.add(text)
            continue
        if tag is None or tag.startswith(("-", "_")) or tag in _DROPPED_TAGS:
            continue
        if tag == "br":
            if pre_text is not None:
                pre_text.append("\n")
            else:
                out.end_line()
            continue
        if tag == "pre":
            pre_depth += 1
            if pre_text is None:
                pre_text = []
        elif tag in _BLOCK_TAGS and pre_text is None:
            out.end_line(blank=tag in _PARAGRAPH_TAGS)
            if tag == "li":
                out.prefix = "- "
        elif tag in ("td", "th") and pre_text is None:
            if out.has_text():
                out.add(" | ")
        elif tag == "img" and pre_text is None:
            alt = (node.attributes.get("alt") or "").strip()
            if alt:
                out.add(f" {alt} ")
        stack.append((None, node))
        children = list(node.iter(include_text=True))
        stack.extend(reversed(children))
    return PageText(title, out.text())


def plain_title(text: str, *, markdown: bool = False) -> str:
    """The title of a plain-text page: its first line, or for Markdown its first heading
    (``# ...``), else its first line; cut at 200 characters."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    if markdown:
        for line in lines:
            if line.startswith("#"):
                return _collapse(line.lstrip("#"))[:200]
    return _collapse(lines[0])[:200] if lines else ""


# --------------------------------------------------------------------------- HTTP helpers


def _seconds(value: float) -> str:
    return f"{value:g} s"


def _media_type(response: httpx2.Response) -> str:
    return response.headers.get("content-type", "").split(";")[0].strip().lower()


async def _read_capped(response: httpx2.Response, cap: int) -> tuple[bytes, bool]:
    """At most ``cap`` bytes of the (decoded) body, and whether there was more."""
    chunks: list[bytes] = []
    size = 0
    async for chunk in response.aiter_bytes():
        chunks.append(chunk)
        size += len(chunk)
        if size > cap:
            return b"".join(chunks)[:cap], True
    return b"".join(chunks), False


async def _error_summary(response: httpx2.Response) -> str:
    """One short line of what an error reply says: the message of a JSON error body, the text
    of an HTML one, else the start of the body."""
    body, _ = await _read_capped(response, _ERROR_BODY_BYTES)
    media = _media_type(response)
    if media in ("text/html", "application/xhtml+xml"):
        try:
            text = html_to_text(body).text
        except ToolUnavailable:
            text = body.decode("utf-8", errors="replace")
    else:
        text = error_text(httpx2.Response(response.status_code, content=body,
                                          headers={"content-type": media or "text/plain"}))
    text = _collapse(text)
    if len(text) > 200:
        text = text[:197] + "..."
    return text or response.reason_phrase or "(empty body)"


def _transport_failure(exc: Exception) -> str:
    message = _collapse(str(exc)) or type(exc).__name__
    return redact_url(f"{type(exc).__name__}: {message}")[:300]


# --------------------------------------------------------------------------- search backends


def _clean(text: Any) -> str:
    """A result field as plain text: entities decoded, highlight tags dropped, one line."""
    if not isinstance(text, str):
        return ""
    return _collapse(re.sub(r"<[^>]{0,200}>", "", html.unescape(text)))


class _HTTPSearch:
    """What the HTTP backends share: ``client`` (the one passed in, or one of its own that
    ``close`` closes), one JSON call under a total deadline with every failure translated."""

    name = "search backend"

    def __init__(self, settings: WebToolConfig, client: httpx2.AsyncClient | None) -> None:
        self.settings = settings
        # Unguarded: it calls the configured URL only, never one the model chose.
        self.client = client if client is not None else make_client(settings, guard=False)
        self._owns_client = client is None

    async def close(self) -> None:
        if self._owns_client and not self.client.is_closed:
            await self.client.aclose()

    def _rejected(self, status: int, summary: str) -> None:
        """Hook: a real API turns a rejected key into ``ConfigError``."""

    async def _call_json(self, method: str, url: str, **kwargs: Any) -> Any:
        timeout_s = self.settings.request_timeout_s
        try:
            async with asyncio.timeout(timeout_s):
                async with self.client.stream(
                        method, url, timeout=httpx2.Timeout(timeout_s), **kwargs) as response:
                    if response.status_code >= 400 or response.status_code in _REDIRECTS:
                        summary = await _error_summary(response)
                        self._rejected(response.status_code, summary)
                        raise ToolError(f"{self.name} answered HTTP {response.status_code}: "
                                        f"{summary}")
                    media = _media_type(response)
                    body, too_big = await _read_capped(response, _REPLY_BYTES)
        except TimeoutError:
            raise ToolError(f"{self.name} did not answer within {_seconds(timeout_s)}") from None
        except httpx2.TimeoutException:
            raise ToolError(f"{self.name} did not answer within {_seconds(timeout_s)}") from None
        except httpx2.HTTPError as exc:
            raise ToolError(f"{self.name} could not be reached: "
                            f"{_transport_failure(exc)}") from exc
        if too_big:
            raise self._malformed(f"the reply is larger than {_REPLY_BYTES} bytes")
        if "json" not in media:
            raise self._malformed(f"content type {media or '(none)'}, not application/json")
        try:
            return json.loads(body.decode("utf-8"))
        except UnicodeDecodeError:
            raise self._malformed("the body is not UTF-8 text") from None
        except ValueError as exc:
            raise self._malformed(str(exc)[:120]) from None

    def _malformed(self, why: str) -> ToolError:
        return ToolError(f"{self.name} returned malformed JSON: {why}")

    def _items(self, data: Any, *path: str) -> list[Any]:
        """The list at ``path`` of a reply object; a missing step means no results."""
        if not isinstance(data, dict):
            raise self._malformed(f"expected an object, got {type(data).__name__}")
        value: Any = data
        for i, key in enumerate(path):
            value = value.get(key)
            if value is None:
                return []
            if i < len(path) - 1 and not isinstance(value, dict):
                raise self._malformed(f"{'.'.join(path[:i + 1])} is not an object")
        if not isinstance(value, list):
            raise self._malformed(f"{'.'.join(path)} is not a list")
        return value

    def _results(self, items: list[Any], url_key: str, snippet_key: str,
                 k: int) -> list[SearchResult]:
        results = []
        for item in items:
            if not isinstance(item, dict) or not isinstance(item.get(url_key), str):
                continue  # one odd entry (an ad, a widget) does not spoil the others
            results.append(SearchResult(title=_clean(item.get("title")) or item[url_key],
                                        url=item[url_key].strip(),
                                        snippet=_clean(item.get(snippet_key))))
        if items and not results:
            raise self._malformed(f"no result is an object with a {url_key!r} string")
        return results[:k]


class CorpusSearch(_HTTPSearch):
    """Our corpus server's ``GET /search?q=&k=`` (``cua_rollout.text.web_corpus``)."""

    async def search(self, query: str, k: int) -> list[SearchResult]:
        base = (self.settings.search_url or "").rstrip("/")
        data = await self._call_json("GET", f"{base}/search", params={"q": query, "k": k})
        if not isinstance(data, dict) or "results" not in data:
            raise self._malformed('expected {"results": [...]}')
        return self._results(self._items(data, "results"), "url", "snippet", k)


class _KeyedSearch(_HTTPSearch):
    api = ""

    def __init__(self, settings: WebToolConfig, client: httpx2.AsyncClient | None,
                 key: str) -> None:
        super().__init__(settings, client)
        self._key = key

    def _rejected(self, status: int, summary: str) -> None:
        # Brave answers a bad token with 422 and the code SUBSCRIPTION_TOKEN_INVALID.
        if status in (401, 403) or "TOKEN_INVALID" in summary:
            raise ConfigError(f"{self.api} rejected the API key in ${self.settings.api_key_env} "
                              f"(HTTP {status}): {summary}")


class SerperSearch(_KeyedSearch):
    """Google results through serper.dev (``POST /search``, ``X-API-KEY``)."""

    api = "serper"
    name = "search backend (serper)"

    async def search(self, query: str, k: int) -> list[SearchResult]:
        data = await self._call_json(
            "POST", self.settings.search_url or SERPER_URL,
            headers={"X-API-KEY": self._key, "Content-Type": "application/json"},
            json={"q": query, "num": k})
        return self._results(self._items(data, "organic"), "link", "snippet", k)


class BraveSearch(_KeyedSearch):
    """The Brave Search API's web search (``GET``, ``X-Subscription-Token``)."""

    api = "brave"
    name = "search backend (brave)"

    async def search(self, query: str, k: int) -> list[SearchResult]:
        data = await self._call_json(
            "GET", self.settings.search_url or BRAVE_URL,
            params={"q": query, "count": min(k, MAX_TOP_K)},
            headers={"X-Subscription-Token": self._key, "Accept": "application/json"})
        return self._results(self._items(data, "web", "results"), "url", "description", k)


def make_search_backend(settings: WebToolConfig,
                        client: httpx2.AsyncClient | None = None) -> SearchBackend:
    """The backend the settings name, on ``client`` (or a client of its own, which its
    ``close`` closes). ``ConfigError``: an unknown backend, no ``search_url`` for the corpus,
    no key variable (or an unset one) for a real API."""
    if settings.backend == "corpus":
        if not settings.search_url:
            raise ConfigError("text.web.search_url: the corpus backend needs the corpus "
                              "server's base URL (or set text.web.serve_corpus)")
        return CorpusSearch(settings, client)
    if settings.backend in ("serper", "brave"):
        if not settings.api_key_env:
            raise ConfigError(f"text.web.api_key_env: the {settings.backend} backend needs the "
                              "name of the environment variable holding its API key")
        key = os.environ.get(settings.api_key_env, "").strip()
        if not key:
            raise ConfigError(f"text.web.api_key_env: the environment variable "
                              f"{settings.api_key_env} is not set; the {settings.backend} "
                              "backend reads its API key from it")
        cls = SerperSearch if settings.backend == "serper" else BraveSearch
        return cls(settings, client, key)
    raise ConfigError(f"text.web.backend: unknown backend {settings.backend!r}; one of "
                      f"{', '.join(BACKENDS)}")


# --------------------------------------------------------------------------- the tools


class SearchTool:
    """``search(query, top_k?)``: the backend's top results as ``[n] title — url`` lines,
    each followed by its snippet; ``(no results)`` when there are none."""

    def __init__(self, settings: WebToolConfig, *, client: httpx2.AsyncClient | None = None,
                 backend: SearchBackend | None = None) -> None:
        self.settings = settings
        self.backend = backend if backend is not None else make_search_backend(settings, client)
        self.spec = ToolSpec(
            name="search",
            description=("Search the web. Returns the top results, numbered, each with its "
                         "title, URL and a snippet; read a page with the fetch tool."),
            parameters={
                "type": "object",
                "properties": {
                    "query": {"type": "string", "description": "What to search for."},
                    "top_k": {"type": "integer",
                              "description": f"How many results (default {settings.top_k}, "
                                             f"at most {MAX_TOP_K})."},
                },
                "required": ["query"],
            },
        )

    async def __call__(self, arguments: Mapping[str, Any]) -> str:
        args = check_arguments(self.spec, arguments)
        query = _collapse(args["query"])
        if not query:
            raise ToolError("search: the query is empty")
        if len(query) > MAX_QUERY_CHARS:
            raise ToolError(f"search: the query is {len(query)} characters long; at most "
                            f"{MAX_QUERY_CHARS}")
        top_k = args.get("top_k", self.settings.top_k)
        if top_k < 1:
            raise ToolError("search: top_k must be at least 1")
        top_k = min(top_k, MAX_TOP_K)
        results = (await self.backend.search(query, top_k))[:top_k]
        if not results:
            return "(no results)"
        entries = []
        for n, result in enumerate(results, 1):
            snippet = result.snippet
            if len(snippet) > SNIPPET_CHARS:
                snippet = snippet[:SNIPPET_CHARS - 3] + "..."
            entries.append(f"[{n}] {result.title} — {result.url}" +
                           (f"\n{snippet}" if snippet else ""))
        return "\n\n".join(entries)

    async def close(self) -> None:
        await self.backend.close()


# Schemes written without "//" (data:text/plain,..., javascript:...): refused by name.
_OPAQUE_SCHEMES = frozenset({"data", "javascript", "mailto", "about", "blob", "tel", "urn",
                             "vbscript", "file"})
_HTML_TYPES = ("text/html", "application/xhtml+xml")
_TEXT_TYPES = ("application/json", "application/xml", "application/javascript",
               "application/x-javascript", "application/ld+json", "application/rss+xml",
               "application/atom+xml", "application/x-yaml", "application/yaml")


class FetchTool:
    """``fetch(url)``: a page's title and readable text (HTML converted, plain text as it
    is), cut at ``max_page_chars``. Only :data:`ALLOWED_SCHEMES`; pages that are not text
    (images, archives, binaries) are refused; redirects followed up to ``max_redirects``.
    ``client``: the one passed in, or one of its own that ``close`` closes."""

    def __init__(self, settings: WebToolConfig, *,
                 client: httpx2.AsyncClient | None = None) -> None:
        self.settings = settings
        self.client = client if client is not None else make_client(settings)
        self._owns_client = client is None
        self.spec = ToolSpec(
            name="fetch",
            description=("Read a web page: returns its title and text (at most "
                         f"{settings.max_page_chars} characters). Takes an http(s) URL, "
                         "e.g. one from the search results."),
            parameters={
                "type": "object",
                "properties": {"url": {"type": "string", "description": "The page's URL."}},
                "required": ["url"],
            },
        )

    async def close(self) -> None:
        if self._owns_client and not self.client.is_closed:
            await self.client.aclose()

    def _check_url(self, url: str) -> str:
        shown = redact_url(url)[:200]
        if not url:
            raise ToolError("fetch: the url is empty")
        if any(ch.isspace() or ord(ch) < 32 for ch in url):
            raise ToolError(f"fetch: invalid URL {shown!r}: it contains spaces or control "
                            "characters")
        try:
            parts = urlsplit(url)
            parts.port  # noqa: B018  (raises on a port that is not a number in range)
        except ValueError as exc:
            raise ToolError(f"fetch: invalid URL {shown!r}: {exc}") from None
        scheme = parts.scheme.lower()
        allowed = ALLOWED_SCHEMES
        if "://" not in url and scheme not in _OPAQUE_SCHEMES:
            raise ToolError(f"fetch: {shown!r} is not an absolute URL; give the whole URL, "
                            f"starting with {' or '.join(s + '://' for s in allowed)}")
        if scheme not in allowed:
            raise ToolError(f"fetch: {scheme}: URLs are not allowed; only "
                            f"{', '.join(allowed)}")
        if not parts.hostname:
            raise ToolError(f"fetch: invalid URL {shown!r}: it has no host")
        try:
            httpx2.URL(url)
        except (httpx2.InvalidURL, ValueError) as exc:
            raise ToolError(f"fetch: invalid URL {shown!r}: {exc}") from None
        return url

    async def __call__(self, arguments: Mapping[str, Any]) -> str:
        args = check_arguments(self.spec, arguments)
        url = self._check_url(args["url"].strip())
        timeout_s = self.settings.request_timeout_s
        shown = redact_url(url)
        try:
            async with asyncio.timeout(timeout_s):
                return await self._fetch(url)
        except TimeoutError:
            raise ToolError(f"fetch: {shown} did not answer within {_seconds(timeout_s)}"
                            ) from None
        except httpx2.TimeoutException:
            raise ToolError(f"fetch: {shown} did not answer within {_seconds(timeout_s)}"
                            ) from None
        except httpx2.HTTPError as exc:
            raise ToolError(f"fetch: could not load {shown}: {_transport_failure(exc)}"
                            ) from exc

    async def _fetch(self, url: str) -> str:
        timeout = httpx2.Timeout(self.settings.request_timeout_s)
        first = url
        for _hop in range(self.settings.max_redirects + 1):
            async with self.client.stream("GET", url, timeout=timeout) as response:
                status = response.status_code
                if status in _REDIRECTS and "location" in response.headers:
                    url = self._check_url(urljoin(str(response.url),
                                                  response.headers["location"]))
                    continue
                if status >= 400:
                    raise ToolError(f"fetch: {redact_url(url)} answered HTTP {status}: "
                                    f"{await _error_summary(response)}")
                return await self._read_page(url, response)
        raise ToolError(f"fetch: {redact_url(first)} redirected more than "
                        f"{self.settings.max_redirects} times")

    async def _read_page(self, url: str, response: httpx2.Response) -> str:
        media = _media_type(response)
        shown = redact_url(url)
        kind = self._kind(media)
        if kind is None:
            raise ToolError(f"fetch: {shown} is {media} content, not a text page")
        body, cut = await _read_capped(response, self.settings.max_page_bytes)
        if kind == "sniff":
            head = body[:4096]
            if b"\x00" in head:
                raise ToolError(f"fetch: {shown} is binary content, not a text page")
            kind = "html" if re.search(rb"<(!doctype html|html|body)\b", head[:1024].lower()
                                       ) else "text"
        elif kind == "text" and b"\x00" in body[:4096]:
            raise ToolError(f"fetch: {shown} is binary content labelled {media}, not a text "
                            "page")
        text = body.decode(self._encoding(response), errors="replace")
        if kind == "html":
            title, text = html_to_text(text)
        else:
            title = plain_title(text, markdown=media in ("text/markdown", "text/x-markdown")
                                or urlsplit(url).path.endswith(".md"))
            text = text.strip()
        return self._render(title, text, cut)

    @staticmethod
    def _kind(media: str) -> str | None:
        if not media:
            return "sniff"
        if media in _HTML_TYPES:
            return "html"
        if (media.startswith("text/") or media in _TEXT_TYPES
                or media.endswith(("+json", "+xml"))):
            return "text"
        return None

    @staticmethod
    def _encoding(response: httpx2.Response) -> str:
        name = response.charset_encoding or "utf-8"
        try:
            return codecs.lookup(name).name
        except LookupError:
            return "utf-8"

    def _render(self, title: str, text: str, cut: bool) -> str:
        limit = self.settings.max_page_chars
        total = len(text)
        notes = []
        if total > limit:
            text = text[:limit]
            notes.append(f"[truncated: {limit} of {total} characters shown]")
        if cut:
            notes.append(f"[download stopped at {self.settings.max_page_bytes} bytes; the page "
                         "is longer]")
        if not text.strip():
            text = "(the page has no text)"
        first_line = text.lstrip().split("\n", 1)[0]
        if not title or _collapse(first_line.lstrip("#")) == title:
            out = text  # the page starts with its title already
        else:
            out = f"{title}\n\n{text}"
        return "\n".join([out, *notes])
