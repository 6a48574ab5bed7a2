"""What the desktop service itself costs: lease latency at 1, 8 and 32 concurrent clients,
and the service process's CPU per lease (+ release), per action step (the action, then a
1280x720 screenshot returned as base64) and per relayed screenshot.

    python benchmarks/bench_desktop_service.py [--leases 200] [--steps 200] [--json]

The service runs in a process of its own (``--serve``: the real app under uvicorn, the real
``DesktopPool``, tenants and lease table) over fake desktops (``tests/doubles``: no Xvfb,
resets take no time), so the figures are the service's share, not a desktop's; relayed
requests go to a fake desktop server in this process. The clients are
``DesktopServiceClient``s in this process; CPU is the service process's (psutil) over each
phase.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

_TOKEN = "bench-token"
_DESKTOPS = 40
_SIZE = (1280, 720)


def _png() -> bytes:
    from benchmarks.sim_world import make_screenshot

    return make_screenshot(1, *_SIZE)


async def _serve(desktop_url: str) -> None:
    """The child: the service over fake desktops, until stdin closes."""
    import uvicorn

    from cua_rollout.config import Config
    from cua_rollout.core.screenshot import Screenshot
    from cua_rollout.envs.contract import DesktopAddress
    from cua_rollout.runtime.pool import DesktopPool
    from cua_rollout.service.app import create_app
    from cua_rollout.service.core import DesktopService
    from cua_rollout.service.relay import Relay
    from cua_rollout.service.serve import service_pool_config
    from cua_rollout.service.tenants import AddressAllowList, Tenant, Tenants
    from tests.doubles.fake_desktop import FakeDesktop, FakeProvider

    png = _png()

    class Desktop(FakeDesktop):
        async def observe(self) -> Screenshot:
            return Screenshot(png)

        async def health(self) -> bool:
            return True

        def address(self) -> DesktopAddress:
            return DesktopAddress(desktop_url)

    class Evaluator:
        async def close(self) -> None:
            pass

    cfg = service_pool_config(Config.model_validate({
        "desktops": {"count": _DESKTOPS, "warm_spares": 0},
        "service": {"tenants": [{"name": "t", "token_env": "UNUSED",
                                 "max_leases": _DESKTOPS}],
                    "default_access": "relay", "action_pause_s": 0}}))
    provider = FakeProvider(desktop_factory=lambda _: Desktop(size=_SIZE))
    pool = DesktopPool(cfg.desktops, provider)
    await pool.start()
    service = DesktopService(cfg, pool, Tenants([Tenant("t", _TOKEN, _DESKTOPS)]),
                             evaluator=Evaluator(),  # type: ignore[arg-type]
                             env_factory=provider.env_factory)
    await service.start()
    relay = Relay(service.metrics, 30)
    server = uvicorn.Server(uvicorn.Config(create_app(service, AddressAllowList([]), relay),
                                           host="127.0.0.1", port=0, log_level="error",
                                           lifespan="off", interface="asgi3"))
    serving = asyncio.create_task(server.serve())
    while not server.started:
        await asyncio.sleep(0.01)
    print(f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}", flush=True)
    await asyncio.to_thread(sys.stdin.read)  # the parent closes it when done
    server.should_exit = True
    await serving
    await service.stop()
    await relay.close()
    await pool.stop()


def _desktop_app(png: bytes) -> Any:
    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        assert scope["type"] == "http"
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"image/png"),
                                (b"content-length", str(len(png)).encode())]})
        await send({"type": "http.response.body", "body": png})
    return app


def _percentiles(samples_s: list[float]) -> dict[str, float]:
    ordered = sorted(samples_s)
    return {"p50_ms": round(1000 * statistics.median(ordered), 2),
            "p99_ms": round(1000 * ordered[min(len(ordered) - 1,
                                               int(0.99 * len(ordered)))], 2)}


async def _measure(url: str, proc: Any, leases: int, steps: int) -> dict[str, Any]:
    import aiohttp

    from cua_rollout.envs.service_client import DesktopServiceClient

    out: dict[str, Any] = {}

    def cpu() -> float:
        times = proc.cpu_times()
        return times.user + times.system

    async with DesktopServiceClient(url, _TOKEN) as client:
        await client.release((await client.lease()).env_id)  # warm up
        for clients in (1, 8, 32):
            latencies: list[float] = []
            per_client = max(1, leases // clients)

            async def one(samples: list[float] = latencies, n: int = per_client) -> None:
                for _ in range(n):
                    t0 = time.perf_counter()
                    lease = await client.lease()
                    samples.append(time.perf_counter() - t0)
                    await client.release(lease.env_id)

            c0 = cpu()
            await asyncio.gather(*(one() for _ in range(clients)))
            used = cpu() - c0
            out[f"lease_{clients}_clients"] = {
                **_percentiles(latencies), "leases": len(latencies),
                "service_cpu_ms_per_lease": round(1000 * used / len(latencies), 2)}

        held = [await client.lease() for _ in range(8)]
        per = max(1, steps // len(held))

        async def act(env_id: str) -> None:
            for _ in range(per):
                await client.act(env_id, kind="pyautogui", code="pass")

        c0 = cpu()
        await asyncio.gather(*(act(x.env_id) for x in held))
        out["act_step"] = {"steps": per * len(held), "service_cpu_ms_per_step": round(
            1000 * (cpu() - c0) / (per * len(held)), 2)}

        async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {_TOKEN}"}) as http:
            async def relayed(path: str) -> int:
                size = 0
                for _ in range(per):
                    async with http.get(url + path + "/screenshot") as r:
                        size = len(await r.read())
                return size

            c0 = cpu()
            sizes = await asyncio.gather(*(relayed(x.desktop_url) for x in held))
            out["relayed_screenshot"] = {
                "requests": per * len(held), "bytes_each": sizes[0],
                "service_cpu_ms_per_request": round(1000 * (cpu() - c0) / (per * len(held)),
                                                    2)}
        for x in held:
            await client.release(x.env_id)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--serve", metavar="DESKTOP_URL", help=argparse.SUPPRESS)
    parser.add_argument("--leases", type=int, default=320)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    if args.serve:
        asyncio.run(_serve(args.serve))
        return 0
    import psutil

    from cua_rollout.core.http import ThreadedServer

    with ThreadedServer(_desktop_app(_png())) as desktop:
        child = subprocess.Popen(
            [sys.executable, __file__, "--serve", desktop.url], stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, text=True,
            env={**os.environ, "PYTHONPATH": str(ROOT)})
        try:
            assert child.stdout is not None and child.stdin is not None
            url = child.stdout.readline().strip()
            result = asyncio.run(_measure(url, psutil.Process(child.pid), args.leases,
                                          args.steps))
        finally:
            if child.stdin is not None:
                child.stdin.close()
            child.wait(timeout=60)
            if child.stdout is not None:
                child.stdout.close()
    if args.json:
        print(json.dumps(result, indent=1))
    else:
        for name, figures in result.items():
            print(f"{name:24} " + "  ".join(f"{k} {v}" for k, v in figures.items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
