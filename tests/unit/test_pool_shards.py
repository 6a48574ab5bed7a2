"""The desktop pool's shard plan (cua_rollout/runtime/pool_shards.py): which nodes get a
shard and how many desktops, disjoint desktop indices, hash shards stable across processes,
the default shard count, runner placement in proportion, and the shards' figures summed."""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
from collections import Counter

import pytest
from pydantic import ValidationError

from cua_rollout.config import DesktopsConfig
from cua_rollout.core.errors import DesktopError
from cua_rollout.runtime.pool import Share
from cua_rollout.runtime.pool_shards import (
    DESKTOPS_PER_HASH_SHARD,
    NodeInfo,
    PoolShards,
    Shard,
    aggregate_stats,
    default_hash_shards,
    next_runner_node,
    plan_shards,
    shard_of,
)
from tests.support import REPO_ROOT

A = NodeInfo("a" * 56, "10.0.0.1", 2.0)
B = NodeInfo("b" * 56, "10.0.0.2", 6.0)
HEAD = NodeInfo("c" * 56, "10.0.0.3", 0.0)   # a head that runs no desktops (num-cpus 0)


def _first_indices(share: Share, n: int) -> list[int]:
    return list(itertools.islice(share.index_order(), n))


def test_node_shards_split_desktops_in_proportion_to_cpus_with_disjoint_indices():
    cfg = DesktopsConfig(provider="local", count=7, warm_spares=1)
    plans = plan_shards(cfg, [HEAD, B, A], home=HEAD)
    assert [(p.node, p.desktops) for p in plans] == [(A, 2), (B, 6)]  # 2 : 6 CPUs, none on HEAD
    assert all(p.name == f"node-{p.node.node_id[:12]}" for p in plans)
    # Loopback desktops: only runners of the same host reach them.
    assert [p.host for p in plans] == ["10.0.0.1", "10.0.0.2"]
    # First desktops and every later one (replacements): no index in two shards.
    seen = [set(_first_indices(p.share, 200)) for p in plans]
    assert not seen[0] & seen[1]
    assert len({i for p in plans for i in p.share.indices}) == 8


def test_a_node_whose_share_rounds_to_nothing_gets_no_shard():
    cfg = DesktopsConfig(provider="container", count=1, warm_spares=0,
                         container={"publish_host": "10.0.0.9"}, token_env="TOKEN")
    plans = plan_shards(cfg, [A, NodeInfo("d" * 56, "10.0.0.4", 2.0)], home=A)
    assert len(plans) == 1 and plans[0].desktops == 1
    assert plans[0].host is None  # published on a network address: any host reaches them


@pytest.mark.parametrize("nodes, pinned", [([A], None), ([A, B, HEAD], HEAD)])
def test_one_node_or_desktops_node_is_one_shard_with_every_desktop_as_before(nodes, pinned):
    cfg = DesktopsConfig(provider="vm", count=3, warm_spares=2, vm={"image": "/x.qcow2"})
    [plan] = plan_shards(cfg, nodes, home=A, pinned=pinned)
    assert plan.node == (pinned or A)
    # Exactly the indices an unsharded pool starts, replacements included.
    assert _first_indices(plan.share, 50) == _first_indices(Share.whole(cfg), 50)


def test_no_node_with_cpus_is_a_clear_error():
    with pytest.raises(DesktopError, match="no live Ray node has CPUs"):
        plan_shards(DesktopsConfig(provider="local"), [HEAD], home=HEAD)


def test_hash_shards_hold_each_static_desktop_once_on_the_drivers_node():
    urls = [f"http://10.1.0.{i}:5000" for i in range(40)]
    cfg = DesktopsConfig(provider="static", count=40, warm_spares=0, shards=3,
                         static={"urls": urls})
    plans = plan_shards(cfg, [A, B], home=A)
    assert {p.node for p in plans} == {A} and len(plans) == 3
    owned = sorted(i for p in plans for i in p.share.indices)
    assert owned == list(range(40))
    for p in plans:
        k = int(p.name.removeprefix("hash-"))
        assert all(shard_of(urls[i], 3) == k for i in p.share.indices)
    # Kubernetes replacements (later indices) never collide between shards either.
    kube = DesktopsConfig(provider="kubernetes", count=30, warm_spares=2, shards=4,
                          kubernetes={"image": "img"})
    later = [set(_first_indices(p.share, 300)) for p in plan_shards(kube, [A], home=A)]
    assert all(not x & y for x, y in itertools.combinations(later, 2))


def test_the_hash_is_the_same_in_every_process_and_moves_little_when_shards_grow():
    keys = [f"http://10.2.0.{i}:5000" for i in range(300)]
    here = [shard_of(k, 5) for k in keys]
    code = ("import sys, json; from cua_rollout.runtime.pool_shards import shard_of; "
            "print(json.dumps([shard_of(k, 5) for k in json.load(sys.stdin)]))")
    import json
    for seed in ("1", "2"):  # Python's own str hash differs between these
        out = subprocess.run([sys.executable, "-c", code], input=json.dumps(keys), text=True,
                             capture_output=True, check=True, cwd=REPO_ROOT,
                             env={**os.environ, "PYTHONHASHSEED": seed,
                                  "PYTHONPATH": str(REPO_ROOT)})
        assert json.loads(out.stdout) == here
    assert set(here) == set(range(5))
    # Rendezvous: a sixth shard takes keys only for itself.
    six = [shard_of(k, 6) for k in keys]
    assert all(new in (old, 5) for old, new in zip(here, six, strict=True))
    assert 0 < six.count(5) < len(keys) / 3


def test_the_default_shard_count_gives_small_runs_one_shard():
    assert default_hash_shards(1) == default_hash_shards(DESKTOPS_PER_HASH_SHARD) == 1
    assert default_hash_shards(DESKTOPS_PER_HASH_SHARD + 1) == 2
    assert default_hash_shards(10_000) == 5
    cfg = DesktopsConfig(provider="kubernetes", count=4096, warm_spares=0,
                         kubernetes={"image": "img"})
    assert len(plan_shards(cfg, [A], home=A)) == 3


@pytest.mark.parametrize("settings, error", [
    ({"provider": "local", "shards": 2}, "desktops.shards is for static, kubernetes and remote"),
    ({"provider": "static", "shards": 3, "count": 5, "static": {"urls": ["http://a:1",
                                                                          "http://b:1"]}},
     "desktops.shards 3 is more than the run's 2 desktops"),
    ({"provider": "kubernetes", "shards": 0, "kubernetes": {"image": "i"}},
     "greater than or equal to 1"),
])
def test_the_shards_setting_is_checked(settings, error):
    with pytest.raises(ValidationError, match=error):
        DesktopsConfig(**settings)


def test_runners_go_to_nodes_in_proportion_to_their_desktops():
    desktops = {"a": 3, "b": 1}
    placed: Counter[str] = Counter()
    order = []
    for _ in range(8):
        node = next_runner_node(desktops, placed)
        placed[node] += 1
        order.append(node)
    assert Counter(order[:4]) == {"a": 3, "b": 1} and placed == {"a": 6, "b": 2}


def test_shard_figures_sum_to_one_pools():
    a = {"shard": "node-a", "free": 2, "leased": 1, "resetting": 0, "quarantined": 0,
         "starting": 0, "waiting": 3, "missing": 0, "leases": 10, "resets": 9,
         "state_s": {"free": 5.0, "leased": 1.5}, "reset_s_median": 0.2, "reset_s_max": 0.9,
         "verify_s_median": None, "last_start_error": None}
    b = {**a, "shard": "node-b", "free": 1, "leased": 4, "waiting": 1, "missing": 1,
         "leases": 5, "state_s": {"free": 1.0, "resetting": 2.0}, "reset_s_median": 0.4,
         "reset_s_max": 0.5, "last_start_error": "Xvfb did not start"}
    out = aggregate_stats([a, b])
    assert (out["free"], out["leased"], out["missing"], out["leases"]) == (3, 5, 1, 15)
    assert out["state_s"] == {"free": 6.0, "leased": 1.5, "resetting": 2.0}
    assert out["waiting"] == 3  # one lease waits on every shard at once: the most, not the sum
    assert out["reset_s_max"] == 0.9 and out["reset_s_median"] == pytest.approx(0.3)
    assert out["last_start_error"] == "shard node-b: Xvfb did not start"
    assert aggregate_stats([a]) == a


def test_runners_follow_node_shards_only_when_there_are_several():
    node_shards = PoolShards((Shard("node-a", None, "a", None, 3),
                              Shard("node-b", None, "b", None, 1)), by_node=True)
    assert node_shards.desktops_by_node() == {"a": 3, "b": 1}
    # One shard (desktops.node, maybe a node without CPUs) or hash shards: runners spread.
    assert PoolShards((Shard("node-a", None, "a", None, 3),), by_node=True
                      ).desktops_by_node() == {}
    assert PoolShards((Shard("hash-0", None, "a"), Shard("hash-1", None, "a"))
                      ).desktops_by_node() == {}
