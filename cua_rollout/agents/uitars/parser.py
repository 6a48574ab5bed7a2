"""UI-TARS replies -> typed actions: the ``Thought:`` / ``Action:`` text, its calls scanned
as UI-TARS writes them (quotes, escapes, boxes, points), each checked and mapped to screen
pixels. Pure functions; a reply that does not parse is an ``ActionParseError``."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any

from cua_rollout.agents.uitars.coordinates import Frame, frame_of
from cua_rollout.core.errors import ActionParseError
from cua_rollout.core.vision import (
    MAX_PIXELS,
    MIN_PIXELS,
)

__all__ = ["ACTION_KINDS", "HEADER_RE", "KEY_KINDS", "NAMED_KEYS", "POINTER_KINDS",
           "SCROLL_DIRECTIONS", "TERMINAL_KINDS", "Action", "ParsedResponse", "find_action",
           "is_bare_call", "normalize_key", "parse_response"]

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
NAMED_KEYS = frozenset([
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
HEADER_RE = re.compile(r"(?:^|\n)[ \t]*(Thought|Reflection|Action_Summary|Action)[ \t]*[:：]")
_INLINE_ACTION_RE = re.compile(r"(?<![A-Za-z0-9_])Action[ \t]*[:：]")
_REPEATED_ACTION_RE = re.compile(r"(?m)^[ \t]*Action[ \t]*[:：][ \t]*")
_IDENT_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_CALL_START_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*[ \t]*\(")
_KWARG_RE = re.compile(r"([A-Za-z_][A-Za-z0-9_]*)\s*=\s*")
_NEXT_KWARG_RE = re.compile(r"\s*,\s*[A-Za-z_][A-Za-z0-9_]*\s*=")
_NEXT_QUOTED_RE = re.compile(r"\s*,\s*['\"]")
_ESCAPES = {"n": "\n", "t": "\t", "'": "'", '"': '"', "\\": "\\"}


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

    def record(self) -> dict[str, Any]:
        """The action as traj.jsonl's ``actions`` keep it."""
        return {"kind": self.kind, "point": self.point, "end_point": self.end_point,
                "content": self.content, "keys": self.keys, "direction": self.direction}


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
    # Made once per reply (and cached per screen size); validates family and size early.
    frame = frame_of(screen_width, screen_height, family, min_pixels=min_pixels,
                     max_pixels=max_pixels)
    body = text.strip()
    if not body:
        raise ActionParseError("empty model reply", text)

    headers = list(HEADER_RE.finditer(body))
    action_m = find_action(body, headers)
    sections: dict[str, str] = {}
    if action_m is None:
        if not is_bare_call(body, headers):
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
        _build_action(name, args, call, frame) for name, args, call in _split_calls(action_text)
    ]
    return ParsedResponse(
        thought=sections.get("Thought") or None,
        reflection=sections.get("Reflection") or None,
        action_summary=sections.get("Action_Summary") or None,
        actions=actions,
        text=text,
    )


def is_bare_call(body: str, headers: list[re.Match[str]]) -> bool:
    """Some deployments answer with the bare call(s) and no headers at all."""
    return not headers and bool(_CALL_START_RE.match(body)) and body.endswith(")")


def find_action(body: str, headers: list[re.Match[str]]) -> re.Match[str] | None:
    """The ``Action:`` that starts the action part; ``None`` for bare calls or no action."""
    action_m = next((m for m in headers if m.group(1) == "Action"), None)
    # "Thought: ... Action: ..." on one line. A bare call is not searched: an "Action:"
    # inside its content is text to type, not a header.
    if action_m is None and not is_bare_call(body.strip(), headers):
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
    frame: Frame,
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
    if "start_box" in values:
        action.model_point = _parse_box(values["start_box"], call)
        action.point = frame.to_screen(action.model_point)
    if "end_box" in values:
        action.model_end_point = _parse_box(values["end_box"], call)
        action.end_point = frame.to_screen(action.model_end_point)
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
        if key not in NAMED_KEYS and key not in _CHAR_KEYS:
            raise ActionParseError(f"unknown key {key!r}", call)
    return keys
