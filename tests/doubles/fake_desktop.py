"""``FakeDesktop``: an environment built from functions, for component tests of whatever
drives environments (the episode loop, scoring, the checker) without Xvfb. It meets the
contract (``DesktopEnv`` and ``DesktopProbe``), runs task setup steps through the real
interpreter (``cua_rollout.envs.setup_steps``) and records what it was asked to do."""

from __future__ import annotations

import asyncio
import struct
import zlib
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from cua_rollout.config import DesktopsConfig
from cua_rollout.core.errors import DesktopError
from cua_rollout.core.screenshot import Screenshot
from cua_rollout.core.types import SPECIAL_ACTIONS, WAIT
from cua_rollout.envs import setup_steps
from cua_rollout.envs.contract import StepResult
from cua_rollout.envs.providers.base import Desktop, DesktopProvider

__all__ = ["FakeDesktop", "FakeProvider", "solid_png"]

StepFunc = Callable[[str], StepResult | Mapping[str, Any] | Awaitable[Any] | None]
ObserveFunc = Callable[[], bytes | Screenshot | Awaitable[Any]]


def solid_png(width: int, height: int, rgb: tuple[int, int, int] = (40, 40, 40)) -> bytes:
    """A valid PNG of one colour (no imaging library needed)."""
    row = b"\x00" + bytes(rgb) * width

    def chunk(kind: bytes, data: bytes) -> bytes:
        body = kind + data
        return struct.pack(">I", len(data)) + body + struct.pack(">I", zlib.crc32(body))

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header)
            + chunk(b"IDAT", zlib.compress(row * height)) + chunk(b"IEND", b""))


async def _maybe_await(value: Any) -> Any:
    return await value if isinstance(value, Awaitable) else value


class FakeDesktop:
    """An in-memory desktop.

    ``step_func(code)`` runs pyautogui code (return a ``StepResult``, a ``/execute``-style
    dict or None for success; raise ``DesktopError`` to fail the desktop);
    ``observe_func()`` returns the screen (PNG bytes or a Screenshot; default: a solid PNG of
    ``size``); ``files`` are the desktop's files for ``get_file``; ``execute_func(command,
    shell)`` answers ``execute`` and setup ``execute`` steps; ``terminal`` and ``accessibility``
    are what the terminal and the accessibility tree show. Everything asked is recorded in
    ``actions`` (pyautogui code and special actions) and ``calls`` (setup and probe calls).
    """

    def __init__(
        self,
        *,
        step_func: StepFunc | None = None,
        observe_func: ObserveFunc | None = None,
        execute_func: Callable[[list[str] | str, bool], Mapping[str, Any]] | None = None,
        files: Mapping[str, bytes] | None = None,
        terminal: str = "",
        accessibility: str = "<desktop-frame/>",
        size: tuple[int, int] = (1920, 1080),
        cfg: DesktopsConfig | None = None,
        name: str = "fake-desktop",
    ) -> None:
        self.name = name
        self.cfg = cfg or DesktopsConfig(screen_width=size[0], screen_height=size[1])
        self.task_id: str | None = None
        self.task_cache: dict[str, str] = {}
        self.files: dict[str, bytes] = dict(files or {})
        self.actions: list[str] = []
        self.calls: list[tuple[str, Any]] = []
        self.closed = 0
        self._step_func = step_func
        self._observe_func = observe_func
        self._execute_func = execute_func
        self.terminal = terminal
        self.accessibility = accessibility
        self._png = solid_png(*size)

    # ----------------------------------------------------------------- DesktopEnv

    async def reset(self, task: Mapping[str, Any]) -> Screenshot:
        self.task_id = str(task.get("id", "")) or None
        self.task_cache = {}
        self.calls.append(("reset", self.task_id))
        for index, step in enumerate(task.get("config") or []):
            await self.run_setup_step(step, index)
        return await self.observe()

    async def step(self, action: str, pause_s: float = 0.0) -> StepResult:
        self.actions.append(action)
        if action in SPECIAL_ACTIONS:
            if action == WAIT and pause_s:
                await asyncio.sleep(pause_s)
            return StepResult(action)
        out = await _maybe_await(self._step_func(action)) if self._step_func else None
        if isinstance(out, StepResult):
            return out
        reply = dict(out or {"returncode": 0})
        return StepResult(action, returncode=reply.get("returncode", 0),
                          output=str(reply.get("output") or ""),
                          error=str(reply.get("error") or ""))

    async def observe(self) -> Screenshot:
        if self._observe_func is None:
            return Screenshot(self._png)
        shot = await _maybe_await(self._observe_func())
        return shot if isinstance(shot, Screenshot) else Screenshot(shot)

    async def close(self) -> None:
        self.closed += 1

    # ----------------------------------------------------------------- DesktopProbe

    async def get_file(self, path: str) -> bytes | None:
        self.calls.append(("get_file", path))
        return self.files.get(path)

    async def execute(self, command: list[str] | str, *, shell: bool = False,
                      timeout_s: float | None = None) -> dict[str, Any]:
        self.calls.append(("execute", command))
        if self._execute_func is not None:
            return dict(self._execute_func(command, shell))
        return {"status": "success", "output": "", "error": "", "returncode": 0}

    async def terminal_output(self) -> str:
        return self.terminal

    async def accessibility_tree(self) -> str:
        return self.accessibility

    async def run_setup_step(self, step: Mapping[str, Any], index: int = 0) -> None:
        await setup_steps.run_setup_step(self, step, index)

    # ----------------------------------------------------------------- setup target

    @property
    def client_password(self) -> str | None:
        return None

    async def launch(self, command: list[str] | str, shell: bool = False) -> None:
        self.calls.append(("launch", command))

    async def setup_execute(self, command: list[str] | str, shell: bool = False
                            ) -> dict[str, Any]:
        self.calls.append(("setup_execute", command))
        return await self.execute(command, shell=shell)

    async def open_file(self, path: str) -> None:
        self.calls.append(("open_file", path))

    async def activate_window(self, window_name: str, strict: bool = False,
                              by_class: bool = False) -> None:
        self.calls.append(("activate_window", window_name))

    async def close_window(self, window_name: str, strict: bool = False,
                           by_class: bool = False) -> None:
        self.calls.append(("close_window", window_name))

    async def upload(self, path: str, data: bytes) -> None:
        self.calls.append(("upload", path))
        self.files[path] = data


class FakeProvider(DesktopProvider):
    """Desktops that exist only as records (a ``DesktopPool`` can lend them); resets take
    ``reset_s`` and fail for ids in ``fail_reset``, health is false for ids in ``unhealthy``.
    With ``desktop_factory``, each desktop also gets a ``FakeDesktop`` that
    ``env_factory(lease, cfg)`` (a runner's ``env_factory``, in-process) hands out."""

    verify_resets = False  # records, not desktops: nothing to run the check on

    def __init__(self, *, reset_s: float = 0.0, replaceable: bool = True,
                 capacity: int | None = None,
                 desktop_factory: Callable[[str], FakeDesktop] | None = None) -> None:
        self.replaceable = replaceable
        self.reset_s = reset_s
        self._capacity = capacity
        self._desktop_factory = desktop_factory
        self.started: list[str] = []
        self.stopped: list[str] = []
        self.resets: list[str] = []
        self.fail_reset: set[str] = set()
        self.unhealthy: set[str] = set()
        self.desktops: dict[str, FakeDesktop] = {}

    def capacity(self) -> int | None:
        return self._capacity

    async def start(self, index: int) -> Desktop:
        desktop = Desktop(id=f"fake-{index}", url=f"http://fake/{index}")
        self.started.append(desktop.id)
        if self._desktop_factory is not None:
            self.desktops[desktop.id] = self._desktop_factory(desktop.id)
        return desktop

    async def reset(self, desktop: Desktop) -> None:
        self.resets.append(desktop.id)
        await asyncio.sleep(self.reset_s)
        if desktop.id in self.fail_reset:
            raise DesktopError(f"{desktop.id} will not reset")

    async def stop(self, desktop: Desktop) -> None:
        self.stopped.append(desktop.id)

    async def health(self, desktop: Desktop) -> bool:
        return desktop.id not in self.unhealthy

    def env_factory(self, lease: Any, cfg: DesktopsConfig) -> FakeDesktop:
        """The leased desktop's ``FakeDesktop`` (``lease`` is a
        ``cua_rollout.runtime.pool.Lease``)."""
        return self.desktops[lease.desktop_id]
