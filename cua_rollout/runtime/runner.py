"""``TrajectoryRunner``: an async Ray actor (``ray.remote(TrajectoryRunner)``) or an in-process
object that runs many episodes as coroutines (episode.py's loop, on desktops or text tasks)
with one model client, one evaluator and one judge per process; a watchdog ends an episode
that outlives every deadline it has. Scheduling and retries are the coordinator's."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import Any

from cua_rollout.config import Config, SamplingConfig
from cua_rollout.core.aio import TaskSet
from cua_rollout.core.types import (
    EpisodeResult,
    EpisodeSpec,
    Status,
)
from cua_rollout.evaluation import Evaluator
from cua_rollout.model.client import ModelServicePool
from cua_rollout.runtime.desktop_episode import DesktopEpisode, open_leased_desktop
from cua_rollout.runtime.episode import EnvFactory, episode_deadline_s
from cua_rollout.runtime.monitoring import Metrics
from cua_rollout.runtime.pool_shards import ShardedPool
from cua_rollout.runtime.storage import StepFiles
from cua_rollout.runtime.text_episode import TextEpisode
from cua_rollout.runtime.utilization import StateClock
from cua_rollout.text.benchmark import is_text_task

__all__ = ["TrajectoryRunner"]

log = logging.getLogger(__name__)

# Finished episodes whose results a runner keeps for a coordinator that lost its call.
_RECENT_RESULTS = 1024
# The judge's sampling when llm_judgement asks the run's own model (text.judge unset).
_JUDGE_SAMPLING = SamplingConfig(temperature=0.0, top_p=1.0, max_tokens=256)


class TrajectoryRunner:
    """Runs episodes concurrently; the coordinator gives it at most ``episodes_per_runner``
    at a time. One model client per runner process, opened on the actor's loop.
    ``env_factory`` builds a leased desktop's environment (default: the OSWorld HTTP client;
    the component tests pass ``tests.doubles.FakeDesktop`` builders)."""

    def __init__(
        self,
        cfg: Config,
        desktop_pool: Any,
        storage: Any,
        runner_id: str = "runner",
        model_state_dir: str | None = None,
        *,
        env_factory: EnvFactory = open_leased_desktop,
        text_env_factory: Callable[[dict[str, Any], str], Any] | None = None,
    ) -> None:
        self.cfg = cfg
        self.desktop_pool = ShardedPool(desktop_pool) if desktop_pool is not None else None
        self.storage = storage
        self.runner_id = runner_id
        self.model_state_dir = model_state_dir
        self.env_factory = env_factory
        self.text_env_factory = text_env_factory
        self.node_id = _node_id()
        # Where this process's episodes write their step files (decided at the first one).
        self.step_files = StepFiles(storage, cfg.storage,
                                    f"{runner_id} (node {(self.node_id or 'local')[:12]})")
        self._model: ModelServicePool | None = None
        self._judge: ModelServicePool | None = None
        self._evaluator: Evaluator | None = None
        self._metrics: Metrics | None = None
        self._episodes: dict[str, asyncio.Task[EpisodeResult]] = {}
        self._recent: OrderedDict[str, EpisodeResult] = OrderedDict()
        self.background = TaskSet()
        self.counters = {"episodes": 0, "steps": 0, "actions": 0, "model_s": 0.0, "env_s": 0.0,
                         "overhead_s": 0.0, "action_s": 0.0, "pause_s": 0.0,
                         "screenshot_s": 0.0}
        # Episode-seconds by what their desktops do (leased time only): utilization.
        self.phases = StateClock()

    @property
    def model(self) -> ModelServicePool:
        if self._model is None:
            state = Path(self.model_state_dir) if self.model_state_dir else None
            self._model = ModelServicePool(self.cfg.model, state)
        return self._model

    def text_env(self, task: dict[str, Any], name: str) -> Any:
        """A text task's environment (``cua_rollout.text.envs``): its mode's tools."""
        if self.text_env_factory is not None:
            return self.text_env_factory(task, name)
        from cua_rollout.text.envs import make_text_env

        return make_text_env(str(task["mode"]), self.cfg.text, name=name)

    async def judge_ask(self, messages: list[dict[str, Any]]) -> str:
        """llm_judgement's question to the judge: ``text.judge``'s endpoints and model, or
        the run's model (deterministic, a short reply) when it is unset."""
        judge_cfg = self.cfg.text.judge
        if judge_cfg is None:
            generation = await self.model.generate(messages, None, _JUDGE_SAMPLING)
        else:
            if self._judge is None:
                self._judge = ModelServicePool(judge_cfg, None)
            # Deterministic unless text.judge.sampling says otherwise.
            sampling = None if "sampling" in judge_cfg.model_fields_set else _JUDGE_SAMPLING
            generation = await self._judge.generate(messages, None, sampling)
        return generation.text

    @property
    def evaluator(self) -> Evaluator:
        """Scores this runner's episodes; OSWorld's worker starts on the first task that
        needs it and stays warm."""
        if self._evaluator is None:
            self._evaluator = Evaluator.from_config(self.cfg)
        return self._evaluator

    def step_done(self, timing: dict[str, float], acted: bool = False) -> None:
        self.counters["steps"] += 1
        self.counters["actions"] += acted
        for key in ("model_s", "env_s", "overhead_s", "action_s", "pause_s", "screenshot_s"):
            self.counters[key] += timing.get(key, 0.0)
        if self._metrics is None:
            self._metrics = Metrics(self.cfg.monitoring.ray_metrics, run=self.cfg.run.name)
        self._metrics.step(timing["model_s"], timing["env_s"], timing["overhead_s"])

    async def run_episode(self, spec: EpisodeSpec, avoid: list[str] | None = None
                          ) -> EpisodeResult:
        """Run one episode to its end; never raises for the episode's own failures. A
        watchdog ends an episode that outlives every deadline it has (``episode_deadline_s``)
        as a retryable infra error on a desktop that must be checked."""
        kind = TextEpisode if is_text_task(spec.task) else DesktopEpisode
        episode = kind(self, spec, list(avoid or []))
        task = asyncio.create_task(episode.run())
        self._episodes[spec.episode_id] = task
        try:
            result = await asyncio.wait_for(asyncio.shield(task), episode_deadline_s(self.cfg))
        except TimeoutError:
            log.error("episode %s outlived its deadlines; the watchdog ends it",
                      spec.episode_id)
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
            result = episode.result(Status.INFRA_ERROR, "the episode outlived its deadlines "
                                    f"({episode_deadline_s(self.cfg):.0f}s): ended by the "
                                    "watchdog", True, None)
        except asyncio.CancelledError:
            if not task.done():
                task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
            return episode.result(Status.CANCELLED, "cancelled", False, None)
        finally:
            self._episodes.pop(spec.episode_id, None)
            self.counters["episodes"] += 1
        self._recent[spec.episode_id] = result
        while len(self._recent) > _RECENT_RESULTS:
            self._recent.popitem(last=False)
        return result

    async def await_episode(self, episode_id: str) -> EpisodeResult | None:
        """The result of an episode this runner runs or ran lately (awaited if it still
        runs), or None if it never got it: for a coordinator whose ``run_episode`` call was
        cut by an unreachable runner, so the episode is neither lost nor run twice."""
        task = self._episodes.get(episode_id)
        if task is not None:
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.shield(task)
            # run_episode stores the final result (the watchdog's included) as it returns.
            while episode_id in self._episodes:
                await asyncio.sleep(0.01)
        return self._recent.get(episode_id)

    async def cancel(self, episode_ids: list[str] | None = None) -> int:
        """Cancel running episodes (all when ``episode_ids`` is None); their desktops are
        released. Returns how many were cancelled."""
        targets = [t for eid, t in self._episodes.items()
                   if episode_ids is None or eid in episode_ids]
        for task in targets:
            task.cancel()
        return len(targets)

    def stats(self) -> dict[str, Any]:
        model = self._model
        return {
            "runner": self.runner_id,
            "node": self.node_id,
            "pid": os.getpid(),
            "active": len(self._episodes),
            **self.counters,
            "phase_s": {k: round(v, 4) for k, v in self.phases.totals().items()},
            "model_in_flight": model.in_flight if model else 0,
            "model_in_flight_by_endpoint": (
                {e["url"]: e["outstanding"] for e in model.stats()["endpoints"]} if model else {}
            ),
            # Episodes of this runner waiting out a model outage, and what routing sees.
            "model_waiting": model.waiting if model else 0,
            "model_outage": str(model.outage_status()) if model and model.waiting else None,
            # Who writes this process's step files ("runner": itself; "storage": the storage
            # actor; None: no episode yet) and what it wrote itself.
            "step_files": self.step_files.stats(),
        }

    async def close(self) -> None:
        await self.cancel()
        await self.background.wait()
        self.step_files.close()
        for pool in (self._model, self._judge):
            if pool is not None:
                await pool.close()
        self._model = self._judge = None
        if self._evaluator is not None:
            await self._evaluator.close()
            self._evaluator = None
        from cua_rollout.envs.client import close_shared_client

        await close_shared_client()


def _node_id() -> str | None:
    try:
        import ray

        if ray.is_initialized():
            return ray.get_runtime_context().get_node_id()
    except Exception:  # outside Ray there is simply no node
        return None
    return None
