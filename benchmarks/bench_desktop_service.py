"""The desktop service under load (issue 35): lease latency at 1, 8 and 32 concurrent
clients, and the service's CPU per lease and per step it relays.

    python benchmarks/bench_desktop_service.py [--quick] [--clients 1,8,32] [--json OUT]

The service (``python -m cua_rollout.service``, a process of its own, measured by pid) lends
simulated desktops (``benchmarks/sim_world.py``, ``provider: static``, in processes of their
own so their CPU is not counted) to ``C`` concurrent clients (``DesktopServiceClient``, in
this process). For each ``C``:

- **leases**: each client leases a desktop with no task (the reply carries the first
  screenshot), then releases it, ``--leases`` times. Lease latency is the lease call's
  wall time at the client; the service's CPU per lease covers the lease, its screenshot, the
  release and the reset the pool starts.
- **steps**: each client holds one lease and acts ``--steps`` times (``pyautogui`` code, no
  pause, the next screenshot in the reply), then fetches the screenshot through the relay
  (``GET .../screenshot``) as often. The service's CPU per step covers one act with its
  observation plus one relayed screenshot; the bytes relayed are counted.

There are ``2 x max(C) + 4`` desktops with a 50 ms reset, so a released desktop is back
before it is needed: the latency is the service's, not a wait for a reset (the table says
when a lease waited). Nothing is asserted; the figures are printed (and written to --json).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import psutil
import yaml

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.sim_world import DesktopSim, Latency, SimWorld  # noqa: E402
from cua_rollout.envs.service_client import DesktopServiceClient  # noqa: E402

__all__ = ["main", "measure"]

TOKEN_ENV = "CUA_BENCH_SERVICE_TOKEN"
STEP_CODE = "pyautogui.moveTo(100, 100)"
START_TIMEOUT_S = 120.0


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def _config(path: Path, world: SimWorld, desktops: int, work: Path) -> None:
    cfg = {
        "run": {"name": "bench-service", "output_dir": str(work / "runs")},
        "desktops": {
            "provider": "static", "count": desktops, "warm_spares": 0,
            "static": {"urls": world.desktop_urls, "reset_command": world.reset_command},
            "verify": {"enabled": False},  # simulated desktops run no real commands
        },
        "service": {
            "host": "127.0.0.1", "port": 0, "default_access": "relay",
            "tenants": [{"name": "bench", "token_env": TOKEN_ENV, "max_leases": desktops}],
            "action_pause_s": 0.0, "lease_ttl_s": 600.0,
        },
    }
    path.write_text(yaml.safe_dump(cfg))


class Service:
    """The service as a process of its own, by pid."""

    def __init__(self, config: Path, token: str, log: Path) -> None:
        env = {**os.environ, TOKEN_ENV: token, "PYTHONPATH": str(ROOT)}
        self._log = log.open("w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "cua_rollout.service", "--config", str(config)],
            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=self._log, text=True,
            start_new_session=True)
        self.url = self._wait_url(log)
        self.ps = psutil.Process(self.proc.pid)

    def _wait_url(self, log: Path) -> str:
        deadline = time.monotonic() + START_TIMEOUT_S
        assert self.proc.stdout is not None
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if not line:
                break
            if line.startswith("desktop service on "):
                return line.split()[3]
        self.stop()
        raise RuntimeError(f"the service did not start: {log.read_text()[-2000:]}")

    def cpu_s(self) -> float:
        t = self.ps.cpu_times()
        return t.user + t.system

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        self._log.close()


async def _leases(url: str, token: str, clients: int, per_client: int
                  ) -> tuple[list[float], list[float]]:
    lease_s: list[float] = []
    waited_s: list[float] = []

    async def one(i: int) -> None:
        async with DesktopServiceClient(url, token) as client:
            for _ in range(per_client):
                t0 = time.perf_counter()
                lease = await client.lease(label=f"bench-{i}", wait_s=60)
                lease_s.append(time.perf_counter() - t0)
                waited_s.append(lease.waited_s)
                await client.release(lease.env_id)

    await asyncio.gather(*(one(i) for i in range(clients)))
    return lease_s, waited_s


async def _steps(url: str, token: str, clients: int, steps: int
                 ) -> tuple[list[float], list[float], int]:
    act_s: list[float] = []
    shot_s: list[float] = []
    relayed = 0
    ready = asyncio.Event()
    held = 0

    async def one(i: int) -> None:
        nonlocal relayed, held
        async with DesktopServiceClient(url, token) as client:
            lease = await client.lease(label=f"bench-{i}", wait_s=60)
            held += 1
            if held == clients:
                ready.set()
            await ready.wait()  # every client holds its lease before the timing starts
            try:
                for _ in range(steps):
                    t0 = time.perf_counter()
                    reply = await client.act(lease.env_id, kind="pyautogui", code=STEP_CODE,
                                             pause_s=0.0)
                    act_s.append(time.perf_counter() - t0)
                    relayed += len(reply.screenshot_png_b64 or "") * 3 // 4
                    if reply.returncode not in (0, None):
                        raise RuntimeError(f"step failed: {reply.error}")
                    t0 = time.perf_counter()
                    png = await client.screenshot(lease.env_id)  # awaited before the +=:
                    relayed += len(png)                           # no update lost meanwhile
                    shot_s.append(time.perf_counter() - t0)
            finally:
                await client.release(lease.env_id)

    await asyncio.gather(*(one(i) for i in range(clients)))
    return act_s, shot_s, relayed


def measure(clients_list: list[int], leases: int, steps: int) -> dict[str, Any]:
    """The figures for each number of concurrent clients (see the module's docstring)."""
    token = os.urandom(16).hex()
    desktops = 2 * max(clients_list) + 4
    sim = DesktopSim(reset_latency=Latency(0.05, 0.0), action_latency=Latency(0.01, 0.0),
                     screenshots=4)
    rows = []
    with tempfile.TemporaryDirectory(prefix="cua-bench-service-") as tmp:
        work = Path(tmp)
        with SimWorld(desktops=desktops, desktop=sim) as world:
            config = work / "service.yaml"
            _config(config, world, desktops, work)
            service = Service(config, token, work / "service.log")
            try:
                for clients in clients_list:
                    c0 = service.cpu_s()
                    t0 = time.monotonic()
                    lease_s, waited = asyncio.run(_leases(service.url, token, clients, leases))
                    lease_wall = time.monotonic() - t0
                    c1 = service.cpu_s()
                    # Let the resets the releases started finish before the steps phase.
                    time.sleep(1.0)
                    c2 = service.cpu_s()
                    act_s, shot_s, relayed = asyncio.run(
                        _steps(service.url, token, clients, steps))
                    c3 = service.cpu_s()
                    n_leases, n_steps = len(lease_s), len(act_s)
                    rows.append({
                        "clients": clients, "leases": n_leases,
                        "lease_p50_ms": 1000 * statistics.median(lease_s),
                        "lease_p99_ms": 1000 * _pct(lease_s, 0.99),
                        "leases_per_s": n_leases / lease_wall,
                        "lease_waited_max_s": max(waited),
                        "cpu_ms_per_lease": 1000 * (c1 - c0) / n_leases,
                        "steps": n_steps,
                        "act_p50_ms": 1000 * statistics.median(act_s),
                        "act_p99_ms": 1000 * _pct(act_s, 0.99),
                        "relay_shot_p50_ms": 1000 * statistics.median(shot_s),
                        # The steps phase's CPU includes its own leases and releases
                        # (one per client): taken out at the per-lease figure.
                        "cpu_ms_per_step": 1000 * max(
                            0.0, (c3 - c2) - clients * (c1 - c0) / n_leases) / n_steps,
                        # The PNG in the act reply plus the relayed one.
                        "relayed_kb_per_step": relayed / n_steps / 1024,
                    })
                    print(json.dumps(rows[-1]), flush=True)
            finally:
                service.stop()
    return {"desktops": desktops, "leases_per_client": leases, "steps_per_client": steps,
            "rows": rows}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer leases and steps")
    parser.add_argument("--clients", default="1,8,32",
                        help="concurrent clients, comma-separated (default 1,8,32)")
    parser.add_argument("--json", type=Path, help="write the figures here")
    args = parser.parse_args(argv)
    clients = [int(c) for c in args.clients.split(",") if c.strip()]
    if not clients or min(clients) < 1:
        parser.error("--clients: positive integers, e.g. 1,8,32")
    leases, steps = (10, 10) if args.quick else (50, 50)
    result = measure(clients, leases, steps)
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"desktop service: {result['desktops']} simulated desktops, relay")
    columns = {"clients": "clients", "leases": "leases", "lease_p50_ms": "lease p50 ms",
               "lease_p99_ms": "lease p99 ms", "leases_per_s": "leases/s",
               "cpu_ms_per_lease": "CPU ms/lease", "steps": "steps", "act_p50_ms": "act p50 ms",
               "act_p99_ms": "act p99 ms", "relay_shot_p50_ms": "relayed shot p50 ms",
               "cpu_ms_per_step": "CPU ms/step", "relayed_kb_per_step": "KB/step"}
    for header in columns.values():
        table.add_column(header, justify="right")
    for row in result["rows"]:
        table.add_row(*(f"{row[c]:.1f}" if isinstance(row[c], float) else str(row[c])
                        for c in columns))
    Console(width=200).print(table)
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
