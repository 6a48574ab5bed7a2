"""Three hosts on this machine, as Linux network namespaces on one bridge (veth links, no
route out): the Ray head and the driver on host A, a Ray worker on host B, and host C with a
CPU-less Ray node where the desktop pool is placed (``desktops.node``) and starts container
desktops published on C's address, plus a real ``run_model.py`` pool (a tiny VLM on vLLM's
CPU build) bound to C's address. Runners on A and B reach the desktops and the model only
through the namespace network, and find the model's endpoints from its control server
(``model.endpoints_url``), not from a file. The rollout completes: every episode scored,
runners of both nodes used, every desktop a container on C.

The hosts, their processes and the Ray cluster are tests.support.hosts' (shared with
tests/integration/test_multi_node.py). Every process is started in a session of its own and
ended by its process group; the namespaces, the bridge, the containers of the run and the
temp dirs are removed after."""

from __future__ import annotations

import contextlib
import json
import shutil
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from cua_rollout.cli.tiny_models import build_tiny_vlm
from cua_rollout.core.types import SCORED_STATUSES
from cua_rollout.envs.providers.base import LABEL_RUN
from cua_rollout.model.fleet.state import ENDPOINTS_FILE
from tests.support import REPO_ROOT, desktop_image, require_vlm_serving
from tests.support.hosts import (
    PYTHON,
    Hosts,
    Processes,
    ray_env,
    ray_nodes,
    require_namespaces,
    start_ray,
    wait_for,
)

pytestmark = [pytest.mark.integration, pytest.mark.slow]

DEMO_VLM = REPO_ROOT / "configs" / "demo_vlm.yaml"
RAY_PORT = 6390
CONTROL_PORT = 8391
TASKS = ["terminal-hello-file", "terminal-make-dirs", "editor-save-new-file", "calc-add"]
START_TIMEOUT_S = 600
RUN_TIMEOUT_S = 900
KEY_VAR, TOKEN_VAR = "CUA_MH_MODEL_KEY", "CUA_MH_DESKTOP_TOKEN"


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
    require_namespaces("podman")
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
    env = ray_env(**{KEY_VAR: "sk-multi-host", TOKEN_VAR: "desktop-multi-host"})
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
        # Every node up before vLLM starts (its start keeps both cores busy).
        start_ray(procs, hosts, env, head="a", cpus={"a": 1, "b": 1, "c": 0}, port=RAY_PORT,
                  temp_dir=ray_tmp)
        procs.start("run_model", hosts.argv(
            "c", PYTHON, REPO_ROOT / "run_model.py", "serve", "--config",
            tmp_path / "pool.yaml"), env)

        def serving() -> bool:
            with contextlib.suppress(OSError, ValueError):
                state = json.loads((tmp_path / "pool" / ENDPOINTS_FILE).read_text())
                return any(e.get("healthy") for e in state.get("endpoints", []))
            return False

        wait_for("a healthy model replica on host C", serving, START_TIMEOUT_S, procs,
                 ["run_model", "ray-a", "ray-b", "ray-c"])
        nodes = wait_for("three Ray nodes", lambda: ray_nodes(hosts, env, "a", RAY_PORT, 3),
                         120, procs, ["ray-a", "ray-b", "ray-c"])
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

