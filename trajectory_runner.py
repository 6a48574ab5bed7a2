"""One episode's loop (DESIGN.md "One step, as data") and the async runner that holds many.

``TrajectoryRunner`` runs as an async Ray actor (``ray.remote(TrajectoryRunner)``) or
in-process; each episode is a coroutine: lease a desktop, run the task's setup, then
screenshot -> model -> parse -> action until the agent ends, ``max_steps`` or the deadline,
score with the task's evaluator, release the desktop. Infrastructure failures become
``infra_error`` results (never a reward); scheduling and retries are the coordinator's.
What a step records is ``rollout.trajectory``'s; how an error ends an episode is written on
the error's class (``rollout.errors``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from config import Config, DesktopsConfig, RunnerConfig
from env_k8s import DONE, FAIL, WAIT, DesktopEnv, Lease, RemoteDesktopEnv
from model_service_pool import Generation, ModelServicePool
from prompts import Turn, build_messages
from rollout.aio import TaskSet, call
from rollout.errors import (
    ActionParseError,
    DesktopError,
    InfraError,
    ModelRequestError,
    RolloutError,
    UnsupportedEvaluator,
)
from rollout.evaluation import evaluate
from rollout.layout import screenshot_name
from rollout.monitoring import Metrics
from rollout.screenshot import Screenshot
from rollout.trajectory import ScreenshotFiles, step_record
from rollout.types import (
    SUCCESS_REWARD,
    EpisodeResult,
    EpisodeSpec,
    Status,
    is_infeasible,
)
from storage_actor import EpisodeWriter
from ui_tars_utils import ParsedResponse, parse_response, split_terminal, to_pyautogui

__all__ = ["Decider", "EnvFactory", "TrajectoryRunner", "episode_error", "open_leased_desktop"]

log = logging.getLogger(__name__)

# Builds the environment of a leased desktop; the default speaks OSWorld's HTTP protocol.
EnvFactory = Callable[[Lease, DesktopsConfig], DesktopEnv]


def open_leased_desktop(lease: Lease, cfg: DesktopsConfig) -> DesktopEnv:
    """The leased desktop's client, with a connection of its own (closed by ``close()``)."""
    return RemoteDesktopEnv.for_lease(lease.url, cfg, name=lease.desktop_id)


def episode_error(exc: Exception, desktop: str | None) -> tuple[str, bool, bool]:
    """(error text, retryable, desktop healthy) of an episode that raised ``exc``. Whether
    another attempt may succeed and whether the desktop is suspect are properties of the
    error's class; an error no layer translated is a bug of ours: recorded, never retried."""
    if not isinstance(exc, RolloutError):
        return f"{type(exc).__name__}: {exc}", False, True
    if isinstance(exc, DesktopError):
        text = f"desktop {desktop or '(none leased)'}: {exc}"
    elif isinstance(exc, UnsupportedEvaluator):
        text = f"evaluator: {exc}"
    elif isinstance(exc, ModelRequestError):
        text = f"model rejected the request: {exc}"
    else:
        text = f"{type(exc).__name__}: {exc}"
    return text, exc.retryable, not exc.blames_desktop


class Decider:
    """What a parsed reply makes the episode do: the pyautogui code to run (the actions
    before a terminal one) and the terminal action (DONE, FAIL, WAIT or None). ``call_user``
    fails the episode, as UI-TARS agents do, or waits up to ``call_user_max_waits`` times."""

    def __init__(self, cfg: RunnerConfig) -> None:
        self.cfg = cfg
        self.call_user_waits = 0

    def decide(self, parsed: ParsedResponse | None) -> tuple[str | None, str | None]:
        if parsed is None:
            return None, FAIL  # unparseable after every retry
        before, kind = split_terminal(parsed.actions)
        code = to_pyautogui(before) if before else None
        if kind == "finished":
            return code, DONE
        if kind == "wait":
            return code, WAIT
        if kind == "call_user":
            if (self.cfg.call_user == "wait"
                    and self.call_user_waits < self.cfg.call_user_max_waits):
                self.call_user_waits += 1
                return code, WAIT
            return code, FAIL
        return code, None


class _EpisodeEnded(Exception):
    """Internal: the episode must stop now with this status (and optional error)."""

    def __init__(self, status: str, error: str | None = None, retryable: bool = False,
                 healthy: bool = True):
        super().__init__(error or status)
        self.status, self.error, self.retryable = status, error, retryable
        self.healthy = healthy


class _Episode:
    """The state of one running episode."""

    def __init__(self, runner: TrajectoryRunner, spec: EpisodeSpec, avoid: list[str]) -> None:
        self.r = runner
        self.cfg = runner.cfg
        self.spec = spec
        self.avoid = avoid
        self.task = spec.task
        self.started_at = time.time()
        self.session_id = f"{spec.episode_id}#{spec.attempt}"
        self.history: list[Turn] = []
        self.files = ScreenshotFiles()
        self.writer = EpisodeWriter(runner.storage, spec.episode_id, spec.attempt)
        self.steps = 0
        self.parse_failures = 0
        self.decider = Decider(runner.cfg.runner)
        self.last_action: str | None = None
        self.endpoints: list[str] = []
        self.model_version: str | None = None
        self.desktop: str | None = None
        self.env: DesktopEnv | None = None
        self.timing = {"model_s": 0.0, "env_s": 0.0, "overhead_s": 0.0, "reset_s": 0.0,
                       "evaluation_s": 0.0, "lease_wait_s": 0.0}
        self.last_messages: list[dict[str, Any]] | None = None
        self.reset_done = False
        self.held_record: dict[str, Any] | None = None

    # ----------------------------------------------------------------- the loop

    async def run(self) -> EpisodeResult:
        cfg = self.cfg
        status, error, retryable, reward = Status.FAILURE, None, False, None
        lease = None
        healthy = True
        try:
            waited = time.monotonic()
            lease = await call(self.r.desktop_pool, "lease",
                               f"{self.r.runner_id}/{self.session_id}",
                               cfg.desktops.lease_timeout_s, self.avoid)
            self.timing["lease_wait_s"] = time.monotonic() - waited
            self.desktop = lease.desktop_id
            env = self.env = self.r.env_factory(lease, cfg.desktops)
            await self.writer.begin(self.task)
            try:
                async with asyncio.timeout(cfg.runner.episode_timeout_s):
                    status = await self._act(env)
            except TimeoutError:
                if not self.reset_done:
                    raise _EpisodeEnded(Status.INFRA_ERROR, "the task's setup outlived the "
                                        "episode deadline", retryable=True,
                                        healthy=False) from None
                status, error = Status.TIMEOUT, (
                    f"episode deadline of {cfg.runner.episode_timeout_s:.0f}s reached")
            reward = await self._evaluate(env)
            if status not in (Status.MAX_STEPS, Status.TIMEOUT):
                status = Status.SUCCESS if reward >= SUCCESS_REWARD else Status.FAILURE
        except _EpisodeEnded as ended:
            status, error, retryable = ended.status, ended.error, ended.retryable
            healthy = ended.healthy
        except asyncio.CancelledError:
            status, error = Status.CANCELLED, "cancelled"
            self._finish_in_background(lease, True, status, error, None)
            raise
        except Exception as exc:
            if not isinstance(exc, InfraError | ModelRequestError):
                log.exception("episode %s failed unexpectedly", self.spec.episode_id)
            status = Status.INFRA_ERROR
            error, retryable, healthy = episode_error(exc, self.desktop)
        if status == Status.INFRA_ERROR:
            reward = None
        # A cancel arriving while the episode is being finished must not cut its writes or
        # the desktop's release short: the finish completes in the background.
        finish = asyncio.ensure_future(
            self._finish(lease, healthy, status, error, retryable, reward))
        try:
            return await asyncio.shield(finish)
        except asyncio.CancelledError:
            self.r.background.add(finish)
            raise

    async def _act(self, env: DesktopEnv) -> str:
        """Setup, then steps until the agent ends; returns ``failure`` (to be scored) or
        ``max_steps``."""
        t0 = time.monotonic()
        shot = await env.reset(self.task)
        self.timing["reset_s"] = time.monotonic() - t0
        self.reset_done = True
        await self._save_first_screenshot(shot)
        for step in range(1, self.cfg.runner.max_steps + 1):
            shot = await self._step(env, step, shot)
            if shot is None:
                return Status.FAILURE  # the agent ended it: scored by the evaluator next
        return Status.MAX_STEPS

    async def _step(self, env: DesktopEnv, step: int, shot: Screenshot) -> Screenshot | None:
        """One step from the screenshot ``shot``: the next screenshot, or None when the
        agent ended the episode (DONE or FAIL)."""
        runner_cfg = self.cfg.runner
        step_started = time.monotonic()
        width, height = shot.size
        messages = build_messages(
            str(self.task.get("instruction", "")), self.history, shot,
            history_images=runner_cfg.history_images, history_texts=runner_cfg.history_texts,
            language=runner_cfg.prompt_language, call_user=runner_cfg.prompt_call_user,
            note=runner_cfg.prompt_note,
        )
        self.last_messages = messages
        generation, parsed, retries, model_s = await self._generate(messages, width, height)
        self.steps = step
        self.history.append(Turn(shot, generation.text))
        self._forget_old_screenshot()
        sampling = self.cfg.model.sampling
        record = step_record(step, generation, parsed, retries, self.files.file_of(shot),
                             token_ids=sampling.return_token_ids, logprobs=sampling.logprobs)

        env_started = time.monotonic()
        code, terminal = self.decider.decide(parsed)
        if code is not None:
            result = await env.step(code, pause_s=runner_cfg.action_pause_s)
            record["info"] = {"returncode": result.returncode, "error": result.error or None}
        if terminal == WAIT:
            await env.step(WAIT, pause_s=runner_cfg.wait_s)
        record["action"] = terminal if code is None else (
            code if terminal in (None, WAIT) else f"{code}\n{terminal}")
        ended = terminal in (DONE, FAIL)
        next_shot = None if ended else await env.observe()
        self._time_step(record, model_s, time.monotonic() - env_started,
                        time.monotonic() - step_started)
        record["done"] = ended
        # A step's line is written with the next step's screenshot (or at the end, when
        # the last line gets the final reward and done=true, as in OSWorld's traj.jsonl).
        previous, self.held_record = self.held_record, record
        if next_shot is None:
            self.last_action = terminal
            if previous is not None:
                await self.writer.step(previous)
            return None
        name = screenshot_name(step) if runner_cfg.save_screenshots else None
        record["screenshot_file"] = name
        await self.writer.step(previous, name, next_shot.png)
        self.files.remember(next_shot, name)
        next_shot.forget_png()  # stored: requests need its base64 only
        return next_shot

    def _time_step(self, record: dict[str, Any], model_s: float, env_s: float,
                   step_s: float) -> None:
        timing = {"model_s": model_s, "env_s": env_s,
                  "overhead_s": max(0.0, step_s - model_s - env_s), "step_s": step_s}
        record["timing"] = {k: round(v, 6) for k, v in timing.items()}
        for key in ("model_s", "env_s", "overhead_s"):
            self.timing[key] += timing[key]
        self.r.step_done(timing)

    async def _generate(
        self, messages: list[dict[str, Any]], width: int, height: int
    ) -> tuple[Generation, ParsedResponse | None, int, float]:
        """Ask the model; an unparseable reply is asked again up to ``max_parse_retries``
        times, after which the episode ends as the UI-TARS agents end it (FAIL)."""
        cfg = self.cfg
        model_s = 0.0
        for retry in range(cfg.runner.max_parse_retries + 1):
            t0 = time.monotonic()
            generation = await self.r.model.generate(messages, self.session_id)
            model_s += time.monotonic() - t0
            if generation.endpoint not in self.endpoints:
                self.endpoints.append(generation.endpoint)
            self.model_version = generation.model_version or self.model_version
            try:
                parsed = parse_response(generation.text, width, height, cfg.model.family)
                if not parsed.actions:
                    raise ActionParseError("the reply has no action", generation.text)
                return generation, parsed, retry, model_s
            except ActionParseError as exc:
                self.parse_failures += 1
                log.info("episode %s: unparseable reply (%s), attempt %d", self.spec.episode_id,
                         exc, retry + 1)
        return generation, None, cfg.runner.max_parse_retries, model_s

    async def _evaluate(self, env: DesktopEnv) -> float:
        t0 = time.monotonic()
        try:
            reward = await asyncio.wait_for(
                evaluate(env, self.task, self.last_action,  # type: ignore[arg-type]
                         cache_dir=Path(self.cfg.desktops.download_cache_dir),
                         task_id=str(self.task.get("id", "")) or None),
                self.cfg.runner.evaluation_timeout_s)
        except TimeoutError:
            raise _EpisodeEnded(Status.INFRA_ERROR, "evaluation timed out after "
                                f"{self.cfg.runner.evaluation_timeout_s:.0f}s",
                                retryable=True, healthy=False) from None
        finally:
            self.timing["evaluation_s"] = time.monotonic() - t0
        return min(1.0, max(0.0, float(reward)))

    # ----------------------------------------------------------------- screenshots

    async def _save_first_screenshot(self, shot: Screenshot) -> None:
        if self.cfg.runner.save_screenshots:
            name = screenshot_name(0)
            await self.writer.step(None, name, shot.png)
            self.files.remember(shot, name)
        shot.forget_png()  # stored: requests need its base64 only

    def _forget_old_screenshot(self) -> None:
        """Drop the screenshot of the turn that just left the last request's image window
        (its file is written; it is never sent again): an episode holds ``history_images``
        screenshots (PNG and base64), not every one it has seen."""
        old = len(self.history) - 1 - self.cfg.runner.history_images
        if old < 0 or (shot := self.history[old].screenshot) is None:
            return
        # The last request (last_messages, saved at the end) no longer shows it either.
        self.files.forget(shot)
        self.history[old].screenshot = None

    # ----------------------------------------------------------------- the end

    def result(self, status: str, error: str | None, retryable: bool,
               reward: float | None) -> EpisodeResult:
        return EpisodeResult(
            self.spec.episode_id, self.spec.task_id, self.spec.domain, self.spec.rollout,
            self.spec.attempt, status, reward, self.steps, self.started_at, time.time(),
            instruction=str(self.task.get("instruction", "")),
            infeasible=is_infeasible(self.task), model_version=self.model_version,
            model_endpoints=self.endpoints, desktop=self.desktop,
            desktops_tried=[*self.avoid, *([self.desktop] if self.desktop else [])],
            error=error, retryable=retryable, last_action=self.last_action,
            parse_failures=self.parse_failures,
            timing={k: round(v, 4) for k, v in self.timing.items()},
            runner=self.r.runner_id, node=self.r.node_id,
        )

    async def _finish(self, lease: Any, healthy: bool, status: str, error: str | None,
                      retryable: bool, reward: float | None) -> EpisodeResult:
        result = self.result(status, error, retryable, reward)
        self.r.model.end_session(self.session_id)
        try:
            if lease is not None:
                await call(self.r.desktop_pool, "release", lease.lease_id, healthy)
            if self.desktop is not None:  # the episode's directory exists
                if self.held_record is not None:
                    last, self.held_record = self.held_record, None
                    last.update(done=True, reward=reward)
                    await self.writer.step(last)
                await self.writer.finish(result.record(),
                                         self.files.messages_for_disk(self.last_messages))
                await self.writer.flush()
        except Exception as exc:
            # The result itself must reach the coordinator; a storage or pool hiccup here is
            # logged (the coordinator still records the result line).
            log.error("episode %s: finishing failed: %s", self.spec.episode_id, exc)
        finally:
            # After the release (its call is sent before anything here can be cancelled).
            if self.env is not None:
                env, self.env = self.env, None
                with contextlib.suppress(Exception):  # closing a socket cannot fail it
                    await env.close()
        return result

    def _finish_in_background(self, lease: Any, healthy: bool, status: str,
                              error: str | None, reward: float | None) -> None:
        """On cancellation: return the desktop and write what we have without awaiting in a
        cancelled task."""
        self.r.background.spawn(self._finish(lease, healthy, status, error, False, reward))


class TrajectoryRunner:
    """Runs episodes concurrently; the coordinator gives it at most ``episodes_per_runner``
    at a time. One model client per runner process, opened on the actor's loop.
    ``env_factory`` builds a leased desktop's environment (default: the OSWorld HTTP client;
    the component tests pass ``rollout.testing.FakeDesktop`` builders)."""

    def __init__(
        self,
        cfg: Config,
        desktop_pool: Any,
        storage: Any,
        runner_id: str = "runner",
        model_state_dir: str | None = None,
        *,
        env_factory: EnvFactory = open_leased_desktop,
    ) -> None:
        self.cfg = cfg
        self.desktop_pool = desktop_pool
        self.storage = storage
        self.runner_id = runner_id
        self.model_state_dir = model_state_dir
        self.env_factory = env_factory
        self.node_id = _node_id()
        self._model: ModelServicePool | None = None
        self._metrics: Metrics | None = None
        self._episodes: dict[str, asyncio.Task[EpisodeResult]] = {}
        self.background = TaskSet()
        self.counters = {"episodes": 0, "steps": 0, "model_s": 0.0, "env_s": 0.0,
                         "overhead_s": 0.0}

    @property
    def model(self) -> ModelServicePool:
        if self._model is None:
            state = Path(self.model_state_dir) if self.model_state_dir else None
            self._model = ModelServicePool(self.cfg.model, state)
        return self._model

    def step_done(self, timing: dict[str, float]) -> None:
        self.counters["steps"] += 1
        for key in ("model_s", "env_s", "overhead_s"):
            self.counters[key] += timing[key]
        if self._metrics is None:
            self._metrics = Metrics(self.cfg.monitoring.ray_metrics)
        self._metrics.step(timing["model_s"], timing["env_s"], timing["overhead_s"])

    async def run_episode(self, spec: EpisodeSpec, avoid: list[str] | None = None
                          ) -> EpisodeResult:
        """Run one episode to its end; never raises for the episode's own failures."""
        episode = _Episode(self, spec, list(avoid or []))
        task = asyncio.create_task(episode.run())
        self._episodes[spec.episode_id] = task
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            if not task.done():
                task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
            return episode.result(Status.CANCELLED, "cancelled", False, None)
        finally:
            self._episodes.pop(spec.episode_id, None)
            self.counters["episodes"] += 1

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
            "model_in_flight": model.in_flight if model else 0,
            "model_in_flight_by_endpoint": (
                {e["url"]: e["outstanding"] for e in model.stats()["endpoints"]} if model else {}
            ),
        }

    async def close(self) -> None:
        await self.cancel()
        await self.background.wait()
        if self._model is not None:
            await self._model.close()
            self._model = None
        from env_k8s import close_shared_client

        await close_shared_client()


def _node_id() -> str | None:
    try:
        import ray

        if ray.is_initialized():
            return ray.get_runtime_context().get_node_id()
    except Exception:  # outside Ray there is simply no node
        return None
    return None
