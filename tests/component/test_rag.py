"""The ``rag`` environment's retrieval (rollout/text/rag.py) with the real embedding model
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
from dataclasses import replace
from pathlib import Path

import pytest

from rollout.errors import ConfigError, ToolError, ToolUnavailable
from rollout.text.rag import (
    DEFAULT_MODEL,
    MODELS,
    RagSettings,
    RetrievalTool,
    Retriever,
    chunk_text,
    shared_retriever,
)
from rollout.text.tools import Tool
from tests.support import REPO_ROOT, unavailable


@pytest.fixture(autouse=True, scope="module")
def text_extra() -> None:
    """The ``text`` extra is a dev dependency: skip without it, fail under CI."""
    if importlib.util.find_spec("wordllama") is None or importlib.util.find_spec("faiss") is None:
        unavailable("the text extra (wordllama, faiss-cpu) is not installed: "
                    "pip install -e .[text]")


PLANTED_ID = "kb-planted"
PLANTED = ("Edda Kroll has tended the Varnholm lighthouse since 1998. She shares the keeper's "
           "cottage with a tame octopus called Bartholomew, which has learned to unscrew the "
           "lids of jam jars to reach the sardines she hides inside them.")

# Paraphrases of the planted fact: none repeats its sentences, and most of their words are
# not the passage's (beacon for lighthouse, mollusc for octopus, containers for jars, sea
# creature for octopus; the fifth shares only "keeper", and the distractors have keepers).
# The model averages word vectors: a query without any anchor and with a stronger pull
# elsewhere ("an eight-armed animal that twists open containers to get fish" finds the
# sardines passage first) is beyond it, and not asserted.
PARAPHRASES = [
    "Which sea creature lives with the woman who runs the Varnholm beacon?",
    "What is the name of the lighthouse keeper's pet that can open jars?",
    "Who minds the beacon on Varnholm?",
    "Who has been the keeper of the Varnholm light since the late nineties?",
    "the beacon keeper whose mollusc opens containers",
    "Which clever sea creature unscrews lids?",
]

# Distractors: varied topics, and a few that share words with the planted passage
# (lighthouses, octopuses, jam, keepers) so that matching one word is not enough.
NEAR = [
    "Lighthouses use a Fresnel lens to concentrate the light of a lamp into a beam visible "
    "for many nautical miles; the beam rotates so sailors can identify each tower.",
    "Octopuses are cephalopods with three hearts and blue blood. They change colour with "
    "chromatophores in their skin and can squeeze through any gap larger than their beak.",
    "Making strawberry jam: simmer crushed berries with sugar and lemon juice until the "
    "mixture reaches the setting point, then pour it into sterilised jars.",
    "Goalkeepers in football may handle the ball only inside their own penalty area.",
    "Sardines are small oily fish of the herring family, often sold tinned in olive oil.",
    "The cottage garden style mixes flowers, herbs and vegetables in dense informal beds.",
    "Automatic lighthouses replaced resident keepers in most countries during the 20th century.",
    "A beekeeper checks the hives in spring to see whether the queen is laying eggs.",
]

TOPICS = [
    "Photosynthesis converts light energy into chemical energy: chlorophyll absorbs red and "
    "blue light, and the plant builds glucose from carbon dioxide and water.",
    "The Treaty of Westphalia, signed in 1648, ended the Thirty Years' War in the Holy Roman "
    "Empire and the Eighty Years' War between Spain and the Dutch Republic.",
    "Sourdough bread rises thanks to a starter of wild yeast and lactic acid bacteria, which "
    "also give the crumb its sour taste.",
    "Dolphins find prey by echolocation: they emit clicks and listen for the echoes.",
    "Python's asyncio runs coroutines on an event loop; blocking calls belong in a thread.",
    "The Rust borrow checker enforces that a value has either one mutable reference or any "
    "number of shared references at a time.",
    "Mount Kilimanjaro in Tanzania is the highest mountain in Africa, at 5,895 metres.",
    "The mitochondrion produces most of a cell's ATP through oxidative phosphorylation.",
    "In chess, castling moves the king two squares towards a rook, which jumps over it.",
    "Impressionist painters such as Monet and Renoir painted outdoors to catch changing light.",
    "A binary search halves the interval on each step and finds an item in logarithmic time.",
    "The Great Barrier Reef off Queensland is the largest coral reef system in the world.",
    "Vaccines train the immune system by exposing it to a harmless piece of a pathogen.",
    "The French Revolution began in 1789 with the storming of the Bastille in Paris.",
    "Espresso is brewed by forcing hot water through finely ground coffee at high pressure.",
    "Jupiter is the largest planet of the solar system; its Great Red Spot is a giant storm.",
    "The violin has four strings tuned in fifths: G, D, A and E.",
    "Compound interest adds interest to the principal, so the balance grows exponentially.",
    "Tectonic plates move a few centimetres a year; their collisions raise mountain ranges.",
    "Haiku are Japanese poems of three lines with five, seven and five syllables.",
    "The Amazon rainforest produces a large share of the world's oxygen and rain.",
    "TCP guarantees ordered delivery with sequence numbers and retransmission of lost packets.",
    "A marathon is 42.195 kilometres long, a distance fixed at the 1908 London Olympics.",
    "Penguins cannot fly; their wings have evolved into flippers for swimming.",
    "The printing press of Johannes Gutenberg, around 1440, used movable metal type.",
    "Glaciers carve U-shaped valleys as they slide downhill under their own weight.",
    "Insulin, made by the pancreas, lets cells take up glucose from the blood.",
    "The Roman aqueducts carried water into cities over many kilometres by gravity alone.",
    "Cheddar cheese is named after a village in Somerset, England, with caves for ageing it.",
    "An electric motor turns because a current in a magnetic field feels a force.",
    "The Silk Road linked China with the Mediterranean for trade in silk, spices and ideas.",
    "Bamboo is a grass, and some species grow nearly a metre in a single day.",
    "The Pythagorean theorem states that a squared plus b squared equals c squared.",
    "Monsoon rains in South Asia come from seasonal winds blowing in from the ocean.",
    "A sonnet has fourteen lines; Shakespeare's rhyme abab cdcd efef gg.",
    "Bees communicate the direction of flowers to the hive with a waggle dance.",
    "Git stores snapshots of a project as commits linked to their parents.",
    "The human heart has four chambers: two atria and two ventricles.",
    "Saturn's rings are made mostly of ice particles with some rock and dust.",
    "Yoga combines breathing exercises, postures and meditation.",
    "The Nile flows north through eleven countries into the Mediterranean Sea.",
    "Blockchains append blocks of transactions, each holding the hash of the previous one.",
    "Olive oil is pressed from the fruit of olive trees grown around the Mediterranean.",
    "The speed of light in vacuum is about 299,792 kilometres per second.",
    "Tea comes from the leaves of Camellia sinensis; green and black tea differ in oxidation.",
    "Volcanoes erupt when magma from the mantle rises through cracks in the crust.",
    "The Renaissance began in Florence in the 14th century with a revival of classical art.",
    "Wind turbines convert the kinetic energy of moving air into electricity.",
    "A haircut with clippers starts with a longer guard and moves to shorter ones.",
    "The tango originated in the working-class neighbourhoods of Buenos Aires.",
    "Antibiotics kill bacteria but have no effect on viruses.",
]

PLACES = ["Lisbon", "Osaka", "Quito", "Tallinn", "Nairobi", "Hobart", "Tromsø", "Cusco",
          "Marrakesh", "Winnipeg", "Bergen", "Hanoi"]
THINGS = [("bakery", "sells rye loaves and cinnamon rolls every morning"),
          ("tram line", "climbs the hill to the old castle every ten minutes"),
          ("museum", "shows textiles woven over three centuries"),
          ("football club", "plays its home games in a stadium by the river"),
          ("market", "opens on Saturdays with farmers selling cheese and honey"),
          ("university", "is known for its research on glaciers and climate"),
          ("orchestra", "performs a free concert in the park each summer"),
          ("library", "lends bicycles as well as books to its members"),
          ("harbour", "handles container ships and a ferry to the nearby islands"),
          ("festival", "fills the streets with paper lanterns in the autumn")]


def distractors() -> list[tuple[str, str, str]]:
    """~150 (id, title, text) passages: hand-written topics and near misses, plus city facts
    made from a template."""
    out = [(f"topic-{n}", "", text) for n, text in enumerate(TOPICS)]
    out += [(f"near-{n}", "", text) for n, text in enumerate(NEAR)]
    rng = random.Random(7)
    for n, place in enumerate(PLACES):
        for thing, fact in rng.sample(THINGS, 8):
            out.append((f"city-{n}-{thing.replace(' ', '-')}", place,
                        f"The {thing} of {place} {fact}."))
    return out


def write_jsonl(path: Path, planted: bool = True) -> Path:
    rows = [{"id": ident, "title": title, "text": text} if title else {"id": ident, "text": text}
            for ident, title, text in distractors()]
    if planted:
        rows.insert(len(rows) // 2, {"id": PLANTED_ID, "title": "Varnholm", "text": PLANTED})
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_jsonl(tmp_path_factory.mktemp("rag") / "kb.jsonl")


@pytest.fixture(scope="module")
def retriever(corpus: Path) -> Retriever:
    return Retriever.build(RagSettings(corpus=corpus))


def test_paraphrased_queries_find_the_planted_passage_first(retriever: Retriever) -> None:
    assert retriever.size == len(distractors()) + 1 >= 150
    assert retriever.model == DEFAULT_MODEL
    for query in PARAPHRASES:
        found = retriever.search(query, 3)
        assert found[0].id == PLANTED_ID, (query, [(p.id, round(p.score, 3)) for p in found])
        assert found[0].title == "Varnholm" and found[0].text == PLANTED
        assert found[0].score > found[1].score
    # A question about a distractor finds that one, not the planted passage.
    assert retriever.search("When did the Thirty Years War end?", 1)[0].id == "topic-1"
    assert retriever.search("how do bakers make bread rise without commercial yeast",
                            1)[0].id == "topic-2"


def test_top_k_is_honoured(retriever: Retriever) -> None:
    for k in (1, 3, 7, 20):
        found = retriever.search("lighthouse", k)
        assert len(found) == k
        assert [p.score for p in found] == sorted((p.score for p in found), reverse=True)
        assert len({p.id for p in found}) == k
    assert len(retriever.search("lighthouse", 10_000)) == retriever.size


def test_matryoshka_models_index_with_fewer_dimensions(corpus: Path) -> None:
    small = Retriever.build(RagSettings(corpus=corpus, model="wordllama/l2_supercat_128"))
    assert small.model == "wordllama/l2_supercat_128" and MODELS[small.model] == 128
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
    settings = RagSettings(corpus=root, chunk_chars=300)
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
    retriever = Retriever.build(RagSettings(corpus=path, chunk_chars=400))
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
        Retriever.build(RagSettings(corpus=path))
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
            Retriever.build(RagSettings(corpus=corpus))
        assert str(corpus) in str(caught.value)
    with pytest.raises(ConfigError, match=r"rag\.corpus is not set"):
        Retriever.build(RagSettings())
    with pytest.raises(ConfigError, match="unknown embedding model 'bge-large'"):
        RagSettings(corpus=empty, model="bge-large")
    with pytest.raises(ConfigError, match="top_k"):
        RagSettings(top_k=0)
    with pytest.raises(ConfigError, match="chunk_chars"):
        RagSettings(chunk_chars=10)


def test_index_cache_is_reused_and_invalidated(tmp_path: Path) -> None:
    corpus = write_jsonl(tmp_path / "kb.jsonl")
    settings = RagSettings(corpus=corpus, cache_dir=tmp_path / "cache")
    first = Retriever.build(settings)
    files = sorted((tmp_path / "cache").glob("rag-*.faiss"))
    assert not first.cached and len(files) == 1
    second = Retriever.build(settings)
    assert second.cached and second.size == first.size
    assert second.search(PARAPHRASES[0], 3) == first.search(PARAPHRASES[0], 3)
    print(f"\nrag build of {first.size} passages: {first.build_seconds * 1000:.0f} ms embedded, "
          f"{second.build_seconds * 1000:.0f} ms from the cache")

    # Another chunking is another index; so is a changed corpus.
    assert not Retriever.build(replace(settings, chunk_chars=200)).cached
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
    settings = RagSettings(corpus=corpus, top_k=2, max_result_chars=4000)
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
    short = RetrievalTool(retriever, replace(settings, max_result_chars=300))
    reply = await short({"query": PARAPHRASES[1], "top_k": 10})
    assert len(reply) <= 300 and reply.endswith("…") and reply.startswith("[1] (kb-planted")
    tiny = RetrievalTool(retriever, replace(settings, max_result_chars=100))
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
    tool = RetrievalTool(retriever, RagSettings(corpus=corpus))
    with pytest.raises(ToolError, match=message):
        await tool(arguments)  # type: ignore[arg-type]


async def test_closed_tool_is_unavailable(retriever: Retriever, corpus: Path) -> None:
    tool = RetrievalTool(retriever, RagSettings(corpus=corpus))
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
    settings = RagSettings(corpus=corpus, top_k=1)
    barrier = threading.Barrier(6)

    def build() -> Retriever:
        barrier.wait()
        return shared_retriever(settings)

    built = await asyncio.gather(*(asyncio.to_thread(build) for _ in range(6)))
    assert all(r is built[0] for r in built)
    assert shared_retriever(settings) is built[0]
    assert shared_retriever(replace(settings, top_k=2)) is not built[0]
    tools = [RetrievalTool(shared_retriever(settings), settings) for _ in range(4)]
    replies = await asyncio.gather(*(tool({"query": q}) for tool in tools for q in PARAPHRASES))
    assert all(reply.startswith(f"[1] ({PLANTED_ID},") for reply in replies)


def test_model_loads_without_any_network(corpus: Path) -> None:
    """The weights ship in the wheel: a build and a search succeed in a fresh interpreter in a
    network namespace of its own (no interface but a down loopback), with no model cache."""
    script = (
        "from rollout.text.rag import RagSettings, Retriever\n"
        f"r = Retriever.build(RagSettings(corpus={str(corpus)!r}))\n"
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
        "from rollout.errors import ToolUnavailable\n"
        "from rollout.text.rag import RagSettings, Retriever\n"
        "try:\n"
        f"    Retriever.build(RagSettings(corpus={str(corpus)!r}))\n"
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
    settings = RagSettings(corpus=path, cache_dir=tmp_path / "cache")
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
