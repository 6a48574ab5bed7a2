"""The tool-calling agent of text episodes, as pure functions the episode loop
(cua_rollout/runtime/runner.py) strings together: the first messages of a task, the model's tool
calls read from a reply, the messages that answer them, and the final answer.

The conversation is OpenAI's chat with function tools, so any OpenAI-compatible server
serves it (vLLM with a tool parser, a hosted API):

    system: the mode's prompt (SYSTEM_PROMPTS, or text.system_prompt)
    user:   the item's question
    assistant: content and/or tool_calls        ┐ one turn: the model's reply, then
    tool:   each call's output (tool_call_id)   ┘ one message per call it made
    ...
    assistant: the final answer (no tool call), or a call of the ``answer`` tool

A reply ends the episode when it calls ``answer`` (its ``answer`` argument is the final
answer) or makes no tool call (its text is the answer: a ``<answer>…</answer>`` block or a
"Final answer:" line when it has one, else the whole text without ``<think>`` blocks).
Parallel tool calls are answered in the order the model made them. A call the model got wrong
(arguments that are not a JSON object, an unknown tool, a call over the per-turn cap) is
answered with an error message the model reads, and counted.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from cua_rollout.agents.base import AgentRequest, Decision
from cua_rollout.config import TextConfig
from cua_rollout.core.types import DONE
from cua_rollout.envs.contract import StepResult, ToolCall
from cua_rollout.envs.tools import (
    TOOL_FAILED,
    TOOL_MALFORMED,
    TOOL_OVER_LIMIT,
    TOOL_UNKNOWN,
    ToolSpec,
)

__all__ = [
    "ANSWER_TOOL",
    "SYSTEM_PROMPTS",
    "AgentCounts",
    "ReadReply",
    "ToolAgent",
    "assistant_message",
    "final_answer",
    "first_messages",
    "read_reply",
    "tool_message",
]

ANSWER_TOOL = ToolSpec(
    name="answer",
    description="Give your final answer to the question. Call it once, when you are done; "
                "the episode ends with it.",
    parameters={"type": "object",
                "properties": {"answer": {"type": "string",
                                          "description": "The final answer, as short as "
                                                         "the question allows."}},
                "required": ["answer"]},
)

_ANSWER_HINT = ("When you know the answer, call the answer tool with it, or reply with the "
                "answer alone.")
SYSTEM_PROMPTS: dict[str, str] = {
    "math": "You solve math problems. Think step by step, then give the final answer "
            "(a number or an expression) and nothing else in your last reply. " + _ANSWER_HINT,
    "py": "You answer questions and solve problems, and you can run Python code with the "
          "python tool (standard library only; print what you want to see; no network; files "
          "you write stay for your later calls). " + _ANSWER_HINT,
    "rag": "You answer questions from a knowledge base. Search it with the retrieve tool, "
           "read the passages, search again if needed, and answer from what you found. "
           + _ANSWER_HINT,
    "web": "You answer questions by searching the web with the search tool and reading "
           "pages with the fetch tool. Answer from what the pages say. " + _ANSWER_HINT,
}


def first_messages(question: str, system_prompt: str) -> list[dict[str, Any]]:
    """The conversation's start: the system prompt and the question."""
    return [{"role": "system", "content": system_prompt},
            {"role": "user", "content": question}]


@dataclass
class AgentCounts:
    """What an episode's tool use came to (kept in its result line)."""

    tool_calls: int = 0
    tool_errors: int = 0        # calls the tool refused or failed
    malformed_calls: int = 0    # arguments that are not a JSON object
    unknown_tools: int = 0      # calls of a tool the environment does not have
    over_limit: int = 0         # calls past text.max_tool_calls_per_turn (not run)
    by_tool: dict[str, int] = field(default_factory=dict)

    def count(self, name: str, result: StepResult) -> None:
        self.tool_calls += 1
        self.by_tool[name] = self.by_tool.get(name, 0) + 1
        if result.returncode == TOOL_FAILED:
            self.tool_errors += 1
        elif result.returncode == TOOL_MALFORMED:
            self.malformed_calls += 1
        elif result.returncode == TOOL_UNKNOWN:
            self.unknown_tools += 1
        elif result.returncode == TOOL_OVER_LIMIT:
            self.over_limit += 1

    def record(self) -> dict[str, Any]:
        return {"tool_calls": self.tool_calls, "tool_errors": self.tool_errors,
                "malformed_calls": self.malformed_calls, "unknown_tools": self.unknown_tools,
                "over_limit": self.over_limit, "by_tool": dict(self.by_tool)}


@dataclass(frozen=True)
class ReadReply:
    """What one reply asks for: the tool calls to run (in the model's order), the final
    answer (when the reply ends the episode) and the problem of an ``answer`` call whose
    arguments did not hold one (answered to the model as an error)."""

    calls: list[ToolCall]
    answer: str | None
    answer_problem: str | None = None
    answer_call: ToolCall | None = None
    # Every call of the reply in the model's order (the answer call included).
    all_calls: tuple[ToolCall, ...] = field(default=(), compare=False)


def _call_of(raw: Any, index: int) -> ToolCall:
    function = raw.get("function") if isinstance(raw, dict) else None
    function = function if isinstance(function, dict) else {}
    name = function.get("name")
    arguments = function.get("arguments")
    if isinstance(arguments, dict):  # a server that sends the object, not its JSON text
        arguments = json.dumps(arguments)
    call_id = raw.get("id") if isinstance(raw, dict) else None
    return ToolCall(id=call_id if isinstance(call_id, str) and call_id else f"call_{index}",
                    name=name if isinstance(name, str) else "",
                    arguments=arguments if isinstance(arguments, str) else "")


def read_reply(text: str, tool_calls: Sequence[Any] | None, *,
               answer_tool: bool = True) -> ReadReply:
    """The calls of a reply and, when it ends the episode, its final answer."""
    calls = []
    ids: set[str] = set()
    for i, raw in enumerate(tool_calls or []):
        call = _call_of(raw, i)
        if call.id in ids:  # each call is answered by its id: a repeated one is made unique
            call = ToolCall(f"{call.id}_{i}", call.name, call.arguments)
        ids.add(call.id)
        calls.append(call)
    every = tuple(calls)
    if answer_tool:
        for call in calls:
            if call.name != ANSWER_TOOL.name:
                continue
            try:
                args = json.loads(call.arguments or "{}")
            except ValueError:
                args = None
            value = args.get("answer") if isinstance(args, dict) else None
            if isinstance(value, int | float) and not isinstance(value, bool):
                value = str(value)
            if isinstance(value, str):
                return ReadReply([], value.strip(), answer_call=call, all_calls=every)
            return ReadReply([c for c in calls if c is not call], None,
                             answer_problem="answer: the arguments must be a JSON object "
                                            "with a string 'answer'", answer_call=call,
                             all_calls=every)
    if calls:
        return ReadReply(calls, None, all_calls=every)
    return ReadReply([], final_answer(text))


_THINK = re.compile(r"<think>.*?</think>", re.DOTALL | re.IGNORECASE)
_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL | re.IGNORECASE)
_FINAL_LINE = re.compile(r"^\s*(?:\*\*)?final answer\s*(?:\*\*)?\s*[:：]\s*(?:\*\*)?\s*(.+?)"
                         r"\s*(?:\*\*)?\s*$", re.IGNORECASE | re.MULTILINE)


def final_answer(text: str | None) -> str | None:
    """The answer a reply without tool calls gives: the last ``<answer>…</answer>`` block,
    else the last "Final answer: …" line, else the whole text; ``<think>`` blocks dropped.
    None for an empty reply (no answer: scored 0)."""
    if not text:
        return None
    visible = _THINK.sub("", text)
    if "<think>" in visible.lower():  # an unclosed thinking block: what precedes it
        visible = visible[:visible.lower().index("<think>")]
    tagged = _ANSWER_TAG.findall(visible)
    if tagged:
        return tagged[-1].strip() or None
    lines = _FINAL_LINE.findall(visible)
    if lines:
        return lines[-1].strip() or None
    visible = visible.strip()
    return visible or None


def assistant_message(text: str, tool_calls: Sequence[ToolCall]) -> dict[str, Any]:
    """The reply as the next request carries it (the calls as the model made them)."""
    message: dict[str, Any] = {"role": "assistant", "content": text or ""}
    if tool_calls:
        message["tool_calls"] = [
            {"id": c.id, "type": "function",
             "function": {"name": c.name, "arguments": c.arguments}} for c in tool_calls]
    return message


def tool_message(call: ToolCall, output: str) -> dict[str, Any]:
    """The answer to one call, as the model reads it."""
    return {"role": "tool", "tool_call_id": call.id, "name": call.name, "content": output}


class ToolAgent:
    """One text episode's tool-calling agent (``cua_rollout.agents.base.Agent``): the
    conversation (the mode's system prompt, the question, every reply and tool output), the
    tools it offers the model, and what a reply asks for (``parse``). The episode loop runs
    the calls and hands back the results (``called``, ``answered``)."""

    name = "tool"
    action_format = "tool_calls"
    constrained = False      # no grammar: the tools are the reply's structure
    max_parse_retries = 0    # a malformed call goes back to the model as the call's error
    observes_a11y_tree = False

    def __init__(self, cfg: TextConfig, mode: str) -> None:
        self.cfg = cfg
        self.system_prompt = cfg.system_prompt or SYSTEM_PROMPTS[mode]
        self.messages: list[dict[str, Any]] = []
        self.tools: list[dict[str, Any]] = []
        self.counts = AgentCounts()

    def start(self, question: str, tools: Sequence[ToolSpec]) -> None:
        """The conversation of ``question`` with the environment's ``tools`` (and the answer
        tool, unless ``text.final_answer_tool`` is off)."""
        self.tools = [spec.openai() for spec in tools]
        if self.cfg.final_answer_tool:
            self.tools.append(ANSWER_TOOL.openai())
        self.messages = first_messages(question, self.system_prompt)

    def request(self, observation: Any = None, a11y_tree: str | None = None) -> AgentRequest:
        """The next turn's request: the conversation so far and the tools (the observations
        are the tool results in it)."""
        return AgentRequest(self.messages, [], 0, tools=list(self.tools),
                            tool_choice=self.cfg.tool_choice if self.tools else None)

    def parse(self, text: str, observation: Any = None,
              tool_calls: Sequence[Any] | None = None) -> ReadReply:
        """The reply's tool calls and final answer (never raises: a malformed call is
        answered as that call's error)."""
        return read_reply(text, tool_calls, answer_tool=self.cfg.final_answer_tool)

    def decide(self, reply: ReadReply | None) -> Decision:
        """A reply that calls no tool and answers well ends the episode (DONE); otherwise its
        calls run (the loop runs ``reply.calls``)."""
        ended = reply is not None and not reply.calls and reply.answer_problem is None
        return Decision(None, DONE if ended else None)

    def remember(self, observation: Any, text: str) -> None:
        """The conversation is kept by ``answered`` and ``called``, with the tool results."""
        return None

    def answered(self, text: str, reply: ReadReply) -> None:
        """The reply that ends the episode joins the conversation (messages.json ends with
        it)."""
        self.messages.append(assistant_message(
            text, [reply.answer_call] if reply.answer_call is not None else []))

    def called(self, text: str, calls: Sequence[ToolCall],
               results: dict[str, StepResult]) -> None:
        """The reply and one tool message per call, answered in the order the model made
        them; each call counted."""
        self.messages.append(assistant_message(text, calls))
        for call in calls:
            result = results[call.id]
            self.messages.append(tool_message(call, result.output))
            self.counts.count(call.name, result)
