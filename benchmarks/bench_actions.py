"""CPU and wall time per agent action in a desktop: the server's warm interpreter
(``cua_rollout/desktop/actions.py``) against a fresh ``python -c`` per action
(``--no-warm-actions``).

    python benchmarks/bench_actions.py [--actions 20] [--json F]

Starts one real desktop (Xvfb) and, in turn, one desktop server on it with each setting; posts
to its ``/execute`` ``--actions`` actions of each kind, one at a time, exactly as the
controller does (``ui_tars_utils.to_pyautogui`` wrapped by
``cua_rollout.desktop.protocol.execute_command``):

    click        a left click (pyautogui then sleeps its PAUSE, 0.1 s, as always)
    type 20      20 ASCII characters (interval 0.01 s between them, then the PAUSE)
    hotkey       ctrl+shift+a
    click, no PAUSE   the same click with ``_pause=False``: what the server itself adds

and prints per kind and setting the CPU per action spent in the desktop (the server, its
warm worker and every process they started: psutil's times of the server, its live children
and its reaped ones, before and after) and the wall time of each request (from the client's
post to its reply: median and 90th percentile). Also the warm worker's resident memory.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import httpx  # noqa: E402
import psutil  # noqa: E402

from cua_rollout.agents.uitars import Action, to_pyautogui  # noqa: E402
from cua_rollout.desktop.display import XvfbDisplay, terminate_process  # noqa: E402
from cua_rollout.desktop.protocol import execute_command  # noqa: E402

SCREEN_W, SCREEN_H = 1280, 800
START_TIMEOUT_S = 60.0
REQUEST_TIMEOUT_S = 60.0
WARMUP = 3

KINDS: dict[str, str] = {
    "click": to_pyautogui([Action("click", point=(640, 400))]),
    "type 20": to_pyautogui([Action("type", content="warm typing 20 chars")]),
    "hotkey": to_pyautogui([Action("hotkey", keys=["ctrl", "shift", "a"])]),
    "click, no PAUSE": "pyautogui.click(640, 400, button='left', _pause=False)",
}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _cpu_s(server: psutil.Process) -> float:
    """CPU seconds of the server, its reaped children and its live descendants."""
    t = server.cpu_times()
    total = t.user + t.system + t.children_user + t.children_system
    for child in server.children(recursive=True):
        with contextlib.suppress(psutil.Error):
            c = child.cpu_times()
            total += c.user + c.system
    return total


@contextlib.contextmanager
def desktop_server(env: dict[str, str], workdir: Path, warm: bool
                   ) -> Iterator[tuple[Any, httpx.Client]]:
    """``python -m cua_rollout.desktop.server`` on the display of ``env``, on a free loopback port,
    once
    it answers (and its warm worker runs, with ``warm``); stopped by pid on exit."""
    port = _free_port()
    argv = [sys.executable, "-m", "cua_rollout.desktop.server",
            "--host", "127.0.0.1", "--port", str(port),
            "--warm-actions" if warm else "--no-warm-actions"]
    with open(workdir / f"server-{port}.log", "wb") as log:
        proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdin=subprocess.DEVNULL, stdout=log,
                                stderr=log)
    client = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=REQUEST_TIMEOUT_S)
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            if proc.poll() is not None:
                log_text = (workdir / f"server-{port}.log").read_text()
                raise RuntimeError(f"the server exited: {log_text}")
            with contextlib.suppress(httpx.TransportError):
                stats = client.get("/actions").json()
                if not warm or stats["worker_pid"]:
                    break
            if time.monotonic() > deadline:
                raise RuntimeError("the server did not get ready")
            time.sleep(0.1)
        yield proc, client
    finally:
        client.close()
        terminate_process(proc, 10)


def _measure(client: httpx.Client, server: psutil.Process, code: str, n: int) -> dict[str, Any]:
    body = {"command": execute_command(code)}
    for _ in range(WARMUP):
        client.post("/execute", json=body).raise_for_status()
    walls = []
    cpu0 = _cpu_s(server)
    for _ in range(n):
        t0 = time.perf_counter()
        r = client.post("/execute", json=body)
        walls.append(time.perf_counter() - t0)
        r.raise_for_status()
        if r.json()["returncode"] != 0:
            raise RuntimeError(f"the action failed: {r.json()}")
    cpu = (_cpu_s(server) - cpu0) / n
    walls.sort()
    return {
        "cpu_ms": round(cpu * 1000, 1),
        "wall_median_ms": round(statistics.median(walls) * 1000, 1),
        "wall_p90_ms": round(walls[int(0.9 * (len(walls) - 1))] * 1000, 1),
    }


def run(n: int) -> dict[str, Any]:
    workdir = Path(tempfile.mkdtemp(prefix="bench-actions-"))
    report: dict[str, Any] = {"actions": n, "rows": []}
    try:
        home = workdir / "home"
        home.mkdir()
        with XvfbDisplay(SCREEN_W, SCREEN_H, min_display=100, tmp_dir=workdir) as display:
            env = display.env({**os.environ, "HOME": str(home)})
            for warm in (True, False):
                with desktop_server(env, workdir, warm) as (proc, client):
                    server = psutil.Process(proc.pid)
                    for kind, code in KINDS.items():
                        row = {"kind": kind, "mode": "warm" if warm else "fresh",
                               **_measure(client, server, code, n)}
                        report["rows"].append(row)
                        print(f"  {row['kind']:16} {row['mode']:6} {row['cpu_ms']:9.1f} "
                              f"{row['wall_median_ms']:9.1f} {row['wall_p90_ms']:9.1f}",
                              flush=True)
                    stats = client.get("/actions").json()
                    report["warm" if warm else "fresh"] = stats
                    if warm and stats["worker_pid"]:
                        rss = psutil.Process(stats["worker_pid"]).memory_info().rss
                        report["worker_rss_mib"] = round(rss / 2**20, 1)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--actions", type=int, default=20, help="actions per kind and setting")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args(argv)
    if shutil.which("Xvfb") is None:
        print("needs Xvfb", file=sys.stderr)
        return 2
    print(f"{args.actions} actions per kind and setting; CPU in the desktop per action, wall "
          "time per request (ms)")
    print(f"  {'kind':16} {'mode':6} {'cpu':>9} {'wall p50':>9} {'wall p90':>9}")
    report = run(args.actions)
    warm, fresh = report["warm"], report["fresh"]
    print(f"warm server: {warm['warm']} actions warm, {warm['fresh']} fresh, "
          f"{warm['restarts']} restarts; fresh server: {fresh['fresh']} fresh; "
          f"warm worker RSS {report.get('worker_rss_mib')} MiB")
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
