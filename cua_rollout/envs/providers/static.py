"""The ``static`` provider: desktops that already run (e.g. OSWorld VMs), given by URL;
never started or stopped. Each is reset between episodes (``desktops.static.reset``):

- ``builtin`` (the default): when the pool first sees a VM it archives its HOME and records
  its processes and window classes (on the VM, kept across runs); a
  reset closes the windows and ends the processes that were not there then (by pid, only the
  VM user's, or on a desktop of ours only those tagged with its id) and restores HOME from the
  archive. Everything runs on the VM through ``/execute`` with its ``python3``; the baseline
  lives in ``$TMPDIR/.cua-baseline`` (a VM: ``/tmp``; our desktops: their own directory).
- ``command``: ``reset_command`` run on the VM;
- ``http``: a POST to ``reset_url`` (the user's VM manager, e.g. a snapshot revert), then
  wait for the VM's server to answer again;
- ``none``: nothing beyond each task's own setup.

The pool then verifies the result (``cua_rollout/envs/verify.py``) before lending the VM again.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

import httpx2

from cua_rollout.config import DesktopsConfig
from cua_rollout.core.errors import DesktopError
from cua_rollout.core.http import error_text, redact_url
from cua_rollout.envs.client import RemoteDesktopEnv
from cua_rollout.envs.providers.base import Desktop, DesktopProvider
from cua_rollout.envs.verify import DESKTOP_SCRIPT

__all__ = [
    "StaticProvider",
    "builtin_reset",
    "run_desktop_python",
    "server_answers",
    "take_baseline",
    "wait_serving",
]

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
    env = RemoteDesktopEnv(desktop.url, cfg, name=desktop.id)
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
    env = RemoteDesktopEnv(desktop.url, cfg, name=desktop.id)
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
    env = RemoteDesktopEnv(desktop.url, cfg, name=desktop.id)
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


class StaticProvider(DesktopProvider):
    """Desktops that already run (e.g. OSWorld VMs), given by URL; never started or stopped.
    Reset as ``desktops.static.reset`` says; the pool checks health and the initial state
    after it."""

    replaceable = False

    def __init__(self, cfg: DesktopsConfig) -> None:
        self.cfg = cfg

    def capacity(self) -> int | None:
        return len(self.cfg.static.urls)

    def _env(self, desktop: Desktop) -> RemoteDesktopEnv:
        return RemoteDesktopEnv(desktop.url, self.cfg, name=desktop.id)

    async def start(self, index: int) -> Desktop:
        urls = self.cfg.static.urls
        if index >= len(urls):
            raise DesktopError(f"desktops.static.urls has {len(urls)} URLs; no desktop #{index}")
        desktop = Desktop(id=f"static-{index}", url=urls[index].rstrip("/"))
        desktop.info["index"] = index
        if not await self.health(desktop):
            raise DesktopError(f"static desktop {redact_url(desktop.url)} does not answer")
        if self.cfg.static.reset == "builtin":
            await take_baseline(self.cfg, desktop)
        return desktop

    async def reset(self, desktop: Desktop) -> None:
        how = self.cfg.static.reset
        started = time.monotonic()
        if how == "builtin":
            await builtin_reset(self.cfg, desktop)
        elif how == "command":
            assert self.cfg.static.reset_command
            reply = await self._env(desktop).execute(self.cfg.static.reset_command,
                                                     timeout_s=self.cfg.reset_timeout_s)
            if reply.get("returncode") not in (0, None):
                raise DesktopError(
                    f"{desktop.id}: reset command exited {reply.get('returncode')}: "
                    f"{str(reply.get('error') or '')[:300]}")
        elif how == "http":
            await self._reset_by_http(desktop)
        desktop.info["last_reset"] = {"how": how, "seconds": time.monotonic() - started}
        # The pool health-checks and verifies every desktop after its reset.

    async def _reset_by_http(self, desktop: Desktop) -> None:
        url = self.cfg.static.reset_url
        assert url
        body = {"desktop": desktop.id, "url": desktop.url, "index": desktop.info.get("index")}
        async with httpx2.AsyncClient(timeout=self.cfg.reset_timeout_s) as client:
            try:
                reply = await client.post(url, json=body)
            except httpx2.HTTPError as exc:
                raise DesktopError(f"{desktop.id}: reset_url {redact_url(url)}: "
                                   f"{type(exc).__name__}: {exc}") from exc
        if reply.status_code >= 300:
            raise DesktopError(f"{desktop.id}: reset_url {redact_url(url)} answered HTTP "
                               f"{reply.status_code}: {error_text(reply, 300)}")
        # A snapshot revert restarts the VM's server: wait until it answers again.
        deadline = time.monotonic() + self.cfg.reset_timeout_s
        while not await self.health(desktop):
            if time.monotonic() > deadline:
                raise DesktopError(f"{desktop.id}: not answering after the reset by "
                                   f"{redact_url(url)}")
            await asyncio.sleep(1.0)

    async def stop(self, desktop: Desktop) -> None:
        """Static desktops belong to someone else: nothing to stop."""

    async def health(self, desktop: Desktop) -> bool:
        return await self._env(desktop).health()
