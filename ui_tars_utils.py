"""The design card's ui_tars_utils: UI-TARS replies to actions to pyautogui code.

The code is ``cua_rollout.agents.uitars``; this file re-exports it for a checkout.
"""

from cua_rollout.agents.uitars import parse_response, to_pyautogui
from cua_rollout.core.vision import smart_resize

__all__ = ["parse_response", "smart_resize", "to_pyautogui"]
