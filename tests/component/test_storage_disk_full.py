"""The storage never lies (review H2, L1, L4): on a real filesystem that fills up, failed
writes are reported to the runner and the coordinator, a cut append is truncated back, and
after space is freed the run goes on with a clean index; the index line and the episode's
directory always describe one attempt; results.jsonl keeps one line per episode."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from cua_rollout.config import StorageConfig
from cua_rollout.core.errors import StorageError
from cua_rollout.core.files import append_text, repair_jsonl_tail
from cua_rollout.core.layout import ATTEMPTS_DIR
from cua_rollout.runtime.storage import StorageActor, compact_results
from tests.doubles.disk import fill
from tests.support import small_filesystem

TASK = {"id": "t", "instruction": "x"}


def record(episode_id: str, attempt: int = 0, status: str = "success", **extra) -> dict:
    return {"episode_id": episode_id, "task_id": episode_id.split("/")[1], "domain": "d",
            "rollout": 0, "attempt": attempt, "status": status,
            "reward": 1.0 if status == "success" else None, **extra}


def lines(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()]


async def test_a_full_disk_is_reported_and_the_index_stays_clean(tmp: Path):
    with small_filesystem(tmp / "fs", 512 * 1024) as fs:
        storage = StorageActor(fs / "run", StorageConfig())
        await storage.start_run({"run": "full"})
        await storage.begin_episode("d/t0/0", 0, TASK)
        assert await storage.finish_episode("d/t0/0", 0, record("d/t0/0")) is None
        await storage.record_result(record("d/t0/0"))
        index = fs / "run" / "results.jsonl"
        size = index.stat().st_size

        await storage.begin_episode("d/t1/0", 0, TASK)
        filler = fill(fs)
        await storage.write_step("d/t1/0", 0, {"step_num": 1}, "step_1.png", b"\x89PNG" * 8192)
        failed = await storage.finish_episode("d/t1/0", 0, record("d/t1/0"))
        assert failed is not None and "No space left on device" in failed
        # A line longer than a page cannot fit: the append fails, and is cut back entirely.
        big = record("d/t1/0", instruction="y" * 20_000)
        with pytest.raises(StorageError, match=r"results\.jsonl: .*No space left on device"):
            await storage.record_result(big)
        assert index.stat().st_size == size
        assert storage.stats()["errors"] >= 2 and "No space" in storage.stats()["last_error"]

        filler.unlink()  # space is freed: the next line lands on a clean index
        await storage.record_result(record("d/t2/0"))
        assert [r["episode_id"] for r in lines(index)] == ["d/t0/0", "d/t2/0"]
        await storage.close()
        assert repair_jsonl_tail(index) == 0


async def test_a_result_whose_files_failed_is_recorded_as_an_infra_error(tmp: Path):
    storage = StorageActor(tmp / "run", StorageConfig())
    await storage.start_run({"run": "x"})
    await storage.begin_episode("d/t0/0", 0, TASK)
    await storage.flush()
    (staging,) = [d for d in (tmp / "run" / ATTEMPTS_DIR).iterdir() if d.is_dir()]
    (staging / "step_0.png").mkdir()  # the screenshot cannot land
    await storage.write_step("d/t0/0", 0, None, "step_0.png", b"png")
    failed = await storage.finish_episode("d/t0/0", 0, record("d/t0/0"))
    assert failed is not None and failed.startswith("step: ")
    await storage.record_result(record("d/t0/0"))  # a caller that ignored it
    await storage.close()
    (line,) = lines(tmp / "run" / "results.jsonl")
    assert (line["status"], line["reward"]) == ("infra_error", None)
    assert line["error"].startswith("storage: step: ")


async def test_the_index_line_and_the_directory_describe_the_same_attempt(tmp: Path):
    """Review L4: attempt 0 wrote its files; attempt 1 never got a desktop. The directory
    must not keep attempt 0's trajectory under attempt 1's line."""
    storage = StorageActor(tmp / "run", StorageConfig())
    await storage.start_run({"run": "x"})
    await storage.begin_episode("d/t0/0", 0, TASK)
    await storage.write_step("d/t0/0", 0, {"step_num": 1}, "step_1.png", b"png")
    await storage.finish_episode("d/t0/0", 0, record("d/t0/0", 0, "infra_error"))
    final = record("d/t0/0", 1, "infra_error", error="no desktop")
    await storage.record_result(final)
    await storage.close()
    directory = tmp / "run" / "d" / "t0" / "0"
    assert sorted(p.name for p in directory.iterdir()) == ["episode.json", "task_config.json"]
    assert json.loads((directory / "episode.json").read_text())["attempt"] == 1


def test_results_keep_one_line_per_episode_and_archive_the_rest(tmp_path: Path):
    index, archive = tmp_path / "results.jsonl", tmp_path / "results.superseded.jsonl"
    rows = [record("d/a/0", 0, "infra_error"), record("d/b/0"), record("d/a/0", 0, "success"),
            record("d/c/0", 2, "infra_error")]
    index.write_text("".join(json.dumps(r) + "\n" for r in rows[:2]) + '{"glued": 1}{"x"\n'
                     + "".join(json.dumps(r) + "\n" for r in rows[2:]))
    ends = [i + 1 for i, byte in enumerate(index.read_bytes()) if byte == ord("\n")]
    carry = [0, *ends]  # a reader's cursors: the start and each line's end
    counts = compact_results(index, archive, ("infra_error",), carry=carry)
    assert counts == {"kept": 2, "superseded": 1, "dropped": 1, "broken": 1, "rewritten": 1}
    assert [(r["episode_id"], r["status"]) for r in lines(index)] == [
        ("d/b/0", "success"), ("d/a/0", "success")]
    # Each cursor is now after the same kept lines in the new file.
    b_end = len(json.dumps(rows[1])) + 1
    assert carry == [0, 0, b_end, b_end, index.stat().st_size, index.stat().st_size]
    assert len(archive.read_text().splitlines()) == 3  # nothing is lost
    assert compact_results(index, archive, ("infra_error",))["kept"] == 2
    assert len(archive.read_text().splitlines()) == 3  # nothing changed: not rewritten
    index.write_text(json.dumps(rows[3]) + "\n")
    assert compact_results(index, archive, ())["kept"] == 1  # infra_error kept as final


async def test_a_restart_compacts_results_and_reruns_infra_errors(tmp: Path):
    run = tmp / "run"
    run.mkdir()
    (run / "results.jsonl").write_text(json.dumps(record("d/a/0", 2, "infra_error")) + "\n"
                                       + json.dumps(record("d/b/0")) + "\n")
    storage = StorageActor(run, StorageConfig())
    out = await storage.start_run({"run": "x"})
    await storage.close()
    assert out["results_compacted"]["dropped"] == 1
    assert [r["episode_id"] for r in lines(run / "results.jsonl")] == ["d/b/0"]


def test_a_cut_line_is_found_from_the_end_of_a_large_file(tmp_path: Path):
    index = tmp_path / "results.jsonl"
    append_text(index, "".join(json.dumps(record(f"d/t{i}/0")) + "\n" for i in range(3000)))
    with open(index, "ab") as f:
        f.write(b'{"episode_id": "d/cut' + b"x" * 100_000)  # longer than a read chunk
    assert repair_jsonl_tail(index) == len(b"{\"episode_id\": \"d/cut") + 100_000
    assert len(lines(index)) == 3000


async def test_a_compaction_carries_the_retention_sweepers_cursors_over(tmp: Path):
    """A start whose compaction rewrites results.jsonl (a new file) moves the retention
    sweeper's cursors to the same lines of the new file: no sizing every episode again."""
    from cua_rollout.core.layout import RETENTION_STATE_FILE
    from cua_rollout.runtime.retention import saved_cursors

    run = tmp / "run"
    run.mkdir()
    results = run / "results.jsonl"
    results.write_text(json.dumps(record("d/a/0", 2, "infra_error")) + "\n"
                       + json.dumps(record("d/b/0")) + "\n")
    st = results.stat()
    (run / RETENTION_STATE_FILE).write_text(json.dumps({
        "format": 1, "results": [st.st_dev, st.st_ino], "sized_offset": st.st_size,
        "released_offset": st.st_size, "episode_bytes": 5, "totals": {}}))
    assert saved_cursors(run) == [st.st_size, st.st_size]
    storage = StorageActor(run, StorageConfig())
    out = await storage.start_run({"run": "x"})
    await storage.close()
    assert out["results_compacted"]["rewritten"] == 1
    assert saved_cursors(run) == [results.stat().st_size] * 2  # of the new file
    assert json.loads((run / RETENTION_STATE_FILE).read_text())["episode_bytes"] == 5
