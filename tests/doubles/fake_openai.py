"""A fake OpenAI/vLLM chat server on a real loopback port (uvicorn in a thread with its own
loop), speaking ``cua_rollout.model.openai_protocol``, with scripted misbehaviour: latency per
server,
a queue of faults per request."""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse

from cua_rollout.core.http import ThreadedServer
from cua_rollout.model.openai_protocol import (
    CHAT_COMPLETIONS_PATH,
    HEALTH_PATH,
    MODELS_PATH,
    completion_body,
    error_body,
    models_body,
    parse_chat_request,
)

__all__ = ["FakeOpenAIServer"]

_PROMPT_TOKENS = 11  # what every reply claims the prompt was
# A reply's text, or its text and the tool calls it makes: (name, arguments JSON text).
Reply = str | tuple[str, list[tuple[str, str]]]


class FakeOpenAIServer(ThreadedServer):
    """``/v1/chat/completions``, ``/v1/models`` and ``/health`` like a vLLM server.

    ``faults`` is a queue consumed one per chat request: an int is an HTTP status answered
    with an OpenAI-style error body, ``"hang"`` never answers, ``"garbage"`` answers 200 with
    a body that is not a completion, ``"drop"`` closes the connection without a reply.
    ``reply`` gets each request's decoded body (a dict), as ``requests`` records it, and
    returns the reply's text, or ``(text, [(tool name, arguments JSON text), ...])`` for a
    reply that makes those tool calls.
    """

    def __init__(
        self,
        *,
        latency_s: float = 0.0,
        model: str = "fake-model",
        reply: Callable[[dict[str, Any]], Reply] | None = None,
        healthy: bool = True,
        max_model_len: int | None = None,
        root: str | None = "",
    ) -> None:
        self.latency_s = latency_s
        # What /v1/models says the server loaded (vLLM's root): the model's name by
        # default, as vLLM serving a hub id says; None: not reported.
        self.root = model if root == "" else root
        self.max_model_len = max_model_len  # reported by /v1/models, as vLLM does
        self.model = model
        self.reply = reply or (lambda body: "Thought: ok\nAction: wait()")
        self.healthy = healthy
        self.faults: list[int | str] = []
        self.requests: list[dict[str, Any]] = []
        self.headers: list[dict[str, str]] = []
        self.statuses: Counter[int | str] = Counter()
        self.in_flight = 0
        self.max_in_flight = 0
        super().__init__(self._build_app())

    def _build_app(self) -> FastAPI:
        app = FastAPI()

        @app.get(HEALTH_PATH)
        async def health() -> PlainTextResponse:
            return PlainTextResponse("", status_code=200 if self.healthy else 503)

        @app.get(MODELS_PATH)
        async def models() -> dict[str, Any]:
            extra = {k: v for k, v in (("max_model_len", self.max_model_len),
                                       ("root", self.root)) if v is not None}
            return models_body(self.model, **extra)

        @app.post(CHAT_COMPLETIONS_PATH)
        async def chat(request: Request) -> Any:
            body = await request.json()
            self.requests.append(body)
            self.headers.append(dict(request.headers))
            fault = self.faults.pop(0) if self.faults else None
            self.in_flight += 1
            self.max_in_flight = max(self.max_in_flight, self.in_flight)
            try:
                if fault == "hang":
                    await asyncio.sleep(3600)
                if self.latency_s:
                    await asyncio.sleep(self.latency_s)
                if isinstance(fault, int):
                    self.statuses[fault] += 1
                    return JSONResponse(error_body(fault, f"fault {fault}"), status_code=fault)
                if fault == "garbage":
                    self.statuses["garbage"] += 1
                    return JSONResponse({"unexpected": True})
                if fault == "drop":
                    raise ConnectionResetError("dropped by the fake server")
                try:
                    chat = parse_chat_request(body)
                except ValueError as exc:
                    self.statuses[400] += 1
                    return JSONResponse(error_body(400, str(exc)), status_code=400)
                self.statuses[200] += 1
                reply = self.reply(body)
                text, tool_calls = (reply, None) if isinstance(reply, str) else reply
                words = text.split()
                return completion_body(
                    text, model=self.model, completion_id="chatcmpl-fake",
                    prompt_tokens=_PROMPT_TOKENS, completion_tokens=len(words),
                    token_ids=list(range(len(words))) if chat.return_token_ids else None,
                    prompt_token_ids=list(range(_PROMPT_TOKENS)) if chat.return_token_ids
                    else None,
                    logprobs=[(w, -0.5) for w in words] if chat.logprobs else None,
                    tool_calls=tool_calls or None,
                )
            finally:
                self.in_flight -= 1

        return app
