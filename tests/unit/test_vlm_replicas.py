"""How run_model.py starts a vision-language replica: the limits derived from the run's
config (images per prompt, context length, the processor's pixel bounds), the isolated
torchvision on its PYTHONPATH only (CPU build), and the errors naming what is wrong."""

from __future__ import annotations

import importlib.util
import json
import os
import tempfile
import uuid
from pathlib import Path

import pytest

from cua_rollout.agents.uitars.grammar import check_max_tokens
from cua_rollout.config import Config, ModelPoolConfig, load_config
from cua_rollout.core.errors import ConfigError
from cua_rollout.core.vision import MAX_PIXELS, MIN_PIXELS
from cua_rollout.model.fleet.launch import (
    PROMPT_TOKENS_BUDGET,
    VLM_CPU_HOOK_DIR,
    RequestShape,
    check_checkpoint,
    replica_command,
    replica_env,
)
from tests.support import REPO_ROOT


def _checkpoint(path: Path, *, vision: bool, positions: int = 32768) -> str:
    path.mkdir(parents=True)
    config: dict = {"architectures": ["Qwen2ForCausalLM"], "max_position_embeddings": positions}
    if vision:
        config = {"architectures": ["Qwen2_5_VLForConditionalGeneration"],
                  "text_config": {"max_position_embeddings": positions},
                  "vision_config": {"depth": 1}}
    (path / "config.json").write_text(json.dumps(config))
    return str(path)


def _shape(**kw) -> RequestShape:
    base = dict(screen_width=1280, screen_height=720, images=5, replies=35, max_tokens=500,
                min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS)
    base.update(kw)
    return RequestShape(**base)


def _flag(cmd: list[str], name: str) -> str | None:
    return cmd[cmd.index(name) + 1] if name in cmd else None


def test_a_vlm_replica_is_started_for_the_runs_requests(tmp):
    ckpt = _checkpoint(tmp / "vl", vision=True)
    shape = _shape()
    cmd = replica_command(ModelPoolConfig(), "m", ckpt, 8100, None, shape)
    assert json.loads(_flag(cmd, "--limit-mm-per-prompt")) == {"image": 5, "video": 0}
    assert json.loads(_flag(cmd, "--mm-processor-kwargs")) == {
        "min_pixels": MIN_PIXELS, "max_pixels": MAX_PIXELS}
    # 5 x (1196 + 2) image tokens, the prompt, 35 past replies and the reply of 500 tokens.
    need = 5 * 1198 + PROMPT_TOKENS_BUDGET + 35 * 500 + 500
    length = int(_flag(cmd, "--max-model-len"))
    assert length == shape.budget() and need <= length < need + 1024 and length % 1024 == 0


def test_a_text_replica_gets_none_of_it(tmp):
    ckpt = _checkpoint(tmp / "text", vision=False)
    cmd = replica_command(ModelPoolConfig(), "m", ckpt, 8100, None, _shape())
    assert not {"--limit-mm-per-prompt", "--mm-processor-kwargs", "--max-model-len"} & set(cmd)
    env = replica_env(ModelPoolConfig(), None, tmp / "t", ckpt)
    assert str(VLM_CPU_HOOK_DIR) not in env.get("PYTHONPATH", "")


def test_what_extra_args_set_wins(tmp):
    ckpt = _checkpoint(tmp / "vl", vision=True)
    pool = ModelPoolConfig(extra_args=["--max-model-len", "9000",
                                       "--limit-mm-per-prompt", '{"image": 2}'])
    cmd = replica_command(pool, "m", ckpt, 8100, None, _shape())
    assert cmd.count("--max-model-len") == 1 and _flag(cmd, "--max-model-len") == "9000"
    assert cmd.count("--limit-mm-per-prompt") == 1
    explicit = replica_command(ModelPoolConfig(max_model_len=12000), "m", ckpt, 1, None,
                               _shape())
    assert _flag(explicit, "--max-model-len") == "12000"


def test_a_context_the_runs_requests_cannot_fit_is_a_config_error(tmp):
    ckpt = _checkpoint(tmp / "short", vision=True, positions=4096)
    with pytest.raises(ConfigError, match=r"takes at most 4096 tokens.*history_images"):
        check_checkpoint(ModelPoolConfig(), ckpt, None, _shape())
    with pytest.raises(ConfigError, match=r"max_model_len 3000 is too short.*need at least"):
        check_checkpoint(ModelPoolConfig(max_model_len=3000), ckpt, None, _shape())
    # A model whose context holds the images and prompt but not a full history of 35
    # replies of 500 tokens: its own limit, not a refusal.
    ckpt = _checkpoint(tmp / "mid", vision=True, positions=16384)
    cmd = replica_command(ModelPoolConfig(), "m", ckpt, 1, None, _shape())
    assert _flag(cmd, "--max-model-len") == "16384"


@pytest.mark.skipif(importlib.util.find_spec("torchvision") is not None,
                    reason="torchvision is importable here: no isolated copy is needed")
def test_the_isolated_torchvision_goes_to_cpu_vlm_replicas_only(tmp):
    ckpt = _checkpoint(tmp / "vl", vision=True)
    site = tmp / "site"
    (site / "torchvision").mkdir(parents=True)
    pool = ModelPoolConfig(vlm_cpu_site=site)
    env = replica_env(pool, None, tmp / "t", ckpt)
    assert env["PYTHONPATH"].split(os.pathsep)[:2] == [str(VLM_CPU_HOOK_DIR), str(site)]
    assert (VLM_CPU_HOOK_DIR / "sitecustomize.py").is_file()
    # GPUs: vLLM's own torchvision works there.
    assert "PYTHONPATH" not in replica_env(pool, "0", tmp / "t", ckpt) or str(site) not in \
        replica_env(pool, "0", tmp / "t", ckpt)["PYTHONPATH"]
    # Never in this (the project's) environment.
    assert importlib.util.find_spec("torchvision") is None
    missing = ModelPoolConfig(vlm_cpu_site=tmp / "nothing")
    with pytest.raises(ConfigError, match=r"vision-language model.*setup_env.sh --vlm"):
        replica_env(missing, None, tmp / "t", ckpt)
    with pytest.raises(ConfigError, match=r"setup_env\.sh --vlm"):
        check_checkpoint(missing, ckpt, None, _shape())


def test_the_request_shape_is_the_runs():
    cfg = load_config(REPO_ROOT / "configs" / "demo_vlm.yaml")
    shape = RequestShape.of(cfg)
    assert (shape.screen_width, shape.screen_height, shape.images) == (1280, 720, 5)
    assert shape.tokens_per_image == 1198
    assert "5 screenshot(s) of 1280x720 (seen as 1288x728: 1198 tokens each)" in \
        shape.describe()


def test_config_rules_of_the_vlm_settings():
    # Checked at a run's start (the grammar is the agent's, not the schema's).
    with pytest.raises(ConfigError, match=r"max_tokens \(20\) must be at least"):
        check_max_tokens(Config.model_validate(
            {"agent": {"constrain_actions": True}, "model": {"sampling": {"max_tokens": 20}}}
        ).model.sampling.max_tokens)
    with pytest.raises(ValueError, match=r"start_with_run needs model_pool\.checkpoint"):
        Config.model_validate({"model_pool": {"start_with_run": True}})
    with pytest.raises(ValueError, match=r"excludes model\.scripted"):
        Config.model_validate({"model": {"scripted": True},
                               "model_pool": {"start_with_run": True, "checkpoint": "x"}})
    # The parser's defaults are the agent settings' defaults.
    assert (Config().agent.min_pixels, Config().agent.max_pixels) == (MIN_PIXELS, MAX_PIXELS)


def test_a_replica_key_goes_to_its_environment_never_its_command_line(tmp, monkeypatch):
    ckpt = _checkpoint(tmp / "text", vision=False)
    monkeypatch.setenv("POOL_TEST_KEY", "sk-pool-secret")
    pool = ModelPoolConfig(api_key_env="POOL_TEST_KEY")
    cmd = replica_command(pool, "m", ckpt, 8100, None, _shape())
    assert "sk-pool-secret" not in " ".join(cmd) and "--api-key" not in cmd
    assert replica_env(pool, None, tmp / "t", ckpt)["VLLM_API_KEY"] == "sk-pool-secret"
    assert "VLLM_API_KEY" not in replica_env(ModelPoolConfig(), None, tmp / "t", ckpt) or \
        replica_env(ModelPoolConfig(), None, tmp / "t", ckpt)["VLLM_API_KEY"] != "sk-pool-secret"
    monkeypatch.delenv("POOL_TEST_KEY")
    with pytest.raises(ConfigError, match=r"model_pool\.api_key_env names \$POOL_TEST_KEY"):
        replica_env(pool, None, tmp / "t", ckpt)


def test_replicas_reachable_from_other_hosts_need_a_key():
    with pytest.raises(ValueError, match=r"model_pool\.host '0\.0\.0\.0' is reachable"):
        Config.model_validate({"model_pool": {"host": "0.0.0.0", "reload_in_place": False}})
    with pytest.raises(ValueError, match=r"set model\.api_key_env"):
        Config.model_validate({"model_pool": {"host": "0.0.0.0", "reload_in_place": False,
                                              "api_key_env": "K"}})
    cfg = Config.model_validate({"model_pool": {"host": "0.0.0.0", "reload_in_place": False,
                                                "api_key_env": "K"},
                                 "model": {"api_key_env": "K"}})
    assert cfg.model_pool.api_key_env == "K"


def test_replica_temp_dirs_stay_short_enough_for_vllm_sockets(tmp_path):
    from cua_rollout.model.fleet.launch import replica_tmp_root

    assert replica_tmp_root(Path("/srv/pool")) == Path("/srv/pool/tmp")
    deep = tmp_path / ("d" * 60) / "pool"
    root = replica_tmp_root(deep)
    assert root.parent == Path(tempfile.gettempdir()) and root.name.startswith("cua-vllm-")
    assert root == replica_tmp_root(deep)  # the same pool, the same dir
    assert len(f"{root}/replica-0/{uuid.uuid4()}") <= 107  # vLLM's IPC socket path
