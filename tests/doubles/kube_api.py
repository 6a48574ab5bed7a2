"""A Kubernetes API server for tests: core/v1 pods, services and events held in memory, served
on a real loopback port with the real API server's wire behaviour, for the official
``kubernetes`` client (``CoreV1Api`` calls and ``kubernetes.watch.Watch().stream``).

Built on kmock's ``KubernetesEmulator`` (https://github.com/nolar/kmock). kmock parses each
request (verb, resource, namespace, name, subresource), routes it through its reactions (a
test may add its own with kmock's DSL on ``server.emulator``; they take precedence), renders
JSON bodies and watch streams, answers discovery (``/api``, ``/api/v1``, ``/version``) and keeps
every object with its history in ``server.emulator.objects``. Extended here because its
emulator has no resourceVersion, uid, validation, selectors, bookmarks, 410, graceful deletion
or Status bodies, and replays every object on every watch: its request handler and
create/get/list/watch/patch/delete reactions are overridden; the state is guarded by a
threading lock so tests and kubelets may drive it from their own threads. Not used: kmock's
``Server`` (it patches aiohttp's resolver for the whole process, LIFO only, and opens a client
session); the handler runs under aiohttp's low-level server instead, on a socket of our own so
that ``api_down()`` can close it and ``api_up()`` reopen the same port.

Emulated: pods, services and events in namespaces: create (201; ``generateName``; uid,
creationTimestamp, a global integer resourceVersion bumped on every change; pod defaults,
``status.phase: Pending``, qosClass; service clusterIP and nodePorts), get, list (list
resourceVersion = the current one), watch (no resourceVersion or "0": synthetic ADDED first;
resourceVersion=N: only the changes after N; 410 Expired as an ERROR event when N is older
than the retained history; BOOKMARKs; ``timeoutSeconds``; a selector-filtered watch sees ADDED
or DELETED when an object starts or stops matching, as the watch cache sends), patch (merge and
strategic merge as JSON merge, JSON patch; resourceVersion precondition; status only through
``/status``; a no-op patch changes nothing), delete (body or query options, gracePeriodSeconds,
preconditions; pods go at once, or after ``deletion_delay_s`` with deletionTimestamp set),
deletecollection, ownerReference garbage collection of dependents; label selectors (``=``,
``==``, ``!=``, ``in``, ``notin``, existence, ``!``, ``<``, ``>``) and field selectors (the
fields the real server supports per resource); Status bodies for 400, 401, 403 (pod quota), 404,
405, 409, 415, 422 (names, label keys and values, containers, service ports).

Not emulated: other resources and API groups (namespaces too: every namespace exists), PUT
(replace), server-side apply, strategic merge of lists by key (lists are replaced), finalizers,
immutability of most pod spec fields, pagination (``limit`` is ignored, as servers may),
``resourceVersionMatch`` and ``sendInitialEvents``, pod logs/exec/attach/port-forward, RBAC
beyond one bearer token, admission webhooks, TLS.
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import copy
import itertools
import json
import logging
import random
import re
import secrets
import socket
import threading
import uuid
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, NamedTuple, Protocol

import aiohttp.web
import kmock

__all__ = [
    "KubeAPIServer",
    "Kubelet",
    "LoggedRequest",
    "evicted_status",
    "image_pull_backoff_status",
    "oom_killed_status",
    "running_status",
    "unschedulable_status",
]

log = logging.getLogger(__name__)

_KINDS = {"pods": "Pod", "services": "Service", "events": "Event"}
_RESOURCES = {plural: kmock.resource("", "v1", plural) for plural in _KINDS}
# The field selectors the real server accepts, per resource.
_FIELDS = {
    "pods": {"metadata.name", "metadata.namespace", "spec.nodeName", "spec.restartPolicy",
             "spec.schedulerName", "spec.serviceAccountName", "spec.hostNetwork",
             "status.phase", "status.podIP", "status.nominatedNodeName"},
    "services": {"metadata.name", "metadata.namespace"},
    "events": {"metadata.name", "metadata.namespace", "involvedObject.kind",
               "involvedObject.namespace", "involvedObject.name", "involvedObject.uid",
               "involvedObject.apiVersion", "involvedObject.resourceVersion",
               "involvedObject.fieldPath", "reason", "reportingComponent", "source", "type"},
}
_FIRST_RV = 100  # the resourceVersion of the empty cluster ("0" means "any" to the server)
_SHUTDOWN_S = 2.0
_JSON = {"Content-Type": "application/json"}
_NAME_CHARS = "bcdfghjklmnpqrstvwxz2456789"  # generateName's suffix alphabet
_HOST_IP = "172.18.0.2"
_TERMINAL = ("Succeeded", "Failed")

_DNS1123 = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")
_DNS1123_MSG = (
    "a lowercase RFC 1123 subdomain must consist of lower case alphanumeric characters, '-' or "
    "'.', and must start and end with an alphanumeric character (e.g. 'example.com', regex used "
    r"for validation is '[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*')")
_DNS1035 = re.compile(r"[a-z]([-a-z0-9]*[a-z0-9])?")
_DNS1035_MSG = (
    "a DNS-1035 label must consist of lower case alphanumeric characters or '-', start with an "
    "alphabetic character, and end with an alphanumeric character (e.g. 'my-name',  or "
    "'abc-123', regex used for validation is '[a-z]([-a-z0-9]*[a-z0-9])?')")
_LABEL_VALUE = re.compile(r"(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?")
_LABEL_VALUE_MSG = (
    "a valid label must be an empty string or consist of alphanumeric characters, '-', '_' or "
    "'.', and must start and end with an alphanumeric character (e.g. 'MyValue',  or "
    "'my_value',  or '12345', regex used for validation is "
    "'(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?')")
_LABEL_NAME = re.compile(r"([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]")
_LABEL_NAME_MSG = (
    "name part must consist of alphanumeric characters, '-', '_' or '.', and must start and end "
    "with an alphanumeric character (e.g. 'MyName',  or 'my.name',  or '123-abc', regex used "
    "for validation is '([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]')")
_REQUIREMENT = re.compile(
    r"\s*(?:!\s*(?P<absent>[\w./-]+)|(?P<key>[\w./-]+)"
    r"(?:\s*(?P<op>==|=|!=|<|>)\s*(?P<value>[\w.-]*)|\s+(?P<set>notin|in)\s*\((?P<values>[^()]*)\))?"
    r")\s*(?:,|$)")
_FIELD_TERM = re.compile(r"\s*([\w.]+)\s*(==|=|!=)\s*([^,]*?)\s*")


class Kubelet(Protocol):
    """What the server calls, on its own loop, when a pod is created or its deletion starts.
    An implementation may start threads; they drive the pod with the server's methods."""

    def on_create(self, server: KubeAPIServer, pod: dict[str, Any]) -> None: ...

    def on_delete(self, server: KubeAPIServer, pod: dict[str, Any]) -> None: ...


class LoggedRequest(NamedTuple):
    method: str
    path: str
    query: dict[str, str]


@dataclass(frozen=True)
class _Change:
    rv: int
    plural: str
    type: str  # ADDED, MODIFIED, DELETED
    obj: dict[str, Any]
    old: dict[str, Any] | None


@dataclass
class _Fault:
    verb: str
    resource: str
    name: str | None
    code: int
    reason: str
    message: str
    times: int


# ---------------------------------------------------------------- wire helpers


def _now(offset_s: float = 0.0) -> str:
    return (datetime.now(UTC) + timedelta(seconds=offset_s)).strftime("%Y-%m-%dT%H:%M:%SZ")


def _status_body(code: int, reason: str, message: str,
                 details: dict[str, Any] | None = None) -> dict[str, Any]:
    body: dict[str, Any] = {"kind": "Status", "apiVersion": "v1", "metadata": {},
                            "status": "Failure", "message": message, "reason": reason}
    if details:
        body["details"] = details
    body["code"] = code
    return body


def _error(code: int, reason: str, message: str, **details: Any) -> kmock.KubernetesError:
    return kmock.KubernetesError(code, reason, message, details or None)


def _not_found(plural: str, name: str) -> kmock.KubernetesError:
    return _error(404, "NotFound", f'{plural} "{name}" not found', name=name, kind=plural)


def _no_route() -> kmock.KubernetesError:
    return _error(404, "NotFound", "the server could not find the requested resource")


def _bad_request(message: str) -> kmock.KubernetesError:
    return _error(400, "BadRequest", message)


def _invalid(kind: str, name: str, causes: list[dict[str, str]]) -> kmock.KubernetesError:
    texts = [f"{c['field']}: {c['message']}" for c in causes]
    summary = texts[0] if len(texts) == 1 else f"[{', '.join(texts)}]"
    return _error(422, "Invalid", f'{kind} "{name}" is invalid: {summary}',
                  name=name, kind=kind, causes=causes)


def _required(field: str, detail: str = "") -> dict[str, str]:
    message = f"Required value: {detail}" if detail else "Required value"
    return {"reason": "FieldValueRequired", "message": message, "field": field}


def _bad_value(field: str, value: Any, detail: str) -> dict[str, str]:
    return {"reason": "FieldValueInvalid", "field": field,
            "message": f"Invalid value: {json.dumps(value)}: {detail}"}


def _event(type_: str, obj: dict[str, Any]) -> dict[str, Any]:
    return {"type": type_, "object": obj}


def _list_item(obj: dict[str, Any]) -> dict[str, Any]:
    """Items of a real list carry no kind and apiVersion."""
    return {k: v for k, v in obj.items() if k not in ("kind", "apiVersion")}


def _verb(request: kmock.Request) -> str | None:
    method = str(request.method.value).upper()
    if method == "GET":
        if request.params.get("watch") in ("true", "1"):
            return "watch"
        return "get" if request.name else "list"
    if method == "DELETE":
        return "delete" if request.name else "deletecollection"
    return {"POST": "create", "PATCH": "patch", "PUT": "update"}.get(method)


# ---------------------------------------------------------------- selectors


def _label_requirement(m: re.Match[str]) -> Callable[[Mapping[str, str]], bool]:
    if m["absent"]:
        absent = m["absent"]
        return lambda labels: absent not in labels
    key, op, value = m["key"], m["op"], m["value"]
    if m["set"]:
        values = {v.strip() for v in m["values"].split(",")}
        if m["set"] == "in":
            return lambda labels: labels.get(key) in values
        return lambda labels: labels.get(key) not in values
    if op is None:
        return lambda labels: key in labels
    if op in ("=", "=="):
        return lambda labels: labels.get(key) == value
    if op == "!=":
        return lambda labels: labels.get(key) != value
    try:
        bound = int(value)
    except ValueError:
        raise _bad_request(f"unable to parse requirement: for '{op}', '{value}' "
                           "is not a valid integer") from None

    def compare(labels: Mapping[str, str]) -> bool:
        try:
            have = int(labels[key])
        except (KeyError, ValueError):
            return False
        return have > bound if op == ">" else have < bound

    return compare


def _label_selector(text: str) -> list[Callable[[Mapping[str, str]], bool]]:
    requirements = []
    pos = 0
    while text[pos:].strip():
        m = _REQUIREMENT.match(text, pos)
        if m is None:
            raise _bad_request(f"unable to parse requirement: found '{text[pos:]}', "
                               "expected: identifier")
        requirements.append(_label_requirement(m))
        pos = m.end()
    return requirements


def _field_value(obj: Mapping[str, Any], field: str) -> str:
    value: Any = obj
    for part in ("source.component" if field == "source" else field).split("."):
        value = value.get(part) if isinstance(value, Mapping) else None
    if isinstance(value, bool):
        return "true" if value else "false"
    return "" if value is None else str(value)


def _field_selector(plural: str, text: str) -> list[Callable[[Mapping[str, Any]], bool]]:
    requirements: list[Callable[[Mapping[str, Any]], bool]] = []
    for term in filter(str.strip, text.split(",")):
        m = _FIELD_TERM.fullmatch(term)
        if m is None:
            raise _bad_request(f"invalid selector: '{text}'; can't understand '{term}'")
        field, op, value = m.groups()
        if field not in _FIELDS[plural]:
            raise _bad_request(f"field label not supported: {field}")
        if op == "!=":
            requirements.append(lambda o, f=field, v=value: _field_value(o, f) != v)
        else:
            requirements.append(lambda o, f=field, v=value: _field_value(o, f) == v)
    return requirements


@dataclass(frozen=True)
class _Filter:
    plural: str
    namespace: str | None
    labels: tuple[Callable[[Mapping[str, str]], bool], ...] = ()
    fields: tuple[Callable[[Mapping[str, Any]], bool], ...] = ()

    @classmethod
    def of(cls, request: kmock.Request) -> _Filter:
        plural = request.resource.plural
        fields = _field_selector(plural, request.params.get("fieldSelector", ""))
        if request.name:  # a watch of one object
            fields.append(lambda o, n=request.name: o["metadata"]["name"] == n)
        return cls(plural, request.namespace,
                   tuple(_label_selector(request.params.get("labelSelector", ""))),
                   tuple(fields))

    def __call__(self, obj: Mapping[str, Any]) -> bool:
        meta = obj["metadata"]
        labels = meta.get("labels") or {}
        return ((self.namespace is None or meta.get("namespace") == self.namespace)
                and all(r(labels) for r in self.labels) and all(r(obj) for r in self.fields))

    def translate(self, change: _Change) -> dict[str, Any] | None:
        """The event a watcher with this filter sees for a change, if any: an object that
        starts matching is ADDED to it, one that stops matching is DELETED from it."""
        if change.plural != self.plural:
            return None
        now = self(change.obj)
        before = change.old is not None and self(change.old)
        if change.type != "MODIFIED":
            return _event(change.type, change.obj) if now else None
        if now:
            return _event("MODIFIED" if before else "ADDED", change.obj)
        return _event("DELETED", change.obj) if before else None


# ---------------------------------------------------------------- validation and defaults


def _validate_meta(plural: str, obj: Mapping[str, Any]) -> list[dict[str, str]]:
    meta = obj["metadata"]
    name = meta.get("name") or ""
    causes = []
    pattern, message, limit = ((_DNS1035, _DNS1035_MSG, 63) if plural == "services"
                               else (_DNS1123, _DNS1123_MSG, 253))
    if not name:
        causes.append(_required("metadata.name", "name or generateName is required"))
    elif len(name) > limit:
        causes.append(_bad_value("metadata.name", name,
                                 f"must be no more than {limit} characters"))
    elif not pattern.fullmatch(name):
        causes.append(_bad_value("metadata.name", name, message))
    labels = meta.get("labels") or {}
    for key, value in labels.items():
        prefix, _, part = key.rpartition("/")
        if (not _LABEL_NAME.fullmatch(part) or len(part) > 63
                or (prefix and not _DNS1123.fullmatch(prefix))):
            causes.append(_bad_value("metadata.labels", key, _LABEL_NAME_MSG))
        if not isinstance(value, str) or len(value) > 63 or not _LABEL_VALUE.fullmatch(value):
            causes.append(_bad_value("metadata.labels", value, _LABEL_VALUE_MSG))
    return causes


def _validate_spec(plural: str, obj: Mapping[str, Any]) -> list[dict[str, str]]:
    spec = obj.get("spec") or {}
    causes = []
    if plural == "pods":
        containers = spec.get("containers") or []
        if not containers:
            causes.append(_required("spec.containers"))
        for i, container in enumerate(containers):
            causes += [_required(f"spec.containers[{i}].{key}")
                       for key in ("name", "image") if not container.get(key)]
    elif plural == "services":
        ports = spec.get("ports") or []
        if not ports and spec.get("clusterIP") != "None":
            causes.append(_required("spec.ports"))
        for i, port in enumerate(ports):
            if not isinstance(port.get("port"), int) or not 0 < port["port"] < 65536:
                causes.append(_bad_value(f"spec.ports[{i}].port", port.get("port", 0),
                                         "must be between 1 and 65535, inclusive"))
    return causes


def _qos(spec: Mapping[str, Any]) -> str:
    resources = [c.get("resources") or {} for c in spec["containers"]]
    if not any(r.get("requests") or r.get("limits") for r in resources):
        return "BestEffort"
    for r in resources:
        limits, requests = r.get("limits") or {}, r.get("requests") or {}
        if not all(k in limits and requests.get(k, limits[k]) == limits[k]
                   for k in ("cpu", "memory")):
            return "Burstable"
    return "Guaranteed"


def _pull_policy(image: str) -> str:
    if "@" in image:
        return "IfNotPresent"
    last = image.rsplit("/", 1)[-1]
    return "Always" if ":" not in last or last.endswith(":latest") else "IfNotPresent"


def _pod_defaults(pod: dict[str, Any]) -> None:
    spec = pod["spec"]
    for key, value in (("restartPolicy", "Always"), ("terminationGracePeriodSeconds", 30),
                       ("dnsPolicy", "ClusterFirst"), ("schedulerName", "default-scheduler"),
                       ("serviceAccountName", "default"), ("securityContext", {}),
                       ("priority", 0), ("enableServiceLinks", True)):
        spec.setdefault(key, value)
    for container in [*spec.get("initContainers", []), *spec["containers"]]:
        container.setdefault("imagePullPolicy", _pull_policy(container["image"]))
        container.setdefault("terminationMessagePath", "/dev/termination-log")
        container.setdefault("terminationMessagePolicy", "File")
        container.setdefault("resources", {})
    pod["status"] = {"phase": "Pending", "qosClass": _qos(spec)}


# ---------------------------------------------------------------- status helpers


def _container_id() -> str:
    return f"containerd://{secrets.token_hex(32)}"


def _condition(type_: str, ok: bool, reason: str = "", message: str = "") -> dict[str, Any]:
    condition: dict[str, Any] = {"type": type_, "status": "True" if ok else "False",
                                 "lastProbeTime": None, "lastTransitionTime": _now()}
    if reason:
        condition["reason"] = reason
    if message:
        condition["message"] = message
    return condition


def _started_conditions(pod: Mapping[str, Any], ready: bool) -> list[dict[str, Any]]:
    names = ",".join(c["name"] for c in pod["spec"]["containers"])
    why = ("", "") if ready else ("ContainersNotReady",
                                  f"containers with unready status: [{names}]")
    return [_condition("PodReadyToStartContainers", True), _condition("Initialized", True),
            _condition("Ready", ready, *why), _condition("ContainersReady", ready, *why),
            _condition("PodScheduled", True)]


def running_status(pod: Mapping[str, Any], pod_ip: str, *, ready: bool = True) -> dict[str, Any]:
    """A started pod's status as a kubelet reports it: Running, its IP, the four conditions
    (Ready and ContainersReady as ``ready`` says), every container running."""
    started = _now()
    return {
        "phase": "Running", "hostIP": _HOST_IP, "hostIPs": [{"ip": _HOST_IP}],
        "podIP": pod_ip, "podIPs": [{"ip": pod_ip}], "startTime": started,
        "conditions": _started_conditions(pod, ready),
        "containerStatuses": [
            {"name": c["name"], "image": c["image"], "imageID": f"{c['image']}@sha256:"
             f"{secrets.token_hex(32)}", "containerID": _container_id(), "ready": ready,
             "started": True, "restartCount": 0, "lastState": {},
             "state": {"running": {"startedAt": started}}}
            for c in pod["spec"]["containers"]],
    }


def unschedulable_status(
    message: str = "0/3 nodes are available: 3 Insufficient memory.",
) -> dict[str, Any]:
    """A pod the scheduler cannot place: Pending, PodScheduled False, reason Unschedulable."""
    return {"phase": "Pending",
            "conditions": [_condition("PodScheduled", False, "Unschedulable", message)]}


def image_pull_backoff_status(pod: Mapping[str, Any], message: str | None = None
                              ) -> dict[str, Any]:
    """A pod whose image cannot be pulled: Pending, every container waiting in
    ImagePullBackOff (``Back-off pulling image "<image>"`` unless ``message`` is given)."""
    return {
        "phase": "Pending", "hostIP": _HOST_IP, "hostIPs": [{"ip": _HOST_IP}],
        "startTime": _now(), "conditions": _started_conditions(pod, False),
        "containerStatuses": [
            {"name": c["name"], "image": c["image"], "imageID": "", "ready": False,
             "started": False, "restartCount": 0, "lastState": {},
             "state": {"waiting": {"reason": "ImagePullBackOff",
                                   "message": message or f'Back-off pulling image "{c["image"]}"'}}}
            for c in pod["spec"]["containers"]],
    }


def evicted_status(message: str = "The node was low on resource: memory.") -> dict[str, Any]:
    """A pod the kubelet evicted: Failed, reason Evicted, a DisruptionTarget condition."""
    return {"phase": "Failed", "reason": "Evicted", "message": message,
            "conditions": [_condition("DisruptionTarget", True, "TerminationByKubelet", message),
                           _condition("Ready", False, "PodFailed"),
                           _condition("ContainersReady", False, "PodFailed")]}


def oom_killed_status(pod: Mapping[str, Any], restart_count: int = 1) -> dict[str, Any]:
    """The first container killed by the OOM killer (exit code 137): state and, when it
    restarted before, lastState terminated with reason OOMKilled; Failed when the pod's
    restartPolicy is Never, else still Running (the kubelet restarts the container)."""
    container = pod["spec"]["containers"][0]
    terminated = {"exitCode": 137, "reason": "OOMKilled", "startedAt": _now(-60),
                  "finishedAt": _now(), "containerID": _container_id()}
    never = pod["spec"].get("restartPolicy") == "Never"
    return {
        "phase": "Failed" if never else "Running",
        "conditions": _started_conditions(pod, False),
        "containerStatuses": [
            {"name": container["name"], "image": container["image"], "imageID": "",
             "ready": False, "started": False, "restartCount": restart_count,
             "containerID": terminated["containerID"], "state": {"terminated": terminated},
             "lastState": {"terminated": terminated} if restart_count else {}}],
    }


# ---------------------------------------------------------------- the emulator


class _Emulator(kmock.KubernetesEmulator):
    """kmock's emulator with the real server's semantics. State changes are synchronous,
    under ``lock`` (callable from any thread); watchers on the loop are woken after each."""

    def __init__(self, server: KubeAPIServer) -> None:
        super().__init__()
        self.server = server
        self.lock = threading.RLock()
        self.rv = _FIRST_RV
        self.compacted_rv = _FIRST_RV  # a new watch from an older resourceVersion gets 410
        self.changes: list[_Change] = []  # also kept while a live watch still needs them
        self.cursors: dict[int, int] = {}  # live watches: how far each has read
        self.faults: list[_Fault] = []
        self.request_log: list[LoggedRequest] = []
        self.wakers: set[asyncio.Event] = set()  # touched on the loop only
        self.loop: asyncio.AbstractEventLoop | None = None
        self.closing = False
        self.watch_ids = itertools.count()
        self.cluster_ips = itertools.count(10)
        self.node_ports = itertools.count(30000)
        for plural, kind in _KINDS.items():
            self.resources[f"v1/{plural}"] = kmock.ResourceInfo(
                kind=kind, namespaced=True, singular=kind.lower(),
                verbs=["create", "delete", "deletecollection", "get", "list", "patch", "watch"],
                subresources=["status"] if plural != "events" else [])
        self.fallback[kmock.method.DELETE] << self._serve_delete_collection
        self.fallback["get /version/"] << self._serve_server_version  # VersionApi's path

    # -- kmock's hooks

    async def _handle(self, request: kmock.Request) -> aiohttp.web.StreamResponse:
        with self.lock:
            self.request_log.append(LoggedRequest(request.method.value, request.url.path,
                                                  dict(request.params)))
        headers = {k.lower(): v for k, v in request.headers.items()}
        if self.server.auth and headers.get("authorization") != f"Bearer {self.server.token}":
            raise _error(401, "Unauthorized", "Unauthorized")
        res = request.resource
        if res is not None and res.plural is not None:
            verb = _verb(request)
            if (res.group, res.version) != ("", "v1") or res.plural not in _KINDS:
                raise _no_route()
            if request.subresource not in (None, "status") or (
                    request.subresource and verb not in ("get", "patch", "update")):
                raise _no_route()
            if verb is None or verb == "update":
                raise _error(405, "MethodNotAllowed",
                             "the server does not allow this method on the requested resource")
            fault = self._take_fault(verb, res.plural, request.name)
            if fault is not None and verb == "watch" and fault.code == 410:
                stream = self._error_stream(_status_body(410, fault.reason, fault.message))
                return await kmock.Response(headers=_JSON, payload=stream)(request)
            if fault is not None:
                raise _error(fault.code, fault.reason, fault.message)
        # Past kmock's own emulator: its _handle would change the state its own way.
        return await kmock.RawHandler._handle(self, request)

    async def _render_error(self, exc: Exception) -> aiohttp.web.StreamResponse:
        if type(exc) is kmock.KubernetesError:
            body = _status_body(exc.status, exc.reason or "", exc.message or "", exc.details)
        elif isinstance(exc, kmock.KubernetesNotFoundError):  # kmock's own: unknown URLs
            body = _status_body(404, "NotFound", "the server could not find the requested "
                                "resource")
        else:
            log.error("kube api test server failed", exc_info=exc)
            body = _status_body(500, "InternalError", f"Internal error occurred: {exc}")
        return aiohttp.web.json_response(body, status=body["code"])

    async def _stream_error(self, exc: Exception, raw: aiohttp.web.StreamResponse) -> None:
        log.error("kube api test server failed in a watch", exc_info=exc)
        body = _status_body(500, "InternalError", f"Internal error occurred: {exc}")
        await raw.write(json.dumps(_event("ERROR", body)).encode() + b"\n")

    def _get_resources(self) -> list[kmock.resource]:
        return list(self.resources)  # the declared ones; the objects may change meanwhile

    async def _serve_version(self, request: kmock.Request) -> Any:
        body = await super()._serve_version(request)
        if body.get("groupVersion") == "/v1":
            body["groupVersion"] = "v1"  # the core group has no name
        return body

    # -- the reactions

    def _serve_fetch(self, request: kmock.Request) -> dict[str, Any]:
        with self.lock:
            return self._get(request.resource.plural, request.namespace, request.name)

    def _serve_list(self, request: kmock.Request) -> dict[str, Any]:
        flt = _Filter.of(request)
        with self.lock:
            items = [_list_item(obj) for obj in self.select(flt)]
            rv = self.rv
        return {"kind": f"{_KINDS[flt.plural]}List", "apiVersion": "v1",
                "metadata": {"resourceVersion": str(rv)}, "items": items}

    def _serve_create(self, request: kmock.Request) -> kmock.Response:
        obj = self.create_object(request.resource.plural, request.namespace, request.data)
        if request.resource.plural == "pods":
            self._kubelet("on_create", obj)
        return kmock.Response(status=201, payload=obj)

    def _serve_update(self, request: kmock.Request) -> dict[str, Any]:
        headers = {k.lower(): v for k, v in request.headers.items()}
        media = headers.get("content-type", "").split(";")[0].strip()
        if media not in ("application/merge-patch+json", "application/strategic-merge-patch+json",
                         "application/json-patch+json"):
            raise _error(415, "UnsupportedMediaType",
                         "the body of the request was in an unknown format - accepted media "
                         "types include: application/json-patch+json, application/merge-patch"
                         "+json, application/strategic-merge-patch+json")
        if not isinstance(request.data, list if media.startswith("application/json-") else dict):
            raise _bad_request("the patch is not a JSON object (a list for a JSON patch)")
        return self.patch_object(request.resource.plural, request.namespace, request.name,
                                 request.data, status_only=request.subresource == "status")

    def _serve_delete(self, request: kmock.Request) -> dict[str, Any]:
        options = dict(request.data) if isinstance(request.data, dict) else {}
        if "gracePeriodSeconds" in request.params:
            options["gracePeriodSeconds"] = request.params["gracePeriodSeconds"]
        return self.delete_object(request.resource.plural, request.namespace, request.name, options)

    def _serve_delete_collection(self, request: kmock.Request) -> dict[str, Any]:
        flt = _Filter.of(request)
        with self.lock:
            names = [(o["metadata"]["namespace"], o["metadata"]["name"]) for o in self.select(flt)]
        items = []
        for namespace, name in names:
            try:
                items.append(_list_item(self.delete_object(flt.plural, namespace, name, {})))
            except kmock.KubernetesError:
                continue  # gone meanwhile
        return {"kind": f"{_KINDS[flt.plural]}List", "apiVersion": "v1",
                "metadata": {"resourceVersion": str(self.rv)}, "items": items}

    def _serve_watch(self, request: kmock.Request) -> kmock.Response:
        flt = _Filter.of(request)
        since = request.params.get("resourceVersion", "")
        try:
            timeout = int(request.params.get("timeoutSeconds") or 0)
            cursor = int(since) if since not in ("", "0") else None
        except ValueError as exc:
            raise _bad_request(f"invalid watch parameter: {exc}") from None
        bookmarks = request.params.get("allowWatchBookmarks") == "true"
        with self.lock:
            if cursor is not None and cursor < self.compacted_rv:
                body = _status_body(410, "Expired", f"too old resource version: {cursor} "
                                    f"({self.compacted_rv})")
                return kmock.Response(headers=_JSON, payload=self._error_stream(body))
            initial = []
            if cursor is None:  # the current state first, as synthetic ADDED events
                initial = [_event("ADDED", obj) for obj in self.select(flt)]
                cursor = self.rv
            watch_id = next(self.watch_ids)
            self.cursors[watch_id] = cursor
        stream = self._watch(flt, watch_id, initial, timeout, bookmarks)
        return kmock.Response(headers=_JSON, payload=stream)

    # -- watching

    async def _error_stream(self, status: dict[str, Any]) -> AsyncIterator[Any]:
        yield _event("ERROR", status)

    async def _watch(self, flt: _Filter, watch_id: int, initial: list[dict[str, Any]],
                     timeout_s: int, bookmarks: bool) -> AsyncIterator[Any]:
        loop = asyncio.get_running_loop()
        waker = asyncio.Event()
        self.wakers.add(waker)
        deadline = loop.time() + timeout_s if timeout_s > 0 else None
        interval = self.server.bookmark_interval_s
        next_bookmark = loop.time() + interval if bookmarks else None
        try:
            yield b""  # the headers go out now, as the real server sends them
            for event in initial:
                yield event
            while not self.closing:
                waker.clear()
                with self.lock:
                    cursor = self.cursors[watch_id]
                    start = bisect.bisect_right(self.changes, cursor, key=lambda c: c.rv)
                    batch = self.changes[start:]
                    # A future resourceVersion waits for the cluster to get there.
                    self.cursors[watch_id] = cursor = max(cursor, self.rv)
                for change in batch:
                    if (event := flt.translate(change)) is not None:
                        yield event
                now = loop.time()
                if deadline is not None and now >= deadline:
                    return
                if next_bookmark is not None and now >= next_bookmark:
                    yield _event("BOOKMARK", {"kind": _KINDS[flt.plural], "apiVersion": "v1",
                                              "metadata": {"resourceVersion": str(cursor)}})
                    next_bookmark = now + interval
                wake_at = min(t for t in (deadline, next_bookmark, now + 3600) if t is not None)
                try:
                    async with asyncio.timeout(wake_at - now):
                        await waker.wait()
                except TimeoutError:
                    pass
        finally:
            self.wakers.discard(waker)
            with self.lock:
                self.cursors.pop(watch_id, None)

    def wake_all(self) -> None:
        for waker in self.wakers:
            waker.set()

    def _notify(self) -> None:
        loop = self.loop
        if loop is not None:
            with contextlib.suppress(RuntimeError):  # the loop closed: nobody watches
                loop.call_soon_threadsafe(self.wake_all)

    # -- the state (every method below: any thread)

    def _key(self, plural: str, namespace: str | None, name: str) -> tuple[Any, ...]:
        return (_RESOURCES[plural], namespace, name)

    def current(self, plural: str, namespace: str | None, name: str) -> dict[str, Any] | None:
        key = self._key(plural, namespace, name)
        if key not in self.objects or self.objects[key].deleted:
            return None
        return self.objects[key].raw

    def _get(self, plural: str, namespace: str | None, name: str | None) -> dict[str, Any]:
        obj = self.current(plural, namespace, name or "")
        if obj is None:
            raise _not_found(plural, name or "")
        return obj

    def select(self, flt: _Filter) -> list[dict[str, Any]]:
        found = [obj.raw for (res, _, _), obj in self.objects.items()
                 if res.plural == flt.plural and not obj.deleted and flt(obj.raw)]
        return sorted(found, key=lambda o: (o["metadata"]["namespace"], o["metadata"]["name"]))

    def commit(self, plural: str, type_: str, obj: dict[str, Any],
               old: dict[str, Any] | None) -> dict[str, Any]:
        """Record one change under a new resourceVersion; wake the watchers."""
        self.rv += 1
        obj = {**obj, "metadata": {**obj["metadata"], "resourceVersion": str(self.rv)}}
        meta = obj["metadata"]
        key = self._key(plural, meta["namespace"], meta["name"])
        if key not in self.objects:
            self.objects[key] = obj
        else:
            self.objects[key].history.append(obj)
        if type_ == "DELETED":
            self.objects[key].delete()
        self.changes.append(_Change(self.rv, plural, type_, obj, old))
        limit = self.server.history_limit
        if limit is not None and len(self.changes) > limit:
            self.compacted_rv = max(self.compacted_rv, self.changes[-limit - 1].rv)
        self._trim()
        self._notify()
        return obj

    def _trim(self) -> None:
        floor = min([self.compacted_rv, *self.cursors.values()])
        drop = bisect.bisect_right(self.changes, floor, key=lambda c: c.rv)
        del self.changes[:drop]

    def compact(self) -> int:
        with self.lock:
            self.compacted_rv = self.rv
            self._trim()
            return self.rv

    def create_object(self, plural: str, namespace: str | None, body: Any) -> dict[str, Any]:
        if not isinstance(body, dict) or not isinstance(body.get("metadata", {}), dict):
            raise _bad_request("the body of the request is not a JSON object")
        kind = _KINDS[plural]
        obj = copy.deepcopy(body)
        meta = obj.setdefault("metadata", {})
        if meta.get("namespace", namespace) != namespace:
            raise _bad_request("the namespace of the provided object does not match the "
                               "namespace sent on the request")
        obj.update(kind=kind, apiVersion="v1")
        meta["namespace"] = namespace
        for key in ("resourceVersion", "deletionTimestamp", "deletionGracePeriodSeconds"):
            meta.pop(key, None)
        with self.lock:
            if not meta.get("name") and meta.get("generateName"):
                while True:
                    suffix = "".join(random.choices(_NAME_CHARS, k=5))
                    meta["name"] = meta["generateName"][:58] + suffix
                    if self.current(plural, namespace, meta["name"]) is None:
                        break
            name = meta.get("name") or ""
            causes = _validate_meta(plural, obj) + _validate_spec(plural, obj)
            if causes:
                raise _invalid(kind, name, causes)
            quota = self.server.pod_quota
            if plural == "pods" and quota is not None:
                used = sum(1 for p in self.select(_Filter("pods", namespace))
                           if p.get("status", {}).get("phase") not in _TERMINAL)
                if used >= quota:
                    raise _error(403, "Forbidden", f'pods "{name}" is forbidden: exceeded quota: '
                                 f"compute-resources, requested: pods=1, used: pods={used}, "
                                 f"limited: pods={quota}", name=name, kind=plural)
            if self.current(plural, namespace, name) is not None:
                raise _error(409, "AlreadyExists", f'{plural} "{name}" already exists',
                             name=name, kind=plural)
            meta.update(uid=str(uuid.uuid4()), creationTimestamp=_now())
            if plural == "pods":
                _pod_defaults(obj)
            elif plural == "services":
                self._service_defaults(obj)
            return self.commit(plural, "ADDED", obj, None)

    def _service_defaults(self, service: dict[str, Any]) -> None:
        spec = service.setdefault("spec", {})
        spec.setdefault("type", "ClusterIP")
        if spec.get("clusterIP") != "None":
            n = next(self.cluster_ips)
            spec["clusterIP"] = f"10.96.{n >> 8 & 255}.{n & 255}"
        spec["clusterIPs"] = [spec["clusterIP"]]
        for key, value in (("sessionAffinity", "None"), ("ipFamilies", ["IPv4"]),
                           ("ipFamilyPolicy", "SingleStack"), ("internalTrafficPolicy", "Cluster")):
            spec.setdefault(key, value)
        exposed = spec["type"] in ("NodePort", "LoadBalancer")
        if exposed:
            spec.setdefault("externalTrafficPolicy", "Cluster")
        for port in spec.get("ports", []):
            port.setdefault("protocol", "TCP")
            port.setdefault("targetPort", port["port"])
            if exposed:
                port.setdefault("nodePort", next(self.node_ports))
        service["status"] = {"loadBalancer": {}}

    def patch_object(self, plural: str, namespace: str | None, name: str | None, data: Any,
                     *, status_only: bool = False) -> dict[str, Any]:
        with self.lock:
            old = self._get(plural, namespace, name)
            wanted = (data.get("metadata") or {}).get("resourceVersion") if isinstance(
                data, dict) else None
            if wanted and wanted != old["metadata"]["resourceVersion"]:
                raise _error(409, "Conflict", f'Operation cannot be fulfilled on {plural} "{name}"'
                             ": the object has been modified; please apply your changes to the "
                             "latest version and try again", name=name, kind=plural)
            try:
                scratch = kmock.Object(copy.deepcopy(old))
                scratch.patch(data)  # kmock: JSON merge patch for a dict, JSON patch for a list
                new = scratch.raw
            except Exception as exc:  # any malformed patch
                raise _error(422, "Invalid", f"the server rejected our request due to an error "
                             f"in our request: {exc}") from None
            if not isinstance(new.get("metadata"), dict):
                raise _invalid(_KINDS[plural], name or "", [_required("metadata")])
            # What a patch cannot change: identity, bookkeeping, and the status (or, through
            # /status, anything but the status).
            new = ({**old, "status": new.get("status", {})} if status_only else
                   {**new, "kind": old["kind"], "apiVersion": old["apiVersion"]})
            if not status_only and "status" in old:
                new["status"] = old["status"]
            new["metadata"] = {**new["metadata"], **{
                k: v for k, v in old["metadata"].items()
                if k in ("name", "namespace", "uid", "creationTimestamp", "resourceVersion",
                         "deletionTimestamp", "deletionGracePeriodSeconds", "generateName")}}
            causes = _validate_meta(plural, new)
            if causes:
                raise _invalid(_KINDS[plural], name or "", causes)
            if new == old:
                return old  # a no-op: no new resourceVersion, no event
            return self.commit(plural, "MODIFIED", new, old)

    def mutate(self, plural: str, namespace: str, name: str,
               change: Callable[[dict[str, Any]], None]) -> dict[str, Any]:
        """Change an object in place of its controller (a kubelet, the scheduler)."""
        with self.lock:
            old = self.current(plural, namespace, name)
            if old is None:
                raise KeyError(f"{plural} {namespace}/{name} does not exist")
            new = copy.deepcopy(old)
            change(new)
            return self.commit(plural, "MODIFIED", new, old)

    def delete_object(self, plural: str, namespace: str | None, name: str | None,
                      options: Mapping[str, Any]) -> dict[str, Any]:
        try:
            grace = options.get("gracePeriodSeconds")
            grace = None if grace is None else int(grace)
        except (TypeError, ValueError):
            raise _bad_request("gracePeriodSeconds must be an integer") from None
        starting = False
        with self.lock:
            obj = self._get(plural, namespace, name)
            meta = obj["metadata"]
            for key, have in (("uid", meta["uid"]), ("resourceVersion", meta["resourceVersion"])):
                want = (options.get("preconditions") or {}).get(key)
                if want is not None and want != have:
                    label = "UID" if key == "uid" else "ResourceVersion"
                    raise _error(409, "Conflict", f"Precondition failed: {label} in precondition: "
                                 f"{want}, {label} in object meta: {have}", name=name, kind=plural)
            delay = self.server.deletion_delay_s if plural == "pods" and grace != 0 else 0.0
            if meta.get("deletionTimestamp") and grace != 0:
                return obj  # already terminating
            if delay > 0:
                period = grace if grace is not None else obj["spec"].get(
                    "terminationGracePeriodSeconds", 30)
                new = copy.deepcopy(obj)
                new["metadata"].update(deletionTimestamp=_now(period),
                                       deletionGracePeriodSeconds=period)
                result = self.commit(plural, "MODIFIED", new, obj)
                uid = meta["uid"]
                self._later(delay, lambda: self._finish_delete(plural, namespace, uid, name))
            else:
                result = self.commit(plural, "DELETED", obj, obj)
            starting = plural == "pods" and not meta.get("deletionTimestamp")
        if starting:
            self._kubelet("on_delete", result)
        if delay <= 0:
            self._collect_dependents(namespace, meta["uid"])
        if plural == "events":  # events answer a Status, pods and services the object
            return {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Success",
                    "details": {"name": name, "kind": plural, "uid": meta["uid"]}}
        return result

    def _finish_delete(self, plural: str, namespace: str | None, uid: str, name: str) -> None:
        with self.lock:
            obj = self.current(plural, namespace, name)
            if obj is None or obj["metadata"]["uid"] != uid:
                return
            self.commit(plural, "DELETED", obj, obj)
        self._collect_dependents(namespace, uid)

    def _collect_dependents(self, namespace: str | None, owner_uid: str) -> None:
        """The garbage collector: objects whose ownerReferences name a removed owner go too."""
        with self.lock:
            dependents = [(res.plural, o.raw["metadata"]["name"])
                          for (res, ns, _), o in self.objects.items()
                          if ns == namespace and not o.deleted and any(
                              ref.get("uid") == owner_uid
                              for ref in o.raw["metadata"].get("ownerReferences") or ())]
        for plural, name in dependents:
            try:
                self.delete_object(plural, namespace, name, {})
            except kmock.KubernetesError:
                continue

    def _later(self, delay_s: float, callback: Callable[[], None]) -> None:
        loop = self.loop
        if loop is not None:
            with contextlib.suppress(RuntimeError):  # the loop closed: nothing to finish
                loop.call_soon_threadsafe(loop.call_later, delay_s, callback)

    def _kubelet(self, hook: str, pod: dict[str, Any]) -> None:
        kubelet = self.server.kubelet
        if kubelet is None:
            return
        try:
            getattr(kubelet, hook)(self.server, copy.deepcopy(pod))
        except Exception as exc:  # a kubelet's failure is not the API's
            log.exception("kubelet %s failed", hook)
            self.server.kubelet_errors.append(exc)

    def _take_fault(self, verb: str, plural: str, name: str | None) -> _Fault | None:
        with self.lock:
            for fault in self.faults:
                if (fault.verb in ("*", verb) and fault.resource in ("*", plural)
                        and fault.name in (None, name)):
                    fault.times -= 1
                    if fault.times <= 0:
                        self.faults.remove(fault)
                    return fault
        return None


# ---------------------------------------------------------------- the server


class KubeAPIServer:
    """The test API server on 127.0.0.1 and a free port, in a thread with its own loop.

    ``kubelet`` is told of pods created and deleted (see ``Kubelet``); ``auth`` requires the
    bearer token of ``kubeconfig()`` (401 otherwise); ``deletion_delay_s``: how long a deleted
    pod stays terminating (deletionTimestamp set) before it goes (0: at once; a request's
    ``gracePeriodSeconds=0`` always deletes at once); ``bookmark_interval_s``: the period of
    BOOKMARK events to watches that allow them; ``history_limit``: how many changes a new watch
    may start behind (None: all since the last ``compact()``); ``pod_quota``: the pods a
    namespace may hold before creation answers the quota's 403. These attributes may be
    changed while the server runs. Every method is thread-safe."""

    def __init__(self, *, kubelet: Kubelet | None = None, auth: bool = True,
                 deletion_delay_s: float = 0.0, bookmark_interval_s: float = 1.0,
                 history_limit: int | None = None, pod_quota: int | None = None,
                 node_name: str = "node-1") -> None:
        self.kubelet = kubelet
        self.auth = auth
        self.token = secrets.token_urlsafe(24)
        self.deletion_delay_s = deletion_delay_s
        self.bookmark_interval_s = bookmark_interval_s
        self.history_limit = history_limit
        self.pod_quota = pod_quota
        self.node_name = node_name
        self.kubelet_errors: list[Exception] = []
        self._emulator = _Emulator(self)
        self._port = 0
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._failure: BaseException | None = None
        self._stopping: asyncio.Event | None = None
        self._web: aiohttp.web.Server | None = None
        self._runner: aiohttp.web.ServerRunner | None = None
        self._site: aiohttp.web.SockSite | None = None

    # -- lifecycle

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._port}"

    @property
    def port(self) -> int:
        return self._port

    def start(self, timeout_s: float = 10.0) -> str:
        if self._thread is not None:
            raise RuntimeError("a KubeAPIServer starts once")
        self._thread = threading.Thread(target=self._run, name="kube-api-server", daemon=True)
        self._thread.start()
        if not self._ready.wait(timeout_s):
            raise RuntimeError("the kube API test server did not start")
        if self._failure is not None:
            raise RuntimeError("the kube API test server did not start") from self._failure
        return self.url

    def stop(self) -> None:
        thread, loop = self._thread, self._emulator.loop
        if thread is None or not thread.is_alive():
            return
        if threading.current_thread() is thread:
            raise RuntimeError("stop() cannot run on the server's own thread")
        if loop is not None and self._stopping is not None:
            loop.call_soon_threadsafe(self._stopping.set)
        thread.join(_SHUTDOWN_S + 10)

    def __enter__(self) -> KubeAPIServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _run(self) -> None:
        try:
            asyncio.run(self._main())
        except BaseException as exc:  # surfaced by start()
            self._failure = exc
        finally:
            self._ready.set()

    async def _main(self) -> None:
        self._stopping = asyncio.Event()
        emulator = self._emulator
        async with emulator:  # kmock's handler context (its stream feeder)
            self._web = aiohttp.web.Server(emulator, handler_cancellation=True, access_log=None)
            self._runner = aiohttp.web.ServerRunner(self._web, shutdown_timeout=_SHUTDOWN_S)
            await self._runner.setup()
            emulator.loop = asyncio.get_running_loop()
            try:
                await self._listen()
                self._ready.set()
                await self._stopping.wait()
            finally:
                emulator.closing = True
                emulator.wake_all()
                await self._runner.cleanup()
                emulator.loop = None

    async def _listen(self) -> None:
        assert self._runner is not None
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(("127.0.0.1", self._port))
            self._port = sock.getsockname()[1]
            site = aiohttp.web.SockSite(self._runner, sock)
            await site.start()
        except BaseException:
            sock.close()
            raise
        self._site = site

    async def _down(self) -> None:
        if self._site is not None:
            await self._site.stop()  # closes the listening socket: connections are refused
            self._site = None
        assert self._web is not None
        for connection in self._web.connections:  # open connections and watches break
            connection.force_close()

    async def _up(self) -> None:
        if self._site is None:
            await self._listen()

    def _on_loop(self, coro: Any, timeout_s: float = 10.0) -> None:
        loop = self._emulator.loop
        if loop is None or threading.current_thread() is self._thread:
            coro.close()
            raise RuntimeError("the server is not running, or this is its own thread")
        asyncio.run_coroutine_threadsafe(coro, loop).result(timeout_s)

    # -- faults

    def api_down(self) -> None:
        """Refuse connections (the listening socket is closed) and break the open ones, watch
        streams included, as an unreachable API server does. The state is kept."""
        self._on_loop(self._down())

    def api_up(self) -> None:
        """Listen again, on the same port."""
        self._on_loop(self._up())

    def fail(self, verb: str, resource: str, code: int, reason: str, message: str,
             times: int = 1, *, name: str | None = None) -> None:
        """Answer the next ``times`` requests of ``verb`` (get, list, watch, create, patch,
        delete, deletecollection, or "*") on ``resource`` (pods, services, events, or "*"),
        of object ``name`` if given, with this Status. A watch answers 410 as the real server
        does, in the stream: an ERROR event (the client's Watch raises it)."""
        with self._emulator.lock:
            self._emulator.faults.append(_Fault(verb, resource, name, code, reason, message,
                                                times))

    def compact(self) -> int:
        """Forget the history up to now, as etcd's compaction does: a new watch from an older
        resourceVersion gets 410 Expired. Returns the resourceVersion compacted to."""
        return self._emulator.compact()

    # -- the state

    @property
    def emulator(self) -> kmock.KubernetesEmulator:
        """kmock's handler: ``.objects`` (every object with its history), DSL reactions."""
        return self._emulator

    @property
    def resource_version(self) -> int:
        return self._emulator.rv

    @property
    def requests(self) -> list[LoggedRequest]:
        """Every request received so far: method, path, query."""
        with self._emulator.lock:
            return list(self._emulator.request_log)

    def pods(self, namespace: str | None = None) -> list[dict[str, Any]]:
        return self._snapshot("pods", namespace)

    def services(self, namespace: str | None = None) -> list[dict[str, Any]]:
        return self._snapshot("services", namespace)

    def pod(self, namespace: str, name: str) -> dict[str, Any] | None:
        with self._emulator.lock:
            return copy.deepcopy(self._emulator.current("pods", namespace, name))

    def _snapshot(self, plural: str, namespace: str | None) -> list[dict[str, Any]]:
        with self._emulator.lock:
            return copy.deepcopy(self._emulator.select(_Filter(plural, namespace)))

    def update_pod_status(self, namespace: str, name: str,
                          status: Mapping[str, Any]) -> dict[str, Any]:
        """Merge ``status`` into the pod's (JSON merge: lists replaced, None removes a key);
        watchers see MODIFIED. KeyError if the pod does not exist."""
        def change(pod: dict[str, Any]) -> None:
            scratch = kmock.Object(pod.get("status") or {})
            scratch.patch(copy.deepcopy(dict(status)))
            pod["status"] = scratch.raw

        return copy.deepcopy(self._emulator.mutate("pods", namespace, name, change))

    def set_pod_phase_running(self, namespace: str, name: str, pod_ip: str,
                              ready: bool = True) -> dict[str, Any]:
        """Bind the pod to ``node_name`` (if unbound) and report it Running with this IP
        (``running_status``), in one change."""
        def change(pod: dict[str, Any]) -> None:
            pod["spec"].setdefault("nodeName", self.node_name)
            pod["status"] = {**pod.get("status", {}), **running_status(pod, pod_ip, ready=ready)}

        return copy.deepcopy(self._emulator.mutate("pods", namespace, name, change))

    def add_event(self, namespace: str, pod_name: str, reason: str, message: str,
                  type: str = "Warning") -> dict[str, Any]:
        """A v1 Event about the pod, from the kubelet (the scheduler for FailedScheduling)."""
        pod = self.pod(namespace, pod_name) or {"metadata": {}}
        component = "default-scheduler" if reason in ("FailedScheduling", "Scheduled") else (
            "kubelet")
        now = _now()
        event = {
            "metadata": {"name": f"{pod_name}.{secrets.token_hex(8)}"},
            "involvedObject": {"kind": "Pod", "namespace": namespace, "name": pod_name,
                               "uid": pod["metadata"].get("uid", ""), "apiVersion": "v1",
                               "resourceVersion": pod["metadata"].get("resourceVersion", "")},
            "reason": reason, "message": message, "type": type, "count": 1,
            "source": {"component": component}, "firstTimestamp": now, "lastTimestamp": now,
            "eventTime": None, "reportingComponent": component, "reportingInstance": "",
        }
        return copy.deepcopy(self._emulator.create_object("events", namespace, event))

    def kubeconfig(self, path: str | Path, namespace: str = "default") -> Path:
        """Write a kubeconfig for this server (bearer token user, plain http)."""
        if not self._port:
            raise RuntimeError("start() the server first: the kubeconfig names its port")
        name = "kube-api-test"
        config = {
            "apiVersion": "v1", "kind": "Config", "preferences": {},
            "clusters": [{"name": name, "cluster": {"server": self.url}}],
            "users": [{"name": name, "user": {"token": self.token}}],
            "contexts": [{"name": name, "context": {"cluster": name, "user": name,
                                                    "namespace": namespace}}],
            "current-context": name,
        }
        path = Path(path)
        path.write_text(json.dumps(config, indent=2), encoding="utf-8")
        return path
