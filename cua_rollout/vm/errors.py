"""The VM machine layer's one exception type. The layer is standalone (it imports nothing
else of ``cua_rollout``), so it cannot raise the package's errors; the desktop provider
translates a ``VMError`` at its boundary (``raise ... from exc``)."""

from __future__ import annotations

__all__ = ["VMError"]


class VMError(Exception):
    """Something about a virtual machine, its image, its ready state or the host is wrong.

    ``permanent`` says whether retrying the same thing can help: a missing image or QEMU
    binary is permanent; a QEMU process that died or a restore that failed is not.
    """

    def __init__(self, message: str, *, permanent: bool = False) -> None:
        super().__init__(message)
        self.permanent = permanent
