"""The UI-TARS agent of one episode: its prompt and history window, the reply parser, the
action grammar and the terminal policy, with the screen's frame (size, family, pixel bounds)
built once. Two registrations, one per family: ``uitars-1.5`` answers in pixels of the
resized screenshot, ``uitars-1.0`` in relative units 0..1000."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from cua_rollout.agents.base import AgentRequest, Decision, ParseRecord
from cua_rollout.agents.uitars.codegen import split_terminal, to_pyautogui
from cua_rollout.agents.uitars.grammar import action_regex
from cua_rollout.agents.uitars.parser import ParsedResponse, parse_response
from cua_rollout.agents.uitars.prompt import Turn, build_messages, window_screenshots
from cua_rollout.config import AgentConfig
from cua_rollout.core.errors import ActionParseError
from cua_rollout.core.screenshot import Screenshot
from cua_rollout.core.types import DONE, FAIL, WAIT
from cua_rollout.core.vision import IMAGE_WRAPPER_TOKENS, image_tokens

__all__ = ["UITars10Agent", "UITars15Agent", "UITarsAgent"]


@dataclass(frozen=True)
class _Frame:
    """What a screen size fixes for a whole episode: the grammar and the image tokens."""

    width: int
    height: int
    regex: str | None
    image_tokens: int   # placeholders of one screenshot, without the wrapper tokens


class UITarsAgent:
    """One episode's UI-TARS agent (``cua_rollout.agents.base.Agent``)."""

    family: ClassVar[str]
    action_format: ClassVar[str] = "uitars"
    observes_a11y_tree: ClassVar[bool] = False

    def __init__(self, settings: AgentConfig, *, instruction: str, max_tokens: int) -> None:
        self.settings = settings
        self.name = settings.name
        self.instruction = instruction
        self.max_tokens = max_tokens
        self.constrained = settings.constrain_actions
        self.max_parse_retries = settings.max_parse_retries
        self.history: list[Turn] = []
        self.call_user_waits = 0
        self._frame: _Frame | None = None

    def frame(self, shot: Screenshot) -> _Frame:
        """The frame of ``shot``'s size, made on the first screenshot (and again only if a
        desktop changed its size mid-episode)."""
        width, height = shot.size
        frame = self._frame
        if frame is None or (frame.width, frame.height) != (width, height):
            s = self.settings
            regex = action_regex(width, height, self.family, call_user=s.prompt_call_user,
                                 min_pixels=s.min_pixels, max_pixels=s.max_pixels
                                 ) if s.constrain_actions else None
            frame = self._frame = _Frame(width, height, regex, image_tokens(
                width, height, min_pixels=s.min_pixels, max_pixels=s.max_pixels))
        return frame

    def request(self, shot: Screenshot, a11y_tree: str | None = None) -> AgentRequest:
        s = self.settings
        frame = self.frame(shot)
        messages = build_messages(
            self.instruction, self.history, shot, history_images=s.history_images,
            history_texts=s.history_texts, language=s.prompt_language,
            call_user=s.prompt_call_user, note=s.prompt_note)
        shots = window_screenshots(self.history, shot, history_images=s.history_images,
                                   history_texts=s.history_texts)
        per_image = IMAGE_WRAPPER_TOKENS + frame.image_tokens
        least_tokens = (len(shots) * per_image + self.max_tokens,
                        f"{len(shots)} screenshot(s) of {frame.width}x{frame.height} "
                        f"({per_image} tokens each) and a reply of up to {self.max_tokens} "
                        "tokens")
        return AgentRequest(messages, shots, frame.image_tokens, frame.regex, least_tokens)

    def parse(self, text: str, shot: Screenshot,
              tool_calls: list[dict[str, Any]] | None = None) -> ParsedResponse:
        """The reply's actions in screen pixels (``tool_calls``: UI-TARS answers in text)."""
        width, height = shot.size
        parsed = parse_response(text, width, height, self.family,
                                min_pixels=self.settings.min_pixels,
                                max_pixels=self.settings.max_pixels)
        if not parsed.actions:
            raise ActionParseError("the reply has no action", text)
        return parsed

    def decide(self, parsed: ParsedResponse | None) -> Decision:
        """The actions before a terminal one run; ``finished`` is DONE, ``wait`` WAIT;
        ``call_user`` fails the episode, as UI-TARS agents do, or waits up to
        ``agent.call_user_max_waits`` times. An unparseable reply (None) is FAIL."""
        if parsed is None:
            return Decision(None, FAIL, ParseRecord(None, []))
        read = ParseRecord(parsed.thought, [a.record() for a in parsed.actions])
        before, kind = split_terminal(parsed.actions)
        code = to_pyautogui(before) if before else None
        if kind == "finished":
            return Decision(code, DONE, read)
        if kind == "wait":
            return Decision(code, WAIT, read)
        if kind == "call_user":
            if (self.settings.call_user == "wait"
                    and self.call_user_waits < self.settings.call_user_max_waits):
                self.call_user_waits += 1
                return Decision(code, WAIT, read)
            return Decision(code, FAIL, read)
        return Decision(code, None, read)

    def remember(self, shot: Screenshot, text: str) -> Screenshot | None:
        self.history.append(Turn(shot, text))
        old = len(self.history) - 1 - self.settings.history_images
        if old < 0 or (gone := self.history[old].screenshot) is None:
            return None
        self.history[old].screenshot = None  # never sent again
        return gone


class UITars15Agent(UITarsAgent):
    """UI-TARS 1.5: points in pixels of the ``smart_resize``d screenshot."""

    family = "uitars-1.5"


class UITars10Agent(UITarsAgent):
    """UI-TARS 1.0: points in relative units 0..1000 on each axis."""

    family = "uitars-1.0"
