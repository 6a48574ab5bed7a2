"""Ray metrics of the rollout (prefix ``rollout_``), declared once here and shown on the Ray
dashboard and its Prometheus endpoint.

Actors create one ``Metrics`` on their loop and update it; outside a Ray worker (the
in-process tests) or with ``monitoring.ray_metrics: false`` every update is a no-op.
"""

from __future__ import annotations

import logging
from typing import Any

__all__ = ["PREFIX", "Metrics"]

log = logging.getLogger(__name__)

PREFIX = "rollout_"
# Step latency buckets (seconds): GUI steps take from tens of milliseconds (a simulated
# desktop) to minutes (a slow model under load).
_LATENCY_BOUNDARIES_S = [0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 120]


class Metrics:
    """The run's Ray metrics; ``enabled=False`` makes every method a no-op."""

    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled and _in_ray_worker()
        if not self.enabled:
            return
        from ray.util import metrics as m

        self._episodes = m.Counter(PREFIX + "episodes", "episodes finished, by status",
                                   tag_keys=("status", "domain"))
        self._retries = m.Counter(PREFIX + "episode_retries",
                                  "episodes restarted after an infrastructure failure")
        self._steps = m.Counter(PREFIX + "steps", "agent steps taken")
        self._model_s = m.Histogram(PREFIX + "step_model_seconds",
                                    "model time of a step (generation, incl. parse retries)",
                                    boundaries=_LATENCY_BOUNDARIES_S)
        self._env_s = m.Histogram(PREFIX + "step_env_seconds",
                                  "desktop time of a step (action, pause, screenshot)",
                                  boundaries=_LATENCY_BOUNDARIES_S)
        self._overhead_s = m.Histogram(PREFIX + "step_overhead_seconds",
                                       "step time that is neither model nor desktop",
                                       boundaries=_LATENCY_BOUNDARIES_S)
        self._desktops = m.Gauge(PREFIX + "desktops", "desktops by state",
                                 tag_keys=("state",))
        self._in_flight = m.Gauge(PREFIX + "episodes_in_flight", "episodes running now")
        self._queued = m.Gauge(PREFIX + "episodes_queued", "episodes waiting for a slot")
        self._model_in_flight = m.Gauge(PREFIX + "model_in_flight",
                                        "model requests in flight, by endpoint",
                                        tag_keys=("endpoint",))
        self._success_rate = m.Gauge(PREFIX + "success_rate",
                                     "mean reward of the scored episodes so far")

    # ----------------------------------------------------------------- runner side

    def step(self, model_s: float, env_s: float, overhead_s: float) -> None:
        if not self.enabled:
            return
        self._steps.inc()
        self._model_s.observe(model_s)
        self._env_s.observe(env_s)
        self._overhead_s.observe(max(0.0, overhead_s))

    # ----------------------------------------------------------------- coordinator side

    def episode(self, status: str, domain: str) -> None:
        if self.enabled:
            self._episodes.inc(tags={"status": status, "domain": domain})

    def retry(self) -> None:
        if self.enabled:
            self._retries.inc()

    def sample(self, sample: dict[str, Any]) -> None:
        """Gauges from a metrics.jsonl sample (see AgentCoordinator)."""
        if not self.enabled:
            return
        for state, count in (sample.get("desktops") or {}).items():
            self._desktops.set(count, tags={"state": state})
        self._in_flight.set(sample.get("episodes_in_flight", 0))
        self._queued.set(sample.get("episodes_queued", 0))
        for endpoint, count in (sample.get("model_in_flight_by_endpoint") or {}).items():
            self._model_in_flight.set(count, tags={"endpoint": endpoint})
        if sample.get("success_rate") is not None:
            self._success_rate.set(sample["success_rate"])


def _in_ray_worker() -> bool:
    try:
        import ray

        return ray.is_initialized()
    except ImportError:  # pragma: no cover — ray is a dependency
        return False
