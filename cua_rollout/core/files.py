"""Small blocking file helpers shared by the writers (storage, the model fleet's state) and
readers (task loading, resume): atomic writes, appends, JSON reads that tolerate absence, and
the repair of a JSONL file a crash cut short. Callers on an event loop run them in a thread."""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import socket
import uuid
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

__all__ = ["DirectoryLock", "JsonLine", "LineMark", "LockHeld", "append_text", "fsync_dir",
           "iter_jsonl", "iter_jsonl_lines", "iter_lines_from", "last_line_mark", "read_json",
           "repair_jsonl_tail", "replace_atomic", "write_atomic"]

# How much of a JSONL file's end is read at a time to find its last newline.
_TAIL_CHUNK_BYTES = 64 * 1024

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
        if fsync:  # the rename itself survives a power loss only once the directory is synced
            fsync_dir(path.parent)
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise
    return mtime_ns


@contextlib.contextmanager
def replace_atomic(path: Path, *, fsync: bool = False, mode: int = 0o644
                   ) -> Iterator[BinaryIO]:
    """``write_atomic`` for content written as a stream (a file too big to hold): a binary
    file under a temporary name that replaces ``path`` when the block ends, or is removed
    when it raises. A reader never sees half a file."""
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
        with os.fdopen(fd, "wb") as f:
            yield f
            if fsync:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
        if fsync:
            fsync_dir(path.parent)
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise


def fsync_dir(directory: Path) -> None:
    """Make the directory's entries (a rename, a new file) durable."""
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def append_text(path: Path, text: str | bytes, *, fsync: bool = False) -> int:
    """Append ``text`` (whole lines) to ``path`` and push it to the OS, all or nothing: a
    write that fails part-way (disk full) is cut back to the file's size before it, so the
    next append never glues onto half a line. Returns the offset ``text`` starts at (the
    file's size before it: exact while this process is the file's one writer)."""
    data = text.encode("utf-8") if isinstance(text, str) else text
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        size = os.fstat(fd).st_size
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            if fsync:
                os.fsync(fd)
        except BaseException:
            with contextlib.suppress(OSError):
                os.ftruncate(fd, size)
            raise
    finally:
        os.close(fd)
    if fsync and size == 0:
        fsync_dir(path.parent)  # a file just created: its directory entry too
    return size


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
            size = f.seek(0, os.SEEK_END)
            if not size:
                return 0
            f.seek(size - 1)
            if f.read(1) == b"\n":
                return 0
            # Back from the end, a chunk at a time, to the last newline: never the whole file.
            end = size
            keep = 0
            while end > 0:
                start = max(0, end - _TAIL_CHUNK_BYTES)
                f.seek(start)
                found = f.read(end - start).rfind(b"\n")
                if found >= 0:
                    keep = start + found + 1
                    break
                end = start
            f.truncate(keep)
            log.warning("%s: removed an unfinished last line (%d bytes)", path, size - keep)
            return size - keep
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
    return iter_jsonl_lines(text.splitlines())


def iter_jsonl_lines(lines: Iterable[str]) -> Iterator[JsonLine]:
    """``iter_jsonl`` over lines as they come (an open file: streamed, never held whole)."""
    for number, raw in enumerate(lines, start=1):
        if not raw.strip():
            continue
        try:
            yield JsonLine(number, json.loads(raw))
        except json.JSONDecodeError as exc:
            yield JsonLine(number, error=exc)


@dataclass(frozen=True)
class LineMark:
    """Where one line of a JSONL file is (``start`` to ``end``, bytes, its newline included)
    and a digest of its bytes: a reader that stored a mark finds the same line there again,
    or knows the file changed under it (rewritten by a compaction, replaced, cut)."""

    start: int
    end: int
    digest: str

    @classmethod
    def of(cls, start: int, line: bytes) -> LineMark:
        return cls(start, start + len(line), hashlib.sha1(line).hexdigest()[:16])

    def found_in(self, path: Path) -> bool:
        """Whether ``path`` holds this very line at this place."""
        if not 0 <= self.start < self.end or self.end - self.start > 1 << 24:
            return False
        try:
            with open(path, "rb") as f:
                f.seek(self.start)
                line = f.read(self.end - self.start)
        except OSError:
            return False
        return len(line) == self.end - self.start and LineMark.of(self.start, line) == self

    def to_json(self) -> list[Any]:
        return [self.start, self.end, self.digest]

    @classmethod
    def from_json(cls, value: Any) -> LineMark | None:
        """A stored mark, or None when ``value`` is none (a reader then starts over)."""
        if (isinstance(value, list) and len(value) == 3
                and all(isinstance(v, int) and not isinstance(v, bool) for v in value[:2])
                and isinstance(value[2], str)):
            return cls(value[0], value[1], value[2])
        return None


def last_line_mark(path: Path, *, chunk: int = _TAIL_CHUNK_BYTES) -> LineMark | None:
    """The mark of the last complete (newline-ended) line of ``path``; None when it has
    none or cannot be read. Reads back from the end, a chunk at a time."""
    try:
        with open(path, "rb") as f:
            size = f.seek(0, os.SEEK_END)
            buf, pos = b"", size
            while pos > 0:
                step = min(chunk, pos)
                pos -= step
                f.seek(pos)
                buf = f.read(step) + buf
                last_nl = buf.rfind(b"\n")
                if last_nl < 0:
                    continue  # no line ends in what was read yet
                before = buf.rfind(b"\n", 0, last_nl)
                if before >= 0 or pos == 0:
                    return LineMark.of(pos + before + 1, buf[before + 1:last_nl + 1])
            return None
    except OSError:
        return None


def iter_lines_from(path: Path, offset: int = 0) -> Iterator[tuple[int, bytes]]:
    """The lines of ``path`` from byte ``offset`` (a line's start), each with its start
    offset, read one at a time (a last line without its newline too)."""
    with open(path, "rb") as f:
        f.seek(offset)
        pos = offset
        for line in f:
            yield pos, line
            pos += len(line)


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
