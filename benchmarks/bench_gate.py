"""What the VM's token gate (``cua_rollout.vm.gate``) costs a client: small GETs per second
over one keep-alive connection, and MB/s of a 2 MiB reply, straight to the server and
through the gate.

    python benchmarks/bench_gate.py [--requests 1000] [--big 20] [--rounds 5] [--json F]

The server (uvicorn, as ``cua_rollout.core.http.ThreadedServer`` serves) and the gate each
run in a process of their own, as the guest's server and the pool's gate do; the client is
one ``httpx2.AsyncClient`` (what ``RemoteDesktopEnv`` uses), one request at a time. Rounds
alternate direct and gated so that load from elsewhere on the host falls on both; each figure
is the median over the rounds.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import statistics
import time
from pathlib import Path
from typing import Any

import httpx2

from cua_rollout.core.http import ThreadedServer
from cua_rollout.vm.gate import TokenGate

__all__ = ["main"]

TOKEN = "bench-token"
BIG_BYTES = bytes(range(256)) * (8 * 1024)  # 2 MiB


async def _app(scope: dict, receive: Any, send: Any) -> None:
    while (await receive()).get("more_body"):
        pass
    body = BIG_BYTES if scope["path"] == "/big" else b"ok"
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


def _serve_upstream(ports: Any, stop: Any) -> None:
    with ThreadedServer(_app) as server:
        ports.put(server.port)
        stop.wait()


def _serve_gate(upstream_port: int, ports: Any, stop: Any) -> None:
    async def run() -> None:
        gate = TokenGate("127.0.0.1", 0, "127.0.0.1", upstream_port, TOKEN)
        ports.put(await gate.start())
        await asyncio.get_running_loop().run_in_executor(None, stop.wait)
        await gate.close()

    asyncio.run(run())


async def _measure(port: int, requests: int, big: int) -> dict[str, float]:
    headers = {"Authorization": f"Bearer {TOKEN}"}
    async with httpx2.AsyncClient(base_url=f"http://127.0.0.1:{port}", headers=headers,
                                  trust_env=False) as client:
        for _ in range(50):  # warm: the connection, both interpreters
            (await client.get("/small")).raise_for_status()
        latencies = []
        started = time.perf_counter()
        for _ in range(requests):
            t0 = time.perf_counter()
            (await client.get("/small")).raise_for_status()
            latencies.append(time.perf_counter() - t0)
        small_s = time.perf_counter() - started
        started = time.perf_counter()
        for _ in range(big):
            reply = await client.get("/big")
            assert len(reply.content) == len(BIG_BYTES)
        big_s = time.perf_counter() - started
    return {"requests_per_s": requests / small_s,
            "median_ms": statistics.median(latencies) * 1e3,
            "p90_ms": statistics.quantiles(latencies, n=10)[-1] * 1e3,
            "big_mb_per_s": big * len(BIG_BYTES) / 1e6 / big_s}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=1000, help="small GETs per round")
    parser.add_argument("--big", type=int, default=20, help="2 MiB replies per round")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args()

    ports: Any = multiprocessing.Queue()
    stop = multiprocessing.Event()
    upstream = multiprocessing.Process(target=_serve_upstream, args=(ports, stop))
    upstream.start()
    upstream_port = ports.get(timeout=30)
    gate = multiprocessing.Process(target=_serve_gate, args=(upstream_port, ports, stop))
    gate.start()
    gate_port = ports.get(timeout=30)
    try:
        rounds: dict[str, list[dict[str, float]]] = {"direct": [], "gate": []}
        for _ in range(args.rounds):
            for name, port in [("direct", upstream_port), ("gate", gate_port)]:
                rounds[name].append(asyncio.run(_measure(port, args.requests, args.big)))
    finally:
        stop.set()
        for process in (gate, upstream):
            process.join(timeout=15)
    figures = {name: {key: statistics.median(r[key] for r in runs) for key in runs[0]}
               for name, runs in rounds.items()}
    direct, gated = figures["direct"], figures["gate"]
    print(f"{'':8} {'GET/s':>8} {'median ms':>10} {'p90 ms':>8} {'2 MiB MB/s':>11}")
    for name, row in figures.items():
        print(f"{name:8} {row['requests_per_s']:8.0f} {row['median_ms']:10.3f} "
              f"{row['p90_ms']:8.3f} {row['big_mb_per_s']:11.0f}")
    added_us = (1 / gated["requests_per_s"] - 1 / direct["requests_per_s"]) * 1e6
    print(f"the gate adds {added_us:.0f} us per small request "
          f"({gated['requests_per_s'] / direct['requests_per_s']:.0%} of direct GET/s, "
          f"{gated['big_mb_per_s'] / direct['big_mb_per_s']:.0%} of direct MB/s)")
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
