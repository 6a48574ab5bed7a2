"""Three hosts on this machine, as Linux network namespaces on one bridge (veth links, no
route out): the Ray head and the driver on host A, a Ray worker on host B, and host C with a
CPU-less Ray node where the desktop pool is placed (``desktops.node``) and starts container
desktops published on C's address, plus a real ``run_model.py`` pool (a tiny VLM on vLLM's
CPU build) bound to C's address. Runners on A and B reach the desktops and the model only
through the namespace network, and find the model's endpoints from its control server
(``model.endpoints_url``), not from a file. The rollout completes: every episode scored,
runners of both nodes used, every desktop a container on C.

Namespaces are entered with ``nsenter --net`` (``ip netns exec`` also remounts /sys, which
hides the cgroup mounts the container runtime needs). Every process is started in a session
of its own and ended by its process group; the namespaces, the bridge, the containers of the
run and the temp dirs are removed after."""

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
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from cua_rollout.cli.tiny_models import build_tiny_vlm
from cua_rollout.core.types import SCORED_STATUSES
from cua_rollout.envs.providers.base import LABEL_RUN
from cua_rollout.model.fleet.state import ENDPOINTS_FILE
from tests.support import REPO_ROOT, desktop_image, require_vlm_serving, unavailable

pytestmark = [pytest.mark.integration, pytest.mark.slow]

DEMO_VLM = REPO_ROOT / "configs" / "demo_vlm.yaml"
PYTHON = Path(sys.executable)
RAY = PYTHON.parent / "ray"
RAY_PORT = 6390
CONTROL_PORT = 8391
TASKS = ["terminal-hello-file", "terminal-make-dirs", "editor-save-new-file", "calc-add"]
START_TIMEOUT_S = 600
RUN_TIMEOUT_S = 900
KEY_VAR, TOKEN_VAR = "CUA_MH_MODEL_KEY", "CUA_MH_DESKTOP_TOKEN"


def _sh(*argv: str) -> None:
    subprocess.run(argv, check=True, capture_output=True, text=True, timeout=60)


class Hosts:
    """A bridge and one namespace per host, each with an address on the bridge's subnet."""

    def __init__(self, names: list[str]) -> None:
        tag = f"{os.getpid() % 100000:05d}"
        subnet = 10 + os.getpid() % 200
        self.bridge = f"cuabr{tag}"
        self.ns = {n: f"cua{tag}{n}" for n in names}
        self.ip = {n: f"10.231.{subnet}.{i + 1}" for i, n in enumerate(names)}
        self._made: list[str] = []

    def __enter__(self) -> Hosts:
        try:
            _sh("ip", "link", "add", self.bridge, "type", "bridge")
            self._made.append("bridge")
            _sh("ip", "link", "set", self.bridge, "up")
            for i, (host, ns) in enumerate(self.ns.items()):
                _sh("ip", "netns", "add", ns)
                self._made.append(ns)
                inner, outer = f"cuav{i}", f"{self.bridge}p{i}"
                _sh("ip", "link", "add", inner, "type", "veth", "peer", "name", outer)
                _sh("ip", "link", "set", outer, "master", self.bridge)
                _sh("ip", "link", "set", outer, "up")
                _sh("ip", "link", "set", inner, "netns", ns)
                _sh("ip", "-n", ns, "addr", "add", f"{self.ip[host]}/24", "dev", inner)
                _sh("ip", "-n", ns, "link", "set", inner, "up")
                _sh("ip", "-n", ns, "link", "set", "lo", "up")
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        for made in reversed(self._made):  # a namespace takes its veth end (and the peer)
            with contextlib.suppress(subprocess.SubprocessError):
                if made == "bridge":
                    _sh("ip", "link", "del", self.bridge)
                else:
                    _sh("ip", "netns", "del", made)
        self._made.clear()

    def argv(self, host: str, *argv: str | Path) -> list[str]:
        return ["nsenter", f"--net=/run/netns/{self.ns[host]}", "--", *map(str, argv)]


class Processes:
    """Processes started in sessions of their own; ended by process group, TERM then KILL."""

    def __init__(self, logs: Path) -> None:
        self.logs = logs
        self.procs: dict[str, subprocess.Popen[bytes]] = {}

    def start(self, name: str, argv: list[str], env: dict[str, str]) -> subprocess.Popen[bytes]:
        log = open(self.logs / f"{name}.log", "wb")  # noqa: SIM115 (closed with the process)
        proc = subprocess.Popen(argv, cwd=REPO_ROOT, env=env, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)
        log.close()
        self.procs[name] = proc
        return proc

    def log(self, name: str) -> str:
        return (self.logs / f"{name}.log").read_text(errors="replace")[-4000:]

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


def _wait_for(what: str, check: Any, timeout_s: float, procs: Processes,
              watch: list[str]) -> Any:
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
        time.sleep(0.5)
    raise AssertionError(f"{what}: not within {timeout_s:.0f} s")


def _published_on(ip: str) -> dict[str, str]:
    """Desktop containers (of any run) published on ``ip``: id -> ports. Only this test's
    run publishes on its namespace's address."""
    out = subprocess.run(
        ["podman", "ps", "-a", "--format", "{{.ID}}\t{{.Ports}}\t{{.Labels}}"],
        capture_output=True, text=True, timeout=60).stdout
    found = {}
    for line in out.splitlines():
        cid, ports, labels = [*line.split("\t"), "", ""][:3]
        if LABEL_RUN in labels and f"{ip}:" in ports:
            found[cid] = ports
    return found


@pytest.fixture
def hosts() -> Iterator[Hosts]:
    if os.geteuid() != 0:
        unavailable("network namespaces need root")
    for tool in ("ip", "nsenter", "podman"):
        if shutil.which(tool) is None:
            unavailable(f"{tool} is not installed (scripts/setup_env.sh --dev)")
    with Hosts(["a", "b", "c"]) as made:
        yield made


def test_a_rollout_across_three_hosts_on_a_namespace_network(hosts, tmp_path):
    require_vlm_serving()
    image = desktop_image("demo")
    model_dir = build_tiny_vlm(tmp_path / "tiny-vlm")
    logs = tmp_path / "logs"
    logs.mkdir()
    # Ray's socket paths must stay short: its own temp dir under /tmp.
    ray_tmp = Path(tempfile.mkdtemp(prefix="cuamh", dir="/tmp"))
    a, b, c = hosts.ip["a"], hosts.ip["b"], hosts.ip["c"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_ADDRESS")}
    env.pop("RAY_AUTH_TOKEN_PATH", None)
    env.update({"PYTHONPATH": str(REPO_ROOT), KEY_VAR: "sk-multi-host",
                TOKEN_VAR: "desktop-multi-host", "RAY_USAGE_STATS_ENABLED": "0",
                # One cluster token for every node and driver, whatever ~/.ray holds.
                "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(16)})
    base = yaml.safe_load(DEMO_VLM.read_text())
    base["model"]["api_key_env"] = KEY_VAR
    base["model_pool"].update({
        "checkpoint": str(model_dir), "start_with_run": False, "host": c,
        "control_port": CONTROL_PORT, "api_key_env": KEY_VAR, "reload_in_place": False,
        "state_dir": str(tmp_path / "pool")})
    (tmp_path / "pool.yaml").write_text(yaml.safe_dump(base))
    driver = json.loads(json.dumps(base))
    driver["model"]["endpoints_url"] = f"http://{c}:{CONTROL_PORT}/endpoints"
    # The driver's own model_pool section names nothing of host C: no path, no address.
    driver["model_pool"] = {}
    driver["run"] = {"name": "multi_host", "output_dir": str(tmp_path / "results")}
    driver["ray"] = {"address": f"{a}:{RAY_PORT}"}
    driver["tasks"].update({"task_ids": TASKS, "rollouts_per_task": 1})
    driver["desktops"] = {
        "provider": "container", "node": c, "count": 2, "warm_spares": 0,
        "screen_width": 1280, "screen_height": 720, "token_env": TOKEN_VAR,
        "container": {"image": image, "publish_host": c, "start_timeout_s": 120}}
    driver["coordinator"] = {"max_concurrent_episodes": 2, "episodes_per_runner": 1,
                             "runner_num_cpus": 1}
    driver["runner"].update({"max_steps": 2})
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(driver))

    procs = Processes(logs)
    seen_ports: dict[str, str] = {}
    watching = threading.Event()

    def watch_containers() -> None:  # the run's containers, while they exist
        while not watching.is_set():
            seen_ports.update(_published_on(c))
            watching.wait(1.0)

    watcher = threading.Thread(target=watch_containers, daemon=True)
    try:
        ray_common = ["--block", "--disable-usage-stats", f"--temp-dir={ray_tmp}"]
        # One node at a time, each waited for before the next and before vLLM starts: a
        # raylet that does not register within Ray's fixed 30 s (2 busy cores) fails its
        # `ray start`.
        procs.start("ray-head", hosts.argv(
            "a", RAY, "start", "--head", f"--node-ip-address={a}", f"--port={RAY_PORT}",
            "--num-cpus=1", "--include-dashboard=false", *ray_common), env)
        _wait_for("the Ray head", lambda: _ray_nodes(hosts, env, a, 1), 120, procs,
                  ["ray-head"])
        for count, (host, cpus) in enumerate((("b", 1), ("c", 0)), start=2):
            procs.start(f"ray-{host}", hosts.argv(
                host, RAY, "start", f"--address={a}:{RAY_PORT}",
                f"--node-ip-address={hosts.ip[host]}", f"--num-cpus={cpus}", *ray_common), env)
            _wait_for(f"Ray node {host}", lambda n=count: _ray_nodes(hosts, env, a, n), 120,
                      procs, ["ray-head", f"ray-{host}"])
        procs.start("run_model", hosts.argv(
            "c", PYTHON, REPO_ROOT / "run_model.py", "serve", "--config",
            tmp_path / "pool.yaml"), env)

        def serving() -> bool:
            with contextlib.suppress(OSError, ValueError):
                state = json.loads((tmp_path / "pool" / ENDPOINTS_FILE).read_text())
                return any(e.get("healthy") for e in state.get("endpoints", []))
            return False

        _wait_for("a healthy model replica on host C", serving, START_TIMEOUT_S, procs,
                  ["run_model", "ray-head", "ray-b", "ray-c"])
        nodes = _wait_for("three Ray nodes", lambda: _ray_nodes(hosts, env, a, 3), 120, procs,
                          ["ray-head", "ray-b", "ray-c"])
        watcher.start()
        started = time.monotonic()
        run = procs.start("driver", hosts.argv(
            "a", PYTHON, REPO_ROOT / "run.py", "--config", tmp_path / "run.yaml"), env)
        try:
            rc = run.wait(timeout=RUN_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            rc = None
        wall_s = time.monotonic() - started
        assert rc == 0, procs.log("driver")
    finally:
        watching.set()
        if watcher.is_alive():
            watcher.join(timeout=30)
        procs.stop_all()
        leaked = set(_published_on(c))
        if leaked:
            subprocess.run(["podman", "rm", "-f", "-t", "0", *sorted(leaked)],
                           capture_output=True, timeout=120)
        shutil.rmtree(ray_tmp, ignore_errors=True)
    assert not leaked, f"the run left containers: {sorted(leaked)}"

    run_dir = tmp_path / "results" / "multi_host"
    results = [json.loads(x) for x in (run_dir / "results.jsonl").read_text().splitlines()]
    assert sorted(r["task_id"] for r in results) == sorted(TASKS)
    assert all(r["status"] in SCORED_STATUSES for r in results), results  # no infra_error
    by_ip = {n["NodeManagerAddress"]: n["NodeID"] for n in nodes}
    # Runners on both CPU nodes; none on host C, which has no CPU to give.
    assert {r["node"] for r in results} == {by_ip[a], by_ip[b]}, (results, by_ip)
    # The desktops were containers the pool on C published on C's address.
    assert len(seen_ports) >= 2, seen_ports
    assert all(r["desktop"].startswith("ctr-") for r in results)
    # Every generation went to the replica on C, found through its control server.
    endpoints = {e for r in results for e in r["model_endpoints"]}
    assert endpoints and all(e.startswith(f"http://{c}:") for e in endpoints), endpoints
    recorded = json.loads((run_dir / "run.json").read_text())["config"]["model"]
    assert recorded["endpoints_url"] == f"http://{c}:{CONTROL_PORT}/endpoints"
    print(f"multi-host rollout: {len(results)} episodes in {wall_s:.0f} s, "
          f"{len(seen_ports)} containers on {c}, endpoints {sorted(endpoints)}")


def _ray_nodes(hosts: Hosts, env: dict[str, str], head_ip: str, count: int
               ) -> list[dict[str, Any]] | None:
    """The live nodes when there are ``count``, asked from host A (the test's own namespace
    has no route there)."""
    code = (f"import json, ray; ray.init(address='{head_ip}:{RAY_PORT}', "
            "logging_level='ERROR'); print(json.dumps([n for n in ray.nodes() if n['Alive']]))")
    try:
        done = subprocess.run(hosts.argv("a", PYTHON, "-c", code), env=env,
                              capture_output=True, text=True, timeout=60, cwd=REPO_ROOT)
    except subprocess.TimeoutExpired:  # the head not answering yet
        return None
    if done.returncode != 0:
        return None
    nodes = json.loads(done.stdout.strip().splitlines()[-1])
    return nodes if len(nodes) == count else None
