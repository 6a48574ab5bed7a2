"""Qwen-VL's computer-use agent (``agent.name: qwen-computer-use``): the ``computer_use``
function tool of Qwen2.5-VL / Qwen3-VL (left_click, type, key, scroll, wait, terminate ...),
offered as an OpenAI tool (the server's tool parser returns ``tool_calls``: vLLM's hermes
parser) or described in the system prompt, and read from ``tool_calls`` or from the
``<tool_call>{...}</tool_call>`` blocks of the reply's text. Coordinates are pixels of the
``smart_resize``d screenshot (Qwen2.5-VL) or 0..1000 on each axis (Qwen3-VL). The tool's
actions follow Qwen's cookbook ``ComputerUse`` tool; the words are ours. Settings:
``agent.qwen_computer_use`` (cua_rollout.config.QwenComputerUseConfig)."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from cua_rollout.agents.base import AgentRequest, Decision, ParseRecord
from cua_rollout.agents.uitars import Action, normalize_key, to_pyautogui
from cua_rollout.agents.uitars.coordinates import RELATIVE_SCALE, Frame, frame_of
from cua_rollout.config import AgentConfig
from cua_rollout.core.errors import ActionParseError
from cua_rollout.core.screenshot import Screenshot
from cua_rollout.core.types import DONE, FAIL, WAIT
from cua_rollout.core.vision import IMAGE_WRAPPER_TOKENS, image_tokens

__all__ = ["ACTIONS", "ARGUMENTS", "TASK_HEADER", "TOOL_NAME", "QwenCall",
           "QwenComputerUseAgent", "computer_use_tool", "read_calls", "tool_call_text"]

TOOL_NAME = "computer_use"
TASK_HEADER = "## Task\n"
# action -> the arguments it needs (besides ``action``).
ACTIONS: dict[str, tuple[str, ...]] = {
    "key": ("keys",), "type": ("text",), "mouse_move": ("coordinate",),
    "left_click": (), "left_click_drag": ("coordinate",), "right_click": (),
    "middle_click": (), "double_click": (), "triple_click": (), "scroll": ("pixels",),
    "hscroll": ("pixels",), "wait": (), "terminate": ("status",),
}
ARGUMENTS = ("action", "keys", "text", "coordinate", "pixels", "time", "status")
_CLICKS = {"left_click": "click", "right_click": "right_single", "double_click": "left_double",
           "mouse_move": "hover"}
_INLINE = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


def computer_use_tool(width: int, height: int) -> dict[str, Any]:
    """The tool as an OpenAI function; ``width`` x ``height``: the frame coordinates are in
    (the resized screenshot, or 1000 x 1000)."""
    actions = "\n".join([
        "The action to do:",
        "* `key`: press the keys of `keys` down in order, then release them in reverse.",
        "* `type`: type the string `text`.",
        "* `mouse_move`: move the pointer to `coordinate`.",
        "* `left_click`, `right_click`, `middle_click`, `double_click`, `triple_click`: "
        "click at `coordinate` (or where the pointer is).",
        "* `left_click_drag`: hold the left button from the pointer to `coordinate`.",
        "* `scroll` / `hscroll`: turn the wheel `pixels` clicks (positive: up / right), at "
        "`coordinate` if given.",
        "* `wait`: wait for the screen to change.",
        "* `terminate`: end the task, with `status` success or failure."])
    description = "\n".join([
        "Control the computer's mouse and keyboard; every call is followed by a new "
        "screenshot.",
        f"* The screen's resolution is {width}x{height}.",
        "* Read coordinates off the latest screenshot; aim at the centre of an element.",
        "* Applications may take time to open or react: wait, then look again."])
    return {"type": "function", "function": {
        "name": TOOL_NAME, "description": description,
        "parameters": {"type": "object", "required": ["action"], "properties": {
            "action": {"type": "string", "enum": list(ACTIONS), "description": actions},
            "keys": {"type": "array", "description": "Keys, for action=key."},
            "text": {"type": "string", "description": "Text, for action=type."},
            "coordinate": {"type": "array", "description": "(x, y): pixels from the left "
                           "and top edges."},
            "pixels": {"type": "number", "description": "Scroll amount, for scroll and "
                       "hscroll."},
            "time": {"type": "number", "description": "Seconds, for action=wait."},
            "status": {"type": "string", "enum": ["success", "failure"],
                       "description": "For action=terminate."}}}}}


def _tools_text(tool: dict[str, Any]) -> str:
    """The tool described in a system prompt as Qwen's chat template does with ``tools``
    (for a server without a tool parser)."""
    return ("# Tools\n\nYou may call one or more functions to assist with the user query."
            "\n\nYou are provided with function signatures within <tools></tools> XML tags:"
            f"\n<tools>\n{json.dumps(tool)}\n</tools>\n\nFor each function call, return a "
            "json object with function name and arguments within <tool_call></tool_call> "
            'XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": '
            "<args-json-object>}\n</tool_call>")


def tool_call_text(arguments: dict[str, Any]) -> str:
    """A call as Qwen writes it inline."""
    return ("<tool_call>\n" + json.dumps({"name": TOOL_NAME, "arguments": arguments})
            + "\n</tool_call>")


@dataclass(frozen=True)
class QwenCall:
    """One checked call: its arguments as written, and the point in screen pixels."""

    arguments: dict[str, Any]
    point: tuple[int, int] | None

    def record(self) -> dict[str, Any]:
        return {**self.arguments, "screen_point": self.point}


def read_calls(text: str, tool_calls: list[dict[str, Any]] | None
               ) -> tuple[list[tuple[str, Any]], str]:
    """(name, arguments) of every call of a reply, from ``tool_calls`` or else the
    ``<tool_call>`` blocks of ``text``; and the text outside them."""
    calls: list[tuple[str, Any]] = []
    for raw in tool_calls or []:
        function = raw.get("function") if isinstance(raw, dict) else None
        if not isinstance(function, dict):
            raise ActionParseError("a tool call without a function", json.dumps(raw)[:200])
        arguments = function.get("arguments")
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments or "{}")
            except (ValueError, RecursionError):
                raise ActionParseError("a tool call's arguments are not JSON",
                                       arguments) from None
        calls.append((str(function.get("name")), arguments))
    if calls:
        return calls, text.strip()
    if text.count("<tool_call>") != text.count("</tool_call>"):
        raise ActionParseError("an unclosed <tool_call>", text)
    for body in _INLINE.findall(text):
        try:
            call = json.loads(body)
        except (ValueError, RecursionError):
            raise ActionParseError("a <tool_call> is not JSON", text) from None
        if not isinstance(call, dict):
            raise ActionParseError("a <tool_call> is not a JSON object", text)
        calls.append((str(call.get("name")), call.get("arguments")))
    return calls, _INLINE.sub("", text).strip()


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def check_call(name: str, arguments: Any, frame: Frame) -> QwenCall:
    """One call checked against the tool (``ValueError`` saying what is wrong)."""
    if name != TOOL_NAME:
        raise ValueError(f"unknown tool {name!r} (the tool is {TOOL_NAME})")
    if not isinstance(arguments, dict):
        raise ValueError("the arguments are not a JSON object")
    unknown = sorted(set(arguments) - set(ARGUMENTS))
    if unknown:
        raise ValueError(f"unknown argument(s) {', '.join(unknown)} (known: "
                         f"{', '.join(ARGUMENTS)})")
    action = arguments.get("action")
    if action not in ACTIONS:
        raise ValueError(f"unknown action {action!r} (known: {', '.join(ACTIONS)})")
    missing = [a for a in ACTIONS[action] if a not in arguments]
    if missing:
        raise ValueError(f"{action} needs {', '.join(missing)}")
    keys = arguments.get("keys")
    if action == "key" and not (isinstance(keys, list) and keys
                                and all(isinstance(k, str) and k for k in keys)):
        raise ValueError("key: keys must be a list of key names")
    if action == "type" and not isinstance(arguments["text"], str):
        raise ValueError("type: text must be a string")
    if action in ("scroll", "hscroll") and not _number(arguments["pixels"]):
        raise ValueError(f"{action}: pixels must be a number")
    if action == "terminate" and arguments["status"] not in ("success", "failure"):
        raise ValueError("terminate: status must be success or failure")
    point = None
    coordinate = arguments.get("coordinate")
    if coordinate is not None and action not in ("key", "type", "wait", "terminate"):
        if not (isinstance(coordinate, list) and len(coordinate) == 2
                and all(_number(v) for v in coordinate)):
            raise ValueError(f"{action}: coordinate must be [x, y], not {coordinate!r}")
        x_max, y_max = frame.limits
        x, y = coordinate
        if not (0 <= x <= x_max and 0 <= y <= y_max):
            raise ValueError(f"{action}: coordinate {coordinate} is off the "
                             f"{x_max + 1}x{y_max + 1} frame")
        point = frame.to_screen((x, y))
    return QwenCall(arguments, point)


def _code(call: QwenCall) -> str:
    a, point = call.arguments, call.point
    action = a["action"]
    if action in _CLICKS and (point is not None or action != "mouse_move"):
        if point is None:  # a click where the pointer is
            button = "right" if action == "right_click" else "left"
            clicks = 2 if action == "double_click" else 1
            return f"pyautogui.click(button={button!r}, clicks={clicks})"
        return to_pyautogui([Action(_CLICKS[action], point=point)])
    at = f"{point[0]}, {point[1]}" if point else ""
    if action == "middle_click":
        return f"pyautogui.middleClick({at})"
    if action == "triple_click":
        return f"pyautogui.tripleClick({at})"
    if action == "left_click_drag":
        return f"pyautogui.dragTo({at}, duration=0.5, button='left')"
    if action == "key":
        keys = [normalize_key(k) for k in a["keys"]]
        return f"pyautogui.hotkey({', '.join(repr(k) for k in keys)})"
    if action == "type":
        return to_pyautogui([Action("type", content=a["text"])])
    if action in ("scroll", "hscroll"):
        where = f", x={point[0]}, y={point[1]}" if point else ""
        return f"pyautogui.{action}({round(a['pixels'])}{where})"
    raise ValueError(f"{action} runs no code")


@dataclass
class QwenReply:
    """A read reply: the code of the calls before the first terminal one, that terminal
    action, the text and the calls (the record)."""

    code: list[str]
    terminal: str | None
    thought: str
    calls: list[QwenCall]


@dataclass
class _Turn:
    image: Screenshot | None
    reply: str   # the reply as the history shows it (its calls written inline)


class QwenComputerUseAgent:
    """One episode's computer-use agent (``cua_rollout.agents.base.Agent``)."""

    name = "qwen-computer-use"
    action_format = "qwen_tool_call"
    constrained = False
    observes_a11y_tree = False

    def __init__(self, settings: AgentConfig, *, instruction: str, max_tokens: int) -> None:
        self.settings = settings
        self.q = settings.qwen_computer_use
        self.instruction = instruction
        self.max_tokens = max_tokens
        self.max_parse_retries = settings.max_parse_retries
        self.history: list[_Turn] = []
        self._reply_shown = ""

    def frame(self, shot: Screenshot) -> Frame:
        width, height = shot.size
        s = self.settings
        return frame_of(width, height, "uitars-1.5" if self.q.coordinates == "absolute"
                        else "uitars-1.0", min_pixels=s.min_pixels, max_pixels=s.max_pixels)

    def request(self, shot: Screenshot, a11y_tree: str | None = None) -> AgentRequest:
        s = self.settings
        frame = self.frame(shot)
        size = (RELATIVE_SCALE, RELATIVE_SCALE) if self.q.coordinates == "relative" else (
            int(frame.width), int(frame.height))
        tool = computer_use_tool(*size)
        system = ("You operate a Linux desktop computer to carry out the user's task, one "
                  "action at a time, with the computer_use tool. Think briefly, then call "
                  "the tool; call terminate when the task is done or cannot be done.")
        if not self.q.send_tools:
            system += "\n\n" + _tools_text(tool)
        messages: list[dict[str, Any]] = [
            {"role": "system", "content": system},
            {"role": "user", "content": [{"type": "text",
                                          "text": f"{TASK_HEADER}{self.instruction}"}]}]
        window = self.history[-(s.history_texts):]
        images = []
        for i, turn in enumerate(window):
            if i:
                messages.append(self._user(turn.image))
            elif turn.image is not None:
                messages[-1]["content"].append(_image(turn.image))
            if turn.image is not None:
                images.append(turn.image)
            messages.append({"role": "assistant", "content": turn.reply})
        if window:
            messages.append(self._user(shot))
        else:
            messages[-1]["content"].append(_image(shot))
        images.append(shot)
        width, height = shot.size
        tokens = image_tokens(width, height, min_pixels=s.min_pixels, max_pixels=s.max_pixels)
        per_image = IMAGE_WRAPPER_TOKENS + tokens
        least = (len(images) * per_image + self.max_tokens,
                 f"{len(images)} screenshot(s) of {width}x{height} ({per_image} tokens each) "
                 f"and a reply of up to {self.max_tokens} tokens")
        return AgentRequest(messages, images, tokens, least_tokens=least,
                            tools=[tool] if self.q.send_tools else None,
                            tool_choice="auto" if self.q.send_tools else None)

    @staticmethod
    def _user(image: Screenshot | None) -> dict[str, Any]:
        if image is None:
            return {"role": "user", "content": [
                {"type": "text", "text": "(an earlier screenshot, no longer shown)"}]}
        return {"role": "user", "content": [_image(image)]}

    def parse(self, text: str, shot: Screenshot,
              tool_calls: list[dict[str, Any]] | None = None) -> QwenReply:
        raw, thought = read_calls(text, tool_calls)
        # What a failure keeps: the reply's text, or its calls when it has no text.
        kept = text if text.strip() or not tool_calls else json.dumps(tool_calls)
        if not raw:
            raise ActionParseError("the reply calls no tool", kept)
        if len(raw) > self.q.max_calls_per_reply:
            raise ActionParseError(f"{len(raw)} tool calls in one reply (at most "
                                   f"{self.q.max_calls_per_reply})", kept)
        frame = self.frame(shot)
        calls = []
        for name, arguments in raw:
            try:
                calls.append(check_call(name, arguments, frame))
            except ValueError as exc:
                raise ActionParseError(str(exc), json.dumps(
                    {"name": name, "arguments": arguments})) from None
        code: list[str] = []
        terminal = None
        for call in calls:
            action = call.arguments["action"]
            if action == "terminate":
                terminal = DONE if call.arguments["status"] == "success" else FAIL
                break
            if action == "wait":
                terminal = WAIT
                break
            code.append(_code(call))
        # The history shows the calls inline, as Qwen's chat template renders them.
        self._reply_shown = "\n".join(
            [thought, *(tool_call_text(c.arguments) for c in calls)]).strip()
        return QwenReply(code, terminal, thought, calls)

    def decide(self, parsed: QwenReply | None) -> Decision:
        """The calls before a terminal one run; ``terminate`` is DONE (success) or FAIL,
        ``wait`` WAIT. An unparseable reply (None) is FAIL."""
        if parsed is None:
            self._reply_shown = ""
            return Decision(None, FAIL, ParseRecord(None, []))
        return Decision("\n".join(parsed.code) if parsed.code else None, parsed.terminal,
                        ParseRecord(parsed.thought or None, [c.record() for c in parsed.calls]))

    def remember(self, shot: Screenshot, text: str) -> Screenshot | None:
        self.history.append(_Turn(shot, self._reply_shown or text))
        self._reply_shown = ""
        # The current screenshot is one of history_images: history_images - 1 past ones.
        old = len(self.history) - self.settings.history_images
        if old < 0 or (gone := self.history[old].image) is None:
            return None
        self.history[old].image = None
        return gone


def _image(shot: Screenshot) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": shot.url}}
