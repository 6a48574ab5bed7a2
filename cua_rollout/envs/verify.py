"""Reset verification: after every reset, before a desktop is lent again, check it is back
in the state it was first lent in. A reset that "succeeded" but left an app open, a file in
HOME or a dialog on screen would hand the next episode a different task than its file says.

The check works on any desktop that speaks OSWorld's protocol (our servers, OSWorld's VMs),
through ``/execute`` and ``/screenshot``:

- **processes**: the names of the desktop's processes (ours: those tagged with its id; a VM:
  its user's); new ones are leftovers (an app a task launched, its helpers), the probe's
  own commands and ``ignore_processes`` aside;
- **windows**: the top-level windows (``wmctrl -lx``), by class and title;
- **home**: the visible entries of HOME down to ``home_depth`` levels, with their sizes
  (hidden ones, caches and configured paths aside: desktops rewrite them as they run);
- **screenshot**: an 8x8 grey thumbnail of the screen; at most ``screenshot_max_distance``
  of its 64 cells may differ from the baseline's by more than 24 grey levels (a clock in a
  panel, the cursor: one or two; a window or a dialog: many).

The baseline is taken from the desktop when it is first ready (fresh from the provider), and
again after a replacement. ``DesktopVerifier.check`` returns the differences, each naming
what is left over; the pool quarantines a desktop with any and counts it.
"""

from __future__ import annotations

import asyncio
import io
import json
from dataclasses import dataclass, field
from typing import Any

from cua_rollout.core.errors import DesktopError
from cua_rollout.envs.client import RemoteDesktopEnv

__all__ = ["DESKTOP_SCRIPT", "Baseline", "DesktopVerifier", "changed_cells",
           "screen_thumbnail", "thumbnail"]

# Python run on the desktop (OSWorld's VMs and our desktops have python3), shared by the check
# below and the static provider's builtin reset: ``desktop_processes(keep)`` is {pid: name} of
# the desktop's processes — on a desktop of ours (several share a host, each tagging its
# processes with CUA_DESKTOP_ID) those tagged and their descendants (Chromium overwrites its
# environment, so the tag cannot be read from it), elsewhere every process of the user;
# ``desktop_windows()`` is [id, class, title] of each top-level window (wmctrl -lx), None
# without a window manager to ask.
DESKTOP_SCRIPT = r"""
import os, subprocess
def desktop_processes(keep):
    mine = os.environ.get("CUA_DESKTOP_ID")
    tag = ("CUA_DESKTOP_ID=" + mine).encode() if mine else None
    uid = os.getuid()
    names, parents, tagged = {}, {}, set()
    for pid in os.listdir("/proc"):
        if not pid.isdigit() or int(pid) in keep:
            continue
        try:
            if os.stat("/proc/" + pid).st_uid != uid:
                continue
            with open("/proc/" + pid + "/stat") as f:
                parents[int(pid)] = int(f.read().rsplit(")", 1)[1].split()[1])
            with open("/proc/" + pid + "/comm") as f:
                names[int(pid)] = f.read().strip()
            if tag is None:
                tagged.add(int(pid))
            else:
                with open("/proc/" + pid + "/environ", "rb") as f:
                    if tag in f.read().split(b"\0"):
                        tagged.add(int(pid))
        except (OSError, IndexError, ValueError):
            continue
    found, grew = set(tagged), True
    while grew:
        grew = False
        for pid, parent in parents.items():
            if pid not in found and parent in found:
                found.add(pid)
                grew = True
    return {p: names[p] for p in found if p in names}
def desktop_windows():
    try:
        out = subprocess.run(["wmctrl", "-lx"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    if out.returncode != 0:
        return None
    rows = [line.split(None, 4) for line in out.stdout.splitlines()]
    return [[r[0], r[2], r[4] if len(r) > 4 else ""] for r in rows if len(r) >= 3]
"""

# Prints one JSON object: the desktop's processes, windows and HOME.
_PROBE = DESKTOP_SCRIPT + r"""
import json, sys
depth = int(sys.argv[1])
procs = set(desktop_processes({os.getpid()}).values())
listed = desktop_windows()
wm = listed is not None
windows = [[cls, title] for _, cls, title in listed or []]
home, base = [], os.path.expanduser("~")
for root, dirs, files in os.walk(base):
    rel = os.path.relpath(root, base)
    level = 0 if rel == "." else rel.count(os.sep) + 1
    dirs[:] = sorted(d for d in dirs if not d.startswith("."))
    for name in [*dirs, *sorted(f for f in files if not f.startswith("."))]:
        path = os.path.join(root, name)
        kind = "d" if name in dirs else "f"
        try:
            size = 0 if kind == "d" else os.lstat(path).st_size
        except OSError:
            continue
        home.append(kind + " " + str(size) + " " + os.path.relpath(path, base))
    if level + 1 >= depth:
        dirs[:] = []
print(json.dumps({"processes": sorted(procs), "windows": windows, "wm": wm, "home": home}))
"""

# Processes a check itself runs, or that come and go on an idle desktop.
_TRANSIENT = {"ps", "sort", "tr", "sh", "bash", "dash", "awk", "mawk", "gawk", "find",
              "wmctrl", "python3", "python", "sleep", "cut", "id", "xdotool", "xprop",
              "kworker", "sed"}


# Pauses before the screen is looked at again when it differs from the baseline.
_SCREEN_RECHECKS_S = (0.3, 0.7)
_CELL_DELTA = 24  # grey levels a thumbnail cell may move before it counts as changed


def thumbnail(png: bytes) -> bytes:
    """The screen as an 8x8 grey thumbnail (64 cell brightnesses): a window, a dialog or a
    menu moves whole cells; a cursor or a clock moves at most one."""
    from PIL import Image

    with Image.open(io.BytesIO(png)) as image:
        return image.convert("L").resize((8, 8), Image.Resampling.BOX).tobytes()


async def screen_thumbnail(png: bytes) -> bytes:
    """``thumbnail`` on a thread: decoding a full screen's PNG takes tens of milliseconds,
    which on the pool's event loop would hold up every lease and release meanwhile (PIL
    lets go of the GIL while it decodes and scales)."""
    return await asyncio.to_thread(thumbnail, png)


def changed_cells(a: bytes, b: bytes) -> int:
    return sum(abs(x - y) > _CELL_DELTA for x, y in zip(a, b, strict=True))


@dataclass(frozen=True)
class Baseline:
    processes: frozenset[str]
    windows: frozenset[tuple[str, str]]
    has_wm: bool
    home: frozenset[str]
    screen: bytes | None = None
    extra: dict[str, Any] = field(default_factory=dict)


class DesktopVerifier:
    """Baselines per desktop, and the check against them (``desktops.verify``)."""

    def __init__(self, cfg: Any) -> None:
        self.cfg = cfg  # DesktopsConfig
        self.verify = cfg.verify
        self._baselines: dict[str, Baseline] = {}

    def forget(self, desktop_id: str) -> None:
        self._baselines.pop(desktop_id, None)

    async def observe(self, url: str, name: str) -> Baseline:
        env = RemoteDesktopEnv(url, self.cfg, name=name)
        try:
            reply = await env.execute(["python3", "-c", _PROBE,
                                       str(int(self.verify.home_depth))],
                                      timeout_s=self.verify.timeout_s)
            if reply.get("returncode") not in (0, None):
                raise DesktopError(f"{name}: the reset check's probe exited "
                                   f"{reply.get('returncode')}: {reply.get('error')}")
            try:
                data = json.loads(str(reply.get("output") or "").strip().splitlines()[-1])
            except (ValueError, IndexError) as exc:
                raise DesktopError(f"{name}: the reset check's probe printed "
                                   f"{str(reply.get('output'))[:200]!r}") from exc
            screen = None
            if self.verify.screenshot_max_distance is not None:
                shot = await env.observe()
                assert shot.png is not None
                screen = await screen_thumbnail(shot.png)
        finally:
            await env.close()
        ignore = set(self.verify.ignore_processes) | _TRANSIENT
        home = {line for line in data.get("home") or []
                if not any(line.split(" ", 2)[-1].startswith(p)
                           for p in self.verify.ignore_paths)}
        return Baseline(
            processes=frozenset(p for p in data.get("processes") or [] if p not in ignore),
            windows=frozenset((str(c), str(t)) for c, t in data.get("windows") or []),
            has_wm=bool(data.get("wm")), home=frozenset(home), screen=screen)

    async def _screen(self, url: str, name: str) -> bytes:
        env = RemoteDesktopEnv(url, self.cfg, name=name)
        try:
            shot = await env.observe()
        finally:
            await env.close()
        assert shot.png is not None
        return await screen_thumbnail(shot.png)

    async def remember(self, desktop_id: str, url: str) -> Baseline:
        """Take the desktop's baseline (it is fresh)."""
        baseline = await self.observe(url, desktop_id)
        self._baselines[desktop_id] = baseline
        return baseline

    async def check(self, desktop_id: str, url: str) -> list[str]:
        """What differs from the baseline (empty: the reset reached the initial state). A
        desktop without a baseline gets one now and passes."""
        before = self._baselines.get(desktop_id)
        if before is None:
            await self.remember(desktop_id, url)
            return []
        now = await self.observe(url, desktop_id)
        problems: list[str] = []
        extra = sorted(now.processes - before.processes)
        if extra:
            problems.append(f"processes left running: {', '.join(extra[:10])}")
        if before.has_wm and now.has_wm:
            windows = sorted(now.windows - before.windows)
            if windows:
                problems.append("windows left open: " + ", ".join(
                    f"{cls} {title!r}" for cls, title in windows[:10]))
        added = sorted(now.home - before.home)
        removed = sorted(before.home - now.home)
        if added or removed:
            what = [f"+{x.split(' ', 2)[-1]}" for x in added[:5]]
            what += [f"-{x.split(' ', 2)[-1]}" for x in removed[:5]]
            problems.append(f"HOME differs from the baseline: {' '.join(what)}")
        limit = self.verify.screenshot_max_distance
        if limit is not None and before.screen is not None and now.screen is not None:
            distance = changed_cells(before.screen, now.screen)
            for pause_s in _SCREEN_RECHECKS_S:
                if distance <= limit:
                    break
                # A window closed by the reset can stay painted until the X server has
                # redrawn what it covered: look again before calling it a difference.
                await asyncio.sleep(pause_s)
                distance = changed_cells(before.screen, await self._screen(url, desktop_id))
            if distance > limit:
                problems.append(f"the screen differs from the baseline's ({distance} of 64 "
                                f"cells, more than {limit})")
        return problems

