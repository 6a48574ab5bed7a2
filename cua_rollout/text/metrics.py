"""The six answer metrics of a text benchmark: a prediction (the agent's final answer) against
the reference ``answer`` of a ``{id, question, answer, metadata}`` item.

Five are local and synchronous (:func:`score`): ``exact_match``, ``f1_score``, ``similarity``,
``contains_answer``, ``numeric_match``. The sixth, ``llm_judgement``, asks a judge model and is
asynchronous (:func:`judge`); the caller hands it an ``ask`` coroutine, so this module makes
no network call and imports only the standard library.

Each metric has two variants (docs/text_metrics.md tells them apart, case by case):

- ``original``: the definition of the framework the project started from (OpenDCAI/AgentFlow,
  ``src/benchmark/benchmark.py``), quirks kept, to reproduce its scores;
- ``normalized`` (the default): SQuAD-style text normalization (NFKC, case-folded, punctuation
  and the articles a/an/the dropped, whitespace collapsed) for the text metrics, and a number
  reader for ``numeric_match`` that understands thousands separators, currency, percent,
  scientific notation, fractions and LaTeX ``\\boxed{}`` / ``\\frac{}{}``.

Every score is in [0, 1]. A missing prediction (``None``: the episode produced no answer)
scores 0 without being looked at; several references score the best of them.
:func:`mean_score` averages a benchmark's scores counting failed episodes as 0, and
:class:`MetricSpec` / :func:`resolve_metric` pick the metric of each item (the benchmark file's,
or the item's own ``metadata["evaluation_metric"]``).

The local metrics are CPU-bound (``similarity`` takes ~0.1-0.2 s on a few thousand characters,
seconds on tens of thousands): a caller on an event loop runs :func:`score` in a thread.
"""

from __future__ import annotations

import difflib
import math
import re
import string
import unicodedata
from collections import Counter
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

__all__ = [
    "ABS_TOLERANCE",
    "JUDGE_SYSTEM_PROMPT",
    "LOCAL_METRICS",
    "METRICS",
    "VARIANTS",
    "Ask",
    "JudgeError",
    "MetricSpec",
    "judge",
    "judge_messages",
    "mean_score",
    "normalize_text",
    "parse_verdict",
    "resolve_metric",
    "score",
]

METRICS = ("exact_match", "f1_score", "similarity", "contains_answer", "numeric_match",
           "llm_judgement")
LOCAL_METRICS = METRICS[:5]  # what score() computes; llm_judgement goes through judge()
VARIANTS = ("original", "normalized")

# Sends chat messages to the judge model, returns the text of its reply.
Ask = Callable[[list[dict[str, str]]], Awaitable[str]]

# The absolute part of numeric_match's tolerance (normalized variant): a reference of 0 is
# matched by anything closer than this, where a relative tolerance alone would demand exact 0.
ABS_TOLERANCE = 1e-9


# ---------------------------------------------------------------------------------------------
# Text normalization (normalized variant of the text metrics)

_ARTICLES = re.compile(r"\b(?:a|an|the)\b")
_ASCII_PUNCTUATION = frozenset(string.punctuation)


def _is_punctuation(ch: str) -> bool:
    return ch in _ASCII_PUNCTUATION or unicodedata.category(ch).startswith("P")


def normalize_text(text: str) -> str:
    """SQuAD's answer normalization, made Unicode-aware: NFKC (full-width forms and
    ligatures become plain ones), case-folded, punctuation deleted (ASCII ``string.punctuation``
    as SQuAD, plus every Unicode punctuation character), the articles a/an/the dropped,
    whitespace collapsed. As in SQuAD, punctuation is deleted, not replaced by a space:
    ``"New-York"`` → ``"newyork"``, ``"3.5"`` → ``"35"``."""
    text = unicodedata.normalize("NFKC", text).casefold()
    text = "".join(ch for ch in text if not _is_punctuation(ch))
    text = _ARTICLES.sub(" ", text)
    return " ".join(text.split())


def _unspaced(ch: str) -> bool:
    """A character of a script written without spaces between words (Chinese, Japanese kana,
    Thai, Lao, Myanmar, Khmer): each such character is a word boundary of its own."""
    cp = ord(ch)
    return (0x2E80 <= cp <= 0x9FFF or 0xF900 <= cp <= 0xFAFF or 0x20000 <= cp <= 0x3FFFF
            or 0x0E00 <= cp <= 0x0EFF or 0x1000 <= cp <= 0x109F or 0x1780 <= cp <= 0x17FF)


def _joins(a: str, b: str) -> bool:
    """Whether two adjacent characters belong to one word (so a match may not split them)."""
    return a.isalnum() and b.isalnum() and not _unspaced(a) and not _unspaced(b)


# ---------------------------------------------------------------------------------------------
# Numbers (normalized variant of numeric_match)

_SUPERSCRIPTS = "⁰¹²³⁴⁵⁶⁷⁸⁹⁻⁺"
_SUPERSCRIPT_RUN = re.compile(f"[{_SUPERSCRIPTS}]+")
_FROM_SUPERSCRIPT = str.maketrans(_SUPERSCRIPTS, "0123456789-+")
_FRAC_AFTER_DIGIT = re.compile(r"(?<=\d)(\\[dt]?frac)")
_LATEX_FRAC = re.compile(
    r"\\[dt]?frac\s*\{\s*([-+]?[\d.,]+)\s*\}\s*\{\s*([-+]?[\d.,]+)\s*\}"
    r"|\\[dt]?frac\s*(\d)\s*(\d)")
_LATEX_THIN_SPACE_IN_NUMBER = re.compile(r"(?<=\d)\\[,!;: ](?=\d)")
_NUMBER = re.compile(
    r"""
    (?<![\w.])                                  # not inside a word, not after a decimal point
    (?P<sign>[-+])?
    (?:(?P<currency>[$€£¥₹₩])\s?(?P<sign2>[-+])?)?
    (?P<mantissa>\d{1,3}(?:,\d{3})+(?!\d)(?:\.\d+)?  # 1,234 or 1,234.5
               |\d+(?:\.\d+)?                   # 1234 or 1234.5
               |\.\d+)                          # .5
    (?:
        \s*/\s*(?P<den_sign>[-+])?(?P<denominator>\d+(?:\.\d+)?)(?![\d/])   # 3/4
      | [eE](?P<exp>[-+]?\d+)                                               # 1.5e3
      | \s*[×x*·]\s*10\s*\^\s*\{?\s*(?P<exp10>[-+]?\d+)\s*\}?               # 1.5 × 10^3
      | \s*\^\s*\{?\s*(?P<power>[-+]?\d+)\s*\}?                             # 2^{10}
    )?
    (?P<percent>\s*(?:%|percent\b|per\s+cent\b))?
    """,
    re.VERBOSE,
)


class _Number(NamedTuple):
    value: float
    percent: bool

    def readings(self) -> tuple[float, ...]:
        """The values this number may stand for: a percentage both as written (50) and as a
        fraction (0.5); any other number only as written."""
        return (self.value, self.value / 100) if self.percent else (self.value,)


def _math_text(text: str) -> str:
    """Plain text with numbers as _NUMBER reads them: superscripts as ``^{..}`` (before NFKC,
    which would turn ``10²`` into ``102``), NFKC, the Unicode minus, LaTeX fractions,
    ``{,}``, ``\\%``, ``\\$``, thin spaces inside numbers, ``\\times`` and ``\\cdot``."""
    text = _SUPERSCRIPT_RUN.sub(
        lambda m: "^{" + m.group().translate(_FROM_SUPERSCRIPT) + "}", text)
    text = unicodedata.normalize("NFKC", text)
    text = text.replace("\u2212", "-").replace("\u2044", "/")  # minus sign; ½ → 1⁄2 → 1/2
    text = _FRAC_AFTER_DIGIT.sub(r" \1", text)  # 2\frac{1}{2}: not "21/2"
    text = _LATEX_FRAC.sub(lambda m: "/".join(g for g in m.groups() if g is not None), text)
    text = text.replace("{,}", ",").replace("\\%", "%").replace("\\$", "$")
    text = _LATEX_THIN_SPACE_IN_NUMBER.sub("", text)
    return text.replace("\\times", "×").replace("\\cdot", "·")


def _last_boxed(text: str) -> str | None:
    """The content of the last ``\\boxed{...}`` (or ``\\fbox{...}``), braces balanced; an
    unclosed box runs to the end. None when there is no box."""
    starts = [(text.rfind(cmd), cmd) for cmd in ("\\boxed", "\\fbox")]
    start, cmd = max(starts)
    if start < 0:
        return None
    i = start + len(cmd)
    while i < len(text) and text[i].isspace():
        i += 1
    if i >= len(text) or text[i] != "{":
        return None
    depth = 0
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[i + 1:j]
    return text[i + 1:]


def _number_value(m: re.Match[str]) -> float | None:
    mantissa = m["mantissa"].replace(",", "")
    exponent = m["exp"] if m["exp"] is not None else m["exp10"]
    try:
        value = float(f"{mantissa}e{exponent}" if exponent is not None else mantissa)
        if m["power"] is not None:
            value = value ** int(m["power"])
        if m["denominator"] is not None:
            value = value / float(m["denominator"])
            if m["den_sign"] == "-":
                value = -value
    except (OverflowError, ZeroDivisionError, ValueError):
        return None
    if not math.isfinite(value):
        return None
    return -value if "-" in (m["sign"], m["sign2"]) else value


def _answer_number(text: str) -> _Number | None:
    """The number a text answers with: the last number of its last ``\\boxed{}`` if it has
    one, else the last number of the text. None when there is none, or when that last number
    cannot be a value (``1/0``, an overflow)."""
    text = _math_text(text)
    boxed = _last_boxed(text)
    last = None
    for m in _NUMBER.finditer(text if boxed is None else boxed):
        last = m
    if last is None:
        return None
    value = _number_value(last)
    return None if value is None else _Number(value, last["percent"] is not None)


# ---------------------------------------------------------------------------------------------
# The metrics, (prediction, reference, tolerance) -> score, one function per variant

def _exact_match_original(prediction: str, reference: str, tolerance: float) -> float:
    return float(reference.strip() == prediction.strip())


def _exact_match_normalized(prediction: str, reference: str, tolerance: float) -> float:
    return float(normalize_text(prediction) == normalize_text(reference))


def _f1(overlap: int, n_prediction: int, n_reference: int) -> float:
    if overlap == 0:
        return 0.0
    precision, recall = overlap / n_prediction, overlap / n_reference
    return 2 * precision * recall / (precision + recall)


def _f1_score_original(prediction: str, reference: str, tolerance: float) -> float:
    # Sets of lower-cased whitespace tokens: a repeated word counts once, punctuation stays
    # attached ("paris." is not "paris").
    pred, ref = set(prediction.lower().split()), set(reference.lower().split())
    if not pred or not ref:
        return float(not pred and not ref)
    return _f1(len(pred & ref), len(pred), len(ref))


def _f1_score_normalized(prediction: str, reference: str, tolerance: float) -> float:
    # SQuAD: bags (multisets) of normalized tokens.
    pred, ref = normalize_text(prediction).split(), normalize_text(reference).split()
    if not pred or not ref:
        return float(not pred and not ref)
    return _f1(sum((Counter(pred) & Counter(ref)).values()), len(pred), len(ref))


def _similarity_original(prediction: str, reference: str, tolerance: float) -> float:
    # The raw strings, difflib's defaults (autojunk on from 200 characters of prediction).
    return difflib.SequenceMatcher(None, reference, prediction).ratio()


def _similarity_normalized(prediction: str, reference: str, tolerance: float) -> float:
    # autojunk off: on character sequences of 200+ it junks every frequent letter and space.
    return difflib.SequenceMatcher(None, normalize_text(reference), normalize_text(prediction),
                                   autojunk=False).ratio()


def _contains_answer_original(prediction: str, reference: str, tolerance: float) -> float:
    # A plain substring: "cat" is in "concatenate", "4" in "14", and "" in anything.
    return float(reference.strip().lower() in prediction.strip().lower())


def _contains_answer_normalized(prediction: str, reference: str, tolerance: float) -> float:
    pred, ref = normalize_text(prediction), normalize_text(reference)
    if not ref:
        return float(not pred)
    start = pred.find(ref)
    while start >= 0:
        end = start + len(ref)
        if ((start == 0 or not _joins(pred[start - 1], ref[0]))
                and (end == len(pred) or not _joins(ref[-1], pred[end]))):
            return 1.0
        start = pred.find(ref, start + 1)
    return 0.0


_ORIGINAL_NUMBER = re.compile(r"-?\d+\.?\d*")


def _numeric_match_original(prediction: str, reference: str, tolerance: float) -> float:
    # Every "-?digits[.digits]" of each side; 1.0 when any reference number is within the
    # (absolute, strict) tolerance of any prediction number, or when neither side has one.
    ref = [float(x) for x in _ORIGINAL_NUMBER.findall(reference)]
    pred = [float(x) for x in _ORIGINAL_NUMBER.findall(prediction)]
    if not ref or not pred:
        return float(not ref and not pred)
    return float(any(abs(r - p) < tolerance for r in ref for p in pred))


def _numeric_match_normalized(prediction: str, reference: str, tolerance: float) -> float:
    ref, pred = _answer_number(reference), _answer_number(prediction)
    if ref is None or pred is None:
        return 0.0
    return float(any(math.isclose(p, r, rel_tol=tolerance, abs_tol=ABS_TOLERANCE)
                     for r in ref.readings() for p in pred.readings()))


_Scorer = Callable[[str, str, float], float]
_SCORERS: dict[tuple[str, str], _Scorer] = {
    ("exact_match", "original"): _exact_match_original,
    ("exact_match", "normalized"): _exact_match_normalized,
    ("f1_score", "original"): _f1_score_original,
    ("f1_score", "normalized"): _f1_score_normalized,
    ("similarity", "original"): _similarity_original,
    ("similarity", "normalized"): _similarity_normalized,
    ("contains_answer", "original"): _contains_answer_original,
    ("contains_answer", "normalized"): _contains_answer_normalized,
    ("numeric_match", "original"): _numeric_match_original,
    ("numeric_match", "normalized"): _numeric_match_normalized,
}


def _check_variant(variant: str) -> None:
    if variant not in VARIANTS:
        raise ValueError(f"unknown metric variant {variant!r}; known: {', '.join(VARIANTS)}")


def _references(reference: Any) -> list[str]:
    """The reference answers: a string, or a non-empty list of them. A number is taken as
    its ``str()``, as the original's loader turned non-string answers into strings."""
    items = list(reference) if isinstance(reference, list | tuple) else [reference]
    if not items:
        raise ValueError("no reference answer (an empty list)")
    out = []
    for item in items:
        if isinstance(item, str):
            out.append(item)
        elif isinstance(item, int | float) and not isinstance(item, bool):
            out.append(str(item))
        else:
            raise TypeError(f"a reference answer must be a string, not {type(item).__name__}")
    return out


def score(metric: str, prediction: str | None, reference: str | list[str], *,
          variant: str = "normalized", tolerance: float = 1e-6) -> float:
    """The score in [0, 1] of ``prediction`` against ``reference`` by one of the five local
    metrics. ``prediction`` None (no answer) scores 0; a list of references scores the best
    of them. ``tolerance`` is numeric_match's: relative (plus an absolute 1e-9) in the
    normalized variant, absolute in the original one (whose constant was 1e-6)."""
    if metric == "llm_judgement":
        raise ValueError("llm_judgement asks a judge model: use judge(), not score()")
    if metric not in LOCAL_METRICS:
        raise ValueError(f"unknown metric {metric!r}; known: {', '.join(METRICS)}")
    _check_variant(variant)
    if not (math.isfinite(tolerance) and tolerance >= 0):
        raise ValueError(f"tolerance must be a finite number >= 0, not {tolerance!r}")
    references = _references(reference)
    if prediction is None:
        return 0.0
    if not isinstance(prediction, str):
        raise TypeError(f"a prediction must be a string or None, not {type(prediction).__name__}")
    scorer = _SCORERS[metric, variant]
    return max(scorer(prediction, ref, tolerance) for ref in references)


# ---------------------------------------------------------------------------------------------
# llm_judgement

class JudgeError(ValueError):
    """The judge's reply says neither Correct nor Incorrect. The caller decides what it is
    worth (the rollout counts it as a failed judgement)."""

    def __init__(self, reply: object) -> None:
        self.reply = reply
        shown = reply if not isinstance(reply, str) or len(reply) <= 300 else reply[:300] + "…"
        super().__init__(f"the judge replied neither Correct nor Incorrect: {shown!r}")


JUDGE_SYSTEM_PROMPT = ("You grade answers to questions. You reply with exactly one word: "
                       "Correct or Incorrect.")


def judge_messages(prediction: str, reference: str | list[str],
                   question: str) -> list[dict[str, str]]:
    """The chat messages asking a judge whether ``prediction`` answers ``question`` as the
    reference does: the question, the reference answer(s), the prediction, and the
    instruction to reply exactly ``Correct`` or ``Incorrect``."""
    references = _references(reference)
    if len(references) == 1:
        ref_block = f"Reference answer:\n{references[0]}"
    else:
        ref_block = ("Reference answers (matching any one of them is enough):\n"
                     + "\n".join(f"- {r}" for r in references))
    user = (f"Question:\n{question}\n\n{ref_block}\n\nModel's answer:\n{prediction}\n\n"
            "Does the model's answer give the same answer as the reference? Reply with "
            "exactly one word: Correct if it does, Incorrect if it does not. No other text.")
    return [{"role": "system", "content": JUDGE_SYSTEM_PROMPT}, {"role": "user", "content": user}]


_VERDICT = re.compile(r"\b(correct|incorrect)\b", re.IGNORECASE)
_THINKING = re.compile(r"<think>.*?</think>", re.DOTALL | re.IGNORECASE)


def parse_verdict(reply: str, *, variant: str = "normalized") -> float:
    """1.0 for Correct, 0.0 for Incorrect. Normalized: the first of the two words found
    as a whole word, any case, after a ``<think>…</think>`` block (``Incorrect`` is never
    read as ``Correct``, "correctly" is neither), and :class:`JudgeError` when there is
    neither. Original: 1.0 only for a reply that is exactly ``Correct`` once stripped,
    0.0 for anything else. A reply that is not a string raises JudgeError in both."""
    _check_variant(variant)
    if not isinstance(reply, str):
        raise JudgeError(reply)
    if variant == "original":
        return float(reply.strip() == "Correct")
    found = _VERDICT.search(_THINKING.sub(" ", reply))
    if found is None:
        raise JudgeError(reply)
    return float(found.group(1).lower() == "correct")


async def judge(prediction: str | None, reference: str | list[str], question: str, *,
                ask: Ask, variant: str = "normalized") -> float:
    """llm_judgement: ask the judge model (``ask`` sends chat messages, returns its reply
    text) and read its verdict with :func:`parse_verdict`. A missing prediction scores 0
    without asking. Raises JudgeError for a reply that is neither verdict (normalized)."""
    _check_variant(variant)
    references = _references(reference)
    if prediction is None:
        return 0.0
    if not isinstance(prediction, str):
        raise TypeError(f"a prediction must be a string or None, not {type(prediction).__name__}")
    reply = await ask(judge_messages(prediction, references, question))
    return parse_verdict(reply, variant=variant)


# ---------------------------------------------------------------------------------------------
# Aggregation and the metric of each item

def mean_score(scores: Sequence[float | None]) -> float:
    """The benchmark's score: the mean over every episode, a failed one (None: no answer, a
    failed judgement) counting as 0. An empty list scores 0. (The original dropped failed
    episodes from the average, which rewards failing on hard items.)"""
    if not scores:
        return 0.0
    return sum(0.0 if s is None else s for s in scores) / len(scores)


def resolve_metric(item_metadata: Mapping[str, Any] | None, benchmark_default: str, *,
                   item_id: object = None) -> str:
    """The metric that scores one item: its ``metadata["evaluation_metric"]`` when set, else
    the benchmark file's ``benchmark_default``. An unknown name raises ValueError naming the
    item's id and the known metrics."""
    known = ", ".join(METRICS)
    if benchmark_default not in METRICS:
        raise ValueError(f"unknown benchmark metric {benchmark_default!r}; known: {known}")
    override = (item_metadata or {}).get("evaluation_metric")
    if override is None:
        return benchmark_default
    if not isinstance(override, str) or override not in METRICS:
        raise ValueError(f"item {item_id!r}: unknown evaluation_metric {override!r}; "
                         f"known: {known}")
    return override


@dataclass(frozen=True)
class MetricSpec:
    """How a benchmark file is scored: its default metric (an item may name its own in
    ``metadata["evaluation_metric"]``), the variant, and numeric_match's tolerance."""

    metric: str = "exact_match"
    variant: str = "normalized"
    tolerance: float = 1e-6

    def __post_init__(self) -> None:
        resolve_metric(None, self.metric)
        _check_variant(self.variant)
        if not (math.isfinite(self.tolerance) and self.tolerance >= 0):
            raise ValueError(f"tolerance must be a finite number >= 0, not {self.tolerance!r}")

    def metric_for(self, item: Mapping[str, Any]) -> str:
        """The metric of one ``{id, question, answer, metadata}`` item."""
        return resolve_metric(item.get("metadata"), self.metric, item_id=item.get("id"))

    async def evaluate(self, item: Mapping[str, Any], prediction: str | None, *,
                       ask: Ask | None = None) -> float:
        """Score ``prediction`` for ``item`` by the item's metric; ``ask`` is required when
        that metric is llm_judgement (JudgeError propagates to the caller)."""
        metric = self.metric_for(item)
        reference = item.get("answer")
        if reference is None:
            raise ValueError(f"item {item.get('id')!r} has no answer")
        if metric != "llm_judgement":
            return score(metric, prediction, reference, variant=self.variant,
                         tolerance=self.tolerance)
        if ask is None:
            raise ValueError(f"item {item.get('id')!r} is scored by llm_judgement: "
                             "a judge (ask) is required")
        return await judge(prediction, reference, str(item.get("question") or ""), ask=ask,
                           variant=self.variant)
