"""The text of past steps in the prompt's history: actions written back as UI-TARS writes
them (boxes in its tokens)."""

from __future__ import annotations

import re

from cua_rollout.agents.uitars.parser import (
    HEADER_RE,
    find_action,
    is_bare_call,
)

__all__ = ["add_box_token"]

# --------------------------------------------------------------------------- text for history


_BOX_ARG_RE = re.compile(
    r"(start_box|end_box|start_point|end_point|point)=(['\"])\s*(\(\s*\d+\s*,\s*\d+\s*\))\s*\2"
)


def add_box_token(text: str) -> str:
    """Wrap bare ``start_box='(x,y)'`` points of the action part in ``<|box_start|>`` tokens,
    as UI-TARS expects in its own past replies. Idempotent; reasoning text is untouched."""
    headers = list(HEADER_RE.finditer(text))
    m = find_action(text, headers)
    if m is not None:
        head, tail = text[: m.end()], text[m.end():]
    elif is_bare_call(text.strip(), headers):
        head, tail = "", text
    else:
        return text
    tail = _BOX_ARG_RE.sub(
        lambda b: f"{b.group(1)}={b.group(2)}<|box_start|>{b.group(3)}<|box_end|>{b.group(2)}",
        tail,
    )
    return head + tail
