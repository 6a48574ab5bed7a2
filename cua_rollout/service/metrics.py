"""The service's Prometheus figures (``GET /metrics``, prometheus_client's text format), in
a registry of its own: desktops by state, resets and quarantines (read from the pool when
scraped), leases held and waiting by tenant, lease waits, 429s, actions and relayed bytes."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

__all__ = ["CONTENT_TYPE", "ServiceMetrics"]

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_PREFIX = "cua_service_"
# Lease waits range from a free desktop (milliseconds) to a full quota's deadline (minutes).
_WAIT_BUCKETS_S = (0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)
_STATES = ("starting", "free", "leased", "resetting", "quarantined")


class _Snapshot(Collector):
    """Figures read when scraped: the pool's states and counters, the tenants' leases."""

    def __init__(self, pool_stats: Callable[[], dict[str, Any]],
                 tenants: Callable[[], dict[str, dict[str, int]]]) -> None:
        self._pool_stats = pool_stats
        self._tenants = tenants

    def collect(self) -> Iterator[Any]:
        stats = self._pool_stats()
        desktops = GaugeMetricFamily(f"{_PREFIX}desktops", "Desktops by state",
                                     labels=["state"])
        for state in _STATES:
            desktops.add_metric([state], stats.get(state, 0))
        yield desktops
        for name, key, text in (("resets", "resets", "Resets that passed"),
                                ("reset_failures", "reset_failures", "Resets that failed"),
                                ("quarantines", "quarantined", "Desktops quarantined"),
                                ("replacements", "replaced", "Desktops replaced")):
            counter = CounterMetricFamily(f"{_PREFIX}{name}", text)
            counter.add_metric([], stats.get(key, 0))
            yield counter
        held = GaugeMetricFamily(f"{_PREFIX}leases", "Leases held by tenant", labels=["tenant"])
        waiting = GaugeMetricFamily(f"{_PREFIX}leases_waiting",
                                    "Lease requests waiting for quota by tenant",
                                    labels=["tenant"])
        for tenant, figures in self._tenants().items():
            held.add_metric([tenant], figures["held"])
            waiting.add_metric([tenant], figures["waiting"])
        yield held
        yield waiting


class ServiceMetrics:
    """The figures the service updates as it goes, and the scrape."""

    def __init__(self, pool_stats: Callable[[], dict[str, Any]],
                 tenants: Callable[[], dict[str, dict[str, int]]]) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.registry.register(_Snapshot(pool_stats, tenants))
        r = self.registry
        self.lease_wait_s = Histogram(f"{_PREFIX}lease_wait_seconds",
                                      "Wait of a granted lease for quota and a desktop",
                                      ["tenant"], buckets=_WAIT_BUCKETS_S, registry=r)
        self.leases_granted = Counter(f"{_PREFIX}leases_granted", "Leases granted",
                                      ["tenant"], registry=r)
        self.lease_ends = Counter(f"{_PREFIX}lease_ends", "Leases ended, by why",
                                  ["tenant", "why"], registry=r)
        self.refusals = Counter(f"{_PREFIX}refusals", "Requests refused, by error code "
                                "(over_quota: the 429s)", ["code"], registry=r)
        self.steps = Counter(f"{_PREFIX}steps", "Actions carried out, by tenant and kind",
                             ["tenant", "kind"], registry=r)
        self.relayed_requests = Counter(f"{_PREFIX}relayed_requests",
                                        "Requests relayed to desktops", ["tenant"], registry=r)
        self.relayed_bytes = Counter(f"{_PREFIX}relayed_bytes",
                                     "Bytes relayed between clients and desktops",
                                     ["direction"], registry=r)

    def scrape(self) -> bytes:
        return generate_latest(self.registry)
