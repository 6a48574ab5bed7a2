"""The retention sweeper (``storage.retention``): every ``sweep_interval_s``, in the storage
actor's process, the step images of *released* episodes (their group acked in the trainer's
index; without an index, their results line written) are removed or re-encoded as the
policy says, with a marker per episode (core/retention.py), and the run directory is kept
within ``max_gb``, oldest released first.

Incremental: a sweep reads only what is new. Two cursors over results.jsonl (byte offsets of
complete lines, with the file's identity; a compaction at start that rewrites the file
carries them to the same lines of the new one: ``carry_cursors``) size each new episode's
directory once and, without an index, release each line
once; with an index, released groups are the acked ones not yet swept (one indexed query,
``TrainingIndex.released_groups``). Cursors and totals persist in
``<run>/retention.state.json``.

Crash-safe: for one episode the order is (1) the group marked images-removed in the index
(no claim can hand it out from then on), (2) the marker written (atomically), (3) the images
removed. A kill -9 anywhere leaves either untouched images or a marker that names what is
(or is about to be) gone, so a reader never meets a missing screenshot without its reason;
the next sweep finds the group unswept, or the line past its cursor, and finishes the work
(a marker already there means done). A marker after the removal would leave a window, and
after a crash possibly forever, with images missing and no reason.

A sweep that fails (a full disk: the marker or the state cannot be written) stops where it
is, logs, counts ``sweep_errors`` and keeps ``last_error``; it touches neither results.jsonl
nor the index's episodes, and the next sweep starts over from the persisted cursors.
"""

from __future__ import annotations

import asyncio
import hashlib
import io
import json
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from sqlalchemy.exc import SQLAlchemyError

from cua_rollout.config import RetentionConfig
from cua_rollout.core.files import read_json, write_atomic
from cua_rollout.core.layout import (
    ATTEMPTS_DIR,
    RESULTS_FILE,
    RETENTION_STATE_FILE,
)
from cua_rollout.core.retention import RetentionMarker, read_marker, write_marker
from cua_rollout.training import TrainingIndex

__all__ = ["GB", "RetentionSweeper", "carry_cursors", "keeps_images", "reencode_image",
           "sampled", "saved_cursors"]

log = logging.getLogger(__name__)

GB = 1_000_000_000
# Acked groups read from the index per query.
_GROUPS_AT_ONCE = 64
# Released lines (no index) between two saves of the state file: a crash redoes at most
# these, each a marker read.
_SAVE_EVERY = 256
_STATE_FORMAT = 1
_IMAGE_SUFFIXES = (".png", ".webp")


def sampled(episode_id: str, fraction: float) -> bool:
    """Whether ``episode_id`` is in the ``fraction`` sample: a hash of the id, so the same
    episodes on every sweep, process and rerun."""
    digest = hashlib.blake2b(episode_id.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") < fraction * 2**64


def keeps_images(cfg: RetentionConfig, record: dict[str, Any]) -> bool:
    """Whether the policy keeps the images of this released episode (its result record)."""
    if cfg.images == "keep":
        return True
    if cfg.images == "after_ack":
        return False
    success = record.get("status") == "success"
    if cfg.images == "failures":
        return not success
    if cfg.images == "successes":
        return success
    return sampled(str(record.get("episode_id")), cfg.sample_fraction)


def reencode_image(data: bytes, mode: str, quality: int) -> bytes:
    """``data`` (a PNG) re-encoded: ``png_max`` the same pixels at zlib level 9 with
    optimize; ``webp`` lossy WebP at ``quality``."""
    from PIL import Image

    out = io.BytesIO()
    with Image.open(io.BytesIO(data)) as image:
        if mode == "png_max":
            image.save(out, "PNG", optimize=True, compress_level=9)
        elif mode == "webp":
            image.save(out, "WEBP", quality=quality, method=4)
        else:
            raise ValueError(f"unknown reencode mode {mode!r}")
    return out.getvalue()


def _finish(path: Path, marker: RetentionMarker) -> None:
    """What a marker says is gone, gone (a sweep cut between the marker and the removal)."""
    for name in marker.removed:
        (path / name).unlink(missing_ok=True)
    for name, replaced_by in marker.reencoded.items():
        if replaced_by != name and (path / replaced_by).is_file():
            (path / name).unlink(missing_ok=True)


def _dir_bytes(path: Path) -> int:
    total = 0
    try:
        with os.scandir(path) as entries:
            for entry in entries:
                try:
                    if entry.is_dir(follow_symlinks=False):
                        total += _dir_bytes(Path(entry.path))
                    else:
                        total += entry.stat(follow_symlinks=False).st_size
                except OSError:
                    continue
    except OSError:
        return 0
    return total


def _results_identity(run_dir: Path) -> list[int] | None:
    try:
        st = (run_dir / RESULTS_FILE).stat()
    except FileNotFoundError:
        return None
    return [st.st_dev, st.st_ino]


def saved_cursors(run_dir: Path) -> list[int] | None:
    """The sweeper's two cursors in results.jsonl as its state file saved them, when they
    are of the file there now (the storage carries them over a compaction's rewrite)."""
    saved = read_json(run_dir / RETENTION_STATE_FILE)
    if (not isinstance(saved, dict) or saved.get("format") != _STATE_FORMAT
            or saved.get("results") != _results_identity(run_dir)):
        return None
    offsets = [saved.get("sized_offset"), saved.get("released_offset")]
    return offsets if all(isinstance(o, int) and o >= 0 for o in offsets) else None


def carry_cursors(run_dir: Path, offsets: list[int], *, fsync: bool = False) -> None:
    """results.jsonl was rewritten by a compaction: the cursors, moved to the same lines
    of the new file (``offsets``), are saved as of it, so the next sweep goes on where it
    was instead of sizing every episode again."""
    path = run_dir / RETENTION_STATE_FILE
    saved = read_json(path)
    if not isinstance(saved, dict):
        return
    saved["results"] = _results_identity(run_dir)
    saved["sized_offset"], saved["released_offset"] = offsets
    write_atomic(path, json.dumps(saved).encode(), fsync=fsync)


class RetentionSweeper:
    """One run directory's sweeper. ``sweep`` (blocking: call it in a thread) does one
    sweep and returns its counts; ``run`` sweeps every ``sweep_interval_s`` until
    cancelled. ``index`` gives the trainer's index (None when it is not open: nothing is
    released then); no ``index``: the run keeps none, each results line releases its
    episode. ``run_name`` gives the run's name in the index."""

    def __init__(self, run_dir: str | Path, cfg: RetentionConfig, *, fsync: bool = False,
                 index: Callable[[], TrainingIndex | None] | None = None,
                 run_name: Callable[[], str] | None = None,
                 clock: Callable[[], float] = time.time) -> None:
        self.run_dir = Path(run_dir)
        self.cfg = cfg
        self.fsync = fsync
        self._index = index
        self._run_name = run_name or (lambda: self.run_dir.name)
        self._clock = clock
        self._state_path = self.run_dir / RETENTION_STATE_FILE
        self.state: dict[str, Any] = {}
        self.counters: dict[str, Any] = {
            "sweeps": 0, "sweep_errors": 0, "episodes_released": 0, "episodes_removed": 0,
            "images_removed": 0, "images_reencoded": 0, "bytes_freed": 0,
            "run_dir_bytes": None, "budget_bytes": (int(cfg.max_gb * GB)
                                                    if cfg.max_gb is not None else None),
            "over_budget": False, "warning": None, "last_error": None}
        self._sweep: asyncio.Future[Any] | None = None
        self._sweeping = threading.Lock()  # one sweep at a time (the loop's, a tool's)
        # Set by a cancel of ``run``: the sweep under way stops at its next episode (a
        # first sweep sizing a long run's backlog would otherwise hold up the storage's close).
        self._stopping = threading.Event()

    # ------------------------------------------------------------- the loop

    async def run(self) -> None:
        """Sweep every ``sweep_interval_s`` (the first one right away) until cancelled; a
        cancel waits for the sweep under way in its thread."""
        while True:
            self._sweep = asyncio.ensure_future(asyncio.to_thread(self.sweep))
            try:
                await asyncio.shield(self._sweep)
            except asyncio.CancelledError:
                self._stopping.set()
                await asyncio.gather(self._sweep, return_exceptions=True)
                raise
            except Exception as exc:  # a bug, not the disk: logged whole, the loop goes on
                self.counters["sweep_errors"] += 1
                self.counters["last_error"] = f"retention sweep: {type(exc).__name__}: {exc}"
                log.exception("storage: the retention sweep failed")
            await asyncio.sleep(self.cfg.sweep_interval_s)

    def stats(self) -> dict[str, Any]:
        return dict(self.counters)

    # ------------------------------------------------------------- one sweep

    def sweep(self) -> dict[str, Any]:
        """One sweep; a failing disk or index does not raise (it is logged and counted)."""
        with self._sweeping:
            return self._sweep_once()

    def _sweep_once(self) -> dict[str, Any]:
        self.counters["sweeps"] += 1
        try:
            self._load_state()
            self._size_new_episodes()
            total = self._run_dir_bytes()
            total = self._release(total)
            self.counters["run_dir_bytes"] = total
            self._check_budget(total)
            self._save_state()
        except (OSError, SQLAlchemyError) as exc:
            self.counters["sweep_errors"] += 1
            cause = getattr(exc, "orig", None) or exc  # the driver's error, not SQL's dump
            why = f"{type(cause).__name__}: {(str(cause).strip().splitlines() or [''])[0]}"
            self.counters["last_error"] = f"retention sweep: {why}"
            # The cursors in memory still say what was done on disk (each moves only after
            # its episode's work); the next sweep goes on from them.
            log.error("storage: the retention sweep failed (the next one goes on from where "
                      "it stopped): %s", why)
        return self.stats()

    def _load_state(self) -> None:
        identity = _results_identity(self.run_dir)
        try:
            size = (self.run_dir / RESULTS_FILE).stat().st_size
        except FileNotFoundError:
            size = 0
        if not self.state:
            saved = read_json(self._state_path)
            self.state = saved if (isinstance(saved, dict)
                                   and saved.get("format") == _STATE_FORMAT) else {}
        if (self.state.get("format") != _STATE_FORMAT or self.state.get("results") != identity
                or size < max(self.state.get("sized_offset", 0),
                              self.state.get("released_offset", 0))):
            # A new results.jsonl (the first sweep, or a compaction at start replaced it):
            # its lines are sized again; released ones with a marker are skipped quickly.
            totals = self.state.get("totals") or {}
            self.state = {"format": _STATE_FORMAT, "results": identity, "sized_offset": 0,
                          "released_offset": 0, "episode_bytes": 0, "totals": totals}

    def _save_state(self) -> None:
        write_atomic(self._state_path, json.dumps(self.state).encode(), fsync=self.fsync)

    def _lines(self, offset: int) -> Iterator[tuple[int, dict[str, Any]]]:
        """Complete results.jsonl lines from byte ``offset``: (the offset after the line,
        its record), records only."""
        try:
            f = open(self.run_dir / RESULTS_FILE, "rb")  # noqa: SIM115 (a generator's file)
        except FileNotFoundError:
            return
        with f:
            f.seek(offset)
            for raw in f:
                if not raw.endswith(b"\n"):
                    return  # being appended: the next sweep reads it whole
                offset += len(raw)
                try:
                    record = json.loads(raw)
                except ValueError:
                    continue
                if isinstance(record, dict) and isinstance(record.get("episode_id"), str):
                    yield offset, record

    def _episode_dir(self, episode_id: str) -> Path | None:
        path = self.run_dir / episode_id
        # An id that leaves the run directory was never written by the storage either.
        if ".." in Path(episode_id).parts or Path(episode_id).is_absolute():
            return None
        return path

    def _size_new_episodes(self) -> None:
        for offset, record in self._lines(self.state["sized_offset"]):
            if self._stopping.is_set():
                return
            if record.get("status") != "cancelled":
                path = self._episode_dir(record["episode_id"])
                if path is not None:
                    self.state["episode_bytes"] += _dir_bytes(path)
            self.state["sized_offset"] = offset

    def _run_dir_bytes(self) -> int:
        """The episodes' files (as sized, less what was freed), plus the run's own files and
        the attempts still running: no walk of every episode."""
        total = max(0, self.state["episode_bytes"])
        with os.scandir(self.run_dir) as entries:
            for entry in entries:
                try:
                    if entry.is_file(follow_symlinks=False):
                        total += entry.stat(follow_symlinks=False).st_size
                except OSError:
                    continue
        return total + _dir_bytes(self.run_dir / ATTEMPTS_DIR)

    def _over(self, total: int) -> bool:
        budget = self.counters["budget_bytes"]
        return budget is not None and total > budget

    def _check_budget(self, total: int) -> None:
        over = self._over(total)
        self.counters["over_budget"] = over
        self.state["warning"] = None
        if not over:
            self.counters["warning"] = None
            return
        warning = (f"the run directory holds {total / GB:.3g} GB, over storage.retention."
                   f"max_gb {self.cfg.max_gb:g}, and nothing more may be removed (policy "
                   f"{self.cfg.images}: images of groups not acked yet are kept)")
        self.counters["warning"] = self.state["warning"] = warning
        log.warning("storage: %s", warning)

    # ------------------------------------------------------------- releasing

    def _eager(self) -> bool:
        return self.cfg.max_gb is None

    def _release(self, total: int) -> int:
        """Handle released episodes, oldest first: all of them without a budget, while the
        run directory is over it with one. Returns the run directory's bytes after."""
        if self._index is not None:
            index = self._index()
            if index is None:  # not open (yet, or any more): acks cannot be read
                return total
            return self._release_groups(index, total)
        for offset, record in self._lines(self.state["released_offset"]):
            if self._stopping.is_set() or not (self._eager() or self._over(total)):
                break
            if record.get("status") != "cancelled":
                freed = self._handle(record, None)
                total -= freed
            self.state["released_offset"] = offset
            self.counters["episodes_released"] += 1
            if self.counters["episodes_released"] % _SAVE_EVERY == 0:
                self._save_state()
        return total

    def _release_groups(self, index: TrainingIndex, total: int) -> int:
        run = self._run_name()
        while (self._eager() or self._over(total)) and not self._stopping.is_set():
            groups = index.released_groups(run, _GROUPS_AT_ONCE)
            if not groups:
                break
            for group in groups:
                if not (self._eager() or self._over(total)):
                    break
                plans = [(episode, self._plan(episode)) for episode in group.episodes]
                if any(plan in ("remove", "webp") for _, plan in plans):
                    # Before any file goes: from now on no claim hands the group out.
                    index.mark_images_removed(run, [group.group_id], self.cfg.images)
                for episode, plan in plans:
                    total -= self._handle(episode, plan)
                    self.counters["episodes_released"] += 1
                index.mark_swept(run, [group.group_id])
        return total

    def _plan(self, record: dict[str, Any]) -> str:
        if not keeps_images(self.cfg, record):
            return "remove"
        return self.cfg.reencode  # none, png_max or webp

    def _handle(self, record: dict[str, Any], plan: str | None) -> int:
        """One released episode: its images removed or re-encoded (marker first, see the
        module's docstring). Returns the bytes freed."""
        plan = plan or self._plan(record)
        if plan == "none":
            return 0
        path = self._episode_dir(str(record["episode_id"]))
        if path is None:
            return 0
        done = read_marker(path)
        if done is not None:  # an earlier sweep's, cut before its cursor moved: finish it
            _finish(path, done)
            return 0
        try:
            images = sorted(p for p in path.iterdir()
                            if p.suffix in _IMAGE_SUFFIXES and p.is_file())
        except (FileNotFoundError, NotADirectoryError):
            return 0
        if not images:
            return 0
        if plan == "remove":
            sizes = {p.name: p.stat().st_size for p in images}
            marker = RetentionMarker(self.cfg.images, at=self._clock(), removed=sorted(sizes),
                                     bytes_freed=sum(sizes.values()))
            write_marker(path, marker, fsync=self.fsync)
            for p in images:
                p.unlink(missing_ok=True)
            self._count(marker, removed=True)
            return marker.bytes_freed
        return self._reencode(path, [p for p in images if p.suffix == ".png"], plan)

    def _reencode(self, path: Path, images: list[Path], mode: str) -> int:
        marker = RetentionMarker(self.cfg.images, at=self._clock(), reencode=mode)
        gone: list[Path] = []
        for p in images:
            data = p.read_bytes()
            try:
                smaller = reencode_image(data, mode, self.cfg.webp_quality)
            except (OSError, ValueError) as exc:  # not an image PIL reads: left as it is
                log.warning("storage: retention cannot re-encode %s: %s", p, exc)
                continue
            if mode == "png_max":
                if len(smaller) >= len(data):
                    continue
                write_atomic(p, smaller, fsync=self.fsync)  # the same pixels, in place
                marker.reencoded[p.name] = p.name
            else:
                target = p.with_suffix(".webp")
                write_atomic(target, smaller, fsync=self.fsync)
                marker.reencoded[p.name] = target.name
                gone.append(p)
            marker.bytes_freed += len(data) - len(smaller)
        if not marker.reencoded:
            return 0
        # The new files first, then the marker naming them, then the PNGs they replace.
        write_marker(path, marker, fsync=self.fsync)
        for p in gone:
            p.unlink(missing_ok=True)
        self._count(marker, removed=False)
        return marker.bytes_freed

    def _count(self, marker: RetentionMarker, *, removed: bool) -> None:
        self.state["episode_bytes"] = self.state.get("episode_bytes", 0) - marker.bytes_freed
        self.counters["bytes_freed"] += marker.bytes_freed
        totals = self.state.setdefault("totals", {})
        if removed:
            self.counters["episodes_removed"] += 1
            self.counters["images_removed"] += len(marker.removed)
            totals["episodes_removed"] = totals.get("episodes_removed", 0) + 1
        else:
            self.counters["images_reencoded"] += len(marker.reencoded)
            totals["episodes_reencoded"] = totals.get("episodes_reencoded", 0) + 1
        totals["bytes_freed"] = totals.get("bytes_freed", 0) + marker.bytes_freed
        totals["policy"] = marker.policy
        totals["reencode"] = self.cfg.reencode
        totals["last_at"] = marker.at
