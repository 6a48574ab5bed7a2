"""The action grammar for constrained decoding (``ui_tars_utils.action_regex``): every reply it
matches parses to one action inside the model's frame, every formatted action of the prompt's
action space matches it, it stays within the dialect vLLM's backends read, and its length
bound holds. Also the image-processor pixel bounds threaded through the coordinate mapping."""

from __future__ import annotations

import random
import re
import string

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import cua_rollout.agents.uitars.grammar as grammar
from cua_rollout.agents.uitars import (
    ACTION_REGEX_CONTENT_CHARS,
    ACTION_REGEX_THOUGHT_CHARS,
    RELATIVE_SCALE,
    SCROLL_DIRECTIONS,
    Action,
    action_regex,
    action_regex_max_chars,
    model_to_screen,
    normalize_key,
    parse_response,
    screen_to_model,
)
from cua_rollout.agents.uitars.parser import NAMED_KEYS
from cua_rollout.core.vision import (
    IMAGE_WRAPPER_TOKENS,
    MAX_PIXELS,
    MIN_PIXELS,
    image_tokens,
    smart_resize,
)
from tests.uitars_replies import format_action, format_response

# The module's private helpers, reached as attributes (the layout forbids importing them).
_int_range_regex = grammar._int_range_regex
_max_frame_side = grammar._max_frame_side

SETTINGS = settings(
    max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
SMALL = 1003520  # a processor's max_pixels (1280 * 28 * 28): 1920x1080 is seen as 728x1316
# (width, height, family, pixel bounds) the grammar is checked on.
CASES = [
    (1280, 720, "uitars-1.5", {}),
    (1920, 1080, "uitars-1.5", {}),
    (1000, 1000, "uitars-1.5", {}),
    (1920, 1080, "uitars-1.0", {}),
    (1920, 1080, "uitars-1.5", {"max_pixels": SMALL}),
    (3840, 2160, "uitars-1.5", {"max_pixels": SMALL}),  # screen over twice the frame
    (640, 200, "uitars-1.5", {"min_pixels": 512 * 28 * 28}),  # scaled up
]
CASE_IDS = [f"{w}x{h}-{f}-{'-'.join(map(str, p.values())) or 'default'}"
            for w, h, f, p in CASES]
GRAMMAR_KINDS = {"click", "left_double", "right_single", "drag", "hotkey", "type", "scroll",
                 "wait", "finished", "call_user"}
REGEX_KEYS = sorted(NAMED_KEYS) + list(string.ascii_lowercase + string.digits)
THOUGHT_CHARS = string.ascii_letters + string.digits + " ,.'-"
# What content may hold before escaping: printable ASCII and newlines (quotes, backslashes).
CONTENT_CHARS = "".join(chr(c) for c in range(32, 127)) + "\n"


def _frame_max(width: int, height: int, family: str, pixels: dict) -> tuple[int, int]:
    """The largest coordinates the model may write, computed independently of the module."""
    if family == "uitars-1.0":
        return RELATIVE_SCALE, RELATIVE_SCALE
    h_bar, w_bar = smart_resize(height, width, **pixels)
    return w_bar - 1, h_bar - 1


# --------------------------------------------------------------------------- integer ranges


RANDOM_HIS = random.Random(20240611).sample(range(2, 60000), 12)


@pytest.mark.parametrize(
    "hi", [0, 1, 2, 9, 10, 11, 19, 20, 90, 99, 100, 101, 109, 110, 199, 200, 727, 999, 1000,
           1001, 1287, 1931, 9999, 10000, *RANDOM_HIS],
)
def test_int_range_regex_matches_exactly_zero_to_hi(hi):
    pattern = re.compile(_int_range_regex(hi))
    for n in range(hi + 201):
        assert bool(pattern.fullmatch(str(n))) == (n <= hi), (hi, n)
        if n <= hi + 1:
            for bad in (f"0{n}", f"00{n}", f"-{n}", f"+{n}", f"{n} ", f"{n}.0"):
                assert not pattern.fullmatch(bad), (hi, bad)
    assert not pattern.fullmatch("")
    assert not pattern.fullmatch(str(hi * 10 + 9))


@given(hi=st.integers(0, 10**7), n=st.integers(0, 10**8))
@settings(max_examples=300, deadline=None)
def test_int_range_regex_property(hi, n):
    assert bool(re.fullmatch(_int_range_regex(hi), str(n))) == (n <= hi)


def test_int_range_regex_rejects_a_negative_bound():
    with pytest.raises(ValueError):
        _int_range_regex(-1)


# --------------------------------------------------------------------------- sampled replies


def _check_sample(text: str, width: int, height: int, family: str, pixels: dict) -> str:
    parsed = parse_response(text, width, height, family, **pixels)
    assert len(parsed.actions) == 1, text
    action = parsed.actions[0]
    assert action.kind in GRAMMAR_KINDS, text
    x_max, y_max = _frame_max(width, height, family, pixels)
    for point in (action.model_point, action.model_end_point):
        if point is not None:
            assert 0 <= point[0] <= x_max and 0 <= point[1] <= y_max, (text, x_max, y_max)
    for point in (action.point, action.end_point):
        if point is not None:
            assert 0 <= point[0] < width and 0 <= point[1] < height, text
    assert len(text) <= action_regex_max_chars(width, height, family, **pixels), text
    assert len(text) <= action_regex_max_chars()
    return action.kind


@pytest.mark.parametrize(("width", "height", "family", "pixels"), CASES, ids=CASE_IDS)
@given(data=st.data())
@SETTINGS
def test_every_sampled_match_parses_to_one_action_in_the_frame(
    width, height, family, pixels, data
):
    regex = action_regex(width, height, family, **pixels)
    text = data.draw(st.from_regex(regex, fullmatch=True))
    _check_sample(text, width, height, family, pixels)


@given(data=st.data())
@SETTINGS
def test_without_call_user_no_sample_is_call_user(data):
    regex = action_regex(1280, 720, call_user=False)
    text = data.draw(st.from_regex(regex, fullmatch=True))
    assert _check_sample(text, 1280, 720, "uitars-1.5", {}) != "call_user"


def test_call_user_only_when_offered():
    reply = "Thought: I need help\nAction: call_user()"
    assert re.fullmatch(action_regex(1280, 720), reply)
    assert not re.fullmatch(action_regex(1280, 720, call_user=False), reply)
    assert re.fullmatch(action_regex(1280, 720, call_user=False), "Thought: x\nAction: wait()")


# --------------------------------------------------------------------------- formatted replies


def _actions(width: int, height: int) -> st.SearchStrategy[Action]:
    point = st.tuples(st.integers(0, width - 1), st.integers(0, height - 1))
    content = st.text(alphabet=CONTENT_CHARS, max_size=ACTION_REGEX_CONTENT_CHARS)
    return st.one_of(
        st.builds(Action, kind=st.sampled_from(["click", "left_double", "right_single"]),
                  point=point),
        st.builds(Action, kind=st.just("drag"), point=point, end_point=point),
        st.builds(Action, kind=st.just("hotkey"),
                  keys=st.lists(st.sampled_from(REGEX_KEYS), min_size=1, max_size=3)),
        st.builds(Action, kind=st.sampled_from(["type", "finished"]), content=content),
        st.builds(Action, kind=st.just("scroll"), point=point,
                  direction=st.sampled_from(SCROLL_DIRECTIONS)),
        st.builds(Action, kind=st.sampled_from(["wait", "call_user"])),
    )


@pytest.mark.parametrize(("width", "height", "family", "pixels"), CASES, ids=CASE_IDS)
@given(data=st.data())
@SETTINGS
def test_every_formatted_action_matches(width, height, family, pixels, data):
    action = data.draw(_actions(width, height))
    thought = data.draw(st.text(alphabet=THOUGHT_CHARS, max_size=ACTION_REGEX_THOUGHT_CHARS))
    regex = action_regex(width, height, family, **pixels)
    reply = format_response(thought, [action], width, height, family, **pixels)
    assert re.fullmatch(regex, reply), reply
    assert len(reply) <= action_regex_max_chars(width, height, family, **pixels)
    parsed = parse_response(reply, width, height, family, **pixels)
    assert [a.kind for a in parsed.actions] == [action.kind]
    if action.kind in ("type", "finished"):
        assert parsed.actions[0].content == action.content
    if action.kind == "hotkey":
        assert parsed.actions[0].keys == [normalize_key(k) for k in action.keys]


@pytest.mark.parametrize(("width", "height", "family", "pixels"), CASES, ids=CASE_IDS)
def test_the_screen_corners_match(width, height, family, pixels):
    regex = action_regex(width, height, family, **pixels)
    x_max, y_max = _frame_max(width, height, family, pixels)
    for point in [(0, 0), (width - 1, height - 1), (width - 1, 0), (0, height - 1)]:
        action = Action("click", point=point)
        reply = format_response("corner", [action], width, height, family, **pixels)
        assert re.fullmatch(regex, reply), reply
        mx, my = screen_to_model(point, width, height, family, **pixels)
        assert 0 <= mx <= x_max and 0 <= my <= y_max
    for kind in ("click", "left_double", "right_single"):
        inside = f"Thought: edge\nAction: {kind}(start_box='({x_max},{y_max})')"
        assert re.fullmatch(regex, inside)
        assert not re.fullmatch(regex, inside.replace(f"({x_max},", f"({x_max + 1},"))
        assert not re.fullmatch(regex, inside.replace(f",{y_max})", f",{y_max + 1})"))


def test_what_the_grammar_rejects():
    w, h = 1280, 720
    regex = re.compile(action_regex(w, h))
    h_bar, w_bar = smart_resize(h, w)
    assert (w_bar, h_bar) == (1288, 728)
    ok = "Thought: click the icon\nAction: click(start_box='(640,360)')"
    assert regex.fullmatch(ok)
    bad = [
        ok.replace("(640,", f"({w_bar},"),                 # x just outside the frame
        ok.replace(",360)", f",{h_bar})"),                 # y just outside
        ok.replace("(640,", "(0640,"),                     # leading zero
        ok.replace(",360)", ",00)"),
        ok.replace("(640,", "(-1,"),
        ok.replace("(640,360)", "(640, 360)"),             # only the plain form
        ok.replace("(640,", "(640.5,"),
        ok.replace("click the icon", "step 1: click"),     # colon in the thought
        ok.replace("click the icon", "first\nthen"),       # newline in the thought
        ok.replace("click the icon", "x" * (ACTION_REGEX_THOUGHT_CHARS + 1)),
        ok.replace("'(640,360)'", "'<|box_start|>(640,360)<|box_end|>'"),
        ok.replace("click(", "hover("),                    # not in the prompt's action space
        ok + "\n\nAction: wait()",                         # one action per reply
        ok + " ",
        "Action: click(start_box='(640,360)')",            # no thought header
        "Thought: x\nAction: hotkey(key='ctrl alt shift t')",   # four keys
        "Thought: x\nAction: hotkey(key='ctrl+c')",
        "Thought: x\nAction: hotkey(key='Ctrl c')",
        "Thought: x\nAction: hotkey(key='ctrl  c')",
        "Thought: x\nAction: hotkey(key='')",
        "Thought: x\nAction: press(key='enter')",
        "Thought: x\nAction: type(content='it's')",          # unescaped quote
        "Thought: x\nAction: type(content='a\\tb')",          # escape not offered
        "Thought: x\nAction: type(content='a\\')",            # lone backslash
        "Thought: x\nAction: type(content='line\nbreak')",    # raw newline
        "Thought: x\nAction: type(content='é')",
        "Thought: x\nAction: type(content='" + "a" * (ACTION_REGEX_CONTENT_CHARS + 1) + "')",
        "Thought: x\nAction: scroll(start_box='(1,1)', direction='sideways')",
        "Thought: x\nAction: scroll(direction='down')",
        "Thought: x\nAction: wait(5)",
    ]
    for text in bad:
        assert not regex.fullmatch(text), text
    good = [
        "Thought: \nAction: wait()",
        f"Thought: x\nAction: drag(start_box='(0,0)', end_box='({w_bar - 1},{h_bar - 1})')",
        "Thought: x\nAction: hotkey(key='ctrl shift esc')",
        "Thought: x\nAction: hotkey(key='launchmediaselect f12 9')",
        "Thought: x\nAction: type(content='it\\'s \"ok\"\\n\\\\')",
        "Thought: x\nAction: type(content='')",
        "Thought: x\nAction: finished(content='" + "a" * ACTION_REGEX_CONTENT_CHARS + "')",
        "Thought: x\nAction: scroll(start_box='(10,0)', direction='left')",
    ]
    for text in good:
        assert regex.fullmatch(text), text
        parse_response(text, w, h)


def test_a_frame_bound_by_max_pixels_limits_the_coordinates():
    small = re.compile(action_regex(1920, 1080, max_pixels=SMALL))
    full = re.compile(action_regex(1920, 1080))
    for x, in_small in [(1315, True), (1316, False), (1931, False)]:
        text = f"Thought: x\nAction: click(start_box='({x},100)')"
        assert bool(small.fullmatch(text)) == in_small, x
        assert full.fullmatch(text)
    assert not full.fullmatch("Thought: x\nAction: click(start_box='(1932,100)')")
    relative = re.compile(action_regex(1920, 1080, "uitars-1.0", max_pixels=SMALL))
    assert relative.fullmatch("Thought: x\nAction: click(start_box='(1000,1000)')")
    assert not relative.fullmatch("Thought: x\nAction: click(start_box='(1001,0)')")


def test_bad_arguments_are_programming_errors():
    with pytest.raises(ValueError, match="unknown model family"):
        action_regex(1280, 720, "gpt")
    with pytest.raises(ValueError):
        action_regex(0, 720)
    with pytest.raises(ValueError, match="both"):
        action_regex_max_chars(1280)


def test_the_regex_is_cached():
    assert action_regex(1366, 768) is action_regex(1366, 768)


# --------------------------------------------------------------------------- length bound


def test_the_length_bound_is_reached_and_exact():
    bound = action_regex_max_chars(1280, 720)
    # The longest reply: the longest thought, content made of escapes only.
    longest = ("Thought: " + "a" * ACTION_REGEX_THOUGHT_CHARS + "\nAction: finished(content='"
               + "\\n" * ACTION_REGEX_CONTENT_CHARS + "')")
    assert re.fullmatch(action_regex(1280, 720), longest)
    assert len(longest) == bound == 178
    assert action_regex_max_chars() == 178


@pytest.mark.parametrize(("width", "height", "family", "pixels"), CASES, ids=CASE_IDS)
def test_the_length_bound_is_the_regex_width(width, height, family, pixels):
    parser = getattr(re, "_parser", None)  # CPython's regex parser knows a pattern's width
    if parser is None:
        pytest.skip("no re._parser on this Python")
    for call_user in (True, False):
        regex = action_regex(width, height, family, call_user=call_user, **pixels)
        _, widest = parser.parse(regex).getwidth()
        assert widest == action_regex_max_chars(
            width, height, family, call_user=call_user, **pixels)
        assert widest <= action_regex_max_chars(family=family, **pixels)


@pytest.mark.parametrize(
    ("width", "height"),
    [(1, 1), (28, 28), (1, 200), (200, 1), (56, 11200), (11200, 56), (5120, 2880),
     (15360, 8640), (100000, 500), (3000, 3000)],
)
@pytest.mark.parametrize("pixels", [{}, {"max_pixels": SMALL}, {"min_pixels": 4 * 28 * 28}])
def test_the_screenless_bound_covers_every_screen(width, height, pixels):
    assert action_regex_max_chars(width, height, **pixels) <= action_regex_max_chars(**pixels)
    # The frame's digits are what grows with the screen: the screenless bound's side covers
    # every frame, not only those whose digits happen to fit.
    x_max, y_max = _frame_max(width, height, "uitars-1.5", pixels)
    bounds = {"min_pixels": MIN_PIXELS, "max_pixels": MAX_PIXELS, **pixels}
    assert max(x_max, y_max) < _max_frame_side("uitars-1.5", **bounds)


# --------------------------------------------------------------------------- dialect


def _dialect_problems(pattern: str) -> list[str]:
    """What in ``pattern`` is outside the portable dialect: escapes other than metacharacters
    and ``\\n``, ``*``, ``+``, ``.``, anchors, ``(?``, lazy or unbounded repetition."""
    problems = []
    metachar_escapes = set("\\.^$*+?{}[]()|-'\"/n")
    i, n = 0, len(pattern)
    quantified = False  # the previous item was a quantifier
    while i < n:
        c = pattern[i]
        if c == "\\":
            if i + 1 >= n or pattern[i + 1] not in metachar_escapes:
                problems.append(f"escape {pattern[i:i + 2]!r} at {i}")
            i += 2
            quantified = False
            continue
        if c == "[":
            j = i + 1
            if j < n and pattern[j] == "^":
                j += 1
            if j < n and pattern[j] == "]":
                problems.append(f"']' first in a class at {i}")
            while j < n and pattern[j] != "]":
                if pattern[j] == "\\":
                    if j + 1 >= n or pattern[j + 1] not in metachar_escapes:
                        problems.append(f"escape {pattern[j:j + 2]!r} in a class at {j}")
                    j += 1
                elif pattern[j] == "[" or pattern[j:j + 2] in ("&&", "--", "~~"):
                    problems.append(f"nested class or set operation at {j}")
                j += 1
            if j >= n:
                problems.append(f"unclosed class at {i}")
            i = j + 1
            quantified = False
            continue
        if c in "*+.^$":
            problems.append(f"{c!r} at {i}")
        elif c == "(" and pattern[i + 1:i + 2] == "?":
            problems.append(f"'(?' at {i}")
        elif c == "?":
            if quantified:
                problems.append(f"lazy quantifier at {i}")
            quantified = True
            i += 1
            continue
        elif c == "{":
            m = re.compile(r"\{([0-9]+)(,([0-9]+))?\}").match(pattern, i)
            if not m or (m.group(2) and int(m.group(3)) < int(m.group(1))):
                problems.append(f"unbounded or malformed repetition at {i}")
                i += 1
            else:
                if quantified:
                    problems.append(f"repeated quantifier at {i}")
                i = m.end()
            quantified = True
            if i < n and pattern[i] == "?":
                problems.append(f"lazy quantifier at {i}")
            continue
        i += 1
        quantified = False
    return problems


@pytest.mark.parametrize(
    "bad", [r"\d", r"\s", r"\w", r"a*", r"a+", r"(?:a)", r"(?=a)", r"a{1,}", r"a{2,3}?",
            r"a??", r"^a", r"a$", r"a.b", r"[a-z]+", r"[[a]]", r"[a&&b]", r"\bword"],
)
def test_the_dialect_check_can_fail(bad):
    assert _dialect_problems(bad), bad


@pytest.mark.parametrize("ok", [r"\*", r"\+", r"[*+.?]", r"a{0,3}", r"(a|b)?", r"\(\)", r"\n"])
def test_the_dialect_check_accepts_the_portable_forms(ok):
    assert not _dialect_problems(ok), ok


@pytest.mark.parametrize(("width", "height", "family", "pixels"), CASES, ids=CASE_IDS)
def test_the_regex_keeps_to_the_portable_dialect(width, height, family, pixels):
    for call_user in (True, False):
        regex = action_regex(width, height, family, call_user=call_user, **pixels)
        assert _dialect_problems(regex) == []
        re.compile(regex)


def _grammar_samples() -> tuple[list[str], list[str]]:
    regex = re.compile(action_regex(1280, 720))
    good = [
        "Thought: ok\nAction: click(start_box='(1287,727)')",
        "Thought: a\nAction: type(content='a\\'b\\nc\\\\ \"q\"')",
        "Thought: a\nAction: hotkey(key='ctrl shift esc')",
        "Thought: \nAction: call_user()",
        "Thought: it's fine\nAction: drag(start_box='(0,0)', end_box='(10,20)')",
        "Thought: x\nAction: scroll(start_box='(5,6)', direction='down')",
    ]
    bad = [
        "Thought: ok\nAction: click(start_box='(1288,727)')",
        "Thought: ok\nAction: click(start_box='(01,7)')",
        "Thought: a: b\nAction: wait()",
        "Thought: a\nAction: type(content='a'b')",
        "Thought: a\nAction: hotkey(key='a b c d')",
    ]
    assert all(regex.fullmatch(t) for t in good) and not any(regex.fullmatch(t) for t in bad)
    return good, bad


def test_xgrammar_reads_the_regex_as_re_does():
    xgrammar = pytest.importorskip("xgrammar")
    from xgrammar.testing import _is_grammar_accept_string

    grammar = xgrammar.Grammar.from_regex(action_regex(1280, 720))
    good, bad = _grammar_samples()
    for text in good:
        assert _is_grammar_accept_string(grammar, text), text
    for text in bad:
        assert not _is_grammar_accept_string(grammar, text), text


def test_outlines_reads_the_regex_as_re_does():
    outlines_core = pytest.importorskip("outlines_core")
    chars = [chr(c) for c in range(32, 127)] + ["\n"]
    vocabulary = outlines_core.Vocabulary(len(chars), {c: [i] for i, c in enumerate(chars)})
    index = outlines_core.Index(action_regex(1280, 720), vocabulary)

    def accepts(text: str) -> bool:
        state = index.get_initial_state()
        for c in text:
            state = index.get_next_state(state, chars.index(c))
            if state is None:
                return False
        return index.is_final_state(state)

    good, bad = _grammar_samples()
    for text in good:
        assert accepts(text), text
    for text in bad:
        assert not accepts(text), text


# --------------------------------------------------------------------------- pixel bounds


def test_image_tokens():
    assert image_tokens(1280, 720) == 1196 == (728 // 28) * (1288 // 28)
    assert image_tokens(1920, 1080) == 2691 == (1092 // 28) * (1932 // 28)
    assert smart_resize(1080, 1920, max_pixels=SMALL) == (728, 1316)
    assert image_tokens(1920, 1080, max_pixels=SMALL) == 1222 == 26 * 47
    assert image_tokens(10, 10) == 100  # scaled up to MIN_PIXELS: 280x280
    assert image_tokens(10, 10, min_pixels=4 * 28 * 28) == 4  # 56x56
    assert IMAGE_WRAPPER_TOKENS == 2


def test_a_smaller_max_pixels_maps_through_the_smaller_frame():
    reply = "Thought: centre\nAction: click(start_box='(658,364)')"
    action = parse_response(reply, 1920, 1080, max_pixels=SMALL).actions[0]
    assert action.point == (960, 540)
    assert parse_response(reply, 1920, 1080).actions[0].point == (654, 360)  # 1932x1092 frame
    assert model_to_screen((658, 364), 1920, 1080, max_pixels=SMALL) == (960, 540)
    assert screen_to_model((960, 540), 1920, 1080, max_pixels=SMALL) == (658, 364)
    assert screen_to_model((960, 540), 1920, 1080) == (966, 546)
    assert format_action(Action("click", point=(960, 540)), 1920, 1080, max_pixels=SMALL) \
        == "click(start_box='(658,364)')"
    drag = Action("drag", point=(0, 0), end_point=(1919, 1079))
    text = format_response("d", [drag], 1920, 1080, max_pixels=SMALL)
    assert text.endswith("drag(start_box='(0,0)', end_box='(1315,727)')")
    back = parse_response(text, 1920, 1080, max_pixels=SMALL).actions[0]
    assert (back.point, back.end_point) == ((0, 0), (1919, 1079))


def test_uitars_1_0_ignores_the_pixel_bounds():
    for pixels in ({}, {"max_pixels": SMALL}, {"min_pixels": 1000 * 28 * 28}):
        assert model_to_screen((500, 500), 1920, 1080, "uitars-1.0", **pixels) == (960, 540)
        assert screen_to_model((960, 540), 1920, 1080, "uitars-1.0", **pixels) == (500, 500)


def test_screen_to_model_stays_in_the_frame_on_a_screen_over_twice_its_size():
    # 3840x2160 is seen as 728x1316: the last screen column maps to 1315.66, not to 1316.
    assert smart_resize(2160, 3840, max_pixels=SMALL) == (728, 1316)
    assert screen_to_model((3839, 2159), 3840, 2160, max_pixels=SMALL) == (1315, 727)
    assert screen_to_model((0, 0), 3840, 2160, max_pixels=SMALL) == (0, 0)
