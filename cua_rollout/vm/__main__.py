"""A launcher for one VM (what a Kubernetes desktop pod runs): sweep what a dead launcher
left, check the machine, get the image's ready state (booting once and saving it when there
is none), start the VM from it, print one JSON line (pid, forwarded ports), then reset it on
SIGUSR1 and stop it on SIGTERM or SIGINT; exit non-zero when QEMU dies.

    python -m cua_rollout.vm --spec spec.json [--root /run/cua-vms] [--cache DIR]
                             [--ready-path /] [--ready-timeout-s 600]

``spec.json`` holds ``MachineSpec``'s fields (paths as strings; ``forwards`` as
{"guest port": host port}; ``accel``: "auto" probes KVM and falls back to TCG with one
warning on stderr). Readiness of a fresh boot before its state is saved: the first forwarded
guest port answers HTTP 200 on ``--ready-path``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import signal
import sys
import time
from pathlib import Path

from cua_rollout.vm.errors import VMError
from cua_rollout.vm.images import check_machine
from cua_rollout.vm.kvm import probe_kvm
from cua_rollout.vm.machine import Machine, sweep
from cua_rollout.vm.readystate import DEFAULT_CACHE_ROOT, ReadyStateCache
from cua_rollout.vm.spec import MachineSpec

HEALTH_POLL_S = 1.0
HTTP_POLL_S = 0.5
HTTP_TIMEOUT_S = 5.0


def load_spec(path: Path) -> MachineSpec:
    raw = json.loads(Path(path).read_text(encoding="utf-8"))
    known = {f.name: f for f in dataclasses.fields(MachineSpec)}
    unknown = set(raw) - set(known)
    if unknown:
        raise VMError(f"{path}: unknown MachineSpec fields {sorted(unknown)}", permanent=True)
    for name in ("image", "ovmf_code", "ovmf_vars", "kernel", "initrd"):
        if raw.get(name) is not None:
            raw[name] = Path(raw[name])
    if "forwards" in raw:
        raw["forwards"] = {int(g): int(h) for g, h in raw["forwards"].items()}
    return MachineSpec(**raw)


async def _http_ok(port: int, path: str) -> bool:
    """One HTTP/1.0 GET on 127.0.0.1 (the launcher needs nothing beyond the stdlib)."""
    try:
        reader, writer = await asyncio.wait_for(
            asyncio.open_connection("127.0.0.1", port), HTTP_TIMEOUT_S)
    except (OSError, TimeoutError):
        return False
    try:
        writer.write(f"GET {path} HTTP/1.0\r\nHost: localhost\r\n\r\n".encode())
        await writer.drain()
        status = await asyncio.wait_for(reader.readline(), HTTP_TIMEOUT_S)
        return status.split()[1:2] == [b"200"]
    except (OSError, TimeoutError, IndexError):
        return False
    finally:
        writer.close()
        with contextlib.suppress(OSError):
            await writer.wait_closed()


async def _wait_ready(machine: Machine, path: str, timeout_s: float) -> None:
    port = next(iter(machine.ports.values()))
    deadline = time.monotonic() + timeout_s
    while not await _http_ok(port, path):
        if not machine.alive():
            raise VMError(f"{machine.name}: QEMU exited while booting the image")
        if time.monotonic() > deadline:
            raise VMError(f"{machine.name}: the guest's server did not answer {path} on "
                          f"port {port} in {timeout_s:g} s")
        await asyncio.sleep(HTTP_POLL_S)


async def run(args: argparse.Namespace) -> int:
    spec = load_spec(args.spec)
    if spec.accel == "auto":  # type: ignore[comparison-overlap]
        usable, reason = await probe_kvm()
        if not usable:
            print(f"warning: KVM unusable, running under TCG: {reason}", file=sys.stderr)
        spec = dataclasses.replace(spec, accel="kvm" if usable else "tcg")
    sweep(args.root)
    check_machine(spec)
    cache = ReadyStateCache(args.cache)

    async def build(dest: Path) -> None:
        builder = Machine(spec, args.root)
        try:
            await builder.start_fresh()
            await _wait_ready(builder, args.ready_path, args.ready_timeout_s)
            await builder.save_state(dest)
        finally:
            await builder.stop()

    state = await cache.get_or_build(spec, build)
    if cache.last_rejection:
        print(f"warning: {cache.last_rejection}", file=sys.stderr)
    machine = Machine(spec, args.root)
    loop = asyncio.get_running_loop()
    stop, reset = asyncio.Event(), asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    loop.add_signal_handler(signal.SIGUSR1, reset.set)
    try:
        await machine.start_from(state)
        print(json.dumps({"name": machine.name, "pid": machine.pid,
                          "ports": {str(g): h for g, h in machine.ports.items()}}), flush=True)
        while not stop.is_set():
            if reset.is_set():
                reset.clear()
                await machine.restore(state)
                print(json.dumps({"reset": True, "pid": machine.pid}), flush=True)
            if (problem := await machine.health()) is not None:
                print(f"error: {problem}", file=sys.stderr)
                return 1
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), HEALTH_POLL_S)
        return 0
    finally:
        await machine.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cua_rollout.vm",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--spec", type=Path, required=True)
    parser.add_argument("--root", type=Path, default=Path("/run/cua-vms"))
    parser.add_argument("--cache", type=Path, default=DEFAULT_CACHE_ROOT)
    parser.add_argument("--ready-path", default="/")
    parser.add_argument("--ready-timeout-s", type=float, default=600.0)
    args = parser.parse_args(argv)
    try:
        return asyncio.run(run(args))
    except VMError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2 if exc.permanent else 1


if __name__ == "__main__":
    raise SystemExit(main())
