"""Start, reset and memory of QEMU VMs (``cua_rollout/vm``) restored from a ready state, at
several numbers of VMs at once, with the tests' tiny guest (``tests.doubles.vm_guest``).

    python benchmarks/bench_vm.py [--sizes 1 4 8] [--memory-mb 1024] [--resets 3] [--json F]

First a fresh boot of one VM (until the guest's ``READY`` on its serial port) and the save of
its ready state (RAM + devices, disk, into a cache in a temporary directory). Then for each
size N: N VMs started from the state at once (start = ``start_from`` until the VM runs and
its HTTP server answers on the forwarded port), their resident memory (VmRSS of each QEMU
process), then ``--resets`` rounds of all N reset at once (``restore`` until the server
answers again). Median and max per size; the accelerator is TCG unless the KVM probe says
KVM runs guests here. Prints a table and, with ``--json``, writes the figures.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import httpx  # noqa: E402

from cua_rollout.vm import Machine, MachineSpec, ReadyStateCache, probe_kvm  # noqa: E402
from tests.doubles.vm_guest import (  # noqa: E402
    GUEST_HTTP_PORT,
    READY_LINE,
    build_test_guest,
    make_base_disk,
)

BOOT_TIMEOUT_S = 180
HTTP_TIMEOUT_S = 60


async def _answers(client: httpx.AsyncClient, machine: Machine) -> None:
    url = f"http://127.0.0.1:{machine.ports[GUEST_HTTP_PORT]}/hello"
    deadline = time.monotonic() + HTTP_TIMEOUT_S
    while True:
        try:
            if (await client.get(url)).status_code == 200:
                return
        except httpx.TransportError:
            if time.monotonic() > deadline:
                raise
        await asyncio.sleep(0.01)


def _rss_mb(pid: int | None) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


async def _timed(coro: Any) -> float:
    start = time.monotonic()
    await coro
    return time.monotonic() - start


async def run(sizes: list[int], memory_mb: int, resets: int) -> dict[str, Any]:
    guest = build_test_guest()
    work = Path(tempfile.mkdtemp(prefix="cua-bvm-"))
    usable, reason = await probe_kvm()
    accel = "kvm" if usable else "tcg"
    print(f"accelerator: {accel} ({reason})")
    spec = MachineSpec(image=make_base_disk(work / "base.qcow2"), firmware="bios",
                       memory_mb=memory_mb, cpus=1, accel=accel, kernel=guest.kernel,
                       initrd=guest.initrd, append=guest.cmdline, forwards={GUEST_HTTP_PORT: 0})
    out: dict[str, Any] = {"accel": accel, "kvm_reason": reason, "memory_mb": memory_mb}
    machines: list[Machine] = []
    try:
        async with httpx.AsyncClient(timeout=10) as client:
            builder = Machine(spec, work / "vms")
            machines.append(builder)
            start = time.monotonic()
            await builder.start_fresh()
            await builder.wait_serial(READY_LINE, BOOT_TIMEOUT_S)
            await _answers(client, builder)
            out["fresh_boot_s"] = time.monotonic() - start
            cache = ReadyStateCache(work / "states")
            start = time.monotonic()
            state = await cache.get_or_build(spec, builder.save_state)
            out["save_s"] = time.monotonic() - start  # incl. the manifest's hashes
            out["state_mb"] = state.size_bytes() / 2**20
            out["state_ram_file_mb"] = state.ram.stat().st_size / 2**20
            await builder.stop()
            machines.remove(builder)

            out["sizes"] = {}
            for n in sizes:
                vms = [Machine(spec, work / "vms") for _ in range(n)]
                machines.extend(vms)

                async def start_one(vm: Machine) -> None:
                    await vm.start_from(state)
                    await _answers(client, vm)

                async def reset_one(vm: Machine) -> None:
                    await vm.restore(state)
                    await _answers(client, vm)

                starts = await asyncio.gather(*(_timed(start_one(vm)) for vm in vms))
                rss = [_rss_mb(vm.pid) for vm in vms]
                reset_times: list[float] = []
                for _ in range(resets):
                    reset_times += await asyncio.gather(*(_timed(reset_one(vm)) for vm in vms))
                out["sizes"][n] = {
                    "start_median_s": statistics.median(starts), "start_max_s": max(starts),
                    "reset_median_s": statistics.median(reset_times),
                    "reset_max_s": max(reset_times),
                    "rss_median_mb": statistics.median(rss), "rss_max_mb": max(rss),
                }
                for vm in vms:
                    await vm.stop()
                    machines.remove(vm)
    finally:
        for vm in machines:
            await vm.stop()
        shutil.rmtree(work, ignore_errors=True)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[1, 4, 8])
    parser.add_argument("--memory-mb", type=int, default=1024)
    parser.add_argument("--resets", type=int, default=3)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    out = asyncio.run(run(args.sizes, args.memory_mb, args.resets))
    print(f"fresh boot to READY and HTTP: {out['fresh_boot_s']:.2f} s; save: {out['save_s']:.2f} s;"
          f" ready state {out['state_mb']:.0f} MB on disk (RAM stream "
          f"{out['state_ram_file_mb']:.0f} MB) for a {out['memory_mb']} MB guest")
    print(f"{'VMs':>4} {'start med':>10} {'start max':>10} {'reset med':>10} {'reset max':>10}"
          f" {'RSS med MB':>11} {'RSS max MB':>11}")
    for n, row in out["sizes"].items():
        print(f"{n:>4} {row['start_median_s']:>10.2f} {row['start_max_s']:>10.2f} "
              f"{row['reset_median_s']:>10.2f} {row['reset_max_s']:>10.2f} "
              f"{row['rss_median_mb']:>11.0f} {row['rss_max_mb']:>11.0f}")
    if args.json:
        args.json.write_text(json.dumps(out, indent=1), encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
