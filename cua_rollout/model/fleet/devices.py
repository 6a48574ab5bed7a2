"""Where replicas run: the GPUs of this machine (NVML, else ``nvidia-smi``), the
``CUDA_VISIBLE_DEVICES`` of each replica, and free ports with the host clients reach them at."""

from __future__ import annotations

import re
import shutil
import socket
import subprocess

from cua_rollout.core.errors import ConfigError, FleetError

__all__ = [
    "assign_devices",
    "choose_port",
    "detect_gpus",
    "parse_nvidia_smi_list",
    "port_is_free",
]


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
    """Whether a server could bind ``host:port`` now."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def choose_port(host: str, start: int, taken: set[int]) -> int:
    """The first free port at or above ``start`` that is not in ``taken``."""
    for port in range(start, 65536):
        if port not in taken and port_is_free(host, port):
            return port
    raise FleetError(f"no free port at or above {start} on {host}")

