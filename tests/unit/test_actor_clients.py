"""The typed actor clients (cua_rollout/runtime/actors.py) over a local object and over a Ray
handle's shape (``method.remote``): calls start when made, in order, and a local method that
answers synchronously is awaited like the others."""

from __future__ import annotations

import asyncio
from typing import Any

from cua_rollout.runtime.actors import PoolClient, RunnerClient, StorageClient


class _LocalPool:
    def __init__(self) -> None:
        self.calls: list[tuple[str, Any]] = []

    async def release_owned(self, owner_prefix: str, healthy: bool = True) -> int:
        self.calls.append(("release_owned", (owner_prefix, healthy)))
        return 2

    def stats(self) -> dict[str, Any]:
        return {"free": 1}


class _RemoteMethod:
    """What a Ray actor handle's attribute looks like: ``.remote(...)`` gives an awaitable."""

    def __init__(self, answer: Any, sent: list[tuple[Any, ...]]) -> None:
        self.answer, self.sent = answer, sent

    def remote(self, *args: Any) -> Any:
        self.sent.append(args)
        future = asyncio.get_running_loop().create_future()
        future.set_result(self.answer)
        return future


class _Handle:
    def __init__(self) -> None:
        self.sent: list[tuple[Any, ...]] = []
        self.cancel = _RemoteMethod(3, self.sent)


async def test_a_local_object_is_called_and_a_synchronous_answer_awaited() -> None:
    pool = _LocalPool()
    client = PoolClient(pool)
    assert await client.release_owned("runner-0/", True) == 2
    assert pool.calls == [("release_owned", ("runner-0/", True))]
    assert await client.stats() == {"free": 1}


async def test_a_call_starts_when_it_is_made_not_when_it_is_awaited() -> None:
    seen: list[str] = []

    class Storage:
        async def write_metrics(self, sample: dict[str, Any]) -> None:
            seen.append(sample["n"])

    client = StorageClient(Storage())
    first, second = client.write_metrics({"n": "a"}), client.write_metrics({"n": "b"})
    await asyncio.sleep(0)
    assert seen == ["a", "b"]
    await asyncio.gather(first, second)


async def test_a_ray_handle_is_called_through_remote() -> None:
    handle = _Handle()
    assert await RunnerClient(handle).cancel(["d/t/0"]) == 3
    assert handle.sent == [(["d/t/0"],)]
