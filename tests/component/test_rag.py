"""The ``rag`` environment's retrieval (cua_rollout/text/rag.py) with the real embedding model
(wordllama's l2_supercat, shipped in its wheel) and a real faiss index: a planted passage is
found among ~150 distractors by queries that paraphrase it, over JSONL and directory corpora;
long texts are chunked; a malformed corpus names its file and line; the index cache is reused
and invalidated; the tool checks its arguments; searches run concurrently."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import random
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from cua_rollout.config import RAG_DEFAULT_MODEL, RAG_MODELS, RagToolConfig
from cua_rollout.core.errors import ConfigError, ToolError, ToolUnavailable
from cua_rollout.envs.tools import Tool
from cua_rollout.text.rag import (
    RetrievalTool,
    Retriever,
    chunk_text,
    shared_retriever,
)
from tests.doubles.rag_corpus import (
    NEAR,
    PARAPHRASES,
    PLANTED,
    PLANTED_ID,
    TOPICS,
    distractors,
    write_jsonl,
)
from tests.support import REPO_ROOT, unavailable


def rag_config(**fields: Any) -> RagToolConfig:
    """``text.rag`` without the index cache unless ``cache_dir`` is given (the config's default
    is ``.cache/rag`` of the working directory)."""
    return RagToolConfig(**{"cache_dir": None, **fields})


@pytest.fixture(autouse=True, scope="module")
def text_extra() -> None:
    """The ``text`` extra is a dev dependency: skip without it, fail under CI."""
    if importlib.util.find_spec("wordllama") is None or importlib.util.find_spec("faiss") is None:
        unavailable("the text extra (wordllama, faiss-cpu) is not installed: "
                    "pip install -e .[text]")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_jsonl(tmp_path_factory.mktemp("rag") / "kb.jsonl")


@pytest.fixture(scope="module")
def retriever(corpus: Path) -> Retriever:
    return Retriever.build(rag_config(corpus=corpus))


def test_paraphrased_queries_find_the_planted_passage_first(retriever: Retriever) -> None:
    assert retriever.size == len(distractors()) + 1 >= 150
    assert retriever.model == RAG_DEFAULT_MODEL
    for query in PARAPHRASES:
        found = retriever.search(query, 3)
        assert found[0].id == PLANTED_ID, (query, [(p.id, round(p.score, 3)) for p in found])
        assert found[0].title == "Varnholm" and found[0].text == PLANTED
        assert found[0].score > found[1].score
    # A question about a distractor finds that one, not the planted passage.
    assert retriever.search("When did the Thirty Years War end?", 1)[0].id == "topic-1"
    assert retriever.search("how do bakers make bread rise without commercial yeast",
                            1)[0].id == "topic-2"


@pytest.mark.parametrize("query", ["Edda Kroll", "Who is Edda Kroll?", "Kroll", "Edda"])
def test_a_name_is_found_first_by_hybrid_and_bm25_where_dense_alone_misses(
        retriever: Retriever, corpus: Path, query: str) -> None:
    """An averaged word embedding dilutes a rare name: the planted passage is not first by
    the dense score alone (ranked 5th, 5th, 2nd and 11th here); BM25's share of the hybrid
    score puts it first, and bm25 alone finds it too."""
    dense = Retriever.build(rag_config(corpus=corpus, retrieval="dense"))
    words = Retriever.build(rag_config(corpus=corpus, retrieval="bm25"))
    assert retriever.retrieval == "hybrid"  # the default
    assert dense.search(query, 5)[0].id != PLANTED_ID
    assert retriever.search(query, 5)[0].id == PLANTED_ID
    assert words.search(query, 5)[0].id == PLANTED_ID


def test_bm25_alone_returns_only_passages_sharing_a_word(corpus: Path) -> None:
    words = Retriever.build(rag_config(corpus=corpus, retrieval="bm25"))
    found = words.search("Varnholm", 10)
    assert [p.id for p in found] == [PLANTED_ID] and found[0].score > 0
    assert words.search("zyzzyva quuxification", 3) == []


def test_hybrid_scores_are_a_weighted_sum_and_its_weights_bound_it(corpus: Path) -> None:
    """dense_weight 1 ranks as dense does and 0 as bm25 does (on the passages sharing a word);
    scores lie in [0, 1] with the best at most 1."""
    query = PARAPHRASES[1]
    dense = Retriever.build(rag_config(corpus=corpus, retrieval="dense")).search(query, 5)
    words = Retriever.build(rag_config(corpus=corpus, retrieval="bm25")).search(query, 5)
    only_dense = Retriever.build(rag_config(corpus=corpus, dense_weight=1.0)).search(query, 5)
    only_words = Retriever.build(rag_config(corpus=corpus, dense_weight=0.0)).search(query, 5)
    assert [p.id for p in only_dense] == [p.id for p in dense]
    assert [p.id for p in only_words] == [p.id for p in words]
    assert only_dense[0].score == pytest.approx(1.0) and only_words[0].score == pytest.approx(1.0)
    for passage in Retriever.build(rag_config(corpus=corpus)).search(query, 10):
        assert 0.0 <= passage.score <= 1.0 + 1e-9
    with pytest.raises(ValidationError, match="retrieval"):
        rag_config(corpus=corpus, retrieval="sparse")
    with pytest.raises(ValidationError, match="dense_weight"):
        rag_config(corpus=corpus, dense_weight=1.5)


def test_top_k_is_honoured(retriever: Retriever) -> None:
    for k in (1, 3, 7, 20):
        found = retriever.search("lighthouse", k)
        assert len(found) == k
        assert [p.score for p in found] == sorted((p.score for p in found), reverse=True)
        assert len({p.id for p in found}) == k
    assert len(retriever.search("lighthouse", 10_000)) == retriever.size


def test_matryoshka_models_index_with_fewer_dimensions(corpus: Path) -> None:
    small = Retriever.build(rag_config(corpus=corpus, model="wordllama/l2_supercat_128"))
    assert small.model == "wordllama/l2_supercat_128" and RAG_MODELS[small.model] == 128
    assert small.search(PARAPHRASES[1], 1)[0].id == PLANTED_ID


def test_directory_corpus_chunks_files_into_paragraph_passages(tmp_path: Path) -> None:
    root = tmp_path / "docs"
    (root / "animals").mkdir(parents=True)
    (root / ".hidden").mkdir()
    (root / ".hidden" / "secret.txt").write_text("Varnholm octopus jam jars, hidden.")
    (root / "notes.bin").write_bytes(b"\x00\x01 not a text file")
    for n, text in enumerate(TOPICS):
        (root / f"topic{n:02}.txt").write_text(text + "\n")
    # A markdown page: its heading is the title; its paragraphs are packed up to chunk_chars.
    paragraphs = [NEAR[0], NEAR[6], PLANTED, NEAR[2]]
    (root / "animals" / "varnholm.md").write_text(
        "# The Varnholm light\n\n" + "\n\n".join(paragraphs) + "\n", encoding="utf-8")
    settings = rag_config(corpus=root, chunk_chars=300)
    retriever = Retriever.build(settings)
    md = [p for p in retriever.search("lighthouse", 100) if p.id.startswith("animals/")]
    assert sorted(p.id for p in md) == [f"animals/varnholm.md#{n}" for n in range(1, len(md) + 1)]
    assert len(md) >= 3 and all(p.title == "The Varnholm light" for p in md)
    assert all(len(p.text) <= 300 for p in md)
    assert retriever.size == len(TOPICS) + len(md)  # the hidden and .bin files are skipped
    top = retriever.search(PARAPHRASES[0], 1)[0]
    assert top.id.startswith("animals/varnholm.md#") and "Bartholomew" in top.text
    assert retriever.search("highest mountain in Africa", 1)[0].id == "topic06.txt#1"


def test_long_texts_are_chunked_at_paragraph_and_sentence_boundaries(tmp_path: Path) -> None:
    sentences = [f"Sentence number {n} talks about subject {n * 7 % 13}." for n in range(60)]
    paragraphs = [" ".join(sentences[i:i + 6]) for i in range(0, 60, 6)]  # ~280 chars each
    text = "\n\n".join(paragraphs)
    chunks = chunk_text(text, 600)
    assert all(len(c) <= 600 for c in chunks)
    assert chunks[0] == paragraphs[0] + "\n\n" + paragraphs[1]  # whole paragraphs packed
    assert " ".join(" ".join(c.split("\n\n")) for c in chunks) == " ".join(paragraphs)
    # A paragraph longer than the limit is split between sentences, never inside one.
    long = chunk_text(" ".join(sentences), 200)
    assert all(len(c) <= 200 and c.endswith(".") for c in long)
    assert " ".join(long) == " ".join(sentences)
    # A sentence longer than the limit is split between words, a word longer than it cut.
    assert chunk_text("word " * 100, 100) == ["word " * 19 + "word"] * 5
    assert chunk_text("x" * 250, 100) == ["x" * 100, "x" * 100, "x" * 50]
    assert chunk_text("\n\n  \n\n", 100) == []

    # In a JSONL corpus, a long passage becomes id#1, id#2, ...: the planted fact buried in
    # the middle of a long document is found, in its own chunk.
    filler = [TOPICS[n % len(TOPICS)] for n in range(30)]
    document = "\n\n".join([*filler[:15], PLANTED, *filler[15:]])
    path = tmp_path / "long.jsonl"
    path.write_text(json.dumps({"id": "manual", "title": "Handbook", "text": document}) + "\n"
                    + json.dumps({"id": "short", "text": NEAR[1]}) + "\n")
    retriever = Retriever.build(rag_config(corpus=path, chunk_chars=400))
    assert retriever.size > 8
    ids = {p.id for p in retriever.search("x", 100)}
    assert "short" in ids and "manual" not in ids and "manual#1" in ids
    top = retriever.search(PARAPHRASES[1], 1)[0]
    assert top.id.startswith("manual#") and "Bartholomew" in top.text and len(top.text) <= 400


@pytest.mark.parametrize(("content", "line", "message"), [
    ('{"id": "a", "text": "fine"}\n{"id": "b", "text": "broken"\n', 2, "not valid JSON"),
    ('{"id": "a", "text": "fine"}\n\n["not", "an", "object"]\n', 3, "expected a JSON object"),
    ('{"id": "a", "title": "t"}\n', 1, "has no text"),
    ('{"id": "a", "text": "   "}\n', 1, "has no text"),
    ('{"text": "no id"}\n', 1, "missing id"),
    ('{"id": "a", "text": "one"}\n{"id": "a", "text": "two"}\n', 2, "duplicate id 'a'"),
    ('{"id": "a", "text": "t", "title": 5}\n', 1, "title must be a string"),
    ('{"id": "a#2", "text": "t"}\n{"id": "a", "text": "' + "word " * 300 + '"}\n', 2,
     "'a#2' is also the id of a chunk"),
])
def test_malformed_jsonl_names_file_and_line(tmp_path: Path, content: str, line: int,
                                             message: str) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text(content)
    with pytest.raises(ConfigError, match=message) as caught:
        Retriever.build(rag_config(corpus=path))
    assert str(caught.value).startswith(f"{path}:{line}: ")


def test_unusable_corpora_and_settings_are_config_errors(tmp_path: Path) -> None:
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n\n")
    (tmp_path / "nodocs").mkdir()
    (tmp_path / "nodocs" / "image.png").write_bytes(b"\x89PNG")
    latin = tmp_path / "latin"
    latin.mkdir()
    (latin / "a.txt").write_bytes("caf\xe9".encode("latin-1"))
    cases = {
        tmp_path / "missing.jsonl": "rag corpus not found",
        empty: "has no passage",
        tmp_path / "nodocs": "no .txt or .md file",
        latin: "a.txt: rag corpus is not UTF-8",
    }
    for corpus, message in cases.items():
        with pytest.raises(ConfigError, match=message) as caught:
            Retriever.build(rag_config(corpus=corpus))
        assert str(corpus) in str(caught.value)
    with pytest.raises(ConfigError, match=r"rag\.corpus is not set"):
        Retriever.build(rag_config())
    with pytest.raises(ValidationError, match="unknown embedding model 'bge-large'"):
        rag_config(corpus=empty, model="bge-large")
    with pytest.raises(ValidationError, match="top_k"):
        rag_config(top_k=0)
    with pytest.raises(ValidationError, match="top_k"):
        rag_config(top_k=21)
    with pytest.raises(ValidationError, match="chunk_chars"):
        rag_config(chunk_chars=10)


def test_index_cache_is_reused_and_invalidated(tmp_path: Path) -> None:
    corpus = write_jsonl(tmp_path / "kb.jsonl")
    settings = rag_config(corpus=corpus, cache_dir=tmp_path / "cache")
    first = Retriever.build(settings)
    files = sorted((tmp_path / "cache").glob("rag-*.faiss"))
    assert not first.cached and len(files) == 1
    second = Retriever.build(settings)
    assert second.cached and second.size == first.size
    assert second.search(PARAPHRASES[0], 3) == first.search(PARAPHRASES[0], 3)
    print(f"\nrag build of {first.size} passages: {first.build_seconds * 1000:.0f} ms embedded, "
          f"{second.build_seconds * 1000:.0f} ms from the cache")

    # Another chunking is another index; so is a changed corpus.
    assert not Retriever.build(settings.model_copy(update={"chunk_chars": 200})).cached
    with corpus.open("a") as f:
        f.write(json.dumps({"id": "new", "text": "A passage added later."}) + "\n")
    changed = Retriever.build(settings)
    assert not changed.cached and changed.size == first.size + 1
    assert len(list((tmp_path / "cache").glob("rag-*.faiss"))) == 3
    assert Retriever.build(settings).cached

    # A torn cache file is rebuilt over, not trusted.
    for path in (tmp_path / "cache").glob("rag-*.faiss"):
        path.write_bytes(path.read_bytes()[:100])
    rebuilt = Retriever.build(settings)
    assert not rebuilt.cached and rebuilt.search("added later", 1)[0].id == "new"
    assert Retriever.build(settings).cached
    assert not list((tmp_path / "cache").glob(".*.tmp"))


async def test_tool_returns_numbered_passages(retriever: Retriever, corpus: Path) -> None:
    settings = rag_config(corpus=corpus, top_k=2, max_result_chars=4000)
    tool = RetrievalTool(retriever, settings)
    assert isinstance(tool, Tool)
    assert tool.spec.name == "retrieve" and tool.spec.parameters["required"] == ["query"]
    assert "default 2" in tool.spec.parameters["properties"]["top_k"]["description"]
    assert tool.spec.openai()["function"]["name"] == "retrieve"

    reply = await tool({"query": PARAPHRASES[1]})
    assert reply.startswith(f"[1] ({PLANTED_ID}, Varnholm) {PLANTED}\n\n[2] (")
    assert "[3]" not in reply
    reply = await tool({"query": PARAPHRASES[1], "top_k": 5})
    assert [f"[{n}]" in reply for n in range(1, 7)] == [True] * 5 + [False]
    untitled = await tool({"query": "Dolphins find prey with echolocation clicks", "top_k": 1})
    assert untitled == f"[1] (topic-3) {TOPICS[3]}"

    # The reply is cut at max_result_chars: whole passages, then the one that did not fit cut.
    short = RetrievalTool(retriever, settings.model_copy(update={"max_result_chars": 300}))
    reply = await short({"query": PARAPHRASES[1], "top_k": 10})
    assert len(reply) <= 300 and reply.endswith("…") and reply.startswith("[1] (kb-planted")
    tiny = RetrievalTool(retriever, settings.model_copy(update={"max_result_chars": 100}))
    reply = await tiny({"query": PARAPHRASES[1]})
    assert len(reply) == 100 and reply.startswith("[1] (kb-planted, Varnholm) Edda Kroll")
    await tool.close()
    await tool.close()


@pytest.mark.parametrize(("arguments", "message"), [
    ({"query": "   "}, "the query is empty"),
    ({"query": "x", "top_k": 0}, "top_k must be between 1 and 20, got 0"),
    ({"query": "x", "top_k": 21}, "top_k must be between 1 and 20, got 21"),
    ({"query": "x", "top_k": "3"}, "argument top_k must be a integer"),
    ({"query": "x", "top_k": True}, "argument top_k must be a integer"),
    ({"top_k": 3}, "missing required argument"),
    ({"query": "x", "k": 3}, "unknown argument"),
    (["query"], "must be a JSON object"),
])
async def test_tool_rejects_bad_arguments(retriever: Retriever, corpus: Path, arguments: object,
                                          message: str) -> None:
    tool = RetrievalTool(retriever, rag_config(corpus=corpus))
    with pytest.raises(ToolError, match=message):
        await tool(arguments)  # type: ignore[arg-type]


async def test_closed_tool_is_unavailable(retriever: Retriever, corpus: Path) -> None:
    tool = RetrievalTool(retriever, rag_config(corpus=corpus))
    await tool.close()
    with pytest.raises(ToolUnavailable, match="closed"):
        await tool({"query": "lighthouse"})


def test_concurrent_searches_from_threads(retriever: Retriever) -> None:
    queries = [*PARAPHRASES, *(text[:60] for text in TOPICS)]
    expected = {q: retriever.search(q, 5) for q in queries}

    def run(n: int) -> list[bool]:
        order = queries[n % len(queries):] + queries[:n % len(queries)]
        return [retriever.search(q, 5) == expected[q] for q in order]

    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(run, range(16)))
    assert all(all(r) for r in results)


async def test_concurrent_tool_calls_share_one_retriever(corpus: Path) -> None:
    settings = rag_config(corpus=corpus, top_k=1)
    barrier = threading.Barrier(6)

    def build() -> Retriever:
        barrier.wait()
        return shared_retriever(settings)

    built = await asyncio.gather(*(asyncio.to_thread(build) for _ in range(6)))
    assert all(r is built[0] for r in built)
    assert shared_retriever(settings) is built[0]
    assert shared_retriever(settings.model_copy(update={"top_k": 2})) is not built[0]
    tools = [RetrievalTool(shared_retriever(settings), settings) for _ in range(4)]
    replies = await asyncio.gather(*(tool({"query": q}) for tool in tools for q in PARAPHRASES))
    assert all(reply.startswith(f"[1] ({PLANTED_ID},") for reply in replies)


def test_model_loads_without_any_network(corpus: Path) -> None:
    """The weights ship in the wheel: a build and a search succeed in a fresh interpreter in a
    network namespace of its own (no interface but a down loopback), with no model cache."""
    script = (
        "from cua_rollout.config import RagToolConfig\n"
        "from cua_rollout.text.rag import Retriever\n"
        f"r = Retriever.build(RagToolConfig(corpus={str(corpus)!r}, cache_dir=None))\n"
        f"print(r.search({PARAPHRASES[1]!r}, 1)[0].id)\n")
    probe = subprocess.run(["unshare", "--net", "true"], capture_output=True, check=False)
    if probe.returncode != 0:
        unavailable("unshare --net needs root (CI runs as root)")
    env = {**os.environ, "HOME": str(corpus.parent), "HF_HUB_OFFLINE": "1",
           "XDG_CACHE_HOME": str(corpus.parent / "xdg-cache")}
    result = subprocess.run(["unshare", "--net", sys.executable, "-c", script], cwd=REPO_ROOT,
                            env=env, capture_output=True, text=True, timeout=60, check=False)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == PLANTED_ID


@pytest.mark.parametrize("package", ["wordllama", "faiss"])
def test_missing_package_is_tool_unavailable(corpus: Path, package: str) -> None:
    """In a fresh interpreter where the package cannot be found or imported."""
    script = (
        "import sys\n"
        f"sys.modules[{package!r}] = None\n"
        "from cua_rollout.core.errors import ToolUnavailable\n"
        "from cua_rollout.config import RagToolConfig\n"
        "from cua_rollout.text.rag import Retriever\n"
        "try:\n"
        f"    Retriever.build(RagToolConfig(corpus={str(corpus)!r}, cache_dir=None))\n"
        "except ToolUnavailable as exc:\n"
        "    print(exc)\n")
    result = subprocess.run([sys.executable, "-c", script], cwd=REPO_ROOT, capture_output=True,
                            text=True, timeout=60, check=True)
    assert "not installed: pip install -e .[text]" in result.stdout
    assert ("faiss-cpu" if package == "faiss" else "wordllama") in result.stdout


@pytest.mark.slow
def test_scale_10k_passages(tmp_path: Path) -> None:
    """10,000 synthetic passages of ~100 words: build, cache load and query latency."""
    rng = random.Random(3)
    vocabulary = " ".join([*TOPICS, *NEAR]).replace(",", "").replace(".", "").split()
    path = tmp_path / "big.jsonl"
    with path.open("w") as f:
        for n in range(10_000):
            f.write(json.dumps({"id": f"p{n}", "text": " ".join(rng.choices(vocabulary, k=100))})
                    + "\n")
        f.write(json.dumps({"id": PLANTED_ID, "title": "Varnholm", "text": PLANTED}) + "\n")
    settings = rag_config(corpus=path, cache_dir=tmp_path / "cache")
    built = Retriever.build(settings)
    loaded = Retriever.build(settings)
    assert loaded.cached and built.size == loaded.size == 10_001
    started = time.perf_counter()
    rounds = 20
    for _ in range(rounds):
        for query in PARAPHRASES:
            loaded.search(query, 5)
    latency = (time.perf_counter() - started) / (rounds * len(PARAPHRASES))
    assert loaded.search(PARAPHRASES[1], 1)[0].id == PLANTED_ID
    print(f"\nrag 10k passages: build {built.build_seconds:.2f} s, from the cache "
          f"{loaded.build_seconds:.2f} s, query {latency * 1000:.2f} ms "
          f"({os.cpu_count()} cores)")
    assert latency < 0.5
