"""DesktopPool semantics with a recording fake provider: exclusive leases, background
resets, quarantine and replacement, lease timeouts, reclaiming expired leases."""

from __future__ import annotations

import asyncio
import functools
import gc
import time

import pytest

from cua_rollout.config import DesktopsConfig
from cua_rollout.core.errors import ConfigError, DesktopError, DesktopUnavailable
from cua_rollout.envs.providers import DesktopProvider
from cua_rollout.runtime.pool import DesktopPool
from tests import support
from tests.doubles.fake_desktop import FakeProvider


def cfg(**kw) -> DesktopsConfig:
    base = dict(count=2, warm_spares=0, lease_timeout_s=2, reset_timeout_s=2,
                health_interval_s=0.05, lease_max_s=60)
    base.update(kw)
    return DesktopsConfig(**base)


until = functools.partial(support.until, timeout_s=3.0, poll_s=0.01)


@pytest.fixture
async def make_pool():
    pools: list[DesktopPool] = []

    async def make(provider: DesktopProvider, **kw) -> DesktopPool:
        pool = DesktopPool(cfg(**kw), provider)
        await pool.start()
        pools.append(pool)
        return pool

    yield make
    for pool in pools:
        await pool.stop()


async def test_starts_count_plus_spares_and_stops_them(make_pool):
    provider = FakeProvider()
    pool = await make_pool(provider, count=3, warm_spares=2)
    assert pool.stats()["free"] == 5
    await pool.stop()
    assert sorted(provider.stopped) == sorted(provider.started)


@pytest.mark.parametrize("error", [ConfigError("desktops.vm.image: no such file /x.qcow2"),
                                   DesktopError("Xvfb did not start")])
async def test_a_pool_that_starts_no_desktop_says_why(error):
    """A config error stays one (the driver names the key); other failures are the
    desktops'."""
    class Refusing(FakeProvider):
        async def start(self, index):
            raise error

    pool = DesktopPool(cfg(), Refusing())
    with pytest.raises(type(error), match=str(error)) as raised:
        await pool.start()
    await pool.stop()
    if isinstance(error, DesktopError):
        assert str(raised.value).startswith("no desktop could be started: ")


async def test_stats_counts_are_kept_at_each_change_and_rows_only_on_request(make_pool):
    """``stats()`` is asked every second: its counts come from the state clock, kept at
    every state change, and equal a recount of the desktops through leases, resets, a
    quarantine and its replacement; rows per desktop only with ``detail``."""
    provider = FakeProvider(reset_s=0.01)
    provider.fail_reset.add("fake-1")
    pool = await make_pool(provider, count=3)

    def recount() -> dict[str, int]:
        rows = pool.stats(detail=True)["desktops"]
        # ("quarantined" in stats() is the count of quarantines so far, a counter)
        return {s: sum(r["state"] == s for r in rows)
                for s in ("starting", "free", "leased", "resetting")}

    assert "desktops" not in pool.stats()
    leases = [await pool.lease(f"o{i}") for i in range(3)]
    assert {k: pool.stats()[k] for k in recount()} == recount()
    for lease in leases:
        await pool.release(lease.lease_id)
    await until(lambda: pool.stats()["free"] == 3 and pool.stats()["replaced"] >= 1)
    assert {k: pool.stats()[k] for k in recount()} == recount()


async def test_capacity_limits_the_pool(make_pool):
    pool = await make_pool(FakeProvider(capacity=2), count=3, warm_spares=2)
    assert pool.stats()["free"] == 2


async def test_concurrent_leases_never_share_a_desktop(make_pool):
    provider = FakeProvider(reset_s=0.01)
    pool = await make_pool(provider, count=3)
    holders: dict[str, str] = {}
    overlaps = []

    async def episode(i: int) -> None:
        for _ in range(5):
            lease = await pool.lease(f"ep{i}", timeout_s=5)
            if lease.desktop_id in holders:
                overlaps.append((lease.desktop_id, holders[lease.desktop_id], i))
            holders[lease.desktop_id] = f"ep{i}"
            await asyncio.sleep(0.005)
            del holders[lease.desktop_id]
            await pool.release(lease.lease_id)

    await asyncio.gather(*(episode(i) for i in range(8)))
    assert overlaps == []
    await until(lambda: pool.stats()["free"] == 3)
    assert pool.stats()["leases"] == 40 and pool.stats()["resets"] == 40


async def test_lease_timeout_raises_desktop_unavailable_with_the_state(make_pool):
    pool = await make_pool(FakeProvider(), count=1)
    await pool.lease("a")
    with pytest.raises(DesktopUnavailable, match=r"within 0s \(free 0, leased 1"):
        await pool.lease("b", timeout_s=0.1)
    assert pool.stats()["lease_timeouts"] == 1


async def test_slow_reset_does_not_block_other_leases(make_pool):
    provider = FakeProvider(reset_s=1.0)
    pool = await make_pool(provider, count=2)
    first = await pool.lease("a")
    await pool.release(first.lease_id)  # now resetting for 1 s
    started = time.monotonic()
    second = await pool.lease("b", timeout_s=5)
    assert time.monotonic() - started < 0.2
    assert second.desktop_id != first.desktop_id
    assert pool.stats()["resetting"] == 1


async def test_a_waiting_lease_gets_the_desktop_once_reset(make_pool):
    provider = FakeProvider(reset_s=0.2)
    pool = await make_pool(provider, count=1)
    first = await pool.lease("a")
    waiting = asyncio.create_task(pool.lease("b", timeout_s=5))
    await asyncio.sleep(0.05)
    await pool.release(first.lease_id)
    second = await waiting
    assert second.desktop_id == first.desktop_id
    assert provider.resets == [first.desktop_id]  # it was reset before being handed over


async def test_failed_reset_quarantines_and_replaces(make_pool):
    provider = FakeProvider()
    pool = await make_pool(provider, count=2)
    lease = await pool.lease("a")
    provider.fail_reset.add(lease.desktop_id)
    await pool.release(lease.lease_id, healthy=False)
    await until(lambda: pool.stats()["replaced"] == 1)
    stats = pool.stats()
    assert stats["quarantined"] == 1 and stats["reset_failures"] == 1
    assert lease.desktop_id in provider.stopped
    assert len(provider.started) == 3 and stats["free"] == 2
    # The broken desktop is never handed out again.
    leased = {(await pool.lease(f"x{i}")).desktop_id for i in range(2)}
    assert lease.desktop_id not in leased


class _RefusingProvider(FakeProvider):
    """Refuses starts while ``refuse`` is set, as a cluster over its quota does."""

    def __init__(self) -> None:
        super().__init__()
        self.refuse = False
        self.refused_at: list[float] = []

    async def start(self, index):
        if self.refuse:
            self.refused_at.append(time.monotonic())
            raise DesktopError("HTTP 403: exceeded quota: compute-resources")
        return await super().start(index)


async def test_a_desktop_that_cannot_be_replaced_is_started_again_with_backoff(
        make_pool, monkeypatch):
    from cua_rollout.runtime import pool as pool_module

    monkeypatch.setattr(pool_module, "_REFILL_BACKOFF_INITIAL_S", 0.1)
    monkeypatch.setattr(pool_module, "_REFILL_BACKOFF_MAX_S", 0.4)
    provider = _RefusingProvider()
    pool = await make_pool(provider, count=2)
    lease = await pool.lease("a")
    provider.fail_reset.add(lease.desktop_id)
    provider.refuse = True
    await pool.release(lease.lease_id, healthy=False)
    await asyncio.sleep(2.0)
    stats = pool.stats()
    assert stats["missing"] == 1 and "exceeded quota" in stats["last_start_error"]
    # Tried again and again, but with backoff: the housekeeping (every 0.05 s) alone would
    # have tried ~40 times; delays up to 0.4 s (0.2 s on average) allow ~8.
    assert 3 <= len(provider.refused_at) <= 16, provider.refused_at
    provider.refuse = False
    await until(lambda: pool.stats()["missing"] == 0 and pool.stats()["free"] == 2)
    assert pool.stats()["last_start_error"] is None


async def test_non_replaceable_desktops_are_retried_later(make_pool):
    provider = FakeProvider(replaceable=False)
    pool = await make_pool(provider, count=1, static={"urls": ["http://x"],
                                                      "retry_quarantined_s": 0.2})
    lease = await pool.lease("a")
    provider.fail_reset.add(lease.desktop_id)
    await pool.release(lease.lease_id)
    await until(lambda: pool.stats()["quarantined"] == 1)
    with pytest.raises(DesktopUnavailable):
        await pool.lease("b", timeout_s=0.05)
    provider.fail_reset.clear()
    again = await pool.lease("c", timeout_s=3)  # back after a successful re-check
    assert again.desktop_id == lease.desktop_id and provider.stopped == []


async def test_idle_desktop_failing_health_is_quarantined(make_pool):
    provider = FakeProvider()
    pool = await make_pool(provider, count=2)
    provider.unhealthy.add("fake-0")
    await until(lambda: pool.stats()["replaced"] == 1)
    ids = {(await pool.lease(f"x{i}")).desktop_id for i in range(2)}
    assert "fake-0" not in ids


async def test_idle_health_checks_of_a_big_pool_go_a_few_at_a_time(make_pool):
    class Slow(FakeProvider):
        def __init__(self) -> None:
            super().__init__()
            self.now = self.most = self.checks = 0

        async def health(self, desktop):
            self.now += 1
            self.most = max(self.most, self.now)
            try:
                await asyncio.sleep(0.01)
            finally:
                self.now -= 1
            self.checks += 1
            return True

    provider = Slow()
    pool = await make_pool(provider, count=200)
    await until(lambda: provider.checks >= 400)  # two rounds over 200 idle desktops
    assert 1 < provider.most <= 32 and pool.stats()["quarantined"] == 0


async def test_a_health_check_failing_once_after_a_reset_is_asked_again(make_pool):
    class Flaky(FakeProvider):
        def __init__(self) -> None:
            super().__init__()
            self.fail_next: set[str] = set()

        async def reset(self, desktop):
            await super().reset(desktop)
            self.fail_next.add(desktop.id)  # its first check after this reset fails

        async def health(self, desktop):
            if desktop.id in self.fail_next:
                self.fail_next.discard(desktop.id)
                return False
            return await super().health(desktop)

    provider = Flaky()
    pool = await make_pool(provider, count=1, health_interval_s=60)
    lease = await pool.lease("a")
    await pool.release(lease.lease_id)
    await until(lambda: pool.stats()["free"] == 1)
    assert pool.stats()["quarantined"] == 0 and pool.stats()["replaced"] == 0
    # A desktop that stays unhealthy is still given up, once the checks are spent.
    provider.unhealthy.add(lease.desktop_id)
    lease = await pool.lease("b")
    await pool.release(lease.lease_id)
    await until(lambda: pool.stats()["quarantined"] == 1)


async def test_expired_lease_is_reclaimed(make_pool):
    pool = await make_pool(FakeProvider(), count=1, lease_max_s=0.1)
    stale = await pool.lease("dead-runner")
    fresh = await pool.lease("b", timeout_s=3)
    assert fresh.desktop_id == stale.desktop_id
    assert pool.stats()["reclaimed"] == 1
    await pool.release(stale.lease_id)  # the late release of a reclaimed lease is ignored
    assert pool.stats()["leased"] == 1


async def test_cancelled_waiter_does_not_lose_a_desktop(make_pool):
    pool = await make_pool(FakeProvider(), count=1)
    first = await pool.lease("a")
    waiting = asyncio.create_task(pool.lease("b", timeout_s=5))
    await asyncio.sleep(0.02)
    waiting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiting
    await pool.release(first.lease_id)
    await until(lambda: pool.stats()["free"] == 1)
    assert (await pool.lease("c", timeout_s=1)).desktop_id == first.desktop_id


async def test_a_lease_still_in_transit_for_a_released_owner_is_never_granted(make_pool):
    """Review L3: in Ray mode, cancelling the runner's await does not cancel the pool's
    ``lease``. The runner then releases by owner; the lease that arrives (or is granted)
    afterwards is refused and the desktop goes to the next one, not to nobody."""
    pool = await make_pool(FakeProvider(), count=1)
    first = await pool.lease("runner-0/a")
    in_transit = asyncio.create_task(pool.lease("runner-0/b#0/x1", timeout_s=5))
    await asyncio.sleep(0.02)
    assert await pool.release_owned("runner-0/b#0/x1") == 0  # the owner gave up on it
    await pool.release(first.lease_id)
    with pytest.raises(DesktopUnavailable, match="released before its lease arrived"):
        await in_transit
    await until(lambda: pool.stats()["free"] == 1)
    with pytest.raises(DesktopUnavailable, match="released before its lease arrived"):
        await pool.lease("runner-0/b#0/x1", timeout_s=1)  # a call that arrives even later
    assert (await pool.lease("runner-0/b#0/x2", timeout_s=1)).desktop_id == first.desktop_id


async def test_reset_statistics_keep_a_bounded_window(make_pool):
    pool = await make_pool(FakeProvider(), count=1)
    for _ in range(3):
        lease = await pool.lease("a")
        await pool.release(lease.lease_id)
        await until(lambda: pool.stats()["free"] == 1)
    assert len(pool.reset_durations_s) == 3
    assert pool.reset_durations_s.maxlen is not None and pool.reset_durations_s.maxlen <= 1000


class SlowStop(FakeProvider):
    """Stopping a desktop takes longer than resetting one."""

    async def stop(self, desktop) -> None:  # type: ignore[no-untyped-def]
        await asyncio.sleep(0.6)
        await super().stop(desktop)


@pytest.mark.parametrize("provider_type", [FakeProvider, SlowStop])
@pytest.mark.parametrize("reset_fails", [False, True])
async def test_a_desktop_quarantined_during_its_reset_stays_out(make_pool, reset_fails,
                                                                provider_type):
    """An operator quarantines a desktop while it is being reset (``desktops.py quarantine``
    between a status and a release): whether the reset then succeeds or fails, the desktop is
    never handed out again, quarantined once and replaced once, and leases go on (it once
    stayed in the free list after its replacement removed it: KeyError in lease)."""
    failures: list[object] = []  # of the pool's background tasks (reset, replacement)
    asyncio.get_running_loop().set_exception_handler(
        lambda loop, context: failures.append(context.get("exception")))
    provider = provider_type(reset_s=0.3)
    pool = await make_pool(provider, count=2)
    lease = await pool.lease("ep0")
    gone = lease.desktop_id
    if reset_fails:
        provider.fail_reset.add(gone)
    await pool.release(lease.lease_id)
    assert {r["id"]: r["state"] for r in pool.describe()}[gone] == "resetting"
    said = await pool.quarantine(gone)
    assert "quarantined" in said
    await asyncio.sleep(0.5)  # the reset ends after the quarantine (before the stop: SlowStop)
    await until(lambda: pool.stats()["free"] == 2 and pool.stats()["replaced"] == 1)
    stats = pool.stats()
    assert stats["quarantined"] == 1 and gone not in {r["id"] for r in pool.describe()}
    leases = [await pool.lease(f"ep{i}") for i in range(1, 3)]
    assert gone not in {x.desktop_id for x in leases}
    assert len({x.desktop_id for x in leases}) == 2
    gc.collect()  # a task that failed unobserved reports it when collected
    await asyncio.sleep(0)
    assert failures == []


async def test_leases_take_the_oldest_free_desktop_not_avoided(make_pool):
    """Free desktops are lent oldest-ready first; ``avoid`` (the desktops an episode already
    failed on) is passed over while another is free, and lent when nothing else is; a
    quarantined desktop is never lent."""
    # Not replaceable: a quarantined desktop is not replaced by a new (newest) one.
    pool = await make_pool(FakeProvider(replaceable=False), count=4, warm_spares=0,
                           health_interval_s=60)
    first = [await pool.lease(f"o{i}", 1) for i in range(4)]
    for lease in first:                      # ready again in this order (instant resets)
        await pool.release(lease.lease_id)
        await until(lambda lease=lease: pool._desktops[lease.desktop_id].state == "free")
    order = [lease.desktop_id for lease in first]
    a = await pool.lease("a", 1, avoid=[order[0]])
    assert a.desktop_id == order[1]
    await pool.quarantine(order[2])
    b = await pool.lease("b", 1, avoid=[order[0]])
    assert b.desktop_id == order[3]          # the quarantined one is skipped
    c = await pool.lease("c", 1, avoid=[order[0]])
    assert c.desktop_id == order[0]          # avoided, but the only one free
    with pytest.raises(DesktopUnavailable):
        await pool.lease("d", 0)
