"""The action grammar for constrained decoding: a regular expression every reply the parser
accepts matches (``action_regex``), and the longest reply it allows."""

from __future__ import annotations

import functools
import math

from cua_rollout.agents.uitars.coordinates import RELATIVE_SCALE, frame_of
from cua_rollout.agents.uitars.parser import NAMED_KEYS, SCROLL_DIRECTIONS
from cua_rollout.core.errors import ConfigError
from cua_rollout.core.vision import (
    IMAGE_FACTOR,
    MAX_PIXELS,
    MAX_RATIO,
    MIN_PIXELS,
)

__all__ = ["ACTION_REGEX_CONTENT_CHARS", "ACTION_REGEX_THOUGHT_CHARS", "action_regex",
           "action_regex_max_chars", "check_max_tokens"]

# --------------------------------------------------------------------------- action grammar


ACTION_REGEX_THOUGHT_CHARS = 60  # longest thought the grammar allows
ACTION_REGEX_CONTENT_CHARS = 40  # most characters (or escapes) in type() / finished() content
_HOTKEY_MAX_KEYS = 3  # the prompt: "do not use more than 3 keys in one hotkey action"
# No colon and no newline: "Action:" can never start inside the thought.
_THOUGHT_CLASS = "[A-Za-z0-9 ,.'-]"
# One unit of quoted content: a printable ASCII character other than ' and \, or one of the
# escapes \' \" \n \\ (each unit is what the parser's quote scanner steps over at once).
_CONTENT_UNIT = r"""([ -&(-\[\]-~]|\\['"n\\])"""
# Named keys longest first (an automaton does not care; a backtracking engine tries fewer).
_REGEX_KEY_NAMES = tuple(sorted(NAMED_KEYS, key=lambda k: (-len(k), k)))
_REGEX_KEY = "(" + "|".join([*_REGEX_KEY_NAMES, "[a-z0-9]"]) + ")"
_REGEX_KEY_CHARS = max(len(k) for k in _REGEX_KEY_NAMES)


def _int_range_regex(hi: int) -> str:
    """A group matching exactly the decimal integers ``0..hi``, without leading zeros.

    Digit by digit: every number shorter than ``hi``, then for each position of ``hi`` the
    numbers that share its prefix and have a smaller digit there, then ``hi`` itself. Only
    literal digits, ``[..]`` classes and ``|``: no repetition, so any regex dialect reads it.
    """
    if hi < 0:
        raise ValueError(f"the upper bound must not be negative, got {hi}")
    s = str(hi)
    n = len(s)
    any_digit = "[0-9]"

    def digit_class(lo: int, top: int) -> str:
        return str(lo) if lo == top else f"[{lo}-{top}]"

    alts = []
    if n > 1:
        alts.append(any_digit)  # 0..9
        alts.extend("[1-9]" + any_digit * (length - 1) for length in range(2, n))
    for i, ch in enumerate(s):
        lo = 1 if i == 0 and n > 1 else 0
        if int(ch) > lo:
            alts.append(s[:i] + digit_class(lo, int(ch) - 1) + any_digit * (n - i - 1))
    alts.append(s)
    return "(" + "|".join(alts) + ")"


@functools.lru_cache(maxsize=256)
def action_regex(
    screen_width: int,
    screen_height: int,
    family: str = "uitars-1.5",
    *,
    call_user: bool = True,
    min_pixels: int = MIN_PIXELS,
    max_pixels: int = MAX_PIXELS,
) -> str:
    """A regular expression a whole reply must fully match: ``Thought: <thought>\\nAction:
    <one action>``, for constrained decoding (vLLM structured outputs, xgrammar / outlines).

    The actions are the prompt's action space (``prompts.build_prompt``) in plain form:
    ``click`` / ``left_double`` / ``right_single(start_box='(x,y)')``, ``drag(start_box=..,
    end_box=..)``, ``hotkey(key='k1 k2 k3')`` (1 to 3 pyautogui key names or characters
    ``[a-z0-9]``), ``type(content='..')``, ``scroll(start_box=.., direction='up|down|left|
    right')``, ``wait()``, ``finished(content='..')`` and, with ``call_user``, ``call_user()``.
    Points are integers without leading zeros inside the model's frame: ``0..w_bar-1`` x
    ``0..h_bar-1`` of ``smart_resize`` with the processor's ``min_pixels`` / ``max_pixels``
    (UI-TARS 1.5), ``0..1000`` on both axes (1.0). No ``<|box_start|>`` tokens: they are
    special tokens, not text a constrained sampler can produce. The thought has at most
    ``ACTION_REGEX_THOUGHT_CHARS`` characters of ``[A-Za-z0-9 ,.'-]``; content at most
    ``ACTION_REGEX_CONTENT_CHARS`` printable ASCII characters or escapes ``\\'``, ``\\"``,
    ``\\n``, ``\\\\``. Every reply it matches parses with ``parse_response`` (same screen,
    family and pixel bounds) to exactly one action, and is at most ``action_regex_max_chars``
    characters long.

    Dialect: literal characters, escaped metacharacters, ``\\n``, ``[...]`` classes, ``|``,
    plain groups and bounded repetition only (no ``\\d``, ``\\s``, ``(?``, ``*``, ``+``,
    anchors or lookarounds), so Python's ``re`` and vLLM's backends read it alike, and every
    match is bounded in length: a model cannot ramble until ``max_tokens``.

    Constrained sampling changes the policy: at each step the tokens the grammar forbids are
    masked out and the rest renormalised. The logprobs the server returns are those of this
    constrained process, not of the free model, and the replies are a narrower distribution
    (short ASCII thoughts, one action, none of the other forms the parser accepts). Training
    on them (importance ratios, KL terms) must treat the masked process as the behaviour
    policy.
    """
    x_max, y_max = frame_of(screen_width, screen_height, family, min_pixels=min_pixels,
                            max_pixels=max_pixels).limits
    point = r"'\(" + _int_range_regex(x_max) + "," + _int_range_regex(y_max) + r"\)'"
    content = f"'{_CONTENT_UNIT}{{0,{ACTION_REGEX_CONTENT_CHARS}}}'"
    keys = f"{_REGEX_KEY}( {_REGEX_KEY}){{0,{_HOTKEY_MAX_KEYS - 1}}}"
    directions = "(" + "|".join(SCROLL_DIRECTIONS) + ")"
    actions = [
        *(rf"{kind}\(start_box={point}\)" for kind in ("click", "left_double", "right_single")),
        rf"drag\(start_box={point}, end_box={point}\)",
        rf"hotkey\(key='{keys}'\)",
        rf"type\(content={content}\)",
        rf"scroll\(start_box={point}, direction='{directions}'\)",
        r"wait\(\)",
        rf"finished\(content={content}\)",
    ]
    if call_user:
        actions.append(r"call_user\(\)")
    thought = f"{_THOUGHT_CLASS}{{0,{ACTION_REGEX_THOUGHT_CHARS}}}"
    return rf"Thought: {thought}\nAction: (" + "|".join(actions) + ")"


def _max_frame_side(family: str, *, min_pixels: int, max_pixels: int) -> int:
    """An upper bound of the frame's longer side over every screen ``smart_resize`` accepts
    (aspect ratio at most ``MAX_RATIO``): kept as is, the area is at most ``max_pixels`` with a
    side of at least 28; scaled down, a side is at most ``sqrt(max_pixels * ratio)``; scaled
    up, at most ``sqrt(min_pixels * ratio) + 28``."""
    if family == "uitars-1.0":
        return RELATIVE_SCALE + 1
    if family != "uitars-1.5":
        frame_of(1, 1, family)  # raises the unknown-family error
    return max(
        max_pixels // IMAGE_FACTOR,
        math.isqrt(max_pixels * MAX_RATIO) + 1,
        math.isqrt(min_pixels * MAX_RATIO) + 1 + IMAGE_FACTOR,
    )


def action_regex_max_chars(
    screen_width: int | None = None,
    screen_height: int | None = None,
    family: str = "uitars-1.5",
    *,
    call_user: bool = True,
    min_pixels: int = MIN_PIXELS,
    max_pixels: int = MAX_PIXELS,
) -> int:
    """The length in characters of the longest reply ``action_regex`` (same arguments)
    matches; without a screen size, a bound over every screen. A reply of n characters is
    at most n tokens, so ``max_tokens`` of at least this never cuts a constrained reply."""
    if (screen_width is None) != (screen_height is None):
        raise ValueError("give both screen_width and screen_height, or neither")
    if screen_width is None or screen_height is None:
        side = _max_frame_side(family, min_pixels=min_pixels, max_pixels=max_pixels)
        x_max = y_max = side - 1
    else:
        x_max, y_max = frame_of(screen_width, screen_height, family, min_pixels=min_pixels,
                                max_pixels=max_pixels).limits
    point = len("'(,)'") + len(str(x_max)) + len(str(y_max))
    content = 2 + 2 * ACTION_REGEX_CONTENT_CHARS  # quotes, and each unit up to an escape pair
    keys = _HOTKEY_MAX_KEYS * _REGEX_KEY_CHARS + (_HOTKEY_MAX_KEYS - 1)
    action = max(
        len("right_single(start_box=)") + point,
        len("drag(start_box=, end_box=)") + 2 * point,
        len("hotkey(key='')") + keys,
        len("type(content=)") + content,
        len("scroll(start_box=, direction='')") + point + max(map(len, SCROLL_DIRECTIONS)),
        len("finished(content=)") + content,
        len("call_user()") if call_user else 0,
    )
    return len("Thought: \nAction: ") + ACTION_REGEX_THOUGHT_CHARS + action


def check_max_tokens(max_tokens: int) -> None:
    """``ConfigError`` when constrained decoding's ``max_tokens`` could cut a reply the grammar
    allows (a cut reply does not parse); checked at a run's start."""
    longest = action_regex_max_chars()
    if max_tokens < longest:
        raise ConfigError(
            f"agent.constrain_actions: model.sampling.max_tokens ({max_tokens}) must be at "
            f"least {longest}, the longest reply the action grammar allows (a cut reply does "
            "not parse)")
