"""A Gymnasium environment over the desktop service (``cua-rollout desktops serve``): one
episode is one lease. ``AsyncCuaDesktopEnv`` holds the logic (async reset/step/close, for
callers on an event loop); ``CuaDesktopEnv`` is the ``gymnasium.Env`` that runs it on an
event loop of its own, in a thread, for synchronous callers.

reset   releases the previous lease, leases a desktop for the task (its setup runs on the
        service) and keeps the lease alive with heartbeats until the episode ends
step    one action; terminated on DONE/FAIL (UI-TARS ``finished()`` / ``call_user()``),
        truncated at ``max_steps``; both are scored by the task's evaluator, as OSWorld
        scores an episode that ran out of steps; the lease then goes back to the service
close   releases the lease and closes the client
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import os
import string
import threading
from collections.abc import Awaitable, Coroutine, Iterable, Sequence
from concurrent.futures import Future
from typing import Any, ClassVar, TypeVar

import gymnasium
import numpy as np
from gymnasium import spaces
from PIL import Image

from cua_rollout.core.errors import ConfigError
from cua_rollout.envs.service_client import (
    BadServiceRequest,
    DesktopServiceClient,
    KeepAlive,
    LeaseGone,
    ServiceError,
)
from cua_rollout.envs.service_protocol import (
    SPECIAL_ACTIONS,
    ActReply,
    LeaseReply,
    Observation,
    decode_png,
)

__all__ = [
    "ACTION_KINDS",
    "ENV_ID",
    "OBSERVE_KINDS",
    "AnyText",
    "AsyncCuaDesktopEnv",
    "CuaDesktopEnv",
    "LeaseEnded",
]

_T = TypeVar("_T")

# The registered id: gymnasium.make(ENV_ID, url=...).
ENV_ID = "cua_rollout/Desktop-v0"
ACTION_KINDS = ("pyautogui", "uitars", "computer13")
OBSERVE_KINDS = ("screenshot", "a11y_tree")
_TERMINAL = ("DONE", "FAIL")
# The longest action: a desktop runs code as one ``python -c`` argument, which Linux limits
# to 128 KiB (MAX_ARG_STRLEN); 30,000 characters stay under it even as 4-byte UTF-8.
MAX_ACTION_CHARS = 30_000
# The longest accessibility tree an observation may carry (OSWorld's trees of big
# documents reach a few MB of text).
MAX_A11Y_CHARS = 1 << 24
# What sample() draws from: printable text. Membership takes any str (AnyText).
_SAMPLE_CHARSET = string.ascii_letters + string.digits + string.punctuation + " "


class LeaseEnded(LeaseGone):
    """The episode's lease is over before the episode: the service lost it (restarted, the
    lease expired) or the desktop under it died. ``reset()`` leases another desktop."""


class AnyText(spaces.Text):
    """A ``Text`` space holding any string up to ``max_length`` characters (code, model
    replies and accessibility trees are Unicode); ``sample()`` draws printable ASCII."""

    def __init__(self, max_length: int, *, min_length: int = 0, seed: Any = None) -> None:
        super().__init__(max_length, min_length=min_length, charset=_SAMPLE_CHARSET, seed=seed)

    def contains(self, x: Any) -> bool:
        return isinstance(x, str) and self.min_length <= len(x) <= self.max_length

    def __repr__(self) -> str:
        return f"AnyText({self.min_length}, {self.max_length})"

    def __eq__(self, other: object, /) -> bool:
        return (isinstance(other, AnyText) and self.min_length == other.min_length
                and self.max_length == other.max_length)


def _spaces(screen: tuple[int, int], observe: Sequence[str]
            ) -> tuple[spaces.Space[Any], spaces.Space[Any]]:
    width, height = screen
    shot = spaces.Box(0, 255, (height, width, 3), np.uint8)
    observation: spaces.Space[Any] = shot
    if "a11y_tree" in observe:
        observation = spaces.Dict({"screenshot": shot, "a11y_tree": AnyText(MAX_A11Y_CHARS)})
    return observation, AnyText(MAX_ACTION_CHARS, min_length=1)


def _check_settings(url: str, action_kind: str, screen: Any, max_steps: int,
                    observe: Iterable[str], access: str | None) -> tuple[tuple[int, int],
                                                                         tuple[str, ...]]:
    if not isinstance(url, str) or not url.startswith(("http://", "https://")):
        raise ConfigError(f"CuaDesktopEnv: url {url!r} is not http(s)://host:port")
    if action_kind not in ACTION_KINDS:
        raise ConfigError(f"CuaDesktopEnv: action_kind {action_kind!r} is not one of "
                          f"{', '.join(ACTION_KINDS)}")
    if (not isinstance(screen, Sequence) or len(screen) != 2
            or not all(isinstance(v, int) and v > 0 for v in screen)):
        raise ConfigError(f"CuaDesktopEnv: screen {screen!r} is not (width, height) in pixels")
    if not isinstance(max_steps, int) or max_steps < 1:
        raise ConfigError(f"CuaDesktopEnv: max_steps {max_steps!r} is not an int >= 1")
    kinds = tuple(observe)
    unknown = [k for k in kinds if k not in OBSERVE_KINDS]
    if unknown or "screenshot" not in kinds or len(set(kinds)) != len(kinds):
        raise ConfigError(f"CuaDesktopEnv: observe {kinds!r} must hold 'screenshot' and may "
                          f"add 'a11y_tree' (each once)")
    if access not in (None, "direct", "relay"):
        raise ConfigError(f"CuaDesktopEnv: access {access!r} is not 'direct', 'relay' or None")
    return (screen[0], screen[1]), kinds


def _token(token: str | None, token_env: str | None) -> str | None:
    if token is not None and token_env is not None:
        raise ConfigError("CuaDesktopEnv: give token or token_env, not both")
    if token_env is None:
        return token
    value = os.environ.get(token_env)
    if not value:
        raise ConfigError(f"CuaDesktopEnv: token_env {token_env!r} is not set in the "
                          f"environment")
    return value


def _pixels(png: bytes) -> np.ndarray:
    with Image.open(io.BytesIO(png)) as image:
        return np.array(image.convert("RGB"), dtype=np.uint8)


class AsyncCuaDesktopEnv:
    """The environment for callers on an event loop: ``await reset()``, ``await step()``,
    ``await close()``, with ``CuaDesktopEnv``'s arguments, spaces and results. ``client`` is
    the service's client (its session is made on the loop of the first call)."""

    def __init__(self, url: str, token: str | None = None, *, token_env: str | None = None,
                 task: dict[str, Any] | None = None, action_kind: str = "pyautogui",
                 screen: tuple[int, int] = (1920, 1080), max_steps: int = 15,
                 observe: Iterable[str] = ("screenshot",), access: str | None = None,
                 wait_s: float | None = None, pause_s: float | None = None,
                 timeout_s: float = 300.0, label: str = "") -> None:
        self.screen, self.observe = _check_settings(url, action_kind, screen, max_steps,
                                                    observe, access)
        if task is not None and not isinstance(task, dict):
            raise ConfigError(f"CuaDesktopEnv: task is a {type(task).__name__}, not an "
                              f"OSWorld task dict")
        self.url = url
        self.task = task
        self.action_kind = action_kind
        self.max_steps = max_steps
        self.access = access
        self.wait_s = wait_s
        self.pause_s = pause_s
        self.label = label
        self.observation_space, self.action_space = _spaces(self.screen, self.observe)
        self.client = DesktopServiceClient(url, _token(token, token_env), timeout_s=timeout_s)
        self.lease: LeaseReply | None = None
        self.steps = 0
        self._episode_task: dict[str, Any] | None = None
        self._last_obs: Any = None
        self._last_png = b""
        self._keep_alive: contextlib.AsyncExitStack | None = None
        self._alive: KeepAlive | None = None
        self._ended = True
        self._closed = False

    # ----------------------------------------------------------------- the contract

    async def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None
                    ) -> tuple[Any, dict[str, Any]]:
        """Lease a desktop for ``options["task"]`` (else the constructor's task; None: a clean
        desktop, nothing to score). ``seed`` is accepted and unused: a desktop is not seeded."""
        del seed
        self._check_open()
        task = self.task
        if options:
            unknown = set(options) - {"task"}
            if unknown:
                raise ValueError(f"reset: unknown options {sorted(unknown)} (known: task)")
            task = options.get("task", task)
            if task is not None and not isinstance(task, dict):
                raise ValueError(f"reset: options['task'] is a {type(task).__name__}, not "
                                 f"an OSWorld task dict")
        await self._release()
        lease = await self.client.lease(task, wait_s=self.wait_s, access=self.access,
                                        observe=self.observe, label=self.label)
        self.lease, self._episode_task, self.steps, self._ended = lease, task, 0, False
        if (lease.screen.width, lease.screen.height) != self.screen:
            await self._release()
            raise ConfigError(
                f"CuaDesktopEnv: the service's desktop {lease.desktop_id} is "
                f"{lease.screen.width}x{lease.screen.height}, this env declares screen="
                f"{self.screen}: pass screen=({lease.screen.width}, {lease.screen.height})")
        self._keep_alive = contextlib.AsyncExitStack()
        self._alive = await self._keep_alive.enter_async_context(
            self.client.keep_alive(lease.env_id, max(lease.heartbeat_s, 0.1)))
        obs, png = await self._observation(lease)
        info = {"env_id": lease.env_id, "desktop_id": lease.desktop_id,
                "task_id": (task or {}).get("id"), "instruction": (task or {}).get("instruction"),
                "screen": self.screen, "setup_s": lease.setup_s, "waited_s": lease.waited_s,
                "screenshot_png": png}
        return obs, info

    async def step(self, action: str | dict[str, Any]
                   ) -> tuple[Any, float, bool, bool, dict[str, Any]]:
        """One action of ``action_kind`` (computer13: a dict or its JSON). A terminal action
        (DONE/FAIL) ends the episode scored; ``max_steps`` truncates it, scored too."""
        self._check_open()
        if self.lease is None or self._ended:
            raise gymnasium.error.ResetNeeded(
                "step: no episode is running (call reset() first, or again after the "
                "episode terminated or was truncated)")
        lease = self.lease
        self._check_alive(lease)
        self.steps += 1
        info: dict[str, Any] = {"step": self.steps, "executed": None, "returncode": None,
                                "output": "", "error": "", "parse_error": None,
                                "terminal": None}
        request = self._request(action)
        reply: ActReply | None = None
        if isinstance(request, str):  # the action did not parse: nothing ran
            info["parse_error"] = request
        else:
            try:
                reply = await self.client.act(lease.env_id, pause_s=self.pause_s,
                                              observe=self.observe, **request)
            except BadServiceRequest as exc:
                if exc.code != "unparseable":
                    raise
                info["parse_error"] = str(exc)
            except ServiceError as exc:
                raise self._lost(lease, exc, "step") from exc
        if reply is not None:
            info.update(executed=reply.executed, returncode=reply.returncode,
                        output=reply.output, error=reply.error, parse_error=reply.parse_error,
                        terminal=reply.terminal)
        terminal = reply.terminal if reply is not None else None
        terminated = terminal in _TERMINAL
        truncated = not terminated and self.steps >= self.max_steps
        if reply is not None and reply.screenshot_png_b64 is not None:
            obs, info["screenshot_png"] = await self._observation(reply)
        else:  # nothing ran, or a terminal action (no observation): the screen as it was
            obs, info["screenshot_png"] = self._copy(self._last_obs), self._last_png
        reward = 0.0
        if terminated or truncated:
            reward = await self._score(lease, terminal if terminated else None, info)
        return obs, reward, terminated, truncated, info

    async def close(self) -> None:
        """Release the lease (if any) and close the client; calling it again does nothing."""
        if self._closed:
            return
        try:
            await self._release()
        finally:
            self._closed = True
            await self.client.close()

    def last_screen(self) -> np.ndarray | None:
        """A copy of the last screen observed (None before the first reset)."""
        last = self._last_obs
        if last is None:
            return None
        return (last["screenshot"] if isinstance(last, dict) else last).copy()

    # ----------------------------------------------------------------- the parts

    def _request(self, action: Any) -> dict[str, Any] | str:
        """The act request's fields for ``action``, or why it does not parse."""
        if self.action_kind == "computer13":
            if isinstance(action, str):
                text = action.strip()
                if text in SPECIAL_ACTIONS:
                    return {"kind": "special", "code": text}
                try:
                    action = json.loads(text)
                except ValueError as exc:
                    return f"computer13 action is not JSON: {exc}"
            if not isinstance(action, dict):
                return (f"computer13 action is a {type(action).__name__}, not an object "
                        f"with action_type")
            return {"kind": "computer13", "action": action}
        if not isinstance(action, str):
            raise TypeError(f"step: a {self.action_kind} action is a str, got "
                            f"{type(action).__name__}")
        if self.action_kind == "uitars":
            return {"kind": "uitars", "reply": action}
        if action.strip() in SPECIAL_ACTIONS:
            return {"kind": "special", "code": action.strip()}
        return {"kind": "pyautogui", "code": action}

    async def _score(self, lease: LeaseReply, last_action: str | None,
                     info: dict[str, Any]) -> float:
        """The task's reward, then the lease goes back (the episode is over)."""
        self._ended = True
        reward = 0.0
        info["evaluated"] = self._episode_task is not None
        if self._episode_task is not None:
            try:
                evaluation = await self.client.evaluate(lease.env_id, last_action)
            except ServiceError as exc:
                raise self._lost(lease, exc, "evaluate") from exc
            reward = float(evaluation.reward)
            info["evaluation_error"] = evaluation.evaluation_error
            info["evaluation_s"] = evaluation.evaluation_s
        await self._release()
        return reward

    async def _observation(self, reply: Observation) -> tuple[Any, bytes]:
        if reply.screenshot_png_b64 is None:
            raise ServiceError("desktop service: the reply carries no screenshot")
        png = decode_png(reply.screenshot_png_b64)
        # A full-screen PNG takes tens of ms to decode: off the caller's event loop.
        pixels = await asyncio.to_thread(_pixels, png)
        if pixels.shape != (self.screen[1], self.screen[0], 3):
            raise ServiceError(f"desktop service: a screenshot of {pixels.shape[1]}x"
                               f"{pixels.shape[0]}, the lease's screen is "
                               f"{self.screen[0]}x{self.screen[1]}")
        obs: Any = pixels
        if "a11y_tree" in self.observe:
            obs = {"screenshot": pixels, "a11y_tree": reply.a11y_tree or ""}
        self._last_obs, self._last_png = obs, png
        return self._copy(obs), png

    @staticmethod
    def _copy(obs: Any) -> Any:
        # Every call returns its own arrays (a caller may keep and modify them).
        if isinstance(obs, dict):
            return {key: value.copy() if isinstance(value, np.ndarray) else value
                    for key, value in obs.items()}
        return obs.copy()

    def _check_alive(self, lease: LeaseReply) -> None:
        """A lease the heartbeats found gone fails the step before it is sent."""
        if self._alive is not None and isinstance(self._alive.error, LeaseGone):
            raise self._lost(lease, self._alive.error, "heartbeat")

    def _lost(self, lease: LeaseReply, exc: ServiceError, where: str) -> ServiceError:
        """``exc`` as the env's error: a lease the service no longer has (gone, or its
        desktop died) ends the episode with ``LeaseEnded`` naming it; others unchanged."""
        if not isinstance(exc, LeaseGone) and exc.code != "desktop_died":
            return exc
        self.lease, self._ended = None, True
        what = "its desktop died" if exc.code == "desktop_died" else "the service lost it"
        task_id = (self._episode_task or {}).get("id")
        return LeaseEnded(
            f"CuaDesktopEnv: lease {lease.env_id} (desktop {lease.desktop_id}, task "
            f"{task_id}) ended at step {self.steps} ({where}): {what}: {exc}; reset() "
            f"leases another", code=exc.code, status=exc.status)

    async def _release(self) -> None:
        lease, self.lease = self.lease, None
        self._ended = True
        if self._keep_alive is not None:
            stack, self._keep_alive, self._alive = self._keep_alive, None, None
            await stack.aclose()
        if lease is not None:
            # A lease already gone needs no release.
            with contextlib.suppress(LeaseGone):
                await self.client.release(lease.env_id)

    def _check_open(self) -> None:
        if self._closed:
            raise gymnasium.error.ClosedEnvironmentError("CuaDesktopEnv: the env is closed")


class _LoopThread:
    """An event loop running in a daemon thread: the sync env's coroutines run there, and
    the heartbeats keep running between calls."""

    def __init__(self, name: str) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self._thread.start()

    def run(self, coro: Coroutine[Any, Any, _T]) -> _T:
        if self.loop.is_closed():
            coro.close()
            raise gymnasium.error.ClosedEnvironmentError("CuaDesktopEnv: the env is closed")
        future: Future[_T] = asyncio.run_coroutine_threadsafe(coro, self.loop)
        try:
            return future.result()
        except BaseException:
            future.cancel()  # an interrupted caller (KeyboardInterrupt) stops the call too
            raise

    def stop(self) -> None:
        if self.loop.is_closed():
            return
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join()
        self.loop.close()


class CuaDesktopEnv(gymnasium.Env[Any, Any]):
    """A desktop of the service as a Gymnasium environment.

    url, token | token_env   the service and the tenant's bearer token (or the name of the
                             environment variable holding it)
    task                     the OSWorld task of every episode (``reset(options={"task":
                             ...})`` overrides it); None: a clean desktop, never scored
    action_kind              ``pyautogui`` (code, or WAIT/DONE/FAIL), ``uitars`` (a UI-TARS
                             reply, parsed by the service) or ``computer13`` (an action dict or
                             its JSON)
    screen                   the desktops' (width, height): the observation's shape
    max_steps                the step that truncates an episode
    observe                  ``("screenshot",)``: the observation is the screen (H x W x 3
                             uint8); with ``"a11y_tree"``: a dict of both
    access, wait_s, pause_s  passed to the service (desktop access, lease wait, the pause
                             after an action)
    render_mode              ``"rgb_array"``: ``render()`` returns the last screen
    """

    metadata: ClassVar[dict[str, Any]] = {"render_modes": ["rgb_array"], "render_fps": 1}

    def __init__(self, url: str, token: str | None = None, *, token_env: str | None = None,
                 task: dict[str, Any] | None = None, action_kind: str = "pyautogui",
                 screen: tuple[int, int] = (1920, 1080), max_steps: int = 15,
                 observe: Iterable[str] = ("screenshot",), access: str | None = None,
                 wait_s: float | None = None, pause_s: float | None = None,
                 timeout_s: float = 300.0, label: str = "",
                 render_mode: str | None = None) -> None:
        if render_mode not in (None, *self.metadata["render_modes"]):
            raise ConfigError(f"CuaDesktopEnv: render_mode {render_mode!r} is not None or "
                              f"'rgb_array'")
        self.async_env = AsyncCuaDesktopEnv(
            url, token, token_env=token_env, task=task, action_kind=action_kind,
            screen=screen, max_steps=max_steps, observe=observe, access=access,
            wait_s=wait_s, pause_s=pause_s, timeout_s=timeout_s, label=label)
        self.observation_space = self.async_env.observation_space
        self.action_space = self.async_env.action_space
        self.render_mode = render_mode
        self._loop = _LoopThread(f"CuaDesktopEnv {url}")

    @property
    def client(self) -> DesktopServiceClient:
        """The service's async client; it lives on this env's loop (``run`` a coroutine)."""
        return self.async_env.client

    def run(self, awaitable: Awaitable[_T]) -> _T:
        """Run a coroutine of ``client`` on this env's loop and return its result."""
        async def call() -> _T:
            return await awaitable
        return self._loop.run(call())

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None
              ) -> tuple[Any, dict[str, Any]]:
        super().reset(seed=seed)  # seeds np_random; the desktop itself is not seeded
        return self._loop.run(self.async_env.reset(seed=seed, options=options))

    def step(self, action: str | dict[str, Any]
             ) -> tuple[Any, float, bool, bool, dict[str, Any]]:
        return self._loop.run(self.async_env.step(action))

    def render(self) -> np.ndarray | None:
        """The last screen (``render_mode="rgb_array"``), None before the first reset."""
        if self.render_mode is None:
            gymnasium.logger.warn("CuaDesktopEnv.render: no render_mode was given")
            return None
        return self.async_env.last_screen()

    def close(self) -> None:
        if self._loop.loop.is_closed():
            return
        try:
            self._loop.run(self.async_env.close())
        finally:
            self._loop.stop()
