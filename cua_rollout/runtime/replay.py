"""Replay an episode on a real desktop: a task's setup, then replies (a reference solution,
or a model's) parsed and run one action at a time, each followed by a wait until the screen
has taken the action in, then the task's evaluator. The demo suites' tests use it, and so
does whoever writes a task:

    python -m cua_rollout.runtime.replay tasks/osworld_demo/examples/vlc/vlc-fullscreen.json \\
        [--config configs/osworld_demo.yaml] [--nothing] [--shots DIR] [--hold]

starts one local desktop, plays the task's ``reference_solution`` (``--nothing``: only
``finished``), saves a screenshot after setup and after each action to ``--shots``, prints
each step and the score, and with ``--hold`` keeps the desktop (its display, URL and HOME
printed) until Ctrl-C, to look at it with ``xdotool`` or a screenshot. Run it from the
repository root: task files name their files relative to it, as OSWorld's do.
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

from cua_rollout.agents.base import make_agent
from cua_rollout.config import Config, load_config
from cua_rollout.core.screenshot import Screenshot
from cua_rollout.core.types import DONE, FAIL, WAIT
from cua_rollout.envs.client import RemoteDesktopEnv
from cua_rollout.evaluation import Evaluator, evaluate

if TYPE_CHECKING:
    from cua_rollout.model.client import ModelServicePool
    from cua_rollout.runtime.pool import DesktopPool

__all__ = ["changed_pixels", "play", "run_concurrently", "score", "settle", "with_upload_root"]

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
    then: Callable[[RemoteDesktopEnv, str | None], Awaitable[None]] | None = None,
) -> float:
    """One episode as the rollout plays it: lease, reset(task), then each reply read by the
    run's agent (``agent.name``: its parser and terminal rule, the runner's) and its code run
    until DONE or FAIL (the last action), evaluate, release; returns the score.

    The replies are either given, or asked of ``model`` step by step with the request the
    agent builds (prompt, screenshot history, grammar). ``evaluator``: see ``score``;
    ``shots``: a folder for a screenshot after setup (00.png) and after each action; ``log``:
    a print-like callable; ``stats``: a dict that gets ``setup_s``, ``actions`` and
    ``evaluation_s``; ``then(env, last_action)``: run after scoring, before the desktop is
    released. A reply that does not parse raises ``ActionParseError``, an action that fails
    ``AssertionError``: a replayed solution must run as written."""
    say = log or (lambda *_: None)
    agent = make_agent(cfg.agent, instruction=str(task["instruction"]),
                       max_tokens=cfg.model.sampling.max_tokens)
    lease = await pool.lease(f"replay-{task['id']}")
    try:
        env = RemoteDesktopEnv(lease.url, cfg.desktops, name=lease.desktop_id)
        started = time.monotonic()
        shot = await env.reset(task)
        figures = stats if stats is not None else {}
        figures["setup_s"] = time.monotonic() - started
        figures["actions"] = 0
        say(f"setup: {figures['setup_s']:.1f} s")
        if shots is not None:
            shots.mkdir(parents=True, exist_ok=True)
            (shots / "00.png").write_bytes(shot.png)
        screen = decode(shot)
        pointer = await env.cursor_position()
        last_action: str | None = None
        for step in range(cfg.runner.max_steps):
            if model is not None:
                request = agent.request(shot)
                text = (await model.generate(
                    request.messages, f"{task['id']}-{lease.lease_id}", regex=request.regex,
                    least_tokens=request.least_tokens)).text
            elif replies is not None and step < len(replies):
                text = replies[step]
            else:
                break
            parsed = agent.parse(text, shot)
            agent.remember(shot, text)
            decision = agent.decide(parsed)
            say(f"{step + 1:02d} {(decision.action or '').strip()}")
            if decision.code is not None:
                figures["actions"] += 1
                result = await env.step(decision.code, pause_s=0.0)
                if not result.ok:
                    raise AssertionError(f"{task['id']}: {decision.code!r} failed: "
                                         f"{result.error}")
                moved_to = await env.cursor_position()
                screen, shot = await settle(env, screen, [pointer, moved_to],
                                            cfg.runner.action_pause_s)
                pointer = moved_to
            if decision.terminal in (DONE, FAIL):
                last_action = decision.terminal
                break
            if decision.terminal == WAIT:
                figures["actions"] += decision.code is None
                await env.step(WAIT, pause_s=cfg.runner.wait_s)
                shot = await env.observe()
            if shots is not None:
                (shots / f"{step + 1:02d}.png").write_bytes(shot.png)
        started = time.monotonic()
        value = await score(env, task, last_action, cfg, evaluator)
        figures["evaluation_s"] = time.monotonic() - started
        say(f"score: {value} (evaluation {figures['evaluation_s']:.2f} s)")
        if then is not None:
            await then(env, last_action)
        return value
    finally:
        await pool.release(lease.lease_id)


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
        f"desktops.local.state_dir={state_dir}", *args.set])
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
    parser.add_argument("--config", default="configs/osworld_demo.yaml")
    parser.add_argument("--nothing", action="store_true",
                        help="play only finished(): the untouched desktop's score")
    parser.add_argument("--shots", type=Path, help="save a screenshot per step here")
    parser.add_argument("--hold", action="store_true", help="keep the desktop after scoring")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="a config override (repeatable)")
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
