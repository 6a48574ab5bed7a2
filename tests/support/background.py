"""The benchmark harnesses the suite checks (the quick chaos run, in two lanes, and the quick
soak), started in the background when the session starts and checked by their tests, which
run last: minutes of subprocesses that mostly wait on their runs go on beside the rest of
the suite instead of after it. A test marked ``@pytest.mark.harness(key, ...)`` names the
runs it reads; ``tests/conftest.py`` starts those of the collected tests and moves the
tests to the end. ``result(key)`` waits for a run (starting it if it was not).

Each run is a process group of its own, ended by its pid if it outlives its time or the
session; its output and JSON go to a temp dir removed at the session's end."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from tests.support import REPO_ROOT

__all__ = ["CHAOS_LANES", "RUNS", "Done", "result", "start", "stop_all"]

# The quick chaos run's scenarios in two lanes of about the same wall time. Each scenario
# has its own run directory, ports, Ray cluster, tmpfs and namespaces; the two on hosts of
# their own (namespaces) share a lane. Its counts must hold under the rest's load.
CHAOS_LANES = (("model_down", "replica_killed", "single_replica_reload", "desktops_killed",
                "desktop_hangs", "storage_killed", "disk_full", "retention_disk_full"),
               ("driver_killed", "runner_killed", "second_driver", "slow_endpoint",
                "network_cut", "node_lost", "postgres_restart"))

# Each run's command (run from the repository's root); ``--json <file>`` is added.
RUNS: dict[str, list[str]] = {
    "chaos-0": ["benchmarks/chaos.py", "--quick", "--only", *CHAOS_LANES[0]],
    "chaos-1": ["benchmarks/chaos.py", "--quick", "--only", *CHAOS_LANES[1]],
    "soak": ["benchmarks/soak.py", "--quick"],
}


@dataclass
class Done:
    """A finished run: its exit code, stdout, stderr and the JSON it wrote."""

    returncode: int
    stdout: str
    stderr: str
    json: Path


@dataclass
class _Run:
    proc: subprocess.Popen[bytes]
    stdout: Path
    stderr: Path
    json: Path


_runs: dict[str, _Run] = {}
_dir: Path | None = None


def start(key: str) -> None:
    """Start run ``key`` of ``RUNS`` now, unless it was started."""
    global _dir
    if key in _runs:
        return
    if _dir is None:
        _dir = Path(tempfile.mkdtemp(prefix="cua-harness-"))
    out = _dir / key
    run = _Run(proc=None, stdout=out.with_suffix(".out"),  # type: ignore[arg-type]
               stderr=out.with_suffix(".err"), json=out.with_suffix(".json"))
    with run.stdout.open("wb") as stdout, run.stderr.open("wb") as stderr:
        run.proc = subprocess.Popen([sys.executable, *RUNS[key], "--json", str(run.json)],
                                    cwd=REPO_ROOT, stdout=stdout, stderr=stderr,
                                    start_new_session=True)
    _runs[key] = run


def result(key: str, timeout_s: float) -> Done:
    """Wait for run ``key`` (started now if it was not); past ``timeout_s`` it is ended
    (its process group, by its pid) and its exit code is that of the kill."""
    start(key)
    run = _runs[key]
    try:
        run.proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        _end(run)
    return Done(run.proc.returncode, run.stdout.read_text(errors="replace"),
                run.stderr.read_text(errors="replace"), run.json)


def stop_all() -> None:
    """End every run still going (by its process group) and remove the outputs."""
    global _dir
    for run in _runs.values():
        if run.proc.poll() is None:
            _end(run)
    _runs.clear()
    if _dir is not None:
        shutil.rmtree(_dir, ignore_errors=True)
        _dir = None


def _end(run: _Run) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(run.proc.pid, signal.SIGKILL)
    run.proc.wait()
