"""The retention sweeper (cua_rollout/runtime/retention.py) on real run directories and a real
SQLite index: after_ack removes acked groups' images only, with a marker; the claim API
never hands out a group whose images are gone; a budget removes the oldest acked images
first and warns when nothing more may go; without an index the policy follows the results
lines by a cursor; a cut sweep is finished by the next; an index of schema 1 is upgraded;
a full disk fails a sweep cleanly; a storage actor next to a trainer stays in budget."""

from __future__ import annotations

import asyncio
import io
import json
import os
import random
import re
import sqlite3
import threading
from pathlib import Path

import pytest
from PIL import Image

from cua_rollout.config import RetentionConfig, StorageConfig
from cua_rollout.core.layout import RESULTS_FILE, RETENTION_STATE_FILE, TRAJ_FILE
from cua_rollout.core.retention import read_marker
from cua_rollout.runtime.retention import RetentionSweeper
from cua_rollout.runtime.storage import StorageActor
from cua_rollout.training import TrainingIndex, default_url
from tests.doubles.disk import fill
from tests.support import small_filesystem

RUN = "ret"
STEPS = 3
BIG = 256  # a screenshot's side in the storage test: ~200 KB of noise


class Clock:
    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        self.now += 1.0
        return self.now


def png(seed: int, side: int = 96, *, smooth: bool = False) -> bytes:
    """A noisy PNG (incompressible: its size is its pixels'), or a smooth one at a low zlib
    level (what a re-encode at level 9 shrinks)."""
    rng = random.Random(seed)
    if smooth:
        image = Image.new("RGB", (side, side))
        image.putdata([((x + seed) % 256, (x // side) % 256, 128) for x in range(side * side)])
    else:
        image = Image.frombytes("RGB", (side, side), rng.randbytes(side * side * 3))
    out = io.BytesIO()
    image.save(out, "PNG", compress_level=1)
    return out.getvalue()


def record(task: str, rollout: int, status: str = "success", size: int = 2) -> dict:
    return {"episode_id": f"d/{task}/{rollout}", "task_id": task, "domain": "d",
            "rollout": rollout, "attempt": 0, "status": status,
            "reward": 1.0 if status == "success" else 0.0, "steps": STEPS,
            "pass_index": 0, "group_id": f"d/{task}/pass-0", "group_size": size,
            "started_at": 1000.0 + rollout, "ended_at": 2000.0}


def pixels(path: Path) -> bytes:
    with Image.open(path) as image:
        return image.tobytes()


def write_episode(run_dir: Path, rec: dict, seed: int = 0, smooth: bool = False) -> Path:
    """An episode's files as the storage leaves them, and its results line."""
    path = run_dir / rec["episode_id"]
    path.mkdir(parents=True, exist_ok=True)
    lines = []
    for n in range(STEPS):
        (path / f"step_{n}.png").write_bytes(png(seed * 10 + n, smooth=smooth))
        lines.append(json.dumps({"step_num": n + 1, "screenshot_file": f"step_{n + 1}.png"}))
    (path / f"step_{STEPS}.png").write_bytes(png(seed * 10 + STEPS, smooth=smooth))
    (path / TRAJ_FILE).write_text("\n".join(lines) + "\n")
    (path / "episode.json").write_text(json.dumps(rec))
    with open(run_dir / RESULTS_FILE, "a") as f:
        f.write(json.dumps(rec) + "\n")
    return path


def pngs(path: Path) -> list[str]:
    return sorted(p.name for p in path.glob("*.png"))


def run_with_groups(run_dir: Path, tasks: list[str], statuses=("success", "failure"),
                    smooth: bool = False) -> tuple[TrainingIndex, list[dict]]:
    records = []
    for i, task in enumerate(tasks):
        for rollout, status in enumerate(statuses):
            rec = record(task, rollout, status, size=len(statuses))
            write_episode(run_dir, rec, seed=i * 10 + rollout, smooth=smooth)
            records.append(rec)
    index = TrainingIndex(default_url(run_dir), clock=Clock())
    index.record_episodes(RUN, run_dir, records)
    return index, records


def claim_and_ack(index: TrainingIndex, n: int) -> list[str]:
    claims = index.claim_groups(n, "trainer", lease_s=60)
    assert index.ack(claims) == []
    return [c.group_id for c in claims]


def sweeper(run_dir: Path, index: TrainingIndex | None, **cfg) -> RetentionSweeper:
    return RetentionSweeper(run_dir, RetentionConfig(**cfg),
                            index=(lambda: index) if index is not None else None,
                            run_name=lambda: RUN)


def test_after_ack_removes_acked_groups_images_with_a_marker_and_nothing_else(tmp):
    index, _ = run_with_groups(tmp, ["a", "b", "c"])
    acked = claim_and_ack(index, 1)
    assert acked == ["d/a/pass-0"]
    stats = sweeper(tmp, index, images="after_ack").sweep()
    assert stats["episodes_removed"] == 2 and stats["sweep_errors"] == 0
    for rollout in (0, 1):
        path = tmp / "d" / "a" / str(rollout)
        assert pngs(path) == []
        marker = read_marker(path)
        assert marker is not None and marker.policy == "after_ack"
        assert marker.removed == [f"step_{n}.png" for n in range(STEPS + 1)]
        assert marker.bytes_freed > 0 and (path / TRAJ_FILE).is_file()
    for task in ("b", "c"):  # not acked: untouched
        assert len(pngs(tmp / "d" / task / "0")) == STEPS + 1
        assert read_marker(tmp / "d" / task / "0") is None
    status = index.status(RUN)
    assert status["images_removed"] == 1
    # The next sweep has nothing new: the swept group is not read again.
    again = sweeper(tmp, index, images="after_ack")
    assert again.sweep()["episodes_released"] == 0
    # A claim hands out the others, loading their steps, never the removed one.
    claims = index.claim_groups(5, "trainer", lease_s=60, load_steps=True)
    assert sorted(c.group_id for c in claims) == ["d/b/pass-0", "d/c/pass-0"]
    index.close()


def test_a_group_marked_removed_is_never_claimed(tmp):
    index, _ = run_with_groups(tmp, ["a", "b"])
    # A manual cleanup (or failures/sample without acks) marks a ready group first.
    assert index.mark_images_removed(RUN, ["d/a/pass-0"], "manual") == 1
    assert index.mark_images_removed(RUN, ["d/a/pass-0"], "manual") == 0
    assert [c.group_id for c in index.claim_groups(5, "t", lease_s=60)] == ["d/b/pass-0"]
    assert index.claim_groups(5, "t2", lease_s=60) == []
    index.close()


def test_failures_policy_keeps_failed_episodes_and_reencodes_them_losslessly(tmp):
    index, _ = run_with_groups(tmp, ["a"], smooth=True)
    claim_and_ack(index, 1)
    sizes = {p.name: p.stat().st_size for p in (tmp / "d/a/1").glob("*.png")}
    before = {p.name: pixels(p) for p in (tmp / "d/a/1").glob("*.png")}
    stats = sweeper(tmp, index, images="failures", reencode="png_max").sweep()
    assert pngs(tmp / "d/a/0") == []  # the success
    kept = tmp / "d/a/1"
    assert {p.name: pixels(p) for p in kept.glob("*.png")} == before
    assert sum(p.stat().st_size for p in kept.glob("*.png")) < sum(sizes.values())
    marker = read_marker(kept)
    assert marker is not None and not marker.images_gone
    assert marker.bytes_freed == sum(sizes.values()) - sum(
        p.stat().st_size for p in kept.glob("*.png"))
    assert stats["images_reencoded"] == STEPS + 1 and stats["images_removed"] == STEPS + 1
    index.close()


def test_without_an_index_a_cursor_releases_each_line_once(tmp):
    for i, status in enumerate(("success", "failure", "success")):
        write_episode(tmp, record(f"t{i}", 0, status, size=1), seed=i)
    handled: list[str] = []

    def spied(sweep: RetentionSweeper) -> RetentionSweeper:
        real = sweep._handle

        def spy(rec, plan):
            handled.append(rec["episode_id"])
            return real(rec, plan)

        sweep._handle = spy  # type: ignore[method-assign]
        return sweep

    sweep = spied(sweeper(tmp, None, images="failures"))
    sweep.sweep()
    assert handled == ["d/t0/0", "d/t1/0", "d/t2/0"]
    assert pngs(tmp / "d/t0/0") == [] and pngs(tmp / "d/t2/0") == []
    assert len(pngs(tmp / "d/t1/0")) == STEPS + 1
    write_episode(tmp, record("t3", 0, "success", size=1), seed=3)
    handled.clear()
    sweep.sweep()
    assert handled == ["d/t3/0"]  # only the new line
    # A new sweeper (a restart) goes on from the saved cursor.
    write_episode(tmp, record("t4", 0, "success", size=1), seed=4)
    state = json.loads((tmp / RETENTION_STATE_FILE).read_text())
    handled.clear()
    spied(sweeper(tmp, None, images="failures")).sweep()
    assert handled == ["d/t4/0"] and state["released_offset"] > 0


def test_a_budget_removes_the_oldest_acked_first_and_warns_when_nothing_may_go(tmp):
    index, _ = run_with_groups(tmp, ["a", "b", "c"])
    first = sweeper(tmp, index, images="after_ack")
    first._release = lambda total: total  # type: ignore[method-assign] (sizing only)
    size = first.sweep()["run_dir_bytes"]
    group_bytes = sum(p.stat().st_size for p in (tmp / "d/a").rglob("*.png"))
    claim_and_ack(index, 1)  # a, then b, acked in this order
    claim_and_ack(index, 1)
    # Over by less than one group: only the oldest acked group goes.
    budget_gb = (size - group_bytes // 2) / 1e9
    stats = sweeper(tmp, index, images="after_ack", max_gb=budget_gb).sweep()
    assert pngs(tmp / "d/a/0") == [] and len(pngs(tmp / "d/b/0")) == STEPS + 1
    assert not stats["over_budget"] and stats["run_dir_bytes"] <= budget_gb * 1e9
    # A budget below the un-acked group's bytes: b goes, c stays, and a warning says so.
    tight = sweeper(tmp, index, images="after_ack", max_gb=group_bytes / 2 / 1e9)
    stats = tight.sweep()
    assert pngs(tmp / "d/b/0") == [] and len(pngs(tmp / "d/c/0")) == STEPS + 1
    assert stats["over_budget"] and "nothing more may be removed" in stats["warning"]
    assert json.loads((tmp / RETENTION_STATE_FILE).read_text())["warning"] == stats["warning"]
    index.close()


def test_a_sweep_cut_after_its_marker_is_finished_by_the_next(tmp, monkeypatch):
    index, _ = run_with_groups(tmp, ["a"])
    claim_and_ack(index, 1)
    real_unlink = Path.unlink
    calls = [0]

    def dies(self, missing_ok=False):
        calls[0] += 1
        if calls[0] == 2:
            raise KeyboardInterrupt("killed")  # not an OSError: the sweep stops here
        return real_unlink(self, missing_ok=missing_ok)

    monkeypatch.setattr(Path, "unlink", dies)
    with pytest.raises(KeyboardInterrupt):
        sweeper(tmp, index, images="after_ack").sweep()
    monkeypatch.setattr(Path, "unlink", real_unlink)
    path = tmp / "d/a/0"
    assert read_marker(path) is not None and 0 < len(pngs(path)) < STEPS + 1
    # The group was marked before anything went: no claim can hand it out meanwhile.
    assert index.status(RUN)["images_removed"] == 1
    sweeper(tmp, index, images="after_ack").sweep()
    assert pngs(path) == [] and pngs(tmp / "d/a/1") == []
    index.close()


def test_an_index_of_schema_1_is_upgraded_in_place(tmp):
    index, _ = run_with_groups(tmp, ["a", "b"])
    index.close()
    db = sqlite3.connect(tmp / "index.db")
    db.execute("DROP INDEX ix_groups_retention")
    for column in ("images_removed_at", "images_removed_by", "retention_swept_at"):
        db.execute(f"ALTER TABLE groups DROP COLUMN {column}")
    db.execute("UPDATE meta SET value = '1' WHERE key = 'schema_version'")
    db.commit()
    db.close()
    with TrainingIndex(default_url(tmp)) as upgraded:
        assert upgraded.status(RUN)["groups"]["ready"] == 2
        assert upgraded.mark_images_removed(RUN, ["d/a/pass-0"], "manual") == 1
        assert [c.group_id for c in upgraded.claim_groups(5, "t")] == ["d/b/pass-0"]
    db = sqlite3.connect(tmp / "index.db")
    assert db.execute("SELECT value FROM meta").fetchone() == ("2",)
    db.close()


def test_a_reindex_finds_the_markers_of_removed_images(tmp):
    index, _ = run_with_groups(tmp, ["a", "b"])
    claim_and_ack(index, 1)
    sweeper(tmp, index, images="after_ack").sweep()
    index.close()
    os.remove(tmp / "index.db")  # a lost database, rebuilt from the files
    with TrainingIndex(default_url(tmp)) as rebuilt:
        rebuilt.reindex(tmp, RUN)
        assert [c.group_id for c in rebuilt.claim_groups(5, "t")] == ["d/b/pass-0"]


def test_a_full_disk_fails_the_sweep_cleanly_and_the_next_one_finishes(tmp):
    with small_filesystem(tmp / "fs", 1024 * 1024) as fs:
        run_dir = fs / "run"
        run_dir.mkdir()
        index, _ = run_with_groups(run_dir, ["a", "b"])
        try:
            _full_disk_sweep(fs, run_dir, index)
        finally:
            index.close()


def _full_disk_sweep(fs: Path, run_dir: Path, index: TrainingIndex) -> None:
    claim_and_ack(index, 2)
    results = (run_dir / RESULTS_FILE).read_bytes()
    filler = fill(fs)
    sweep = sweeper(run_dir, index, images="after_ack")
    stats = sweep.sweep()
    # SQLite's own words for ENOSPC when the index is on the full disk too.
    assert stats["sweep_errors"] == 1, stats
    assert re.search(r"No space left|database or disk is full", stats["last_error"])
    # Nothing half done: every episode has all its images, or a marker for them.
    for path in (run_dir / "d").glob("*/*"):
        assert read_marker(path) is not None or len(pngs(path)) == STEPS + 1
        assert not [p for p in path.iterdir() if p.name.endswith(".tmp")]
    assert (run_dir / RESULTS_FILE).read_bytes() == results
    filler.unlink()
    stats = sweep.sweep()
    assert stats["episodes_removed"] == 4 and stats["run_dir_bytes"] > 0
    assert all(pngs(p) == [] for p in (run_dir / "d").glob("*/*"))
    assert index.status(RUN)["groups"]["acked"] == 2


async def until(predicate, timeout_s: float = 30.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not predicate():
        assert loop.time() < deadline, "timed out"
        await asyncio.sleep(0.02)


async def test_a_storage_next_to_a_trainer_stays_within_its_budget(tmp):
    """Episodes keep coming through a real StorageActor (its sweeper on, after_ack within a
    budget of ~5 groups' images); a trainer thread claims (with steps) and acks groups. Each
    claimed group has every image its steps name, and after each sweep the run directory is
    under its budget."""
    group_bytes = 2 * (STEPS + 1) * len(png(0, BIG))
    # ~5 groups' images + the run's own files: SQLite's WAL alone grows to ~4 MB before it
    # is checkpointed (1000 pages), results.jsonl, traj.jsonl...
    budget = 5 * group_bytes + 6_000_000
    cfg = StorageConfig(retention={"images": "after_ack", "max_gb": budget / 1e9,
                                   "sweep_interval_s": 3600})
    storage = StorageActor(tmp / "run", cfg)
    await storage.start_run({"run": RUN})
    sweep = storage.retention
    assert sweep is not None
    stop, problems, claimed = threading.Event(), [], []

    def trainer() -> None:
        with TrainingIndex(default_url(tmp / "run")) as index:
            while not stop.is_set():
                for claim in index.claim_groups(2, "trainer", lease_s=60, load_steps=True):
                    for ep in claim.episodes:
                        names = [s["screenshot_file"] for s in ep["steps"]]
                        missing = [n for n in names if not (Path(ep["dir"]) / n).is_file()]
                        if missing or read_marker(ep["dir"]) is not None:
                            problems.append((claim.group_id, missing))
                    assert index.ack([claim]) == []
                    claimed.append(claim.group_id)
                stop.wait(0.05)

    thread = threading.Thread(target=trainer)
    thread.start()
    try:
        sizes = []
        for task in range(40):
            for rollout in range(2):
                rec = record(f"t{task}", rollout)
                eid = rec["episode_id"]
                await storage.begin_episode(eid, 0, {"id": f"t{task}"})
                for n in range(STEPS + 1):
                    line = {"step_num": n, "screenshot_file": f"step_{n}.png"} if n else None
                    await storage.write_step(eid, 0, line, f"step_{n}.png", png(task * 10 + n, BIG))
                assert await storage.finish_episode(eid, 0, rec) is None
                await storage.record_result(rec)
            if task % 5 == 4:
                # The trainer keeps up (un-acked groups are kept whatever the budget).
                await storage.index_feed.drain(30)
                await until(lambda n=task + 1: len(claimed) >= n)
                await asyncio.to_thread(sweep.sweep)
                sizes.append(sweep.stats()["run_dir_bytes"])
                files = {p.name: p.stat().st_size for p in (tmp / "run").iterdir() if p.is_file()}
                assert sizes[-1] <= budget and not sweep.stats()["over_budget"], (sizes, files)
    finally:
        stop.set()
        thread.join(30)
    stats = await asyncio.to_thread(sweep.sweep)
    await storage.close()
    assert problems == [] and sorted(claimed) == sorted({f"d/t{t}/pass-0" for t in range(40)})
    on_disk = sum(p.stat().st_size for p in (tmp / "run").rglob("*") if p.is_file())
    assert stats["run_dir_bytes"] <= budget and on_disk <= budget, (stats, on_disk)
    assert stats["episodes_removed"] > 0 and not stats["over_budget"]
    # Without retention these episodes would hold 4x the budget.
    assert 40 * group_bytes > 4 * budget


def test_the_viewer_and_show_result_say_the_images_were_removed_by_policy(tmp, capsys):
    from cua_rollout.cli import show_result, view_trajectory

    index, _ = run_with_groups(tmp, ["a", "b"], smooth=True)
    claim_and_ack(index, 2)
    sweeper(tmp, index, images="failures", reencode="webp").sweep()
    index.close()
    assert view_trajectory.main([str(tmp), "--out", str(tmp / "viewer")]) == 0
    pages = {p.name: p.read_text() for p in (tmp / "viewer").rglob("*.html")}
    text = "\n".join(pages.values())
    assert "images removed by retention policy failures at" in text
    assert "screenshot not found" not in text  # removed ones say why, webp ones are shown
    assert len(list((tmp / "viewer").rglob("step_0.webp"))) == 2  # the failures' copies
    capsys.readouterr()
    assert show_result.main([str(tmp)]) == 0
    out = capsys.readouterr().out
    assert "images removed by retention policy failures at" in out
    assert "2 episode(s) without images, 2 re-encoded (webp)" in out


async def test_a_storage_without_an_index_releases_each_episode_by_its_line(tmp):
    """storage.index off: an episode is released once its results line is written (no acks
    to wait for), and the storage's own sweeper removes its images (the chaos run's
    retention_disk_full found a storage that waited for an index it never opens)."""
    cfg = StorageConfig(index=False, retention={"images": "sample", "sample_fraction": 0.0,
                                                "sweep_interval_s": 3600})
    storage = StorageActor(tmp / "run", cfg)
    await storage.start_run({"run": RUN})
    assert storage.retention is not None
    rec = record("t0", 0)
    eid = rec["episode_id"]
    await storage.begin_episode(eid, 0, {"id": "t0"})
    for n in range(STEPS + 1):
        line = {"step_num": n, "screenshot_file": f"step_{n}.png"} if n else None
        await storage.write_step(eid, 0, line, f"step_{n}.png", png(n, BIG))
    assert await storage.finish_episode(eid, 0, rec) is None
    await storage.record_result(rec)
    stats = await asyncio.to_thread(storage.retention.sweep)
    await storage.close()
    marker = read_marker(tmp / "run" / eid)
    assert stats["episodes_removed"] == 1 and marker is not None
    assert not list((tmp / "run" / eid).glob("*.png"))
    assert sorted(marker.removed) == [f"step_{n}.png" for n in range(STEPS + 1)]
