"""``--watch DIR``: wait for the first complete checkpoint in a directory, then hand each newer
one to the supervisor once it is complete and has not changed for one poll."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from cua_rollout.model.fleet.checkpoints import checkpoint_mtime, newest_checkpoint

__all__ = ["first_checkpoint", "newest_not_served", "watch_checkpoints"]

log = logging.getLogger(__name__)


async def first_checkpoint(directory: Path, interval_s: float) -> Path:
    """The newest complete checkpoint in ``directory`` once one has stayed unchanged for a
    poll of ``interval_s``."""
    log.info("waiting for a checkpoint in %s", directory)
    previous = None
    while True:
        found = await asyncio.to_thread(newest_checkpoint, directory)
        if found is not None and previous is not None and found.signature == previous:
            return found.path
        previous = found.signature if found is not None else None
        await asyncio.sleep(interval_s)


async def watch_checkpoints(
    directory: Path,
    served: str,
    interval_s: float,
    *,
    busy: Callable[[], bool],
    roll_out: Callable[[str], Awaitable[None]],
) -> None:
    """Call ``roll_out(path)`` for each checkpoint written to ``directory`` after ``served``
    (the one being served), once it is complete and has not changed for one poll, and
    while no reload is running (``busy()``). Runs until cancelled."""
    handled_mtime = await asyncio.to_thread(checkpoint_mtime, served)
    pending: str | None = None
    log.info("watching %s for new checkpoints every %.0f s", directory, interval_s)
    while True:
        await asyncio.sleep(interval_s)
        found = await asyncio.to_thread(newest_checkpoint, directory)
        if found is None or found.mtime <= handled_mtime:
            continue
        if found.signature != pending:
            pending = found.signature  # still being written? look again next time
            continue
        if busy():
            continue
        handled_mtime = found.mtime
        await roll_out(str(found.path))


def newest_not_served(state: dict[str, Any] | None) -> str | None:
    """Why the pool of ``state`` (``endpoints.json``) is not serving its newest checkpoint
    right now, or None when it is: the checkpoint barrier's question (tasks.checkpoint_barrier).

    Not served: no state, a rolling reload under way, no healthy replica, replicas on
    another version than the pool's, or (when its watched directory is readable here) a
    newer complete checkpoint there than the one the pool serves."""
    if not isinstance(state, dict):
        return "the model pool's endpoint list is not readable"
    reload = state.get("reload") or {}
    if reload.get("state") == "running":
        return (f"reload {reload.get('id')} to {reload.get('version')} under way "
                f"({reload.get('batches_done')}/{reload.get('batches_total')} batches)")
    serving = [e for e in state.get("endpoints") or []
               if e.get("healthy") and not e.get("draining")]
    if not serving:
        return "no replica is serving"
    target = state.get("model_version")
    versions = sorted({str(e.get("model_version")) for e in serving})
    if versions != [target]:
        return f"replicas serve {', '.join(versions)}; the pool's checkpoint is {target}"
    watch_dir = (state.get("supervisor") or {}).get("watch_dir")
    if watch_dir and Path(watch_dir).is_dir():
        newest = newest_checkpoint(Path(watch_dir))
        served = state.get("checkpoint")
        if (newest is not None and served and newest.path != Path(served).resolve()
                and newest.mtime > checkpoint_mtime(served)):
            return f"{newest.path.name} in {watch_dir} is newer than the served {target}"
    return None
