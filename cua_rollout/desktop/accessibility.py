"""The accessibility tree and the terminal text, for the server: runs
``cua_rollout/desktop/a11y.py`` with
the interpreter that has pyatspi and turns its failures into ``cua_rollout.desktop.errors``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

from cua_rollout.desktop.a11y import EXIT_UNAVAILABLE
from cua_rollout.desktop.errors import AccessibilityFailed, AccessibilityUnavailable, CommandTimeout
from cua_rollout.desktop.processes import output_tail, run_captured

__all__ = ["A11Y_SCRIPT", "Accessibility"]

A11Y_SCRIPT = Path(__file__).with_name("a11y.py")
# What libatspi prints when it aborts (instead of failing) because its bus vanished after the
# helper's own check.
_LIBATSPI_NO_BUS = b"Couldn't connect to accessibility bus"


class Accessibility:
    """Dumps of the desktop's AT-SPI tree by ``python`` (Debian's python3 with
    python3-pyatspi), each within ``timeout_s``. Every method raises
    ``AccessibilityUnavailable`` when AT-SPI or that interpreter is missing, and
    ``AccessibilityFailed`` when the dump fails or runs past its limit."""

    def __init__(self, *, python: str, timeout_s: float, env: Mapping[str, str]) -> None:
        self.python = python
        self.timeout_s = timeout_s
        self.env = env

    async def tree(self) -> str:
        """The XML of every application, in the layout of OSWorld's Linux tree."""
        return (await self._dump("tree")).decode("utf-8", "replace")

    async def terminal(self) -> str | None:
        """The text of the focused terminal widget of the active window (None: none)."""
        found = json.loads(await self._dump("terminal"))
        return found["output"]

    async def _dump(self, mode: str) -> bytes:
        try:
            result = await run_captured(
                [self.python, str(A11Y_SCRIPT), mode], timeout_s=self.timeout_s, env=self.env
            )
        except FileNotFoundError:
            raise AccessibilityUnavailable(
                f"{self.python} not found: AT-SPI needs Debian's python3 with python3-pyatspi"
            ) from None
        except CommandTimeout as exc:
            raise AccessibilityFailed(str(exc)) from None
        if result.returncode == EXIT_UNAVAILABLE or _LIBATSPI_NO_BUS in result.stderr:
            raise AccessibilityUnavailable(f"AT-SPI is not available: {output_tail(result.stderr)}")
        if result.returncode != 0:
            raise AccessibilityFailed(
                f"the accessibility dump failed (exit status {result.returncode}): "
                f"{output_tail(result.stderr)}"
            )
        return result.stdout
