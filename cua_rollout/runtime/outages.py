"""The coordinator's circuit breakers: one per side of the service (the model endpoints, the
desktops), open from the first outage until a probe finds that side back (capped, jittered
backoff), or until ``coordinator.outage_give_up_s`` ends the run."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cua_rollout.config import Config
from cua_rollout.core.aio import backoff_s
from cua_rollout.core.errors import one_line
from cua_rollout.model.client import ModelServicePool
from cua_rollout.runtime.pool_shards import ShardedPool

__all__ = ["Breaker", "Breakers"]

log = logging.getLogger(__name__)

# A probe of the desktops (the pool's figures) must answer within this; the model's, which
# asks each endpoint, within four times it.
_PROBE_TIMEOUT_S = 5.0


@dataclass
class Breaker:
    """One side of the service (the model endpoints, the desktops) seen from dispatching:
    closed while it serves; open from the first outage until a probe finds it back."""

    side: str
    label: str                      # "model endpoints", "desktops"
    open_since: float | None = None
    status: str = ""                # the probe's figures, e.g. "0 live, 1 draining, 0 down"
    outages: int = 0
    waited_s: float = 0.0
    closed_at: float = 0.0          # when it last came back

    def line(self, now: float) -> str:
        assert self.open_since is not None
        return f"waiting for {self.label}: {self.status}, {now - self.open_since:.0f} s"


class Breakers:
    """Both breakers. ``trip`` opens one and spawns its recovery (``spawn``: the
    coordinator's tasks); ``on_back`` is called when a side is back, ``on_give_up`` with the
    reason the run stops."""

    def __init__(self, cfg: Config, pool: ShardedPool | None, model_state_dir: str | None, *,
                 spawn: Callable[[Coroutine[Any, Any, Any]], Any],
                 on_back: Callable[[], None], on_give_up: Callable[[str], None]) -> None:
        self.cfg = cfg
        self.pool = pool
        self.model_state_dir = model_state_dir
        self._spawn = spawn
        self._on_back = on_back
        self._on_give_up = on_give_up
        self.by_side = {"model": Breaker("model", "model endpoints"),
                        "desktop": Breaker("desktop", "desktops")}
        self._model_probe: ModelServicePool | None = None  # used for health probes only

    def any_open(self) -> bool:
        return any(b.open_since is not None for b in self.by_side.values())

    def waiting(self, now: float) -> str | None:
        """What dispatching waits for (the status line), or None."""
        return "; ".join(b.line(now) for b in self.by_side.values()
                         if b.open_since is not None) or None

    def outages(self) -> dict[str, dict[str, Any]]:
        return {b.side: {"count": b.outages, "waited_s": round(b.waited_s, 1)}
                for b in self.by_side.values()}

    def trip_after(self, side: str, started_at: float, reason: str) -> None:
        """An episode that started at ``started_at`` met an outage of ``side``: trip it,
        unless the episode began before the side came back (it saw the outage that ended)."""
        breaker = self.by_side.get(side)
        if breaker is not None and started_at >= breaker.closed_at:
            self.trip(side, reason)

    def trip(self, side: str, reason: str) -> None:
        """``side`` is down: hold new episodes until a probe finds it back."""
        breaker = self.by_side[side]
        if breaker.open_since is not None:
            return
        breaker.open_since = time.time()
        breaker.outages += 1
        breaker.status = "checking"
        log.warning("%s down (%s): holding new episodes until they are back", breaker.label,
                    reason)
        self._spawn(self._recover(breaker))

    async def aclose(self) -> None:
        if self._model_probe is not None:
            await self._model_probe.close()

    async def _recover(self, breaker: Breaker) -> None:
        cfg = self.cfg.coordinator
        checks = 0
        while True:
            if checks:  # the first check at once: the status line shows figures, not a guess
                await asyncio.sleep(backoff_s(checks, cfg.outage_backoff.initial_s,
                                              cfg.outage_backoff.max_s))
            checks += 1
            try:
                back, breaker.status = await self._probe(breaker.side)
            except Exception as exc:  # a probe that fails says the side is still down
                back, breaker.status = False, f"probe failed: {one_line(exc)}"
            assert breaker.open_since is not None
            down_s = time.time() - breaker.open_since
            if back:
                breaker.waited_s += down_s
                breaker.open_since = None
                breaker.closed_at = time.time()
                log.warning("%s back after %.0f s (%s)", breaker.label, down_s, breaker.status)
                self._on_back()
                return
            if cfg.outage_give_up_s and down_s >= cfg.outage_give_up_s:
                self._on_give_up(f"{breaker.label} down for {down_s:.0f} s "
                                 f"(coordinator.outage_give_up_s): {breaker.status}")
                return

    async def _probe(self, side: str) -> tuple[bool, str]:
        if side == "model":
            if self._model_probe is None:
                state = Path(self.model_state_dir) if self.model_state_dir else None
                self._model_probe = ModelServicePool(self.cfg.model, state)
            status = await asyncio.wait_for(self._model_probe.probe(), _PROBE_TIMEOUT_S * 4)
            return status.live > 0, str(status)
        if self.pool is None:
            return True, "no desktops (text tasks)"
        stats = await asyncio.wait_for(self.pool.stats(), _PROBE_TIMEOUT_S)
        usable = sum(stats.get(k, 0) for k in ("free", "leased", "resetting"))
        text = ", ".join(f"{stats.get(k, 0)} {k}" for k in ("free", "leased", "resetting",
                                                            "quarantined", "starting"))
        return usable > 0, text
