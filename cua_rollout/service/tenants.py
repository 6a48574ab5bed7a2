"""Who may call the service: tenants by bearer token (read from the environment once, at
start), each with a concurrency quota that a lease waits for fairly (in arrival order) up to
its deadline, the operator's token, and the address allow-list."""

from __future__ import annotations

import asyncio
import hmac
import ipaddress
import socket
from collections import deque
from dataclasses import dataclass, field

from cua_rollout.config import ServiceConfig, secret_from_env
from cua_rollout.core.errors import ConfigError
from cua_rollout.core.http import host_entry
from cua_rollout.service.failures import Refusal

__all__ = ["OPERATOR", "AddressAllowList", "Quota", "Tenant", "Tenants"]

OPERATOR = "operator"
"""The name the operator's token authenticates as (no tenant may take it)."""


@dataclass
class Tenant:
    """One tenant: its name, token and quota."""

    name: str
    token: str = field(repr=False)
    max_leases: int
    quota: Quota = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.quota = Quota(self.name, self.max_leases)

    @property
    def is_operator(self) -> bool:
        return self.name == OPERATOR


class Quota:
    """At most ``limit`` leases held at once. ``acquire`` waits its turn: a slot that frees
    goes to the oldest waiter (a newcomer never overtakes one), so a tenant's requests are
    served in order; past its deadline a waiter gets 429 ``over_quota``."""

    def __init__(self, tenant: str, limit: int) -> None:
        self.tenant = tenant
        self.limit = limit
        self.held = 0
        self._waiters: deque[asyncio.Future[None]] = deque()

    @property
    def waiting(self) -> int:
        return sum(1 for w in self._waiters if not w.done())

    async def acquire(self, wait_s: float, retry_after_s: float) -> None:
        """A slot of the quota, or ``Refusal("over_quota")`` after ``wait_s``."""
        if self.held < self.limit and not self.waiting:
            self.held += 1
            return
        if wait_s <= 0:
            raise self._over(0.0, retry_after_s)
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        try:
            # shield: a deadline must not lose a slot handed over at the same moment.
            await asyncio.wait_for(asyncio.shield(waiter), wait_s)
        except (TimeoutError, asyncio.CancelledError) as exc:
            handed = waiter.done() and not waiter.cancelled()
            waiter.cancel()
            if isinstance(exc, asyncio.CancelledError):
                if handed:
                    self.release()
                raise
            if not handed:
                raise self._over(wait_s, retry_after_s) from None
        finally:
            if waiter in self._waiters:
                self._waiters.remove(waiter)

    def release(self) -> None:
        """Give a slot back: to the oldest waiter, else to the quota."""
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)  # the slot passes on: held stays
                return
        self.held = max(0, self.held - 1)

    def _over(self, waited_s: float, retry_after_s: float) -> Refusal:
        return Refusal("over_quota",
                       f"tenant {self.tenant} holds {self.held} of its {self.limit} lease(s)"
                       f" and none ended within {waited_s:g} s", retry_after_s=retry_after_s)


class Tenants:
    """The tenants and the operator by token (compared in constant time)."""

    def __init__(self, tenants: list[Tenant], operator_token: str | None = None) -> None:
        self.by_name = {t.name: t for t in tenants}
        self.operator = (Tenant(OPERATOR, operator_token, 0) if operator_token else None)
        tokens = [t.token for t in tenants] + ([operator_token] if operator_token else [])
        if len(set(tokens)) != len(tokens):
            raise ConfigError("service.tenants: two tenants (or a tenant and the operator) "
                              "hold the same token")

    @classmethod
    def from_config(cls, cfg: ServiceConfig) -> Tenants:
        """The tenants of ``service.tenants``, their tokens read from the environment."""
        if not cfg.tenants:
            raise ConfigError("service.tenants is empty: name at least one tenant (name, "
                              "token_env, max_leases)")
        tenants = []
        for index, t in enumerate(cfg.tenants):
            if t.name == OPERATOR:
                raise ConfigError(f"service.tenants[{index}].name: {OPERATOR!r} is the "
                                  "operator's name")
            token = secret_from_env(t.token_env, f"service.tenants[{index}].token_env")
            assert token is not None
            tenants.append(Tenant(t.name, token, t.max_leases))
        return cls(tenants, secret_from_env(cfg.operator_token_env,
                                            "service.operator_token_env"))

    def authenticate(self, authorization: str | None) -> Tenant:
        """The tenant (or the operator) whose token ``Authorization: Bearer ...`` carries."""
        if not authorization or not authorization.startswith("Bearer "):
            raise Refusal("unauthorized", "no bearer token (Authorization: Bearer <token>)")
        token = authorization.removeprefix("Bearer ").encode()
        found = None
        for tenant in [*self.by_name.values(), *([self.operator] if self.operator else [])]:
            if hmac.compare_digest(token, tenant.token.encode()):
                found = tenant  # no early exit: every comparison runs
        if found is None:
            raise Refusal("unauthorized", "the bearer token is no tenant's")
        return found


class AddressAllowList:
    """The addresses allowed to call: IPs and CIDR networks, host names resolved once (at
    start). Empty: every address."""

    def __init__(self, entries: list[str], key: str = "service.allow") -> None:
        self.networks: list[ipaddress.IPv4Network | ipaddress.IPv6Network] = []
        for index, entry in enumerate(entries):
            parsed = host_entry(entry, f"{key}[{index}]")
            if isinstance(parsed, tuple):
                self.networks += _resolve(parsed[0], f"{key}[{index}]")
            else:
                self.networks.append(parsed)

    def allows(self, address: str | None) -> bool:
        if not self.networks:
            return True
        if address is None:
            return False
        try:
            ip = ipaddress.ip_address(address)
        except ValueError:
            return False
        if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
            ip = ip.ipv4_mapped
        return any(ip in net for net in self.networks)


def _resolve(host: str, key: str) -> list[ipaddress.IPv4Network | ipaddress.IPv6Network]:
    try:
        infos = socket.getaddrinfo(host, None)
    except OSError as exc:
        raise ConfigError(f"{key}: cannot resolve {host!r}: {exc}") from exc
    return [ipaddress.ip_network(info[4][0]) for info in infos]
