"""``DesktopService``: the pool (any provider, in this process), the lease table, the
tenants and each lease's session, together: lease (quota, then a desktop, then the task's
setup), act, observe, evaluate, heartbeat, release; leases that go silent expire; a lease
whose desktop died ends and the pool replaces the desktop; stop gives every desktop back."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from collections.abc import AsyncIterator, Callable
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from cua_rollout.config import Config
from cua_rollout.core.aio import TaskSet
from cua_rollout.core.errors import DesktopError, DesktopUnavailable, one_line
from cua_rollout.core.http import is_loopback, redact_url
from cua_rollout.envs.service_protocol import (
    ActReply,
    ActRequest,
    DesktopAction,
    DesktopRow,
    DesktopsReply,
    EvaluateReply,
    HeartbeatReply,
    LeaseInfo,
    LeaseReply,
    LeaseRequest,
    Observation,
    ReleaseReply,
    ScreenSize,
    ServicePaths,
)
from cua_rollout.evaluation import Evaluator
from cua_rollout.runtime.pool import DesktopPool, Lease
from cua_rollout.service.failures import Refusal
from cua_rollout.service.leases import LeaseEntry, LeaseTable
from cua_rollout.service.metrics import ServiceMetrics
from cua_rollout.service.session import DesktopSession
from cua_rollout.service.tenants import Tenant, Tenants

__all__ = ["DesktopService"]

log = logging.getLogger(__name__)

# What a 429 / 503 tells a client to wait before asking again: about a short episode's step.
_RETRY_AFTER_S = 5.0
# How often silent leases are looked for, at most (and at least 4 times per ttl).
_EXPIRY_CHECK_MAX_S = 1.0


class DesktopService:
    """The service's state and operations; ``app.py`` is its HTTP edge."""

    def __init__(self, cfg: Config, pool: DesktopPool, tenants: Tenants, *,
                 evaluator: Evaluator | None = None, boot: str | None = None,
                 env_factory: Callable[[Lease, Config], Any] | None = None) -> None:
        self.cfg = cfg
        # A leased desktop's client (tests give one that needs no desktop server).
        self.env_factory = env_factory
        self.scfg = cfg.service
        self.pool = pool
        self.tenants = tenants
        self.evaluator = evaluator or Evaluator.from_config(cfg)
        self.table = LeaseTable(self.scfg.lease_ttl_s, boot)
        self.metrics = ServiceMetrics(pool.stats, self.quota_figures)
        self.stopping = False
        self._tasks = TaskSet()
        self._expiry: asyncio.Task[Any] | None = None
        self._desktop_token = bool(cfg.desktops.token_env)

    # ----------------------------------------------------------------- lifecycle

    async def start(self) -> None:
        self._expiry = asyncio.create_task(self._expire_silent(), name="lease expiry")

    async def stop(self) -> None:
        """Refuse new leases, end every lease (each desktop's lease token cleared, the
        desktop given back to the pool), and wait for the give-backs."""
        self.stopping = True
        if self._expiry is not None:
            self._expiry.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._expiry
        for entry in self.table:
            self._end(entry, "the service stopped", healthy=True)
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.evaluator.close()

    @property
    def heartbeat_s(self) -> float:
        return self.scfg.lease_ttl_s / 3

    # ----------------------------------------------------------------- leases

    async def lease(self, tenant: Tenant, request: LeaseRequest) -> LeaseReply:
        if self.stopping:
            raise Refusal("stopping", "the service is stopping", retry_after_s=_RETRY_AFTER_S)
        if tenant.is_operator:
            raise Refusal("forbidden", "the operator's token does not lease; use a tenant's")
        access = request.access or self.scfg.default_access
        if access == "direct" and not self._desktop_token:
            raise Refusal("bad_request", "access direct needs desktops with a token "
                          "(desktops.token_env on the service); ask for access relay")
        wait_s = min(self.scfg.default_wait_s if request.wait_s is None else request.wait_s,
                     self.scfg.max_wait_s)
        started = time.monotonic()
        await tenant.quota.acquire(wait_s, _RETRY_AFTER_S)  # over_quota: counted at the edge
        env_id = self.table.new_id()
        try:
            remaining = max(0.0, wait_s - (time.monotonic() - started))
            pool_lease = await self.pool.lease(env_id, remaining)
        except DesktopUnavailable as exc:
            tenant.quota.release()
            raise Refusal("no_desktop", f"no desktop came free within {wait_s:g} s "
                          f"({one_line(exc)})", retry_after_s=_RETRY_AFTER_S) from exc
        except BaseException:
            tenant.quota.release()
            raise
        waited_s = time.monotonic() - started
        entry = self.table.add(env_id, tenant.name, request.label)
        session = entry.session = DesktopSession(
            pool_lease, self.cfg, self.evaluator,
            self.env_factory(pool_lease, self.cfg) if self.env_factory else None)
        entry.busy += 1  # the setup may outlast the ttl
        try:
            async with session.lock:
                if access == "direct":
                    session.lease_token = secrets.token_urlsafe(32)
                    await session.env.set_lease_token(session.lease_token)
                setup_started = time.monotonic()
                shot = await session.begin(request.task)
                setup_s = time.monotonic() - setup_started
                obs = await session.observe(request.observe, shot)
        except Refusal as refusal:
            self._end(entry, refusal.code, healthy=refusal.code != "desktop_died")
            raise
        except DesktopError as exc:
            self._end(entry, "desktop_error", healthy=False)
            raise Refusal("desktop_died", f"desktop {pool_lease.desktop_id} failed while "
                          f"leasing: {one_line(exc)}") from exc
        except BaseException:  # the client went away mid-setup, or a bug: give it back
            self._end(entry, "failed", healthy=True)
            raise
        finally:
            entry.busy -= 1
        expires_at = self.table.touch(entry)
        self.metrics.lease_wait_s.labels(tenant.name).observe(waited_s)
        self.metrics.leases_granted.labels(tenant.name).inc()
        width, height = shot.size
        url, token = self._desktop_url(entry, access)
        return LeaseReply(
            **obs.model_dump(), env_id=env_id, tenant=tenant.name,
            desktop_id=pool_lease.desktop_id, screen=ScreenSize(width=width, height=height),
            access=access, desktop_url=url, desktop_token=token,
            lease_ttl_s=self.scfg.lease_ttl_s, heartbeat_s=self.heartbeat_s,
            expires_at=expires_at, waited_s=round(waited_s, 4), setup_s=round(setup_s, 4))

    def _desktop_url(self, entry: LeaseEntry, access: str) -> tuple[str, str | None]:
        if access == "relay":
            return ServicePaths.of(ServicePaths.RELAY, env_id=entry.env_id), None
        session: DesktopSession = entry.session
        url = session.lease.url
        parts = urlsplit(url)
        if self.scfg.direct_host and is_loopback(parts.hostname or ""):
            netloc = (f"{self.scfg.direct_host}:{parts.port}" if parts.port
                      else self.scfg.direct_host)
            url = urlunsplit(parts._replace(netloc=netloc))
        return url, session.lease_token

    @contextlib.asynccontextmanager
    async def using(self, tenant: Tenant, env_id: str, *, exclusive: bool = True
                    ) -> AsyncIterator[LeaseEntry]:
        """The lease ``env_id`` of ``tenant`` for one call: held open (no expiry) while the
        call runs, its expiry pushed on at both ends; ``exclusive``: one such call at a
        time on the desktop. A desktop that died ends the lease."""
        entry = self.table.get(env_id, tenant.name, operator=tenant.is_operator)
        entry.busy += 1
        self.table.touch(entry)
        try:
            if exclusive:
                async with entry.session.lock:
                    if entry.ended:
                        raise Refusal("unknown_env", f"lease {env_id} ended ({entry.ended})")
                    yield entry
            else:
                yield entry
        except Refusal as refusal:
            if refusal.code == "desktop_died":
                self._end(entry, "desktop_died", healthy=False)
            raise
        finally:
            entry.busy -= 1
            self.table.touch(entry)

    async def act(self, tenant: Tenant, env_id: str, request: ActRequest) -> ActReply:
        pause_s = self.scfg.action_pause_s if request.pause_s is None else request.pause_s
        async with self.using(tenant, env_id) as entry:
            session: DesktopSession = entry.session
            outcome = await session.act(request, pause_s)
            entry.steps += 1
            self.metrics.steps.labels(entry.tenant, request.kind).inc()
            obs = Observation()
            if outcome["terminal"] not in ("DONE", "FAIL") and outcome["parse_error"] is None:
                obs = await session.observe(request.observe)
            fields = obs.model_dump()
            # ActReply's ``terminal`` is the terminal action; the terminal's text moves.
            fields["terminal_output"] = fields.pop("terminal")
            return ActReply(**fields, **outcome, env_id=env_id, step=entry.steps,
                            expires_at=entry.expires_at)

    async def observe(self, tenant: Tenant, env_id: str, kinds: list[str]) -> Observation:
        async with self.using(tenant, env_id) as entry:
            return await entry.session.observe(kinds)

    async def screenshot(self, tenant: Tenant, env_id: str) -> bytes:
        async with self.using(tenant, env_id) as entry:
            shot = await entry.session.screenshot()
            assert shot.png is not None
            return shot.png

    async def evaluate(self, tenant: Tenant, env_id: str, last_action: str | None
                       ) -> EvaluateReply:
        async with self.using(tenant, env_id) as entry:
            reward, error, took_s = await entry.session.evaluate(last_action)
            return EvaluateReply(env_id=env_id, reward=reward, evaluation_error=error,
                                 evaluation_s=round(took_s, 4))

    async def heartbeat(self, tenant: Tenant, env_id: str) -> HeartbeatReply:
        entry = self.table.get(env_id, tenant.name, operator=tenant.is_operator)
        return HeartbeatReply(env_id=env_id, expires_at=self.table.touch(entry))

    def info(self, tenant: Tenant, env_id: str) -> LeaseInfo:
        entry = self.table.get(env_id, tenant.name, operator=tenant.is_operator)
        return self._info(entry)

    def _info(self, entry: LeaseEntry) -> LeaseInfo:
        session: DesktopSession = entry.session
        task_id = (session.task or {}).get("id") if session else None
        return LeaseInfo(env_id=entry.env_id, tenant=entry.tenant,
                         desktop_id=session.desktop_id if session else "",
                         task_id=str(task_id) if task_id else None, label=entry.label,
                         steps=entry.steps, age_s=round(time.time() - entry.granted_at, 3),
                         expires_at=entry.expires_at)

    async def release(self, tenant: Tenant, env_id: str) -> ReleaseReply:
        entry = self.table.get(env_id, tenant.name, operator=tenant.is_operator)
        self._end(entry, "released", healthy=True)
        return ReleaseReply(env_id=env_id, released=True, steps=entry.steps,
                            held_s=round(time.time() - entry.granted_at, 3))

    def _end(self, entry: LeaseEntry, why: str, *, healthy: bool, to_pool: bool = True
             ) -> None:
        """End a lease now (its id answers 404 from here on, its quota slot is free) and
        give its desktop back in the background, after the call in progress: the lease
        token cleared first, so the client keeps no access, then the pool resets it."""
        if self.table.remove(entry.env_id, why) is None:
            return  # already ended
        tenant = self.tenants.by_name.get(entry.tenant)
        if tenant is not None:
            tenant.quota.release()
        self.metrics.lease_ends.labels(entry.tenant, why).inc()
        log.info("lease %s of %s ended: %s", entry.env_id, entry.tenant, why)
        if entry.session is not None:
            self._tasks.spawn(self._give_back(entry.session, healthy, to_pool))

    async def _give_back(self, session: DesktopSession, healthy: bool, to_pool: bool) -> None:
        async with session.lock:
            await session.close_client_access()
            if not to_pool:
                return
            if session.lease_token is not None:
                # A desktop that may still take the lease's token is never lent again.
                await self.pool.release_desktop(
                    session.desktop_id, "ended, and its lease token could not be cleared")
                return
            await self.pool.release(session.lease.lease_id, healthy)

    async def _expire_silent(self) -> None:
        every_s = min(_EXPIRY_CHECK_MAX_S, self.scfg.lease_ttl_s / 4)
        while True:
            await asyncio.sleep(every_s)
            for entry in self.table.expired():
                log.warning("lease %s of %s expired: no call for %g s", entry.env_id,
                            entry.tenant, self.scfg.lease_ttl_s)
                self._end(entry, "expired", healthy=True)

    # ----------------------------------------------------------------- operators

    def quota_figures(self) -> dict[str, dict[str, int]]:
        return {t.name: {"max_leases": t.max_leases, "held": t.quota.held,
                         "waiting": t.quota.waiting}
                for t in self.tenants.by_name.values()}

    def status(self, tenant: Tenant) -> dict[str, Any]:
        """Everything for the operator; a tenant's own leases and quota for a tenant."""
        if not tenant.is_operator:
            return {"tenant": tenant.name, "boot": self.table.boot,
                    "quota": self.quota_figures()[tenant.name],
                    "leases": [self._info(e).model_dump() for e in
                               self.table.of_tenant(tenant.name)]}
        stats = self.pool.stats()
        return {"boot": self.table.boot, "stopping": self.stopping,
                "provider": self.cfg.desktops.provider,
                "tenants": self.quota_figures(),
                "leases": [self._info(e).model_dump() for e in self.table],
                "desktops": [r.model_dump() for r in self.desktops().desktops],
                "pool": {k: v for k, v in stats.items() if k != "state_s"}}

    def desktops(self) -> DesktopsReply:
        held = {e.session.desktop_id: e for e in self.table if e.session is not None}
        rows = []
        for row in self.pool.describe():
            entry = held.get(row["id"])
            rows.append(DesktopRow(
                id=row["id"], state=row["state"], owner=row["owner"],
                tenant=entry.tenant if entry else None, env_id=entry.env_id if entry else None,
                lease_age_s=row["lease_age_s"], leases=row["leases"],
                failures=row["failures"], url=redact_url(row["url"]),
                provider=self.cfg.desktops.provider, last_error=row["last_error"]))
        return DesktopsReply(desktops=rows)

    async def desktop_action(self, desktop_id: str, action: str) -> DesktopAction:
        """An operator's ``release`` (the lease on it ends; the desktop is quarantined and
        replaced), ``quarantine`` or ``remove`` of a desktop."""
        try:
            if action == "release":
                entry = next((e for e in self.table if e.session is not None
                              and e.session.desktop_id == desktop_id), None)
                if entry is not None:
                    self._end(entry, "taken back by an operator", healthy=False,
                              to_pool=False)
                result = await self.pool.release_desktop(desktop_id)
            elif action == "quarantine":
                result = await self.pool.quarantine(desktop_id)
            elif action == "remove":
                result = await self.pool.remove(desktop_id)
            else:
                raise Refusal("bad_request", f"no desktop action {action!r} (release, "
                              "quarantine, remove)")
        except DesktopError as exc:
            raise Refusal("bad_request", one_line(exc)) from exc
        return DesktopAction(desktop_id=desktop_id, action=action, result=result)
