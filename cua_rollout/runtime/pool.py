"""The pool of M desktops lent to episodes: leases with deadlines and waiters, resets in
the background (outside any lock) before a desktop is lent again, quarantine and replacement
of broken desktops, reclaiming of expired leases. Where desktops come from is a provider's
job (``cua_rollout.envs.providers``); the pool knows none of them by name."""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
import uuid
from collections import deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from cua_rollout.config import DesktopsConfig
from cua_rollout.core.aio import TaskSet, backoff_s
from cua_rollout.core.errors import ConfigError, DesktopError, DesktopUnavailable
from cua_rollout.core.http import redact_url
from cua_rollout.envs.client import close_shared_client
from cua_rollout.envs.contract import DesktopAccess
from cua_rollout.envs.providers import make_provider
from cua_rollout.envs.providers.base import Desktop, DesktopProvider
from cua_rollout.envs.verify import DesktopVerifier
from cua_rollout.runtime.utilization import StateClock

__all__ = ["DesktopPool", "Lease", "Share", "pool_actor_name"]

log = logging.getLogger(__name__)

# The housekeeping loop runs at least this often (reclaiming leases, idle health checks).
_HOUSEKEEPING_MAX_INTERVAL_S = 5.0
# Idle desktops health-checked at once. Unbounded, a pool of thousands sent thousands of
# checks in one burst every round; those that timed out behind the burst (healthy desktops)
# were quarantined (1,255 of 4,352 simulated desktops, at 4,096 episodes).
_HEALTH_CHECKS_AT_ONCE = 32
# After a failed health check that follows a reset, pauses before asking again.
_RECHECKS_AFTER_RESET_S = (0.5, 1.5)
_REFILL_BACKOFF_INITIAL_S = 2.0   # after a failed start, the first delay before another
_REFILL_BACKOFF_MAX_S = 120.0
# Reset durations kept for the statistics (a bounded window: a week-long run must not grow).
_RESET_WINDOW = 1000


def pool_actor_name(run_name: str) -> str:
    """The Ray actor name of a run's desktop pool (in the run's namespace), and the prefix
    of its shards' names (``pool_shards.shard_actor_name``): how ``scripts/desktops.py``
    finds a live run's desktops."""
    return f"desktops:{run_name}"


@dataclass(frozen=True)
class Lease:
    """A desktop lent to ``owner`` until ``deadline`` (``time.time()`` seconds), by the
    pool shard named ``shard`` (its release goes back there); ``access``: the desktop's own
    token and ports, where its provider hands them out (``Desktop.access``)."""

    lease_id: str
    desktop_id: str
    url: str
    owner: str
    deadline: float
    shard: str = ""
    access: DesktopAccess | None = None


@dataclass(frozen=True)
class Share:
    """One pool's part of a run's desktops when the pool is one shard of several
    (``cua_rollout/runtime/pool_shards.py`` plans them): its name, the provider indices of
    the desktops it starts first (disjoint from every other shard's), and where the indices
    of its later desktops (replacements) go on: ``then``, ``then + stride``, ... (also
    disjoint: a desktop's id is unique in the run). Without a share a pool is the run's only
    one: ``count + warm_spares`` desktops from index 0."""

    name: str
    indices: tuple[int, ...]
    then: int
    stride: int = 1

    def __post_init__(self) -> None:
        if self.stride < 1 or len(set(self.indices)) != len(self.indices):
            raise ValueError(f"shard {self.name}: indices must be distinct and stride >= 1")

    @classmethod
    def whole(cls, cfg: DesktopsConfig, name: str = "") -> Share:
        """The share of a run's only pool: every desktop."""
        size = cfg.count + cfg.warm_spares
        return cls(name, tuple(range(size)), size, 1)

    def index_order(self) -> Iterator[int]:
        """The provider indices of this shard's desktops, in the order they are started."""
        yield from self.indices
        yield from itertools.count(self.then, self.stride)



class DesktopPool:
    """M desktops lent to episodes. Run it as an async Ray actor (``ray.remote(DesktopPool)``)
    or in-process.

    ``lease(owner, timeout_s)`` hands out a free desktop (never one that is resetting or
    quarantined) or raises ``DesktopUnavailable``; ``release(lease_id, healthy)`` returns it
    and resets it in the background, outside any lock, so other leases never wait for a reset.
    A desktop that fails its reset or health check is quarantined, then replaced (local,
    Kubernetes) or re-checked later (static). Leases past ``lease_max_s`` are reclaimed.
    """

    def __init__(self, cfg: DesktopsConfig, provider: DesktopProvider | None = None,
                 share: Share | None = None) -> None:
        self.cfg = cfg
        self.provider = provider or make_provider(cfg)
        self.share = share or Share.whole(cfg)
        self._desktops: dict[str, Desktop] = {}
        self.state_clock = StateClock()             # desktop-seconds per state
        # Desktop ids, oldest ready first: a dict as an ordered set, so taking and giving
        # back one are O(1) (a list rebuilt per lease cost 43% of the pool's Python time
        # with ~2,000 desktops free: bench_singletons.py).
        self._free: dict[str, None] = {}
        # Each waiting lease's future, with its owner (``withdraw`` ends an owner's waits).
        self._waiters: list[asyncio.Future[str]] = []
        self._waiting_owner: dict[asyncio.Future[str], str] = {}
        self._leases: dict[str, Lease] = {}
        self._tasks = TaskSet()
        self._housekeeper: asyncio.Task[Any] | None = None
        self._indices = self.share.index_order()
        self._started = False
        self._stopping = False
        # Desktops missing from the target (a start or a replacement failed): started again
        # by the housekeeping with backoff, so a refusal (quota, no room) is no crash loop.
        self._refill: asyncio.Task[Any] | None = None
        self._refill_failures = 0
        self._refill_at = 0.0
        self.last_start_error: str | None = None
        self.counters = {"leases": 0, "releases": 0, "resets": 0, "reset_failures": 0,
                         "verify_failures": 0, "quarantined": 0, "replaced": 0,
                         "reclaimed": 0, "lease_timeouts": 0, "withdrawn": 0}
        # After every reset, before a desktop is lent again: is it back in its first state?
        self.verifier = (DesktopVerifier(cfg)
                         if cfg.verify.enabled and self.provider.verify_resets else None)
        self.verify_durations_s: deque[float] = deque(maxlen=_RESET_WINDOW)
        self.reset_durations_s: deque[float] = deque(maxlen=_RESET_WINDOW)
        # Owners (prefixes) whose leases were given back for them: an episode cancelled or a
        # runner declared dead. A lease call of theirs still in transit must not be granted.
        self._revoked: dict[str, float] = {}
        # Owners (exact) that withdrew from this shard: their lease calls in transit too.
        self._withdrawn: dict[str, float] = {}

    # ----------------------------------------------------------------- lifecycle

    @property
    def name(self) -> str:
        """This shard's name (empty for a run's only pool): leases and rows carry it."""
        return self.share.name

    def target_size(self) -> int:
        want = len(self.share.indices)
        cap = self.provider.capacity()
        return want if cap is None else min(want, cap)

    async def start(self) -> dict[str, Any]:
        """Start the desktops concurrently; returns ``stats()``. Fails if none comes up."""
        if self._started:
            return self.stats()
        self._started = True
        results = await asyncio.gather(
            *(self._start_one() for _ in range(self.target_size())), return_exceptions=True
        )
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors and len(errors) == len(results):
            if isinstance(errors[0], ConfigError):  # the config's fault: said as such
                raise errors[0]
            raise DesktopError(f"no desktop could be started: {errors[0]}") from errors[0]
        for err in errors:
            self._start_failed(err, "a desktop's start")
        self._housekeeper = self._spawn(self._housekeeping())
        return self.stats()

    async def stop(self) -> None:
        """Stop every desktop this pool started and cancel its background work."""
        self._stopping = True
        if self._housekeeper is not None:
            self._housekeeper.cancel()
        # Resets and replacements run partly in threads that cancelling cannot stop: let them
        # finish (bounded), or one could recreate a desktop's files after it was stopped.
        busy = [t for t in self._tasks if t is not self._housekeeper]
        if busy:
            _, late = await asyncio.wait(busy, timeout=self.cfg.reset_timeout_s)
            for task in late:
                task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for waiter in self._waiters:
            if not waiter.done():
                waiter.set_exception(DesktopUnavailable("the desktop pool is stopping"))
        await asyncio.gather(
            *(self._stop_quietly(d) for d in self._desktops.values()), return_exceptions=True
        )
        try:
            await self.provider.close()
        except Exception as exc:  # the desktops are stopped; what is left is logged
            log.error("closing the %s provider failed: %s", self.cfg.provider, exc)
        await close_shared_client()

    # ----------------------------------------------------------------- leases

    async def lease(
        self, owner: str, timeout_s: float | None = None, avoid: Iterable[str] = ()
    ) -> Lease:
        """A free desktop for ``owner``; ``DesktopUnavailable`` after ``timeout_s``
        (``0``: only one free now, and not counted as a lease timeout: the shard router's
        first ask). Desktops in ``avoid`` (where an earlier attempt failed) are handed out
        only when no other one is free."""
        if self._stopping:
            raise DesktopUnavailable("the desktop pool is stopping")
        if self._is_revoked(owner):
            raise DesktopUnavailable(f"{owner} was released before its lease arrived")
        wait_s = self.cfg.lease_timeout_s if timeout_s is None else timeout_s
        desktop_id = self._take_free(frozenset(avoid))
        if desktop_id is None and wait_s <= 0:
            raise DesktopUnavailable(f"no desktop free now in {self._label()} "
                                     f"({self._summary()})")
        if desktop_id is None:
            waiter: asyncio.Future[str] = asyncio.get_running_loop().create_future()
            self._waiters.append(waiter)
            self._waiting_owner[waiter] = owner
            try:
                # shield: a timeout must not lose a desktop handed over at the same moment.
                desktop_id = await asyncio.wait_for(asyncio.shield(waiter), wait_s)
            except (TimeoutError, asyncio.CancelledError) as exc:
                handed = (waiter.result() if waiter.done() and not waiter.cancelled()
                          and waiter.exception() is None else None)
                waiter.cancel()
                if isinstance(exc, asyncio.CancelledError):
                    if handed is not None:
                        self._make_free(handed)
                    raise
                if handed is None:
                    self.counters["lease_timeouts"] += 1
                    raise DesktopUnavailable(
                        f"no desktop free for {owner} within {wait_s:.0f}s ({self._summary()})"
                    ) from None
                desktop_id = handed
            finally:
                self._waiting_owner.pop(waiter, None)
                if waiter in self._waiters:
                    self._waiters.remove(waiter)
        if self._is_revoked(owner):  # revoked while it waited: the desktop goes to the next one
            self._make_free(desktop_id)
            raise DesktopUnavailable(f"{owner} was released before its lease arrived")
        desktop = self._desktops[desktop_id]
        self._set_state(desktop, "leased")
        desktop.leases += 1
        lease = Lease(uuid.uuid4().hex, desktop.id, desktop.url, owner,
                      time.time() + self.cfg.lease_max_s, self.name, desktop.access)
        self._leases[lease.lease_id] = lease
        self.counters["leases"] += 1
        return lease

    async def withdraw(self, owner: str) -> int:
        """``owner`` no longer wants a desktop from this shard (it got one from another):
        its waits end now, a lease of its that was granted meanwhile goes back to the free
        desktops without a reset (it was never used), and a lease call of its still in
        transit is refused. Returns how many leases went back."""
        self._revoke(owner, exact=True)
        for waiter, who in list(self._waiting_owner.items()):
            if who == owner and not waiter.done():
                waiter.set_exception(DesktopUnavailable(f"{owner} withdrew its lease"))
        ids = [i for i, lease in self._leases.items() if lease.owner == owner]
        for lease_id in ids:
            lease = self._leases.pop(lease_id)
            # Never used: not a lease in the counts, and no reset before the next one.
            self.counters["leases"] -= 1
            self.counters["withdrawn"] += 1
            desktop = self._desktops[lease.desktop_id]
            desktop.leases -= 1
            self._make_free(desktop.id)
        return len(ids)

    async def release(self, lease_id: str, healthy: bool = True) -> None:
        """Give a desktop back; it is reset in the background before anyone else gets it."""
        lease = self._leases.pop(lease_id, None)
        if lease is None:
            log.warning("release of unknown or reclaimed lease %s ignored", lease_id)
            return
        self.counters["releases"] += 1
        desktop = self._desktops[lease.desktop_id]
        if not healthy:
            desktop.failures += 1
        self._set_state(desktop, "resetting")
        self._spawn(self._reset(desktop))

    async def release_owned(self, owner_prefix: str, healthy: bool = True) -> int:
        """Release every lease whose owner starts with ``owner_prefix`` (the leases of a
        runner that died, of an episode that stopped waiting for its lease); returns how
        many. Until its own lease could still arrive, that owner is refused any new lease,
        so a call in transit never lends a desktop to nobody."""
        self._revoke(owner_prefix)
        ids = [i for i, lease in self._leases.items() if lease.owner.startswith(owner_prefix)]
        for lease_id in ids:
            await self.release(lease_id, healthy)
        return len(ids)

    def stats(self, detail: bool = False) -> dict[str, Any]:
        """Counts by state, waits, failures and reset times: O(1) in the number of desktops
        (the coordinator asks every second; the counts are the state clock's, kept at every
        change). ``detail``: also one row per desktop (``desktops``), for tests and tools;
        operators' rows are ``describe()``."""
        counts = self.state_clock.counts()
        by_state = {s: counts.get(s, 0)
                    for s in ("starting", "free", "leased", "resetting", "quarantined")}
        resets = sorted(self.reset_durations_s)  # bounded windows (_RESET_WINDOW)
        stats = {
            "shard": self.name,
            **by_state,
            "state_s": {k: round(v, 3) for k, v in self.state_clock.totals().items()},
            "waiting": len(self._waiters),
            "missing": max(0, self.target_size() - len(self._desktops)),
            "last_start_error": self.last_start_error,
            **self.counters,
            "reset_s_median": resets[len(resets) // 2] if resets else None,
            "reset_s_max": resets[-1] if resets else None,
            "verify_s_median": (sorted(self.verify_durations_s)[len(self.verify_durations_s)
                                                                // 2]
                                if self.verify_durations_s else None),
        }
        if detail:
            stats["desktops"] = [
                {"id": d.id, "url": d.url, "state": d.state, "leases": d.leases,
                 "failures": d.failures, "last_error": d.last_error}
                for d in self._desktops.values()
            ]
        return stats

    # ----------------------------------------------------------------- operators

    def describe(self) -> list[dict[str, Any]]:
        """Every desktop as an operator sees it (``scripts/desktops.py status``): state,
        holder and age of its lease, counts, last error, and the provider's record of it."""
        now = time.time()
        held = {lease.desktop_id: lease for lease in self._leases.values()}
        rows = []
        for d in self._desktops.values():
            lease = held.get(d.id)
            rows.append({
                "id": d.id, "shard": self.name, "url": redact_url(d.url), "state": d.state,
                "owner": lease.owner if lease else None,
                "lease_id": lease.lease_id if lease else None,
                "lease_age_s": (round(now - (lease.deadline - self.cfg.lease_max_s), 1)
                                if lease else None),
                "leases": d.leases, "failures": d.failures, "last_error": d.last_error,
                "provider": {k: v for k, v in d.info.items() if k != "last_reset"},
            })
        return rows

    async def release_desktop(self, desktop_id: str,
                              reason: str = "taken back by an operator") -> str:
        """An operator takes back the lease on ``desktop_id`` (a stuck episode's): the
        desktop is quarantined, not reset, so the episode still on it fails at its next call
        (an infrastructure error, retried elsewhere) instead of going on with a desktop reset
        under it; a new desktop replaces it where the provider can. What was done, in words."""
        lease = next((x for x in self._leases.values() if x.desktop_id == desktop_id), None)
        if lease is None:
            raise DesktopError(f"{desktop_id} is not leased ({self._state_of(desktop_id)})")
        del self._leases[lease.lease_id]
        self.counters["releases"] += 1
        desktop = self._desktops[desktop_id]
        desktop.failures += 1
        await self._quarantine(desktop, f"lease of {lease.owner} {reason}")
        return (f"took back {desktop_id} from {lease.owner}; the desktop is quarantined"
                + ("; a new desktop replaces it" if self.provider.replaceable else ""))

    async def quarantine(self, desktop_id: str, reason: str = "quarantined by an operator"
                         ) -> str:
        """Take a desktop that is not leased out of service (replaced where the provider
        can). What was done, in words."""
        desktop = self._desktops.get(desktop_id)
        if desktop is None:
            raise DesktopError(f"no desktop {desktop_id} in this pool")
        if desktop.state == "leased":
            raise DesktopError(f"{desktop_id} is leased: release it first")
        if desktop.state in ("quarantined", "stopped"):
            return f"{desktop_id} is already {desktop.state}"
        self._free.pop(desktop_id, None)
        await self._quarantine(desktop, reason)
        return (f"quarantined {desktop_id}" + ("; a new desktop replaces it"
                                               if self.provider.replaceable else ""))

    async def remove(self, desktop_id: str) -> str:
        """Stop a desktop that is not leased for good and start another in its place (a
        provider that cannot start desktops only takes it out of service)."""
        return await self.quarantine(desktop_id, "removed by an operator")

    def _state_of(self, desktop_id: str) -> str:
        desktop = self._desktops.get(desktop_id)
        return desktop.state if desktop else "not in this pool"

    # ----------------------------------------------------------------- internals

    def _revoke(self, owner_prefix: str, exact: bool = False) -> None:
        """Refuse leases to owners starting with ``owner_prefix`` (``exact``: to that owner
        only) for as long as a lease call of theirs could still be in transit."""
        now = time.monotonic()
        until = now + 2 * self.cfg.lease_timeout_s + 60
        if exact:
            self._withdrawn = {p: t for p, t in self._withdrawn.items() if t > now}
            self._withdrawn[owner_prefix] = until
            return
        self._revoked = {p: t for p, t in self._revoked.items() if t > now}
        self._revoked[owner_prefix] = until

    def _label(self) -> str:
        return f"shard {self.name}" if self.name else "the pool"

    def _is_revoked(self, owner: str) -> bool:
        if self._withdrawn.get(owner, 0.0) > time.monotonic():
            return True
        if not self._revoked:
            return False
        now = time.monotonic()
        return any(owner.startswith(p) and t > now for p, t in self._revoked.items())

    def _summary(self) -> str:
        s = self.stats()
        return ", ".join(f"{k} {s[k]}" for k in ("free", "leased", "resetting", "quarantined",
                                                  "starting"))

    def _take_free(self, avoid: frozenset[str] = frozenset()) -> str | None:
        """The oldest free desktop not in ``avoid`` (else the oldest free one), taken off
        the free set; ids whose desktop is no longer free are dropped on the way."""
        stale: list[str] = []
        chosen = fallback = None
        for desktop_id in self._free:  # stops at the first usable one: O(1) as a rule
            desktop = self._desktops.get(desktop_id)
            if desktop is None or desktop.state != "free":
                stale.append(desktop_id)
            elif desktop_id not in avoid:
                chosen = desktop_id
                break
            elif fallback is None:
                fallback = desktop_id
        for desktop_id in stale:
            del self._free[desktop_id]
        chosen = chosen or fallback
        if chosen is not None:
            del self._free[chosen]
        return chosen

    def _make_free(self, desktop_id: str) -> None:
        desktop = self._desktops[desktop_id]
        while self._waiters:
            waiter = self._waiters.pop(0)
            if not waiter.done():
                self._set_state(desktop, "leased")  # reserved for this waiter
                waiter.set_result(desktop_id)
                return
        self._set_state(desktop, "free")
        self._free[desktop_id] = None

    def _set_state(self, desktop: Desktop, state: str) -> None:
        """Every state change goes through here: the state clock counts desktop-seconds
        per state (a stopped desktop leaves it)."""
        if desktop.id in self._desktops:
            self.state_clock.move(None if desktop.state == "stopped" else desktop.state,
                                  None if state == "stopped" else state)
        desktop.state = state

    def _spawn(self, coro: Any) -> asyncio.Task[Any]:
        return self._tasks.spawn(coro)

    async def _start_one(self) -> Desktop:
        index = next(self._indices)
        desktop = await self.provider.start(index)
        if self.verifier is not None:
            try:  # fresh from the provider: the state every reset must return to
                await asyncio.wait_for(self.verifier.remember(desktop.id, desktop.url),
                                       self.cfg.verify.timeout_s)
            except Exception as exc:
                await self._stop_quietly(desktop)
                raise DesktopError(f"{desktop.id}: cannot take the baseline its resets are "
                                   f"checked against: {exc}") from exc
        self._desktops[desktop.id] = desktop
        self.state_clock.move(None, desktop.state)
        self._make_free(desktop.id)
        return desktop

    async def _healthy_after_reset(self, desktop: Desktop) -> None:
        """The provider's health check after a reset, asked again after short pauses
        before the desktop is given up: under load (4,096 episodes on two cores) one check
        timed out behind the others and quarantined hundreds of healthy desktops. The
        reset's own deadline bounds the whole."""
        checks = 1
        healthy = await self.provider.health(desktop)
        for pause_s in _RECHECKS_AFTER_RESET_S:
            if healthy:
                return
            await asyncio.sleep(pause_s)
            checks += 1
            healthy = await self.provider.health(desktop)
        if not healthy:
            raise DesktopError(f"unhealthy after reset ({checks} checks)")

    async def _reset(self, desktop: Desktop) -> None:
        started = time.monotonic()
        try:
            async with asyncio.timeout(self.cfg.reset_timeout_s):  # the check included
                await self.provider.reset(desktop)
                await self._healthy_after_reset(desktop)
                problems = await self._verify(desktop)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # any failure of a reset quarantines the desktop
            if self._taken_out(desktop):
                return
            self.counters["reset_failures"] += 1
            await self._quarantine(desktop, f"reset failed: {exc!r}")
            return
        if self._taken_out(desktop):
            return
        if problems:
            self.counters["verify_failures"] += 1
            await self._quarantine(desktop, "reset did not reach the initial state: "
                                   + "; ".join(problems))
            return
        self.counters["resets"] += 1
        self.reset_durations_s.append(time.monotonic() - started)
        self._make_free(desktop.id)

    def _taken_out(self, desktop: Desktop) -> bool:
        """An operator quarantined ``desktop`` while it was being reset: it is being
        replaced, and the reset's outcome no longer decides anything."""
        return desktop.state != "resetting" or self._desktops.get(desktop.id) is not desktop

    async def _verify(self, desktop: Desktop) -> list[str]:
        if self.verifier is None:
            return []
        started = time.monotonic()
        problems = await self.verifier.check(desktop.id, desktop.url)
        self.verify_durations_s.append(time.monotonic() - started)
        return problems

    async def _quarantine(self, desktop: Desktop, reason: str) -> None:
        log.warning("desktop %s quarantined: %s", desktop.id, reason)
        self._set_state(desktop, "quarantined")
        desktop.last_error = reason
        desktop.quarantined_at = time.monotonic()
        self.counters["quarantined"] += 1
        if self.provider.replaceable and not self._stopping:
            self._spawn(self._replace(desktop))

    async def _replace(self, desktop: Desktop) -> None:
        await self._stop_quietly(desktop)
        del self._desktops[desktop.id]
        if self.verifier is not None:
            self.verifier.forget(desktop.id)
        try:
            await self._start_one()
            self.counters["replaced"] += 1
        except Exception as exc:  # one fewer until the housekeeping's refill succeeds
            self._start_failed(exc, f"replacement of {desktop.id}")

    def _start_failed(self, exc: BaseException, what: str) -> None:
        """A desktop could not be started: the next try after a growing, jittered delay;
        each distinct reason logged once."""
        reason = str(exc)
        self._refill_failures += 1
        delay = backoff_s(self._refill_failures, _REFILL_BACKOFF_INITIAL_S,
                          _REFILL_BACKOFF_MAX_S)
        self._refill_at = time.monotonic() + delay
        if reason != self.last_start_error:
            log.error("%s failed: %s (next try in %.0f s)", what, reason, delay)
        self.last_start_error = reason

    async def _refill_one(self) -> None:
        try:
            await self._start_one()
        except Exception as exc:
            self._start_failed(exc, "starting a missing desktop")
        else:
            self._refill_failures = 0
            self.last_start_error = None

    async def _stop_quietly(self, desktop: Desktop) -> None:
        try:
            await self.provider.stop(desktop)
        except Exception as exc:  # stopping is best effort; the reason is logged
            log.error("stopping %s failed: %s", desktop.id, exc)
        self._set_state(desktop, "stopped")

    async def _health_of(self, desktops: list[Desktop]) -> list[bool]:
        """The provider's health of each desktop, ``_HEALTH_CHECKS_AT_ONCE`` at a time."""
        gate = asyncio.Semaphore(_HEALTH_CHECKS_AT_ONCE)

        async def one(desktop: Desktop) -> bool:
            async with gate:
                return await self.provider.health(desktop)

        return await asyncio.gather(*(one(d) for d in desktops))

    async def _housekeeping(self) -> None:
        """Reclaim expired leases, health-check idle desktops, retry quarantined static ones."""
        while True:
            await asyncio.sleep(min(self.cfg.health_interval_s, _HOUSEKEEPING_MAX_INTERVAL_S))
            now = time.time()
            for lease in [x for x in self._leases.values() if x.deadline < now]:
                log.warning("lease %s of %s by %s expired; reclaiming", lease.lease_id,
                            lease.desktop_id, lease.owner)
                self.counters["reclaimed"] += 1
                await self.release(lease.lease_id, healthy=False)
            missing = self.target_size() - len(self._desktops)
            if (missing > 0 and self.provider.replaceable and not self._stopping
                    and (self._refill is None or self._refill.done())
                    and time.monotonic() >= self._refill_at):
                self._refill = self._spawn(self._refill_one())
            idle = [d for d in self._desktops.values() if d.state == "free"]
            healthy = await self._health_of(idle)
            for desktop, ok in zip(idle, healthy, strict=True):
                if not ok and desktop.state == "free":  # not leased while we were checking
                    self._free.pop(desktop.id, None)
                    await self._quarantine(desktop, "failed its health check while idle")
            if not self.provider.replaceable:
                retry_after = self.cfg.static.retry_quarantined_s
                for desktop in [d for d in self._desktops.values() if d.state == "quarantined"]:
                    if time.monotonic() - desktop.quarantined_at >= retry_after:
                        self._set_state(desktop, "resetting")
                        self._spawn(self._reset(desktop))
