"""A scripted UI-TARS policy behind an OpenAI-compatible server, for the demo and the tests:
it replays each task's ``reference_solution`` (task from the prompt's instruction, step from
the assistant turns), ``error_rate`` adding wrong clicks and early ``finished``. No weights.

    python -m rollout.scripted_policy --tasks tasks/demo --port 8199 [--error-rate 0.1]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse

from rollout.errors import ConfigError
from rollout.openai_protocol import (
    CHAT_COMPLETIONS_PATH,
    HEALTH_PATH,
    MODELS_PATH,
    completion_body,
    error_body,
    models_body,
    parse_chat_request,
)
from rollout.server_metrics import vllm_metrics_text
from ui_tars_utils import screen_to_model

__all__ = ["MODEL_NAME", "ScriptedPolicy", "create_app", "load_solutions", "main"]

MODEL_NAME = "scripted-ui-tars"
_INSTRUCTION_HEADER = "## User Instruction\n"


def load_solutions(roots: Iterable[Path]) -> dict[str, list[str]]:
    """instruction -> reference replies, from every task JSON under ``roots`` that has one."""
    solutions: dict[str, list[str]] = {}
    for root in roots:
        root = Path(root)
        files = [root] if root.is_file() else sorted(root.rglob("*.json"))
        for path in files:
            try:
                task = json.loads(path.read_text(encoding="utf-8"))
            except (OSError, ValueError):
                continue  # task lists and broken files are the task loader's business
            if not isinstance(task, dict) or not task.get("reference_solution"):
                continue
            replies = task["reference_solution"]
            if not (isinstance(replies, list) and all(isinstance(r, str) for r in replies)):
                raise ConfigError(f"{path}: reference_solution must be a list of strings")
            solutions[str(task["instruction"]).strip()] = replies
    return solutions


class ScriptedPolicy:
    """Chooses the reply for a chat request; pure logic, no HTTP."""

    def __init__(
        self,
        solutions: dict[str, list[str]],
        *,
        error_rate: float = 0.0,
        seed: int = 0,
        screen: tuple[int, int] = (1280, 720),
    ) -> None:
        if not 0.0 <= error_rate <= 1.0:
            raise ValueError("error_rate must be in [0, 1]")
        self.solutions = solutions
        self.error_rate = error_rate
        self.rng = random.Random(seed)
        self.screen = screen
        self.served = 0
        self.errors_injected = 0

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


def create_app(policy: ScriptedPolicy, *, latency_s: float = 0.0,
               model_name: str = MODEL_NAME) -> FastAPI:
    """``/v1/models``, ``/v1/chat/completions``, ``/health`` and ``/metrics`` (vLLM's
    names: requests running, tokens, time per request) as a vLLM server answers them."""
    app = FastAPI(title="scripted UI-TARS policy")
    served = {"running": 0, "generation": 0, "finished": 0, "inference_s": 0.0}

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        return PlainTextResponse(vllm_metrics_text(
            model_name=model_name, running=served["running"],
            generation_tokens_total=served["generation"],
            requests_finished_total=served["finished"],
            queue_time_s=(0.0, served["finished"]),
            inference_time_s=(served["inference_s"], served["finished"])))

    @app.get(HEALTH_PATH)
    async def health() -> dict[str, str]:
        return {}

    @app.get(MODELS_PATH)
    async def models() -> dict[str, Any]:
        return models_body(model_name, owned_by="scripted", root=f"scripted-{model_name}")

    @app.post(CHAT_COMPLETIONS_PATH)
    async def chat(request: Request) -> Any:
        try:
            body = await request.json()
        except ValueError:
            return _error(400, "the request body is not JSON")
        try:
            chat = parse_chat_request(body)
        except ValueError as exc:
            return _error(400, str(exc))
        started = time.monotonic()
        served["running"] += 1
        try:
            if latency_s:
                await asyncio.sleep(latency_s)
            text = policy.reply(chat.messages)
        finally:
            served["running"] -= 1
        served["finished"] += 1
        served["generation"] += len(text.split())
        served["inference_s"] += time.monotonic() - started
        return completion_body(text, model=model_name, prompt_tokens=0,
                               completion_tokens=len(text.split()))

    return app


def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse(error_body(status, message), status_code=status)


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
    uvicorn.run(create_app(policy, latency_s=args.latency_s), host=args.host, port=args.port,
                log_level="warning")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
