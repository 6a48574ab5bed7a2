"""UI-TARS protocol: a corpus of real-looking replies with hand-computed screen points, exact
``smart_resize`` values, and property tests for coordinates, formatting and malformed text."""

from __future__ import annotations

import json
import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cua_rollout.agents.uitars import (
    ACTION_KINDS,
    Action,
    add_box_token,
    model_to_screen,
    normalize_key,
    parse_response,
    screen_to_model,
    split_terminal,
    to_pyautogui,
)
from cua_rollout.core.errors import ActionParseError
from cua_rollout.core.types import DONE, FAIL, WAIT
from cua_rollout.core.vision import MAX_PIXELS, MIN_PIXELS, smart_resize
from cua_rollout.desktop.protocol import execute_command
from tests.support import TESTS_DIR
from tests.uitars_replies import format_action, format_response

CORPUS_PATH = TESTS_DIR / "data" / "uitars_corpus.jsonl"
CORPUS = [json.loads(line) for line in CORPUS_PATH.read_text(encoding="utf-8").splitlines()]
GOOD = [c for c in CORPUS if not c["expect"].get("error")]
BROKEN = [c for c in CORPUS if c["expect"].get("error")]
SPECIAL = {DONE, WAIT, FAIL}

FAMILIES = ("uitars-1.5", "uitars-1.0")
# Screen sizes desktops run at; 1.0's relative frame stays within 1 px only up to ~3000 px.
SCREENS = [(1920, 1080), (1280, 720), (1366, 768), (2560, 1440), (1024, 768)]
SETTINGS = settings(max_examples=150, deadline=None)


def _parse(case: dict):
    width, height = case["screen"]
    return parse_response(case["text"], width, height, case["family"])


def _as_dict(action: Action) -> dict:
    return {
        "kind": action.kind,
        "point": list(action.point) if action.point is not None else None,
        "end_point": list(action.end_point) if action.end_point is not None else None,
        "content": action.content,
        "keys": list(action.keys),
        "direction": action.direction,
    }


# --------------------------------------------------------------------------- the corpus


def test_corpus_is_large_and_covers_the_action_space():
    assert len(CORPUS) >= 45
    assert len(BROKEN) >= 12
    assert len({c["id"] for c in CORPUS}) == len(CORPUS)
    assert sum("pyautogui" in c["expect"] for c in GOOD) >= 15
    kinds = {a["kind"] for c in GOOD for a in c["expect"]["actions"]}
    assert kinds == ACTION_KINDS
    directions = {a["direction"] for c in GOOD for a in c["expect"]["actions"]} - {None}
    assert directions == {"up", "down", "left", "right"}
    assert {c["family"] for c in GOOD} == set(FAMILIES)
    assert len({tuple(c["screen"]) for c in GOOD}) >= 4


@pytest.mark.parametrize("case", GOOD, ids=[c["id"] for c in GOOD])
def test_corpus_well_formed(case):
    expect = case["expect"]
    parsed = _parse(case)
    assert parsed.thought == expect["thought"]
    assert parsed.reflection == expect["reflection"]
    assert parsed.action_summary == expect["action_summary"]
    assert [_as_dict(a) for a in parsed.actions] == expect["actions"]
    assert parsed.text == case["text"]
    if "pyautogui" in expect:
        assert to_pyautogui(parsed.actions) == expect["pyautogui"]


@pytest.mark.parametrize("case", BROKEN, ids=[c["id"] for c in BROKEN])
def test_corpus_broken(case):
    with pytest.raises(ActionParseError) as info:
        _parse(case)
    assert isinstance(info.value.text, str)
    assert info.value.reason


@pytest.mark.parametrize("case", GOOD, ids=[c["id"] for c in GOOD])
def test_corpus_code_compiles_after_osworld_prefix(case):
    code = to_pyautogui(_parse(case).actions)
    if code in SPECIAL:
        return
    argv = execute_command(code)
    assert argv[:2] == ["python", "-c"]
    compile(argv[2], f"<{case['id']}>", "exec")


@pytest.mark.parametrize("value", [None, 42, b"Action: wait()", ["Action: wait()"]])
def test_non_string_reply_is_a_parse_error(value):
    with pytest.raises(ActionParseError, match="not text"):
        parse_response(value, 1920, 1080)


def test_parse_error_keeps_the_offending_text():
    with pytest.raises(ActionParseError) as info:
        parse_response("Thought: hmm\nAction: fly(to='moon')", 1920, 1080)
    assert "fly(to='moon')" in info.value.text
    assert "fly" in str(info.value)


def test_bad_family_or_screen_is_a_programming_error_not_a_parse_error():
    with pytest.raises(ValueError, match="family"):
        parse_response("Action: wait()", 1920, 1080, "uitars-9")
    with pytest.raises(ValueError):
        parse_response("Action: wait()", 0, 1080)


def test_terminal_property():
    assert parse_response("Action: click(start_box='(1,1)')", 1920, 1080).terminal is None
    reply = "Action: click(start_box='(1,1)')\n\nfinished(content='ok')\n\nwait()"
    assert parse_response(reply, 1920, 1080).terminal == "finished"


# --------------------------------------------------------------------------- smart_resize


@pytest.mark.parametrize(
    ("height", "width", "expected"),
    [
        (1080, 1920, (1092, 1932)),
        (720, 1280, (728, 1288)),
        (768, 1366, (756, 1372)),
        (1440, 2560, (1428, 2548)),
        (2160, 3840, (2156, 3836)),
        (1600, 2560, (1596, 2548)),
        # Python's round-half-even: 42.5 -> 42, 43.5 -> 44, 62.5 -> 62.
        (1190, 1750, (1176, 1736)),
        (1218, 1750, (1232, 1736)),
        # Too small: scaled up by sqrt(min_pixels / area), sides rounded up.
        (28, 28, (280, 280)),
        (1, 1, (280, 280)),
        (50, 80, (224, 364)),
        (1, 200, (28, 3976)),
        # Too large: scaled down by sqrt(area / max_pixels), sides rounded down.
        (4000, 6000, (2912, 4368)),
    ],
)
def test_smart_resize_exact(height, width, expected):
    assert smart_resize(height, width) == expected


@pytest.mark.parametrize(("height", "width"), [(0, 100), (100, 0), (-1, 100), (1, 201), (201, 1)])
def test_smart_resize_rejects_invalid_sizes(height, width):
    with pytest.raises(ValueError):
        smart_resize(height, width)


@st.composite
def _image_sizes(draw):
    """Sides up to 20000 px with an aspect ratio of at most 200, either way round."""
    short = draw(st.integers(1, 20000))
    long = draw(st.integers(short, min(20000, short * 200)))
    return (short, long) if draw(st.booleans()) else (long, short)


@SETTINGS
@given(_image_sizes())
def test_smart_resize_properties(size):
    height, width = size
    h_bar, w_bar = smart_resize(height, width)
    assert h_bar > 0 and w_bar > 0
    assert h_bar % 28 == 0 and w_bar % 28 == 0
    assert MIN_PIXELS <= h_bar * w_bar <= MAX_PIXELS
    # The aspect ratio is kept up to one grid cell per side: one scale s puts both
    # sides within 28 px of (s*height, s*width).
    low = max((h_bar - 28) / height, (w_bar - 28) / width)
    high = min((h_bar + 28) / height, (w_bar + 28) / width)
    assert low <= high * (1 + 1e-12)


# --------------------------------------------------------------------------- coordinates


def _frame(width: int, height: int, family: str) -> tuple[int, int]:
    if family == "uitars-1.0":
        return 1000, 1000
    h_bar, w_bar = smart_resize(height, width)
    return w_bar, h_bar


@st.composite
def _model_points(draw):
    family = draw(st.sampled_from(FAMILIES))
    width, height = draw(st.sampled_from(SCREENS))
    frame_w, frame_h = _frame(width, height, family)
    point = (draw(st.integers(0, frame_w)), draw(st.integers(0, frame_h)))
    return family, width, height, point


@st.composite
def _screen_points(draw):
    family = draw(st.sampled_from(FAMILIES))
    width, height = draw(st.sampled_from(SCREENS))
    point = (draw(st.integers(0, width - 1)), draw(st.integers(0, height - 1)))
    return family, width, height, point


@SETTINGS
@given(_model_points())
def test_model_screen_model_round_trip(sample):
    family, width, height, (x, y) = sample
    sx, sy = model_to_screen((x, y), width, height, family)
    assert 0 <= sx < width and 0 <= sy < height
    mx, my = screen_to_model((sx, sy), width, height, family)
    assert abs(mx - x) <= 1 and abs(my - y) <= 1


@SETTINGS
@given(_screen_points())
def test_screen_model_screen_round_trip(sample):
    family, width, height, (x, y) = sample
    model = screen_to_model((x, y), width, height, family)
    sx, sy = model_to_screen(model, width, height, family)
    assert abs(sx - x) <= 1 and abs(sy - y) <= 1


def test_model_to_screen_examples_and_clamping():
    assert model_to_screen((966, 546), 1920, 1080) == (960, 540)
    assert model_to_screen((1932, 1092), 1920, 1080) == (1919, 1079)
    assert model_to_screen((500, 500), 1920, 1080, "uitars-1.0") == (960, 540)
    assert model_to_screen((1000, 0), 1920, 1080, "uitars-1.0") == (1919, 0)
    assert screen_to_model((960, 540), 1920, 1080) == (966, 546)
    assert screen_to_model((960, 540), 1920, 1080, "uitars-1.0") == (500, 500)
    with pytest.raises(ValueError, match="family"):
        model_to_screen((1, 1), 1920, 1080, "gpt")


# --------------------------------------------------------------------------- format -> parse

KEYS = [
    "ctrl", "shift", "alt", "win", "enter", "esc", "tab", "space", "backspace", "delete",
    "up", "down", "left", "right", "home", "end", "pageup", "pagedown", "f1", "f5", "f12",
    "a", "c", "v", "z", "1", "'", "\\", ",", "=", "+", "-", "/", "`",
]
# Content mixes the characters that break naive quoting with arbitrary Unicode.
CONTENT = st.lists(
    st.sampled_from([*"'\"\\\n\r\t ,=()[]<>|", "', x='", "')", "\\n", "Action: "])
    | st.characters(exclude_categories=("Cs",)),
    max_size=30,
).map("".join)
# No ':' so the thought cannot grow a header of its own.
THOUGHT = st.text(alphabet="abcdefgh XYZ.,'\"\n()中文é", max_size=60)


@st.composite
def _actions(draw, width: int, height: int) -> Action:
    point = st.tuples(st.integers(0, width - 1), st.integers(0, height - 1))
    kind = draw(st.sampled_from(sorted(ACTION_KINDS)))
    if kind in ("click", "left_double", "right_single", "hover"):
        return Action(kind, point=draw(point))
    if kind == "drag":
        return Action(kind, point=draw(point), end_point=draw(point))
    if kind == "hotkey":
        return Action(kind, keys=draw(st.lists(st.sampled_from(KEYS), min_size=1, max_size=4)))
    if kind in ("press", "keydown", "keyup"):
        return Action(kind, keys=[draw(st.sampled_from(KEYS))])
    if kind == "scroll":
        return Action(
            kind,
            point=draw(st.none() | point),
            direction=draw(st.sampled_from(["up", "down", "left", "right"])),
        )
    if kind in ("type", "finished"):
        return Action(kind, content=draw(CONTENT))
    return Action(kind)


@st.composite
def _replies(draw):
    family = draw(st.sampled_from(FAMILIES))
    width, height = draw(st.sampled_from(SCREENS))
    actions = draw(st.lists(_actions(width, height), min_size=1, max_size=4))
    thought = draw(THOUGHT)
    return family, width, height, thought, actions


def _assert_same_actions(parsed: list[Action], original: list[Action]) -> None:
    assert [a.kind for a in parsed] == [a.kind for a in original]
    for got, want in zip(parsed, original, strict=True):
        for name in ("point", "end_point"):
            g, w = getattr(got, name), getattr(want, name)
            assert (g is None) == (w is None), name
            if w is not None:
                assert abs(g[0] - w[0]) <= 1 and abs(g[1] - w[1]) <= 1, (name, g, w)
        assert got.content == want.content
        assert got.keys == want.keys
        assert got.direction == want.direction


@SETTINGS
@given(_replies())
def test_format_then_parse_gives_the_actions_back(reply):
    family, width, height, thought, actions = reply
    text = format_response(thought, actions, width, height, family)
    parsed = parse_response(text, width, height, family)
    assert parsed.thought == (thought.strip() or None)
    _assert_same_actions(parsed.actions, actions)
    # The same holds for each call on its own, without headers.
    for action in actions:
        call = format_action(action, width, height, family)
        _assert_same_actions(parse_response(call, width, height, family).actions, [action])


@SETTINGS
@given(
    _replies(),
    st.sampled_from([{}, {"max_pixels": 1280 * 28 * 28}, {"max_pixels": 512 * 28 * 28},
                     {"min_pixels": 4096 * 28 * 28}]),
)
def test_format_then_parse_with_the_processors_pixel_bounds(reply, pixels):
    """With other min/max pixels the frame changes (1.5 only) and both directions follow it:
    a point comes back within the size of one frame pixel on the screen."""
    family, width, height, thought, actions = reply
    text = format_response(thought, actions, width, height, family, **pixels)
    parsed = parse_response(text, width, height, family, **pixels)
    if family == "uitars-1.0":
        assert text == format_response(thought, actions, width, height, family)
    h_bar, w_bar = smart_resize(height, width, **pixels)
    tol_x, tol_y = (1, 1) if family == "uitars-1.0" else (
        max(1, math.ceil(width / w_bar)), max(1, math.ceil(height / h_bar)))
    assert [a.kind for a in parsed.actions] == [a.kind for a in actions]
    for got, want in zip(parsed.actions, actions, strict=True):
        for name, model_name in (("point", "model_point"), ("end_point", "model_end_point")):
            g, w = getattr(got, name), getattr(want, name)
            assert (g is None) == (w is None), name
            if w is not None:
                assert abs(g[0] - w[0]) <= tol_x and abs(g[1] - w[1]) <= tol_y, (name, g, w)
                m = getattr(got, model_name)
                if family == "uitars-1.5":
                    assert 0 <= m[0] < w_bar and 0 <= m[1] < h_bar, (m, w_bar, h_bar)


@SETTINGS
@given(_replies())
def test_to_pyautogui_compiles_for_random_actions(reply):
    _, _, _, _, actions = reply
    before, terminal = split_terminal(actions)
    if before:
        compile(execute_command(to_pyautogui(before))[2], "<random>", "exec")
    code = to_pyautogui(actions)
    assert (code in SPECIAL) == (terminal is not None)


# --------------------------------------------------------------------------- malformed text


def _parse_or_parse_error(text: str, width: int = 1920, height: int = 1080) -> None:
    try:
        parsed = parse_response(text, width, height)
    except ActionParseError as exc:
        assert isinstance(exc.text, str)
        return
    assert parsed.actions
    for action in parsed.actions:
        assert action.kind in ACTION_KINDS
        for point in (action.point, action.end_point):
            assert point is None or (0 <= point[0] < width and 0 <= point[1] < height)


@settings(max_examples=300, deadline=None)
@given(st.text())
def test_arbitrary_text_parses_or_raises_parse_error(text):
    _parse_or_parse_error(text)


@settings(max_examples=300, deadline=None)
@given(st.text(alphabet="Action:：Thought click()'\",=<>|_[]\\ \n0123456789-.eTp", max_size=80))
def test_protocol_shaped_text_parses_or_raises_parse_error(text):
    _parse_or_parse_error(text)


_SNIPPETS = st.sampled_from(
    ["(", ")", "'", '"', "\\", ",", "=", "\n", "\n\n", "Action:", "Action：", "Thought:",
     "<|box_start|>", "<|box_end|>", "<point>", "</point>", "-", "9" * 400, "1e5", "é", " "]
)


@st.composite
def _mutated_replies(draw):
    text = draw(st.sampled_from([c["text"] for c in CORPUS]))
    for _ in range(draw(st.integers(1, 4))):
        i = draw(st.integers(0, len(text)))
        j = draw(st.integers(i, min(len(text), i + 8)))
        op = draw(st.sampled_from(["delete", "insert", "replace", "duplicate"]))
        if op == "delete":
            text = text[:i] + text[j:]
        elif op == "insert":
            text = text[:i] + draw(_SNIPPETS | st.text(max_size=3)) + text[i:]
        elif op == "replace":
            text = text[:i] + draw(_SNIPPETS) + text[j:]
        else:
            text = text[:j] + text[i:j] + text[j:]
    return text


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_mutated_replies())
def test_mutated_replies_parse_or_raise_parse_error(text):
    _parse_or_parse_error(text)


# --------------------------------------------------------------------------- terminal actions


def test_terminal_actions_map_to_special_strings():
    click = Action("click", point=(10, 20))
    assert to_pyautogui([Action("finished", content="ok")]) == DONE
    assert to_pyautogui([Action("wait")]) == WAIT
    assert to_pyautogui([Action("call_user")]) == FAIL
    # A terminal action anywhere wins, as in OSWorld's UI-TARS agent.
    assert to_pyautogui([click, Action("finished")]) == DONE
    assert to_pyautogui([click, Action("call_user"), Action("wait")]) == FAIL
    assert to_pyautogui([click, Action("wait")]) == WAIT
    assert to_pyautogui([click]) == "pyautogui.click(10, 20, button='left')"
    with pytest.raises(ValueError):
        to_pyautogui([])


def test_split_terminal():
    click = Action("click", point=(10, 20))
    typing = Action("type", content="x")
    assert split_terminal([]) == ([], None)
    assert split_terminal([click, typing]) == ([click, typing], None)
    assert split_terminal([click, Action("wait"), typing]) == ([click], "wait")
    assert split_terminal([Action("finished"), click]) == ([], "finished")
    assert split_terminal([click, typing, Action("call_user")]) == ([click, typing], "call_user")


def test_to_pyautogui_options_and_empty_type():
    scroll = Action("scroll", point=(5, 6), direction="down")
    drag = Action("drag", point=(1, 2), end_point=(3, 4))
    code = to_pyautogui([scroll, drag], scroll_clicks=3, drag_duration_s=1.0)
    assert code == (
        "pyautogui.scroll(-3, x=5, y=6)\npyautogui.moveTo(1, 2)\n"
        "pyautogui.dragTo(3, 4, duration=1.0, button='left')"
    )
    assert to_pyautogui([Action("scroll", direction="up")]) == "pyautogui.scroll(5)"
    assert to_pyautogui([Action("type", content="")]) == "pass"
    assert to_pyautogui([Action("type", content="ab")], typing_interval_s=0.1) == (
        "pyautogui.write('ab', interval=0.1)"
    )


# --------------------------------------------------------------------------- add_box_token


def test_add_box_token_wraps_points_of_the_action_only():
    text = (
        "Thought: earlier I used start_box='(1,2)' here.\n"
        "Action: drag(start_box='(100,200)', end_box='(300, 400)')"
    )
    wrapped = add_box_token(text)
    assert wrapped == (
        "Thought: earlier I used start_box='(1,2)' here.\n"
        "Action: drag(start_box='<|box_start|>(100,200)<|box_end|>', "
        "end_box='<|box_start|>(300, 400)<|box_end|>')"
    )
    assert add_box_token(wrapped) == wrapped


def test_add_box_token_on_one_line_reply():
    text = "Thought: ok. Action: click(start_box='(5,6)')"
    assert add_box_token(text) == (
        "Thought: ok. Action: click(start_box='<|box_start|>(5,6)<|box_end|>')"
    )


def test_add_box_token_without_action_is_unchanged():
    assert add_box_token("Thought: start_box='(1,2)'") == "Thought: start_box='(1,2)'"
    assert add_box_token("") == ""


@pytest.mark.parametrize("case", GOOD, ids=[c["id"] for c in GOOD])
def test_add_box_token_on_corpus(case):
    text = case["text"]
    wrapped = add_box_token(text)
    assert add_box_token(wrapped) == wrapped
    width, height = case["screen"]
    parsed = parse_response(wrapped, width, height, case["family"])
    assert [_as_dict(a) for a in parsed.actions] == case["expect"]["actions"]
    assert parsed.thought == case["expect"]["thought"]


@SETTINGS
@given(_replies())
def test_add_box_token_is_idempotent_and_keeps_meaning(reply):
    family, width, height, thought, actions = reply
    text = format_response(thought, actions, width, height, family)
    wrapped = add_box_token(text)
    assert add_box_token(wrapped) == wrapped
    head = text[: text.index("\nAction: ")]
    assert wrapped.startswith(head)
    original = parse_response(text, width, height, family)
    again = parse_response(wrapped, width, height, family)
    assert again.thought == original.thought
    _assert_same_actions(again.actions, original.actions)


# --------------------------------------------------------------------------- keys


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("Control", "ctrl"), ("ctrl", "ctrl"), ("CTRL", "ctrl"), ("ArrowLeft", "left"),
        ("arrow_down", "down"), ("Escape", "esc"), ("ESC", "esc"), ("Return", "enter"),
        ("cmd", "win"), ("Super", "win"), ("Meta", "win"), ("PageDown", "pagedown"),
        ("page_up", "pageup"), ("BackSpace", "backspace"), ("Del", "delete"),
        ("Option", "alt"), ("plus", "+"), ("minus", "-"), ("spacebar", "space"),
        (" Tab ", "tab"), ("A", "a"), ("F5", "f5"), ("+", "+"), ("'", "'"),
    ],
)
def test_normalize_key(name, expected):
    assert normalize_key(name) == expected


@pytest.mark.parametrize(
    ("key", "expected"),
    [
        ("ctrl c", ["ctrl", "c"]),
        ("ctrl+c", ["ctrl", "c"]),
        ("Ctrl+Shift+Esc", ["ctrl", "shift", "esc"]),
        ("ctrl++", ["ctrl", "+"]),
        ("ctrl +", ["ctrl", "+"]),
        ("alt  tab", ["alt", "tab"]),
        ("command space", ["command", "space"]),
    ],
)
def test_hotkey_key_lists(key, expected):
    parsed = parse_response(f"Action: hotkey(key={key!r})", 1920, 1080)
    assert parsed.actions[0].keys == expected


def test_non_finite_coordinates_are_parse_errors():
    huge = "9" * 400
    for box in (f"({huge},5)", f"(5,{huge})", f"(0,0,{huge},{huge})"):
        with pytest.raises(ActionParseError, match="out of range"):
            parse_response(f"Action: click(start_box='{box}')", 1920, 1080)
    # Large but finite values are clamped like any point beyond the image.
    reply = "Action: click(start_box='(" + "9" * 30 + ",5)')"
    assert parse_response(reply, 1920, 1080).actions[0].point == (1919, 5)


@pytest.mark.timeout(10)
def test_long_runs_of_spaces_in_a_box_do_not_backtrack():
    # Degenerate sampling can emit long whitespace runs; the old box pattern needed minutes.
    spaces = " " * 3000
    for box in (f"(1{spaces}2{spaces}x)", f"(1{spaces}2{spaces}3{spaces}x)"):
        with pytest.raises(ActionParseError, match="not a point or box"):
            parse_response(f"Action: click(start_box='{box}')", 1920, 1080)
    reply = f"Action: click(start_box='(10{spaces},{spaces}20)')"
    assert parse_response(reply, 1920, 1080).actions[0].model_point == (10.0, 20.0)


@pytest.mark.parametrize(
    ("call", "expected"),
    [
        ("drag('(400,300)', '(800,300)')", {"point": (398, 297), "end_point": (795, 297)}),
        ("drag('(400,300)', end_box='(800,300)')", {"point": (398, 297), "end_point": (795, 297)}),
        ("scroll('(966,546)', 'left')", {"point": (960, 540), "direction": "left"}),
        ('scroll("(966,546)", "down")', {"point": (960, 540), "direction": "down"}),
        ("hotkey('ctrl s')", {"keys": ["ctrl", "s"]}),
        ("finished('all done')", {"content": "all done"}),
    ],
)
def test_positional_arguments(call, expected):
    action = parse_response(f"Action: {call}", 1920, 1080).actions[0]
    for name, value in expected.items():
        assert getattr(action, name) == value


@pytest.mark.parametrize(
    "call",
    ["type('a', 'b')", "click('(1,2)', '(3,4)')", "drag('(1,2)', '(3,4)', '(5,6)')"],
)
def test_too_many_positional_arguments(call):
    with pytest.raises(ActionParseError, match="too many arguments"):
        parse_response(f"Action: {call}", 1920, 1080)


def test_box_whose_centre_overflows_is_rejected():
    big = "1" + "0" * 308  # 1e308 is finite, the sum of two such corners is not
    assert math.isfinite(float(big))
    with pytest.raises(ActionParseError, match="out of range"):
        parse_response(f"Action: click(start_box='({big},0,{big},0)')", 1920, 1080)
