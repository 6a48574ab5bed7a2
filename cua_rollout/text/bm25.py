"""Okapi BM25 over an inverted index: the lexical search of the web corpus server
(``web_corpus.py``) and the lexical half of the rag retriever's hybrid search (``rag.py``).

Our own ~50 lines rather than ``bm25s`` or ``rank-bm25``: a corpus here is one a person
wrote or a benchmark's passages (tens to ~10^5 documents), where scoring a query's posting
lists takes well under a millisecond to a few; ``rank-bm25`` scores every document for every
query with numpy and has not been released since 2022, and ``bm25s`` brings numpy and scipy
sparse matrices that only pay off on millions of documents. The scorer is Lucene's variant
(``idf = ln(1 + (N - df + 0.5) / (df + 0.5))``, always positive; ``k1 = 1.2``, ``b = 0.75``)
over lower-cased Unicode word tokens, without stemming or stop words.
"""

from __future__ import annotations

import math
import re
from collections import Counter, defaultdict
from collections.abc import Iterable

__all__ = ["TOKEN_RE", "BM25Index", "tokens"]

TOKEN_RE = re.compile(r"\w+")
"""A token: a run of Unicode word characters (matched on the case-folded text)."""


def tokens(text: str) -> list[str]:
    return TOKEN_RE.findall(text.casefold())


class BM25Index:
    """The documents' BM25 index; documents are numbered in the order given."""

    def __init__(self, documents: Iterable[str], *, k1: float = 1.2, b: float = 0.75) -> None:
        self.k1, self.b = k1, b
        self._lengths: list[int] = []
        self._postings: dict[str, list[tuple[int, int]]] = defaultdict(list)
        for doc, text in enumerate(documents):
            counts = Counter(tokens(text))
            self._lengths.append(sum(counts.values()))
            for term, tf in counts.items():
                self._postings[term].append((doc, tf))
        self._avg_length = (sum(self._lengths) / len(self._lengths)) if self._lengths else 1.0
        self._avg_length = self._avg_length or 1.0

    def __len__(self) -> int:
        return len(self._lengths)

    def idf(self, term: str) -> float:
        df = len(self._postings.get(term, ()))
        return math.log(1 + (len(self) - df + 0.5) / (df + 0.5))

    def search(self, query: str, k: int) -> list[tuple[int, float]]:
        """The ``k`` best documents for ``query`` as ``(number, score)``, best first;
        documents matching none of its words are left out, ties go to the lower number."""
        ranked = sorted(self.scores(query).items(), key=lambda item: (-item[1], item[0]))
        return ranked[:max(k, 0)]

    def scores(self, query: str) -> dict[int, float]:
        """The score of every document sharing a word with ``query``."""
        scores: dict[int, float] = defaultdict(float)
        for term in set(tokens(query)):
            postings = self._postings.get(term)
            if not postings:
                continue
            idf = self.idf(term)
            for doc, tf in postings:
                norm = self.k1 * (1 - self.b + self.b * self._lengths[doc] / self._avg_length)
                scores[doc] += idf * tf * (self.k1 + 1) / (tf + norm)
        return dict(scores)
