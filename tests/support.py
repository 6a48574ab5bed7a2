"""Helpers and paths shared by the tests of every tier."""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable
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
