"""Reading the prompt agent's replies, in either action space: fenced blocks (several per
reply, run in order), ``WAIT`` / ``DONE`` / ``FAIL`` alone or as a block's last line; in
``pyautogui`` each block is Python that must compile and whose literal coordinates must be
on the screen (with ``som``, ``tag_<n>`` names a mark's centre); in ``computer_13`` each
block is a JSON action of the action space. Anything else is an ``ActionParseError``
carrying the reply (the episode asks again, then fails), never another exception."""

from __future__ import annotations

import ast
import json
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from cua_rollout.agents.osworld.a11y import Mark
from cua_rollout.agents.osworld.computer13 import SPECIAL_TYPES, action_code, validate
from cua_rollout.core.errors import ActionParseError

__all__ = ["Reading", "fenced_blocks", "read_computer13", "read_pyautogui"]

_FENCE = "```"
# A block: ``` then an optional language word alone on the opening line, the body, ```.
_BLOCK = re.compile(r"```(?:([A-Za-z0-9_+-]+)[ \t]*\n)?(.*?)```", re.DOTALL)
_TAG = re.compile(r"^tag_(\d+)$")
# pyautogui calls whose first two arguments (or x=, y=) are a screen point.
_POINT_FIRST = frozenset({"click", "doubleClick", "tripleClick", "rightClick", "middleClick",
                          "moveTo", "dragTo", "mouseDown", "mouseUp"})


@dataclass
class Reading:
    """What a reply asks for: ``steps`` (code blocks, or computer_13 actions) before the
    first special action, that action (``WAIT`` / ``DONE`` / ``FAIL`` or None), the text
    outside the blocks (the model's reflection) and every block as read (the record)."""

    code: list[str]
    terminal: str | None
    thought: str
    actions: list[dict[str, Any]] = field(default_factory=list)


def fenced_blocks(text: str) -> tuple[list[tuple[str, str]], str]:
    """(language, body) of every fenced block, and the text outside them;
    ``ActionParseError`` when a fence is left open."""
    if text.count(_FENCE) % 2:
        raise ActionParseError("unbalanced code fence (an odd number of ```)", text)
    blocks = []
    for m in _BLOCK.finditer(text):
        language, body = m[1] or "", m[2].strip()
        if not body and language in SPECIAL_TYPES:  # ```DONE\n```: the word is the body
            language, body = "", language
        blocks.append((language.lower(), body))
    return blocks, _BLOCK.sub("", text).strip()


def _special(body: str) -> tuple[str, str | None]:
    """A block's body split into its code and a special action ending it (its last line)."""
    if body in SPECIAL_TYPES:
        return "", body
    head, _, last = body.rpartition("\n")
    if last.strip() in SPECIAL_TYPES:
        return head.strip(), last.strip()
    return body, None


def _literal_point(call: ast.Call) -> tuple[Any, Any] | None:
    args = list(call.args)
    keywords = {k.arg: k.value for k in call.keywords if k.arg}
    if args and isinstance(args[0], ast.Tuple | ast.List) and len(args[0].elts) == 2:
        x, y = args[0].elts
    elif len(args) >= 2:
        x, y = args[0], args[1]
    elif "x" in keywords and "y" in keywords:
        x, y = keywords["x"], keywords["y"]
    else:
        return None
    try:  # literals only (-5 included); names and expressions are not checked
        return ast.literal_eval(x), ast.literal_eval(y)
    except (ValueError, TypeError, RecursionError):
        return None


def _check_code(code: str, text: str, width: int, height: int,
                marks: Sequence[Mark] | None) -> str:
    """``code`` as it runs: compiled, its literal points checked, the mark names it uses
    defined first. Its first line is a simple statement (the desktop prefixes imports)."""
    try:
        tree = ast.parse(code)
        compile(tree, "<reply>", "exec")
    except SyntaxError as exc:
        raise ActionParseError(f"the code does not compile: {exc.msg} (line {exc.lineno})",
                               text) from None
    except (ValueError, RecursionError, MemoryError) as exc:  # NUL bytes, deep nesting
        raise ActionParseError(f"the code does not compile: {exc}", text) from None
    tags: dict[int, Mark] = {}
    by_index = {m.index: m for m in marks or ()}
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and (found := _TAG.match(node.id)):
            if marks is None:
                continue  # a name of the model's own
            index = int(found[1])
            if index not in by_index:
                raise ActionParseError(f"{node.id} is no mark of the screenshot (marks "
                                       f"1..{len(by_index)})", text)
            tags[index] = by_index[index]
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and isinstance(node.func.value, ast.Name) and node.func.value.id == "pyautogui"
                and node.func.attr in _POINT_FIRST):
            point = _literal_point(node)
            if point is None:
                continue
            x, y = point
            if not all(isinstance(v, int | float) and not isinstance(v, bool) for v in point):
                raise ActionParseError(f"pyautogui.{node.func.attr}: the point ({x!r}, {y!r}) "
                                       "is not numbers", text)
            if not (0 <= x < width and 0 <= y < height):
                raise ActionParseError(f"pyautogui.{node.func.attr}({x}, {y}) is off the "
                                       f"{width}x{height} screen", text)
    lines = [f"tag_{i} = {tags[i].center}" for i in sorted(tags)]
    first = tree.body[0] if tree.body else None
    if first is not None and not lines and isinstance(
            first, ast.If | ast.For | ast.While | ast.With | ast.Try | ast.FunctionDef
            | ast.ClassDef | ast.AsyncFunctionDef | ast.AsyncFor | ast.AsyncWith):
        lines = ["import pyautogui"]  # a simple first line for the desktop's prefix
    return "\n".join([*lines, code])


def read_pyautogui(text: str, width: int, height: int,
                   marks: Sequence[Mark] | None = None) -> Reading:
    """A ``pyautogui`` reply: its code blocks up to the first special action."""
    blocks, thought = fenced_blocks(text)
    if not blocks:
        if text.strip() in SPECIAL_TYPES:
            return Reading([], text.strip(), "", [{"special": text.strip()}])
        raise ActionParseError("no code block in the reply", text)
    code: list[str] = []
    record: list[dict[str, Any]] = []
    for _, body in blocks:
        body_code, special = _special(body)
        if body_code:
            code.append(_check_code(body_code, text, width, height, marks))
            record.append({"code": body_code})
        if special is not None:
            record.append({"special": special})
            return Reading(code, special, thought, record)
    return Reading(code, None, thought, record)


def read_computer13(text: str, width: int, height: int) -> Reading:
    """A ``computer_13`` reply: its JSON actions (fenced, or the whole reply) up to the
    first special one, each checked against the action space."""
    stripped = text.strip()
    if stripped in SPECIAL_TYPES:
        return Reading([], stripped, "", [{"action_type": stripped}])
    blocks, thought = fenced_blocks(text)
    bodies = [body for _, body in blocks] if blocks else [stripped]
    code: list[str] = []
    record: list[dict[str, Any]] = []
    for body in bodies:
        if not body:
            continue
        if body in SPECIAL_TYPES:
            parsed: Any = body
        else:
            try:
                parsed = json.loads(body)
            except (ValueError, RecursionError) as exc:
                raise ActionParseError(f"an action is not JSON ({exc})", text) from None
        try:
            action = validate(parsed, width, height)
        except ValueError as exc:
            raise ActionParseError(str(exc), text) from None
        record.append(action)
        kind = action["action_type"]
        if kind in SPECIAL_TYPES:
            return Reading(code, kind, thought, record)
        code.append(action_code(action))
    return Reading(code, None, thought, record)
