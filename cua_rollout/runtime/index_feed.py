"""The trainer's index fed from the run's results: a subscriber of the storage actor that gets
each results.jsonl record once its line is durable and writes them, batched into
transactions, into ``cua_rollout.training.TrainingIndex`` (episodes and groups in SQLite or
PostgreSQL). It never holds up a result; a failing database is retried with backoff."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from cua_rollout.config import StorageConfig
from cua_rollout.core.aio import backoff_s
from cua_rollout.core.errors import StorageError
from cua_rollout.core.files import LineMark, last_line_mark
from cua_rollout.core.layout import RESULTS_FILE
from cua_rollout.training import TrainingIndex, default_url, index_url

__all__ = ["IndexFeed"]

log = logging.getLogger(__name__)

# Results written to the index per transaction at most.
_INDEX_BATCH = 256


class IndexFeed:
    """Feeds one run's results into the trainer's index. ``open`` brings the index up to
    date with results.jsonl and starts the writer task; ``recorded`` is the storage's
    subscriber; ``close`` waits for the transaction under way before it closes the index.
    ``on_error`` hears each failed transaction (the storage's ``last_error``)."""

    def __init__(self, run_dir: Path, cfg: StorageConfig,
                 on_error: Callable[[str], None] | None = None) -> None:
        self.run_dir = run_dir
        self.cfg = cfg
        self.on_error = on_error
        self.counters = {"indexed": 0, "groups": 0, "index_errors": 0}
        self.index: TrainingIndex | None = None
        self.pending = 0                              # records queued or being written
        self._run_name = run_dir.name
        self._queue: asyncio.Queue[tuple[dict[str, Any], LineMark | None]] | None = None
        self._task: asyncio.Task[None] | None = None
        self._write: asyncio.Future[Any] | None = None  # the last index transaction

    async def open(self, run_name: str) -> dict[str, Any] | None:
        """Open the trainer's index and bring it up to date with results.jsonl (a crash
        between a line and its index write, a rerun, a deleted database): the lines after
        the index's cursor only, when it is still valid (``TrainingIndex.reindex``), so a
        start does not cost the length of the run. A database that cannot be opened is a
        ``StorageError`` naming it: the run does not start."""
        self._run_name = run_name
        url = index_url(self.cfg.database_url or default_url(self.run_dir),
                        self.cfg.database_password_env)
        try:
            self.index = await asyncio.to_thread(TrainingIndex, url)
            synced: dict[str, Any] | None = None
            if (self.run_dir / RESULTS_FILE).exists():  # else a new run: nothing to read
                synced = await asyncio.to_thread(
                    self.index.reindex, self.run_dir, run_name, resume=True)
        except Exception as exc:
            raise StorageError(f"storage.database_url: the trainer's index cannot be used: "
                               f"{exc}") from exc
        self._queue = asyncio.Queue()
        self._task = asyncio.create_task(self._writer())
        return synced

    async def rewritten(self) -> None:
        """The storage's compaction rewrote results.jsonl after ``open`` indexed it whole:
        the cursor moves to the new file's last line (every line of it was in the old one,
        and is in the index)."""
        if self.index is not None:
            mark = await asyncio.to_thread(last_line_mark, self.run_dir / RESULTS_FILE)
            await asyncio.to_thread(self.index.set_cursor, self._run_name, mark)

    def recorded(self, record: dict[str, Any], mark: LineMark | None = None) -> None:
        """A results.jsonl line (at ``mark``) is durable: queue its record for the index (a
        cancelled one only moves the cursor: not final, the trainer sees its rerun)."""
        if self._queue is None:
            return
        self.pending += 1
        self._queue.put_nowait((record, mark))

    @property
    def run_name(self) -> str:
        """The run's name in the index."""
        return self._run_name

    async def drain(self, timeout_s: float) -> bool:
        """Wait until every queued result is in the index; False after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while self.pending and self._task is not None:
            if time.monotonic() >= deadline:
                return False
            await asyncio.sleep(0.02)
        return True

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        if self._write is not None:  # a transaction under way in its thread
            await asyncio.gather(self._write, return_exceptions=True)
            self._write = None
        if self.index is not None:
            await asyncio.to_thread(self.index.close)
            self.index = None

    async def _writer(self) -> None:
        """Write queued results to the index, as many per transaction as are waiting; a
        failing database is retried with backoff, never skipped."""
        assert self._queue is not None and self.index is not None
        index = self.index
        failures = 0
        while True:
            queued = [await self._queue.get()]
            while len(queued) < _INDEX_BATCH and not self._queue.empty():
                queued.append(self._queue.get_nowait())
            batch = [record for record, _ in queued]
            cursor = queued[-1][1]  # the lines come in the file's order
            while True:
                # Shielded: a cancel (close) stops the wait, not the transaction in its
                # thread, which close awaits before it closes the database's connections.
                write = self._write = asyncio.ensure_future(asyncio.to_thread(
                    index.record_episodes, self._run_name, str(self.run_dir), batch,
                    cursor=cursor))
                try:
                    groups = await asyncio.shield(write)
                    break
                except Exception as exc:
                    failures += 1
                    self.counters["index_errors"] += 1
                    error = f"index: {type(exc).__name__}: {exc}"
                    if self.on_error is not None:
                        self.on_error(error)
                    if failures == 1:
                        log.error("storage: %s (retrying; results.jsonl has the episodes)",
                                  error)
                    await asyncio.sleep(backoff_s(failures, 0.5, 30.0))
            if failures:
                log.info("storage: the index is written again")
                failures = 0
            self.counters["indexed"] += sum(r.get("status") != "cancelled" for r in batch)
            self.counters["groups"] += len(groups)
            self.pending -= len(batch)
