"""The Kubernetes API test server (tests/doubles/kube_api.py) through the official client:
CoreV1Api configured from the kubeconfig it writes, kubernetes.watch.Watch, real HTTP on
loopback. What the Kubernetes provider's tests will rely on is pinned here, including how the
client surfaces each failure."""

from __future__ import annotations

import json
import queue
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import urllib3
from kubernetes import client, config, watch

from tests.doubles.kube_api import (
    KubeAPIServer,
    evicted_status,
    image_pull_backoff_status,
    oom_killed_status,
    unschedulable_status,
)

NS = "desktops"


class RecordingKubelet:
    """Records the hook calls; ``start`` makes each pod Running from a thread of its own."""

    def __init__(self, start: bool = False) -> None:
        self.start = start
        self.created: list[dict[str, Any]] = []
        self.deleted: list[dict[str, Any]] = []
        self.threads: list[threading.Thread] = []

    def on_create(self, server: KubeAPIServer, pod: dict[str, Any]) -> None:
        self.created.append(pod)
        if self.start:
            meta = pod["metadata"]
            thread = threading.Thread(target=self._run, args=(server, meta["namespace"],
                                                              meta["name"]))
            self.threads.append(thread)
            thread.start()

    def _run(self, server: KubeAPIServer, namespace: str, name: str) -> None:
        time.sleep(0.1)
        server.add_event(namespace, name, "Pulled", "Container image already present",
                         type="Normal")
        server.set_pod_phase_running(namespace, name, "10.244.0.7")

    def on_delete(self, server: KubeAPIServer, pod: dict[str, Any]) -> None:
        self.deleted.append(pod)


def make_server(**kwargs: Any) -> KubeAPIServer:
    kwargs.setdefault("bookmark_interval_s", 0.2)
    return KubeAPIServer(**kwargs)


@pytest.fixture
def kubelet() -> RecordingKubelet:
    return RecordingKubelet()


@pytest.fixture
def server(kubelet: RecordingKubelet) -> Iterator[KubeAPIServer]:
    with make_server(kubelet=kubelet) as running:
        yield running
    for thread in kubelet.threads:
        thread.join(5)


def core_api(server: KubeAPIServer, directory: Path) -> client.ApiClient:
    configuration = client.Configuration()
    config.load_kube_config(config_file=str(server.kubeconfig(directory / "kubeconfig")),
                            client_configuration=configuration)
    return client.ApiClient(configuration)


@pytest.fixture
def core(server: KubeAPIServer, tmp: Path) -> Iterator[client.CoreV1Api]:
    with core_api(server, tmp) as api:
        yield client.CoreV1Api(api)


def pod_body(name: str | None = None, labels: dict[str, str] | None = None,
             **spec: Any) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name} if name else {"generateName": "desktop-"}
    meta["labels"] = labels or {}
    return {"metadata": meta, "spec": {"containers": [{"name": "desktop",
                                                        "image": "desktop:1"}], **spec}}


def api_error(call: Callable[[], Any]) -> tuple[client.ApiException, dict[str, Any]]:
    with pytest.raises(client.ApiException) as caught:
        call()
    return caught.value, json.loads(caught.value.body)


def events_of(core: client.CoreV1Api, **kwargs: Any) -> list[dict[str, Any]]:
    """Every event of a watch that ends by itself (timeout_seconds)."""
    return list(watch.Watch().stream(core.list_namespaced_pod, namespace=NS, **kwargs))


class Watcher:
    """A watch in a thread (as a provider runs it), its events in a queue."""

    def __init__(self, list_call: Callable[..., Any], **kwargs: Any) -> None:
        self.events: queue.Queue[Any] = queue.Queue()
        self.watch = watch.Watch()
        self.thread = threading.Thread(target=self._run, args=(list_call, kwargs), daemon=True)
        self.thread.start()

    def _run(self, list_call: Callable[..., Any], kwargs: dict[str, Any]) -> None:
        try:
            for event in self.watch.stream(list_call, **kwargs):
                self.events.put(event)
        except Exception as exc:  # handed to the test
            self.events.put(exc)
        self.events.put(None)

    def next(self, timeout_s: float = 5.0) -> Any:
        return self.events.get(timeout=timeout_s)

    def until(self, done: Callable[[dict[str, Any]], bool],
              timeout_s: float = 5.0) -> list[dict[str, Any]]:
        seen = []
        deadline = time.monotonic() + timeout_s
        while True:
            event = self.events.get(timeout=max(0.01, deadline - time.monotonic()))
            assert isinstance(event, dict), f"the watch ended: {event!r}"
            seen.append(event)
            if done(event):
                return seen

    def close(self) -> None:
        self.watch.stop()
        self.thread.join(10)
        assert not self.thread.is_alive()


# ---------------------------------------------------------------- create, get, list


def test_create_assigns_what_the_server_assigns(server: KubeAPIServer,
                                                core: client.CoreV1Api) -> None:
    rv = server.resource_version
    pod = core.create_namespaced_pod(NS, pod_body())
    assert pod.metadata.name.startswith("desktop-") and len(pod.metadata.name) == 13
    assert len(pod.metadata.uid) == 36 and pod.metadata.creation_timestamp is not None
    assert pod.metadata.resource_version == str(rv + 1) and pod.metadata.namespace == NS
    assert pod.status.phase == "Pending" and pod.status.qos_class == "BestEffort"
    assert pod.spec.restart_policy == "Always"
    assert pod.spec.containers[0].image_pull_policy == "IfNotPresent"
    assert core.read_namespaced_pod(pod.metadata.name, NS).metadata.uid == pod.metadata.uid
    other = core.create_namespaced_pod(NS, pod_body("fixed"))
    assert int(other.metadata.resource_version) == rv + 2 and other.metadata.uid != \
        pod.metadata.uid
    listed = core.list_namespaced_pod(NS)
    assert listed.metadata.resource_version == str(server.resource_version) == str(rv + 2)
    assert sorted(p.metadata.name for p in listed.items) == sorted([pod.metadata.name, "fixed"])
    assert core.list_namespaced_pod("elsewhere").items == []
    assert len(core.list_pod_for_all_namespaces().items) == 2


LABELLED = {"a": {"tier": "web"}, "b": {"tier": "web", "gpu": "yes", "rank": "3"},
            "c": {"tier": "db", "rank": "1"}, "d": {}}


@pytest.mark.parametrize(("selector", "expected"), [
    ("tier=web", {"a", "b"}),
    ("tier==web", {"a", "b"}),
    ("tier!=web", {"c", "d"}),
    ("tier in (web, db)", {"a", "b", "c"}),
    ("tier notin (web)", {"c", "d"}),
    ("gpu", {"b"}),
    ("!gpu", {"a", "c", "d"}),
    ("tier=web,gpu=yes", {"b"}),
    ("tier in (web,db),!gpu", {"a", "c"}),
    ("rank>2", {"b"}),
    ("rank<2", {"c"}),
])
def test_label_selectors(core: client.CoreV1Api, selector: str, expected: set[str]) -> None:
    for name, labels in LABELLED.items():
        core.create_namespaced_pod(NS, pod_body(name, labels))
    found = core.list_namespaced_pod(NS, label_selector=selector).items
    assert {p.metadata.name for p in found} == expected


def test_field_selectors_and_bad_selectors(core: client.CoreV1Api) -> None:
    for name in ("one", "two"):
        core.create_namespaced_pod(NS, pod_body(name))
    found = core.list_namespaced_pod(NS, field_selector="metadata.name=two").items
    assert [p.metadata.name for p in found] == ["two"]
    found = core.list_namespaced_pod(NS, field_selector="metadata.name!=two,status.phase=Pending")
    assert [p.metadata.name for p in found.items] == ["one"]
    error, body = api_error(lambda: core.list_namespaced_pod(NS, field_selector="spec.foo=x"))
    assert error.status == 400 and body["message"] == "field label not supported: spec.foo"
    error, body = api_error(lambda: core.list_namespaced_pod(NS, label_selector="a in (b"))
    assert error.status == 400 and body["reason"] == "BadRequest"


# ---------------------------------------------------------------- errors


def test_duplicate_name_is_409_already_exists(core: client.CoreV1Api) -> None:
    core.create_namespaced_pod(NS, pod_body("twin"))
    error, body = api_error(lambda: core.create_namespaced_pod(NS, pod_body("twin")))
    assert isinstance(error, client.exceptions.ConflictException) and error.status == 409
    assert body == {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
                    "message": 'pods "twin" already exists', "reason": "AlreadyExists",
                    "details": {"name": "twin", "kind": "pods"}, "code": 409}


def test_missing_object_is_404_not_found(core: client.CoreV1Api) -> None:
    for call in (lambda: core.read_namespaced_pod("ghost", NS),
                 lambda: core.delete_namespaced_pod("ghost", NS),
                 lambda: core.patch_namespaced_pod("ghost", NS, {"metadata": {}})):
        error, body = api_error(call)
        assert error.status == 404 and body["reason"] == "NotFound"
        assert body["message"] == 'pods "ghost" not found'


def test_invalid_objects_are_422(core: client.CoreV1Api) -> None:
    error, body = api_error(lambda: core.create_namespaced_pod(
        NS, {"metadata": {"name": "empty"}, "spec": {"containers": []}}))
    assert error.status == 422 and body["reason"] == "Invalid"
    assert body["message"] == 'Pod "empty" is invalid: spec.containers: Required value'
    assert body["details"]["causes"] == [{"reason": "FieldValueRequired",
                                          "message": "Required value", "field": "spec.containers"}]
    error, body = api_error(lambda: core.create_namespaced_pod(
        NS, pod_body("Bad_Name", {"task": "a b"})))
    assert error.status == 422 and body["message"].startswith('Pod "Bad_Name" is invalid: [')
    assert {c["field"] for c in body["details"]["causes"]} == {"metadata.name", "metadata.labels"}
    error, body = api_error(lambda: core.create_namespaced_service(
        NS, {"metadata": {"name": "1-desktop"}, "spec": {"ports": [{"port": 5000}]}}))
    assert error.status == 422 and "DNS-1035" in body["message"]


def test_a_request_without_the_token_is_401(server: KubeAPIServer) -> None:
    configuration = client.Configuration(host=server.url)
    with client.ApiClient(configuration) as api:
        error, body = api_error(lambda: client.CoreV1Api(api).list_namespaced_pod(NS))
    assert isinstance(error, client.exceptions.UnauthorizedException)
    assert body == {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
                    "message": "Unauthorized", "reason": "Unauthorized", "code": 401}


def test_pod_quota_answers_the_quota_403(tmp: Path) -> None:
    with make_server(pod_quota=2) as server, core_api(server, tmp) as api:
        core = client.CoreV1Api(api)
        core.create_namespaced_pod(NS, pod_body("p1"))
        core.create_namespaced_pod(NS, pod_body("p2"))
        error, body = api_error(lambda: core.create_namespaced_pod(NS, pod_body("p3")))
        assert isinstance(error, client.exceptions.ForbiddenException)
        assert body["message"] == ('pods "p3" is forbidden: exceeded quota: compute-resources, '
                                   "requested: pods=1, used: pods=2, limited: pods=2")
        server.update_pod_status(NS, "p1", {"phase": "Succeeded"})  # terminal pods are free
        core.create_namespaced_pod(NS, pod_body("p3"))


# ---------------------------------------------------------------- watch


def test_watch_from_a_resource_version_sends_only_later_events(core: client.CoreV1Api) -> None:
    core.create_namespaced_pod(NS, pod_body("old"))
    rv = core.list_namespaced_pod(NS).metadata.resource_version
    core.create_namespaced_pod(NS, pod_body("new"))
    core.patch_namespaced_pod("old", NS, {"metadata": {"annotations": {"seen": "yes"}}})
    core.delete_namespaced_pod("new", NS)
    events = events_of(core, resource_version=rv, timeout_seconds=1)
    assert [(e["type"], e["object"].metadata.name) for e in events] == [
        ("ADDED", "new"), ("MODIFIED", "old"), ("DELETED", "new")]
    versions = [int(e["object"].metadata.resource_version) for e in events]
    assert versions == sorted(versions) and versions[0] == int(rv) + 1


def test_watch_without_a_resource_version_lists_first_then_follows(
        core: client.CoreV1Api) -> None:
    core.create_namespaced_pod(NS, pod_body("existing", {"app": "desktop"}))
    watcher = Watcher(core.list_namespaced_pod, namespace=NS, label_selector="app=desktop",
                      timeout_seconds=5)
    try:
        first = watcher.next()
        assert (first["type"], first["object"].metadata.name) == ("ADDED", "existing")
        core.create_namespaced_pod(NS, pod_body("ignored", {"app": "other"}))
        core.create_namespaced_pod(NS, pod_body("later", {"app": "desktop"}))
        # Filtered watches see an object that stops matching as DELETED, one that starts as
        # ADDED, as the real watch cache sends them.
        core.patch_namespaced_pod("existing", NS, {"metadata": {"labels": {"app": "gone"}}})
        core.patch_namespaced_pod("ignored", NS, {"metadata": {"labels": {"app": "desktop"}}})
        seen = watcher.until(lambda e: e["object"].metadata.name == "ignored")
        assert [(e["type"], e["object"].metadata.name) for e in seen] == [
            ("ADDED", "later"), ("DELETED", "existing"), ("ADDED", "ignored")]
    finally:
        watcher.close()


def test_bookmarks_carry_the_current_resource_version(server: KubeAPIServer,
                                                      core: client.CoreV1Api) -> None:
    core.create_namespaced_pod(NS, pod_body("p"))
    rv = core.list_namespaced_pod(NS).metadata.resource_version
    core.create_namespaced_pod("other-namespace", pod_body("q"))  # a change it does not see
    stream = watch.Watch()
    events = list(stream.stream(core.list_namespaced_pod, namespace=NS, resource_version=rv,
                                allow_watch_bookmarks=True, timeout_seconds=1))
    assert len(events) >= 3 and {e["type"] for e in events} == {"BOOKMARK"}
    # The client does not deserialise a bookmark: its object stays a dict.
    assert events[-1]["object"] == {"kind": "Pod", "apiVersion": "v1",
                                    "metadata": {"resourceVersion": str(int(rv) + 1)}}
    assert stream.resource_version == str(server.resource_version)
    assert events_of(core, resource_version=rv, timeout_seconds=1) == []  # not asked: none


def test_a_compacted_resource_version_raises_410_from_the_watch(
        server: KubeAPIServer, core: client.CoreV1Api) -> None:
    core.create_namespaced_pod(NS, pod_body("p"))
    rv = core.list_namespaced_pod(NS).metadata.resource_version
    core.create_namespaced_pod(NS, pod_body("q"))
    assert server.compact() == server.resource_version
    with pytest.raises(client.ApiException) as caught:
        events_of(core, resource_version=rv, timeout_seconds=5)
    assert caught.value.status == 410
    assert caught.value.reason == f"Expired: too old resource version: {rv} ({int(rv) + 1})"
    assert caught.value.body is None  # a watch error comes as an event: no body
    # Without timeout_seconds the client retries once from the same version, then raises.
    watches = len([r for r in server.requests if r.query.get("watch") == "true"])
    with pytest.raises(client.ApiException) as caught:
        list(watch.Watch().stream(core.list_namespaced_pod, namespace=NS, resource_version=rv))
    assert caught.value.status == 410
    assert len([r for r in server.requests if r.query.get("watch") == "true"]) == watches + 2
    # From the list's resourceVersion after the compaction, a watch works.
    fresh = core.list_namespaced_pod(NS).metadata.resource_version
    assert events_of(core, resource_version=fresh, timeout_seconds=1) == []


def test_history_limit_expires_older_versions(tmp: Path) -> None:
    with make_server(history_limit=2) as server, core_api(server, tmp) as api:
        core = client.CoreV1Api(api)
        start = server.resource_version
        for name in ("a", "b", "c"):
            core.create_namespaced_pod(NS, pod_body(name))
        with pytest.raises(client.ApiException) as caught:
            events_of(core, resource_version=str(start), timeout_seconds=1)
        assert caught.value.status == 410
        events = events_of(core, resource_version=str(start + 1), timeout_seconds=1)
        assert [e["object"].metadata.name for e in events] == ["b", "c"]


def test_timeout_seconds_ends_the_stream(core: client.CoreV1Api) -> None:
    started = time.monotonic()
    assert events_of(core, timeout_seconds=1) == []
    assert 0.9 < time.monotonic() - started < 3


def test_a_live_watch_survives_compaction(server: KubeAPIServer,
                                          core: client.CoreV1Api) -> None:
    watcher = Watcher(core.list_namespaced_pod, namespace=NS, timeout_seconds=5)
    try:
        time.sleep(0.2)
        core.create_namespaced_pod(NS, pod_body("p"))
        server.compact()
        assert watcher.next()["object"].metadata.name == "p"
    finally:
        watcher.close()


# ---------------------------------------------------------------- faults


def test_fail_answers_the_given_status(server: KubeAPIServer, core: client.CoreV1Api) -> None:
    quota = ("exceeded quota: compute-resources, requested: pods=1, used: pods=4, "
             "limited: pods=4")
    server.fail("create", "pods", 403, "Forbidden", quota)
    error, body = api_error(lambda: core.create_namespaced_pod(NS, pod_body("p")))
    assert isinstance(error, client.exceptions.ForbiddenException)
    assert body["message"] == quota and body["reason"] == "Forbidden" and body["code"] == 403
    assert core.create_namespaced_pod(NS, pod_body("p")).metadata.name == "p"  # once only
    assert server.pods(NS)[0]["metadata"]["name"] == "p"

    server.fail("get", "pods", 500, "InternalError", "etcdserver: request timed out", times=2,
                name="p")
    for _ in range(2):
        error, body = api_error(lambda: core.read_namespaced_pod("p", NS))
        assert error.status == 500 and body["message"] == "etcdserver: request timed out"
    core.read_namespaced_pod("p", NS)

    server.fail("watch", "pods", 429, "TooManyRequests", "slow down")
    error, body = api_error(lambda: events_of(core, timeout_seconds=1))
    assert error.status == 429 and body["message"] == "slow down"
    server.fail("watch", "pods", 410, "Expired", "too old resource version: 1 (2)")
    with pytest.raises(client.ApiException) as caught:
        events_of(core, timeout_seconds=1)
    assert caught.value.status == 410 and caught.value.reason.startswith("Expired: too old")


def test_api_down_refuses_and_breaks_watches_and_api_up_restores(
        server: KubeAPIServer, core: client.CoreV1Api) -> None:
    core.create_namespaced_pod(NS, pod_body("p"))
    watcher = Watcher(core.list_namespaced_pod, namespace=NS)
    assert watcher.next()["type"] == "ADDED"
    rv = watcher.watch.resource_version
    server.api_down()
    broken = watcher.next()  # the open stream breaks, as when the API server goes away
    assert isinstance(broken, urllib3.exceptions.ProtocolError), broken
    assert watcher.next() is None
    with pytest.raises(urllib3.exceptions.MaxRetryError) as caught:
        core.list_namespaced_pod(NS)
    assert isinstance(caught.value.reason, urllib3.exceptions.NewConnectionError)
    server.set_pod_phase_running(NS, "p", "10.244.0.9")  # the cluster goes on meanwhile
    server.api_up()
    assert core.read_namespaced_pod("p", NS).status.phase == "Running"
    events = events_of(core, resource_version=rv, timeout_seconds=1)
    assert [(e["type"], e["object"].status.pod_ip) for e in events] == [
        ("MODIFIED", "10.244.0.9")]


# ---------------------------------------------------------------- kubelet and status


def test_the_kubelet_hook_runs_pods_and_readiness_comes_from_the_watch(
        tmp: Path) -> None:
    kubelet = RecordingKubelet(start=True)
    with make_server(kubelet=kubelet) as server, core_api(server, tmp) as api:
        core = client.CoreV1Api(api)
        watcher = Watcher(core.list_namespaced_pod, namespace=NS, timeout_seconds=5)
        try:
            pod = core.create_namespaced_pod(NS, pod_body())
            name = pod.metadata.name
            assert [p["metadata"]["name"] for p in kubelet.created] == [name]
            seen = watcher.until(lambda e: e["object"].status.phase == "Running")
            ready = seen[-1]["object"]
            assert ready.status.pod_ip == "10.244.0.7" and ready.spec.node_name == "node-1"
            assert {c.type: c.status for c in ready.status.conditions} == {
                "PodReadyToStartContainers": "True", "Initialized": "True", "Ready": "True",
                "ContainersReady": "True", "PodScheduled": "True"}
            assert ready.status.container_statuses[0].ready
            assert ready.status.container_statuses[0].state.running.started_at is not None
        finally:
            watcher.close()
        pod_gets = [r for r in server.requests
                    if r.method == "GET" and r.path == f"/api/v1/namespaces/{NS}/pods/{name}"]
        assert pod_gets == []  # readiness came from the watch, not from polling
        core.delete_namespaced_pod(name, NS)
        assert [p["metadata"]["name"] for p in kubelet.deleted] == [name]
        assert server.pods(NS) == [] and server.kubelet_errors == []
        kubelet.threads[0].join(5)


@pytest.mark.parametrize("scenario", ["unschedulable", "image", "evicted", "oom", "running"])
def test_status_helpers_make_real_looking_pods(server: KubeAPIServer, core: client.CoreV1Api,
                                               scenario: str) -> None:
    core.create_namespaced_pod(NS, pod_body("p"))
    pod = server.pod(NS, "p")
    assert pod is not None
    if scenario == "running":
        server.set_pod_phase_running(NS, "p", "10.244.1.2", ready=False)
    else:
        status = {"unschedulable": lambda: unschedulable_status(),
                  "image": lambda: image_pull_backoff_status(pod),
                  "evicted": lambda: evicted_status(),
                  "oom": lambda: oom_killed_status(pod, restart_count=2)}[scenario]()
        server.update_pod_status(NS, "p", status)
    raw = server.pod(NS, "p")
    offline = client.ApiClient().deserialize(json.dumps(raw), "V1Pod", "application/json")
    for read in (core.read_namespaced_pod("p", NS), offline):
        assert isinstance(read, client.V1Pod)
        status = read.status
        if scenario == "unschedulable":
            assert status.phase == "Pending"
            condition = status.conditions[0]
            assert (condition.type, condition.status, condition.reason) == (
                "PodScheduled", "False", "Unschedulable")
            assert condition.message == "0/3 nodes are available: 3 Insufficient memory."
        elif scenario == "image":
            waiting = status.container_statuses[0].state.waiting
            assert waiting.reason == "ImagePullBackOff"
            assert waiting.message == 'Back-off pulling image "desktop:1"'
        elif scenario == "evicted":
            assert (status.phase, status.reason) == ("Failed", "Evicted")
            assert status.message == "The node was low on resource: memory."
        elif scenario == "oom":
            container = status.container_statuses[0]
            assert container.state.terminated.reason == "OOMKilled"
            assert container.last_state.terminated.reason == "OOMKilled"
            assert container.state.terminated.exit_code == 137 and container.restart_count == 2
        else:
            assert (status.phase, status.pod_ip) == ("Running", "10.244.1.2")
            assert {c.type: c.status for c in status.conditions}["Ready"] == "False"
            assert not status.container_statuses[0].ready
        assert status.qos_class == "BestEffort"  # merged into, not replacing, the status


def test_events_list_and_watch_by_involved_object(server: KubeAPIServer,
                                                  core: client.CoreV1Api) -> None:
    core.create_namespaced_pod(NS, pod_body("p"))
    core.create_namespaced_pod(NS, pod_body("q"))
    server.add_event(NS, "q", "Pulled", "pulled", type="Normal")
    rv = core.list_namespaced_event(NS).metadata.resource_version
    watcher = Watcher(core.list_namespaced_event, namespace=NS, resource_version=rv,
                      field_selector="involvedObject.name=p,involvedObject.kind=Pod",
                      timeout_seconds=5)
    try:
        server.add_event(NS, "q", "Started", "started", type="Normal")
        server.add_event(NS, "p", "FailedScheduling",
                         "0/3 nodes are available: 3 Insufficient memory.")
        event = watcher.next()["object"]
        assert isinstance(event, client.CoreV1Event)
        assert (event.reason, event.type, event.source.component) == (
            "FailedScheduling", "Warning", "default-scheduler")
        assert event.involved_object.uid == server.pod(NS, "p")["metadata"]["uid"]
    finally:
        watcher.close()
    listed = core.list_namespaced_event(NS, field_selector="involvedObject.name=q").items
    assert {e.reason for e in listed} == {"Pulled", "Started"}


def test_services_create_list_delete_and_follow_their_owner(
        server: KubeAPIServer, core: client.CoreV1Api) -> None:
    pod = core.create_namespaced_pod(NS, pod_body("p"))
    owner = {"apiVersion": "v1", "kind": "Pod", "name": "p", "uid": pod.metadata.uid}
    body = {"metadata": {"name": "p-vnc", "labels": {"desktop": "p"},
                         "ownerReferences": [owner]},
            "spec": {"selector": {"desktop": "p"}, "ports": [{"name": "vnc", "port": 5900}]}}
    service = core.create_namespaced_service(NS, body)
    assert service.spec.cluster_ip.startswith("10.96.") and service.spec.type == "ClusterIP"
    assert service.spec.ports[0].target_port == 5900 and service.spec.ports[0].protocol == "TCP"
    assert api_error(lambda: core.create_namespaced_service(NS, body))[0].status == 409
    node_port = core.create_namespaced_service(NS, {
        "metadata": {"name": "p-ui"}, "spec": {"type": "NodePort", "ports": [{"port": 80}]}})
    assert node_port.spec.ports[0].node_port >= 30000
    listed = core.list_namespaced_service(NS, label_selector="desktop=p").items
    assert [s.metadata.name for s in listed] == ["p-vnc"]
    assert core.read_namespaced_service("p-vnc", NS).spec.cluster_ip == service.spec.cluster_ip
    core.delete_namespaced_service("p-ui", NS)
    assert api_error(lambda: core.read_namespaced_service("p-ui", NS))[0].status == 404
    core.delete_namespaced_pod("p", NS)  # the garbage collector takes its dependents
    assert core.list_namespaced_service(NS).items == [] and server.services() == []


# ---------------------------------------------------------------- delete and patch


def test_deletion_delay_keeps_a_terminating_pod_first(tmp: Path) -> None:
    kubelet = RecordingKubelet()
    with make_server(kubelet=kubelet, deletion_delay_s=0.5) as server, \
            core_api(server, tmp) as api:
        core = client.CoreV1Api(api)
        core.create_namespaced_pod(NS, pod_body("slow"))
        rv = core.list_namespaced_pod(NS).metadata.resource_version
        deleted = core.delete_namespaced_pod("slow", NS)
        assert deleted.metadata.deletion_timestamp is not None
        assert deleted.metadata.deletion_grace_period_seconds == 30
        assert core.read_namespaced_pod("slow", NS).metadata.deletion_timestamp is not None
        core.delete_namespaced_pod("slow", NS)  # again: still terminating, no second hook
        assert len(kubelet.deleted) == 1
        assert kubelet.deleted[0]["metadata"]["deletionTimestamp"]
        events = events_of(core, resource_version=rv, timeout_seconds=1)
        assert [e["type"] for e in events] == ["MODIFIED", "DELETED"]
        assert api_error(lambda: core.read_namespaced_pod("slow", NS))[0].status == 404
        core.create_namespaced_pod(NS, pod_body("fast"))
        core.delete_namespaced_pod("fast", NS, grace_period_seconds=0)  # at once
        assert api_error(lambda: core.read_namespaced_pod("fast", NS))[0].status == 404
        assert server.emulator.objects["v1/pods", NS, "slow"].deleted  # kmock's history


def test_delete_options_in_the_body(server: KubeAPIServer, core: client.CoreV1Api) -> None:
    pod = core.create_namespaced_pod(NS, pod_body("p"))
    stale = client.V1DeleteOptions(preconditions=client.V1Preconditions(uid="another"))
    error, body = api_error(lambda: core.delete_namespaced_pod("p", NS, body=stale))
    assert error.status == 409 and body["message"].startswith("Precondition failed: UID")
    options = client.V1DeleteOptions(grace_period_seconds=0, propagation_policy="Foreground",
                                     preconditions=client.V1Preconditions(uid=pod.metadata.uid))
    gone = core.delete_namespaced_pod("p", NS, body=options)
    assert gone.metadata.name == "p" and server.pods() == []
    core.create_namespaced_pod(NS, pod_body("a", {"batch": "1"}))
    core.create_namespaced_pod(NS, pod_body("b", {"batch": "2"}))
    core.delete_collection_namespaced_pod(NS, label_selector="batch=1")
    assert [p["metadata"]["name"] for p in server.pods(NS)] == ["b"]


def test_patches_merge_metadata_and_keep_the_rest(server: KubeAPIServer,
                                                  core: client.CoreV1Api) -> None:
    pod = core.create_namespaced_pod(NS, pod_body("p", {"a": "1"}))
    patched = core.patch_namespaced_pod("p", NS, {  # strategic merge, the client's default
        "metadata": {"labels": {"b": "2"}, "annotations": {"note": "x"}, "uid": "forged"},
        "status": {"phase": "Running"}})
    assert patched.metadata.labels == {"a": "1", "b": "2"}
    assert patched.metadata.annotations == {"note": "x"}
    assert patched.metadata.uid == pod.metadata.uid and patched.status.phase == "Pending"
    assert int(patched.metadata.resource_version) == int(pod.metadata.resource_version) + 1
    merged = core.patch_namespaced_pod("p", NS, {"metadata": {"labels": {"a": None}}},
                                       _content_type="application/merge-patch+json")
    assert merged.metadata.labels == {"b": "2"}
    same = core.patch_namespaced_pod("p", NS, {"metadata": {"labels": {"b": "2"}}})
    assert same.metadata.resource_version == merged.metadata.resource_version  # a no-op
    json_patched = core.patch_namespaced_pod(
        "p", NS, [{"op": "add", "path": "/metadata/annotations/extra", "value": "y"}])
    assert json_patched.metadata.annotations == {"note": "x", "extra": "y"}
    error, body = api_error(lambda: core.patch_namespaced_pod(
        "p", NS, {"metadata": {"resourceVersion": pod.metadata.resource_version}}))
    assert error.status == 409 and body["reason"] == "Conflict"
    status = core.patch_namespaced_pod_status("p", NS, {"status": {"phase": "Running"}})
    assert status.status.phase == "Running" and status.metadata.labels == {"b": "2"}


# ---------------------------------------------------------------- the server itself


def test_requests_log_and_kmock_reactions(server: KubeAPIServer,
                                          core: client.CoreV1Api) -> None:
    core.create_namespaced_pod(NS, pod_body("p"))
    for _ in range(3):
        core.read_namespaced_pod("p", NS)
    core.list_namespaced_pod(NS, label_selector="a=b")
    gets = [r for r in server.requests
            if (r.method, r.path) == ("GET", f"/api/v1/namespaces/{NS}/pods/p")]
    assert len(gets) == 3
    assert server.requests[-1].query == {"labelSelector": "a=b"}
    # kmock's DSL on the emulator takes precedence over the emulation.
    assert client.VersionApi(core.api_client).get_code().major == "1"
    version = client.VersionApi(core.api_client).get_code().to_dict()
    server.emulator["get /version/"] << {**version, "minor": "33", "gitVersion": "v1.33.1"}
    assert client.VersionApi(core.api_client).get_code().git_version == "v1.33.1"


def test_stop_leaves_no_thread_and_no_listener(tmp: Path) -> None:
    before = set(threading.enumerate())
    server = make_server()
    with server, core_api(server, tmp) as api:
        core = client.CoreV1Api(api)
        core.create_namespaced_pod(NS, pod_body("p"))
        watcher = Watcher(core.list_namespaced_pod, namespace=NS)
        assert watcher.next()["type"] == "ADDED"
    # The server ended the stream; a Watch without timeout_seconds then reconnects by itself
    # from the last resourceVersion, and finds nobody listening.
    assert isinstance(watcher.next(), urllib3.exceptions.MaxRetryError)
    watcher.thread.join(5)
    assert set(threading.enumerate()) == before
    configuration = client.Configuration(host=server.url)
    configuration.retries = 0
    with client.ApiClient(configuration) as api, pytest.raises(urllib3.exceptions.HTTPError):
        client.CoreV1Api(api).list_namespaced_pod(NS)
