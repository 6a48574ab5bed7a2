"""The agent contract and the agents by name.

An agent plays one episode (vLLM's tool parsers and verl's agent loops have the same shape):
it turns the observation and its history into a model request (``AgentRequest``: messages,
the images they carry, a decoding grammar or tools) and a reply into a ``Decision`` (the
code to run, the terminal action, what it read from the reply). The episode loop
(cua_rollout/runtime/episode.py) owns the model client, the environment, deadlines and
records; the agent owns prompt, parser, code generation, grammar and terminal policy.
Desktop agents are registered by name (``agent.name``) and imported only when chosen; the
text modes' tool-calling agent is ``cua_rollout.agents.tool.ToolAgent``.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol

from cua_rollout.config import AgentConfig
from cua_rollout.core.errors import ConfigError
from cua_rollout.core.screenshot import Screenshot

__all__ = ["AGENTS", "Agent", "AgentRequest", "Decision", "ParseRecord", "agent_class",
           "make_agent"]

# name -> "module:Class"; the class is imported when its name is chosen.
AGENTS: dict[str, str] = {
    "uitars-1.5": "cua_rollout.agents.uitars.agent:UITars15Agent",
    "uitars-1.0": "cua_rollout.agents.uitars.agent:UITars10Agent",
    "osworld-prompt": "cua_rollout.agents.osworld.agent:OSWorldPromptAgent",
    "qwen-computer-use": "cua_rollout.agents.qwen:QwenComputerUseAgent",
}


@dataclass(frozen=True)
class AgentRequest:
    """What an agent asks the model for one step."""

    messages: list[dict[str, Any]]
    screenshots: list[Screenshot]     # the request's images, in prompt order
    image_tokens: int                 # placeholder tokens of each image (one screen size)
    regex: str | None = None          # structured-output grammar every reply must match
    # The context a server needs for this request, and why (checked by the model client).
    least_tokens: tuple[int, str] | None = None
    tools: list[dict[str, Any]] | None = None   # OpenAI tools offered (None: a text reply)
    tool_choice: str | None = None
    # What the model was shown besides the screenshot, kept with the step for the viewer:
    # the accessibility tree as the prompt has it, the screenshot with marks drawn on it.
    a11y_tree: str | None = None
    marked: Screenshot | None = None


class ParseRecord(NamedTuple):
    """What a desktop agent read from a reply, as traj.jsonl keeps it: the thought and the
    parsed actions (an unparseable reply: None and [])."""

    thought: str | None
    actions: list[dict[str, Any]]


class Decision(NamedTuple):
    """What a reply makes the episode do: ``code`` to run first (None: nothing) and the
    terminal action (``DONE``, ``FAIL``, ``WAIT`` or None to go on); ``parse``: what the
    agent read from it (None: an agent that keeps no parse record, as the tool agent)."""

    code: str | None
    terminal: str | None
    parse: ParseRecord | None = None

    @property
    def action(self) -> str | None:
        """The step's ``action`` as traj.jsonl records it (OSWorld's: the code, then the
        terminal action that ends the episode)."""
        if self.code is None:
            return self.terminal
        if self.terminal in (None, "WAIT"):
            return self.code
        return f"{self.code}\n{self.terminal}"


class Agent(Protocol):
    """One episode's agent. ``observation``: the screenshot a desktop step starts from (None
    in a text episode, whose observations are the tool results in its conversation)."""

    name: str
    action_format: str       # how its replies say actions (traj.jsonl's ``action_format``)
    constrained: bool        # replies are sampled under ``AgentRequest.regex``
    max_parse_retries: int   # re-asks after an unparseable reply before FAIL
    # The step's observation includes the desktop's accessibility tree (the episode loop
    # fetches it, ``DesktopProbe.accessibility_tree``, and passes it to ``request``).
    observes_a11y_tree: bool

    def request(self, observation: Screenshot | None,
                a11y_tree: str | None = None) -> AgentRequest:
        """The request for the step that starts from ``observation`` (and the desktop's
        accessibility tree XML, when the agent observes it)."""
        ...

    def parse(self, text: str, observation: Screenshot | None,
              tool_calls: list[dict[str, Any]] | None = None) -> Any:
        """What the reply asks for (an ``ActionParseError`` when it is unreadable and may
        be asked again)."""
        ...

    def decide(self, parsed: Any | None) -> Decision:
        """What the parsed reply (None: unparseable after every retry) makes the episode do."""
        ...

    def remember(self, observation: Screenshot | None, text: str) -> Screenshot | None:
        """Add the step (its observation, the reply) to the history; returns a screenshot
        that left the image window for good (its memory may go), if any."""
        ...


def agent_class(name: str) -> type[Agent]:
    """The agent registered as ``name``, imported now."""
    try:
        module, _, attr = AGENTS[name].partition(":")
    except KeyError:
        raise ConfigError(f"agent.name: unknown agent {name!r} (known: "
                          f"{', '.join(sorted(AGENTS))})") from None
    cls: type[Agent] = getattr(importlib.import_module(module), attr)
    return cls


def make_agent(cfg: AgentConfig, *, instruction: str, max_tokens: int) -> Agent:
    """A fresh agent of ``cfg.name`` for one episode of ``instruction``; ``max_tokens`` is
    the sampling's reply budget (part of the context a request needs)."""
    return agent_class(cfg.name)(cfg, instruction=instruction,  # type: ignore[call-arg]
                                 max_tokens=max_tokens)
