"""The desktop server's PNG encoder (``cua_rollout.desktop.screen.encode_png``): lossless, valid PNG
(chunk CRCs, zlib stream) that Pillow and zlib read back pixel for pixel, from X's BGRA."""

from __future__ import annotations

import io
import random
import struct
import zlib

import pytest
from PIL import Image

from cua_rollout.core.screenshot import png_size
from cua_rollout.desktop.screen import encode_png


def _bgra(width: int, height: int, seed: int) -> tuple[bytes, bytes]:
    """A screen-like image (flat areas, text-like noise, a gradient) as BGRA, and its RGB."""
    rng = random.Random(seed)
    rgb = bytearray()
    for y in range(height):
        for x in range(width):
            if y < height // 3:
                px = (240, 240, 240)
            elif y < 2 * height // 3:
                px = tuple(rng.randrange(256) for _ in range(3))
            else:
                px = (x % 256, y % 256, (x + y) % 256)
            rgb += bytes(px)
    bgra = bytearray()
    for i in range(0, len(rgb), 3):
        r, g, b = rgb[i:i + 3]
        bgra += bytes((b, g, r, 255))
    return bytes(bgra), bytes(rgb)


@pytest.mark.parametrize(("width", "height"), [(1, 1), (7, 5), (64, 48), (333, 17)])
@pytest.mark.parametrize("level", [0, 1, 3])
def test_the_png_holds_exactly_the_screen(width: int, height: int, level: int) -> None:
    bgra, rgb = _bgra(width, height, seed=width * height + level)
    png = encode_png(bgra, width, height, level)
    assert png_size(png) == (width, height)
    with Image.open(io.BytesIO(png)) as image:
        image.load()  # Pillow checks every chunk's CRC
        assert image.mode == "RGB" and image.size == (width, height)
        assert image.tobytes() == rgb


def test_the_chunks_are_well_formed_and_the_data_is_a_zlib_stream() -> None:
    width, height = 40, 30
    bgra, rgb = _bgra(width, height, seed=1)
    png = encode_png(bgra, width, height)
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    pos, kinds, idat = 8, [], b""
    while pos < len(png):
        (length,) = struct.unpack(">I", png[pos:pos + 4])
        kind, data = png[pos + 4:pos + 8], png[pos + 8:pos + 8 + length]
        (crc,) = struct.unpack(">I", png[pos + 8 + length:pos + 12 + length])
        assert crc == zlib.crc32(kind + data), kind
        kinds.append(kind)
        idat += data if kind == b"IDAT" else b""
        pos += 12 + length
    assert kinds == [b"IHDR", b"IDAT", b"IEND"]
    lines = zlib.decompress(idat)  # a plain zlib stream, as PNG requires
    stride = width * 3 + 1
    assert len(lines) == height * stride
    assert all(lines[y * stride] == 0 for y in range(height))  # filter type 0 on every line
    assert b"".join(lines[y * stride + 1:(y + 1) * stride] for y in range(height)) == rgb
