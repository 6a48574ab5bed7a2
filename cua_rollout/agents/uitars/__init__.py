"""The UI-TARS agent's protocol: model text -> typed actions -> pyautogui code, and back.

    coordinates  where the model's points live (1.5: the resized image's pixels; 1.0: 0..1000)
    parser       replies -> typed actions (``parse_response``)
    codegen      typed actions -> OSWorld's pyautogui code or DONE / WAIT / FAIL
    history      past actions written back into the prompt
    grammar      the regular expression of every reply the parser accepts
    prompt       the prompt and the messages of one request

Pure functions, no I/O; every ``Action`` carries screen pixels. The image geometry they build
on is ``cua_rollout.core.vision``'s.
"""

from __future__ import annotations

from cua_rollout.agents.uitars.codegen import split_terminal, to_pyautogui
from cua_rollout.agents.uitars.coordinates import (
    FAMILIES,
    RELATIVE_SCALE,
    Family,
    model_to_screen,
    screen_to_model,
)
from cua_rollout.agents.uitars.grammar import (
    ACTION_REGEX_CONTENT_CHARS,
    ACTION_REGEX_THOUGHT_CHARS,
    action_regex,
    action_regex_max_chars,
)
from cua_rollout.agents.uitars.history import add_box_token
from cua_rollout.agents.uitars.parser import (
    ACTION_KINDS,
    KEY_KINDS,
    POINTER_KINDS,
    SCROLL_DIRECTIONS,
    TERMINAL_KINDS,
    Action,
    ParsedResponse,
    normalize_key,
    parse_response,
)

__all__ = [
    "ACTION_KINDS", "ACTION_REGEX_CONTENT_CHARS", "ACTION_REGEX_THOUGHT_CHARS", "FAMILIES",
    "KEY_KINDS", "POINTER_KINDS", "RELATIVE_SCALE", "SCROLL_DIRECTIONS", "TERMINAL_KINDS",
    "Action", "Family", "ParsedResponse", "action_regex", "action_regex_max_chars",
    "add_box_token", "model_to_screen", "normalize_key",
    "parse_response", "screen_to_model", "split_terminal", "to_pyautogui",
]
