"""The one configuration schema of the project, loaded from YAML with ``--set a.b=c`` overrides.

Every section rejects unknown keys, so a typo fails with its key path and file. Secrets are
never in the YAML: the config names the environment variables that hold them.

One file on purpose: the schema is the YAML reference, one class per section read top to
bottom, and every key's docstring is its documentation; loading, overrides and the table of
moved keys follow it.
"""

from __future__ import annotations

import argparse
import os
import sys
import types
import typing
from pathlib import Path
from typing import Annotated, Any, Literal, NamedTuple
from urllib.parse import urlsplit

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator
from pydantic_core import PydanticCustomError

from cua_rollout.core.errors import ConfigError
from cua_rollout.core.http import host_entry, is_loopback
from cua_rollout.core.vision import MAX_PIXELS, MIN_PIXELS

__all__ = [
    "LEASE_MARGIN_S",
    "MOVED_KEYS",
    "RAG_DEFAULT_MODEL",
    "RAG_MAX_TOP_K",
    "RAG_MODELS",
    "TASK_MODES",
    "TEXT_MODES",
    "AgentConfig",
    "BackoffConfig",
    "BenchmarkConfig",
    "Config",
    "ContainerDesktopsConfig",
    "CoordinatorConfig",
    "DesktopsConfig",
    "DynamicRolloutsConfig",
    "Elsewhere",
    "EvaluationConfig",
    "KubernetesDesktopsConfig",
    "LocalDesktopsConfig",
    "MetricName",
    "ModelConfig",
    "ModelPoolConfig",
    "MonitoringConfig",
    "OSWorldPromptConfig",
    "PyToolConfig",
    "QwenComputerUseConfig",
    "RagToolConfig",
    "RayConfig",
    "RemoteDesktopsConfig",
    "Removed",
    "RetentionConfig",
    "RunConfig",
    "RunnerConfig",
    "SamplingConfig",
    "ServiceConfig",
    "ServiceTenantConfig",
    "StaticDesktopsConfig",
    "StorageConfig",
    "TasksConfig",
    "TextConfig",
    "TextMode",
    "VMDesktopsConfig",
    "VerifyConfig",
    "WebToolConfig",
    "add_config_arguments",
    "config_from_args",
    "load_config",
    "secret_from_env",
    "status_bind",
]

PositiveInt = Annotated[int, Field(ge=1)]
NonNegInt = Annotated[int, Field(ge=0)]
NonNegFloat = Annotated[float, Field(ge=0)]
PositiveFloat = Annotated[float, Field(gt=0)]
# What a lease covers beyond an episode's deadlines: the release, the last writes, a reset.
LEASE_MARGIN_S = 60.0


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_default=True)

    @model_validator(mode="before")
    @classmethod
    def _backoff_keys_default_to_their_use(cls, data: Any) -> Any:
        # BackoffConfig has no defaults of its own: each use has its own (the field's
        # default), and a key left out of one, e.g. ``--set model.backoff.max_s=3``, keeps it.
        if not isinstance(data, dict):
            return data
        for name, field in cls.model_fields.items():
            if field.annotation is BackoffConfig and isinstance(data.get(name), dict):
                data = {**data, name: {**field.default.model_dump(), **data[name]}}
        return data


class BackoffConfig(_Section):
    """A delay that grows: ``initial_s`` first, doubled each time up to ``max_s``. The
    section holding one sets its defaults."""

    initial_s: NonNegFloat
    """The first delay."""
    max_s: NonNegFloat
    """The cap of the delay."""


# --------------------------------------------------------------------------- sections


class RunConfig(_Section):
    """Identity of a run and where its results go."""

    name: str = Field("run", min_length=1, pattern=r"^[A-Za-z0-9._-]+$")
    """Run name; results go to ``<output_dir>/<name>/``. Rerunning the same name resumes."""
    output_dir: Path = Path("results")
    """Root directory of all runs' results."""
    seed: int = 0
    """Seed for everything random on the controller side (task order, scripted errors)."""
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = "INFO"
    """Log level of the driver and the actors."""


class RayConfig(_Section):
    """How to reach or start the Ray cluster."""

    address: str | None = None
    """``null`` starts a local cluster; ``"auto"`` or ``"ray://host:10001"`` joins one."""
    namespace: str = "cua-rollout"
    """Ray namespace of the named actors (coordinator, pools, storage)."""
    num_cpus: PositiveInt | None = None
    """CPUs of a locally started cluster (null: all cores)."""
    include_dashboard: bool = True
    """Start the Ray dashboard with a local cluster."""
    dashboard_host: str = "127.0.0.1"
    """Dashboard bind address; keep loopback unless the network is trusted."""
    dashboard_port: Annotated[int, Field(ge=1, le=65535)] = 8265
    """Dashboard port of a locally started cluster."""
    working_dir: Path | None = None
    """``runtime_env.working_dir`` shipped to a remote cluster (null: none, code is local)."""
    task_events_kept: PositiveInt = 10000
    """Task events the GCS of a locally started cluster keeps for the dashboard's task list
    (Ray's ``task_events_max_num_task_in_gcs``, 100,000 by default: ~11 KB per episode of
    GCS memory until that cap, 1 GB in a long run). A cluster this run joins keeps its own
    setting."""
    log_rotation_mb: PositiveInt = 64
    """Each log file of a locally started cluster is rotated at this size, keeping
    ``log_backups`` old ones (Ray's ``RAY_ROTATION_MAX_BYTES``; its 512 MB x 5 per file let a
    week-long run's logs grow to GBs)."""
    log_backups: NonNegInt = 2
    """Rotated log files kept per log (Ray's ``RAY_ROTATION_BACKUP_COUNT``)."""


class DynamicRolloutsConfig(_Section):
    """DART's dynamic rollout number: fewer rollouts for tasks the policy already solves."""

    enabled: bool = False
    """Use ``n = max(min_n, int(9/sr - 7))`` when a task's recent success rate >= threshold."""
    threshold: Annotated[float, Field(ge=0, le=1)] = 0.6
    """Success rate from which the rollout number shrinks."""
    min_n: PositiveInt = 2
    """Fewest rollouts per task."""
    window: PositiveInt = 16
    """How many recent episodes of a task make its success rate."""


class CheckpointBarrierConfig(_Section):
    """Newest checkpoint first: before groups are handed out, the ``run_model.py`` pool must
    serve the checkpoint it was last given (no rolling reload under way, every healthy
    replica on that version). Running episodes are not held; only new groups wait."""

    enabled: bool = False
    """Hold new groups while a reload is under way or replicas serve different versions."""
    timeout_s: NonNegFloat = 0.0
    """Longest wait per hand-out before groups start anyway (logged); 0: wait as long as it
    takes."""


class TasksConfig(_Section):
    """Which tasks to roll out."""

    source: Path | None = None
    """An OSWorld task list (``{domain: [ids]}``, e.g. ``test_all.json``), a JSONL file of
    tasks, or a directory of task JSON files."""
    examples_dir: Path | None = None
    """Where ``<domain>/<id>.json`` live for a task list (null: ``examples/`` beside it)."""
    domains: list[str] | None = None
    """Only these domains (null: all)."""
    task_ids: list[str] | None = None
    """Only these task ids (null: all)."""
    rollouts_per_task: PositiveInt = 1
    """Episodes per task, started next to each other as a group."""
    poll_interval_s: NonNegFloat = 0.0
    """0: one pass over the tasks; > 0: service mode, re-read the source this often."""
    dynamic_rollouts: DynamicRolloutsConfig = DynamicRolloutsConfig()
    """Optional adaptive rollout number."""
    rerun_infra_errors: bool = True
    """On a resumed run, rerun episodes whose results.jsonl line is ``infra_error`` (the new
    line replaces the old one); false keeps them as final."""
    passes: NonNegInt = 1
    """How many times the task set is sampled: each pass of a task is a new group of
    rollouts (``rollouts_per_task``, or DART's dynamic number from the task's success in
    earlier passes), started once the task's previous group is final. 0: unbounded (a
    service that keeps sampling until stopped)."""
    failed_group_reruns: NonNegInt = 2
    """A group with an episode that ended ``infra_error`` (its retries used up) failed as a
    whole: the trainer's index never hands it out (state ``failed_infra``: a smaller group
    would skew its advantages). With ``passes`` > 0 such a group does not count as one of
    the task's passes: another group is planned in its place, at most this many times per
    task (a task whose setup always fails stops there); 0: never. With ``passes: 0`` the
    task's next pass comes anyway."""
    checkpoint_barrier: CheckpointBarrierConfig = CheckpointBarrierConfig()
    """Start new groups only while the model pool serves its newest checkpoint (DART's
    ``load_latest_model()`` before each batch)."""
    mode: Literal["desktop", "math", "py", "rag", "web"] = "desktop"
    """What ``source`` holds: OSWorld desktop tasks (``desktop``), or a text benchmark of
    ``{id, question, answer, metadata}`` items run in that text mode (scored by ``metric``).
    The desktop pool is started only when some task needs a desktop."""
    metric: MetricName = "exact_match"
    """A text ``source``'s evaluation metric (as ``benchmarks[].metric``)."""
    metric_variant: Literal["original", "normalized"] = "normalized"
    """A text ``source``'s metric variant (as ``benchmarks[].metric_variant``)."""
    benchmarks: list[BenchmarkConfig] = []
    """Text benchmarks run besides (or instead of) ``source``, each in its own mode."""

    @model_validator(mode="after")
    def _benchmarks(self) -> TasksConfig:
        seen: dict[str, str] = {}
        own = 1 if self.mode != "desktop" and self.source is not None else 0
        for i, bench in enumerate(self.text_benchmarks()):
            where = ("tasks.source" if i < own else f"tasks.benchmarks[{i - own}]") + (
                f" ({bench.source})")
            if bench.domain in seen:
                raise ValueError(f"{where}: benchmark name {bench.domain!r} is also "
                                 f"{seen[bench.domain]}'s; give one of them a name")
            seen[bench.domain] = where
        return self

    def text_benchmarks(self) -> list[BenchmarkConfig]:
        """Every text benchmark of the run: ``source`` when ``mode`` is a text mode, then
        ``benchmarks``."""
        own = ([BenchmarkConfig(source=self.source, mode=self.mode, metric=self.metric,
                                metric_variant=self.metric_variant)]
               if self.mode != "desktop" and self.source is not None else [])
        return own + list(self.benchmarks)

    @property
    def needs_desktops(self) -> bool:
        """Whether some task runs on a desktop (the pool is started only then)."""
        return self.mode == "desktop" and self.source is not None


TEXT_MODES = ("math", "py", "rag", "web")
"""The text environments (no desktop): ``math`` (no tools), ``py`` (a Python sandbox), ``rag``
(retrieval over a local corpus), ``web`` (search and page fetch)."""
TASK_MODES = ("desktop", *TEXT_MODES)
TextMode = Literal["math", "py", "rag", "web"]
MetricName = Literal["exact_match", "f1_score", "similarity", "contains_answer",
                     "numeric_match", "llm_judgement"]


class BenchmarkConfig(_Section):
    """A text benchmark: a JSON (a list) or JSONL file of ``{id, question, answer, metadata}``
    items, run in one text mode and scored by one answer metric (an item may name its own in
    ``metadata.evaluation_metric``)."""

    source: Path
    """The benchmark file (.json: a list of items; .jsonl: one item per line)."""
    mode: TextMode
    """The environment its episodes run in."""
    metric: MetricName = "exact_match"
    """The benchmark's ``evaluation_metric`` (docs/text_metrics.md)."""
    metric_variant: Literal["original", "normalized"] = "normalized"
    """``original`` reproduces the seeds' definitions, quirks kept; ``normalized`` is ours."""
    numeric_tolerance: NonNegFloat = 1e-6
    """numeric_match's tolerance (relative in ``normalized``, absolute in ``original``)."""
    name: str | None = Field(None, min_length=1, pattern=r"^[A-Za-z0-9._-]+$")
    """Its name in results (the episodes' domain); null: the file's stem."""

    @property
    def domain(self) -> str:
        return self.name or Path(self.source).stem


class SamplingConfig(_Section):
    """Sampling parameters sent with every generation."""

    temperature: NonNegFloat = 0.7
    """Softmax temperature (DART uses 0.7; 0 for greedy evaluation)."""
    top_p: Annotated[float, Field(gt=0, le=1)] = 0.9
    """Nucleus sampling mass."""
    max_tokens: PositiveInt = 500
    """Most tokens per reply."""
    frequency_penalty: float = 0.0
    """OpenAI frequency penalty (UI-TARS deployments often use 1)."""
    logprobs: bool = False
    """Return the log-probability of each sampled token (for training)."""
    return_token_ids: bool = False
    """Return prompt and completion token ids (vLLM's ``return_token_ids``)."""
    seed: int | None = None
    """Per-request seed (null: unseeded)."""


class ModelConfig(_Section):
    """The policy: which model, where it is served, how requests are sent."""

    name: str = "ui-tars-1.5-7b"
    """Served model name sent as ``model`` in requests."""
    endpoints: list[str] = []
    """Base URLs of OpenAI-compatible servers you already run (``http://host:8000``).
    Empty: the endpoints ``run_model.py`` publishes (``endpoints_url``, else its state file
    under ``model_pool.state_dir``)."""
    endpoints_url: str | None = None
    """The endpoint list of a ``run_model.py`` on another machine, from its control server:
    ``http://HOST:PORT/endpoints`` (``model_pool.host`` and ``model_pool.control_port`` of
    that pool; ``run_model.py status`` prints it). Read with the key ``api_key_env`` names
    and re-read every second, so drivers and runners need no shared filesystem. Null: when
    the pool of ``model_pool.state_dir`` serves on a network address, ``run.py`` points the
    runners at its control server by itself; else they read its ``endpoints.json``."""
    version: str | None = None
    """The model version recorded with every step when ``model.endpoints`` are servers you
    run (e.g. your checkpoint's tag). Null: what each server reports in ``GET /v1/models``
    (vLLM's ``root``: the weights it loaded), else none; never the served name. Endpoints
    ``run_model.py`` publishes carry their checkpoint's version."""
    scripted: bool = False
    """Serve the built-in scripted UI-TARS policy in-process instead (demo and tests, no GPU)."""
    api_key_env: str | None = None
    """Name of the environment variable holding the API key (null: no key)."""
    sampling: SamplingConfig = SamplingConfig()
    """Sampling parameters."""
    request_timeout_s: PositiveFloat = 100.0
    """Deadline of one generation request."""
    connect_timeout_s: PositiveFloat = 5.0
    """Deadline to open a connection to an endpoint."""
    retries: Annotated[int, Field(ge=0)] = 5
    """Retries of a request after connection errors, timeouts and 5xx (4xx never retried)."""
    backoff: BackoffConfig = BackoffConfig(initial_s=0.5, max_s=20.0)
    """Delay before a retry: ``initial_s`` first, doubling per retry up to ``max_s``, with
    full jitter."""
    outage_wait_s: NonNegFloat = 300.0
    """How long, in total, an episode waits for a model endpoint when none is live (all
    down, draining for a reload, or restarting). Its deadline stops meanwhile and no
    attempt is used up; past this it is requeued, and the coordinator holds new episodes
    until an endpoint answers again."""
    routing: Literal["sticky_least_outstanding", "least_outstanding", "round_robin"] = (
        "sticky_least_outstanding"
    )
    """Endpoint choice: sticky per episode for prefix-cache reuse unless much busier."""
    sticky_max_extra_outstanding: Annotated[int, Field(ge=0)] = 4
    """Leave the sticky endpoint when it has this many more requests than the least loaded."""
    max_connections_per_endpoint: PositiveInt = 256
    """HTTP connection limit per endpoint in each process."""
    images: Literal["inline", "file"] = "inline"
    """How a request carries its screenshots. ``inline``: base64 data URLs in the body (any
    OpenAI-compatible server; five 1920x1080 screenshots make a ~2.3 MB body every step).
    ``file``: ``file://`` URLs of the screenshots the runner wrote into the run directory,
    read by the server itself: a request of a few KB, no base64 on either side, and a
    runner holds no encoded images. The model servers must see the run directory at the
    same path (one host, or a shared filesystem) and be allowed to read it: vLLM's
    ``--allowed-local-media-path <run.output_dir>`` (``model_pool.extra_args``). Needs
    ``runner.save_screenshots`` and runners that write their step files
    (``storage.step_files`` ``auto`` or ``runner``); a runner that cannot sends them
    inline, with a warning."""
    endpoint_failures_to_eject: PositiveInt = 3
    """Consecutive failures after which an endpoint is taken out of routing."""
    reprobe_interval_s: PositiveFloat = 10.0
    """How often an ejected endpoint's ``/health`` is probed to bring it back."""


class ModelPoolConfig(_Section):
    """vLLM replicas launched and supervised by ``run_model.py``."""

    checkpoint: str | None = None
    """Model path or name passed to ``--model``."""
    replicas: PositiveInt = 1
    """Number of vLLM servers."""
    tensor_parallel_size: PositiveInt = 1
    """GPUs per replica."""
    gpu_ids: list[int] | None = None
    """GPUs to use (null: all that NVML / nvidia-smi report)."""
    host: str = "127.0.0.1"
    """Bind address of the replicas. A non-loopback address (runners on other nodes) needs
    ``api_key_env``: a replica then refuses generations without the key."""
    api_key_env: str | None = None
    """The environment variable holding the key the replicas require on their ``/v1`` routes
    (given to vLLM as ``VLLM_API_KEY``, never on its command line); the model client sends
    the one ``model.api_key_env`` names."""
    control_port: Annotated[int, Field(ge=0, le=65535)] = 0
    """Port of the pool's control server (``/status``, ``/reload``, and ``/endpoints``, the
    endpoint list for clients that cannot read ``state_dir``), bound on ``host``. 0: a free
    port, written to ``control.json``; fix it when clients elsewhere use
    ``model.endpoints_url``."""
    base_port: Annotated[int, Field(ge=1024, le=65535)] = 8100
    """Port of the first replica; others follow (a busy port is skipped)."""
    state_dir: Path = Path(".model_pool")
    """Where ``endpoints.json``, pids and per-replica logs live."""
    extra_args: list[str] = []
    """Extra ``vllm`` server arguments, e.g. ``["--max-model-len", "32768"]``."""
    env: dict[str, str] = {}
    """Extra environment variables for the replicas (not secrets)."""
    startup_timeout_s: PositiveFloat = 900.0
    """Deadline for a replica to answer ``/health`` after start."""
    health_interval_s: PositiveFloat = 5.0
    """Supervision period."""
    restart_backoff: BackoffConfig = BackoffConfig(initial_s=2.0, max_s=120.0)
    """Delay before restarting a dead replica: ``initial_s`` first, doubling per consecutive
    death up to ``max_s``."""
    reload_batch: PositiveInt = 1
    """Replicas drained and reloaded at a time during a rolling reload."""
    drain_timeout_s: PositiveFloat = 300.0
    """Longest wait for in-flight requests before a replica is reloaded anyway."""
    drain_grace_s: NonNegFloat = 3.0
    """Time clients get to see a replica marked draining before its in-flight count is
    trusted (the model client checks the state file at most every 0.02 s, as it sends
    requests, and asks ``endpoints_url`` once a second: the grace covers the slower)."""
    reload_in_place: bool = True
    """Reload weights in place (vLLM dev endpoints ``/pause``, ``/collective_rpc``
    ``reload_weights``, ``/resume``) when the new checkpoint has the same architecture and
    tokenizer; else restart the replica. Starts replicas with ``VLLM_SERVER_DEV_MODE=1``,
    whose endpoints have no authentication: refused on a non-loopback ``host`` unless
    ``dev_mode_on_network`` is set."""
    dev_mode_on_network: bool = False
    """Allow ``reload_in_place`` (vLLM dev mode) with a non-loopback ``host``: anyone who
    reaches a replica can then pause it or load other weights. Only on a trusted network."""
    health_timeout_s: PositiveFloat = 5.0
    """Deadline of one ``/health`` or ``/metrics`` request to a replica."""
    health_failures_to_restart: PositiveInt = 3
    """Consecutive failed health checks after which a running replica is restarted (hung)."""
    stop_timeout_s: PositiveFloat = 30.0
    """Grace after SIGTERM before a replica's process group is killed."""
    watch_interval_s: PositiveFloat = 30.0
    """``--watch``: how often the checkpoint directory is polled."""
    cpu_kv_cache_space_gib: PositiveInt = 2
    """CPU build only (no GPU found): KV cache per replica (``VLLM_CPU_KVCACHE_SPACE``);
    an explicit size also lets vLLM skip its memory-profiling warm-up."""
    cpu_threads_per_replica: PositiveInt | None = None
    """CPU build only: OpenMP threads per replica (null: the machine's cores / replicas)."""
    cpu_enforce_eager: bool = True
    """CPU build only: pass ``--enforce-eager`` (no torch.compile: start in seconds, not
    minutes)."""
    max_model_len: PositiveInt | None = None
    """vLLM ``--max-model-len`` (null: for a vision-language checkpoint, derived from the
    run's settings — ``agent.history_images`` screenshots of the configured screen size,
    ``agent.history_texts`` replies of ``model.sampling.max_tokens``, the prompt — so no
    request is refused for length; for a text checkpoint, vLLM's default). An explicit
    ``--max-model-len`` in ``extra_args`` wins."""
    vlm_cpu_site: Path | None = None
    """CPU build only: the directory holding the isolated torchvision that vision-language
    replicas need (``bash scripts/setup_env.sh --vlm`` installs it; null: ``vlm-cpu-site``
    inside this Python's environment). Put on those replicas' ``PYTHONPATH`` only."""
    start_with_run: bool = False
    """``run.py`` starts ``run_model.py serve`` with this config, waits for a replica to be
    healthy (``startup_timeout_s``) and stops the pool when the run ends: one command for a
    dry run (``configs/demo_vlm.yaml``). Off: start the pool yourself."""


class LocalDesktopsConfig(_Section):
    """Desktops started on this machine (Xvfb + window manager + desktop server)."""

    state_dir: Path = Path(".desktops")
    """Per-desktop homes, logs and pid files; stale desktops are found here and removed."""
    window_manager: str = "openbox"
    """Window manager command run on each display."""
    home_template: Path | None = None
    """Directory copied into each fresh HOME at reset (null: an empty HOME)."""
    start_timeout_s: PositiveFloat = 60.0
    """Deadline for a desktop to become healthy."""
    host: str = "127.0.0.1"
    """Bind address of the desktops' servers. Runners on other nodes reach local desktops
    only through an address of the node that starts them (``desktops.node``) or ``0.0.0.0``;
    ``desktops.token_env`` is then required."""


class ContainerDesktopsConfig(_Section):
    """Desktops as containers of the desktop image (``scripts/build_desktop_image.sh``) on a
    container engine's CLI (podman or docker), started and removed by the pool."""

    engine: Literal["auto", "podman", "docker"] = "auto"
    """The engine's CLI (auto: podman if installed, else docker)."""
    image: str = "localhost/cua-desktop:demo"
    """The desktop image. The build script tags each build ``cua-desktop:<version>-<profile>-
    <inputs hash>`` and also ``cua-desktop:<profile>``, the last one built."""
    cpus: PositiveFloat | None = 1.0
    """CPU limit per desktop (``--cpus``; null: none)."""
    memory: str | None = "2g"
    """Memory limit per desktop (``--memory``; null: none)."""
    publish_host: str = "127.0.0.1"
    """Host address the desktop's port is published on (a random free port); another node
    reaches the desktops through a non-loopback address here (the token is then required)."""
    network: str | None = None
    """Engine network to attach (null: the engine's default)."""
    runtime: str | None = None
    """OCI runtime (``--runtime``; null: podman on cgroups v1 gets runc, else the engine's)."""
    extra_args: list[str] = []
    """More ``run`` arguments, e.g. ``["--shm-size", "1g"]``."""
    start_timeout_s: PositiveFloat = 60.0
    """Deadline for a container's desktop server to answer after ``run``."""


class VMDesktopsConfig(_Section):
    """Desktops as QEMU virtual machines of a disk image, started by the pool
    (``docs/vm_desktops.md``): each on a copy-on-write overlay of the one base image, started
    and reset by restoring the image's ready state (saved once, after a first boot)."""

    image: Path | None = None
    """The base disk image (qcow2 or raw): OSWorld's ``Ubuntu.qcow2``, or the test image of
    ``scripts/build_vm_image.sh``. Never written: make it read-only (``chmod a-w``)."""
    image_format: Literal["auto", "qcow2", "raw"] = "auto"
    """The image's format (auto: what ``qemu-img info`` says)."""
    firmware: Literal["uefi", "bios"] = "uefi"
    """UEFI (OVMF, with a variables file of each VM's own) as OSWorld's image needs, or BIOS."""
    ovmf_code: Path = Path("/usr/share/OVMF/OVMF_CODE_4M.fd")
    """OVMF's code (read-only, shared)."""
    ovmf_vars: Path = Path("/usr/share/OVMF/OVMF_VARS_4M.fd")
    """OVMF's variables template (copied per VM)."""
    memory_mb: PositiveInt = 4096
    """Guest memory per VM (OSWorld's docker provider: 4096)."""
    cpus: PositiveInt = 4
    """Virtual CPUs per VM (OSWorld's docker provider: 4)."""
    accel: Literal["auto", "kvm", "tcg"] = "auto"
    """``auto``: KVM when a probe guest makes progress under it, else TCG (with one warning
    saying why); ``tcg`` never tries KVM; ``kvm`` fails where KVM does not work."""
    server_port: PositiveInt = 5000
    """The guest port of the image's desktop server (OSWorld's and ours: 5000)."""
    chromium_port: PositiveInt = 9222
    """The guest port of Chrome's DevTools (OSWorld's image: socat on 9222)."""
    vlc_port: PositiveInt = 8080
    """The guest port of VLC's HTTP interface."""
    bind_host: str = "127.0.0.1"
    """Where each VM's ports are reachable (the host side of the forwards): the server's
    through a gate that checks the desktops' bearer token (the guest never sees it)."""
    state_dir: Path = Path(".desktops/vm")
    """Per-VM directories (overlay, variables, QMP socket, logs); VMs of dead runs are swept
    from here at the first start. Keep it short: a UNIX socket path holds 107 bytes."""
    ready_state_dir: Path | None = None
    """Where ready states are kept, by the image's identity and the machine's settings.
    Null: ``~/.cache/cua-rollout/vm-states``."""
    boot_timeout_s: PositiveFloat = 900.0
    """Deadline of the first boot that makes an image's ready state (TCG boots are slow)."""
    ready_still_s: PositiveFloat = 3.0
    """The first boot is ready when the server answers and the screen has been still this
    long; then its state is saved."""
    start_timeout_s: PositiveFloat = 120.0
    """Deadline of a VM's start or reset from the ready state until its server answers."""
    kernel: Path | None = None
    """Boot this kernel directly (QEMU ``-kernel``) instead of the image's bootloader: for
    images without one, such as the tests' tiny guest. Not for OSWorld's image, which boots
    its own. Null: the image boots itself."""
    initrd: Path | None = None
    """The initramfs for ``kernel`` (QEMU ``-initrd``)."""
    append: str = ""
    """The kernel command line for ``kernel`` (QEMU ``-append``)."""

    @model_validator(mode="after")
    def _direct_boot_complete(self) -> VMDesktopsConfig:
        if (self.initrd is not None or self.append) and self.kernel is None:
            raise ValueError("desktops.vm.initrd and desktops.vm.append need desktops.vm.kernel")
        return self


class StaticDesktopsConfig(_Section):
    """Desktops that already run somewhere (e.g. OSWorld VMs), given by URL."""

    urls: list[str] = []
    """Base URLs of the desktop servers, e.g. ``http://10.0.0.5:5000``."""
    reset: Literal["builtin", "command", "http", "none"] = "builtin"
    """How a VM is reset between episodes. ``builtin``: close the windows and end the
    processes that were not there when the pool first saw the VM, and restore HOME from the
    archive taken then (``$TMPDIR/.cua-baseline`` on the VM, /tmp without TMPDIR); ``command``: run
    ``reset_command`` on it; ``http``: POST to ``reset_url`` (a VM manager reverting a
    snapshot) and wait for the server to answer again; ``none``: task setup only."""
    reset_command: list[str] | None = None
    """Command run on the desktop (via ``/execute``) for ``reset: command``."""
    reset_url: str | None = None
    """For ``reset: http``: URL POSTed ``{"desktop", "url", "index"}`` to reset one VM; the
    reset is done when it answers 2xx and the VM's server answers again."""
    @model_validator(mode="before")
    @classmethod
    def _reset_from_its_setting(cls, data: Any) -> Any:
        # A config naming only reset_command (or reset_url) means that reset.
        if isinstance(data, dict) and "reset" not in data:
            if data.get("reset_command"):
                data = {**data, "reset": "command"}
            elif data.get("reset_url"):
                data = {**data, "reset": "http"}
        return data

    @model_validator(mode="after")
    def _reset_has_its_setting(self) -> StaticDesktopsConfig:
        if self.reset == "command" and not self.reset_command:
            raise ValueError("static.reset is 'command' but static.reset_command is not set")
        if self.reset == "http" and not self.reset_url:
            raise ValueError("static.reset is 'http' but static.reset_url is not set")
        return self
    retry_quarantined_s: PositiveFloat = 300.0
    """How long a failed desktop waits before it is checked again."""


class RemoteDesktopsConfig(_Section):
    """Desktops leased from an environment cluster instead of started by the run
    (``docs/remote_desktops.md``): each pool desktop is one remote lease (``cua``: our desktop
    service, ``cua-rollout desktops serve``) or one emulator (``gui-docker-env``: the API of
    GUI-Docker-Env, DART-GUI's environment manager)."""

    kind: Literal["cua", "gui-docker-env"] = "cua"
    """Which API the cluster speaks."""
    urls: list[str] = []
    """Base URLs of the service, e.g. ``http://envs.example:8700``; a new desktop is asked of
    each in turn until one grants it (a full quota or no free desktop on one: the next one).
    Empty with ``gui-docker-env``: the comma list in ``$OSWORLD_BASE_URL``, as their client
    reads it."""
    token_env: str | None = None
    """The variable holding the bearer token the service knows us by (``cua``: the tenant's
    token, required; ``gui-docker-env``: the quota token; null: ``OSWORLD_TOKEN``, as their
    client reads it)."""
    access: Literal["direct", "relay"] | None = None
    """``cua`` only: reach a desktop's own server directly (with the lease's own token) or
    through the service (``relay``). Null: the service's default."""
    wait_s: Annotated[float, Field(ge=0)] = 60.0
    """How long one new desktop waits for the quota and a free desktop (``cua``: the lease's
    ``wait_s``; ``gui-docker-env``: a 429 is asked again, with backoff, until then). Past it
    the pool runs with fewer desktops and its refill asks again later, with backoff."""
    start_timeout_s: PositiveFloat = 600.0
    """Deadline of getting one desktop until its server answers (a GUI-Docker-Env emulator
    boots a VM before ``/start_emulator`` answers), ``wait_s`` included."""
    request_timeout_s: PositiveFloat = 30.0
    """Deadline of one other call to the service (heartbeat, release, status)."""
    state_dir: Path = Path(".remote_desktops")
    """``gui-docker-env``: a record per emulator the runs of this machine hold. Their
    managers never expire an emulator, so a run's start stops those of runs that are gone
    (killed with SIGKILL, a crash) before it takes its own."""

    @model_validator(mode="after")
    def _fits_its_kind(self) -> RemoteDesktopsConfig:
        if self.access is not None and self.kind != "cua":
            raise ValueError(f"desktops.remote.access is for kind cua; {self.kind} desktops "
                             "are reached directly")
        for url in self.urls:
            parts = urlsplit(url)
            if parts.scheme not in ("http", "https") or not parts.hostname:
                raise ValueError(f"desktops.remote.urls: {url!r} is not an http(s) URL")
        return self

    def token_var(self) -> str:
        """The variable the token is read from."""
        return self.token_env or "OSWORLD_TOKEN"

    def token(self) -> str:
        """The token (``ConfigError`` naming the key when its variable is unset)."""
        value = secret_from_env(self.token_var(), "desktops.remote.token_env")
        assert value is not None
        return value

    def server_urls(self) -> list[str]:
        """``urls``, or for ``gui-docker-env`` without them ``$OSWORLD_BASE_URL``'s list
        (``ConfigError`` when there is none, or one is not a URL)."""
        urls = [u.rstrip("/") for u in self.urls]
        if not urls and self.kind == "gui-docker-env":
            for item in os.environ.get("OSWORLD_BASE_URL", "").split(","):
                item = item.strip()
                if item:
                    urls.append((item if "://" in item else f"http://{item}").rstrip("/"))
            for url in urls:
                if not urlsplit(url).hostname:
                    raise ConfigError(f"$OSWORLD_BASE_URL: {url!r} is not a URL")
        if not urls:
            raise ConfigError("desktops.provider is remote: set desktops.remote.urls to the "
                              "service's URL" + (" (or $OSWORLD_BASE_URL)"
                                                 if self.kind == "gui-docker-env" else ""))
        return urls


class VerifyConfig(_Section):
    """The check after every reset that a desktop is back in its first state
    (``cua_rollout/envs/verify.py``): a desktop that fails is quarantined and counted."""

    enabled: bool = True
    """Check every reset before the desktop is lent again."""
    home_depth: PositiveInt = 2
    """Levels of HOME compared with the baseline (visible entries and their sizes)."""
    ignore_paths: list[str] = []
    """HOME-relative path prefixes left out of the comparison."""
    ignore_processes: list[str] = []
    """Process names that may come and go (beyond the check's own commands)."""
    screenshot_max_distance: Annotated[int, Field(ge=0, le=64)] | None = 4
    """Cells of the screen's 8x8 grey thumbnail that may differ from the baseline's by more
    than 24 grey levels (a panel clock or the cursor: one or two); null: no screenshot
    comparison."""
    timeout_s: PositiveFloat = 30.0
    """Deadline of one check (within ``reset_timeout_s``)."""


class KubernetesDesktopsConfig(_Section):
    """Desktops as pods of the desktop image in a Kubernetes cluster (``env_k8s.py``;
    ``deploy/kubernetes/`` has the manifests, ``docs/kubernetes.md`` the walk-through)."""

    namespace: str = "default"
    """Namespace of the desktop pods (the provider's Role must allow pods there)."""
    image: str | None = None
    """The desktop image (``scripts/build_desktop_image.sh``, pushed to a registry the cluster
    pulls from). Null: the one ``pod_template`` names."""
    pod_template: Path | None = None
    """A YAML Pod (or a PodTemplate, whose ``template`` is used) that every desktop pod starts
    from: volumes, affinity, annotations, sidecars ... The provider sets, over it, the name,
    the labels below, the desktop container's image, resources, port, token and readiness
    probe (``deploy/kubernetes/desktop-pod.yaml`` is one). Null: a pod of the image alone."""
    service_account: str | None = None
    """Service account of the pods (null: the namespace's default)."""
    cpu: str = "1"
    """CPU request and limit per pod."""
    memory: str = "2Gi"
    """Memory request and limit per pod."""
    node_selector: dict[str, str] = {}
    """Node labels a desktop pod must run on."""
    tolerations: list[dict[str, Any]] = []
    """Tolerations of the pods (Kubernetes' own form: ``{key, operator, value, effect}``)."""
    image_pull_secrets: list[str] = []
    """Secrets of the registry the image is pulled from."""
    labels: dict[str, str] = {}
    """More labels on each pod (e.g. the ones a NetworkPolicy selects)."""
    port: Annotated[int, Field(ge=1, le=65535)] = 5000
    """Port of the desktop server in the pod."""
    token_secret: str | None = None
    """A Secret holding the desktops' bearer token (key ``token_secret_key``), given to each
    pod's server as ``CUA_DESKTOP_TOKEN``; the runners send the same value from
    ``desktops.token_env``. Null: no token (a pod then accepts anyone who reaches it)."""
    token_secret_key: str = "token"
    """The key of the token in ``token_secret``."""
    reset: Literal["builtin", "vm"] = "builtin"
    """How a pod's desktop is reset between episodes. ``builtin``: in place, through the
    desktop server (the windows and processes that were not there at the start closed and
    ended, HOME restored): pods of the desktop image. ``vm``: pods that run the VM launcher
    (``deploy/kubernetes/vm-desktop-pod.yaml``, ``docs/vm_desktops.md``) are reset by its
    ``POST /vm/reset``, a restore of the VM's ready state. The pool's reset check follows
    either."""
    service_per_pod: bool = False
    """Give each pod a Service and reach it by the Service's cluster DNS name instead of
    the pod's IP (the provider's Role then needs services too)."""
    kubeconfig: Path | None = None
    """A kubeconfig file. Null: the in-cluster service account when running in a pod, else
    ``$KUBECONFIG`` or ``~/.kube/config``."""
    context: str | None = None
    """The kubeconfig context (null: its current one)."""
    startup_timeout_s: PositiveFloat = 300.0
    """Deadline for a pod to be scheduled, pull its image and answer."""
    api_timeout_s: PositiveFloat = 30.0
    """Deadline of one API request."""
    api_outage_s: PositiveFloat = 300.0
    """How long the API server may be unreachable before the pool's calls fail (held leases
    keep working meanwhile; watches are re-listed when it answers again)."""
    heartbeat_interval_s: PositiveFloat = 30.0
    """How often the provider marks its pods alive (an annotation); the sweep removes pods of
    other runs whose mark is older than ``heartbeat_timeout_s``."""
    heartbeat_timeout_s: PositiveFloat = 180.0
    """Age of a run's heartbeat after which its pods count as leaked."""

    @model_validator(mode="after")
    def _vm_pods_have_a_template(self) -> KubernetesDesktopsConfig:
        if self.reset == "vm" and self.pod_template is None:
            raise ValueError(
                "desktops.kubernetes.reset is vm: set desktops.kubernetes.pod_template to a "
                "pod that runs the VM launcher (deploy/kubernetes/vm-desktop-pod.yaml); a pod "
                "of the image alone runs the desktop image's server, which /vm/reset is not")
        return self

    @model_validator(mode="after")
    def _heartbeat_outlives_its_interval(self) -> KubernetesDesktopsConfig:
        if self.heartbeat_timeout_s <= 2 * self.heartbeat_interval_s:
            raise ValueError(
                f"desktops.kubernetes.heartbeat_timeout_s ({self.heartbeat_timeout_s:g}) must "
                f"exceed twice heartbeat_interval_s ({self.heartbeat_interval_s:g}): a live "
                "run's pods would be swept")
        return self


class DesktopsConfig(_Section):
    """The pool of desktops episodes lease."""

    provider: Literal["local", "static", "container", "kubernetes", "vm", "remote"] = "local"
    """Where desktops come from (``remote``: leased from an environment cluster,
    ``desktops.remote``)."""
    apps: list[str] | None = None
    """The apps the desktops have (OSWorld's names: ``chrome``, ``libreoffice_calc``,
    ``vs_code`` ...): a task naming another in its ``related_apps`` is skipped as not
    runnable here. Null: the provider says (``local``: the commands installed here;
    ``container``: the image's ``cua.apps`` label; others: every app).
    ``cua_rollout/envs/apps.py``."""
    node: str | None = None
    """The one Ray node that runs the desktop pool, and so starts ``local`` desktops and runs
    the ``container`` engine's CLI: its IP address as Ray reports it (``ray.nodes()``'s
    ``NodeManagerAddress``, ``ray status``) or its node id. Null: ``local``, ``container``
    and ``vm`` desktops run on every live node with CPUs, a pool shard on each with its
    share of ``count + warm_spares`` (in proportion to the nodes' CPUs), and runners lease
    from their own node's shard first; ``static`` and ``kubernetes`` shards
    (``shards``) run on the driver's node."""
    shards: PositiveInt | None = None
    """How many pool shards hold ``static`` and ``kubernetes`` desktops: a desktop belongs
    to the shard its key hashes to (a static desktop's URL, a pod's index: the stable part
    of its name), each shard a process of its own (leases, resets and reset checks spread
    over them). Null: one per 2,000 desktops of ``count + warm_spares``, rounded up (a run
    of up to 2,000 has one; one shard carried ~16,000 at a 2 s step with ``verify`` off,
    benchmarks/bench_singletons.py). ``local``,
    ``container`` and ``vm`` desktops have a shard per node instead (``node``)."""
    count: PositiveInt = 2
    """Desktops in the pool (for ``static``: taken from ``static.urls`` when unset)."""
    warm_spares: Annotated[int, Field(ge=0)] = 1
    """Desktops kept reset and ready beyond current demand, so a lease rarely waits."""
    screen_width: PositiveInt = 1920
    """Screen width in pixels."""
    screen_height: PositiveInt = 1080
    """Screen height in pixels."""
    lease_timeout_s: PositiveFloat = 120.0
    """Longest wait for a desktop before ``DesktopUnavailable``."""
    lease_max_s: PositiveFloat = 3600.0
    """A lease older than this is reclaimed (its holder is presumed dead)."""
    reset_timeout_s: PositiveFloat = 60.0
    """Deadline of one reset; a desktop that misses it is quarantined."""
    health_interval_s: PositiveFloat = 15.0
    """How often idle desktops are health-checked."""
    request_timeout_s: PositiveFloat = 30.0
    """Deadline of one desktop request (``/execute`` of an action, ``/screenshot``)."""
    setup_timeout_s: PositiveFloat = 180.0
    """Deadline of one task setup step (launch, open, download ...)."""
    max_connections: PositiveInt = 512
    """HTTP connection limit of the desktop client in each process."""
    retries: Annotated[int, Field(ge=0)] = 2
    """Retries of a desktop request on transient errors."""
    token_env: str | None = None
    """Name of the environment variable holding the desktop servers' bearer token."""
    client_password_env: str | None = None
    """Name of the environment variable replacing ``{CLIENT_PASSWORD}`` in task setup."""
    download_cache_dir: Path = Path("cache")
    """Cache of files tasks download (setup ``download`` steps, the ``cloud_file`` getter),
    shared by every desktop and run on this host: each URL is fetched once. OSWorld's own
    cache names (``<task_id>/<name>``) are read as they are."""
    offline: bool = False
    """Never fetch: downloads read only ``download_cache_dir``, and a missing file is an
    error naming its URL and the cache path it was looked for under."""
    download_timeout_s: PositiveFloat = 300.0
    """Deadline of fetching one file into the cache."""
    chromium_port: Annotated[int, Field(ge=1, le=65535)] = 9222
    """Port of the desktop's Chromium remote debugging (DevTools) endpoint, on the desktop's
    host: OSWorld's VMs forward 9222 to Chrome's 1337 with socat. Chrome setup steps and
    getters use it."""
    vlc_port: Annotated[int, Field(ge=1, le=65535)] = 8080
    """Port of VLC's HTTP interface on the desktop's host (OSWorld's VLC getters)."""
    accounts_dir: Path | None = None
    """OSWorld's ``settings`` folder with the credentials its ``login`` and ``googledrive``
    setup steps read (``google/settings.json``, ``googledrive/settings.yml`` ...). Null:
    tasks with those steps are refused when they load (they also need the internet)."""
    task_file_roots: list[Path] = []
    """Other directories whose files tasks may upload to a desktop (``upload_file``); run.py
    adds the folder of ``tasks.source`` and ``tasks.examples_dir``. Nothing else on this host
    is readable by a task file."""
    verify: VerifyConfig = VerifyConfig()
    """The check after every reset."""
    local: LocalDesktopsConfig = LocalDesktopsConfig()
    """Settings of the ``local`` provider."""
    static: StaticDesktopsConfig = StaticDesktopsConfig()
    """Settings of the ``static`` provider."""
    container: ContainerDesktopsConfig = ContainerDesktopsConfig()
    """Settings of the ``container`` provider."""
    kubernetes: KubernetesDesktopsConfig = KubernetesDesktopsConfig()
    """Settings of the ``kubernetes`` provider."""
    vm: VMDesktopsConfig = VMDesktopsConfig()
    """Settings of the ``vm`` provider."""
    remote: RemoteDesktopsConfig = RemoteDesktopsConfig()
    """Settings of the ``remote`` provider."""

    @property
    def start_deadline_s(self) -> float:
        """How long the provider may take to start one desktop: a VM's first start boots the
        image and saves its ready state; a pod waits to be scheduled and pulled."""
        return {"vm": self.vm.boot_timeout_s + self.vm.start_timeout_s,
                "container": self.container.start_timeout_s,
                "kubernetes": self.kubernetes.startup_timeout_s,
                "remote": self.remote.start_timeout_s,
                }.get(self.provider, self.local.start_timeout_s)

    @model_validator(mode="after")
    def _shards_fit(self) -> DesktopsConfig:
        if self.shards is None:
            return self
        if self.provider not in ("static", "kubernetes", "remote"):
            raise ValueError(
                f"desktops.shards is for static, kubernetes and remote desktops; {self.provider} "
                "desktops have one pool shard per node that runs them (desktops.node pins "
                "them to one)")
        desktops = self.count + self.warm_spares
        if self.provider == "static" and self.static.urls:
            desktops = min(desktops, len(self.static.urls))
        if self.shards > desktops:
            raise ValueError(f"desktops.shards {self.shards} is more than the run's "
                             f"{desktops} desktops: a shard would hold none")
        return self

    @model_validator(mode="after")
    def _vm_complete(self) -> DesktopsConfig:
        if self.provider == "vm" and self.vm.image is None:
            raise ValueError("desktops.provider is vm: set desktops.vm.image to a disk image "
                             "(OSWorld's Ubuntu.qcow2, or scripts/build_vm_image.sh's)")
        return self

    @model_validator(mode="after")
    def _remote_complete(self) -> DesktopsConfig:
        if self.provider == "remote" and self.remote.kind == "cua" \
                and self.remote.token_env is None:
            raise ValueError("desktops.remote.kind is cua: set desktops.remote.token_env to "
                             "the variable holding the tenant's bearer token")
        return self

    @model_validator(mode="after")
    def _kubernetes_complete(self) -> DesktopsConfig:
        if self.provider != "kubernetes":
            return self
        k = self.kubernetes
        if k.image is None and k.pod_template is None:
            raise ValueError("desktops.provider is kubernetes: set desktops.kubernetes.image "
                             "(or a desktops.kubernetes.pod_template naming one)")
        if (k.token_secret is None) != (self.token_env is None):
            raise ValueError(
                "desktops.provider is kubernetes: set both desktops.kubernetes.token_secret "
                "(the Secret the pods read their token from) and desktops.token_env (the "
                "variable the runners read the same token from); pods are reachable from the "
                "whole cluster network")
        return self

    @model_validator(mode="after")
    def _token_beyond_loopback(self) -> DesktopsConfig:
        # A desktop runs any code it is sent: beyond this host, only for who holds the token.
        key, host = {"local": ("local.host", self.local.host),
                     "container": ("container.publish_host", self.container.publish_host),
                     "vm": ("vm.bind_host", self.vm.bind_host),
                     }.get(self.provider, (None, "127.0.0.1"))
        if self.token_env is None and not is_loopback(host):
            raise ValueError(
                f"desktops.{key} {host!r} is reachable from other hosts: set "
                "desktops.token_env to the variable holding the desktops' bearer token (a "
                "desktop runs any code it is sent)")
        return self


class EvaluationConfig(_Section):
    """How episodes are scored: OSWorld's rules, by our own functions or OSWorld's code."""

    engine: Literal["auto", "native", "osworld"] = "auto"
    """``auto``: a task whose metrics and getters all have a native implementation (parity-
    tested against OSWorld's) is scored natively, any other one by OSWorld's own evaluator
    code in a worker process; ``native``: never the worker (tasks that need it are refused
    when they load); ``osworld``: every task by OSWorld's code."""
    osworld_python: Path | None = None
    """Interpreter of the environment holding OSWorld's evaluator code (``desktop-env``,
    installed by ``scripts/setup_env.sh --osworld``). Null: ``.venv-osworld/bin/python`` of
    this project, when it exists."""
    osworld_path: Path | None = None
    """A checkout of OSWorld whose ``desktop_env`` package is used instead of the installed
    one (put first on the worker's import path)."""
    worker_start_timeout_s: PositiveFloat = 120.0
    """Deadline for the worker to import OSWorld's evaluators and answer."""


class CoordinatorConfig(_Section):
    """How many episodes run at once and how they are scheduled."""

    max_concurrent_episodes: PositiveInt = 8
    """Episodes in flight at once (K)."""
    episodes_per_runner: PositiveInt = 8
    """Episodes one runner actor holds at once; 1 is the original one-actor-per-episode."""
    schedule: Literal["rollout", "batch"] = "rollout"
    """``rollout``: refill a slot the moment an episode ends; ``batch``: start the next batch
    only when the whole batch is done (strictly on-policy, and for comparison)."""
    batch_cutoff: Annotated[float, Field(gt=0, le=1)] | None = None
    """``schedule: batch`` straggler control: once this fraction of a batch is final (and
    ``batch_grace_s`` more has passed), the batch's episodes still running are cut: recorded
    as ``cancelled`` with the reason, never scored, and run again in the next batch (WebGym
    uses 0.98). Null: every batch waits for its last episode."""
    batch_grace_s: NonNegFloat = 0.0
    """How long after ``batch_cutoff`` is reached the stragglers may still finish."""
    max_retries: Annotated[int, Field(ge=0)] = 2
    """Retries of an episode after an infrastructure failure (never after an agent failure)."""
    runner_num_cpus: NonNegFloat = 0.25
    """Ray CPU reservation of one runner actor (they mostly wait on I/O)."""
    outage_backoff: BackoffConfig = BackoffConfig(initial_s=1.0, max_s=30.0)
    """While the model or the desktops are down, the delay before checking again:
    ``initial_s`` first, doubling per check up to ``max_s``, with full jitter (both > 0)."""
    outage_give_up_s: NonNegFloat = 0.0
    """Stop the run (resumable, exit 1) when an outage lasts this long; 0 waits forever."""

    @model_validator(mode="after")
    def _cutoff_is_for_batches(self) -> CoordinatorConfig:
        if self.batch_cutoff is not None and self.schedule != "batch":
            raise ValueError("coordinator.batch_cutoff cuts stragglers of synchronous batches: "
                             "set coordinator.schedule: batch (a rollout schedule has none)")
        return self

    @model_validator(mode="after")
    def _outage_backoff_positive(self) -> CoordinatorConfig:
        # A delay of 0 would check a down model or desktop pool in a busy loop.
        backoff = self.outage_backoff
        if not (backoff.initial_s > 0 and backoff.max_s > 0):
            raise ValueError(f"coordinator.outage_backoff: initial_s and max_s must be greater "
                             f"than 0, got {backoff.initial_s:g} and {backoff.max_s:g}")
        return self


class OSWorldPromptConfig(_Section):
    """``agent.name: osworld-prompt``: OSWorld's prompt agent (cua_rollout/agents/osworld/;
    docs/agents.md), for any chat model, vision or not."""

    observation_type: Literal["screenshot", "a11y_tree", "screenshot_a11y_tree", "som"] = (
        "screenshot_a11y_tree")
    """What the model sees each step: the screenshot, the linearized accessibility tree,
    both, or ``som`` (the screenshot with numbered boxes drawn from the tree, and their
    table). Every kind but ``screenshot`` fetches the desktop's tree each step."""
    action_space: Literal["pyautogui", "computer_13"] = "pyautogui"
    """How it answers: Python code blocks using pyautogui, or ``computer_13`` JSON actions
    (not with ``som``, as in OSWorld)."""
    max_trajectory_length: NonNegInt = 3
    """Past steps (observation and reply) kept in a request (OSWorld's default, 3)."""
    a11y_tree_max_chars: PositiveInt = 40000
    """The linearized tree is cut past this many characters (OSWorld: 10,000 GPT-4 tokens,
    counted with tiktoken, whose vocabulary is downloaded at run time)."""
    password: str | None = "password"
    """The sudo password the prompt gives the model (OSWorld's images: ``password``; null:
    none is given)."""

    @model_validator(mode="after")
    def _som_writes_code(self) -> OSWorldPromptConfig:
        if self.observation_type == "som" and self.action_space != "pyautogui":
            raise ValueError("observation_type som needs action_space pyautogui (its marks "
                             "are names in the code)")
        return self


class QwenComputerUseConfig(_Section):
    """``agent.name: qwen-computer-use``: Qwen2.5-VL / Qwen3-VL's ``computer_use`` function
    tool (cua_rollout/agents/qwen.py; docs/agents.md). Screenshots in a request:
    ``agent.history_images``; pixel bounds: ``agent.min_pixels`` / ``max_pixels``."""

    coordinates: Literal["absolute", "relative"] = "absolute"
    """``absolute``: pixels of the ``smart_resize``d screenshot (Qwen2.5-VL); ``relative``:
    0..1000 on each axis (Qwen3-VL)."""
    send_tools: bool = True
    """Send the tool as OpenAI ``tools`` (the server's chat template describes it, its tool
    parser returns ``tool_calls``: vLLM's ``--enable-auto-tool-choice --tool-call-parser
    hermes``). False: describe it in the system prompt ourselves and read the
    ``<tool_call>`` blocks of the reply's text (a server without a tool parser). Calls
    written inline are read either way."""
    max_calls_per_reply: PositiveInt = 5
    """Tool calls of one reply that run (in order); a reply with more is a parse failure."""


class AgentConfig(_Section):
    """The agent: what turns a screenshot and the history into a request, and a reply into
    actions (cua_rollout/agents/; docs/agents.md). ``name`` picks a registered agent."""

    name: Literal["uitars-1.5", "uitars-1.0", "osworld-prompt", "qwen-computer-use"] = (
        "uitars-1.5")
    """The agent. ``uitars-1.5`` / ``uitars-1.0``: UI-TARS, answering in pixels of the
    resized screenshot / relative units 0..1000; ``osworld-prompt``: OSWorld's prompt agent
    (``agent.osworld_prompt``); ``qwen-computer-use``: Qwen-VL's computer-use tool
    (``agent.qwen_computer_use``). (Text tasks are played by the tool-calling agent of their
    mode: ``text.*``.)"""
    osworld_prompt: OSWorldPromptConfig = OSWorldPromptConfig()
    """The settings of ``osworld-prompt``."""
    qwen_computer_use: QwenComputerUseConfig = QwenComputerUseConfig()
    """The settings of ``qwen-computer-use``."""
    history_images: PositiveInt = 5
    """Screenshots in a request, the current one included (UI-TARS's ``history_n``)."""
    history_texts: PositiveInt = 35
    """Past responses kept in a request (older turns are dropped)."""
    max_parse_retries: Annotated[int, Field(ge=0)] = 3
    """Re-asks of the model after an unparseable reply before the episode ends with FAIL."""
    call_user: Literal["fail", "wait"] = "fail"
    """``call_user()``: end with FAIL (the UI-TARS agents' default), or treat as a wait."""
    call_user_max_waits: Annotated[int, Field(ge=0)] = 1
    """With ``call_user: wait``, how many call_user are tolerated before FAIL."""
    prompt_call_user: bool = True
    """Offer ``call_user()`` in the prompt's action space."""
    prompt_language: str = "English"
    """Language the model is asked to think in."""
    prompt_note: str | None = None
    """Extra line in the prompt's Note section (e.g. where the sudo password comes from)."""
    min_pixels: PositiveInt = MIN_PIXELS
    """Lower pixel bound of the served model's image processor (smart_resize). With
    ``uitars-1.5`` the model answers in pixels of the resized screenshot, so the parser must
    resize as the server did: keep these equal to the processor's (``run_model.py`` passes
    them to the vision-language replicas it launches)."""
    max_pixels: PositiveInt = MAX_PIXELS
    """Upper pixel bound of the served model's image processor (UI-TARS-1.5: 12845056)."""
    constrain_actions: bool = False
    """Constrained decoding: send vLLM a structured-output regex of every UI-TARS action form
    (``cua_rollout.agents.uitars.grammar``), coordinates within the resized frame, so every
    reply parses. For smoke tests and undertrained checkpoints. It changes the policy: tokens are
    sampled from the masked, renormalised distribution and the logprobs returned are those
    of that constrained process, not of the free model; each step records ``constrained``.
    Needs ``model.sampling.max_tokens`` >= the grammar's longest reply (checked at the
    run's start)."""

    @model_validator(mode="after")
    def _agent_fits(self) -> AgentConfig:
        if self.constrain_actions and not self.name.startswith("uitars-"):
            raise ValueError(f"constrain_actions is the UI-TARS action grammar; agent "
                             f"{self.name} has none")
        o = self.osworld_prompt
        if (self.name == "osworld-prompt" and o.observation_type != "a11y_tree"
                and o.max_trajectory_length + 1 > self.history_images):
            # The model servers take history_images images per prompt (run_model.py).
            raise ValueError(f"osworld_prompt.max_trajectory_length "
                             f"({o.max_trajectory_length}) + the current screenshot is more "
                             f"than history_images ({self.history_images}) images a request")
        return self


class RunnerConfig(_Section):
    """One episode's loop."""

    max_steps: PositiveInt = 30
    """Steps before the episode ends as ``max_steps``."""
    action_pause_s: NonNegFloat = 1.0
    """Pause after an action before the next screenshot."""
    wait_s: NonNegFloat = 5.0
    """Sleep of a ``wait()`` action before observing again."""
    episode_timeout_s: PositiveFloat = 1800.0
    """Wall-clock deadline of one episode's setup and steps (time waiting out a model
    outage excluded); the evaluation has its own."""
    evaluation_timeout_s: PositiveFloat = 300.0
    """Deadline of the final evaluation (after the episode's deadline)."""
    save_screenshots: bool = True
    """Store each step's screenshot."""


class RetentionConfig(_Section):
    """What a long run keeps of its screenshots (``storage.retention``; the sweeper,
    cua_rollout/runtime/retention.py; costs in docs/results_format.md). An episode is
    *released* once its group is acked in the trainer's index (with ``storage.index``), or
    once its results line is written (without one); the policy then decides, per released
    episode, whether its step images go or stay (re-encoded by ``reencode``). Never
    before: un-acked training data is not removed. The defaults keep everything as
    written, and no sweeper runs."""

    images: Literal["keep", "after_ack", "failures", "successes", "sample"] = "keep"
    """Whose images stay once released. ``keep``: all; ``after_ack``: none (removed once
    its group's ack is in; needs ``storage.index``); ``failures``: only episodes whose status
    is not ``success`` (failure, max_steps, timeout, infra_error); ``successes``: only
    ``success`` ones;
    ``sample``: a ``sample_fraction`` of episodes, chosen by a hash of the episode id (the
    same episodes on every sweep and every rerun)."""
    sample_fraction: Annotated[float, Field(ge=0.0, le=1.0)] = 0.1
    """With ``images: sample``: the share of episodes whose images stay."""
    reencode: Literal["none", "png_max", "webp"] = "none"
    """Released images that stay: ``none`` as written; ``png_max``: PNG re-compressed at
    zlib level 9 with ``optimize`` (lossless: the same pixels, the same file names);
    ``webp``: lossy WebP at ``webp_quality``, ``step_<n>.webp`` in place of
    ``step_<n>.png`` (the episode's marker maps the names)."""
    webp_quality: Annotated[int, Field(ge=1, le=100)] = 80
    """WebP quality with ``reencode: webp``."""
    max_gb: PositiveFloat | None = None
    """Budget of the run directory in GB (1e9 bytes). Null: released images the policy lets
    go are removed at the next sweep. Set: they are kept while the run directory fits and
    removed oldest released first when it does not; a run directory over budget with
    nothing removable is a warning (log and storage stats), never a deletion of un-acked
    data."""
    sweep_interval_s: PositiveFloat = 60.0
    """Time between two sweeps (each handles only what is new since the last one)."""

    @property
    def active(self) -> bool:
        """Whether a sweeper has anything to do."""
        return self.images != "keep" or self.reencode != "none" or self.max_gb is not None


class StorageConfig(_Section):
    """Asynchronous writes of trajectories and results."""

    queue_max_items: PositiveInt = 512
    """Bound of the write queue; writers wait when it is full (backpressure)."""
    save_messages: bool = True
    """Store the final request's chat messages (images as file references) per episode."""
    fsync: bool = False
    """fsync every file, append and rename (and the directories holding them) before an
    episode's results.jsonl line counts as written: slower, survives power loss, not just
    crashes."""
    index: bool = True
    """Keep the trainer's index of episodes and groups in a database (``python -m
    cua_rollout.training``; docs/training.md). The files stay the source of truth."""
    database_url: str | None = None
    """SQLAlchemy URL of that index (``postgresql+psycopg://user@host:5432/db`` for several
    machines). Null: SQLite (WAL) at ``<run>/index.db``. No password here: see
    ``database_password_env``."""
    database_password_env: str | None = None
    """The environment variable holding the database password (null: none)."""
    step_files: Literal["auto", "runner", "storage"] = "auto"
    """Who writes the screenshots and traj.jsonl lines. ``runner``: each runner process,
    straight into the run directory, which must then be at the same path on every node (a
    shared filesystem: NFS, CephFS, a ReadWriteMany volume); a runner that cannot see it
    stops the run. ``storage``: every step travels to the storage actor, which writes it on
    the driver's node (no shared filesystem needed; one process carries every step's bytes).
    ``auto``: ``runner`` for each runner process that finds the run directory (a probe file
    the storage writes at start), ``storage`` for the others."""
    retention: RetentionConfig = RetentionConfig()
    """What a long run keeps of its screenshots, within a disk budget (defaults: all)."""

    @model_validator(mode="after")
    def _retention_needs_an_index(self) -> StorageConfig:
        if self.retention.images == "after_ack" and not self.index:
            raise ValueError("storage.retention.images: after_ack needs storage.index: true "
                             "(acks are read from the trainer's index)")
        return self

    @model_validator(mode="after")
    def _no_password_in_url(self) -> StorageConfig:
        url = self.database_url
        if url is not None:
            if "://" not in url:
                raise ValueError(f"storage.database_url {url!r} is not a URL "
                                 "(dialect+driver://user@host:port/database)")
            if urlsplit(url).password:
                raise ValueError("storage.database_url holds a password: remove it and name "
                                 "the variable holding it in storage.database_password_env")
        return self


class PyToolConfig(_Section):
    """The ``py`` mode's Python sandbox (cua_rollout/text/sandbox.py): each call runs in a fresh
    process of its own, without network, seeing only its episode's scratch directory."""

    timeout_s: PositiveFloat = 10.0
    """Wall-clock limit of one call; past it the snippet and all it started are killed."""
    memory_mb: Annotated[int, Field(ge=64)] = 512
    """Address-space limit of the snippet's processes (the interpreter alone needs ~30 MB)."""
    max_output_bytes: PositiveInt = 16384
    """Kept of each of stdout and stderr; a snippet writing far beyond it is killed."""
    max_processes: Annotated[int, Field(ge=2)] = 32
    """Processes and threads the snippet may have at once, its interpreter included (a fork
    bomb stops here)."""
    max_file_mb: PositiveInt = 64
    """Largest file the snippet may write."""
    max_scratch_mb: PositiveInt = 256
    """Size of the episode's scratch directory; past it the snippet is killed."""
    max_scratch_files: PositiveInt = 10000
    """Entries of the scratch directory; past them the snippet is killed."""
    tmp_mb: PositiveInt = 64
    """The in-memory /tmp (and /dev/shm) of a call."""
    scratch_root: Path | None = None
    """Where the episodes' scratch directories are made (null: the system's temp dir)."""


RAG_MODELS: dict[str, int] = {
    "wordllama/l2_supercat_256": 256,
    "wordllama/l2_supercat_128": 128,
    "wordllama/l2_supercat_64": 64,
}
"""The embedding models ``text.rag.model`` may name, and their dimensions: all three are the
one 256-dimension model wordllama's wheel ships, the smaller ones its Matryoshka prefixes."""
RAG_DEFAULT_MODEL = "wordllama/l2_supercat_256"
"""The embedding model of ``text.rag.model: null``."""
RAG_MAX_TOP_K = 20
"""The most passages one retrieval returns."""


class RagToolConfig(_Section):
    """The ``rag`` mode's retrieval tool (cua_rollout/text/rag.py). Frozen, so hashable: the
    key of a process's shared retriever."""

    model_config = ConfigDict(frozen=True)

    corpus: Path | None = None
    """A JSONL file of ``{id, title?, text}`` passages, or a directory of .txt/.md files
    (searched recursively, hidden names skipped)."""
    top_k: Annotated[int, Field(ge=1, le=RAG_MAX_TOP_K)] = 3
    """Passages a search returns unless the call asks for another number."""
    model: str | None = None
    """The embedding model, one of ``RAG_MODELS`` (null: ``RAG_DEFAULT_MODEL``;
    docs/text_modes.md)."""
    chunk_chars: Annotated[int, Field(ge=100)] = 1200
    """Longer texts are split at paragraph, then sentence, then word boundaries into chunks of
    this size."""
    max_result_chars: Annotated[int, Field(ge=100)] = 4000
    """Of passage text returned to the model per call; the last passage that does not fit is
    cut."""
    retrieval: Literal["hybrid", "dense", "bm25"] = "hybrid"
    """``dense``: the embedding model's cosine similarity; ``bm25``: shared words;
    ``hybrid``: a weighted sum of both (docs/text_modes.md)."""
    dense_weight: float = Field(0.8, ge=0.0, le=1.0)
    """``hybrid``: the weight of the dense score; BM25's is the rest."""
    cache_dir: Path | None = Path(".cache/rag")
    """Embeddings and index, cached by a hash of the corpus, model and chunking (null: none)."""

    @model_validator(mode="after")
    def _known_model(self) -> RagToolConfig:
        if self.model is not None and self.model not in RAG_MODELS:
            raise ValueError(f"text.rag.model: unknown embedding model {self.model!r}; known: "
                             f"{', '.join(RAG_MODELS)}")
        return self


class WebToolConfig(_Section):
    """The ``web`` mode's search and page-fetch tools (cua_rollout/text/web.py)."""

    backend: Literal["corpus", "serper", "brave"] = "corpus"
    """``corpus``: a web corpus server's /search (``serve_corpus`` or ``search_url``);
    ``serper`` / ``brave``: those search APIs (a key in ``api_key_env``)."""
    search_url: str | None = None
    """The search server's base URL (corpus), or another endpoint for an API backend."""
    api_key_env: str | None = None
    """The environment variable holding the search API's key (never the key itself)."""
    serve_corpus: Path | None = None
    """A directory of pages the driver serves on loopback for the run (the demo's web):
    search and pages over real HTTP; sets ``search_url``."""
    top_k: PositiveInt = 5
    """Results a search returns unless the call asks for another number."""
    request_timeout_s: PositiveFloat = 10.0
    """Whole deadline of one search or fetch."""
    max_page_bytes: PositiveInt = 2_000_000
    """Of a page downloaded; the rest is not read."""
    max_page_chars: PositiveInt = 8000
    """Of a page's text returned to the model."""
    max_redirects: NonNegInt = 5
    allow_private: bool = False
    """Let fetch reach loopback, private, link-local and other non-public addresses. Off: the
    model cannot read the machine's or its network's own services through ``fetch`` (the
    search backend's own host and port are always reachable; search itself is not guarded:
    it calls only its configured URL)."""
    allow_hosts: list[str] = []
    """Non-public hosts fetch may reach all the same: ``host`` (any port),
    ``host:port`` or a CIDR network (``10.1.0.0/16``)."""

    @model_validator(mode="after")
    def _where(self) -> WebToolConfig:
        if self.allow_hosts:
            try:
                for entry in self.allow_hosts:
                    host_entry(entry, "text.web.allow_hosts")
            except ConfigError as exc:  # names the malformed entry
                raise ValueError(str(exc)) from None
        if self.serve_corpus is not None and self.search_url is not None:
            raise ValueError("text.web.serve_corpus serves the run's own corpus and sets the "
                             "search URL: it excludes text.web.search_url")
        if self.backend != "corpus" and self.serve_corpus is not None:
            raise ValueError(f"text.web.serve_corpus needs backend 'corpus', not "
                             f"{self.backend!r}")
        if self.backend != "corpus" and self.api_key_env is None:
            raise ValueError(f"text.web.backend {self.backend!r} needs text.web.api_key_env, "
                             "the variable holding the API key")
        return self


class TextConfig(_Section):
    """Text environments (``math``, ``py``, ``rag``, ``web``; tasks.mode / tasks.benchmarks):
    the tool-calling agent and the tools of each mode."""

    max_turns: PositiveInt = 10
    """Model replies per episode; an episode without a final answer by then ends as
    ``max_steps`` (scored with no answer: 0)."""
    max_tool_calls_per_turn: PositiveInt = 8
    """Tool calls of one reply that are run (parallel calls run concurrently); the rest are
    answered with an error."""
    tool_timeout_s: PositiveFloat = 60.0
    """Outer deadline of one tool call (each tool has its own, shorter limits)."""
    tool_choice: Literal["auto", "required"] = "auto"
    """Sent with the tools: ``required`` forces a tool call on every turn (vLLM's structured
    outputs), ``auto`` lets the model answer."""
    final_answer_tool: bool = True
    """Offer an ``answer`` tool whose argument is the final answer (besides a plain reply)."""
    system_prompt: str | None = None
    """Replaces the mode's system prompt (cua_rollout/agents/tool.py: SYSTEM_PROMPTS)."""
    judge: ModelConfig | None = None
    """The judge model of ``llm_judgement`` (its own endpoints, ``name`` of the model they
    serve, which must be given, and key variable); null: the run's model (``model``)."""
    py: PyToolConfig = PyToolConfig()
    rag: RagToolConfig = RagToolConfig()
    web: WebToolConfig = WebToolConfig()

    @model_validator(mode="after")
    def _judge_named(self) -> TextConfig:
        # model.name's default is the UI-TARS model, which a judge's server rarely serves:
        # a judge without a name would fail every judgement with "model not found".
        if self.judge is not None and "name" not in self.judge.model_fields_set:
            raise ValueError("text.judge.name is not set: name the model the judge's "
                             "endpoints serve")
        return self


class ServiceTenantConfig(_Section):
    """One tenant of the desktop service: who holds which token, and how many desktops at
    once."""

    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")
    """The tenant's name (in ``/status``, the metrics' labels and error messages)."""
    token_env: str = Field(min_length=1)
    """The environment variable holding the tenant's bearer token (read when the service
    starts; unset is an error)."""
    max_leases: PositiveInt = 1
    """The tenant's concurrency quota: leases held at once. One more waits (fairly, in
    arrival order) up to its ``wait_s``, then gets 429 ``over_quota``."""


class ServiceConfig(_Section):
    """The desktop service (``cua-rollout desktops serve``, ``cua_rollout/service/``): the
    pool of ``desktops`` behind an HTTP API for tenants outside a run (docs/desktop_service.md)."""

    host: str = "127.0.0.1"
    """Address the service binds."""
    port: Annotated[int, Field(ge=0, le=65535)] = 8790
    """Port the service binds (0: a free one, printed when it starts)."""
    tenants: list[ServiceTenantConfig] = []
    """Who may lease (the service refuses to start without one)."""
    operator_token_env: str | None = None
    """The environment variable holding the operator's token: ``/status`` of everything,
    ``/v1/desktops`` and its actions (``scripts/desktops.py --service``). Null: no operator."""
    allow: list[str] = []
    """Addresses allowed to call (IPs, CIDR networks, host names resolved at start); empty:
    every address. ``/healthz`` is open to all."""
    default_access: Literal["direct", "relay"] = "direct"
    """How a lease's client reaches its desktop's own server unless it asks: ``direct`` (the
    desktop's URL with a per-lease token: needs ``desktops.token_env``) or ``relay`` (through
    the service, with the tenant's token)."""
    direct_host: str | None = None
    """The host put into direct URLs in place of a desktop's loopback address (desktops bound
    to 127.0.0.1 are reached by other hosts through this name). Null: the URL as it is."""
    lease_ttl_s: PositiveFloat = 120.0
    """A lease with no call (heartbeat or any other) for this long expires: its desktop is
    reset and lent again."""
    default_wait_s: Annotated[float, Field(ge=0)] = 30.0
    """How long a lease waits for quota and a free desktop when the request names no
    ``wait_s``."""
    max_wait_s: Annotated[float, Field(ge=0)] = 600.0
    """The longest wait a lease request may ask for (longer is capped)."""
    max_body_bytes: PositiveInt = 64 * 1024 * 1024
    """Largest request body (413 ``too_large`` beyond it, said before it is read)."""
    action_pause_s: Annotated[float, Field(ge=0)] = 0.5
    """Pause after an action before its observation, unless the request names one."""

    @model_validator(mode="after")
    def _consistent(self) -> ServiceConfig:
        for index, entry in enumerate(self.allow):
            try:
                host_entry(entry, f"service.allow[{index}]")
            except ConfigError as exc:
                raise ValueError(str(exc)) from None
        names = [t.name for t in self.tenants]
        if len(set(names)) != len(names):
            raise ValueError(f"service.tenants: names must be distinct, got {names}")
        envs = [t.token_env for t in self.tenants]
        if len(set(envs)) != len(envs):
            raise ValueError("service.tenants: two tenants name the same token_env")
        if self.default_wait_s > self.max_wait_s:
            raise ValueError(f"service.default_wait_s ({self.default_wait_s:g}) exceeds "
                             f"service.max_wait_s ({self.max_wait_s:g})")
        return self


class MonitoringConfig(_Section):
    """What the user sees while a run goes on."""

    progress_bar: bool = True
    """Show the rich progress bar in the terminal."""
    metrics_interval_s: PositiveFloat = 5.0
    """Sampling period of ``metrics.jsonl``."""
    ray_metrics: bool = True
    """Export ``rollout_*`` metrics to the Ray dashboard / Prometheus."""
    tracker: Literal["none", "mlflow"] = "none"
    """Log the run's summary and curves to an experiment tracker at its end
    (``cua_rollout/results/trackers.py``; needs the ``trackers`` extra)."""
    tracker_uri: str | None = None
    """The tracker's URI (MLflow: ``sqlite:///path/mlflow.db`` for a local store, or a
    server's URL); null: the ``MLFLOW_TRACKING_URI`` environment variable."""
    tracker_experiment: str = Field("cua-rollout", min_length=1)
    """The experiment the run is logged under (the run's name names the tracker's run)."""
    status_address: str | None = "127.0.0.1"
    """Where the driver answers ``GET /healthz`` and ``GET /status`` while the run goes on
    (``cua_rollout/runtime/status.py``): ``host:port``, ``[v6]:port``, or a host alone for a
    free port (its URL is logged and written to ``<run>/status.url``); null: not served. On by
    default, on loopback: a run that goes on for days should answer "are you alive, what are
    you doing" without anyone reading its log, and loopback needs no token. Off loopback
    (a probe from the kubelet, an operator's dashboard) ``status_token_env`` is required."""
    status_token_env: str | None = None
    """The environment variable holding the bearer token ``/status`` requires (``/healthz``
    stays open: it says only ok or not, and a kubelet probe cannot hold a secret). Null: no
    token, allowed on loopback only."""
    stall_s: PositiveFloat | None = 900.0
    """A run with episodes running or queued and no progress (no episode finished, the step
    counter unchanged) for this long is stalled: the progress line, ``/status`` and
    ``/healthz`` say so. Time in an outage wait (the model or desktops down: the run waits by
    design) does not count. Null: never stalled."""

    @model_validator(mode="after")
    def _status_token_beyond_loopback(self) -> MonitoringConfig:
        if self.status_address is None:
            return self
        try:
            host, _ = status_bind(self.status_address)
        except ConfigError as exc:  # names the malformed address
            raise ValueError(str(exc)) from None
        if self.status_token_env is None and not is_loopback(host):
            raise ValueError(
                f"monitoring.status_address {self.status_address!r} is reachable from other "
                "hosts: set monitoring.status_token_env to the variable holding the bearer "
                "token /status requires, or bind 127.0.0.1")
        return self


def status_bind(address: str) -> tuple[str, int]:
    """``monitoring.status_address`` as the host and port to bind (0: a free port). Raises
    ``ConfigError`` naming the key when it is no ``host[:port]``."""
    key = "monitoring.status_address"
    entry = host_entry(address, key)
    if isinstance(entry, tuple):
        return entry[0], entry[1] or 0
    if entry.num_addresses != 1:  # a CIDR network: no address to bind
        raise ConfigError(f"{key}: {address!r} is a network, not a host or host:port")
    return str(entry.network_address), 0


class Removed(NamedTuple):
    """A key that is gone from the schema, and why (in :data:`MOVED_KEYS`)."""

    why: str


class Elsewhere(NamedTuple):
    """A key that moved to another section: its whole new path (in :data:`MOVED_KEYS`)."""

    key: str


_SCRIPTED_KNOB = ("a demo knob of the scripted policy, not of a run: serve the policy yourself "
                  "(python -m cua_rollout.agents.scripted_policy --error-rate/--latency-s, or "
                  "cua_rollout.runtime.launch.scripted_policy_server) and point "
                  "model.endpoints at it")

MOVED_KEYS: dict[type[BaseModel], dict[str, str | Removed | Elsewhere]] = {
    ModelConfig: {
        "backoff_initial_s": "backoff.initial_s",
        "backoff_max_s": "backoff.max_s",
        "scripted_error_rate": Removed(_SCRIPTED_KNOB),
        "scripted_latency_s": Removed(_SCRIPTED_KNOB),
        # The agent's settings (cua_rollout/agents/) have a section of their own.
        "family": Elsewhere("agent.name"),
        **{k: Elsewhere(f"agent.{k}") for k in ("min_pixels", "max_pixels",
                                                "constrain_actions")},
    },
    RunnerConfig: {k: Elsewhere(f"agent.{k}") for k in (
        "history_images", "history_texts", "max_parse_retries", "call_user",
        "call_user_max_waits", "prompt_call_user", "prompt_language", "prompt_note")},
    ModelPoolConfig: {
        "restart_backoff_initial_s": "restart_backoff.initial_s",
        "restart_backoff_max_s": "restart_backoff.max_s",
    },
    CoordinatorConfig: {
        "outage_backoff_initial_s": "outage_backoff.initial_s",
        "outage_backoff_max_s": "outage_backoff.max_s",
    },
}
"""Keys of earlier schemas, per section: where each went (relative to its section), or why it
was removed. A config naming one fails with that, not with "unknown key" (``Config``)."""


def _moved_keys(model: type[BaseModel], data: Any, prefix: str) -> list[str]:
    """What the moved keys in ``data`` (a section of type ``model`` at ``prefix``) became."""
    if not isinstance(data, dict):
        return []
    found = []
    for key, value in data.items():
        moved = MOVED_KEYS.get(model, {}).get(key)
        if isinstance(moved, Removed):
            found.append(f"{prefix}{key} was removed: {moved.why}")
        elif isinstance(moved, Elsewhere):
            found.append(f"{prefix}{key} moved: it is {moved.key} now")
        elif moved is not None:
            found.append(f"{prefix}{key} moved: it is {prefix}{moved} now")
        elif key in model.model_fields:
            sub = _model_in(model.model_fields[key].annotation)
            if sub is not None:
                found += _moved_keys(sub, value, f"{prefix}{key}.")
    return found


class Config(_Section):
    """The whole configuration: one section per component."""

    run: RunConfig = RunConfig()
    ray: RayConfig = RayConfig()
    tasks: TasksConfig = TasksConfig()
    model: ModelConfig = ModelConfig()
    model_pool: ModelPoolConfig = ModelPoolConfig()
    desktops: DesktopsConfig = DesktopsConfig()
    coordinator: CoordinatorConfig = CoordinatorConfig()
    agent: AgentConfig = AgentConfig()
    runner: RunnerConfig = RunnerConfig()
    evaluation: EvaluationConfig = EvaluationConfig()
    storage: StorageConfig = StorageConfig()
    monitoring: MonitoringConfig = MonitoringConfig()
    text: TextConfig = TextConfig()
    service: ServiceConfig = ServiceConfig()

    @model_validator(mode="before")
    @classmethod
    def _no_moved_keys(cls, data: Any) -> Any:
        found = _moved_keys(cls, data, "")
        if found:
            raise PydanticCustomError("moved_key", "\n".join(found))
        return data

    @model_validator(mode="after")
    def _consistent(self) -> Config:
        sources = [k for k, v in (("model.scripted", self.model.scripted),
                                  ("model.endpoints", self.model.endpoints),
                                  ("model.endpoints_url", self.model.endpoints_url)) if v]
        if len(sources) > 1:
            raise ValueError(f"{' and '.join(sources)} exclude each other; set one")
        if self.model.endpoints_url is not None and not self.model.endpoints_url.startswith(
                ("http://", "https://")):
            raise ValueError(f"model.endpoints_url {self.model.endpoints_url!r} is not an "
                             "http(s) URL (http://HOST:PORT/endpoints)")
        if self.model_pool.start_with_run:
            if sources:
                raise ValueError("model_pool.start_with_run starts the run's own model pool; "
                                 f"it excludes {sources[0]}")
            if not self.model_pool.checkpoint:
                raise ValueError("model_pool.start_with_run needs model_pool.checkpoint")
        if self.model.images == "file" and (not self.runner.save_screenshots
                                            or self.storage.step_files == "storage"):
            raise ValueError(
                "model.images: file sends the paths of the screenshots the runners write: it "
                "needs runner.save_screenshots: true and storage.step_files auto or runner")
        if self.desktops.provider == "static" and not self.desktops.static.urls:
            raise ValueError("desktops.provider is 'static' but desktops.static.urls is empty")
        # A lease is reclaimed after lease_max_s; it must outlive everything an episode does
        # while holding it, or a live episode's desktop is reset and lent to another one.
        held_s = (self.runner.episode_timeout_s + self.model.outage_wait_s
                  + self.runner.evaluation_timeout_s + LEASE_MARGIN_S)
        if self.desktops.lease_max_s <= held_s:
            raise ValueError(
                f"desktops.lease_max_s ({self.desktops.lease_max_s:g}) must exceed "
                f"runner.episode_timeout_s + model.outage_wait_s + "
                f"runner.evaluation_timeout_s + {LEASE_MARGIN_S:g} s ({held_s:g}): a lease "
                "reclaimed while its episode runs hands the desktop to a second episode")
        pool = self.model_pool
        dev_mode = pool.reload_in_place or pool.env.get("VLLM_SERVER_DEV_MODE", "0") not in (
            "", "0")
        if dev_mode and not pool.dev_mode_on_network and not is_loopback(pool.host):
            raise ValueError(
                f"model_pool.reload_in_place (or env VLLM_SERVER_DEV_MODE) starts vLLM's "
                f"unauthenticated dev endpoints, and "
                f"model_pool.host {pool.host!r} is not loopback: set "
                "model_pool.reload_in_place: false, or model_pool.dev_mode_on_network: true "
                "on a trusted network")
        if not is_loopback(pool.host) and pool.api_key_env is None:
            raise ValueError(
                f"model_pool.host {pool.host!r} is reachable from other hosts: set "
                "model_pool.api_key_env to the variable holding the key its replicas require "
                "(and model.api_key_env for the client), or bind 127.0.0.1")
        if pool.api_key_env is not None and self.model.api_key_env is None \
                and not self.model.scripted:
            raise ValueError("model_pool.api_key_env makes the replicas require a key: set "
                             "model.api_key_env to the variable the model client reads it from")
        return self

    @property
    def run_dir(self) -> Path:
        """``<output_dir>/<name>``: where this run's results live."""
        return self.run.output_dir / self.run.name


# --------------------------------------------------------------------------- secrets


def secret_from_env(var_name: str | None, key_path: str) -> str | None:
    """The secret held by the environment variable a config key names (None if unnamed).

    A named but unset variable is a ``ConfigError``: a run must not start without its key.
    """
    if var_name is None:
        return None
    value = os.environ.get(var_name)
    if not value:
        raise ConfigError(f"{key_path} names ${var_name}, which is not set in the environment")
    return value


# --------------------------------------------------------------------------- loading


def load_config(path: str | os.PathLike[str] | None, overrides: list[str] | None = None) -> Config:
    """Load and validate a YAML config; ``overrides`` are ``a.b.c=value`` strings.

    Any problem raises one ``ConfigError`` naming the file and every bad key path.
    """
    where = str(path) if path is not None else "<defaults>"
    data: dict[str, Any] = {}
    if path is not None:
        p = Path(path)
        try:
            text = p.read_text(encoding="utf-8")
        except FileNotFoundError:
            raise ConfigError(f"{where}: config file not found") from None
        except OSError as exc:
            raise ConfigError(f"{where}: cannot read config file: {exc.strerror}") from exc
        try:
            loaded = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            raise ConfigError(f"{where}: not valid YAML: {exc}") from exc
        if loaded is None:
            loaded = {}
        if not isinstance(loaded, dict):
            raise ConfigError(f"{where}: the top level must be a mapping of sections")
        data = loaded
    for item in overrides or []:
        _apply_override(data, item, where)
    try:
        return Config.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(_format_errors(exc, where, overrides or [])) from None


def add_config_arguments(parser: argparse.ArgumentParser, *, required: bool = True,
                         default: str | None = None) -> None:
    """The ``--config`` and ``--set`` options every command of the project shares (optional
    when ``required`` is false: ``default``, or the defaults when that is None)."""
    parser.add_argument("--config", "-c", required=required, default=default,
                        help="YAML config file" + (f" (default: {default or 'the defaults'})"
                                                   if not required else ""))
    parser.add_argument(
        "--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
        help="override a config key, e.g. --set coordinator.max_concurrent_episodes=16")


def config_from_args(args: argparse.Namespace) -> Config:
    """The config ``add_config_arguments``' options name, or exit 2 with the error on
    stderr."""
    try:
        return load_config(args.config, args.overrides)
    except ConfigError as exc:
        print(f"config error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None


def _format_errors(exc: ValidationError, where: str, overrides: list[str]) -> str:
    overridden = {o.split("=", 1)[0].strip() for o in overrides}
    lines = []
    for err in exc.errors():
        if err["type"] == "moved_key":  # one line per key, each starting with its path
            lines += [f"  {line}{' (from --set)' if line.split()[0] in overridden else ''}"
                      for line in err["msg"].splitlines()]
            continue
        key = ".".join(str(p) for p in err["loc"]) or "<top level>"
        if err["type"] == "extra_forbidden":
            msg = "unknown key"
        else:
            msg = err["msg"]
            if "input" in err and err["type"] not in ("missing",) and not isinstance(
                err["input"], dict
            ):
                msg += f" (got {err['input']!r})"
        source = " (from --set)" if key in overridden else ""
        lines.append(f"  {key}: {msg}{source}")
    count = len(lines)
    head = f"{where}: invalid config ({count} error{'s' if count > 1 else ''})"
    return "\n".join([head, *lines])


def _apply_override(data: dict[str, Any], item: str, where: str) -> None:
    if "=" not in item:
        raise ConfigError(f"--set {item!r}: expected key.path=value")
    key, raw = (s.strip() for s in item.split("=", 1))
    parts = key.split(".")
    if not all(parts):
        raise ConfigError(f"--set {item!r}: empty part in key path {key!r}")
    annotation = _field_annotation(parts, key, where)
    node = data
    for depth, part in enumerate(parts[:-1]):
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            bad = ".".join(parts[: depth + 1])
            raise ConfigError(f"{where}: {bad} is not a section (needed by --set {key})")
        node = child
    node[parts[-1]] = raw if _is_text(annotation) else _yaml_scalar(raw, key)


def _field_annotation(parts: list[str], key: str, where: str) -> Any:
    """The schema type at a key path; an unknown key is an error naming it."""
    model: type[BaseModel] = Config
    for depth, part in enumerate(parts):
        path = ".".join(parts[: depth + 1])
        if part in MOVED_KEYS.get(model, {}):
            return Any  # set as given: validation says where the key went
        if part not in model.model_fields:
            known = ", ".join(sorted(model.model_fields))
            raise ConfigError(f"--set {key}: unknown key {path!r} (known here: {known})")
        annotation = model.model_fields[part].annotation
        if depth == len(parts) - 1:
            return annotation
        sub = _model_in(annotation)
        if sub is not None:
            model = sub
        elif _is_mapping(annotation):
            return str  # a free-form mapping such as model_pool.env: its values are text
        else:
            raise ConfigError(f"--set {key}: {path} is a value, not a section")
    raise AssertionError("unreachable")


def _unwrap(annotation: Any) -> list[Any]:
    origin = typing.get_origin(annotation)
    if origin is Annotated:
        return _unwrap(typing.get_args(annotation)[0])
    if origin in (typing.Union, types.UnionType):
        return [t for a in typing.get_args(annotation) for t in _unwrap(a)]
    return [annotation]


def _model_in(annotation: Any) -> type[BaseModel] | None:
    for t in _unwrap(annotation):
        if isinstance(t, type) and issubclass(t, BaseModel):
            return t
    return None


def _is_mapping(annotation: Any) -> bool:
    return any(typing.get_origin(t) is dict for t in _unwrap(annotation))


def _is_text(annotation: Any) -> bool:
    """True for str / Path fields: their override value is taken verbatim, not as YAML."""
    kinds = [t for t in _unwrap(annotation) if t is not type(None)]
    return bool(kinds) and all(t in (str, Path) for t in kinds)


def _yaml_scalar(raw: str, key: str) -> Any:
    try:
        return yaml.safe_load(raw) if raw != "" else None
    except yaml.YAMLError as exc:
        raise ConfigError(f"--set {key}: value {raw!r} is not valid YAML: {exc}") from exc
