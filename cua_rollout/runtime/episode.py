"""The episode loop, one for every environment: open the environment, begin the task, then
observation -> agent request -> model -> agent decision -> carry it out, until the agent
ends, ``max_steps`` or the deadline; score; give the environment back; write everything
through the storage. Each step fills one ``StepRecord`` (trajectory.py) here. What differs
between a desktop (desktop_episode.py) and a text task (text_episode.py) is four hooks:
``_open``, ``_begin``, ``_carry_out`` and ``_evaluate`` (and ``_give_back``). How an error
ends an episode is written on the error's class (``cua_rollout.core.errors``) and read here
once (``episode_error``). The runner (runner.py) holds many episodes; the replay tool
(replay.py) runs one with a scripted model."""

from __future__ import annotations

import abc
import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any, NamedTuple, Protocol

from cua_rollout.agents.base import Agent, AgentRequest, Decision
from cua_rollout.config import LEASE_MARGIN_S, Config, DesktopsConfig
from cua_rollout.core.aio import TaskSet
from cua_rollout.core.errors import (
    ActionParseError,
    ConfigError,
    DesktopError,
    ModelRequestError,
    ModelUnavailable,
    RolloutError,
    StorageError,
    UnsupportedEvaluator,
    one_line,
)
from cua_rollout.core.layout import observation_file_name, screenshot_name
from cua_rollout.core.screenshot import Screenshot
from cua_rollout.core.types import (
    SUCCESS_REWARD,
    EpisodeResult,
    EpisodeSpec,
    Status,
    is_infeasible,
)
from cua_rollout.envs.contract import DesktopEnv
from cua_rollout.evaluation import Evaluator
from cua_rollout.model.client import Generation, ModelServicePool
from cua_rollout.runtime.pool import Lease
from cua_rollout.runtime.storage import EpisodeWriter, StepFiles
from cua_rollout.runtime.trajectory import (
    UNSET,
    ScreenshotFiles,
    StepRecord,
    discarded_generation,
    image_spans,
)
from cua_rollout.runtime.utilization import StateClock

__all__ = ["ACTOR_CALL_TIMEOUT_S", "EnvFactory", "Episode", "EpisodeEnded", "EpisodeError",
           "EpisodeHost", "episode_deadline_s", "episode_error", "within"]

log = logging.getLogger(__name__)

# Whether this process said that it sends screenshots inline although model.images is file.
_WARNED_INLINE: list[bool] = []

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


# Builds the environment of a leased desktop; the default speaks OSWorld's HTTP protocol
# (desktop_episode.open_leased_desktop).
EnvFactory = Callable[[Lease, DesktopsConfig], DesktopEnv]


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
    step_files: StepFiles | None  # None: every write goes through the storage actor
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


class Episode(abc.ABC):
    """One running episode: the loop and its state. Subclasses say what the environment is
    (``_open``, ``_give_back``), how a task begins (``_begin``), what a decision does in it
    (``_carry_out``) and how it is scored (``_evaluate``)."""

    def __init__(self, runner: EpisodeHost, spec: EpisodeSpec, avoid: list[str]) -> None:
        self.r = runner
        self.cfg = runner.cfg
        self.spec = spec
        self.avoid = avoid
        self.task = spec.task
        self.started_at = time.time()
        self.session_id = f"{spec.episode_id}#{spec.attempt}"
        self.files = ScreenshotFiles()
        self.writer = EpisodeWriter(runner.storage, spec.episode_id, spec.attempt,
                                    runner.step_files, spec.nonce)
        self.steps = 0
        self.max_steps = self.cfg.runner.max_steps
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
        self.held_record: StepRecord | None = None
        self.pending_record: StepRecord | None = None  # the step whose action runs
        # step -> the files of what its request showed besides the screenshot (tree, marks)
        self._observed: dict[int, tuple[Any, Any]] = {}
        # Unique per run of an attempt (an outage requeues the same attempt): a revoked
        # owner (release_owned) never matches a later run's lease.
        self.owner = f"{runner.runner_id}/{self.session_id}/{uuid.uuid4().hex[:12]}"
        self.deadline: asyncio.Timeout | None = None   # of setup and steps, while they run
        self.outage: str | None = None
        self.fatal = False
        self.evaluation_error: str | None = None  # scored 0: the evaluation raised on it
        # What its desktop does now (cua_rollout/runtime/utilization.py).
        self.phase: str | None = None

    # ----------------------------------------------------------------- the hooks

    @abc.abstractmethod
    def _make_agent(self) -> Agent:
        """The episode's agent."""

    @abc.abstractmethod
    async def _open(self) -> Any:
        """The episode's environment (its directory begins here: ``self.begun``)."""

    @abc.abstractmethod
    async def _begin(self, env: Any) -> Screenshot | None:
        """Set the task up; the first observation."""

    @abc.abstractmethod
    async def _carry_out(self, env: Any, decision: Decision, parsed: Any, record: StepRecord,
                         split: dict[str, float]) -> tuple[bool, Screenshot | None]:
        """Do what ``decision`` says (``parsed``: the agent's reading of the reply), filling
        ``record`` (``action``, ``info`` ...) and ``split`` (action, pause and screenshot
        seconds); whether the episode ended, and the next observation."""

    @abc.abstractmethod
    async def _evaluate(self, env: Any) -> float:
        """The episode's reward, in [0, 1]."""

    @abc.abstractmethod
    async def _give_back(self, healthy: bool) -> None:
        """Return what the episode holds besides its environment's connection (a lease)."""

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
            self.r.background.spawn(self._finish(True, status, error, False, None))
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
        finish = asyncio.ensure_future(self._finish(healthy, status, error, retryable, reward))
        try:
            return await asyncio.shield(finish)
        except asyncio.CancelledError:
            self.r.background.add(finish)
            raise

    async def _act(self, env: Any) -> str:
        """Begin the task, then steps until the agent ends; returns ``failure`` (to be
        scored) or ``max_steps``."""
        t0 = time.monotonic()
        self._enter("setup")
        observation = await self._begin(env)
        self.timing["reset_s"] = time.monotonic() - t0
        self._enter("other")
        self.reset_done = True
        for step in range(1, self.max_steps + 1):
            ended, observation = await self._step(env, step, observation)
            if ended:
                return Status.FAILURE  # the agent ended it: scored by the evaluator next
        return Status.MAX_STEPS

    async def _step(self, env: Any, step: int, observation: Screenshot | None
                    ) -> tuple[bool, Screenshot | None]:
        """One step from ``observation``: whether the agent ended the episode, and the next
        observation."""
        step_started = time.monotonic()
        wall_started = time.time()
        split = {"action_s": 0.0, "pause_s": 0.0, "screenshot_s": 0.0}
        request = await self._request(env, step, observation, split)
        self.last_messages = request.messages
        self._enter("model")
        generation, parsed, discarded, model_s = await self._generate(request, observation)
        self._enter("other")
        decision = self.agent.decide(parsed)
        record = self._record(step, generation, request, decision, discarded, observation)
        record.a11y_tree_file, record.marks_file = self._observed.pop(step, (UNSET, UNSET))
        gone = self.agent.remember(observation, generation.text)
        if gone is not None:  # left the image window: the last request no longer shows it
            self.files.forget(gone)
        self.steps = step
        # The step counts from here (its action may run): a deadline or a cancel before it
        # is held below still writes its line, so result.steps is traj.jsonl's line count.
        self.pending_record = record
        env_started = time.monotonic()
        ended, next_observation = await self._carry_out(env, decision, parsed, record, split)
        self._enter("other")
        self._time_step(record, model_s,
                        time.monotonic() - env_started + split.get("a11y_tree_s", 0.0),
                        time.monotonic() - step_started, split, wall_started)
        record.done = ended
        await self._keep(record, step, None if ended else next_observation)
        return ended, next_observation

    async def _request(self, env: Any, step: int, observation: Screenshot | None,
                       split: dict[str, float]) -> AgentRequest:
        """The agent's request for the step; an agent that observes the accessibility tree
        gets it first (its seconds: ``split["a11y_tree_s"]``, part of the step's env time),
        and what it showed besides the screenshot (the tree's table, the marked
        screenshot) is kept as the step's files for the viewer."""
        tree = None
        if self.agent.observes_a11y_tree:
            self._enter("screenshot")
            t0 = time.monotonic()
            tree = await self._accessibility_tree(env)
            split["a11y_tree_s"] = time.monotonic() - t0
            self._enter("other")
        request = self.agent.request(observation, tree)
        tree_file = marks_file = UNSET
        if self.cfg.runner.save_screenshots and request.a11y_tree is not None:
            tree_file = observation_file_name(step, "a11y_tree.txt")
            await self.writer.step(None, tree_file, request.a11y_tree.encode())
        if self.cfg.runner.save_screenshots and request.marked is not None:
            marks_file = observation_file_name(step, "marks.png")
            await self.writer.step(None, marks_file, request.marked.png)
            self.files.remember(request.marked, marks_file)
            request.marked.forget_png()
        self._observed[step] = (tree_file, marks_file)
        return request

    async def _accessibility_tree(self, env: Any) -> str:
        """The environment's accessibility tree (``DesktopProbe.accessibility_tree``)."""
        fetch = getattr(env, "accessibility_tree", None)
        if fetch is None:
            raise ConfigError(f"agent {self.agent.name} observes the accessibility tree, "
                              f"which this environment ({type(env).__name__}) does not have")
        tree: str = await fetch()
        return tree

    def _record(self, step: int, generation: Generation, request: AgentRequest,
                decision: Decision, discarded: list[dict[str, Any]],
                observation: Screenshot | None) -> StepRecord:
        """The step's traj.jsonl record as known once the agent decided: the reply, what the
        agent read from it, the request's images or tools."""
        sampling = self.cfg.model.sampling
        record = StepRecord.of_reply(step, generation, token_ids=sampling.return_token_ids,
                                     logprobs=sampling.logprobs)
        if isinstance(observation, Screenshot):
            record.observation_file = self.files.file_of(observation)
        record.agent, record.action_format = self.agent.name, self.agent.action_format
        if decision.parse is not None:
            record.thought, record.actions = decision.parse
            record.parse_retries = len(discarded)
            record.constrained = self.agent.constrained
        if request.tools is not None:
            record.response_tool_calls = generation.tool_calls
        if discarded:
            record.discarded = discarded
        if isinstance(observation, Screenshot):
            # What rebuilding the multimodal prompt needs: each image of the request in
            # order (its file, its placeholder token count) and, when the server returned the
            # prompt's token ids, where those placeholders are in them.
            tokens = request.image_tokens
            files = [self.files.file_of(s) for s in request.screenshots]
            record.images = [{"file": f, "tokens": tokens} for f in files]
            if generation.prompt_token_ids is not None:
                record.image_spans = image_spans(generation.prompt_token_ids,
                                                 [tokens] * len(files))
        return record

    async def _keep(self, record: StepRecord, step: int, observation: Screenshot | None
                    ) -> None:
        """Hold the step's line and write the one before: a line is written with the next
        step's screenshot (or at the end, when the last line gets the final reward and
        done=true, as in OSWorld's traj.jsonl)."""
        previous, self.held_record, self.pending_record = self.held_record, record, None
        if observation is None:
            if previous is not None:
                await self.writer.step(previous.line())
            return
        name = screenshot_name(step) if self.cfg.runner.save_screenshots else None
        record.screenshot_file = name
        await self.store_screenshot(observation, name,
                                    previous.line() if previous is not None else None)

    async def store_screenshot(self, shot: Screenshot, name: str | None,
                               line: dict[str, Any] | None = None) -> None:
        """Write the screenshot ``shot`` as ``name`` (and a traj.jsonl ``line`` before it);
        requests then send it by its file's path (``model.images: file``, where this process
        writes the file) or by its data URL, and its PNG bytes are let go."""
        if name is not None or line is not None:
            await self.writer.step(line, name, shot.png if name else None)
        if name is not None:
            path = (self.writer.local_file(name)
                    if self.cfg.model.images == "file" else None)
            if path is not None:
                shot.file_url = path.as_uri()
            elif self.cfg.model.images == "file" and not _WARNED_INLINE:
                _WARNED_INLINE.append(True)  # once per process
                log.warning("model.images is file, but the storage actor writes this "
                            "runner's step files (the run directory is not shared here): "
                            "its requests send screenshots inline")
            self.files.remember(shot, name)
        shot.forget_png()  # stored: requests need its path or its base64 only

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

    def _time_step(self, record: StepRecord, model_s: float, env_s: float,
                   step_s: float, split: dict[str, float], started_at: float) -> None:
        """The step's traj.jsonl ``timing``: model / env (= action + pause + screenshot) /
        overhead seconds, the whole step, and when it started (epoch s)."""
        timing = {"model_s": model_s, "env_s": env_s,
                  "overhead_s": max(0.0, step_s - model_s - env_s), "step_s": step_s,
                  **split}
        record.timing = {**{k: round(v, 6) for k, v in timing.items()},
                         "started_at": round(started_at, 6)}
        for key in ("model_s", "env_s", "overhead_s"):
            self.timing[key] += timing[key]
        self.r.step_done(timing, acted=split["action_s"] > 0)

    def _saw_version(self, version: str | None) -> None:
        if version is None:
            return
        self.model_version = version
        if version not in self.model_versions:
            self.model_versions.append(version)

    async def _generate(
        self, request: AgentRequest, observation: Screenshot | None
    ) -> tuple[Generation, Any | None, list[dict[str, Any]], float]:
        """Ask the model; an unparseable reply is asked again up to the agent's
        ``max_parse_retries`` times, after which the agent decides on None (UI-TARS agents
        FAIL). Returns the reply, its parse, the replies dropped before it (kept for the
        trajectory) and the time spent asking."""
        retries = self.agent.max_parse_retries
        model_s = 0.0
        sampling = self.cfg.model.sampling
        discarded: list[dict[str, Any]] = []
        for retry in range(retries + 1):
            generation, asked_s = await self._ask_model(request)
            model_s += asked_s
            try:
                parsed = self.agent.parse(generation.text, observation, generation.tool_calls)
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

    async def _ask_model(self, request: AgentRequest) -> tuple[Generation, float]:
        """One generation of ``request``, an outage of the model side waited out
        (``_wait_out_model_outage``); the reply and the seconds spent asking, the wait
        included."""
        started = time.monotonic()
        # A screenshot sent by its path is read by the server: its write must be done.
        if self.cfg.model.images == "file":
            await self.writer.flush()
        while True:
            try:
                generation = await self.r.model.generate(
                    request.messages, self.session_id, regex=request.regex,
                    least_tokens=request.least_tokens, tools=request.tools or None,
                    tool_choice=request.tool_choice)
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
            evaluation_error=self.evaluation_error if status != Status.INFRA_ERROR else None,
        )

    async def _finish(self, healthy: bool, status: str, error: str | None,
                      retryable: bool, reward: float | None) -> EpisodeResult:
        self.r.model.end_session(self.session_id)
        self._enter(None)
        try:
            await self._give_back(healthy)
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
                        line.done, line.reward = True, reward
                    await within(self.writer.step(line.line()), ACTOR_CALL_TIMEOUT_S,
                                 "the storage")
                failed = await within(
                    self.writer.finish(self.result(status, error, retryable, reward).record(),
                                       self.files.messages_for_disk(self.last_messages)),
                    ACTOR_CALL_TIMEOUT_S, "the storage (finish)")
                if failed:
                    raise StorageError(failed)
            if status == Status.CANCELLED and self.begun:  # no result line will come
                await within(self.writer.forget(), ACTOR_CALL_TIMEOUT_S, "the storage")
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
