"""The ``kubernetes`` provider: desktops as pods of the desktop image, through the official
``kubernetes`` client (its blocking calls run in threads: it is the client maintained with the
API itself, and the provider makes few calls — one create and one delete per desktop, one
watch, a heartbeat — so threads cost nothing that matters, where the asyncio fork lags it).

Each desktop is one pod, built from ``desktops.kubernetes.pod_template`` (or the image alone)
with the name, labels (``cua.run``, ``cua.owner``, ``cua.desktop``,
``app.kubernetes.io/component: desktop``), the image, resources, port, token (from a Secret)
and readiness probe the config gives, ``restartPolicy: Never`` (a desktop that dies is replaced
by a fresh pod, never restarted with a dirty state). Readiness comes from one watch of the
run's pods (re-listed after a 410 or an API outage), not from polling: a pod is ready when its
``Ready`` condition is true, then its server is asked once and its first state taken. Its URL
is the pod's IP and port, or a per-pod Service's cluster name (``service_per_pod``).

Failures are named: ``Unschedulable`` with the scheduler's message (which resource), image
pull errors with the image, ``exceeded quota`` (403) with the quota, eviction and OOM kills.
The pool retries a failed start with backoff (no crash loop). While the API server is
unreachable, calls are retried up to ``api_outage_s`` and the watch reconnects; desktops
already leased keep working (nothing on their path asks the API).

No leaks: every pod carries a heartbeat annotation the provider renews, and the process that
owns it (``cua.run/process``: host, pid and start time). At start, at every heartbeat and at
stop, pods of other runs are swept when their heartbeat is older than
``heartbeat_timeout_s``, or at once when their process was on this host and is gone (a driver
killed with SIGKILL leaves nothing after the next start). Pods of a live run are never swept.

Resets (``reset``): ``builtin`` resets a desktop-image pod in place through its server;
``vm`` is for pods that run the VM launcher (``deploy/kubernetes/vm-desktop-pod.yaml``: QEMU
in the pod, its base image from a volume, ``/dev/kvm`` from the node), reset by the launcher's
``POST /vm/reset`` (a restore of the VM's ready state, answered once the guest serves again;
``cua_rollout/vm/launcher.py``). The pool's reset check follows either. A launcher whose QEMU
dies exits, so its pod fails and is replaced like any failed pod.

One file on purpose: a provider is one file (providers/__init__.py); what it shares with
the others is in providers/base.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import getpass
import hashlib
import json
import logging
import os
import re
import secrets
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml
from urllib3.exceptions import HTTPError

from cua_rollout.config import DesktopsConfig, secret_from_env
from cua_rollout.core.aio import backoff_s
from cua_rollout.core.errors import ConfigError, DesktopError
from cua_rollout.core.http import TransportFailure, error_text, hot_request
from cua_rollout.envs.client import shared_client
from cua_rollout.envs.providers.base import (
    LABEL_DESKTOP,
    LABEL_OWNER,
    LABEL_RUN,
    Desktop,
    DesktopProvider,
    bring_up,
    builtin_reset,
    run_is_gone,
    run_label,
    server_answers,
    wait_serving,
)
from cua_rollout.vm.launcher import RESET_PATH

__all__ = [
    "HEARTBEAT_ANNOTATION",
    "PROCESS_ANNOTATION",
    "KubernetesProvider",
    "load_pod_template",
    "pod_problem",
    "pod_ready",
]

log = logging.getLogger(__name__)

HEARTBEAT_ANNOTATION = "cua.run/heartbeat"   # epoch seconds of the owner's last renewal
PROCESS_ANNOTATION = "cua.run/process"       # host:pid:start of the pool that owns the pod
COMPONENT_LABELS = {"app.kubernetes.io/component": "desktop",
                    "app.kubernetes.io/part-of": "cua-rollout"}
CONTAINER_NAME = "desktop"
_TOKEN_VAR = "CUA_DESKTOP_TOKEN"             # the image's CUA_DESKTOP_TOKEN_ENV
# The image's HEALTHCHECK.
_HEALTHCHECK = ["/opt/venv/bin/python", "-m", "cua_rollout.desktop.healthcheck"]
_WATCH_TIMEOUT_S = 10          # one watch request's life: a stop is noticed within this
_API_BACKOFF_INITIAL_S = 0.5
_API_BACKOFF_MAX_S = 10.0
# Container states that end a start at once (they do not resolve by waiting).
_FATAL_WAITING = {"ErrImagePull", "ImagePullBackOff", "InvalidImageName", "ErrImageNeverPull",
                  "CreateContainerConfigError", "CreateContainerError", "CrashLoopBackOff",
                  "RunContainerError"}
_LABEL_VALUE = re.compile(r"[^A-Za-z0-9_.-]")


def _label_value(text: str) -> str:
    """``text`` as a valid label value (63 characters of ``[A-Za-z0-9_.-]``, alphanumeric
    at both ends)."""
    return _LABEL_VALUE.sub("_", text)[:63].strip("_.-") or "unknown"


def load_pod_template(path: Path) -> dict[str, Any]:
    """The pod of a template file (a Pod, or a PodTemplate's ``template``), as a dict;
    ``ConfigError`` naming the key and what is wrong."""
    key = "desktops.kubernetes.pod_template"
    try:
        docs = [d for d in yaml.safe_load_all(Path(path).read_text()) if d is not None]
    except (OSError, yaml.YAMLError) as exc:
        raise ConfigError(f"{key} {path}: cannot read it: {exc}") from None
    if len(docs) != 1 or not isinstance(docs[0], dict):
        raise ConfigError(f"{key} {path}: expected one YAML document, a Pod or a PodTemplate")
    doc = docs[0]
    kind = doc.get("kind")
    if kind == "PodTemplate":
        doc = doc.get("template") or {}
    elif kind != "Pod":
        raise ConfigError(f"{key} {path}: kind is {kind!r}, expected Pod or PodTemplate")
    containers = (doc.get("spec") or {}).get("containers")
    if not isinstance(containers, list) or not containers or not all(
            isinstance(c, dict) for c in containers):
        raise ConfigError(f"{key} {path}: spec.containers must list the desktop's container")
    return doc


def pod_ready(pod: dict[str, Any]) -> bool:
    """Running, not being deleted, with its ``Ready`` condition true and an IP."""
    status = pod.get("status") or {}
    if (pod.get("metadata") or {}).get("deletionTimestamp") or status.get("phase") != "Running":
        return False
    ready = any(c.get("type") == "Ready" and c.get("status") == "True"
                for c in status.get("conditions") or [])
    return ready and bool(status.get("podIP"))


def pod_problem(pod: dict[str, Any]) -> tuple[str, bool] | None:
    """What keeps a pod from serving, in words, and whether waiting cannot cure it
    (``fatal``); None when nothing is wrong (yet)."""
    meta, status = pod.get("metadata") or {}, pod.get("status") or {}
    if meta.get("deletionTimestamp"):
        return "the pod is being deleted", True
    for cs in status.get("containerStatuses") or []:
        state = cs.get("state") or {}
        waiting, terminated = state.get("waiting") or {}, state.get("terminated") or {}
        if waiting.get("reason") in _FATAL_WAITING:
            image = cs.get("image") or ""
            return (f"{waiting['reason']}" + (f" ({image})" if image else "")
                    + (f": {waiting['message']}" if waiting.get("message") else "")), True
        if terminated:
            code = terminated.get("exitCode")
            return (f"its container ended: {terminated.get('reason') or 'terminated'}"
                    + (f" (exit code {code})" if code is not None else "")
                    + (f": {terminated['message']}" if terminated.get("message") else "")), True
    phase = status.get("phase")
    if phase in ("Failed", "Succeeded"):
        reason = status.get("reason") or phase
        return f"{reason}" + (f": {status['message']}" if status.get("message") else ""), True
    for c in status.get("conditions") or []:
        if c.get("type") == "PodScheduled" and c.get("status") == "False":
            # The scheduler's message names the resource ("3 Insufficient memory"); an
            # autoscaler may still add a node, so this is waited on until the deadline.
            return (f"{c.get('reason') or 'not scheduled'}: {c.get('message') or ''}".rstrip(": "),
                    False)
    return None


class _Api:
    """The official client's CoreV1Api, each call in a thread, retried with backoff while
    the API server is unreachable or overloaded (5xx, 429), up to ``outage_s``; an answer
    that waiting cannot change (403, 404, 409, 422 ...) raises ``ApiException`` at once."""

    def __init__(self, core: Any, timeout_s: float, outage_s: float) -> None:
        from kubernetes.client.exceptions import ApiException

        self.core = core
        self.timeout_s = timeout_s
        self.outage_s = outage_s
        self._api_exception = ApiException
        self.down_since: float | None = None

    async def __call__(self, method: str, *args: Any, **kwargs: Any) -> Any:
        started = time.monotonic()
        attempt = 0
        fn: Callable[..., Any] = getattr(self.core, method)
        while True:
            try:
                result = await asyncio.to_thread(fn, *args, _request_timeout=self.timeout_s,
                                                 **kwargs)
                self.down_since = None
                return result
            except self._api_exception as exc:
                if exc.status not in (0, 429, 500, 502, 503, 504):
                    raise
                problem = f"HTTP {exc.status} {exc.reason}"
            except (HTTPError, OSError) as exc:  # urllib3's connection errors and timeouts
                problem = f"{type(exc).__name__}: {exc}"
            except Exception as exc:  # an answer the client cannot read: not an outage
                raise DesktopError(f"the Kubernetes API's answer to {method} could not be "
                                   f"read: {type(exc).__name__}: {exc}") from exc
            if self.down_since is None:
                self.down_since = time.monotonic()
                log.warning("the Kubernetes API server does not answer (%s); retrying for up "
                            "to %g s", problem, self.outage_s)
            if time.monotonic() - started > self.outage_s:
                raise DesktopError(f"the Kubernetes API server did not answer {method} for "
                                   f"{self.outage_s:g} s: {problem}")
            attempt += 1
            await asyncio.sleep(backoff_s(attempt, _API_BACKOFF_INITIAL_S, _API_BACKOFF_MAX_S))


def _status_message(exc: Any) -> str:
    """The ``message`` of an API error's Status body (the quota's words for a 403)."""
    with contextlib.suppress(ValueError, TypeError, AttributeError):
        body = json.loads(exc.body)
        if isinstance(body, dict) and body.get("message"):
            return f"HTTP {exc.status}: {body['message']}"
    return f"HTTP {exc.status} {exc.reason}"


class KubernetesProvider(DesktopProvider):
    """Desktops as pods; see the module docstring."""

    def __init__(self, cfg: DesktopsConfig) -> None:
        self.cfg = cfg
        self.kcfg = cfg.kubernetes
        self.namespace = self.kcfg.namespace
        self.process = run_label()
        # The run's label: short, valid as a label value, the same for the pool's life.
        self.run = "r" + hashlib.blake2b(self.process.encode(), digest_size=6).hexdigest()
        self.owner = _label_value(getpass.getuser())
        self.template = (load_pod_template(self.kcfg.pod_template)
                         if self.kcfg.pod_template is not None else None)
        if self.kcfg.image is None and not any(
                c.get("image") for c in (self.template or {}).get("spec", {}).get(
                    "containers", [])):
            raise ConfigError("desktops.kubernetes.image is not set and the pod_template "
                              "names no image")
        self._client: Any = None
        self._api: _Api | None = None
        self._pods: dict[str, dict[str, Any]] = {}   # pod name -> the pod as last watched
        self._mine: dict[str, str] = {}              # desktop id (= pod name) -> service name
        self._waiters: dict[str, list[asyncio.Future[None]]] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._watch_thread: threading.Thread | None = None
        self._watch_stop = threading.Event()
        self._watch_error: str | None = None
        self._heartbeat: asyncio.Task[None] | None = None
        self._swept = False
        self.stale_removed: list[str] = []

    # ----------------------------------------------------------------- the client

    def _connect(self) -> _Api:
        if self._api is None:
            from kubernetes import client, config

            configuration = client.Configuration()
            if self.kcfg.kubeconfig is None and os.environ.get("KUBERNETES_SERVICE_HOST"):
                config.load_incluster_config(client_configuration=configuration)
            else:
                try:
                    config.load_kube_config(
                        config_file=str(self.kcfg.kubeconfig) if self.kcfg.kubeconfig else None,
                        context=self.kcfg.context, client_configuration=configuration)
                except (config.ConfigException, OSError) as exc:
                    where = self.kcfg.kubeconfig or os.environ.get("KUBECONFIG") \
                        or "~/.kube/config"
                    context = f" (context {self.kcfg.context})" if self.kcfg.context else ""
                    raise ConfigError(f"desktops.kubernetes.kubeconfig: cannot load {where}"
                                      f"{context}: {exc}") from None
            # Every desktop's create, delete and heartbeat may be in flight at once.
            configuration.connection_pool_maxsize = max(
                32, 2 * (self.cfg.count + self.cfg.warm_spares))
            self._client = client.ApiClient(configuration)
            self._api = _Api(client.CoreV1Api(self._client), self.kcfg.api_timeout_s,
                             self.kcfg.api_outage_s)
        return self._api

    @property
    def selector(self) -> str:
        return f"{LABEL_RUN}={self.run}"

    # ----------------------------------------------------------------- the watch

    def _start_watch(self) -> None:
        if self._watch_thread is not None:
            return
        self._loop = asyncio.get_running_loop()
        self._watch_thread = threading.Thread(target=self._watch, name=f"pods-{self.run}",
                                              daemon=True)
        self._watch_thread.start()

    def _watch(self) -> None:
        """One watch of this run's pods, in a thread: a list (its resourceVersion), then
        watch from there; a 410 or a broken connection re-lists. Events go to the loop."""
        from kubernetes import watch
        from kubernetes.client.exceptions import ApiException

        assert self._api is not None and self._loop is not None
        core, sanitize = self._api.core, self._client.sanitize_for_serialization
        version: str | None = None
        failures = 0
        while not self._watch_stop.is_set():
            try:
                if version is None:
                    listed = core.list_namespaced_pod(
                        self.namespace, label_selector=self.selector,
                        _request_timeout=self.kcfg.api_timeout_s)
                    version = listed.metadata.resource_version
                    self._post("list", [sanitize(p) for p in listed.items])
                stream = watch.Watch()
                for event in stream.stream(
                        core.list_namespaced_pod, self.namespace, label_selector=self.selector,
                        resource_version=version, allow_watch_bookmarks=True,
                        timeout_seconds=_WATCH_TIMEOUT_S,
                        _request_timeout=(self.kcfg.api_timeout_s, _WATCH_TIMEOUT_S + 30)):
                    if self._watch_stop.is_set():
                        stream.stop()
                        break
                    pod = event["object"]
                    version = stream.resource_version or version
                    if event["type"] in ("ADDED", "MODIFIED", "DELETED"):
                        self._post(event["type"], [sanitize(pod)])
                failures = 0
                self._watch_error = None
            except ApiException as exc:
                if exc.status == 410:  # too old: start again from a list
                    version = None
                    continue
                failures += 1
                self._watch_error = f"HTTP {exc.status} {exc.reason}"
            except Exception as exc:  # the API server unreachable: wait, then re-list
                failures += 1
                version = None
                self._watch_error = f"{type(exc).__name__}: {exc}"
            if failures:
                if failures == 1:
                    log.warning("the watch of %s's pods broke (%s); re-listing with backoff",
                                self.run, self._watch_error)
                self._watch_stop.wait(backoff_s(failures, _API_BACKOFF_INITIAL_S,
                                                _API_BACKOFF_MAX_S))

    def _post(self, kind: str, pods: list[dict[str, Any]]) -> None:
        loop = self._loop
        if loop is not None and not loop.is_closed():
            with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
                loop.call_soon_threadsafe(self._apply, kind, pods)

    def _apply(self, kind: str, pods: list[dict[str, Any]]) -> None:
        """On the loop: the watched state of the pods, and a wake-up for whoever waits. A
        pod gone (deleted, or missing from a re-list) is forgotten, unless a start waits on
        it: that one finds it marked ``deleted`` (and drops it), so the map holds the live
        pods only, not every pod a long run ever replaced."""
        changed = []
        if kind == "list":
            listed = {p["metadata"]["name"]: p for p in pods}
            changed = list(set(self._pods) | set(listed))
            for name in set(self._pods) - set(listed):
                self._gone(name, {"metadata": {"name": name}, "status": {}})
            self._pods.update(listed)
        else:
            for pod in pods:
                name = pod["metadata"]["name"]
                if kind == "DELETED":
                    self._gone(name, pod)
                else:
                    self._pods[name] = pod
                changed.append(name)
        for name in changed:
            for waiter in self._waiters.pop(name, []):
                if not waiter.done():
                    waiter.set_result(None)

    def _gone(self, name: str, pod: dict[str, Any]) -> None:
        if any(not w.done() for w in self._waiters.get(name, ())):
            self._pods[name] = {**pod, "deleted": True}
        else:
            self._pods.pop(name, None)

    async def _changed(self, name: str, timeout_s: float) -> None:
        waiter = asyncio.get_running_loop().create_future()
        self._waiters.setdefault(name, []).append(waiter)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(waiter, timeout_s)

    # ----------------------------------------------------------------- pods

    def pod_manifest(self, name: str, index: int) -> dict[str, Any]:
        """The pod of desktop ``name``: the template with what the config sets over it."""
        k = self.kcfg
        pod = copy.deepcopy(self.template) if self.template else {
            "spec": {"containers": [{"name": CONTAINER_NAME}]}}
        pod["apiVersion"], pod["kind"] = "v1", "Pod"
        meta = pod.setdefault("metadata", {})
        meta.pop("generateName", None)
        meta.update(name=name, namespace=self.namespace)
        meta["labels"] = {**COMPONENT_LABELS, **(meta.get("labels") or {}), **k.labels,
                          LABEL_RUN: self.run, LABEL_OWNER: self.owner, LABEL_DESKTOP: name}
        meta["annotations"] = {**(meta.get("annotations") or {}),
                               HEARTBEAT_ANNOTATION: f"{time.time():.0f}",
                               PROCESS_ANNOTATION: self.process}
        spec = pod.setdefault("spec", {})
        spec["restartPolicy"] = "Never"
        if k.service_account:
            spec["serviceAccountName"] = k.service_account
        if k.node_selector:
            spec["nodeSelector"] = {**(spec.get("nodeSelector") or {}), **k.node_selector}
        if k.tolerations:
            spec["tolerations"] = [*(spec.get("tolerations") or []), *k.tolerations]
        if k.image_pull_secrets:
            spec["imagePullSecrets"] = [*(spec.get("imagePullSecrets") or []),
                                        *({"name": s} for s in k.image_pull_secrets)]
        containers = spec["containers"]
        box = next((c for c in containers if c.get("name") == CONTAINER_NAME), containers[0])
        if k.image:
            box["image"] = k.image
        # CPU and memory from the config; the template's other resources kept (a VM pod's
        # devices.kubevirt.io/kvm).
        resources = box.get("resources") or {}
        box["resources"] = {**resources, **{
            side: {**(resources.get(side) or {}), "cpu": k.cpu, "memory": k.memory}
            for side in ("requests", "limits")}}
        # The server's port, and the template's others (a VM pod's DevTools and VLC gates).
        box["ports"] = [{"name": "desktop", "containerPort": k.port, "protocol": "TCP"}] + [
            p for p in box.get("ports") or []
            if p.get("containerPort") != k.port and p.get("name") != "desktop"]
        env = {e.get("name"): e for e in box.get("env") or []}
        for var, value in (("SCREEN_WIDTH", str(self.cfg.screen_width)),
                           ("SCREEN_HEIGHT", str(self.cfg.screen_height)),
                           ("CUA_DESKTOP_ID", name), ("CUA_DESKTOP_PORT", str(k.port)),
                           ("CUA_DESKTOP_HOST", "0.0.0.0")):
            env[var] = {"name": var, "value": value}
        if k.token_secret:
            env[_TOKEN_VAR] = {"name": _TOKEN_VAR, "valueFrom": {"secretKeyRef": {
                "name": k.token_secret, "key": k.token_secret_key}}}
        box["env"] = list(env.values())
        box.setdefault("readinessProbe", {"exec": {"command": _HEALTHCHECK},
                                          "periodSeconds": 2, "timeoutSeconds": 5,
                                          "failureThreshold": 3})
        return pod

    async def start(self, index: int) -> Desktop:
        api = self._connect()
        self._start_watch()
        if not self._swept:
            self._swept = True
            self.stale_removed = await self.sweep()
            if self.stale_removed:
                log.warning("removed desktop pods of runs that are gone: %s",
                            ", ".join(self.stale_removed))
        if self._heartbeat is None:
            self._heartbeat = asyncio.get_running_loop().create_task(self._beat())
        name = f"cua-{self.run}-{index}-{secrets.token_hex(2)}"
        started = time.monotonic()
        from kubernetes.client.exceptions import ApiException

        try:
            await api("create_namespaced_pod", self.namespace, self.pod_manifest(name, index))
        except ApiException as exc:
            raise DesktopError(f"{name}: the API server refused the pod: "
                               f"{_status_message(exc)}") from None
        self._mine[name] = ""

        async def serving() -> Desktop:
            url = await self._wait_ready(name, started)
            if self.kcfg.service_per_pod:
                url = await self._service(name)
            desktop = Desktop(id=name, url=url, info={"pod": name,
                                                      "namespace": self.namespace})
            # Ready in Kubernetes; from here, as the runners will reach it.
            await wait_serving(self.cfg, desktop, started + self.kcfg.startup_timeout_s,
                               poll_s=0.2)
            return desktop

        # A VM pod is reset by a restore: no baseline for the builtin reset to take.
        return await bring_up(self, self.cfg, name, started, serving,
                              baseline=self.kcfg.reset == "builtin")

    async def _wait_ready(self, name: str, started: float) -> str:
        """The pod's URL once it is ready, by the watch's events; ``DesktopError`` naming
        what went wrong when it fails or misses ``startup_timeout_s``."""
        deadline = started + self.kcfg.startup_timeout_s
        waiting_on = "no word from the API server yet"
        while True:
            pod = self._pods.get(name)
            if pod is not None:
                if pod.get("deleted"):
                    self._pods.pop(name, None)  # kept for this wait only (_gone)
                    raise DesktopError(f"{name}: the pod was deleted before it was ready")
                if pod_ready(pod):
                    return f"http://{pod['status']['podIP']}:{self.kcfg.port}"
                problem = pod_problem(pod)
                if problem is not None and problem[1]:
                    raise DesktopError(f"{name}: {problem[0]}")
                phase = (pod.get("status") or {}).get("phase") or "Pending"
                waiting_on = problem[0] if problem else f"phase {phase}, not ready"
            elif self._watch_error:
                waiting_on = f"the pod watch is broken: {self._watch_error}"
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise DesktopError(f"{name}: not ready after {self.kcfg.startup_timeout_s:g} s "
                                   f"({waiting_on})")
            await self._changed(name, remaining)

    async def _service(self, name: str) -> str:
        """A Service for the pod alone; its cluster DNS name's URL."""
        body = {"apiVersion": "v1", "kind": "Service",
                "metadata": {"name": name, "namespace": self.namespace,
                             "labels": {LABEL_RUN: self.run, LABEL_DESKTOP: name}},
                "spec": {"selector": {LABEL_DESKTOP: name},
                         "ports": [{"name": "desktop", "port": self.kcfg.port,
                                    "targetPort": self.kcfg.port}]}}
        await self._connect()("create_namespaced_service", self.namespace, body)
        self._mine[name] = name
        return f"http://{name}.{self.namespace}.svc:{self.kcfg.port}"

    async def reset(self, desktop: Desktop) -> None:
        began = time.monotonic()
        pod = self._pods.get(desktop.id)
        if pod is None or not pod_ready(pod):
            problem = pod_problem(pod) if pod else None
            raise DesktopError(f"{desktop.id}: the pod is not ready"
                               + (f" ({problem[0]})" if problem else ""))
        if self.kcfg.reset == "vm":
            await self._vm_reset(desktop)
            how = "restore"
        else:
            await builtin_reset(self.cfg, desktop)
            how = "in place"
        desktop.info["last_reset"] = {"how": how, "seconds": time.monotonic() - began}

    async def _vm_reset(self, desktop: Desktop) -> None:
        """``POST /vm/reset`` to the pod's VM launcher, with the token: it answers once the
        restored guest's server answers; any other answer is a ``DesktopError`` saying why."""
        token = secret_from_env(self.cfg.token_env, "desktops.token_env")
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        try:
            reply = await hot_request(
                shared_client(self.cfg.max_connections), "POST", desktop.url + RESET_PATH,
                headers=headers, timeout_s=self.cfg.reset_timeout_s,
                connect_timeout_s=self.cfg.reset_timeout_s)
        except TransportFailure as exc:
            raise DesktopError(f"{desktop.id}: POST {RESET_PATH} failed: {exc}") from exc
        if reply.status_code != 200:
            raise DesktopError(f"{desktop.id}: POST {RESET_PATH} answered HTTP "
                               f"{reply.status_code}: {error_text(reply, 500)}")

    async def stop(self, desktop: Desktop) -> None:
        if desktop.id not in self._mine:
            return
        service = self._mine.pop(desktop.id)
        await self._delete(desktop.id, service)

    async def _delete(self, name: str, service: str = "") -> None:
        from kubernetes.client.exceptions import ApiException

        api = self._connect()
        with contextlib.suppress(ApiException):  # 404: already gone
            await api("delete_namespaced_pod", name, self.namespace, grace_period_seconds=2)
        if service:
            with contextlib.suppress(ApiException):
                await api("delete_namespaced_service", service, self.namespace)

    async def health(self, desktop: Desktop) -> bool:
        pod = self._pods.get(desktop.id)
        if pod is None or pod.get("deleted") or not pod_ready(pod):
            return False
        return await server_answers(self.cfg, desktop)

    # ----------------------------------------------------------------- heartbeat, sweep

    async def _beat(self) -> None:
        """Renew this run's mark on its pods, and sweep other runs' leaked ones."""
        from kubernetes.client.exceptions import ApiException

        while True:
            await asyncio.sleep(self.kcfg.heartbeat_interval_s)
            api = self._connect()
            patch = {"metadata": {"annotations": {HEARTBEAT_ANNOTATION: f"{time.time():.0f}"}}}
            results = await asyncio.gather(
                *(api("patch_namespaced_pod", name, self.namespace, patch)
                  for name in list(self._mine)), return_exceptions=True)
            for result in results:
                if isinstance(result, Exception) and not (
                        isinstance(result, ApiException) and result.status == 404):
                    log.warning("heartbeat of %s's pods: %s", self.run, result)
                    break
            with contextlib.suppress(Exception):
                removed = await self.sweep()
                if removed:
                    log.warning("removed desktop pods of runs that are gone: %s",
                                ", ".join(removed))

    async def sweep(self) -> list[str]:
        """Delete the desktop pods of other runs that are gone (heartbeat older than
        ``heartbeat_timeout_s``, or their process was on this host and has ended); the
        names of those deleted. Never a pod of a live run."""
        api = self._connect()
        listed = await api("list_namespaced_pod", self.namespace,
                           label_selector=f"{LABEL_RUN},{LABEL_RUN}!={self.run}")
        now = time.time()
        removed = []
        for pod in listed.items:
            meta = pod.metadata
            annotations = meta.annotations or {}
            try:
                beat = float(annotations.get(HEARTBEAT_ANNOTATION, ""))
            except ValueError:
                created = meta.creation_timestamp
                beat = created.timestamp() if created is not None else now
            process = annotations.get(PROCESS_ANNOTATION, "")
            if now - beat > self.kcfg.heartbeat_timeout_s or (process and run_is_gone(process)):
                await self._delete(meta.name)
                removed.append(meta.name)
        return removed

    async def close(self) -> None:
        """Stop the heartbeat and the watch (after ``stop`` of every desktop), sweeping the
        pods of runs that are gone once more."""
        if self._heartbeat is not None:
            self._heartbeat.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._heartbeat
            self._heartbeat = None
        if self._api is not None and self._swept:  # it ran desktops (not only a listing)
            try:
                removed = await asyncio.wait_for(self.sweep(), self.kcfg.api_timeout_s)
                if removed:
                    log.warning("removed desktop pods of runs that are gone: %s",
                                ", ".join(removed))
            except Exception as exc:  # best effort: the next start sweeps again
                log.warning("the sweep at stop failed: %s", exc)
        self._watch_stop.set()
        if self._watch_thread is not None:
            await asyncio.to_thread(self._watch_thread.join, _WATCH_TIMEOUT_S + 5)
            self._watch_thread = None
        if self._client is not None:
            with contextlib.suppress(Exception):
                self._client.close()

    # ----------------------------------------------------------------- operators

    async def list_pods(self) -> list[dict[str, Any]]:
        """Every desktop pod of every run in the namespace, as an operator's rows (id, phase,
        owning run and process, heartbeat age, URL): what ``scripts/desktops.py status``
        shows without a live run."""
        listed = await self._connect()("list_namespaced_pod", self.namespace,
                                       label_selector=LABEL_RUN)
        now = time.time()
        rows = []
        for pod in listed.items:
            meta, status = pod.metadata, pod.status
            annotations = meta.annotations or {}
            try:
                age: float | None = round(now - float(annotations[HEARTBEAT_ANNOTATION]), 1)
            except (KeyError, ValueError):
                age = None
            rows.append({
                "id": meta.name, "state": status.phase if status else None,
                "owner": (meta.labels or {}).get(LABEL_RUN),
                "url": (f"http://{status.pod_ip}:{self.kcfg.port}"
                        if status is not None and status.pod_ip else None),
                "provider": {"process": annotations.get(PROCESS_ANNOTATION),
                             "heartbeat_age_s": age}})
        return rows

