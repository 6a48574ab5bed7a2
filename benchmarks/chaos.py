"""The chaos run: inject one fault at a time into a real rollout and count what it cost.

    python benchmarks/chaos.py [--quick] [--json OUT] [--only NAME ...]

Each scenario runs ``run.py`` as a subprocess (a real local Ray cluster, runners, storage,
coordinator and model client) against simulated desktops (``benchmarks/sim_world.py``,
``desktops.provider: static``) and simulated model replicas published in a run_model.py-style
``endpoints.json`` (each replica its own process, so it can be killed, drained and brought
back like run_model.py does), injects its fault mid-run, reruns the driver when the fault
stops the run (as an operator would), and then checks the run directory:

    expected             episodes of the task set
    recorded             distinct episodes in the final results.jsonl
    lost                 expected - recorded
    duplicated           results.jsonl lines beyond one per episode
    misrecorded          lines whose episode directory disagrees (episode.json missing or with
                         another attempt/status/reward, result.txt differing, no traj.jsonl)
    outage_infra_errors  infra_error lines (every injected fault is recoverable: all count)
    recover_s            seconds from the end of the fault to the next episode recorded

The target is every count 0. Figures are printed and written (``--json``); nothing is
asserted here (tests/integration/test_chaos.py runs ``--quick``).

Every process, mount and directory a scenario starts is ended and removed by pid or path.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.sim_world import DesktopSim, EpisodeLengths, ModelSim, SimWorld  # noqa: E402
from rollout.fleet.state import ENDPOINTS_FILE  # noqa: E402
from rollout.layout import RESULTS_FILE  # noqa: E402

SCENARIOS = ("model_down", "replica_killed", "single_replica_reload", "desktops_killed",
             "desktop_hangs", "storage_killed", "disk_full", "driver_killed", "runner_killed",
             "second_driver")


@dataclass(frozen=True)
class Size:
    tasks: int
    outage_s: float          # how long a model outage lasts
    reload_s: float          # how long a replica is away for a reload
    hang_s: float            # how long a desktop hangs
    run_timeout_s: float     # one driver's longest run


QUICK = Size(tasks=12, outage_s=8.0, reload_s=4.0, hang_s=10.0, run_timeout_s=240.0)
FULL = Size(tasks=40, outage_s=60.0, reload_s=20.0, hang_s=45.0, run_timeout_s=900.0)
# Short episodes (2-5 model calls) keep a scenario to tens of seconds.
LENGTHS = EpisodeLengths(median_steps=3.0, sigma=0.3, tail_fraction=0.0, min_steps=2,
                         max_steps=5)
MODEL = ModelSim(base_latency_s=0.3, per_token_s=0.002, lengths=LENGTHS, model="sim-ui-tars")
DESKTOP = DesktopSim(rich_screenshots=False)


# --------------------------------------------------------------------------- the world


class Replicas:
    """Model replicas published like run_model.py does: each a SimWorld process of its own,
    listed in ``endpoints.json`` with its health and drain state."""

    def __init__(self, state_dir: Path, n: int) -> None:
        self.state_dir = state_dir
        state_dir.mkdir(parents=True, exist_ok=True)
        self.worlds: list[SimWorld | None] = [None] * n
        self.flags: list[dict[str, Any]] = [{"healthy": True, "draining": False,
                                             "model_version": "v1"} for _ in range(n)]
        for i in range(n):
            self.start(i)

    def url(self, i: int) -> str | None:
        world = self.worlds[i]
        return world.model_urls[0] if world is not None else None

    def publish(self) -> None:
        endpoints = [{"url": self.url(i), **self.flags[i]} for i in range(len(self.worlds))
                     if self.url(i) is not None]
        tmp = self.state_dir / f".{ENDPOINTS_FILE}.tmp"
        tmp.write_text(json.dumps({"model": MODEL.model, "endpoints": endpoints}))
        os.replace(tmp, self.state_dir / ENDPOINTS_FILE)

    def start(self, i: int, version: str | None = None) -> None:
        self.worlds[i] = SimWorld(model_servers=1, model=MODEL).start()
        self.flags[i].update(healthy=True, draining=False)
        if version:
            self.flags[i]["model_version"] = version
        self.publish()

    def kill(self, i: int, *, publish: bool = True) -> None:
        """SIGKILL the replica's process (requests in flight are cut), as a crash would."""
        world = self.worlds[i]
        if world is None:
            return
        for pid in world.pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        world.stop()
        self.worlds[i] = None
        if publish:
            self.publish()

    def stop(self) -> None:
        for i in range(len(self.worlds)):
            self.kill(i, publish=False)


@dataclass
class Run:
    """One scenario's run directory, config and driver processes."""

    work: Path
    run_dir: Path
    config: Path
    size: Size
    log: Path
    drivers: list[subprocess.Popen[bytes]] = field(default_factory=list)

    def start(self) -> subprocess.Popen[bytes]:
        out = self.log.open("ab")
        proc = subprocess.Popen([sys.executable, str(ROOT / "run.py"), "--config",
                                 str(self.config)], cwd=ROOT, stdout=out,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True)
        out.close()
        self.drivers.append(proc)
        return proc

    def wait(self, proc: subprocess.Popen[bytes]) -> int:
        try:
            return proc.wait(timeout=self.size.run_timeout_s)
        except subprocess.TimeoutExpired:
            end_tree(proc.pid)
            return -1

    def lines(self) -> list[dict[str, Any]]:
        path = self.run_dir / RESULTS_FILE
        if not path.exists():
            return []
        out = []
        for raw in path.read_text(errors="replace").splitlines():
            with contextlib.suppress(ValueError):
                out.append(json.loads(raw))
        return out

    def until(self, predicate: Callable[[], bool], timeout_s: float, what: str) -> None:
        deadline = time.monotonic() + timeout_s
        while not predicate():
            if time.monotonic() > deadline:
                raise TimeoutError(f"{what} not reached within {timeout_s:.0f} s")
            if self.drivers and self.drivers[-1].poll() is not None:
                raise RuntimeError(f"the driver exited ({self.drivers[-1].returncode}) before "
                                   f"{what}; see {self.log}")
            time.sleep(0.1)

    def recorded_after(self, count: int, timeout_s: float) -> float:
        """Seconds until results.jsonl has more than ``count`` lines (or the run ends)."""
        t0 = time.monotonic()
        deadline = t0 + timeout_s
        while len(self.lines()) <= count and time.monotonic() < deadline:
            if self.drivers and self.drivers[-1].poll() is not None:
                break
            time.sleep(0.1)
        return round(time.monotonic() - t0, 1)

    def actor_pid(self, kind: str) -> int:
        """The pid of one of this run's Ray actors (``ray::StorageActor`` ...): a descendant
        of this scenario's driver, so no other Ray on the machine is touched."""
        driver = psutil.Process(self.drivers[-1].pid)
        for proc in driver.children(recursive=True):
            with contextlib.suppress(psutil.Error):
                if proc.cmdline() and proc.cmdline()[0].startswith(f"ray::{kind}"):
                    return proc.pid
        raise LookupError(f"no ray::{kind} process under driver {driver.pid}")


def end_tree(pid: int) -> None:
    """End a process and its descendants (a driver and the Ray cluster it started)."""
    with contextlib.suppress(psutil.Error):
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
        for p in procs:
            with contextlib.suppress(psutil.Error):
                p.kill()
        psutil.wait_procs(procs, timeout=10)


def write_tasks(path: Path, n: int) -> None:
    with path.open("w") as f:
        for i in range(n):
            f.write(json.dumps({"id": f"t{i:04d}", "domain": "chaos",
                                "instruction": f"chaos task {i}", "config": [],
                                "evaluator": {"func": "infeasible"}}) + "\n")


@contextlib.contextmanager
def scenario_run(name: str, size: Size, desktops: list[SimWorld], replicas: Replicas,
                 work: Path, run_root: Path | None = None, **sets: Any) -> Iterator[Run]:
    run_root = run_root or work / "results"
    tasks = work / "tasks.jsonl"
    write_tasks(tasks, size.tasks)
    urls = [u for w in desktops for u in w.desktop_urls]
    config = {
        "run": {"name": name, "output_dir": str(run_root)},
        "ray": {"num_cpus": 2, "include_dashboard": False},
        "tasks": {"source": str(tasks)},
        "model": {"name": MODEL.model, "retries": 2, "backoff_initial_s": 0.2,
                  "backoff_max_s": 1.0, "request_timeout_s": 20, "connect_timeout_s": 2,
                  "endpoint_failures_to_eject": 1, "reprobe_interval_s": 1},
        "model_pool": {"state_dir": str(replicas.state_dir)},
        "desktops": {"provider": "static", "count": len(urls), "warm_spares": 0,
                     "static": {"urls": urls, "reset_command": desktops[0].reset_command,
                                "retry_quarantined_s": 5},
                     "lease_timeout_s": 20, "request_timeout_s": 10, "reset_timeout_s": 10,
                     "health_interval_s": 2},
        "coordinator": {"max_concurrent_episodes": 6, "episodes_per_runner": 3,
                        "runner_num_cpus": 0, "outage_backoff_initial_s": 0.5,
                        "outage_backoff_max_s": 2},
        "runner": {"action_pause_s": 0, "max_steps": 8, "episode_timeout_s": 120,
                   "evaluation_timeout_s": 30},
        "monitoring": {"progress_bar": False, "ray_metrics": False,
                       "metrics_interval_s": 2},
    }
    for key, value in sets.items():
        node = config
        *path, last = key.split("__")
        for part in path:
            node = node.setdefault(part, {})
        node[last] = value
    path = work / f"{name}.yaml"
    path.write_text(json.dumps(config))
    run = Run(work, run_root / name, path, size, work / f"{name}.log")
    try:
        yield run
    finally:
        for proc in run.drivers:
            if proc.poll() is None:
                end_tree(proc.pid)


# --------------------------------------------------------------------------- scenarios


def model_down(run: Run, replicas: Replicas, desktops: list[SimWorld]) -> float | None:
    proc = run.start()
    run.until(lambda: len(run.lines()) >= 2, 120, "2 episodes recorded")
    for i in range(len(replicas.worlds)):
        replicas.kill(i, publish=False)  # run_model.py not told: connections are refused
    time.sleep(run.size.outage_s)
    before = len(run.lines())
    for i in range(len(replicas.worlds)):
        replicas.start(i)
    recover = run.recorded_after(before, 120)
    run.wait(proc)
    return recover


def replica_killed(run: Run, replicas: Replicas, desktops: list[SimWorld]) -> float | None:
    proc = run.start()
    run.until(lambda: len(run.lines()) >= 2, 120, "2 episodes recorded")
    replicas.kill(0, publish=False)  # mid-request: its requests are cut
    time.sleep(2)
    replicas.publish()  # the supervisor notices and stops listing it
    recover = run.recorded_after(len(run.lines()), 120)
    replicas.start(0)
    run.wait(proc)
    return recover


def single_replica_reload(run: Run, replicas: Replicas, desktops: list[SimWorld]
                          ) -> float | None:
    proc = run.start()
    run.until(lambda: len(run.lines()) >= 2, 120, "2 episodes recorded")
    replicas.flags[0]["draining"] = True  # what run_model.py reload publishes first
    replicas.publish()
    time.sleep(1.0)
    replicas.kill(0)
    time.sleep(run.size.reload_s)
    before = len(run.lines())
    replicas.start(0, version="v2")
    recover = run.recorded_after(before, 120)
    run.wait(proc)
    return recover


def desktops_killed(run: Run, replicas: Replicas, desktops: list[SimWorld]) -> float | None:
    proc = run.start()
    run.until(lambda: len(run.lines()) >= 2, 120, "2 episodes recorded")
    before = len(run.lines())
    for pid in desktops[1].pids:  # half the desktops, mid-episode, for good
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    recover = run.recorded_after(before, 120)
    run.wait(proc)
    return recover


def desktop_hangs(run: Run, replicas: Replicas, desktops: list[SimWorld]) -> float | None:
    proc = run.start()
    run.until(lambda: len(run.lines()) >= 2, 120, "2 episodes recorded")
    stopped = list(desktops[1].pids)
    for pid in stopped:  # every request in flight there (an /execute among them) hangs
        os.kill(pid, signal.SIGSTOP)
    time.sleep(run.size.hang_s)
    for pid in stopped:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)
    recover = run.recorded_after(len(run.lines()), 120)
    run.wait(proc)
    return recover


def _kill_actor_then_rerun(run: Run, kind: str) -> float | None:
    proc = run.start()
    run.until(lambda: len(run.lines()) >= 2, 120, "2 episodes recorded")
    os.kill(run.actor_pid(kind), signal.SIGKILL)
    code = run.wait(proc)
    if code == 0:
        return 0.0
    # The run stopped and said why: the operator reruns the same command.
    before = len(run.lines())
    proc = run.start()
    recover = run.recorded_after(before, 180)
    run.wait(proc)
    return recover


def storage_killed(run: Run, replicas: Replicas, desktops: list[SimWorld]) -> float | None:
    return _kill_actor_then_rerun(run, "StorageActor")


def runner_killed(run: Run, replicas: Replicas, desktops: list[SimWorld]) -> float | None:
    proc = run.start()
    run.until(lambda: len(run.lines()) >= 2, 120, "2 episodes recorded")
    before = len(run.lines())
    os.kill(run.actor_pid("TrajectoryRunner"), signal.SIGKILL)
    recover = run.recorded_after(before, 120)
    run.wait(proc)
    return recover


def driver_killed(run: Run, replicas: Replicas, desktops: list[SimWorld]) -> float | None:
    proc = run.start()
    run.until(lambda: len(run.lines()) >= 2, 120, "2 episodes recorded")
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    end_tree(proc.pid)
    time.sleep(2)  # Ray's reaper ends the cluster of a driver that died
    before = len(run.lines())
    proc = run.start()
    recover = run.recorded_after(before, 180)
    run.wait(proc)
    return recover


def second_driver(run: Run, replicas: Replicas, desktops: list[SimWorld]) -> float | None:
    proc = run.start()
    run.until(lambda: len(run.lines()) >= 1, 120, "1 episode recorded")
    second = run.start()
    code = run.wait(second)
    text = run.log.read_text(errors="replace")
    if code != 1 or "another run.py" not in text:
        raise RuntimeError(f"the second driver was not refused (exit {code}); see {run.log}")
    run.drivers.remove(second)
    run.wait(proc)
    return 0.0


def disk_full(run: Run, replicas: Replicas, desktops: list[SimWorld]) -> float | None:
    proc = run.start()
    run.until(lambda: len(run.lines()) >= 2, 120, "2 episodes recorded")
    filler = _fill(run.run_dir.parent)
    code = run.wait(proc)
    filler.unlink()
    if code == 0:
        return 0.0
    before = len(run.lines())
    t0 = time.monotonic()
    proc = run.start()
    run.recorded_after(before, 180)
    recover = round(time.monotonic() - t0, 1)
    run.wait(proc)
    return recover


def _fill(directory: Path) -> Path:
    filler = directory / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        for chunk in (b"\0" * 65536, b"\0" * 512, b"\0"):
            with contextlib.suppress(OSError):
                while os.write(fd, chunk):
                    pass
    finally:
        os.close(fd)
    return filler


@contextlib.contextmanager
def small_filesystem(directory: Path, size_bytes: int) -> Iterator[Path]:
    directory.mkdir(parents=True, exist_ok=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_bytes}", "tmpfs",
                    str(directory)], check=True, capture_output=True)
    try:
        yield directory
    finally:
        subprocess.run(["umount", "-l", str(directory)], check=False)


# --------------------------------------------------------------------------- counting


def count(run: Run, size: Size) -> dict[str, Any]:
    lines = run.lines()
    ids = Counter(str(r.get("episode_id")) for r in lines)
    last = {str(r.get("episode_id")): r for r in lines}
    misrecorded = 0
    for episode_id, record in last.items():
        directory = run.run_dir / episode_id
        try:
            on_disk = json.loads((directory / "episode.json").read_text())
        except (OSError, ValueError):
            misrecorded += 1
            continue
        if any(on_disk.get(k) != record.get(k) for k in ("attempt", "status", "reward")):
            misrecorded += 1
            continue
        if record.get("status") in ("success", "failure", "max_steps", "timeout"):
            result = directory / "result.txt"
            if (not (directory / "traj.jsonl").is_file() or not result.is_file()
                    or float(result.read_text()) != float(record.get("reward") or 0.0)):
                misrecorded += 1
    recorded = len(ids)
    return {"expected": size.tasks, "recorded": recorded, "lost": size.tasks - recorded,
            "duplicated": sum(n - 1 for n in ids.values()), "misrecorded": misrecorded,
            "outage_infra_errors": sum(r.get("status") == "infra_error" for r in last.values())}


RUNNERS: dict[str, Callable[[Run, Replicas, list[SimWorld]], float | None]] = {
    "model_down": model_down, "replica_killed": replica_killed,
    "single_replica_reload": single_replica_reload, "desktops_killed": desktops_killed,
    "desktop_hangs": desktop_hangs, "storage_killed": storage_killed, "disk_full": disk_full,
    "driver_killed": driver_killed, "runner_killed": runner_killed,
    "second_driver": second_driver,
}


def run_scenario(name: str, size: Size) -> dict[str, Any]:
    work = Path(tempfile.mkdtemp(prefix=f"cua-chaos-{name}-"))
    replicas: Replicas | None = None
    desktops: list[SimWorld] = []
    started = time.monotonic()
    try:
        desktops = [SimWorld(desktops=3, desktop=DESKTOP).start() for _ in range(2)]
        replicas = Replicas(work / "model-state", 1 if name == "single_replica_reload" else 2)
        with contextlib.ExitStack() as stack:
            run_root = None
            sets: dict[str, Any] = {}
            if name == "disk_full":
                if os.geteuid() != 0:
                    return {"name": name, "skipped": "needs root to mount a small filesystem"}
                run_root = stack.enter_context(small_filesystem(work / "fs", 64 * 1024 * 1024))
                sets["runner__save_screenshots"] = False
            run = stack.enter_context(scenario_run(name, size, desktops, replicas, work,
                                                   run_root, **sets))
            recover = RUNNERS[name](run, replicas, desktops)
            return {"name": name, **count(run, size), "recover_s": recover,
                    "wall_s": round(time.monotonic() - started, 1)}
    except Exception as exc:
        log = work / f"{name}.log"
        tail = log.read_text(errors="replace")[-2000:] if log.exists() else ""
        return {"name": name, "error": f"{type(exc).__name__}: {exc}", "log_tail": tail}
    finally:
        if replicas is not None:
            replicas.stop()
        for world in desktops:
            for pid in world.pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGCONT)
            world.stop()
        shutil.rmtree(work, ignore_errors=True)


COUNTS = ("expected", "recorded", "lost", "duplicated", "misrecorded", "outage_infra_errors")


def print_table(rows: list[dict[str, Any]]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="chaos run: every count should be 0 (expected = recorded)")
    for column in ("scenario", *COUNTS, "recover_s", "wall_s"):
        table.add_column(column, justify="left" if column == "scenario" else "right")
    for row in rows:
        if "error" in row or "skipped" in row:
            table.add_row(row["name"], row.get("error") or f"skipped: {row['skipped']}")
            continue
        table.add_row(row["name"], *(str(row[c]) for c in COUNTS), str(row["recover_s"]),
                      str(row["wall_s"]))
    Console(width=150).print(table)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="short outages, 12 episodes")
    parser.add_argument("--json", type=Path, help="write the figures here")
    parser.add_argument("--only", nargs="+", choices=SCENARIOS, help="run only these")
    args = parser.parse_args(argv)
    size = QUICK if args.quick else FULL
    rows = []
    for name in args.only or SCENARIOS:
        print(f"scenario {name} ...", file=sys.stderr, flush=True)
        rows.append(run_scenario(name, size))
        if "error" in rows[-1]:
            print(rows[-1]["log_tail"], file=sys.stderr)
    print_table(rows)
    if args.json is not None:
        args.json.write_text(json.dumps({"scenarios": rows}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
