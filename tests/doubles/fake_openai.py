"""A fake OpenAI/vLLM chat server on a real loopback port: ``cua_rollout.model.openai_server``
with a reply function of the test's, latency per server and a queue of faults per request."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Any

from cua_rollout.model.openai_protocol import error_body
from cua_rollout.model.openai_server import (
    ChatCall,
    Completion,
    HttpReply,
    OpenAIServer,
    json_reply,
)

__all__ = ["FakeOpenAIServer"]

_PROMPT_TOKENS = 11  # what every reply claims the prompt was
_HANG_S = 3600.0     # a "hang" fault: longer than any test waits
# A reply's text, or its text and the tool calls it makes: (name, arguments JSON text).
Reply = str | tuple[str, list[tuple[str, str]]]


class FakeOpenAIServer(OpenAIServer):
    """``/v1/chat/completions``, ``/v1/models`` and ``/health`` like a vLLM server (no
    ``/metrics``).

    ``faults`` is a queue consumed one per chat request: an int is an HTTP status answered
    with an OpenAI-style error body, ``"hang"`` never answers, ``"garbage"`` answers 200 with
    a body that is not a completion, ``"drop"`` closes the connection without a reply.
    ``reply`` gets each request's decoded body (a dict), as ``requests`` records it, and
    returns the reply's text, or ``(text, [(tool name, arguments JSON text), ...])`` for a
    reply that makes those tool calls. ``statuses`` counts the replies by status (and
    ``"garbage"``); ``in_flight``/``max_in_flight`` the requests not answered yet.
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
        # What /v1/models says the server loaded (vLLM's root): the model's name by default,
        # as vLLM serving a hub id says; None: not reported. max_model_len: as vLLM reports.
        super().__init__(model=model, max_model_len=max_model_len,
                         root=model if root == "" else root, metrics=False)
        self.latency_s = latency_s
        self.reply = reply or (lambda body: "Thought: ok\nAction: wait()")
        self.healthy = healthy
        self.faults: list[int | str] = []
        self.requests: list[dict[str, Any]] = []
        self.headers: list[dict[str, str]] = []
        self.statuses: Counter[int | str] = Counter()

    def answer(self, call: ChatCall) -> Completion | HttpReply:
        body = call.json
        self.requests.append(body)
        self.headers.append(call.headers)
        fault = self.faults.pop(0) if self.faults else None
        delay_s = self.latency_s + (_HANG_S if fault == "hang" else 0.0)
        if isinstance(fault, int):
            self.statuses[fault] += 1
            return json_reply(error_body(fault, f"fault {fault}"), fault, delay_s=delay_s)
        if fault == "garbage":
            self.statuses["garbage"] += 1
            return json_reply({"unexpected": True}, delay_s=delay_s)
        if fault == "drop":
            return HttpReply(200, b"", delay_s=delay_s, drop=True)
        try:
            chat = call.request
        except ValueError:
            self.statuses[400] += 1
            raise  # answered 400 with its message
        self.statuses[200] += 1
        reply = self.reply(body)
        text, tool_calls = (reply, []) if isinstance(reply, str) else reply
        words = text.split()
        return Completion(
            text, tool_calls=tool_calls, completion_id="chatcmpl-fake",
            prompt_tokens=_PROMPT_TOKENS, completion_tokens=len(words),
            token_ids=list(range(len(words))) if chat.return_token_ids else None,
            prompt_token_ids=list(range(_PROMPT_TOKENS)) if chat.return_token_ids else None,
            logprobs=[(w, -0.5) for w in words] if chat.logprobs else None,
            delay_s=delay_s)
