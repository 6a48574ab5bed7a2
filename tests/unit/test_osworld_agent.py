"""OSWorld's prompt agent (cua_rollout/agents/osworld): parity of the accessibility tree's
linearization and of the computer_13 action space with OSWorld's definitions (mm_agents/
agent.py, accessibility_tree_wrap/heuristic_retrieve.py, desktop_env/actions.py; the
expected values below are written from those rules by hand), the reply parsing of both
action spaces, bad replies as parse failures keeping the reply, the history window."""

from __future__ import annotations

import io

import pytest
from PIL import Image, ImageDraw

from cua_rollout.agents.base import make_agent
from cua_rollout.agents.osworld import ACTION_SPACE, KEYBOARD_KEYS, linearize, validate
from cua_rollout.agents.osworld.a11y import HEADER, draw_marks, trim
from cua_rollout.agents.osworld.computer13 import action_code
from cua_rollout.agents.osworld.replies import read_computer13, read_pyautogui
from cua_rollout.config import load_config
from cua_rollout.core.errors import ActionParseError, ConfigError, DesktopError
from cua_rollout.core.screenshot import Screenshot
from cua_rollout.core.types import DONE, FAIL, WAIT
from tests.support import REPO_ROOT

W, H = 1280, 720
ST = "https://accessibility.ubuntu.example.org/ns/state"
CP = "https://accessibility.ubuntu.example.org/ns/component"
ATTR = "https://accessibility.ubuntu.example.org/ns/attributes"
VAL = "https://accessibility.ubuntu.example.org/ns/value"
WATTR = "https://accessibility.windows.example.org/ns/attributes"
WCLASS = "https://accessibility.windows.example.org/ns/class"
ON = 'st:showing="true" st:visible="true" st:enabled="true"'


def _tree(*nodes: str) -> str:
    return (f'<desktop-frame xmlns:st="{ST}" xmlns:cp="{CP}" xmlns:attr="{ATTR}" '
            f'xmlns:val="{VAL}" xmlns:wattr="{WATTR}" xmlns:wclass="{WCLASS}">'
            f'<application name="app">{"".join(nodes)}</application></desktop-frame>')


def _at(x: int, y: int, w: int, h: int) -> str:
    return f'cp:screencoord="({x}, {y})" cp:size="({w}, {h})"'


TREE = _tree(
    f'<push-button name="OK" {ON} {_at(10, 20, 30, 40)}/>',
    # text with a double quote: quoted, its quotes doubled
    f'<label name="greeting" {ON} {_at(0, 0, 5, 5)}>say "hi"</label>',
    # a role OSWorld does not list: dropped
    f'<panel name="p" {ON} {_at(0, 0, 5, 5)}/>',
    # "document..." is kept by its prefix, "...menu" by its suffix
    f'<document-web name="page" {ON} {_at(1, 2, 3, 4)}/>',
    f'<popup-menu name="m" {ON} {_at(1, 2, 3, 4)}/>',
    # not showing / not visible: dropped
    f'<push-button name="hidden" st:visible="true" st:enabled="true" {_at(1, 1, 1, 1)}/>',
    f'<push-button name="ghost" st:showing="true" st:enabled="true" {_at(1, 1, 1, 1)}/>',
    # not enabled, but editable: kept; neither: dropped
    f'<entry name="field" st:showing="true" st:visible="true" st:editable="true" '
    f'{_at(5, 6, 7, 8)}/>',
    f'<push-button name="off" st:showing="true" st:visible="true" {_at(1, 1, 1, 1)}/>',
    # off screen or without a size: dropped
    f'<push-button name="left" {ON} {_at(-5, 1, 10, 10)}/>',
    f'<push-button name="flat" {ON} {_at(5, 1, 0, 10)}/>',
    f'<push-button name="nowhere" {ON}/>',
    # neither name nor text: dropped (kept for the marks when it is an image)
    f'<icon {ON} image="true" {_at(50, 50, 20, 20)}/>',
    # class and description are read from the Windows attributes namespace (OSWorld's
    # attributes_ns_ubuntu names it): the Linux tree's own class stays out of the table
    f'<push-button name="styled" attr:class="linux-class" wattr:class="win-class" '
    f'wattr:description="tip" {ON} {_at(3, 3, 3, 3)}/>',
    # an EditWrapper (Windows class) without text shows its value
    f'<edit name="e" wclass:class="X.EditWrapper" val:value="v1" {ON} {_at(9, 9, 9, 9)}/>',
)


def test_linearization_follows_osworlds_table():
    assert linearize(TREE).split("\n") == [
        "tag\tname\ttext\tclass\tdescription\tposition (top-left x&y)\tsize (w&h)",
        'push-button\tOK\t""\t\t\t(10, 20)\t(30, 40)',
        'label\tgreeting\t"say ""hi"""\t\t\t(0, 0)\t(5, 5)',
        'document-web\tpage\t""\t\t\t(1, 2)\t(3, 4)',
        'popup-menu\tm\t""\t\t\t(1, 2)\t(3, 4)',
        'entry\tfield\t""\t\t\t(5, 6)\t(7, 8)',
        'push-button\tstyled\t""\twin-class\ttip\t(3, 3)\t(3, 3)',
    ]
    assert linearize(_tree()) == HEADER
    assert linearize("") == HEADER   # a desktop without AT-SPI: no elements


def test_a_tree_that_is_not_xml_is_a_clear_error():
    with pytest.raises(DesktopError, match="accessibility tree is not XML"):
        linearize("<desktop-frame>")


def test_trim_cuts_and_marks_the_cut():
    assert trim("abc", 3) == "abc"
    assert trim("abcdef", 3) == "abc[...]\n"


def _png(draw_boxes: bool = True) -> bytes:
    image = Image.new("RGB", (W, H), (230, 230, 230))
    if draw_boxes:
        ImageDraw.Draw(image).rectangle((12, 22, 30, 50), fill=(0, 90, 200))
        ImageDraw.Draw(image).rectangle((55, 55, 60, 60), fill=(200, 0, 0))
    out = io.BytesIO()
    image.save(out, "PNG")
    return out.getvalue()


def test_marks_number_the_kept_nodes_that_are_not_one_flat_colour():
    png, marks, table = draw_marks(_png(), TREE)
    # OK's box and the icon (an image, kept for the marks) hold more than one colour;
    # the others cover flat background.
    assert [(m.index, m.x, m.y, m.width, m.height) for m in marks] == [
        (1, 10, 20, 30, 40), (2, 50, 50, 20, 20)]
    assert marks[0].center == (25, 40)
    assert table.split("\n") == ["index\ttag\tname\ttext", '1\tpush-button\tOK\t""',
                                 '2\ticon\t\t""']
    drawn = Image.open(io.BytesIO(png)).convert("RGB")
    assert drawn.getpixel((10, 20)) == (255, 0, 0)   # the box's outline
    assert Image.open(io.BytesIO(_png())).convert("RGB").getpixel((10, 20)) != (255, 0, 0)


# --------------------------------------------------------------------------- computer_13

# OSWorld's ACTION_SPACE (desktop_env/actions.py): action_type -> {parameter: (type, range,
# optional)}; "X"/"Y" stand for [0, X_MAX] / [0, Y_MAX], "KEYS" for KEYBOARD_KEYS.
OSWORLD_SPACE = {
    "MOVE_TO": {"x": (float, "X", False), "y": (float, "Y", False)},
    "CLICK": {"button": (str, ("left", "right", "middle"), True), "x": (float, "X", True),
              "y": (float, "Y", True), "num_clicks": (int, (1, 2, 3), True)},
    "MOUSE_DOWN": {"button": (str, ("left", "right", "middle"), True)},
    "MOUSE_UP": {"button": (str, ("left", "right", "middle"), True)},
    "RIGHT_CLICK": {"x": (float, "X", True), "y": (float, "Y", True)},
    "DOUBLE_CLICK": {"x": (float, "X", True), "y": (float, "Y", True)},
    "DRAG_TO": {"x": (float, "X", False), "y": (float, "Y", False)},
    "SCROLL": {"dx": (int, None, False), "dy": (int, None, False)},
    "TYPING": {"text": (str, None, False)},
    "PRESS": {"key": (str, "KEYS", False)},
    "KEY_DOWN": {"key": (str, "KEYS", False)},
    "KEY_UP": {"key": (str, "KEYS", False)},
    "HOTKEY": {"keys": (list, "KEYS", False)},
}
_RANGES = {"X": "x", "Y": "y", "KEYS": "keys"}


def test_the_action_space_is_osworlds():
    assert set(ACTION_SPACE) == set(OSWORLD_SPACE)
    for kind, params in OSWORLD_SPACE.items():
        ours = ACTION_SPACE[kind][1]
        assert set(ours) == set(params), kind
        for name, (kind_type, allowed, optional) in params.items():
            p = ours[name]
            assert (p.type, p.optional) == (kind_type, optional), f"{kind}.{name}"
            assert p.range == _RANGES.get(allowed, allowed), f"{kind}.{name}"  # type: ignore


def test_keyboard_keys_are_pyautoguis_as_osworld_lists_them():
    assert len(KEYBOARD_KEYS) == 193
    assert {"\t", "\n", " ", "a", "~", "ctrl", "enter", "f24", "num9", "winright", "yen",
            "command", "optionright"} <= KEYBOARD_KEYS
    assert "control" not in KEYBOARD_KEYS and "F1" not in KEYBOARD_KEYS


@pytest.mark.parametrize(("action", "code"), [
    ({"action_type": "MOVE_TO", "x": 10, "y": 20.4}, "pyautogui.moveTo(10, 20)"),
    ({"action_type": "CLICK"}, "pyautogui.click()"),
    ({"action_type": "CLICK", "button": "right", "x": 1, "y": 2, "num_clicks": 2},
     "pyautogui.click(button='right', x=1, y=2, clicks=2)"),
    ({"action_type": "CLICK", "parameters": {"x": 5, "y": 6}}, "pyautogui.click(x=5, y=6)"),
    ({"action_type": "MOUSE_DOWN", "button": "middle"}, "pyautogui.mouseDown(button='middle')"),
    ({"action_type": "MOUSE_UP"}, "pyautogui.mouseUp()"),
    ({"action_type": "RIGHT_CLICK", "x": 3, "y": 4}, "pyautogui.rightClick(x=3, y=4)"),
    ({"action_type": "DOUBLE_CLICK"}, "pyautogui.doubleClick()"),
    ({"action_type": "DRAG_TO", "x": 7, "y": 8},
     "pyautogui.dragTo(7, 8, duration=1.0, button='left', mouseDownUp=True)"),
    ({"action_type": "SCROLL", "dx": 0, "dy": -3}, "pyautogui.vscroll(-3)"),
    ({"action_type": "SCROLL", "dx": 2, "dy": 1.0}, "pyautogui.hscroll(2)\npyautogui.vscroll(1)"),
    ({"action_type": "TYPING", "text": "hi"}, "pyautogui.write('hi', interval=0.01)"),
    ({"action_type": "PRESS", "key": "Enter"}, "pyautogui.press('Enter')"),
    ({"action_type": "KEY_DOWN", "key": "shift"}, "pyautogui.keyDown('shift')"),
    ({"action_type": "KEY_UP", "key": "shift"}, "pyautogui.keyUp('shift')"),
    ({"action_type": "HOTKEY", "keys": ["ctrl", "c"]}, "pyautogui.hotkey('ctrl', 'c')"),
])
def test_each_action_validates_and_runs_as_osworlds_controller(action, code):
    assert action_code(validate(action, W, H)) == code


@pytest.mark.parametrize(("action", "error"), [
    ({"action_type": "TELEPORT"}, "unknown action_type"),
    ({"x": 1}, "unknown action_type null"),
    ([1, 2], "an action is a JSON object"),
    ({"action_type": "CLICK", "speed": 3}, "CLICK has no parameter speed"),
    ({"action_type": "MOVE_TO", "x": 1}, "MOVE_TO needs y"),
    ({"action_type": "CLICK", "x": 1}, "needs both x and y"),
    ({"action_type": "CLICK", "x": "1", "y": 2}, "CLICK.x must be a number"),
    ({"action_type": "CLICK", "x": True, "y": 2}, "CLICK.x must be a number"),
    ({"action_type": "CLICK", "x": W, "y": 2}, "off the 1280x720 screen"),
    ({"action_type": "CLICK", "x": 3, "y": -1}, "off the 1280x720 screen"),
    ({"action_type": "CLICK", "button": "back"}, "CLICK.button must be one of"),
    ({"action_type": "CLICK", "num_clicks": 4}, "CLICK.num_clicks must be one of"),
    ({"action_type": "SCROLL", "dx": 0, "dy": 1.5}, "SCROLL.dy must be an integer"),
    ({"action_type": "SCROLL", "dy": 1}, "SCROLL needs dx"),
    ({"action_type": "PRESS", "key": "control"}, "not a key name"),
    ({"action_type": "HOTKEY", "keys": "ctrl+c"}, "HOTKEY.keys must be a list"),
    ({"action_type": "HOTKEY", "keys": []}, "at least one key"),
    ({"action_type": "TYPING", "text": 5}, "TYPING.text must be a string"),
    ({"action_type": "DONE", "x": 1}, "DONE takes no parameters"),
])
def test_actions_off_the_action_space_are_refused_with_the_reason(action, error):
    with pytest.raises(ValueError, match=error):
        validate(action, W, H)


# --------------------------------------------------------------------------- replies


def test_pyautogui_replies_several_blocks_and_special_codes():
    reply = ("The editor is open.\n```python\npyautogui.click(10, 20)\n```\nthen\n"
             "```\nimport time\ntime.sleep(0.5)\nDONE\n```\n```python\npyautogui.click(1, 1)\n```")
    read = read_pyautogui(reply, W, H)
    assert read.code == ["pyautogui.click(10, 20)", "import time\ntime.sleep(0.5)"]
    assert read.terminal == DONE and read.thought == "The editor is open.\n\nthen"
    assert read_pyautogui("WAIT", W, H).terminal == WAIT
    assert read_pyautogui("```FAIL```", W, H).terminal == FAIL
    assert read_pyautogui("ok\n```DONE\n```", W, H).terminal == DONE
    # A compound first statement gets a simple line first (the desktop prefixes imports).
    assert read_pyautogui("```python\nfor i in range(2):\n    pass\n```", W, H).code == [
        "import pyautogui\nfor i in range(2):\n    pass"]


def test_som_tags_are_the_marks_centres():
    _, marks, _ = draw_marks(_png(), TREE)
    read = read_pyautogui("```python\npyautogui.click(tag_2)\n```", W, H, marks)
    assert read.code == ["tag_2 = (60, 60)\npyautogui.click(tag_2)"]
    with pytest.raises(ActionParseError, match="tag_9 is no mark"):
        read_pyautogui("```python\npyautogui.click(tag_9)\n```", W, H, marks)


@pytest.mark.parametrize(("reply", "error"), [
    ("```python\npyautogui.click(1, 2)\n", "unbalanced code fence"),
    ("```python\npyautogui.click(1, 2)\n``` and ```", "unbalanced code fence"),
    ("I would click the button.", "no code block"),
    ("```python\npyautogui.click(1, 2\n```", "does not compile"),
    ("```python\npyautogui.click(1280, 5)\n```", r"click\(1280, 5\) is off the 1280x720"),
    ("```python\npyautogui.moveTo(x=5, y=900)\n```", "off the 1280x720 screen"),
    ("```python\npyautogui.dragTo((-1, 5))\n```", "off the 1280x720 screen"),
    ("```python\npyautogui.click('a', 5)\n```", "is not numbers"),
])
def test_bad_pyautogui_replies_are_parse_failures_keeping_the_reply(reply, error):
    with pytest.raises(ActionParseError, match=error) as caught:
        read_pyautogui(reply, W, H)
    assert caught.value.text == reply


def test_computer13_replies():
    reply = ('Click, then type.\n```json\n{"action_type": "CLICK", "x": 5, "y": 6}\n```\n'
             '```\n{"action_type": "TYPING", "text": "a"}\n```\n```json\n'
             '{"action_type": "DONE"}\n```')
    read = read_computer13(reply, W, H)
    assert read.code == ["pyautogui.click(x=5, y=6)", "pyautogui.write('a', interval=0.01)"]
    assert read.terminal == DONE
    assert [a["action_type"] for a in read.actions] == ["CLICK", "TYPING", "DONE"]
    assert read_computer13('{"action_type": "PRESS", "key": "tab"}', W, H).code == [
        "pyautogui.press('tab')"]
    assert read_computer13(" FAIL ", W, H).terminal == FAIL


@pytest.mark.parametrize(("reply", "error"), [
    ('```json\n{"action_type": "CLICK", "x": 5\n```', "not JSON"),
    ('```json\n{"action_type": "JUMP"}\n```', "unknown action_type"),
    ('```json\n{"action_type": "CLICK", "x": 5, "y": 9000}\n```', "off the 1280x720"),
    ('```json\n{"action_type": "CLICK", "x": 5, "y": 6}', "unbalanced code fence"),
    ("Let me click OK.", "not JSON"),
])
def test_bad_computer13_replies_are_parse_failures_keeping_the_reply(reply, error):
    with pytest.raises(ActionParseError, match=error) as caught:
        read_computer13(reply, W, H)
    assert caught.value.text == reply


# --------------------------------------------------------------------------- the agent


def _agent(*sets: str):
    cfg = load_config(REPO_ROOT / "configs" / "demo.yaml", ["agent.name=osworld-prompt", *sets])
    return make_agent(cfg.agent, instruction="Save the file.", max_tokens=100)


def _shot() -> Screenshot:
    return Screenshot(_png())


def test_the_request_has_the_task_the_observation_and_the_window_of_past_steps():
    agent = _agent("agent.osworld_prompt.max_trajectory_length=2")
    assert agent.observes_a11y_tree and agent.action_format == "pyautogui"
    shots = [_shot() for _ in range(4)]
    for i, shot in enumerate(shots[:3]):
        request = agent.request(shot, TREE)
        agent.decide(agent.parse(f"step {i}\n```python\npyautogui.click(1, 1)\n```", shot))
        agent.remember(shot, f"step {i}\n```python\npyautogui.click(1, 1)\n```")
    request = agent.request(shots[3], TREE)
    system = request.messages[0]["content"][0]["text"]
    assert system.endswith("## Task\nSave the file.") and "pyautogui" in system
    assert "1280x720" in system and "'password'" in system
    roles = [m["role"] for m in request.messages]
    assert roles == ["system", "user", "assistant", "user", "assistant", "user"]
    assert [m["content"][0]["text"].split("\n")[0] for m in request.messages[2::2]] == [
        "step 1", "step 2"]
    assert request.screenshots == shots[1:]   # two past steps and the current one
    assert request.a11y_tree == linearize(TREE) and request.marked is None
    assert linearize(TREE) in request.messages[-1]["content"][0]["text"]


def test_observation_types():
    shot = _shot()
    request = _agent("agent.osworld_prompt.observation_type=a11y_tree").request(shot, TREE)
    assert request.screenshots == [] and request.a11y_tree == linearize(TREE)
    screenshot_only = _agent("agent.osworld_prompt.observation_type=screenshot")
    assert not screenshot_only.observes_a11y_tree
    request = screenshot_only.request(shot)
    assert request.screenshots == [shot] and request.a11y_tree is None
    som = _agent("agent.osworld_prompt.observation_type=som")
    request = som.request(shot, TREE)
    assert request.marked is not None and request.screenshots == [request.marked]
    assert request.a11y_tree.startswith("index\ttag")
    assert "tag_" in request.messages[0]["content"][0]["text"]
    # The marks of this step name its tags.
    assert som.parse("```python\npyautogui.click(tag_1)\n```", shot).code == [
        "tag_1 = (25, 40)\npyautogui.click(tag_1)"]
    with pytest.raises(ValueError, match="needs the accessibility tree"):
        som.request(shot)


def test_a_reply_without_an_action_and_the_terminal_policy():
    agent = _agent("agent.osworld_prompt.action_space=computer_13")
    shot = _shot()
    agent.request(shot, TREE)
    with pytest.raises(ActionParseError, match="holds no action"):
        agent.parse("```python\n```", shot)
    decision = agent.decide(agent.parse('```json\n{"action_type": "PRESS", "key": "a"}\n```\n'
                                        "```WAIT```", shot))
    assert decision[:2] == ("pyautogui.press('a')", WAIT)
    assert decision.parse == (None, [{"action_type": "PRESS", "key": "a"},
                                     {"action_type": "WAIT"}])
    assert agent.decide(None)[:2] == (None, FAIL)


def test_settings_are_checked_at_load():
    with pytest.raises(ConfigError, match=r"osworld_prompt\.observaton_type"):
        load_config(None, ["agent.osworld_prompt.observaton_type=som"])
    with pytest.raises(ConfigError, match="som needs action_space pyautogui"):
        load_config(None, ["agent.osworld_prompt.observation_type=som",
                           "agent.osworld_prompt.action_space=computer_13"])
    with pytest.raises(ConfigError, match="more than history_images"):
        load_config(None, ["agent.name=osworld-prompt", "agent.history_images=3"])
    with pytest.raises(ConfigError, match="constrain_actions"):
        load_config(None, ["agent.name=osworld-prompt", "agent.constrain_actions=true"])
