"""The coordinator's batching of results lines (cua_rollout/runtime/recorder.py)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from cua_rollout.core.errors import StorageError
from cua_rollout.runtime.actors import StorageClient
from cua_rollout.runtime.recorder import BATCH_MAX, ResultRecorder


class _Storage:
    """A storage whose ``record_results`` waits for ``gate`` and answers ``answers``."""

    def __init__(self) -> None:
        self.calls: list[list[Any]] = []
        self.gate = asyncio.Event()
        self.fail: Exception | None = None
        self.refuse: set[str] = set()

    async def record_results(self, items: list[Any]) -> list[str | None]:
        self.calls.append(items)
        await self.gate.wait()
        if self.fail is not None:
            raise self.fail
        return [f"refused {r['episode_id']}" if r["episode_id"] in self.refuse else None
                for r, _, _ in items]


def _record(n: int) -> dict[str, Any]:
    return {"episode_id": f"d/t/{n}", "attempt": 0}


async def test_a_lone_result_goes_at_once_and_the_next_ones_wait_together():
    storage = _Storage()
    recorder = ResultRecorder(StorageClient(storage), timeout_s=5.0)
    first = asyncio.ensure_future(recorder.record(_record(0), "s0", ["old"]))
    for _ in range(5):  # the recorder's task, then the call's
        await asyncio.sleep(0)
    assert [len(c) for c in storage.calls] == [1], "not held back for company"
    rest = [asyncio.ensure_future(recorder.record(_record(n), f"s{n}"))
            for n in range(1, BATCH_MAX + 6)]
    await asyncio.sleep(0)
    lag = recorder.lag()  # the storage's lag, as /status shows it: all of them wait
    assert lag["results_waiting"] == BATCH_MAX + 6 and lag["oldest_s"] >= 0
    storage.gate.set()
    await asyncio.gather(first, *rest)
    assert recorder.lag() == {"results_waiting": 0, "oldest_s": 0.0}
    assert [len(c) for c in storage.calls] == [1, BATCH_MAX, 5]
    assert storage.calls[0] == [(_record(0), "s0", ["old"])]
    assert storage.calls[1][0] == (_record(1), "s1", [])
    assert (recorder.calls, recorder.records) == (3, BATCH_MAX + 6)


async def test_each_caller_hears_its_own_refusal_and_a_failed_call_fails_its_batch():
    storage = _Storage()
    storage.gate.set()
    storage.refuse = {"d/t/1"}
    recorder = ResultRecorder(StorageClient(storage), timeout_s=5.0)
    outcomes = await asyncio.gather(*(recorder.record(_record(n)) for n in range(3)),
                                    return_exceptions=True)
    assert outcomes[0] is None and outcomes[2] is None
    assert isinstance(outcomes[1], StorageError) and "refused d/t/1" in str(outcomes[1])

    storage.fail = OSError(28, "No space left on device")
    with pytest.raises(OSError, match="No space left"):
        await recorder.record(_record(4))
    storage.fail = None
    await recorder.record(_record(5))  # the recorder goes on after a failed call


async def test_a_storage_that_does_not_answer_times_out():
    storage = _Storage()  # its gate never opens
    recorder = ResultRecorder(StorageClient(storage), timeout_s=0.05)
    with pytest.raises(TimeoutError):
        await recorder.record(_record(0))
