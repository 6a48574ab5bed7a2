"""Where UI-TARS's coordinates live: 1.5 answers in pixels of the ``smart_resize``d
screenshot, 1.0 in relative units 0..1000; both map to and from screen pixels here."""

from __future__ import annotations

from typing import Literal

from cua_rollout.core.vision import (
    MAX_PIXELS,
    MIN_PIXELS,
    smart_resize,
)

__all__ = ["FAMILIES", "RELATIVE_SCALE", "Family", "frame_limits", "model_frame",
           "model_to_screen", "screen_to_model"]

Family = Literal["uitars-1.5", "uitars-1.0"]
FAMILIES: tuple[str, ...] = ("uitars-1.5", "uitars-1.0")
RELATIVE_SCALE = 1000  # UI-TARS 1.0: coordinates in 0..1000 on each axis


def model_frame(
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
    fw, fh = model_frame(
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
    frame = model_frame(
        screen_width, screen_height, family, min_pixels=min_pixels, max_pixels=max_pixels
    )
    x_max, y_max = frame_limits(frame, family)
    x = round(point[0] / screen_width * frame[0])
    y = round(point[1] / screen_height * frame[1])
    return min(max(x, 0), x_max), min(max(y, 0), y_max)


def frame_limits(frame: tuple[float, float], family: str) -> tuple[int, int]:
    """The largest x and y the model may write in ``frame``: ``w_bar - 1`` / ``h_bar - 1``
    in 1.5's pixel frame, 1000 in 1.0's relative one."""
    if family == "uitars-1.0":
        return RELATIVE_SCALE, RELATIVE_SCALE
    return int(frame[0]) - 1, int(frame[1]) - 1
