"""The host's cache of files tasks download (setup ``download`` steps, the History template of
``update_browse_history``): each URL fetched once per host, however many processes ask at
once, and the only place on this host besides the task roots that a task may read from.

A file is looked for under OSWorld's own cache names first (an OSWorld cache directory works
as it is), then in our store ``<root>/by-url/<sha256(url)[:32]>/<name>``, where downloads go.
Several processes asking for one URL take turns on ``<root>/by-url/<key>.lock`` (``flock``):
the first downloads, the others find its file when they get the lock.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import hashlib
import logging
import os
import tempfile
import uuid
from collections.abc import AsyncIterator, Iterable
from pathlib import Path
from typing import BinaryIO

import httpx2

from cua_rollout.config import DesktopsConfig
from cua_rollout.core.aio import backoff_s
from cua_rollout.core.errors import BadTaskStep, DownloadMissing, TaskSetupError
from cua_rollout.core.http import error_text, redact_url, ssl_context

__all__ = ["DownloadCache", "confined_path", "download_cache"]

log = logging.getLogger(__name__)

# Our store's folder under the cache root (OSWorld's own names sit in the root itself).
STORE_DIR = "by-url"
# Hex digits of the URL's sha256 naming its folder in the store: 128 bits, no collisions.
_KEY_HEX_CHARS = 32
# Attempts at one download (OSWorld makes 3), all within ``download_timeout_s``; only
# transport errors and 5xx replies are tried again.
_ATTEMPTS = 3
_RETRY_BACKOFF_INITIAL_S = 1.0
_RETRY_BACKOFF_MAX_S = 10.0
# Connecting to a file server is fast or not at all.
_CONNECT_TIMEOUT_S = 20.0
# Bytes read from the reply per write to the temporary file.
_CHUNK_BYTES = 1 << 20
# Waiting for another process's download of the same URL: how often the lock is tried, and
# how long past that download's own deadline we wait before giving up on it.
_LOCK_POLL_S = 0.1
_LOCK_MARGIN_S = 30.0
# Longest part of an error reply quoted in an error.
_ERROR_TEXT_CHARS = 200


def confined_path(path: str | os.PathLike[str], roots: Iterable[Path]) -> Path:
    """``path`` resolved (symlinks followed), when that is a path under one of ``roots``
    (resolved too): the only files on this host a task may have read. Raises ``ValueError``
    naming the path and the roots otherwise; nothing is read."""
    resolved = Path(path).resolve()
    allowed = [Path(root).resolve() for root in roots]
    if not any(resolved != root and resolved.is_relative_to(root) for root in allowed):
        raise ValueError(
            f"{os.fspath(path)!r} (resolved: {resolved}) is outside the directories tasks "
            f"may read files from on this host: {', '.join(map(str, allowed))}"
        )
    return resolved


class DownloadCache:
    """Files by URL under ``root``. ``lookup`` reads the cache only; ``fetch`` also downloads
    what is missing, unless ``offline``. Every path returned resolves into ``root``: a cached
    name linked out of it raises ``BadTaskStep`` (a task must not read ``~/.ssh`` through a
    link someone left in the cache)."""

    def __init__(self, root: Path, *, offline: bool, timeout_s: float) -> None:
        self.root = Path(root)
        self.offline = offline
        self.timeout_s = timeout_s

    def store_path(self, url: str, name: str) -> Path:
        """Where ``fetch`` puts ``url`` saved as ``name``."""
        return self._key_dir(url) / _file_name(name, url)

    def candidates(self, url: str, name: str, task_id: str | None = None) -> list[Path]:
        """Every path ``url`` (saved as ``name``) is looked for at, in order: the two names
        keyed by the exact URL (OSWorld's ``<uuid5(url)>_<name>``, our store), then
        OSWorld's per-task and flat names, then the URL's own file name (what
        ``download_cache_dir`` held before there was a store)."""
        name = _file_name(name, url)
        paths = [self.root / f"{uuid.uuid5(uuid.NAMESPACE_URL, url)}_{name}",
                 self.store_path(url, name)]
        if task_id:
            paths.append(self.root / task_id / name)
        paths.append(self.root / name)
        url_name = os.path.basename(url.split("?", 1)[0].split("#", 1)[0])
        if url_name and url_name not in (".", "..", name):
            paths.append(self.root / url_name)
        return paths

    def lookup(self, url: str, name: str, task_id: str | None = None) -> Path | None:
        """The cached file for ``url``, or None; never the network. Blocking (it stats
        files): call it off the event loop in async code."""
        for candidate in self.candidates(url, name, task_id):
            if candidate.is_file():
                try:
                    return confined_path(candidate, [self.root])
                except ValueError as exc:
                    raise BadTaskStep(f"download of {redact_url(url)}: {exc}") from exc
        return None

    async def fetch(self, url: str, name: str, task_id: str | None = None) -> Path:
        """The local file for ``url``: from the cache, else downloaded into the store (once
        per host: the download runs under the URL's lock and the cache is looked at again
        once the lock is held). Raises ``TaskSetupError`` naming the URL and the paths looked
        at when offline, and the HTTP status or the transport error when a download fails."""
        name = _file_name(name, url)
        found = await asyncio.to_thread(self.lookup, url, name, task_id)
        if found is not None:
            return found
        if self.offline:
            raise DownloadMissing(
                f"download of {redact_url(url)}: not in the cache (looked for "
                f"{self._looked_for(url, name, task_id)}) and desktops.offline is set; put "
                f"the file at {self.store_path(url, name)} first"
            )
        async with self._locked(url):
            found = await asyncio.to_thread(self.lookup, url, name, task_id)
            if found is not None:  # another process downloaded it while we waited
                return found
            target = self.store_path(url, name)
            await self._download(url, target)
        return await asyncio.to_thread(confined_path, target, [self.root])

    # ----------------------------------------------------------------- internals

    def _key_dir(self, url: str) -> Path:
        key = hashlib.sha256(url.encode("utf-8")).hexdigest()[:_KEY_HEX_CHARS]
        return self.root / STORE_DIR / key

    def _looked_for(self, url: str, name: str, task_id: str | None) -> str:
        return ", ".join(str(p) for p in self.candidates(url, name, task_id))

    @contextlib.asynccontextmanager
    async def _locked(self, url: str) -> AsyncIterator[None]:
        """Hold ``url``'s lock file. ``flock`` is tried without blocking and retried on the
        loop, so a cancelled wait leaves no thread behind that would take the lock later
        and keep it; the lock goes with the file descriptor, even if the process dies."""
        lock_path = self._key_dir(url).with_suffix(".lock")
        fd = await asyncio.to_thread(_open_lock_file, lock_path)
        try:
            loop = asyncio.get_running_loop()
            deadline = loop.time() + self.timeout_s + _LOCK_MARGIN_S
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if loop.time() > deadline:
                        raise TaskSetupError(
                            f"download of {redact_url(url)}: another process has held "
                            f"{lock_path} for over {self.timeout_s + _LOCK_MARGIN_S:.0f}s"
                        ) from None
                    await asyncio.sleep(_LOCK_POLL_S)
            yield
        finally:
            os.close(fd)

    async def _download(self, url: str, target: Path) -> None:
        """``url`` into ``target``: streamed to a temporary file beside it, renamed when
        whole, so a reader never sees part of a file. The caller holds the URL's lock."""
        shown = redact_url(url)
        await asyncio.to_thread(_clear_partial_files, target.parent)
        try:
            async with asyncio.timeout(self.timeout_s):
                last = ""
                for attempt in range(_ATTEMPTS):
                    if attempt:
                        await asyncio.sleep(backoff_s(attempt, _RETRY_BACKOFF_INITIAL_S,
                                                      _RETRY_BACKOFF_MAX_S))
                    try:
                        await self._download_once(url, target)
                        log.info("downloaded %s to %s", shown, target)
                        return
                    except _Retryable as exc:
                        last = str(exc)
                        log.warning("download of %s, attempt %d/%d: %s", shown, attempt + 1,
                                    _ATTEMPTS, last)
                raise TaskSetupError(f"download of {shown} failed after {_ATTEMPTS} "
                                     f"attempts: {last}")
        except TimeoutError as exc:
            raise TaskSetupError(
                f"download of {shown}: not done within {self.timeout_s:g}s "
                "(desktops.download_timeout_s)"
            ) from exc

    async def _download_once(self, url: str, target: Path) -> None:
        shown = redact_url(url)
        timeout = httpx2.Timeout(self.timeout_s, connect=_CONNECT_TIMEOUT_S)
        fd, partial = await asyncio.to_thread(
            tempfile.mkstemp, dir=target.parent, prefix=f".{target.name}.", suffix=".part")
        try:
            with os.fdopen(fd, "wb") as out:
                # A client per download: each URL is fetched once per host, so there is no
                # pool worth keeping between them.
                async with (
                    httpx2.AsyncClient(timeout=timeout, follow_redirects=True,
                                       verify=ssl_context()) as client,
                    client.stream("GET", url) as response,
                ):
                    if response.status_code >= 400:
                        await response.aread()
                        message = (f"download of {shown}: HTTP {response.status_code}: "
                                   f"{error_text(response, _ERROR_TEXT_CHARS)}")
                        if response.status_code >= 500:
                            raise _Retryable(message)
                        raise DownloadMissing(message)
                    async for chunk in response.aiter_bytes(_CHUNK_BYTES):
                        await asyncio.to_thread(out.write, chunk)
                await asyncio.to_thread(_flush_and_sync, out)
            await asyncio.to_thread(os.replace, partial, target)
        except httpx2.TransportError as exc:
            raise _Retryable(f"{type(exc).__name__}: {exc}") from exc
        except httpx2.HTTPError as exc:  # e.g. too many redirects, an invalid URL
            raise TaskSetupError(f"download of {shown}: {type(exc).__name__}: {exc}") from exc
        except OSError as exc:
            raise TaskSetupError(f"download of {shown}: cannot write {target}: "
                                 f"{exc.strerror or exc}") from exc
        finally:
            with contextlib.suppress(FileNotFoundError):
                await asyncio.to_thread(os.unlink, partial)


def download_cache(cfg: DesktopsConfig) -> DownloadCache:
    """The host's cache as the config describes it (``desktops.download_cache_dir``,
    ``offline``, ``download_timeout_s``)."""
    return DownloadCache(cfg.download_cache_dir, offline=cfg.offline,
                         timeout_s=cfg.download_timeout_s)


class _Retryable(Exception):
    """A download attempt that another attempt may get past (transport error, 5xx)."""


def _file_name(name: str, url: str) -> str:
    """``name`` as a file name of its own: a task's desktop path's last part, which must not
    climb out of the folder it is joined to."""
    base = os.path.basename(str(name))
    if base in ("", ".", ".."):
        raise BadTaskStep(f"download of {redact_url(url)}: {name!r} names no file")
    return base


def _open_lock_file(path: Path) -> int:
    path.parent.mkdir(parents=True, exist_ok=True)
    return os.open(path, os.O_RDWR | os.O_CREAT, 0o644)


def _clear_partial_files(directory: Path) -> None:
    """Create ``directory`` and remove what a process that died mid-download left in it
    (only ever called under the URL's lock, so no download of it is running)."""
    directory.mkdir(parents=True, exist_ok=True)
    for leftover in directory.glob(".*.part"):
        with contextlib.suppress(FileNotFoundError):
            leftover.unlink()


def _flush_and_sync(out: BinaryIO) -> None:
    out.flush()
    os.fsync(out.fileno())
