"""Fixtures shared by every tier (tests/unit, tests/component, tests/integration)."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest


@pytest.fixture
def tmp() -> Iterator[Path]:
    """A fresh directory with a short path, removed afterwards. pytest's ``tmp_path`` is
    too long for what binds Unix sockets under it (Ray's session files, X displays): their
    paths must stay under ~100 bytes."""
    path = Path(tempfile.mkdtemp(prefix="cua-test-"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)
