"""StorageActor in-process: the layout of docs/results_format.md, write order, superseded
attempts, the repair of a results.jsonl cut by a crash, and backpressure."""

from __future__ import annotations

import asyncio
import json
import tracemalloc
from pathlib import Path

from cua_rollout.config import StorageConfig
from cua_rollout.runtime.storage import StorageActor

PNG = b"\x89PNG\r\n\x1a\n" + b"\0" * 64


def _record(episode_id: str, attempt: int = 0, reward: float | None = 1.0) -> dict:
    domain, task_id, rollout = episode_id.split("/")
    return {"episode_id": episode_id, "task_id": task_id, "domain": domain,
            "rollout": int(rollout), "attempt": attempt,
            "status": "success" if reward else "infra_error", "reward": reward, "steps": 2}


async def test_an_episode_lands_in_the_documented_layout(tmp_path: Path):
    storage = StorageActor(tmp_path / "run")
    await storage.start_run({"run": "t", "config": {"a": 1}})
    episode = "web/task-1/0"
    await storage.begin_episode(episode, 0, {"id": "task-1", "instruction": "do it"})
    await storage.write_step(episode, 0, None, "step_0.png", PNG)
    await storage.write_step(episode, 0, {"step_num": 1}, "step_1.png", PNG)
    await storage.write_step(episode, 0, {"step_num": 2, "done": True})
    await storage.finish_episode(episode, 0, _record(episode), [{"role": "user"}])
    await storage.record_result(_record(episode))
    await storage.write_metrics({"t": 1.0, "steps": 2})
    await storage.end_run("finished", {"episodes": 1})
    await storage.close()

    run = tmp_path / "run"
    directory = run / episode
    assert sorted(p.name for p in directory.iterdir()) == [
        "episode.json", "messages.json", "result.txt", "step_0.png", "step_1.png",
        "task_config.json", "traj.jsonl"]
    lines = [json.loads(x) for x in (directory / "traj.jsonl").read_text().splitlines()]
    assert [x["step_num"] for x in lines] == [1, 2]
    assert (directory / "result.txt").read_text().strip() == "1.0"
    assert json.loads((directory / "task_config.json").read_text())["id"] == "task-1"
    assert (directory / "step_1.png").read_bytes() == PNG
    results = [json.loads(x) for x in (run / "results.jsonl").read_text().splitlines()]
    assert [r["episode_id"] for r in results] == [episode]
    assert json.loads((run / "metrics.jsonl").read_text())["steps"] == 2
    info = json.loads((run / "run.json").read_text())
    assert info["status"] == "finished" and info["config"] == {"a": 1}
    assert info["ended_at"] >= info["started_at"] and info["summary"] == {"episodes": 1}
    assert not list(run.rglob("*.tmp")), "temporary files left behind"


async def test_writes_of_a_superseded_attempt_are_dropped(tmp_path: Path):
    storage = StorageActor(tmp_path)
    await storage.start_run({})
    episode = "d/t/1"
    await storage.begin_episode(episode, 0, {"id": "t"})
    await storage.write_step(episode, 0, {"step_num": 1, "attempt": 0}, "step_1.png", PNG)
    # The runner died; the coordinator restarted the episode elsewhere, while a late write
    # of the dead attempt is still queued behind the restart.
    await storage.begin_episode(episode, 1, {"id": "t"})
    await storage.write_step(episode, 0, {"step_num": 2, "attempt": 0}, "step_2.png", PNG)
    await storage.write_step(episode, 1, {"step_num": 1, "attempt": 1})
    assert await storage.finish_episode(episode, 0, _record(episode, 0), None) is None
    await storage.flush()
    directory = tmp_path / episode
    assert not directory.exists(), "attempt 1 still runs: nothing is in place yet"
    assert await storage.finish_episode(episode, 1, _record(episode, 1), None) is None
    assert sorted(p.name for p in directory.iterdir()) == [
        "episode.json", "result.txt", "task_config.json", "traj.jsonl"]
    lines = [json.loads(x) for x in (directory / "traj.jsonl").read_text().splitlines()]
    assert lines == [{"step_num": 1, "attempt": 1}]
    assert json.loads((directory / "episode.json").read_text())["attempt"] == 1
    assert storage.stats()["dropped_stale"] == 2
    await storage.close()


async def test_a_results_line_cut_by_a_crash_is_removed_at_start(tmp_path: Path):
    whole = json.dumps(_record("d/t/0")) + "\n"
    (tmp_path / "results.jsonl").write_text(whole + '{"episode_id": "d/t/1", "sta')
    storage = StorageActor(tmp_path)
    repaired = await storage.start_run({})
    assert repaired["results_tail_cut_bytes"] == len('{"episode_id": "d/t/1", "sta')
    await storage.record_result(_record("d/t/1"))
    await storage.close()
    lines = (tmp_path / "results.jsonl").read_text().splitlines()
    assert [json.loads(x)["episode_id"] for x in lines] == ["d/t/0", "d/t/1"]


async def test_a_restart_streams_a_long_runs_results(tmp_path: Path):
    """A long run's results.jsonl (~12 MB, 40,000 episodes): the start's repair and
    compaction read it a line at a time (the memory traced stays far below the file's size),
    keep the last line of each episode byte for byte and in order (a U+2028 inside a string
    is not a line break), move infra errors (rerun) and superseded cancelled lines to the
    archive, and remove the line a crash cut."""
    run = tmp_path / "run"
    run.mkdir()
    path, archive = run / "results.jsonl", run / "results.superseded.jsonl"
    episodes = 40_000
    kept: list[bytes] = []
    moved: list[bytes] = []
    reruns: list[bytes] = []

    def line(i: int, status: str) -> bytes:
        record = {**_record(f"d/t{i // 8}/{i % 8}", reward=1.0), "status": status,
                  "instruction": "écrire " * 40 + ("\u2028" if i == 5 else "")}
        return (json.dumps(record, ensure_ascii=False) + "\n").encode()

    with path.open("wb") as f:
        for i in range(episodes):
            status = ("infra_error" if i % 97 == 0 else "cancelled" if i % 89 == 0
                      else "success")
            written = line(i, status)
            f.write(written)
            (moved if status != "success" else kept).append(written)
            if status == "cancelled":
                reruns.append(line(i, "success"))
        f.writelines(reruns)
        f.write(b'{"episode_id": "d/cut/0", "status": "succ')
    size = path.stat().st_size
    assert size > 10_000_000

    storage = StorageActor(run, StorageConfig(index=False))
    tracemalloc.start()
    try:
        repaired = await storage.start_run({"run": "long"})
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
        await storage.close()
    assert peak < size / 20, f"the start held {peak} bytes for a {size}-byte file"
    infra = len(range(0, episodes, 97))
    assert repaired["results_compacted"] == {
        "kept": episodes - infra, "superseded": len(reruns), "dropped": infra, "broken": 0,
        "rewritten": 1}
    assert path.read_bytes() == b"".join(kept + reruns)
    assert archive.read_bytes() == b"".join(moved)
    assert not list(run.glob(".results.jsonl.*"))  # no temporary file left


async def test_callers_wait_when_the_queue_is_full(tmp_path: Path, monkeypatch):
    storage = StorageActor(tmp_path, StorageConfig(queue_max_items=4))  # 1 per writer
    await storage.start_run({})
    gate = asyncio.Event()
    real_handle = storage._handle

    async def slow_handle(job):
        await gate.wait()
        await real_handle(job)

    monkeypatch.setattr(storage, "_handle", slow_handle)
    episode = "d/t/0"
    await storage.begin_episode(episode, 0, {"id": "t"})  # taken by the writer, held
    await storage.write_step(episode, 0, {"step_num": 1})  # fills the queue
    blocked = asyncio.create_task(storage.write_step(episode, 0, {"step_num": 2}))
    await asyncio.sleep(0.2)
    assert not blocked.done(), "a full queue must make the caller wait"
    gate.set()
    await asyncio.wait_for(blocked, 5)
    await storage.finish_episode(episode, 0, _record(episode), None)
    await storage.close()
    lines = (tmp_path / episode / "traj.jsonl").read_text().splitlines()
    assert [json.loads(x)["step_num"] for x in lines] == [1, 2]


async def test_an_episode_id_cannot_leave_the_run_directory(tmp_path: Path):
    storage = StorageActor(tmp_path / "run")
    await storage.start_run({})
    await storage.begin_episode("../../etc/x", 0, {"id": "x"})
    await storage.flush()
    assert storage.stats()["errors"] == 1
    assert not (tmp_path / "etc").exists()
    await storage.close()


# --------------------------------------------------------------------------- the trainer's index


def _group_record(episode_id: str, reward: float, size: int = 2) -> dict:
    return {**_record(episode_id, reward=reward), "status": "success" if reward else "failure",
            "pass_index": 0, "group_size": size, "model_version": "v1",
            "group_id": "d/t/pass-0"}


async def test_results_reach_the_index_and_a_group_once_it_is_complete(tmp_path: Path):
    from cua_rollout.training import TrainingIndex, default_url

    storage = StorageActor(tmp_path / "run")
    await storage.start_run({"run": "t"})
    await storage.record_result(_group_record("d/t/0", 1.0))
    await storage.flush()
    await storage.record_result(_group_record("d/t/1", 0.0))
    await storage.end_run("finished")  # waits for the index
    assert storage.stats()["indexed"] == 2 and storage.stats()["groups"] == 1
    await storage.close()
    with TrainingIndex(default_url(tmp_path / "run")) as index:
        (group,) = index.groups()
        assert group.group["rewards"] == [1.0, 0.0] and group.state == "ready"


async def test_a_failing_index_is_retried_and_loses_nothing(tmp_path: Path, monkeypatch):
    import cua_rollout.runtime.index_feed as index_feed

    monkeypatch.setattr(index_feed, "backoff_s", lambda *a, **k: 0.01)
    storage = StorageActor(tmp_path / "run")
    await storage.start_run({"run": "t"})
    assert storage.index_feed.index is not None
    real, failures = storage.index_feed.index.record_episodes, [2]

    def flaky(*args, **kw):
        if failures[0]:
            failures[0] -= 1
            raise OSError("database is gone")
        return real(*args, **kw)

    storage.index_feed.index.record_episodes = flaky  # type: ignore[method-assign]
    await storage.record_result(_group_record("d/t/0", 1.0))
    await storage.record_result(_group_record("d/t/1", 1.0))
    await storage.end_run("finished")
    stats = storage.stats()
    assert (stats["indexed"], stats["groups"], stats["index_errors"]) == (2, 1, 2)
    assert stats["index_pending"] == 0
    await storage.close()


async def test_an_index_that_cannot_be_opened_stops_the_start_by_name(tmp_path: Path):
    import socket

    import pytest

    from cua_rollout.core.errors import StorageError

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cfg = StorageConfig(database_url=f"postgresql+psycopg://nobody@127.0.0.1:{port}/x")
    storage = StorageActor(tmp_path / "run", cfg)
    with pytest.raises(StorageError, match=r"storage\.database_url.*127\.0\.0\.1"):
        await storage.start_run({"run": "t"})
    await storage.close()


async def test_a_new_start_brings_the_index_up_to_date(tmp_path: Path):
    """A result line written while the index was unreachable (or a deleted index.db) is
    indexed when the run starts again."""
    from cua_rollout.core.layout import INDEX_FILE

    run = tmp_path / "run"
    storage = StorageActor(run, StorageConfig(index=False))
    await storage.start_run({"run": "t"})
    for i in range(2):
        await storage.record_result(_group_record(f"d/t/{i}", 1.0))
    await storage.end_run("finished")
    await storage.close()
    assert not (run / INDEX_FILE).exists()
    storage = StorageActor(run)
    repaired = await storage.start_run({"run": "t"})
    assert repaired["index"]["groups"] == 1, repaired
    await storage.close()


async def test_a_restart_reads_only_the_lines_the_index_has_not_had(tmp_path: Path):
    """Issue 34: a restart's cost must not grow with the run. The index stores, with each
    transaction, where in results.jsonl it is; a start reads what came after (nothing, when
    the last start's lines all reached it), and a compaction that rewrites the file moves
    that place to the new file's end instead of costing a whole read next time."""
    run = tmp_path / "run"
    storage = StorageActor(run)
    assert (await storage.start_run({"run": "t"}))["index"] is None  # a new run: no file
    for i in range(6):
        await storage.record_result(_group_record(f"d/t/{i}", float(i % 2), size=2))
    await storage.end_run("finished")
    await storage.close()
    size = (run / "results.jsonl").stat().st_size

    storage = StorageActor(run)
    synced = (await storage.start_run({"run": "t"}))["index"]
    assert (synced["from_byte"], synced["lines"], synced["groups"]) == (size, 0, 1)
    # An infra error (rerun at the next start: the compaction drops its line, rewriting the
    # file) and a line the index misses (written with the index off).
    await storage.record_result({**_group_record("d/u/0", 0.0), "status": "infra_error",
                                 "reward": None, "group_id": "d/u/pass-0"})
    await storage.end_run("stopped")
    await storage.close()
    with open(run / "results.jsonl", "a") as f:  # as a crash before its index write leaves it
        f.write(json.dumps({**_group_record("d/v/0", 1.0, size=1),
                            "group_id": "d/v/pass-0"}) + "\n")

    storage = StorageActor(run)
    repaired = await storage.start_run({"run": "t"})
    synced = repaired["index"]
    assert synced["from_byte"] == size + len(_line_of(run, "d/u/0"))  # after the infra line
    assert (synced["lines"], synced["inserted"]) == (1, 1)            # d/v/0 only
    assert repaired["results_compacted"]["dropped"] == 1
    await storage.end_run("stopped")
    await storage.close()
    storage = StorageActor(run)
    synced = (await storage.start_run({"run": "t"}))["index"]
    assert synced["lines"] == 0 and synced["from_byte"] == (run / "results.jsonl").stat().st_size
    # A file that is not the one the cursor was stored for is read whole.
    (run / "results.jsonl").write_bytes(b"\n" + (run / "results.jsonl").read_bytes())
    await storage.end_run("stopped")
    await storage.close()
    storage = StorageActor(run)
    synced = (await storage.start_run({"run": "t"}))["index"]
    assert synced["from_byte"] == 0 and synced["lines"] == 7 and synced["unchanged"] == 7
    await storage.close()


def _line_of(run: Path, episode_id: str) -> bytes:
    for name in ("results.jsonl", "results.superseded.jsonl"):
        path = run / name
        if path.exists():
            for line in path.read_bytes().splitlines(keepends=True):
                if json.loads(line)["episode_id"] == episode_id:
                    return line
    raise AssertionError(episode_id)
