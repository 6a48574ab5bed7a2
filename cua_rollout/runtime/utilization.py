"""Where the desktops' time goes (the DART paper's "environment utilization"), live.

Two clocks count it where it happens, and one tracker turns their totals into fractions:

- the desktop pool keeps a ``StateClock`` of its desktops (``starting``, ``free``,
  ``leased``, ``resetting``, ``quarantined``): desktop-seconds spent in each state;
- each runner keeps a ``StateClock`` of its episodes' phases while they hold a desktop
  (``PHASES``: setup, model, action, pause, screenshot, evaluate, other): since an episode
  holds exactly one desktop, these are the leased desktops' seconds by what they were doing;
- the coordinator's ``UtilizationTracker`` takes both clocks' totals (and the runners' step
  counters) every sample and reports the interval since the previous one: the desktops'
  time split into ``DESKTOP_STATES`` (fractions that sum to 1), actions per minute and the
  mean step split into ``STEP_PHASES``.

Totals are cumulative and include what is under way at the moment they are read, so an
interval sees the time of a phase that has not ended yet. Imports nothing heavy.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import Any

__all__ = [
    "ACTING_PHASES",
    "DESKTOP_STATES",
    "PHASES",
    "STEP_PHASES",
    "StateClock",
    "UtilizationTracker",
]

# What an episode's desktop is doing while the episode holds it.
PHASES = ("setup", "model", "action", "pause", "screenshot", "evaluate", "other")
# The phases in which the desktop itself works (the rest it waits: for the model, for the
# UI to settle, for our own bookkeeping).
ACTING_PHASES = ("setup", "action", "screenshot", "evaluate")
# The desktops' time, split: leased = acting + model_wait + pause + other, and
# leased + resetting + idle = 1 (idle: free, starting or quarantined).
DESKTOP_STATES = ("leased", "acting", "model_wait", "pause", "other", "resetting", "idle")
# The mean step, split (seconds): the runner's counters ``<phase>_s``.
STEP_PHASES = ("model", "action", "pause", "screenshot", "overhead")
_IDLE_POOL_STATES = ("free", "starting", "quarantined")


class StateClock:
    """Cumulative thing-seconds per state of a set of things that move between states
    (desktops, episodes): ``move(old, new)`` at every change (``None``: entering or leaving
    the set), ``totals()`` whenever. Exact, whatever the sampling: time is added at each
    change, O(states) per call."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._counts: dict[str, int] = {}
        self._seconds: dict[str, float] = {}
        self._last = clock()

    def move(self, old: str | None, new: str | None) -> None:
        if old == new:
            return
        self._advance()
        if old is not None:
            left = self._counts.get(old, 0) - 1
            if left > 0:
                self._counts[old] = left
            else:
                self._counts.pop(old, None)
        if new is not None:
            self._counts[new] = self._counts.get(new, 0) + 1

    def counts(self) -> dict[str, int]:
        return dict(self._counts)

    def totals(self) -> dict[str, float]:
        """Seconds per state so far, the time up to now of what is in it now included."""
        self._advance()
        return dict(self._seconds)

    def _advance(self) -> None:
        now = self._clock()
        elapsed = now - self._last
        self._last = now
        if elapsed > 0:
            for state, count in self._counts.items():
                self._seconds[state] = self._seconds.get(state, 0.0) + count * elapsed


class UtilizationTracker:
    """The coordinator's view: each ``update`` gives the interval since the previous one.

    ``pool_state_s``: the pool's ``StateClock`` totals. ``runners``: per runner id, its
    statistics (``phase_s``: its phase clock's totals; ``actions``, ``steps`` and the step
    counters ``<phase>_s``). A runner seen for the first time, or whose totals went down (a
    replacement under the same id), counts from zero; a runner that disappears simply
    stops counting."""

    def __init__(self) -> None:
        self._t: float | None = None
        self._pool: dict[str, float] = {}
        self._runners: dict[str, dict[str, Any]] = {}

    def update(self, now: float, pool_state_s: Mapping[str, float] | None,
               runners: Mapping[str, Mapping[str, Any]]) -> dict[str, Any] | None:
        """The interval's utilization, or None for the first call (no interval yet)."""
        previous_t, self._t = self._t, now
        pool = dict(pool_state_s or {})
        pool_delta = {k: max(0.0, v - self._pool.get(k, 0.0)) for k, v in pool.items()}
        self._pool = pool
        phase_delta = dict.fromkeys(PHASES, 0.0)
        counter_delta: dict[str, float] = {}
        seen: dict[str, dict[str, Any]] = {}
        for rid, stats in runners.items():
            current = _runner_totals(stats)
            before = self._runners.get(rid)
            if before is None or any(current[k] < before.get(k, 0.0) for k in current):
                before = {}
            for key, value in current.items():
                delta = value - before.get(key, 0.0)
                if key.startswith("phase:"):
                    phase = key.removeprefix("phase:")
                    if phase in phase_delta:
                        phase_delta[phase] += delta
                else:
                    counter_delta[key] = counter_delta.get(key, 0.0) + delta
            seen[rid] = current
        self._runners = seen
        if previous_t is None or now <= previous_t:
            return None
        window = now - previous_t
        return {
            "window_s": round(window, 3),
            **_desktop_split(pool_delta, phase_delta, window),
            "actions_per_min": round(60.0 * counter_delta.get("actions", 0.0) / window, 3),
            "step_s": _step_split(counter_delta),
        }


def _runner_totals(stats: Mapping[str, Any]) -> dict[str, float]:
    out = {f"phase:{k}": float(v) for k, v in (stats.get("phase_s") or {}).items()}
    for key in ("actions", "steps", *(f"{p}_s" for p in STEP_PHASES)):
        value = stats.get(key)
        if isinstance(value, int | float):
            out[key] = float(value)
    return out


def _desktop_split(pool: Mapping[str, float], phases: Mapping[str, float],
                   window: float) -> dict[str, Any]:
    total = sum(pool.values())
    if total <= 0:
        return {"desktops": 0.0, "desktop": None}
    leased = pool.get("leased", 0.0)
    parts = {"acting": sum(phases.get(p, 0.0) for p in ACTING_PHASES),
             "model_wait": phases.get("model", 0.0), "pause": phases.get("pause", 0.0)}
    busy = sum(parts.values())
    if busy > leased > 0:
        # The runners' clocks and the pool's see a lease a call apart: scale to the pool's.
        parts = {k: v * leased / busy for k, v in parts.items()}
        busy = leased
    elif leased <= 0:
        parts = dict.fromkeys(parts, 0.0)
        busy = 0.0
    split = {"leased": leased, **parts, "other": max(0.0, leased - busy),
             "resetting": pool.get("resetting", 0.0),
             "idle": sum(pool.get(s, 0.0) for s in _IDLE_POOL_STATES)}
    return {"desktops": round(total / window, 3),
            "desktop": {k: round(split[k] / total, 4) for k in DESKTOP_STATES}}


def _step_split(counters: Mapping[str, float]) -> dict[str, Any] | None:
    steps = counters.get("steps", 0.0)
    if steps <= 0:
        return None
    out: dict[str, Any] = {p: round(counters.get(f"{p}_s", 0.0) / steps, 4)
                           for p in STEP_PHASES}
    out["steps"] = round(steps)
    return out

