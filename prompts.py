"""The design card's prompts: the UI-TARS prompt and the messages of one request.

The code is ``cua_rollout.agents.uitars.prompt``; this file re-exports it for a checkout.
"""

from cua_rollout.agents.uitars.prompt import build_messages, build_prompt

__all__ = ["build_messages", "build_prompt"]
