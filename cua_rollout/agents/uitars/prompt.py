"""Prompt templates (UI-TARS 1.5 computer use) and the chat messages of one model request.

Screenshots are encoded to base64 once, on first use, and the same data URL string is reused
by every later request while the screenshot stays in the history window. It is a ``DataURL``:
the model client embeds it in request bodies as it is, without JSON-escaping megabytes again.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Any

from cua_rollout.agents.uitars import add_box_token
from cua_rollout.core.screenshot import Screenshot

__all__ = ["SYSTEM_PROMPT", "Turn", "build_messages", "build_prompt", "window_screenshots"]

SYSTEM_PROMPT = "You are a helpful assistant."


# The action space the model was trained with; coordinates are written as box tokens.
_ACTION_SPACE = """click(start_box='<|box_start|>(x1,y1)<|box_end|>')
left_double(start_box='<|box_start|>(x1,y1)<|box_end|>')
right_single(start_box='<|box_start|>(x1,y1)<|box_end|>')
drag(start_box='<|box_start|>(x1,y1)<|box_end|>', end_box='<|box_start|>(x3,y3)<|box_end|>')
hotkey(key='ctrl c') # Split keys with a space and use lowercase. Also, do not use more than 3 keys in one hotkey action.
type(content='xxx') # Use escape characters \\', \\", and \\n in content part to ensure we can parse the content in normal python string format. If you want to submit your input, use \\n at the end of content.
scroll(start_box='<|box_start|>(x1,y1)<|box_end|>', direction='down or up or right or left') # Show more information on the `direction` side.
wait() #Sleep for 5s and take a screenshot to check for any changes.
finished(content='xxx') # Use escape characters \\', \\", and \\n in content part to ensure we can parse the content in normal python string format."""

_CALL_USER = (
    "call_user() # Submit the task and call the user when the task is unsolvable, "
    "or when you need the user's help."
)

_TEMPLATE = """You are a GUI agent. You are given a task and your action history, with screenshots. You need to perform the next action to complete the task.

## Output Format
```
Thought: ...
Action: ...
```

## Action Space
{action_space}

## Note
- Use {language} in `Thought` part.
- Write a small plan and finally summarize your next action (with its target element) in one sentence in `Thought` part.{note}

## User Instruction
{instruction}
"""


def build_prompt(
    instruction: str,
    *,
    language: str = "English",
    call_user: bool = True,
    note: str | None = None,
) -> str:
    """The UI-TARS 1.5 computer-use prompt for one task.

    ``call_user`` offers the ``call_user()`` action (the model may then ask for help or
    declare a task infeasible); ``note`` adds a line to the Note section, for example
    where the sudo password is.
    """
    if not instruction.strip():
        raise ValueError("the task instruction is empty")
    action_space = _ACTION_SPACE + ("\n" + _CALL_USER if call_user else "")
    extra = f"\n- {note.strip()}" if note and note.strip() else ""
    return _TEMPLATE.format(
        action_space=action_space, language=language, note=extra, instruction=instruction
    )


@dataclass
class Turn:
    """One past step: the screenshot the model saw and the reply it gave. A caller may drop
    the screenshot (``None``) once the turn is older than the image window: it is never sent
    again."""

    screenshot: Screenshot | None
    response: str

    @cached_property
    def history_text(self) -> str:
        """The reply as it goes back to the model (points wrapped in box tokens)."""
        return add_box_token(self.response)


def build_messages(
    instruction: str,
    history: list[Turn],
    current: Screenshot,
    *,
    history_images: int = 5,
    history_texts: int = 35,
    language: str = "English",
    call_user: bool = True,
    note: str | None = None,
    system_prompt: str = SYSTEM_PROMPT,
    prompt: str | None = None,
) -> list[dict[str, Any]]:
    """OpenAI chat messages for the next step, in the layout UI-TARS agents use.

    System message, the prompt, then per kept past step its screenshot (only for the most
    recent steps, so that at most ``history_images`` images are sent counting the current
    one) and its reply, then the current screenshot. Only the last ``history_texts`` past
    replies are kept; older steps are dropped whole. ``prompt`` overrides the built prompt.
    """
    if history_images < 1:
        raise ValueError("history_images must be at least 1 (the current screenshot)")
    if history_texts < 0:
        raise ValueError("history_texts must not be negative")
    text = prompt if prompt is not None else build_prompt(
        instruction, language=language, call_user=call_user, note=note
    )
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": [{"type": "text", "text": system_prompt}]},
        {"role": "user", "content": [{"type": "text", "text": text}]},
    ]
    kept = history[-history_texts:] if history_texts else []
    with_image_from = len(kept) - (history_images - 1)
    for i, turn in enumerate(kept):
        if i >= with_image_from:
            if turn.screenshot is None:
                raise ValueError(f"turn {len(history) - len(kept) + i} is inside the image "
                                 "window but its screenshot was dropped")
            messages.append({"role": "user", "content": [_image_part(turn.screenshot)]})
        messages.append(
            {"role": "assistant", "content": [{"type": "text", "text": turn.history_text}]}
        )
    messages.append({"role": "user", "content": [_image_part(current)]})
    return messages


def window_screenshots(history: list[Turn], current: Screenshot, *, history_images: int = 5,
                       history_texts: int = 35) -> list[Screenshot]:
    """The screenshots ``build_messages`` sends with the same arguments, in prompt order."""
    kept = history[-history_texts:] if history_texts else []
    with_image_from = max(0, len(kept) - (history_images - 1))
    return [t.screenshot for t in kept[with_image_from:] if t.screenshot is not None] + [current]


def _image_part(shot: Screenshot) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": shot.url}}
