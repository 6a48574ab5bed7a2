"""What one replica runs: the vLLM OpenAI API server's command line and the environment for
its devices (its GPUs, or the CPU build sharing the cores), from ``model_pool``."""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

from config import ModelPoolConfig
from rollout.fleet.processes import API_SERVER_MODULE

__all__ = ["replica_command", "replica_env"]


def replica_command(pool: ModelPoolConfig, model_name: str, checkpoint: str, port: int,
                    devices: str | None) -> list[str]:
    """``python -m vllm.entrypoints.openai.api_server ...`` serving ``checkpoint`` as
    ``model_name`` on ``pool.host:port``, then ``pool.extra_args``."""
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
    return cmd + list(pool.extra_args)


def replica_env(pool: ModelPoolConfig, devices: str | None, tmp_dir: Path) -> dict[str, str]:
    """This process's environment plus the replica's devices (or CPU threads), its own
    ``TMPDIR`` (``tmp_dir``, emptied here), and ``pool.env``."""
    env = dict(os.environ)
    env["PYTHONUNBUFFERED"] = "1"  # the log file shows what happened up to a crash
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
    return env
