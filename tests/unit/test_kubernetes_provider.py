"""The Kubernetes provider's pure parts: the pod it asks for (template + config), how it
reads a pod's status (ready, or what is wrong, fatal or not), and its config errors."""

from __future__ import annotations

import json

import pytest
import yaml

from cua_rollout.config import DesktopsConfig
from cua_rollout.core.errors import ConfigError
from cua_rollout.envs.providers.kubernetes import (
    HEARTBEAT_ANNOTATION,
    PROCESS_ANNOTATION,
    KubernetesProvider,
    load_pod_template,
    pod_problem,
    pod_ready,
)

TEMPLATE = {
    "apiVersion": "v1", "kind": "Pod",
    "metadata": {"labels": {"team": "agents"}, "annotations": {"note": "x"}},
    "spec": {
        "serviceAccountName": "cua-desktop",
        "securityContext": {"runAsNonRoot": True},
        "nodeSelector": {"disk": "ssd"},
        "containers": [
            {"name": "sidecar", "image": "busybox"},
            {"name": "desktop", "image": "reg/desk:1",
             "env": [{"name": "EXTRA", "value": "1"}, {"name": "SCREEN_WIDTH", "value": "9"}],
             "volumeMounts": [{"name": "shm", "mountPath": "/dev/shm"}]},
        ],
        "volumes": [{"name": "shm", "emptyDir": {"medium": "Memory"}}],
    },
}


def _cfg(tmp_path, **k8s) -> DesktopsConfig:
    template = tmp_path / "pod.yaml"
    template.write_text(yaml.safe_dump(TEMPLATE))
    base = {"pod_template": str(template), "token_secret": "desk-token",
            "namespace": "rollout"}
    base.update(k8s)
    return DesktopsConfig(provider="kubernetes", screen_width=1280, screen_height=720,
                          token_env="DESK_TOKEN", kubernetes=base)


def test_the_pod_is_the_template_with_what_the_config_sets(tmp_path):
    cfg = _cfg(tmp_path, image="reg/desk:2", cpu="2", memory="3Gi",
               node_selector={"pool": "desktops"}, labels={"net": "rollout"},
               tolerations=[{"key": "gpu", "operator": "Exists"}],
               image_pull_secrets=["regcred"])
    provider = KubernetesProvider(cfg)
    pod = provider.pod_manifest("cua-r1-0-ab12", 0)
    meta, spec = pod["metadata"], pod["spec"]
    assert meta["name"] == "cua-r1-0-ab12" and meta["namespace"] == "rollout"
    assert meta["labels"]["team"] == "agents" and meta["labels"]["net"] == "rollout"
    assert meta["labels"]["cua.run"] == provider.run and meta["labels"]["cua.desktop"] == \
        "cua-r1-0-ab12"
    assert meta["labels"]["app.kubernetes.io/component"] == "desktop"
    assert meta["annotations"]["note"] == "x"
    assert float(meta["annotations"][HEARTBEAT_ANNOTATION]) > 0
    assert meta["annotations"][PROCESS_ANNOTATION] == provider.process
    assert spec["restartPolicy"] == "Never"
    assert spec["nodeSelector"] == {"disk": "ssd", "pool": "desktops"}
    assert spec["tolerations"] == [{"key": "gpu", "operator": "Exists"}]
    assert spec["imagePullSecrets"] == [{"name": "regcred"}]
    assert spec["volumes"] == TEMPLATE["spec"]["volumes"]
    sidecar, box = spec["containers"]
    assert sidecar == {"name": "sidecar", "image": "busybox"}  # untouched
    assert box["image"] == "reg/desk:2"
    assert box["resources"] == {"requests": {"cpu": "2", "memory": "3Gi"},
                                "limits": {"cpu": "2", "memory": "3Gi"}}
    assert box["ports"] == [{"name": "desktop", "containerPort": 5000, "protocol": "TCP"}]
    env = {e["name"]: e for e in box["env"]}
    assert env["EXTRA"]["value"] == "1" and env["SCREEN_WIDTH"]["value"] == "1280"
    assert env["CUA_DESKTOP_TOKEN"]["valueFrom"] == {
        "secretKeyRef": {"name": "desk-token", "key": "token"}}
    assert box["readinessProbe"]["exec"]["command"][-2:] == [
        "-m", "cua_rollout.desktop.healthcheck"]
    assert TEMPLATE["spec"]["containers"][1]["image"] == "reg/desk:1"  # template not changed
    # The manifest is a valid V1Pod for the official client.
    from kubernetes.client import ApiClient

    parsed = ApiClient().deserialize(json.dumps(pod), "V1Pod", "application/json")
    assert parsed.spec.containers[1].env[-1].value_from.secret_key_ref.name == "desk-token"


def test_labels_are_valid_label_values(tmp_path):
    import re

    provider = KubernetesProvider(_cfg(tmp_path))
    labels = provider.pod_manifest("cua-x-0-aaaa", 0)["metadata"]["labels"]
    for value in labels.values():
        assert re.fullmatch(r"[A-Za-z0-9]([A-Za-z0-9_.-]{0,61}[A-Za-z0-9])?", value), value


def _pod(phase="Pending", conditions=(), statuses=(), deleting=False, **status):
    meta = {"name": "p"}
    if deleting:
        meta["deletionTimestamp"] = "2026-11-23T00:00:00Z"
    return {"metadata": meta, "status": {"phase": phase, "conditions": list(conditions),
                                         "containerStatuses": list(statuses), **status}}


READY = [{"type": "Ready", "status": "True"}]


def test_ready_needs_running_ready_and_an_ip():
    assert pod_ready(_pod("Running", READY, podIP="10.1.2.3"))
    assert not pod_ready(_pod("Running", READY))
    assert not pod_ready(_pod("Running", [{"type": "Ready", "status": "False"}],
                              podIP="10.1.2.3"))
    assert not pod_ready(_pod("Running", READY, podIP="10.1.2.3", deleting=True))
    assert not pod_ready(_pod("Pending", READY, podIP="10.1.2.3"))


@pytest.mark.parametrize(("pod", "words", "fatal"), [
    (_pod(conditions=[{"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
                       "message": "0/3 nodes are available: 3 Insufficient memory."}]),
     "Unschedulable: 0/3 nodes are available: 3 Insufficient memory.", False),
    (_pod(statuses=[{"image": "reg/desk:9", "state": {"waiting": {
        "reason": "ImagePullBackOff", "message": "Back-off pulling image \"reg/desk:9\""}}}]),
     "ImagePullBackOff (reg/desk:9): Back-off pulling image", True),
    (_pod("Failed", reason="Evicted", message="The node was low on resource: memory."),
     "Evicted: The node was low on resource: memory.", True),
    (_pod("Running", statuses=[{"state": {"terminated": {"reason": "OOMKilled",
                                                          "exitCode": 137}}}]),
     "its container ended: OOMKilled (exit code 137)", True),
    (_pod("Running", READY, deleting=True), "being deleted", True),
])
def test_what_keeps_a_pod_from_serving_is_named(pod, words, fatal):
    problem = pod_problem(pod)
    assert problem is not None and words in problem[0] and problem[1] is fatal, problem


def test_a_pending_pod_without_trouble_has_no_problem():
    assert pod_problem(_pod()) is None
    assert pod_problem(_pod("Running", READY, podIP="10.0.0.1")) is None


def test_template_and_config_errors_name_the_key(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("kind: Deployment\nspec: {}\n")
    with pytest.raises(ConfigError, match=r"pod_template .*kind is 'Deployment'"):
        load_pod_template(bad)
    bad.write_text("kind: Pod\nspec: {containers: []}\n")
    with pytest.raises(ConfigError, match=r"pod_template .*spec\.containers"):
        load_pod_template(bad)
    with pytest.raises(ConfigError, match="cannot read it"):
        load_pod_template(tmp_path / "absent.yaml")
    template = tmp_path / "t.yaml"
    template.write_text(yaml.safe_dump({"kind": "PodTemplate", "template": TEMPLATE}))
    assert load_pod_template(template)["spec"]["containers"][1]["name"] == "desktop"
    with pytest.raises(ValueError, match=r"desktops\.kubernetes\.image"):
        DesktopsConfig(provider="kubernetes")
    with pytest.raises(ValueError, match=r"token_secret .*token_env"):
        DesktopsConfig(provider="kubernetes", kubernetes={"image": "x"}, token_env="T")
    with pytest.raises(ValueError, match=r"heartbeat_timeout_s"):
        DesktopsConfig(provider="kubernetes", kubernetes={
            "image": "x", "heartbeat_interval_s": 30, "heartbeat_timeout_s": 40})
    bare = tmp_path / "bare.yaml"
    bare.write_text(yaml.safe_dump({"kind": "Pod", "spec": {"containers": [{"name": "d"}]}}))
    with pytest.raises(ConfigError, match="names no image"):
        KubernetesProvider(DesktopsConfig(provider="kubernetes",
                                          kubernetes={"pod_template": str(bare)}))


def test_a_vm_pod_keeps_its_launcher_probe_ports_and_kvm_device(tmp_path):
    """``reset: vm`` with deploy/kubernetes/vm-desktop-pod.yaml: the config sets CPU, memory,
    the server's port and the token over the template, and keeps what the VM launcher needs:
    its command and args, the kvm device resource, the DevTools and VLC ports, the readiness
    probe on the gate's own path, the downward-API pod IP."""
    from tests.support import REPO_ROOT

    template = REPO_ROOT / "deploy" / "kubernetes" / "vm-desktop-pod.yaml"
    cfg = DesktopsConfig(provider="kubernetes", token_env="DESK_TOKEN", kubernetes={
        "pod_template": str(template), "token_secret": "desk-token", "reset": "vm",
        "image": "reg/launcher:1", "cpu": "2", "memory": "6Gi"})
    pod = KubernetesProvider(cfg).pod_manifest("cua-r1-0-ab12", 0)
    box = pod["spec"]["containers"][0]
    assert box["image"] == "reg/launcher:1"
    assert box["command"][-2:] == ["-m", "cua_rollout.vm"] and "--gate=$(POD_IP)" in box["args"]
    assert box["resources"]["limits"] == {"cpu": "2", "memory": "6Gi",
                                          "devices.kubevirt.io/kvm": "1"}
    assert box["resources"]["requests"] == {"cpu": "2", "memory": "6Gi"}
    assert sorted(p["containerPort"] for p in box["ports"]) == [5000, 8080, 9222]
    assert box["readinessProbe"]["httpGet"]["path"] == "/vm/ready"
    env = {e["name"]: e for e in box["env"]}
    assert env["POD_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    assert env["CUA_DESKTOP_TOKEN"]["valueFrom"]["secretKeyRef"]["name"] == "desk-token"
