"""The soak run: a service run for many episodes, sampled as it ages, restarted as it ages.

    python benchmarks/soak.py [--quick | --episodes N] [--json OUT] [--keep]

``run.py`` runs as a subprocess (its own local Ray cluster, runners, storage, coordinator,
desktop pool, model client; launched as ``benchmarks/chaos.py`` launches it) in service mode
(``tasks.passes: 0``: the task set is sampled again and again) against a simulated world
(``benchmarks/sim_world.py``, in processes of its own: ``desktops.provider: static``) with
fast latencies: episodes of 2-3 steps, model and desktop answers in milliseconds, so the run's
own costs dominate. It is stopped (SIGINT: drain) once N episodes are recorded.

Every N/20 episodes it samples:

    rss_mb       resident memory of every process of the run, by group: the driver (run.py),
                 each Ray actor by its process title (ray::AgentCoordinator,
                 ray::TrajectoryRunner, ray::StorageActor, ray::DesktopPool, ...), and Ray's
                 own processes (raylet, gcs_server, dashboard, log monitor, ...) as ``ray``
    fds          open file descriptors, by the same groups
    cpu_ms/step  CPU seconds of the run's processes (the simulated world excluded) over the
                 steps done in the window since the previous sample, total and by group
    poll_s       the driver's coordinator.poll() round trip (``/status``'s ``poll_s``, read
                 every 0.2 s: each loop pass is seen), p50/p95/max over the window
    pass_s       one pass of the driver's loop without its 0.5 s sleep (the time between two
                 ``/status`` snapshots - 0.5 s: the loader's poll and bookkeeping, the
                 coordinator's poll), p50/p95/max over the window
    disk         bytes of the run directory (and per episode), of Ray's session logs (every
                 session under RAY_TMPDIR), of the index (index.db with its WAL)
    load         os.getloadavg()[0] of the machine (other work on it makes figures noisy)

and at 10%, 50% and 100% of N it kills the driver (SIGKILL; its Ray cluster goes with it, or
is ended by the harness as in chaos.py's driver_killed), reruns the same command, and
measures from the rerun's start to ``/status`` answering (the driver started: Ray, actors,
the storage's compaction of results.jsonl, the loader's read of it), to the first step and
to the first episode recorded by the rerun; then the run goes on (after the 100% restart,
until the rerun recorded a few episodes, then it is drained).

Level figures (rss, fds, disk) are compared at 10% of N and at the end (the sample at N,
before the last kill); rates (cpu, poll, pass, episodes/s) over the window ending at 10% and
the last one. Note that the restarts at 10% and 50% start fresh processes: a process's growth
at the end is what it gained since the 50% restart plus what a start loads of the whole run.
The series of every sample is in ``--json``. Nothing is asserted here (the quick run is
tests/integration/test_soak.py's); the exit code is 0 unless the harness itself failed.

Cleanup is exact (as chaos.py): the drivers run with a marker in their environment, which
every process of their Ray cluster inherits; whatever carries it is ended by pid. Ray's files
go to the soak's temp dir (``RAY_TMPDIR``), removed at the end with the run directory (unless
``--keep``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import urllib.request
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import psutil

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.chaos import MARKER_ENV, end_marked, marked  # noqa: E402
from benchmarks.sim_world import (  # noqa: E402
    DesktopSim,
    EpisodeLengths,
    Latency,
    ModelSim,
    SimWorld,
)
from cua_rollout.core.layout import (  # noqa: E402
    INDEX_FILE,
    RESULTS_FILE,
    STATUS_URL_FILE,
)

__all__ = ["FIGURES", "QUICK_EPISODES", "SAMPLES", "Size", "dist", "group_of", "main", "soak",
           "wait_steps"]

SAMPLES = 20                       # a sample every N/20 episodes
RESTARTS_AT = (0.1, 0.5, 1.0)      # kill -9 the driver at these fractions of N, rerun
QUICK_EPISODES = 1500               # CI-sized: three restarts and 20 samples, ~1 min of load
FULL_EPISODES = 100_000
STATUS_EVERY_S = 0.2               # /status read this often (the loop passes every >= 0.5 s)
LOOP_SLEEP_S = 0.5                 # runtime/driver.py's _POLL_INTERVAL_S
RAY_AGENTS = ("ray::DashboardAgent", "ray::RuntimeEnvAgent")  # seen to outlive a kill -9
ORPHAN_GRACE_S = 60.0              # a killed driver's Ray cluster is given this to end
UNMARKED_GRACE_S = 5.0             # and its processes that do not show the marker, this
EPISODES_AFTER_LAST_RESTART = 5    # the rerun at 100% goes on until it recorded these
# Groups of the run's processes (``group_of``); "ray" is Ray's own (raylet, gcs, ...).
GROUPS = ("driver", "AgentCoordinator", "TrajectoryRunner", "StorageActor", "DesktopPool",
          "other actors", "ray")
# Ray's own processes titled like actors.
RAY_ACTORS = ("DashboardAgent", "RuntimeEnvAgent")
# The figures the table and --json carry (per group for rss_mb, fds, cpu_ms_per_step).
FIGURES = ("rss_mb", "fds", "cpu_ms_per_step", "poll_s", "pass_s", "disk_mb",
           "episodes_per_s", "load")
# Episodes of 2-3 model calls; the model and the desktops answer in milliseconds.
LENGTHS = EpisodeLengths(median_steps=2.5, sigma=0.2, tail_fraction=0.0, min_steps=2,
                         max_steps=3)
# Small flat screens: ~20 KB a step on disk, so that 100,000 episodes fit on a disk.
SCREEN = (640, 360)
MODEL = ModelSim(base_latency_s=0.01, per_token_s=0.0001, prefill_s_per_1k_tokens=0.0,
                 capacity=64, lengths=LENGTHS, model="sim-ui-tars", screen_width=SCREEN[0],
                 screen_height=SCREEN[1])
DESKTOP = DesktopSim(action_latency=Latency(0.005, 0.002), reset_latency=Latency(0.01, 0.005),
                     setup_latency=Latency(0.0, 0.0), rich_screenshots=False, screenshots=4,
                     screen_width=SCREEN[0], screen_height=SCREEN[1])


@dataclass(frozen=True)
class Size:
    episodes: int
    desktops: int = 12
    concurrency: int = 12          # coordinator.max_concurrent_episodes
    episodes_per_runner: int = 6
    tasks: int = 48                # the task set sampled again and again (>= concurrency)
    start_timeout_s: float = 600.0  # longest wait for a (re)start to reach its first episode
    stall_timeout_s: float = 300.0  # longest time without a new episode


class HarnessError(RuntimeError):
    """The soak script itself could not do what it needs (not the service's fault)."""


# --------------------------------------------------------------------------- processes


def group_of(cmdline: list[str], pid: int, driver_pid: int | None) -> tuple[str, str]:
    """The group of a process of the run and its name (``ray::StorageActor``, ``raylet``).
    Ray titles an actor's worker ``ray::Class`` or ``ray::Class.method`` while it runs one."""
    if pid == driver_pid:
        return "driver", "run.py"
    first = cmdline[0] if cmdline else ""
    if first.startswith("ray::"):
        cls = first[5:].split(".", 1)[0].split()[0] if first[5:] else "?"
        if cls in GROUPS:
            return cls, f"ray::{cls}"
        if cls in RAY_ACTORS:
            return "ray", f"ray::{cls}"
        return "other actors", f"ray::{cls}"
    text = " ".join(cmdline)
    for name in ("raylet", "gcs_server", "dashboard_agent", "runtime_env", "log_monitor",
                 "monitor.py", "dashboard.py"):
        if name in text:
            return "ray", name.removesuffix(".py")
    return "ray", Path(first).name or "?"


@dataclass
class ProcSample:
    pid: int
    group: str
    name: str
    rss: int
    fds: int
    cpu_s: float
    create_time: float


def run_processes(marker: str) -> list[psutil.Process]:
    """The processes of the run: those carrying ``marker`` and their descendants. Ray's
    DashboardAgent (a child of the raylet) reads without the marker in /proc/<pid>/environ
    while it runs; without the descendants it would be missed, alive or orphaned."""
    found: dict[int, psutil.Process] = {}
    for proc in marked(marker):
        found[proc.pid] = proc
        with contextlib.suppress(psutil.Error):
            for child in proc.children(recursive=True):
                found.setdefault(child.pid, child)
    return list(found.values())


def sample_processes(marker: str, driver_pid: int | None) -> list[ProcSample]:
    out = []
    for proc in run_processes(marker):
        try:
            with proc.oneshot():
                cmdline = proc.cmdline()
                cpu = proc.cpu_times()
                group, name = group_of(cmdline, proc.pid, driver_pid)
                out.append(ProcSample(proc.pid, group, name, proc.memory_info().rss,
                                      proc.num_fds(), cpu.user + cpu.system,
                                      proc.create_time()))
        except (psutil.Error, OSError):
            continue
    return out


# --------------------------------------------------------------------------- disk


def tree_bytes(path: Path) -> tuple[int, int]:
    """Bytes allocated on disk (st_blocks) under ``path`` and how many files."""
    total = files = 0
    stack = [path]
    while stack:
        try:
            with os.scandir(stack.pop()) as it:
                for entry in it:
                    try:
                        if entry.is_dir(follow_symlinks=False):
                            stack.append(Path(entry.path))
                        else:
                            total += entry.stat(follow_symlinks=False).st_blocks * 512
                            files += 1
                    except OSError:
                        continue
        except OSError:
            continue
    return total, files


def ray_logs_bytes(ray_tmp: Path) -> int:
    """Bytes of every Ray session's logs under RAY_TMPDIR (``ray/session_*/logs``)."""
    return sum(tree_bytes(logs)[0] for logs in ray_tmp.glob("ray/session_*/logs"))


def index_bytes(run_dir: Path) -> int:
    return sum(p.stat().st_blocks * 512 for p in run_dir.glob(INDEX_FILE + "*") if p.is_file())


# --------------------------------------------------------------------------- /status


class StatusWatch:
    """Reads the driver's ``/status`` every ``STATUS_EVERY_S`` from a thread: the last
    snapshot, and each new one's ``poll_s`` and time since the one before (a loop pass)."""

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = run_dir
        self.last: dict[str, Any] = {}
        self.polls: list[float] = []
        self.passes: list[float] = []
        self.errors = 0
        self._url: str | None = None
        self._prev_t: float | None = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="soak-status", daemon=True)

    def start(self) -> StatusWatch:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def forget(self) -> None:
        """A new driver: its URL is read again, the old snapshot dropped."""
        with self._lock:
            self._url = None
            self._prev_t = None
            self.last = {}

    def take_window(self) -> tuple[list[float], list[float]]:
        """The poll and pass times seen since the last call."""
        with self._lock:
            polls, passes = self.polls, self.passes
            self.polls, self.passes = [], []
        return polls, passes

    def _loop(self) -> None:
        while not self._stop.wait(STATUS_EVERY_S):
            try:
                self._read()
            except (OSError, ValueError):
                self.errors += 1

    def _read(self) -> None:
        if self._url is None:
            path = self.run_dir / STATUS_URL_FILE
            if not path.exists():
                return
            self._url = path.read_text().strip()
        with urllib.request.urlopen(self._url + "/status", timeout=5) as reply:
            body = json.loads(reply.read())
        if "episodes" not in body:  # "starting": before the loop's first pass
            return
        with self._lock:
            t = float(body["t"])
            if t != (self.last.get("t") if self.last else None):
                if self._prev_t is not None:
                    self.passes.append(t - self._prev_t - LOOP_SLEEP_S)
                    self.polls.append(float(body["poll_s"]))
                self._prev_t = t
            self.last = body


# --------------------------------------------------------------------------- the run


def write_tasks(path: Path, n: int) -> None:
    with path.open("w") as f:
        for i in range(n):
            f.write(json.dumps({"id": f"t{i:04d}", "domain": "soak",
                                "instruction": f"soak task {i}", "config": [],
                                "evaluator": {"func": "infeasible"}}) + "\n")


def make_config(size: Size, work: Path, world: SimWorld) -> Path:
    tasks = work / "tasks.jsonl"
    write_tasks(tasks, size.tasks)
    config = {
        "run": {"name": "soak", "output_dir": str(work / "results")},
        "ray": {"num_cpus": 2, "include_dashboard": False},
        "tasks": {"source": str(tasks), "passes": 0},
        "model": {"name": MODEL.model, "endpoints": world.model_urls, "retries": 2,
                  "request_timeout_s": 20, "connect_timeout_s": 2},
        "model_pool": {"state_dir": str(work / "no-fleet")},
        "desktops": {"provider": "static", "count": size.desktops, "warm_spares": 0,
                     "screen_width": SCREEN[0], "screen_height": SCREEN[1],
                     "static": {"urls": world.desktop_urls,
                                "reset_command": world.reset_command},
                     "verify": {"enabled": False},  # simulated: no real commands to run
                     "lease_timeout_s": 20, "request_timeout_s": 10, "reset_timeout_s": 20,
                     "download_cache_dir": str(work / "cache")},
        "coordinator": {"max_concurrent_episodes": size.concurrency,
                        "episodes_per_runner": size.episodes_per_runner,
                        "runner_num_cpus": 0},
        "runner": {"action_pause_s": 0, "wait_s": 0, "max_steps": 8, "episode_timeout_s": 120,
                   "evaluation_timeout_s": 30},
        "monitoring": {"progress_bar": False, "ray_metrics": False,
                       "status_address": "127.0.0.1"},
    }
    path = work / "soak.yaml"
    path.write_text(json.dumps(config, indent=1))
    return path


@dataclass
class Soak:
    size: Size
    work: Path
    config: Path
    marker: str
    run_dir: Path
    driver: subprocess.Popen[bytes] | None = None
    logs: list[Path] = field(default_factory=list)
    exit_codes: list[int | None] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    samples: list[dict[str, Any]] = field(default_factory=list)
    restarts: list[dict[str, Any]] = field(default_factory=list)
    # The baseline of the current window: CPU per pid, steps, episodes, time.
    _cpu: dict[int, float] = field(default_factory=dict)
    _steps: int = 0
    _done: int = 0
    _t: float = 0.0

    @property
    def ray_tmp(self) -> Path:
        return self.work / "r"

    def start(self, label: str) -> float:
        """Start ``run.py`` on the config; returns its start (monotonic)."""
        log = self.work / f"driver-{len(self.logs)}-{label}.log"
        with contextlib.suppress(FileNotFoundError):
            (self.run_dir / STATUS_URL_FILE).unlink()  # a killed driver's, naming a dead port
        t0 = time.monotonic()
        with log.open("wb") as out:
            env = {**os.environ, MARKER_ENV: self.marker, "RAY_TMPDIR": str(self.ray_tmp)}
            self.driver = subprocess.Popen(
                [sys.executable, str(ROOT / "run.py"), "--config", str(self.config)],
                cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                start_new_session=True, env=env)
        self.logs.append(log)
        return t0

    def tail(self, lines: int = 30) -> str:
        if not self.logs:
            return ""
        text = self.logs[-1].read_text(errors="replace")
        return f"===== {self.logs[-1].name}\n" + "\n".join(text.splitlines()[-lines:])

    def alive(self) -> bool:
        return self.driver is not None and self.driver.poll() is None

    def check_alive(self, what: str) -> None:
        if not self.alive():
            assert self.driver is not None
            raise HarnessError(f"the driver exited ({self.driver.returncode}) {what}\n"
                               f"{self.tail()}")

    def baseline(self, status: StatusWatch) -> None:
        """A new window starts now (after a start: the start-up is not in any window)."""
        procs = sample_processes(self.marker, self.driver.pid if self.driver else None)
        self._cpu = {p.pid: p.cpu_s for p in procs}
        last = status.last
        self._steps = int(last.get("steps") or 0)
        self._done = int((last.get("episodes") or {}).get("done") or 0)
        self._t = time.monotonic()
        status.take_window()

    @property
    def window_start_steps(self) -> int:
        """The driver's steps when the current window started."""
        return self._steps

    def sample(self, status: StatusWatch, k: int) -> dict[str, Any]:
        """Sample ``k`` (of SAMPLES): levels now, rates over the window since the baseline."""
        driver_pid = self.driver.pid if self.driver else None
        procs = sample_processes(self.marker, driver_pid)
        last = status.last
        done = int(last["episodes"]["done"])
        steps = int(last.get("steps") or 0)
        now = time.monotonic()
        polls, passes = status.take_window()
        d_steps = steps - self._steps
        cpu_by_group = dict.fromkeys(GROUPS, 0.0)
        for p in procs:
            cpu_by_group[p.group] += p.cpu_s - self._cpu.get(p.pid, 0.0)
        rss = dict.fromkeys(GROUPS, 0.0)
        fds = dict.fromkeys(GROUPS, 0)
        count = dict.fromkeys(GROUPS, 0)
        for p in procs:
            rss[p.group] += p.rss / 2**20
            fds[p.group] += p.fds
            count[p.group] += 1
        run_bytes, run_files = tree_bytes(self.run_dir)
        results = self.run_dir / RESULTS_FILE
        out = {
            "k": k, "at": k / SAMPLES, "episodes": done, "steps_in_window": d_steps,
            "window_s": round(now - self._t, 1),
            "episodes_per_s": round((done - self._done) / max(now - self._t, 1e-9), 2),
            "rss_mb": {g: round(v, 1) for g, v in rss.items()} | {
                "total": round(sum(rss.values()), 1)},
            "fds": fds | {"total": sum(fds.values())},
            "processes": count,
            "cpu_ms_per_step": ({g: round(1000 * v / d_steps, 3)
                                 for g, v in cpu_by_group.items()}
                                | {"total": round(1000 * sum(cpu_by_group.values()) / d_steps,
                                                  3)}) if d_steps > 0 else None,
            "poll_s": dist(polls),
            "pass_s": dist(passes),
            "disk_mb": {"run_dir": round(run_bytes / 2**20, 2),
                        "run_dir_kb_per_episode": round(run_bytes / 1024 / max(done, 1), 2),
                        "run_dir_files": run_files,
                        "results_jsonl": round(results.stat().st_size / 2**20, 3)
                        if results.exists() else 0.0,
                        "ray_logs": round(ray_logs_bytes(self.ray_tmp) / 2**20, 2),
                        "index": round(index_bytes(self.run_dir) / 2**20, 2)},
            "load": round(os.getloadavg()[0], 2),
            "per_process": [{"pid": p.pid, "name": p.name, "rss_mb": round(p.rss / 2**20, 1),
                             "fds": p.fds, "cpu_s": round(p.cpu_s, 2)} for p in procs],
            "status_errors": status.errors,
        }
        self.samples.append(out)
        self.baseline(status)
        return out

    def kill_driver(self) -> dict[str, Any]:
        """SIGKILL the driver; wait for its Ray cluster to end (then end what is left)."""
        assert self.driver is not None
        cluster = run_processes(self.marker)
        os.kill(self.driver.pid, signal.SIGKILL)
        self.exit_codes.append(self.driver.wait())
        t0 = time.monotonic()
        while marked(self.marker) and time.monotonic() - t0 < ORPHAN_GRACE_S:
            time.sleep(0.5)
        left = end_marked(self.marker)
        # Ray's own agents are known to outlive a killed driver (measured as "orphans",
        # below); anything else of the run still there is a finding.
        others = [p for p in left if not any(a in p for a in RAY_AGENTS)]
        if others:
            self.notes.append(f"{len(others)} process(es) of the killed driver's Ray outlived "
                              f"it by {ORPHAN_GRACE_S:.0f} s (killed): {others}")
        # What is left of its descendants (Ray's DashboardAgent, seen to linger ~2 min with
        # the init process as parent) is given a few seconds more, then ended by the harness:
        # "orphans" in the restart's row.
        deadline = time.monotonic() + UNMARKED_GRACE_S
        while any(_running(p) for p in cluster) and time.monotonic() < deadline:
            time.sleep(0.5)
        gone_s = round(time.monotonic() - t0, 1)
        orphans = end_processes(cluster)
        return {"cluster_gone_s": gone_s, "orphans": left + orphans}

    def restart(self, status: StatusWatch, at: float) -> dict[str, Any]:
        """Kill -9 the driver, rerun it, time its way back to work."""
        recorded = int(status.last["episodes"]["done"])
        results = self.run_dir / RESULTS_FILE
        row: dict[str, Any] = {"at": at, "episodes_recorded": recorded,
                               "results_jsonl_mb": round(results.stat().st_size / 2**20, 2),
                               **self.kill_driver()}
        status.forget()
        t0 = self.start(f"rerun-{round(100 * at)}")
        deadline = t0 + self.size.start_timeout_s
        marks = {"status_s": None, "first_step_s": None, "first_episode_s": None}
        while marks["first_episode_s"] is None:
            self.check_alive(f"before its first episode after the restart at {at:.0%}")
            if time.monotonic() > deadline:
                raise HarnessError(f"the rerun at {at:.0%} recorded no episode within "
                                   f"{self.size.start_timeout_s:.0f} s\n{self.tail()}")
            last = status.last
            now = round(time.monotonic() - t0, 2)
            if last and marks["status_s"] is None:
                marks["status_s"] = now
            if last and last.get("steps") and marks["first_step_s"] is None:
                marks["first_step_s"] = now
            if last and last["episodes"]["done_this_start"] >= 1:
                marks["first_episode_s"] = now
                marks["first_step_s"] = marks["first_step_s"] or now
            time.sleep(0.05)
        row.update(marks)
        row["load"] = round(os.getloadavg()[0], 2)
        self.restarts.append(row)
        return row

    def drain(self) -> int | None:
        """SIGINT (run.py drains: running episodes finish) and wait for the exit."""
        assert self.driver is not None
        os.kill(self.driver.pid, signal.SIGINT)
        try:
            code: int | None = self.driver.wait(timeout=180)
        except subprocess.TimeoutExpired:
            self.notes.append("the driver did not drain within 180 s: killed")
            os.kill(self.driver.pid, signal.SIGKILL)
            self.driver.wait()
            code = None
        self.exit_codes.append(code)
        if code != 130:
            self.notes.append(f"the drained driver exited {code} (run.py's interrupted is "
                              f"130)\n{self.tail()}")
        return code


def dist(values: list[float]) -> dict[str, float] | None:
    if not values:
        return None
    ordered = sorted(values)
    return {"n": len(ordered), "p50": round(statistics.median(ordered), 4),
            "p95": round(ordered[min(len(ordered) - 1, math.ceil(0.95 * len(ordered)) - 1)], 4),
            "max": round(ordered[-1], 4), "mean": round(statistics.fmean(ordered), 4)}


def wait_for(soak: Soak, status: StatusWatch, episodes: int) -> None:
    """Wait until ``episodes`` are recorded (the driver must stay alive and progress)."""
    last_done, last_change = -1, time.monotonic()
    while True:
        soak.check_alive(f"before {episodes} episodes were recorded")
        done = int((status.last.get("episodes") or {}).get("done") or 0)
        if done >= episodes:
            return
        if done != last_done:
            last_done, last_change = done, time.monotonic()
        elif time.monotonic() - last_change > soak.size.stall_timeout_s:
            raise HarnessError(f"no episode recorded for {soak.size.stall_timeout_s:.0f} s "
                               f"at {done} (waiting for {episodes})\n{soak.tail()}")
        time.sleep(0.1)


def wait_steps(soak: Soak, status: StatusWatch) -> None:
    """Wait until the driver's /status counts a step since the window started."""
    deadline = time.monotonic() + soak.size.stall_timeout_s
    while int(status.last.get("steps") or 0) <= soak.window_start_steps:
        soak.check_alive("before a step of the window")
        if time.monotonic() > deadline:
            raise HarnessError(f"no step counted for {soak.size.stall_timeout_s:.0f} s\n"
                               f"{soak.tail()}")
        time.sleep(0.1)


def soak(size: Size, keep: bool = False, progress: bool = True) -> dict[str, Any]:
    """Run the soak; everything measured (``error`` and ``traceback`` if the harness
    failed)."""
    work = Path(tempfile.mkdtemp(prefix="soak-"))
    started = time.monotonic()
    out: dict[str, Any] = {"size": asdict(size), "model": asdict(MODEL),
                           "desktop": asdict(DESKTOP), "work": str(work) if keep else None}
    run: Soak | None = None
    try:
        with contextlib.ExitStack() as stack:
            if not keep:
                stack.callback(shutil.rmtree, work, True)
            world = SimWorld(desktops=size.desktops, model_servers=1, desktop=DESKTOP,
                             model=MODEL)
            stack.callback(world.stop)
            world.start()
            config = make_config(size, work, world)
            run = Soak(size, work, config, f"soak-{uuid.uuid4().hex[:12]}",
                       work / "results" / "soak")
            stack.callback(_end_run, run)
            status = StatusWatch(run.run_dir).start()
            stack.callback(status.stop)
            _drive(run, status, size, progress)
            out["sim_cpu_s"] = {k: round(v, 1) for k, v in world.cpu_s().items()}
        out["wall_s"] = round(time.monotonic() - started, 1)
        return out
    except Exception as exc:
        out["error"] = f"{type(exc).__name__}: {exc}"
        out["traceback"] = traceback.format_exc()[-4000:]
        return out
    finally:
        if run is not None:
            out.update(samples=run.samples, restarts=run.restarts, notes=run.notes,
                       exit_codes=run.exit_codes)


def _drive(run: Soak, status: StatusWatch, size: Size, progress: bool) -> None:
    n = size.episodes
    t0 = run.start("driver")
    wait_for(run, status, 1)
    first = time.monotonic() - t0
    if progress:
        print(f"  started: first episode after {first:.1f} s", file=sys.stderr, flush=True)
    run.baseline(status)
    restart_ks = {round(a * SAMPLES) for a in RESTARTS_AT}
    for k in range(1, SAMPLES + 1):
        wait_for(run, status, math.ceil(k * n / SAMPLES))
        # Steps in every window: after a restart the rerun can start past the next sample's
        # count (a small N, a loaded machine), and its /status counts steps a while later
        # than episodes.
        wait_steps(run, status)
        s = run.sample(status, k)
        if progress:
            print(f"  sample {k}/{SAMPLES}: {s['episodes']} episodes, "
                  f"{s['episodes_per_s']}/s, rss {s['rss_mb']['total']} MB, cpu "
                  f"{(s['cpu_ms_per_step'] or {}).get('total')} ms/step, load {s['load']}",
                  file=sys.stderr, flush=True)
        if k in restart_ks:
            r = run.restart(status, k / SAMPLES)
            if progress:
                print(f"  restart at {r['at']:.0%} ({r['episodes_recorded']} episodes): "
                      f"status {r['status_s']} s, first step {r['first_step_s']} s, first "
                      f"episode {r['first_episode_s']} s", file=sys.stderr, flush=True)
            if k == SAMPLES:
                wait_for(run, status, int(status.last["episodes"]["done"])
                         + EPISODES_AFTER_LAST_RESTART)
            run.baseline(status)
    run.drain()


def _running(proc: psutil.Process) -> bool:
    """``proc`` (the very process: pid and start time) still runs."""
    with contextlib.suppress(psutil.Error):
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    return False


def end_processes(procs: list[psutil.Process]) -> list[str]:
    """SIGKILL those of ``procs`` still running (``is_running`` checks the start time too,
    so a reused pid is left alone); what was killed ("pid name")."""
    killed = []
    for proc in procs:
        if _running(proc):
            with contextlib.suppress(psutil.Error):
                name = f"{proc.pid} {proc.name()}"
                proc.kill()
                killed.append(name)
    return killed


def _end_run(run: Soak) -> None:
    cluster = run_processes(run.marker)
    if run.driver is not None and run.driver.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(run.driver.pid, signal.SIGKILL)
        run.driver.wait()
    deadline = time.monotonic() + 15.0
    while any(_running(p) for p in cluster) and time.monotonic() < deadline:
        time.sleep(0.5)
    left = end_marked(run.marker, grace_s=15.0) + end_processes(cluster)
    if left:
        run.notes.append(f"processes of the run outlived its driver (killed): {left}")


# --------------------------------------------------------------------------- output


def _at(samples: list[dict[str, Any]], k: int) -> dict[str, Any] | None:
    return next((s for s in samples if s["k"] == k), None)


def rows(result: dict[str, Any]) -> list[tuple[str, Any, Any]]:
    """(figure, at 10%, at the end) for the table."""
    samples = result.get("samples") or []
    first, end = _at(samples, round(0.1 * SAMPLES)), _at(samples, SAMPLES)
    if first is None or end is None:
        return []
    out: list[tuple[str, Any, Any]] = []

    def get(s: dict[str, Any], *path: str) -> Any:
        v: Any = s
        for p in path:
            v = v.get(p) if isinstance(v, dict) else None
        return v

    def add(label: str, *path: str) -> None:
        out.append((label, get(first, *path), get(end, *path)))

    for g in (*GROUPS, "total"):
        n = "" if g == "total" else f" (x{end['processes'].get(g, 0)})"
        add(f"rss MB {g}{n}", "rss_mb", g)
    for g in (*GROUPS, "total"):
        add(f"fds {g}", "fds", g)
    for g in (*GROUPS, "total"):
        add(f"cpu ms/step {g}", "cpu_ms_per_step", g)
    for q in ("p50", "p95", "max"):
        add(f"driver poll_s {q}", "poll_s", q)
    for q in ("p50", "p95", "max"):
        add(f"driver pass_s {q} (no sleep)", "pass_s", q)
    for key in ("run_dir", "run_dir_kb_per_episode", "results_jsonl", "ray_logs", "index"):
        add(f"disk {key}" + ("" if "per" in key else " MB"), "disk_mb", key)
    add("episodes/s", "episodes_per_s")
    add("episodes", "episodes")
    add("load (1 min)", "load")
    return out


# Rows that grow by nature (totals of what is recorded) or are not the run's: their ratio is
# shown, never marked red.
CUMULATIVE = ("episodes", "load", "disk run_dir MB", "disk results_jsonl", "disk ray_logs",
              "disk index")


def print_table(result: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(width=140)
    size = result["size"]
    table = Table(title=f"soak: {size['episodes']:,} episodes, {size['concurrency']} at once, "
                  f"{result.get('wall_s', 0):.0f} s",
                  caption="levels at the samples, rates over the window before them; red: "
                  "more than 10% apart")
    for column in ("figure", "at 10%", "at end", "end / 10%"):
        table.add_column(column, justify="left" if column == "figure" else "right")
    for label, a, b in rows(result):
        ratio = ""
        if isinstance(a, int | float) and isinstance(b, int | float) and a:
            r = b / a
            judged = not label.startswith(CUMULATIVE)
            ratio = f"[red]{r:.2f}" if judged and abs(r - 1) > 0.1 else f"{r:.2f}"
        table.add_row(label, _fmt(a), _fmt(b), ratio)
    console.print(table)
    restarts = Table(title="restart: kill -9 the driver, rerun; seconds from the rerun's start")
    for column in ("at", "episodes recorded", "results.jsonl MB", "cluster gone s",
                   "orphans", "/status s", "first step s", "first episode s", "load"):
        restarts.add_column(column, justify="right")
    for r in result.get("restarts") or []:
        restarts.add_row(f"{r['at']:.0%}", f"{r['episodes_recorded']:,}",
                         str(r["results_jsonl_mb"]), str(r["cluster_gone_s"]),
                         " ".join(o.split(" ", 1)[-1] for o in r["orphans"]) or "0",
                         str(r["status_s"]), str(r["first_step_s"]),
                         str(r["first_episode_s"]), str(r["load"]))
    console.print(restarts)
    for note in result.get("notes") or []:
        console.print(f"  note: {note}", markup=False)


def _fmt(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:,.4g}" if abs(v) < 1000 else f"{v:,.0f}"
    return f"{v:,}" if isinstance(v, int) else str(v)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true",
                        help=f"{QUICK_EPISODES:,} episodes (CI-sized, ~1.5 min)")
    parser.add_argument("--episodes", type=int,
                        help=f"episodes to run (default {FULL_EPISODES:,})")
    parser.add_argument("--json", type=Path, help="write every figure here")
    parser.add_argument("--keep", action="store_true",
                        help="keep the temp dir (run dir, Ray's logs, driver logs) to look at")
    args = parser.parse_args(argv)
    if args.quick and args.episodes is not None:
        parser.error("--quick and --episodes: choose one")
    n = args.episodes if args.episodes is not None else (
        QUICK_EPISODES if args.quick else FULL_EPISODES)
    if n < SAMPLES:
        parser.error(f"--episodes must be at least {SAMPLES} (a sample every N/{SAMPLES})")
    result = soak(Size(episodes=n), keep=args.keep)
    result["mode"] = "quick" if args.quick else "episodes"
    if "error" in result:
        print(result["traceback"], file=sys.stderr)
    print_table(result)
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=1))
    return 1 if "error" in result else 0


if __name__ == "__main__":
    raise SystemExit(main())
