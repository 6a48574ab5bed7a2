"""``core.aio.pipe_reader``: a pipe read on the loop, its descriptor closed exactly once,
under asyncio and under uvloop (whose ``connect_read_pipe`` closes it twice: the EBADF a
runner's rag tool saw while py sandboxes ran beside it)."""

from __future__ import annotations

import asyncio
import gc
import os
from collections.abc import Callable
from pathlib import Path

import pytest
import uvloop

from cua_rollout.core.aio import pipe_reader

LOOPS: dict[str, Callable[[], asyncio.AbstractEventLoop]] = {
    "asyncio": asyncio.new_event_loop, "uvloop": uvloop.new_event_loop}


def _run(loop_name: str, coro_fn: Callable[[], object]) -> object:
    with asyncio.Runner(loop_factory=LOOPS[loop_name]) as runner:
        return runner.run(coro_fn())  # type: ignore[arg-type]


@pytest.mark.parametrize("loop_name", sorted(LOOPS))
def test_a_pipe_is_read_to_its_end_and_its_descriptor_closed_once(loop_name, tmp_path: Path):
    unrelated = tmp_path / "corpus.txt"
    unrelated.write_text("passage\n" * 1000)

    async def main() -> tuple[bytes, bytes]:
        read_fd, write_fd = os.pipe()
        reader, close = pipe_reader(read_fd)
        payload = os.urandom(300_000)

        async def write() -> None:
            view = memoryview(payload)
            while view:
                view = view[await asyncio.to_thread(os.write, write_fd, view[:65536]):]
            os.close(write_fd)

        got, _ = await asyncio.gather(reader.read(), write())
        assert got == payload
        for _ in range(3):
            await asyncio.sleep(0)
        gc.collect()
        # Only ``close`` closes it: the loop (libuv, under uvloop) has not, so no file another
        # thread opens meanwhile can get its number and lose it to a second close.
        os.fstat(read_fd)
        close()
        close()  # a second call does nothing
        # The lowest free number is the one just closed: a file opened now gets it. Nothing
        # of the reader may close it behind the file's back (a loop turn, a collection).
        with unrelated.open("rb") as f:
            assert f.fileno() == read_fd
            for _ in range(3):
                await asyncio.sleep(0)
            gc.collect()
            await asyncio.sleep(0.01)
            os.fstat(f.fileno())  # EBADF here was the bug
            return got[:10], f.read(8)

    head, text = _run(loop_name, main)  # type: ignore[misc]
    assert text == b"passage\n" and len(head) == 10


@pytest.mark.parametrize("loop_name", sorted(LOOPS))
def test_closing_before_the_end_stops_the_reader(loop_name):
    async def main() -> None:
        read_fd, write_fd = os.pipe()
        reader, close = pipe_reader(read_fd)
        os.write(write_fd, b"partial")
        assert await reader.read(7) == b"partial"
        close()
        os.close(write_fd)
        with pytest.raises(OSError):
            os.fstat(read_fd)

    _run(loop_name, main)
