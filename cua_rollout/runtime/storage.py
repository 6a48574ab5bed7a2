"""All writes of a run: per-step screenshots and records, episode summaries, the results
index, the metrics timeline and run.json (layout: docs/results_format.md).

Runs as an async Ray actor (``ray.remote(StorageActor)``) or in-process. Calls only enqueue:
the writes happen on a few writer tasks, each owning the episodes hashed to it, so one
episode's files are written in call order and ``record_result`` (the results.jsonl line)
lands after that episode's other files. The queues are bounded: a caller that awaits its
call waits for room, which is the backpressure runners feel when the disk falls behind.

Each results.jsonl line, once durable, goes to the storage's subscribers: the trainer's index
(``IndexFeed``, cua_rollout/runtime/index_feed.py) is one; it never holds up a result
(results.jsonl stays the source of truth; the next start re-syncs the index).

The storage never lies: a write that fails (disk full, I/O error) is remembered for its
episode's attempt; ``finish_episode`` answers with it, so the runner turns the episode into an
error instead of a result whose files are missing; ``record_result`` raises ``StorageError``
when its line cannot be appended (a cut append is truncated back), so the coordinator stops
the run instead of believing it recorded.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import shutil
import time
import zlib
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiofiles
import aiofiles.os

from cua_rollout.config import StorageConfig
from cua_rollout.core.errors import StorageError
from cua_rollout.core.files import (
    append_text,
    read_json,
    repair_jsonl_tail,
    replace_atomic,
    write_atomic,
)
from cua_rollout.core.layout import (
    EPISODE_FILE,
    MESSAGES_FILE,
    METRICS_FILE,
    OSWORLD_RESULT_FILE,
    RESULTS_FILE,
    RUN_FILE,
    SUPERSEDED_RESULTS_FILE,
    TASK_CONFIG_FILE,
    TRAJ_FILE,
)
from cua_rollout.runtime.actors import StorageClient
from cua_rollout.runtime.index_feed import IndexFeed

__all__ = ["PART_BYTES", "EpisodeWriter", "StorageActor", "compact_results", "png_parts"]

log = logging.getLogger(__name__)

# Size of the parts a screenshot is sent in (write_step): below Ray's inline limit for
# call arguments (max_direct_call_object_size, 100 KiB by default) with room for framing.
PART_BYTES = 64 * 1024
# How long the end of a run waits for a lagging index before it says how to catch it up.
_INDEX_DRAIN_S = 30.0
# Writers per actor: episodes are hashed over them, so disk latency of one episode's file
# does not hold up the others; 4 keeps the thread pool busy without reordering anything.
_WRITERS = 4


@dataclass
class _Job:
    kind: str
    episode_id: str | None
    attempt: int
    payload: dict[str, Any] = field(default_factory=dict)
    done: asyncio.Future[None] | None = None


def _dumps(obj: Any) -> str:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"), default=str)


class StorageActor:
    """Writes one run directory. Create it once per run; every method is cheap to call."""

    def __init__(self, run_dir: str | Path, cfg: StorageConfig | None = None) -> None:
        self.run_dir = Path(run_dir)
        self.cfg = cfg or StorageConfig()
        self._queues: list[asyncio.Queue[_Job]] = []
        self._writers: list[asyncio.Task[None]] = []
        self._results_lock: asyncio.Lock | None = None
        self._attempts: dict[str, int] = {}  # episode -> attempt whose files are current
        self._dirs: dict[str, Path] = {}      # episode -> its directory, checked once
        self._failed: dict[str, str] = {}     # episode -> first failed write of its attempt
        self.last_error: str | None = None
        self._root = self.run_dir.resolve()
        self._run_info: dict[str, Any] = {}
        self.counters = {"steps": 0, "screenshots": 0, "episodes": 0, "results": 0,
                         "metrics": 0, "dropped_stale": 0, "errors": 0, "bytes": 0}
        # Called with each record once its results.jsonl line is durable (never raising
        # into the write: a subscriber's failure is logged).
        self.subscribers: list[Callable[[dict[str, Any]], None]] = []
        self.index_feed = IndexFeed(self.run_dir, self.cfg, on_error=self._index_error)

    # ----------------------------------------------------------------- run

    async def start_run(self, info: dict[str, Any], *, rerun_infra_errors: bool = True
                        ) -> dict[str, Any]:
        """Create the run directory, repair a results.jsonl cut short by a crash, keep one
        line per episode in it (``compact_results``; infra_error lines go too when they are
        to be rerun), write run.json (status ``running``). Returns what was repaired."""
        self._ensure_writers()
        await aiofiles.os.makedirs(self.run_dir, exist_ok=True)
        cut = await asyncio.to_thread(repair_jsonl_tail, self.run_dir / RESULTS_FILE)
        compacted = await asyncio.to_thread(
            compact_results, self.run_dir / RESULTS_FILE,
            self.run_dir / SUPERSEDED_RESULTS_FILE,
            ("infra_error",) if rerun_infra_errors else (), fsync=self.cfg.fsync)
        previous = await asyncio.to_thread(read_json, self.run_dir / RUN_FILE)
        self._run_info = {
            **info,
            "run_dir": str(self.run_dir),
            "started_at": time.time(),
            "ended_at": None,
            "status": "running",
        }
        if isinstance(previous, dict):
            # A resumed run keeps the history of its earlier starts.
            starts = previous.get("previous_starts") or []
            starts.append({k: previous.get(k) for k in ("started_at", "ended_at", "status")})
            self._run_info["previous_starts"] = starts
        await self._write_atomic(self.run_dir / RUN_FILE, _dumps(self._run_info).encode())
        synced = None
        if self.cfg.index:
            synced = await self.index_feed.open(str(self._run_info.get("run")
                                                    or self.run_dir.name))
            self.subscribers.append(self.index_feed.recorded)
        return {"results_tail_cut_bytes": cut, "results_compacted": compacted,
                "index": synced}

    async def end_run(self, status: str, summary: dict[str, Any] | None = None) -> None:
        """Flush everything (the index for at most ``_INDEX_DRAIN_S``), then mark run.json
        ended with ``status``."""
        await self.flush()
        if not await self.index_feed.drain(_INDEX_DRAIN_S):
            log.error("storage: the index is %d episode(s) behind (%s); results.jsonl has "
                      "them: `python -m cua_rollout.training reindex %s` catches it up",
                      self.index_feed.pending, self.last_error, self.run_dir)
            self._run_info["index_behind"] = self.index_feed.pending
        self._run_info.update(ended_at=time.time(), status=status)
        if summary is not None:
            self._run_info["summary"] = summary
        await self._write_atomic(self.run_dir / RUN_FILE, _dumps(self._run_info).encode())

    # ----------------------------------------------------------------- episodes

    async def begin_episode(self, episode_id: str, attempt: int, task: dict[str, Any]) -> None:
        """Start (or restart) an episode's directory: files of earlier attempts are removed,
        writes still queued for them are dropped."""
        await self._put(_Job("begin", episode_id, attempt, {"task": task}))

    async def write_step(
        self,
        episode_id: str,
        attempt: int,
        record: dict[str, Any] | None,
        png_name: str | None = None,
        *png_parts: bytes,
    ) -> None:
        """Append a traj.jsonl line (``record``) and/or write the screenshot ``png_name``,
        whose PNG comes cut in parts of at most ``PART_BYTES`` (``png_parts``), one argument
        each. Ray carries an argument up to 100 KiB inside the call's message; a bigger one
        goes through the object store (a put, raylet round trips, a fetch): a 350 KB
        screenshot costs ~6 ms of CPU over the caller, the raylet and this actor that way,
        ~3 ms as six inline parts (measured with two actors on this project's 2-core
        machine). ``EpisodeWriter.step`` cuts them."""
        await self._put(_Job("step", episode_id, attempt,
                             {"record": record, "png": list(png_parts) if png_parts else None,
                              "png_name": png_name}))

    async def finish_episode(
        self,
        episode_id: str,
        attempt: int,
        record: dict[str, Any],
        messages: list[dict[str, Any]] | None = None,
    ) -> str | None:
        """episode.json, result.txt (scored episodes) and messages.json of an attempt; returns
        once they are written, with None, or the first write of this attempt that failed."""
        await self._wait(_Job("finish", episode_id, attempt,
                              {"record": record, "messages": messages}))
        if self._attempts.get(episode_id) != attempt:
            return None  # superseded: its writes were dropped on purpose
        return self._failed.get(episode_id)

    async def record_result(self, record: dict[str, Any]) -> None:
        """The episode is final: append its line to results.jsonl (after its other files).
        Returns once it is written; ``StorageError`` if it could not be."""
        try:
            await self._wait(_Job("result", record["episode_id"],
                                  int(record.get("attempt", 0)), {"record": record}))
        except OSError as exc:
            raise StorageError(f"{RESULTS_FILE}: {exc}") from exc

    async def forget_episode(self, episode_id: str, attempt: int) -> None:
        """An attempt that ends without a result line (cancelled): drop what is kept for it."""
        if self._attempts.get(episode_id) == attempt:
            for kept in (self._attempts, self._dirs, self._failed):
                kept.pop(episode_id, None)

    async def write_metrics(self, sample: dict[str, Any]) -> None:
        await self._put(_Job("metrics", None, 0, {"sample": sample}))

    async def flush(self) -> None:
        """Return once everything enqueued before this call is on disk."""
        self._ensure_writers()
        loop = asyncio.get_running_loop()
        futures = []
        for queue in self._queues:
            done: asyncio.Future[None] = loop.create_future()
            futures.append(done)
            await queue.put(_Job("flush", None, 0, done=done))
        await asyncio.gather(*futures)

    def stats(self) -> dict[str, Any]:
        return {**self.counters, **self.index_feed.counters,
                "queued": sum(q.qsize() for q in self._queues),
                "index_pending": self.index_feed.pending, "last_error": self.last_error}

    async def close(self) -> None:
        await self.flush()
        for task in self._writers:
            task.cancel()
        await asyncio.gather(*self._writers, return_exceptions=True)
        self._writers = []
        self._queues = []
        await self.index_feed.close()

    # ----------------------------------------------------------------- subscribers

    def _index_error(self, error: str) -> None:
        self.last_error = error

    def _published(self, record: dict[str, Any]) -> None:
        """The record's line is durable: hand it to each subscriber."""
        for subscriber in self.subscribers:
            try:
                subscriber(record)
            except Exception:  # the line is written: a subscriber cannot undo that
                log.exception("storage: a subscriber of results failed")

    # ----------------------------------------------------------------- internals

    def _ensure_writers(self) -> None:
        # Loop-bound objects are made on the actor's running loop, not in __init__.
        if self._writers:
            return
        per_writer = max(1, self.cfg.queue_max_items // _WRITERS)
        self._queues = [asyncio.Queue(per_writer) for _ in range(_WRITERS)]
        self._results_lock = asyncio.Lock()
        self._writers = [asyncio.create_task(self._writer(q)) for q in self._queues]

    async def _put(self, job: _Job) -> None:
        self._ensure_writers()
        index = zlib.crc32(job.episode_id.encode()) % _WRITERS if job.episode_id else 0
        await self._queues[index].put(job)

    async def _wait(self, job: _Job) -> None:
        """Enqueue ``job`` and return once it is handled (raising what it raised)."""
        job.done = asyncio.get_running_loop().create_future()
        await self._put(job)
        await job.done

    async def _writer(self, queue: asyncio.Queue[_Job]) -> None:
        while True:
            job = await queue.get()
            error: Exception | None = None
            try:
                await self._handle(job)
            except Exception as exc:
                # A failed write must not stop the writer (other episodes keep going); it is
                # counted, logged, and kept for the episode's attempt (finish_episode says so).
                error = exc
                self.counters["errors"] += 1
                self.last_error = f"{job.kind} of {job.episode_id}: {exc}"
                log.error("storage: %s", self.last_error)
                if (job.episode_id is not None and job.kind in ("begin", "step", "finish")
                        and self._attempts.get(job.episode_id) == job.attempt):
                    self._failed.setdefault(job.episode_id, f"{job.kind}: {exc}")
            finally:
                if job.done is not None and not job.done.done():
                    if error is not None and job.kind == "result":
                        job.done.set_exception(error)
                    else:
                        job.done.set_result(None)

    def _episode_dir(self, episode_id: str) -> Path:
        path = self._dirs.get(episode_id)
        if path is None:
            path = (self.run_dir / episode_id).resolve()
            if self._root not in path.parents:
                raise ValueError(f"episode id {episode_id!r} leaves the run directory")
            self._dirs[episode_id] = path
        return path

    async def _handle(self, job: _Job) -> None:
        # Each job's file work runs in one thread call: a screenshot and its traj.jsonl line
        # cost one hop to the thread pool, not one per open, write, close and rename.
        if job.kind == "flush":
            return
        if job.kind == "metrics":
            await asyncio.to_thread(append_text, self.run_dir / METRICS_FILE,
                                    _dumps(job.payload["sample"]) + "\n")
            self.counters["metrics"] += 1
            return
        assert job.episode_id is not None
        if job.kind == "begin":
            self._attempts[job.episode_id] = job.attempt
            self._failed.pop(job.episode_id, None)
            directory = self._episode_dir(job.episode_id)
            task = json.dumps(job.payload["task"], indent=2, ensure_ascii=False).encode()
            await asyncio.to_thread(_begin, directory, task, self.cfg.fsync)
            return
        if job.kind == "result":
            record = job.payload["record"]
            failed = self._failed.pop(job.episode_id, None)
            begun = self._attempts.pop(job.episode_id, None)
            directory = self._episode_dir(job.episode_id)
            self._dirs.pop(job.episode_id, None)
            if failed is not None and record.get("status") != "infra_error":
                # Its files are incomplete: never a result that claims them.
                record = {**record, "status": "infra_error", "reward": None,
                          "error": f"storage: {failed}"}
            if begun != job.attempt:
                # The directory holds another attempt's files (this one never got a desktop):
                # it is rewritten so that the line and the directory describe one attempt.
                await asyncio.to_thread(_rewrite_for, directory, record, self.cfg.fsync)
            assert self._results_lock is not None
            async with self._results_lock:
                await asyncio.to_thread(append_text, self.run_dir / RESULTS_FILE,
                                        _dumps(record) + "\n", fsync=self.cfg.fsync)
            self.counters["results"] += 1
            self._published(record)
            return
        if self._attempts.get(job.episode_id) != job.attempt:
            # A write of an attempt that was superseded (its runner died and the episode
            # was restarted elsewhere): never mix it into the new attempt's files.
            self.counters["dropped_stale"] += 1
            return
        directory = self._episode_dir(job.episode_id)
        if job.kind == "step":
            parts, name = job.payload["png"], job.payload["png_name"]
            png = b"".join(parts) if parts and name else None  # sent in parts (write_step)
            record = job.payload["record"]
            line = _dumps(record) + "\n" if record is not None else None
            await asyncio.to_thread(_step, directory, name, png, line, self.cfg.fsync)
            if png is not None:
                self.counters["screenshots"] += 1
                self.counters["bytes"] += len(png)
            if line is not None:
                self.counters["steps"] += 1
        elif job.kind == "finish":
            record = job.payload["record"]
            files = [(EPISODE_FILE, json.dumps(record, indent=2, ensure_ascii=False,
                                               default=str).encode())]
            if record.get("reward") is not None:
                files.append((OSWORLD_RESULT_FILE, f"{float(record['reward'])}\n".encode()))
            messages = job.payload["messages"]
            if messages is not None and self.cfg.save_messages:
                files.append((MESSAGES_FILE, json.dumps(messages, ensure_ascii=False).encode()))
            await asyncio.to_thread(_write_files, directory, files, self.cfg.fsync)
            self.counters["episodes"] += 1

    async def _write_atomic(self, path: Path, data: bytes) -> None:
        await asyncio.to_thread(write_atomic, path, data, fsync=self.cfg.fsync)


# ----------------------------------------------------------------- file work (in threads)


def _begin(directory: Path, task: bytes, fsync: bool) -> None:
    shutil.rmtree(directory, ignore_errors=True)
    directory.mkdir(parents=True, exist_ok=True)
    write_atomic(directory / TASK_CONFIG_FILE, task, fsync=fsync)


def _step(directory: Path, name: str | None, png: bytes | None, line: str | None,
          fsync: bool) -> None:
    if png is not None and name:
        write_atomic(directory / name, png, fsync=fsync)
    if line is not None:
        append_text(directory / TRAJ_FILE, line, fsync=fsync)


def _rewrite_for(directory: Path, record: dict[str, Any], fsync: bool) -> None:
    """An episode directory left by an earlier attempt, replaced by the final attempt's
    episode.json (task_config.json, the task's, is kept)."""
    if not directory.is_dir():
        return
    task = directory / TASK_CONFIG_FILE
    keep = task.read_bytes() if task.is_file() else None
    shutil.rmtree(directory, ignore_errors=True)
    directory.mkdir(parents=True, exist_ok=True)
    if keep is not None:
        write_atomic(task, keep, fsync=fsync)
    write_atomic(directory / EPISODE_FILE,
                 json.dumps(record, indent=2, ensure_ascii=False, default=str).encode(),
                 fsync=fsync)


def compact_results(path: Path, archive: Path, drop_statuses: tuple[str, ...] = (), *,
                    fsync: bool = False) -> dict[str, int]:
    """Keep one line per episode in results.jsonl: the last one, unless its status is in
    ``drop_statuses`` (those episodes run again). Every line taken out (an earlier line of an
    episode, a dropped one, a broken one) is appended to ``archive`` first, so nothing is
    lost; then the file is replaced by its compacted copy, streamed to a temporary file and
    renamed, and only when something changes.

    The file is read line by line, twice at most, and never held. An episode gets another
    line only after a line that is not final (``cancelled``, or a status dropped here: it
    runs again), since a final one never runs again. So the first read remembers only the
    episodes with such a line, with the number of their last line; the second one copies.
    Two final lines of one episode, which no run writes, are both kept."""
    counts = {"kept": 0, "superseded": 0, "dropped": 0, "broken": 0}
    moving = False
    records = 0
    watched: dict[str, int] = {}  # episode with a line not final -> its last line's number
    try:
        for number, _, episode, status in _result_lines(path):
            if episode is None:
                moving = True
                continue
            records += 1
            if episode in watched:
                watched[episode] = number
                moving = True  # an earlier line of it goes
            elif status == "cancelled" or status in drop_statuses:
                watched[episode] = number
            if status in drop_statuses:
                moving = True
    except FileNotFoundError:
        return counts
    if not moving:
        counts["kept"] = records
        return counts
    archive_size = archive.stat().st_size if archive.exists() else None
    try:
        with replace_atomic(path, fsync=fsync) as out, open(archive, "ab") as moved:
            for number, raw, episode, status in _result_lines(path):
                line = raw if raw.endswith(b"\n") else raw + b"\n"
                last = watched.get(episode) if episode is not None else None
                if episode is None:
                    counts["broken"] += 1
                elif last is not None and last != number:
                    counts["superseded"] += 1
                elif status in drop_statuses:
                    counts["dropped"] += 1
                else:
                    counts["kept"] += 1
                    out.write(line)
                    continue
                moved.write(line)
            moved.flush()
            if fsync:
                os.fsync(moved.fileno())
    except BaseException:
        # All or nothing: the archive loses what this attempt appended to it.
        with contextlib.suppress(OSError):
            if archive_size is None:
                archive.unlink()
            else:
                os.truncate(archive, archive_size)
        raise
    log.warning("%s: %s", path, ", ".join(f"{k} {v}" for k, v in counts.items()))
    return counts


def _result_lines(path: Path) -> Iterator[tuple[int, bytes, str | None, str | None]]:
    """The non-blank lines of a results.jsonl file, read one at a time: ``(number, the
    line as written, its episode_id, its status)``, the id None when the line is not a
    record (cut short, not JSON, no ``episode_id``)."""
    with open(path, "rb") as f:
        for number, raw in enumerate(f, start=1):
            if not raw.strip():
                continue
            try:
                value = json.loads(raw.decode("utf-8", errors="replace"))
            except ValueError:
                yield number, raw, None, None
                continue
            if isinstance(value, dict) and "episode_id" in value:
                yield number, raw, str(value["episode_id"]), str(value.get("status"))
            else:
                yield number, raw, None, None


def _write_files(directory: Path, files: list[tuple[str, bytes]], fsync: bool) -> None:
    for name, data in files:
        write_atomic(directory / name, data, fsync=fsync)


def png_parts(png: bytes) -> list[bytes]:
    """``png`` cut in ``PART_BYTES`` pieces, the arguments of ``write_step``."""
    return [png[i:i + PART_BYTES] for i in range(0, len(png), PART_BYTES)]


# ----------------------------------------------------------------- the runner's side


class EpisodeWriter:
    """A runner's handle on the files of one episode attempt in the storage actor (a Ray
    actor handle or a local ``StorageActor``). Calls go out in order with one in flight: the
    files are written in step order, and a storage that falls behind slows this episode down
    instead of piling screenshots up in the runner's memory."""

    def __init__(self, storage: Any, episode_id: str, attempt: int) -> None:
        self.storage = StorageClient(storage)
        self.episode_id = episode_id
        self.attempt = attempt
        self._pending: Awaitable[Any] | None = None

    async def begin(self, task: dict[str, Any]) -> None:
        """Start the attempt's directory (and wait until it is started)."""
        await self.flush()
        self._pending = self.storage.begin_episode(self.episode_id, self.attempt, task)
        await self.flush()

    async def step(self, record: dict[str, Any] | None, png_name: str | None = None,
                   png: bytes | None = None) -> None:
        """A traj.jsonl line and/or the screenshot ``png_name``."""
        await self.flush()
        self._pending = self.storage.write_step(
            self.episode_id, self.attempt, record, png_name,
            *(png_parts(png) if png is not None and png_name else ()))

    async def finish(self, record: dict[str, Any],
                     messages: list[dict[str, Any]] | None) -> str | None:
        """episode.json, result.txt and messages.json of the attempt, written; returns None,
        or the first write of the attempt that failed (its files are incomplete)."""
        await self.flush()
        return await self.storage.finish_episode(self.episode_id, self.attempt, record,
                                                 messages)

    async def flush(self) -> None:
        """Wait for the call in flight."""
        if self._pending is not None:
            pending, self._pending = self._pending, None
            await pending

