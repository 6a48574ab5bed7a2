"""Ray metrics of the rollout (prefix ``rollout_``), declared once here and shown on the Ray
dashboard, its Prometheus endpoint and the Grafana dashboard of
``deploy/grafana/rollout-dashboard.json``.

Actors create one ``Metrics`` on their loop and update it; outside a Ray worker (the
in-process tests) or with ``monitoring.ray_metrics: false`` every update is a no-op. Every
metric carries the tag ``run`` (the run's name), so that two runs on one cluster stay apart.

``METRICS`` names every metric and its kind; ``exported_names`` says which Prometheus series
Ray's metrics agent makes of one (checked against a real Ray in
``tests/integration/test_ray_metrics_export.py``); ``sample_values`` is what ``sample()``
sets, as data.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable, Mapping
from typing import Any, NamedTuple

# The states of ``sample["utilization"]["desktop"]`` and the phases of its ``step_s``.
from cua_rollout.runtime.utilization import DESKTOP_STATES, STEP_PHASES

__all__ = [
    "DESKTOP_STATES",
    "EXPORT_NAMESPACE",
    "METRICS",
    "PREFIX",
    "STEP_PHASES",
    "Metrics",
    "Value",
    "exported_names",
    "sample_values",
]

log = logging.getLogger(__name__)

PREFIX = "rollout_"
# Ray's metrics agent exports every user metric under this namespace: ``ray_<name>``
# (ray/_private/telemetry/open_telemetry_metric_recorder.py, NAMESPACE).
EXPORT_NAMESPACE = "ray_"
# Step latency buckets (seconds): GUI steps take from tens of milliseconds (a simulated
# desktop) to minutes (a slow model under load).
_LATENCY_BOUNDARIES_S = [0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 120]


class _Spec(NamedTuple):
    kind: str               # counter | gauge | histogram
    description: str
    tag_keys: tuple[str, ...] = ()


# Every metric, once: the declarations are built from this table (``run`` is added to each
# one's tags).
_SPECS: dict[str, _Spec] = {
    # runner side
    PREFIX + "steps": _Spec("counter", "agent steps taken"),
    PREFIX + "step_model_seconds": _Spec(
        "histogram", "model time of a step (generation, incl. parse retries)"),
    PREFIX + "step_env_seconds": _Spec(
        "histogram", "desktop time of a step (action, pause, screenshot)"),
    PREFIX + "step_overhead_seconds": _Spec(
        "histogram", "step time that is neither model nor desktop"),
    # coordinator side: events
    PREFIX + "episodes": _Spec("counter", "episodes finished, by status",
                               ("status", "domain")),
    PREFIX + "episode_retries": _Spec(
        "counter", "episodes restarted after an infrastructure failure"),
    # coordinator side: gauges of the metrics.jsonl sample
    PREFIX + "desktops": _Spec("gauge", "desktops by state", ("state",)),
    PREFIX + "episodes_in_flight": _Spec("gauge", "episodes running now"),
    PREFIX + "episodes_queued": _Spec("gauge", "episodes waiting for a slot"),
    PREFIX + "model_in_flight": _Spec("gauge", "model requests in flight, by endpoint",
                                      ("endpoint",)),
    PREFIX + "success_rate": _Spec("gauge", "mean reward of the scored episodes so far"),
    PREFIX + "desktop_utilization": _Spec(
        "gauge", "fraction (0..1) of the desktops' time in each state over the last interval",
        ("state",)),
    PREFIX + "actions_per_minute": _Spec(
        "gauge", "actions run on the desktops per minute over the last interval"),
    PREFIX + "step_phase_seconds": _Spec(
        "gauge", "mean seconds per step in each phase over the last interval", ("phase",)),
    PREFIX + "model_server_up": _Spec(
        "gauge", "1 if the model server's /metrics answered, else 0", ("endpoint",)),
    PREFIX + "model_server_requests": _Spec(
        "gauge", "requests on a model server, running or waiting", ("endpoint", "state")),
    PREFIX + "model_server_kv_cache_usage": _Spec(
        "gauge", "KV-cache usage (0..1) of a model server", ("endpoint",)),
    PREFIX + "model_server_tokens_per_second": _Spec(
        "gauge", "tokens per second of a model server, prompt or generation",
        ("endpoint", "kind")),
    PREFIX + "model_server_queue_seconds": _Spec(
        "gauge", "mean queue time of the requests that left a model server's queue",
        ("endpoint",)),
    PREFIX + "model_server_inference_seconds": _Spec(
        "gauge", "mean inference time (prefill + decode) of a model server's requests",
        ("endpoint",)),
    PREFIX + "fleet_replicas": _Spec("gauge", "model replicas of the fleet by state",
                                     ("state",)),
    PREFIX + "fleet_restarts": _Spec(
        "gauge", "unplanned restarts of the fleet's replicas so far (cumulative)"),
    PREFIX + "fleet_reloads": _Spec("gauge", "reloads of the fleet's replicas so far "
                                             "(cumulative)"),
}

METRICS: dict[str, str] = {name: spec.kind for name, spec in _SPECS.items()}
"""Name -> kind ("counter", "gauge" or "histogram") of every metric declared here."""

# Gauges of a breakdown (one series per state or endpoint): a series seen before and absent
# from a later sample whose section is there is set to 0, since Ray keeps exporting a
# gauge's last value while its worker lives.
_ZERO_WHEN_ABSENT: dict[str, tuple[str, ...]] = {  # name -> path of its section
    PREFIX + "desktops": ("desktops",),
    PREFIX + "model_in_flight": ("model_in_flight_by_endpoint",),
    PREFIX + "desktop_utilization": ("utilization", "desktop"),
    PREFIX + "model_server_requests": ("model_servers", "endpoints"),
    PREFIX + "fleet_replicas": ("fleet", "replicas"),
}


def exported_names(name: str) -> list[str]:
    """The Prometheus series names Ray's metrics agent exports for the metric ``name`` (a
    key of ``METRICS``), as verified on Ray 2.60 with OpenTelemetry (its default): the
    namespace ``ray_`` in front; a counter gets ``_total`` (once: a name already ending in
    ``_total`` keeps it); a histogram is ``_bucket`` (label ``le``), ``_sum`` and
    ``_count``; a gauge is its name. Ray adds the labels ``SessionName``, ``WorkerId``,
    ``Component``, ``NodeAddress`` and ``Version`` to the metric's own tags (one series per
    worker: aggregate in queries). A histogram's ``_sum`` is approximate (Ray adds up the
    midpoints of the buckets observed). With ``RAY_enable_open_telemetry=0`` (OpenCensus)
    a counter also has a deprecated gauge twin without ``_total``; these names hold in both."""
    kind = METRICS[name]
    base = EXPORT_NAMESPACE + name
    if kind == "counter":
        return [base if base.endswith("_total") else base + "_total"]
    if kind == "histogram":
        return [base + "_bucket", base + "_sum", base + "_count"]
    return [base]


class Value(NamedTuple):
    """One gauge value of a sample: metric name, its tags (without ``run``), the value."""

    name: str
    tags: dict[str, str]
    value: float


def _number(value: Any) -> float | None:
    """A finite number as float (bool as 0/1), else None."""
    if isinstance(value, bool):
        return float(value)
    if isinstance(value, int | float) and math.isfinite(value):
        return float(value)
    return None


def _section(sample: Mapping[str, Any], key: str) -> Mapping[str, Any]:
    value = sample.get(key)
    return value if isinstance(value, Mapping) else {}


def sample_values(sample: Mapping[str, Any] | None) -> list[Value]:
    """The gauge values ``Metrics.sample`` sets from a metrics.jsonl sample. A key that is
    missing, None or not of its shape is skipped, as is a value that is not a finite number;
    never raises for any JSON-like input."""
    out: list[Value] = []
    if not isinstance(sample, Mapping):
        return out

    def add(name: str, value: Any, **tags: Any) -> None:
        number = _number(value)
        if number is not None:
            out.append(Value(name, {k: str(v) for k, v in tags.items()}, number))

    def breakdown(name: str, counts: Mapping[str, Any], key: str) -> None:
        for label, value in counts.items():
            add(name, value, **{key: label})

    breakdown(PREFIX + "desktops", _section(sample, "desktops"), "state")
    add(PREFIX + "episodes_in_flight", sample.get("episodes_in_flight"))
    add(PREFIX + "episodes_queued", sample.get("episodes_queued"))
    breakdown(PREFIX + "model_in_flight", _section(sample, "model_in_flight_by_endpoint"),
              "endpoint")
    add(PREFIX + "success_rate", sample.get("success_rate"))

    utilization = _section(sample, "utilization")
    breakdown(PREFIX + "desktop_utilization", _section(utilization, "desktop"), "state")
    add(PREFIX + "actions_per_minute", utilization.get("actions_per_min"))
    step_s = _section(utilization, "step_s")
    for phase in STEP_PHASES:
        add(PREFIX + "step_phase_seconds", step_s.get(phase), phase=phase)

    endpoints = _section(sample, "model_servers").get("endpoints")
    for endpoint in endpoints if isinstance(endpoints, list) else ():
        if not isinstance(endpoint, Mapping) or not isinstance(endpoint.get("url"), str):
            continue
        url = endpoint["url"]
        add(PREFIX + "model_server_up", endpoint.get("up"), endpoint=url)
        for state in ("running", "waiting"):
            add(PREFIX + "model_server_requests", endpoint.get(state), endpoint=url,
                state=state)
        add(PREFIX + "model_server_kv_cache_usage", endpoint.get("kv_cache_usage"),
            endpoint=url)
        for kind in ("prompt", "generation"):
            add(PREFIX + "model_server_tokens_per_second",
                endpoint.get(f"{kind}_tokens_per_s"), endpoint=url, kind=kind)
        add(PREFIX + "model_server_queue_seconds", endpoint.get("mean_queue_time_s"),
            endpoint=url)
        add(PREFIX + "model_server_inference_seconds", endpoint.get("mean_inference_time_s"),
            endpoint=url)

    fleet = _section(sample, "fleet")
    breakdown(PREFIX + "fleet_replicas", _section(fleet, "replicas"), "state")
    add(PREFIX + "fleet_restarts", fleet.get("restarts"))
    add(PREFIX + "fleet_reloads", fleet.get("reloads"))
    return out


def _present_breakdowns(sample: Any) -> set[str]:
    """The breakdown gauges whose section is in ``sample`` (so absent series mean 0)."""
    out = set()
    for name, path in _ZERO_WHEN_ABSENT.items():
        section = sample
        for key in path:
            section = section.get(key) if isinstance(section, Mapping) else None
        if isinstance(section, Mapping | list):
            out.add(name)
    return out


class Metrics:
    """The run's Ray metrics; ``enabled=False`` (or outside Ray) makes every method a
    no-op. ``run``: the run's name (``cfg.run.name``), the tag ``run`` of every metric."""

    def __init__(self, enabled: bool = True, run: str | None = None) -> None:
        self.run = str(run) if run else "run"
        self.enabled = enabled and _in_ray_worker()
        self._metrics: dict[str, Any] = {}
        # name -> tag sets set so far, for the breakdowns of _ZERO_WHEN_ABSENT
        self._seen: dict[str, set[tuple[tuple[str, str], ...]]] = {}
        if not self.enabled:
            return
        from ray.util import metrics as m

        for name, spec in _SPECS.items():
            tag_keys = ("run", *spec.tag_keys)
            if spec.kind == "counter":
                metric = m.Counter(name, spec.description, tag_keys=tag_keys)
            elif spec.kind == "gauge":
                metric = m.Gauge(name, spec.description, tag_keys=tag_keys)
            else:
                metric = m.Histogram(name, spec.description,
                                     boundaries=_LATENCY_BOUNDARIES_S, tag_keys=tag_keys)
            self._metrics[name] = metric.set_default_tags({"run": self.run})

    # ----------------------------------------------------------------- runner side

    def step(self, model_s: float, env_s: float, overhead_s: float) -> None:
        if not self.enabled:
            return
        self._metrics[PREFIX + "steps"].inc()
        self._metrics[PREFIX + "step_model_seconds"].observe(model_s)
        self._metrics[PREFIX + "step_env_seconds"].observe(env_s)
        self._metrics[PREFIX + "step_overhead_seconds"].observe(max(0.0, overhead_s))

    # ----------------------------------------------------------------- coordinator side

    def episode(self, status: str, domain: str) -> None:
        if self.enabled:
            self._metrics[PREFIX + "episodes"].inc(
                tags={"status": str(status), "domain": str(domain)})

    def retry(self) -> None:
        if self.enabled:
            self._metrics[PREFIX + "episode_retries"].inc()

    def sample(self, sample: dict[str, Any]) -> None:
        """Gauges from a metrics.jsonl sample (see AgentCoordinator and ``sample_values``).
        Never raises: a value Ray refuses is logged and skipped."""
        if not self.enabled:
            return
        values = sample_values(sample)
        self._set_all(values)
        set_now: dict[str, set[tuple[tuple[str, str], ...]]] = {}
        for v in values:
            if v.name in _ZERO_WHEN_ABSENT:
                set_now.setdefault(v.name, set()).add(tuple(sorted(v.tags.items())))
        for name in _present_breakdowns(sample):
            gone = self._seen.get(name, set()) - set_now.get(name, set())
            self._set_all(Value(name, dict(tags), 0.0) for tags in sorted(gone))
        for name, now in set_now.items():
            self._seen.setdefault(name, set()).update(now)

    def _set_all(self, values: Iterable[Value]) -> None:
        for v in values:
            try:
                self._metrics[v.name].set(v.value, tags=v.tags)
            except (TypeError, ValueError) as exc:
                log.debug("metric %s %s not set: %s", v.name, v.tags, exc)


def _in_ray_worker() -> bool:
    try:
        import ray

        return ray.is_initialized()
    except ImportError:  # pragma: no cover — ray is a dependency
        return False
