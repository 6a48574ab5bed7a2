"""Keeps ``coordinator.max_concurrent_episodes`` episodes in flight over a pool of runner
actors, retries infrastructure failures, replaces dead runners, and keeps the run's counters
(metrics.jsonl samples and the Ray gauges).

``schedule: rollout`` refills a slot the moment an episode ends; ``schedule: batch`` starts
the next batch only when every episode of the current one (retries included) is done.
Runs as an async Ray actor; its own work is bookkeeping only (no blocking I/O).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import logging
import time
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Any

from config import Config
from rollout.aio import TaskSet, call
from rollout.monitoring import Metrics
from rollout.types import SCORED_STATUSES, EpisodeResult, EpisodeSpec, Status, infra_result
from trajectory_runner import TrajectoryRunner

__all__ = ["AgentCoordinator"]

log = logging.getLogger(__name__)

# How often runner and pool statistics are gathered for the progress bar and the gauges;
# metrics.jsonl gets a sample every monitoring.metrics_interval_s.
_STATS_INTERVAL_S = 1.0
# A statistics call that takes longer than this is skipped (a busy or dying actor must not
# hold up the coordinator).
_STATS_TIMEOUT_S = 5.0
# Extra concurrent calls a runner accepts beyond its episodes (stats, cancel).
_RUNNER_SPARE_CALLS = 16


@dataclass
class _Runner:
    id: str
    handle: Any
    active: set[str] = field(default_factory=set)
    alive: bool = True
    last_stats: dict[str, Any] = field(default_factory=dict)


class AgentCoordinator:
    """Schedules episodes on runners. ``submit`` queues specs, ``poll`` hands finished
    results (and current statistics) to the driver, ``drain`` stops starting new ones."""

    def __init__(
        self,
        cfg: Config,
        desktop_pool: Any,
        storage: Any,
        model_state_dir: str | None = None,
        *,
        use_ray: bool = True,
    ) -> None:
        self.cfg = cfg
        self.desktop_pool = desktop_pool
        self.storage = storage
        self.model_state_dir = model_state_dir
        self.use_ray = use_ray
        self._queue: deque[tuple[EpisodeSpec, list[str]]] = deque()
        self._in_flight: dict[str, tuple[EpisodeSpec, str]] = {}  # episode -> (spec, runner)
        self._runners: list[_Runner] = []
        self._runner_ids = itertools.count()
        self._batch: set[str] = set()
        self._finished: list[dict[str, Any]] = []    # not yet handed to poll()
        self._tasks = TaskSet()
        self._wake: asyncio.Event | None = None
        self._idle: asyncio.Event | None = None
        self._draining = False
        self._cancelling = False
        self._started_at = time.time()
        self._metrics = Metrics(cfg.monitoring.ray_metrics and use_ray)
        self.counters: Counter[str] = Counter()
        self._rewards_sum = 0.0
        self._rewards_n = 0
        self._dead_runner_steps = 0
        self._sample: dict[str, Any] = {}
        self._step_history: deque[tuple[float, int]] = deque([(time.time(), 0)])
        self._pool_stats: dict[str, Any] = {}

    # ----------------------------------------------------------------- public surface

    async def start(self) -> None:
        """Start the scheduling and statistics loops (idempotent)."""
        if self._wake is not None:
            return
        self._wake = asyncio.Event()
        self._idle = asyncio.Event()
        self._idle.set()
        self._spawn(self._dispatch())
        self._spawn(self._stats_loop())

    async def submit(self, specs: list[EpisodeSpec]) -> int:
        """Queue episodes (a task's rollouts stay next to each other); returns the queue size."""
        await self.start()
        for spec in specs:
            self._queue.append((spec, []))
        self.counters["submitted"] += len(specs)
        self._changed()
        return len(self._queue)

    async def poll(self) -> dict[str, Any]:
        """Results finished since the last poll (results.jsonl records) and statistics."""
        finished, self._finished = self._finished, []
        return {"finished": finished, "stats": self.stats()}

    def stats(self) -> dict[str, Any]:
        return {
            **self._sample,
            "episodes_queued": len(self._queue),
            "episodes_in_flight": len(self._in_flight),
            "episodes_done": sum(self.counters[f"status_{s}"] for s in
                                 (*SCORED_STATUSES, Status.INFRA_ERROR)),
            "episodes_by_status": {s.removeprefix("status_"): n for s, n in self.counters.items()
                                   if s.startswith("status_")},
            "retries": self.counters["retries"],
            "runners": sum(r.alive for r in self._runners),
            "runners_replaced": self.counters["runners_died"],
            "success_rate": self._success_rate(),
            "draining": self._draining,
        }

    async def drain(self, cancel: bool = False, timeout_s: float | None = None) -> dict[str, Any]:
        """Start nothing new; with ``cancel`` cancel what runs. Returns when no episode is in
        flight (or after ``timeout_s``) with the statistics; queued episodes stay unrun (a
        rerun of the same command picks them up)."""
        await self.start()
        self._draining = True
        self._update_idle()
        if cancel:
            await self.cancel_all()
        assert self._idle is not None
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._idle.wait(), timeout_s)
        return self.stats()

    async def cancel_all(self) -> int:
        """Cancel every running episode (they end as ``cancelled`` and are not recorded)."""
        self._draining = True
        self._cancelling = True
        counts = await asyncio.gather(
            *(call(r.handle, "cancel") for r in self._runners if r.alive),
            return_exceptions=True,
        )
        return sum(c for c in counts if isinstance(c, int))

    def runner_handles(self) -> list[Any]:
        """The live runners (for tests and tools that inspect them)."""
        return [r.handle for r in self._runners if r.alive]

    async def wait_idle(self, timeout_s: float | None = None) -> bool:
        """True once nothing is queued or in flight."""
        await self.start()
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while self._queue or self._in_flight:
            assert self._idle is not None
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if left == 0.0:
                return False
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._idle.wait(), min(left or 1.0, 1.0))
        return True

    async def shutdown(self) -> dict[str, Any]:
        """Stop the loops and the runners (after ``drain``). Returns final statistics."""
        await self._refresh_stats(write=True)
        await self._tasks.cancel_all()
        runners = [r for r in self._runners if r.alive]
        await asyncio.gather(*(call(r.handle, "close") for r in runners),
                             return_exceptions=True)
        if self.use_ray:
            import ray

            for r in runners:
                with contextlib.suppress(Exception):
                    ray.kill(r.handle)
        return self.stats()

    # ----------------------------------------------------------------- scheduling

    def _spawn(self, coro: Any) -> asyncio.Task[Any]:
        return self._tasks.spawn(coro)

    def _changed(self) -> None:
        """Something that scheduling depends on changed: let the dispatcher look again."""
        assert self._wake is not None
        self._wake.set()
        self._update_idle()

    def _update_idle(self) -> None:
        assert self._idle is not None
        # While draining, queued episodes will not start: idle means nothing runs.
        if self._in_flight or (self._queue and not self._draining):
            self._idle.clear()
        else:
            self._idle.set()

    def _next(self) -> tuple[EpisodeSpec, list[str]] | None:
        """The episode to start now, if any (schedule, slot limit, draining)."""
        if self._draining or not self._queue:
            return None
        limit = self.cfg.coordinator.max_concurrent_episodes
        if len(self._in_flight) >= limit:
            return None
        if self.cfg.coordinator.schedule == "batch":
            if not self._batch:
                # The previous batch is complete: the next one is the next `limit` episodes.
                self._batch = {spec.episode_id for spec, _ in itertools.islice(self._queue,
                                                                                 limit)}
            if self._queue[0][0].episode_id not in self._batch:
                return None  # wait for the whole batch (retries included) to finish
        return self._queue.popleft()

    async def _dispatch(self) -> None:
        assert self._wake is not None
        while True:
            await self._wake.wait()
            self._wake.clear()
            while (item := self._next()) is not None:
                spec, avoid = item
                runner = self._runner_with_room()
                runner.active.add(spec.episode_id)
                self._in_flight[spec.episode_id] = (spec, runner.id)
                self.counters["started"] += 1
                self._spawn(self._run(spec, avoid, runner))
            self._update_idle()

    def _runner_with_room(self) -> _Runner:
        per_runner = self.cfg.coordinator.episodes_per_runner
        live = [r for r in self._runners if r.alive and len(r.active) < per_runner]
        if live:
            return min(live, key=lambda r: len(r.active))
        return self._new_runner()

    def _new_runner(self) -> _Runner:
        runner_id = f"runner-{next(self._runner_ids)}"
        args = (self.cfg, self.desktop_pool, self.storage, runner_id, self.model_state_dir)
        if self.use_ray:
            import ray

            handle = ray.remote(TrajectoryRunner).options(
                name=None,
                num_cpus=self.cfg.coordinator.runner_num_cpus,
                max_concurrency=self.cfg.coordinator.episodes_per_runner + _RUNNER_SPARE_CALLS,
                scheduling_strategy="SPREAD",
                max_restarts=0,
            ).remote(*args)
        else:
            handle = TrajectoryRunner(*args)
        runner = _Runner(runner_id, handle)
        self._runners.append(runner)
        self.counters["runners_started"] += 1
        return runner

    async def _run(self, spec: EpisodeSpec, avoid: list[str], runner: _Runner) -> None:
        try:
            try:
                result: EpisodeResult = await call(runner.handle, "run_episode", spec, avoid)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                result = await self._runner_failed(runner, spec, exc)
            await self._handle_result(spec, result)
        finally:
            runner.active.discard(spec.episode_id)
            self._in_flight.pop(spec.episode_id, None)
            self._changed()

    async def _runner_failed(self, runner: _Runner, spec: EpisodeSpec,
                             exc: Exception) -> EpisodeResult:
        from ray.exceptions import RayActorError

        if isinstance(exc, RayActorError):
            if runner.alive:
                runner.alive = False
                self.counters["runners_died"] += 1
                self._dead_runner_steps += int(runner.last_stats.get("steps", 0))
                log.warning("runner %s died (%s); its episodes are requeued", runner.id,
                            type(exc).__name__)
                # Its desktops were leased to episodes that no longer run: give them back
                # (the pool resets them before anyone else gets them).
                with contextlib.suppress(Exception):
                    await call(self.desktop_pool, "release_owned", f"{runner.id}/", True)
            return infra_result(spec, f"runner {runner.id} died: {type(exc).__name__}",
                                runner=runner.id)
        log.error("episode %s: runner call failed: %r", spec.episode_id, exc)
        return infra_result(spec, f"runner call failed: {type(exc).__name__}: {exc}",
                            runner=runner.id)

    async def _handle_result(self, spec: EpisodeSpec, result: EpisodeResult) -> None:
        cfg = self.cfg.coordinator
        if result.status == Status.CANCELLED or (
                self._cancelling and result.status == Status.INFRA_ERROR):
            # Not recorded: a rerun of the same command runs it again.
            self.counters["cancelled"] += 1
            self._batch.discard(spec.episode_id)
            return
        if (result.status == Status.INFRA_ERROR and result.retryable
                and spec.attempt < cfg.max_retries):
            self.counters["retries"] += 1
            self._metrics.retry()
            log.info("episode %s attempt %d: %s; retrying", spec.episode_id, spec.attempt,
                     result.error)
            tried = list(dict.fromkeys([*result.desktops_tried]))
            self._queue.appendleft((dataclasses.replace(spec, attempt=spec.attempt + 1), tried))
            return
        record = result.record()
        self._batch.discard(spec.episode_id)
        self.counters[f"status_{result.status}"] += 1
        if result.status in SCORED_STATUSES and result.reward is not None:
            self._rewards_sum += result.reward
            self._rewards_n += 1
        self._metrics.episode(result.status, spec.domain)
        await call(self.storage, "record_result", record)
        self._finished.append(record)

    def _success_rate(self) -> float | None:
        return self._rewards_sum / self._rewards_n if self._rewards_n else None

    # ----------------------------------------------------------------- statistics

    async def _stats_loop(self) -> None:
        interval_s = self.cfg.monitoring.metrics_interval_s
        next_write = time.monotonic() + interval_s
        while True:
            await asyncio.sleep(min(_STATS_INTERVAL_S, interval_s))
            write = time.monotonic() >= next_write
            if write:
                next_write += interval_s
            try:
                await self._refresh_stats(write=write)
            except Exception:  # statistics must never stop the run
                log.exception("statistics refresh failed")

    async def _refresh_stats(self, write: bool) -> None:
        runners = [r for r in self._runners if r.alive]

        async def one(target: Any, method: str) -> Any:
            try:
                return await asyncio.wait_for(call(target, method), _STATS_TIMEOUT_S)
            except Exception:  # a dying actor simply gives no statistics
                return None

        results = await asyncio.gather(one(self.desktop_pool, "stats"),
                                       *(one(r.handle, "stats") for r in runners))
        if results[0] is not None:
            self._pool_stats = results[0]
        for runner, stats in zip(runners, results[1:], strict=True):
            if stats is not None:
                runner.last_stats = stats
        steps = self._dead_runner_steps + sum(int(r.last_stats.get("steps", 0))
                                              for r in self._runners if r.alive)
        by_endpoint: Counter[str] = Counter()
        for r in runners:
            by_endpoint.update(r.last_stats.get("model_in_flight_by_endpoint") or {})
        now = time.time()
        # steps/s over the last metrics interval: a 1 s window would show the quantisation
        # of a few steps per second (0, 2, 4 ...) rather than the rate.
        self._step_history.append((now, steps))
        while len(self._step_history) > 2 and (
                now - self._step_history[1][0] >= self.cfg.monitoring.metrics_interval_s):
            self._step_history.popleft()
        first_t, first_steps = self._step_history[0]
        rate = (steps - first_steps) / (now - first_t) if now > first_t else 0.0
        pool = self._pool_stats
        self._sample = {
            "t": now,
            "elapsed_s": round(now - self._started_at, 3),
            "steps": steps,
            "steps_per_s": round(max(0.0, rate), 4),
            "desktops": {k: pool.get(k, 0) for k in ("free", "leased", "resetting",
                                                      "quarantined", "starting")},
            "desktop_resets": pool.get("resets", 0),
            "model_in_flight": sum(by_endpoint.values()),
            "model_in_flight_by_endpoint": dict(by_endpoint),
            "step_time_s": _step_split([r.last_stats for r in runners]),
        }
        sample = self.stats()
        self._metrics.sample(sample)
        if write:
            await call(self.storage, "write_metrics", sample)


def _step_split(stats: list[dict[str, Any]]) -> dict[str, float] | None:
    """Mean model / env / overhead seconds per step over the live runners."""
    steps = sum(int(s.get("steps", 0)) for s in stats)
    if not steps:
        return None
    return {k: round(sum(float(s.get(k, 0.0)) for s in stats) / steps, 4)
            for k in ("model_s", "env_s", "overhead_s")}

