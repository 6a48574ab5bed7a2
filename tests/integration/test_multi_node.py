"""A run on a cluster whose run directory is a real network filesystem (issue 33, item 6).

Four hosts on this machine (tests.support.hosts: network namespaces on one bridge):

    a  the Ray head (no CPUs for runners), the driver (run.py) with its coordinator, storage
       and desktop pool; the run directory on its disk, served by sshd over SFTP
    b  a Ray worker node with runners, its own simulated desktops (benchmarks/sim_world.py)
    c  the same as b
    d  the simulated model servers

b and c each have a mount namespace of their own in which the results root is an ``sshfs``
mount of a's directory (tests.support.netfs), at the same path: their runners find the
storage's probe there (``storage.step_files: auto``) and write every step's screenshot and
traj.jsonl line over the network, close-to-open, while the storage on a renames the finished
attempts into place and writes results.jsonl. The SFTP server logs each client's writes, so
the test knows which host wrote every byte of every episode.

The first run: every episode recorded exactly once, scored, its files complete, and every
file of every recorded episode written over sshfs by the host whose runner ran it, on both
b and c. The second: host c's Ray node (raylet and workers, by the process group it was
started in) is SIGKILLed mid-run; the episodes it had in flight run again on b, and nothing
is lost or recorded twice. Each prints the CPU seconds of every host's processes (found by
network namespace), split by role.

The cluster is set up once for both tests (module scope); everything is stopped by process
group, unmounted and removed afterwards, also on failure."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import unquote

import pytest

from benchmarks.chaos import COUNTS, count, metrics_facts
from benchmarks.sim_world import DesktopSim, EpisodeLengths, Latency, ModelSim
from cua_rollout.core.layout import ATTEMPTS_DIR, METRICS_FILE, RESULTS_FILE
from cua_rollout.core.types import SCORED_STATUSES
from tests.support import REPO_ROOT
from tests.support.hosts import (
    PYTHON,
    HostCPU,
    Hosts,
    Processes,
    ray_env,
    require_namespaces,
    start_ray,
    wait_for,
)
from tests.support.netfs import SftpExport, require_sshfs

pytestmark = [pytest.mark.integration, pytest.mark.slow]

RAY_PORT = 6391
SFTP_PORT = 2222
RUNNER_HOSTS = ("b", "c")
DESKTOPS_PER_HOST = 5
RUN_TIMEOUT_S = 300
# A worker node found dead within seconds, not Ray's default ~30 s (a killed raylet refuses
# the GCS's health checks at once; five in a row declare it dead).
RAY_HEALTH = {"RAY_health_check_period_ms": "1000", "RAY_health_check_timeout_ms": "2000",
              "RAY_health_check_failure_threshold": "5"}
SIM_MODEL = ModelSim(base_latency_s=0.25, per_token_s=0.002, model="sim-ui-tars",
                     lengths=EpisodeLengths(median_steps=4.0, sigma=0.3, tail_fraction=0.0,
                                            min_steps=3, max_steps=6))
# Photo-like 1920x1080 screenshots (~300 KB each): the bytes a real desktop's step carries.
SIM_DESKTOP = DesktopSim(screenshots=4, reset_latency=Latency(0.2, 0.1))


@dataclasses.dataclass
class Cluster:
    hosts: Hosts
    procs: Processes
    export: SftpExport
    cpu: HostCPU
    env: dict[str, str]
    work: Path
    results_root: Path
    node_host: dict[str, str]          # Ray node id -> host
    desktop_urls: list[str]
    reset_command: list[str]
    model_urls: list[str]

    def host_of(self, record: dict[str, Any]) -> str | None:
        return self.node_host.get(str(record.get("node")))


def _serve_sim(cluster_procs: Processes, hosts: Hosts, env: dict[str, str], host: str,
               **what: Any) -> dict[str, Any]:
    """A sim world serving on ``host``'s address, from a process there (``sim-<host>``)."""
    argv = [PYTHON, REPO_ROOT / "benchmarks" / "sim_world.py", "serve",
            "--host", hosts.ip[host]]
    for key, value in what.items():
        argv += [f"--{key.replace('_', '-')}",
                 json.dumps(dataclasses.asdict(value)) if dataclasses.is_dataclass(value)
                 else str(value)]
    name = f"sim-{host}"
    cluster_procs.start(name, hosts.argv(host, *argv), env)

    def urls() -> dict[str, Any] | None:
        for line in cluster_procs.log(name, 100_000).splitlines():
            if line.startswith("{"):
                return json.loads(line)
        return None

    return wait_for(f"the sim world on {host}", urls, 120, cluster_procs, [name], poll_s=0.2)


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    require_namespaces()
    require_sshfs()
    # Short paths: Ray's socket files live under its temp dir.
    work = Path(tempfile.mkdtemp(prefix="cuamn", dir="/tmp"))
    results_root = work / "results"
    results_root.mkdir()
    (work / "logs").mkdir()
    procs = Processes(work / "logs")
    env = ray_env(**RAY_HEALTH)
    try:
        with contextlib.ExitStack() as stack:
            hosts = stack.enter_context(Hosts(["a", *RUNNER_HOSTS, "d"],
                                              own_mounts=RUNNER_HOSTS))
            cpu = stack.enter_context(HostCPU(hosts))
            stack.callback(procs.stop_all)  # after the mounts are gone: sshd last
            export = SftpExport(hosts, procs, "a", results_root, work / "sshd", SFTP_PORT)
            stack.callback(export.close)
            export.start()
            for host in RUNNER_HOSTS:
                export.mount(host)
            # Ray's nodes stop before the filesystem their workers write goes.
            stack.callback(lambda: [procs.stop(f"ray-{h}") for h in (*RUNNER_HOSTS, "a")])
            models = _serve_sim(procs, hosts, env, "d", model_servers=2, model=SIM_MODEL)
            desktops = [_serve_sim(procs, hosts, env, h, desktops=DESKTOPS_PER_HOST,
                                   desktop=SIM_DESKTOP) for h in RUNNER_HOSTS]
            nodes = start_ray(procs, hosts, env, head="a", cpus={"a": 0, "b": 2, "c": 2},
                              port=RAY_PORT, temp_dir=work / "ray",
                              args=["--object-store-memory=300000000"])
            by_ip = {ip: h for h, ip in hosts.ip.items()}
            yield Cluster(
                hosts=hosts, procs=procs, export=export, cpu=cpu, env=env, work=work,
                results_root=results_root,
                node_host={n["NodeID"]: by_ip[n["NodeManagerAddress"]] for n in nodes},
                desktop_urls=[u for d in desktops for u in d["desktop_urls"]],
                reset_command=desktops[0]["reset_command"], model_urls=models["model_urls"])
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _config(cluster: Cluster, name: str, tasks: int) -> Path:
    source = cluster.work / f"{name}-tasks.jsonl"
    with source.open("w") as f:
        for i in range(tasks):
            f.write(json.dumps({"id": f"t{i:03d}", "domain": "multinode",
                                "instruction": f"multi-node task {i}", "config": [],
                                "evaluator": {"func": "infeasible"}}) + "\n")
    config = {
        "run": {"name": name, "output_dir": str(cluster.results_root)},
        "ray": {"address": f"{cluster.hosts.ip['a']}:{RAY_PORT}"},
        "tasks": {"source": str(source)},
        "model": {"name": SIM_MODEL.model, "endpoints": cluster.model_urls, "retries": 2,
                  "request_timeout_s": 30},
        "model_pool": {"state_dir": str(cluster.work / "no-fleet")},
        "desktops": {"provider": "static", "count": len(cluster.desktop_urls),
                     "warm_spares": 0,
                     "static": {"urls": cluster.desktop_urls,
                                "reset_command": cluster.reset_command},
                     "verify": {"enabled": False},  # simulated: no real commands to check
                     "download_cache_dir": str(cluster.work / "cache")},
        # Four runners of two episodes; 0.5 CPU each, so that b alone (2 CPUs) takes all
        # four when c is gone.
        "coordinator": {"max_concurrent_episodes": 8, "episodes_per_runner": 2,
                        "runner_num_cpus": 0.5},
        "runner": {"action_pause_s": 0, "wait_s": 0, "max_steps": 8,
                   "episode_timeout_s": 120, "evaluation_timeout_s": 30},
        "storage": {"step_files": "auto"},
        "monitoring": {"progress_bar": False, "ray_metrics": False, "metrics_interval_s": 1},
    }
    path = cluster.work / f"{name}.json"
    path.write_text(json.dumps(config, indent=1))
    return path


def _start_driver(cluster: Cluster, name: str, tasks: int) -> subprocess.Popen[bytes]:
    config = _config(cluster, name, tasks)
    return cluster.procs.start(f"driver-{name}", cluster.hosts.argv(
        "a", PYTHON, REPO_ROOT / "run.py", "--config", config), cluster.env)


def _finish(cluster: Cluster, name: str, run: subprocess.Popen[bytes]) -> None:
    try:
        rc = run.wait(timeout=RUN_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        rc = None
    log = cluster.procs.log(f"driver-{name}", 1_000_000)
    cluster.procs.stop(f"driver-{name}")
    assert rc == 0, log[-4000:]
    # A runner that cannot see the run directory warns (Ray forwards runners' warnings).
    assert "step files go through the storage actor" not in log, log[-4000:]


def _assert_runners_wrote_their_step_files(run_dir: Path) -> None:
    """Every metrics sample counts the live runners as writing their step files themselves
    (``step_files``), none through the storage actor; the last one counts some."""
    samples = [json.loads(x) for x in (run_dir / METRICS_FILE).read_text().splitlines()]
    modes = [s.get("step_files") or {} for s in samples]
    assert all(set(m) <= {"runner"} for m in modes), modes
    assert modes[-1].get("runner", 0) >= 2, modes[-1]


def _results(run_dir: Path) -> list[dict[str, Any]]:
    return [json.loads(x) for x in (run_dir / RESULTS_FILE).read_text().splitlines()]


def _assert_exactly_once(run_dir: Path, tasks: int) -> list[dict[str, Any]]:
    ids = {f"multinode/t{i:03d}/0" for i in range(tasks)}
    counts = count(run_dir, tasks, ids)
    assert {k: counts[k] for k in COUNTS} == {
        "expected": tasks, "recorded": tasks, "lost": 0, "duplicated": 0, "misrecorded": 0,
        "outage_infra_errors": 0}, counts["why"]
    results = _results(run_dir)
    assert all(r["status"] in SCORED_STATUSES for r in results), results
    return results


def _assert_written_over_sshfs(cluster: Cluster, run_dir: Path,
                               results: list[dict[str, Any]]) -> dict[str, int]:
    """Every file of every recorded episode was written, with its every byte, through the
    sshfs mount of the host whose runner ran the episode (into the attempt's staging
    directory, which the storage on a renamed into place). Returns the episodes per host."""
    attempts = run_dir / ATTEMPTS_DIR
    writes = {h: cluster.export.writes(h) for h in RUNNER_HOSTS}
    per_host = dict.fromkeys(RUNNER_HOSTS, 0)
    for record in results:
        host = cluster.host_of(record)
        assert host in RUNNER_HOSTS, (record["episode_id"], record.get("node"))
        per_host[host] += 1
        final = run_dir / record["episode_id"]
        on_disk = {p.name: p.stat().st_size for p in final.iterdir()}
        assert sum(n.endswith(".png") for n in on_disk) >= record["steps"], on_disk
        # The staging directories of this attempt that host wrote into (one, unless the
        # attempt was run twice, e.g. requeued by an outage).
        staged: dict[str, dict[str, int]] = {}
        for path, size in writes[host].items():
            parent = Path(path).parent
            if parent.parent == attempts:
                flat, attempt, _nonce = parent.name.rsplit(".", 2)
                if unquote(flat) == record["episode_id"] and int(attempt) == record["attempt"]:
                    staged.setdefault(parent.name, {})[Path(path).name] = size
        assert on_disk in staged.values(), (record["episode_id"], host, on_disk, staged)
    return per_host


def test_runners_on_two_nodes_write_their_step_files_over_sshfs(cluster):
    tasks = 24
    before, started = cluster.cpu.snapshot(), time.monotonic()
    run = _start_driver(cluster, "shared", tasks)
    _finish(cluster, "shared", run)
    wall_s = time.monotonic() - started
    run_dir = cluster.results_root / "shared"
    results = _assert_exactly_once(run_dir, tasks)
    per_host = _assert_written_over_sshfs(cluster, run_dir, results)
    assert all(per_host.values()), per_host  # runners of both nodes wrote
    _assert_runners_wrote_their_step_files(run_dir)
    print(cluster.cpu.table(f"shared run directory, {tasks} episodes ({per_host})", wall_s,
                            since=before))
    split = cluster.cpu.split(since=before)
    # The step files' bytes crossed the network: sshd on a served them, sshfs on b and c
    # sent them, and the runners ran on b and c only.
    assert split["a"].get("sshd", 0) > 0 and split["a"].get("runners", 0) == 0, split
    assert all(split[h].get("runners", 0) > 0 and split[h].get("sshfs", 0) > 0
               for h in RUNNER_HOSTS), split
    steps = sum(r["steps"] for r in results)
    mb = sum(sum(cluster.export.writes(h).values()) for h in RUNNER_HOSTS) / 1e6
    print(f"  {steps} steps in {wall_s:.1f} s; {mb:.1f} MB written over sshfs in all")


def _in_flight_on(cluster: Cluster, host: str, run_dir: Path) -> set[str]:
    """The staging directories ``host`` made that are still there (attempts it is running,
    or that died with it)."""
    attempts = run_dir / ATTEMPTS_DIR
    made = {Path(p).name for p in cluster.export.made_dirs(host) if Path(p).parent == attempts}
    try:
        present = {p.name for p in attempts.iterdir()}
    except FileNotFoundError:
        return set()
    return made & present


def _ray_processes_on(cluster: Cluster, host: str) -> list[str]:
    """The live Ray processes of ``host`` (its network namespace)."""
    import psutil

    netns = os.stat(f"/run/netns/{cluster.hosts.ns[host]}").st_ino
    found = []
    for proc in psutil.process_iter(["pid"]):
        with contextlib.suppress(OSError, psutil.Error):
            if os.stat(f"/proc/{proc.pid}/ns/net").st_ino != netns:
                continue
            if proc.status() == psutil.STATUS_ZOMBIE:
                continue
            cmdline = " ".join(proc.cmdline())
            if "sim_world" not in cmdline and Path(cmdline.split(" ")[0]).name not in (
                    "sshfs", "ssh"):
                found.append(f"{proc.pid} {cmdline[:80]}")
    return found


def test_a_worker_node_killed_mid_run_loses_no_episode(cluster):
    tasks = 40
    run_dir = cluster.results_root / "killed"
    before, started = cluster.cpu.snapshot(), time.monotonic()
    run = _start_driver(cluster, "killed", tasks)
    try:
        # Mid-run: episodes recorded, and c running several of the rest (not one that may
        # end in the next millisecond).
        wait_for("episodes recorded and c running more",
                 lambda: (run_dir / RESULTS_FILE).exists()
                 and len(_results(run_dir)) >= 6
                 and len(_in_flight_on(cluster, "c", run_dir)) >= 2,
                 RUN_TIMEOUT_S, cluster.procs, ["driver-killed", "ray-c"], poll_s=0.1)
        # The raylet, its workers (ray_env keeps them in the group), the node's agents.
        cluster.procs.kill("ray-c")
        killed_s = time.monotonic() - started
        in_flight = _in_flight_on(cluster, "c", run_dir)
        deadline = time.monotonic() + 5  # SIGKILLed processes still on their way out
        while (left := _ray_processes_on(cluster, "c")) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not left, f"host c's Ray processes outlived its process group: {left}"
    except BaseException:
        print(cluster.procs.log("driver-killed"))
        raise
    _finish(cluster, "killed", run)
    wall_s = time.monotonic() - started
    results = _assert_exactly_once(run_dir, tasks)
    per_host = _assert_written_over_sshfs(cluster, run_dir, results)
    _assert_runners_wrote_their_step_files(run_dir)
    by_id = {r["episode_id"]: r for r in results}
    rerun = []
    for staging in in_flight:
        flat, attempt, _nonce = staging.rsplit(".", 2)
        record = by_id[unquote(flat)]
        if record["attempt"] == int(attempt) and cluster.host_of(record) == "c":
            continue  # it had finished as c died: its finish was on its way to the storage
        # Run again, on b, as a later attempt.
        assert record["attempt"] > int(attempt), (staging, record)
        assert cluster.host_of(record) == "b", (staging, record)
        rerun.append(record["episode_id"])
    assert rerun, f"no episode of c's was in flight when it was killed: {sorted(in_flight)}"
    assert metrics_facts(run_dir)["runners_replaced"] >= 1
    print(cluster.cpu.table(
        f"c killed {killed_s:.1f} s into a run of {tasks} episodes ({per_host}; rerun on b: "
        f"{len(rerun)})", wall_s, since=before))
