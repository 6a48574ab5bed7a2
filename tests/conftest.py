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


# ------------------------------------------------------------------ background harnesses


@pytest.hookimpl(trylast=True)  # after -k / -m deselected what they deselect
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests that read a background harness run (``@pytest.mark.harness``) go last: their
    runs, started when collection ends, go on beside every other test meanwhile."""
    items.sort(key=lambda item: item.get_closest_marker("harness") is not None)


def pytest_collection_finish(session: pytest.Session) -> None:
    if session.config.option.collectonly:
        return
    from tests.support import background

    for key in sorted({key for item in session.items
                       for marker in item.iter_markers("harness") for key in marker.args}):
        background.start(key)


def pytest_sessionfinish(session: pytest.Session) -> None:
    from tests.support import background

    background.stop_all()
