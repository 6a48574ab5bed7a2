"""Keeps ``coordinator.max_concurrent_episodes`` episodes in flight over a pool of runner
actors, retries infrastructure failures, replaces dead runners, and keeps the run's counters
(through ``RunStats``, cua_rollout/runtime/stats.py: metrics.jsonl samples and the Ray
gauges).

``schedule: rollout`` refills a slot the moment an episode ends; ``schedule: batch`` starts
the next batch only when every episode of the current one (retries included) is done.
Runs as an async Ray actor; its own work is bookkeeping only (no blocking I/O).

Outages are waits, not results: an episode that ends because the model or the desktops are
down (``EpisodeResult.outage``) goes back to the head of the queue without using an attempt,
and that side's circuit breaker (cua_rollout/runtime/outages.py) holds every new episode until
a probe finds it back (capped, jittered backoff; the status line says what is waited for). An
error no retry can fix (``fatal``: credentials, configuration, storage) stops dispatching and
is handed to the driver, which ends the run with that one line; nothing of it is recorded, so
a rerun resumes.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import logging
import math
import time
import uuid
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Any

from cua_rollout.config import Config
from cua_rollout.core.aio import TaskSet, backoff_s
from cua_rollout.core.errors import ConfigError, one_line
from cua_rollout.core.layout import staging_name
from cua_rollout.core.types import EpisodeResult, EpisodeSpec, Status, infra_result
from cua_rollout.runtime.actors import RunnerClient, StorageClient
from cua_rollout.runtime.episode import episode_deadline_s
from cua_rollout.runtime.outages import Breakers
from cua_rollout.runtime.pool_shards import PoolShards, ShardedPool, next_runner_node
from cua_rollout.runtime.recorder import ResultRecorder
from cua_rollout.runtime.runner import TrajectoryRunner
from cua_rollout.runtime.stats import RunStats

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
# Calls to the storage and the pool that should answer at once.
_ACTOR_CALL_TIMEOUT_S = 60.0
# A batch of results lines waits behind the storage's queued writes (its backpressure: a
# storage writing every step for runners that cannot, on a slow disk, is slow, not dead; a
# dead one fails the call at once): only a storage stuck this long stops the run.
_RECORD_TIMEOUT_S = 300.0
# How long a runner that is unreachable (not dead) is given to answer again before it is
# declared dead, killed, and its episodes run elsewhere.
_UNREACHABLE_GRACE_S = 30.0
# Beyond an episode's own deadlines, how long the coordinator waits for its runner to answer.
_RUNNER_WATCHDOG_MARGIN_S = 60.0


@dataclass
class _Runner:
    id: str
    handle: Any
    client: RunnerClient
    active: set[str] = field(default_factory=set)
    alive: bool = True
    last_stats: dict[str, Any] = field(default_factory=dict)
    node: str | None = None   # the node it was placed on (softly), with node pool shards


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
        self._pool = ShardedPool(desktop_pool) if desktop_pool is not None else None
        # Node pool shards: runners go to the nodes in proportion to their desktops.
        self._desktops_by_node = (desktop_pool.desktops_by_node()
                                  if isinstance(desktop_pool, PoolShards) else {})
        self._storage = StorageClient(storage)
        self._recorder = ResultRecorder(self._storage, _RECORD_TIMEOUT_S)
        # episode -> staging directories of its dispatches that ended without a results line
        # (a retry, an outage): removed by the storage when the episode is recorded.
        self._unrecorded: dict[str, list[str]] = {}
        self.model_state_dir = model_state_dir
        self.use_ray = use_ray
        self._queue: deque[tuple[EpisodeSpec, list[str]]] = deque()
        self._in_flight: dict[str, tuple[EpisodeSpec, str]] = {}  # episode -> (spec, runner)
        self._runners: list[_Runner] = []
        self._runner_ids = itertools.count()
        self._batch: set[str] = set()
        self._batch_size = 0                  # episodes the current batch started with
        self._batch_final = 0                 # of them final (recorded) so far
        self._batch_cut: asyncio.Task[None] | None = None  # the straggler cut, once armed
        self._cut: dict[str, str] = {}        # episode -> why it is being cut
        self._finished: list[dict[str, Any]] = []    # not yet handed to poll()
        self._tasks = TaskSet()
        self._wake: asyncio.Event | None = None
        self._idle: asyncio.Event | None = None
        self._draining = False
        self._cancelling = False
        self.run_stats = RunStats(cfg.monitoring.metrics_interval_s, model_state_dir,
                                  ray_metrics=cfg.monitoring.ray_metrics and use_ray,
                                  run_name=cfg.run.name)
        self._breakers = Breakers(cfg, self._pool, model_state_dir, spawn=self._spawn,
                                  on_back=self._changed, on_give_up=self._stop)
        self._fatal: str | None = None    # why the run must stop; handed to the driver
        # Runners of tests and benchmarks: (cfg, pool, storage, runner id, state dir) -> a
        # runner, a local object or (use_ray) an actor handle the factory made.
        self.runner_factory: Any = None

    # ----------------------------------------------------------------- public surface

    async def start(self, prestart: bool = False) -> None:
        """Start the scheduling and statistics loops (idempotent). ``prestart``: create the
        runners K episodes need now, so their processes start while the desktops do (not
        when the first episodes are dispatched)."""
        if self._wake is not None:
            return
        self._check_runners_fit()
        if prestart:
            per_runner = self.cfg.coordinator.episodes_per_runner
            for _ in range(-(-self.cfg.coordinator.max_concurrent_episodes // per_runner)):
                self._new_runner()
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

    @property
    def counters(self) -> Counter[str]:
        """The run's counters (kept by ``run_stats``)."""
        return self.run_stats.counters

    def stats(self) -> dict[str, Any]:
        return {**self.run_stats.snapshot(
            queued=len(self._queue),
            in_flight=len(self._in_flight),
            runners=sum(r.alive for r in self._runners),
            draining=self._draining,
            waiting=self._breakers.waiting(time.time()),
            outages=self._breakers.outages(),
            fatal=self._fatal,
        ), "storage_lag": self._recorder.lag()}

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
            *(r.client.cancel() for r in self._runners if r.alive),
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
        await self._breakers.aclose()
        await self.run_stats.aclose()
        runners = [r for r in self._runners if r.alive]
        await asyncio.gather(*(r.client.close() for r in runners),
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
        if self._draining or not self._queue or self._fatal is not None:
            return None
        if self._breakers.any_open():
            return None  # a side is down: hold everything until its probe finds it back
        limit = self.cfg.coordinator.max_concurrent_episodes
        if len(self._in_flight) >= limit:
            return None
        if self.cfg.coordinator.schedule == "batch":
            if not self._batch:
                # The previous batch is complete: the next one is the next `limit` episodes.
                self._batch = {spec.episode_id for spec, _ in itertools.islice(self._queue,
                                                                                 limit)}
                self._batch_size, self._batch_final = len(self._batch), 0
                if self._batch_cut is not None:
                    self._batch_cut.cancel()
                    self._batch_cut = None
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
                # A new name for the files of each dispatch (an outage reruns the attempt).
                spec = dataclasses.replace(spec, nonce=uuid.uuid4().hex[:12])
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
        node = None
        if self._desktops_by_node:
            node = next_runner_node(self._desktops_by_node,
                                    Counter(r.node for r in self._runners if r.alive))
        if self.runner_factory is not None:
            handle = self.runner_factory(*args)
        elif self.use_ray:
            import ray
            from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

            # With its desktops' shard (soft: a full node places it elsewhere); spread
            # when the desktops are anywhere (hash shards) or none (text tasks).
            strategy: Any = ("SPREAD" if node is None
                             else NodeAffinitySchedulingStrategy(node, soft=True))
            handle = ray.remote(TrajectoryRunner).options(
                name=None,
                num_cpus=self.cfg.coordinator.runner_num_cpus,
                max_concurrency=self.cfg.coordinator.episodes_per_runner + _RUNNER_SPARE_CALLS,
                scheduling_strategy=strategy,
                max_restarts=0,
            ).remote(*args)
        else:
            handle = TrajectoryRunner(*args)
        runner = _Runner(runner_id, handle, RunnerClient(handle), node=node)
        self._runners.append(runner)
        self.counters["runners_started"] += 1
        return runner

    async def _run(self, spec: EpisodeSpec, avoid: list[str], runner: _Runner) -> None:
        try:
            try:
                # The runner ends its own episodes at their deadlines; past those and a
                # margin, the runner itself is stuck (a frozen loop, a pending actor).
                result: EpisodeResult = await asyncio.wait_for(
                    runner.client.run_episode(spec, avoid),
                    episode_deadline_s(self.cfg) + _RUNNER_WATCHDOG_MARGIN_S)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                result = await self._runner_failed(runner, spec, exc)
            await self._handle_result(spec, result)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a bug of ours: never silent, and the run must not go on
            log.exception("episode %s: handling its result failed", spec.episode_id)
            self._stop(f"the coordinator failed on episode {spec.episode_id}: "
                       f"{type(exc).__name__}: {exc}")
        finally:
            runner.active.discard(spec.episode_id)
            self._in_flight.pop(spec.episode_id, None)
            self._changed()

    async def _runner_failed(self, runner: _Runner, spec: EpisodeSpec,
                             exc: Exception) -> EpisodeResult:
        from ray.exceptions import ActorUnavailableError, RayActorError

        if isinstance(exc, ActorUnavailableError):
            # Unreachable is not dead: the episode may still run there. Ask for its result
            # once the runner answers again; only a runner that stays silent is dead.
            result = await self._result_from_unreachable(runner, spec)
            if result is not None:
                return result
        if isinstance(exc, RayActorError | TimeoutError):
            why = ("did not answer within its episode deadline" if isinstance(exc, TimeoutError)
                   else type(exc).__name__)
            await self._declare_dead(runner, why)
            return infra_result(spec, f"runner {runner.id} died: {why}", runner=runner.id)
        log.error("episode %s: runner call failed: %r", spec.episode_id, exc)
        return infra_result(spec, f"runner call failed: {type(exc).__name__}: {exc}",
                            runner=runner.id)

    async def _result_from_unreachable(self, runner: _Runner, spec: EpisodeSpec
                                       ) -> EpisodeResult | None:
        """The episode's result from a runner that was unreachable for a moment, or None
        when it stays unreachable for ``_UNREACHABLE_GRACE_S`` (then it is declared dead).
        A runner that answers but never got the episode gives it back as an outage-like
        requeue (no attempt used, not run twice)."""
        from ray.exceptions import ActorUnavailableError

        deadline = time.monotonic() + _UNREACHABLE_GRACE_S
        attempt = 0
        while time.monotonic() < deadline:
            try:
                result = await asyncio.wait_for(
                    runner.client.await_episode(spec.episode_id),
                    episode_deadline_s(self.cfg) + _RUNNER_WATCHDOG_MARGIN_S)
            except ActorUnavailableError:
                attempt += 1
                await asyncio.sleep(max(0.0, min(deadline - time.monotonic(),
                                                 backoff_s(attempt, 0.5, 5.0))))
                continue
            except Exception:  # dead, or stuck: the caller declares it dead
                return None
            self.counters["runner_unreachable_recovered"] += 1
            if result is None:
                return dataclasses.replace(
                    infra_result(spec, f"runner {runner.id} never got the episode",
                                 runner=runner.id), outage="runner")
            return result
        return None

    async def _declare_dead(self, runner: _Runner, why: str) -> None:
        """Kill the runner (so it can no longer drive a desktop), then give its desktops
        back (every pool shard's); the shards refuse its leases still in transit."""
        if not runner.alive:
            return
        runner.alive = False
        self._runners.remove(runner)  # dead runners are not kept (a week-long run)
        self.run_stats.runner_died(int(runner.last_stats.get("steps", 0)))
        log.warning("runner %s is dead (%s); its episodes are requeued", runner.id, why)
        if self.use_ray:
            import ray

            with contextlib.suppress(Exception):
                ray.kill(runner.handle, no_restart=True)
        if self._pool is None:  # a run of text tasks: no desktops to return
            return
        try:
            await asyncio.wait_for(self._pool.release_owned(f"{runner.id}/", True),
                                   _ACTOR_CALL_TIMEOUT_S)
        except Exception as exc:  # the pool reclaims them at lease_max_s at the latest
            log.error("returning the desktops of runner %s failed: %s", runner.id, exc)

    async def _handle_result(self, spec: EpisodeSpec, result: EpisodeResult) -> None:
        cfg = self.cfg.coordinator
        cut = self._cut.pop(spec.episode_id, None)
        if cut is not None and result.status in (Status.CANCELLED, Status.INFRA_ERROR):
            await self._record_cut(spec, result, cut)
            return
        if result.status == Status.CANCELLED or (
                self._cancelling and result.status == Status.INFRA_ERROR):
            # Not recorded: a rerun of the same command runs it again (its files, if any,
            # go with the run's staging area at its end).
            self.counters["cancelled"] += 1
            self._batch.discard(spec.episode_id)
            self._unrecorded.pop(spec.episode_id, None)
            return
        if result.status == Status.INFRA_ERROR and result.fatal:
            # No retry can fix it: stop, record nothing, let a rerun resume the episode.
            self.counters["fatal"] += 1
            self._not_recorded(spec)
            self._queue.appendleft((spec, list(avoid_of(result))))
            self._stop(result.error or "a fatal error")
            return
        if result.status == Status.INFRA_ERROR and result.outage:
            # A side of the service is down: a wait, not a result and not an attempt.
            self.counters["outage_requeues"] += 1
            self._not_recorded(spec)
            self._queue.appendleft((spec, list(avoid_of(result))))
            self._breakers.trip_after(result.outage, result.started_at, result.error or "")
            return
        if (result.status == Status.INFRA_ERROR and result.retryable
                and spec.attempt < cfg.max_retries):
            self.run_stats.retried()
            self._not_recorded(spec)
            log.info("episode %s attempt %d: %s; retrying", spec.episode_id, spec.attempt,
                     result.error)
            self._queue.appendleft((dataclasses.replace(spec, attempt=spec.attempt + 1),
                                    list(avoid_of(result))))
            return
        record = result.record()
        # The durable write first: bookkeeping that fails after it loses nothing.
        if not await self._record(spec, record):
            return
        if spec.episode_id in self._batch:
            self._batch.discard(spec.episode_id)
            self._batch_final += 1
            self._arm_batch_cut()
        self._finished.append(record)
        self.run_stats.final(result.status, result.reward, spec.domain)

    # ----------------------------------------------------------------- stragglers

    def _arm_batch_cut(self) -> None:
        """``batch_cutoff``: once that fraction of the batch is final, cut what still runs
        of it ``batch_grace_s`` later (once per batch)."""
        cutoff = self.cfg.coordinator.batch_cutoff
        if (cutoff is None or self._batch_cut is not None or not self._batch
                or self._batch_final < math.ceil(cutoff * self._batch_size - 1e-9)):
            return
        self._batch_cut = self._spawn(self._cut_batch(set(self._batch)))

    async def _cut_batch(self, batch: set[str]) -> None:
        cfg = self.cfg.coordinator
        await asyncio.sleep(cfg.batch_grace_s)
        left = batch & self._batch
        if not left:
            return
        why = (f"straggler cut: {self._batch_final}/{self._batch_size} of its batch were final "
               f"(coordinator.batch_cutoff {cfg.batch_cutoff:g}) and batch_grace_s "
               f"{cfg.batch_grace_s:g} passed; it runs again in the next batch")
        # Queued ones (a retry waiting for a slot) simply move on to the next batch.
        queued = {spec.episode_id for spec, _ in self._queue} & left
        self._batch -= queued
        by_runner: dict[str, list[str]] = {}
        for episode_id in left - queued:
            if episode_id in self._in_flight:
                self._cut[episode_id] = why
                by_runner.setdefault(self._in_flight[episode_id][1], []).append(episode_id)
        log.info("cutting %d straggler(s) of the batch: %s", len(self._cut), why)
        runners = {r.id: r for r in self._runners if r.alive}
        await asyncio.gather(*(runners[rid].client.cancel(ids)
                               for rid, ids in by_runner.items() if rid in runners),
                             return_exceptions=True)
        self._changed()

    async def _record_cut(self, spec: EpisodeSpec, result: EpisodeResult, why: str) -> None:
        """A cut straggler: its results line says ``cancelled`` and why (never a score, and
        not final: resume runs it again), and it goes first into the next batch."""
        self.counters["cut"] += 1
        record = dataclasses.replace(result, status=Status.CANCELLED, reward=None,
                                     error=why).record()
        if not await self._record(spec, record):
            return
        self._batch.discard(spec.episode_id)
        self._queue.appendleft((spec, list(avoid_of(result))))

    def _not_recorded(self, spec: EpisodeSpec) -> None:
        """The dispatch ends without a results line and the episode runs again: its staging
        directory goes when the episode is recorded."""
        self._unrecorded.setdefault(spec.episode_id, []).append(
            staging_name(spec.episode_id, spec.attempt, spec.nonce))

    async def _record(self, spec: EpisodeSpec, record: dict[str, Any]) -> bool:
        """Append the episode's results.jsonl line, its runner's files moved into place first
        (batched with others: ``ResultRecorder``); False (and the run stops) when the
        storage cannot: the episode is then not in results.jsonl, so a rerun runs it again."""
        staging = staging_name(spec.episode_id, spec.attempt, spec.nonce) if spec.nonce else None
        discard = self._unrecorded.pop(spec.episode_id, [])
        try:
            await self._recorder.record(record, staging, discard)
            self.counters["results_calls"] = self._recorder.calls
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            self._stop(f"storage: cannot record episode {spec.episode_id}: {one_line(exc)}")
            return False
        return True

    def _stop(self, why: str) -> None:
        """Dispatch nothing more; the driver ends the run with ``why`` (its first line: the
        driver's stop message is one line)."""
        if self._fatal is None:
            self._fatal = next((x for x in why.splitlines() if x.strip()), why)
            log.error("stopping the run: %s", why)
        self._draining = True
        self._changed()

    def _check_runners_fit(self) -> None:
        """Runners the cluster cannot schedule would stay pending with no error: say so at
        start (K, episodes per runner and the CPU reservation decide how many are needed)."""
        cfg = self.cfg.coordinator
        if not self.use_ray or cfg.runner_num_cpus == 0:
            return
        import ray

        runners = -(-cfg.max_concurrent_episodes // cfg.episodes_per_runner)
        need = runners * cfg.runner_num_cpus
        have = float(ray.cluster_resources().get("CPU", 0))
        if need > have:
            raise ConfigError(
                f"coordinator: {runners} runners (max_concurrent_episodes "
                f"{cfg.max_concurrent_episodes} / episodes_per_runner "
                f"{cfg.episodes_per_runner}) reserve {need:g} CPUs "
                f"(runner_num_cpus {cfg.runner_num_cpus:g}) but the cluster has {have:g}; "
                "raise episodes_per_runner or lower runner_num_cpus")

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
        """Gather the pool's and the runners' figures into a new sample (the gauges get it;
        ``write``: metrics.jsonl too, with the interval's utilization and the model
        servers')."""
        runners = [r for r in self._runners if r.alive]

        async def one(client: ShardedPool | RunnerClient | None) -> dict[str, Any] | None:
            if client is None:  # no desktop pool: a run of text tasks
                return None
            try:
                return await asyncio.wait_for(client.stats(), _STATS_TIMEOUT_S)
            except Exception:  # a dying actor simply gives no statistics
                return None

        scrape = (asyncio.ensure_future(self.run_stats.scrape_model_servers(
            [r.last_stats for r in runners])) if write else None)
        results = await asyncio.gather(one(self._pool), *(one(r.client) for r in runners))
        for runner, stats in zip(runners, results[1:], strict=True):
            if stats is not None:
                runner.last_stats = stats
                if stats.get("model_waiting"):
                    # Episodes already wait out a model outage: hold new ones from now.
                    self._breakers.trip("model",
                                         stats.get("model_outage") or "no endpoint is live")
        live_steps = sum(int(r.last_stats.get("steps", 0)) for r in self._runners if r.alive)
        await self.run_stats.refresh(results[0], {r.id: r.last_stats for r in runners},
                                     live_steps, scrape)
        sample = self.stats()
        self.run_stats.metrics.sample(sample)
        if write:
            await self._storage.write_metrics(sample)


def avoid_of(result: EpisodeResult) -> list[str]:
    """Desktops the next try of an episode should avoid: those its attempts ran on."""
    return list(dict.fromkeys(result.desktops_tried))

