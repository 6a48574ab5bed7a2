"""The cache of ready states: one directory per (image identity, machine settings, QEMU
version) under a cache root, holding a saved VM (``ram``, ``disk.qcow2``, ``vars.fd``) and a
manifest. Built once under a file lock, in a temporary directory renamed into place, and
checked before every use, so a partial or corrupt state is rebuilt, never restored."""

from __future__ import annotations

import asyncio
import fcntl
import hashlib
import json
import os
import shutil
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

from cua_rollout.vm.errors import VMError
from cua_rollout.vm.images import qemu_version
from cua_rollout.vm.spec import MachineSpec

__all__ = ["DEFAULT_CACHE_ROOT", "DISK_FILE", "MANIFEST_FILE", "RAM_FILE", "VARS_FILE",
           "ReadyState", "ReadyStateCache", "image_identity"]

DEFAULT_CACHE_ROOT = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) \
    / "cua-rollout" / "vm-states"
RAM_FILE = "ram"              # the migration stream: RAM and device state
DISK_FILE = "disk.qcow2"      # the overlay as it was at the save, backed by the base image
VARS_FILE = "vars.fd"         # UEFI variables (uefi only)
MANIFEST_FILE = "manifest.json"
MANIFEST_VERSION = 1
HASH_CHUNK_BYTES = 1 << 20
LOCK_POLL_S = 0.1


@dataclass(frozen=True)
class ReadyState:
    """A checked ready state on disk."""

    directory: Path
    manifest: dict

    @property
    def ram(self) -> Path:
        return self.directory / RAM_FILE

    @property
    def disk(self) -> Path:
        return self.directory / DISK_FILE

    @property
    def vars(self) -> Path | None:
        path = self.directory / VARS_FILE
        return path if VARS_FILE in self.manifest.get("files", {}) else None

    def size_bytes(self) -> int:
        """Bytes the state takes on disk (allocated, so sparse files count what they hold)."""
        return sum((self.directory / f).stat().st_blocks * 512 for f in self.manifest["files"])


def image_identity(path: Path) -> dict[str, object]:
    """What tells one base image from another, or from itself after a change, without
    reading it: its real path, size, modification time and inode."""
    real = Path(path).resolve()
    try:
        st = real.stat()
    except OSError as exc:
        raise VMError(f"VM image {path} cannot be read: {exc}", permanent=True) from exc
    return {"path": str(real), "size": st.st_size, "mtime_ns": st.st_mtime_ns,
            "inode": st.st_ino, "device": st.st_dev}


class ReadyStateCache:
    """Ready states under ``root`` (default ``~/.cache/cua-rollout/vm-states``)."""

    def __init__(self, root: Path = DEFAULT_CACHE_ROOT, *, lock_timeout_s: float = 1800.0,
                 verify_hashes: bool = False) -> None:
        self.root = Path(root)
        self.lock_timeout_s = lock_timeout_s
        # Sizes and the manifest's own hash are checked on every load; the files' content
        # hashes (a full read of the RAM file) only when asked.
        self.verify_hashes = verify_hashes
        # why the last load found no usable state (None: none existed, or it was fine)
        self.last_rejection: str | None = None

    def identity(self, spec: MachineSpec) -> dict[str, object]:
        return {"image": image_identity(spec.image), "machine": spec.state_settings(),
                "qemu": qemu_version(spec.qemu_binary), "version": MANIFEST_VERSION}

    def key(self, spec: MachineSpec) -> str:
        return _sha256_json(self.identity(spec))[:24]

    def directory(self, spec: MachineSpec) -> Path:
        return self.root / self.key(spec)

    def load(self, spec: MachineSpec) -> ReadyState | None:
        """The cached state for ``spec`` if there is one and it is whole; a broken one is
        removed (the reason kept in ``last_rejection``) and None returned."""
        self.last_rejection = None
        directory = self.directory(spec)
        if not directory.exists():
            return None
        problem = check_state(directory, self.identity(spec), deep=self.verify_hashes)
        if problem is None:
            return ReadyState(directory, json.loads((directory / MANIFEST_FILE).read_text()))
        self.last_rejection = f"ready state {directory} is unusable ({problem}): rebuilt"
        shutil.rmtree(directory, ignore_errors=True)
        return None

    async def get_or_build(self, spec: MachineSpec,
                           build: Callable[[Path], Awaitable[None]]) -> ReadyState:
        """The cached state for ``spec``, built by ``build(directory)`` when there is none
        (or a broken one). ``build`` writes ``ram``, ``disk.qcow2`` (and ``vars.fd``) into
        the directory it is given; the manifest is written here. One builder at a time per
        key, across processes; the others wait for its result."""
        if (state := self.load(spec)) is not None:
            return state
        rejection = self.last_rejection  # the next load finds the broken state gone
        self.root.mkdir(parents=True, exist_ok=True)
        key = self.key(spec)
        with open(self.root / f".{key}.lock", "w") as lock:
            await _lock(lock, self.lock_timeout_s, key)
            try:
                if (state := self.load(spec)) is not None:  # built while we waited
                    return state
                rejection = self.last_rejection or rejection
                staging = self.root / f".{key}.build-{os.getpid()}-{uuid.uuid4().hex[:6]}"
                staging.mkdir()
                try:
                    await build(staging)
                    _write_manifest(staging, self.identity(spec))
                    final = self.root / key
                    shutil.rmtree(final, ignore_errors=True)
                    staging.rename(final)
                finally:
                    shutil.rmtree(staging, ignore_errors=True)
                state = self.load(spec)
                if state is None:
                    raise VMError(f"the ready state just built is unusable: {self.last_rejection}")
                self.last_rejection = rejection
                return state
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)


def check_state(directory: Path, identity: dict[str, object], *, deep: bool = False) -> str | None:
    """Why the state in ``directory`` cannot be restored, or None if it can."""
    try:
        manifest = json.loads((directory / MANIFEST_FILE).read_text(encoding="utf-8"))
    except FileNotFoundError:
        return "no manifest (a partial build)"
    except (OSError, ValueError) as exc:
        return f"unreadable manifest: {exc}"
    recorded = manifest.pop("manifest_sha256", None)
    if recorded != _sha256_json(manifest):
        return "the manifest does not match its hash"
    if manifest.get("identity") != identity:
        return "saved for another image, machine or QEMU version"
    for name, meta in manifest.get("files", {}).items():
        path = directory / name
        try:
            size = path.stat().st_size
        except OSError:
            return f"{name} is missing"
        if size != meta["size"]:
            return f"{name} has {size} bytes, {meta['size']} were saved"
        if deep and _sha256_file(path) != meta["sha256"]:
            return f"{name} does not match its hash"
    if RAM_FILE not in manifest.get("files", {}) or DISK_FILE not in manifest["files"]:
        return "the manifest lists no RAM or disk"
    return None


def _write_manifest(directory: Path, identity: dict[str, object]) -> None:
    files = {}
    for name in (RAM_FILE, DISK_FILE, VARS_FILE):
        path = directory / name
        if path.exists():
            files[name] = {"size": path.stat().st_size, "sha256": _sha256_file(path)}
        elif name != VARS_FILE:
            raise VMError(f"building the ready state wrote no {name}")
    manifest: dict[str, object] = {"identity": identity, "files": files,
                                   "created_unix_s": time.time()}
    manifest["manifest_sha256"] = _sha256_json(manifest)
    for name in files:
        with open(directory / name, "rb") as f:
            os.fsync(f.fileno())
    tmp = directory / f".{MANIFEST_FILE}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(manifest, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    tmp.replace(directory / MANIFEST_FILE)


async def _lock(lock_file, timeout_s: float, key: str) -> None:
    """An exclusive flock, polled so the event loop keeps running while another process
    builds."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            fcntl.flock(lock_file, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            if time.monotonic() > deadline:
                raise VMError(f"ready state {key}: another process has been building it for "
                              f"more than {timeout_s:g} s") from None
            await asyncio.sleep(LOCK_POLL_S)


def _sha256_json(value: object) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True).encode()).hexdigest()


def _sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(HASH_CHUNK_BYTES):
            digest.update(chunk)
    return digest.hexdigest()
