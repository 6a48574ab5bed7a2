"""Config schema: every section loads from YAML, typos and bad values fail with their key path."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

import cua_rollout.config as config_module
from cua_rollout.config import Config, load_config, secret_from_env
from cua_rollout.core.errors import ConfigError
from tests.support import REPO_ROOT

ROOT = REPO_ROOT

FULL = """
run: {name: exp-1, output_dir: out, seed: 7, log_level: DEBUG}
ray: {address: auto, namespace: ns, num_cpus: 2, include_dashboard: false,
      dashboard_host: 127.0.0.1, dashboard_port: 8266, working_dir: ., task_events_kept: 5000,
      log_rotation_mb: 32, log_backups: 1}
tasks:
  source: tasks/demo/test_all.json
  examples_dir: tasks/demo/examples
  domains: [os, calc]
  task_ids: [a, b]
  rollouts_per_task: 8
  poll_interval_s: 30
  dynamic_rollouts: {enabled: true, threshold: 0.75, min_n: 2, window: 8}
  rerun_infra_errors: false
  failed_group_reruns: 1
  passes: 3
  checkpoint_barrier: {enabled: true, timeout_s: 600}
  mode: desktop
  metric: f1_score
  metric_variant: original
  benchmarks:
    - {source: bench/gsm.jsonl, mode: py, metric: numeric_match, metric_variant: original,
       numeric_tolerance: 0.01, name: gsm-py}
model:
  name: ui-tars-1.5-7b
  endpoints: ["http://127.0.0.1:8000", "http://127.0.0.1:8001"]
  endpoints_url: null  # excludes endpoints
  version: ckpt-7
  api_key_env: MY_KEY
  scripted: false
  sampling: {temperature: 0.0, top_p: 1.0, max_tokens: 1000, frequency_penalty: 1,
             logprobs: true, return_token_ids: true, seed: 3}
  request_timeout_s: 60
  connect_timeout_s: 2
  retries: 10
  backoff: {initial_s: 1, max_s: 30}
  outage_wait_s: 120
  routing: least_outstanding
  sticky_max_extra_outstanding: 2
  max_connections_per_endpoint: 64
  images: inline   # file needs step files by the runners (below: storage)
  endpoint_failures_to_eject: 5
  reprobe_interval_s: 3
model_pool:
  checkpoint: /ckpt/step-100
  replicas: 4
  tensor_parallel_size: 2
  gpu_ids: [0, 1, 2, 3, 4, 5, 6, 7]
  host: 0.0.0.0
  base_port: 9000
  control_port: 8099
  state_dir: /tmp/pool
  extra_args: ["--max-model-len", "32768", "--limit-mm-per-prompt", "image=5"]
  env: {VLLM_SERVER_DEV_MODE: "1"}
  startup_timeout_s: 600
  health_interval_s: 2
  restart_backoff: {initial_s: 1, max_s: 60}
  reload_batch: 2
  drain_timeout_s: 120
  drain_grace_s: 1.5
  reload_in_place: false
  dev_mode_on_network: true
  health_timeout_s: 2
  health_failures_to_restart: 5
  stop_timeout_s: 10
  watch_interval_s: 5
  cpu_kv_cache_space_gib: 1
  cpu_threads_per_replica: 2
  cpu_enforce_eager: false
  max_model_len: 16384
  api_key_env: POOL_KEY
  vlm_cpu_site: /opt/vlm-site
  start_with_run: false
desktops:
  provider: static
  apps: [chrome, vs_code]
  node: 10.0.0.9
  shards: 2
  count: 3
  warm_spares: 0
  screen_width: 1280
  screen_height: 720
  lease_timeout_s: 90
  lease_max_s: 7200
  reset_timeout_s: 30
  health_interval_s: 5
  request_timeout_s: 20
  setup_timeout_s: 100
  max_connections: 100
  retries: 3
  token_env: DESKTOP_TOKEN
  client_password_env: VM_PASSWORD
  download_cache_dir: /data/cache
  task_file_roots: [/data/osworld]
  offline: true
  download_timeout_s: 30
  chromium_port: 9333
  vlc_port: 8081
  accounts_dir: /data/osworld/settings
  local: {state_dir: /tmp/d, window_manager: openbox, home_template: /tmp/home, start_timeout_s: 30,
          host: 10.0.0.9}
  static: {urls: ["http://10.0.0.1:5000", "http://10.0.0.2:5000"], reset_command: [bash, reset.sh],
           retry_quarantined_s: 60, reset: command, reset_url: "http://vm-manager/reset"}
  verify: {enabled: false, home_depth: 3, ignore_paths: [snap], ignore_processes: [tracker],
           screenshot_max_distance: 4, timeout_s: 10}
  container: {engine: podman, image: "localhost/cua-desktop:osworld", cpus: 2, memory: 3g,
              publish_host: 127.0.0.1, network: cua, runtime: runc, extra_args: [--shm-size, 1g],
              start_timeout_s: 45}
  kubernetes: {namespace: rollout, image: desk:1, service_account: sa, cpu: "2", memory: 4Gi,
               port: 5000, startup_timeout_s: 200, pod_template: deploy/kubernetes/desktop-pod.yaml,
               node_selector: {pool: desktops}, tolerations: [{key: gpu, operator: Exists}],
               image_pull_secrets: [regcred], labels: {team: agents}, token_secret: desk-token,
               token_secret_key: tok, service_per_pod: true, kubeconfig: /k/config,
               context: lab, api_timeout_s: 10, api_outage_s: 60, heartbeat_interval_s: 10,
               heartbeat_timeout_s: 60, reset: vm}
  vm: {image: /vm/Ubuntu.qcow2, image_format: qcow2, firmware: uefi,
       ovmf_code: /ovmf/CODE.fd, ovmf_vars: /ovmf/VARS.fd, memory_mb: 2048, cpus: 2, accel: tcg,
       server_port: 5001, chromium_port: 9223, vlc_port: 8081, bind_host: 0.0.0.0,
       state_dir: /tmp/vms, ready_state_dir: /data/vm-states, boot_timeout_s: 600,
       ready_still_s: 2, start_timeout_s: 60, kernel: /vm/vmlinuz, initrd: /vm/initrd,
       append: console=ttyS0}
  remote: {kind: cua, urls: ["http://envs:8700"], token_env: ENVS_TOKEN, access: relay,
           wait_s: 30, start_timeout_s: 300, request_timeout_s: 10,
           state_dir: /var/lib/cua/remote}
coordinator: {max_concurrent_episodes: 64, episodes_per_runner: 16, schedule: batch,
              max_retries: 3, runner_num_cpus: 0.5, outage_backoff: {initial_s: 2,
              max_s: 10}, outage_give_up_s: 600, batch_cutoff: 0.98, batch_grace_s: 30}
agent: {name: uitars-1.0, history_images: 3, history_texts: 10, max_parse_retries: 2,
        call_user: wait, call_user_max_waits: 2, prompt_call_user: false,
        prompt_language: Chinese, prompt_note: "sudo password is in the note",
        min_pixels: 3136, max_pixels: 1003520, constrain_actions: true,
        osworld_prompt: {observation_type: som, action_space: pyautogui,
                         max_trajectory_length: 2, a11y_tree_max_chars: 9000, password: null},
        qwen_computer_use: {coordinates: relative, send_tools: false, max_calls_per_reply: 3}}
runner: {max_steps: 15, action_pause_s: 0.5, wait_s: 2,
         episode_timeout_s: 600, evaluation_timeout_s: 60, save_screenshots: false}
evaluation: {engine: osworld, osworld_python: /opt/osw/bin/python, osworld_path: /src/OSWorld,
             worker_start_timeout_s: 30}
storage: {queue_max_items: 64, save_messages: false, fsync: true, index: true,
          database_url: "postgresql+psycopg://rollout@db:5432/rollout",
          database_password_env: DB_PASSWORD, step_files: storage,
          retention: {images: sample, sample_fraction: 0.2, reencode: webp, webp_quality: 70,
                      max_gb: 500, sweep_interval_s: 30}}
monitoring: {progress_bar: false, metrics_interval_s: 1, ray_metrics: false, tracker: mlflow,
             tracker_uri: "sqlite:///t/mlflow.db", tracker_experiment: exp,
             status_address: "127.0.0.1:8270", status_token_env: STATUS_TOKEN, stall_s: 600}
service:
  host: 0.0.0.0
  port: 8791
  tenants: [{name: team-a, token_env: TEAM_A_TOKEN, max_leases: 4}]
  operator_token_env: OPERATOR_TOKEN
  allow: [10.0.0.0/8, "127.0.0.1"]
  default_access: relay
  direct_host: desktops.example
  lease_ttl_s: 90
  default_wait_s: 10
  max_wait_s: 60
  max_body_bytes: 1000000
  action_pause_s: 0.2
text:
  max_turns: 4
  max_tool_calls_per_turn: 3
  tool_timeout_s: 20
  tool_choice: required
  final_answer_tool: false
  system_prompt: Answer.
  judge: null
  py: {timeout_s: 3, memory_mb: 256, max_output_bytes: 1000, max_processes: 8, max_file_mb: 4,
       max_scratch_mb: 16, max_scratch_files: 100, tmp_mb: 8, scratch_root: /tmp/scratch}
  rag: {corpus: corpus.jsonl, top_k: 2, model: wordllama/l2_supercat_64, chunk_chars: 500,
        max_result_chars: 900, cache_dir: null, retrieval: bm25, dense_weight: 0.5}
  web: {backend: serper, search_url: "http://127.0.0.1:9/search", api_key_env: SERPER_KEY,
        serve_corpus: null, top_k: 2, request_timeout_s: 3, max_page_bytes: 1000,
        max_page_chars: 500, max_redirects: 1, allow_private: false,
        allow_hosts: [wiki.lab, "10.1.0.0/16"]}
"""


def write(tmp_path: Path, text: str, name: str = "c.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def test_every_section_and_key_loads_from_yaml(tmp_path):
    cfg = load_config(write(tmp_path, FULL))
    # Each value differs from its default, so this proves the YAML reached every section.
    assert cfg.run.name == "exp-1" and cfg.run.output_dir == Path("out")
    assert cfg.ray.address == "auto" and cfg.ray.dashboard_port == 8266
    assert cfg.tasks.rollouts_per_task == 8 and cfg.tasks.dynamic_rollouts.threshold == 0.75
    assert cfg.agent.name == "uitars-1.0" and cfg.model.sampling.max_tokens == 1000
    assert cfg.model.endpoints == ["http://127.0.0.1:8000", "http://127.0.0.1:8001"]
    assert cfg.model_pool.replicas == 4 and cfg.model_pool.env == {"VLLM_SERVER_DEV_MODE": "1"}
    assert cfg.agent.max_pixels == 1003520 and cfg.agent.constrain_actions is True
    assert cfg.desktops.container.memory == "3g" and cfg.desktops.container.runtime == "runc"
    assert cfg.model_pool.max_model_len == 16384 and cfg.model_pool.control_port == 8099
    assert cfg.desktops.node == "10.0.0.9" and cfg.desktops.local.host == "10.0.0.9"
    assert cfg.desktops.shards == 2
    assert cfg.model_pool.vlm_cpu_site == Path("/opt/vlm-site")
    assert cfg.desktops.apps == ["chrome", "vs_code"]
    assert cfg.desktops.provider == "static" and cfg.desktops.static.reset_command == [
        "bash",
        "reset.sh",
    ]
    assert cfg.desktops.kubernetes.memory == "4Gi" and cfg.desktops.local.start_timeout_s == 30
    assert cfg.desktops.kubernetes.reset == "vm"
    assert cfg.coordinator.schedule == "batch" and cfg.coordinator.episodes_per_runner == 16
    assert cfg.agent.call_user == "wait" and cfg.agent.history_images == 3
    assert cfg.agent.osworld_prompt.observation_type == "som"
    assert cfg.agent.osworld_prompt.password is None
    assert cfg.agent.qwen_computer_use.coordinates == "relative"
    assert cfg.desktops.offline is True and cfg.desktops.chromium_port == 9333
    assert cfg.desktops.accounts_dir == Path("/data/osworld/settings")
    assert cfg.desktops.verify.enabled is False and cfg.desktops.verify.home_depth == 3
    assert cfg.desktops.static.reset == "command"
    assert cfg.desktops.remote.state_dir == Path("/var/lib/cua/remote")
    assert cfg.evaluation.engine == "osworld" and cfg.evaluation.worker_start_timeout_s == 30
    assert cfg.storage.fsync is True and cfg.monitoring.metrics_interval_s == 1
    assert cfg.storage.step_files == "storage"
    assert cfg.storage.retention.model_dump() == {
        "images": "sample", "sample_fraction": 0.2, "reencode": "webp", "webp_quality": 70,
        "max_gb": 500, "sweep_interval_s": 30}
    assert cfg.tasks.rerun_infra_errors is False and cfg.model.outage_wait_s == 120
    assert cfg.tasks.failed_group_reruns == 1
    assert cfg.coordinator.outage_give_up_s == 600
    assert cfg.run_dir == Path("out/exp-1")
    assert cfg.tasks.metric_variant == "original" and cfg.tasks.needs_desktops
    assert [b.domain for b in cfg.tasks.text_benchmarks()] == ["gsm-py"]
    assert cfg.text.tool_choice == "required" and cfg.text.py.memory_mb == 256
    assert cfg.text.rag.cache_dir is None and cfg.text.web.backend == "serper"


def test_full_example_sets_every_field(tmp_path):
    """FULL must mention every key of the schema, so the test above covers them all."""
    data = yaml.safe_load(FULL)

    def missing(model: type, node: dict, prefix: str) -> list[str]:
        out = []
        for name, field in model.model_fields.items():
            key = f"{prefix}{name}"
            if name not in node:
                out.append(key)
                continue
            sub = config_module._model_in(field.annotation)
            if sub is not None and isinstance(node[name], dict):
                out += missing(sub, node[name], key + ".")
        return out

    assert missing(Config, data, "") == []


def test_defaults_and_required_key_names():
    cfg = load_config(None)
    assert cfg.run.output_dir == Path("results")
    for key in [
        "run.name", "run.output_dir", "tasks.source", "tasks.rollouts_per_task",
        "tasks.poll_interval_s", "model.endpoints", "model.scripted", "model_pool.replicas",
        "model_pool.state_dir", "desktops.provider", "desktops.count", "desktops.warm_spares",
        "coordinator.max_concurrent_episodes", "coordinator.episodes_per_runner",
        "coordinator.schedule", "coordinator.max_retries", "runner.max_steps",
    ]:
        node = cfg
        for part in key.split("."):
            node = getattr(node, part)  # AttributeError would name the missing key


@pytest.mark.parametrize(
    "text, key",
    [
        ("runner: {max_setps: 3}", "runner.max_setps"),
        ("desktops: {local: {window_manger: x}}", "desktops.local.window_manger"),
        ("modle: {}", "modle"),
        ("model: {sampling: {temprature: 0}}", "model.sampling.temprature"),
    ],
)
def test_misspelt_key_fails_with_its_path_and_file(tmp_path, text, key):
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as info:
        load_config(path)
    message = str(info.value)
    assert str(path) in message
    assert f"{key}: unknown key" in message


@pytest.mark.parametrize(
    "text, key, fragment",
    [
        ("coordinator: {max_concurrent_episodes: lots}", "coordinator.max_concurrent_episodes",
         "integer"),
        ("coordinator: {schedule: sometimes}", "coordinator.schedule", "'rollout' or 'batch'"),
        ("runner: {max_steps: 0}", "runner.max_steps", "greater than or equal to 1"),
        ("model: {endpoints: http://x}", "model.endpoints", "list"),
        ("model: {sampling: {top_p: 1.5}}", "model.sampling.top_p", "less than or equal to 1"),
        ("desktops: {provider: vmware}", "desktops.provider", "'local'"),
        ("desktops: {kubernetes: {reset: restore}}", "desktops.kubernetes.reset",
         "Input should be 'builtin' or 'vm' (got 'restore')"),
        ("desktops: {remote: {kind: docker}}", "desktops.remote.kind",
         "'cua' or 'gui-docker-env'"),
        ("desktops: {remote: {urls: [envs:8700]}}", "desktops.remote",
         "'envs:8700' is not an http(s) URL"),
        ("desktops: {remote: {kind: gui-docker-env, access: relay}}", "desktops.remote",
         "access is for kind cua"),
        ("desktops: {remote: {wait: 3}}", "desktops.remote.wait", "unknown key"),
        ("storage: {step_files: nfs}", "storage.step_files",
         "Input should be 'auto', 'runner' or 'storage' (got 'nfs')"),
    ],
)
def test_wrong_type_fails_with_its_path(tmp_path, text, key, fragment):
    with pytest.raises(ConfigError) as info:
        load_config(write(tmp_path, text))
    line = next(ln for ln in str(info.value).splitlines() if ln.strip().startswith(key + ":"))
    assert fragment in line


def test_all_errors_reported_at_once(tmp_path):
    with pytest.raises(ConfigError) as info:
        load_config(write(tmp_path, "runner: {max_steps: x, bogus: 1}\nstorage: {fsync: maybe}"))
    message = str(info.value)
    assert "3 errors" in message
    for key in ("runner.max_steps", "runner.bogus", "storage.fsync"):
        assert key in message


def test_missing_file_bad_yaml_and_non_mapping(tmp_path):
    with pytest.raises(ConfigError, match="config file not found"):
        load_config(tmp_path / "absent.yaml")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(write(tmp_path, "run: {name: [unclosed"))
    with pytest.raises(ConfigError, match="top level must be a mapping"):
        load_config(write(tmp_path, "- a\n- b\n"))
    assert load_config(write(tmp_path, "")).run.name == "run"


def test_cross_field_rules(tmp_path):
    with pytest.raises(ConfigError, match="exclude each other"):
        load_config(write(tmp_path, "model: {scripted: true, endpoints: ['http://x:1']}"))
    with pytest.raises(ConfigError, match=r"model\.endpoints and model\.endpoints_url exclude"):
        load_config(write(tmp_path, "model: {endpoints: ['http://x:1'], "
                                    "endpoints_url: 'http://x:2/endpoints'}"))
    with pytest.raises(ConfigError, match=r"model\.endpoints_url 'x:2/endpoints' is not an "
                                          r"http\(s\) URL"):
        load_config(write(tmp_path, "model: {endpoints_url: 'x:2/endpoints'}"))
    with pytest.raises(ConfigError, match=r"start_with_run .* excludes model\.endpoints_url"):
        load_config(write(tmp_path, "model: {endpoints_url: 'http://x:2/endpoints'}\n"
                                    "model_pool: {start_with_run: true, checkpoint: /m}"))
    with pytest.raises(ConfigError, match=r"static\.urls is empty"):
        load_config(write(tmp_path, "desktops: {provider: static}"))


def test_vllm_dev_mode_is_refused_on_a_network_host_unless_allowed(tmp_path):
    """Review L7: the dev endpoints (/pause, /collective_rpc) have no authentication."""
    with pytest.raises(ConfigError, match=r"model_pool\.host '0\.0\.0\.0' is not loopback"):
        load_config(write(tmp_path, "model_pool: {host: 0.0.0.0}"))
    with pytest.raises(ConfigError, match="not loopback"):  # dev mode asked through env
        load_config(write(tmp_path, "model_pool: {host: 0.0.0.0, reload_in_place: false, "
                                    "env: {VLLM_SERVER_DEV_MODE: '1'}}"))
    key = "api_key_env: K}, model: {api_key_env: K"  # a network host needs a key (below)
    for allowed in (f"{{model_pool: {{host: 0.0.0.0, reload_in_place: false, {key}}}}}",
                    f"{{model_pool: {{host: 0.0.0.0, dev_mode_on_network: true, {key}}}}}",
                    "model_pool: {host: '::1'}", "model_pool: {host: localhost}",
                    "model_pool: {host: 127.0.0.2}"):
        load_config(write(tmp_path, allowed))


def test_overrides_are_typed_by_the_schema(tmp_path):
    path = write(tmp_path, "run: {name: a}\n")
    cfg = load_config(
        path,
        [
            "run.name=123",  # a str field keeps the text, not the int 123
            "coordinator.max_concurrent_episodes=16",
            "model.scripted=true",
            "tasks.domains=[os, chrome]",
            "model_pool.extra_args=[--max-model-len, '4096']",
            "model_pool.env.VLLM_SERVER_DEV_MODE=1",
            "ray.address=",
            "desktops.static.urls=[http://a:5000]",
            "desktops.provider=static",
            "agent.prompt_note=password: 'x'",
        ],
    )
    assert cfg.run.name == "123"
    assert cfg.coordinator.max_concurrent_episodes == 16
    assert cfg.model.scripted is True
    assert cfg.tasks.domains == ["os", "chrome"]
    assert cfg.model_pool.extra_args == ["--max-model-len", "4096"]
    assert cfg.model_pool.env == {"VLLM_SERVER_DEV_MODE": "1"}
    assert cfg.ray.address == ""
    assert cfg.desktops.static.urls == ["http://a:5000"]
    assert cfg.agent.prompt_note == "password: 'x'"


@pytest.mark.parametrize(
    "override, fragment",
    [
        ("runner.max_stepz=3", "unknown key 'runner.max_stepz'"),
        ("nope.x=1", "unknown key 'nope'"),
        ("runner.max_steps.deep=1", "runner.max_steps is a value, not a section"),
        ("runner.max_steps", "expected key.path=value"),
        ("runner..max_steps=1", "empty part"),
    ],
)
def test_bad_override_keys(override, fragment):
    with pytest.raises(ConfigError, match=re.escape(fragment)):
        load_config(None, [override])


def test_bad_override_value_is_marked_as_coming_from_set():
    with pytest.raises(ConfigError) as info:
        load_config(None, ["coordinator.max_retries=-1"])
    assert "coordinator.max_retries: Input should be greater than or equal to 0" in str(info.value)
    assert "(from --set)" in str(info.value)


def test_secrets_come_from_named_env_vars(monkeypatch, tmp_path):
    cfg = load_config(write(tmp_path, "model: {api_key_env: TEST_ROLLOUT_KEY}"))
    monkeypatch.delenv("TEST_ROLLOUT_KEY", raising=False)
    with pytest.raises(ConfigError, match=re.escape("model.api_key_env names $TEST_ROLLOUT_KEY")):
        secret_from_env(cfg.model.api_key_env, "model.api_key_env")
    monkeypatch.setenv("TEST_ROLLOUT_KEY", "sk-123")
    assert secret_from_env(cfg.model.api_key_env, "model.api_key_env") == "sk-123"
    assert secret_from_env(None, "model.api_key_env") is None
    # A literal key in the YAML is rejected, not silently used.
    with pytest.raises(ConfigError, match=r"model\.api_key: unknown key"):
        load_config(write(tmp_path, "model: {api_key: sk-123}"))


@pytest.mark.parametrize("path", sorted((ROOT / "configs").glob("*.yaml")), ids=lambda p: p.name)
def test_shipped_configs_are_valid(path):
    load_config(path)


def test_cli_exit_codes(tmp_path):
    good = write(tmp_path, "run: {name: x}")
    bad = write(tmp_path, "run: {nmae: x}", "bad.yaml")
    ok = subprocess.run(
        [sys.executable, str(ROOT / "config.py"), "-c", str(good), "--set", "runner.max_steps=7"],
        capture_output=True, text=True, cwd=ROOT, check=False,
    )
    assert ok.returncode == 0, ok.stderr
    assert yaml.safe_load(ok.stdout)["runner"]["max_steps"] == 7
    fail = subprocess.run(
        [sys.executable, str(ROOT / "config.py"), "--config", str(bad)],
        capture_output=True, text=True, cwd=ROOT, check=False,
    )
    assert fail.returncode == 2
    assert f"{bad}" in fail.stderr and "run.nmae: unknown key" in fail.stderr


def test_a_lease_must_outlive_everything_its_episode_does(tmp_path):
    """Review M3: a lease reclaimed at lease_max_s while its episode still runs (or is
    scored) hands the desktop to a second episode; the config refuses that, naming keys."""
    with pytest.raises(ConfigError, match=r"desktops.lease_max_s \(3600\) must exceed "
                                          r"runner.episode_timeout_s \+ model.outage_wait_s"):
        load_config(None, ["runner.episode_timeout_s=3600"])
    cfg = load_config(None, ["runner.episode_timeout_s=3600", "desktops.lease_max_s=5000"])
    assert cfg.desktops.lease_max_s == 5000


def test_the_run_makes_paths_absolute_and_adds_the_task_folders_to_the_task_roots(tmp_path):
    """Review M5: upload_file may read the task set's own files (the folder of tasks.source,
    tasks.examples_dir) and the download cache, nothing else; run.py says which they are."""
    import cua_rollout.runtime.launch as launch

    (tmp_path / "osworld" / "examples").mkdir(parents=True)
    source = tmp_path / "osworld" / "test_all.json"
    source.write_text("{}")
    cfg = launch.absolute_paths(load_config(None, [
        f"tasks.source={source}", f"tasks.examples_dir={tmp_path / 'osworld' / 'examples'}",
        "desktops.download_cache_dir=cache"]))
    assert cfg.desktops.task_file_roots == [(tmp_path / "osworld" / "examples").resolve(),
                                            (tmp_path / "osworld").resolve()]
    assert cfg.desktops.download_cache_dir.is_absolute()


def test_a_batch_cutoff_needs_the_batch_schedule():
    with pytest.raises(ConfigError, match=r"batch_cutoff.*schedule: batch"):
        load_config(None, ["coordinator.batch_cutoff=0.98"])
    cfg = load_config(None, ["coordinator.schedule=batch", "coordinator.batch_cutoff=0.98",
                             "coordinator.batch_grace_s=30"])
    assert (cfg.coordinator.batch_cutoff, cfg.coordinator.batch_grace_s) == (0.98, 30)


def test_a_judge_without_the_name_of_its_model_is_refused() -> None:
    with pytest.raises(ValueError, match=r"text\.judge\.name is not set"):
        Config.model_validate({"text": {"judge": {"endpoints": ["http://127.0.0.1:9"]}}})
    named = Config.model_validate(
        {"text": {"judge": {"endpoints": ["http://127.0.0.1:9"], "name": "judge-7b"}}})
    assert named.text.judge is not None and named.text.judge.name == "judge-7b"


def test_each_backoff_keeps_its_own_defaults_when_partly_set(tmp_path):
    cfg = load_config(None)
    assert (cfg.model.backoff.initial_s, cfg.model.backoff.max_s) == (0.5, 20.0)
    assert (cfg.model_pool.restart_backoff.initial_s, cfg.model_pool.restart_backoff.max_s) == (
        2.0, 120.0)
    assert (cfg.coordinator.outage_backoff.initial_s,
            cfg.coordinator.outage_backoff.max_s) == (1.0, 30.0)
    # A key left out keeps its use's default, not another use's.
    cfg = load_config(write(tmp_path, "model_pool: {restart_backoff: {max_s: 60}}"),
                      ["model.backoff.max_s=3", "coordinator.outage_backoff.initial_s=0.2"])
    assert (cfg.model.backoff.initial_s, cfg.model.backoff.max_s) == (0.5, 3.0)
    assert (cfg.model_pool.restart_backoff.initial_s, cfg.model_pool.restart_backoff.max_s) == (
        2.0, 60.0)
    assert (cfg.coordinator.outage_backoff.initial_s,
            cfg.coordinator.outage_backoff.max_s) == (0.2, 30.0)
    # The model's and the pool's may be 0 (retry at once); the coordinator's would spin.
    assert load_config(None, ["model.backoff.initial_s=0"]).model.backoff.initial_s == 0
    with pytest.raises(ConfigError, match=r"coordinator\.outage_backoff: initial_s and max_s "
                                          r"must be greater than 0"):
        load_config(None, ["coordinator.outage_backoff.initial_s=0"])
    with pytest.raises(ConfigError, match=r"model\.backoff\.max_s: Input should be greater"):
        load_config(None, ["model.backoff.max_s=-1"])
    with pytest.raises(ConfigError, match=r"model\.backoff\.min_s: unknown key"):
        load_config(write(tmp_path, "model: {backoff: {min_s: 1}}"))


@pytest.mark.parametrize("old, new", [
    ("model.backoff_initial_s", "model.backoff.initial_s"),
    ("model.backoff_max_s", "model.backoff.max_s"),
    ("model_pool.restart_backoff_initial_s", "model_pool.restart_backoff.initial_s"),
    ("model_pool.restart_backoff_max_s", "model_pool.restart_backoff.max_s"),
    ("coordinator.outage_backoff_initial_s", "coordinator.outage_backoff.initial_s"),
    ("coordinator.outage_backoff_max_s", "coordinator.outage_backoff.max_s"),
    ("text.judge.backoff_max_s", "text.judge.backoff.max_s"),  # a ModelConfig too
    ("model.family", "agent.name"),  # the agent's settings: a section of their own
    ("model.max_pixels", "agent.max_pixels"),
    ("model.constrain_actions", "agent.constrain_actions"),
    ("runner.history_images", "agent.history_images"),
    ("runner.call_user", "agent.call_user"),
])
def test_a_moved_key_names_its_new_key_from_yaml_and_from_set(tmp_path, old, new):
    section, key = old.rsplit(".", 1)
    nested: dict = {key: 3}
    for part in reversed(section.split(".")):
        nested = {part: nested}
    expected = f"{old} moved: it is {new} now"
    with pytest.raises(ConfigError, match=re.escape(expected)) as info:
        load_config(write(tmp_path, yaml.safe_dump(nested)))
    assert "unknown key" not in str(info.value)
    with pytest.raises(ConfigError, match=re.escape(f"{expected} (from --set)")):
        load_config(None, [f"{old}=3"])
    with pytest.raises(ValueError, match=re.escape(expected)):
        Config.model_validate(nested)


@pytest.mark.parametrize("key", ["scripted_error_rate", "scripted_latency_s"])
def test_the_scripted_demo_knobs_are_removed_with_the_reason(tmp_path, key):
    expected = rf"model\.{key} was removed: a demo knob of the scripted policy.*model\.endpoints"
    with pytest.raises(ConfigError, match=expected):
        load_config(write(tmp_path, f"model: {{scripted: true, {key}: 0.1}}"))
    with pytest.raises(ConfigError, match=expected):
        load_config(None, [f"model.{key}=0.1"])


def test_the_moved_keys_table_names_real_sections_and_new_keys():
    for model, moved in config_module.MOVED_KEYS.items():
        for old, new in moved.items():
            assert old not in model.model_fields, (model.__name__, old)
            if isinstance(new, config_module.Removed):
                continue
            node: type = model
            if isinstance(new, config_module.Elsewhere):  # a whole path from the root
                node, new = Config, new.key
            for part in new.split("."):  # the new key exists in the schema
                field = node.model_fields[part]
                node = config_module._model_in(field.annotation) or field.annotation


def test_the_pool_start_deadline_is_the_providers():
    """A VM's first start boots the image and saves its ready state: the driver waits for
    that, not for a local desktop's minute."""
    vm = load_config(None, ["desktops.provider=vm", "desktops.vm.image=/x.qcow2",
                            "desktops.vm.boot_timeout_s=600", "desktops.vm.start_timeout_s=30"])
    assert vm.desktops.start_deadline_s == 630
    assert load_config(None).desktops.start_deadline_s == 60
    assert load_config(None, ["desktops.provider=container",
                              "desktops.container.start_timeout_s=45"]
                       ).desktops.start_deadline_s == 45


def test_kubernetes_vm_reset_needs_a_pod_template():
    """``reset: vm`` resets pods through the VM launcher's endpoint: a pod of the image alone
    (no template) runs the desktop image's server, which has none."""
    with pytest.raises(ConfigError, match=r"desktops.kubernetes.reset is vm: set "
                                          r"desktops.kubernetes.pod_template to a pod that runs "
                                          r"the VM launcher"):
        load_config(None, ["desktops.kubernetes.reset=vm"])
    cfg = load_config(None, ["desktops.kubernetes.reset=vm",
                             "desktops.kubernetes.pod_template=deploy/kubernetes/"
                             "vm-desktop-pod.yaml"])
    assert cfg.desktops.kubernetes.reset == "vm"


def test_remote_desktops_name_their_missing_token_and_urls(tmp_path, monkeypatch):
    with pytest.raises(ConfigError, match=r"desktops\.remote\.token_env"):
        load_config(write(tmp_path, "desktops: {provider: remote, remote: {urls: [http://e:1]}}"))
    cfg = load_config(write(tmp_path, "desktops: {provider: remote, remote: "
                                      "{kind: gui-docker-env}}"))
    monkeypatch.delenv("OSWORLD_TOKEN", raising=False)
    monkeypatch.delenv("OSWORLD_BASE_URL", raising=False)
    with pytest.raises(ConfigError, match=r"desktops\.remote\.token_env names \$OSWORLD_TOKEN"):
        cfg.desktops.remote.token()
    with pytest.raises(ConfigError, match=r"desktops\.remote\.urls .*OSWORLD_BASE_URL"):
        cfg.desktops.remote.server_urls()
    # As GUI-Docker-Env's own client reads them: a comma list, with or without a scheme.
    monkeypatch.setenv("OSWORLD_BASE_URL", "http://10.0.0.1:50003, 10.0.0.2:50003")
    assert cfg.desktops.remote.server_urls() == ["http://10.0.0.1:50003",
                                                 "http://10.0.0.2:50003"]
    assert cfg.desktops.start_deadline_s == cfg.desktops.remote.start_timeout_s
