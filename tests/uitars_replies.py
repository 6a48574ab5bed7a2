"""UI-TARS replies written from typed actions (the inverse of parsing): the round trips of the
parser and grammar tests. Test code: the product never writes a reply."""

from __future__ import annotations

from cua_rollout.agents.uitars import KEY_KINDS, POINTER_KINDS, Action, screen_to_model
from cua_rollout.core.vision import MAX_PIXELS, MIN_PIXELS

__all__ = ["format_action", "format_response"]


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
