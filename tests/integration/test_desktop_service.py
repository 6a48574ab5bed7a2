"""The desktop service as a process (real uvicorn) on local Xvfb desktops: two tenants
lease, act, evaluate and release concurrently within their quotas (a third lease of the
quota-1 tenant waits, then 429); a demo task's reference solution scores 1.0 through the
service and the untouched desktop 0; direct access ends with the lease; the relay; the
operator CLI against the service. Faults: a client that disappears, a desktop killed under a
lease, the service killed with -9 and restarted (old env ids 410, its desktops swept)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import psutil
import pytest

from cua_rollout.envs.service_client import (
    DesktopServiceClient,
    LeaseGone,
    ServiceError,
    ServiceUnavailable,
)
from tests.support import REPO_ROOT

pytestmark = [pytest.mark.integration, pytest.mark.slow]

TASKS = REPO_ROOT / "tasks" / "demo" / "examples" / "terminal"
TOKENS = {"SVC_DESK_TOKEN": "desk-secret", "SVC_TOKEN_A": "token-a",
          "SVC_TOKEN_B": "token-b", "SVC_TOKEN_OP": "token-op"}


def _task(name: str) -> dict[str, Any]:
    return json.loads((TASKS / f"{name}.json").read_text())


class _Service:
    """``python -m cua_rollout.service`` on ``count`` local desktops."""

    def __init__(self, tmp: Path, *, count: int, ttl_s: float = 60.0) -> None:
        self.tmp = tmp
        self.state_dir = tmp / "desktops"
        self.config = tmp / "service.yaml"
        self.config.write_text(f"""
desktops:
  provider: local
  count: {count}
  warm_spares: 0
  screen_width: 1280
  screen_height: 720
  token_env: SVC_DESK_TOKEN
  local: {{state_dir: {self.state_dir}}}
service:
  port: 0
  tenants:
    - {{name: a, token_env: SVC_TOKEN_A, max_leases: 1}}
    - {{name: b, token_env: SVC_TOKEN_B, max_leases: 2}}
  operator_token_env: SVC_TOKEN_OP
  lease_ttl_s: {ttl_s}
  action_pause_s: 0.3
""")
        self.proc: subprocess.Popen[str] | None = None
        self.url = ""
        self.log = tmp / "service.log"

    def start(self) -> _Service:
        env = {**os.environ, **TOKENS, "PYTHONPATH": str(REPO_ROOT)}
        with self.log.open("a") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "cua_rollout.service", "--config", str(self.config)],
                cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE, stderr=log, text=True,
                start_new_session=True)
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()  # the service's one line, when it serves
        assert line.startswith("desktop service on "), (line, self.log.read_text()[-3000:])
        self.url = line.split()[3]
        return self

    def stop(self) -> int:
        """SIGTERM, as a supervisor stops it; its exit status."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGTERM)
        return self._ended(self.proc.wait(timeout=120))

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.kill()
        self._ended(self.proc.wait(timeout=30))

    def _ended(self, code: int) -> int:
        assert self.proc is not None and self.proc.stdout is not None
        self.proc.stdout.close()
        return code

    def session_pids(self) -> set[int]:
        """The pids of every local desktop's core processes, from their session files."""
        pids = set()
        for path in self.state_dir.glob("*/session.json"):
            pids |= {e["pid"] for e in json.loads(path.read_text())["processes"]}
        return pids

    def client(self, token: str) -> DesktopServiceClient:
        return DesktopServiceClient(self.url, token, timeout_s=180)


@contextlib.contextmanager
def _running(tmp: Path, **kw: Any) -> Iterator[_Service]:
    service = _Service(tmp, **kw).start()
    try:
        yield service
    finally:
        if service.proc is not None and service.proc.poll() is None:
            try:
                service.stop()
            except subprocess.TimeoutExpired:
                service.kill()


def _alive(pids: set[int]) -> set[int]:
    return {p for p in pids if psutil.pid_exists(p)
            and psutil.Process(p).status() != psutil.STATUS_ZOMBIE}


async def _play(client: DesktopServiceClient, env_id: str, task: dict[str, Any]
                ) -> dict[str, Any]:
    """Score the leased task untouched, play its reference solution, score it, release."""
    untouched = (await client.evaluate(env_id)).reward
    for reply in task["reference_solution"]:
        step = await client.act(env_id, kind="uitars", reply=reply)
        assert step.parse_error is None, step
    solved = await client.evaluate(env_id)
    released = await client.release(env_id)
    return {"untouched": untouched, "reward": solved.reward, "released": released.released}


async def _solve(client: DesktopServiceClient, name: str, *, access: str = "direct"
                 ) -> dict[str, Any]:
    """Lease ``name`` and play it (``_play``)."""
    task = _task(name)
    lease = await client.lease(task, access=access, wait_s=120)
    return {"lease": lease, **await _play(client, lease.env_id, task)}


def _tool(service: _Service, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "CUA_SERVICE_TOKEN": TOKENS["SVC_TOKEN_OP"],
           "PYTHONPATH": str(REPO_ROOT)}
    return subprocess.run([sys.executable, str(REPO_ROOT / "scripts" / "desktops.py"), *args,
                           "--service", service.url], cwd=REPO_ROOT, env=env,
                          capture_output=True, text=True, timeout=60)


async def test_two_tenants_lease_act_evaluate_release_within_their_quotas(tmp):
    with _running(tmp, count=3) as service:
        async with service.client("token-a") as a, service.client("token-b") as b:
            task = _task("terminal-hello-file")
            held = await a.lease(task)

            async def a_also_leases() -> ServiceError:
                with pytest.raises(ServiceUnavailable) as over:  # a holds its 1
                    await a.lease(wait_s=2)
                return over.value

            *of_b, over = await asyncio.gather(
                _solve(b, "terminal-make-dirs", access="relay"),
                _solve(b, "terminal-count-lines"),
                a_also_leases())
            of_a = await _play(a, held.env_id, task)
            solved = [of_a, *of_b]
            assert [r["reward"] for r in solved] == [1.0, 1.0, 1.0]
            assert [r["untouched"] for r in solved] == [0.0, 0.0, 0.0]
            assert all(r["released"] for r in solved)
            assert over.code == "over_quota" and over.status == 429
            assert over.retry_after_s and "tenant a holds 1 of its 1" in str(over)
            # at once, each on its own desktop
            assert len({held.desktop_id, *(r["lease"].desktop_id for r in of_b)}) == 3

            # Direct access: the lease's token works while the lease lives, not after.
            lease = await a.lease(access="direct")
            auth = {"Authorization": f"Bearer {lease.desktop_token}"}
            async with aiohttp.ClientSession() as http:
                async with http.get(lease.desktop_url + "/screenshot", headers=auth) as r:
                    assert r.status == 200 and (await r.read()).startswith(b"\x89PNG")
                # A lease's token cannot install another (one that would outlive the lease).
                async with http.post(lease.desktop_url + "/lease_token", headers=auth,
                                     json={"token": "mine-forever"}) as r:
                    assert r.status == 401
                # The relay: the tenant's token in, the desktop's own token out.
                relay = await b.lease(access="relay")
                async with http.post(f"{service.url}{relay.desktop_url}/screen_size",
                                     headers={"Authorization": "Bearer token-b"}) as r:
                    assert r.status == 200 and (await r.json())["width"] == 1280
                async with http.post(f"{service.url}{relay.desktop_url}/screen_size",
                                     headers={"Authorization": "Bearer token-a"}) as r:
                    assert r.status == 403  # another tenant's lease
                await a.release(lease.env_id)
                await b.release(relay.env_id)
                deadline = time.monotonic() + 30
                while True:  # cleared before the reset
                    async with http.get(lease.desktop_url + "/screenshot", headers=auth) as r:
                        if r.status == 401:
                            break
                    assert time.monotonic() < deadline
                    await asyncio.sleep(0.2)

            status = _tool(service, "status", "--json")
            assert status.returncode == 0, status.stderr
            rows = json.loads(status.stdout)["desktops"]
            assert len(rows) == 3 and all(r["provider"] == "local" for r in rows)
            metrics = await _get(service.url + "/metrics", "token-op")
            assert 'cua_service_leases_granted_total{tenant="b"} 3.0' in metrics
            assert 'cua_service_refusals_total{code="over_quota"} 1.0' in metrics
            assert "cua_service_relayed_bytes_total" in metrics
        pids = service.session_pids()
        assert len(_alive(pids)) >= 3 * 3
        assert service.stop() == 0
        assert _alive(pids) == set() and not list(service.state_dir.glob("*/session.json"))


async def _get(url: str, token: str) -> str:
    async with aiohttp.ClientSession() as http, http.get(
            url, headers={"Authorization": f"Bearer {token}"}) as r:
        assert r.status == 200
        return await r.text()


async def test_a_client_that_disappears_and_a_desktop_that_dies(tmp):
    with _running(tmp, count=1, ttl_s=3) as service:
        async with service.client("token-a") as a, service.client("token-b") as b:
            # a leases and goes silent: its lease expires, the desktop is reset and lent to b.
            gone = await a.lease(_task("terminal-hello-file"))
            again = await b.lease(wait_s=60)
            assert again.desktop_id == gone.desktop_id
            with pytest.raises(LeaseGone) as lost:
                await a.act(gone.env_id, kind="special", code="WAIT")
            assert lost.value.code == "unknown_env"
            status = json.loads(_tool(service, "status", "--json").stdout)["desktops"]
            assert [r["tenant"] for r in status] == ["b"]

            # b's desktop server is killed under its lease.
            port = int(again.desktop_url.rsplit(":", 1)[1])
            server = next(c.pid for c in psutil.net_connections("tcp")
                          if c.laddr and c.laddr.port == port and c.status == "LISTEN")
            os.kill(server, signal.SIGKILL)
            with pytest.raises(ServiceError) as died:
                async with b.keep_alive(again.env_id, 1):
                    await b.act(again.env_id, kind="pyautogui", code="pyautogui.click(5, 5)")
            assert died.value.code == "desktop_died" and died.value.status == 502
            assert again.desktop_id in str(died.value)
            with pytest.raises(LeaseGone):
                await b.info(again.env_id)
            # The pool replaces it; b leases the new one.
            replaced = await b.lease(wait_s=120)
            assert replaced.desktop_id != again.desktop_id
            await b.release(replaced.env_id)


async def test_a_killed_service_loses_its_leases_cleanly_and_leaks_no_desktop(tmp):
    first = _Service(tmp, count=1).start()
    try:
        async with first.client("token-a") as a:
            held = await a.lease()
        old_pids = _alive(first.session_pids())
        assert old_pids
    finally:
        first.kill()  # kill -9: nothing of it runs its stop
    assert _alive(old_pids) == old_pids  # the desktops outlive it, for now
    with _running(tmp, count=1) as second:
        assert _alive(old_pids) == set()  # swept when the new instance started
        async with second.client("token-a") as a:
            with pytest.raises(LeaseGone) as lost:
                await a.act(held.env_id, kind="special", code="WAIT")
            assert lost.value.code == "lease_lost" and lost.value.status == 410
            assert "earlier instance" in str(lost.value)
            fresh = await a.lease()  # and the tenant's quota is whole
            await a.release(fresh.env_id)
        new_pids = _alive(second.session_pids())
        assert new_pids and not new_pids & old_pids
    assert _alive(new_pids) == set()
