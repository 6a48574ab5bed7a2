"""A local web: a directory of pages (:class:`WebCorpus`) served over real HTTP on loopback
(:class:`WebCorpusServer`) with a search API, for the ``web`` environment's tests and its
offline demo (``text.web.serve_corpus: <dir>`` makes run.py start one and point the ``corpus``
backend at it).

Pages are the directory's ``.html``/``.htm``, ``.md`` and ``.txt`` files, found recursively
(hidden files and directories skipped, symlinks that lead outside the directory ignored). A
page's title is its ``<title>`` (else its first heading) for HTML, its first ``#`` heading for
Markdown, its first line for text; its searchable text is what ``cua_rollout.text.web``'s
``fetch`` would show the model (HTML through the same converter).

Routes:

- ``GET /search?q=...&k=5``: ``{"results": [{"title", "url", "snippet"}]}``, the pages
  ranked by Okapi BM25 over title and text; ``url`` is the page's absolute URL on this
  server, ``/pages/<relative path>``; ``snippet`` is the passage with the query's rarest words.
- ``GET /pages/<path>``: the page as stored (``text/html`` or ``text/plain``); 404 for
  any path that is not a page of the corpus, so ``..`` and absolute paths reach nothing
  (pages are looked up in the index, never joined onto the directory).

Faults for tests, set at construction or at run time (``server.fault = ...``), apply to both
routes: ``"hang"`` (the request is accepted and never answered, until the fault is cleared or
the server stops: a stop returns within about a second), ``"garbage"`` / ``"garbage:<kind>"``
(200 with a body that is not a valid reply; kinds: ``not_json``, ``bytes``, ``shape``,
``content_type``), ``"error"`` / ``"error:<status>"`` (HTTP 500 by default, or e.g. 503).

Search is Okapi BM25 over the pages' title and text (``cua_rollout.text.bm25``).

Run ``python -m cua_rollout.text.web_corpus DIR [--port N]`` to serve a directory by hand.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response

from cua_rollout.core.errors import ConfigError, ToolUnavailable
from cua_rollout.core.http import ThreadedServer
from cua_rollout.text.bm25 import TOKEN_RE, BM25Index, tokens
from cua_rollout.text.web import html_to_text, plain_title

__all__ = [
    "FAULTS",
    "GARBAGE_KINDS",
    "PAGE_SUFFIXES",
    "CorpusHit",
    "CorpusPage",
    "WebCorpus",
    "WebCorpusServer",
    "main",
]

PAGE_SUFFIXES = {".html": "text/html", ".htm": "text/html", ".md": "text/plain",
                 ".txt": "text/plain"}
FAULTS = ("hang", "garbage", "error")
GARBAGE_KINDS = ("not_json", "bytes", "shape", "content_type")
MAX_K = 50
SNIPPET_CHARS = 240


@dataclass(frozen=True)
class CorpusPage:
    """One page: ``path`` relative to the corpus root (``/``-separated); ``body`` is what is
    served, in UTF-8 (a file that is not UTF-8 is read as Windows-1252)."""

    path: str
    title: str
    text: str
    media_type: str
    body: bytes


@dataclass(frozen=True)
class CorpusHit:
    page: CorpusPage
    score: float
    snippet: str


class WebCorpus:
    """The pages of a directory, with a BM25 index over their title and text. Pages are read
    once, at construction (edits afterwards are not seen)."""

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root).expanduser()
        if not self.root.is_dir():
            raise ConfigError(f"text.web.serve_corpus: {self.root} is not a directory")
        self.pages: dict[str, CorpusPage] = {}
        try:
            for path in self._files():
                page = self._load(path)
                self.pages[page.path] = page
        except OSError as exc:
            raise ToolUnavailable(f"the web corpus {self.root} cannot be read: {exc}") from exc
        if not self.pages:
            raise ConfigError(f"text.web.serve_corpus: no {', '.join(PAGE_SUFFIXES)} pages "
                              f"under {self.root}")
        self._order = sorted(self.pages)
        self._index = BM25Index(f"{self.pages[name].title}\n{self.pages[name].text}"
                                for name in self._order)

    def _files(self) -> list[Path]:
        root = self.root.resolve()
        found = []
        for folder, dirs, files in os.walk(root):
            dirs[:] = sorted(d for d in dirs if not d.startswith("."))
            for name in sorted(files):
                path = Path(folder) / name
                if name.startswith(".") or path.suffix.lower() not in PAGE_SUFFIXES:
                    continue
                if not path.resolve().is_relative_to(root) or not path.is_file():
                    continue  # a symlink leading out of the corpus
                found.append(path)
        return found

    def _load(self, path: Path) -> CorpusPage:
        raw = path.read_bytes()
        try:
            decoded = raw.decode("utf-8")
        except UnicodeDecodeError:  # an older page: Windows-1252, a superset of Latin-1
            decoded = raw.decode("cp1252", errors="replace")
        body = decoded.encode("utf-8")  # served as UTF-8, whatever it was stored as
        rel = path.relative_to(self.root.resolve()).as_posix()
        suffix = path.suffix.lower()
        media = PAGE_SUFFIXES[suffix]
        if media == "text/html":
            title, text = html_to_text(decoded)
        else:
            text = decoded.strip()
            title = plain_title(text, markdown=suffix == ".md")
        return CorpusPage(path=rel, title=title or path.stem, text=text, media_type=media,
                          body=body)

    def __len__(self) -> int:
        return len(self.pages)

    def page(self, path: str) -> CorpusPage | None:
        return self.pages.get(path)

    def idf(self, term: str) -> float:
        return self._index.idf(term)

    def search(self, query: str, k: int = 5) -> list[CorpusHit]:
        """The ``k`` best pages for ``query`` by BM25 (pages matching none of its words are
        left out; ties in path order)."""
        terms = set(tokens(query))
        hits = []
        for doc, score in self._index.search(query, k):
            page = self.pages[self._order[doc]]
            hits.append(CorpusHit(page, score, self.snippet(page, terms)))
        return hits

    def snippet(self, page: CorpusPage, terms: set[str]) -> str:
        """The line of the page whose query words weigh most (by idf), cut to a window of
        ``SNIPPET_CHARS`` around the first of them."""
        best_line, best_weight = "", -1.0
        for line in page.text.splitlines():
            line = line.strip()
            if not line:
                continue
            weight = sum(self.idf(t) for t in set(tokens(line)) & terms)
            if weight > best_weight:
                best_line, best_weight = line, weight
        line = " ".join(best_line.split())
        if len(line) <= SNIPPET_CHARS:
            return line
        first = min((m.start() for m in TOKEN_RE.finditer(line)
                     if m.group().casefold() in terms), default=0)
        start = max(0, min(first - SNIPPET_CHARS // 4, len(line) - SNIPPET_CHARS))
        window = line[start:start + SNIPPET_CHARS]
        return ("..." if start else "") + window + ("..." if start + SNIPPET_CHARS < len(line)
                                                    else "")


def _parse_fault(fault: str | None) -> tuple[str | None, str]:
    if fault is None:
        return None, ""
    name, _, detail = fault.partition(":")
    if name == "hang" and not detail:
        return name, ""
    if name == "garbage" and (detail or "not_json") in GARBAGE_KINDS:
        return name, detail or "not_json"
    if name == "error" and (not detail or (detail.isdigit() and 400 <= int(detail) <= 599)):
        return name, detail or "500"
    raise ValueError(f"unknown fault {fault!r}: hang, garbage[:{'|'.join(GARBAGE_KINDS)}] "
                     "or error[:<status>]")


class WebCorpusServer(ThreadedServer):
    """A :class:`WebCorpus` over HTTP on loopback: ``/search`` and ``/pages/<path>``, with
    the faults of the module's docstring. ``requests`` records each request's path and query
    (``/search?q=...``) in order."""

    def __init__(self, corpus: WebCorpus | str | Path, *, fault: str | None = None,
                 host: str = "127.0.0.1", port: int = 0) -> None:
        self.corpus = corpus if isinstance(corpus, WebCorpus) else WebCorpus(corpus)
        self.fault = fault
        self.requests: list[str] = []
        self._stopping = threading.Event()
        super().__init__(self._build_app(), host=host, port=port)

    @property
    def fault(self) -> str | None:
        return self._fault

    @fault.setter
    def fault(self, value: str | None) -> None:
        _parse_fault(value)  # refuse an unknown one here, not at the next request
        self._fault = value

    def start(self, timeout_s: float = 10.0) -> WebCorpusServer:
        self._stopping.clear()
        super().start(timeout_s)
        return self

    def stop(self) -> None:
        self._stopping.set()  # releases hanging requests, so the stop is prompt
        super().stop()

    def __enter__(self) -> WebCorpusServer:
        return self.start()

    def page_url(self, path: str) -> str:
        return f"{self.url}/pages/{quote(path)}"

    async def _hang(self) -> bool:
        """Wait while the fault is ``hang``; True if the server is stopping."""
        while self._fault == "hang" and not self._stopping.is_set():
            await asyncio.sleep(0.05)
        return self._stopping.is_set()

    async def _faulty(self, route: str) -> Response | None:
        """The reply a fault dictates, or None to answer normally."""
        name, detail = _parse_fault(self._fault)
        if name == "hang":
            if await self._hang():
                return PlainTextResponse("server stopping", status_code=503)
            name, detail = _parse_fault(self._fault)  # cleared while hanging
        if name == "error":
            status = int(detail)
            if route == "search":
                return JSONResponse({"detail": f"injected fault: HTTP {status}"},
                                    status_code=status)
            return PlainTextResponse(f"injected fault: HTTP {status}", status_code=status)
        if name == "garbage":
            return self._garbage(route, detail)
        return None

    @staticmethod
    def _garbage(route: str, kind: str) -> Response:
        if route == "pages":
            if kind == "content_type":
                return Response(b"\x89PNG\r\n\x1a\n" + os.urandom(256), media_type="image/png")
            return Response(os.urandom(512), media_type="application/octet-stream")
        if kind == "not_json":
            return Response(b'{"results": [{"title": "cut off', media_type="application/json")
        if kind == "bytes":
            return Response(b"\xff\xfe\x00" + os.urandom(256), media_type="application/json")
        if kind == "shape":
            return JSONResponse({"hits": [{"name": "no url here"}]})
        return Response(b"<html><body><h1>Search</h1><p>Results: none</p></body></html>",
                        media_type="text/html")

    def _build_app(self) -> FastAPI:
        app = FastAPI(openapi_url=None, docs_url=None, redoc_url=None)

        @app.get("/search")
        async def search(request: Request) -> Response:
            self.requests.append(f"{request.url.path}?{request.url.query}")
            faulty = await self._faulty("search")
            if faulty is not None:
                return faulty
            query = request.query_params.get("q", "")
            try:
                k = int(request.query_params.get("k", "5"))
            except ValueError:
                return JSONResponse({"detail": "k must be an integer"}, status_code=400)
            if not query.strip():
                return JSONResponse({"detail": "q is required"}, status_code=400)
            hits = await asyncio.to_thread(self.corpus.search, query, min(max(k, 0), MAX_K))
            return JSONResponse({"results": [
                {"title": hit.page.title, "url": self.page_url(hit.page.path),
                 "snippet": hit.snippet} for hit in hits]})

        @app.get("/pages/{path:path}")
        async def page(path: str, request: Request) -> Response:
            self.requests.append(request.url.path)
            faulty = await self._faulty("pages")
            if faulty is not None:
                return faulty
            found = self.corpus.page(path)
            if found is None:
                return PlainTextResponse(f"no such page: {path}", status_code=404)
            return Response(found.body, media_type=f"{found.media_type}; charset=utf-8")

        return app


def main(argv: list[str] | None = None) -> None:
    """Serve a directory until interrupted."""
    parser = argparse.ArgumentParser(prog="python -m cua_rollout.text.web_corpus",
                                     description=main.__doc__)
    parser.add_argument("root", help="the directory of .html/.md/.txt pages")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0)
    args = parser.parse_args(argv)
    server = WebCorpusServer(args.root, host=args.host, port=args.port)
    with server:
        print(f"{len(server.corpus)} pages at {server.url}/search?q=... and "
              f"{server.url}/pages/<path>", flush=True)
        try:
            while True:
                time.sleep(3600)
        except KeyboardInterrupt:
            pass


if __name__ == "__main__":
    main()
