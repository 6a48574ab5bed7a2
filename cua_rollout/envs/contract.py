"""The environment contract: what the episode loop needs of an environment (``DesktopEnv``:
reset, step, observe, close) and what scoring needs of a desktop (``DesktopProbe``: files,
commands, accessibility tree, setup steps). Every environment (the OSWorld HTTP client, the
function-built fake, the providers' desktops) meets it; ``checker.check_desktop_env`` proves it.

Text environments (``math``, ``py``, ``rag``, ``web``) meet the same shape with text in place
of the screen (``TextEnv``: reset to the task's first message, step one ``ToolCall`` to a
``StepResult`` whose output the model reads, close); ``checker.check_text_env`` proves it.

A leaf module: it imports nothing of the project but the screenshot and tool types."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from cua_rollout.core.screenshot import Screenshot
from cua_rollout.envs.tools import ToolSpec

__all__ = ["DesktopAccess", "DesktopAddress", "DesktopEnv",
           "DesktopProbe", "StepResult", "TextEnv", "ToolCall"]



@dataclass
class StepResult:
    """What executing one action did on the desktop."""

    action: str
    returncode: int | None = None
    output: str = ""
    error: str = ""
    duration_s: float = 0.0

    @property
    def ok(self) -> bool:
        return self.returncode in (None, 0)


@runtime_checkable
class DesktopEnv(Protocol):
    """An environment the episode loop drives. Failures of the environment itself raise
    ``cua_rollout.core.errors.DesktopError`` (or a subclass), never a transport library's error."""

    name: str

    async def reset(self, task: Mapping[str, Any]) -> Screenshot:
        """Run the task's setup (``task["config"]``); return the first observation."""
        ...

    async def step(self, action: str, pause_s: float = 0.0) -> StepResult:
        """Run pyautogui code, or one of ``SPECIAL_ACTIONS``; wait ``pause_s`` after it."""
        ...

    async def observe(self) -> Screenshot:
        """The current screen (PNG; its size read from the header)."""
        ...

    async def close(self) -> None:
        """Release what this object holds (not the desktop: the pool owns that)."""
        ...


@dataclass(frozen=True)
class ToolCall:
    """One tool call of a model reply, as the model wrote it: ``arguments`` is JSON text
    that may not parse (the environment answers that as an error)."""

    id: str
    name: str
    arguments: str


@runtime_checkable
class TextEnv(Protocol):
    """A text environment the episode loop drives: ``mode`` (math, py, rag, web) and the
    ``tools`` the model may call. ``step`` runs one call and never raises for the model's
    mistakes (malformed arguments, an unknown tool, a call the tool refused): those are a
    ``StepResult`` that is not ``ok`` (``returncode`` 1: the tool refused or failed, 2: the
    arguments are not a JSON object, 3: no such tool) with the message the model reads in
    ``output`` (``error`` says what went wrong). A tool that cannot run at all raises
    ``cua_rollout.core.errors.ToolUnavailable``."""

    name: str
    mode: str
    tools: list[ToolSpec]

    async def reset(self, task: Mapping[str, Any]) -> str:
        """Start the task's episode; return its first user message (the question)."""
        ...

    async def step(self, call: ToolCall) -> StepResult:
        """Run one tool call; ``StepResult.output`` is what the model reads next."""
        ...

    async def close(self) -> None:
        """Release what the environment holds (sandbox processes, scratch files, sockets)."""
        ...


@runtime_checkable
class DesktopProbe(Protocol):
    """What scoring reads from a desktop (``cua_rollout.evaluation``): no HTTP in sight, so a fake
    needs only these methods. A probe that ran the task's setup may also keep a
    ``task_cache`` dict (file name -> text: what ``execute`` steps saved as OSWorld's
    SetupController does), which the ``cache_file`` getter reads."""

    async def get_file(self, path: str) -> bytes | None:
        """The file's bytes, or None when it does not exist."""
        ...

    async def execute(self, command: list[str] | str, *, shell: bool = False,
                      timeout_s: float | None = None) -> dict[str, Any]:
        """Run a command; ``{status, output, error, returncode}``."""
        ...

    async def terminal_output(self) -> str:
        ...

    async def accessibility_tree(self) -> str:
        ...

    async def run_setup_step(self, step: Mapping[str, Any], index: int = 0) -> None:
        """One OSWorld setup step (evaluators' ``postconfig``)."""
        ...


@dataclass(frozen=True)
class DesktopAccess:
    """What one desktop needs beyond its URL when a provider hands it out with credentials
    and ports of its own (a remote lease's bearer token, an emulator's Chromium and VLC
    ports): it goes from the provider's ``Desktop`` through the pool's ``Lease`` to the
    desktop's client. Unset fields fall back to the run's ``desktops`` settings
    (``token_env``, the desktop's ``/ports``, ``chromium_port``, ``vlc_port``). The token
    never shows in a repr (leases and desktops are logged)."""

    token: str | None = field(default=None, repr=False)
    chromium_port: int | None = None
    vlc_port: int | None = None


@dataclass(frozen=True)
class DesktopAddress:
    """Where OSWorld's code reaches a desktop: its server (with the bearer token our servers
    want) and, on the same host, Chromium's DevTools and VLC's HTTP ports."""

    url: str
    token: str | None = None
    chromium_port: int = 9222
    vlc_port: int = 8080

    def wire(self) -> dict[str, Any]:
        return {"url": self.url, "token": self.token, "chromium_port": self.chromium_port,
                "vlc_port": self.vlc_port}
