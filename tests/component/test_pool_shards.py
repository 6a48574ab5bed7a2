"""A sharded desktop pool in-process: real ``DesktopPool`` shards (their shares from
``plan_shards``) over a recording fake provider, reached through ``ShardedPool`` as runners
on different nodes reach them: their own node's shard first, another when theirs has none
free, no lease waiting on one shard while another frees a desktop, no desktop granted twice
or left lent to nobody, releases to the right shard, and figures summed."""

from __future__ import annotations

import asyncio
import functools
from typing import Any

import pytest

from cua_rollout.config import DesktopsConfig
from cua_rollout.core.errors import DesktopError, DesktopUnavailable
from cua_rollout.runtime.pool import DesktopPool, Lease
from cua_rollout.runtime.pool_shards import NodeInfo, PoolShards, Shard, ShardedPool, plan_shards
from tests import support
from tests.doubles.fake_desktop import FakeProvider

until = functools.partial(support.until, timeout_s=5.0, poll_s=0.01)

NODES = [NodeInfo(f"{c * 12}{'0' * 44}", f"10.0.0.{i + 1}", 2.0) for i, c in enumerate("abc")]


def cfg(**kw: Any) -> DesktopsConfig:
    base = dict(provider="local", count=4, warm_spares=0, lease_timeout_s=2,
                reset_timeout_s=2, health_interval_s=0.05, lease_max_s=60)
    base.update(kw)
    return DesktopsConfig(**base)


class World:
    """Shards on ``nodes``, each a DesktopPool with its own FakeProvider."""

    def __init__(self, shards: PoolShards, pools: dict[str, DesktopPool],
                 providers: dict[str, FakeProvider]) -> None:
        self.shards, self.pools, self.providers = shards, pools, providers
        self.clients: list[ShardedPool] = []

    def node_shard(self, node: NodeInfo) -> str:
        return next(s.name for s in self.shards.shards if s.node_id == node.node_id)

    def runner_on(self, node: NodeInfo | None, address: str | None = None) -> ShardedPool:
        client = ShardedPool(self.shards, node_id=node.node_id if node else None,
                             address=address)
        self.clients.append(client)
        return client

    def leased(self) -> dict[str, int]:
        return {name: pool.stats()["leased"] for name, pool in self.pools.items()}

    async def settle(self) -> None:
        for client in self.clients:
            await client.settle()


@pytest.fixture
async def world():
    made: list[World] = []

    async def make(nodes: list[NodeInfo] = NODES[:2], *, reset_s: float = 0.0,
                   **kw: Any) -> World:
        desktops = cfg(**kw)
        plans = plan_shards(desktops, nodes, home=nodes[0])
        pools, providers, shards = {}, {}, []
        for plan in plans:
            providers[plan.name] = FakeProvider(reset_s=reset_s)
            pools[plan.name] = DesktopPool(desktops, providers[plan.name], plan.share)
            await pools[plan.name].start()
            shards.append(Shard(plan.name, pools[plan.name], plan.node.node_id, None,
                                plan.desktops))
        made.append(World(PoolShards(tuple(shards), by_node=True), pools, providers))
        return made[-1]

    yield make
    for w in made:
        await w.settle()
        for pool in w.pools.values():
            await pool.stop()


async def test_a_runner_leases_its_own_nodes_desktops_first_then_another_nodes(world):
    w = await world(count=4)  # two desktops on each node
    runner = w.runner_on(NODES[1])
    own = w.node_shard(NODES[1])
    first = [await runner.lease(f"runner-0/e{i}/x", 1) for i in range(2)]
    assert [x.shard for x in first] == [own, own]
    third = await runner.lease("runner-0/e2/x", 1)
    assert third.shard == w.node_shard(NODES[0])  # its own shard has none free
    # Every desktop id is the run's only one of that name (disjoint indices per shard).
    ids = [x.desktop_id for x in (*first, third)]
    assert len(set(ids)) == 3
    # Releases go to the shard that lent each desktop.
    await runner.release(third)
    assert w.pools[w.node_shard(NODES[0])].counters["releases"] == 1
    assert w.pools[own].counters["releases"] == 0
    await w.settle()
    assert w.leased() == {own: 2, w.node_shard(NODES[0]): 0}
    # A runner's leases came from its own shard when it had one free: none withdrawn.
    assert sum(p.counters["withdrawn"] for p in w.pools.values()) == 0


async def test_a_wait_on_its_own_shard_takes_a_desktop_freed_on_another(world):
    w = await world(count=2)  # one desktop per node
    a, b = w.runner_on(NODES[0]), w.runner_on(NODES[1])
    held_a = await a.lease("runner-0/e0/x", 1)
    held_b = await b.lease("runner-1/e0/x", 1)
    waiting = asyncio.ensure_future(b.lease("runner-1/e1/x", 30))
    await until(lambda: all(p.stats()["waiting"] == 1 for p in w.pools.values()))
    await a.release(held_a)  # node A's desktop comes back (after its reset)
    got = await asyncio.wait_for(waiting, 5)  # far less than the 30 s lease timeout
    assert got.shard == w.node_shard(NODES[0])
    await w.settle()
    # Its wait on its own shard was withdrawn: the desktop B frees goes back to free.
    assert all(p.stats()["waiting"] == 0 for p in w.pools.values())
    await b.release(held_b)
    await until(lambda: w.pools[w.node_shard(NODES[1])].stats()["free"] == 1)
    assert w.leased() == {w.node_shard(NODES[0]): 1, w.node_shard(NODES[1]): 0}


async def test_several_shards_granting_at_once_lend_one_desktop_and_take_the_rest_back(world):
    """Three shards: the runner's own has none free, the two others one each. Its lease asks
    both, takes one, and the other is given back unused (no reset, nothing held)."""
    w = await world(NODES, count=3)
    runner = w.runner_on(NODES[2])
    own = w.node_shard(NODES[2])
    blocker = await w.runner_on(NODES[2]).lease("runner-9/e0/x", 1)
    assert blocker.shard == own
    lease = await runner.lease("runner-0/e0/x", 1)
    assert lease.shard != own
    await w.settle()
    stats = await runner.stats()
    assert stats["leased"] == 2 and stats["free"] == 1 and stats["resetting"] == 0
    assert sum(p.counters["withdrawn"] for p in w.pools.values()) == 1
    assert sum(len(p.resets) for p in w.providers.values()) == 0  # never used: never reset
    assert stats["leases"] == 2  # a withdrawn grant is no lease


async def test_concurrent_waits_over_shards_never_grant_a_desktop_twice(world):
    w = await world(NODES, count=6, reset_s=0.01)
    first = [w.runner_on(NODES[i % 3]) for i in range(6)]
    held = await asyncio.gather(*(c.lease(f"runner-{i}/e0/x", 1) for i, c in enumerate(first)))
    assert w.leased() == {name: 2 for name in w.pools}
    # Twelve episodes on all nodes wait for the six desktops; all six come back at once.
    waiters = [w.runner_on(NODES[i % 3]) for i in range(12)]
    calls = [asyncio.ensure_future(c.lease(f"runner-{10 + i}/e1/x", 1.5))
             for i, c in enumerate(waiters)]
    await until(lambda: all(p.stats()["waiting"] == 12 for p in w.pools.values()))
    await asyncio.gather(*(c.release(x) for c, x in zip(first, held, strict=True)))
    results = await asyncio.gather(*calls, return_exceptions=True)
    granted = [r for r in results if isinstance(r, Lease)]
    refused = [r for r in results if not isinstance(r, Lease)]
    assert len(granted) == 6 and all(isinstance(r, DesktopUnavailable) for r in refused)
    assert len({x.desktop_id for x in granted}) == 6  # never one desktop to two episodes
    await w.settle()
    assert sum(w.leased().values()) == 6
    held_by = {lease.desktop_id: lease.owner for p in w.pools.values()
               for lease in p._leases.values()}
    assert held_by == {x.desktop_id: x.owner for x in granted}


async def test_a_cancelled_lease_leaves_no_desktop_lent_to_nobody(world):
    w = await world(count=2)
    a, b = w.runner_on(NODES[0]), w.runner_on(NODES[1])
    held = [await a.lease("runner-0/e0/x", 1), await b.lease("runner-1/e0/x", 1)]
    waiting = asyncio.ensure_future(b.lease("runner-1/e1/x", 30))
    await until(lambda: all(p.stats()["waiting"] == 1 for p in w.pools.values()))
    waiting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiting
    await w.settle()
    for client, lease in zip((a, b), held, strict=True):
        await client.release(lease)
    await until(lambda: all(p.stats()["free"] == 1 for p in w.pools.values()))
    assert w.leased() == {name: 0 for name in w.pools}
    # The cancelled owner's lease calls still in transit are refused on every shard.
    for name in w.pools:
        with pytest.raises(DesktopUnavailable, match="released before its lease arrived"):
            await w.pools[name].lease("runner-1/e1/x", 0.1)


async def test_release_owned_reaches_every_shard_and_refuses_later_leases(world):
    w = await world(count=2)
    dead = w.runner_on(NODES[0])
    leases = [await dead.lease("runner-3/e0/x", 1), await dead.lease("runner-3/e1/x", 1)]
    assert {x.shard for x in leases} == set(w.pools)  # one from each node's shard
    assert await dead.release_owned("runner-3/") == 2
    for name, pool in w.pools.items():
        assert pool.counters["releases"] == 1, name
    with pytest.raises(DesktopUnavailable):
        await dead.lease("runner-3/e2/x", 0.2)


async def test_figures_are_summed_and_a_silent_shard_keeps_its_last(world, monkeypatch):
    w = await world(NODES, count=6)
    coordinator = w.runner_on(None)
    await w.runner_on(NODES[0]).lease("runner-0/e0/x", 1)
    stats = await coordinator.stats()
    assert (stats["free"], stats["leased"], stats["shards"]) == (5, 1, 3)
    assert stats["shards_unanswered"] == []
    silent = w.node_shard(NODES[0])

    def broken(detail: bool = False) -> dict[str, Any]:
        raise RuntimeError("shard gone")

    monkeypatch.setattr(w.pools[silent], "stats", broken)
    again = await coordinator.stats()
    assert again["shards_unanswered"] == [silent]
    assert (again["free"], again["leased"]) == (5, 1)  # its last figures, not zero
    rows = await coordinator.describe()
    assert len(rows) == 6 and {r["shard"] for r in rows} == set(w.pools)


async def test_an_operator_action_goes_to_the_shard_holding_the_desktop(world):
    w = await world(count=4)
    client = w.runner_on(None)
    target = next(r for r in await client.describe() if r["shard"] == w.node_shard(NODES[1]))
    said = await client.quarantine(target["id"])
    assert said.startswith(f"quarantined {target['id']}")
    assert w.pools[w.node_shard(NODES[1])].counters["quarantined"] == 1
    assert w.pools[w.node_shard(NODES[0])].counters["quarantined"] == 0
    with pytest.raises(DesktopError, match="no desktop nope in the run's 2 pool shards"):
        await client.remove("nope")


async def test_hash_shards_give_each_runner_a_home_shard_of_its_own():
    urls = [f"http://10.3.0.{i}:5000" for i in range(8)]
    desktops = cfg(provider="static", count=8, shards=2, static={"urls": urls})
    plans = plan_shards(desktops, NODES, home=NODES[0])
    pools = {p.name: DesktopPool(desktops, FakeProvider(), p.share) for p in plans}
    shards = PoolShards(tuple(Shard(p.name, pools[p.name], p.node.node_id) for p in plans))
    for pool in pools.values():
        await pool.start()
    try:
        homes = {}
        for i in range(6):
            client = ShardedPool(shards, node_id=NODES[0].node_id)
            order = [s.name for s in client.order(f"runner-{i}/e/x")]
            assert order == [s.name for s in client.order(f"runner-{i}/other/y")]  # stable
            lease = await client.lease(f"runner-{i}/e/x", 1)
            assert lease.shard == order[0]
            homes[i] = order[0]
            await client.release(lease)
        assert set(homes.values()) == set(pools)  # runners spread over the shards
    finally:
        for pool in pools.values():
            await pool.stop()


async def test_desktops_another_host_cannot_reach_are_never_lent_to_it(world):
    w = await world(count=2)
    shards = PoolShards(tuple(Shard(s.name, s.target, s.node_id, NODES[i].address, 1)
                              for i, s in enumerate(w.shards.shards)), by_node=True)
    runner = ShardedPool(shards, node_id=NODES[1].node_id, address=NODES[1].address)
    assert [s.name for s in runner.order("runner-0/e/x")] == [w.node_shard(NODES[1])]
    await runner.lease("runner-0/e0/x", 1)
    with pytest.raises(DesktopUnavailable):  # node A's desktop is free, but not for it
        await runner.lease("runner-0/e1/x", 0.2)
    elsewhere = ShardedPool(shards, node_id="z" * 56, address="10.9.9.9")
    with pytest.raises(DesktopUnavailable, match="bound to loopback on other hosts"):
        await elsewhere.lease("runner-1/e0/x", 0.2)


async def test_one_shard_is_the_pool_itself():
    """A run's only pool: a lease is its lease (its timeout, its error), with no withdraw."""
    pool = DesktopPool(cfg(count=1), FakeProvider())
    await pool.start()
    try:
        client = ShardedPool(pool)
        lease = await client.lease("runner-0/e0/x", 1)
        with pytest.raises(DesktopUnavailable, match="within 0s"):
            await client.lease("runner-0/e1/x", 0.2)
        assert pool.counters["lease_timeouts"] == 1 and pool.counters["withdrawn"] == 0
        await client.release(lease)
        assert (await client.stats())["releases"] == 1
    finally:
        await pool.stop()


async def test_a_withdrawal_refuses_that_owner_only():
    """``withdraw`` is exact, where ``release_owned`` takes a prefix (a runner's)."""
    pool = DesktopPool(cfg(count=2), FakeProvider())
    await pool.start()
    try:
        lease = await pool.lease("probe/1", 1)
        assert await pool.withdraw("probe/1") == 1
        assert pool.stats()["free"] == 2 and pool.counters["leases"] == 0  # back, no reset
        with pytest.raises(DesktopUnavailable, match="released before its lease arrived"):
            await pool.lease("probe/1", 0.1)
        other = await pool.lease("probe/10", 1)
        assert other.lease_id != lease.lease_id
    finally:
        await pool.stop()
