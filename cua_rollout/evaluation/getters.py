"""OSWorld's getters: each fetches one state for a metric, from the desktop through the
``DesktopProbe`` (a file, a command's output, the accessibility tree) or from the task (rules,
files cached with the task). ``GETTERS`` maps the names task files use to them.

Local paths a task names stay in their directory (``confined_path``): a cached file in the
cache, a fetched file in the evaluation's scratch directory. A task could otherwise make a
metric read any file of this host (``/proc/self/environ`` holds the model's API key) and
turn its score into an oracle on it."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from cua_rollout.core.errors import UnsupportedEvaluator
from cua_rollout.envs.contract import DesktopProbe
from cua_rollout.envs.setup_steps import confined_path

__all__ = ["GETTERS", "EvalContext", "Getter", "get_accessibility_tree", "get_cache_file",
           "get_cloud_file",
           "get_rule", "get_vm_command_line", "get_vm_file", "get_vm_terminal_output",
           "local_file"]


@dataclass(frozen=True)
class EvalContext:
    """What a getter may use: the desktop, the task's cached files and a scratch directory
    of this evaluation (removed afterwards; two rollouts scored at once never share one)."""

    probe: DesktopProbe
    cache_dir: Path
    task_id: str | None
    scratch: Path
    evaluator: Any = None  # the Evaluator: its download cache serves cloud_file

    def readable_roots(self) -> list[Path]:
        """The only directories of this host whose files scoring may read."""
        return [self.scratch, self.cache_dir]


Getter = Callable[[EvalContext, Mapping[str, Any]], Awaitable[Any]]


def local_file(path: str | os.PathLike[str], roots: list[Path], what: str) -> Path:
    """``path`` resolved, when it lies under one of ``roots`` (``confined_path``); else
    ``UnsupportedEvaluator`` naming ``what`` asked for it, the path and the roots."""
    try:
        return confined_path(path, roots)
    except ValueError as exc:
        raise UnsupportedEvaluator(f"{what}: {exc}") from None


async def get_vm_file(ctx: EvalContext, cfg: Mapping[str, Any]) -> Any:
    """OSWorld's ``vm_file``: files from the desktop saved under ``dest`` in this
    evaluation's directory. ``multi`` takes lists ``path``/``dest``; ``gives`` (default
    ``[0]``) picks which local paths the metric gets: one path alone, several as a list; a
    file the desktop does not have is None. ``time_suffix`` (single file) appends the time
    in ``time_format`` to ``dest``'s stem, as OSWorld does."""
    if not cfg.get("multi", False):
        paths = [cfg["path"]]
        dests = [cfg.get("dest") or os.path.basename(cfg["path"])]
        if cfg.get("time_suffix", False):
            stamp = datetime.now().strftime(cfg.get("time_format", "%Y%m%d_%H%M%S"))
            dests = [f"{os.path.splitext(d)[0]}_{stamp}{os.path.splitext(d)[1]}"
                     for d in dests]
    else:
        paths, dests = list(cfg["path"]), list(cfg["dest"])
    gives = set(cfg.get("gives", [0]))
    out: list[str | None] = []
    for i, (remote, dest) in enumerate(zip(paths, dests, strict=False)):
        local = local_file(ctx.scratch / dest, [ctx.scratch], "vm_file dest")
        data = await ctx.probe.get_file(remote)
        if data is None:
            if i in gives:
                out.append(None)
            continue
        try:
            await asyncio.to_thread(_write, local, data)
        except OSError:
            if i in gives:
                out.append(None)
            continue
        if i in gives:
            out.append(str(local))
    return out[0] if len(out) == 1 else out


async def get_cloud_file(ctx: EvalContext, cfg: Mapping[str, Any]) -> Any:
    """OSWorld's ``cloud_file``: files by URL, fetched once per host into the shared download
    cache and placed under ``dest`` in this evaluation's directory; ``multi`` and ``gives``
    as for ``vm_file`` (every file is fetched; the metric gets the ones in ``gives``)."""
    if ctx.evaluator is None:
        raise UnsupportedEvaluator("cloud_file needs the download cache (score with an "
                                   "Evaluator)")
    if cfg.get("multi", False):
        pairs = list(zip(cfg["path"], cfg["dest"], strict=False))
    else:
        pairs = [(cfg["path"], cfg["dest"])]
    gives = set(cfg.get("gives", [0]))
    out: list[str] = []
    for i, (url, dest) in enumerate(pairs):
        local = await ctx.evaluator.place_cloud_file(url, dest, ctx.scratch, ctx.task_id)
        if i in gives:
            out.append(str(local))
    return out[0] if len(out) == 1 else out


def _write(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)


async def get_vm_command_line(ctx: EvalContext, cfg: Mapping[str, Any]) -> Any:
    """The standard output of a command run on the desktop (``/execute``)."""
    reply = await ctx.probe.execute(cfg["command"], shell=bool(cfg.get("shell", False)))
    return reply.get("output")


async def get_vm_terminal_output(ctx: EvalContext, cfg: Mapping[str, Any]) -> str:
    return await ctx.probe.terminal_output()


async def get_accessibility_tree(ctx: EvalContext, cfg: Mapping[str, Any]) -> str:
    return await ctx.probe.accessibility_tree()


async def get_rule(ctx: EvalContext, cfg: Mapping[str, Any]) -> Any:
    return cfg["rules"]


async def get_cache_file(ctx: EvalContext, cfg: Mapping[str, Any]) -> str:
    """A file in the task's cache: one the task's setup saved (``execute``'s ``stdout`` /
    ``stderr``, in this evaluation's directory), else one the task ships (expected outputs)
    under ``desktops.download_cache_dir``; ``UnsupportedEvaluator`` when ``path`` leads out
    of them (absolute, ``..``, a symlink) or is in neither."""
    root = ctx.cache_dir
    for candidate, base in ((ctx.scratch / cfg["path"], ctx.scratch),
                            (root / (ctx.task_id or "") / cfg["path"], root),
                            (root / cfg["path"], root)):
        local = local_file(candidate, [base], "cache_file")
        if local.is_file():
            return str(local)
    raise UnsupportedEvaluator(f"cache_file {cfg['path']!r} is not in {root} nor saved by "
                               "the task's setup")


GETTERS: dict[str, Getter] = {
    "vm_file": get_vm_file,
    "cloud_file": get_cloud_file,
    "vm_command_line": get_vm_command_line,
    "vm_terminal_output": get_vm_terminal_output,
    "accessibility_tree": get_accessibility_tree,
    "rule": get_rule,
    "cache_file": get_cache_file,
}


