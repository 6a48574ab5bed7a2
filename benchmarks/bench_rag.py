"""Retrieval quality and latency of the rag mode's ``dense``, ``bm25`` and ``hybrid`` ranking
(``cua_rollout/text/rag.py``) on two query sets written here:

- ``paraphrase``: the component test's 150-passage corpus (``tests/doubles/rag_corpus.py``)
  with 12 questions about its planted passage, six of them paraphrases without its words and
  a few by name, and six questions about other passages;
- ``names``: 2,000 look-alike biographies of made-up people ("<name> was born in <town> in
  <year> and worked as a <job> in <town>"), 200 questions each naming one of them.

    python benchmarks/bench_rag.py [--weights 0.5 0.8 0.9] [--json out.json]

Prints, per set and ranking, top-1, top-5 and the mean reciprocal rank of the right passage
in the first 10, and the mean query time.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from cua_rollout.config import RagToolConfig  # noqa: E402
from cua_rollout.text.rag import Retriever  # noqa: E402
from tests.doubles.rag_corpus import PARAPHRASES, PLANTED_ID, write_jsonl  # noqa: E402

PLANTED_QUESTIONS = [
    *PARAPHRASES,
    "an eight-armed animal that twists open containers to get fish",
    "Which animal lives in the Varnholm keeper's cottage?",
    "octopus Bartholomew",
    "Edda Kroll",
    "lighthouse keeper octopus jam jars sardines",
    "Who looks after the light on the island of Varnholm and what pet does she have?",
]
OTHER_QUESTIONS = [
    ("When did the Thirty Years War end?", "topic-1"),
    ("how do bakers make bread rise without commercial yeast", "topic-2"),
    ("how do whales and dolphins locate fish with sound", "topic-3"),
    ("which is the tallest peak on the African continent", "topic-6"),
    ("what powers a cell", "topic-7"),
    ("how long is the race run at the olympics over forty-two kilometres", "topic-22"),
]
FIRST = ["Anja", "Bram", "Celia", "Dario", "Elin", "Femi", "Greta", "Hugo", "Ines", "Jonas",
         "Kaia", "Lars", "Mira", "Nils", "Oona", "Pavel", "Rhea", "Soren", "Tove", "Uma",
         "Viggo", "Wren", "Xenia", "Yusuf", "Zora"]
LAST = ["Aldane", "Brisk", "Corvel", "Dunmore", "Esker", "Falk", "Gorrin", "Hale", "Ivers",
        "Jurek", "Kessel", "Lundt", "Marrow", "Nyberg", "Orsk", "Pell", "Quist", "Rook",
        "Strand", "Tamsin", "Ulvik", "Varga", "Welt", "Yarrow", "Zell"]
TOWNS = [a + b for a in ("Ard", "Bel", "Cor", "Dun", "Els", "Fen", "Gar", "Hol", "Ist", "Kel")
         for b in ("mouth", "ford", "wick", "holm", "by", "stead", "vik", "dal")]
JOBS = ["baker", "glassblower", "ferry captain", "surveyor", "organist", "beekeeper",
        "cartographer", "lock keeper", "clockmaker", "botanist"]


def names_set(path: Path, people: int = 2000, questions: int = 200,
              seed: int = 11) -> list[tuple[str, str]]:
    """Write the biographies to ``path``; the questions and their passages' ids."""
    rng = random.Random(seed)
    rows: list[dict[str, str]] = []
    asked: list[tuple[str, str]] = []
    seen: set[str] = set()
    while len(rows) < people:
        name = f"{rng.choice(FIRST)} {rng.choice('ABCDEFGHJKLMNPRSTVW')}. {rng.choice(LAST)}"
        if name in seen:
            continue
        seen.add(name)
        ident = f"person-{len(rows)}"
        born, worked = rng.choice(TOWNS), rng.choice(TOWNS)
        rows.append({"id": ident, "title": name,
                     "text": f"{name} was born in {born} in {rng.randint(1850, 1990)} and "
                             f"worked as a {rng.choice(JOBS)} in {worked} for most of their "
                             "life."})
        if len(asked) < questions:
            asked.append((rng.choice([f"Where was {name} born?", f"What was {name}'s job?",
                                      f"In which year was {name} born?",
                                      f"{name} birthplace"]), ident))
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    return asked


def measure(retriever: Retriever, questions: list[tuple[str, str]]) -> dict[str, Any]:
    ranks: list[int | None] = []
    started = time.perf_counter()
    for query, gold in questions:
        ids = [p.id for p in retriever.search(query, 10)]
        ranks.append(ids.index(gold) + 1 if gold in ids else None)
    elapsed = time.perf_counter() - started
    return {"queries": len(questions),
            "top1": sum(1 for r in ranks if r == 1),
            "top5": sum(1 for r in ranks if r is not None and r <= 5),
            "mrr10": round(sum(1 / r for r in ranks if r) / len(ranks), 3),
            "ms_per_query": round(1000 * elapsed / len(questions), 2)}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--weights", type=float, nargs="+", default=[0.8],
                        help="hybrid's dense_weight values to measure")
    parser.add_argument("--json", type=Path, help="write the figures here")
    args = parser.parse_args(argv)
    rankings = [("dense", "dense", 0.8), ("bm25", "bm25", 0.8),
                *((f"hybrid w={w:g}", "hybrid", w) for w in args.weights)]
    rows = []
    with tempfile.TemporaryDirectory(prefix="cua-bench-rag-") as tmp:
        sets = {
            "paraphrase": (write_jsonl(Path(tmp) / "kb.jsonl"),
                           [(q, PLANTED_ID) for q in PLANTED_QUESTIONS] + OTHER_QUESTIONS),
        }
        people = Path(tmp) / "people.jsonl"
        sets["names"] = (people, names_set(people))
        for set_name, (corpus, questions) in sets.items():
            for label, retrieval, weight in rankings:
                retriever = Retriever.build(RagToolConfig(
                    corpus=corpus, retrieval=retrieval, dense_weight=weight, cache_dir=None))
                rows.append({"set": set_name, "ranking": label, "passages": retriever.size,
                             **measure(retriever, questions)})
    print(f"{'set':11} {'ranking':14} {'passages':>8} {'top-1':>9} {'top-5':>9} "
          f"{'MRR@10':>7} {'ms/query':>9}")
    for r in rows:
        print(f"{r['set']:11} {r['ranking']:14} {r['passages']:>8} "
              f"{r['top1']:>4}/{r['queries']:<4} {r['top5']:>4}/{r['queries']:<4} "
              f"{r['mrr10']:>7.3f} {r['ms_per_query']:>9.2f}")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
