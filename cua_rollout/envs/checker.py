"""``check_desktop_env``: the conformance checker every environment must pass (the OSWorld
client against each provider's desktops, the simulated desktops, the function-built fake),
as Gymnasium's ``env_checker`` is for its environments. It drives the contract of
``contract.py`` and checks what the episode loop relies on. ``check_text_env`` does the same
for the text environments (math, py, rag, web)."""

from __future__ import annotations

import json
import struct
from typing import Any

from cua_rollout.core.errors import DesktopError, RolloutError, UnsupportedSetupStep
from cua_rollout.core.screenshot import Screenshot
from cua_rollout.core.types import DONE, FAIL, WAIT
from cua_rollout.envs.contract import (
    DesktopEnv,
    DesktopProbe,
    StepResult,
    TextEnv,
    ToolCall,
)
from cua_rollout.envs.tools import ToolSpec

__all__ = ["ConformanceError", "check_desktop_env", "check_text_env"]

# A task with no setup steps: every environment can reset to it.
_EMPTY_TASK: dict[str, Any] = {"id": "conformance-check", "instruction": "conformance check",
                               "config": []}
# pyautogui code that changes nothing a task could depend on.
_HARMLESS_ACTION = "pyautogui.position()"
# A path no desktop has.
_MISSING_FILE = "/nonexistent/conformance-check/missing.txt"
# A setup step type no interpreter implements.
_UNKNOWN_STEP = {"type": "conformance_check_unknown_step", "parameters": {}}


class ConformanceError(AssertionError):
    """The environment broke the contract; the message says which check and how."""


def _check(ok: bool, what: str) -> None:
    if not ok:
        raise ConformanceError(what)


def _png_header_size(png: bytes) -> tuple[int, int]:
    # Read independently of cua_rollout.core.screenshot: the checker must not trust what it checks.
    _check(len(png) >= 24 and png[:8] == b"\x89PNG\r\n\x1a\n" and png[12:16] == b"IHDR",
           "a screenshot is not a PNG (signature or IHDR chunk missing)")
    width, height = struct.unpack(">II", png[16:24])
    return width, height


def _check_screenshot(shot: Any, where: str,
                      screen_size: tuple[int, int] | None) -> tuple[int, int]:
    _check(isinstance(shot, Screenshot), f"{where} returned {type(shot).__name__}, "
           "not a cua_rollout.core.screenshot.Screenshot")
    _check(shot.png is not None, f"{where} returned a screenshot without PNG bytes")
    size = _png_header_size(shot.png)
    _check(size[0] > 0 and size[1] > 0, f"{where}: the PNG is {size[0]}x{size[1]}")
    _check(shot.size == size, f"{where}: Screenshot.size {shot.size} differs from the PNG "
           f"header's {size}")
    if screen_size is not None:
        _check(size == tuple(screen_size), f"{where}: screenshot is {size[0]}x{size[1]}, "
               f"the configured screen is {screen_size[0]}x{screen_size[1]}")
    return size


def _contract_break(env: Any, exc: Exception, allowed: type[Exception]) -> None:
    """Raise ``ConformanceError`` for an exception the environment should not raise; return
    for a ``ConformanceError`` or an ``allowed`` one (the environment failed in the project's
    terms: not a contract break), which the caller re-raises."""
    if isinstance(exc, ConformanceError | allowed):
        return
    raise ConformanceError(f"{type(env).__name__} raised {type(exc).__name__} (not a "
                           f"cua_rollout.core.errors.{allowed.__name__}): {exc}") from exc


async def check_desktop_env(env: Any, *, screen_size: tuple[int, int] | None = None,
                            probe: bool = True) -> dict[str, Any]:
    """Drive ``env`` through the contract and raise ``ConformanceError`` at the first break:

    - it is a ``DesktopEnv`` (and, with ``probe``, a ``DesktopProbe``) and has a ``name``;
    - ``reset`` of a task without setup steps returns a PNG screenshot whose size, read from
      the PNG header, is positive (and ``screen_size`` when given) and agrees with
      ``Screenshot.size``; ``observe`` returns the same size;
    - ``step`` of pyautogui code returns a ``StepResult`` that ran (``ok``) and of ``WAIT``,
      ``DONE`` and ``FAIL`` one that ran nothing on the desktop (no return code);
    - errors are the project's: an unknown setup step raises ``UnsupportedSetupStep``
      (a ``DesktopError``), a missing file is ``None`` (not an
      exception), and nothing raises a transport library's exception;
    - ``close`` returns, and a second ``close`` too.

    Returns what it observed (``screen_size``, the step's ``StepResult``) for the caller's log.
    """
    _check(isinstance(env, DesktopEnv), f"{type(env).__name__} does not have reset, step, "
           "observe, close and name (cua_rollout.envs.contract.DesktopEnv)")
    if probe:
        _check(isinstance(env, DesktopProbe), f"{type(env).__name__} does not have get_file, "
               "execute, terminal_output, accessibility_tree and run_setup_step "
               "(cua_rollout.envs.contract.DesktopProbe)")
    try:
        first = await env.reset(_EMPTY_TASK)
        size = _check_screenshot(first, "reset()", screen_size)
        again = await env.observe()
        _check(_check_screenshot(again, "observe()", screen_size) == size,
               "observe() returned a different screen size than reset()")

        acted = await env.step(_HARMLESS_ACTION, pause_s=0.0)
        _check(isinstance(acted, StepResult), f"step() returned {type(acted).__name__}, "
               "not a StepResult")
        _check(acted.ok, f"step({_HARMLESS_ACTION!r}) failed: returncode {acted.returncode}, "
               f"error {acted.error!r}")
        for special in (WAIT, DONE, FAIL):
            result = await env.step(special, pause_s=0.0)
            _check(isinstance(result, StepResult) and result.action == special
                   and result.returncode is None,
                   f"step({special!r}) must run nothing on the desktop and return a "
                   f"StepResult without a return code, got {result!r}")

        if probe:
            missing = await env.get_file(_MISSING_FILE)
            _check(missing is None, f"get_file of a missing file returned {missing!r:.80}, "
                   "not None")
            try:
                await env.run_setup_step(_UNKNOWN_STEP, 0)
            except UnsupportedSetupStep:
                pass
            else:
                raise ConformanceError("an unknown setup step type did not raise "
                                       "cua_rollout.core.errors.UnsupportedSetupStep")
    except Exception as exc:
        _contract_break(env, exc, DesktopError)
        raise
    finally:
        await env.close()
    await env.close()  # idempotent
    return {"screen_size": size, "step": acted}


# A text task every text environment can reset to.
_TEXT_TASK: dict[str, Any] = {"id": "conformance-check", "question": "conformance check",
                              "instruction": "conformance check", "answer": "ok",
                              "metadata": {}}


def _example_arguments(spec: ToolSpec) -> dict[str, Any]:
    """Arguments of the declared types for the required properties of a tool's schema."""
    examples = {"string": "conformance check", "integer": 1, "number": 1, "boolean": False,
                "array": [], "object": {}}
    properties = spec.parameters.get("properties", {})
    return {name: examples.get(properties.get(name, {}).get("type"), "conformance check")
            for name in spec.parameters.get("required", [])}


async def check_text_env(env: Any) -> dict[str, Any]:
    """Drive a text environment through its contract (``TextEnv``) and raise
    ``ConformanceError`` at the first break:

    - it is a ``TextEnv`` with a ``name``, a ``mode`` and ``tools``: ``ToolSpec``s with
      distinct names whose parameters are an object schema (what OpenAI tools need);
    - ``reset`` returns the task's question (a non-empty string);
    - each tool, called with arguments of the declared types, returns a ``StepResult`` whose
      output is a non-empty string (a tool's refusal is an output too);
    - the model's mistakes are results, not exceptions: an unknown tool, arguments that are
      not JSON and arguments that are not an object each return a ``StepResult`` that is not
      ``ok`` and whose output names the problem for the model;
    - nothing raises a library's exception; ``close`` returns, and a second ``close`` too.

    Returns what it observed (the tools' names, each call's ``StepResult``).
    """
    _check(isinstance(env, TextEnv), f"{type(env).__name__} does not have reset, step, "
           "close, name, mode and tools (cua_rollout.envs.contract.TextEnv)")
    calls: dict[str, StepResult] = {}
    try:
        _check(all(isinstance(spec, ToolSpec) for spec in env.tools),
               "tools must be cua_rollout.envs.tools.ToolSpec")
        names = [spec.name for spec in env.tools]
        _check(len(set(names)) == len(names), f"two tools share a name: {names}")
        for spec in env.tools:
            _check(spec.parameters.get("type") == "object",
                   f"tool {spec.name}: parameters must be an object schema")
        first = await env.reset(_TEXT_TASK)
        _check(isinstance(first, str) and "conformance check" in first,
               f"reset() must return the task's question, got {first!r:.80}")
        for n, spec in enumerate(env.tools):
            call = ToolCall(f"check_{n}", spec.name, json.dumps(_example_arguments(spec)))
            result = await env.step(call)
            _check(isinstance(result, StepResult) and isinstance(result.output, str)
                   and result.output.strip() != "",
                   f"step() of tool {spec.name} must return a StepResult with an output for "
                   f"the model, got {result!r:.200}")
            calls[spec.name] = result
        wrong = [ToolCall("check_unknown", "conformance_check_no_such_tool", "{}")]
        if env.tools:
            wrong += [ToolCall("check_json", env.tools[0].name, "{not json"),
                      ToolCall("check_object", env.tools[0].name, "[1, 2]")]
        for call in wrong:
            result = await env.step(call)
            _check(isinstance(result, StepResult) and not result.ok and result.output.strip(),
                   f"step() of a wrong call ({call.name} {call.arguments!r}) must return a "
                   f"StepResult that is not ok with a message for the model, got {result!r:.200}")
    except Exception as exc:
        _contract_break(env, exc, RolloutError)
        raise
    finally:
        await env.close()
    await env.close()  # idempotent
    return {"tools": [spec.name for spec in env.tools], "calls": calls}
