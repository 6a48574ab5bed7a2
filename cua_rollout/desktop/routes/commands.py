"""Routes that run code on the desktop: ``/execute`` (and ``/setup/execute``; plain pyautogui
actions in the warm interpreter of ``cua_rollout.desktop.actions``, the rest in a fresh process),
``/run_python``, ``/run_bash_script``, and ``/actions`` (how ``/execute`` ran its commands).
"""

from __future__ import annotations

import time

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from cua_rollout.desktop.commands import (
    read_command,
    run_bash_script,
    run_command,
    run_python,
    shell_argv,
    time_limit,
    working_dir,
)
from cua_rollout.desktop.errors import CommandError, CommandTimeout, NoSuchPath
from cua_rollout.desktop.protocol import (
    ActionsReply,
    CommandReply,
    MessageReply,
    Paths,
    RunPythonErrorReply,
    RunPythonReply,
)
from cua_rollout.desktop.routes.common import State, json_reply, read_json

__all__ = ["router"]

router = APIRouter()


@router.post(Paths.EXECUTE)
@router.post(Paths.SETUP_EXECUTE)
async def execute(request: Request, state: State) -> JSONResponse:
    data = await read_json(request)
    try:
        command = read_command(data)
        timeout_s = time_limit(command, state.settings.execute_timeout_s)
        started = time.monotonic()
        code = state.actions.plain(command)
        result = None
        if code is not None:
            result = await state.actions.run(code, shell_argv(command), timeout_s=timeout_s)
        if result is None:
            state.actions.count_fresh(plain=code is not None)
            if code is not None:  # what the warm interpreter's attempt left of the limit
                timeout_s = max(timeout_s - (time.monotonic() - started), 0.001)
            result = await run_command(
                command, timeout_s=timeout_s, env=state.env, tracker=state.apps
            )
    except CommandError as exc:  # OSWorld's server answers 500 for every one of them
        return json_reply(MessageReply(status="error", message=str(exc)), 500)
    return json_reply(
        CommandReply(
            status="success",
            output=result.stdout_text,
            error=result.stderr_text,
            returncode=result.returncode,
        )
    )


@router.get(Paths.ACTIONS)
async def actions(state: State) -> JSONResponse:
    """How ``/execute`` ran its commands: warm, fresh, restarts (not in OSWorld)."""
    focus = state.click_focus.stats() if state.click_focus is not None else {}
    return json_reply(ActionsReply(**state.actions.stats(), **focus))


@router.post(Paths.RUN_PYTHON)
async def run_python_code(request: Request, state: State) -> JSONResponse:
    code = (await read_json(request)).get("code")
    if not code:
        return json_reply(MessageReply(status="error", message="Code not supplied!"), 400)
    try:
        result = await run_python(
            str(code),
            workdir=state.workdir,
            timeout_s=state.settings.run_python_timeout_s,
            env=state.env,
            tracker=state.apps,
        )
    except CommandTimeout:
        message = "Execution timeout: Code took too long to execute"
        return json_reply(RunPythonErrorReply(message=message, error="TimeoutExpired"), 500)
    except CommandError as exc:
        return json_reply(
            RunPythonErrorReply(message=f"Execution error: {exc}", error=str(exc)), 500
        )
    output, error = result.stdout_text, result.stderr_text
    if result.returncode != 0 and not error:
        error = f"Process exited with code {result.returncode}"
    return json_reply(
        RunPythonReply(
            status="success" if result.returncode == 0 else "error",
            message="\n".join(part for part in (output, error) if part),
            output=output,
            error=error,
            return_code=result.returncode,
        )
    )


@router.post(Paths.RUN_BASH_SCRIPT)
async def run_script(request: Request, state: State) -> JSONResponse:
    data = await read_json(request)
    script = data.get("script")
    if not script:
        return _script_failed(400, "Script not supplied!")
    timeout = data.get("timeout", state.settings.bash_default_timeout_s)
    try:
        cwd = working_dir(data["working_dir"]) if data.get("working_dir") else None
    except NoSuchPath as exc:
        return _script_failed(400, f"Working directory does not exist: {exc.path}")
    try:
        result = await run_bash_script(
            str(script),
            timeout=timeout,
            cwd=cwd,
            workdir=state.workdir,
            env=state.env,
            tracker=state.apps,
        )
    except CommandTimeout:
        return _script_failed(500, f"Script execution timed out after {timeout} seconds")
    except CommandError as exc:
        return _script_failed(500, f"Failed to execute script: {exc}")
    return json_reply(
        CommandReply(
            status="success" if result.returncode == 0 else "error",
            output=result.stdout_text,
            error="",
            returncode=result.returncode,
        )
    )


def _script_failed(status_code: int, output: str) -> JSONResponse:
    reply = CommandReply(status="error", output=output, error="", returncode=-1)
    return json_reply(reply, status_code)
