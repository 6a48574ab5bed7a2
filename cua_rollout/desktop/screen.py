"""The X display as the desktop server sees it: screenshots with the pointer drawn in, the
pointer position, the screen size and the size of an app's window.

All X work happens on one thread that keeps its connections open between requests (a fresh
connection per screenshot costs more than the capture), so the event loop never blocks on X.
"""

from __future__ import annotations

import asyncio
import contextlib
import struct
import threading
import zlib
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import mss
from isal import isal_zlib
from PIL import Image
from Xlib import X
from Xlib import display as xdisplay
from Xlib import error as xerror

__all__ = ["DEFAULT_PNG_LEVEL", "Screen", "encode_png"]

T = TypeVar("T")

# ISA-L's deflate level (0-3) of the PNG's image data. Level 1 compresses a 1920x1080 screen
# about as well as zlib's level 1 at a tenth of its time (benchmarks/bench_screenshot.py).
DEFAULT_PNG_LEVEL = 1
_PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _chunk(kind: bytes, data: bytes) -> bytes:
    return (struct.pack(">I", len(data)) + kind + data
            + struct.pack(">I", zlib.crc32(data, zlib.crc32(kind)) & 0xFFFFFFFF))


def encode_png(bgra: bytes | memoryview, width: int, height: int,
               level: int = DEFAULT_PNG_LEVEL) -> bytes:
    """A lossless 8-bit RGB PNG of a screen grabbed as BGRA (X's 32-bit layout, as mss grabs
    it). Pillow swaps the channels in C; every scanline gets filter type 0 (none: on screens
    of flat colours and text the adaptive filters buy little and cost most of the time); the
    image data is deflated by ISA-L (``isal``), a zlib stream as PNG requires."""
    rgb = Image.frombuffer("RGB", (width, height), bgra, "raw", "BGRX", 0, 1).tobytes()
    stride = width * 3
    lines = bytearray(height * (stride + 1))  # zero: the filter byte of every line
    for y in range(height):
        start = y * (stride + 1) + 1
        lines[start:start + stride] = rgb[y * stride:(y + 1) * stride]
    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (_PNG_SIGNATURE + _chunk(b"IHDR", header)
            + _chunk(b"IDAT", isal_zlib.compress(lines, level)) + _chunk(b"IEND", b""))


# mss >= 10.2 names its class MSS (and deprecates the older ``mss.mss`` factory).
_MSS: Any = getattr(mss, "MSS", None) or mss.mss


class Screen:
    """One X display, reached from a single worker thread.

    ``display`` is the X display name (None: ``$DISPLAY``). A connection that fails is dropped
    and opened again on the next call, so the server survives an X hiccup.
    """

    def __init__(self, display: str | None = None, *, png_level: int = DEFAULT_PNG_LEVEL) -> None:
        self.display = display
        self.png_level = png_level
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="x11")
        self._local = threading.local()

    async def screenshot_png(self) -> bytes:
        """The whole screen as PNG bytes, with the pointer's current cursor image drawn in at
        the pointer (XFixes, hotspot included)."""
        return await self._run(self._screenshot_png)

    async def size(self) -> tuple[int, int]:
        """Width and height of the screen in pixels."""
        return await self._run(self._size)

    async def pointer(self) -> tuple[int, int]:
        """The pointer's position on the screen."""
        return await self._run(self._pointer)

    async def window_size(self, app_class: str) -> tuple[int, int] | None:
        """Size of the first managed window whose WM_CLASS (instance or class) equals
        ``app_class`` ignoring case; None when there is none."""
        return await self._run(lambda: self._window_size(app_class))

    def close(self) -> None:
        """Close the connections and stop the worker thread."""

        def close_all() -> None:
            self._drop()

        with contextlib.suppress(RuntimeError):
            self._executor.submit(close_all).result()
        self._executor.shutdown(wait=True)

    # ------------------------------------------------------------------ on the X thread

    async def _run(self, fn: Callable[[], T]) -> T:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, self._guarded, fn)

    def _guarded(self, fn: Callable[[], T]) -> T:
        try:
            return fn()
        except Exception:
            self._drop()  # reconnect next time
            raise

    def _drop(self) -> None:
        for name in ("mss", "xlib"):
            conn: Any = getattr(self._local, name, None)
            if conn is not None:
                with contextlib.suppress(Exception):
                    conn.close()
                setattr(self._local, name, None)

    def _mss(self) -> Any:
        grabber = getattr(self._local, "mss", None)
        if grabber is None:
            grabber = _MSS(with_cursor=True, display=self.display)
            self._local.mss = grabber
        return grabber

    def _xlib(self) -> xdisplay.Display:
        conn = getattr(self._local, "xlib", None)
        if conn is None:
            conn = xdisplay.Display(self.display)
            self._local.xlib = conn
        return conn

    def _screenshot_png(self) -> bytes:
        grabber = self._mss()
        shot = grabber.grab(grabber.monitors[0])
        return encode_png(shot.raw, shot.width, shot.height, self.png_level)

    def _size(self) -> tuple[int, int]:
        screen = self._xlib().screen()
        return screen.width_in_pixels, screen.height_in_pixels

    def _pointer(self) -> tuple[int, int]:
        reply = self._xlib().screen().root.query_pointer()
        return reply.root_x, reply.root_y

    def _window_size(self, app_class: str) -> tuple[int, int] | None:
        conn = self._xlib()
        root = conn.screen().root
        prop = root.get_full_property(conn.intern_atom("_NET_CLIENT_LIST"), X.AnyPropertyType)
        wanted = app_class.lower()
        for window_id in prop.value if prop is not None else []:
            try:
                window = conn.create_resource_object("window", window_id)
                names = window.get_wm_class()
                if names and wanted in (n.lower() for n in names):
                    geometry = window.get_geometry()
                    return geometry.width, geometry.height
            except xerror.XError:  # the window went away while we looked
                continue
        return None
