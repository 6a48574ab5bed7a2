"""Qwen-VL's computer-use agent (cua_rollout/agents/qwen.py): the computer_use tool offered
as OpenAI tools or described in the prompt, calls read from tool_calls or inline
<tool_call> text, coordinates in the resized screenshot's pixels or 0..1000, the terminal
policy, the history window, and bad calls as parse failures keeping the reply."""

from __future__ import annotations

import io
import json

import pytest
from PIL import Image

from cua_rollout.agents.base import make_agent
from cua_rollout.agents.qwen import TOOL_NAME, tool_call_text
from cua_rollout.config import load_config
from cua_rollout.core.errors import ActionParseError
from cua_rollout.core.screenshot import Screenshot
from cua_rollout.core.types import DONE, FAIL, WAIT
from cua_rollout.core.vision import smart_resize
from tests.support import REPO_ROOT

W, H = 1280, 720
RH, RW = smart_resize(H, W)   # 728 x 1288: the frame of absolute coordinates


def _agent(*sets: str):
    cfg = load_config(REPO_ROOT / "configs" / "demo.yaml",
                      ["agent.name=qwen-computer-use", *sets])
    return make_agent(cfg.agent, instruction="Open the file.", max_tokens=100)


def _shot() -> Screenshot:
    out = io.BytesIO()
    Image.new("RGB", (W, H), (9, 9, 9)).save(out, "PNG")
    return Screenshot(out.getvalue())


def _calls(*arguments: dict) -> list[dict]:
    return [{"id": f"c{i}", "type": "function",
             "function": {"name": TOOL_NAME, "arguments": json.dumps(a)}}
            for i, a in enumerate(arguments)]


def test_the_request_offers_the_tool_in_the_resized_frame():
    agent = _agent()
    assert agent.action_format == "qwen_tool_call" and not agent.observes_a11y_tree
    shot = _shot()
    request = agent.request(shot)
    assert request.tool_choice == "auto" and len(request.tools) == 1
    tool = request.tools[0]["function"]
    assert tool["name"] == TOOL_NAME
    assert f"resolution is {RW}x{RH}" in tool["description"]
    assert {"left_click", "type", "key", "scroll", "wait", "terminate", "left_click_drag"} <= set(
        tool["parameters"]["properties"]["action"]["enum"])
    assert request.messages[1]["content"][0]["text"] == "## Task\nOpen the file."
    assert request.screenshots == [shot]
    relative = _agent("agent.qwen_computer_use.coordinates=relative").request(shot)
    assert "resolution is 1000x1000" in relative.tools[0]["function"]["description"]
    inline = _agent("agent.qwen_computer_use.send_tools=false").request(shot)
    assert inline.tools is None and '"name": "computer_use"' in inline.messages[0]["content"]


def test_calls_become_pyautogui_code_in_screen_pixels():
    agent = _agent()
    shot = _shot()
    agent.request(shot)
    reply = agent.parse("I click, then type.", shot, _calls(
        {"action": "left_click", "coordinate": [RW // 2, RH // 2]},
        {"action": "type", "text": "hi"},
        {"action": "key", "keys": ["Control", "s"]},
        {"action": "scroll", "pixels": -3, "coordinate": [0, 0]},
        {"action": "left_click_drag", "coordinate": [RW - 1, RH - 1]}))
    decision = agent.decide(reply)
    assert decision.code.split("\n") == [
        "pyautogui.click(640, 360, button='left')", "pyautogui.write('hi', interval=0.01)",
        "pyautogui.hotkey('ctrl', 's')", "pyautogui.scroll(-3, x=0, y=0)",
        "pyautogui.dragTo(1279, 719, duration=0.5, button='left')"]
    assert decision.terminal is None and decision.parse.thought == "I click, then type."
    assert decision.parse.actions[0]["screen_point"] == (640, 360)


def test_relative_coordinates_and_inline_calls():
    agent = _agent("agent.qwen_computer_use.coordinates=relative")
    shot = _shot()
    agent.request(shot)
    text = "Double click.\n" + tool_call_text({"action": "double_click",
                                               "coordinate": [500, 500]})
    reply = agent.parse(text, shot, None)
    assert agent.decide(reply).code == "pyautogui.doubleClick(640, 360, button='left')"
    assert reply.thought == "Double click."


@pytest.mark.parametrize(("arguments", "terminal"), [
    ({"action": "terminate", "status": "success"}, DONE),
    ({"action": "terminate", "status": "failure"}, FAIL),
    ({"action": "wait", "time": 2}, WAIT),
])
def test_terminal_calls(arguments, terminal):
    agent = _agent()
    shot = _shot()
    agent.request(shot)
    decision = agent.decide(agent.parse("", shot, _calls(
        {"action": "right_click", "coordinate": [1, 1]}, arguments,
        {"action": "left_click", "coordinate": [2, 2]})))
    assert decision[:2] == ("pyautogui.click(1, 1, button='right')", terminal)
    assert agent.decide(None)[:2] == (None, FAIL)


@pytest.mark.parametrize(("text", "calls", "error"), [
    ("I am done.", None, "calls no tool"),
    ("<tool_call>\n{\"name\": \"computer_use\", \"arguments\": {}}", None, "unclosed <tool_call>"),
    ("<tool_call>{not json}</tool_call>", None, "not JSON"),
    ("", [{"function": {"name": TOOL_NAME, "arguments": "{"}}], "arguments are not JSON"),
    ("", [{"nothing": 1}], "without a function"),
    ("", _calls({"action": "left_click", "coordinate": [1, 1], "speed": 3}),
     r"unknown argument\(s\) speed"),
    ("", [{"function": {"name": "browser", "arguments": "{}"}}], "unknown tool 'browser'"),
    ("", _calls({"action": "teleport"}), "unknown action 'teleport'"),
    ("", _calls({"action": "type"}), "type needs text"),
    ("", _calls({"action": "key", "keys": "ctrl+s"}), "keys must be a list"),
    ("", _calls({"action": "left_click", "coordinate": [RW, 5]}), "off the 1288x728 frame"),
    ("", _calls({"action": "left_click", "coordinate": [5, -1]}), "off the 1288x728 frame"),
    ("", _calls({"action": "left_click", "coordinate": "5,5"}), "coordinate must be"),
    ("", _calls({"action": "terminate", "status": "done"}), "status must be"),
    ("", _calls(*[{"action": "wait"}] * 6), "6 tool calls in one reply"),
])
def test_bad_calls_are_parse_failures_keeping_the_reply(text, calls, error):
    agent = _agent()
    shot = _shot()
    agent.request(shot)
    with pytest.raises(ActionParseError, match=error) as caught:
        agent.parse(text, shot, calls)
    assert caught.value.text  # the reply (or the call) is kept


def test_the_history_shows_past_calls_inline_and_the_last_screenshots():
    agent = _agent("agent.history_images=2")
    shots = [_shot() for _ in range(3)]
    for i, shot in enumerate(shots[:2]):
        agent.request(shot)
        agent.decide(agent.parse(f"step {i}", shot, _calls({"action": "left_click",
                                                             "coordinate": [i, i]})))
        assert agent.remember(shot, f"step {i}") is (shots[0] if i == 1 else None)
    request = agent.request(shots[2])
    roles = [m["role"] for m in request.messages]
    assert roles == ["system", "user", "assistant", "user", "assistant", "user"]
    assert request.messages[2]["content"] == "step 0\n" + tool_call_text(
        {"action": "left_click", "coordinate": [0, 0]})
    # The first screenshot left the window (history_images: 2).
    assert request.screenshots == shots[1:]
    assert request.messages[1]["content"][-1]["type"] == "text"
