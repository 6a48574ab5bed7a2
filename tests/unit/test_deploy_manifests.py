"""deploy/kubernetes/, checked without a cluster: every YAML document of a built-in kind
deserializes into the official client's model with no key dropped on the way (a typo such as
``contianers`` fails with its path), the KubeRay resources have the structure KubeRay reads and
pod templates that deserialize the same way, and the pieces agree with each other: the run
config loads with ``config.load_config``, the desktop pod template, the NetworkPolicies'
selectors, the Role, the model pool's replicas and the run's endpoints, the kustomization.

The client's ``ApiClient().deserialize`` takes the JSON text (kubernetes >= 37, pydantic
models) or a response object whose ``.data`` is that text (older ones). Either keeps only the
keys its model knows, so each document is serialized back (``sanitize_for_serialization``) and
compared with the original: a key of the original (with a non-None value) that does not come
back, or a value that comes back changed, is a failure naming file, document index and key
path.
"""

from __future__ import annotations

import importlib.util
import inspect
import json
import re
from pathlib import Path, PurePosixPath
from types import SimpleNamespace
from typing import Any, Union, get_args, get_origin

import kubernetes.client
import pytest
import yaml
from kubernetes.client import ApiClient
from pydantic import BaseModel

from cua_rollout.config import Config, load_config, status_bind
from cua_rollout.core.http import reachable_host
from cua_rollout.model.fleet.launch import RequestShape
from cua_rollout.model.fleet.processes import API_SERVER_MODULE
from tests.support import REPO_ROOT

DEPLOY = REPO_ROOT / "deploy" / "kubernetes"
CONTAINERFILE = REPO_ROOT / "deploy" / "desktop-image" / "Containerfile"
NAMESPACE = "cua-rollout"
PART_OF = "app.kubernetes.io/part-of"
COMPONENT = "app.kubernetes.io/component"
# Applied on their own, not by `kubectl apply -k`.
OUTSIDE_KUSTOMIZATION = {"secrets.example.yaml", "rayjob.yaml"}
EXPECTED_FILES = {"namespace.yaml", "rbac.yaml", "secrets.example.yaml", "networkpolicy.yaml",
                  "desktop-pod.yaml", "volumes.yaml", "model-pool.yaml", "run-config.yaml",
                  "raycluster.yaml", "rayjob.yaml", "kustomization.yaml",
                  "vm-desktop-pod.yaml"}
DESKTOP_POD = "cua-desktop-template"      # desktop-pod.yaml's Pod
VM_DESKTOP_POD = "cua-vm-desktop-template"  # vm-desktop-pod.yaml's Pod

# (apiVersion, kind) -> the client's model.
MODELS = {
    ("v1", "Namespace"): "V1Namespace",
    ("v1", "ServiceAccount"): "V1ServiceAccount",
    ("v1", "Secret"): "V1Secret",
    ("v1", "ConfigMap"): "V1ConfigMap",
    ("v1", "Pod"): "V1Pod",
    ("v1", "Service"): "V1Service",
    ("v1", "PersistentVolumeClaim"): "V1PersistentVolumeClaim",
    ("rbac.authorization.k8s.io/v1", "Role"): "V1Role",
    ("rbac.authorization.k8s.io/v1", "RoleBinding"): "V1RoleBinding",
    ("networking.k8s.io/v1", "NetworkPolicy"): "V1NetworkPolicy",
    ("apps/v1", "StatefulSet"): "V1StatefulSet",
    ("apps/v1", "Deployment"): "V1Deployment",
}
RAY_API = "ray.io/v1"
KUSTOMIZE_API = "kustomize.config.k8s.io/v1beta1"

# The fields of KubeRay's ray.io/v1 types (ray-operator/apis/ray/v1, KubeRay 1.1 - 1.4):
# anything else is a typo the API server would drop or refuse.
RAYCLUSTER_SPEC_KEYS = {"headGroupSpec", "workerGroupSpecs", "rayVersion",
                        "enableInTreeAutoscaling", "autoscalerOptions", "headServiceAnnotations",
                        "suspend", "managedBy", "gcsFaultToleranceOptions", "upgradeStrategy",
                        "authOptions"}
HEAD_GROUP_KEYS = {"rayStartParams", "template", "serviceType", "headService", "enableIngress"}
WORKER_GROUP_KEYS = {"groupName", "replicas", "minReplicas", "maxReplicas", "idleTimeoutSeconds",
                     "numOfHosts", "rayStartParams", "template", "scaleStrategy", "suspend"}
RAYJOB_SPEC_KEYS = {"entrypoint", "rayClusterSpec", "clusterSelector", "submissionMode",
                    "shutdownAfterJobFinishes", "ttlSecondsAfterFinished", "runtimeEnvYAML",
                    "jobId", "metadata", "entrypointNumCpus", "entrypointNumGpus",
                    "entrypointResources", "submitterPodTemplate", "submitterConfig",
                    "activeDeadlineSeconds", "backoffLimit", "suspend", "managedBy",
                    "deletionStrategy", "deletionPolicy", "submitterFinishedTimeoutSeconds"}
SUBMISSION_MODES = {"K8sJobMode", "HTTPMode", "InteractiveMode", "SidecarMode"}

# What the Kubernetes desktop provider may do, and nothing more.
ROLE_VERBS = {
    "pods": {"get", "list", "watch", "create", "delete", "patch"},
    "pods/log": {"get"},
    "services": {"get", "list", "create", "delete"},
    "events": {"get", "list", "watch"},
}

API = ApiClient()


# --------------------------------------------------------------------------- loading


def _documents() -> tuple[list[tuple[str, int, dict[str, Any]]], list[str]]:
    """(file, index, document) of every YAML document here; and the files that do not parse."""
    out, errors = [], []
    for path in sorted(DEPLOY.glob("*.yaml")):
        try:
            docs = list(yaml.safe_load_all(path.read_text(encoding="utf-8")))
        except yaml.YAMLError as exc:
            errors.append(f"{path.name}: not valid YAML: {exc}")
            continue
        out += [(path.name, index, doc) for index, doc in enumerate(docs) if doc is not None]
    return out, errors


DOCS, YAML_ERRORS = _documents()


def _where(file: str, index: int, doc: dict[str, Any]) -> str:
    name = (doc.get("metadata") or {}).get("name", "?")
    return f"{file} document {index} ({doc.get('kind')} {name})"


def _find(kind: str, name: str | None = None) -> tuple[str, int, dict[str, Any]]:
    """The one document of ``kind`` (and ``name``)."""
    found = [(f, i, d) for f, i, d in DOCS if d.get("kind") == kind
             and (name is None or (d.get("metadata") or {}).get("name") == name)]
    assert len(found) == 1, f"expected one {kind} {name or ''} under {DEPLOY}, found " \
        f"{[f'{f} document {i}' for f, i, _ in found]}"
    return found[0]


def _doc(kind: str, name: str | None = None) -> dict[str, Any]:
    return _find(kind, name)[2]


def _run_config(tmp_path: Path) -> Config:
    configmap = _doc("ConfigMap", "cua-run-config")
    path = tmp_path / "run.yaml"
    path.write_text(configmap["data"]["run.yaml"], encoding="utf-8")
    return load_config(path)


# --------------------------------------------------------------------------- the round trip


def _wire_fields(cls: type) -> dict[str, Any]:
    """A model's fields by their names on the wire (``from``, ``imagePullPolicy`` ...), each
    with its type: an annotation (pydantic models, kubernetes >= 37) or the type's name as the
    older generated models spell it (``list[V1Container]``, ``dict(str, str)``)."""
    if isinstance(cls, type) and issubclass(cls, BaseModel):
        return {f.serialization_alias or name: f.annotation
                for name, f in cls.model_fields.items()}
    return {cls.attribute_map[name]: kind for name, kind in cls.openapi_types.items()}


def _model_class(kind: Any) -> type | None:
    if isinstance(kind, str):
        return getattr(kubernetes.client, kind, None)
    if isinstance(kind, type) and (issubclass(kind, BaseModel) or hasattr(kind, "openapi_types")):
        return kind
    return None


def unknown_keys(data: Any, kind: Any, path: str) -> list[str]:
    """The key paths of ``data`` that the type ``kind`` (a model, or a list, dict, Optional or
    Annotated of one) does not have: what names a typo when the model refuses the document
    outright (a misspelt required field)."""
    cls = _model_class(kind)
    if cls is not None:
        if not isinstance(data, dict):
            return []
        fields = _wire_fields(cls)
        out = []
        for key, value in data.items():
            where = f"{path}.{key}" if path else key
            if key not in fields:
                out.append(where)
            else:
                out += unknown_keys(value, fields[key], where)
        return out
    if isinstance(kind, str):  # the older models' names of list and dict types
        if (found := re.fullmatch(r"list\[(.+)\]", kind)) and isinstance(data, list):
            return [k for i, item in enumerate(data)
                    for k in unknown_keys(item, found[1], f"{path}[{i}]")]
        if (found := re.fullmatch(r"dict\(str, (.+)\)", kind)) and isinstance(data, dict):
            return [k for key, item in data.items()
                    for k in unknown_keys(item, found[1], f"{path}.{key}")]
        return []
    origin, args = get_origin(kind), get_args(kind)
    if origin is list and isinstance(data, list):
        return [k for i, item in enumerate(data) for k in unknown_keys(item, args[0],
                                                                       f"{path}[{i}]")]
    if origin is dict and isinstance(data, dict):
        return [k for key, item in data.items() for k in unknown_keys(item, args[1],
                                                                      f"{path}.{key}")]
    if origin is Union or args:  # Optional[...], Union[...], Annotated[...]
        for arg in args:
            if found := unknown_keys(data, arg, path):
                return found
    return []


def differences(original: Any, back: Any, path: str) -> list[str]:
    """Where ``back`` (the serialized model) lost or changed what ``original`` had. Keys whose
    original value is None are skipped: serialization leaves None out."""
    if isinstance(original, dict):
        if not isinstance(back, dict):
            return [f"{path or '<top>'}: a mapping came back as {back!r:.80}"]
        out = []
        for key, value in original.items():
            where = f"{path}.{key}" if path else str(key)
            if value is None:
                continue
            if key not in back:
                out.append(f"{where}: unknown key (dropped by the model)")
            else:
                out += differences(value, back[key], where)
        return out
    if isinstance(original, list):
        if not isinstance(back, list) or len(back) != len(original):
            return [f"{path}: a list of {len(original)} came back as {back!r:.80}"]
        return [d for i, (a, b) in enumerate(zip(original, back, strict=True))
                for d in differences(a, b, f"{path}[{i}]")]
    if type(original) is not type(back) or original != back:
        return [f"{path}: {original!r} came back as {back!r}"]
    return []


def _client_deserialize(text: str, model: str) -> Any:
    """The client's own deserialization of JSON ``text``: kubernetes >= 37 takes the text,
    older ones a response object whose ``.data`` is the text."""
    if "response_text" in inspect.signature(API.deserialize).parameters:
        return API.deserialize(text, model, "application/json")
    return API.deserialize(SimpleNamespace(data=text), model)


def deserialize(doc: dict[str, Any], model: str, where: str) -> Any:
    """``doc`` as the client's ``model``; an AssertionError naming ``where`` and the key path
    when the model refuses it or would drop or change any of it."""
    cls = getattr(kubernetes.client, model)
    try:
        obj = _client_deserialize(json.dumps(doc), model)
    except (ValueError, TypeError, AttributeError, KeyError) as exc:  # pydantic's are ValueError
        unknown = unknown_keys(doc, cls, "")
        hint = f"unknown key(s) {', '.join(unknown)}; " if unknown else ""
        raise AssertionError(f"{where}: not a valid {model}: {hint}{exc}") from None
    assert isinstance(obj, cls), f"{where}: deserialized into {type(obj).__name__}, not {model}"
    lost = differences(doc, API.sanitize_for_serialization(obj), "")
    assert not lost, f"{where}: as {model}:\n  " + "\n  ".join(lost)
    return obj


def test_the_helper_names_a_misspelt_key_and_ignores_none():
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p", "annotations": None},
           "spec": {"containers": [{"name": "c", "image": "i", "imagePulPolicy": "Always"}]}}
    with pytest.raises(AssertionError, match=r"spec\.containers\[0\]\.imagePulPolicy: unknown"):
        deserialize(pod, "V1Pod", "f.yaml document 0")
    pod["spec"] = {"contianers": [{"name": "c", "image": "i"}]}
    with pytest.raises(AssertionError, match=r"f\.yaml document 0: .*spec\.contianers"):
        deserialize(pod, "V1Pod", "f.yaml document 0")
    pod["spec"] = {"containers": [{"name": "c", "resources": {"limits": {"cpu": 1}}}]}
    with pytest.raises(AssertionError, match=r"limits\.cpu"):
        deserialize(pod, "V1Pod", "f.yaml document 0")
    pod["spec"] = {"containers": [{"name": "c", "image_pull_policy": "Always"}]}
    with pytest.raises(AssertionError, match=r"containers\[0\]\.image_pull_policy: unknown"):
        deserialize(pod, "V1Pod", "f.yaml document 0")
    pod["spec"] = {"containers": [{"name": "c", "ports": [], "env": None}],
                   "volumes": [{"name": "v", "emptyDir": {}}]}
    deserialize(pod, "V1Pod", "f.yaml document 0")


# --------------------------------------------------------------------------- every document


def test_the_folder_holds_the_manifests():
    assert not YAML_ERRORS, "\n".join(YAML_ERRORS)
    names = {p.name for p in DEPLOY.glob("*.yaml")}
    assert names >= EXPECTED_FILES, f"missing in {DEPLOY}: {sorted(EXPECTED_FILES - names)}"
    for path in sorted(DEPLOY.glob("*.yaml")):
        first = path.read_text(encoding="utf-8").lstrip("\n").splitlines()[0]
        assert first.startswith("#"), f"{path.name}: start with a comment saying what it is " \
            "for and what to change"


@pytest.mark.parametrize(("file", "index", "doc"), DOCS,
                         ids=[f"{f}#{i}" for f, i, _ in DOCS])
def test_each_document_deserializes_with_no_key_dropped(file, index, doc):
    where = _where(file, index, doc)
    assert isinstance(doc, dict), f"{where}: not a mapping"
    api, kind = doc.get("apiVersion"), doc.get("kind")
    if api == KUSTOMIZE_API:
        assert kind == "Kustomization" and file == "kustomization.yaml", where
        return
    if api == RAY_API:
        check_ray_resource(doc, where)
        return
    model = MODELS.get((api, kind))
    assert model, f"{where}: no check for apiVersion {api!r} kind {kind!r} (add it to MODELS)"
    deserialize(doc, model, where)
    if kind != "Namespace":
        assert doc["metadata"].get("namespace") == NAMESPACE, \
            f"{where}: metadata.namespace must be {NAMESPACE}"
    assert doc["metadata"].get("labels", {}).get(PART_OF) == "cua-rollout", \
        f"{where}: metadata.labels.{PART_OF} must be cua-rollout"


# --------------------------------------------------------------------------- KubeRay


def _keys_within(data: dict[str, Any], allowed: set[str], where: str) -> None:
    unknown = sorted(set(data) - allowed)
    assert not unknown, f"{where}: unknown key(s) {unknown} (KubeRay's fields: {sorted(allowed)})"


def _check_start_params(params: Any, where: str) -> None:
    assert isinstance(params, dict), f"{where}.rayStartParams: a mapping is required"
    wrong = {k: v for k, v in params.items() if not isinstance(v, str)}
    assert not wrong, f"{where}.rayStartParams: values must be strings (quote them): {wrong}"


def _check_template(template: Any, where: str) -> None:
    assert isinstance(template, dict), f"{where}.template: a pod template is required"
    deserialize(template, "V1PodTemplateSpec", f"{where}.template")
    containers = template.get("spec", {}).get("containers") or []
    assert containers, f"{where}.template.spec.containers: the Ray container is required"


def check_ray_cluster_spec(spec: Any, where: str) -> None:
    assert isinstance(spec, dict), f"{where}: a mapping is required"
    _keys_within(spec, RAYCLUSTER_SPEC_KEYS, where)
    head = spec.get("headGroupSpec")
    assert isinstance(head, dict), f"{where}.headGroupSpec: required"
    _keys_within(head, HEAD_GROUP_KEYS, f"{where}.headGroupSpec")
    _check_start_params(head.get("rayStartParams"), f"{where}.headGroupSpec")
    _check_template(head.get("template"), f"{where}.headGroupSpec")
    groups = spec.get("workerGroupSpecs")
    assert isinstance(groups, list) and groups, f"{where}.workerGroupSpecs: the runners' group"
    for i, group in enumerate(groups):
        at = f"{where}.workerGroupSpecs[{i}]"
        assert isinstance(group, dict), f"{at}: a mapping is required"
        _keys_within(group, WORKER_GROUP_KEYS, at)
        assert isinstance(group.get("groupName"), str), f"{at}.groupName: required"
        _check_start_params(group.get("rayStartParams"), at)
        _check_template(group.get("template"), at)
        low, n, high = (group.get(k) for k in ("minReplicas", "replicas", "maxReplicas"))
        assert all(isinstance(v, int) for v in (low, n, high)) and low <= n <= high, \
            f"{at}: needs minReplicas <= replicas <= maxReplicas (integers)"


def check_ray_resource(doc: dict[str, Any], where: str) -> None:
    kind = doc.get("kind")
    assert kind in ("RayCluster", "RayJob"), f"{where}: unexpected {RAY_API} kind {kind!r}"
    top = {"apiVersion", "kind", "metadata", "spec"}
    assert set(doc) <= top, f"{where}: unknown top-level key(s) {sorted(set(doc) - top)}"
    deserialize(doc["metadata"], "V1ObjectMeta", f"{where}.metadata")
    assert doc["metadata"].get("namespace") == NAMESPACE, f"{where}: metadata.namespace"
    spec = doc.get("spec")
    assert isinstance(spec, dict), f"{where}.spec: required"
    if kind == "RayCluster":
        check_ray_cluster_spec(spec, f"{where}.spec")
        return
    _keys_within(spec, RAYJOB_SPEC_KEYS, f"{where}.spec")
    assert isinstance(spec.get("entrypoint"), str) and spec["entrypoint"].strip(), \
        f"{where}.spec.entrypoint: required"
    assert spec.get("submissionMode", "K8sJobMode") in SUBMISSION_MODES, \
        f"{where}.spec.submissionMode: one of {sorted(SUBMISSION_MODES)}"
    assert ("rayClusterSpec" in spec) != ("clusterSelector" in spec), \
        f"{where}.spec: set rayClusterSpec or clusterSelector, one of them"
    if "rayClusterSpec" in spec:
        check_ray_cluster_spec(spec["rayClusterSpec"], f"{where}.spec.rayClusterSpec")
    if "submitterPodTemplate" in spec:
        deserialize(spec["submitterPodTemplate"], "V1PodTemplateSpec",
                    f"{where}.spec.submitterPodTemplate")
    for key, kind_of in (("shutdownAfterJobFinishes", bool), ("ttlSecondsAfterFinished", int)):
        if key in spec:
            assert isinstance(spec[key], kind_of), f"{where}.spec.{key}: a {kind_of.__name__}"


def _ray_pods() -> dict[str, dict[str, Any]]:
    """The RayCluster's pod templates: head and each worker group's."""
    spec = _doc("RayCluster")["spec"]
    out = {"head": spec["headGroupSpec"]["template"]}
    for group in spec["workerGroupSpecs"]:
        out[group["groupName"]] = group["template"]
    return out


def _env_secret(container: dict[str, Any], name: str) -> tuple[str, str] | None:
    for env in container.get("env") or []:
        if env.get("name") == name:
            ref = (env.get("valueFrom") or {}).get("secretKeyRef") or {}
            return ref.get("name"), ref.get("key")
    return None


def _mounts(template: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """mountPath -> the volume mounted there, in the template's first container."""
    volumes = {v["name"]: v for v in template["spec"].get("volumes") or []}
    return {m["mountPath"]: volumes[m["name"]]
            for m in template["spec"]["containers"][0].get("volumeMounts") or []}


def test_the_rayjob_runs_run_py_on_the_rayclusters_spec():
    job = _doc("RayJob")["spec"]
    assert re.fullmatch(r"python \S*run\.py --config /config/run\.yaml", job["entrypoint"]), \
        f"rayjob.yaml: spec.entrypoint {job['entrypoint']!r}"
    assert job.get("submissionMode") == "K8sJobMode", "rayjob.yaml: spec.submissionMode"
    assert job.get("shutdownAfterJobFinishes") is True, \
        "rayjob.yaml: spec.shutdownAfterJobFinishes"
    assert isinstance(job.get("ttlSecondsAfterFinished"), int), \
        "rayjob.yaml: spec.ttlSecondsAfterFinished"
    assert job["rayClusterSpec"] == _doc("RayCluster")["spec"], \
        "rayjob.yaml: spec.rayClusterSpec differs from raycluster.yaml's spec: keep them equal"


def test_the_ray_pods_have_the_service_account_secrets_and_volumes(tmp_path):
    cfg = _run_config(tmp_path)
    binding = _doc("RoleBinding")
    bound = {s["name"] for s in binding["subjects"] if s["kind"] == "ServiceAccount"}
    secrets = {d["metadata"]["name"]: d for _, _, d in DOCS if d.get("kind") == "Secret"}
    for group, template in _ray_pods().items():
        where = f"raycluster.yaml {group} template"
        spec, labels = template["spec"], template["metadata"]["labels"]
        assert labels.get(PART_OF) == "cua-rollout", f"{where}: label {PART_OF}"
        assert labels.get(COMPONENT) == ("ray-head" if group == "head" else "ray-worker"), \
            f"{where}: label {COMPONENT}"
        assert spec.get("serviceAccountName") in bound, \
            f"{where}: serviceAccountName must be the one rbac.yaml binds ({bound})"
        container = spec["containers"][0]
        for var in (cfg.desktops.token_env, cfg.model.api_key_env):
            ref = _env_secret(container, var)
            assert ref, f"{where}: env {var} from a Secret (the run config names it)"
            assert ref[0] in secrets and ref[1] in secrets[ref[0]]["stringData"], \
                f"{where}: env {var} reads {ref}, which secrets.example.yaml does not define"
        mounts = _mounts(template)
        assert mounts.get("/config", {}).get("configMap", {}).get("name") == "cua-run-config", \
            f"{where}: the ConfigMap cua-run-config at /config"
        assert cfg.desktops.download_cache_dir.is_absolute() \
            and str(cfg.desktops.download_cache_dir) in mounts, \
            f"{where}: desktops.download_cache_dir must be a mounted volume"
        assert any(Path(cfg.tasks.source).is_relative_to(p) for p in mounts), \
            f"{where}: tasks.source {cfg.tasks.source} is on no mounted volume"
    head = _mounts(_ray_pods()["head"])
    assert "persistentVolumeClaim" in head.get(str(cfg.run.output_dir), {}), \
        f"raycluster.yaml head: run.output_dir {cfg.run.output_dir} must be a volume claim"


def test_the_workers_have_cores_for_the_runners(tmp_path):
    cfg = _run_config(tmp_path)
    spec = _doc("RayCluster")["spec"]
    assert float(spec["headGroupSpec"]["rayStartParams"].get("num-cpus", "1")) == 0, \
        "raycluster.yaml: the head keeps num-cpus 0, so no runner is placed on it"
    cores = sum(float(g["rayStartParams"]["num-cpus"]) * g["replicas"]
                for g in spec["workerGroupSpecs"])
    c = cfg.coordinator
    runners = -(-c.max_concurrent_episodes // c.episodes_per_runner)
    assert runners * c.runner_num_cpus <= cores, "the runners do not fit the workers' num-cpus"
    assert runners <= cores, f"{runners} runners on {cores:g} worker cores: keep about one " \
        "runner per core (an event loop uses one core at most)"
    for group in spec["workerGroupSpecs"]:
        limit = group["template"]["spec"]["containers"][0]["resources"]["limits"]["cpu"]
        assert float(group["rayStartParams"]["num-cpus"]) == float(limit), \
            f"raycluster.yaml {group['groupName']}: num-cpus is the container's CPU limit"


# --------------------------------------------------------------------------- run config


def test_the_run_config_loads_and_uses_the_kubernetes_provider(tmp_path):
    cfg = _run_config(tmp_path)
    k = cfg.desktops.kubernetes
    want = {"desktops.provider": (cfg.desktops.provider, "kubernetes"),
            "ray.address": (cfg.ray.address, "auto"),
            "model.name": (cfg.model.name, "ui-tars-1.5-7b"),
            "model.api_key_env": (cfg.model.api_key_env, "CUA_MODEL_KEY"),
            "desktops.token_env": (cfg.desktops.token_env, "CUA_DESKTOP_TOKEN"),
            "desktops.kubernetes.namespace": (k.namespace, NAMESPACE),
            "desktops.kubernetes.service_account": (k.service_account, "cua-desktop"),
            "run.output_dir": (str(cfg.run.output_dir), "/results")}
    wrong = {key: got for key, (got, expected) in want.items() if got != expected}
    assert not wrong, f"run-config.yaml run.yaml: unexpected {wrong}"
    for path in (cfg.tasks.source, cfg.tasks.examples_dir, cfg.run.output_dir, k.pod_template,
                 cfg.desktops.download_cache_dir):
        assert path is not None and Path(path).is_absolute(), \
            f"run.yaml: {path} must be absolute (a job's working directory is Ray's choice)"
    secret = _doc("Secret", k.token_secret)
    assert k.token_secret_key in secret["stringData"], \
        f"secrets.example.yaml: {k.token_secret} has no key {k.token_secret_key}"


def test_the_pod_template_is_a_desktop_pod_in_the_configmap(tmp_path):
    cfg = _run_config(tmp_path)
    k = cfg.desktops.kubernetes
    template = PurePosixPath(str(k.pod_template))
    assert template.parent == PurePosixPath("/config"), \
        f"desktops.kubernetes.pod_template {template}: the ConfigMap is mounted at /config"
    kustomization = yaml.safe_load((DEPLOY / "kustomization.yaml").read_text(encoding="utf-8"))
    generated = {Path(f).name for g in kustomization.get("configMapGenerator") or []
                 if g["name"] == "cua-run-config" for f in g.get("files") or []}
    in_configmap = set(_doc("ConfigMap", "cua-run-config")["data"]) | generated
    assert template.name in in_configmap, \
        f"{template.name} is not a key of the ConfigMap cua-run-config ({sorted(in_configmap)})"
    assert (DEPLOY / template.name).is_file(), f"{template.name} is not in {DEPLOY}"
    file, _, pod = _find("Pod", DESKTOP_POD)
    assert file == template.name, f"the Pod document is in {file}, not {template.name}"
    containers = [c["name"] for c in pod["spec"]["containers"]]
    assert containers == ["desktop"], f"{file}: one container, named desktop (got {containers})"
    container = pod["spec"]["containers"][0]
    assert container["image"] == k.image, f"{file}: the image differs from the run config's"
    for key, want in (("cpu", k.cpu), ("memory", k.memory)):
        for side in ("requests", "limits"):
            assert container["resources"][side][key] == want, \
                f"{file}: resources.{side}.{key} differs from desktops.kubernetes.{key}"
    assert pod["spec"]["serviceAccountName"] == k.service_account, \
        f"{file}: spec.serviceAccountName differs from desktops.kubernetes.service_account"
    assert any(p["containerPort"] == k.port for p in container["ports"]), \
        f"{file}: no containerPort {k.port} (desktops.kubernetes.port)"
    assert _env_secret(container, "CUA_DESKTOP_TOKEN") == (k.token_secret, k.token_secret_key), \
        f"{file}: env CUA_DESKTOP_TOKEN must come from desktops.kubernetes.token_secret"


def test_the_desktop_pod_is_locked_down_and_probed_as_the_image_is():
    pod = _doc("Pod", DESKTOP_POD)
    spec, container = pod["spec"], pod["spec"]["containers"][0]
    security = spec["securityContext"]
    checks = {
        "spec.securityContext.runAsNonRoot": (security.get("runAsNonRoot"), True),
        "spec.securityContext.runAsUser": (security.get("runAsUser"), 1000),
        "spec.securityContext.fsGroup": (security.get("fsGroup"), 1000),
        "spec.securityContext.seccompProfile": (security.get("seccompProfile"),
                                                {"type": "RuntimeDefault"}),
        "containers[0].securityContext.allowPrivilegeEscalation":
            (container["securityContext"].get("allowPrivilegeEscalation"), False),
        "containers[0].securityContext.capabilities.drop":
            (container["securityContext"].get("capabilities", {}).get("drop"), ["ALL"]),
        "spec.terminationGracePeriodSeconds": (spec.get("terminationGracePeriodSeconds"), 10),
    }
    wrong = {key: got for key, (got, expected) in checks.items() if got != expected}
    assert not wrong, f"desktop-pod.yaml: {wrong}"
    shm = _mounts(pod).get("/dev/shm")
    assert shm and shm["emptyDir"]["medium"] == "Memory", "desktop-pod.yaml: /dev/shm in memory"
    account = _doc("ServiceAccount", spec["serviceAccountName"])
    assert account.get("automountServiceAccountToken") is False, \
        f"rbac.yaml: ServiceAccount {spec['serviceAccountName']} must not mount a token"
    bound = {s["name"] for s in _doc("RoleBinding")["subjects"]}
    assert spec["serviceAccountName"] not in bound, "desktops get no API access"
    # The probe runs what the image's HEALTHCHECK runs.
    text = CONTAINERFILE.read_text(encoding="utf-8").replace("\\\n", " ")
    line = next(x for x in text.splitlines() if x.startswith("HEALTHCHECK"))
    healthcheck = json.loads(line.split(" CMD ", 1)[1])
    assert container["readinessProbe"]["exec"]["command"] == healthcheck, \
        f"desktop-pod.yaml: readinessProbe must run the image's HEALTHCHECK {healthcheck}"
    assert "livenessProbe" not in container, \
        "desktop-pod.yaml: no liveness probe (a restart resets a desktop in use)"


def _quantity_mib(text: str) -> float:
    units = {"Ki": 1 / 1024, "Mi": 1, "Gi": 1024, "Ti": 1024 ** 2}
    for suffix, factor in units.items():
        if text.endswith(suffix):
            return float(text[:-2]) * factor
    return float(text) / 2 ** 20


def test_the_vm_desktop_pod_runs_the_launcher_on_its_volumes_and_kvm(tmp_path):
    """vm-desktop-pod.yaml: the launcher's command line parses and names paths on the pod's
    volumes (the spec from the ConfigMap cua-vm-spec, the base image read-only, the cache and
    the VMs' directory writable), its gates on the pod's IP (downward API) with the token
    from the Secret, a readiness probe on the gate's own path, /dev/kvm from the device
    plugin, memory above the guest's, and both files in the ConfigMap kustomize makes."""
    from cua_rollout.envs.providers.kubernetes import load_pod_template
    from cua_rollout.vm.launcher import READY_PATH, TOKEN_ENV, load_spec, parse_args

    pod = load_pod_template(DEPLOY / "vm-desktop-pod.yaml")
    assert pod["metadata"]["name"] == VM_DESKTOP_POD
    container = pod["spec"]["containers"][0]
    assert container["name"] == "desktop"
    assert container["command"][-2:] == ["-m", "cua_rollout.vm"]
    args = parse_args(container["args"])
    mounts = _mounts(pod)

    def volume_of(path: Path) -> tuple[str, dict[str, Any]]:
        where = max((m for m in mounts if str(path).startswith(m + "/") or str(path) == m),
                    key=len, default=None)
        assert where is not None, f"vm-desktop-pod.yaml: {path} is on no volume"
        return where, mounts[where]

    assert "configMap" in volume_of(args.spec)[1], "the spec comes from a ConfigMap"
    assert volume_of(args.spec)[1]["configMap"]["name"] == "cua-vm-spec"
    assert volume_of(args.cache)[1].get("hostPath") or \
        volume_of(args.cache)[1].get("persistentVolumeClaim")
    assert "emptyDir" in volume_of(args.root)[1]
    readonly = {m["mountPath"] for m in container["volumeMounts"] if m.get("readOnly")}
    spec = load_spec(DEPLOY / "vm-spec.json")
    image_mount, image_volume = volume_of(spec.image)
    assert image_mount in readonly and image_volume["persistentVolumeClaim"]["readOnly"], \
        "vm-desktop-pod.yaml: the base image's volume must be read-only"
    assert args.gate == "$(POD_IP)"
    env = {e["name"]: e for e in container["env"]}
    assert env["POD_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    assert _env_secret(container, TOKEN_ENV) == ("cua-desktop-token", "token")
    assert args.token_env == TOKEN_ENV
    ports = {p["containerPort"] for p in container["ports"]}
    assert ports == set(spec.forwards) and args.server_port in ports
    probe = container["readinessProbe"]["httpGet"]
    assert (probe["path"], probe["port"]) == (READY_PATH, args.server_port)
    assert "livenessProbe" not in container
    limits, requests = container["resources"]["limits"], container["resources"]["requests"]
    assert limits.get("devices.kubevirt.io/kvm") == "1"
    assert _quantity_mib(requests["memory"]) >= spec.memory_mb + 512, \
        "vm-desktop-pod.yaml: the memory request must exceed the guest's memory_mb"
    assert pod["spec"]["securityContext"]["runAsNonRoot"] is True
    kustomization = yaml.safe_load((DEPLOY / "kustomization.yaml").read_text(encoding="utf-8"))
    generated = {g["name"]: g["files"] for g in kustomization["configMapGenerator"]}
    assert "vm-desktop-pod.yaml" in generated["cua-run-config"]
    assert generated["cua-vm-spec"] == [f"{args.spec.name}=vm-spec.json"]
    # The run config's keys for VM pods load.
    load_config(None, ["desktops.kubernetes.reset=vm",
                       "desktops.kubernetes.pod_template=/config/vm-desktop-pod.yaml"])


# --------------------------------------------------------------------------- network


def _selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    if any(labels.get(k) != v for k, v in (selector.get("matchLabels") or {}).items()):
        return False
    for expr in selector.get("matchExpressions") or []:
        key, op, values = expr["key"], expr["operator"], expr.get("values") or []
        if (op == "In" and labels.get(key) not in values) \
                or (op == "NotIn" and labels.get(key) in values) \
                or (op == "Exists" and key not in labels) \
                or (op == "DoesNotExist" and key in labels):
            return False
    return True


def _policy_for(labels: dict[str, str]) -> dict[str, Any]:
    found = [d for _, _, d in DOCS if d.get("kind") == "NetworkPolicy"
             and _selects(d["spec"]["podSelector"], labels)]
    assert len(found) == 1, f"expected one NetworkPolicy selecting {labels}, found {len(found)}"
    return found[0]


def _peers_and_ports(policy: dict[str, Any]) -> tuple[list[dict], set[tuple[str, int]]]:
    peers, ports = [], set()
    for rule in policy["spec"].get("ingress") or []:
        peers += rule.get("from") or []
        ports |= {(p.get("protocol", "TCP"), p["port"]) for p in rule.get("ports") or []}
    return peers, ports


def _admitted(peers: list[dict], labels: dict[str, str]) -> bool:
    return any("podSelector" in p and "namespaceSelector" not in p and "ipBlock" not in p
               and _selects(p["podSelector"], labels) for p in peers)


def test_only_the_ray_pods_reach_the_desktops(tmp_path):
    cfg = _run_config(tmp_path)
    pod_labels = _doc("Pod", DESKTOP_POD)["metadata"]["labels"]
    assert pod_labels.get(COMPONENT) == "desktop" and pod_labels.get(PART_OF) == "cua-rollout", \
        f"desktop-pod.yaml: metadata.labels must have {COMPONENT}: desktop and {PART_OF}: " \
        f"cua-rollout (got {pod_labels})"
    assert cfg.desktops.kubernetes.labels == pod_labels, \
        "run.yaml desktops.kubernetes.labels differ from desktop-pod.yaml's labels"
    policy = _policy_for(pod_labels)
    where = f"NetworkPolicy {policy['metadata']['name']}"
    assert set(policy["spec"]["policyTypes"]) == {"Ingress", "Egress"}, where
    peers, ports = _peers_and_ports(policy)
    assert ("TCP", cfg.desktops.kubernetes.port) in ports, f"{where}: the server's port"
    for group, template in _ray_pods().items():
        assert _admitted(peers, template["metadata"]["labels"]), \
            f"{where}: does not admit the Ray {group} pods"
    model_labels = _doc("StatefulSet")["spec"]["template"]["metadata"]["labels"]
    for labels in (pod_labels, model_labels, {}):
        assert not _admitted(peers, labels), f"{where}: admits pods labelled {labels}"
    egress_ports = {p["port"] for rule in policy["spec"]["egress"] for p in rule["ports"]}
    assert egress_ports == {53}, f"{where}: desktops get no egress but DNS"
    assert all(set(rule) == {"ports"} for rule in policy["spec"]["egress"]), \
        f"{where}: the DNS egress rule has ports only"


def test_only_the_ray_pods_reach_the_model_pool():
    labels = _doc("StatefulSet")["spec"]["template"]["metadata"]["labels"]
    assert labels.get(COMPONENT) == "model", \
        f"model-pool.yaml: the pod template's label {COMPONENT} must be model"
    policy = _policy_for(labels)
    peers, ports = _peers_and_ports(policy)
    assert ports == {("TCP", 8000)}
    for group, template in _ray_pods().items():
        assert _admitted(peers, template["metadata"]["labels"]), f"Ray {group} pods"
    assert not _admitted(peers, _doc("Pod", DESKTOP_POD)["metadata"]["labels"]), \
        "desktops reach the model"


# --------------------------------------------------------------------------- model pool


def _arg(args: list[str], flag: str) -> str:
    assert flag in args, f"model-pool.yaml: vLLM argument {flag} missing"
    return args[args.index(flag) + 1]


def test_the_endpoints_are_the_statefulsets_replicas(tmp_path):
    cfg = _run_config(tmp_path)
    sts, service = _doc("StatefulSet"), _doc("Service", _doc("StatefulSet")["spec"]["serviceName"])
    assert service["spec"]["clusterIP"] == "None", "the model Service must be headless"
    pod = sts["spec"]["template"]
    assert service["spec"]["selector"] == sts["spec"]["selector"]["matchLabels"], \
        "model-pool.yaml: the Service selects other pods than the StatefulSet"
    assert _selects(sts["spec"]["selector"], pod["metadata"]["labels"]), \
        "model-pool.yaml: spec.selector does not select the StatefulSet's own pods"
    port = service["spec"]["ports"][0]["port"]
    name, svc = sts["metadata"]["name"], service["metadata"]["name"]
    want = [f"http://{name}-{i}.{svc}.{NAMESPACE}.svc:{port}" for i in
            range(sts["spec"]["replicas"])]
    assert cfg.model.endpoints == want, f"run.yaml model.endpoints must list every replica: {want}"
    container = pod["spec"]["containers"][0]
    assert container["command"][-2:] == ["-m", API_SERVER_MODULE], \
        f"model-pool.yaml: command must run {API_SERVER_MODULE} as run_model.py does"
    args = container["args"]
    assert _arg(args, "--served-model-name") == cfg.model.name
    assert int(_arg(args, "--port")) == port
    assert json.loads(_arg(args, "--limit-mm-per-prompt"))["image"] == cfg.agent.history_images
    pixels = json.loads(_arg(args, "--mm-processor-kwargs"))
    assert pixels == {"min_pixels": cfg.agent.min_pixels, "max_pixels": cfg.agent.max_pixels}, \
        "model-pool.yaml: --mm-processor-kwargs must equal agent.min_pixels / max_pixels"
    assert int(_arg(args, "--max-model-len")) >= RequestShape.of(cfg).budget(), \
        "model-pool.yaml: --max-model-len is shorter than the run's longest request"
    assert _env_secret(container, "VLLM_API_KEY") == ("cua-model-key", "key")
    assert container["resources"]["limits"].get("nvidia.com/gpu") == "1", \
        "model-pool.yaml: resources.limits.nvidia.com/gpu"
    assert container["readinessProbe"].get("httpGet") == {"path": "/health", "port": port}, \
        "model-pool.yaml: readinessProbe is httpGet /health on the server's port"
    claims = {v["persistentVolumeClaim"]["claimName"]: v["persistentVolumeClaim"]
              for v in pod["spec"]["volumes"] if "persistentVolumeClaim" in v}
    assert claims.get("cua-models", {}).get("readOnly") is True, \
        "model-pool.yaml: the claim cua-models, mounted read-only"
    claim = _doc("PersistentVolumeClaim", "cua-models")
    assert claim["spec"]["accessModes"] == ["ReadOnlyMany"], "volumes.yaml: cua-models is ROX"
    weights = PurePosixPath(_arg(args, "--model"))
    assert any(weights.is_relative_to(p) for p in _mounts(pod)), "the weights are not mounted"


# --------------------------------------------------------------------------- RBAC


def test_the_role_allows_exactly_what_the_provider_needs():
    role = _doc("Role")
    verbs: dict[str, set[str]] = {}
    for rule in role["rules"]:
        assert rule["apiGroups"] == [""], f"rbac.yaml: only the core API group ({rule})"
        for resource in rule["resources"]:
            verbs.setdefault(resource, set()).update(rule["verbs"])
    shown = {r: sorted(v) for r, v in verbs.items()}
    assert verbs == ROLE_VERBS, f"rbac.yaml: the Role allows {shown}, expected " \
        f"{ {r: sorted(v) for r, v in ROLE_VERBS.items()} }"
    binding = _doc("RoleBinding")
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role",
                                  "name": role["metadata"]["name"]}, "rbac.yaml: roleRef"
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "cua-rollout",
                                    "namespace": NAMESPACE}], "rbac.yaml: subjects"
    _doc("ServiceAccount", "cua-rollout")


# --------------------------------------------------------------------------- kustomization


def test_the_kustomization_lists_files_that_exist():
    kustomization = yaml.safe_load((DEPLOY / "kustomization.yaml").read_text(encoding="utf-8"))
    assert kustomization["apiVersion"] == KUSTOMIZE_API, "kustomization.yaml: apiVersion"
    resources = kustomization["resources"]
    missing = [r for r in resources if not (DEPLOY / r).is_file()]
    assert not missing, f"kustomization.yaml: resources that do not exist: {missing}"
    generated = [f.rsplit("=", 1)[-1] for g in kustomization.get("configMapGenerator") or []
                 for f in g.get("files") or []]  # "key=file": the file
    missing = [f for f in generated if not (DEPLOY / f).is_file()]
    assert not missing, f"kustomization.yaml: configMapGenerator files missing: {missing}"
    wrong = sorted(set(resources) & (OUTSIDE_KUSTOMIZATION | set(generated)))
    assert not wrong, f"kustomization.yaml must not apply {wrong}"
    manifests = {p.name for p in DEPLOY.glob("*.yaml")} - {"kustomization.yaml"}
    orphans = sorted(manifests - set(resources) - set(generated) - OUTSIDE_KUSTOMIZATION)
    assert not orphans, f"kustomization.yaml: neither applied nor generated: {orphans}"
    for g in kustomization.get("configMapGenerator") or []:
        if g.get("behavior") == "merge":
            # A merge needs the ConfigMap among the resources, in the same namespace.
            target = _doc("ConfigMap", g["name"])
            assert g.get("namespace") == target["metadata"]["namespace"], \
                f"kustomization.yaml: configMapGenerator {g['name']} needs namespace " \
                f"{target['metadata']['namespace']} to merge"
            assert (g.get("options") or {}).get("disableNameSuffixHash") is True, \
                f"kustomization.yaml: {g['name']} is mounted by name: disableNameSuffixHash"


def test_the_head_probes_the_drivers_healthz_where_the_run_config_serves_it(tmp_path):
    cfg = _run_config(tmp_path)
    assert cfg.monitoring.status_address is not None, \
        "run-config.yaml: monitoring.status_address is null: the head's probe has no driver"
    host, port = status_bind(cfg.monitoring.status_address)
    assert port, "run-config.yaml: monitoring.status_address needs a fixed port for the probe"
    head = _ray_pods()["head"]["spec"]["containers"][0]
    probe = head.get("livenessProbe") or {}
    command = (probe.get("exec") or {}).get("command") or []
    assert command[:3] == ["python", "-m", "cua_rollout.runtime.status_probe"], \
        f"raycluster.yaml: the head's livenessProbe runs {command}"
    assert command[3] == f"http://{reachable_host(host)}:{port}", \
        "raycluster.yaml: the head's probe and run.yaml's monitoring.status_address differ"
    assert importlib.util.find_spec(command[2]) is not None
    assert probe.get("timeoutSeconds", 1) > 5, \
        "raycluster.yaml: the probe's timeoutSeconds must exceed the probe's own 5 s"
