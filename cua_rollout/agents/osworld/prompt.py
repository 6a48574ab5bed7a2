"""The prompt agent's words: a system prompt per action space and observation type, and the
user turn of each observation. Our own text, not OSWorld's verbatim prompts (its license and
wording stay its own): it states the same contract — what the model sees, how it answers
(fenced Python using pyautogui, or computer_13 JSON actions), the special ``WAIT`` /
``DONE`` / ``FAIL``, no state shared between turns, the sudo password — and ends with the
task after ``TASK_HEADER``."""

from __future__ import annotations

from cua_rollout.agents.osworld.computer13 import describe

__all__ = ["TASK_HEADER", "observation_text", "system_prompt"]

TASK_HEADER = "## Task\n"

_SEES = {
    "screenshot": "a screenshot of the screen",
    "a11y_tree": "the screen's accessibility tree (AT-SPI), as a table with one element a "
                 "line: its role, name, text, class, description, top-left position and "
                 "size in pixels",
    "screenshot_a11y_tree": "a screenshot of the screen and its accessibility tree (AT-SPI), "
                            "as a table with one element a line: its role, name, text, "
                            "class, description, top-left position and size in pixels",
    "som": "a screenshot on which the elements you can act on carry red boxes with numbers, "
           "and a table of those elements (number, role, name, text)",
}

_CODE = """\
Answer with Python code that uses the `pyautogui` module to do the next action, in a fenced
block:
```python
pyautogui.click(640, 360)
```
Several blocks in one reply run one after the other. Each block runs in a new interpreter:
nothing you defined in earlier turns exists any more. Find coordinates yourself from what
you see; `pyautogui.locateCenterOnScreen` and `pyautogui.screenshot` are of no use here.
Between several actions of one block, pause briefly (`time.sleep(0.5)`)."""

_TAGS = """\
A numbered element's centre is the variable `tag_<number>`, e.g.
`pyautogui.click(tag_3)` or `pyautogui.dragTo(tag_1, button='left')`; where no box fits,
use coordinates."""

_JSON = """\
Answer with the next action as one JSON object in a fenced block, for example
```json
{{"action_type": "CLICK", "x": 640, "y": 360}}
```
The action_type is one of these (`?`: may be left out; coordinates are screen pixels):
{actions}
Several blocks in one reply run one after the other. Use no other action or parameter."""

_SPECIAL = """\
Instead of an action you may answer one of these words in a block of its own: ```WAIT```
to wait for the screen to change, ```DONE``` when the task is complete, ```FAIL``` when it
cannot be done (only after trying hard)."""

_HEAD = """\
You operate a Linux desktop computer (its screen is {width}x{height} pixels) to carry out the
user's task, one step at a time. Each step you see {sees}, then choose the next action."""

_TAIL = """\
Start your reply with a short reflection on the current screen and the steps so far, then
give the action."""


def system_prompt(instruction: str, *, observation_type: str, action_space: str,
                  width: int, height: int, password: str | None) -> str:
    """The system message of every request of an episode of ``instruction``."""
    parts = [_HEAD.format(width=width, height=height, sees=_SEES[observation_type])]
    if action_space == "pyautogui":
        parts.append(_CODE)
        if observation_type == "som":
            parts.append(_TAGS)
    else:
        parts.append(_JSON.format(actions=describe(width, height)))
    parts.append(_SPECIAL)
    if password:
        parts.append(f"The user's password is '{password}' (for sudo).")
    parts.append(_TAIL)
    return "\n\n".join(parts) + f"\n\n{TASK_HEADER}{instruction}"


def observation_text(observation_type: str, table: str | None) -> str:
    """The text of an observation's user turn (``table``: the linearized tree, or the
    marks' table)."""
    if observation_type == "screenshot":
        return "Here is the screenshot. What is the next step?"
    if observation_type == "som":
        return f"Here is the marked screenshot; its elements:\n{table}\nWhat is the next step?"
    if observation_type == "a11y_tree":
        return f"Here is the accessibility tree:\n{table}\nWhat is the next step?"
    return (f"Here is the screenshot, and the accessibility tree:\n{table}\n"
            "What is the next step?")
