"""Commands run for the server's callers: OSWorld's reading of a command request, and running
commands, Python code and bash scripts under time limits, with what they leave running tracked.
"""

from __future__ import annotations

import math
import os
import shlex
import sys
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from cua_rollout.desktop.errors import BadCommand, CommandNotStarted, NoSuchPath
from cua_rollout.desktop.processes import AppTracker, Completed, run_captured
from cua_rollout.desktop.protocol import CommandRequest

__all__ = [
    "BASH_SHEBANG",
    "launch_app",
    "read_command",
    "run_bash_script",
    "run_command",
    "run_python",
    "shell_argv",
    "time_limit",
    "working_dir",
]

BASH_SHEBANG = "#!/bin/bash"


def read_command(data: Mapping[str, Any]) -> CommandRequest:
    """OSWorld's reading of a command request: ``shell`` by truthiness; ``command`` (empty
    when missing), a string split with shlex unless ``shell``; list arguments starting with
    ``~/`` expanded; and the caller's ``timeout``, if any (not OSWorld's). Raises
    ``BadCommand`` when no runnable command is left or the timeout is not a positive number."""
    shell = bool(data.get("shell", False))
    command = data.get("command", "" if shell else [])
    if isinstance(command, str) and not shell:
        try:
            command = shlex.split(command)
        except ValueError as exc:  # unbalanced quotes
            raise BadCommand(str(exc)) from None
    if isinstance(command, list):
        command = [
            os.path.expanduser(a) if isinstance(a, str) and a.startswith("~/") else a
            for a in command
        ]
        if not command:
            raise BadCommand("no command given")
        if not all(isinstance(a, str) for a in command):
            raise BadCommand("every element of command must be a string")
    elif not isinstance(command, str):
        raise BadCommand(f"command must be a list or a string, not {type(command).__name__}")
    timeout = data.get("timeout")
    if timeout is not None and (
        isinstance(timeout, bool)
        or not isinstance(timeout, int | float)
        or not (0 < timeout < math.inf)
    ):
        raise BadCommand(f"timeout must be a positive number of seconds, not {timeout!r}")
    return CommandRequest(command=command, shell=shell, timeout=timeout)


def time_limit(request: CommandRequest, limit_s: float) -> float:
    """How long the command may run: the server's ``limit_s``, or less when its caller said it
    waits less (``timeout``), so that nothing runs on after the caller gave up."""
    return limit_s if request.timeout is None else min(limit_s, request.timeout)


def shell_argv(request: CommandRequest) -> list[str]:
    """The argv that runs the command as ``subprocess`` would with ``shell``: a string through
    ``/bin/sh -c``, and a list with ``shell`` as ``sh -c list[0] list[1:]``."""
    command = request.command
    if not request.shell:
        assert isinstance(command, list)
        return command
    if isinstance(command, str):
        return ["/bin/sh", "-c", command]
    return ["/bin/sh", "-c", *command]


async def run_command(
    request: CommandRequest,
    *,
    timeout_s: float,
    env: Mapping[str, str],
    tracker: AppTracker,
) -> Completed:
    """Run the command to its end and return its exit status and output (``/execute``).
    Raises ``CommandNotStarted`` or ``CommandTimeout``."""
    try:
        return await run_captured(
            shell_argv(request), timeout_s=timeout_s, env=env, tracker=tracker, source="execute"
        )
    except (OSError, ValueError, TypeError) as exc:
        raise CommandNotStarted(str(exc)) from exc


def launch_app(request: CommandRequest, *, apps: AppTracker, env: Mapping[str, str]) -> None:
    """Start the command as a long-running app of ``apps`` and return at once
    (``/setup/launch``). Raises ``CommandNotStarted``."""
    try:
        apps.launch(shell_argv(request), env=env)
    except (OSError, ValueError, TypeError) as exc:
        raise CommandNotStarted(str(exc)) from exc


async def run_python(
    code: str,
    *,
    workdir: Path,
    timeout_s: float,
    env: Mapping[str, str],
    tracker: AppTracker,
) -> Completed:
    """Run ``code`` with the server's own interpreter (the one with pyautogui), from a file in
    ``workdir``. Raises ``CommandNotStarted`` or ``CommandTimeout``."""
    with tempfile.NamedTemporaryFile(
        "w", suffix=".py", prefix="run_python_", dir=workdir, delete=False
    ) as f:
        f.write(code)
    try:
        return await run_captured(
            [sys.executable, f.name],
            timeout_s=timeout_s,
            env=env,
            tracker=tracker,
            source="run_python",
        )
    except OSError as exc:
        raise CommandNotStarted(str(exc)) from exc
    finally:
        Path(f.name).unlink(missing_ok=True)


def working_dir(path: object) -> str:
    """The directory a script is to run in, ``~`` expanded; raises ``NoSuchPath``."""
    cwd = os.path.expanduser(str(path))
    if not os.path.exists(cwd):
        raise NoSuchPath(cwd)
    return cwd


async def run_bash_script(
    script: str,
    *,
    timeout: object,
    cwd: str | None,
    workdir: Path,
    env: Mapping[str, str],
    tracker: AppTracker,
) -> Completed:
    """Run ``script`` with bash (a ``#!/bin/bash`` line added when it has none), stderr
    merged into stdout, from a file in ``workdir``. ``timeout`` is the limit as the request
    gave it. Raises ``BadCommand`` (the limit is not a positive number), ``CommandNotStarted``
    or ``CommandTimeout``."""
    if BASH_SHEBANG not in script:
        script = f"{BASH_SHEBANG}\n\n{script}"
    with tempfile.NamedTemporaryFile(
        "w", suffix=".sh", prefix="run_bash_", dir=workdir, delete=False
    ) as f:
        f.write(script)
    try:
        if isinstance(timeout, bool) or not isinstance(timeout, int | float) or timeout <= 0:
            raise BadCommand(f"timeout must be a positive number of seconds, not {timeout!r}")
        return await run_captured(
            ["/bin/bash", f.name],
            timeout_s=float(timeout),
            env=env,
            cwd=cwd,
            merge_stderr=True,
            tracker=tracker,
            source="run_bash_script",
        )
    except (OSError, TypeError) as exc:
        raise CommandNotStarted(str(exc)) from exc
    finally:
        Path(f.name).unlink(missing_ok=True)
