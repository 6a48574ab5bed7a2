"""Small blocking file helpers shared by the writers (storage, the model fleet's state) and
readers (task loading, resume): atomic writes, appends, JSON reads that tolerate absence, and
the repair of a JSONL file a crash cut short. Callers on an event loop run them in a thread."""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import socket
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["DirectoryLock", "JsonLine", "LockHeld", "append_text", "iter_jsonl", "read_json",
           "repair_jsonl_tail", "write_atomic"]

log = logging.getLogger(__name__)


def write_atomic(path: Path, data: bytes, *, fsync: bool = False, mode: int = 0o644,
                 min_mtime_ns: int = 0) -> int:
    """Write under a temporary name, then rename: a reader never sees half a file.

    ``mode`` is set before the rename (0o600 for a file holding a token). Returns the new
    file's mtime (ns), made greater than ``min_mtime_ns``, so a reader that watches the mtime
    never misses an update written within the clock's resolution of the last one."""
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            if fsync:
                f.flush()
                os.fsync(f.fileno())
        st = os.stat(tmp)
        mtime_ns = st.st_mtime_ns
        if mtime_ns <= min_mtime_ns:
            mtime_ns = min_mtime_ns + 1_000
            os.utime(tmp, ns=(st.st_atime_ns, mtime_ns))
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise
    return mtime_ns


def append_text(path: Path, text: str, *, fsync: bool = False) -> None:
    """Append ``text`` (whole lines) to ``path`` and push it to the OS."""
    with open(path, "a", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        if fsync:
            os.fsync(f.fileno())


def read_json(path: Path) -> Any:
    """The JSON in ``path``, or None when it is missing or not JSON (a file being replaced
    atomically is never half-written, so None means absent, unreadable or foreign)."""
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):  # ValueError: not JSON, or not UTF-8
        return None


def repair_jsonl_tail(path: Path) -> int:
    """Cut a last line that a crash left without its newline (that record is not final and
    is written again); returns the bytes removed."""
    try:
        with open(path, "rb+") as f:
            data = f.read()
            if not data or data.endswith(b"\n"):
                return 0
            keep = data.rfind(b"\n") + 1
            f.truncate(keep)
            log.warning("%s: removed an unfinished last line (%d bytes)", path,
                        len(data) - keep)
            return len(data) - keep
    except FileNotFoundError:
        return 0


@dataclass(frozen=True)
class JsonLine:
    """One non-blank line of a JSONL text: its 1-based number and either its value or, when
    it is not JSON (a crash can cut the last line short), the decoding error."""

    number: int
    value: Any = None
    error: json.JSONDecodeError | None = None


def iter_jsonl(text: str) -> Iterator[JsonLine]:
    """The non-blank lines of a JSONL text, parsed; a broken line is reported, not raised,
    so every reader (resume, result tools) skips it the same way and says where it was."""
    for number, raw in enumerate(text.splitlines(), start=1):
        if not raw.strip():
            continue
        try:
            yield JsonLine(number, json.loads(raw))
        except json.JSONDecodeError as exc:
            yield JsonLine(number, error=exc)


class LockHeld(Exception):
    """Another process holds the lock; ``holder`` is what it wrote ("pid N on host H")."""

    def __init__(self, path: Path, holder: str) -> None:
        super().__init__(f"{path} is locked by {holder}")
        self.path = path
        self.holder = holder


class DirectoryLock:
    """An exclusive ``flock`` on ``<directory>/<name>``, held while this object lives (or until
    ``release``), so one process at a time owns a directory (a run, a fleet's state). The
    kernel drops it when the process dies, so a crash never leaves a stale lock. The holder
    writes its pid and host into the file for the error the next process shows."""

    def __init__(self, directory: Path, name: str = ".lock") -> None:
        self.path = Path(directory) / name
        self._fd: int | None = None

    def acquire(self) -> DirectoryLock:
        """Take the lock now or raise ``LockHeld`` naming the holder."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            try:
                holder = os.pread(fd, 200, 0).decode("utf-8", "replace").strip()
            finally:
                os.close(fd)
            raise LockHeld(self.path, holder or "another process") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()} on host {socket.gethostname()}\n".encode(), 0)
        self._fd = fd
        return self

    def release(self) -> None:
        if self._fd is not None:
            fd, self._fd = self._fd, None
            os.close(fd)  # closing the descriptor drops the flock

    def __enter__(self) -> DirectoryLock:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()
