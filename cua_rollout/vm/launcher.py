"""A launcher for one VM, what a Kubernetes desktop pod runs (``python -m cua_rollout.vm``):
sweep what a dead launcher left, check the machine, get the image's ready state (booting once
and saving it when there is none), start the VM from it, print one JSON line (pid, forwarded
ports, gates), then reset it on SIGUSR1 and stop it on SIGTERM or SIGINT; exit non-zero when
QEMU dies (the pod then fails, and the pool replaces it).

    python -m cua_rollout.vm --spec spec.json [--root /run/cua-vms] [--cache DIR]
                             [--ready-path /] [--ready-timeout-s 600]
                             [--gate HOST [--token-env CUA_DESKTOP_TOKEN] [--server-port 5000]
                              [--chromium-port 9222] [--vlc-port 8080] [--reset-timeout-s 120]
                              [--gate-port GUEST=PORT ...]]

``spec.json`` holds ``MachineSpec``'s fields (paths as strings; ``forwards`` as
{"guest port": host port}; ``accel``: "auto" probes KVM and falls back to TCG with one
warning on stderr). Readiness of a fresh boot before its state is saved, and of a reset: the
server's guest port answers HTTP 200 on ``--ready-path``.

With ``--gate HOST`` (a pod: its IP) the launcher is the pod's desktop: every forwarded guest
port gets a gate (``gate.py``) on ``HOST`` at the same port number (5000, 9222, 8080: the
pod's ports; ``--gate-port GUEST=PORT`` for another), forwarding to QEMU's loopback-forwarded
port. The server's gate checks the
bearer token from ``$CUA_DESKTOP_TOKEN`` (the variable the Kubernetes provider fills from its
Secret) and strips it, so the token never enters the guest; it also answers

    GET /ports       the DevTools and VLC ports on HOST (token checked)
    POST /vm/reset   restore the ready state; answers once the guest's server answers
                     again: 200 {"reset", "pid", "seconds"}, 500 when the restore failed
                     (QEMU is then gone and the launcher exits 1), 503 when the guest's server
                     did not answer in --reset-timeout-s (token checked)
    GET /vm/ready    the readiness probe's path: 200 while QEMU runs and the guest's server
                     answers (and during a reset, which its caller waits on), else 503 (no
                     token: a probe cannot send one)

The paths sit under ``/vm/``, which OSWorld's server and ours never use. DevTools and VLC
gates check no token (their clients cannot send one, as with the ``vm`` provider): the pod's
NetworkPolicy keeps them to the run's pods. Without a token the gates listen only on a
loopback address.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import ipaddress
import json
import os
import signal
import sys
import time
from pathlib import Path

from cua_rollout.vm.errors import VMError
from cua_rollout.vm.gate import TokenGate
from cua_rollout.vm.images import check_machine
from cua_rollout.vm.kvm import probe_kvm
from cua_rollout.vm.machine import Machine, sweep
from cua_rollout.vm.readystate import DEFAULT_CACHE_ROOT, ReadyState, ReadyStateCache
from cua_rollout.vm.spec import MachineSpec

__all__ = ["READY_PATH", "RESET_PATH", "TOKEN_ENV", "load_spec", "main", "parse_args",
           "run"]

RESET_PATH = "/vm/reset"
READY_PATH = "/vm/ready"
TOKEN_ENV = "CUA_DESKTOP_TOKEN"  # what the Kubernetes provider sets from its Secret
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


async def _wait_ready(machine: Machine, guest_port: int, path: str, timeout_s: float) -> None:
    port = machine.ports[guest_port]
    deadline = time.monotonic() + timeout_s
    while not await _http_ok(port, path):
        if not machine.alive():
            raise VMError(f"{machine.name}: QEMU exited before the guest's server answered"
                          f"{machine._stderr_tail()}")
        if time.monotonic() > deadline:
            raise VMError(f"{machine.name}: the guest's server did not answer {path} on "
                          f"port {port} in {timeout_s:g} s")
        await asyncio.sleep(HTTP_POLL_S)


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def _check_gate_args(args: argparse.Namespace, spec: MachineSpec) -> str | None:
    """The token for ``--gate`` (taken out of this process's environment, so QEMU does not
    inherit it); ``VMError`` naming what is wrong with the gate's settings."""
    for guest in args.gate_ports:
        if guest not in spec.forwards:
            raise VMError(f"--gate-port {guest}=...: {guest} is not a forwarded guest port of "
                          f"the spec (forwards: {sorted(spec.forwards)})", permanent=True)
    if args.server_port not in spec.forwards:
        raise VMError(f"--server-port {args.server_port} is not a forwarded guest port of the "
                      f"spec (forwards: {sorted(spec.forwards)})", permanent=True)
    token = os.environ.pop(args.token_env, "") or None
    if token is None and not _is_loopback(args.gate):
        raise VMError(f"--gate {args.gate} is reachable from other hosts, but ${args.token_env} "
                      "is empty or unset: a desktop runs any code it is sent, so its server's "
                      "gate needs the bearer token (desktops.kubernetes.token_secret)",
                      permanent=True)
    return token


class _Desktop:
    """The VM behind the gates: its reset and readiness, one at a time with the health loop
    (a restore replaces the QEMU process, which a health check must not see go)."""

    def __init__(self, machine: Machine, state: ReadyState, args: argparse.Namespace) -> None:
        self.machine, self.state, self.args = machine, state, args
        self.lock = asyncio.Lock()

    async def reset(self, *, wait: bool = True) -> tuple[int, object]:
        """Restore the ready state; with ``wait``, until the guest's server answers."""
        async with self.lock:
            began = time.monotonic()
            try:
                await self.machine.restore(self.state)
            except VMError as exc:
                print(f"error: the reset's restore failed: {exc}", file=sys.stderr, flush=True)
                return 500, {"error": f"the restore failed: {exc}"}
            try:
                if wait:
                    await _wait_ready(self.machine, self.args.server_port,
                                      self.args.ready_path, self.args.reset_timeout_s)
            except VMError as exc:
                return 503, {"error": f"restored, but {exc}"}
            seconds = round(time.monotonic() - began, 3)
            print(json.dumps({"reset": True, "pid": self.machine.pid, "seconds": seconds}),
                  flush=True)
            return 200, {"reset": True, "pid": self.machine.pid, "seconds": seconds}

    async def ready(self) -> tuple[int, object]:
        if self.lock.locked():
            return 200, {"ready": True, "resetting": True}
        if not self.machine.alive():
            return 503, {"ready": False, "error": "QEMU is not running"}
        if not await _http_ok(self.machine.ports[self.args.server_port], self.args.ready_path):
            return 503, {"ready": False,
                         "error": f"the guest's server does not answer {self.args.ready_path}"}
        return 200, {"ready": True}

    async def health(self) -> str | None:
        if self.lock.locked():  # a reset is under way: it names its own failures
            return None
        async with self.lock:
            return await self.machine.health()


async def _open_gates(desktop: _Desktop, args: argparse.Namespace, token: str | None
                      ) -> list[TokenGate]:
    """One gate per forwarded guest port on ``--gate`` at the same port number; the server's
    checks the token and answers the launcher's paths."""
    machine = desktop.machine
    listen = {guest: args.gate_ports.get(guest, guest) for guest in machine.ports}
    ports = {"chromium": listen.get(args.chromium_port), "vlc": listen.get(args.vlc_port)}
    gates = []
    try:
        for guest, host in machine.ports.items():
            if guest == args.server_port:
                gate = TokenGate(args.gate, listen[guest], "127.0.0.1", host, token,
                                 answers={"GET /ports": ports},
                                 handlers={f"POST {RESET_PATH}": desktop.reset},
                                 public={f"GET {READY_PATH}": desktop.ready})
            else:
                gate = TokenGate(args.gate, listen[guest], "127.0.0.1", host, None)
            gates.append(gate)
            await gate.start()
    except OSError as exc:
        for gate in gates:
            await gate.close()
        raise VMError(f"cannot listen on {args.gate}: {exc}", permanent=True) from exc
    return gates


async def run(args: argparse.Namespace) -> int:
    spec = load_spec(args.spec)
    token = _check_gate_args(args, spec) if args.gate is not None else None
    if args.server_port not in spec.forwards:  # no gates: the first forward is the server
        args.server_port = next(iter(spec.forwards))
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
            await _wait_ready(builder, args.server_port, args.ready_path,
                              args.ready_timeout_s)
            await builder.save_state(dest)
        finally:
            await builder.stop()

    state = await cache.get_or_build(spec, build)
    if cache.last_rejection:
        print(f"warning: {cache.last_rejection}", file=sys.stderr)
    machine = Machine(spec, args.root)
    desktop = _Desktop(machine, state, args)
    loop = asyncio.get_running_loop()
    stop, reset = asyncio.Event(), asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    loop.add_signal_handler(signal.SIGUSR1, reset.set)
    gates: list[TokenGate] = []
    try:
        await machine.start_from(state)
        if args.gate is not None:
            gates = await _open_gates(desktop, args, token)
        print(json.dumps({"name": machine.name, "pid": machine.pid,
                          "ports": {str(g): h for g, h in machine.ports.items()},
                          "gates": {str(g.port): f"{args.gate}:{g.port}" for g in gates}}),
              flush=True)
        while not stop.is_set():
            if reset.is_set():  # SIGUSR1: the restore alone (its caller polls the guest)
                reset.clear()
                await desktop.reset(wait=False)
            if (problem := await desktop.health()) is not None:
                print(f"error: {problem}", file=sys.stderr, flush=True)
                return 1
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), HEALTH_POLL_S)
        return 0
    finally:
        for gate in gates:
            await gate.close()
        await machine.stop()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The launcher's command line (a pod template's ``args`` can be checked with it)."""
    parser = argparse.ArgumentParser(prog="python -m cua_rollout.vm",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--spec", type=Path, required=True,
                        help="a JSON file of MachineSpec's fields")
    parser.add_argument("--root", type=Path, default=Path("/run/cua-vms"),
                        help="per-VM directories (overlay, QMP socket, logs)")
    parser.add_argument("--cache", type=Path, default=DEFAULT_CACHE_ROOT,
                        help="the ready-state cache")
    parser.add_argument("--ready-path", default="/",
                        help="a GET the guest's server answers 200 once it serves")
    parser.add_argument("--ready-timeout-s", type=float, default=600.0,
                        help="deadline of the first boot that builds the ready state")
    gate = parser.add_argument_group("the pod's desktop (gates)")
    gate.add_argument("--gate", metavar="HOST",
                      help="open a gate for each forwarded guest port on HOST (the pod's IP)")
    gate.add_argument("--token-env", default=TOKEN_ENV,
                      help="the variable holding the bearer token the server's gate checks")
    gate.add_argument("--server-port", type=int, default=5000,
                      help="the guest port of the desktop server")
    gate.add_argument("--chromium-port", type=int, default=9222,
                      help="the guest port of Chrome's DevTools (GET /ports)")
    gate.add_argument("--vlc-port", type=int, default=8080,
                      help="the guest port of VLC's HTTP interface (GET /ports)")
    gate.add_argument("--reset-timeout-s", type=float, default=120.0,
                      help=f"deadline of {RESET_PATH} until the guest's server answers again")
    gate.add_argument("--gate-port", metavar="GUEST=PORT", action="append", default=[],
                      help="listen on PORT for a guest port (default: the same number)")
    args = parser.parse_args(argv)
    try:
        args.gate_ports = {int(g): int(p) for g, p in
                           (item.split("=", 1) for item in args.gate_port)}
    except ValueError:
        parser.error(f"--gate-port takes GUEST=PORT (two port numbers), not {args.gate_port}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        return asyncio.run(run(args))
    except VMError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2 if exc.permanent else 1
