"""A real vision-language model in the loop: a tiny random Qwen2.5-VL built at test time,
served by a real ``run_model.py`` pool on vLLM's CPU build (with the isolated torchvision),
real screenshots of real desktops as images, real Ray.

- the demo as users run it (``configs/demo_vlm.yaml``: run.py starts its own pool): valid
  statuses, every reply parsed under the action grammar, the images of the history window in
  every prompt (prompt tokens and image placeholders), token ids and logprobs recorded;
- the parser's ``smart_resize`` against what the server's processor made of each screen size
  the configs use (image token counts);
- the grammar: 100% of replies parse over 50+ requests; without it, unparseable replies take
  the parse-failure path;
- a request longer than the served context is refused before it is sent.
"""

from __future__ import annotations

import asyncio
import io
import itertools
import json
import random
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from fastapi import FastAPI, Request, Response

from cua_rollout.agents.uitars import action_regex, parse_response
from cua_rollout.cli.tiny_models import build_tiny_vlm
from cua_rollout.config import Config, load_config
from cua_rollout.core.errors import ActionParseError, ContextTooShort, ModelRequestError
from cua_rollout.core.http import ThreadedServer
from cua_rollout.core.screenshot import Screenshot
from cua_rollout.core.types import SCORED_STATUSES, Status
from cua_rollout.core.vision import IMAGE_WRAPPER_TOKENS, image_tokens, smart_resize
from cua_rollout.model.client import ModelServicePool
from cua_rollout.model.fleet.child import PoolChild
from cua_rollout.model.fleet.launch import RequestShape
from cua_rollout.training import TrainingIndex, default_url, export
from tests.support import REPO_ROOT, require_vlm_serving

pytestmark = [pytest.mark.integration, pytest.mark.slow]

DEMO_VLM = REPO_ROOT / "configs" / "demo_vlm.yaml"
RUN_TIMEOUT_S = 900


def _config(tmp: Path, *sets: str) -> Config:
    return load_config(DEMO_VLM, overrides=[
        *sets, f"run.output_dir={tmp / 'results'}", f"model_pool.state_dir={tmp / 'pool'}"])


def _screen_sizes() -> list[tuple[int, int]]:
    """Every screen size the shipped configs use."""
    sizes = set()
    for path in sorted((REPO_ROOT / "configs").glob("*.yaml")):
        d = load_config(path).desktops
        sizes.add((d.screen_width, d.screen_height))
    return sorted(sizes)


def _png(width: int, height: int, seed: int) -> bytes:
    """A screenshot-like PNG: random coloured rectangles (not one flat colour)."""
    from PIL import Image, ImageDraw

    rng = random.Random(seed)
    image = Image.new("RGB", (width, height), (rng.randrange(256),) * 3)
    draw = ImageDraw.Draw(image)
    for _ in range(20):
        x, y = rng.randrange(width), rng.randrange(height)
        draw.rectangle((x, y, x + rng.randrange(40, 400), y + rng.randrange(20, 200)),
                       fill=tuple(rng.randrange(256) for _ in range(3)))
    out = io.BytesIO()
    image.save(out, "PNG")
    return out.getvalue()


def _messages(shots: list[Screenshot], text: str = "Click the button.") -> list[dict[str, Any]]:
    content: list[dict[str, Any]] = [{"type": "text", "text": text}]
    content += [{"type": "image_url", "image_url": {"url": s.url}} for s in shots]
    return [{"role": "user", "content": content}]


# --------------------------------------------------------------------------- the demo


def test_the_vlm_demo_as_users_run_it(tmp):
    """``python run.py --config configs/demo_vlm.yaml`` (its own pool on a tiny VLM built
    here), on a few demo tasks x 2 rollouts."""
    require_vlm_serving()
    model_dir = build_tiny_vlm(tmp / "tiny-vlm")
    tasks = ["terminal-hello-file", "editor-save-new-file", "calc-add"]
    args = [sys.executable, str(REPO_ROOT / "run.py"), "--config", str(DEMO_VLM)]
    for s in (f"run.output_dir={tmp / 'results'}", f"model_pool.state_dir={tmp / 'pool'}",
              f"model_pool.checkpoint={model_dir}", f"desktops.local.state_dir={tmp / 'd'}",
              f"tasks.task_ids={json.dumps(tasks)}", "tasks.rollouts_per_task=2",
              "runner.max_steps=6", "ray.include_dashboard=false"):
        args += ["--set", s]
    started = time.monotonic()
    done = subprocess.run(args, cwd=REPO_ROOT, capture_output=True, text=True,
                          timeout=RUN_TIMEOUT_S)
    wall_s = time.monotonic() - started
    assert done.returncode == 0, done.stderr[-4000:]
    assert "model pool: ready after" in done.stderr

    run_dir = tmp / "results" / "demo_vlm"
    results = [json.loads(x) for x in (run_dir / "results.jsonl").read_text().splitlines()]
    assert sorted((r["task_id"], r["rollout"]) for r in results) == sorted(
        (t, k) for t in tasks for k in range(2))
    image_pad = _token_id(model_dir, "<|image_pad|>")
    per_image = image_tokens(1280, 720)                       # 1196: 728x1288 seen
    steps_seen = 0
    model_s: list[float] = []
    for r in results:
        assert r["status"] in SCORED_STATUSES, r  # no infrastructure error
        assert r["model_version"] and r["model_version"].startswith("tiny-vlm-"), r
        episode = run_dir / r["domain"] / r["task_id"] / str(r["rollout"])
        steps = [json.loads(x) for x in (episode / "traj.jsonl").read_text().splitlines()]
        previous_tokens = 0
        for i, s in enumerate(steps, start=1):
            steps_seen += 1
            model_s.append(s["timing"]["model_s"])
            assert s["constrained"] is True
            assert s["parse_retries"] == 0 and s["actions"], s["response"]  # the grammar holds
            assert re.fullmatch(action_regex(1280, 720), s["response"]), s["response"]
            images = min(i, 5)                                 # agent.history_images: 5
            # The images of the history window are in the prompt, as image placeholders.
            assert s["prompt_token_ids"].count(image_pad) == images * per_image
            assert s["prompt_tokens"] == len(s["prompt_token_ids"])
            if i <= 5:  # one more image each step: at least its tokens more
                assert s["prompt_tokens"] - previous_tokens >= per_image + IMAGE_WRAPPER_TOKENS
            previous_tokens = s["prompt_tokens"]
            assert len(s["token_ids"]) == s["completion_tokens"] == len(s["logprobs"])
            assert all(isinstance(p, float) and p <= 0.0 for p in s["logprobs"])
    assert steps_seen >= 6
    assert not list((tmp / "d").glob("*/session.json")), "desktops left running"
    pool_state = json.loads((tmp / "pool" / "endpoints.json").read_text())
    assert pool_state["supervisor"] is None and pool_state["endpoints"] == []  # stopped
    # Utilization during the run: the real vLLM's /metrics, the supervisor's replicas.
    samples = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    servers = [e for x in samples for e in (x.get("model_servers") or {}).get("endpoints", [])]
    assert servers and all(e["up"] for e in servers), servers[:3]
    assert any(e["kv_cache_usage"] is not None for e in servers)
    assert any((e["generation_tokens_per_s"] or 0) > 0 for e in servers)
    assert any((e["mean_inference_time_s"] or 0) > 0 for e in servers)
    fleets = [x["fleet"] for x in samples if x.get("fleet")]
    assert fleets and max(f["replicas"].get("serving", 0) for f in fleets) >= 1
    assert any((x.get("utilization") or {}).get("desktop") for x in samples)
    print(f"\nvlm demo: {len(results)} episodes, {steps_seen} steps in {wall_s:.0f} s; "
          f"model time per step median {statistics.median(model_s):.2f} s")


def _token_id(model_dir: Path, token: str) -> int:
    return json.loads((model_dir / "tokenizer.json").read_text())["model"]["vocab"][token]


# --------------------------------------------------------------------------- one pool


@pytest.fixture
def pool(tiny_vlm) -> tuple[Config, str]:
    """The session's tiny-VLM pool (tests/integration/conftest.py): its config and URL; its
    last extra argument is the directory screenshots may be sent from by path."""
    return tiny_vlm.cfg, tiny_vlm.url


def _chat(url: str, cfg: Config, shots: list[Screenshot], **extra: Any) -> dict[str, Any]:
    body = {"model": cfg.model.name, "messages": _messages(shots), "max_tokens": 4,
            "temperature": 1.0, **extra}
    r = httpx.post(url + "/v1/chat/completions", json=body, timeout=300)
    assert r.status_code == 200, r.text
    return r.json()


def test_the_parser_resizes_as_the_server_did_for_every_configured_screen(pool):
    cfg, url = pool
    base = _chat(url, cfg, [])["usage"]["prompt_tokens"]
    for width, height in _screen_sizes():
        shot = Screenshot(_png(width, height, seed=width))
        seen = _chat(url, cfg, [shot])["usage"]["prompt_tokens"] - base - IMAGE_WRAPPER_TOKENS
        h, w = smart_resize(height, width)
        assert seen == image_tokens(width, height) == (h // 28) * (w // 28), (width, height)
        # So a point the model writes in that frame lands where it pointed on the screen.
        parsed = parse_response(f"Action: click(start_box='({w // 2},{h // 2})')",
                                width, height)
        assert parsed.actions[0].point == (round(width / 2), round(height / 2))


def test_prompt_tokens_grow_with_each_image_up_to_the_history_window(pool):
    cfg, url = pool
    shots = [Screenshot(_png(1280, 720, seed=i)) for i in range(5)]
    tokens = [_chat(url, cfg, shots[:k])["usage"]["prompt_tokens"] for k in range(1, 6)]
    per_image = image_tokens(1280, 720) + IMAGE_WRAPPER_TOKENS
    assert [b - a for a, b in itertools.pairwise(tokens)] == [per_image] * 4
    # One more image than the window is refused by the server (--limit-mm-per-prompt 5).
    r = httpx.post(url + "/v1/chat/completions", timeout=300, json={
        "model": cfg.model.name, "messages": _messages(shots + shots[:1]), "max_tokens": 4})
    assert r.status_code == 400 and "image" in r.text.lower()
    # Latency with images the server has not seen (no prefix or encoder cache hit).
    latency = {}
    for k in (1, 5):
        fresh = [Screenshot(_png(1280, 720, seed=1000 * k + i)) for i in range(k)]
        t0 = time.monotonic()
        _chat(url, cfg, fresh, max_tokens=50)
        latency[k] = time.monotonic() - t0
    print(f"\nprompt tokens 1..5 images: {tokens}; latency (50 tokens out) 1 image "
          f"{latency[1]:.2f} s, 5 images {latency[5]:.2f} s")


def test_screenshots_sent_by_path_are_read_by_the_server(pool):
    """``model.images: file``: vLLM reads each ``file://`` screenshot under its
    ``--allowed-local-media-path`` (the run directory): the same prompt as the same images
    sent inline, token for token. One outside it is refused with the server's reason."""
    cfg, url = pool
    run_dir = Path(cfg.model_pool.extra_args[-1])
    episode = run_dir / ".attempts" / "d%2Ft%2F0.0.abc"  # as staging names are
    episode.mkdir(parents=True)
    inline = [Screenshot(_png(1280, 720, seed=70 + i)) for i in range(3)]
    by_path = []
    for i, shot in enumerate(inline):
        path = episode / f"step_{i}.png"
        path.write_bytes(shot.png or b"")
        by_path.append(Screenshot(shot.png, file_url=path.as_uri()))
        by_path[-1].forget_png()
        assert "data_url" not in by_path[-1].__dict__   # never encoded
    a = _chat(url, cfg, inline, return_token_ids=True, max_tokens=1)
    b = _chat(url, cfg, by_path, return_token_ids=True, max_tokens=1)
    assert a["usage"]["prompt_tokens"] == b["usage"]["prompt_tokens"] > 3 * image_tokens(
        1280, 720)
    assert a["prompt_token_ids"] == b["prompt_token_ids"]

    async def outside() -> None:
        elsewhere = run_dir.parent / "elsewhere.png"
        elsewhere.write_bytes(inline[0].png or b"")
        shot = Screenshot(None, file_url=elsewhere.as_uri())
        client = ModelServicePool(cfg.model, cfg.model_pool.state_dir)
        try:
            with pytest.raises(ModelRequestError, match="allowed-local-media-path"):
                await client.generate(_messages([shot]), "s-outside")
        finally:
            await client.close()

    asyncio.run(outside())


def _generate_many(cfg: Config, shots: list[Screenshot], n: int, regex: str | None
                   ) -> list[tuple[str, float]]:
    async def go() -> list[tuple[str, float]]:
        client = ModelServicePool(cfg.model, cfg.model_pool.state_dir)
        out = []
        try:
            for i in range(n):
                window = shots[i % len(shots): i % len(shots) + 1 + i % 3]
                t0 = time.monotonic()
                g = await client.generate(_messages(window, "Open the text editor."),
                                          f"s{i}", regex=regex)
                out.append((g.text, time.monotonic() - t0))
        finally:
            await client.close()
        return out

    return asyncio.run(go())


def test_with_the_grammar_every_reply_parses(pool):
    cfg, _ = pool
    shots = [Screenshot(_png(1280, 720, seed=i)) for i in range(6)]
    regex = action_regex(1280, 720)
    replies = _generate_many(cfg, shots, 50, regex)
    (h, w) = smart_resize(720, 1280)
    for text, _ in replies:
        assert re.fullmatch(regex, text), text
        parsed = parse_response(text, 1280, 720)
        assert len(parsed.actions) == 1
        mp = parsed.actions[0].model_point
        if mp is not None:
            assert 0 <= mp[0] < w and 0 <= mp[1] < h
    kinds = {parse_response(t, 1280, 720).actions[0].kind for t, _ in replies}
    assert len(kinds) >= 3, kinds  # a random policy under the grammar: varied actions
    print(f"\nconstrained: 50/50 parsed; kinds {sorted(kinds)}; median latency "
          f"{statistics.median(s for _, s in replies):.2f} s")


class _RecordingProxy:
    """Between the run and the real vLLM server: forwards every request and keeps each
    completion's raw reply, so the test compares what was stored with what the server
    itself answered (nothing re-tokenized, nothing lost)."""

    def __init__(self, upstream: str) -> None:
        self.replies: list[dict[str, Any]] = []
        app = FastAPI()

        @app.api_route("/{path:path}", methods=["GET", "POST"])
        async def forward(path: str, request: Request) -> Response:
            async with httpx.AsyncClient(timeout=300) as client:
                r = await client.request(
                    request.method, f"{upstream}/{path}", content=await request.body(),
                    headers={k: v for k, v in request.headers.items()
                             if k.lower() in ("authorization", "content-type")})
            if path.endswith("chat/completions") and r.status_code == 200:
                self.replies.append(r.json())
            return Response(r.content, r.status_code,
                            media_type=r.headers.get("content-type"))

        self.server = ThreadedServer(app).start()

    def stop(self) -> None:
        self.server.stop()


def test_without_the_grammar_unparseable_replies_take_the_parse_failure_path(pool, tmp):
    """A run against the pool without the grammar: the random model's replies do not
    parse, are asked again, and the episode ends as UI-TARS agents end it (FAIL). Through
    a recording proxy: every step's and every dropped reply's prompt ids, completion ids and
    logprobs in traj.jsonl are exactly one reply of the server, and every reply is there."""
    cfg, url = pool
    shots = [Screenshot(_png(1280, 720, seed=i)) for i in range(3)]
    replies = _generate_many(cfg, shots, 20, None)
    failures = 0
    for text, _ in replies:
        try:
            parse_response(text, 1280, 720)
        except ActionParseError:
            failures += 1
    assert failures >= 15, [t for t, _ in replies]
    print(f"\nunconstrained: {20 - failures}/20 parsed")

    proxy = _RecordingProxy(url)
    try:
        args = [sys.executable, str(REPO_ROOT / "run.py"), "--config", str(DEMO_VLM)]
        for s in (f"run.output_dir={tmp / 'results'}",
                  f"model.endpoints=[\"{proxy.server.url}\"]",
                  "model_pool.start_with_run=false", "agent.constrain_actions=false",
                  f"desktops.local.state_dir={tmp / 'd'}", "tasks.task_ids=[\"calc-add\"]",
                  "agent.max_parse_retries=2", "ray.include_dashboard=false"):
            args += ["--set", s]
        done = subprocess.run(args, cwd=REPO_ROOT, capture_output=True, text=True,
                              timeout=RUN_TIMEOUT_S)
    finally:
        proxy.stop()
    assert done.returncode == 0, done.stderr[-4000:]
    run_dir = tmp / "results" / "demo_vlm"
    (result,) = [json.loads(x) for x in (run_dir / "results.jsonl").read_text().splitlines()]
    assert result["status"] in SCORED_STATUSES, (result["error"], done.stderr[-3000:])
    episode = run_dir / result["domain"] / result["task_id"] / "0"
    steps = [json.loads(x) for x in (episode / "traj.jsonl").read_text().splitlines()]
    assert all(s["constrained"] is False for s in steps)
    unparsed = [s for s in steps if not s["actions"]]
    assert unparsed, steps  # at least one step's replies never parsed ...
    assert unparsed[-1] is steps[-1] and unparsed[-1]["parse_retries"] == 2
    assert result["last_action"] == "FAIL" and result["status"] in (  # ... and ended it
        Status.FAILURE.value, Status.SUCCESS.value)

    # The version is what the server says it loaded (vLLM's root), not the served name.
    checkpoint = str(cfg.model_pool.checkpoint)
    assert result["model_version"] == result["first_model_version"] == checkpoint
    assert result["model_versions"] == [checkpoint] and result["mixed_versions"] is False

    def raw(reply: dict[str, Any]) -> tuple[Any, ...]:
        choice = reply["choices"][0]
        return (choice["message"]["content"], reply["prompt_token_ids"], choice["token_ids"],
                [t["logprob"] for t in choice["logprobs"]["content"]])

    def stored(g: dict[str, Any]) -> tuple[Any, ...]:
        return g["response"], g["prompt_token_ids"], g["token_ids"], g["logprobs"]

    generations = [g for s in steps for g in (*s.get("discarded", []), s)]
    assert sum(len(s.get("discarded", [])) for s in steps) == sum(
        s["parse_retries"] for s in steps) > 0  # dropped replies are kept, marked
    assert all(d["error"] and d["model_version"] == checkpoint
               for s in steps for d in s.get("discarded", []))
    assert sorted(map(repr, map(stored, generations))) == sorted(
        map(repr, map(raw, proxy.replies)))  # each reply once, exactly as the server sent it
    # The trainer's export carries the same ids and logprobs, step by step.
    export_file = tmp / "steps.jsonl"
    with TrainingIndex(default_url(run_dir)) as index:
        assert export(export_file, index, per="step") == len(steps)
    rows = [json.loads(x) for x in export_file.read_text().splitlines()]
    assert [(r["step_num"], r["prompt_token_ids"], r["token_ids"], r["logprobs"],
             r["reward"], len(r["discarded"])) for r in rows] == [
        (s["step_num"], s["prompt_token_ids"], s["token_ids"], s["logprobs"],
         result["reward"], len(s.get("discarded", []))) for s in steps]
    per_image = image_tokens(1280, 720)
    for s in steps:
        assert [i["tokens"] for i in s["images"]] == [per_image] * len(s["images"])
        assert all((episode / i["file"]).is_file() for i in s["images"])
        spans = s["image_spans"]
        assert len(spans) == len(s["images"]) and all(n == per_image for _, n in spans)
        pad = {s["prompt_token_ids"][a] for a, _ in spans}
        assert len(pad) == 1 and all(
            s["prompt_token_ids"][a:a + n] == [*pad] * n for a, n in spans)


def test_a_request_longer_than_the_served_context_is_not_sent(pool):
    cfg, url = pool
    served = httpx.get(url + "/v1/models", timeout=30).json()["data"][0]["max_model_len"]
    assert served == RequestShape.of(cfg).budget()  # derived from the run's settings
    shots = [Screenshot(_png(1280, 720, seed=1))]

    async def go() -> None:
        client = ModelServicePool(cfg.model, cfg.model_pool.state_dir)
        try:
            with pytest.raises(ContextTooShort) as caught:
                await client.generate(_messages(shots), "s", least_tokens=(
                    served + 1, "a request one token longer than the context"))
            assert caught.value.fatal and str(served) in str(caught.value)
            assert client.stats()["endpoints"][0]["served"] == 0  # nothing was sent
            g = await client.generate(_messages(shots), "s", least_tokens=(served, "fits"))
            assert g.prompt_tokens > image_tokens(1280, 720)
        finally:
            await client.close()

    asyncio.run(go())


def test_the_pool_config_child_reads_is_the_runs(tmp):
    """run.py hands its own config to run_model.py (model_pool.yaml in the run dir)."""
    cfg = _config(tmp, "model_pool.checkpoint=/nonexistent/model")
    child = PoolChild(cfg, tmp, report=lambda line: None)
    child.start()
    try:
        with pytest.raises(Exception) as caught:
            child.wait_ready()
        assert "exited with code 2" in str(caught.value)
        assert "/nonexistent/model" in str(caught.value)  # the supervisor's own error
    finally:
        child.stop()
    written = yaml.safe_load((tmp / "model_pool.yaml").read_text())
    assert Config.model_validate(written) == cfg
