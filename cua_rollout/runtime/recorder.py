"""The coordinator's way to the storage's results.jsonl: episodes that become final while a
call is under way go together in the next (``StorageActor.record_results``), so the storage
carries one Ray call per batch, not one per episode, and a lone result is never held back
(no timer: a batch is whatever waited for the previous call).

Each caller awaits its own record: it returns once the line is durable, or raises
``StorageError`` with why it is not (the coordinator then stops the run; the episode is not
in results.jsonl and a rerun runs it again).
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from cua_rollout.core.errors import StorageError
from cua_rollout.runtime.actors import StorageClient

__all__ = ["ResultRecorder"]

# Records per call at most: ~1 KB each keeps a call's arguments under Ray's inline limit
# (100 KiB), so a batch never goes through the object store.
BATCH_MAX = 64


class ResultRecorder:
    """Batches ``record`` calls into ``record_results`` calls, one in flight at a time."""

    def __init__(self, storage: StorageClient, timeout_s: float) -> None:
        self.storage = storage
        self.timeout_s = timeout_s
        self.calls = 0
        self.records = 0
        self._waiting: list[tuple[tuple[dict[str, Any], str | None, list[str]],
                                  asyncio.Future[None]]] = []
        self._sender: asyncio.Task[None] | None = None
        self._since: list[float] = []  # when each record not yet answered came, in order
        self._sending = 0              # records of the call under way

    async def record(self, record: dict[str, Any], staging: str | None = None,
                     discard: list[str] | None = None) -> None:
        """Append ``record``'s line (``staging``, ``discard``: ``record_results``)."""
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiting.append(((record, staging, list(discard or ())), done))
        self._since.append(time.monotonic())
        if self._sender is None or self._sender.done():
            self._sender = asyncio.create_task(self._send())
        await asyncio.shield(done)  # a caller's cancel never tears a batch apart

    async def _send(self) -> None:
        while self._waiting:
            batch, self._waiting = self._waiting[:BATCH_MAX], self._waiting[BATCH_MAX:]
            self.calls += 1
            self.records += len(batch)
            self._sending = len(batch)
            try:
                errors = await asyncio.wait_for(
                    self.storage.record_results([item for item, _ in batch]), self.timeout_s)
            except Exception as exc:  # the call itself: none of them is known written
                for _, done in batch:
                    if not done.done():
                        done.set_exception(exc)
                continue
            finally:
                del self._since[:len(batch)]
                self._sending = 0
            for (_, done), error in zip(batch, errors, strict=True):
                if done.done():
                    continue
                if error is None:
                    done.set_result(None)
                else:
                    done.set_exception(StorageError(error))

    def lag(self) -> dict[str, Any]:
        """How far the storage is behind: results waiting for their line (in the call under
        way or behind it) and the age of the oldest (``/status``'s storage lag)."""
        return {"results_waiting": len(self._waiting) + self._sending,
                "oldest_s": round(time.monotonic() - self._since[0], 3) if self._since else 0.0}
