"""``Rollout``: one run driven from Python — what ``cua-rollout run`` (run.py), the tests and a
trainer in the same process use.

    with Rollout(cfg) as rollout:              # checks, Ray, endpoints, actors, tasks
        for record in rollout.results():       # each finished episode's results.jsonl line
            ...
    rollout.status, rollout.summary            # "finished" / "interrupted" / "stopped"

    async with Rollout(cfg) as rollout:        # the same from a coroutine
        async for record in rollout.aresults():
            ...

Tasks come from the config's sources (``tasks.*``: files, benchmarks, a JSONL file that grows
in service mode, ``tasks.passes: 0``) or are handed over: ``Rollout(cfg, tasks=[...])``.
``drain()`` stops handing out episodes and lets running ones finish, ``cancel()`` cancels them
(run.py's first and second Ctrl-C). A rerun of the same config resumes: episodes in
results.jsonl are not run again. Decoupled trainers read the claim-based index instead
(cua_rollout.training).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import logging
import platform
import sys
import time
from collections.abc import AsyncIterator, Iterable, Iterator, Mapping
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import ray

from cua_rollout.agents.uitars.grammar import check_max_tokens
from cua_rollout.config import Config, secret_from_env
from cua_rollout.core.errors import FatalSetupError
from cua_rollout.core.files import DirectoryLock, LockHeld, write_atomic
from cua_rollout.core.http import redact_urls
from cua_rollout.core.layout import GIVEN_TASKS_FILE, RUN_LOCK_FILE
from cua_rollout.evaluation.preflight import TaskChecker
from cua_rollout.model.fleet.child import PoolChild
from cua_rollout.results import load_run, summarize
from cua_rollout.runtime.launch import (
    CALL_TIMEOUT_S,
    Actors,
    absolute_paths,
    checkpoint_barrier,
    log_to_tracker,
    probe_endpoints,
    published_endpoints,
    scripted_endpoint,
    serve_web_corpus,
    start_actors,
    start_ray,
    stop_actors,
    tracker_uri,
    uses_mode,
    versions,
)
from cua_rollout.runtime.loader import TaskLoader, resume_plan
from cua_rollout.runtime.progress import Progress
from cua_rollout.runtime.status import StatusBoard, serve_status
from cua_rollout.text.envs import check_text_modes

__all__ = ["Rollout"]

log = logging.getLogger(__name__)

# How often the driver asks the coordinator for finished episodes and statistics.
_POLL_INTERVAL_S = 0.5
# /healthz says the loop is not iterating when its last pass is this old: a pass makes up to
# three Ray calls of CALL_TIMEOUT_S each (and waits while the caller holds a record).
_LOOP_LATE_S = 3 * CALL_TIMEOUT_S + 30.0


class Rollout:
    """A run of ``cfg``: ``start`` it (or enter it), iterate ``results()`` to its end, ``stop``
    it (or leave it). Not thread-safe, but ``drain`` and ``cancel`` may be called from a
    signal handler or another thread."""

    def __init__(self, cfg: Config, *, tasks: Iterable[Mapping[str, Any]] | None = None,
                 command: list[str] | None = None) -> None:
        """``tasks``: OSWorld-format task dicts to run instead of the config's desktop task
        source (its text benchmarks stay); they are written to the run directory
        (``given_tasks.jsonl``) once the run is ours, so a rerun with the same tasks resumes
        and the results keep their tasks beside them."""
        self.cfg = absolute_paths(cfg)
        self.tasks = None if tasks is None else [dict(t) for t in tasks]
        self.run_dir = self.cfg.run_dir.resolve()
        self.command = list(sys.argv if command is None else command)
        self.status = "failed"        # finished | interrupted | stopped | failed
        self.fatal: str | None = None  # why the coordinator stopped the run
        self.summary: dict[str, Any] | None = None
        self.loader: TaskLoader | None = None
        self.actors: Actors | None = None
        self._stack = ExitStack()
        self._tracker_uri: str | None = None
        self._drain = False
        self._cancel = False
        # /status's bearer token: read at the start, so an unset variable fails it.
        self._status_token = secret_from_env(cfg.monitoring.status_token_env,
                                             "monitoring.status_token_env")
        if cfg.desktops.provider == "remote":  # the same for the environment cluster's
            cfg.desktops.remote.token()
            cfg.desktops.remote.server_urls()

    # ----------------------------------------------------------------- lifecycle

    def start(self) -> Rollout:
        """Checks what can be checked without Ray first (the task source, the text modes,
        the grammar's budget, the tracker, the model endpoints), then starts Ray (or joins
        it), the model pool when the run owns one, the actors, and reads the tasks (their
        pre-flight: tasks that cannot run here are skipped, listed in ``problems``)."""
        try:
            self._start()
        except BaseException:
            self._stack.close()
            raise
        return self

    def _start(self) -> None:
        cfg, stack = self.cfg, self._stack
        self.run_dir.mkdir(parents=True, exist_ok=True)
        # One driver per run directory: a second one would hand out the same episodes and
        # both would write (and remove) the same episode directories.
        try:
            stack.enter_context(DirectoryLock(self.run_dir, RUN_LOCK_FILE))
        except LockHeld as exc:
            raise FatalSetupError(f"another run.py ({exc.holder}) is writing {self.run_dir}; "
                                  "wait for it to end or use another run.name") from None
        if self.tasks is not None:
            cfg = self.cfg = _with_given_tasks(cfg, self.run_dir, self.tasks)
        TaskLoader(cfg.tasks, self.run_dir, read_results=False)  # the task source, now
        # A resumed run's results.jsonl (what is done, which groups are open) is read while
        # Ray starts: its length must not add to a restart. Its errors are raised below.
        reader = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="resume")
        resumed = reader.submit(resume_plan, cfg.tasks, self.run_dir)
        reader.shutdown(wait=False)  # its thread ends with the read
        check_text_modes(cfg)
        if cfg.agent.constrain_actions:
            check_max_tokens(cfg.model.sampling.max_tokens)
        self._tracker_uri = tracker_uri(cfg)
        model_state_dir = None
        pool = None
        if cfg.model_pool.start_with_run and not cfg.model.scripted:
            # Started first, waited for after Ray's start: the two overlap.
            pool = stack.enter_context(PoolChild(cfg, self.run_dir))
        elif not cfg.model.scripted:
            if cfg.model.endpoints:
                probe_endpoints(cfg)
            cfg, model_state_dir = published_endpoints(cfg)
        if start_ray(cfg):
            stack.callback(ray.shutdown)
        plan = resumed.result()
        if pool is not None:
            pool.wait_ready()
            cfg, model_state_dir = published_endpoints(cfg)
        if cfg.text.web.serve_corpus is not None and uses_mode(cfg, "web"):
            cfg = serve_web_corpus(cfg, stack)
        if cfg.model.scripted:
            url = scripted_endpoint(cfg, stack)
            cfg = cfg.model_copy(update={"model": cfg.model.model_copy(
                update={"endpoints": [url]})})
        self.cfg = cfg
        self.actors, _ = start_actors(cfg, self.run_dir, model_state_dir, {
            "run": cfg.run.name, "config": redact_urls(cfg.model_dump(mode="json")),
            "versions": versions(), "host": platform.node(),
            "command": redact_urls(self.command),
            # Where the run's actors are: the desktops command reaches the live pool there.
            "ray_address": ray.get_runtime_context().gcs_address,
        })
        # Read results.jsonl after the storage repaired a line a crash may have cut. Tasks
        # that cannot be set up or scored here are reported and skipped now (pre-flight).
        self.loader = TaskLoader(cfg.tasks, self.run_dir, check=TaskChecker(cfg),
                                 barrier=checkpoint_barrier(cfg, model_state_dir), plan=plan)

    def stop(self) -> None:
        """Runners, desktops and storage stopped (run.json closed with the status and, when
        the run was not cut short, its summary), the tracker told, Ray left."""
        try:
            if self.actors is not None:
                if self.status not in ("failed", "stopped"):
                    loaded = load_run(self.run_dir)
                    self.summary = summarize(loaded) if loaded.episodes else None
                actors, self.actors = self.actors, None
                stop_actors(actors, self.status, self.summary)
                if self._tracker_uri is not None:
                    log_to_tracker(self.cfg, self.run_dir, self._tracker_uri)
        finally:
            self._stack.close()

    def __enter__(self) -> Rollout:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    async def __aenter__(self) -> Rollout:
        await asyncio.to_thread(self.start)
        return self

    async def __aexit__(self, *exc: object) -> None:
        await asyncio.to_thread(self.stop)

    @property
    def problems(self) -> list[str]:
        """Tasks that could not be loaded or cannot run here (skipped)."""
        return [str(p) for p in self.loader.problems] if self.loader is not None else []

    def drain(self) -> None:
        """Hand out no more episodes; running ones finish."""
        self._drain = True

    def cancel(self) -> None:
        """Cancel running episodes too (recorded ``cancelled``, run again on a rerun)."""
        self._drain = self._cancel = True

    # ----------------------------------------------------------------- the loop

    def results(self) -> Iterator[dict[str, Any]]:
        """Feed the coordinator and yield each finished episode's results.jsonl record, until
        every episode is done (never, in service mode, unless drained); ``status`` and
        ``fatal`` say how it ended."""
        if self.loader is None or self.actors is None:
            raise RuntimeError("Rollout.results() before start()")
        cfg, loader, coordinator = self.cfg, self.loader, self.actors.coordinator
        next_task_poll = 0.0
        more = True  # the loader may have episodes to hand out (results came in, a barrier)
        done_before: int | None = None
        done = 0
        progress: Progress | None = None
        drained = cancelled = False
        board = StatusBoard(cfg.run.name, stall_s=cfg.monitoring.stall_s,
                            loop_late_s=_LOOP_LATE_S)
        status_server = None
        try:
            if cfg.monitoring.status_address is not None:
                status_server = serve_status(board, cfg.monitoring.status_address,
                                             self._status_token, self.run_dir)
            while True:
                if self._drain and not drained:
                    drained = True
                    coordinator.drain.remote()  # not awaited: the loop keeps showing progress
                if self._cancel and not cancelled:
                    cancelled = True
                    ray.get(coordinator.cancel_all.remote(), timeout=CALL_TIMEOUT_S)
                due = time.monotonic() >= next_task_poll
                if not drained and (due or more or loader.waiting):
                    # Re-read the source when due (service mode); else hand out what results
                    # made possible (the next group of a task whose group is final).
                    specs = loader.poll(refresh=due)
                    if specs:
                        ray.get(coordinator.submit.remote(specs), timeout=CALL_TIMEOUT_S)
                    if due:
                        next_task_poll = time.monotonic() + (cfg.tasks.poll_interval_s or 1e9)
                    more = False
                    if done_before is None:  # known once the loader has read the task source
                        done_before = loader.finished_before()
                poll_t = time.monotonic()
                out = ray.get(coordinator.poll.remote(), timeout=CALL_TIMEOUT_S)
                poll_s = time.monotonic() - poll_t
                for record in out["finished"]:
                    done += 1
                    loader.record_result(record)
                    more = True
                    yield record
                stats = out["stats"]
                fatal = stats.get("fatal")
                if fatal and not drained:
                    drained = True  # the coordinator dispatches nothing more; running ones end
                total = loader.total_known()
                before = done_before or 0
                if progress is None:
                    progress = Progress(cfg.monitoring.progress_bar, total, before)
                waiting = loader.waiting or stats.get("waiting")
                stalled = board.publish(
                    status="stopping" if fatal else "cancelling" if cancelled else
                    "draining" if drained else "running",
                    done=done, done_before=before, total=total, stats=stats,
                    waiting=waiting, poll_s=poll_s)
                note = ("stopping: " + fatal if fatal else
                        "draining" if drained and not cancelled else
                        "cancelling" if cancelled else
                        waiting or stalled)
                progress.update(before + done, total, stats, note)
                idle = stats["episodes_in_flight"] == 0 and (
                    drained or stats["episodes_queued"] == 0)
                if idle and fatal:
                    self.status, self.fatal = "stopped", fatal
                    return
                if idle and drained:
                    self.status = "interrupted"
                    return
                # Every pass of every task was handed out (retries wait in the coordinator's
                # queue), so once nothing is queued or running the run is complete.
                if idle and not more and loader.exhausted() and not drained:
                    self.status = "finished"
                    return
                time.sleep(_POLL_INTERVAL_S)
        finally:
            if status_server is not None:
                status_server.stop()
            if progress is not None:
                progress.close()

    async def aresults(self) -> AsyncIterator[dict[str, Any]]:
        """``results()`` for a coroutine: the loop runs in a thread, the event loop stays
        free."""
        done = object()
        records = self.results()
        while (record := await asyncio.to_thread(next, records, done)) is not done:
            yield record  # type: ignore[misc]

    def run(self) -> list[dict[str, Any]]:
        """Start, run to the end, stop; the finished episodes' records."""
        with self:
            return list(self.results())


def _with_given_tasks(cfg: Config, run_dir: Path, tasks: list[dict[str, Any]]) -> Config:
    """``cfg`` with ``tasks`` as its desktop task source: a JSONL file in the run directory
    (written atomically; the loader validates each task as it would a file's)."""
    path = run_dir / GIVEN_TASKS_FILE
    write_atomic(path, "".join(json.dumps(t, ensure_ascii=False) + "\n"
                               for t in tasks).encode("utf-8"))
    return cfg.model_copy(update={"tasks": cfg.tasks.model_copy(
        update={"source": path, "examples_dir": None, "domains": None, "task_ids": None})})
