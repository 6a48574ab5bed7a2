"""The checkpoint barrier's question (cua_rollout.model.fleet.watch.newest_not_served) on the states
run_model.py publishes: serving its newest checkpoint, or why not."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from cua_rollout.model.fleet.watch import newest_not_served


def _state(version: str = "ck-1", *, reload: dict | None = None, watch_dir: Path | None = None,
           checkpoint: str = "/ck/ck-1", replicas: list[dict[str, Any]] | None = None
           ) -> dict[str, Any]:
    replicas = replicas if replicas is not None else [
        {"healthy": True, "draining": False, "model_version": version}] * 2
    return {"model_version": version, "checkpoint": checkpoint, "reload": reload,
            "supervisor": {"watch_dir": str(watch_dir) if watch_dir else None},
            "endpoints": replicas}


def _checkpoint(path: Path, mtime: float) -> Path:
    path.mkdir(parents=True)
    for name in ("config.json", "model.safetensors"):
        (path / name).write_text("{}")
        os.utime(path / name, (mtime, mtime))
    return path


def test_a_pool_on_its_version_with_no_reload_is_serving_its_newest():
    assert newest_not_served(_state()) is None
    assert newest_not_served(_state(reload={"state": "done", "version": "ck-1"})) is None


def test_reasons_not_to_start_new_groups():
    assert "not readable" in newest_not_served(None)
    running = newest_not_served(_state(reload={"id": 4, "state": "running", "version": "ck-2",
                                               "batches_done": 1, "batches_total": 3}))
    assert running == "reload 4 to ck-2 under way (1/3 batches)"
    mixed = newest_not_served(_state(replicas=[
        {"healthy": True, "draining": False, "model_version": "ck-1"},
        {"healthy": True, "draining": False, "model_version": "ck-0"}]))
    assert mixed == "replicas serve ck-0, ck-1; the pool's checkpoint is ck-1"
    # Unhealthy and draining replicas do not count, either way.
    assert newest_not_served(_state(replicas=[
        {"healthy": True, "draining": False, "model_version": "ck-1"},
        {"healthy": False, "draining": False, "model_version": "ck-0"},
        {"healthy": True, "draining": True, "model_version": "ck-0"}])) is None
    assert newest_not_served(_state(replicas=[])) == "no replica is serving"


def test_a_newer_checkpoint_in_the_watched_directory_holds_new_groups(tmp_path):
    now = time.time()
    served = _checkpoint(tmp_path / "ck-1", now - 100)
    state = _state(watch_dir=tmp_path, checkpoint=str(served))
    assert newest_not_served(state) is None
    _checkpoint(tmp_path / "ck-2", now)
    assert newest_not_served(state) == f"ck-2 in {tmp_path} is newer than the served ck-1"
    # An older one (the pool was started on a newer checkpoint than the directory's) does not.
    assert newest_not_served(_state(watch_dir=tmp_path,
                                    checkpoint=str(_checkpoint(tmp_path / "x" / "ck-9",
                                                               now + 100)))) is None
