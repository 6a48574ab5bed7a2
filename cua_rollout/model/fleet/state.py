"""The files a fleet supervisor keeps in ``<model_pool.state_dir>``: their names, the schema of
``endpoints.json`` (read by every ModelServicePool) and ``control.json`` (read by the
``status``/``reload`` commands), and their atomic writers and readers. Light, stdlib only: the
model client imports this module, never the supervisor."""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NotRequired, TypedDict

from cua_rollout.core.files import read_json, write_atomic

__all__ = [
    "CONTROL_FILE",
    "ENDPOINTS_FILE",
    "LOCK_FILE",
    "LOG_DIR",
    "STATE_FORMAT",
    "ControlInfo",
    "EndpointEntry",
    "FleetState",
    "ReloadReplicaResult",
    "ReloadStatus",
    "SupervisorEntry",
    "fleet_summary",
    "read_control",
    "read_state",
    "write_control",
    "write_state",
]

ENDPOINTS_FILE = "endpoints.json"  # the published fleet (FleetState), for the model clients
CONTROL_FILE = "control.json"      # control URL + token of the live supervisor (mode 0600)
LOCK_FILE = "supervisor.lock"      # flock'ed while a supervisor owns the state dir
LOG_DIR = "logs"                   # one file per replica: replica-<index>.log
STATE_FORMAT = 1                   # FleetState["format"]


class EndpointEntry(TypedDict):
    """One replica in ``endpoints.json``; clients route to it while ``healthy`` and not
    ``draining``. ``status`` adds its requests ``running`` / ``waiting`` (None: no answer)."""

    index: int
    url: str
    healthy: bool
    draining: bool
    model_version: str
    checkpoint: str
    state: str              # starting serving draining reloading backoff stopped
    pid: int | None
    port: int
    devices: str | None     # CUDA_VISIBLE_DEVICES; None on the CPU build
    restarts: int
    reloads: int
    started_at: float | None
    startup_s: float | None
    last_exit: str | None
    log: str
    running: NotRequired[int | None]
    waiting: NotRequired[int | None]


class SupervisorEntry(TypedDict):
    pid: int
    control_url: str
    started_at: float
    state_dir: str
    watch_dir: str | None


class ReloadReplicaResult(TypedDict):
    index: int
    mode: str               # "in-place" or "restart"
    ok: bool
    seconds: float | None
    error: str | None


class ReloadStatus(TypedDict):
    """The last rolling reload; ``state`` is running, done or failed."""

    id: int
    checkpoint: str
    version: str
    state: str
    message: str
    started_at: float
    finished_at: float | None
    duration_s: float | None
    batches_total: int
    batches_done: int
    replicas: list[ReloadReplicaResult]


class FleetState(TypedDict):
    """``endpoints.json``. Once the supervisor has stopped: no endpoints, ``supervisor``
    None, and ``stopped_at``."""

    format: int
    updated_at: float
    model: str
    checkpoint: str
    model_version: str
    supervisor: SupervisorEntry | None
    reload: ReloadStatus | None
    endpoints: list[EndpointEntry]
    stopped_at: NotRequired[float]


@dataclass(frozen=True)
class ControlInfo:
    """``control.json``: where the live supervisor's control server listens, its bearer
    token, and the supervisor's pid."""

    url: str
    token: str
    pid: int | None


def write_state(state_dir: Path, state: FleetState | dict[str, Any], *,
                min_mtime_ns: int = 0) -> int:
    """Replace ``endpoints.json`` atomically; returns its mtime (ns), greater than
    ``min_mtime_ns``, so a client that watches the mtime never misses an update."""
    text = json.dumps(state, indent=1) + "\n"
    return write_atomic(state_dir / ENDPOINTS_FILE, text.encode(), min_mtime_ns=min_mtime_ns)


def read_state(state_dir: Path) -> dict[str, Any] | None:
    """``endpoints.json`` as a dict, or None when it is missing or not a JSON object."""
    data = read_json(state_dir / ENDPOINTS_FILE)
    return data if isinstance(data, dict) else None


def fleet_summary(state_dir: Path) -> dict[str, Any] | None:
    """Replicas by state, restarts and reloads of the fleet whose ``endpoints.json`` is in
    ``state_dir`` (run_model.py's supervisor), or None when there is none (yet)."""
    state = read_state(state_dir)
    if not state:
        return None
    replicas = state.get("endpoints") or []
    return {"replicas": dict(Counter(str(e.get("state")) for e in replicas)),
            "restarts": sum(int(e.get("restarts") or 0) for e in replicas),
            "reloads": sum(int(e.get("reloads") or 0) for e in replicas),
            "model_version": state.get("model_version")}


def write_control(state_dir: Path, info: ControlInfo) -> None:
    """Write ``control.json``, readable by its owner only (it holds the token)."""
    text = json.dumps({"url": info.url, "token": info.token, "pid": info.pid})
    write_atomic(state_dir / CONTROL_FILE, text.encode(), mode=0o600)


def read_control(state_dir: Path) -> ControlInfo | None:
    """What ``control.json`` says, or None when it is missing, broken or has no URL (it
    does not say whether that supervisor still runs)."""
    data = read_json(state_dir / CONTROL_FILE)
    if not isinstance(data, dict) or "url" not in data:
        return None
    pid = data.get("pid")
    return ControlInfo(str(data["url"]), str(data.get("token", "")),
                       pid if isinstance(pid, int) else None)
