"""The ``web`` environment's tools (``cua_rollout.text.web``) against real HTTP servers on loopback:
the local web corpus server (``cua_rollout.text.web_corpus``) healthy, hanging, answering garbage
and failing, and small stand-ins of the serper.dev and Brave Search APIs that check the
request's shape (key header, body, query parameters) and answer in each API's documented
shape. No HTTP is mocked."""

from __future__ import annotations

import asyncio
import re
import shutil
import socket
import tempfile
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx2
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, RedirectResponse, Response, StreamingResponse
from pydantic import ValidationError

from cua_rollout.config import WebToolConfig
from cua_rollout.core.errors import ConfigError, ToolError
from cua_rollout.core.http import ThreadedServer
from cua_rollout.envs.tools import Tool
from cua_rollout.text.web import (
    AddressPolicy,
    CorpusSearch,
    FetchTool,
    SearchTool,
    html_to_text,
    make_client,
    make_search_backend,
)
from cua_rollout.text.web_corpus import WebCorpus, WebCorpusServer

VOLCANO = """<!doctype html>
<html><head><title>Mount Erebus</title>
<style>body { color: STYLEMARKER; }</style>
<script>var SCRIPTMARKER = 1;</script></head>
<body><nav><a href="/">Home</a></nav>
<h1>Mount Erebus</h1>
<p>Erebus is the southernmost active volcano on Earth, on Ross Island in Antarctica.</p>
<p>It holds a persistent <b>lava lake</b>.</p>
<ul><li>Height: 3,794 m</li><li>First ascent: 1908</li></ul>
<noscript>NOSCRIPTMARKER</noscript>
</body></html>"""

PAGES = {
    "volcano.html": VOLCANO,
    "notes/tea.md": "# Green tea\n\nGreen tea is made from unoxidized leaves of Camellia.\n",
    "plain.txt": "Plain page title\nThe quick brown fox jumps over the lazy dog.\n",
    "big.html": "<html><head><title>Big page</title></head><body>"
                + "".join(f"<p>Paragraph {i} of the enormous page about nothing.</p>"
                          for i in range(2000)) + "</body></html>",
    **{f"rivers/river{i}.txt": f"River {i}\nThe river number {i} flows into the sea.\n"
       for i in range(6)},
}


@pytest.fixture(scope="module")
def corpus_root() -> Iterator[Path]:
    base = Path(tempfile.mkdtemp(prefix="cua-web-"))
    (base / "secret.txt").write_text("TOP SECRET outside the corpus\n")
    root = base / "corpus"
    for rel, text in PAGES.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    (root / ".hidden.txt").write_text("hidden page\n")
    (root / "image.png").write_bytes(b"\x89PNG not a page")
    try:
        yield root
    finally:
        shutil.rmtree(base, ignore_errors=True)


@pytest.fixture(scope="module")
def corpus(corpus_root: Path) -> WebCorpus:
    return WebCorpus(corpus_root)


@pytest.fixture(scope="module")
def server(corpus: WebCorpus) -> Iterator[WebCorpusServer]:
    with WebCorpusServer(corpus) as srv:
        yield srv


@pytest.fixture(scope="module")
def faulty(corpus: WebCorpus) -> Iterator[WebCorpusServer]:
    """A second server whose fault each test sets (and the fixture clears)."""
    with WebCorpusServer(corpus) as srv:
        yield srv


@pytest.fixture
def fault(faulty: WebCorpusServer) -> Iterator[WebCorpusServer]:
    yield faulty
    faulty.fault = None


@pytest.fixture
async def client() -> AsyncIterator[httpx2.AsyncClient]:
    c = make_client(WebToolConfig(allow_hosts=("127.0.0.1",)))  # the test servers
    try:
        yield c
    finally:
        await c.aclose()


def settings(url: str, **kw: Any) -> WebToolConfig:
    return WebToolConfig(backend=kw.pop("backend", "corpus"), search_url=url, **kw)


def entries(reply: str) -> list[str]:
    return [block for block in reply.split("\n\n") if block.startswith("[")]


# --------------------------------------------------------------------------- the corpus


def test_the_corpus_reads_pages_titles_and_skips_the_rest(corpus: WebCorpus) -> None:
    assert sorted(corpus.pages) == sorted(PAGES)  # no hidden file, no image
    assert corpus.page("volcano.html").title == "Mount Erebus"
    assert corpus.page("notes/tea.md").title == "Green tea"
    assert corpus.page("plain.txt").title == "Plain page title"
    assert "SCRIPTMARKER" not in corpus.page("volcano.html").text


def test_a_missing_or_empty_corpus_is_a_config_error(tmp: Path) -> None:
    with pytest.raises(ConfigError, match="not a directory"):
        WebCorpus(tmp / "nowhere")
    with pytest.raises(ConfigError, match=r"no \.html"):
        WebCorpus(tmp)


def test_html_to_text_keeps_blocks_lists_and_pre() -> None:
    title, text = html_to_text(
        "<title> A  title </title><p>one <i>two</i></p><ul><li>x</li><li>y</li></ul>"
        "<pre>  keep\n    indent</pre><table><tr><td>a</td><td>b</td></tr></table>"
        "<script>gone()</script><style>.gone{}</style>")
    assert title == "A title"
    assert text == "one two\n\n- x\n- y\n\n  keep\n    indent\n\na | b"


def test_pages_outside_the_corpus_are_not_served(server: WebCorpusServer,
                                                 corpus_root: Path) -> None:
    with httpx2.Client() as c:
        for path in ("/pages/%2e%2e/secret.txt", "/pages/..%2fsecret.txt",
                     f"/pages/{corpus_root.parent / 'secret.txt'}", "/pages/.hidden.txt",
                     "/pages/image.png"):
            reply = c.get(server.url + path)
            assert reply.status_code == 404, path
            assert "TOP SECRET" not in reply.text
        ok = c.get(server.page_url("notes/tea.md"))
        assert ok.status_code == 200 and ok.headers["content-type"].startswith("text/plain")


# --------------------------------------------------------------------------- search


async def test_search_returns_the_planted_page_first(server: WebCorpusServer,
                                                     client: httpx2.AsyncClient) -> None:
    tool = SearchTool(settings(server.url), client=client)
    assert isinstance(tool, Tool)
    reply = await tool({"query": "southernmost active volcano"})
    first = entries(reply)[0]
    assert first.startswith(f"[1] Mount Erebus — {server.url}/pages/volcano.html\n")
    assert "southernmost active volcano" in first
    await tool.close()
    assert not client.is_closed  # not its client


async def test_top_k_is_honoured(server: WebCorpusServer, client: httpx2.AsyncClient) -> None:
    tool = SearchTool(settings(server.url, top_k=2), client=client)
    assert len(entries(await tool({"query": "river sea"}))) == 2
    reply = await tool({"query": "river sea", "top_k": 4})
    assert [e[:3] for e in entries(reply)] == ["[1]", "[2]", "[3]", "[4]"]
    assert server.requests[-1].endswith("k=4")
    assert await tool({"query": "zyzzyva"}) == "(no results)"


@pytest.mark.parametrize(("arguments", "message"), [
    ({}, "missing required argument"),
    ({"query": 5}, "query must be a string"),
    ({"query": "lava", "top_k": "3"}, "top_k must be a integer"),
    ({"query": "lava", "top_k": 0}, "at least 1"),
    ({"query": "   "}, "query is empty"),
    ({"query": "lava", "site": "x"}, "unknown argument"),
    ("lava", "must be a JSON object"),
])
async def test_bad_search_arguments_are_told_to_the_model(
        server: WebCorpusServer, client: httpx2.AsyncClient, arguments: Any,
        message: str) -> None:
    with pytest.raises(ToolError, match=message):
        await SearchTool(settings(server.url), client=client)(arguments)


# --------------------------------------------------------------------------- fetch


async def test_fetch_reads_html_without_scripts_and_styles(
        server: WebCorpusServer, client: httpx2.AsyncClient) -> None:
    reply = await FetchTool(WebToolConfig(), client=client)(
        {"url": server.page_url("volcano.html")})
    assert reply.startswith("Mount Erebus\n\n")
    assert "Erebus is the southernmost active volcano on Earth" in reply
    assert "- Height: 3,794 m" in reply
    assert "It holds a persistent lava lake." in reply
    for marker in ("SCRIPTMARKER", "STYLEMARKER", "NOSCRIPTMARKER", "<p>"):
        assert marker not in reply
    assert "truncated" not in reply


async def test_fetch_reads_plain_text_and_markdown(server: WebCorpusServer,
                                                   client: httpx2.AsyncClient) -> None:
    fetch = FetchTool(WebToolConfig(), client=client)
    assert await fetch({"url": server.page_url("plain.txt")}) == (
        "Plain page title\nThe quick brown fox jumps over the lazy dog.")
    tea = await fetch({"url": server.page_url("notes/tea.md")})
    assert tea.startswith("# Green tea") and "Camellia" in tea


async def test_a_big_page_is_truncated_not_refused(server: WebCorpusServer,
                                                   client: httpx2.AsyncClient) -> None:
    reply = await FetchTool(WebToolConfig(max_page_chars=1000), client=client)(
        {"url": server.page_url("big.html")})
    body, note = reply.rsplit("\n", 1)
    total = int(note.split(" of ")[1].split()[0])
    assert note == f"[truncated: 1000 of {total} characters shown]" and total > 50_000
    assert body.startswith("Big page\n\nParagraph 0 of") and len(body) < 1100
    # The download stops at max_page_bytes, and says so.
    capped = await FetchTool(WebToolConfig(max_page_bytes=5000), client=client)(
        {"url": server.page_url("big.html")})
    assert capped.endswith("[download stopped at 5000 bytes; the page is longer]")
    assert "Paragraph 1999" not in capped


async def test_an_unknown_page_is_a_404_tool_error(server: WebCorpusServer,
                                                   client: httpx2.AsyncClient) -> None:
    with pytest.raises(ToolError, match=r"answered HTTP 404: no such page: nope\.html"):
        await FetchTool(WebToolConfig(), client=client)({"url": server.page_url("nope.html")})


@pytest.mark.parametrize(("url", "message"), [
    ("file:///etc/passwd", "file: URLs are not allowed"),
    ("ftp://ftp.example.org/file.txt", "ftp: URLs are not allowed"),
    ("data:text/plain,hello", "data: URLs are not allowed"),
    ("javascript:alert(1)", "javascript: URLs are not allowed"),
    ("example.com/page", "not an absolute URL"),
    ("http://", "no host"),
    ("http://exa mple.com/", "invalid URL"),
    ("http://127.0.0.1:99999/", "invalid URL"),
    ("", "url is empty"),
])
async def test_disallowed_schemes_and_invalid_urls(client: httpx2.AsyncClient, url: str,
                                                   message: str) -> None:
    with pytest.raises(ToolError, match=message):
        await FetchTool(WebToolConfig(), client=client)({"url": url})


async def test_bad_fetch_arguments(client: httpx2.AsyncClient) -> None:
    fetch = FetchTool(WebToolConfig(), client=client)
    with pytest.raises(ToolError, match="missing required argument"):
        await fetch({})
    with pytest.raises(ToolError, match="url must be a string"):
        await fetch({"url": 1})


def free_port() -> int:
    """A loopback port nothing listens on (bound, then closed)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def test_an_unreachable_host_is_a_tool_error(client: httpx2.AsyncClient) -> None:
    port = free_port()
    with pytest.raises(ToolError, match=f"could not load http://127.0.0.1:{port}/: Connect"):
        await FetchTool(WebToolConfig(), client=client)({"url": f"http://127.0.0.1:{port}/"})
    with pytest.raises(ToolError, match="search backend could not be reached: Connect"):
        await SearchTool(settings(f"http://127.0.0.1:{port}"), client=client)({"query": "x"})


# --------------------------------------------------------------------------- faults


async def test_a_hanging_server_fails_the_call_at_the_timeout(
        corpus: WebCorpus, client: httpx2.AsyncClient) -> None:
    srv = WebCorpusServer(corpus, fault="hang").start()
    try:
        timeout = 1.0
        web = settings(srv.url, request_timeout_s=timeout)
        for call, args, message in (
                (SearchTool(web, client=client), {"query": "lava"},
                 "search backend did not answer within 1 s"),
                (FetchTool(web, client=client), {"url": srv.page_url("plain.txt")},
                 f"{srv.page_url('plain.txt')} did not answer within 1 s")):
            started = time.monotonic()
            with pytest.raises(ToolError, match=message):
                await call(args)
            assert timeout - 0.1 < time.monotonic() - started < timeout + 3
        # Another request is hanging as the server stops: the stop is still prompt.
        pending = asyncio.ensure_future(client.get(srv.url + "/search?q=lava", timeout=30))
        await asyncio.sleep(0.3)
    finally:
        started = time.monotonic()
        await asyncio.to_thread(srv.stop)
        assert time.monotonic() - started < 3
    reply = await pending
    assert reply.status_code == 503


async def test_a_server_dripping_bytes_is_cut_at_the_total_deadline(
        stub: Stub, client: httpx2.AsyncClient) -> None:
    """httpx2's read timeout restarts with every chunk; the tool's deadline does not."""
    started = time.monotonic()
    with pytest.raises(ToolError, match="did not answer within 1 s"):
        await FetchTool(WebToolConfig(request_timeout_s=1.0), client=client)(
            {"url": stub.url + "/drip"})
    assert time.monotonic() - started < 4


async def test_faults_toggle_at_run_time(fault: WebCorpusServer,
                                         client: httpx2.AsyncClient) -> None:
    tool = SearchTool(settings(fault.url), client=client)
    fault.fault = "error:503"
    with pytest.raises(ToolError, match="answered HTTP 503: injected fault"):
        await tool({"query": "lava"})
    fault.fault = None
    assert entries(await tool({"query": "lava"}))[0].startswith("[1] Mount Erebus")
    with pytest.raises(ValueError, match="unknown fault"):
        fault.fault = "explode"


async def test_a_500_is_a_tool_error_with_the_body(fault: WebCorpusServer,
                                                   client: httpx2.AsyncClient) -> None:
    fault.fault = "error"
    with pytest.raises(ToolError, match=r"^search backend answered HTTP 500: injected fault"):
        await SearchTool(settings(fault.url), client=client)({"query": "lava"})
    with pytest.raises(ToolError, match=r"answered HTTP 500: injected fault: HTTP 500$"):
        await FetchTool(WebToolConfig(), client=client)({"url": fault.page_url("plain.txt")})


@pytest.mark.parametrize(("kind", "why"), [
    ("not_json", "Unterminated string"),
    ("bytes", "not UTF-8"),
    ("shape", 'expected {"results"'),
    ("content_type", "content type text/html, not application/json"),
])
async def test_garbage_search_replies_are_malformed_tool_errors(
        fault: WebCorpusServer, client: httpx2.AsyncClient, kind: str, why: str) -> None:
    fault.fault = f"garbage:{kind}"
    with pytest.raises(ToolError, match=f"^search backend returned malformed JSON: .*{why}"):
        await SearchTool(settings(fault.url), client=client)({"query": "lava"})


@pytest.mark.parametrize(("kind", "message"), [
    ("bytes", "is application/octet-stream content, not a text page"),
    ("content_type", "is image/png content, not a text page"),
])
async def test_garbage_pages_are_refused(fault: WebCorpusServer, client: httpx2.AsyncClient,
                                         kind: str, message: str) -> None:
    fault.fault = f"garbage:{kind}"
    with pytest.raises(ToolError, match=message):
        await FetchTool(WebToolConfig(), client=client)({"url": fault.page_url("plain.txt")})


# --------------------------------------------------------------------------- a stub of the
# real APIs, and of misbehaving web servers


class Stub(ThreadedServer):
    """serper.dev's ``POST /search`` and Brave's ``GET /res/v1/web/search``, each checking
    the request as the API's documentation describes it, plus pages that redirect, drip and
    are not text."""

    KEY = "k-123-secret"

    def __init__(self) -> None:
        self.calls: list[dict[str, Any]] = []
        self.status = 200
        app = FastAPI()

        @app.post("/search")
        async def serper(request: Request) -> Response:
            body = await request.json()
            self.calls.append({"headers": dict(request.headers), "body": body})
            if request.headers.get("x-api-key") != self.KEY or self.status == 401:
                return JSONResponse({"message": "Unauthorized.", "statusCode": 401},
                                    status_code=401)
            assert request.headers["content-type"] == "application/json"
            assert set(body) == {"q", "num"}
            organic: list[Any] = [{"title": f"Result {i} about {body['q']}",
                                   "link": f"https://example.org/{i}",
                                   "snippet": f"Snippet {i}.", "position": i}
                                  for i in range(1, 11)]
            if body["q"] == "odd":
                organic[1] = {"title": "an entry without a link", "position": 2}
            return JSONResponse({"searchParameters": {"q": body["q"], "type": "search"},
                                 "organic": organic[:body["num"]], "credits": 1})

        @app.get("/res/v1/web/search")
        async def brave(request: Request) -> Response:
            params = dict(request.query_params)
            self.calls.append({"headers": dict(request.headers), "params": params})
            if request.headers.get("x-subscription-token") != self.KEY:
                return JSONResponse({"type": "ErrorResponse", "error": {
                    "status": 422, "code": "SUBSCRIPTION_TOKEN_INVALID",
                    "detail": "The provided subscription token is invalid."}},
                    status_code=422)
            assert request.headers["accept"] == "application/json"
            results = [{"title": f"Brave &amp; result {i}", "url": f"https://brave.example/{i}",
                        "description": f"About <strong>{params['q']}</strong> number {i}.",
                        "type": "search_result"} for i in range(1, 21)]
            return JSONResponse({"type": "search", "query": {"original": params["q"]},
                                 "web": {"type": "search",
                                         "results": results[:int(params["count"])]}})

        @app.get("/redirect/{n}")
        async def redirect(n: int) -> Response:
            return RedirectResponse("/plain" if n == 0 else f"/redirect/{n - 1}")

        @app.get("/to-file")
        async def to_file() -> Response:
            return RedirectResponse("file:///etc/passwd")

        @app.get("/to")
        async def to(url: str) -> Response:
            return RedirectResponse(url)

        @app.get("/plain")
        async def plain() -> Response:
            return Response("Arrived\nafter redirects", media_type="text/plain")

        @app.get("/nul")
        async def nul() -> Response:
            return Response(b"text\x00\x01\x02binary", media_type="text/plain")

        @app.get("/bare")
        async def bare() -> Response:  # no content type: the tool looks at the bytes
            return Response(b"<!DOCTYPE html><title>Bare</title><p>sniffed as HTML</p>")

        @app.get("/drip")
        async def drip() -> Response:
            async def chunks() -> AsyncIterator[bytes]:
                yield b"<html><body>"
                for _ in range(100):  # 20 s at most
                    await asyncio.sleep(0.2)
                    yield b"<p>more</p>"

            return StreamingResponse(chunks(), media_type="text/html")

        super().__init__(app)


@pytest.fixture(scope="module")
def stub() -> Iterator[Stub]:
    srv = Stub()
    srv.start()
    try:
        yield srv
    finally:
        srv.stop()


async def test_serper_backend_sends_the_documented_request(
        stub: Stub, client: httpx2.AsyncClient, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TEST_SERPER_KEY", Stub.KEY)
    web = settings(stub.url + "/search", backend="serper", api_key_env="TEST_SERPER_KEY")
    reply = await SearchTool(web, client=client)({"query": "lava lake", "top_k": 3})
    call = stub.calls[-1]
    assert call["headers"]["x-api-key"] == Stub.KEY
    assert call["body"] == {"q": "lava lake", "num": 3}
    assert entries(reply) == [f"[{i}] Result {i} about lava lake — https://example.org/{i}\n"
                              f"Snippet {i}." for i in (1, 2, 3)]
    assert Stub.KEY not in reply


async def test_brave_backend_sends_the_documented_request(
        stub: Stub, client: httpx2.AsyncClient, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TEST_BRAVE_KEY", Stub.KEY)
    web = settings(stub.url + "/res/v1/web/search", backend="brave",
                   api_key_env="TEST_BRAVE_KEY", top_k=2)
    reply = await SearchTool(web, client=client)({"query": "lava"})
    call = stub.calls[-1]
    assert call["headers"]["x-subscription-token"] == Stub.KEY
    assert call["params"] == {"q": "lava", "count": "2"}
    assert entries(reply) == ["[1] Brave & result 1 — https://brave.example/1\n"
                              "About lava number 1.",
                              "[2] Brave & result 2 — https://brave.example/2\n"
                              "About lava number 2."]


@pytest.mark.parametrize(("backend", "path", "status"), [
    ("serper", "/search", "HTTP 401"), ("brave", "/res/v1/web/search", "HTTP 422")])
async def test_a_rejected_key_stops_the_run_naming_the_variable(
        stub: Stub, client: httpx2.AsyncClient, monkeypatch: pytest.MonkeyPatch,
        backend: str, path: str, status: str) -> None:
    monkeypatch.setenv("TEST_SEARCH_KEY", "wrong")
    web = settings(stub.url + path, backend=backend, api_key_env="TEST_SEARCH_KEY")
    with pytest.raises(ConfigError, match=rf"{backend} rejected the API key in "
                                          rf"\$TEST_SEARCH_KEY \({status}\)"):
        await SearchTool(web, client=client)({"query": "lava"})


async def test_odd_entries_of_a_real_api_are_skipped(
        stub: Stub, client: httpx2.AsyncClient, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TEST_SERPER_KEY", Stub.KEY)
    web = settings(stub.url + "/search", backend="serper", api_key_env="TEST_SERPER_KEY")
    reply = await SearchTool(web, client=client)({"query": "odd", "top_k": 3})
    assert [e.split(" — ")[1].split("\n")[0] for e in entries(reply)] == [
        "https://example.org/1", "https://example.org/3"]


@pytest.mark.parametrize("backend", ["serper", "brave"])
def test_a_missing_key_variable_is_a_config_error_naming_it(
        backend: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("NO_SUCH_SEARCH_KEY", raising=False)
    with pytest.raises(ConfigError, match="NO_SUCH_SEARCH_KEY is not set"):
        make_search_backend(WebToolConfig(backend=backend, api_key_env="NO_SUCH_SEARCH_KEY"))
    with pytest.raises(ValidationError, match="api_key_env"):  # the config refuses it
        WebToolConfig(backend=backend)


def test_unknown_backend_and_missing_corpus_url_are_config_errors() -> None:
    with pytest.raises(ValidationError, match="backend"):  # the config refuses it
        WebToolConfig(backend="bing", search_url="http://x")
    with pytest.raises(ConfigError, match="search_url"):
        make_search_backend(WebToolConfig(backend="corpus"))


async def test_redirects_are_followed_checked_and_bounded(stub: Stub,
                                                          client: httpx2.AsyncClient) -> None:
    fetch = FetchTool(WebToolConfig(max_redirects=3), client=client)
    # /redirect/n answers n + 1 redirects.
    assert await fetch({"url": stub.url + "/redirect/2"}) == "Arrived\nafter redirects"
    with pytest.raises(ToolError, match=r"/redirect/3 redirected more than 3 times"):
        await fetch({"url": stub.url + "/redirect/3"})
    with pytest.raises(ToolError, match="file: URLs are not allowed"):
        await fetch({"url": stub.url + "/to-file"})


async def test_a_page_without_a_content_type_is_sniffed(stub: Stub,
                                                        client: httpx2.AsyncClient) -> None:
    assert await FetchTool(WebToolConfig(), client=client)({"url": stub.url + "/bare"}) == (
        "Bare\n\nsniffed as HTML")


async def test_binary_labelled_text_is_refused(stub: Stub, client: httpx2.AsyncClient) -> None:
    with pytest.raises(ToolError, match="binary content labelled text/plain"):
        await FetchTool(WebToolConfig(), client=client)({"url": stub.url + "/nul"})


async def test_a_tool_without_a_client_owns_and_closes_its_own(server: WebCorpusServer) -> None:
    search = SearchTool(settings(server.url))
    fetch = FetchTool(settings(server.url))
    assert entries(await search({"query": "volcano"}))
    assert (await fetch({"url": server.page_url("plain.txt")})).startswith("Plain page")
    for tool in (search, fetch):
        await tool.close()
        await tool.close()  # twice is fine
    assert isinstance(search.backend, CorpusSearch) and search.backend.client.is_closed
    assert fetch.client.is_closed


# --------------------------------------------------------------------------- addresses


@pytest.mark.parametrize(("address", "kind"), [
    ("127.0.0.1", "a loopback"), ("127.8.9.10", "a loopback"), ("::1", "a loopback"),
    ("10.0.0.1", "a private"), ("172.16.5.4", "a private"), ("192.168.1.1", "a private"),
    ("169.254.169.254", "a link-local"), ("fe80::1", "a link-local"),
    ("0.0.0.0", "an unspecified"), ("::", "an unspecified"), ("224.0.0.1", "a multicast"),
    ("ff02::1", "a multicast"), ("fd00::1", "a private"), ("100.64.0.1", "a non-public"),
    ("240.0.0.1", "a reserved"),
    # IPv6 spellings of IPv4 addresses: mapped, 6to4, NAT64
    ("::ffff:127.0.0.1", "a loopback"), ("::ffff:10.1.2.3", "a private"),
    ("2002:7f00:1::", "a loopback"), ("64:ff9b::a9fe:a9fe", "a link-local"),
])
def test_non_public_addresses_are_refused_by_default(address: str, kind: str) -> None:
    why = AddressPolicy().refusal("some.host", 80, address)
    assert why is not None and f"is {kind} address" in why and "allow_hosts" in why


@pytest.mark.parametrize("address", ["8.8.8.8", "93.184.216.34", "2001:4860:4860::8888",
                                     "::ffff:8.8.8.8", "64:ff9b::808:808"])
def test_public_addresses_are_allowed(address: str) -> None:
    assert AddressPolicy().refusal("some.host", 443, address) is None


def test_allow_hosts_by_name_address_port_and_network() -> None:
    policy = AddressPolicy(["intranet.lab", "10.1.0.0/16", "127.0.0.1:8080", "[::1]:9000",
                            "Wiki.Local:81"], search_url="http://127.0.0.1:7000/api")
    assert policy.refusal("intranet.lab", 1234, "10.9.9.9") is None  # the name, any port
    assert policy.refusal("other.lab", 80, "10.1.200.3") is None  # in the network
    assert policy.refusal("other.lab", 80, "10.2.0.1") is not None
    assert policy.refusal("127.0.0.1", 8080, "127.0.0.1") is None
    assert policy.refusal("127.0.0.1", 8081, "127.0.0.1") is not None  # another port
    assert policy.refusal("::1", 9000, "::1") is None
    assert policy.refusal("wiki.local", 81, "192.168.0.2") is None  # case-insensitive
    assert policy.refusal("127.0.0.1", 7000, "127.0.0.1") is None  # search_url's host:port
    assert policy.refusal("127.0.0.1", 7001, "127.0.0.1") is not None


@pytest.mark.parametrize("entry", ["bad host", "host:0", "host:99999", "host:http", "",
                                   "-x.lab", "a/b"])
def test_a_malformed_allow_hosts_entry_is_a_config_error(entry: str) -> None:
    with pytest.raises(ConfigError, match=r"text\.web\.allow_hosts"):
        AddressPolicy([entry])


def test_a_malformed_allow_hosts_entry_fails_the_config_naming_it() -> None:
    from cua_rollout.config import Config

    with pytest.raises(ValueError, match=r"allow_hosts.*'bad host'"):
        Config.model_validate({"text": {"web": {"allow_hosts": ["ok.lab", "bad host"]}}})


async def test_fetch_reaches_only_public_addresses_and_its_search_servers_port(
        server: WebCorpusServer, faulty: WebCorpusServer) -> None:
    """A default client: the corpus server is reached on its own port only; loopback by name,
    the other server's port, link-local and private addresses are refused before connecting,
    naming why; ``allow_private`` lets them through."""
    guarded = FetchTool(settings(server.url))
    try:
        assert (await guarded({"url": server.page_url("plain.txt")})).startswith("Plain page")
        other = faulty.page_url("plain.txt")
        refused = {
            other: "127.0.0.1 is a loopback address",
            other.replace("127.0.0.1", "localhost"): "localhost (127.0.0.1) is a loopback",
            "http://169.254.169.254/latest/meta-data/": "is a link-local address",
            "http://10.255.0.1:8000/": "is a private address",
            "http://[::ffff:127.0.0.1]:1/": "is a loopback address",
        }
        for url, why in refused.items():
            started = time.monotonic()
            with pytest.raises(ToolError, match=rf"could not load .*{re.escape(why)}.*allow_hosts"):
                await guarded({"url": url})
            assert time.monotonic() - started < 2.0  # refused, not timed out
    finally:
        await guarded.close()
    open_ = FetchTool(WebToolConfig(allow_private=True))
    try:
        assert (await open_({"url": faulty.page_url("plain.txt")})).startswith("Plain page")
    finally:
        await open_.close()


async def test_a_redirect_to_a_private_address_is_refused_at_that_hop(
        stub: Stub, server: WebCorpusServer) -> None:
    fetch = FetchTool(WebToolConfig(allow_hosts=(f"127.0.0.1:{stub.port}",)))
    try:
        assert await fetch({"url": stub.url + "/redirect/0"}) == "Arrived\nafter redirects"
        target = server.page_url("plain.txt")  # same address, a port not allowed
        with pytest.raises(ToolError, match=rf"could not load .*{server.port}.*loopback"):
            await fetch({"url": f"{stub.url}/to?url={target}"})
        with pytest.raises(ToolError, match="link-local"):
            await fetch({"url": f"{stub.url}/to?url=http://169.254.169.254/"})
    finally:
        await fetch.close()
