"""asyncio helpers every actor uses: background tasks that remove themselves when done, and
capped, fully jittered backoff. (Calls to another actor, a Ray handle or a local object alike,
go through the typed clients of cua_rollout/runtime/actors.py.)"""

from __future__ import annotations

import asyncio
import os
import random
from collections.abc import Callable, Coroutine, Iterator
from typing import Any

__all__ = ["TaskSet", "backoff_s", "pipe_reader"]

_PIPE_CHUNK = 65536


class TaskSet:
    """Background tasks owned by one object; each leaves the set when it ends, so the set
    holds exactly what still runs (and keeps it from being garbage-collected)."""

    def __init__(self) -> None:
        self._tasks: set[asyncio.Task[Any]] = set()

    def spawn(self, coro: Coroutine[Any, Any, Any]) -> asyncio.Task[Any]:
        task = asyncio.get_running_loop().create_task(coro)
        self.add(task)
        return task

    def add(self, task: asyncio.Future[Any]) -> None:
        self._tasks.add(task)  # type: ignore[arg-type]
        task.add_done_callback(self._tasks.discard)  # type: ignore[arg-type]

    def __iter__(self) -> Iterator[asyncio.Task[Any]]:
        # A snapshot, so a caller may cancel tasks (which then leave the set) while iterating.
        return iter(list(self._tasks))

    def __len__(self) -> int:
        return len(self._tasks)

    def __bool__(self) -> bool:
        return bool(self._tasks)

    async def wait(self, timeout_s: float | None = None) -> set[asyncio.Task[Any]]:
        """Wait for the tasks running now (at most ``timeout_s``); returns those still running."""
        if not self._tasks:
            return set()
        _, late = await asyncio.wait(list(self._tasks), timeout=timeout_s)
        return late

    async def cancel_all(self) -> None:
        """Cancel every task and wait until each has ended."""
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def backoff_s(attempt: int, initial_s: float, max_s: float, rng: random.Random | None = None
              ) -> float:
    """Full-jitter backoff before retry number ``attempt`` (1 for the first retry): uniform
    in [0, min(max_s, initial_s * 2**(attempt-1))], so clients that failed together do not
    come back together."""
    cap = min(max_s, initial_s * 2 ** (attempt - 1))
    return (rng or random).uniform(0, cap)


def pipe_reader(fd: int, limit: int = 2**16) -> tuple[asyncio.StreamReader, Callable[[], None]]:
    """A ``StreamReader`` fed from the read end ``fd`` of a pipe, on the running loop, and the
    function that stops it and closes ``fd`` (once, whenever called: safe from a ``finally``).

    Not ``loop.connect_read_pipe``: under uvloop (Ray's actors and uvicorn use it when it is
    installed) that closes the descriptor twice, through libuv and through the file object
    (uvloop issue 763); when another thread has opened a file in between, the second close
    takes that file's descriptor, whose next read fails with EBADF. Here the loop only
    watches ``fd`` (``add_reader``) and this module alone closes it."""
    loop = asyncio.get_running_loop()
    os.set_blocking(fd, False)
    reader = asyncio.StreamReader(limit=limit)
    state = {"open": True, "watched": True}

    def unwatch() -> None:
        if state["watched"]:
            state["watched"] = False
            loop.remove_reader(fd)

    def ready() -> None:
        try:
            data = os.read(fd, _PIPE_CHUNK)
        except (BlockingIOError, InterruptedError):
            return
        except OSError as exc:
            unwatch()
            reader.set_exception(exc)
            return
        if data:
            reader.feed_data(data)
        else:
            unwatch()
            reader.feed_eof()

    def close() -> None:
        if state["open"]:
            state["open"] = False
            unwatch()
            os.close(fd)

    loop.add_reader(fd, ready)
    return reader, close
