"""What one replica runs: the vLLM OpenAI API server's command line and the environment for
its devices (its GPUs, or the CPU build sharing the cores), from ``model_pool``.

A vision-language checkpoint (a ``vision_config`` in its config.json) is started for the run's
requests: as many images per prompt as ``agent.history_images``, a context long enough for
them and the history (``request_budget``), and the image processor's pixel bounds equal to the
parser's (``agent.min_pixels`` / ``max_pixels``), so a click lands where the model pointed.
On the CPU build it also gets the isolated torchvision its model code needs (``vlm_cpu_site``),
on its ``PYTHONPATH`` only.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from cua_rollout.config import Config, ModelPoolConfig, secret_from_env
from cua_rollout.core.errors import ConfigError
from cua_rollout.core.vision import IMAGE_WRAPPER_TOKENS, image_tokens, smart_resize
from cua_rollout.model.fleet.checkpoints import is_vision_language, max_positions
from cua_rollout.model.fleet.processes import API_SERVER_MODULE

__all__ = [
    "PROMPT_TOKENS_BUDGET",
    "VLM_CPU_HOOK_DIR",
    "RequestShape",
    "check_checkpoint",
    "replica_command",
    "replica_env",
    "replica_tmp_root",
    "vlm_cpu_site",
]

log = logging.getLogger(__name__)

# Tokens allowed for the system message, the UI-TARS prompt and the task's instruction (the
# prompt is ~2 KB of text; a byte-level tokenizer spends at most a token per byte).
PROMPT_TOKENS_BUDGET = 4096
# sitecustomize.py declaring the torchvision operators the CUDA wheel's missing library
# would have: on the PYTHONPATH of vision-language replicas on the CPU build only.
VLM_CPU_HOOK_DIR = Path(__file__).resolve().parent / "vlm_cpu_site"
_VLM_SITE_NAME = "vlm-cpu-site"


@dataclass(frozen=True)
class RequestShape:
    """What the run's model requests hold, from the run's config: the limits a
    vision-language replica is started with follow from it."""

    screen_width: int
    screen_height: int
    images: int             # screenshots per request (agent.history_images)
    replies: int            # past replies per request (agent.history_texts)
    max_tokens: int         # per reply (model.sampling.max_tokens)
    min_pixels: int
    max_pixels: int

    @classmethod
    def of(cls, cfg: Config) -> RequestShape:
        return cls(cfg.desktops.screen_width, cfg.desktops.screen_height,
                   cfg.agent.history_images, cfg.agent.history_texts,
                   cfg.model.sampling.max_tokens, cfg.agent.min_pixels, cfg.agent.max_pixels)

    @property
    def tokens_per_image(self) -> int:
        return IMAGE_WRAPPER_TOKENS + image_tokens(
            self.screen_width, self.screen_height,
            min_pixels=self.min_pixels, max_pixels=self.max_pixels)

    def least_tokens(self) -> int:
        """What every full request needs at least: its images and one reply."""
        return self.images * self.tokens_per_image + self.max_tokens

    def budget(self) -> int:
        """The longest request the run can send: images, prompt, every past reply of the
        history window at ``max_tokens``, and the reply; rounded up to a multiple of 1024."""
        need = self.least_tokens() + PROMPT_TOKENS_BUDGET + self.replies * self.max_tokens
        return -(-need // 1024) * 1024

    def describe(self) -> str:
        h, w = smart_resize(self.screen_height, self.screen_width,
                            min_pixels=self.min_pixels, max_pixels=self.max_pixels)
        return (f"{self.images} screenshot(s) of {self.screen_width}x{self.screen_height} "
                f"(seen as {w}x{h}: {self.tokens_per_image} tokens each), "
                f"{self.replies} past replies and the reply of up to {self.max_tokens} tokens")


def _has_flag(args: list[str], flag: str) -> bool:
    return any(a == flag or a.startswith(flag + "=") for a in args)


def _vision_args(pool: ModelPoolConfig, checkpoint: str, shape: RequestShape) -> list[str]:
    """The image limit, context length and processor pixel bounds of a VLM replica; what
    ``extra_args`` sets itself is left to it. ``ConfigError`` when the run's requests cannot
    fit the context."""
    extra = pool.extra_args
    args: list[str] = []
    if not _has_flag(extra, "--limit-mm-per-prompt"):
        args += ["--limit-mm-per-prompt", json.dumps({"image": shape.images, "video": 0})]
    if not _has_flag(extra, "--mm-processor-kwargs"):
        args += ["--mm-processor-kwargs", json.dumps(
            {"min_pixels": shape.min_pixels, "max_pixels": shape.max_pixels})]
    if _has_flag(extra, "--max-model-len"):
        return args
    limit = max_positions(checkpoint)
    if pool.max_model_len is not None:
        length = pool.max_model_len
        if length < shape.least_tokens():
            raise ConfigError(
                f"model_pool.max_model_len {length} is too short for one request of this run: "
                f"{shape.describe()} need at least {shape.least_tokens()} tokens; raise it or "
                "lower agent.history_images / agent.max_pixels")
    else:
        length = shape.budget()
        if limit is not None and length > limit:
            if shape.least_tokens() + PROMPT_TOKENS_BUDGET > limit:
                raise ConfigError(
                    f"checkpoint {checkpoint} takes at most {limit} tokens, and a request of "
                    f"this run ({shape.describe()}) needs up to {length}: lower "
                    "agent.history_images, agent.max_pixels or model.sampling.max_tokens")
            log.warning("checkpoint %s takes at most %d tokens: --max-model-len %d, less than "
                        "the %d a full history of %s could need", checkpoint, limit, limit,
                        length, shape.describe())
            length = limit  # the history's replies are rarely all max_tokens long
    return [*args, "--max-model-len", str(length)]


def replica_command(pool: ModelPoolConfig, model_name: str, checkpoint: str, port: int,
                    devices: str | None, shape: RequestShape | None = None) -> list[str]:
    """``python -m vllm.entrypoints.openai.api_server ...`` serving ``checkpoint`` as
    ``model_name`` on ``pool.host:port``; for a vision-language checkpoint and a run of
    ``shape``, its limits; then ``pool.extra_args``."""
    cmd = [
        sys.executable, "-m", API_SERVER_MODULE,
        "--model", checkpoint,
        "--served-model-name", model_name,
        "--host", pool.host,
        "--port", str(port),
        "--tensor-parallel-size", str(pool.tensor_parallel_size),
    ]
    if devices is None and pool.cpu_enforce_eager and "--enforce-eager" not in pool.extra_args:
        cmd.append("--enforce-eager")
    if shape is not None and is_vision_language(checkpoint):
        cmd += _vision_args(pool, checkpoint, shape)
    elif pool.max_model_len is not None and not _has_flag(pool.extra_args, "--max-model-len"):
        cmd += ["--max-model-len", str(pool.max_model_len)]
    return cmd + list(pool.extra_args)


def vlm_cpu_site(pool: ModelPoolConfig) -> Path:
    """Where the isolated torchvision for vision-language replicas on the CPU build lives."""
    return Path(pool.vlm_cpu_site or Path(sys.prefix) / _VLM_SITE_NAME).expanduser().resolve()


def _vision_pythonpath(pool: ModelPoolConfig, devices: str | None, checkpoint: str) -> str | None:
    """The directories a vision-language replica on the CPU build puts first on its
    ``PYTHONPATH`` (None: not needed); ``ConfigError`` when the isolated torchvision is not
    installed."""
    if devices is not None or not is_vision_language(checkpoint) \
            or importlib.util.find_spec("torchvision") is not None:
        return None
    site = vlm_cpu_site(pool)
    if not (site / "torchvision").is_dir():
        raise ConfigError(
            f"checkpoint {checkpoint} is a vision-language model, and vLLM's CPU build needs "
            f"torchvision for it, installed apart from this environment in {site}: run "
            "`bash scripts/setup_env.sh --vlm` (or set model_pool.vlm_cpu_site)")
    return os.pathsep.join((str(VLM_CPU_HOOK_DIR), str(site)))


def check_checkpoint(pool: ModelPoolConfig, checkpoint: str, devices: str | None,
                     shape: RequestShape | None) -> None:
    """Raise ``ConfigError`` now if a replica of ``checkpoint`` could not be started for a
    run of ``shape`` (context too short, torchvision missing), rather than at each start."""
    replica_command(pool, "check", checkpoint, 1, devices, shape)
    _vision_pythonpath(pool, devices, checkpoint)


# vLLM puts ZeroMQ IPC sockets in TMPDIR, named by a uuid4 (37 characters with the slash);
# a socket's path has at most 107 bytes.
_TMP_DIR_MAX_CHARS = 107 - 37


def replica_tmp_root(state_dir: Path) -> Path:
    """Where the replicas' temp dirs live: ``<state_dir>/tmp``, or, when that path is too
    long for vLLM's sockets, a short directory of the system temp dir named after it."""
    root = Path(state_dir).resolve() / "tmp"
    if len(str(root)) + len("/replica-999") <= _TMP_DIR_MAX_CHARS:
        return root
    digest = hashlib.blake2b(str(root).encode(), digest_size=6).hexdigest()
    return Path(tempfile.gettempdir()) / f"cua-vllm-{digest}"


def replica_env(pool: ModelPoolConfig, devices: str | None, tmp_dir: Path,
                checkpoint: str | None = None) -> dict[str, str]:
    """This process's environment plus the replica's devices (or CPU threads), its own
    ``TMPDIR`` (``tmp_dir``, emptied here), and ``pool.env``. A vision-language
    ``checkpoint`` on the CPU build also gets the isolated torchvision (``ConfigError`` when
    it is not installed)."""
    env = dict(os.environ)
    env["PYTHONUNBUFFERED"] = "1"  # the log file shows what happened up to a crash
    extra_path = _vision_pythonpath(pool, devices, checkpoint) if checkpoint else None
    if extra_path:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (extra_path, env.get("PYTHONPATH")) if p)
    # vLLM leaves files in the temp dir (vllm_dist_*) when it is killed: give each replica
    # its own, emptied at every start, so nothing piles up in /tmp.
    shutil.rmtree(tmp_dir, ignore_errors=True)
    tmp_dir.mkdir(parents=True)
    env["TMPDIR"] = str(tmp_dir)
    if devices is not None:
        env["CUDA_VISIBLE_DEVICES"] = devices
    else:
        threads = pool.cpu_threads_per_replica or max(1, (os.cpu_count() or 1) // pool.replicas)
        env["VLLM_CPU_KVCACHE_SPACE"] = str(pool.cpu_kv_cache_space_gib)
        env["OMP_NUM_THREADS"] = str(threads)
        # Replicas share the cores: vLLM's default binding would pin each to all of them.
        env["VLLM_CPU_OMP_THREADS_BIND"] = "nobind"
    if pool.reload_in_place:
        env["VLLM_SERVER_DEV_MODE"] = "1"
    env.update(pool.env)
    key = secret_from_env(pool.api_key_env, "model_pool.api_key_env")
    if key:
        env["VLLM_API_KEY"] = key  # vLLM's --api-key, kept off the command line (ps shows it)
    return env
