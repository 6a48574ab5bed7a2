"""One episode's loop (each step: observe, ask the model, act) and the async runner holding many.

``TrajectoryRunner`` runs as an async Ray actor (``ray.remote(TrajectoryRunner)``) or
in-process; each episode is a coroutine: lease a desktop, run the task's setup, then
screenshot -> model -> parse -> action until the agent ends, ``max_steps`` or the deadline,
score with the task's evaluator, release the desktop. Infrastructure failures become
``infra_error`` results (never a reward); scheduling and retries are the coordinator's.
What a step records is ``cua_rollout.runtime.trajectory``'s; how an error ends an episode is
written on
the error's class (``cua_rollout.core.errors``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
import uuid
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, NamedTuple

from cua_rollout.agents.uitars import (
    ParsedResponse,
    action_regex,
    parse_response,
    split_terminal,
    to_pyautogui,
)
from cua_rollout.agents.uitars.prompt import Turn, build_messages
from cua_rollout.config import LEASE_MARGIN_S, Config, DesktopsConfig, RunnerConfig, SamplingConfig
from cua_rollout.core.aio import TaskSet, call
from cua_rollout.core.errors import (
    ActionParseError,
    DesktopError,
    DesktopUnavailable,
    EvaluationError,
    ModelRequestError,
    ModelUnavailable,
    RolloutError,
    StorageError,
    UnsupportedEvaluator,
    one_line,
)
from cua_rollout.core.layout import screenshot_name
from cua_rollout.core.screenshot import Screenshot
from cua_rollout.core.types import (
    DONE,
    FAIL,
    SUCCESS_REWARD,
    WAIT,
    EpisodeResult,
    EpisodeSpec,
    Status,
    is_infeasible,
)
from cua_rollout.core.vision import IMAGE_WRAPPER_TOKENS, image_tokens
from cua_rollout.envs.client import RemoteDesktopEnv
from cua_rollout.envs.contract import DesktopEnv, StepResult
from cua_rollout.evaluation import Evaluator
from cua_rollout.model.service_pool import Generation, ModelServicePool
from cua_rollout.runtime.monitoring import Metrics
from cua_rollout.runtime.pool import Lease
from cua_rollout.runtime.storage import EpisodeWriter
from cua_rollout.runtime.trajectory import (
    ScreenshotFiles,
    discarded_generation,
    image_spans,
    step_record,
    text_step_record,
    tool_call_record,
)
from cua_rollout.runtime.utilization import StateClock
from cua_rollout.text.agent import (
    ANSWER_TOOL,
    SYSTEM_PROMPTS,
    TOOL_MALFORMED,
    TOOL_OVER_LIMIT,
    AgentCounts,
    assistant_message,
    first_messages,
    read_reply,
    tool_message,
)
from cua_rollout.text.benchmark import is_text_task, task_metric
from cua_rollout.text.metrics import JudgeError, judge, score

__all__ = ["Decider", "EnvFactory", "EpisodeError", "TrajectoryRunner", "episode_deadline_s",
           "episode_error", "open_leased_desktop"]

log = logging.getLogger(__name__)

# Deadline of a call to another actor that should answer at once (a release, a storage
# write's enqueue): a hung pool or storage must not hold an episode's slot forever.
_ACTOR_CALL_TIMEOUT_S = 60.0
# Finished episodes whose results a runner keeps for a coordinator that lost its call.
_RECENT_RESULTS = 1024
# Of a text episode's final answer, what its results.jsonl line keeps (traj.jsonl has it all).
_ANSWER_RECORD_CHARS = 2000
# The judge's sampling when llm_judgement asks the run's own model (text.judge unset).
_JUDGE_SAMPLING = SamplingConfig(temperature=0.0, top_p=1.0, max_tokens=256)


def episode_deadline_s(cfg: Config) -> float:
    """The longest an episode can take when every part of it uses its whole budget: the
    lease wait, setup and steps, a model outage waited out, the evaluation, the finish. The
    runner's watchdog ends an episode past it; the coordinator's, a runner that does not
    answer past it."""
    return (cfg.desktops.lease_timeout_s + cfg.runner.episode_timeout_s
            + cfg.model.outage_wait_s + cfg.runner.evaluation_timeout_s + LEASE_MARGIN_S)


async def within(awaitable: Awaitable[Any], timeout_s: float, what: str) -> Any:
    """Await an actor call with a deadline; past it, ``TimeoutError`` naming the call."""
    try:
        return await asyncio.wait_for(awaitable, timeout_s)
    except TimeoutError:
        raise TimeoutError(f"{what} did not answer within {timeout_s:.0f}s") from None

# Builds the environment of a leased desktop; the default speaks OSWorld's HTTP protocol.
EnvFactory = Callable[[Lease, DesktopsConfig], DesktopEnv]


def open_leased_desktop(lease: Lease, cfg: DesktopsConfig) -> DesktopEnv:
    """The leased desktop's client, with a connection of its own (closed by ``close()``)."""
    return RemoteDesktopEnv.for_lease(lease.url, cfg, name=lease.desktop_id)


class EpisodeError(NamedTuple):
    """How an episode that raised an error ends (see ``cua_rollout.core.errors``)."""

    text: str
    retryable: bool
    healthy: bool               # the desktop it held may be lent again without a check
    outage: str | None = None   # "model"/"desktop": requeued without using an attempt
    fatal: bool = False         # the run stops; the episode is not recorded


def episode_error(exc: Exception, desktop: str | None) -> EpisodeError:
    """How an episode that raised ``exc`` ends. Whether another attempt may succeed, whether
    the desktop is suspect, whether a whole side of the service is down and whether the run
    must stop are properties of the error's class; an error no layer translated is a bug of
    ours: recorded, never retried."""
    if not isinstance(exc, RolloutError):
        return EpisodeError(f"{type(exc).__name__}: {exc}", False, True)
    if isinstance(exc, DesktopError):
        text = f"desktop {desktop or '(none leased)'}: {exc}"
    elif isinstance(exc, UnsupportedEvaluator):
        text = f"evaluator: {exc}"
    elif isinstance(exc, ModelRequestError):
        text = f"model rejected the request: {exc}"
    else:
        text = f"{type(exc).__name__}: {exc}"
    return EpisodeError(text, exc.retryable, not exc.blames_desktop, exc.outage, exc.fatal)


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
                 healthy: bool = True, fatal: bool = False):
        super().__init__(error or status)
        self.status, self.error, self.retryable = status, error, retryable
        self.healthy = healthy
        self.fatal = fatal


class _Episode:
    """The state of one running episode on a desktop."""

    uses_desktop = True  # leases a desktop (a text episode does not)

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
        self.model_version: str | None = None   # of the last generation
        self.model_versions: list[str] = []     # every version a generation came from, in order
        self.desktop: str | None = None
        self.lease: Lease | None = None
        self.begun = False  # the episode's directory exists (its files are written at the end)
        self.env: Any = None
        self.timing = {"model_s": 0.0, "env_s": 0.0, "overhead_s": 0.0, "reset_s": 0.0,
                       "evaluation_s": 0.0, "lease_wait_s": 0.0, "outage_wait_s": 0.0}
        self.last_messages: list[dict[str, Any]] | None = None
        self.reset_done = False
        self.held_record: dict[str, Any] | None = None
        self.pending_record: dict[str, Any] | None = None  # the step whose action runs
        # Unique per run of an attempt (an outage requeues the same attempt): a revoked
        # owner (release_owned) never matches a later run's lease.
        self.owner = f"{runner.runner_id}/{self.session_id}/{uuid.uuid4().hex[:12]}"
        self.deadline: asyncio.Timeout | None = None   # of setup and steps, while they run
        self.outage: str | None = None
        self.fatal = False
        # What its desktop does now (cua_rollout/runtime/utilization.py).
        self.phase: str | None = None

    # ----------------------------------------------------------------- the loop

    async def run(self) -> EpisodeResult:
        cfg = self.cfg
        status, error, retryable, reward = Status.FAILURE, None, False, None
        healthy = True
        try:
            env = await self._open()
            await within(self.writer.begin(self.task), _ACTOR_CALL_TIMEOUT_S,
                         "the storage (begin)")
            try:
                async with asyncio.timeout(cfg.runner.episode_timeout_s) as self.deadline:
                    status = await self._act(env)
            except TimeoutError:
                if not self.reset_done:
                    raise _EpisodeEnded(Status.INFRA_ERROR, "the task's setup outlived the "
                                        "episode deadline", retryable=True,
                                        healthy=False) from None
                status, error = Status.TIMEOUT, (
                    f"episode deadline of {cfg.runner.episode_timeout_s:.0f}s reached")
            finally:
                self.deadline = None
            self._enter("evaluate")
            reward = await self._evaluate(env)
            self._enter("other")
            if status not in (Status.MAX_STEPS, Status.TIMEOUT):
                status = Status.SUCCESS if reward >= SUCCESS_REWARD else Status.FAILURE
        except _EpisodeEnded as ended:
            status, error, retryable = ended.status, ended.error, ended.retryable
            healthy, self.fatal = ended.healthy, ended.fatal
        except asyncio.CancelledError:
            status, error = Status.CANCELLED, "cancelled"
            self._finish_in_background(self.lease, True, status, error, None)
            raise
        except Exception as exc:
            if not isinstance(exc, RolloutError):
                log.exception("episode %s failed unexpectedly", self.spec.episode_id)
            status = Status.INFRA_ERROR
            error, retryable, healthy, self.outage, self.fatal = episode_error(exc, self.desktop)
        if status == Status.INFRA_ERROR:
            reward = None
        # A cancel arriving while the episode is being finished must not cut its writes or
        # the desktop's release short: the finish completes in the background.
        finish = asyncio.ensure_future(
            self._finish(self.lease, healthy, status, error, retryable, reward))
        try:
            return await asyncio.shield(finish)
        except asyncio.CancelledError:
            self.r.background.add(finish)
            raise

    async def _open(self) -> Any:
        """The episode's environment: a leased desktop's (its directory begins here)."""
        waited = time.monotonic()
        self.lease = await self._lease()
        self.timing["lease_wait_s"] = time.monotonic() - waited
        self._enter("other")
        self.desktop = self.lease.desktop_id
        self.begun = True
        env = self.env = self.r.env_factory(self.lease, self.cfg.desktops)
        return env

    async def _lease(self) -> Lease:
        """A desktop for this attempt. The pool's own deadline is the lease timeout; a pool
        that does not answer well past it is a desktop outage too."""
        timeout_s = self.cfg.desktops.lease_timeout_s
        try:
            return await asyncio.wait_for(
                call(self.r.desktop_pool, "lease", self.owner, timeout_s, self.avoid),
                timeout_s + _ACTOR_CALL_TIMEOUT_S)
        except TimeoutError:
            raise DesktopUnavailable(f"the desktop pool did not answer a lease within "
                                     f"{timeout_s + _ACTOR_CALL_TIMEOUT_S:.0f}s") from None

    async def _act(self, env: DesktopEnv) -> str:
        """Setup, then steps until the agent ends; returns ``failure`` (to be scored) or
        ``max_steps``."""
        t0 = time.monotonic()
        self._enter("setup")
        shot = await env.reset(self.task)
        self.timing["reset_s"] = time.monotonic() - t0
        self._enter("other")
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
        wall_started = time.time()
        width, height = shot.size
        messages = build_messages(
            str(self.task.get("instruction", "")), self.history, shot,
            history_images=runner_cfg.history_images, history_texts=runner_cfg.history_texts,
            language=runner_cfg.prompt_language, call_user=runner_cfg.prompt_call_user,
            note=runner_cfg.prompt_note,
        )
        self.last_messages = messages
        self._enter("model")
        generation, parsed, discarded, model_s = await self._generate(messages, width, height)
        self._enter("other")
        sampling = self.cfg.model.sampling
        record = step_record(step, generation, parsed, len(discarded), self.files.file_of(shot),
                             token_ids=sampling.return_token_ids, logprobs=sampling.logprobs,
                             constrained=self.cfg.model.constrain_actions)
        if discarded:
            record["discarded"] = discarded
        self._record_images(record, messages, generation, width, height)
        self.history.append(Turn(shot, generation.text))
        self._forget_old_screenshot()
        self.steps = step

        env_started = time.monotonic()
        code, terminal = self.decider.decide(parsed)
        record["action"] = terminal if code is None else (
            code if terminal in (None, WAIT) else f"{code}\n{terminal}")
        # The step counts from here (its action may run): a deadline or a cancel before it
        # is held below still writes its line, so result.steps is traj.jsonl's line count.
        self.pending_record = record
        split = {"action_s": 0.0, "pause_s": 0.0, "screenshot_s": 0.0}
        if code is not None:
            self._enter("action")
            result = await env.step(code)
            record["info"] = {"returncode": result.returncode, "error": result.error or None}
            split["action_s"] = time.monotonic() - env_started
            # The pause after an action (the env contract's pause_s), timed on its own.
            await self._pause(runner_cfg.action_pause_s, split)
        if terminal == WAIT:
            self._enter("pause")
            t0 = time.monotonic()
            await env.step(WAIT, pause_s=runner_cfg.wait_s)
            split["pause_s"] += time.monotonic() - t0
        ended = terminal in (DONE, FAIL)
        next_shot = None
        if not ended:
            self._enter("screenshot")
            t0 = time.monotonic()
            next_shot = await env.observe()
            split["screenshot_s"] = time.monotonic() - t0
        self._enter("other")
        self._time_step(record, model_s, time.monotonic() - env_started,
                        time.monotonic() - step_started, split, wall_started)
        record["done"] = ended
        # A step's line is written with the next step's screenshot (or at the end, when
        # the last line gets the final reward and done=true, as in OSWorld's traj.jsonl).
        previous, self.held_record, self.pending_record = self.held_record, record, None
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

    async def _pause(self, pause_s: float, split: dict[str, float]) -> None:
        if pause_s > 0:
            self._enter("pause")
            t0 = time.monotonic()
            await asyncio.sleep(pause_s)
            split["pause_s"] += time.monotonic() - t0

    def _enter(self, phase: str | None) -> None:
        """The episode's desktop now does ``phase`` (None: the episode gave it back)."""
        self.r.phases.move(self.phase, phase)
        self.phase = phase

    def _time_step(self, record: dict[str, Any], model_s: float, env_s: float,
                   step_s: float, split: dict[str, float], started_at: float) -> None:
        """The step's traj.jsonl ``timing``: model / env (= action + pause + screenshot) /
        overhead seconds, the whole step, and when it started (epoch s)."""
        timing = {"model_s": model_s, "env_s": env_s,
                  "overhead_s": max(0.0, step_s - model_s - env_s), "step_s": step_s,
                  **split}
        record["timing"] = {**{k: round(v, 6) for k, v in timing.items()},
                            "started_at": round(started_at, 6)}
        for key in ("model_s", "env_s", "overhead_s"):
            self.timing[key] += timing[key]
        self.r.step_done(timing, acted=split["action_s"] > 0)

    def _record_images(self, record: dict[str, Any], messages: list[dict[str, Any]],
                       generation: Generation, width: int, height: int) -> None:
        """What rebuilding the multimodal prompt needs: each image of the request in order
        (its file, its placeholder token count) and, when the server returned the prompt's
        token ids, where those placeholders are in them."""
        model = self.cfg.model
        tokens = image_tokens(width, height, min_pixels=model.min_pixels,
                              max_pixels=model.max_pixels)
        files = self.files.image_files(messages)
        record["images"] = [{"file": f, "tokens": tokens} for f in files]
        if generation.prompt_token_ids is not None:
            record["image_spans"] = image_spans(generation.prompt_token_ids,
                                                [tokens] * len(files))

    def _saw_version(self, version: str | None) -> None:
        if version is None:
            return
        self.model_version = version
        if version not in self.model_versions:
            self.model_versions.append(version)

    async def _generate(
        self, messages: list[dict[str, Any]], width: int, height: int
    ) -> tuple[Generation, ParsedResponse | None, list[dict[str, Any]], float]:
        """Ask the model; an unparseable reply is asked again up to ``max_parse_retries``
        times, after which the episode ends as the UI-TARS agents end it (FAIL). Returns
        the reply, its parse, the replies dropped before it (kept for the trajectory) and
        the time spent asking."""
        cfg = self.cfg
        model = cfg.model
        pixels = {"min_pixels": model.min_pixels, "max_pixels": model.max_pixels}
        regex = action_regex(width, height, model.family, call_user=cfg.runner.prompt_call_user,
                             **pixels) if model.constrain_actions else None
        images = sum(1 for m in messages if isinstance(m.get("content"), list)
                     for part in m["content"] if part.get("type") == "image_url")
        per_image = IMAGE_WRAPPER_TOKENS + image_tokens(width, height, **pixels)
        least_tokens = (images * per_image + model.sampling.max_tokens,
                        f"{images} screenshot(s) of {width}x{height} ({per_image} tokens each) "
                        f"and a reply of up to {model.sampling.max_tokens} tokens")
        model_s = 0.0
        sampling = model.sampling
        discarded: list[dict[str, Any]] = []
        for retry in range(cfg.runner.max_parse_retries + 1):
            generation, asked_s = await self._ask_model(messages, regex=regex,
                                                        least_tokens=least_tokens)
            model_s += asked_s
            try:
                parsed = parse_response(generation.text, width, height, model.family, **pixels)
                if not parsed.actions:
                    raise ActionParseError("the reply has no action", generation.text)
                return generation, parsed, discarded, model_s
            except ActionParseError as exc:
                self.parse_failures += 1
                log.info("episode %s: unparseable reply (%s), attempt %d", self.spec.episode_id,
                         exc, retry + 1)
                if retry < cfg.runner.max_parse_retries:  # the last one is the step's reply
                    discarded.append(discarded_generation(
                        generation, str(exc), token_ids=sampling.return_token_ids,
                        logprobs=sampling.logprobs))
        return generation, None, discarded, model_s

    async def _ask_model(self, messages: list[dict[str, Any]], **options: Any
                         ) -> tuple[Generation, float]:
        """One generation (``options``: those of ``ModelServicePool.generate``), an outage of
        the model side waited out (``_wait_out_model_outage``); the reply and the seconds
        spent asking, the wait included."""
        started = time.monotonic()
        while True:
            try:
                generation = await self.r.model.generate(messages, self.session_id, **options)
                break
            except ModelUnavailable as exc:
                if exc.outage is None:
                    raise
                await self._wait_out_model_outage(exc)
        if generation.endpoint not in self.endpoints:
            self.endpoints.append(generation.endpoint)
        self._saw_version(generation.model_version)
        return generation, time.monotonic() - started

    async def _wait_out_model_outage(self, exc: ModelUnavailable) -> None:
        """No model endpoint is live: wait for one with the episode's deadline stopped (an
        outage is not the agent's time), up to ``model.outage_wait_s`` in all per episode.
        Past that, ``exc`` ends the attempt as an outage: requeued, no attempt used."""
        left = self.cfg.model.outage_wait_s - self.timing["outage_wait_s"]
        if left <= 0:
            raise exc
        loop = asyncio.get_running_loop()
        deadline = self.deadline
        remaining = None
        if deadline is not None and (when := deadline.when()) is not None:
            remaining = when - loop.time()
            deadline.reschedule(None)
        log.info("episode %s waits for a model endpoint: %s", self.spec.episode_id, exc)
        t0 = time.monotonic()
        try:
            back = await self.r.model.wait_until_live(left)
        finally:
            self.timing["outage_wait_s"] += time.monotonic() - t0
            if deadline is not None and remaining is not None:
                deadline.reschedule(loop.time() + remaining)
        if not back:
            raise ModelUnavailable(
                f"no model endpoint for {self.timing['outage_wait_s']:.0f}s "
                f"({self.r.model.outage_status()})", outage=True) from exc

    async def _evaluate(self, env: DesktopEnv) -> float:
        t0 = time.monotonic()
        try:
            reward = await asyncio.wait_for(
                self.r.evaluator.evaluate(env, self.task,  # type: ignore[arg-type]
                                          self.last_action,
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
            first_model_version=self.model_versions[0] if self.model_versions else None,
            model_versions=list(self.model_versions), pass_index=self.spec.pass_index,
            group_id=self.spec.group_id, group_size=self.spec.group_size,
            desktops_tried=[*self.avoid, *([self.desktop] if self.desktop else [])],
            error=error, retryable=retryable, last_action=self.last_action,
            parse_failures=self.parse_failures,
            timing={k: round(v, 4) for k, v in self.timing.items()},
            runner=self.r.runner_id, node=self.r.node_id,
            outage=self.outage if status == Status.INFRA_ERROR else None,
            fatal=self.fatal and status == Status.INFRA_ERROR,
        )

    async def _finish(self, lease: Any, healthy: bool, status: str, error: str | None,
                      retryable: bool, reward: float | None) -> EpisodeResult:
        self.r.model.end_session(self.session_id)
        self._enter(None)
        try:
            if not self.uses_desktop:
                pass
            elif lease is not None:
                await within(call(self.r.desktop_pool, "release", lease.lease_id, healthy),
                             _ACTOR_CALL_TIMEOUT_S, "the desktop pool (release)")
            else:
                # A lease granted after this episode stopped waiting for it (a cancel, a
                # deadline, a call still in transit) must not stay lent to nobody: the pool
                # releases what this owner holds and refuses it any later grant.
                await within(call(self.r.desktop_pool, "release_owned", self.owner, True),
                             _ACTOR_CALL_TIMEOUT_S, "the desktop pool (release_owned)")
        except Exception as exc:  # the pool reclaims the lease at lease_max_s at the latest
            log.error("episode %s: returning its desktop failed: %s", self.spec.episode_id, exc)
        try:
            if self.begun:  # the episode's directory exists
                # The held line (the last finished step) and a step cut short by a deadline
                # or a cancel; the last of them carries the reward and done=true.
                lines = [r for r in (self.held_record, self.pending_record) if r is not None]
                self.held_record = self.pending_record = None
                for n, line in enumerate(lines, 1):
                    if n == len(lines):
                        line.update(done=True, reward=reward)
                    await within(self.writer.step(line), _ACTOR_CALL_TIMEOUT_S, "the storage")
                failed = await within(
                    self.writer.finish(self.result(status, error, retryable, reward).record(),
                                       self.files.messages_for_disk(self.last_messages)),
                    _ACTOR_CALL_TIMEOUT_S, "the storage (finish)")
                if failed:
                    raise StorageError(failed)
            if status == Status.CANCELLED:  # no result line will come: the storage forgets it
                await within(call(self.r.storage, "forget_episode", self.spec.episode_id,
                                  self.spec.attempt), _ACTOR_CALL_TIMEOUT_S, "the storage")
        except Exception as exc:
            # Files that were not written make the episode an infra error that stops the run
            # (a full disk, a dead storage actor): never a result whose files are missing.
            if status != Status.CANCELLED:
                log.error("episode %s: its files were not written: %s", self.spec.episode_id,
                          exc)
                status, reward, retryable = Status.INFRA_ERROR, None, False
                error, self.fatal = f"storage: {one_line(exc)}", True
        finally:
            # After the release (its call is sent before anything here can be cancelled).
            if self.env is not None:
                env, self.env = self.env, None
                with contextlib.suppress(Exception):  # closing a socket cannot fail it
                    await env.close()
        return self.result(status, error, retryable, reward)

    def _finish_in_background(self, lease: Any, healthy: bool, status: str,
                              error: str | None, reward: float | None) -> None:
        """On cancellation: return the desktop and write what we have without awaiting in a
        cancelled task."""
        self.r.background.spawn(self._finish(lease, healthy, status, error, False, reward))


async def _close_when_made(opening: Awaitable[Any]) -> None:
    """Close the environment ``opening`` makes, when it does (an episode cancelled while
    its environment was being made)."""
    with contextlib.suppress(Exception):
        env = await opening
        await env.close()


async def _all_or_none(calls: list[Awaitable[StepResult]]) -> list[StepResult]:
    """Run a turn's tool calls concurrently; when one raises (a tool that cannot run, a
    cancel), the others are cancelled and awaited before the error goes on: no call outlives
    its episode's environment."""
    tasks = [asyncio.ensure_future(c) for c in calls]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise


class _TextEpisode(_Episode):
    """A text episode (math, py, rag, web): no desktop; a text environment's tools in its
    place (``cua_rollout.text.envs``), a tool-calling conversation of up to ``text.max_turns``
    replies (``cua_rollout.text.agent``), scored by the item's answer metric. Everything else
    (storage, deadlines, model outages, retries, results) is the desktop episode's."""

    uses_desktop = False

    def __init__(self, runner: TrajectoryRunner, spec: EpisodeSpec, avoid: list[str]) -> None:
        super().__init__(runner, spec, avoid)
        self.counts = AgentCounts()
        self.answer: str | None = None

    def _enter(self, phase: str | None) -> None:
        pass  # the utilization clocks count desktops' time; a text episode holds none

    async def _open(self) -> Any:
        self.begun = True
        # In a thread: the first rag episode of a process builds (or loads) the index.
        opening = asyncio.ensure_future(
            asyncio.to_thread(self.r.text_env, self.task, self.session_id))
        try:
            env = await asyncio.shield(opening)
        except asyncio.CancelledError:
            # The thread runs on: the environment it makes (a scratch directory, clients) is
            # closed once made, or nothing would.
            self.r.background.spawn(_close_when_made(opening))
            raise
        self.env = env
        return env

    async def _act(self, env: Any) -> str:
        text_cfg = self.cfg.text
        t0 = time.monotonic()
        question = await env.reset(self.task)
        self.timing["reset_s"] = time.monotonic() - t0
        self.reset_done = True
        tools = [spec.openai() for spec in env.tools]
        if text_cfg.final_answer_tool:
            tools.append(ANSWER_TOOL.openai())
        prompt = text_cfg.system_prompt or SYSTEM_PROMPTS[env.mode]
        messages = first_messages(question, prompt)
        self.last_messages = messages
        for turn in range(1, text_cfg.max_turns + 1):
            if await self._turn(env, turn, messages, tools):
                return Status.FAILURE  # answered: scored next
        return Status.MAX_STEPS

    async def _turn(self, env: Any, turn: int, messages: list[dict[str, Any]],
                    tools: list[dict[str, Any]]) -> bool:
        """One reply and the calls it makes; True when it ends the episode."""
        text_cfg = self.cfg.text
        step_started = time.monotonic()
        wall_started = time.time()
        generation, model_s = await self._ask_model(
            messages, tools=tools or None, tool_choice=text_cfg.tool_choice if tools else None)
        sampling = self.cfg.model.sampling
        record = text_step_record(turn, generation, token_ids=sampling.return_token_ids,
                                  logprobs=sampling.logprobs)
        reply = read_reply(generation.text, generation.tool_calls,
                           answer_tool=text_cfg.final_answer_tool)
        self.steps = turn  # a turn is a step
        self.pending_record = record
        env_started = time.monotonic()
        ended = not reply.calls and reply.answer_problem is None
        if ended:
            self.answer = reply.answer
            # The conversation on disk (messages.json) ends with the answering reply.
            messages.append(assistant_message(generation.text, [reply.answer_call]
                                              if reply.answer_call is not None else []))
            self.last_action = "answer"
            record["action"] = "answer"
            record["answer"] = reply.answer
        else:
            limit = text_cfg.max_tool_calls_per_turn
            run, over = reply.calls[:limit], reply.calls[limit:]
            ran = await _all_or_none([env.step(c) for c in run])
            results: dict[str, StepResult] = {c.id: r for c, r in zip(run, ran, strict=True)}
            skipped = (f"error: not run: a reply may make at most {limit} tool calls "
                       f"(text.max_tool_calls_per_turn)")
            for call in over:
                results[call.id] = StepResult(call.name, TOOL_OVER_LIMIT, skipped, skipped)
            if reply.answer_call is not None and reply.answer_problem is not None:
                text = f"error: {reply.answer_problem}"
                results[reply.answer_call.id] = StepResult(reply.answer_call.name,
                                                           TOOL_MALFORMED, text, text)
            # Answered in the order the model made the calls.
            answered = [c for c in reply.all_calls if c.id in results]
            messages.append(assistant_message(generation.text, answered))
            record["tool_calls"] = []
            for call in answered:
                result = results[call.id]
                messages.append(tool_message(call, result.output))
                self.counts.count(call.name, result)
                record["tool_calls"].append(tool_call_record(call, result))
            record["action"] = ",".join(c.name for c in answered)
            self.last_action = record["action"]
        env_s = time.monotonic() - env_started
        split = {"action_s": env_s, "pause_s": 0.0, "screenshot_s": 0.0}
        self._time_step(record, model_s, env_s, time.monotonic() - step_started, split,
                        wall_started)
        record["done"] = ended
        previous, self.held_record, self.pending_record = self.held_record, record, None
        if previous is not None:
            await self.writer.step(previous)
        return ended

    async def _evaluate(self, env: Any) -> float:
        t0 = time.monotonic()
        metric, variant, tolerance = task_metric(self.task)
        try:
            async with asyncio.timeout(self.cfg.runner.evaluation_timeout_s):
                if metric == "llm_judgement":
                    reward = await judge(self.answer, self.task["answer"],
                                         str(self.task.get("question", "")),
                                         ask=self.r.judge_ask, variant=variant)
                else:  # CPU-bound (similarity of long texts): off the loop
                    reward = await asyncio.to_thread(score, metric, self.answer,
                                                     self.task["answer"], variant=variant,
                                                     tolerance=tolerance)
        except TimeoutError:
            raise _EpisodeEnded(Status.INFRA_ERROR, "evaluation timed out after "
                                f"{self.cfg.runner.evaluation_timeout_s:.0f}s",
                                retryable=True) from None
        except JudgeError as exc:
            raise EvaluationError(f"llm_judgement: {exc}") from exc
        finally:
            self.timing["evaluation_s"] = time.monotonic() - t0
        return min(1.0, max(0.0, float(reward)))

    def result(self, status: str, error: str | None, retryable: bool,
               reward: float | None) -> EpisodeResult:
        out = super().result(status, error, retryable, reward)
        metric, variant, _ = task_metric(self.task)
        answer = self.answer
        if answer is not None and len(answer) > _ANSWER_RECORD_CHARS:
            answer = answer[:_ANSWER_RECORD_CHARS] + "…"
        out.text = {"mode": self.task.get("mode"), "benchmark": self.task.get("benchmark"),
                    "metric": metric, "variant": variant, "answer": answer,
                    "turns": self.steps, **self.counts.record()}
        return out


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
        self.desktop_pool = desktop_pool
        self.storage = storage
        self.runner_id = runner_id
        self.model_state_dir = model_state_dir
        self.env_factory = env_factory
        self.text_env_factory = text_env_factory
        self.node_id = _node_id()
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
        kind = _TextEpisode if is_text_task(spec.task) else _Episode
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
        }

    async def close(self) -> None:
        await self.cancel()
        await self.background.wait()
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
