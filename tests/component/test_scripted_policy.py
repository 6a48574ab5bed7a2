"""The scripted UI-TARS policy over real HTTP, driven by the real model client, prompt
builder and parser, on synthetic tasks."""

from __future__ import annotations

import io
import json
import time

import pytest
from PIL import Image

from cua_rollout.agents.scripted_policy import ScriptedPolicy, load_solutions, scripted_server
from cua_rollout.agents.uitars import parse_response, to_pyautogui
from cua_rollout.agents.uitars.prompt import Turn, build_messages
from cua_rollout.config import ModelConfig
from cua_rollout.core.errors import ConfigError
from cua_rollout.core.screenshot import Screenshot
from cua_rollout.model.client import ModelServicePool
from cua_rollout.model.openai_protocol import ChatCompletion, ErrorReply, parse_chat_completion

SOLUTION = [
    "Thought: Open the editor.\nAction: click(start_box='(100,200)')",
    "Thought: Type the text.\nAction: type(content='hello\\n')",
    "Thought: Done.\nAction: finished(content='')",
]


def write_tasks(root):
    (root / "examples" / "editor").mkdir(parents=True)
    task = {"id": "t1", "instruction": "Write hello in the editor", "config": [],
            "evaluator": {"func": "infeasible"}, "reference_solution": SOLUTION}
    (root / "examples" / "editor" / "t1.json").write_text(json.dumps(task))
    (root / "examples" / "editor" / "nosolution.json").write_text(
        json.dumps({"id": "t2", "instruction": "x"}))
    (root / "test_all.json").write_text(json.dumps({"editor": ["t1", "t2"]}))
    (root / "broken.json").write_text("{not json")
    return root


def png() -> Screenshot:
    buf = io.BytesIO()
    Image.new("RGB", (64, 36)).save(buf, format="PNG")
    return Screenshot(buf.getvalue())


@pytest.fixture
def served(tmp_path):
    servers = []

    def serve(**kw) -> str:
        policy = ScriptedPolicy(load_solutions([write_tasks(tmp_path)]), **kw)
        server = scripted_server(policy).start()
        servers.append(server)
        return server.url

    yield serve
    for server in servers:
        server.stop()


def test_load_solutions_skips_lists_and_broken_files(tmp_path):
    assert load_solutions([write_tasks(tmp_path)]) == {"Write hello in the editor": SOLUTION}
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"instruction": "y", "reference_solution": "not a list"}))
    with pytest.raises(ConfigError, match=r"bad\.json: reference_solution must be a list"):
        load_solutions([bad])


async def test_replays_the_solution_step_by_step_through_the_real_client(served):
    pool = ModelServicePool(ModelConfig(endpoints=[served()]))
    history: list[Turn] = []
    codes = []
    try:
        for _ in range(len(SOLUTION) + 1):
            shot = png()
            messages = build_messages("Write hello in the editor", history, shot)
            gen = await pool.generate(messages, "episode-1")
            parsed = parse_response(gen.text, 1280, 720)
            codes.append(to_pyautogui(parsed.actions))
            history.append(Turn(shot, gen.text))
    finally:
        await pool.close()
    assert [t.response for t in history[:3]] == SOLUTION
    assert codes[0] == "pyautogui.click(99, 198, button='left')"  # 100/1288*1280, 200/728*720
    assert codes[2] == "DONE" and codes[3] == "DONE"  # past the end it keeps finishing


async def test_unknown_instruction_calls_the_user(served):
    pool = ModelServicePool(ModelConfig(endpoints=[served()]))
    try:
        gen = await pool.generate(build_messages("Something else", [], png()), "e")
    finally:
        await pool.close()
    assert to_pyautogui(parse_response(gen.text, 1280, 720).actions) == "FAIL"


async def test_error_rate_injects_parseable_mistakes(served):
    pool = ModelServicePool(ModelConfig(endpoints=[served(error_rate=1.0, seed=3)]))
    kinds = set()
    try:
        for i in range(20):
            gen = await pool.generate(build_messages("Write hello in the editor", [], png()),
                                      f"e{i}")
            kinds.add(parse_response(gen.text, 1280, 720).actions[0].kind)
    finally:
        await pool.close()
    assert kinds == {"click", "finished"}


async def test_latency_is_added(tmp_path):
    policy = ScriptedPolicy(load_solutions([write_tasks(tmp_path)]))
    with scripted_server(policy, latency_s=0.3) as server:
        pool = ModelServicePool(ModelConfig(endpoints=[server.url]))
        try:
            started = time.monotonic()
            await pool.generate(build_messages("Write hello in the editor", [], png()), "e")
            assert time.monotonic() - started >= 0.3
        finally:
            await pool.close()


def test_bad_requests_get_openai_style_errors(tmp_path):
    import httpx

    policy = ScriptedPolicy({})
    with scripted_server(policy) as server:
        r = httpx.post(server.url + "/v1/chat/completions", content=b"nope",
                       headers={"Content-Type": "application/json"})
        assert r.status_code == 400 and "not JSON" in r.json()["message"]
        assert r.json() == {"object": "error", "message": "the request body is not JSON",
                            "type": "BadRequestError", "code": 400}
        r = httpx.post(server.url + "/v1/chat/completions", json={"messages": "x"})
        assert r.status_code == 400 and "messages" in r.json()["message"]
        assert ErrorReply.model_validate(r.json()).code == 400
        assert httpx.get(server.url + "/v1/models").json()["data"][0]["id"] == "scripted-ui-tars"
        assert httpx.get(server.url + "/health").status_code == 200


def test_replies_are_chat_completions_of_the_protocol(tmp_path):
    import httpx

    policy = ScriptedPolicy(load_solutions([write_tasks(tmp_path)]))
    with scripted_server(policy) as server:
        messages = build_messages("Write hello in the editor", [], png())
        r = httpx.post(server.url + "/v1/chat/completions", json={"messages": messages})
    completion = ChatCompletion.model_validate(r.json())
    assert completion.model == "scripted-ui-tars" and completion.id.startswith("chatcmpl-")
    reply = parse_chat_completion(r.json())
    assert reply.text == SOLUTION[0] and reply.finish_reason == "stop"
    assert reply.completion_tokens == len(SOLUTION[0].split()) and reply.prompt_tokens == 0
