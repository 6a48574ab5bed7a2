"""The fleet supervisor: starts the replicas, restarts those that die or hang (with backoff),
publishes them in ``endpoints.json``, and rolls a new checkpoint onto them batch by batch.
Its methods return values; the control server maps them to HTTP.

One file on purpose: the supervision state machine (start, health, restart with backoff,
rolling reload) whose transitions share the replicas table and the state directory it locks."""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import os
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from cua_rollout.config import ModelPoolConfig, secret_from_env
from cua_rollout.core.aio import TaskSet
from cua_rollout.core.errors import ConfigError, FleetError
from cua_rollout.core.files import DirectoryLock, LockHeld
from cua_rollout.core.http import reachable_host
from cua_rollout.model.fleet.checkpoints import (
    checkpoint_version,
    resolve_checkpoint,
    same_architecture,
)
from cua_rollout.model.fleet.devices import assign_devices, choose_port, detect_gpus, port_is_free
from cua_rollout.model.fleet.launch import (
    RequestShape,
    check_checkpoint,
    replica_command,
    replica_env,
    replica_tmp_root,
)
from cua_rollout.model.fleet.processes import (
    exit_status,
    log_tail,
    signal_group,
    signal_name,
    spawn,
    stop_group,
    sweep_stale_replicas,
)
from cua_rollout.model.fleet.replica_api import ReplicaAPI
from cua_rollout.model.fleet.state import (
    CONTROL_FILE,
    ENDPOINTS_FILE,
    LOCK_FILE,
    LOG_DIR,
    STATE_FORMAT,
    ControlInfo,
    EndpointEntry,
    FleetState,
    ReloadReplicaResult,
    ReloadStatus,
    write_control,
    write_state,
)
from cua_rollout.model.fleet.watch import first_checkpoint, watch_checkpoints
from cua_rollout.model.openai_protocol import HEALTH_PATH

__all__ = [
    "ControlService",
    "ReloadOutcome",
    "ReloadRefusal",
    "Replica",
    "Supervisor",
    "restart_delay_s",
]

log = logging.getLogger(__name__)

_POLL_S = 0.2                # period of process-exit checks and of waits on busy replicas
_STARTUP_POLL_S = 0.5        # /health polling while a replica starts
_DRAIN_POLL_S = 0.25         # /metrics polling while a replica drains
_DRAIN_ZERO_SAMPLES = 2      # consecutive idle samples before a replica counts as drained


def restart_delay_s(pool: ModelPoolConfig, consecutive_failures: int) -> float:
    """Capped exponential backoff before restart number ``consecutive_failures`` (1, 2 ...).

    No jitter: each replica fails on its own clock, and the delays are pinned by a test."""
    exponent = max(0, consecutive_failures - 1)
    return min(pool.restart_backoff.max_s, pool.restart_backoff.initial_s * 2.0 ** exponent)


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

    def entry(self) -> EndpointEntry:
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


class ReloadRefusal(enum.Enum):
    """Why ``Supervisor.request_reload`` did not start a reload."""

    BUSY = "busy"                      # another reload is running; try again later
    NOT_STARTED = "not started"        # the replicas are not started yet
    BAD_CHECKPOINT = "bad checkpoint"  # no such checkpoint, or it cannot be read


@dataclass(frozen=True)
class ReloadOutcome:
    """What ``request_reload`` did: started ``reload`` (``refused`` is None), or refused it
    for the reason ``refused``, told in ``error``; ``reload`` is then the reload already
    running when that is the reason."""

    reload: ReloadStatus | None
    refused: ReloadRefusal | None = None
    error: str = ""


class ControlService(Protocol):
    """The control server the supervisor runs while it serves (``cua_rollout.model.fleet.control``);
    clients authenticate with ``token``, which the supervisor writes to ``control.json``."""

    token: str

    def start(self, loop: asyncio.AbstractEventLoop) -> str:
        """Start serving requests on ``loop`` (the supervisor's); the URL. Raises
        ``FleetError`` when it cannot."""
        ...

    def stop(self) -> None: ...


class Supervisor:
    """Starts the replicas, keeps them alive, publishes them, and reloads checkpoints.

    Everything runs on one asyncio loop in the main thread (replicas are spawned from it,
    which ``PR_SET_PDEATHSIG`` requires); the control server runs in a thread and hands
    each request to that loop.
    """

    def __init__(self, pool: ModelPoolConfig, model_name: str, *,
                 watch_dir: Path | None = None, shape: RequestShape | None = None) -> None:
        self.pool = pool
        self.model_name = model_name
        self.state_dir = pool.state_dir.resolve()
        self.watch_dir = watch_dir.resolve() if watch_dir is not None else None
        self.checkpoint = resolve_checkpoint(pool.checkpoint) if pool.checkpoint else ""
        self.version = checkpoint_version(self.checkpoint) if self.checkpoint else ""
        self.replicas: list[Replica] = []
        self.reload_status: ReloadStatus | None = None
        self.started_at = time.time()
        self.control_url = ""
        self.devices = assign_devices(
            pool.replicas, pool.tensor_parallel_size, pool.gpu_ids,
            detect_gpus(), os.environ.get("CUDA_VISIBLE_DEVICES"),
        )
        # A key named but not set fails now, not at each replica's start.
        self.replica_key = secret_from_env(pool.api_key_env, "model_pool.api_key_env")
        self.published: FleetState | None = None  # what endpoints.json holds now
        self.shape = shape  # the run's requests: a vision-language replica's limits
        if self.checkpoint:  # a checkpoint no replica could serve fails now, not per start
            check_checkpoint(pool, self.checkpoint, self.devices[0] if self.devices else None,
                             shape)
        self._control: ControlService | None = None
        self._lock: DirectoryLock | None = None  # held for the supervisor's life
        self._api: ReplicaAPI | None = None
        self._stopping: asyncio.Event | None = None
        self._force = False
        self._reload_task: asyncio.Task[None] | None = None
        self._reload_seq = 0
        self._tasks = TaskSet()
        self._mtime_ns = 0

    # ----------------------------------------------------------------- life cycle

    def acquire(self) -> None:
        """Own the state dir (one supervisor per state dir) and stop stale replicas.
        Raises ``FleetError`` when another supervisor owns it."""
        self.state_dir.mkdir(parents=True, exist_ok=True)
        (self.state_dir / LOG_DIR).mkdir(exist_ok=True)
        try:
            self._lock = DirectoryLock(self.state_dir, LOCK_FILE).acquire()
        except LockHeld as exc:
            raise FleetError(
                f"another run_model.py ({exc.holder}) already supervises {self.state_dir}"
            ) from None
        sweep_stale_replicas(self.state_dir, self.pool.stop_timeout_s)

    async def run(self, control: ControlService) -> int:
        """Serve until SIGTERM / SIGINT, with ``control`` answering for it; the exit code."""
        loop = asyncio.get_running_loop()
        self._stopping = asyncio.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._on_signal, sig)
        self._api = ReplicaAPI(self.pool.health_timeout_s)
        self._control = control
        self.control_url = control.start(loop)
        write_control(self.state_dir, ControlInfo(self.control_url, control.token, os.getpid()))
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
            log.warning("%s again: killing the replicas now", signal_name(sig))
            self._force = True
            for r in self.replicas:
                if r.proc is not None:
                    signal_group(r.proc.pid, signal.SIGKILL)
            return
        log.info("%s received: stopping the replicas", signal_name(sig))
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
        tmp_root = replica_tmp_root(self.state_dir)
        if not tmp_root.is_relative_to(self.state_dir):  # the short one in the system's
            shutil.rmtree(tmp_root, ignore_errors=True)
        if self._control is not None:
            self._control.stop()
        if self._api is not None:
            await self._api.aclose()
        log.info("all replicas stopped")

    async def _serve(self) -> int:
        if not self.checkpoint:
            assert self.watch_dir is not None
            found = await first_checkpoint(self.watch_dir, self.pool.watch_interval_s)
            self.checkpoint = str(found)
            self.version = checkpoint_version(self.checkpoint)
        taken: set[int] = set()
        port = self.pool.base_port
        for i in range(self.pool.replicas):
            port = choose_port(self.pool.host, port, taken)
            taken.add(port)
            self.replicas.append(Replica(
                index=i,
                devices=self.devices[i] if self.devices else None,
                port=port,
                url=f"http://{reachable_host(self.pool.host)}:{port}",
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
            loops.append(watch_checkpoints(
                self.watch_dir, self.checkpoint, self.pool.watch_interval_s,
                busy=self._reload_running, roll_out=self._roll_out_watched,
            ))
        await asyncio.gather(*loops)
        return 0

    # ----------------------------------------------------------------- one replica

    async def _start(self, r: Replica) -> bool:
        """Launch ``r`` and wait for its ``/health``; on failure it is stopped again."""
        taken = {o.port for o in self.replicas if o is not r}
        if r.port in taken or not port_is_free(self.pool.host, r.port):
            r.port = choose_port(self.pool.host, self.pool.base_port, taken)
            r.url = f"http://{reachable_host(self.pool.host)}:{r.port}"
        cmd = replica_command(self.pool, self.model_name, r.checkpoint, r.port, r.devices,
                              self.shape)
        env = replica_env(self.pool, r.devices,
                          replica_tmp_root(self.state_dir) / f"replica-{r.index}", r.checkpoint)
        r.proc = spawn(cmd, env, r.log_path)
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
        status = exit_status(r.proc) or f"no /health within {self.pool.startup_timeout_s:.0f} s"
        r.last_exit = status
        log.error("replica %d failed to start (%s); end of %s:\n%s",
                  r.index, status, r.log_path, log_tail(r.log_path))
        await self._stop(r)
        r.state = "backoff"
        self._publish()
        return False

    async def _wait_healthy(self, r: Replica, timeout_s: float) -> bool:
        assert self._api is not None
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if r.proc is None or exit_status(r.proc) is not None:
                return False
            if await self._api.healthy(r.url + HEALTH_PATH):
                return True
            await asyncio.sleep(_STARTUP_POLL_S)
        return False

    async def _stop(self, r: Replica) -> None:
        """Stop a replica's whole process group and reap it.

        A serving replica gets SIGTERM on its API server, which shuts its engine down in
        order; an orphaned group (the server died) gets SIGTERM on every process; a replica
        still starting is killed at once (vLLM cannot stop cleanly while it initialises).
        """
        proc = r.proc
        if proc is None:
            return
        graceful = r.healthy and r.state in ("serving", "draining", "reloading")
        r.healthy = False
        await stop_group(proc, graceful=graceful, orphans_first=r.state != "starting",
                         timeout_s=self.pool.stop_timeout_s, forced=lambda: self._force)
        r.proc = None

    async def _load(self, r: Replica) -> tuple[int, int] | None:
        """(running, waiting) requests of a replica, None if it does not answer."""
        if r.proc is None or self._api is None:
            return None
        return await self._api.load(r.url)

    # ----------------------------------------------------------------- supervision

    def _schedule_restart(self, r: Replica) -> None:
        r.consecutive_failures += 1
        delay = restart_delay_s(self.pool, r.consecutive_failures)
        r.state, r.healthy, r.restart_at = "backoff", False, time.monotonic() + delay
        log.info("replica %d restarts in %.1f s", r.index, delay)
        self._publish()

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
                    status = exit_status(r.proc)
                    if status is not None:
                        r.healthy, r.busy, r.state = False, True, "backoff"
                        self._publish()  # clients stop routing to it before anything else
                        self._tasks.spawn(self._on_death(r, status))
                elif r.state == "backoff" and now >= r.restart_at:
                    r.busy = True
                    self._tasks.spawn(self._restart(r))
            await asyncio.sleep(_POLL_S)

    async def _on_death(self, r: Replica, status: str) -> None:
        assert r.proc is not None
        pid = r.proc.pid
        try:
            r.last_exit = status
            log.warning("replica %d (pid %d, port %d) died: %s; end of %s:\n%s",
                        r.index, pid, r.port, status, r.log_path, log_tail(r.log_path))
            await self._stop(r)  # its engine processes
            self._schedule_restart(r)
        finally:
            r.busy = False

    async def _check_health(self) -> None:
        """Restart replicas that run but stopped answering ``/health`` (hung)."""
        assert self._api is not None
        api = self._api
        while True:
            await asyncio.sleep(self.pool.health_interval_s)
            serving = [r for r in self.replicas
                       if not r.busy and r.proc is not None and r.state == "serving"]
            results = await asyncio.gather(
                *(api.healthy(r.url + HEALTH_PATH) for r in serving))
            for r, ok in zip(serving, results, strict=True):
                if r.busy or r.proc is None or r.state != "serving":
                    continue
                if ok:
                    r.health_failures = 0
                    stable_s = time.monotonic() - (r.healthy_since or time.monotonic())
                    if stable_s >= self.pool.restart_backoff.max_s:
                        r.consecutive_failures = 0
                    continue
                r.health_failures += 1
                if r.health_failures >= self.pool.health_failures_to_restart:
                    log.warning("replica %d failed %d health checks in a row: restarting it",
                                r.index, r.health_failures)
                    r.healthy, r.busy, r.last_exit = False, True, "hung"
                    self._publish()
                    self._tasks.spawn(self._restart(r, stop_first=True))

    # ----------------------------------------------------------------- reload

    def _reload_running(self) -> bool:
        return self._reload_task is not None and not self._reload_task.done()

    def request_reload(self, checkpoint: str, batch: int | None = None) -> ReloadOutcome:
        """Start a rolling reload onto ``checkpoint`` (call it on the supervisor's loop),
        ``batch`` replicas at a time (None: ``model_pool.reload_batch``). One runs at a time;
        a refusal says why."""
        if self._reload_running():
            running = self.reload_status
            where = running["checkpoint"] if running is not None else None
            return ReloadOutcome(running, ReloadRefusal.BUSY,
                                 f"a reload to {where} is already running")
        if not self.replicas:
            return ReloadOutcome(None, ReloadRefusal.NOT_STARTED,
                                 "the replicas are not started yet")
        try:
            ckpt = resolve_checkpoint(checkpoint)
            version = checkpoint_version(ckpt)
            check_checkpoint(self.pool, ckpt, self.devices[0] if self.devices else None,
                             self.shape)
        except (ConfigError, OSError) as exc:
            return ReloadOutcome(None, ReloadRefusal.BAD_CHECKPOINT, str(exc))
        self._reload_seq += 1
        self.reload_status = {
            "id": self._reload_seq, "checkpoint": ckpt, "version": version,
            "state": "running", "message": "", "started_at": time.time(),
            "finished_at": None, "duration_s": None, "batches_total": 0, "batches_done": 0,
            "replicas": [],
        }
        self._reload_task = asyncio.create_task(
            self._rolling_reload(ckpt, self.reload_status, batch or self.pool.reload_batch))
        return ReloadOutcome(self.reload_status)

    async def _roll_out_watched(self, checkpoint: str) -> None:
        """``--watch`` found ``checkpoint``: reload onto it and wait until that is over."""
        outcome = self.request_reload(checkpoint)
        if outcome.refused is not None:
            log.error("--watch: cannot roll out %s: %s", checkpoint, outcome.error)
            return
        log.info("--watch: new checkpoint %s", checkpoint)
        assert self._reload_task is not None
        await asyncio.shield(self._reload_task)

    async def _rolling_reload(self, ckpt: str, status: ReloadStatus, n: int) -> None:
        version = status["version"]
        t0 = time.monotonic()
        log.info("reload %d: rolling %s (version %s) onto %d replica(s), %d at a time",
                 status["id"], ckpt, version, len(self.replicas), n)
        try:
            todo = [r for r in self.replicas if (r.checkpoint, r.version) != (ckpt, version)]
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
    ) -> list[ReloadReplicaResult]:
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
    ) -> ReloadReplicaResult:
        t0 = time.monotonic()
        old = (r.checkpoint, r.version)
        result: ReloadReplicaResult = {"index": r.index, "mode": "restart", "ok": False,
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
        assert self._api is not None
        return await self._api.reload_weights(
            r.index, r.url, ckpt, pause_timeout_s=self.pool.drain_timeout_s,
            reload_timeout_s=self.pool.startup_timeout_s,
        )

    # ----------------------------------------------------------------- state

    def snapshot(self) -> FleetState:
        """What ``endpoints.json`` holds."""
        return {
            "format": STATE_FORMAT,
            "updated_at": time.time(),
            "model": self.model_name,
            "checkpoint": self.checkpoint,
            "model_version": self.version,
            "supervisor": {"pid": os.getpid(), "control_url": self.control_url,
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
        self._mtime_ns = write_state(self.state_dir, data, min_mtime_ns=self._mtime_ns)
        self.published = data

    async def status(self) -> FleetState:
        """The snapshot plus each replica's requests running / waiting (vLLM /metrics)."""
        data = self.snapshot()
        loads = await asyncio.gather(*(self._load(r) for r in self.replicas))
        for entry, load in zip(data["endpoints"], loads, strict=True):
            entry["running"], entry["waiting"] = load if load is not None else (None, None)
        return data
