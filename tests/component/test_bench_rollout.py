"""The rollout benchmark's machinery on a tiny run (real Ray, real actors, the sim world), and
the hot-path rewrites it led to: they must send and keep exactly what they did before.
No timing is asserted: benchmarks print figures, tests check that they are sound."""

from __future__ import annotations

import asyncio
import io
import json
from pathlib import Path

import pytest

from benchmarks import bench_rollout
from cua_rollout.agents.uitars.prompt import Turn, build_messages
from cua_rollout.core.screenshot import DataURL, Screenshot
from cua_rollout.model.openai_protocol import IMAGE_MARK, RequestBody
from cua_rollout.runtime.storage import PART_BYTES, png_parts


def _png(seed: int, size: tuple[int, int] = (1920, 1080)) -> bytes:
    from PIL import Image

    out = io.BytesIO()
    Image.new("RGB", size, (seed % 256, 40, 200)).save(out, "PNG")
    return out.getvalue()


def _body(messages: list[dict]) -> dict:
    return {"model": "m", "messages": messages, "temperature": 0.7, "top_p": 0.9,
            "max_tokens": 500, "frequency_penalty": 0.0}


async def _sent(body: RequestBody) -> bytes:
    return b"".join([piece async for piece in body])


# --------------------------------------------------------------------------- request bodies


def test_a_body_is_sent_as_exactly_the_bytes_json_dumps_makes():
    shots = [Screenshot(_png(i)) for i in range(6)]
    history = [Turn(shots[i], f'Thought: "q" \\ é 中 {i}\nAction: click(start_box=\'(1,2)\')')
               for i in range(5)]
    messages = build_messages('task "ünï" \\n', history, shots[5])
    assert all(type(p["image_url"]["url"]) is DataURL
               for m in messages for p in m["content"] if p["type"] == "image_url")
    body = RequestBody(_body(messages))
    expected = json.dumps(_body(messages)).encode()
    assert bytes(body) == expected and body.length == len(expected)
    assert asyncio.run(_sent(body)) == expected
    assert asyncio.run(_sent(body)) == expected  # again, as a retry sends it


def test_a_body_whose_text_holds_the_mark_or_plain_urls_is_serialised_whole():
    shot = Screenshot(_png(1, (64, 48)))
    messages = build_messages(f"type {IMAGE_MARK}0{IMAGE_MARK} please", [], shot)
    plain = [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}]
    for msgs in (messages, plain):
        expected = json.dumps(_body(msgs)).encode()
        body = RequestBody(_body(msgs))
        assert bytes(body) == expected and asyncio.run(_sent(body)) == expected


def test_screenshots_keep_size_and_data_url_once_their_png_is_forgotten():
    png = _png(3, (320, 200))
    shot = Screenshot(png)
    fresh = Screenshot(png)
    shot.forget_png()
    assert shot.png is None and shot.size == (320, 200)
    assert shot.data_url == fresh.data_url
    dropped = Turn(None, "Action: wait()")
    with pytest.raises(ValueError, match="dropped"):
        build_messages("task", [dropped], shot)
    # Outside the image window a dropped screenshot is fine.
    msgs = build_messages("task", [dropped, *[Turn(shot, "x")] * 4], shot, history_images=5)
    assert sum(p["type"] == "image_url" for m in msgs for p in m["content"]) == 5


def test_png_parts_join_back_and_stay_under_the_inline_size():
    png = bytes(range(256)) * 1500
    parts = png_parts(png)
    assert b"".join(parts) == png and max(map(len, parts)) <= PART_BYTES
    assert png_parts(b"") == []


# --------------------------------------------------------------------------- the benchmark




@pytest.mark.integration
@pytest.mark.slow
def test_a_tiny_run_loses_and_duplicates_nothing_and_writes_its_files(tmp: Path):
    out = tmp / "bench.json"
    code = bench_rollout.main([
        "--quick", "--levels", "4", "--schedules", "rollout", "batch", "--no-routing",
        "--warmup-s", "1", "--window-s", "3", "--out", str(out),
    ])
    assert code == 0
    data = json.loads(out.read_text())
    assert set(data) == {"results", "routing"} and data["routing"] == []
    rows = data["results"]
    assert [(r["schedule"], r["concurrency"]) for r in rows] == [("rollout", 4), ("batch", 4)]
    for row in rows:
        assert set(bench_rollout.RESULT_KEYS) <= set(row)
        assert row["status"] == "measured", row
        assert row["lost"] == 0 and row["duplicated"] == 0, row
        assert row["steps"] > 0 and row["ratio"] is not None and row["cpu_ms_per_step"] > 0
        assert row["statuses"].keys() <= {"failure"}  # infeasible tasks ended by finished()
    batch = rows[1]
    assert batch["recorded"] == batch["submitted"] == 8  # a warm-up batch and a measured one
    assert out.with_suffix(".png").stat().st_size > 0
