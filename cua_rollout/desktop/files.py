"""Files on the desktop for the server's callers: directory trees, the files to serve, uploads
stored and URLs downloaded (with retries), and the user's Desktop directory.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any, BinaryIO

import httpx

from cua_rollout.desktop.errors import (
    DownloadFailed,
    NoSuchPath,
    NotADirectory,
    NotAReadableFile,
    UploadFailed,
)

__all__ = [
    "desktop_directory",
    "directory_tree",
    "download",
    "expand_path",
    "list_directory",
    "readable_file",
    "save_upload",
]


def expand_path(path: str) -> Path:
    """``~`` and ``$VARS`` expanded, as OSWorld does for file paths."""
    return Path(os.path.expandvars(os.path.expanduser(path)))


def desktop_directory() -> Path | None:
    """The user's ``~/Desktop``, or None when there is none."""
    path = Path.home() / "Desktop"
    return path if path.is_dir() else None


def list_directory(path: object) -> dict[str, Any]:
    """The tree under ``path`` (a request's value; ``~`` and ``$VARS`` expanded, as for the
    other file routes; blocking, run it in a thread); raises ``NotADirectory`` unless it is
    the path of a directory."""
    if not isinstance(path, str) or not expand_path(path).is_dir():
        raise NotADirectory(path)
    return directory_tree(str(expand_path(path)))


def directory_tree(directory: str, ancestors: frozenset[str] = frozenset()) -> dict[str, Any]:
    """OSWorld's ``directory_tree``; a symlink back to an ancestor is listed, not followed."""
    tree: dict[str, Any] = {
        "type": "directory",
        "name": os.path.basename(directory),
        "children": [],
    }
    real = os.path.realpath(directory)
    if real in ancestors:
        return tree
    try:
        for entry in os.listdir(directory):
            full = os.path.join(directory, entry)
            if os.path.isdir(full):
                tree["children"].append(directory_tree(full, ancestors | {real}))
            else:
                tree["children"].append({"type": "file", "name": entry})
    except OSError as exc:
        return {"error": str(exc)}
    return tree


def readable_file(path: str) -> Path:
    """``path`` expanded, once it is known to be a file the server can read; raises
    ``NoSuchPath`` or ``NotAReadableFile`` (a directory, no permission)."""
    resolved = expand_path(path)
    if not resolved.exists():
        raise NoSuchPath(resolved)
    if not resolved.is_file() or not os.access(resolved, os.R_OK):
        raise NotAReadableFile(resolved)
    return resolved


def save_upload(source: BinaryIO, path: str) -> int:
    """Store the whole of ``source`` at ``path`` (expanded; parents created) and return its
    size. Blocking: run it in a thread. Raises ``UploadFailed``."""
    target = expand_path(path)
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        source.seek(0)
        with open(target, "wb") as out:
            shutil.copyfileobj(source, out)
        return target.stat().st_size
    except OSError as exc:
        raise UploadFailed(str(exc)) from exc


async def download(client: httpx.AsyncClient, url: str, path: str, *, attempts: int) -> int:
    """Download ``url`` to ``path`` (expanded; parents created; written whole or not at all)
    and return its size, trying up to ``attempts`` times. Raises ``DownloadFailed``."""
    target = expand_path(path)
    error: Exception | None = None
    for _ in range(attempts):
        try:
            return await _download_once(client, url, target)
        except (httpx.HTTPError, OSError) as exc:
            error = exc
    raise DownloadFailed(url, error)


async def _download_once(client: httpx.AsyncClient, url: str, path: Path) -> int:
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".part")
    try:
        async with client.stream("GET", url) as response:
            response.raise_for_status()
            with open(partial, "wb") as out:
                async for chunk in response.aiter_bytes():
                    out.write(chunk)  # small local writes: not worth a thread each
        partial.replace(path)
    finally:
        partial.unlink(missing_ok=True)
    return path.stat().st_size
