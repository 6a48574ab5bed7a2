"""Routing of model requests: the ``Endpoint`` record, the policies that choose one endpoint
per request (each overrides ``RoutingPolicy.choose``), and the endpoints' health in
``Router``: taken out after consecutive failures, brought back by a re-probe of ``/health``."""

from __future__ import annotations

import abc
import asyncio
import contextlib
import dataclasses
import functools
import logging
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

from cua_rollout.config import ModelConfig
from cua_rollout.core.http import redact_url

__all__ = [
    "Endpoint",
    "LeastOutstandingPolicy",
    "RoundRobinPolicy",
    "Router",
    "RoutingPolicy",
    "StickyLeastOutstandingPolicy",
    "make_policy",
]

log = logging.getLogger(__name__)

_STICKY_SESSIONS_MAX = 100_000     # sessions remembered for stickiness (LRU beyond this)


@dataclass
class Endpoint:
    """A model server and what routing knows about it."""

    url: str
    model_version: str | None = None
    draining: bool = False          # set by run_model.py during a rolling reload
    outstanding: int = 0            # requests in flight from this process
    served: int = 0
    consecutive_failures: int = 0
    ejected: bool = False
    last_error: str | None = None
    max_model_len: int | None = None   # its context, from GET /v1/models (None: unknown)
    context_asked: bool = False        # that question was answered (once per endpoint)
    published: bool = False            # listed by run_model.py (its version is the list's)

    @functools.cached_property
    def label(self) -> str:
        """The URL as records, statistics and logs show it (credentials redacted); made once,
        not on every generation (``url`` never changes)."""
        return redact_url(self.url)

    def snapshot(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "url": self.label}


# --------------------------------------------------------------------------- routing policies


class RoutingPolicy(abc.ABC):
    """Chooses an endpoint for a request; one method to override."""

    @abc.abstractmethod
    def choose(self, candidates: list[Endpoint], session_id: str | None) -> Endpoint:
        """The endpoint for this request, among ``candidates`` (never empty)."""

    def forget(self, session_id: str) -> None:  # noqa: B027 — optional hook, no-op by default
        """Drop what is remembered about a finished session (stateless policies: nothing)."""


class RoundRobinPolicy(RoutingPolicy):
    def __init__(self) -> None:
        self._next = 0

    def choose(self, candidates: list[Endpoint], session_id: str | None) -> Endpoint:
        chosen = candidates[self._next % len(candidates)]
        self._next += 1
        return chosen


class LeastOutstandingPolicy(RoutingPolicy):
    """Fewest requests in flight; ties go to the endpoint that has served least."""

    def choose(self, candidates: list[Endpoint], session_id: str | None) -> Endpoint:
        return min(candidates, key=lambda e: (e.outstanding, e.served))


class StickyLeastOutstandingPolicy(LeastOutstandingPolicy):
    """Keep an episode on one endpoint (its prefix cache holds the history) unless that
    endpoint has ``max_extra_outstanding`` more requests in flight than the least loaded."""

    def __init__(self, max_extra_outstanding: int) -> None:
        self.max_extra_outstanding = max_extra_outstanding
        self._sticky: OrderedDict[str, str] = OrderedDict()
        self.hits = 0
        self.moves = 0

    def choose(self, candidates: list[Endpoint], session_id: str | None) -> Endpoint:
        least = super().choose(candidates, session_id)
        if session_id is None:
            return least
        url = self._sticky.get(session_id)
        current = next((e for e in candidates if e.url == url), None)
        if current is not None and (
            current.outstanding <= least.outstanding + self.max_extra_outstanding
        ):
            self.hits += 1
            self._sticky.move_to_end(session_id)
            return current
        if url is not None:
            self.moves += 1
        self._sticky[session_id] = least.url
        self._sticky.move_to_end(session_id)
        while len(self._sticky) > _STICKY_SESSIONS_MAX:
            self._sticky.popitem(last=False)
        return least

    def forget(self, session_id: str) -> None:
        self._sticky.pop(session_id, None)


def make_policy(cfg: ModelConfig) -> RoutingPolicy:
    if cfg.routing == "round_robin":
        return RoundRobinPolicy()
    if cfg.routing == "least_outstanding":
        return LeastOutstandingPolicy()
    return StickyLeastOutstandingPolicy(cfg.sticky_max_extra_outstanding)


# --------------------------------------------------------------------------- health


class Router:
    """The endpoints' health and the choice among the live ones. ``endpoints`` is the
    discovery's table (it adds and drops entries; this reads them and keeps their health);
    ``healthy`` asks one endpoint's ``/health`` (the client owns the HTTP connections)."""

    def __init__(
        self,
        endpoints: Mapping[str, Endpoint],
        policy: RoutingPolicy,
        *,
        failures_to_eject: int,
        reprobe_interval_s: float,
        healthy: Callable[[Endpoint], Awaitable[bool]],
    ) -> None:
        self.endpoints = endpoints
        self.policy = policy
        self.failures_to_eject = failures_to_eject
        self.reprobe_interval_s = reprobe_interval_s
        self._healthy = healthy
        self._reprobe_task: asyncio.Task[None] | None = None

    def pick(self, session_id: str | None, avoid: set[str]) -> Endpoint | None:
        """The endpoint for the next attempt, preferring one not in ``avoid`` (URLs tried
        already), or None when none is live (all draining, unhealthy, taken out after
        failures, or absent)."""
        live = [e for e in self.endpoints.values() if not e.draining and not e.ejected]
        if not live:
            return None
        fresh = [e for e in live if e.url not in avoid]
        return self.policy.choose(fresh or live, session_id)

    def answered(self, endpoint: Endpoint, *, served: bool) -> None:
        """``endpoint`` answered (``served``: with a reply; else it refused the request
        itself, a 4xx): it is not failing."""
        endpoint.consecutive_failures = 0
        if served:
            endpoint.served += 1

    def failed(self, endpoint: Endpoint, reason: str) -> None:
        """Count a failure of ``endpoint``; after ``failures_to_eject`` in a row it is taken
        out of routing until the re-probe finds it healthy."""
        endpoint.consecutive_failures += 1
        endpoint.last_error = reason
        failures = endpoint.consecutive_failures
        if failures >= self.failures_to_eject and not endpoint.ejected:
            endpoint.ejected = True
            log.warning("model endpoint %s taken out after %d failures: %s",
                        endpoint.label, failures, reason)
            self._ensure_reprobe()

    async def check_all(self) -> None:
        """Ask every endpoint that is not draining for ``/health`` now; those answering 200
        are routed to again, the others taken out."""
        candidates = [e for e in self.endpoints.values() if not e.draining]
        answers = await asyncio.gather(*(self._healthy(e) for e in candidates))
        for endpoint, ok in zip(candidates, answers, strict=True):
            if ok:
                if endpoint.ejected:
                    log.info("model endpoint %s is back", endpoint.label)
                endpoint.ejected = False
                endpoint.consecutive_failures = 0
            elif not endpoint.ejected:
                endpoint.ejected = True
                endpoint.last_error = "health check failed"

    def counts(self) -> tuple[int, int, int]:
        """(live, draining, down) endpoints."""
        endpoints = list(self.endpoints.values())
        draining = sum(e.draining for e in endpoints)
        down = sum(e.ejected and not e.draining for e in endpoints)
        return len(endpoints) - draining - down, draining, down

    @property
    def in_flight(self) -> int:
        return sum(e.outstanding for e in self.endpoints.values())

    def stats(self) -> dict[str, Any]:
        out: dict[str, Any] = {"endpoints": [e.snapshot() for e in self.endpoints.values()]}
        if isinstance(self.policy, StickyLeastOutstandingPolicy):
            out["sticky_hits"] = self.policy.hits
            out["sticky_moves"] = self.policy.moves
        return out

    async def close(self) -> None:
        if self._reprobe_task is not None:
            self._reprobe_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reprobe_task
            self._reprobe_task = None

    def _ensure_reprobe(self) -> None:
        if self._reprobe_task is None or self._reprobe_task.done():
            self._reprobe_task = asyncio.get_running_loop().create_task(self._reprobe_loop())

    async def _reprobe_loop(self) -> None:
        """Bring ejected endpoints back once their ``/health`` answers 200."""
        while any(e.ejected for e in self.endpoints.values()):
            await asyncio.sleep(self.reprobe_interval_s)
            for endpoint in [e for e in self.endpoints.values() if e.ejected]:
                if await self._healthy(endpoint):
                    endpoint.ejected = False
                    endpoint.consecutive_failures = 0
                    log.info("model endpoint %s is back", endpoint.label)
