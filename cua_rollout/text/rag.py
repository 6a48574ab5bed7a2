"""The ``rag`` text environment's retrieval tool: dense search over a local corpus.

A corpus is a JSONL file of ``{"id", "title"?, "text"}`` passages or a directory of ``.txt`` /
``.md`` files. :meth:`Retriever.build` reads it, splits texts longer than ``chunk_chars`` at
paragraph, then sentence, then word boundaries (:func:`chunk_text`), embeds every chunk with a
real embedding model and puts the vectors in an exact inner-product index; unless the
retrieval is ``dense`` alone, it also indexes the chunks' words for BM25 (``bm25.py``), which
``hybrid`` (the default) combines with the dense score (:meth:`Retriever.search`). The build is
synchronous and CPU-bound: an actor runs it once per process through :func:`shared_retriever`
(in a thread, ``asyncio.to_thread``) and every episode of that process shares the result.
:class:`RetrievalTool` is the ``retrieve`` tool the model calls (``cua_rollout.envs.tools.Tool``).

Why these dependencies (the ``text`` extra of pyproject.toml):

- **wordllama** ships its 256-dimension ``l2_supercat`` model *inside the wheel* (16 MB of
  float16 token vectors and the Llama-2 tokenizer, MIT): static embeddings distilled from
  Llama-2's token embeddings and trained contrastively on sentence pairs, so synonyms and
  paraphrases land close, yet a text's vector is the mean of its token vectors. Nothing is
  downloaded at run time, it needs no torch, it loads in ~0.1 s and embeds ~3,000 passages of
  600 characters a second on 2 cores, where transformers (all-MiniLM-L6-v2 on torch, a 4-bit
  e5-small in C) did 7-11 a second on the same busy machine, for no better hits on the test's
  paraphrases. Its vectors are Matryoshka-trained, so the first 64 or 128 dimensions
  are a model too (``wordllama/l2_supercat_128``, ``_64``). We read the package's weight and
  tokenizer files directly (numpy, ``safetensors``, ``tokenizers``, which wordllama depends
  on) and pool as it does (the same vectors as its ``WordLlamaInference.embed(norm=True)``, to
  1e-7), without importing ``wordllama``: its ``WordLlama.load()`` (0.4.0) looks for the
  tokenizer in a ``tokenizer/`` folder while the wheel has it in ``tokenizers/``, and so
  downloads it from Hugging Face, and its import calls ``logging.basicConfig``, which would
  take over the root logger of the process.
- **faiss-cpu**: the best-kept vector index library (Meta's; frequent releases, 1.15 in
  2026). ``IndexFlatIP`` is an exact inner-product (cosine, on unit vectors) search: a query
  over 1e5 passages of 256 dimensions is ~25 M multiply-adds, ~5 ms, and 100 MB of memory,
  so no approximate index is needed at this scale (HNSW would be the next step). Concurrent
  searches on one index are safe and run without the GIL, and ``write_index``/``read_index``
  give the on-disk cache for free.

The cache (``cache_dir``) holds one index file per hash of what was embedded: the model's name
and package version, ``chunk_chars``, and every chunk's id, title and text. A changed corpus or
setting gives another hash and a fresh build; an unreadable cache file is rebuilt over.

Errors: a corpus that cannot be read (missing path, bad JSON line, a passage without text, no
passage at all) or an unknown model is a ``ConfigError`` naming the file and line; a missing
package is ``ToolUnavailable`` naming the extra to install; a bad call of the tool (empty query,
``top_k`` out of range) is a ``ToolError`` the model reads.

One file on purpose: the index's build, cache and search share one cache key and its
invalidation rules.
"""

from __future__ import annotations

import asyncio
import hashlib
import heapq
import importlib.metadata
import importlib.util
import json
import logging
import os
import re
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from cua_rollout.config import RAG_DEFAULT_MODEL, RAG_MAX_TOP_K, RAG_MODELS, RagToolConfig
from cua_rollout.core.errors import ConfigError, ToolError, ToolUnavailable
from cua_rollout.envs.tools import ToolSpec, check_arguments
from cua_rollout.text.bm25 import BM25Index

if TYPE_CHECKING:
    import numpy.typing as npt

__all__ = [
    "HYBRID_DEPTH",
    "Passage",
    "RetrievalTool",
    "Retriever",
    "chunk_text",
    "shared_retriever",
]

log = logging.getLogger(__name__)

HYBRID_DEPTH = 50
"""Candidates taken from each list (dense, BM25) that ``hybrid`` scores."""
_INSTALL_HINT = "pip install -e .[text]"
_CACHE_FORMAT = "rag-index-v1"
_EMBED_BATCH = 256  # texts per gather: ~256 x 300 tokens x 1 KiB of float32 at most
_TEXT_SUFFIXES = (".txt", ".md")


@dataclass(frozen=True)
class Passage:
    """One chunk of the corpus; ``score`` is how well it matches the query by the retriever's
    ranking (:meth:`Retriever.search`; 0 in the index itself)."""

    id: str
    title: str
    text: str
    score: float = 0.0


# --- chunking ---------------------------------------------------------------------------------

_PARAGRAPH_BREAK = re.compile(r"\n[ \t\r]*\n\s*")
_SENTENCE_END = re.compile(r"(?<=[.!?;:。！？])\s+")


def _split_long(text: str, limit: int, pattern: re.Pattern[str] | None) -> list[str]:
    """``text`` in pieces of at most ``limit`` characters: at ``pattern`` (sentence ends),
    else at whitespace, else cut."""
    if len(text) <= limit:
        return [text]
    if pattern is not None:
        parts = [p for p in pattern.split(text) if p]
        if len(parts) > 1:
            return [piece for part in parts for piece in _split_long(part, limit, None)]
    words = text.split()
    if len(words) > 1:
        return _pack([w for word in words for w in _split_long(word, limit, None)], " ", limit)
    return [text[i:i + limit] for i in range(0, len(text), limit)]


def _pack(pieces: Sequence[str], separator: str, limit: int) -> list[str]:
    """Consecutive pieces joined while the result stays within ``limit``."""
    chunks: list[str] = []
    current = ""
    for piece in pieces:
        if current and len(current) + len(separator) + len(piece) <= limit:
            current += separator + piece
        else:
            if current:
                chunks.append(current)
            current = piece
    if current:
        chunks.append(current)
    return chunks


def chunk_text(text: str, limit: int) -> list[str]:
    """``text`` as chunks of at most ``limit`` characters: whole paragraphs (separated by a
    blank line) packed together while they fit; a longer paragraph split at sentence ends and
    its sentences packed; a longer sentence split between words; a longer word cut. Empty
    paragraphs vanish; an empty text has no chunk."""
    chunks: list[str] = []
    current = ""
    for paragraph in _PARAGRAPH_BREAK.split(text.strip()):
        paragraph = paragraph.strip()
        if not paragraph:
            continue
        pieces = _split_long(paragraph, limit, _SENTENCE_END)
        if len(pieces) > 1:  # a long paragraph: its sentences packed, never with a neighbour
            if current:
                chunks.append(current)
                current = ""
            packed = _pack(pieces, " ", limit)
            chunks.extend(packed[:-1])
            current = packed[-1]
        elif current and len(current) + 2 + len(paragraph) <= limit:
            current += "\n\n" + paragraph
        else:
            if current:
                chunks.append(current)
            current = paragraph
    if current:
        chunks.append(current)
    return chunks


# --- reading the corpus -----------------------------------------------------------------------

def _read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path}: rag corpus is not UTF-8 text ({exc.reason} at byte "
                          f"{exc.start})") from exc
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read the rag corpus: {exc.strerror or exc}") from exc


def _read_jsonl(path: Path, limit: int) -> list[Passage]:
    passages: list[Passage] = []
    first_line: dict[str, int] = {}
    emitted: set[str] = set()
    for number, line in enumerate(_read_text(path).splitlines(), 1):
        if not line.strip():
            continue
        where = f"{path}:{number}"
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{where}: not valid JSON ({exc.msg}, column {exc.colno})") from exc
        if not isinstance(record, dict):
            raise ConfigError(f"{where}: expected a JSON object with id and text, got "
                              f"{type(record).__name__}")
        ident = record.get("id")
        if isinstance(ident, bool) or not isinstance(ident, str | int) or str(ident) == "":
            raise ConfigError(f"{where}: missing id (a non-empty string or an integer)")
        ident = str(ident)
        text = record.get("text")
        if not isinstance(text, str) or not text.strip():
            raise ConfigError(f"{where}: passage {ident!r} has no text (a non-empty string)")
        title = record.get("title", "")
        if title is None:
            title = ""
        if not isinstance(title, str):
            raise ConfigError(f"{where}: passage {ident!r}: title must be a string")
        if ident in first_line:
            raise ConfigError(f"{where}: duplicate id {ident!r} (first on line "
                              f"{first_line[ident]})")
        first_line[ident] = number
        chunks = chunk_text(text, limit)
        ids = [ident] if len(chunks) == 1 else [f"{ident}#{n}" for n in range(1, len(chunks) + 1)]
        for chunk_id, chunk in zip(ids, chunks, strict=True):
            if chunk_id in emitted:  # "a#1" given as an id, and a long "a" split into a#1...
                raise ConfigError(f"{where}: passage id {chunk_id!r} is also the id of a chunk "
                                  "of a longer passage (ids #1, #2, ...); rename one")
            emitted.add(chunk_id)
            passages.append(Passage(chunk_id, title.strip(), chunk))
    return passages


_MARKDOWN_HEADING = re.compile(r"^#{1,6}[ \t]+(.+?)[ \t#]*$", re.MULTILINE)


def _read_directory(root: Path, limit: int) -> list[Passage]:
    files = sorted(
        path for path in root.rglob("*")
        if path.suffix.lower() in _TEXT_SUFFIXES and path.is_file()
        and not any(part.startswith(".") for part in path.relative_to(root).parts))
    if not files:
        raise ConfigError(f"{root}: the rag corpus directory has no .txt or .md file")
    passages: list[Passage] = []
    for path in files:
        text = _read_text(path)
        heading = _MARKDOWN_HEADING.search(text) if path.suffix.lower() == ".md" else None
        title = heading.group(1).strip() if heading else path.stem
        relative = path.relative_to(root).as_posix()
        passages.extend(Passage(f"{relative}#{n}", title, chunk)
                        for n, chunk in enumerate(chunk_text(text, limit), 1))
    return passages


def _read_corpus(settings: RagToolConfig) -> list[Passage]:
    if settings.corpus is None:
        raise ConfigError("text.rag.corpus is not set: a JSONL file of {id, title, text} passages "
                          "or a directory of .txt/.md files")
    path = Path(settings.corpus)
    if path.is_dir():
        passages = _read_directory(path, settings.chunk_chars)
    elif path.is_file():
        passages = _read_jsonl(path, settings.chunk_chars)
    else:
        raise ConfigError(f"{path}: rag corpus not found (text.rag.corpus)")
    if not passages:
        raise ConfigError(f"{path}: the rag corpus has no passage")
    return passages


# --- the embedding model ----------------------------------------------------------------------

class _StaticEmbedder:
    """A static embedding model: a text's vector is the mean of its tokens' vectors, made unit
    length. Thread-safe (the tokenizer is never reconfigured after loading)."""

    def __init__(self, name: str, vectors: npt.NDArray[np.float32], tokenizer: Any,
                 version: str) -> None:
        self.name = name
        self.vectors = vectors
        self.tokenizer = tokenizer
        self.version = version
        self.dim = int(vectors.shape[1])

    def embed(self, texts: Sequence[str]) -> npt.NDArray[np.float32]:
        out = np.zeros((len(texts), self.dim), dtype=np.float32)
        vocabulary = self.vectors.shape[0]
        for start in range(0, len(texts), _EMBED_BATCH):
            encodings = self.tokenizer.encode_batch(list(texts[start:start + _EMBED_BATCH]),
                                                    add_special_tokens=False)
            lengths = np.fromiter((len(e.ids) for e in encodings), dtype=np.int64,
                                  count=len(encodings))
            rows = np.flatnonzero(lengths)
            if rows.size == 0:
                continue
            ids = np.fromiter((i for e in encodings for i in e.ids), dtype=np.int64,
                              count=int(lengths.sum()))
            np.clip(ids, 0, vocabulary - 1, out=ids)
            offsets = np.concatenate(([0], np.cumsum(lengths[rows])[:-1]))
            sums = np.add.reduceat(self.vectors[ids], offsets, axis=0)
            out[start + rows] = sums / lengths[rows, None]
        norms = np.linalg.norm(out, axis=1, keepdims=True)
        np.divide(out, norms, out=out, where=norms > 0)
        return out


_embedders: dict[str, _StaticEmbedder] = {}
_embedders_lock = threading.Lock()


def _package_dir(package: str) -> Path:
    """Where an installed package's files are, found without importing it."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ToolUnavailable(f"rag: the embedding model's package {package} is not "
                              f"installed: {_INSTALL_HINT}")
    return Path(next(iter(spec.submodule_search_locations)))


def _load_embedder(name: str) -> _StaticEmbedder:
    """The model ``name``, loaded once per process."""
    with _embedders_lock:
        found = _embedders.get(name)
        if found is not None:
            return found
        if name not in RAG_MODELS:
            raise ConfigError(f"text.rag.model: unknown embedding model {name!r}; known: "
                              f"{', '.join(RAG_MODELS)}")
        root = _package_dir("wordllama")
        try:
            from safetensors.numpy import load_file
            from tokenizers import Tokenizer
        except ImportError as exc:
            raise ToolUnavailable(f"rag: {exc.name or exc} (a dependency of the embedding "
                                  f"model) is not installed: {_INSTALL_HINT}") from exc
        weights = root / "weights" / "l2_supercat_256.safetensors"
        tokenizer_file = root / "tokenizers" / "l2_supercat_tokenizer_config.json"
        try:
            tensors = load_file(str(weights))
            tokenizer = Tokenizer.from_file(str(tokenizer_file))
        except Exception as exc:  # a missing file, or a wheel of another layout
            raise ToolUnavailable(f"rag: cannot load the embedding model {name} from "
                                  f"{root}: {exc}") from exc
        tokenizer.no_padding()
        tokenizer.no_truncation()
        dim = RAG_MODELS[name]
        vectors = np.ascontiguousarray(tensors["embedding.weight"][:, :dim], dtype=np.float32)
        embedder = _StaticEmbedder(name, vectors, tokenizer,
                                   importlib.metadata.version("wordllama"))
        _embedders[name] = embedder
        return embedder


def _import_faiss() -> Any:
    try:
        import faiss
    except ImportError as exc:
        raise ToolUnavailable(f"rag: the vector index library faiss-cpu is not installed: "
                              f"{_INSTALL_HINT}") from exc
    return faiss


# --- the retriever ----------------------------------------------------------------------------

def _cache_key(embedder: _StaticEmbedder, settings: RagToolConfig,
               passages: Sequence[Passage]) -> str:
    digest = hashlib.sha256()
    header = [_CACHE_FORMAT, embedder.name, embedder.version, settings.chunk_chars]
    digest.update(json.dumps(header).encode())
    for passage in passages:
        digest.update(json.dumps([passage.id, passage.title, passage.text],
                                 ensure_ascii=False).encode())
        digest.update(b"\n")
    return digest.hexdigest()


def _document(passage: Passage) -> str:
    """What is embedded for a passage: its title, if any, then its text."""
    return f"{passage.title}\n{passage.text}" if passage.title else passage.text


class Retriever:
    """A corpus, chunked and indexed. :meth:`search` is synchronous and thread-safe."""

    def __init__(self, passages: Sequence[Passage], index: Any, embedder: _StaticEmbedder,
                 *, cached: bool, build_seconds: float, retrieval: str = "hybrid",
                 dense_weight: float = 0.8) -> None:
        self._passages = tuple(passages)
        self._index = index
        self._faiss = _import_faiss()
        self._embedder = embedder
        self.retrieval = retrieval
        """How :meth:`search` ranks (``RagToolConfig.retrieval``)."""
        self.dense_weight = dense_weight
        self._words = (BM25Index(_document(p) for p in self._passages)
                       if retrieval != "dense" else None)
        self.cached = cached
        """The index was read from ``cache_dir``, not embedded."""
        self.build_seconds = build_seconds
        """Time :meth:`build` took (reading, chunking, embedding or loading, indexing)."""

    @classmethod
    def build(cls, settings: RagToolConfig) -> Retriever:
        """Read, chunk, embed and index the corpus of ``settings``, or read the index from
        its cache. Synchronous and CPU-bound (~3 s for 10,000 passages): run it in a thread."""
        started = time.perf_counter()
        passages = _read_corpus(settings)
        embedder = _load_embedder(settings.model or RAG_DEFAULT_MODEL)
        faiss = _import_faiss()
        cache_file: Path | None = None
        index = None
        if settings.cache_dir is not None:
            key = _cache_key(embedder, settings, passages)
            cache_file = Path(settings.cache_dir) / f"rag-{key[:32]}.faiss"
            index = cls._read_cache(faiss, cache_file, len(passages), embedder.dim)
        cached = index is not None
        if index is None:
            vectors = embedder.embed([_document(p) for p in passages])
            index = faiss.IndexFlatIP(embedder.dim)
            index.add(vectors)
            if cache_file is not None:
                cls._write_cache(faiss, index, cache_file)
        retriever = cls(passages, index, embedder, cached=cached, build_seconds=0.0,
                        retrieval=settings.retrieval, dense_weight=settings.dense_weight)
        retriever.build_seconds = time.perf_counter() - started  # the BM25 index included
        log.info("rag: %d passages from %s %s in %.2f s (%s)", len(passages), settings.corpus,
                 "loaded from the cache" if cached else "embedded and indexed",
                 retriever.build_seconds, embedder.name)
        return retriever

    @staticmethod
    def _read_cache(faiss: Any, path: Path, count: int, dim: int) -> Any:
        if not path.is_file():
            return None
        try:
            index = faiss.read_index(str(path))
        except Exception as exc:  # faiss raises RuntimeError on a torn or foreign file
            log.warning("rag: ignoring the unreadable index cache %s: %s", path, exc)
            return None
        if index.ntotal != count or index.d != dim:
            log.warning("rag: ignoring the index cache %s: %d vectors of %d dimensions, "
                        "expected %d of %d", path, index.ntotal, index.d, count, dim)
            return None
        return index

    @staticmethod
    def _write_cache(faiss: Any, index: Any, path: Path) -> None:
        temporary = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            faiss.write_index(index, str(temporary))
            os.replace(temporary, path)
        except Exception as exc:  # the cache is an optimisation: a full disk is only slower
            log.warning("rag: cannot write the index cache %s: %s", path, exc)
            temporary.unlink(missing_ok=True)

    @property
    def size(self) -> int:
        """Number of passages (chunks) in the index."""
        return len(self._passages)

    @property
    def model(self) -> str:
        """Name of the embedding model."""
        return self._embedder.name

    def search(self, query: str, k: int) -> list[Passage]:
        """The ``k`` passages that best answer ``query``, best first (fewer if the corpus is
        smaller, or, by ``bm25`` alone, if fewer share a word with it). Thread-safe.

        ``hybrid``: the ``max(k, HYBRID_DEPTH)`` best passages of each list are scored
        ``w * (cos + 1) / (best_cos + 1) + (1 - w) * bm25 / best_bm25`` (``w``:
        ``dense_weight``; the best of the candidates; a passage sharing no word scores 0 for
        BM25), the convex combination with theoretical-minimum normalization that Bruch,
        Gai and Ingber (ACM TOIS 2023) found better than reciprocal rank fusion. ``score``:
        that, the cosine similarity (``dense``), or the BM25 score (``bm25``)."""
        k = min(max(1, k), self.size)
        if self._words is None:
            return [self._passage(row, score)
                    for row, score in self._dense(self._embedder.embed([query]), k)]
        if self.retrieval == "bm25":
            return [self._passage(row, score) for row, score in self._words.search(query, k)]
        depth = min(self.size, max(k, HYBRID_DEPTH))
        vector = self._embedder.embed([query])
        cosine = dict(self._dense(vector, depth))
        words = self._words.scores(query)
        lexical = heapq.nsmallest(depth, words, key=lambda row: (-words[row], row))
        for row in lexical:
            if row not in cosine:
                cosine[row] = float(self._index.reconstruct(row) @ vector[0])
        top_cosine = (max(cosine.values()) + 1.0) or 1.0
        best_words = max((words[row] for row in lexical), default=0.0)
        weight = self.dense_weight
        fused = {row: weight * (cos + 1.0) / top_cosine
                 + (1.0 - weight) * (words.get(row, 0.0) / best_words if best_words else 0.0)
                 for row, cos in cosine.items()}
        best = sorted(fused.items(), key=lambda item: (-item[1], item[0]))[:k]
        return [self._passage(row, score) for row, score in best]

    def _passage(self, row: int, score: float) -> Passage:
        passage = self._passages[row]
        return Passage(passage.id, passage.title, passage.text, float(score))

    def _dense(self, vector: npt.NDArray[np.float32], k: int) -> list[tuple[int, float]]:
        # One query vector: OpenMP's fan-out only costs (on a busy 2-core machine 20-30 ms a
        # query against 0.7 ms on one thread); concurrency comes from concurrent searches.
        # The setting is the calling thread's own (OpenMP's nthreads-var is per task), and
        # put back after.
        threads = self._faiss.omp_get_max_threads()
        self._faiss.omp_set_num_threads(1)
        try:
            scores, rows = self._index.search(vector, k)
        finally:
            self._faiss.omp_set_num_threads(threads)
        return [(int(row), float(score))
                for score, row in zip(scores[0], rows[0], strict=True) if row >= 0]


_shared: dict[RagToolConfig, Retriever] = {}
_shared_locks: dict[RagToolConfig, threading.Lock] = {}
_shared_lock = threading.Lock()


def shared_retriever(settings: RagToolConfig) -> Retriever:
    """The process's retriever for ``settings``, built on first use; concurrent callers wait
    for the one build. A failed build is not remembered (the next call tries again). The
    corpus is not watched: a process sees it as it was at its first call."""
    with _shared_lock:
        found = _shared.get(settings)
        if found is not None:
            return found
        lock = _shared_locks.setdefault(settings, threading.Lock())
    with lock:
        with _shared_lock:
            found = _shared.get(settings)
        if found is not None:
            return found
        retriever = Retriever.build(settings)
        with _shared_lock:
            _shared[settings] = retriever
            _shared_locks.pop(settings, None)
        return retriever


# --- the tool ---------------------------------------------------------------------------------

def _spec(default_top_k: int) -> ToolSpec:
    return ToolSpec(
        name="retrieve",
        description=(
            "Search the knowledge base for passages relevant to a query. Returns the "
            "best-matching passages, best first, numbered, each with its id and title. "
            "Phrase the query as a question or a few descriptive keywords; search again with "
            "other words if the passages do not answer."),
        parameters={
            "type": "object",
            "properties": {
                "query": {"type": "string",
                          "description": "What to look for, in natural language."},
                "top_k": {"type": "integer",
                          "description": f"How many passages to return, 1 to {RAG_MAX_TOP_K} "
                                         f"(default {default_top_k})."},
            },
            "required": ["query"],
        })


class RetrievalTool:
    """The ``retrieve`` tool over a shared :class:`Retriever`. The retriever belongs to the
    process, not to the tool: :meth:`close` only stops this tool's calls."""

    spec = _spec(RagToolConfig.model_fields["top_k"].default)

    def __init__(self, retriever: Retriever, settings: RagToolConfig) -> None:
        self.retriever = retriever
        self.settings = settings
        self.spec = _spec(settings.top_k)
        self._closed = False

    async def __call__(self, arguments: Mapping[str, Any]) -> str:
        args = check_arguments(self.spec, arguments)
        query = args["query"].strip()
        if not query:
            raise ToolError("retrieve: the query is empty; say what to look for")
        top_k = args.get("top_k", self.settings.top_k)
        if not 1 <= top_k <= RAG_MAX_TOP_K:
            raise ToolError(f"retrieve: top_k must be between 1 and {RAG_MAX_TOP_K}, got {top_k}")
        if self._closed:
            raise ToolUnavailable("retrieve: the tool is closed")
        passages = await asyncio.to_thread(self.retriever.search, query, top_k)
        return self.format(passages)

    def format(self, passages: Sequence[Passage]) -> str:
        """Passages as the model reads them: ``[n] (id, title) text``, a blank line between
        them, the whole cut to ``max_result_chars`` (the last passage that does not fit is
        cut with an ellipsis, the rest left out)."""
        if not passages:
            return "No passage found."
        limit = self.settings.max_result_chars
        blocks: list[str] = []
        used = 0
        for number, passage in enumerate(passages, 1):
            where = f"{passage.id}, {passage.title}" if passage.title else passage.id
            block = f"[{number}] ({where}) {passage.text}"
            room = limit - used - (2 if blocks else 0)
            if len(block) > room:
                if room > 40 or not blocks:
                    blocks.append(block[:max(room - 1, 0)] + "…")
                break
            blocks.append(block)
            used += len(block) + (2 if len(blocks) > 1 else 0)
        return "\n\n".join(blocks)

    async def close(self) -> None:
        self._closed = True
