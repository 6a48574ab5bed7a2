"""The desktop pool in shards, so no one process lends every desktop of a big run: where a
run's shards go and which desktops each holds (``plan_shards``), where runners go to be near
them (``next_runner_node``), and ``ShardedPool``, the one client of all of a run's shards:
it leases from the caller's own node's shard first, releases to the shard a lease came from
and sums the shards' figures. Each shard is a ``DesktopPool`` (pool.py) given its ``Share``.

Two kinds of shards:

- **by node** (``local``, ``container``, ``vm``: desktops run where their pool runs): one
  shard on each live node with CPUs (or on ``desktops.node`` alone), each with its share of
  ``count + warm_spares`` in proportion to the nodes' CPUs; runners are placed on the nodes
  in the same proportion and lease from their own node's shard first.
- **by hash** (``static``, ``kubernetes``: desktops run elsewhere): ``desktops.shards``
  shards on the driver's node (or ``desktops.node``), a desktop in the shard its key hashes
  to (rendezvous hashing: stable across processes and runs); a runner's first shard is the
  one its id hashes to.

One shard is exactly the pool of before: every call goes straight to it.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import math
import statistics
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

from cua_rollout.config import DesktopsConfig
from cua_rollout.core.aio import TaskSet
from cua_rollout.core.errors import DesktopError, DesktopUnavailable
from cua_rollout.core.http import is_loopback
from cua_rollout.runtime.actors import PoolClient
from cua_rollout.runtime.pool import DesktopPool, Lease, Share, pool_actor_name

__all__ = ["DESKTOPS_PER_HASH_SHARD", "NodeInfo", "PoolShards", "Shard", "ShardPlan",
           "ShardedPool", "aggregate_stats", "default_hash_shards", "find_run_shards",
           "hosted_by_node", "next_runner_node", "plan_shards", "shard_actor_name",
           "shard_of"]

log = logging.getLogger(__name__)

T = TypeVar("T")

# A hash-sharded run gets one shard per this many desktops by default. One shard carried 815
# episodes/s with reset checks off (bench_singletons.py: ~16,000 desktops at a 2 s step);
# a checked reset adds a screenshot and a thumbnail decode per episode, so a shard gets an
# eighth of that. Each shard is a process with its own housekeeping: at 4,096 desktops, 9
# shards (one per 500) cost the run 1.7 ms of CPU a step in bench_rollout.py's 50 steps/s.
DESKTOPS_PER_HASH_SHARD = 2000
# Calls to the shards for operator actions should answer at once.
_SHARD_CALL_TIMEOUT_S = 5.0
# A shard's figures: under the coordinator's 5 s for the whole call, so one silent shard is
# reported (its last figures kept) rather than losing every shard's.
_SHARD_STATS_TIMEOUT_S = 2.0
# What the other shards asked for a lease get to answer once one granted it (the cleanup).
_WITHDRAW_TIMEOUT_S = 60.0
_BY_NODE = ("local", "container", "vm")


def hosted_by_node(cfg: DesktopsConfig) -> bool:
    """Whether the provider's desktops run on the node of their pool (one shard per node)."""
    return cfg.provider in _BY_NODE


def shard_of(key: str, shards: int) -> int:
    """The shard (0 .. shards-1) ``key`` belongs to: rendezvous hashing over blake2b, the
    same in every process and run (never Python's salted ``hash``), and a desktop keeps its
    shard when a shard is added unless it moves to the new one."""
    if shards < 1:
        raise ValueError(f"shards must be at least 1, not {shards}")
    return max(range(shards), key=lambda k: _score(key, str(k)))


def _score(key: str, salt: str) -> int:
    digest = hashlib.blake2b(f"{salt}\0{key}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


def default_hash_shards(desktops: int) -> int:
    """``desktops.shards`` when unset: one per ``DESKTOPS_PER_HASH_SHARD`` desktops, at
    least one (a run of up to 2,000 desktops has one shard)."""
    return max(1, math.ceil(desktops / DESKTOPS_PER_HASH_SHARD))


# --------------------------------------------------------------------------- the plan


@dataclass(frozen=True)
class NodeInfo:
    """A live Ray node as the plan sees it."""

    node_id: str
    address: str
    cpus: float


@dataclass(frozen=True)
class ShardPlan:
    """One shard to start: its share of the desktops, the node its actor is pinned to, and
    (``host``) the address only runners of which reach its desktops (bound to loopback)."""

    share: Share
    node: NodeInfo
    host: str | None = None

    @property
    def name(self) -> str:
        return self.share.name

    @property
    def desktops(self) -> int:
        return len(self.share.indices)


def plan_shards(cfg: DesktopsConfig, nodes: list[NodeInfo], *, home: NodeInfo,
                pinned: NodeInfo | None = None) -> list[ShardPlan]:
    """The run's shards. ``home``: the driver's node (hash shards go there); ``pinned``:
    the node ``desktops.node`` names (then node-hosted desktops have one shard there, as
    before shards). Node shards split ``count + warm_spares`` in proportion to the nodes'
    CPUs (largest remainders; a node whose share is 0 gets no shard): desktops and the
    runners placed with them both take CPU, and a cluster's nodes differ in size."""
    if hosted_by_node(cfg):
        return _node_plan(cfg, nodes, pinned)
    return _hash_plan(cfg, pinned or home)


def _node_plan(cfg: DesktopsConfig, nodes: list[NodeInfo], pinned: NodeInfo | None
               ) -> list[ShardPlan]:
    total = cfg.count + cfg.warm_spares
    hosts = [pinned] if pinned is not None else [n for n in nodes if n.cpus > 0]
    if not hosts:
        raise DesktopError("no live Ray node has CPUs to run desktops on (set desktops.node "
                           "to the node that should)")
    hosts = sorted(hosts, key=lambda n: n.node_id)
    weights = [n.cpus if pinned is None else 1.0 for n in hosts]
    sizes = _proportional(total, weights)
    kept = [(n, size) for n, size in zip(hosts, sizes, strict=True) if size > 0]
    stride = len(kept)
    bind = {"local": cfg.local.host, "container": cfg.container.publish_host,
            "vm": cfg.vm.bind_host}[cfg.provider]
    plans = []
    for k, (node, size) in enumerate(kept):
        # Residue k of the stride: no two shards ever start a desktop of the same index
        # (ids hold the index; a replacement's too).
        share = Share(f"node-{node.node_id[:12]}", tuple(range(k, k + size * stride, stride)),
                      k + size * stride, stride)
        plans.append(ShardPlan(share, node, node.address if is_loopback(bind) else None))
    return plans


def _hash_plan(cfg: DesktopsConfig, node: NodeInfo) -> list[ShardPlan]:
    total = cfg.count + cfg.warm_spares
    if cfg.provider == "static":
        total = min(total, len(cfg.static.urls))
        keys = [cfg.static.urls[i].rstrip("/") for i in range(total)]
    else:  # kubernetes: a pod's name is cua-<run>-<index>-<random>; the index is what stays
        keys = [str(i) for i in range(total)]
    count = cfg.shards or default_hash_shards(total)
    owned: list[list[int]] = [[] for _ in range(count)]
    for index, key in enumerate(keys):
        owned[shard_of(key, count)].append(index)
    plans = []
    for k, indices in enumerate(owned):
        if not indices:  # a few desktops hashed over many shards: this one got none
            log.info("desktop pool shard hash-%d of %d holds no desktop; not started", k, count)
            continue
        # Replacements (kubernetes) go on past every first index, in residue k of count.
        plans.append(ShardPlan(Share(f"hash-{k}", tuple(indices), total + k, count), node))
    return plans


def _proportional(total: int, weights: list[float]) -> list[int]:
    """``total`` split in proportion to ``weights`` (largest remainders, ties to the first)."""
    whole = sum(weights)
    exact = [total * w / whole for w in weights]
    sizes = [math.floor(x) for x in exact]
    for i in sorted(range(len(weights)), key=lambda i: (sizes[i] - exact[i], i))[
            :total - sum(sizes)]:
        sizes[i] += 1
    return sizes


def next_runner_node(desktops_by_node: Mapping[str, int],
                     runners_by_node: Mapping[str, int]) -> str:
    """The node the next runner goes to: the one whose runners are furthest below its share
    of the desktops (runners end up in proportion to the desktops, as seats are given in
    proportion to votes)."""
    return min(desktops_by_node, key=lambda n: ((runners_by_node.get(n, 0) + 1)
                                                / desktops_by_node[n],
                                                -desktops_by_node[n], n))


# --------------------------------------------------------------------------- the run's shards


@dataclass(frozen=True)
class Shard:
    """One started shard: its name (what its leases carry), its ``DesktopPool`` (a Ray
    actor handle, or the object itself in-process), its node and planned desktops, and
    ``host`` when only runners on that address reach its desktops."""

    name: str
    target: Any
    node_id: str | None = None
    host: str | None = None
    desktops: int = 0


@dataclass(frozen=True)
class PoolShards:
    """A run's desktop pool as its shards: what the coordinator and every runner are given
    (it pickles: Ray handles and names). ``by_node``: shards per node (runners are placed
    with them); else by hash."""

    shards: tuple[Shard, ...]
    by_node: bool = False

    def __post_init__(self) -> None:
        if not self.shards:
            raise ValueError("a desktop pool has at least one shard")
        names = [s.name for s in self.shards]
        if len(set(names)) != len(names):
            raise ValueError(f"shard names repeat: {names}")

    def desktops_by_node(self) -> dict[str, int]:
        """Planned desktops per node of node shards: where runners go. Empty for hash shards
        and for one shard (``desktops.node``, or a one-node cluster): runners spread as
        before shards (a pinned node may have no CPU for them)."""
        if not self.by_node or len(self.shards) == 1:
            return {}
        out: dict[str, int] = {}
        for s in self.shards:
            if s.node_id is not None and s.desktops > 0:
                out[s.node_id] = out.get(s.node_id, 0) + s.desktops
        return out


def shard_actor_name(base: str, shard: str, shards: int) -> str:
    """A shard's Ray actor name: ``base`` (``pool_actor_name``, with a ``#suffix`` when an
    earlier run's is still held) for a run's only shard, ``base/shard`` for one of several."""
    return base if shards == 1 else f"{base}/{shard}"


def find_run_shards(run_name: str) -> PoolShards | None:
    """The shards of the live run ``run_name`` in the current Ray namespace (Ray must be
    initialised), or None. A run's shards share one base name; several bases (an earlier
    run's pool not yet collected) are tried in order, the plain name first."""
    import ray

    base = pool_actor_name(run_name)
    groups: dict[str, list[str]] = {}
    for name in ray.util.list_named_actors():  # this namespace's, as names
        group = name.split("/", 1)[0]
        if group == base or group.startswith(base + "#"):
            groups.setdefault(group, []).append(name)
    for group in sorted(groups, key=lambda g: (g != base, g)):
        shards = []
        for name in sorted(groups[group]):
            try:
                handle = ray.get_actor(name)
            except ValueError:  # ended meanwhile
                break
            shards.append(Shard(name.split("/", 1)[1] if "/" in name else "", handle))
        else:
            if shards:
                return PoolShards(tuple(shards))
    return None


# --------------------------------------------------------------------------- the client


def _here() -> tuple[str | None, str | None]:
    """This process's Ray node id and address (None, None outside Ray)."""
    try:
        import ray

        if not ray.is_initialized():
            return None, None
        return ray.get_runtime_context().get_node_id(), ray.util.get_node_ip_address()
    except Exception:  # no Ray here: no node to be near
        return None, None


@dataclass
class ShardedPool:
    """Every desktop of a run through one client: ``lease`` near the caller, ``release`` to
    the lease's shard, the rest to all shards. Built from a ``PoolShards`` or from one pool
    (a Ray handle or a ``DesktopPool``): one shard, every call straight to it.

    ``node_id`` and ``address`` say where the caller runs (default: this process's Ray
    node); tests pass them."""

    pool: Any
    node_id: str | None = None
    address: str | None = None
    _shards: PoolShards = field(init=False)
    _last_stats: dict[str, dict[str, Any]] = field(init=False, default_factory=dict)
    _cleanups: TaskSet = field(init=False, default_factory=TaskSet)

    def __post_init__(self) -> None:
        pool = self.pool
        if isinstance(pool, ShardedPool):
            pool = pool._shards
        self._shards = pool if isinstance(pool, PoolShards) else PoolShards(
            (Shard(pool.name if isinstance(pool, DesktopPool) else "", pool),))
        if self.node_id is None and self.address is None and len(self._shards.shards) > 1:
            self.node_id, self.address = _here()

    @classmethod
    def of(cls, pool: Any) -> ShardedPool:
        """``pool`` itself when it is a ``ShardedPool`` already, else one around it."""
        return pool if isinstance(pool, ShardedPool) else cls(pool)

    @property
    def shards(self) -> tuple[Shard, ...]:
        return self._shards.shards

    def _client(self, shard: Shard) -> PoolClient:
        return PoolClient(shard.target)

    # ----------------------------------------------------------------- leases

    def order(self, owner: str) -> list[Shard]:
        """The shards a lease of ``owner`` may come from, best first: those of the caller's
        node, then the others in the order of the runner's hash (each runner its own order,
        so fallbacks spread); shards whose desktops this host cannot reach are left out."""
        runner = owner.split("/", 1)[0]
        reachable = [s for s in self.shards
                     if s.host is None or self.address is None or s.host == self.address]
        reachable.sort(key=lambda s: _score(runner, s.name), reverse=True)
        if self._shards.by_node and self.node_id is not None:
            reachable.sort(key=lambda s: s.node_id != self.node_id)  # stable: own first
        return reachable

    async def lease(self, owner: str, timeout_s: float | None = None,
                    avoid: Iterable[str] = ()) -> Lease:
        """A desktop for ``owner`` within ``timeout_s`` (each shard's lease timeout when
        None), or ``DesktopUnavailable``. With several shards: the first shard of
        ``order`` if it has one free now; else every shard at once, the first grant taken
        (the earlier in ``order`` when several arrive together) and every other shard told
        to withdraw the owner's wait, which gives a grant it made meanwhile back unused:
        no desktop is lent twice or left lent to nobody, and no lease waits on one shard
        while another has a desktop free."""
        avoid = list(avoid)
        if len(self.shards) == 1:
            return await self._client(self.shards[0]).lease(owner, timeout_s, avoid)
        order = self.order(owner)
        if not order:
            raise DesktopUnavailable(
                f"no desktop pool shard's desktops are reachable from {self.address}: they "
                "are bound to loopback on other hosts (set desktops.local.host, "
                "container.publish_host or vm.bind_host to an address others reach)")
        started = time.monotonic()
        asked: dict[str, asyncio.Future[Lease]] = {}
        try:
            first = asyncio.ensure_future(self._client(order[0]).lease(owner, 0, avoid))
            asked[order[0].name] = first
            try:
                return await first
            except DesktopUnavailable:
                pass  # none free there now: every shard at once
            except Exception as exc:  # a dead shard: the others may still have one
                log.warning("desktop pool shard %s: %s", order[0].name, exc)
            left = (None if timeout_s is None
                    else max(0.0, timeout_s - (time.monotonic() - started)))
            asked = {s.name: asyncio.ensure_future(self._client(s).lease(owner, left, avoid))
                     for s in order}
            return await self._first_grant(owner, order, asked)
        except BaseException:  # cancelled, or a bug: nothing may stay lent to this owner
            self._withdraw_later(owner, [s for s in order if s.name in asked], asked)
            raise

    async def _first_grant(self, owner: str, order: list[Shard],
                           asked: dict[str, asyncio.Future[Lease]]) -> Lease:
        winner: Shard | None = None
        errors: list[tuple[Shard, BaseException]] = []
        pending: set[asyncio.Future[Lease]] = set(asked.values())
        while pending and winner is None:
            done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for shard in order:
                call = asked[shard.name]
                if call not in done:
                    continue
                exc = (DesktopUnavailable(f"shard {shard.name}: the lease call was cancelled")
                       if call.cancelled() else call.exception())
                if exc is not None:
                    errors.append((shard, exc))
                elif winner is None:
                    winner = shard
        if winner is None:
            unavailable = [e for _, e in errors if isinstance(e, DesktopUnavailable)]
            if not unavailable:
                raise errors[0][1]
            others = "; ".join(f"{s.name}: {e}" for s, e in errors
                               if not isinstance(e, DesktopUnavailable))
            raise DesktopUnavailable(
                f"no desktop free for {owner} in any of {len(order)} shards: "
                f"{unavailable[0]}" + (f" (and {others})" if others else ""))
        # Every other shard still waiting, or that granted too, gives the owner's up.
        losers = [s for s in order if s is not winner and (
            not asked[s.name].done()
            or (not asked[s.name].cancelled() and asked[s.name].exception() is None))]
        if losers:
            self._withdraw_later(owner, losers, asked)
        return asked[winner.name].result()

    def _withdraw_later(self, owner: str, shards: list[Shard],
                        asked: dict[str, asyncio.Future[Lease]]) -> None:
        if shards:
            self._cleanups.spawn(self._withdraw(owner, shards, asked))

    async def _withdraw(self, owner: str, shards: list[Shard],
                        asked: dict[str, asyncio.Future[Lease]]) -> None:
        """Tell ``shards`` that ``owner`` wants nothing more of them, then see their lease
        calls end. A shard that granted before the withdrawal arrived has taken that
        desktop back unused by then (its lease, if it still arrives here, is void); a call
        arriving after it is refused."""
        async def one(shard: Shard) -> None:
            try:
                await asyncio.wait_for(self._client(shard).withdraw(owner),
                                       _WITHDRAW_TIMEOUT_S)
            except Exception as exc:  # the shard reclaims it at lease_max_s at the latest
                log.error("withdrawing %s's lease from desktop pool shard %s failed: %s",
                          owner, shard.name, exc)
            call = asked.get(shard.name)
            if call is not None:
                # Seen to its end, so its answer (a void lease or a refusal) is not left
                # unread; an error here was already handled by the lease.
                await asyncio.wait([call], timeout=_WITHDRAW_TIMEOUT_S)
                if call.done() and not call.cancelled():
                    call.exception()

        await asyncio.gather(*(one(s) for s in shards))

    async def settle(self) -> None:
        """Wait until the withdrawals started by earlier leases are done (tests, shutdown)."""
        await self._cleanups.wait()

    def _shard_named(self, name: str) -> Shard:
        if len(self.shards) == 1:
            return self.shards[0]
        for shard in self.shards:
            if shard.name == name:
                return shard
        raise DesktopError(f"lease of unknown desktop pool shard {name!r} (shards: "
                           f"{', '.join(s.name for s in self.shards)})")

    async def release(self, lease: Lease, healthy: bool = True) -> None:
        """Give ``lease``'s desktop back to the shard that lent it."""
        await self._client(self._shard_named(lease.shard)).release(lease.lease_id, healthy)

    async def release_owned(self, owner_prefix: str, healthy: bool = True) -> int:
        """``DesktopPool.release_owned`` on every shard (a dead runner's leases may come
        from any, and a lease of it in transit must be refused by each); how many in all."""
        counts = await self._on_all(lambda c: c.release_owned(owner_prefix, healthy))
        return sum(counts)

    # ----------------------------------------------------------------- figures

    async def stats(self) -> dict[str, Any]:
        """The shards' figures summed (``aggregate_stats``): one call per shard, each O(1).
        A shard that does not answer counts with its last figures (so totals such as
        ``state_s`` never step back) and is named in ``shards_unanswered``."""
        if len(self.shards) == 1:
            return await self._client(self.shards[0]).stats()
        answers = await self._ask_all(lambda c: c.stats(), _SHARD_STATS_TIMEOUT_S)
        silent = []
        for shard, answer in zip(self.shards, answers, strict=True):
            if isinstance(answer, dict):
                self._last_stats[shard.name] = answer
            else:
                silent.append(shard.name)
        if not self._last_stats:
            first = next(a for a in answers if isinstance(a, BaseException))
            raise first
        return {**aggregate_stats(list(self._last_stats.values())),
                "shards": len(self.shards), "shards_unanswered": silent}

    async def describe(self) -> list[dict[str, Any]]:
        """Every shard's desktops (each row names its shard)."""
        rows = await self._on_all(lambda c: c.describe(), timeout_s=_SHARD_CALL_TIMEOUT_S)
        return [row for part in rows for row in part]

    # ----------------------------------------------------------------- operators

    async def _holder(self, desktop_id: str) -> Shard:
        if len(self.shards) == 1:
            return self.shards[0]
        rows = await self._ask_all(lambda c: c.describe(), _SHARD_CALL_TIMEOUT_S)
        for shard, part in zip(self.shards, rows, strict=True):
            if isinstance(part, list) and any(r.get("id") == desktop_id for r in part):
                return shard
        silent = [s.name for s, p in zip(self.shards, rows, strict=True)
                  if not isinstance(p, list)]
        raise DesktopError(f"no desktop {desktop_id} in the run's {len(self.shards)} pool "
                           "shards" + (f" (not answering: {', '.join(silent)})"
                                       if silent else ""))

    async def release_desktop(self, desktop_id: str) -> str:
        return await self._client(await self._holder(desktop_id)).release_desktop(desktop_id)

    async def quarantine(self, desktop_id: str) -> str:
        return await self._client(await self._holder(desktop_id)).quarantine(desktop_id)

    async def remove(self, desktop_id: str) -> str:
        return await self._client(await self._holder(desktop_id)).remove(desktop_id)

    async def _ask_all(self, call: Callable[[PoolClient], Awaitable[T]],
                       timeout_s: float | None = None) -> list[T | BaseException]:
        """``call`` on every shard at once; each answer or the error it raised."""
        async def one(shard: Shard) -> T:
            return await asyncio.wait_for(call(self._client(shard)), timeout_s)

        return await asyncio.gather(*(one(s) for s in self.shards), return_exceptions=True)

    async def _on_all(self, call: Callable[[PoolClient], Awaitable[T]],
                      timeout_s: float | None = None) -> list[T]:
        answers = await self._ask_all(call, timeout_s)
        for answer in answers:
            if isinstance(answer, BaseException):
                raise answer
        return answers  # type: ignore[return-value]


_SUMMED_STATES = ("starting", "free", "leased", "resetting", "quarantined")


def aggregate_stats(parts: list[dict[str, Any]]) -> dict[str, Any]:
    """Shards' ``DesktopPool.stats()`` as one pool's: counts, counters, ``missing`` and
    ``state_s`` summed; ``waiting`` the largest (a lease waiting on every shard at once is
    one wait, not one per shard); reset times the median of the shards' medians and the
    largest maximum (a shard's window is all that is kept); the first start error, named by
    its shard. O(shards)."""
    if len(parts) == 1:
        return dict(parts[0])
    out: dict[str, Any] = {}
    for part in parts:
        for key, value in part.items():
            if key in ("state_s",):
                totals = out.setdefault("state_s", {})
                for state, seconds in (value or {}).items():
                    totals[state] = round(totals.get(state, 0.0) + seconds, 3)
            elif isinstance(value, int | float) and not isinstance(value, bool) and key not in (
                    "waiting", "reset_s_median", "reset_s_max", "verify_s_median"):
                out[key] = out.get(key, 0) + value
    for state in _SUMMED_STATES:
        out.setdefault(state, 0)
    out["waiting"] = max(int(p.get("waiting", 0)) for p in parts)
    for key, pick in (("reset_s_median", statistics.median), ("reset_s_max", max),
                      ("verify_s_median", statistics.median)):
        values = [p[key] for p in parts if p.get(key) is not None]
        out[key] = pick(values) if values else None
    errors = [(p.get("shard") or "?", p["last_start_error"]) for p in parts
              if p.get("last_start_error")]
    out["last_start_error"] = f"shard {errors[0][0]}: {errors[0][1]}" if errors else None
    return out
