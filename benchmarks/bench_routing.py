"""How the model client's routing policies spread multi-step episodes over model servers when
one of them is twice as slow: latency, load balance and how often an episode stays put.

    python benchmarks/bench_routing.py [--quick] [--episodes 128] [--duration-s 20] [--json]

Four simulated UI-TARS servers (benchmarks/sim_world.py, in their own process; one with
``speed_factor`` 2) answer episodes that each send their growing history (prompts.
build_messages, small 1920x1080 PNGs) through the REAL ``ModelServicePool``, one request per
step, with a simulated desktop step between replies. Each policy gets the same episodes
(``sim task <i>``, whose lengths the sim draws from the instruction) and a fresh server state.
The sim's prefix cache makes stickiness pay: a server that saw a session's previous request
prefills only the new part of the prompt.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import io
import itertools
import json
import random
import resource
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.sim_world import Latency, ModelSim, SimWorld  # noqa: E402
from cua_rollout.agents.uitars import parse_response  # noqa: E402
from cua_rollout.agents.uitars.prompt import Turn, build_messages  # noqa: E402
from cua_rollout.config import ModelConfig, SamplingConfig  # noqa: E402
from cua_rollout.core.screenshot import Screenshot  # noqa: E402
from cua_rollout.model.client import ModelServicePool  # noqa: E402

POLICIES = ("round_robin", "least_outstanding", "sticky_least_outstanding")
SPEED_FACTORS = (1.0, 1.0, 1.0, 2.0)  # the last endpoint is twice as slow
SCREEN = (1920, 1080)
# A desktop step (action, pause, screenshot) between a reply and the episode's next request.
ENV_STEP = Latency(0.15, 0.1)
# Servers that saturate past 8 requests in flight, so where requests go shows in latency.
MODEL = ModelSim(base_latency_s=0.05, per_token_s=0.002, prefill_s_per_1k_tokens=0.01,
                 capacity=8, speed_factors=SPEED_FACTORS)


@dataclasses.dataclass(frozen=True)
class RoutingSetup:
    """One benchmark configuration (``quick`` and full presets below)."""

    episodes: int            # episodes in flight at once (a finished one is replaced)
    duration_s: float        # measured time per policy
    warmup_s: float          # run before measuring, so every slot is mid-episode
    env_step: Latency = ENV_STEP
    model: ModelSim = MODEL
    pools: int = 1           # ModelServicePools the episodes share out, as runner processes do
    seed: int = 0


QUICK = RoutingSetup(episodes=64, duration_s=7.0, warmup_s=2.0)
# Twice the episodes on servers of twice the capacity: the same load, more samples.
FULL = RoutingSetup(episodes=128, duration_s=20.0, warmup_s=4.0,
                    model=dataclasses.replace(MODEL, capacity=16))


@dataclasses.dataclass
class _Record:
    episode: int
    step: int
    endpoint: str
    latency_s: float
    done_at: float


def run_routing_benchmark(
    quick: bool = False,
    *,
    setup: RoutingSetup | None = None,
    policies: tuple[str, ...] = POLICIES,
) -> list[dict[str, Any]]:
    """One row per policy: latency percentiles, requests and share per endpoint (in
    ``SPEED_FACTORS`` order), imbalance, sticky rate (client and server side), prefix-cache
    hit rate, throughput and the client's CPU per request."""
    setup = setup or (QUICK if quick else FULL)
    shots = _small_screenshots(8)
    rows = []
    with SimWorld(model_servers=len(setup.model.speed_factors), model=setup.model) as world:
        for policy in policies:
            world.reset_stats()
            cpu0 = resource.getrusage(resource.RUSAGE_SELF)
            records, episodes_done = asyncio.run(_drive(policy, world.model_urls, shots, setup))
            cpu1 = resource.getrusage(resource.RUSAGE_SELF)
            _wait_idle(world)
            stats = world.stats()
            client_cpu_s = (cpu1.ru_utime - cpu0.ru_utime) + (cpu1.ru_stime - cpu0.ru_stime)
            rows.append(_row(policy, world.model_urls, records, episodes_done, stats, setup,
                             client_cpu_s))
    return rows


async def _drive(
    policy: str, urls: list[str], shots: list[Screenshot], setup: RoutingSetup
) -> tuple[list[_Record], int]:
    cfg = ModelConfig(
        name=setup.model.model, endpoints=urls, routing=policy, retries=2,
        request_timeout_s=120, max_connections_per_endpoint=setup.episodes,
        sampling=SamplingConfig(max_tokens=500),
    )
    # Each runner process has its own pool, which sees only its own requests in flight.
    pools = [ModelServicePool(cfg) for _ in range(setup.pools)]
    records: list[_Record] = []
    next_episode = itertools.count()
    finished = 0
    rng = random.Random(setup.seed)

    async def episode(index: int, pool: ModelServicePool) -> None:
        nonlocal finished
        instruction, session = f"sim task {index}", f"ep-{index}"
        history: list[Turn] = []
        current = shots[index % len(shots)]
        try:
            for step in itertools.count():
                gen = await pool.generate(build_messages(instruction, history, current), session)
                records.append(_Record(index, step, gen.endpoint, gen.latency_s,
                                       time.monotonic()))
                if parse_response(gen.text, *SCREEN).terminal == "finished":
                    finished += 1
                    return
                history.append(Turn(current, gen.text))
                current = shots[(index + step + 1) % len(shots)]
                await asyncio.sleep(setup.env_step.draw(rng))
        finally:
            pool.end_session(session)

    async def slot(pool: ModelServicePool) -> None:
        while True:
            await episode(next(next_episode), pool)

    start = time.monotonic()
    tasks = [asyncio.create_task(slot(pools[k % len(pools)])) for k in range(setup.episodes)]
    try:
        done, _ = await asyncio.wait(tasks, timeout=setup.warmup_s + setup.duration_s,
                                     return_when=asyncio.FIRST_EXCEPTION)
        for task in done:
            task.result()  # an episode that failed is a broken benchmark: say so
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for pool in pools:
            await pool.close()
    measured_from = start + setup.warmup_s
    return [r for r in records if r.done_at >= measured_from], finished


def _wait_idle(world: SimWorld, timeout_s: float = 60.0) -> None:
    """Requests cancelled at the end of a run still occupy the sim until their reply time;
    the next policy must not start against that phantom load."""
    deadline = time.monotonic() + timeout_s
    while any(m["in_flight"] for m in world.stats(sessions=False)["models"]):
        if time.monotonic() > deadline:
            raise RuntimeError("the sim model servers did not drain")
        time.sleep(0.1)


def _row(policy: str, urls: list[str], records: list[_Record], episodes_done: int,
         stats: dict[str, Any], setup: RoutingSetup, client_cpu_s: float) -> dict[str, Any]:
    latencies = sorted(r.latency_s for r in records)
    per_endpoint = [sum(r.endpoint == u for r in records) for u in urls]
    total = sum(per_endpoint)
    by_episode: dict[int, list[_Record]] = {}
    for r in sorted(records, key=lambda r: (r.episode, r.step)):
        by_episode.setdefault(r.episode, []).append(r)
    pairs = same = 0
    for seq in by_episode.values():
        for a, b in itertools.pairwise(seq):
            if b.step == a.step + 1:
                pairs += 1
                same += a.endpoint == b.endpoint
    sessions = stats["sessions"].values()
    server_pairs = sum(s["requests"] - 1 for s in sessions)
    server_switches = sum(s["switches"] for s in sessions)
    models = stats["models"]
    prompt = sum(m["prompt_tokens"] for m in models)
    return {
        "policy": policy,
        "requests": total,
        "requests_per_s": round(total / setup.duration_s, 1),
        "p50_ms": round(1000 * _percentile(latencies, 0.50), 1),
        "p99_ms": round(1000 * _percentile(latencies, 0.99), 1),
        "mean_ms": round(1000 * statistics.fmean(latencies), 1) if latencies else None,
        "requests_per_endpoint": per_endpoint,
        "share_per_endpoint": [round(n / total, 3) for n in per_endpoint] if total else [],
        "speed_factors": list(setup.model.speed_factors),
        "imbalance": round(max(per_endpoint) / max(1, min(per_endpoint)), 2),
        "cv": round(statistics.pstdev(per_endpoint) / statistics.fmean(per_endpoint), 3)
        if total else None,
        "sticky_rate": round(same / pairs, 3) if pairs else None,
        "server_sticky_rate": round(1 - server_switches / server_pairs, 3)
        if server_pairs else None,
        "prefix_cache_hit": round(sum(m["cached_tokens"] for m in models) / prompt, 3)
        if prompt else None,
        "max_in_flight_per_endpoint": [m["max_in_flight"] for m in models],
        "episodes_finished": episodes_done,
        "client_cpu_ms_per_request": round(1000 * client_cpu_s / max(1, total), 2),
        "episodes_in_flight": setup.episodes,
        "pools": setup.pools,
    }


def _percentile(ordered: list[float], q: float) -> float:
    if not ordered:
        return float("nan")
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _small_screenshots(count: int) -> list[Screenshot]:
    """Full-size (1920x1080) but nearly flat PNGs of a few KB: the sim counts images, not
    bytes, and the client's CPU should go to routing, not to encoding megabytes of JSON."""
    from PIL import Image, ImageDraw

    shots = []
    for i in range(count):
        image = Image.new("RGB", SCREEN, (40 + 20 * i, 80, 120))
        draw = ImageDraw.Draw(image)
        draw.rectangle([100 + 50 * i, 100, 900 + 50 * i, 700], fill=(245, 245, 245))
        draw.text((120 + 50 * i, 120), f"sim screen {i}", fill=(0, 0, 0))
        out = io.BytesIO()
        image.save(out, "PNG")
        shots.append(Screenshot(out.getvalue()))
    return shots


def _table(rows: list[dict[str, Any]]) -> str:
    head = (f"{'policy':<26}{'req/s':>7}{'p50 ms':>8}{'p99 ms':>8}  {'share per endpoint':<26}"
            f"{'max/min':>8}{'cv':>7}{'sticky':>8}{'cache':>7}{'cpu ms':>8}")
    lines = [head, "-" * len(head)]
    for r in rows:
        share = " ".join(f"{s:.2f}" for s in r["share_per_endpoint"])
        lines.append(
            f"{r['policy']:<26}{r['requests_per_s']:>7}{r['p50_ms']:>8}{r['p99_ms']:>8}  "
            f"{share:<26}{r['imbalance']:>8}{r['cv']:>7}{r['sticky_rate']:>8}"
            f"{r['prefix_cache_hit']:>7}{r['client_cpu_ms_per_request']:>8}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="64 episodes, 7 s per policy")
    parser.add_argument("--episodes", type=int, help="episodes in flight (default 128)")
    parser.add_argument("--duration-s", type=float, help="measured seconds per policy (20)")
    parser.add_argument("--pools", type=int, help="model clients sharing the episodes, as "
                        "runner processes would (default 1)")
    parser.add_argument("--policies", nargs="+", choices=POLICIES, default=list(POLICIES))
    parser.add_argument("--json", action="store_true", help="print the rows as JSON")
    args = parser.parse_args(argv)
    setup = QUICK if args.quick else FULL
    setup = dataclasses.replace(
        setup, episodes=args.episodes or setup.episodes,
        duration_s=args.duration_s or setup.duration_s, pools=args.pools or setup.pools,
    )
    rows = run_routing_benchmark(setup=setup, policies=tuple(args.policies))
    if args.json:
        print(json.dumps(rows, indent=1))
    else:
        print(f"{setup.episodes} episodes in flight over {setup.pools} model client(s), "
              f"{setup.duration_s:.0f} s per policy, endpoint speed factors "
              f"{list(setup.model.speed_factors)}")
        print(_table(rows))
        print("share: requests per endpoint, in speed-factor order; max/min and cv: spread of "
              "those counts;\nsticky: an episode's next request on the same endpoint; cache: "
              "prompt tokens the sim's prefix caches held;\ncpu ms: this process's CPU per "
              "request (model client, prompts, parsing)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
