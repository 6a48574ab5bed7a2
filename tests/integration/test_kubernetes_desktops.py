"""Desktops as Kubernetes pods, through the official client and real HTTP to a Kubernetes API
test server (``tests.doubles.kube_api``) whose pods become real containers of the desktop
image (``tests.doubles.kubelet``): the conformance checker on a pod desktop, readiness from
the watch (no pod polled), each failure named or recovered from (quota, image pull,
unschedulable, eviction and OOM kills, the API server away, an expired watch), the sweep of
dead runs' pods (never a live run's), and the demo end to end with
``desktops.provider: kubernetes``. No cluster runs here: what this proves is the provider
against the API's protocol, with real desktops behind it."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import secrets
import signal
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from cua_rollout.config import DesktopsConfig
from cua_rollout.core.errors import DesktopError
from cua_rollout.envs.checker import check_desktop_env
from cua_rollout.envs.client import RemoteDesktopEnv
from cua_rollout.envs.providers.base import run_label
from cua_rollout.envs.providers.kubernetes import (
    HEARTBEAT_ANNOTATION,
    PROCESS_ANNOTATION,
    KubernetesProvider,
)
from tests.doubles.kube_api import (
    KubeAPIServer,
    evicted_status,
    oom_killed_status,
    unschedulable_status,
)
from tests.doubles.kubelet import ContainerKubelet
from tests.support import (
    REPO_ROOT,
    assert_every_episode_succeeded,
    desktop_image,
    slow_scripted_policy,
    until,
)

pytestmark = [pytest.mark.integration, pytest.mark.slow]

NAMESPACE = "rollout"
TEMPLATE = REPO_ROOT / "deploy" / "kubernetes" / "desktop-pod.yaml"
TOKEN_VAR = "CUA_K8S_TEST_DESKTOP_TOKEN"
TOKEN = secrets.token_hex(16)
RUN_TIMEOUT_S = 600


@pytest.fixture(scope="module")
def image() -> str:
    return desktop_image("demo")


class Cluster:
    def __init__(self, server: KubeAPIServer, kubelet: ContainerKubelet | None,
                 kubeconfig: Path) -> None:
        self.server, self.kubelet, self.kubeconfig = server, kubelet, kubeconfig

    def cfg(self, image: str, **k8s: Any) -> DesktopsConfig:
        base: dict[str, Any] = {
            "namespace": NAMESPACE, "image": image, "pod_template": str(TEMPLATE),
            "token_secret": "desk-token", "kubeconfig": str(self.kubeconfig),
            "startup_timeout_s": 120, "api_outage_s": 60, "api_timeout_s": 10,
            "heartbeat_interval_s": 1, "heartbeat_timeout_s": 5}
        base.update(k8s)
        return DesktopsConfig(provider="kubernetes", count=1, warm_spares=0,
                              screen_width=1280, screen_height=720, token_env=TOKEN_VAR,
                              lease_timeout_s=60, reset_timeout_s=60, kubernetes=base)

    def pod_gets(self) -> int:
        """GETs of single pods: readiness must come from the watch, not from polling."""
        return sum(1 for r in self.server.requests
                   if r.method == "GET" and "/pods/" in r.path and "watch" not in r.query)


def _cluster(tmp_path: Path, kubelet: ContainerKubelet | None, **kw: Any) -> Iterator[Cluster]:
    os.environ[TOKEN_VAR] = TOKEN
    server = KubeAPIServer(kubelet=kubelet, **kw)
    server.start()
    try:
        yield Cluster(server, kubelet, server.kubeconfig(tmp_path / "kubeconfig", NAMESPACE))
    finally:
        server.stop()
        if kubelet is not None:
            kubelet.close()


@pytest.fixture
def cluster(tmp_path) -> Iterator[Cluster]:
    """The API server with a kubelet that runs pods as real desktop containers."""
    yield from _cluster(tmp_path, ContainerKubelet({("desk-token", "token"): TOKEN}))


@pytest.fixture
def bare_cluster(tmp_path) -> Iterator[Cluster]:
    """The API server alone: pods stay Pending unless the test moves them."""
    yield from _cluster(tmp_path, None)


async def _closing(provider: KubernetesProvider, *desktops: Any) -> None:
    for desktop in desktops:
        await provider.stop(desktop)
    await provider.close()


async def test_a_pod_desktop_conforms_resets_in_place_and_is_removed(cluster, image):
    provider = KubernetesProvider(cluster.cfg(image))
    starts = []
    desktops = []
    try:
        for index in range(2):
            began = time.monotonic()
            desktops.append(await provider.start(index))
            starts.append(time.monotonic() - began)
        desktop = desktops[0]
        assert desktop.url.startswith("http://127.0.0.") and desktop.url.endswith(":5000")
        pod = cluster.server.pod(NAMESPACE, desktop.id)
        assert pod["metadata"]["labels"]["cua.run"] == provider.run
        assert pod["spec"]["securityContext"]["runAsNonRoot"] is True  # the template's
        env = RemoteDesktopEnv.for_lease(desktop.url, provider.cfg, name=desktop.id)
        seen = await check_desktop_env(env, screen_size=(1280, 720))
        assert seen["step"].returncode == 0  # pyautogui ran on the pod's display
        env = RemoteDesktopEnv.for_lease(desktop.url, provider.cfg, name=desktop.id)
        resets = []
        try:  # what an episode leaves is gone after the reset in place
            await env.execute(["bash", "-c", "echo x > ~/Desktop/left.txt"])
            for _ in range(3):
                began = time.monotonic()
                await provider.reset(desktop)
                resets.append(time.monotonic() - began)
                assert await provider.health(desktop)
            assert await env.get_file("/home/user/Desktop/left.txt") is None
        finally:
            await env.close()
        assert cluster.pod_gets() == 0, "a pod was polled; readiness must come from the watch"
        kubelet = sorted(round(t, 2) for t in cluster.kubelet.timings.values())
        print(f"pod start to ready (provider, 2 in a row): {[round(s, 2) for s in starts]} s; "
              f"kubelet create->Ready {kubelet} s; reset in place median "
              f"{statistics.median(resets):.2f} s")
    finally:
        await _closing(provider, *desktops)
    assert cluster.server.pods(NAMESPACE) == []
    await until(lambda: not _kubelet_containers(), timeout_s=30, poll_s=0.5)


def _kubelet_containers() -> list[str]:
    return subprocess.run(["podman", "ps", "-aq", "--filter", "label=cua.kubelet.pod"],
                          capture_output=True, text=True, check=True).stdout.split()


async def test_a_quota_refusal_and_a_missing_image_are_named(cluster, image):
    provider = KubernetesProvider(cluster.cfg(image))
    try:
        cluster.server.fail("create", "pods", 403, "Forbidden",
                            'pods "x" is forbidden: exceeded quota: compute-resources, '
                            "requested: pods=1, used: pods=4, limited: pods=4")
        with pytest.raises(DesktopError, match=r"refused the pod: HTTP 403: .*exceeded quota: "
                                               r"compute-resources"):
            await provider.start(0)
        missing = KubernetesProvider(cluster.cfg("localhost/cua-desktop:no-such-tag"))
        try:
            with pytest.raises(DesktopError,
                               match=r"ErrImagePull \(localhost/cua-desktop:no-such-tag\)"):
                await missing.start(0)
        finally:
            await missing.close()
        assert cluster.server.pods(NAMESPACE) == []  # the failed pod was deleted
    finally:
        await provider.close()


async def test_an_unschedulable_pod_names_the_resource_at_its_deadline(bare_cluster, image):
    provider = KubernetesProvider(bare_cluster.cfg(image, startup_timeout_s=3))
    try:
        start = asyncio.ensure_future(provider.start(0))
        await until(lambda: bare_cluster.server.pods(NAMESPACE) != [], timeout_s=10)
        name = bare_cluster.server.pods(NAMESPACE)[0]["metadata"]["name"]
        bare_cluster.server.update_pod_status(NAMESPACE, name, unschedulable_status())
        with pytest.raises(DesktopError, match=r"not ready after 3 s \(Unschedulable: 0/3 "
                                               r"nodes are available: 3 Insufficient memory"):
            await start
        assert bare_cluster.server.pods(NAMESPACE) == []
    finally:
        await provider.close()


async def test_a_per_pod_service_is_made_for_the_pod_and_removed_with_it(cluster, image):
    """``service_per_pod``: the URL is the Service's cluster name, which does not resolve on
    this machine, so the start fails at its deadline; the Service made for the pod (selecting
    it alone, on its port) is deleted with it."""
    provider = KubernetesProvider(cluster.cfg(image, service_per_pod=True,
                                              startup_timeout_s=15))
    try:
        with pytest.raises(DesktopError, match=r"\.rollout\.svc:5000 did not answer"):
            await provider.start(0)
    finally:
        await provider.close()
    made = [r for r in cluster.server.requests
            if r.method == "POST" and r.path.endswith("/services")]
    assert len(made) == 1
    deleted = [r for r in cluster.server.requests
               if r.method == "DELETE" and "/services/" in r.path]
    assert len(deleted) == 1 and deleted[0].path.rsplit("/", 1)[1].startswith("cua-r")
    assert cluster.server.services(NAMESPACE) == [] and cluster.server.pods(NAMESPACE) == []


async def test_evicted_and_oom_killed_pods_are_unhealthy(cluster, image):
    provider = KubernetesProvider(cluster.cfg(image))
    desktops = []
    try:
        desktops = [await provider.start(i) for i in range(2)]
        assert all([await provider.health(d) for d in desktops])
        evicted, oom = desktops
        cluster.server.update_pod_status(NAMESPACE, evicted.id, evicted_status())
        pod = cluster.server.pod(NAMESPACE, oom.id)
        cluster.server.update_pod_status(NAMESPACE, oom.id, oom_killed_status(pod))
        for desktop in desktops:
            for _ in range(50):
                if not await provider.health(desktop):
                    break
                await asyncio.sleep(0.1)
            assert not await provider.health(desktop), desktop.id
            with pytest.raises(DesktopError, match=r"not ready \((Evicted|its container "
                                                   r"ended: OOMKilled)"):
                await provider.reset(desktop)
    finally:
        await _closing(provider, *desktops)


async def test_the_api_server_away_leaves_held_desktops_working(cluster, image):
    provider = KubernetesProvider(cluster.cfg(image))
    desktops = []
    try:
        desktops.append(await provider.start(0))
        held = desktops[0]
        cluster.server.api_down()
        env = RemoteDesktopEnv(held.url, provider.cfg, name=held.id)
        try:
            assert await env.health()            # the desktop itself needs no API
            assert await provider.health(held)   # nor does its health
            second = asyncio.ensure_future(provider.start(1))
            await asyncio.sleep(3)
            assert not second.done()             # a new desktop waits for the API
            cluster.server.api_up()
            desktops.append(await asyncio.wait_for(second, 120))
            # The watch came back: an expired watch is re-listed, and readiness still
            # arrives by events.
            cluster.server.compact()
            desktops.append(await provider.start(2))
            assert await env.health()
        finally:
            await env.close()
        assert cluster.pod_gets() == 0
    finally:
        await _closing(provider, *desktops)


async def test_the_sweep_removes_dead_runs_pods_and_never_a_live_runs(bare_cluster, image):
    from kubernetes import client, config

    api = client.CoreV1Api(config.new_client_from_config(str(bare_cluster.kubeconfig)))
    now = time.time()
    host = socket.gethostname()
    dead_pid = 4_000_000  # above pid_max: never a running process
    pods = {
        "stale": {HEARTBEAT_ANNOTATION: f"{now - 600:.0f}", PROCESS_ANNOTATION: "other:1:1"},
        "live-elsewhere": {HEARTBEAT_ANNOTATION: f"{now:.0f}", PROCESS_ANNOTATION: "other:1:1"},
        "killed-here": {HEARTBEAT_ANNOTATION: f"{now:.0f}",
                        PROCESS_ANNOTATION: f"{host}:{dead_pid}:1"},
        "live-here": {HEARTBEAT_ANNOTATION: f"{now:.0f}",
                      PROCESS_ANNOTATION: run_label()},
    }
    for name, marks in pods.items():
        await asyncio.to_thread(api.create_namespaced_pod, NAMESPACE, {
            "metadata": {"name": name, "labels": {"cua.run": f"r-{name}"},
                         "annotations": marks},
            "spec": {"containers": [{"name": "desktop", "image": image}]}})
    provider = KubernetesProvider(bare_cluster.cfg(image))
    try:
        removed = await provider.sweep()
    finally:
        await provider.close()
    assert sorted(removed) == ["killed-here", "stale"]
    left = sorted(p["metadata"]["name"] for p in bare_cluster.server.pods(NAMESPACE))
    assert left == ["live-elsewhere", "live-here"]
    api.api_client.close()


def test_the_operators_tool_lists_and_sweeps_pods_without_a_live_run(bare_cluster, image,
                                                                     tmp_path):
    from kubernetes import client, config

    api = client.CoreV1Api(config.new_client_from_config(str(bare_cluster.kubeconfig)))
    for name, beat in (("old-run-pod", time.time() - 3600), ("live-run-pod", time.time())):
        api.create_namespaced_pod(NAMESPACE, {
            "metadata": {"name": name, "labels": {"cua.run": f"r-{name}"},
                         "annotations": {HEARTBEAT_ANNOTATION: f"{beat:.0f}",
                                         PROCESS_ANNOTATION: "elsewhere:1:1"}},
            "spec": {"containers": [{"name": "desktop", "image": image}]}})
    api.api_client.close()
    tool = [sys.executable, str(REPO_ROOT / "scripts" / "desktops.py")]
    sets = ["--config", str(REPO_ROOT / "configs" / "demo.yaml"),
            "--set", f"run.output_dir={tmp_path / 'results'}",
            "--set", "desktops.provider=kubernetes", "--set", f"desktops.token_env={TOKEN_VAR}",
            "--set", f"desktops.kubernetes.image={image}",
            "--set", f"desktops.kubernetes.namespace={NAMESPACE}",
            "--set", "desktops.kubernetes.token_secret=desk-token",
            "--set", f"desktops.kubernetes.kubeconfig={bare_cluster.kubeconfig}"]
    env = {**os.environ, TOKEN_VAR: TOKEN}
    status = subprocess.run([*tool, "status", "--json", *sets], cwd=REPO_ROOT, env=env,
                            capture_output=True, text=True, timeout=120)
    assert status.returncode == 0, status.stderr
    rows = {r["id"]: r for r in json.loads(status.stdout)["desktops"]}
    assert set(rows) == {"old-run-pod", "live-run-pod"}
    assert rows["old-run-pod"]["provider"]["heartbeat_age_s"] >= 3600
    assert rows["live-run-pod"]["state"] == "Pending"
    swept = subprocess.run([*tool, "sweep", *sets], cwd=REPO_ROOT, env=env,
                           capture_output=True, text=True, timeout=120)
    assert swept.returncode == 0, swept.stderr
    assert "removed 1 desktop(s) of runs that are gone: old-run-pod" in swept.stdout
    assert [p["metadata"]["name"] for p in bare_cluster.server.pods(NAMESPACE)] == [
        "live-run-pod"]


def _run_command(cluster: Cluster, image: str, tmp: Path, *sets: str) -> list[str]:
    args = [sys.executable, str(REPO_ROOT / "run.py"), "--config",
            str(REPO_ROOT / "configs" / "demo.yaml")]
    for s in (f"run.output_dir={tmp / 'results'}", "desktops.provider=kubernetes",
              f"desktops.token_env={TOKEN_VAR}", f"desktops.kubernetes.image={image}",
              f"desktops.kubernetes.namespace={NAMESPACE}",
              f"desktops.kubernetes.pod_template={TEMPLATE}",
              "desktops.kubernetes.token_secret=desk-token",
              f"desktops.kubernetes.kubeconfig={cluster.kubeconfig}",
              "ray.include_dashboard=false", *sets):
        args += ["--set", s]
    return args


def test_the_demo_on_kubernetes_desktops_and_a_killed_drivers_pods(cluster, image, tmp):
    """The demo with ``desktops.provider: kubernetes``, its driver killed with SIGKILL once
    its pods run: the pool actor ends with the driver's job, and the rerun's start deletes the
    pods it left (their process gone from this host) long before their heartbeat would
    expire; the rerun completes every episode and leaves no pod."""
    import psutil

    tasks = ["terminal-hello-file", "editor-save-new-file", "calc-add"]
    args = _run_command(cluster, image, tmp, f"tasks.task_ids={json.dumps(tasks)}",
                        "desktops.kubernetes.heartbeat_timeout_s=3600")
    env = {**os.environ, TOKEN_VAR: TOKEN}
    # The first run's policy is slow, so it is killed with its pods running.
    slow_policy = slow_scripted_policy(REPO_ROOT / "configs" / "demo.yaml",
                                       [f"tasks.task_ids={json.dumps(tasks)}"], latency_s=1.0)
    with slow_policy as slow:
        first = subprocess.Popen([*args, *(a for s in slow for a in ("--set", s))],
                                 cwd=REPO_ROOT, env=env, stdout=subprocess.DEVNULL,
                                 stderr=subprocess.DEVNULL, start_new_session=True)
        left: list[psutil.Process] = []
        try:
            def running_pods() -> list[dict[str, Any]]:
                return [p for p in cluster.server.pods(NAMESPACE)
                        if (p.get("status") or {}).get("phase") == "Running"]

            deadline = time.monotonic() + RUN_TIMEOUT_S
            while len(running_pods()) < 2:
                assert first.poll() is None and time.monotonic() < deadline
                time.sleep(0.2)
            time.sleep(2)  # episodes under way
            left = psutil.Process(first.pid).children(recursive=True)
            os.kill(first.pid, signal.SIGKILL)
            first.wait()
            orphans = sorted(p["metadata"]["name"] for p in cluster.server.pods(NAMESPACE))
            assert len(orphans) == 2, orphans
            owner = cluster.server.pod(NAMESPACE, orphans[0])["metadata"]["annotations"][
                PROCESS_ANNOTATION]
            pid = int(owner.rsplit(":", 2)[1])
            # The pool actor belonged to the killed driver's job: Ray ends it.
            end = time.monotonic() + 120
            while psutil.pid_exists(pid) and time.monotonic() < end:
                time.sleep(0.5)
            assert not psutil.pid_exists(pid), "the killed run's pool actor still runs"
            again = subprocess.run(args, cwd=REPO_ROOT, env=env, capture_output=True, text=True,
                                   timeout=RUN_TIMEOUT_S)
            assert again.returncode == 0, again.stderr[-3000:]
        finally:
            if first.poll() is None:
                first.kill()
            for proc in left:  # what the killed driver started (Ray), ended by pid
                with contextlib.suppress(psutil.NoSuchProcess):
                    proc.kill()
    removed = [r for r in cluster.server.requests
               if r.method == "DELETE" and any(r.path.endswith(f"/pods/{n}") for n in orphans)]
    assert len(removed) == 2, "the rerun's start did not delete the killed run's pods"
    results = assert_every_episode_succeeded(tmp / "results" / "demo", tasks)
    assert all(r["desktop"].startswith("cua-r") for r in results)
    assert cluster.server.pods(NAMESPACE) == [], "pods left after the run"
    assert cluster.pod_gets() == 0
