"""One OpenAI-compatible chat server as vLLM answers it, with the reply left to a policy: the
routes (``/v1/chat/completions``, ``/v1/models``, ``/health``, ``/metrics``), the request and
reply bodies of ``openai_protocol``, vLLM's figures, uvicorn in a thread (``ThreadedServer``).

Whatever stands in for a model server is one of these: the scripted policy (the demo), the
tests' fake with its faults, the benchmarks' simulated servers with their latency model.
``OpenAIServer.handle(method, path, body)`` answers a request from its bytes, so a transport
of its own (the sim's hand-written HTTP) serves it as well as the ASGI adapter here does.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, NamedTuple

from cua_rollout.core.http import ThreadedServer
from cua_rollout.model.openai_protocol import (
    CHAT_COMPLETIONS_PATH,
    HEALTH_PATH,
    MODELS_PATH,
    ChatRequest,
    completion_json,
    error_body,
    models_body,
    parse_chat_request,
)
from cua_rollout.model.server_metrics import vllm_metrics_text

__all__ = [
    "METRICS_PATH",
    "ChatCall",
    "ChatPolicy",
    "Completion",
    "HttpReply",
    "OpenAIServer",
    "json_reply",
]

METRICS_PATH = "/metrics"  # vLLM's Prometheus figures, at the server's root

_CHAT = CHAT_COMPLETIONS_PATH.encode()
_MODELS = MODELS_PATH.encode()
_HEALTH = HEALTH_PATH.encode()
_METRICS = METRICS_PATH.encode()
_NOT_FOUND_BODY = b'{"error": "not found"}'


class HttpReply(NamedTuple):
    """A reply as a transport writes it: sent ``delay_s`` after the request, then ``done()``
    (also when the client went away meanwhile); ``drop`` closes the connection instead of
    answering (a fault a test asks for)."""

    status: int
    body: bytes
    content_type: bytes = b"application/json"
    delay_s: float = 0.0
    done: Callable[[], None] | None = None
    drop: bool = False


def json_reply(obj: Any, status: int = 200, **fields: Any) -> HttpReply:
    """``obj`` as a JSON reply with HTTP ``status`` (``fields``: those of ``HttpReply``)."""
    return HttpReply(status, json.dumps(obj).encode(), **fields)


@dataclass
class ChatCall:
    """One chat request as a policy sees it: the raw body (the sim reads its bytes, never
    decoding a 3 MB request), decoded and validated on first use; the request's headers
    when the transport gives them."""

    body: bytes | bytearray
    headers: dict[str, str] = field(default_factory=dict)

    @cached_property
    def json(self) -> Any:
        """The decoded body; ``ValueError`` (a 400 reply) when it is not JSON."""
        try:
            return json.loads(self.body)
        except ValueError:
            raise ValueError("the request body is not JSON") from None

    @cached_property
    def request(self) -> ChatRequest:
        """The validated request; ``ValueError`` (a 400 reply) naming what is wrong."""
        return parse_chat_request(self.json)


@dataclass(frozen=True)
class Completion:
    """A policy's answer: the completion's text and tool calls (name, arguments JSON text),
    its usage (``completion_tokens`` None: the text's words) and what vLLM adds when asked
    (logprobs, token ids), and ``delay_s``, the generation time the reply waits for."""

    text: str
    tool_calls: Sequence[tuple[str, str]] = ()
    prompt_tokens: int = 0
    completion_tokens: int | None = None
    cached_tokens: int | None = None
    completion_id: str | None = None
    logprobs: Sequence[tuple[str, float]] | None = None
    token_ids: list[int] | None = None
    prompt_token_ids: list[int] | None = None
    delay_s: float = 0.0

    @property
    def tokens(self) -> int:
        """The completion's tokens: as given, else its text's words."""
        if self.completion_tokens is None:
            return len(self.text.split())
        return self.completion_tokens


# What answers a chat request: a completion, or any reply of its own (an error, a fault);
# a ValueError it raises is answered 400 with its message.
ChatPolicy = Callable[[ChatCall], Completion | HttpReply]


class OpenAIServer(ThreadedServer):
    """An OpenAI-compatible server whose chat replies come from ``policy`` (or a subclass's
    ``answer``). ``/v1/models`` lists ``model`` (with ``owned_by``, ``max_model_len`` and
    vLLM's ``root`` when set); ``/health`` answers 200 while ``healthy``, else 503;
    ``/metrics`` (unless ``metrics`` is false) gives vLLM's figures, requests beyond
    ``capacity`` counted as waiting. ``in_flight`` and ``max_in_flight`` count chat requests
    not yet answered, faults included. ``start()``/``stop()``/``url`` serve it from a thread
    (port 0: a free one); ``handle`` answers a request from its bytes for other transports."""

    def __init__(
        self,
        policy: ChatPolicy | None = None,
        *,
        model: str,
        owned_by: str | None = None,
        max_model_len: int | None = None,
        root: str | None = None,
        capacity: int | None = None,
        metrics: bool = True,
        host: str = "127.0.0.1",
        port: int = 0,
    ) -> None:
        super().__init__(self, host=host, port=port)
        if policy is None and type(self).answer is OpenAIServer.answer:
            raise TypeError(f"{type(self).__name__} needs a policy or its own answer()")
        self.policy = policy
        self.model = model
        self.owned_by = owned_by
        self.max_model_len = max_model_len
        self.root = root
        self.capacity = capacity
        self.metrics = metrics
        self.healthy = True
        self.in_flight = 0
        self.max_in_flight = 0
        # vLLM's counters: never reset (Prometheus counters only go up).
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        self.requests_finished_total = 0
        self.inference_s_total = 0.0

    def answer(self, call: ChatCall) -> Completion | HttpReply:
        """The reply to one chat request: ``policy``'s, unless a subclass says otherwise."""
        assert self.policy is not None  # checked when the server was made
        return self.policy(call)

    # ----------------------------------------------------------------- requests

    def handle(self, method: bytes, path: bytes, body: bytes | bytearray,
               headers: dict[str, str] | None = None) -> HttpReply:
        """The reply to one request, from its method, path (no query) and body."""
        if path == _CHAT and method == b"POST":
            return self._chat(ChatCall(body, headers or {}))
        if path == _HEALTH:
            return HttpReply(200 if self.healthy else 503, b"", b"text/plain")
        if path == _MODELS:
            extra = {k: v for k, v in (("max_model_len", self.max_model_len),
                                       ("root", self.root)) if v is not None}
            return json_reply(models_body(self.model, owned_by=self.owned_by, **extra))
        if path == _METRICS and self.metrics:
            return HttpReply(200, self.metrics_text().encode(), b"text/plain; version=0.0.4")
        return HttpReply(404, _NOT_FOUND_BODY)

    def _chat(self, call: ChatCall) -> HttpReply:
        started = time.monotonic()
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            answer = self.answer(call)
        except ValueError as exc:
            answer = json_reply(error_body(400, str(exc)), 400)
        except BaseException:
            self.in_flight -= 1
            raise
        if isinstance(answer, HttpReply):
            return answer._replace(done=self._ended(answer.done))
        tokens = answer.tokens
        self.prompt_tokens_total += answer.prompt_tokens
        self.generation_tokens_total += tokens
        # The model's time: choosing the reply, then the generation time it waits for.
        inference_s = time.monotonic() - started + answer.delay_s
        body = completion_json(
            answer.text, model=self.model, completion_id=answer.completion_id,
            prompt_tokens=answer.prompt_tokens, completion_tokens=tokens,
            cached_tokens=answer.cached_tokens, logprobs=answer.logprobs,
            token_ids=answer.token_ids, prompt_token_ids=answer.prompt_token_ids,
            tool_calls=answer.tool_calls or None)
        return HttpReply(200, body, delay_s=answer.delay_s,
                         done=self._ended(None, inference_s))

    def _ended(self, then: Callable[[], None] | None,
               inference_s: float | None = None) -> Callable[[], None]:
        def done() -> None:
            self.in_flight -= 1
            if inference_s is not None:  # a completion, not an error or a fault
                self.requests_finished_total += 1
                self.inference_s_total += inference_s
            if then is not None:
                then()

        return done

    def metrics_text(self) -> str:
        """vLLM's ``/metrics`` of this server: no queue time (nothing queues here), each
        request's model time as its inference time."""
        running = self.in_flight if self.capacity is None else min(self.in_flight,
                                                                   self.capacity)
        finished = self.requests_finished_total
        return vllm_metrics_text(
            model_name=self.model, running=running, waiting=self.in_flight - running,
            prompt_tokens_total=self.prompt_tokens_total,
            generation_tokens_total=self.generation_tokens_total,
            requests_finished_total=finished, queue_time_s=(0.0, finished),
            inference_time_s=(self.inference_s_total, finished))

    # ----------------------------------------------------------------- ASGI

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        """The ASGI app uvicorn serves (``start()``, or ``uvicorn.run(server)``)."""
        if scope["type"] != "http":
            return
        body = bytearray()
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        headers: dict[str, str] = {}
        for name, value in scope["headers"]:
            headers.setdefault(name.decode("latin-1"), value.decode("latin-1"))
        reply = self.handle(scope["method"].encode(), scope["path"].encode(), body, headers)
        try:
            if reply.delay_s > 0:
                await asyncio.sleep(reply.delay_s)
        finally:
            if reply.done is not None:
                reply.done()
        await send({"type": "http.response.start", "status": reply.status,
                    "headers": [(b"content-type", reply.content_type),
                                (b"content-length", str(len(reply.body)).encode())]})
        if reply.drop:
            # The head is out, the body never follows: uvicorn closes the connection when
            # the app fails after the reply started, and the client reads a cut reply.
            raise ConnectionResetError("reply dropped on purpose")
        await send({"type": "http.response.body", "body": reply.body})
