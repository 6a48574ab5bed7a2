"""OSWorld's prompt agent, reimplemented (``agent.name: osworld-prompt``; docs/agents.md):

    a11y        the accessibility tree as OSWorld shows it: kept nodes, the linearized table,
                the cut, the set-of-marks screenshot
    computer13  the computer_13 action space: its definition, checks and code
    replies     replies -> code blocks or computer_13 actions (several per reply)
    prompt      our system prompts and observation turns (not OSWorld's verbatim text)
    agent       OSWorldPromptAgent: observation types, history window, terminal policy
"""

from __future__ import annotations

from cua_rollout.agents.osworld.a11y import Mark, draw_marks, kept_nodes, linearize, trim
from cua_rollout.agents.osworld.computer13 import ACTION_SPACE, KEYBOARD_KEYS, validate
from cua_rollout.agents.osworld.replies import Reading, read_computer13, read_pyautogui

__all__ = ["ACTION_SPACE", "KEYBOARD_KEYS", "Mark", "Reading", "draw_marks", "kept_nodes",
           "linearize", "read_computer13", "read_pyautogui", "trim", "validate"]
