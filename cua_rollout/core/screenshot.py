"""The screenshot as every part of the controller holds it: PNG bytes whose size is read
from the header (never decoded on the hot path) and whose base64 data URL is made once."""

from __future__ import annotations

import struct
from dataclasses import dataclass
from functools import cached_property

import pybase64

__all__ = ["DataURL", "Screenshot", "png_size"]

_PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def png_size(png: bytes) -> tuple[int, int]:
    """(width, height) from a PNG's IHDR chunk, without decoding the image."""
    if len(png) < 24 or not png.startswith(_PNG_SIGNATURE) or png[12:16] != b"IHDR":
        raise ValueError("not a PNG image")
    width, height = struct.unpack(">II", png[16:24])
    return width, height


class DataURL(str):
    """A ``data:`` URL whose payload is base64 (made by ``Screenshot.data_url``): its
    characters need no JSON escaping, so ``json.dumps`` of it is the string in quotes and a
    request body can embed it as is."""

    __slots__ = ()


@dataclass(eq=False)
class Screenshot:
    """One observed screen: the PNG bytes and, computed once on first use, its data URL.
    ``forget_png`` lets the PNG go once it is stored (``png`` is then None)."""

    png: bytes | None
    file_url: str | None = None
    """``file://`` URL of the PNG as stored, when requests send it by path
    (``model.images: file``)."""

    @cached_property
    def size(self) -> tuple[int, int]:
        """(width, height) read from the PNG header."""
        if self.png is None:
            raise ValueError("the PNG was forgotten before its size was read")
        return png_size(self.png)

    @cached_property
    def data_url(self) -> DataURL:
        """``data:image/png;base64,...``: encoded once, shared by every request that sends it
        (by pybase64's SIMD encoder: 13 us for a 330 KB screenshot, where the standard
        library's takes 370 us on the runner's event loop)."""
        if self.png is None:
            raise ValueError("the PNG was forgotten before its data URL was made")
        return DataURL(b"data:image/png;base64," + pybase64.b64encode(self.png), "ascii")

    @property
    def url(self) -> str:
        """What a request sends for this image: its ``file_url`` when it has one, else its
        data URL. The same string object every time (the trajectory recognises a
        request's images by it)."""
        return self.file_url if self.file_url is not None else self.data_url

    def forget_png(self) -> None:
        """Keep only what requests need (size; the data URL, made now if not yet, unless the
        image is sent by ``file_url``) and let the PNG bytes go, once they are stored: a
        screenshot in the image window then costs its base64 alone (~470 KB for 1920x1080)
        instead of PNG and base64 (~820 KB), or nothing but its path."""
        self.size  # noqa: B018 — cached now, while the PNG is still here
        if self.file_url is None:
            self.data_url  # noqa: B018
        self.png = None
