"""Hosts on this machine for the multi-host tests: Linux network namespaces on one bridge
(veth links, no route out), some with a mount namespace of their own; processes started in
sessions of their own and ended by process group; a Ray cluster across the hosts; and the CPU
each host used, found by the network namespace every process lives in.

Namespaces are entered with ``nsenter --net`` (``ip netns exec`` also remounts /sys, which
hides the cgroup mounts the container runtime needs). A host's mount namespace is a copy of
this machine's made at the start, kept by a bind mount of its nsfs file, so that what is
mounted in it (a network filesystem) is seen by that host's processes only."""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from tests.support import REPO_ROOT, unavailable

__all__ = ["PYTHON", "RAY", "CommandFailed", "HostCPU", "Hosts", "Processes", "ray_env",
           "ray_nodes", "require_namespaces", "sh", "start_ray", "wait_for"]

PYTHON = Path(sys.executable)
RAY = PYTHON.parent / "ray"
_NODE_TRIES = 3  # starts of one Ray node before the test gives up


class CommandFailed(subprocess.CalledProcessError):
    """A command of the test's set-up that failed, with what it said."""

    def __str__(self) -> str:
        return f"{super().__str__()}: {(self.stderr or '').strip()[-2000:]}"


def sh(*argv: str | Path, timeout_s: float = 60.0) -> str:
    """Run ``argv``; its stdout, or ``CommandFailed`` naming the command and its stderr."""
    done = subprocess.run([str(a) for a in argv], capture_output=True, text=True,
                          timeout=timeout_s, check=False)
    if done.returncode != 0:
        raise CommandFailed(done.returncode, done.args, done.stdout, done.stderr)
    return done.stdout


def require_namespaces(*tools: str) -> None:
    """Root, and ``ip`` and ``nsenter`` plus ``tools`` installed; else the test is unavailable."""
    if os.geteuid() != 0:
        unavailable("network namespaces need root")
    for tool in ("ip", "nsenter", "unshare", *tools):
        if shutil.which(tool) is None:
            unavailable(f"{tool} is not installed (scripts/setup_env.sh --dev)")


class Hosts:
    """A bridge and one network namespace per host, each with an address on the bridge's
    subnet; the hosts in ``own_mounts`` also get a mount namespace of their own."""

    def __init__(self, names: list[str], *, own_mounts: Iterable[str] = ()) -> None:
        # Names of their own per instance: a namespace deleted by the previous instance (a
        # test module's teardown) takes its veth pair away asynchronously, so names reused
        # at once collide ("File exists").
        tag = secrets.token_hex(3)[:5]
        subnet = 10 + os.getpid() % 200
        self.bridge = f"cuabr{tag}"
        self.ns = {n: f"cua{tag}{n}" for n in names}
        self.ip = {n: f"10.231.{subnet}.{i + 1}" for i, n in enumerate(names)}
        unknown = set(own_mounts) - set(names)
        if unknown:
            raise ValueError(f"own_mounts names hosts that are not among {names}: {unknown}")
        self._own_mounts = list(own_mounts)
        self.mount_ns: dict[str, Path] = {}  # host -> its mount namespace's file
        self._made: list[tuple[str, str]] = []

    def __enter__(self) -> Hosts:
        try:
            sh("ip", "link", "add", self.bridge, "type", "bridge")
            self._made.append(("bridge", self.bridge))
            sh("ip", "link", "set", self.bridge, "up")
            for i, (host, ns) in enumerate(self.ns.items()):
                sh("ip", "netns", "add", ns)
                self._made.append(("netns", ns))
                inner, outer = f"cuav{i}", f"{self.bridge}p{i}"
                # The inner end is made inside the namespace: no name of it in ours.
                sh("ip", "link", "add", inner, "netns", ns, "type", "veth", "peer", "name",
                   outer)
                self._made.append(("link", outer))  # deleted (with its peer) before the netns
                sh("ip", "link", "set", outer, "master", self.bridge)
                sh("ip", "link", "set", outer, "up")
                sh("ip", "-n", ns, "addr", "add", f"{self.ip[host]}/24", "dev", inner)
                sh("ip", "-n", ns, "link", "set", inner, "up")
                sh("ip", "-n", ns, "link", "set", "lo", "up")
            if self._own_mounts:
                self._make_mount_namespaces()
        except BaseException:
            self.__exit__()
            raise
        return self

    def _make_mount_namespaces(self) -> None:
        # The nsfs files must sit on a private mount (a bind of one onto a shared mount
        # would propagate, and the kernel refuses it): a directory bound onto itself.
        holder = Path(tempfile.mkdtemp(prefix="cuamnt", dir="/tmp"))
        self._made.append(("dir", str(holder)))
        sh("mount", "--bind", holder, holder)
        self._made.append(("mount", str(holder)))
        sh("mount", "--make-private", holder)
        for host in self._own_mounts:
            path = holder / host
            path.touch()
            sh("unshare", f"--mount={path}", "--propagation", "private", "true")
            self._made.append(("mount", str(path)))
            self.mount_ns[host] = path

    def __exit__(self, *exc: object) -> None:
        for kind, name in reversed(self._made):  # a namespace takes its veth end (and peer)
            with contextlib.suppress(subprocess.SubprocessError):
                if kind in ("bridge", "link"):
                    sh("ip", "link", "del", name)
                elif kind == "netns":
                    sh("ip", "netns", "del", name)
                elif kind == "mount":  # a mount namespace ends with its last process
                    sh("umount", name)
                elif kind == "dir":
                    shutil.rmtree(name, ignore_errors=True)
        self._made.clear()
        self.mount_ns.clear()

    def argv(self, host: str, *argv: str | Path) -> list[str]:
        """``argv`` run on ``host``: in its network namespace, and its mount namespace when it
        has one (there in the repository's directory: entering a mount namespace leaves the
        working directory at its root)."""
        enter = ["nsenter", f"--net=/run/netns/{self.ns[host]}"]
        if host in self.mount_ns:
            enter += [f"--mount={self.mount_ns[host]}", f"--wd={REPO_ROOT}"]
        return [*enter, "--", *map(str, argv)]

    def netns_ids(self) -> dict[int, str]:
        """The inode of each host's network namespace -> the host (``/proc/<pid>/ns/net``
        of a process there has the same)."""
        return {os.stat(f"/run/netns/{ns}").st_ino: host for host, ns in self.ns.items()}


class Processes:
    """Processes started in sessions of their own; ended by process group, TERM then KILL."""

    def __init__(self, logs: Path) -> None:
        self.logs = logs
        self.procs: dict[str, subprocess.Popen[bytes]] = {}

    def start(self, name: str, argv: list[str], env: dict[str, str]) -> subprocess.Popen[bytes]:
        if name in self.procs:
            raise ValueError(f"a process named {name} is running already")
        log = open(self.logs / f"{name}.log", "wb")  # noqa: SIM115 (closed with the process)
        proc = subprocess.Popen(argv, cwd=REPO_ROOT, env=env, stdout=log,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True)
        log.close()
        self.procs[name] = proc
        return proc

    def log(self, name: str, tail_chars: int = 4000) -> str:
        return (self.logs / f"{name}.log").read_text(errors="replace")[-tail_chars:]

    def kill(self, name: str) -> None:
        """SIGKILL the process group of ``name`` at once, as a machine that dies."""
        proc = self.procs.pop(name)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)

    def stop(self, name: str, grace_s: float = 30.0) -> None:
        proc = self.procs.pop(name, None)
        if proc is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=grace_s)
        with contextlib.suppress(ProcessLookupError):  # what the leader left in its group
            os.killpg(proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=10)

    def stop_all(self) -> None:
        for name in reversed(list(self.procs)):
            self.stop(name)


def wait_for(what: str, check: Callable[[], Any], timeout_s: float, procs: Processes,
             watch: list[str], poll_s: float = 0.5) -> Any:
    """``check()``'s first true value; fails when a watched process exits or at the
    deadline."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for name in watch:
            proc = procs.procs[name]
            if proc.poll() is not None:
                raise AssertionError(f"{name} exited ({proc.returncode}) while waiting for "
                                     f"{what}:\n{procs.log(name)}")
        value = check()
        if value:
            return value
        time.sleep(poll_s)
    raise AssertionError(f"{what}: not within {timeout_s:.0f} s")


# ----------------------------------------------------------------- a Ray cluster


def ray_env(**extra: str) -> dict[str, str]:
    """The environment of every node and driver of a test's Ray cluster: this checkout first
    on the path, one fresh cluster token whatever ~/.ray holds, no usage reports, every
    worker in its node's process group."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_ADDRESS")}
    env.pop("RAY_AUTH_TOKEN_PATH", None)
    env.update({"PYTHONPATH": str(REPO_ROOT), "RAY_USAGE_STATS_ENABLED": "0",
                "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(16),
                # Workers stay in their node's process group (Ray gives each its own by
                # default): ending the group ends the whole node at once, as a machine that
                # dies, and nothing of it outlives the test.
                "RAY_process_group_cleanup_enabled": "0",
                # A node told to stop (SIGTERM) stops now: Ray's default first drains it
                # for up to 30 s (for Serve), which a test's head node waits out in full.
                "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S": "0", **extra})
    return env


def start_ray(procs: Processes, hosts: Hosts, env: dict[str, str], *, head: str,
              cpus: dict[str, int | float], port: int, temp_dir: Path,
              timeout_s: float = 120.0, args: Iterable[str] = ()) -> list[dict[str, Any]]:
    """A Ray head on ``head`` and a worker node on every other host of ``cpus`` (host -> its
    CPUs, the head's included), processes ``ray-<host>``; the live nodes. One node at a time,
    each waited for, and started again (up to ``_NODE_TRIES`` times) when its ``ray start``
    gives up: a raylet that does not register within Ray's fixed 30 s fails it, which a
    2-core machine busy with other work sees."""
    common = ["--block", "--disable-usage-stats", f"--temp-dir={temp_dir}", *args]
    argv = {h: hosts.argv(h, RAY, "start", f"--address={hosts.ip[head]}:{port}",
                          f"--node-ip-address={hosts.ip[h]}", f"--num-cpus={n}", *common)
            for h, n in cpus.items() if h != head}
    argv[head] = hosts.argv(
        head, RAY, "start", "--head", f"--node-ip-address={hosts.ip[head]}", f"--port={port}",
        f"--num-cpus={cpus[head]}", "--include-dashboard=false", *common)
    up: list[str] = []
    nodes: list[dict[str, Any]] = []
    for host in [head, *(h for h in cpus if h != head)]:
        up.append(host)
        name = f"ray-{host}"
        for attempt in range(1, _NODE_TRIES + 1):
            proc = procs.start(name, argv[host], env)
            try:
                nodes = wait_for(f"Ray node {host}",
                                 lambda: ray_nodes(hosts, env, head, port, len(up),
                                                   [hosts.ip[h] for h in up]),
                                 timeout_s, procs, [f"ray-{h}" for h in up])
                break
            except AssertionError:
                if proc.poll() is None or attempt == _NODE_TRIES:
                    raise  # not its start giving up, or no try left
                procs.stop(name)  # what the failed start left in its group
    return nodes


def ray_nodes(hosts: Hosts, env: dict[str, str], head: str, port: int, count: int,
              addresses: Iterable[str] | None = None) -> list[dict[str, Any]] | None:
    """The live nodes when there are ``count`` (at ``addresses``, when given), asked from
    host ``head`` (the test's own namespace has no route there)."""
    code = (f"import json, ray; ray.init(address='{hosts.ip[head]}:{port}', "
            "logging_level='ERROR'); print(json.dumps([n for n in ray.nodes() if n['Alive']]))")
    try:
        done = subprocess.run(hosts.argv(head, PYTHON, "-c", code), env=env,
                              capture_output=True, text=True, timeout=60, cwd=REPO_ROOT)
    except subprocess.TimeoutExpired:  # the head not answering yet
        return None
    if done.returncode != 0:
        return None
    nodes = json.loads(done.stdout.strip().splitlines()[-1])
    if len(nodes) != count:
        return None
    if addresses is not None and {n["NodeManagerAddress"] for n in nodes} != set(addresses):
        return None
    return nodes


# ----------------------------------------------------------------- CPU per host


_RAY_ACTORS = {"TrajectoryRunner": "runners", "StorageActor": "storage",
               "AgentCoordinator": "coordinator", "DesktopPool": "pool"}
_RAY_DAEMONS = ("raylet", "gcs_server", "dashboard", "log_monitor", "runtime_env", "monitor.py",
                "ray start", "/ray ")


def _role(cmdline: str) -> str:
    """What a process is, from its command line (Ray's workers name theirs ``ray::<actor>``)."""
    if cmdline.startswith("ray::"):
        actor = cmdline[5:].split(".", 1)[0].split(" ", 1)[0]
        return _RAY_ACTORS.get(actor, "ray workers")
    if "sim_world" in cmdline:
        for role in ("desktops", "models"):
            if f'"role": "{role}"' in cmdline:
                return f"sim {role}"
        return "sim"
    if "run.py" in cmdline:
        return "driver"
    if "default_worker.py" in cmdline:  # a worker before it names itself
        return "ray workers"
    if any(d in cmdline for d in _RAY_DAEMONS):
        return "ray daemons"
    first = Path(cmdline.split(" ", 1)[0]).name
    if first in ("sshfs", "ssh"):
        return "sshfs"
    if first.startswith("sshd") or "sftp-server" in cmdline:
        return "sshd"
    # Anything else by its program (a Python process by its script or module).
    words = cmdline.split(" ")
    if first.startswith("python"):
        for i, word in enumerate(words[1:], start=1):
            if word.endswith(".py"):
                return Path(word).name
            if word == "-m" and i + 1 < len(words):
                return words[i + 1]
            if word == "-c":
                return "python -c"
    return first or "?"


class HostCPU:
    """The CPU seconds (user + system) every process of each host used, the host found by the
    process's network namespace (so a process a raylet forks counts, whatever its process
    group), sampled by a thread every ``interval_s``: a process that exits between two
    samples keeps what it had used at the last one. Roles by command line."""

    def __init__(self, hosts: Hosts, interval_s: float = 0.5) -> None:
        self.ids = hosts.netns_ids()
        self.addresses = dict(hosts.ip)
        self.interval_s = interval_s
        self._seen: dict[tuple[int, float], tuple[str, str, float]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="host-cpu", daemon=True)
        self._lock = threading.Lock()

    def __enter__(self) -> HostCPU:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=30)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.sample()
            self._stop.wait(self.interval_s)

    def sample(self) -> None:
        import psutil

        for proc in psutil.process_iter():
            try:
                host = self.ids.get(os.stat(f"/proc/{proc.pid}/ns/net").st_ino)
                if host is None:
                    continue
                cpu = proc.cpu_times()
                cmdline = " ".join(proc.cmdline())
                key = (proc.pid, proc.create_time())
            except (OSError, psutil.Error):
                continue
            role = _role(cmdline)
            with self._lock:
                old = self._seen.get(key)
                if old is not None and (not cmdline.strip() or (
                        role == "ray workers" and old[1] != "ray workers")):
                    # A process on its way out (no command line left), or a worker between
                    # tasks: it keeps the role it had.
                    role = old[1]
                self._seen[key] = (host, role, cpu.user + cpu.system)

    def snapshot(self) -> dict[tuple[int, float], tuple[str, str, float]]:
        """What each process had used so far (for ``split(since=...)``)."""
        with self._lock:
            return dict(self._seen)

    def split(self, since: dict[tuple[int, float], tuple[str, str, float]] | None = None
              ) -> dict[str, dict[str, float]]:
        """host -> role -> CPU seconds (since the ``snapshot`` ``since``), each host's
        ``total`` included."""
        since = since or {}
        out: dict[str, Counter[str]] = {h: Counter() for h in self.addresses}
        for key, (host, role, cpu_s) in self.snapshot().items():
            used = cpu_s - (since[key][2] if key in since else 0.0)
            out[host][role] += used
            out[host]["total"] += used
        return {h: dict(c) for h, c in out.items()}

    def table(self, title: str, wall_s: float,
              since: dict[tuple[int, float], tuple[str, str, float]] | None = None) -> str:
        """The split as lines to print: one per host, its roles largest first."""
        lines = [f"{title}: CPU seconds per host over {wall_s:.1f} s"]
        for host, roles in self.split(since).items():
            total = roles.pop("total", 0.0)
            parts = ", ".join(f"{r} {s:.1f}" for r, s in
                              sorted(roles.items(), key=lambda kv: -kv[1]) if s >= 0.05)
            lines.append(f"  {host} {self.addresses[host]:<15} {total:6.1f} s "
                         f"({total / wall_s:4.2f} cores)  {parts}")
        return "\n".join(lines)
