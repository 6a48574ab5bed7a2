"""The lease table: env ids of this boot (``<boot>-<n>``), who holds each, when it expires
(``lease_ttl_s`` after its last call; a call in progress holds it open), and what an env id
that is not here means: 404 ``unknown_env`` (never granted, released or expired), 410
``lease_lost`` (an earlier instance of the service granted it) or 403 (another tenant's)."""

from __future__ import annotations

import itertools
import re
import secrets
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from cua_rollout.service.failures import Refusal

__all__ = ["LeaseEntry", "LeaseTable", "new_boot_id"]

_ENV_ID = re.compile(r"^(?P<boot>[0-9a-f]{8})-(?P<n>[0-9]+)$")


def new_boot_id() -> str:
    """This instance's part of every env id it grants (random: a restart gets another)."""
    return secrets.token_hex(4)


@dataclass
class LeaseEntry:
    """One lease: who holds it, since when, until when (pushed on by every call)."""

    env_id: str
    tenant: str
    label: str
    granted_at: float
    expires_at: float
    session: Any = None          # the lease's DesktopSession (session.py)
    busy: int = 0                # calls in progress: the lease does not expire under them
    steps: int = 0
    ended: str | None = None     # why it ended (released, expired, desktop died ...)


class LeaseTable:
    """Every live lease of this instance by env id."""

    def __init__(self, ttl_s: float, boot: str | None = None,
                 clock: Callable[[], float] = time.time) -> None:
        self.ttl_s = ttl_s
        self.boot = boot or new_boot_id()
        self._clock = clock
        self._numbers = itertools.count(1)
        self._leases: dict[str, LeaseEntry] = {}

    def __len__(self) -> int:
        return len(self._leases)

    def __iter__(self) -> Iterator[LeaseEntry]:
        return iter(list(self._leases.values()))

    def new_id(self) -> str:
        return f"{self.boot}-{next(self._numbers)}"

    def add(self, env_id: str, tenant: str, label: str = "") -> LeaseEntry:
        now = self._clock()
        entry = LeaseEntry(env_id, tenant, label, now, now + self.ttl_s)
        self._leases[env_id] = entry
        return entry

    def get(self, env_id: str, tenant: str, *, operator: bool = False) -> LeaseEntry:
        """The live lease ``env_id`` of ``tenant`` (the operator: anyone's), or the refusal
        that says why not."""
        entry = self._leases.get(env_id)
        if entry is None:
            match = _ENV_ID.match(env_id)
            if match is not None and match["boot"] != self.boot:
                raise Refusal("lease_lost", f"{env_id} was granted by an earlier instance "
                              "of the service (it restarted): lease again")
            raise Refusal("unknown_env", f"no lease {env_id} (never granted, released or "
                          "expired)")
        if entry.tenant != tenant and not operator:
            raise Refusal("forbidden", f"{env_id} is another tenant's lease")
        return entry

    def touch(self, entry: LeaseEntry) -> float:
        """The lease was heard from: its expiry moves on."""
        entry.expires_at = self._clock() + self.ttl_s
        return entry.expires_at

    def remove(self, env_id: str, why: str) -> LeaseEntry | None:
        entry = self._leases.pop(env_id, None)
        if entry is not None:
            entry.ended = why
        return entry

    def expired(self) -> list[LeaseEntry]:
        """Leases past their expiry with no call in progress."""
        now = self._clock()
        return [e for e in self._leases.values() if e.expires_at < now and not e.busy]

    def of_tenant(self, tenant: str) -> list[LeaseEntry]:
        return [e for e in self._leases.values() if e.tenant == tenant]
