"""The benchmarks' simulated world speaks the real protocols to the real clients: the desktop
client and static provider of env_k8s.py, the model client of model_service_pool.py."""

from __future__ import annotations

import asyncio
import io
import json
import os
import select
import signal
import socket
import statistics
import subprocess
import sys
import time

import httpx
import psutil
import pytest

from benchmarks.sim_world import (
    RESET_COMMAND,
    DesktopSim,
    EpisodeLengths,
    Latency,
    ModelApp,
    ModelSim,
    SimWorld,
    sim_reply,
    summarize_request,
)
from cua_rollout.agents.uitars import parse_response
from cua_rollout.agents.uitars.prompt import Turn, build_messages
from cua_rollout.config import DesktopsConfig, ModelConfig, SamplingConfig, StaticDesktopsConfig
from cua_rollout.core.screenshot import Screenshot, png_size
from cua_rollout.core.vision import smart_resize
from cua_rollout.envs.client import RemoteDesktopEnv, close_shared_client
from cua_rollout.envs.providers import Desktop
from cua_rollout.envs.providers.static import StaticProvider
from cua_rollout.model.client import ModelServicePool
from tests.support import REPO_ROOT

SIM_WORLD = REPO_ROOT / "benchmarks" / "sim_world.py"
ACTION_S = 0.2
RESET_S = 0.3
BASE_S = 0.05
SLOW = 4.0  # speed factor of the second model server


def _png(seed: int) -> Screenshot:
    """A small but valid 1920x1080 PNG (the sim counts images, not bytes)."""
    from PIL import Image

    out = io.BytesIO()
    Image.new("RGB", (1920, 1080), (seed % 256, 90, 160)).save(out, "PNG")
    return Screenshot(out.getvalue())


def _body(messages: list[dict], compact: bool = False, **extra: object) -> bytes:
    """A request body serialised the way ModelServicePool does (or compactly)."""
    body = {"model": "m", "messages": messages, "temperature": 0.7, "max_tokens": 500, **extra}
    if compact:
        return json.dumps(body, separators=(",", ":")).encode()
    return json.dumps(body).encode()


# --------------------------------------------------------------------------- pure behaviour


def test_episode_lengths_are_deterministic_with_a_long_tail():
    lengths = EpisodeLengths()
    draws = [lengths.draw(f"sim task {i}") for i in range(1000)]
    assert draws == [lengths.draw(f"sim task {i}") for i in range(1000)]
    assert lengths.draw(" sim task 3\n") == lengths.draw("sim task 3")
    median = statistics.median(draws)
    assert 5 <= median <= 15
    assert max(draws) > 2 * median
    assert sum(d >= 30 for d in draws) >= 20  # a real tail, not one outlier
    assert min(draws) >= lengths.min_steps and max(draws) <= lengths.max_steps
    assert [EpisodeLengths(seed=1).draw(f"sim task {i}") for i in range(50)] != draws[:50]
    assert [EpisodeLengths(max_steps=12).draw(f"sim task {i}") for i in range(50)] == [
        min(12, d) for d in draws[:50]
    ]


def test_replies_parse_as_ui_tars_and_finish_at_the_drawn_length():
    cfg = ModelSim()
    model_h, model_w = smart_resize(1080, 1920)
    kinds = set()
    for i in range(40):
        instruction = f"sim task {i}"
        n = cfg.lengths.draw(instruction)
        for step in range(n):
            text, tokens = sim_reply(instruction, step, cfg)
            assert tokens > 0 and f"[sim step {step + 1}/{n}]" in text
            parsed = parse_response(text, 1920, 1080)
            if step < n - 1:
                assert parsed.terminal is None and len(parsed.actions) == 1
                action = parsed.actions[0]
                kinds.add(action.kind)
                if action.model_point is not None:
                    x, y = action.model_point
                    assert 0 <= x < model_w and 0 <= y < model_h
                    assert 0 <= action.point[0] < 1920 and 0 <= action.point[1] < 1080
            else:
                assert parsed.terminal == "finished"
                assert text.endswith("Action: finished(content='')")
    assert kinds == {"click", "type", "scroll", "hotkey"}


@pytest.mark.parametrize("compact", [False, True])
def test_raw_request_summary_agrees_with_a_full_json_parse(compact):
    shots = [_png(i) for i in range(3)]
    cfg = ModelSim()
    instructions = ["sim task 7", 'say "hi" \\ now', "two\nlines", "café ✓ — 表", "x"]
    for instruction in instructions:
        for steps in (0, 1, 4, 9):
            history = [Turn(shots[i % 3], sim_reply(instruction, i, cfg)[0])
                       for i in range(steps)]
            messages = build_messages(instruction, history, shots[steps % 3],
                                      history_images=5, history_texts=35)
            for extra in ({}, {"logprobs": True, "return_token_ids": True}):
                raw = _body(messages, compact, **extra)
                summary = summarize_request(raw)
                full = json.loads(raw)
                prompt = full["messages"][1]["content"][0]["text"]
                assert summary.instruction == prompt.split("## User Instruction\n")[1].strip()
                assert summary.instruction == instruction.strip()
                assert summary.assistant_turns == sum(
                    m["role"] == "assistant" for m in full["messages"])
                assert summary.images == sum(
                    p.get("type") == "image_url"
                    for m in full["messages"] if isinstance(m["content"], list)
                    for p in m["content"])
                assert summary.last_step == (steps or None)
                assert summary.logprobs == summary.return_token_ids == bool(extra)
                assert not summary.full_parse
                assert summarize_request(bytearray(raw)) == summary


def test_summary_keeps_counting_steps_past_the_text_window_and_parses_foreign_prompts():
    cfg = ModelSim()
    shot = _png(0)
    history = [Turn(shot, sim_reply("sim task 1", i, cfg)[0]) for i in range(10)]
    raw = _body(build_messages("sim task 1", history, shot, history_texts=3))
    summary = summarize_request(raw)
    assert summary.assistant_turns == 3 and summary.last_step == 10
    foreign = _body(build_messages("ignored", [], shot, prompt="Do the foreign thing"))
    summary = summarize_request(foreign)
    assert summary.full_parse and summary.instruction == "Do the foreign thing"


def test_model_latency_grows_with_speed_factor_tokens_and_load():
    cfg = ModelSim(base_latency_s=0.1, per_token_s=0.01, prefill_s_per_1k_tokens=0.0,
                   capacity=2, speed_factors=(1.0, 2.0))
    body = _body(build_messages("sim task 5", [], _png(0)))
    fast, slow = ModelApp(cfg, 0), ModelApp(cfg, 1)
    replies = [fast.handle(b"POST", b"/v1/chat/completions", body) for _ in range(4)]
    tokens = json.loads(replies[0].body)["usage"]["completion_tokens"]
    one = 0.1 + 0.01 * tokens
    assert [r.delay_s for r in replies] == pytest.approx([one, one, 1.5 * one, 2 * one])
    assert slow.handle(b"POST", b"/v1/chat/completions", body).delay_s == pytest.approx(2 * one)
    for r in replies:
        r.done()
    assert fast.in_flight == 0 and fast.max_in_flight == 4
    assert fast.stats()["sessions"] == {"sim task 5": [0, 0, 0, 0]}


# --------------------------------------------------------------------------- over real sockets


@pytest.fixture(scope="module")
def world():
    sim = SimWorld(
        desktops=4, model_servers=2, desktop_workers=2,
        desktop=DesktopSim(action_latency=Latency(ACTION_S), reset_latency=Latency(RESET_S),
                           setup_latency=Latency(0.0), screenshots=4),
        model=ModelSim(base_latency_s=BASE_S, per_token_s=0.0, prefill_s_per_1k_tokens=0.0,
                       speed_factors=(1.0, SLOW)),
    )
    with sim:
        yield sim


def _desktops_cfg(world: SimWorld) -> DesktopsConfig:
    return DesktopsConfig(
        provider="static", count=len(world.desktop_urls),
        static=StaticDesktopsConfig(urls=world.desktop_urls, reset_command=world.reset_command),
        verify={"enabled": False},  # simulated desktops run no real commands
    )


@pytest.mark.integration
async def test_the_real_desktop_client_observes_acts_and_sets_up(world):
    cfg = _desktops_cfg(world)
    env = RemoteDesktopEnv(world.desktop_urls[1], cfg)
    try:
        shots = [await env.observe() for _ in range(2)]
        for shot in shots:
            assert shot.size == png_size(shot.png) == (1920, 1080)
            assert len(shot.png) >= 100_000
        assert shots[0].png != shots[1].png
        result = await env.step("pyautogui.click(100, 200)")
        assert result.ok and result.returncode == 0 and result.duration_s >= ACTION_S
        assert await env.execute(["echo", "hi"]) == {
            "status": "success", "output": "", "error": "", "returncode": 0}
        assert await env.cursor_position() == (960, 540)
        assert await env.health()
        first = await env.reset({"id": "t1", "config": [
            {"type": "launch", "parameters": {"command": ["xterm"]}},
            {"type": "execute", "parameters": {"command": "true", "shell": True,
                                               "until": {"returncode": 0}}},
        ]})
        assert first.size == (1920, 1080)
    finally:
        await close_shared_client()
    counts = world.stats()["desktops"]["per_desktop"]["1"]
    assert counts["screenshot"] >= 3 and counts["action"] >= 2 and counts["setup"] == 2
    assert counts["health"] >= 1 and counts["query"] >= 1
    with httpx.Client() as client:
        assert client.get(world.desktop_urls[1] + "/platform").text == "Linux"
        assert client.post(world.desktop_urls[1] + "/screen_size").json() == {
            "width": 1920, "height": 1080}
        assert client.get(world.desktop_urls[1] + "/nowhere").status_code == 404
        # A desktop index served by the other worker, or none at all, is not found.
        other = world.desktop_urls[0].rsplit("/d/", 1)[0] + "/d/1/screenshot"
        assert client.get(other).status_code == 404


@pytest.mark.integration
async def test_static_provider_reset_is_recognised_and_overlaps_are_counted(world):
    cfg = _desktops_cfg(world)
    provider = StaticProvider(cfg)
    try:
        desktop = await provider.start(2)
        assert isinstance(desktop, Desktop)
        started = time.monotonic()
        await provider.reset(desktop)
        assert time.monotonic() - started >= RESET_S
        env = RemoteDesktopEnv(world.desktop_urls[3], cfg)
        # Two actions at once on one desktop: what a double lease would look like.
        await asyncio.gather(env.step("pyautogui.press('a')"), env.step("pyautogui.press('b')"))
    finally:
        await close_shared_client()
    stats = world.stats()["desktops"]
    assert stats["per_desktop"]["2"]["reset"] == 1
    assert stats["overlaps_per_desktop"].get("3") == 1
    assert "2" not in stats["overlaps_per_desktop"]
    assert world.reset_command == RESET_COMMAND


@pytest.mark.integration
async def test_the_real_model_pool_plays_episodes_to_their_drawn_length(world):
    cfg = ModelConfig(name="sim", endpoints=world.model_urls,
                      routing="sticky_least_outstanding",
                      sampling=SamplingConfig(logprobs=True, return_token_ids=True))
    pool = ModelServicePool(cfg)
    shots = [_png(i) for i in range(3)]
    lengths = world.model.lengths
    instructions = [f"sim test episode {i}" for i in range(3)]
    try:
        async def play(instruction: str) -> int:
            history: list[Turn] = []
            for step in range(lengths.max_steps):
                messages = build_messages(instruction, history, shots[step % 3],
                                          history_texts=4)
                gen = await pool.generate(messages, session_id=instruction)
                assert gen.model_version == world.model.model
                assert gen.prompt_tokens > 0 and gen.completion_tokens > 0
                assert gen.logprobs and gen.token_ids
                parsed = parse_response(gen.text, 1920, 1080)
                if parsed.terminal == "finished":
                    return step + 1
                assert parsed.terminal is None
                history.append(Turn(shots[step % 3], gen.text))
            return -1

        played = await asyncio.gather(*(play(i) for i in instructions))
    finally:
        await pool.close()
    assert played == [lengths.draw(i) for i in instructions]
    sessions = world.stats()["sessions"]
    for instruction, n in zip(instructions, played, strict=True):
        s = sessions[instruction]
        assert s["requests"] == n and s["last_step"] == n - 1
        assert s["switches"] == 0 and s["first_server"] == s["last_server"]


@pytest.mark.integration
def test_model_server_latency_and_protocol(world):
    body = _body(build_messages("sim task 9", [], _png(1)))
    with httpx.Client(timeout=10) as client:
        for url, factor in zip(world.model_urls, (1.0, SLOW), strict=True):
            started = time.monotonic()
            r = client.post(url + "/v1/chat/completions", content=body,
                            headers={"content-type": "application/json"})
            assert time.monotonic() - started >= BASE_S * factor
            reply = r.json()
            assert reply["object"] == "chat.completion" and reply["model"] == world.model.model
            assert reply["usage"]["total_tokens"] == (
                reply["usage"]["prompt_tokens"] + reply["usage"]["completion_tokens"])
            assert client.get(url + "/health").status_code == 200
            assert client.get(url + "/v1/models").json()["data"][0]["id"] == world.model.model
    # The raw HTTP layer refuses what it cannot parse instead of hanging.
    host, port = world.model_urls[0].removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=5) as sock:
        sock.sendall(b"GARBAGE\r\n\r\n")
        assert sock.recv(100).startswith(b"HTTP/1.1 400")


@pytest.mark.integration
def test_stop_ends_every_process_and_frees_ports_and_temp_files():
    sim = SimWorld(desktops=3, model_servers=2, desktop_workers=2, model_workers=2,
                   desktop=DesktopSim(screenshots=2, rich_screenshots=False))
    sim.start()
    pids = sim.pids
    ports = [int(u.split(":")[2].split("/")[0]) for u in sim.desktop_urls + sim.model_urls]
    tmp = sim._tmp
    assert len(pids) == 4 and tmp is not None and tmp.exists()
    assert all(psutil.pid_exists(p) for p in pids)
    sim.stop()
    assert not any(psutil.pid_exists(p) for p in pids)
    assert not tmp.exists()
    for port in set(ports):
        with pytest.raises(OSError), socket.create_connection(("127.0.0.1", port), timeout=2):
            pass


def _serve(*args: str) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, str(SIM_WORLD), "serve", *args], cwd=REPO_ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)


@pytest.mark.integration
def test_serve_prints_where_the_world_serves_and_stops_it_at_sigterm():
    proc = _serve("--desktops", "2", "--model-servers", "1", "--desktop",
                  json.dumps({"rich_screenshots": False, "screenshots": 1}),
                  "--model", json.dumps({"model": "served", "lengths": {"median_steps": 2}}))
    try:
        assert proc.stdout is not None
        ready, _, _ = select.select([proc.stdout], [], [], 60)
        assert ready, "serve printed nothing within 60 s"
        world = json.loads(proc.stdout.readline())
        assert [u.rsplit("/", 1)[1] for u in world["desktop_urls"]] == ["0", "1"]
        assert world["reset_command"] == RESET_COMMAND and len(world["model_urls"]) == 1
        shot = httpx.get(world["desktop_urls"][1] + "/screenshot", timeout=10)
        assert png_size(shot.content) == (1920, 1080)
        models = httpx.get(world["model_urls"][0] + "/v1/models", timeout=10).json()
        assert [m["id"] for m in models["data"]] == ["served"]  # the --model settings hold
        pids = world["pids"]
        assert len(pids) == 2 and all(psutil.pid_exists(p) for p in pids)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
        assert not any(psutil.pid_exists(p) for p in pids)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
        for pipe in (proc.stdout, proc.stderr):
            if pipe is not None:
                pipe.close()


def test_serve_names_a_setting_that_does_not_exist():
    proc = _serve("--model", json.dumps({"speed": 2}))
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 2
    assert "--model: ModelSim has no field speed" in err
