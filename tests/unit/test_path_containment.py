"""Task files read files of this host only inside the download cache (review finding M5): setup
``upload_file`` and ``download``, the evaluator's ``cache_file``, ``vm_file`` destinations and
the paths file-reading metrics get. Anything else (``/proc/self/environ``, ``~/.ssh/id_rsa``,
``../..``, a symlink out of the cache) is refused, naming the path and the allowed directory,
before any file is read."""

from __future__ import annotations

import os
import uuid
from pathlib import Path

import pytest

from cua_rollout.config import DesktopsConfig
from cua_rollout.core.errors import BadTaskStep, TaskSetupError, UnsupportedEvaluator
from cua_rollout.envs.setup_steps import confined_path
from cua_rollout.evaluation import evaluate
from tests.doubles.fake_desktop import FakeDesktop


@pytest.fixture
def cache(tmp_path: Path) -> Path:
    (tmp_path / "cache" / "t1").mkdir(parents=True)
    (tmp_path / "cache" / "t1" / "expected.txt").write_text("hello\n")
    (tmp_path / "outside").mkdir()
    (tmp_path / "outside" / "secret.txt").write_text("sk-secret\n")
    return tmp_path / "cache"


@pytest.fixture
def desktop(cache: Path) -> FakeDesktop:
    return FakeDesktop(cfg=DesktopsConfig(download_cache_dir=cache), files={"/r/a": b"hello\n"})


def upload(*local_paths: str | Path) -> dict:
    files = [{"local_path": str(p), "path": f"/home/user/{i}"} for i, p in enumerate(local_paths)]
    return {"id": "t1", "config": [{"type": "upload_file", "parameters": {"files": files}}]}


def uploads(desktop: FakeDesktop) -> list[str]:
    return [path for kind, path in desktop.calls if kind == "upload"]


def outside_paths(cache: Path, monkeypatch: pytest.MonkeyPatch) -> list[str | Path]:
    """What a hostile task names: the environment (API keys), a private key, a climb out of
    the working directory, and a link in the cache that points out of it."""
    home = cache.parent / "home"
    (home / ".ssh").mkdir(parents=True)
    (home / ".ssh" / "id_rsa").write_text("PRIVATE KEY\n")
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(cache / "t1")
    (cache / "link.txt").symlink_to(cache.parent / "outside" / "secret.txt")
    return [
        "/proc/self/environ",
        os.path.expanduser("~/.ssh/id_rsa"),
        "../../outside/secret.txt",
        cache / "link.txt",
    ]


async def test_upload_file_reads_only_the_download_cache(
    desktop: FakeDesktop, cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for path in outside_paths(cache, monkeypatch):
        with pytest.raises(BadTaskStep) as caught:  # every attempt would hit it: no retry
            await desktop.reset(upload(path))
        message = str(caught.value)
        assert "task t1 config[0]" in message and str(path) in message
        assert str(cache.resolve()) in message  # the allowed directory
    assert uploads(desktop) == []
    await desktop.reset(upload(cache / "t1" / "expected.txt", "expected.txt"))  # relative: cwd
    assert desktop.files["/home/user/0"] == desktop.files["/home/user/1"] == b"hello\n"


async def test_one_bad_path_stops_an_upload_before_any_file_is_read(
    desktop: FakeDesktop, cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    read: list[Path] = []
    real_read_bytes = Path.read_bytes
    monkeypatch.setattr(Path, "read_bytes", lambda p: read.append(p) or real_read_bytes(p))
    with pytest.raises(TaskSetupError):
        await desktop.reset(upload(cache / "t1" / "expected.txt", "/etc/passwd"))
    assert read == [] and uploads(desktop) == []


async def test_a_download_whose_cached_copy_links_out_of_the_cache_is_refused(
    desktop: FakeDesktop, cache: Path
) -> None:
    url = "https://example.org/data.txt"
    link = cache / f"{uuid.uuid5(uuid.NAMESPACE_URL, url)}_data.txt"
    link.symlink_to(cache.parent / "outside" / "secret.txt")
    step = {"type": "download", "parameters": {"files": [{"url": url, "path": "~/data.txt"}]}}
    with pytest.raises(TaskSetupError, match="outside the directories"):
        await desktop.reset({"id": "t1", "config": [step]})
    assert uploads(desktop) == []
    link.unlink()
    (cache / "t1" / "data.txt").write_text("cached\n")
    await desktop.reset({"id": "t1", "config": [step]})
    assert desktop.files["~/data.txt"] == b"cached\n"


def task(evaluator: dict) -> dict:
    return {"id": "t1", "instruction": "x", "evaluator": evaluator}


async def score(desktop: FakeDesktop, cache: Path, t: dict) -> float:
    return await evaluate(desktop, t, None, cache_dir=cache, task_id="t1")


async def test_cache_file_stays_in_the_cache(
    desktop: FakeDesktop, cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def compare(expected: str) -> dict:
        return task({"func": "compare_text_file",
                     "result": {"type": "vm_file", "path": "/r/a", "dest": "a.txt"},
                     "expected": {"type": "cache_file", "path": expected}})  # fmt: skip

    assert await score(desktop, cache, compare("expected.txt")) == 1.0
    for path in outside_paths(cache, monkeypatch):
        with pytest.raises(UnsupportedEvaluator, match=r"cache_file: .*outside the directories"):
            await score(desktop, cache, compare(str(path)))
    with pytest.raises(UnsupportedEvaluator, match=r"cache_file: .*outside the directories"):
        await score(desktop, cache, compare("../../outside/secret.txt"))


@pytest.mark.parametrize("func", ["compare_text_file", "check_list"])
async def test_a_metric_reads_no_file_a_rule_names(
    desktop: FakeDesktop, cache: Path, func: str
) -> None:
    """A ``rule`` getter passes the task's string as is: as a file to read, it is refused."""
    expected = (
        {"type": "cache_file", "path": "expected.txt"}
        if func == "compare_text_file"
        else {"type": "rule", "rules": {"expect": ["OPENAI_API_KEY=sk-a"]}}
    )
    t = task({"func": func, "result": {"type": "rule", "rules": "/proc/self/environ"},
              "expected": expected})  # fmt: skip
    with pytest.raises(UnsupportedEvaluator, match=f"metric {func}: '/proc/self/environ'"):
        await score(desktop, cache, t)


async def test_a_fetched_file_is_saved_only_in_the_evaluations_directory(
    desktop: FakeDesktop, cache: Path
) -> None:
    for dest in ("..", ".", "/"):
        t = task({"func": "check_list",
                  "result": {"type": "vm_file", "path": "/r/a", "dest": dest},
                  "expected": {"type": "rule", "rules": {"expect": ["hello"]}}})  # fmt: skip
        with pytest.raises(UnsupportedEvaluator, match="vm_file dest"):
            await score(desktop, cache, t)


def test_confined_path_resolves_links_and_names_the_roots(tmp_path: Path) -> None:
    root = tmp_path / "root"
    (root / "sub").mkdir(parents=True)
    (root / "in.txt").write_text("x")
    (root / "sub" / "up").symlink_to(root / "in.txt")
    assert confined_path(root / "sub" / "up", [root]) == (root / "in.txt").resolve()
    assert confined_path(root / "sub" / ".." / "in.txt", [tmp_path / "x", root]).name == "in.txt"
    for bad in (root, root / ".." / "root2" / "f", "/proc/self/environ"):
        with pytest.raises(ValueError, match=str(root.resolve())):
            confined_path(bad, [root])


async def test_upload_file_also_reads_the_task_roots(cache: Path, tmp_path: Path) -> None:
    """OSWorld's upload_file names files beside its task files: run.py adds the folder of
    tasks.source (and tasks.examples_dir) to desktops.task_file_roots."""
    tasks = tmp_path / "tasks"
    (tasks / "files").mkdir(parents=True)
    (tasks / "files" / "doc.txt").write_text("from the task set\n")
    desktop = FakeDesktop(cfg=DesktopsConfig(download_cache_dir=cache, task_file_roots=[tasks]))
    await desktop.reset(upload(tasks / "files" / "doc.txt"))
    assert desktop.files["/home/user/0"] == b"from the task set\n"
    with pytest.raises(BadTaskStep, match="outside the directories"):
        await desktop.reset(upload(tmp_path / "outside" / "secret.txt"))
