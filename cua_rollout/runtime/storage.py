"""All writes of a run: per-step screenshots and records, episode summaries, the results
index, the metrics timeline and run.json (layout: docs/results_format.md).

Runs as an async Ray actor (``ray.remote(StorageActor)``) or in-process. Calls only enqueue:
the writes happen on a few writer tasks, each owning the episodes hashed to it, so one
episode's files are written in call order and ``record_result`` (the results.jsonl line)
lands after that episode's other files. The queues are bounded: a caller that awaits its
call waits for room, which is the backpressure runners feel when the disk falls behind.

Step files are written where they are made: a runner process that sees the run directory
(``StepFiles``: a probe, or ``storage.step_files``) writes its episodes' screenshots and
traj.jsonl lines itself, from a thread, into a staging directory of the attempt's own
(``<run>/.attempts/<name>``, named by the coordinator's dispatch: ``staging_name``). The
storage actor hears nothing of it until the results line: ``record_results`` names the
attempt's staging directory (moved into the episode's place, then the line appended) and
those of the episode's earlier dispatches that were never recorded (removed), so a
superseded attempt (a runner declared dead that keeps running) can never mix its files into
the current one, and the actor carries one call per batch of results, not three per episode.
A runner that cannot see the run directory sends every step to the actor (``begin_episode``,
``write_step``, ``finish_episode``), which writes a staging directory for it.

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
import errno
import json
import logging
import os
import re
import shutil
import threading
import time
import uuid
import zlib
from collections import OrderedDict
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiofiles
import aiofiles.os

from cua_rollout.config import StorageConfig
from cua_rollout.core.errors import ConfigError, StorageError
from cua_rollout.core.files import (
    LineMark,
    append_text,
    fsync_dir,
    read_json,
    repair_jsonl_tail,
    replace_atomic,
    write_atomic,
)
from cua_rollout.core.layout import (
    ATTEMPTS_DIR,
    EPISODE_FILE,
    MESSAGES_FILE,
    METRICS_FILE,
    OSWORLD_RESULT_FILE,
    RESULTS_FILE,
    RUN_FILE,
    SUPERSEDED_RESULTS_FILE,
    TASK_CONFIG_FILE,
    TRAJ_FILE,
    staging_name,
)
from cua_rollout.runtime.actors import StorageClient
from cua_rollout.runtime.index_feed import IndexFeed
from cua_rollout.runtime.retention import RetentionSweeper, carry_cursors, saved_cursors

__all__ = ["PART_BYTES", "EpisodeWriter", "StepFiles", "StorageActor", "compact_results",
           "png_parts"]

log = logging.getLogger(__name__)

# Size of the parts a screenshot is sent in (write_step): below Ray's inline limit for
# call arguments (max_direct_call_object_size, 100 KiB by default) with room for framing.
PART_BYTES = 64 * 1024
# How long the end of a run waits for a lagging index before it says how to catch it up.
_INDEX_DRAIN_S = 30.0
# Writers per actor: episodes are hashed over them, so disk latency of one episode's file
# does not hold up the others; 4 keeps the thread pool busy without reordering anything.
_WRITERS = 4
# Threads writing a runner process's step files. Each episode has one write in flight, so
# they bound the writes waiting, not the order; 4 cover a shared filesystem's latency (a few
# ms a file) at far more steps than one runner process makes (~90/s).
_FILE_THREADS = 4
# Recorded episodes whose attempt the storage remembers, so that a begin of an older attempt
# arriving late (its runner was declared dead, then woke up) is refused: ~100 B each.
_RECORDED_ATTEMPTS = 65536
# Results handled in one thread call and one append at most (``record_results``).
_RESULTS_AT_ONCE = 256
# The file the storage writes at the start of a run and runners look for (``StepFiles``).
_PROBE_PREFIX = "probe-"


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
        self._staging: dict[str, str] = {}    # episode -> its unfinished attempt's staging dir
        self._placed: dict[str, str] = {}     # episode -> staging dir placed without a line
        # episode -> attempt of its results line (the last _RECORDED_ATTEMPTS episodes)
        self._recorded: OrderedDict[str, int] = OrderedDict()
        self._attempts_dir = self.run_dir / ATTEMPTS_DIR
        self._token: str | None = None        # of the probe file runners look for
        self.last_error: str | None = None
        self._root = self.run_dir.resolve()
        self._run_info: dict[str, Any] = {}
        self.counters = {"steps": 0, "screenshots": 0, "episodes": 0, "results": 0,
                         "metrics": 0, "dropped_stale": 0, "errors": 0, "bytes": 0}
        # Called with each record once its results.jsonl line is durable (never raising
        # into the write: a subscriber's failure is logged).
        self.subscribers: list[Callable[[dict[str, Any], LineMark | None], None]] = []
        self.index_feed = IndexFeed(self.run_dir, self.cfg, on_error=self._index_error)
        self.retention: RetentionSweeper | None = None  # storage.retention, when active
        self._retention_task: asyncio.Task[None] | None = None

    # ----------------------------------------------------------------- run

    async def start_run(self, info: dict[str, Any], *, rerun_infra_errors: bool = True
                        ) -> dict[str, Any]:
        """Create the run directory, repair a results.jsonl cut short by a crash, keep one
        line per episode in it (``compact_results``; infra_error lines go too when they are
        to be rerun), write run.json (status ``running``). Returns what was repaired."""
        self._ensure_writers()
        await aiofiles.os.makedirs(self.run_dir, exist_ok=True)
        cut = await asyncio.to_thread(repair_jsonl_tail, self.run_dir / RESULTS_FILE)
        previous = await asyncio.to_thread(read_json, self.run_dir / RUN_FILE)
        synced = None
        if self.cfg.index:
            # Before the compaction: the index's cursor is a place in the file as the last
            # start left it, so only the lines since then are read.
            run_name = str(info.get("run") or self.run_dir.name)
            synced = await self.index_feed.open(run_name)
        # The retention sweeper's cursors, when of this file, are carried over a rewrite.
        carry = await asyncio.to_thread(saved_cursors, self.run_dir)
        compacted = await asyncio.to_thread(
            compact_results, self.run_dir / RESULTS_FILE,
            self.run_dir / SUPERSEDED_RESULTS_FILE,
            ("infra_error",) if rerun_infra_errors else (), fsync=self.cfg.fsync,
            carry=carry)
        if compacted["rewritten"]:
            if self.cfg.index:
                await self.index_feed.rewritten()
            if carry is not None:
                await asyncio.to_thread(carry_cursors, self.run_dir, carry,
                                        fsync=self.cfg.fsync)
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
        await self._open_attempts(sweep=True)
        if self.cfg.index:
            self.subscribers.append(self.index_feed.recorded)
        self._start_retention()
        return {"results_tail_cut_bytes": cut, "results_compacted": compacted,
                "index": synced}

    async def end_run(self, status: str, summary: dict[str, Any] | None = None) -> None:
        """Flush everything (the index for at most ``_INDEX_DRAIN_S``), then mark run.json
        ended with ``status``."""
        await self.flush()
        # Attempts that never finished (their runners were killed): nothing reads them.
        await asyncio.to_thread(shutil.rmtree, self._attempts_dir, True)
        self._token = None
        self._staging.clear()
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
        """Start an attempt whose files this actor writes (``write_step``): a staging
        directory with task_config.json. Files of an earlier attempt that never finished
        are removed, writes still queued for it are dropped; a begin of an attempt older
        than the episode's current (or recorded) one is itself dropped."""
        await self._put(_Job("begin", episode_id, attempt, {"task": task}))

    async def step_files_target(self) -> dict[str, str]:
        """Where runners find the run directory: its path here and a probe file in it
        (``StepFiles``): a runner that reads ``token`` from ``<run_dir>/<probe>`` sees the
        same directory and writes its step files itself."""
        if self._token is None:
            await self._open_attempts(sweep=False)
        assert self._token is not None
        return {"run_dir": str(self.run_dir.absolute()),
                "probe": f"{ATTEMPTS_DIR}/{_PROBE_PREFIX}{self._token}", "token": self._token}

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
        """episode.json, result.txt (scored episodes) and messages.json of an attempt, then
        its files moved into the episode's directory; returns once they are, with None, or
        the first write of this attempt that failed."""
        await self._wait(_Job("finish", episode_id, attempt,
                              {"record": record, "messages": messages}))
        if self._attempts.get(episode_id) != attempt:
            return None  # superseded: its writes were dropped on purpose
        return self._failed.get(episode_id)

    async def record_result(self, record: dict[str, Any], staging: str | None = None,
                            discard: list[str] | None = None) -> None:
        """``record_results`` for one record; ``StorageError`` if it could not be written."""
        error = (await self.record_results([(record, staging, discard or [])]))[0]
        if error is not None:
            raise StorageError(error)

    async def record_results(self, items: list[tuple[dict[str, Any], str | None, list[str]]]
                             ) -> list[str | None]:
        """The episodes are final: per item ``(record, staging, discard)``, the files of the
        record's attempt are put in place (those its runner wrote in ``staging``, a name in
        ``.attempts``, moved to the episode's directory; those this actor wrote, already
        there), the staging directories in ``discard`` (the episode's earlier dispatches,
        never recorded) removed, then the record's line appended to results.jsonl (after the
        episode's other files). Returns once the lines are written: per item None, or why it
        was not (its line is then not in results.jsonl: a rerun runs the episode again)."""
        loop = asyncio.get_running_loop()
        jobs = []
        for record, staging, discard in items:
            job = _Job("result", record["episode_id"], int(record.get("attempt", 0)),
                       {"record": record, "staging": staging, "discard": list(discard)},
                       done=loop.create_future())
            jobs.append(job)
            await self._put(job)
        errors: list[str | None] = []
        for job in jobs:
            assert job.done is not None
            try:
                await job.done
                errors.append(None)
            except Exception as exc:
                errors.append(f"{RESULTS_FILE}: {exc}")
        return errors

    async def place_unrecorded(self, episode_id: str, attempt: int, staging: str) -> None:
        """An attempt its runner wrote that ends without a results line (cancelled when the
        run stops): its files are moved into the episode's place for a reader of the stopped
        run, as an attempt this actor writes is at its finish. Nothing when the staging
        directory is gone (the attempt was recorded, or discarded); a results line naming
        it later finds it in place (``_plan_result``)."""
        await self._wait(_Job("place", episode_id, attempt, {"staging": staging}))

    async def forget_episode(self, episode_id: str, attempt: int) -> None:
        """An attempt this actor writes that ends without a result line (cancelled): drop
        what is kept for it. (A runner removes the staging directory it wrote itself.)"""
        if self._attempts.get(episode_id) == attempt:
            staged = self._staging.pop(episode_id, None)
            for kept in (self._attempts, self._dirs, self._failed):
                kept.pop(episode_id, None)
            if staged is not None:  # never finished: nothing will move it into place
                await asyncio.to_thread(shutil.rmtree, self._attempts_dir / staged, True)

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
                "index_pending": self.index_feed.pending, "last_error": self.last_error,
                "retention": self.retention.stats() if self.retention is not None else None}

    def _start_retention(self) -> None:
        """The retention sweeper (cua_rollout/runtime/retention.py), on this actor's loop,
        its sweeps in a thread: only when ``storage.retention`` asks for anything."""
        if not self.cfg.retention.active or self._retention_task is not None:
            return
        feed = self.index_feed
        # Without an index an episode is released by its results line (no acks to wait for).
        self.retention = RetentionSweeper(self.run_dir, self.cfg.retention, fsync=self.cfg.fsync,
                                          index=(lambda: feed.index) if self.cfg.index else None,
                                          run_name=lambda: feed.run_name)
        self._retention_task = asyncio.create_task(self.retention.run())

    async def close(self) -> None:
        if self._retention_task is not None:
            self._retention_task.cancel()
            await asyncio.gather(self._retention_task, return_exceptions=True)
            self._retention_task = None
        await self.flush()
        for task in self._writers:
            task.cancel()
        await asyncio.gather(*self._writers, return_exceptions=True)
        self._writers = []
        self._queues = []
        await self.index_feed.close()
        with contextlib.suppress(OSError):  # the staging area, when empty (a run without end)
            self._attempts_dir.rmdir()

    # ----------------------------------------------------------------- subscribers

    def _index_error(self, error: str) -> None:
        self.last_error = error

    def _published(self, record: dict[str, Any], mark: LineMark | None) -> None:
        """The record's line (at ``mark`` in results.jsonl) is durable: hand it to each
        subscriber, in the file's order."""
        for subscriber in self.subscribers:
            try:
                subscriber(record, mark)
            except Exception:  # the line is written: a subscriber cannot undo that
                log.exception("storage: a subscriber of results failed")

    # ----------------------------------------------------------------- internals

    async def _open_attempts(self, *, sweep: bool) -> None:
        """The staging area and a new probe file for runners; ``sweep``: a start, where
        whatever an earlier start left there (attempts of runners gone since) goes."""
        token = uuid.uuid4().hex
        await asyncio.to_thread(_open_attempts, self._attempts_dir, token, sweep)
        self._token = token
        if sweep:
            self._staging.clear()

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
        held: _Job | None = None
        while True:
            job, held = (held, None) if held is not None else (await queue.get(), None)
            if job.kind == "result":
                # The results waiting right behind it go with it: one thread call and one
                # append for all (a job of another kind waits its turn, in order).
                jobs = [job]
                while len(jobs) < _RESULTS_AT_ONCE and not queue.empty():
                    following = queue.get_nowait()
                    if following.kind != "result":
                        held = following
                        break
                    jobs.append(following)
                await self._results(jobs)
                continue
            try:
                await self._handle(job)
            except Exception as exc:
                # A failed write must not stop the writer (other episodes keep going); it is
                # counted, logged, and kept for the episode's attempt (finish_episode says so).
                self._write_failed(job, exc)
                if (job.episode_id is not None and job.kind in ("begin", "step", "finish")
                        and self._attempts.get(job.episode_id) == job.attempt):
                    self._failed.setdefault(job.episode_id, f"{job.kind}: {exc}")
            finally:
                if job.done is not None and not job.done.done():
                    job.done.set_result(None)

    def _write_failed(self, job: _Job, exc: Exception) -> None:
        self.counters["errors"] += 1
        self.last_error = f"{job.kind} of {job.episode_id}: {exc}"
        log.error("storage: %s", self.last_error)

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
        episode_id = job.episode_id
        if job.kind == "begin":
            await self._begin(job)
            return
        if job.kind == "place":
            if self._attempts.get(episode_id) is not None:
                return  # this actor writes the episode's attempts: in place at their finish
            name = job.payload["staging"]
            if await asyncio.to_thread(_promote, self._staged_path(name),
                                       self._episode_dir(episode_id), self.cfg.fsync):
                self._placed[episode_id] = name
            return
        staging = self._staging.get(episode_id)
        if (self._attempts.get(episode_id) != job.attempt or staging is None
                or job.payload.get("staging", staging) != staging):
            # A write of an attempt that was superseded (its runner died and the episode
            # was restarted elsewhere): never mix it into the new attempt's files.
            self.counters["dropped_stale"] += 1
            stale = job.payload.get("staging")
            if stale is not None and stale != staging:  # its runner's directory: no use now
                await asyncio.to_thread(shutil.rmtree, self._staged_path(stale), True)
            return
        path = self._attempts_dir / staging
        if job.kind == "step":
            parts, name = job.payload["png"], job.payload["png_name"]
            png = b"".join(parts) if parts and name else None  # sent in parts (write_step)
            record = job.payload["record"]
            line = _dumps(record) + "\n" if record is not None else None
            await asyncio.to_thread(_step, path, name, png, line, self.cfg.fsync)
            if png is not None:
                self.counters["screenshots"] += 1
                self.counters["bytes"] += len(png)
            if line is not None:
                self.counters["steps"] += 1
        elif job.kind == "finish":
            # From here on the attempt's files are the episode's: a later write of it is
            # stale, whatever happens below.
            del self._staging[episode_id]
            failed = job.payload.get("failed")
            if failed is not None:  # a write of its runner's
                self._failed.setdefault(episode_id, failed)
            files = None
            if "staging" not in job.payload:  # else its runner wrote them
                files = _episode_files(job.payload["record"], job.payload["messages"],
                                       self.cfg.save_messages)
            await asyncio.to_thread(_finish, path, files, self._episode_dir(episode_id),
                                    self.cfg.fsync)
            self.counters["episodes"] += 1

    async def _begin(self, job: _Job) -> None:
        episode_id = job.episode_id
        assert episode_id is not None
        newest = max(self._attempts.get(episode_id, -1), self._recorded.get(episode_id, -1))
        if job.attempt < newest:  # a late begin of a superseded attempt
            self.counters["dropped_stale"] += 1
            return
        previous = self._staging.pop(episode_id, None)  # an attempt that never finished
        self._attempts[episode_id] = job.attempt
        self._failed.pop(episode_id, None)
        self._episode_dir(episode_id)  # an id that leaves the run directory fails here
        task = job.payload.get("task")
        name = job.payload.get("staging")
        if name is None:  # this actor writes the attempt's files
            name = staging_name(episode_id, job.attempt, uuid.uuid4().hex[:12])
        self._staged_path(name)
        self._staging[episode_id] = name
        data = None if task is None else json.dumps(task, indent=2, ensure_ascii=False).encode()
        await asyncio.to_thread(_begin, self._attempts_dir, previous, name, data, self.cfg.fsync)

    async def _results(self, jobs: list[_Job]) -> None:
        """Result jobs (``record_results``): what each needs is decided here, the file work
        and the append of every line done in one thread call; each job's ``done`` answers."""
        plans: list[_ResultPlan] = []
        for job in jobs:
            try:
                plans.append(self._plan_result(job))
            except Exception as exc:  # a name that leaves its directory: that record only
                self._result_failed(job, exc)
        if plans:
            assert self._results_lock is not None
            async with self._results_lock:
                try:
                    errors, marks = await asyncio.to_thread(_record_results, plans,
                                                            self.run_dir / RESULTS_FILE,
                                                            self.cfg.fsync)
                except Exception as exc:  # the append itself (disk full): every line of it
                    errors, marks = [exc] * len(plans), [None] * len(plans)
            for plan, error, mark in zip(plans, errors, marks, strict=True):
                if error is not None:
                    self._result_failed(plan.job, error)
                    continue
                self.counters["results"] += 1
                if plan.promoted:
                    self.counters["episodes"] += 1
                assert plan.job.done is not None
                plan.job.done.set_result(None)
                self._published(plan.record, mark)

    def _result_failed(self, job: _Job, exc: Exception) -> None:
        self._write_failed(job, exc)
        assert job.done is not None
        job.done.set_exception(exc)

    def _plan_result(self, job: _Job) -> _ResultPlan:
        episode_id = job.episode_id
        assert episode_id is not None
        record = job.payload["record"]
        staged = job.payload.get("staging")
        # Names first: a bad one fails this record before anything is forgotten.
        own = self._staged_path(staged) if staged is not None else None
        discard = [self._staged_path(name) for name in job.payload.get("discard") or ()]
        directory = self._episode_dir(episode_id)
        failed = self._failed.pop(episode_id, None)
        begun = self._attempts.pop(episode_id, None)
        unfinished = self._staging.pop(episode_id, None)  # began, never finished: its runner died
        self._dirs.pop(episode_id, None)
        self._recorded[episode_id] = job.attempt
        self._recorded.move_to_end(episode_id)
        while len(self._recorded) > _RECORDED_ATTEMPTS:
            self._recorded.popitem(last=False)
        if failed is not None and record.get("status") != "infra_error":
            # Its files are incomplete: never a result that claims them.
            record = {**record, "status": "infra_error", "reward": None,
                      "error": f"storage: {failed}"}
        plan = _ResultPlan(job, record, directory, discard=discard)
        if staged is not None and self._placed.pop(episode_id, None) == staged:
            return plan  # already in place (``place_unrecorded``): the line only
        unfinished_path = self._attempts_dir / unfinished if unfinished is not None else None
        if begun == job.attempt:
            # This actor wrote the attempt's files: in place at its finish, or (its runner
            # died first) moved there now with the line's record.
            if unfinished_path is not None:
                plan.settle, plan.same_attempt = unfinished_path, True
        else:
            # Its runner wrote them (``own``), or the attempt never began: then the
            # directory is made to describe this line's attempt (``_settle``).
            plan.own, plan.settle, plan.must_settle = own, unfinished_path, True
        return plan

    def _staged_path(self, name: str) -> Path:
        """A staging directory by name (one path component in ``.attempts``)."""
        if not name or name in (".", "..") or "/" in name or "\0" in name:
            raise ValueError(f"staging directory {name!r} is not a name in {ATTEMPTS_DIR}")
        return self._attempts_dir / name

    async def _write_atomic(self, path: Path, data: bytes) -> None:
        await asyncio.to_thread(write_atomic, path, data, fsync=self.cfg.fsync)


# ----------------------------------------------------------------- file work (in threads)


def _open_attempts(attempts: Path, token: str, sweep: bool) -> None:
    if sweep:
        shutil.rmtree(attempts, ignore_errors=True)
    attempts.mkdir(parents=True, exist_ok=True)
    for old in attempts.glob(f"{_PROBE_PREFIX}*"):
        old.unlink(missing_ok=True)
    write_atomic(attempts / f"{_PROBE_PREFIX}{token}", token.encode())


def _begin(attempts: Path, previous: str | None, name: str, task: bytes | None,
           fsync: bool) -> None:
    if previous is not None:
        shutil.rmtree(attempts / previous, ignore_errors=True)
    attempts.mkdir(parents=True, exist_ok=True)
    if task is not None:  # the actor writes this attempt's files (else its runner does)
        (attempts / name).mkdir()
        write_atomic(attempts / name / TASK_CONFIG_FILE, task, fsync=fsync)


def _make_staging(staging: Path, task: bytes, fsync: bool) -> None:
    """A runner's begin: never ``parents``, so an attempt whose staging area was swept (the
    run ended or started again) fails instead of writing where nothing will look."""
    staging.mkdir()
    write_atomic(staging / TASK_CONFIG_FILE, task, fsync=fsync)


def _step(directory: Path, name: str | None, png: bytes | None, line: str | None,
          fsync: bool) -> None:
    if png is not None and name:
        write_atomic(directory / name, png, fsync=fsync)
    if line is not None:
        append_text(directory / TRAJ_FILE, line, fsync=fsync)


def _episode_files(record: dict[str, Any], messages: list[dict[str, Any]] | None,
                   save_messages: bool) -> list[tuple[str, bytes]]:
    """episode.json, result.txt (a scored episode) and messages.json, as written."""
    files = [(EPISODE_FILE, json.dumps(record, indent=2, ensure_ascii=False,
                                       default=str).encode())]
    if record.get("reward") is not None:
        files.append((OSWORLD_RESULT_FILE, f"{float(record['reward'])}\n".encode()))
    if messages is not None and save_messages:
        files.append((MESSAGES_FILE, json.dumps(messages, ensure_ascii=False).encode()))
    return files


def _promote(staging: Path, directory: Path, fsync: bool) -> bool:
    """Move an attempt's staging directory to the episode's place, replacing what an earlier
    attempt left there (moved aside first: a directory is renamed only onto an empty one).
    False when there is no staging directory (its begin failed)."""
    if not staging.is_dir():
        return False
    directory.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.rename(staging, directory)
    except OSError as exc:
        if exc.errno not in (errno.EEXIST, errno.ENOTEMPTY):
            raise
        aside = staging.with_name(f"{staging.name}.replaced")
        os.rename(directory, aside)
        os.rename(staging, directory)
        shutil.rmtree(aside, ignore_errors=True)
    if fsync:  # the renames survive a power loss before the results line counts
        fsync_dir(directory.parent)
        fsync_dir(staging.parent)
    return True


def _finish(staging: Path, files: list[tuple[str, bytes]] | None, directory: Path,
            fsync: bool) -> None:
    """The attempt's last files (None: its runner wrote them), then the attempt moved into
    place, even when they failed (the directory shows what was written)."""
    error: OSError | None = None
    if files is not None:
        try:
            _write_files(staging, files, fsync)
        except OSError as exc:
            error = exc
    moved = _promote(staging, directory, fsync)
    if error is not None:
        raise error
    if not moved:
        raise FileNotFoundError(errno.ENOENT, "the attempt's directory is gone", str(staging))


def _settle(staging: Path | None, directory: Path, record: dict[str, Any], same_attempt: bool,
            fsync: bool) -> None:
    """Before a results line whose attempt did not finish writing: the files of an attempt
    that never finished moved into place (``staging``), then the directory made to describe
    the line's attempt: with its record when the line is that attempt's, else only the task
    and the record (``_rewrite_for``)."""
    if staging is not None:
        _promote(staging, directory, fsync)
    if not same_attempt:
        _rewrite_for(directory, record, fsync)
        return
    directory.mkdir(parents=True, exist_ok=True)
    write_atomic(directory / EPISODE_FILE,
                 json.dumps(record, indent=2, ensure_ascii=False, default=str).encode(),
                 fsync=fsync)


@dataclass
class _ResultPlan:
    """What one result needs on disk before its line (decided on the actor's loop)."""

    job: _Job
    record: dict[str, Any]
    directory: Path
    discard: list[Path] = field(default_factory=list)  # earlier dispatches' staging dirs
    own: Path | None = None      # the staging directory its runner wrote
    settle: Path | None = None   # an attempt of this actor's that never finished
    same_attempt: bool = False   # ``settle`` is the line's attempt
    must_settle: bool = False    # settle even without ``settle`` (``own`` missing)
    promoted: bool = False       # set in the thread: an attempt's files moved into place


def _record_results(plans: list[_ResultPlan], results: Path, fsync: bool
                    ) -> tuple[list[Exception | None], list[LineMark | None]]:
    """Each plan's files put in place, then the lines of those that were, in one append;
    per plan the error, or where its line is."""
    errors: list[Exception | None] = []
    lines: list[bytes] = []
    for plan in plans:
        try:
            _place(plan, fsync)
        except Exception as exc:
            errors.append(exc)
            continue
        errors.append(None)
        lines.append((_dumps(plan.record) + "\n").encode("utf-8"))
    marks: list[LineMark | None] = [None] * len(plans)
    if lines:
        at = append_text(results, b"".join(lines), fsync=fsync)
        written = iter(lines)
        for i, error in enumerate(errors):
            if error is None:
                line = next(written)
                marks[i] = LineMark.of(at, line)
                at += len(line)
    return errors, marks


def _place(plan: _ResultPlan, fsync: bool) -> None:
    for path in plan.discard:
        shutil.rmtree(path, ignore_errors=True)
    if plan.own is not None and plan.own.is_dir():
        finished = (plan.own / EPISODE_FILE).is_file()  # else its runner died first
        if plan.settle is not None:  # another attempt's, of this actor's: superseded
            shutil.rmtree(plan.settle, ignore_errors=True)
        plan.promoted = _promote(plan.own, plan.directory, fsync)
        if not finished:
            write_atomic(plan.directory / EPISODE_FILE,
                         json.dumps(plan.record, indent=2, ensure_ascii=False,
                                    default=str).encode(), fsync=fsync)
    elif plan.settle is not None or plan.must_settle:
        _settle(plan.settle, plan.directory, plan.record, plan.same_attempt, fsync)


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
                    fsync: bool = False, carry: list[int] | None = None) -> dict[str, int]:
    """Keep one line per episode in results.jsonl: the last one, unless its status is in
    ``drop_statuses`` (those episodes run again). Every line taken out (an earlier line of an
    episode, a dropped one, a broken one) is appended to ``archive`` first, so nothing is
    lost; then the file is replaced by its compacted copy, streamed to a temporary file and
    renamed, and only when something changes.

    The file is read line by line, twice at most, and never held. An episode gets another
    line only after a line that is not final (``cancelled``, or a status dropped here: it
    runs again), since a final one never runs again. So the first read remembers only the
    episodes with such a line, with the number of their last line; the second one copies.
    Two final lines of one episode, which no run writes, are both kept.

    ``carry``: places in the file (line ends: a reader's cursors) replaced, when the file is
    rewritten, by the same places in the new one (after the last line kept before each)."""
    counts = {"kept": 0, "superseded": 0, "dropped": 0, "broken": 0, "rewritten": 0}
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
        marks = sorted(set(carry or ()))
        carried: dict[int, int] = {}
        new_pos = 0
        where = [0]
        with replace_atomic(path, fsync=fsync) as out, open(archive, "ab") as moved:
            for number, raw, episode, status in _result_lines(path, where):
                while marks and marks[0] <= where[0]:  # a cursor before this line
                    carried[marks.pop(0)] = new_pos
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
                    new_pos += len(line)
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
    for mark in marks:  # after the last line's start: its end, or past it
        carried[mark] = new_pos
    if carry:
        carry[:] = [carried[mark] for mark in carry]
    counts["rewritten"] = 1
    log.warning("%s: %s", path, ", ".join(f"{k} {v}" for k, v in counts.items()))
    return counts


# This actor's own lines start with the episode id, its status a few flat fields later
# (``_dumps`` of ``EpisodeResult.record``): both are read from the bytes, without a JSON parse
# of the rest (a compaction's scan of a long run's file). Any other line is parsed whole.
_OWN_ID = re.compile(rb'\{"episode_id":("(?:[^"\\]|\\.)*"),')
_STATUS_KEY = b',"status":"'


def _own_line(raw: bytes) -> tuple[str, str] | None:
    """``(episode_id, status)`` of a line as this actor writes it, or None (parse it)."""
    own = _OWN_ID.match(raw)
    if own is None or not raw.rstrip().endswith(b"}"):
        return None
    at = raw.find(_STATUS_KEY, own.end() - 1)
    if at < 0 or b"{" in raw[1:at] or b"[" in raw[1:at]:  # status nested, or not flat
        return None
    first = at + len(_STATUS_KEY)
    last = raw.find(b'"', first)
    status = raw[first:last]
    if last < 0 or not status.replace(b"_", b"").isalpha():
        return None
    return json.loads(own[1]), status.decode()


def _result_lines(path: Path, where: list[int] | None = None
                  ) -> Iterator[tuple[int, bytes, str | None, str | None]]:
    """The non-blank lines of a results.jsonl file, read one at a time: ``(number, the
    line as written, its episode_id, its status)``, the id None when the line is not a
    record (cut short, not JSON, no ``episode_id``). ``where[0]`` is set to each yielded
    line's offset."""
    at = 0
    with open(path, "rb") as f:
        for number, raw in enumerate(f, start=1):
            start, at = at, at + len(raw)
            if not raw.strip():
                continue
            if where is not None:
                where[0] = start
            own = _own_line(raw)
            if own is not None:
                yield number, raw, own[0], own[1]
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


class StepFiles:
    """A runner process's way to its episodes' files, decided once, at its first episode:
    written here when this node sees the run directory at the storage's path (it reads the
    probe file the storage wrote at the run's start), else sent to the storage actor.
    ``storage.step_files`` may force either; ``runner`` where the probe fails is an error
    (a ``ConfigError``: the run stops). Writes run on a few threads of this process, off its
    event loop."""

    def __init__(self, storage: Any, cfg: StorageConfig, name: str) -> None:
        self.storage = StorageClient(storage)
        self.cfg = cfg
        self.name = name  # for the log: which runner, on which node
        self.mode: str | None = None  # "runner" or "storage", once decided
        self.attempts: Path | None = None  # the staging area, when written here
        self.counters = {"steps": 0, "screenshots": 0, "bytes": 0, "errors": 0, "swept": 0}
        self.last_error: str | None = None
        self._deciding: asyncio.Lock | None = None
        self._executor: ThreadPoolExecutor | None = None
        self._counting = threading.Lock()

    async def local(self) -> bool:
        """Whether this process writes its step files itself (probed on the first call)."""
        if self.mode is None:
            if self._deciding is None:
                self._deciding = asyncio.Lock()
            async with self._deciding:
                if self.mode is None:
                    self.mode = await self._decide()
        return self.mode == "runner"

    async def _decide(self) -> str:
        if self.cfg.step_files == "storage":
            log.info("%s: step files go through the storage actor (storage.step_files: "
                     "storage)", self.name)
            return "storage"
        target = await self.storage.step_files_target()
        run_dir = Path(target["run_dir"])
        seen = await asyncio.to_thread(_read_probe, run_dir / target["probe"])
        if seen == target["token"]:
            self.attempts = run_dir / ATTEMPTS_DIR
            log.info("%s: writes its step files into %s itself", self.name, run_dir)
            return "runner"
        why = (f"{run_dir} is not the run directory the storage writes here "
               f"({target['probe']}: {seen or 'missing'})")
        if self.cfg.step_files == "runner":
            raise ConfigError(f"storage.step_files is runner, but {self.name}: {why}; mount "
                              "the run directory at the same path on every node, or set "
                              "storage.step_files: auto")
        # A warning (Ray shows runners' warnings, not their info lines): every step's bytes
        # now pass through the one storage process.
        log.warning("%s: step files go through the storage actor: %s (a run directory "
                    "shared at the same path on every node lets runners write them)",
                    self.name, why)
        return "storage"

    def submit(self, work: Callable[..., None], *args: Any) -> asyncio.Future[None]:
        """Run ``work(*args)`` on this process's file threads."""
        if self._executor is None:
            self._executor = ThreadPoolExecutor(_FILE_THREADS, thread_name_prefix="step-files")
        return asyncio.get_running_loop().run_in_executor(self._executor, work, *args)

    def count(self, png: bytes | None, line: str | None) -> None:
        """A step written (from a file thread)."""
        with self._counting:
            if png is not None:
                self.counters["screenshots"] += 1
                self.counters["bytes"] += len(png)
            if line is not None:
                self.counters["steps"] += 1

    def swept(self, error: str) -> None:
        """A write whose attempt's staging directory is gone (from a file thread)."""
        log.info("%s: the attempt's staging directory was removed (superseded, or the run "
                 "ended): %s", self.name, error)
        with self._counting:
            self.counters["swept"] += 1

    def failed(self, error: str) -> None:
        """A write that failed (from a file thread)."""
        log.error("%s: %s", self.name, error)
        with self._counting:
            self.counters["errors"] += 1
            self.last_error = error

    def stats(self) -> dict[str, Any]:
        return {"mode": self.mode, **self.counters, "last_error": self.last_error}

    def close(self) -> None:
        """After the last episode's writes (they are awaited before an episode ends)."""
        if self._executor is not None:
            self._executor.shutdown(wait=False)
            self._executor = None


def _read_probe(path: Path) -> str | None:
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return None


class EpisodeWriter:
    """A runner's handle on the files of one episode attempt. Where its process writes step
    files itself (``files``, ``StepFiles``), they go from a file thread into the attempt's
    staging directory and the storage actor hears nothing of them (the coordinator's
    ``record_results`` names the directory); else each write is a call to the storage
    actor (a Ray actor handle or a local ``StorageActor``). Either way one write is in
    flight at a time: the files are written in step order, and a disk (or a storage) that
    falls behind slows this episode down instead of piling screenshots up in the runner's
    memory. A write that fails is kept; ``finish`` answers with it."""

    def __init__(self, storage: Any, episode_id: str, attempt: int,
                 files: StepFiles | None = None, nonce: str | None = None) -> None:
        self.storage = StorageClient(storage)
        self.episode_id = episode_id
        self.attempt = attempt
        self.files = files
        # The dispatch's (``EpisodeSpec.nonce``): the coordinator names the same staging
        # directory when it records the attempt.
        self.nonce = nonce or uuid.uuid4().hex[:12]
        self.failed: str | None = None  # the first write of this process's that failed
        self._staging: str | None = None  # the attempt's staging name, when written here
        self._path: Path | None = None
        self._pending: asyncio.Future[Any] | None = None

    async def begin(self, task: dict[str, Any]) -> None:
        """Start the attempt's directory (and wait until it is started)."""
        await self.flush()
        if self.files is not None and await self.files.local():
            assert self.files.attempts is not None
            name = staging_name(self.episode_id, self.attempt, self.nonce)
            self._staging, self._path = name, self.files.attempts / name
            self._pending = self.files.submit(self._begin_here, task)
        else:
            self._pending = asyncio.ensure_future(
                self.storage.begin_episode(self.episode_id, self.attempt, task))
        await self.flush()

    async def step(self, record: dict[str, Any] | None, png_name: str | None = None,
                   png: bytes | None = None) -> None:
        """A traj.jsonl line and/or the screenshot ``png_name``."""
        await self.flush()
        if self.files is not None and self._path is not None:
            self._pending = self.files.submit(self._step_here, record, png_name, png)
            return
        self._pending = asyncio.ensure_future(self.storage.write_step(
            self.episode_id, self.attempt, record, png_name,
            *(png_parts(png) if png is not None and png_name else ())))

    def local_file(self, name: str) -> Path | None:
        """Where the file ``name`` of this attempt is written by this process (its staging
        directory, at the same path on every node of a shared run directory); None when
        the storage actor writes it."""
        return self._path / name if self._path is not None else None

    async def finish(self, record: dict[str, Any],
                     messages: list[dict[str, Any]] | None) -> str | None:
        """episode.json, result.txt and messages.json of the attempt, written (and, by the
        storage actor, moved into place; a staging directory of this process's moves when
        the attempt is recorded); returns None, or the first write of the attempt that
        failed (its files are incomplete)."""
        await self.flush()
        if self.files is None or self._staging is None:
            return await self.storage.finish_episode(self.episode_id, self.attempt, record,
                                                     messages)
        self._pending = self.files.submit(self._finish_here, record, messages)
        await self.flush()
        return self.failed

    @property
    def staging(self) -> str | None:
        """The attempt's staging directory (a name in ``.attempts``) when this process
        writes its files, which ``record_results`` moves into place."""
        return self._staging

    async def forget(self) -> None:
        """The attempt ends without a results line (cancelled, which happens when a run
        stops): the storage actor forgets an attempt it writes, and moves a staging
        directory of this process's into the episode's place (a reader of the stopped run
        sees what the attempt did; a rerun replaces it)."""
        await self.flush()
        if self.files is None or self._staging is None:
            await self.storage.forget_episode(self.episode_id, self.attempt)
            return
        await self.storage.place_unrecorded(self.episode_id, self.attempt, self._staging)

    async def flush(self) -> None:
        """Wait for the write in flight (it is not cut short when the wait is cancelled, and
        the next write still waits for it)."""
        if self._pending is not None:
            await asyncio.shield(self._pending)
            self._pending = None

    # The file work, on a thread of StepFiles: nothing raises into the episode.

    def _begin_here(self, task: dict[str, Any]) -> None:
        assert self._path is not None and self.files is not None
        data = json.dumps(task, indent=2, ensure_ascii=False).encode()
        self._guard("begin", _make_staging, self._path, data, self.files.cfg.fsync)

    def _step_here(self, record: dict[str, Any] | None, png_name: str | None,
                   png: bytes | None) -> None:
        assert self._path is not None and self.files is not None
        png = png if png_name else None
        line = _dumps(record) + "\n" if record is not None else None
        if self._guard("step", _step, self._path, png_name, png, line, self.files.cfg.fsync):
            self.files.count(png, line)

    def _finish_here(self, record: dict[str, Any],
                     messages: list[dict[str, Any]] | None) -> None:
        assert self._path is not None and self.files is not None
        files = _episode_files(record, messages, self.files.cfg.save_messages)
        self._guard("finish", _write_files, self._path, files, self.files.cfg.fsync)

    def _guard(self, kind: str, work: Callable[..., None], *args: Any) -> bool:
        """``work(*args)``; a failure is kept (the first) and counted, never raised."""
        assert self.files is not None
        try:
            work(*args)
        except Exception as exc:
            error = f"{kind}: {exc}"
            if self.failed is None:
                self.failed = error
            where = f"{self.episode_id} attempt {self.attempt}: {error}"
            if (isinstance(exc, FileNotFoundError) and kind != "begin"
                    and self._path is not None and not self._path.exists()):
                # Its staging directory was removed under it: the attempt was superseded
                # (recorded elsewhere) or the run ended (a cancelled attempt still
                # finishing). Expected: not a failing disk.
                self.files.swept(where)
            else:
                self.files.failed(where)
            return False
        return True
