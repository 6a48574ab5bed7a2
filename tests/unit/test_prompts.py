"""Prompt template and message building: windows, layout, one encoding per screenshot."""

from __future__ import annotations

import base64
import io
import struct
import zlib

import pybase64
import pytest
from PIL import Image

from cua_rollout.agents.uitars import parse_response
from cua_rollout.agents.uitars.prompt import SYSTEM_PROMPT, Turn, build_messages, build_prompt
from cua_rollout.core.screenshot import Screenshot, png_size


def make_png(width: int, height: int, shade: int) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (width, height), (shade, 255 - shade, 128)).save(buf, format="PNG")
    return buf.getvalue()


def shot(i: int) -> Screenshot:
    return Screenshot(make_png(64 + i, 48, i * 10 % 256))


def turns(n: int) -> list[Turn]:
    return [Turn(shot(i), f"Thought: step {i}\nAction: click(start_box='({i},{i + 1})')")
            for i in range(n)]


def images_in(messages) -> list[str]:
    return [part["image_url"]["url"] for m in messages for part in m["content"]
            if part["type"] == "image_url"]


def texts_of(messages, role) -> list[str]:
    return [part["text"] for m in messages if m["role"] == role for part in m["content"]
            if part["type"] == "text"]


def test_prompt_variants():
    base = build_prompt("Open the terminal")
    assert base.endswith("## User Instruction\nOpen the terminal\n")
    assert "call_user()" in base and "Use English in `Thought` part." in base
    assert "click(start_box='<|box_start|>(x1,y1)<|box_end|>')" in base
    without = build_prompt("Open the terminal", call_user=False, language="Chinese",
                           note="My password is in $PW; use it for sudo.")
    assert "call_user()" not in without
    assert "Use Chinese in `Thought` part." in without
    assert "- My password is in $PW; use it for sudo.\n\n## User Instruction" in without
    with pytest.raises(ValueError, match="empty"):
        build_prompt("  ")


def test_first_step_layout():
    current = shot(99)
    msgs = build_messages("Do it", [], current)
    assert [m["role"] for m in msgs] == ["system", "user", "user"]
    assert msgs[0]["content"][0]["text"] == SYSTEM_PROMPT
    assert "## User Instruction\nDo it" in msgs[1]["content"][0]["text"]
    assert images_in(msgs) == [current.data_url]


def test_history_windows_and_order():
    history = turns(8)
    current = shot(50)
    msgs = build_messages("task", history, current, history_images=5, history_texts=6)
    roles = [m["role"] for m in msgs]
    # 6 kept replies (steps 2..7), images for the last 4 of them, then the current image.
    assert texts_of(msgs, "assistant") == [t.history_text for t in history[2:]]
    assert images_in(msgs) == [t.screenshot.data_url for t in history[4:]] + [current.data_url]
    assert roles == ["system", "user"] + ["assistant"] * 2 + ["user", "assistant"] * 4 + ["user"]
    # Each image precedes the reply given to it.
    for i, m in enumerate(msgs[:-1]):
        if m["role"] == "user" and m["content"][0]["type"] == "image_url":
            assert msgs[i + 1]["role"] == "assistant"


@pytest.mark.parametrize("n_hist, n_img, n_txt, expect_imgs, expect_txts", [
    (0, 5, 35, 1, 0), (3, 5, 35, 4, 3), (10, 5, 35, 5, 10), (10, 1, 35, 1, 10),
    (10, 5, 2, 3, 2), (10, 5, 0, 1, 0), (4, 10, 35, 5, 4),
])
def test_window_sizes(n_hist, n_img, n_txt, expect_imgs, expect_txts):
    msgs = build_messages("t", turns(n_hist), shot(77), history_images=n_img, history_texts=n_txt)
    assert len(images_in(msgs)) == expect_imgs
    assert len(texts_of(msgs, "assistant")) == expect_txts


def test_replies_go_back_with_box_tokens():
    msgs = build_messages("t", turns(1), shot(5))
    reply = texts_of(msgs, "assistant")[0]
    assert "start_box='<|box_start|>(0,1)<|box_end|>'" in reply
    assert reply.startswith("Thought: step 0\n")
    # and they still parse
    assert parse_response(reply, 1920, 1080).actions[0].kind == "click"


def test_each_screenshot_encoded_once_and_shared(monkeypatch):
    calls = []
    real = pybase64.b64encode

    def counting(data):
        calls.append(len(data))
        return real(data)

    monkeypatch.setattr(pybase64, "b64encode", counting)
    history: list[Turn] = []
    current = shot(0)
    previous_urls: dict[int, str] = {}
    for step in range(1, 9):
        msgs = build_messages("t", history, current, history_images=5)
        for t in history:
            if t.screenshot.__dict__.get("data_url") is not None:
                key = id(t.screenshot)
                if key in previous_urls:
                    assert t.screenshot.data_url is previous_urls[key]  # same string object
                previous_urls[key] = t.screenshot.data_url
        assert len(images_in(msgs)) == min(step, 5)
        history.append(Turn(current, "Action: wait()"))
        current = shot(step)
    # 8 distinct screenshots were sent; each was encoded exactly once.
    assert len(calls) == 8
    decoded = base64.b64decode(current.data_url.split(",", 1)[1])
    assert decoded == current.png


def test_png_size_reads_header_only():
    png = make_png(321, 123, 9)
    assert png_size(png) == (321, 123)
    assert Screenshot(png).size == (321, 123)
    # A header with a body that is not a valid image still gives its size: nothing decoded.
    fake = b"\x89PNG\r\n\x1a\n" + struct.pack(">I", 13) + b"IHDR" + struct.pack(">II", 1920, 1080)
    assert png_size(fake + zlib.compress(b"junk")) == (1920, 1080)
    for bad in (b"", b"GIF89a" + b"\0" * 30, png[:20]):
        with pytest.raises(ValueError, match="not a PNG"):
            png_size(bad)


def test_bad_windows():
    with pytest.raises(ValueError):
        build_messages("t", [], shot(1), history_images=0)
    with pytest.raises(ValueError):
        build_messages("t", [], shot(1), history_texts=-1)
