"""``DesktopServiceClient`` against the real service app (uvicorn on a free port, in the
test's loop) over a pool of fake desktops: every method, and every error code mapped to its
class; quotas, expiry, bad input and another tenant's env id, with nothing else disturbed."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
import uvicorn

from cua_rollout.config import Config
from cua_rollout.core.errors import ConfigError, DesktopUnavailable
from cua_rollout.envs.contract import DesktopAddress
from cua_rollout.envs.service_client import (
    BadServiceRequest,
    DesktopServiceClient,
    LeaseGone,
    ServiceRefused,
    ServiceUnavailable,
)
from cua_rollout.envs.service_protocol import decode_png
from cua_rollout.runtime.pool import DesktopPool
from cua_rollout.service.app import create_app
from cua_rollout.service.core import DesktopService
from cua_rollout.service.relay import Relay
from cua_rollout.service.serve import service_pool_config
from cua_rollout.service.tenants import AddressAllowList, Tenant, Tenants
from tests.doubles.fake_desktop import FakeDesktop, FakeProvider
from tests.support import until

TASK = {"id": "t1", "instruction": "click", "config": [],
        "evaluator": {"func": "check", "result": {}, "expected": {}}}


class _Desktop(FakeDesktop):
    """A fake desktop with what the service asks of a ``RemoteDesktopEnv`` beyond the
    contract."""

    def __init__(self, name: str) -> None:
        super().__init__(size=(1280, 720), name=name)
        self.alive = True
        self.keeps_token = False
        self.tokens: list[str | None] = []

    async def health(self) -> bool:
        return self.alive

    async def set_lease_token(self, token: str | None) -> None:
        if token is None and self.keeps_token:
            from cua_rollout.core.errors import DesktopError
            raise DesktopError("cannot clear")
        self.tokens.append(token)

    def address(self) -> DesktopAddress:
        return DesktopAddress(f"http://{self.name}")


class _LoopbackProvider(FakeProvider):
    """Fake desktops whose URLs are on loopback, as local desktops' are."""

    async def start(self, index: int) -> Any:
        desktop = await super().start(index)
        desktop.url = f"http://127.0.0.1:{7000 + index}"
        return desktop


class _Evaluator:
    """Scores 1 when the episode's actions include a click and ended with DONE."""

    async def evaluate(self, env: Any, task: Any, last_action: str | None, *,
                       task_id: str | None = None) -> float:
        return 1.0 if last_action == "DONE" and any("click" in a for a in env.actions) else 0.0

    async def close(self) -> None:
        pass


@contextlib.asynccontextmanager
async def _service(count: int = 3, ttl_s: float = 30.0, allow: list[str] | None = None,
                   **service: Any) -> AsyncIterator[tuple[str, DesktopService, FakeProvider]]:
    cfg = service_pool_config(Config.model_validate({
        "desktops": {"count": count, "warm_spares": 0, "token_env": "UNUSED"},
        "service": {"tenants": [{"name": "a", "token_env": "A", "max_leases": 1},
                                {"name": "b", "token_env": "B", "max_leases": 2}],
                    "lease_ttl_s": ttl_s, "default_wait_s": 0.2, "action_pause_s": 0,
                    "max_body_bytes": 100_000, **service}}))
    provider = _LoopbackProvider(desktop_factory=_Desktop)
    pool = DesktopPool(cfg.desktops, provider)
    await pool.start()
    tenants = Tenants([Tenant("a", "tok-a", 1), Tenant("b", "tok-b", 2)], "tok-op")
    service = DesktopService(cfg, pool, tenants, evaluator=_Evaluator(),  # type: ignore[arg-type]
                             env_factory=provider.env_factory)
    await service.start()
    relay = Relay(service.metrics, 5.0)
    app = create_app(service, AddressAllowList(allow or []), relay)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="error",
                                           lifespan="off", interface="asgi3"))
    server.install_signal_handlers = lambda: None  # type: ignore[method-assign]
    serving = asyncio.create_task(server.serve())
    await until(lambda: server.started, 10)
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}", service, provider
    finally:
        server.should_exit = True
        await serving
        await service.stop()
        await relay.close()
        await pool.stop()


async def test_lease_act_observe_evaluate_release():
    async with _service() as (url, _, provider), \
            DesktopServiceClient(url, "tok-a") as client:
        lease = await client.lease(TASK, label="run-1")
        assert lease.tenant == "a" and (lease.screen.width, lease.screen.height) == (1280, 720)
        assert decode_png(lease.screenshot_png_b64 or "").startswith(b"\x89PNG")
        assert lease.access == "direct" and lease.desktop_token  # a token of its own
        desktop = provider.desktops[lease.desktop_id]
        assert desktop.tokens == [lease.desktop_token]
        moved = await client.act(lease.env_id, kind="pyautogui",
                                 code="pyautogui.click(10, 20)", observe=["screenshot",
                                                                           "a11y_tree"])
        assert moved.step == 1 and moved.executed == "pyautogui.click(10, 20)"
        assert moved.a11y_tree == "<desktop-frame/>" and moved.screenshot_png_b64
        parsed = await client.act(lease.env_id, kind="uitars",
                                  reply="Thought: t\nAction: click(start_box='(644,364)')")
        assert parsed.executed and "click" in parsed.executed and parsed.parse_error is None
        bad = await client.act(lease.env_id, kind="uitars", reply="no action here")
        assert bad.parse_error and bad.executed is None
        c13 = await client.act(lease.env_id, kind="computer13",
                               action={"action_type": "CLICK", "x": 5, "y": 6})
        assert c13.executed and "click" in c13.executed.lower()
        with pytest.raises(BadServiceRequest) as unparseable:
            await client.act(lease.env_id, kind="computer13",
                             action={"action_type": "CLICK", "x": 5000, "y": 6})
        assert unparseable.value.code == "unparseable" and unparseable.value.status == 422
        done = await client.act(lease.env_id, kind="special", code="DONE")
        assert done.terminal == "DONE" and done.screenshot_png_b64 is None
        assert (await client.observe(lease.env_id, ["terminal"])).terminal == ""
        assert (await client.screenshot(lease.env_id)).startswith(b"\x89PNG")
        assert (await client.evaluate(lease.env_id)).reward == 1.0
        info = await client.info(lease.env_id)
        assert info.task_id == "t1" and info.label == "run-1" and info.steps == 5
        assert (await client.heartbeat(lease.env_id)).expires_at >= info.expires_at
        status = await client.status()
        assert [x["env_id"] for x in status["leases"]] == [lease.env_id]
        released = await client.release(lease.env_id)
        assert released.released and released.steps == 5
        with pytest.raises(LeaseGone) as gone:
            await client.info(lease.env_id)
        assert gone.value.code == "unknown_env" and gone.value.status == 404
        await until(lambda: desktop.tokens[-1:] == [None], 5)  # cleared before the reset
        await until(lambda: lease.desktop_id in provider.resets, 5)


async def test_quota_then_429_and_the_other_tenant_is_undisturbed():
    async with _service() as (url, _, _provider), \
            DesktopServiceClient(url, "tok-a") as a, DesktopServiceClient(url, "tok-b") as b:
        first = await a.lease(access="relay")
        assert first.desktop_url.endswith(f"/v1/leases/{first.env_id}/desktop")
        with pytest.raises(ServiceUnavailable) as over:
            await a.lease(wait_s=0.1)
        assert isinstance(over.value, DesktopUnavailable)
        assert over.value.code == "over_quota" and over.value.status == 429
        assert over.value.retry_after_s and over.value.retry_after_s > 0
        b1, b2 = await asyncio.gather(b.lease(), b.lease())
        with pytest.raises(ServiceUnavailable) as none_free:  # b's quota 2, no desktop left
            await a.release(first.env_id)
            await asyncio.sleep(0)
            await b.lease(wait_s=0)
        assert none_free.value.code in ("over_quota", "no_desktop")
        # A waiter gets the slot a release frees.
        a2 = await a.lease(wait_s=5)
        for env_id in (b1.env_id, b2.env_id):
            await b.release(env_id)
        await a.release(a2.env_id)
        text = (await aiohttp_get(url + "/metrics", "tok-op")).decode()
        assert 'cua_service_refusals_total{code="over_quota"}' in text
        assert 'cua_service_leases_granted_total{tenant="b"} 2.0' in text


async def aiohttp_get(url: str, token: str) -> bytes:
    async with aiohttp.ClientSession() as s, s.get(
            url, headers={"Authorization": f"Bearer {token}"}) as r:
        return await r.read()


async def test_bad_input_is_a_4xx_with_the_reason_and_disturbs_nothing():
    async with _service() as (url, _, provider), \
            DesktopServiceClient(url, "tok-a") as a, DesktopServiceClient(url, "tok-b") as b:
        mine = await b.lease()
        desktop = provider.desktops[mine.desktop_id]
        # Another tenant's env id: 403, and its desktop untouched.
        with pytest.raises(ServiceRefused) as forbidden:
            await a.act(mine.env_id, kind="pyautogui", code="pyautogui.click(1, 1)")
        assert forbidden.value.code == "forbidden" and forbidden.value.status == 403
        assert isinstance(forbidden.value, ConfigError) and desktop.actions == []
        with pytest.raises(LeaseGone) as lost:
            await a.info("00000000-1")
        assert lost.value.code == "lease_lost" and lost.value.status == 410
        with pytest.raises(ServiceRefused) as wrong:
            async with DesktopServiceClient(url, "nope") as nobody:
                await nobody.status()
        assert wrong.value.code == "unauthorized" and wrong.value.status == 401
        with pytest.raises(ServiceRefused):
            await a.desktops()  # the operator's
        async with aiohttp.ClientSession(headers={"Authorization": "Bearer tok-a"}) as s:
            async def post(path: str, data: bytes) -> tuple[int, dict[str, Any]]:
                async with s.post(url + path, data=data,
                                  headers={"Content-Type": "application/json"}) as r:
                    return r.status, await r.json()

            status, body = await post("/v1/leases", b"{not json")
            assert status == 400 and body["code"] == "bad_request"
            status, body = await post("/v1/leases", json.dumps({"wait": 1}).encode())
            assert status == 400 and "wait" in body["error"]
            status, body = await post("/v1/leases", b"x" * 200_000)
            assert status == 413 and body["code"] == "too_large"

            async def chunks() -> AsyncIterator[bytes]:
                for _ in range(50):
                    yield b"x" * 10_000

            async with s.post(url + "/v1/leases", data=chunks()) as r:
                assert r.status == 413
            # A relayed request the desktop does not answer, while it still answers its
            # health check: that request's failure, the lease lives on.
            relay_url = f"{url}/v1/leases/{mine.env_id}/desktop/screenshot"
            async with s.get(relay_url, headers={"Authorization": "Bearer tok-b"}) as r:
                assert r.status == 502 and (await r.json())["code"] == "relay_failed"
            async with s.get(relay_url) as r:  # tok-a: another tenant's
                assert r.status == 403
        # b's lease still works.
        assert (await b.act(mine.env_id, kind="special", code="WAIT")).step == 1
        assert (await b.release(mine.env_id)).released


async def test_a_silent_lease_expires_and_its_desktop_is_lent_again():
    async with _service(count=1, ttl_s=0.5) as (url, service, provider), \
            DesktopServiceClient(url, "tok-a") as a, DesktopServiceClient(url, "tok-b") as b:
        lease = await a.lease()
        async with a.keep_alive(lease.env_id, 0.1) as beats:
            await until(lambda: beats.beats >= 8, 10)  # heartbeats keep it past its ttl
        assert (await a.info(lease.env_id)).env_id == lease.env_id
        # The client disappears: no call for the ttl.
        await until(lambda: len(service.table) == 0, 10)
        again = await b.lease(wait_s=5)
        assert again.desktop_id == lease.desktop_id and provider.resets == [lease.desktop_id]
        with pytest.raises(LeaseGone):
            await a.heartbeat(lease.env_id)
        await b.release(again.env_id)


async def test_a_desktop_that_dies_ends_the_lease_naming_it():
    async with _service(count=1) as (url, _, provider), \
            DesktopServiceClient(url, "tok-a") as a:
        lease = await a.lease()
        desktop = provider.desktops[lease.desktop_id]

        def dead(code: str) -> None:
            from cua_rollout.core.errors import DesktopError
            raise DesktopError("connection refused")

        desktop._step_func = dead
        desktop.alive = False
        provider.fail_reset.add(lease.desktop_id)
        with pytest.raises(Exception) as died:
            await a.act(lease.env_id, kind="pyautogui", code="pyautogui.click(1, 1)")
        assert getattr(died.value, "code", None) == "desktop_died"
        assert died.value.status == 502 and lease.desktop_id in str(died.value)
        with pytest.raises(LeaseGone):
            await a.info(lease.env_id)
        await until(lambda: lease.desktop_id in provider.stopped and len(provider.started) == 2,
                    10)  # quarantined, replaced


async def test_an_address_not_allowed_is_refused():
    async with _service(allow=["10.9.9.9"]) as (url, _, _provider), \
            DesktopServiceClient(url, "tok-a") as a:
        with pytest.raises(ServiceRefused) as refused:
            await a.status()
        assert refused.value.code == "address_not_allowed" and refused.value.status == 403
        async with aiohttp.ClientSession() as s, s.get(url + "/healthz") as r:
            assert r.status == 200 and (await r.json())["ok"]


async def test_a_desktop_whose_lease_token_stays_is_not_lent_again():
    async with _service(count=1) as (url, _, provider), \
            DesktopServiceClient(url, "tok-a") as a:
        lease = await a.lease()
        provider.desktops[lease.desktop_id].keeps_token = True
        await a.release(lease.env_id)
        # quarantined and replaced, not reset and lent again with the old token valid
        again = await a.lease(wait_s=10)
        assert again.desktop_id != lease.desktop_id
        assert lease.desktop_id in provider.stopped and lease.desktop_id not in provider.resets
        await a.release(again.env_id)


def test_the_error_message_is_the_services_own_words():
    from cua_rollout.envs.service_client import service_error

    err = service_error(429, b'{"error": "tenant a holds 1", "code": "over_quota"}',
                        {"Retry-After": "7"}, where="svc/v1/leases")
    assert isinstance(err, ServiceUnavailable) and str(err) == "tenant a holds 1"
    assert err.retry_after_s == 7.0 and err.where == "svc/v1/leases"
    proxy = service_error(502, b"<html>bad gateway</html>", where="svc/x")
    assert isinstance(proxy, ServiceUnavailable) and proxy.code is None
    assert "bad gateway" in str(proxy) and proxy.status == 502


async def test_direct_urls_name_the_configured_host_in_place_of_loopback():
    async with _service(direct_host="desktops.example") as (url, _, _provider), \
            DesktopServiceClient(url, "tok-a") as a:
        lease = await a.lease()
        assert lease.desktop_url.startswith("http://desktops.example:70")
        await a.release(lease.env_id)
