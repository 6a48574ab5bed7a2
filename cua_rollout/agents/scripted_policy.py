"""A scripted UI-TARS policy behind an OpenAI-compatible server, for the demo and the tests:
it replays each task's ``reference_solution`` (task from the prompt's instruction, step from
the assistant turns), ``error_rate`` adding wrong clicks and early ``finished``. No weights.

Text benchmarks replay too: an item's ``metadata.reference_solution`` is a list of turns,
each a tool call ``{"tool": name, "arguments": {...}}``, a list of them (parallel calls), or
the final reply (a string, or ``{"answer": ...}``: a call of the ``answer`` tool); in an
argument, ``{{url:N}}`` stands for the N-th URL of the last tool results. The item
is found by its question (the conversation's first user message). As a judge
(``llm_judgement``), it says Correct when the answer contains a reference answer
(``contains_answer``, normalized).

``scripted_server`` serves it as an OpenAI-compatible server (``cua_rollout.model.openai_server``).

    python -m cua_rollout.agents.scripted_policy --tasks tasks/demo --port 8199 [--error-rate 0.1]
"""

from __future__ import annotations

import argparse
import json
import random
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import uvicorn

from cua_rollout.agents.uitars import screen_to_model
from cua_rollout.core.errors import ConfigError
from cua_rollout.model.openai_server import ChatCall, Completion, OpenAIServer
from cua_rollout.text.metrics import JUDGE_SYSTEM_PROMPT, score

__all__ = ["MODEL_NAME", "ScriptedPolicy", "TextTurn", "load_solutions", "load_text_solutions",
           "main", "scripted_server"]

MODEL_NAME = "scripted-ui-tars"
_INSTRUCTION_HEADER = "## User Instruction\n"


def load_solutions(roots: Iterable[Path]) -> dict[str, list[str]]:
    """instruction -> reference replies, from every task JSON under ``roots`` (or a JSONL task
    file among them) that has one."""
    solutions: dict[str, list[str]] = {}
    for root in roots:
        root = Path(root)
        files = [root] if root.is_file() else sorted(root.rglob("*.json"))
        for path in files:
            try:
                text = path.read_text(encoding="utf-8")
                # A JSONL task file holds a task per line; a JSON file one task (or a list).
                tasks = ([json.loads(x) for x in text.splitlines() if x.strip()]
                         if path.suffix == ".jsonl" else [json.loads(text)])
            except (OSError, ValueError):
                continue  # task lists and broken files are the task loader's business
            for task in tasks:
                if not isinstance(task, dict) or not task.get("reference_solution"):
                    continue
                replies = task["reference_solution"]
                if not (isinstance(replies, list) and all(isinstance(r, str) for r in replies)):
                    raise ConfigError(f"{path}: reference_solution must be a list of strings")
                solutions[str(task["instruction"]).strip()] = replies
    return solutions


# One scripted turn of a text episode: (text, [(tool, arguments JSON)]) — no calls: final.
TextTurn = tuple[str, list[tuple[str, str]]]


def _text_turn(turn: Any, where: str) -> TextTurn:
    if isinstance(turn, str):
        return turn, []
    if isinstance(turn, dict) and set(turn) == {"answer"}:
        return "", [("answer", json.dumps({"answer": str(turn["answer"])}))]
    calls = turn if isinstance(turn, list) else [turn]
    out = []
    for call in calls:
        if not (isinstance(call, dict) and isinstance(call.get("tool"), str)):
            raise ConfigError(f"{where}: a turn is a string, {{\"answer\": ...}}, or tool "
                              f"calls {{\"tool\": name, \"arguments\": {{...}}}}; got {call!r:.80}")
        arguments = call.get("arguments", {})
        out.append((call["tool"], arguments if isinstance(arguments, str)
                    else json.dumps(arguments)))
    return "", out


def load_text_solutions(items: Iterable[tuple[str, Any, str]]) -> dict[str, list[TextTurn]]:
    """question -> scripted turns, from ``(question, metadata, where)`` of benchmark items
    whose metadata has a ``reference_solution``."""
    solutions: dict[str, list[TextTurn]] = {}
    for question, metadata, where in items:
        turns = (metadata or {}).get("reference_solution")
        if not turns:
            continue
        if not isinstance(turns, list):
            raise ConfigError(f"{where}: metadata.reference_solution must be a list of turns")
        solutions[question.strip()] = [_text_turn(t, where) for t in turns]
    return solutions


_JUDGE_PARTS = re.compile(r"Reference answers?[^\n]*:\n(?P<refs>.*?)\n\nModel's answer:\n"
                          r"(?P<answer>.*?)\n\nDoes the model's answer", re.DOTALL)


class ScriptedPolicy:
    """Chooses the reply for a chat request; pure logic, no HTTP."""

    def __init__(
        self,
        solutions: dict[str, list[str]],
        *,
        error_rate: float = 0.0,
        seed: int = 0,
        screen: tuple[int, int] = (1280, 720),
        text_solutions: dict[str, list[TextTurn]] | None = None,
    ) -> None:
        if not 0.0 <= error_rate <= 1.0:
            raise ValueError("error_rate must be in [0, 1]")
        self.solutions = solutions
        self.text_solutions = text_solutions or {}
        self.error_rate = error_rate
        self.rng = random.Random(seed)
        self.screen = screen
        self.served = 0
        self.errors_injected = 0

    def respond(self, messages: list[dict[str, Any]]) -> TextTurn:
        """The reply to a chat request: text and tool calls (name, arguments JSON)."""
        system = messages[0].get("content") if messages else None
        if system == JUDGE_SYSTEM_PROMPT:
            return self._judge(messages), []
        question = _first_user_text(messages)
        if _instruction(messages) is None and question is not None and (
                question.strip() in self.text_solutions or messages[0].get("role") == "system"):
            return self._text(question.strip(), messages)
        return self.reply(messages), []

    def _text(self, question: str, messages: list[dict[str, Any]]) -> TextTurn:
        turns = self.text_solutions.get(question)
        self.served += 1
        if turns is None:
            return "I do not know.", []
        step = sum(1 for m in messages if m.get("role") == "assistant")
        if self.error_rate and self.rng.random() < self.error_rate:
            self.errors_injected += 1
            return "I am not sure; my guess is 0.", []
        if step >= len(turns):
            return "I have no more to add.", []
        text, calls = turns[step]
        if any(_URL_REF.search(arguments) for _, arguments in calls):
            urls = _URL.findall(_last_tool_outputs(messages))
            calls = [(name, _URL_REF.sub(lambda m: json.dumps(
                urls[int(m.group(1)) - 1] if int(m.group(1)) <= len(urls) else "")[1:-1],
                arguments)) for name, arguments in calls]
        return text, calls

    def _judge(self, messages: list[dict[str, Any]]) -> str:
        found = _JUDGE_PARTS.search(str(messages[-1].get("content", "")))
        if found is None:
            return "Incorrect"
        refs = [r.removeprefix("- ") for r in found.group("refs").splitlines() if r.strip()]
        verdict = score("contains_answer", found.group("answer"), refs)
        return "Correct" if verdict >= 1.0 else "Incorrect"

    def reply(self, messages: list[dict[str, Any]]) -> str:
        instruction = _instruction(messages)
        replies = self.solutions.get(instruction) if instruction is not None else None
        if replies is None:
            # Like a model that cannot solve it: give up (the episode scores as the task says).
            return "Thought: I do not know how to do this task.\nAction: call_user()"
        step = sum(1 for m in messages if m.get("role") == "assistant")
        self.served += 1
        if self.error_rate and self.rng.random() < self.error_rate:
            self.errors_injected += 1
            return self._mistake()
        if step >= len(replies):
            return "Thought: The task should be complete now.\nAction: finished(content='')"
        return replies[step]

    def _mistake(self) -> str:
        if self.rng.random() < 0.5:
            return "Thought: I think the task is already done.\nAction: finished(content='')"
        w, h = self.screen
        x, y = screen_to_model((self.rng.randrange(w), self.rng.randrange(h)), w, h)
        return f"Thought: Let me click here.\nAction: click(start_box='({x},{y})')"


# In a scripted call's arguments, {{url:N}}: the N-th URL of the last tool results (what a
# model reads off a search result list).
_URL_REF = re.compile(r"\{\{url:(\d+)\}\}")
_URL = re.compile(r"https?://[^\s\"'<>)\]]+")


def _last_tool_outputs(messages: list[dict[str, Any]]) -> str:
    outputs: list[str] = []
    for message in reversed(messages):
        if message.get("role") != "tool":
            break
        outputs.append(str(message.get("content", "")))
    return "\n".join(reversed(outputs))


def _first_user_text(messages: list[dict[str, Any]]) -> str | None:
    for message in messages:
        if message.get("role") == "user":
            content = message.get("content")
            return content if isinstance(content, str) else None
    return None


def _instruction(messages: list[dict[str, Any]]) -> str | None:
    """The task instruction from the UI-TARS prompt (the text after "## User Instruction")."""
    for message in messages:
        if message.get("role") != "user":
            continue
        content = message.get("content")
        parts = [content] if isinstance(content, str) else [
            p.get("text", "") for p in content or [] if isinstance(p, dict)
        ]
        for text in parts:
            if isinstance(text, str) and _INSTRUCTION_HEADER in text:
                return text.split(_INSTRUCTION_HEADER, 1)[1].strip()
    return None


def scripted_server(policy: ScriptedPolicy, *, latency_s: float = 0.0,
                    model_name: str = MODEL_NAME, host: str = "127.0.0.1",
                    port: int = 0) -> OpenAIServer:
    """``policy`` behind an OpenAI-compatible server as vLLM answers (``/v1/models``,
    ``/v1/chat/completions``, ``/health``, ``/metrics``), each reply ``latency_s`` late;
    ``start()`` serves it from a thread (port 0: a free one)."""

    def answer(call: ChatCall) -> Completion:
        text, calls = policy.respond(call.request.messages)
        tokens = len(text.split()) + sum(len(a.split()) + 1 for _, a in calls)
        return Completion(text, tool_calls=calls, completion_tokens=tokens, delay_s=latency_s)

    return OpenAIServer(answer, model=model_name, owned_by="scripted",
                        root=f"scripted-{model_name}", host=host, port=port)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", action="append", required=True, type=Path,
                        help="task file or directory holding task JSONs (repeatable)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8199)
    parser.add_argument("--error-rate", type=float, default=0.0)
    parser.add_argument("--latency-s", type=float, default=0.0)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    solutions = load_solutions(args.tasks)
    if not solutions:
        parser.error(f"no task with a reference_solution under {', '.join(map(str, args.tasks))}")
    policy = ScriptedPolicy(solutions, error_rate=args.error_rate, seed=args.seed)
    uvicorn.run(scripted_server(policy, latency_s=args.latency_s), host=args.host,
                port=args.port, log_level="warning", lifespan="off")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
