"""OSWorld's ``computer_13`` action space: thirteen typed actions (JSON objects with an
``action_type`` and its parameters) and the special ``WAIT`` / ``DONE`` / ``FAIL``. The
definition follows OSWorld's ``desktop_env/actions.py`` (its ``ACTION_SPACE``: types, ranges,
which parameters are optional); the code each action runs follows its Python controller's
``execute_action``. Coordinates are checked against the real screen, where OSWorld's table
says 1920x1080 whatever the screen."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from cua_rollout.agents.uitars import Action, to_pyautogui
from cua_rollout.core.types import DONE, FAIL, WAIT

__all__ = ["ACTION_SPACE", "ACTION_TYPES", "KEYBOARD_KEYS", "SPECIAL_TYPES", "Param",
           "action_code", "describe", "validate"]

# pyautogui's key names, as OSWorld's actions.py lists them (keys are compared lowercased).
KEYBOARD_KEYS = frozenset([
    "\t", "\n", "\r", " ", "!", '"', "#", "$", "%", "&", "'", "(", ")", "*", "+", ",", "-",
    ".", "/", *"0123456789", ":", ";", "<", "=", ">", "?", "@", "[", "\\", "]", "^", "_", "`",
    *"abcdefghijklmnopqrstuvwxyz", "{", "|", "}", "~",
    "accept", "add", "alt", "altleft", "altright", "apps", "backspace", "browserback",
    "browserfavorites", "browserforward", "browserhome", "browserrefresh", "browsersearch",
    "browserstop", "capslock", "clear", "convert", "ctrl", "ctrlleft", "ctrlright", "decimal",
    "del", "delete", "divide", "down", "end", "enter", "esc", "escape", "execute",
    *(f"f{i}" for i in range(1, 25)), "final", "fn", "hanguel", "hangul", "hanja", "help",
    "home", "insert", "junja", "kana", "kanji", "launchapp1", "launchapp2", "launchmail",
    "launchmediaselect", "left", "modechange", "multiply", "nexttrack", "nonconvert",
    *(f"num{i}" for i in range(10)), "numlock", "pagedown", "pageup", "pause", "pgdn",
    "pgup", "playpause", "prevtrack", "print", "printscreen", "prntscrn", "prtsc", "prtscr",
    "return", "right", "scrolllock", "select", "separator", "shift", "shiftleft",
    "shiftright", "sleep", "stop", "subtract", "tab", "up", "volumedown", "volumemute",
    "volumeup", "win", "winleft", "winright", "yen", "command", "option", "optionleft",
    "optionright",
])


@dataclass(frozen=True)
class Param:
    """One parameter of an action: its JSON type (``float``: any number), allowed values
    (``"x"`` / ``"y"``: within the screen's width / height; a tuple: one of them; ``"keys"``:
    a key name; None: anything of the type) and whether it may be left out."""

    type: type
    range: str | tuple[Any, ...] | None
    optional: bool


_X, _Y = Param(float, "x", False), Param(float, "y", False)
_OX, _OY = Param(float, "x", True), Param(float, "y", True)
_BUTTON = Param(str, ("left", "right", "middle"), True)
_KEY = Param(str, "keys", False)

# action_type -> (what it does, its parameters).
ACTION_SPACE: dict[str, tuple[str, dict[str, Param]]] = {
    "MOVE_TO": ("move the pointer to (x, y)", {"x": _X, "y": _Y}),
    "CLICK": ("click `button` (default left) `num_clicks` times, at (x, y) or where the "
              "pointer is", {"button": _BUTTON, "x": _OX, "y": _OY,
                             "num_clicks": Param(int, (1, 2, 3), True)}),
    "MOUSE_DOWN": ("press `button` (default left)", {"button": _BUTTON}),
    "MOUSE_UP": ("release `button` (default left)", {"button": _BUTTON}),
    "RIGHT_CLICK": ("right click at (x, y) or where the pointer is", {"x": _OX, "y": _OY}),
    "DOUBLE_CLICK": ("double click at (x, y) or where the pointer is", {"x": _OX, "y": _OY}),
    "DRAG_TO": ("drag with the left button held from the pointer to (x, y)",
                {"x": _X, "y": _Y}),
    "SCROLL": ("scroll the wheel dx clicks right (negative: left) and dy up (negative: "
               "down)", {"dx": Param(int, None, False), "dy": Param(int, None, False)}),
    "TYPING": ("type `text`", {"text": Param(str, None, False)}),
    "PRESS": ("press and release `key`", {"key": _KEY}),
    "KEY_DOWN": ("hold `key` down", {"key": _KEY}),
    "KEY_UP": ("release `key`", {"key": _KEY}),
    "HOTKEY": ("press the key combination `keys` (a list)", {"keys": Param(list, "keys",
                                                                           False)}),
}
SPECIAL_TYPES = {"WAIT": WAIT, "DONE": DONE, "FAIL": FAIL}
ACTION_TYPES = frozenset(ACTION_SPACE) | frozenset(SPECIAL_TYPES)


def describe(width: int, height: int) -> str:
    """The action space as the prompt lists it, one action a line."""
    lines = []
    for kind, (note, params) in ACTION_SPACE.items():
        parts = []
        for name, p in params.items():
            allowed = (f"0..{width - 1}" if p.range == "x" else f"0..{height - 1}"
                       if p.range == "y" else "a key name" if p.range == "keys"
                       else " | ".join(map(str, p.range)) if p.range else p.type.__name__)
            if p.type is list:
                allowed = "list of key names"
            parts.append(f"{name}{'?' if p.optional else ''}: {allowed}")
        lines.append(f"- {kind} {{{', '.join(parts)}}}: {note}")
    lines.append("- WAIT, DONE, FAIL (no parameters): wait a moment / the task is done / "
                 "the task cannot be done")
    return "\n".join(lines)


def _check(kind: str, name: str, value: Any, p: Param, width: int, height: int) -> Any:
    where = f"{kind}.{name}"
    if p.type is float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ValueError(f"{where} must be a number, not {json.dumps(value)}")
    elif p.type is int:
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"{where} must be an integer, not {json.dumps(value)}")
    elif not isinstance(value, p.type):
        raise ValueError(f"{where} must be a {'string' if p.type is str else 'list'}, "
                         f"not {json.dumps(value)}")
    if p.range == "x" and not 0 <= value < width:
        raise ValueError(f"{where}={value} is off the {width}x{height} screen")
    if p.range == "y" and not 0 <= value < height:
        raise ValueError(f"{where}={value} is off the {width}x{height} screen")
    if p.range == "keys":
        keys = value if isinstance(value, list) else [value]
        if not keys:
            raise ValueError(f"{where} must name at least one key")
        for key in keys:
            if not isinstance(key, str) or key.lower() not in KEYBOARD_KEYS:
                raise ValueError(f"{where}: {json.dumps(key)} is not a key name of pyautogui")
    elif isinstance(p.range, tuple) and value not in p.range:
        raise ValueError(f"{where} must be one of {', '.join(map(str, p.range))}, not "
                         f"{json.dumps(value)}")
    return value


def validate(action: Any, width: int, height: int) -> dict[str, Any]:
    """``action`` (parsed JSON) as a checked ``{"action_type": ..., **parameters}``, or
    ``ValueError`` saying what does not match the action space. Parameters may be flat or
    under ``"parameters"``, as OSWorld's controller reads them."""
    if isinstance(action, str) and action.strip() in SPECIAL_TYPES:
        return {"action_type": action.strip()}
    if not isinstance(action, dict):
        raise ValueError(f"an action is a JSON object, not {json.dumps(action)[:80]}")
    kind = action.get("action_type")
    if kind not in ACTION_TYPES:
        raise ValueError(f"unknown action_type {json.dumps(kind)} (known: "
                         f"{', '.join(sorted(ACTION_TYPES))})")
    nested = action.get("parameters")
    if isinstance(nested, dict) and set(action) == {"action_type", "parameters"}:
        given = dict(nested)
    else:
        given = {k: v for k, v in action.items() if k != "action_type"}
    if kind in SPECIAL_TYPES:
        if given:
            raise ValueError(f"{kind} takes no parameters, got {', '.join(sorted(given))}")
        return {"action_type": kind}
    params = ACTION_SPACE[kind][1]
    unknown = sorted(set(given) - set(params))
    if unknown:
        raise ValueError(f"{kind} has no parameter {', '.join(unknown)} (its parameters: "
                         f"{', '.join(params) or 'none'})")
    missing = [n for n, p in params.items() if not p.optional and n not in given]
    if missing:
        raise ValueError(f"{kind} needs {', '.join(missing)}")
    if ("x" in given) != ("y" in given):
        raise ValueError(f"{kind} needs both x and y, or neither")
    checked = {n: _check(kind, n, v, params[n], width, height) for n, v in given.items()}
    return {"action_type": kind, **checked}


def _xy(a: dict[str, Any]) -> str:
    return f"{round(a['x'])}, {round(a['y'])}"


def action_code(a: dict[str, Any]) -> str:
    """The pyautogui code of one validated action (not a special one), as OSWorld's
    controller runs it; typed text goes through our typing code (X11's '<' and non-ASCII
    text, see uitars.codegen)."""
    kind = a["action_type"]
    button = f"button={a['button']!r}" if "button" in a else ""
    at = f"x={round(a['x'])}, y={round(a['y'])}" if "x" in a else ""
    if kind == "MOVE_TO":
        return f"pyautogui.moveTo({_xy(a)})"
    if kind == "CLICK":
        clicks = f"clicks={a['num_clicks']}" if "num_clicks" in a else ""
        return f"pyautogui.click({', '.join(p for p in (button, at, clicks) if p)})"
    if kind in ("MOUSE_DOWN", "MOUSE_UP"):
        return f"pyautogui.{'mouseDown' if kind == 'MOUSE_DOWN' else 'mouseUp'}({button})"
    if kind == "RIGHT_CLICK":
        return f"pyautogui.rightClick({at})"
    if kind == "DOUBLE_CLICK":
        return f"pyautogui.doubleClick({at})"
    if kind == "DRAG_TO":
        return f"pyautogui.dragTo({_xy(a)}, duration=1.0, button='left', mouseDownUp=True)"
    if kind == "SCROLL":
        lines = [f"pyautogui.hscroll({a['dx']})"] if a["dx"] else []
        lines += [f"pyautogui.vscroll({a['dy']})"] if a["dy"] else []
        return "\n".join(lines) or "pass"
    if kind == "TYPING":
        return to_pyautogui([Action("type", content=a["text"])])
    if kind == "PRESS":
        return f"pyautogui.press({a['key']!r})"
    if kind == "KEY_DOWN":
        return f"pyautogui.keyDown({a['key']!r})"
    if kind == "KEY_UP":
        return f"pyautogui.keyUp({a['key']!r})"
    if kind == "HOTKEY":
        return f"pyautogui.hotkey({', '.join(repr(k) for k in a['keys'])})"
    raise ValueError(f"{kind} runs no code")
