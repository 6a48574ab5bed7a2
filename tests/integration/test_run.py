"""run.py as a user runs it (a subprocess on real Ray, real local desktops, the scripted
policy): a small demo end to end, resume after the driver is SIGKILLed, a malformed task
file, and the exit codes of setup errors."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil
import pytest

from cua_rollout.core.files import DirectoryLock
from cua_rollout.core.layout import RUN_LOCK_FILE
from tests.support import REPO_ROOT, run_py_command, slow_scripted_policy

ROOT = REPO_ROOT
DEMO = ROOT / "configs" / "demo.yaml"
SUITE = ROOT / "tasks" / "demo"
RUN_TIMEOUT_S = 420




def _command(tmp: Path, *sets: str) -> list[str]:
    return run_py_command(DEMO, tmp / "results", f"desktops.local.state_dir={tmp / 'desktops'}",
                          *sets)


def _run(args: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(args, cwd=cwd, capture_output=True, text=True,
                          timeout=RUN_TIMEOUT_S)


def _results(run_dir: Path) -> list[dict[str, Any]]:
    return [json.loads(x) for x in (run_dir / "results.jsonl").read_text().splitlines()]


@pytest.mark.integration
@pytest.mark.slow
def test_a_small_demo_end_to_end(tmp):
    tasks = ["terminal-hello-file", "calc-divide-keyboard", "terminal-wifi-infeasible"]
    done = _run(_command(tmp, f"tasks.task_ids={json.dumps(tasks)}"), cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    run_dir = tmp / "results" / "demo"
    results = _results(run_dir)
    assert sorted((r["task_id"], r["rollout"]) for r in results) == sorted(
        (t, k) for t in tasks for k in range(2))
    for r in results:
        assert {"task_id", "domain", "rollout", "status", "reward", "steps", "started_at",
                "ended_at", "model_version", "desktop", "attempt"} <= r.keys()
        assert r["status"] == "success" and r["reward"] == 1.0 and r["attempt"] == 0
        episode = run_dir / r["domain"] / r["task_id"] / str(r["rollout"])
        files = {p.name for p in episode.iterdir()}
        assert {"traj.jsonl", "result.txt", "task_config.json", "episode.json",
                "messages.json", "step_0.png"} <= files, files
        steps = [json.loads(x) for x in (episode / "traj.jsonl").read_text().splitlines()]
        assert [s["step_num"] for s in steps] == list(range(1, r["steps"] + 1))
        for s in steps[:-1]:
            assert s["screenshot_file"] in files and s["observation_file"] in files
            assert not s["done"] and set(s["timing"]) == {
                "model_s", "env_s", "overhead_s", "step_s", "action_s", "pause_s",
                "screenshot_s", "started_at"}
        # The same reward everywhere it is written.
        assert steps[-1]["done"] and steps[-1]["reward"] == r["reward"]
        assert float((episode / "result.txt").read_text()) == r["reward"]
        assert json.loads((episode / "episode.json").read_text())["reward"] == r["reward"]
        assert r["last_action"] == ("FAIL" if "infeasible" in r["task_id"] else "DONE")
    info = json.loads((run_dir / "run.json").read_text())
    assert info["status"] == "finished" and info["config"]["run"]["name"] == "demo"
    assert info["versions"]["ray"]
    samples = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert samples and samples[-1]["episodes_done"] == len(results)
    # Utilization (desktops' time split, the scripted policy's vLLM-style /metrics).
    util = [s["utilization"] for s in samples if (s.get("utilization") or {}).get("desktop")]
    assert util and max(u["desktop"]["acting"] for u in util) > 0
    assert max(u["actions_per_min"] for u in util) > 0
    servers = [s["model_servers"]["summary"] for s in samples if s.get("model_servers")]
    assert servers and all(x["endpoints_up"] == x["endpoints"] == 1 for x in servers)
    assert max(x["generation_tokens_per_s"] or 0 for x in servers) > 0
    assert "calculator" in done.stdout and "terminal" in done.stdout  # the per-domain table
    assert not list((tmp / "desktops").glob("*/session.json")), "desktops left running"


def _descendants(pid: int) -> list[psutil.Process]:
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


@pytest.mark.integration
@pytest.mark.slow
def test_a_driver_killed_mid_run_resumes_with_every_episode_once(tmp):
    tasks = ["terminal-hello-file", "terminal-make-dirs", "calc-add", "editor-append-line"]
    sets = [f"tasks.task_ids={json.dumps(tasks)}"]
    run_dir = tmp / "results" / "demo"
    started: list[psutil.Process] = []
    with slow_scripted_policy(DEMO, sets, latency_s=0.3) as slow:
        args = _command(tmp, *sets, *slow)
        first = subprocess.Popen(args, cwd=ROOT, stdout=subprocess.DEVNULL,
                                 stderr=subprocess.DEVNULL, start_new_session=True)
        try:
            deadline = time.monotonic() + RUN_TIMEOUT_S
            while not ((run_dir / "results.jsonl").exists()
                       and len(_results(run_dir)) >= 2):
                assert first.poll() is None, "the first run ended before it was killed"
                assert time.monotonic() < deadline
                started = _descendants(first.pid) or started
                time.sleep(0.2)
            started = _descendants(first.pid) or started
            os.kill(first.pid, signal.SIGKILL)
            first.wait()
            killed_at = len(_results(run_dir))
            assert killed_at < 2 * len(tasks), "the run finished before it was killed"

            again = _run(args, cwd=ROOT)
            assert again.returncode == 0, again.stderr[-3000:]
        finally:
            # What the killed driver started and left behind (Ray, desktops) is ended by pid.
            for proc in started:
                try:
                    proc.kill()
                except psutil.NoSuchProcess:
                    continue
    results = _results(run_dir)
    counts = Counter((r["task_id"], r["rollout"]) for r in results)
    assert counts == Counter({(t, k): 1 for t in tasks for k in range(2)})
    assert {r["status"] for r in results} == {"success"}
    info = json.loads((run_dir / "run.json").read_text())
    assert info["status"] == "finished" and info["previous_starts"][0]["status"] == "running"


@pytest.mark.integration
@pytest.mark.slow
def test_a_malformed_task_file_is_reported_and_the_rest_run(tmp):
    suite = tmp / "suite"
    shutil.copytree(SUITE, suite)
    broken = suite / "examples" / "terminal" / "terminal-make-dirs.json"
    task = json.loads(broken.read_text())
    task["instruction"] = 42
    broken.write_text(json.dumps(task))
    index = {"terminal": ["terminal-hello-file", "terminal-make-dirs"]}
    (suite / "test_all.json").write_text(json.dumps(index))
    done = _run(_command(tmp, f"tasks.source={suite / 'test_all.json'}",
                         "tasks.rollouts_per_task=1"), cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    assert str(broken) in done.stderr and "instruction" in done.stderr
    [result] = _results(tmp / "results" / "demo")
    assert result["task_id"] == "terminal-hello-file" and result["status"] == "success"


def test_setup_errors_exit_with_one_line_and_their_codes(tmp):
    bad_key = _run(_command(tmp, "runner.max_stepz=3"), cwd=ROOT)
    assert bad_key.returncode == 2 and "runner.max_stepz" in bad_key.stderr
    no_tasks = _run(_command(tmp, f"tasks.source={tmp / 'missing.json'}"), cwd=ROOT)
    assert no_tasks.returncode == 2
    [line] = [x for x in no_tasks.stderr.splitlines() if x.startswith("run.py: error:")]
    assert "missing.json" in line
    no_model = _run(_command(tmp, "model.scripted=false",
                             f"model_pool.state_dir={tmp / 'no-pool'}"), cwd=ROOT)
    assert no_model.returncode == 1
    [line] = [x for x in no_model.stderr.splitlines() if x.startswith("run.py: error:")]
    assert "no model endpoints" in line


@pytest.mark.integration
def test_a_second_driver_on_the_same_run_exits_naming_the_first(tmp):
    """Two drivers on one run directory would hand out the same episodes and remove each
    other's episode directories (review M1): the second one stops before anything starts."""
    run_dir = tmp / "results" / "demo"
    with DirectoryLock(run_dir, RUN_LOCK_FILE):  # this test process is the first driver
        second = _run(_command(tmp), cwd=ROOT)
    assert second.returncode == 1, second.stderr[-2000:]
    [line] = [x for x in second.stderr.splitlines() if x.startswith("run.py: error:")]
    assert f"another run.py (pid {os.getpid()} on host" in line and str(run_dir) in line
    assert not (run_dir / "results.jsonl").exists() and not (run_dir / "run.json").exists()


def _interrupt_when(args: list[str], ready: Callable[[], bool], ctrl_c: int = 1
                    ) -> tuple[int, str]:
    """Run ``args``; once ``ready()`` holds (polled while the run lives), press Ctrl-C
    ``ctrl_c`` times; returns the exit code and stderr."""
    proc = subprocess.Popen(args, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    try:
        deadline = time.monotonic() + RUN_TIMEOUT_S
        while not ready():
            assert proc.poll() is None, "the run ended before it was interrupted"
            assert time.monotonic() < deadline
            time.sleep(0.2)
        for press in range(ctrl_c):
            if press:
                time.sleep(0.5)
            proc.send_signal(signal.SIGINT)
        _, stderr = proc.communicate(timeout=RUN_TIMEOUT_S)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return proc.returncode, stderr


def _finished_tasks(run_dir: Path) -> set[str]:
    path = run_dir / "results.jsonl"
    return {r["task_id"] for r in _results(run_dir)} if path.exists() else set()


@pytest.mark.integration
@pytest.mark.slow
def test_ctrl_c_lets_running_episodes_finish_and_records_only_finished_ones(tmp):
    tasks = ["terminal-hello-file", "terminal-make-dirs", "terminal-count-lines"]
    sets = [f"tasks.task_ids={json.dumps(tasks)}"]
    run_dir = tmp / "results" / "demo"
    with slow_scripted_policy(DEMO, sets, latency_s=0.3) as slow:
        code, stderr = _interrupt_when(_command(tmp, *sets, *slow),
                                       lambda: bool(_finished_tasks(run_dir)))
    assert code == 130, stderr[-3000:]
    results = _results(run_dir)
    # The episodes that were running when Ctrl-C came finished (2 desktops), nothing new
    # started, and nothing unfinished was recorded.
    assert 1 <= len(results) < 2 * len(tasks)
    assert {r["status"] for r in results} == {"success"}
    assert json.loads((run_dir / "run.json").read_text())["status"] == "interrupted"
    assert not list((tmp / "desktops").glob("*/session.json")), "desktops left running"


@pytest.mark.integration
@pytest.mark.slow
def test_service_mode_picks_up_tasks_added_while_it_runs(tmp):
    tasks = tmp / "incoming"
    tasks.mkdir()
    example = SUITE / "examples" / "terminal"
    shutil.copy(example / "terminal-hello-file.json", tasks)
    # The scripted policy learns every demo solution up front (from examples_dir), so it
    # can answer a task that appears later.
    args = _command(tmp, f"tasks.source={tasks}", "tasks.poll_interval_s=1",
                    "tasks.rollouts_per_task=1", f"tasks.examples_dir={SUITE / 'examples'}")
    run_dir = tmp / "results" / "demo"

    def both_done() -> bool:
        done = _finished_tasks(run_dir)
        if done == {"terminal-hello-file"} and not (tasks / "terminal-make-dirs.json").exists():
            shutil.copy(example / "terminal-make-dirs.json", tasks)  # a new task arrives
        return done == {"terminal-hello-file", "terminal-make-dirs"}

    # The run must still be alive when both are done: service mode keeps polling.
    code, stderr = _interrupt_when(args, both_done)
    assert code == 130, stderr[-3000:]
    assert {r["status"] for r in _results(run_dir)} == {"success"}


@pytest.mark.integration
@pytest.mark.slow
def test_a_second_ctrl_c_cancels_running_episodes_without_recording_them(tmp):
    tasks = ["calc-add", "editor-replace-all", "terminal-hello-file"]
    sets = [f"tasks.task_ids={json.dumps(tasks)}", "tasks.rollouts_per_task=1"]
    run_dir = tmp / "results" / "demo"
    # Both desktops are mid-episode when Ctrl-C is pressed twice (a running attempt's files
    # are in the staging area until it ends).
    with slow_scripted_policy(DEMO, sets, latency_s=0.5) as slow:
        code, stderr = _interrupt_when(
            _command(tmp, *sets, *slow),
            lambda: len(list(run_dir.glob(".attempts/*/traj.jsonl"))) >= 2, ctrl_c=2)
    assert code == 130, stderr[-3000:]
    recorded = _results(run_dir) if (run_dir / "results.jsonl").exists() else []
    assert all(r["status"] == "success" for r in recorded)
    cancelled = [json.loads(p.read_text()) for p in run_dir.glob("*/*/0/episode.json")]
    cancelled = [e for e in cancelled if e["status"] == "cancelled"]
    assert cancelled, "the running episodes should have been cancelled"
    assert not {e["episode_id"] for e in cancelled} & {r["episode_id"] for r in recorded}
    assert not list((tmp / "desktops").glob("*/session.json")), "desktops left running"
