"""A simulated world for benchmarks: many OSWorld-protocol desktops and OpenAI-compatible
UI-TARS model servers, each side in its own subprocesses, so that the sim's CPU and memory
are not counted as the measured run's.

    from benchmarks.sim_world import SimWorld, DesktopSim, ModelSim, Latency
    with SimWorld(desktops=256, model_servers=4,
                  desktop=DesktopSim(action_latency=Latency(0.5, 0.2)),
                  model=ModelSim(speed_factors=(1, 1, 1, 2))) as world:
        cfg.desktops.static.urls = world.desktop_urls      # provider: static
        cfg.desktops.static.reset_command = world.reset_command
        cfg.desktops.verify.enabled = False                 # no real commands to check with
        cfg.model.endpoints = world.model_urls
        ...; world.stats(); world.cpu_s()

The servers are plain asyncio protocols on uvloop with a hand-written HTTP/1.1 parser (no
framework): a screenshot costs a table lookup and a socket write, a 3 MB chat request is
read by the kernel straight into one buffer and costs a handful of byte searches, never a
JSON parse of the images. ``python benchmarks/sim_world.py measure``
prints their CPU per request and the rate one process sustains; ``python
benchmarks/sim_world.py serve --desktops 4 --host ADDRESS`` serves a world from a process of
its own (in another network namespace, say) until SIGTERM, its URLs on stdout as one JSON line.
"""

from __future__ import annotations

import abc
import argparse
import asyncio
import dataclasses
import hashlib
import io
import itertools
import json
import math
import os
import random
import select
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
import urllib.request
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from cua_rollout.core.vision import smart_resize  # noqa: E402
from cua_rollout.desktop.protocol import (  # noqa: E402
    AccessibilityReply,
    CommandReply,
    ErrorReply,
    Paths,
    RunPythonReply,
    ScreenSizeReply,
    TerminalReply,
)
from cua_rollout.model.openai_protocol import (  # noqa: E402
    CHAT_COMPLETIONS_PATH,
    chat_request_body,
)
from cua_rollout.model.openai_server import (  # noqa: E402
    ChatCall,
    Completion,
    HttpReply,
    OpenAIServer,
    json_reply,
)

RESET_COMMAND = ["sim-reset"]
"""The ``desktops.static.reset_command`` a sim desktop recognises on ``/execute`` as a reset."""

_TOKENS_PER_PATCH = 28 * 28  # Qwen2.5-VL: one visual token per 28x28 pixels after merging
_TEXT_BYTES_PER_TOKEN = 4    # rough size of a text token in the JSON body


# --------------------------------------------------------------------------- settings


@dataclass(frozen=True)
class Latency:
    """A delay drawn uniformly from ``mean_s +- jitter_s`` (never below zero)."""

    mean_s: float = 0.0
    jitter_s: float = 0.0

    def draw(self, rng: random.Random) -> float:
        if not self.jitter_s:
            return max(0.0, self.mean_s)
        return max(0.0, self.mean_s + rng.uniform(-self.jitter_s, self.jitter_s))


@dataclass(frozen=True)
class EpisodeLengths:
    """Model calls per episode, drawn deterministically from the instruction's hash.

    A mixture of two lognormals: most episodes around ``median_steps``, a ``tail_fraction``
    around ``tail_median_steps`` (the long tail that holds up a batch), capped to
    ``[min_steps, max_steps]``. The last call of an episode replies ``finished()``.
    """

    median_steps: float = 9.0
    sigma: float = 0.45
    tail_fraction: float = 0.12
    tail_median_steps: float = 32.0
    min_steps: int = 1
    max_steps: int = 50
    seed: int = 0

    def draw(self, instruction: str) -> int:
        digest = hashlib.blake2b(
            f"{self.seed}\0{instruction.strip()}".encode(), digest_size=16
        ).digest()
        u_mix = (int.from_bytes(digest[:8], "big") + 0.5) / 2**64
        u_len = (int.from_bytes(digest[8:], "big") + 0.5) / 2**64
        median = self.tail_median_steps if u_mix < self.tail_fraction else self.median_steps
        steps = round(median * math.exp(self.sigma * statistics.NormalDist().inv_cdf(u_len)))
        return min(self.max_steps, max(self.min_steps, steps))


@dataclass(frozen=True)
class DesktopSim:
    """How the simulated desktops behave."""

    action_latency: Latency = Latency(0.05, 0.02)
    """``/execute`` of an action (pyautogui code)."""
    reset_latency: Latency = Latency(0.5, 0.2)
    """``/execute`` of ``RESET_COMMAND`` (what the static provider runs to reset)."""
    setup_latency: Latency = Latency(0.02, 0.0)
    """``/setup/*`` steps of a task."""
    screenshot_latency: Latency = Latency(0.0, 0.0)
    """``/screenshot`` (capture time on a real desktop)."""
    screen_width: int = 1920
    screen_height: int = 1080
    screenshots: int = 16
    """Distinct PNGs generated at start-up and served round-robin."""
    rich_screenshots: bool = True
    """Photo-like and noisy regions (a few hundred KB per PNG); False: flat UI (~30 KB)."""
    seed: int = 0


@dataclass(frozen=True)
class ModelSim:
    """How the simulated model servers behave.

    Latency of one request = ``speed_factor * (base_latency_s + prefill_s_per_1k_tokens *
    uncached_prompt_tokens / 1000 + per_token_s * completion_tokens)``, times
    ``max(1, in_flight / capacity)`` (a server past its batch capacity slows down). The
    prefix cache: a session whose previous request was served by the same server, and is
    still among its ``prefix_cache_sessions`` most recent, reuses the previous prompt while
    the image window grows, and only its text prefix once old images start dropping out.
    """

    base_latency_s: float = 0.05
    per_token_s: float = 0.002
    prefill_s_per_1k_tokens: float = 0.01
    capacity: int = 16
    speed_factors: tuple[float, ...] = ()
    """Per server (index order); missing entries are 1.0. 2.0 is a server twice as slow."""
    prefix_cache_sessions: int = 32
    output_tokens_mean: int = 60
    output_tokens_jitter: int = 30
    model: str = "sim-ui-tars-1.5"
    lengths: EpisodeLengths = EpisodeLengths()
    screen_width: int = 1920
    screen_height: int = 1080
    seed: int = 0

    def speed_factor(self, index: int) -> float:
        return float(self.speed_factors[index]) if index < len(self.speed_factors) else 1.0


def _from_dict(cls: type, data: dict[str, Any]) -> Any:
    """Rebuild a (nested) settings dataclass from ``dataclasses.asdict`` output."""
    kwargs: dict[str, Any] = {}
    hints = {f.name: f for f in dataclasses.fields(cls)}
    for key, value in data.items():
        default = hints[key].default
        if dataclasses.is_dataclass(default) and isinstance(value, dict):
            value = _from_dict(type(default), value)
        elif isinstance(value, list):
            value = tuple(value)
        kwargs[key] = value
    return cls(**kwargs)


# --------------------------------------------------------------------------- the model's behaviour


class RequestSummary(NamedTuple):
    """What the sim model needs from a chat request, read from the raw JSON bytes."""

    instruction: str
    assistant_turns: int
    last_step: int | None    # the step number the previous reply carried, if any
    images: int
    text_bytes: int          # body bytes outside the image data URLs
    logprobs: bool
    return_token_ids: bool
    full_parse: bool         # the cheap path failed and the body was json-parsed
    image_files: tuple[str, ...] = ()  # paths of the images sent as file:// URLs


_ASSISTANT_MARKS = (b'"role": "assistant"', b'"role":"assistant"')
_INSTRUCTION_MARK = b"## User Instruction\\n"  # prompts.build_prompt's header, JSON-escaped
_IMAGE_MARK = b"data:image/"
_FILE_IMAGE_MARK = b'"file://'  # an image sent by path (model.images: file)
_PNG_END = b"IEND\xaeB`\x82"    # a PNG's last chunk (IEND and its CRC)
_STEP_MARK = b"[sim step "
_LOGPROBS_MARKS = (b'"logprobs": true', b'"logprobs":true')
_TOKEN_IDS_MARKS = (b'"return_token_ids": true', b'"return_token_ids":true')


def _string_end(body: bytes | bytearray, start: int) -> int:
    """Index of the closing quote of the JSON string that contains ``start``."""
    j = start
    while True:
        j = body.find(b'"', j)
        if j < 0:
            raise ValueError("unterminated JSON string")
        k = j - 1
        while body[k] == 0x5C:  # a quote preceded by an odd number of backslashes is escaped
            k -= 1
        if (j - 1 - k) % 2 == 0:
            return j
        j += 1


def summarize_request(body: bytes | bytearray) -> RequestSummary:
    """Instruction, step and size of a chat request without parsing its JSON.

    JSON escapes every quote inside strings, so ``"role": "assistant"`` in the raw bytes is
    a message's role and never text; base64 holds no quotes, so an image's data URL ends at
    the first quote, and everything else is searched only outside the images. A body
    without ``prompts.build_prompt``'s instruction header is parsed in full
    (``full_parse``) and its first user text taken as the instruction.
    """
    images = 0
    files: list[str] = []
    outside: list[bytes | bytearray] = []
    pos = 0
    while True:
        i = body.find(_IMAGE_MARK, pos)
        f = body.find(_FILE_IMAGE_MARK, pos)
        if i < 0 and f < 0:
            break
        if f >= 0 and (i < 0 or f < i):  # a file:// URL: its JSON string, unescaped
            i = f + 1
            end = _string_end(body, i)
            files.append(urllib.parse.unquote(
                json.loads(b'"' + body[i:end] + b'"').removeprefix("file://")))
        else:
            end = body.find(b'"', i)
            if end < 0:
                raise ValueError("unterminated image data URL")
        outside.append(body[pos:i])
        images += 1
        pos = end
    outside.append(body[pos:])
    text = bytes(outside[0]) if len(outside) == 1 else b"".join(outside)
    assistant = sum(text.count(m) for m in _ASSISTANT_MARKS)
    logprobs = any(m in text for m in _LOGPROBS_MARKS)
    token_ids = any(m in text for m in _TOKEN_IDS_MARKS)
    last_step = None
    if assistant:
        s = text.rfind(_STEP_MARK)
        if s >= 0:
            digits = text[s + len(_STEP_MARK): text.find(b"/", s)]
            if digits.isdigit():
                last_step = int(digits)
    m = text.find(_INSTRUCTION_MARK)
    full = m < 0
    if full:
        instruction = _first_user_text(json.loads(body))
    else:
        start = m + len(_INSTRUCTION_MARK)
        instruction = json.loads(b'"' + text[start:_string_end(text, start)] + b'"')
    return RequestSummary(
        instruction.strip(), assistant, last_step, images, len(text), logprobs, token_ids, full,
        tuple(files),
    )


def _first_user_text(request: dict[str, Any]) -> str:
    for message in request.get("messages") or []:
        if message.get("role") != "user":
            continue
        content = message.get("content")
        if isinstance(content, str):
            return content.split("## User Instruction\n")[-1]
        for part in content or []:
            if part.get("type") == "text":
                return str(part.get("text", "")).split("## User Instruction\n")[-1]
    return ""


_WORDS = (
    "the", "window", "shows", "a", "dialog", "with", "file", "menu", "open", "and", "cursor",
    "near", "toolbar", "so", "I", "should", "select", "next", "field", "type", "value",
    "confirm", "it", "check", "result", "before", "move", "on", "to", "remaining", "part",
    "of", "task",
)
_TYPED = ("hello world", "report.txt", "=SUM(A1:A9)", "budget 2024\\n", "sim")
_HOTKEYS = ("ctrl c", "ctrl v", "ctrl s", "alt tab", "enter", "ctrl a")


def sim_reply(
    instruction: str, step: int, cfg: ModelSim
) -> tuple[str, int]:
    """The reply at ``step`` (0-based) of the episode ``instruction``, and its token count.

    Steps before the episode's drawn length answer a UI-TARS 1.5 action at coordinates of
    the smart-resized screen (1920x1080 -> 1932x1092); the last answers ``finished``.
    """
    n = cfg.lengths.draw(instruction)
    key = hashlib.blake2b(f"{cfg.seed}\0{instruction}\0{step}".encode(), digest_size=8)
    rng = random.Random(int.from_bytes(key.digest(), "big"))
    tokens = max(8, cfg.output_tokens_mean + rng.randint(-cfg.output_tokens_jitter,
                                                         cfg.output_tokens_jitter))
    words = " ".join(rng.choice(_WORDS) for _ in range(max(1, tokens * 3 // 4 - 12)))
    head = f"Thought: [sim step {step + 1}/{n}] {words}."
    if step + 1 >= n:
        return f"{head}\nAction: finished(content='')", tokens
    model_h, model_w = smart_resize(cfg.screen_height, cfg.screen_width)
    x = rng.randrange(model_w)
    y = rng.randrange(model_h)
    kind = rng.choices(("click", "type", "scroll", "hotkey"), weights=(6, 2, 1, 1))[0]
    if kind == "click":
        action = f"click(start_box='({x},{y})')"
    elif kind == "type":
        action = f"type(content='{rng.choice(_TYPED)}')"
    elif kind == "scroll":
        action = f"scroll(start_box='({x},{y})', direction='{rng.choice(('up', 'down'))}')"
    else:
        action = f"hotkey(key='{rng.choice(_HOTKEYS)}')"
    return f"{head}\nAction: {action}", tokens


# --------------------------------------------------------------------------- screenshots


def make_screenshot(seed: int, width: int = 1920, height: int = 1080, rich: bool = True) -> bytes:
    """A UI-like PNG: wallpaper, top bar, a window of text lines; ``rich`` adds photo-like
    and noisy regions so it weighs a few hundred KB, like a real desktop capture."""
    import numpy as np
    from PIL import Image, ImageDraw, ImageFont

    rng = np.random.default_rng(seed)
    r = random.Random(seed)
    top, bottom = rng.integers(0, 256, 3), rng.integers(0, 256, 3)
    ramp = np.linspace(0.0, 1.0, height)[:, None, None]
    pixels = np.broadcast_to(top * (1 - ramp) + bottom * ramp, (height, width, 3))
    pixels = pixels.astype(np.uint8)
    if rich:
        for _ in range(2):  # photos: smooth, but never twice the same
            w, h = r.randint(width // 6, width // 3), r.randint(height // 5, height // 3)
            small = Image.fromarray(rng.integers(0, 256, (h // 8, w // 8, 3), dtype=np.uint8))
            x0, y0 = r.randrange(width - w), r.randrange(28, height - h)
            pixels[y0:y0 + h, x0:x0 + w] = np.asarray(small.resize((w, h), Image.BICUBIC))
        for _ in range(3):  # icons and thumbnails: incompressible
            w, h = r.randint(50, 120), r.randint(50, 120)
            x0, y0 = r.randrange(width - w), r.randrange(28, height - h)
            pixels[y0:y0 + h, x0:x0 + w] = rng.integers(0, 256, (h, w, 3), dtype=np.uint8)
    image = Image.fromarray(pixels)
    draw = ImageDraw.Draw(image)
    font = ImageFont.load_default(14)
    wx, wy = r.randrange(width // 30, width // 5), r.randrange(height // 15, height // 5)
    ww, wh = r.randint(width // 2, width * 2 // 3), r.randint(height // 2, height * 3 // 4)
    draw.rectangle([wx, wy, wx + ww, wy + wh], fill=(250, 250, 250), outline=(90, 90, 90))
    draw.rectangle([wx, wy, wx + ww, wy + 30], fill=(60, 60, 70))
    draw.text((wx + 10, wy + 8), f"Document {seed} - Editor", fill=(240, 240, 240), font=font)
    for line in range((wh - 60) // 20):
        text = " ".join(r.choice(_WORDS) for _ in range(r.randint(3, 16)))
        draw.text((wx + 12, wy + 40 + 20 * line), text, fill=(20, 20, 20), font=font)
    draw.rectangle([0, 0, width, 28], fill=(30, 30, 30))
    draw.text((10, 6), f"Activities   {seed:04d}   12:{seed % 60:02d}", fill=(230, 230, 230),
              font=font)
    out = io.BytesIO()
    image.save(out, "PNG")
    return out.getvalue()


# --------------------------------------------------------------------------- HTTP core


_REASONS = {200: b"OK", 400: b"Bad Request", 404: b"Not Found", 431: b"Too Large",
            500: b"Internal Server Error"}


class _App(abc.ABC):
    """What a connection serves: ``app.handle(method, path, body) -> HttpReply``, and a count
    of the connections made to it (a client that does not keep its connections alive shows)."""

    connections = 0

    @abc.abstractmethod
    def handle(self, method: bytes, path: bytes, body: bytes | bytearray) -> HttpReply:
        """(each server kind defines it)"""

    @abc.abstractmethod
    def stats(self) -> dict[str, Any]:
        """(each server kind defines it)"""

    @abc.abstractmethod
    def reset_stats(self) -> None:
        """(each server kind defines it)"""

    # The benchmark's own routes, the same on every sim server.
    def _control(self, method: bytes, path: bytes) -> HttpReply:
        if path == b"/_sim/stats":
            return json_reply(self.stats())
        if path == b"/_sim/reset" and method == b"POST":
            self.reset_stats()
            return json_reply({"ok": True})
        return _NOT_FOUND


_HEAD_MAX_BYTES = 16 * 1024  # request line and headers (bodies go elsewhere); per connection


class _Connection(asyncio.BufferedProtocol):
    """One keep-alive HTTP/1.1 connection, parsed by hand for the least CPU per request.

    The head is read into a reused buffer; a body is read by the kernel straight into a
    bytearray of its Content-Length (one copy of a 3 MB chat request, not three). The
    handler answers at once; a delayed reply is a ``call_later`` (no task, no coroutine).
    Clients must not pipeline (httpx does not): a later request could be answered before
    a delayed earlier one. No chunked request bodies (httpx sends Content-Length).
    """

    def __init__(self, app: _App) -> None:
        self._app = app
        self._transport: asyncio.Transport | None = None
        self._head = bytearray(_HEAD_MAX_BYTES)
        self._filled = 0                          # bytes of _head holding unparsed input
        self._body: bytearray | None = None       # a body being received in place
        self._got = 0
        self._request: tuple[bytes, bytes, bool] = (b"", b"", True)

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport  # type: ignore[assignment]
        self._app.connections += 1

    def connection_lost(self, exc: Exception | None) -> None:
        self._transport = None
        self._body = None

    def get_buffer(self, sizehint: int) -> memoryview:
        if self._body is not None:
            return memoryview(self._body)[self._got:]
        return memoryview(self._head)[self._filled:]

    def buffer_updated(self, nbytes: int) -> None:
        if self._body is not None:
            self._got += nbytes
            if self._got == len(self._body):
                body, self._body = self._body, None
                self._dispatch(*self._request, body)
            return
        self._filled += nbytes
        head = self._head
        while self._filled:
            end = head.find(b"\r\n\r\n", 0, self._filled)
            if end < 0:
                if self._filled == len(head):
                    self._write(HttpReply(431, b'{"error": "request head too large"}'), False)
                return
            try:
                method, path, length, keep_alive = _parse_head(bytes(head[:end]))
            except ValueError as exc:
                self._write(HttpReply(400, json.dumps({"error": str(exc)}).encode()), False)
                return
            start = end + 4
            available = self._filled - start
            if length > available:
                # Receive the rest of the body in place, straight into its final buffer.
                self._body = bytearray(length)
                self._body[:available] = head[start:self._filled]
                self._got = available
                self._request = (method, path, keep_alive)
                self._filled = 0
                return
            body = bytes(memoryview(head)[start:start + length])
            rest = available - length
            head[:rest] = head[start + length:self._filled]  # same size: never resized
            self._filled = rest
            self._dispatch(method, path, keep_alive, body)

    def _dispatch(self, method: bytes, path: bytes, keep_alive: bool,
                  body: bytes | bytearray) -> None:
        try:
            reply = self._app.handle(method, path, body)
        except Exception as exc:  # a bug or a bad body: answered as the real servers do
            reply = HttpReply(500, json.dumps({"status": "error", "message": repr(exc)}).encode())
        if reply.delay_s > 0:
            asyncio.get_running_loop().call_later(reply.delay_s, self._write, reply, keep_alive)
        else:
            self._write(reply, keep_alive)

    def _write(self, reply: HttpReply, keep_alive: bool) -> None:
        if reply.done is not None:
            reply.done()
        t = self._transport
        if t is None or t.is_closing():
            return
        if reply.drop:
            t.close()
            return
        head = b"HTTP/1.1 %d %s\r\ncontent-type: %s\r\ncontent-length: %d\r\n%s\r\n" % (
            reply.status, _REASONS.get(reply.status, b"Error"), reply.content_type,
            len(reply.body), b"" if keep_alive else b"connection: close\r\n",
        )
        if len(reply.body) < 16384:
            t.write(head + reply.body)
        else:  # no copy of a large body just to prepend the head
            t.write(head)
            t.write(reply.body)
        if not keep_alive:
            t.close()


_NOT_FOUND = HttpReply(404, b'{"error": "not found"}')


def _parse_head(head: bytes) -> tuple[bytes, bytes, int, bool]:
    """Method, path (query dropped), Content-Length and keep-alive of a request head."""
    lines = head.split(b"\r\n")
    parts = lines[0].split(b" ")
    if len(parts) != 3 or not parts[2].startswith(b"HTTP/1."):
        raise ValueError(f"bad request line {lines[0][:100]!r}")
    method, target, version = parts
    length = 0
    keep_alive = version == b"HTTP/1.1"
    for line in lines[1:]:
        name, _, value = line.partition(b":")
        name = name.strip().lower()
        if name == b"content-length":
            length = int(value)
        elif name == b"connection":
            value = value.strip().lower()
            keep_alive = value != b"close" and (keep_alive or value == b"keep-alive")
        elif name == b"transfer-encoding":
            raise ValueError("chunked request bodies are not supported by the sim")
    if length < 0:
        raise ValueError("negative Content-Length")
    return method, target.split(b"?", 1)[0], length, keep_alive


# --------------------------------------------------------------------------- desktops


class _EP:
    """The desktop protocol's paths (cua_rollout/desktop/protocol.py) as the sim matches them:
    bytes after
    ``/d/<index>/``."""

    SCREENSHOT = Paths.SCREENSHOT[1:].encode()
    EXECUTE = Paths.EXECUTE[1:].encode()
    SCREEN_SIZE = Paths.SCREEN_SIZE[1:].encode()
    SETUP_EXECUTE = Paths.SETUP_EXECUTE[1:].encode()
    SETUP_PREFIX = b"setup/"  # every /setup/... path (launch, open_file, upload, windows)
    CURSOR_POSITION = Paths.CURSOR_POSITION[1:].encode()
    PLATFORM = Paths.PLATFORM[1:].encode()
    RUN_PYTHON = Paths.RUN_PYTHON[1:].encode()
    TERMINAL = Paths.TERMINAL[1:].encode()
    ACCESSIBILITY = Paths.ACCESSIBILITY[1:].encode()
    FILE = Paths.FILE[1:].encode()


DESKTOP_KINDS = ("screenshot", "action", "reset", "setup", "health", "query", "unknown")
_EXCLUSIVE = frozenset({"action", "reset", "setup"})  # two at once on a desktop: a double lease
# Replies built once from the protocol's models (cua_rollout/desktop/protocol.py), served as bytes.
_EXECUTE_OK = CommandReply(status="success", output="", error="", returncode=0
                           ).model_dump_json().encode()
_RUN_PYTHON_OK = RunPythonReply(status="success", message="", output="", error="",
                                return_code=0).model_dump_json().encode()
_TERMINAL_OK = TerminalReply(output="").model_dump_json().encode()
_ACCESSIBILITY_OK = AccessibilityReply(AT='<desktop-frame name="sim"/>').model_dump_json().encode()
_FILE_NOT_FOUND = ErrorReply(error="File not found").model_dump_json().encode()


class DesktopsApp(_App):
    """Desktops ``worker, worker + workers, ...`` of ``count``, under ``/d/<index>/...``."""

    def __init__(self, cfg: DesktopSim, count: int, worker: int, workers: int,
                 screenshots: list[bytes]) -> None:
        self.cfg = cfg
        self.count, self.worker, self.workers = count, worker, workers
        self._shots = screenshots
        self._next_shot = 0
        self._rng = random.Random(cfg.seed * 1000 + worker)
        self._reset_json = [json.dumps(RESET_COMMAND).encode(), b'"sim-reset"']
        w, h = cfg.screen_width, cfg.screen_height
        self._screen_size = ScreenSizeReply(width=w, height=h).model_dump_json().encode()
        self._cursor = json.dumps([w // 2, h // 2]).encode()
        self.busy = [0] * count  # exclusive requests in flight per desktop (state, not a stat)
        self.reset_stats()

    def reset_stats(self) -> None:
        self.counts = {k: [0] * self.count for k in DESKTOP_KINDS}
        self.overlaps = [0] * self.count      # exclusive requests that met another one
        self.connections = 0
        self.bytes_sent = 0
        self.started_at = time.monotonic()

    def stats(self) -> dict[str, Any]:
        mine = range(self.worker, self.count, self.workers)
        per_desktop = {
            str(i): {k: self.counts[k][i] for k in DESKTOP_KINDS if self.counts[k][i]}
            for i in mine
        }
        return {
            "desktops": len(mine),
            "totals": {k: sum(self.counts[k]) for k in DESKTOP_KINDS},
            "overlaps": sum(self.overlaps),
            "per_desktop": {i: c for i, c in per_desktop.items() if c},
            "overlaps_per_desktop": {str(i): self.overlaps[i] for i in mine if self.overlaps[i]},
            "bytes_sent": self.bytes_sent,
            "connections": self.connections,
            "elapsed_s": time.monotonic() - self.started_at,
        }

    def handle(self, method: bytes, path: bytes, body: bytes | bytearray) -> HttpReply:
        parts = path.split(b"/", 3)  # b"", b"d", index, endpoint
        if len(parts) < 4 or parts[1] != b"d":
            return self._control(method, path)
        try:
            index = int(parts[2])
        except ValueError:
            return _NOT_FOUND
        if not (0 <= index < self.count) or index % self.workers != self.worker:
            return _NOT_FOUND
        kind, reply = self._route(parts[3], body)
        self.counts[kind][index] += 1
        if kind in _EXCLUSIVE:
            if self.busy[index]:
                self.overlaps[index] += 1
            self.busy[index] += 1
            reply = reply._replace(done=lambda: self._release(index))
        self.bytes_sent += len(reply.body)
        return reply

    def _release(self, index: int) -> None:
        self.busy[index] -= 1

    def _route(self, endpoint: bytes, body: bytes | bytearray) -> tuple[str, HttpReply]:
        cfg, rng = self.cfg, self._rng
        if endpoint == _EP.SCREENSHOT:
            shot = self._shots[self._next_shot % len(self._shots)]
            self._next_shot += 1
            return "screenshot", HttpReply(200, shot, b"image/png",
                                        cfg.screenshot_latency.draw(rng))
        if endpoint == _EP.EXECUTE:
            if any(marker in body for marker in self._reset_json) and self._is_reset(body):
                return "reset", HttpReply(200, _EXECUTE_OK, delay_s=cfg.reset_latency.draw(rng))
            return "action", HttpReply(200, _EXECUTE_OK, delay_s=cfg.action_latency.draw(rng))
        if endpoint == _EP.SCREEN_SIZE:
            return "health", HttpReply(200, self._screen_size)
        if endpoint.startswith(_EP.SETUP_PREFIX):
            delay = cfg.setup_latency.draw(rng)
            if endpoint == _EP.SETUP_EXECUTE:
                return "setup", HttpReply(200, _EXECUTE_OK, delay_s=delay)
            return "setup", HttpReply(200, b"ok", b"text/plain", delay)
        if endpoint == _EP.CURSOR_POSITION:
            return "query", HttpReply(200, self._cursor)
        if endpoint == _EP.PLATFORM:
            return "query", HttpReply(200, b"Linux", b"text/plain")
        if endpoint == _EP.RUN_PYTHON:
            return "query", HttpReply(200, _RUN_PYTHON_OK)
        if endpoint == _EP.TERMINAL:
            return "query", HttpReply(200, _TERMINAL_OK)
        if endpoint == _EP.ACCESSIBILITY:
            return "query", HttpReply(200, _ACCESSIBILITY_OK)
        if endpoint == _EP.FILE:
            return "query", HttpReply(404, _FILE_NOT_FOUND)
        return "unknown", _NOT_FOUND

    @staticmethod
    def _is_reset(body: bytes | bytearray) -> bool:
        command = json.loads(body).get("command")
        return command == RESET_COMMAND or command == RESET_COMMAND[0]



# --------------------------------------------------------------------------- model servers


class ModelApp(OpenAIServer, _App):
    """One OpenAI-compatible server of the sim (``index`` picks its speed factor):
    ``cua_rollout.model.openai_server`` with the sim's latency model as its policy; requests
    are read from their raw bytes (``summarize_request``), never decoded whole."""

    def __init__(self, cfg: ModelSim, index: int) -> None:
        # Past ``capacity`` requests wait (a real server's batch is full): /metrics says so.
        super().__init__(model=cfg.model, owned_by="sim", max_model_len=65536, root=cfg.model,
                         capacity=cfg.capacity)
        self.cfg = cfg
        self.index = index
        self.speed_factor = cfg.speed_factor(index)
        h, w = smart_resize(cfg.screen_height, cfg.screen_width)
        self._image_tokens = h * w // _TOKENS_PER_PATCH
        self.reset_stats()

    def reset_stats(self) -> None:
        self.requests = 0
        # in_flight is state, not a stat: requests answered after a reset still leave.
        self.max_in_flight = self.in_flight
        self.connections = 0
        self.finished = 0
        self.full_parses = 0
        self.prompt_tokens = 0
        self.cached_tokens = 0
        self.completion_tokens = 0
        self.service_s = 0.0
        self.sessions: dict[str, list[int]] = {}
        self._cache: OrderedDict[str, tuple[int, int, int]] = OrderedDict()
        self.started_at = time.monotonic()

    def stats(self) -> dict[str, Any]:
        return {
            "index": self.index, "speed_factor": self.speed_factor, "requests": self.requests,
            "in_flight": self.in_flight, "max_in_flight": self.max_in_flight,
            "finished": self.finished, "full_parses": self.full_parses,
            "connections": self.connections,
            "prompt_tokens": self.prompt_tokens, "cached_tokens": self.cached_tokens,
            "completion_tokens": self.completion_tokens,
            "service_s": round(self.service_s, 3),
            "elapsed_s": time.monotonic() - self.started_at,
            "sessions": self.sessions,
        }

    def handle(self, method: bytes, path: bytes, body: bytes | bytearray,
               headers: dict[str, str] | None = None) -> HttpReply:
        if path.startswith(b"/_sim/"):
            return self._control(method, path)
        return super().handle(method, path, body, headers)

    def answer(self, call: ChatCall) -> Completion:
        cfg = self.cfg
        try:
            req = summarize_request(call.body)
        except (ValueError, AttributeError, TypeError) as exc:
            raise ValueError(f"bad request: {exc}") from exc
        for path in req.image_files:  # read as a server does (vLLM's file:// media)
            try:
                with open(path, "rb") as f:
                    data = f.read()
            except OSError as exc:
                raise ValueError(f"cannot read the image {path}: {exc}") from exc
            if not (data.startswith(b"\x89PNG\r\n\x1a\n") and data.endswith(_PNG_END)):
                raise ValueError(f"the image {path} is not a whole PNG")
        # A long episode's oldest replies drop out of the request (history_texts): the step
        # number the last reply carried keeps counting past that.
        step = req.assistant_turns
        if req.last_step is not None:
            step = max(step, req.last_step)
        text, completion = sim_reply(req.instruction, step, cfg)
        prompt = req.images * self._image_tokens + req.text_bytes // _TEXT_BYTES_PER_TOKEN
        text_tokens = prompt - req.images * self._image_tokens
        cached = self._cached(req.instruction, prompt, req.images, text_tokens)
        self.requests += 1
        self.full_parses += req.full_parse
        self.prompt_tokens += prompt
        self.cached_tokens += cached
        self.completion_tokens += completion
        self.sessions.setdefault(req.instruction[:200], []).append(step)
        if text.endswith("finished(content='')"):
            self.finished += 1
        service = self.speed_factor * (
            cfg.base_latency_s + cfg.prefill_s_per_1k_tokens * (prompt - cached) / 1000
            + cfg.per_token_s * completion
        )
        # in_flight counts this request already (the server counts it before asking).
        delay = service * max(1.0, self.in_flight / cfg.capacity)
        self.service_s += delay
        return Completion(
            text, completion_id=f"chatcmpl-sim-{self.index}-{self.requests}",
            prompt_tokens=prompt, completion_tokens=completion, cached_tokens=cached,
            logprobs=[(w, -0.1) for w in text.split()[:completion]] if req.logprobs else None,
            token_ids=list(range(completion)) if req.return_token_ids else None,
            prompt_token_ids=list(range(prompt)) if req.return_token_ids else None,
            delay_s=delay,
        )

    def _cached(self, session: str, prompt: int, images: int, text_tokens: int) -> int:
        """Prompt tokens found in this server's prefix cache for this session's request."""
        previous = self._cache.pop(session, None)
        self._cache[session] = (prompt, images, text_tokens)
        while len(self._cache) > self.cfg.prefix_cache_sessions:
            self._cache.popitem(last=False)
        if previous is None:
            return 0
        prev_prompt, prev_images, prev_text = previous
        # While the image window grows the whole previous prompt is a prefix; once it is
        # full, the oldest image turns into text and the prefix breaks there (roughly: the
        # text before the first image).
        reused = prev_prompt if images > prev_images else min(prev_text, text_tokens) // 2
        return min(reused, prompt)


# --------------------------------------------------------------------------- child processes


async def _serve(spec: dict[str, Any]) -> None:
    loop = asyncio.get_running_loop()
    role = spec["role"]
    apps: list[_App]
    if role == "desktops":
        shots = [p.read_bytes() for p in sorted(Path(spec["screenshots_dir"]).glob("*.png"))]
        cfg = _from_dict(DesktopSim, spec["desktop"])
        apps = [DesktopsApp(cfg, spec["count"], spec["worker"], spec["workers"], shots)]
    else:
        mcfg = _from_dict(ModelSim, spec["model"])
        apps = [ModelApp(mcfg, i) for i in spec["indices"]]
    servers = []
    for app in apps:
        servers.append(await loop.create_server(
            lambda app=app: _Connection(app), spec["host"], 0, backlog=4096,
        ))
    ports = [s.sockets[0].getsockname()[1] for s in servers]
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    stdin = sys.stdin.fileno()

    def _stdin_readable() -> None:
        # The parent holds our stdin: EOF means it is gone, and so must we be.
        if not os.read(stdin, 4096):
            loop.remove_reader(stdin)
            stop.set()

    loop.add_reader(stdin, _stdin_readable)
    sys.stdout.write(json.dumps({"ports": ports}) + "\n")
    sys.stdout.flush()
    await stop.wait()
    for s in servers:
        s.close()


def _child_main(spec_json: str) -> None:
    spec = json.loads(spec_json)
    if spec.get("nice"):
        os.nice(spec["nice"])
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvicorn[standard] brings it
        asyncio.run(_serve(spec))
    else:
        uvloop.run(_serve(spec))


# --------------------------------------------------------------------------- the parent API


@dataclass
class _Child:
    role: str
    proc: subprocess.Popen[bytes]
    ports: list[int] = field(default_factory=list)


class SimWorld:
    """``desktops`` simulated desktops and ``model_servers`` simulated model servers, served
    by ``desktop_workers`` and ``model_workers`` subprocesses on loopback ports.

    Desktop ``i`` lives at ``desktop_urls[i] == http://HOST:PORT/d/i`` (its worker's port);
    model server ``j`` at ``model_urls[j]``. ``stats()`` reads every process's counters,
    ``reset_stats()`` zeroes them (and the model servers' prefix caches), ``cpu_s()`` is the
    CPU time each side used so far. Stop with ``stop()`` or by leaving the ``with`` block.
    """

    def __init__(
        self,
        desktops: int = 0,
        model_servers: int = 0,
        *,
        desktop: DesktopSim | None = None,
        model: ModelSim | None = None,
        desktop_workers: int = 1,
        model_workers: int = 1,
        host: str = "127.0.0.1",
        nice: int = 0,
        start_timeout_s: float = 30.0,
    ) -> None:
        if desktops < 0 or model_servers < 0:
            raise ValueError("desktops and model_servers must not be negative")
        self.desktops = desktops
        self.model_servers = model_servers
        self.desktop = desktop or DesktopSim()
        self.model = model or ModelSim()
        self.desktop_workers = max(1, min(desktop_workers, desktops or 1))
        self.model_workers = max(1, min(model_workers, model_servers or 1))
        self.host = host
        self.nice = nice
        self.start_timeout_s = start_timeout_s
        self.reset_command = list(RESET_COMMAND)
        self.desktop_urls: list[str] = []
        self.model_urls: list[str] = []
        self._children: list[_Child] = []
        self._tmp: Path | None = None

    # ----------------------------------------------------------------- lifecycle

    def start(self) -> SimWorld:
        if self._children:
            return self
        self._tmp = Path(tempfile.mkdtemp(prefix="cua-sim-"))
        try:
            # Model servers start while the screenshots are drawn.
            model_children = [
                self._spawn({"role": "models", "model": dataclasses.asdict(self.model),
                             "indices": list(range(w, self.model_servers, self.model_workers))})
                for w in range(self.model_workers) if self.model_servers
            ]
            desktop_children = []
            if self.desktops:
                shots = self._tmp / "screenshots"
                shots.mkdir()
                d = self.desktop
                for i in range(d.screenshots):
                    png = make_screenshot(d.seed * 1000 + i, d.screen_width, d.screen_height,
                                          d.rich_screenshots)
                    (shots / f"{i:03d}.png").write_bytes(png)
                desktop_children = [
                    self._spawn({"role": "desktops", "desktop": dataclasses.asdict(d),
                                 "count": self.desktops, "worker": w,
                                 "workers": self.desktop_workers,
                                 "screenshots_dir": str(shots)})
                    for w in range(self.desktop_workers)
                ]
            for child in self._children:
                child.ports = self._read_ports(child)
            ports = [c.ports[0] for c in desktop_children]
            self.desktop_urls = [
                f"http://{self.host}:{ports[i % len(ports)]}/d/{i}" for i in range(self.desktops)
            ]
            by_index: dict[int, str] = {}
            for w, child in enumerate(model_children):
                for j, port in zip(range(w, self.model_servers, self.model_workers), child.ports,
                                   strict=True):
                    by_index[j] = f"http://{self.host}:{port}"
            self.model_urls = [by_index[j] for j in range(self.model_servers)]
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        """Stop every process this world started (by pid), then remove its temp dir."""
        for child in self._children:
            if child.proc.poll() is None:
                child.proc.terminate()
        for child in self._children:
            try:
                child.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                child.proc.kill()
                child.proc.wait(timeout=5)
            for pipe in (child.proc.stdin, child.proc.stdout):
                if pipe is not None:
                    pipe.close()
        self._children = []
        if self._tmp is not None:
            shutil.rmtree(self._tmp, ignore_errors=True)
            self._tmp = None

    def __enter__(self) -> SimWorld:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def pids(self) -> list[int]:
        return [c.proc.pid for c in self._children]

    # ----------------------------------------------------------------- measurements

    def stats(self, sessions: bool = True) -> dict[str, Any]:
        """Counters of both sides: ``desktops`` (totals per request kind, per desktop,
        overlapping exclusive requests), ``models`` (one entry per server, in
        ``model_urls`` order) and ``sessions`` (per episode instruction: requests, first
        and last server index, server switches), plus each process's CPU and memory."""
        desktop_parts = [self._get(c.ports[0], "/_sim/stats")
                         for c in self._children if c.role == "desktops"]
        models = [self._get_url(url + "/_sim/stats") for url in self.model_urls]
        out: dict[str, Any] = {"desktops": _merge_desktop_stats(desktop_parts)}
        out["models"] = [{k: v for k, v in m.items() if k != "sessions"} for m in models]
        if sessions:
            out["sessions"] = _merge_sessions([m["sessions"] for m in models])
        out["processes"] = self.processes()
        return out

    def reset_stats(self) -> None:
        for child in self._children:
            for port in child.ports:
                self._post(port, "/_sim/reset")

    def processes(self) -> list[dict[str, Any]]:
        import psutil

        out = []
        for child in self._children:
            try:
                p = psutil.Process(child.proc.pid)
                cpu = p.cpu_times()
                rss = p.memory_info().rss
            except psutil.Error:
                continue
            out.append({"role": child.role, "pid": child.proc.pid,
                        "cpu_s": cpu.user + cpu.system, "rss_mb": rss / 2**20})
        return out

    def cpu_s(self) -> dict[str, float]:
        """CPU seconds used so far by the desktop side and by the model side."""
        totals = {"desktops": 0.0, "models": 0.0}
        for p in self.processes():
            totals[p["role"]] += p["cpu_s"]
        return totals

    # ----------------------------------------------------------------- internals

    def _spawn(self, spec: dict[str, Any]) -> _Child:
        assert self._tmp is not None
        spec = {**spec, "host": self.host, "nice": self.nice}
        log = (self._tmp / f"{spec['role']}-{len(self._children)}.log").open("wb")
        with log:
            proc = subprocess.Popen(
                [sys.executable, str(Path(__file__).resolve()), "_serve", json.dumps(spec)],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log,
                start_new_session=True,  # a Ctrl-C reaches the parent, which stops us in order
            )
        child = _Child(spec["role"], proc)
        self._children.append(child)
        return child

    def _read_ports(self, child: _Child) -> list[int]:
        assert child.proc.stdout is not None
        deadline = time.monotonic() + self.start_timeout_s
        line = b""
        while not line.endswith(b"\n"):
            remaining = deadline - time.monotonic()
            if remaining <= 0 or child.proc.poll() is not None:
                raise RuntimeError(f"sim {child.role} process did not start: {self._log(child)}")
            ready, _, _ = select.select([child.proc.stdout], [], [], remaining)
            if ready:
                chunk = os.read(child.proc.stdout.fileno(), 4096)
                if not chunk:
                    child.proc.wait(timeout=5)
                    raise RuntimeError(f"sim {child.role} process exited: {self._log(child)}")
                line += chunk
        return list(json.loads(line)["ports"])

    def _log(self, child: _Child) -> str:
        assert self._tmp is not None
        text = "".join(p.read_text(errors="replace") for p in self._tmp.glob(f"{child.role}-*"))
        return text[-2000:] or "(no output)"

    def _get(self, port: int, path: str) -> dict[str, Any]:
        return self._get_url(f"http://{self.host}:{port}{path}")

    @staticmethod
    def _get_url(url: str) -> dict[str, Any]:
        with urllib.request.urlopen(url, timeout=30) as r:
            return json.loads(r.read())

    def _post(self, port: int, path: str) -> None:
        req = urllib.request.Request(f"http://{self.host}:{port}{path}", data=b"", method="POST")
        with urllib.request.urlopen(req, timeout=30) as r:
            r.read()


def _merge_desktop_stats(parts: list[dict[str, Any]]) -> dict[str, Any]:
    totals: Counter[str] = Counter()
    per_desktop: dict[str, Any] = {}
    overlaps_per: dict[str, int] = {}
    for part in parts:
        totals.update(part["totals"])
        per_desktop.update(part["per_desktop"])
        overlaps_per.update(part["overlaps_per_desktop"])
    return {
        "desktops": sum(p["desktops"] for p in parts),
        "totals": {k: totals[k] for k in DESKTOP_KINDS},
        "requests": sum(totals.values()),
        "overlaps": sum(p["overlaps"] for p in parts),
        "bytes_sent": sum(p["bytes_sent"] for p in parts),
        "connections": sum(p["connections"] for p in parts),
        "per_desktop": per_desktop,
        "overlaps_per_desktop": overlaps_per,
    }


def _merge_sessions(per_server: list[dict[str, list[int]]]) -> dict[str, dict[str, Any]]:
    steps: dict[str, list[tuple[int, int]]] = {}
    for server, sessions in enumerate(per_server):
        for name, served in sessions.items():
            steps.setdefault(name, []).extend((s, server) for s in served)
    out = {}
    for name, seq in steps.items():
        seq.sort()
        servers = [s for _, s in seq]
        out[name] = {
            "requests": len(seq), "first_server": servers[0], "last_server": servers[-1],
            "switches": sum(a != b for a, b in itertools.pairwise(servers)),
            "last_step": seq[-1][0],
        }
    return out


# --------------------------------------------------------------------------- measurement CLI


class _LoadConnection(asyncio.Protocol):
    """A lean keep-alive client connection that repeats one request as fast as answered."""

    def __init__(self, requests: Iterator[bytes], on_reply: Callable[[int], None]) -> None:
        import httptools

        self._requests = requests
        self._on_reply = on_reply
        self._parser = httptools.HttpResponseParser(self)
        self._size = 0
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self.transport.write(next(self._requests))

    def data_received(self, data: bytes) -> None:
        self._parser.feed_data(data)

    def on_body(self, body: bytes) -> None:
        self._size += len(body)

    def on_message_complete(self) -> None:
        self._on_reply(self._parser.get_status_code())
        self._size = 0
        if self.transport is not None and not self.transport.is_closing():
            self.transport.write(next(self._requests))


def _request_bytes(method: str, host: str, port: int, path: str, body: bytes = b"") -> bytes:
    head = (f"{method} {path} HTTP/1.1\r\nhost: {host}:{port}\r\n"
            f"content-type: application/json\r\ncontent-length: {len(body)}\r\n\r\n")
    return head.encode() + body


async def _load(host: str, targets: list[tuple[int, list[bytes]]], connections: int,
                seconds: float) -> tuple[int, Counter[int]]:
    """``connections`` keep-alive connections spread over ``targets`` (port, requests),
    each repeating its requests round-robin for ``seconds``; returns replies and statuses."""
    loop = asyncio.get_running_loop()
    statuses: Counter[int] = Counter()

    def cycle(items: list[bytes], offset: int) -> Iterator[bytes]:
        i = offset
        while True:
            yield items[i % len(items)]
            i += 1

    def count(status: int) -> None:
        statuses[status] += 1

    conns = []
    for c in range(connections):
        port, reqs = targets[c % len(targets)]
        _, proto = await loop.create_connection(
            lambda reqs=reqs, c=c: _LoadConnection(cycle(reqs, c), count), host, port
        )
        conns.append(proto)
    await asyncio.sleep(seconds)
    for proto in conns:
        if proto.transport is not None:
            proto.transport.close()
    return sum(statuses.values()), statuses


def _measure(args: argparse.Namespace) -> dict[str, Any]:
    import uvloop

    results: dict[str, Any] = {"cpus": os.cpu_count()}
    desktop = DesktopSim(action_latency=Latency(0.0), reset_latency=Latency(0.0))
    with SimWorld(desktops=args.desktops, model_servers=1, desktop=desktop,
                  model=ModelSim(base_latency_s=0.0, per_token_s=0.0,
                                 prefill_s_per_1k_tokens=0.0, capacity=10**6),
                  desktop_workers=args.desktop_workers) as world:
        host = world.host

        def desktop_targets(endpoint: str, method: str = "GET", body: bytes = b""
                            ) -> list[tuple[int, list[bytes]]]:
            by_port: dict[int, list[bytes]] = {}
            for url in world.desktop_urls:
                port = int(url.split(":")[2].split("/")[0])
                path = url.split(str(port), 1)[1] + endpoint
                by_port.setdefault(port, []).append(
                    _request_bytes(method, host, port, path, body))
            return list(by_port.items())

        action = json.dumps({"command": ["python", "-c", "import pyautogui; "
                                         "pyautogui.click(10, 20)"], "shell": False}).encode()
        chat = _chat_body(args.history)
        model_port = int(world.model_urls[0].rsplit(":", 1)[1])
        cases = [
            ("desktop /screenshot", "desktops",
             desktop_targets("/screenshot"), args.connections),
            ("desktop /execute", "desktops",
             desktop_targets("/execute", "POST", action), args.connections),
            ("model /v1/chat/completions", "models",
             [(model_port, [_request_bytes("POST", host, model_port, CHAT_COMPLETIONS_PATH,
                                           chat)])], args.model_connections),
        ]
        for name, role, targets, connections in cases:
            world.reset_stats()
            cpu0 = world.cpu_s()[role]
            t0 = time.monotonic()
            n, statuses = uvloop.run(_load(host, targets, connections, args.seconds))
            elapsed = time.monotonic() - t0
            cpu = world.cpu_s()[role] - cpu0
            results[name] = {
                "requests": n, "requests_per_s": round(n / elapsed, 1),
                "server_cpu_us_per_request": round(1e6 * cpu / n, 1) if n else None,
                "server_cpu_share": round(cpu / elapsed, 2),
                "sustainable_requests_per_s_per_core": round(n / cpu) if cpu else None,
                "statuses": dict(statuses),
            }
            if name == "desktop /screenshot":
                sent = world.stats(sessions=False)["desktops"]
                results["screenshot_kb"] = round(
                    sent["bytes_sent"] / 1024 / max(1, sent["totals"]["screenshot"]), 1)
        results["chat_body_kb"] = round(len(chat) / 1024)
        results["processes"] = world.processes()
        results["setup"] = {"desktops": args.desktops, "desktop_workers": args.desktop_workers,
                            "connections": args.connections, "seconds": args.seconds}
    return results


def _chat_body(history: int) -> bytes:
    """A real request body: what the model client sends for ``prompts.build_messages`` over
    full-size sim screenshots."""
    from cua_rollout.agents.uitars.prompt import Turn, build_messages
    from cua_rollout.config import SamplingConfig
    from cua_rollout.core.screenshot import Screenshot

    shots = [Screenshot(make_screenshot(i)) for i in range(min(history + 1, 6))]
    cfg = ModelSim()
    turns = [Turn(shots[i % len(shots)], sim_reply("sim task 0", i, cfg)[0])
             for i in range(history)]
    messages = build_messages("sim task 0", turns, shots[history % len(shots)])
    body = chat_request_body(cfg.model, messages, SamplingConfig(max_tokens=500))
    return json.dumps(body).encode()


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["_serve"]:
        _child_main(argv[1])
        return 0
    parser = argparse.ArgumentParser(description="Measure the sim world's own cost.")
    sub = parser.add_subparsers(dest="command", required=True)
    m = sub.add_parser("measure", help="CPU per request and requests/s of the sim servers")
    m.add_argument("--desktops", type=int, default=1024)
    m.add_argument("--desktop-workers", type=int, default=1)
    m.add_argument("--connections", type=int, default=64)
    m.add_argument("--model-connections", type=int, default=16)
    m.add_argument("--history", type=int, default=4, help="past steps in the chat request")
    m.add_argument("--seconds", type=float, default=5.0)
    s = sub.add_parser("serve", help="serve a sim world (e.g. inside a network namespace) "
                       "until SIGTERM or SIGINT; its URLs on stdout as one JSON line")
    s.add_argument("--desktops", type=int, default=0)
    s.add_argument("--model-servers", type=int, default=0)
    s.add_argument("--host", default="127.0.0.1", help="the address to bind")
    s.add_argument("--desktop", type=json.loads, default={}, metavar="JSON",
                   help='DesktopSim fields, e.g. \'{"rich_screenshots": false}\'')
    s.add_argument("--model", type=json.loads, default={}, metavar="JSON",
                   help='ModelSim fields, e.g. \'{"lengths": {"median_steps": 4}}\'')
    args = parser.parse_args(argv)
    if args.command == "serve":
        try:
            desktop = _settings(DesktopSim, args.desktop, "--desktop")
            model = _settings(ModelSim, args.model, "--model")
        except ValueError as exc:
            parser.error(str(exc))
        _serve_world(SimWorld(args.desktops, args.model_servers, desktop=desktop, model=model,
                              host=args.host))
        return 0
    print(json.dumps(_measure(args), indent=1))
    return 0


def _settings(cls: type, data: Any, option: str) -> Any:
    """``cls`` from ``data`` (the JSON of ``option``), unknown fields named in the error."""
    if not isinstance(data, dict):
        raise ValueError(f"{option} must be a JSON object of {cls.__name__} fields")
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ValueError(f"{option}: {cls.__name__} has no field {', '.join(unknown)} "
                         f"(it has {', '.join(sorted(known))})")
    try:
        return _from_dict(cls, data)
    except (KeyError, TypeError) as exc:
        raise ValueError(f"{option}: {type(exc).__name__}: {exc}") from exc


def _serve_world(world: SimWorld) -> None:
    """Start ``world``, print where it serves, stop it at SIGTERM or SIGINT."""
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):  # handlers, not a mask: children inherit masks
        signal.signal(sig, lambda *_: stop.set())
    with world:
        sys.stdout.write(json.dumps({"desktop_urls": world.desktop_urls,
                                     "model_urls": world.model_urls,
                                     "reset_command": world.reset_command,
                                     "pids": world.pids}) + "\n")
        sys.stdout.flush()
        stop.wait()


if __name__ == "__main__":
    raise SystemExit(main())
