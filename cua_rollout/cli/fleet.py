"""The bodies of ``run_model.py``'s commands: ``serve`` (run a supervisor until a signal),
``status`` (ask the live supervisor, else show the last published state) and ``reload`` (start
a rolling reload and follow it); each prints its one-line errors and returns the exit code."""

from __future__ import annotations

import asyncio
import json
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from cua_rollout.config import Config
from cua_rollout.core.errors import ConfigError, FleetError
from cua_rollout.core.http import error_text
from cua_rollout.model.fleet.control import ENDPOINTS_PATH, ControlClient, ControlServer
from cua_rollout.model.fleet.launch import RequestShape
from cua_rollout.model.fleet.state import ENDPOINTS_FILE, read_state
from cua_rollout.model.fleet.supervisor import Supervisor

__all__ = ["cmd_make_tiny_vlm", "cmd_reload", "cmd_serve", "cmd_status", "format_status"]

_CLIENT_POLL_S = 0.5  # how often ``reload`` polls the supervisor for progress


def _control_timeout_s(cfg: Config) -> float:
    return cfg.model_pool.health_timeout_s * 3


def cmd_make_tiny_vlm(directory: Path) -> int:
    """Write the tiny random Qwen2.5-VL of ``cua_rollout.cli.tiny_models`` to ``directory``."""
    from cua_rollout.cli.tiny_models import build_tiny_vlm

    if directory.exists() and any(directory.iterdir()):
        print(f"error: {directory} exists and is not empty", file=sys.stderr)
        return 1
    build_tiny_vlm(directory)
    print(f"wrote a tiny random Qwen2.5-VL to {directory} (serve it with model_pool.checkpoint; "
          "its replies are random)")
    return 0


def cmd_serve(cfg: Config, watch_dir: Path | None) -> int:
    """Start the replicas and supervise them until SIGTERM / SIGINT."""
    if not cfg.model_pool.checkpoint and watch_dir is None:
        print("config error: model_pool.checkpoint is not set (set it, pass --checkpoint, "
              "or --watch DIR)", file=sys.stderr)
        return 2
    try:
        supervisor = Supervisor(cfg.model_pool, cfg.model.name, watch_dir=watch_dir,
                                shape=RequestShape.of(cfg))
    except ConfigError as exc:
        print(f"config error: {exc}", file=sys.stderr)
        return 2
    try:
        supervisor.acquire()
    except FleetError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    try:
        return asyncio.run(supervisor.run(ControlServer(supervisor)))
    except FleetError as exc:  # e.g. the control server did not start: one line, not a trace
        print(f"error: {exc}", file=sys.stderr)
        return 1


def _fmt(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    return str(value)


def format_status(data: dict[str, Any], *, live: bool) -> str:
    """The human-readable ``status``: supervisor, model, last reload, one row per replica."""
    sup = data.get("supervisor") or {}
    lines = []
    if live:
        up_s = time.time() - float(sup.get("started_at") or time.time())
        lines.append(f"supervisor: pid {sup.get('pid')}, up {up_s:.0f} s, "
                     f"control {sup.get('control_url')}, endpoint list "
                     f"{sup.get('control_url')}{ENDPOINTS_PATH} (model.endpoints_url)")
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
    """Print the live supervisor's status (exit 0), else the last published state (exit 1)."""
    state_dir = cfg.model_pool.state_dir.resolve()
    client = ControlClient.find(state_dir, _control_timeout_s(cfg))
    data = None
    if client is not None:
        try:
            response = client.status()
            if response.status_code == 200:
                data = response.json()
            else:
                print(f"supervisor at {client.url} answered HTTP {response.status_code}: "
                      f"{response.text[:300]}", file=sys.stderr)
        except httpx.HTTPError as exc:
            print(f"supervisor at {client.url} does not answer: {exc}", file=sys.stderr)
    live = data is not None
    if data is None:
        data = read_state(state_dir)
        if data is None:
            print(f"no model pool runs from {state_dir} (no {ENDPOINTS_FILE})", file=sys.stderr)
            return 1
    print(json.dumps({"live": live, **data}, indent=1) if as_json
          else format_status(data, live=live))
    return 0 if live else 1


def cmd_reload(cfg: Config, checkpoint: str, *, wait: bool, batch: int | None = None) -> int:
    """Ask the live supervisor to roll ``checkpoint`` out; with ``wait``, print each replica
    as it is done and exit 0 only if every one reloaded."""
    state_dir = cfg.model_pool.state_dir.resolve()
    client = ControlClient.find(state_dir, _control_timeout_s(cfg))
    if client is None:
        print(f"no supervisor runs for {state_dir}; start `python run_model.py --config ...`",
              file=sys.stderr)
        return 1
    local = Path(checkpoint).expanduser()
    target = str(local.resolve()) if local.exists() else checkpoint  # the supervisor's cwd differs
    try:
        response = client.reload(target, batch)
    except httpx.HTTPError as exc:
        print(f"supervisor at {client.url} does not answer: {exc}", file=sys.stderr)
        return 1
    if response.status_code != 202:
        print(f"reload refused (HTTP {response.status_code}): {error_text(response)}",
              file=sys.stderr)
        return 1
    body = response.json()
    reload_id = body["reload"]["id"]
    print(f"reload #{reload_id}: {body['reload']['checkpoint']} "
          f"(version {body['reload']['version']})", flush=True)
    if not wait:
        return 0
    printed = 0
    while True:
        time.sleep(_CLIENT_POLL_S)
        try:
            status = client.status().json()
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
