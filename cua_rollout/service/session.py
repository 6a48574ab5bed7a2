"""One lease's desktop: its client (``RemoteDesktopEnv``), the task's setup (``reset``), an
action by kind (pyautogui code; a UI-TARS reply parsed by our UI-TARS agent against this
screen; one of OSWorld's computer-13 actions; WAIT / DONE / FAIL), observations (screenshot,
accessibility tree, terminal) and the task's score, as episodes score it (``score_task``).

A request that fails on the desktop is told apart: the desktop still answers its health
check (the request's own failure) or it does not (``desktop_died``: the lease ends and the
pool replaces the desktop)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Iterable
from typing import Any, TypeVar

from cua_rollout.agents.base import Agent, make_agent
from cua_rollout.agents.osworld import computer13
from cua_rollout.config import Config
from cua_rollout.core.errors import (
    ActionParseError,
    DesktopError,
    EvaluationError,
    TaskSetupError,
    UnsupportedEvaluator,
    one_line,
)
from cua_rollout.core.screenshot import Screenshot
from cua_rollout.core.types import DONE, FAIL, SPECIAL_ACTIONS, WAIT
from cua_rollout.envs.client import RemoteDesktopEnv
from cua_rollout.envs.service_protocol import ActRequest, Observation, encode_png
from cua_rollout.evaluation import Evaluator
from cua_rollout.runtime.desktop_episode import score_task
from cua_rollout.runtime.pool import Lease
from cua_rollout.service.failures import Refusal

__all__ = ["ActOutcome", "DesktopSession"]

log = logging.getLogger(__name__)

T = TypeVar("T")

# The agent whose parser reads ``uitars`` replies when the config's agent is another family.
_UITARS_AGENT = "uitars-1.5"


class ActOutcome(dict[str, Any]):
    """An action's result: ``ActReply``'s fields but the env id, step and expiry."""


class DesktopSession:
    """The desktop of one lease and what the lease did on it."""

    def __init__(self, lease: Lease, cfg: Config, evaluator: Evaluator,
                 env: RemoteDesktopEnv | None = None) -> None:
        self.lease = lease
        self.cfg = cfg
        self.evaluator = evaluator
        self.env = env or RemoteDesktopEnv.for_lease(lease.url, cfg.desktops,
                                                     name=lease.desktop_id)
        self.task: dict[str, Any] | None = None
        self.last_action: str | None = None
        self.shot: Screenshot | None = None
        self.lease_token: str | None = None
        self._agent: Agent | None = None
        # One call at a time on a desktop (an action and a score must not interleave); the
        # give-back waits for the call in progress.
        self.lock = asyncio.Lock()

    @property
    def desktop_id(self) -> str:
        return self.lease.desktop_id

    # ----------------------------------------------------------------- lifecycle

    async def begin(self, task: dict[str, Any] | None) -> Screenshot:
        """The task's setup (its first screenshot), or the clean desktop's screen."""
        self.task = task
        try:
            if task is None:
                self.shot = await self._on_desktop(self.env.observe(), "screenshot")
            else:
                self.shot = await self._on_desktop(self.env.reset(task), "the task's setup")
        except TaskSetupError as exc:
            raise Refusal("setup_failed", f"the setup of task {task and task.get('id')!r} "
                          f"failed on {self.desktop_id}: {one_line(exc)}") from exc
        except DesktopError as exc:  # the desktop answers, the setup's request failed
            raise Refusal("setup_failed", f"the setup of task {task and task.get('id')!r} "
                          f"failed on {self.desktop_id}: {one_line(exc)}") from exc
        return self.shot

    async def close_client_access(self) -> None:
        """The lease is over: clear its token on the desktop (``lease_token`` stays set when
        that fails: the desktop may still take it) and close the connection."""
        if self.lease_token is not None:
            try:
                await self.env.set_lease_token(None)
                self.lease_token = None
            except DesktopError as exc:
                log.warning("clearing the lease token of %s failed: %s", self.desktop_id, exc)
        await self.env.close()

    # ----------------------------------------------------------------- observations

    async def observe(self, kinds: Iterable[str], shot: Screenshot | None = None
                      ) -> Observation:
        """What ``kinds`` ask of the desktop now (``shot``: a screenshot just taken)."""
        kinds = set(kinds)
        obs = Observation()
        if "screenshot" in kinds:
            if shot is None:
                shot = await self._on_desktop(self.env.observe(), "screenshot")
            self.shot = shot
            obs.screenshot_png_b64 = encode_png(shot.png)
        if "a11y_tree" in kinds:
            obs.a11y_tree = await self._on_desktop(self.env.accessibility_tree(),
                                                   "accessibility tree")
        if "terminal" in kinds:
            obs.terminal = await self._on_desktop(self.env.terminal_output(), "terminal")
        return obs

    async def screenshot(self) -> Screenshot:
        self.shot = await self._on_desktop(self.env.observe(), "screenshot")
        return self.shot

    # ----------------------------------------------------------------- actions

    async def act(self, request: ActRequest, pause_s: float) -> ActOutcome:
        """Carry out one action: its code (if any) on the desktop, then the pause; a WAIT
        waits, DONE / FAIL end the episode (nothing runs)."""
        code, terminal, parse_error = await self._code_of(request)
        outcome = ActOutcome(executed=None, terminal=terminal, returncode=None, output="",
                             error="", parse_error=parse_error)
        if code is not None:
            result = await self._on_desktop(self.env.step(code, pause_s), "action")
            outcome.update(executed=code, returncode=result.returncode,
                           output=result.output, error=result.error)
        elif terminal == WAIT:
            await asyncio.sleep(pause_s)
        if terminal in (DONE, FAIL):
            self.last_action = terminal
        return outcome

    async def _code_of(self, request: ActRequest
                       ) -> tuple[str | None, str | None, str | None]:
        """(code to run, terminal action, parse error) of a request."""
        kind = request.kind
        if kind == "pyautogui":
            if not request.code:
                raise Refusal("bad_request", "kind pyautogui needs code (pyautogui source)")
            if request.code in SPECIAL_ACTIONS:
                return None, request.code, None
            return request.code, None, None
        if kind == "special":
            if request.code not in SPECIAL_ACTIONS:
                raise Refusal("bad_request", f"kind special needs code WAIT, DONE or FAIL, "
                              f"not {request.code!r}")
            return None, request.code, None
        shot = self.shot or await self.screenshot()
        if kind == "uitars":
            if not request.reply:
                raise Refusal("bad_request", "kind uitars needs reply (a UI-TARS reply: "
                              "Thought: ... Action: ...)")
            agent = self._uitars()
            try:
                parsed = agent.parse(request.reply, shot)
            except ActionParseError as exc:
                return None, None, one_line(exc)
            decision = agent.decide(parsed)
            return decision.code, decision.terminal, None
        # computer13
        if request.action is None:
            raise Refusal("bad_request", "kind computer13 needs action ({\"action_type\": "
                          "..., parameters})")
        width, height = shot.size
        try:
            action = computer13.validate(request.action, width, height)
        except ValueError as exc:
            raise Refusal("unparseable", f"computer13 action: {exc}") from exc
        special = computer13.SPECIAL_TYPES.get(action["action_type"])
        if special is not None:
            return None, special, None
        return computer13.action_code(action), None, None

    def _uitars(self) -> Agent:
        if self._agent is None:
            settings = self.cfg.agent
            if not settings.name.startswith("uitars"):
                settings = settings.model_copy(update={"name": _UITARS_AGENT})
            instruction = str((self.task or {}).get("instruction", ""))
            self._agent = make_agent(settings, instruction=instruction,
                                     max_tokens=self.cfg.model.sampling.max_tokens)
        return self._agent

    # ----------------------------------------------------------------- score

    async def evaluate(self, last_action: str | None) -> tuple[float, str | None, float]:
        """The task's reward, why it is 0 when the evaluator raised on what was left, and
        how long scoring took."""
        if self.task is None:
            raise Refusal("bad_request", "this lease has no task to evaluate (lease with one)")
        if not self.task.get("evaluator"):
            raise Refusal("bad_request", f"task {self.task.get('id')!r} has no evaluator")
        timeout_s = self.cfg.runner.evaluation_timeout_s
        started = time.monotonic()
        try:
            reward, error = await self._on_desktop(
                score_task(self.evaluator, self.env, self.task,
                           last_action or self.last_action, timeout_s), "evaluation")
        except TimeoutError:
            raise Refusal("evaluation_failed",
                          f"evaluation timed out after {timeout_s:g} s") from None
        except (EvaluationError, UnsupportedEvaluator) as exc:
            raise Refusal("evaluation_failed", one_line(exc)) from exc
        return reward, error, time.monotonic() - started

    # ----------------------------------------------------------------- failures

    async def _on_desktop(self, call: Awaitable[T], what: str) -> T:
        """``call`` on the desktop; a ``DesktopError`` from a desktop that no longer answers
        its health check is ``desktop_died`` (the request's own failures are raised as they
        are)."""
        try:
            return await call
        except DesktopError as exc:
            if isinstance(exc, TaskSetupError) or await self.env.health():
                raise
            raise Refusal("desktop_died", f"desktop {self.desktop_id} stopped answering "
                          f"({what}: {one_line(exc)}); the lease has ended and the desktop "
                          "is being replaced") from exc
