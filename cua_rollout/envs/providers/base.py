"""Where desktops come from: ``DesktopProvider``, one method per lifecycle step, and the
``Desktop`` record the pool keeps for each. A provider is one file of this package."""

from __future__ import annotations

import abc
from dataclasses import dataclass, field
from typing import Any

__all__ = ["Desktop", "DesktopProvider"]


@dataclass
class Desktop:
    """A desktop the pool owns; ``url`` is its server's base URL."""

    id: str
    url: str
    state: str = "starting"  # starting | free | leased | resetting | quarantined | stopped
    info: dict[str, Any] = field(default_factory=dict)
    leases: int = 0
    failures: int = 0
    last_error: str | None = None
    quarantined_at: float = 0.0


class DesktopProvider(abc.ABC):
    """Where desktops come from. One method per lifecycle step; ``replaceable`` says whether
    a broken desktop is stopped and a new one started (else it is retried later)."""

    replaceable = True
    verify_resets = True
    """Whether the pool checks this provider's resets (``cua_rollout/envs/verify.py``): false
    for desktops that are only records (tests' fakes)."""

    @abc.abstractmethod
    async def start(self, index: int) -> Desktop:
        """Bring up desktop number ``index``."""

    @abc.abstractmethod
    async def reset(self, desktop: Desktop) -> None:
        """Return the desktop to a clean state; raise if that fails."""

    @abc.abstractmethod
    async def stop(self, desktop: Desktop) -> None:
        """Stop what ``start`` started."""

    @abc.abstractmethod
    async def health(self, desktop: Desktop) -> bool:
        """Whether the desktop can be handed out."""

    async def close(self) -> None:
        """Release what the provider holds beyond its desktops (watches, clients), after
        every desktop was stopped. Most hold nothing more."""
        return None

    def capacity(self) -> int | None:
        """The most desktops this provider can have (None: no limit)."""
        return None
