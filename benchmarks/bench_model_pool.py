"""Requests per second the model client (model_service_pool.py) sustains against fast fake
OpenAI servers, with many concurrent sticky sessions.

    python benchmarks/bench_model_pool.py [--servers 4] [--sessions 256] [--duration-s 10]
        [--image-kb 0] [--servers-process]

By default the fake servers (tests/doubles/fake_openai.py, uvicorn in threads) share this
one Python process with the client, so the figure is what one process sustains end to end;
``--servers-process`` moves them to a second process to measure the client more alone.
Endpoints are read from an ``endpoints.json`` state file, as runners read run_model.py's.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import os
import random
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from cua_rollout.config import ModelConfig, SamplingConfig  # noqa: E402
from cua_rollout.model.client import ModelServicePool  # noqa: E402
from cua_rollout.model.fleet.state import ENDPOINTS_FILE  # noqa: E402
from tests.doubles.fake_openai import FakeOpenAIServer  # noqa: E402


def _messages(image_kb: int) -> list[dict]:
    content: list[dict] = [{"type": "text", "text": "Open the text editor and save a note."}]
    if image_kb:
        blob = base64.b64encode(random.randbytes(image_kb * 1024 * 3 // 4)).decode()
        content.append({"type": "image_url", "image_url": {"url": f"data:image/png;base64,{blob}"}})
    return [{"role": "user", "content": content}]


def _percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def _run(urls: list[str], args: argparse.Namespace) -> dict:
    with tempfile.TemporaryDirectory() as state_dir:
        Path(state_dir, ENDPOINTS_FILE).write_text(json.dumps({"endpoints": [
            {"url": u, "healthy": True, "draining": False, "model_version": "bench"} for u in urls
        ]}))
        cfg = ModelConfig(
            name="fake-model", endpoints=[], retries=3, request_timeout_s=30,
            max_connections_per_endpoint=max(64, args.sessions),
            sampling=SamplingConfig(max_tokens=16),
        )
        pool = ModelServicePool(cfg, state_dir=Path(state_dir))
        messages = _messages(args.image_kb)
        latencies: list[float] = []
        served: Counter[str] = Counter()
        errors: Counter[str] = Counter()
        measuring = False

        async def session(i: int, stop_at: float) -> None:
            n = 0
            while time.monotonic() < stop_at:
                try:
                    gen = await pool.generate(messages, session_id=f"ep{i}-{n // args.steps}")
                except Exception as exc:  # counted, not fatal: the benchmark reports them
                    errors[type(exc).__name__] += 1
                    continue
                n += 1
                if measuring:
                    latencies.append(gen.latency_s)
                    served[gen.endpoint] += 1

        try:
            warm_until = time.monotonic() + args.warmup_s
            await asyncio.gather(*(session(i, warm_until) for i in range(args.sessions)))
            measuring = True
            cpu0 = resource.getrusage(resource.RUSAGE_SELF)
            t0 = time.monotonic()
            stop_at = t0 + args.duration_s
            await asyncio.gather(*(session(i, stop_at) for i in range(args.sessions)))
            elapsed = time.monotonic() - t0
            cpu1 = resource.getrusage(resource.RUSAGE_SELF)
            stats = pool.stats()
        finally:
            await pool.close()
    total = sum(served.values())
    cpu_s = (cpu1.ru_utime - cpu0.ru_utime) + (cpu1.ru_stime - cpu0.ru_stime)
    return {
        "requests": total,
        "elapsed_s": round(elapsed, 2),
        "requests_per_s": round(total / elapsed, 1),
        "latency_ms": {
            "p50": round(1000 * _percentile(latencies, 0.50), 2),
            "p90": round(1000 * _percentile(latencies, 0.90), 2),
            "p99": round(1000 * _percentile(latencies, 0.99), 2),
            "mean": round(1000 * statistics.fmean(latencies), 2) if latencies else None,
        },
        "cpu_s_per_1000_requests": round(1000 * cpu_s / total, 3) if total else None,
        "share_per_endpoint": sorted(round(n / total, 3) for n in served.values()) if total
        else [],
        "retries": stats["retries"],
        "errors": dict(errors),
        "sticky_hits": stats.get("sticky_hits"),
        "sticky_moves": stats.get("sticky_moves"),
    }


def _serve_fakes(n: int, latency_s: float) -> None:
    """Child mode of ``--servers-process``: run the fakes until stdin closes."""
    servers = [FakeOpenAIServer(latency_s=latency_s).start() for _ in range(n)]
    print(json.dumps([s.url for s in servers]), flush=True)
    sys.stdin.read()
    for s in servers:
        s.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--servers", type=int, default=4)
    parser.add_argument("--sessions", type=int, default=256, help="concurrent episodes")
    parser.add_argument("--steps", type=int, default=30, help="requests per episode")
    parser.add_argument("--duration-s", type=float, default=10.0)
    parser.add_argument("--warmup-s", type=float, default=2.0)
    parser.add_argument("--latency-s", type=float, default=0.0, help="fake server latency")
    parser.add_argument("--image-kb", type=int, default=0,
                        help="attach a base64 'screenshot' of this size to each request")
    parser.add_argument("--servers-process", action="store_true",
                        help="run the fake servers in a second process")
    parser.add_argument("--httpx", action="store_true",
                        help="swap the client's httpx2 for the old httpx 0.28 to compare")
    parser.add_argument("--serve-fakes", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.httpx:
        import httpx

        import cua_rollout.model.client as model_client
        import cua_rollout.model.discovery as model_discovery

        # Same API; a comparison, not the shipped client (both modules open HTTP clients).
        model_client.httpx2 = httpx
        model_discovery.httpx2 = httpx
    if args.serve_fakes:
        _serve_fakes(args.servers, args.latency_s)
        return 0
    child = None
    servers: list[FakeOpenAIServer] = []
    if args.servers_process:
        child = subprocess.Popen(
            [sys.executable, __file__, "--serve-fakes", "--servers", str(args.servers),
             "--latency-s", str(args.latency_s)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        )
        assert child.stdout is not None
        urls = json.loads(child.stdout.readline())
    else:
        servers = [FakeOpenAIServer(latency_s=args.latency_s).start() for _ in range(args.servers)]
        urls = [s.url for s in servers]
    try:
        result = asyncio.run(_run(urls, args))
    finally:
        for s in servers:
            s.stop()
        if child is not None:
            assert child.stdin is not None
            child.stdin.close()
            child.wait(timeout=30)
            if child.stdout is not None:
                child.stdout.close()
    setup = {"servers": args.servers, "sessions": args.sessions, "image_kb": args.image_kb,
             "servers_process": args.servers_process, "client": "httpx" if args.httpx else "httpx2",
             "cpus": os.cpu_count()}
    print(json.dumps({"setup": setup, **result}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
