"""A full disk on demand, for the tests and the chaos run (which must not import tests/)."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

__all__ = ["fill"]


def fill(directory: Path) -> Path:
    """Fill the filesystem holding ``directory`` to the last byte; returns the filler file
    (remove it to free the space). Large writes first, then smaller ones down to one byte."""
    filler = directory / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        for chunk in (b"\0" * 65536, b"\0" * 4096, b"\0"):
            with contextlib.suppress(OSError):
                while os.write(fd, chunk):
                    pass
    finally:
        os.close(fd)
    return filler
