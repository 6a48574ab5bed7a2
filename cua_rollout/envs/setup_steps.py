"""OSWorld's task setup steps (``task["config"]``, evaluators' ``postconfig``), interpreted
on a desktop: a registry from step type to handler, the parameters each type takes
(``STEP_PARAMETERS``, checked without a desktop by ``step_problem``) and the placeholders task
files use (``{CLIENT_PASSWORD}``, ``{SCREEN_WIDTH}`` ...). Downloads go through the host's
cache (``downloads.py``), the browser steps through the desktop's DevTools endpoint
(``chrome.py``). The behaviour of each step is that of OSWorld's ``SetupController``.

Task files are not trusted with this host's files: every local file a task names is read only
when it resolves into ``desktops.download_cache_dir`` or a task root (``confined_path``).
Otherwise a task could upload ``/proc/self/environ`` (the model's API key) or
``~/.ssh/id_rsa`` to the desktop, where the model reads it."""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path
from typing import Any, NamedTuple, Protocol

from pydantic import TypeAdapter, ValidationError

from cua_rollout.config import DesktopsConfig
from cua_rollout.core.errors import (
    BadTaskStep,
    ConfigError,
    DesktopError,
    TaskSetupError,
    UnsupportedSetupStep,
)
from cua_rollout.envs import chrome
from cua_rollout.envs.downloads import confined_path, download_cache

__all__ = ["STEP_PARAMETERS", "STEP_TYPES", "Parameter", "SetupTarget", "confined_path",
           "run_setup_step", "step_problem", "until_met"]

log = logging.getLogger(__name__)

# How often an ``execute`` step with ``until`` runs its command again.
_UNTIL_POLL_INTERVAL_S = 0.3


class SetupTarget(Protocol):
    """The desktop calls setup steps make (``RemoteDesktopEnv`` implements them)."""

    cfg: DesktopsConfig
    task_id: str | None
    # Files an ``execute`` step wrote into the task's cache (its ``stdout``/``stderr``
    # names -> the text), for the ``cache_file`` getter: this episode's, never shared.
    task_cache: dict[str, str]

    @property
    def client_password(self) -> str | None: ...

    async def launch(self, command: list[str] | str, shell: bool = False) -> None: ...

    async def setup_execute(self, command: list[str] | str, shell: bool = False
                            ) -> dict[str, Any]: ...

    async def open_file(self, path: str) -> None: ...

    async def activate_window(self, window_name: str, strict: bool = False,
                              by_class: bool = False) -> None: ...

    async def close_window(self, window_name: str, strict: bool = False,
                           by_class: bool = False) -> None: ...

    async def upload(self, path: str, data: bytes) -> None: ...

    @property
    def devtools_url(self) -> str:
        """The desktop browser's DevTools endpoint, ``http://<desktop host>:<port>``."""
        ...


Handler = Callable[..., Awaitable[None]]


async def run_setup_step(desktop: SetupTarget, step: Mapping[str, Any], index: int = 0) -> None:
    """One OSWorld setup step ``{"type": ..., "parameters": {...}}`` on ``desktop``.
    A step type not in ``STEP_TYPES`` raises ``UnsupportedSetupStep``; a failed step
    ``TaskSetupError`` naming the task, the step's index and its type."""
    kind = step.get("type") if isinstance(step, Mapping) else None
    params = (step.get("parameters") or {}) if isinstance(step, Mapping) else {}
    where = f"task {desktop.task_id or '?'} config[{index}]"
    if not isinstance(kind, str) or not isinstance(params, Mapping):
        raise TaskSetupError(f"{where}: a setup step needs a 'type' and 'parameters' mapping")
    params = _fill_placeholders(desktop, params, where)
    handler = STEP_TYPES.get(kind)
    if handler is None:
        raise UnsupportedSetupStep(f"{where}: setup step type {kind!r} is not supported")
    try:
        await handler(desktop, **params)
    except KeyError as exc:  # a record in a list parameter lacks a field
        raise BadTaskStep(f"{where}: bad parameters for {kind!r}: missing {exc}") from exc
    except (TypeError, ValueError) as exc:  # ValueError: the protocol's models refused them
        raise BadTaskStep(f"{where}: bad parameters for {kind!r}: {exc}") from exc
    except TaskSetupError as exc:  # same class (retryable or not), now naming the step
        raise type(exc)(f"{where} ({kind}): {exc}") from exc
    except DesktopError as exc:
        raise TaskSetupError(f"{where} ({kind}) failed: {exc}") from exc


# --------------------------------------------------------------------------- the steps


async def _launch(desktop: SetupTarget, command: list[str] | str, shell: bool = False) -> None:
    await desktop.launch(command, shell)


async def _execute(
    desktop: SetupTarget,
    command: list[str] | str,
    shell: bool = False,
    stdout: str = "",
    stderr: str = "",
    until: Mapping[str, Any] | None = None,
) -> None:
    deadline = time.monotonic() + desktop.cfg.setup_timeout_s
    while True:
        reply = await desktop.setup_execute(command, shell)
        # As OSWorld's SetupController: each answer's output and error go into the task's
        # cache under the names given (the cache_file getter reads them when scoring).
        if stdout:
            desktop.task_cache[stdout] = str(reply.get("output") or "")
        if stderr:
            desktop.task_cache[stderr] = str(reply.get("error") or "")
        if not until or until_met(reply, until):
            return
        if time.monotonic() > deadline:
            raise TaskSetupError(f"execute {command!r}: 'until' {dict(until)} not met in time")
        await asyncio.sleep(_UNTIL_POLL_INTERVAL_S)


async def _open(desktop: SetupTarget, path: str) -> None:
    await desktop.open_file(path)


async def _sleep(desktop: SetupTarget, seconds: float) -> None:
    await asyncio.sleep(float(seconds))


async def _activate_window(desktop: SetupTarget, window_name: str, strict: bool = False,
                           by_class: bool = False) -> None:
    await desktop.activate_window(window_name, strict, by_class)


async def _close_window(desktop: SetupTarget, window_name: str, strict: bool = False,
                        by_class: bool = False) -> None:
    await desktop.close_window(window_name, strict, by_class)


async def _upload_file(desktop: SetupTarget, files: list[Mapping[str, str]]) -> None:
    """Each ``local_path`` (relative: to the working directory, as OSWorld reads it) must
    lie in the download cache or a task root (``desktops.task_file_roots``: run.py adds the
    task source's folder); ``ValueError`` otherwise, before any file is read."""
    roots = _upload_roots(desktop.cfg)
    uploads = await asyncio.to_thread(
        lambda: [(confined_path(f["local_path"], roots), f["path"]) for f in files])
    for local, path in uploads:
        try:
            data = await asyncio.to_thread(local.read_bytes)
        except OSError as exc:
            raise TaskSetupError(f"upload_file: cannot read {local}: {exc.strerror}") from exc
        await desktop.upload(path, data)


async def _download(desktop: SetupTarget, files: list[Mapping[str, str]]) -> None:
    """Each file from the host's cache (``downloads.DownloadCache``: fetched into it once
    per host unless ``desktops.offline``), then uploaded to the desktop's ``path``."""
    cache = download_cache(desktop.cfg)
    for f in files:
        url, path = f["url"], f["path"]
        if not url or not path:
            raise ValueError(f"a download needs a 'url' and a 'path': {dict(f)!r}")
        local = await cache.fetch(url, os.path.basename(path), desktop.task_id)
        data = await asyncio.to_thread(local.read_bytes)
        await desktop.upload(path, data)


async def _chrome_open_tabs(desktop: SetupTarget, urls_to_open: list[str]) -> None:
    async with chrome.DevTools(desktop.devtools_url,
                               timeout_s=desktop.cfg.request_timeout_s) as devtools:
        await devtools.wait_until_up()
        await chrome.open_tabs(devtools, urls_to_open)


async def _chrome_close_tabs(desktop: SetupTarget, urls_to_close: list[str]) -> None:
    async with chrome.DevTools(desktop.devtools_url,
                               timeout_s=desktop.cfg.request_timeout_s) as devtools:
        await devtools.wait_until_up()
        await chrome.close_tabs(devtools, urls_to_close)


async def _update_browse_history(desktop: SetupTarget,
                                 history: list[Mapping[str, Any]]) -> None:
    """OSWorld's: its empty History database (from the cache) filled with ``history`` and
    put in place of the desktop browser's own, then given the owner of the folder it is in
    (OSWorld chowns it to its VM's user; here the folder's owner is the browser's user). The
    browser must not be running yet: it keeps the file open and would not see the change."""
    cache = download_cache(desktop.cfg)
    template = await cache.fetch(chrome.HISTORY_TEMPLATE_URL, chrome.HISTORY_TEMPLATE_NAME,
                                 desktop.task_id)
    data = await asyncio.to_thread(chrome.history_database, template, history, time.time())
    await desktop.upload(chrome.HISTORY_PATH, data)
    history_file = chrome.HISTORY_PATH.replace("~", "$HOME", 1)
    reply = await desktop.setup_execute(
        f'chown --reference="$(dirname "{history_file}")" "{history_file}"', True)
    if reply.get("returncode") not in (0, None):  # best effort, as OSWorld's chown
        log.warning("update_browse_history: chown of %s failed: %s", chrome.HISTORY_PATH,
                    str(reply.get("error") or reply.get("output") or "")[:200])


def _needs_accounts(kind: str) -> Handler:
    """``login`` and ``googledrive`` sign in to Google with the user's credentials and
    need the internet: they are never run here, only refused with the reason."""

    async def refuse(desktop: SetupTarget, **params: Any) -> None:
        raise UnsupportedSetupStep(_accounts_problem(kind, desktop.cfg))

    return refuse


# Step type -> handler(desktop, **parameters). OSWorld's names; ``command`` is an alias.
STEP_TYPES: dict[str, Handler] = {
    "launch": _launch,
    "execute": _execute,
    "command": _execute,
    "open": _open,
    "sleep": _sleep,
    "activate_window": _activate_window,
    "close_window": _close_window,
    "upload_file": _upload_file,
    "download": _download,
    "chrome_open_tabs": _chrome_open_tabs,
    "chrome_close_tabs": _chrome_close_tabs,
    "update_browse_history": _update_browse_history,
    "login": _needs_accounts("login"),
    "googledrive": _needs_accounts("googledrive"),
}


# --------------------------------------------------------------------------- checking steps


class Parameter(NamedTuple):
    """One parameter of a step type: whether a step must give it, and what it must be."""

    required: bool
    check: Callable[[Any], bool]
    expected: str
    """What ``check`` accepts, as an error message says it."""


def _is_str(value: Any) -> bool:
    return isinstance(value, str)


# What the desktop protocol's models take as a boolean: OSWorld's own tasks write
# ``"shell": "true"``, which its server (and ours) reads as true.
_FLAG_VALUES = TypeAdapter(bool)


def _is_flag(value: Any) -> bool:
    try:
        _FLAG_VALUES.validate_python(value)
    except ValidationError:
        return False
    return True


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _is_command(value: Any) -> bool:
    if isinstance(value, str):
        return bool(value.strip())
    return isinstance(value, list) and bool(value) and all(isinstance(v, str) for v in value)


def _is_str_list(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(v, str) for v in value)


def _records(*keys: str) -> Callable[[Any], bool]:
    def check(value: Any) -> bool:
        return isinstance(value, list) and all(
            isinstance(v, Mapping) and all(isinstance(v.get(k), str) and v.get(k) for k in keys)
            for v in value)
    return check


def _is_history(value: Any) -> bool:
    return isinstance(value, list) and all(
        isinstance(v, Mapping) and isinstance(v.get("url"), str)
        and isinstance(v.get("title"), str)
        and _is_number(v.get("visit_time_from_now_in_seconds"))
        for v in value)


_COMMAND = Parameter(True, _is_command, "a command: a non-empty string or list of strings")
_FLAG = Parameter(False, _is_flag, "true or false")
_TEXT = Parameter(False, _is_str, "a string")
_WINDOW = {"window_name": Parameter(True, lambda v: isinstance(v, str) and bool(v),
                                    "a non-empty string"),
           "strict": _FLAG, "by_class": _FLAG}
_CACHE_NAME = Parameter(False, lambda v: isinstance(v, str) and _is_cache_name(v),
                        "a relative file name in the task's cache (no '..')")
_EXECUTE = {"command": _COMMAND, "shell": _FLAG, "stdout": _CACHE_NAME, "stderr": _CACHE_NAME,
            "until": Parameter(False, lambda v: v is None or isinstance(v, Mapping),
                               "a mapping of returncode / stdout / stderr")}

# Step type -> its parameters (name -> Parameter); the handler in STEP_TYPES takes exactly
# these. ``login`` and ``googledrive`` are absent: they take OSWorld's free-form settings and
# are refused whatever they hold.
STEP_PARAMETERS: dict[str, dict[str, Parameter]] = {
    "launch": {"command": _COMMAND, "shell": _FLAG},
    "execute": _EXECUTE,
    "command": _EXECUTE,
    "open": {"path": Parameter(True, lambda v: isinstance(v, str) and bool(v),
                               "a non-empty path")},
    "sleep": {"seconds": Parameter(True, _is_number, "a number of seconds")},
    "activate_window": _WINDOW,
    "close_window": _WINDOW,
    "upload_file": {"files": Parameter(True, _records("local_path", "path"),
                                       "a list of {local_path, path} strings")},
    "download": {"files": Parameter(True, _records("url", "path"),
                                    "a list of {url, path} strings")},
    "chrome_open_tabs": {"urls_to_open": Parameter(True, _is_str_list, "a list of URLs")},
    "chrome_close_tabs": {"urls_to_close": Parameter(True, _is_str_list, "a list of URLs")},
    "update_browse_history": {"history": Parameter(
        True, _is_history, "a list of {url, title, visit_time_from_now_in_seconds}")},
}
_ACCOUNT_STEPS = ("login", "googledrive")


def step_problem(step: Mapping[str, Any], cfg: DesktopsConfig, *,
                 task_id: str | None = None) -> str | None:
    """Why ``step`` could not run here, found without a desktop (for checking tasks before
    any runs): not a step, a type we lack, parameters missing, unknown or of the wrong kind,
    ``{CLIENT_PASSWORD}`` without ``desktops.client_password_env``, a sign-in step without
    ``desktops.accounts_dir``, a download not cached while ``desktops.offline``, a file to
    upload that is missing or outside the directories tasks may read. None when the step
    looks runnable (the desktop may still fail it). ``task_id`` finds OSWorld's per-task
    cache names. Blocking: it looks at files."""
    if not isinstance(step, Mapping):
        return f"a setup step must be a mapping with 'type' and 'parameters', not {step!r:.100}"
    kind, params = step.get("type"), step.get("parameters") or {}
    if not isinstance(kind, str):
        return f"a setup step needs a 'type' string: {dict(step)!r:.200}"
    if not isinstance(params, Mapping):
        return f"{kind}: 'parameters' must be a mapping, not {params!r:.100}"
    if kind not in STEP_TYPES:
        return (f"setup step type {kind!r} is not supported (supported: "
                f"{', '.join(sorted(STEP_TYPES))})")
    if kind in _ACCOUNT_STEPS:
        return _accounts_problem(kind, cfg) if cfg.accounts_dir is None else None
    spec = STEP_PARAMETERS[kind]
    wrong = [f"missing {name!r} ({p.expected})" for name, p in spec.items()
             if p.required and name not in params]
    wrong += [f"unknown parameter {name!r}" for name in params if name not in spec]
    wrong += [f"{name!r} must be {p.expected}, not {params[name]!r:.100}"
              for name, p in spec.items() if name in params and not p.check(params[name])]
    if wrong:
        return f"{kind}: {'; '.join(wrong)}"
    if cfg.client_password_env is None and _mentions(params, "{CLIENT_PASSWORD}"):
        return f"{kind}: uses {{CLIENT_PASSWORD}} but desktops.client_password_env is not set"
    files_check = _FILE_CHECKS.get(kind)
    return files_check(params, cfg, task_id) if files_check else None


def _accounts_problem(kind: str, cfg: DesktopsConfig) -> str:
    if cfg.accounts_dir is None:
        return (f"setup step {kind!r} signs in to the user's Google account: it needs the "
                "credentials in desktops.accounts_dir (OSWorld's settings folder), which is "
                "not set, and the network")
    return (f"setup step {kind!r} is run only by OSWorld's own SetupController in the "
            "evaluator worker, with the credentials in desktops.accounts_dir "
            f"({cfg.accounts_dir}) and the network; this interpreter does not sign in")


def _upload_roots(cfg: DesktopsConfig) -> list[Path]:
    return [Path(cfg.download_cache_dir), *cfg.task_file_roots]


def _mentions(value: Any, text: str) -> bool:
    if isinstance(value, str):
        return text in value
    if isinstance(value, Mapping):
        return any(_mentions(v, text) for v in value.values())
    if isinstance(value, list):
        return any(_mentions(v, text) for v in value)
    return False


def _uncached(cfg: DesktopsConfig, task_id: str | None, kind: str, url: str, name: str
              ) -> str | None:
    """Offline: why ``url`` could not be had (not cached, or cached through a link out of
    the cache); None when it is cached, or when it may be downloaded."""
    if not cfg.offline:
        return None
    cache = download_cache(cfg)
    try:
        if cache.lookup(url, name, task_id) is not None:
            return None
        looked = ", ".join(str(p) for p in cache.candidates(url, name, task_id))
    except TaskSetupError as exc:
        return f"{kind}: {exc}"
    return (f"{kind}: {url} is not in the cache (looked for {looked}) and "
            "desktops.offline is set")


def _check_download(params: Mapping[str, Any], cfg: DesktopsConfig, task_id: str | None
                    ) -> str | None:
    for f in params["files"]:
        problem = _uncached(cfg, task_id, "download", f["url"], os.path.basename(f["path"]))
        if problem:
            return problem
    return None


def _check_history(params: Mapping[str, Any], cfg: DesktopsConfig, task_id: str | None
                   ) -> str | None:
    return _uncached(cfg, task_id, "update_browse_history (its History template)",
                     chrome.HISTORY_TEMPLATE_URL, chrome.HISTORY_TEMPLATE_NAME)


def _check_upload(params: Mapping[str, Any], cfg: DesktopsConfig, task_id: str | None
                  ) -> str | None:
    for f in params["files"]:
        try:
            local = confined_path(f["local_path"], _upload_roots(cfg))
        except ValueError as exc:
            return f"upload_file: {exc}"
        if not local.is_file():
            return f"upload_file: {f['local_path']!r} (resolved: {local}) is not a file"
    return None


_FILE_CHECKS: dict[str, Callable[[Mapping[str, Any], DesktopsConfig, str | None],
                                 str | None]] = {
    "download": _check_download,
    "update_browse_history": _check_history,
    "upload_file": _check_upload,
}


# --------------------------------------------------------------------------- helpers


def until_met(reply: Mapping[str, Any], until: Mapping[str, Any]) -> bool:
    """OSWorld's ``until`` (``SetupController._execute_setup``): met when ANY given field
    matches: the returncode equal, or the text contained in stdout, or in stderr."""
    return (("returncode" in until and reply.get("returncode") == until["returncode"])
            or ("stdout" in until and str(until["stdout"]) in str(reply.get("output") or ""))
            or ("stderr" in until and str(until["stderr"]) in str(reply.get("error") or "")))


def _is_cache_name(name: str) -> bool:
    """An empty name (none) or a relative path that stays inside the task's cache."""
    if not name:
        return True
    parts = name.replace("\\", "/").split("/")
    return not name.startswith("/") and ".." not in parts and all(parts)


def _fill_placeholders(desktop: SetupTarget, value: Any, where: str) -> Any:
    if isinstance(value, str):
        if "{CLIENT_PASSWORD}" in value:
            password = desktop.client_password
            if password is None:
                raise ConfigError(
                    f"{where} uses {{CLIENT_PASSWORD}} but desktops.client_password_env "
                    "is not set"
                )
            value = value.replace("{CLIENT_PASSWORD}", password)
        w, h = desktop.cfg.screen_width, desktop.cfg.screen_height
        for key, number in (
            ("{SCREEN_WIDTH_HALF}", w // 2), ("{SCREEN_HEIGHT_HALF}", h // 2),
            ("{SCREEN_WIDTH}", w), ("{SCREEN_HEIGHT}", h),
        ):
            value = value.replace(key, str(number))
        return value
    if isinstance(value, Mapping):
        return {k: _fill_placeholders(desktop, v, where) for k, v in value.items()}
    if isinstance(value, list):
        return [_fill_placeholders(desktop, v, where) for v in value]
    return value
