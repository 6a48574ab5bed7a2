"""VM desktops as Kubernetes pods (``desktops.kubernetes.reset: vm``): the pods of
``deploy/kubernetes/vm-desktop-pod.yaml`` created through the official client and the
Kubernetes API test server (``tests.doubles.kube_api``), each run by ``ProcessKubelet``
(``tests.doubles.kubelet``) as the VM launcher's process with the pod's env (the token from
the Secret, the pod IP from the downward API), so real QEMU runs behind every pod.

The template is the deploy one with its volumes made host paths of this test (the kubelet
runs pods on this host's filesystem): the base image, the spec (the ConfigMap's file), the
ready-state cache and the VMs' directory. The tiny test guest (``tests/doubles/vm_guest.py``)
serves all but the conformance test: a pod resets by restore (a mark made before is gone
after), its gate refuses a missing or wrong token and never passes the token to the guest, a
QEMU killed in the pod fails the pod and the pool replaces it, and nothing is left after (no
QEMU, no overlay, no socket). The conformance checker runs on the VM test image when it is
built (``scripts/build_vm_image.sh``), else that test is skipped; so does the launcher image
(``scripts/build_vm_launcher_image.sh``) run under podman. Times are printed (``-s``).
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import secrets
import shutil
import socket
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest
import yaml

from cua_rollout.config import DesktopsConfig
from cua_rollout.core.errors import DesktopError
from cua_rollout.envs.checker import check_desktop_env
from cua_rollout.envs.client import RemoteDesktopEnv
from cua_rollout.envs.providers.kubernetes import KubernetesProvider
from cua_rollout.runtime.pool import DesktopPool
from cua_rollout.vm.launcher import READY_PATH, RESET_PATH
from tests.doubles.kube_api import KubeAPIServer
from tests.doubles.kubelet import ProcessKubelet
from tests.doubles.vm_guest import SCREEN_HEIGHT, SCREEN_WIDTH, TestGuest, make_base_disk
from tests.support import (
    REPO_ROOT,
    kill_qemu_children,
    qemu_children,
    release_and_lease,
    until,
    vm_test_guest,
)

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(1800)]

NAMESPACE = "rollout"
TEMPLATE = REPO_ROOT / "deploy" / "kubernetes" / "vm-desktop-pod.yaml"
TOKEN_VAR = "CUA_K8S_VM_TEST_TOKEN"
TOKEN = secrets.token_hex(16)
SECRET = ("desk-token", "token")
GUEST_MEMORY_MB = 512
WAIT_S = 300  # TCG on a busy 2-core machine; the first pod also builds the ready state
VM_IMAGE = Path.home() / ".cache" / "cua-rollout" / "images" / "cua-desktop-vm.qcow2"
VM_STATES = Path.home() / ".cache" / "cua-rollout" / "vm-states"  # the user's, as a node's


@pytest.fixture(scope="module")
def guest() -> TestGuest:
    return vm_test_guest()


@pytest.fixture(scope="module")
def files() -> Iterator[Path]:
    """The module's host paths: a short root (QMP sockets live under vms/) with the base
    image, the ready-state cache kept across the module's pods (as a node's hostPath)."""
    path = Path(tempfile.mkdtemp(prefix="k8vm-", dir="/tmp"))
    try:
        (path / "images").mkdir()
        make_base_disk(path / "images" / "base.qcow2")
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(autouse=True)
def no_qemu_left(monkeypatch) -> Iterator[None]:
    """The token in the environment; after the test, no QEMU under this process."""
    monkeypatch.setenv(TOKEN_VAR, TOKEN)
    yield
    left = kill_qemu_children()  # not left for the next test, whatever this one asserted
    assert left == [], f"QEMU processes left: {left}"


def _qemus(parent: int | None = None) -> list[int]:
    return [p.pid for p in qemu_children(parent)]


def on_this_host(template: Path, where: dict[str, Path], args: dict[str, str],
                 extra_paths: list[Path] = ()) -> dict[str, Any]:
    """The deploy template as the process kubelet can run it: each volume (by name, in
    ``where``) a hostPath mounted at its own path, the launcher's arguments that named the
    old mount paths rewritten, ``args`` (``--flag``: value) replacing those flags, and
    ``extra_paths`` (the guest's kernel) mounted as they are."""
    pod = yaml.safe_load(template.read_text(encoding="utf-8"))
    box = pod["spec"]["containers"][0]
    moved: dict[str, str] = {}
    volumes = []
    mounts = []
    for mount in box["volumeMounts"]:
        host = str(where[mount["name"]])
        moved[mount["mountPath"]] = host
        volumes.append({"name": mount["name"], "hostPath": {"path": host}})
        mounts.append({**mount, "mountPath": host})
    for index, path in enumerate(extra_paths):
        volumes.append({"name": f"extra-{index}", "hostPath": {"path": str(path)}})
        mounts.append({"name": f"extra-{index}", "mountPath": str(path), "readOnly": True})
    out_args = []
    for arg in box["args"]:
        flag, _, value = arg.partition("=")
        if flag in args:
            value = args[flag]
        for old, new in moved.items():
            if value == old or value.startswith(old + "/"):
                value = new + value[len(old):]
        out_args.append(f"{flag}={value}")
    # DevTools and VLC on free ports: this host is shared (a test's socat may hold 9222 on
    # every address), where a real pod has its own network.
    for port in box["ports"]:
        if port["containerPort"] != 5000:
            free = _free_port()
            out_args.append(f"--gate-port={port['containerPort']}={free}")
            port["containerPort"] = free
    pod["spec"]["volumes"] = volumes
    box["volumeMounts"] = mounts
    box["args"] = out_args
    return pod


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Cluster:
    def __init__(self, server: KubeAPIServer, kubelet: ProcessKubelet, kubeconfig: Path,
                 template: Path) -> None:
        self.server, self.kubelet = server, kubelet
        self.kubeconfig, self.template = kubeconfig, template

    def cfg(self, *, screen: tuple[int, int] = (SCREEN_WIDTH, SCREEN_HEIGHT),
            verify: bool = False, k8s: dict[str, Any] | None = None, **kw: Any
            ) -> DesktopsConfig:
        settings = {"namespace": NAMESPACE, "image": "localhost/cua-vm-launcher:test",
               "pod_template": str(self.template), "token_secret": SECRET[0],
               "kubeconfig": str(self.kubeconfig), "reset": "vm", "cpu": "1",
               "memory": "2Gi", "startup_timeout_s": WAIT_S, "api_timeout_s": 10,
               "heartbeat_interval_s": 5, "heartbeat_timeout_s": 60, **(k8s or {})}
        return DesktopsConfig(**{
            "provider": "kubernetes", "count": 1, "warm_spares": 0,
            "screen_width": screen[0], "screen_height": screen[1], "token_env": TOKEN_VAR,
            "lease_timeout_s": WAIT_S, "reset_timeout_s": 120, "health_interval_s": 60,
            "verify": {"enabled": verify}, "kubernetes": settings, **kw})

    def pod_pid(self, name: str) -> int:
        pid = self.kubelet.pid_of(NAMESPACE, name)
        assert pid is not None, f"{name}: no process"
        return pid


def _cluster(tmp: Path, template: dict[str, Any]) -> Iterator[Cluster]:
    kubelet = ProcessKubelet({SECRET: TOKEN}, executables={
        "/opt/venv/bin/python": sys.executable}, base_env={
        "PATH": os.environ.get("PATH", os.defpath), "LANG": "C.UTF-8",
        "PYTHONPATH": str(REPO_ROOT)}, log_dir=tmp / "logs", ready_timeout_s=WAIT_S,
        grace_s=20)
    path = tmp / "vm-desktop-pod.yaml"
    path.write_text(yaml.safe_dump(template), encoding="utf-8")
    server = KubeAPIServer(kubelet=kubelet)
    server.start()
    try:
        yield Cluster(server, kubelet, server.kubeconfig(tmp / "kubeconfig", NAMESPACE), path)
    finally:
        server.stop()
        kubelet.close()


def _tiny_spec(files: Path, guest: TestGuest) -> Path:
    spec = files / "spec" / "spec.json"
    spec.parent.mkdir(exist_ok=True)
    spec.write_text(json.dumps({
        "image": str(files / "images" / "base.qcow2"), "firmware": "bios",
        "memory_mb": GUEST_MEMORY_MB, "cpus": 1, "accel": "tcg",
        "screen_width": SCREEN_WIDTH, "screen_height": SCREEN_HEIGHT,
        "kernel": str(guest.kernel), "initrd": str(guest.initrd), "append": guest.cmdline,
        "forwards": {"5000": 0, "9222": 0, "8080": 0}}))
    return spec


@pytest.fixture
def cluster(files, guest, tmp) -> Iterator[Cluster]:
    """Pods of the deploy template running the tiny guest; the module's cache."""
    _tiny_spec(files, guest)
    for sub in ("states", "vms"):
        (files / sub).mkdir(exist_ok=True)
    template = on_this_host(TEMPLATE, {
        "images": files / "images", "spec": files / "spec", "states": files / "states",
        "vms": files / "vms"}, {"--ready-path": "/hello", "--reset-timeout-s": "60"},
        extra_paths=[guest.kernel.parent])
    yield from _cluster(tmp, template)


def _auth(token: str = TOKEN) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


async def _nothing_left(files: Path, cluster: Cluster, pids: list[int]) -> None:
    """No pod, no pod's process (the kubelet ends a deleted pod's in the background, as a
    real one does: waited for), no QEMU, no VM directory."""
    assert cluster.server.pods(NAMESPACE) == [], "pods left"
    await until(lambda: all(_gone(p) for p in pids), timeout_s=60, poll_s=0.2)
    assert _qemus() == [], "QEMU left"
    left = list((files / "vms").iterdir())
    assert left == [], f"VM directories (overlays, QMP sockets) left: {left}"


async def _stop_all(provider: KubernetesProvider, desktops: list[Any]) -> None:
    for desktop in desktops:
        await provider.stop(desktop)
    await provider.close()


# --------------------------------------------------------------------------- the tiny guest


async def test_a_vm_pod_resets_by_restore_and_its_gate_keeps_the_token_out(cluster, files):
    provider = KubernetesProvider(cluster.cfg())
    desktops: list[Any] = []
    pids: list[int] = []
    try:
        began = time.monotonic()
        first = await provider.start(0)  # builds the ready state (a first boot) if not cached
        desktops.append(first)
        first_s = time.monotonic() - began
        pids.append(cluster.pod_pid(first.id))
        await provider.stop(first)
        desktops.remove(first)
        await until(lambda: _qemus() == [], timeout_s=60, poll_s=0.2)
        began = time.monotonic()
        desktop = await provider.start(1)  # from the cached state
        desktops.append(desktop)
        cached_s = time.monotonic() - began
        pids.append(cluster.pod_pid(desktop.id))
        pod = cluster.server.pod(NAMESPACE, desktop.id)
        ip = pod["status"]["podIP"]
        assert desktop.url == f"http://{ip}:5000"
        url = desktop.url
        async with httpx.AsyncClient(timeout=30, trust_env=False) as client:
            # The gate: the token checked on every path, the launcher's own ones too.
            assert (await client.get(f"{url}/hello", headers=_auth())).status_code == 200
            for headers in ({}, _auth("wrong"), {"Authorization": f"Basic {TOKEN}"}):
                assert (await client.get(f"{url}/hello", headers=headers)).status_code == 401
                assert (await client.post(f"{url}{RESET_PATH}",
                                          headers=headers)).status_code == 401
            ports = await client.get(f"{url}/ports", headers=_auth())
            gates = {p["name"]: p["containerPort"] for p in pod["spec"]["containers"][0]["ports"]}
            assert ports.json() == {"chromium": gates["devtools"], "vlc": gates["vlc"]}
            probe = await client.get(f"{url}{READY_PATH}")  # the kubelet's probe: no token
            assert probe.status_code == 200 and probe.json()["ready"] is True

            # What an episode leaves is gone after each reset (the guest's RAM restored).
            resets = []
            for _ in range(3):
                assert (await client.get(f"{url}/cgi-bin/mark",
                                         headers=_auth())).status_code == 200
                assert (await client.get(f"{url}/mark", headers=_auth())).status_code == 200
                began = time.monotonic()
                await provider.reset(desktop)
                resets.append(time.monotonic() - began)
                assert (await client.get(f"{url}/mark", headers=_auth())).status_code == 404
                assert await provider.health(desktop)
            assert desktop.info["last_reset"]["how"] == "restore"

            seen = (await client.get(f"{url}/requests", headers=_auth())).text
            assert "GET /requests" in seen
            assert "authorization" not in seen.lower() and TOKEN not in seen
        # Nor is the token in QEMU's environment: the launcher took it out of its own.
        (qemu,) = _qemus(pids[-1])
        assert TOKEN.encode() not in Path(f"/proc/{qemu}/environ").read_bytes()
        kubelet = cluster.kubelet.timings[desktop.id]
        print(f"\nvm pod create -> Ready: first (building the ready state) {first_s:.1f} s; "
              f"from the cached state {cached_s:.2f} s (kubelet create->Ready "
              f"{kubelet:.2f} s); reset via {RESET_PATH} {[round(r, 2) for r in resets]} s "
              f"(median {statistics.median(resets):.2f})")
    finally:
        await _stop_all(provider, desktops)
    await _nothing_left(files, cluster, pids)


async def test_a_qemu_killed_in_a_pod_fails_it_and_the_pool_replaces_it(cluster, files):
    """QEMU killed under a leased desktop (the guest crashed, the OOM killer): the launcher
    exits 1 and the pod fails with its last words; the provider says it is unhealthy and
    names why; the episode's release resets it, the reset names the failed pod, and the pool
    quarantines it and starts another pod in its place."""
    pool = DesktopPool(cluster.cfg())
    await pool.start()
    provider = pool.provider
    assert isinstance(provider, KubernetesProvider)
    pids: list[int] = []
    try:
        lease = await pool.lease("doomed")
        desktop = pool._desktops[lease.desktop_id]
        pid = cluster.pod_pid(desktop.id)
        pids.append(pid)
        (qemu,) = _qemus(pid)
        psutil.Process(qemu).kill()

        def status() -> dict[str, Any]:
            return (cluster.server.pod(NAMESPACE, desktop.id) or {}).get("status") or {}

        await until(lambda: status().get("phase") == "Failed", timeout_s=60, poll_s=0.2)
        terminated = status()["containerStatuses"][0]["state"]["terminated"]
        assert terminated["exitCode"] == 1 and "QEMU exited" in terminated["message"]
        await until(lambda: provider._pods[desktop.id]["status"].get("phase") == "Failed",
                    timeout_s=30, poll_s=0.1)  # the provider's watch saw it
        assert not await provider.health(desktop)
        with pytest.raises(DesktopError, match=r"(?s)not ready \(its container ended: Error "
                                               r"\(exit code 1\): .*QEMU exited"):
            await provider.reset(desktop)
        await pool.release(lease.lease_id)
        await until(lambda: pool.counters["replaced"] == 1 and len(pool._desktops) == 1
                    and desktop.id not in pool._desktops, timeout_s=WAIT_S, poll_s=0.2)
        assert pool.counters["quarantined"] == 1
        lease = await pool.lease("after-the-kill")
        assert lease.desktop_id != desktop.id
        pids.append(cluster.pod_pid(lease.desktop_id))
        async with httpx.AsyncClient(timeout=30, trust_env=False) as client:
            assert (await client.get(f"{lease.url}/hello", headers=_auth())).status_code == 200
        await pool.release(lease.lease_id)
    finally:
        await pool.stop()
    await _nothing_left(files, cluster, pids)


# --------------------------------------------------------------------------- the VM image


@pytest.fixture
def image_cluster(tmp) -> Iterator[Cluster]:
    """Pods of the deploy template running the VM test image, if it is built; the user's
    ready-state cache (shared with the ``vm`` provider's tests: same image, same machine)."""
    if not VM_IMAGE.exists():
        pytest.skip(f"the VM test image is not built ({VM_IMAGE}: scripts/build_vm_image.sh)")
    spec = tmp / "spec" / "spec.json"
    spec.parent.mkdir()
    deploy_spec = json.loads((REPO_ROOT / "deploy" / "kubernetes" / "vm-spec.json").read_text())
    spec.write_text(json.dumps({**deploy_spec, "image": str(VM_IMAGE), "memory_mb": 1024,
                                "cpus": 1, "screen_width": 1280, "screen_height": 720}))
    VM_STATES.mkdir(parents=True, exist_ok=True)
    (tmp / "vms").mkdir()
    template = on_this_host(TEMPLATE, {"images": VM_IMAGE.parent, "spec": spec.parent,
                                       "states": VM_STATES, "vms": tmp / "vms"},
                            {"--reset-timeout-s": "300"})
    yield from _cluster(tmp, template)


async def test_a_vm_pod_of_the_image_conforms_and_its_reset_passes_the_check(image_cluster,
                                                                           tmp):
    """The conformance checker on a pod of the VM test image; then, as a run does it, the
    pool's reset (the launcher's restore) and its reset check after each release."""
    # A first boot of the image under TCG builds the ready state when none is cached.
    cfg = image_cluster.cfg(screen=(1280, 720), verify=True, k8s={"startup_timeout_s": 1500})
    pool = DesktopPool(cfg)
    began = time.monotonic()
    await pool.start()
    start_s = time.monotonic() - began
    resets: list[float] = []
    pids: list[int] = []
    try:
        (desktop,) = list(pool._desktops.values())
        pids.append(image_cluster.pod_pid(desktop.id))
        lease = await pool.lease("conformance")
        env = RemoteDesktopEnv.for_lease(lease.url, cfg, name=lease.desktop_id)
        seen = await check_desktop_env(env, screen_size=(1280, 720))
        assert seen["step"].returncode == 0  # pyautogui ran on the VM's display
        env = RemoteDesktopEnv.for_lease(lease.url, cfg, name=lease.desktop_id)
        try:
            await env.execute(["bash", "-c", "echo x > ~/Desktop/left.txt"])
        finally:
            await env.close()
        lease, took = await release_and_lease(pool, lease, 2)
        resets += took
        stats = pool.stats()
        assert (stats["verify_failures"], stats["quarantined"], stats["replaced"]) == (0, 0, 0)
        env = RemoteDesktopEnv.for_lease(lease.url, cfg, name=lease.desktop_id)
        try:
            assert await env.get_file("/home/user/Desktop/left.txt") is None
        finally:
            await env.close()
        await pool.release(lease.lease_id)
    finally:
        await pool.stop()
    assert image_cluster.server.pods(NAMESPACE) == [] and _qemus() == []
    print(f"\nvm image pod: pool start {start_s:.1f} s; release + /vm/reset + verify + lease "
          f"{[round(r, 2) for r in resets]} s")


def test_the_template_on_this_host_keeps_the_deploy_pods_shape(files, guest):
    """What the tests change in the deploy template: volume sources and paths, two flags;
    the rest (command, probe, env, ports, resources) is the deploy file's."""
    deploy = yaml.safe_load(TEMPLATE.read_text(encoding="utf-8"))
    here = on_this_host(TEMPLATE, {"images": files / "images", "spec": files / "spec",
                                   "states": files / "states", "vms": files / "vms"},
                        {"--ready-path": "/hello"})
    a, b = copy.deepcopy(deploy["spec"]["containers"][0]), here["spec"]["containers"][0]
    for key in ("command", "env", "resources", "readinessProbe", "terminationMessagePolicy"):
        assert a[key] == b[key], key
    assert "--gate=$(POD_IP)" in b["args"] and "--ready-path=/hello" in b["args"]
    assert f"--spec={files / 'spec' / 'spec.json'}" in b["args"]


# --------------------------------------------------------------------------- the image


def test_the_launcher_image_serves_resets_and_stops_a_vm(files, guest, tmp):
    """The launcher image (``scripts/build_vm_launcher_image.sh``) as a pod's container would
    run it: non-root, the volumes of the template at their mount paths, the token in its
    env, the gate on the container's address (published on a loopback IP here). The tiny
    guest under TCG: ready, token checked, a mark gone after ``POST /vm/reset``, a clean exit
    on SIGTERM with no VM directory left."""
    import subprocess

    engine = shutil.which("podman")
    tag = subprocess.run(["bash", str(REPO_ROOT / "scripts" / "build_vm_launcher_image.sh"),
                          "--print-tag"], capture_output=True, text=True, check=True,
                         timeout=60).stdout.strip()
    if engine is None or subprocess.run([engine, "image", "exists", tag]).returncode != 0:
        pytest.skip(f"the launcher image {tag} is not built "
                    "(scripts/build_vm_launcher_image.sh)")
    # The container's user (uid 1000) reads the guest and writes the cache and VM dirs.
    for sub in ("guest", "spec", "states", "vms"):
        (tmp / sub).mkdir(mode=0o777)
        (tmp / sub).chmod(0o777)
    for path in (guest.kernel, guest.initrd):
        shutil.copy(path, tmp / "guest" / path.name)
    (tmp / "spec" / "spec.json").write_text(json.dumps({
        "image": "/images/base.qcow2", "firmware": "bios", "memory_mb": GUEST_MEMORY_MB,
        "cpus": 1, "accel": "tcg", "kernel": f"/guest/{guest.kernel.name}",
        "initrd": f"/guest/{guest.initrd.name}", "append": guest.cmdline,
        "forwards": {"5000": 0}}))
    tmp.chmod(0o755)
    ip = "127.0.0.250"
    name = f"cua-launcher-test-{secrets.token_hex(3)}"
    run = [engine, "run", "-d", "--name", name, "--runtime", "runc",
           "--ulimit", "nofile=1024:1024", "--ulimit", "nproc=4096:4096",
           "-p", f"{ip}:5000:5000", "-e", "CUA_DESKTOP_TOKEN",
           "-v", f"{files / 'images'}:/images:ro", "-v", f"{tmp / 'spec'}:/etc/cua-vm:ro",
           "-v", f"{tmp / 'guest'}:/guest:ro", "-v", f"{tmp / 'states'}:/var/cache/cua-vm-states",
           "-v", f"{tmp / 'vms'}:/run/cua-vms", tag, "--spec=/etc/cua-vm/spec.json",
           "--root=/run/cua-vms", "--cache=/var/cache/cua-vm-states", "--ready-path=/hello",
           "--gate=0.0.0.0"]
    subprocess.run(run, check=True, capture_output=True, timeout=120,
                   env={**os.environ, "CUA_DESKTOP_TOKEN": TOKEN})
    try:
        url = f"http://{ip}:5000"
        with httpx.Client(timeout=10, trust_env=False) as client:
            deadline = time.monotonic() + WAIT_S
            while True:
                with contextlib.suppress(httpx.HTTPError):
                    if client.get(f"{url}{READY_PATH}").status_code == 200:
                        break
                assert time.monotonic() < deadline, "the launcher's VM never got ready"
                time.sleep(0.5)
            assert client.get(f"{url}/hello").status_code == 401
            assert client.get(f"{url}/cgi-bin/mark", headers=_auth()).status_code == 200
            reset = client.post(f"{url}{RESET_PATH}", headers=_auth(), timeout=120)
            assert reset.status_code == 200, reset.text
            assert client.get(f"{url}/mark", headers=_auth()).status_code == 404
        subprocess.run([engine, "stop", "-t", "20", name], check=True, capture_output=True,
                       timeout=60)
        code = subprocess.run([engine, "inspect", name, "--format", "{{.State.ExitCode}}"],
                              capture_output=True, text=True, check=True).stdout.strip()
        assert code == "0"
        assert list((tmp / "vms").iterdir()) == []
        print(f"\nlauncher image: reset via {RESET_PATH} {reset.json()['seconds']} s")
    finally:
        subprocess.run([engine, "rm", "-f", "-t", "0", name], capture_output=True, timeout=60)
