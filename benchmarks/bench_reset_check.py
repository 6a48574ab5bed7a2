"""Lease latency of a desktop pool while its resets are checked: the reset check's 8x8
thumbnail of a full screen decoded on the pool's event loop (as before issue 33) or on a
thread (``cua_rollout.envs.verify.screen_thumbnail``, now).

    python benchmarks/bench_reset_check.py [--desktops 64] [--seconds 10] [--json]

One ``DesktopPool`` (in-process, a fake provider) whose every reset decodes a 1920x1080
UI-like PNG of a few hundred KB (``sim_world.make_screenshot``) the way the reset check
does; ``--churners`` episodes lease, hold a desktop ``--hold-s`` and release it (a reset
each), while a probe leases from another thread every 10 ms (as a runner's call reaches a
pool actor's event loop) and gives the desktop back unused (no reset of its own). Prints,
per mode: resets/s, and the probe's lease wall time
(median, 99th percentile, max): what a lease waits for while the pool decodes.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.sim_world import make_screenshot  # noqa: E402
from cua_rollout.config import DesktopsConfig  # noqa: E402
from cua_rollout.envs.verify import screen_thumbnail, thumbnail  # noqa: E402
from cua_rollout.runtime.pool import DesktopPool  # noqa: E402
from tests.doubles.fake_desktop import FakeProvider  # noqa: E402


class CheckedResets(FakeProvider):
    """Each reset takes the screen's thumbnail as the reset check does (inline or on a
    thread)."""

    def __init__(self, png: bytes, threaded: bool) -> None:
        super().__init__()
        self.png, self.threaded = png, threaded

    async def reset(self, desktop: Any) -> None:
        if self.threaded:
            await screen_thumbnail(self.png)
        else:
            thumbnail(self.png)


async def _measure(png: bytes, threaded: bool, desktops: int, seconds: float,
                   churners: int, hold_s: float) -> dict[str, Any]:
    cfg = DesktopsConfig(count=desktops, warm_spares=0, lease_timeout_s=60,
                         reset_timeout_s=60, health_interval_s=60)
    pool = DesktopPool(cfg, CheckedResets(png, threaded))
    await pool.start()
    loop = asyncio.get_running_loop()
    end = time.monotonic() + seconds

    async def churn(i: int) -> None:  # episodes ending: a reset (and its check) each
        while time.monotonic() < end:
            lease = await pool.lease(f"churn-{i}/x", 60)
            await asyncio.sleep(hold_s)
            await pool.release(lease.lease_id)

    probes = itertools.count()

    async def lease_and_give_back() -> None:
        # Given back unused (withdraw): the probe adds no reset of its own to the load.
        owner = f"probe/{next(probes)}"
        await pool.lease(owner, 60)
        await pool.withdraw(owner)

    def probe() -> list[float]:
        """Leases as a runner's arrive at a pool actor: from outside its event loop, so
        the time the loop is busy decoding counts."""
        waits = []
        while time.monotonic() < end:
            t0 = time.perf_counter()
            asyncio.run_coroutine_threadsafe(lease_and_give_back(), loop).result()
            waits.append(time.perf_counter() - t0)
            time.sleep(0.01)
        return waits

    started = time.monotonic()
    probing = loop.run_in_executor(None, probe)
    await asyncio.gather(*(churn(i) for i in range(churners)))
    waits = sorted(await probing)
    elapsed = time.monotonic() - started
    resets = pool.counters["resets"]
    await pool.stop()
    return {"mode": "thread" if threaded else "event loop",
            "resets_per_s": round(resets / elapsed, 1), "leases": len(waits),
            "lease_ms_median": round(1000 * statistics.median(waits), 2),
            "lease_ms_p99": round(1000 * waits[int(0.99 * (len(waits) - 1))], 2),
            "lease_ms_max": round(1000 * waits[-1], 2)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--desktops", type=int, default=64)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--churners", type=int, default=8,
                        help="episodes at once, each releasing its desktop every --hold-s")
    parser.add_argument("--hold-s", type=float, default=0.25)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    png = make_screenshot(1)
    rows = [asyncio.run(_measure(png, threaded, args.desktops, args.seconds, args.churners,
                                 args.hold_s)) for threaded in (False, True)]
    if args.json:
        print(json.dumps({"png_bytes": len(png), "rows": rows}, indent=1))
        return 0
    print(f"screenshot {len(png) // 1024} KB; {args.desktops} desktops, {args.churners} "
          f"episodes releasing one every {args.hold_s:g} s; leases from another thread")
    for row in rows:
        print(f"  thumbnail on the {row['mode']:<10}  {row['resets_per_s']:>6} resets/s  "
              f"lease {row['lease_ms_median']} ms median, {row['lease_ms_p99']} ms p99, "
              f"{row['lease_ms_max']} ms max ({row['leases']} leases)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
