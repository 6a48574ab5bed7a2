"""Fixtures shared by integration modules."""

from __future__ import annotations

import json
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from cua_rollout.config import Config, load_config
from tests.support import REPO_ROOT, require_vlm_serving

DEMO_VLM = REPO_ROOT / "configs" / "demo_vlm.yaml"


@dataclass(frozen=True)
class TinyVlm:
    """A run_model.py pool (vLLM's CPU build) serving a tiny random Qwen2.5-VL built here."""

    cfg: Config   # demo_vlm.yaml with this pool's checkpoint, port, state dir and arguments
    url: str      # the replica's base URL


@pytest.fixture(scope="session")
def tiny_vlm() -> Iterator[TinyVlm]:
    """One pool for every module that needs a served VLM but not its own pool's start
    (test_vlm, test_gym_vlm, test_vlm_agents): a vLLM start is the slowest part of each,
    and the server is stateless between requests. Its arguments are the union of theirs:
    float32, the hermes tool-call parser (used only by requests that offer tools), and a
    directory screenshots may be read from by path."""
    require_vlm_serving()
    from cua_rollout.cli.tiny_models import build_tiny_vlm
    from cua_rollout.model.fleet.child import PoolChild

    tmp = Path(tempfile.mkdtemp(prefix="cua-vlm-"))
    try:
        model_dir = build_tiny_vlm(tmp / "tiny-vlm")
        media = tmp / "run"
        media.mkdir()
        cfg = load_config(DEMO_VLM, overrides=[
            f"run.output_dir={tmp / 'results'}", f"model_pool.state_dir={tmp / 'pool'}",
            f"model_pool.checkpoint={model_dir}", "model_pool.base_port=8170",
            "model_pool.extra_args=" + json.dumps(
                ["--dtype", "float32", "--enable-auto-tool-choice", "--tool-call-parser",
                 "hermes", "--allowed-local-media-path", str(media)])])
        with PoolChild(cfg, media, report=lambda line: None) as child:
            started = child.wait_ready()
            state = json.loads((tmp / "pool" / "endpoints.json").read_text())
            print(f"\ntiny VLM pool: healthy {started:.0f} s after start")
            yield TinyVlm(cfg, state["endpoints"][0]["url"])
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
