"""Where UI-TARS's coordinates live: 1.5 answers in pixels of the ``smart_resize``d
screenshot, 1.0 in relative units 0..1000; both map to and from screen pixels here."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Literal

from cua_rollout.core.vision import (
    MAX_PIXELS,
    MIN_PIXELS,
    smart_resize,
)

__all__ = ["FAMILIES", "RELATIVE_SCALE", "Family", "Frame", "frame_of", "model_to_screen",
           "screen_to_model"]

Family = Literal["uitars-1.5", "uitars-1.0"]
FAMILIES: tuple[str, ...] = ("uitars-1.5", "uitars-1.0")
RELATIVE_SCALE = 1000  # UI-TARS 1.0: coordinates in 0..1000 on each axis


@dataclass(frozen=True)
class Frame:
    """The coordinate frame the model answers in for one screen size and family, made once:
    ``width`` x ``height`` is the resized image for UI-TARS 1.5 (the serving processor's
    ``min_pixels`` / ``max_pixels`` decide it) and 1000 x 1000 for 1.0. It maps points both
    ways and bounds what the model may write (``limits``)."""

    screen_width: int
    screen_height: int
    family: str
    width: float
    height: float

    @property
    def limits(self) -> tuple[int, int]:
        """The largest x and y the model may write: ``w_bar - 1`` / ``h_bar - 1`` in 1.5's
        pixel frame, 1000 in 1.0's relative one."""
        if self.family == "uitars-1.0":
            return RELATIVE_SCALE, RELATIVE_SCALE
        return int(self.width) - 1, int(self.height) - 1

    def to_screen(self, point: tuple[float, float]) -> tuple[int, int]:
        """A point the model wrote, in integer screen pixels clamped onto the screen."""
        x = round(point[0] / self.width * self.screen_width)
        y = round(point[1] / self.height * self.screen_height)
        return (min(max(x, 0), self.screen_width - 1),
                min(max(y, 0), self.screen_height - 1))

    def to_model(self, point: tuple[float, float]) -> tuple[int, int]:
        """Screen pixels as the integer coordinates the model would write, clamped into the
        frame: on a screen over twice the frame's size, its last pixels would otherwise
        round to ``w_bar``."""
        x_max, y_max = self.limits
        x = round(point[0] / self.screen_width * self.width)
        y = round(point[1] / self.screen_height * self.height)
        return min(max(x, 0), x_max), min(max(y, 0), y_max)


@functools.lru_cache(maxsize=256)
def frame_of(screen_width: int, screen_height: int, family: str = "uitars-1.5", *,
             min_pixels: int = MIN_PIXELS, max_pixels: int = MAX_PIXELS) -> Frame:
    """The frame of a ``screen_width`` x ``screen_height`` screen for ``family`` (an unknown
    family or a bad size raises ``ValueError``)."""
    if family == "uitars-1.5":
        h, w = smart_resize(
            screen_height, screen_width, min_pixels=min_pixels, max_pixels=max_pixels
        )
        return Frame(screen_width, screen_height, family, float(w), float(h))
    if family == "uitars-1.0":
        return Frame(screen_width, screen_height, family, float(RELATIVE_SCALE),
                     float(RELATIVE_SCALE))
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
    return frame_of(screen_width, screen_height, family, min_pixels=min_pixels,
                    max_pixels=max_pixels).to_screen(point)


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
    into the model's frame (``0..w_bar-1`` for UI-TARS 1.5, ``0..1000`` for 1.0)."""
    return frame_of(screen_width, screen_height, family, min_pixels=min_pixels,
                    max_pixels=max_pixels).to_model(point)
