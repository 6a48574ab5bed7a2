"""Step files written where they are made (issue 33, item 1): a runner process that sees the
run directory writes its episodes' screenshots and traj.jsonl lines itself, into a staging
directory per attempt that the storage moves into place when the current attempt finishes;
a runner that does not see it sends them to the storage actor. A real StorageActor, StepFiles
and EpisodeWriter in one process; for the full disk, the coordinator's whole world."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any
from urllib.request import url2pathname

import pytest

import cua_rollout.runtime.storage as storage_module
from cua_rollout.config import StorageConfig, load_config
from cua_rollout.core.errors import ConfigError, StorageError
from cua_rollout.core.layout import ATTEMPTS_DIR, RESULTS_FILE, staging_name
from cua_rollout.core.types import EpisodeSpec
from cua_rollout.runtime.coordinator import AgentCoordinator
from cua_rollout.runtime.pool import DesktopPool
from cua_rollout.runtime.runner import TrajectoryRunner
from cua_rollout.runtime.storage import EpisodeWriter, StepFiles, StorageActor
from tests.doubles.disk import fill
from tests.doubles.fake_desktop import FakeDesktop, FakeProvider
from tests.doubles.fake_openai import FakeOpenAIServer
from tests.support import REPO_ROOT, small_filesystem

PNG = b"\x89PNG\r\n\x1a\n" + b"\0" * 64
PNG_1 = b"\x89PNG\r\n\x1a\n" + b"\1" * 64
TASK = {"id": "t", "instruction": "do it"}
EPISODE = "d/t/0"


def record(episode_id: str = EPISODE, attempt: int = 0, status: str = "success") -> dict:
    domain, task_id, rollout = episode_id.split("/")
    return {"episode_id": episode_id, "task_id": task_id, "domain": domain,
            "rollout": int(rollout), "attempt": attempt, "status": status,
            "reward": 1.0 if status == "success" else None, "steps": 1}


async def started(run: Path) -> StorageActor:
    storage = StorageActor(run, StorageConfig(index=False))
    await storage.start_run({"run": "t"})
    return storage


def files_of(storage: StorageActor, mode: str = "auto", name: str = "r0") -> StepFiles:
    return StepFiles(storage, StorageConfig(step_files=mode), name)  # type: ignore[arg-type]


def traj(directory: Path) -> list[dict[str, Any]]:
    return [json.loads(x) for x in (directory / "traj.jsonl").read_text().splitlines()]


def staged(run: Path) -> list[str]:
    """What the staging area holds besides the runners' probe."""
    return sorted(p.name for p in (run / ATTEMPTS_DIR).iterdir()
                  if not p.name.startswith("probe-"))


async def test_a_runner_that_sees_the_run_directory_writes_the_step_files_itself(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture):
    run = tmp_path / "run"
    storage = await started(run)
    files = files_of(storage)
    # What the episode's directory holds at the moment its results line is appended.
    at_line: list[list[str]] = []
    real_append = storage_module.append_text

    def append(path: Path, text: str | bytes, **kw: Any) -> int:
        if path.name == RESULTS_FILE:
            at_line.append(sorted(p.name for p in (run / EPISODE).iterdir()))
            assert len(traj(run / EPISODE)) == 2
        return real_append(path, text, **kw)

    monkeypatch.setattr(storage_module, "append_text", append)
    writer = EpisodeWriter(storage, EPISODE, 0, files)
    with caplog.at_level(logging.INFO, logger=storage_module.__name__):
        await writer.begin(TASK)
    assert "r0: writes its step files into" in caplog.text
    await writer.step(None, "step_0.png", PNG)
    await writer.step({"step_num": 1}, "step_1.png", PNG_1)
    await writer.step({"step_num": 2, "done": True})
    await writer.flush()
    assert not (run / EPISODE).exists(), "a running attempt's files are staged"
    (name,) = staged(run)
    assert sorted(p.name for p in (run / ATTEMPTS_DIR / name).iterdir()) == [
        "step_0.png", "step_1.png", "task_config.json", "traj.jsonl"]
    assert await writer.finish(record(), [{"role": "user"}]) is None
    assert (run / ATTEMPTS_DIR / name / "episode.json").is_file()
    assert not (run / EPISODE).exists(), "moved into place when it is recorded"
    assert writer.staging == name == staging_name(EPISODE, 0, writer.nonce)
    await storage.record_result(record(), writer.staging)
    await storage.close()

    expected = ["episode.json", "messages.json", "result.txt", "step_0.png", "step_1.png",
                "task_config.json", "traj.jsonl"]
    assert at_line == [expected], "the files are complete before the results line"
    directory = run / EPISODE
    assert [s["step_num"] for s in traj(directory)] == [1, 2]
    assert (directory / "step_1.png").read_bytes() == PNG_1
    assert json.loads((directory / "task_config.json").read_text()) == TASK
    assert json.loads((directory / "episode.json").read_text())["attempt"] == 0
    assert staged(run) == []
    # The storage actor carried no step; the runner's process wrote them.
    stats = storage.stats()
    assert (stats["steps"], stats["screenshots"], stats["episodes"]) == (0, 0, 1)
    assert files.stats() == {"mode": "runner", "steps": 2, "screenshots": 2,
                             "bytes": len(PNG) + len(PNG_1), "errors": 0, "swept": 0,
                             "last_error": None}
    files.close()


async def test_a_stale_attempts_writes_never_reach_the_episodes_directory(tmp_path: Path):
    """Attempt 0's runner is declared dead but keeps running: it writes after attempt 1 began
    elsewhere, finishes after it, writes after attempt 1's results line, and even begins
    again. Only attempt 1's staging directory is recorded; attempt 0's is discarded."""
    run = tmp_path / "run"
    storage = await started(run)
    dead, alive = files_of(storage, name="r0"), files_of(storage, name="r1")
    old = EpisodeWriter(storage, EPISODE, 0, dead, nonce="n0")
    await old.begin(TASK)
    await old.step({"step_num": 1, "attempt": 0}, "step_1.png", PNG)
    await old.flush()

    new = EpisodeWriter(storage, EPISODE, 1, alive, nonce="n1")
    await new.begin(TASK)
    await old.step({"step_num": 2, "attempt": 0}, "step_2.png", PNG)
    assert await old.finish(record(attempt=0), None) is None  # into its own directory
    assert not (run / EPISODE).exists()
    await new.step({"step_num": 1, "attempt": 1}, "step_1.png", PNG_1)
    assert await new.finish(record(attempt=1), None) is None
    assert sorted(staged(run)) == sorted([old.staging, new.staging])
    await storage.record_result(record(attempt=1), new.staging, [old.staging])
    assert staged(run) == [], "attempt 0's directory is discarded, attempt 1's moved"

    await old.step({"step_num": 3, "attempt": 0}, "step_3.png", PNG)  # its runner wakes up
    await old.flush()
    assert old.failed is not None and "No such file or directory" in old.failed
    # Expected, not a failing disk: counted apart from errors.
    assert (dead.counters["swept"], dead.counters["errors"]) == (1, 0)
    late = EpisodeWriter(storage, EPISODE, 0, dead, nonce="n2")  # and begins once more
    await late.begin(TASK)
    await late.step({"step_num": 1, "attempt": 0}, "step_1.png", PNG)
    assert await late.finish(record(attempt=0), None) is None
    assert staged(run) == [late.staging], "never recorded: never moved"

    directory = run / EPISODE
    assert sorted(p.name for p in directory.iterdir()) == [
        "episode.json", "result.txt", "step_1.png", "task_config.json", "traj.jsonl"]
    assert traj(directory) == [{"step_num": 1, "attempt": 1}]
    assert (directory / "step_1.png").read_bytes() == PNG_1
    assert json.loads((directory / "episode.json").read_text())["attempt"] == 1
    lines = (run / RESULTS_FILE).read_text().splitlines()
    assert [json.loads(x)["attempt"] for x in lines] == [1]
    await storage.end_run("finished")
    await storage.close()
    assert not (run / ATTEMPTS_DIR).exists(), "the end of the run sweeps the staging area"
    for files in (dead, alive):
        files.close()


async def test_a_runner_that_does_not_see_the_run_directory_sends_its_steps(
        tmp_path: Path, caplog: pytest.LogCaptureFixture):
    run = tmp_path / "run"
    storage = await started(run)
    # Another node's directory at the same path: a probe file, not this run's token.
    target = await storage.step_files_target()
    (Path(target["run_dir"]) / target["probe"]).write_text("another run's token")
    files = files_of(storage)
    writer = EpisodeWriter(storage, EPISODE, 0, files)
    with caplog.at_level(logging.INFO, logger=storage_module.__name__):
        await writer.begin(TASK)
    assert "r0: step files go through the storage actor" in caplog.text
    await writer.step(None, "step_0.png", PNG)
    await writer.step({"step_num": 1, "done": True})
    assert await writer.finish(record(), None) is None
    assert writer.staging is None
    # The coordinator names the dispatch's staging directory either way: this actor's
    # own attempt wins.
    await storage.record_result(record(), staging_name(EPISODE, 0, writer.nonce))
    assert files.mode == "storage" and files.counters["steps"] == 0
    stats = storage.stats()
    assert (stats["steps"], stats["screenshots"]) == (1, 1)
    directory = run / EPISODE
    assert sorted(p.name for p in directory.iterdir()) == [
        "episode.json", "result.txt", "step_0.png", "task_config.json", "traj.jsonl"]
    assert staged(run) == []

    # storage.step_files: runner, where the run directory is not visible, stops the run.
    forced = EpisodeWriter(storage, "d/t/1", 0, files_of(storage, "runner"))
    with pytest.raises(ConfigError, match=r"storage\.step_files is runner, but r0: .*token"):
        await forced.begin(TASK)
    # storage.step_files: storage never probes.
    through = files_of(storage, "storage")
    assert not await through.local() and through.mode == "storage"
    await storage.close()


async def test_an_attempt_that_never_finished_is_recorded_with_the_files_it_wrote(
        tmp_path: Path):
    """Its runner died mid-episode and the coordinator records the attempt as an infra
    error: the directory shows what it wrote, with the line's record."""
    run = tmp_path / "run"
    storage = await started(run)
    files = files_of(storage)
    writer = EpisodeWriter(storage, EPISODE, 0, files)
    await writer.begin(TASK)
    await writer.step(None, "step_0.png", PNG)
    await writer.flush()
    died = {**record(status="infra_error"), "error": "runner runner-0 died"}
    await storage.record_result(died, writer.staging)
    await storage.close()
    directory = run / EPISODE
    assert sorted(p.name for p in directory.iterdir()) == [
        "episode.json", "step_0.png", "task_config.json"]
    assert json.loads((directory / "episode.json").read_text())["error"] == died["error"]
    assert staged(run) == []
    files.close()


async def test_a_batch_of_results_is_placed_and_appended_at_once(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """``record_results``: every episode of the batch moved into place before the lines,
    which go in one append, in the batch's order."""
    run = tmp_path / "run"
    storage = await started(run)
    files = files_of(storage)
    writers = [EpisodeWriter(storage, f"d/t/{n}", 0, files) for n in range(6)]
    for n, writer in enumerate(writers):
        await writer.begin(TASK)
        await writer.step({"step_num": 1, "n": n}, "step_1.png", PNG)
        assert await writer.finish(record(f"d/t/{n}"), None) is None
    appends: list[tuple[list[str], list[str]]] = []
    real_append = storage_module.append_text

    def append(path: Path, text: str | bytes, **kw: Any) -> int:
        if path.name == RESULTS_FILE:
            placed = sorted(p.name for p in (run / "d" / "t").iterdir())
            appends.append(([json.loads(x)["episode_id"] for x in text.splitlines()], placed))
        return real_append(path, text, **kw)

    monkeypatch.setattr(storage_module, "append_text", append)
    order = [3, 0, 5, 1, 4, 2]
    errors = await storage.record_results([(record(f"d/t/{n}"), writers[n].staging, [])
                                           for n in order])
    assert errors == [None] * 6
    assert sum(len(ids) for ids, _ in appends) == 6 and len(appends) <= 4  # its writers
    for ids, placed in appends:
        assert set(x.rsplit("/", 1)[1] for x in ids) <= set(placed)
    lines = [json.loads(x)["episode_id"] for x in (run / RESULTS_FILE).read_text().splitlines()]
    assert sorted(lines) == sorted(f"d/t/{n}" for n in range(6))
    for n in range(6):
        assert traj(run / f"d/t/{n}") == [{"step_num": 1, "n": n}]
    assert staged(run) == [] and storage.stats()["episodes"] == 6
    await storage.close()
    files.close()


async def test_a_cancelled_attempt_is_placed_without_a_line_and_kept_if_recorded_later(
        tmp_path: Path):
    """Cancelled when the run stops: its files move into place, no results line. A cut
    straggler's cancelled line may come after that: the files stay as they are."""
    run = tmp_path / "run"
    storage = await started(run)
    files = files_of(storage)
    writer = EpisodeWriter(storage, EPISODE, 0, files)
    await writer.begin(TASK)
    await writer.step({"step_num": 1}, "step_1.png", PNG)
    assert await writer.finish(record(status="cancelled"), None) is None
    await writer.forget()
    directory = run / EPISODE
    assert sorted(p.name for p in directory.iterdir()) == [
        "episode.json", "step_1.png", "task_config.json", "traj.jsonl"]
    assert not (run / RESULTS_FILE).exists() or (run / RESULTS_FILE).read_text() == ""
    assert staged(run) == []
    await storage.record_result(record(status="cancelled"), writer.staging)
    assert traj(directory) == [{"step_num": 1}], "not rewritten by the later line"
    assert json.loads((run / RESULTS_FILE).read_text())["status"] == "cancelled"
    await storage.close()
    files.close()


def test_a_staging_name_is_one_new_path_component_for_any_episode_id():
    for episode_id in ("d/t/0", "../../etc/x", "a" * 300 + "/t/0", "d/t%2F/1", ".."):
        name = staging_name(episode_id, 2, "n0")
        assert "/" not in name and name not in (".", "..") and len(name.encode()) < 255
        assert name.endswith(".2.n0")
    assert staging_name("d/t/0", 0, "a") != staging_name("d/t/0", 0, "b")
    assert staging_name("d/t/0", 0, "a") != staging_name("d%2Ft/0", 0, "a")


async def test_the_storage_refuses_a_staging_name_that_is_not_one_component(tmp_path: Path):
    run = tmp_path / "run"
    storage = await started(run)
    (tmp_path / "escape").mkdir()  # what "../escape" would name from the staging area
    for staging, discard in (("../../escape", []), (None, ["../../escape"]), ("", [])):
        with pytest.raises(StorageError, match=r"is not a name in \.attempts"):
            await storage.record_result(record(), staging, discard)
    # The other records of a batch are written.
    errors = await storage.record_results([(record(), "../x", []),
                                           (record("d/t/1"), None, [])])
    assert errors[0] is not None and "is not a name in .attempts" in errors[0]
    assert errors[1] is None
    assert (tmp_path / "escape").is_dir() and not (run / EPISODE).exists()
    lines = (run / RESULTS_FILE).read_text().splitlines()
    assert [json.loads(x)["episode_id"] for x in lines] == ["d/t/1"]
    await storage.close()


@contextlib.asynccontextmanager
async def one_episode_world(output_dir: Path, server_url: str, *sets: str
                            ) -> AsyncIterator[tuple[Any, AgentCoordinator, StorageActor,
                                                     list[TrajectoryRunner]]]:
    """The coordinator's whole world in this process (fake desktops, a real storage and
    in-process runners) on the demo config for one episode at a time, its model the
    server at ``server_url``; ``sets`` add overrides. Yields the config, the coordinator,
    the storage and the runners it made; everything is stopped after."""
    cfg = load_config(REPO_ROOT / "configs" / "demo.yaml", [
        f"run.output_dir={output_dir / 'results'}", "model.scripted=false",
        f"model.endpoints={json.dumps([server_url])}",
        "desktops.count=1", "desktops.warm_spares=0", "runner.action_pause_s=0",
        "coordinator.max_concurrent_episodes=1", "coordinator.episodes_per_runner=1",
        "monitoring.ray_metrics=false", "storage.index=false",
        f"desktops.download_cache_dir={output_dir}", *sets])
    provider = FakeProvider(desktop_factory=lambda i: FakeDesktop(name=i))
    pool = DesktopPool(cfg.desktops, provider)
    await pool.start()
    storage = StorageActor(cfg.run_dir, cfg.storage)
    await storage.start_run({"run": cfg.run.name})
    coordinator = AgentCoordinator(cfg, pool, storage, use_ray=False)
    runners: list[TrajectoryRunner] = []

    def runner(*args: Any) -> TrajectoryRunner:
        runners.append(TrajectoryRunner(*args, env_factory=provider.env_factory))
        return runners[-1]

    coordinator.runner_factory = runner
    try:
        await coordinator.submit([EpisodeSpec("t0", "d", 0, {
            "id": "t0", "instruction": "x", "config": [],
            "evaluator": {"func": "infeasible"}})])
        yield cfg, coordinator, storage, runners
    finally:
        await coordinator.drain(cancel=True, timeout_s=10)
        await coordinator.shutdown()
        await pool.stop()
        await storage.close()


async def settled(coordinator: AgentCoordinator, done: Callable[[dict[str, Any]], bool]
                  ) -> dict[str, Any]:
    """The coordinator's statistics once ``done`` says so (at most 30 s of polls)."""
    for _ in range(600):
        stats = (await coordinator.poll())["stats"]
        if done(stats):
            break
        await asyncio.sleep(0.05)
    return stats


def image_urls(messages: list[dict[str, Any]]) -> list[str]:
    """The image URLs of chat ``messages``, in order."""
    return [part["image_url"]["url"] for m in messages if isinstance(m["content"], list)
            for part in m["content"] if part.get("type") == "image_url"]


async def test_a_full_disk_on_the_runner_side_is_an_error_that_is_never_recorded(tmp: Path):
    """The disk fills while an episode runs: the runner's own write fails, the episode ends
    as a fatal infra error (its files are incomplete), the coordinator records nothing and
    stops the run, which a rerun resumes."""
    with small_filesystem(tmp / "fs", 2 * 1024 * 1024) as fs:
        filler: list[Path] = []

        def reply(body: dict[str, Any]) -> str:
            if not filler:  # the screen after this click cannot be saved
                filler.append(fill(fs))
                return "Action: click(start_box='(10,10)')"
            return "Action: call_user()"

        server = FakeOpenAIServer(reply=reply).start()
        try:
            async with one_episode_world(fs, server.url, "model.retries=0",
                                         "coordinator.max_retries=0") as (
                    cfg, coordinator, storage, runners):
                stats = await settled(coordinator, lambda s: bool(
                    s["fatal"] and not s["episodes_in_flight"]))
                assert stats["fatal"] and stats["fatal"].startswith("storage: StorageError: step: ")
                assert "No space left on device" in stats["fatal"]
                await storage.flush()
                results = cfg.run_dir / RESULTS_FILE
                assert not results.exists() or results.read_text() == ""
                (only,) = runners
                assert only.stats()["step_files"]["mode"] == "runner"
                assert only.stats()["step_files"]["errors"] >= 1
                assert storage.stats()["steps"] == 0  # nothing went through the actor
        finally:
            server.stop()
            for made in filler:
                made.unlink()


async def test_screenshots_sent_by_path_are_on_disk_when_the_model_reads_them(tmp_path: Path):
    """``model.images: file``: every request names its screenshots by ``file://`` URLs of
    the files this runner wrote (read by the server when it gets the request: each is
    there, whole), no base64 is sent, and what is stored names the files."""
    seen: list[list[str]] = []

    def reply(body: dict[str, Any]) -> str:
        urls = image_urls(body["messages"])
        for url in urls:
            assert url.startswith("file:///"), url[:40]
            data = Path(url2pathname(url.removeprefix("file://"))).read_bytes()
            assert data.startswith(b"\x89PNG") and data.endswith(b"IEND\xaeB`\x82")
        seen.append(urls)
        return ("Action: click(start_box='(10,10)')" if len(seen) < 3
                else "Action: finished(content='')")

    server = FakeOpenAIServer(reply=reply).start()
    try:
        async with one_episode_world(tmp_path, server.url, "model.images=file",
                                     "storage.save_messages=true") as (
                cfg, coordinator, storage, _):
            await settled(coordinator, lambda s: bool(
                s["episodes_done"] and not s["episodes_in_flight"]))
            await storage.flush()
    finally:
        server.stop()
    assert [len(urls) for urls in seen] == [1, 2, 3]
    assert all(url.endswith(f"/step_{i}.png") for urls in seen for i, url in enumerate(urls))
    (line,) = [json.loads(x) for x in (cfg.run_dir / RESULTS_FILE).read_text().splitlines()]
    directory = cfg.run_dir / line["result_dir"] if "result_dir" in line else None
    episode = next(p for p in cfg.run_dir.rglob("traj.jsonl")).parent
    assert directory is None or directory == episode
    assert sorted(p.name for p in episode.glob("step_*.png")) == [
        "step_0.png", "step_1.png", "step_2.png"]
    stored = json.loads((episode / "messages.json").read_text())
    assert image_urls(stored) == ["step_0.png", "step_1.png", "step_2.png"]


def test_images_by_path_need_the_runners_to_write_the_screenshots():
    for bad in ("storage.step_files=storage", "runner.save_screenshots=false"):
        with pytest.raises(ConfigError, match=r"model\.images: file"):
            load_config(REPO_ROOT / "configs" / "demo.yaml", ["model.images=file", bad])
