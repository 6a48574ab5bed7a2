"""Kubelets for the Kubernetes API test server (``tests.doubles.kube_api``): each pod created
through the API runs for real on this machine, so a desktop the Kubernetes provider asked for
is a real desktop. Two runtimes share one pod lifecycle (``_Kubelet``):

- ``ContainerKubelet``: the pod's image as a container of this machine's engine (podman or
  docker). The image must exist in the engine (else ``ErrImagePull``, as with a registry that
  lacks it); CPU and memory limits apply; the container's ports are published on the pod's
  IP; an ``exec`` probe runs in the container. Deleting the pod removes the container.
- ``ProcessKubelet``: the container's ``command`` and ``args`` as a process of this host, as
  they would run in the container (the image is not run: ``executables`` maps the image's
  interpreter to this host's, ``base_env`` stands for the image's ``ENV``). Volumes must be
  ``hostPath`` ones mounted at their own path (the process sees the host's filesystem);
  limits are not applied. Deleting the pod sends SIGTERM, then SIGKILL after the grace period
  to the process and what it started, by pid. For the VM launcher's pods: QEMU in the pod.

What a kubelet does, as far as a desktop pod needs: the pod is scheduled at once; its
container gets the pod's env (``value``, ``secretKeyRef`` values from ``secrets``, the
downward API's ``status.podIP``, ``metadata.name`` and ``metadata.namespace``; ``$(VAR)`` in
``command`` and ``args`` expanded from it, as Kubernetes does) and a loopback address of its
own (``127.0.0.N``, the pod's IP); the readiness probe (``exec``, or ``httpGet`` on the pod's
IP) is run until it passes, then the pod is ``Running`` and ``Ready``. A container that exits
makes the pod ``Failed`` with its exit code (``OOMKilled`` when the engine says so; with
``terminationMessagePolicy: FallbackToLogsOnError``, the end of its log as the message).
Everything a kubelet started is ended by ``close()``.
"""

from __future__ import annotations

import contextlib
import http.client
import itertools
import logging
import os
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import psutil

__all__ = ["ContainerKubelet", "ProcessKubelet"]

log = logging.getLogger(__name__)

_PROBE_PERIOD_S = 0.25
_WATCH_PERIOD_S = 0.5
_ENGINE_TIMEOUT_S = 120.0
_PROBE_TIMEOUT_S = 5.0
# Kubernetes' FallbackToLogsOnError: the last 80 lines or 2048 bytes of the log, the smaller.
_LOG_MESSAGE_LINES = 80
_LOG_MESSAGE_BYTES = 2048
_VAR_REF = re.compile(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_.-]*)\)")
_IPS = itertools.count(10)  # one counter per process: two kubelets never share a pod IP
_IPS_LOCK = threading.Lock()


class _Kubelet:
    """A pod's life, whatever runs it: subclasses start, watch, probe and remove the thing
    (a container, a process) that ``_launch`` returns as the pod's handle."""

    def __init__(self, secrets: dict[tuple[str, str], str] | None, ready_timeout_s: float
                 ) -> None:
        self.secrets = dict(secrets or {})  # (secret name, key) -> value
        self.ready_timeout_s = ready_timeout_s
        self._lock = threading.Lock()
        self._handles: dict[tuple[str, str], Any] = {}  # (namespace, pod) -> handle
        self._deleted: set[tuple[str, str]] = set()
        self._threads: list[threading.Thread] = []
        self.timings: dict[str, float] = {}   # pod name -> seconds from create to Ready

    # ----------------------------------------------------------------- the hooks

    def on_create(self, server: Any, pod: dict[str, Any]) -> None:
        self._thread(self._run_pod, server, pod)

    def on_delete(self, server: Any, pod: dict[str, Any]) -> None:
        meta = pod.get("metadata") or {}
        key = (meta.get("namespace") or "default", meta.get("name") or "")
        with self._lock:
            self._deleted.add(key)
            handle = self._handles.pop(key, None)
        if handle is not None:
            self._thread(self._remove, handle)

    def close(self) -> None:
        """End everything this kubelet started; wait for its threads."""
        with self._lock:
            handles = list(self._handles.values())
            self._handles.clear()
            threads = list(self._threads)
        for handle in handles:
            self._remove(handle)
        for thread in threads:
            thread.join(timeout=_ENGINE_TIMEOUT_S)

    def _thread(self, target: Any, *args: Any) -> None:
        thread = threading.Thread(target=target, args=args, daemon=True)
        with self._lock:
            self._threads.append(thread)
        thread.start()

    def _handle(self, namespace: str, name: str) -> Any:
        with self._lock:
            return self._handles.get((namespace, name))

    # ----------------------------------------------------------------- what runtimes do

    def _launch(self, server: Any, pod: dict[str, Any], box: dict[str, Any], ip: str,
                env: dict[str, str]) -> Any:
        """Start the pod's container; its handle, or None after reporting why it could
        not start (the pod's status set here)."""
        raise NotImplementedError

    def _state(self, handle: Any) -> dict[str, Any] | None:
        """``{"running", "exit_code", "oom", "log"}`` of the container (None: unknown)."""
        raise NotImplementedError

    def _exec(self, handle: Any, command: list[str], env: dict[str, str]) -> bool:
        """Run an ``exec`` probe's command in the container: whether it exited 0."""
        raise NotImplementedError

    def _remove(self, handle: Any) -> None:
        raise NotImplementedError

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
            "containerStatuses": [_container_status(box, {"waiting": {
                "reason": "ContainerCreating"}})]})
        ip = _pod_ip([p["containerPort"] for p in box.get("ports") or []])
        env = self._env(pod, box, ip)
        handle = self._launch(server, pod, box, ip, env)
        if handle is None:
            return
        with self._lock:
            gone = key in self._deleted  # deleted while it was starting
            if not gone:
                self._handles[key] = handle
        if gone:
            self._remove(handle)
            return
        server.update_pod_status(namespace, name, {"podIP": ip, "podIPs": [{"ip": ip}],
                                                   "hostIP": "127.0.0.1"})
        probe = box.get("readinessProbe") or {}
        deadline = started + self.ready_timeout_s
        while time.monotonic() < deadline:
            with self._lock:
                if key in self._deleted:
                    return
            state = self._state(handle)
            if state is not None and not state["running"]:
                server.update_pod_status(namespace, name, _ended(box, image, state))
                return
            if self._ready(handle, probe, box, ip, env):
                self.timings[name] = time.monotonic() - started
                server.set_pod_phase_running(namespace, name, ip, ready=True)
                with contextlib.suppress(KeyError):
                    self._watch(server, key, handle, box, image)
                return
            time.sleep(_PROBE_PERIOD_S)
        server.update_pod_status(namespace, name, {"conditions": [
            {"type": "PodScheduled", "status": "True"},
            {"type": "Ready", "status": "False", "reason": "ContainersNotReady"}]})

    def _env(self, pod: dict[str, Any], box: dict[str, Any], ip: str) -> dict[str, str]:
        """The container's env as Kubernetes gives it (later entries may use earlier ones in
        ``$(VAR)``); an entry whose Secret key is unknown is left out."""
        meta = pod["metadata"]
        fields = {"status.podIP": ip, "metadata.name": meta["name"],
                  "metadata.namespace": meta.get("namespace") or "default"}
        env: dict[str, str] = {}
        for var in box.get("env") or []:
            source = var.get("valueFrom") or {}
            if "secretKeyRef" in source:
                ref = source["secretKeyRef"]
                value = self.secrets.get((ref["name"], ref["key"]))
            elif "fieldRef" in source:
                value = fields.get(source["fieldRef"]["fieldPath"])
            else:
                value = _expand(var.get("value") or "", env)
            if value is not None:
                env[var["name"]] = value
        return env

    def _ready(self, handle: Any, probe: dict[str, Any], box: dict[str, Any], ip: str,
               env: dict[str, str]) -> bool:
        if "exec" in probe:
            return self._exec(handle, list(probe["exec"]["command"]), env)
        if "httpGet" in probe:
            get = probe["httpGet"]
            port = get["port"]
            if isinstance(port, str):  # a named port of the container
                port = next(p["containerPort"] for p in box.get("ports") or []
                            if p.get("name") == port)
            return _http_status(ip, int(port), get.get("path") or "/") in range(200, 400)
        return True  # no probe: ready once started

    def _watch(self, server: Any, key: tuple[str, str], handle: Any, box: dict[str, Any],
               image: str) -> None:
        """While the pod lives: a container that exits makes it Failed."""
        while True:
            time.sleep(_WATCH_PERIOD_S)
            with self._lock:
                if key in self._deleted or self._handles.get(key) is not handle:
                    return
            state = self._state(handle)
            if state is not None and not state["running"]:
                server.update_pod_status(key[0], key[1], _ended(box, image, state))
                return


class ContainerKubelet(_Kubelet):
    """Runs pods as containers; give it to ``KubeAPIServer(kubelet=...)``."""

    def __init__(self, secrets: dict[tuple[str, str], str] | None = None, *,
                 engine: str | None = None, ready_timeout_s: float = 120.0) -> None:
        super().__init__(secrets, ready_timeout_s)
        self.engine = engine or shutil.which("podman") or shutil.which("docker") or "podman"

    def container_of(self, namespace: str, name: str) -> str | None:
        """The engine's id of a pod's container (None: not running here)."""
        return self._handle(namespace, name)

    def _launch(self, server: Any, pod: dict[str, Any], box: dict[str, Any], ip: str,
                env: dict[str, str]) -> str | None:
        meta = pod["metadata"]
        namespace, name = meta.get("namespace") or "default", meta["name"]
        image = box.get("image") or ""
        if self._engine("image", "exists", image, check=False).returncode != 0:
            server.update_pod_status(namespace, name, {"containerStatuses": [
                _container_status(box, {"waiting": {
                    "reason": "ErrImagePull",
                    "message": f'failed to pull image "{image}": not found'}})]})
            return None
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
        for var in env:
            args += ["-e", var]  # the value from the CLI's environment, not argv
        args.append(image)
        done = self._engine(*args, env={**os.environ, **env}, check=False)
        if done.returncode != 0:
            server.update_pod_status(namespace, name, {"phase": "Failed", "reason": "Error",
                                                       "message": done.stderr[-300:]})
            return None
        return done.stdout.strip()

    def _state(self, handle: str) -> dict[str, Any] | None:
        done = self._engine("inspect", "--format",
                            "{{.State.Running}} {{.State.ExitCode}} {{.State.OOMKilled}}",
                            handle, check=False)
        if done.returncode != 0:
            return None
        running, code, oom = ([*done.stdout.split(), "", "", ""])[:3]
        return {"running": running == "true", "exit_code": int(code or 0),
                "oom": oom == "true", "log": ""}

    def _exec(self, handle: str, command: list[str], env: dict[str, str]) -> bool:
        return self._engine("exec", handle, *command, check=False).returncode == 0

    def _remove(self, handle: str) -> None:
        with contextlib.suppress(subprocess.SubprocessError, OSError):
            self._engine("rm", "-f", "-t", "0", handle, check=False)

    def _engine(self, *args: str, env: dict[str, str] | None = None, check: bool = True
                ) -> subprocess.CompletedProcess[str]:
        return subprocess.run([self.engine, *args], capture_output=True, text=True,
                              stdin=subprocess.DEVNULL, env=env, timeout=_ENGINE_TIMEOUT_S,
                              check=check)


class _Process:
    """A pod's process: the Popen, its log, and the pids of what it started (kept while it
    runs, so its children can be ended by pid after it is gone)."""

    def __init__(self, proc: subprocess.Popen[bytes], log_path: Path) -> None:
        self.proc = proc
        self.log_path = log_path
        self.descendants: dict[int, float] = {}  # pid -> create time

    def remember_descendants(self) -> None:
        with contextlib.suppress(psutil.Error):
            for child in psutil.Process(self.proc.pid).children(recursive=True):
                with contextlib.suppress(psutil.Error):
                    self.descendants[child.pid] = child.create_time()


class ProcessKubelet(_Kubelet):
    """Runs each pod's container command as a process of this host; give it to
    ``KubeAPIServer(kubelet=...)``. ``executables`` maps a command's first word (the image's
    interpreter, e.g. ``/opt/venv/bin/python``) to this host's; ``base_env`` is the image's
    ``ENV`` (PATH, PYTHONPATH ...), under the pod's env; ``grace_s`` the time between SIGTERM
    and SIGKILL when a pod is deleted."""

    def __init__(self, secrets: dict[tuple[str, str], str] | None = None, *,
                 executables: dict[str, str] | None = None,
                 base_env: dict[str, str] | None = None, log_dir: Path | None = None,
                 ready_timeout_s: float = 120.0, grace_s: float = 10.0) -> None:
        super().__init__(secrets, ready_timeout_s)
        self.executables = dict(executables or {})
        self.base_env = dict(base_env if base_env is not None else {
            "PATH": os.environ.get("PATH", os.defpath), "LANG": "C.UTF-8"})
        self._own_log_dir = log_dir is None
        self.log_dir = Path(log_dir or tempfile.mkdtemp(prefix="kubelet-logs-"))
        self.grace_s = grace_s

    def pid_of(self, namespace: str, name: str) -> int | None:
        """The pid of a pod's process (None: not running here)."""
        handle = self._handle(namespace, name)
        return handle.proc.pid if handle is not None else None

    def log_of(self, name: str) -> str:
        """What a pod's process wrote (stdout and stderr), kept after it ended."""
        with contextlib.suppress(OSError):
            return (self.log_dir / f"{name}.log").read_text(errors="replace")
        return ""

    def close(self) -> None:
        super().close()
        if self._own_log_dir:
            shutil.rmtree(self.log_dir, ignore_errors=True)

    def _launch(self, server: Any, pod: dict[str, Any], box: dict[str, Any], ip: str,
                env: dict[str, str]) -> _Process | None:
        meta = pod["metadata"]
        namespace, name = meta.get("namespace") or "default", meta["name"]

        def refuse(message: str) -> None:
            server.update_pod_status(namespace, name, {"containerStatuses": [
                _container_status(box, {"waiting": {"reason": "CreateContainerConfigError",
                                                    "message": message}})]})

        command = [_expand(str(w), env) for w in (box.get("command") or [])
                   + (box.get("args") or [])]
        if not box.get("command"):
            refuse("ProcessKubelet runs the container's command (it has no image "
                   "entrypoint to run): set spec.containers[].command")
            return None
        volumes = {v["name"]: v for v in pod["spec"].get("volumes") or []}
        for mount in box.get("volumeMounts") or []:
            host = (volumes.get(mount["name"]) or {}).get("hostPath") or {}
            if host.get("path") != mount["mountPath"]:
                refuse(f"volume {mount['name']!r}: ProcessKubelet runs pods on this host's "
                       "filesystem, so only hostPath volumes mounted at their own path "
                       f"(here {mount['mountPath']}) are possible")
                return None
        command[0] = self.executables.get(command[0], command[0])
        self.log_dir.mkdir(parents=True, exist_ok=True)
        log_path = self.log_dir / f"{name}.log"
        with open(log_path, "wb") as out:
            try:
                proc = subprocess.Popen(command, env={**self.base_env, **env},
                                        stdin=subprocess.DEVNULL, stdout=out, stderr=out,
                                        cwd="/", start_new_session=True)
            except OSError as exc:
                server.update_pod_status(namespace, name, {"containerStatuses": [
                    _container_status(box, {"waiting": {"reason": "RunContainerError",
                                                        "message": str(exc)}})]})
                return None
        return _Process(proc, log_path)

    def _state(self, handle: _Process) -> dict[str, Any] | None:
        code = handle.proc.poll()
        if code is None:
            handle.remember_descendants()
            return {"running": True, "exit_code": 0, "oom": False, "log": ""}
        return {"running": False, "exit_code": code if code >= 0 else 128 - code,
                "oom": False, "log": _log_tail(handle.log_path)}

    def _exec(self, handle: _Process, command: list[str], env: dict[str, str]) -> bool:
        command = [_expand(w, env) for w in command]
        command[0] = self.executables.get(command[0], command[0])
        try:
            return subprocess.run(command, env={**self.base_env, **env}, capture_output=True,
                                  stdin=subprocess.DEVNULL, timeout=_PROBE_TIMEOUT_S,
                                  check=False).returncode == 0
        except (OSError, subprocess.TimeoutExpired):
            return False

    def _remove(self, handle: _Process) -> None:
        """SIGTERM, then after ``grace_s`` SIGKILL to the process and to every process it
        started (what a container's end takes with it), each by pid."""
        proc = handle.proc
        if proc.poll() is None:
            handle.remember_descendants()
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(self.grace_s)
        if proc.poll() is None:
            handle.remember_descendants()
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            proc.wait()
        for pid, created in handle.descendants.items():
            with contextlib.suppress(psutil.Error):
                child = psutil.Process(pid)
                if child.create_time() == created:  # the same process, not a reused pid
                    child.kill()
                    child.wait(self.grace_s)


def _pod_ip(ports: list[int]) -> str:
    """The next loopback address of this process's pods (127.0.0.10, .11 ...) on which the
    pod's ports are free: another process on this host (a test's server on 0.0.0.0, another
    test run's pods) may hold some, where a real pod has a network of its own."""
    while True:
        with _IPS_LOCK:
            n = next(_IPS)
        if n > 254:
            raise RuntimeError("no loopback address left for a pod")
        ip = f"127.0.0.{n}"
        try:
            for port in ports:
                with socket.socket() as sock:
                    sock.bind((ip, port))
        except OSError:
            continue
        return ip


def _expand(text: str, env: dict[str, str]) -> str:
    """Kubernetes' ``$(VAR)`` expansion: a defined variable's value, ``$$`` a literal ``$``,
    anything else left as written."""
    def one(match: re.Match[str]) -> str:
        if match.group(0) == "$$":
            return "$"
        return env.get(match.group(1), match.group(0))

    return _VAR_REF.sub(one, text)


def _http_status(host: str, port: int, path: str) -> int:
    """The status of one GET (0: no answer), as a kubelet's httpGet probe asks."""
    conn = http.client.HTTPConnection(host, port, timeout=_PROBE_TIMEOUT_S)
    try:
        conn.request("GET", path, headers={"User-Agent": "kube-probe/1.30"})
        return conn.getresponse().status
    except (OSError, http.client.HTTPException):
        return 0
    finally:
        conn.close()


def _log_tail(path: Path) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - _LOG_MESSAGE_BYTES))
            data = f.read().decode(errors="replace")
    except OSError:
        return ""
    return "\n".join(data.splitlines()[-_LOG_MESSAGE_LINES:])


def _container_status(box: dict[str, Any], state: dict[str, Any]) -> dict[str, Any]:
    return {"name": box.get("name", "desktop"), "image": box.get("image") or "", "imageID": "",
            "ready": False, "restartCount": 0, "state": state}


def _ended(box: dict[str, Any], image: str, state: dict[str, Any]) -> dict[str, Any]:
    reason = "OOMKilled" if state["oom"] else ("Completed" if state["exit_code"] == 0
                                               else "Error")
    terminated: dict[str, Any] = {"reason": reason, "exitCode": state["exit_code"]}
    if state["exit_code"] and state.get("log") and \
            box.get("terminationMessagePolicy") == "FallbackToLogsOnError":
        terminated["message"] = state["log"]
    return {"phase": "Failed", "containerStatuses": [
        {**_container_status(box, {"terminated": terminated}), "image": image}]}


def _cpus(quantity: str) -> str:
    """A Kubernetes CPU quantity (``"1"``, ``"500m"``) as the engine's ``--cpus``."""
    return f"{int(quantity[:-1]) / 1000:g}" if quantity.endswith("m") else quantity


def _bytes(quantity: str) -> str:
    """A Kubernetes memory quantity (``"2Gi"``, ``"512Mi"``) as the engine's ``--memory``."""
    for suffix, unit in (("Ki", "k"), ("Mi", "m"), ("Gi", "g")):
        if quantity.endswith(suffix):
            return quantity[:-2] + unit
    return quantity
