"""One episode on a desktop, as data through the layers: lease a desktop, run the task's
setup, then screenshot -> agent request -> model -> agent decision -> action until the agent
ends, ``max_steps`` or the deadline; score with the task's evaluator; release the desktop;
write everything through the storage. How an error ends an episode is written on the error's
class (``cua_rollout.core.errors``) and read here once (``episode_error``); what a step
records is ``cua_rollout.runtime.trajectory``'s. The runner (runner.py) holds many."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any, NamedTuple, Protocol

from cua_rollout.agents.base import AgentRequest, DesktopAgent, make_agent
from cua_rollout.config import LEASE_MARGIN_S, Config, DesktopsConfig
from cua_rollout.core.aio import TaskSet
from cua_rollout.core.errors import (
    ActionParseError,
    DesktopError,
    DesktopUnavailable,
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
from cua_rollout.envs.client import RemoteDesktopEnv
from cua_rollout.envs.contract import DesktopEnv
from cua_rollout.evaluation import Evaluator
from cua_rollout.model.client import Generation, ModelServicePool
from cua_rollout.runtime.actors import PoolClient, StorageClient
from cua_rollout.runtime.pool import Lease
from cua_rollout.runtime.storage import EpisodeWriter
from cua_rollout.runtime.trajectory import (
    ScreenshotFiles,
    discarded_generation,
    image_spans,
    step_record,
)
from cua_rollout.runtime.utilization import StateClock

__all__ = ["ACTOR_CALL_TIMEOUT_S", "DesktopEpisode", "EnvFactory", "EpisodeEnded", "EpisodeError",
           "EpisodeHost", "episode_deadline_s", "episode_error", "open_leased_desktop", "within"]

log = logging.getLogger(__name__)

# Deadline of a call to another actor that should answer at once (a release, a storage
# write's enqueue): a hung pool or storage must not hold an episode's slot forever.
ACTOR_CALL_TIMEOUT_S = 60.0


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


class EpisodeHost(Protocol):
    """What an episode uses of the runner that holds it (``TrajectoryRunner``): the run's
    config, its actors, the process's model client and evaluator, the utilization clocks."""

    cfg: Config
    runner_id: str
    node_id: str | None
    desktop_pool: Any
    storage: Any
    env_factory: EnvFactory
    background: TaskSet
    phases: StateClock

    @property
    def model(self) -> ModelServicePool: ...

    @property
    def evaluator(self) -> Evaluator: ...

    def step_done(self, timing: dict[str, float], acted: bool = False) -> None: ...

    def text_env(self, task: dict[str, Any], name: str) -> Any: ...

    async def judge_ask(self, messages: list[dict[str, Any]]) -> str: ...


class EpisodeEnded(Exception):
    """Internal: the episode must stop now with this status (and optional error)."""

    def __init__(self, status: str, error: str | None = None, retryable: bool = False,
                 healthy: bool = True, fatal: bool = False):
        super().__init__(error or status)
        self.status, self.error, self.retryable = status, error, retryable
        self.healthy = healthy
        self.fatal = fatal


class DesktopEpisode:
    """The state of one running episode on a desktop."""

    uses_desktop = True  # leases a desktop (a text episode does not)

    def __init__(self, runner: EpisodeHost, spec: EpisodeSpec, avoid: list[str]) -> None:
        self.r = runner
        self.cfg = runner.cfg
        self.spec = spec
        self.avoid = avoid
        self.task = spec.task
        self.started_at = time.time()
        self.session_id = f"{spec.episode_id}#{spec.attempt}"
        self.files = ScreenshotFiles()
        self.writer = EpisodeWriter(runner.storage, spec.episode_id, spec.attempt)
        self.steps = 0
        self.parse_failures = 0
        self.agent = self._make_agent()
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
            await within(self.writer.begin(self.task), ACTOR_CALL_TIMEOUT_S,
                         "the storage (begin)")
            try:
                async with asyncio.timeout(cfg.runner.episode_timeout_s) as self.deadline:
                    status = await self._act(env)
            except TimeoutError:
                if not self.reset_done:
                    raise EpisodeEnded(Status.INFRA_ERROR, "the task's setup outlived the "
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
        except EpisodeEnded as ended:
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
                PoolClient(self.r.desktop_pool).lease(self.owner, timeout_s, self.avoid),
                timeout_s + ACTOR_CALL_TIMEOUT_S)
        except TimeoutError:
            raise DesktopUnavailable(f"the desktop pool did not answer a lease within "
                                     f"{timeout_s + ACTOR_CALL_TIMEOUT_S:.0f}s") from None

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
        request = self.agent.request(shot)
        self.last_messages = request.messages
        self._enter("model")
        generation, parsed, discarded, model_s = await self._generate(request, shot)
        self._enter("other")
        sampling = self.cfg.model.sampling
        record = step_record(step, generation, parsed, len(discarded), self.files.file_of(shot),
                             token_ids=sampling.return_token_ids, logprobs=sampling.logprobs,
                             constrained=self.agent.constrained)
        if discarded:
            record["discarded"] = discarded
        self._record_images(record, request, generation)
        gone = self.agent.remember(shot, generation.text)
        if gone is not None:  # left the image window: the last request no longer shows it
            self.files.forget(gone)
        self.steps = step

        env_started = time.monotonic()
        decision = self.agent.decide(parsed)
        code, terminal = decision.code, decision.terminal
        record["action"] = decision.action
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

    def _make_agent(self) -> DesktopAgent:
        return make_agent(self.cfg.agent, instruction=str(self.task.get("instruction", "")),
                          max_tokens=self.cfg.model.sampling.max_tokens)

    def _record_images(self, record: dict[str, Any], request: AgentRequest,
                       generation: Generation) -> None:
        """What rebuilding the multimodal prompt needs: each image of the request in order
        (its file, its placeholder token count) and, when the server returned the prompt's
        token ids, where those placeholders are in them."""
        tokens = request.image_tokens
        files = [self.files.file_of(s) for s in request.screenshots]
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
        self, request: AgentRequest, shot: Screenshot
    ) -> tuple[Generation, Any | None, list[dict[str, Any]], float]:
        """Ask the model; an unparseable reply is asked again up to the agent's
        ``max_parse_retries`` times, after which the episode ends as the UI-TARS agents end
        it (FAIL). Returns the reply, its parse, the replies dropped before it (kept for the
        trajectory) and the time spent asking."""
        retries = self.agent.max_parse_retries
        model_s = 0.0
        sampling = self.cfg.model.sampling
        discarded: list[dict[str, Any]] = []
        for retry in range(retries + 1):
            generation, asked_s = await self._ask_model(
                request.messages, regex=request.regex, least_tokens=request.least_tokens)
            model_s += asked_s
            try:
                parsed = self.agent.parse(generation.text, shot)
                return generation, parsed, discarded, model_s
            except ActionParseError as exc:
                self.parse_failures += 1
                log.info("episode %s: unparseable reply (%s), attempt %d", self.spec.episode_id,
                         exc, retry + 1)
                if retry < retries:  # the last one is the step's reply
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
            raise EpisodeEnded(Status.INFRA_ERROR, "evaluation timed out after "
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
                await within(PoolClient(self.r.desktop_pool).release(lease.lease_id, healthy),
                             ACTOR_CALL_TIMEOUT_S, "the desktop pool (release)")
            else:
                # A lease granted after this episode stopped waiting for it (a cancel, a
                # deadline, a call still in transit) must not stay lent to nobody: the pool
                # releases what this owner holds and refuses it any later grant.
                await within(PoolClient(self.r.desktop_pool).release_owned(self.owner, True),
                             ACTOR_CALL_TIMEOUT_S, "the desktop pool (release_owned)")
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
                    await within(self.writer.step(line), ACTOR_CALL_TIMEOUT_S, "the storage")
                failed = await within(
                    self.writer.finish(self.result(status, error, retryable, reward).record(),
                                       self.files.messages_for_disk(self.last_messages)),
                    ACTOR_CALL_TIMEOUT_S, "the storage (finish)")
                if failed:
                    raise StorageError(failed)
            if status == Status.CANCELLED:  # no result line will come: the storage forgets it
                await within(StorageClient(self.r.storage).forget_episode(
                    self.spec.episode_id, self.spec.attempt), ACTOR_CALL_TIMEOUT_S, "the storage")
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
