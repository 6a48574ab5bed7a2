"""Each utilization figure of metrics.jsonl checked against a run whose timings are known:
the real ``run.py`` (its own Ray, the real coordinator, runners, pool and storage) on the
benchmark's simulated world with fixed latencies (benchmarks/sim_world.py), every step the
same: model 0.5 s, action 0.25 s, pause 0.15 s, screenshot 0.1 s."""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from benchmarks.bench_rollout import sim_sets
from benchmarks.sim_world import DesktopSim, EpisodeLengths, Latency, ModelSim, SimWorld
from cua_rollout.config import load_config
from tests.support import REPO_ROOT

pytestmark = [pytest.mark.integration, pytest.mark.slow]

K = 4                 # episodes in flight
SPARES = 2            # desktops beyond K: 6 in all
STEPS = 8             # model calls per episode: 7 actions, then finished()
MODEL_S, ACTION_S, PAUSE_S, SHOT_S = 0.5, 0.25, 0.15, 0.1
TOKENS = 40           # completion tokens of every reply
TASKS = 16            # ~30 s of steady state at K=4
INTERVAL_S = 2.0      # monitoring.metrics_interval_s


@pytest.fixture
def world():
    lengths = EpisodeLengths(median_steps=STEPS, sigma=0.0, tail_fraction=0.0,
                             min_steps=STEPS, max_steps=STEPS)
    sim = SimWorld(
        desktops=K + SPARES, model_servers=2,
        desktop=DesktopSim(action_latency=Latency(ACTION_S), reset_latency=Latency(0.3),
                           setup_latency=Latency(0.0), screenshot_latency=Latency(SHOT_S),
                           screen_width=1280, screen_height=720, screenshots=4,
                           rich_screenshots=False),
        model=ModelSim(base_latency_s=MODEL_S, per_token_s=0.0, prefill_s_per_1k_tokens=0.0,
                       capacity=10**6, output_tokens_mean=TOKENS, output_tokens_jitter=0,
                       lengths=lengths, screen_width=1280, screen_height=720),
    )
    with sim:
        yield sim


def _mean(samples: list[dict[str, Any]], *path: str) -> float:
    values = []
    for s in samples:
        v: Any = s
        for key in path:
            v = v[key]
        values.append(float(v))
    return sum(values) / len(values)


def test_utilization_figures_match_the_simulated_timings(tmp: Path, world: SimWorld):
    tasks = tmp / "tasks.jsonl"
    tasks.write_text("".join(
        json.dumps({"id": f"t{i}", "domain": "sim", "instruction": f"sim task {i}",
                    "config": [], "evaluator": {"func": "infeasible"}}) + "\n"
        for i in range(TASKS)))
    run_dir = tmp / "results" / "util"
    sets = sim_sets(run_dir, tasks, world.desktop_urls, world.reset_command,
                     world.model_urls, world.model.model, concurrency=K, spares=SPARES,
                     per_runner=K, schedule="rollout", max_steps=STEPS + 2, history_images=1,
                     action_pause_s=PAUSE_S)
    sets += ["tasks.rollouts_per_task=1", f"monitoring.metrics_interval_s={INTERVAL_S}",
             "ray.include_dashboard=false", "ray.num_cpus=2",
             "desktops.screen_width=1280", "desktops.screen_height=720",
             # The run's summary and curves to MLflow at its end (a local SQLite store).
             "monitoring.tracker=mlflow", f"monitoring.tracker_uri=sqlite:///{tmp}/mlflow.db"]
    cfg = load_config(None, sets)
    config = tmp / "util.yaml"
    config.write_text(yaml.safe_dump(cfg.model_dump(mode="json", exclude_unset=True)))
    done = subprocess.run([sys.executable, str(REPO_ROOT / "run.py"), "--config", str(config)],
                          cwd=REPO_ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(REPO_ROOT)})
    assert done.returncode == 0, done.stderr[-3000:]

    samples = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    # Steady state: every slot busy and episodes still queued for the whole interval (the
    # sample before it also had a queue), so the interval holds no start-up and no tail.
    steady = [s for prev, s in itertools.pairwise(samples)
              if (s.get("utilization") or {}).get("desktop") and s["episodes_in_flight"] == K
              and s["episodes_queued"] > 0 and prev["episodes_queued"] > 0
              and prev["episodes_in_flight"] == K]
    assert len(steady) >= 3, [(s["elapsed_s"], s["episodes_in_flight"], s["episodes_queued"])
                              for s in samples]

    # What the figures should be, from the simulated latencies placed where the run put
    # each step (its traj line: start, whether it acted): the steady windows' union.
    t0 = steady[0]["t"] - steady[0]["utilization"]["window_s"]
    t1 = steady[-1]["t"]
    window = t1 - t0
    assert sum(s["utilization"]["window_s"] for s in steady) == pytest.approx(window, abs=0.1)
    steps = [json.loads(x) for f in run_dir.rglob("traj.jsonl")
             for x in f.read_text().splitlines()]
    phase_s = dict.fromkeys(("model_wait", "action", "pause", "screenshot"), 0.0)
    ended = {"steps": 0, "actions": 0}
    for step in steps:
        start, acted = step["timing"]["started_at"], step["timing"]["action_s"] > 0
        segments = [("model_wait", MODEL_S)] + (
            [("action", ACTION_S), ("pause", PAUSE_S), ("screenshot", SHOT_S)] if acted else [])
        for phase, seconds in segments:
            phase_s[phase] += max(0.0, min(t1, start + seconds) - max(t0, start))
            start += seconds
        if t0 < step["timing"]["started_at"] + step["timing"]["step_s"] <= t1:
            ended["steps"] += 1
            ended["actions"] += acted

    # The mean step of the steps that ended in the windows.
    by_step = {"model": MODEL_S, "action": ACTION_S * ended["actions"] / ended["steps"],
               "pause": PAUSE_S * ended["actions"] / ended["steps"],
               "screenshot": SHOT_S * ended["actions"] / ended["steps"]}
    measured_steps = sum(s["utilization"]["step_s"]["steps"] for s in steady)
    assert measured_steps == pytest.approx(ended["steps"], abs=K)
    for phase, seconds in by_step.items():
        mean = sum(s["utilization"]["step_s"][phase] * s["utilization"]["step_s"]["steps"]
                   for s in steady) / measured_steps
        assert mean == pytest.approx(seconds, abs=0.02 + 0.1 * seconds), phase
    actions_per_min = sum(s["utilization"]["actions_per_min"] * s["utilization"]["window_s"]
                          for s in steady) / window
    assert actions_per_min == pytest.approx(60 * ended["actions"] / window, rel=0.1)

    # The desktops' time: K of the K + SPARES desktops leased (the spares absorb resets);
    # within the lease, model, acting (action + screenshot) and pause as simulated.
    desktops = K + SPARES
    assert _mean(steady, "utilization", "desktops") == pytest.approx(desktops, abs=0.05)
    assert _mean(steady, "utilization", "desktop", "leased") == pytest.approx(
        K / desktops, abs=0.04)
    expected = {"model_wait": phase_s["model_wait"],
                "acting": phase_s["action"] + phase_s["screenshot"],
                "pause": phase_s["pause"]}
    for state, seconds in expected.items():
        assert _mean(steady, "utilization", "desktop", state) == pytest.approx(
            seconds / (desktops * window), abs=0.02), state
    for s in steady:
        split = s["utilization"]["desktop"]
        assert split["leased"] + split["resetting"] + split["idle"] == pytest.approx(1, abs=0.01)
        assert sum(split[k] for k in ("acting", "model_wait", "pause", "other")) == \
            pytest.approx(split["leased"], abs=0.01)

    # The model servers, from their vLLM /metrics: every reply is TOKENS tokens, K episodes
    # ask once per step; both servers answer.
    steps_per_s = ended["steps"] / window
    servers = [s["model_servers"]["summary"] for s in steady]
    assert all(x["endpoints_up"] == x["endpoints"] == 2 for x in servers)
    # (the first scrape of a server has no rate yet: no interval)
    rates = [x["generation_tokens_per_s"] for x in servers
             if x["generation_tokens_per_s"] is not None]
    assert len(rates) >= len(servers) - 1
    tokens = sum(rates) / len(rates)
    assert tokens == pytest.approx(TOKENS * steps_per_s, rel=0.15)
    assert all(0 <= x["running"] <= K and x["waiting"] == 0 for x in servers)
    inference = [x["mean_inference_time_s"] for x in servers if x["mean_inference_time_s"]]
    assert inference and sum(inference) / len(inference) == pytest.approx(MODEL_S, abs=0.02)
    assert all(s["fleet"] is None for s in steady)  # fixed endpoints: no fleet to report

    # Every step's traj line carries the split the figures were made from.
    traj = [json.loads(x) for x in next(run_dir.rglob("traj.jsonl")).read_text().splitlines()]
    assert traj[0]["timing"]["action_s"] == pytest.approx(ACTION_S, abs=0.1)
    assert traj[0]["timing"]["pause_s"] == pytest.approx(PAUSE_S, abs=0.05)
    assert traj[-1]["timing"]["action_s"] == 0.0 and "started_at" in traj[-1]["timing"]
    # The same figures reached the experiment tracker.
    assert "logged to mlflow" in done.stdout
    _check_tracker(f"sqlite:///{tmp}/mlflow.db", len(samples))
    if os.environ.get("UTIL_DUMP"):
        import shutil
        shutil.copy(run_dir / "metrics.jsonl", os.environ["UTIL_DUMP"])


def _check_tracker(uri: str, samples: int) -> None:
    import warnings

    from mlflow.tracking import MlflowClient

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # MLflow's SQLAlchemy use
        client = MlflowClient(tracking_uri=uri)
        [run] = client.search_runs([client.get_experiment_by_name("cua-rollout").experiment_id])
        assert run.info.run_name == "util" and run.info.status == "FINISHED"
        assert run.data.metrics["overall/episodes"] == TASKS
        acting = client.get_metric_history(run.info.run_id, "utilization/desktop/acting")
        assert 0 < len(acting) < samples and all(0 <= m.value <= 1 for m in acting)
