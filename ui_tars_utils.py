"""The UI-TARS action protocol: model text -> typed actions -> pyautogui code, and back.

Pure functions, no I/O. Coordinates: UI-TARS 1.5 answers in pixels of the ``smart_resize``d
image, UI-TARS 1.0 in relative units 0..1000; every ``Action`` carries SCREEN pixels.
"""

from __future__ import annotations

import functools
import math
import re
from dataclasses import dataclass, field
from typing import Literal

from rollout.envs.contract import DONE, FAIL, WAIT
from rollout.errors import ActionParseError

__all__ = [
    "ACTION_KINDS", "ACTION_REGEX_CONTENT_CHARS", "ACTION_REGEX_THOUGHT_CHARS", "FAMILIES",
    "IMAGE_FACTOR", "IMAGE_WRAPPER_TOKENS", "KEY_KINDS", "MAX_PIXELS", "MAX_RATIO",
    "MIN_PIXELS", "POINTER_KINDS", "RELATIVE_SCALE", "SCROLL_DIRECTIONS", "TERMINAL_KINDS",
    "Action", "Family", "ParsedResponse", "action_regex", "action_regex_max_chars",
    "add_box_token", "format_action", "format_response", "image_tokens", "model_to_screen",
    "normalize_key", "parse_response", "screen_to_model", "smart_resize", "split_terminal",
    "to_pyautogui",
]

Family = Literal["uitars-1.5", "uitars-1.0"]
FAMILIES: tuple[str, ...] = ("uitars-1.5", "uitars-1.0")

# Qwen2.5-VL's image grid: sides are multiples of 28 px, area between these bounds.
IMAGE_FACTOR = 28
MIN_PIXELS = 100 * 28 * 28
MAX_PIXELS = 16384 * 28 * 28
MAX_RATIO = 200
RELATIVE_SCALE = 1000  # UI-TARS 1.0: coordinates in 0..1000 on each axis
# Tokens around each image's tokens in the prompt: <|vision_start|> and <|vision_end|>.
IMAGE_WRAPPER_TOKENS = 2

POINTER_KINDS = frozenset({"click", "left_double", "right_single", "hover"})
KEY_KINDS = frozenset({"hotkey", "press", "keydown", "keyup"})
TERMINAL_KINDS = frozenset({"finished", "wait", "call_user"})
ACTION_KINDS = frozenset(
    POINTER_KINDS | KEY_KINDS | TERMINAL_KINDS | {"drag", "type", "scroll"}
)
SCROLL_DIRECTIONS = ("up", "down", "left", "right")

# Names seen in the wild for the same action.
_KIND_ALIASES = {"left_single": "click", "select": "drag", "mouse_move": "hover"}
# Parameter names per kind, in positional order; aliases map onto them.
_PARAMS: dict[str, tuple[str, ...]] = {
    **{k: ("start_box",) for k in POINTER_KINDS},
    "drag": ("start_box", "end_box"),
    "scroll": ("start_box", "direction"),
    **{k: ("key",) for k in KEY_KINDS},
    "type": ("content",),
    "finished": ("content",),
    "wait": (),
    "call_user": (),
}
_PARAM_ALIASES = {
    "point": "start_box",
    "start_point": "start_box",
    "end_point": "end_box",
    "keys": "key",
    "hotkey": "key",
    "text": "content",
}
_REQUIRED: dict[str, tuple[str, ...]] = {
    **{k: ("start_box",) for k in POINTER_KINDS},
    "drag": ("start_box", "end_box"),
    "scroll": ("direction",),
    **{k: ("key",) for k in KEY_KINDS},
    "type": ("content",),
}

# pyautogui's key names (KEYBOARD_KEYS minus the whitespace characters, which cannot be
# written in a space-separated key list), kept here so this module needs no display.
_NAMED_KEYS = frozenset([
    "accept", "add", "alt", "altleft", "altright", "apps", "backspace", "browserback",
    "browserfavorites", "browserforward", "browserhome", "browserrefresh", "browsersearch",
    "browserstop", "capslock", "clear", "convert", "ctrl", "ctrlleft", "ctrlright", "decimal",
    "del", "delete", "divide", "down", "end", "enter", "esc", "escape", "execute", "final",
    "fn", "hanguel", "hangul", "hanja", "help", "home", "insert", "junja", "kana", "kanji",
    "launchapp1", "launchapp2", "launchmail", "launchmediaselect", "left", "modechange",
    "multiply", "nexttrack", "nonconvert", "num0", "num1", "num2", "num3", "num4", "num5",
    "num6", "num7", "num8", "num9", "numlock", "pagedown", "pageup", "pause", "pgdn", "pgup",
    "playpause", "prevtrack", "print", "printscreen", "prntscrn", "prtsc", "prtscr", "return",
    "right", "scrolllock", "select", "separator", "shift", "shiftleft", "shiftright", "sleep",
    "space", "stop", "subtract", "tab", "up", "volumedown", "volumemute", "volumeup", "win",
    "winleft", "winright", "yen", "command", "option", "optionleft", "optionright",
]) | {f"f{i}" for i in range(1, 25)}
_CHAR_KEYS = frozenset("abcdefghijklmnopqrstuvwxyz0123456789`-=[]\\;',./!@#$%^&*()_+{}|:\"<>?~")
# Normalisation of the names models and other toolkits use.
_KEY_ALIASES = {
    "control": "ctrl", "ctl": "ctrl", "ctrl_l": "ctrl", "control_l": "ctrl",
    "arrowleft": "left", "arrowright": "right", "arrowup": "up", "arrowdown": "down",
    "leftarrow": "left", "rightarrow": "right", "uparrow": "up", "downarrow": "down",
    "arrow_left": "left", "arrow_right": "right", "arrow_up": "up", "arrow_down": "down",
    "escape": "esc", "return": "enter", "spacebar": "space", "del": "delete",
    "pgup": "pageup", "pgdn": "pagedown", "page_up": "pageup", "page_down": "pagedown",
    "cmd": "win", "super": "win", "meta": "win", "windows": "win", "super_l": "win",
    "caps_lock": "capslock", "caps": "capslock", "bksp": "backspace", "back_space": "backspace",
    "ins": "insert", "prtsc": "printscreen", "print_screen": "printscreen",
    "plus": "+", "minus": "-", "alt_l": "alt", "shift_l": "shift", "opt": "alt",
    "option": "alt",
}

_BOX_TOKENS = ("<|box_start|>", "<|box_end|>")
_NUM = r"-?\d+(?:\.\d+)?"
# One comma with optional spaces, or spaces alone. Written without overlapping "\s*[,\s]\s*"
# so that a long run of spaces cannot make the match backtrack for minutes.
_SEP = r"(?:\s*,\s*|\s+)"
_BOX_RE = re.compile(
    rf"^[\(\[]?\s*({_NUM}){_SEP}({_NUM})(?:{_SEP}({_NUM}){_SEP}({_NUM}))?\s*[\)\]]?$"
)
_POINT_TAG_RE = re.compile(r"<(point|bbox)>(.*?)</\1>", re.S)
_HEADER_RE = re.compile(r"(?:^|\n)[ \t]*(Thought|Reflection|Action_Summary|Action)[ \t]*[:：]")
_INLINE_ACTION_RE = re.compile(r"(?<![A-Za-z0-9_])Action[ \t]*[:：]")
_REPEATED_ACTION_RE = re.compile(r"(?m)^[ \t]*Action[ \t]*[:：][ \t]*")
_IDENT_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_CALL_START_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*[ \t]*\(")
_KWARG_RE = re.compile(r"([A-Za-z_][A-Za-z0-9_]*)\s*=\s*")
_NEXT_KWARG_RE = re.compile(r"\s*,\s*[A-Za-z_][A-Za-z0-9_]*\s*=")
_NEXT_QUOTED_RE = re.compile(r"\s*,\s*['\"]")
_ESCAPES = {"n": "\n", "t": "\t", "'": "'", '"': '"', "\\": "\\"}


# --------------------------------------------------------------------------- coordinates


def smart_resize(
    height: int,
    width: int,
    factor: int = IMAGE_FACTOR,
    min_pixels: int = MIN_PIXELS,
    max_pixels: int = MAX_PIXELS,
) -> tuple[int, int]:
    """The image size the model sees: each side a multiple of ``factor``, the area within
    ``[min_pixels, max_pixels]``, the aspect ratio kept as closely as possible.

    Same semantics as Qwen2.5-VL / UI-TARS (Python's round-half-even included):
    ``smart_resize(1080, 1920) == (1092, 1932)``.
    """
    if height <= 0 or width <= 0:
        raise ValueError(f"image size must be positive, got {height}x{width}")
    ratio = max(height, width) / min(height, width)
    if ratio > MAX_RATIO:
        raise ValueError(f"aspect ratio must be at most {MAX_RATIO}, got {ratio}")
    h_bar = max(factor, round(height / factor) * factor)
    w_bar = max(factor, round(width / factor) * factor)
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = math.floor(height / beta / factor) * factor
        w_bar = math.floor(width / beta / factor) * factor
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def image_tokens(
    width: int, height: int, *, min_pixels: int = MIN_PIXELS, max_pixels: int = MAX_PIXELS
) -> int:
    """The image tokens a Qwen2-VL / Qwen2.5-VL processor makes of a ``width`` x ``height``
    screenshot: one per 28x28 block of the ``smart_resize``d image (1280x720 -> 728x1288 ->
    1196). Without the ``IMAGE_WRAPPER_TOKENS`` (``<|vision_start|>``, ``<|vision_end|>``)."""
    h_bar, w_bar = smart_resize(height, width, min_pixels=min_pixels, max_pixels=max_pixels)
    return (h_bar // IMAGE_FACTOR) * (w_bar // IMAGE_FACTOR)


def _model_frame(
    screen_width: int,
    screen_height: int,
    family: str,
    *,
    min_pixels: int = MIN_PIXELS,
    max_pixels: int = MAX_PIXELS,
) -> tuple[float, float]:
    """Width and height of the coordinate frame the model answers in. ``min_pixels`` and
    ``max_pixels`` are the image processor's bounds (UI-TARS 1.5 only: 1.0 is relative)."""
    if family == "uitars-1.5":
        h, w = smart_resize(
            screen_height, screen_width, min_pixels=min_pixels, max_pixels=max_pixels
        )
        return float(w), float(h)
    if family == "uitars-1.0":
        return float(RELATIVE_SCALE), float(RELATIVE_SCALE)
    raise ValueError(f"unknown model family {family!r}; expected one of {', '.join(FAMILIES)}")


def model_to_screen(
    point: tuple[float, float],
    screen_width: int,
    screen_height: int,
    family: str = "uitars-1.5",
    *,
    min_pixels: int = MIN_PIXELS,
    max_pixels: int = MAX_PIXELS,
) -> tuple[int, int]:
    """Map a point the model wrote to integer screen pixels, clamped onto the screen."""
    fw, fh = _model_frame(
        screen_width, screen_height, family, min_pixels=min_pixels, max_pixels=max_pixels
    )
    x = round(point[0] / fw * screen_width)
    y = round(point[1] / fh * screen_height)
    return min(max(x, 0), screen_width - 1), min(max(y, 0), screen_height - 1)


def screen_to_model(
    point: tuple[float, float],
    screen_width: int,
    screen_height: int,
    family: str = "uitars-1.5",
    *,
    min_pixels: int = MIN_PIXELS,
    max_pixels: int = MAX_PIXELS,
) -> tuple[int, int]:
    """Map screen pixels to the integer coordinates the model would write for them, clamped
    into the model's frame (``0..w_bar-1`` for UI-TARS 1.5, ``0..1000`` for 1.0): on a screen
    over twice the frame's size, its last pixels would otherwise round to ``w_bar``."""
    frame = _model_frame(
        screen_width, screen_height, family, min_pixels=min_pixels, max_pixels=max_pixels
    )
    x_max, y_max = _frame_limits(frame, family)
    x = round(point[0] / screen_width * frame[0])
    y = round(point[1] / screen_height * frame[1])
    return min(max(x, 0), x_max), min(max(y, 0), y_max)


def _frame_limits(frame: tuple[float, float], family: str) -> tuple[int, int]:
    """The largest x and y the model may write in ``frame``: ``w_bar - 1`` / ``h_bar - 1``
    in 1.5's pixel frame, 1000 in 1.0's relative one."""
    if family == "uitars-1.0":
        return RELATIVE_SCALE, RELATIVE_SCALE
    return int(frame[0]) - 1, int(frame[1]) - 1


# --------------------------------------------------------------------------- typed actions


@dataclass
class Action:
    """One UI-TARS action. Points are SCREEN pixels; ``model_point`` is what the model wrote."""

    kind: str
    point: tuple[int, int] | None = None
    end_point: tuple[int, int] | None = None
    content: str | None = None
    keys: list[str] = field(default_factory=list)
    direction: str | None = None
    model_point: tuple[float, float] | None = None
    model_end_point: tuple[float, float] | None = None
    call: str = ""


@dataclass
class ParsedResponse:
    """A model reply: its reasoning parts and the actions to run, in order."""

    thought: str | None
    reflection: str | None
    action_summary: str | None
    actions: list[Action]
    text: str

    @property
    def terminal(self) -> str | None:
        """The kind of the first finished / wait / call_user action, if any."""
        return next((a.kind for a in self.actions if a.kind in TERMINAL_KINDS), None)


def parse_response(
    text: str,
    screen_width: int,
    screen_height: int,
    family: str = "uitars-1.5",
    *,
    min_pixels: int = MIN_PIXELS,
    max_pixels: int = MAX_PIXELS,
) -> ParsedResponse:
    """Parse a UI-TARS reply (``Thought: ...\\nAction: ...``) into typed actions.

    Accepts the variants seen from UI-TARS 1.0/1.5 and Doubao servers: ``Reflection:`` and
    ``Action_Summary:`` prefixes, the full-width colon, several actions separated by blank
    lines, ``<|box_start|>`` wrappers, four-number boxes (centre taken), ``<point>x y</point>``
    and ``<bbox>`` tags, ``point=``/``start_point=``/``end_point=`` names, positional
    arguments, escaped quotes and newlines. Anything else raises ``ActionParseError``.
    ``min_pixels`` / ``max_pixels``: the serving image processor's bounds, which set the
    frame UI-TARS 1.5 answers in.
    """
    if not isinstance(text, str):
        raise ActionParseError("model reply is not text", repr(text))
    pixels = {"min_pixels": min_pixels, "max_pixels": max_pixels}
    _model_frame(screen_width, screen_height, family, **pixels)  # validates family, size early
    body = text.strip()
    if not body:
        raise ActionParseError("empty model reply", text)

    headers = list(_HEADER_RE.finditer(body))
    action_m = _find_action(body, headers)
    sections: dict[str, str] = {}
    if action_m is None:
        if not _is_bare_call(body, headers):
            raise ActionParseError("no 'Action:' in the model reply", text)
        action_text = body
    else:
        before = [m for m in headers if m.start() < action_m.start()]
        for i, m in enumerate(before):
            end = before[i + 1].start() if i + 1 < len(before) else action_m.start()
            sections[m.group(1)] = body[m.end():end].strip()
        leading = body[: before[0].start() if before else action_m.start()].strip()
        if leading and "Thought" not in sections:
            sections["Thought"] = leading  # reasoning given without a "Thought:" label
        # A repeated "Action:" header before a later call is noise, not content.
        action_text = _REPEATED_ACTION_RE.sub("", body[action_m.end():]).strip()
    if not action_text:
        raise ActionParseError("'Action:' is empty", text)

    actions = [
        _build_action(name, args, call, screen_width, screen_height, family, **pixels)
        for name, args, call in _split_calls(action_text)
    ]
    return ParsedResponse(
        thought=sections.get("Thought") or None,
        reflection=sections.get("Reflection") or None,
        action_summary=sections.get("Action_Summary") or None,
        actions=actions,
        text=text,
    )


def _is_bare_call(body: str, headers: list[re.Match[str]]) -> bool:
    """Some deployments answer with the bare call(s) and no headers at all."""
    return not headers and bool(_CALL_START_RE.match(body)) and body.endswith(")")


def _find_action(body: str, headers: list[re.Match[str]]) -> re.Match[str] | None:
    """The ``Action:`` that starts the action part; ``None`` for bare calls or no action."""
    action_m = next((m for m in headers if m.group(1) == "Action"), None)
    # "Thought: ... Action: ..." on one line. A bare call is not searched: an "Action:"
    # inside its content is text to type, not a header.
    if action_m is None and not _is_bare_call(body.strip(), headers):
        action_m = _INLINE_ACTION_RE.search(body)
    return action_m


# --------------------------------------------------------------------------- call scanning


def _split_calls(action_text: str) -> list[tuple[str, list[tuple[str | None, str, bool]], str]]:
    """Split the action part into ``(name, [(key, value, quoted)], call_text)``.

    Quotes end where the argument list can go on (``, name=`` or the closing parenthesis),
    so an unescaped quote inside ``content`` does not cut it short. If scanning several
    calls fails, the whole part is read as one call with its arguments taken greedily.
    """
    try:
        calls = []
        pos = 0
        n = len(action_text)
        while pos < n:
            while pos < n and action_text[pos].isspace():
                pos += 1
            if pos >= n:
                break
            name, args, end = _scan_call(action_text, pos)
            calls.append((name, args, action_text[pos:end]))
            pos = end
        if not calls:
            raise ActionParseError("no action call", action_text)
        return calls
    except ActionParseError:
        whole = action_text.strip()
        m = _IDENT_RE.match(whole)
        if not m or not whole.endswith(")") or whole[m.end():m.end() + 1] != "(":
            raise
        inner = whole[m.end() + 1 : -1]
        return [(m.group(0), _scan_args(inner, 0, len(inner), greedy=True)[0], whole)]


def _scan_call(text: str, pos: int) -> tuple[str, list[tuple[str | None, str, bool]], int]:
    m = _IDENT_RE.match(text, pos)
    if not m:
        raise ActionParseError("expected an action call", text[pos:])
    after = m.end()
    while after < len(text) and text[after] in " \t":
        after += 1
    if after >= len(text) or text[after] != "(":
        raise ActionParseError("expected '(' after the action name", text[pos:])
    args, end = _scan_args(text, after + 1, len(text), greedy=False)
    return m.group(0), args, end


def _scan_args(
    text: str, pos: int, limit: int, *, greedy: bool
) -> tuple[list[tuple[str | None, str, bool]], int]:
    """Scan ``key=value`` / positional arguments until the closing ``)`` (or ``limit``)."""
    args: list[tuple[str | None, str, bool]] = []
    while True:
        while pos < limit and text[pos] in " \t\r\n,":
            pos += 1
        if pos >= limit:
            if greedy:
                return args, pos
            raise ActionParseError("unclosed '(' in action", text)
        if text[pos] == ")" and not greedy:
            return args, pos + 1
        key = None
        km = _KWARG_RE.match(text, pos)
        if km and km.end() <= limit:
            key, pos = km.group(1), km.end()
        if pos < limit and text[pos] in "'\"":
            value, pos = _scan_quoted(text, pos, limit, greedy=greedy, positional=key is None)
            args.append((key, value, True))
        else:
            start, depth = pos, 0
            while pos < limit:
                c = text[pos]
                if c in "([":
                    depth += 1
                elif c in ")]":
                    if depth == 0:
                        break
                    depth -= 1
                elif c == "," and depth == 0:
                    break
                pos += 1
            if depth:
                # Without this, the greedy re-scan of ``click(start_box=(1,2)`` would take the
                # box's ")" for the call's and accept a call that was never closed.
                raise ActionParseError("unbalanced brackets in argument", text[start:limit])
            value = text[start:pos].strip()
            if not value:
                raise ActionParseError("empty argument", text)
            args.append((key, value, False))


def _scan_quoted(
    text: str, pos: int, limit: int, *, greedy: bool, positional: bool = False
) -> tuple[str, int]:
    quote = text[pos]
    i = pos + 1
    candidate = -1
    while i < limit:
        c = text[i]
        if c == "\\":
            i += 2
            continue
        if c == quote:
            rest = i + 1
            if greedy:
                # In a lone call, the value runs to the last quote before the next key.
                if _NEXT_KWARG_RE.match(text, rest) or text[rest:limit].strip() == "":
                    candidate = i
                    if _NEXT_KWARG_RE.match(text, rest):
                        break
            else:
                j = rest
                while j < limit and text[j] in " \t":
                    j += 1
                if (
                    _NEXT_KWARG_RE.match(text, rest)
                    or (j < limit and text[j] == ")")
                    # drag('(1,2)', '(3,4)'): a positional string ends before the next one.
                    or (positional and _NEXT_QUOTED_RE.match(text, rest))
                ):
                    return _unescape(text[pos + 1 : i]), rest
        i += 1
    if greedy and candidate >= 0:
        return _unescape(text[pos + 1 : candidate]), candidate + 1
    raise ActionParseError("unterminated string in action", text[pos:limit])


def _unescape(raw: str) -> str:
    out = []
    i = 0
    while i < len(raw):
        c = raw[i]
        if c == "\\" and i + 1 < len(raw) and raw[i + 1] in _ESCAPES:
            out.append(_ESCAPES[raw[i + 1]])
            i += 2
        else:
            out.append(c)
            i += 1
    return "".join(out)


# --------------------------------------------------------------------------- action building


def _build_action(
    name: str,
    args: list[tuple[str | None, str, bool]],
    call: str,
    screen_width: int,
    screen_height: int,
    family: str,
    *,
    min_pixels: int = MIN_PIXELS,
    max_pixels: int = MAX_PIXELS,
) -> Action:
    kind = _KIND_ALIASES.get(name.lower(), name.lower())
    if kind not in ACTION_KINDS:
        raise ActionParseError(f"unknown action {name!r}", call)
    params = _PARAMS[kind]
    values: dict[str, str] = {}
    for index, (key, value, _quoted) in enumerate(args):
        if key is None:
            if index >= len(params):
                raise ActionParseError(f"too many arguments for {kind}()", call)
            key = params[index]
        key = _PARAM_ALIASES.get(key, key)
        if key not in params:
            raise ActionParseError(f"{kind}() takes no argument {key!r}", call)
        if key in values:
            raise ActionParseError(f"argument {key!r} given twice", call)
        values[key] = value
    for required in _REQUIRED.get(kind, ()):
        if required not in values:
            raise ActionParseError(f"{kind}() needs {required!r}", call)

    action = Action(kind=kind, call=call)
    pixels = {"min_pixels": min_pixels, "max_pixels": max_pixels}
    if "start_box" in values:
        action.model_point = _parse_box(values["start_box"], call)
        action.point = model_to_screen(
            action.model_point, screen_width, screen_height, family, **pixels
        )
    if "end_box" in values:
        action.model_end_point = _parse_box(values["end_box"], call)
        action.end_point = model_to_screen(
            action.model_end_point, screen_width, screen_height, family, **pixels
        )
    if "content" in values:
        action.content = values["content"]
    if "key" in values:
        action.keys = _parse_keys(values["key"], call)
        if kind != "hotkey" and len(action.keys) != 1:
            raise ActionParseError(f"{kind}() takes exactly one key", call)
    if "direction" in values:
        direction = values["direction"].strip().lower()
        if direction not in SCROLL_DIRECTIONS:
            raise ActionParseError(f"scroll direction must be one of {SCROLL_DIRECTIONS}", call)
        action.direction = direction
    return action


def _parse_box(value: str, call: str) -> tuple[float, float]:
    """``(x,y)``, ``(x1,y1,x2,y2)`` (centre), ``[..]``, box tokens, ``<point>``/``<bbox>`` tags."""
    s = value
    for token in _BOX_TOKENS:
        s = s.replace(token, "")
    s = s.strip()
    tag = _POINT_TAG_RE.fullmatch(s)
    if tag:
        s = tag.group(2).strip()
    m = _BOX_RE.fullmatch(s)
    if not m:
        raise ActionParseError(f"not a point or box: {value!r}", call)
    nums = [float(g) for g in m.groups() if g is not None]
    if any(v < 0 for v in nums):
        raise ActionParseError(f"negative coordinate in {value!r}", call)
    if len(nums) == 4:
        point = (nums[0] + nums[2]) / 2, (nums[1] + nums[3]) / 2
    else:
        point = nums[0], nums[1]
    # A run of hundreds of digits reads as infinity, which no pixel can be rounded to.
    if not all(math.isfinite(v) for v in point):
        raise ActionParseError(f"coordinate out of range in {value!r}", call)
    return point


def normalize_key(name: str) -> str:
    """A key name as pyautogui knows it (``ArrowLeft`` -> ``left``, ``Control`` -> ``ctrl``)."""
    k = name.strip()
    if len(k) == 1:
        return k.lower() if k.isalpha() else k
    k = k.lower()
    return _KEY_ALIASES.get(k, k)


def _parse_keys(value: str, call: str) -> list[str]:
    tokens: list[str] = []
    for token in value.split():
        if len(token) > 1 and "+" in token:
            # "ctrl+c" is two keys; in "ctrl++" the last "+" is the key itself.
            plus_key = token.endswith("++")
            combo = token[:-2] if plus_key else token
            tokens.extend(t for t in combo.split("+") if t)
            if plus_key:
                tokens.append("+")
        else:
            tokens.append(token)
    if not tokens:
        raise ActionParseError("empty key", call)
    keys = [normalize_key(t) for t in tokens]
    for key in keys:
        if key not in _NAMED_KEYS and key not in _CHAR_KEYS:
            raise ActionParseError(f"unknown key {key!r}", call)
    return keys


# --------------------------------------------------------------------------- code generation


def split_terminal(actions: list[Action]) -> tuple[list[Action], str | None]:
    """The actions to execute before the first terminal one, and that terminal kind."""
    for i, action in enumerate(actions):
        if action.kind in TERMINAL_KINDS:
            return actions[:i], action.kind
    return list(actions), None


def to_pyautogui(
    actions: list[Action],
    *,
    scroll_clicks: int = 5,
    drag_duration_s: float = 0.5,
    typing_interval_s: float = 0.01,
) -> str:
    """Python code for OSWorld's ``pyautogui`` action space, or ``DONE`` / ``WAIT`` / ``FAIL``.

    A terminal action anywhere wins, as in OSWorld's UI-TARS agent: ``finished`` -> ``DONE``,
    ``call_user`` -> ``FAIL``, ``wait`` -> ``WAIT`` (use ``split_terminal`` to run the
    actions before it first). Non-ASCII text is pasted through the clipboard (xclip), else
    typed with ``xdotool type``, since ``pyautogui.write`` drops such characters.
    The first line is always a simple statement, so the code can follow OSWorld's
    ``"import pyautogui; ...; "`` prefix.
    """
    kinds = {a.kind for a in actions}
    if "finished" in kinds:
        return DONE
    if "call_user" in kinds:
        return FAIL
    if "wait" in kinds:
        return WAIT
    if not actions:
        raise ValueError("no actions to convert")
    lines: list[str] = []
    for a in actions:
        lines.extend(_action_code(a, scroll_clicks, drag_duration_s, typing_interval_s))
    if any(line.startswith("_type_unicode(") for line in lines):
        lines = _UNICODE_HELPER + lines
    return "\n".join(lines)


def _action_code(a: Action, scroll_clicks: int, drag_s: float, interval_s: float) -> list[str]:
    if a.kind in POINTER_KINDS or a.kind == "drag":
        if a.point is None:
            raise ValueError(f"{a.kind} needs a point: {a}")
        x, y = a.point
    if a.kind == "click":
        return [f"pyautogui.click({x}, {y}, button='left')"]
    if a.kind == "left_double":
        return [f"pyautogui.doubleClick({x}, {y}, button='left')"]
    if a.kind == "right_single":
        return [f"pyautogui.click({x}, {y}, button='right')"]
    if a.kind == "hover":
        return [f"pyautogui.moveTo({x}, {y})"]
    if a.kind == "drag":
        if a.end_point is None:
            raise ValueError(f"drag needs an end point: {a}")
        ex, ey = a.end_point
        return [
            f"pyautogui.moveTo({x}, {y})",
            f"pyautogui.dragTo({ex}, {ey}, duration={drag_s}, button='left')",
        ]
    if a.kind == "hotkey":
        return [f"pyautogui.hotkey({', '.join(repr(k) for k in a.keys)})"]
    if a.kind == "press":
        return [f"pyautogui.press({a.keys[0]!r})"]
    if a.kind == "keydown":
        return [f"pyautogui.keyDown({a.keys[0]!r})"]
    if a.kind == "keyup":
        return [f"pyautogui.keyUp({a.keys[0]!r})"]
    if a.kind == "scroll":
        where = f", x={a.point[0]}, y={a.point[1]}" if a.point else ""
        if a.direction in ("up", "down"):
            clicks = scroll_clicks if a.direction == "up" else -scroll_clicks
            return [f"pyautogui.scroll({clicks}{where})"]
        clicks = scroll_clicks if a.direction == "right" else -scroll_clicks
        return [f"pyautogui.hscroll({clicks}{where})"]
    if a.kind == "type":
        return _type_code(a.content or "", interval_s)
    raise ValueError(f"{a.kind} has no pyautogui code")


# Defined once in code that types non-ASCII text (pyautogui.write drops such characters).
# Clipboard first: it keeps every character and case; xclip gets the text on stdin and no
# inherited stdout/stderr (it stays alive to serve the selection and would hold /execute's
# pipes open), and Ctrl+V waits until xclip really owns the text. xdotool is the fallback
# (it can drop characters at short delays and lowers Latin-1 capitals), pyperclip the last.
_UNICODE_HELPER = [
    "import os, shutil, subprocess, time",
    "def _type_unicode(text):",
    "    data = text.encode()",
    "    if shutil.which('xclip'):",
    "        subprocess.run(['xclip', '-selection', 'clipboard'], input=data,"
    " stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=True)",
    "        deadline = time.monotonic() + 2",
    "        while time.monotonic() < deadline and subprocess.run(['xclip', '-selection',"
    " 'clipboard', '-o'], capture_output=True).stdout != data:",
    "            time.sleep(0.01)",
    "        pyautogui.hotkey('ctrl', 'v')",
    "    elif shutil.which('xdotool'):",
    "        subprocess.run(['xdotool', 'type', '--delay', '50', '--', text],"
    " env={**os.environ, 'LC_ALL': 'C.UTF-8'}, check=True)",
    "    else:",
    "        import pyperclip",
    "        pyperclip.copy(text)",
    "        pyautogui.hotkey('ctrl', 'v')",
]


def _type_code(content: str, interval_s: float) -> list[str]:
    lines: list[str] = []
    segments = content.replace("\r\n", "\n").replace("\r", "\n").split("\n")
    for i, segment in enumerate(segments):
        if segment.isascii():
            # pyautogui on X11 types '<' with the ISO key's keycode plus Shift, giving '>'.
            for j, part in enumerate(segment.split("<")):
                if j:
                    lines.append("pyautogui.hotkey('shift', ',')")
                if part:
                    lines.append(f"pyautogui.write({part!r}, interval={interval_s})")
        else:
            lines.append(f"_type_unicode({segment!r})")
        if i < len(segments) - 1:
            lines.append("pyautogui.press('enter')")
    # A type() of nothing still has to be valid code.
    return lines or ["pass"]


# --------------------------------------------------------------------------- text for history


_BOX_ARG_RE = re.compile(
    r"(start_box|end_box|start_point|end_point|point)=(['\"])\s*(\(\s*\d+\s*,\s*\d+\s*\))\s*\2"
)


def add_box_token(text: str) -> str:
    """Wrap bare ``start_box='(x,y)'`` points of the action part in ``<|box_start|>`` tokens,
    as UI-TARS expects in its own past replies. Idempotent; reasoning text is untouched."""
    headers = list(_HEADER_RE.finditer(text))
    m = _find_action(text, headers)
    if m is not None:
        head, tail = text[: m.end()], text[m.end():]
    elif _is_bare_call(text.strip(), headers):
        head, tail = "", text
    else:
        return text
    tail = _BOX_ARG_RE.sub(
        lambda b: f"{b.group(1)}={b.group(2)}<|box_start|>{b.group(3)}<|box_end|>{b.group(2)}",
        tail,
    )
    return head + tail


def format_action(
    action: Action,
    screen_width: int,
    screen_height: int,
    family: str = "uitars-1.5",
    *,
    min_pixels: int = MIN_PIXELS,
    max_pixels: int = MAX_PIXELS,
) -> str:
    """The UI-TARS call for an action given in screen pixels (the inverse of parsing)."""

    def box(point: tuple[int, int]) -> str:
        x, y = screen_to_model(
            point, screen_width, screen_height, family, min_pixels=min_pixels,
            max_pixels=max_pixels,
        )
        return f"'({x},{y})'"

    def quoted(s: str) -> str:
        return "'" + s.replace("\\", "\\\\").replace("'", "\\'").replace("\n", "\\n") + "'"

    k = action.kind
    if k in POINTER_KINDS:
        assert action.point is not None
        return f"{k}(start_box={box(action.point)})"
    if k == "drag":
        assert action.point is not None and action.end_point is not None
        return f"drag(start_box={box(action.point)}, end_box={box(action.end_point)})"
    if k in KEY_KINDS:
        return f"{k}(key={quoted(' '.join(action.keys))})"
    if k == "type":
        return f"type(content={quoted(action.content or '')})"
    if k == "scroll":
        where = f"start_box={box(action.point)}, " if action.point else ""
        return f"scroll({where}direction='{action.direction}')"
    if k == "finished":
        return f"finished(content={quoted(action.content or '')})"
    return f"{k}()"


def format_response(
    thought: str,
    actions: list[Action],
    screen_width: int,
    screen_height: int,
    family: str = "uitars-1.5",
    *,
    min_pixels: int = MIN_PIXELS,
    max_pixels: int = MAX_PIXELS,
) -> str:
    """A whole reply in UI-TARS form: ``Thought: ...`` then the actions, blank-line separated."""
    calls = "\n\n".join(
        format_action(
            a, screen_width, screen_height, family, min_pixels=min_pixels, max_pixels=max_pixels
        )
        for a in actions
    )
    return f"Thought: {thought}\nAction: {calls}"


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
_REGEX_KEY_NAMES = tuple(sorted(_NAMED_KEYS, key=lambda k: (-len(k), k)))
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
    pixels = {"min_pixels": min_pixels, "max_pixels": max_pixels}
    x_max, y_max = _frame_limits(
        _model_frame(screen_width, screen_height, family, **pixels), family
    )
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
        _model_frame(1, 1, family)  # raises the unknown-family error
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
        frame = _model_frame(
            screen_width, screen_height, family, min_pixels=min_pixels, max_pixels=max_pixels
        )
        x_max, y_max = _frame_limits(frame, family)
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
