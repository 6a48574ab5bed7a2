"""A scripted UI-TARS policy behind an OpenAI-compatible server, for the demo and the tests:
it replays each task's ``reference_solution`` (task from the prompt's instruction, step from
the assistant turns), ``error_rate`` adding wrong clicks and early ``finished``. No weights.

The solutions are written as UI-TARS replies; asked by another agent, the policy answers the
same actions in that agent's format (``convert``): OSWorld's prompt agent gets fenced
pyautogui code or computer_13 JSON actions, Qwen's computer-use agent ``computer_use`` tool
calls (as ``tool_calls`` when the request offers the tool, else inline ``<tool_call>``
blocks), each reply marked with its step (``[reference step N]``), since those agents'
history windows drop early turns.

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

from cua_rollout.agents import qwen
from cua_rollout.agents.osworld import prompt as osworld_prompt
from cua_rollout.agents.uitars import Action, parse_response, screen_to_model, to_pyautogui
from cua_rollout.agents.uitars.coordinates import frame_of
from cua_rollout.core.errors import ConfigError
from cua_rollout.model.openai_server import ChatCall, Completion, OpenAIServer
from cua_rollout.text.metrics import JUDGE_SYSTEM_PROMPT, score

__all__ = ["MODEL_NAME", "ScriptedPolicy", "TextTurn", "convert", "load_solutions",
           "load_text_solutions", "main", "scripted_server"]

MODEL_NAME = "scripted-ui-tars"
_INSTRUCTION_HEADER = "## User Instruction\n"
# Where the other agents put the task (their prompts end with it).
_TASK_HEADERS = (_INSTRUCTION_HEADER, osworld_prompt.TASK_HEADER, qwen.TASK_HEADER)
_STEP_MARK = re.compile(r"\[reference step (\d+)\]")
_RESOLUTION = re.compile(r"resolution is (\d+)x(\d+)")


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

    def respond(self, messages: list[dict[str, Any]],
                tools: list[dict[str, Any]] | None = None) -> TextTurn:
        """The reply to a chat request: text and tool calls (name, arguments JSON)."""
        system = messages[0].get("content") if messages else None
        if system == JUDGE_SYSTEM_PROMPT:
            return self._judge(messages), []
        question = _first_user_text(messages)
        if _instruction(messages) is None and question is not None and (
                question.strip() in self.text_solutions or messages[0].get("role") == "system"):
            return self._text(question.strip(), messages)
        fmt = _format(messages, tools)
        if fmt == "uitars":
            return self.reply(messages), []
        marked = _STEP_MARK.search(_last_assistant_text(messages))
        step = int(marked[1]) + 1 if marked else sum(
            1 for m in messages if m.get("role") == "assistant")
        return convert(self.reply(messages, step=step), fmt, self.screen, step=step,
                       frame=_frame(messages, tools))

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

    def reply(self, messages: list[dict[str, Any]], step: int | None = None) -> str:
        """The UI-TARS reply of step ``step`` (default: the assistant turns so far)."""
        instruction = _instruction(messages)
        replies = self.solutions.get(instruction) if instruction is not None else None
        if replies is None:
            # Like a model that cannot solve it: give up (the episode scores as the task says).
            return "Thought: I do not know how to do this task.\nAction: call_user()"
        if step is None:
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


def _texts(message: dict[str, Any]) -> list[str]:
    content = message.get("content")
    parts = [content] if isinstance(content, str) else [
        p.get("text", "") for p in content or [] if isinstance(p, dict)]
    return [t for t in parts if isinstance(t, str)]


def _instruction(messages: list[dict[str, Any]]) -> str | None:
    """The task instruction from an agent's prompt (the text after its header: UI-TARS's
    "## User Instruction" in a user turn, the others' "## Task")."""
    for message in messages:
        if message.get("role") not in ("user", "system"):
            continue
        for text in _texts(message):
            for header in _TASK_HEADERS:
                if header in text:
                    return text.split(header, 1)[1].strip()
    return None


def _last_assistant_text(messages: list[dict[str, Any]]) -> str:
    for message in reversed(messages):
        if message.get("role") == "assistant":
            return "\n".join(_texts(message))
    return ""


def _format(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> str:
    """Which agent asks: ``uitars``, ``pyautogui`` / ``computer_13`` (OSWorld's prompt
    agent), ``qwen_tools`` / ``qwen_inline`` (Qwen's computer-use agent)."""
    if any((t.get("function") or {}).get("name") == qwen.TOOL_NAME for t in tools or []):
        return "qwen_tools"
    system = "\n".join(_texts(messages[0])) if messages and messages[0].get(
        "role") == "system" else ""
    if f'"name": "{qwen.TOOL_NAME}"' in system:
        return "qwen_inline"
    if osworld_prompt.TASK_HEADER in system:
        return "computer_13" if '"action_type"' in system else "pyautogui"
    return "uitars"


def _frame(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None
           ) -> tuple[int, int] | None:
    """The coordinate frame a Qwen tool description states (its resolution)."""
    text = json.dumps(tools or []) + "\n".join(
        t for m in messages[:1] for t in _texts(m))
    found = _RESOLUTION.search(text)
    return (int(found[1]), int(found[2])) if found else None


def convert(reply: str, fmt: str, screen: tuple[int, int], *, step: int = 0,
            frame: tuple[int, int] | None = None) -> TextTurn:
    """A UI-TARS reply said in another agent's format ``fmt`` (see ``_format``): the text and
    the tool calls. ``screen``: the screen's size (the UI-TARS-1.5 reply's frame);
    ``frame``: the Qwen tool's coordinate frame (default: the resized screenshot)."""
    width, height = screen
    parsed = parse_response(reply, width, height, "uitars-1.5")
    head = f"[reference step {step}] {parsed.thought or ''}".strip()
    if fmt == "pyautogui":
        return head + "\n" + "\n".join(_code_blocks(parsed.actions)), []
    if fmt == "computer_13":
        blocks = [f"```json\n{json.dumps(a)}\n```" for a in _computer13(parsed.actions)]
        return head + "\n" + "\n".join(blocks), []
    if frame is None:
        fr = frame_of(width, height, "uitars-1.5")
        frame = (int(fr.width), int(fr.height))
    calls = _qwen_calls(parsed.actions, screen, frame)
    if fmt == "qwen_tools":
        return head, [(qwen.TOOL_NAME, json.dumps(c)) for c in calls]
    return "\n".join([head, *(qwen.tool_call_text(c) for c in calls)]), []


_TERMINALS = {"finished": "DONE", "call_user": "FAIL", "wait": "WAIT"}


def _code_blocks(actions: list[Action]) -> list[str]:
    blocks: list[str] = []
    for a in actions:
        if a.kind in _TERMINALS:
            return [*blocks, f"```{_TERMINALS[a.kind]}```"]
        blocks.append(f"```python\n{to_pyautogui([a])}\n```")
    return blocks


def _computer13(actions: list[Action]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for a in actions:
        xy = {"x": a.point[0], "y": a.point[1]} if a.point else {}
        if a.kind in _TERMINALS:
            out.append({"action_type": _TERMINALS[a.kind]})
            break
        if a.kind == "click":
            out.append({"action_type": "CLICK", "button": "left", **xy})
        elif a.kind == "left_double":
            out.append({"action_type": "DOUBLE_CLICK", **xy})
        elif a.kind == "right_single":
            out.append({"action_type": "RIGHT_CLICK", **xy})
        elif a.kind == "hover":
            out.append({"action_type": "MOVE_TO", **xy})
        elif a.kind == "drag" and a.end_point:
            out += [{"action_type": "MOVE_TO", **xy},
                    {"action_type": "DRAG_TO", "x": a.end_point[0], "y": a.end_point[1]}]
        elif a.kind in ("hotkey", "press"):
            out.append({"action_type": "PRESS", "key": a.keys[0]} if len(a.keys) == 1
                       else {"action_type": "HOTKEY", "keys": a.keys})
        elif a.kind in ("keydown", "keyup"):
            out.append({"action_type": "KEY_DOWN" if a.kind == "keydown" else "KEY_UP",
                        "key": a.keys[0]})
        elif a.kind == "type":
            out.append({"action_type": "TYPING", "text": a.content or ""})
        elif a.kind == "scroll":
            clicks = 5 if a.direction in ("up", "right") else -5
            vertical = a.direction in ("up", "down")
            out += [{"action_type": "MOVE_TO", **xy}] if xy else []
            out.append({"action_type": "SCROLL", "dx": 0 if vertical else clicks,
                        "dy": clicks if vertical else 0})
    return out


def _qwen_calls(actions: list[Action], screen: tuple[int, int],
                frame: tuple[int, int]) -> list[dict[str, Any]]:
    def at(point: tuple[int, int]) -> list[int]:
        return [round(point[0] / screen[0] * frame[0]), round(point[1] / screen[1] * frame[1])]

    named = {"click": "left_click", "left_double": "double_click",
             "right_single": "right_click", "hover": "mouse_move"}
    out: list[dict[str, Any]] = []
    for a in actions:
        if a.kind == "finished" or a.kind == "call_user":
            out.append({"action": "terminate",
                        "status": "success" if a.kind == "finished" else "failure"})
            break
        if a.kind == "wait":
            out.append({"action": "wait", "time": 1})
            break
        if a.kind in named and a.point:
            out.append({"action": named[a.kind], "coordinate": at(a.point)})
        elif a.kind == "drag" and a.point and a.end_point:
            out += [{"action": "mouse_move", "coordinate": at(a.point)},
                    {"action": "left_click_drag", "coordinate": at(a.end_point)}]
        elif a.kind in ("hotkey", "press"):
            out.append({"action": "key", "keys": a.keys})
        elif a.kind == "type":
            out.append({"action": "type", "text": a.content or ""})
        elif a.kind == "scroll":
            vertical = a.direction in ("up", "down")
            call: dict[str, Any] = {"action": "scroll" if vertical else "hscroll",
                                    "pixels": 5 if a.direction in ("up", "right") else -5}
            if a.point:
                call["coordinate"] = at(a.point)
            out.append(call)
    return out


def scripted_server(policy: ScriptedPolicy, *, latency_s: float = 0.0,
                    model_name: str = MODEL_NAME, host: str = "127.0.0.1",
                    port: int = 0) -> OpenAIServer:
    """``policy`` behind an OpenAI-compatible server as vLLM answers (``/v1/models``,
    ``/v1/chat/completions``, ``/health``, ``/metrics``), each reply ``latency_s`` late;
    ``start()`` serves it from a thread (port 0: a free one)."""

    def answer(call: ChatCall) -> Completion:
        text, calls = policy.respond(call.request.messages, call.request.tools)
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
