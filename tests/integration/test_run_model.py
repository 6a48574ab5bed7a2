"""run_model.py: a real vLLM pool (CPU build) on tiny random models built at test time,
driven through its CLI and the real model client; plus its helpers, without vLLM.

The integration tests share one supervisor (module scope) and run in file order: start,
routing, a 4xx, a killed replica, ``--watch``, a rolling reload, SIGTERM.
"""

from __future__ import annotations

import asyncio
import base64
import importlib.util
import json
import os
import random
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest

from cua_rollout.config import ModelConfig, ModelPoolConfig, SamplingConfig
from cua_rollout.core.errors import ConfigError, ModelRequestError, ModelUnavailable
from cua_rollout.model.client import Generation, ModelServicePool
from cua_rollout.model.fleet.checkpoints import (
    checkpoint_version,
    newest_checkpoint,
    resolve_checkpoint,
    same_architecture,
)
from cua_rollout.model.fleet.control import ENDPOINTS_PATH, ControlClient, ControlServer
from cua_rollout.model.fleet.devices import assign_devices, parse_nvidia_smi_list
from cua_rollout.model.fleet.processes import (
    API_SERVER_MODULE,
    group_members,
    replica_process,
    sweep_stale_replicas,
    terminate_tree,
)
from cua_rollout.model.fleet.replica_api import parse_vllm_load
from cua_rollout.model.fleet.state import CONTROL_FILE, ENDPOINTS_FILE, write_state
from cua_rollout.model.fleet.supervisor import ReloadOutcome, ReloadRefusal, restart_delay_s
from cua_rollout.model.server_metrics import ServerMetricsScraper
from tests.support import REPO_ROOT, unavailable

ROOT = REPO_ROOT
RUN_MODEL = ROOT / "run_model.py"
MODEL_NAME = "tiny"
# The replicas require a key (model_pool.api_key_env): every client here sends it.
POOL_KEY_VAR = "CUA_TEST_POOL_KEY"
os.environ.setdefault(POOL_KEY_VAR, f"sk-test-{random.Random().getrandbits(64):x}")
# Deadlines are generous: this machine has 2 cores and other suites run beside this one.
START_TIMEOUT_S = 420.0
RESTART_TIMEOUT_S = 300.0
RELOAD_TIMEOUT_S = 300.0
STOP_TIMEOUT_S = 90.0
MESSAGES = [{"role": "user", "content": [{"type": "text", "text": "Open the text editor."}]}]
PNG_1PX = base64.b64encode(bytes.fromhex(
    "89504e470d0a1a0a0000000d4948445200000001000000010806000000"
    "1f15c4890000000d49444154789c63000100000500010d0a2db40000000049454e44ae426082"
)).decode()


# --------------------------------------------------------------------------- helpers


def run_cli(*args: str, timeout_s: float = 120.0) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(RUN_MODEL), *args], cwd=ROOT, capture_output=True, text=True,
        timeout=timeout_s,
    )


def read_state(state_dir: Path) -> dict[str, Any]:
    return json.loads((state_dir / ENDPOINTS_FILE).read_text())


def alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def wait_for(predicate, timeout_s: float, what: str, interval_s: float = 0.5) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what}")
        time.sleep(interval_s)


def client_cfg(**kw: Any) -> ModelConfig:
    base: dict[str, Any] = dict(
        name=MODEL_NAME, endpoints=[], api_key_env=POOL_KEY_VAR, retries=10,
        backoff={"initial_s": 0.2, "max_s": 2.0},
        request_timeout_s=120.0, connect_timeout_s=5.0, reprobe_interval_s=1.0,
        sampling=SamplingConfig(max_tokens=8, temperature=0.7),
    )
    base.update(kw)
    return ModelConfig(**base)


@dataclass
class Stream:
    """A steady stream of chat requests from ``workers`` concurrent episodes."""

    client: ModelServicePool
    workers: int
    patient: bool = False   # wait out an outage as an episode does (model.outage_wait_s)
    done: list[tuple[float, Generation]] = field(default_factory=list)  # (start time, gen)
    waits: int = 0
    errors: list[BaseException] = field(default_factory=list)
    _stop: asyncio.Event = field(default_factory=asyncio.Event)
    _tasks: list[asyncio.Task[None]] = field(default_factory=list)

    def start(self) -> None:
        self._tasks = [asyncio.create_task(self._worker(i)) for i in range(self.workers)]

    async def _worker(self, i: int) -> None:
        n = 0
        while not self._stop.is_set():
            started = time.monotonic()
            try:
                gen = await self.client.generate(MESSAGES, session_id=f"ep{i}")
            except ModelUnavailable as exc:
                if self.patient and exc.outage and await self.client.wait_until_live(300):
                    self.waits += 1
                    continue
                self.errors.append(exc)
                return
            except Exception as exc:
                self.errors.append(exc)
                return
            self.done.append((started, gen))
            n += 1

    async def wait_done(self, count: int, timeout_s: float, after: float = 0.0) -> None:
        deadline = time.monotonic() + timeout_s
        while sum(1 for t, _ in self.done if t >= after) < count:
            assert not self.errors, self.errors
            assert time.monotonic() < deadline, f"only {len(self.done)} generations"
            await asyncio.sleep(0.05)

    async def stop(self) -> None:
        self._stop.set()
        await asyncio.gather(*self._tasks)


# --------------------------------------------------------------------------- helpers, no vLLM


def test_assign_devices_splits_gpus_per_replica_and_explains_shortage():
    assert assign_devices(2, 2, None, ["0", "1", "2", "3"]) == ["0,1", "2,3"]
    assert assign_devices(2, 1, [5, 7], ["5", "6", "7"]) == ["5", "7"]
    assert assign_devices(1, 1, None, ["0", "1"], visible="1") == ["1"]
    assert assign_devices(3, 1, None, []) is None  # no GPU: the CPU build
    with pytest.raises(ConfigError, match=r"needs 4 GPUs .* only 3 are available"):
        assign_devices(2, 2, None, ["0", "1", "2"])
    with pytest.raises(ConfigError, match="no GPU was found"):
        assign_devices(1, 1, [0], [])
    with pytest.raises(ConfigError, match=r"no such GPU \[9\]"):
        assign_devices(1, 1, [9], ["0"])
    text = "GPU 0: NVIDIA A100-SXM4-80GB (UUID: GPU-1)\nGPU 1: NVIDIA A100 (UUID: GPU-2)\n"
    assert parse_nvidia_smi_list(text) == ["0", "1"]


def test_metrics_parsing_and_restart_backoff():
    text = (
        '# HELP vllm:num_requests_running Number of requests\n'
        'vllm:num_requests_running{engine="0",model_name="tiny"} 3.0\n'
        'vllm:num_requests_waiting{engine="0",model_name="tiny"} 2.0\n'
        'vllm:num_requests_waiting_by_reason{engine="0",reason="capacity"} 7.0\n'
        'vllm:num_requests_running{engine="1",model_name="tiny"} 1.0\n'
    )
    assert parse_vllm_load(text) == (4, 2)
    pool = ModelPoolConfig(restart_backoff={"initial_s": 2, "max_s": 10})
    delays = [restart_delay_s(pool, n) for n in range(1, 6)]
    assert delays == [2, 4, 8, 10, 10]


def _fake_checkpoint(path: Path, weights: bytes = b"w", config: dict | None = None) -> Path:
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps(config or {"model_type": "qwen2"}))
    (path / "tokenizer.json").write_text("{}")
    (path / "model.safetensors").write_bytes(weights)
    return path


def test_checkpoint_version_architecture_and_resolution(tmp_path):
    a = _fake_checkpoint(tmp_path / "step-1")
    b = _fake_checkpoint(tmp_path / "step-2", weights=b"other")
    va = checkpoint_version(str(a))
    assert va.startswith("step-1-") and va == checkpoint_version(str(a))
    os.utime(a / "model.safetensors", ns=(1, 10**18))
    assert checkpoint_version(str(a)) != va  # rewritten: a new version
    assert same_architecture(str(a), str(b))
    (b / "tokenizer.json").write_text('{"changed": true}')
    assert not same_architecture(str(a), str(b))  # a new tokenizer: restart
    c = _fake_checkpoint(tmp_path / "step-3", config={"model_type": "qwen2", "layers": 3})
    assert not same_architecture(str(a), str(c))
    assert resolve_checkpoint(str(a)) == str(a.resolve())
    assert resolve_checkpoint("Qwen/Qwen2-0.5B") == "Qwen/Qwen2-0.5B"  # hub id
    with pytest.raises(ConfigError, match="no such file"):
        resolve_checkpoint(str(tmp_path / "missing"))
    with pytest.raises(ConfigError, match=r"no config\.json"):
        resolve_checkpoint(str(tmp_path))


def test_newest_checkpoint_skips_incomplete_ones(tmp_path):
    assert newest_checkpoint(tmp_path) is None
    old = _fake_checkpoint(tmp_path / "step-1")
    os.utime(old / "model.safetensors", ns=(1, 10**18))
    half = tmp_path / "step-3"
    half.mkdir()
    (half / "config.json").write_text("{}")  # weights not written yet
    sharded = tmp_path / "step-2"
    sharded.mkdir()
    (sharded / "config.json").write_text("{}")
    (sharded / "model-1.safetensors").write_bytes(b"x")
    (sharded / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"a": "model-1.safetensors", "b": "model-2.safetensors"}}
    ))  # shard 2 missing
    found = newest_checkpoint(tmp_path)
    assert found is not None and found.path == old.resolve()
    (sharded / "model-2.safetensors").write_bytes(b"y")
    os.utime(sharded / "model-2.safetensors", ns=(1, 2 * 10**18))
    found = newest_checkpoint(tmp_path)
    assert found is not None and found.path == sharded.resolve()


def test_state_file_mtime_always_moves_forward(tmp_path):
    path = tmp_path / ENDPOINTS_FILE
    last = 0
    for i in range(20):  # faster than the filesystem's timestamp granularity
        mtime = write_state(tmp_path, {"i": i}, min_mtime_ns=last)
        assert mtime > last and path.stat().st_mtime_ns == mtime
        last = mtime
    assert json.loads(path.read_text()) == {"i": 19}
    assert not [p for p in tmp_path.iterdir() if p.name != "endpoints.json"]  # no temp left


def test_stale_sweep_stops_only_provable_replicas(tmp_path):
    """A recorded pid is stopped only if its command line is the API server's with the
    recorded port and it started when recorded; anything else is left alone."""
    sleeper = "import time; time.sleep(300)"
    replica = subprocess.Popen(  # looks like a replica: module and port in its command line
        [sys.executable, "-c", sleeper, "-m", API_SERVER_MODULE, "--port", "18999"],
        start_new_session=True,
    )
    other = subprocess.Popen([sys.executable, "-c", sleeper, "--port", "18998"],
                             start_new_session=True)
    reused = subprocess.Popen(  # right command line, but not started when recorded
        [sys.executable, "-c", sleeper, "-m", API_SERVER_MODULE, "--port", "18997"],
        start_new_session=True,
    )
    try:
        now = time.time()
        (tmp_path / ENDPOINTS_FILE).write_text(json.dumps({"endpoints": [
            {"pid": replica.pid, "port": 18999, "started_at": now},
            {"pid": other.pid, "port": 18998, "started_at": now},
            {"pid": reused.pid, "port": 18997, "started_at": now - 3600},
            {"pid": replica.pid, "port": 18000, "started_at": now},  # wrong port
            {"pid": None, "port": 18100},
        ]}))
        assert sweep_stale_replicas(tmp_path, stop_timeout_s=10) == [replica.pid]
        assert replica.wait(timeout=10) == -signal.SIGTERM
        assert other.poll() is None and reused.poll() is None
    finally:
        for p in (replica, other, reused):
            if p.poll() is None:
                p.kill()
            p.wait()


class _StubSupervisor:
    """What the control routes call, with the answers a real supervisor gives."""

    def __init__(self) -> None:
        self.outcomes: list[ReloadOutcome] = []
        self.requested: list[str] = []
        self.pool = ModelPoolConfig()
        self.replica_key = None
        self.published = {"model": MODEL_NAME, "endpoints": []}

    async def status(self) -> dict[str, Any]:
        return {"model": MODEL_NAME, "endpoints": []}

    def request_reload(self, checkpoint: str, batch: int | None = None) -> ReloadOutcome:
        self.requested.append(checkpoint)
        return self.outcomes.pop(0)


async def test_control_routes_map_reload_outcomes_to_http(tmp_path):
    """The control API without vLLM: bearer token, and each reload outcome's HTTP status."""
    stub = _StubSupervisor()
    server = ControlServer(stub)  # type: ignore[arg-type]
    url = server.start(asyncio.get_running_loop())
    try:
        (tmp_path / CONTROL_FILE).write_text(json.dumps(
            {"url": url, "token": server.token, "pid": os.getpid()}
        ))
        client = ControlClient.find(tmp_path, timeout_s=10)
        assert client is not None and client.url == url
        response = await asyncio.to_thread(client.status)
        assert response.status_code == 200 and response.json()["model"] == MODEL_NAME
        intruder = ControlClient(url, "wrong", timeout_s=10)
        assert (await asyncio.to_thread(intruder.status)).status_code == 401
        running: Any = {"id": 1, "checkpoint": "/ckpt/a"}
        stub.outcomes = [
            ReloadOutcome(running),
            ReloadOutcome(running, ReloadRefusal.BUSY, "a reload to /ckpt/a is already running"),
            ReloadOutcome(None, ReloadRefusal.NOT_STARTED, "the replicas are not started yet"),
            ReloadOutcome(None, ReloadRefusal.BAD_CHECKPOINT, "checkpoint x: no such file"),
        ]
        replies = [await asyncio.to_thread(client.reload, "/ckpt/a") for _ in range(4)]
        assert [r.status_code for r in replies] == [202, 409, 409, 400]
        assert replies[0].json() == {"reload": running}
        assert replies[1].json() == {"error": "a reload to /ckpt/a is already running",
                                     "reload": running}
        assert replies[2].json() == {"error": "the replicas are not started yet"}
        assert replies[3].json() == {"error": "checkpoint x: no such file"}
        assert stub.requested == ["/ckpt/a"] * 4
    finally:
        server.stop()


def test_bad_config_exits_2_with_the_key_path(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("model_pool:\n  replicas: 0\n  chekpoint: x\n")
    result = run_cli("--config", str(cfg))
    assert result.returncode == 2
    assert "model_pool.replicas" in result.stderr and "model_pool.chekpoint" in result.stderr
    result = run_cli("--config", str(cfg), "--set", "model_pool.replicas=1")
    assert result.returncode == 2 and "model_pool.chekpoint: unknown key" in result.stderr
    cfg.write_text(f"model_pool: {{state_dir: {tmp_path / 'state'}}}\n")
    result = run_cli("--config", str(cfg))
    assert result.returncode == 2 and "model_pool.checkpoint is not set" in result.stderr
    result = run_cli("status", "--config", str(cfg))
    assert result.returncode == 1 and "no model pool runs" in result.stderr
    result = run_cli("reload", "--config", str(cfg), "--checkpoint", str(tmp_path))
    assert result.returncode == 1 and "no supervisor runs" in result.stderr


# --------------------------------------------------------------------------- real vLLM


@dataclass
class Models:
    first: Path        # served at start; lives in the watched directory
    second: Path       # the CLI reload's target
    watched: Path      # staged; moved into the watched directory by the --watch test
    watch_dir: Path


@dataclass
class Pool:
    proc: subprocess.Popen[bytes]
    config: Path
    state_dir: Path
    log: Path
    models: Models
    replica_ports: dict[int, int] = field(default_factory=dict)  # every replica pid seen

    def state(self) -> dict[str, Any]:
        return read_state(self.state_dir)

    def endpoints(self) -> list[dict[str, Any]]:
        data = self.state()
        self.replica_ports.update((e["pid"], e["port"]) for e in data["endpoints"] if e["pid"])
        return data["endpoints"]

    def log_tail(self, lines: int = 40) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> Models:
    if importlib.util.find_spec("vllm") is None:
        unavailable("vLLM is not installed")
    root = tmp_path_factory.mktemp("tiny-models")
    watch_dir = root / "watch"
    watch_dir.mkdir()
    first, second, watched = watch_dir / "step-1", root / "second", root / "staged" / "step-2"
    subprocess.run([sys.executable, "-m", "cua_rollout.cli.tiny_models", "text", str(first),
                    str(second), str(watched)],
                   cwd=ROOT, check=True, capture_output=True, timeout=300)
    return Models(first, second, watched, watch_dir)


@pytest.fixture(scope="module")
def pool(models: Models, tmp_path_factory) -> Pool:
    work = tmp_path_factory.mktemp("model-pool")
    state_dir = work / "state"
    base_port = random.Random().randrange(20000, 40000, 10)
    config = work / "config.yaml"
    config.write_text(json.dumps({
        "model": {"name": MODEL_NAME, "api_key_env": POOL_KEY_VAR},
        "model_pool": {
            "checkpoint": str(models.first),
            "api_key_env": POOL_KEY_VAR,
            "replicas": 2,
            "base_port": base_port,
            "state_dir": str(state_dir),
            "extra_args": ["--max-model-len", "1024"],
            "cpu_kv_cache_space_gib": 1,
            "startup_timeout_s": START_TIMEOUT_S,
            "health_interval_s": 1,
            "restart_backoff": {"initial_s": 0.5, "max_s": 5},
            "reload_batch": 1,
            "drain_timeout_s": 60,
            "drain_grace_s": 2.5,
            "stop_timeout_s": 20,
            "watch_interval_s": 1,
        },
    }))
    log = work / "supervisor.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [sys.executable, str(RUN_MODEL), "--config", str(config),
             "--watch", str(models.watch_dir)],
            cwd=ROOT, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    handle = Pool(proc, config, state_dir, log, models)

    def ready() -> bool:
        assert proc.poll() is None, f"run_model.py exited:\n{handle.log_tail()}"
        try:
            endpoints = handle.endpoints()
        except (OSError, ValueError):
            return False
        return len(endpoints) == 2 and all(e["healthy"] for e in endpoints)

    try:
        wait_for(ready, START_TIMEOUT_S, "two healthy replicas")
        yield handle
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        # The supervisor stops its replicas; if it could not, stop the ones it reported.
        for pid, port in handle.replica_ports.items():
            proc = replica_process(pid, port, None)
            if proc is not None:
                terminate_tree(proc, 10)


@pytest.mark.integration
def test_supervisor_publishes_healthy_replicas_and_status(pool: Pool):
    state = pool.state()
    endpoints = pool.endpoints()
    version = checkpoint_version(str(pool.models.first))
    assert state["supervisor"]["pid"] == pool.proc.pid
    assert state["model_version"] == version and state["model"] == MODEL_NAME
    assert len({e["port"] for e in endpoints}) == 2
    for e in endpoints:
        assert e["healthy"] and not e["draining"] and e["model_version"] == version
        assert e["restarts"] == 0 and e["url"] == f"http://127.0.0.1:{e['port']}"
        cmdline = psutil.Process(e["pid"]).cmdline()
        assert API_SERVER_MODULE in cmdline
        assert str(pool.models.first.resolve()) in cmdline
        assert Path(e["log"]).is_file()
    control = pool.state_dir / CONTROL_FILE
    assert control.stat().st_mode & 0o777 == 0o600  # it holds the control token

    result = run_cli("status", "--config", str(pool.config))
    assert result.returncode == 0, result.stderr
    for e in endpoints:
        assert e["url"] in result.stdout
    assert result.stdout.count("serving") == 2 and version in result.stdout
    result = run_cli("status", "--config", str(pool.config), "--json")
    data = json.loads(result.stdout)
    assert data["live"] is True
    assert all(e["running"] == 0 and e["waiting"] == 0 for e in data["endpoints"])


@pytest.mark.integration
def test_replicas_refuse_generations_without_the_key(pool: Pool):
    """model_pool.api_key_env: the key reaches vLLM (VLLM_API_KEY), not its command line."""
    body = {"model": MODEL_NAME, "messages": MESSAGES, "max_tokens": 2}
    for e in pool.endpoints():
        url = e["url"]
        assert httpx.post(url + "/v1/chat/completions", json=body, timeout=60).status_code == 401
        wrong = {"Authorization": "Bearer sk-wrong"}
        assert httpx.post(url + "/v1/chat/completions", json=body, headers=wrong,
                          timeout=60).status_code == 401
        right = {"Authorization": f"Bearer {os.environ[POOL_KEY_VAR]}"}
        assert httpx.post(url + "/v1/chat/completions", json=body, headers=right,
                          timeout=120).status_code == 200
        assert httpx.get(url + "/health", timeout=30).status_code == 200  # probes need none
        cmdline = " ".join(psutil.Process(e["pid"]).cmdline())
        assert os.environ[POOL_KEY_VAR] not in cmdline


async def test_pool_routes_requests_to_both_replicas(pool: Pool):
    version = checkpoint_version(str(pool.models.first))
    client = ModelServicePool(client_cfg(), state_dir=pool.state_dir)
    # A client elsewhere reads the list from the control server, with the replicas' key.
    control = json.loads((pool.state_dir / CONTROL_FILE).read_text())["url"]
    remote = ModelServicePool(client_cfg(endpoints_url=control + ENDPOINTS_PATH))
    try:
        gens = await asyncio.gather(*(client.generate(MESSAGES, f"s{i}") for i in range(12)))
        remote_gens = await asyncio.gather(*(remote.generate(MESSAGES, f"r{i}")
                                             for i in range(4)))
    finally:
        await client.close()
        await remote.close()
    assert {g.endpoint for g in gens} == {e["url"] for e in pool.endpoints()}
    assert {g.model_version for g in gens + remote_gens} == {version}
    assert all(g.completion_tokens > 0 and g.attempts == 1 for g in gens + remote_gens)
    assert {g.endpoint for g in remote_gens} <= {e["url"] for e in pool.endpoints()}
    no_key = httpx.get(control + ENDPOINTS_PATH, timeout=30)
    assert no_key.status_code == 401  # the list is for those who hold the key


@pytest.mark.integration
async def test_image_to_the_text_only_model_is_a_request_error(pool: Pool):
    client = ModelServicePool(client_cfg(), state_dir=pool.state_dir)
    messages = [{"role": "user", "content": [
        {"type": "text", "text": "What is on the screen?"},
        {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{PNG_1PX}"}},
    ]}]
    try:
        with pytest.raises(ModelRequestError) as info:
            await client.generate(messages, "s")
        assert client.stats()["retries"] == 0  # refused once, not retried
    finally:
        await client.close()
    assert info.value.status == 400 and "multimodal" in info.value.server_message


@pytest.mark.integration
async def test_server_metrics_scraper_reads_the_replicas_real_counters(pool: Pool):
    """cua_rollout/model/server_metrics.py on vLLM's own /metrics (no key needed: vLLM guards /v1
    only): rates from its real counters between two scrapes, its KV-cache gauge."""
    urls = [e["url"] for e in pool.endpoints()]
    scraper = ServerMetricsScraper([urls[0] + "/v1", *urls[1:]], timeout_s=30.0)
    headers = {"Authorization": f"Bearer {os.environ[POOL_KEY_VAR]}"}
    body = {"model": MODEL_NAME, "messages": MESSAGES, "max_tokens": 8, "ignore_eos": True}
    try:
        async with httpx.AsyncClient(timeout=120, headers=headers) as http:
            first_start = time.monotonic()
            first = await scraper.scrape()
            first_done = time.monotonic()
            tokens = dict.fromkeys(urls, 0)
            for url in urls * 2:
                reply = await http.post(url + "/v1/chat/completions", json=body)
                assert reply.status_code == 200, reply.text
                tokens[url] += reply.json()["usage"]["completion_tokens"]
            metrics_text = (await http.get(urls[1] + "/metrics")).text
            await asyncio.sleep(1.0)  # the frontend records a request's stats after its reply
            second_start = time.monotonic()
            second = await scraper.scrape()
            second_done = time.monotonic()
            quiet = await scraper.scrape()  # nothing generated since the second
    finally:
        await scraper.aclose()
    assert "# TYPE vllm:generation_tokens_total counter" in metrics_text
    for util in first:
        assert util.up and util.error is None, util
        assert isinstance(util.running, int) and isinstance(util.waiting, int)
        assert util.kv_cache_usage is not None and 0.0 <= util.kv_cache_usage <= 1.0
        assert util.generation_tokens_per_s is None  # the first scrape has no interval
    for url, util in zip(urls, second, strict=True):
        assert util.up and util.error is None, util
        assert (util.running, util.waiting) == (0, 0)
        assert util.kv_cache_usage is not None and 0.0 <= util.kv_cache_usage <= 1.0
        assert tokens[url] > 0
        # The replica generated tokens[url] between the scrapes, and nothing else did.
        rate = util.generation_tokens_per_s
        assert rate is not None and rate > 0, util
        assert tokens[url] / (second_done - first_start) <= rate
        assert rate <= tokens[url] / (second_start - first_done)
        assert util.prompt_tokens_per_s is not None and util.prompt_tokens_per_s > 0
        assert util.mean_queue_time_s is not None and util.mean_queue_time_s >= 0
    for util in quiet:
        assert util.up and util.generation_tokens_per_s == 0.0
        assert util.mean_queue_time_s is None  # no request left the queue
    summary = ServerMetricsScraper.summary(second)
    assert summary["endpoints_up"] == summary["endpoints"] == 2
    assert summary["generation_tokens_per_s"] == pytest.approx(
        sum(u.generation_tokens_per_s for u in second), rel=1e-3)


@pytest.mark.integration
async def test_killed_replica_loses_no_request_and_comes_back(pool: Pool):
    victim = pool.endpoints()[0]
    client = ModelServicePool(client_cfg(endpoint_failures_to_eject=2), state_dir=pool.state_dir)
    stream = Stream(client, workers=8)
    try:
        stream.start()
        await stream.wait_done(16, timeout_s=120)

        def in_flight_on_victim() -> int:
            by_url = {e["url"]: e for e in client.stats()["endpoints"]}
            return by_url[victim["url"]]["outstanding"]

        deadline = time.monotonic() + 60
        while in_flight_on_victim() == 0:  # kill it mid-request
            assert time.monotonic() < deadline, "no request ever reached the victim"
            await asyncio.sleep(0.005)
        os.kill(victim["pid"], signal.SIGKILL)
        killed_at = time.monotonic()
        await stream.wait_done(16, timeout_s=120, after=killed_at + 1)
        await stream.stop()
    finally:
        await client.close()
    assert not stream.errors, stream.errors
    assert client.stats()["retries"] >= 1  # the cut-off requests were retried elsewhere
    assert any(g.attempts > 1 for _, g in stream.done)

    def back() -> dict[str, Any] | None:
        e = pool.endpoints()[0]
        return e if e["healthy"] and e["pid"] != victim["pid"] else None

    revived = await asyncio.to_thread(wait_for, back, RESTART_TIMEOUT_S, "the replica's restart")
    assert revived["restarts"] == 1 and revived["url"] == victim["url"]
    assert not alive(victim["pid"]) and not group_members(victim["pid"])
    fresh = ModelServicePool(client_cfg(), state_dir=pool.state_dir)
    try:
        gens = await asyncio.gather(*(fresh.generate(MESSAGES, f"t{i}") for i in range(8)))
    finally:
        await fresh.close()
    assert victim["url"] in {g.endpoint for g in gens}


@pytest.mark.integration
def test_watch_rolls_out_a_checkpoint_written_to_the_directory(pool: Pool):
    staged = pool.models.watched
    now_ns = time.time_ns()
    for f in staged.iterdir():  # written now, i.e. after the one being served
        os.utime(f, ns=(now_ns, now_ns))
    target = pool.models.watch_dir / staged.name
    staged.rename(target)  # appears complete at once, as a trainer should write it
    version = checkpoint_version(str(target))

    def rolled_out() -> bool:
        state = pool.state()
        reload = state.get("reload") or {}
        return reload.get("state") == "done" and state["model_version"] == version

    wait_for(rolled_out, RELOAD_TIMEOUT_S, "--watch to roll out the new checkpoint")
    state = pool.state()
    assert {e["model_version"] for e in pool.endpoints()} == {version}
    assert [r["mode"] for r in state["reload"]["replicas"]] == ["in-place", "in-place"]


@pytest.mark.integration
async def test_rolling_reload_under_load_fails_no_request(pool: Pool):
    old_version = pool.state()["model_version"]
    new_version = checkpoint_version(str(pool.models.second))
    assert new_version != old_version
    client = ModelServicePool(client_cfg(), state_dir=pool.state_dir)
    stream = Stream(client, workers=4)
    try:
        stream.start()
        await stream.wait_done(8, timeout_s=120)
        result = await asyncio.to_thread(
            run_cli, "reload", "--config", str(pool.config),
            "--checkpoint", str(pool.models.second), timeout_s=RELOAD_TIMEOUT_S,
        )
        reloaded_at = time.monotonic()
        assert result.returncode == 0, result.stdout + result.stderr
        await stream.wait_done(8, timeout_s=120, after=reloaded_at)
        await stream.stop()
    finally:
        await client.close()
    assert not stream.errors, stream.errors
    assert "reload #" in result.stdout and "done" in result.stdout
    assert result.stdout.count("ok (in-place") == 2
    before = {g.model_version for t, g in stream.done if t < reloaded_at}
    after = {g.model_version for t, g in stream.done if t >= reloaded_at}
    assert old_version in before and after == {new_version}
    assert {e["model_version"] for e in pool.endpoints()} == {new_version}
    assert all(not e["draining"] and e["healthy"] for e in pool.endpoints())
    status = run_cli("status", "--config", str(pool.config))
    assert status.returncode == 0 and f"done -> {new_version}" in status.stdout


@pytest.mark.integration
async def test_reloading_every_replica_at_once_under_load_fails_no_request(pool: Pool):
    """Review H1 (a single-replica reload, or reload_batch >= replicas): every endpoint is
    draining and then restarting at once, so no request can be served for a while. Callers
    that wait out the outage, as episodes do, lose nothing and see the new version after."""
    old_version = pool.state()["model_version"]
    target = pool.models.first if old_version != checkpoint_version(
        str(pool.models.first)) else pool.models.second
    new_version = checkpoint_version(str(target))
    client = ModelServicePool(client_cfg(), state_dir=pool.state_dir)
    stream = Stream(client, workers=4, patient=True)
    try:
        stream.start()
        await stream.wait_done(4, timeout_s=120)
        result = await asyncio.to_thread(
            run_cli, "reload", "--config", str(pool.config), "--checkpoint", str(target),
            "--batch", "2", timeout_s=RELOAD_TIMEOUT_S)
        reloaded_at = time.monotonic()
        assert result.returncode == 0, result.stdout + result.stderr
        await stream.wait_done(4, timeout_s=120, after=reloaded_at)
        await stream.stop()
    finally:
        await client.close()
    assert not stream.errors, stream.errors
    assert stream.waits >= 1  # there was a moment with no endpoint at all
    assert {g.model_version for t, g in stream.done if t >= reloaded_at} == {new_version}
    assert client.stats()["outage_waits"] >= 1


@pytest.mark.integration
def test_sigterm_stops_the_supervisor_and_its_replicas_only(pool: Pool):
    bystander = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"],
                                 start_new_session=True)
    try:
        endpoints = pool.endpoints()
        groups = {e["pid"]: group_members(e["pid"]) for e in endpoints}
        assert all(len(members) >= 2 for members in groups.values())  # server + engine
        pool.proc.send_signal(signal.SIGTERM)
        assert pool.proc.wait(timeout=STOP_TIMEOUT_S) == 0, pool.log_tail()
        for leader, members in groups.items():
            assert not any(alive(pid) for pid in members), (leader, members)
            assert not group_members(leader)
        assert bystander.poll() is None  # nothing else was touched
        state = pool.state()
        assert state["endpoints"] == [] and state["supervisor"] is None
        assert not (pool.state_dir / CONTROL_FILE).exists()
        result = run_cli("status", "--config", str(pool.config))
        assert result.returncode == 1 and "not running" in result.stdout
    finally:
        bystander.kill()
        bystander.wait()
