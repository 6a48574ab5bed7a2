"""The desktop service's logic without desktops: tokens to tenants, quotas (a fair wait,
then 429), the address allow-list, the lease table (404 / 410 / 403 by env id, expiry)."""

from __future__ import annotations

import asyncio

import pytest

from cua_rollout.config import Config, ServiceConfig
from cua_rollout.core.errors import ConfigError
from cua_rollout.service.failures import Refusal
from cua_rollout.service.leases import LeaseTable
from cua_rollout.service.tenants import AddressAllowList, Quota, Tenant, Tenants


async def test_a_full_quota_waits_then_refuses_with_retry_after():
    quota = Quota("a", 1)
    await quota.acquire(0, 5.0)
    with pytest.raises(Refusal) as refused:
        await quota.acquire(0.05, 5.0)
    assert refused.value.code == "over_quota" and refused.value.status == 429
    assert refused.value.retry_after_s == 5.0 and "tenant a holds 1 of its 1" in str(
        refused.value)
    assert quota.held == 1 and quota.waiting == 0


async def test_a_freed_slot_goes_to_the_oldest_waiter():
    quota = Quota("a", 1)
    await quota.acquire(0, 1)
    order: list[str] = []

    async def wait(name: str) -> None:
        await quota.acquire(10, 1)
        order.append(name)

    first = asyncio.create_task(wait("first"))
    await asyncio.sleep(0)
    second = asyncio.create_task(wait("second"))
    await asyncio.sleep(0)
    assert quota.waiting == 2
    # A newcomer does not overtake the waiters, even when a slot is free for an instant.
    quota.release()
    await first
    with pytest.raises(Refusal):
        await quota.acquire(0, 1)
    quota.release()
    await second
    assert order == ["first", "second"] and quota.held == 1
    quota.release()
    assert quota.held == 0


async def test_a_cancelled_waiter_hands_its_slot_on():
    quota = Quota("a", 1)
    await quota.acquire(0, 1)
    waiter = asyncio.create_task(quota.acquire(10, 1))
    await asyncio.sleep(0)
    waiter.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiter
    quota.release()
    assert quota.held == 0 and quota.waiting == 0


def test_tokens_name_tenants_and_the_operator():
    tenants = Tenants([Tenant("a", "tok-a", 1), Tenant("b", "tok-b", 2)], "tok-op")
    assert tenants.authenticate("Bearer tok-b").name == "b"
    assert tenants.authenticate("Bearer tok-op").is_operator
    for header in (None, "tok-a", "Bearer wrong", "Basic tok-a"):
        with pytest.raises(Refusal) as refused:
            tenants.authenticate(header)
        assert refused.value.code == "unauthorized" and refused.value.status == 401
    with pytest.raises(ConfigError, match="same token"):
        Tenants([Tenant("a", "same", 1), Tenant("b", "same", 1)])


def test_tenant_tokens_come_from_the_environment(monkeypatch):
    cfg = ServiceConfig(tenants=[{"name": "a", "token_env": "SVC_TOKEN_A"}])
    with pytest.raises(ConfigError, match="SVC_TOKEN_A"):
        Tenants.from_config(cfg)
    monkeypatch.setenv("SVC_TOKEN_A", "secret")
    assert Tenants.from_config(cfg).authenticate("Bearer secret").name == "a"
    with pytest.raises(ConfigError, match=r"service\.tenants is empty"):
        Tenants.from_config(ServiceConfig())


def test_the_allow_list():
    allow = AddressAllowList(["10.1.0.0/16", "127.0.0.1", "localhost"])
    assert allow.allows("10.1.2.3") and allow.allows("127.0.0.1")
    assert allow.allows("::ffff:10.1.2.3")  # an IPv4 caller on a dual-stack socket
    assert not allow.allows("10.2.0.1") and not allow.allows(None)
    assert AddressAllowList([]).allows("192.0.2.1")
    with pytest.raises(ConfigError, match=r"service.allow\[0\]"):
        AddressAllowList(["not a host!"])


def test_service_config_names_wrong_keys():
    with pytest.raises(ValueError, match=r"service\.allow"):
        Config.model_validate({"service": {"allow": ["bad host!"]}})
    with pytest.raises(ValueError, match="extra"):
        Config.model_validate({"service": {"tenant": []}})
    with pytest.raises(ValueError, match="distinct"):
        Config.model_validate({"service": {"tenants": [{"name": "a", "token_env": "X"},
                                                       {"name": "a", "token_env": "Y"}]}})


def test_env_ids_of_another_boot_are_lost_not_unknown():
    now = [1000.0]
    table = LeaseTable(60, "0123abcd", clock=lambda: now[0])
    env_id = table.new_id()
    assert env_id == "0123abcd-1"
    entry = table.add(env_id, "a")
    assert table.get(env_id, "a") is entry
    for wrong, code in (("ffffeeee-1", "lease_lost"), ("0123abcd-9", "unknown_env"),
                        ("junk", "unknown_env")):
        with pytest.raises(Refusal) as refused:
            table.get(wrong, "a")
        assert refused.value.code == code
    with pytest.raises(Refusal) as refused:
        table.get(env_id, "b")
    assert refused.value.code == "forbidden" and refused.value.status == 403
    assert table.get(env_id, "b", operator=True) is entry


def test_a_lease_expires_after_its_ttl_of_silence_unless_a_call_runs():
    now = [1000.0]
    table = LeaseTable(60, clock=lambda: now[0])
    entry = table.add(table.new_id(), "a")
    now[0] += 59
    assert table.expired() == []
    table.touch(entry)
    now[0] += 61
    entry.busy = 1
    assert table.expired() == []
    entry.busy = 0
    assert table.expired() == [entry]
    table.remove(entry.env_id, "expired")
    assert entry.ended == "expired" and len(table) == 0
