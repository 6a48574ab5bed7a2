"""Typed actions -> Python code for OSWorld's ``pyautogui`` action space, or ``DONE`` /
``WAIT`` / ``FAIL``."""

from __future__ import annotations

from cua_rollout.agents.uitars.parser import POINTER_KINDS, TERMINAL_KINDS, Action
from cua_rollout.core.types import DONE, FAIL, WAIT

__all__ = ["split_terminal", "to_pyautogui"]

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
