"""Outages, fatal errors and unreachable runners as the coordinator sees them (review H1,
H2's driver side, M3): a real AgentCoordinator, TrajectoryRunner, DesktopPool, StorageActor and
model client over real HTTP to a fake OpenAI server, in one process (no Ray), with
function-built desktops."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest
from ray.exceptions import ActorUnavailableError

from cua_rollout.config import Config, load_config
from cua_rollout.core.types import EpisodeSpec
from cua_rollout.runtime.coordinator import AgentCoordinator
from cua_rollout.runtime.pool import DesktopPool
from cua_rollout.runtime.runner import TrajectoryRunner
from cua_rollout.runtime.storage import StorageActor
from tests.doubles.fake_desktop import FakeDesktop, FakeProvider
from tests.doubles.fake_openai import FakeOpenAIServer
from tests.support import REPO_ROOT

TASK = {"id": "t", "instruction": "finish", "config": [],
        "evaluator": {"func": "infeasible"}}  # FAIL solves it; finished() does not


def specs(n: int) -> list[EpisodeSpec]:
    return [EpisodeSpec(f"t{i}", "d", 0, {**TASK, "id": f"t{i}"}) for i in range(n)]


class World:
    def __init__(self, cfg: Config, coordinator: AgentCoordinator, storage: StorageActor,
                 model: FakeOpenAIServer, provider: FakeProvider) -> None:
        self.cfg, self.coordinator, self.storage = cfg, coordinator, storage
        self.model, self.provider = model, provider
        self.seen: list[dict[str, Any]] = []

    async def until(self, predicate: Callable[[dict[str, Any]], bool], timeout_s: float = 60,
                    ) -> dict[str, Any]:
        loop = asyncio.get_running_loop()
        end = loop.time() + timeout_s
        while True:
            out = await self.coordinator.poll()
            self.seen.append(out["stats"])
            if predicate(out["stats"]):
                return out["stats"]
            assert loop.time() < end, f"timed out; last stats {out['stats']}"
            await asyncio.sleep(0.05)

    async def results(self) -> list[dict[str, Any]]:
        await self.storage.flush()
        path = self.cfg.run_dir / "results.jsonl"
        return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


@pytest.fixture
async def make_world(tmp: Path) -> AsyncIterator[Callable[..., Any]]:
    made: list[tuple[World, DesktopPool]] = []

    async def make(*sets: str, runner_factory: Any = None) -> World:
        server = FakeOpenAIServer(reply=lambda body: "Action: call_user()").start()
        cfg = load_config(REPO_ROOT / "configs" / "demo.yaml", [
            f"run.output_dir={tmp / 'results'}", "model.scripted=false",
            f"model.endpoints={json.dumps([server.url])}", "model.retries=0",
            "model.endpoint_failures_to_eject=1", "desktops.count=2",
            "desktops.warm_spares=0", "runner.action_pause_s=0",
            "coordinator.max_concurrent_episodes=4", "coordinator.episodes_per_runner=4",
            "coordinator.outage_backoff.initial_s=0.1", "coordinator.outage_backoff.max_s=0.3",
            "monitoring.ray_metrics=false", "monitoring.metrics_interval_s=0.2",
            f"desktops.download_cache_dir={tmp}", *sets])
        provider = FakeProvider(desktop_factory=lambda i: FakeDesktop(name=i))
        pool = DesktopPool(cfg.desktops, provider)
        await pool.start()
        storage = StorageActor(cfg.run_dir, cfg.storage)
        await storage.start_run({"run": "outages"})
        coordinator = AgentCoordinator(cfg, pool, storage, use_ray=False)
        coordinator.runner_factory = runner_factory or (
            lambda *args: TrajectoryRunner(*args, env_factory=provider.env_factory))
        world = World(cfg, coordinator, storage, server, provider)
        made.append((world, pool))
        return world

    yield make
    for world, pool in made:
        await world.coordinator.drain(cancel=True, timeout_s=10)
        await world.coordinator.shutdown()
        await pool.stop()
        await world.storage.close()
        world.model.stop()


def done(n: int) -> Callable[[dict[str, Any]], bool]:
    return lambda s: s["episodes_done"] >= n and not s["episodes_in_flight"]


async def test_every_model_endpoint_down_holds_the_queue_and_fails_no_episode(make_world):
    """The only endpoint is down when the run starts and for a few seconds more, far longer
    than an episode waits (outage_wait_s): episodes go back to the queue without using an
    attempt, the breaker holds the rest and says so, and every episode ends scored."""
    world = await make_world("model.outage_wait_s=0.3", "coordinator.max_retries=0")
    world.model.healthy = False
    world.model.faults.extend([503] * 10_000)
    await world.coordinator.submit(specs(6))
    stats = await world.until(lambda s: "live" in (s["waiting"] or ""))
    assert stats["waiting"].startswith("waiting for model endpoints: 0 live, 0 draining, 1 down")
    await asyncio.sleep(2.0)
    stats = (await world.coordinator.poll())["stats"]
    assert stats["episodes_done"] == 0 and stats["episodes_in_flight"] <= 4
    world.model.faults.clear()
    world.model.healthy = True
    stats = await world.until(done(6))
    assert stats["episodes_by_status"] == {"success": 6}
    assert stats["outages"]["model"]["count"] >= 1 and stats["waiting"] is None
    assert world.coordinator.counters["outage_requeues"] >= 1
    records = await world.results()
    assert sorted(r["episode_id"] for r in records) == [f"d/t{i}/0" for i in range(6)]
    assert {r["attempt"] for r in records} == {0}  # no attempt was used up


async def test_a_rejected_api_key_stops_the_run_and_records_nothing(make_world):
    world = await make_world()
    world.model.faults.extend([401] * 100)
    await world.coordinator.submit(specs(5))
    stats = await world.until(lambda s: s["fatal"] and not s["episodes_in_flight"])
    assert "HTTP 401" in stats["fatal"]
    assert await world.results() == []  # a rerun runs every episode
    assert stats["episodes_queued"] == 5 and stats["episodes_done"] == 0


@pytest.mark.parametrize("how", ["the call fails", "it answers why"])
async def test_a_result_the_storage_cannot_write_stops_the_run(make_world, how):
    world = await make_world()

    async def full_disk(items: list[Any]) -> list[str | None]:
        if how == "the call fails":
            raise OSError(28, "No space left on device")
        return ["results.jsonl: [Errno 28] No space left on device"] * len(items)

    world.storage.record_results = full_disk  # type: ignore[method-assign]
    await world.coordinator.submit(specs(3))
    stats = await world.until(lambda s: s["fatal"] and not s["episodes_in_flight"])
    assert stats["fatal"].startswith("storage: cannot record episode d/t")
    assert "No space left on device" in stats["fatal"]
    assert stats["episodes_done"] == 0


class _Unreachable:
    """A runner whose first ``run_episode`` call is cut (the network, not the runner): the
    episode still runs there, and the coordinator must get its result, not run it twice."""

    def __init__(self, runner: TrajectoryRunner) -> None:
        self.runner = runner
        self.cut = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.runner, name)

    async def run_episode(self, spec: EpisodeSpec, avoid: list[str] | None = None) -> Any:
        if self.cut:
            return await self.runner.run_episode(spec, avoid)
        self.cut += 1
        # The call goes on in the runner (as an unreachable actor's would); kept referenced.
        self.orphan = asyncio.ensure_future(self.runner.run_episode(spec, avoid))
        await asyncio.sleep(0.05)
        raise ActorUnavailableError("the runner is unreachable for now", None)


async def test_an_unreachable_runner_is_not_dead_and_its_episode_runs_once(make_world):
    made: list[_Unreachable] = []

    def factory(*args: Any) -> _Unreachable:
        provider = world_provider[0]
        made.append(_Unreachable(TrajectoryRunner(*args, env_factory=provider.env_factory)))
        return made[-1]

    world_provider: list[FakeProvider] = []
    world = await make_world(runner_factory=factory)
    world_provider.append(world.provider)
    await world.coordinator.submit(specs(2))
    stats = await world.until(done(2))
    assert stats["episodes_by_status"] == {"success": 2}
    assert stats["runners_replaced"] == 0 and len(made) == 1
    assert world.coordinator.counters["runner_unreachable_recovered"] == 1
    assert sorted(r["episode_id"] for r in await world.results()) == ["d/t0/0", "d/t1/0"]
    # Each episode leased one desktop once: the cut call was not run a second time.
    assert len(world.provider.resets) == 2


async def test_a_runner_stuck_past_every_deadline_is_declared_dead_and_replaced(
        make_world, monkeypatch):
    """Review M6/M3: the coordinator's await on a runner has a deadline; a runner that does
    not answer past it is declared dead (killed in Ray mode), its desktops are given back,
    and the episode runs on a new runner."""
    import cua_rollout.runtime.coordinator as agent_coordinator

    monkeypatch.setattr(agent_coordinator, "episode_deadline_s", lambda cfg: 0.5)
    monkeypatch.setattr(agent_coordinator, "_RUNNER_WATCHDOG_MARGIN_S", 0.5)
    made: list[Any] = []

    class Frozen(TrajectoryRunner):
        async def run_episode(self, spec: EpisodeSpec, avoid: list[str] | None = None) -> Any:
            if len(made) == 1:  # the first runner holds a desktop and never answers
                await self.desktop_pool.lease("runner-0/stuck")
                await asyncio.sleep(3600)
            return await super().run_episode(spec, avoid)

    def factory(*args: Any) -> Frozen:
        made.append(Frozen(*args, env_factory=provider[0].env_factory))
        return made[-1]

    provider: list[FakeProvider] = []
    world = await make_world(runner_factory=factory)
    provider.append(world.provider)
    await world.coordinator.submit(specs(1))
    stats = await world.until(done(1))
    assert stats["episodes_by_status"] == {"success": 1} and stats["runners_replaced"] == 1
    assert len(made) == 2
    record = (await world.results())[0]
    assert record["attempt"] == 1 and record["runner"] == "runner-1"
    await asyncio.sleep(0.05)
    assert world.coordinator.desktop_pool.stats()["leased"] == 0  # runner-0's desktop is back


# --------------------------------------------------------------------------- stragglers (issue 17)


async def test_batch_stragglers_are_cut_recorded_cancelled_and_run_in_the_next_batch(
        make_world, tmp):
    """schedule: batch with batch_cutoff 0.75: episode t0 only ever waits (a straggler that
    would take its 30 steps); once 3 of its batch of 4 are final and the grace passed, it is
    cut (a cancelled line saying why, no score) and goes first into the next batch, where the
    same happens; in the last batch (t0 and one other) the cutoff needs t0 itself, so it
    ends as max_steps, its only scored line."""
    world = await make_world("coordinator.schedule=batch", "coordinator.batch_cutoff=0.75",
                             "coordinator.batch_grace_s=0.2", "runner.wait_s=0.05",
                             "runner.max_steps=40", "desktops.count=4")
    world.model.reply = lambda body: ("Action: wait()" if "straggle" in json.dumps(body)
                                      else "Action: call_user()")
    episodes = specs(8)
    episodes[0] = EpisodeSpec("t0", "d", 0, {**TASK, "id": "t0", "instruction": "straggle"})
    await world.coordinator.submit(episodes)
    stats = await world.until(done(8), timeout_s=120)
    assert stats["cut"] == 2
    lines = await world.results()
    t0 = [(r["status"], r["reward"], r["error"]) for r in lines if r["task_id"] == "t0"]
    assert [s for s, _, _ in t0] == ["cancelled", "cancelled", "max_steps"], t0
    assert all(reward is None and "straggler cut: 3/4" in error for _, reward, error in t0[:2])
    assert t0[2][1] is not None  # scored once, by its complete run
    # The cut lines are not final: a resumed loader runs nothing again but t0 is done.
    finished = [r for r in lines if r["status"] != "cancelled"]
    assert sorted(r["task_id"] for r in finished) == sorted(f"t{i}" for i in range(8))
    assert (await world.coordinator.poll())["stats"]["episodes_by_status"].get(
        "cancelled") is None  # never counted as a result
