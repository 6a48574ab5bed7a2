"""A fake OpenAI/vLLM chat server on a real loopback port, with scripted misbehaviour.

It runs uvicorn in a thread with its own event loop, so async tests can talk to it over
real HTTP. Behaviour is set per server (latency) or per request (a queue of faults).
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse

from rollout.http import ThreadedServer


class FakeOpenAIServer(ThreadedServer):
    """``/v1/chat/completions``, ``/v1/models`` and ``/health`` like a vLLM server.

    ``faults`` is a queue consumed one per chat request: an int is an HTTP status answered
    with an OpenAI-style error body, ``"hang"`` never answers, ``"garbage"`` answers 200 with
    a body that is not a completion, ``"drop"`` closes the connection without a reply.
    """

    def __init__(
        self,
        *,
        latency_s: float = 0.0,
        model: str = "fake-model",
        reply: Callable[[dict[str, Any]], str] | None = None,
        healthy: bool = True,
    ) -> None:
        self.latency_s = latency_s
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

        @app.get("/health")
        async def health() -> PlainTextResponse:
            return PlainTextResponse("", status_code=200 if self.healthy else 503)

        @app.get("/v1/models")
        async def models() -> dict[str, Any]:
            return {"object": "list", "data": [{"id": self.model, "object": "model"}]}

        @app.post("/v1/chat/completions")
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
                    return JSONResponse(
                        {"object": "error", "message": f"fault {fault}", "type": "BadRequest",
                         "code": fault},
                        status_code=fault,
                    )
                if fault == "garbage":
                    self.statuses["garbage"] += 1
                    return JSONResponse({"unexpected": True})
                if fault == "drop":
                    raise ConnectionResetError("dropped by the fake server")
                self.statuses[200] += 1
                text = self.reply(body)
                choice: dict[str, Any] = {
                    "index": 0,
                    "message": {"role": "assistant", "content": text},
                    "finish_reason": "stop",
                }
                if body.get("return_token_ids"):
                    choice["token_ids"] = list(range(len(text.split())))
                if body.get("logprobs"):
                    choice["logprobs"] = {
                        "content": [{"token": w, "logprob": -0.5} for w in text.split()]
                    }
                out: dict[str, Any] = {
                    "id": "chatcmpl-fake",
                    "object": "chat.completion",
                    "created": int(time.time()),
                    "model": self.model,
                    "choices": [choice],
                    "usage": {"prompt_tokens": 11, "completion_tokens": len(text.split()),
                              "total_tokens": 11 + len(text.split())},
                }
                if body.get("return_token_ids"):
                    out["prompt_token_ids"] = list(range(11))
                return out
            finally:
                self.in_flight -= 1

        return app
