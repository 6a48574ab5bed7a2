"""Start and reset of VM desktops as the pool has them (``desktops.provider: vm``): the VM test
image (``scripts/build_vm_image.sh``) or any image, N VMs started at once from the image's
ready state and reset at once, each time until its desktop server answers through its gate.

    python benchmarks/bench_vm_desktops.py [--image PATH] [--counts 1,4,8] [--resets 2]
                                           [--memory-mb 1024] [--cpus 1]

Prints, per count: start and reset median / max (seconds), the resident memory of one VM's
QEMU (median), and how many such VMs 24 GB holds; then the ready state's size and how long
building it took (0 when it was cached). Fails nothing: the figures go in notes.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from cua_rollout.config import DesktopsConfig  # noqa: E402
from cua_rollout.envs.providers.vm import VMProvider  # noqa: E402

GIB = 1024 ** 3


def _image() -> Path:
    out = subprocess.run(["bash", str(ROOT / "scripts" / "build_vm_image.sh")], cwd=ROOT,
                         capture_output=True, text=True, check=True).stdout
    return Path(out.strip().splitlines()[-1])


async def _measure(args: argparse.Namespace, image: Path) -> None:
    state_dir = Path(tempfile.mkdtemp(prefix="bvm-", dir="/tmp"))
    rows = []
    build_s = 0.0
    state_bytes = 0
    for count in args.counts:
        cfg = DesktopsConfig(provider="vm", count=count, warm_spares=0, screen_width=1280,
                             screen_height=720,
                             vm={"image": image, "memory_mb": args.memory_mb,
                                 "cpus": args.cpus, "state_dir": state_dir})
        provider = VMProvider(cfg)
        desktops = []
        try:
            t0 = time.monotonic()
            warm = await provider.start(-1)  # builds (or finds) the ready state: not counted
            build_s = max(build_s, time.monotonic() - t0)
            assert provider.spec is not None
            state_bytes = provider.cache.load(provider.spec).size_bytes()
            await provider.stop(warm)
            started = await asyncio.gather(*(_timed(provider.start(i)) for i in range(count)))
            desktops = [d for d, _ in started]
            starts = [s for _, s in started]
            resets: list[float] = []
            for _ in range(args.resets):
                done = await asyncio.gather(*(_timed(provider.reset(d)) for d in desktops))
                resets += [s for _, s in done]
            rss = [psutil.Process(provider.machine(d.id).pid).memory_info().rss
                   for d in desktops]
            rows.append((count, statistics.median(starts), max(starts),
                         statistics.median(resets), max(resets), statistics.median(rss)))
        finally:
            for d in desktops:
                await provider.stop(d)
            await provider.close()
    print(f"image {image} ({args.memory_mb} MB, {args.cpus} vCPU, "
          f"{'TCG' if provider.accel_reason else 'KVM'})")
    print("VMs  start median/max s  reset median/max s  RSS/VM MB  VMs per 24 GB")
    for count, sm, sx, rm, rx, rss in rows:
        print(f"{count:>3}  {sm:6.2f} / {sx:5.2f}       {rm:6.2f} / {rx:5.2f}       "
              f"{rss / 2**20:7.0f}    {int(24 * GIB // (rss + 64 * 2**20))}")
    print(f"ready state: {state_bytes / 2**20:.0f} MB; first start incl. any build "
          f"{build_s:.1f} s")


async def _timed(coro):
    t = time.monotonic()
    value = await coro
    return value, time.monotonic() - t


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--image", type=Path, default=None)
    parser.add_argument("--counts", default="1,4,8",
                        type=lambda v: [int(x) for x in v.split(",")])
    parser.add_argument("--resets", type=int, default=2)
    parser.add_argument("--memory-mb", type=int, default=1024)
    parser.add_argument("--cpus", type=int, default=1)
    args = parser.parse_args()
    asyncio.run(_measure(args, args.image or _image()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
