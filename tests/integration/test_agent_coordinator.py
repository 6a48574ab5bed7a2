"""The coordinator, runners, storage and desktop pool as real Ray actors on real local
desktops (the demo tasks, the scripted policy over HTTP): faults are injected while episodes
run, and a 2-node cluster from ray.cluster_utils spreads runners over both nodes."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import psutil
import pytest
import ray

from cua_rollout.agents.scripted_policy import ScriptedPolicy, load_solutions, scripted_server
from cua_rollout.config import Config, load_config
from cua_rollout.model.openai_server import OpenAIServer
from cua_rollout.runtime.launch import Actors, start_actors, stop_actors
from cua_rollout.runtime.loader import TaskLoader
from tests.doubles.fake_openai import FakeOpenAIServer
from tests.support import REPO_ROOT

ROOT = REPO_ROOT
DEMO = ROOT / "configs" / "demo.yaml"
SUITE = ROOT / "tasks" / "demo"

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def _ray_env() -> None:
    # Workers of clusters started here import the project from the repository.
    paths = [str(ROOT), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    os.environ["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))


@pytest.fixture(scope="module")
def local_ray() -> Iterator[None]:
    _ray_env()
    ray.init(num_cpus=4, include_dashboard=False, namespace="test-coordinator",
             logging_level="WARNING")
    try:
        yield
    finally:
        ray.shutdown()


def _config(tmp: Path, endpoint: str, task_ids: list[str], **overrides: Any) -> Config:
    sets = [
        f"run.output_dir={tmp / 'results'}",
        f"desktops.local.state_dir={tmp / 'desktops'}",
        f"tasks.source={SUITE / 'test_all.json'}",
        f"tasks.task_ids={json.dumps(task_ids)}",
        "tasks.rollouts_per_task=1",
        "model.scripted=false",
        f"model.endpoints={json.dumps([endpoint])}",
        "model.retries=1",
        "monitoring.metrics_interval_s=1",
        *(f"{k}={v}" for k, v in overrides.items()),
    ]
    return load_config(DEMO, sets)


@contextmanager
def _rollout(cfg: Config) -> Iterator[tuple[Actors, TaskLoader]]:
    run_dir = cfg.run_dir
    actors, _ = start_actors(cfg, run_dir, None, {"run": cfg.run.name})
    try:
        yield actors, TaskLoader(cfg.tasks, run_dir)
    finally:
        stop_actors(actors, "finished", None)


def _scripted(latency_s: float = 0.0) -> OpenAIServer:
    policy = ScriptedPolicy(load_solutions([SUITE]), screen=(1280, 720))
    return scripted_server(policy, latency_s=latency_s)


def _wait(actors: Actors, timeout_s: float = 240) -> dict[str, Any]:
    assert ray.get(actors.coordinator.wait_idle.remote(timeout_s)), "episodes did not finish"
    return ray.get(actors.coordinator.stats.remote())


def _until(predicate: Any, timeout_s: float, what: str) -> Any:
    deadline = time.monotonic() + timeout_s
    while not (value := predicate()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)
    return value


def _results(cfg: Config) -> list[dict[str, Any]]:
    path = cfg.run_dir / "results.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


def _traj(cfg: Config, episode_id: str) -> list[dict[str, Any]]:
    path = cfg.run_dir / episode_id / "traj.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines()]




def test_a_killed_runner_is_replaced_and_its_episodes_complete(local_ray, tmp):
    with _scripted(latency_s=0.4) as model:
        cfg = _config(tmp, model.url, ["calc-add", "editor-replace-all"],
                      **{"coordinator.episodes_per_runner": 2})
        with _rollout(cfg) as (actors, loader):
            ray.get(actors.coordinator.submit.remote(loader.poll()))
            _until(lambda: ray.get(actors.coordinator.stats.remote()).get("steps", 0) >= 2,
                   60, "the first steps")
            [runner] = ray.get(actors.coordinator.runner_handles.remote())
            ray.kill(runner, no_restart=True)
            stats = _wait(actors)
    results = _results(cfg)
    assert sorted(r["task_id"] for r in results) == ["calc-add", "editor-replace-all"]
    assert {r["status"] for r in results} == {"success"}
    assert {r["attempt"] for r in results} == {1}
    assert stats["runners_replaced"] == 1 and stats["retries"] == 2
    for r in results:
        steps = _traj(cfg, r["episode_id"])
        # The restarted attempt's files only: steps 1..n once, the last one carrying the reward.
        assert [s["step_num"] for s in steps] == list(range(1, r["steps"] + 1))
        assert steps[-1]["done"] and steps[-1]["reward"] == 1.0


def test_a_killed_desktop_server_is_an_infra_error_retried_on_another_desktop(local_ray, tmp):
    with _scripted(latency_s=0.4) as model:
        cfg = _config(tmp, model.url, ["editor-replace-all"],
                      **{"desktops.retries": 0, "desktops.request_timeout_s": 5})
        with _rollout(cfg) as (actors, loader):
            ray.get(actors.coordinator.submit.remote(loader.poll()))

            def leased() -> dict[str, Any] | None:
                [shard] = actors.pool.shards  # one node: one pool shard, as before shards
                stats = ray.get(shard.target.stats.remote(detail=True))
                busy = [d for d in stats["desktops"] if d["state"] == "leased"]
                steps = ray.get(actors.coordinator.stats.remote()).get("steps", 0)
                return busy[0] if busy and steps >= 1 else None

            desktop = _until(leased, 60, "a leased desktop")
            port = int(desktop["url"].rsplit(":", 1)[1])
            [server] = [c.pid for c in psutil.net_connections("tcp")
                        if c.laddr and c.laddr.port == port and c.status == psutil.CONN_LISTEN]
            psutil.Process(server).kill()  # the desktop's own server: started by this test
            _wait(actors)
            pool = ray.get(actors.pool.shards[0].target.stats.remote())
    [result] = _results(cfg)
    assert result["status"] == "success" and result["attempt"] == 1
    assert result["desktops_tried"][0] == desktop["id"]
    assert result["desktop"] != desktop["id"]
    assert pool["reset_failures"] + pool["quarantined"] >= 1


def test_a_model_replying_garbage_takes_the_parse_failure_path(local_ray, tmp):
    with FakeOpenAIServer(reply=lambda body: "I would rather not use your format.") as model:
        cfg = _config(tmp, model.url, ["terminal-hello-file", "terminal-wifi-infeasible"],
                      **{"agent.max_parse_retries": 2})
        with _rollout(cfg) as (actors, loader):
            ray.get(actors.coordinator.submit.remote(loader.poll()))
            _wait(actors)
    results = {r["task_id"]: r for r in _results(cfg)}
    for r in results.values():
        assert r["parse_failures"] == 3 and r["last_action"] == "FAIL" and r["steps"] == 1
        [step] = _traj(cfg, r["episode_id"])
        assert step["action"] == "FAIL" and step["parse_retries"] == 2 and step["done"]
    # Giving up is what the UI-TARS agents do: it fails a feasible task and, as OSWorld
    # scores it, solves an infeasible one.
    assert results["terminal-hello-file"]["status"] == "failure"
    assert results["terminal-hello-file"]["reward"] == 0.0
    assert results["terminal-wifi-infeasible"]["status"] == "success"


def test_max_steps_and_the_episode_deadline_end_episodes_that_are_still_scored(local_ray,
                                                                                tmp):
    with _scripted(latency_s=0.5) as model:
        cfg = _config(tmp / "steps", model.url, ["calc-add"], **{"runner.max_steps": 2})
        with _rollout(cfg) as (actors, loader):
            ray.get(actors.coordinator.submit.remote(loader.poll()))
            _wait(actors)
        [capped] = _results(cfg)
        cfg = _config(tmp / "deadline", model.url, ["editor-replace-all"],
                      **{"runner.episode_timeout_s": 4})
        with _rollout(cfg) as (actors, loader):
            ray.get(actors.coordinator.submit.remote(loader.poll()))
            _wait(actors)
        [late] = _results(cfg)
    assert capped["status"] == "max_steps" and capped["steps"] == 2
    assert capped["reward"] == 0.0 and capped["last_action"] is None  # evaluated: unsolved
    assert late["status"] == "timeout" and 1 <= late["steps"] < 9 and late["reward"] == 0.0
    assert "deadline" in late["error"]
    # One line per counted step, a step cut short by the deadline included (its action may
    # have run), the last one with the reward.
    steps = _traj(cfg, late["episode_id"])
    assert [s["step_num"] for s in steps] == list(range(1, late["steps"] + 1))
    assert steps[-1]["done"] and steps[-1]["reward"] == 0.0


def test_drain_lets_running_episodes_finish_and_leaves_the_queue(local_ray, tmp):
    tasks = ["terminal-hello-file", "terminal-make-dirs", "terminal-count-lines",
             "terminal-save-code"]
    with _scripted(latency_s=0.3) as model:
        cfg = _config(tmp, model.url, tasks)
        with _rollout(cfg) as (actors, loader):
            ray.get(actors.coordinator.submit.remote(loader.poll()))
            _until(lambda: ray.get(actors.coordinator.stats.remote())["episodes_in_flight"] == 2,
                   60, "two running episodes")
            # No timeout given: drain must return once the running ones end, although two
            # episodes are still queued.
            stats = ray.get(actors.coordinator.drain.remote(), timeout=120)
    assert stats["episodes_in_flight"] == 0 and stats["episodes_queued"] == 2
    assert len(_results(cfg)) == 2


def test_batch_schedule_starts_the_next_batch_only_after_the_whole_batch(local_ray, tmp):
    with _scripted() as model:
        cfg = _config(tmp, model.url, ["terminal-hello-file", "calc-add", "terminal-make-dirs",
                                       "terminal-save-code"],
                      **{"coordinator.schedule": "batch"})
        with _rollout(cfg) as (actors, loader):
            ray.get(actors.coordinator.submit.remote(loader.poll()))
            _wait(actors)
    results = sorted(_results(cfg), key=lambda r: r["started_at"])
    assert len(results) == 4 and {r["status"] for r in results} == {"success"}
    first, second = results[:2], results[2:]
    # No episode of the second batch starts before the slow one of the first has ended.
    assert min(r["started_at"] for r in second) >= max(r["ended_at"] for r in first) - 0.05


def test_metrics_reach_the_prometheus_endpoint_and_metrics_jsonl(local_ray, tmp):
    import httpx

    with _scripted() as model:
        cfg = _config(tmp, model.url, ["terminal-hello-file"])
        with _rollout(cfg) as (actors, loader):
            ray.get(actors.coordinator.submit.remote(loader.poll()))
            _wait(actors)
            time.sleep(1.5)  # at least one metrics.jsonl sample after the episode
    port = ray._private.worker.global_worker.node.metrics_export_port
    wanted = {"ray_rollout_steps_total", "ray_rollout_episodes_total",
              "ray_rollout_step_model_seconds_count", "ray_rollout_step_env_seconds_count",
              "ray_rollout_desktops", "ray_rollout_episodes_in_flight",
              "ray_rollout_success_rate"}

    def exported() -> bool:
        text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
        names = {line.split("{")[0].split(" ")[0] for line in text.splitlines()
                 if line.startswith("ray_rollout_")}
        return wanted <= names

    _until(exported, 60, "the rollout_ metrics on the Prometheus endpoint")
    samples = [json.loads(x) for x in (cfg.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert samples[-1]["episodes_done"] == 1 and samples[-1]["steps"] >= 2
    assert set(samples[-1]["desktops"]) == {"free", "leased", "resetting", "quarantined",
                                            "starting"}


def test_runners_the_cluster_cannot_schedule_are_a_clear_error_at_start(local_ray, tmp):
    """Review M6: 64 runners of 0.25 CPU on a 4-CPU cluster would stay pending with no
    error; the coordinator refuses at start and names the keys to change."""
    import asyncio

    from cua_rollout.core.errors import ConfigError
    from cua_rollout.runtime.coordinator import AgentCoordinator

    cfg = _config(tmp, "http://127.0.0.1:9", ["calc-add"],
                  **{"coordinator.max_concurrent_episodes": 512,
                     "coordinator.episodes_per_runner": 8})
    coordinator = AgentCoordinator(cfg, None, None, use_ray=True)
    with pytest.raises(ConfigError, match=r"64 runners .* reserve 16 CPUs .* cluster has 4"):
        asyncio.run(coordinator.start())


def test_runners_spread_over_a_two_node_cluster(tmp):
    # Last in the module on purpose: it shuts down the module's local_ray.
    from ray.cluster_utils import Cluster

    if ray.is_initialized():
        ray.shutdown()
    _ray_env()
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2})
    try:
        cluster.add_node(num_cpus=2)
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, namespace="test-cluster", logging_level="WARNING")
        with _scripted() as model:
            cfg = _config(tmp, model.url, ["terminal-hello-file", "terminal-make-dirs",
                                           "terminal-count-lines", "calc-divide-keyboard"],
                          **{"coordinator.episodes_per_runner": 1,
                             "coordinator.runner_num_cpus": 1})
            with _rollout(cfg) as (actors, loader):
                ray.get(actors.coordinator.submit.remote(loader.poll()))
                _wait(actors)
        results = _results(cfg)
        assert len(results) == 4 and {r["status"] for r in results} == {"success"}
        nodes = {r["node"] for r in results}
        assert nodes == {n["NodeID"] for n in ray.nodes() if n["Alive"]}, nodes
    finally:
        ray.shutdown()
        cluster.shutdown()
