"""Checkpoints as the fleet sees them, on disk and without reading weights: resolving a path
or hub id, a version fingerprint, whether two checkpoints allow an in-place weight reload,
and the newest complete checkpoint in a directory (for ``--watch``)."""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cua_rollout.core.errors import ConfigError

__all__ = [
    "CheckpointCandidate",
    "checkpoint_mtime",
    "checkpoint_version",
    "is_vision_language",
    "max_positions",
    "model_config",
    "newest_checkpoint",
    "resolve_checkpoint",
    "same_architecture",
]

# Files whose equality (config.json: up to these keys) allows an in-place weight reload.
_SAME_ARCH_FILES = re.compile(
    r"^(generation_config\.json|tokenizer.*|special_tokens_map\.json|added_tokens\.json|"
    r"vocab.*|merges\.txt|chat_template.*|(video_)?preprocessor_config\.json|"
    r"processor_config\.json)$"
)
_CONFIG_KEYS_IGNORED = {"_name_or_path", "transformers_version"}
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")


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


def checkpoint_mtime(checkpoint: str) -> float:
    """The newest mtime of a local checkpoint's files; 0 for a hub id or an empty dir."""
    path = Path(checkpoint)
    if not path.is_dir():
        return 0.0
    return max((f.stat().st_mtime for f in _checkpoint_files(path)), default=0.0)


def model_config(checkpoint: str) -> dict[str, Any] | None:
    """A local checkpoint's ``config.json``; None for a hub id or an unreadable file."""
    try:
        config = json.loads((Path(checkpoint) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    return config if isinstance(config, dict) else None


def is_vision_language(checkpoint: str) -> bool:
    """True for a local checkpoint with a vision tower (``vision_config`` in its config:
    Qwen2-VL, Qwen2.5-VL / UI-TARS-1.5 ...)."""
    config = model_config(checkpoint)
    return config is not None and "vision_config" in config


def max_positions(checkpoint: str) -> int | None:
    """The longest context a local checkpoint takes (``max_position_embeddings``, in its text
    config for a vision-language model); None when unknown."""
    config = model_config(checkpoint) or {}
    for section in (config.get("text_config") or {}, config):
        value = section.get("max_position_embeddings") if isinstance(section, dict) else None
        if isinstance(value, int) and value > 0:
            return value
    return None


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
    """A complete checkpoint directory found by ``newest_checkpoint``."""

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
