"""Where desktops come from: ``DesktopProvider``, one method per lifecycle step, and the
``Desktop`` record the pool keeps for each; and what several providers share (a provider is
one file of this package and imports no other): the desktop server's health and the
``builtin`` reset's baseline, the end of a start that rolls back, the labels of a run."""

from __future__ import annotations

import abc
import asyncio
import contextlib
import socket
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import psutil

from cua_rollout.config import DesktopsConfig
from cua_rollout.core.errors import DesktopError
from cua_rollout.envs.client import RemoteDesktopEnv
from cua_rollout.envs.contract import DesktopAccess
from cua_rollout.envs.verify import DESKTOP_SCRIPT

__all__ = [
    "LABEL_DESKTOP",
    "LABEL_OWNER",
    "LABEL_RUN",
    "Desktop",
    "DesktopProvider",
    "bring_up",
    "builtin_reset",
    "run_desktop_python",
    "run_is_gone",
    "run_label",
    "server_answers",
    "take_baseline",
    "wait_serving",
]


@dataclass
class Desktop:
    """A desktop the pool owns; ``url`` is its server's base URL, ``access`` its own token
    and ports where the provider hands them out per desktop (a remote lease; None: the
    run's ``desktops`` settings). ``info`` is what operators see (never a secret)."""

    id: str
    url: str
    state: str = "starting"  # starting | free | leased | resetting | quarantined | stopped
    info: dict[str, Any] = field(default_factory=dict)
    access: DesktopAccess | None = None
    leases: int = 0
    failures: int = 0
    last_error: str | None = None
    quarantined_at: float = 0.0


class DesktopProvider(abc.ABC):
    """Where desktops come from. One method per lifecycle step; ``replaceable`` says whether
    a broken desktop is stopped and a new one started (else it is retried later)."""

    replaceable = True
    verify_resets = True
    """Whether the pool checks this provider's resets (``cua_rollout/envs/verify.py``): false
    for desktops that are only records (tests' fakes)."""

    @abc.abstractmethod
    async def start(self, index: int) -> Desktop:
        """Bring up desktop number ``index``."""

    @abc.abstractmethod
    async def reset(self, desktop: Desktop) -> None:
        """Return the desktop to a clean state; raise if that fails."""

    @abc.abstractmethod
    async def stop(self, desktop: Desktop) -> None:
        """Stop what ``start`` started."""

    @abc.abstractmethod
    async def health(self, desktop: Desktop) -> bool:
        """Whether the desktop can be handed out."""

    async def close(self) -> None:
        """Release what the provider holds beyond its desktops (watches, clients), after
        every desktop was stopped. Most hold nothing more."""
        return None

    def capacity(self) -> int | None:
        """The most desktops this provider can have (None: no limit)."""
        return None


# --------------------------------------------------------------------------- a run's labels

# On every desktop a provider creates (container labels, pod labels).
LABEL_DESKTOP = "cua.desktop"
LABEL_RUN = "cua.run"
LABEL_OWNER = "cua.owner"


def run_label(pid: int | None = None) -> str:
    """``host:pid:start`` of a process (this one by default): what ``cua.run`` holds, and
    how a sweep tells a live run's containers from a dead one's."""
    proc = psutil.Process(pid)
    return f"{socket.gethostname()}:{proc.pid}:{int(proc.create_time())}"


def run_is_gone(label: str) -> bool:
    """True when ``label`` names a process of this host that no longer runs; a run of
    another host is never judged from here."""
    try:
        host, pid, started = label.rsplit(":", 2)
        if host != socket.gethostname():
            return False
        return int(psutil.Process(int(pid)).create_time()) != int(started)
    except (ValueError, psutil.NoSuchProcess):
        return True
    except psutil.Error:
        return False


# --------------------------------------------------------------------------- the server


# Shared by both scripts: the baseline's place and HOME, with DESKTOP_SCRIPT's functions.
_PROCESSES = DESKTOP_SCRIPT + r"""
import json, signal, tarfile, time
# The desktop's own temporary directory (ours set TMPDIR per desktop; a VM has /tmp).
base = os.path.join(os.environ.get("TMPDIR") or "/tmp", ".cua-baseline")
keep = {os.getpid(), os.getppid()}
def processes():
    return desktop_processes(keep)
def windows():
    return desktop_windows() or []
home = os.path.expanduser("~")
"""

# Records the baseline once (an existing one is kept: the VM's first state across runs).
_SNAPSHOT = _PROCESSES + r"""
if not os.path.exists(os.path.join(base, "home.tar")):
    os.makedirs(base, exist_ok=True)
    with tarfile.open(os.path.join(base, "home.tar.part"), "w") as tar:
        for name in sorted(os.listdir(home)):
            if name != ".cache":
                tar.add(os.path.join(home, name), arcname=name)
    os.replace(os.path.join(base, "home.tar.part"), os.path.join(base, "home.tar"))
    with open(os.path.join(base, "state.json"), "w") as f:
        json.dump({"processes": sorted(set(processes().values())),
                   "windows": sorted({w[1] for w in windows()})}, f)
print("baseline", base)
"""

_RESET = _PROCESSES + r"""
with open(os.path.join(base, "state.json")) as f:
    state = json.load(f)
closed = 0
for wid, cls, _ in windows():
    if cls not in state["windows"]:
        subprocess.run(["wmctrl", "-ic", wid], capture_output=True, timeout=10)
        closed += 1
if closed:
    time.sleep(0.5)
victims = [pid for pid, name in processes().items() if name not in state["processes"]]
for pid in victims:
    try:
        os.kill(pid, signal.SIGKILL)
    except OSError:
        pass
for name in os.listdir(home):
    if name == ".cache":
        continue
    path = os.path.join(home, name)
    if os.path.isdir(path) and not os.path.islink(path):
        subprocess.run(["rm", "-rf", "--", path], check=True)
    else:
        os.unlink(path)
with tarfile.open(os.path.join(base, "home.tar")) as tar:
    tar.extractall(home)
print(json.dumps({"closed": closed, "killed": len(victims)}))
"""


async def run_desktop_python(cfg: DesktopsConfig, desktop: Desktop, script: str, what: str
                             ) -> str:
    """Run ``script`` with the desktop's ``python3`` (``/execute``); its output.
    ``DesktopError`` naming ``what`` when it fails."""
    env = RemoteDesktopEnv(desktop.url, cfg, name=desktop.id, access=desktop.access)
    try:
        reply = await env.execute(["python3", "-c", script], timeout_s=cfg.reset_timeout_s)
    finally:
        await env.close()
    if reply.get("returncode") not in (0, None):
        raise DesktopError(f"{desktop.id}: {what} failed (exit {reply.get('returncode')}): "
                           f"{str(reply.get('error') or '').strip()[-300:]}")
    return str(reply.get("output") or "")


async def server_answers(cfg: DesktopsConfig, desktop: Desktop) -> bool:
    """Whether the desktop's server answers now (its health request)."""
    env = RemoteDesktopEnv(desktop.url, cfg, name=desktop.id, access=desktop.access)
    try:
        return await env.health()
    finally:
        await env.close()


async def wait_serving(cfg: DesktopsConfig, desktop: Desktop, deadline: float, *,
                       gone: Callable[[], Awaitable[str | None]] | None = None,
                       late: Callable[[], Awaitable[str]] | None = None,
                       poll_s: float = 0.1) -> None:
    """Wait until a desktop that is starting answers; ``DesktopError`` past ``deadline``
    (``time.monotonic()``) with what ``late()`` adds, or at once when ``gone()`` says why it
    never will (its container exited)."""
    env = RemoteDesktopEnv(desktop.url, cfg, name=desktop.id, access=desktop.access)
    try:
        while not await env.health():
            if time.monotonic() > deadline:
                raise DesktopError(f"{desktop.id}: its server at {desktop.url} did not answer "
                                   "in time" + (await late() if late is not None else ""))
            reason = await gone() if gone is not None else None
            if reason:
                raise DesktopError(f"{desktop.id}: {reason}")
            await asyncio.sleep(poll_s)
    finally:
        await env.close()


async def take_baseline(cfg: DesktopsConfig, desktop: Desktop) -> None:
    """Record the desktop's first state for ``builtin_reset`` (kept if already recorded)."""
    await run_desktop_python(cfg, desktop, _SNAPSHOT, "taking the reset baseline")


async def builtin_reset(cfg: DesktopsConfig, desktop: Desktop) -> None:
    """Back to the baseline: new windows closed, new processes ended, HOME restored."""
    await run_desktop_python(cfg, desktop, _RESET, "builtin reset")


async def bring_up(provider: DesktopProvider, cfg: DesktopsConfig, desktop_id: str,
                   started: float, serving: Callable[[], Awaitable[Desktop]], *,
                   baseline: bool = True) -> Desktop:
    """The end of a provider's ``start`` once it created desktop ``desktop_id``:
    ``serving()`` gives the desktop once its server answers, then the ``builtin`` reset's
    baseline is taken (``baseline``: a provider that resets otherwise, by restoring a saved
    state, takes none) and ``info["start_s"]`` set (seconds since ``started``, monotonic).
    On any failure, cancellation included, what was created is stopped before the error
    goes on (a desktop half started would leak)."""
    try:
        desktop = await serving()
        ready_s = time.monotonic() - started
        if baseline:
            await take_baseline(cfg, desktop)
    except BaseException:
        with contextlib.suppress(Exception):
            await provider.stop(Desktop(id=desktop_id, url=""))
        raise
    desktop.info["start_s"] = round(ready_s, 3)
    return desktop
