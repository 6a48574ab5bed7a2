"""benchmarks/bench_fidelity.py on real local desktops: a reference solution scores 1.0, the
untouched desktop (``--nothing``) 0.0, and a task set without solutions is refused unless
played with ``--nothing`` (OSWorld's own tasks have none)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support import REPO_ROOT

pytestmark = pytest.mark.skipif(shutil.which("Xvfb") is None, reason="needs Xvfb")

sys.path.insert(0, str(REPO_ROOT / "benchmarks"))
import bench_fidelity  # noqa: E402

TASK = "terminal-hello-file"


@pytest.fixture(autouse=True)
def _restored() -> Iterator[None]:
    """The benchmark's main moves to the repository and installs its signal handlers."""
    cwd, handlers = os.getcwd(), {s: signal.getsignal(s) for s in (signal.SIGINT,
                                                                  signal.SIGTERM)}
    yield
    os.chdir(cwd)
    for sig, handler in handlers.items():
        signal.signal(sig, handler)


@pytest.mark.parametrize("nothing", [False, True], ids=["reference", "nothing"])
def test_a_task_scores_as_solved_and_as_untouched(tmp_path: Path, nothing: bool) -> None:
    out = tmp_path / "report.json"
    argv = ["--suite", str(REPO_ROOT / "tasks" / "demo"), "--tasks", f"terminal/{TASK}",
            "--concurrency", "1", "--json", str(out), *(["--nothing"] if nothing else [])]
    assert bench_fidelity.main(argv) == 0
    report = json.loads(out.read_text())
    assert report["mode"] == ("nothing" if nothing else "reference")
    [record] = report["records"]
    assert (record["task"], record["outcome"]) == (TASK, "pass")
    assert record["score"] == (0.0 if nothing else 1.0)
    assert record["name"] == f"terminal/{TASK}#0"


def test_tasks_without_solutions_need_nothing_mode(tmp_path: Path) -> None:
    (tmp_path / "examples" / "os").mkdir(parents=True)
    task = {"id": "bare", "instruction": "x", "config": [],
            "evaluator": {"func": "infeasible"}}
    (tmp_path / "examples" / "os" / "bare.json").write_text(json.dumps(task))
    (tmp_path / "test_all.json").write_text(json.dumps({"os": ["bare"]}))
    listed = tmp_path / "ids.txt"
    listed.write_text("os/bare\n")
    with pytest.raises(SystemExit, match=r"no reference_solution.*--nothing"):
        bench_fidelity.main(["--suite", str(tmp_path), "--tasks-file", str(listed),
                             "--concurrency", "1"])
    with pytest.raises(SystemExit, match=r"no such task or domain.*os/other"):
        bench_fidelity.main(["--suite", str(tmp_path), "--tasks", "os/other", "--nothing"])
