"""The chaos run: inject one fault at a time into a real rollout and count what it cost.

    python benchmarks/chaos.py [--quick] [--json OUT] [--only NAME ...]

Each scenario runs ``run.py`` as a subprocess (its own local Ray cluster, runners, storage,
coordinator and model client; node_lost: a cluster of two hosts) on a fresh run directory,
against simulated desktops and model replicas (``benchmarks/sim_world.py``:
``desktops.provider: static``; the model either as ``model.endpoints`` or as a
run_model.py-style ``endpoints.json`` the script publishes),
injects its fault mid-run, reruns the driver when the fault stopped the run (as an operator
would: the same command), and then reads the run directory. Servers are killed for real
(SIGKILL of their process); where one must come back at the same URL (static
``model.endpoints``, static desktop URLs) or freeze in the middle of a request, it sits behind
a loopback gate (``benchmarks/chaos_proxy.py``) that refuses connections while it is dead.

    model_down             both replicas (static model.endpoints) killed mid-request, URLs
                           refusing for 60 s (quick 8 s), back at the same URLs
    replica_killed         one of two replicas (endpoints.json) killed mid-request, listed
                           unhealthy, restarted
    single_replica_reload  the only replica drained, stopped and restarted as v2 through
                           endpoints.json, under load
    desktops_killed        4 of 6 desktops' servers killed mid-episode: 2 for good, 2 back
    desktop_hangs          a desktop frozen mid-/execute of an action, then thawed
    storage_killed         the run's StorageActor process SIGKILLed -> stop, rerun
    disk_full              the run dir's own tmpfs filled -> stop, space freed, rerun
    retention_disk_full    the same, while storage.retention's sweeper removes every episode's
                           images each second: none missing without its marker
    driver_killed          run.py SIGKILLed -> rerun
    runner_killed          a TrajectoryRunner actor's process SIGKILLed
    second_driver          a second run.py on the same run dir while the first runs
    slow_endpoint          one of two replicas (static model.endpoints, gated) answers 10x
                           slower for 60 s (quick 10 s), then normally
    network_cut            the desktops on a host of their own (a network namespace); every
                           packet to and from it dropped for 20 s (quick 8 s): timeouts, not
                           refusals; the desktops live on
    node_lost              a Ray cluster of two hosts (namespaces: head a, worker b, each with
                           runners and desktops); b's raylet, workers and desktops SIGKILLed
                           while its runners run episodes: a finishes the run
    postgres_restart       the trainer's index on a PostgreSQL server of its own
                           (storage.database_url) stopped mid-run, down 10 s, started again

network_cut and node_lost need root, ip, nsenter and iptables (tests/support/hosts.py makes
the hosts); postgres_restart needs Debian's PostgreSQL server binaries (as
tests/integration/test_training_postgres.py). The disk filling during a retention sweep
comes with ``storage.retention`` (see the note by SCENARIO_FUNCS).

Counted:

    expected             episodes of the task set
    recorded             distinct expected episodes in the final results.jsonl
    lost                 expected - recorded
    duplicated           lines beyond one per episode: in results.jsonl, plus the non-infra_error
                         lines a restart moved to results.superseded.jsonl (an episode recorded
                         twice before the compaction at start is still a duplicate)
    misrecorded          final lines whose episode directory disagrees: episode.json missing or
                         with another attempt/status/reward; for a scored episode result.txt
                         missing or another reward, traj.jsonl missing, not one line per step,
                         its last line with another reward, or a screenshot it names missing
    outage_infra_errors  infra_error lines in results.jsonl and results.superseded.jsonl (every
                         injected fault is recoverable, so every one counts)
    recover_s            seconds from the end of the fault (for a fault that stops the run: the
                         rerun's start) to the first episode that ended after it
    index_behind         (postgres_restart) final results.jsonl records the index lacks, or has
                         with another attempt or status, once the run has ended

The target is every count 0 but expected and recorded, and recorded == expected. Figures are
printed and written (``--json``), with what each scenario saw (``facts``: exit codes, requests
cut, outages, how the routing split requests, episodes per node, ...) and ``notes`` on
anything unexpected; nothing is asserted here (tests/integration/test_chaos.py runs
``--quick``). The exit code is 0 unless the harness itself failed.

Cleanup is exact: each scenario's drivers run with a marker in their environment, which every
process of their Ray cluster inherits; whatever carries it is ended by pid at the end (and
after a driver is SIGKILLed). Ray's files go to the scenario's temp dir (``RAY_TMPDIR``), its
small filesystem is unmounted, its temp dir removed. No other Ray on the machine is touched.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
import urllib.request
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.chaos_proxy import FaultProxy  # noqa: E402
from benchmarks.sim_world import DesktopSim, EpisodeLengths, ModelSim, SimWorld  # noqa: E402
from cua_rollout.core.layout import (  # noqa: E402
    EPISODE_FILE,
    METRICS_FILE,
    OSWORLD_RESULT_FILE,
    RESULTS_FILE,
    RETENTION_MARKER_FILE,
    RETENTION_STATE_FILE,
    RUN_FILE,
    SUPERSEDED_RESULTS_FILE,
    TRAJ_FILE,
)
from cua_rollout.core.retention import read_marker  # noqa: E402
from cua_rollout.model.fleet.state import ENDPOINTS_FILE  # noqa: E402
from tests.doubles.disk import fill  # noqa: E402
from tests.support.hosts import Hosts, Processes, ray_env, sh, start_ray, wait_for  # noqa: E402

__all__ = ["COUNTS", "FULL", "QUICK", "SCENARIOS", "Size", "count", "main", "recover_s"]

SCENARIOS = ("model_down", "replica_killed", "single_replica_reload", "desktops_killed",
             "desktop_hangs", "storage_killed", "disk_full", "driver_killed", "runner_killed",
             "second_driver", "slow_endpoint", "network_cut", "node_lost", "postgres_restart",
             "retention_disk_full")
# Scenarios on hosts of their own (network namespaces: root, ip, nsenter, iptables).
NET_SCENARIOS = ("network_cut", "node_lost")
SLOW_FACTOR = 10.0                 # slow_endpoint: answers this many times slower
# node_lost: a dead node found within seconds, not Ray's default ~30 s (as
# tests/integration/test_multi_node.py).
RAY_HEALTH = {"RAY_health_check_period_ms": "1000", "RAY_health_check_timeout_ms": "2000",
              "RAY_health_check_failure_threshold": "5"}
COUNTS = ("expected", "recorded", "lost", "duplicated", "misrecorded", "outage_infra_errors")
SCORED = ("success", "failure", "max_steps", "timeout")
MARKER_ENV = "CUA_CHAOS_MARKER"   # in the environment of every process of a scenario's Ray
# Model outages: no episode may use an attempt on them (a wait, then a requeue).
MODEL_SCENARIOS = ("model_down", "replica_killed", "single_replica_reload", "slow_endpoint")
# How long a SIGKILLed driver's Ray cluster is given to end by itself.
ORPHAN_GRACE_S = 60.0


@dataclass(frozen=True)
class Size:
    tasks: int
    concurrency: int          # coordinator.max_concurrent_episodes (6 desktops)
    outage_s: float           # every model endpoint down
    model_wait_s: float       # model.outage_wait_s: shorter than the outage, so that episodes
    #                           both wait it out and are requeued past their wait
    reload_s: float           # a replica away (reload, restart after a crash)
    desktop_back_s: float     # a killed desktop server that comes back
    hang_s: float             # a desktop frozen mid-/execute
    desktop_timeout_s: float  # desktops.request_timeout_s (a hung /execute is found after it)
    progress_timeout_s: float  # longest wait for the run to reach the point of injection
    run_timeout_s: float      # one driver's longest run
    slow_s: float = 10.0      # a model endpoint answering SLOW_FACTOR x slower
    cut_s: float = 8.0        # the network between runners and desktops cut
    db_down_s: float = 10.0   # the index's PostgreSQL server stopped


QUICK = Size(tasks=10, concurrency=6, outage_s=8.0, model_wait_s=4.0, reload_s=3.0,
             desktop_back_s=6.0, hang_s=8.0, desktop_timeout_s=4.0, progress_timeout_s=120.0,
             run_timeout_s=240.0, slow_s=10.0, cut_s=8.0, db_down_s=10.0)
FULL = Size(tasks=40, concurrency=6, outage_s=60.0, model_wait_s=20.0, reload_s=20.0,
            desktop_back_s=30.0, hang_s=45.0, desktop_timeout_s=10.0, progress_timeout_s=300.0,
            run_timeout_s=900.0, slow_s=60.0, cut_s=20.0, db_down_s=10.0)
# Short episodes (2-5 model calls) keep a scenario to tens of seconds.
LENGTHS = EpisodeLengths(median_steps=3.0, sigma=0.3, tail_fraction=0.0, min_steps=2,
                         max_steps=5)
MODEL = ModelSim(base_latency_s=0.3, per_token_s=0.002, lengths=LENGTHS, model="sim-ui-tars")
DESKTOP = DesktopSim(rich_screenshots=False, screenshots=4)


class HarnessError(RuntimeError):
    """The chaos script itself could not do what a scenario needs (not the service's fault)."""


# --------------------------------------------------------------------------- processes


def _kill_pids(pids: list[int]) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def marked(marker: str) -> list[psutil.Process]:
    """The live processes whose environment carries ``marker`` (a driver, its Ray cluster)."""
    out = []
    for proc in psutil.process_iter(["pid"]):
        try:
            if proc.environ().get(MARKER_ENV) == marker:
                out.append(proc)
        except (psutil.Error, OSError):
            continue
    return out


def end_marked(marker: str, grace_s: float = 0.0) -> list[str]:
    """End (SIGKILL, by pid) what carries ``marker``, after ``grace_s`` for it to end on its
    own; returns what had to be killed ("pid name")."""
    deadline = time.monotonic() + grace_s
    procs = marked(marker)
    while procs and time.monotonic() < deadline:
        time.sleep(0.5)
        procs = marked(marker)
    killed = []
    for proc in procs:
        with contextlib.suppress(psutil.Error):
            name = _name(proc)
            proc.kill()
            killed.append(name)
    psutil.wait_procs(procs, timeout=10)
    return killed


def _get_json(url: str, timeout_s: float = 5.0) -> dict[str, Any]:
    with urllib.request.urlopen(url, timeout=timeout_s) as r:
        return json.loads(r.read())


# --------------------------------------------------------------------------- the world


class Replica:
    """One simulated model server process, optionally behind a gate that keeps its URL."""

    def __init__(self, gated: bool) -> None:
        self.world: SimWorld | None = None
        self.gate: FaultProxy | None = None
        self.last_url: str | None = None
        self.start()
        if gated:
            assert self.world is not None
            self.gate = FaultProxy(_port(self.world.model_urls[0])).start()

    @property
    def backend_url(self) -> str | None:
        return self.world.model_urls[0] if self.world is not None else None

    @property
    def url(self) -> str | None:
        """Its URL; while it is down, the last one it had (as run_model.py keeps listing a
        replica that restarts, unhealthy)."""
        return self.gate.url() if self.gate is not None else self.last_url

    def start(self) -> None:
        self.world = SimWorld(model_servers=1, model=MODEL).start()
        self.last_url = self.world.model_urls[0]

    def in_flight(self) -> int:
        if self.backend_url is None:
            return 0
        try:
            return int(_get_json(self.backend_url + "/_sim/stats")["in_flight"])
        except (OSError, ValueError, KeyError):
            return 0

    def kill(self) -> None:
        """SIGKILL the server process: its requests in flight are cut, as in a crash."""
        if self.world is None:
            return
        _kill_pids(self.world.pids)
        self.world.stop()
        self.world = None

    def stop(self) -> None:
        self.kill()
        if self.gate is not None:
            self.gate.stop()


class Fleet:
    """The model replicas, published like run_model.py does (``endpoints.json``: each with
    its URL, health, drain state and version) unless they are static ``model.endpoints``."""

    def __init__(self, n: int, state_dir: Path | None, gated: bool = False) -> None:
        self.state_dir = state_dir
        self.replicas: list[Replica] = []
        self.flags: list[dict[str, Any]] = []
        try:
            for _ in range(n):
                self.replicas.append(Replica(gated))
                self.flags.append({"healthy": True, "draining": False, "state": "serving",
                                   "model_version": "v1"})
        except BaseException:
            self.stop()
            raise
        if state_dir is not None:
            state_dir.mkdir(parents=True, exist_ok=True)
            self.publish()

    def publish(self) -> None:
        if self.state_dir is None:
            return
        endpoints = [{"index": i, "url": r.url, **self.flags[i]}
                     for i, r in enumerate(self.replicas) if r.url is not None]
        tmp = self.state_dir / f".{ENDPOINTS_FILE}.tmp"
        tmp.write_text(json.dumps({"format": 1, "updated_at": time.time(),
                                   "model": MODEL.model, "endpoints": endpoints}))
        os.replace(tmp, self.state_dir / ENDPOINTS_FILE)

    def set(self, i: int, **flags: Any) -> None:
        self.flags[i].update(flags)
        self.publish()

    def in_flight(self) -> int:
        return sum(r.in_flight() for r in self.replicas)

    def stop(self) -> None:
        for r in self.replicas:
            r.stop()


class Desktops:
    """Six simulated desktops in three server processes: ``a`` and ``b`` direct, ``c`` behind a
    gate (a server that is killed and comes back at the same URL; a desktop that freezes)."""

    def __init__(self) -> None:
        self.a = self.b = self.c = None
        self.gate: FaultProxy | None = None
        try:
            self.a = SimWorld(desktops=2, desktop=DESKTOP).start()
            self.b = SimWorld(desktops=2, desktop=DESKTOP).start()
            self.c = SimWorld(desktops=2, desktop=DESKTOP).start()
            self.gate = FaultProxy(_port(self.c.desktop_urls[0])).start()
        except BaseException:
            self.stop()
            raise
        self.reset_command = self.a.reset_command

    @property
    def urls(self) -> list[str]:
        assert self.a and self.b and self.gate
        return [*self.a.desktop_urls, *self.b.desktop_urls,
                *(self.gate.url(f"/d/{i}") for i in range(2))]

    def restart_c(self) -> None:
        """A new server for the gated desktops (call ``gate.up(port)`` to route to it)."""
        self.c = SimWorld(desktops=2, desktop=DESKTOP).start()

    def stop(self) -> None:
        for world in (self.a, self.b, self.c):
            if world is not None:
                world.stop()
        if self.gate is not None:
            self.gate.stop()


def _port(url: str) -> int:
    return int(url.split("://", 1)[1].split("/", 1)[0].rsplit(":", 1)[1])


class Net:
    """Hosts of their own on this machine (``tests.support.hosts``: a network namespace each
    on one bridge) for the faults of a network: this machine reaches them through an address
    of its own on the bridge; what runs there is started in sessions of its own and ended by
    process group."""

    def __init__(self, work: Path, names: list[str]) -> None:
        if os.geteuid() != 0:
            raise HarnessError("network namespaces need root")
        for tool in ("ip", "nsenter", "iptables"):
            if shutil.which(tool) is None:
                raise HarnessError(f"{tool} is not installed (scripts/setup_env.sh --dev)")
        (work / "hosts").mkdir(exist_ok=True)
        self.procs = Processes(work / "hosts")
        self.hosts = Hosts(names).__enter__()
        self.cuts: set[str] = set()
        try:
            self.gateway = self.hosts.ip[names[0]].rsplit(".", 1)[0] + ".254"
            sh("ip", "addr", "add", f"{self.gateway}/24", "dev", self.hosts.bridge)
        except BaseException:
            self.hosts.__exit__()
            raise

    def serve(self, host: str, **what: Any) -> dict[str, Any]:
        """A sim world serving on ``host``'s address (process ``sim-<host>``): its URLs."""
        argv = [sys.executable, str(ROOT / "benchmarks" / "sim_world.py"), "serve", "--host",
                self.hosts.ip[host]]
        for key, value in what.items():
            argv += [f"--{key.replace('_', '-')}",
                     json.dumps(dataclasses.asdict(value)) if dataclasses.is_dataclass(value)
                     else str(value)]
        name = f"sim-{host}"
        self.procs.start(name, self.hosts.argv(host, *argv),
                         {**os.environ, "PYTHONPATH": str(ROOT)})

        def urls() -> dict[str, Any] | None:
            for line in self.procs.log(name, 100_000).splitlines():
                if line.startswith("{"):
                    return dict(json.loads(line))
            return None

        return dict(wait_for(f"the sim world on {host}", urls, 120, self.procs, [name], 0.2))

    def cut(self, host: str) -> None:
        """Every packet to and from ``host`` dropped (a cut cable, not a refusal: senders
        time out); its processes live on."""
        for chain in ("INPUT", "OUTPUT"):
            sh("nsenter", f"--net=/run/netns/{self.hosts.ns[host]}", "iptables", "-I", chain,
               "-j", "DROP")
        self.cuts.add(host)

    def restore(self, host: str) -> None:
        for chain in ("INPUT", "OUTPUT"):
            sh("nsenter", f"--net=/run/netns/{self.hosts.ns[host]}", "iptables", "-D", chain,
               "-j", "DROP")
        self.cuts.discard(host)

    def processes_on(self, host: str, prefix: str = "") -> list[int]:
        """Pids of the live processes in ``host``'s namespace whose command line starts with
        ``prefix``."""
        netns = os.stat(f"/run/netns/{self.hosts.ns[host]}").st_ino
        out = []
        for proc in psutil.process_iter(["pid"]):
            with contextlib.suppress(OSError, psutil.Error):
                if os.stat(f"/proc/{proc.pid}/ns/net").st_ino != netns \
                        or proc.status() == psutil.STATUS_ZOMBIE:
                    continue
                if " ".join(proc.cmdline()).startswith(prefix):
                    out.append(proc.pid)
        return out

    def stop(self) -> None:
        for host in list(self.cuts):
            with contextlib.suppress(subprocess.SubprocessError):
                self.restore(host)
        self.procs.stop_all()
        self.hosts.__exit__()


class NetDesktops:
    """Six simulated desktops on a host of their own (``d``), reached from this machine
    (runners, pool) over the bridge: the network between them can be cut."""

    def __init__(self, net: Net) -> None:
        served = net.serve("d", desktops=6, desktop=DESKTOP)
        self.urls: list[str] = list(served["desktop_urls"])
        self.reset_command: list[str] = list(served["reset_command"])

    def stop(self) -> None:
        pass  # its server is one of the Net's processes


class NodeCluster:
    """A Ray cluster of two hosts: the head on ``a`` (the driver, storage, coordinator, pool,
    runners; the model replicas; three desktops) and a worker node on ``b`` (runners; three
    desktops of its own). Runners of 0.5 CPU on nodes of 2: either node alone holds all."""

    RAY_PORT = 6379  # in a's namespace of its own: nothing else listens there

    def __init__(self, net: Net, work: Path) -> None:
        self.env = ray_env(**RAY_HEALTH)
        on_a = net.serve("a", model_servers=2, model=MODEL, desktops=3, desktop=DESKTOP)
        on_b = net.serve("b", desktops=3, desktop=DESKTOP)
        self.model_urls: list[str] = list(on_a["model_urls"])
        self.urls: list[str] = [*on_a["desktop_urls"], *on_b["desktop_urls"]]
        self.reset_command: list[str] = list(on_a["reset_command"])
        nodes = start_ray(net.procs, net.hosts, self.env, head="a", cpus={"a": 2, "b": 2},
                          port=self.RAY_PORT, temp_dir=work / "ray",
                          args=["--object-store-memory=200000000"])
        by_ip = {ip: h for h, ip in net.hosts.ip.items()}
        self.node_of = {by_ip[n["NodeManagerAddress"]]: str(n["NodeID"]) for n in nodes}
        self.address = f"{net.hosts.ip['a']}:{self.RAY_PORT}"

    def stop(self) -> None:
        pass  # its processes are the Net's


class Postgres:
    """A PostgreSQL server of the scenario's own (Debian's binaries, as
    tests/integration/test_training_postgres.py starts one), stopped and started again at
    the same port; as root, run as the ``postgres`` user."""

    def __init__(self) -> None:
        import pwd

        found = [p.parent for p in Path("/usr/lib/postgresql").glob("*/bin/initdb")
                 if (p.parent / "pg_ctl").exists() and p.parent.parent.name.isdigit()]
        if not found:
            raise HarnessError("PostgreSQL's server binaries are not installed "
                               "(apt-get install postgresql)")
        self.bindir = max(found, key=lambda p: int(p.parent.name))
        self.prefix: list[str] = []
        self.root = Path(tempfile.mkdtemp(prefix="chaos-pg-"))
        self.data, self.sockets = self.root / "data", self.root / "sock"
        self.log = self.root / "server.log"
        self.sockets.mkdir()
        self.running = False
        try:
            if os.geteuid() == 0:
                try:
                    owner = pwd.getpwnam("postgres")
                except KeyError:
                    raise HarnessError("running as root and there is no postgres user to "
                                       "run the server as") from None
                self.prefix = ["runuser", "-u", "postgres", "--"]
                for path in (self.root, self.sockets):
                    os.chown(path, owner.pw_uid, owner.pw_gid)
            self._pg("initdb", "-D", str(self.data), "--auth=trust", "-U", "postgres", "-E",
                     "UTF8", "--no-sync")
            self.port = _free_port()
            self.start()
        except BaseException:
            self.close()
            raise
        self.url = f"postgresql+psycopg://postgres@127.0.0.1:{self.port}/postgres"

    def _pg(self, tool: str, *args: str) -> None:
        done = subprocess.run([*self.prefix, str(self.bindir / tool), *args],
                              capture_output=True, text=True, timeout=120, check=False)
        if done.returncode != 0:
            log = self.log.read_text(errors="replace")[-1500:] if self.log.exists() else ""
            raise HarnessError(f"{tool} {' '.join(args[-1:])} failed: {done.stderr.strip()}"
                               f"\n{log}")

    def start(self) -> None:
        options = (f"-k {self.sockets} -p {self.port} -c listen_addresses=127.0.0.1 "
                   "-c fsync=off -c synchronous_commit=off -c full_page_writes=off")
        self._pg("pg_ctl", "-D", str(self.data), "-l", str(self.log), "-w", "-t", "60", "-o",
                 options, "start")
        self.running = True

    def stop(self) -> None:
        """An ordinary fast shutdown: connections are closed, the port refuses."""
        self._pg("pg_ctl", "-D", str(self.data), "stop", "-m", "fast")
        self.running = False

    def episodes(self) -> dict[str, tuple[int | None, str]]:
        """The index's episodes: episode_id -> (attempt, status)."""
        import psycopg

        plain = self.url.replace("postgresql+psycopg://", "postgresql://")
        with psycopg.connect(plain) as conn:
            rows = conn.execute("SELECT episode_id, attempt, status FROM episodes").fetchall()
        return {str(r[0]): (r[1], str(r[2])) for r in rows}

    def close(self) -> None:
        if self.running:
            with contextlib.suppress(HarnessError, subprocess.SubprocessError):
                self.stop()
        shutil.rmtree(self.root, ignore_errors=True)


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


# --------------------------------------------------------------------------- one run


@dataclass
class Run:
    """One scenario's run directory, config and driver processes."""

    work: Path
    run_dir: Path
    config: Path
    size: Size
    marker: str
    drivers: list[subprocess.Popen[bytes]] = field(default_factory=list)
    logs: list[Path] = field(default_factory=list)
    exit_codes: list[int | None] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    facts: dict[str, Any] = field(default_factory=dict)
    fault_end: float | None = None   # wall-clock end of the fault (time.time())
    prefix: list[str] = field(default_factory=list)  # the drivers' host (nsenter ... --)
    env: dict[str, str] = field(default_factory=dict)  # and their environment's extras

    def start(self, label: str, marker: str | None = None) -> subprocess.Popen[bytes]:
        """Start ``run.py`` on the scenario's config; its output goes to a log of its own."""
        log = self.work / f"driver-{len(self.drivers)}-{label.replace(' ', '_')}.log"
        with log.open("wb") as out:
            env = {**os.environ, MARKER_ENV: marker or self.marker,
                   "RAY_TMPDIR": str(self.work / "r"), **self.env}
            proc = subprocess.Popen([*self.prefix, sys.executable, str(ROOT / "run.py"),
                                     "--config", str(self.config)], cwd=ROOT, stdout=out,
                                    stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    start_new_session=True, env=env)
        self.drivers.append(proc)
        self.logs.append(log)
        return proc

    def wait(self, proc: subprocess.Popen[bytes], timeout_s: float | None = None) -> int | None:
        """The driver's exit code; None (and a note) if it outlived ``timeout_s``."""
        try:
            code: int | None = proc.wait(timeout=timeout_s or self.size.run_timeout_s)
        except subprocess.TimeoutExpired:
            self.notes.append(f"driver {proc.pid} still running after "
                              f"{timeout_s or self.size.run_timeout_s:.0f} s: killed")
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, signal.SIGKILL)
            proc.wait()
            code = None
        self.exit_codes.append(code)
        return code

    def lines(self, name: str = RESULTS_FILE) -> list[dict[str, Any]]:
        return read_jsonl(self.run_dir / name)[0]

    def recorded(self) -> int:
        return len({r.get("episode_id") for r in self.lines()})

    def until(self, predicate: Callable[[], bool], what: str,
              timeout_s: float | None = None) -> bool:
        """Wait for ``predicate`` while the last driver runs; False (and a note) if the
        driver exits first or it takes longer than ``timeout_s``."""
        deadline = time.monotonic() + (timeout_s or self.size.progress_timeout_s)
        while not predicate():
            driver = self.drivers[-1] if self.drivers else None
            if driver is not None and driver.poll() is not None:
                self.notes.append(f"the driver exited ({driver.returncode}) before {what}")
                return False
            if time.monotonic() > deadline:
                self.notes.append(f"{what}: not reached within "
                                  f"{timeout_s or self.size.progress_timeout_s:.0f} s")
                return False
            time.sleep(0.1)
        return True

    def actor_pids(self, kind: str) -> list[int]:
        """Pids of this run's Ray actor processes ``ray::<kind>`` (found by the marker)."""
        out = []
        for proc in marked(self.marker):
            with contextlib.suppress(psutil.Error):
                cmdline = proc.cmdline()
                if cmdline and cmdline[0].startswith(f"ray::{kind}"):
                    out.append(proc.pid)
        return out

    def error_text(self, proc: subprocess.Popen[bytes]) -> str | None:
        """What ``proc`` said last on ``run.py: error:`` (to the end of its output)."""
        log = self.logs[self.drivers.index(proc)]
        text = log.read_text(errors="replace") if log.exists() else ""
        at = text.rfind("run.py: error:")
        return text[at:].strip() if at >= 0 else None

    def tail(self, lines: int = 40) -> str:
        """The end of every driver's output."""
        out = []
        for log in self.logs:
            text = log.read_text(errors="replace") if log.exists() else ""
            out.append(f"===== {log.name}\n" + "\n".join(text.splitlines()[-lines:]))
        return "\n".join(out)


def read_jsonl(path: Path) -> tuple[list[dict[str, Any]], int]:
    """The records of a JSONL file and how many of its lines are not a JSON object."""
    if not path.exists():
        return [], 0
    out, broken = [], 0
    for raw in path.read_text(encoding="utf-8", errors="replace").splitlines():
        if not raw.strip():
            continue
        try:
            value = json.loads(raw)
        except ValueError:
            broken += 1
            continue
        if isinstance(value, dict):
            out.append(value)
        else:
            broken += 1
    return out, broken


def write_tasks(path: Path, n: int) -> None:
    with path.open("w") as f:
        for i in range(n):
            f.write(json.dumps({"id": f"t{i:04d}", "domain": "chaos",
                                "instruction": f"chaos task {i}", "config": [],
                                "evaluator": {"func": "infeasible"}}) + "\n")


def tasks_for(name: str, size: Size) -> int:
    """Episodes of a scenario: where the fault leaves part of the desktops serving, enough
    more that the run still has work when the fault ends (~2 episodes/s on 6 desktops)."""
    if name == "desktop_hangs":  # and ~10 s of work after the thaw, to see it back
        return size.tasks + round(2 * size.hang_s) + 20
    if name == "desktops_killed":
        return size.tasks + round(size.desktop_back_s)
    if name == "slow_endpoint":  # work through the slow minute and ~10 s after it
        return size.tasks + round(2 * size.slow_s) + 20
    if name == "postgres_restart":  # episodes recorded while the index is down, and after
        return size.tasks + round(2 * size.db_down_s) + 10
    if name == "retention_disk_full":  # sweeps (a second apart) under way when it fills
        return size.tasks + 30
    if name in ("network_cut", "node_lost"):  # work left when the network is back
        return size.tasks + 10
    return size.tasks


def make_config(name: str, size: Size, work: Path, run_root: Path, desktops: Any,
                fleet: Fleet, overrides: dict[str, dict[str, Any]] | None = None) -> Path:
    tasks = work / "tasks.jsonl"
    write_tasks(tasks, tasks_for(name, size))
    model: dict[str, Any] = {
        "name": MODEL.model, "retries": 2, "backoff": {"initial_s": 0.2, "max_s": 1.0},
        "request_timeout_s": 20, "connect_timeout_s": 2, "endpoint_failures_to_eject": 1,
        "reprobe_interval_s": 1, "outage_wait_s": size.model_wait_s,
    }
    if fleet.state_dir is None:
        model["endpoints"] = [r.url for r in fleet.replicas]
    config = {
        "run": {"name": name, "output_dir": str(run_root)},
        "ray": {"num_cpus": 2, "include_dashboard": False},
        "tasks": {"source": str(tasks)},
        "model": model,
        "model_pool": {"state_dir": str(fleet.state_dir or work / "no-fleet")},
        "desktops": {"provider": "static", "count": len(desktops.urls), "warm_spares": 0,
                     "static": {"urls": desktops.urls,
                                "reset_command": desktops.reset_command,
                                "retry_quarantined_s": 3},
                     "verify": {"enabled": False},  # simulated: no real commands to run
                     "lease_timeout_s": 20, "request_timeout_s": size.desktop_timeout_s,
                     "reset_timeout_s": 2 * size.desktop_timeout_s, "health_interval_s": 2,
                     "download_cache_dir": str(work / "cache")},
        "coordinator": {"max_concurrent_episodes": size.concurrency, "episodes_per_runner": 3,
                        "runner_num_cpus": 0,
                        "outage_backoff": {"initial_s": 0.5, "max_s": 2}},
        "runner": {"action_pause_s": 0, "wait_s": 0, "max_steps": 8, "episode_timeout_s": 120,
                   "evaluation_timeout_s": 30},
        "monitoring": {"progress_bar": False, "ray_metrics": False, "metrics_interval_s": 1},
    }
    for section, values in (overrides or {}).items():
        config.setdefault(section, {}).update(values)
    path = work / f"{name}.yaml"
    path.write_text(json.dumps(config, indent=1))
    return path


@contextlib.contextmanager
def small_filesystem(directory: Path, size_bytes: int) -> Iterator[Path]:
    """A tmpfs of ``size_bytes`` on ``directory`` (as tests.support's); unmounted on exit."""
    directory.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0:
        raise HarnessError("disk_full needs root to mount a small filesystem (tmpfs)")
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_bytes}", "tmpfs",
                           str(directory)], capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise HarnessError(f"cannot mount a tmpfs on {directory}: {done.stderr.strip()}")
    try:
        yield directory
    finally:
        if subprocess.run(["umount", str(directory)], check=False).returncode != 0:
            subprocess.run(["umount", "-l", str(directory)], check=False)


# --------------------------------------------------------------------------- scenarios


@dataclass
class Ctx:
    run: Run
    desktops: Any            # Desktops; NetDesktops or NodeCluster on hosts of their own
    fleet: Fleet
    size: Size
    net: Net | None = None
    pg: Postgres | None = None


def _midrun(ctx: Ctx, episodes: int = 2) -> subprocess.Popen[bytes] | None:
    """Start the driver and wait until ``episodes`` are recorded (None: it never got there)."""
    proc = ctx.run.start("driver")
    if not ctx.run.until(lambda: ctx.run.recorded() >= episodes,
                         f"{episodes} episodes recorded"):
        ctx.run.wait(proc, 5)
        return None
    ctx.run.facts["recorded_at_fault"] = ctx.run.recorded()
    return proc


def _model_in_flight(ctx: Ctx, replicas: list[Replica], timeout_s: float = 10.0) -> int:
    """Wait (a little) until a model request is in flight on ``replicas``; how many are."""
    deadline = time.monotonic() + timeout_s
    while True:
        n = sum(r.in_flight() for r in replicas)
        if n or time.monotonic() > deadline:
            return n
        time.sleep(0.02)


def _outcome(ctx: Ctx, proc: subprocess.Popen[bytes]) -> None:
    code = ctx.run.wait(proc)
    if code != 0:
        ctx.run.notes.append(f"the driver exited {code}: {ctx.run.error_text(proc)!r:.600}")


def model_down(ctx: Ctx) -> None:
    """Both replicas (static ``model.endpoints``) SIGKILLed with requests in flight; their
    URLs refuse connections for ``outage_s``; then new servers answer at the same URLs."""
    proc = _midrun(ctx)
    if proc is None:
        return
    replicas = ctx.fleet.replicas
    ctx.run.facts["requests_cut"] = _model_in_flight(ctx, replicas)
    for r in replicas:
        r.kill()
        assert r.gate is not None
        r.gate.down()
    t0 = time.monotonic()
    for r in replicas:  # the new servers boot while the URLs still refuse
        r.start()
    time.sleep(max(0.0, ctx.size.outage_s - (time.monotonic() - t0)))
    for r in replicas:
        assert r.gate is not None and r.backend_url is not None
        r.gate.up(_port(r.backend_url))
    ctx.run.fault_end = time.time()
    ctx.run.facts["outage_s"] = round(time.monotonic() - t0, 1)
    _outcome(ctx, proc)


def replica_killed(ctx: Ctx) -> None:
    """One of two replicas (endpoints.json) SIGKILLed mid-request; the supervisor lists it
    unhealthy 2 s later and restarts it (a new URL) after ``reload_s``."""
    proc = _midrun(ctx)
    if proc is None:
        return
    victim = ctx.fleet.replicas[0]
    ctx.run.facts["requests_cut"] = _model_in_flight(ctx, [victim])
    victim.kill()
    ctx.run.fault_end = time.time()
    time.sleep(2.0)
    ctx.fleet.set(0, healthy=False, state="backoff")
    time.sleep(ctx.size.reload_s)
    victim.start()
    ctx.fleet.set(0, healthy=True, state="serving")
    _outcome(ctx, proc)


def single_replica_reload(ctx: Ctx) -> None:
    """The only replica reloaded under load as run_model.py does it: marked draining, in-flight
    requests drained, stopped, away for ``reload_s``, back (restart mode: a new URL) as v2."""
    proc = _midrun(ctx)
    if proc is None:
        return
    replica = ctx.fleet.replicas[0]
    facts = ctx.run.facts
    facts["in_flight_at_drain"] = _model_in_flight(ctx, [replica])
    t0 = time.monotonic()
    ctx.fleet.set(0, draining=True, state="draining")
    time.sleep(1.0)  # model_pool.drain_grace_s: clients re-read the file within a second
    deadline = time.monotonic() + 30
    while replica.in_flight() and time.monotonic() < deadline:
        time.sleep(0.1)
    facts["drained"] = replica.in_flight() == 0
    facts["drain_s"] = round(time.monotonic() - t0, 1)
    ctx.fleet.set(0, state="reloading")
    assert replica.world is not None
    replica.world.stop()  # SIGTERM: a graceful stop after the drain
    replica.world = None
    time.sleep(ctx.size.reload_s)
    replica.start()
    ctx.fleet.set(0, draining=False, healthy=True, state="serving", model_version="v2")
    ctx.run.fault_end = time.time()
    facts["away_s"] = round(time.monotonic() - t0, 1)
    _outcome(ctx, proc)
    facts["model_versions"] = dict(Counter(str(r.get("model_version"))
                                           for r in ctx.run.lines()))


def desktops_killed(ctx: Ctx) -> None:
    """Four of six desktops' servers SIGKILLed mid-episode: two for good (still listed in
    static.urls), two (behind a gate) back at the same URLs after ``desktop_back_s``."""
    proc = _midrun(ctx)
    if proc is None:
        return
    d = ctx.desktops
    assert d.b is not None and d.c is not None and d.gate is not None
    ctx.run.facts.update(killed_for_good=["static-2", "static-3"],
                         killed_and_back=["static-4", "static-5"])
    _kill_pids(d.b.pids)
    _kill_pids(d.c.pids)
    d.gate.down()
    d.c.stop()
    t0 = time.monotonic()
    d.restart_c()
    time.sleep(max(0.0, ctx.size.desktop_back_s - (time.monotonic() - t0)))
    assert d.c is not None
    d.gate.up(_port(d.c.desktop_urls[0]))
    ctx.run.fault_end = time.time()
    _outcome(ctx, proc)


def desktop_hangs(ctx: Ctx) -> None:
    """A desktop freezes in the middle of an action's ``/execute``: that request and every
    later one to it get no answer for ``hang_s``, then it answers again."""
    proc = _midrun(ctx)
    if proc is None:
        return
    gate = ctx.desktops.gate
    assert gate is not None
    gate.freeze_on_execute()
    if not ctx.run.until(lambda: gate.frozen_prefix is not None,
                         "an action /execute on a gated desktop", 60):
        gate.thaw()
        _outcome(ctx, proc)
        return
    index = int((gate.frozen_prefix or b"/d/0/").split(b"/")[2])
    ctx.run.facts["frozen_desktop"] = f"static-{4 + index}"  # the gated ones are 4 and 5
    time.sleep(ctx.size.hang_s)
    ctx.run.facts["requests_held"] = gate.held
    gate.thaw()
    ctx.run.fault_end = time.time()
    _outcome(ctx, proc)


def _rerun(ctx: Ctx) -> None:
    """The operator's answer to a run that stopped: the same command again."""
    ctx.run.fault_end = time.time()
    _outcome(ctx, ctx.run.start("rerun"))


def _expect_stop(ctx: Ctx, proc: subprocess.Popen[bytes], cause: str) -> None:
    """The fault must stop the run: exit 1 with one line that names ``cause`` and says how
    to resume."""
    code = ctx.run.wait(proc)
    text = ctx.run.error_text(proc)
    ctx.run.facts["stopped_with"] = {"exit": code, "message": text and text[:600],
                                     "message_lines": len(text.splitlines()) if text else 0}
    if code == 0:
        ctx.run.notes.append("the run finished despite the fault (nothing failed?)")
    elif (code != 1 or not text or cause not in text
          or "rerun the same command to resume" not in text):
        ctx.run.notes.append(f"the stopped run exited {code} with {text!r:.600} (expected 1, "
                             f"naming {cause!r} and saying 'rerun the same command')")
    elif len(text.splitlines()) > 1:
        ctx.run.notes.append(f"the stop message is {len(text.splitlines())} lines, not one: "
                             f"{text!r:.600}")


def storage_killed(ctx: Ctx) -> None:
    """The run's StorageActor process SIGKILLed mid-run: the run must stop (exit 1, one
    line) with nothing half-recorded; the rerun completes it."""
    proc = _midrun(ctx)
    if proc is None:
        return
    pids = ctx.run.actor_pids("StorageActor")
    if len(pids) != 1:
        raise HarnessError(f"expected one ray::StorageActor of this run, found {pids}")
    os.kill(pids[0], signal.SIGKILL)
    _expect_stop(ctx, proc, "storage")
    _rerun(ctx)


def disk_full(ctx: Ctx) -> None:
    """The run directory's own small filesystem filled to the last byte mid-run: the run
    must stop (or pause) cleanly; space is freed and the rerun completes it."""
    proc = _midrun(ctx)
    if proc is None:
        return
    filler = fill(ctx.run.run_dir.parent)
    ctx.run.facts["filler_mb"] = round(filler.stat().st_size / 2**20, 1)
    _expect_stop(ctx, proc, "No space left on device")
    filler.unlink()
    _rerun(ctx)


def retention_disk_full(ctx: Ctx) -> None:
    """disk_full while the retention sweeper (``storage.retention``: every episode's images
    removed once its line is written, a sweep a second) removes images:
    the disk fills mid-sweep; the run stops cleanly, and after the space is freed the rerun
    completes and the sweeper goes on. Counted besides: episodes whose images went (each
    must have its marker: a screenshot named by traj.jsonl and missing without one is a
    misrecord), and the sweep errors the full disk caused."""
    proc = _midrun(ctx, episodes=4)
    if proc is None:
        return
    if not ctx.run.until(lambda: _markers(ctx.run.run_dir) > 0, "a sweep removed images"):
        ctx.run.wait(proc, 5)
        return
    filler = fill(ctx.run.run_dir.parent)
    ctx.run.facts["filler_mb"] = round(filler.stat().st_size / 2**20, 1)
    ctx.run.facts["removed_at_fault"] = _markers(ctx.run.run_dir)
    _expect_stop(ctx, proc, "No space left on device")
    state = _retention_state(ctx.run.run_dir)
    said = "".join(log.read_text(errors="replace") for log in ctx.run.logs if log.exists())
    ctx.run.facts["sweep_errors_logged"] = "the retention sweep failed" in said
    filler.unlink()
    _rerun(ctx)
    ctx.run.facts["removed_at_end"] = _markers(ctx.run.run_dir)
    ctx.run.facts["retention_state_readable"] = state is not None


def _markers(run_dir: Path) -> int:
    return sum(1 for _ in run_dir.glob(f"*/*/*/{RETENTION_MARKER_FILE}"))


def _retention_state(run_dir: Path) -> dict[str, Any] | None:
    try:
        state = json.loads((run_dir / RETENTION_STATE_FILE).read_text())
    except (OSError, ValueError):
        return None
    return state if isinstance(state, dict) else None


def driver_killed(ctx: Ctx) -> None:
    """run.py SIGKILLed mid-run; its Ray cluster must go with it (Ray fate-shares the
    processes a driver starts); the rerun completes the run."""
    proc = _midrun(ctx)
    if proc is None:
        return
    os.kill(proc.pid, signal.SIGKILL)
    ctx.run.wait(proc)
    t0 = time.monotonic()
    lingering: list[str] = []
    while (procs := marked(ctx.run.marker)) and time.monotonic() - t0 < ORPHAN_GRACE_S:
        if not lingering and time.monotonic() - t0 > 5:
            lingering = sorted(_name(p) for p in procs)
        time.sleep(0.5)
    facts = ctx.run.facts
    facts["cluster_gone_s"] = None if procs else round(time.monotonic() - t0, 1)
    facts["alive_5s_after_the_kill"] = lingering
    left = end_marked(ctx.run.marker)
    facts["orphans"] = left
    if left:
        ctx.run.notes.append(f"{len(left)} process(es) of the killed driver's Ray outlived it "
                             f"by {ORPHAN_GRACE_S:.0f} s (killed by the harness): {left}")
    _rerun(ctx)


def _name(proc: psutil.Process) -> str:
    with contextlib.suppress(psutil.Error):
        return f"{proc.pid} {(' '.join(proc.cmdline()[:1]) or proc.name())[:60]}"
    return str(proc.pid)


def runner_killed(ctx: Ctx) -> None:
    """A TrajectoryRunner actor's worker process SIGKILLed while it runs episodes."""
    proc = _midrun(ctx)
    if proc is None:
        return
    pids = ctx.run.actor_pids("TrajectoryRunner")
    if not pids:
        raise HarnessError("no ray::TrajectoryRunner process of this run")
    os.kill(pids[0], signal.SIGKILL)
    ctx.run.fault_end = time.time()
    ctx.run.facts["runners_at_kill"] = len(pids)
    _outcome(ctx, proc)


def second_driver(ctx: Ctx) -> None:
    """A second run.py on the same run directory while the first runs (held, its replicas
    draining, until the second is done): it must exit 1 at once naming the holder, start
    nothing and change nothing."""
    proc = _midrun(ctx, episodes=1)
    if proc is None:
        return
    before = json.loads((ctx.run.run_dir / RUN_FILE).read_text())
    # The first run held (its replicas draining: episodes wait for the model) until the
    # second has exited: on a loaded machine the second's start can outlast a whole run,
    # which then ends, frees the lock and leaves nothing to refuse.
    for i in range(len(ctx.fleet.replicas)):
        ctx.fleet.set(i, draining=True, state="draining")
    marker = f"{ctx.run.marker}-second"
    t0 = time.monotonic()
    second = ctx.run.start("second driver", marker=marker)
    code = ctx.run.wait(second, 120)
    first_alive = proc.poll() is None
    for i in range(len(ctx.fleet.replicas)):
        ctx.fleet.set(i, draining=False, state="serving")
    ctx.run.fault_end = time.time()
    if not first_alive:
        ctx.run.notes.append(f"the first driver exited ({proc.returncode}) before the second "
                             "was done: the run was not held")
    text = ctx.run.error_text(second) or ""
    lines = [x for x in text.splitlines() if x.strip()]
    facts = ctx.run.facts
    facts["second"] = {"exit": code, "exit_s": round(time.monotonic() - t0, 1),
                       "message": text[:600]}
    left = end_marked(marker)
    if code != 1 or len(lines) != 1 or "another run.py" not in text \
            or f"pid {proc.pid}" not in text:
        ctx.run.notes.append(f"the second driver exited {code}: {text!r:.600} (expected 1 "
                             f"and one line naming pid {proc.pid})")
    if left:
        ctx.run.notes.append(f"the second driver left processes behind: {left}")
    _outcome(ctx, proc)
    after = json.loads((ctx.run.run_dir / RUN_FILE).read_text())
    starts = len(after.get("previous_starts") or [])
    facts["starts_in_run_json"] = 1 + starts
    if starts or after.get("started_at") != before.get("started_at"):
        ctx.run.notes.append("run.json records a start of the second driver")


def slow_endpoint(ctx: Ctx) -> None:
    """One of two replicas (static ``model.endpoints``, each behind a gate) answers
    ``SLOW_FACTOR`` times slower for ``slow_s``, then at its normal speed again."""
    proc = _midrun(ctx)
    if proc is None:
        return
    slow, fast = ctx.fleet.replicas
    assert slow.gate is not None and fast.gate is not None
    gates = (slow.gate, fast.gate)
    before = [g.forwarded for g in gates]
    slow.gate.slow(SLOW_FACTOR)
    time.sleep(ctx.size.slow_s)
    during = [g.forwarded for g in gates]
    slow.gate.slow(1)
    ctx.run.fault_end = time.time()
    _outcome(ctx, proc)
    after = [g.forwarded for g in gates]
    # What the routing did: requests answered by each replica in the slow window, and after.
    ctx.run.facts.update(
        slowed=slow.gate.slowed,
        answered_while_slow={"slow": during[0] - before[0], "fast": during[1] - before[1]},
        answered_after={"slow": after[0] - during[0], "fast": after[1] - during[1]})


def network_cut(ctx: Ctx) -> None:
    """Every packet between this machine (runners, pool) and the desktops' host dropped for
    ``cut_s`` (iptables DROP in its namespace: connections time out, nothing is refused);
    the desktops live on and the network comes back."""
    proc = _midrun(ctx)
    if proc is None:
        return
    assert ctx.net is not None
    t0 = time.monotonic()
    ctx.net.cut("d")
    time.sleep(ctx.size.cut_s)
    ctx.net.restore("d")
    ctx.run.fault_end = time.time()
    ctx.run.facts["cut_s"] = round(time.monotonic() - t0, 1)
    ctx.run.facts["recorded_at_restore"] = ctx.run.recorded()
    _outcome(ctx, proc)


def node_lost(ctx: Ctx) -> None:
    """A Ray worker node (host ``b``: its raylet and workers, by process group, and its
    simulated desktops) SIGKILLed while its runners run episodes; the head's node (``a``)
    must finish every episode."""
    cluster = ctx.desktops
    assert isinstance(cluster, NodeCluster) and ctx.net is not None
    proc = ctx.run.start("driver")
    b_node = cluster.node_of["b"]
    # Mid-run: episodes recorded, runners of b among their runners.
    if not ctx.run.until(lambda: ctx.run.recorded() >= 2 and any(
            r.get("node") == b_node for r in ctx.run.lines()),
            "episodes recorded, some by the runners of b"):
        ctx.run.wait(proc, 5)
        return
    facts = ctx.run.facts
    facts["recorded_at_fault"] = ctx.run.recorded()
    facts["runners_on_b_at_kill"] = len(ctx.net.processes_on("b", "ray::TrajectoryRunner"))
    ctx.net.procs.kill("ray-b")
    ctx.net.procs.kill("sim-b")
    ctx.run.fault_end = time.time()
    deadline = time.monotonic() + 10
    while (left := ctx.net.processes_on("b")) and time.monotonic() < deadline:
        time.sleep(0.1)
    facts["left_on_b"] = len(left)
    if left:
        ctx.run.notes.append(f"{len(left)} process(es) of b outlived its kill")
    _outcome(ctx, proc)
    hosts = {v: k for k, v in cluster.node_of.items()}
    lines = ctx.run.lines()
    facts["episodes_by_node"] = dict(Counter(hosts.get(str(r.get("node")), "?")
                                             for r in lines))
    facts["after_kill_by_node"] = dict(Counter(
        hosts.get(str(r.get("node")), "?") for r in lines
        if float(r.get("started_at") or 0) >= (ctx.run.fault_end or 0)))


def postgres_restart(ctx: Ctx) -> None:
    """The trainer's index (``storage.database_url``: PostgreSQL) stopped mid-run, down for
    ``db_down_s``, started again: no episode lost, and the index has every recorded episode
    by the end of the run (``index_behind``)."""
    proc = _midrun(ctx)
    if proc is None:
        return
    assert ctx.pg is not None
    t0 = time.monotonic()
    ctx.pg.stop()
    ctx.run.facts["recorded_at_stop"] = ctx.run.recorded()
    time.sleep(max(0.0, ctx.size.db_down_s - (time.monotonic() - t0)))
    ctx.run.facts["recorded_while_down"] = ctx.run.recorded() - ctx.run.facts["recorded_at_stop"]
    ctx.pg.start()
    ctx.run.fault_end = time.time()
    facts = ctx.run.facts
    facts["db_down_s"] = round(time.monotonic() - t0, 1)
    # How far behind the index was just after the server came back (0 when a retry of the
    # storage's happened to land between the server's start and this look).
    facts["behind_at_restart"] = index_behind(ctx.run.run_dir, ctx.pg.episodes())[
        "index_behind"]
    _outcome(ctx, proc)
    # The storage's error line (its "written again" is at INFO, not forwarded to the driver).
    said = "\n".join(p.read_text(errors="replace") for p in ctx.run.logs if p.exists())
    facts["index_failure_logged"] = "(retrying; results.jsonl has the episodes)" in said


def index_behind(run_dir: Path, index: dict[str, tuple[int | None, str]]) -> dict[str, Any]:
    """How many final results.jsonl records the index lacks or has with another attempt or
    status (a cancelled line is never indexed), and which."""
    last = {str(r.get("episode_id")): r for r in read_jsonl(run_dir / RESULTS_FILE)[0]}
    behind = sorted(eid for eid, r in last.items() if r.get("status") != "cancelled"
                    and index.get(eid) != (r.get("attempt"), r.get("status")))
    return {"index_behind": len(behind), "index_rows": len(index),
            "index_behind_ids": behind[:10]}


SCENARIO_FUNCS: dict[str, Callable[[Ctx], None]] = {
    "model_down": model_down, "replica_killed": replica_killed,
    "single_replica_reload": single_replica_reload, "desktops_killed": desktops_killed,
    "desktop_hangs": desktop_hangs, "storage_killed": storage_killed, "disk_full": disk_full,
    "driver_killed": driver_killed, "runner_killed": runner_killed,
    "second_driver": second_driver, "slow_endpoint": slow_endpoint,
    "network_cut": network_cut, "node_lost": node_lost, "postgres_restart": postgres_restart,
    "retention_disk_full": retention_disk_full,
}


# --------------------------------------------------------------------------- counting


def _misrecorded(run_dir: Path, record: dict[str, Any]) -> str | None:
    """Why the episode's directory disagrees with its final results.jsonl line (or None)."""
    directory = run_dir / str(record.get("episode_id"))
    try:
        on_disk = json.loads((directory / EPISODE_FILE).read_text())
    except (OSError, ValueError) as exc:
        return f"{EPISODE_FILE}: {type(exc).__name__}"
    for key in ("attempt", "status", "reward"):
        if on_disk.get(key) != record.get(key):
            return f"{EPISODE_FILE} {key} {on_disk.get(key)!r} != line's {record.get(key)!r}"
    if record.get("status") not in SCORED:
        return None
    reward = float(record.get("reward") or 0.0)
    try:
        if float((directory / OSWORLD_RESULT_FILE).read_text()) != reward:
            return f"{OSWORLD_RESULT_FILE} differs from the line's reward {reward}"
    except (OSError, ValueError) as exc:
        return f"{OSWORLD_RESULT_FILE}: {type(exc).__name__}"
    steps, broken = read_jsonl(directory / TRAJ_FILE)
    if not (directory / TRAJ_FILE).is_file():
        return f"{TRAJ_FILE} missing"
    if broken or len(steps) != int(record.get("steps") or 0):
        return f"{TRAJ_FILE}: {len(steps)} lines ({broken} broken) for {record.get('steps')} steps"
    if steps and float(steps[-1].get("reward") or 0.0) != reward:
        return f"{TRAJ_FILE}: last line's reward differs from {reward}"
    marker = read_marker(directory)  # images storage.retention removed (or re-encoded)
    gone = set(marker.removed) | set(marker.reencoded) if marker is not None else set()
    for step in steps:
        for key in ("screenshot_file", "observation_file"):
            name = step.get(key)
            if name and not (directory / name).is_file() and name not in gone:
                return f"{name} (named by {TRAJ_FILE}) missing"
    return None


def count(run_dir: Path, expected: int, expected_ids: set[str] | None = None
          ) -> dict[str, Any]:
    """The six counts of a run directory (and, under ``why``, what each misrecord was)."""
    index, broken = read_jsonl(run_dir / RESULTS_FILE)
    archive, archive_broken = read_jsonl(run_dir / SUPERSEDED_RESULTS_FILE)
    ids = Counter(str(r.get("episode_id")) for r in index)
    last = {str(r.get("episode_id")): r for r in index}
    wanted = expected_ids if expected_ids is not None else set(ids)
    recorded = len(wanted & set(ids))
    why = {eid: reason for eid, record in last.items()
           if (reason := _misrecorded(run_dir, record)) is not None}
    return {
        "expected": expected,
        "recorded": recorded,
        "lost": expected - recorded,
        "duplicated": (sum(n - 1 for n in ids.values())
                       + sum(r.get("status") != "infra_error" for r in archive)),
        "misrecorded": len(why),
        "outage_infra_errors": sum(r.get("status") == "infra_error" for r in (*index, *archive)),
        "why": {"misrecorded": why, "broken_lines": broken + archive_broken,
                "unexpected_ids": sorted(set(ids) - wanted)},
    }


def recover_s(run_dir: Path, fault_end: float | None) -> float | None:
    """Seconds from ``fault_end`` to the first episode (any line) that ended after it."""
    if fault_end is None:
        return None
    lines = [*read_jsonl(run_dir / RESULTS_FILE)[0],
             *read_jsonl(run_dir / SUPERSEDED_RESULTS_FILE)[0]]
    ends = [float(r["ended_at"]) for r in lines
            if isinstance(r.get("ended_at"), int | float) and r["ended_at"] >= fault_end]
    return round(min(ends) - fault_end, 1) if ends else None


def metrics_facts(run_dir: Path) -> dict[str, Any]:
    """What the coordinator saw (max over the metrics samples of every start)."""
    samples = read_jsonl(run_dir / METRICS_FILE)[0]
    out: dict[str, Any] = {"model_outages": 0, "desktop_outages": 0, "retries": 0,
                           "runners_replaced": 0, "status_lines": []}
    for s in samples:
        outages = s.get("outages") or {}
        out["model_outages"] = max(out["model_outages"],
                                   (outages.get("model") or {}).get("count", 0))
        out["desktop_outages"] = max(out["desktop_outages"],
                                     (outages.get("desktop") or {}).get("count", 0))
        out["retries"] = max(out["retries"], s.get("retries") or 0)
        out["runners_replaced"] = max(out["runners_replaced"], s.get("runners_replaced") or 0)
        waiting = s.get("waiting")  # what the progress bar shows while a side is down
        if waiting and "checking" not in waiting:
            lines = out["status_lines"]
            # The first line of each outage and the last: e.g. "... 1 s" and "... 58 s".
            if len(lines) < 2:
                lines.append(waiting)
            else:
                lines[-1] = waiting
    return out


# --------------------------------------------------------------------------- a scenario


def run_scenario(name: str, size: Size, keep: bool = False) -> dict[str, Any]:
    work = Path(tempfile.mkdtemp(prefix="chaos-"))
    started = time.monotonic()
    row: dict[str, Any] = {"name": name}
    marker = f"{name}-{uuid.uuid4().hex[:12]}"
    run: Run | None = None
    try:
        with contextlib.ExitStack() as stack:
            if keep:
                row["kept"] = str(work)
            else:
                stack.callback(shutil.rmtree, work, True)
            net = pg = None
            overrides: dict[str, dict[str, Any]] = {}
            if name in NET_SCENARIOS:
                net = Net(work, ["d"] if name == "network_cut" else ["a", "b"])
                stack.callback(net.stop)
            desktops: Any
            if name == "network_cut":
                assert net is not None
                desktops = NetDesktops(net)
            elif name == "node_lost":
                assert net is not None
                desktops = NodeCluster(net, work)
                overrides["ray"] = {"address": desktops.address}
                overrides["model"] = {"endpoints": desktops.model_urls}
                # Three runners of two episodes, spread over both nodes.
                overrides["coordinator"] = {"episodes_per_runner": 2, "runner_num_cpus": 0.5}
            else:
                desktops = Desktops()
            stack.callback(desktops.stop)
            if name == "postgres_restart":
                pg = Postgres()
                stack.callback(pg.close)
                overrides["storage"] = {"database_url": pg.url}
            if name in ("model_down", "slow_endpoint"):
                fleet = Fleet(2, None, gated=True)
            elif name == "node_lost":
                fleet = Fleet(0, None)  # the replicas are on host a
            else:
                fleet = Fleet(1 if name == "single_replica_reload" else 2, work / "fleet")
            stack.callback(fleet.stop)
            run_root = work / "results"
            if name in ("disk_full", "retention_disk_full"):
                run_root = stack.enter_context(small_filesystem(work / "fs", 16 * 2**20))
            if name == "retention_disk_full":
                overrides["storage"] = {"index": False, "retention": {
                    "images": "sample", "sample_fraction": 0.0, "sweep_interval_s": 1}}
            config = make_config(name, size, work, run_root, desktops, fleet, overrides)
            run = Run(work, run_root / name, config, size, marker)
            if name == "node_lost":
                assert net is not None
                run.prefix = net.hosts.argv("a")  # the driver on the head's host
                run.env = {k: v for k, v in desktops.env.items()
                           if k.startswith("RAY_") or k == "PYTHONPATH"}
            # Last in, first out: the run's processes end before the mount and the servers.
            stack.callback(_end_run, run)
            SCENARIO_FUNCS[name](Ctx(run, desktops, fleet, size, net, pg))
            n = tasks_for(name, size)
            counts = count(run.run_dir, n, {f"chaos/t{i:04d}/0" for i in range(n)})
            why = counts.pop("why")
            row.update(counts)
            if pg is not None:  # the index caught up with results.jsonl
                caught = index_behind(run.run_dir, pg.episodes())
                row["index_behind"] = caught.pop("index_behind")
                run.facts.update(caught)
                if row["index_behind"]:
                    run.notes.append(f"the index lacks {row['index_behind']} recorded "
                                     f"episode(s) at the end of the run")
            row["recover_s"] = recover_s(run.run_dir, run.fault_end)
            row["wall_s"] = round(time.monotonic() - started, 1)
            row["exit_codes"] = run.exit_codes
            row["facts"] = {**run.facts, **metrics_facts(run.run_dir)}
            if name in ("desktops_killed", "desktop_hangs") and run.fault_end is not None:
                # Which desktops served episodes started after the fault: a desktop that
                # came back is among them, one killed for good is not.
                row["facts"]["desktops_after_fault"] = sorted({
                    str(r.get("desktop")) for r in run.lines()
                    if float(r.get("started_at") or 0) >= run.fault_end})
            if why["misrecorded"] or why["broken_lines"] or why["unexpected_ids"]:
                row["facts"]["why"] = why
            if why["broken_lines"]:
                run.notes.append(f"{why['broken_lines']} line(s) of results.jsonl (or the "
                                 "archive) are not JSON")
            attempts = Counter(int(r.get("attempt") or 0) for r in run.lines())
            row["facts"]["attempts"] = {str(k): v for k, v in sorted(attempts.items())}
            waits = [float((r.get("timing") or {}).get("outage_wait_s") or 0)
                     for r in run.lines()]
            if name in MODEL_SCENARIOS:  # episodes that waited the outage out in place
                row["facts"]["waited"] = {"episodes": sum(w > 0 for w in waits),
                                          "max_s": round(max(waits, default=0.0), 1)}
            if name in MODEL_SCENARIOS and set(attempts) - {0}:
                run.notes.append(f"a model outage used up attempts: {dict(attempts)} (an "
                                 "outage must requeue without using one)")
            if row["recover_s"] is None and run.fault_end is not None:
                run.notes.append("no episode ended after the fault")
            row["notes"] = run.notes
            if any(row[k] for k in COUNTS[2:]) or run.notes:
                row["log_tail"] = run.tail()
        return row
    except Exception as exc:
        row["error"] = f"{type(exc).__name__}: {exc}"
        row["traceback"] = traceback.format_exc()[-3000:]
        if run is not None:
            row["notes"] = run.notes
            row["log_tail"] = run.tail()
        return row


def _end_run(run: Run) -> None:
    """End the run's drivers and whatever of their Ray clusters is left, by pid."""
    for proc in run.drivers:
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, signal.SIGKILL)
            proc.wait()
    left = end_marked(run.marker, grace_s=10.0)
    if left:
        run.notes.append(f"processes of the run outlived its drivers (killed): {left}")


# --------------------------------------------------------------------------- output


def print_table(rows: list[dict[str, Any]], runtime_s: float, mode: str) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"chaos run ({mode}, {runtime_s:.0f} s): every count should be 0")
    for column in ("scenario", *COUNTS, "recover_s", "wall_s", "exits"):
        table.add_column(column, justify="left" if column == "scenario" else "right")
    for row in rows:
        if "error" in row:
            table.add_row(row["name"], f"[red]harness error: {row['error']}")
            continue
        cells = []
        for c in COUNTS:
            bad = c not in ("expected", "recorded") and row[c]
            cells.append(f"[red]{row[c]}" if bad else str(row[c]))
        table.add_row(row["name"], *cells, str(row["recover_s"]), str(row["wall_s"]),
                      " ".join(str(c) for c in row["exit_codes"]))
    console = Console(width=160)
    console.print(table)
    for row in rows:
        for note in row.get("notes") or []:
            console.print(f"  {row['name']}: {note}", markup=False)
        why = (row.get("facts") or {}).get("why")
        if why:
            console.print(f"  {row['name']}: {json.dumps(why)[:1500]}", markup=False)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true",
                        help=f"{QUICK.tasks} episodes, {QUICK.outage_s:g} s outages "
                        f"(default: {FULL.tasks} episodes, {FULL.outage_s:g} s)")
    parser.add_argument("--json", type=Path, help="write the figures here")
    parser.add_argument("--only", nargs="+", choices=SCENARIOS, help="run only these")
    parser.add_argument("--keep", action="store_true",
                        help="keep each scenario's temp dir (run dir, logs) to look at")
    args = parser.parse_args(argv)
    size = QUICK if args.quick else FULL
    mode = "quick" if args.quick else "full"
    t0 = time.monotonic()
    rows = []
    for name in args.only or SCENARIOS:
        print(f"scenario {name} ...", file=sys.stderr, flush=True)
        rows.append(run_scenario(name, size, args.keep))
        row = rows[-1]
        if "error" in row:
            print(row["traceback"], row.get("log_tail", ""), sep="\n", file=sys.stderr)
        else:
            shown = (*COUNTS, *(["index_behind"] if "index_behind" in row else []),
                     "recover_s", "wall_s")
            print(f"  {json.dumps({k: row[k] for k in shown})}",
                  file=sys.stderr, flush=True)
    runtime_s = time.monotonic() - t0
    print_table(rows, runtime_s, mode)
    if args.json is not None:
        args.json.write_text(json.dumps({"mode": mode, "runtime_s": round(runtime_s, 1),
                                         "scenarios": rows}, indent=2))
    return 1 if any("error" in row for row in rows) else 0


if __name__ == "__main__":
    raise SystemExit(main())
