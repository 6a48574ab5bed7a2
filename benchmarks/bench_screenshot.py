"""Screenshot cost in a desktop: a 1920x1080 screen captured and PNG-encoded by the desktop
server (``cua_rollout/desktop/screen.py``), over HTTP as the controller asks for it.

    python benchmarks/bench_screenshot.py [--shots 40] [--json F]

Starts one real desktop (Xvfb 1920x1080, openbox, mousepad with a page of text over
galculator, so that the screen holds text and flat colours as an agent's does) and its desktop
server, then prints:

- in the benchmark's process, on the same screen: the capture alone (mss), the encoding the
  server uses (``cua_rollout.desktop.screen.encode_png``: Pillow's BGRX->RGB, ISA-L deflate) at its
  levels,
  and the encoding it replaced (``mss.tools.to_png`` at zlib level 1), with the PNG sizes;
- over HTTP: ``GET /screenshot`` ``--shots`` times, one at a time, the server's CPU per
  screenshot (psutil's times of the server process before and after) and the wall time of each
  request (median and 90th percentile).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import mss  # noqa: E402
import mss.tools  # noqa: E402
import psutil  # noqa: E402

from benchmarks.bench_actions import desktop_server  # noqa: E402
from cua_rollout.desktop.display import XvfbDisplay, terminate_process  # noqa: E402
from cua_rollout.desktop.entry import OPENBOX_RC  # noqa: E402
from cua_rollout.desktop.screen import encode_png  # noqa: E402

SCREEN_W, SCREEN_H = 1920, 1080
START_TIMEOUT_S = 60.0
WARMUP = 3
TEXT = "\n".join(f"{i:3}  The quick brown fox jumps over the lazy dog; 0123456789 = {i * 37}"
                 for i in range(200))


def _ms(fn: Callable[[], Any], n: int) -> tuple[float, Any]:
    """Median milliseconds of ``n`` calls, and the last result."""
    times, out = [], None
    for _ in range(n):
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
    return round(statistics.median(times) * 1000, 1), out


def in_process(display: str, n: int) -> dict[str, Any]:
    grabber = getattr(mss, "MSS", None) or mss.mss
    with grabber(display=display, with_cursor=True) as sct:
        monitor = sct.monitors[0]
        grab_ms, shot = _ms(lambda: sct.grab(monitor), n)
        rows: dict[str, Any] = {"grab_ms": grab_ms}
        for level in (0, 1, 2, 3):
            ms, png = _ms(lambda lv=level: encode_png(shot.raw, shot.width, shot.height, lv), n)
            rows[f"isal_{level}"] = {"ms": ms, "kb": round(len(png) / 1000)}
        ms, png = _ms(lambda: mss.tools.to_png(shot.rgb, shot.size, level=1), max(3, n // 4))
        rows["mss_zlib_1"] = {"ms": ms, "kb": round(len(png) / 1000)}
    return rows


def over_http(env: dict[str, str], workdir: Path, n: int) -> dict[str, Any]:
    with desktop_server(env, workdir, warm=True) as (proc, client):
        server = psutil.Process(proc.pid)
        for _ in range(WARMUP):
            client.get("/screenshot").raise_for_status()
        walls, sizes = [], []
        t = server.cpu_times()
        cpu0 = t.user + t.system
        for _ in range(n):
            t0 = time.perf_counter()
            r = client.get("/screenshot")
            walls.append(time.perf_counter() - t0)
            r.raise_for_status()
            sizes.append(len(r.content))
        t = server.cpu_times()
        walls.sort()
        return {
            "server_cpu_ms": round((t.user + t.system - cpu0) / n * 1000, 1),
            "wall_median_ms": round(statistics.median(walls) * 1000, 1),
            "wall_p90_ms": round(walls[int(0.9 * (len(walls) - 1))] * 1000, 1),
            "png_kb": round(statistics.median(sizes) / 1000),
            "server_rss_mib": round(server.memory_info().rss / 2**20),
        }


def run(n: int) -> dict[str, Any]:
    workdir = Path(tempfile.mkdtemp(prefix="bench-screenshot-"))
    apps: list[subprocess.Popen[bytes]] = []
    try:
        home = workdir / "home"
        home.mkdir()
        (home / "page.txt").write_text(TEXT)
        wm = ["openbox", "--config-file", str(OPENBOX_RC)]
        with XvfbDisplay(SCREEN_W, SCREEN_H, window_manager=wm, min_display=100,
                         tmp_dir=workdir) as display:
            env = display.env({**os.environ, "HOME": str(home)})
            for argv in (["galculator"], ["mousepad", str(home / "page.txt")]):
                if shutil.which(argv[0]):
                    apps.append(subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL,
                                                 stdout=subprocess.DEVNULL,
                                                 stderr=subprocess.DEVNULL))
            time.sleep(5)  # the apps draw
            old_auth = os.environ.get("XAUTHORITY")
            os.environ["XAUTHORITY"] = env["XAUTHORITY"]
            try:
                report = {"screen": f"{SCREEN_W}x{SCREEN_H}", "shots": n,
                          "in_process": in_process(display.display, n)}
            finally:
                if old_auth is None:
                    os.environ.pop("XAUTHORITY", None)
                else:
                    os.environ["XAUTHORITY"] = old_auth
            report["http"] = over_http(env, workdir, n)
            for app in apps:
                terminate_process(app, 5)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shots", type=int, default=40, help="screenshots per measurement")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args(argv)
    if shutil.which("Xvfb") is None or shutil.which("openbox") is None:
        print("needs Xvfb and openbox", file=sys.stderr)
        return 2
    report = run(args.shots)
    p = report["in_process"]
    print(f"{report['screen']} screen, {args.shots} screenshots per figure (median ms)")
    print(f"  capture (mss)                      {p['grab_ms']:7.1f}")
    for level in range(4):
        row = p[f"isal_{level}"]
        print(f"  encode, ISA-L level {level}{' (server)' if level == 1 else '         '}"
              f"     {row['ms']:7.1f} ms {row['kb']:6} KB")
    row = p["mss_zlib_1"]
    print(f"  encode, mss.tools.to_png zlib 1    {row['ms']:7.1f} ms {row['kb']:6} KB (before)")
    h = report["http"]
    print(f"  GET /screenshot: server CPU {h['server_cpu_ms']} ms per screenshot, wall p50 "
          f"{h['wall_median_ms']} ms, p90 {h['wall_p90_ms']} ms, {h['png_kb']} KB; server RSS "
          f"{h['server_rss_mib']} MiB")
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
