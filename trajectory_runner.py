"""One episode's loop (DESIGN.md "One step, as data") and the async runner that holds many.

``TrajectoryRunner`` runs as an async Ray actor (``ray.remote(TrajectoryRunner)``) or
in-process; each episode is a coroutine: lease a desktop, run the task's setup, then
screenshot -> model -> parse -> action until the agent ends, ``max_steps`` or the deadline,
score with the task's evaluator, release the desktop. Infrastructure failures become
``infra_error`` results (never a reward); scheduling and retries are the coordinator's.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import Awaitable
from dataclasses import asdict, dataclass, field
from datetime import datetime
from typing import Any

from config import Config
from env_k8s import RemoteDesktopEnv, lease_client
from rollout.errors import (
    ActionParseError,
    DesktopError,
    InfraError,
    ModelRequestError,
    TaskSetupError,
    UnsupportedEvaluator,
    UnsupportedSetupStep,
)
from model_service_pool import Generation, ModelServicePool
from rollout.monitoring import Metrics
from rollout.screenshot import Screenshot
from prompts import Turn, build_messages
from storage_actor import png_parts
from task_loader import EpisodeSpec
from ui_tars_utils import DONE, FAIL, WAIT, Action, parse_response, split_terminal, to_pyautogui

log = logging.getLogger(__name__)

SCORED_STATUSES = ("success", "failure", "max_steps", "timeout")
STATUSES = (*SCORED_STATUSES, "infra_error", "cancelled")
# A reward at least this high is a solved task (evaluators return 1.0 for a full solve;
# partial credit counts as failure but keeps its reward).
SUCCESS_REWARD = 1.0


@dataclass
class EpisodeResult:
    """How an episode ended; ``record()`` is its results.jsonl line."""

    episode_id: str
    task_id: str
    domain: str
    rollout: int
    attempt: int
    status: str
    reward: float | None
    steps: int
    started_at: float
    ended_at: float
    instruction: str = ""
    infeasible: bool = False
    model_version: str | None = None
    model_endpoints: list[str] = field(default_factory=list)
    desktop: str | None = None
    desktops_tried: list[str] = field(default_factory=list)
    error: str | None = None
    retryable: bool = False       # an infra error that another attempt may not hit
    last_action: str | None = None
    parse_failures: int = 0
    timing: dict[str, float] = field(default_factory=dict)
    runner: str | None = None
    node: str | None = None

    def record(self) -> dict[str, Any]:
        out = asdict(self)
        out["duration_s"] = round(self.ended_at - self.started_at, 4)
        out.pop("retryable")
        return out


def infra_result(spec: EpisodeSpec, error: str, *, retryable: bool = True,
                 runner: str | None = None) -> EpisodeResult:
    """The result of an attempt that never reached (or lost) its runner."""
    now = time.time()
    return EpisodeResult(
        spec.episode_id, spec.task_id, spec.domain, spec.rollout, spec.attempt, "infra_error",
        None, 0, now, now, instruction=str(spec.task.get("instruction", "")),
        infeasible=_is_infeasible(spec.task), error=error, retryable=retryable, runner=runner,
    )


def _is_infeasible(task: dict[str, Any]) -> bool:
    func = (task.get("evaluator") or {}).get("func")
    return func == "infeasible" or func == ["infeasible"]


def _call(target: Any, method: str, *args: Any, **kwargs: Any) -> Awaitable[Any]:
    """Call ``method`` on a Ray actor handle (an awaitable ObjectRef) or a local object."""
    fn = getattr(target, method)
    if hasattr(fn, "remote"):
        return fn.remote(*args, **kwargs)
    return asyncio.ensure_future(fn(*args, **kwargs))


def _timestamp() -> str:
    return datetime.now().strftime("%Y%m%d@%H%M%S%f")


def _action_dict(a: Action) -> dict[str, Any]:
    return {"kind": a.kind, "point": a.point, "end_point": a.end_point, "content": a.content,
            "keys": a.keys, "direction": a.direction}


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
        self.files: dict[int, str] = {}       # id(data URL string) -> screenshot file
        self.steps = 0
        self.parse_failures = 0
        self.call_user_waits = 0
        self.last_action: str | None = None
        self.endpoints: list[str] = []
        self.model_version: str | None = None
        self.desktop: str | None = None
        self.timing = {"model_s": 0.0, "env_s": 0.0, "overhead_s": 0.0, "reset_s": 0.0,
                       "evaluation_s": 0.0, "lease_wait_s": 0.0}
        self.last_messages: list[dict[str, Any]] | None = None
        self.reset_done = False
        self.held_record: dict[str, Any] | None = None
        self._pending_write: Awaitable[Any] | None = None
        self.desktop_client: Any = None       # the leased desktop's connection (lease_client)

    # ----------------------------------------------------------------- storage

    async def _store(self, method: str, *args: Any) -> None:
        # One write in flight per episode: ordered, and a storage that falls behind slows
        # this episode down instead of piling screenshots up in memory.
        if self._pending_write is not None:
            await self._pending_write
        self._pending_write = _call(self.r.storage, method, self.spec.episode_id,
                                    self.spec.attempt, *args)

    async def _store_done(self) -> None:
        if self._pending_write is not None:
            pending, self._pending_write = self._pending_write, None
            await pending

    def _forget_old_screenshot(self) -> None:
        """Drop the screenshot of the turn that just left the last request's image window
        (its file is written; it is never sent again): an episode holds ``history_images``
        screenshots (PNG and base64), not every one it has seen."""
        old = len(self.history) - 1 - self.cfg.runner.history_images
        if old < 0 or (shot := self.history[old].screenshot) is None:
            return
        # The last request (last_messages, saved at the end) no longer shows it either, so
        # its file name can go; its data URL's id may be reused once the string is freed.
        if "data_url" in shot.__dict__:
            self.files.pop(id(shot.data_url), None)
        self.history[old].screenshot = None

    def _remember(self, shot: Screenshot, name: str | None) -> None:
        if name:
            self.files[id(shot.data_url)] = name

    async def _save_screenshot(self, shot: Screenshot, step: int) -> str | None:
        if not self.cfg.runner.save_screenshots:
            return None
        name = f"step_{step}.png"
        await self._store("write_step_parts", None, name, *png_parts(shot.png))
        self._remember(shot, name)
        return name

    # ----------------------------------------------------------------- the loop

    async def run(self) -> EpisodeResult:
        cfg = self.cfg
        status, error, retryable, reward = "failure", None, False, None
        lease = None
        healthy = True
        try:
            waited = time.monotonic()
            lease = await _call(self.r.desktop_pool, "lease",
                                f"{self.r.runner_id}/{self.session_id}",
                                cfg.desktops.lease_timeout_s, self.avoid)
            self.timing["lease_wait_s"] = time.monotonic() - waited
            self.desktop = lease.desktop_id
            self.desktop_client = lease_client(cfg.desktops)
            env = RemoteDesktopEnv(lease.url, cfg.desktops, name=lease.desktop_id,
                                   client=self.desktop_client)
            await _call(self.r.storage, "begin_episode", self.spec.episode_id,
                        self.spec.attempt, self.task)
            try:
                async with asyncio.timeout(cfg.runner.episode_timeout_s):
                    status = await self._act(env)
            except TimeoutError:
                if not self.reset_done:
                    raise _EpisodeEnded("infra_error", "the task's setup outlived the episode "
                                        "deadline", retryable=True, healthy=False) from None
                status, error = "timeout", (
                    f"episode deadline of {cfg.runner.episode_timeout_s:.0f}s reached")
            reward = await self._evaluate(env)
            if status not in ("max_steps", "timeout"):
                status = "success" if reward >= SUCCESS_REWARD else "failure"
        except _EpisodeEnded as ended:
            status, error, retryable = ended.status, ended.error, ended.retryable
            healthy = ended.healthy
        except asyncio.CancelledError:
            status, error = "cancelled", "cancelled"
            self._finish_in_background(lease, True, status, error, None)
            raise
        except (DesktopError, TaskSetupError) as exc:
            status, error = "infra_error", f"desktop {self.desktop or '(none leased)'}: {exc}"
            retryable = not isinstance(exc, UnsupportedSetupStep)
            # A setup step that failed says nothing against the desktop; anything else does
            # (the pool health-checks it before lending it again).
            healthy = isinstance(exc, TaskSetupError)
        except UnsupportedEvaluator as exc:
            status, error, retryable = "infra_error", f"evaluator: {exc}", False
        except ModelRequestError as exc:
            status, error, retryable = "infra_error", f"model rejected the request: {exc}", False
        except InfraError as exc:
            status, error, retryable = "infra_error", f"{type(exc).__name__}: {exc}", True
        except Exception as exc:
            # A bug of ours, or an error no layer translated: recorded, not retried blindly.
            log.exception("episode %s failed unexpectedly", self.spec.episode_id)
            status, error, retryable = "infra_error", f"{type(exc).__name__}: {exc}", False
        if status == "infra_error":
            reward = None
        # A cancel arriving while the episode is being finished must not cut its writes or
        # the desktop's release short: the finish completes in the background.
        finish = asyncio.ensure_future(
            self._finish(lease, healthy, status, error, retryable, reward))
        try:
            return await asyncio.shield(finish)
        except asyncio.CancelledError:
            self.r.background.add(finish)
            finish.add_done_callback(self.r.background.discard)
            raise

    async def _act(self, env: RemoteDesktopEnv) -> str:
        """Setup, then steps until the agent ends; returns ``failure`` (to be scored) or
        ``max_steps``."""
        cfg = self.cfg
        t0 = time.monotonic()
        shot = await env.reset(self.task)
        self.timing["reset_s"] = time.monotonic() - t0
        self.reset_done = True
        await self._save_screenshot(shot, 0)
        shot.forget_png()  # stored: requests need its base64 only
        width, height = shot.size
        for step in range(1, cfg.runner.max_steps + 1):
            step_started = time.monotonic()
            messages = build_messages(
                str(self.task.get("instruction", "")), self.history, shot,
                history_images=cfg.runner.history_images,
                history_texts=cfg.runner.history_texts,
                language=cfg.runner.prompt_language,
                call_user=cfg.runner.prompt_call_user,
                note=cfg.runner.prompt_note,
            )
            self.last_messages = messages
            generation, parsed, retries, model_s = await self._generate(messages, width, height)
            self.steps = step
            self.history.append(Turn(shot, generation.text))
            self._forget_old_screenshot()
            record: dict[str, Any] = {
                "step_num": step,
                "action_timestamp": _timestamp(),
                "action": None,
                "response": generation.text,
                "reward": 0,
                "done": False,
                "info": {},
                "screenshot_file": None,
                "observation_file": self.files.get(id(shot.data_url)),
                "thought": parsed.thought if parsed else None,
                "actions": [_action_dict(a) for a in parsed.actions] if parsed else [],
                "model_endpoint": generation.endpoint,
                "model_version": generation.model_version,
                "parse_retries": retries,
                "prompt_tokens": generation.prompt_tokens,
                "completion_tokens": generation.completion_tokens,
            }
            if cfg.model.sampling.return_token_ids:
                record["token_ids"] = generation.token_ids
                record["prompt_token_ids"] = generation.prompt_token_ids
            if cfg.model.sampling.logprobs:
                record["logprobs"] = generation.logprobs
            env_started = time.monotonic()
            code, terminal = self._decide(parsed)
            if code is not None:
                result = await env.step(code, pause_s=cfg.runner.action_pause_s)
                record["info"] = {"returncode": result.returncode, "error": result.error or None}
            if terminal == WAIT:
                await env.step(WAIT, pause_s=cfg.runner.wait_s)
            record["action"] = terminal if code is None else (
                code if terminal in (None, WAIT) else f"{code}\n{terminal}")
            ended = terminal in (DONE, FAIL)
            if not ended:
                shot = await env.observe()
                width, height = shot.size
            env_s = time.monotonic() - env_started
            step_s = time.monotonic() - step_started
            timing = {"model_s": model_s, "env_s": env_s,
                      "overhead_s": max(0.0, step_s - model_s - env_s), "step_s": step_s}
            record["timing"] = {k: round(v, 6) for k, v in timing.items()}
            for key in ("model_s", "env_s", "overhead_s"):
                self.timing[key] += timing[key]
            self.r.step_done(timing)
            record["done"] = ended
            # A step's line is written with the next step's screenshot (or at the end, when
            # the last line gets the final reward and done=true, as in OSWorld's traj.jsonl).
            previous, self.held_record = self.held_record, record
            if ended:
                self.last_action = terminal
                if previous is not None:
                    await self._store("write_step", previous, None, None)
                return "failure"  # scored by the evaluator next
            name = f"step_{step}.png" if cfg.runner.save_screenshots else None
            record["screenshot_file"] = name
            await self._store("write_step_parts", previous, name,
                              *(png_parts(shot.png) if name else ()))
            self._remember(shot, name)
            shot.forget_png()
        return "max_steps"

    async def _generate(
        self, messages: list[dict[str, Any]], width: int, height: int
    ) -> tuple[Generation, Any, int, float]:
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

    def _decide(self, parsed: Any) -> tuple[str | None, str | None]:
        """(pyautogui code to run or None, terminal DONE/FAIL/WAIT or None)."""
        if parsed is None:
            return None, FAIL  # unparseable after every retry
        before, kind = split_terminal(parsed.actions)
        code = to_pyautogui(before) if before else None
        if kind == "finished":
            return code, DONE
        if kind == "wait":
            return code, WAIT
        if kind == "call_user":
            if (self.cfg.runner.call_user == "wait"
                    and self.call_user_waits < self.cfg.runner.call_user_max_waits):
                self.call_user_waits += 1
                return code, WAIT
            return code, FAIL
        return code, None

    async def _evaluate(self, env: RemoteDesktopEnv) -> float:
        t0 = time.monotonic()
        try:
            reward = await asyncio.wait_for(env.evaluate(self.task, self.last_action),
                                            self.cfg.runner.evaluation_timeout_s)
        except TimeoutError:
            raise _EpisodeEnded("infra_error", "evaluation timed out after "
                                f"{self.cfg.runner.evaluation_timeout_s:.0f}s",
                                retryable=True, healthy=False) from None
        finally:
            self.timing["evaluation_s"] = time.monotonic() - t0
        return min(1.0, max(0.0, float(reward)))

    # ----------------------------------------------------------------- the end

    def _result(self, status: str, error: str | None, retryable: bool,
                reward: float | None) -> EpisodeResult:
        return EpisodeResult(
            self.spec.episode_id, self.spec.task_id, self.spec.domain, self.spec.rollout,
            self.spec.attempt, status, reward, self.steps, self.started_at, time.time(),
            instruction=str(self.task.get("instruction", "")),
            infeasible=_is_infeasible(self.task), model_version=self.model_version,
            model_endpoints=self.endpoints, desktop=self.desktop,
            desktops_tried=[*self.avoid, *([self.desktop] if self.desktop else [])],
            error=error, retryable=retryable, last_action=self.last_action,
            parse_failures=self.parse_failures,
            timing={k: round(v, 4) for k, v in self.timing.items()},
            runner=self.r.runner_id, node=self.r.node_id,
        )

    def _messages_for_disk(self) -> list[dict[str, Any]] | None:
        if self.last_messages is None:
            return None
        out = []
        for message in self.last_messages:
            content = message["content"]
            if isinstance(content, list):
                content = [
                    {"type": "image_url", "image_url": {
                        "url": self.files.get(id(part["image_url"]["url"]), "<not saved>")}}
                    if part.get("type") == "image_url" else part
                    for part in content
                ]
            out.append({"role": message["role"], "content": content})
        return out

    async def _finish(self, lease: Any, healthy: bool, status: str, error: str | None,
                      retryable: bool, reward: float | None) -> EpisodeResult:
        result = self._result(status, error, retryable, reward)
        self.r.model.end_session(self.session_id)
        try:
            if lease is not None:
                await _call(self.r.desktop_pool, "release", lease.lease_id, healthy)
            if self.desktop is not None:  # the episode's directory exists
                if self.held_record is not None:
                    last, self.held_record = self.held_record, None
                    last.update(done=True, reward=reward)
                    await self._store("write_step", last, None, None)
                await self._store("finish_episode", result.record(), self._messages_for_disk())
                await self._store_done()
        except Exception as exc:
            # The result itself must reach the coordinator; a storage or pool hiccup here is
            # logged (the coordinator still records the result line).
            log.error("episode %s: finishing failed: %s", self.spec.episode_id, exc)
        finally:
            # After the release (its call is sent before anything here can be cancelled).
            if self.desktop_client is not None:
                client, self.desktop_client = self.desktop_client, None
                with contextlib.suppress(Exception):  # closing a socket cannot fail it
                    await client.aclose()
        return result

    def _finish_in_background(self, lease: Any, healthy: bool, status: str,
                              error: str | None, reward: float | None) -> None:
        """On cancellation: return the desktop and write what we have without awaiting in a
        cancelled task."""
        task = asyncio.get_running_loop().create_task(
            self._finish(lease, healthy, status, error, False, reward))
        self.r.background.add(task)
        task.add_done_callback(self.r.background.discard)


class TrajectoryRunner:
    """Runs episodes concurrently; the coordinator gives it at most ``episodes_per_runner``
    at a time. One model client per runner process, opened on the actor's loop."""

    def __init__(
        self,
        cfg: Config,
        desktop_pool: Any,
        storage: Any,
        runner_id: str = "runner",
        model_state_dir: str | None = None,
    ) -> None:
        self.cfg = cfg
        self.desktop_pool = desktop_pool
        self.storage = storage
        self.runner_id = runner_id
        self.model_state_dir = model_state_dir
        self.node_id = _node_id()
        self._model: ModelServicePool | None = None
        self._metrics: Metrics | None = None
        self._episodes: dict[str, asyncio.Task[EpisodeResult]] = {}
        self.background: set[asyncio.Task[Any]] = set()
        self.counters = {"episodes": 0, "steps": 0, "model_s": 0.0, "env_s": 0.0,
                         "overhead_s": 0.0}

    @property
    def model(self) -> ModelServicePool:
        if self._model is None:
            from pathlib import Path

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
            return episode._result("cancelled", "cancelled", False, None)
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
        if self.background:
            await asyncio.gather(*self.background, return_exceptions=True)
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
