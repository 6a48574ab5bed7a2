"""The UI-TARS agent of one episode (cua_rollout/agents/uitars/agent.py): its terminal policy
(what runs before a terminal action, call_user, unparseable replies), the request it builds
(images, grammar, the context it needs) and its history window; the registry by name."""

from __future__ import annotations

import io
import typing

import pytest
from PIL import Image

from cua_rollout.agents.base import AGENTS, agent_class, make_agent
from cua_rollout.agents.uitars import action_regex, parse_response
from cua_rollout.agents.uitars.agent import UITars10Agent, UITars15Agent
from cua_rollout.agents.uitars.coordinates import frame_of
from cua_rollout.agents.uitars.prompt import build_messages
from cua_rollout.config import AgentConfig, load_config
from cua_rollout.core.errors import ActionParseError, ConfigError
from cua_rollout.core.screenshot import Screenshot
from cua_rollout.core.types import DONE, FAIL, WAIT
from cua_rollout.core.vision import image_tokens
from tests.support import REPO_ROOT


def _png(width: int = 1280, height: int = 720) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (width, height), (40, 80, 120)).save(out, "PNG")
    return out.getvalue()


def _shot(width: int = 1280, height: int = 720) -> Screenshot:
    return Screenshot(_png(width, height))


def _agent(*sets: str, max_tokens: int = 500):
    cfg = load_config(REPO_ROOT / "configs" / "demo.yaml", list(sets))
    return make_agent(cfg.agent, instruction="do it", max_tokens=max_tokens)


def _parsed(action: str):
    return parse_response(f"Thought: x\nAction: {action}", 1280, 720)


def test_agents_are_registered_by_name_one_per_family():
    assert agent_class("uitars-1.5") is UITars15Agent
    assert agent_class("uitars-1.0") is UITars10Agent
    # Every registered agent is a choice of agent.name, and every choice is registered.
    assert set(AGENTS) == set(typing.get_args(AgentConfig.model_fields["name"].annotation))
    assert {"uitars-1.5", "uitars-1.0"} <= set(AGENTS)
    with pytest.raises(ConfigError, match=r"agent.name: unknown agent 'gpt' \(known: "):
        agent_class("gpt")


def test_terminal_actions_and_what_runs_before_them():
    agent = _agent()
    decision = agent.decide(_parsed("finished(content='ok')"))
    assert decision[:2] == (None, DONE)
    # What the agent read is the step's parse record (traj.jsonl's thought and actions).
    assert decision.parse == ("x", [{"kind": "finished", "point": None, "end_point": None,
                                     "content": "ok", "keys": [], "direction": None}])
    assert agent.decide(_parsed("wait()")).terminal == WAIT
    decision = agent.decide(_parsed("click(start_box='(10,10)')\n\nfinished()"))
    assert decision.terminal == DONE and decision.code.startswith("pyautogui.click(")
    assert decision.action == f"{decision.code}\n{DONE}"  # as traj.jsonl records it
    decision = agent.decide(_parsed("hotkey(key='ctrl s')"))
    assert decision.terminal is None and "hotkey" in decision.code
    assert decision.action == decision.code
    assert agent.decide(None) == (None, FAIL, (None, []))  # unparseable after every retry


def test_call_user_fails_or_waits_up_to_the_configured_number():
    assert _agent().decide(_parsed("call_user()")).terminal == FAIL
    waiting = _agent("agent.call_user=wait", "agent.call_user_max_waits=2")
    decisions = [waiting.decide(_parsed("call_user()")).terminal for _ in range(3)]
    assert decisions == [WAIT, WAIT, FAIL]


def test_a_reply_without_an_action_does_not_parse():
    agent = _agent()
    with pytest.raises(ActionParseError, match="Action"):
        agent.parse("Thought: nothing to do", _shot())
    assert agent.parse("Action: click(start_box='(1,1)')", _shot()).actions[0].kind == "click"


def test_the_request_carries_the_window_of_screenshots_and_what_it_needs():
    agent = _agent("agent.history_images=2", max_tokens=300)
    shots = [_shot() for _ in range(4)]
    forgotten = [agent.remember(s, "Action: wait()") for s in shots[:3]]
    # The agent holds history_images past screenshots; older ones are let go.
    assert forgotten == [None, None, shots[0]]
    assert [t.screenshot for t in agent.history] == [None, shots[1], shots[2]]
    request = agent.request(shots[3])
    assert request.screenshots == [shots[2], shots[3]]
    assert request.messages == build_messages("do it", agent.history, shots[3],
                                              history_images=2)
    tokens = image_tokens(1280, 720)
    assert request.image_tokens == tokens
    assert request.least_tokens[0] == 2 * (tokens + 2) + 300
    assert request.regex is None


def test_constrained_decoding_sends_the_grammar_of_the_screens_frame():
    agent = _agent("agent.constrain_actions=true")
    request = agent.request(_shot())
    assert agent.constrained and request.regex == action_regex(1280, 720, "uitars-1.5")
    agent10 = UITars10Agent(AgentConfig(name="uitars-1.0", constrain_actions=True),
                            instruction="x", max_tokens=10)
    assert agent10.request(_shot()).regex == action_regex(1280, 720, "uitars-1.0")
    # A screen of another size (a desktop resized mid-episode) gets its own frame.
    assert agent.request(_shot(1920, 1080)).regex == action_regex(1920, 1080, "uitars-1.5")


def test_the_families_read_coordinates_in_their_own_frame():
    shot = _shot()
    a15 = UITars15Agent(AgentConfig(), instruction="x", max_tokens=10)
    a10 = UITars10Agent(AgentConfig(name="uitars-1.0"), instruction="x", max_tokens=10)
    reply = "Action: click(start_box='(500,500)')"
    assert a10.parse(reply, shot).actions[0].point == (640, 360)  # 0..1000 relative
    assert a15.parse(reply, shot).actions[0].point != (640, 360)  # resized pixels


def test_a_screens_frame_is_made_once_and_maps_both_ways():
    frame = frame_of(1920, 1080)
    assert frame is frame_of(1920, 1080)  # cached per screen size, family and bounds
    assert (frame.width, frame.height) == (1932.0, 1092.0)  # smart_resize(1080, 1920)
    assert frame.limits == (1931, 1091)
    assert frame.to_screen(frame.to_model((960, 540))) == (960, 540)
    assert frame.to_model((5000, -5)) == (1931, 0)  # clamped into the frame
    assert frame_of(1920, 1080, "uitars-1.0").limits == (1000, 1000)
    with pytest.raises(ValueError, match="unknown model family 'uitars-9'"):
        frame_of(1920, 1080, "uitars-9")
