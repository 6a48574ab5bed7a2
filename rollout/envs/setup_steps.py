"""OSWorld's task setup steps (``task["config"]``, evaluators' ``postconfig``), interpreted
on a desktop: a registry from step type to handler, the placeholders task files use
(``{CLIENT_PASSWORD}``, ``{SCREEN_WIDTH}`` ...) and the local download cache (there is no
network here: a ``download`` step's file must already be cached).

Task files are not trusted with this host's files: every local file a task names is read only
when it resolves into ``desktops.download_cache_dir`` (``confined_path``). Otherwise a task
could upload ``/proc/self/environ`` (the model's API key) or ``~/.ssh/id_rsa`` to the desktop,
where the model reads it."""

from __future__ import annotations

import asyncio
import os
import time
import uuid
from collections.abc import Awaitable, Callable, Iterable, Mapping
from pathlib import Path
from typing import Any, Protocol

from config import DesktopsConfig
from rollout.errors import (
    BadTaskStep,
    ConfigError,
    DesktopError,
    TaskSetupError,
    UnsupportedSetupStep,
)

__all__ = ["STEP_TYPES", "SetupTarget", "cached_download", "confined_path", "run_setup_step"]

# How often an ``execute`` step with ``until`` runs its command again.
_UNTIL_POLL_INTERVAL_S = 0.3


class SetupTarget(Protocol):
    """The desktop calls setup steps make (``RemoteDesktopEnv`` implements them)."""

    cfg: DesktopsConfig
    task_id: str | None

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
    except (TypeError, ValueError) as exc:  # ValueError: the protocol's models refused them
        raise BadTaskStep(f"{where}: bad parameters for {kind!r}: {exc}") from exc
    except DesktopError as exc:
        if isinstance(exc, TaskSetupError):
            raise
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
    # stdout/stderr name files on the OSWorld host for logs; nothing to do with them here.
    del stdout, stderr
    deadline = time.monotonic() + desktop.cfg.setup_timeout_s
    while True:
        reply = await desktop.setup_execute(command, shell)
        if not until or _until_met(reply, until):
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
    roots = [Path(desktop.cfg.download_cache_dir), *desktop.cfg.task_file_roots]
    uploads = [(confined_path(f["local_path"], roots), f["path"]) for f in files]
    for local, path in uploads:
        try:
            data = await asyncio.to_thread(local.read_bytes)
        except OSError as exc:
            raise TaskSetupError(f"upload_file: cannot read {local}: {exc.strerror}") from exc
        await desktop.upload(path, data)


async def _download(desktop: SetupTarget, files: list[Mapping[str, str]]) -> None:
    """There is no network: each file must already be in ``download_cache_dir``."""
    for f in files:
        url, path = f["url"], f["path"]
        local = cached_download(Path(desktop.cfg.download_cache_dir), url, path,
                                desktop.task_id)
        data = await asyncio.to_thread(local.read_bytes)
        await desktop.upload(path, data)


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
}


# --------------------------------------------------------------------------- helpers


def confined_path(path: str | os.PathLike[str], roots: Iterable[Path]) -> Path:
    """``path`` resolved (symlinks followed), when that is a path under one of ``roots``
    (resolved too): the only files on this host a task may have read. Raises ``ValueError``
    naming the path and the roots otherwise; nothing is read."""
    resolved = Path(path).resolve()
    allowed = [Path(root).resolve() for root in roots]
    if not any(resolved != root and resolved.is_relative_to(root) for root in allowed):
        raise ValueError(
            f"{os.fspath(path)!r} (resolved: {resolved}) is outside the directories tasks "
            f"may read files from on this host: {', '.join(map(str, allowed))}"
        )
    return resolved


def cached_download(cache: Path, url: str, path: str, task_id: str | None) -> Path:
    """The local copy of a task's download: OSWorld's cache layout first (an existing
    OSWorld cache works as is), then ``<cache>/<task_id>/<name>`` and ``<cache>/<name>``.
    The copy must resolve into ``cache``: ``ValueError`` for one linked out of it."""
    base = os.path.basename(path)
    candidates = [cache / f"{uuid.uuid5(uuid.NAMESPACE_URL, url)}_{base}"]
    if task_id:
        candidates.append(cache / task_id / base)
    candidates += [cache / base, cache / os.path.basename(url.split("?", 1)[0])]
    for candidate in candidates:
        if candidate.is_file():
            return confined_path(candidate, [cache])
    raise TaskSetupError(
        f"download of {url} to {path}: not in the local cache (looked for "
        f"{', '.join(str(c) for c in candidates)}); there is no network here, so put the "
        "file in desktops.download_cache_dir first"
    )


def _until_met(reply: Mapping[str, Any], until: Mapping[str, Any]) -> bool:
    """OSWorld's ``until``: every given field matches (returncode equal, text contained)."""
    if "returncode" in until and reply.get("returncode") != until["returncode"]:
        return False
    if "stdout" in until and str(until["stdout"]) not in str(reply.get("output") or ""):
        return False
    return not ("stderr" in until and str(until["stderr"]) not in str(reply.get("error") or ""))


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
