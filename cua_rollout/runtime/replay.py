"""Replay an episode on a real desktop: the rollout's own episode loop (``DesktopEpisode``)
with a scripted model (a reference solution's replies, or a model's), so a replay plays a
task as the rollout does: the task's setup, each reply read by the run's agent and its code
run, then the task's evaluator, the whole trajectory written as a run writes it. Two things
differ, both for a replay to test the task rather than the timing: after each action the
desktop is watched until the screen has taken the action in (instead of the fixed
``runner.action_pause_s``), and a reply that does not parse or an action that fails stops
the replay with that error. The demo suites' tests use it, and so does whoever writes a
task:

    python -m cua_rollout.runtime.replay tasks/osworld_demo/examples/vlc/vlc-fullscreen.json \\
        [--config configs/osworld_demo.yaml] [--nothing] [--shots DIR] [--hold]

starts one local desktop, plays the task's ``reference_solution`` (``--nothing``: only
``finished``), writes the episode's directory (traj.jsonl, a screenshot after setup and after
each step) under ``--shots``, prints each step and the score, and with ``--hold`` keeps the
desktop (its display, URL and HOME printed) until Ctrl-C, to look at it with ``xdotool`` or
a screenshot. Run it from the repository root: task files name their files relative to it,
as OSWorld's do.
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from PIL import Image, ImageChops, ImageDraw

from cua_rollout.agents.base import Agent, Decision
from cua_rollout.config import Config, DesktopsConfig, add_config_arguments, load_config
from cua_rollout.core.aio import TaskSet
from cua_rollout.core.errors import ActionParseError
from cua_rollout.core.screenshot import Screenshot
from cua_rollout.core.types import WAIT, EpisodeSpec, Status
from cua_rollout.envs.client import RemoteDesktopEnv
from cua_rollout.envs.contract import StepResult
from cua_rollout.evaluation import Evaluator, evaluate
from cua_rollout.model.client import Generation
from cua_rollout.runtime.desktop_episode import DesktopEpisode
from cua_rollout.runtime.pool import Lease
from cua_rollout.runtime.storage import StorageActor
from cua_rollout.runtime.trajectory import StepRecord
from cua_rollout.runtime.utilization import StateClock

if TYPE_CHECKING:
    from cua_rollout.model.client import ModelServicePool
    from cua_rollout.runtime.pool import DesktopPool

__all__ = ["ScriptedReplies", "changed_pixels", "play", "run_concurrently", "score", "settle",
           "with_upload_root"]

# After an action, the screen counts as changed when more pixels than this differ outside the
# pointer; a blinking text caret is 18.
CHANGED_PIXELS = 24
# How long to wait for an action's effect to show before going on anyway (an action may
# change nothing visible).
SETTLE_MAX_S = 3.0
# The screen must then hold still this long (an app under load can pause between frames).
SETTLE_QUIET_S = 0.3
# A screen that never holds still (a video playing, an animation) is taken as it is then.
SETTLE_LIMIT_S = 6.0
SETTLE_POLL_S = 0.1
# Half the size of the box around the pointer that screen comparisons ignore (the pointer is
# drawn into screenshots and changes shape over text, buttons and dialogs).
POINTER_BOX_PX = 32

NOTHING = 'Thought: Nothing to do.\nAction: finished(content="")'
GIVE_UP = "Thought: This cannot be done.\nAction: call_user()"


async def score(env: RemoteDesktopEnv, task: dict[str, Any], last_action: str | None,
                cfg: Config, evaluator: Evaluator | None = None) -> float:
    """The task's evaluator on the desktop, as the runner scores an episode: by
    ``evaluator``'s route (native or OSWorld's code), or without one natively."""
    if evaluator is not None:
        return await evaluator.evaluate(env, task, last_action, task_id=task["id"])
    return await evaluate(env, task, last_action, cache_dir=Path(cfg.desktops.download_cache_dir),
                          task_id=task["id"])


def decode(shot: Screenshot) -> Image.Image:
    return Image.open(io.BytesIO(shot.png)).convert("RGB")


def changed_pixels(a: Image.Image, b: Image.Image, pointers: Iterable[tuple[int, int]]) -> int:
    """Pixels that differ between two screens, outside a box around each pointer position."""
    diff = ImageChops.difference(a, b).convert("L")
    draw = ImageDraw.Draw(diff)
    for x, y in pointers:
        draw.rectangle((x - POINTER_BOX_PX, y - POINTER_BOX_PX,
                        x + POINTER_BOX_PX, y + POINTER_BOX_PX), fill=0)
    return diff.point(lambda v: 255 if v else 0).histogram()[255]


async def settle(env: RemoteDesktopEnv, before: Image.Image, pointers: list[tuple[int, int]],
                 pause_s: float) -> tuple[Image.Image, Screenshot]:
    """Wait until the action's effect shows and the screen then holds still for
    SETTLE_QUIET_S, or until SETTLE_MAX_S passes without any change (SETTLE_LIMIT_S in all)."""
    await asyncio.sleep(pause_s)
    deadline = time.monotonic() + SETTLE_MAX_S
    limit = time.monotonic() + SETTLE_LIMIT_S
    previous = before
    changed = False
    quiet_since = time.monotonic()
    while True:
        shot = await env.observe()
        current = decode(shot)
        now = time.monotonic()
        if changed_pixels(previous, current, pointers) > CHANGED_PIXELS:
            changed, quiet_since = True, now
        if changed and now - quiet_since >= SETTLE_QUIET_S:
            return current, shot
        if (not changed and now > deadline) or now > limit:
            return current, shot
        previous = current
        await asyncio.sleep(SETTLE_POLL_S)


class ScriptedReplies:
    """The model of a replay: the given replies, in order, one per request."""

    def __init__(self, replies: list[str]) -> None:
        self.replies = list(replies)
        self.served = 0

    async def generate(self, messages: list[dict[str, Any]], session_id: str | None = None,
                       sampling: Any = None, **_: Any) -> Generation:
        text = self.replies[self.served]
        self.served += 1
        return Generation(text, "replay", None, 0.0, 0, 0, "stop", 1)

    def end_session(self, session_id: str) -> None:
        pass

    async def wait_until_live(self, timeout_s: float) -> bool:
        return True

    def outage_status(self) -> str:
        return "scripted replies"

    async def close(self) -> None:
        pass


class _StrictAgent:
    """The run's agent, except that a reply that does not parse stops the replay (the
    rollout would ask again): a replayed solution must run as written."""

    def __init__(self, agent: Agent) -> None:
        self._agent = agent
        self.max_parse_retries = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._agent, name)

    def parse(self, text: str, observation: Any, tool_calls: Any = None) -> Any:
        try:
            return self._agent.parse(text, observation, tool_calls)
        except ActionParseError as exc:
            raise _Stop(exc) from exc


class _Stop(Exception):
    """Carries what stops a replay through the episode loop (which records any error)."""

    def __init__(self, error: BaseException) -> None:
        super().__init__(str(error))
        self.error = error


class _SettlingDesktop:
    """A leased desktop's client that, after each action, waits until the screen has taken
    it in (``settle``), and stops the replay when an action fails."""

    def __init__(self, env: RemoteDesktopEnv, pause_s: float, say: Callable[..., None],
                 figures: dict[str, Any]) -> None:
        self._env = env
        self._pause_s = pause_s
        self._say = say
        self._figures = figures
        self._screen: Image.Image | None = None
        self._pointer: tuple[int, int] = (0, 0)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._env, name)

    async def reset(self, task: dict[str, Any]) -> Screenshot:
        shot = await self._env.reset(task)
        self._screen = decode(shot)
        self._pointer = await self._env.cursor_position()
        return shot

    async def step(self, action: str, pause_s: float | None = None) -> StepResult:
        self._figures["actions"] += 1
        result = await self._env.step(action, pause_s=pause_s if action == WAIT else 0.0)
        if action == WAIT:
            return result
        if not result.ok:
            raise _Stop(AssertionError(f"{action!r} failed: {result.error}"))
        moved_to = await self._env.cursor_position()
        assert self._screen is not None
        self._screen, _ = await settle(self._env, self._screen, [self._pointer, moved_to],
                                       self._pause_s)
        self._pointer = moved_to
        return result

    async def observe(self) -> Screenshot:
        shot = await self._env.observe()
        self._screen = decode(shot)
        return shot


class _ReplayHost:
    """What the episode uses of a runner (``EpisodeHost``), for one replay: the pool, a
    storage writing the replay's folder, the scripted (or real) model, the scoring."""

    def __init__(self, cfg: Config, pool: DesktopPool, storage: StorageActor, model: Any,
                 scoring: Evaluator | None, env_factory: Any) -> None:
        self.cfg = cfg
        self.runner_id = "replay"
        self.node_id = None
        self.desktop_pool = pool
        self.storage = storage
        self.step_files = None  # the storage is in this process: it writes every file
        self.env_factory = env_factory
        self.background = TaskSet()
        self.phases = StateClock()
        self._model = model
        self._scoring = scoring

    @property
    def model(self) -> Any:
        return self._model

    @property
    def evaluator(self) -> Any:
        return self

    async def evaluate(self, env: Any, task: dict[str, Any], last_action: str | None,
                       task_id: str | None = None) -> float:
        return await score(env, task, last_action, self.cfg, self._scoring)

    def step_done(self, timing: dict[str, float], acted: bool = False) -> None:
        pass

    def text_env(self, task: dict[str, Any], name: str) -> Any:
        raise NotImplementedError("a replay plays desktop tasks")

    async def judge_ask(self, messages: list[dict[str, Any]]) -> str:
        raise NotImplementedError("a replay plays desktop tasks")


class _ReplayEpisode(DesktopEpisode):
    """The rollout's desktop episode, with the replay's strict agent, each step printed,
    ``then`` run after scoring, and what stopped it kept to be raised again."""

    def __init__(self, host: _ReplayHost, spec: EpisodeSpec, say: Callable[..., None],
                 then: Callable[[Any, str | None], Awaitable[None]] | None) -> None:
        super().__init__(host, spec, [])  # type: ignore[arg-type]
        self.say = say
        self.then = then
        self.stopped: BaseException | None = None

    def _make_agent(self) -> Agent:
        return _StrictAgent(super()._make_agent())  # type: ignore[return-value]

    async def run(self) -> Any:
        try:
            return await super().run()
        finally:  # a cancelled episode finishes (releases, writes) in the background
            await self.r.background.wait()

    async def _act(self, env: Any) -> str:
        try:
            return await super()._act(env)
        except _Stop as stop:
            self.stopped = stop.error
            raise
        except Exception as exc:
            self.stopped = exc
            raise

    async def _begin(self, env: Any) -> Screenshot:
        started = time.monotonic()
        shot = await super()._begin(env)
        self.say(f"setup: {time.monotonic() - started:.1f} s")
        return shot

    async def _carry_out(self, env: Any, decision: Decision, parsed: Any, record: StepRecord,
                         split: dict[str, float]) -> tuple[bool, Screenshot | None]:
        self.say(f"{self.steps:02d} {(decision.action or '').strip()}")
        return await super()._carry_out(env, decision, parsed, record, split)

    async def _evaluate(self, env: Any) -> float:
        try:
            value = await super()._evaluate(env)
        except Exception as exc:
            self.stopped = exc
            raise
        self.say(f"score: {value} (evaluation {self.timing['evaluation_s']:.2f} s)")
        if self.then is not None:
            await self.then(env, self.last_action)
        return value


async def play(
    cfg: Config,
    pool: DesktopPool,
    task: dict[str, Any],
    replies: list[str] | None = None,
    model: ModelServicePool | None = None,
    *,
    evaluator: Evaluator | None = None,
    shots: Path | None = None,
    log: Any = None,
    stats: dict[str, Any] | None = None,
    then: Callable[[Any, str | None], Awaitable[None]] | None = None,
) -> float:
    """One episode as the rollout plays it (its loop, ``DesktopEpisode``): lease, reset(task),
    then each reply read by the run's agent (``agent.name``) and its code run until DONE or
    FAIL, evaluate, release; returns the score.

    The replies are either given (the episode ends after the last one, scored as it is), or
    asked of ``model`` step by step with the request the agent builds. ``evaluator``: see
    ``score``; ``shots``: a folder that gets the episode's directory (traj.jsonl, a
    screenshot after setup and after each step, episode.json; default: a temporary one);
    ``log``: a print-like callable; ``stats``: a dict that gets ``setup_s``, ``actions`` and
    ``evaluation_s``; ``then(env, last_action)``: run after scoring, before the desktop is
    released. A reply that does not parse raises ``ActionParseError``, an action that fails
    ``AssertionError``, and an error of the desktop or the evaluation is raised as it is: a
    replayed solution must run as written."""
    if model is None and replies is None:
        raise ValueError("play() needs replies or a model")
    say = log or (lambda *_: None)
    figures = stats if stats is not None else {}
    figures["actions"] = 0
    runner = cfg.runner.model_copy(update={"action_pause_s": 0.0, **(
        {"max_steps": min(cfg.runner.max_steps, len(replies))} if model is None else {})})
    played = cfg.model_copy(update={"runner": runner})
    folder = shots if shots is not None else Path(tempfile.mkdtemp(prefix="replay-"))
    storage = StorageActor(folder, cfg.storage.model_copy(update={"index": False}))

    def open_desktop(lease: Lease, desktops: DesktopsConfig) -> _SettlingDesktop:
        return _SettlingDesktop(RemoteDesktopEnv(lease.url, desktops, name=lease.desktop_id,
                                                 access=lease.access),
                                cfg.runner.action_pause_s, say, figures)

    host = _ReplayHost(played, pool, storage, model or ScriptedReplies(replies or []),
                       evaluator, open_desktop)
    spec = EpisodeSpec(str(task["id"]), "replay", 0, task)
    episode = _ReplayEpisode(host, spec, say, then)
    try:
        result = await episode.run()
    finally:
        await storage.close()
        if shots is None:
            shutil.rmtree(folder, ignore_errors=True)
    figures["setup_s"] = result.timing.get("reset_s", 0.0)
    figures["evaluation_s"] = result.timing.get("evaluation_s", 0.0)
    if episode.stopped is not None:
        raise episode.stopped
    if result.status in (Status.INFRA_ERROR, Status.TIMEOUT, Status.CANCELLED):
        raise RuntimeError(f"{task['id']}: the replay ended as {result.status}: {result.error}")
    return float(result.reward or 0.0)


def with_upload_root(cfg: Config, root: Path) -> Config:
    """``cfg`` with ``root`` first among the folders tasks may upload files from: task files
    name theirs relative to the repository root, as OSWorld's do (run.py adds the task
    source's folder instead)."""
    roots = [Path(root).resolve(), *cfg.desktops.task_file_roots]
    return cfg.model_copy(update={"desktops": cfg.desktops.model_copy(
        update={"task_file_roots": roots})})


async def run_concurrently(episodes: list[tuple[str, Any]], slots: int) -> dict[str, Any]:
    """Episodes (name, coroutine) with at most ``slots`` at a time (one per desktop);
    {name: score or the exception it raised}."""
    gate = asyncio.Semaphore(slots)

    async def one(coro: Any) -> Any:
        async with gate:
            return await coro

    results = await asyncio.gather(*(one(c) for _, c in episodes), return_exceptions=True)
    return {name: r for (name, _), r in zip(episodes, results, strict=True)}


async def _hold(env: RemoteDesktopEnv, _last_action: str | None) -> None:
    where = await env.execute('echo "DISPLAY=$DISPLAY HOME=$HOME"', shell=True)
    print(f"holding {env.base_url} {where['output'].strip()}; Ctrl-C ends it", flush=True)
    while True:
        await asyncio.sleep(3600)


async def _main(args: argparse.Namespace) -> int:
    from cua_rollout.runtime.pool import DesktopPool

    task_path = Path(args.task)
    task = json.loads(task_path.read_text(encoding="utf-8"))
    # A short path: Chromium's sockets live under it and UNIX socket paths are short.
    state_dir = Path(tempfile.mkdtemp(prefix="rp-", dir="/tmp"))
    cfg = load_config(args.config, [
        "desktops.provider=local", "desktops.count=1", "desktops.warm_spares=0",
        f"desktops.local.state_dir={state_dir}", *args.overrides])
    cfg = with_upload_root(cfg, Path.cwd())
    replies = [NOTHING] if args.nothing else task.get("reference_solution") or [NOTHING]
    pool = DesktopPool(cfg.desktops)
    evaluator = Evaluator.from_config(cfg)
    try:
        await pool.start()
        value = await play(cfg, pool, task, replies, evaluator=evaluator, shots=args.shots,
                           log=lambda *a: print(*a, flush=True),
                           then=_hold if args.hold else None)
        return 0 if value == (0.0 if args.nothing else 1.0) else 1
    finally:
        if evaluator.bridge is not None:
            await evaluator.bridge.close()
        await pool.stop()
        shutil.rmtree(state_dir, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("task", help="a task file (OSWorld format)")
    add_config_arguments(parser, required=False, default="configs/osworld_demo.yaml")
    parser.add_argument("--nothing", action="store_true",
                        help="play only finished(): the untouched desktop's score")
    parser.add_argument("--shots", type=Path,
                        help="write the episode's directory (traj.jsonl, screenshots) here")
    parser.add_argument("--hold", action="store_true", help="keep the desktop after scoring")
    args = parser.parse_args(argv)
    # Ctrl-C, SIGINT or SIGTERM end a run (a --hold) cleanly: the desktop stopped, its
    # folder removed. A shell's background job starts with SIGINT ignored: handle it anyway.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        return asyncio.run(_main(args))
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
