"""Helpers and paths shared by the tests of every tier."""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

TESTS_DIR = Path(__file__).resolve().parent
REPO_ROOT = TESTS_DIR.parent


def unavailable(reason: str) -> None:
    """Skip on a developer machine without the component; fail under CI, where a missing
    component means a missing install step, not a reason to pass."""
    if os.environ.get("CI"):
        pytest.fail(f"{reason} (CI installs it with scripts/setup_env.sh --dev)")
    pytest.skip(reason)


async def until(predicate: Callable[[], bool], timeout_s: float, poll_s: float = 0.01) -> None:
    """Poll ``predicate`` until it holds; fail the test after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(poll_s)


@contextlib.contextmanager
def small_filesystem(directory: Path, size_bytes: int) -> Iterator[Path]:
    """A real filesystem of ``size_bytes`` mounted on ``directory`` (a tmpfs), so writes hit
    a real ENOSPC; unmounted on exit. Needs root (CI runs as root)."""
    directory.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0:
        unavailable("a small filesystem needs root to mount a tmpfs")
    result = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_bytes}", "tmpfs",
                             str(directory)], capture_output=True, text=True, check=False)
    if result.returncode != 0:
        unavailable(f"cannot mount a tmpfs on {directory}: {result.stderr.strip()}")
    try:
        yield directory
    finally:
        subprocess.run(["umount", str(directory)], check=True)
