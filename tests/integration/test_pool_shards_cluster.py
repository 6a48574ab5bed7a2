"""A sharded desktop pool on a real two-node Ray cluster (``ray.cluster_utils.Cluster``: two
raylets on this machine, each a node with its own id): local desktops get a pool shard on
each node in proportion to its CPUs, runners are placed in the same proportion, every
episode's desktop came from the shard of its runner's own node, and the run records each
episode exactly once."""

from __future__ import annotations

import asyncio
import json
import os
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import ray

from cua_rollout.agents.scripted_policy import ScriptedPolicy, load_solutions, scripted_server
from cua_rollout.config import load_config
from cua_rollout.runtime.launch import start_actors, stop_actors
from cua_rollout.runtime.loader import TaskLoader
from cua_rollout.runtime.pool_shards import ShardedPool, find_run_shards
from tests.support import REPO_ROOT

pytestmark = [pytest.mark.integration, pytest.mark.slow]

DEMO = REPO_ROOT / "configs" / "demo.yaml"
SUITE = REPO_ROOT / "tasks" / "demo"
TASKS = ["terminal-hello-file", "terminal-make-dirs", "calc-add", "editor-save-new-file"]
ROLLOUTS = 2
RUN_TIMEOUT_S = 300


@pytest.fixture
def two_nodes() -> Any:
    from ray.cluster_utils import Cluster

    if ray.is_initialized():
        ray.shutdown()
    # Workers import the project from this checkout.
    paths = [str(REPO_ROOT), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    os.environ["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2})
    try:
        cluster.add_node(num_cpus=4)
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, namespace="test-pool-shards",
                 logging_level="WARNING")
        yield cluster
    finally:
        ray.shutdown()
        cluster.shutdown()


def _results(run_dir: Path) -> list[dict[str, Any]]:
    path = run_dir / "results.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


def test_local_desktops_are_sharded_per_node_and_leased_by_that_nodes_runners(two_nodes, tmp):
    policy = ScriptedPolicy(load_solutions([SUITE]), screen=(1280, 720))
    with scripted_server(policy) as model:
        # Eight desktops over 2 + 4 CPUs: 3 on the head, 5 on the worker; four runners in
        # the same proportion: 1 and 3. A router that ignored nodes would give all four
        # runners their first desktop from their own node by chance once in 16.
        cfg = load_config(DEMO, [
            f"run.output_dir={tmp / 'results'}", "run.name=shards",
            f"desktops.local.state_dir={tmp / 'desktops'}",
            "desktops.count=4", "desktops.warm_spares=4",
            f"tasks.source={SUITE / 'test_all.json'}", f"tasks.task_ids={json.dumps(TASKS)}",
            f"tasks.rollouts_per_task={ROLLOUTS}",
            "model.scripted=false", f"model.endpoints={json.dumps([model.url])}",
            "coordinator.max_concurrent_episodes=4", "coordinator.episodes_per_runner=1",
            "coordinator.runner_num_cpus=0.5", "monitoring.metrics_interval_s=1",
        ])
        actors, _ = start_actors(cfg, cfg.run_dir, None, {"run": cfg.run.name})
        try:
            pool = actors.pool
            assert pool is not None and pool.by_node
            nodes = {n["NodeID"] for n in ray.nodes() if n["Alive"]}
            assert {s.node_id for s in pool.shards} == nodes and len(pool.shards) == 2
            cpus = {n["NodeID"]: n["Resources"]["CPU"] for n in ray.nodes() if n["Alive"]}
            assert {cpus[s.node_id]: s.desktops for s in pool.shards} == {2: 3, 4: 5}
            # Each shard actor runs on its node, under the run's name, found as the tool does.
            names = sorted(n for n in ray.util.list_named_actors()
                           if n.startswith("desktops:shards"))
            assert names == sorted(f"desktops:shards/{s.name}" for s in pool.shards)
            found = find_run_shards("shards")
            assert found is not None
            assert sorted(s.name for s in found.shards) == sorted(s.name for s in pool.shards)
            specs = TaskLoader(cfg.tasks, cfg.run_dir).poll()
            assert len(specs) == len(TASKS) * ROLLOUTS
            ray.get(actors.coordinator.submit.remote(specs))
            assert ray.get(actors.coordinator.wait_idle.remote(RUN_TIMEOUT_S)), "not finished"
            client = ShardedPool(pool)
            rows = asyncio.run(client.describe())
            per_shard = {s.name: ray.get(s.target.stats.remote()) for s in pool.shards}
            total = asyncio.run(client.stats())
        finally:
            stop_actors(actors, "finished", None)
    results = _results(cfg.run_dir)
    ids = [r["episode_id"] for r in results]
    assert sorted(ids) == sorted(s.episode_id for s in specs), ids  # each exactly once
    assert {r["status"] for r in results} == {"success"}, [
        (r["episode_id"], r["status"], r.get("error")) for r in results]
    # Runners were placed with the desktops (not spread evenly): 1 on the head, 3 beside.
    runners_by_node = Counter(node for node in {r["runner"]: r["node"]
                                                for r in results}.values())
    assert {cpus[n]: k for n, k in runners_by_node.items()} == {2: 1, 4: 3}, runners_by_node
    # A runner's first lease came from its own node's shard: all desktops are free then,
    # and each node has at least as many as its runners. Later ones may come from the other
    # node's shard when a runner's own has none free (its desktops leased or resetting).
    # A local desktop's id names its pool shard's process (local-<pid>-<index>): the shard
    # of a desktop replaced since (a reset check failing under load) is still known.
    shard_of_pid = {row["id"].split("-")[1]: row["shard"] for row in rows}
    assert len(set(shard_of_pid.values())) == 2

    def shard_of(desktop: str) -> str:
        return shard_of_pid[desktop.split("-")[1]]

    node_of = {s.name: s.node_id for s in pool.shards}
    firsts = {}
    for r in sorted(results, key=lambda r: r["started_at"]):
        firsts.setdefault(r["runner"], r)
    assert len(firsts) == 4
    for r in firsts.values():
        assert node_of[shard_of(r["desktop"])] == r["node"], r
    # Each shard lent exactly the desktops its episodes' attempts ran on: no grant lost or
    # doubled (a grant withdrawn from a shard that was not needed is no lease). An attempt
    # retried under load leases again; each attempt's desktop is in desktops_tried.
    assert total["leases"] == sum(r["attempt"] + 1 for r in results)
    if all(len(r["desktops_tried"]) == r["attempt"] + 1 for r in results):
        lent = Counter(shard_of(d) for r in results for d in r["desktops_tried"])
        assert {name: stats["leases"] for name, stats in per_shard.items()} == {
            name: lent[name] for name in per_shard}
    assert total["shards"] == 2
    assert total["leased"] == 0
