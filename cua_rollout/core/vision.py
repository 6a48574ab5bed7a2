"""The image geometry of Qwen2-VL / Qwen2.5-VL processors (UI-TARS's): the size a screenshot
is resized to (``smart_resize``) and the image tokens it becomes. Pure functions, shared by the
agents (coordinates), the model client (token counts) and the fleet (a replica's limits)."""

from __future__ import annotations

import math

__all__ = ["IMAGE_FACTOR", "IMAGE_WRAPPER_TOKENS", "MAX_PIXELS", "MAX_RATIO", "MIN_PIXELS",
           "image_tokens", "smart_resize"]

IMAGE_FACTOR = 28
MIN_PIXELS = 100 * 28 * 28
MAX_PIXELS = 16384 * 28 * 28
MAX_RATIO = 200
# Tokens around each image's tokens in the prompt: <|vision_start|> and <|vision_end|>.
IMAGE_WRAPPER_TOKENS = 2


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
