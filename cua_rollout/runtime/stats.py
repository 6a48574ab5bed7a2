"""The run's statistics, kept for the coordinator: its counters, the success rate, steps per
second, the desktops' and runners' latest figures, the utilization of each metrics interval,
the model servers' own /metrics and the Ray gauges. The coordinator feeds it; it schedules
nothing and calls no actor."""

from __future__ import annotations

import logging
import time
from collections import Counter, deque
from collections.abc import Awaitable
from pathlib import Path
from typing import Any

from cua_rollout.core.types import SCORED_STATUSES, Status
from cua_rollout.model.fleet.state import fleet_summary
from cua_rollout.model.server_metrics import ServerMetricsScraper
from cua_rollout.runtime.monitoring import Metrics
from cua_rollout.runtime.utilization import UtilizationTracker

__all__ = ["RunStats"]

log = logging.getLogger(__name__)

# Each model server's /metrics must answer within this (a slow one is reported as down).
_SCRAPE_TIMEOUT_S = 2.0
_DESKTOP_STATES = ("free", "leased", "resetting", "quarantined", "starting")


class RunStats:
    """Counters and samples of one coordinator. ``snapshot`` is what ``AgentCoordinator.stats``
    returns (the driver, the progress line, metrics.jsonl and the benchmarks read it)."""

    def __init__(self, metrics_interval_s: float, model_state_dir: str | None, *,
                 ray_metrics: bool, run_name: str) -> None:
        self.metrics_interval_s = metrics_interval_s
        self.model_state_dir = model_state_dir
        self.metrics = Metrics(ray_metrics, run=run_name)   # the Ray gauges
        self.counters: Counter[str] = Counter()
        self._started_at = time.time()
        self._rewards_sum = 0.0
        self._rewards_n = 0
        self._dead_runner_steps = 0
        self._sample: dict[str, Any] = {}
        self._step_history: deque[tuple[float, int]] = deque([(time.time(), 0)])
        self._pool_stats: dict[str, Any] = {}
        self._utilization = UtilizationTracker()
        self._servers: ServerMetricsScraper | None = None   # the model servers' /metrics
        self._servers_sample: dict[str, Any] | None = None

    # ----------------------------------------------------------------- events

    def retried(self) -> None:
        self.counters["retries"] += 1
        self.metrics.retry()

    def final(self, status: str, reward: float | None, domain: str) -> None:
        """An episode's results line is written (its status counts; a score feeds the rate)."""
        self.counters[f"status_{status}"] += 1
        if status in SCORED_STATUSES and reward is not None:
            self._rewards_sum += reward
            self._rewards_n += 1
        self.metrics.episode(status, domain)

    def runner_died(self, steps: int) -> None:
        """A dead runner's steps stay in the run's total."""
        self.counters["runners_died"] += 1
        self._dead_runner_steps += steps

    def success_rate(self) -> float | None:
        return self._rewards_sum / self._rewards_n if self._rewards_n else None

    # ----------------------------------------------------------------- samples

    def snapshot(self, *, queued: int, in_flight: int, runners: int, draining: bool,
                 waiting: str | None, outages: dict[str, Any], fatal: str | None
                 ) -> dict[str, Any]:
        """The latest sample with the scheduling state the coordinator hands in."""
        return {
            **self._sample,
            "episodes_queued": queued,
            "episodes_in_flight": in_flight,
            "episodes_done": sum(self.counters[f"status_{s}"] for s in
                                 (*SCORED_STATUSES, Status.INFRA_ERROR)),
            "episodes_by_status": {s.removeprefix("status_"): n for s, n in self.counters.items()
                                   if s.startswith("status_")},
            "retries": self.counters["retries"],
            "cut": self.counters["cut"],
            "runners": runners,
            "runners_replaced": self.counters["runners_died"],
            "success_rate": self.success_rate(),
            "draining": draining,
            "waiting": waiting,
            "outages": outages,
            "fatal": fatal,
        }

    async def refresh(self, pool_stats: dict[str, Any] | None,
                      runner_stats: dict[str, dict[str, Any]], live_steps: int,
                      scrape: Awaitable[None] | None) -> None:
        """A new sample from the pool's figures (None: none came), each runner's latest
        (by runner id) and the steps of the live runners; with ``scrape`` (the model servers'
        scrape under way, started by ``scrape_model_servers``) it is a written sample, whose
        interval's utilization is added."""
        if pool_stats is not None:
            self._pool_stats = pool_stats
        stats = list(runner_stats.values())
        steps = self._dead_runner_steps + live_steps
        by_endpoint: Counter[str] = Counter()
        for s in stats:
            by_endpoint.update(s.get("model_in_flight_by_endpoint") or {})
        now = time.time()
        # steps/s over the last metrics interval: a 1 s window would show the quantisation
        # of a few steps per second (0, 2, 4 ...) rather than the rate.
        self._step_history.append((now, steps))
        while len(self._step_history) > 2 and (
                now - self._step_history[1][0] >= self.metrics_interval_s):
            self._step_history.popleft()
        first_t, first_steps = self._step_history[0]
        rate = (steps - first_steps) / (now - first_t) if now > first_t else 0.0
        pool = self._pool_stats
        self._sample = {
            "t": now,
            "elapsed_s": round(now - self._started_at, 3),
            "steps": steps,
            "steps_per_s": round(max(0.0, rate), 4),
            "desktops": {k: pool.get(k, 0) for k in _DESKTOP_STATES},
            "desktop_resets": pool.get("resets", 0),
            "model_in_flight": sum(by_endpoint.values()),
            "model_in_flight_by_endpoint": dict(by_endpoint),
            "step_time_s": _step_split(stats),
            # Who writes the live runners' step files (runtime/storage.py, StepFiles): each
            # runner process itself, or the storage actor (every step's bytes through it).
            "step_files": dict(Counter(
                mode for s in stats if (mode := (s.get("step_files") or {}).get("mode")))),
        }
        if scrape is not None:
            # The interval since the last written sample: the desktops' time split, actions
            # per minute, the mean step split (cua_rollout/runtime/utilization.py); the model
            # servers.
            utilization = self._utilization.update(
                time.monotonic(), pool.get("state_s"),
                {rid: s for rid, s in runner_stats.items() if s})
            await scrape
            self._servers_sample = {**(self._servers_sample or {}),
                                    "utilization": utilization}
        self._sample.update(self._servers_sample or {})

    async def scrape_model_servers(self, runner_stats: list[dict[str, Any]]) -> None:
        """The model servers' own figures (vLLM's Prometheus ``/metrics``) at the endpoints
        the runners use: requests running and waiting, KV-cache use, tokens/s, queue and
        inference time; and the fleet's replicas when its state directory is known. Never
        raises."""
        try:
            urls = sorted({url for s in runner_stats
                           for url in (s.get("model_in_flight_by_endpoint") or {})})
            if self._servers is None:
                self._servers = ServerMetricsScraper(urls, timeout_s=_SCRAPE_TIMEOUT_S)
            else:
                self._servers.set_urls(urls)
            found = await self._servers.scrape() if urls else []
            sample: dict[str, Any] = {
                "model_servers": {"endpoints": [u.to_dict() for u in found],
                                  "summary": ServerMetricsScraper.summary(found)}
                if found else None,
                "fleet": fleet_summary(Path(self.model_state_dir))
                if self.model_state_dir else None,
            }
        except Exception:  # statistics must never stop the run
            log.exception("model server statistics failed")
            return
        self._servers_sample = {**(self._servers_sample or {}), **sample}

    async def aclose(self) -> None:
        if self._servers is not None:
            await self._servers.aclose()


def _step_split(stats: list[dict[str, Any]]) -> dict[str, float] | None:
    """Mean model / env / overhead seconds per step over the live runners."""
    steps = sum(int(s.get("steps", 0)) for s in stats)
    if not steps:
        return None
    return {k: round(sum(float(s.get(k, 0.0)) for s in stats) / steps, 4)
            for k in ("model_s", "env_s", "overhead_s")}
