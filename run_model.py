"""Launch and supervise a pool of vLLM OpenAI servers, and roll new checkpoints onto it.

``python run_model.py --config C`` starts ``model_pool.replicas`` servers, restarts any that
die, and publishes them in ``<state_dir>/endpoints.json`` for ``model_service_pool.py``.
``status`` and ``reload`` reach the running supervisor over its control server on 127.0.0.1.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import fcntl
import hashlib
import hmac
import itertools
import json
import logging
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from config import Config, ModelPoolConfig, add_config_arguments, config_from_args
from rollout.errors import ConfigError, ModelUnavailable
from rollout.fleet.state import ENDPOINTS_FILE

log = logging.getLogger("run_model")

CONTROL_FILE = "control.json"      # control URL + token of the live supervisor (mode 0600)
LOCK_FILE = "supervisor.lock"      # flock'ed while a supervisor owns the state dir
LOG_DIR = "logs"                   # one file per replica: replica-<index>.log
API_SERVER_MODULE = "vllm.entrypoints.openai.api_server"

_POLL_S = 0.2                # period of process-exit checks and of waits on them
_STARTUP_POLL_S = 0.5        # /health polling while a replica starts
_DRAIN_POLL_S = 0.25         # /metrics polling while a replica drains
_DRAIN_ZERO_SAMPLES = 2      # consecutive idle samples before a replica counts as drained
_PID_START_SLACK_S = 30.0    # a recorded pid is ours only if the process started this close
_LOG_TAIL_LINES = 15         # lines of a replica's log quoted when it fails
_CLIENT_POLL_S = 0.5         # how often ``reload`` polls the supervisor for progress
_PROBE_LOG_LINE = re.compile(r'"GET /(health|metrics) HTTP')  # our probes, left out of tails
# Files whose equality (config.json: up to these keys) allows an in-place weight reload.
_SAME_ARCH_FILES = re.compile(
    r"^(generation_config\.json|tokenizer.*|special_tokens_map\.json|added_tokens\.json|"
    r"vocab.*|merges\.txt|chat_template.*|(video_)?preprocessor_config\.json|"
    r"processor_config\.json)$"
)
_CONFIG_KEYS_IGNORED = {"_name_or_path", "transformers_version"}
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")
_METRIC = re.compile(
    r"^vllm:num_requests_(running|waiting)(?:\{[^}]*\})?\s+([-+0-9.eE]+|NaN)\s*$", re.M
)

# Runs first in each replica process: die with the supervisor (PR_SET_PDEATHSIG), then exec
# vLLM, so its command line is exactly the server's (what the stale-replica sweep checks).
_EXEC_WITH_PDEATHSIG = (
    "import ctypes, os, signal, sys\n"
    "ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGTERM), 0, 0, 0)\n"
    "if os.getppid() != int(sys.argv[1]):\n"
    "    sys.exit(0)\n"
    "os.execv(sys.argv[2], sys.argv[2:])\n"
)


# --------------------------------------------------------------------------- checkpoints


def resolve_checkpoint(checkpoint: str) -> str:
    """An existing local checkpoint as an absolute path; a hub model id unchanged.

    A path-like value (``/``, ``.`` or ``~``) that does not exist is a ``ConfigError``.
    """
    path = Path(checkpoint).expanduser()
    if path.exists():
        if path.is_dir() and not (path / "config.json").is_file():
            raise ConfigError(f"checkpoint {checkpoint}: no config.json in that directory")
        return str(path.resolve())
    if checkpoint.startswith(("/", ".", "~")) or checkpoint.count("/") > 1:
        raise ConfigError(f"checkpoint {checkpoint}: no such file or directory")
    return checkpoint


def _checkpoint_files(path: Path) -> list[Path]:
    return sorted(p for p in path.rglob("*") if p.is_file() and not p.name.startswith("."))


def checkpoint_version(checkpoint: str) -> str:
    """``<dir name>-<8 hex>``: a fingerprint of the files' names, sizes and mtimes.

    Cheap (no weights are read) and changes whenever the checkpoint is rewritten. A hub
    model id is its own version.
    """
    path = Path(checkpoint)
    if not path.is_dir():
        return checkpoint
    digest = hashlib.sha1()
    for f in _checkpoint_files(path):
        st = f.stat()
        digest.update(f"{f.relative_to(path)}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    return f"{path.name}-{digest.hexdigest()[:8]}"


def same_architecture(old: str, new: str) -> bool:
    """True when ``new`` can be loaded into a server built for ``old`` (same model config
    and tokenizer): the condition for an in-place weight reload."""
    a, b = Path(old), Path(new)
    if not (a.is_dir() and b.is_dir()):
        return False
    try:
        ca = json.loads((a / "config.json").read_text())
        cb = json.loads((b / "config.json").read_text())
    except (OSError, ValueError):
        return False
    for key in _CONFIG_KEYS_IGNORED:
        ca.pop(key, None)
        cb.pop(key, None)
    if ca != cb:
        return False
    names_a = {p.name for p in a.iterdir() if _SAME_ARCH_FILES.match(p.name)}
    names_b = {p.name for p in b.iterdir() if _SAME_ARCH_FILES.match(p.name)}
    if names_a != names_b:
        return False
    return all((a / n).read_bytes() == (b / n).read_bytes() for n in names_a)


@dataclass
class CheckpointCandidate:
    path: Path
    mtime: float        # newest file's mtime
    signature: str      # changes while the checkpoint is still being written


def _complete(path: Path) -> bool:
    """config.json plus weights; with a shard index, every shard it names."""
    if not (path / "config.json").is_file():
        return False
    for index in path.glob("*.index.json"):
        try:
            shards = set(json.loads(index.read_text())["weight_map"].values())
        except (OSError, ValueError, KeyError, AttributeError):
            return False
        if not all((path / s).is_file() for s in shards):
            return False
    return any(p.name.endswith(_WEIGHT_SUFFIXES) for p in path.iterdir())


def newest_checkpoint(directory: Path) -> CheckpointCandidate | None:
    """The most recently written complete checkpoint directory directly under ``directory``."""
    best: CheckpointCandidate | None = None
    try:
        children = [p for p in directory.iterdir() if p.is_dir() and not p.name.startswith(".")]
    except OSError:
        return None
    for child in children:
        try:
            if not _complete(child):
                continue
            files = _checkpoint_files(child)
            stats = [(str(f.relative_to(child)), f.stat()) for f in files]
        except OSError:
            continue  # being written or removed right now
        mtime = max(st.st_mtime for _, st in stats)
        signature = hashlib.sha1(
            "".join(f"{n}\0{st.st_size}\0{st.st_mtime_ns}\n" for n, st in stats).encode()
        ).hexdigest()
        if best is None or mtime > best.mtime:
            best = CheckpointCandidate(child.resolve(), mtime, signature)
    return best


def _checkpoint_mtime(checkpoint: str) -> float:
    path = Path(checkpoint)
    if not path.is_dir():
        return 0.0
    return max((f.stat().st_mtime for f in _checkpoint_files(path)), default=0.0)


# --------------------------------------------------------------------------- devices, ports


def detect_gpus() -> list[str]:
    """GPU indices from NVML, else from ``nvidia-smi -L``; empty without GPUs."""
    try:
        import pynvml  # type: ignore[import-not-found]

        pynvml.nvmlInit()
        try:
            return [str(i) for i in range(pynvml.nvmlDeviceGetCount())]
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # not installed, no driver: fall through to nvidia-smi
        pass
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return []
    try:
        out = subprocess.run([exe, "-L"], capture_output=True, text=True, timeout=30, check=True)
    except (OSError, subprocess.SubprocessError):
        return []
    return parse_nvidia_smi_list(out.stdout)


def parse_nvidia_smi_list(text: str) -> list[str]:
    """``GPU 0: NVIDIA A100 (UUID: ...)`` lines -> ``["0", ...]``."""
    return re.findall(r"^GPU (\d+):", text, re.M)


def assign_devices(
    replicas: int,
    tensor_parallel_size: int,
    gpu_ids: list[int] | None,
    detected: list[str],
    visible: str | None = None,
) -> list[str] | None:
    """``CUDA_VISIBLE_DEVICES`` of each replica, or None to run on the CPU build.

    Candidates: ``gpu_ids`` when configured, else the supervisor's own
    ``CUDA_VISIBLE_DEVICES`` when set, else every GPU detected.
    """
    if gpu_ids is not None:
        unknown = [g for g in gpu_ids if detected and str(g) not in detected]
        if not detected:
            raise ConfigError("model_pool.gpu_ids is set but no GPU was found (NVML, nvidia-smi)")
        if unknown:
            raise ConfigError(f"model_pool.gpu_ids: no such GPU {unknown} (found {detected})")
        available = [str(g) for g in gpu_ids]
    elif visible is not None and detected:
        available = [v.strip() for v in visible.split(",") if v.strip()]
    else:
        available = list(detected)
    if not available:
        return None
    need = replicas * tensor_parallel_size
    if len(available) < need:
        raise ConfigError(
            f"model_pool needs {need} GPUs (replicas {replicas} x tensor_parallel_size "
            f"{tensor_parallel_size}) but only {len(available)} are available "
            f"({', '.join(available)})"
        )
    tp = tensor_parallel_size
    return [",".join(available[i * tp:(i + 1) * tp]) for i in range(replicas)]


def port_is_free(host: str, port: int) -> bool:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def choose_port(host: str, start: int, taken: set[int]) -> int:
    for port in range(start, 65536):
        if port not in taken and port_is_free(host, port):
            return port
    raise ModelUnavailable(f"no free port at or above {start} on {host}")


def _url_host(host: str) -> str:
    """Where clients reach a replica bound to ``host``."""
    return socket.getfqdn() if host in ("0.0.0.0", "::", "") else host


# --------------------------------------------------------------------------- processes


def _exit_status(proc: subprocess.Popen[bytes]) -> str | None:
    """How the process ended, or None while it runs. The zombie is left unreaped, so its
    pid (and process group id) cannot be reused before ``_stop`` has swept the group."""
    if proc.returncode is not None:
        return _describe_returncode(proc.returncode)
    try:
        info = os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    except ChildProcessError:
        return "exited"
    if info is None:
        return None
    if info.si_code == os.CLD_EXITED:
        return f"exit code {info.si_status}"
    return f"killed by {_signal_name(info.si_status)}"


def _describe_returncode(code: int) -> str:
    return f"exit code {code}" if code >= 0 else f"killed by {_signal_name(-code)}"


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def _signal_group(pgid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, sig)


def group_members(pgid: int) -> list[int]:
    """Live (non-zombie) processes of process group ``pgid``, from /proc."""
    members = []
    with contextlib.suppress(OSError):
        for entry in os.scandir("/proc"):
            if not entry.name.isdigit():
                continue
            try:
                with open(f"/proc/{entry.name}/stat") as f:
                    stat = f.read()
            except OSError:
                continue
            fields = stat[stat.rindex(")") + 2:].split()  # state ppid pgrp ...
            if len(fields) > 2 and int(fields[2]) == pgid and fields[0] != "Z":
                members.append(int(entry.name))
    return members


def _shm_files(pids: list[int]) -> set[str]:
    """The /dev/shm files these processes map (vLLM's message queues and semaphores)."""
    paths: set[str] = set()
    for pid in pids:
        try:
            with open(f"/proc/{pid}/maps") as f:
                text = f.read()
        except OSError:
            continue
        for line in text.splitlines():
            at = line.find("/dev/shm/")
            if at >= 0:
                paths.add(line[at:].removesuffix(" (deleted)"))
    return paths


def _remove_files(paths: set[str]) -> None:
    for path in paths:
        with contextlib.suppress(OSError):
            os.unlink(path)


def _log_tail(path: Path, lines: int = _LOG_TAIL_LINES) -> str:
    try:
        with path.open("rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 16384))
            text = f.read().decode("utf-8", "replace")
    except OSError:
        return ""
    kept = [line for line in text.splitlines() if not _PROBE_LOG_LINE.search(line)]
    return "\n".join("    " + line for line in kept[-lines:])


def _replica_process(pid: int, port: int, started_at: float | None) -> Any | None:
    """The psutil process of a replica we recorded, or None if ``pid`` is now something else:
    its command line must name the vLLM API server module and ``--port <port>``, and it must
    have started when we recorded it."""
    import psutil

    try:
        proc = psutil.Process(pid)
        cmdline = proc.cmdline()
        created = proc.create_time()
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return None
    if API_SERVER_MODULE not in cmdline:
        return None
    if not any(a == "--port" and b == str(port) for a, b in itertools.pairwise(cmdline)) and (
        f"--port={port}" not in cmdline
    ):
        return None
    if started_at is not None and abs(created - started_at) > _PID_START_SLACK_S:
        return None
    return proc


def _terminate_tree(proc: Any, timeout_s: float) -> None:
    """Stop a replica we did not start in this run (no Popen handle): SIGTERM its API server,
    then its process group; SIGKILL what is left after ``timeout_s`` and remove the /dev/shm
    files of the processes that had to be killed."""
    import psutil

    pid = proc.pid
    deadline = time.monotonic() + timeout_s

    def wait(done: Callable[[], bool], until: float) -> None:
        while not done() and time.monotonic() < until:
            time.sleep(_POLL_S)

    def gone() -> bool:
        try:
            return proc.status() == psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return True

    try:
        leads_group = os.getpgid(pid) == pid
    except ProcessLookupError:
        return
    if not leads_group:  # started some other way: stop its tree
        members = [proc, *proc.children(recursive=True)]
        for p in members:
            with contextlib.suppress(psutil.NoSuchProcess):
                p.terminate()
        _, alive = psutil.wait_procs(members, timeout=timeout_s)
        for p in alive:
            with contextlib.suppress(psutil.NoSuchProcess):
                p.kill()
        return
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGTERM)
    wait(gone, deadline)
    _signal_group(pid, signal.SIGTERM)
    wait(lambda: not group_members(pid), deadline)
    left = group_members(pid)
    if left:
        shm = _shm_files(left)
        _signal_group(pid, signal.SIGKILL)
        wait(lambda: not group_members(pid), time.monotonic() + timeout_s)
        _remove_files(shm)


def sweep_stale_replicas(state_dir: Path, stop_timeout_s: float) -> list[int]:
    """Stop the replicas an earlier supervisor of ``state_dir`` left running; their pids.

    Only processes that are provably those replicas are touched (``_replica_process``).
    """
    state = _read_json(state_dir / ENDPOINTS_FILE)
    stopped = []
    for entry in (state or {}).get("endpoints", []):
        pid, port = entry.get("pid"), entry.get("port")
        if not isinstance(pid, int) or not isinstance(port, int) or pid == os.getpid():
            continue
        proc = _replica_process(pid, port, entry.get("started_at"))
        if proc is None:
            continue
        log.warning("stopping replica pid %d (port %d) left by an earlier supervisor", pid, port)
        _terminate_tree(proc, stop_timeout_s)
        stopped.append(pid)
    return stopped


# --------------------------------------------------------------------------- files


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _atomic_write(path: Path, text: str, mode: int = 0o644, min_mtime_ns: int = 0) -> int:
    """Write via a temp file and rename; returns the new file's mtime (ns), made greater than
    ``min_mtime_ns`` so readers that watch the mtime never miss an update."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    st = os.stat(tmp)
    mtime_ns = st.st_mtime_ns
    if mtime_ns <= min_mtime_ns:
        mtime_ns = min_mtime_ns + 1_000
        os.utime(tmp, ns=(st.st_atime_ns, mtime_ns))
    os.replace(tmp, path)
    return mtime_ns


def parse_vllm_load(metrics_text: str) -> tuple[int, int]:
    """(running, waiting) requests from vLLM's Prometheus ``/metrics`` text."""
    totals = {"running": 0.0, "waiting": 0.0}
    for kind, value in _METRIC.findall(metrics_text):
        if value != "NaN":
            totals[kind] += float(value)
    return int(totals["running"]), int(totals["waiting"])


def restart_delay_s(pool: ModelPoolConfig, consecutive_failures: int) -> float:
    """Capped exponential backoff before restart number ``consecutive_failures`` (1, 2 ...)."""
    exponent = max(0, consecutive_failures - 1)
    return min(pool.restart_backoff_max_s, pool.restart_backoff_initial_s * 2.0 ** exponent)


# --------------------------------------------------------------------------- the supervisor


@dataclass
class Replica:
    """One vLLM server and what the supervisor knows about it."""

    index: int
    devices: str | None            # CUDA_VISIBLE_DEVICES; None on the CPU build
    port: int
    url: str
    checkpoint: str
    version: str
    log_path: Path
    proc: subprocess.Popen[bytes] | None = None
    state: str = "stopped"         # starting serving draining reloading backoff stopped
    healthy: bool = False
    draining: bool = False
    busy: bool = False             # a start, restart or reload owns it; the monitor keeps off
    restarts: int = 0              # unplanned: after a death or a hang
    reloads: int = 0
    consecutive_failures: int = 0  # deaths and failed starts since it last stayed up
    health_failures: int = 0
    restart_at: float = 0.0        # monotonic time of the next restart (state "backoff")
    started_at: float | None = None
    healthy_since: float | None = None
    startup_s: float | None = None
    last_exit: str | None = None

    def entry(self) -> dict[str, Any]:
        return {
            "index": self.index,
            "url": self.url,
            "healthy": self.healthy,
            "draining": self.draining,
            "model_version": self.version,
            "checkpoint": self.checkpoint,
            "state": self.state,
            "pid": self.proc.pid if self.proc is not None else None,
            "port": self.port,
            "devices": self.devices,
            "restarts": self.restarts,
            "reloads": self.reloads,
            "started_at": self.started_at,
            "startup_s": self.startup_s,
            "last_exit": self.last_exit,
            "log": str(self.log_path),
        }


class Supervisor:
    """Starts the replicas, keeps them alive, publishes them, and reloads checkpoints.

    Everything runs on one asyncio loop in the main thread (replicas are spawned from it,
    which ``PR_SET_PDEATHSIG`` requires); the control server runs in a thread and hands
    each request to that loop.
    """

    def __init__(self, cfg: Config, *, watch_dir: Path | None = None) -> None:
        self.cfg = cfg
        self.pool = cfg.model_pool
        self.model_name = cfg.model.name
        self.state_dir = self.pool.state_dir.resolve()
        self.watch_dir = watch_dir.resolve() if watch_dir is not None else None
        self.checkpoint = resolve_checkpoint(self.pool.checkpoint) if self.pool.checkpoint else ""
        self.version = checkpoint_version(self.checkpoint) if self.checkpoint else ""
        self.replicas: list[Replica] = []
        self.reload_status: dict[str, Any] | None = None
        self.started_at = time.time()
        self.devices = assign_devices(
            self.pool.replicas, self.pool.tensor_parallel_size, self.pool.gpu_ids,
            detect_gpus(), os.environ.get("CUDA_VISIBLE_DEVICES"),
        )
        self._token = secrets.token_urlsafe(24)
        self._control_url = ""
        self._control: _ControlServer | None = None
        self._lock_fd: int | None = None
        self._http: httpx.AsyncClient | None = None
        self._stopping: asyncio.Event | None = None
        self._force = False
        self._reload_task: asyncio.Task[None] | None = None
        self._reload_seq = 0
        self._tasks: set[asyncio.Task[Any]] = set()
        self._mtime_ns = 0

    # ----------------------------------------------------------------- life cycle

    def acquire(self) -> None:
        """Own the state dir (one supervisor per state dir) and stop stale replicas."""
        self.state_dir.mkdir(parents=True, exist_ok=True)
        (self.state_dir / LOG_DIR).mkdir(exist_ok=True)
        fd = os.open(self.state_dir / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            other = (_read_json(self.state_dir / CONTROL_FILE) or {}).get("pid", "?")
            raise ModelUnavailable(
                f"another run_model.py (pid {other}) already supervises {self.state_dir}"
            ) from None
        self._lock_fd = fd
        sweep_stale_replicas(self.state_dir, self.pool.stop_timeout_s)

    async def run(self) -> int:
        """Serve until SIGTERM / SIGINT; the exit code."""
        loop = asyncio.get_running_loop()
        self._stopping = asyncio.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._on_signal, sig)
        self._http = httpx.AsyncClient(timeout=self.pool.health_timeout_s)
        self._control = _ControlServer(self, loop, self._token)
        self._control_url = self._control.start()
        _atomic_write(
            self.state_dir / CONTROL_FILE,
            json.dumps({"url": self._control_url, "token": self._token, "pid": os.getpid()}),
            mode=0o600,
        )
        if self.devices is None:
            log.info("no GPU found (NVML, nvidia-smi): replicas run on the CPU build")
        serve = asyncio.create_task(self._serve())
        stop = asyncio.create_task(self._stopping.wait())
        rc = 0
        try:
            done, _ = await asyncio.wait({serve, stop}, return_when=asyncio.FIRST_COMPLETED)
            if serve in done:
                rc = serve.result()
            else:
                log.info("stopping: %d replica(s)", sum(r.proc is not None for r in self.replicas))
        except Exception:
            log.exception("supervisor failed")
            rc = 1
        finally:
            for task in (serve, stop, self._reload_task, *self._tasks):
                if task is not None and not task.done():
                    task.cancel()
            for task in (serve, self._reload_task, *self._tasks):
                if task is not None:
                    with contextlib.suppress(asyncio.CancelledError, Exception):
                        await task
            await self._shutdown()
        return rc

    def _on_signal(self, sig: int) -> None:
        assert self._stopping is not None
        if self._stopping.is_set():
            log.warning("%s again: killing the replicas now", _signal_name(sig))
            self._force = True
            for r in self.replicas:
                if r.proc is not None:
                    _signal_group(r.proc.pid, signal.SIGKILL)
            return
        log.info("%s received: stopping the replicas", _signal_name(sig))
        self._stopping.set()

    async def _shutdown(self) -> None:
        for r in self.replicas:
            r.draining = True
        self._publish()
        await asyncio.gather(*(self._stop(r) for r in self.replicas))
        for r in self.replicas:
            r.state = "stopped"
        self._publish(stopped=True)
        with contextlib.suppress(FileNotFoundError):
            (self.state_dir / CONTROL_FILE).unlink()
        if self._control is not None:
            self._control.stop()
        if self._http is not None:
            await self._http.aclose()
        log.info("all replicas stopped")

    async def _serve(self) -> int:
        if not self.checkpoint:
            await self._wait_for_first_checkpoint()
        taken: set[int] = set()
        port = self.pool.base_port
        for i in range(self.pool.replicas):
            port = choose_port(self.pool.host, port, taken)
            taken.add(port)
            self.replicas.append(Replica(
                index=i,
                devices=self.devices[i] if self.devices else None,
                port=port,
                url=f"http://{_url_host(self.pool.host)}:{port}",
                checkpoint=self.checkpoint,
                version=self.version,
                log_path=self.state_dir / LOG_DIR / f"replica-{i}.log",
            ))
            port += 1
        log.info("starting %d replica(s) of %s (version %s); logs in %s",
                 len(self.replicas), self.checkpoint, self.version, self.state_dir / LOG_DIR)
        for r in self.replicas:
            r.busy = True
        results = await asyncio.gather(*(self._start(r) for r in self.replicas))
        for r, ok in zip(self.replicas, results, strict=True):
            r.busy = False
            if not ok:
                self._schedule_restart(r)
        if not any(results):
            log.error("no replica became healthy; see the logs above and in %s",
                      self.state_dir / LOG_DIR)
            return 1
        log.info("pool ready: %d/%d replicas serving %r (version %s); state file %s",
                 sum(results), len(results), self.model_name, self.version,
                 self.state_dir / ENDPOINTS_FILE)
        loops = [self._watch_processes(), self._check_health()]
        if self.watch_dir is not None:
            loops.append(self._watch_checkpoints(self.watch_dir))
        await asyncio.gather(*loops)
        return 0

    # ----------------------------------------------------------------- one replica

    def _command(self, r: Replica) -> list[str]:
        cmd = [
            sys.executable, "-m", API_SERVER_MODULE,
            "--model", r.checkpoint,
            "--served-model-name", self.model_name,
            "--host", self.pool.host,
            "--port", str(r.port),
            "--tensor-parallel-size", str(self.pool.tensor_parallel_size),
        ]
        if r.devices is None and self.pool.cpu_enforce_eager and (
            "--enforce-eager" not in self.pool.extra_args
        ):
            cmd.append("--enforce-eager")
        return cmd + list(self.pool.extra_args)

    def _env(self, r: Replica) -> dict[str, str]:
        env = dict(os.environ)
        env["PYTHONUNBUFFERED"] = "1"  # the log file shows what happened up to a crash
        # vLLM leaves files in the temp dir (vllm_dist_*) when it is killed: give each replica
        # its own, emptied at every start, so nothing piles up in /tmp.
        tmp = self.state_dir / "tmp" / f"replica-{r.index}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        env["TMPDIR"] = str(tmp)
        if r.devices is not None:
            env["CUDA_VISIBLE_DEVICES"] = r.devices
        else:
            threads = self.pool.cpu_threads_per_replica or max(
                1, (os.cpu_count() or 1) // self.pool.replicas
            )
            env["VLLM_CPU_KVCACHE_SPACE"] = str(self.pool.cpu_kv_cache_space_gib)
            env["OMP_NUM_THREADS"] = str(threads)
            # Replicas share the cores: vLLM's default binding would pin each to all of them.
            env["VLLM_CPU_OMP_THREADS_BIND"] = "nobind"
        if self.pool.reload_in_place:
            env["VLLM_SERVER_DEV_MODE"] = "1"
        env.update(self.pool.env)
        return env

    async def _start(self, r: Replica) -> bool:
        """Launch ``r`` and wait for its ``/health``; on failure it is stopped again."""
        taken = {o.port for o in self.replicas if o is not r}
        if r.port in taken or not port_is_free(self.pool.host, r.port):
            r.port = choose_port(self.pool.host, self.pool.base_port, taken)
            r.url = f"http://{_url_host(self.pool.host)}:{r.port}"
        cmd = self._command(r)
        launch = cmd
        if sys.platform.startswith("linux"):
            launch = [sys.executable, "-c", _EXEC_WITH_PDEATHSIG, str(os.getpid()), *cmd]
        with r.log_path.open("ab") as logf:
            logf.write(f"\n=== {time.strftime('%Y-%m-%d %H:%M:%S')} run_model.py starts: "
                       f"{' '.join(cmd)}\n".encode())
            logf.flush()
            r.proc = subprocess.Popen(
                launch, stdin=subprocess.DEVNULL, stdout=logf, stderr=subprocess.STDOUT,
                env=self._env(r), start_new_session=True,
            )
        r.started_at = time.time()
        r.state, r.healthy, r.health_failures, r.last_exit = "starting", False, 0, None
        self._publish()
        log.info("replica %d starting: pid %d, port %d%s", r.index, r.proc.pid, r.port,
                 f", GPUs {r.devices}" if r.devices is not None else ", CPU")
        t0 = time.monotonic()
        if await self._wait_healthy(r, self.pool.startup_timeout_s):
            r.startup_s = round(time.monotonic() - t0, 2)
            r.state, r.healthy, r.healthy_since = "serving", True, time.monotonic()
            self._publish()
            log.info("replica %d healthy at %s after %.1f s", r.index, r.url, r.startup_s)
            return True
        status = _exit_status(r.proc) or f"no /health within {self.pool.startup_timeout_s:.0f} s"
        r.last_exit = status
        log.error("replica %d failed to start (%s); end of %s:\n%s",
                  r.index, status, r.log_path, _log_tail(r.log_path))
        await self._stop(r)
        r.state = "backoff"
        self._publish()
        return False

    async def _wait_healthy(self, r: Replica, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if r.proc is None or _exit_status(r.proc) is not None:
                return False
            if await self._probe(r.url + "/health"):
                return True
            await asyncio.sleep(_STARTUP_POLL_S)
        return False

    async def _stop(self, r: Replica) -> None:
        """Stop a replica's whole process group and reap it.

        A serving replica gets SIGTERM on its API server, which shuts its engine down in
        order; an orphaned group (the server died) gets SIGTERM on every process; a replica
        still starting is killed at once (vLLM cannot stop cleanly while it initialises).
        SIGKILL follows after ``stop_timeout_s``; the /dev/shm files of processes that had
        to be killed are removed (only a clean exit removes them).
        """
        proc = r.proc
        if proc is None:
            return
        pgid = proc.pid
        deadline = time.monotonic() + self.pool.stop_timeout_s
        graceful = r.healthy and r.state in ("serving", "draining", "reloading")
        r.healthy = False
        if graceful and _exit_status(proc) is None and not self._force:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pgid, signal.SIGTERM)
            await self._until(lambda: _exit_status(proc) is not None, deadline)
        if r.state != "starting" and _exit_status(proc) is not None and not self._force:
            _signal_group(pgid, signal.SIGTERM)  # the engine processes it leaves behind
            await self._until(lambda: not group_members(pgid), deadline)
        left = group_members(pgid)
        if left:
            shm = _shm_files(left)
            _signal_group(pgid, signal.SIGKILL)  # the leader is unreaped: pgid is still ours
            await self._until(lambda: not group_members(pgid), float("inf"))
            _remove_files(shm)
        await self._until(lambda: _exit_status(proc) is not None, float("inf"))
        proc.wait()
        r.proc = None

    async def _until(self, done: Callable[[], bool], deadline: float) -> None:
        while not done() and time.monotonic() < deadline and not self._force:
            await asyncio.sleep(_POLL_S)

    async def _probe(self, url: str) -> bool:
        assert self._http is not None
        try:
            response = await self._http.get(url, timeout=self.pool.health_timeout_s)
        except httpx.HTTPError:
            return False
        return response.status_code == 200

    async def _load(self, r: Replica) -> tuple[int, int] | None:
        """(running, waiting) requests of a replica, None if it does not answer."""
        if r.proc is None or self._http is None:
            return None
        try:
            response = await self._http.get(r.url + "/metrics", timeout=self.pool.health_timeout_s)
        except httpx.HTTPError:
            return None
        if response.status_code != 200:
            return None
        return parse_vllm_load(response.text)

    # ----------------------------------------------------------------- supervision

    def _schedule_restart(self, r: Replica) -> None:
        r.consecutive_failures += 1
        delay = restart_delay_s(self.pool, r.consecutive_failures)
        r.state, r.healthy, r.restart_at = "backoff", False, time.monotonic() + delay
        log.info("replica %d restarts in %.1f s", r.index, delay)
        self._publish()

    def _spawn(self, coro: Coroutine[Any, Any, Any]) -> None:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _restart(self, r: Replica, *, stop_first: bool = False) -> None:
        try:
            if stop_first:
                await self._stop(r)
            r.restarts += 1
            if not await self._start(r):
                self._schedule_restart(r)
        finally:
            r.busy = False

    async def _watch_processes(self) -> None:
        """Notice dead replicas at once, and restart them when their backoff is over."""
        while True:
            now = time.monotonic()
            for r in self.replicas:
                if r.busy:
                    continue
                if r.proc is not None:
                    status = _exit_status(r.proc)
                    if status is not None:
                        r.healthy, r.busy, r.state = False, True, "backoff"
                        self._publish()  # clients stop routing to it before anything else
                        self._spawn(self._on_death(r, status))
                elif r.state == "backoff" and now >= r.restart_at:
                    r.busy = True
                    self._spawn(self._restart(r))
            await asyncio.sleep(_POLL_S)

    async def _on_death(self, r: Replica, status: str) -> None:
        assert r.proc is not None
        pid = r.proc.pid
        try:
            r.last_exit = status
            log.warning("replica %d (pid %d, port %d) died: %s; end of %s:\n%s",
                        r.index, pid, r.port, status, r.log_path, _log_tail(r.log_path))
            await self._stop(r)  # its engine processes
            self._schedule_restart(r)
        finally:
            r.busy = False

    async def _check_health(self) -> None:
        """Restart replicas that run but stopped answering ``/health`` (hung)."""
        while True:
            await asyncio.sleep(self.pool.health_interval_s)
            serving = [r for r in self.replicas
                       if not r.busy and r.proc is not None and r.state == "serving"]
            results = await asyncio.gather(*(self._probe(r.url + "/health") for r in serving))
            for r, ok in zip(serving, results, strict=True):
                if r.busy or r.proc is None or r.state != "serving":
                    continue
                if ok:
                    r.health_failures = 0
                    stable_s = time.monotonic() - (r.healthy_since or time.monotonic())
                    if stable_s >= self.pool.restart_backoff_max_s:
                        r.consecutive_failures = 0
                    continue
                r.health_failures += 1
                if r.health_failures >= self.pool.health_failures_to_restart:
                    log.warning("replica %d failed %d health checks in a row: restarting it",
                                r.index, r.health_failures)
                    r.healthy, r.busy, r.last_exit = False, True, "hung"
                    self._publish()
                    self._spawn(self._restart(r, stop_first=True))

    # ----------------------------------------------------------------- reload

    def request_reload(self, checkpoint: str) -> tuple[int, dict[str, Any]]:
        """Start a rolling reload (HTTP-like status, body). One runs at a time."""
        if self._reload_task is not None and not self._reload_task.done():
            running = self.reload_status or {}
            return 409, {"error": f"a reload to {running.get('checkpoint')} is already running",
                         "reload": running}
        if not self.replicas:
            return 409, {"error": "the replicas are not started yet"}
        try:
            ckpt = resolve_checkpoint(checkpoint)
            version = checkpoint_version(ckpt)
        except (ConfigError, OSError) as exc:
            return 400, {"error": str(exc)}
        self._reload_seq += 1
        self.reload_status = {
            "id": self._reload_seq, "checkpoint": ckpt, "version": version,
            "state": "running", "message": "", "started_at": time.time(),
            "finished_at": None, "duration_s": None, "batches_total": 0, "batches_done": 0,
            "replicas": [],
        }
        self._reload_task = asyncio.create_task(self._rolling_reload(ckpt, self.reload_status))
        return 202, {"reload": self.reload_status}

    async def _rolling_reload(self, ckpt: str, status: dict[str, Any]) -> None:
        version = status["version"]
        t0 = time.monotonic()
        log.info("reload %d: rolling %s (version %s) onto %d replica(s), %d at a time",
                 status["id"], ckpt, version, len(self.replicas), self.pool.reload_batch)
        try:
            todo = [r for r in self.replicas if (r.checkpoint, r.version) != (ckpt, version)]
            n = self.pool.reload_batch
            batches = [todo[i:i + n] for i in range(0, len(todo), n)]
            status["batches_total"] = len(batches)
            for batch in batches:
                for r in batch:
                    while r.busy:  # a restart in progress finishes first
                        await asyncio.sleep(_POLL_S)
                    r.busy = True
                results = await self._reload_batch(batch, ckpt, version)
                status["replicas"].extend(results)
                status["batches_done"] += 1
                failed = [x for x in results if not x["ok"]]
                if failed:
                    status["state"] = "failed"
                    status["message"] = "; ".join(
                        f"replica {x['index']}: {x['error']}" for x in failed
                    ) + " (replicas not yet reloaded keep the old checkpoint)"
                    log.error("reload %d failed: %s", status["id"], status["message"])
                    return
            self.checkpoint, self.version = ckpt, version
            status["state"] = "done"
            log.info("reload %d done in %.1f s: every replica serves %s",
                     status["id"], time.monotonic() - t0, version)
        except asyncio.CancelledError:
            status["state"], status["message"] = "failed", "cancelled (supervisor stopping)"
            raise
        except Exception as exc:
            log.exception("reload %d failed", status["id"])
            status["state"], status["message"] = "failed", f"{type(exc).__name__}: {exc}"
        finally:
            status["finished_at"] = time.time()
            status["duration_s"] = round(time.monotonic() - t0, 2)
            self._publish()

    async def _reload_batch(
        self, batch: list[Replica], ckpt: str, version: str
    ) -> list[dict[str, Any]]:
        live = [r for r in batch if r.proc is not None and r.state == "serving"]
        for r in batch:
            r.draining = True
            if r.state == "serving":
                r.state = "draining"
        self._publish()
        drained = True
        if live:
            await asyncio.sleep(self.pool.drain_grace_s)
            drained = await self._wait_drained(live)
        return list(await asyncio.gather(
            *(self._reload_one(r, ckpt, version, in_place=drained and r in live) for r in batch)
        ))

    async def _wait_drained(self, replicas: list[Replica]) -> bool:
        """True once none of ``replicas`` has requests running or waiting."""
        deadline = time.monotonic() + self.pool.drain_timeout_s
        idle_samples = 0
        while True:
            loads = await asyncio.gather(*(self._load(r) for r in replicas))
            in_flight = sum(sum(load) for load in loads if load is not None)
            idle_samples = idle_samples + 1 if in_flight == 0 else 0
            if idle_samples >= _DRAIN_ZERO_SAMPLES:
                return True
            if time.monotonic() > deadline:
                log.warning("drain timeout: %d request(s) still in flight on replica(s) %s; "
                            "they will be cut off by a restart (clients retry them)",
                            in_flight, [r.index for r in replicas])
                return False
            await asyncio.sleep(_DRAIN_POLL_S)

    async def _reload_one(
        self, r: Replica, ckpt: str, version: str, *, in_place: bool
    ) -> dict[str, Any]:
        t0 = time.monotonic()
        old = (r.checkpoint, r.version)
        result: dict[str, Any] = {"index": r.index, "mode": "restart", "ok": False,
                                  "seconds": None, "error": None}
        try:
            r.state = "reloading"
            self._publish()
            if in_place and self.pool.reload_in_place and same_architecture(r.checkpoint, ckpt):
                if await self._reload_weights(r, ckpt):
                    result["mode"] = "in-place"
                    r.checkpoint, r.version = ckpt, version
                else:
                    log.warning("replica %d: in-place reload failed; restarting it", r.index)
            if result["mode"] == "restart":
                await self._stop(r)
                r.checkpoint, r.version = ckpt, version
                if not await self._start(r):
                    result["error"] = f"did not start with the new checkpoint ({r.last_exit})"
                    r.checkpoint, r.version = old  # back to what worked, keep the capacity
                    if not await self._start(r):
                        self._schedule_restart(r)
                    return result
            r.reloads += 1
            r.state = "serving"
            result["ok"] = True
            log.info("replica %d reloaded (%s) in %.1f s", r.index, result["mode"],
                     time.monotonic() - t0)
            return result
        finally:
            result["seconds"] = round(time.monotonic() - t0, 2)
            r.draining = False
            r.busy = False
            if r.proc is not None and r.state in ("draining", "reloading"):
                r.state = "serving"
            self._publish()

    async def _reload_weights(self, r: Replica, ckpt: str) -> bool:
        """Swap weights inside the running server: pause (in-flight ones finish, new ones
        wait), ``reload_weights`` from the new path, drop the prefix cache, resume."""
        assert self._http is not None
        http, base = self._http, r.url
        try:
            response = await http.post(base + "/pause", params={"mode": "wait"},
                                       timeout=self.pool.drain_timeout_s)
        except httpx.HTTPError as exc:
            log.warning("replica %d: /pause failed: %s", r.index, exc)
            return False
        if response.status_code != 200:
            log.info("replica %d offers no in-place reload (HTTP %d from /pause)",
                     r.index, response.status_code)
            return False
        reloaded = False
        try:
            response = await http.post(
                base + "/collective_rpc",
                json={"method": "reload_weights", "kwargs": {"weights_path": ckpt}},
                timeout=self.pool.startup_timeout_s,
            )
            if response.status_code != 200:
                log.warning("replica %d: reload_weights failed (HTTP %d): %s",
                            r.index, response.status_code, response.text[:500])
                return False
            reset = await http.post(base + "/reset_prefix_cache")
            if reset.status_code != 200:
                log.warning("replica %d: /reset_prefix_cache answered HTTP %d",
                            r.index, reset.status_code)
            reloaded = True
        except httpx.HTTPError as exc:
            log.warning("replica %d: in-place reload failed: %s", r.index, exc)
            return False
        finally:
            try:
                resumed = await http.post(base + "/resume")
                if resumed.status_code != 200:
                    reloaded = False
            except httpx.HTTPError:
                reloaded = False
        return reloaded and await self._probe(base + "/health")

    # ----------------------------------------------------------------- --watch

    async def _wait_for_first_checkpoint(self) -> None:
        assert self.watch_dir is not None
        log.info("waiting for a checkpoint in %s", self.watch_dir)
        previous = None
        while True:
            found = await asyncio.to_thread(newest_checkpoint, self.watch_dir)
            if found is not None and previous is not None and found.signature == previous:
                self.checkpoint = str(found.path)
                self.version = checkpoint_version(self.checkpoint)
                return
            previous = found.signature if found is not None else None
            await asyncio.sleep(self.pool.watch_interval_s)

    async def _watch_checkpoints(self, directory: Path) -> None:
        """Roll out each checkpoint written to ``directory`` after the one being served,
        once it is complete and has not changed for one poll."""
        handled_mtime = await asyncio.to_thread(_checkpoint_mtime, self.checkpoint)
        pending: str | None = None
        log.info("watching %s for new checkpoints every %.0f s", directory,
                 self.pool.watch_interval_s)
        while True:
            await asyncio.sleep(self.pool.watch_interval_s)
            found = await asyncio.to_thread(newest_checkpoint, directory)
            if found is None or found.mtime <= handled_mtime:
                continue
            if found.signature != pending:
                pending = found.signature  # still being written? look again next time
                continue
            if self._reload_task is not None and not self._reload_task.done():
                continue
            handled_mtime = found.mtime
            code, body = self.request_reload(str(found.path))
            if code != 202:
                log.error("--watch: cannot roll out %s: %s", found.path, body.get("error"))
                continue
            log.info("--watch: new checkpoint %s", found.path)
            assert self._reload_task is not None
            await asyncio.shield(self._reload_task)

    # ----------------------------------------------------------------- state

    def snapshot(self) -> dict[str, Any]:
        """What ``endpoints.json`` holds."""
        return {
            "format": 1,
            "updated_at": time.time(),
            "model": self.model_name,
            "checkpoint": self.checkpoint,
            "model_version": self.version,
            "supervisor": {"pid": os.getpid(), "control_url": self._control_url,
                           "started_at": self.started_at, "state_dir": str(self.state_dir),
                           "watch_dir": str(self.watch_dir) if self.watch_dir else None},
            "reload": self.reload_status,
            "endpoints": [r.entry() for r in self.replicas],
        }

    def _publish(self, *, stopped: bool = False) -> None:
        data = self.snapshot()
        if stopped:
            data["endpoints"] = []
            data["supervisor"] = None
            data["stopped_at"] = time.time()
        self._mtime_ns = _atomic_write(
            self.state_dir / ENDPOINTS_FILE, json.dumps(data, indent=1) + "\n",
            min_mtime_ns=self._mtime_ns,
        )

    async def status(self) -> dict[str, Any]:
        """The snapshot plus each replica's requests running / waiting (vLLM /metrics)."""
        data = self.snapshot()
        loads = await asyncio.gather(*(self._load(r) for r in self.replicas))
        for entry, load in zip(data["endpoints"], loads, strict=True):
            entry["running"], entry["waiting"] = load if load is not None else (None, None)
        return data


# --------------------------------------------------------------------------- control server


class _ControlServer:
    """``GET /status`` and ``POST /reload`` on 127.0.0.1, bearer-token protected (the token is
    in the 0600 ``control.json``). uvicorn runs in a thread; each request is executed on
    the supervisor's loop."""

    def __init__(self, supervisor: Supervisor, loop: asyncio.AbstractEventLoop, token: str):
        self.supervisor = supervisor
        self.loop = loop
        self.token = token
        self._server: Any = None
        self._thread: threading.Thread | None = None

    def start(self, timeout_s: float = 30.0) -> str:
        import uvicorn
        from starlette.applications import Starlette
        from starlette.requests import Request
        from starlette.responses import JSONResponse
        from starlette.routing import Route

        sup = self.supervisor

        def authorized(request: Request) -> bool:
            given = request.headers.get("authorization", "")
            return hmac.compare_digest(given.encode(), f"Bearer {self.token}".encode())

        async def on_loop(make: Callable[[], Awaitable[Any]]) -> Any:
            async def call() -> Any:
                return await make()

            return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(call(), self.loop))

        async def status(request: Request) -> JSONResponse:
            if not authorized(request):
                return JSONResponse({"error": "unauthorized"}, status_code=401)
            return JSONResponse(await on_loop(sup.status))

        async def reload(request: Request) -> JSONResponse:
            if not authorized(request):
                return JSONResponse({"error": "unauthorized"}, status_code=401)
            try:
                body = await request.json()
                checkpoint = str(body["checkpoint"])
            except (ValueError, KeyError, TypeError):
                return JSONResponse({"error": 'expected {"checkpoint": PATH}'}, status_code=400)

            async def start() -> tuple[int, dict[str, Any]]:
                return sup.request_reload(checkpoint)

            code, payload = await on_loop(start)
            return JSONResponse(payload, status_code=code)

        app = Starlette(routes=[
            Route("/status", status, methods=["GET"]),
            Route("/reload", reload, methods=["POST"]),
        ])
        config = uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning",
                                lifespan="off", access_log=False)
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, name="control-server",
                                        daemon=True)
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not self._server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise ModelUnavailable("the control server did not start")
            time.sleep(0.01)
        port = self._server.servers[0].sockets[0].getsockname()[1]
        return f"http://127.0.0.1:{port}"

    def stop(self) -> None:
        if self._server is not None and self._thread is not None:
            self._server.should_exit = True
            self._thread.join(timeout=5)


# --------------------------------------------------------------------------- CLI clients


def _control(state_dir: Path) -> tuple[str, dict[str, str]] | None:
    """URL and auth header of the live supervisor of ``state_dir``, None if none runs."""
    info = _read_json(state_dir / CONTROL_FILE)
    if not info or "url" not in info:
        return None
    pid = info.get("pid")
    if isinstance(pid, int):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return None
        except PermissionError:
            pass
    return str(info["url"]), {"Authorization": f"Bearer {info.get('token', '')}"}


def _fmt(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    return str(value)


def format_status(data: dict[str, Any], *, live: bool) -> str:
    sup = data.get("supervisor") or {}
    lines = []
    if live:
        up_s = time.time() - float(sup.get("started_at") or time.time())
        lines.append(f"supervisor: pid {sup.get('pid')}, up {up_s:.0f} s, "
                     f"control {sup.get('control_url')}")
    else:
        lines.append("supervisor: not running (last published state below)")
    lines.append(f"model: {data.get('model')}  checkpoint: {data.get('checkpoint')}  "
                 f"version: {data.get('model_version')}")
    reload = data.get("reload")
    if reload:
        lines.append(f"last reload #{reload['id']}: {reload['state']} -> {reload['version']}"
                     f" ({reload['batches_done']}/{reload['batches_total']} batches"
                     + (f", {reload['duration_s']} s" if reload.get("duration_s") else "")
                     + (f"; {reload['message']}" if reload.get("message") else "") + ")")
    header = ["#", "url", "state", "healthy", "draining", "running", "waiting", "version",
              "pid", "restarts", "reloads"]
    rows = [header]
    for e in data.get("endpoints", []):
        rows.append([_fmt(e.get(k)) for k in ("index", "url", "state", "healthy", "draining",
                                              "running", "waiting", "model_version", "pid",
                                              "restarts", "reloads")])
    if len(rows) == 1:
        lines.append("no replicas")
    else:
        widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
        lines += ["  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip()
                  for row in rows]
    return "\n".join(lines)


def cmd_status(cfg: Config, *, as_json: bool) -> int:
    state_dir = cfg.model_pool.state_dir.resolve()
    control = _control(state_dir)
    data = None
    if control is not None:
        url, headers = control
        try:
            response = httpx.get(url + "/status", headers=headers,
                                 timeout=cfg.model_pool.health_timeout_s * 3)
            if response.status_code == 200:
                data = response.json()
            else:
                print(f"supervisor at {url} answered HTTP {response.status_code}: "
                      f"{response.text[:300]}", file=sys.stderr)
        except httpx.HTTPError as exc:
            print(f"supervisor at {url} does not answer: {exc}", file=sys.stderr)
    live = data is not None
    if data is None:
        data = _read_json(state_dir / ENDPOINTS_FILE)
        if data is None:
            print(f"no model pool runs from {state_dir} (no {ENDPOINTS_FILE})", file=sys.stderr)
            return 1
    print(json.dumps({"live": live, **data}, indent=1) if as_json
          else format_status(data, live=live))
    return 0 if live else 1


def cmd_reload(cfg: Config, checkpoint: str, *, wait: bool) -> int:
    state_dir = cfg.model_pool.state_dir.resolve()
    control = _control(state_dir)
    if control is None:
        print(f"no supervisor runs for {state_dir}; start `python run_model.py --config ...`",
              file=sys.stderr)
        return 1
    url, headers = control
    local = Path(checkpoint).expanduser()
    target = str(local.resolve()) if local.exists() else checkpoint  # the supervisor's cwd differs
    try:
        response = httpx.post(url + "/reload", json={"checkpoint": target}, headers=headers,
                              timeout=cfg.model_pool.health_timeout_s * 3)
    except httpx.HTTPError as exc:
        print(f"supervisor at {url} does not answer: {exc}", file=sys.stderr)
        return 1
    body = response.json()
    if response.status_code != 202:
        print(f"reload refused (HTTP {response.status_code}): {body.get('error')}",
              file=sys.stderr)
        return 1
    reload_id = body["reload"]["id"]
    print(f"reload #{reload_id}: {body['reload']['checkpoint']} "
          f"(version {body['reload']['version']})", flush=True)
    if not wait:
        return 0
    printed = 0
    while True:
        time.sleep(_CLIENT_POLL_S)
        try:
            status = httpx.get(url + "/status", headers=headers,
                               timeout=cfg.model_pool.health_timeout_s * 3).json()
        except (httpx.HTTPError, ValueError) as exc:
            print(f"lost the supervisor: {exc}", file=sys.stderr)
            return 1
        current = status.get("reload") or {}
        if current.get("id") != reload_id:
            print("the supervisor restarted; the reload's outcome is unknown", file=sys.stderr)
            return 1
        for item in current["replicas"][printed:]:
            print(f"  replica {item['index']}: {'ok' if item['ok'] else 'FAILED'} "
                  f"({item['mode']}, {item['seconds']} s)"
                  + (f": {item['error']}" if item.get("error") else ""), flush=True)
        printed = len(current["replicas"])
        if current["state"] != "running":
            print(f"reload #{reload_id} {current['state']} in {current['duration_s']} s"
                  + (f": {current['message']}" if current.get("message") else ""), flush=True)
            return 0 if current["state"] == "done" else 1


# --------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="run_model.py",
        description="Start and supervise the vLLM pool (default), show its status, or roll a "
                    "new checkpoint onto it.",
    )
    parser.add_argument("command", nargs="?", default="serve",
                        choices=["serve", "status", "reload"])
    add_config_arguments(parser)
    parser.add_argument("--checkpoint", help="reload: the new checkpoint; serve: overrides "
                        "model_pool.checkpoint")
    parser.add_argument("--watch", type=Path, metavar="DIR",
                        help="serve: poll DIR and roll out each newer checkpoint in it")
    parser.add_argument("--json", action="store_true", help="status: print JSON")
    parser.add_argument("--no-wait", action="store_true",
                        help="reload: return once the supervisor accepted the reload")
    args = parser.parse_args(argv)
    if args.command == "reload" and not args.checkpoint:
        parser.error("reload needs --checkpoint PATH")
    if args.watch is not None and args.command != "serve":
        parser.error("--watch goes with serve")
    if args.watch is not None and not args.watch.is_dir():
        parser.error(f"--watch {args.watch}: not a directory")
    if args.command == "serve" and args.checkpoint:
        args.overrides.append(f"model_pool.checkpoint={args.checkpoint}")
    cfg = config_from_args(args)
    logging.basicConfig(
        level=cfg.run.log_level, stream=sys.stderr,
        format="%(asctime)s run_model %(levelname)s %(message)s",
    )
    logging.getLogger("httpx").setLevel(logging.WARNING)
    if args.command == "status":
        return cmd_status(cfg, as_json=args.json)
    if args.command == "reload":
        return cmd_reload(cfg, args.checkpoint, wait=not args.no_wait)
    if not cfg.model_pool.checkpoint and args.watch is None:
        print("config error: model_pool.checkpoint is not set (set it, pass --checkpoint, "
              "or --watch DIR)", file=sys.stderr)
        return 2
    try:
        supervisor = Supervisor(cfg, watch_dir=args.watch)
    except ConfigError as exc:
        print(f"config error: {exc}", file=sys.stderr)
        return 2
    try:
        supervisor.acquire()
    except ModelUnavailable as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return asyncio.run(supervisor.run())


if __name__ == "__main__":
    raise SystemExit(main())
