"""What ``storage.retention.reencode`` saves and costs per screenshot: bytes before and after
each mode (``png_max``: lossless, ``webp``: lossy at a quality) and the CPU time of one
re-encode (``time.process_time``, one thread), on the simulated world's screenshots
(benchmarks/sim_world.make_screenshot, encoded as a desktop encodes its captures: ISA-L
deflate, cua_rollout/desktop/screen.py) and, with ``--x-display``, on real captures of an X
screen (start Xvfb with the demo's apps on it first).

    python benchmarks/bench_retention.py [--images 12] [--x-display :91] [--json out.json]
"""

from __future__ import annotations

import argparse
import io
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.sim_world import make_screenshot
from cua_rollout.desktop.screen import DEFAULT_PNG_LEVEL, encode_png
from cua_rollout.runtime.retention import reencode_image

MODES = (("png_max", 0), ("webp", 90), ("webp", 80), ("webp", 60))


def _as_desktop_png(png: bytes) -> bytes:
    """A PNG re-encoded as a desktop sends its capture (BGRA pixels, ISA-L deflate)."""
    from PIL import Image

    with Image.open(io.BytesIO(png)) as image:
        rgba = image.convert("RGBA")
        r, g, b, a = rgba.split()
        bgra = Image.merge("RGBA", (b, g, r, a)).tobytes()
        return encode_png(bgra, rgba.width, rgba.height, DEFAULT_PNG_LEVEL)


def sim_images(n: int, width: int, height: int) -> list[bytes]:
    return [_as_desktop_png(make_screenshot(seed, width, height)) for seed in range(n)]


def x_images(display: str, n: int) -> list[bytes]:
    """``n`` captures of the X screen ``display``, as the desktop server makes them."""
    import mss

    out = []
    with mss.mss(display=display) as grabber:
        monitor = grabber.monitors[0]
        for _ in range(n):
            shot = grabber.grab(monitor)
            out.append(encode_png(shot.bgra, shot.width, shot.height, DEFAULT_PNG_LEVEL))
            time.sleep(0.2)
    return out


def measure(images: list[bytes]) -> list[dict[str, float | str]]:
    rows = []
    before = statistics.mean(len(x) for x in images)
    for mode, quality in MODES:
        sizes, cpu = [], []
        for data in images:
            t0 = time.process_time()
            out = reencode_image(data, mode, quality or 80)
            cpu.append((time.process_time() - t0) * 1000)
            sizes.append(len(out) if mode != "png_max" else min(len(out), len(data)))
        after = statistics.mean(sizes)
        rows.append({"mode": mode if mode == "png_max" else f"webp q{quality}",
                     "bytes_before": round(before), "bytes_after": round(after),
                     "saved_pct": round(100 * (1 - after / before), 1),
                     "cpu_ms_per_image": round(statistics.median(cpu), 1)})
    return rows


def measure_removal(episodes: int = 200, images: int = 16) -> dict[str, float]:
    """CPU of removing released episodes' images (marker + unlinks), no index: a sweep over
    ``episodes`` results lines of ``images`` 300 KB screenshots each."""
    import tempfile

    from cua_rollout.config import RetentionConfig
    from cua_rollout.runtime.retention import RetentionSweeper

    with tempfile.TemporaryDirectory() as tmp:
        run = Path(tmp)
        blob = b"\0" * 300_000
        with open(run / "results.jsonl", "w") as results:
            for e in range(episodes):
                path = run / "d" / f"t{e}" / "0"
                path.mkdir(parents=True)
                for n in range(images):
                    (path / f"step_{n}.png").write_bytes(blob)
                results.write(json.dumps({"episode_id": f"d/t{e}/0", "status": "success"})
                              + "\n")
        sweeper = RetentionSweeper(run, RetentionConfig(images="failures"))
        t0 = time.process_time()
        stats = sweeper.sweep()
        cpu_ms = (time.process_time() - t0) * 1000
        assert stats["episodes_removed"] == episodes, stats
    return {"episodes": episodes, "images_per_episode": images,
            "cpu_ms_per_episode": round(cpu_ms / episodes, 2)}


def _print(title: str, rows: list[dict[str, float | str]]) -> None:
    print(f"\n{title}")
    print(f"{'mode':<10} {'KB before':>10} {'KB after':>9} {'saved':>7} {'CPU ms/image':>13}")
    for r in rows:
        print(f"{r['mode']:<10} {int(r['bytes_before']) / 1000:>10.0f} "
              f"{int(r['bytes_after']) / 1000:>9.0f} {r['saved_pct']:>6}% "
              f"{r['cpu_ms_per_image']:>13}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=12, help="screenshots per set")
    parser.add_argument("--x-display", help="also capture this X display (e.g. :91)")
    parser.add_argument("--json", type=Path, help="write the rows here")
    args = parser.parse_args(argv)
    results = {}
    for name, (w, h) in (("sim 1920x1080", (1920, 1080)), ("sim 1280x720", (1280, 720))):
        results[name] = measure(sim_images(args.images, w, h))
        _print(f"{name} (benchmarks/sim_world.make_screenshot, desktop encoding)", results[name])
    if args.x_display:
        name = f"X display {args.x_display}"
        results[name] = measure(x_images(args.x_display, args.images))
        _print(f"{name} (real captures, desktop encoding)", results[name])
    results["removal"] = measure_removal()  # type: ignore[assignment]
    print(f"\nremoval (marker + unlinks, no index): {results['removal']}")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
