"""OSWorld's prompt agent, reimplemented (``agent.name: osworld-prompt``): one system prompt
per action space and observation type, the last ``max_trajectory_length`` steps (each one's
observation and reply) as the history, then the current observation; replies read as
fenced pyautogui code or computer_13 JSON actions (replies.py). Settings:
``agent.osworld_prompt`` (cua_rollout.config.OSWorldPromptConfig)."""

from __future__ import annotations

import base64
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

from cua_rollout.agents.base import AgentRequest, Decision, ParseRecord
from cua_rollout.agents.osworld.a11y import Mark, draw_marks, linearize, trim
from cua_rollout.agents.osworld.prompt import observation_text, system_prompt
from cua_rollout.agents.osworld.replies import Reading, read_computer13, read_pyautogui
from cua_rollout.config import AgentConfig
from cua_rollout.core.errors import ActionParseError
from cua_rollout.core.screenshot import Screenshot
from cua_rollout.core.types import FAIL
from cua_rollout.core.vision import IMAGE_WRAPPER_TOKENS, image_tokens

__all__ = ["OSWorldPromptAgent", "png_of"]

# What an unparseable reply leaves in the history (OSWorld's words for an empty thought).
NO_VALID_ACTION = "No valid action"


def png_of(shot: Screenshot) -> bytes:
    """The screenshot's PNG, also once stored and let go: read back from its file or its
    data URL."""
    if shot.png is not None:
        return shot.png
    if shot.file_url is not None:
        return Path(unquote(urlsplit(shot.file_url).path)).read_bytes()
    return base64.b64decode(str(shot.data_url).partition(",")[2])


@dataclass
class _Turn:
    """A past step as the history shows it: its image (the screenshot or the marked one;
    None once out of the window), its table, the reply."""

    image: Screenshot | None
    table: str | None
    reply: str


class OSWorldPromptAgent:
    """One episode's prompt agent (``cua_rollout.agents.base.Agent``)."""

    name = "osworld-prompt"
    constrained = False

    def __init__(self, settings: AgentConfig, *, instruction: str, max_tokens: int) -> None:
        self.settings = settings
        self.o = settings.osworld_prompt
        self.instruction = instruction
        self.max_tokens = max_tokens
        self.max_parse_retries = settings.max_parse_retries
        self.action_format = self.o.action_space
        self.observes_a11y_tree = self.o.observation_type != "screenshot"
        self.history: list[_Turn] = []
        # The current step's observation, as the request showed it.
        self._image: Screenshot | None = None
        self._table: str | None = None
        self._marks: list[Mark] | None = None
        self._parsed_ok = True

    # ----------------------------------------------------------------- the request

    def _observe(self, shot: Screenshot, a11y_tree: str | None) -> Screenshot | None:
        kind = self.o.observation_type
        self._marks = None
        if kind == "screenshot":
            self._table = None
            return shot
        if a11y_tree is None:
            raise ValueError(f"observation_type {kind} needs the accessibility tree")
        if kind == "som":
            png, self._marks, table = draw_marks(png_of(shot), a11y_tree)
            self._table = trim(table, self.o.a11y_tree_max_chars)
            return Screenshot(png)
        self._table = trim(linearize(a11y_tree), self.o.a11y_tree_max_chars)
        return None if kind == "a11y_tree" else shot

    def _user(self, image: Screenshot | None, table: str | None) -> dict[str, Any]:
        content: list[dict[str, Any]] = [
            {"type": "text", "text": observation_text(self.o.observation_type, table)}]
        if image is not None:
            content.append({"type": "image_url", "image_url": {"url": image.url}})
        return {"role": "user", "content": content}

    def request(self, shot: Screenshot, a11y_tree: str | None = None) -> AgentRequest:
        o = self.o
        width, height = shot.size
        image = self._image = self._observe(shot, a11y_tree)
        messages: list[dict[str, Any]] = [{"role": "system", "content": [{
            "type": "text", "text": system_prompt(
                self.instruction, observation_type=o.observation_type,
                action_space=o.action_space, width=width, height=height,
                password=o.password)}]}]
        window = self.history[-o.max_trajectory_length:] if o.max_trajectory_length else []
        images: list[Screenshot] = []
        for turn in window:
            messages.append(self._user(turn.image, turn.table))
            messages.append({"role": "assistant", "content": [
                {"type": "text", "text": turn.reply.strip() or NO_VALID_ACTION}]})
            if turn.image is not None:
                images.append(turn.image)
        messages.append(self._user(image, self._table))
        if image is not None:
            images.append(image)
        s = self.settings
        tokens = image_tokens(width, height, min_pixels=s.min_pixels, max_pixels=s.max_pixels)
        per_image = IMAGE_WRAPPER_TOKENS + tokens
        least = (len(images) * per_image + self.max_tokens,
                 f"{len(images)} screenshot(s) of {width}x{height} ({per_image} tokens each) "
                 f"and a reply of up to {self.max_tokens} tokens")
        return AgentRequest(messages, images, tokens, least_tokens=least,
                            a11y_tree=self._table,
                            marked=image if self._marks is not None else None)

    # ----------------------------------------------------------------- the reply

    def parse(self, text: str, shot: Screenshot,
              tool_calls: list[dict[str, Any]] | None = None) -> Reading:
        """The reply's code (or actions) and special action; ``ActionParseError`` when it
        has none or one does not read."""
        width, height = shot.size
        if self.o.action_space == "computer_13":
            reading = read_computer13(text, width, height)
        else:
            reading = read_pyautogui(text, width, height, self._marks)
        if not reading.code and reading.terminal is None:
            raise ActionParseError("the reply holds no action", text)
        return reading

    def decide(self, parsed: Reading | None) -> Decision:
        """The code before the first special action runs; the special action (WAIT, DONE,
        FAIL) follows. An unparseable reply (None) is FAIL, as OSWorld's loop ends an
        example whose reply yields no actions list."""
        self._parsed_ok = parsed is not None
        if parsed is None:
            return Decision(None, FAIL, ParseRecord(None, []))
        code = "\n".join(parsed.code) if parsed.code else None
        return Decision(code, parsed.terminal,
                        ParseRecord(parsed.thought or None, parsed.actions))

    def remember(self, shot: Screenshot, text: str) -> Screenshot | None:
        self.history.append(_Turn(self._image, self._table,
                                  text if self._parsed_ok else ""))
        self._image = self._table = None
        old = len(self.history) - 1 - self.o.max_trajectory_length
        if old < 0 or (gone := self.history[old].image) is None:
            return None
        self.history[old].image = None  # never sent again
        return gone
