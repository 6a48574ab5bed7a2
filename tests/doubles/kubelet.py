"""A kubelet for the Kubernetes API test server (``tests.doubles.kube_api``): each pod created
through the API becomes a real container of its image on this machine's engine (podman or
docker), so a desktop the Kubernetes provider asked for is a real desktop.

What a kubelet does, as far as a desktop pod needs: the pod is scheduled at once, its image
must exist in the engine (else ``ErrImagePull``, as with a registry that lacks it), its
container runs with the pod's env (``secretKeyRef`` values from ``secrets``), CPU and memory
limits, and its port published on a loopback address of its own (``127.0.0.N``, the pod's
IP); the readiness probe's ``exec`` command is run in the container (``exec``) until it
passes, then the pod is ``Running`` and ``Ready``. A container that exits makes the pod
``Failed`` with its exit code (``OOMKilled`` when the engine says so). Deleting the pod
removes the container. Everything it started is removed by ``close()``.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import shutil
import subprocess
import threading
import time
from typing import Any

__all__ = ["ContainerKubelet"]

log = logging.getLogger(__name__)

_PROBE_PERIOD_S = 0.25
_ENGINE_TIMEOUT_S = 120.0


class ContainerKubelet:
    """Runs pods as containers; give it to ``KubeAPIServer(kubelet=...)``."""

    def __init__(self, secrets: dict[tuple[str, str], str] | None = None, *,
                 engine: str | None = None, ready_timeout_s: float = 120.0) -> None:
        self.secrets = dict(secrets or {})  # (secret name, key) -> value
        self.engine = engine or shutil.which("podman") or shutil.which("docker") or "podman"
        self.ready_timeout_s = ready_timeout_s
        self._ips = itertools.count(10)
        self._lock = threading.Lock()
        self._containers: dict[tuple[str, str], str] = {}  # (namespace, pod) -> container
        self._deleted: set[tuple[str, str]] = set()
        self._threads: list[threading.Thread] = []
        self.timings: dict[str, float] = {}   # pod name -> seconds from create to Ready

    # ----------------------------------------------------------------- the hooks

    def on_create(self, server: Any, pod: dict[str, Any]) -> None:
        thread = threading.Thread(target=self._run_pod, args=(server, pod), daemon=True)
        with self._lock:
            self._threads.append(thread)
        thread.start()

    def on_delete(self, server: Any, pod: dict[str, Any]) -> None:
        meta = pod.get("metadata") or {}
        key = (meta.get("namespace") or "default", meta.get("name") or "")
        with self._lock:
            self._deleted.add(key)
            container = self._containers.pop(key, None)
        if container is not None:
            thread = threading.Thread(target=self._remove, args=(container,), daemon=True)
            with self._lock:
                self._threads.append(thread)
            thread.start()

    def container_of(self, namespace: str, name: str) -> str | None:
        """The engine's id of a pod's container (None: not running here)."""
        with self._lock:
            return self._containers.get((namespace, name))

    def close(self) -> None:
        """Remove every container this kubelet started; wait for its threads."""
        with self._lock:
            containers = list(self._containers.values())
            self._containers.clear()
            threads = list(self._threads)
        for container in containers:
            self._remove(container)
        for thread in threads:
            thread.join(timeout=_ENGINE_TIMEOUT_S)

    # ----------------------------------------------------------------- one pod

    def _run_pod(self, server: Any, pod: dict[str, Any]) -> None:
        with contextlib.suppress(KeyError):  # the pod was deleted meanwhile (a 404)
            self._run(server, pod)

    def _run(self, server: Any, pod: dict[str, Any]) -> None:
        started = time.monotonic()
        meta, spec = pod["metadata"], pod["spec"]
        namespace, name = meta.get("namespace") or "default", meta["name"]
        key = (namespace, name)
        box = next((c for c in spec["containers"] if c.get("name") == "desktop"),
                   spec["containers"][0])
        image = box.get("image") or ""
        server.update_pod_status(namespace, name, {
            "conditions": [{"type": "PodScheduled", "status": "True"}],
            "containerStatuses": [{"name": box.get("name", "desktop"), "image": image,
                                   "imageID": "", "ready": False, "restartCount": 0,
                                   "state": {"waiting": {"reason": "ContainerCreating"}}}]})
        if self._engine("image", "exists", image, check=False).returncode != 0:
            server.update_pod_status(namespace, name, {"containerStatuses": [{
                "name": box.get("name", "desktop"), "image": image, "imageID": "",
                "ready": False, "restartCount": 0, "state": {"waiting": {
                    "reason": "ErrImagePull",
                    "message": f'failed to pull image "{image}": not found'}}}]})
            return
        ip = f"127.0.0.{next(self._ips)}"
        args = ["run", "-d", "--name", f"cua-kubelet-{name}", "--no-healthcheck",
                "--label", f"cua.kubelet.pod={namespace}/{name}"]
        if os.path.basename(self.engine) == "podman":
            args += ["--runtime", "runc", "--ulimit", "nofile=1024:1024",
                     "--ulimit", "nproc=4096:4096"]
        limits = (box.get("resources") or {}).get("limits") or {}
        if "cpu" in limits:
            args += ["--cpus", _cpus(str(limits["cpu"]))]
        if "memory" in limits:
            args += ["--memory", _bytes(str(limits["memory"]))]
        for port in box.get("ports") or []:
            number = port["containerPort"]
            args += ["-p", f"{ip}:{number}:{number}"]
        env = dict(os.environ)
        for var in box.get("env") or []:
            ref = ((var.get("valueFrom") or {}).get("secretKeyRef")) or None
            value = self.secrets.get((ref["name"], ref["key"])) if ref else var.get("value")
            if value is None:
                continue
            env[var["name"]] = value
            args += ["-e", var["name"]]  # the value from the CLI's environment, not argv
        args.append(image)
        done = self._engine(*args, env=env, check=False)
        if done.returncode != 0:
            server.update_pod_status(namespace, name, {"phase": "Failed", "reason": "Error",
                                                       "message": done.stderr[-300:]})
            return
        container = done.stdout.strip()
        with self._lock:
            if key in self._deleted:  # deleted while it was starting
                gone = True
            else:
                self._containers[key] = container
                gone = False
        if gone:
            self._remove(container)
            return
        server.update_pod_status(namespace, name, {"podIP": ip, "podIPs": [{"ip": ip}],
                                                   "hostIP": "127.0.0.1"})
        probe = ((box.get("readinessProbe") or {}).get("exec") or {}).get("command")
        deadline = started + self.ready_timeout_s
        while time.monotonic() < deadline:
            with self._lock:
                if key in self._deleted:
                    return
            state = self._state(container)
            if state is not None and not state["running"]:
                server.update_pod_status(namespace, name, _ended(box, image, state))
                return
            if probe is None or self._engine("exec", container, *probe,
                                             check=False).returncode == 0:
                self.timings[name] = time.monotonic() - started
                server.set_pod_phase_running(namespace, name, ip, ready=True)
                with contextlib.suppress(KeyError):
                    self._watch_container(server, key, container, box, image)
                return
            time.sleep(_PROBE_PERIOD_S)
        server.update_pod_status(namespace, name, {"conditions": [
            {"type": "PodScheduled", "status": "True"},
            {"type": "Ready", "status": "False", "reason": "ContainersNotReady"}]})

    def _watch_container(self, server: Any, key: tuple[str, str], container: str,
                         box: dict[str, Any], image: str) -> None:
        """While the pod lives: a container that exits makes it Failed."""
        while True:
            time.sleep(1.0)
            with self._lock:
                if key in self._deleted or self._containers.get(key) != container:
                    return
            state = self._state(container)
            if state is not None and not state["running"]:
                server.update_pod_status(key[0], key[1], _ended(box, image, state))
                return

    def _state(self, container: str) -> dict[str, Any] | None:
        done = self._engine("inspect", "--format",
                            "{{.State.Running}} {{.State.ExitCode}} {{.State.OOMKilled}}",
                            container, check=False)
        if done.returncode != 0:
            return None
        running, code, oom = ([*done.stdout.split(), "", "", ""])[:3]
        return {"running": running == "true", "exit_code": int(code or 0),
                "oom": oom == "true"}

    def _remove(self, container: str) -> None:
        with contextlib.suppress(subprocess.SubprocessError, OSError):
            self._engine("rm", "-f", "-t", "0", container, check=False)

    def _engine(self, *args: str, env: dict[str, str] | None = None, check: bool = True
                ) -> subprocess.CompletedProcess[str]:
        return subprocess.run([self.engine, *args], capture_output=True, text=True,
                              stdin=subprocess.DEVNULL, env=env, timeout=_ENGINE_TIMEOUT_S,
                              check=check)


def _ended(box: dict[str, Any], image: str, state: dict[str, Any]) -> dict[str, Any]:
    reason = "OOMKilled" if state["oom"] else ("Completed" if state["exit_code"] == 0
                                               else "Error")
    return {"phase": "Failed", "containerStatuses": [{
        "name": box.get("name", "desktop"), "image": image, "imageID": "", "ready": False,
        "restartCount": 0,
        "state": {"terminated": {"reason": reason, "exitCode": state["exit_code"]}}}]}


def _cpus(quantity: str) -> str:
    """A Kubernetes CPU quantity (``"1"``, ``"500m"``) as the engine's ``--cpus``."""
    return f"{int(quantity[:-1]) / 1000:g}" if quantity.endswith("m") else quantity


def _bytes(quantity: str) -> str:
    """A Kubernetes memory quantity (``"2Gi"``, ``"512Mi"``) as the engine's ``--memory``."""
    for suffix, unit in (("Ki", "k"), ("Mi", "m"), ("Gi", "g")):
        if quantity.endswith(suffix):
            return quantity[:-2] + unit
    return quantity
